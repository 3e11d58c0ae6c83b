"""Speculative decoding with the checkpoint's MTP layer (models/transformer.py, mixserve/speculative.py).

The MTP layer against transformers' own decoder block composed as SGLang composes it; the engine
against plain decoding: greedy outputs must be the same tokens whatever the drafts are (the real
MTP's, mostly rejected on random models, or oracle drafts that are right, or right but for one),
and the rejection sampler must draw from the model's distribution."""

import re
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hf_reference as ref
import mixserve
from conftest import ONE_STEP_SHAPE, host_devices_env
from mixserve.disaggregated import DisaggregatedEngine
from mixserve.engine import Engine
from mixserve.model_runner import steps_for
from mixserve.request import Request
from mixserve.sampling import Sampling, sampling_logits
from mixserve.scheduler import Counters, PageManager
from mixserve import speculative

FAMILIES = ("kimi-yarn-groups", "glm4-qknorm-bias", "glm5-dsa-shared")
PRESETS = ("tiny-kimi", "tiny-glm4", "tiny-glm5")
TOL = 1e-4  # the parity tests' float32 bound


@pytest.fixture(autouse=True)
def _highest_precision():
    with jax.default_matmul_precision("highest"):
        yield


def rel_err(a, b):
    return float(np.max(np.abs(np.asarray(a) - b)) / np.max(np.abs(b)))


@pytest.mark.parametrize("name", FAMILIES)
def test_mtp_layer_matches_transformers_block(name, tmp_path):
    # GLM-5: index_topk >= T keeps every position, so the DSA top-k cannot meet a ReLU tie (the
    # indexer's top-k itself is covered by test_model_parity).
    overrides = {"index_topk": 16} if "glm5" in name else {}
    model, mtp = ref.save_with_mtp(name, str(tmp_path), **overrides)
    ours = mixserve.load(str(tmp_path), dtype="float32", progress=False)
    assert ours.has_mtp and ours.mtp_plan == ours.plan
    ids = np.random.default_rng(0).integers(0, 160, (1, 13))
    logits, hidden = ours.module.apply({"params": ours.params}, jnp.asarray(ids[:, :-1]), return_hidden=True)
    assert rel_err(logits, ref.reference_logits(model, ids[:, :-1])) < TOL
    draft_logits, _ = ours.module.apply({"params": ours.params}, jnp.asarray(ids[:, 1:]), draft_from=hidden)
    assert rel_err(draft_logits, mtp.logits(ids)) < TOL
    # The layer's copies of embed_tokens and lm_head are not read (the model's own are used).
    assert "embed_tokens" not in ours.params[f"layers_{ours.config.mtp_layer}"]
    assert not mixserve.load(str(tmp_path), dtype="float32", progress=False, mtp=False).has_mtp


def test_mtp_true_without_an_mtp_layer_is_refused(tmp_path, capsys):
    ref.save(ref.build("glm4-plain"), str(tmp_path))
    assert not mixserve.load(str(tmp_path), dtype="float32", progress=False).has_mtp
    with pytest.raises(ValueError, match="holds no MTP layer"):
        mixserve.load(str(tmp_path), dtype="float32", progress=False, mtp=True)
    # From the command line: a usage error that names the flags, and the draft that needs no MTP layer.
    from mixserve import run
    with pytest.raises(SystemExit):
        run.main(["--model", str(tmp_path), "--speculative-tokens", "2"])
    assert re.search(r"holds no MTP layer .*mixserve.run --speculative-tokens.*--draft ngram", capsys.readouterr().err)


def _prompts(vocab, n=3):
    return [[int(t) for t in np.random.default_rng(i).integers(0, vocab, 5 + 7 * i)] for i in range(n)]


def _engine(model, **kw):
    return Engine(model, **{"num_pages": 64, "page_size": 8, "max_batch": 4, **ONE_STEP_SHAPE, **kw})


