"""Load an HF-format checkpoint directory into mixserve parameters, streaming tensor by tensor.

Naming: our parameter paths mirror the HF keys (`layers_3/self_attn/q_a_proj/kernel` is
`model.layers.3.self_attn.q_a_proj.weight`, transposed to [in, out]); routed experts are stored
on disk per expert (`mlp.experts.7.gate_proj.weight`) and stacked here into [E, in, out].

On-disk formats of a linear weight ("unit"), told apart by which tensors exist:
  dense      `weight`
  fp8_block  `weight` (float8_e4m3fn) + `weight_scale_inv` (float32, 128x128 blocks)
  int4       `weight_packed` (int32 [out, in/8]) + `weight_scale` [out, in/group] + `weight_shape`
  nvfp4      `weight_packed` (uint8 [out, in/2]) + `weight_scale` (float8_e4m3fn [out, in/16])
             + `weight_global_scale` (float32 [1]), as compressed-tensors writes it; NVIDIA ModelOpt
             writes the same pack as `weight` and the reciprocal of the global scale as
             `weight_scale_2` (float32 []): read as compressed-tensors' own converter maps them
             (served_tensors, _convert). A W4A4 checkpoint's input scales (`input_global_scale`,
             ModelOpt's reciprocal `input_scale`) are read when the plan quantizes activations
             (WeightFormat w4a4), else left out.
Routed experts and the other linear layers each get one format (a WeightPlan); if a checkpoint
mixes formats inside one of these, that part is dequantized to the model dtype on load.
Any other part beside these (zero points, group indices, a bias the config does not declare) and a
quantization_config that declares another scheme are refused before any tensor is read.
"""

from __future__ import annotations

import json
import os
import re
import warnings
from dataclasses import dataclass

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from mixserve.safetensors_io import CheckpointError, TensorInfo, index_tensors, iter_tensors, load_tensor
from models.config import ModelConfig
from models.transformer import Transformer
from models.weights import BF16, FP8_BLOCK, NVFP4_GROUP, Fp8BlockWeight, Int4Weight, Nvfp4Weight, WeightFormat, WeightPlan
from pallas_kernels.nvfp4_matmul import from_compressed_tensors as nvfp4_from_compressed_tensors

QUANT_PARTS = {"weight_scale_inv", "weight_packed", "weight_scale", "weight_shape", "weight_global_scale",
               "weight_scale_2"}
# Tensors that real checkpoints carry but the text model does not use.
MTP_SHARED_UNITS = ("embed_tokens", "shared_head.head")  # the MTP layer's copies of the model's (is_read_mtp_unit)
SKIPPED = re.compile(r"(^|\.)(vision_tower|mm_projector|multi_modal_projector|visual)\.|rotary_emb\.inv_freq$")
LEAF_TO_PART = {"values_KN": "weight", "scale_inv_kn": "weight_scale_inv", "packed_QN": "weight_packed",
                "scales_GN": "weight_scale", "global_scale": "weight_global_scale",
                "input_global_scale": "input_global_scale"}
PER_MATRIX_PARTS = {"weight_global_scale", "input_global_scale"}  # [1] (llm-compressor) or [] (ModelOpt and its converter)
# ModelOpt's per-matrix scales multiply where compressed-tensors' divide: read as their reciprocals.
MODELOPT_RECIPROCALS = {"weight_global_scale": "weight_scale_2", "input_global_scale": "input_scale"}
# The parts each on-disk format of a linear weight consists of; any other part of a known unit is refused.
STORED_PARTS = {"dense": {"weight"}, "fp8_block": {"weight", "weight_scale_inv"},
                "int4": {"weight_packed", "weight_scale", "weight_shape"},
                "nvfp4": {"weight_packed", "weight_scale", "weight_global_scale", "weight_scale_2", "weight_shape"}}
# The dtypes (safetensors names) of the packed formats' parts: a uint8 NVFP4 pack without its global
# scale must not pass for an INT4 one.
PART_DTYPES = {"int4": {"weight_packed": "I32"},
               "nvfp4": {"weight_packed": "U8", "weight_scale": "F8_E4M3", "weight_global_scale": "F32",
                         "weight_scale_2": "F32", "input_global_scale": "F32", "input_scale": "F32"}}
# Calibration scales of a quantized KV cache (compressed-tensors kv_cache_scheme, ModelOpt
# kv_cache_quant_algo) on the attention modules: not weights. GQA models' per-tensor FP8 scales
# are read apart (read_kv_scales), for the engine's FP8 KV cache; the KV format is chosen when serving.
KV_SCALE_PARTS = {"k_scale", "v_scale"}
KV_SCALE_UNIT = re.compile(r"(?:^|\.)layers\.(\d+)\.self_attn(?:\.[kv]_proj)?$")
MODELOPT_ALGOS = ("NVFP4", "W4A16_NVFP4")  # ModelOpt's quant_algo for NVFP4 weights with and without NVFP4 activations
# Static input scales of NVFP4 activations (W4A4), which mixserve serves weight-only.
NVFP4_INPUT_PARTS = {"input_global_scale", "input_scale"}
# Parts that quantization schemes mixserve does not implement add to a unit: named in the error.
UNSUPPORTED_PARTS = {
    "weight_zero_point": "zero points of asymmetric quantization (mixserve's INT4 is symmetric)",
    "weight_g_idx": "group indices of activation reordering (actorder 'group'; re-quantize with actorder 'weight')",
    "input_scale": "static activation scales (mixserve does not quantize activations)",
}


