"""The rows an RL trainer replays. Routed experts return (vLLM's --enable-return-routed-experts, for
routing replay): each request's Result.routed_experts holds the experts every MoE layer chose for
each position fed to the model. DSA indexer top-k return (GLM-5; SGLang's
--enable-return-indexer-topk, for indexer replay): Result.indexer_topk[p, l] holds the positions
the l-th indexer layer let token p attend to, ascending, then -1. Both must be the choices of the
cache-free forward over the request's final sequence (float32 weights: the paged, chunked, cached
and speculative paths agree with it to roundoff, and these random models' choices are nowhere near
a tie at that scale; a tie at an exact score, as the indexer's ReLUs make, goes to the lower
position on every path, since each lays its keys out in position order), whatever path computed
each position: chunked prefill, decode, a prefix-cache hit (device or host tier), a recompute
after preemption, speculative verification, a disaggregated hand-over."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mixserve
from mixserve.disaggregated import DisaggregatedEngine
from mixserve.engine import Engine
from models.attention import sown_indexer_topk
from models.kv import NoCache, chosen_positions, top_k_mask
from models.moe import sown_routes
from conftest import ONE_STEP_SHAPE
from test_engine import engine, prompts

NEW = 6
PADDED = 72  # the reference's sequence length: one compile per model (causal: the padding changes nothing before it)
TOP_K = 4  # GLM-5's indexers here: the tiny preset keeps 16, every key of these prompts; 4 makes them choose


def glm5(**kw):
    """tiny-glm5 (float32) whose indexers keep TOP_K positions (the weights do not depend on it)."""
    model = mixserve.load("tiny-glm5", dtype="float32", **kw)
    return dataclasses.replace(model, config=dataclasses.replace(model.config, index_topk=TOP_K))


@functools.partial(jax.jit, static_argnums=0)
def sown(module, params, ids_BT, routed_experts=None, indexer_topk=None):
    """The plain forward's logits and what its layers sowed (routes, indexer choices), replaying
    what is given: jitted, one compile per model and shape (eagerly, each call dispatches every
    operation on its own: seconds per call on these tiny models)."""
    logits, state = module.apply({"params": params}, ids_BT, routed_experts=routed_experts, indexer_topk=indexer_topk,
                                 mutable=["intermediates"])
    return logits, state["intermediates"]


def cache_free(model, tokens: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """(routes int16 [len - 1, L, K], greedy next token at each of those positions) of the plain
    forward over tokens: the rows a Result holds, and the tokens greedy decoding would have fed."""
    seq = np.zeros((1, PADDED), np.int32)
    seq[0, : len(tokens)] = tokens
    logits, rows = sown(model.module, model.params, seq)
    routes = np.asarray(sown_routes(rows, model.config))[0, : len(tokens) - 1]
    return routes, np.argmax(np.asarray(logits)[0, : len(tokens) - 1], axis=-1)


def assert_cache_free_routes(model, prompt: list[int], result) -> None:
    assert result.status == "ok", result.reason
    tokens = prompt + result.tokens
    routes, greedy = cache_free(model, tokens)
    np.testing.assert_array_equal(result.routed_experts, routes)
    assert list(greedy[len(prompt) - 1:]) == result.tokens  # the flag changes no token


def cache_free_chosen(model, tokens: list[int]) -> np.ndarray:
    """int32 [len - 1, indexer layers, TOP_K]: the plain forward's choices for the positions fed."""
    seq = np.zeros((1, PADDED), np.int32)
    seq[0, : len(tokens)] = tokens
    return np.asarray(sown_indexer_topk(sown(model.module, model.params, seq)[1], model.config))[0, : len(tokens) - 1]


