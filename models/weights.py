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
  nvfp4      4-bit floats (e2m1) in INT4's packed layout, a float8_e4m3fn scale per 16 inputs and a
             float32 global scale per matrix (per expert) [compressed-tensors nvfp4-pack-quantized:
             `weight_packed` uint8, `weight_scale`, `weight_global_scale`]; real = e2m1 * scale /
             global_scale. See pallas_kernels/nvfp4_matmul.py. nvfp4-w4a4 also quantizes the
             layer's input to NVFP4 under a calibrated `input_global_scale` [..., 1], as an FP4
             tensor-core GPU computes a W4A4 checkpoint's layers (matmul: w4a4_operands).
Tensor parallelism may hold either with finer scale blocks (their scales repeated: the same
weight), where a device's share would cut the stored ones (split_for_tp): FP8 scale_block (64, 128)
or an INT4 group of 64 for GLM-4.5's 192-row expert shares at TP8.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

import pallas_kernels
from models import partitioning

FP8_BLOCK = pallas_kernels.FP8_BLOCK
E4M3_MAX = 448.0  # largest finite float8_e4m3fn; it has no infinity, so an unclamped overflow is NaN
FormatKind = Literal["bf16", "fp8_block", "int4", "nvfp4"]
NVFP4_GROUP = pallas_kernels.NVFP4_GROUP


@dataclasses.dataclass(frozen=True)
class WeightFormat:
    kind: FormatKind = "bf16"
    group_size: int = 32  # int4 only (nvfp4's is 16)
    # nvfp4 only: also quantize each layer's input to NVFP4 (W4A4) under the checkpoint's calibrated
    # input scales, as Blackwell computes it; off, NVFP4 is weight-only (W4A16), as on Hopper.
    w4a4: bool = False

    def __post_init__(self):
        if self.kind not in ("bf16", "fp8_block", "int4", "nvfp4"):
            raise ValueError(f"unknown weight format {self.kind!r}; expected bf16, fp8_block, int4 or nvfp4")
        if self.w4a4 and self.kind != "nvfp4":
            raise ValueError(f"w4a4 (NVFP4 activations) is an nvfp4 option, not {self.kind}'s")
        if self.kind == "int4" and (self.group_size <= 0 or self.group_size % 8):
            raise ValueError(f"int4 group_size must be a positive multiple of 8, got {self.group_size}")
        if self.kind == "nvfp4":
            object.__setattr__(self, "group_size", NVFP4_GROUP)

    def __str__(self) -> str:
        return f"int4-g{self.group_size}" if self.kind == "int4" else self.kind + "-w4a4" * self.w4a4


BF16 = WeightFormat("bf16")


@dataclasses.dataclass(frozen=True)
class WeightPlan:
    """Which format each kind of weight uses. Router, norms, embeddings, lm_head and the DSA
    indexer's `weights_proj` always stay in the model dtype (as in Kimi K2 Thinking and DeepSeek FP8)."""

    experts: WeightFormat = BF16  # routed experts
    linear: WeightFormat = BF16  # attention projections, dense MLPs, shared experts, indexer wq_b/wk

    @property
    def w4a4(self) -> bool:
        """Does any category quantize its inputs (NVFP4 activations)?"""
        return self.experts.w4a4 or self.linear.w4a4

    def __str__(self) -> str:
        return f"experts={self.experts}, linear={self.linear}"


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Fp8BlockWeight:
    """values_KN float8_e4m3fn [..., K, N]; scale_inv_kn float32 [..., ceil(K/r), ceil(N/c)] for
    scale_block (r, c) (its values_per_scale): 128 x 128 as checkpoints store it, finer where tensor
    parallelism re-blocks the scales (split_for_tp)."""

    values_KN: jax.Array
    scale_inv_kn: jax.Array
    scale_block: tuple[int, int] = dataclasses.field(default=(FP8_BLOCK, FP8_BLOCK), metadata=dict(static=True))

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

    @property
    def stored(self) -> tuple[jax.Array, jax.Array]:
        """(values, scales), each [..., rows, columns]."""
        return self.values_KN, self.scale_inv_kn

    def with_stored(self, values, scales, values_per_scale: tuple[int, int] | None = None,
                    per_tensor: tuple = ()) -> "Fp8BlockWeight":
        return Fp8BlockWeight(values, scales, values_per_scale or self.scale_block)

    per_tensor = ()  # no scale per matrix (Nvfp4Weight's global scale)

    @property
    def values_per_scale(self) -> tuple[int, int]:
        """Stored rows and columns per scale."""
        return self.scale_block

    @property
    def kernel_args(self) -> dict:
        return {"scale_block": self.scale_block}

    def dequantize(self, dtype=jnp.bfloat16) -> jax.Array:
        return pallas_kernels.dequantize_fp8_block(self.values_KN, self.scale_inv_kn, dtype, self.scale_block)


