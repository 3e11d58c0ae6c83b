"""Grouped (MoE) W4A16 matmul over expert-sorted tokens, like `lax.ragged_dot`.

x_TK holds T token rows sorted by expert; group_sizes_E[e] consecutive rows
use expert e's INT4 weights (packed_EQN [E, K/8, N], scales_EGN [E, K/g, N],
layout as in int4_matmul.py). y_TN = x @ dequantize(weights of its expert).

The kernel is int4_matmul's, driven by a work list of row tiles. Each expert
with g rows gets ceil(g / BM) tiles starting at its first row (tiles are not
aligned to BM; x is padded so a tile may read past the last row). The list is
sized statically for the worst case, ceil(T / BM) + min(E, T) tiles, and
unused entries do nothing. So:
  * prefill (many tokens, ragged groups): one tile per BM rows of an expert;
  * decode (few tokens, most experts empty): an empty expert has no tile, so
    its weights are never streamed; only experts with tokens cost bandwidth.
Each tile writes its own [BM, N] block (no two tiles write the same memory),
and y gathers every row from the tile that owns it.
"""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels.backend import resolve_backend
from pallas_kernels.int4_matmul import (
    Int4Tuning, TileSchedule, check_int4_operands, dequantize_int4, int4_tiles, pad_rows, plan_tiling, tile_rows)


def moe_int4_matmul(x_TK: jax.Array, packed_EQN: jax.Array, scales_EGN: jax.Array,
                    group_sizes_E: jax.Array, *, group_size: int,
                    backend: str | None = None, tuning: Int4Tuning = Int4Tuning()) -> jax.Array:
    """Row t of y uses the expert whose group contains t; f32 accumulation, x's dtype.

    Rows past sum(group_sizes_E) belong to no expert and are zero (as in
    lax.ragged_dot). tuning: the kernel's launch choices; not the result.
    """
    backend = resolve_backend(backend)
    if packed_EQN.ndim != 3:
        raise ValueError(f"packed expert weights must be [E, K/8, N], got {packed_EQN.shape}")
    check_int4_operands(x_TK, packed_EQN, scales_EGN, group_size)
    if group_sizes_E.shape != (packed_EQN.shape[0],) or not jnp.issubdtype(group_sizes_E.dtype, jnp.integer):
        raise ValueError(f"group_sizes_E must be int [E={packed_EQN.shape[0]}], got {group_sizes_E.dtype}{group_sizes_E.shape}")
    if backend == "xla":
        return _reference(x_TK, packed_EQN, scales_EGN, group_sizes_E, group_size=group_size)
    return _kernel(x_TK, packed_EQN, scales_EGN, group_sizes_E, group_size=group_size,
                   interpret=backend == "interpret", tuning=tuning)


@functools.partial(jax.jit, static_argnames=("group_size",))
def _reference(x_TK, packed_EQN, scales_EGN, group_sizes_E, *, group_size: int):
    w_EKN = dequantize_int4(packed_EQN, scales_EGN, group_size)
    y_TN = jax.lax.ragged_dot(x_TK.astype(jnp.float32), w_EKN, group_sizes_E.astype(jnp.int32),
                              precision=jax.lax.Precision.HIGHEST)
    return y_TN.astype(x_TK.dtype)


class _RowOwner(NamedTuple):
    """Where row t of y lives in the kernel output [W, BM, N]."""

    tile_T: jax.Array  # int32 index into the work list
    offset_T: jax.Array  # int32 row within that tile
    assigned_T: jax.Array  # bool: False past sum(group_sizes)


def expert_tile_schedule(group_sizes_E: jax.Array, num_rows: int, block_m: int, num_tiles: int):
    """Work list of row tiles (only experts with rows get tiles) and each row's owner tile."""
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


@functools.partial(jax.jit, static_argnames=("group_size", "interpret", "tuning"))
def _kernel(x_TK, packed_EQN, scales_EGN, group_sizes_E, *, group_size: int, interpret: bool,
            tuning: Int4Tuning):
    t, k = x_TK.shape
    num_experts, _, n = packed_EQN.shape
    if t == 0:
        return jnp.zeros((0, n), x_TK.dtype)
    block_m = tile_rows(-(-t // num_experts))  # rows of an average expert
    num_tiles = -(-t // block_m) + min(num_experts, t)
    tiling = plan_tiling(block_m, block_m, n, k, num_tiles, tuning)
    schedule, owner = expert_tile_schedule(group_sizes_E, t, block_m, num_tiles)
    # A tile may start at any row < T.
    y_tiles = int4_tiles(pad_rows(x_TK, block_m, tuning), packed_EQN, scales_EGN, schedule, tiling,
                         group_size=group_size, interpret=interpret)
    y_TN = y_tiles[owner.tile_T, owner.offset_T]
    return jnp.where(owner.assigned_T[:, None], y_TN, 0.0).astype(x_TK.dtype)
