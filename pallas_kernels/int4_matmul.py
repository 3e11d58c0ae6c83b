"""W4A16 matmul: bf16 activations times group-quantized signed INT4 weights.

Packed layout (fixed; other code depends on it):
  packed_QN int32 [K/8, N], Q = K/8. For k = 8*i + j, weight value[k, n]
  is stored as the unsigned nibble value + 8 (0..15, so value in [-8, 7]) in
  bits 4j..4j+3 of packed[i, n]: the low nibble holds the lowest k.
  scales_GN [K/group_size, N] bf16 or f32:
      weight[k, n] = value[k, n] * scales[k // group_size, n].
  This is exactly the transpose of compressed-tensors "pack-quantized"
  (weight_packed int32 [N, K/8], same nibble order along K; weight_scale
  [N, K/group]); see from_compressed_tensors / to_compressed_tensors.
  Expert-batched weights add a leading axis: [E, K/8, N] and [E, K/g, N].

Kernel strategy (Triton-style, no in-kernel interleave): a dot may contract
K in any order, as long as x is permuted the same way. Nibbles j and j + 4 of a
word sit 16 bits apart, so one shift and one mask put both into the two bf16
halves of an int32 (_dequantize_pairs: no int -> float conversion), and the
kernel contracts K in that pair order: for j in 0..3, the [2Q, N] matrix
w_j[2i + h, n] = weight[8i + j + 4h, n] pairs with x permuted once outside
the kernel, x_pairs[j, m, 2i + h] = x[m, 8i + j + 4h] (cheap: x is tiny next
to the weights). The block product is the sum of 4 dots [BM, BK/4] x
[BK/4, BN]. Two k that are neighbours in this order are the two halves of one
register, which is how the MMA wants its operand (consecutive k in a
register): the dequantized int32 is the MMA's operand with no byte permutes
(sm_90a, M=64, x w: 1111 instructions per step with 8 stride-8 planes,
whose neighbouring k came from two words; 982 in pair order;
experiments/results/sm90_sass.md). Each packed row i lies in one group,
i // (group_size/8), so one scale serves both halves; a block's scale rows
are loaded once each, repeated per packed row in registers
(_scale_row_loader), and applied before the bf16 tensor-core dot. The
products accumulate in float32. (With Int4Tuning.gather_x the kernel reads
x's columns in pair order itself, instead of taking x permuted.)

Why Triton-backed Pallas: the weight is streamed once as int32 (4x fewer bytes
than bf16), unpacked with shifts/masks in registers, and fed to MMA; the MoE
variant (moe_int4_matmul.py) picks each tile's expert from a work list with a
dynamic index into the expert axis, which Triton lowers to pointer arithmetic.
The work list, split-K and grid are weight_stream.py's, shared with the
FP8-block kernel; this file holds the INT4 format and its inner step. (Mosaic GPU has a Hopper
mixed-type matmul, built around 64-row warpgroup tiles and TMA layouts. The
choice of Triton rested on the op being bound by streaming the weights; on
the H200 (2026-11-29) it was not: at M=1 the kernel ran at 15% of copy
bandwidth with its issue slots mostly idle, waiting on latency. What that
costs, and why the M=1 goal may need a hand-scheduled (Mosaic GPU) kernel:
experiments/results/gpu_kernels_h200_2026-11-29_notes.md.)
"""

import dataclasses
import functools
from typing import Callable, ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import mma
from pallas_kernels.backend import resolve_backend
from pallas_kernels.weight_stream import (
    StreamTuning, TileRunner, TileSchedule, Tiling, check_activations, column_blocks, dense_rows, pad_to, plan_tiling,
    reference_dot, stream_tiles, tile_product, whole)

PACK = 8  # int4 values per int32
_NIBBLE_SHIFTS = np.arange(PACK, dtype=np.uint32) * 4  # numpy: no device work at import
# Each pair-order dot contracts block_k / 4; Triton's MMA needs 16.
PAIR_DOTS = PACK // 2
MIN_BLOCK_K = PAIR_DOTS * mma.MIN_DOT_ROWS


