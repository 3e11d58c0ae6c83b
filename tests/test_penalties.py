"""Repetition, frequency and presence penalties (mixserve/sampling.py): the sparse in-step form
against a float64 statement of vLLM's dense one, greedy decoding against the cache-free forward
with the same penalties, sampling frequencies, speculative verification (each position counts
the drafts before it), validation, and the steps a penalized request compiles."""

import numpy as np
import jax
import jax.numpy as jnp
import pytest

import mixserve
from mixserve.engine import Engine
from mixserve.model_runner import penalty_width
from mixserve.request import Request
from mixserve.sampling import NO_TOKEN, Sampling, apply_penalties, first_token_keys, sample
from test_speculative import _engine, _prompts, _run_with_oracle

PENALTIES = dict(repetition_penalty=1.8, frequency_penalty=0.7, presence_penalty=0.4)


def dense_penalties(logits, prompt, output, repetition, frequency, presence):
    """vLLM's statement, float64, over the whole vocabulary: bin counts of the output, a mask of
    prompt or output tokens; divide positive / multiply other logits of masked tokens by the
    repetition penalty, then subtract frequency x count and presence x (count > 0)."""
    V = len(logits)
    counts = np.bincount(np.asarray(output, np.int64), minlength=V)[:V].astype(np.float64)
    seen = (np.bincount(np.asarray(list(prompt) + list(output), np.int64), minlength=V)[:V] > 0)
    x = np.asarray(logits, np.float64)
    x = np.where(seen, np.where(x > 0, x / repetition, x * repetition), x)
    return x - frequency * counts - presence * (counts > 0)


def sparse_rows(histories, U):
    """The runner's lists for rows of (prompt, output): distinct tokens and their output counts."""
    ids, counts = np.full((len(histories), U), NO_TOKEN, np.int32), np.zeros((len(histories), U), np.int32)
    for b, (prompt, output) in enumerate(histories):
        c = dict.fromkeys(prompt, 0)
        for t in output:
            c[t] = c.get(t, 0) + 1
        ids[b, :len(c)], counts[b, :len(c)] = list(c), list(c.values())
    return ids, counts


