"""Serving measurements on this machine (CPU, XLA path): what FP8 KV and the integrity check cost
and buy. Not a timed test: run it by hand.

    python experiments/serving.py [--out experiments/results/serving.md] [--repeats 5]

1. KV tokens that fit a fixed budget, BF16 against FP8, for the full presets and the tiny ones.
2. The largest concurrency that fits, for a fixed request shape (prompt + generated tokens).
3. Decode throughput by concurrency on a tiny model (CPU: relative numbers only).
4. Integrity-check overhead, as the seed's table: by concurrency, `off` and `check` engines serve
   the same closed-loop workload (each client sends its next request when the last finishes,
   through Engine.submit/step), runs interleaved; the paired median change of end-to-end
   throughput and of p95 request latency, beside the seed's.
5. Attended width: decode throughput with a long context limit when each step attends over the
   page-table bucket its rows need, against attending over the whole table (interleaved).
6. Decode rows: few live requests in an engine of many slots, each step running the live requests
   rounded up to a power of two, against running every slot (interleaved).
7. Prefill chunk length: prompts shorter than prefill_chunk, each chunk as long as its tokens
   rounded up to a power of two, against every chunk padded to prefill_chunk (interleaved).
8. Prefill rows: requests arriving together, prefilled a row each in one call per chunk round,
   against one request per call (interleaved).
9. Chunked prefill: a long prompt arriving while requests decode, one prefill call per step (the
   running requests decode between its chunks) against its whole prefill in one step (interleaved).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import itertools
import statistics
import time

import jax
import numpy as np

from experiments.report import publish
import mixserve
from mixserve import page_table as pt
from mixserve.engine import Engine
from mixserve.kv_cache import bytes_per_token, kv_format
from mixserve.model_runner import prefill_tokens, step_rows
from models.presets import PRESETS

SEED_KIMI_BF16_TOKENS = 686_000  # the seed: Kimi K2.6 KV pool, BF16 -> ~1.37 M tokens in FP8


def capacity_table(budget_bytes: int, page_size: int) -> list[str]:
    rows = ["| preset | KV bytes/token BF16 | FP8 | tokens in budget BF16 | FP8 | ratio |", "|---|---|---|---|---|---|"]
    for name, cfg in PRESETS.items():
        b16, f8 = (bytes_per_token(cfg, kv_format(d, None)) for d in ("bfloat16", "fp8_e4m3"))
        t16, t8 = (budget_bytes // (b * page_size) * page_size for b in (b16, f8))
        rows.append(f"| {name} | {b16:,} | {f8:,} | {t16:,} | {t8:,} | {t8 / t16:.3f} |")
    return rows


def concurrency_table(budget_bytes: int, page_size: int, prompt: int, generated: int) -> list[str]:
    rows = [f"| preset | max concurrent requests of {prompt}+{generated} tokens, BF16 | FP8 |", "|---|---|---|"]
    pages_per_request = -(-(prompt + generated) // page_size)
    for name in ("kimi-k2.6", "glm-4.6", "glm-5"):
        cfg = PRESETS[name]
        counts = [budget_bytes // (bytes_per_token(cfg, kv_format(d, None)) * page_size) // pages_per_request
                  for d in ("bfloat16", "fp8_e4m3")]
        rows.append(f"| {name} | {counts[0]:,} | {counts[1]:,} |")
    return rows


def workload(n: int, prompt_len: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(0, 256, prompt_len)] for _ in range(n)]


def decode_counts(c) -> tuple[int, float]:
    return c.decode_tokens, c.decode_s


def prefill_counts(c) -> tuple[int, float]:
    return c.prefill_tokens, c.prefill_s


def interleaved_rates(engines: dict, requests: int, repeats: int, *, prompt_len: int = 24, new_tokens: int,
                      counts=decode_counts) -> dict:
    """Tokens/s of each engine per repeat (decode or prefill, as `counts` reads the counters), the
    engines taking turns on the same workload."""
    for e in engines.values():  # warm-up: compile prefill and decode
        e.generate(workload(requests, prompt_len, 99), max_new_tokens=min(2, new_tokens))
    rates = {name: [] for name in engines}
    for r in range(repeats):
        for name, e in engines.items():
            tok0, s0 = counts(e.counters)
            e.generate(workload(requests, prompt_len, r), max_new_tokens=new_tokens)
            tok1, s1 = counts(e.counters)
            rates[name].append((tok1 - tok0) / (s1 - s0))
    return rates


def fp8_engines(model, option: str, values: dict, **kw) -> dict:
    """FP8-KV engines that differ only in `option`: {name: Engine(..., option=value)}."""
    return {name: Engine(model, kv_dtype="fp8_e4m3", num_pages=256, page_size=16, stop_tokens=(), **kw,
                         **{option: value}) for name, value in values.items()}


def paired_cells(rates: dict, a: str, b: str) -> str:
    """Table cells: the median rate of a, of b, and the median of the per-repeat ratios a / b."""
    ratios = [x / y for x, y in zip(rates[a], rates[b])]
    return f"{statistics.median(rates[a]):.1f} | {statistics.median(rates[b]):.1f} | {statistics.median(ratios):.2f}x"


def decode_throughput(model, concurrencies, new_tokens: int, repeats: int) -> list[str]:
    rows = ["| concurrency | decode tok/s BF16 KV (median) | FP8 KV | FP8/BF16 |", "|---|---|---|---|"]
    for c in concurrencies:
        engines = {d: Engine(model, kv_dtype=d, num_pages=256, page_size=16, max_batch=c, stop_tokens=())
                   for d in ("bfloat16", "fp8_e4m3")}
        rates = interleaved_rates(engines, c, repeats, new_tokens=new_tokens)
        m16, m8 = statistics.median(rates["bfloat16"]), statistics.median(rates["fp8_e4m3"])
        rows.append(f"| {c} | {m16:.1f} | {m8:.1f} | {m8 / m16:.3f} |")
    return rows


def attended_width(model, concurrency: int, new_tokens: int, repeats: int, limits=(4096, 32768)) -> list[str]:
    """Decode throughput when the context limit is long: each step attends over the power-of-two
    bucket of pages its longest row needs (the default), or over the whole page table
    (min_attended_tokens = the limit: what every step did before the buckets)."""
    rows = ["| context limit | page-table columns | decode tok/s, bucket (median) | whole table | bucket / whole |",
            "|---|---|---|---|---|"]
    for limit in limits:
        long_model = dataclasses.replace(model, config=model.config.replace(max_position_embeddings=limit))
        engines = fp8_engines(long_model, "min_attended_tokens", {"bucket": 256, "whole": limit}, max_batch=concurrency)
        rates = interleaved_rates(engines, concurrency, repeats, new_tokens=new_tokens)
        rows.append(f"| {limit:,} | {engines['bucket'].max_pages_per_seq:,} | {paired_cells(rates, 'bucket', 'whole')} |")
    return rows


def decode_rows_table(model, max_batch: int, live_counts, new_tokens: int, repeats: int) -> list[str]:
    """Decode throughput with `live` requests in an engine of max_batch slots: each step runs the
    live requests rounded up to a power of two (min_decode_rows=1, the default), or every slot
    (min_decode_rows=max_batch: what every step did before)."""
    rows = [f"| live requests (of {max_batch} slots) | rows per step | decode tok/s, live rows (median) | "
            "every slot | live / every |", "|---|---|---|---|---|"]
    for live in live_counts:
        engines = fp8_engines(model, "min_decode_rows", {"live": 1, "every": max_batch}, max_batch=max_batch)
        rates = interleaved_rates(engines, live, repeats, new_tokens=new_tokens)
        rows.append(f"| {live} | {step_rows(live, max_batch, 1)} | {paired_cells(rates, 'live', 'every')} |")
    return rows


def prefill_length_table(model, prefill_chunk: int, prompt_lengths, repeats: int, prompts: int = 4) -> list[str]:
    """Prefill tokens/s of prompts shorter than prefill_chunk: chunks of their length rounded up to
    a power of two (min_prefill_tokens=16, the default), or padded to prefill_chunk (what every
    chunk was before). One new token per request, so the run is prefill only."""
    rows = [f"| prompt tokens | chunk run | prefill tok/s, rounded chunks (median) | padded to {prefill_chunk} | "
            "rounded / padded |", "|---|---|---|---|---|"]
    for length in prompt_lengths:
        engines = fp8_engines(model, "min_prefill_tokens", {"rounded": 16, "padded": prefill_chunk},
                              max_batch=prompts, prefill_chunk=prefill_chunk)
        rates = interleaved_rates(engines, prompts, repeats, prompt_len=length, new_tokens=1, counts=prefill_counts)
        rows.append(f"| {length} | {prefill_tokens(length, prefill_chunk, 16)} | {paired_cells(rates, 'rounded', 'padded')} |")
    return rows


def prefill_rows_table(model, prompts: int, prompt_lengths, repeats: int, prefill_chunk: int = 128) -> list[str]:
    """Prefill tokens/s of `prompts` requests arriving together: one call per chunk round with a row
    each (max_prefill_rows = prompts, the default), or one request per call (max_prefill_rows=1,
    what prefill was before). One new token per request, so the run is prefill only."""
    rows = ["| prompt tokens | calls, together | one at a time | prefill tok/s, together (median) | one at a time | "
            "together / one at a time |", "|---|---|---|---|---|---|"]
    for length in prompt_lengths:
        engines = fp8_engines(model, "max_prefill_rows", {"together": prompts, "alone": 1}, max_batch=prompts,
                              prefill_chunk=prefill_chunk)
        rates = interleaved_rates(engines, prompts, repeats, prompt_len=length, new_tokens=1, counts=prefill_counts)
        calls = -(-length // prefill_chunk)
        rows.append(f"| {length} | {calls} | {calls * prompts} | {paired_cells(rates, 'together', 'alone')} |")
    return rows


def arrival_during_decode(engine, running: int, long_prompt: int, new_tokens: int, seed: int):
    """`running` requests (24-token prompts) decode; after two steps a `long_prompt`-token request
    arrives. Returns (the running requests' token gaps, the long request's time to first token,
    generated tokens per wall-clock second)."""
    prompts = workload(running + 1, 24, seed)
    prompts[-1] = workload(1, long_prompt, seed + 1000)[0]
    t0 = time.perf_counter()
    rids = [engine.submit(p, max_new_tokens=new_tokens) for p in prompts[:running]]
    results, steps = {}, 0
    while steps <= 2 or engine.has_work():
        if steps == 2:
            late = engine.submit(prompts[-1], max_new_tokens=8)
        results.update({u.rid: u.result for u in engine.step() if u.result is not None})
        steps += 1
    wall = time.perf_counter() - t0
    assert all(r.status == "ok" for r in results.values())
    gaps = [g for rid in rids for g in results[rid].token_latencies_s]
    return gaps, results[late].ttft_s, sum(len(r.tokens) for r in results.values()) / wall


def chunked_prefill_table(model, running: int, long_prompt: int, prefill_chunk: int, new_tokens: int,
                          repeats: int) -> list[str]:
    """A long prompt arriving while requests decode: one prefill call per step (the default), or
    its whole prefill in the step that admits it (prefill_calls_per_step=None)."""
    variants = {"1": 1, "None": None}
    engines = fp8_engines(model, "prefill_calls_per_step", variants, max_batch=running + 1, prefill_chunk=prefill_chunk)
    for e in engines.values():  # warm-up: compile every shape the runs use
        arrival_during_decode(e, running, long_prompt, new_tokens, 99)
    runs = {m: [] for m in engines}
    for r in range(repeats):
        for m in (list(variants) if r % 2 == 0 else list(variants)[::-1]):
            runs[m].append(arrival_during_decode(engines[m], running, long_prompt, new_tokens, r))
    rows = ["| prefill calls per step | running requests' longest token gap ms (median over runs) | their p50 gap ms | "
            "their p99 gap ms | long prompt's TTFT ms | end-to-end tok/s |", "|---|---|---|---|---|---|"]
    for m, rs in runs.items():
        med = lambda f: statistics.median(f(run) for run in rs)
        rows.append(f"| {m} | {1e3 * med(lambda x: max(x[0])):.1f} | {1e3 * med(lambda x: np.percentile(x[0], 50)):.1f} | "
                    f"{1e3 * med(lambda x: np.percentile(x[0], 99)):.1f} | {1e3 * med(lambda x: x[1]):.1f} | {med(lambda x: x[2]):.1f} |")
    ratio = lambda f: statistics.median(f(a) / f(b) for a, b in zip(runs["1"], runs["None"]))
    rows += ["", f"Paired medians, 1 call / None: longest gap {ratio(lambda x: max(x[0])):.2f}x, long prompt's TTFT "
             f"{ratio(lambda x: x[1]):.2f}x, end-to-end tok/s {ratio(lambda x: x[2]):.2f}x "
             f"({-(-long_prompt // prefill_chunk)} prefill calls of {prefill_chunk} tokens for the long prompt)."]
    return rows


# The seed's integrity-check overhead table (mid-size model, 2 prefill + 2 decode servers, 8192 in /
# 1000 out): concurrency -> (throughput change, p95 latency change).
SEED_INTEGRITY = {1: (-0.0053, 0.0042), 2: (-0.0038, 0.0054), 4: (-0.0079, 0.0063), 8: (-0.0043, 0.0080)}


def closed_loop(engine, clients: int, requests: int, prompt_len: int, new_tokens: int, seed: int):
    """`clients` users, each sending its next request when the last one finishes (what a benchmark
    client's max-concurrency does), `requests` in all, through submit/step. Returns (generated
    tokens per wall-clock second, every request's latency from submit to finish)."""
    prompts = iter(workload(requests, prompt_len, seed))
    t0 = time.perf_counter()
    for p in itertools.islice(prompts, clients):
        engine.submit(p, max_new_tokens=new_tokens)
    tokens, latencies = 0, []
    while engine.has_work():
        for u in engine.step():
            tokens += len(u.new_tokens)
            if u.result is not None:
                assert u.result.status == "ok", u.result.reason
                latencies.append(u.result.latency_s)
                nxt = next(prompts, None)
                if nxt is not None:
                    engine.submit(nxt, max_new_tokens=new_tokens)
    return tokens / (time.perf_counter() - t0), latencies


def paired_change(a: list[float], b: list[float]) -> str:
    """A table cell: the median of the paired changes b / a - 1, and their interquartile range."""
    changes = [y / x - 1 for x, y in zip(a, b)]
    q1, _, q3 = statistics.quantiles(changes, n=4) if len(changes) > 1 else changes * 3
    return f"{statistics.median(changes):+.2%} [{q1:+.1%}, {q3:+.1%}]"


def integrity_overhead(model, concurrencies, requests: int, prompt_len: int, new_tokens: int,
                       repeats: int) -> list[str]:
    """The seed's table: `off` and `check` engines serve the same closed-loop workload, runs
    interleaved and alternating who goes first; the paired median change of end-to-end throughput
    and of the p95 request latency, per concurrency."""
    rows = ["| concurrency | tok/s off (median) | check | throughput change (paired median [IQR]) | seed | "
            "p95 latency off ms | check | p95 change (paired median [IQR]) | seed |", "|---|---|---|---|---|---|---|---|---|"]
    for c in concurrencies:
        engines = fp8_engines(model, "integrity", {"off": "off", "check": "check"}, max_batch=c)
        for e in engines.values():  # warm-up: compile every prefill chunk and decode width the runs use
            closed_loop(e, c, c, prompt_len, new_tokens, 99)
        tput, p95 = {m: [] for m in engines}, {m: [] for m in engines}
        for r in range(repeats):
            for m in (("off", "check") if r % 2 == 0 else ("check", "off")):
                rate, latencies = closed_loop(engines[m], c, requests, prompt_len, new_tokens, r)
                tput[m].append(rate)
                p95[m].append(float(np.percentile(latencies, 95)))
        d_tput, d_p95 = (paired_change(x["off"], x["check"]) for x in (tput, p95))
        seed = SEED_INTEGRITY.get(c)
        seed_cells = (f"{seed[0]:+.2%}", f"{seed[1]:+.2%}") if seed else ("", "")
        rows.append(f"| {c} | {statistics.median(tput['off']):.1f} | {statistics.median(tput['check']):.1f} | "
                    f"{d_tput} | {seed_cells[0]} | {1e3 * statistics.median(p95['off']):.1f} | "
                    f"{1e3 * statistics.median(p95['check']):.1f} | {d_p95} | {seed_cells[1]} |")
    # The check in isolation: the same batched verify() the decode step runs, timed alone.
    e = engines["check"]
    active = jax.numpy.ones(e.max_batch, bool)
    verify = jax.jit(pt.verify)
    jax.block_until_ready(verify(e.table, active))
    alone = []
    for _ in range(200):
        t0 = time.perf_counter()
        jax.block_until_ready(verify(e.table, active))
        alone.append(time.perf_counter() - t0)
    step = statistics.median(e.counters.decode_step_s)
    rows += ["", f"The check alone (jitted verify over {e.max_batch} slots x {e.max_pages_per_seq} pages, median of 200 "
             f"calls, launched separately): {1e6 * statistics.median(alone):.0f} us, against a median decode step of "
             f"{1e3 * step:.2f} ms at concurrency {c} = {statistics.median(alone) / step:.2%} of a step (launched alone "
             "it pays its own dispatch, which the fused check does not)."]
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="write the markdown report here")
    p.add_argument("--model", default="tiny-kimi")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--closed-loop-requests", type=int, default=16, help="requests per run, integrity section")
    p.add_argument("--closed-loop-prompt", type=int, default=256,
                   help="prompt tokens, integrity section (the seed's 8192 in / 1000 out, scaled to the tiny model)")
    p.add_argument("--context-limits", type=int, nargs="+", default=[4096, 32768],
                   help="max_position_embeddings for the attended-width section")
    p.add_argument("--max-batch", type=int, default=32, help="engine slots for the decode-rows section")
    p.add_argument("--live", type=int, nargs="+", default=[1, 3, 8, 32],
                   help="live requests for the decode-rows section")
    p.add_argument("--prefill-chunk", type=int, default=512, help="prefill_chunk for the prefill-length section")
    p.add_argument("--prompt-lengths", type=int, nargs="+", default=[20, 100, 300],
                   help="prompt tokens for the prefill-length and prefill-rows sections")
    p.add_argument("--prefill-prompts", type=int, default=8, help="requests arriving together, prefill-rows section")
    p.add_argument("--long-prompt", type=int, default=384, help="prompt tokens arriving mid-decode, chunked-prefill section")
    args = p.parse_args(argv)
    model = mixserve.load(args.model)
    budget = 48 << 30  # a round budget 7% above the seed's Kimi K2.6 BF16 pool (686k tokens x 70,272 B = 44.9 GiB)
    lines = [f"# Serving measurements ({datetime.date.today()}, {jax.devices()[0].device_kind}, XLA path)", ""]
    lines += ["## KV tokens in a 48 GiB budget (page size 64)", ""] + capacity_table(budget, 64)
    kimi = PRESETS["kimi-k2.6"]
    lines += ["", f"The seed's Kimi K2.6 pool holds ~{SEED_KIMI_BF16_TOKENS:,} tokens in BF16 -> ~1.37 M in FP8; "
              f"{SEED_KIMI_BF16_TOKENS:,} tokens x {bytes_per_token(kimi, kv_format('bfloat16', None)):,} B = "
              f"{SEED_KIMI_BF16_TOKENS * bytes_per_token(kimi, kv_format('bfloat16', None)) / 2**30:.1f} GiB.", ""]
    lines += ["## Largest concurrency that fits (48 GiB, 8192 + 1000 tokens per request, the seed's overhead workload)", ""]
    lines += concurrency_table(budget, 64, 8192, 1000)
    lines += ["", f"## Decode throughput by concurrency ({args.model}, {args.new_tokens} new tokens, {args.repeats} interleaved repeats)", ""]
    lines += decode_throughput(model, args.concurrency, args.new_tokens, args.repeats)
    rows = integrity_overhead(model, args.concurrency, args.closed_loop_requests, args.closed_loop_prompt,
                              args.new_tokens, 2 * args.repeats)
    lines += ["", f"## Integrity check overhead ({args.model}, FP8 KV, closed loop: {args.closed_loop_requests} requests "
              f"of {args.closed_loop_prompt} + {args.new_tokens} tokens per run, {2 * args.repeats} interleaved runs each)",
              ""] + rows
    c = max(args.concurrency)
    lines += ["", f"## Attended width ({args.model}, FP8 KV, concurrency {c}, prompts of 24 + {args.new_tokens} tokens, "
              f"page 16, {args.repeats} interleaved repeats)", ""]
    lines += attended_width(model, c, args.new_tokens, args.repeats, tuple(args.context_limits))
    lines += ["", f"## Decode rows ({args.model}, FP8 KV, {args.max_batch} slots, prompts of 24 + {args.new_tokens} tokens, "
              f"{args.repeats} interleaved repeats)", ""]
    lines += decode_rows_table(model, args.max_batch, args.live, args.new_tokens, args.repeats)
    lines += ["", f"## Prefill chunk length ({args.model}, FP8 KV, prefill_chunk {args.prefill_chunk}, 4 prompts per run, "
              f"{args.repeats} interleaved repeats)", ""]
    lines += prefill_length_table(model, args.prefill_chunk, args.prompt_lengths, args.repeats)
    lines += ["", f"## Prefill rows ({args.model}, FP8 KV, {args.prefill_prompts} prompts arriving together, "
              f"prefill_chunk 128, {args.repeats} interleaved repeats)", ""]
    lines += prefill_rows_table(model, args.prefill_prompts, args.prompt_lengths, args.repeats)
    lines += ["", f"## Chunked prefill ({args.model}, FP8 KV, a {args.long_prompt}-token prompt arriving while 4 requests "
              f"decode {args.new_tokens} tokens, prefill_chunk 32, {2 * args.repeats} interleaved runs)", ""]
    lines += chunked_prefill_table(model, 4, args.long_prompt, 32, args.new_tokens, 2 * args.repeats)
    lines += ["", "CPU times on a shared 2-core machine: ratios within one run are the result, absolute rates are not."]
    publish(lines, args.out)


if __name__ == "__main__":
    main()