@dataclasses.dataclass(frozen=True)
class Int4Tuning(StreamTuning):
    """The launch choices of weight_stream.StreamTuning, for the INT4 kernels.
    Measured: experiments/gpu_kernels.py --sweep.

    block_k >= 64, so that each pair-order dot contracts Triton's minimum of 16.
    target_programs: sm_90a compiles at 3 stages fit 3 programs per SM at
      M=1 and 1 at M=64, 2 at M=64 with 2 stages, 5 and 3 at block_k=128
      (experiments/results/sm90_compile.md; before the pair order).
    swap_ab: on by default for INT4. In pair order the dequantized int32s are
      the wgmma's register operand as they stand. sm_90a compiles
      (experiments/results/sm90_sass.md, 2026-12-01) issue no more
      instructions per step than the 8-plane kernel's default did at any
      shape compiled, and fewer at most: M=1 489 against 519, M=32 951
      against 1030, M=64 984 against 1111, MoE T=64 514 against 515, T=2048
      984 against 1100; no shared-memory stores of weights. (Pair order
      without swap_ab: M=1 591, its mma.sync operands taking 101 register
      moves.) Registers at M=1: 92, 2 programs per SM, which still runs the
      224 programs of the Kimi K2 expert shape in one wave. Not yet timed on
      a GPU; the sweep times swap_ab=False beside it.
    gather_x: the kernel reads x's pair-order columns itself, with a gather
      masked to the tile's rows, instead of x permuted by an XLA op
      beforehand. No permute and no row padding, so a call that also needs
      no split-K (target_programs <= N / block_n) is one kernel, which writes
      x's dtype directly. The gather costs loads that are not vectorized
      (neighbouring columns are 4 elements apart). Not yet timed.
    """

    gather_x: bool = False
    swap_ab: bool = True
    MIN_BLOCK_K: ClassVar[int] = MIN_BLOCK_K


