"""The serving engine: exactness against Model.logits, FP8 KV, bad input, integrity faults,
oversubscription, and the no-op integrity mode."""

import dataclasses
import os
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

import mixserve
from mixserve import faults
from mixserve.engine import Engine
from mixserve.kv_cache import quantize_for_pool
from mixserve.model_runner import blocked_logprobs, logprobs_of, steps_for
from mixserve.sampling import Sampling, _kept_by_top_k_top_p, first_token_keys, sample, sampling_keys
from mixserve.quantize import plan_for, quantize_model
from models.weights import WeightFormat
from conftest import ONE_STEP_SHAPE

PROMPT_LENGTHS = [5, 11, 1, 14]  # page size 4: prompts end mid-page and span several pages
NEW = 6


@pytest.fixture(scope="module", params=["tiny-kimi", "tiny-glm4", "tiny-glm5"])
def model(request):
    return mixserve.load(request.param, dtype="float32")


def prompts(seed=0):
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(0, 256, n)] for n in PROMPT_LENGTHS]


def greedy_reference(model, prompt, new):
    """Greedy decoding with the cache-free forward over the growing sequence. The sequence is
    padded to a fixed length (causal attention ignores the padding), so this compiles once."""
    total = len(prompt) + new
    seq = np.zeros((1, max(24, total)), np.int32)
    seq[0, : len(prompt)] = prompt
    for pos in range(len(prompt), total):
        seq[0, pos] = int(np.argmax(np.asarray(model.logits(seq))[0, pos - 1]))
    return [int(t) for t in seq[0, len(prompt):total]]


def engine(model, **kw):
    args = dict(num_pages=48, page_size=4, max_batch=4, prefill_chunk=8, stop_tokens=(), **ONE_STEP_SHAPE)
    return Engine(model, **{**args, **kw})


def test_engine_greedy_equals_cache_free_greedy(model):
    ps = prompts()
    results = engine(model, kv_dtype="auto", integrity="check").generate(ps, max_new_tokens=NEW)
    for p, r in zip(ps, results):
        assert r.status == "ok", r.reason
        assert r.tokens == greedy_reference(model, p, NEW)
        assert r.ttft_s is not None and len(r.token_latencies_s) == NEW - 1
        assert r.routed_experts is None  # unless return_routed_experts (tests/test_routed_experts.py)


def test_steps_attend_over_a_power_of_two_of_pages(model):
    """A step sees only the page-table columns its longest row needs, rounded up to a power of
    two, not the whole table (max_seq_len / page_size columns). While one request grows from 11
    to 41 tokens (pages of 4) the width goes 4 -> 8 -> 16 pages; each width is compiled once,
    and the tokens stay those of the cache-free forward (a width one page short would drop the
    newest token's key: it would be written through a clamped column into another page). The
    reference's smallest top-2 logit gap over these steps is 2e-4, far above float32 roundoff."""
    prompt, new = prompts()[1], 30
    e = engine(model, max_batch=2, integrity="check", min_attended_tokens=8)
    assert e.table.max_pages_per_seq == 128
    e.runner.decode_step.clear_cache()  # engines of an equal spec share it (model_runner.steps_for)
    [r] = e.generate([prompt], max_new_tokens=new)
    assert r.status == "ok", r.reason
    assert r.tokens == greedy_reference(model, prompt, new)
    assert e.runner.decode_step._cache_size() == 3


def test_engines_of_an_equal_spec_share_compiled_steps_and_keep_their_own_kv_scales():
    """Engines of one model and settings share their jitted steps (model_runner.steps_for): a
    second one compiles nothing the first compiled, even with other FP8 KV scales, which are
    arguments of the steps and not constants of the first trace: it serves what an engine traced
    afresh with its scales serves, not what the first serves. Another pool size, other steps."""
    model = mixserve.load("tiny-glm4", dtype="float32")
    kw, ps = dict(kv_dtype="fp8_e4m3", max_batch=2, integrity="check"), prompts()[:2]
    request = dict(max_new_tokens=NEW, logprobs=1)
    logprobs = lambda results: [[t.logprob for t in r.logprobs] for r in results]
    compiled = lambda e: (e.runner.prefill_step._cache_size(), e.runner.decode_step._cache_size())
    steps_for.cache_clear()
    first = engine(model, k_scale=0.5, v_scale=0.5, **kw)
    first_out = first.generate(ps, **request)
    before = compiled(first)
    second = engine(model, k_scale=0.02, v_scale=0.02, **kw)
    assert second.runner.decode_step is first.runner.decode_step
    second_out = second.generate(ps, **request)
    assert compiled(second) == before and before[1] > 0
    steps_for.cache_clear()
    fresh = engine(model, k_scale=0.02, v_scale=0.02, **kw)
    assert fresh.runner.decode_step is not first.runner.decode_step
    fresh_out = fresh.generate(ps, **request)
    assert all(r.status == "ok" for r in first_out + second_out + fresh_out)
    assert logprobs(second_out) == logprobs(fresh_out) != logprobs(first_out)
    assert engine(model, num_pages=32, **kw).runner.decode_step is not fresh.runner.decode_step


def record_shapes(runner, step_name: str, *, arg: int, axis: int | None) -> list:
    """Wrap the runner's jitted step `step_name` to record args[arg].shape[axis] (the whole shape
    for axis None) of every call (args: params, pools, scales, table, ...)."""
    step_fn, seen = getattr(runner, step_name), []

    def spy(*args, width):
        seen.append(args[arg].shape if axis is None else args[arg].shape[axis])
        return step_fn(*args, width=width)

    setattr(runner, step_name, spy)
    return seen


def test_decode_runs_the_live_requests_rounded_up_to_a_power_of_two():
    """An engine of 8 slots decoding 3 requests runs 4 rows a step, and 1 row for 1 request, not
    8: padding rows repeat slot 0 with no token and touch nothing. The tokens are those of the
    cache-free forward, and those of an engine that runs every slot (min_decode_rows=max_batch)."""
    model = mixserve.load("tiny-glm4", dtype="float32")
    ps = prompts()[:3]
    rows = {}
    for min_rows in (1, 8):
        # Whole prefills: with chunked prefill the 5- and 1-token prompts would decode while the
        # 11-token one still prefills, and the first step would run 2 rows, not 4.
        e = engine(model, max_batch=8, integrity="check", min_decode_rows=min_rows, prefill_calls_per_step=None)
        rows[min_rows] = record_shapes(e.runner, "decode_step", arg=4, axis=0)  # slots_R
        results = e.generate(ps, max_new_tokens=NEW)
        [one] = e.generate(ps[:1], max_new_tokens=NEW)
        for p, r in zip(ps + ps[:1], results + [one]):
            assert r.status == "ok", r.reason
            assert r.tokens == greedy_reference(model, p, NEW)
    assert rows[1] == [4] * (NEW - 1) + [1] * (NEW - 1)
    assert rows[8] == [8] * (2 * (NEW - 1))


def test_chunked_prefill_lets_the_running_requests_decode_between_a_long_prompts_chunks():
    """A 30-token prompt (chunks of 8: 8, 8, 8, 6) arrives while two requests decode. With one
    prefill call per step (the default), each of the next four steps runs one chunk and still gives
    both running requests a token; the long request's first token comes out of the fourth. With
    prefill_calls_per_step=None the first step runs all four calls before its decode step. The
    tokens are the cache-free forward's either way."""
    model = mixserve.load("tiny-glm4", dtype="float32")
    rng = np.random.default_rng(5)
    short = [[int(t) for t in rng.integers(0, 256, 5)] for _ in range(2)]
    long = [int(t) for t in rng.integers(0, 256, 30)]
    for budget, calls_per_step, first_token_step in ((1, [1, 1, 1, 1], 3), (None, [4], 0)):
        e = engine(model, num_pages=64, prefill_calls_per_step=budget)
        a, b = (e.submit(p, max_new_tokens=10) for p in short)
        calls, steps = [], []
        while e.has_work():
            if len(steps) == 2:
                c = e.submit(long, max_new_tokens=4)
            before = e.counters.prefill_chunks
            steps.append({u.rid: u for u in e.step()})
            calls.append(e.counters.prefill_chunks - before)
        late = calls[2:]
        assert late[: len(calls_per_step)] == calls_per_step and not any(late[len(calls_per_step):])
        for k in range(2, 2 + len(calls_per_step)):  # the running two got a token in every one of these steps
            assert len(steps[k][a].new_tokens) == len(steps[k][b].new_tokens) == 1
        assert min(k for k, s in enumerate(steps) if c in s) == 2 + first_token_step
        tokens = {rid: [t for s in steps for t in (s[rid].new_tokens if rid in s else [])] for rid in (a, b, c)}
        assert tokens[c] == greedy_reference(model, long, 4)
        assert tokens[a] == greedy_reference(model, short[0], 10)


