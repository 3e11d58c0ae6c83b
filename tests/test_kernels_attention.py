"""Paged decode attention (GQA and absorbed MLA): interpret-mode kernels vs jnp
references vs a float64 numpy computation of the same function.

Every test draws fresh inputs from a seed taken from os.urandom; the seed is in
every assertion message, so `_rng(seed)` reproduces a failure.

Poisoning. The Pallas interpreter fills kernel outputs with NaN before the
kernel runs (checked by test_interpreter_poisons_outputs), so a split partial
the kernel forgets to write turns the combined output into NaN and fails.
Cache slots past a request's length, and pages no request owns, are filled
with NaN too, so any read of a masked token that leaks into the result fails.

Tolerances (u_x = unit roundoff of format x: f32 2^-24, bf16 2^-8, e4m3 2^-4):
* reference vs float64, f32 q: every step is an f32 op on O(1) values with
  sums over <= a few hundred terms, so |err| <= 1e-5 * max|v| (about 100 u_f32
  of accumulated rounding).
* kernel vs reference on the SAME cache values:
  - f32 q: both accumulate in f32, only the order differs: 1e-5 * max|v|.
  - bf16 q: the kernel feeds the probabilities p to the PV tensor-core dot in
    bf16 (as FlashAttention does); K/V in bf16 are exact copies of the bf16 or
    fp8 cache values. |sum_i (bf16(p_i) - p_i) v_i| <= u_bf16 sum_i p_i |v_i|
    <= u_bf16 max|v|. Both outputs are then rounded to bf16 (<= u_bf16 |out|
    each, |out| <= max|v|), so |kernel - ref| <= 3 u_bf16 max|v| (plus the
    1e-5 max|v| f32 slack for second-order terms).
  - bf16 q with AttentionTuning(fp8_dots="float16") over fp8 pages: the dots
    run in f16 (fp8 values are exact there; q is scaled by a power of two per
    row, exact but for entries 2^-28 below the row's largest). p rounds to f16:
    relative 2^-11 down to 2^-14, absolute <= 2^-25 below, so
    |sum_i (f16(p_i) - p_i) v_i| <= (2^-11 + T 2^-25) max|v| (sum p >= 1: the
    largest p is 1) < u_bf16 max|v| for T < 2^16: the bf16 bound holds.
* FP8 vs BF16 on the same unquantized values: see test_fp8_within_e4m3_bound.
"""

import copy
import functools
import math
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import KERNEL_BACKEND, dots_below_the_mma_minimum, ttir_dots

from pallas_kernels import paged_attention_gqa, paged_attention_mla, sparse_paged_attention_mla
from pallas_kernels.backend import lower_for_cuda, resolve_backend, triton_kernels_for_cuda
from pallas_kernels.flash_decoding import AttentionTuning, merge_over_axis, row_lengths

# Unit roundoff, half the spacing at 1: bf16 keeps 8 significant bits, so 2^-8. It read 2^-9
# until 2026-11-29, which halved every bf16 bound; one seed rounded an output of -4.1106 to
# -4.125 (0.89 u) and failed the sparse MLA test.
U_BF16 = float(jnp.finfo(jnp.bfloat16).eps) / 2
U_E4M3 = 2.0**-4
E4M3_MAX = 448.0
# Half the spacing of e4m3 subnormals (2^-9): absolute rounding error floor.
E4M3_SUBNORMAL_ERR = 2.0**-10
F32_TOL = 1e-5
# 3 bf16 roundings (derived in the module docstring) plus the f32 slack for
# second-order terms and accumulation order.
BF16_TOL = 3 * U_BF16 + F32_TOL


def _seed() -> int:
    return int.from_bytes(os.urandom(4), "little")


def _rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)


