"""Absorbed multi-head latent attention (MLA) decode over a paged latent cache.

This is the FlashMLA decode shape used by DeepSeek-V3-style models (Kimi K2,
GLM-5): with the up-projections absorbed into the query and the output, every
token is cached as ONE latent vector of width C = L + R shared by all heads
(L = kv_lora_rank, e.g. 512; R = decoupled RoPE dims, e.g. 64). Keys are the
whole C-vector and values are its first L entries, so each latent is read once
per step and serves both products for all H heads of the request.

Why Triton-backed Pallas: like the GQA kernel, a block of pages is gathered
through the page table with one vectorized pointer load, and all H heads form
one side of the dots ([16, C] x [C, T], then [16, T] x [T, L]; with
AttentionTuning.swap_pv the second is [L, T] x [T, 16], which Triton runs as
wgmma). Triton
blocks must be powers of two and C = 576 is not, so the kernel reads the
latent as two column views, [.., :L] and [.., L:], and adds their logits
(so L and R must each be powers of two on GPU: 512 and 64 are). Numerics and
split-K are as in paged_attention_gqa.py; the one scale multiplies the logits
(with softmax_scale) and the combined output. Several query tokens of a
request (speculative verification) fold into the rows as there: Q * H rows,
query-major, over one read of the latents (FlashMLA's seqlen_q * heads).

Sparse decode (DSA, GLM-5): `sparse_paged_attention_mla` attends only to the
tokens the indexer chose. Each chosen token is one row of the pool viewed as
[P*S, 1, C], so it is this same kernel with page size 1 and the chosen rows as
the page table: a block gathers 64 chosen latents (as FlashMLA's sparse
decode does) and a step streams top-k latents, not the whole context.

Tile-scaled FP8 (`TiledLatentPages`, FlashMLA's 656-byte layout, tiled_fp8.py):
the latent comes as three pools, nope values in e4m3 with a power-of-two scale
per token and 128-column tile, and the RoPE part in bf16. The kernel gathers
all three per block and dequantizes the nope values into bf16 in registers,
exactly (power-of-two scales), so the dots see the same operands as a bf16
pool holding the dequantized values; `scale` does not apply.

Shapes (see the glossary in pallas_kernels/__init__.py):
  q_BHC             [B, H, C]  bf16 or f32; or q_BQHC [B, Q, H, C] with
                    lengths_BQ [B, Q], and out_BQHL [B, Q, H, L]
  latent_pages_PSC  [P, S, C]  bf16, f32, float8_e4m3fn or float8_e5m2;
                    or TiledLatentPages: nope [P, S, L] e4m3, scales [P, S, L/tile] f32,
                    rope [P, S, C - L] bf16
  page_table_BN     [B, N] int32, lengths_B [B] int32 (0 allowed)
  scale             f32 scalar: real latent = stored latent * scale
  out_BHL           [B, H, L] in q's dtype
"""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import flash_decoding as fd
from pallas_kernels import mma
from pallas_kernels.backend import resolve_backend
from pallas_kernels.tiled_fp8 import E4M3, dequantize_tiles, tile_width

# Programs the split heuristic aims for (AttentionTuning.target_programs=None):
# one wave of 1 program per SM of the H200's 132 (2026-11-30 sweep).
TARGET_PROGRAMS = 128


class TiledLatentPages(NamedTuple):
    """A latent pool in FlashMLA's FP8 layout: real latent = [nope * tile scales, rope]."""

    nope_PSL: jax.Array  # float8_e4m3fn
    scales_PSJ: jax.Array  # float32: one power of two per token per tile of nope columns
    rope_PSR: jax.Array  # bfloat16

    def map(self, fn) -> "TiledLatentPages":
        return TiledLatentPages(*(fn(x) for x in self))

    @property
    def shape(self) -> tuple[int, int, int]:
        """[P, S, C] of the latent these pools hold."""
        p, s, rank = self.nope_PSL.shape
        return p, s, rank + self.rope_PSR.shape[2]



LatentPages = jax.Array | TiledLatentPages


def latent_bytes_per_token(pages: LatentPages) -> int:
    """Bytes one token's latent takes in these pages (Kimi K2: 576 in FP8, 656 tiled)."""
    pools = pages if isinstance(pages, TiledLatentPages) else (pages,)
    return sum(x.shape[2] * x.dtype.itemsize for x in pools)