def test_a_request_preempted_mid_prefill_is_recomputed_and_loses_nothing():
    """Pool of 5 pages of 4. A (2 + 16 tokens) decodes; B (14-token prompt, chunks of 4) is
    admitted with the last 4 free pages. Two chunks in, A's fifth token needs a page: B, the
    youngest, is preempted mid-prefill, waits for A to finish, and prefills again from scratch.
    Both get the tokens of a roomy engine, and every page comes back."""
    model = mixserve.load("tiny-kimi", dtype="float32")
    rng = np.random.default_rng(6)
    pa, pb = [int(t) for t in rng.integers(0, 256, 2)], [int(t) for t in rng.integers(0, 256, 14)]
    roomy = engine(model, num_pages=64)
    expected = [roomy.generate([p], max_new_tokens=n)[0].tokens for p, n in ((pa, 16), (pb, 2))]
    e = engine(model, num_pages=5, prefill_chunk=4)
    a = e.submit(pa, max_new_tokens=16)
    tokens, results, steps = {a: []}, {}, 0
    while e.has_work():
        if steps == 1:  # B's prompt logprobs: 8 of 13 computed when it is preempted, the rest after
            b = e.submit(pb, max_new_tokens=2, prompt_logprobs=2)
            tokens[b] = []
        steps += 1
        for u in e.step():
            tokens[u.rid] += u.new_tokens
            if u.result is not None:
                results[u.rid] = u.result
    assert e.counters.preemptions == 1
    assert e.counters.prefill_tokens == 2 + 8 + 14  # A, B's first two chunks, B again from scratch
    assert [tokens[a], tokens[b]] == [results[a].tokens, results[b].tokens] == expected
    assert_prompt_logprobs(model, pb, results[b].prompt_logprobs, 2)
    assert e.free_pages == e.num_pages


def test_prefill_chunks_are_their_tokens_rounded_up_and_requests_admitted_together_prefill_together():
    """Prompts of 5, 11, 1 and 14 tokens in chunks of at most 8 (and at least 4). One request per
    call (max_prefill_rows=1) runs chunks of 8 | 8, 4 | 4 | 8, 8 tokens, not 8 each: the padding is
    masked out of the attention, the KV writes and the experts. Prefilled together, the four run
    in two calls: 4 rows of 8 tokens (the longest row's chunk), then 2 rows (11 and 14 have tokens
    left) of 8; with min_prefill_rows=4 the second call runs 4 rows too (one shape to compile), two
    of them padding. The tokens are those of the cache-free forward in every case, and those of an
    engine whose every chunk is padded to prefill_chunk (min_prefill_tokens=prefill_chunk)."""
    model = mixserve.load("tiny-kimi", dtype="float32")
    ps = prompts()
    shapes = {}
    for min_tokens, rows, min_rows in ((4, 1, 1), (8, 1, 1), (4, 4, 1), (4, 4, 4)):
        e = engine(model, max_batch=4, min_prefill_tokens=min_tokens, max_prefill_rows=rows, min_prefill_rows=min_rows)
        shapes[min_tokens, rows, min_rows] = record_shapes(e.runner, "prefill_step", arg=7, axis=None)  # tokens_RC
        for p, r in zip(ps, e.generate(ps, max_new_tokens=NEW)):
            assert r.status == "ok", r.reason
            assert r.tokens == greedy_reference(model, p, NEW)
        assert e.counters.prefill_chunks == len(shapes[min_tokens, rows, min_rows])
    assert shapes[4, 1, 1] == [(1, 8), (1, 8), (1, 4), (1, 4), (1, 8), (1, 8)]
    assert shapes[8, 1, 1] == [(1, 8)] * 6
    assert shapes[4, 4, 1] == [(4, 8), (2, 8)]
    assert shapes[4, 4, 4] == [(4, 8), (4, 8)]


def test_fp8_kv_tracks_bf16(model):
    """FP8 e4m3 KV against full-precision KV on the same model. Reported, not asserted exact:
    e4m3 rounds each stored value to 3 mantissa bits (relative error <= 2^-4), which can flip a
    greedy choice between near-equal logits of a random model."""
    ps = prompts(1)
    ref = engine(model, kv_dtype="auto").generate(ps, max_new_tokens=NEW)
    fp8 = engine(model, kv_dtype="fp8_e4m3").generate(ps, max_new_tokens=NEW)
    assert all(r.status == "ok" for r in fp8)
    first = [a.tokens[0] == b.tokens[0] for a, b in zip(ref, fp8)]
    agree = np.mean([x == y for a, b in zip(ref, fp8) for x, y in zip(a.tokens, b.tokens)])
    print(f"{model.source}: FP8-KV greedy agreement {agree:.2f}, first tokens equal {sum(first)}/{len(first)}")
    assert sum(first) >= len(first) - 1


def test_fp8_cast_saturates_instead_of_nan():
    x = jnp.array([500.0, -1000.0, 3.0, 448.0])
    assert bool(jnp.isnan(x.astype(jnp.float8_e4m3fn)[0]))  # the unclamped cast: overflow is NaN
    q = quantize_for_pool(x, jnp.float8_e4m3fn, jnp.float32(1.0)).astype(jnp.float32)
    assert q.tolist() == [448.0, -448.0, 3.0, 448.0]


