"""Weight-streaming matmuls: x [M, K] times a compressed weight that is read once.

The INT4 (int4_matmul.py) and FP8-block (fp8_block_matmul.py) kernels share
everything here and differ only in how one K block of the weight is loaded,
dequantized and multiplied (their `step`).

A work list of row tiles (TileSchedule) says which rows of x each tile
multiplies by which expert's weight: one expert for a dense matmul
(dense_rows), the experts with tokens for a grouped MoE matmul
(grouped_rows). The grid is (tile, column block, split-K part). Each program
loops over its share of the K blocks, adding each block's product to a
float32 accumulator, and stores it: the partial sum over its share of K
(summed by XLA afterwards), or the result in x's dtype when K is not split.
Small M splits K over extra programs, so that a 7168 x 2048 weight is
streamed by hundreds of programs, not 16.

A tile with no rows streams no weights, so in the decode case (few tokens,
many experts) idle experts cost no bandwidth.

With StreamTuning.swap_ab a program computes the transposed product,
acc_NM += w^T x^T, so that the dequantized weights are the MMA's first
operand. On sm_90 Triton then issues Hopper's warpgroup MMA (wgmma) with
that operand in registers, and only x goes through shared memory; in the
plain orientation a 64-row tile's wgmma reads the weights from shared memory,
so each step stores every dequantized weight there and fences before the MMA.
"""

import dataclasses
import functools
from typing import Callable, ClassVar, NamedTuple, Sequence

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import mma

_BLOCK_M_CAP = 64


@dataclasses.dataclass(frozen=True)
class StreamTuning:
    """Launch choices of a weight-streaming kernel; the result does not depend
    on them (tests/test_kernels_int4.py, tests/test_kernels_fp8_block.py).

    block_n / block_k: output columns per program / input features per inner
      step (capped by powers of two dividing N and K).
    num_warps: None takes 8 for 16-row tiles, else 4 (measured, see compiler_params).
    num_stages: weight blocks in flight.
    target_programs: split-K grows until the grid has about this many programs
      (2 per SM of an H100/H200's 132).
    swap_ab: accumulate the transposed product (module docstring). The INT4
      kernel's default (Int4Tuning, where the sm_90a counts are); the
      FP8-block kernel gets nothing from it: its weights reach the MMA's
      register layout through 128 byte permutes per step at M=64 (581
      instructions against 284). Not yet timed on a GPU.
    """

    block_n: int = 128
    block_k: int = 256
    num_warps: int | None = None
    num_stages: int = 2
    target_programs: int = 2 * 132
    swap_ab: bool = False
    MIN_BLOCK_K: ClassVar[int] = mma.MIN_DOT_ROWS

    def __post_init__(self):
        for name, least in (("block_n", mma.MIN_DOT_ROWS), ("block_k", self.MIN_BLOCK_K)):
            value = getattr(self, name)
            if value < least or value & (value - 1):
                raise ValueError(f"{type(self).__name__}.{name}={value} must be a power of two >= {least}")


def compiler_params(block_m: int, tuning: StreamTuning) -> plgpu.CompilerParams:
    """Triton launch parameters (ignored by the interpreter).

    Measured with the INT4 kernel on the H200 (CUPTI kernel time, K=7168
    N=2048 g=32; experiments/results/gpu_kernels_h200_2026-11-29_run2_cupti.md):
    16-row tiles (M=1) 11.6 us at 8 warps against 12.7 at 4; 64-row tiles
    (M=64) 19.4 us at 4 warps against 24.7 at 8 (sm_90a compiles: 168
    registers at 4 warps, no spills; experiments/results/sm90_compile.md).
    32-row tiles were not measured and follow the 64-row ones. Stages: 2
    weight blocks in flight measured faster than 3 on the H200 (2026-11-30
    sweep, experiments/results/gpu_kernels_h200_2026-11-30_run3.md): 10.6
    against 11.6 us at M=1, 16.5 against 19.7 at M=64 (at M=64, 3 stages
    need 148 KiB of shared memory, 1 program per SM; 2 need 98 KiB, 2 per SM).
    The FP8-block kernel takes the same choices, not yet measured on a GPU.
    """
    warps = tuning.num_warps or (8 if block_m <= 16 else 4)
    return plgpu.CompilerParams(num_warps=warps, num_stages=tuning.num_stages)


