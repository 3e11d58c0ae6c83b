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


def quantized_split(names: tuple, w, tp: int, expert_parallel: bool = False):
    """((input, output) mesh axes of the stored values, the same of the scales) of a quantized weight
    (models.weights.QUANTIZED): values [..., rows, columns], scales [..., rows / r, columns / c],
    (r, c) = w.values_per_scale (INT4: (group / 8 packed rows, 1), FP8 blocks: (128, 128)).

    A dimension splits its values wherever tp divides them (whole packed words). Its scales split
    alike where each device's values fill whole scale blocks; otherwise a share would cut a block
    (GLM-4.5's expert width at TP8, 1536 / 8 = 192: 1.5 FP8 blocks, 1.5 INT4 g128 groups), and the
    (tiny) scales stay whole on every device, which takes the scales of its own values
    (models.weights.shard_scales). vLLM refuses to load such shards instead ("... is not divisible by
    weight quantization block_n = 128"; vllm-project/vllm#39046 pads them)."""
    axes = split_axes(expert_parallel)
    values, scales = (x.shape for x in w.stored)
    splits = []
    for d in (-2, -1):
        divisible = names[d] in axes and values[d] % tp == 0
        aligned = divisible and scales[d] % tp == 0 and values[d] == scales[d] * w.values_per_scale[d]
        splits.append((split_if(divisible), split_if(aligned)))
    (values_row, scales_row), (values_col, scales_col) = splits
    return (values_row, values_col), (scales_row, scales_col)


def quantized_specs(names: tuple, w, tp: int, expert_parallel: bool = False) -> tuple[P, P]:
    """The PartitionSpecs of a quantized weight's values and of its scales: leading axes (experts)
    by name, the last two as quantized_split says."""
    lead = spec_for(names[:-2], w.stored[0].shape[:-2], tp, expert_parallel)
    return tuple(P(*lead, *axes) for axes in quantized_split(names, w, tp, expert_parallel))


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
