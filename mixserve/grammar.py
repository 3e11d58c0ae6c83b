"""Structured outputs: a request's output held to a JSON schema, a regular expression, a choice of
strings or a Lark grammar (vLLM's `structured_outputs`), by taking every token that cannot
continue a match out of the sampling.

llguidance (the Rust engine that vLLM and SGLang offer as their "guidance" backend) keeps one
matcher per request and computes, on the host, which tokens may come next as a bitmask: bit v % 32
of int32 word v // 32, W = ceil(V / 32) words a row. The step unpacks it and sets every other logit
to -inf after the logit bias and the penalties (mixserve/sampling.py), so nothing outside the
grammar can win, greedy, sampled or in speculative verification (one mask per verified position:
the matcher's state after the drafts before it). logprobs stay the model's own, as vLLM reports
them. A request's matcher takes each token as it is accepted (Request.accept). When the grammar is
complete, only the engine's stop tokens are allowed, and the request ends on one, as on any stop
token.
"""

from __future__ import annotations

import dataclasses
import re
import time

import llguidance
import llguidance.numpy
import numpy as np

from mixserve.tokenizer import ByteTokenizer, HFTokenizer, TiktokenTokenizer, Tokenizer

ALL_ALLOWED = -1  # a mask word whose 32 bits are set


def token_mask(ids, words: int) -> np.ndarray:
    """A mask of `words` int32 words (bit v % 32 of word v // 32, as llguidance writes them) that
    allows exactly the tokens ids."""
    bits = np.zeros(words * 32, bool)
    bits[np.asarray(ids, np.int64)] = True
    return np.packbits(bits.reshape(words, 32), axis=1, bitorder="little").view(np.int32).reshape(words)