def read_config(directory: str) -> tuple[ModelConfig, dict]:
    path = os.path.join(directory, "config.json")
    if not os.path.exists(path):
        raise CheckpointError(f"{directory}: no config.json")
    with open(path) as f:
        raw = json.load(f)
    quant = (raw.get("quantization_config") or (raw.get("text_config") or {}).get("quantization_config")
             or _modelopt_quant_config(directory))
    generation_eos = None  # generate() also stops on generation_config.json's eos ids (a chat model's end of turn)
    if os.path.exists(generation := os.path.join(directory, "generation_config.json")):
        with open(generation) as f:
            generation_eos = json.load(f).get("eos_token_id")
    return ModelConfig.from_hf(raw, generation_eos), quant


# generation_config.json's sampling keys a server takes as its requests' defaults (vLLM's
# --generation-config auto). vLLM takes those of GenerationConfig.to_diff_dict(): with transformers
# 5, whose defaults are all None, every key the file sets (4.x dropped one equal to its own default).
GENERATION_SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def generation_sampling_defaults(directory: str) -> dict[str, float]:
    """The sampling values the model's creator recommends in its generation_config.json ({}: none)."""
    path = os.path.join(directory, "generation_config.json")
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        raw = json.load(f)
    taken = {key: raw[key] for key in GENERATION_SAMPLING_KEYS if raw.get(key) is not None}
    if bad := {k: v for k, v in taken.items() if not isinstance(v, (int, float)) or isinstance(v, bool)}:
        raise CheckpointError(f"{path}: sampling values must be numbers, got {bad}")
    return taken


def _modelopt_quant_config(directory: str) -> dict:
    """ModelOpt's hf_quant_config.json as a quantization_config (older ModelOpt exports may write
    only that file; 0.47 writes both)."""
    path = os.path.join(directory, "hf_quant_config.json")
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return {"quant_method": "modelopt", **(json.load(f).get("quantization") or {})}


def served_tensors(infos: dict[str, TensorInfo], quant: dict, nvfp4_activations: bool = False) -> dict[str, TensorInfo]:
    """The checkpoint's tensors under the names the loader reads. ModelOpt's NVFP4 pack (a uint8
    `weight` beside a `weight_scale_2`) is renamed `weight_packed`, as compressed-tensors' ModelOpt
    converter renames it. Left out, where the quantization_config declares them: the input scales
    of NVFP4 layers that run weight-only (all of them unless nvfp4_activations; those that stay in
    the model dtype, e.g. weights_proj, always), and the scales of a quantized KV cache on the
    attention modules. Any other such tensor stays, and _check refuses it."""
    kv_scales = KV_SCALE_PARTS if kv_cache_scheme(quant) else set()
    input_scales = NVFP4_INPUT_PARTS if _nvfp4_activations(quant) else set()
    out = {}
    for name, info in infos.items():
        unit, part = split_unit(name)
        nvfp4 = any(f"{unit}.{p}" in infos for p in ("weight_scale_2", "weight_global_scale"))
        if part in input_scales and nvfp4 and not (nvfp4_activations and quantizes_input(unit)):
            continue
        if part in kv_scales and KV_SCALE_UNIT.search(unit):
            continue
        modelopt_pack = (part == "weight" and info.dtype == "U8" and f"{unit}.weight_scale_2" in infos
                         and f"{unit}.weight_packed" not in infos)
        out[f"{unit}.weight_packed" if modelopt_pack else name] = info
    return out


def quantizes_input(unit: str) -> bool:
    """Does a W4A4 plan quantize this layer's input? Every quantizable layer but kv_b_proj, which
    absorbed MLA runs weight-only (models.attention.LatentUpProjection)."""
    return is_quantizable_unit(unit) and not unit.endswith("kv_b_proj")


def checkpoint_index(directory: str, quant: dict, nvfp4_activations: bool = False) -> dict[str, TensorInfo]:
    """The shards' headers (no tensor data), named as the loader reads them (served_tensors)."""
    return served_tensors(index_tensors(directory), quant, nvfp4_activations)


def text_prefix(infos: dict[str, TensorInfo]) -> str:
    """K2.5/K2.6 prefix the text model's weights with `language_model.`."""
    return "language_model." if any(name.startswith("language_model.") for name in infos) else ""


def split_unit(name: str) -> tuple[str, str]:
    """'model.layers.0.mlp.gate_proj.weight_scale_inv' -> ('model.layers.0.mlp.gate_proj', 'weight_scale_inv')."""
    base, _, part = name.rpartition(".")
    return base, part


def is_expert_unit(unit: str) -> bool:
    return ".mlp.experts." in unit


def is_mtp_layer(unit: str, cfg: ModelConfig) -> bool:
    """A multi-token-prediction layer, stored after the decoder layers (num_nextn_predict_layers of
    them): read only as the speculative-decoding draft (the first; load(mtp=...)). A layer past
    those is unexpected, not skipped."""
    m = re.match(r"model\.layers\.(\d+)\.", unit)
    return m is not None and cfg.num_layers <= int(m.group(1)) < cfg.num_layers + cfg.num_mtp_layers


def is_read_mtp_unit(unit: str, cfg: ModelConfig) -> bool:
    """A unit of the MTP layer the draft reads: layer cfg.mtp_layer, less its copies of the model's
    embedding and head (the draft uses the model's own, as SGLang; GLM-4.6 on ship none)."""
    head = f"model.layers.{cfg.mtp_layer}."
    return unit.startswith(head) and unit.removeprefix(head) not in MTP_SHARED_UNITS


