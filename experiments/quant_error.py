"""Quantization error on tiny random models of the three families: logits of INT4 (RTN and GPTQ,
g32 and g128, routed experts only or all linear layers), NVFP4 (RTN and GPTQ; weight-only, and W4A4 with
input scales calibrated on the calibration tokens, as Blackwell computes it) and FP8-block against the
BF16 model, on held-out tokens, with greedy-token agreement, as a markdown table. Before it, the
formats' error on weight matrices of three distributions (normal, heavy-tailed, outlier rows), with
bits per weight: INT4 g32 and NVFP4 both spend 4.5.

    python experiments/quant_error.py            # print
    python experiments/quant_error.py --out      # also write experiments/results/quant_error.md
    python experiments/quant_error.py --weights-only --rows 256   # the weight table alone (small)

The tiny presets are widened so that every quantized input dimension is a multiple of 128 (g128
applies everywhere). Weights are random (normal 0.02) rounded to BF16, and, as in
tests/hf_reference.py, norm scales are 1 + 0.1 N(0, 1) and router biases 0.05 N(0, 1). The BF16
reference and every quantized model compute in float32, so the differences are the weight
formats' alone. GPTQ and RTN see the same calibration tokens (random ids; held-out ids use another seed).
"""

from __future__ import annotations

import argparse
import datetime
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from mixserve.gptq import Calibration
from mixserve.model import Model, init_params
from mixserve.quantize import plan_for, quantize_model
from models.presets import get_preset
from models.weights import WeightFormat, abstract_weight, dequantize, quantize

FAMILIES = {"tiny-kimi": "deepseek_v3 (MLA)", "tiny-glm4": "glm4_moe (GQA)", "tiny-glm5": "glm_moe_dsa (MLA + DSA)"}
# 8192 tokens: ~2048 rows per expert (top-2 of 8) for 128-wide inputs. With 2048 tokens (~512 rows)
# GPTQ still halves the calibration-set layer error but over-fits: held-out logits only tie RTN on
# tiny-kimi's experts.
CALIBRATION = Calibration(tokens=8192, seq_len=64, seed=0)
HELD_OUT = Calibration(tokens=512, seq_len=64, seed=1)
RESULT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "quant_error.md")


def widened(name: str):
    """The tiny preset with input dims of every linear layer a multiple of 128."""
    cfg = get_preset(name).replace(hidden_size=128, intermediate_size=256, moe_intermediate_size=128, num_heads=8)
    if cfg.attention_kind == "gqa":
        return cfg.replace(head_dim=16)
    return cfg.replace(q_lora_rank=128, kv_lora_rank=128, v_head_dim=16)


def bf16_model(name: str, seed: int = 0) -> Model:
    cfg = widened(name)
    params = init_params(cfg, plan_for(WeightFormat("bf16"), "all"), jnp.float32, seed)
    rng = np.random.default_rng(seed)

    def perturb(path, x):
        keys = [getattr(k, "key", "") for k in path]
        if "scale" in keys and any("norm" in k for k in keys):
            x = x * (1 + 0.1 * rng.standard_normal(x.shape, np.float32))
        if "e_score_correction_bias" in keys:
            x = x + 0.05 * rng.standard_normal(x.shape, np.float32)
        return jnp.asarray(x, jnp.bfloat16).astype(jnp.float32)  # BF16 values, float32 compute

    return Model(cfg, jax.tree_util.tree_map_with_path(perturb, params), dtype=jnp.float32, source=name)


def variants():
    """(label, scope, method, format) of every quantized model compared."""
    for scope in ("experts", "all"):
        yield "fp8 block", scope, "rtn", WeightFormat("fp8_block")
        for group in (32, 128):
            for method in ("rtn", "gptq"):
                yield f"int4 g{group}", scope, method, WeightFormat("int4", group)
        for method in ("rtn", "gptq"):
            yield "nvfp4", scope, method, WeightFormat("nvfp4")
        for method in ("rtn", "gptq"):
            yield "nvfp4 w4a4", scope, method, WeightFormat("nvfp4", w4a4=True)


WEIGHT_FORMATS = {"fp8 block": WeightFormat("fp8_block"), "int4 g32": WeightFormat("int4", 32),
                  "nvfp4": WeightFormat("nvfp4"), "int4 g128": WeightFormat("int4", 128)}


