"""What structured outputs cost a decode step on this machine: the host's masks (llguidance, via
mixserve.grammar.Grammars) and the mask in the jitted step (CPU, XLA path). Not a timed test: run
it by hand.

    python experiments/structured_outputs.py [--out experiments/results/structured_outputs.md] [--repeats 20]

1. One-time costs, per tokenizer: the first Grammars.matcher call of a fresh Grammars (llguidance
   reads the tokenizer, then compiles the grammar) and a later one (the compile alone), for a small
   JSON schema; medians over `repeats` fresh Grammars.
2. A step's masks on the host: Grammars.allowed(rows, batch, positions) for batch 1, 8 and 32, each
   row a fresh matcher, and batch 8 with positions 4 (speculative decoding: 3 drafts a row, `cde` a
   character each, a mask per verified position). The matchers are held to the JSON schema, having
   consumed `{"name":"ab` (inside a string: nearly every token allowed), or to the regex
   `[a-z ]{40}` (section 3's), having consumed `ab`. Wall clock (time.perf_counter) around the
   call, the int32 mask's allocation included, after one call that starts llguidance's thread
   pool; medians over `repeats` sets of fresh matchers, of their first call and of a second call
   on the same matchers. The first is what a step pays in a lexer state new to the matcher:
   llguidance walks the token trie (its lexer building the transitions it needs), except the
   tokens of a slice it can add whole (its JSON-string slices, inside a JSON string). The second,
   the same state again, is answered without the walk, as is every step in a lexer state the
   matcher has been in (inside a JSON string, or `[a-z ]+`: its state repeats); a counted regex
   like `[a-z ]{40}` is in a new lexer state every token. With drafts, a call walks every position
   again, the second too (llguidance consumes the drafts and rolls them back).
   Tokenizers: the tiny presets' ByteTokenizer (vocabulary 320, end token 257), and a byte-level
   BPE of --vocab tokens (default 160,000, about Kimi's and GLM's) trained by `tokenizers` on
   generated JSON lines of random words and numbers, wrapped in HFTokenizer (mostly lowercase
   words: the regex allows most of it, where a real vocabulary's code, digits and other scripts
   would narrow the mask and shorten the walk). The table gives how many tokens the first row's
   first mask allows.
3. The mask in the decode step: one tiny-glm4 engine (float32, ByteTokenizer, 8 slots, page 8)
   generates --new-tokens tokens for 8 random 16-byte prompts, held to the regex `[a-z ]{n}`
   (n = new tokens + 8: no output completes it, so each runs to the limit) or plain with
   ignore_eos (the same length), runs
   interleaved and alternating who goes first after a warm-up of each; decode seconds per decoded
   token from Engine.counters (decode_s, decode_tokens), the paired median ratio. decode_s times
   the runner's decode call: building the step's inputs (so the host masks, Grammars.allowed),
   moving them to the device, the step (the mask unpacked to [B, V] bits and applied) and reading
   the tokens back; the matchers consuming the new tokens (Request.accept) come after it and are
   not in it. Greedy, the structured step also takes the adjusted branch (the logit bias and
   penalty scatters, the mask, the argmax; no draw), which the plain greedy step skips; at
   temperature 1 both sides sample, so the ratio is the mask's alone. Both sides build the step's
   sampling inputs, masks included, while the forward runs (ModelRunner.overlap_inputs).
4. That overlap: the plain and the structured workload at temperature 1 on two engines, one building the
   sampling inputs (masks included) while the forward runs (the default), one before dispatching
   it (overlap_inputs = False), runs interleaved as in 3; decode seconds per decoded token and the
   host mask seconds of a run (Grammars.mask_s), the paired median ratio.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import itertools
import json
import os
import statistics
import tempfile
import time

import jax
import numpy as np
import tokenizers

from experiments.report import publish
from experiments.serving import workload
import mixserve
from mixserve.engine import Engine
from mixserve.grammar import Grammars, StructuredOutput
from mixserve.tokenizer import ByteTokenizer, HFTokenizer
from models.presets import get_preset

SCHEMA = StructuredOutput(json_schema={"type": "object", "properties": {"name": {"type": "string"},
                                       "age": {"type": "integer"}}, "required": ["name", "age"]})
# What section 2's matchers are held to, and what they have consumed.
HELD = {"JSON schema": (SCHEMA, '{"name":"ab'), "regex [a-z ]{40}": (StructuredOutput(regex="[a-z ]{40}"), "ab")}
DRAFTS = "cde"

def synthetic_bpe(vocab_size: int, directory: str, seed: int = 0) -> tuple[HFTokenizer, int]:
    """A byte-level BPE of vocab_size tokens (GPT-2's pre-tokenizer, its 256 byte symbols, one
    special token) trained on JSON lines of random lowercase words and numbers; and its end token."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(2, 12, vocab_size)
    letters = rng.integers(ord("a"), ord("z") + 1, lengths.sum()).astype(np.uint8).tobytes().decode()
    words = [letters[i - n:i] for n, i in zip(lengths, np.cumsum(lengths))]
    lines = (json.dumps({words[i]: " ".join(words[i + 1:i + 8]), words[i + 8]: int(rng.integers(10**6))})
             for i in range(0, len(words) - 8, 9))
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    tok.train_from_iterator(lines, tokenizers.trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<|endoftext|>"], show_progress=False,
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet()))
    path = os.path.join(directory, "tokenizer.json")
    tok.save(path)
    return HFTokenizer(path), tok.token_to_id("<|endoftext|>")