def has_mtp(cfg: ModelConfig, infos: dict[str, TensorInfo]) -> bool:
    """Does the checkpoint hold the MTP layer's own weights (its eh_proj)?"""
    return cfg.num_mtp_layers > 0 and f"{text_prefix(infos)}model.layers.{cfg.mtp_layer}.eh_proj.weight" in infos


def _stored_kind(parts) -> str:
    if "weight_global_scale" in parts or "weight_scale_2" in parts:
        return "nvfp4"
    if "weight_packed" in parts:
        return "int4"
    return "fp8_block" if "weight_scale_inv" in parts else "dense"


def detect_plan(cfg: ModelConfig, infos: dict[str, TensorInfo], quant: dict,
                nvfp4_activations: bool = False) -> WeightPlan:
    """The formats stored on disk, per category (routed experts / other linear layers).
    nvfp4_activations: the NVFP4 formats as W4A4 (the checkpoint must declare NVFP4 activations).
    A category that mixes NVFP4 with another format loads dequantized and runs weight-only, with a
    warning; at least one category must be NVFP4 alone."""
    found = _stored_formats(cfg, infos, mtp=False)
    for notice in check_quantization_config(quant, nvfp4_activations, cfg):
        warnings.warn(notice, stacklevel=3)
    _check_group_size(found, quant)
    if nvfp4_activations:
        nvfp4 = WeightFormat("nvfp4")
        if not _nvfp4_activations(quant):
            raise CheckpointError("nvfp4_activations: the checkpoint declares no NVFP4 activations (W4A4), so it has "
                                  "no input scales to quantize them with")
        if not any(fmts == {nvfp4} for fmts in found.values()):
            raise CheckpointError("nvfp4_activations: no category of layers (routed experts, other linear layers) is "
                                  "NVFP4 alone, so every NVFP4 layer loads dequantized and runs weight-only")
        if mixed := sorted(c for c, fmts in found.items() if nvfp4 in fmts and len(fmts) > 1):
            warnings.warn(f"the checkpoint's {' and '.join(mixed)} layers mix NVFP4 with "
                          f"{sorted(str(f) for c in mixed for f in found[c] if f != nvfp4)}: they load dequantized "
                          "and run weight-only; nvfp4_activations applies to the others", stacklevel=3)
        found = {c: {WeightFormat("nvfp4", w4a4=True)} if fmts == {nvfp4} else fmts for c, fmts in found.items()}
    return _plan_of(found)


def detect_mtp_plan(cfg: ModelConfig, infos: dict[str, TensorInfo]) -> WeightPlan:
    """The MTP layer's own formats (writers often keep it in BF16 beside quantized layers: mixserve.quantize
    does). It runs weight-only: an NVFP4 MTP layer's input scales are not read."""
    return _plan_of(_stored_formats(cfg, infos, mtp=True))


def _stored_formats(cfg: ModelConfig, infos: dict[str, TensorInfo], mtp: bool) -> dict[str, set[WeightFormat]]:
    """The formats of the quantizable units per category, of the decoder layers or (mtp) the MTP layer."""
    prefix = text_prefix(infos)
    units: dict[str, set[str]] = {}
    for name in infos:
        base, part = split_unit(name.removeprefix(prefix))
        if part in QUANT_PARTS or part == "weight":
            units.setdefault(base, set()).add(part)
    found = {"experts": set(), "linear": set()}
    for unit, parts in units.items():
        if not is_quantizable_unit(unit) or (not is_read_mtp_unit(unit, cfg) if mtp else is_mtp_layer(unit, cfg)):
            continue
        kind = _stored_kind(parts)
        fmt = BF16 if kind == "dense" else WeightFormat(kind, _int4_group(prefix + unit, infos) if kind == "int4" else 32)
        found["experts" if is_expert_unit(unit) else "linear"].add(fmt)
    return found


def _plan_of(found: dict[str, set[WeightFormat]]) -> WeightPlan:
    pick = lambda fmts: next(iter(fmts)) if len(fmts) == 1 else BF16
    return WeightPlan(experts=pick(found["experts"]), linear=pick(found["linear"]))


def _int4_group(unit: str, infos: dict[str, TensorInfo]) -> int:
    """Group size implied by weight_packed [out, in/8] and weight_scale [out, in/group]."""
    if unit + ".weight_scale" not in infos:
        raise CheckpointError(f"{unit}.weight_scale is missing (needed with weight_packed)")
    if (dtype := infos[unit + ".weight_packed"].dtype) != PART_DTYPES["int4"]["weight_packed"]:
        raise CheckpointError(f"tensor {unit}.weight_packed is {dtype}, where int4 stores I32 "
                              "(a uint8 pack is NVFP4's, which needs its weight_global_scale or weight_scale_2)")
    packed, scale = infos[unit + ".weight_packed"].shape, infos[unit + ".weight_scale"].shape
    in_dim = packed[1] * 8
    group = in_dim // scale[1]
    if in_dim % scale[1] or group % 8:
        raise CheckpointError(
            f"{unit}.weight_packed {packed} and {unit}.weight_scale {scale} disagree: "
            f"input dim {in_dim} is not a multiple-of-8 group size times {scale[1]} groups"
        )
    return group


def is_quantizable_unit(unit: str) -> bool:
    """Linear layers a WeightPlan covers (not the router, norms, embeddings, lm_head, weights_proj)."""
    leaf = unit.rsplit(".", 1)[-1]
    return leaf.endswith("_proj") and leaf != "weights_proj" or leaf in ("wq_b", "wk", "kv_a_proj_with_mqa")


