"""Handing a new policy to the engine between RL rollouts: what each way costs.

    python experiments/rl_cycle.py [--out experiments/results/rl_cycle.md] [--repeats 5]

An RL loop samples a batch of rollouts, trains, and samples the next batch from the new weights.
The trainer keeps float32 master weights; the engine serves a BF16 copy of its own. Four ways to
serve the new weights, each round's trainer step (a small perturbation of every weight) the same:
  fresh engine      the old engine dropped before the trainer runs, a new Engine on the new weights
                    after, compiling its steps anew (a restarted server's cost, less the imports, JAX's
                    start and the checkpoint's read);
  update_weights    the running engine takes them between two steps (awake: the old and the new weights
                    are both on the device until it does);
  sleep 2, update   the engine sleeps at level 2 before the trainer runs (its weights discarded, its KV
                    pools freed), takes the new weights, and wakes;
  sleep 1, wake     level 1 around the trainer step (weights to host memory and back), serving the
                    same weights again: the way to lend the device out between rollouts of one policy.
Per way, medians over interleaved rounds: the hand-over (everything between the trainer's step and
the next rollout's submission, the sleep before the step included), the next rollout's median time
to first token and its wall time, the device bytes live arrays hold (each buffer once) after the
trainer's step and after the hand-over, the larger, less those at the round's start (what the
device must fit beyond the loop's steady state), and what sleep freed.

CPU, XLA path: times compare within the table. The host copies of level 1 are host-to-host here;
on a GPU they cross PCIe (or NVLink-C2C) and the fresh engine's compile is a GPU compile.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from experiments.report import interleaved, publish
import mixserve
from mixserve import model_runner
from mixserve.device_memory import live_bytes
from mixserve.engine import Engine

WAYS = ("fresh engine", "update_weights", "sleep 2, update", "sleep 1, wake")


@jax.jit
def trained(master, key):
    """The trainer's step on its float32 master weights: each moved by 1% of its spread, with noise."""
    leaves, tree = jax.tree.flatten(master)
    keys = jax.random.split(key, len(leaves))
    return jax.tree.unflatten(tree, [x + 0.01 * x.std() * jax.random.normal(k, x.shape, x.dtype)
                                     for x, k in zip(leaves, keys)])


@functools.partial(jax.jit, static_argnums=1)
def cast(master, dtype):
    """What the engine serves: the master weights in the serving dtype (arrays of their own)."""
    return jax.tree.map(lambda x: x.astype(dtype), master)


@dataclasses.dataclass
class Loop:
    """One way's RL loop: the trainer's master weights, and the engine serving a copy of them."""
    way: str
    model: mixserve.Model  # the served model: its dtype, config and plan
    master: object  # float32 params, the trainer's
    engine_args: dict
    engine: Engine | None = None

    def served(self) -> mixserve.Model:
        return dataclasses.replace(self.model, params=cast(self.master, self.model.dtype))


def cold_caches() -> None:
    """A new engine compiles its steps and pool makers anew (its own jitted functions); the other
    loops' engines keep theirs."""
    model_runner.steps_for.cache_clear()
    model_runner._pool_maker.cache_clear()