def assert_cache_free_rows(model, prompt: list[int], result) -> None:
    """Both kinds of rows, the cache-free forward's; the indexer's also well formed: position p has
    min(p + 1, TOP_K) positions, ascending, each at most p, then -1."""
    assert_cache_free_routes(model, prompt, result)
    chosen = result.indexer_topk
    np.testing.assert_array_equal(chosen, cache_free_chosen(model, prompt + result.tokens))
    p = np.arange(len(chosen))[:, None]
    assert ((chosen >= 0).sum(-1) == np.minimum(p + 1, TOP_K)).all()
    ascending = (np.diff(chosen, axis=-1) > 0) | (chosen[..., 1:] == -1)
    assert ascending.all() and (chosen <= p[..., None]).all()


def test_chosen_positions_are_the_masks_choice_in_order():
    """chosen_positions against numpy on random scores (no ties) and masks: the top_k valid keys by
    score, as positions (key_positions maps a key to its request's position), ascending, -1 past a
    query's valid keys; and the same set as top_k_mask's, which attention uses."""
    rng = np.random.default_rng()
    B, T, S, k = 3, 5, 11, 4
    scores = rng.normal(size=(B, T, S)).astype(np.float32)
    valid = rng.random((B, T, S)) < 0.5
    valid[0, 0] = False
    valid[0, 0, :2] = True  # fewer valid keys than k
    positions = rng.permutation(100)[: B * S].reshape(B, S).astype(np.int32)
    got = np.asarray(chosen_positions(jnp.asarray(scores), jnp.asarray(valid), k, jnp.asarray(positions)))
    mask = np.asarray(top_k_mask(jnp.asarray(scores), jnp.asarray(valid), k))
    for b in range(B):
        for t in range(T):
            keys = np.flatnonzero(valid[b, t])
            best = keys[np.argsort(-scores[b, t, keys])][:k]
            want = sorted(positions[b, best])
            np.testing.assert_array_equal(got[b, t], want + [-1] * (k - len(want)))
            assert set(np.flatnonzero(mask[b, t])) == set(best)
    assert (got[0, 0, 2:] == -1).all()


def test_rows_are_the_cache_free_forwards_choices_through_every_cache_path():
    """Ragged prompts (1 to 14 tokens: one token, pages of 4 ending mid-page, two prefill chunks
    of 8) in one batch with padding rows, then decode, in a pool of 10 pages that the four requests
    outgrow (some are preempted and recomputed): a row per position fed to the model, its experts
    (one column per MoE layer: the first, dense layer has none) and its indexers' positions (one
    column per layer that runs an indexer: the tiny preset's second layer reuses the first's).
    Then a prompt extending a finished sequence shares its pages from the prefix cache (their rows
    come with them, none computed again), and again after the pages went to the host tier and came
    back. A request cancelled mid-decode holds the rows of the positions it got to."""
    model = glm5()
    e = engine(model, num_pages=10, integrity="check", return_routed_experts=True, return_indexer_topk=True,
               host_kv_bytes=1 << 20)
    cfg = model.config
    assert e.replay_dtype.names == ("routed_experts", "indexer_topk")
    moe_layers = sum(cfg.is_moe_layer(i) for i in range(cfg.num_layers))
    assert 0 < moe_layers < cfg.num_layers and len(cfg.indexer_layers) == 2  # a dense first layer; a shared indexer
    ps = prompts()
    results = e.generate(ps, max_new_tokens=NEW)
    for p, r in zip(ps, results):
        assert r.routed_experts.shape == (len(p) + NEW - 1, moe_layers, cfg.num_experts_per_tok)
        assert r.indexer_topk.shape == (len(p) + NEW - 1, len(cfg.indexer_layers), TOP_K)
        assert r.routed_experts.dtype == np.int16 and r.indexer_topk.dtype == np.int32
        assert_cache_free_rows(model, p, r)
    assert e.counters.preemptions > 0
    # the indexers choose: some position past TOP_K keeps neither its first nor its last TOP_K keys
    rows = results[3].indexer_topk[TOP_K:]
    p = np.arange(TOP_K, TOP_K + len(rows))[:, None, None]
    assert (~(rows == np.arange(TOP_K)).all(-1) & ~(rows == p - TOP_K + 1 + np.arange(TOP_K)).all(-1)).any()
    longer = ps[3] + results[3].tokens + [7, 8, 9]
    [b] = e.generate([longer], max_new_tokens=NEW)
    assert b.cached_tokens == 16  # the 4 full pages of 19 fed tokens
    assert_cache_free_rows(model, longer, b)
    pm = e.page_manager
    assert set(pm.replay_rows) == set(pm._cache) and pm.replay_rows
    pm.evict_all()  # into the host tier
    assert not pm.replay_rows and not pm._cache  # the host keeps the rows with the pages
    [c] = e.generate([longer], max_new_tokens=NEW)
    assert e.counters.host_restored_tokens >= 16 and c.tokens == b.tokens
    assert_cache_free_rows(model, longer, c)
    rid = e.submit(ps[3][:9], max_new_tokens=NEW)  # cancelled mid-decode: the rows of the positions it got to
    got = []
    while len(got) < 3:
        got += [t for u in e.step() for t in u.new_tokens]
    e.cancel(rid)
    [cancelled] = [u.result for u in e.step() if u.rid == rid]
    assert cancelled.status == "aborted" and len(cancelled.tokens) == 3
    fed = ps[3][:9] + cancelled.tokens
    np.testing.assert_array_equal(cancelled.routed_experts, cache_free(model, fed)[0])
    np.testing.assert_array_equal(cancelled.indexer_topk, cache_free_chosen(model, fed))


