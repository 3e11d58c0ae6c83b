"""Paged grouped-query decode attention with an FP8/BF16 KV cache.

One decode token per request attends to that request's pages of a paged KV
cache. All G query heads sharing a KV head are one kernel block, so each K/V
page is read from HBM once per step, not G times. Several query tokens of one
request (speculative verification: the last token and its drafts, each
seeing the cache up to itself) share that block too, Q * G rows over one read
of the pages, as FlashMLA folds seqlen_q into its head rows.

Why Triton-backed Pallas (jax.experimental.pallas.triton) rather than Mosaic
GPU: the kernel is a gather (pages picked through the page table) followed by
small dots. Triton lowers `ref[page_ids]` to per-row pointer arithmetic, so a
block of pages scattered anywhere in the pool is one vectorized load with no
copy and no scalar-prefetch machinery (which Triton-Pallas lacks anyway), and
its dots accept the [16, T] x [T, D] shapes of decode. Mosaic GPU would need
explicit TMA/async-copy pipelining per page and warpgroup-sized (64-row)
tiles, a poor fit for 12-16 query rows (Triton takes wgmma where a product
has 64 rows: AttentionTuning.swap_pv computes values^T p^T). The same body runs in the Pallas
interpreter on CPU for tests, and `backend.lower_for_cuda` checks on CPU that
it lowers to Triton IR.

Numerics: pages are cast to the dot dtype (exact for fp8/bf16 -> bf16), the
scales are applied in f32 (k_scale * softmax_scale to the logits, v_scale to
the combined output), all sums are f32, and the softmax is online. The one
rounding beyond the reference is the probabilities fed to the PV dot in bf16
(bf16 queries only), as in FlashAttention.

Shapes (see the glossary in pallas_kernels/__init__.py):
  q_BHD            [B, H, D]   bf16 or f32, H = K * G; or q_BQHD [B, Q, H, D]
  k/v_pages_KPSD   [K, P, S, D] bf16, f32, float8_e4m3fn or float8_e5m2
  page_table_BN    [B, N] int32 physical page of each logical page slot
  lengths_B        [B] int32 valid tokens per request (0 allowed); with
                   q_BQHD, lengths_BQ [B, Q]: the tokens each query token sees
  k_scale, v_scale f32 scalar or [K]: real value = stored value * scale
  out_BHD          [B, H, D] (or [B, Q, H, D]) in q's dtype
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import flash_decoding as fd
from pallas_kernels import mma
from pallas_kernels.backend import resolve_backend

# Programs the split heuristic aims for (AttentionTuning.target_programs=None):
# 4 float16-dot programs per SM of the H200's 132 (2026-11-30 sweep).
TARGET_PROGRAMS = 512


def paged_attention_gqa(
    q_BHD: jax.Array,
    k_pages_KPSD: jax.Array,
    v_pages_KPSD: jax.Array,
    page_table_BN: jax.Array,
    lengths_B: jax.Array,
    *,
    k_scale,
    v_scale,
    softmax_scale: float,
    backend: str | None = None,
    tuning: fd.AttentionTuning = fd.AttentionTuning(),
) -> jax.Array:
    """softmax(q k^T * softmax_scale) v over each request's first lengths_B tokens
    (each query token's, with q [B, Q, H, D] and lengths [B, Q]: fd.query_tokens).

    tuning: the kernel's launch choices (block size, splits, warps); not the result.
    """
    backend = resolve_backend(backend)
    q_BQHD, lengths_BQ = fd.query_tokens(q_BHD, lengths_B, "q")
    _check_shapes(q_BQHD, k_pages_KPSD, v_pages_KPSD, page_table_BN, lengths_BQ)
    num_kv_heads = k_pages_KPSD.shape[0]
    k_scale_K = _per_head(k_scale, num_kv_heads, "k_scale")
    v_scale_K = _per_head(v_scale, num_kv_heads, "v_scale")
    softmax_scale = jnp.float32(softmax_scale)
    if backend == "xla":
        out_BQHD = _reference(q_BQHD, k_pages_KPSD, v_pages_KPSD, page_table_BN, lengths_BQ,
                              k_scale_K, v_scale_K, softmax_scale)
    else:
        fd.check_kernel_page_size(k_pages_KPSD.shape[2])
        out_BQHD = _kernel(q_BQHD, k_pages_KPSD, v_pages_KPSD, page_table_BN, lengths_BQ,
                           k_scale_K, v_scale_K, softmax_scale, interpret=backend == "interpret", tuning=tuning)
    return out_BQHD.reshape(q_BHD.shape)


def _check_shapes(q_BQHD, k_pages_KPSD, v_pages_KPSD, page_table_BN, lengths_BQ) -> None:
    if k_pages_KPSD.ndim != 4:
        raise ValueError(f"expected pages [K, P, S, D], got {k_pages_KPSD.shape}")
    if k_pages_KPSD.shape != v_pages_KPSD.shape or k_pages_KPSD.dtype != v_pages_KPSD.dtype:
        raise ValueError(f"k/v pages differ: {k_pages_KPSD.dtype}{k_pages_KPSD.shape} vs {v_pages_KPSD.dtype}{v_pages_KPSD.shape}")
    if k_pages_KPSD.dtype not in fd.PAGE_DTYPES:
        raise ValueError(f"unsupported KV dtype {k_pages_KPSD.dtype}; expected one of {fd.PAGE_DTYPES}")
    if q_BQHD.dtype not in (jnp.bfloat16, jnp.float32):
        raise ValueError(f"q must be bf16 or f32, got {q_BQHD.dtype}")
    b, _, h, d = q_BQHD.shape
    kvh, _, _, kd = k_pages_KPSD.shape
    if kd != d or h % kvh:
        raise ValueError(f"q [B, H={h}, D={d}] does not fit pages [K={kvh}, P, S, D={kd}]: need H % K == 0 and equal D")
    fd.check_paging(page_table_BN, lengths_BQ, b)


def _per_head(scale, num_kv_heads: int, name: str) -> jax.Array:
    scale = jnp.asarray(scale, jnp.float32)
    if scale.ndim == 0:
        return jnp.broadcast_to(scale, (num_kv_heads,))
    if scale.shape != (num_kv_heads,):
        raise ValueError(f"{name} must be a scalar or [K={num_kv_heads}], got {scale.shape}")
    return scale


@jax.jit
def _reference(q_BQHD, k_pages_KPSD, v_pages_KPSD, page_table_BN, lengths_BQ,
               k_scale_K, v_scale_K, softmax_scale):
    """Gather the pages, dequantize to f32, masked softmax: the spec, in jnp."""
    b, nq, h, d = q_BQHD.shape
    kvh, _, page_size, _ = k_pages_KPSD.shape
    n = page_table_BN.shape[1]

    def dequantized_BKTD(pages_KPSD, scale_K):
        gathered_KBNSD = pages_KPSD[:, page_table_BN].astype(jnp.float32)
        values_BKTD = gathered_KBNSD.transpose(1, 0, 2, 3, 4).reshape(b, kvh, n * page_size, d)
        return values_BKTD * scale_K[None, :, None, None]

    valid_BQT = jnp.arange(n * page_size)[None, None, :] < lengths_BQ[:, :, None]
    k_BKTD = dequantized_BKTD(k_pages_KPSD, k_scale_K)
    # Slots past the length may hold stale NaN/Inf bits: zero them, since
    # probability 0 times NaN is still NaN.
    v_BKTD = jnp.where(valid_BQT.any(1)[:, None, :, None], dequantized_BKTD(v_pages_KPSD, v_scale_K), 0.0)
    q_BQKGD = q_BQHD.astype(jnp.float32).reshape(b, nq, kvh, h // kvh, d)
    logits_BQKGT = jnp.einsum("bqkgd,bktd->bqkgt", q_BQKGD, k_BKTD,
                              precision=jax.lax.Precision.HIGHEST) * softmax_scale
    logits_BQKGT = jnp.where(valid_BQT[:, :, None, None, :], logits_BQKGT, -jnp.inf)
    # An empty request has all logits -inf; its output is defined as zeros.
    max_BQKG = jnp.max(logits_BQKGT, axis=-1, keepdims=True)
    p_BQKGT = jnp.exp(logits_BQKGT - jnp.where(jnp.isfinite(max_BQKG), max_BQKG, 0.0))
    sum_BQKG = jnp.sum(p_BQKGT, axis=-1, keepdims=True)
    out_BQKGD = jnp.einsum("bqkgt,bktd->bqkgd", p_BQKGT / jnp.where(sum_BQKG > 0, sum_BQKG, 1.0), v_BKTD,
                           precision=jax.lax.Precision.HIGHEST)
    return out_BQKGD.reshape(b, nq, h, d).astype(q_BQHD.dtype)


def _gqa_kernel(q_ref, k_pages_ref, v_pages_ref, slots_ref, length_ref, logit_scale_ref,
                acc_ref, max_ref, sum_ref, *, plan: fd.SplitPlan, page_size: int, dot_dtype,
                tuning: fd.AttentionTuning):
    """One (request, KV head, split) grid step.

    Refs: q [R, D] (R = Q * G padded), k/v pages [P, S, D] of this KV head, the
    split's page ids [pages_per_split], lengths [1] or [R] (fd.row_lengths), logit scale [1];
    outputs acc [R, D], max [R], sum [R].
    """
    (q_RD,), unscale_R = fd.scaled_query((q_ref[...],), dot_dtype)
    rows, head_dim = q_RD.shape
    logit_scale = fd.row_logit_scale(logit_scale_ref[0], unscale_R)
    block_tokens = plan.pages_per_block * page_size

    def gather(pages, valid_T):
        return (fd.gather_pages(k_pages_ref, pages, valid_T), fd.gather_pages(v_pages_ref, pages, valid_T))

    def logits_and_values(tiles):
        # Exact dequantization (fp8/bf16 -> bf16, fp8 -> f16, or -> f32); the
        # scales are applied to the f32 logits here and to the combined f32 output.
        k_TD, v_TD = (t.reshape(block_tokens, head_dim).astype(dot_dtype) for t in tiles)
        return mma.dot_nt(q_RD, k_TD) * logit_scale, v_TD

    state = fd.attend_split(slots_ref, length_ref[...], pl.program_id(2), page_size, plan,
                            rows, head_dim, gather, logits_and_values, tuning)
    fd.store_partial(state, acc_ref, max_ref, sum_ref, tuning)


@functools.partial(jax.jit, static_argnames=("interpret", "tuning"))
def _kernel(q_BQHD, k_pages_KPSD, v_pages_KPSD, page_table_BN, lengths_BQ,
            k_scale_K, v_scale_K, softmax_scale, *, interpret: bool, tuning: fd.AttentionTuning):
    b, nq, h, d = q_BQHD.shape
    kvh = k_pages_KPSD.shape[0]
    g = h // kvh
    # Query-major rows of one KV head (row j * G + i is query token j's head i of it); more than
    # gqa_rows run in blocks of gqa_rows, each a request of its own over the same pages.
    blocks = fd.RowBlocks.of(nq * g, tuning.gqa_rows)
    rows, x = blocks.rows, b * blocks.blocks
    page_table_XN, k_pages_KPSD, v_pages_KPSD = fd.cut_pages(blocks.table(page_table_BN), tuning.block_tokens, 1,
                                                             k_pages_KPSD, v_pages_KPSD)
    page_size = k_pages_KPSD.shape[2]
    plan = fd.plan_splits(page_table_XN.shape[1], page_size, x * kvh,
                          kv_bytes_per_token=2 * d * k_pages_KPSD.dtype.itemsize,
                          partial_bytes=rows * (d + 2) * 4, target_programs=TARGET_PROGRAMS, tuning=tuning)
    dtype = fd.compute_dtype(q_BQHD.dtype, k_pages_KPSD.dtype, tuning)
    q_BKRD = q_BQHD.reshape(b, nq, kvh, g, d).transpose(0, 2, 1, 3, 4).reshape(b, kvh, nq * g, d)
    q_XKRD = blocks.split(q_BKRD.astype(fd.kernel_query_dtype(dtype, q_BQHD.dtype)), axis=2)
    slots_XYN, lengths = fd.split_page_table(page_table_XN, blocks.lengths(lengths_BQ, g), page_size, plan)
    logit_scale_K = k_scale_K * softmax_scale
    pool_spec = pl.BlockSpec((None, *k_pages_KPSD.shape[1:]), lambda bi, ki, xi: (ki, 0, 0, 0))
    partials = pl.pallas_call(
        functools.partial(_gqa_kernel, plan=plan, page_size=page_size, dot_dtype=dtype,
                          tuning=tuning),
        grid=(x, kvh, plan.num_splits),
        in_specs=[
            pl.BlockSpec((None, None, rows, d), lambda bi, ki, xi: (bi, ki, 0, 0)),
            pool_spec,
            pool_spec,
            pl.BlockSpec((None, None, plan.pages_per_split), lambda bi, ki, xi: (bi, xi, 0)),
            fd.lengths_spec(lengths),
            pl.BlockSpec((1,), lambda bi, ki, xi: (ki,)),
        ],
        out_specs=fd.partial_specs(3, rows, d),
        out_shape=fd.partial_shapes((x, kvh, plan.num_splits), rows, d),
        compiler_params=fd.compiler_params(tuning, 4, dtype),
        interpret=interpret,
        name="paged_attention_gqa",
    )(q_XKRD, k_pages_KPSD, v_pages_KPSD, slots_XYN, lengths, logit_scale_K)
    if tuning.combine == "pallas":
        out_XKRD, _ = fd.combine_splits(*partials, rows=blocks.kept, scale_S=v_scale_K, out_dtype=q_BQHD.dtype,
                                        with_lse=False, interpret=interpret)
    else:
        out_XKRD = fd.combine_partials(*partials)[0][:, :, :blocks.kept] * v_scale_K[None, :, None, None]
    out_BKQGD = blocks.join(out_XKRD, axis=2).reshape(b, kvh, nq, g, d).astype(q_BQHD.dtype)
    return out_BKQGD.transpose(0, 2, 1, 3, 4).reshape(b, nq, h, d)
