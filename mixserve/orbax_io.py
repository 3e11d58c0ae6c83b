"""Save and restore converted (quantized) parameters with Orbax, for a fast restart.

Converting a checkpoint (reading safetensors, stacking experts, quantizing, GPTQ) is slow; the
result is saved as an Orbax checkpoint (one array per leaf; Int4Weight / Fp8BlockWeight are pytree
nodes, so packed int32, float8 values and scales are stored as they are) beside `model.json`:

    PATH/params/      orbax StandardCheckpointer
    PATH/model.json   {"config": ModelConfig, "plan": WeightPlan, "mtp_plan": WeightPlan or null,
                       "kv_scales": the checkpoint's FP8 KV scales ([k per layer], [v per layer]) or null,
                       "dtype": "bfloat16"} (dataclasses.asdict)
    PATH/tokenizer*   copied from the source checkpoint directory, when it had them (and its chat template)

Restore builds the abstract target from config + plan (jax.eval_shape of the Transformer), so the
tree, dtypes and the static group sizes come from the code, and each leaf can carry a sharding:
pass `shardings` (a pytree of jax.sharding.Sharding shaped like the params) to restore straight
onto a mesh; by default everything lands on the first device. Shares that would cut scale blocks
need the scales re-blocked (models.weights.split_for_tp): restore, then mixserve.sharding.shard_model.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from mixserve.chat import ChatTemplate
from mixserve.gptq import abstract_params, is_quantized
from mixserve.model import DTYPES, Model
from mixserve.tokenizer import copy_tokenizer_files, load_tokenizer
from models.config import ModelConfig, RopeConfig
from models.weights import WeightFormat, WeightPlan



def save_params(path: str, model: Model) -> None:
    """Write model.params (+ config, plan, dtype, tokenizer files) under `path`, replacing what was there."""
    stored = jax.tree.leaves(abstract_params(model.config, model.plan, model.dtype, model.mtp_plan), is_leaf=is_quantized)
    held = jax.tree.leaves(model.params, is_leaf=is_quantized)
    for want, got in zip(stored, held, strict=True):
        if is_quantized(got) and got.values_per_scale != want.values_per_scale:
            raise ValueError(f"a {type(got).__name__} holds scales re-blocked for tensor parallelism ({got.values_per_scale} "
                             f"values per scale, its plan stores {want.values_per_scale}): save the model as loaded "
                             "without a mesh")
    path = os.path.abspath(path)
    if os.path.exists(os.path.join(path, "params")):
        shutil.rmtree(os.path.join(path, "params"))
    os.makedirs(path, exist_ok=True)
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(os.path.join(path, "params"), model.params)
    meta = {"config": dataclasses.asdict(model.config), "plan": dataclasses.asdict(model.plan),
            "mtp_plan": None if model.mtp_plan is None else dataclasses.asdict(model.mtp_plan),
            "kv_scales": None if model.kv_scales is None else [np.asarray(x).tolist() for x in model.kv_scales],
            "dtype": jnp.dtype(model.dtype).name}
    with open(os.path.join(path, "model.json"), "w") as f:
        json.dump(meta, f, indent=1)
    if os.path.isdir(model.source) and os.path.samefile(model.source, path):
        return  # saved into its own source: its tokenizer files are already the ones to keep
    copy_tokenizer_files(model.source if os.path.isdir(model.source) else None, path)


def restore_params(path: str, *, shardings: Any = None, target: Any = None, backend: str = "xla") -> Model:
    """The Model saved by save_params. Optional: `shardings` (pytree of Shardings shaped like the
    params) places each leaf as it is read; `target` (pytree of jax.ShapeDtypeStruct, shardings
    included) replaces the abstract params built from the saved config + plan."""
    path = os.path.abspath(path)
    meta_path = os.path.join(path, "model.json")
    if not os.path.exists(meta_path):
        raise FileNotFoundError(f"{path}: no model.json (not written by mixserve.orbax_io.save_params)")
    with open(meta_path) as f:
        meta = json.load(f)
    config, plan, dtype = config_from_dict(meta["config"]), plan_from_dict(meta["plan"]), DTYPES[meta["dtype"]]
    mtp_plan = None if meta.get("mtp_plan") is None else plan_from_dict(meta["mtp_plan"])  # absent: saved before MTP
    if target is None:
        target = abstract_params(config, plan, dtype, mtp_plan)
        if shardings is None:
            shardings = jax.tree.map(lambda _: jax.sharding.SingleDeviceSharding(jax.devices()[0]), target)
        target = jax.tree.map(lambda leaf, s: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=s), target, shardings)
    with ocp.StandardCheckpointer() as ckpt:
        params = ckpt.restore(os.path.join(path, "params"), target)
    kv_scales = None if meta.get("kv_scales") is None else tuple(np.asarray(x, np.float32) for x in meta["kv_scales"])
    return Model(config, params, load_tokenizer(path), plan, dtype, backend, path, mtp_plan=mtp_plan,
                 kv_scales=kv_scales, chat_template=ChatTemplate.from_dir(path))


def config_from_dict(d: dict) -> ModelConfig:
    """Inverse of dataclasses.asdict(ModelConfig) after a JSON trip (lists back to tuples)."""
    fields = {k: tuple(v) if isinstance(v, list) else v for k, v in d.items()}
    return ModelConfig(**{**fields, "rope": RopeConfig(**d["rope"])})


def plan_from_dict(d: dict) -> WeightPlan:
    return WeightPlan(**{k: WeightFormat(**v) for k, v in d.items()})