class PagedCache:
    """Random paged layout: distinct pages per request, NaN in every unused slot."""

    def __init__(self, rng, lengths, num_slots: int, page_size: int, extra_pages: int = 3):
        self.lengths = np.asarray(lengths, np.int32)
        batch = len(lengths)
        used = [-(-int(n) // page_size) for n in lengths]
        self.num_pages = sum(used) + extra_pages
        order = rng.permutation(self.num_pages)
        # Slots past a request's last page point at arbitrary in-range pages.
        self.page_table = rng.integers(0, self.num_pages, (batch, num_slots)).astype(np.int32)
        valid = np.zeros((self.num_pages, page_size), bool)
        nxt = 0
        for b, n in enumerate(used):
            self.page_table[b, :n] = order[nxt:nxt + n]
            for j in range(n):
                filled = min(page_size, int(lengths[b]) - j * page_size)
                valid[order[nxt + j], :filled] = True
            nxt += n
        self.valid_PS = valid
        self.page_size = page_size

    def poison(self, pages_PSX: np.ndarray) -> np.ndarray:
        """NaN in every slot no request may read; pages [P, S, ...]."""
        out = np.array(pages_PSX, np.float32)
        out[~self.valid_PS] = np.nan
        return out

    def poison_heads(self, pages_KPSD: np.ndarray) -> np.ndarray:
        """`poison` for pages with a leading KV-head axis."""
        return self.poison(pages_KPSD.transpose(1, 2, 0, 3)).transpose(2, 0, 1, 3)

    def tokens(self, b: int, pages_PSX: np.ndarray) -> np.ndarray:
        """The request's valid tokens in order, [length, ...], float64."""
        flat = np.asarray(pages_PSX, np.float64)[self.page_table[b]]
        flat = flat.reshape(-1, *pages_PSX.shape[2:])
        return flat[: self.lengths[b]]


def _softmax_attend(q_HC, k_TC, v_TV, softmax_scale) -> np.ndarray:
    """float64 attention for one request; zeros when there are no tokens."""
    if k_TC.shape[0] == 0:
        return np.zeros((q_HC.shape[0], v_TV.shape[1]))
    logits = q_HC @ k_TC.T * softmax_scale
    p = np.exp(logits - logits.max(axis=1, keepdims=True))
    return (p / p.sum(axis=1, keepdims=True)) @ v_TV


def _gqa_float64(q_BHD, k_KPSD, v_KPSD, cache: PagedCache, k_scale_K, v_scale_K, softmax_scale):
    q = np.asarray(q_BHD, np.float64)
    b, h, d = q.shape
    kvh = k_KPSD.shape[0]
    g = h // kvh
    out = np.zeros((b, h, d))
    for bi in range(b):
        for ki in range(kvh):
            k = cache.tokens(bi, np.asarray(k_KPSD[ki], np.float64)) * k_scale_K[ki]
            v = cache.tokens(bi, np.asarray(v_KPSD[ki], np.float64)) * v_scale_K[ki]
            out[bi, ki * g:(ki + 1) * g] = _softmax_attend(q[bi, ki * g:(ki + 1) * g], k, v, softmax_scale)
    return out


def _mla_float64(q_BHC, latent_PSC, cache: PagedCache, kv_lora_rank, scale, softmax_scale):
    q = np.asarray(q_BHC, np.float64)
    out = np.zeros((*q.shape[:2], kv_lora_rank))
    for bi in range(q.shape[0]):
        lat = cache.tokens(bi, np.asarray(latent_PSC, np.float64)) * scale
        out[bi] = _softmax_attend(q[bi], lat, lat[:, :kv_lora_rank], softmax_scale)
    return out


def _as_np(x) -> np.ndarray:
    return np.asarray(jnp.asarray(x, jnp.float32), np.float64)


def _gqa_inputs(rng, *, batch, kv_heads, group, head_dim, page_size, num_slots, lengths,
                kv_dtype, q_dtype, per_head):
    cache = PagedCache(rng, lengths, num_slots, page_size)
    q = rng.standard_normal((batch, kv_heads * group, head_dim))
    pages = [cache.poison_heads(rng.standard_normal((kv_heads, cache.num_pages, page_size, head_dim)))
             for _ in range(2)]
    k_scale = rng.uniform(0.5, 2.0, kv_heads) if per_head else np.float32(rng.uniform(0.5, 2.0))
    v_scale = rng.uniform(0.5, 2.0, kv_heads) if per_head else np.float32(rng.uniform(0.5, 2.0))
    return dict(
        q_BHD=jnp.asarray(q, q_dtype),
        k_pages_KPSD=jnp.asarray(pages[0], kv_dtype),
        v_pages_KPSD=jnp.asarray(pages[1], kv_dtype),
        page_table_BN=jnp.asarray(cache.page_table),
        lengths_B=jnp.asarray(cache.lengths),
        k_scale=jnp.asarray(k_scale, jnp.float32),
        v_scale=jnp.asarray(v_scale, jnp.float32),
        softmax_scale=head_dim**-0.5,
    ), cache


def _gqa_expected(args, cache):
    kvh = args["k_pages_KPSD"].shape[0]
    per_head = lambda s: np.broadcast_to(np.asarray(s, np.float64), (kvh,))
    return _gqa_float64(_as_np(args["q_BHD"]), _as_np(args["k_pages_KPSD"]), _as_np(args["v_pages_KPSD"]),
                        cache, per_head(args["k_scale"]), per_head(args["v_scale"]), args["softmax_scale"])


def _max_abs_v(args) -> float:
    v = _as_np(args["v_pages_KPSD"]) * np.asarray(args["v_scale"], np.float64).reshape(-1, 1, 1, 1)
    return float(np.nanmax(np.abs(v)))


def _check_close(actual, expected, tol, seed, what):
    actual = _as_np(actual)
    assert np.all(np.isfinite(actual)), f"{what}: non-finite output (unwritten or leaked NaN), seed={seed}"
    err = float(np.max(np.abs(actual - expected)))
    assert err <= tol, f"{what}: max |err| {err:.3g} > bound {tol:.3g}, seed={seed}"


# (kv_heads, group, head_dim, page_size, num_slots, lengths): ragged lengths with
# 0, 1, exact page ends and mid-page ends, several split-K chunks.
GQA_SHAPES = [
    (1, 12, 64, 8, 40, (0, 1, 37, 300)),
    (2, 4, 32, 16, 20, (17, 320, 0)),
    (2, 1, 128, 32, 8, (33, 250, 5)),
    (1, 2, 16, 8, 1, (5, 8)),  # a one-page table, shorter than one kernel block
]


@pytest.mark.parametrize("shape", GQA_SHAPES)
@pytest.mark.parametrize("kv_dtype", [jnp.bfloat16, jnp.float8_e4m3fn])
def test_gqa_reference_matches_float64(shape, kv_dtype):
    seed = _seed()
    kvh, g, d, s, n, lengths = shape
    args, cache = _gqa_inputs(_rng(seed), batch=len(lengths), kv_heads=kvh, group=g, head_dim=d,
                              page_size=s, num_slots=n, lengths=lengths, kv_dtype=kv_dtype,
                              q_dtype=jnp.float32, per_head=True)
    out = paged_attention_gqa(**args, backend="xla")
    _check_close(out, _gqa_expected(args, cache), F32_TOL * _max_abs_v(args), seed, "gqa reference")


# Default tuning = the kernel's split heuristic (one split at these tiny sizes);
# explicit num_splits make split boundaries fall inside and past the requests,
# and other block sizes move the block boundaries against the lengths.
@pytest.mark.parametrize(
    "shape, kv_dtype, q_dtype, per_head, tuning",
    [
        (GQA_SHAPES[0], jnp.float8_e4m3fn, jnp.bfloat16, False, AttentionTuning(num_splits=2)),
        (GQA_SHAPES[0], jnp.float8_e4m3fn, jnp.bfloat16, True, AttentionTuning(block_tokens=16, num_splits=3)),
        (GQA_SHAPES[0], jnp.bfloat16, jnp.float32, True, AttentionTuning()),
        (GQA_SHAPES[1], jnp.float8_e4m3fn, jnp.float32, True, AttentionTuning(block_tokens=32)),
        (GQA_SHAPES[1], jnp.float8_e5m2, jnp.bfloat16, True, AttentionTuning(num_splits=3)),
        (GQA_SHAPES[1], jnp.float8_e4m3fn, jnp.bfloat16, True, AttentionTuning(fp8_dots="float16")),
        # bf16 dots over FP8 pages: the default until the H200 sweep of 2026-11-30.
        (GQA_SHAPES[1], jnp.float8_e4m3fn, jnp.bfloat16, False, AttentionTuning(fp8_dots="bfloat16", num_splits=2)),
        (GQA_SHAPES[2], jnp.float8_e5m2, jnp.bfloat16, False, AttentionTuning(fp8_dots="float16", num_splits=2)),
        (GQA_SHAPES[2], jnp.bfloat16, jnp.bfloat16, False, AttentionTuning(block_tokens=128, num_splits=3)),
        (GQA_SHAPES[2], jnp.float32, jnp.float32, False, AttentionTuning(num_splits=2)),
        # Pages of 32 cut into blocks of 16 (fd.cut_pages).
        (GQA_SHAPES[2], jnp.float8_e4m3fn, jnp.bfloat16, True, AttentionTuning(block_tokens=16, num_splits=3)),
        (GQA_SHAPES[2], jnp.float8_e4m3fn, jnp.bfloat16, False, AttentionTuning(prefetch=True, block_tokens=16,
                                                                                num_splits=2)),
        (GQA_SHAPES[3], jnp.float8_e4m3fn, jnp.float32, True, AttentionTuning(num_splits=4)),
        # Prefetch: splits of 1..n blocks, splits past a request's end and empty requests.
        (GQA_SHAPES[0], jnp.float8_e4m3fn, jnp.bfloat16, True, AttentionTuning(prefetch=True, block_tokens=16,
                                                                               num_splits=3)),
        (GQA_SHAPES[2], jnp.bfloat16, jnp.bfloat16, False, AttentionTuning(prefetch=True, num_splits=2)),
        # The values product accumulated transposed ([V, R]), alone and with prefetch and f32 dots.
        (GQA_SHAPES[1], jnp.float8_e4m3fn, jnp.bfloat16, True, AttentionTuning(swap_pv=True, num_splits=3)),
        (GQA_SHAPES[0], jnp.float8_e4m3fn, jnp.bfloat16, False, AttentionTuning(swap_pv=True, prefetch=True,
                                                                                block_tokens=16, num_splits=3)),
        (GQA_SHAPES[2], jnp.float32, jnp.float32, False, AttentionTuning(swap_pv=True, num_splits=2)),
        # The splits merged by the Pallas kernel (fd.combine_splits), with per-head and per-tensor scales.
        (GQA_SHAPES[0], jnp.float8_e4m3fn, jnp.bfloat16, True, AttentionTuning(combine="pallas", num_splits=5)),
        (GQA_SHAPES[1], jnp.float8_e4m3fn, jnp.float32, True, AttentionTuning(combine="pallas", num_splits=3)),
        (GQA_SHAPES[2], jnp.bfloat16, jnp.bfloat16, False, AttentionTuning(combine="pallas", swap_pv=True)),
    ],
)
def test_gqa_kernel_matches_reference(shape, kv_dtype, q_dtype, per_head, tuning):
    seed = _seed()
    kvh, g, d, s, n, lengths = shape
    args, cache = _gqa_inputs(_rng(seed), batch=len(lengths), kv_heads=kvh, group=g, head_dim=d,
                              page_size=s, num_slots=n, lengths=lengths, kv_dtype=kv_dtype,
                              q_dtype=q_dtype, per_head=per_head)
    got = paged_attention_gqa(**args, backend=KERNEL_BACKEND, tuning=tuning)
    assert got.shape == args["q_BHD"].shape and got.dtype == q_dtype
    ref = _as_np(paged_attention_gqa(**args, backend="xla"))
    tol = (F32_TOL if q_dtype == jnp.float32 else BF16_TOL) * _max_abs_v(args)
    _check_close(got, ref, tol, seed, "gqa kernel vs reference")
    empty = np.asarray(cache.lengths) == 0
    assert np.all(_as_np(got)[empty] == 0), f"empty requests must give zeros, seed={seed}"


def _e4m3_quantize(values: np.ndarray, axis_amax) -> tuple[np.ndarray, np.ndarray]:
    """Per-head scale = amax / 448 (no saturation); returns (fp8 values, scale)."""
    scale = axis_amax / E4M3_MAX
    return values / scale.reshape(-1, *([1] * (values.ndim - 1))), scale


def _fp8_output_bound(q_HC, k_TC, v_TV, k_scale, v_scale, softmax_scale) -> np.ndarray:
    """Worst-case |attn(fp8 K/V) - attn(K/V)| per output element, float64.

    Rounding to e4m3 (3 mantissa bits) gives k~ = k + dk with
    |dk| <= u|k| + a, u = 2^-4 and a = 2^-10 * scale (subnormal floor); same for v.
    Logits: |ds_i| = softmax_scale |q . dk_i| <= softmax_scale sum_c |q_c| (u|k_ic| + a) =: e_i <= e.
    Softmax: p~_i / p_i = exp(ds_i) / sum_j p_j exp(ds_j) lies in [exp(-2e), exp(2e)],
    so |p~_i - p_i| <= (exp(2e) - 1) p_i.
    Output: o~ - o = sum_i p~_i dv_i + sum_i (p~_i - p_i) v_i, hence
    |o~ - o| <= max_i |dv_i| + (exp(2e) - 1) sum_i p_i |v_i|   (elementwise in V)
             <= max_i (u|v_i| + a_v) + (exp(2e) - 1) max_i |v_i|.
    """
    if k_TC.shape[0] == 0:
        return np.zeros((q_HC.shape[0], v_TV.shape[1]))
    eps_H = softmax_scale * np.max(np.abs(q_HC) @ (U_E4M3 * np.abs(k_TC) + E4M3_SUBNORMAL_ERR * k_scale).T, axis=1)
    vmax_V = np.max(np.abs(v_TV), axis=0)
    return (U_E4M3 * vmax_V + E4M3_SUBNORMAL_ERR * v_scale)[None, :] + np.expm1(2 * eps_H)[:, None] * vmax_V[None, :]


def test_fp8_within_e4m3_bound():
    """FP8 e4m3 (per-head scales) vs BF16 attention on the same unquantized values.

    Both run the interpret-mode kernel with f32 queries (so kernel rounding is
    ~1e-6, see the module docstring) and the difference must stay within
    _fp8_output_bound (derived there) plus that f32 slack. Queries have std 1/8
    so the worst-case logit term exp(2e) - 1 stays small enough (e ~ 0.03) for
    the bound to say something; with unit-variance q and k, e ~ 0.2 and the
    worst case (all rounding errors aligned) exceeds max|v|, although the
    actual error, a random walk, stays far smaller.
    """
    seed = _seed()
    rng = _rng(seed)
    kvh, g, d, s, n, lengths = 2, 8, 64, 16, 5, (0, 1, 40, 80)
    cache = PagedCache(rng, lengths, n, s)
    shape = (kvh, cache.num_pages, s, d)
    # The unquantized cache: bf16 values (what a BF16 KV cache would store).
    k_true = _as_np(jnp.asarray(rng.standard_normal(shape), jnp.bfloat16))
    v_true = _as_np(jnp.asarray(rng.standard_normal(shape), jnp.bfloat16))
    k_fp8, k_scale = _e4m3_quantize(k_true, np.abs(k_true).max(axis=(1, 2, 3)))
    v_fp8, v_scale = _e4m3_quantize(v_true, np.abs(v_true).max(axis=(1, 2, 3)))
    q = rng.standard_normal((len(lengths), kvh * g, d)) / 8
    common = dict(q_BHD=jnp.asarray(q, jnp.float32), page_table_BN=jnp.asarray(cache.page_table),
                  lengths_B=jnp.asarray(cache.lengths), softmax_scale=d**-0.5, backend=KERNEL_BACKEND)
    out_bf16 = _as_np(paged_attention_gqa(
        k_pages_KPSD=jnp.asarray(cache.poison_heads(k_true), jnp.bfloat16),
        v_pages_KPSD=jnp.asarray(cache.poison_heads(v_true), jnp.bfloat16),
        k_scale=1.0, v_scale=1.0, **common))
    out_fp8 = _as_np(paged_attention_gqa(
        k_pages_KPSD=jnp.asarray(cache.poison_heads(k_fp8), jnp.float8_e4m3fn),
        v_pages_KPSD=jnp.asarray(cache.poison_heads(v_fp8), jnp.float8_e4m3fn),
        k_scale=jnp.asarray(k_scale, jnp.float32), v_scale=jnp.asarray(v_scale, jnp.float32), **common))
    assert np.all(np.isfinite(out_fp8)) and np.all(np.isfinite(out_bf16)), f"seed={seed}"
    slack = F32_TOL * np.abs(v_true).max()
    for b in range(len(lengths)):
        for ki in range(kvh):
            rows = slice(ki * g, (ki + 1) * g)
            bound = _fp8_output_bound(q[b, rows], cache.tokens(b, k_true[ki]), cache.tokens(b, v_true[ki]),
                                      k_scale[ki], v_scale[ki], d**-0.5) + slack
            err = np.abs(out_fp8[b, rows] - out_bf16[b, rows])
            assert np.all(err <= bound), (
                f"request {b} head {ki}: fp8 error {err.max():.3g} exceeds e4m3 bound "
                f"(min margin {np.min(bound - err):.3g}), seed={seed}")
            if lengths[b] > 1:
                assert bound.max() < 0.5 * np.abs(v_true).max(), f"bound is vacuous, seed={seed}"


# (heads, latent width C, kv_lora_rank L, page_size, num_slots, lengths)
MLA_SHAPES = [
    (8, 576, 512, 16, 12, (0, 1, 150)),
    (5, 48, 32, 8, 7, (56, 3)),
    (16, 96, 64, 32, 10, (70, 300, 0, 64)),
]


def _mla_inputs(rng, *, heads, width, rank, page_size, num_slots, lengths, kv_dtype, q_dtype):
    cache = PagedCache(rng, lengths, num_slots, page_size)
    latent = cache.poison(rng.standard_normal((cache.num_pages, page_size, width)))
    return dict(
        q_BHC=jnp.asarray(rng.standard_normal((len(lengths), heads, width)), q_dtype),
        latent_pages_PSC=jnp.asarray(latent, kv_dtype),
        page_table_BN=jnp.asarray(cache.page_table),
        lengths_B=jnp.asarray(cache.lengths),
        kv_lora_rank=rank,
        scale=jnp.float32(rng.uniform(0.5, 2.0)),
        softmax_scale=width**-0.5,
    ), cache


def _mla_max_abs_v(args) -> float:
    latent = _as_np(args["latent_pages_PSC"])[..., : args["kv_lora_rank"]]
    return float(np.nanmax(np.abs(latent))) * float(args["scale"])


@pytest.mark.parametrize("shape", MLA_SHAPES)
def test_mla_reference_matches_float64(shape):
    seed = _seed()
    h, c, rank, s, n, lengths = shape
    args, cache = _mla_inputs(_rng(seed), heads=h, width=c, rank=rank, page_size=s, num_slots=n,
                              lengths=lengths, kv_dtype=jnp.float8_e4m3fn, q_dtype=jnp.float32)
    expected = _mla_float64(_as_np(args["q_BHC"]), _as_np(args["latent_pages_PSC"]), cache, rank,
                            float(args["scale"]), args["softmax_scale"])
    _check_close(paged_attention_mla(**args, backend="xla"), expected, F32_TOL * _mla_max_abs_v(args),
                 seed, "mla reference")


@pytest.mark.parametrize(
    "shape, kv_dtype, q_dtype, tuning",
    [
        (MLA_SHAPES[0], jnp.float8_e4m3fn, jnp.bfloat16, AttentionTuning(num_splits=2)),
        (MLA_SHAPES[0], jnp.bfloat16, jnp.bfloat16, AttentionTuning(block_tokens=32, num_splits=2)),
        (MLA_SHAPES[1], jnp.bfloat16, jnp.float32, AttentionTuning()),
        (MLA_SHAPES[1], jnp.float8_e5m2, jnp.bfloat16, AttentionTuning(num_splits=1)),
        (MLA_SHAPES[0], jnp.float8_e4m3fn, jnp.bfloat16, AttentionTuning(fp8_dots="float16", num_splits=2)),
        (MLA_SHAPES[2], jnp.float8_e5m2, jnp.bfloat16, AttentionTuning(fp8_dots="float16")),
        (MLA_SHAPES[0], jnp.float8_e4m3fn, jnp.bfloat16, AttentionTuning(fp8_dots="bfloat16", num_splits=2)),
        (MLA_SHAPES[2], jnp.float8_e4m3fn, jnp.float32, AttentionTuning(block_tokens=128, num_splits=3)),
        (MLA_SHAPES[0], jnp.float8_e4m3fn, jnp.bfloat16, AttentionTuning(prefetch=True, block_tokens=16, num_splits=2)),
        (MLA_SHAPES[2], jnp.float8_e5m2, jnp.bfloat16, AttentionTuning(prefetch=True, fp8_dots="float16")),
        # Pages of 32 cut into blocks of 16 (fd.cut_pages).
        (MLA_SHAPES[2], jnp.float8_e4m3fn, jnp.bfloat16, AttentionTuning(block_tokens=16, num_splits=3)),
        (MLA_SHAPES[2], jnp.bfloat16, jnp.bfloat16, AttentionTuning(prefetch=True, block_tokens=16)),
        # 40 heads: three programs of 16 rows per request (AttentionTuning.head_rows).
        ((40,) + MLA_SHAPES[1][1:], jnp.float8_e4m3fn, jnp.bfloat16, AttentionTuning(num_splits=2)),
        # The values product accumulated transposed ([L, R]), alone and with prefetch, bf16 dots and head blocks.
        (MLA_SHAPES[0], jnp.float8_e4m3fn, jnp.bfloat16, AttentionTuning(swap_pv=True, num_splits=2)),
        (MLA_SHAPES[2], jnp.float8_e5m2, jnp.bfloat16, AttentionTuning(swap_pv=True, prefetch=True, block_tokens=16)),
        (MLA_SHAPES[1], jnp.bfloat16, jnp.float32, AttentionTuning(swap_pv=True, fp8_dots="bfloat16")),
        ((40,) + MLA_SHAPES[2][1:], jnp.float8_e4m3fn, jnp.bfloat16, AttentionTuning(swap_pv=True, num_splits=3)),
        # The splits merged by the Pallas kernel (fd.combine_splits), also per block of 16 heads.
        (MLA_SHAPES[0], jnp.float8_e4m3fn, jnp.bfloat16, AttentionTuning(combine="pallas", num_splits=3)),
        ((40,) + MLA_SHAPES[2][1:], jnp.bfloat16, jnp.float32, AttentionTuning(combine="pallas", num_splits=2)),
    ],
)
def test_mla_kernel_matches_reference(shape, kv_dtype, q_dtype, tuning):
    seed = _seed()
    h, c, rank, s, n, lengths = shape
    args, cache = _mla_inputs(_rng(seed), heads=h, width=c, rank=rank, page_size=s, num_slots=n,
                              lengths=lengths, kv_dtype=kv_dtype, q_dtype=q_dtype)
    got = paged_attention_mla(**args, backend=KERNEL_BACKEND, tuning=tuning)
    assert got.shape == (len(lengths), h, rank) and got.dtype == q_dtype
    ref = _as_np(paged_attention_mla(**args, backend="xla"))
    tol = (F32_TOL if q_dtype == jnp.float32 else BF16_TOL) * _mla_max_abs_v(args)
    _check_close(got, ref, tol, seed, "mla kernel vs reference")
    assert np.all(_as_np(got)[np.asarray(cache.lengths) == 0] == 0), f"seed={seed}"


@pytest.mark.parametrize("backend, kv_dtype, tuning", [
    ("xla", jnp.float32, AttentionTuning()),
    (KERNEL_BACKEND, jnp.float8_e4m3fn, AttentionTuning(num_splits=2)),
    (KERNEL_BACKEND, jnp.bfloat16, AttentionTuning(block_tokens=16, prefetch=True)),
    (KERNEL_BACKEND, jnp.float8_e4m3fn, AttentionTuning(swap_pv=True)),
    (KERNEL_BACKEND, jnp.float8_e4m3fn, AttentionTuning(combine="pallas", num_splits=3)),
])
def test_mla_slot_shares_merge_into_the_whole(backend, kv_dtype, tuning):
    """Decode context parallelism's arithmetic: each of 4 devices holds slots [8d, 8d + 8) of every
    32-slot page, attends over its share (a pool of 8-slot pages, the same page table, as many
    tokens as its slots hold below the length: a prefix of its share) and returns its output with
    the log-sum-exp; merge_over_axis (under vmap, standing in for the device axis) gives the
    attention over all tokens. The whole-pool log-sum-exp is checked against float64 too. f32
    queries: every step is an f32 op, so the F32_TOL bound of the dense test holds."""
    seed = _seed()
    _, c, rank, s, n, lengths = MLA_SHAPES[2]
    h = 40  # all heads on every device, as decode context parallelism runs them: 3 programs of 16 heads
    args, cache = _mla_inputs(_rng(seed), heads=h, width=c, rank=rank, page_size=s, num_slots=n,
                              lengths=lengths, kv_dtype=kv_dtype, q_dtype=jnp.float32)
    devices, share = 4, s // 4
    q, latent = _as_np(args["q_BHC"]).astype(np.float64), _as_np(args["latent_pages_PSC"]).astype(np.float64)
    expected = _mla_float64(q, latent, cache, rank, float(args["scale"]), args["softmax_scale"])
    lse_expected, logit_max = np.full((len(lengths), h), -np.inf), 0.0
    for b, length in enumerate(cache.lengths):
        if length:
            logits = q[b] @ (cache.tokens(b, latent) * float(args["scale"])).T * args["softmax_scale"]
            top = logits.max(axis=1)
            lse_expected[b] = top + np.log(np.exp(logits - top[:, None]).sum(axis=1))
            logit_max = max(logit_max, float(np.abs(logits).max()))
    common = dict(args, backend=backend, tuning=tuning, return_lse=True)
    out, lse = paged_attention_mla(**common)
    assert out.dtype == lse.dtype == jnp.float32
    tol = F32_TOL * _mla_max_abs_v(args)
    _check_close(out, expected, tol, seed, "mla output with lse")
    # f32 logits err by <= F32_TOL of their magnitude; the log of an f32 sum (relative err <= F32_TOL)
    # by <= F32_TOL absolute. -inf (empty) must match exactly.
    np.testing.assert_allclose(_as_np(lse), lse_expected, rtol=0, atol=F32_TOL * (logit_max + 1), err_msg=f"seed={seed}")

    def one_share(d):  # as device d computes it
        local_lengths = np.array([np.sum((np.arange(length) % s) // share == d) for length in cache.lengths], np.int32)
        return paged_attention_mla(**dict(common, latent_pages_PSC=args["latent_pages_PSC"][:, d * share:(d + 1) * share],
                                          lengths_B=jnp.asarray(local_lengths)))

    outs, lses = zip(*(one_share(d) for d in range(devices)))
    merged = jax.vmap(functools.partial(merge_over_axis, axis_name="devices"), axis_name="devices")(
        jnp.stack(outs), jnp.stack(lses))
    for d in range(devices):
        _check_close(merged[d], expected, tol, seed, f"merged slot shares (device {d})")


# Several query tokens per request (speculative verification), q [B, Q, H, D] with lengths [B, Q]:
# (GQA: kv_heads, group, head_dim | MLA: heads, width, rank), page_size, num_slots, lengths [B][Q].
# Query j usually sees one token more than query j - 1 (each its own token and the ones before);
# a request whose last queries see nothing (an engine row with fewer drafts than slots), an
# empty request, queries across page ends; rows Q * G or Q * H of 8 to 36 (MLA: 24 and 32 are
# two blocks of the default 16 head rows).
GQA_TOKEN_SHAPES = [
    (1, 12, 64, 8, 40, ((1, 2, 3), (298, 299, 300), (0, 0, 0), (36, 37, 0))),
    (2, 4, 32, 16, 20, ((16, 17), (0, 1), (320, 0))),
    (2, 1, 128, 32, 8, ((30, 31, 32, 33), (247, 248, 249, 250))),
    (2, 6, 32, 16, 12, ((40, 41, 42), (0, 1, 2), (100, 101, 0))),  # 18 rows per KV head
]
MLA_TOKEN_SHAPES = [
    (8, 576, 512, 16, 12, ((148, 149, 150), (0, 1, 2), (0, 0, 0))),
    (5, 48, 32, 8, 7, ((55, 56), (2, 3))),
    (16, 96, 64, 32, 10, ((69, 70), (299, 300), (0, 0), (63, 64))),
]


def _query_token_inputs(rng, kind, shape, kv_dtype, q_dtype):
    """The op's arguments with q [B, Q, ...] and lengths [B, Q]; the cache is poisoned past each
    request's longest query."""
    *dims, s, n, lengths = shape
    lengths_BQ = np.asarray(lengths, np.int32)
    b, nq = lengths_BQ.shape
    if kind == "gqa":
        kvh, g, d = dims
        args, cache = _gqa_inputs(rng, batch=b, kv_heads=kvh, group=g, head_dim=d, page_size=s, num_slots=n,
                                  lengths=lengths_BQ.max(1), kv_dtype=kv_dtype, q_dtype=q_dtype, per_head=True)
        q_name, q_shape = "q_BHD", (b, nq, kvh * g, d)
    else:
        h, c, rank = dims
        args, cache = _mla_inputs(rng, heads=h, width=c, rank=rank, page_size=s, num_slots=n,
                                  lengths=lengths_BQ.max(1), kv_dtype=kv_dtype, q_dtype=q_dtype)
        q_name, q_shape = "q_BHC", (b, nq, h, c)
    args = {**args, q_name: jnp.asarray(rng.standard_normal(q_shape), q_dtype), "lengths_B": jnp.asarray(lengths_BQ)}
    return args, cache, lengths_BQ


def _one_query(kind, args, j):
    """The arguments of query token j alone: q [B, ...], lengths [B]."""
    q_name = "q_BHD" if kind == "gqa" else "q_BHC"
    return {**args, q_name: args[q_name][:, j], "lengths_B": args["lengths_B"][:, j]}


def test_padding_rows_take_the_last_query_tokens_length():
    """fd.row_lengths: each query token's length for its heads, then the padding rows at the last
    token's, so that they move neither the shortest row nor a block's longest."""
    got = row_lengths(jnp.asarray([[5, 6, 0], [7, 8, 9]], jnp.int32), heads=2, rows=8)
    assert got.tolist() == [[5, 5, 6, 6, 0, 0, 0, 0], [7, 7, 8, 8, 9, 9, 9, 9]]
    assert row_lengths(jnp.asarray([[4], [0]], jnp.int32), heads=2, rows=16).tolist() == [4, 0]  # one token: [B]


def test_sparse_mla_refuses_several_query_tokens():
    """Each query token of DSA chooses its own tokens: the sparse op takes one per request."""
    args, _ = _mla_inputs(_rng(0), heads=4, width=48, rank=32, page_size=8, num_slots=2, lengths=(9, 3),
                          kv_dtype=jnp.bfloat16, q_dtype=jnp.float32)
    ids = jnp.zeros((2, 4), jnp.int32)
    common = dict(kv_lora_rank=32, softmax_scale=0.1, backend="xla")
    for q, counts in ((jnp.stack([args["q_BHC"]] * 2, axis=1), jnp.ones((2,), jnp.int32)),
                      (args["q_BHC"], jnp.ones((2, 2), jnp.int32))):
        with pytest.raises(ValueError, match="one query token per request"):
            sparse_paged_attention_mla(q, args["latent_pages_PSC"], args["page_table_BN"], ids, counts, **common)


TOKEN_CASES = [("gqa", shape) for shape in GQA_TOKEN_SHAPES] + [("mla", shape) for shape in MLA_TOKEN_SHAPES]


@pytest.mark.parametrize("kind, shape", TOKEN_CASES)
def test_query_tokens_reference_matches_float64(kind, shape):
    seed = _seed()
    args, cache, lengths_BQ = _query_token_inputs(_rng(seed), kind, shape, jnp.float8_e4m3fn, jnp.float32)
    op = paged_attention_gqa if kind == "gqa" else paged_attention_mla
    got = _as_np(op(**args, backend="xla"))
    for j in range(lengths_BQ.shape[1]):
        view = copy.copy(cache)
        view.lengths = lengths_BQ[:, j]
        one = _one_query(kind, args, j)
        if kind == "gqa":
            expected, v_max = _gqa_expected(one, view), _max_abs_v(args)
        else:
            expected = _mla_float64(_as_np(one["q_BHC"]), _as_np(args["latent_pages_PSC"]), view,
                                    args["kv_lora_rank"], float(args["scale"]), args["softmax_scale"])
            v_max = _mla_max_abs_v(args)
        _check_close(got[:, j], expected, F32_TOL * v_max, seed, f"{kind} reference, query token {j}")


@pytest.mark.parametrize("kind, shape, kv_dtype, q_dtype, tuning", [
    ("gqa", GQA_TOKEN_SHAPES[0], jnp.float8_e4m3fn, jnp.bfloat16, AttentionTuning(num_splits=3)),
    ("gqa", GQA_TOKEN_SHAPES[0], jnp.float8_e4m3fn, jnp.bfloat16, AttentionTuning(prefetch=True, block_tokens=16,
                                                                                  num_splits=2)),
    ("gqa", GQA_TOKEN_SHAPES[1], jnp.bfloat16, jnp.float32, AttentionTuning(swap_pv=True, num_splits=2)),
    ("gqa", GQA_TOKEN_SHAPES[1], jnp.float8_e4m3fn, jnp.bfloat16, AttentionTuning(combine="pallas", num_splits=3)),
    ("gqa", GQA_TOKEN_SHAPES[2], jnp.float8_e4m3fn, jnp.float32, AttentionTuning(branch_masks=False, block_tokens=16)),
    ("gqa", GQA_TOKEN_SHAPES[2], jnp.float8_e5m2, jnp.bfloat16, AttentionTuning(fp8_dots="bfloat16")),
    # Rows in programs of at most 16 (18 rows of 2 KV heads: 2 blocks each) or 32 (36 rows: 2
    # blocks, the second 4 real rows and 28 of padding).
    ("gqa", GQA_TOKEN_SHAPES[3], jnp.float8_e4m3fn, jnp.bfloat16, AttentionTuning(gqa_rows=16, num_splits=2)),
    ("gqa", GQA_TOKEN_SHAPES[0], jnp.bfloat16, jnp.float32, AttentionTuning(gqa_rows=32, combine="pallas")),
    ("mla", MLA_TOKEN_SHAPES[0], jnp.float8_e4m3fn, jnp.bfloat16, AttentionTuning(num_splits=2)),
    ("mla", MLA_TOKEN_SHAPES[0], jnp.float8_e4m3fn, jnp.float32, AttentionTuning(head_rows=32, combine="pallas")),
    ("mla", MLA_TOKEN_SHAPES[1], jnp.bfloat16, jnp.bfloat16, AttentionTuning(prefetch=True, swap_pv=True)),
    ("mla", MLA_TOKEN_SHAPES[2], jnp.float8_e5m2, jnp.bfloat16, AttentionTuning(block_tokens=16, num_splits=3)),
    ("mla", MLA_TOKEN_SHAPES[2], jnp.float8_e4m3fn, jnp.float32, AttentionTuning(combine="pallas", num_splits=2,
                                                                                 branch_masks=False)),
])
def test_query_tokens_kernel_matches_reference_and_each_token_alone(kind, shape, kv_dtype, q_dtype, tuning):
    """The folded kernel against the reference, and each query token's rows against the same
    kernel run for that token alone (Q = 1: another split plan, so within the same tolerance);
    a query token that sees nothing gets zeros."""
    seed = _seed()
    args, cache, lengths_BQ = _query_token_inputs(_rng(seed), kind, shape, kv_dtype, q_dtype)
    op = paged_attention_gqa if kind == "gqa" else paged_attention_mla
    v_max = _max_abs_v(args) if kind == "gqa" else _mla_max_abs_v(args)
    tol = (F32_TOL if q_dtype == jnp.float32 else BF16_TOL) * v_max
    got = op(**args, backend=KERNEL_BACKEND, tuning=tuning)
    q = args["q_BHD" if kind == "gqa" else "q_BHC"]
    assert got.shape == (*q.shape[:-1], got.shape[-1]) and got.dtype == q_dtype
    _check_close(got, _as_np(op(**args, backend="xla")), tol, seed, f"{kind} kernel vs reference")
    got = _as_np(got)
    for j in range(lengths_BQ.shape[1]):
        alone = op(**_one_query(kind, args, j), backend=KERNEL_BACKEND, tuning=tuning)
        _check_close(got[:, j], _as_np(alone), tol, seed, f"{kind} query token {j} vs alone")
        assert np.all(got[lengths_BQ[:, j] == 0, j] == 0), f"query tokens that see nothing give zeros, seed={seed}"


@pytest.mark.parametrize("lead, splits, value_dim, rows, scales, out_dtype, with_lse", [
    ((2, 3), 5, 32, 12, 3, jnp.bfloat16, False),  # GQA-like: per-KV-head scales, 12 of 16 rows
    ((1,), 37, 64, 8, 1, jnp.float32, True),  # odd split count, one chunk
    ((3,), 1, 16, 16, 1, jnp.float32, True),  # one split: out = acc / sum
    ((1,), 300, 16, 5, 1, jnp.bfloat16, True),  # 300 splits in two chunks of 256 (masked past 300)
    ((2,), 6, 512, 8, 1, jnp.bfloat16, False),  # Kimi's value width: 512 in column blocks
])
def test_combine_kernel_merges_the_splits_as_float64(lead, splits, value_dim, rows, scales, out_dtype, with_lse):
    """fd.combine_splits (the Pallas merge) and fd.combine_partials (XLA's) against the merge in
    float64, on partials as the kernels write them: each split's max, its sum >= 1 (the max
    token contributes exp(0)), |acc| <= sum * max|v|; about a third of the splits empty (max
    finfo.min, sum and acc 0), and row 0 empty in every split.

    Bound: the merge is out = scale * sum_x w_x a_x / sum_x w_x s_x with w_x = exp(m_x - max).
    In f32 each w_x errs by <= 2 u (exp within 1 ulp, the difference exact or rounded once),
    each product by u, each sum of X terms by (X - 1) u relative to its sum of magnitudes, and
    the division and scaling by 2 u: |err| <= 2 (X + 4) u scale sum_x w_x |a_x| / sum_x w_x s_x
    (u = 2^-24), plus one rounding to the output dtype. The log-sum-exp, max + log(sum),
    errs by <= (X + 4) u + u |lse|; an empty row must give exactly 0 and -inf."""
    from pallas_kernels import flash_decoding as fd

    seed = _seed()
    rng = _rng(seed)
    shape = (*lead, splits, 16)
    empty = rng.random(shape) < 0.3
    empty[..., 0] = True
    max_XR = np.where(empty, np.finfo(np.float32).min, rng.standard_normal(shape) * 4).astype(np.float32)
    sum_XR = np.where(empty, 0.0, rng.uniform(1.0, 64.0, shape)).astype(np.float32)
    acc_XRV = (rng.uniform(-1, 1, (*shape, value_dim)) * sum_XR[..., None] * 3).astype(np.float32)
    scale_S = rng.uniform(0.5, 2.0, (scales,)).astype(np.float32)
    partials = tuple(jnp.asarray(x) for x in (acc_XRV, max_XR, sum_XR))
    out, lse = fd.combine_splits(*partials, rows=rows, scale_S=jnp.asarray(scale_S), out_dtype=out_dtype,
                                 with_lse=with_lse, interpret=resolve_backend(KERNEL_BACKEND) == "interpret")
    assert out.shape == (*lead, rows, value_dim) and out.dtype == out_dtype
    assert (lse is not None) == with_lse

    m, s, a = (x.astype(np.float64) for x in (max_XR[..., :rows], sum_XR[..., :rows], acc_XRV[..., :rows, :]))
    top = m.max(axis=-2)  # [..., R]: finfo.min for an empty row
    w = np.where(empty[..., :rows], 0.0, np.exp(m - top[..., None, :]))
    safe = np.where((w * s).sum(axis=-2) > 0, (w * s).sum(axis=-2), 1.0)[..., None]
    scale = scale_S[np.arange(math.prod(lead)) % scales].reshape(*lead, 1, 1).astype(np.float64)
    expected = scale * (w[..., None] * a).sum(axis=-3) / safe
    u = 2.0**-24
    bound = 2 * (splits + 4) * u * scale * (w[..., None] * np.abs(a)).sum(axis=-3) / safe
    rounding = U_BF16 if out_dtype == jnp.bfloat16 else u
    got = _as_np(out)
    assert np.all(np.isfinite(got)), f"unwritten or non-finite output, seed={seed}"
    err = np.abs(got - expected)
    assert np.all(err <= bound + rounding * np.abs(expected)), f"combine_splits: {err.max():.3g}, seed={seed}"
    assert np.all(got[..., 0, :] == 0), f"an empty row must give zeros, seed={seed}"
    ref_out, ref_lse = fd.combine_partials(*partials)
    ref_out = _as_np(ref_out)[..., :rows, :] * scale
    assert np.all(np.abs(ref_out - expected) <= bound + u * np.abs(expected)), f"combine_partials, seed={seed}"
    if with_lse:
        lse_expected = np.where(empty[..., :rows].all(axis=-2), -np.inf, top + np.log(safe[..., 0]))
        for got in (_as_np(lse), _as_np(ref_lse)[..., :rows]):
            assert np.array_equal(np.isneginf(got), np.isneginf(lse_expected)), f"seed={seed}"
            finite = np.isfinite(lse_expected)
            lse_bound = (splits + 4) * u + u * np.abs(lse_expected[finite])
            assert np.all(np.abs(got[finite] - lse_expected[finite]) <= lse_bound), f"lse, seed={seed}"


def test_kernels_clamp_lengths_to_the_table():
    """Lengths past the table (N * S tokens) count as the whole table, below 0
    as empty, as in the references. The last split runs past slot N - 1 here
    (N = 7, 3 splits), and must read no page id beyond the table."""
    seed = _seed()
    rng = _rng(seed)
    n, s = 7, 8
    tuning = AttentionTuning(num_splits=3, block_tokens=16)
    args, _ = _gqa_inputs(rng, batch=3, kv_heads=1, group=4, head_dim=16, page_size=s, num_slots=n,
                              lengths=(n * s, 20, 0), kv_dtype=jnp.float8_e4m3fn, q_dtype=jnp.float32,
                              per_head=False)
    overlong = dict(args, lengths_B=jnp.asarray([n * s + 100, 20, -5], jnp.int32))
    tol = F32_TOL * _max_abs_v(args)
    ref = _as_np(paged_attention_gqa(**args, backend="xla"))
    _check_close(paged_attention_gqa(**overlong, backend=KERNEL_BACKEND, tuning=tuning), ref, tol, seed, "gqa")
    args, _ = _mla_inputs(rng, heads=4, width=48, rank=32, page_size=s, num_slots=n, lengths=(n * s, 20, 0),
                              kv_dtype=jnp.float8_e4m3fn, q_dtype=jnp.float32)
    overlong = dict(args, lengths_B=jnp.asarray([n * s + 100, 20, -5], jnp.int32))
    ref = _as_np(paged_attention_mla(**args, backend="xla"))
    _check_close(paged_attention_mla(**overlong, backend=KERNEL_BACKEND, tuning=tuning), ref,
                 F32_TOL * _mla_max_abs_v(args), seed, "mla")


@pytest.mark.parametrize("tuning", [AttentionTuning(block_tokens=16, num_splits=2),
                                    AttentionTuning(block_tokens=16, swap_pv=True),
                                    AttentionTuning(block_tokens=16, branch_masks=False)])
def test_blocks_ending_one_token_either_side_of_the_length(tuning):
    """Only a block holding tokens past the length is masked (attend_split's
    partial branch); a block of valid tokens skips the masks. Lengths one short
    of, at and one past a block's end (16 tokens, two 8-slot pages), with NaN
    in every slot past them: a block with a single invalid token taken as
    full leaks its NaN into the output."""
    seed = _seed()
    rng = _rng(seed)
    lengths = (15, 16, 17, 31, 47, 1)
    args, cache = _gqa_inputs(rng, batch=len(lengths), kv_heads=1, group=4, head_dim=16, page_size=8,
                              num_slots=8, lengths=lengths, kv_dtype=jnp.float8_e4m3fn, q_dtype=jnp.float32,
                              per_head=False)
    _check_close(paged_attention_gqa(**args, backend=KERNEL_BACKEND, tuning=tuning), _gqa_expected(args, cache),
                 F32_TOL * _max_abs_v(args), seed, "gqa")
    args, cache = _mla_inputs(rng, heads=4, width=48, rank=32, page_size=8, num_slots=8, lengths=lengths,
                              kv_dtype=jnp.float8_e4m3fn, q_dtype=jnp.float32)
    expected = _mla_float64(_as_np(args["q_BHC"]), _as_np(args["latent_pages_PSC"]), cache, 32,
                            float(args["scale"]), args["softmax_scale"])
    _check_close(paged_attention_mla(**args, backend=KERNEL_BACKEND, tuning=tuning), expected,
                 F32_TOL * _mla_max_abs_v(args), seed, "mla")


def test_float16_dots_scale_queries_of_any_magnitude():
    """fp8_dots="float16" holds q in f16 (max 65504): rows of q as large as 1e6
    and as small as 1e-25 and 1e-36 must give the reference's output, GQA and
    MLA. Casting q to f16 unscaled turns the 1e6 rows into inf (NaN output)."""
    seed = _seed()
    rng = _rng(seed)
    magnitudes = np.array([1e6, 3e4, 1.0, 1e-25, 1e-36])
    tuning = AttentionTuning(fp8_dots="float16")
    args, _ = _gqa_inputs(rng, batch=3, kv_heads=1, group=5, head_dim=32, page_size=8, num_slots=6,
                          lengths=(40, 7, 33), kv_dtype=jnp.float8_e4m3fn, q_dtype=jnp.float32, per_head=False)
    q = _as_np(args["q_BHD"]) * magnitudes[None, :, None]
    args = dict(args, q_BHD=jnp.asarray(q, jnp.bfloat16))
    got = paged_attention_gqa(**args, backend=KERNEL_BACKEND, tuning=tuning)
    _check_close(got, _as_np(paged_attention_gqa(**args, backend="xla")), BF16_TOL * _max_abs_v(args), seed,
                 "gqa float16 dots vs reference")
    h, c, rank, s, n, lengths = MLA_SHAPES[0]
    args, _ = _mla_inputs(rng, heads=5, width=c, rank=rank, page_size=s, num_slots=n, lengths=lengths,
                          kv_dtype=jnp.float8_e4m3fn, q_dtype=jnp.float32)
    q = _as_np(args["q_BHC"]) * magnitudes[None, :, None]
    args = dict(args, q_BHC=jnp.asarray(q, jnp.bfloat16))
    got = paged_attention_mla(**args, backend=KERNEL_BACKEND, tuning=tuning)
    _check_close(got, _as_np(paged_attention_mla(**args, backend="xla")), BF16_TOL * _mla_max_abs_v(args), seed,
                 "mla float16 dots vs reference")


def test_a_page_table_without_columns_is_refused():
    q, pages = jnp.ones((2, 4, 16), jnp.float32), jnp.ones((1, 3, 4, 16), jnp.float32)
    for backend in ("xla", KERNEL_BACKEND):
        with pytest.raises(ValueError, match="page_table_BN has no columns"):
            paged_attention_gqa(q, pages, pages, jnp.zeros((2, 0), jnp.int32), jnp.zeros(2, jnp.int32),
                                k_scale=1.0, v_scale=1.0, softmax_scale=0.25, backend=backend)


def test_attention_tuning_rejects_an_unknown_dot_dtype_and_odd_blocks():
    with pytest.raises(ValueError, match="fp8_dots"):
        AttentionTuning(fp8_dots="float8")
    for field in ("block_tokens", "head_rows", "gqa_rows"):
        for value in (8, 24):
            with pytest.raises(ValueError, match=f"{field} must be a power of two >= 16, got {value}"):
                AttentionTuning(**{field: value})


@pytest.mark.parametrize(
    "shape, top_k, kv_dtype, q_dtype, tuning",
    [
        (MLA_SHAPES[1], 16, jnp.float8_e4m3fn, jnp.bfloat16, AttentionTuning(num_splits=2)),
        # top-k above some lengths: all their tokens
        (MLA_SHAPES[2], 80, jnp.bfloat16, jnp.float32, AttentionTuning(num_splits=2, block_tokens=16, prefetch=True)),
        (MLA_SHAPES[1], 16, jnp.float8_e4m3fn, jnp.bfloat16, AttentionTuning(swap_pv=True)),
        (MLA_SHAPES[2], 40, jnp.float8_e4m3fn, jnp.bfloat16, AttentionTuning(combine="pallas", num_splits=2)),
    ],
)
def test_sparse_mla_attends_only_the_chosen_tokens(shape, top_k, kv_dtype, q_dtype, tuning):
    """DSA decode. Each request chooses min(top_k, length) random positions; every
    valid token it did NOT choose is NaN in the pool, as are all unused slots, and
    the token ids past the count are garbage (negative, beyond the table), so a
    read of anything unchosen fails. Kernel vs reference vs float64 over the
    chosen tokens, with the tolerances of the dense test."""
    seed = _seed()
    rng = _rng(seed)
    h, c, rank, s, n, lengths = shape
    args, cache = _mla_inputs(rng, heads=h, width=c, rank=rank, page_size=s, num_slots=n,
                              lengths=lengths, kv_dtype=jnp.float32, q_dtype=q_dtype)
    latent = np.array(args["latent_pages_PSC"])
    ids = rng.integers(-5 * s, 2 * n * s, (len(lengths), top_k)).astype(np.int32)
    counts = np.minimum(top_k, cache.lengths).astype(np.int32)
    expected = np.zeros((len(lengths), h, rank))
    for b, length in enumerate(cache.lengths):
        chosen = rng.permutation(int(length))[:counts[b]]
        ids[b, :counts[b]] = chosen
        unchosen = np.setdiff1d(np.arange(length), chosen)
        latent[cache.page_table[b, unchosen // s], unchosen % s] = np.nan
        tokens = np.asarray(latent, np.float64)[cache.page_table[b, chosen // s], chosen % s]
        tokens = np.asarray(jnp.asarray(tokens, kv_dtype).astype(jnp.float32), np.float64) * float(args["scale"])
        expected[b] = _softmax_attend(np.asarray(_as_np(args["q_BHC"])[b]), tokens, tokens[:, :rank],
                                      args["softmax_scale"])
    sparse = dict(args, latent_pages_PSC=jnp.asarray(latent, kv_dtype), token_ids_BK=jnp.asarray(ids),
                  counts_B=jnp.asarray(counts))
    del sparse["lengths_B"]
    v_max = _mla_max_abs_v(sparse)
    ref = sparse_paged_attention_mla(**sparse, backend="xla")
    # The reference returns q's dtype: with bf16 q add that one rounding, u_bf16 |out| <= u_bf16 max|v|.
    rounding = U_BF16 if q_dtype == jnp.bfloat16 else 0.0
    _check_close(ref, expected, (F32_TOL + rounding) * v_max, seed, "sparse mla reference vs float64")
    got = sparse_paged_attention_mla(**sparse, backend=KERNEL_BACKEND, tuning=tuning)
    tol = (F32_TOL if q_dtype == jnp.float32 else BF16_TOL) * v_max
    _check_close(got, _as_np(ref), tol, seed, "sparse mla kernel vs reference")


@pytest.mark.triton_ir
@pytest.mark.parametrize("kv_dtype", [jnp.bfloat16, jnp.float8_e4m3fn, jnp.float8_e5m2, jnp.float32])
@pytest.mark.parametrize("q_dtype", [jnp.bfloat16, jnp.float32])
def test_kernels_lower_to_triton_at_gpu_shapes(kv_dtype, q_dtype):
    """Pallas -> Triton IR lowering for CUDA (runs on CPU): GLM-4.6 GQA per GPU
    (12 q heads, 1 KV head of 128) and Kimi K2 MLA per GPU (8 heads, C = 576).
    The IR is read back and verified by jaxlib's Triton dialect, as the GPU
    compile does; experiments/sm90_compile.py compiles it on to sm_90a."""
    spec = jax.ShapeDtypeStruct
    gqa = functools.partial(paged_attention_gqa, k_scale=jnp.ones((1,)), v_scale=1.0, softmax_scale=0.1,
                            backend="pallas")
    [kernel] = triton_kernels_for_cuda(gqa, spec((4, 12, 128), q_dtype), spec((1, 512, 16, 128), kv_dtype),
                                       spec((1, 512, 16, 128), kv_dtype), spec((4, 128), jnp.int32),
                                       spec((4,), jnp.int32))
    assert kernel.name == "paged_attention_gqa" and kernel.ttir.count("tt.dot") >= 2  # QK^T and PV
    mla = functools.partial(paged_attention_mla, kv_lora_rank=512, scale=1.0, softmax_scale=0.1, backend="pallas")
    [kernel] = triton_kernels_for_cuda(mla, spec((4, 8, 576), q_dtype), spec((512, 64, 576), kv_dtype),
                                       spec((4, 32), jnp.int32), spec((4,), jnp.int32))
    assert kernel.name == "paged_attention_mla" and kernel.ttir.count("tt.dot") >= 3  # 2 column views + PV
    assert kernel.grid[0] == 4  # one program row per request
    # GLM-5 DSA decode: top-2048 of 4096 tokens, one latent row per chosen token.
    sparse = functools.partial(sparse_paged_attention_mla, kv_lora_rank=512, scale=1.0, softmax_scale=0.1,
                               backend="pallas")
    [kernel] = triton_kernels_for_cuda(sparse, spec((4, 8, 576), q_dtype), spec((512, 64, 576), kv_dtype),
                                       spec((4, 64), jnp.int32), spec((4, 2048), jnp.int32), spec((4,), jnp.int32))
    assert kernel.name == "paged_attention_mla" and kernel.grid[0] == 4


@pytest.mark.triton_ir
def test_query_tokens_lower_to_one_program_row_per_request():
    """Speculative verification's shapes (the last token and 2 drafts per request) lower to Triton
    with the query tokens folded into a program's rows: the grid has one row per request, not
    per query token, so each page is read once for all of them."""
    spec = jax.ShapeDtypeStruct
    fp8 = jnp.float8_e4m3fn
    gqa = functools.partial(paged_attention_gqa, k_scale=jnp.ones((1,)), v_scale=1.0, softmax_scale=0.1,
                            backend="pallas")
    [kernel] = triton_kernels_for_cuda(gqa, spec((4, 3, 12, 128), jnp.bfloat16), spec((1, 512, 16, 128), fp8),
                                       spec((1, 512, 16, 128), fp8), spec((4, 128), jnp.int32),
                                       spec((4, 3), jnp.int32))
    assert kernel.name == "paged_attention_gqa" and kernel.grid[0] == 4
    mla = functools.partial(paged_attention_mla, kv_lora_rank=512, scale=1.0, softmax_scale=0.1, backend="pallas")
    [kernel] = triton_kernels_for_cuda(mla, spec((4, 2, 8, 576), jnp.bfloat16), spec((512, 64, 576), fp8),
                                       spec((4, 32), jnp.int32), spec((4, 2), jnp.int32))
    assert kernel.name == "paged_attention_mla" and kernel.grid[0] == 4  # 2 tokens x 8 heads: one block of 16


@pytest.mark.triton_ir
def test_pallas_combine_leaves_no_reduction_after_the_kernels():
    """AttentionTuning(combine="pallas") at B=1 ctx=32k, FP8 pages (GLM-4.6's GQA and Kimi's MLA per
    GPU, hundreds of splits): the attention kernel and the merge kernel, nothing reduced by XLA
    after them (the "xla" merge lowers to reductions over the splits), and the merge's grid one
    program per (request and KV head, real head row, column block)."""
    spec = jax.ShapeDtypeStruct
    fp8 = jnp.float8_e4m3fn
    gqa_specs = (spec((1, 12, 128), jnp.bfloat16), spec((1, 2048, 16, 128), fp8), spec((1, 2048, 16, 128), fp8),
                 spec((1, 2048), jnp.int32), spec((1,), jnp.int32))
    mla_specs = (spec((1, 8, 576), jnp.bfloat16), spec((512, 64, 576), fp8), spec((1, 512), jnp.int32),
                 spec((1,), jnp.int32))
    for combine, expected_reductions in (("xla", True), ("pallas", False)):
        tuning = AttentionTuning(combine=combine)
        gqa = functools.partial(paged_attention_gqa, k_scale=1.0, v_scale=0.5, softmax_scale=0.1,
                                backend="pallas", tuning=tuning)
        mla = functools.partial(paged_attention_mla, kv_lora_rank=512, scale=0.5, softmax_scale=0.1,
                                backend="pallas", tuning=tuning)
        for fn, specs, grid in ((gqa, gqa_specs, (1, 12, 8)), (mla, mla_specs, (1, 8, 32))):
            assert ("stablehlo.reduce" in lower_for_cuda(fn, *specs)) == expected_reductions, (combine, fn)
            kernels = triton_kernels_for_cuda(fn, *specs)
            if combine == "pallas":
                assert [k.name for k in kernels] == [kernels[0].name, "combine_splits"], kernels
                assert kernels[1].grid == grid and "tt.store" in kernels[1].ttir
                assert kernels[0].grid[-1] * kernels[0].grid[-2] >= 128  # splits to merge (one request)


def _fp8_serving_kernels(tuning: AttentionTuning):
    """The Triton kernels of GQA (12 query heads per KV head, D = 128) and MLA
    (Kimi's 8 heads per GPU at TP8, latent 512 + 64) over FP8 pages, bf16 queries."""
    spec = jax.ShapeDtypeStruct
    fp8 = jnp.float8_e4m3fn
    gqa = functools.partial(paged_attention_gqa, k_scale=1.0, v_scale=1.0, softmax_scale=0.1,
                            backend="pallas", tuning=tuning)
    [kernel] = triton_kernels_for_cuda(gqa, spec((4, 12, 128), jnp.bfloat16), spec((1, 512, 16, 128), fp8),
                                       spec((1, 512, 16, 128), fp8), spec((4, 128), jnp.int32),
                                       spec((4,), jnp.int32))
    mla = functools.partial(paged_attention_mla, kv_lora_rank=512, scale=1.0, softmax_scale=0.1,
                            backend="pallas", tuning=tuning)
    [latent] = triton_kernels_for_cuda(mla, spec((4, 8, 576), jnp.bfloat16), spec((512, 64, 576), fp8),
                                       spec((4, 32), jnp.int32), spec((4,), jnp.int32))
    return kernel, latent


@pytest.mark.triton_ir
def test_prefetch_kernels_lower_to_triton_with_masked_page_loads():
    """AttentionTuning(prefetch=True) at GPU shapes: every page load is masked
    (the prologue's and the loop's), so a prefetch past a split's last block
    reads nothing; without prefetch the two loads are unmasked."""

    def page_loads(tuning):
        kernel, latent = _fp8_serving_kernels(tuning)
        # tt.load %ptr[, %mask, %other] : tensor<...x!tt.ptr<f8E4M3FN>>
        return [re.search(r"tt\.load ([^:]*):", line).group(1).count(",")
                for line in kernel.ttir.splitlines() + latent.ttir.splitlines()
                if "tt.load" in line and "ptr<f8E4M3FN>" in line]

    assert page_loads(AttentionTuning()) == [0] * 4  # GQA k, v; MLA two column views
    assert page_loads(AttentionTuning(prefetch=True)) == [2] * 8  # each in the prologue and the loop


def _tensor_selects_by_branch(ttir: str) -> tuple[int, int]:
    """(tensor arith.selects inside some scf.if, those outside any) in a kernel's TTIR."""
    inside = outside = 0
    regions: list[bool] = []  # per open region: is it an scf.if's (then or else)?
    for line in ttir.splitlines():
        stripped = line.strip()
        if stripped.startswith("}"):
            regions.pop()
        if stripped.endswith("{"):
            regions.append("scf.if" in stripped or stripped.startswith("} else"))
        if "arith.select" in stripped and "tensor<" in stripped:
            inside, outside = (inside + 1, outside) if any(regions) else (inside, outside + 1)
    return inside, outside


@pytest.mark.triton_ir
def test_masks_lower_into_a_branch_only_the_last_block_takes():
    """At GPU shapes every tensor select (the logits' -inf mask, the values'
    zeroing of stale slots) sits inside an scf.if: a block of valid tokens
    branches past them (online_softmax_step's needs_mask); outside any, with
    AttentionTuning(branch_masks=False)."""
    for tuning in (AttentionTuning(), AttentionTuning(swap_pv=True), AttentionTuning(prefetch=True),
                   AttentionTuning(branch_masks=False)):
        for kernel in _fp8_serving_kernels(tuning):
            masks = 1 if tuning.prefetch else 2  # prefetch loads stale slots as zeros: only the logits are masked
            expected = (masks, 0) if tuning.branch_masks else (0, masks)
            assert _tensor_selects_by_branch(kernel.ttir) == expected, (tuning, kernel.name)


@pytest.mark.triton_ir
def test_swap_pv_gives_the_values_product_the_value_width_as_rows():
    """AttentionTuning(swap_pv=True) at GPU shapes: the values product reaches
    Triton as [V, T] x [T, R] (V = 128 for GQA, 512 for MLA: rows enough for
    wgmma) instead of [R, T] x [T, V]; the logits products are unchanged."""

    def dots(tuning):
        return tuple([(a, b) for a, b, _ in ttir_dots(k.ttir)] for k in _fp8_serving_kernels(tuning))

    gqa, mla = dots(AttentionTuning())
    assert gqa == [((16, 128), (128, 64)), ((16, 64), (64, 128))], gqa
    assert mla == [((16, 512), (512, 64)), ((16, 64), (64, 64)), ((16, 64), (64, 512))], mla
    gqa, mla = dots(AttentionTuning(swap_pv=True))
    assert gqa == [((16, 128), (128, 64)), ((128, 64), (64, 16))], gqa
    assert mla == [((16, 512), (512, 64)), ((16, 64), (64, 64)), ((512, 64), (64, 16))], mla


@pytest.mark.triton_ir
def test_attention_kernels_keep_small_dots_off_the_mma():
    """A tiny model's MLA (latent 32 + RoPE 8, as tiny-kimi) with a bf16 query
    over FP8 pages: its RoPE logits contract 8, so in the Triton IR they take
    float32 operands; the serving shape's dots stay 16-bit and >= 16 wide."""
    spec = jax.ShapeDtypeStruct
    for heads, rank, rope, page in ((4, 32, 8, 16), (8, 512, 64, 64)):
        mla = functools.partial(paged_attention_mla, kv_lora_rank=rank, scale=1.0, softmax_scale=0.1,
                                backend="pallas")
        [kernel] = triton_kernels_for_cuda(mla, spec((2, heads, rank + rope), jnp.bfloat16),
                                           spec((64, page, rank + rope), jnp.float8_e4m3fn),
                                           spec((2, 8), jnp.int32), spec((2,), jnp.int32))
        dots = ttir_dots(kernel.ttir)
        assert dots and not dots_below_the_mma_minimum(kernel.ttir), dots
        assert any(t == "f32" for _, _, t in dots) == (rope < 16), dots


@pytest.mark.triton_ir
def test_triton_kernels_for_cuda_names_a_function_without_kernels():
    with pytest.raises(RuntimeError, match="no __gpu"):
        triton_kernels_for_cuda(jnp.sin, jax.ShapeDtypeStruct((4,), jnp.float32))


def test_split_heuristic_at_gpu_shapes():
    """Batch 1 splits down to 1-2 blocks per program (the H200 showed its time
    growing with blocks per program), batch 64 keeps few splits, and every
    split streams at least partial_share times the bytes of its partial."""
    from pallas_kernels.flash_decoding import plan_splits

    gqa = dict(kv_bytes_per_token=2 * 128, partial_bytes=16 * 130 * 4)  # fp8 K + V, D = 128
    mla = dict(kv_bytes_per_token=576, partial_bytes=16 * 514 * 4)  # fp8 latent, L = 512
    cases = [(32768, 16, 1, gqa), (32768, 16, 64, gqa), (4096, 64, 1, mla), (32768, 64, 1, mla), (4096, 64, 64, mla)]
    for share in (1, 8):
        tuning = AttentionTuning(partial_share=share)
        plans = {}
        for context, page, batch, sizes in cases:
            plan = plans[context, batch, page] = plan_splits(context // page, page, batch, **sizes,
                                                             target_programs=2 * 132, tuning=tuning)
            streamed = plan.pages_per_split * page * sizes["kv_bytes_per_token"]
            assert streamed >= share * sizes["partial_bytes"], plan
        assert plans[32768, 64, 16].num_splits <= 8 and plans[4096, 64, 64].num_splits <= 8
        if share == 1:
            assert plans[4096, 1, 64].blocks_per_split == 1 and plans[32768, 1, 64].blocks_per_split <= 2
            assert plans[32768, 1, 16].num_splits >= 2 * 132 - 8
        else:  # the old rule: 8 blocks per program for MLA at batch 1
            assert plans[4096, 1, 64].blocks_per_split == 8 and plans[32768, 1, 64].blocks_per_split == 8


def test_sweep_program_targets_give_one_wave_at_batch_64():
    """The sweep's AttentionTuning.target_programs (experiments/gpu_kernels.py):
    at B=64 ctx=32k they must give exactly the splits its comment claims, so
    that the programs fill the 132 SMs in one wave at the occupancy sm_90a
    compiles allow for every choice swept (GQA fp8 with float16 dots 4 per
    SM, with or without swap_pv; MLA 1, at 8 or 16 warps). GQA with every
    block masked (branch_masks=False) now compiles to 96 registers, 5 per
    SM; it is swept to time the branch against, at the defaults' plan."""
    from experiments.gpu_kernels import ATTENTION_SWEEP, BEFORE_RUN_3
    from pallas_kernels.flash_decoding import plan_splits
    from pallas_kernels.paged_attention_gqa import TARGET_PROGRAMS as GQA_PROGRAMS
    from pallas_kernels.paged_attention_mla import TARGET_PROGRAMS as MLA_PROGRAMS

    sizes = {"GQA": (16, dict(kv_bytes_per_token=2 * 128, partial_bytes=16 * 130 * 4)),
             "MLA": (64, dict(kv_bytes_per_token=576, partial_bytes=16 * 514 * 4))}
    defaults = {"GQA": GQA_PROGRAMS, "MLA": MLA_PROGRAMS}
    for kernel, (page, bytes_) in sizes.items():
        for tuning in ATTENTION_SWEEP[kernel]:
            if tuning.target_programs == BEFORE_RUN_3.target_programs:
                continue  # the defaults before the third H200 run, 2 per SM, kept for comparison
            cut = min(page, tuning.block_tokens)  # the page size the kernel sees (fd.cut_pages)
            plan = plan_splits(32768 // cut, cut, 64, **bytes_, target_programs=defaults[kernel], tuning=tuning)
            programs = 64 * plan.num_splits
            capacity = 132 * {"GQA": 4, "MLA": 1}[kernel]
            assert 0.9 * capacity <= programs <= capacity, (kernel, tuning, programs, capacity)


def test_dots_below_the_mma_minimum_run_in_float32():
    """A dot with a dimension < 16 (the tiny models' 8-wide RoPE part) takes
    float32 operands, Triton's FMA path: with bf16 operands and K = 8 the
    H200 returned twice the product (2026-11-30). At 16 and up the operands
    stay as they are (the MMA)."""
    from pallas_kernels import mma

    def dot_operand_dtypes(a, b, dot):
        [eqn] = [e for e in jax.make_jaxpr(dot)(a, b).eqns if e.primitive.name == "dot_general"]
        return {v.aval.dtype for v in eqn.invars}

    rng = np.random.default_rng(_seed())
    for m, k, n in ((16, 8, 64), (16, 16, 8), (8, 16, 16), (16, 16, 16)):
        a = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
        b = jnp.asarray(rng.standard_normal((k, n)), jnp.float16)
        small = min(m, k, n) < 16
        for dot, b_op in ((mma.dot_nn, b), (mma.dot_nt, b.T)):
            assert dot_operand_dtypes(a, b_op, dot) == ({jnp.dtype(jnp.float32)} if small else
                                                        {jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)})
            exact = np.asarray(a, np.float64) @ np.asarray(b, np.float64)  # products exact in f32
            np.testing.assert_allclose(np.asarray(dot(a, b_op)), exact, rtol=0, atol=k * 2.0**-20 * np.abs(exact).max())


def test_interpreter_poisons_outputs():
    """The NaN-poisoning the kernel tests rely on: unwritten outputs read NaN."""
    from jax.experimental import pallas as pl

    def writes_nothing(x_ref, o_ref):
        del x_ref, o_ref

    out = pl.pallas_call(writes_nothing, out_shape=jax.ShapeDtypeStruct((8,), jnp.float32),
                         interpret=True)(jnp.ones((8,), jnp.float32))
    assert np.all(np.isnan(np.asarray(out)))


def test_backend_resolution_and_errors():
    assert resolve_backend("xla") == "xla"
    assert resolve_backend(None) == ("pallas" if jax.default_backend() == "gpu" else "xla")
    assert resolve_backend("auto") == resolve_backend(None)
    args, _ = _gqa_inputs(_rng(0), batch=1, kv_heads=1, group=2, head_dim=8, page_size=8, num_slots=1,
                          lengths=(3,), kv_dtype=jnp.bfloat16, q_dtype=jnp.float32, per_head=False)
    with pytest.raises(ValueError, match="unknown backend"):
        paged_attention_gqa(**args, backend="cuda")
    with pytest.raises(ValueError, match="H % K"):
        paged_attention_gqa(**{**args, "q_BHD": args["q_BHD"][:, :, :4]}, backend="xla")
    with pytest.raises(ValueError, match="k_scale"):
        paged_attention_gqa(**{**args, "k_scale": jnp.ones((3,))}, backend="xla")
    with pytest.raises(ValueError, match="lengths_B"):
        paged_attention_gqa(**{**args, "lengths_B": jnp.zeros((2,), jnp.int32)}, backend="xla")
    tokens = {**args, "q_BHD": jnp.stack([args["q_BHD"]] * 3, axis=1)}  # [B, Q=3, H, D]
    for q, lengths in ((tokens["q_BHD"], jnp.zeros((1,), jnp.int32)), (tokens["q_BHD"], jnp.zeros((1, 2), jnp.int32)),
                       (args["q_BHD"], jnp.zeros((1, 3), jnp.int32))):
        with pytest.raises(ValueError, match=r"lengths_B must be \[B\] .* or \[B, Q\]"):
            paged_attention_gqa(**{**tokens, "q_BHD": q, "lengths_B": lengths}, backend="xla")
    with pytest.raises(ValueError, match="at least one query token"):
        paged_attention_gqa(**{**tokens, "q_BHD": tokens["q_BHD"][:, :0], "lengths_B": jnp.zeros((1, 0), jnp.int32)},
                            backend=KERNEL_BACKEND)
    # The reference takes any page size; the kernels need 2^n (Triton blocks).
    odd_pages = {**args, "k_pages_KPSD": args["k_pages_KPSD"][:, :, :6], "v_pages_KPSD": args["v_pages_KPSD"][:, :, :6]}
    assert np.isfinite(_as_np(paged_attention_gqa(**odd_pages, backend="xla"))).all()
    with pytest.raises(ValueError, match="power-of-two page size"):
        paged_attention_gqa(**odd_pages, backend=KERNEL_BACKEND)


@pytest.mark.parametrize("page_axis", [0, 1])
def test_cut_pages_keeps_every_token_where_the_table_says(page_axis):
    """fd.cut_pages views pages of S tokens as sub-pages of T: token t of a
    request, at pool[table[t // S], t % S], is at cut[cut_table[t // T], t % T]
    for every pool sharing the table. Pages no longer than T are left as they are."""
    from pallas_kernels import flash_decoding as fd

    seed = _seed()
    rng = _rng(seed)
    pages, s, t, n = 6, 32, 8, 5
    lead = (2,) * page_axis  # GQA pools carry a KV-head axis first
    pool_a = jnp.asarray(rng.standard_normal((*lead, pages, s, 3)), jnp.float32)
    pool_b = pool_a + 1
    table = jnp.asarray(rng.integers(0, pages, (2, n)), jnp.int32)
    cut_table, cut_a, cut_b = fd.cut_pages(table, t, page_axis, pool_a, pool_b)
    assert cut_table.shape == (2, n * s // t) and cut_a.shape == (*lead, pages * s // t, t, 3)
    tokens = np.arange(n * s)
    for pool, cut in ((pool_a, cut_a), (pool_b, cut_b)):
        pool, cut = (np.moveaxis(np.asarray(x), (page_axis, page_axis + 1), (0, 1)) for x in (pool, cut))
        for b in range(2):
            want = pool[np.asarray(table)[b, tokens // s], tokens % s]
            got = cut[np.asarray(cut_table)[b, tokens // t], tokens % t]
            assert np.array_equal(got, want), f"seed={seed}"
    same = fd.cut_pages(table, s, page_axis, pool_a)
    assert same[0] is table and same[1] is pool_a


def test_block_tokens_must_be_a_power_of_two_of_at_least_16():
    for bad in (8, 24, 0):
        with pytest.raises(ValueError, match="block_tokens"):
            AttentionTuning(block_tokens=bad)


@pytest.mark.triton_ir
def test_mla_blocks_smaller_than_a_page_lower_to_smaller_tiles():
    """At Kimi's 64-token pages, block_tokens=32 reaches the GPU kernel as
    32-token latent loads over a table twice as long (not silently ignored)."""
    spec = jax.ShapeDtypeStruct
    fp8 = jnp.float8_e4m3fn

    def latent_tiles(block_tokens):
        mla = functools.partial(paged_attention_mla, kv_lora_rank=512, scale=1.0, softmax_scale=0.1,
                                backend="pallas", tuning=AttentionTuning(block_tokens=block_tokens, num_splits=4))
        [kernel] = triton_kernels_for_cuda(mla, spec((4, 8, 576), jnp.bfloat16), spec((512, 64, 576), fp8),
                                           spec((4, 32), jnp.int32), spec((4,), jnp.int32))
        return sorted(set(re.findall(r"tensor<(\d+x\d+x\d+)x!tt\.ptr<f8E4M3FN>>", kernel.ttir)))

    assert latent_tiles(64) == ["1x64x512", "1x64x64"]
    assert latent_tiles(32) == ["1x32x512", "1x32x64"]
