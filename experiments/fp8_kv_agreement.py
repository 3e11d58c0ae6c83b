"""FP8 KV formats against full-precision KV on tiny random models: greedy-token agreement,
multiple-choice log-likelihood scoring (how the seed's ARC and MMLU columns are computed), and the
error each format leaves in the MLA latents the models actually produce.

    python experiments/fp8_kv_agreement.py [--out experiments/results/fp8_kv_agreement.md]

Formats: e4m3 and e5m2 with a per-tensor scale of 1 (SGLang's default without a scales file),
e4m3 with a calibrated per-tensor scale (absmax / 448 over 8 other prompts of 32 tokens:
mixserve.kv_cache.calibrate_scales, as SGLang/vLLM calibrate k_scale/v_scale), and for MLA models fp8_ds_mla
(FlashMLA's layout: a power-of-two scale per token and 128-column tile, RoPE dims in BF16).

Random models have nearly flat logits (small top-1 margins), so one flipped token changes the
rest of a sequence: read "first token" and "all positions" together, and compare rows rather than
expecting a trained model's agreement. The latent table needs no decoding: it records every
layer's latent [c_kv, k_pe] of the prompts in a cache-free forward, stores it in each format and
reads it back.
"""

from __future__ import annotations

import argparse
import datetime

import jax.numpy as jnp
import numpy as np

from experiments.report import publish
import mixserve
from mixserve.engine import Engine
from experiments.serving import SEED_KIMI_BF16_TOKENS
from mixserve.kv_cache import bytes_per_token, calibrate_scales, decode_entry, encode_entry, init_pools, kv_format
from models.kv import NoCache
from models.presets import PRESETS

MODELS = ("tiny-kimi", "tiny-glm4", "tiny-glm5")


def serve(model, kv_dtype: str, prompts, new: int, **scales):
    return Engine(model, kv_dtype=kv_dtype, num_pages=1024, page_size=16, max_batch=len(prompts), stop_tokens=(),
                  **scales).generate(prompts, max_new_tokens=new)


CHOICE_CHUNK = 16  # prefill chunk of the scoring engines: an answer reads its context from the pages


def choice_items(rng, n: int) -> list[tuple[list[int], list[list[int]]]]:
    """n multiple-choice items as MMLU is scored: a context (the question) of 20-40 tokens and 4
    distinct one-token answers (the letters)."""
    return [([int(t) for t in rng.integers(0, 256, rng.integers(20, 41))],
             [[int(t)] for t in rng.choice(256, 4, replace=False)]) for _ in range(n)]


def continuation_logprobs(model, kv_dtype: str, items, **scales) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """lm-eval's loglikelihood request through the engine: each context + answer served with
    prompt_logprobs, in chunks of CHOICE_CHUNK. Returns, per sequence, the logprobs of its answer
    tokens, and those of its first chunk's positions (which attend over fresh keys)."""
    seqs = [ctx + cont for ctx, conts in items for cont in conts]
    results = Engine(model, kv_dtype=kv_dtype, num_pages=1024, page_size=16, max_batch=len(seqs),
                     prefill_chunk=CHOICE_CHUNK, stop_tokens=(), **scales).generate(seqs, max_new_tokens=1,
                                                                                 prompt_logprobs=0)
    starts = [len(ctx) for ctx, conts in items for _ in conts]
    values = [np.array([lp.logprob for lp in r.prompt_logprobs[1:]]) for r in results]  # token j at [j - 1]
    return [v[s - 1:] for v, s in zip(values, starts)], [v[:CHOICE_CHUNK] for v in values]


def token_agreement(ref, test, new: int) -> tuple[float, float, float]:
    """(first token agrees, all positions agree, mean common prefix) of two lists of Results."""
    first = np.mean([a.tokens[0] == b.tokens[0] for a, b in zip(ref, test)])
    pos = np.mean([x == y for a, b in zip(ref, test) for x, y in zip(a.tokens, b.tokens)])
    prefix = np.mean([next((i for i, (x, y) in enumerate(zip(a.tokens, b.tokens)) if x != y), new) for a, b in zip(ref, test)])
    return float(first), float(pos), float(prefix)


class _LatentRecorder(NoCache):
    """Cache-free attention that keeps every MLA layer's latent [c_kv, k_pe] per token."""

    def __init__(self):
        self.latents = []

    def layer(self, i):
        return self

    def attend_mla(self, q_nope, q_pe, c_kv, k_pe, kv_b, *, scale, index_mask=None):
        self.latents.append(np.concatenate([np.asarray(c_kv), np.asarray(k_pe)], axis=-1).reshape(-1, c_kv.shape[-1] + k_pe.shape[-1]))
        return super().attend_mla(q_nope, q_pe, c_kv, k_pe, kv_b, scale=scale, index_mask=index_mask)


