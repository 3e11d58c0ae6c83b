"""Split-K ("flash-decoding") pieces shared by the paged attention kernels.

A decode step has one query token per request, so a grid over (request, head)
alone leaves most GPU SMs idle at small batch. Flash-decoding also splits each
request's pages into `num_splits` chunks processed by separate grid steps. Each
step runs an online softmax over its chunk and writes a partial
(acc, max, sum); `combine_partials` (XLA) or `combine_splits` (the same merge
as one Pallas kernel, AttentionTuning.combine) merges them afterwards.

Everything here is used inside Triton-lowered kernel bodies, so it sticks to
what the Pallas Triton lowering supports: power-of-two block shapes, 2-D dots,
elementwise math and reductions.
"""

import dataclasses
import functools
import math
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import mma

@dataclasses.dataclass(frozen=True)
class AttentionTuning:
    """Launch choices of the paged attention kernels; the result does not depend
    on them (tests/test_kernels_attention.py). Defaults: see experiments/gpu_kernels.py
    --sweep for how they were measured.

    block_tokens: tokens per inner step, a power of two >= 16 (so that every
      dot is at least one MMA tile). Pages larger than this are cut into
      sub-pages of block_tokens (cut_pages). MLA blocks of 128 tokens exceed
      the 227 KiB of shared memory a block may use: tiled FP8 pages at two
      stages need 232 KiB, float32 operands 300 KiB (the H200 refused that
      launch, 2026-11-30) or 324 KiB (offline sm_90a compile;
      experiments/sm90_compile.py --test-shapes checks the tests' choices).
    num_splits: split-K programs per request (None: about target_programs
      programs in all, plan_splits).
    target_programs: programs the split heuristic aims for (None: the
      kernel's own, measured on the H200, 2026-11-30 sweep,
      experiments/results/gpu_kernels_h200_2026-11-30_run3.md: GQA 512, the
      4 float16-dot programs per SM that sm_90a compiles allow at B=64
      (261 us against 339 at the earlier 264, both with float16 dots, for B=64 ctx=32k; 1.1x slower
      at B=1, 20.8 against 18.9 us); MLA 128, one wave of its 1 program per
      SM (1247 against 1491 us at B=64, 34.9 against 38.8 at B=1)).
    num_warps: None takes the kernel's own default (GQA 4, MLA 8).
    num_stages: software-pipelining depth of the page gathers.
    fp8_dots: operand dtype of the dots over FP8 pages with a bf16 query,
      "float16" or "bfloat16" (see compute_dtype). float16 measured faster on
      the H200 (2026-11-30) for both kernels at B=1 and B=64: GQA 339 against
      374 us, MLA 1491 against 1628 us (B=64 ctx=32k). Tiled pages always
      take bfloat16.
    partial_share: a split streams at least this many times the bytes of the
      partial it writes (plan_splits). It was 8 until the H200 showed small
      batches bound by blocks per program, not bytes: at B=1, MLA took 55-57
      us for 8 blocks per program whether the context was 4k (8 programs)
      or 32k (64 programs), and 31-38 us for 4 blocks per program (bf16 pages,
      sparse and dense); experiments/results/gpu_kernels_h200_2026-11-29_run2_cupti.md.
      At 1, B=1 splits down to 1-2 blocks per program; larger batches were
      already held to ~2 waves of programs. Not yet timed at 1.
    prefetch: carry the next block through the loop so that its loads
      overlap this block's math (see attend_split).
    swap_pv: compute the probabilities-times-values product transposed,
      acc^T [V, R] += values^T [V, T] p^T [T, R], so that its M side is the
      value width (GQA 128, MLA 512) rather than R query rows (16). Triton
      then runs it as Hopper's warpgroup wgmma (M >= 64) instead of mma.sync.
      sm_90a SASS at B=64 (experiments/results/sm90_sass.md), FP8 with
      float16 dots: with every block masked (branch_masks=False), GQA 578
      instructions per loop iteration against 679, MLA 997 against 1147,
      mostly the register moves (IMAD.MOV) that fed the zeroed values to
      mma.sync's operand fragments. With the masks in a branch, a block of
      valid tokens issues GQA 436 against 422 and MLA 703 against 694: the
      saving is gone. Not yet timed: off until a GPU sweep says.
    combine: how the split partials are merged: "xla" (combine_partials,
      XLA's reductions) or "pallas" (combine_splits, one kernel that reads
      each partial once and writes the scaled output in its final dtype).
      At B=1 ctx=32k on the H200 (run 4's log) the GQA call was 8.6 us of
      attention kernel and 12.9 us of small XLA kernels, three of them the
      merge's reductions (5.6 us): the partials of 512 one-block splits are
      half the bytes of the pages they summarize. Not yet timed.
    branch_masks: the masks of tokens past the length (-inf logits, zeroed
      stale values) sit in a branch that only a block holding such tokens
      takes (True), or are applied to every block (False: what the H200
      runs 1-4 timed). In sm_90a SASS at B=64 (results/sm90_sass.md, "fast path")
      a block of valid tokens then issues GQA 422 instructions per thread
      against 679 unbranched, MLA 694 against 1147, with float16 dots;
      registers 124 against 96 (GQA: 4 programs per SM instead of 5, the 4
      its 512-program target assumes) and 174 against 128 (MLA: 1 either
      way, bound by shared memory). Not yet timed.
    head_rows: MLA: the most query heads one program holds, a power of two
      >= 16. More heads run in blocks of this many, each its own program
      that reads the pages again. 16 holds Kimi's 8 heads per GPU at TP8;
      one program of 64 heads (decode context parallelism at 8 ways runs
      them all) compiles for sm_90a to 255 registers with 1204 B of spills
      and 180 KiB of shared memory (experiments/results/sm90_compile.md).
    gqa_rows: GQA: the most query rows (Q query tokens x G heads) one
      program holds, a power of two >= 16; more run in blocks of this many,
      each its own program that reads the pages again. For sm_90a at 4 warps
      (FP8, float16 dots, B=64): 16 rows (one token of GLM-4.x's 12 heads)
      124 registers, 64 (3-4 tokens) 201, 128 (6-8 tokens) 255 with 700 B of
      spills (experiments/results/sm90_compile_verify.md).
    """

    block_tokens: int = 64
    num_splits: int | None = None
    num_warps: int | None = None
    num_stages: int = 2
    fp8_dots: str = "float16"
    partial_share: int = 1
    prefetch: bool = False
    swap_pv: bool = False
    target_programs: int | None = None
    combine: str = "xla"
    branch_masks: bool = True
    head_rows: int = 16
    gqa_rows: int = 64

    def __post_init__(self):
        for name in ("block_tokens", "head_rows", "gqa_rows"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"{name} must be a power of two >= 16, got {value}")
        if self.fp8_dots not in ("bfloat16", "float16"):
            raise ValueError(f"fp8_dots must be 'bfloat16' or 'float16', got {self.fp8_dots!r}")
        if self.combine not in ("xla", "pallas"):
            raise ValueError(f"combine must be 'xla' or 'pallas', got {self.combine!r}")