def round_of(loop: Loop, prompts: list[list[int]], new_tokens: int, seed: int) -> dict:
    """Stop or sleep, a trainer step, the hand-over, and the next rollout batch."""
    start, freed = live_bytes(), 0
    t0 = time.perf_counter()
    if loop.way == "fresh engine":
        loop.engine = None  # the old server stopped: its memory back before the trainer runs
    elif loop.way in ("sleep 2, update", "sleep 1, wake"):
        freed = loop.engine.sleep(level=2 if loop.way == "sleep 2, update" else 1)
    stop_s = time.perf_counter() - t0
    served = None
    if loop.way != "sleep 1, wake":  # the trainer's step, and the copy it hands over (not timed)
        loop.master = trained(loop.master, jax.random.key(seed))
        served = jax.block_until_ready(loop.served())
    after_step = live_bytes()
    t0 = time.perf_counter()
    if loop.way == "fresh engine":
        cold_caches()
        loop.engine = Engine(served, **loop.engine_args)
    elif loop.way == "sleep 1, wake":
        loop.engine.wake_up()
    else:
        loop.engine.update_weights(served)
        if loop.way == "sleep 2, update":
            loop.engine.wake_up()
    handover_s = stop_s + time.perf_counter() - t0
    del served  # the engine's alone from here
    after_handover = live_bytes()
    t0 = time.perf_counter()
    results = loop.engine.generate(prompts, max_new_tokens=new_tokens, temperature=1.0, seed=seed)
    return {"handover": handover_s, "ttft": statistics.median(r.ttft_s for r in results),
            "wall": time.perf_counter() - t0, "device": max(after_step, after_handover) - start, "freed": freed}


def cycle_table(model: mixserve.Model, batch: int, prompt_len: int, new_tokens: int, page_size: int,
                repeats: int) -> list[str]:
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(0, 256, prompt_len)] for _ in range(batch)]
    pages = batch * -(-(prompt_len + new_tokens) // page_size)
    args = dict(num_pages=pages, page_size=page_size, max_batch=batch, stop_tokens=())
    loops = {}
    for way in WAYS:
        master = jax.tree.map(lambda x: x.astype(jnp.float32), model.params)
        loops[way] = Loop(way, model, master, args)
        loops[way].engine = Engine(loops[way].served(), **args)
        loops[way].engine.generate(prompts, max_new_tokens=new_tokens, temperature=1.0, seed=99)
        round_of(loops[way], prompts, new_tokens, 98)  # warm: each way's first calls compiled
    runs = interleaved(loops, repeats, lambda loop, r: round_of(loop, prompts, new_tokens, r))

    def median(way: str, field: str) -> float:
        return statistics.median(run[field] for run in runs[way])

    weights = sum(x.nbytes for x in jax.tree.leaves(model.params)) / 2**20
    rows = ["| way | hand-over (ms) | next rollout: TTFT, median (ms) | its wall time (ms) | device MiB beyond the "
            "round's start, at the larger of after the step and after the hand-over | freed by sleep (MiB) |",
            "|---|---:|---:|---:|---:|---:|"]
    for way in WAYS:
        rows.append(f"| {way} | {1e3 * median(way, 'handover'):.1f} | {1e3 * median(way, 'ttft'):.1f} | "
                    f"{1e3 * median(way, 'wall'):.1f} | {median(way, 'device') / 2**20:.2f} | "
                    f"{median(way, 'freed') / 2**20:.2f} |")

    def ratio(way: str, field: str) -> float:
        return statistics.median(a[field] / b[field] for a, b in zip(runs["fresh engine"], runs[way]))

    return [f"{batch} rollouts of {prompt_len} prompt and {new_tokens} sampled tokens per round, one served weight "
            f"set of {weights:.2f} MiB, a pool of {pages} pages of {page_size}; {repeats} rounds per way after one "
            "to warm up, interleaved.", "", *rows, "",
            "Fresh engine / each way, median of the paired rounds' ratios: " + "; ".join(
                f"{way}: hand-over {ratio(way, 'handover'):.1f}x, the next rollout's wall {ratio(way, 'wall'):.0f}x"
                for way in WAYS[1:]) + "."]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out")
    p.add_argument("--model", default="tiny-kimi")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    model = mixserve.load(args.model, dtype="bfloat16")
    publish([f"# The RL loop's weight hand-over ({args.model}, BF16 served from float32 master weights, "
             f"{datetime.date.today()}, CPU)", "",
             *cycle_table(model, args.batch, args.prompt_len, args.new_tokens, args.page_size, args.repeats), "",
             "CPU times on a shared 2-core machine: compare within the table; absolute times are not GPU times."],
            args.out)


if __name__ == "__main__":
    main()
