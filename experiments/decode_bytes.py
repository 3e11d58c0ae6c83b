"""The seed's two decode throughput tables against the bytes one GPU reads per decode step.

    python experiments/decode_bytes.py [--context N] [--out experiments/results/decode_bytes.md]

The seed says decode streams the weights (and the KV cache) from HBM every step, so fewer bytes
means faster steps. It reports two tables on H200s: GLM 5.2 with FP8 against INT4 weights (+55% at
concurrency 1 falling to +16% at 64) and Kimi K2.6 with BF16 against FP8 KV (FP8 4-9% slower up to
32, then the only one that fits 64). This counts what one GPU at 8-way tensor parallelism reads per
decode step in each setting, and asks how much of each table bytes explain. Abstract
(jax.eval_shape via mixserve.weight_bytes): nothing is allocated.

A step of c requests (one token each) reads, on one GPU at tensor parallelism tp:
- weights: attention (DSA indexer included), dense and shared-expert MLPs, norms, router and
  lm_head, split tp ways except what SGLang keeps whole on every rank (weight_bytes.REPLICATED).
  The embedding table is only looked up (c rows): left out.
- routed experts: a token picks top_k distinct experts of E, so under uniform routing an expert
  escapes one token with probability 1 - k/E, and c tokens touch E (1 - (1 - k/E)^c) experts per
  MoE layer on average. Uniform routing touches the most: skewed routing touches fewer. TP splits
  every expert's width, so a GPU reads 1/tp of each touched expert.
- KV: each request's cache at the given context. MLA latents serve all heads, so every TP rank
  reads all of them; GQA KV heads split over the ranks. DSA (GLM-5) reads the index keys of every
  token in its "full" indexer layers and the latents of at most index_topk tokens per layer.
Left out of the seed's tables: activations, communication, launch costs, and MTP/speculative
decoding (the seed does not say whether it used it); a last table estimates what MTP drafts
would change (`speculative_bytes_per_token`). The seed gives neither context lengths nor parallelism for these tables:
TP8 and one context for every request are assumptions, varied in the sensitivity table.

Each table has a baseline column (FP8 weights; BF16 KV) and a variant (INT4 weights; FP8 KV). Two
readings:
- bytes only: step time = bytes / bandwidth, so the variant's gain is the byte ratio; and
- fitted: step time = t0 + bytes / bandwidth, t0 and bandwidth fitted (least squares) to the
  baseline rows, then applied to the variant's bytes. Where the variant has rows enough, it gets a
  fit of its own too: a different t0 or bandwidth is what bytes do not explain.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import os
import re
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from experiments.report import publish  # noqa: E402
from experiments.weight_bytes import PLANS  # noqa: E402
from mixserve.kv_cache import KVFormat, bytes_per_token, kv_format  # noqa: E402
from mixserve.weight_bytes import weight_bytes  # noqa: E402
from models.config import ModelConfig  # noqa: E402
from models.presets import get_preset  # noqa: E402
from models.weights import WeightPlan  # noqa: E402

GIB = 2**30
TP = 8
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
COPY_BENCHMARK = os.path.join(RESULTS, "gpu_kernels_h200_2026-11-30_run4.md")
DEFAULT_CONTEXT = 8192 + 1000 // 2  # the seed's one named workload (section 3): 8,192 in, 1,000 out


@dataclasses.dataclass(frozen=True)
class Setup:
    """One column's serving setting: a weight plan (experiments/weight_bytes.py's PLANS) and a KV format."""

    label: str
    plan: str
    kv_dtype: str


@dataclasses.dataclass(frozen=True)
class SeedTable:
    """One of the seed's decode tables (DIGEST.md): tok/s by concurrency, baseline against variant."""

    title: str
    preset: str
    baseline: Setup
    variants: tuple[Setup, ...]  # readings of the variant column (the INT4 plan is not stated)
    baseline_tok_s: dict[int, float]  # the rows the fit uses
    variant_tok_s: dict[int, float]
    gain: dict[int, float]  # variant / baseline - 1, as the seed states or implies it
    sources: str  # where the rows come from


