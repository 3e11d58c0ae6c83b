"""Building blocks shared by the three families: norms, linear layers, RoPE, the gated MLP.

Every parameter carries logical axis names (see GLOSSARY in models/__init__.py), so sharding
over devices is a table of rules (`flax.linen.logical_to_mesh_sharding`), not a rewrite.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from models.config import ModelConfig, RopeConfig
from models.weights import BF16, Weight, WeightFormat, abstract_weight, matmul, quantize

Dtype = Any
default_init = nn.initializers.normal(stddev=0.02)


def boxed_weight_init(fmt: WeightFormat, axes: tuple[str, ...], dtype: Dtype, init=default_init):
    """Param initializer for a weight of shape [..., in, out] in `fmt`, every leaf boxed with `axes`.

    A quantized format starts from a random dense weight, rounded to nearest.
    """

    def init_fn(key, shape):
        w = quantize(init(key, shape, jnp.float32).astype(dtype), fmt)
        return jax.tree.map(lambda leaf: nn.Partitioned(leaf, names=axes), w)

    return init_fn


def weight_param(module: nn.Module, name: str, fmt: WeightFormat, axes: tuple[str, ...], dtype: Dtype,
                 shape: tuple[int, ...]) -> Weight:
    """module.param for a weight [..., in, out] in `fmt`. Tensor parallelism may have placed a
    quantized one with finer scale blocks than the format's (models.weights.split_for_tp), so more
    scales than Flax's param check expects: such a weight is checked by its type, its shape, and
    scales that tile its values in blocks dividing the format's."""
    if fmt.kind == "bf16" or not module.has_variable("params", name):
        return module.param(name, boxed_weight_init(fmt, axes, dtype), shape)
    w = nn.unbox(module.get_variable("params", name))
    want = abstract_weight(fmt, shape, dtype)
    quantizes_input = lambda x: getattr(x, "input_global_scale", None) is not None  # W4A4 or not
    if type(w) is not type(want) or tuple(w.shape) != tuple(shape) or quantizes_input(w) != quantizes_input(want):
        raise ValueError(f"parameter {name!r} of {module.name!r} is {type(w).__name__} {tuple(w.shape)}"
                         f"{' with an input scale' * quantizes_input(w)}, expected {fmt} {tuple(shape)}")
    values, scales = w.stored
    tiled = tuple(-(-size // block) for size, block in zip(values.shape[-2:], w.values_per_scale))
    if (any(whole % block for whole, block in zip(want.values_per_scale, w.values_per_scale))
            or scales.shape != (*values.shape[:-2], *tiled)):
        raise ValueError(f"parameter {name!r} of {module.name!r}: scales {scales.shape} in blocks of "
                         f"{w.values_per_scale} do not tile its values {values.shape} in blocks dividing {fmt}'s")
    return w


class RMSNorm(nn.Module):
    """x / rms(x) * scale, normalised in float32 then cast back (as the reference)."""

    eps: float = 1e-6
    dtype: Dtype = jnp.float32
    axis_name: str = "norm"

    @nn.compact
    def __call__(self, x):
        scale = self.param("scale", nn.with_logical_partitioning(nn.initializers.ones, (self.axis_name,)), (x.shape[-1],), self.dtype)
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return scale * normed.astype(x.dtype)


class LayerNorm(nn.Module):
    """Standard LayerNorm with scale and bias, in float32 (the DSA indexer's k_norm)."""

    eps: float = 1e-6
    dtype: Dtype = jnp.float32
    axis_name: str = "norm"

    @nn.compact
    def __call__(self, x):
        part = lambda init: nn.with_logical_partitioning(init, (self.axis_name,))
        scale = self.param("scale", part(nn.initializers.ones), (x.shape[-1],), self.dtype)
        bias = self.param("bias", part(nn.initializers.zeros), (x.shape[-1],), self.dtype)
        x32 = x.astype(jnp.float32)
        mean = jnp.mean(x32, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
        y = (x32 - mean) * jax.lax.rsqrt(var + self.eps) * scale.astype(jnp.float32) + bias.astype(jnp.float32)
        return y.astype(x.dtype)


class Linear(nn.Module):
    """y = x @ kernel (+ bias). kernel [in, out] in any WeightFormat; axes = (in_axis, out_axis)."""

    features: int
    axes: tuple[str, str]
    use_bias: bool = False
    fmt: WeightFormat = BF16
    dtype: Dtype = jnp.bfloat16
    backend: str = "xla"

    @nn.compact
    def __call__(self, x):
        kernel = weight_param(self, "kernel", self.fmt, self.axes, self.dtype, (x.shape[-1], self.features))
        y = matmul(x.astype(self.dtype), kernel, backend=self.backend, axes=self.axes)
        if self.use_bias:
            bias = self.param("bias", nn.with_logical_partitioning(nn.initializers.zeros, self.axes[1:]), (self.features,), self.dtype)
            y = y + bias.astype(y.dtype)
        return y


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)): the dense MLP and the shared experts."""

    intermediate_size: int
    fmt: WeightFormat = BF16
    dtype: Dtype = jnp.bfloat16
    backend: str = "xla"

    @nn.compact
    def __call__(self, x):
        lin = dict(fmt=self.fmt, dtype=self.dtype, backend=self.backend)
        gate = Linear(self.intermediate_size, ("embed", "mlp"), name="gate_proj", **lin)(x)
        up = Linear(self.intermediate_size, ("embed", "mlp"), name="up_proj", **lin)(x)
        return Linear(x.shape[-1], ("mlp", "embed"), name="down_proj", **lin)(nn.silu(gate) * up)


# ---- rotary embeddings --------------------------------------------------------------------------


def rope_frequencies(rope: RopeConfig, dim: int) -> tuple[np.ndarray, float]:
    """(inv_freq [dim/2] float32, attention_factor) exactly as transformers computes them."""
    exponents = np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)
    pos_freqs = np.power(np.float32(rope.theta), exponents, dtype=np.float32)
    if rope.type == "default":
        return (np.float32(1.0) / pos_freqs).astype(np.float32), 1.0

    factor = rope.factor

    def get_mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * np.log(scale) + 1.0

    attention_factor = rope.attention_factor
    if attention_factor is None:
        if rope.mscale and rope.mscale_all_dim:
            attention_factor = float(get_mscale(factor, rope.mscale) / get_mscale(factor, rope.mscale_all_dim))
        else:
            attention_factor = float(get_mscale(factor))

    orig = rope.original_max_position_embeddings

    def correction_dim(rotations):
        return (dim * np.log(orig / (rotations * 2 * np.pi))) / (2 * np.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = np.floor(low), np.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # the reference's guard against a zero-width ramp
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
    extrapolation = (1 - ramp).astype(np.float32)
    inv_extra = np.float32(1.0) / pos_freqs
    inv_inter = np.float32(1.0) / (np.float32(factor) * pos_freqs)
    inv_freq = inv_inter * (1 - extrapolation) + inv_extra * extrapolation
    return inv_freq.astype(np.float32), attention_factor


def rope_cos_sin(cfg: ModelConfig, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """cos, sin [..., rotary_dim/2] in float32 (already times YaRN's attention factor)."""
    inv_freq, attention_factor = rope_frequencies(cfg.rope, cfg.rotary_dim)
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
    return jnp.cos(freqs) * attention_factor, jnp.sin(freqs) * attention_factor


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array, *, interleaved: bool) -> jax.Array:
    """Rotate x [..., T, (heads,) R] by cos/sin [..., T, R/2].

    interleaved: pairs (x0, x1), (x2, x3)... are rotated, and the result is written de-interleaved
    ([all first components, all second components]), exactly as transformers does for DeepSeek.
    Since q and k get the same permutation, their dot products are those of interleaved RoPE.
    Otherwise: the rotate-half convention (pairs (x_i, x_{i + R/2})).
    """
    if x.ndim == cos.ndim + 1:  # a heads axis between T and R
        cos, sin = cos[..., None, :], sin[..., None, :]
    cos, sin = cos.astype(x.dtype), sin.astype(x.dtype)
    if interleaved:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    else:
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
