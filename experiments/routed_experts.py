"""What returning the routed experts costs (Engine(return_routed_experts=True), for routing replay).

    python experiments/routed_experts.py [--out experiments/results/routed_experts.md] [--repeats 21]

Two tables:
  bytes     per token, for the full presets: the routing rows (int16, a K-expert row per MoE layer)
            against the KV cache's bytes (BF16 and FP8), and per decode step of 64 requests the rows
            read back from the device. The rows are the prefix cache's host-side companion too:
            a cached page keeps its tokens' rows in host memory.
  time      one engine serving the same closed batch with the flag off and on, in interleaved rounds
            (a tiny model on this CPU, so the per-step host work of reading and keeping the rows is
            as large a share of a step as it can be): decode steps' median time and the paired ratio.
"""

from __future__ import annotations

import argparse
import datetime
import statistics

import numpy as np

from experiments.report import interleaved, publish
import mixserve
from mixserve.engine import Engine
from mixserve.kv_cache import bytes_per_token, kv_format
from models.presets import FULL_PRESETS

STEP_ROWS = 64  # requests in the decode step the bytes table reads rows back for


def routes_bytes(cfg) -> int:
    """Bytes of one position's routing: a row of top-k int16 expert ids per MoE layer."""
    return 2 * cfg.num_experts_per_tok * sum(cfg.is_moe_layer(i) for i in range(cfg.num_layers))


def bytes_table() -> list[str]:
    rows = ["| model | MoE layers x top-k | routing bytes / token | BF16 KV bytes / token | share | FP8 KV "
            f"bytes / token | share | read back per decode step of {STEP_ROWS} (KiB) |",
            "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name in ("kimi-k2", "glm-4.5", "glm-4.5-air", "glm-5"):  # K2.6, GLM-4.6 and 4.7 differ in context only
        cfg = FULL_PRESETS[name]
        layers = sum(cfg.is_moe_layer(i) for i in range(cfg.num_layers))
        routing = routes_bytes(cfg)
        bf16, fp8 = (bytes_per_token(cfg, kv_format(dtype, "bfloat16")) for dtype in ("bfloat16", "fp8_e4m3"))
        rows.append(f"| {name} | {layers} x {cfg.num_experts_per_tok} | {routing} | {bf16:,} | "
                    f"{100 * routing / bf16:.2f}% | {fp8:,} | {100 * routing / fp8:.2f}% | "
                    f"{STEP_ROWS * routing / 1024:.1f} |")
    return rows


def time_table(model_name: str, batch: int, prompt_len: int, new_tokens: int, repeats: int) -> list[str]:
    model = mixserve.load(model_name, dtype="bfloat16")
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(0, 256, prompt_len)] for _ in range(batch)]
    args = dict(num_pages=batch * -(-(prompt_len + new_tokens) // 16), page_size=16, max_batch=batch,
                stop_tokens=(), min_decode_rows=batch)
    engines = {flag: Engine(model, return_routed_experts=flag, **args) for flag in (False, True)}
    for e in engines.values():  # warm: every shape compiled
        e.generate(prompts, max_new_tokens=new_tokens)

    def serve(engine: Engine, r: int) -> dict:
        engine.reset_prefix_cache()  # each round prefills its prompts anew
        before = len(engine.counters.decode_step_s)
        results = engine.generate(prompts, max_new_tokens=new_tokens, temperature=1.0, seed=r)
        assert all(res.status == "ok" for res in results)
        rows = sum(0 if res.routed_experts is None else len(res.routed_experts) for res in results)
        return {"step": statistics.median(engine.counters.decode_step_s[before:]), "rows": rows}

    runs = interleaved(engines, repeats, serve)
    off, on = runs[False], runs[True]
    ratios = [b["step"] / a["step"] for a, b in zip(off, on)]
    return [f"{model_name} (BF16, {routes_bytes(model.config)} routing bytes per position), {batch} requests of "
            f"{prompt_len} prompt and {new_tokens} sampled tokens per round, {repeats} rounds after a warm-up, "
            "the flag's two engines interleaved.", "",
            "| return_routed_experts | decode step, median of the rounds' medians (ms) | rows returned per round |",
            "|---|---:|---:|",
            f"| off | {1e3 * statistics.median(r['step'] for r in off):.2f} | {off[0]['rows']} |",
            f"| on | {1e3 * statistics.median(r['step'] for r in on):.2f} | {on[0]['rows']} |", "",
            f"On / off decode step time, median of the paired rounds' ratios: {statistics.median(ratios):.3f} "
            f"(the rounds' ratios from {min(ratios):.3f} to {max(ratios):.3f})."]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out")
    p.add_argument("--model", default="tiny-kimi")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=21)
    args = p.parse_args(argv)
    publish([f"# Routed experts return: its bytes and its time ({datetime.date.today()}, CPU)", "",
             "## Bytes (computed from the configs)", "", *bytes_table(), "",
             "## Time (measured)", "",
             *time_table(args.model, args.batch, args.prompt_len, args.new_tokens, args.repeats), "",
             "CPU times on a shared 2-core machine: compare within the table; absolute times are not GPU times."],
            args.out)


if __name__ == "__main__":
    main()
