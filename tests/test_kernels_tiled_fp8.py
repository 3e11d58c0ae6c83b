"""FlashMLA's tile-scaled FP8 latent layout (pallas_kernels/tiled_fp8.py): the quantizer against a
float64 numpy statement of the format, and the MLA kernels over tiled pages against their
reference and a float64 attention.

Inputs are fresh each run (seed from os.urandom, in every message). Tokens differ in magnitude
by up to e^±6 and tiles within a token by e^±2, which is what per-token tile scales are for.
Unused slots hold NaN in all three pools (nope, scales, rope), and the interpreter poisons
outputs, as in test_kernels_attention.py. The tiled kernels dequantize exactly into bf16 (the
tiled_fp8 docstring), so they get the tolerances of the untiled kernels over the same values.
"""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from conftest import KERNEL_BACKEND
from test_kernels_attention import (
    BF16_TOL, F32_TOL, U_BF16, PagedCache, _as_np, _check_close, _rng, _seed, _softmax_attend)

from pallas_kernels import paged_attention_mla, sparse_paged_attention_mla
from pallas_kernels.backend import triton_kernels_for_cuda
from pallas_kernels.flash_decoding import AttentionTuning
from pallas_kernels.paged_attention_mla import TiledLatentPages
from pallas_kernels.tiled_fp8 import dequantize_tiles, quantize_tiles

E4M3_U = 2.0**-4  # relative rounding of a normal e4m3 value
E4M3_SUB = 2.0**-10  # absolute rounding (in units of the scale) below e4m3's smallest normal 2^-6