class _PackedNibbles:
    """What the 4-bit formats share: eight values per int32 of packed_QN [..., K/8, N], a scale
    per group_size of them along K (one column each)."""

    @property
    def shape(self) -> tuple[int, ...]:
        *lead, q, n = self.packed_QN.shape
        return (*lead, q * 8, n)

    @property
    def values_per_scale(self) -> tuple[int, int]:
        """Stored rows and columns per scale: packed rows of one group, one column."""
        return self.group_size // 8, 1

    @property
    def kernel_args(self) -> dict:
        return {"group_size": self.group_size}


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Int4Weight(_PackedNibbles):
    """packed_QN int32 [..., K/8, N]; scales_GN [..., K/group, N]. group_size is static."""

    packed_QN: jax.Array
    scales_GN: jax.Array
    group_size: int = dataclasses.field(metadata=dict(static=True))

    @classmethod
    def quantize(cls, w_KN: jax.Array, group_size: int) -> "Int4Weight":
        """Round-to-nearest, symmetric: scale = absmax / 7.5 per group (compressed-tensors' rule),
        values clamped to [-8, 7], so |error| <= scale / 2, but for a group's largest positive
        weight when the bf16 scale rounds below absmax / 7.5 (by up to 2**-8 of it): that weight
        rounds to 8 and is clamped to 7, |error| <= (0.5 + 7.5 * 2**-8) scale = 0.529 scale."""
        *lead, k, n = w_KN.shape
        if k % group_size:
            raise ValueError(f"int4 group_size {group_size} does not divide the input dimension {k}")
        groups = w_KN.astype(jnp.float32).reshape(*lead, k // group_size, group_size, n)
        scales = (jnp.max(jnp.abs(groups), axis=-2) / 7.5).astype(jnp.bfloat16)
        safe = jnp.maximum(scales.astype(jnp.float32), jnp.finfo(jnp.float32).tiny)
        values = jnp.clip(jnp.round(groups / safe[..., None, :]), -8, 7).astype(jnp.int8)
        return cls(pallas_kernels.pack_int4(values.reshape(*lead, k, n)), scales, group_size)

    @property
    def stored(self) -> tuple[jax.Array, jax.Array]:
        """(values, scales), each [..., rows, columns]."""
        return self.packed_QN, self.scales_GN

    def with_stored(self, values, scales, values_per_scale: tuple[int, int] | None = None,
                    per_tensor: tuple = ()) -> "Int4Weight":
        return Int4Weight(values, scales, _nibble_group(values_per_scale, self.group_size))

    per_tensor = ()

    def dequantize(self, dtype=jnp.bfloat16) -> jax.Array:
        return pallas_kernels.dequantize_int4(self.packed_QN, self.scales_GN, self.group_size, dtype)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Nvfp4Weight(_PackedNibbles):
    """packed_QN int32 [..., K/8, N] of e2m1 codes; scales_GN float8_e4m3fn [..., K/16, N];
    global_scale float32 [..., 1], which divides (pallas_kernels/nvfp4_matmul.py). group_size is
    16, or 8 where tensor parallelism re-blocks it (split_for_tp). input_global_scale float32
    [..., 1] (W4A4 only, else None): the calibrated global scale of the layer's NVFP4 input."""

    packed_QN: jax.Array
    scales_GN: jax.Array
    global_scale: jax.Array
    group_size: int = dataclasses.field(default=NVFP4_GROUP, metadata=dict(static=True))
    input_global_scale: jax.Array | None = None

    @classmethod
    def quantize(cls, w_KN: jax.Array, w4a4: bool = False) -> "Nvfp4Weight":
        """Round to nearest (ties to even) under llm-compressor's scales: nvfp4_matmul.quantize_nvfp4.
        w4a4: with an input global scale of 1 (inputs up to 6 * 448), a placeholder for the calibrated
        one (mixserve.gptq.input_global_scales) that quantize_model and quantize_checkpoint put in
        its place; mixserve.load refuses a W4A4 plan for a preset, which has none."""
        packed, scales, global_scale = pallas_kernels.quantize_nvfp4(w_KN)
        return cls(packed, scales, global_scale, NVFP4_GROUP, jnp.ones_like(global_scale) if w4a4 else None)

    @property
    def stored(self) -> tuple[jax.Array, jax.Array]:
        """(values, scales), each [..., rows, columns]."""
        return self.packed_QN, self.scales_GN

    @property
    def per_tensor(self) -> tuple[jax.Array, ...]:
        """The arrays with one entry per matrix, [..., 1]: split only as the leading (expert) axes are."""
        return (self.global_scale,) if self.input_global_scale is None else (self.global_scale, self.input_global_scale)

    def with_stored(self, values, scales, values_per_scale: tuple[int, int] | None = None,
                    per_tensor: tuple | None = None) -> "Nvfp4Weight":
        global_scale, *input_scale = per_tensor or self.per_tensor
        return Nvfp4Weight(values, scales, global_scale, _nibble_group(values_per_scale, self.group_size),
                           *input_scale)

    def dequantize(self, dtype=jnp.bfloat16) -> jax.Array:
        return pallas_kernels.dequantize_nvfp4(self.packed_QN, self.scales_GN, self.global_scale, dtype)


def _nibble_group(values_per_scale: tuple[int, int] | None, group_size: int) -> int:
    """The group size of a packed 4-bit weight whose scales cover values_per_scale stored values."""
    if values_per_scale is None:
        return group_size
    if values_per_scale[1] != 1:
        raise ValueError(f"a 4-bit weight's scale covers one column, not {values_per_scale[1]}")
    return 8 * values_per_scale[0]


Weight = jax.Array | Fp8BlockWeight | Int4Weight | Nvfp4Weight
QUANTIZED = (Fp8BlockWeight, Int4Weight, Nvfp4Weight)  # the formats with stored values and scales
Quantized = Fp8BlockWeight | Int4Weight | Nvfp4Weight


def saturating_cast(x: jax.Array, dtype) -> jax.Array:
    """Cast to an FP8 type, clamping to its finite range first (NaN stays NaN)."""
    limit = float(jnp.finfo(dtype).max)
    return jnp.clip(x, -limit, limit).astype(dtype)


def quantize(w: jax.Array, fmt: WeightFormat) -> Weight:
    """Round-to-nearest into `fmt` (GPTQ lives in mixserve.quantize)."""
    return w if fmt.kind == "bf16" else _quantize_jit(w, fmt)


@functools.partial(jax.jit, static_argnames="fmt")
def _quantize_jit(w: jax.Array, fmt: WeightFormat) -> Quantized:
    """One program per weight shape and format: op by op, each of the rounding's dozen operations
    compiled and ran on its own (a tiny Kimi's INT4 conversion: 4.7 s against 1.0 s on a CPU,
    mostly compiling)."""
    if fmt.kind == "fp8_block":
        return Fp8BlockWeight.quantize(w)
    if fmt.kind == "int4":
        return Int4Weight.quantize(w, fmt.group_size)
    return Nvfp4Weight.quantize(w, fmt.w4a4)


def dequantize(w: Weight, dtype) -> jax.Array:
    return w.astype(dtype) if isinstance(w, jax.Array) else w.dequantize(dtype)


def matmul(x: jax.Array, w: Weight, *, backend: str | None = "xla", axes: tuple[str, str] | None = None) -> jax.Array:
    """x [..., K] @ w [K, N] -> [..., N] in x's dtype, float32 accumulation. axes: w's logical
    axis names, which say how a kernel splits under tensor parallelism (_per_device_kernel)."""
    backend = pallas_kernels.resolve_backend(backend)
    if isinstance(w, Nvfp4Weight) and w.input_global_scale is not None:
        x, w = w4a4_operands(x, w, w.input_global_scale)
    if isinstance(w, Int4Weight):
        kernel = functools.partial(pallas_kernels.int4_matmul, backend=backend)
    elif isinstance(w, Nvfp4Weight):
        kernel = functools.partial(pallas_kernels.nvfp4_matmul, backend=backend)
    elif isinstance(w, Fp8BlockWeight) and backend != "xla":
        kernel = functools.partial(pallas_kernels.fp8_block_matmul, backend=backend)
    else:
        w = dequantize(w, x.dtype)
        return jnp.einsum("...k,kn->...n", x, w, preferred_element_type=jnp.float32).astype(x.dtype)
    lead = x.shape[:-1]
    return _per_device_kernel(kernel, x.reshape(-1, x.shape[-1]), w, axes, backend).reshape(*lead, -1)


def expert_matmul(x_TK: jax.Array, w: Weight, group_sizes_E: jax.Array, *, backend: str | None = "xla",
                  axes: tuple[str, str, str] | None = None) -> jax.Array:
    """Rows of x sorted by expert, group_sizes_E rows per expert; w [E, K, N] -> [T, N]."""
    backend = pallas_kernels.resolve_backend(backend)
    if isinstance(w, Nvfp4Weight) and w.input_global_scale is not None:  # each row under its expert's scale
        expert_T = jnp.searchsorted(jnp.cumsum(group_sizes_E), jnp.arange(x_TK.shape[0]), side="right")
        x_TK, w = w4a4_operands(x_TK, w, w.input_global_scale[jnp.minimum(expert_T, w.input_global_scale.shape[0] - 1)])
    if isinstance(w, Int4Weight):
        kernel = functools.partial(pallas_kernels.moe_int4_matmul, backend=backend)
    elif isinstance(w, Nvfp4Weight):
        kernel = functools.partial(pallas_kernels.moe_nvfp4_matmul, backend=backend)
    elif isinstance(w, Fp8BlockWeight) and backend != "xla":
        kernel = functools.partial(pallas_kernels.moe_fp8_block_matmul, backend=backend)
    else:
        w = dequantize(w, x_TK.dtype)
        y = jax.lax.ragged_dot(x_TK, w, group_sizes_E, preferred_element_type=jnp.float32)
        return y.astype(x_TK.dtype)
    return _per_device_kernel(kernel, x_TK, w, axes, backend, group_sizes_E)


def w4a4_operands(x: jax.Array, w: Nvfp4Weight, input_global_scale_M1: jax.Array) -> tuple[jax.Array, Nvfp4Weight]:
    """A W4A4 layer as W4A16 operands that compute the same products: x quantized to NVFP4
    (e2m1 * e4m3 scale, exact in x's dtype: quantize_nvfp4_activations) and w with its global scale
    times the input's, so each output is divided by input_global_scale * global_scale once, as FP4
    GEMMs scale their float32 sums (vLLM's alpha)."""
    x_q = pallas_kernels.quantize_nvfp4_activations(x, input_global_scale_M1)
    return x_q, Nvfp4Weight(w.packed_QN, w.scales_GN, w.global_scale * w.input_global_scale, w.group_size)


def _per_device_kernel(kernel, x_MK, w: Quantized, axes, backend, *replicated):
    """kernel(x, values, scales, *per_tensor, *replicated, **format arguments), per device under tensor
    parallelism: a weight split on its output features (column-parallel) gives each device its
    output columns; one split on its input features (row-parallel) its share of the contraction,
    summed over devices. Placement follows split_for_tp, so no weight moves. (The INT4 XLA
    reference runs here too; XLA's partitioner would split it by itself.)"""
    mesh = partitioning.context_mesh() if backend != "xla" and axes else None
    if mesh:
        w, spec = split_for_tp(w, axes, partitioning.tp_size(mesh))  # a placed weight is already re-blocked
    else:
        spec = P(*(None,) * w.stored[0].ndim)
    row, col = spec[-2:]

    def local(x, values, scales, *rest):
        y = kernel(x, values, scales, *rest, **w.kernel_args)
        return jax.lax.psum(y, partitioning.MODEL_AXIS) if row else y

    per_tensor_spec = P(*spec[:-2], None)  # [..., 1]: split as the experts are
    in_specs = (P(None, row), spec, spec) + (per_tensor_spec,) * len(w.per_tensor) + (P(),) * len(replicated)
    run = partitioning.per_device(local, mesh, in_specs, P(None, col))
    return run(x_MK, *w.stored, *w.per_tensor, *replicated)


def reblock(w: Quantized, values_per_scale: tuple[int, int]) -> Quantized:
    """The same weight with finer scale blocks of values_per_scale stored values (each dividing
    w's own): every scale repeated over the blocks it covered, so the values and their products are
    unchanged. The blocks at the end of a dimension that ends mid-block are cut to fit. Host (numpy)
    scales stay on the host: a checkpoint streams onto a mesh this way (mixserve.sharding.placement)."""
    values_per_scale = tuple(values_per_scale)
    if values_per_scale == w.values_per_scale:
        return w
    values, scales = w.stored
    xp = np if isinstance(scales, np.ndarray) else jnp
    for axis, old, new in zip((-2, -1), w.values_per_scale, values_per_scale):
        if new <= 0 or old % new:
            raise ValueError(f"scale blocks of {new} values do not tile blocks of {old}")
        fit = [slice(None)] * scales.ndim
        fit[axis] = slice(0, -(-values.shape[axis] // new))
        scales = xp.repeat(scales, old // new, axis=axis)[tuple(fit)]
    return w.with_stored(values, scales, values_per_scale)


def split_for_tp(w: Quantized, names: tuple, tp: int, expert_parallel: bool = False) -> tuple[Quantized, P]:
    """w re-blocked so that no device's share of its values cuts a scale block
    (partitioning.tp_values_per_scale), and the one PartitionSpec its values and scales then share.
    GLM-4.5's expert width at TP8, 1536 / 8 = 192 rows a device: FP8 128-blocks become 64-row
    blocks, INT4 g128 becomes g64, and each device holds the scales of its own rows only. Works on
    abstract weights too (ShapeDtypeStruct leaves: mixserve.weight_bytes)."""
    finer = functools.partial(reblock, values_per_scale=partitioning.tp_values_per_scale(names, w, tp, expert_parallel))
    w = jax.eval_shape(finer, w) if isinstance(w.stored[0], jax.ShapeDtypeStruct) else finer(w)
    return w, partitioning.quantized_spec(names, w, tp, expert_parallel)


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
        raise ValueError(f"{fmt.kind} group_size {fmt.group_size} does not divide the input dimension {k}")
    if fmt.kind == "nvfp4":
        per_matrix = jax.ShapeDtypeStruct((*lead, 1), jnp.float32)
        return Nvfp4Weight(jax.ShapeDtypeStruct((*lead, k // 8, n), jnp.int32),
                           jax.ShapeDtypeStruct((*lead, k // fmt.group_size, n), jnp.float8_e4m3fn),
                           per_matrix, fmt.group_size, per_matrix if fmt.w4a4 else None)
    return Int4Weight(
        jax.ShapeDtypeStruct((*lead, k // 8, n), jnp.int32),
        jax.ShapeDtypeStruct((*lead, k // fmt.group_size, n), jnp.bfloat16),
        fmt.group_size,
    )
