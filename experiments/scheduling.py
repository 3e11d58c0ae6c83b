"""Priority scheduling (vLLM's priority policy): what it buys the urgent requests, what it costs
the others.

    python experiments/scheduling.py [--out experiments/results/scheduling.md] [--repeats 5]

A burst of requests arrives at once, every fourth one urgent (so first come, first served meets
most of them late), more than the engine's slots hold, through a pool too small for every slot's
request at full length, so requests queue and decode preempts. `schedule_policy="fcfs"` serves
them in arrival order (every priority 0: fcfs refuses others, as vLLM does);
`schedule_policy="priority"` admits the urgent ones (priority 0, the others 1) first and preempts
the others first. Per class: the median time to first token and the median latency (submit to
last token); the burst's preemptions and wall time. Runs interleaved; medians over the runs, and
the median of the paired runs' ratios.

CPU, XLA path, tiny-kimi: times compare only within the table.
"""

from __future__ import annotations

import argparse
import datetime
import statistics

import numpy as np

from experiments.report import interleaved, publish
import mixserve
from mixserve.engine import Engine


def burst(engine: Engine, requests: int, prompt_len: int, new_tokens: int, seed: int) -> dict:
    """Serve the burst; per class ("urgent", "others") the times to first token and latencies."""
    rng = np.random.default_rng(seed)
    urgent = {i for i in range(requests) if i % 4 == 3}
    by_priority = engine.scheduler.policy == "priority"
    rids = {engine.submit([int(t) for t in rng.integers(0, 256, prompt_len)], max_new_tokens=new_tokens,
                          priority=(0 if i in urgent else 1) if by_priority else 0): i for i in range(requests)}
    preempted = engine.counters.preemptions
    times = {"urgent": ([], []), "others": ([], [])}
    while engine.has_work():
        for update in engine.step():
            if update.result is not None:
                assert update.result.status == "ok", update.result.reason
                ttft, latency = times["urgent" if rids[update.rid] in urgent else "others"]
                ttft.append(update.result.ttft_s)
                latency.append(update.result.latency_s)
    return {**times, "preemptions": engine.counters.preemptions - preempted,
            "wall": max(x for ttft, latency in times.values() for x in latency)}


def priority_table(model, requests: int, concurrency: int, prompt_len: int, new_tokens: int, page_size: int,
                   repeats: int) -> list[str]:
    per_request = -(-(prompt_len + new_tokens) // page_size)
    pages = max(per_request, 3 * concurrency * per_request // 4)
    engines = {policy: Engine(model, num_pages=pages, page_size=page_size, max_batch=concurrency, stop_tokens=(),
                              schedule_policy=policy, prefix_caching=False) for policy in ("fcfs", "priority")}
    for e in engines.values():  # warm-up: compile the shapes the runs use
        burst(e, requests, prompt_len, new_tokens, 99)
    runs = interleaved(engines, repeats, lambda e, r: burst(e, requests, prompt_len, new_tokens, r))

    def median(policy: str, cls: str, which: int) -> float:
        return statistics.median(statistics.median(run[cls][which]) for run in runs[policy])

    rows = ["| policy | urgent: TTFT, median (ms) | urgent: latency, median (ms) | others: TTFT (ms) | "
            "others: latency (ms) | preemptions | burst wall (s) |", "|---|---|---|---|---|---|---|"]
    for policy in engines:
        rows.append(f"| {policy} | {1e3 * median(policy, 'urgent', 0):.0f} | {1e3 * median(policy, 'urgent', 1):.0f} | "
                    f"{1e3 * median(policy, 'others', 0):.0f} | {1e3 * median(policy, 'others', 1):.0f} | "
                    f"{statistics.median(run['preemptions'] for run in runs[policy]):.0f} | "
                    f"{statistics.median(run['wall'] for run in runs[policy]):.2f} |")

    def ratio(cls: str, which: int) -> float:
        return statistics.median(statistics.median(a[cls][which]) / statistics.median(b[cls][which])
                                 for a, b in zip(runs["priority"], runs["fcfs"]))

    return [f"{requests} requests at once ({requests // 4} urgent: every fourth), {prompt_len} prompt tokens and "
            f"{new_tokens} generated each, {concurrency} slots, a pool of {pages} pages of {page_size} (three "
            f"quarters of what {concurrency} requests reach), no prefix cache; {repeats} runs per policy, "
            "interleaved.", "", *rows, "",
            f"Priority / fcfs, median of the paired runs' ratios: urgent TTFT {ratio('urgent', 0):.2f}x, urgent "
            f"latency {ratio('urgent', 1):.2f}x; others' TTFT {ratio('others', 0):.2f}x, others' latency "
            f"{ratio('others', 1):.2f}x."]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out")
    p.add_argument("--model", default="tiny-kimi")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    model = mixserve.load(args.model, dtype="bfloat16")
    publish([f"# Scheduling by priority ({args.model}, BF16 weights, {datetime.date.today()}, CPU)", "",
             *priority_table(model, args.requests, args.concurrency, args.prompt_len, args.new_tokens,
                             args.page_size, args.repeats), "",
             "CPU times on a shared 2-core machine: compare within the table; absolute times are not GPU times."],
            args.out)


if __name__ == "__main__":
    main()
