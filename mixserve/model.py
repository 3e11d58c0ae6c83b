"""`mixserve.load` and the `Model` handle: config + params + tokenizer + a jitted forward."""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from mixserve import sharding
from mixserve.checkpoint import (checkpoint_index, detect_mtp_plan, detect_plan, has_mtp, load_params, read_config,
                                 read_kv_scales)
from mixserve.chat import ChatTemplate
from mixserve.device_memory import buffers, host_copy
from mixserve.tokenizer import Tokenizer, load_tokenizer
from models.config import ModelConfig
from models.presets import FULL_PRESETS, PRESETS, TINY_PRESETS, get_preset
from models.transformer import Transformer
from models.weights import WeightPlan

DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32, "float16": jnp.float16}


def _dtype(name) -> Any:
    if isinstance(name, str):
        if name not in DTYPES:
            raise ValueError(f"unknown dtype {name!r}; expected one of {sorted(DTYPES)}")
        return DTYPES[name]
    return jnp.dtype(name).type


@dataclasses.dataclass
class Model:
    """A loaded model. `params` is a plain pytree of arrays (and quantized-weight dataclasses);
    `param_axes` holds the logical axis names of every leaf, for sharding rules."""

    config: ModelConfig
    params: Any
    tokenizer: Tokenizer | None = None
    plan: WeightPlan = WeightPlan()
    dtype: Any = jnp.bfloat16
    backend: str = "xla"
    source: str = ""
    expert_parallel: bool = False  # set by mixserve.sharding.shard_model, with the experts' placement
    mtp_plan: WeightPlan | None = None  # the MTP layer's formats; None: the model holds no MTP layer
    # The checkpoint's calibrated FP8 KV scales (checkpoint.read_kv_scales): (k, v) float32, one per
    # cache layer; an Engine with an FP8 KV cache uses them unless given k_scale/v_scale.
    kv_scales: tuple[np.ndarray, np.ndarray] | None = None
    chat_template: ChatTemplate | None = None  # the checkpoint's (mixserve/chat.py); None: it ships none

    @property
    def module(self) -> Transformer:
        return Transformer(self.config, self.plan, self.dtype, self.backend, self.expert_parallel, self.mtp_plan)

    @property
    def has_mtp(self) -> bool:
        """Does it hold the MTP layer (the speculative-decoding draft: Engine(speculative_tokens=...))?"""
        return self.mtp_plan is not None

    @functools.cached_property
    def _logits_fn(self):
        return jax.jit(lambda params, ids, routes=None, chosen=None: self.module.apply(
            {"params": params}, ids, routed_experts=routes, indexer_topk=chosen))

    def logits(self, input_ids, routed_experts=None, indexer_topk=None) -> jax.Array:
        """int32 [B, T] -> float32 [B, T, vocab]: a full causal forward without any cache.
        routed_experts (optional int [B, T, MoE layers, top-k]): routing replay, each token sent to
        these experts (a rollout's Result.routed_experts holds them for tokens[:-1], the positions
        whose logits score tokens[1:]).
        indexer_topk (optional int [B, T, indexer layers, index_topk], GLM-5): DSA indexer replay,
        each token attending to these positions (a rollout's Result.indexer_topk, likewise)."""
        ids = jnp.asarray(input_ids, jnp.int32)
        if ids.ndim != 2:
            raise ValueError(f"input_ids must be [batch, time], got shape {ids.shape}")
        return self._logits_fn(self.params, ids, None if routed_experts is None else self.replayed(routed_experts, ids.shape),
                               None if indexer_topk is None else self.replayed_indexer_topk(indexer_topk, ids.shape))

    def replayed(self, routed_experts, shape: tuple[int, int]) -> jax.Array:
        """routed_experts checked for a forward over `shape` [B, T] tokens, as int32 (Transformer's
        routed_experts): one row of top-k distinct experts per token and MoE layer (a padding
        token's too). A bad row would not fail by name in the forward (an id past the last expert
        gathers NaN weights, a negative one wraps around), so it fails here."""
        cfg, routes = self.config, np.asarray(routed_experts)
        want = (*shape, len(cfg.moe_layers), cfg.num_experts_per_tok)
        if routes.shape != want:
            raise ValueError(f"routed_experts must be [batch, time, MoE layers, top-k] = {list(want)}, got "
                             f"{list(routes.shape)}")
        if routes.size and (not np.issubdtype(routes.dtype, np.integer) or routes.min() < 0
                            or routes.max() >= cfg.n_routed_experts):
            raise ValueError(f"routed_experts must be integer expert ids in [0, {cfg.n_routed_experts}), got "
                             f"{routes.dtype} in [{routes.min()}, {routes.max()}]")
        ordered = np.sort(routes, axis=-1)
        if (ordered[..., 1:] == ordered[..., :-1]).any():
            raise ValueError("routed_experts names an expert twice for one token and layer")
        return jnp.asarray(routes, jnp.int32)

    def replayed_indexer_topk(self, indexer_topk, shape: tuple[int, int]) -> jax.Array:
        """indexer_topk checked for a forward over `shape` [B, T] tokens, as int32 (Transformer's
        indexer_topk): per token and indexer layer, positions at or before the token's, -1 for
        none, at least one. A later position would let a token see the future, and a row of none
        would attend to every key alike (the mask's fill is finite), so they fail here."""
        cfg, chosen = self.config, np.asarray(indexer_topk)
        if not cfg.indexer_layers:
            raise ValueError("indexer_topk needs a model with a DSA indexer (GLM-5): this one has none")
        want = (*shape, len(cfg.indexer_layers), cfg.index_topk)
        if chosen.shape != want:
            raise ValueError(f"indexer_topk must be [batch, time, indexer layers, index_topk] = {list(want)}, got "
                             f"{list(chosen.shape)}")
        if not np.issubdtype(chosen.dtype, np.integer):
            raise ValueError(f"indexer_topk must be integer positions, got {chosen.dtype}")
        token_BT11 = np.arange(shape[1])[None, :, None, None]
        if ((chosen < -1) | (chosen > token_BT11)).any():
            raise ValueError("indexer_topk must hold, for token t, positions in [0, t] (or -1: none)")
        if not (chosen >= 0).any(axis=-1).all():
            raise ValueError("indexer_topk chooses no position for a token")
        return jnp.asarray(chosen, jnp.int32)

    @functools.cached_property
    def param_axes(self):
        boxed = jax.eval_shape(lambda: self.module.init(jax.random.key(0), jnp.zeros((1, 1), jnp.int32)))["params"]
        return nn.get_partition_spec(boxed)