def pack_nibbles(nibbles_KN: jax.Array) -> jax.Array:
    """4-bit codes (0..15), [..., K, N] -> int32 [..., K/8, N], the low nibble holding the lowest k."""
    *lead, k, n = nibbles_KN.shape
    if k % PACK:
        raise ValueError(f"K={k} must be a multiple of {PACK} to pack 4-bit values into int32")
    nibbles = nibbles_KN.astype(jnp.uint32) & 15
    nibbles = nibbles.reshape(*lead, k // PACK, PACK, n) << _NIBBLE_SHIFTS[:, None]
    # Disjoint bit fields: the sum is the bitwise OR.
    return jax.lax.bitcast_convert_type(jnp.sum(nibbles, axis=-2, dtype=jnp.uint32), jnp.int32)


def unpack_nibbles(packed_QN: jax.Array) -> jax.Array:
    """int32 [..., K/8, N] -> the 4-bit codes, uint8 [..., K, N]."""
    *lead, q, n = packed_QN.shape
    bits = jax.lax.bitcast_convert_type(packed_QN, jnp.uint32)[..., :, None, :]
    return ((bits >> _NIBBLE_SHIFTS[:, None]) & 15).astype(jnp.uint8).reshape(*lead, q * PACK, n)


def pack_int4(values_KN: jax.Array) -> jax.Array:
    """int values in [-8, 7], [..., K, N] -> int32 [..., K/8, N] (layout above)."""
    if not jnp.issubdtype(values_KN.dtype, jnp.integer):
        raise ValueError(f"pack_int4 needs integer values in [-8, 7], got {values_KN.dtype}")
    return pack_nibbles(values_KN.astype(jnp.int32) + 8)


def unpack_int4(packed_QN: jax.Array) -> jax.Array:
    """int32 [..., K/8, N] -> int8 [..., K, N] with values in [-8, 7]."""
    return unpack_nibbles(packed_QN).astype(jnp.int8) - 8


def dequantize_int4(packed_QN: jax.Array, scales_GN: jax.Array, group_size: int,
                    dtype=jnp.float32) -> jax.Array:
    """Real weights [..., K, N] = value * group scale, computed in f32, cast to dtype."""
    values = unpack_int4(packed_QN).astype(jnp.float32)
    scales = jnp.repeat(scales_GN.astype(jnp.float32), group_size, axis=-2)
    return (values * scales).astype(dtype)


def from_compressed_tensors(weight_packed_NQ: jax.Array, weight_scale_NG: jax.Array):
    """compressed-tensors pack-quantized (..., [N, K/8], [N, K/g]) -> (packed_QN, scales_GN)."""
    return jnp.swapaxes(weight_packed_NQ, -1, -2), jnp.swapaxes(weight_scale_NG, -1, -2)


def to_compressed_tensors(packed_QN: jax.Array, scales_GN: jax.Array):
    """(packed_QN, scales_GN) -> compressed-tensors (weight_packed_NQ, weight_scale_NG)."""
    return jnp.swapaxes(packed_QN, -1, -2), jnp.swapaxes(scales_GN, -1, -2)


def check_int4_operands(x_MK: jax.Array, packed_QN: jax.Array, scales_GN: jax.Array,
                        group_size: int) -> None:
    """ValueError naming the mismatch; packed/scales may carry an expert axis."""
    check_activations(x_MK)
    k = x_MK.shape[1]
    if group_size <= 0 or group_size % PACK:
        raise ValueError(f"group_size={group_size} must be a positive multiple of {PACK}")
    if k % group_size:
        raise ValueError(f"group_size={group_size} does not divide K={k}")
    if packed_QN.dtype != jnp.int32 or packed_QN.shape[-2] != k // PACK:
        raise ValueError(f"packed weights must be int32 [..., K/8={k // PACK}, N], got {packed_QN.dtype}{packed_QN.shape}")
    expected = (*packed_QN.shape[:-2], k // group_size, packed_QN.shape[-1])
    if scales_GN.shape != expected:
        raise ValueError(f"scales must be [..., K/group_size, N] = {expected}, got {scales_GN.shape}")


def int4_matmul(x_MK: jax.Array, packed_QN: jax.Array, scales_GN: jax.Array, *,
                group_size: int, backend: str | None = None,
                tuning: Int4Tuning = Int4Tuning()) -> jax.Array:
    """y = x @ dequantize(packed, scales), f32 accumulation, returned in x's dtype.

    tuning: the kernel's launch choices (tiles, warps, split-K); not the result.
    """
    backend = resolve_backend(backend)
    if packed_QN.ndim != 2:
        raise ValueError(f"packed weights must be [K/8, N], got {packed_QN.shape}")
    check_int4_operands(x_MK, packed_QN, scales_GN, group_size)
    if backend == "xla":
        return _reference(x_MK, packed_QN, scales_GN, group_size=group_size)
    return _dense_kernel(x_MK, packed_QN, scales_GN, group_size=group_size,
                         interpret=backend == "interpret", tuning=tuning)


@functools.partial(jax.jit, static_argnames=("group_size",))
def _reference(x_MK, packed_QN, scales_GN, *, group_size: int):
    return reference_dot(x_MK, dequantize_int4(packed_QN, scales_GN, group_size))


@functools.partial(jax.jit, static_argnames=("group_size", "interpret", "tuning"))
def _dense_kernel(x_MK, packed_QN, scales_GN, *, group_size: int, interpret: bool, tuning: Int4Tuning):
    run = int4_runner(packed_QN[None], scales_GN[None], group_size=group_size, tuning=tuning, interpret=interpret)
    return dense_rows(x_MK, packed_QN.shape[-1], run)


class NibbleCode(NamedTuple):
    """How a 4-bit format's packed codes become weights inside the pair-order kernel: the INT4 one
    here, NVFP4's in nvfp4_matmul.py. Both pack as `pack_nibbles` does.

    scale_rows(dtype) -> f(scale rows [BK/8, BN] as loaded) -> the scale per packed row that
      dequantize_pairs takes (dtype: that of x as the kernel reads it).
    dequantize_pairs(packed [BK/8, BN], j, scale per packed row, dtype) -> [BK/4, BN] in pair order:
      row 2i + h the weight of nibble j + 4h of packed row i.
    prepare_x(x [M, K]) -> (x as the kernel reads it, None or a float32 factor per row [M] that
      the result's rows are multiplied by): outside the kernel.
    finish: weight_stream.Finish, or None (extra operands, after the scales, reach it whole).
    """

    name: str
    scale_rows: Callable
    dequantize_pairs: Callable
    prepare_x: Callable = lambda x_MK: (x_MK, None)
    finish: Callable | None = None


def int4_runner(packed_EQN: jax.Array, scales_EGN: jax.Array, *, group_size: int, tuning: Int4Tuning,
                interpret: bool) -> TileRunner:
    """The INT4 kernel over a work list (weight_stream.TileRunner)."""
    return nibble_runner(INT4_CODE, packed_EQN, scales_EGN, (), group_size=group_size, tuning=tuning,
                         interpret=interpret)


def nibble_runner(code: NibbleCode, packed_EQN: jax.Array, scales_EGN: jax.Array, extras: tuple[jax.Array, ...], *,
                  group_size: int, tuning: Int4Tuning, interpret: bool) -> TileRunner:
    """The pair-order kernel of a 4-bit format over a work list (weight_stream.TileRunner).
    extras: further operands that every program reads whole (code.finish reads them)."""
    q, n = packed_EQN.shape[-2:]
    k = q * PACK

    def run(x_MK: jax.Array, schedule: TileSchedule, block_m: int, out_rows: int, rows_read: int) -> jax.Array:
        tiling = plan_tiling(block_m, out_rows, n, k, schedule.num_tiles, tuning)
        x_read, row_factor_M = code.prepare_x(x_MK)
        if tuning.gather_x:  # the kernel masks its reads to each tile's rows instead of padding
            x_in = x_read
        else:
            # x_pairs[j, m, 2i + h] = x[m, 8i + j + 4h] (module docstring)
            x_in = pad_to(x_read, rows_read).reshape(rows_read, q, 2, PAIR_DOTS).transpose(3, 0, 1, 2).reshape(
                PAIR_DOTS, rows_read, 2 * q)
        operands = [(w, column_blocks(w, tiling.block_n)) for w in (packed_EQN, scales_EGN)]
        operands += [(extra, whole(extra)) for extra in extras]
        y_WMN = stream_tiles(x_in, operands, schedule, tiling, n=n, k=k, out_dtype=x_MK.dtype,
                             make_step=functools.partial(_pair_step, code=code, group_size=group_size),
                             interpret=interpret, name=f"{code.name}_matmul", finish=code.finish)
        if row_factor_M is None:
            return y_WMN
        # Row r of tile t is x's row start_W[t] + r (rows past M are zero: any factor will do).
        rows_WM = jnp.minimum(schedule.start_W[:, None] + jnp.arange(out_rows)[None, :], x_MK.shape[0] - 1)
        return (y_WMN * row_factor_M[rows_WM][..., None]).astype(y_WMN.dtype)

    return run


# bf16 bit pattern 0x4300 | n is 128 + n for a nibble n in 0..15 (bf16 steps by
# 1 in [128, 256)), so a stored nibble (value + 8) is value + 136.
_BF16_128 = 0x4300
_NIBBLE_BIAS = 136


def _dequantize_pairs(packed_QN: jax.Array, j: int, scale_QN: jax.Array, dtype) -> jax.Array:
    """Nibbles j and j + 4 of a packed block, dequantized in pair order:
    [2Q, N], row 2i + h holding nibble j + 4h of packed row i.

    After the shift and mask an int32 is [16 bits: 128 + n_{j+4} | 16 bits:
    128 + n_j] as bf16 bit patterns. With bf16 x and scales the rest is bf16
    math that the GPU runs two values per instruction: (biased - 136) is
    exact, and * scale rounds once, as the float32 product (exact: 4 x 8
    significant bits) rounded to bf16 does. Other dtypes take float32 math.
    The join, transpose and reshape into pair order move no data in the
    compiled kernel (no layout conversion in the TTGIR): each int32 already
    holds an MMA operand register.
    """
    pair_QN = ((packed_QN >> (4 * j)) & 0x000F000F) | (_BF16_128 << 16 | _BF16_128)
    halves = [jax.lax.bitcast_convert_type(half_QN.astype(jnp.int16), jnp.bfloat16)
              for half_QN in (pair_QN, pair_QN >> 16)]
    biased_QN2 = jnp.stack(halves, axis=-1)
    scale_QN1 = scale_QN[:, :, None]
    if dtype == jnp.bfloat16 and scale_QN.dtype == jnp.bfloat16:
        w_QN2 = (biased_QN2 - jnp.bfloat16(_NIBBLE_BIAS)) * scale_QN1
    else:
        w_QN2 = ((biased_QN2.astype(jnp.float32) - _NIBBLE_BIAS) * scale_QN1.astype(jnp.float32)).astype(dtype)
    q, n = packed_QN.shape
    return w_QN2.transpose(0, 2, 1).reshape(2 * q, n)


def _x_pair_loader(x_ref, start: jax.Array, rows: jax.Array, tiling: Tiling) -> Callable:
    """load(j, first_row) -> x [BM, BK/4] at the pair-order columns of j:
    column 2i + h is x's column 8 * (first_row + i) + j + 4h.

    x_ref is x_pairs [4, M, K/4] (permuted by XLA) or, with gather_x, x
    [M, K] itself: then the tile's rows past `rows` (and past M) read as
    zeros and are not read at all.
    """
    packed_rows = tiling.block_k // PACK
    if not tiling.tuning.gather_x:
        return lambda j, first_row: x_ref[j, pl.ds(start, tiling.block_m), pl.ds(2 * first_row, 2 * packed_rows)]
    tile_row_M = jnp.arange(tiling.block_m)
    valid_M = (tile_row_M < rows) & (start + tile_row_M < x_ref.shape[0])
    row_M = jnp.minimum(start + tile_row_M, x_ref.shape[0] - 1)  # in bounds even where masked
    shape = (tiling.block_m, 2 * packed_rows)
    mask_MP = jnp.broadcast_to(valid_M[:, None], shape)
    pair_P = jnp.arange(2 * packed_rows)

    def load(j, first_row):
        column_P = (first_row + pair_P // 2) * PACK + j + (pair_P % 2) * PAIR_DOTS
        return plgpu.load(x_ref.at[row_M[:, None], column_P[None, :]], mask=mask_MP,
                          other=jnp.zeros(shape, x_ref.dtype))

    return load


def _scale_row_loader(scales_ref, expert: jax.Array, packed_rows: int, group_size: int) -> Callable:
    """load(first_row) -> the scale of each of a block's packed rows, [BK/8, BN].

    When a group spans a power of two of packed rows, the block's groups are
    contiguous: load each scale row once and repeat it in registers (a
    broadcast), not once per packed row (4x the loads at group 32, 16x at
    128). Otherwise gather a row per packed row.
    """
    rows_per_group = group_size // PACK
    if rows_per_group & (rows_per_group - 1):
        return lambda first_row: scales_ref[expert, (first_row + jnp.arange(packed_rows)) // rows_per_group, :]
    groups = max(1, packed_rows // rows_per_group)  # a block inside one group loads 1 row

    def load(first_row):
        scale_GN = scales_ref[expert, pl.ds(first_row // rows_per_group, groups), :]
        width = scale_GN.shape[-1]
        return jnp.broadcast_to(scale_GN[:, None, :], (groups, packed_rows // groups, width)).reshape(packed_rows, width)

    return load


def _pair_step(x_ref, operand_refs, expert: jax.Array, start: jax.Array, rows: jax.Array, tiling: Tiling, *,
               code: NibbleCode, group_size: int) -> Callable:
    """step(k_block, acc) for one program (weight_stream.StepFactory).

    Refs: x_pairs [4, M, K/4] (or x [M, K] with gather_x), as the code's
    prepare_x gives it; packed [E, K/8, BN]; scales [E, K/g, BN]; then the
    code's extra operands (its finish reads them).
    """
    packed_ref, scales_ref = operand_refs[:2]
    load_x = _x_pair_loader(x_ref, start, rows, tiling)
    packed_rows = tiling.block_k // PACK
    load_scales = _scale_row_loader(scales_ref, expert, packed_rows, group_size)
    scale_rows = code.scale_rows(x_ref.dtype)

    def step(block, acc):
        first_row = block * packed_rows
        packed_QN = packed_ref[expert, pl.ds(first_row, packed_rows), :]
        scale_QN = scale_rows(load_scales(first_row))
        for j in range(PAIR_DOTS):
            w_PN = code.dequantize_pairs(packed_QN, j, scale_QN, x_ref.dtype)
            acc += tile_product(load_x(j, first_row), w_PN, tiling)
        return acc

    return step


INT4_CODE = NibbleCode("int4", lambda dtype: lambda scale_QN: scale_QN, _dequantize_pairs)
