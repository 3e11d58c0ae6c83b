"""W8A16 matmul: bf16 activations times FP8 weights with 128 x 128 block scales.

The format of DeepSeek-V3, Kimi K2 and GLM's FP8 checkpoints (the seed's
baseline, before INT4):
  values_KN float8_e4m3fn [K, N]; scale_inv_kn float32 (or bf16) [ceil(K/128), ceil(N/128)]:
      weight[k, n] = values[k, n] * scale_inv[k // 128, n // 128].
  Expert-batched weights add a leading axis: [E, K, N] and [E, kb, nb].
  Every op takes scale_block = (rows, columns) of values per scale, 128 x 128
  by default; a smaller power of two serves one device's share of a weight
  whose tensor-parallel split cuts 128-blocks (models.weights: GLM-4.5's
  1536 / 8 = 192 rows become 3 blocks of 64, each scale repeated).
  (On disk: `weight` [N, K] and `weight_scale_inv` [nb, kb], the transposes;
  mixserve.checkpoint converts.)

Kernel strategy: a program's column block (a power of two dividing the
scale block's columns) lies in one column of scale blocks, and so does each
K block in one row of them: the block's weights share one scale. The
kernel converts the FP8 block to x's dtype (exact: e4m3 has 4 significant
bits), takes the tensor-core dot with x, accumulating in float32, and multiplies the
[BM, BN] product by that scale before adding it to the accumulator, as
DeepSeek's FP8 GEMMs promote per 128-block. No weight is rounded, unlike
dequantizing to bf16 first (XLA's path in models.weights.matmul). With bf16
x the dots run in float16 by default (Fp8BlockTuning.dot_dtype), x's rows
scaled by powers of two into f16's range.

The work list, split-K and grid are weight_stream.py's, shared with the INT4
kernels: fp8_block_matmul is dense, moe_fp8_block_matmul grouped over
expert-sorted rows (idle experts stream nothing). XLA's alternative
dequantizes every weight to bf16 in memory first, and for a MoE layer every
expert's (jax.lax.ragged_dot takes one dtype). Triton-backed Pallas for the
reasons of int4_matmul.py: a streamed weight, a dynamic expert index.
"""

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.backend import resolve_backend
from pallas_kernels.flash_decoding import scaled_query
from pallas_kernels.weight_stream import (
    StreamTuning, TileRunner, TileSchedule, Tiling, check_activations, checked_group_sizes, column_blocks, dense_rows,
    grouped_rows, pad_to, plan_tiling, reference_dot, reference_ragged_dot, row_factor, stream_tiles, tile_product,
    whole)

FP8_BLOCK = 128  # weights per scale, along K and along N


@dataclasses.dataclass(frozen=True)
class Fp8BlockTuning(StreamTuning):
    """The launch choices of weight_stream.StreamTuning, for the FP8-block
    kernels. block_k and block_n are capped by the scale block, so that one
    scale serves each weight block.

    dot_dtype: the dots' operand dtype with bf16 x, "bfloat16" or "float16".
      e4m3 is exact in both, but on sm_90 e4m3 -> f16 is one packed
      instruction per two values and e4m3 -> bf16 adds a scalar f16 -> bf16
      conversion per value (experiments/results/sm90_sass.md). float16 scales
      each row of x by a power of two into f16's range first, as the FP8
      attention kernels scale their query (flash_decoding.scaled_query:
      exact but for entries below 2^-28 of their row's largest), and undoes
      it on the float32 sums. float32 x always dots in float32. float16 is the
      default: its sm_90a inner loop is 279 instructions against 371 at M=1
      and 284 against 475 at M=64 (no scalar conversions, no permutes; same
      registers), and the same change made the FP8 attention kernels 1.16x
      to 1.43x faster on the H200. Not yet timed for this kernel on a GPU.
    """

    block_k: int = FP8_BLOCK
    dot_dtype: str = "float16"

    def __post_init__(self):
        super().__post_init__()
        if self.dot_dtype not in ("bfloat16", "float16"):
            raise ValueError(f"dot_dtype must be 'bfloat16' or 'float16', got {self.dot_dtype!r}")


ScaleBlock = tuple[int, int]
DEFAULT_SCALE_BLOCK: ScaleBlock = (FP8_BLOCK, FP8_BLOCK)