def glm_int4_table(kv_dtype: str) -> SeedTable:
    """DIGEST.md section 2. The FP8 rows at 8 and 16 are garbled in the source: they are the INT4
    rows / (1 + the stated gain). The row at 32 is left out of the fit: its INT4 1,672 is the FP8
    figure at 64, and 1,672 / 1.27 matches nothing."""
    gain = {1: 0.55, 8: 0.21, 16: 0.21, 32: 0.27, 64: 0.16}
    int4 = {1: 92, 8: 413, 16: 838, 32: 1672, 64: 1933}
    fp8 = {1: 60, 8: int4[8] / (1 + gain[8]), 16: int4[16] / (1 + gain[16]), 64: 1672}
    return SeedTable(
        "GLM 5.2: FP8 against INT4 weights (DIGEST.md section 2)", "glm-5",
        Setup("FP8 weights", "fp8 (all linear)", kv_dtype),
        # The first matches the seed's 421 GiB checkpoint (experiments/results/weight_bytes.md).
        tuple(Setup(f"INT4 ({plan})", plan, kv_dtype)
              for plan in ("int4 g32 experts, rest bf16", "int4 g32 experts, rest fp8")),
        fp8, {c: v for c, v in int4.items() if c != 32}, gain,
        "FP8 at 8 and 16: INT4 / (1 + gain), garbled in the source; the row at 32 is left out "
        "(its INT4 figure repeats FP8's at 64).")


def kimi_kv_table() -> SeedTable:
    """DIGEST.md section 1: BF16 KV is out of memory at 64."""
    bf16, fp8 = {1: 137, 16: 1106, 32: 1558}, {1: 125, 16: 1028, 32: 1489, 64: 2192}
    plan = "int4 g32 experts, rest bf16"  # Kimi K2.6 ships this (compressed-tensors, routed experts)
    return SeedTable(
        "Kimi K2.6: BF16 against FP8 KV (DIGEST.md section 1)", "kimi-k2.6",
        Setup("BF16 KV", plan, "bfloat16"), (Setup("FP8 KV", plan, "fp8_e4m3"),),
        bf16, fp8, {c: fp8[c] / bf16[c] - 1 for c in bf16},
        "the row at 1 comes from the source's summary text; BF16 KV did not fit 64 requests.")


@dataclasses.dataclass(frozen=True)
class StepBytes:
    """Bytes one GPU reads in one decode step (experts: expected under uniform routing)."""

    weights: float  # read whatever the routing
    experts: float  # routed experts the step's tokens touch
    kv: float  # the requests' KV cache

    @property
    def total(self) -> float:
        return self.weights + self.experts + self.kv


def experts_touched(num_experts: int, top_k: int, tokens: int) -> float:
    """Expected distinct experts c tokens choose, each top_k distinct of num_experts, uniformly."""
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** tokens)