def paged_attention_mla(
    q_BHC: jax.Array,
    latent_pages_PSC: LatentPages,
    page_table_BN: jax.Array,
    lengths_B: jax.Array,
    *,
    kv_lora_rank: int,
    scale=None,
    softmax_scale: float,
    backend: str | None = None,
    tuning: fd.AttentionTuning = fd.AttentionTuning(),
    return_lse: bool = False,
):
    """softmax(q latent^T * softmax_scale) latent[:, :L] per request (per query token, with
    q [B, Q, H, C] and lengths [B, Q]: fd.query_tokens).

    scale: real latent = stored * scale, a per-tensor scalar (None: 1); tiled pages
      carry their own scales and take None.
    tuning: the kernel's launch choices (block size, splits, warps); not the result.
    return_lse: also return the logits' log-sum-exp [B, H] (-inf for an empty
      request), with the output in float32, so that outputs over disjoint token
      sets (e.g. the slots each device holds) merge exactly (fd.merge_over_axis).
      With q [B, Q, H, C] it is [B, Q, H].
    """
    backend = resolve_backend(backend)
    q_BQHC, lengths_BQ = fd.query_tokens(q_BHC, lengths_B, "q")
    _check_shapes(q_BQHC, latent_pages_PSC, page_table_BN, lengths_BQ, kv_lora_rank)
    if isinstance(latent_pages_PSC, TiledLatentPages) and scale is not None:
        raise ValueError("tiled FP8 latent pages carry a scale per token and tile: pass scale=None")
    scale = jnp.asarray(1.0 if scale is None else scale, jnp.float32)
    if scale.ndim != 0:
        raise ValueError(f"MLA latent scale must be a per-tensor scalar, got shape {scale.shape}")
    softmax_scale = jnp.float32(softmax_scale)
    if backend == "xla":
        out_BQHL, lse_BQH = _reference(q_BQHC, latent_pages_PSC, page_table_BN, lengths_BQ, scale, softmax_scale,
                                       kv_lora_rank=kv_lora_rank)
    else:
        fd.check_kernel_page_size(latent_pages_PSC.shape[1])
        out_BQHL, lse_BQH = _kernel(q_BQHC, latent_pages_PSC, page_table_BN, lengths_BQ, scale, softmax_scale,
                                    kv_lora_rank=kv_lora_rank, interpret=backend == "interpret", tuning=tuning,
                                    return_lse=return_lse)
    out = out_BQHL.reshape(*q_BHC.shape[:-1], kv_lora_rank)
    return (out, lse_BQH.reshape(q_BHC.shape[:-1])) if return_lse else out.astype(q_BHC.dtype)