def compiler_params(tuning: AttentionTuning, default_warps: int, dot_dtype) -> plgpu.CompilerParams:
    """Triton launch parameters (ignored by the interpreter).

    Defaults from sm_90a compiles without a GPU (experiments/results/sm90_compile*.md),
    at bf16 operands: 2 stages overlap the next page gather with the math. GQA fits
    4 warps in 96-128 registers; MLA's [16, 512] f32 accumulator and [64, 576]
    latent block spill at 4 warps (255 registers, up to 2 KB/thread) and fit
    at 8 (~170-205), so it asks for 8. float32 operands (exactness tests, not a
    serving format) double every block: MLA's two stages would need 312 KiB of
    shared memory (the launch fails above 227 KiB), so f32 always runs one
    stage at 8 warps (168 KiB).
    """
    if jnp.dtype(dot_dtype) == jnp.float32:
        return plgpu.CompilerParams(num_warps=8, num_stages=1)
    return plgpu.CompilerParams(num_warps=tuning.num_warps or default_warps, num_stages=tuning.num_stages)


PAGE_DTYPES = (jnp.bfloat16, jnp.float32, jnp.float8_e4m3fn, jnp.float8_e5m2)  # pages the decode kernels read


@dataclasses.dataclass(frozen=True)
class SplitPlan:
    """How the N page-table slots of a request are cut into grid steps."""

    pages_per_block: int  # pages gathered per inner-loop step (power of two)
    blocks_per_split: int  # inner-loop steps of one split
    num_splits: int  # grid extent of the split axis

    @property
    def pages_per_split(self) -> int:
        return self.pages_per_block * self.blocks_per_split