@dataclasses.dataclass(frozen=True)
class StructuredOutput:
    """What a request's output must match: exactly one of a JSON schema (a dict or its text),
    any JSON object (OpenAI's response_format json_object), a regular expression (Rust's `regex`
    syntax, anchored at both ends), one of several strings, or a grammar in Lark syntax
    (llguidance's dialect). `after`: the token ids after which the grammar starts (a thinking
    model's end of reasoning, `</think>` encoded, as vLLM's reasoning parser starts it; the output
    before them and them are free); () from the first token. `opens` (with `after`): token ids
    that, as the output's first tokens, open that free part (`<think>` encoded, for a thinking
    model whose reply opens its reasoning itself); else the grammar governs from the first token.
    The first tokens may be either: the grammar's or the opener's next (a token that completes the
    opener opens, even where the grammar would take it too)."""
    json_schema: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    after: tuple[int, ...] = ()
    opens: tuple[int, ...] = ()

    def __hash__(self) -> int:  # all but a schema given as a dict (unhashable): equal outputs, equal hashes
        schema = self.json_schema if isinstance(self.json_schema, (str, bool, type(None))) else dict
        choice = tuple(self.choice) if isinstance(self.choice, list) else self.choice
        try:
            return hash((schema, self.json_object, self.regex, choice, self.grammar, self.after, self.opens))
        except TypeError:  # fields of the wrong types (reason() says which): one hash for all of them
            return hash(StructuredOutput)

    def reason(self) -> str | None:
        """Why this is no structured output (None: it is one); a grammar's own errors come from
        Grammars.matcher."""
        given = [name for name in ("json_schema", "regex", "choice", "grammar") if getattr(self, name) is not None]
        given += ["json_object"] * (self.json_object is True)
        if len(given) != 1:
            return f"a structured output takes exactly one of json, json_object, regex, choice, grammar; got {given}"
        if self.json_object not in (True, False):
            return f"json_object must be true or false, got {self.json_object!r}"
        if self.json_schema is not None and not isinstance(self.json_schema, (dict, str, bool)):
            return f"json must be a JSON schema (an object or its text), got {self.json_schema!r}"
        for name in ("regex", "grammar"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                return f"{name} must be a string, got {getattr(self, name)!r}"
        if self.choice is not None and not (isinstance(self.choice, (list, tuple)) and self.choice
                                            and all(isinstance(c, str) for c in self.choice)):
            return f"choice must be a non-empty list of strings, got {self.choice!r}"
        for name in ("after", "opens"):
            if not (isinstance(getattr(self, name), tuple) and all(isinstance(t, int) for t in getattr(self, name))):
                return f"{name} must be a tuple of token ids, got {getattr(self, name)!r}"
        if self.opens and not self.after:
            return "opens starts a free part that only `after` ends: give both"
        return None

    def llguidance_grammar(self) -> str:
        """The grammar as llguidance takes it. Raises ValueError on a schema that is not JSON."""
        if self.json_object:
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"})
        if self.json_schema is not None:
            return llguidance.LLMatcher.grammar_from_json_schema(self.json_schema)
        if self.regex is not None:
            return llguidance.LLMatcher.grammar_from_regex(self.regex)
        if self.choice is not None:  # each string literally: Python's escapes are valid in Rust's syntax
            return llguidance.LLMatcher.grammar_from_regex("|".join(re.escape(c) for c in self.choice))
        return llguidance.LLMatcher.grammar_from_lark(self.grammar)


class Grammars:
    """One engine's grammar side: its tokenizer as llguidance reads it (at the first structured
    request, or at prepare(): 0.85 s for a 160k vocabulary) and the thread pool that computes a
    step's masks. `end_tokens`: what the request ends on once its grammar is complete (the
    engine's stop tokens)."""

    def __init__(self, tokenizer: Tokenizer | None, vocab_size: int, end_tokens: tuple[int, ...]):
        self.tokenizer, self.vocab_size, self.end_tokens = tokenizer, vocab_size, end_tokens
        self.words = -(-vocab_size // 32)  # W
        self._lltokenizer = None
        self._reads_from: Grammars | None = None  # share_tokenizer: whose tokenizer this one uses
        self._executor = None
        self.mask_s = 0.0  # host seconds in allowed() computing masks (inside the steps' decode_s and prefill_s)

    def matcher(self, structured: StructuredOutput, ignore_eos: bool = False):
        """A new matcher for `structured`, or the reason there is none (a str): bad input, a
        grammar that does not compile, or an engine that could not end the output."""
        if why := structured.reason():
            return why
        if ignore_eos:
            return "ignore_eos would generate past the end of the structured output: it ends on a stop token"
        if not self.end_tokens:
            return "structured outputs end on the engine's stop tokens, and this engine has none"
        lltokenizer = self.lltokenizer()
        if isinstance(lltokenizer, str):
            return lltokenizer
        try:
            grammar = structured.llguidance_grammar()
        except (ValueError, TypeError) as e:
            return f"structured output: {e}"
        matcher = llguidance.LLMatcher(lltokenizer, grammar, log_level=0)
        if matcher.is_error():
            return f"structured output: {matcher.get_error()}"
        return matcher

    def prepare(self) -> str | None:
        """Read the tokenizer now (a server, at start: else the first structured request waits
        for it, and every running request's next step with it); why there is none, if not."""
        tokenizer = self.lltokenizer()
        return tokenizer if isinstance(tokenizer, str) else None

    def share_tokenizer(self, other: Grammars) -> None:
        """Use other's tokenizer (a prefill/decode pair of one model: read once, held once)."""
        self._reads_from = other

    def lltokenizer(self):
        """llguidance's tokenizer, read at the first call, or why there is none (a str)."""
        if self._reads_from is not None:
            return self._reads_from.lltokenizer()
        if self._lltokenizer is None:
            self._lltokenizer = _lltokenizer(self.tokenizer, self.vocab_size, list(self.end_tokens))
        return self._lltokenizer

    def allowed(self, rows: list[tuple[object, int, int, list[int]]], batch: int, positions: int = 1,
                openers: list[tuple[object | None, int, int]] = ()) -> np.ndarray:
        """A step's masks, [batch, positions * W] int32: rows holds (matcher, row, first, drafts)
        per request its grammar governs from verified position `first` on (0 but where the drafts
        before it end the free part, StructuredOutput.after); its row's position first + j gets the
        tokens allowed after drafts[:j] (every token past a draft the grammar refuses: verification
        never reaches there). openers holds (matcher or None, row, token) per request whose output
        may still open its free part (StructuredOutput.opens, verified without drafts): its row's
        position 0 gets the matcher's tokens (none: the output can no longer be the grammar's) and
        the opener's next token. Other positions and rows allow every token. The matchers end
        where they began."""
        allowed = np.full((batch * positions, self.words), ALL_ALLOWED, np.int32)
        if rows or openers:
            t0 = time.perf_counter()
            if self._executor is None:
                self._executor = llguidance.LLExecutor()
            numpy_api = llguidance.numpy
            plain = [(m, row * positions + first) for m, row, first, drafts in rows if not drafts]
            if plain := plain + [(m, row * positions) for m, row, _ in openers if m is not None]:
                numpy_api.fill_next_token_bitmask_par(self._executor, plain, allowed)
            if drafted := [(m, row * positions + first, list(drafts)) for m, row, first, drafts in rows if drafts]:
                numpy_api.fill_next_token_bitmask_par_with_draft_tokens(self._executor, drafted, allowed)
            bits = allowed.view(np.uint32)  # bit 31 of an int32 word: shifts in uint32
            for m, row, token in openers:
                if m is None:
                    bits[row * positions] = 0
                bits[row * positions, token // 32] |= np.uint32(1 << (token % 32))
            self.mask_s += time.perf_counter() - t0
        return allowed.reshape(batch, positions * self.words)


def _lltokenizer(tokenizer: Tokenizer | None, vocab_size: int, end_tokens: list[int]):
    """llguidance's view of the tokenizer (its bytes per token), or why there is none (a str: no
    tokenizer, or one llguidance cannot read, such as a Metaspace decoder or more tokens than the
    model's vocabulary)."""
    try:
        if isinstance(tokenizer, HFTokenizer):
            return llguidance.LLTokenizer(tokenizer.to_json(), n_vocab=vocab_size, eos_token=end_tokens)
        if isinstance(tokenizer, TiktokenTokenizer):
            enc = tokenizer.encoding
            return llguidance.LLTokenizer.from_tiktoken(encoder=enc._mergeable_ranks, special_tokens=enc._special_tokens,
                                                        pattern=enc._pat_str, eos_token=end_tokens, n_vocab=vocab_size)
        if isinstance(tokenizer, ByteTokenizer):
            return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_ByteTokens(vocab_size, end_tokens)),
                                          n_vocab=vocab_size, eos_token=end_tokens)
    except (ValueError, RuntimeError) as e:
        return f"structured outputs: llguidance cannot read this model's tokenizer: {e}"
    return "structured outputs need the model's tokenizer, and this model has none"


class _ByteTokens:
    """ByteTokenizer as llguidance.TokenizerWrapper reads a tokenizer: each id's bytes (ids past
    255 hold none), and an encoder."""

    def __init__(self, vocab_size: int, end_tokens: list[int]):
        self.tokens = [bytes([i]) if i < 256 else b"" for i in range(vocab_size)]
        self.eos_token_id, self.bos_token_id = end_tokens[0], None
        self.special_token_ids = list(range(256, vocab_size))

    def __call__(self, text):
        return list(text if isinstance(text, bytes) else text.encode("utf-8"))