def _run_with_oracle(engine, prompts, reference, k, wrong_at, **request):
    """Generate with each running request's drafts replaced, before every step, by the reference
    continuation (with draft `wrong_at` changed, if given). The first decode step after a prefill
    keeps the MTP's own drafts (prefill sets them within the step)."""
    rids = [engine.submit(p, **request) for p in prompts]
    by_prompt = {tuple(p): r for p, r in zip(prompts, reference)}
    results = {}
    while len(results) < len(rids):
        for r in engine.scheduler.running:
            if r.prefilled:
                want = by_prompt[tuple(r.prompt)].tokens[len(r.out):len(r.out) + k]
                if wrong_at is not None and len(want) > wrong_at:
                    want[wrong_at] = (want[wrong_at] + 1) % engine.cfg.vocab_size
                r.drafts = want
        for update in engine.step():
            if update.result is not None:
                results[update.rid] = update.result
    return [results[r] for r in rids]


@pytest.mark.parametrize("preset", PRESETS)
def test_greedy_speculative_emits_the_plain_decode_tokens(preset, monkeypatch):
    """With oracle drafts, right, right but one, or wrong: plain decoding's tokens and logprobs.
    On the XLA path too a request's verified tokens are folded: attention (and GLM-5's indexer)
    gets q [R, k + 1, ...] over keys gathered once per request."""
    model = mixserve.load(preset, dtype="float32", mtp=True)
    seen = []
    for name in ("masked_attention", "index_scores"):
        def recording(q, keys, *args, _fn=getattr(mixserve.kv_cache, name), _name=name, **kw):
            seen.append((_name, q.shape[:2], keys.shape[:2]))
            return _fn(q, keys, *args, **kw)
        monkeypatch.setattr(mixserve.kv_cache, name, recording)
    prompts = _prompts(model.config.vocab_size)
    request = dict(max_new_tokens=24, temperature=0.0, logprobs=2)
    plain = _engine(model).generate(prompts, **request)
    steps = {}
    for k, wrong_at in ((3, None), (3, 1), (2, 0)):
        seen.clear()
        steps_for.cache_clear()  # steps traced afresh: the recording sees only what a trace calls
        engine = _engine(model, speculative_tokens=k)
        got = _run_with_oracle(engine, prompts, plain, k, wrong_at, **request)
        assert [r.tokens for r in got] == [r.tokens for r in plain], (k, wrong_at)
        for g, p in zip(got, plain):  # each token's logprobs come from its own verified position
            np.testing.assert_allclose([lp.logprob for lp in g.logprobs], [lp.logprob for lp in p.logprobs], atol=1e-5)
            assert [lp.top[0][0] for lp in g.logprobs] == [lp.top[0][0] for lp in p.logprobs]
        # Verification's calls: k + 1 query tokens over cached keys alone (whole pages of 8), where
        # the MTP layer's extend over k + 1 tokens adds them fresh (8n + k + 1); one gather per request.
        verify = [(name, q, keys) for name, q, keys in seen if q[1] == k + 1 and keys[1] % 8 == 0]
        assert all(q[0] == keys[0] for _, q, keys in verify), sorted(set(seen))
        expected = {"masked_attention", "index_scores"} if preset == "tiny-glm5" else {"masked_attention"}
        assert {name for name, _, _ in verify} == expected and len(verify) >= model.config.num_layers
        c = engine.counters
        steps[(k, wrong_at)] = c.steps
        if wrong_at == 0:
            assert c.accepted_tokens == 0  # every first draft is wrong: one token a step
        else:
            assert c.accepted_tokens > 0
            assert c.decode_tokens == sum(len(r.tokens) for r in got) - len(got)  # the first comes from prefill
    # 23 tokens after the first: plain decode takes 23 steps; right drafts take about a quarter.
    assert steps[(3, None)] < steps[(3, 1)] < steps[(2, 0)] == 23


@pytest.mark.parametrize("preset, max_seq_len", [("tiny-kimi", None), ("tiny-glm4", None), ("tiny-glm5", None),
                                                 ("tiny-glm5", 16)])
