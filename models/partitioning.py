"""Tensor parallelism's split of the models' logical axes, shared by the runtime (which places
parameters and pools: mixserve/sharding.py) and the kernel calls (which run per device).

Megatron-style: attention heads, the MLP and expert hidden widths and the vocabulary are split
over the mesh axis "model"; every other axis is replicated, and so is an axis whose size does not
divide by the mesh's "model" size.

XLA's partitioner splits the jnp code by itself, but a Pallas kernel is one opaque custom call
to it: left alone it would gather its operands and run whole on every device. `per_device` runs a
kernel under shard_map instead, on each device's share, when the step is traced inside
`jax.set_mesh(mesh)` (the engine does this) with a "model" axis of size > 1.
"""

from __future__ import annotations

import jax
from jax.sharding import PartitionSpec as P

MODEL_AXIS = "model"
SPLIT_AXES = frozenset({"heads", "kv_heads", "mlp", "moe_mlp", "vocab"})


def tp_size(mesh) -> int:
    return 1 if mesh is None or mesh.empty else dict(mesh.shape).get(MODEL_AXIS, 1)


def spec_for(names: tuple, shape: tuple[int, ...], tp: int) -> P:
    """One array's PartitionSpec from its logical axis names."""
    return P(*(MODEL_AXIS if name in SPLIT_AXES and size % tp == 0 else None for name, size in zip(names, shape)))


def int4_split(names: tuple, packed_shape: tuple[int, ...], scales_shape: tuple[int, ...], tp: int):
    """(input, output) mesh axes of an INT4 weight [..., K/8 | K/group, N]: its input features split
    only where the packed rows and the scale groups both divide, so each device keeps whole groups."""
    (q, n), g = packed_shape[-2:], scales_shape[-2]
    return (split_if(names[-2] in SPLIT_AXES and q % tp == 0 and g % tp == 0),
            split_if(names[-1] in SPLIT_AXES and n % tp == 0))


def context_mesh():
    """The mesh the step is traced under, if it splits anything (a "model" axis of size > 1)."""
    mesh = jax.sharding.get_abstract_mesh()
    return mesh if tp_size(mesh) > 1 else None


def per_device(fn, mesh, in_specs: tuple, out_specs):
    """fn on each device's share of its arguments (shard_map over mesh); fn itself without one."""
    return fn if mesh is None else jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)


def split_if(condition: bool):
    """The mesh axis for a dimension that is split when condition holds, else None (replicated)."""
    return MODEL_AXIS if condition else None
