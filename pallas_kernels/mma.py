"""Tile-shape rules and float32-accumulating dots shared by all kernels.

Triton (the backend of `jax.experimental.pallas.triton`) needs every loaded
block to have a power-of-two number of elements, and its MMA instructions need
tiles of at least 16 rows and a contraction of at least 16.
"""

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

MIN_DOT_ROWS = 16


def padded_rows(rows: int, cap: int | None = None) -> int:
    """Rows of a dot operand block: a power of two, at least one MMA tile."""
    block = max(MIN_DOT_ROWS, pl.next_power_of_2(rows))
    return block if cap is None else min(block, cap)


def pow2_divisor(n: int, cap: int) -> int:
    """Largest power of two <= cap that divides n."""
    block = 1
    while block * 2 <= cap and n % (block * 2) == 0:
        block *= 2
    return block


def _mma_operands(a: jax.Array, b: jax.Array, m: int, k: int, n: int) -> tuple[jax.Array, jax.Array]:
    """The operands as the dot should take them: Triton's MMA (16- and 8-bit
    operands) needs M, N and K of at least 16. Below that it does not refuse:
    on the H200 (2026-11-30) an INT4 kernel with bf16 operands and K = 8 per
    dot compiled and returned exactly twice the product, while the same test
    with float32 operands passed. float32 at HIGHEST precision takes Triton's
    FMA path, which has no minimum; bf16/f16 -> f32 is exact, so a small dot
    (the tiny test models' 8-wide RoPE part) runs in float32. Serving shapes
    are all >= 16 and keep the MMA."""
    if min(m, k, n) < MIN_DOT_ROWS:
        return a.astype(jnp.float32), b.astype(jnp.float32)
    return a, b


def dot_nt(a_MK: jax.Array, b_NK: jax.Array) -> jax.Array:
    """a @ b.T with float32 accumulation (IEEE, not TF32, for f32 operands)."""
    a_MK, b_NK = _mma_operands(a_MK, b_NK, a_MK.shape[0], a_MK.shape[1], b_NK.shape[0])
    return lax.dot_general(a_MK, b_NK, (((1,), (1,)), ((), ())),
                           precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)


def dot_nn(a_MK: jax.Array, b_KN: jax.Array) -> jax.Array:
    """a @ b with float32 accumulation (IEEE, not TF32, for f32 operands)."""
    a_MK, b_KN = _mma_operands(a_MK, b_KN, a_MK.shape[0], a_MK.shape[1], b_KN.shape[1])
    return lax.dot_general(a_MK, b_KN, (((1,), (0,)), ((), ())),
                           precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)


def dot_tt(a_KM: jax.Array, b_NK: jax.Array) -> jax.Array:
    """a.T @ b.T with float32 accumulation (IEEE, not TF32, for f32 operands)."""
    a_KM, b_NK = _mma_operands(a_KM, b_NK, a_KM.shape[1], a_KM.shape[0], b_NK.shape[0])
    return lax.dot_general(a_KM, b_NK, (((0,), (1,)), ((), ())),
                           precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
