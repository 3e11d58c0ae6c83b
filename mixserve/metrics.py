"""What `GET /metrics` reports, in Prometheus' text format under vLLM's names (mixserve: for vllm:).

Two kinds, as vLLM has them: the engine's gauges and counters, read between its steps
(`ENGINE_METRICS`, a role label each: engine, or prefill and decode for a disaggregated pair), and
per-request histograms and counts, observed as each request finishes (`RequestMetrics`): what an
SRE sets service levels on (time to first token, inter-token latency, queueing).
"""

from __future__ import annotations

import bisect
import dataclasses

from mixserve.disaggregated import DisaggregatedEngine
from mixserve.engine import SLEEP_STATES
from mixserve.frontend import Frontend
from mixserve.request import Result

ENGINE_METRICS = (
    ("num_requests_running", "gauge", "requests holding a batch slot, prefilling or decoding",
     lambda e: len(e.scheduler.running)),
    ("num_requests_waiting", "gauge", "requests waiting for a slot and pages, new or preempted",
     lambda e: len(e.scheduler.waiting)),
    ("kv_pages_used", "gauge", "KV pool pages held by requests", lambda e: e.pages_in_use),
    ("kv_pages_cached", "gauge", "KV pool pages only the prefix cache holds (free to evict)", lambda e: e.cached_pages),
    ("prefix_cache_queries_total", "counter", "prompt tokens looked up in the prefix cache at admission",
     lambda e: e.counters.prefix_cache_queries),
    ("prefix_cache_hits_total", "counter", "of those, tokens the device's prefix cache held (not prefilled)",
     lambda e: e.counters.prefix_cache_hits),
    ("prefix_cache_host_hits_total", "counter", "of those, tokens whose KV came back from the host tier instead (not prefilled)",
     lambda e: e.counters.host_restored_tokens),
    ("kv_host_pages", "gauge", "KV pages the prefix cache's host tier holds", lambda e: 0 if e.host_cache is None else len(e.host_cache)),
    ("prefix_cache_evicted_pages_total", "counter", "cached pages freed for allocations",
     lambda e: e.counters.evicted_pages),
    ("prefix_cache_stale_pages_total", "counter", "cached pages a hit found freed or reallocated (refused, recomputed)",
     lambda e: e.counters.stale_cache_entries),
    ("kv_pages_total", "gauge", "KV pool pages", lambda e: e.num_pages),
    ("prompt_tokens_total", "counter", "prompt tokens prefilled (recomputed after a preemption included)",
     lambda e: e.counters.prefill_tokens),
    ("generation_tokens_total", "counter", "tokens decoded", lambda e: e.counters.decode_tokens),
    ("decode_steps_total", "counter", "decode steps", lambda e: e.counters.steps),
    ("preemptions_total", "counter", "requests preempted for pages (recomputed later)",
     lambda e: e.counters.preemptions),
    ("integrity_aborts_total", "counter", "requests aborted by a failed KV integrity check (or a pool leaked after one)",
     lambda e: e.counters.aborts),
    ("grammar_mask_seconds_total", "counter", "host seconds computing structured outputs' token masks before steps",
     lambda e: e.grammars.mask_s),
)

# Bucket bounds: a 1-2.5-5 ladder per decade over the range each quantity spans, from a
# millisecond step on a GPU to a long queue on a CPU.
SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 50.0, 100.0, 250.0,
           500.0, 1000.0, 2500.0)
TOKENS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000, 200000, 500000,
          1000000)


@dataclasses.dataclass
class Histogram:
    """A Prometheus histogram: how many observations fell at or under each bound, their sum and count."""
    bounds: tuple[float, ...]
    counts: list[int] = dataclasses.field(init=False)  # per bucket, not cumulative; the last: +Inf
    total: float = 0.0

    def __post_init__(self):
        self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1  # a value on a bound counts in its bucket (le)
        self.total += value

    def samples(self, name: str, labels: str) -> list[str]:
        cumulative, lines = 0, []
        for bound, count in zip((*self.bounds, "+Inf"), self.counts):
            cumulative += count
            lines.append(f'{name}_bucket{{{labels},le="{bound}"}} {cumulative}')
        return [*lines, f"{name}_sum{{{labels}}} {self.total}", f"{name}_count{{{labels}}} {cumulative}"]