def _spread_values(rng, shape, tile: int, token_spread: float = 6, tile_spread: float = 2) -> np.ndarray:
    """Normal values with per-token (e^±token_spread) and per-tile (e^±tile_spread) magnitudes."""
    *lead, columns = shape
    x = rng.standard_normal(shape) * np.exp(rng.uniform(-token_spread, token_spread, (*lead, 1)))
    tiles = x.reshape(*lead, columns // tile, tile)
    return (tiles * np.exp(rng.uniform(-tile_spread, tile_spread, (*lead, columns // tile, 1)))).reshape(shape)


def _quantize_float64(x: np.ndarray, tile: int) -> tuple[np.ndarray, np.ndarray]:
    """The format in numpy: s = 2^ceil(log2(amax / 448)) per tile, stored = e4m3(x / s)."""
    *lead, columns = x.shape
    tiles = x.reshape(*lead, columns // tile, tile)
    amax = np.abs(tiles).max(axis=-1)
    scales = 2.0 ** np.ceil(np.log2(np.maximum(amax, 448 * 2.0**-100) / 448))
    stored = (tiles / scales[..., None]).astype(ml_dtypes.float8_e4m3fn)  # in range: no clamp needed
    return stored.reshape(x.shape), scales


@pytest.mark.parametrize("columns, tile", [(512, 128), (64, 64), (16, 16)])
def test_quantizer_is_the_format_bit_for_bit_and_within_the_e4m3_bound(columns, tile):
    seed = _seed()
    rng = _rng(seed)
    x = _spread_values(rng, (7, 33, columns), tile).astype(np.float32)
    x[0, 0] = 0.0  # an all-zero token
    x[1, 2, :tile] = 448.0 * 2.0**-20  # a tile whose amax is exactly 448 times a power of two
    stored, scales = quantize_tiles(jnp.asarray(x), tile)
    want_stored, want_scales = _quantize_float64(x.astype(np.float64), tile)
    np.testing.assert_array_equal(np.asarray(scales, np.float64), want_scales, err_msg=f"seed={seed}")
    np.testing.assert_array_equal(np.asarray(stored).view(np.uint8), want_stored.view(np.uint8), err_msg=f"seed={seed}")
    assert scales[1, 2, 0] == 2.0**-20, f"exact power of two must not round up, seed={seed}"
    # Every tile's largest value uses e4m3's top binade: |max| / s in (224, 448].
    ratio = np.abs(x.reshape(7, 33, -1, tile)).max(-1) / np.asarray(scales)
    assert np.all((ratio > 224) & (ratio <= 448) | (ratio == 0)), f"seed={seed}"
    back = np.asarray(dequantize_tiles(stored, scales), np.float64)
    s_full = np.repeat(np.asarray(scales, np.float64), tile, axis=-1)
    bound = np.maximum(E4M3_U * np.abs(x), E4M3_SUB * s_full)
    assert np.all(np.abs(back - x) <= bound), f"seed={seed}"
    # Exact in bf16: dequantizing straight into bf16 loses nothing.
    np.testing.assert_array_equal(np.asarray(dequantize_tiles(stored, scales, jnp.bfloat16), np.float32),
                                  np.asarray(back, np.float32), err_msg=f"seed={seed}")


def test_non_finite_values_saturate_or_stay_nan_without_coarsening_their_tile():
    """An inf in a tile once made its scale 1 (frexp(inf)), storing the tile's finite values at
    the wrong binade; now the scale comes from the finite values, ±inf stores ±448 (e4m3fn has no
    infinity: the per-tensor pools saturate too) and NaN stays NaN."""
    seed = _seed()
    x = (_rng(seed).standard_normal((3, 128)) * 1e-3).astype(np.float32)
    clean = x.copy()
    x[0, 5], x[1, 7], x[2, 9] = np.inf, -np.inf, np.nan
    clean[0, 5] = clean[1, 7] = clean[2, 9] = 0.0
    stored, scales = quantize_tiles(jnp.asarray(x), 128)
    clean_stored, clean_scales = quantize_tiles(jnp.asarray(clean), 128)
    np.testing.assert_array_equal(np.asarray(scales), np.asarray(clean_scales), err_msg=f"seed={seed}")
    back, clean_back = (np.asarray(dequantize_tiles(a, b)) for a, b in ((stored, scales), (clean_stored, clean_scales)))
    s = np.asarray(scales)[:, 0]
    assert back[0, 5] == 448 * s[0] and back[1, 7] == -448 * s[1] and np.isnan(back[2, 9]), f"seed={seed}"
    finite = np.isfinite(x)
    np.testing.assert_array_equal(back[finite], clean_back[finite], err_msg=f"seed={seed}")
    # No nonzero finite value beside the inf: scale 1, so it saturates to 448 (the floor scale gave ~3.5e-28).
    lone = np.zeros((2, 128), np.float32)
    lone[0, 3], lone[1, :] = -np.inf, np.inf
    stored, scales = quantize_tiles(jnp.asarray(lone), 128)
    back = np.asarray(dequantize_tiles(stored, scales))
    assert back[0, 3] == -448 and np.all(back[1] == 448) and np.all(np.delete(back[0], 3) == 0), f"seed={seed}"


def test_per_token_tiles_beat_one_scale_on_spread_tokens():
    """What the layout is for: with token magnitudes spread over e^±6, one per-tensor scale
    (calibrated: absmax / 448) leaves the small tokens in e4m3's subnormals, tile scales do not."""
    seed = _seed()
    x = _spread_values(_rng(seed), (256, 512), 128).astype(np.float32)
    stored, scales = quantize_tiles(jnp.asarray(x), 128)
    tiled_err = np.linalg.norm(np.asarray(dequantize_tiles(stored, scales)) - x, axis=-1) / np.linalg.norm(x, axis=-1)
    scale = np.abs(x).max() / 448
    per_tensor = np.clip(x / scale, -448, 448).astype(ml_dtypes.float8_e4m3fn).astype(np.float32) * scale
    tensor_err = np.linalg.norm(per_tensor - x, axis=-1) / np.linalg.norm(x, axis=-1)
    # Normal e4m3 values round within 2^-4 relative (RMS about 0.03 over a token; seeds 0-7: at most
    # 0.033). One scale: tokens below ~2^-9 of the largest are partly or wholly subnormal or zero
    # (seeds 0-7: 20-29% of tokens above 0.1, the smallest at 1.0, i.e. stored as all zeros).
    assert np.max(tiled_err) < 0.05, f"seed={seed}"
    assert np.mean(tensor_err > 0.1) > 0.1 and np.max(tensor_err) > 0.5, f"seed={seed}"


def _tiled_inputs(rng, *, heads, rank, rope, page_size, num_slots, lengths, q_dtype):
    cache = PagedCache(rng, lengths, num_slots, page_size)
    # Milder spreads than the quantizer test's, so that no one token's logit swamps the softmax.
    nope = _spread_values(rng, (cache.num_pages, page_size, rank), min(128, rank), token_spread=2, tile_spread=1)
    rope_values = rng.standard_normal((cache.num_pages, page_size, rope)) * np.abs(nope).max(-1, keepdims=True) / 3
    stored, scales = quantize_tiles(jnp.asarray(nope, jnp.float32), min(128, rank))
    poison = lambda a: jnp.asarray(cache.poison(np.asarray(a, np.float32)), a.dtype)
    pages = TiledLatentPages(poison(stored), poison(scales), poison(jnp.asarray(rope_values, jnp.bfloat16)))
    q = rng.standard_normal((len(lengths), heads, rank + rope)) * 0.3
    return dict(q_BHC=jnp.asarray(q, q_dtype), latent_pages_PSC=pages, page_table_BN=jnp.asarray(cache.page_table),
                lengths_B=jnp.asarray(cache.lengths), kv_lora_rank=rank, softmax_scale=(rank + rope) ** -0.5), cache


def _real_latent(pages: TiledLatentPages) -> np.ndarray:
    nope, scales, rope = (np.asarray(jnp.asarray(x, jnp.float32), np.float64) for x in pages)
    tile = nope.shape[-1] // scales.shape[-1]
    return np.concatenate([nope * np.repeat(scales, tile, axis=-1), rope], axis=-1)


def _max_abs_v(args) -> float:
    return float(np.nanmax(np.abs(_real_latent(args["latent_pages_PSC"])[..., : args["kv_lora_rank"]])))


# (heads, rank, rope, page_size, num_slots, lengths): Kimi's 512 + 64 (four tiles), one tile
# of 64, ragged lengths with 0, 1 and mid-page ends.
TILED_SHAPES = [
    (8, 512, 64, 16, 12, (0, 1, 150)),
    (5, 64, 16, 8, 9, (56, 3, 70)),
]


# (shape, q dtype, tuning): what the kernel test runs (and sm90_compile.py --test-shapes compiles).
TILED_KERNEL_CASES = [
    (TILED_SHAPES[0], jnp.bfloat16, AttentionTuning(num_splits=2)),
    # 32-token blocks: at 128, float32 operands need 300 KiB of shared memory on the
    # H200 (the launch failed, 2026-11-30), 324 KiB in the offline sm_90a compile.
    (TILED_SHAPES[0], jnp.float32, AttentionTuning(block_tokens=32, num_splits=3)),
    (TILED_SHAPES[1], jnp.bfloat16, AttentionTuning(prefetch=True, block_tokens=16)),
    # float16 dots fall back to bf16 for tiled pages (f16 lacks the scales' exponent range).
    (TILED_SHAPES[1], jnp.bfloat16, AttentionTuning(fp8_dots="float16", num_splits=2)),
    (TILED_SHAPES[0], jnp.bfloat16, AttentionTuning(swap_pv=True, num_splits=3)),
]


@pytest.mark.parametrize("shape, q_dtype, tuning", TILED_KERNEL_CASES)
def test_tiled_mla_kernel_matches_reference_and_float64(shape, q_dtype, tuning):
    seed = _seed()
    h, rank, rope, s, n, lengths = shape
    args, cache = _tiled_inputs(_rng(seed), heads=h, rank=rank, rope=rope, page_size=s, num_slots=n,
                                lengths=lengths, q_dtype=q_dtype)
    real = _real_latent(args["latent_pages_PSC"])
    q = _as_np(args["q_BHC"])
    expected = np.stack([_softmax_attend(q[b], cache.tokens(b, real), cache.tokens(b, real)[:, :rank],
                                         args["softmax_scale"]) for b in range(len(lengths))])
    v_max = _max_abs_v(args)
    ref = paged_attention_mla(**args, backend="xla")
    rounding = U_BF16 if q_dtype == jnp.bfloat16 else 0.0  # the reference returns q's dtype
    _check_close(ref, expected, (F32_TOL + rounding) * v_max, seed, "tiled mla reference vs float64")
    got = paged_attention_mla(**args, backend=KERNEL_BACKEND, tuning=tuning)
    assert got.shape == (len(lengths), h, rank) and got.dtype == q_dtype
    tol = (F32_TOL if q_dtype == jnp.float32 else BF16_TOL) * v_max
    _check_close(got, _as_np(ref), tol, seed, "tiled mla kernel vs reference")
    assert np.all(_as_np(got)[np.asarray(cache.lengths) == 0] == 0), f"seed={seed}"


def test_tiled_sparse_mla_reads_only_the_chosen_tokens():
    """GLM-5's DSA decode over tiled pages: every valid token not chosen is NaN in all three
    pools, so a read of anything unchosen fails; ids past the count are garbage."""
    seed = _seed()
    rng = _rng(seed)
    h, rank, rope, s, n, lengths = TILED_SHAPES[0]
    top_k = 40
    args, cache = _tiled_inputs(rng, heads=h, rank=rank, rope=rope, page_size=s, num_slots=n, lengths=lengths,
                                q_dtype=jnp.bfloat16)
    pools = [np.array(x) for x in args["latent_pages_PSC"]]
    real = _real_latent(args["latent_pages_PSC"])
    ids = rng.integers(-5 * s, 2 * n * s, (len(lengths), top_k)).astype(np.int32)
    counts = np.minimum(top_k, cache.lengths).astype(np.int32)
    expected = np.zeros((len(lengths), h, rank))
    q = _as_np(args["q_BHC"])
    for b, length in enumerate(cache.lengths):
        chosen = rng.permutation(int(length))[:counts[b]]
        ids[b, :counts[b]] = chosen
        unchosen = np.setdiff1d(np.arange(length), chosen)
        tokens = real[cache.page_table[b, chosen // s], chosen % s]
        for pool in pools:
            pool[cache.page_table[b, unchosen // s], unchosen % s] = np.nan
        expected[b] = _softmax_attend(q[b], tokens, tokens[:, :rank], args["softmax_scale"])
    pages = TiledLatentPages(*(jnp.asarray(p) for p in pools))
    sparse = dict(args, latent_pages_PSC=pages, token_ids_BK=jnp.asarray(ids), counts_B=jnp.asarray(counts))
    del sparse["lengths_B"]
    v_max = float(np.nanmax(np.abs(real[..., :rank])))
    ref = sparse_paged_attention_mla(**sparse, backend="xla")
    _check_close(ref, expected, (F32_TOL + U_BF16) * v_max, seed, "tiled sparse reference vs float64")
    got = sparse_paged_attention_mla(**sparse, backend=KERNEL_BACKEND, tuning=AttentionTuning(num_splits=2))
    _check_close(got, _as_np(ref), BF16_TOL * v_max, seed, "tiled sparse kernel vs reference")


def test_tiled_pages_are_checked():
    args, _ = _tiled_inputs(_rng(0), heads=2, rank=64, rope=16, page_size=8, num_slots=2, lengths=(5,),
                            q_dtype=jnp.float32)
    pages = args["latent_pages_PSC"]
    with pytest.raises(ValueError, match="pass scale=None"):
        paged_attention_mla(**args, scale=1.0, backend="xla")
    with pytest.raises(ValueError, match="float8_e4m3fn, float32, bfloat16"):
        paged_attention_mla(**{**args, "latent_pages_PSC": pages._replace(rope_PSR=pages.rope_PSR.astype(jnp.float32))},
                            backend="xla")
    with pytest.raises(ValueError, match="tile scales per token"):
        paged_attention_mla(**{**args, "latent_pages_PSC": pages._replace(scales_PSJ=pages.scales_PSJ[..., :0])},
                            backend="xla")
    with pytest.raises(ValueError, match="kv_lora_rank"):
        paged_attention_mla(**{**args, "kv_lora_rank": 48}, backend="xla")


@pytest.mark.triton_ir
def test_tiled_kernels_lower_to_triton_at_gpu_shapes():
    """Kimi K2 per GPU (8 heads, 512 + 64) over FlashMLA's layout, dense and DSA-sparse: the
    in-register tile dequantization must lower to Triton IR for CUDA (CPU-checkable)."""
    spec = jax.ShapeDtypeStruct
    pages = TiledLatentPages(spec((512, 64, 512), jnp.float8_e4m3fn), spec((512, 64, 4), jnp.float32),
                             spec((512, 64, 64), jnp.bfloat16))
    for tuning in (AttentionTuning(), AttentionTuning(prefetch=True), AttentionTuning(block_tokens=32)):
        mla = functools.partial(paged_attention_mla, kv_lora_rank=512, softmax_scale=0.1, backend="pallas", tuning=tuning)
        [kernel] = triton_kernels_for_cuda(mla, spec((4, 8, 576), jnp.bfloat16), pages, spec((4, 32), jnp.int32),
                                           spec((4,), jnp.int32))
        assert kernel.name == "paged_attention_mla" and kernel.ttir.count("tt.dot") >= 3
        assert kernel.ttir.count("f8E4M3FN") > 0 and kernel.grid[0] == 4
    sparse = functools.partial(sparse_paged_attention_mla, kv_lora_rank=512, softmax_scale=0.1, backend="pallas")
    [kernel] = triton_kernels_for_cuda(sparse, spec((4, 8, 576), jnp.bfloat16), pages, spec((4, 64), jnp.int32),
                                       spec((4, 2048), jnp.int32), spec((4,), jnp.int32))
    assert kernel.name == "paged_attention_mla" and kernel.grid[0] == 4