def test_decode_kernels_verify_a_requests_tokens_in_one_call(preset, max_seq_len, monkeypatch):
    """With the decode kernels (interpreted), verification hands each request's last token and
    drafts to the attention kernels as one request of k + 1 query tokens (q [R, k + 1, H, D]),
    and greedy output is still plain decoding's, with the same logprobs. GLM-5's indexer chooses
    tokens per position (the sparse kernel, one row per position), unless its top-k (16) covers
    the context (max_seq_len 16): then it keeps every token and the dense kernel runs folded."""
    model = mixserve.load(preset, dtype="float32", mtp=True)
    seen, folded_lengths = [], []
    for name in ("paged_attention_gqa", "paged_attention_mla"):
        def recording(q, *args, _kernel=getattr(mixserve.kv_cache.pallas_kernels, name), **kw):
            seen.append(q.shape)
            if q.ndim == 4:  # lengths, the last positional argument: [R, k + 1]
                jax.debug.callback(lambda lengths: folded_lengths.append(np.asarray(lengths)), args[-1])
            return _kernel(q, *args, **kw)
        monkeypatch.setattr(mixserve.kv_cache.pallas_kernels, name, recording)
    prompts = _prompts(model.config.vocab_size, 2 if max_seq_len else 3)
    request = dict(max_new_tokens=4 if max_seq_len else 10, temperature=0.0, logprobs=1)
    kw = dict(attention_backend="interpret", max_seq_len=max_seq_len)
    plain = _engine(model, **kw).generate(prompts, **request)
    steps_for.cache_clear()  # traced afresh, the recording and its callback in the trace
    engine = _engine(model, speculative_tokens=2, **kw)
    got = _run_with_oracle(engine, prompts, plain, 2, 1, **request)
    assert all(r.status == "ok" for r in plain) and [r.tokens for r in got] == [r.tokens for r in plain]
    for g, p in zip(got, plain):
        np.testing.assert_allclose([lp.logprob for lp in g.logprobs], [lp.logprob for lp in p.logprobs], atol=1e-5)
    assert engine.counters.accepted_tokens > 0
    folded = [shape for shape in seen if len(shape) == 4]
    dense_kernel = preset != "tiny-glm5" or max_seq_len is not None
    assert bool(folded) == dense_kernel and all(shape[1] == 3 for shape in folded), sorted(set(seen))
    # A request's rows past its drafts (fewer near max_new_tokens) see its first row's tokens, not
    # none: the kernels mask every block from the shortest row's on (fold_tokens).
    lengths = np.concatenate(folded_lengths) if dense_kernel else np.zeros((0, 3))
    assert dense_kernel == bool(len(lengths)) and ((lengths.min(1) > 0) | (lengths.max(1) == 0)).all()
    assert dense_kernel == ((lengths.max(1) > 0) & (lengths[:, -1] == lengths[:, 0])).any()  # fewer than 2 drafts


@pytest.mark.parametrize("name", ["kimi-yarn-groups", "glm5-dsa-shared"])
def test_real_mtp_drafts_keep_greedy_output(name, tmp_path):
    ref.save_with_mtp(name, str(tmp_path))
    model = mixserve.load(str(tmp_path), dtype="float32", progress=False)
    prompts = _prompts(model.config.vocab_size)
    plain = _engine(model).generate(prompts, max_new_tokens=12, temperature=0.0)
    engine = _engine(model, speculative_tokens=2)
    spec = engine.generate(prompts, max_new_tokens=12, temperature=0.0)
    assert [r.tokens for r in spec] == [r.tokens for r in plain]
    assert engine.counters.drafted_tokens > 0


def test_preempted_requests_recompute_their_drafts():
    model = mixserve.load("tiny-glm4", dtype="float32", mtp=True)
    prompts = _prompts(model.config.vocab_size, 4)
    plain = _engine(model).generate(prompts, max_new_tokens=20, temperature=0.0)
    engine = _engine(model, num_pages=12, speculative_tokens=3)  # 96 slots for 4 requests of up to 45 tokens
    got = _run_with_oracle(engine, prompts, plain, 3, None, max_new_tokens=20, temperature=0.0)
    assert engine.counters.preemptions > 0
    assert [r.tokens for r in got] == [r.tokens for r in plain]


