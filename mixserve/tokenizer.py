"""Text <-> token ids for a checkpoint directory: `tokenizer.json` (GLM, via the `tokenizers`
library) or Kimi's `tiktoken.model` (via `tiktoken`, with specials from tokenizer_config.json)."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
from collections.abc import Collection
from typing import Protocol

# What a checkpoint keeps of its tokenizer and chat template (mixserve/chat.py): a converted copy
# (mixserve.quantize, orbax_io.save_params) takes them along.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tiktoken.model", "special_tokens_map.json",
                   "chat_template.jinja", "additional_chat_templates")


def copy_tokenizer_files(src: str | None, dst: str, names: tuple[str, ...] = TOKENIZER_FILES) -> None:
    """Copy src's files of names (a folder whole) into dst, first removing dst's own: an earlier
    copy's must not outlive it (load_tokenizer would read them). src None (a preset): only remove."""
    for name in names:
        target = os.path.join(dst, name)
        if os.path.isdir(target):
            shutil.rmtree(target)
        elif os.path.exists(target):
            os.remove(target)
        source = None if src is None else os.path.join(src, name)
        if source is None:
            continue
        if os.path.isdir(source):
            shutil.copytree(source, target)
        elif os.path.exists(source):
            shutil.copy(source, target)


class Tokenizer(Protocol):
    # The ids that vLLM's skip_special_tokens leaves out of a text: the tokenizer's own notion of
    # special (each format's below), not every added token. A tokenizer without it has none.
    special_ids: frozenset[int]

    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: list[int]) -> str: ...
    # One token's own bytes (OpenAI's logprobs "bytes"): a token may hold part of a character,
    # which its decoded text shows as U+FFFD; the bytes of consecutive tokens join into the text.
    def token_bytes(self, token: int) -> bytes: ...


def _byte_level_alphabet() -> dict[str, int]:
    """A byte-level BPE vocabulary's characters (GPT-2's, tokenizers' ByteLevel) -> the byte each
    stands for: printable Latin-1 characters stand for their own byte, the other bytes for the
    characters from U+0100 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {chr(b): b for b in printable} | {chr(256 + i): b for i, b in enumerate(others)}


BYTE_LEVEL_ALPHABET = _byte_level_alphabet()


class HFTokenizer:
    def __init__(self, path: str):
        import tokenizers

        self._tok = tokenizers.Tokenizer.from_file(path)
        spec = json.loads(self._tok.to_str())
        decoders = [spec.get("decoder") or {}]
        decoders += decoders[0].get("decoders") or []  # a Sequence's
        self._decoders = {d.get("type") for d in decoders}
        self._added = {t["id"] for t in spec.get("added_tokens") or []}
        # what tokenizers' decode(skip_special_tokens=True) skips: added tokens marked special
        self.special_ids = frozenset(t["id"] for t in spec.get("added_tokens") or [] if t.get("special"))

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False)

    def token_bytes(self, token: int) -> bytes:
        """A byte-level vocabulary's token: its characters' bytes; SentencePiece's: a byte-fallback
        token (<0xE4>) its byte, another its text with "▁" as the space it stands for; an added
        token, or another vocabulary's: its text's UTF-8 (an id past the vocabulary: none)."""
        piece = self._tok.id_to_token(token)
        if piece is None:
            return b""
        if token in self._added:
            return piece.encode()
        if "ByteLevel" in self._decoders and all(c in BYTE_LEVEL_ALPHABET for c in piece):
            return bytes(BYTE_LEVEL_ALPHABET[c] for c in piece)
        if "ByteFallback" in self._decoders and (byte := re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", piece)):
            return bytes([int(byte[1], 16)])
        if self._decoders & {"Metaspace", "Replace"}:  # SentencePiece's space, as its decoders write it
            return piece.replace("\u2581", " ").encode()
        return self.decode([token]).encode()

    def to_json(self) -> str:
        return self._tok.to_str()


# Kimi's pre-tokenizer split: CJK runs, words with optional contractions, digit groups of 1-3,
# punctuation runs, whitespace (as in Moonshot's tokenization_kimi.py).
KIMI_PATTERN = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])


RESERVED_SPECIALS = 256  # Kimi's tiktoken specials (tokenization_kimi.py's num_reserved_special_tokens)


def named_special_tokens(config: dict) -> set[str]:
    """The special tokens' texts a tokenizer_config.json (or special_tokens_map.json) names, as
    transformers 5 reads a Python tokenizer's all_special_ids from it: each `*_token` key's token
    (bos_token, eos_token, ..., and model-specific ones) and the extra_special_tokens (or the older
    additional_special_tokens), a list or a dict; each a string or an AddedToken's {"content": ...}.
    Not every added token: Kimi's tool-call markers are added tokens, but not among them."""
    text = lambda token: token.get("content") if isinstance(token, dict) else token
    named = {text(value) for key, value in config.items() if key.endswith("_token")}
    extra = config.get("extra_special_tokens") or config.get("additional_special_tokens") or []
    named |= {text(token) for token in (extra.values() if isinstance(extra, dict) else extra)}
    return {t for t in named if isinstance(t, str)}