def test_bad_requests_are_rejected_per_request(model):
    e = engine(model, num_pages=8, max_seq_len=40)
    good = [1, 2, 3]
    cases = {
        "empty prompt": ([], 4, 0.0),
        "outside the vocabulary": ([1, model.config.vocab_size], 4, 0.0),
        "exceeds the context limit": ([1] * 30, 20, 0.0),
        "max_new_tokens must be a positive": (good, 0, 0.0),
        "prompt (35) + max_new_tokens (4) = 39 tokens need 10 pages of 4, and the KV pool holds 8": ([1] * 35, 4, 0.0),
        "temperature must be a finite number": (good, 4, float("nan")),
    }
    for needle, (p, n, temp) in cases.items():
        bad, fine = e.generate([p, good], max_new_tokens=n, temperature=temp) if n > 0 else (
            e.generate([p], max_new_tokens=n)[0], None)
        assert bad.status == "rejected" and needle in bad.reason, (needle, bad.reason)
        # the other request of the same call is served (it shares max_new_tokens/temperature, so
        # only when those are valid)
        if fine is not None and needle not in ("temperature must be a finite number",):
            assert fine.status == "ok"
    for value in ("hot", None, float("inf"), 10**400):  # 10**400: an int beyond float's range
        res = e.generate([good], max_new_tokens=2, temperature=value)[0]
        assert res.status == "rejected" and "temperature" in res.reason
    for seed in (-2**63 - 1, 2**63, True, 1.0):  # int64, as vLLM: the key holds 64 bits, no two seeds may alias
        res = e.generate([good], max_new_tokens=2, seed=seed)[0]
        assert res.status == "rejected" and "seed must be an integer in [-2**63, 2**63)" in res.reason, seed
    assert e.generate([good], max_new_tokens=2, top_p=float("nan"))[0].status == "rejected"
    for min_p, why in ((float("nan"), "min_p must be a finite number"), (-0.1, "0 <= min_p <= 1"),
                       (1.5, "0 <= min_p <= 1"), ("0.1", "min_p must be a finite number")):
        res = e.generate([good], max_new_tokens=2, temperature=1.0, min_p=min_p)[0]
        assert res.status == "rejected" and why in res.reason, min_p
    for options, why in (({"skip_special_tokens": "no"}, "skip_special_tokens must be True or False"),
                         ({"kept_special_ids": 5}, "kept_special_ids must be a collection of token ids"),
                         ({"kept_special_ids": "<think>"}, "kept_special_ids must be a collection of token ids"),
                         ({"kept_special_ids": ["<think>"]}, "kept_special_ids must be a collection of token ids")):
        res = e.generate([good], max_new_tokens=2, **options)[0]
        assert res.status == "rejected" and why in res.reason, options
    for top_k in (-2, 2.0, True, "3"):
        res = e.generate([good], max_new_tokens=2, temperature=1.0, top_k=top_k)[0]
        assert res.status == "rejected" and "top_k must be an integer >= 1, or 0 or -1" in res.reason, top_k
    assert e.generate([[1.5, 2]], max_new_tokens=2)[0].reason == "prompt must be a list of integer token ids"
    # numpy limits: a huge one once wrapped negative in numpy's arithmetic and passed (the request
    # then hung step() at the context limit); an unsigned one wrapped in the page count.
    for n in (np.int32(2**31 - 1), np.int64(2**63 - 1)):  # one step: an accepted one would run, not hang
        rid = e.submit(good, max_new_tokens=n)
        result = {u.rid: u.result for u in e.step()}.get(rid)
        assert result is not None and "exceeds the context limit 40" in result.reason, n
    assert e.generate([good], max_new_tokens=np.uint8(3))[0].tokens == e.generate([good], max_new_tokens=3)[0].tokens
    mixed = e.generate([[], good, [10**6]], max_new_tokens=3)
    assert [r.status for r in mixed] == ["rejected", "ok", "rejected"]
    with pytest.raises(ValueError, match="exactly one of num_pages or kv_memory_bytes"):
        Engine(model, num_pages=8, kv_memory_bytes=1 << 20)
    with pytest.raises(ValueError, match="integrity"):
        Engine(model, num_pages=8, integrity="sometimes")
    with pytest.raises(ValueError, match="unknown backend"):
        Engine(model, num_pages=8, attention_backend="cuda")
    with pytest.raises(ValueError, match="k_scale must be finite and positive"):
        Engine(model, num_pages=8, k_scale=0.0)
    with pytest.raises(ValueError, match=r"max_seq_len=513 must be in \[1, max_position_embeddings=512\]"):
        Engine(model, num_pages=8, max_seq_len=513)
    with pytest.raises(ValueError, match="min_attended_tokens must be positive, got 0"):
        Engine(model, num_pages=8, min_attended_tokens=0)
    with pytest.raises(ValueError, match="min_decode_rows must be positive, got -1"):
        Engine(model, num_pages=8, min_decode_rows=-1)
    with pytest.raises(ValueError, match="min_prefill_tokens must be positive, got 0"):
        Engine(model, num_pages=8, min_prefill_tokens=0)
    with pytest.raises(ValueError, match="max_prefill_rows must be positive, got 0"):
        Engine(model, num_pages=8, max_prefill_rows=0)
    with pytest.raises(ValueError, match="min_prefill_rows must be positive, got 0"):
        Engine(model, num_pages=8, min_prefill_rows=0)


FAULTS = {
    "stale_tag": (faults.FaultKind.STALE_TAG, dict(slot=1), {1}),
    "double_allocation": (faults.FaultKind.DOUBLE_ALLOCATION, dict(slot=1, other=2), {1}),
    "use_after_free": (faults.FaultKind.USE_AFTER_FREE, dict(slot=1), {1}),
    "swapped_mapping": (faults.FaultKind.SWAPPED_MAPPING, dict(slot=1, other=2), {1, 2}),
    "out_of_range": (faults.FaultKind.OUT_OF_RANGE, dict(slot=2), {2}),
}


def _inject_at(step, kind, targets):
    def hook(table, n):
        return faults.inject(table, kind, **{k: jnp.int32(v) for k, v in targets.items()}) if n == step else table
    return hook


@pytest.fixture(scope="module")
def clean_run():
    """tiny-glm4 and what an integrity-checked engine without faults serves for prompts(2): each
    fault case's reference (served once per worker, not once per case)."""
    model = mixserve.load("tiny-glm4", dtype="float32")
    return model, engine(model, integrity="check").generate(prompts(2), max_new_tokens=NEW)


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_fault_aborts_only_the_affected_request(fault, clean_run):
    model, clean = clean_run
    kind, targets, affected = FAULTS[fault]
    ps = prompts(2)
    hurt = engine(model, integrity="check", fault_hook=_inject_at(2, kind, targets)).generate(ps, max_new_tokens=NEW)
    for slot, (c, h) in enumerate(zip(clean, hurt)):  # requests take slots 0..3 in order
        if slot in affected:
            assert h.status == "aborted" and "page" in h.reason and "tag" in h.reason, h.reason
            assert h.tokens == c.tokens[: len(h.tokens)]  # nothing wrong was ever answered
        else:
            assert h.status == "ok" and h.tokens == c.tokens


def test_without_the_check_a_fault_is_silent_wrong_output():
    model = mixserve.load("tiny-glm4", dtype="float32")
    ps = prompts(2)
    clean = engine(model, integrity="off").generate(ps, max_new_tokens=NEW)
    hook = _inject_at(2, faults.FaultKind.SWAPPED_MAPPING, dict(slot=1, other=2))
    hurt = engine(model, integrity="off", fault_hook=hook).generate(ps, max_new_tokens=NEW)
    assert all(r.status == "ok" for r in hurt)  # nobody notices...
    assert hurt[1].tokens != clean[1].tokens or hurt[2].tokens != clean[2].tokens  # ...but answers changed


def _drain(e, results: dict) -> list[str]:
    """Step e until it has no work, collecting results by request id; returns the messages of
    the integrity errors the steps raised (strict mode), each after which the engine goes on."""
    raised = []
    for _ in range(200):  # bounded: an engine that raised and stopped making progress fails here, not hangs
        if not e.has_work():
            return raised
        try:
            results.update({u.rid: u.result for u in e.step() if u.result is not None})
        except checkify.JaxRuntimeError as err:
            raised.append(str(err))
    raise AssertionError(f"the engine did not finish; it raised {raised[:3]}")


def test_strict_mode_raises_then_the_engine_goes_on():
    """strict raises the check's error once the failing request is aborted; the pools were kept
    (the step had donated the old ones), so the next steps serve the others as a clean run."""
    model = mixserve.load("tiny-glm4", dtype="float32")
    clean = engine(model, integrity="strict").generate(prompts(), max_new_tokens=NEW)
    e = engine(model, integrity="strict", fault_hook=_inject_at(1, faults.FaultKind.STALE_TAG, dict(slot=0)))
    with pytest.raises(checkify.JaxRuntimeError, match="KV integrity check failed: slot 0 .*expected tag"):
        e.generate(prompts(), max_new_tokens=NEW)
    results = {}
    assert _drain(e, results) == []
    got = [results[rid] for rid in sorted(results)]
    assert got[0].status == "aborted" and "expected tag" in got[0].reason
    assert [r.tokens for r in got[1:]] == [r.tokens for r in clean[1:]]
    assert e.generate(prompts()[1:2], max_new_tokens=NEW)[0].tokens == clean[1].tokens


