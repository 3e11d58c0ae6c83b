"""Disaggregated prefill/decode (mixserve/disaggregated.py) on this machine: what the seed's split
of KV formats does to the tokens, and what handing the pages over costs. Not a timed test.

    python experiments/disaggregated.py [--out experiments/results/disaggregated.md] [--repeats 10]

1. Where prefill's KV lives. BF16 tiny models; prompts span several prefill chunks, so later
   chunks attend to earlier ones through the pool. Against one engine with BF16 KV (the
   reference), greedy-token agreement of: one engine with FP8 KV (prefill and decode read FP8
   pages), the seed's pair (prefill over a BF16 pool, pages converted to FP8 on hand-over, decode
   over FP8), and a pair with FP8 on both sides (a control: it must equal the one FP8 engine).
2. The hand-over. Bytes sent per prompt token into an FP8 decode pool and into a BF16 one
   (counted), the hand-over's share of the pair's time, and end-to-end tokens/s of the pair
   against one engine on the same requests (interleaved runs; CPU, both engines share its cores:
   relative numbers only).
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import time

import numpy as np

from experiments.fp8_kv_agreement import token_agreement
from experiments.report import publish
import mixserve
from mixserve.disaggregated import DisaggregatedEngine
from mixserve.engine import Engine

# Every prefill chunk 32 tokens long and every decode step max_batch rows: fewer shapes to compile.
COMMON = dict(page_size=16, num_pages=256, prefill_chunk=32, min_prefill_tokens=32, stop_tokens=())
MODELS = ("tiny-kimi", "tiny-glm4", "tiny-glm5")


def long_prompts(n: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(0, 256, rng.integers(lo, hi))] for _ in range(n)]


def one(model, kv: str, batch: int) -> Engine:
    return Engine(model, kv_dtype=kv, max_batch=batch, min_decode_rows=batch, **COMMON)


def pair(model, prefill_kv: str, decode_kv: str, batch: int) -> DisaggregatedEngine:
    return DisaggregatedEngine(Engine(model, kv_dtype=prefill_kv, max_batch=batch, prefill_only=True, **COMMON),
                               Engine(model, kv_dtype=decode_kv, max_batch=batch, min_decode_rows=batch, **COMMON))


def format_table(models, prompts: int, new: int, lo: int, hi: int) -> list[str]:
    rows = ["| model | serving | first token agrees | all positions agree | mean common prefix |", "|---|---|---|---|---|"]
    ps = long_prompts(prompts, lo, hi, seed=0)
    for name in models:
        model = mixserve.load(name, dtype="bfloat16")
        ref = one(model, "bfloat16", prompts).generate(ps, max_new_tokens=new)
        runs = {"one engine, FP8 KV": one(model, "fp8_e4m3", prompts),
                "pair: BF16 prefill KV -> FP8 decode KV (the seed)": pair(model, "bfloat16", "fp8_e4m3", prompts),
                "pair: FP8 -> FP8 (control)": pair(model, "fp8_e4m3", "fp8_e4m3", prompts)}
        results = {label: engine.generate(ps, max_new_tokens=new) for label, engine in runs.items()}
        control = [r.tokens for r in results["pair: FP8 -> FP8 (control)"]]
        if control != [r.tokens for r in results["one engine, FP8 KV"]]:
            raise SystemExit(f"{name}: the FP8 -> FP8 pair's tokens differ from one FP8 engine's: a hand-over bug")
        for label, got in results.items():
            first, pos, prefix = token_agreement(ref, got, new)
            rows.append(f"| {name} | {label} | {first:.2f} | {pos:.2f} | {prefix:.1f} / {new} |")
    return rows


def handover_table(requests: int, prompt_len: int, new: int, repeats: int) -> list[str]:
    model = mixserve.load("tiny-kimi", dtype="bfloat16")
    rows = ["| decode KV | bytes sent per prompt token | hand-over share of the pair's time (median) | "
            "pair tok/s (median) | one engine tok/s | pair / one (median of ratios) |", "|---|---|---|---|---|---|"]
    for decode_kv in ("fp8_e4m3", "bfloat16"):
        engines = {"pair": pair(model, "bfloat16", decode_kv, requests), "one": one(model, decode_kv, requests)}
        for e in engines.values():  # warm-up: compile every shape the runs use
            e.generate(long_prompts(requests, prompt_len, prompt_len + 1, 99), max_new_tokens=new)
        rates, share, per_token = {"pair": [], "one": []}, [], []
        for r in range(repeats):
            ps = long_prompts(requests, prompt_len, prompt_len + 1, r)
            for name, e in engines.items():
                before = (e.counters.handover_s, e.counters.bytes_sent) if name == "pair" else None
                t0 = time.perf_counter()
                out = e.generate(ps, max_new_tokens=new)
                wall = time.perf_counter() - t0
                rates[name].append(sum(len(x.tokens) for x in out) / wall)
                if before:
                    share.append((e.counters.handover_s - before[0]) / wall)
                    per_token.append((e.counters.bytes_sent - before[1]) / (requests * prompt_len))
        ratio = statistics.median(p / o for p, o in zip(rates["pair"], rates["one"]))
        rows.append(f"| {decode_kv} | {statistics.median(per_token):.1f} | {100 * statistics.median(share):.1f}% | "
                    f"{statistics.median(rates['pair']):.1f} | {statistics.median(rates['one']):.1f} | {ratio:.2f}x |")
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--prompt-range", type=int, nargs=2, default=(64, 192), help="prompt lengths drawn from [lo, hi)")
    p.add_argument("--models", nargs="+", default=MODELS, choices=MODELS)
    p.add_argument("--handover-requests", type=int, default=8)
    p.add_argument("--handover-prompt", type=int, default=96)
    args = p.parse_args(argv)
    lo, hi = args.prompt_range
    lines = [f"# Disaggregated prefill/decode ({datetime.date.today()}, CPU, XLA path)", "",
             "## 1. Where prefill's KV lives", "",
             f"{args.prompts} prompts of {lo}-{hi - 1} tokens (prefill chunks of 32: later chunks attend to earlier ones "
             f"through the pool), {args.new_tokens} greedy tokens, BF16 weights, per-tensor scale 1.0. Reference: one "
             "engine with BF16 KV. Random models have flat logits: one flip changes the rest of a sequence, so compare "
             "rows, not against a trained model's agreement.", "", *format_table(args.models, args.prompts, args.new_tokens, lo, hi), "",
             "The FP8 -> FP8 pair's tokens equal the one FP8 engine's (checked: the script stops otherwise).", "",
             "## 2. The hand-over", "",
             f"tiny-kimi (BF16 weights), prefill KV BF16, {args.handover_requests} requests of {args.handover_prompt} "
             f"prompt tokens, {args.new_tokens} new tokens, "
             f"{args.repeats} interleaved runs after a warm-up. Both engines run on the same CPU cores in one loop, "
             "taking turns: the pair's time includes both.", "",
             *handover_table(args.handover_requests, args.handover_prompt, args.new_tokens, args.repeats)]
    publish(lines, args.out)


if __name__ == "__main__":
    main()
