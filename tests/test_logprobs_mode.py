"""Engine(logprobs_mode=...), vLLM's --logprobs-mode: a request's logprobs of the model's raw
distribution or of the one each token was drawn from (temperature, truncation, logit bias,
penalties), as log-probabilities or logits; against a float64 statement of the sampler."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mixserve
from mixserve import run, server
from mixserve.disaggregated import DisaggregatedEngine
from mixserve.engine import Engine
from mixserve.sampling import Sampling, sample
from conftest import ONE_STEP_SHAPE
from test_engine import _kept_distribution, engine, prompts
from test_penalties import dense_penalties
from test_server import FLAGS, PROMPT, post, serving

# Greedy and sampled rows, with and without truncation, bias and penalties, in one batch.
REQUESTS = (dict(temperature=0.8, top_k=4, top_p=0.9, min_p=0.05, seed=3),
            dict(temperature=0.0, logit_bias={7: 3.0}, repetition_penalty=1.3),
            dict(temperature=1.2, top_p=0.7, frequency_penalty=0.4, presence_penalty=0.2, logit_bias={11: -2.0}, seed=5))
TOP = 6


def served(e, prompts, requests=REQUESTS, before_step=lambda: None, **common):
    """requests on prompts, submitted together (greedy and sampled rows share steps), each asking
    for its TOP likeliest tokens -> their Results."""
    rids = [e.submit(p, logprobs=TOP, **common, **o) for p, o in zip(prompts, requests)]
    done = {}
    while e.has_work():
        before_step()
        done.update({u.rid: u.result for u in e.step() if u.result is not None})
    return [done[rid] for rid in rids]


def reference(model, prompt, tokens, options, mode):
    """[position] -> float64 values of every token, as the mode names them: the raw logits of the
    cache-free forward, or those after the request's bias, penalties (the output so far counted),
    temperature and truncation (a greedy row's at temperature 1, untruncated; the rest at -inf),
    as log-probabilities or as logits."""
    seq = np.asarray([prompt + tokens[:-1]], np.int32)
    raw_TV = np.asarray(model.logits(seq), np.float64)[0, len(prompt) - 1:]
    out = []
    for j, raw_V in enumerate(raw_TV):
        values = raw_V
        if mode.startswith("processed"):
            z = raw_V.copy()
            for token, bias in options.get("logit_bias", {}).items():
                z[token] += bias
            z = dense_penalties(z, prompt, tokens[:j], options.get("repetition_penalty", 1.0),
                                options.get("frequency_penalty", 0.0), options.get("presence_penalty", 0.0))
            T = options["temperature"]
            if T == 0:
                values = z
            else:
                kept = _kept_distribution(z, T, options.get("top_k", 0), options.get("top_p", 1.0), options.get("min_p", 0.0))
                values = np.where(kept > 0, z / T, -np.inf)
        if mode.endswith("logprobs"):
            values = values - np.logaddexp.reduce(values)
        out.append(values)
    return out


def assert_mode(model, prompts, results, mode, requests=REQUESTS):
    """Each token's value and its TOP likeliest (only tokens it could have drawn) are the
    reference's, within 1e-5 x max(1, 0.8 / T). Bound: float32 throughout, KV included, so the
    logits differ from the cache-free forward's in summation order only (4.8e-7 seen in the raw
    logprobs test); a repetition penalty multiplies a negative one by 1.3, a processed value
    divides them by T and subtracts a log-sum-exp over the kept tokens, whose error is at most the
    largest logit's: under 2 x 4.8e-7 x 1.3 / T, 1.6e-6 at T = 0.8; the bound is 6 of those."""
    for p, options, r in zip(prompts, requests, results):
        assert r.status == "ok", r.reason
        T = options["temperature"]
        atol = 1e-5 * max(1.0, 0.8 / T) if mode.startswith("processed") and T > 0 else 1e-5
        for token, got, want_V in zip(r.tokens, r.logprobs, reference(model, p, r.tokens, options, mode)):
            np.testing.assert_allclose(got.logprob, want_V[token], atol=atol)
            assert got.rank == 1 + np.sum(want_V > want_V[token] + atol)
            finite = np.sort(want_V[np.isfinite(want_V)])[::-1]
            assert len(got.top) == min(TOP, len(finite)), (mode, got.top)
            ids = [t for t, _ in got.top]
            np.testing.assert_allclose([v for _, v in got.top], want_V[ids], atol=atol)
            np.testing.assert_allclose(finite[: len(ids)], want_V[ids], atol=atol)


def test_each_mode_reports_what_the_sampler_drew_from_and_samples_the_same_tokens():
    """The mode changes what is reported, never what is drawn: the same seeds give the same tokens
    in every mode. Processed values are of the distribution each token was drawn from: the
    truncated tokens are gone from `top` (fewer than asked where fewer were kept), and the
    sampled token is always among those kept. Prompt logprobs are the raw log-probabilities in
    every mode, as vLLM's."""
    model = mixserve.load("tiny-kimi", dtype="float32")
    runs = {}
    for mode in ("raw_logprobs", "processed_logprobs", "raw_logits", "processed_logits"):
        runs[mode] = served(engine(model, max_logprobs=TOP, logprobs_mode=mode), prompts(2), max_new_tokens=6,
                            prompt_logprobs=2)
        assert_mode(model, prompts(2), runs[mode], mode)
    tokens = {mode: [r.tokens for r in results] for mode, results in runs.items()}
    assert len({str(t) for t in tokens.values()}) == 1, tokens
    truncated = [lp for lp in runs["processed_logprobs"][0].logprobs if len(lp.top) < TOP]
    assert truncated  # top-k 4: at most 4 tokens could be drawn
    raw = [lp.logprob for lp in runs["raw_logprobs"][0].prompt_logprobs[1:]]
    assert len(raw) == len(prompts(2)[0]) - 1 and max(raw) < 0
    for mode in ("processed_logprobs", "raw_logits", "processed_logits"):  # other programs: float32 rounding apart
        np.testing.assert_allclose([lp.logprob for lp in runs[mode][0].prompt_logprobs[1:]], raw, atol=1e-6)


