"""What each logprobs mode costs a decode step's sampling (Engine(logprobs_mode=...), vLLM's flag).

    python experiments/logprobs_mode.py [--batch 64] [--vocab 163840] [--rounds 15] [--out PATH]

The program a decode step samples with (mixserve.model_runner.pick: the sampler, and the
logprobs of the logits the mode names), on random float32 logits of Kimi K2's vocabulary, with every
row asking for 20 logprobs, and without logprobs. Two batches: every row sampled at temperature 1
with top-p 0.95 (the sort runs), and every row greedy. The processed modes read the logits the
sampler drew from, which it computes anyway; the raw ones the model's. Steps in which no row asks
are timed in an engine of each kind too. Variants are timed in
interleaved rounds (experiments/report.py), after a warm-up call each; the table gives each one's
median and its median paired ratio to raw_logprobs. CPU times: ratios, not a GPU's absolute times.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import statistics
import time
import types

import jax
import jax.numpy as jnp

from experiments.report import interleaved, publish
from mixserve.model_runner import LOGPROBS_MODES, pick
from mixserve.sampling import Sampling, first_token_keys

TOP = 20  # vLLM's default max_logprobs
# No row asks for logprobs, in an engine of each kind: a raw engine's program never reads the
# sampler's logits; a processed one's copies the step's logits once all the same (XLA puts the copy
# the slow path's in-place scatters need in front of the sampler's conditional).
NONE = {"no logprobs (raw engine)": "raw_logprobs", "no logprobs (processed engine)": "processed_logprobs"}


def pick_fn(mode: str):
    """The pick step of an engine in `mode` (its logprobs read these two fields of the spec)."""
    return jax.jit(functools.partial(pick, spec=types.SimpleNamespace(max_logprobs=TOP, logprobs_mode=mode)))


def batch_inputs(batch: int, vocab: int, sampled: bool, logprobs: bool, seed: int = 0):
    logits = jax.random.normal(jax.random.key(seed), (batch, vocab), jnp.float32) * 3.0
    s = Sampling.greedy(batch)._replace(logprobs_B=jnp.full(batch, logprobs))
    if sampled:
        s = s._replace(temperature_B=jnp.ones(batch), top_p_B=jnp.full(batch, 0.95),
                       key_ints_B4=jnp.asarray(first_token_keys(seed, batch)))
    return logits, s


def timed_table(batch: int, vocab: int, rounds: int) -> list[str]:
    rows = ["| rows | variant | median ms | / raw_logprobs (median of paired ratios, min - max) |", "|---|---|---:|---|"]
    for sampled in (True, False):
        variants = {name: (pick_fn(mode), batch_inputs(batch, vocab, sampled, False)) for name, mode in NONE.items()}
        variants.update({mode: (pick_fn(mode), batch_inputs(batch, vocab, sampled, True)) for mode in LOGPROBS_MODES})
        for fn, args in variants.values():  # compile, and one warm call
            jax.block_until_ready(fn(*args))

        def run(variant, _round):
            fn, args = variant
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*args))
            return time.perf_counter() - t0

        times = interleaved(variants, rounds, run)
        label = f"{batch} sampled (T=1, top-p 0.95)" if sampled else f"{batch} greedy"
        for name, ts in times.items():
            ratios = [t / r for t, r in zip(ts, times["raw_logprobs"])]
            rows.append(f"| {label} | {name} | {statistics.median(ts) * 1e3:.1f} | {statistics.median(ratios):.3f} "
                        f"({min(ratios):.2f} - {max(ratios):.2f}) |")
    return rows


def main(argv=None) -> str:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--vocab", type=int, default=163_840, help="Kimi K2's vocabulary by default")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--out", default="experiments/results/logprobs_mode.md")
    args = p.parse_args(argv)
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [f"# Logprobs modes: the cost of a decode step's sampling and logprobs, {now}", "",
             f"`python experiments/logprobs_mode.py --batch {args.batch} --vocab {args.vocab} --rounds {args.rounds}`, "
             f"on {jax.devices()[0].device_kind} ({jax.device_count()} device), jax {jax.__version__}: random float32 "
             f"logits [{args.batch}, {args.vocab}], {TOP} logprobs a row. {args.rounds} interleaved rounds.", "",
             *timed_table(args.batch, args.vocab, args.rounds)]
    return publish(lines, args.out)


if __name__ == "__main__":
    main()
