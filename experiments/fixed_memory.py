"""Throughput at a fixed KV memory budget, BF16 against FP8 KV, by concurrency: the seed's Kimi
K2.6 table (same memory: BF16 tops out at 32 concurrent requests, FP8 serves 64, +41% peak).

    python experiments/fixed_memory.py [--out experiments/results/fixed_memory.md] [--repeats 5]

The budget holds `--fit` whole requests (prompt + generated tokens) in BF16, so twice as many in
FP8. Each concurrency runs a closed loop (each client sends its next request when its last one
finishes) on a BF16-KV and an FP8-KV engine with that budget and as many slots as clients, runs
interleaved. Past what its pool holds, an engine admits fewer requests and preempts (recomputing
later) instead of failing as the seed's BF16 server did (OOM): the table reports how many requests
each decode step really ran and how many preemptions a run had. CPU, XLA path, tiny-kimi: where
the seed's GPU is bound by memory bandwidth, this machine is bound by compute, so only the shape
of the result carries over, not its size.
"""

from __future__ import annotations

import argparse
import datetime
import statistics

from experiments.report import publish
from experiments.serving import closed_loop
import mixserve
from mixserve.engine import Engine
from mixserve.kv_cache import bytes_per_token, kv_format

SEED_KIMI = {1: (137, 125), 16: (1106, 1028), 32: (1558, 1489), 64: (None, 2192)}  # tok/s BF16, FP8 KV


def budget_for(model, fit: int, tokens_per_request: int, page_size: int) -> int:
    """KV bytes that hold `fit` requests of tokens_per_request tokens in BF16, in whole pages."""
    pages = fit * -(-tokens_per_request // page_size)
    return pages * page_size * bytes_per_token(model.config, kv_format("bfloat16", None))


def fixed_memory_table(model, concurrencies, fit: int, prompt_len: int, new_tokens: int, repeats: int,
                       page_size: int = 16) -> list[str]:
    budget = budget_for(model, fit, prompt_len + new_tokens, page_size)
    rows = [f"KV budget {budget:,} bytes: {fit} requests of {prompt_len} + {new_tokens} tokens in BF16, "
            f"{2 * fit} in FP8 (pages of {page_size}).", "",
            "| concurrency | BF16 KV tok/s (median) | requests per decode step | preemptions per run | "
            "FP8 KV tok/s | requests per decode step | preemptions per run | FP8 / BF16 (median of ratios) |",
            "|---|---|---|---|---|---|---|---|"]
    peaks = {"bfloat16": 0.0, "fp8_e4m3": 0.0}
    for c in concurrencies:
        engines = {kv: Engine(model, kv_dtype=kv, kv_memory_bytes=budget, page_size=page_size, max_batch=c,
                              stop_tokens=()) for kv in peaks}
        for e in engines.values():  # warm-up: compile the shapes the runs use
            closed_loop(e, c, 2 * c, prompt_len, new_tokens, 99)
        rates, per_step, preempted = ({kv: [] for kv in engines} for _ in range(3))
        for r in range(repeats):
            for kv in (list(engines) if r % 2 == 0 else list(engines)[::-1]):
                e = engines[kv]
                steps, tokens, pre = e.counters.steps, e.counters.decode_tokens, e.counters.preemptions
                rates[kv].append(closed_loop(e, c, 2 * c, prompt_len, new_tokens, r)[0])
                per_step[kv].append((e.counters.decode_tokens - tokens) / (e.counters.steps - steps))
                preempted[kv].append(e.counters.preemptions - pre)
        cells = []
        for kv in engines:
            peaks[kv] = max(peaks[kv], statistics.median(rates[kv]))
            cells += [f"{statistics.median(rates[kv]):.1f}", f"{statistics.median(per_step[kv]):.1f}",
                      f"{statistics.median(preempted[kv]):g}"]
        ratio = statistics.median(f / b for f, b in zip(rates["fp8_e4m3"], rates["bfloat16"]))
        rows.append(f"| {c} | {' | '.join(cells)} | {ratio:.2f}x |")
    seed_bf16, seed_fp8 = max(v[0] for v in SEED_KIMI.values() if v[0]), max(v[1] for v in SEED_KIMI.values())
    rows += ["", f"Peak (the best concurrency's median): FP8 / BF16 = {peaks['fp8_e4m3'] / peaks['bfloat16']:.2f}x here; "
             f"the seed's Kimi K2.6 on H200: {seed_fp8:,} / {seed_bf16:,} tok/s = {seed_fp8 / seed_bf16:.2f}x."]
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out")
    p.add_argument("--model", default="tiny-kimi")
    p.add_argument("--fit", type=int, default=8, help="requests the budget holds in BF16")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8, 16])
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    model = mixserve.load(args.model, dtype="bfloat16")
    publish([f"# Throughput at a fixed KV memory budget ({args.model}, BF16 weights, {datetime.date.today()}, CPU)", "",
             f"Closed loop, 2 x concurrency requests per run, {args.repeats} interleaved runs per engine after a warm-up.",
             "", *fixed_memory_table(model, args.concurrency, args.fit, args.prompt_len, args.new_tokens, args.repeats), "",
             "CPU times on a shared 2-core machine: compare within a row; absolute rates are not GPU rates."], args.out)


if __name__ == "__main__":
    main()