def placed_like(served: Model, new: Model, name: str = "model", made: dict | None = None) -> Model:
    """served with new's weights, each array placed where served's is (which must be committed:
    `committed`): what an engine swaps in to serve new weights (Engine.update_weights) without
    compiling anything again. new must be the same model in the same formats and precision,
    array for array; a ValueError names the first difference. The rest of served (tokenizer,
    chat template, KV scales) stays. made: arrays placed by earlier calls, reused (see `copied`)."""
    for field in ("config", "plan", "mtp_plan", "dtype", "backend"):
        a, b = getattr(served, field), getattr(new, field)
        if a != b:
            if field == "config":
                field = next(f.name for f in dataclasses.fields(a) if getattr(a, f.name) != getattr(b, f.name))
                a, b = getattr(served.config, field), getattr(new.config, field)
            elif field == "dtype":
                a, b = jnp.dtype(a).name, jnp.dtype(b).name
            raise ValueError(f"{name}: its {field} is {b!r}, the served model's {a!r}: weights are swapped only "
                             "for the same model in the same formats")
    old, old_def = jax.tree_util.tree_flatten_with_path(served.params)
    leaves, new_def = jax.tree_util.tree_flatten(new.params)
    if new_def != old_def:
        raise ValueError(f"{name}: its parameters are another tree than the served model's")
    for (path, a), b in zip(old, leaves):
        if a.shape != b.shape or a.dtype != b.dtype:
            raise ValueError(f"{name}: {jax.tree_util.keystr(path)} is {b.dtype}{list(b.shape)}, the served "
                             f"model's {a.dtype}{list(a.shape)}")

    def place(a, b):  # jit's cache keys on each argument's sharding, committedness and weak type: all as a's
        b = jax.device_put(b, a.sharding)
        return jax.lax.convert_element_type(b, a.dtype) if b.weak_type and not a.weak_type else b

    # by id: the host copies are held (Engine._host_weights) while they are placed
    placed = [copied(lambda b: place(a, b), b, made, (id(b), a.sharding)) for (_, a), b in zip(old, leaves)]
    return dataclasses.replace(served, params=jax.tree_util.tree_unflatten(old_def, placed))