def latent_errors(model, prompts, formats: dict) -> tuple[dict, dict]:
    """Per format and per part of the latent (c_kv: the kv_lora_rank nope dims; k_pe: the RoPE
    dims), the relative L2 error of every layer's stored-and-read latent per prompt token (all
    layers pooled); and per part, the ratio of the largest to the smallest token norm seen."""
    rec = _LatentRecorder()
    for p in prompts:
        model.module.apply({"params": model.params}, jnp.asarray([p], jnp.int32), kv=rec)
    real = np.concatenate(rec.latents).astype(np.float32)  # [tokens * layers, C]
    parts = {"c_kv": slice(0, model.config.kv_lora_rank), "k_pe": slice(model.config.kv_lora_rank, None)}
    norms = {part: np.linalg.norm(real[:, cols], axis=-1) for part, cols in parts.items()}
    errors = {}
    for label, (name, scale) in formats.items():
        layer = {k: v[0, 0] for k, v in init_pools(model.config, 1, 1, kv_format(name, model.dtype))[0].items()}
        stored = encode_entry(layer, "latent", jnp.asarray(real), jnp.float32(scale))
        back = np.asarray(decode_entry(stored, "latent", jnp.float32(scale), jnp.float32))
        errors[label] = {part: np.linalg.norm(back[:, cols] - real[:, cols], axis=-1) / np.maximum(norms[part], 1e-30)
                         for part, cols in parts.items()}
    spread = {part: float(n.max() / max(n.min(), 1e-30)) for part, n in norms.items()}
    return errors, spread


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    args = p.parse_args(argv)
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(0, 256, rng.integers(8, 64))] for _ in range(args.prompts)]
    calibration = np.random.default_rng(1).integers(0, 256, (8, 32))
    items = choice_items(np.random.default_rng(2), args.prompts)
    lines = [f"# FP8 KV formats vs full-precision KV ({datetime.date.today()})", "",
             f"{args.prompts} prompts of 8-63 tokens, float32 weights. `python experiments/fp8_kv_agreement.py"
             f" --prompts {args.prompts} --new-tokens {args.new_tokens}"
             + ("" if tuple(args.models) == MODELS else f" --models {' '.join(args.models)}") + "`.", "",
             "## Greedy agreement", "",
             f"{args.new_tokens} new tokens. The first token comes from prefill, which attends over the fresh "
             "full-precision keys (these prompts fit one chunk), so it agrees by construction, as in the seed's "
             "BF16-prefill / FP8-decode split; every later token reads FP8 pages. Random models have flat logits: "
             "one flip changes the rest of a sequence.", "",
             "| model | KV | first token agrees | all positions agree | mean common prefix (tokens) |", "|---|---|---|---|---|"]
    choice_lines = ["", "## Multiple-choice scoring (log-likelihood)", "",
                    f"{len(items)} items as MMLU is scored (the seed's accuracy table): a context of 20-40 random "
                    "tokens and 4 one-token answers, each scored by its log-probability after the context "
                    "(lm-eval's loglikelihood request; one sequence per answer), read from the engine's "
                    f"`prompt_logprobs`; the pick is the likeliest answer. Prefill runs chunks of {CHOICE_CHUNK} tokens, so an answer reads at least "
                    "its context's first chunk from the pages in the format under test; a first chunk's positions "
                    "attend over the fresh keys only.", "",
                    "| model | KV | pick agrees | answer logprob: mean abs diff | max abs diff | first chunk: max abs diff |",
                    "|---|---|---|---|---|---|"]
    error_lines = ["", "## Latent error per format (MLA models)", "",
                   "Every layer's latent [c_kv, k_pe] for every prompt token, stored and read back: relative L2 "
                   "error per token and layer.", "",
                   "| model | KV | c_kv median | c_kv max | k_pe median | k_pe max |", "|---|---|---|---|---|---|"]
    spreads, identical, margins = [], [], []
    for name in args.models:
        model = mixserve.load(name, dtype="float32")
        # Calibrated on other prompts, as a deployment calibrates before serving.
        k_scale, v_scale = calibrate_scales(model, calibration, kv_dtype="fp8_e4m3")
        runs = [("fp8_e4m3", "fp8_e4m3 (scale 1)", {}),
                ("fp8_e4m3", "fp8_e4m3 (calibrated)", dict(k_scale=k_scale, v_scale=v_scale)),
                ("fp8_e5m2", "fp8_e5m2 (scale 1)", {})]
        if model.config.attention_kind == "mla":
            runs.append(("fp8_ds_mla", "fp8_ds_mla", {}))
        full = serve(model, "auto", prompts, args.new_tokens)
        full_choice, full_first = continuation_logprobs(model, "auto", items)
        scores = lambda logprobs: np.reshape([v.sum() for v in logprobs], (len(items), 4))
        pick = lambda logprobs: np.argmax(scores(logprobs), axis=1)
        top2 = np.sort(scores(full_choice), axis=1)[:, -2:]
        margins.append(f"{name} {np.median(top2[:, 1] - top2[:, 0]):.2f}")
        served = {}
        for kv, label, scales in runs:
            served[label] = serve(model, kv, prompts, args.new_tokens, **scales)
            first, pos, prefix = token_agreement(full, served[label], args.new_tokens)
            lines.append(f"| {name} | {label} | {first:.2f} | {pos:.2f} | {prefix:.1f} / {args.new_tokens} |")
            choice, first_chunk = continuation_logprobs(model, kv, items, **scales)
            diff = np.abs(np.concatenate(choice) - np.concatenate(full_choice))
            first_diff = np.abs(np.concatenate(first_chunk) - np.concatenate(full_first)).max()
            choice_lines.append(f"| {name} | {label} | {np.mean(pick(choice) == pick(full_choice)):.2f} | "
                                f"{diff.mean():.2e} | {diff.max():.2e} | {first_diff:.1e} |")
        if "fp8_ds_mla" in served:
            same = token_agreement(served["fp8_e4m3 (scale 1)"], served["fp8_ds_mla"], args.new_tokens)[1]
            identical.append(f"{name} {same:.0%}")
        if model.config.attention_kind == "mla":
            errors, spread = latent_errors(model, prompts, {
                "fp8_e4m3 (scale 1)": ("fp8_e4m3", 1.0),
                "fp8_e4m3 (calibrated)": ("fp8_e4m3", float(jnp.mean(k_scale))),
                "fp8_ds_mla": ("fp8_ds_mla", 1.0)})
            for label, e in errors.items():
                error_lines.append(f"| {name} | {label} | {np.median(e['c_kv']):.4f} | {e['c_kv'].max():.4f} | "
                                   f"{np.median(e['k_pe']):.4f} | {e['k_pe'].max():.4f} |")
            spreads.append(f"{name}: c_kv {spread['c_kv']:.2f}, k_pe {spread['k_pe']:.2f}; calibrated scale "
                           f"{float(jnp.mean(k_scale)):.3g}")
    error_lines += ["", "Largest over smallest token norm, per part: " + "; ".join(spreads) + ".", "",
                    "Positions where fp8_ds_mla served the same token as fp8_e4m3 at scale 1: " + ", ".join(identical) + ".",
                    "", "Reading. A power-of-two scale does not change how e4m3 rounds a normal value (the rounding is "
                    "relative), so tiles change the stored nope values only where one scale would leave them in e4m3's "
                    "subnormals (below 2^-6 of the scale) or saturate them. These random models' c_kv comes out of an "
                    "RMSNorm with unit weights: every token has the same norm, no value of consequence is subnormal at "
                    "scale 1, and the two formats store the same c_kv. What differs is the RoPE part, kept in BF16 by "
                    "fp8_ds_mla (its error above). Where token magnitudes do spread (tests/test_kernels_tiled_fp8.py: "
                    "e^+-6), one scale leaves 20-29% of tokens above 10% relative error and tiles none above 3.3%. A "
                    "trained checkpoint's latents are needed to say which case serving is in; none is loadable here."]
    choice_lines += ["", "Median margin between the best and second-best choice under full-precision KV (nats): "
                     + ", ".join(margins) + ". A pick flips only where a format moves two scores by about that much."]
    publish(lines + choice_lines + error_lines + capacity_lines(), args.out)


def capacity_lines() -> list[str]:
    """What each format costs in pool capacity, full-size MLA presets, at the seed's Kimi K2.6 budget."""
    budget = SEED_KIMI_BF16_TOKENS * bytes_per_token(PRESETS["kimi-k2.6"], kv_format("bfloat16", None))
    lines = ["", f"## Pool capacity at the seed's Kimi K2.6 budget ({SEED_KIMI_BF16_TOKENS:,} BF16 tokens = "
             f"{budget / 2**30:.1f} GiB)", "", "| preset | KV | bytes per token | tokens | vs BF16 |", "|---|---|---:|---:|---:|"]
    for name in ("kimi-k2.6", "glm-5"):
        base = budget // bytes_per_token(PRESETS[name], kv_format("bfloat16", None))
        for kv in ("bfloat16", "fp8_e4m3", "fp8_ds_mla"):
            per_token = bytes_per_token(PRESETS[name], kv_format(kv, None))
            lines.append(f"| {name} | {kv} | {per_token:,} | {budget // per_token:,} | {budget // per_token / base:.2f}x |")
    return lines


if __name__ == "__main__":
    main()
