"""Paged KV pools: FP8 attention against full precision within the e4m3 rounding bound,
per-head scales, and the decode kernels plugged in through the attention backend."""

import os

import jax.numpy as jnp
import numpy as np
import pytest

from mixserve.kv_cache import PagedKV, StepInputs, bytes_per_token, init_pools, kv_format, layer_scales
from models.kv import NoCache
from models.presets import TINY_PRESETS

CFG = TINY_PRESETS["tiny-glm4"].replace(num_layers=1)  # 4 query heads, 2 KV heads of 16
E4M3_U = 2.0**-4  # relative rounding of a normal e4m3 value: 3 mantissa bits, round to nearest
E4M3_SUB = 2.0**-10  # absolute rounding below the smallest normal (2^-6): half the 2^-9 spacing


def run_attention(kv_dtype, q_BHD, k_BSKD, v_BSKD, k_scale, v_scale, page_size=4, backend="xla"):
    """Write S context tokens by prefill, then decode one more (its K/V are the last ones given)."""
    B, S1, K, D = k_BSKD.shape
    S = S1 - 1
    n_pages = -(-S1 // page_size)
    pools = init_pools(CFG, B * n_pages, page_size, kv_format(kv_dtype, jnp.float32))
    pages = jnp.arange(B * n_pages, dtype=jnp.int32).reshape(B, n_pages)
    scales = dict(k_scale=layer_scales(k_scale, "k_scale", CFG), v_scale=layer_scales(v_scale, "v_scale", CFG))
    prefill = PagedKV(pools, StepInputs(pages, jnp.zeros(B, jnp.int32), jnp.full(B, S, jnp.int32)), page_size, backend=backend, **scales)
    H = q_BHD.shape[1]
    prefill.layer(0).attend_gqa(jnp.zeros((B, S, H, D)), k_BSKD[:, :S], v_BSKD[:, :S], scale=D**-0.5)
    decode = PagedKV(prefill.new_pools, StepInputs(pages, jnp.full(B, S, jnp.int32), jnp.ones(B, jnp.int32)), page_size, backend=backend, **scales)
    return decode.layer(0).attend_gqa(q_BHD[:, None], k_BSKD[:, S:], v_BSKD[:, S:], scale=D**-0.5)[:, 0]


def test_writes_past_the_page_tables_width_are_dropped_not_wrapped_into_its_last_page():
    """Positions 6..9 of a request whose table holds 2 pages of 4: 6 and 7 land in its second
    page's slots 2 and 3; 8 and 9 have no page and are dropped. (The position's page column was
    once clamped to the table's last, which wrote them over slots 0 and 1 of that page.)"""
    rng = np.random.default_rng()
    pools = init_pools(CFG, 4, 4, kv_format("float32", jnp.float32))
    scales = dict(k_scale=layer_scales(1.0, "k_scale", CFG), v_scale=layer_scales(1.0, "v_scale", CFG))
    step = StepInputs(jnp.asarray([[3, 1]], jnp.int32), jnp.asarray([6], jnp.int32), jnp.asarray([4], jnp.int32))
    kv = PagedKV(pools, step, 4, **scales)
    k_BTKD, v_BTKD = (jnp.asarray(rng.standard_normal((1, 4, 2, 16)), jnp.float32) for _ in range(2))
    kv.layer(0).attend_gqa(jnp.asarray(rng.standard_normal((1, 4, 4, 16)), jnp.float32), k_BTKD, v_BTKD, scale=0.25)
    for name, fresh_BTKD in (("k", k_BTKD), ("v", v_BTKD)):
        want_KPSD = np.zeros(pools[0][name].shape, np.float32)
        want_KPSD[:, 1, 2:] = np.moveaxis(np.asarray(fresh_BTKD[0, :2]), 1, 0)
        np.testing.assert_array_equal(np.asarray(kv.new_pools[0][name]), want_KPSD)


@pytest.mark.parametrize("per_head", [False, True])
def test_fp8_attention_within_e4m3_bound(per_head):
    """|o_fp8 - o| <= max_j |dv_j| + (exp(2 eps) - 1) max|v|, eps = max_j |q . dk_j| * softmax_scale.

    Each stored value x/scale is rounded with |error| <= u |x/scale| + 2^-10 (u = 2^-4), times the
    scale on the way out. A logit moves by at most eps, so each softmax weight changes by a factor
    within exp(+-2 eps) and ||dp||_1 <= exp(2 eps) - 1; the output is a p-weighted average of v."""
    seed = int.from_bytes(os.urandom(4), "little")
    rng = np.random.default_rng(seed)
    B, S, K, D = 3, 13, CFG.num_kv_heads, CFG.head_dim
    # q small enough that the bound says something: with std 0.25, 89 of 3000 seeds made it exceed
    # max|v| (the test then failed on its own precondition); with 0.125, none of 3000 did.
    q = jnp.asarray(rng.normal(0, 0.125, (B, CFG.num_heads, D)), jnp.float32)
    k = jnp.asarray(rng.normal(0, 1, (B, S + 1, K, D)) * (1 + 3 * rng.random((1, 1, K, 1))), jnp.float32)
    v = jnp.asarray(rng.normal(0, 1, (B, S + 1, K, D)), jnp.float32)
    if per_head:  # calibrated per KV head: absmax / 448
        k_scale, v_scale = jnp.max(jnp.abs(k), axis=(0, 1, 3)) / 448, jnp.max(jnp.abs(v), axis=(0, 1, 3)) / 448
    else:
        k_scale, v_scale = 1.0, 1.0
    exact = run_attention("float32", q, k, v, 1.0, 1.0)
    fp8 = run_attention("fp8_e4m3", q, k, v, k_scale, v_scale)
    ks = jnp.broadcast_to(jnp.asarray(k_scale), (K,))[None, None, :, None]
    vs = jnp.broadcast_to(jnp.asarray(v_scale), (K,))[None, None, :, None]
    dk = E4M3_U * jnp.abs(k) + E4M3_SUB * ks
    dv = E4M3_U * jnp.abs(v) + E4M3_SUB * vs
    qg = jnp.abs(q).reshape(B, K, -1, D)
    eps = float(jnp.max(jnp.einsum("bkgd,bskd->bkgs", qg, dk))) * D**-0.5
    bound = float(jnp.max(dv)) + (np.exp(2 * eps) - 1) * float(jnp.max(jnp.abs(v)))
    err = float(jnp.max(jnp.abs(fp8 - exact)))
    assert bound < float(jnp.max(jnp.abs(v))), "bound is vacuous; shrink q"
    assert 0 < err <= bound, f"seed {seed}: error {err:.4g} vs bound {bound:.4g}"


@pytest.mark.parametrize("kv_dtype", ["fp8_e4m3", "bfloat16"])
def test_pallas_decode_backend_matches_xla(kv_dtype):
    """The engine's attention backend switch: the Pallas GQA kernel (interpret mode on CPU) on the
    same pages as the XLA reference path, to float32 accumulation precision. The scales apply to
    FP8 pools only: a BF16 pool holds the values themselves, on either path."""
    rng = np.random.default_rng(int.from_bytes(os.urandom(4), "little"))
    B, S, K, D = 2, 21, CFG.num_kv_heads, CFG.head_dim
    q = jnp.asarray(rng.normal(0, 0.5, (B, CFG.num_heads, D)), jnp.float32)
    k = jnp.asarray(rng.normal(0, 1, (B, S + 1, K, D)), jnp.float32)
    v = jnp.asarray(rng.normal(0, 1, (B, S + 1, K, D)), jnp.float32)
    xla = run_attention(kv_dtype, q, k, v, 0.5, 0.25, page_size=8)
    kernel = run_attention(kv_dtype, q, k, v, 0.5, 0.25, page_size=8, backend="interpret")
    np.testing.assert_allclose(np.asarray(kernel), np.asarray(xla), atol=2e-5, rtol=2e-5)
    if kv_dtype == "bfloat16":  # the values as given, rounded to bf16 once
        unscaled = run_attention(kv_dtype, q, k, v, 1.0, 1.0, page_size=8)
        np.testing.assert_allclose(np.asarray(xla), np.asarray(unscaled), atol=1e-6)


def test_scales_leave_a_bf16_latent_pool_alone_on_both_backends():
    """MLA's latent scale, like GQA's: given with a BF16 pool, neither the XLA path nor the kernel
    applies it (the engine serves what it would without scales)."""
    import mixserve
    from mixserve.engine import Engine

    model = mixserve.load("tiny-kimi", dtype="float32")
    prompts = [list(map(int, np.random.default_rng(i).integers(0, 256, 9 + 4 * i))) for i in range(2)]
    kw = dict(kv_dtype="bfloat16", num_pages=16, page_size=8, max_batch=2, stop_tokens=())
    runs = [Engine(model, attention_backend=backend, **kw, **scales).generate(prompts, max_new_tokens=4, logprobs=0)
            for backend, scales in (("xla", {}), ("xla", dict(k_scale=0.5, v_scale=0.5)),
                                    ("interpret", dict(k_scale=0.5, v_scale=0.5)))]
    for other in runs[1:]:
        assert [r.tokens for r in other] == [r.tokens for r in runs[0]]
        np.testing.assert_allclose([lp.logprob for r in other for lp in r.logprobs],
                                   [lp.logprob for r in runs[0] for lp in r.logprobs], atol=1e-5)


def test_calibrated_per_head_scales_feed_the_engine():
    import mixserve
    from mixserve.engine import Engine
    from mixserve.kv_cache import calibrate_scales

    model = mixserve.load("tiny-glm4", dtype="float32")
    batch = np.random.default_rng(0).integers(0, 256, (2, 12))
    k_scale, v_scale = calibrate_scales(model, batch, per_head=True)
    assert k_scale.shape == (model.config.num_kv_heads,) and bool(jnp.all(k_scale > 0))
    results = Engine(model, kv_dtype="fp8_e4m3", num_pages=16, page_size=4, max_batch=2, k_scale=k_scale,
                     v_scale=v_scale, stop_tokens=()).generate([list(map(int, batch[0]))], max_new_tokens=3)
    assert results[0].status == "ok"
    with pytest.raises(ValueError, match="per-head"):
        calibrate_scales(mixserve.load("tiny-kimi", dtype="float32"), batch, per_head=True)
    with pytest.raises(ValueError, match="nothing to calibrate"):
        calibrate_scales(mixserve.load("tiny-kimi", dtype="float32"), batch, kv_dtype="fp8_ds_mla")


def test_layer_scales_take_every_form_and_refuse_the_rest():
    """Engine k_scale/v_scale: a scalar or [KVH] for every layer, or per layer [L, 1] / [L, KVH];
    per layer over the decoder layers only, the MTP draft's pool takes the largest; a checkpoint's
    MTP scale is dropped when there is no MTP pool."""
    cfg = TINY_PRESETS["tiny-glm4"]  # 3 layers, 2 KV heads
    L, K = cfg.num_layers, cfg.num_kv_heads
    np.testing.assert_array_equal(layer_scales(0.5, "k_scale", cfg), [0.5] * L)
    np.testing.assert_array_equal(layer_scales([0.5, 2.0], "k_scale", cfg), [[0.5, 2.0]] * L)
    per_layer = np.asarray([[0.1], [0.3], [0.2]], np.float32)
    np.testing.assert_array_equal(layer_scales(per_layer, "k_scale", cfg), per_layer[:, 0])
    np.testing.assert_array_equal(layer_scales(per_layer, "k_scale", cfg, mtp=True), np.float32([0.1, 0.3, 0.2, 0.3]))
    with_mtp = np.asarray([[0.1], [0.3], [0.2], [0.4]], np.float32)
    np.testing.assert_array_equal(layer_scales(with_mtp, "k_scale", cfg), np.float32([0.1, 0.3, 0.2]))
    assert layer_scales(np.ones((L, K)), "v_scale", cfg).shape == (L, K)
    for bad in (np.ones(3), np.ones((2, 1)), np.ones((L, 3)), np.ones((L, 1, 1))):
        with pytest.raises(ValueError, match="k_scale must be a scalar, one value per KV head"):
            layer_scales(bad, "k_scale", cfg)
    with pytest.raises(ValueError, match="v_scale must be finite and positive"):
        layer_scales(np.asarray([[0.1], [0.0], [0.2]]), "v_scale", cfg)
    with pytest.raises(ValueError, match="MLA keeps one latent per token"):
        layer_scales(np.ones((3, 4)), "k_scale", TINY_PRESETS["tiny-kimi"])


def test_per_layer_calibration_is_the_per_tensor_scale_split_by_layer():
    import mixserve
    from mixserve.engine import Engine
    from mixserve.kv_cache import calibrate_scales

    model = mixserve.load("tiny-glm4", dtype="float32")
    batch = np.random.default_rng(1).integers(0, 256, (2, 12))
    for per_head in (False, True):
        k_all, v_all = calibrate_scales(model, batch, per_head=per_head)
        k_layers, v_layers = calibrate_scales(model, batch, per_head=per_head, per_layer=True)
        assert k_layers.shape == (model.config.num_layers, model.config.num_kv_heads if per_head else 1)
        # Two compiled forwards, which XLA may sum in other orders: a float32 dot over the 64-wide
        # hidden state errs by at most 64 u = 3.8e-6 relative; the keys pass a few such.
        np.testing.assert_allclose(jnp.max(k_layers, axis=0).reshape(k_all.shape), k_all, rtol=1e-5)
        np.testing.assert_allclose(jnp.max(v_layers, axis=0).reshape(v_all.shape), v_all, rtol=1e-5)
        assert float(jnp.min(k_layers)) < float(jnp.max(k_all))  # the layers differ
        engine = Engine(model, kv_dtype="fp8_e4m3", num_pages=16, page_size=4, max_batch=2, k_scale=k_layers,
                        v_scale=v_layers, stop_tokens=())
        assert engine.generate([list(map(int, batch[0]))], max_new_tokens=3)[0].status == "ok"


def test_fp8_ds_mla_bytes_per_token_are_flashmlas():
    """656 bytes per token and layer at Kimi K2's 512 + 64 (512 e4m3, 4 float32 tile scales, 64
    bf16 RoPE values); GLM-5's full indexer layers add 128 e4m3 keys and one float32 scale.
    GQA has no latent to tile: asking for it is an error, not a silent fallback."""
    from mixserve.engine import Engine
    from models.presets import PRESETS
    import mixserve

    tiled = kv_format("fp8_ds_mla", None)
    kimi, glm5 = PRESETS["kimi-k2"], PRESETS["glm-5"]
    assert bytes_per_token(kimi, tiled) == 61 * 656
    assert bytes_per_token(kimi, kv_format("fp8_e4m3", None)) == 61 * 576
    full = sum(t == "full" for t in glm5.indexer_types)
    assert bytes_per_token(glm5, tiled) == 78 * 656 + full * (128 + 4)
    with pytest.raises(ValueError, match="MLA latents; this model uses GQA"):
        Engine(mixserve.load("tiny-glm4", dtype="float32"), kv_dtype="fp8_ds_mla", num_pages=8)
    with pytest.raises(ValueError, match=r"unknown KV cache dtype 'int8' \(kv_dtype, --kv-cache-dtype\); expected one of"):
        kv_format("int8", None)


class _Recorder(NoCache):
    """Cache-free attention that keeps every layer's latent [c_kv, k_pe] and DSA index keys."""

    def __init__(self):
        self.latents, self.index_keys = [], []

    def layer(self, i):
        return self

    def attend_mla(self, q_nope, q_pe, c_kv, k_pe, kv_b, *, scale, index_mask=None):
        self.latents.append(np.concatenate([np.asarray(c_kv), np.asarray(k_pe)], axis=-1)[0])
        return super().attend_mla(q_nope, q_pe, c_kv, k_pe, kv_b, scale=scale, index_mask=index_mask)

    def index_select(self, q_BTHD, k_BTD, w_BTH, *, scale, top_k):
        self.index_keys.append(np.asarray(k_BTD)[0])
        return super().index_select(q_BTHD, k_BTD, w_BTH, scale=scale, top_k=top_k)


@pytest.mark.parametrize("backend", ["xla", "interpret"])
def test_fp8_ds_mla_pages_hold_each_tokens_latent_within_the_e4m3_bound(backend):
    """GLM-5 (latent and index keys) served with fp8_ds_mla: after prefill, the request's pages,
    dequantized, are the cache-free forward's latents and index keys within e4m3's rounding
    (2^-4 relative, 2^-10 of the tile's scale below the normals); RoPE dims within bf16's 2^-8.
    The engine's prefill and the cache-free forward compute the latents in different float32
    orders: each value may differ by float32 roundings of its dot product's terms, so both bounds
    add 1e-5 of the token's largest value: 13x the largest difference measured over 10 prompts
    with float32 KV (7.7e-7), and not relative to the value itself, since a small value can be the
    difference of large terms (one seed gave 5e-4 relative on a RoPE value of 4e-5).
    The tokens are equal with the XLA path and the Pallas kernel (interpret), so the kernel reads
    the layout the pool writes."""
    import mixserve
    from mixserve.engine import Engine
    from pallas_kernels.tiled_fp8 import dequantize_tiles

    model = mixserve.load("tiny-glm5", dtype="float32")
    cfg, L = model.config, model.config.kv_lora_rank
    prompt = [int(t) for t in np.random.default_rng(int.from_bytes(os.urandom(4), "little")).integers(0, 256, 13)]
    engine = Engine(model, kv_dtype="fp8_ds_mla", num_pages=16, page_size=4, max_batch=2, attention_backend=backend,
                    stop_tokens=(), min_decode_rows=2)
    rid = engine.submit(prompt, max_new_tokens=6)
    engine.step()
    req = engine._unreported[rid]
    pages = np.asarray(engine.table.pages_BN)[req.slot, :4]
    rec = _Recorder()
    model.module.apply({"params": model.params}, jnp.asarray([prompt], jnp.int32), kv=rec)
    pools = engine.runner.pools
    index_layers = [i for i, t in enumerate(cfg.indexer_types) if t == "full"]
    assert len(rec.index_keys) == len(index_layers) > 0
    for layer, pool in enumerate(pools):
        tokens = lambda name: np.asarray(pool[name], np.float32)[pages].reshape(16, -1)[:13]
        entries = [("latent", rec.latents[layer])]
        if layer in index_layers:
            entries.append(("index", rec.index_keys[index_layers.index(layer)]))
        for name, real in entries:
            width = tokens(name).shape[1]
            scales = tokens(name + "_scale")
            got = np.asarray(dequantize_tiles(jnp.asarray(tokens(name)), jnp.asarray(scales)))
            s_full = np.repeat(scales, width // scales.shape[1], axis=1)
            x = real[:, :width]
            bound = 2.0**-4 * np.abs(x) + 2.0**-10 * s_full + 1e-5 * np.abs(x).max(axis=1, keepdims=True)
            assert np.all(np.abs(got - x) <= bound), (layer, name)
            assert np.all((scales > 0) & (np.log2(scales) == np.round(np.log2(scales)))), "powers of two"
        rope, want = tokens("rope"), rec.latents[layer][:, L:]
        assert np.all(np.abs(rope - want) <= 2.0**-8 * np.abs(want) + 1e-5 * np.abs(want).max(axis=1, keepdims=True)), layer
    while engine.has_work():
        engine.step()
    reference = Engine(model, kv_dtype="fp8_ds_mla", num_pages=16, page_size=4, max_batch=2, stop_tokens=(),
                       min_decode_rows=2).generate([prompt], max_new_tokens=6)
    assert req.result.tokens == reference[0].tokens
    assert engine.free_pages == engine.num_pages