@pytest.mark.parametrize("integrity", ["check", "strict"])
def test_a_fault_during_chunked_prefill_is_caught_before_the_prompt_writes_on(integrity):
    """Mid-prefill (8 of X's 16 prompt tokens cached), a bookkeeping bug frees X's second page,
    still unwritten, and Y, arriving next, is given it. X's next prefill call checks its mapping
    and aborts X before it writes there; unchecked, X's next chunk overwrote Y's KV and Y finished
    "ok" with other tokens. L decodes throughout, untouched."""
    model = mixserve.load("tiny-glm4", dtype="float32")
    rng = np.random.default_rng(3)
    L, X, Y = ([int(t) for t in rng.integers(0, 256, n)] for n in (5, 16, 8))

    def serve(fault):
        hook = _inject_at(0, faults.FaultKind.USE_AFTER_FREE, dict(slot=1, index=1)) if fault else None
        e = engine(model, num_pages=32, page_size=8, prefill_chunk=4, min_prefill_tokens=4, prefix_caching=False,
                   integrity=integrity, fault_hook=hook)
        rids, results = [e.submit(L, max_new_tokens=NEW), e.submit(X, max_new_tokens=NEW)], {}
        for _ in range(2):  # two prefill calls of 4 tokens; L decodes its first step (the fault) in the second
            results.update({u.rid: u.result for u in e.step() if u.result is not None})
        rids.append(e.submit(Y, max_new_tokens=NEW))
        raised = _drain(e, results)
        return [results[r] for r in rids], raised

    clean, _ = serve(False)
    (l, x, y), raised = serve(True)
    assert x.status == "aborted" and x.tokens == [] and x.reason.startswith("KV integrity check failed: page ")
    assert (l.status, y.status) == ("ok", "ok") and (l.tokens, y.tokens) == (clean[0].tokens, clean[2].tokens)
    assert len(raised) == (integrity == "strict") and all("KV integrity check failed: slot 1" in m for m in raised)


def test_a_page_handed_behind_the_hosts_back_does_not_crash_the_engine():
    """double_allocation hands slot 0's first page to slot 1 behind the scheduler's back: slot 1's
    mapping is consistent (it records the new tag) but holds a page more than the host counts.
    When slot 1 later needs its last page, the table (the authority) refuses the allocation: the
    host resyncs from it instead of asserting, so only slot 0's request is lost."""
    model = mixserve.load("tiny-glm4", dtype="float32")
    ps, kw = [[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]], dict(max_seq_len=16, integrity="check")
    clean = engine(model, **kw).generate(ps, max_new_tokens=11)
    hook = _inject_at(1, faults.FaultKind.DOUBLE_ALLOCATION, dict(slot=0, other=1))
    e = engine(model, fault_hook=hook, **kw)
    hurt = e.generate(ps, max_new_tokens=11)
    assert hurt[0].status == "aborted" and "expected tag" in hurt[0].reason
    assert hurt[1].status == "ok" and hurt[1].tokens == clean[1].tokens
    assert e.pages_in_use == 0  # the handed page was slot 1's at the end, and came back with the rest


def test_off_mode_traces_no_check():
    model = mixserve.load("tiny-glm4", dtype="float32")
    assert "kv_integrity_check" not in engine(model, integrity="off").lowered_decode_text()
    assert "kv_integrity_check" in engine(model, integrity="check").lowered_decode_text()


def test_oversubscription_preempts_and_loses_nothing():
    model = mixserve.load("tiny-kimi", dtype="float32")
    rng = np.random.default_rng(3)
    ps = [[int(t) for t in rng.integers(0, 256, 6)] for _ in range(8)]
    roomy = engine(model, num_pages=64).generate(ps, max_new_tokens=8)
    e = engine(model, num_pages=6)  # 24 tokens: two 14-token requests at once, 8 requests queued
    tight = e.generate(ps, max_new_tokens=8)
    assert [r.status for r in tight] == ["ok"] * 8
    assert [r.tokens for r in tight] == [r.tokens for r in roomy]
    assert e.counters.preemptions > 0
    assert e.free_pages == e.num_pages


def test_requests_submitted_mid_flight_join_the_batch_and_stream_their_tokens():
    """The online API: submit() queues one request, and each step() reports the tokens every
    request got in it. Two requests submitted while two others decode get a token in the very next
    step (continuous batching). Each request's streamed tokens, concatenated, are its Result's,
    equal to generate()'s for the same prompts, and each is reported finished exactly once. In a
    pool too small for all four, preempted requests stream on without repeating or losing a token."""
    model = mixserve.load("tiny-kimi", dtype="float32")
    rng = np.random.default_rng(3)
    ps = [[int(t) for t in rng.integers(0, 256, 6)] for _ in range(4)]
    batch = engine(model, num_pages=64).generate(ps, max_new_tokens=8)
    for num_pages in (64, 6):  # 6 pages of 4: one 14-token request at a time, the others preempted
        e = engine(model, num_pages=num_pages)
        rids = [e.submit(p, max_new_tokens=8) for p in ps[:2]]
        steps = []
        while e.has_work():
            if len(steps) == 2:
                rids += [e.submit(p, max_new_tokens=8) for p in ps[2:]]
            steps.append(e.step())
        streamed, finished = {rid: [] for rid in rids}, {}
        for updates in steps:
            for u in updates:
                assert u.rid not in finished, "an update after the request finished"
                streamed[u.rid] += u.new_tokens
                if u.result is not None:
                    finished[u.rid] = u.result
        assert set(finished) == set(rids)
        for rid, expected in zip(rids, batch):
            r = finished[rid]
            assert r.status == "ok" and streamed[rid] == r.tokens == expected.tokens
            assert 0 < r.ttft_s <= r.latency_s
        if num_pages == 64:
            assert {u.rid for u in steps[2]} == set(rids)  # the late two decoded beside the first two
        else:
            assert e.counters.preemptions > 0
        assert e.free_pages == e.num_pages


def test_submit_rejects_in_the_next_step_and_generate_will_not_swallow_pending_updates():
    e = engine(mixserve.load("tiny-kimi", dtype="float32"))
    bad, good = e.submit([], max_new_tokens=4), e.submit([1, 2, 3], max_new_tokens=2)
    with pytest.raises(RuntimeError, match="2 submitted requests are unfinished"):
        e.generate([[1, 2]], max_new_tokens=2)
    first = e.step()
    [rejected] = [u for u in first if u.rid == bad]
    assert rejected.new_tokens == [] and rejected.result.status == "rejected"
    assert rejected.result.reason == "empty prompt" and rejected.result.latency_s is None
    tokens = [t for u in first if u.rid == good for t in u.new_tokens]
    while e.has_work():
        tokens += [t for u in e.step() for t in u.new_tokens]
    assert len(tokens) == 2
    assert e.generate([[1, 2, 3]], max_new_tokens=2)[0].tokens == tokens
    assert e.step() == [] and not e.has_work()


def test_cancel_stops_a_request_wherever_it_is_and_frees_its_pages():
    """Cancelled waiting for a slot, mid-prefill (a prompt of several chunks) and while decoding:
    each finishes "aborted" ("cancelled") with the tokens it had, its pages come back at once,
    and the request that stays serves what it serves alone."""
    model = mixserve.load("tiny-kimi", dtype="float32")
    long, short, waits, stays = prompts()[3], prompts()[0], prompts()[1], prompts()[2]
    want = {id(p): r.tokens for p, r in zip((short, stays), engine(model).generate([short, stays], max_new_tokens=NEW))}
    e = engine(model, max_batch=2, prefill_chunk=4, min_prefill_tokens=4)
    a, b, c = (e.submit(p, max_new_tokens=NEW) for p in (long, short, waits))
    results, streamed = {}, {}

    def step():
        for u in e.step():
            streamed.setdefault(u.rid, []).extend(u.new_tokens)
            if u.result is not None:
                results[u.rid] = u.result

    step()  # a and b take the two slots; c waits
    assert [r.rid for r in e.scheduler.waiting] == [c] and e.cancel(c)
    step()  # b's prompt is done (5 tokens: two chunks); a's 14 need four
    assert [r.rid for r in e.scheduler.prefilling()] == [a] and [r.rid for r in e.scheduler.live()] == [b]
    held = e.pages_in_use
    assert e.cancel(a) and e.pages_in_use == held - 4  # admission gave a pages for its 14 tokens: 4 of 4
    d = e.submit(stays, max_new_tokens=NEW)  # takes a's slot
    step()
    step()
    assert e.cancel(b) and not e.cancel(b) and not e.cancel(12345)
    while e.has_work():
        step()
    assert {rid: (r.status, r.reason) for rid, r in results.items() if rid != d} == {
        rid: ("aborted", "cancelled") for rid in (a, b, c)}
    assert results[a].tokens == results[c].tokens == []
    assert 1 <= len(results[b].tokens) < NEW and results[b].tokens == want[id(short)][: len(results[b].tokens)]
    assert results[b].tokens == streamed[b]
    assert results[d].status == "ok" and results[d].tokens == want[id(stays)]
    assert not e.cancel(d) and e.free_pages == e.num_pages and e.counters.aborts == 0