def dequantize_fp8_block(values_KN: jax.Array, scale_inv_kn: jax.Array, dtype=jnp.float32,
                         scale_block: ScaleBlock = DEFAULT_SCALE_BLOCK) -> jax.Array:
    """Real weights [..., K, N] = value * block scale, computed in f32, cast to dtype."""
    *_, k, n = values_KN.shape
    rows, columns = scale_block
    scale_KN = jnp.repeat(jnp.repeat(scale_inv_kn.astype(jnp.float32), rows, axis=-2), columns, axis=-1)
    return (values_KN.astype(jnp.float32) * scale_KN[..., :k, :n]).astype(dtype)


def _check_operands(x_MK: jax.Array, values_KN: jax.Array, scale_inv_kn: jax.Array, scale_block: ScaleBlock) -> None:
    """ValueError naming the mismatch; values/scales may carry an expert axis."""
    check_activations(x_MK)
    if values_KN.dtype != jnp.float8_e4m3fn or values_KN.shape[-2] != x_MK.shape[1]:
        raise ValueError(f"weights must be float8_e4m3fn [..., K={x_MK.shape[1]}, N], got "
                         f"{values_KN.dtype}{values_KN.shape}")
    if any(b <= 0 or b & (b - 1) or b > FP8_BLOCK for b in scale_block):
        raise ValueError(f"scale_block={scale_block} must be powers of two <= {FP8_BLOCK}")
    *lead, k, n = values_KN.shape
    rows, columns = scale_block
    expected = (*lead, -(-k // rows), -(-n // columns))
    if scale_inv_kn.shape != expected or scale_inv_kn.dtype not in (jnp.float32, jnp.bfloat16):
        raise ValueError(f"scale_inv must be float32 or bf16 [..., ceil(K/{rows}), ceil(N/{columns})] = {expected}, "
                         f"got {scale_inv_kn.dtype}{scale_inv_kn.shape}")


def fp8_block_matmul(x_MK: jax.Array, values_KN: jax.Array, scale_inv_kn: jax.Array, *,
                     scale_block: ScaleBlock = DEFAULT_SCALE_BLOCK, backend: str | None = None,
                     tuning: Fp8BlockTuning = Fp8BlockTuning()) -> jax.Array:
    """y = x @ dequantize(values, scale_inv), f32 accumulation, returned in x's dtype.

    tuning: the kernel's launch choices (tiles, warps, split-K); not the result.
    """
    backend = resolve_backend(backend)
    if values_KN.ndim != 2:
        raise ValueError(f"weights must be [K, N], got {values_KN.shape}")
    _check_operands(x_MK, values_KN, scale_inv_kn, scale_block)
    if backend == "xla":
        return _reference(x_MK, values_KN, scale_inv_kn, scale_block=scale_block)
    return _dense_kernel(x_MK, values_KN, scale_inv_kn, scale_block=scale_block, interpret=backend == "interpret",
                         tuning=tuning)


def moe_fp8_block_matmul(x_TK: jax.Array, values_EKN: jax.Array, scale_inv_Ekn: jax.Array,
                         group_sizes_E: jax.Array, *, scale_block: ScaleBlock = DEFAULT_SCALE_BLOCK,
                         backend: str | None = None, tuning: Fp8BlockTuning = Fp8BlockTuning()) -> jax.Array:
    """Grouped over expert-sorted rows, like lax.ragged_dot: row t of y uses the
    expert whose group contains t; rows past sum(group_sizes_E) are zero; a negative
    size counts as 0."""
    backend = resolve_backend(backend)
    if values_EKN.ndim != 3:
        raise ValueError(f"expert weights must be [E, K, N], got {values_EKN.shape}")
    _check_operands(x_TK, values_EKN, scale_inv_Ekn, scale_block)
    group_sizes_E = checked_group_sizes(group_sizes_E, values_EKN.shape[0])
    if backend == "xla":
        return _moe_reference(x_TK, values_EKN, scale_inv_Ekn, group_sizes_E, scale_block=scale_block)
    return _moe_kernel(x_TK, values_EKN, scale_inv_Ekn, group_sizes_E, scale_block=scale_block,
                       interpret=backend == "interpret", tuning=tuning)


@functools.partial(jax.jit, static_argnames=("scale_block",))
def _reference(x_MK, values_KN, scale_inv_kn, *, scale_block: ScaleBlock):
    return reference_dot(x_MK, dequantize_fp8_block(values_KN, scale_inv_kn, scale_block=scale_block))


@functools.partial(jax.jit, static_argnames=("scale_block",))
def _moe_reference(x_TK, values_EKN, scale_inv_Ekn, group_sizes_E, *, scale_block: ScaleBlock):
    w_EKN = dequantize_fp8_block(values_EKN, scale_inv_Ekn, scale_block=scale_block)
    return reference_ragged_dot(x_TK, w_EKN, group_sizes_E)


@functools.partial(jax.jit, static_argnames=("scale_block", "interpret", "tuning"))
def _dense_kernel(x_MK, values_KN, scale_inv_kn, *, scale_block: ScaleBlock, interpret: bool, tuning: Fp8BlockTuning):
    run = _runner(values_KN[None], scale_inv_kn[None], scale_block=scale_block, tuning=tuning, interpret=interpret)
    return dense_rows(x_MK, values_KN.shape[-1], run)


@functools.partial(jax.jit, static_argnames=("scale_block", "interpret", "tuning"))
def _moe_kernel(x_TK, values_EKN, scale_inv_Ekn, group_sizes_E, *, scale_block: ScaleBlock, interpret: bool,
                tuning: Fp8BlockTuning):
    run = _runner(values_EKN, scale_inv_Ekn, scale_block=scale_block, tuning=tuning, interpret=interpret)
    return grouped_rows(x_TK, group_sizes_E, values_EKN.shape[-1], run)


def _runner(values_EKN: jax.Array, scale_inv_Ekn: jax.Array, *, scale_block: ScaleBlock, tuning: Fp8BlockTuning,
            interpret: bool) -> TileRunner:
    """The FP8-block kernel over a work list (weight_stream.TileRunner)."""
    k, n = values_EKN.shape[-2:]

    def run(x_MK: jax.Array, schedule: TileSchedule, block_m: int, out_rows: int, rows_read: int) -> jax.Array:
        tiling = plan_tiling(block_m, out_rows, n, k, schedule.num_tiles, tuning, caps=scale_block)
        # The scales are tiny (1/16384 of the weights): every program sees them whole.
        operands = [(values_EKN, column_blocks(values_EKN, tiling.block_n)), (scale_inv_Ekn, whole(scale_inv_Ekn))]
        x_in = pad_to(x_MK, rows_read)
        if tuning.dot_dtype == "float16" and x_MK.dtype == jnp.bfloat16:
            (x_in,), unscale_M = scaled_query((x_in,), jnp.float16)
            operands.append((unscale_M, whole(unscale_M)))
        return stream_tiles(x_in, operands, schedule, tiling, n=n, k=k, out_dtype=x_MK.dtype,
                            make_step=functools.partial(_fp8_step, scale_block=scale_block), interpret=interpret,
                            name="fp8_block_matmul")

    return run


def _fp8_step(x_ref, operand_refs, expert: jax.Array, start: jax.Array, rows: jax.Array, tiling: Tiling, *,
              scale_block: ScaleBlock) -> Callable:
    """step(k_block, acc) for one program (weight_stream.StepFactory).

    Refs: x [rows_read, K] (f16 rows scaled by powers of two, or x itself);
    values [E, K, BN] (this program's columns); scale_inv [E, kb, nb] whole;
    with f16 x, the factors undoing its scaling [rows_read].
    """
    del rows  # x is padded: a tile reads all of its block_m rows
    values_ref, scale_ref, *unscale_ref = operand_refs
    scale_rows, scale_columns = scale_block
    scale_column = pl.program_id(1) * tiling.block_n // scale_columns
    # Per row with scaled f16 x (applied with each block's scale: [BM, 1], not [BM, BN]), else 1.
    unscale = row_factor(unscale_ref[0][pl.ds(start, tiling.block_m)], tiling) if unscale_ref else 1.0

    def step(block, acc):
        first_k = block * tiling.block_k
        x_MK = x_ref[pl.ds(start, tiling.block_m), pl.ds(first_k, tiling.block_k)]
        w_KN = values_ref[expert, pl.ds(first_k, tiling.block_k), :].astype(x_MK.dtype)
        scale = scale_ref[expert, first_k // scale_rows, scale_column].astype(jnp.float32)
        return acc + tile_product(x_MK, w_KN, tiling) * (scale * unscale)

    return step
