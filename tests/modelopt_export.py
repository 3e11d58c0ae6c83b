"""Write a real NVIDIA ModelOpt NVFP4 checkpoint of a tiny reference model, and its reference.

    python tests/modelopt_export.py CONFIG OUT [--kv-fp8 | --kv-only]

OUT/modelopt:    what ModelOpt's own PTQ and HF export write (mtq.quantize with NVFP4_DEFAULT_CFG,
                 export_hf_checkpoint): uint8 `weight`, e4m3 `weight_scale`, float32 `weight_scale_2`
                 and `input_scale`, hf_quant_config.json; with --kv-fp8 also FP8 KV scales; with
                 --kv-only the FP8 KV scales alone (ModelOpt's FP8_KV_CFG, every other quantizer off:
                 unquantized weights, quant_algo null).
OUT/dequantized: the unquantized checkpoint with each NVFP4 weight replaced by ModelOpt's own
                 dequantization of the exported tensors (NVFP4QTensor.dequantize), float32.

Run in a subprocess by tests/test_modelopt.py: importing ModelOpt patches torch and transformers
classes, which the rest of the suite should not see.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
import hf_reference  # noqa: E402

import modelopt.torch.quantization as mtq  # noqa: E402
from modelopt.torch.export import export_hf_checkpoint  # noqa: E402
from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

GROUP = 16


def dequantized(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each exported NVFP4 unit's `weight`, as ModelOpt dequantizes it; other tensors as they are."""
    out = {}
    for name, t in tensors.items():
        unit, _, part = name.rpartition(".")
        if part in ("weight_scale", "weight_scale_2", "input_scale", "k_scale", "v_scale"):
            continue
        if part == "weight" and t.dtype == torch.uint8:
            rows, half = t.shape
            q = NVFP4QTensor(torch.Size((rows, 2 * half)), torch.float32, t)
            t = q.dequantize(torch.float32, scale=tensors[f"{unit}.weight_scale"],
                             double_scale=tensors[f"{unit}.weight_scale_2"], block_sizes={-1: GROUP})
        out[name] = t.float().contiguous()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("config", choices=sorted(hf_reference.CONFIGS))
    ap.add_argument("out")
    formats = ap.add_mutually_exclusive_group()
    formats.add_argument("--kv-fp8", action="store_true")
    formats.add_argument("--kv-only", action="store_true")
    args = ap.parse_args()
    # NVFP4 needs every input width a multiple of 16: kv_b_proj's is kv_lora_rank (512 in the real models).
    mla = "kv_lora_rank" in hf_reference.CONFIGS[args.config][1]
    model = hf_reference.build(args.config, **({"kv_lora_rank": 32} if mla else {}))
    model.config.architectures = [type(model).__name__]  # ModelOpt's export reads it
    plain = os.path.join(args.out, "plain")
    model.save_pretrained(plain)
    cfg = copy.deepcopy(mtq.NVFP4_DEFAULT_CFG)
    if args.kv_only:  # NVFP4's config starts by turning every quantizer off; keep only that
        cfg["quant_cfg"] = [q for q in cfg["quant_cfg"] if q == {"quantizer_name": "*", "enable": False}]
    if args.kv_fp8 or args.kv_only:
        cfg["quant_cfg"] += mtq.FP8_KV_CFG["quant_cfg"]
    gen = torch.Generator().manual_seed(1)
    calibration = [torch.randint(0, model.config.vocab_size, (2, 24), generator=gen) for _ in range(2)]

    def forward_loop(m):
        for ids in calibration:
            m(ids)

    with torch.no_grad():
        model = mtq.quantize(model, cfg, forward_loop)
        export_hf_checkpoint(model, dtype=torch.float32, export_dir=os.path.join(args.out, "modelopt"))
    exported = load_file(os.path.join(args.out, "modelopt", "model.safetensors"))
    reference = os.path.join(args.out, "dequantized")
    os.makedirs(reference)
    save_file(dequantized(exported), os.path.join(reference, "model.safetensors"), metadata={"format": "pt"})
    for name in ("config.json", "generation_config.json"):
        if os.path.exists(os.path.join(plain, name)):
            with open(os.path.join(plain, name)) as src, open(os.path.join(reference, name), "w") as dst:
                dst.write(src.read())


if __name__ == "__main__":
    main()
