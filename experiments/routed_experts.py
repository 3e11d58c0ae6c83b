"""What returning the routed experts costs (Engine(return_routed_experts=True), for routing replay),
and what GLM-5's DSA indexer top-k adds (return_indexer_topk, for indexer replay).

    python experiments/routed_experts.py [--out experiments/results/routed_experts.md] [--repeats 21]

Three tables:
  bytes     per token, for the full presets: the routing rows (int16, a K-expert row per MoE layer;
            GLM-5 also the indexer rows, int32, index_topk positions per indexer layer) against the
            KV cache's bytes (BF16 and FP8), and per decode step of 64 requests the rows read back
            from the device. The rows are the prefix cache's host-side companion too:
            a cached page keeps its tokens' rows in host memory.
  time      one engine serving the same closed batch with the flag off and on, in interleaved rounds
            (a tiny model on this CPU, so the per-step host work of reading and keeping the rows is
            as large a share of a step as it can be): decode steps' median time and the paired ratio.
  replay    what the rows are for (R3): a float32 trainer scoring the rollouts of an engine serving a
            BF16 copy of its weights with an FP8 e4m3 KV cache (scale 1), sampled at temperature 1,
            by one cache-free forward over prompt + output[:-1] (Model.logits), free (its router
            picks) and replayed (each token sent to the rollout's experts, weighted by the trainer's
            own router). Per model: the routing decisions (position x MoE layer) whose expert set
            differs between the trainer's free forward and the rollout (replayed: none, by
            construction), and |trainer - engine| log-probability of each sampled token, free and
            replayed (mean, 99th percentile, largest), also over the tokens a differing decision
            reaches (its position or any before it: a flip changes every later position through
            attention). A model with a DSA indexer (GLM-5) is scored a third time with the rollout's
            indexer top-k replayed too (each token attending to the positions the rollout's indexer
            chose), and its indexer choices (position x indexer layer) that differ are counted.
            Random tiny models: the mechanism, not a real model's rates.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import statistics

import jax
import jax.numpy as jnp
import numpy as np

from experiments.report import interleaved, publish
import mixserve
from mixserve.engine import Engine
from mixserve.kv_cache import bytes_per_token, kv_format
from models.attention import sown_indexer_topk
from models.moe import sown_routes
from models.presets import FULL_PRESETS

STEP_ROWS = 64  # requests in the decode step the bytes table reads rows back for


def routes_bytes(cfg) -> int:
    """Bytes of one position's routing: a row of top-k int16 expert ids per MoE layer."""
    return 2 * cfg.num_experts_per_tok * len(cfg.moe_layers)


