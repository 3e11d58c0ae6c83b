"""Write a quantized HF-format checkpoint from a BF16 one, streaming unit by unit.

    python -m mixserve.quantize --model DIR --out DIR --format int4 --group-size 32 [--scope experts|all]
           [--method rtn|gptq --calibration-tokens 2048 --seed 0] [--fp8-kv-scales]
    python -m mixserve.quantize --model DIR --out DIR --format fp8
    python -m mixserve.quantize --model DIR --out DIR --format nvfp4 [--scope experts|all] [--nvfp4-activations]

int4 writes compressed-tensors pack-quantized (W4A16, symmetric, group-wise) with a
`quantization_config` in the form vLLM/SGLang read; nvfp4 writes compressed-tensors
nvfp4-pack-quantized, weights only (llm-compressor's NVFP4A16), or with --nvfp4-activations also
the inputs' global scales calibrated over the calibration tokens (W4A4, llm-compressor's NVFP4:
mixserve.gptq.input_global_scales); fp8 writes the DeepSeek/GLM block format
(`weight_scale_inv`, 128x128). Scope "experts" quantizes routed experts only (as Kimi K2 Thinking
ships); "all" also quantizes attention, dense MLPs and shared experts. Router, norms, embeddings,
lm_head and the DSA indexer's weights_proj always stay as they are.

Methods: rtn rounds each weight to nearest; gptq (mixserve/gptq.py, int4 and nvfp4) first loads the
whole source model in float32 and runs it over calibration tokens, so it is for models that fit in
host memory; its tensors are in the same format as RTN's. --fp8-kv-scales (GQA models) also
calibrates each layer's FP8 KV cache scales, absmax / 448 of its cached keys and values over the
calibration tokens, and writes them as llm-compressor's kv_cache_scheme does. `quantize_model`
does the same in memory, to a Model.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels
from mixserve.checkpoint import (KV_SCALE_PARTS, KV_SCALE_UNIT, check_quantization_config, fp8_kv_scheme, hf_source,
                                 is_expert_unit, is_mtp_layer, is_quantizable_unit, kv_cache_scheme, quantizes_weights,
                                 read_config, split_unit, text_prefix)
from mixserve.gptq import (Calibration, LayerReport, abstract_params, flat_params, gptq_weights, input_global_scales,
                           is_quantized, require_unquantized)
from mixserve.kv_cache import calibrate_scales
from mixserve.model import Model, load
from mixserve.safetensors_io import CheckpointError, index_tensors, iter_tensors, write_safetensors
from mixserve.tokenizer import TOKENIZER_FILES, copy_tokenizer_files
from models.weights import Int4Weight, Nvfp4Weight, Quantized, WeightFormat, WeightPlan, quantize
from pallas_kernels.nvfp4_matmul import to_compressed_tensors as nvfp4_to_compressed_tensors

log = logging.getLogger(__name__)

SHARD_BYTES = 2 << 30
# compressed-tensors' kv_cache_scheme for static per-tensor FP8 keys and values, as llm-compressor writes it.
FP8_KV_SCHEME = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}


def plan_for(fmt: WeightFormat, scope: str) -> WeightPlan:
    if scope not in ("experts", "all"):
        raise ValueError(f"scope must be 'experts' or 'all', got {scope!r}")
    return WeightPlan(experts=fmt, linear=fmt if scope == "all" else WeightPlan().linear)


def quantize_unit(weight_NK: np.ndarray, fmt: WeightFormat) -> dict[str, np.ndarray]:
    """One HF [out, in] weight -> its on-disk parts in `fmt` (round to nearest)."""
    return disk_parts(quantize(jnp.asarray(np.asarray(weight_NK, np.float32).T), fmt))


def disk_parts(q: Quantized) -> dict[str, np.ndarray]:
    """A quantized [in, out] weight -> its HF on-disk parts ([out, in] orientation)."""
    if isinstance(q, Nvfp4Weight):
        packed, scales, global_scale = nvfp4_to_compressed_tensors(q.packed_QN, q.scales_GN, q.global_scale)
        inputs = {} if q.input_global_scale is None else {"input_global_scale": np.asarray(q.input_global_scale, np.float32)}
        return {"weight_packed": packed, "weight_scale": scales, "weight_global_scale": global_scale} | inputs
    if not isinstance(q, Int4Weight):
        return {"weight": np.asarray(q.values_KN).T, "weight_scale_inv": np.asarray(q.scale_inv_kn).T}
    packed_NQ, scale_NG = pallas_kernels.to_compressed_tensors(q.packed_QN, q.scales_GN)
    k, n = q.shape
    return {
        "weight_packed": np.asarray(packed_NQ),
        "weight_scale": np.asarray(scale_NG),
        "weight_shape": np.asarray((n, k), np.int64),
    }


def calibration_ids(calibration: Calibration | np.ndarray | None, vocab_size: int) -> np.ndarray:
    """int32 [B, T] token ids: given, or drawn by a Calibration spec (default Calibration())."""
    if calibration is None or isinstance(calibration, Calibration):
        return (calibration or Calibration()).token_ids(vocab_size)
    ids = np.asarray(calibration, np.int32)
    if ids.ndim != 2 or ids.size == 0:
        raise ValueError(f"calibration token ids must be a non-empty [batch, time] array, got shape {ids.shape}")
    return ids


def quantize_model(model: Model, plan: WeightPlan, *, method: str = "rtn",
                   calibration: Calibration | np.ndarray | None = None,
                   fp8_kv_scales: bool = False) -> tuple[Model, list[LayerReport]]:
    """A float model's weights converted into `plan` in memory -> (Model, GPTQ layer reports).

    method "rtn": every quantized weight rounded to nearest. "gptq": the int4 and nvfp4 weights by GPTQ over
    the calibration tokens (fp8 ones still RTN). Unquantized weights are cast to the model dtype.
    A W4A4 format's input scales are calibrated over the same tokens, with either method, and so
    are, with fp8_kv_scales, a GQA model's FP8 KV cache scales (Model.kv_scales; else it keeps its own).
    """
    _check_method(method, plan)
    _check_kv_scales(fp8_kv_scales, model.config)
    source = flat_params(model.params)
    require_unquantized(source)
    abstract = abstract_params(model.config, plan, model.dtype, model.mtp_plan)  # an MTP layer stays as it is
    require_finite_targets(source, abstract)
    gptq, reports, input_scales, kv_scales = _calibrated(model, plan, method, calibration, fp8_kv_scales)
    leaves = []
    for path, leaf in flat_params(abstract).items():
        if is_quantized(leaf):
            fmt = plan.experts if "experts" in path else plan.linear
            q = gptq[path] if path in gptq else quantize(source[path].astype(model.dtype), fmt)
            if isinstance(q, Nvfp4Weight):  # the calibrated input scale where the model has one (kv_b_proj: none)
                q = dataclasses.replace(q, input_global_scale=None if leaf.input_global_scale is None else input_scales[path])
            leaves.append(q)
        else:
            leaves.append(source[path].astype(leaf.dtype))
    params = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(abstract, is_leaf=is_quantized), leaves)
    kv_scales = model.kv_scales if kv_scales is None else kv_scales
    return dataclasses.replace(model, params=params, plan=plan, kv_scales=kv_scales), reports


_count_finite = jax.jit(lambda w: jnp.count_nonzero(jnp.isfinite(w)))  # one program per shape, not two


def require_finite(name: str, w) -> None:
    """Refuse a weight with inf or NaN: its scale covers a whole group or block, which the value
    would spoil (one inf turns its 128 x 128 FP8 block into NaN, its INT4 group likewise)."""
    bad = int(np.size(w)) - int(_count_finite(w))
    if bad:
        raise ValueError(f"{name} has {bad} non-finite value(s); quantizing would spread them over its scale "
                         "group or block: fix the source weights")


def require_finite_targets(source: dict, abstract) -> None:
    """require_finite for every source weight the plan (shown by `abstract`'s leaves) quantizes."""
    for path, leaf in flat_params(abstract).items():
        if is_quantized(leaf):
            require_finite("/".join(path), source[path])


class Calibrated(NamedTuple):
    """What the calibration tokens decide."""

    weights: dict  # GPTQ's weights, by param path (method gptq)
    reports: list[LayerReport]  # GPTQ's
    input_scales: dict  # W4A4 input global scales, by param path (plan w4a4)
    kv_scales: tuple[np.ndarray, np.ndarray] | None  # FP8 KV (k, v) float32 [num_layers] (fp8_kv_scales)


def _calibrates(method: str, plan: WeightPlan, fp8_kv_scales: bool) -> bool:
    return method == "gptq" or plan.w4a4 or fp8_kv_scales


def _calibrated(model: Model, plan: WeightPlan, method: str, calibration, fp8_kv_scales: bool) -> Calibrated:
    if not _calibrates(method, plan, fp8_kv_scales):
        return Calibrated({}, [], {}, None)
    ids = calibration_ids(calibration, model.config.vocab_size)
    gptq, reports, grams = gptq_weights(model, plan, ids) if method == "gptq" else ({}, [], None)
    input_scales = input_global_scales(model, plan, ids, grams) if plan.w4a4 else {}
    # Per layer and per tensor, as llm-compressor's kv_cache_scheme and ModelOpt's FP8 KV calibrate
    # them: the decoder layers' cached keys and values (the MTP layer's pool takes their largest).
    kv_scales = _positive_kv_scales(*calibrate_scales(model, ids, per_layer=True)) if fp8_kv_scales else None
    return Calibrated(gptq, reports, input_scales, kv_scales)


def _positive_kv_scales(k_scale_L1, v_scale_L1) -> tuple[np.ndarray, np.ndarray]:
    """Calibrated [num_layers, 1] scales -> float32 [num_layers], each finite and positive: a layer
    whose keys or values are all 0 gets float32's eps, as compressed-tensors' qparams give it."""
    scales = []
    for name, scale in (("k_scale", k_scale_L1), ("v_scale", v_scale_L1)):
        scale = np.asarray(scale, np.float32)[:, 0]
        if not np.isfinite(scale).all():
            raise ValueError(f"{name} of layers {np.flatnonzero(~np.isfinite(scale)).tolist()} is not finite: the "
                             "calibration forward met inf or NaN")
        scales.append(np.maximum(scale, np.finfo(np.float32).eps))
    return scales[0], scales[1]


def _check_kv_scales(fp8_kv_scales: bool, config) -> None:
    if fp8_kv_scales and config.attention_kind != "gqa":
        raise ValueError("FP8 KV scales are calibrated for GQA models' keys and values; this model caches an MLA "
                         "latent, whose scale mixserve neither writes nor reads (ModelOpt's MLA scales are of the "
                         "expanded keys and values): calibrate it when serving (mixserve.kv_cache.calibrate_scales)")


def _check_method(method: str, plan: WeightPlan) -> None:
    if method not in ("rtn", "gptq"):
        raise ValueError(f"method must be 'rtn' or 'gptq', got {method!r}")
    if method == "gptq" and not {"int4", "nvfp4"} & {plan.experts.kind, plan.linear.kind}:
        raise ValueError(f"GPTQ quantizes int4 and nvfp4 weights and the plan ({plan}) has none; use method='rtn'")


def _calibrated_units(src: str, plan: WeightPlan, method: str, calibration, fp8_kv_scales: bool) -> Calibrated:
    """_calibrated over the source checkpoint (loaded whole, in float32), with weights and input
    scales by bare HF unit name (one per expert)."""
    if not _calibrates(method, plan, fp8_kv_scales):
        return Calibrated({}, [], {}, None)
    model = load(src, dtype="float32", progress=False)
    require_finite_targets(flat_params(model.params), abstract_params(model.config, plan, model.dtype))
    c = _calibrated(model, plan, method, calibration, fp8_kv_scales)
    return c._replace(weights=_by_unit(c.weights), input_scales=_by_unit(c.input_scales))


def _by_unit(by_path: dict) -> dict:
    """{param path: value (experts stacked)} -> {bare HF unit name: value}, one per expert."""
    units = {}
    for path, value in by_path.items():
        unit, _, _ = hf_source(path)
        if "{e}" not in unit:
            units[unit] = value
            continue
        for e in range(jax.tree.leaves(value)[0].shape[0]):
            units[unit.replace("{e}", str(e))] = jax.tree.map(lambda a: a[e], value)
    return units


def quantization_config(plan: WeightPlan, ignored: list[str]) -> dict:
    fmts = {f for f in (plan.experts, plan.linear) if f.kind != "bf16"}
    if len(fmts) != 1:
        raise ValueError(f"one quantized format per checkpoint, got {sorted(map(str, fmts))}")
    fmt = fmts.pop()
    if fmt.kind == "fp8_block":
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
                "modules_to_not_convert": ignored}
    nvfp4 = fmt.kind == "nvfp4"
    return {
        "quant_method": "compressed-tensors",
        "format": "nvfp4-pack-quantized" if nvfp4 else "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 4, "type": "float" if nvfp4 else "int", "symmetric": True,
                        "strategy": "tensor_group" if nvfp4 else "group",
                        "group_size": fmt.group_size, "dynamic": False, "observer": "minmax"},
            # W4A4: llm-compressor's NVFP4 activations, group scales computed as they come ("local")
            "input_activations": {"num_bits": 4, "type": "float", "symmetric": True, "strategy": "tensor_group",
                                  "group_size": fmt.group_size, "dynamic": "local", "observer": "static_minmax"}
            if fmt.w4a4 else None,
            "output_activations": None,
        }},
        "ignore": ignored,
    }