def timed(f):
    t0 = time.perf_counter()
    out = f()
    return time.perf_counter() - t0, out


def setup_costs(tokenizer, vocab_size: int, end: int, repeats: int) -> tuple[float, float]:
    """Median seconds of a fresh Grammars' first matcher call (tokenizer + compile) and its second
    (compile)."""
    first, later = [], []
    for _ in range(repeats):
        g = Grammars(tokenizer, vocab_size, (end,))
        first.append(timed(lambda: g.matcher(SCHEMA))[0])
        later.append(timed(lambda: g.matcher(SCHEMA))[0])
    return statistics.median(first), statistics.median(later)


def at_prefix(grammars: Grammars, tokenizer, structured: StructuredOutput, prefix: str):
    """A fresh matcher of `structured` that has consumed `prefix`."""
    m = grammars.matcher(structured)
    assert m.consume_tokens(tokenizer.encode(prefix)), m.get_error()
    return m


def mask_times(grammars: Grammars, tokenizer, held: tuple, batch: int, positions: int,
               repeats: int) -> tuple[float, float, int]:
    """Median seconds of Grammars.allowed over `batch` fresh matchers at_prefix(*held) (positions >
    1: the first positions - 1 characters of DRAFTS as each row's drafts): their first call, and a
    second call on the same matchers; and how many tokens the first row's first mask allows."""
    drafts = [tokenizer.encode(c)[0] for c in DRAFTS[:positions - 1]]
    first, second = [], []
    for _ in range(repeats):
        rows = [(at_prefix(grammars, tokenizer, *held), row, 0, drafts) for row in range(batch)]
        t, allowed = timed(lambda: grammars.allowed(rows, batch, positions))
        first.append(t)
        second.append(timed(lambda: grammars.allowed(rows, batch, positions))[0])
        assert allowed.shape == (batch, positions * grammars.words) and (allowed != -1).any()  # a real mask
    return statistics.median(first), statistics.median(second), int(np.unpackbits(allowed[0].view(np.uint8)[
        :4 * grammars.words]).sum())


def setup_table(tokenizers_: dict, repeats: int) -> list[str]:
    """The one-time costs' rows, by tokenizer."""
    rows = ["| tokenizer | vocabulary | first matcher call ms (tokenizer + compile) | "
            "later matcher call ms (compile) |", "|---|---:|---:|---:|"]
    for name, (tokenizer, vocab_size, end) in tokenizers_.items():
        first, later = setup_costs(tokenizer, vocab_size, end, repeats)
        rows.append(f"| {name} | {vocab_size:,} | {1e3 * first:.1f} | {1e3 * later:.2f} |")
    return rows


