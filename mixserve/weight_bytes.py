"""`mixserve.weight_bytes`: bytes of a model's weights in a format, by component and per GPU, abstractly.

Nothing is allocated: the sizes come from jax.eval_shape of `Transformer(cfg, plan).init`, so every
format's overhead is the one its parameter type really carries (FP8: 1 byte per weight plus a
float32 scale per 128x128 block; INT4: packed int32 plus a bf16 scale per group).

Tensor-parallel split (per_gpu): everything is divided tp ways (attention heads, MLP and shared
expert columns, routed experts by TP or EP alike, embeddings and lm_head vocab-parallel) except
what SGLang's DeepSeek/GLM models replicate on every rank: norms, the router, MLA's low-rank
down-projections (q_a_proj, kv_a_proj_with_mqa) and the DSA indexer (wq_b, wk, weights_proj, k_norm).

`device_bytes` is the other view: the bytes of the main model that one device holds under
mixserve's own placement (mixserve/sharding.py's rules: a quantized weight's scales are re-blocked
where a device's share would cut their blocks, models.weights.split_for_tp), at tensor or expert
parallelism.

MTP: `count_params` leaves the next-token-prediction layer out (it is not part of the forward), but
checkpoints ship it, so `mtp` estimates it: one more decoder layer shaped like the last one, plus
eh_proj [2*hidden, hidden] in the linear format and three hidden-size norms (enorm, hnorm,
shared_head.norm). Its embedding and head are shared with the main model (GLM-5.x ships no copies).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Literal

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from models.config import ModelConfig
from models.kv import NoCache
from models.partitioning import check_expert_parallel, spec_for
from models.presets import get_preset
from models.transformer import DecoderLayer, Transformer
from models.weights import BF16, QUANTIZED, WeightFormat, WeightPlan, abstract_weight, split_for_tp

FORMATS = {"bf16": BF16, "fp8": WeightFormat("fp8_block"), "nvfp4": WeightFormat("nvfp4")}
REPLICATED = ("q_a_proj", "kv_a_proj_with_mqa", "indexer", "gate")  # module names kept whole on every rank
Component = Literal["experts", "attention", "dense", "embeddings", "other"]
COMPONENTS = ("experts", "attention", "dense", "embeddings", "other")


@dataclasses.dataclass(frozen=True)
class WeightBytes:
    """Bytes per component (main model, MTP apart), and the per-GPU share at tensor parallelism tp."""

    plan: WeightPlan
    tp: int
    experts: int  # routed experts
    attention: int  # attention projections incl. the DSA indexer
    dense: int  # dense MLP layers + shared experts
    embeddings: int  # embed_tokens + lm_head
    other: int  # norms, router, biases
    mtp: int  # the MTP layer(s) a checkpoint ships (estimate, see module doc)
    replicated: int  # bytes of main model + MTP that every GPU holds whole

    @property
    def total(self) -> int:
        """Main model only, the count_params convention."""
        return self.experts + self.attention + self.dense + self.embeddings + self.other

    @property
    def checkpoint(self) -> int:
        """What a checkpoint directory holds: main model + MTP."""
        return self.total + self.mtp

    @property
    def per_gpu(self) -> float:
        """Checkpoint bytes on one GPU: replicated parts whole, the rest split tp ways."""
        return self.replicated + (self.checkpoint - self.replicated) / self.tp


def resolve_plan(fmt: str, group_size: int = 32, scope: str | None = None) -> WeightPlan:
    """Format name + scope -> WeightPlan. scope None: "all" for fp8 (the DeepSeek/GLM FP8 checkpoints
    quantize every linear layer), "experts" for int4 (Kimi K2 Thinking's INT4 covers routed experts
    only) and nvfp4 (the same plan, in the other 4-bit format)."""
    if fmt == "int4":
        quant = WeightFormat("int4", group_size)
    elif fmt in FORMATS:
        quant = FORMATS[fmt]
    else:
        raise ValueError(f"unknown format {fmt!r}; expected bf16, fp8, int4 or nvfp4")
    scope = scope or ("all" if fmt == "fp8" else "experts")
    if scope not in ("experts", "all"):
        raise ValueError(f"scope must be 'experts' or 'all', got {scope!r}")
    return WeightPlan(experts=quant, linear=quant if scope == "all" else BF16)


def weight_bytes(preset_or_config: str | ModelConfig, format: str = "bf16", group_size: int = 32, *,
                 scope: str | None = None, tp: int = 1, plan: WeightPlan | None = None) -> WeightBytes:
    """Weight bytes of a model (bf16 dtype for everything the plan keeps unquantized).

    `plan` (general form) overrides format/group_size/scope, e.g. WeightPlan(experts=int4, linear=fp8).
    """
    cfg = get_preset(preset_or_config) if isinstance(preset_or_config, str) else preset_or_config
    plan = plan or resolve_plan(format, group_size, scope)
    if tp < 1:
        raise ValueError(f"tp must be >= 1, got {tp}")
    tally = Counter()
    for init, count in _inits(cfg, plan):
        tally.update({key: count * nbytes for key, nbytes in _tally(init).items()})
    mtp = Counter()
    for _ in range(cfg.num_mtp_layers):
        mtp += _mtp_tally(cfg, plan)
    return WeightBytes(plan, tp, **{c: tally[c] for c in COMPONENTS}, mtp=sum(mtp[c] for c in COMPONENTS),
                       replicated=tally["replicated"] + mtp["replicated"])


def device_bytes(preset_or_config: str | ModelConfig, plan: WeightPlan, tp: int, expert_parallel: bool = False,
                 dtype=jnp.bfloat16) -> int:
    """Bytes of the main model on the fullest device when mixserve.sharding places it over tp
    devices, with the routed experts split by hidden width (TP) or by expert (EP); dtype is the
    model's (what the plan leaves unquantized). Abstract, like weight_bytes."""
    cfg = get_preset(preset_or_config) if isinstance(preset_or_config, str) else preset_or_config
    if expert_parallel:
        check_expert_parallel(cfg.n_routed_experts, tp)
    return sum(count * _device_share(init, tp, expert_parallel) for init, count in _inits(cfg, plan, dtype))


