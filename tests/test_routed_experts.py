"""Routed experts return (vLLM's --enable-return-routed-experts, for an RL trainer's routing
replay): each request's Result.routed_experts holds the experts every MoE layer chose for each
position fed to the model. They must be the choices of the cache-free forward over the request's
final sequence (float32 weights: the paged, chunked, cached and speculative paths agree with it to
roundoff, and these random models' choices are nowhere near a tie at that scale), whatever path
computed each position: chunked prefill, decode, a prefix-cache hit (device or host tier), a
recompute after preemption, speculative verification, a disaggregated hand-over."""

import numpy as np
import pytest

import mixserve
from mixserve.disaggregated import DisaggregatedEngine
from mixserve.engine import Engine
from models.moe import sown_routes
from conftest import ONE_STEP_SHAPE
from test_engine import engine, prompts

NEW = 6
PADDED = 72  # the reference's sequence length: one compile per model (causal: the padding changes nothing before it)


def cache_free(model, tokens: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """(routes int16 [len - 1, L, K], greedy next token at each of those positions) of the plain
    forward over tokens: the rows a Result holds, and the tokens greedy decoding would have fed."""
    seq = np.zeros((1, PADDED), np.int32)
    seq[0, : len(tokens)] = tokens
    logits, state = model.module.apply({"params": model.params}, seq, mutable=["intermediates"])
    routes = np.asarray(sown_routes(state["intermediates"], model.config))[0, : len(tokens) - 1]
    return routes, np.argmax(np.asarray(logits)[0, : len(tokens) - 1], axis=-1)


def assert_cache_free_routes(model, prompt: list[int], result) -> None:
    assert result.status == "ok", result.reason
    tokens = prompt + result.tokens
    routes, greedy = cache_free(model, tokens)
    np.testing.assert_array_equal(result.routed_experts, routes)
    assert list(greedy[len(prompt) - 1:]) == result.tokens  # the flag changes no token


def test_routed_experts_are_the_cache_free_forwards_choices():
    """Ragged prompts (1 to 14 tokens: one token, pages of 4 ending mid-page, two prefill chunks of
    8) in one batch with padding rows, then decode, in a pool of 10 pages that the four requests
    outgrow (some are preempted and recomputed): a row per position fed to the model, each the
    cache-free forward's experts in its order, one column per MoE layer (Kimi's first dense layer
    has none). The rows do not depend on the attention: GLM-5's are tested below (disaggregated)."""
    model = mixserve.load("tiny-kimi", dtype="float32")
    cfg, ps = model.config, prompts()
    e = engine(model, num_pages=10, integrity="check", return_routed_experts=True)
    moe_layers = sum(cfg.is_moe_layer(i) for i in range(cfg.num_layers))
    assert 0 < moe_layers < cfg.num_layers and e.routes_shape == (moe_layers, cfg.num_experts_per_tok)
    for p, r in zip(ps, e.generate(ps, max_new_tokens=NEW)):
        assert r.routed_experts.shape == (len(p) + NEW - 1, moe_layers, cfg.num_experts_per_tok)
        assert r.routed_experts.dtype == np.int16
        assert_cache_free_routes(model, p, r)
    assert e.counters.preemptions > 0


def test_prefix_cache_hits_return_the_routing_that_computed_their_pages():
    """A prompt that extends an earlier request's sequence shares its full pages: their rows come
    from the routing stored with them (none of them is computed again). After the pages are
    evicted to the host tier and restored, the same. A request cancelled mid-decode holds the rows
    of the positions it got to."""
    model = mixserve.load("tiny-kimi", dtype="float32")
    e = engine(model, return_routed_experts=True, host_kv_bytes=1 << 20)
    first = prompts(1)[3]  # 14 tokens
    [a] = e.generate([first], max_new_tokens=NEW)
    assert_cache_free_routes(model, first, a)
    longer = first + a.tokens + [7, 8, 9]
    [b] = e.generate([longer], max_new_tokens=NEW)
    assert b.cached_tokens == 16  # the 4 full pages of 19 fed tokens
    assert_cache_free_routes(model, longer, b)
    pm = e.page_manager
    assert set(pm.routes) == set(pm._cache) and pm.routes
    pm.evict_all()  # into the host tier
    assert not pm.routes and not pm._cache  # the host keeps the rows with the pages
    [c] = e.generate([longer], max_new_tokens=NEW)
    assert e.counters.host_restored_tokens >= 16 and c.tokens == b.tokens
    assert_cache_free_routes(model, longer, c)
    rid = e.submit(first[:9], max_new_tokens=NEW)
    got = []
    while len(got) < 3:
        got += [t for u in e.step() for t in u.new_tokens]
    e.cancel(rid)
    [cancelled] = [u.result for u in e.step() if u.rid == rid]
    assert cancelled.status == "aborted" and len(cancelled.tokens) == 3
    routes, _ = cache_free(model, first[:9] + cancelled.tokens)
    np.testing.assert_array_equal(cancelled.routed_experts, routes)


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
    assert e.update_weights(new) == 3 and not e.page_manager.routes
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
    """A verify step computes a row per draft; a request keeps those of its fed token and the
    drafts it accepted (n-gram drafts, on a model whose greedy output falls into cycles)."""
    model = mixserve.load("tiny-kimi", dtype="float32")
    ps = [[int(t) for t in np.random.default_rng(i).integers(0, 256, 5 + 7 * i)] for i in range(3)]
    e = Engine(model, num_pages=128, page_size=8, max_batch=4, stop_tokens=(), speculative_tokens=4, draft="ngram",
               return_routed_experts=True, **ONE_STEP_SHAPE)
    for p, r in zip(ps, e.generate(ps, max_new_tokens=48)):
        assert_cache_free_routes(model, p, r)
    assert e.counters.accepted_tokens > 0 and e.counters.steps < 47


def test_mtp_drafts_leave_the_rows_the_models_own_layers_chose():
    """The MTP layer is a MoE layer too, run beside every prefill and verify step (its KV, its
    drafts): its choices are not the model's and must not reach the rows (a random MTP layer, whose
    drafts are mostly rejected: each step keeps the fed token's row and its accepted drafts')."""
    model = mixserve.load("tiny-kimi", dtype="float32", mtp=True)
    e = engine(model, speculative_tokens=2, return_routed_experts=True)
    ps = prompts()
    for p, r in zip(ps, e.generate(ps, max_new_tokens=NEW)):
        assert_cache_free_routes(model, p, r)
    assert e.counters.verified_rows > 0


def test_a_disaggregated_pair_hands_the_prompt_routing_over_with_the_pages():
    """The prefill engine's rows go with the request to the decode engine, whose own follow. The
    flag must be on both engines or on neither."""
    model = mixserve.load("tiny-glm5", dtype="float32")
    kw = dict(num_pages=48, page_size=4, max_batch=4, prefill_chunk=8, stop_tokens=(), **ONE_STEP_SHAPE)
    pair = DisaggregatedEngine(Engine(model, prefill_only=True, return_routed_experts=True, **kw),
                               Engine(model, return_routed_experts=True, **kw))
    ps = prompts()
    for p, r in zip(ps, pair.generate(ps, max_new_tokens=NEW)):
        assert_cache_free_routes(model, p, r)
    assert pair.counters.handovers == len(ps)
    longer = ps[3] + [7] * 6  # its first 3 pages are in both pools: the decode engine shares them
    [r] = pair.generate([longer], max_new_tokens=NEW)
    assert pair.counters.pages_shared >= 3
    assert_cache_free_routes(model, longer, r)
    with pytest.raises(ValueError, match="return_routed_experts must be on both engines"):
        DisaggregatedEngine(Engine(model, prefill_only=True, **kw), Engine(model, return_routed_experts=True, **kw))


def test_the_server_returns_each_choices_prompt_and_output_rows():
    """--enable-return-routed-experts: each finished choice has prompt_routed_experts (a row per
    prompt token) and routed_experts (a row per output token fed back: all but the last): the
    rows of the engine's Result for the same greedy request, split at the prompt's end. Streamed,
    the choice's last chunk has them, and no earlier one."""
    from test_server import FLAGS, events, post, serving
    from mixserve import server

    s = serving(server.make_server([*FLAGS, "--port", "0", "--enable-return-routed-experts"]))
    prompts_ = [[1, 2, 3, 4, 5], [9] * 7]
    try:
        status, body = post(s, {"prompt": prompts_, "max_tokens": 4, "temperature": 0})
        streamed = [e["choices"][0] for e in events(s, {"prompt": prompts_[1], "max_tokens": 4, "temperature": 0})
                    if e != "[DONE]"]
        direct = s.loop.between_steps(lambda engine: engine.generate(prompts_, max_new_tokens=4))
    finally:
        s.close()
    assert status == 200, body
    assert ["routed_experts" in c for c in streamed] == [False] * (len(streamed) - 1) + [True]
    assert streamed[-1]["prompt_routed_experts"] + streamed[-1]["routed_experts"] == direct[1].routed_experts.tolist()
    for choice, prompt, r in zip(body["choices"], prompts_, direct):
        assert np.array(choice["prompt_routed_experts"]).shape[0] == len(prompt)
        assert np.array(choice["routed_experts"]).shape[0] == len(r.tokens) - 1
        np.testing.assert_array_equal(choice["prompt_routed_experts"] + choice["routed_experts"], r.routed_experts)


def test_routing_replay_sends_each_token_to_the_given_experts_with_its_own_routers_weights():
    """route(replay_TK=) keeps those experts, weighted by the router's own scores at them (against
    float64 numpy: sigmoid, normalised, scaled; float32 rounds each step to 2^-24 relative, a few
    steps: 1e-6). Replaying a model's own routing gives its logits bit for bit; another routing is
    routed as given (the forward's sown rows are the replayed ones), changes the logits, and the
    gradient still reaches the router. A row the model cannot route is refused by name."""
    import dataclasses

    import jax
    import jax.numpy as jnp
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
    _, state = model.module.apply({"params": model.params}, ids, mutable=["intermediates"])
    own = np.asarray(sown_routes(state["intermediates"], cfg))
    np.testing.assert_array_equal(model.logits(ids, routed_experts=own), model.logits(ids))
    other = (own + 1) % cfg.n_routed_experts  # still distinct per row
    logits, state = model.module.apply({"params": model.params}, ids, routed_experts=model.replayed(other, ids.shape),
                                       mutable=["intermediates"])
    np.testing.assert_array_equal(sown_routes(state["intermediates"], cfg), other)
    assert not np.allclose(logits, model.logits(ids))
    grads = jax.grad(lambda p: model.module.apply({"params": p}, ids, routed_experts=jnp.asarray(other)).sum())(
        model.params)
    assert np.abs(np.asarray(grads["layers_1"]["mlp"]["gate"]["kernel"])).max() > 0
    # Three dense layers first (as GLM-4.5's): MoE layer l is model layer 3 + l, and routes row l.
    cfg3 = dataclasses.replace(cfg, num_layers=5, first_k_dense_replace=3)
    deep = dataclasses.replace(model, config=cfg3, params=init_params(cfg3, WeightPlan(), jnp.float32, 0, None))
    shifted = np.stack([own[:, :, 0], (own[:, :, 1] + 1) % cfg.n_routed_experts], axis=2)
    _, state = deep.module.apply({"params": deep.params}, ids, routed_experts=deep.replayed(shifted, ids.shape),
                                 mutable=["intermediates"])
    np.testing.assert_array_equal(sown_routes(state["intermediates"], cfg3), shifted)
    bad = [(own[:, :-1], r"\[batch, time, MoE layers, top-k\] = \[2, 12, 2, 2\], got \[2, 11, 2, 2\]"),
           (np.where(own == own.max(), cfg.n_routed_experts, own), r"expert ids in \[0, 8\)"),
           (own.astype(np.float32), r"integer expert ids"),
           (np.repeat(own[..., :1], 2, axis=-1), "names an expert twice")]
    for routes, message in bad:
        with pytest.raises(ValueError, match=message):
            model.logits(ids, routed_experts=routes)