def test_a_restored_page_brings_the_rows_of_the_kv_it_restores():
    """Rows differ with the forward that computed them: here prefill and decode run two weight
    sets. A's decoded pages go to the host tier; B computes the same pages again with the prefill
    weights (it asks for prompt logprobs, so it shares nothing) and they are evicted again, where
    the host keeps A's KV. C restores A's KV: it gets A's rows, not B's."""
    model = mixserve.load("tiny-kimi", dtype="float32")
    e = engine(model, decode_model=mixserve.load("tiny-kimi", dtype="float32", seed=1), return_routed_experts=True,
               host_kv_bytes=1 << 20)
    prompt = prompts(7)[3][:8]
    [a] = e.generate([prompt], max_new_tokens=9)  # positions 0-7 prefilled, 8-15 decoded
    sequence = prompt + a.tokens + [5]
    e.page_manager.evict_all()
    [b] = e.generate([sequence], max_new_tokens=2, prompt_logprobs=1)
    assert b.cached_tokens == 0 and (b.routed_experts[8:16] != a.routed_experts[8:16]).any()
    e.page_manager.evict_all()
    [c] = e.generate([sequence], max_new_tokens=2)
    assert c.cached_tokens == 16 and e.counters.host_restored_tokens >= 16
    np.testing.assert_array_equal(c.routed_experts[:16], a.routed_experts[:16])


def test_new_weights_write_the_rows_again_and_a_cancelled_request_keeps_those_of_the_kv_it_holds():
    """update_weights(running="recompute"): a running request's rows are all the new weights'
    (its tokens before the update were the old weights', its KV and routing are recomputed). One
    cancelled after a first recomputed chunk holds that chunk's rows, none of the old KV's; one
    cancelled before it is admitted again holds none."""
    old, new = mixserve.load("tiny-kimi", dtype="float32"), mixserve.load("tiny-kimi", dtype="float32", seed=1)
    e = engine(old, return_routed_experts=True)
    ps = prompts(2)
    rids = [e.submit(ps[3], max_new_tokens=NEW), e.submit(ps[1], max_new_tokens=12), e.submit(ps[0], max_new_tokens=9)]
    for _ in range(4):
        e.step()
    assert e.update_weights(new) == 3 and not e.page_manager.replay_rows
    e.cancel(rids[2])
    results = {u.rid: u.result for u in e.step() if u.result is not None}  # the others re-admitted, a chunk of 8 each
    e.cancel(rids[0])
    while e.has_work():
        results.update((u.rid, u.result) for u in e.step() if u.result is not None)
    cancelled, finished = results[rids[0]], results[rids[1]]
    assert results[rids[2]].status == "aborted" and results[rids[2]].routed_experts.shape == (0, 2, 2)
    assert cancelled.status == "aborted" and len(cancelled.routed_experts) == 8
    np.testing.assert_array_equal(cancelled.routed_experts, cache_free(new, ps[3] + cancelled.tokens)[0][:8])
    assert finished.status == "ok"
    np.testing.assert_array_equal(finished.routed_experts, cache_free(new, ps[1] + finished.tokens)[0])


