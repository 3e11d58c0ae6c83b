"""Weight formats as parameter types: a dense array, FP8 with 128x128 block scales, or INT4 groups.

Every linear layer and every stacked expert tensor holds one of these, oriented [in, out]
(experts [E, in, out]). `matmul` / `expert_matmul` dispatch on the type, so model code never
changes with the format. Each format carries its own dequantize-reference; fast paths are the
Pallas kernels (`pallas_kernels`), the XLA path dequantizes then dots.

Formats (on-disk names in brackets):
  bf16       plain array (any float dtype).
  fp8_block  float8_e4m3fn values and float32 `scale_inv` per 128x128 block [DeepSeek/GLM FP8:
             `weight` + `weight_scale_inv`]; real = fp8 * scale_inv[k // 128, n // 128].
  int4       symmetric group-wise along the input dim, group 32 or 128, 8 nibbles per int32
             [compressed-tensors pack-quantized: `weight_packed`, `weight_scale`, `weight_shape`].
             Packed layout: see pallas_kernels/int4_matmul.py (the transpose of compressed-tensors).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Literal

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

import pallas_kernels
from models import partitioning

FP8_BLOCK = 128
E4M3_MAX = 448.0  # largest finite float8_e4m3fn; it has no infinity, so an unclamped overflow is NaN
FormatKind = Literal["bf16", "fp8_block", "int4"]


@dataclasses.dataclass(frozen=True)
class WeightFormat:
    kind: FormatKind = "bf16"
    group_size: int = 32  # int4 only

    def __post_init__(self):
        if self.kind not in ("bf16", "fp8_block", "int4"):
            raise ValueError(f"unknown weight format {self.kind!r}; expected bf16, fp8_block or int4")
        if self.kind == "int4" and (self.group_size <= 0 or self.group_size % 8):
            raise ValueError(f"int4 group_size must be a positive multiple of 8, got {self.group_size}")

    def __str__(self) -> str:
        return f"int4-g{self.group_size}" if self.kind == "int4" else self.kind


BF16 = WeightFormat("bf16")


@dataclasses.dataclass(frozen=True)
class WeightPlan:
    """Which format each kind of weight uses. Router, norms, embeddings, lm_head and the DSA
    indexer's `weights_proj` always stay in the model dtype (as in Kimi K2 Thinking and DeepSeek FP8)."""

    experts: WeightFormat = BF16  # routed experts
    linear: WeightFormat = BF16  # attention projections, dense MLPs, shared experts, indexer wq_b/wk

    def __str__(self) -> str:
        return f"experts={self.experts}, linear={self.linear}"


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Fp8BlockWeight:
    """values_KN float8_e4m3fn [..., K, N]; scale_inv_kn float32 [..., ceil(K/128), ceil(N/128)]."""

    values_KN: jax.Array
    scale_inv_kn: jax.Array

    @property
    def shape(self) -> tuple[int, ...]:
        return self.values_KN.shape

    @classmethod
    def quantize(cls, w_KN: jax.Array) -> "Fp8BlockWeight":
        """Per-block absmax scaling to e4m3's largest finite value (448); the cast saturates."""
        *lead, k, n = w_KN.shape
        kb, nb = -(-k // FP8_BLOCK), -(-n // FP8_BLOCK)
        w = jnp.pad(w_KN.astype(jnp.float32), [(0, 0)] * len(lead) + [(0, kb * FP8_BLOCK - k), (0, nb * FP8_BLOCK - n)])
        blocks = w.reshape(*lead, kb, FP8_BLOCK, nb, FP8_BLOCK)
        absmax = jnp.max(jnp.abs(blocks), axis=(-3, -1))
        scale_inv = jnp.maximum(absmax, jnp.finfo(jnp.float32).tiny) / E4M3_MAX
        q = blocks / scale_inv[..., :, None, :, None]
        values = saturating_cast(q, jnp.float8_e4m3fn).reshape(*lead, kb * FP8_BLOCK, nb * FP8_BLOCK)
        return cls(values[..., :k, :n], scale_inv)

    def dequantize(self, dtype=jnp.bfloat16) -> jax.Array:
        *_, k, n = self.values_KN.shape
        s = jnp.repeat(jnp.repeat(self.scale_inv_kn, FP8_BLOCK, axis=-2), FP8_BLOCK, axis=-1)[..., :k, :n]
        return (self.values_KN.astype(jnp.float32) * s).astype(dtype)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Int4Weight:
    """packed_QN int32 [..., K/8, N]; scales_GN [..., K/group, N]. group_size is static."""

    packed_QN: jax.Array
    scales_GN: jax.Array
    group_size: int = dataclasses.field(metadata=dict(static=True))

    @property
    def shape(self) -> tuple[int, ...]:
        *lead, q, n = self.packed_QN.shape
        return (*lead, q * 8, n)

    @classmethod
    def quantize(cls, w_KN: jax.Array, group_size: int) -> "Int4Weight":
        """Round-to-nearest, symmetric: scale = absmax / 7.5 per group (compressed-tensors' rule),
        values clamped to [-8, 7], so |error| <= scale / 2 everywhere."""
        *lead, k, n = w_KN.shape
        if k % group_size:
            raise ValueError(f"int4 group_size {group_size} does not divide the input dimension {k}")
        groups = w_KN.astype(jnp.float32).reshape(*lead, k // group_size, group_size, n)
        scales = (jnp.max(jnp.abs(groups), axis=-2) / 7.5).astype(jnp.bfloat16)
        safe = jnp.maximum(scales.astype(jnp.float32), jnp.finfo(jnp.float32).tiny)
        values = jnp.clip(jnp.round(groups / safe[..., None, :]), -8, 7).astype(jnp.int8)
        return cls(pallas_kernels.pack_int4(values.reshape(*lead, k, n)), scales, group_size)

    def dequantize(self, dtype=jnp.bfloat16) -> jax.Array:
        return pallas_kernels.dequantize_int4(self.packed_QN, self.scales_GN, self.group_size, dtype)


Weight = jax.Array | Fp8BlockWeight | Int4Weight


def saturating_cast(x: jax.Array, dtype) -> jax.Array:
    """Cast to an FP8 type, clamping to its finite range first (NaN stays NaN)."""
    limit = float(jnp.finfo(dtype).max)
    return jnp.clip(x, -limit, limit).astype(dtype)


def quantize(w: jax.Array, fmt: WeightFormat) -> Weight:
    """Round-to-nearest into `fmt` (GPTQ lives in mixserve.quantize)."""
    if fmt.kind == "fp8_block":
        return Fp8BlockWeight.quantize(w)
    if fmt.kind == "int4":
        return Int4Weight.quantize(w, fmt.group_size)
    return w


def dequantize(w: Weight, dtype) -> jax.Array:
    return w.astype(dtype) if isinstance(w, jax.Array) else w.dequantize(dtype)


def matmul(x: jax.Array, w: Weight, *, backend: str | None = "xla", axes: tuple[str, str] | None = None) -> jax.Array:
    """x [..., K] @ w [K, N] -> [..., N] in x's dtype, float32 accumulation. axes: w's logical
    axis names, which say how a kernel splits under tensor parallelism (_int4_kernel)."""
    if isinstance(w, Int4Weight):
        lead = x.shape[:-1]
        kernel = functools.partial(pallas_kernels.int4_matmul, group_size=w.group_size, backend=backend)
        return _int4_kernel(kernel, x.reshape(-1, x.shape[-1]), w, axes, backend).reshape(*lead, -1)
    w = dequantize(w, x.dtype)
    return jnp.einsum("...k,kn->...n", x, w, preferred_element_type=jnp.float32).astype(x.dtype)


def expert_matmul(x_TK: jax.Array, w: Weight, group_sizes_E: jax.Array, *, backend: str | None = "xla",
                  axes: tuple[str, str, str] | None = None) -> jax.Array:
    """Rows of x sorted by expert, group_sizes_E rows per expert; w [E, K, N] -> [T, N]."""
    if isinstance(w, Int4Weight):
        kernel = functools.partial(pallas_kernels.moe_int4_matmul, group_size=w.group_size, backend=backend)
        return _int4_kernel(kernel, x_TK, w, axes, backend, group_sizes_E)
    w = dequantize(w, x_TK.dtype)
    y = jax.lax.ragged_dot(x_TK, w, group_sizes_E, preferred_element_type=jnp.float32)
    return y.astype(x_TK.dtype)


def _int4_kernel(kernel, x_MK, w: Int4Weight, axes, backend, *replicated):
    """kernel(x, packed, scales, *replicated), per device under tensor parallelism: a weight split
    on its output features (column-parallel) gives each device its output columns; one split on its
    input features (row-parallel) its share of the contraction, summed over devices. The XLA
    reference needs none of this: XLA's partitioner splits it."""
    mesh = partitioning.context_mesh() if backend != "xla" and axes else None
    row, col = partitioning.int4_split(axes, w.packed_QN.shape, w.scales_GN.shape, partitioning.tp_size(mesh)) \
        if mesh is not None else (None, None)
    w_spec = P(*(None,) * (w.packed_QN.ndim - 2), row, col)

    def local(x, packed, scales, *rest):
        y = kernel(x, packed, scales, *rest)
        return jax.lax.psum(y, partitioning.MODEL_AXIS) if row else y

    run = partitioning.per_device(local, mesh, (P(None, row), w_spec, w_spec) + (P(),) * len(replicated), P(None, col))
    return run(x_MK, w.packed_QN, w.scales_GN, *replicated)


def abstract_weight(fmt: WeightFormat, shape: tuple[int, ...], dtype) -> Weight:
    """Shape-only instance of a weight in `fmt`, for eval_shape and memory accounting."""
    *lead, k, n = shape
    if fmt.kind == "bf16":
        return jax.ShapeDtypeStruct(shape, dtype)
    if fmt.kind == "fp8_block":
        kb, nb = -(-k // FP8_BLOCK), -(-n // FP8_BLOCK)
        return Fp8BlockWeight(
            jax.ShapeDtypeStruct(shape, jnp.float8_e4m3fn), jax.ShapeDtypeStruct((*lead, kb, nb), jnp.float32)
        )
    if k % fmt.group_size:
        raise ValueError(f"int4 group_size {fmt.group_size} does not divide the input dimension {k}")
    return Int4Weight(
        jax.ShapeDtypeStruct((*lead, k // 8, n), jnp.int32),
        jax.ShapeDtypeStruct((*lead, k // fmt.group_size, n), jnp.bfloat16),
        fmt.group_size,
    )