def test_prefix_sharing_shares_full_pages_and_changes_nothing():
    model = mixserve.load("tiny-glm4", dtype="float32")
    rng = np.random.default_rng(4)
    system = [int(t) for t in rng.integers(0, 256, 9)]  # two full pages of 4, then one token
    ps = [system + [int(t) for t in rng.integers(0, 256, n)] for n in (3, 6, 2)]
    alone = engine(model, prefix_caching=False).generate(ps, max_new_tokens=NEW)
    e = engine(model, integrity="check")
    shared = e.generate(ps, max_new_tokens=NEW)
    assert [r.tokens for r in shared] == [r.tokens for r in alone]
    assert all(r.status == "ok" for r in shared)
    assert e.counters.shared_pages == 2 * 2  # requests 2 and 3 each reuse request 1's two full pages
    assert e.free_pages == e.num_pages  # every reference was given back


def test_hybrid_prefill_and_decode_weights(tmp_path):
    """FP8 weights for prefill, INT4 for decode, one KV pool between them: the first token comes
    from the last prompt position, which decode computes, so compare with the INT4-only engine;
    the prompt KV it reads was written by the FP8 prefill."""
    import hf_reference as ref
    from mixserve.quantize import plan_for, quantize_checkpoint
    from models.weights import WeightFormat

    src = tmp_path / "bf16"
    ref.save(ref.build("kimi-yarn-groups"), src)
    dirs = {}
    for name, fmt, scope in (("fp8", WeightFormat("fp8_block"), "all"), ("int4", WeightFormat("int4", 8), "all")):
        dirs[name] = str(tmp_path / name)
        quantize_checkpoint(str(src), dirs[name], plan_for(fmt, scope))
    fp8, int4 = (mixserve.load(dirs[n], dtype="float32", progress=False) for n in ("fp8", "int4"))
    ps = [[int(t) for t in np.random.default_rng(5).integers(0, 160, 9)]]
    hybrid = engine(fp8, decode_model=int4).generate(ps, max_new_tokens=3)[0]
    fp8_only = engine(fp8).generate(ps, max_new_tokens=3)[0]
    assert hybrid.status == "ok" and len(hybrid.tokens) == 3
    assert hybrid.tokens[0] == fp8_only.tokens[0]
    with pytest.raises(ValueError, match="same model"):
        engine(fp8, decode_model=mixserve.load("tiny-kimi", dtype="float32"))


def test_seeded_sampling_is_reproducible_and_top_p_narrows_to_greedy():
    model = mixserve.load("tiny-kimi", dtype="float32")
    ps = prompts(6)[:2]
    e = engine(model)
    a = e.generate(ps, max_new_tokens=NEW, temperature=1.5, seed=7)
    b = e.generate(ps, max_new_tokens=NEW, temperature=1.5, seed=7)  # same engine, a later call
    assert [r.tokens for r in a] == [r.tokens for r in b]
    others = [engine(model).generate(ps, max_new_tokens=NEW, temperature=1.5, seed=s) for s in (8, 9)]
    assert any([r.tokens for r in o] != [r.tokens for r in a] for o in others)
    # a 64-bit seed is its own: 2**32 + 7 shares 7's low word, and samples otherwise, repeatably
    wide = [e.generate(ps, max_new_tokens=NEW, temperature=1.5, seed=2**32 + 7) for _ in range(2)]
    assert [r.tokens for r in wide[0]] == [r.tokens for r in wide[1]] != [r.tokens for r in a]
    greedy = engine(model).generate(ps, max_new_tokens=NEW)
    for top_p in (1e-6, 1e-46):  # 1e-46 is 0 in float32: the top token still survives
        nucleus = engine(model).generate(ps, max_new_tokens=NEW, temperature=1.5, top_p=top_p, seed=3)
        assert [r.tokens for r in nucleus] == [r.tokens for r in greedy], top_p  # only the top token survives
    min_p = e.generate(ps, max_new_tokens=NEW, temperature=1.5, min_p=1.0, seed=3)  # likewise
    assert [r.tokens for r in min_p] == [r.tokens for r in greedy]
    with warnings.catch_warnings():  # a temperature past float32's largest is its largest, cast without overflow
        warnings.simplefilter("error")
        huge = e.generate(ps, max_new_tokens=NEW, temperature=1e300, seed=3)
    assert [r.tokens for r in huge] == [r.tokens for r in e.generate(ps, max_new_tokens=NEW, temperature=3e38, seed=3)]
    # Without a seed, copies of one prompt sample independently (best-of-n; a default seed of 0
    # made them all alike), and each Result names the seed that reproduces it.
    rids = [e.submit(ps[0], max_new_tokens=NEW, temperature=1.5) for _ in range(4)]
    done = {}
    while e.has_work():
        done.update({u.rid: u.result for u in e.step() if u.result is not None})
    copies = [done[r] for r in rids]
    assert len({tuple(r.tokens) for r in copies}) > 1 and len({r.seed for r in copies}) == 4
    again = e.generate([ps[0]], max_new_tokens=NEW, temperature=1.5, seed=copies[2].seed)[0]
    assert again.tokens == copies[2].tokens
    # A row's draw does not depend on its neighbours' options: beside a top-p request (its steps
    # sort the vocabulary) a temperature-only request samples what it did in steps that skip the sort.
    rid = e.submit(ps[0], max_new_tokens=NEW, temperature=1.5, seed=7)
    e.submit(ps[1], max_new_tokens=NEW, temperature=1.5, top_p=0.5, seed=7)
    while e.has_work():
        done.update({u.rid: u.result for u in e.step() if u.result is not None})
    assert done[rid].tokens == a[0].tokens


def test_a_seed_is_its_64_bits_and_one_below_2_to_the_32_keeps_its_key():
    """The step's key for (seed, request index i, token index t): fold_in(fold_in(jax.random.key(seed),
    i), t), the key 64-bit JAX makes of an int64 seed, and the one 32-bit seeds always had."""
    seeds = [0, 7, 2**32 - 1, 2**32 + 7, 2**40, -1, -2**63, 2**63 - 1]
    n = len(seeds)
    keys = np.stack([first_token_keys(seed, 1)[0] for seed in seeds])
    keys[:, 2:] = np.stack([np.arange(n) * 3 + 1, np.arange(n) + 5], 1)  # request and token indices
    got = np.asarray(jax.random.key_data(sampling_keys(Sampling.greedy(n)._replace(key_ints_B4=jnp.asarray(keys)))))
    want = lambda seed, i, t: np.asarray(jax.random.key_data(jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), i), t)))
    for row, (seed, (i, t)) in enumerate(zip(seeds, keys[:, 2:].tolist())):
        with jax.enable_x64():
            np.testing.assert_array_equal(got[row], want(seed, i, t), err_msg=str(seed))
        if 0 <= seed < 2**32:  # 32-bit JAX, the engine's
            np.testing.assert_array_equal(got[row], want(seed, i, t), err_msg=str(seed))
    assert len({tuple(k) for k in got}) == n