def test_pages_of_rejected_drafts_go_to_a_request_that_needs_them():
    """Pages a request took for its drafts hold only rejected tokens once the drafts are refused:
    a request that arrives needing them is admitted at once, as under plain decoding, rather than
    waiting until the drafter ends. Request a (3 tokens) drafts 7 wrong tokens after its first
    step: 3 pages of 4 for 5 tokens. Request b (21 tokens) then needs 6 of the 8 pages."""
    model = mixserve.load("tiny-glm4", dtype="float32", mtp=True)
    vocab = model.config.vocab_size
    a, b = [[int(t) for t in np.random.default_rng(i).integers(0, vocab, n)] for i, n in ((0, 3), (1, 21))]
    finished = {}
    for k in (0, 7):  # plain decoding first: its tokens make the wrong drafts
        engine = _engine(model, num_pages=8, page_size=4, max_batch=2, speculative_tokens=k)
        rids = {engine.submit(a, max_new_tokens=20, temperature=0.0): "a"}
        for step in range(40):
            if step == 1:
                assert engine.pages_in_use == (3 if k else 1)  # a's pages, drafts' included
                rids[engine.submit(b, max_new_tokens=1, temperature=0.0)] = "b"
            for r in engine.scheduler.running:
                if k and r.prefilled:  # every first draft wrong: one token a step, like plain decode
                    r.drafts = [(finished[0, "a"][1][len(r.out)] + 1) % vocab] * k
            for update in engine.step():
                if update.result is not None:
                    finished[k, rids[update.rid]] = (step, update.result.tokens)
        assert engine.counters.preemptions == 0 and engine.free_pages == 8
    assert finished[7, "a"][1] == finished[0, "a"][1] and engine.counters.drafted_tokens > 0
    assert finished[7, "b"] == finished[0, "b"] and finished[7, "b"][0] == 1  # b's step: the one after it came


def test_sampled_speculative_decoding_is_reproducible_and_stops():
    model = mixserve.load("tiny-kimi", dtype="float32", mtp=True)
    prompts = _prompts(model.config.vocab_size)
    runs = [_engine(model, speculative_tokens=2).generate(prompts, max_new_tokens=16, temperature=0.8, top_p=0.9,
                                                           seed=7) for _ in range(2)]
    assert [r.tokens for r in runs[0]] == [r.tokens for r in runs[1]]
    assert all(r.status == "ok" and len(r.tokens) == 16 for r in runs[0])


def _sampling(temperature, n, top_k=0):
    s = Sampling.greedy(n, np)
    s.temperature_B[:] = temperature
    s.top_k_B[:] = top_k
    s.key_ints_B4[:, 1] = np.arange(n)  # a different seed per row (its low word): n independent draws
    return Sampling(*map(jnp.asarray, s))


@pytest.mark.parametrize("draft", [0, 3])
def test_rejection_sampling_draws_the_models_distribution(draft):
    """One position, one draft: the emitted token (the draft if kept, else a draw from the rest) is
    distributed as p, whether the draft is likely (token 0) or not (token 3). Bound: 5 binomial
    standard deviations per token over n draws."""
    n, V = 40000, 6
    logits = jnp.asarray([2.0, 1.0, 0.5, -1.0, 0.0, -3.0])
    s = _sampling(0.7, n, top_k=5)  # top-k 5 drops token 5
    p = np.asarray(jax.nn.softmax(sampling_logits(logits[None], Sampling(*(a[:1] for a in s)))[0]))
    logits_RJV = jnp.broadcast_to(logits, (n, 2, V))
    accepted, tokens, picked = speculative.accept(logits_RJV, jnp.full((n, 1), draft, jnp.int32), jnp.ones(n, jnp.int32),
                                                  speculative.per_position(s, 2))
    # every position reports the distribution it draws from, whatever was kept (float32 softmax: 1e-6)
    np.testing.assert_allclose(np.asarray(jax.nn.softmax(picked[:2])), np.stack([p, p]), rtol=1e-6, atol=1e-7)
    first = np.asarray(tokens[:, 0])
    freq = np.bincount(first, minlength=V) / n
    assert np.all(np.abs(freq - p) <= 5 * np.sqrt(p * (1 - p) / n) + 1e-9), (freq, p)
    assert freq[5] == 0
    np.testing.assert_allclose(np.mean(np.asarray(accepted)), p[draft], atol=5 * np.sqrt(p[draft] / n))
    kept = np.asarray(accepted) == 1  # a kept draft is followed by a bonus token drawn from p
    assert np.all(first[kept] == draft) and np.all(first[~kept] != draft)


def test_greedy_acceptance_stops_at_the_first_disagreement():
    V = 5
    logits = jnp.asarray(np.eye(V)[[1, 2, 3, 4]] * 3.0)[None]  # argmax 1, 2, 3, 4 at positions 0..3
    drafts = jnp.asarray([[1, 2, 0]])
    s = speculative.per_position(_sampling(0.0, 1), 4)
    for n_drafts, accepted, emitted in ((3, 2, [1, 2, 3]), (1, 1, [1, 2]), (0, 0, [1])):
        a, tokens, picked = speculative.accept(logits, drafts, jnp.asarray([n_drafts]), s)
        np.testing.assert_array_equal(np.asarray(picked), np.asarray(logits[0]))  # greedy, nothing adjusted: the raw logits
        assert int(a[0]) == accepted and np.asarray(tokens[0, :accepted + 1]).tolist() == emitted


