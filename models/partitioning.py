"""Tensor parallelism's split of the models' logical axes, shared by the runtime (which places
parameters and pools: mixserve/sharding.py) and the kernel calls (which run per device).

Megatron-style: attention heads, the MLP and expert hidden widths and the vocabulary are split
over the mesh axis "model"; every other axis is replicated, and so is an axis whose size does not
divide by the mesh's "model" size. With expert parallelism the routed experts are split by expert
instead (E/n whole experts per device, SGLang's `--ep-size`): models/moe.py runs each device's
experts on every token under shard_map and sums the devices' outputs.

XLA's partitioner splits the jnp code by itself, but a Pallas kernel is one opaque custom call
to it: left alone it would gather its operands and run whole on every device. `per_device` runs a
kernel under shard_map instead, on each device's share, when the step is traced inside
`jax.set_mesh(mesh)` (the engine does this) with a "model" axis of size > 1.
"""

from __future__ import annotations

import jax
from jax.sharding import PartitionSpec as P

MODEL_AXIS = "model"
TP_AXES = frozenset({"heads", "kv_heads", "mlp", "moe_mlp", "vocab"})
EP_AXES = TP_AXES - {"moe_mlp"} | {"experts"}


def split_axes(expert_parallel: bool) -> frozenset[str]:
    """The logical axes split over "model": the experts' hidden width (TP) or the experts themselves (EP)."""
    return EP_AXES if expert_parallel else TP_AXES


def tp_size(mesh) -> int:
    return 1 if mesh is None or mesh.empty else dict(mesh.shape).get(MODEL_AXIS, 1)


def spec_for(names: tuple, shape: tuple[int, ...], tp: int, expert_parallel: bool = False) -> P:
    """One array's PartitionSpec from its logical axis names."""
    axes = split_axes(expert_parallel)
    return P(*(split_if(name in axes and size % tp == 0) for name, size in zip(names, shape)))


def int4_split(names: tuple, packed_shape: tuple[int, ...], scales_shape: tuple[int, ...], tp: int,
               expert_parallel: bool = False):
    """(input, output) mesh axes of an INT4 weight [..., K/8 | K/group, N]: its input features split
    only where the packed rows and the scale groups both divide, so each device keeps whole groups."""
    axes, (q, n), g = split_axes(expert_parallel), packed_shape[-2:], scales_shape[-2]
    return (split_if(names[-2] in axes and q % tp == 0 and g % tp == 0),
            split_if(names[-1] in axes and n % tp == 0))


def int4_spec(names: tuple, packed_shape: tuple[int, ...], scales_shape: tuple[int, ...], tp: int,
              expert_parallel: bool = False) -> P:
    """The PartitionSpec of an INT4 weight's packed values and scales alike: leading axes (experts)
    by name, the last two as int4_split says."""
    lead = spec_for(names[:-2], packed_shape[:-2], tp, expert_parallel)
    return P(*lead, *int4_split(names, packed_shape, scales_shape, tp, expert_parallel))


def check_expert_parallel(num_experts: int, tp: int) -> None:
    if num_experts % tp:
        raise ValueError(f"expert parallelism over {tp} devices needs the routed expert count ({num_experts}) "
                         "to divide by it")


def context_mesh():
    """The mesh the step is traced under, if it splits anything (a "model" axis of size > 1) and
    the code is not already per device (inside shard_map over "model", e.g. an expert-parallel MoE)."""
    mesh = jax.sharding.get_abstract_mesh()
    return mesh if tp_size(mesh) > 1 and MODEL_AXIS not in mesh.manual_axes else None


def per_device(fn, mesh, in_specs: tuple, out_specs):
    """fn on each device's share of its arguments (shard_map over mesh); fn itself without one."""
    return fn if mesh is None else jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)


def split_if(condition: bool):
    """The mesh axis for a dimension that is split when condition holds, else None (replicated)."""
    return MODEL_AXIS if condition else None