def _inits(cfg: ModelConfig, plan: WeightPlan, dtype=jnp.bfloat16) -> list[tuple[object, int]]:
    """(init, how many) covering the model: the Transformer without its layers (embeddings, final
    norm, lm_head), then each kind of layer once, times its count. Layers differ only in dense vs
    MoE MLP and whether they run the DSA indexer."""
    outer = cfg.replace(num_layers=0, indexer_types=())
    kind = lambda i: (cfg.is_moe_layer(i), cfg.runs_indexer(i))
    counts = Counter(kind(i) for i in range(cfg.num_layers))
    first = {}
    for i in range(cfg.num_layers):
        first.setdefault(kind(i), i)
    outer_init = lambda: Transformer(outer, plan, dtype).init(jax.random.key(0), jnp.zeros((1, 1), jnp.int32))
    return [(outer_init, 1)] + [(_layer_init(cfg, plan, first[k], dtype), n) for k, n in counts.items()]


def _tally(init) -> Counter:
    """Bytes per component of the params `init` creates (abstractly), and the replicated bytes."""
    params = nn.unbox(jax.eval_shape(init)["params"])
    tally = Counter()
    for key_path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        path = tuple(getattr(k, "key", getattr(k, "name", None)) for k in key_path)
        nbytes = leaf.size * jnp.dtype(leaf.dtype).itemsize
        tally[_component(path)] += nbytes
        tally["replicated"] += nbytes if _replicated(path) else 0
    return tally


def _device_share(init, tp: int, expert_parallel: bool) -> int:
    """Bytes of the params `init` creates that one device holds under mixserve.sharding's rules."""
    boxed = jax.eval_shape(init)["params"]

    def share(leaf, names) -> int:
        if isinstance(leaf, QUANTIZED):
            leaf, spec = split_for_tp(leaf, tuple(names.stored[0]), tp, expert_parallel)
            return (sum(_split_bytes(part, spec, tp) for part in leaf.stored)
                    + sum(_split_bytes(part, P(*spec[:-2], None), tp) for part in leaf.per_tensor))
        return _split_bytes(leaf, spec_for(tuple(names), leaf.shape, tp, expert_parallel), tp)

    is_leaf = lambda x: isinstance(x, QUANTIZED)
    return sum(jax.tree.leaves(jax.tree.map(share, nn.unbox(boxed), nn.get_partition_spec(boxed), is_leaf=is_leaf)))


def _split_bytes(leaf, spec, tp: int) -> int:
    splits = sum(axis is not None for axis in spec)
    assert splits <= 1, spec  # one mesh axis: at most one dimension of an array splits over it
    return leaf.size * jnp.dtype(leaf.dtype).itemsize // tp**splits


def _layer_init(cfg: ModelConfig, plan: WeightPlan, layer: int, dtype=jnp.bfloat16):
    x = jnp.zeros((1, 1, cfg.hidden_size), dtype)
    cos = sin = jnp.zeros((1, 1, cfg.rotary_dim // 2), jnp.float32)
    return lambda: DecoderLayer(cfg, layer, plan, dtype).init(jax.random.key(0), x, cos, sin, NoCache().layer(layer))


def _component(path: tuple[str, ...]) -> Component:
    if path[0] in ("embed_tokens", "lm_head"):
        return "embeddings"
    if "experts" in path:
        return "experts"
    matmul = any(p in ("kernel", "values_KN", "scale_inv_kn", "packed_QN", "scales_GN", "global_scale") for p in path[-2:])
    if matmul and "self_attn" in path:
        return "attention"
    if matmul and "mlp" in path and "gate" not in path:  # mlp/gate is the router
        return "dense"
    return "other"


def _replicated(path: tuple[str, ...]) -> bool:
    return _component(path) == "other" or any(name in path for name in REPLICATED)


def _mtp_tally(cfg: ModelConfig, plan: WeightPlan) -> Counter:
    """One MTP layer: a decoder layer like the last, eh_proj (linear format), 3 replicated norms."""
    d = cfg.hidden_size
    tally = _tally(_layer_init(cfg, plan, cfg.num_layers - 1))
    eh_proj = abstract_weight(plan.linear, (2 * d, d), jnp.bfloat16)
    tally["dense"] += sum(leaf.size * jnp.dtype(leaf.dtype).itemsize for leaf in jax.tree.leaves(eh_proj))
    tally["other"] += 3 * d * 2
    tally["replicated"] += 3 * d * 2
    return tally