@dataclasses.dataclass(frozen=True)
class Tiling:
    block_m: int  # rows of x per tile (MMA rows: >= 16)
    out_rows: int  # rows stored per tile; < block_m only when the rest are zero
    block_n: int  # output columns per program
    block_k: int  # input features per inner step
    num_splits: int  # split-K programs per (tile, column block)
    tuning: StreamTuning  # for the launch parameters and format-specific choices

    def blocks_per_split(self, k: int) -> int:
        return k // self.block_k // self.num_splits


class TileSchedule(NamedTuple):
    """Work list: tile t multiplies x rows [start, start + block_m) by expert's weights.

    rows_W == 0 marks an unused tile: its programs skip the weight stream and
    write zeros.
    """

    expert_W: jax.Array  # int32
    start_W: jax.Array  # int32
    rows_W: jax.Array  # int32

    @property
    def num_tiles(self) -> int:
        return self.start_W.shape[0]


def tile_rows(rows: int) -> int:
    """Rows per tile for tiles that hold about `rows` rows."""
    return mma.padded_rows(rows, cap=_BLOCK_M_CAP)


def plan_tiling(block_m: int, out_rows: int, n: int, k: int, num_tiles: int, tuning: StreamTuning,
                caps: tuple[int, int] | None = None) -> Tiling:
    """Block sizes, and split-K wide enough for ~tuning.target_programs programs.
    caps: powers of two that block_k and block_n must also divide (a format's scale block).

    A K with no power-of-two divisor >= tuning.block_k gets a smaller block:
    the tiny test models' 32 and 64, and one device's share of a split
    weight, e.g. GLM-4.5's 1536 / 8 = 192 at TP8 (block 64: the INT4
    kernel's pair-order dots then contract 16, the MMA's minimum). Where its
    dots contract < 16 they run in float32 (mma._mma_operands): slower math,
    but no copy of the weights to pad K, which per call would cost more."""
    cap_k, cap_n = caps or (tuning.block_k, tuning.block_n)
    block_k = mma.pow2_divisor(k, min(tuning.block_k, cap_k))
    block_n = mma.pow2_divisor(n, min(tuning.block_n, cap_n))
    programs = num_tiles * (n // block_n)
    k_blocks = k // block_k
    wanted = -(-tuning.target_programs // programs)
    num_splits = max(d for d in range(1, k_blocks + 1) if k_blocks % d == 0 and d <= max(wanted, 1))
    return Tiling(block_m, out_rows, block_n, block_k, num_splits, tuning)


# make_step(x_ref, operand_refs, expert, start, rows, tiling) -> step(k_block, acc) -> acc:
# the format's inner loop body, built once per program. It adds tile_products to acc.
StepFactory = Callable[..., Callable[[jax.Array, jax.Array], jax.Array]]
# finish(operand_refs, expert, x_dtype) -> f(acc [rows, BN] float32) -> acc: what a format does to
# a program's sum before it is stored (NVFP4: its per-matrix scale). Linear, so it may act on each
# split-K partial.
Finish = Callable[..., Callable[[jax.Array], jax.Array]]


def tile_product(x_MQ: jax.Array, w_QN: jax.Array, tiling: Tiling) -> jax.Array:
    """x @ w in float32, in the accumulator's orientation: [BM, BN], or
    [BN, BM] = w^T x^T with tuning.swap_ab."""
    return mma.dot_tt(w_QN, x_MQ) if tiling.tuning.swap_ab else mma.dot_nn(x_MQ, w_QN)


def row_factor(f_M: jax.Array, tiling: Tiling) -> jax.Array:
    """A factor per row of x, shaped to multiply a tile_product."""
    return f_M[None, :] if tiling.tuning.swap_ab else f_M[:, None]


def _stream_kernel(expert_ref, start_ref, rows_ref, x_ref, *refs, make_step: StepFactory, tiling: Tiling,
                   blocks_per_split: int, finish: Finish | None):
    """One (tile, column block, split) program.

    Refs: expert/start/rows [1]; x (as the format's step reads it); the
    format's operands (weights, scales: one column block of each, or whole);
    out [BM', BN]: the f32
    partial sum over this split's K, or the result in x's dtype when there is
    one split.
    """
    *operand_refs, out_ref = refs
    rows = rows_ref[0]
    step = make_step(x_ref, operand_refs, expert_ref[0], start_ref[0], rows, tiling)
    first_block = pl.program_id(2) * blocks_per_split
    # An unused tile streams no weights (the decode case: most experts idle).
    # Arithmetic, not jnp.where(rows > 0, n, 0): the Triton lowering gave that
    # select a type other than the loop's lower bound, an scf.for that fails
    # verification on the GPU (caught by tests/test_kernels_int4.py).
    num_blocks = jnp.minimum(rows, 1) * blocks_per_split  # rows >= 0
    shape = (tiling.block_n, tiling.block_m) if tiling.tuning.swap_ab else (tiling.block_m, tiling.block_n)
    acc = jax.lax.fori_loop(0, num_blocks, lambda block, acc: step(first_block + block, acc),
                            jnp.zeros(shape, jnp.float32))
    acc_MN = acc.T if tiling.tuning.swap_ab else acc
    if tiling.out_rows < tiling.block_m:
        # Rows >= out_rows are exactly zero (zero-padded x): folding them onto
        # the first out_rows is exact, and at M = 1 it cuts the split-K partial
        # traffic 16x (Triton has no static value slice, but has reshape+sum).
        acc_MN = acc_MN.reshape(-1, tiling.out_rows, tiling.block_n).sum(axis=0)
    if finish is not None:
        acc_MN = finish(operand_refs, expert_ref[0], x_ref.dtype)(acc_MN)
    out_ref[...] = acc_MN.astype(out_ref.dtype)


def column_blocks(array: jax.Array, block_n: int) -> pl.BlockSpec:
    """Each program's view of a weight-shaped array [..., N]: its block_n output columns."""
    return pl.BlockSpec((*array.shape[:-1], block_n), lambda t, c, s: (0,) * (array.ndim - 1) + (c,))


def whole(array: jax.Array) -> pl.BlockSpec:
    return pl.BlockSpec(array.shape, lambda t, c, s: (0,) * array.ndim)


def stream_tiles(x_in: jax.Array, operands: Sequence[tuple[jax.Array, pl.BlockSpec]], schedule: TileSchedule,
                 tiling: Tiling, *, n: int, k: int, out_dtype, make_step: StepFactory, interpret: bool,
                 name: str, finish: Finish | None = None) -> jax.Array:
    """Runs the work list; returns [tiles, out_rows, N], split-K summed in f32,
    or in out_dtype straight from the kernel when there is one split.

    x_in reaches every program whole, in the form the format's step reads;
    operands (the weights, their scales, anything else the step reads) with
    their block specs; finish, the format's last step on each program's sum.
    """
    kernel_dtype = out_dtype if tiling.num_splits == 1 else jnp.float32
    scalar_spec = pl.BlockSpec((1,), lambda t, c, s: (t,))
    partial_XTMN = pl.pallas_call(
        functools.partial(_stream_kernel, make_step=make_step, tiling=tiling,
                          blocks_per_split=tiling.blocks_per_split(k), finish=finish),
        grid=(schedule.num_tiles, n // tiling.block_n, tiling.num_splits),
        in_specs=[scalar_spec, scalar_spec, scalar_spec, whole(x_in)] + [spec for _, spec in operands],
        out_specs=pl.BlockSpec((None, None, tiling.out_rows, tiling.block_n), lambda t, c, s: (s, t, 0, c)),
        out_shape=jax.ShapeDtypeStruct((tiling.num_splits, schedule.num_tiles, tiling.out_rows, n), kernel_dtype),
        compiler_params=compiler_params(tiling.block_m, tiling.tuning),
        interpret=interpret,
        name=name,
    )(schedule.expert_W, schedule.start_W, schedule.rows_W, x_in, *(array for array, _ in operands))
    return partial_XTMN[0] if tiling.num_splits == 1 else jnp.sum(partial_XTMN, axis=0)


# run(x_MK, schedule, block_m, out_rows, rows_read) -> [tiles, out_rows, N]: one format's call of
# stream_tiles. Tiles read x rows [start, start + block_m), all below rows_read: a format that
# reads whole tiles pads x to rows_read first.
TileRunner = Callable[[jax.Array, TileSchedule, int, int, int], jax.Array]


def dense_rows(x_MK: jax.Array, n: int, run: TileRunner) -> jax.Array:
    """y [M, N] in x's dtype: M rows in tiles of one weight (expert 0)."""
    m = x_MK.shape[0]
    if m == 0:
        return jnp.zeros((0, n), x_MK.dtype)
    block_m = tile_rows(m)
    num_tiles = -(-m // block_m)
    starts_W = jnp.arange(num_tiles, dtype=jnp.int32) * block_m
    schedule = TileSchedule(jnp.zeros((num_tiles,), jnp.int32), starts_W, jnp.minimum(m - starts_W, block_m))
    # Padding rows of x are zero, so their output rows are zero and a tile
    # may store only the first next_pow2(m) rows (see _stream_kernel).
    out_rows = min(block_m, pl.next_power_of_2(m))
    y_WMN = run(x_MK, schedule, block_m, out_rows, num_tiles * block_m)
    return y_WMN.reshape(-1, n)[:m].astype(x_MK.dtype)


class _RowOwner(NamedTuple):
    """Where row t of y lives in the kernel output [W, BM, N]."""

    tile_T: jax.Array  # int32 index into the work list
    offset_T: jax.Array  # int32 row within that tile
    assigned_T: jax.Array  # bool: False past sum(group_sizes)


def expert_tile_schedule(group_sizes_E: jax.Array, num_rows: int, block_m: int, num_tiles: int):
    """Work list of row tiles (only experts with rows get tiles) and each row's owner tile.

    Each expert with g rows gets ceil(g / BM) tiles starting at its first row
    (tiles are not aligned to BM, so a tile may read past the last row). The
    list is sized statically for the worst case; unused entries do nothing.
    """
    sizes_E = group_sizes_E.astype(jnp.int32)
    num_experts = sizes_E.shape[0]
    tiles_E = (sizes_E + block_m - 1) // block_m
    tile_end_E = jnp.cumsum(tiles_E)
    tile_begin_E = tile_end_E - tiles_E
    row_end_E = jnp.cumsum(sizes_E)
    row_begin_E = row_end_E - sizes_E

    tile_W = jnp.arange(num_tiles, dtype=jnp.int32)
    owner_W = jnp.searchsorted(tile_end_E, tile_W, side="right")  # == E when unused
    used_W = owner_W < num_experts
    expert_W = jnp.minimum(owner_W, num_experts - 1).astype(jnp.int32)
    first_row_W = (tile_W - tile_begin_E[expert_W]) * block_m
    schedule = TileSchedule(
        expert_W=expert_W,
        # Clamped so that a tile never reads past x's block_m rows of padding,
        # even when group sizes add up to more than T.
        start_W=jnp.where(used_W, jnp.minimum(row_begin_E[expert_W] + first_row_W, num_rows), 0),
        rows_W=jnp.where(used_W, jnp.clip(sizes_E[expert_W] - first_row_W, 0, block_m), 0),
    )

    row_T = jnp.arange(num_rows, dtype=jnp.int32)
    row_expert_T = jnp.searchsorted(row_end_E, row_T, side="right")
    assigned_T = row_expert_T < num_experts
    row_expert_T = jnp.minimum(row_expert_T, num_experts - 1)
    local_T = row_T - row_begin_E[row_expert_T]
    owner = _RowOwner(tile_begin_E[row_expert_T] + local_T // block_m, local_T % block_m, assigned_T)
    return schedule, owner


def grouped_rows(x_TK: jax.Array, group_sizes_E: jax.Array, n: int, run: TileRunner) -> jax.Array:
    """y [T, N] in x's dtype for expert-sorted rows, group_sizes_E rows per expert.

    The work list has ceil(T / BM) + min(E, T) entries, enough for any
    group sizes; each tile writes its own [BM, N] block (no two tiles write
    the same memory), and y gathers every row from the tile that owns it.
    Rows past sum(group_sizes_E) belong to no expert and are zero.
    """
    t = x_TK.shape[0]
    num_experts = group_sizes_E.shape[0]
    if t == 0:
        return jnp.zeros((0, n), x_TK.dtype)
    block_m = tile_rows(-(-t // num_experts))  # rows of an average expert
    num_tiles = -(-t // block_m) + min(num_experts, t)
    schedule, owner = expert_tile_schedule(group_sizes_E, t, block_m, num_tiles)
    y_tiles = run(x_TK, schedule, block_m, block_m, t + block_m)  # a tile may start at any row < T
    y_TN = y_tiles[owner.tile_T, owner.offset_T]
    return jnp.where(owner.assigned_T[:, None], y_TN, 0.0).astype(x_TK.dtype)


def pad_to(x_MK: jax.Array, rows: int) -> jax.Array:
    return jnp.pad(x_MK, ((0, rows - x_MK.shape[0]), (0, 0)))


def checked_group_sizes(group_sizes_E: jax.Array, num_experts: int) -> jax.Array:
    """group_sizes_E after its static checks, with negative sizes (traced: they cannot raise) as 0,
    so that the kernels and the references (lax.ragged_dot) read the same groups."""
    if group_sizes_E.shape != (num_experts,) or not jnp.issubdtype(group_sizes_E.dtype, jnp.integer):
        raise ValueError(f"group_sizes_E must be int [E={num_experts}], got {group_sizes_E.dtype}{group_sizes_E.shape}")
    return jnp.maximum(group_sizes_E, 0)


def check_activations(x_MK: jax.Array) -> None:
    if x_MK.ndim != 2:
        raise ValueError(f"x must be [M, K], got shape {x_MK.shape}")
    if x_MK.dtype not in (jnp.bfloat16, jnp.float32):
        raise ValueError(f"x must be bf16 or f32, got {x_MK.dtype}")


def reference_dot(x_MK: jax.Array, w_KN: jax.Array) -> jax.Array:
    """The references' product: float32 weights (dequantized exactly or nearly), x in float32, the
    dot at HIGHEST precision, cast to x's dtype."""
    y_MN = jnp.dot(x_MK.astype(jnp.float32), w_KN, precision=jax.lax.Precision.HIGHEST)
    return y_MN.astype(x_MK.dtype)


def reference_ragged_dot(x_TK: jax.Array, w_EKN: jax.Array, group_sizes_E: jax.Array) -> jax.Array:
    """reference_dot per expert group, with lax.ragged_dot."""
    y_TN = jax.lax.ragged_dot(x_TK.astype(jnp.float32), w_EKN, group_sizes_E.astype(jnp.int32),
                              precision=jax.lax.Precision.HIGHEST)
    return y_TN.astype(x_TK.dtype)