def test_per_request_stop_tokens_and_ignore_eos():
    """vLLM's per-request stop_token_ids (beside the engine's), ignore_eos (the engine's are
    ignored: how a benchmark fixes the output length) and min_tokens."""
    model = mixserve.load("tiny-kimi", dtype="float32")
    p = prompts(4)[:1]
    free = engine(model).generate(p, max_new_tokens=NEW)[0].tokens
    first = free.index(free[1])  # where the second token first appears: 0 or 1, before the end
    assert engine(model).generate(p, max_new_tokens=NEW, stop_token_ids=[free[1]])[0].tokens == free[: first + 1]
    eos = engine(model, stop_tokens=(free[0],))
    assert eos.generate(p, max_new_tokens=NEW)[0].tokens == free[:1]
    assert eos.generate(p, max_new_tokens=NEW, ignore_eos=True)[0].tokens == free
    # min_tokens: no stop token, its own or the engine's, is sampled before it has that many
    held = eos.generate(p, max_new_tokens=NEW, stop_token_ids=[free[1]], min_tokens=3)[0]
    taken_out = eos.generate(p, max_new_tokens=3, logit_bias={free[0]: -100, free[1]: -100})[0]
    assert held.tokens[:3] == taken_out.tokens and not {free[0], free[1]} & set(held.tokens[:3])
    assert len(held.tokens) == NEW or (len(held.tokens) > 3 and held.stop_reason == held.tokens[-1])
    for bad in ({"stop_token_ids": [model.config.vocab_size]}, {"stop_token_ids": 3}, {"ignore_eos": "yes"},
                {"min_tokens": NEW + 1}, {"min_tokens": -1}, {"min_tokens": 1.0}):
        res = eos.generate(p, max_new_tokens=NEW, **bad)[0]
        assert res.status == "rejected" and next(iter(bad)) in res.reason, bad


def _kept_distribution(logits, temperature, top_k, top_p, min_p):
    """float64 statement of the sampler: softmax(logits / T) without the tokens less likely than
    min_p times the likeliest, over the top_k tokens, renormalized, then the smallest most-likely
    prefix whose mass reaches top_p, renormalized."""
    order = np.argsort(-logits, kind="stable")
    z = logits[order] / temperature
    p = np.exp(z - z.max()) / np.exp(z - z.max()).sum()
    z = z[: min(top_k if top_k > 0 else len(z), int(np.sum(p >= min_p * p.max())))]
    p = np.exp(z - z.max()) / np.exp(z - z.max()).sum()
    kept = int(np.searchsorted(np.cumsum(p), top_p - 1e-12) + 1)
    out = np.zeros(len(logits))
    out[order[:kept]] = p[:kept] / p[:kept].sum()
    return out


@pytest.mark.parametrize("top_k, top_p, min_p", [(3, 1.0, 0), (3, 0.75, 0), (0, 0.6, 0), (-1, 1.0, 0), (1, 1.0, 0),
                                                 (0, 1.0, 0.3), (4, 0.8, 0.3)])
def test_sampled_frequencies_follow_temperature_min_p_top_k_then_top_p(top_k, top_p, min_p):
    """20,000 rows of one 6-token distribution, each with its own key: token frequencies are
    within 0.02 of the float64 statement (a binomial standard deviation is at most
    sqrt(0.25 / 20000) = 0.0035, so 0.02 is 5.7 of them), and a dropped token never appears."""
    n, temperature, greedy_rows = 20_000, 1.3, 100
    logits = np.array([1.0, 2.5, -0.5, 2.0, 0.3, 1.6], np.float32)
    temperatures = jnp.full(n + greedy_rows, temperature, jnp.float32).at[n:].set(0.0)  # mixed in one call
    n += greedy_rows
    sampling = Sampling.greedy(n)._replace(
        temperature_B=temperatures, top_p_B=jnp.full(n, top_p, jnp.float32), top_k_B=jnp.full(n, max(top_k, 0), jnp.int32),
        min_p_B=jnp.full(n, min_p, jnp.float32),
        key_ints_B4=jnp.asarray(first_token_keys(11, n)))
    tokens, picked = map(np.asarray, jax.jit(sample)(jnp.tile(logits, (n, 1)), sampling))
    assert np.all(tokens[n - greedy_rows:] == np.argmax(logits))
    want = _kept_distribution(logits.astype(np.float64), temperature, top_k, top_p, min_p)
    # What each row picked from (the processed logprobs modes report it): a sampled row's softmax is
    # the float64 statement within float32 rounding (a few ulps of probabilities <= 1: 1e-6), its
    # dropped tokens at -inf; a greedy row's, the logits as they came.
    np.testing.assert_allclose(np.exp(picked[0] - np.logaddexp.reduce(picked[0].astype(np.float64))), want, atol=1e-6)
    assert np.all(np.isneginf(picked[0][want == 0])) and np.all(picked[n - 1] == logits)
    got = np.bincount(tokens[: n - greedy_rows], minlength=len(logits)) / (n - greedy_rows)
    assert np.all(got[want == 0] == 0) and np.max(np.abs(got - want)) < 0.02, (got, want)


def test_top_p_1_keeps_every_token_where_the_float32_cumsum_reaches_1_early():
    """A row at top_p=1 in a step that sorts (the other row asks for top_p < 1) keeps the whole
    vocabulary: one token with all but 9e-11 of the mass rounds the float32 cumsum to 1.0 before
    the tail, which `cumsum - p < top_p` alone would drop (999 tokens here)."""
    scaled_BV = jnp.zeros((2, 1000)).at[:, 7].set(30.0)
    s = Sampling.greedy(2)._replace(temperature_B=jnp.ones(2), top_p_B=jnp.array([1.0, 0.5]))
    kept_BV = np.asarray(_kept_by_top_k_top_p(scaled_BV, s))
    assert kept_BV[0].all() and kept_BV[1].sum() == 1 and kept_BV[1, 7]


def test_logprobs_are_the_models_log_softmax_with_rank_and_top_n():
    """logprobs=n: each generated token's log-probability and rank, and the n likeliest tokens, of
    the model's raw distribution at that position (before temperature, top-k and top-p): the
    log_softmax of the cache-free forward over the same tokens, within 1e-5 (float32 throughout,
    KV included, so only the summation order differs: 4.8e-7 seen, one ulp of the largest
    |logprob|, 5.4; 1e-5 is 20 of them). Greedy and sampled requests
    in one batch with one that asks for none (None in its Result and Updates); the
    Updates stream what the Result holds; the first token (sampled in prefill) has them too.
    logprobs past max_logprobs or not an integer are rejected per request."""
    model = mixserve.load("tiny-kimi", dtype="float32")
    ps = prompts(9)[:3]
    e = engine(model, max_logprobs=5)
    options = [dict(logprobs=5), dict(logprobs=0, temperature=2.0, top_k=3, top_p=0.9, seed=1), dict()]
    rids = [e.submit(p, max_new_tokens=NEW, **o) for p, o in zip(ps, options)]
    streamed, results = {rid: [] for rid in rids}, {}
    while e.has_work():
        for u in e.step():
            assert (u.new_logprobs is None) == (u.rid == rids[2]) and len(u.new_logprobs or u.new_tokens) == len(u.new_tokens)
            streamed[u.rid] += u.new_logprobs or []
            if u.result is not None:
                results[u.rid] = u.result
    assert results[rids[2]].logprobs is None
    for p, rid, n in zip(ps, rids, (5, 0)):
        r = results[rid]
        assert r.status == "ok" and len(r.logprobs) == NEW and streamed[rid] == r.logprobs
        seq = np.asarray([p + r.tokens[:-1]], np.int32)
        want = np.asarray(jax.nn.log_softmax(model.logits(seq)[0, len(p) - 1:], axis=-1))  # [NEW, vocab]
        for token, got, want_V in zip(r.tokens, r.logprobs, want):
            np.testing.assert_allclose(got.logprob, want_V[token], atol=1e-5)
            assert got.rank == 1 + np.sum(want_V > want_V[token] + 1e-5) and len(got.top) == n
            ids = [i for i, _ in got.top]
            np.testing.assert_allclose([v for _, v in got.top], want_V[ids], atol=1e-5)
            np.testing.assert_allclose(sorted(want_V, reverse=True)[:n], want_V[ids], atol=1e-5)
            if n:
                assert got.top[0][0] == token and got.top[0][1] == got.logprob  # greedy: its token leads
    assert any(lp.rank > 1 for lp in results[rids[1]].logprobs)  # sampled at temperature 2 from the top 3
    for bad in (6, -1, 1.0, True):
        res = e.generate(ps[:1], max_new_tokens=1, logprobs=bad)[0]
        assert res.status == "rejected" and "logprobs must be None or an integer in [0, max_logprobs=5]" in res.reason
        assert res.logprobs == []  # it asked: an empty list, as its Update streamed
    for bad in (model.config.vocab_size + 1, 2.5, True):
        with pytest.raises(ValueError, match="max_logprobs must be an integer in"):
            engine(model, max_logprobs=bad)