def sparse_paged_attention_mla(
    q_BHC: jax.Array,
    latent_pages_PSC: LatentPages,
    page_table_BN: jax.Array,
    token_ids_BK: jax.Array,
    counts_B: jax.Array,
    *,
    kv_lora_rank: int,
    scale=None,
    softmax_scale: float,
    backend: str | None = None,
    tuning: fd.AttentionTuning = fd.AttentionTuning(),
    return_lse: bool = False,
):
    """paged_attention_mla over each request's chosen tokens only (DSA decode).

    token_ids_BK[b, :counts_B[b]] are the logical positions request b attends
    to (each below its length, no repeats); entries past counts_B[b] are
    ignored and may hold anything. Output [B, H, L] as paged_attention_mla.
    """
    if q_BHC.ndim != 3 or counts_B.ndim != 1:
        raise ValueError(f"sparse MLA takes one query token per request, q [B, H, C] and counts_B [B], got "
                         f"{q_BHC.shape} and {counts_B.shape}")
    if token_ids_BK.ndim != 2 or token_ids_BK.shape[0] != q_BHC.shape[0]:
        raise ValueError(f"token_ids_BK must be [B={q_BHC.shape[0]}, K], got {token_ids_BK.shape}")
    fd.check_paging(page_table_BN, counts_B, q_BHC.shape[0])
    p, s, c = latent_pages_PSC.shape
    # Ignored entries are clamped into the table and the pool: the kernel loads whole blocks.
    ids_BK = jnp.clip(token_ids_BK.astype(jnp.int32), 0, page_table_BN.shape[1] * s - 1)
    pages_BK = jnp.clip(jnp.take_along_axis(page_table_BN.astype(jnp.int32), ids_BK // s, axis=1), 0, p - 1)
    as_rows = lambda x: x.reshape(p * s, 1, x.shape[2])
    rows = latent_pages_PSC.map(as_rows) if isinstance(latent_pages_PSC, TiledLatentPages) else as_rows(latent_pages_PSC)
    return paged_attention_mla(
        q_BHC, rows, pages_BK * s + ids_BK % s,
        jnp.clip(counts_B, 0, token_ids_BK.shape[1]), kv_lora_rank=kv_lora_rank, scale=scale,
        softmax_scale=softmax_scale, backend=backend, tuning=tuning, return_lse=return_lse)


def _check_tiled(pages: TiledLatentPages, kv_lora_rank: int) -> None:
    nope, scales, rope = pages
    if any(x.ndim != 3 or x.shape[:2] != nope.shape[:2] for x in pages):
        raise ValueError(f"tiled latent pools must be [P, S, ...] alike, got {[x.shape for x in pages]}")
    if (nope.dtype, scales.dtype, rope.dtype) != (E4M3, jnp.float32, jnp.bfloat16):
        raise ValueError(f"tiled latent pools must be float8_e4m3fn, float32, bfloat16, got "
                         f"{nope.dtype}, {scales.dtype}, {rope.dtype}")
    if nope.shape[2] != kv_lora_rank:
        raise ValueError(f"tiled nope width {nope.shape[2]} differs from kv_lora_rank={kv_lora_rank}")
    if scales.shape[2] != kv_lora_rank // tile_width(kv_lora_rank):
        raise ValueError(f"expected {kv_lora_rank // tile_width(kv_lora_rank)} tile scales per token, "
                         f"got {scales.shape[2]}")


def _check_shapes(q_BQHC, latent_pages_PSC, page_table_BN, lengths_BQ, kv_lora_rank: int) -> None:
    if isinstance(latent_pages_PSC, TiledLatentPages):
        _check_tiled(latent_pages_PSC, kv_lora_rank)
    elif latent_pages_PSC.ndim == 3 and latent_pages_PSC.dtype not in fd.PAGE_DTYPES:
        raise ValueError(f"unsupported latent dtype {latent_pages_PSC.dtype}; expected one of {fd.PAGE_DTYPES}")
    if len(latent_pages_PSC.shape) != 3:
        raise ValueError(f"expected latent pages [P, S, C], got {latent_pages_PSC.shape}")
    if q_BQHC.dtype not in (jnp.bfloat16, jnp.float32):
        raise ValueError(f"q must be bf16 or f32, got {q_BQHC.dtype}")
    b, _, _, c = q_BQHC.shape
    latent_c = latent_pages_PSC.shape[2]
    if latent_c != c:
        raise ValueError(f"q width C={c} differs from latent width {latent_c}")
    if not 0 < kv_lora_rank <= c:
        raise ValueError(f"kv_lora_rank={kv_lora_rank} must be in (0, C={c}]")
    fd.check_paging(page_table_BN, lengths_BQ, b)


@functools.partial(jax.jit, static_argnames=("kv_lora_rank",))
def _reference(q_BQHC, latent_pages_PSC, page_table_BN, lengths_BQ, scale, softmax_scale, *,
               kv_lora_rank: int):
    """Gather the latents, dequantize to f32, masked softmax: the spec, in jnp -> (out float32, lse)."""
    b, _, _, c = q_BQHC.shape
    n = page_table_BN.shape[1]
    page_size = latent_pages_PSC.shape[1]
    valid_BQT = jnp.arange(n * page_size)[None, None, :] < lengths_BQ[:, :, None]
    if isinstance(latent_pages_PSC, TiledLatentPages):
        nope, scales, rope = (x[page_table_BN] for x in latent_pages_PSC)
        latent_BNSC = jnp.concatenate([dequantize_tiles(nope, scales), rope.astype(jnp.float32)], axis=-1)
    else:
        latent_BNSC = latent_pages_PSC[page_table_BN].astype(jnp.float32) * scale
    latent_BTC = latent_BNSC.reshape(b, n * page_size, c)
    # Slots past the length may hold stale NaN/Inf bits; 0 * NaN is NaN.
    latent_BTC = jnp.where(valid_BQT.any(1)[:, :, None], latent_BTC, 0.0)
    logits_BQHT = jnp.einsum("bqhc,btc->bqht", q_BQHC.astype(jnp.float32), latent_BTC,
                             precision=jax.lax.Precision.HIGHEST) * softmax_scale
    logits_BQHT = jnp.where(valid_BQT[:, :, None, :], logits_BQHT, -jnp.inf)
    # An empty request has all logits -inf; its output is defined as zeros.
    max_BQH = jnp.max(logits_BQHT, axis=-1, keepdims=True)
    p_BQHT = jnp.exp(logits_BQHT - jnp.where(jnp.isfinite(max_BQH), max_BQH, 0.0))
    sum_BQH = jnp.sum(p_BQHT, axis=-1, keepdims=True)
    out_BQHL = jnp.einsum("bqht,btl->bqhl", p_BQHT / jnp.where(sum_BQH > 0, sum_BQH, 1.0),
                          latent_BTC[..., :kv_lora_rank], precision=jax.lax.Precision.HIGHEST)
    lse_BQH = jnp.where(sum_BQH > 0, max_BQH + jnp.log(jnp.where(sum_BQH > 0, sum_BQH, 1.0)), -jnp.inf)[..., 0]
    return out_BQHL, lse_BQH


def _mla_kernel(q_ref, *refs, plan: fd.SplitPlan, page_size: int, kv_lora_rank: int, dot_dtype,
                tuning: fd.AttentionTuning, tiled: bool):
    """One (request, split) grid step.

    Refs: q [R, C] (R = Q * H padded, or a block of head_rows of them); the latent
    pages [P, S, C], or (tiled) nope [P, S, L], tile scales [P, S, L/tile] and rope
    [P, S, C - L]; the split's page ids [pages_per_split], lengths [1] or [R]
    (fd.row_lengths), logit scale [1]; outputs acc [R, L],
    max [R], sum [R].
    """
    page_refs, (slots_ref, length_ref, logit_scale_ref, acc_ref, max_ref, sum_ref) = refs[:-6], refs[-6:]
    rows, width = q_ref.shape
    rope_dim = width - kv_lora_rank
    block_tokens = plan.pages_per_block * page_size
    # Two power-of-two column views of the non-power-of-two latent width.
    views = (q_ref[:, pl.ds(0, kv_lora_rank)], q_ref[:, pl.ds(kv_lora_rank, rope_dim)]) if rope_dim else (q_ref[...],)
    scaled, unscale_R = fd.scaled_query(views, dot_dtype)
    q_RL, q_RR = scaled[0], (scaled[1] if rope_dim else None)
    logit_scale = fd.row_logit_scale(logit_scale_ref[0], unscale_R)

    def gather(pages, valid_T):
        if tiled:
            return tuple(fd.gather_pages(ref, pages, valid_T) for ref in page_refs)
        return tuple(fd.gather_pages(page_refs[0], pages, valid_T, start, size)
                     for start, size in ((0, kv_lora_rank), (kv_lora_rank, rope_dim)) if size)

    def logits_and_values(tiles):
        if tiled:  # exact: power-of-two tile scales times e4m3 values are bf16 values
            nope, scales, *rope = (t.reshape(block_tokens, -1) for t in tiles)
            latent_TL = dequantize_tiles(nope, scales, dot_dtype)
            rope = [r.astype(dot_dtype) for r in rope]
        else:  # exact dequantization; the scale is applied to the f32 logits and output
            latent_TL, *rope = (t.reshape(block_tokens, -1).astype(dot_dtype) for t in tiles)
        logits_RT = mma.dot_nt(q_RL, latent_TL)
        if rope:
            logits_RT += mma.dot_nt(q_RR, rope[0])
        return logits_RT * logit_scale, latent_TL

    state = fd.attend_split(slots_ref, length_ref[...], pl.program_id(1), page_size, plan,
                            rows, kv_lora_rank, gather, logits_and_values, tuning)
    fd.store_partial(state, acc_ref, max_ref, sum_ref, tuning)


@functools.partial(jax.jit, static_argnames=("kv_lora_rank", "interpret", "tuning", "return_lse"))
def _kernel(q_BQHC, latent_pages_PSC, page_table_BN, lengths_BQ, scale, softmax_scale, *,
            kv_lora_rank: int, interpret: bool, tuning: fd.AttentionTuning, return_lse: bool):
    """-> (out [B, Q, H, L], log-sum-exp [B, Q, H]); out in float32 with return_lse, else
    in q's dtype or float32 (the caller casts), and the log-sum-exp may be None."""
    b, nq, h, c = q_BQHC.shape
    # Query-major rows (row j * H + i is query token j's head i); more than head_rows run in
    # blocks of head_rows, each a request of its own over the same pages.
    blocks = fd.RowBlocks.of(nq * h, tuning.head_rows)
    rows, x = blocks.rows, b * blocks.blocks
    q_XRC = blocks.split(q_BQHC.reshape(b, nq * h, c), axis=1)
    lengths = blocks.lengths(lengths_BQ, h)
    tiled = isinstance(latent_pages_PSC, TiledLatentPages)
    pools = tuple(latent_pages_PSC) if tiled else (latent_pages_PSC,)
    page_table_XN, *pools = fd.cut_pages(blocks.table(page_table_BN), tuning.block_tokens, 0, *pools)
    page_size = pools[0].shape[1]
    plan = fd.plan_splits(page_table_XN.shape[1], page_size, x,
                          kv_bytes_per_token=latent_bytes_per_token(latent_pages_PSC),
                          partial_bytes=rows * (kv_lora_rank + 2) * 4, target_programs=TARGET_PROGRAMS,
                          tuning=tuning)
    # Tiled values are dequantized into the dot dtype: bf16 (f16 lacks the scales' range).
    dtype = fd.compute_dtype(q_BQHC.dtype, jnp.bfloat16 if tiled else pools[0].dtype, tuning)
    q_XRC = q_XRC.astype(fd.kernel_query_dtype(dtype, q_BQHC.dtype))
    slots_XYN, lengths = fd.split_page_table(page_table_XN, lengths, page_size, plan)
    logit_scale = (scale * softmax_scale).reshape(1)
    partials = pl.pallas_call(
        functools.partial(_mla_kernel, plan=plan, page_size=page_size, kv_lora_rank=kv_lora_rank,
                          dot_dtype=dtype, tuning=tuning, tiled=tiled),
        grid=(x, plan.num_splits),
        in_specs=[
            pl.BlockSpec((None, rows, c), lambda bi, xi: (bi, 0, 0)),
            *(pl.BlockSpec(p.shape, lambda bi, xi: (0, 0, 0)) for p in pools),
            pl.BlockSpec((None, None, plan.pages_per_split), lambda bi, xi: (bi, xi, 0)),
            fd.lengths_spec(lengths),
            pl.BlockSpec((1,), lambda bi, xi: (0,)),
        ],
        out_specs=fd.partial_specs(2, rows, kv_lora_rank),
        out_shape=fd.partial_shapes((x, plan.num_splits), rows, kv_lora_rank),
        compiler_params=fd.compiler_params(tuning, 8, dtype),
        interpret=interpret,
        name="paged_attention_mla",
    )(q_XRC, *pools, slots_XYN, lengths, logit_scale)
    if tuning.combine == "pallas":
        out_XRL, lse_XR = fd.combine_splits(*partials, rows=blocks.kept, scale_S=scale.reshape(1),
                                            out_dtype=jnp.float32 if return_lse else q_BQHC.dtype,
                                            with_lse=return_lse, interpret=interpret)
    else:
        out_XRL, lse_XR = fd.combine_partials(*partials)
        out_XRL, lse_XR = out_XRL[:, :blocks.kept] * scale, lse_XR[:, :blocks.kept]
    out_BQHL = blocks.join(out_XRL, axis=1).reshape(b, nq, h, kv_lora_rank)
    return out_BQHL, None if lse_XR is None else blocks.join(lse_XR, axis=1).reshape(b, nq, h)