def synthetic_weights(kind: str, rows: int, columns: int, seed: int = 0) -> jax.Array:
    """A [rows (inputs), columns] weight in BF16 values: "normal"; "student-t" (5 degrees of freedom:
    heavy tails, kurtosis 9); "outlier rows" (normal, with 1% of the input rows 10x larger, as
    input features with large activations leave their weight rows after smoothing)."""
    rng = np.random.default_rng(seed)
    if kind == "normal":
        w = rng.standard_normal((rows, columns))
    elif kind == "student-t":
        w = rng.standard_t(5, (rows, columns))
    elif kind == "outlier rows":
        w = rng.standard_normal((rows, columns))
        w[rng.choice(rows, max(1, rows // 100), replace=False)] *= 10
    else:
        raise ValueError(kind)
    return jnp.asarray(0.02 * w, jnp.bfloat16).astype(jnp.float32)


def bits_per_weight(fmt: WeightFormat, rows: int, columns: int) -> float:
    """Stored bits per weight value: values plus scales (and NVFP4's global scale)."""
    leaves = jax.tree.leaves(abstract_weight(fmt, (rows, columns), jnp.bfloat16))
    return 8 * sum(x.size * jnp.dtype(x.dtype).itemsize for x in leaves) / (rows * columns)


def weight_rows(rows: int = 4096, columns: int = 512) -> list[dict]:
    """Each format's round-to-nearest error on each distribution: relative RMS (= the relative RMS
    error of x @ W for x with independent unit entries) and the largest error over the weights'
    RMS."""
    out = []
    for kind in ("normal", "student-t", "outlier rows"):
        w = synthetic_weights(kind, rows, columns)
        rms = float(jnp.sqrt(jnp.mean(w**2)))
        for label, fmt in WEIGHT_FORMATS.items():
            err = dequantize(quantize(w, fmt), jnp.float32) - w
            out.append(dict(distribution=kind, format=label, bits=bits_per_weight(fmt, rows, columns),
                            rel=float(jnp.sqrt(jnp.mean(err**2))) / rms, worst=float(jnp.max(jnp.abs(err))) / rms))
    return out


def weight_markdown(table: list[dict]) -> str:
    lines = ["| weights | format | bits per weight | rel. RMS error | largest error / RMS weight |", "|" + "---|" * 5]
    lines += [f"| {r['distribution']} | {r['format']} | {r['bits']:.3f} | {r['rel']:.4f} | {r['worst']:.3f} |"
              for r in table]
    return "\n".join(lines)


def rows() -> list[dict]:
    out = []
    for name, family in FAMILIES.items():
        model = bf16_model(name)
        held_out = HELD_OUT.token_ids(model.config.vocab_size)
        forward = jax.jit(lambda params: model.module.apply({"params": params}, held_out))
        ref = forward(model.params)
        for label, scope, method, fmt in variants():
            quantized, reports = quantize_model(model, plan_for(fmt, scope), method=method, calibration=CALIBRATION)
            logits = jax.jit(lambda params: quantized.module.apply({"params": params}, held_out))(quantized.params)
            ratio = np.median([r.gptq_error / r.rtn_error for r in reports]) if reports else float("nan")
            out.append(dict(family=family, format=label, scope=scope, method=method, **_errors(ref, logits), layer_ratio=ratio))
    return out


def _errors(ref_BTV: jax.Array, got_BTV: jax.Array) -> dict:
    """Relative RMS logit error, KL(ref || got) per token (nats), greedy (argmax) agreement."""
    rel = float(jnp.sqrt(jnp.mean((got_BTV - ref_BTV) ** 2) / jnp.mean(ref_BTV**2)))
    p_log, q_log = jax.nn.log_softmax(ref_BTV), jax.nn.log_softmax(got_BTV)
    kl = float(jnp.mean(jnp.sum(jnp.exp(p_log) * (p_log - q_log), -1)))
    agree = float(jnp.mean(jnp.argmax(ref_BTV, -1) == jnp.argmax(got_BTV, -1)))
    return dict(rel=rel, kl=kl, agree=agree)


def markdown(table: list[dict]) -> str:
    head = ("| family | format | quantized | method | rel. RMS logit error | KL(bf16 \\|\\| q) nats/token "
            "| greedy agreement | GPTQ / RTN layer error (median) |")
    lines = [head, "|" + "---|" * 8]
    for r in table:
        ratio = "" if np.isnan(r["layer_ratio"]) else f"{r['layer_ratio']:.2f}"
        lines.append(f"| {r['family']} | {r['format']} | {r['scope']} | {r['method']} | {r['rel']:.4f} | {r['kl']:.2e} "
                     f"| {r['agree']:.3f} | {ratio} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", action="store_true", help=f"also write {os.path.relpath(RESULT)}")
    parser.add_argument("--weights-only", action="store_true", help="only the synthetic weight table")
    parser.add_argument("--rows", type=int, default=4096, help="input rows of the synthetic weights")
    args = parser.parse_args(argv)
    start = time.time()
    weights = weight_markdown(weight_rows(args.rows))
    print(weights)
    if args.weights_only:
        return
    table = rows()
    seconds = time.time() - start
    text = markdown(table)
    print(text)
    if args.out:
        os.makedirs(os.path.dirname(RESULT), exist_ok=True)
        with open(RESULT, "w") as f:
            f.write(f"# Quantization error on tiny random models ({datetime.date.today()})\n\n")
            f.write(f"Generated by `python experiments/quant_error.py --out` ({seconds:.0f} s on CPU). "
                    f"Calibration: {CALIBRATION.tokens} random tokens; held out: {HELD_OUT.tokens} tokens "
                    f"(another seed). \"experts\" = routed experts only (Kimi K2 Thinking's recipe), \"all\" = every "
                    "linear layer except router, norms, embeddings, lm_head, weights_proj. Random models have "
                    "nearly flat logits (small top-1 margins), so greedy agreement here sits far below a trained "
                    "model's: compare rows, not absolute values. The last column is GPTQ's ||X(W - Q)||^2 over "
                    "RTN's on the calibration set (weights only: W4A4's GPTQ minimizes the same weight error). "
                    "\"nvfp4 w4a4\" also quantizes every NVFP4 layer's input but kv_b_proj's (absorbed MLA) (input global scales calibrated on the "
                    "calibration tokens, group scales per token as it comes), as Blackwell's FP4 tensor cores "
                    "compute it; \"nvfp4\" is weight-only, as on Hopper.\n\n")
            f.write(f"## The formats on weight matrices ({args.rows} x 512, BF16 values, round to nearest)\n\n"
                    + weights + "\n\n## Logits of the tiny models\n\n")
            f.write(text + "\n")
        print(f"wrote {RESULT}")


if __name__ == "__main__":
    main()
