"""Tensor parallelism over a device mesh: where the engine places parameters and KV pools.

Every parameter names its axes (`Model.param_axes`); models/partitioning.py says which of them
Megatron-style tensor parallelism splits over the mesh axis "model": attention heads, the MLP and
expert hidden widths, and the vocabulary. Column-parallel projections (q/k/v, gate/up) split
their output, row-parallel ones (o, down) their input, and XLA's SPMD partitioner adds the
all-reduces; the Pallas kernels run per device under shard_map. Every other axis is replicated,
and so is an axis whose size does not divide by the mesh's "model" size (tiny-glm4 has 2 KV
heads: on 4 devices they are replicated, as vLLM replicates KV heads when there are fewer than
devices).

KV pools follow the heads: a GQA pool [KVH, P, S, D] splits its KV heads, so each device holds
1/tp of every token. An MLA pool [P, S, C] holds one latent per token that every head reads,
so each device holds all of it: at TP8 every device still stores Kimi's whole 1,152 B per token
per layer in BF16 (SGLang's reason for DP attention). With split_slots (decode context
parallelism, mixserve/kv_cache.py) each device holds page_size/tp slots of every latent page
instead. The engine's KV budget is per device.
"""

from __future__ import annotations

import dataclasses
import warnings

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from mixserve.kv_cache import SPLIT_ENTRY, bytes_per_token, stored_names
from models.partitioning import MODEL_AXIS, check_expert_parallel, spec_for, tp_size, unsplit_axes
from models.weights import QUANTIZED, reblock, split_for_tp


def tp_mesh(tp: int, first: int = 0) -> Mesh:
    """A 1-D mesh ("model",) over tp devices from device `first` on (on CPU, start Python with
    XLA_FLAGS=--xla_force_host_platform_device_count=N for N devices). Disaggregated serving puts
    its prefill engine on one such mesh and its decode engine on the next."""
    if tp <= 0 or first < 0:
        raise ValueError(f"tp must be positive and first at least 0, got tp={tp}, first={first}")
    if first + tp > jax.device_count():
        raise ValueError(f"devices [{first}, {first + tp}): {jax.device_count()} devices available (on CPU, set "
                         f"XLA_FLAGS=--xla_force_host_platform_device_count={first + tp} before starting Python)")
    return Mesh(jax.devices()[first : first + tp], (MODEL_AXIS,))


def as_auto(mesh: Mesh) -> Mesh:
    """The same devices and names with every axis Auto: the engine's steps are written without
    sharding annotations, and XLA's partitioner propagates the parameters' and pools' shardings."""
    return Mesh(mesh.devices, mesh.axis_names, axis_types=(jax.sharding.AxisType.Auto,) * len(mesh.axis_names))


def placement(params, param_axes, mesh: Mesh, expert_parallel: bool = False):
    """Where each parameter goes: a pytree shaped like the placed params (quantized weights with
    their scales re-blocked where a share would cut them: split_for_tp) whose leaves are functions
    from a leaf of `params` (a host or device array, in flattening order) to that leaf on the mesh.
    params may be abstract (ShapeDtypeStruct leaves): the checkpoint loader places each tensor as it
    is read, from the host, so no device holds a whole split parameter (mixserve.load(..., mesh=);
    a quantized unit that a dense plan dequantizes passes through the default device first)."""
    tp = tp_size(mesh)
    unsplit = set()

    def place(leaf, names):
        quantized = isinstance(leaf, QUANTIZED)
        stored_names, values = (tuple(names.stored[0]), leaf.stored[0]) if quantized else (tuple(names), leaf)
        unsplit.update(unsplit_axes(stored_names, values.shape, tp, expert_parallel))
        if quantized:
            shape_only = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), leaf)
            placed, spec = split_for_tp(shape_only, stored_names, tp, expert_parallel)
            to = NamedSharding(mesh, spec)
            finer = lambda scales: reblock(leaf.with_stored(values, scales), placed.values_per_scale).stored[1]
            per_tensor_to = NamedSharding(mesh, PartitionSpec(*spec[:-2], None))  # [..., 1]: split as the experts are
            per_tensor = tuple(lambda x: jax.device_put(x, per_tensor_to) for _ in leaf.per_tensor)
            return placed.with_stored(lambda v: jax.device_put(v, to), lambda s: jax.device_put(finer(s), to),
                                      per_tensor=per_tensor)
        to = NamedSharding(mesh, spec_for(stored_names, leaf.shape, tp, expert_parallel))
        return lambda x: jax.device_put(x, to)

    where = jax.tree.map(place, params, param_axes, is_leaf=lambda x: isinstance(x, QUANTIZED))
    if unsplit:  # e.g. 64 heads over 3 devices: every device holds all of them
        sizes = {name: sorted(size for n, size in unsplit if n == name) for name, _ in unsplit}
        axes = ", ".join(f"{name} ({', '.join(map(str, sizes[name]))})" for name in sorted(sizes))
        warnings.warn(f"tensor parallelism over {tp} devices replicates the parameters whose split axes {tp} does not "
                      f"divide, each device holding them whole: {axes}")  # once per process: one place warns
    return where