def quantize_checkpoint(src: str, dst: str, plan: WeightPlan, *, method: str = "rtn",
                        calibration: Calibration | np.ndarray | None = None,
                        fp8_kv_scales: bool = False) -> list[LayerReport]:
    """Write `src` (BF16 HF checkpoint) quantized into `plan` to `dst`. Returns GPTQ's layer reports
    (empty for rtn). calibration: token ids [B, T] or a Calibration spec (gptq, W4A4's input scales,
    and FP8 KV scales). fp8_kv_scales: also write a GQA model's per-layer FP8 KV cache scales
    (self_attn.k_scale/v_scale with a kv_cache_scheme, as llm-compressor does), which mixserve's
    engine and vLLM serve an FP8 cache with. A source whose quantization_config declares only a
    KV cache scheme keeps its scales and scheme unless fp8_kv_scales calibrates new ones."""
    _check_method(method, plan)
    if os.path.isdir(dst) and os.path.samefile(src, dst):  # its shards would be rewritten while still read
        raise CheckpointError(f"the output directory {dst} is the source checkpoint: write the quantized copy elsewhere")
    if os.path.isdir(dst) and any(n == "config.json" or n.endswith(".safetensors") for n in os.listdir(dst)):
        # its old shards would stay beside the new ones, and its config be replaced
        raise CheckpointError(f"the output directory {dst} already holds a checkpoint: write elsewhere, or remove it")
    config, quant = read_config(src)
    if quantizes_weights(quant):
        raise CheckpointError(f"{src} is already quantized ({quant.get('quant_method')}); start from a BF16 checkpoint")
    check_quantization_config(quant, cfg=config)  # what else a KV-only config declares (a rotation) is refused
    _check_kv_scales(fp8_kv_scales, config)
    infos = index_tensors(src)
    prefix = text_prefix(infos)
    _check_group_sizes(infos, prefix, plan, config)
    os.makedirs(dst, exist_ok=True)  # before calibration (GPTQ can take a while): an unwritable dst fails first
    calibrated = _calibrated_units(src, plan, method, calibration, fp8_kv_scales)
    shard: dict[str, np.ndarray] = {}
    shards: list[dict[str, np.ndarray]] = []
    ignored: set[str] = set()
    size = 0
    for name, array in _with_kv_scales(iter_tensors(infos), calibrated.kv_scales, prefix):
        unit, part = split_unit(name)
        bare = unit.removeprefix(prefix)
        fmt = plan.experts if is_expert_unit(bare) else plan.linear
        if _quantized_here(name.removeprefix(prefix), plan, config):
            require_finite(name, array)
            on_disk = disk_parts(calibrated.weights[bare]) if bare in calibrated.weights else quantize_unit(array, fmt)
            if fmt.w4a4:  # kv_b_proj's too: mixserve does not use it, a checkpoint's other readers may
                on_disk["input_global_scale"] = np.asarray(calibrated.input_scales[bare], np.float32)
            parts = {f"{unit}.{p}": v for p, v in on_disk.items()}
        else:
            parts = {name: np.asarray(array)}
            # every nn.Linear left unquantized: readers quantize the config's "Linear" targets but these
            if part == "weight" and (is_quantizable_unit(bare) or bare == "lm_head" or bare.endswith(".weights_proj")):
                ignored.add(unit)
        for key, value in parts.items():
            shard[key] = value
            size += value.nbytes
        if size >= SHARD_BYTES:
            shards.append(shard)
            shard, size = {}, 0
    shards.append(shard)
    weight_map = {}
    for i, tensors in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        write_safetensors(os.path.join(dst, fname), tensors)
        weight_map.update({k: fname for k in tensors})
    with open(os.path.join(dst, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=1)
    with open(os.path.join(src, "config.json")) as f:
        raw = json.load(f)
    target = raw["text_config"] if "text_config" in raw else raw
    for config_dict in (raw, target):  # a KV-only source's, wherever it was: replaced by the one below
        config_dict.pop("quantization_config", None)
    target["quantization_config"] = quantization_config(plan, sorted(ignored))
    if calibrated.kv_scales is not None or kv_cache_scheme(quant):
        # a KV-only ModelOpt source's scheme ("FP8") as compressed-tensors writes it
        kv_fp8 = calibrated.kv_scales is not None or fp8_kv_scheme(quant)
        target["quantization_config"]["kv_cache_scheme"] = FP8_KV_SCHEME if kv_fp8 else kv_cache_scheme(quant)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(raw, f, indent=2)
    copy_tokenizer_files(src, dst, (*TOKENIZER_FILES, "generation_config.json"))
    return calibrated.reports


def _with_kv_scales(tensors, kv_scales, prefix: str):
    """The source's tensors, with FP8 KV scales calibrated here in place of any it has. A source's
    own are written where compressed-tensors puts them: ModelOpt's self_attn.k_proj.k_scale as
    self_attn.k_scale."""
    for name, array in tensors:
        unit, part = split_unit(name)
        if not (part in KV_SCALE_PARTS and KV_SCALE_UNIT.search(unit)):
            yield name, array
        elif kv_scales is None:
            yield f"{unit.removesuffix(f'.{part[0]}_proj')}.{part}", array
    if kv_scales is None:
        return
    for part, scales in zip(("k_scale", "v_scale"), kv_scales):
        for layer, scale in enumerate(scales):
            yield f"{prefix}model.layers.{layer}.self_attn.{part}", np.asarray(scale, np.float32)


def _quantized_here(bare_name: str, plan: WeightPlan, config) -> bool:
    """Does the plan quantize this tensor (name without the K2.5 text prefix)?"""
    unit, part = split_unit(bare_name)
    fmt = plan.experts if is_expert_unit(unit) else plan.linear
    return part == "weight" and is_quantizable_unit(unit) and not is_mtp_layer(unit, config) and fmt.kind != "bf16"


def _check_group_sizes(infos, prefix: str, plan: WeightPlan, config) -> None:
    """Before any work (GPTQ can take a while): every int4 weight's input dim must split into groups."""
    for name, info in infos.items():
        bare = name.removeprefix(prefix)
        fmt = plan.experts if is_expert_unit(bare) else plan.linear
        if _quantized_here(bare, plan, config) and fmt.kind in ("int4", "nvfp4") and info.shape[1] % fmt.group_size:
            raise CheckpointError(f"{name}: group size {fmt.group_size} does not divide the input dimension {info.shape[1]}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m mixserve.quantize", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="source HF checkpoint directory (BF16)")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--format", choices=["int4", "nvfp4", "fp8"], required=True,
                   help="int4: compressed-tensors W4A16; nvfp4: compressed-tensors NVFP4 weights (W4A16); "
                        "fp8: 128x128 block FP8")
    p.add_argument("--nvfp4-activations", action="store_true",
                   help="with --format nvfp4: also calibrate each layer's input global scale over the calibration "
                        "tokens (W4A4, llm-compressor's NVFP4 scheme); loads the model in float32 to run them, as gptq")
    p.add_argument("--group-size", type=int, help="int4 group size along the input dimension (default 32; or 128)")
    p.add_argument("--scope", choices=["experts", "all"], default="experts",
                   help="experts: routed experts only (Kimi K2 Thinking's choice); all: every linear layer except router/lm_head")
    p.add_argument("--method", choices=["rtn", "gptq"], default="rtn",
                   help="rtn: round to nearest; gptq: GPTQ over random calibration tokens (int4 and nvfp4; loads the model)")
    p.add_argument("--fp8-kv-scales", action="store_true",
                   help="also calibrate per-layer FP8 KV cache scales over the calibration tokens (GQA models; "
                        "llm-compressor's kv_cache_scheme), which the engine serves an FP8 cache with; loads the model")
    p.add_argument("--calibration-tokens", type=int, help="gptq, W4A4, KV scales: number of calibration tokens (default 2048)")
    p.add_argument("--seq-len", type=int, help="gptq, W4A4, KV scales: calibration sequence length (default 128)")
    p.add_argument("--seed", type=int, help="gptq, W4A4, KV scales: seed of the calibration tokens (default 0)")
    args = p.parse_args(argv)
    if why := flag_without_effect(args):
        p.error(why)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:  # bad arguments or a checkpoint that cannot be quantized: a usage error, not a traceback
        given = lambda **flags: {k: v for k, v in flags.items() if v is not None}  # the others keep their defaults
        fmt = WeightFormat({"fp8": "fp8_block"}.get(args.format, args.format), w4a4=args.nvfp4_activations,
                           **given(group_size=args.group_size))
        calibration = Calibration(**given(tokens=args.calibration_tokens, seq_len=args.seq_len, seed=args.seed))
        reports = quantize_checkpoint(args.model, args.out, plan_for(fmt, args.scope), method=args.method,
                                      calibration=calibration, fp8_kv_scales=args.fp8_kv_scales)
    except (ValueError, OSError) as e:  # CheckpointError is a ValueError; OSError: an output path that cannot be made
        p.error(str(e))
    for r in reports:
        fallback = f", RTN for experts {r.rtn_fallback_experts} (no tokens)" if r.rtn_fallback_experts else ""
        print(f"{r.path}: {r.rows} rows, ||X(W-Q)||^2 RTN {r.rtn_error:.4g} -> GPTQ {r.gptq_error:.4g}{fallback}")
    kv = ", FP8 KV scales" if args.fp8_kv_scales else ""
    print(f"wrote {args.out} ({fmt}, scope={args.scope}, method={args.method}{kv})")


def flag_without_effect(args) -> str | None:
    """Why a flag given would change nothing, as the others stand: a usage error, not dropped unsaid."""
    calibrates = args.method == "gptq" or args.nvfp4_activations or args.fp8_kv_scales
    return first_without_effect((
            (args.group_size, args.format == "int4",
             f"--group-size is int4's (nvfp4's groups are 16 values, fp8's blocks 128 x 128), not {args.format}'s"),
            (args.nvfp4_activations, args.format == "nvfp4", "--nvfp4-activations quantizes the inputs of --format nvfp4"),
            (any(x is not None for x in (args.calibration_tokens, args.seq_len, args.seed)), calibrates,
             "--calibration-tokens, --seq-len and --seed draw the tokens of --method gptq, --nvfp4-activations or "
             "--fp8-kv-scales; round to nearest (rtn) calibrates nothing")))


def first_without_effect(rules) -> str | None:
    """The `why` of the first (given, applies, why) whose flag was given (not None or False) but
    does not apply; None if every given flag applies. The CLIs' (this and mixserve.run) check."""
    return next((why for given, applies, why in rules if given is not None and given is not False and not applies),
                None)


if __name__ == "__main__":
    main()
