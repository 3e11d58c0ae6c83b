"""FP8 with a scale per token and per tile of columns: FlashMLA's FP8 KV layout.

DeepSeek-V3.2's sparse FlashMLA (vLLM's "fp8_ds_mla") stores each MLA latent as
its L = 512 nope values in float8_e4m3fn with one float32 scale per 128-column
tile, and its R = 64 RoPE values in bfloat16: 512 + 16 + 128 = 656 bytes per
token, against 576 with one per-tensor scale and 1152 in BF16. A per-tensor scale
is fixed before serving; a per-token tile scale follows each token's own range,
which is what one calibrated scalar cannot do for the latents of every layer (SGLang
issue 22671: GLM-5.1 lost 19 points of AIME with per-tensor FP8 KV).

Scales here are powers of two: s = 2^ceil(log2(amax / 448)), so a tile's largest
value lands in (224, 448]. Dividing by s is exact, and so is s * stored in float32
and in bfloat16 (an e4m3 value has 4 significant bits, bf16 keeps 8, and the floor on s keeps the products
normal). A tile's scale follows its finite values: an infinity saturates to
±448 s and a NaN stays NaN, as in the per-tensor pools, without coarsening the
rest of its tile (a tile with no nonzero finite value takes s = 1 then). The only rounding is e4m3's own: |error| <= 2^-4 |x| for values
at or above s * 2^-6 (e4m3's smallest normal), and <= s * 2^-10 below it. The kernels
therefore dequantize into bf16 tensor-core operands exactly. The cost against a
free float32 scale is at most one binade of range, which e4m3's relative precision
does not feel.

Shapes: x [..., C] with C = tiles * tile; stored [..., C] float8_e4m3fn;
scales [..., tiles] float32.
"""

import jax
import jax.numpy as jnp

E4M3 = jnp.float8_e4m3fn
E4M3_MAX = float(jnp.finfo(E4M3).max)  # 448
TILE = 128  # FlashMLA's tile; a narrower latent (tiny test models) is one tile
# amax is floored here so that s >= 2^-100: s * stored then stays a normal bf16/f32.
_MIN_AMAX = E4M3_MAX * 2.0**-100


def tile_width(columns: int) -> int:
    """Columns per scale: TILE, or all of them when fewer; they must divide evenly."""
    tile = min(TILE, columns)
    if columns % tile:
        raise ValueError(f"{columns} columns do not split into tiles of {tile}")
    return tile


def power_of_two_scale(amax: jax.Array) -> jax.Array:
    """The smallest power of two s with amax / s <= 448 (float32, exact: no log2 rounding)."""
    mantissa, exponent = jnp.frexp(jnp.maximum(amax.astype(jnp.float32), _MIN_AMAX) / E4M3_MAX)
    # amax / 448 = mantissa * 2^exponent with mantissa in [0.5, 1): 0.5 is itself a power of two.
    return jnp.ldexp(jnp.float32(1.0), jnp.where(mantissa == 0.5, exponent - 1, exponent))


def quantize_tiles(x: jax.Array, tile: int) -> tuple[jax.Array, jax.Array]:
    """x [..., C] -> (stored [..., C] e4m3, scales [..., C / tile] f32). NaN stays NaN; ±inf saturates."""
    *lead, columns = x.shape
    tiles = x.astype(jnp.float32).reshape(*lead, columns // tile, tile)
    amax = jnp.max(jnp.where(jnp.isfinite(tiles), jnp.abs(tiles), 0.0), axis=-1)
    # An inf with no nonzero finite value beside it would saturate to 448 x the floor scale, about 0.
    amax = jnp.where((amax == 0) & jnp.any(jnp.isinf(tiles), axis=-1), E4M3_MAX, amax)
    scales = power_of_two_scale(amax)
    # Finite values are already in range (the clamp trims float32 rounding of amax / 448); ±inf saturates.
    stored = jnp.clip(tiles / scales[..., None], -E4M3_MAX, E4M3_MAX).astype(E4M3)
    return stored.reshape(*lead, columns), scales


def dequantize_tiles(stored: jax.Array, scales: jax.Array, dtype=jnp.float32) -> jax.Array:
    """(stored [..., C], scales [..., C / tile]) -> values [..., C] in dtype (exact for bf16/f32)."""
    *lead, columns = stored.shape
    tiles = stored.astype(jnp.float32).reshape(*lead, scales.shape[-1], -1) * scales[..., None]
    return tiles.reshape(*lead, columns).astype(dtype)
