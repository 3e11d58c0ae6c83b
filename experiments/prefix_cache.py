"""The prefix cache on multi-turn conversations: what it saves, and what FP8 KV adds to it.

    python experiments/prefix_cache.py [--out experiments/results/prefix_cache.md] [--repeats 5]

Each conversation is a closed loop of turns: turn t's prompt is turn t-1's prompt, its reply and a
new user message of random bytes (an agent's or a chat's growing history), sent when the reply has
finished. Every engine has no stop tokens, so every reply has its full length.

1. The prefix cache on and off (`Engine(prefix_caching=...)`), same pool: prompt tokens prefilled,
   time to first token of the later turns, and the run's wall time, runs interleaved, medians
   and the median of the paired ratios.
2. At one KV memory budget, BF16 against FP8 pools, as the conversations outgrow the pool: FP8's
   pages hold twice the tokens, so more of the histories are still cached when their next turns
   come. Counts, not times: the cache hit rate, prompt tokens prefilled and pages evicted.
3. Admission order: a burst of requests over a few long system prompts, interleaved, through a
   pool that holds one of them besides the running requests, first come first served against
   SGLang's longest-prefix-match order (`Engine(schedule_policy="lpm")`). Counts.
4. What it costs when nothing repeats: unique prompts through a full pool, where every admission
   evicts, on against off, and with the host tier against without (every eviction copies its
   pages to host memory): wall time, paired runs.
5. The host tier (`Engine(host_kv_bytes=...)`, SGLang's HiCache): FP8 pools at section 2's budget,
   with and without host memory for more histories, as the conversations outgrow the pool: cache
   hit rate (device and host), prompt tokens prefilled, and the later turns' TTFT (paired runs).

CPU, XLA path, tiny-kimi: times compare only within a row.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import time

import numpy as np

from experiments.report import interleaved, publish
import mixserve
from mixserve.engine import Engine
from mixserve.kv_cache import bytes_per_token, kv_format


def pages_bytes(model, tokens: int, page_size: int, kv_dtype: str) -> int:
    """Bytes of the whole pages that hold `tokens` tokens in a kv_dtype pool."""
    return -(-tokens // page_size) * page_size * bytes_per_token(model.config, kv_format(kv_dtype, model.dtype))


def converse(engine: Engine, conversations: int, turns: int, user_len: int, reply_len: int, seed: int) -> dict:
    """Run the conversations to their last turn, at most engine.max_batch at a time, from a cold
    cache. Returns the later turns' times to first token, the run's wall time and the engine's
    counter deltas."""
    engine.reset_prefix_cache()
    rng = np.random.default_rng(seed)
    c0 = dict(vars(engine.counters))
    history = {i: [] for i in range(conversations)}
    done_turns = dict.fromkeys(history, 0)
    waiting, owner, later_ttft = list(history), {}, []
    t0 = time.perf_counter()
    while waiting or owner:
        while waiting and len(owner) < engine.max_batch:
            i = waiting.pop(0)
            history[i] += [int(t) for t in rng.integers(0, 256, user_len)]
            owner[engine.submit(history[i], max_new_tokens=reply_len)] = i
        for update in engine.step():
            if update.result is None:
                continue
            i = owner.pop(update.rid)
            assert update.result.status == "ok", update.result.reason
            history[i] += update.result.tokens
            if done_turns[i] > 0:
                later_ttft.append(update.result.ttft_s)
            done_turns[i] += 1
            if done_turns[i] < turns:
                waiting.append(i)
    wall = time.perf_counter() - t0
    c = vars(engine.counters)
    return {"ttft": later_ttft, "wall": wall, **{k: c[k] - c0[k] for k in
            ("prefill_tokens", "prefix_cache_queries", "prefix_cache_hits", "evicted_pages", "preemptions",
             "host_restored_tokens")}}


def on_off_table(model, conversations: int, turns: int, user_len: int, reply_len: int, repeats: int,
                 page_size: int) -> list[str]:
    tokens = conversations * turns * (user_len + reply_len)
    engines = {on: Engine(model, num_pages=2 * -(-tokens // page_size), page_size=page_size, max_batch=conversations,
                          stop_tokens=(), prefix_caching=on) for on in (True, False)}
    for e in engines.values():  # warm-up: compile the shapes the runs use
        converse(e, conversations, turns, user_len, reply_len, 99)
    runs = interleaved(engines, repeats, lambda e, r: converse(e, conversations, turns, user_len, reply_len, r))
    rows = ["| prefix cache | prompt tokens prefilled | cache hits (tokens) | later turns' TTFT, median (ms) | "
            "wall (s), median |", "|---|---|---|---|---|"]
    for on, name in ((False, "off"), (True, "on")):
        x = runs[on]
        rows.append(f"| {name} | {x[0]['prefill_tokens']:,} | {x[0]['prefix_cache_hits']:,} | "
                    f"{1e3 * statistics.median(t for run in x for t in run['ttft']):.1f} | "
                    f"{statistics.median(run['wall'] for run in x):.2f} |")
    ttft = statistics.median(statistics.median(a["ttft"]) / statistics.median(b["ttft"])
                             for a, b in zip(runs[True], runs[False]))
    wall = statistics.median(a["wall"] / b["wall"] for a, b in zip(runs[True], runs[False]))
    prompt_tokens = runs[True][0]["prefix_cache_queries"]
    return [f"{conversations} conversations of {turns} turns, each turn {user_len} new user tokens and a reply of "
            f"{reply_len}; {prompt_tokens:,} prompt tokens in all; pages of {page_size}; a pool that holds them all; "
            f"{repeats} runs per engine, interleaved, each from a cold cache.", "", *rows, "",
            f"On / off, median of the paired runs' ratios: later turns' median TTFT {ttft:.2f}x, wall time {wall:.2f}x."]


def fp8_table(model, conversation_counts: list[int], concurrency: int, turns: int, user_len: int, reply_len: int,
              fit: int, page_size: int) -> list[str]:
    """Same bytes for both pools: BF16 holds `fit` conversations' full histories, FP8 twice that."""
    history = turns * (user_len + reply_len)
    budget = fit * pages_bytes(model, history, page_size, "bfloat16")
    engines = {kv: Engine(model, kv_dtype=kv, kv_memory_bytes=budget, page_size=page_size, max_batch=concurrency,
                          stop_tokens=()) for kv in ("bfloat16", "fp8_e4m3")}
    rows = ["| conversations | BF16: cache hit rate | prompt tokens prefilled | pages evicted | "
            "FP8: cache hit rate | prompt tokens prefilled | pages evicted |", "|---|---|---|---|---|---|---|"]
    for n in conversation_counts:
        cells = []
        for e in engines.values():
            x = converse(e, n, turns, user_len, reply_len, 0)
            assert x["preemptions"] == 0  # the budget holds every running turn: only the cache is short
            cells += [f"{x['prefix_cache_hits'] / x['prefix_cache_queries']:.1%}", f"{x['prefill_tokens']:,}",
                      f"{x['evicted_pages']:,}"]
        rows.append(f"| {n} | {' | '.join(cells)} |")
    pools = ", ".join(f"{kv} {e.capacity_tokens:,}" for kv, e in engines.items())
    return [f"KV budget {budget:,} bytes ({pools} tokens): {fit} full histories of {history} tokens in BF16 pages. "
            f"Conversations of {turns} turns ({user_len} user tokens, {reply_len}-token replies), {concurrency} at a "
            "time, each conversation's next turn queued behind the others' (round robin: the order least kind to "
            "LRU, which keeps nothing once the histories outgrow the pool).", "", *rows]


