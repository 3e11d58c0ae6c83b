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

import math

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
    return P(*(split_if(_splits(name, size, tp, expert_parallel)) for name, size in zip(names, shape)))


def tp_values_per_scale(names: tuple, w, tp: int, expert_parallel: bool = False) -> tuple[int, int]:
    """Stored values per scale, along (rows, columns), at which every device's share of a quantized
    weight (models.weights.QUANTIZED: values [..., rows, columns], scales [..., rows / r, columns / c],
    (r, c) = w.values_per_scale) holds whole scale blocks.

    That is w's own, except where tp splits a dimension into shares of s values that cut its blocks
    of v: then gcd(v, s), which tiles both the share (it starts at a multiple of s) and the blocks.
    GLM-4.5's expert width at TP8 is 1536 / 8 = 192 rows, 1.5 FP8 blocks or INT4 g128 groups: blocks
    of 64. vLLM refuses to load such shards instead ("... is not divisible by weight quantization
    block_n = 128"; vllm-project/vllm#39046 pads them). A device holds (v / b) / tp of the whole
    scales: a quarter for GLM-4.5 at TP8, all of them (as many as keeping them whole) for
    GLM-4.5-Air's 176 rows at g128; more only where v / b > tp, which no preset has at TP8."""
    values = w.stored[0].shape
    return tuple(math.gcd(v, values[d] // tp) if _splits(names[d], values[d], tp, expert_parallel) else v
                 for d, v in zip((-2, -1), w.values_per_scale))


def quantized_spec(names: tuple, w, tp: int, expert_parallel: bool = False) -> P:
    """The one PartitionSpec of a quantized weight's values and of its scales: leading axes (experts)
    by name, the last two wherever tp divides the values (whole packed words). Its scales must
    already be in blocks that no share cuts (models.weights.split_for_tp re-blocks them)."""
    values = w.stored[0].shape
    if tp_values_per_scale(names, w, tp, expert_parallel) != tuple(w.values_per_scale):
        raise ValueError(f"scale blocks of {w.values_per_scale} values are cut by {tp}-way shares of {values}: "
                         "re-block them first (models.weights.split_for_tp)")
    lead = spec_for(names[:-2], values[:-2], tp, expert_parallel)
    return P(*lead, *(split_if(_splits(names[d], values[d], tp, expert_parallel)) for d in (-2, -1)))


def unsplit_axes(names: tuple, shape: tuple[int, ...], tp: int, expert_parallel: bool = False) -> set[tuple[str, int]]:
    """(name, size) of the axes tensor parallelism splits that tp does not divide: replicated instead."""
    return {(name, size) for name, size in zip(names, shape) if name in split_axes(expert_parallel) and size % tp}


def _splits(name: str, size: int, tp: int, expert_parallel: bool) -> bool:
    return name in split_axes(expert_parallel) and size % tp == 0


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
