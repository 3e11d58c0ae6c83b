"""Weight bytes of the full presets in each format (mixserve.weight_bytes, abstract: nothing is
allocated), total and per GPU at TP 8, next to the seed's GLM 5.2 numbers, and what mixserve's own
placement puts on one device at TP 8 and at EP 8 (mixserve.weight_bytes.device_bytes), as a markdown table.

    python experiments/weight_bytes.py            # print
    python experiments/weight_bytes.py --out      # also write experiments/results/weight_bytes.md
"""

from __future__ import annotations

import argparse
import datetime
import os
import time

import mixserve
from mixserve.weight_bytes import device_bytes
from models.config import RopeConfig
from models.presets import FULL_PRESETS
from models.weights import BF16, WeightFormat, WeightPlan

GIB = 2**30
TP = 8
INT4_G32, INT4_G128, FP8 = WeightFormat("int4", 32), WeightFormat("int4", 128), WeightFormat("fp8_block")
NVFP4 = WeightFormat("nvfp4")
# label -> plan. "linear" = attention, dense MLPs, shared experts; router, norms, embeddings, lm_head stay BF16.
PLANS = {
    "bf16": WeightPlan(),
    "fp8 (all linear)": WeightPlan(FP8, FP8),
    "int4 g32 experts, rest bf16": WeightPlan(INT4_G32, BF16),
    "int4 g128 experts, rest bf16": WeightPlan(INT4_G128, BF16),
    "int4 g32 experts, rest fp8": WeightPlan(INT4_G32, FP8),
    "int4 g32 all linear": WeightPlan(INT4_G32, INT4_G32),
    "nvfp4 experts, rest bf16": WeightPlan(NVFP4, BF16),
}
SEED = {"fp8 (all linear)": (705, 88), "int4 g32 experts, rest bf16": (421, 52)}  # GLM 5.2, "GB" = GiB
RESULT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "weight_bytes.md")


def architectures() -> dict[str, object]:
    """Presets that differ only in context length / RoPE scaling weigh the same: one row each."""
    names: dict[object, list[str]] = {}
    for name, cfg in FULL_PRESETS.items():
        names.setdefault(cfg.replace(max_position_embeddings=0, rope=RopeConfig()), []).append(name)
    return {", ".join(group): cfg for cfg, group in names.items()}


def rows() -> list[dict]:
    out = []
    for names, cfg in architectures().items():
        for label, plan in PLANS.items():
            b = mixserve.weight_bytes(cfg, plan=plan, tp=TP)
            seed = SEED.get(label) if "glm-5" in names.split(", ") else None
            placed = {ep: device_bytes(cfg, plan, TP, ep) for ep in (False, True)}
            out.append(dict(preset=names, plan=label, b=b, seed=seed, placed=placed))
    return out


def markdown(table: list[dict]) -> str:
    head = ("| preset | format | experts | attention | dense+shared | emb+head | other | MTP | checkpoint GiB (GB) "
            f"| per GPU TP{TP}, replicated parts whole | checkpoint / {TP} | seed checkpoint / per GPU "
            f"| mixserve TP{TP} / EP{TP}, one device |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in table:
        b = r["b"]
        gib = lambda x: f"{x / GIB:.1f}"
        seed = "" if r["seed"] is None else (
            f"{r['seed'][0]} / {r['seed'][1]} ({100 * (b.checkpoint / GIB / r['seed'][0] - 1):+.1f}% / "
            f"{100 * (b.checkpoint / TP / GIB / r['seed'][1] - 1):+.1f}%)")
        lines.append(
            f"| {r['preset']} | {r['plan']} | {gib(b.experts)} | {gib(b.attention)} | {gib(b.dense)} | {gib(b.embeddings)} "
            f"| {gib(b.other)} | {gib(b.mtp)} | {gib(b.checkpoint)} ({b.checkpoint / 1e9:.0f}) | {gib(b.per_gpu)} "
            f"| {gib(b.checkpoint / TP)} | {seed} | {gib(r['placed'][False])} / {gib(r['placed'][True])} |"
        )
    return "\n".join(lines)


NOTES = f"""\
- Sizes in GiB (2^30 bytes); the checkpoint column also gives decimal GB. The seed's "705 GB -> 421 GB"
  are GiB: GLM-5's FP8 checkpoint is 756 GB = 704 GiB.
- checkpoint = main model + the MTP layer (estimated as one more decoder layer like the last, plus
  eh_proj and 3 norms; its embedding and head are shared). count_params leaves MTP out.
- fp8: 1 byte per weight + a float32 scale per 128x128 block; int4: 0.5 byte + a bf16 scale per group
  (g32: 0.5625 byte per weight, g128: 0.5156). Router, norms, embeddings and lm_head stay BF16
  (the router and the DSA indexer's weights_proj float32).
- nvfp4: 0.5 byte + an e4m3 scale per 16 weights (0.5625 byte, as int4 g32) + a float32 global scale per
  matrix (per expert): the seed's next step costs the bytes of its INT4 plan, plus 4 bytes a matrix. Its
  groups of 16 divide every preset's TP{TP} expert share (GLM-4.5's 192 rows, Air's 176), so nothing is
  re-blocked and TP{TP} holds what EP{TP} holds.
- Which plan is the seed's INT4? "int4 g32 experts, rest bf16" (Kimi K2 Thinking's recipe) gives
  421.2 GiB against the seed's 421; "rest fp8" would give 405.0 and int4 g128 experts 389.1.
- Per GPU at TP{TP}: the seed's 88 / 52 are the checkpoint / 8 (704.4 / 8 = 88.1, 421.2 / 8 = 52.6).
  Our replication-aware figure keeps norms, router, MLA q_a_proj / kv_a_proj_with_mqa and the DSA
  indexer whole on every rank (our reading of SGLang's DeepSeek-V3 / GLM-5 models): +2% for FP8
  (90.1) and +7% for INT4 (56.3, those layers are BF16 there). KV cache and activations come on top.
- mixserve TP{TP} / EP{TP}: the main model (no MTP: mixserve does not load it) on the fullest device as
  `mixserve.sharding` places it (`Engine(mesh=tp_mesh({TP}))`, and with `expert_parallel=True`). TP
  splits an expert's hidden width. Where a device's share would cut scale groups (GLM-4.5's 1536 / {TP} = 192
  rows at INT4 g128, GLM-4.5-Air's 1408 / {TP} = 176 at g32 and g128), the scales are re-blocked to
  gcd(group, share) rows and split with the values (models.weights.split_for_tp): a device holds
  (group / gcd) / {TP} of the whole scales where EP holds 1 / {TP}, and that is what TP holds above EP:
  GLM-4.5 g128 (g64) and Air g32 (g16) a quarter of them, Air g128 (g16) all of them, as many as
  keeping them whole would. EP gives each device E / {TP} whole experts, so every format splits evenly.
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", action="store_true", help=f"also write {os.path.relpath(RESULT)}")
    args = parser.parse_args()
    start = time.time()
    table = markdown(rows())
    seconds = time.time() - start
    print(table)
    if args.out:
        os.makedirs(os.path.dirname(RESULT), exist_ok=True)
        with open(RESULT, "w") as f:
            f.write(f"# Weight bytes: full presets by format, vs the seed ({datetime.date.today()})\n\n")
            f.write(f"Generated by `python experiments/weight_bytes.py --out` (abstract, jax.eval_shape; {seconds:.1f} s on CPU).\n\n")
            f.write(NOTES + "\n" + table + "\n")
        print(f"wrote {RESULT}")


if __name__ == "__main__":
    main()