def order_table(model, groups: int, per_group: int, system_len: int, user_len: int, reply_len: int,
                concurrency: int, fit: int, page_size: int) -> list[str]:
    """A burst of requests over a few long system prompts, interleaved (A B C D A B C D ...), all
    waiting at once, through a pool that holds `fit` system prompts besides the running requests:
    first come, first served against the longest cached prefix first (`schedule_policy="lpm"`)."""
    rng = np.random.default_rng(0)
    systems = [[int(t) for t in rng.integers(0, 256, system_len)] for _ in range(groups)]
    prompts = [systems[i % groups] + [int(t) for t in rng.integers(0, 256, user_len)]
               for i in range(groups * per_group)]
    running = concurrency * -(-(system_len + user_len + reply_len) // page_size)
    pages = running + fit * (system_len // page_size)
    rows = ["| admission order | cache hit rate | prompt tokens prefilled | pages evicted |", "|---|---|---|---|"]
    for policy in ("fcfs", "lpm"):
        e = Engine(model, num_pages=pages, page_size=page_size, max_batch=concurrency, stop_tokens=(),
                   schedule_policy=policy)
        results = e.generate(prompts, max_new_tokens=reply_len)
        assert all(r.status == "ok" for r in results)
        c = e.counters
        rows.append(f"| {policy} | {c.prefix_cache_hits / c.prefix_cache_queries:.1%} | {c.prefill_tokens:,} | "
                    f"{c.evicted_pages:,} |")
    return [f"{groups * per_group} requests arriving together: {groups} system prompts of {system_len} tokens, "
            f"interleaved, each with {user_len} tokens of its own and a {reply_len}-token reply; {concurrency} at a "
            f"time; a pool of {pages} pages of {page_size} (the running requests' and {fit} system prompts').", "",
            *rows]


def miss_table(model, requests: int, concurrency: int, prompt_len: int, reply_len: int, repeats: int,
               page_size: int) -> list[str]:
    """What the cache costs when nothing repeats: unique prompts through a pool that holds
    2 x concurrency requests, so once it is full every admission evicts (with a host tier: and
    copies the evicted pages to host memory, which holds them all)."""
    pages = 2 * concurrency * -(-(prompt_len + reply_len) // page_size)
    host_bytes = requests * pages_bytes(model, prompt_len + reply_len, page_size, "auto")
    variants = {"off": dict(prefix_caching=False), "on": {}, "on + host": dict(host_kv_bytes=host_bytes)}
    engines = {name: Engine(model, num_pages=pages, page_size=page_size, max_batch=concurrency, stop_tokens=(), **kw)
               for name, kw in variants.items()}
    for e in engines.values():
        converse(e, requests, 1, prompt_len, reply_len, 99)
    runs = interleaved(engines, repeats, lambda e, r: converse(e, requests, 1, prompt_len, reply_len, r))
    hot = runs["on"][0]
    ratio = lambda a, b: statistics.median(x["wall"] / y["wall"] for x, y in zip(runs[a], runs[b]))
    wall = lambda name: statistics.median(x["wall"] for x in runs[name])
    return [f"{requests} requests of {prompt_len} unique prompt tokens and {reply_len} generated, {concurrency} at a "
            f"time, a pool of {pages} pages of {page_size} (2 x {concurrency} requests): {hot['prefix_cache_hits']} "
            f"tokens hit, {hot['evicted_pages']:,} pages evicted per run. Wall time, median of {repeats} paired "
            f"interleaved runs: cache on / off {ratio('on', 'off'):.2f}x, with the host tier / without "
            f"{ratio('on + host', 'on'):.2f}x (off {wall('off'):.2f} s, on {wall('on'):.2f} s, "
            f"on + host {wall('on + host'):.2f} s)."]


def host_table(model, conversation_counts: list[int], concurrency: int, turns: int, user_len: int, reply_len: int,
               fit: int, host_fit: int, repeats: int, page_size: int) -> list[str]:
    """FP8 pools at fp8_table's budget (BF16 holds `fit` full histories), without and with a host
    tier that holds `host_fit` more full histories in FP8 pages."""
    history = turns * (user_len + reply_len)
    budget = fit * pages_bytes(model, history, page_size, "bfloat16")
    host_bytes = host_fit * pages_bytes(model, history, page_size, "fp8_e4m3")
    engines = {host: Engine(model, kv_dtype="fp8_e4m3", kv_memory_bytes=budget, page_size=page_size,
                            max_batch=concurrency, stop_tokens=(), host_kv_bytes=host)
               for host in (0, host_bytes)}
    for e in engines.values():
        converse(e, max(conversation_counts), turns, user_len, reply_len, 99)
    rows = ["| conversations | device only: hit rate | prompt tokens prefilled | + host: hit rate | from the host "
            "(tokens) | prompt tokens prefilled | later turns' TTFT, + host / device only |", "|---|---|---|---|---|---|---|"]
    for n in conversation_counts:
        runs = interleaved(engines, repeats, lambda e, r: converse(e, n, turns, user_len, reply_len, 0))
        cells = []
        for host in engines:
            x = runs[host][0]
            assert x["preemptions"] == 0
            hit = (x["prefix_cache_hits"] + x["host_restored_tokens"]) / x["prefix_cache_queries"]
            cells += [f"{hit:.1%}"] + ([f"{x['host_restored_tokens']:,}"] if host else []) + [f"{x['prefill_tokens']:,}"]
        ttft = statistics.median(statistics.median(a["ttft"]) / statistics.median(b["ttft"])
                                 for a, b in zip(runs[host_bytes], runs[0]))
        rows.append(f"| {n} | {' | '.join(cells)} | {ttft:.2f}x |")
    return [f"FP8 pools of {engines[0].capacity_tokens:,} tokens (section 2's budget, {budget:,} bytes); the host tier "
            f"holds {host_fit} more full histories ({host_bytes:,} bytes, FP8 pages as the pool stores them). Same "
            f"conversations as section 2; {repeats} paired runs per row, interleaved, each from cold caches (the "
            "counts are the first run's; they repeat).", "", *rows]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out")
    p.add_argument("--model", default="tiny-kimi")
    p.add_argument("--conversations", type=int, default=4)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--user-len", type=int, default=64)
    p.add_argument("--reply-len", type=int, default=16)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--pressure-conversations", type=int, nargs="+", default=[4, 8, 12, 16],
                   help="section 2's conversation counts")
    p.add_argument("--fit", type=int, default=4, help="section 2: full histories the budget holds in BF16")
    p.add_argument("--miss-requests", type=int, default=32, help="section 4: unique prompts served")
    p.add_argument("--host-fit", type=int, default=12, help="section 5: full histories the host tier holds")
    p.add_argument("--groups", type=int, default=4, help="section 3: system prompts")
    p.add_argument("--per-group", type=int, default=8, help="section 3: requests per system prompt")
    p.add_argument("--system-len", type=int, default=256, help="section 3: tokens of a system prompt")
    p.add_argument("--order-concurrency", type=int, default=2, help="section 3: requests run at a time")
    args = p.parse_args(argv)
    model = mixserve.load(args.model, dtype="bfloat16")
    publish([f"# The prefix cache on multi-turn conversations ({args.model}, BF16 weights, {datetime.date.today()}, CPU)",
             "", "## Prefix cache on and off", "",
             *on_off_table(model, args.conversations, args.turns, args.user_len, args.reply_len, args.repeats,
                           args.page_size),
             "", "## BF16 and FP8 KV at the same memory, as the conversations outgrow it", "",
             *fp8_table(model, args.pressure_conversations, args.conversations, args.turns, args.user_len,
                        args.reply_len, args.fit, args.page_size), "",
             "## Admission order: first come, first served or longest cached prefix first", "",
             *order_table(model, args.groups, args.per_group, args.system_len, args.user_len, args.reply_len,
                          args.order_concurrency, 1, args.page_size), "",
             "## When nothing repeats", "",
             *miss_table(model, args.miss_requests, args.conversations, args.user_len, args.reply_len, args.repeats,
                         args.page_size), "",
             "## The host tier: evicted pages kept in host memory", "",
             *host_table(model, args.pressure_conversations, args.conversations, args.turns, args.user_len,
                         args.reply_len, args.fit, args.host_fit, args.repeats, args.page_size), "",
             "CPU times on a shared 2-core machine: compare within a table; absolute times are not GPU times."], args.out)


if __name__ == "__main__":
    main()