# name -> (help, bounds) of each per-request histogram, as vLLM names them
REQUEST_HISTOGRAMS = {
    "time_to_first_token_seconds": ("submit to the first token", SECONDS),
    "inter_token_latency_seconds": ("between the steps that gave a request tokens (a speculative step's tokens "
                                    "arrive together: one observation)", SECONDS),
    "e2e_request_latency_seconds": ("submit to finish", SECONDS),
    "request_queue_time_seconds": ("submit to the first admission (a batch slot and pages)", SECONDS),
    "request_prefill_time_seconds": ("first admission to the first token", SECONDS),
    "request_decode_time_seconds": ("first token to finish", SECONDS),
    "request_prompt_tokens": ("prompt tokens per request", TOKENS),
    "request_generation_tokens": ("output tokens per request", TOKENS),
}
FINISHED_REASONS = ("stop", "length", "abort")  # a stop token or string; max_new_tokens; aborted or cancelled


class RequestMetrics:
    """Per-request histograms and finish counts over the requests served so far; `observe` each
    finished request (not a rejected one: it never ran, and rejections_total counts it)."""

    def __init__(self):
        self.histograms = {name: Histogram(bounds) for name, (_, bounds) in REQUEST_HISTOGRAMS.items()}
        self.finished = dict.fromkeys(FINISHED_REASONS, 0)

    def observe(self, prompt_tokens: int, result: Result) -> None:
        if result.status == "rejected":
            return
        reason = "abort" if result.status == "aborted" else "length" if result.stop_reason is None else "stop"
        self.finished[reason] += 1
        h = self.histograms
        h["request_prompt_tokens"].observe(prompt_tokens)
        h["request_generation_tokens"].observe(len(result.tokens))
        h["e2e_request_latency_seconds"].observe(result.latency_s)
        if result.queue_s is not None:  # None: cancelled before it was admitted
            h["request_queue_time_seconds"].observe(result.queue_s)
        if result.ttft_s is not None:
            h["time_to_first_token_seconds"].observe(result.ttft_s)
            h["request_decode_time_seconds"].observe(result.latency_s - result.ttft_s)
            if result.queue_s is not None:
                h["request_prefill_time_seconds"].observe(result.ttft_s - result.queue_s)
        for gap in result.step_gaps_s():
            h["inter_token_latency_seconds"].observe(gap)


def prometheus(engine: Frontend, requests: RequestMetrics, cancelled: int) -> str:
    """The engine's gauges and counters (a role label: engine, or prefill and decode), then the
    per-request histograms and finish counts, in Prometheus' text format."""
    pair = isinstance(engine, DisaggregatedEngine)
    parts = {"prefill": engine.prefill, "decode": engine.decode} if pair else {"engine": engine}
    lines = []

    def header(name: str, kind: str, text: str) -> None:
        lines.extend([f"# HELP mixserve:{name} {text}", f"# TYPE mixserve:{name} {kind}"])

    def metric(name: str, kind: str, text: str, values: dict[str, float]) -> None:
        header(name, kind, text)
        lines.extend(f'mixserve:{name}{{role="{role}"}} {value}' for role, value in values.items())

    for name, kind, text, read in ENGINE_METRICS:
        metric(name, kind, text, {role: read(e) for role, e in parts.items()})
    header("engine_sleep_state", "gauge", "1 for the state Engine.sleep left it in (vLLM's awake, weights_offloaded, "
           "discard_all; kv_cache_freed: the pools alone), else 0")
    lines.extend(f'mixserve:engine_sleep_state{{role="{role}",sleep_state="{state}"}} {int(e.sleep_state == state)}'
                 for role, e in parts.items() for state in SLEEP_STATES)
    metric("rejections_total", "counter", "requests rejected as bad input", {"engine": engine.counters.rejections})
    metric("cancelled_total", "counter", "requests cancelled unfinished (their client gone, a prompt beside them "
           "rejected)", {"engine": cancelled})
    if pair:
        metric("handovers_total", "counter", "requests handed from prefill to decode", {"engine": engine.counters.handovers})
        metric("kv_bytes_sent_total", "counter", "KV page bytes sent from prefill to decode",
               {"engine": engine.counters.bytes_sent})
    header("request_success_total", "counter", "requests finished, by why: stop (a stop token or string), length "
           "(max_tokens), abort (aborted or cancelled)")
    lines.extend(f'mixserve:request_success_total{{role="engine",finished_reason="{reason}"}} {count}'
                 for reason, count in requests.finished.items())
    for name, (text, _) in REQUEST_HISTOGRAMS.items():
        header(name, "histogram", text)
        lines.extend(requests.histograms[name].samples(f"mixserve:{name}", 'role="engine"'))
    return "\n".join(lines) + "\n"