def test_prefix_pages_are_shared_only_where_the_mtp_lookahead_agrees():
    S = 4
    a, b = list(range(10)), list(range(10))
    b[S] = 99  # the first token after page 0: the MTP's entry at position 3 holds it
    plain = PageManager(8, S, 2, 4, True, Counters())
    mtp = PageManager(8, S, 2, 4, True, Counters(), lookahead=1)

    def keys(manager, tokens):
        return manager.page_keys(Request(0, tokens, 1, 0.0, 1.0, 0))

    assert keys(plain, a)[0] == keys(plain, b)[0]
    assert keys(mtp, a)[0] != keys(mtp, b)[0]
    assert len(keys(mtp, a)) == len(keys(plain, a)) == 2


def test_speculative_decoding_needs_an_mtp_layer():
    plain = mixserve.load("tiny-glm4", dtype="float32")
    with pytest.raises(ValueError, match="MTP layer"):
        _engine(plain, speculative_tokens=1)
    model = mixserve.load("tiny-glm4", dtype="float32", mtp=True)
    with pytest.raises(ValueError, match="non-negative integer"):
        _engine(model, speculative_tokens=-1)
    with pytest.raises(ValueError, match="on both engines or on neither"):
        DisaggregatedEngine(_engine(model, prefill_only=True), _engine(model, speculative_tokens=1))


@pytest.mark.parametrize("preset", ["tiny-kimi", "tiny-glm5"])
def test_disaggregated_prefill_sends_the_mtp_cache_and_first_drafts(preset):
    """The prefill engine (BF16 KV) fills the MTP layer's cache and drafts; the decode engine (FP8
    KV) goes on from them. Oracle drafts from the second decode step: the same tokens as one
    engine with the same pools, in fewer steps."""
    model = mixserve.load(preset, dtype="float32", mtp=True)
    prompts = _prompts(model.config.vocab_size)
    request = dict(max_new_tokens=16, temperature=0.0)
    plain = _engine(model, kv_dtype="fp8_e4m3").generate(prompts, **request)
    engine = DisaggregatedEngine(_engine(model, prefill_only=True, speculative_tokens=3),
                                 _engine(model, kv_dtype="fp8_e4m3", speculative_tokens=3))
    rids = [engine.submit(p, **request) for p in prompts]
    by_prompt, results = {tuple(p): r for p, r in zip(prompts, plain)}, {}
    while len(results) < len(rids):
        for r in engine.decode.scheduler.running:
            if r.prefilled and r.drafts and engine.decode.counters.steps:
                r.drafts = by_prompt[tuple(r.prompt)].tokens[len(r.out):len(r.out) + 3]
        for update in engine.step():
            if update.result is not None:
                results[update.rid] = update.result
    assert [results[r].tokens for r in rids] == [r.tokens for r in plain]
    assert engine.counters.handovers == 3 and engine.decode.counters.accepted_tokens > 0
    assert engine.decode.counters.steps < 15


def test_tensor_expert_and_context_parallel_speculative_decoding_keeps_the_tokens():
    """TP4, EP4 and decode context parallelism on 4 CPU devices (a subprocess: the device count is fixed when JAX starts): the
    MTP layer's parameters and pool are placed by their logical axes like every layer's, and the
    decode kernels verify per device."""
    script = textwrap.dedent("""
        import jax, numpy as np, mixserve
        from mixserve import sharding
        from mixserve.engine import Engine
        jax.config.update("jax_default_matmul_precision", "highest")
        for name in ("tiny-kimi", "tiny-glm4"):
            m = mixserve.load(name, dtype="float32", mtp=True)
            prompts = [[int(t) for t in np.random.default_rng(i).integers(0, 320, 5 + 7 * i)] for i in range(3)]
            kw = dict(num_pages=64, page_size=8, max_batch=4, speculative_tokens=2, min_decode_rows=4)  # one decode shape
            one = Engine(m, **kw).generate(prompts, max_new_tokens=10, temperature=0.0)
            # Decode context parallelism (MLA: each device holds a share of every page's slots);
            # the kernels (interpreted) take each request's tokens as one request (fold_tokens).
            kernels = dict(attention_backend="interpret")
            splits = [dict(expert_parallel=False, **kernels), dict(expert_parallel=True)]
            splits += [dict(decode_context_parallel=True, **kernels)] if name == "tiny-kimi" else []
            for split in splits:
                got = Engine(m, mesh=sharding.tp_mesh(4), **split, **kw).generate(
                    prompts, max_new_tokens=10, temperature=0.0)
                assert [r.tokens for r in got] == [r.tokens for r in one], (name, split)
        print("ok")
    """)
    result = subprocess.run([sys.executable, "-c", script], env=host_devices_env(4), capture_output=True, text=True,
                            timeout=900)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-4000:]


