"""Write a quantized HF-format checkpoint from a BF16 one, streaming unit by unit.

    python -m mixserve.quantize --model DIR --out DIR --format int4 --group-size 32 [--scope experts|all]
    python -m mixserve.quantize --model DIR --out DIR --format fp8

int4 writes compressed-tensors pack-quantized (W4A16, symmetric, group-wise) with a
`quantization_config` in the form vLLM/SGLang read; fp8 writes the DeepSeek/GLM block format
(`weight_scale_inv`, 128x128). Scope "experts" quantizes routed experts only (as Kimi K2 Thinking
ships); "all" also quantizes attention, dense MLPs and shared experts. Router, norms, embeddings,
lm_head and the DSA indexer's weights_proj always stay as they are.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil

import jax.numpy as jnp
import numpy as np

import pallas_kernels
from mixserve.checkpoint import _is_expert, _mtp_or_beyond, _quantizable, _text_prefix, _unit_of, read_config
from mixserve.safetensors_io import CheckpointError, index_tensors, iter_tensors, write_safetensors
from models.weights import Fp8BlockWeight, Int4Weight, WeightFormat, WeightPlan

SHARD_BYTES = 2 << 30
COPIED = ("tokenizer.json", "tokenizer_config.json", "tiktoken.model", "generation_config.json", "special_tokens_map.json")


def plan_for(fmt: WeightFormat, scope: str) -> WeightPlan:
    if scope not in ("experts", "all"):
        raise ValueError(f"scope must be 'experts' or 'all', got {scope!r}")
    return WeightPlan(experts=fmt, linear=fmt if scope == "all" else WeightPlan().linear)


def quantize_unit(weight_NK: np.ndarray, fmt: WeightFormat) -> dict[str, np.ndarray]:
    """One HF [out, in] weight -> its on-disk parts in `fmt` (round to nearest)."""
    w_KN = jnp.asarray(np.asarray(weight_NK, np.float32).T)
    if fmt.kind == "fp8_block":
        q = Fp8BlockWeight.quantize(w_KN)
        return {"weight": np.asarray(q.values_KN).T, "weight_scale_inv": np.asarray(q.scale_inv_kn).T}
    q = Int4Weight.quantize(w_KN, fmt.group_size)
    packed_NQ, scale_NG = pallas_kernels.to_compressed_tensors(q.packed_QN, q.scales_GN)
    return {
        "weight_packed": np.asarray(packed_NQ),
        "weight_scale": np.asarray(scale_NG),
        "weight_shape": np.asarray(weight_NK.shape, np.int64),
    }


def quantization_config(plan: WeightPlan, ignored: list[str]) -> dict:
    fmts = {f for f in (plan.experts, plan.linear) if f.kind != "bf16"}
    if len(fmts) != 1:
        raise ValueError(f"one quantized format per checkpoint, got {sorted(map(str, fmts))}")
    fmt = fmts.pop()
    if fmt.kind == "fp8_block":
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
                "modules_to_not_convert": ignored}
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                        "group_size": fmt.group_size, "dynamic": False, "observer": "minmax"},
            "input_activations": None, "output_activations": None,
        }},
        "ignore": ignored,
    }


def quantize_checkpoint(src: str, dst: str, plan: WeightPlan) -> None:
    config, quant = read_config(src)
    if quant:
        raise CheckpointError(f"{src} is already quantized ({quant.get('quant_method')}); start from a BF16 checkpoint")
    infos = index_tensors(src)
    prefix = _text_prefix(infos)
    os.makedirs(dst, exist_ok=True)
    shard: dict[str, np.ndarray] = {}
    shards: list[dict[str, np.ndarray]] = []
    ignored: set[str] = set()
    size = 0
    for name, array in iter_tensors(infos):
        unit, part = _unit_of(name)
        bare = unit.removeprefix(prefix)
        fmt = plan.experts if _is_expert(bare) else plan.linear
        if part == "weight" and _quantizable(bare) and not _mtp_or_beyond(bare, config) and fmt.kind != "bf16":
            if fmt.kind == "int4" and array.shape[1] % fmt.group_size:
                raise CheckpointError(f"{name}: group size {fmt.group_size} does not divide the input dimension {array.shape[1]}")
            parts = {f"{unit}.{p}": v for p, v in quantize_unit(array, fmt).items()}
        else:
            parts = {name: np.asarray(array)}
            if part == "weight" and (_quantizable(bare) or bare == "lm_head"):
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
    target["quantization_config"] = quantization_config(plan, sorted(ignored))
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(raw, f, indent=2)
    for name in COPIED:
        if os.path.exists(os.path.join(src, name)):
            shutil.copy(os.path.join(src, name), os.path.join(dst, name))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m mixserve.quantize", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="source HF checkpoint directory (BF16)")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--format", choices=["int4", "fp8"], required=True, help="int4: compressed-tensors W4A16; fp8: 128x128 block FP8")
    p.add_argument("--group-size", type=int, default=32, help="int4 group size along the input dimension (32 or 128)")
    p.add_argument("--scope", choices=["experts", "all"], default="experts",
                   help="experts: routed experts only (Kimi K2 Thinking's choice); all: every linear layer except router/lm_head")
    p.add_argument("--method", choices=["rtn"], default="rtn", help="rounding method")
    args = p.parse_args(argv)
    fmt = WeightFormat("int4", args.group_size) if args.format == "int4" else WeightFormat("fp8_block")
    quantize_checkpoint(args.model, args.out, plan_for(fmt, args.scope))
    print(f"wrote {args.out} ({fmt}, scope={args.scope}, method={args.method})")


if __name__ == "__main__":
    main()