def assert_prompt_logprobs(model, prompt, got, n):
    """got: a Result's prompt_logprobs, against the log_softmax of the cache-free forward over the
    prompt (bound: as for generated tokens' logprobs, above)."""
    want = np.asarray(jax.nn.log_softmax(model.logits(np.asarray([prompt], np.int32))[0], axis=-1))  # [T, vocab]
    assert len(got) == len(prompt) and got[0] is None
    for j, lp in enumerate(got[1:], start=1):
        want_V = want[j - 1]
        np.testing.assert_allclose(lp.logprob, want_V[prompt[j]], atol=1e-5)
        assert lp.rank == 1 + np.sum(want_V > want_V[prompt[j]] + 1e-5) and len(lp.top) == n
        ids = [i for i, _ in lp.top]
        np.testing.assert_allclose([v for _, v in lp.top], want_V[ids], atol=1e-5)
        np.testing.assert_allclose(np.sort(want_V)[::-1][:n], want_V[ids], atol=1e-5)


@pytest.mark.parametrize("vocab, block, n", [(1000, 256, 5), (1024, 256, 0), (300, 512, 3), (70, 16, 20)])
def test_blocked_logprobs_equal_those_of_the_whole_logits(vocab, block, n):
    """Prompt logprobs a vocabulary block at a time (a last block cut short, one block, more top
    tokens than a block holds) against logprobs_of the whole [rows, vocab] logits: the same ranks
    and top ids, log-probabilities within float32 summation order (1e-5); the first and last
    vocabulary entries as targets.

    The inputs are multiples of 2^-7 in [-2, 2): each logit, a sum of 32 products that are multiples
    of 2^-14 below 4, needs 21 bits and is exact in float32 in any summation order. With normal
    draws the two orders differed by an ulp in 2% of logits, and swapped two near-tied top ids in 5
    of 20000 seeds. Exact ties both break by the lower id."""
    seed = int.from_bytes(os.urandom(4), "little")
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.integers(-256, 256, (9, 32)) / 128, jnp.float32)
    head = jnp.asarray(rng.integers(-256, 256, (32, vocab)) / 128, jnp.float32)
    tokens = jnp.asarray([0, vocab - 1, *rng.integers(0, vocab, 7)], jnp.int32)
    want = logprobs_of(jnp.dot(x, head, preferred_element_type=jnp.float32), tokens, n)
    got = blocked_logprobs(x, head, tokens, n, block)
    np.testing.assert_array_equal(np.asarray(got.rank_B), np.asarray(want.rank_B), err_msg=f"seed={seed}")
    np.testing.assert_array_equal(np.asarray(got.top_ids_BN), np.asarray(want.top_ids_BN), err_msg=f"seed={seed}")
    np.testing.assert_allclose(np.asarray(got.token_B), np.asarray(want.token_B), atol=1e-5, err_msg=f"seed={seed}")
    np.testing.assert_allclose(np.asarray(got.top_BN), np.asarray(want.top_BN), atol=1e-5, err_msg=f"seed={seed}")


def test_prompt_logprobs_are_the_models_log_softmax_over_the_prompt():
    """prompt_logprobs=n: each prompt token's log-probability, rank and the n likeliest tokens at
    the position before it (None for the first), as prefill computes them: over prompts of one
    and of two chunks (8), prefilled together with one that asks for none, and a one-token prompt.
    They come in a request's first Update (with its first token) and in its Result. A request
    asking for them computes its whole prompt: of three identical prompts submitted together, the
    one that does not ask shares the first one's pages, and the third, asking, computes its own.
    Values past max_logprobs are rejected per request."""
    model = mixserve.load("tiny-kimi", dtype="float32")
    ps = prompts(10)  # 5, 11, 1, 14 tokens
    e = engine(model, max_logprobs=5)
    options = [dict(prompt_logprobs=5), dict(prompt_logprobs=0, logprobs=1), dict(prompt_logprobs=3), dict()]
    rids = [e.submit(p, max_new_tokens=3, **o) for p, o in zip(ps, options)]
    firsts, results = {}, {}
    while e.has_work():
        for u in e.step():
            if u.rid not in firsts:
                firsts[u.rid] = u.prompt_logprobs
            else:
                assert u.prompt_logprobs is None
            if u.result is not None:
                results[u.rid] = u.result
    assert results[rids[3]].prompt_logprobs is None and firsts[rids[3]] is None
    for p, rid, o in zip(ps, rids, options[:3]):
        r = results[rid]
        assert r.status == "ok" and firsts[rid] == r.prompt_logprobs
        assert_prompt_logprobs(model, p, r.prompt_logprobs, o["prompt_logprobs"])
    assert len(results[rids[1]].logprobs) == 3  # the generated tokens' are there too
    assert results[rids[2]].prompt_logprobs == [None]  # one token: nothing before it
    shared = e.counters.shared_pages
    again = [e.submit(ps[3], max_new_tokens=3, prompt_logprobs=n) for n in (4, None, 4)]  # the first still runs when the second comes
    results = {u.rid: u.result for _ in iter(e.has_work, False) for u in e.step() if u.result}
    assert e.counters.shared_pages == shared + 3  # the 14-token prompt's 3 full pages, once: by the one not asking
    first, _, last = (results[rid].prompt_logprobs for rid in again)
    assert results[again[1]].prompt_logprobs is None
    for got in (first, last):
        assert_prompt_logprobs(model, ps[3], got, 4)
    for bad in (6, -1, 2.0, True):
        res = e.generate(ps[:1], max_new_tokens=1, prompt_logprobs=bad)[0]
        assert res.status == "rejected" and "prompt_logprobs must be None or an integer in [0, max_logprobs=5]" in res.reason
        assert res.prompt_logprobs == []


class LetterTokenizer:
    """Each id decodes to one letter (id mod 26): stop strings over known token boundaries."""

    def encode(self, text):
        return [ord(c) - 97 for c in text]

    def decode(self, ids):
        return "".join(chr(97 + t % 26) for t in ids)


def test_stop_strings_end_a_request_once_its_output_contains_one():
    """stop=(strings): a request finishes at the token that completes the first stop string in its
    decoded output (kept in its tokens, as vLLM keeps it), and stop_reason names the string, or
    the stop token id that ended it (None at max_new_tokens). Greedy tokens fix where each string
    first occurs. A model without a tokenizer rejects stop strings per request, as it does
    malformed ones."""
    model = mixserve.load("tiny-kimi", dtype="float32")
    p = prompts(11)[3]
    letters = dataclasses.replace(model, tokenizer=LetterTokenizer())
    e = engine(letters)
    free = e.generate([p], max_new_tokens=10)[0]
    text = LetterTokenizer().decode(free.tokens)
    assert free.stop_reason is None and len(free.tokens) == 10
    late, early = text[5:8], text[2:4]  # each first occurs where it was cut from, or before
    end = lambda s: text.find(s) + len(s)
    assert end(early) < end(late)  # so early alone is complete when a request with both stops
    cases = [((late,), late), ((late, early), early), ((early, late), early), (("zzzzzzzzzzz",), None)]
    for stop, reason in cases:
        r = e.generate([p], max_new_tokens=10, stop=stop)[0]
        assert r.status == "ok" and r.stop_reason == reason
        assert r.tokens == free.tokens[:end(reason) if reason else 10]
    by_id = e.generate([p], max_new_tokens=10, stop_token_ids=(free.tokens[3],), stop=(late,))[0]
    assert by_id.stop_reason == free.tokens[3] and by_id.tokens == free.tokens[:free.tokens.index(free.tokens[3]) + 1]
    assert e.generate([p], max_new_tokens=10, stop=early)[0].tokens == free.tokens[:end(early)]  # one string, as vLLM
    assert e.generate([p], max_new_tokens=10, stop=None)[0].tokens == free.tokens
    for bad in (("",), "", (3,)):
        r = e.generate([p], max_new_tokens=2, stop=bad)[0]
        assert r.status == "rejected" and "stop must be a list of non-empty strings" in r.reason
    r = engine(model).generate([p], max_new_tokens=2, stop=("a",))[0]
    assert r.status == "rejected" and "stop strings need the model's tokenizer" in r.reason