def mask_table(tokenizers_: dict, repeats: int) -> tuple[list[str], dict]:
    """The rows, and the median seconds (first call, second) by (tokenizer, held, batch, positions)."""
    rows = ["| tokenizer | held to | tokens allowed | batch | positions | first call us | per row-position | "
            "second call us | per row-position |", "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    times = {}
    for name, (tokenizer, vocab_size, end) in tokenizers_.items():
        grammars = Grammars(tokenizer, vocab_size, (end,))
        grammars.allowed([(at_prefix(grammars, tokenizer, *HELD["JSON schema"]), 0, 0, [])], 1)  # starts the pool
        for held, (batch, positions) in itertools.product(HELD, ((1, 1), (8, 1), (32, 1), (8, 4))):
            *t, allowed = mask_times(grammars, tokenizer, HELD[held], batch, positions, repeats)
            times[name, held, batch, positions] = t
            cells = " | ".join(f"{1e6 * x:,.0f} | {1e6 * x / (batch * positions):,.1f}" for x in t)
            rows.append(f"| {name} | {held} | {allowed:,} | {batch} | {positions} | {cells} |")
    return rows, times


def decode_seconds_per_token(engine: Engine, structured: bool, temperature: float, new_tokens: int, seed: int) -> float:
    """One run of 8 prompts: decode seconds per decoded token (Engine.counters deltas)."""
    tokens0, s0 = engine.counters.decode_tokens, engine.counters.decode_s
    options = (dict(structured_output=StructuredOutput(regex=f"[a-z ]{{{new_tokens + 8}}}")) if structured
               else dict(ignore_eos=True))
    results = engine.generate(workload(8, 16, seed), max_new_tokens=new_tokens, temperature=temperature, seed=seed,
                              **options)
    assert all(r.status == "ok" and len(r.tokens) == new_tokens for r in results), results[0]
    tokens = engine.counters.decode_tokens - tokens0
    assert tokens == 8 * (new_tokens - 1)  # each prompt's first token comes from its prefill
    return (engine.counters.decode_s - s0) / tokens


def step_runs(engine: Engine, temperature: float, new_tokens: int, repeats: int) -> dict:
    """Seconds per decoded token by side ("plain", "structured"), runs interleaved, who goes first
    alternating, after a warm-up run of each (compiles each side's step)."""
    sides = {"plain": False, "structured": True}
    for structured in sides.values():
        decode_seconds_per_token(engine, structured, temperature, new_tokens, 99)
    runs = {side: [] for side in sides}
    for r in range(repeats):
        for side in (list(sides) if r % 2 == 0 else list(sides)[::-1]):
            runs[side].append(decode_seconds_per_token(engine, sides[side], temperature, new_tokens, r))
    return runs


def overlap_runs(model, structured: bool, new_tokens: int, repeats: int) -> dict:
    """Decode (temperature 1, structured or plain) seconds per decoded token and host mask seconds
    per run, by side: the sampling inputs built while the forward runs (True, the default) or
    before it is dispatched (False: ModelRunner.overlap_inputs); two engines, runs interleaved as
    in step_runs."""
    sides = {}
    for overlap in (True, False):
        sides[overlap] = Engine(model, num_pages=8 * (-(-(16 + new_tokens) // 8) + 1), page_size=8, max_batch=8)
        sides[overlap].runner.overlap_inputs = overlap
        decode_seconds_per_token(sides[overlap], structured, 1.0, new_tokens, 99)
    runs = {overlap: ([], []) for overlap in sides}
    for r in range(repeats):
        for overlap in ((True, False) if r % 2 == 0 else (False, True)):
            mask0 = sides[overlap].grammars.mask_s
            runs[overlap][0].append(decode_seconds_per_token(sides[overlap], structured, 1.0, new_tokens, r))
            runs[overlap][1].append(sides[overlap].grammars.mask_s - mask0)
    return runs


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="write the markdown report here")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--vocab", type=int, default=160_000, help="the synthetic BPE's vocabulary")
    p.add_argument("--new-tokens", type=int, default=32)
    args = p.parse_args(argv)
    lines = [f"# Structured outputs: host masks and the step ({datetime.date.today()}, {jax.devices()[0].device_kind}, "
             f"XLA path, {os.cpu_count()} CPUs)", ""]
    with tempfile.TemporaryDirectory() as tmp:
        t_train, (bpe, bpe_end) = timed(lambda: synthetic_bpe(args.vocab, tmp))
        toks = {"ByteTokenizer": (ByteTokenizer(), get_preset("tiny-glm4").vocab_size, 257),
                "synthetic byte-level BPE": (bpe, args.vocab, bpe_end)}
        lines += [f"Method: the docstring of `experiments/structured_outputs.py`. Schema: "
                  f"`{json.dumps(SCHEMA.json_schema)}`. The synthetic BPE "
                  f"({args.vocab:,} tokens) took {t_train:.1f} s to train.", "",
                  f"## One-time costs: an engine's tokenizer, a request's matcher (median of {args.repeats} fresh "
                  "Grammars)", ""] + setup_table(toks, args.repeats)
        rows, mask_s = mask_table(toks, args.repeats)
        lines += ["", f"## Host masks per step: Grammars.allowed (medians over {args.repeats} sets of fresh "
                  "matchers)", "",
                  "First call: a lexer state new to the matcher (llguidance walks the token trie); second call: "
                  "the same state again (no walk). A decode step in a state the matcher has been in pays the "
                  "second, in a new one about the first: the counted regex is in a new state every token. With drafts "
                  "(positions 4) every call walks every position, the second too.", ""]
        lines += rows
    model = dataclasses.replace(mixserve.load("tiny-glm4", dtype="float32"), tokenizer=ByteTokenizer())
    engine = Engine(model, num_pages=8 * (-(-(16 + args.new_tokens) // 8) + 1), page_size=8, max_batch=8)
    lines += ["", f"## The mask in the decode step (tiny-glm4 float32, ByteTokenizer, 8 prompts of 16 + "
              f"{args.new_tokens} tokens, {args.repeats} interleaved runs a side)", "",
              "| sampling | decode ms/token, plain (median) | structured | structured / plain (paired median) |",
              "|---|---:|---:|---:|"]
    runs = {name: step_runs(engine, temperature, args.new_tokens, args.repeats)
            for temperature, name in ((0.0, "greedy"), (1.0, "temperature 1"))}
    for name, r in runs.items():
        ratio = statistics.median(s / p for s, p in zip(r["structured"], r["plain"]))
        lines.append(f"| {name} | {1e3 * statistics.median(r['plain']):.3f} | "
                     f"{1e3 * statistics.median(r['structured']):.3f} | {ratio:.3f}x |")
    lines += ["", f"## Sampling inputs built while the forward runs (temperature 1, {args.repeats} interleaved runs a "
              "side)", "", "| workload | decode ms/token, built before (median) | built while it runs | while / before "
              "(paired median) | host mask ms per run, before | while |", "|---|---:|---:|---:|---:|---:|"]
    for structured in (False, True):
        (while_s, while_mask), (before_s, before_mask) = overlap_runs(model, structured, args.new_tokens,
                                                                      args.repeats).values()
        ratio = statistics.median(a / b for a, b in zip(while_s, before_s))
        lines.append(f"| {'structured' if structured else 'plain'} | {1e3 * statistics.median(before_s):.3f} | "
                     f"{1e3 * statistics.median(while_s):.3f} | {ratio:.3f}x | "
                     f"{1e3 * statistics.median(before_mask):.2f} | {1e3 * statistics.median(while_mask):.2f} |")
    lines += ["", "On these 2 cores the masks take longer while the forward runs: they share the cores with it."]
    step = 8 * statistics.median(runs["greedy"]["plain"])
    first, second = mask_s["ByteTokenizer", "regex [a-z ]{40}", 8, 1]
    lines += ["", f"A plain greedy decode step of 8 rows takes {1e3 * step:.2f} ms here (8 x its ms/token); the host "
              f"masks of 8 ByteTokenizer rows take {1e6 * second:.0f} us (a state seen before) to {1e6 * first:.0f} us "
              f"(a new one): {second / step:.1%} to {first / step:.1%} of it.", "",
              "CPU times on a shared 2-core machine: ratios within one run are the result, absolute times are not."]
    publish(lines, args.out)


if __name__ == "__main__":
    main()