def test_a_quantized_checkpoint_keeps_its_bf16_mtp_layer(tmp_path):
    """mixserve.quantize writes the MTP layer unquantized: the model loads INT4, its MTP layer
    BF16 (detect_mtp_plan reads the MTP layer's own tensors), and drafts for INT4 decoding."""
    from mixserve.quantize import quantize_checkpoint
    from models.weights import WeightFormat, WeightPlan

    ref.save_with_mtp("glm4-qknorm-bias", str(tmp_path / "bf16"))
    int4 = WeightFormat("int4", 32)
    quantize_checkpoint(str(tmp_path / "bf16"), str(tmp_path / "int4"), WeightPlan(experts=int4, linear=int4))
    model = mixserve.load(str(tmp_path / "int4"), dtype="float32", progress=False)
    assert model.plan == WeightPlan(experts=int4, linear=int4) and model.mtp_plan == WeightPlan()
    prompts = _prompts(model.config.vocab_size)
    plain = _engine(model).generate(prompts, max_new_tokens=8, temperature=0.0)
    spec = _engine(model, speculative_tokens=2).generate(prompts, max_new_tokens=8, temperature=0.0)
    assert [r.tokens for r in spec] == [r.tokens for r in plain]


def test_orbax_round_trip_keeps_the_mtp_layer(tmp_path):
    from mixserve.orbax_io import restore_params, save_params

    model = mixserve.load("tiny-glm5", dtype="float32", mtp=True)
    save_params(str(tmp_path), model)
    back = restore_params(str(tmp_path))
    assert back.mtp_plan == model.mtp_plan
    for a, b in zip(jax.tree.leaves(model.params), jax.tree.leaves(back.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_ngram_drafts_look_up_the_latest_earlier_occurrence():
    assert speculative.ngram_drafts([1, 2, 3, 4, 1, 2, 3], 3) == [4, 1, 2]
    assert speculative.ngram_drafts([1, 2, 9, 1, 2, 7, 2], 2) == [7, 2]  # n = 1: token 2 last seen before 7
    assert speculative.ngram_drafts([1, 2, 1, 2, 1], 2) == [2, 1]  # its own repetition
    assert speculative.ngram_drafts([1, 2, 3, 4, 5], 2) == []
    assert speculative.ngram_drafts([5], 2) == []
    assert speculative.ngram_drafts([8, 1, 2, 3, 9, 1, 2, 3], 2, max_n=2) == [9, 1]  # the latest of the longest


def test_ngram_drafts_equal_a_plain_search():
    """Against the definition, searched plainly, on random short sequences over tiny vocabularies
    (many repeats), with random k, max_n and min_n."""

    def plain(tokens, k, max_n, min_n):
        for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
            suffix = tokens[-n:]
            ends = [e for e in range(n - 1, len(tokens) - 1) if tokens[e - n + 1:e + 1] == suffix]
            if ends:
                return tokens[ends[-1] + 1:ends[-1] + 1 + k]
        return []

    rng = np.random.default_rng()
    for _ in range(3000):
        tokens = rng.integers(0, int(rng.integers(1, 5)), int(rng.integers(1, 30))).tolist()
        k, max_n = int(rng.integers(1, 5)), int(rng.integers(1, 6))
        min_n = int(rng.integers(1, max_n + 1))
        assert speculative.ngram_drafts(tokens, k, max_n, min_n) == plain(tokens, k, max_n, min_n), (tokens, k, max_n, min_n)


@pytest.mark.parametrize("preset", ["tiny-kimi", "tiny-glm5"])
def test_ngram_drafts_speed_up_a_repeating_model_and_keep_its_tokens(preset):
    """Kimi ships no MTP layer: n-gram drafts need none. A random tiny model's greedy output falls
    into cycles, which prompt lookup then predicts. Same tokens and logprobs as plain decode."""
    model = mixserve.load(preset, dtype="float32")
    prompts = _prompts(model.config.vocab_size)
    request = dict(max_new_tokens=48, temperature=0.0, logprobs=1)
    plain = _engine(model, num_pages=128).generate(prompts, **request)
    engine = _engine(model, num_pages=128, speculative_tokens=4, draft="ngram")
    got = engine.generate(prompts, **request)
    assert [r.tokens for r in got] == [r.tokens for r in plain]
    for g, p in zip(got, plain):
        np.testing.assert_allclose([lp.logprob for lp in g.logprobs], [lp.logprob for lp in p.logprobs], atol=1e-5)
    c = engine.counters
    assert engine.runner.pools.__len__() == model.config.num_layers  # no MTP cache
    assert c.accepted_tokens > 0 and c.steps < 47


@pytest.mark.parametrize("fault", ["stale_tag", "swapped_mapping"])
def test_integrity_check_aborts_only_the_affected_requests_of_a_speculative_step(fault):
    """The verify rows of a request share its slot: a failed check stops them all (and its MTP
    draft), the others go on with the tokens of a clean run."""
    from test_engine import FAULTS, _inject_at

    model = mixserve.load("tiny-glm4", dtype="float32", mtp=True)
    kind, targets, affected = FAULTS[fault]
    prompts = _prompts(model.config.vocab_size, 4)
    kw = dict(integrity="check", speculative_tokens=2)
    clean = _engine(model, **kw).generate(prompts, max_new_tokens=12, temperature=0.0)
    hurt = _engine(model, fault_hook=_inject_at(2, kind, targets), **kw).generate(prompts, max_new_tokens=12,
                                                                                 temperature=0.0)
    for slot, (c, h) in enumerate(zip(clean, hurt)):
        if slot in affected:
            assert h.status == "aborted" and "tag" in h.reason and h.tokens == c.tokens[:len(h.tokens)], h.reason
        else:
            assert h.status == "ok" and h.tokens == c.tokens


def test_speculative_decoding_applies_the_logit_bias_as_plain_decoding_does():
    """Verification picks and accepts drafts on the biased logits: greedy, the plain tokens."""
    model = mixserve.load("tiny-kimi", dtype="float32", mtp=True)
    prompts = _prompts(model.config.vocab_size)
    unbiased = _engine(model).generate(prompts, max_new_tokens=16)
    common = max(range(model.config.vocab_size), key=lambda t: sum(r.tokens.count(t) for r in unbiased))
    request = dict(max_new_tokens=16, logit_bias={common: -100, 5: 3.0})
    plain = _engine(model).generate(prompts, **request)
    assert [r.tokens for r in plain] != [r.tokens for r in unbiased] and all(common not in r.tokens for r in plain)
    for k in (1, 3):
        assert [r.tokens for r in _engine(model, speculative_tokens=k).generate(prompts, **request)] == \
            [r.tokens for r in plain], k


def test_speculative_decoding_holds_back_stop_tokens_until_min_tokens():
    """A draft that is a stop token before the request's min_tokens is refused at its position
    (the hold follows each verified position's token index): greedy, the plain tokens. The drafts
    are the continuation without min_tokens, so they propose the stop token where it is held."""
    model = mixserve.load("tiny-kimi", dtype="float32", mtp=True)
    prompts = _prompts(model.config.vocab_size)
    free = _engine(model).generate(prompts, max_new_tokens=16)
    common = max(range(model.config.vocab_size), key=lambda t: sum(r.tokens[:8].count(t) for r in free))
    request = dict(max_new_tokens=16, stop_token_ids=(common,), min_tokens=8)
    plain = _engine(model).generate(prompts, **request)
    assert all(common not in r.tokens[:8] for r in plain) and any(common in r.tokens[1:8] for r in free)
    got = _run_with_oracle(_engine(model, speculative_tokens=3), prompts, free, 3, None, **request)
    assert [r.tokens for r in got] == [r.tokens for r in plain]