def test_speculative_verification_reports_each_positions_own_distribution():
    """Drafts kept or rejected (a rejected draft's replacement is drawn from the rest of the
    distribution): each emitted token's processed logprob, rank and likeliest tokens are those of
    its own position's distribution, its penalties counting the output before it. Before each
    step a request's draft is the cache-free forward's likeliest next token: a sampled row keeps it
    with its probability, so both happen. The tiny random model is nearly flat: low temperatures
    make that probability large enough."""
    model = mixserve.load("tiny-kimi", dtype="float32")
    requests = (dict(temperature=0.05, top_k=3, seed=3), REQUESTS[1],
                dict(temperature=0.1, top_p=0.9, frequency_penalty=0.4, presence_penalty=0.2, seed=5))
    e = Engine(model, num_pages=64, page_size=8, max_batch=4, stop_tokens=(), speculative_tokens=3, draft="ngram",
               max_logprobs=TOP, logprobs_mode="processed_logprobs", **ONE_STEP_SHAPE)

    def draft():
        for r in e.scheduler.running:
            if r.prefilled:
                seq = np.zeros((1, 32), np.int32)  # one shape: one compile (causal: the padding is unseen)
                seq[0, :len(r.tokens)] = r.tokens
                r.drafts = [int(np.argmax(np.asarray(model.logits(seq))[0, len(r.tokens) - 1]))]

    results = served(e, prompts(2), requests, before_step=draft, max_new_tokens=10)
    assert 0 < e.counters.accepted_tokens < e.counters.drafted_tokens, e.counters
    assert_mode(model, prompts(2), results, "processed_logprobs", requests)


def test_the_sampler_returns_a_grammars_mask_in_what_each_row_picked_from():
    """A structured output's mask is part of the processed distribution: outside it, -inf in
    what a greedy and a sampled row picked from; inside, each row's logits (the sampled row's
    divided by its temperature: no truncation asked)."""
    V = 70
    logits = jax.random.normal(jax.random.key(0), (2, V)) * 2
    allowed = np.zeros(V, bool)
    allowed[[3, 17, 40, 64, 69]] = True
    words = np.zeros(3, np.uint32)  # token v: bit v % 32 of word v // 32 (mixserve/grammar.py)
    for v in np.flatnonzero(allowed):
        words[v // 32] |= np.uint32(1 << (v % 32))
    words = words.view(np.int32)
    s = Sampling.greedy(2, words=3)._replace(temperature_B=jnp.array([0.0, 0.5]), allowed_BW=jnp.asarray(np.tile(words, (2, 1))),
                                             key_ints_B4=jnp.ones((2, 4), jnp.uint32))
    tokens, picked = map(np.asarray, jax.jit(sample)(logits, s))
    assert allowed[tokens].all()
    assert np.all(np.isneginf(picked[:, ~allowed]))
    np.testing.assert_allclose(picked[:, allowed], np.asarray(logits)[:, allowed] / np.array([[1.0], [0.5]]), rtol=1e-6)


def test_a_bad_mode_or_a_pair_of_two_modes_is_refused_and_run_reports_the_mode():
    model = mixserve.load("tiny-kimi", dtype="float32")
    with pytest.raises(ValueError, match="logprobs_mode must be one of raw_logprobs, processed_logprobs, raw_logits, "
                                         "processed_logits, got 'processed'"):
        engine(model, logprobs_mode="processed")
    with pytest.raises(ValueError, match="logprobs_mode must be the same on both engines"):
        DisaggregatedEngine(engine(model, prefill_only=True, logprobs_mode="processed_logprobs"), engine(model))
    report = run.main(["--model", "tiny-kimi", "--max-new-tokens", "3", "--temperature", "1", "--top-k", "2",
                       "--logprobs", "5", "--logprobs-mode", "processed_logprobs", "--json"])
    assert report["logprobs_mode"] == "processed_logprobs"
    for r in report["requests"]:
        assert all(len(lp["top"]) <= 2 and lp["logprob"] > -np.inf for lp in r["logprobs"]), r["logprobs"]


def test_the_server_serves_processed_logprobs_as_finite_json():
    """`--logprobs-mode processed_logprobs`: a top-k 2 completion lists at most 2 alternatives, each
    finite (strict JSON has no -Infinity), the sampled token's among them."""
    s = serving(server.make_server([*FLAGS, "--port", "0", "--logprobs-mode", "processed_logprobs"]))
    try:
        status, body = post(s, {"prompt": PROMPT, "max_tokens": 4, "temperature": 1.0, "top_k": 2, "seed": 1,
                                "logprobs": 5, "return_tokens_as_token_ids": True})  # names: distinct
        assert status == 200, body
        lp = body["choices"][0]["logprobs"]
        assert len(lp["token_logprobs"]) == 4
        for token, value, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
            assert len(top) == 2 and all(np.isfinite(v) for v in top.values()) and top[token] == value, top
            np.testing.assert_allclose(np.logaddexp.reduce(list(top.values())), 0.0, atol=1e-6)  # all that was kept
    finally:
        s.close()