class TiktokenTokenizer:
    def __init__(self, model_path: str, config_path: str | None):
        import tiktoken
        from tiktoken.load import load_tiktoken_bpe

        ranks = load_tiktoken_bpe(model_path)
        named: dict[int, str] = {}
        special_texts: set[str] = set()
        if config_path and os.path.exists(config_path):
            with open(config_path) as f:
                config = json.load(f)
            named = {int(i): entry["content"] for i, entry in config.get("added_tokens_decoder", {}).items()}
            special_texts = named_special_tokens(config)
        map_path = os.path.join(os.path.dirname(model_path), "special_tokens_map.json")
        if not named and os.path.exists(map_path):  # transformers 5 reads it only for a config without added tokens
            with open(map_path) as f:
                special_texts |= named_special_tokens(json.load(f))
        # Moonshot's rule: the RESERVED_SPECIALS ids after the ranks are all special, named by the
        # config where it names them, else <|reserved_token_i|>, so every id the model samples decodes.
        reserved = {i: f"<|reserved_token_{i}|>" for i in range(len(ranks), len(ranks) + RESERVED_SPECIALS)}
        specials = {name: i for i, name in (reserved | named).items()}
        self._ranks, self._added_ids = len(ranks), frozenset(specials.values())
        self.special_ids = frozenset(specials[t] for t in special_texts if t in specials)
        self.encoding = tiktoken.Encoding(
            name=os.path.basename(os.path.dirname(model_path)) or "kimi",
            pat_str=KIMI_PATTERN, mergeable_ranks=ranks, special_tokens=specials,
        )

    def encode(self, text: str) -> list[int]:
        return self.encoding.encode(text, allowed_special="all")

    def decode(self, ids: list[int]) -> str:
        # An id past the tokenizer (a model vocab padded beyond it) is dropped, as `tokenizers` does.
        return self.encoding.decode([i for i in ids if 0 <= i < self._ranks or i in self._added_ids])

    def token_bytes(self, token: int) -> bytes:
        known = 0 <= token < self._ranks or token in self._added_ids
        return self.encoding.decode_single_token_bytes(token) if known else b""


class ByteTokenizer:
    """UTF-8 bytes as ids 0-255: the tiny presets' vocabulary starts with the 256 bytes (what
    `mixserve.run` serves them with; ids past 255 decode to nothing)."""

    special_ids = frozenset()

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(t for t in ids if 0 <= t < 256).decode("utf-8", errors="replace")

    def token_bytes(self, token: int) -> bytes:
        return bytes([token]) if 0 <= token < 256 else b""


def special_ids_of(tokenizer) -> frozenset[int]:
    """tokenizer.special_ids; none for a tokenizer of the caller's own that does not say."""
    return getattr(tokenizer, "special_ids", frozenset())


@dataclasses.dataclass(frozen=True)
class LeavingOut:
    """`tokenizer`'s decoding, leaving out the ids `left_out` (vLLM's skip_special_tokens): they decode
    to nothing, as tokenizers' own skipping does (it drops them before its decoders run). Only a
    request's text is decoded so; its tokens' own names and bytes (logprobs) stay the tokenizer's."""
    tokenizer: Tokenizer
    left_out: frozenset[int]

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode([t for t in ids if t not in self.left_out])


def text_tokenizer(tokenizer: Tokenizer, skip_special_tokens: bool,
                   kept: Collection[int] = ()) -> Tokenizer | LeavingOut:
    """What a request's text is decoded with: skip_special_tokens (vLLM's, true by default) leaves
    the tokenizer's special tokens out of it, but those in kept (a chat reply's markup, which its
    parser reads)."""
    left_out = special_ids_of(tokenizer) - frozenset(kept) if skip_special_tokens else frozenset()
    return LeavingOut(tokenizer, left_out) if left_out else tokenizer