def test_speculative_decoding_returns_the_rows_of_the_kept_positions():
    """A verify step computes a row per draft (a row of one token per position, the pages read once
    per request); a request keeps those of its fed token and the drafts it accepted (n-gram drafts,
    on a model whose greedy output falls into cycles), routing and indexer positions alike."""
    model = glm5()
    ps = [[int(t) for t in np.random.default_rng(i).integers(0, 256, 5 + 7 * i)] for i in range(3)]
    e = Engine(model, num_pages=128, page_size=8, max_batch=4, stop_tokens=(), speculative_tokens=4, draft="ngram",
               return_routed_experts=True, return_indexer_topk=True, **ONE_STEP_SHAPE)
    for p, r in zip(ps, e.generate(ps, max_new_tokens=48)):
        assert_cache_free_rows(model, p, r)
    assert e.counters.accepted_tokens > 0 and e.counters.steps < 47


def test_the_mtp_layers_own_choices_reach_no_row():
    """Speculative decoding with GLM-5's MTP layer, a MoE layer with an indexer of its own, run
    beside every prefill and verify step (its KV, its drafts): its choices are not the model's and
    reach no row. (This random MTP layer's drafts are all rejected: each step keeps its fed token's
    rows. The n-gram test above keeps accepted drafts' rows.)"""
    model = glm5(mtp=True)
    e = engine(model, speculative_tokens=2, return_routed_experts=True, return_indexer_topk=True)
    ps = prompts()
    for p, r in zip(ps, e.generate(ps, max_new_tokens=NEW)):
        assert_cache_free_rows(model, p, r)
    assert e.counters.verified_rows > 0


def test_a_disaggregated_pair_hands_the_prompt_rows_over_with_the_pages():
    """The prefill engine's rows (routing and indexer) go with the request to the decode engine,
    whose own follow. Each flag must be on both engines or on neither."""
    model = glm5()
    kw = dict(num_pages=48, page_size=4, max_batch=4, prefill_chunk=8, stop_tokens=(), **ONE_STEP_SHAPE)
    both = dict(return_routed_experts=True, return_indexer_topk=True)
    pair = DisaggregatedEngine(Engine(model, prefill_only=True, **both, **kw), Engine(model, **both, **kw))
    ps = prompts()
    for p, r in zip(ps, pair.generate(ps, max_new_tokens=NEW)):
        assert_cache_free_rows(model, p, r)
    assert pair.counters.handovers == len(ps)
    longer = ps[3] + [7] * 6  # its first 3 pages are in both pools: the decode engine shares them
    [r] = pair.generate([longer], max_new_tokens=NEW)
    assert pair.counters.pages_shared >= 3
    assert_cache_free_rows(model, longer, r)
    for one in ({}, dict(return_routed_experts=True)):
        with pytest.raises(ValueError, match="must each be on both engines"):
            DisaggregatedEngine(Engine(model, prefill_only=True, **one, **kw), Engine(model, **both, **kw))


