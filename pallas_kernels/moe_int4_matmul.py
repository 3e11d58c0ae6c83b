"""Grouped (MoE) W4A16 matmul over expert-sorted tokens, like `lax.ragged_dot`.

x_TK holds T token rows sorted by expert; group_sizes_E[e] consecutive rows
use expert e's INT4 weights (packed_EQN [E, K/8, N], scales_EGN [E, K/g, N],
layout as in int4_matmul.py). y_TN = x @ dequantize(weights of its expert).

The kernel is int4_matmul's, driven by a work list of row tiles
(weight_stream.grouped_rows):
  * prefill (many tokens, ragged groups): one tile per BM rows of an expert;
  * decode (few tokens, most experts empty): an empty expert has no tile, so
    its weights are never streamed; only experts with tokens cost bandwidth.
"""

import functools

import jax

from pallas_kernels.backend import resolve_backend
from pallas_kernels.int4_matmul import Int4Tuning, check_int4_operands, dequantize_int4, int4_runner
from pallas_kernels.weight_stream import checked_group_sizes, grouped_rows, reference_ragged_dot


def moe_int4_matmul(x_TK: jax.Array, packed_EQN: jax.Array, scales_EGN: jax.Array,
                    group_sizes_E: jax.Array, *, group_size: int,
                    backend: str | None = None, tuning: Int4Tuning = Int4Tuning()) -> jax.Array:
    """Row t of y uses the expert whose group contains t; f32 accumulation, x's dtype.

    Rows past sum(group_sizes_E) belong to no expert and are zero (as in
    lax.ragged_dot); a negative size counts as 0. tuning: the kernel's launch
    choices; not the result.
    """
    backend = resolve_backend(backend)
    if packed_EQN.ndim != 3:
        raise ValueError(f"packed expert weights must be [E, K/8, N], got {packed_EQN.shape}")
    check_int4_operands(x_TK, packed_EQN, scales_EGN, group_size)
    group_sizes_E = checked_group_sizes(group_sizes_E, packed_EQN.shape[0])
    if backend == "xla":
        return _reference(x_TK, packed_EQN, scales_EGN, group_sizes_E, group_size=group_size)
    return _kernel(x_TK, packed_EQN, scales_EGN, group_sizes_E, group_size=group_size,
                   interpret=backend == "interpret", tuning=tuning)


@functools.partial(jax.jit, static_argnames=("group_size",))
def _reference(x_TK, packed_EQN, scales_EGN, group_sizes_E, *, group_size: int):
    return reference_ragged_dot(x_TK, dequantize_int4(packed_EQN, scales_EGN, group_size), group_sizes_E)


@functools.partial(jax.jit, static_argnames=("group_size", "interpret", "tuning"))
def _kernel(x_TK, packed_EQN, scales_EGN, group_sizes_E, *, group_size: int, interpret: bool,
            tuning: Int4Tuning):
    run = int4_runner(packed_EQN, scales_EGN, group_size=group_size, tuning=tuning, interpret=interpret)
    return grouped_rows(x_TK, group_sizes_E, packed_EQN.shape[-1], run)
