"""Greedy-token agreement of FP8 KV (e4m3, e5m2) against full-precision KV, tiny random models.

    python experiments/fp8_kv_agreement.py [--out experiments/results/fp8_kv_agreement.md]

Random models have nearly flat logits (small top-1 margins), so one flipped token changes the
rest of a sequence: read "first token" and "all positions" together, and compare rows rather than
expecting a trained model's agreement.
"""

from __future__ import annotations

import argparse
import datetime

import numpy as np

from experiments.report import publish
import mixserve
from mixserve.engine import Engine


def agreement(model, kv_dtype: str, prompts, new: int) -> tuple[float, float, float]:
    """(first-token agreement, position-wise agreement, mean length of the common prefix)."""
    run = lambda d: Engine(model, kv_dtype=d, num_pages=256, page_size=16, max_batch=len(prompts),
                           stop_tokens=()).generate(prompts, max_new_tokens=new)
    return token_agreement(run("auto"), run(kv_dtype), new)


def token_agreement(ref, test, new: int) -> tuple[float, float, float]:
    """(first token agrees, all positions agree, mean common prefix) of two lists of Results."""
    first = np.mean([a.tokens[0] == b.tokens[0] for a, b in zip(ref, test)])
    pos = np.mean([x == y for a, b in zip(ref, test) for x, y in zip(a.tokens, b.tokens)])
    prefix = np.mean([next((i for i, (x, y) in enumerate(zip(a.tokens, b.tokens)) if x != y), new) for a, b in zip(ref, test)])
    return float(first), float(pos), float(prefix)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=16)
    args = p.parse_args(argv)
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(0, 256, rng.integers(8, 64))] for _ in range(args.prompts)]
    lines = [f"# FP8 KV vs full-precision KV, greedy decoding ({datetime.date.today()})", "",
             f"{args.prompts} prompts of 8-63 tokens, {args.new_tokens} new tokens, float32 weights, per-tensor scale 1.0. "
             "The first token comes from prefill, which attends over the fresh full-precision keys (these prompts fit "
             "one chunk), so it agrees by construction, as in the seed's BF16-prefill / FP8-decode split; every later "
             "token reads FP8 pages. Random models have flat logits: one flip changes the rest of a sequence. GLM-5's "
             "lower agreement may partly come from the DSA indexer's top-k choice on FP8 index keys (not separated here).", "",
             "| model | KV | first token agrees | all positions agree | mean common prefix (tokens) |", "|---|---|---|---|---|"]
    for name in ("tiny-kimi", "tiny-glm4", "tiny-glm5"):
        model = mixserve.load(name, dtype="float32")
        for kv in ("fp8_e4m3", "fp8_e5m2"):
            first, pos, prefix = agreement(model, kv, prompts, args.new_tokens)
            lines.append(f"| {name} | {kv} | {first:.2f} | {pos:.2f} | {prefix:.1f} / {args.new_tokens} |")
    publish(lines, args.out)


if __name__ == "__main__":
    main()