def test_the_server_returns_each_choices_prompt_and_output_rows():
    """--enable-return-routed-experts: each finished choice has prompt_routed_experts (a row per
    prompt token) and routed_experts (a row per output token fed back: all but the last): the
    rows of the engine's Result for the same greedy request, split at the prompt's end. Streamed,
    the choice's last chunk has them, and no earlier one. --enable-return-indexer-topk (GLM-5):
    prompt_indexer_topk and indexer_topk, likewise."""
    from test_server import FLAGS, events, post, serving
    from mixserve import server

    flags = [*FLAGS, "--model", "tiny-glm5", "--port", "0", "--enable-return-routed-experts",
             "--enable-return-indexer-topk"]
    s = serving(server.make_server(flags))
    prompts_ = [[1, 2, 3, 4, 5], [9] * 7]
    try:
        status, body = post(s, {"prompt": prompts_, "max_tokens": 4, "temperature": 0})
        streamed = [e["choices"][0] for e in events(s, {"prompt": prompts_[1], "max_tokens": 4, "temperature": 0})
                    if e != "[DONE]"]
        direct = s.loop.between_steps(lambda engine: engine.generate(prompts_, max_new_tokens=4))
    finally:
        s.close()
    assert status == 200, body
    for name in ("routed_experts", "indexer_topk"):
        assert [name in c for c in streamed] == [False] * (len(streamed) - 1) + [True]
        assert streamed[-1][f"prompt_{name}"] + streamed[-1][name] == getattr(direct[1], name).tolist()
        for choice, prompt, r in zip(body["choices"], prompts_, direct):
            assert np.array(choice[f"prompt_{name}"]).shape[0] == len(prompt)
            assert np.array(choice[name]).shape[0] == len(r.tokens) - 1
            np.testing.assert_array_equal(choice[f"prompt_{name}"] + choice[name], getattr(r, name))


def test_routing_replay_sends_each_token_to_the_given_experts_with_its_own_routers_weights():
    """route(replay_TK=) keeps those experts, weighted by the router's own scores at them (against
    float64 numpy: sigmoid, normalised, scaled; float32 rounds each step to 2^-24 relative, a few
    steps: 1e-6). Replaying a model's own routing gives its logits bit for bit; another routing is
    routed as given (the forward's sown rows are the replayed ones), changes the logits, and the
    gradient still reaches the router. A row the model cannot route is refused by name."""
    from mixserve.model import init_params
    from models.moe import route
    from models.weights import WeightPlan

    model = mixserve.load("tiny-kimi", dtype="float32")
    cfg, rng = model.config, np.random.default_rng()
    logits_TE = rng.normal(size=(9, cfg.n_routed_experts)).astype(np.float32)
    replay_TK = np.stack([rng.permutation(cfg.n_routed_experts)[: cfg.num_experts_per_tok] for _ in range(9)])
    weights, experts = route(jnp.asarray(logits_TE), jnp.asarray(rng.normal(size=cfg.n_routed_experts)), cfg,
                             jnp.asarray(replay_TK))
    scores = 1 / (1 + np.exp(-logits_TE.astype(np.float64)))
    want = np.take_along_axis(scores, replay_TK, axis=1)
    want = want / want.sum(-1, keepdims=True) if cfg.norm_topk_prob else want
    np.testing.assert_array_equal(experts, replay_TK)
    np.testing.assert_allclose(weights, want * cfg.routed_scaling_factor, rtol=1e-6)

    ids = rng.integers(0, 256, (2, 12)).astype(np.int32)
    own = np.asarray(sown_routes(sown(model.module, model.params, ids)[1], cfg))
    np.testing.assert_array_equal(model.logits(ids, routed_experts=own), model.logits(ids))
    other = (own + 1) % cfg.n_routed_experts  # still distinct per row
    logits, rows = sown(model.module, model.params, ids, model.replayed(other, ids.shape))
    np.testing.assert_array_equal(sown_routes(rows, cfg), other)
    assert not np.allclose(logits, model.logits(ids))
    grads = jax.jit(jax.grad(lambda p: model.module.apply({"params": p}, ids, routed_experts=jnp.asarray(other)).sum()))(
        model.params)
    assert np.abs(np.asarray(grads["layers_1"]["mlp"]["gate"]["kernel"])).max() > 0
    # Three dense layers first (as GLM-4.5's): MoE layer l is model layer 3 + l, and routes row l.
    cfg3 = dataclasses.replace(cfg, num_layers=5, first_k_dense_replace=3)
    deep = dataclasses.replace(model, config=cfg3, params=init_params(cfg3, WeightPlan(), jnp.float32, 0, None))
    shifted = np.stack([own[:, :, 0], (own[:, :, 1] + 1) % cfg.n_routed_experts], axis=2)
    np.testing.assert_array_equal(sown_routes(sown(deep.module, deep.params, ids, deep.replayed(shifted, ids.shape))[1],
                                              cfg3), shifted)
    bad = [(own[:, :-1], r"\[batch, time, MoE layers, top-k\] = \[2, 12, 2, 2\], got \[2, 11, 2, 2\]"),
           (np.where(own == own.max(), cfg.n_routed_experts, own), r"expert ids in \[0, 8\)"),
           (own.astype(np.float32), r"integer expert ids"),
           (np.repeat(own[..., :1], 2, axis=-1), "names an expert twice")]
    for routes, message in bad:
        with pytest.raises(ValueError, match=message):
            model.logits(ids, routed_experts=routes)