def place_params(params, placement_tree):
    """params placed as placement_tree says (its structure: the placed params')."""
    leaves = [put(x) for put, x in zip(jax.tree.leaves(placement_tree), jax.tree.leaves(params), strict=True)]
    return jax.tree.unflatten(jax.tree.structure(placement_tree), leaves)


def pool_shardings(pools: list[dict], mesh: Mesh, split_slots: bool = False) -> list[dict]:
    """GQA pools split their KV heads (axis 0, when it divides); MLA latent pools replicate, or with
    split_slots (decode context parallelism) split every page's slots (axis 1); indexer pools replicate."""
    tp = tp_size(mesh)
    latent = set(stored_names(pools[0], SPLIT_ENTRY)) if split_slots else set()

    def spec(name: str, pool) -> PartitionSpec:
        if name in ("k", "v") and pool.shape[0] % tp == 0:
            return PartitionSpec(MODEL_AXIS)
        return PartitionSpec(None, MODEL_AXIS) if name in latent else PartitionSpec()

    return [{name: NamedSharding(mesh, spec(name, pool)) for name, pool in layer.items()} for layer in pools]


def check_mesh(mesh: Mesh | None, n_routed_experts: int, expert_parallel: bool) -> None:
    """Named errors for a placement the mesh cannot take, before anything is placed."""
    if mesh is None:
        if expert_parallel:
            raise ValueError("expert_parallel splits the routed experts over a mesh: give one (mixserve.sharding.tp_mesh(n))")
        return
    if MODEL_AXIS not in mesh.shape:
        raise ValueError(f"the mesh needs a {MODEL_AXIS!r} axis to split over, got {tuple(mesh.shape)}")
    if expert_parallel:
        check_expert_parallel(n_routed_experts, tp_size(mesh))


def shard_model(model, mesh: Mesh, expert_parallel: bool = False):
    """The model with its parameters placed on the mesh (a copy of the handle, same config).
    expert_parallel: the routed experts split by expert (E/n whole experts per device) rather than
    by hidden width; the handle's module then runs them so (models/moe.py)."""
    check_mesh(mesh, model.config.n_routed_experts, expert_parallel)
    where = placement(model.params, model.param_axes, mesh, expert_parallel)
    return dataclasses.replace(model, params=place_params(model.params, where), expert_parallel=expert_parallel)


def kv_bytes_per_device(cfg, fmt, mesh: Mesh | None, split_slots: bool = False, mtp: bool = False) -> int:
    """KV bytes per token that one device stores (the MTP draft's layer too, if mtp): GQA's share
    of the KV heads; MLA's whole latent, or with split_slots a 1/tp share of it (plus GLM-5's
    whole index keys)."""
    tp = tp_size(mesh)
    total = bytes_per_token(cfg, fmt, mtp=mtp)
    if cfg.attention_kind == "gqa":
        return total // tp if cfg.num_kv_heads % tp == 0 else total
    if not split_slots:
        return total
    latent = bytes_per_token(cfg, fmt, SPLIT_ENTRY, mtp)
    return total - latent + latent // tp


def bytes_per_device(tree) -> int:
    """The most bytes any one device holds of the arrays in tree (replicated arrays count fully)."""
    per_device: dict = {}
    for leaf in jax.tree.leaves(tree):
        for shard in leaf.addressable_shards:
            per_device[shard.device] = per_device.get(shard.device, 0) + shard.data.nbytes
    return max(per_device.values(), default=0)