def copied(copy, x, made: dict | None, key):
    """copy(x), or the copy made before of what key names: two engines of a disaggregated pair
    on one device may serve the same buffers, and keep sharing them through sleep's host copies
    and wake_up's placement."""
    if made is None:
        return copy(x)
    if key not in made:
        made[key] = copy(x)
    return made[key]


def skeleton(model: Model) -> Model:
    """model with each parameter replaced by its shape, dtype and placement (a ShapeDtypeStruct):
    enough for placed_like to place weights as these were, once these are let go (Engine.sleep)."""
    return dataclasses.replace(model, params=jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding, weak_type=x.weak_type), model.params))


def on_host(model: Model, made: dict | None = None) -> Model:
    """model with each parameter copied to host memory, whole (a split one gathered). made: as
    `copied`'s."""
    return dataclasses.replace(model, params=jax.tree.map(lambda x: copied(host_copy, x, made, tuple(buffers(x))),
                                                          model.params))


def committed(model: Model) -> Model:
    """model with each parameter committed to the device it is on (no copy; a host array: to the
    default device), as placed_like places new weights."""
    device = jax.devices()[0]
    return dataclasses.replace(model, params=jax.tree.map(
        lambda x: jax.device_put(x, x.sharding if isinstance(x, jax.Array) else device), model.params))


def init_params(config: ModelConfig, plan: WeightPlan, dtype, seed: int, mtp_plan: WeightPlan | None = None):
    variables = _jitted_init(Transformer(config, plan, dtype, mtp_plan=mtp_plan))(jax.random.key(seed))
    return nn.unbox(variables["params"])


@functools.lru_cache(maxsize=8)
def _jitted_init(module: Transformer):
    """module.init, jitted once per module (hashable: its config and plan) for the last 8 asked
    for: loading a preset again compiles nothing (1.4 s for tiny-kimi on a CPU otherwise)."""
    return jax.jit(lambda key: module.init(key, jnp.zeros((1, 1), jnp.int32)))