def test_indexer_replay_attends_to_the_given_positions():
    """Replaying a forward's own choices gives its logits bit for bit; another choice (each token's
    first positions) is attended as given: its mask holds exactly those positions, the sown rows are
    the replayed ones, and the logits change. A row that could see the future, names no position,
    or has the wrong shape or type is refused by name; so is a model without an indexer."""
    model = glm5()
    cfg, rng = model.config, np.random.default_rng()
    ids = rng.integers(0, 256, (2, 12)).astype(np.int32)
    own = np.asarray(sown_indexer_topk(sown(model.module, model.params, ids)[1], cfg))
    assert own.shape == (2, 12, 2, TOP_K)
    np.testing.assert_array_equal(model.logits(ids, indexer_topk=own), model.logits(ids))
    first = np.where(np.arange(TOP_K) <= np.arange(12)[:, None], np.arange(TOP_K), -1)  # [T, K]
    other = np.broadcast_to(first[None, :, None], own.shape).copy()
    assert (other != own).any()
    mask = np.asarray(NoCache().index_replay(jnp.asarray(other[:, :, 0])))
    want = np.zeros((2, 12, 12), bool)
    for t, row in enumerate(first):
        want[:, t, row[row >= 0]] = True
    np.testing.assert_array_equal(mask, want)
    logits, rows = sown(model.module, model.params, ids, indexer_topk=model.replayed_indexer_topk(other, ids.shape))
    np.testing.assert_array_equal(sown_indexer_topk(rows, cfg), other)
    assert not np.allclose(logits, model.logits(ids))
    future = own.copy()
    future[0, 3, 0, 0] = 4
    none = own.copy()
    none[1, 5, 1] = -1
    bad = [(own[:, :-1], r"\[batch, time, indexer layers, index_topk\] = \[2, 12, 2, 4\], got \[2, 11, 2, 4\]"),
           (future, r"positions in \[0, t\]"), (np.where(own < 0, -2, own), r"positions in \[0, t\]"),
           (none, "chooses no position"), (own.astype(np.float32), "integer positions")]
    for chosen, message in bad:
        with pytest.raises(ValueError, match=message):
            model.logits(ids, indexer_topk=chosen)
    kimi = mixserve.load("tiny-kimi", dtype="float32")
    with pytest.raises(ValueError, match="needs a model with a DSA indexer"):
        kimi.logits(ids, indexer_topk=own)
    with pytest.raises(ValueError, match="return_indexer_topk needs a model with a DSA indexer"):
        Engine(kimi, num_pages=8, return_indexer_topk=True)