def plan_splits(num_slots: int, page_size: int, parallel_programs: int, *,
                kv_bytes_per_token: int, partial_bytes: int, target_programs: int,
                tuning: AttentionTuning = AttentionTuning()) -> SplitPlan:
    """Picks the split so that parallel_programs * num_splits fills the GPU
    (about tuning.target_programs programs, else the kernel's target_programs).

    Each split also writes a partial of partial_bytes (read again by the
    combine), so a split streams at least tuning.partial_share times that
    much KV cache.
    An explicit tuning.num_splits (tuning, tests) overrides the heuristic.
    """
    # Not capped by num_slots: a short table is padded instead, keeping the
    # token block >= 16 for the MMA.
    pages_per_block = max(1, tuning.block_tokens // page_size)
    num_blocks = -(-num_slots // pages_per_block)
    block_bytes = pages_per_block * page_size * kv_bytes_per_token
    min_blocks_per_split = -(-tuning.partial_share * partial_bytes // block_bytes)
    num_splits = tuning.num_splits
    if num_splits is None:
        wanted = -(-(tuning.target_programs or target_programs) // max(parallel_programs, 1))
        num_splits = min(wanted, num_blocks // min_blocks_per_split)
    num_splits = max(1, min(num_splits, num_blocks))
    blocks_per_split = -(-num_blocks // num_splits)
    # Re-derive so that no split is entirely past the page table.
    num_splits = -(-num_blocks // blocks_per_split)
    return SplitPlan(pages_per_block, blocks_per_split, num_splits)


def cut_pages(page_table_BN: jax.Array, block_tokens: int, page_axis: int,
              *pools: jax.Array) -> tuple[jax.Array, ...]:
    """(page table, *pools) with pages longer than block_tokens viewed as
    sub-pages of block_tokens tokens: sub-page i of page p is p * k + i, for
    k = page_size / block_tokens. The pools share the table and page size.

    A kernel block holds whole pages, so without this a 64-token MLA page
    would force 64-token blocks: 204 registers at 8 warps and one program per
    SM, against 100 registers and two per SM at 32 tokens (FP8, sm_90a,
    experiments/results/sm90_compile.md). The pool view is a free reshape;
    only the small table grows k-fold.
    """
    page_size = pools[0].shape[page_axis + 1]
    k = page_size // block_tokens
    if k <= 1:
        return page_table_BN, *pools
    b, n = page_table_BN.shape
    table_BNK = page_table_BN.astype(jnp.int32)[:, :, None] * k + jnp.arange(k, dtype=jnp.int32)
    return table_BNK.reshape(b, n * k), *(
        pool.reshape(*pool.shape[:page_axis], pool.shape[page_axis] * k, block_tokens, *pool.shape[page_axis + 2:])
        for pool in pools)


def split_page_table(page_table_BN: jax.Array, lengths_B: jax.Array, page_size: int,
                     plan: SplitPlan) -> tuple[jax.Array, jax.Array]:
    """Kernel inputs: page table [B, X, pages_per_split] and lengths [B].

    The table is padded with page 0: padding slots are only read inside a
    block that also holds valid tokens, and masked there. Lengths are clamped
    to the table's N * S tokens, so padding never counts as valid.
    """
    b, n = page_table_BN.shape
    padded = plan.num_splits * plan.pages_per_split
    table = jnp.pad(page_table_BN.astype(jnp.int32), ((0, 0), (0, padded - n)))
    lengths_B = jnp.clip(lengths_B.astype(jnp.int32), 0, n * page_size)
    return table.reshape(b, plan.num_splits, plan.pages_per_split), lengths_B


def compute_dtype(q_dtype, kv_dtype, tuning: AttentionTuning) -> jnp.dtype:
    """Operand dtype of the in-kernel dots; accumulation is always float32.

    fp8 (e4m3 and e5m2) and bf16 values are exactly representable in bf16, so
    casting pages to bf16 is an exact dequantization that keeps tensor-core
    speed; the per-tensor/per-head scale is applied to the f32 logits and the
    f32 output instead. Any float32 operand makes the whole dot float32.

    fp8 values are exact in float16 too, and on sm_90 e4m3 -> f16 is one
    packed unpack per two values, while e4m3 -> bf16 adds a scalar
    f16 -> bf16 conversion per value (128 F2F.BF16.F16 per thread per block
    in the GQA kernel's SASS; experiments/results/sm90_sass.md).
    tuning.fp8_dots="float16" runs the dots in f16: the query is scaled into
    f16's range first (scaled_query) and the probabilities are rounded to
    f16 (relative 2^-11 down to 2^-14, absolute 2^-25 below; bf16 rounds
    relative 2^-9).
    """
    q_dtype, kv_dtype = jnp.dtype(q_dtype), jnp.dtype(kv_dtype)
    if jnp.float32 in (q_dtype, kv_dtype):
        return jnp.dtype(jnp.float32)
    if tuning.fp8_dots == "float16" and kv_dtype.itemsize == 1:
        return jnp.dtype(jnp.float16)
    return jnp.dtype(jnp.bfloat16)


def kernel_query_dtype(dot_dtype, q_dtype) -> jnp.dtype:
    """The dtype q enters the kernel in: float16 dots scale it there first."""
    return jnp.dtype(q_dtype) if jnp.dtype(dot_dtype) == jnp.float16 else jnp.dtype(dot_dtype)


# Largest |q| after scaling lies in [2^14, 2^15): below f16's max (65504).
_F16_QUERY_EXPONENT = 14


def scaled_query(views_RX: tuple[jax.Array, ...], dot_dtype) -> tuple[tuple[jax.Array, ...], jax.Array | None]:
    """Column views of q [R, X_i] in the dot dtype, and per row the factor
    that undoes their scaling on the logits (None when q is only cast).

    float16 holds only |x| <= 65504, so each row is scaled by a power of two s
    that brings its largest entry (over all views) into [2^14, 2^15): exact (a
    bf16 value has 8 significant bits, f16 11) except for entries below 2^-28
    of the row's largest, which lose bits (f16 subnormals), a logit error
    under 2^-38 * max|q| * sum|k|. s and 1/s are built from exponent bits (no
    exp2/log2 rounding); a row whose largest entry is below 2^-112 gets
    1/s = 0, so its logits are 0 instead of below 2^-100.
    """
    if jnp.dtype(dot_dtype) != jnp.float16:
        return tuple(v.astype(dot_dtype) for v in views_RX), None
    views_RX = tuple(v.astype(jnp.float32) for v in views_RX)
    amax_R = functools.reduce(jnp.maximum, (jnp.max(jnp.abs(v), axis=1) for v in views_RX))
    exponent_R = (lax.bitcast_convert_type(amax_R, jnp.int32) >> 23) & 0xFF  # biased
    # s = 2^(14 - (exponent - 127)), as a biased exponent field in [1, 254].
    s_field_R = jnp.clip(_F16_QUERY_EXPONENT + 254 - exponent_R, 1, 254)
    s_R = lax.bitcast_convert_type(s_field_R << 23, jnp.float32)
    inverse_R = lax.bitcast_convert_type((254 - s_field_R) << 23, jnp.float32)
    return tuple((v * s_R[:, None]).astype(jnp.float16) for v in views_RX), inverse_R


def row_logit_scale(logit_scale: jax.Array, unscale_R: jax.Array | None) -> jax.Array:
    """The logit scale, times each row's unscaling factor from scaled_query."""
    return logit_scale if unscale_R is None else (logit_scale * unscale_R)[:, None]


class SoftmaxPartial(NamedTuple):
    """Online-softmax state for R query rows over the tokens seen so far."""

    acc: jax.Array  # f32 [R, V] (or [V, R] with swap_pv): sum_t exp(logit_t - max) * value_t
    max_R: jax.Array  # f32: running max logit (finite: finfo.min when empty)
    sum_R: jax.Array  # f32: sum_t exp(logit_t - max)


def empty_partial(rows: int, value_dim: int, swap_pv: bool) -> SoftmaxPartial:
    # A finite "minus infinity" keeps exp(max_a - max_b) NaN-free when a
    # split saw no tokens at all (empty request or split past its length).
    return SoftmaxPartial(
        jnp.zeros((value_dim, rows) if swap_pv else (rows, value_dim), jnp.float32),
        jnp.full((rows,), jnp.finfo(jnp.float32).min, jnp.float32),
        jnp.zeros((rows,), jnp.float32),
    )


def online_softmax_step(
    state: SoftmaxPartial, logits_RT: jax.Array, values_TV: jax.Array, valid_T: jax.Array,
    seen_RT: jax.Array, needs_mask: jax.Array | None, zero_values: bool, swap_pv: bool,
) -> SoftmaxPartial:
    """Folds one block of T tokens into the running state.

    seen_RT [1, T] or [R, T]: the tokens each row attends to; the others get
    probability exactly 0. valid_T: the tokens any row attends to. The values
    of the rest must be finite, since 0 * NaN would poison acc: loaded as
    zeros (gather_pages with a mask), or zeroed here (zero_values) when a
    stale slot was loaded as it is. values_TV is in the dot operand dtype; the
    probabilities are rounded to it for the tensor-core dot (as
    FlashAttention does) but summed in f32. swap_pv: state.acc is [V, R]
    (AttentionTuning.swap_pv).

    needs_mask: a scalar, true when some row does not see every token of the block. Only
    then are the masks applied, in a branch: a block of valid tokens (all
    but a request's last) skips them. None: masks every block, unbranched
    (AttentionTuning.branch_masks=False). In sm_90a SASS the masks are
    mostly the zeroing, a select and a byte permute per register of values
    (its two halves belong to different tokens): 64 + 64 per thread per block
    in the GQA kernel, 128 + 128 in MLA's.
    """
    def mask(logits_RT, values_TV):
        logits_RT = jnp.where(seen_RT, logits_RT, -jnp.inf)
        if zero_values:
            values_TV = jnp.where(valid_T[:, None], values_TV, jnp.zeros_like(values_TV))
        return logits_RT, values_TV

    if needs_mask is None:
        logits_RT, values_TV = mask(logits_RT, values_TV)
    else:
        logits_RT, values_TV = lax.cond(needs_mask, mask, lambda *tiles: tiles, logits_RT, values_TV)
    max_R = jnp.maximum(state.max_R, jnp.max(logits_RT, axis=1))
    rescale_R = jnp.exp(state.max_R - max_R)
    p_RT = jnp.exp(logits_RT - max_R[:, None])
    rounded_RT = p_RT.astype(values_TV.dtype)
    if swap_pv:
        acc = state.acc * rescale_R[None, :] + mma.dot_tt(values_TV, rounded_RT)
    else:
        acc = state.acc * rescale_R[:, None] + mma.dot_nn(rounded_RT, values_TV)
    sum_R = state.sum_R * rescale_R + jnp.sum(p_RT, axis=1)
    return SoftmaxPartial(acc, max_R, sum_R)


def attend_split(
    slots_ref, lengths: jax.Array, split: jax.Array, page_size: int, plan: SplitPlan,
    rows: int, value_dim: int, gather: Callable, logits_and_values: Callable, tuning: AttentionTuning,
) -> SoftmaxPartial:
    """Online softmax over the token blocks of one split of one request.

    lengths: [1], the tokens every row attends to, or [R], each row its own
    (several query tokens of a request, each seeing the cache up to itself:
    speculative verification, see row_lengths). The rows share the value
    tiles, zeroed only past the longest row: a NaN value of a token some row
    sees (a NaN activation; FP8 writes saturate) reaches every row of the
    request (probability 0 times NaN), where one row per token would keep it
    to the rows that see the token. slots_ref holds this split's
    page ids. gather(pages, valid_T) loads
    those pages as stored (gather_pages; valid_T None: a plain load), and
    logits_and_values(tiles) turns them into (logits [R, T] f32, values [T, V]).
    The loop stops at the request's last page, so blocks past the length cost
    no HBM traffic.
    One loop runs every block; the masks sit in a branch inside it, which
    only a block holding tokens past the shortest row's length takes
    (online_softmax_step's needs_mask). An unmasked loop over full blocks plus a masked tail loop
    measured slower on the H200 than one loop masking every block (FP8 GQA
    B=64 ctx=32k 420 vs 357 us, MLA 1957 vs 1657 us;
    experiments/results/gpu_kernels_h200_2026-11-29_run2_cupti.md); the
    branch keeps one loop and one copy of the body. Not yet timed.

    tuning.prefetch (AttentionTuning.prefetch): Triton's pipeliner, given the
    page-table indirection, keeps one buffer per block and issues the next
    block's copy at the end of the loop body, right before the wait at the
    top, so a program never computes while its own loads are in flight
    (sm_90a SASS, experiments/results/sm90_sass.md). With prefetch the loop
    carries the next block as loaded values and the page ids of the one after
    it: block i + 1 is requested before block i's math, and its page ids one
    iteration earlier still, so neither load waits on the other. These loads
    are masked per token (stale slots read as zeros, nothing read past the
    split's last block), which also spares zeroing the values in registers.
    """
    per_row = lengths.shape[0] > 1
    length = jnp.max(lengths) if per_row else lengths[0]  # the longest row's
    shortest = jnp.min(lengths) if per_row else length
    first_slot = split * plan.pages_per_split
    used_slots = (length + page_size - 1) // page_size - first_slot
    num_blocks = jnp.clip(
        (used_slots + plan.pages_per_block - 1) // plan.pages_per_block, 0, plan.blocks_per_split)
    block_tokens = plan.pages_per_block * page_size

    def pages_of(block):
        # Clamped into this split's slots: a prefetch past the last block
        # reads valid page ids, and its gather is masked off.
        block = jnp.clip(block, 0, plan.blocks_per_split - 1)
        return slots_ref[pl.ds(block * plan.pages_per_block, plan.pages_per_block)]

    def first_token(block):
        return (first_slot + block * plan.pages_per_block) * page_size

    def tokens_of(block):
        return first_token(block) + jnp.arange(block_tokens)

    def valid_tokens(block):
        return tokens_of(block) < length

    def fold(block, tiles, state):
        logits_RT, values_TV = logits_and_values(tiles)
        tokens_T = tokens_of(block)
        seen_RT = tokens_T[None, :] < (lengths[:, None] if per_row else length)
        # Loaded unmasked (no prefetch): the stale values are zeroed in registers.
        return online_softmax_step(state, logits_RT, values_TV, valid_tokens(block), seen_RT,
                                   needs_mask=first_token(block) + block_tokens > shortest if tuning.branch_masks else None,
                                   zero_values=not tuning.prefetch, swap_pv=tuning.swap_pv)

    empty = empty_partial(rows, value_dim, tuning.swap_pv)
    if not tuning.prefetch:
        return lax.fori_loop(0, num_blocks, lambda block, state: fold(block, gather(pages_of(block), None), state),
                             empty)

    def body(block, carry):
        state, tiles, next_pages = carry
        # The clamped ids of a block past the split may hold tokens < length
        # (the next split's): the block test keeps them unread.
        next_tiles = gather(next_pages, valid_tokens(block + 1) & (block + 1 < num_blocks))
        return fold(block, tiles, state), next_tiles, pages_of(block + 2)

    first = (empty, gather(pages_of(0), valid_tokens(0) & (num_blocks > 0)), pages_of(1))
    return lax.fori_loop(0, num_blocks, body, first)[0]


def gather_pages(pages_ref, pages: jax.Array, valid_T: jax.Array | None, start: int = 0,
                 size: int | None = None) -> jax.Array:
    """pages_ref[pages, :, start:start + size] as stored [pages, S, size].

    valid_T [T = pages * S] bool, or None for a plain load: the tokens not
    valid are zero and unread. A stale slot may hold NaN/Inf bit patterns
    (fp8 e4m3fn has a NaN encoding), and a value row of NaN poisons the
    output even at probability 0.

    The masked load indexes every axis by an array (not a slice): that is the
    form of masked gather both the Triton lowering and the interpreter accept.
    """
    _, page_size, width = pages_ref.shape
    size = width - start if size is None else size
    if valid_T is None:
        return pages_ref[pages, :, pl.ds(start, size)]
    index = (pages[:, None, None], jnp.arange(page_size)[None, :, None], start + jnp.arange(size)[None, None, :])
    shape = (pages.shape[0], page_size, size)
    mask = jnp.broadcast_to(valid_T.reshape(pages.shape[0], page_size, 1), shape)
    return plgpu.load(pages_ref.at[index], mask=mask, other=jnp.zeros(shape, pages_ref.dtype))


def store_partial(state: SoftmaxPartial, acc_ref, max_ref, sum_ref, tuning: AttentionTuning) -> None:
    """Writes the partial with acc as [R, V], whatever the orientation it was accumulated in."""
    acc_ref[...] = state.acc.T if tuning.swap_pv else state.acc
    max_ref[...] = state.max_R
    sum_ref[...] = state.sum_R


def partial_shapes(lead: tuple[int, ...], rows: int, value_dim: int) -> list[jax.ShapeDtypeStruct]:
    """Output shapes of (acc, max, sum) for grid axes `lead` (split axis last)."""
    return [
        jax.ShapeDtypeStruct((*lead, rows, value_dim), jnp.float32),
        jax.ShapeDtypeStruct((*lead, rows), jnp.float32),
        jax.ShapeDtypeStruct((*lead, rows), jnp.float32),
    ]


def partial_specs(num_lead: int, rows: int, value_dim: int) -> list[pl.BlockSpec]:
    """One (acc, max, sum) block per grid step; the grid is exactly `lead`."""
    lead = (None,) * num_lead
    return [
        pl.BlockSpec((*lead, rows, value_dim), lambda *grid_ids: (*grid_ids, 0, 0)),
        pl.BlockSpec((*lead, rows), lambda *grid_ids: (*grid_ids, 0)),
        pl.BlockSpec((*lead, rows), lambda *grid_ids: (*grid_ids, 0)),
    ]


def combine_partials(acc_XRV: jax.Array, max_XR: jax.Array, sum_XR: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Merges split partials -> (softmax output [..., R, V], its log-sum-exp [..., R]).

    The split axis is the last axis before R (as written by `partial_specs`);
    any batch axes come before it. A request with no tokens has sum 0 in every
    split and gets output 0 rather than 0/0, and log-sum-exp -inf. The
    log-sum-exp lets outputs over disjoint token sets merge exactly
    (merge_over_axis).
    """
    acc_XRV, max_XR, sum_XR = (jnp.moveaxis(x, n, 0) for x, n in ((acc_XRV, -3), (max_XR, -2), (sum_XR, -2)))
    max_R = jnp.max(max_XR, axis=0)
    weight_XR = jnp.exp(max_XR - max_R[None])
    sum_R = jnp.sum(sum_XR * weight_XR, axis=0)
    acc_RV = jnp.sum(acc_XRV * weight_XR[..., None], axis=0)
    lse_R = jnp.where(sum_R > 0, max_R + jnp.log(jnp.where(sum_R > 0, sum_R, 1.0)), -jnp.inf)
    return acc_RV / jnp.where(sum_R > 0, sum_R, 1.0)[..., None], lse_R


# Partial values one combine program holds per step (32 per thread at 4 warps);
# the programs its column blocks aim for (about 2 per SM of an H200), in
# blocks of at least 16 columns (64 bytes: two whole 32-byte memory sectors).
_COMBINE_TILE = 4096
_COMBINE_PROGRAMS = 256
_COMBINE_MIN_COLUMNS = 16


def combine_splits(acc_XRV: jax.Array, max_XR: jax.Array, sum_XR: jax.Array, *, rows: int, scale_S: jax.Array,
                   out_dtype, with_lse: bool, interpret: bool) -> tuple[jax.Array, jax.Array | None]:
    """combine_partials as one Pallas kernel, for the first `rows` rows, times a scale.

    acc [..., X, R, V], max and sum [..., X, R] as the attention kernels write
    them (lead axes first); scale_S [S]: lead entry i (flattened) takes scale
    i % S, so S is 1 (per tensor) or the last lead axis (GQA: per KV head).
    Returns (out [..., rows, V] in out_dtype, log-sum-exp [..., rows] or None).

    One program per (lead entry, row, block of V columns). It reads the row's
    X maxima and sums once, then the acc columns in chunks of splits, each
    weighted by exp(max_x - max): every partial is read once, and the output
    is written scaled and in its final dtype, so nothing follows the kernel.
    X need not be a power of two: loads are masked to the X splits.
    """
    *lead, splits, padded_rows, v = acc_XRV.shape
    num_lead = math.prod(lead)
    v_block = v
    while v_block > _COMBINE_MIN_COLUMNS and num_lead * rows * (v // v_block) < _COMBINE_PROGRAMS:
        v_block //= 2
    x_block = min(pl.next_power_of_2(splits), max(1, _COMBINE_TILE // v_block))
    grid = (num_lead, rows, v // v_block)
    out_specs = [pl.BlockSpec((None, None, v_block), lambda i, r, c: (i, r, c))]
    out_shape = [jax.ShapeDtypeStruct((num_lead, rows, v), out_dtype)]
    if with_lse:  # every column block of a row writes the same value
        out_specs.append(pl.BlockSpec((None, None, 1), lambda i, r, c: (i, r, 0)))
        out_shape.append(jax.ShapeDtypeStruct((num_lead, rows, 1), jnp.float32))
    whole = lambda x: pl.BlockSpec(x.shape, lambda i, r, c: (0,) * x.ndim)
    partials = (acc_XRV.reshape(num_lead, splits, padded_rows, v),
                *(x.reshape(num_lead, splits, padded_rows) for x in (max_XR, sum_XR)))
    outs = pl.pallas_call(
        functools.partial(_combine_kernel, splits=splits, x_block=x_block, v_block=v_block),
        grid=grid,
        in_specs=[*(whole(x) for x in partials), pl.BlockSpec((1,), lambda i, r, c: (i % scale_S.shape[0],))],
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret,
        name="combine_splits",
    )(*partials, scale_S.astype(jnp.float32))
    out = outs[0].reshape(*lead, rows, v)
    return out, (outs[1].reshape(*lead, rows) if with_lse else None)


def _combine_kernel(acc_ref, max_ref, sum_ref, scale_ref, out_ref, *lse_ref, splits: int, x_block: int,
                    v_block: int):
    """One (lead entry, row, column block) of combine_splits.

    Refs: acc [lead entries, X, R, V], max and sum [lead entries, X, R]
    whole; scale [1]; out [v_block]; lse [1] when asked for.
    """
    lead, row = pl.program_id(0), pl.program_id(1)
    columns_V = pl.program_id(2) * v_block + jnp.arange(v_block)

    def load_row(ref, x_X, other):
        return plgpu.load(ref.at[lead, x_X, row], mask=x_X < splits, other=jnp.full(x_X.shape, other, jnp.float32))

    # A split past the partials weighs 0: its max is finfo.min, like an empty split's.
    max_all = jnp.max(load_row(max_ref, jnp.arange(pl.next_power_of_2(splits)), jnp.finfo(jnp.float32).min))

    def add_chunk(chunk, carry):
        acc_V, sum_ = carry
        x_X = chunk * x_block + jnp.arange(x_block)
        weight_X = jnp.exp(load_row(max_ref, x_X, jnp.finfo(jnp.float32).min) - max_all)
        mask_XV = jnp.broadcast_to((x_X < splits)[:, None], (x_block, v_block))
        acc_XV = plgpu.load(acc_ref.at[lead, x_X[:, None], row, columns_V[None, :]], mask=mask_XV,
                            other=jnp.zeros((x_block, v_block), jnp.float32))
        return (acc_V + jnp.sum(acc_XV * weight_X[:, None], axis=0),
                sum_ + jnp.sum(load_row(sum_ref, x_X, 0.0) * weight_X))

    chunks = -(-splits // x_block)
    acc_V, sum_ = lax.fori_loop(0, chunks, add_chunk, (jnp.zeros((v_block,), jnp.float32), jnp.float32(0)))
    # An empty row (sum 0) gets output 0 and log-sum-exp -inf, as in combine_partials.
    out_ref[...] = (acc_V * (scale_ref[0] / jnp.where(sum_ > 0, sum_, 1.0))).astype(out_ref.dtype)
    if lse_ref:
        lse = jnp.where(sum_ > 0, max_all + jnp.log(jnp.where(sum_ > 0, sum_, 1.0)), -jnp.inf)
        lse_ref[0][...] = jnp.full((1,), lse, jnp.float32)


def merge_over_axis(out_RV: jax.Array, lse_R: jax.Array, axis_name: str) -> jax.Array:
    """Inside shard_map: softmax outputs over disjoint token sets, one per device along
    axis_name, merged into the output over their union (float32). Rows empty on every device get 0."""
    top_R = lax.pmax(lse_R, axis_name)
    weight_R = jnp.exp(lse_R - jnp.where(jnp.isfinite(top_R), top_R, 0.0))  # exp(-inf) = 0: an empty share
    total_R = lax.psum(weight_R, axis_name)
    merged_RV = lax.psum(out_RV.astype(jnp.float32) * weight_R[..., None], axis_name)
    return merged_RV / jnp.where(total_R > 0, total_R, 1.0)[..., None]


def query_tokens(q: jax.Array, lengths: jax.Array, name: str) -> tuple[jax.Array, jax.Array]:
    """An op's (q, lengths) as [B, Q, H, D] and [B, Q]: q [B, H, D] with lengths [B] is one query
    token per request (Q = 1); q [B, Q, H, D] with lengths [B, Q] is Q query tokens per request
    over its one page table, query j seeing the first lengths[b, j] tokens (speculative
    verification: the last token and its drafts, each up to itself, as FlashMLA's seqlen_q)."""
    if q.ndim == 3 and lengths.ndim == 1:
        q, lengths = q[:, None], lengths[:, None]
    if q.ndim not in (3, 4):
        raise ValueError(f"expected {name} [B, H, D] or [B, Q, H, D], got {q.shape}")
    if q.ndim == 3 or lengths.shape != q.shape[:2]:
        raise ValueError(f"lengths_B must be [B] for {name} [B, H, D], or [B, Q] for {name} [B, Q, H, D]; "
                         f"got {lengths.shape} for {name} {q.shape}")
    if q.shape[1] == 0:
        raise ValueError(f"{name} [B, Q, H, D] needs at least one query token per request, got {q.shape}")
    return q, lengths


def row_lengths(lengths_BQ: jax.Array, heads: int, rows: int) -> jax.Array:
    """Kernel lengths [B] (one query token) or [B, R] per query row, for rows laid out
    query-major (row j * heads + h is query j's head h). The padding rows (their outputs are
    dropped) take the last query's length, so that they change neither the shortest row's
    length nor the longest of a block they share with it (attend_split): a length of 0 would
    send every block into the masked branch, the request's longest would make a block of
    queries that see nothing (an MLA head block) stream pages."""
    b, q = lengths_BQ.shape
    if q == 1:
        return lengths_BQ[:, 0]
    return jnp.concatenate([jnp.repeat(lengths_BQ, heads, axis=1),
                            jnp.broadcast_to(lengths_BQ[:, -1:], (b, rows - q * heads))], axis=1)


class RowBlocks(NamedTuple):
    """How a request's real query rows are laid into programs of at most `cap` rows: `blocks`
    programs of `rows` rows each (a power of two), of which the combine keeps the first `kept`."""

    real: int
    blocks: int
    rows: int

    @classmethod
    def of(cls, real_rows: int, cap: int) -> "RowBlocks":
        if real_rows <= cap:
            return cls(real_rows, 1, mma.padded_rows(real_rows))
        return cls(real_rows, -(-real_rows // cap), cap)

    @property
    def kept(self) -> int:
        """Rows per program that join keeps: a lone program's real rows, or every row of several
        (the last one's padding is cut after the rejoin)."""
        return self.rows if self.blocks > 1 else self.real

    def split(self, x_BR, axis: int):
        """x [B, ..., real rows (at axis), ...] -> [B * blocks, ..., rows, ...], padded with zeros."""
        pad = [(0, 0)] * x_BR.ndim
        pad[axis] = (0, self.blocks * self.rows - self.real)
        x = jnp.pad(x_BR, pad)
        x = x.reshape(*x.shape[:axis], self.blocks, self.rows, *x.shape[axis + 1:])
        return jnp.moveaxis(x, axis, 1).reshape(-1, *x.shape[1:axis], self.rows, *x.shape[axis + 2:])

    def join(self, x_XR, axis: int):
        """split's inverse on the kept rows: [B * blocks, ..., kept, ...] -> [B, ..., real rows, ...]."""
        x = x_XR.reshape(-1, self.blocks, *x_XR.shape[1:])
        x = jnp.moveaxis(x, 1, axis)
        x = x.reshape(*x.shape[:axis], self.blocks * self.kept, *x.shape[axis + 2:])
        return jax.lax.slice_in_dim(x, 0, self.real, axis=axis)

    def lengths(self, lengths_BQ: jax.Array, heads: int) -> jax.Array:
        """row_lengths per program: [B * blocks] (one query token) or [B * blocks, rows]."""
        lengths = row_lengths(lengths_BQ, heads, self.blocks * self.rows)
        return lengths.reshape(-1, self.rows) if lengths.ndim == 2 else jnp.repeat(lengths, self.blocks)

    def table(self, page_table_BN: jax.Array) -> jax.Array:
        """Each program's page table: its request's."""
        return page_table_BN if self.blocks == 1 else jnp.repeat(page_table_BN, self.blocks, axis=0)


def lengths_spec(lengths: jax.Array) -> pl.BlockSpec:
    """The block of row_lengths' output a (request, ...) grid step reads: [1] or [R]."""
    if lengths.ndim == 1:
        return pl.BlockSpec((1,), lambda b, *rest: (b,))
    return pl.BlockSpec((None, lengths.shape[1]), lambda b, *rest: (b, 0))


def check_paging(page_table_BN: jax.Array, lengths_B: jax.Array, batch: int) -> None:
    """Static checks of the page table and lengths ([B], or [B, Q] per query token) shared by both ops."""
    if page_table_BN.ndim != 2 or page_table_BN.shape[0] != batch:
        raise ValueError(f"page_table_BN must be [B={batch}, N], got {page_table_BN.shape}")
    if not jnp.issubdtype(page_table_BN.dtype, jnp.integer):
        raise ValueError(f"page_table_BN must be integer, got {page_table_BN.dtype}")
    if page_table_BN.shape[1] == 0:
        raise ValueError("page_table_BN has no columns: give each request at least one page slot")
    if lengths_B.ndim not in (1, 2) or lengths_B.shape[0] != batch or not jnp.issubdtype(lengths_B.dtype, jnp.integer):
        raise ValueError(f"lengths_B must be int [B={batch}] (or [B, Q]), got {lengths_B.dtype}{lengths_B.shape}")


def check_kernel_page_size(page_size: int) -> None:
    """The kernels (not the references) load whole pages: Triton needs 2^n."""
    if page_size & (page_size - 1):
        raise ValueError(f"the Pallas kernels need a power-of-two page size (Triton blocks), got {page_size}")