def kv_bytes_per_request(cfg: ModelConfig, fmt: KVFormat, context: int, tp: int) -> float:
    """KV bytes one decode step reads for one request of `context` tokens, on one of tp GPUs."""
    if cfg.attention_kind == "gqa":
        heads_per_rank = max(1, cfg.num_kv_heads // tp)  # SGLang replicates KV heads when tp exceeds them
        return bytes_per_token(cfg, fmt) * context * heads_per_rank / cfg.num_kv_heads
    if cfg.family != "glm_moe_dsa":
        return bytes_per_token(cfg, fmt) * context
    latent = bytes_per_token(cfg, fmt, entry="latent")  # summed over layers
    index = bytes_per_token(cfg, fmt, entry="index")  # "full" indexer layers only
    return index * context + latent * min(context, cfg.index_topk)


def kv_bytes_per_query(cfg: ModelConfig, fmt: KVFormat, context: int, tp: int) -> float:
    """The part of kv_bytes_per_request that a query token chose for itself, so that another
    query token of the same request reads it again even when they share one read of the pages:
    DSA's top-k latents (the index keys are shared); none for dense attention."""
    if cfg.family != "glm_moe_dsa":
        return 0.0
    return bytes_per_token(cfg, fmt, entry="latent") * min(context, cfg.index_topk)


@functools.lru_cache(maxsize=None)
def weight_reads(cfg: ModelConfig, plan: WeightPlan, tp: int) -> tuple[float, float]:
    """(bytes every step reads, bytes of one routed expert over all MoE layers), on one of tp GPUs."""
    wb = weight_bytes(cfg.replace(num_mtp_layers=0), plan=plan, tp=tp)  # MTP passes: speculative_bytes_per_token
    lm_head = wb.embeddings if cfg.tie_word_embeddings else wb.embeddings // 2
    # Every replicated byte is among these (norms, router, MLA down-projections, indexer).
    always = wb.attention + wb.dense + wb.other + lm_head
    return wb.replicated + (always - wb.replicated) / tp, wb.experts / cfg.n_routed_experts / tp


def step_bytes(cfg: ModelConfig, plan: WeightPlan, *, tp: int, concurrency: int, context: int,
               kv_dtype: str = "fp8_e4m3") -> StepBytes:
    """What one GPU reads for one decode step of `concurrency` requests (module docstring)."""
    weights, per_expert = weight_reads(cfg, plan, tp)
    # The expected count is the same in every MoE layer.
    touched = experts_touched(cfg.n_routed_experts, cfg.num_experts_per_tok, concurrency)
    return StepBytes(weights=weights, experts=touched * per_expert,
                     kv=concurrency * kv_bytes_per_request(cfg, kv_format(kv_dtype, "bfloat16"), context, tp))


@dataclasses.dataclass(frozen=True)
class Fit:
    """step seconds = t0 + bytes / bandwidth."""

    t0: float  # s
    bandwidth: float  # B/s

    def tok_s(self, concurrency: int, nbytes: float) -> float:
        return concurrency / (self.t0 + nbytes / self.bandwidth)


def fit_step_time(nbytes: list[float], seconds: list[float]) -> Fit:
    """Least squares over (bytes, seconds) pairs."""
    slope, t0 = np.polyfit(np.asarray(nbytes, float), np.asarray(seconds, float), 1)
    return Fit(float(t0), float(1.0 / slope))


def copy_bandwidth(path: str = COPY_BENCHMARK) -> float:
    """The device-to-device copy bandwidth (B/s) the H200 benchmark measured."""
    with open(path) as f:
        return float(re.search(r"copy bandwidth: ([0-9.]+) GB/s", f.read()).group(1)) * 1e9


@dataclasses.dataclass(frozen=True)
class Analysis:
    table: SeedTable
    context: int
    bytes: dict[str, dict[int, StepBytes]]  # setup label -> concurrency -> bytes
    fit: Fit  # to the baseline rows
    own_fits: dict[str, Fit]  # variant label -> its fit to the variant rows

    def fitted_tok_s(self, setup: Setup, c: int) -> float:
        return self.fit.tok_s(c, self.bytes[setup.label][c].total)

    def bytes_only_gain(self, setup: Setup, c: int) -> float:
        return self.bytes[self.table.baseline.label][c].total / self.bytes[setup.label][c].total - 1

    def fitted_gain(self, setup: Setup, c: int) -> float:
        return self.fitted_tok_s(setup, c) / self.fitted_tok_s(self.table.baseline, c) - 1


def analyse(table: SeedTable, context: int = DEFAULT_CONTEXT, tp: int = TP) -> Analysis:
    cfg = get_preset(table.preset)
    rows = sorted({*table.gain, *table.baseline_tok_s, *table.variant_tok_s})
    nbytes = {s.label: {c: step_bytes(cfg, PLANS[s.plan], tp=tp, concurrency=c, context=context, kv_dtype=s.kv_dtype)
                        for c in rows} for s in (table.baseline, *table.variants)}

    def fit(label: str, tok_s: dict[int, float]) -> Fit:
        return fit_step_time([nbytes[label][c].total for c in tok_s], [c / v for c, v in tok_s.items()])

    own = {s.label: fit(s.label, table.variant_tok_s) for s in table.variants}
    return Analysis(table, context, nbytes, fit(table.baseline.label, table.baseline_tok_s), own)


pct = lambda x: f"{100 * x:+.0f}%"


def table_markdown(a: Analysis, copy_bw: float) -> list[str]:
    t = a.table
    lines = [f"## {t.title}", "", f"Seed rows: {t.sources} Context {a.context} tokens per request, TP{TP}.", "",
             "Bytes one GPU reads per decode step (GiB):", "",
             "| setting | KV | concurrency | weights | routed experts | KV | total | tok/s at copy bandwidth |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for setup in (t.baseline, *t.variants):
        for c, b in a.bytes[setup.label].items():
            lines.append(f"| {setup.label} | {setup.kv_dtype} | {c} | {b.weights / GIB:.2f} | {b.experts / GIB:.2f} "
                         f"| {b.kv / GIB:.2f} | {b.total / GIB:.2f} | {c * copy_bw / b.total:,.0f} |")
    lines += ["", f"The {t.baseline.label} fit: step time = {1e3 * a.fit.t0:.1f} ms + bytes / "
              f"{a.fit.bandwidth / 1e9:,.0f} GB/s ({100 * a.fit.bandwidth / copy_bw:.0f}% of the copy bandwidth).", "",
              "| setting | concurrency | seed tok/s | fitted tok/s | residual | seed gain | bytes-only gain | fitted gain |",
              "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for c, tok_s in t.baseline_tok_s.items():
        fitted = a.fitted_tok_s(t.baseline, c)
        lines.append(f"| {t.baseline.label} | {c} | {tok_s:,.0f} | {fitted:,.0f} | {pct(fitted / tok_s - 1)} | | | |")
    for setup in t.variants:
        for c in a.bytes[setup.label]:
            seed = t.variant_tok_s.get(c)
            fitted = a.fitted_tok_s(setup, c)
            lines.append(f"| {setup.label} | {c} | {'' if seed is None else f'{seed:,.0f}'} | {fitted:,.0f} "
                         f"| {'' if seed is None else pct(fitted / seed - 1)} "
                         f"| {pct(t.gain[c]) if c in t.gain else ''} | {pct(a.bytes_only_gain(setup, c))} "
                         f"| {pct(a.fitted_gain(setup, c))} |")
    return lines + ["", "Reading:", ""] + reading(a, copy_bw)


def reading(a: Analysis, copy_bw: float) -> list[str]:
    """What the tables say, in numbers taken from them."""
    t = a.table
    worst = lambda fit, tok_s, label: max(abs(fit.tok_s(c, a.bytes[label][c].total) / v - 1) for c, v in tok_s.items())
    lines = [f"- The {t.baseline.label} rows fit a fixed {1e3 * a.fit.t0:.1f} ms per step plus bytes at "
             f"{a.fit.bandwidth / 1e9:,.0f} GB/s ({100 * a.fit.bandwidth / copy_bw:.0f}% of the copy bandwidth), "
             f"within {100 * worst(a.fit, t.baseline_tok_s, t.baseline.label):.1f}% at every row."]
    low, high = min(t.gain), max(t.gain)
    for setup in t.variants:
        own = a.own_fits[setup.label]
        lines.append(
            f"- {setup.label}: at concurrency {low} the seed's gain is {pct(t.gain[low])}, bytes alone give "
            f"{pct(a.bytes_only_gain(setup, low))} and the fit {pct(a.fitted_gain(setup, low))}; at {high}, "
            f"{pct(t.gain[high])} against {pct(a.bytes_only_gain(setup, high))} and {pct(a.fitted_gain(setup, high))}. "
            f"Its own rows fit {1e3 * own.t0:.1f} ms + bytes / {own.bandwidth / 1e9:,.0f} GB/s (within "
            f"{100 * worst(own, t.variant_tok_s, setup.label):.1f}%), against the baseline's "
            f"{1e3 * a.fit.t0:.1f} ms and {a.fit.bandwidth / 1e9:,.0f} GB/s.")
    step_ms = 1e3 * low / t.variant_tok_s[low]
    if step_ms < 1e3 * a.fit.t0:
        lines.append(
            f"- At concurrency {low} the seed's variant step takes {step_ms:.1f} ms, less than the "
            f"{t.baseline.label} fit's fixed {1e3 * a.fit.t0:.1f} ms alone: that gain is not a saving of bytes. "
            f"Something the byte count does not see (kernel efficiency at one token, launches, communication) "
            f"cost less there.")
    return lines


def emitted_per_step(acceptance: float, k: int) -> float:
    """Expected tokens a request gets from one step verifying k drafts, each kept with probability
    `acceptance` while every one before it was (the first rejection ends the run; the step adds
    one token of its own): 1 + a + a^2 + ... + a^k."""
    return sum(acceptance**i for i in range(k + 1))


def speculative_bytes_per_token(cfg: ModelConfig, plan: WeightPlan, *, tp: int, concurrency: int, context: int,
                                k: int, acceptance: float, folded: bool, kv_dtype: str = "fp8_e4m3") -> float:
    """Bytes one GPU reads per emitted token when each step verifies k MTP drafts per request.
    - The model runs c (k + 1) tokens: the experts they touch, the weights once.
    - KV: each position verified as its own decode row reads its request's cache again: (k + 1) c
      caches. folded: the positions folded into the query rows (FlashMLA's seqlen_q; mixserve's
      kernels and XLA path), c caches, plus what each position chose for itself (DSA's top-k
      latents, kv_bytes_per_query) k c more times.
    - The MTP layer runs k times over c tokens; each pass reads about one decoder layer (the
      step's weights and c tokens' experts over num_layers) and one layer of the caches.
    k = 0 is plain decode."""
    tokens = concurrency * (k + 1)
    verify = step_bytes(cfg, plan, tp=tp, concurrency=tokens, context=context, kv_dtype=kv_dtype)
    kv_per_request = verify.kv / tokens
    again = kv_bytes_per_query(cfg, kv_format(kv_dtype, "bfloat16"), context, tp) if folded else kv_per_request
    kv = concurrency * (kv_per_request + k * again)
    one_pass = step_bytes(cfg, plan, tp=tp, concurrency=concurrency, context=context, kv_dtype=kv_dtype)
    mtp = k * one_pass.total / cfg.num_layers
    return (verify.weights + verify.experts + kv + mtp) / (concurrency * emitted_per_step(acceptance, k))


def speculative_table(copy_bw: float) -> list[str]:
    """GLM 5.2 and GLM-4.7 (INT4 experts, rest FP8; FP8 KV) with MTP drafts: bytes per emitted
    token against plain decode's, so the bytes-only speedup, with verify rows reading the caches
    once per position and folded (once per request)."""
    cases = [(1, 0.85), (3, 0.85), (3, 0.6)]
    lines = ["## Speculative decoding with MTP drafts: bytes per emitted token", "",
             "TP8, INT4 experts (rest FP8), FP8 KV. Each cell: the bytes-only speedup over plain decode "
             "(plain bytes per token / speculative bytes per token), with each position verified as its own decode "
             "row (its request's cache read again) / with the positions folded into one read (FlashMLA's seqlen_q). "
             "mixserve folds them since 2026-12-02 (the second number); GLM-5's positions share the read of the "
             "index keys, but each reads the top-k latents it chose (counted in the second number too). "
             "Acceptance: the chance each draft is kept, the same for every draft (assumed; DeepSeek-V3's report, as "
             "quoted, gives 85-90% for its one MTP token, and later drafts of a reused layer do worse). Bytes only: "
             "verifying more tokens costs compute that a bytes model does not count.", "",
             "| model | context | concurrency | " + " | ".join(f"k={k}, acceptance {a:.0%}" for k, a in cases) + " |",
             "|---|---:|---:|" + "---|" * len(cases)]
    plan = PLANS["int4 g32 experts, rest fp8"]
    for name in ("glm-5", "glm-4.7"):
        cfg = get_preset(name)
        for context in (DEFAULT_CONTEXT, 32768):
            for c in (1, 8, 64):
                plain = speculative_bytes_per_token(cfg, plan, tp=TP, concurrency=c, context=context, k=0,
                                                    acceptance=0, folded=False)
                cells = []
                for k, a in cases:
                    rows, folded = (plain / speculative_bytes_per_token(cfg, plan, tp=TP, concurrency=c,
                                                                        context=context, k=k, acceptance=a, folded=f)
                                    for f in (False, True))
                    cells.append(f"{rows:.2f}x / {folded:.2f}x")
                lines.append(f"| {name} | {context} | {c} | " + " | ".join(cells) + " |")
    return lines


def sensitivity(tables: list[SeedTable], contexts: tuple[int, ...], copy_bw: float) -> list[str]:
    lines = ["## Sensitivity to the assumed context", "",
             "A fitted bandwidth above the copy bandwidth means that setting counts more bytes than the seed's "
             "GPUs could have read in the time the seed measured.", "",
             "| table | context | fit t0 ms | fit GB/s | setting | seed gain lowest / highest concurrency "
             "| bytes-only | fitted |", "|---|---:|---:|---:|---|---|---|---|"]
    for table in tables:
        low, high = min(table.gain), max(table.gain)
        for context in contexts:
            a = analyse(table, context)
            above = " (above copy)" if a.fit.bandwidth > copy_bw else ""
            for setup in table.variants:
                lines.append(
                    f"| {table.preset} | {context} | {1e3 * a.fit.t0:.1f} | {a.fit.bandwidth / 1e9:,.0f}{above} "
                    f"| {setup.label}, KV {setup.kv_dtype} | {pct(table.gain[low])} / {pct(table.gain[high])} "
                    f"| {pct(a.bytes_only_gain(setup, low))} / {pct(a.bytes_only_gain(setup, high))} "
                    f"| {pct(a.fitted_gain(setup, low))} / {pct(a.fitted_gain(setup, high))} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=DEFAULT_CONTEXT, help="tokens in each request's cache")
    parser.add_argument("--glm-kv-dtype", default="fp8_e4m3", help="GLM 5.2's KV format (the seed does not say)")
    parser.add_argument("--out")
    cli = parser.parse_args()
    start = time.perf_counter()
    copy_bw = copy_bandwidth()
    tables = [glm_int4_table(cli.glm_kv_dtype), kimi_kv_table()]
    lines = ["# Decode bytes per step against the seed's throughput tables", "",
             __doc__.split("\n\n")[2].replace("\n", " "), "",
             "What a step reads, and what is left out: the docstring of `experiments/decode_bytes.py`. "
             f"Bandwidth: the H200's device-to-device copy, {copy_bw / 1e9:,.0f} GB/s "
             f"(`{os.path.relpath(COPY_BENCHMARK, RESULTS)}`).", ""]
    for table in tables:
        lines += table_markdown(analyse(table, cli.context), copy_bw) + [""]
    lines += sensitivity(tables, (2048, cli.context, 32768), copy_bw)
    lines += [""] + speculative_table(copy_bw)
    lines += ["", f"Generated {datetime.date.today()} by `python experiments/decode_bytes.py --out` "
                  f"in {time.perf_counter() - start:.0f} s on CPU."]
    publish(lines, cli.out)


if __name__ == "__main__":
    main()