def test_public_api_exports_the_engine():
    assert mixserve.Engine is Engine and mixserve.Result.__name__ == "Result"


def test_pallas_kernels_serve_the_same_tokens(model):
    """The backend switch end to end: one INT4 model (all linear weights and experts, group 16)
    on FP8 pages, served with the XLA references and with the Pallas kernels (interpret mode on
    CPU): INT4 dense and grouped-MoE matmuls in prefill and decode, GQA or MLA paged decode
    attention (GLM-5: sparse, over the DSA choice). Only the backend name changes; the greedy
    tokens must not."""
    int4, _ = quantize_model(model, plan_for(WeightFormat("int4", 16), "all"))
    rng = np.random.default_rng(2)
    # Longer than tiny-glm5's index_topk (16): the DSA choice drops tokens.
    ps = [[int(t) for t in rng.integers(0, 256, n)] for n in (5, 37, 1, 30)]
    # One decode row count and one chunk length: each interpret-mode shape costs seconds to compile.
    kw = dict(kv_dtype="fp8_e4m3", min_decode_rows=4, min_prefill_tokens=8, min_prefill_rows=4)
    xla_engine = engine(int4, **kw)
    kernel_engine = engine(dataclasses.replace(int4, backend="interpret"), attention_backend="interpret", **kw)
    ref = xla_engine.generate(ps, max_new_tokens=4)
    kernels = kernel_engine.generate(ps, max_new_tokens=4)
    assert all(r.status == "ok" for r in ref + kernels)
    assert [r.tokens for r in kernels] == [r.tokens for r in ref]
    # The decode step really runs the kernels (named pallas_calls), and the XLA one none.
    attention = "paged_attention_mla" if model.config.attention_kind == "mla" else "paged_attention_gqa"
    text = kernel_engine.lowered_decode_text()
    assert "int4_matmul/pallas_call" in text
    assert f"{attention}/pallas_call" in text  # GLM-5: the sparse MLA kernel over the DSA choice
    assert "/pallas_call" not in xla_engine.lowered_decode_text()


def test_dsa_choosing_every_token_takes_the_dense_kernel():
    """When index_topk covers the whole context (max_seq_len <= top-k), the indexer's choice is
    every cached token: the kernel backend then reads pages with the dense MLA kernel instead of
    gathering token by token, and serves the same tokens as XLA's masked attention."""
    glm5 = mixserve.load("tiny-glm5", dtype="float32")
    assert glm5.config.index_topk == 16
    ps = prompts(3)[:2]  # 5 and 11 tokens, + 4 new <= 16
    kw = dict(max_seq_len=16, kv_dtype="fp8_e4m3")
    ref = engine(glm5, **kw).generate(ps, max_new_tokens=4)
    dense = engine(dataclasses.replace(glm5, backend="interpret"), attention_backend="interpret", **kw)
    assert [r.tokens for r in dense.generate(ps, max_new_tokens=4)] == [r.tokens for r in ref]
    assert all(r.status == "ok" for r in ref)


def test_a_logit_bias_moves_greedy_and_sampled_picks_and_leaves_logprobs_the_models():
    model = mixserve.load("tiny-kimi", dtype="float32")
    ps = prompts(6)[:2]
    e = engine(model)
    plain = e.generate(ps, max_new_tokens=1, logprobs=2)
    first = [r.tokens[0] for r in plain]
    away = e.generate(ps, max_new_tokens=1, logprobs=2, logit_bias={t: -100 for t in first})
    for p, a in zip(plain, away):  # the likeliest barred: the runner-up, at the model's own logprob
        assert a.tokens[0] == p.logprobs[0].top[1][0] and a.logprobs[0].logprob == pytest.approx(p.logprobs[0].top[1][1])
        assert a.logprobs[0].rank == 2
    for temperature in (0.0, 1.5):
        assert all(r.tokens == [9] * NEW for r in e.generate(ps, max_new_tokens=NEW, temperature=temperature, seed=1,
                                                             logit_bias={9: 100}))
    assert [r.tokens for r in e.generate(ps, max_new_tokens=NEW, logit_bias={})] == \
        [r.tokens for r in e.generate(ps, max_new_tokens=NEW)]
    V = model.config.vocab_size
    for bias in ({V: 1}, {-1: 1}, {1: 100.5}, {1: float("nan")}, {1: True}, [(1, 1)], {i: 1 for i in range(301)}):
        (r,) = e.generate(ps[:1], max_new_tokens=2, logit_bias=bias)
        assert r.status == "rejected" and "logit_bias must map at most 300 token ids" in r.reason, bias


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_priority_admits_lower_values_first_and_preempts_the_highest(policy):
    """One slot, four requests queued with priorities 3, 1, 3, 0: "priority" admits them 0, 1,
    then the two 3s in arrival order; "fcfs" (all 0: it refuses others, as vLLM) in arrival order.
    Then a pool of 5 pages of 4 for two requests of 2 + 16 tokens: when one must go, fcfs preempts
    the younger, "priority" the older of priority 1 over the younger of priority 0, which then
    finishes first. Every output is a roomy engine's; a priority that is not an integer (or not 0
    under fcfs) is that request's rejection."""
    model = mixserve.load("tiny-glm4", dtype="float32")
    e = engine(model, max_batch=1, schedule_policy=policy)
    queued = prompts(3)
    level = (lambda pr: pr) if policy == "priority" else (lambda pr: 0)  # fcfs refuses any other
    rids = [e.submit(p, max_new_tokens=2, priority=level(pr)) for p, pr in zip(queued, (3, 1, 3, 0))]
    admitted, results = [], {}
    while e.has_work():
        for u in e.step():
            admitted += [u.rid] if u.rid not in admitted else []
            results |= {u.rid: u.result} if u.result is not None else {}
    assert admitted == ([rids[3], rids[1], rids[0], rids[2]] if policy == "priority" else rids)
    assert [results[r].tokens for r in rids] == [greedy_reference(model, p, 2) for p in queued]
    rng = np.random.default_rng(7)
    pa, pb = ([int(t) for t in rng.integers(0, 256, 2)] for _ in range(2))
    e = engine(model, num_pages=5, schedule_policy=policy)
    old, young = e.submit(pa, max_new_tokens=16, priority=level(1)), e.submit(pb, max_new_tokens=16, priority=0)
    finished = {}
    while e.has_work():
        finished |= {u.rid: u.result.tokens for u in e.step() if u.result is not None and u.result.status == "ok"}
    assert e.counters.preemptions >= 1 and list(finished) == ([young, old] if policy == "priority" else [old, young])
    roomy = engine(model, num_pages=64)
    assert [finished[old], finished[young]] == [roomy.generate([p], max_new_tokens=16)[0].tokens for p in (pa, pb)]
    assert e.free_pages == e.num_pages
    [bad] = e.generate([pa], max_new_tokens=2, priority=1.5 if policy == "priority" else 1)
    assert bad.status == "rejected" and ("priority must be an integer" if policy == "priority" else
                                         "priority 1 needs schedule_policy 'priority'") in bad.reason
