"""Per-request metrics: the histograms against numpy's counts, and Result.queue_s from the engine
(what /metrics reports of them: tests/test_server.py)."""

import numpy as np
import pytest

import mixserve
from mixserve.disaggregated import DisaggregatedEngine
from mixserve.metrics import SECONDS, Histogram, RequestMetrics
from mixserve.request import Result
from test_engine import engine


def parse(samples: list[str]) -> dict[str, float]:
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in samples}


def test_a_histogram_counts_at_or_under_each_bound_cumulatively():
    rng = np.random.default_rng()
    values = np.concatenate([10 ** rng.uniform(-4, 4, 500), rng.choice(SECONDS, 40)])  # some exactly on a bound
    h = Histogram(SECONDS)
    for v in values:
        h.observe(float(v))
    got = parse(h.samples("x", 'role="engine"'))
    for bound in SECONDS:
        assert got[f'x_bucket{{role="engine",le="{bound}"}}'] == np.sum(values <= bound)  # Prometheus' le
    assert got['x_bucket{role="engine",le="+Inf"}'] == got['x_count{role="engine"}'] == len(values)
    assert got['x_sum{role="engine"}'] == pytest.approx(values.sum(), rel=1e-12)


def test_request_metrics_sort_finishes_and_skip_a_steps_later_tokens():
    m = RequestMetrics()
    m.observe(7, Result([1, 2, 3], "ok", ttft_s=0.5, token_latencies_s=[0.2, 0.0], latency_s=0.9, queue_s=0.1,
                        stop_reason=3))
    m.observe(4, Result([5, 6], "ok", ttft_s=0.3, token_latencies_s=[0.4], latency_s=0.8, queue_s=0.2))
    m.observe(9, Result([], "aborted", "cancelled", latency_s=2.0))  # cancelled while waiting
    m.observe(9, Result([], "rejected", "bad"))
    assert m.finished == {"stop": 1, "length": 1, "abort": 1}
    h = m.histograms
    assert h["request_prompt_tokens"].total == 20 and h["request_generation_tokens"].total == 5
    assert sum(h["inter_token_latency_seconds"].counts) == 2  # the 0.0 is the speculative step's second token
    assert h["inter_token_latency_seconds"].total == pytest.approx(0.6)
    assert sum(h["request_queue_time_seconds"].counts) == sum(h["time_to_first_token_seconds"].counts) == 2
    assert h["request_prefill_time_seconds"].total == pytest.approx(0.4 + 0.1)
    assert h["request_decode_time_seconds"].total == pytest.approx(0.4 + 0.5)
    assert sum(h["e2e_request_latency_seconds"].counts) == 3


@pytest.fixture(scope="module")
def kimi():
    return mixserve.load("tiny-kimi", dtype="float32")


def test_queue_time_is_submit_to_first_admission(kimi):
    """One slot: each request waits for those before it, so queue times grow in submit order,
    and each lies before its first token. A disaggregated pair keeps the prefill side's admission."""
    rng = np.random.default_rng()
    prompts = [[int(t) for t in rng.integers(0, 256, 6)] for _ in range(3)]
    results = engine(kimi, max_batch=1).generate(prompts, max_new_tokens=4)
    queues = [r.queue_s for r in results]
    assert all(r.status == "ok" and 0 <= r.queue_s < r.ttft_s < r.latency_s for r in results)
    assert queues[0] < results[0].ttft_s <= queues[1] < queues[2]  # admitted once the one before finished
    pair = DisaggregatedEngine(engine(kimi, max_batch=1, prefill_only=True), engine(kimi, max_batch=1))
    results = pair.generate(prompts, max_new_tokens=4)
    assert all(r.status == "ok" and 0 <= r.queue_s < r.ttft_s for r in results)
    assert results[0].queue_s < results[1].queue_s < results[2].queue_s