def check_quantization_config(quant: dict, nvfp4_activations: bool = False, cfg: ModelConfig | None = None) -> list[str]:
    """Refuse, before any tensor is read, a quantization_config whose tensors would load but mean
    something else: asymmetric or reordered INT4, other bit widths, integer or FP8 activations,
    sparsity or rotation transforms. Accepted: DeepSeek-style block FP8 (quant_method "fp8", e4m3,
    128 x 128 blocks, dynamic activations), compressed-tensors pack-quantized (symmetric 4-bit int
    weights by group or channel) and nvfp4-pack-quantized (4-bit float weights in groups of 16, a
    global scale per tensor), and ModelOpt NVFP4 (quant_method "modelopt", the same weights).

    Returns notices of what is served otherwise than declared: NVFP4 activations (W4A4) are served
    weight-only (W4A16), as vLLM serves them on GPUs without FP4 math (Hopper: Marlin), so the
    activations stay in the model dtype, unless nvfp4_activations (then kv_b_proj alone runs
    weight-only: absorbed MLA never multiplies the latent by it); a declared KV cache scheme's
    calibrated scales are not read unless they are a GQA model's (cfg) per-tensor FP8 scales
    (read_kv_scales)."""
    if not quant:
        return []
    method, problems, notices = quant.get("quant_method"), [], []
    if method == "fp8":
        if quant.get("fmt", "e4m3") != "e4m3":
            problems.append(f"fmt {quant['fmt']!r} (only e4m3 weights)")
        if quant.get("activation_scheme", "dynamic") != "dynamic":
            problems.append(f"activation_scheme {quant['activation_scheme']!r} (activations are not quantized)")
        if list(quant.get("weight_block_size") or [FP8_BLOCK, FP8_BLOCK]) != [FP8_BLOCK, FP8_BLOCK]:
            problems.append(f"weight_block_size {quant['weight_block_size']!r} (only {FP8_BLOCK} x {FP8_BLOCK} blocks)")
    elif method == "compressed-tensors":
        if quant.get("quantization_status", "compressed") != "compressed":
            problems.append(f"quantization_status {quant['quantization_status']!r} (only 'compressed' checkpoints)")
        sparsity = quant.get("sparsity_config") or {}
        if sparsity.get("format", "dense") != "dense":  # llm-compressor writes format "dense" for none
            problems.append(f"sparsity_config {sparsity!r}")
        if quant.get("transform_config"):
            problems.append(f"transform_config {quant['transform_config']!r}")
        for name, group in (quant.get("config_groups") or {}).items():
            problems += [f"config_groups.{name}: {p}" for p in _unsupported_group(group, quant.get("format"))]
    elif method == "modelopt":  # quant_algo null: ModelOpt calibrated the KV cache alone (quantizes_weights)
        if quant.get("quant_algo") not in MODELOPT_ALGOS and quantizes_weights(quant):
            problems.append(f"quant_algo {quant.get('quant_algo')!r} (mixserve reads ModelOpt {' and '.join(MODELOPT_ALGOS)})")
        groups = {quant.get("group_size", NVFP4_GROUP)}
        for name, group in (quant.get("config_groups") or {}).items():
            for key in ("weights", "input_activations"):
                args = group.get(key) or {}
                groups.add(args.get("group_size", NVFP4_GROUP))
                problems += [f"config_groups.{name}.{key}.{k} {args[k]!r} (expected {v!r})"
                             for k, v in {"num_bits": 4, "type": "float"}.items() if k in args and args[k] != v]
        if groups != {NVFP4_GROUP}:
            problems.append(f"group_size {sorted(groups)} (NVFP4 groups are {NVFP4_GROUP})")
    else:
        problems.append(f"quant_method {method!r} (mixserve reads 'fp8' block checkpoints, 'compressed-tensors' INT4 "
                        "and NVFP4, and 'modelopt' NVFP4)")
    if problems:
        raise CheckpointError("unsupported quantization_config: " + "; ".join(problems))
    if _nvfp4_activations(quant) and not nvfp4_activations:
        notices.append("the checkpoint quantizes activations to NVFP4 (W4A4); mixserve serves it weight-only "
                       "(W4A16), as vLLM does on GPUs without FP4 math: activations stay in the model dtype and "
                       "the input scales are not read (nvfp4_activations=True quantizes them, as Blackwell does)")
    if kv_cache_scheme(quant) and not (fp8_kv_scheme(quant) and cfg is not None and cfg.attention_kind == "gqa"):
        why = ("they calibrate the expanded keys and values, not the latent MLA caches"
               if fp8_kv_scheme(quant) else "mixserve reads per-tensor FP8 KV scales only")
        notices.append(f"the checkpoint declares a quantized KV cache ({kv_cache_scheme(quant)}); its k_scale/v_scale "
                       f"are not read ({why}): the KV cache format is chosen when serving (Engine kv_dtype, --kv-cache-dtype), and "
                       "Engine(k_scale=, v_scale=) takes calibrated scales (mixserve.kv_cache.calibrate_scales)")
    return notices


def _nvfp4_activations(quant: dict) -> bool:
    """Does the checkpoint declare NVFP4 activations (W4A4)? ModelOpt's NVFP4 does (W4A16_NVFP4 not)."""
    if quant.get("quant_method") == "modelopt":
        return quant.get("quant_algo") == "NVFP4"
    return any(_is_nvfp4_activation(group.get("input_activations"))
               for group in (quant.get("config_groups") or {}).values())