@pytest.mark.parametrize("with_drafts", [False, True])
def test_penalties_equal_vllms_dense_statement_in_float64(with_drafts):
    """Fresh random logits (exact zeros among them: the repetition branch at 0), histories with
    repeated tokens, penalties of either sign, an unpenalized row; with drafts, up to 3 more
    output tokens per row, repeating seen tokens and each other (row 0: one token three times).
    Tokens outside the lists come back bit for bit. The rest are within the float32 bound of the
    float64 statement on the same float32 inputs: four roundings (the divide or multiply, the
    frequency product, its sum with presence, the subtraction), each at most 2^-24 of its own
    result's magnitude, doubled for a division XLA may compute as a reciprocal and a multiply:
    2^-23 x (|x'| + |f c| + |f c + p| + |result|), x' the logit after the repetition penalty."""
    rng = np.random.default_rng()
    B, V, U, E = 7, 40, 64, 3
    logits = rng.normal(0, 3, (B, V)).astype(np.float32)
    logits[rng.random((B, V)) < 0.1] = 0.0
    histories = [(list(rng.integers(0, V, rng.integers(1, 20))), list(rng.integers(0, V // 2, rng.integers(0, 15))))
                 for _ in range(B)]
    rep = rng.uniform(0.3, 3, B).astype(np.float32)
    freq, pres = rng.uniform(-2, 2, B).astype(np.float32), rng.uniform(-2, 2, B).astype(np.float32)
    rep[3], freq[3], pres[3] = 1, 0, 0
    histories[3] = (histories[3][0], [])  # unpenalized: the runner lists nothing for it
    ids, counts = sparse_rows(histories, U)
    ids[3], counts[3] = NO_TOKEN, 0
    drafted = np.full((B, E), NO_TOKEN, np.int32)
    if with_drafts:
        for b in range(B):
            if b != 3:
                n = rng.integers(0, E + 1)
                drafted[b, :n] = rng.choice([*histories[b][1], *histories[b][0], *rng.integers(0, V, 2)], n)
        drafted[0, :] = histories[0][0][0]  # one token (a prompt's) drafted three times
    s = Sampling.greedy(B, seen=U)._replace(repetition_B=jnp.asarray(rep), frequency_B=jnp.asarray(freq),
                                            presence_B=jnp.asarray(pres), seen_ids_BU=jnp.asarray(ids),
                                            output_counts_BU=jnp.asarray(counts))
    got = np.asarray(jax.jit(apply_penalties)(jnp.asarray(logits), s, jnp.asarray(drafted) if with_drafts else None))
    for b, (prompt, output) in enumerate(histories):
        extra = [int(t) for t in drafted[b] if t != NO_TOKEN]
        want = dense_penalties(logits[b], prompt, output + extra, rep[b], freq[b], pres[b])
        x = logits[b].astype(np.float64)
        fc = float(freq[b]) * np.bincount(np.asarray(output + extra, np.int64), minlength=V)
        bound = 2.0**-23 * (np.abs(np.where(x > 0, x / rep[b], x * rep[b])) + np.abs(fc) + np.abs(fc + pres[b])
                            + np.abs(want))
        listed = np.zeros(V, bool)
        listed[list({*prompt, *output, *extra})] = b != 3
        np.testing.assert_array_equal(got[b][~listed], logits[b][~listed])
        assert np.all(np.abs(got[b][listed] - want[listed]) <= bound[listed]), (b, got[b] - want)
    assert np.any(got != logits)


def test_sampled_frequencies_follow_the_penalized_distribution():
    """20,000 rows sample one 6-token distribution with a history: frequencies within 0.02 of
    softmax(penalized / T) in float64 (5.7 binomial standard deviations at most; see the sampler's
    own test), and greedy rows take the penalized argmax, not the raw one."""
    n, T = 20_000, 1.3
    logits = np.array([3.0, 2.5, -0.5, 2.0, 0.3, 1.6], np.float32)
    prompt, output = [1, 4], [0, 0, 2]
    ids, counts = sparse_rows([(prompt, output)] * n, 64)
    temperature = np.full(n, T, np.float32)
    temperature[-100:] = 0
    s = Sampling.greedy(n, seen=64)._replace(
        temperature_B=jnp.asarray(temperature), repetition_B=jnp.full(n, 1.5), frequency_B=jnp.full(n, 0.5),
        presence_B=jnp.full(n, 0.25), seen_ids_BU=jnp.asarray(ids), output_counts_BU=jnp.asarray(counts),
        key_ints_B4=jnp.asarray(first_token_keys(5, n)))
    tokens, picked = map(np.asarray, jax.jit(sample)(jnp.tile(logits, (n, 1)), s))
    z = dense_penalties(logits, prompt, output, 1.5, 0.5, 0.25)
    # what each row picked from (the processed logprobs modes report it): penalized / T, or penalized when greedy
    np.testing.assert_allclose(picked[0], z / T, rtol=1e-6)
    np.testing.assert_allclose(picked[-1], z, rtol=1e-6)
    assert np.argmax(logits) == 0 and np.all(tokens[-100:] == np.argmax(z)) and np.argmax(z) == 3
    p = np.exp(z / T - np.max(z / T))
    p /= p.sum()
    got = np.bincount(tokens[:-100], minlength=6) / (n - 100)
    assert np.max(np.abs(got - p)) < 0.02, (got, p)


def penalized_reference(model, prompt, new, repetition_penalty, frequency_penalty, presence_penalty):
    """Greedy decoding with the cache-free forward, each step's logits penalized in float64."""
    seq = np.zeros((1, max(24, len(prompt) + new)), np.int32)
    seq[0, :len(prompt)] = prompt
    out = []
    for pos in range(len(prompt), len(prompt) + new):
        z = dense_penalties(np.asarray(model.logits(seq))[0, pos - 1], prompt, out, repetition_penalty,
                            frequency_penalty, presence_penalty)
        out.append(int(np.argmax(z)))
        seq[0, pos] = out[-1]
    return out


@pytest.mark.parametrize("preset", ["tiny-kimi", "tiny-glm4"])
def test_greedy_penalized_decoding_equals_the_cache_free_forward_penalized(preset):
    """Prefill's first token and every decode step read the request's prompt and output so far:
    the tokens of penalized greedy decoding over the growing sequence. The penalties change what
    the random models repeat, and a request beside them without penalties keeps its own tokens.
    MLA and GQA; GLM-5 (it passed too) is left out for the suite's time: the penalties act on
    the logits, after any family's forward."""
    model = mixserve.load(preset, dtype="float32")
    rng = np.random.default_rng(1)
    prompts = [[int(t) for t in rng.integers(0, 256, n)] for n in (5, 11, 14)]
    engine = Engine(model, num_pages=48, page_size=4, max_batch=4, prefill_chunk=8, stop_tokens=(), kv_dtype="auto")
    plain = engine.generate(prompts, max_new_tokens=8)
    rids = [engine.submit(p, max_new_tokens=8, **PENALTIES) for p in prompts] + [engine.submit(prompts[0], max_new_tokens=8)]
    got = {}
    while engine.has_work():
        got.update({u.rid: u.result for u in engine.step() if u.result is not None})
    penalized = [got[r] for r in rids[:3]]
    for p, r in zip(prompts, penalized):
        assert r.status == "ok" and r.tokens == penalized_reference(model, p, 8, **PENALTIES)
    assert got[rids[3]].tokens == plain[0].tokens
    assert [r.tokens for r in penalized] != [r.tokens for r in plain]


def test_speculative_verification_counts_the_drafts_before_each_position():
    """Oracle drafts (plain decoding's tokens, or those with one wrong) under penalties: the
    tokens of plain penalized decoding. A logit bias makes token 9 the pick until the penalties
    of its occurrences outweigh it (6 of 20 tokens), so within one step position j must count
    drafts 1..j as output: scored without them (tried), a kept 9 is picked again and the tokens
    differ."""
    model = mixserve.load("tiny-glm4", dtype="float32", mtp=True)
    prompts = _prompts(model.config.vocab_size)
    request = dict(max_new_tokens=20, temperature=0.0, repetition_penalty=1.1, frequency_penalty=1.0,
                   presence_penalty=0.5, logit_bias={9: 6.0})
    plain = _engine(model).generate(prompts, **request)
    assert all(2 <= r.tokens.count(9) < 20 for r in plain)
    for k, wrong_at in ((3, None), (3, 1)):
        engine = _engine(model, speculative_tokens=k)
        got = _run_with_oracle(engine, prompts, plain, k, wrong_at, **request)
        assert [r.tokens for r in got] == [r.tokens for r in plain], (k, wrong_at)
        assert engine.counters.accepted_tokens > 0


def test_bad_penalties_are_rejected_per_request():
    model = mixserve.load("tiny-kimi", dtype="float32")
    engine = Engine(model, num_pages=16, page_size=4, max_batch=2)
    bad = [dict(repetition_penalty=0.0), dict(repetition_penalty=-1.0), dict(frequency_penalty=2.5),
           dict(presence_penalty=-2.01), dict(presence_penalty=float("nan")), dict(frequency_penalty="1"),
           dict(repetition_penalty=True), dict(repetition_penalty=float("inf"))]
    rids = [engine.submit([1, 2, 3], max_new_tokens=2, **b) for b in bad]
    good = engine.submit([1, 2, 3], max_new_tokens=2, repetition_penalty=1e300)  # float32's largest: still served
    results = {}
    while engine.has_work():
        results.update({u.rid: u.result for u in engine.step() if u.result is not None})
    for rid, b in zip(rids, bad):
        (name, value), = b.items()
        r = results[rid]
        assert r.status == "rejected" and name in r.reason, (b, r.reason)
    assert results[good].status == "ok" and len(results[good].tokens) == 2


def test_penalty_width_is_0_unpenalized_else_a_power_of_two_of_at_least_64():
    assert [penalty_width(n) for n in (0, 1, 64, 65, 200, 4096)] == [0, 64, 64, 128, 256, 4096]


def test_token_counts_grow_with_the_output_as_a_recount_does():
    """A request's lists, kept as tokens arrive (past their first capacity), equal a recount of
    its prompt and output after every step."""
    rng = np.random.default_rng()
    prompt = [int(t) for t in rng.integers(0, 50, 12)]
    r = Request(0, prompt, 500, 0.0, 1.0, 0, repetition_penalty=1.2)
    for _ in range(40):
        r.out += [int(t) for t in rng.integers(0, 300, rng.integers(1, 6))]
        c = r.token_counts()
        want = {t: r.out.count(t) for t in dict.fromkeys(prompt + r.out)}
        assert dict(zip(c.ids.tolist(), c.counts.tolist())) == want and len(c) == len(want)
        assert c.ids.tolist() == list(want)  # first appearance order, no repeats