def load(path_or_preset: str, *, dtype="bfloat16", seed: int = 0, plan: WeightPlan | None = None,
         backend: str = "xla", progress: bool = True, mesh=None, expert_parallel: bool = False,
         nvfp4_activations: bool = False, mtp: bool | None = None) -> Model:
    """A directory loads an HF checkpoint (BF16, FP8 block, compressed-tensors INT4 or NVFP4, ModelOpt NVFP4);
    a preset name builds randomly initialised weights (tiny presets only).

    mesh: place the parameters on it as they are read (tensor parallelism over its "model" axis,
    expert_parallel: routed experts by expert), as Engine(model, mesh=mesh) would place them, but
    without a whole copy of each parameter on one device first: how a model larger than one
    device's memory loads (of the full presets only GLM-4.5-Air in FP8 or INT4 fits one H200).

    nvfp4_activations: a W4A4 NVFP4 checkpoint's layers quantize their inputs under its calibrated
    input scales, as an FP4 tensor-core GPU (Blackwell) computes them (WeightFormat w4a4); by
    default NVFP4 is served weight-only, as on Hopper.

    mtp: hold the multi-token-prediction layer, the draft of speculative decoding (models/transformer.py).
    None: a checkpoint's if it ships one (one decoder layer's weights more: 1/61 of Kimi, 1/92 of
    GLM-4.5), none for a preset; True: required (a preset gets a random one); False: never."""
    dt = _dtype(dtype)
    if os.path.isdir(path_or_preset):
        config, quant = read_config(path_or_preset)
        infos = checkpoint_index(path_or_preset, quant, nvfp4_activations)
        stored = detect_plan(config, infos, quant, nvfp4_activations)
        plan = stored if plan is None else plan
        sharding.check_mesh(mesh, config.n_routed_experts, expert_parallel)
        if plan != stored:
            raise ValueError(
                f"checkpoint stores ({stored}); load it as stored and convert with mixserve.quantize instead of ({plan})"
            )
        placement = None if mesh is None else functools.partial(sharding.placement, mesh=mesh,
                                                                 expert_parallel=expert_parallel)
        shipped = has_mtp(config, infos)
        if mtp and not shipped:
            raise ValueError(f"{path_or_preset} holds no MTP layer (model.layers.{config.mtp_layer}.eh_proj; "
                             f"num_nextn_predict_layers={config.num_mtp_layers}), which the MTP draft needs "
                             "(load(..., mtp=True); mixserve.run --speculative-tokens): the n-gram draft needs none "
                             "(draft='ngram', --draft ngram)")
        mtp_plan = detect_mtp_plan(config, infos) if shipped and mtp is not False else None
        params = load_params(path_or_preset, config, plan, dt, progress=progress, infos=infos, placement=placement,
                             mtp_plan=mtp_plan)
        return Model(config, params, load_tokenizer(path_or_preset), plan, dt, backend, path_or_preset, expert_parallel,
                     mtp_plan, read_kv_scales(path_or_preset, config, quant, mtp_plan is not None),
                     ChatTemplate.from_dir(path_or_preset))
    if path_or_preset in FULL_PRESETS:
        raise ValueError(
            f"{path_or_preset!r} is a full-size preset: it cannot be randomly initialised here. "
            "Use count_params/weight_bytes with it, or load a checkpoint directory."
        )
    if nvfp4_activations or plan is not None and plan.w4a4:
        raise ValueError("NVFP4 activations (W4A4) need calibrated input scales, which a preset has none of: load "
                         "a W4A4 checkpoint, or quantize_model a preset with a W4A4 plan (it calibrates them)")
    if path_or_preset not in PRESETS:  # most likely a checkpoint's path with a typo: say so, not "unknown preset"
        what = "a file, not a directory" if os.path.exists(path_or_preset) else "no such directory"
        raise ValueError(f"{path_or_preset!r} is neither a checkpoint directory ({what}) nor a preset; the presets a "
                         f"model is made from: {', '.join(sorted(TINY_PRESETS))}")
    config = get_preset(path_or_preset)
    plan = plan or WeightPlan()
    mtp_plan = plan if mtp else None
    model = Model(config, init_params(config, plan, dt, seed, mtp_plan), None, plan, dt, backend, path_or_preset,
                  mtp_plan=mtp_plan)
    return model if mesh is None else sharding.shard_model(model, mesh, expert_parallel)


def count_params(preset_or_config: str | ModelConfig) -> dict[str, int]:
    """{"total", "active", "embedding"} computed abstractly (jax.eval_shape): no memory is allocated.

    Convention: embeddings and lm_head count in both "total" and "active"; MTP (next-token-prediction)
    layers are not counted (they are not part of the forward). Active = total minus the routed
    experts a token does not use (all but num_experts_per_tok per MoE layer).

    "embedding" is the parameter count of embed_tokens plus lm_head (once when the two are tied),
    reported separately because model cards disagree on whether "active" includes it: Moonshot's
    Kimi K2 card (1T / 32B) counts it, so compare with "active"; Z.ai's GLM cards (GLM-4.5 355B/32B,
    GLM-4.5-Air 106B/12B, GLM-5 744B/40B) do not, so compare with active - embedding.
    """
    cfg = get_preset(preset_or_config) if isinstance(preset_or_config, str) else preset_or_config
    shapes = jax.eval_shape(lambda: Transformer(cfg, WeightPlan(), jnp.bfloat16).init(jax.random.key(0), jnp.zeros((1, 1), jnp.int32)))
    total = routed = embedding = 0
    for path, leaf in jax.tree_util.tree_flatten_with_path(nn.unbox(shapes["params"]))[0]:
        n = int(leaf.size)
        total += n
        if any(getattr(k, "key", None) == "experts" for k in path):
            routed += n
        if getattr(path[0], "key", None) in ("embed_tokens", "lm_head"):
            embedding += n
    inactive = routed * (cfg.n_routed_experts - cfg.num_experts_per_tok) // max(cfg.n_routed_experts, 1)
    return {"total": total, "active": total - inactive, "embedding": embedding}