def bytes_table() -> list[str]:
    rows = ["| model | rows | layers x top-k | bytes / token | BF16 KV bytes / token | share | FP8 KV "
            f"bytes / token | share | read back per decode step of {STEP_ROWS} (KiB) |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name in ("kimi-k2", "glm-4.5", "glm-4.5-air", "glm-5"):  # K2.6, GLM-4.6 and 4.7 differ in context only
        cfg = FULL_PRESETS[name]
        bf16, fp8 = (bytes_per_token(cfg, kv_format(dtype, "bfloat16")) for dtype in ("bfloat16", "fp8_e4m3"))
        kinds = [("routed experts", len(cfg.moe_layers), cfg.num_experts_per_tok,
                  routes_bytes(cfg))]
        if cfg.indexer_layers:  # int32 positions: a context past 32k tokens does not fit int16
            kinds.append(("indexer top-k", len(cfg.indexer_layers), cfg.index_topk,
                          4 * len(cfg.indexer_layers) * cfg.index_topk))
        for kind, layers, k, size in kinds:
            rows.append(f"| {name} | {kind} | {layers} x {k} | {size:,} | {bf16:,} | {100 * size / bf16:.2f}% | "
                        f"{fp8:,} | {100 * size / fp8:.2f}% | {STEP_ROWS * size / 1024:,.1f} |")
    return rows


def time_table(model_name: str, batch: int, prompt_len: int, new_tokens: int, repeats: int) -> list[str]:
    model = mixserve.load(model_name, dtype="bfloat16")
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(0, 256, prompt_len)] for _ in range(batch)]
    args = dict(num_pages=batch * -(-(prompt_len + new_tokens) // 16), page_size=16, max_batch=batch,
                stop_tokens=(), min_decode_rows=batch)
    engines = {flag: Engine(model, return_routed_experts=flag, **args) for flag in (False, True)}
    for e in engines.values():  # warm: every shape compiled
        e.generate(prompts, max_new_tokens=new_tokens)

    def serve(engine: Engine, r: int) -> dict:
        engine.reset_prefix_cache()  # each round prefills its prompts anew
        before = len(engine.counters.decode_step_s)
        results = engine.generate(prompts, max_new_tokens=new_tokens, temperature=1.0, seed=r)
        assert all(res.status == "ok" for res in results)
        rows = sum(0 if res.routed_experts is None else len(res.routed_experts) for res in results)
        return {"step": statistics.median(engine.counters.decode_step_s[before:]), "rows": rows}

    runs = interleaved(engines, repeats, serve)
    off, on = runs[False], runs[True]
    ratios = [b["step"] / a["step"] for a, b in zip(off, on)]
    return [f"{model_name} (BF16, {routes_bytes(model.config)} routing bytes per position), {batch} requests of "
            f"{prompt_len} prompt and {new_tokens} sampled tokens per round, {repeats} rounds after a warm-up, "
            "the flag's two engines interleaved.", "",
            "| return_routed_experts | decode step, median of the rounds' medians (ms) | rows returned per round |",
            "|---|---:|---:|",
            f"| off | {1e3 * statistics.median(r['step'] for r in off):.2f} | {off[0]['rows']} |",
            f"| on | {1e3 * statistics.median(r['step'] for r in on):.2f} | {on[0]['rows']} |", "",
            f"On / off decode step time, median of the paired rounds' ratios: {statistics.median(ratios):.3f} "
            f"(the rounds' ratios from {min(ratios):.3f} to {max(ratios):.3f})."]


@functools.partial(jax.jit, static_argnums=0)
def forward(module, params, ids, replay, chosen):
    """The trainer's forward: log-softmax of the logits, the routing it used and (DSA) the
    positions its indexers chose (else None)."""
    logits, state = module.apply({"params": params}, ids, routed_experts=replay, indexer_topk=chosen,
                                 mutable=["intermediates"])
    used = sown_indexer_topk(state["intermediates"], module.cfg) if module.cfg.indexer_layers else None
    return jax.nn.log_softmax(logits, axis=-1), sown_routes(state["intermediates"], module.cfg), used


def trainer_logprobs(model, tokens: list[int], prompt_len: int, routes=None, chosen=None):
    """(log-probability of each output token, the forward's routing int [positions, L, K], its
    indexer choices int [positions, L, index_topk] or None) of the cache-free forward over
    tokens[:-1], its routing and indexer choices replayed from `routes` and `chosen` if given."""
    ids = np.asarray([tokens[:-1]], np.int32)
    replay = None if routes is None else model.replayed(routes[None], ids.shape)
    chosen = None if chosen is None else model.replayed_indexer_topk(chosen[None], ids.shape)
    logprobs, used, used_chosen = forward(model.module, model.params, ids, replay, chosen)
    out = tokens[prompt_len:]
    return (np.asarray(logprobs)[0, prompt_len - 1:][np.arange(len(out)), out], np.asarray(used)[0],
            None if used_chosen is None else np.asarray(used_chosen)[0])


def stats(diffs: np.ndarray) -> str:
    if diffs.size == 0:
        return "- | - | -"
    return f"{diffs.mean():.2e} | {np.percentile(diffs, 99):.2e} | {diffs.max():.2e}"


def replay_rows(preset: str, rollouts: int, prompt_len: int, new_tokens: int) -> list[str]:
    trainer = mixserve.load(preset, dtype="float32")
    served = dataclasses.replace(mixserve.load(preset, dtype="bfloat16"),
                                 params=jax.tree.map(lambda x: x.astype(jnp.bfloat16), trainer.params))
    dsa = bool(trainer.config.indexer_layers)
    engine = Engine(served, kv_dtype="fp8_e4m3", num_pages=rollouts * -(-(prompt_len + new_tokens) // 16),
                    page_size=16, max_batch=rollouts, stop_tokens=(), return_routed_experts=True,
                    return_indexer_topk=dsa)
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(0, 256, prompt_len)] for _ in range(rollouts)]
    results = engine.generate(prompts, max_new_tokens=new_tokens, temperature=1.0, seed=0, logprobs=0)
    # each trainer forward: what it replays from the rollout (routing, indexer choices)
    modes = {"free": (False, False), "replayed": (True, False)} | ({"replayed, indexer too": (True, True)} if dsa else {})
    flipped = {m: np.zeros(2, int) for m in modes}  # its routing and indexer decisions that differ from the rollout's
    decisions = np.zeros(2, int)
    gaps, gaps_hit = {m: [] for m in modes}, {m: [] for m in modes}
    for prompt, r in zip(prompts, results):
        assert r.status == "ok", r.reason
        engine_lp = np.array([lp.logprob for lp in r.logprobs])
        tokens = prompt + r.tokens
        reached = None
        for m, (routes, chosen) in modes.items():
            lp, used_routes, used_chosen = trainer_logprobs(trainer, tokens, prompt_len, r.routed_experts if routes else None,
                                                            r.indexer_topk if chosen else None)
            differs = [(np.sort(used_routes, -1) != np.sort(r.routed_experts, -1)).any(-1)]  # [positions, L]
            if dsa:  # the rows are sets in ascending order: equal sets are equal rows
                differs.append((used_chosen != r.indexer_topk).any(-1))  # [positions, indexer layers]
            assert not (routes and differs[0].any()) and not (chosen and differs[1].any())  # replayed as the rollout
            flipped[m] += [int(d.sum()) for d in differs] + [0] * (2 - len(differs))
            if reached is None:  # the free forward's: a sampled token is scored at position prompt_len - 1 + j,
                decisions += [d.size for d in differs] + [0] * (2 - len(differs))  # and a flip there or before reaches it
                reached = np.maximum.accumulate(np.concatenate(differs, axis=1).any(-1))[prompt_len - 1:]
            gaps[m].append(np.abs(lp - engine_lp))
            gaps_hit[m].append(gaps[m][-1][reached])
    shape, out = f"{rollouts} x ({prompt_len} + {new_tokens})", []
    for m in modes:
        every, hit = np.concatenate(gaps[m]), np.concatenate(gaps_hit[m])
        counts = [f"{n} / {d} ({100 * n / d:.2f}%)" if d else "-" for n, d in zip(flipped[m], decisions)]
        out.append(f"| {preset} | {shape} | {m} | {counts[0]} | {counts[1]} | {stats(every)} | {hit.size} / {every.size} | "
                   f"{stats(hit)} |")
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out")
    p.add_argument("--model", default="tiny-kimi")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=21)
    p.add_argument("--presets", nargs="+", default=["tiny-kimi", "tiny-glm4", "tiny-glm5"], help="the replay table's")
    p.add_argument("--rollouts", nargs="+", default=["16x16+48", "64x6+10"],
                   help="the replay table's rollouts per model, as COUNTxPROMPT+SAMPLED tokens (6 + 10: GLM-5's "
                        "indexer, top-16, keeps every key)")
    args = p.parse_args(argv)
    replay = ["| model | rollouts x (prompt + sampled) | trainer routing | routing decisions that differ from the "
              "rollout's | indexer choices that differ | abs(trainer - engine) logprob: mean | p99 | max | tokens a "
              "differing decision reaches | their abs(diff): mean | p99 | max |",
              "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for shape in args.rollouts:
        count, lengths = shape.split("x")
        prompt_len, new_tokens = map(int, lengths.split("+"))
        for preset in args.presets:
            replay += replay_rows(preset, int(count), prompt_len, new_tokens)
    publish([f"# Routed experts return: its bytes, its time, and routing replay ({datetime.date.today()}, CPU)", "",
             "## Bytes (computed from the configs)", "", *bytes_table(), "",
             "## Time (measured)", "",
             *time_table(args.model, args.batch, args.prompt_len, args.new_tokens, args.repeats), "",
             "CPU times on a shared 2-core machine: compare within the table; absolute times are not GPU times.", "",
             "## Replay (measured)", "",
             "Rollouts of random prompt tokens, sampled at temperature 1 (seed 0); each sampled token's "
             "log-probability as the engine computed it against the trainer's cache-free forward.", "", *replay, "",
             "Replayed, what is left is the BF16 weights' and FP8 KV's own error, the routing weights' included "
             "(replay fixes which experts, not their weights). GLM-5's DSA indexer top-k is a second discrete "
             "choice: replaying the routing alone leaves it free, and 'replayed, indexer too' replays both. An "
             "indexer choice differs when its set of positions does; 'tokens a differing decision reaches' "
             "counts either kind."], args.out)


if __name__ == "__main__":
    main()