def _is_nvfp4_activation(args: dict | None) -> bool:
    return bool(args) and all(args.get(k) == v for k, v in
                              {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": NVFP4_GROUP}.items())


def quantizes_weights(quant: dict) -> bool:
    """Does the quantization_config quantize any weight? A KV-cache-only one does not: llm-compressor
    run with a kv_cache_scheme alone (no config_groups), ModelOpt's export of an FP8 KV calibration
    alone (quant_algo null, as ModelOpt 0.47 writes it). Its weights are the model dtype's."""
    method = quant.get("quant_method")
    if method == "compressed-tensors":
        return bool(quant.get("config_groups"))
    if method == "modelopt":
        return quant.get("quant_algo") is not None or bool(quant.get("config_groups"))
    return bool(quant)


def kv_cache_scheme(quant: dict):
    """The declared KV cache quantization (compressed-tensors kv_cache_scheme, ModelOpt kv_cache_quant_algo)."""
    return quant.get("kv_cache_scheme") or quant.get("kv_cache_quant_algo")


def fp8_kv_scheme(quant: dict) -> bool:
    """Does the checkpoint declare a static per-tensor FP8 KV cache (ModelOpt kv_cache_quant_algo
    "FP8", compressed-tensors kv_cache_scheme float 8-bit by tensor)? Its k_scale/v_scale are then
    real = stored * scale, per attention layer."""
    scheme = kv_cache_scheme(quant)
    if isinstance(scheme, str):
        return scheme.upper() == "FP8"
    return (isinstance(scheme, dict) and scheme.get("num_bits") == 8 and scheme.get("type") == "float"
            and scheme.get("strategy", "tensor") == "tensor" and not scheme.get("dynamic", False))


def read_kv_scales(directory: str, cfg: ModelConfig, quant: dict, mtp: bool) -> tuple[np.ndarray, np.ndarray] | None:
    """A GQA checkpoint's calibrated FP8 KV scales (fp8_kv_scheme), one per cache layer: (k, v)
    float32 [num_layers] (+ the MTP layer's, if mtp and it has them; else the engine gives it the
    layers' largest, kv_cache.layer_scales). Named as compressed-tensors (self_attn.k_scale) or
    ModelOpt (self_attn.k_proj.k_scale) writes them. None: no such scales (or an MLA model: see
    check_quantization_config's notice)."""
    if not fp8_kv_scheme(quant) or cfg.attention_kind != "gqa":
        return None
    found: dict[tuple[str, int], TensorInfo] = {}
    for name, info in index_tensors(directory).items():
        unit, part = split_unit(name)
        if part in KV_SCALE_PARTS and (m := KV_SCALE_UNIT.search(unit)):
            found[(part, int(m.group(1)))] = info
    if not found:
        return None
    layers = cfg.num_layers + int(mtp and all((p, cfg.mtp_layer) in found for p in KV_SCALE_PARTS))
    missing = [f"layer {i} {p}" for i in range(cfg.num_layers) for p in sorted(KV_SCALE_PARTS) if (p, i) not in found]
    if missing:
        raise CheckpointError(f"the checkpoint's FP8 KV scales miss {', '.join(missing)}: every decoder layer needs both")
    scales = {}
    for p in sorted(KV_SCALE_PARTS):
        values = []
        for i in range(layers):
            value = np.asarray(load_tensor(found[(p, i)]), np.float32)
            if value.size != 1 or not np.isfinite(value).all() or value.item() <= 0:
                raise CheckpointError(f"layer {i}'s {p} is {value.tolist()} (shape {value.shape}): mixserve reads one "
                                      "finite positive FP8 KV scale per layer")
            values.append(value.item())
        scales[p] = np.asarray(values, np.float32)
    return scales["k_scale"], scales["v_scale"]


def _unsupported_group(group: dict, default_format) -> list[str]:
    """What a compressed-tensors config group declares beyond symmetric W4A16 pack-quantized or NVFP4
    (whose NVFP4 activations are served weight-only)."""
    weights, problems = group.get("weights") or {}, []
    fmt = group.get("format", default_format)
    if fmt == "nvfp4-pack-quantized":
        expected = {"num_bits": 4, "type": "float", "symmetric": True, "strategy": "tensor_group",
                    "group_size": NVFP4_GROUP}
    elif fmt == "pack-quantized":
        expected = {"num_bits": 4, "type": "int", "symmetric": True}
        if weights.get("strategy") not in ("group", "channel"):
            problems.append(f"weights.strategy {weights.get('strategy')!r} (expected 'group' or 'channel')")
    else:
        return [f"format {fmt!r} (only 'pack-quantized' and 'nvfp4-pack-quantized')"]
    problems += [f"weights.{k} {weights.get(k)!r} (expected {v!r})" for k, v in expected.items() if weights.get(k) != v]
    if weights.get("actorder") in ("group", "dynamic", True):
        problems.append(f"weights.actorder {weights['actorder']!r} (group indices; 'weight' or none is supported)")
    served = fmt == "nvfp4-pack-quantized" and _is_nvfp4_activation(group.get("input_activations"))
    problems += [f"{k} {group[k]!r} (W4A16, or NVFP4 served as W4A16)" for k in ("input_activations", "output_activations")
                 if group.get(k) and not (k == "input_activations" and served)]
    return problems


def _check_group_size(found: dict, quant: dict) -> None:
    groups = quant.get("config_groups") or {}
    declared = {g.get("weights", {}).get("group_size") for g in groups.values()} - {None}
    for fmts in found.values():
        for fmt in fmts:
            if fmt.kind == "int4" and declared and fmt.group_size not in declared:
                raise CheckpointError(
                    f"int4 tensors use group size {fmt.group_size} but quantization_config declares {sorted(declared)}"
                )


@dataclass
class _Leaf:
    """One parameter leaf being assembled (stacked experts fill one slice per expert)."""

    shape: tuple[int, ...]
    dtype: np.dtype
    transpose: bool  # HF stores [out, in]; we keep [in, out]
    stacked: bool  # routed experts: one HF unit per expert
    buffer: np.ndarray | None = None
    filled: int = 0


@dataclass
class _Unit:
    """One HF weight unit (e.g. model.layers.3.mlp.experts.5.up_proj): the leaves it fills, by part."""

    leaves: dict[str, int]  # HF part -> leaf index
    expert: int | None
    target: str  # "dense" | "fp8_block" | "int4" | "nvfp4" | "plain" (norm scale, bias, embedding, ...)


def _path_str(path) -> tuple[str, ...]:
    return tuple(getattr(k, "key", getattr(k, "name", None)) for k in path)


def hf_source(path: tuple[str, ...]) -> tuple[str, str, bool]:
    """Our leaf path -> (HF unit with '{e}' for the expert index, HF part, transpose)."""
    if path == ("lm_head",):
        return "lm_head", "weight", True
    names = list(path)
    part, transpose = "weight", True
    if names[-1] in LEAF_TO_PART:  # a field of a quantized weight
        part = LEAF_TO_PART[names.pop()]
        transpose = part not in PER_MATRIX_PARTS
    last = names[-1]
    if last == "kernel":
        names.pop()
    elif last in ("scale", "embedding", "bias", "e_score_correction_bias"):
        names.pop()
        part = {"scale": "weight", "embedding": "weight"}.get(last, last)
        transpose = False
    dotted = ["model"] + [n.replace("layers_", "layers.") for n in names]
    if "experts" in dotted:
        at = dotted.index("experts") + 1
        dotted.insert(at, "{e}")
    return ".".join(dotted), part, transpose


def load_params(directory: str, cfg: ModelConfig, plan: WeightPlan, dtype, *, progress: bool = True,
                infos: dict[str, TensorInfo] | None = None, placement=None, mtp_plan: WeightPlan | None = None):
    """Stream every tensor of the checkpoint into a params pytree for Transformer(cfg, plan, dtype,
    mtp_plan=mtp_plan) (mtp_plan None: the MTP layer is not read).
    `infos` (the shards' headers) can be passed in when the caller has already read them.
    placement(abstract params, their logical axes) -> a tree of functions that put each leaf where
    it goes (mixserve.sharding.placement); each leaf is placed as soon as it is read, so host
    memory holds one unit (or one stack of experts) at a time. None: the default device."""
    infos = checkpoint_index(directory, read_config(directory)[1], plan.w4a4) if infos is None else infos
    prefix = text_prefix(infos)
    boxed = jax.eval_shape(
        lambda: Transformer(cfg, plan, dtype, mtp_plan=mtp_plan).init(jax.random.key(0), jnp.zeros((1, 1), jnp.int32))
    )["params"]
    abstract = nn.unbox(boxed)
    flat, treedef = jax.tree_util.tree_flatten_with_path(abstract)
    if placement is None:
        puts = [jnp.asarray] * len(flat)
    else:
        where = placement(abstract, nn.get_partition_spec(boxed))
        puts, treedef = jax.tree.leaves(where), jax.tree.structure(where)

    leaves: list[_Leaf] = []
    templates: dict[str, dict[str, int]] = {}
    for i, (path, sds) in enumerate(flat):
        unit, part, transpose = hf_source(_path_str(path))
        leaves.append(_Leaf(sds.shape, np.dtype(sds.dtype), transpose, "{e}" in unit))
        templates.setdefault(unit, {})[part] = i
    units: dict[str, _Unit] = {}
    for template, parts in templates.items():
        is_matmul = "weight" in parts and leaves[parts["weight"]].transpose or "weight_packed" in parts
        kind = _stored_kind(parts) if is_matmul else "plain"
        for e in range(cfg.n_routed_experts) if "{e}" in template else [None]:
            units[prefix + template.replace("{e}", str(e))] = _Unit(parts, e, kind)

    on_disk: dict[str, dict[str, TensorInfo]] = {}
    for name, info in infos.items():
        unit, part = split_unit(name)
        mtp_unit = unit.removeprefix(prefix)
        if SKIPPED.search(name) or is_mtp_layer(mtp_unit, cfg) and not (mtp_plan is not None
                                                                         and is_read_mtp_unit(mtp_unit, cfg)):
            continue
        on_disk.setdefault(unit, {})[part] = info
    _check(units, on_disk, leaves)

    done: list = [None] * len(leaves)
    pending: dict[str, dict[str, np.ndarray]] = {}
    bar = tqdm(total=len(infos), desc=f"loading {os.path.basename(os.path.normpath(directory))}", unit="tensor", disable=not progress)
    for name, array in iter_tensors(infos):
        bar.update()
        unit, part = split_unit(name)
        if unit not in units or part == "weight_shape":
            continue
        got = pending.setdefault(unit, {})
        got[part] = array
        if set(got) >= set(on_disk[unit]) - {"weight_shape"}:  # all parts of the unit are in
            _fill(units[unit], _convert(unit, pending.pop(unit), units[unit]), leaves, done, puts)
    bar.close()
    return jax.tree_util.tree_unflatten(treedef, done)


def _check(units: dict[str, _Unit], on_disk: dict[str, dict[str, TensorInfo]], leaves: list[_Leaf]) -> None:
    """All missing, unexpected and mis-shaped tensors are reported before any data is read."""
    missing, wrong, extra = [], [], []
    for name, unit in units.items():
        stored = on_disk.get(name)
        if stored is not None:
            extra += [f"{name}.{part}" for part in sorted(set(stored) - _allowed_parts(unit, stored))]
        if stored is None or (unit.target != "plain" and "weight" not in stored and "weight_packed" not in stored):
            part, i = next(iter(unit.leaves.items()))
            missing.append(f"{name}.{part} (expected shape {_disk_shape(leaves[i])})")
            continue
        if unit.target == "plain":
            for part, i in unit.leaves.items():
                expected = _disk_shape(leaves[i])
                if part not in stored:
                    missing.append(f"{name}.{part} (expected shape {expected})")
                elif tuple(stored[part].shape) != expected:
                    wrong.append(f"tensor {name}.{part} has shape {tuple(stored[part].shape)}, expected {expected}")
            continue
        kind = _stored_kind(stored)
        if kind == "dense" and stored["weight"].dtype == "U8":
            missing.append(f"{name}.weight_scale_2 or .weight_global_scale (its weight is U8: a packed NVFP4 weight)")
            continue
        if kind == "nvfp4" and "weight_packed" not in stored:
            missing.append(f"{name}.weight_packed (its weight is {stored['weight'].dtype} beside a weight_scale_2, "
                           "where ModelOpt's NVFP4 pack is U8)")
            continue
        if kind == "nvfp4" and (problems := _nvfp4_problems(name, stored)):
            wrong += problems
            continue
        wrong += [f"tensor {name}.{part} is {stored[part].dtype}, where {kind} stores {dtype}"
                  for part, dtype in PART_DTYPES.get(kind, {}).items() if part in stored and stored[part].dtype != dtype]
        if kind != unit.target and unit.target != "dense":
            wrong.append(f"{name} is stored as {kind} but the plan wants {unit.target}")
        if kind in ("int4", "nvfp4") and "weight_scale" not in stored:
            missing.append(f"{name}.weight_scale (needed with weight_packed)")
        if kind in ("int4", "nvfp4") and "weight_shape" in stored:  # two integers: cheap to read now
            declared = tuple(int(d) for d in load_tensor(stored["weight_shape"]))
            if declared != _logical_shape(stored):
                wrong.append(f"tensor {name}.weight_shape says {declared}, weight_packed holds {_logical_shape(stored)}")
        if kind == unit.target:
            for part, i in unit.leaves.items():
                expected = _disk_shape(leaves[i])
                if kind == "nvfp4" and part == "weight_packed":  # uint8 on disk, int32 here
                    expected = (*expected[:-1], expected[-1] * 4)
                if part in PER_MATRIX_PARTS:  # its shape and value: _nvfp4_problems; ModelOpt's name for its units
                    part = MODELOPT_RECIPROCALS[part] if "weight_scale_2" in stored else part
                    if part not in stored:
                        missing.append(f"{name}.{part} (expected shape (1,))")
                    continue
                if part not in stored:
                    missing.append(f"{name}.{part} (expected shape {expected})")
                elif tuple(stored[part].shape) != expected:
                    wrong.append(f"tensor {name}.{part} has shape {tuple(stored[part].shape)}, expected {expected}")
        else:  # quantized on disk, dense in the plan: check the logical shape
            for part, i in unit.leaves.items():
                expected = _disk_shape(leaves[i])
                found = _logical_shape(stored) if part == "weight" else tuple(stored[part].shape)
                if found != expected:
                    wrong.append(f"tensor {name}.{part} has logical shape {found}, expected {expected}")
    if missing:
        raise CheckpointError(f"{len(missing)} tensor(s) missing from the checkpoint: " + "; ".join(missing[:8]))
    unexpected = extra + sorted(f"{unit}.{part}" for unit, parts in on_disk.items() if unit not in units for part in parts)
    if unexpected:
        why = sorted({f"{part}: {UNSUPPORTED_PARTS[part]}" for part in (u.rpartition(".")[2] for u in unexpected)
                      if part in UNSUPPORTED_PARTS})
        raise CheckpointError(f"{len(unexpected)} unexpected tensor(s) in the checkpoint: {unexpected[:8]}"
                              + "".join(f"; {w}" for w in why))
    if wrong:
        raise CheckpointError("; ".join(wrong[:8]))


def _nvfp4_problems(name: str, stored: dict[str, TensorInfo]) -> list[str]:
    """What makes an NVFP4 unit other weights than its format says, found before its pack is read
    (the per-matrix scales, a few bytes each, are read here)."""
    problems = []
    if "weight_scale_2" in stored and "weight_global_scale" in stored:
        problems.append(f"{name} has both weight_scale_2 (ModelOpt) and weight_global_scale (compressed-tensors)")
    out, half = stored["weight_packed"].shape
    if "weight_scale" in stored and tuple(stored["weight_scale"].shape) != (out, 2 * half // NVFP4_GROUP):
        problems.append(f"tensor {name}.weight_scale has shape {tuple(stored['weight_scale'].shape)} where "
                        f"{name}.weight_packed {(out, half)} holds {2 * half} inputs a row: expected "
                        f"{(out, 2 * half // NVFP4_GROUP)} (an e4m3 scale per {NVFP4_GROUP} inputs)")
    for part in sorted((PER_MATRIX_PARTS | set(MODELOPT_RECIPROCALS.values())) & set(stored)):
        info = stored[part]
        if tuple(info.shape) not in ((), (1,)):
            problems.append(f"tensor {name}.{part} has shape {tuple(info.shape)}, expected () or (1,)")
        elif info.dtype == "F32" and not _valid_per_matrix(part, value := float(load_tensor(info).reshape(()))):
            problems.append(f"tensor {name}.{part} is {value:g}: a per-matrix scale is finite and positive "
                            "(ModelOpt writes weight_scale_2 = 0 for an all-zero weight)")
    return problems


def _valid_per_matrix(part: str, value: float) -> bool:
    return np.isfinite(value) and (value > 0 or value == 0 and part == "weight_scale_2")


def _allowed_parts(unit: _Unit, stored: dict[str, TensorInfo]) -> set[str]:
    """The parts a unit may have on disk: its leaves; a linear weight's in the format it is stored in."""
    if unit.target == "plain":
        return set(unit.leaves)
    inputs = {"input_scale"} if "input_global_scale" in unit.leaves else set()  # ModelOpt's, for a W4A4 plan
    if unit.target == "dense" and _stored_kind(stored) == "nvfp4":  # loads dequantized: weight-only, its input scale unused
        inputs |= NVFP4_INPUT_PARTS
    return {p for p in unit.leaves if p != "weight" and p not in QUANT_PARTS} | STORED_PARTS[_stored_kind(stored)] | inputs


def _logical_shape(stored: dict[str, TensorInfo]) -> tuple[int, ...]:
    if "weight_packed" in stored:
        out, width = stored["weight_packed"].shape
        return (out, width * (2 if _stored_kind(stored) == "nvfp4" else 8))  # uint8 or int32 words
    return tuple(stored["weight"].shape)


def _disk_shape(leaf: _Leaf) -> tuple[int, ...]:
    shape = leaf.shape[1:] if leaf.stacked else leaf.shape
    return tuple(reversed(shape)) if leaf.transpose else tuple(shape)


def _convert(unit: str, parts: dict[str, np.ndarray], target: _Unit) -> dict[str, np.ndarray]:
    """HF parts -> our parts (still HF orientation); dequantizes when the plan keeps the unit dense."""
    if _stored_kind(parts) == "nvfp4":
        if "weight_scale_2" in parts and not np.any(parts["weight_scale_2"]):
            # amax 0, the weight all zero: ModelOpt stores NaN scales (0 / 0) and saturated codes then
            parts = parts | {"weight_scale": np.zeros_like(parts["weight_scale"]), "weight_scale_2": np.float32(1)}
        if np.isnan(np.asarray(parts["weight_scale"], np.float32)).any():
            raise CheckpointError(f"tensor {unit}.weight_scale holds NaN (e4m3fn's only non-finite value)")
        for ours, theirs in MODELOPT_RECIPROCALS.items():  # compressed-tensors' converter inverts them too
            if theirs in parts:
                parts = {k: v for k, v in parts.items() if k != theirs} | {ours: 1 / np.asarray(parts[theirs], np.float32)}
        parts |= {p: np.asarray(parts[p], np.float32).reshape(1) for p in PER_MATRIX_PARTS if p in parts}
        packed, scales, global_scale = nvfp4_from_compressed_tensors(
            parts["weight_packed"], parts["weight_scale"], parts["weight_global_scale"])
        if target.target == "dense":
            w = Nvfp4Weight(jnp.asarray(packed), jnp.asarray(scales), jnp.asarray(global_scale))
            rest = {k: v for k, v in parts.items() if k not in QUANT_PARTS}
            return {**rest, "weight": np.asarray(w.dequantize(jnp.float32)).T}
        return {**parts, "weight_packed": packed.T, "weight_scale": scales.T, "weight_global_scale": global_scale}
    if target.target == "dense" and _stored_kind(parts) != "dense":
        if "weight_packed" in parts:
            out, q = parts["weight_packed"].shape
            scale = parts["weight_scale"]
            if (q * 8) % scale.shape[1]:
                raise CheckpointError(f"{unit}.weight_scale shape {scale.shape} does not divide input dim {q * 8}")
            w = Int4Weight(jnp.asarray(parts["weight_packed"]).T, jnp.asarray(scale).T, q * 8 // scale.shape[1])
        else:
            w = Fp8BlockWeight(jnp.asarray(parts["weight"]).T, jnp.asarray(parts["weight_scale_inv"]).T)
        rest = {k: v for k, v in parts.items() if k not in QUANT_PARTS}
        return {**rest, "weight": np.asarray(w.dequantize(jnp.float32)).T}
    return parts


def _fill(unit: _Unit, parts: dict[str, np.ndarray], leaves: list[_Leaf], done: list, puts: list) -> None:
    for part, i in unit.leaves.items():
        leaf = leaves[i]
        value = np.asarray(parts[part])
        value = (value.T if leaf.transpose else value).astype(leaf.dtype)
        if not leaf.stacked:
            done[i] = puts[i](value)
            continue
        if leaf.buffer is None:
            leaf.buffer = np.empty(leaf.shape, leaf.dtype)
        leaf.buffer[unit.expert] = value
        leaf.filled += 1
        if leaf.filled == leaf.shape[0]:
            done[i], leaf.buffer = puts[i](leaf.buffer), None