class IncrementalDecoder:
    """A growing token list's text, extended a token at a time without decoding the whole list each
    time (which would cost a long output quadratic time): each call decodes only the tokens since
    the read before last, as context, with and without the new ones, and keeps the difference
    (vLLM's prefix and read offsets).

    Text that ends inside a UTF-8 character (a token holding the first bytes of one) is held back
    until the character completes; `visible` adds the complete characters in front of it, so
    `visible` is tokenizer.decode(ids) less its trailing replacement characters
    (tests/test_tokenizer.py). A character is at most 4 bytes, and a token holds at least one
    unless it decodes to nothing (an id past the tokenizer's vocabulary): one still unfinished
    after MAX_HELD held tokens is taken to have started in the last MAX_HELD - 1, and everything
    before them is committed, as decode shows it. So no run of tokens (invalid bytes, ids that
    decode to nothing) makes a call decode more than about MAX_HELD of them.

    A decoder whose later tokens rewrite earlier text breaks the invariant: with a ByteFallback
    decoder (Llama-style tokenizer.json) a byte token "/" followed by a stray continuation byte
    becomes a replacement character in decode(ids) but stays "/" in `text`. A stop string is
    still found at the token that completes it, where decode(ids) shows it too."""

    MAX_HELD = 16  # tokens; a character spans at most 4 that hold bytes

    def __init__(self, tokenizer: Tokenizer | LeavingOut):
        # A LeavingOut's ids are dropped here, before a window is chosen: a context of
        # left-out ids alone would decode to nothing, and a SentencePiece decoder (Metaspace) would
        # then strip the next word's space as the text's first.
        self._left_out = tokenizer.left_out if isinstance(tokenizer, LeavingOut) else frozenset()
        self.tokenizer = tokenizer.tokenizer if isinstance(tokenizer, LeavingOut) else tokenizer
        self._ids: list[int] = []  # the ids added so far, less those left out
        self._seen = 0  # ids added so far
        self._pieces: list[str] = []  # the committed text, as added (joined only on request)
        self._committed = 0  # its length
        self.held = ""  # complete characters after the committed text, in front of an unfinished one
        self._prefix = 0  # context starts here
        self._read = 0  # tokens committed

    @property
    def text(self) -> str:
        return "".join(self._pieces)

    @property
    def visible(self) -> str:
        return self.text + self.held

    def __len__(self) -> int:
        """Characters of `visible`."""
        return self._committed + len(self.held)

    def tail(self, n: int) -> str:
        """The last n characters of `visible`, without joining the rest (a long output's text is
        not copied per token)."""
        parts, size = [self.held], len(self.held)
        for piece in reversed(self._pieces):
            if size >= n:
                break
            parts.append(piece)
            size += len(piece)
        return "".join(reversed(parts))[-n:] if n > 0 else ""

    def add(self, ids: list[int]) -> None:
        """Extend by the tokens of ids (every token so far: those of the last call and more)."""
        known = len(self._ids)
        self._ids += [t for t in ids[self._seen:] if t not in self._left_out]
        self._seen, ids = len(ids), self._ids
        if len(ids) == known:  # only left-out ids: the text is as it was (and so is the context)
            return
        before = self.tokenizer.decode(ids[self._prefix:self._read])
        new = self.tokenizer.decode(ids[self._prefix:])[len(before):]
        if not new.endswith("\ufffd"):
            self._commit(new, len(ids))
            return
        if len(ids) - self._read >= self.MAX_HELD:
            keep = len(ids) - (self.MAX_HELD - 1)
            self._commit(self.tokenizer.decode(ids[self._prefix:keep])[len(before):], keep)
            before = self.tokenizer.decode(ids[self._prefix:self._read])
            new = self.tokenizer.decode(ids[self._prefix:])[len(before):]
        self.held = new.rstrip("\ufffd")

    def _commit(self, new: str, read: int) -> None:
        if new:
            self._pieces.append(new)
            self._committed += len(new)
        self.held = ""
        self._prefix, self._read = self._read, read


def load_tokenizer(directory: str) -> Tokenizer | None:
    if os.path.exists(path := os.path.join(directory, "tokenizer.json")):
        return HFTokenizer(path)
    if os.path.exists(path := os.path.join(directory, "tiktoken.model")):
        return TiktokenTokenizer(path, os.path.join(directory, "tokenizer_config.json"))
    return None
