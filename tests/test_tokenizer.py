"""mixserve.load(dir).tokenizer: GLM's `tokenizer.json` (tokenizers) and Kimi's `tiktoken.model`
(tiktoken, specials from tokenizer_config.json), built tiny here next to a tiny saved model."""

import base64
import json
import shutil

import numpy as np
import pytest
import tokenizers
from tokenizers import decoders, models, normalizers, pre_tokenizers, trainers

import hf_reference as ref
import mixserve
from mixserve.request import Request, Result
from mixserve.run import output_text
from mixserve.replies import GLM45, KIMI_K2, ReplyFormat, ReplyParser
from mixserve.tokenizer import ByteTokenizer, HFTokenizer, IncrementalDecoder, TiktokenTokenizer, text_tokenizer

TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "Mixture-of-experts models route each token to 8 of 384 experts.",
    "  leading spaces, tabs\tand\nnew lines\r\n",
    "你好，世界！混合专家模型。",
    "naïve café — emoji 🙂 and digits 1234567",
    "",
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny saved checkpoint, no tokenizer files."""
    path = tmp_path_factory.mktemp("model")
    ref.save(ref.build("glm4-plain"), path)
    return path


def checkpoint_with(model_dir, tmp_path, **files):
    shutil.copytree(model_dir, tmp_path, dirs_exist_ok=True)
    for name, content in files.items():
        (tmp_path / name.replace("__", ".")).write_bytes(content if isinstance(content, bytes) else content.encode())
    return str(tmp_path)


def byte_level_bpe_json() -> str:
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<|endoftext|>"], show_progress=False)
    tok.train_from_iterator(TEXTS[:3] * 5, trainer)
    return tok.to_str()


def test_no_tokenizer_files_gives_none(model_dir):
    assert mixserve.load(str(model_dir), dtype="float32", progress=False).tokenizer is None


def test_tokenizer_json_round_trips(model_dir, tmp_path):
    path = checkpoint_with(model_dir, tmp_path, tokenizer__json=byte_level_bpe_json())
    tok = mixserve.load(path, dtype="float32", progress=False).tokenizer
    assert isinstance(tok, HFTokenizer)
    for text in TEXTS:
        ids = tok.encode(text)
        assert tok.decode(ids) == text
    # trained merges are used: a training sentence takes fewer tokens than bytes
    assert len(tok.encode(TEXTS[0])) < len(TEXTS[0].encode()) * 3 // 4


# --- Kimi: tiktoken.model = lines of "base64(token bytes) rank" -------------------------------------
MERGES = [b"he", b"ll", b"llo", b"hello", b"12", b"\xe4\xbd", b"\xe4\xbd\xa0"]  # 256.., "你" = e4 bd a0
ID = {tok: 256 + i for i, tok in enumerate(MERGES)}
SPECIALS = {"300": {"content": "<|im_end|>", "special": True}, "301": {"content": "<|im_user|>", "special": True}}


def tiktoken_files() -> dict:
    ranks = [bytes([b]) for b in range(256)] + MERGES
    model = "".join(f"{base64.b64encode(t).decode()} {rank}\n" for rank, t in enumerate(ranks))
    return {"tiktoken__model": model, "tokenizer_config__json": json.dumps({"added_tokens_decoder": SPECIALS})}


@pytest.fixture(scope="module")
def kimi_tok(model_dir, tmp_path_factory):
    path = checkpoint_with(model_dir, tmp_path_factory.mktemp("kimi"), **tiktoken_files())
    tok = mixserve.load(path, dtype="float32", progress=False).tokenizer
    assert isinstance(tok, TiktokenTokenizer)
    return tok


@pytest.mark.parametrize("text", TEXTS)
def test_tiktoken_round_trips(kimi_tok, text):
    assert kimi_tok.decode(kimi_tok.encode(text)) == text


def test_tiktoken_merges_and_cjk(kimi_tok):
    assert kimi_tok.encode("hello") == [ID[b"hello"]]
    assert kimi_tok.encode("你好") == [ID[b"\xe4\xbd\xa0"], *"好".encode()]


def test_tiktoken_uses_kimi_split_pattern(kimi_tok):
    # \p{N}{1,3}: "1212" splits as "121" + "2", so the "12" merge applies once, then 1 and 2 alone
    assert kimi_tok.encode("1212") == [ID[b"12"], ord("1"), ord("2")]
    # (the merge itself applies to a 2-digit group; without the split "1212" would be [12, 12])
    assert kimi_tok.encode("12") == [ID[b"12"]]


def test_tiktoken_special_tokens(kimi_tok):
    assert kimi_tok.encode("<|im_end|>") == [300]
    ids = kimi_tok.encode("hello<|im_user|>你<|im_end|>")
    assert ids == [ID[b"hello"], 301, ID[b"\xe4\xbd\xa0"], 300]
    assert kimi_tok.decode(ids) == "hello<|im_user|>你<|im_end|>"


def test_tiktoken_unnamed_special_ids_decode_as_reserved_tokens(kimi_tok):
    """Kimi's config names only some of its 256 special ids; an unnamed one the model samples
    used to raise KeyError in decode. Moonshot's tokenizer names it <|reserved_token_i|>."""
    first = 256 + len(MERGES)  # the first id after the ranks, unnamed in SPECIALS
    hello = ID[b"hello"]
    assert kimi_tok.decode([hello, first]) == f"hello<|reserved_token_{first}|>"
    assert kimi_tok.encode(f"<|reserved_token_{first}|>") == [first]
    assert kimi_tok.decode([hello, 300, first + 255]) == f"hello<|im_end|><|reserved_token_{first + 255}|>"
    # past the tokenizer (a padded model vocab): dropped, as the tokenizers library does
    assert kimi_tok.decode([hello, first + 256, 10**6]) == "hello"


# --- incremental decoding (stop strings) -----------------------------------------------------------


def metaspace_bpe() -> HFTokenizer:
    """SentencePiece-style: words carry a leading "▁" that decodes to a space, except at the start
    of a text, so a token's text depends on what precedes it."""
    tok = tokenizers.Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.train_from_iterator(TEXTS * 5, trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>"], show_progress=False))
    wrapped = HFTokenizer.__new__(HFTokenizer)
    wrapped._tok = tok
    return wrapped


class Counting:
    """A tokenizer that counts the ids it is asked to decode."""

    def __init__(self, tok):
        self.tok, self.decoded = tok, 0

    def decode(self, ids):
        self.decoded += len(ids)
        return self.tok.decode(ids)


def assert_incremental_text_follows_decode(tok, ids):
    inc = IncrementalDecoder(tok)
    for n in range(1, len(ids) + 1):
        inc.add(ids[:n])
        full = tok.decode(ids[:n])
        # visible: decode(ids) less what is held back, replacement characters only
        assert full.startswith(inc.visible) and set(full[len(inc.visible):]) <= {"\ufffd"}, (n, inc.visible, full)
        assert inc.visible.startswith(inc.text) and len(inc) == len(inc.visible)
        assert all(inc.tail(k) == inc.visible[max(0, len(inc.visible) - k):] for k in (0, 1, 5, 100))
    if not tok.decode(ids).endswith("\ufffd"):
        assert inc.text == tok.decode(ids)


def test_token_bytes_join_into_the_texts_bytes(model_dir, tmp_path, kimi_tok):
    """Each token's own bytes (the server's chat logprobs "bytes"), for byte-level BPE, Kimi's
    tiktoken and UTF-8 bytes: joined, a text's UTF-8, though CJK and emoji characters split across
    tokens whose text alone is U+FFFD; a special token's bytes are its text; ids past the
    vocabulary have none."""
    hf = mixserve.load(checkpoint_with(model_dir, tmp_path, tokenizer__json=byte_level_bpe_json()),
                       dtype="float32", progress=False).tokenizer
    split = 0
    for tok in (hf, kimi_tok, ByteTokenizer()):
        for text in TEXTS:
            ids = tok.encode(text)
            assert b"".join(tok.token_bytes(t) for t in ids) == text.encode(), (tok, text)
            split += sum("\ufffd" in tok.decode([t]) for t in ids)
    assert split > 10
    assert hf.token_bytes(hf.encode("<|endoftext|>")[0]) == b"<|endoftext|>"
    assert kimi_tok.token_bytes(300) == b"<|im_end|>" and kimi_tok.token_bytes(10**6) == b""
    assert hf.token_bytes(10**6) == b"" and ByteTokenizer().token_bytes(300) == b""


def test_a_sentencepiece_vocabularys_token_bytes(tmp_path):
    """SentencePiece's form (Llama-style tokenizer.json): "▁" stands for a space, and a
    character outside the vocabulary falls back to tokens <0xE4> ... of its bytes. Joined, the
    tokens' bytes are the text's with the leading space the normalizer prepends (decode strips it)."""
    vocab = {"<unk>": 0, **{f"<0x{b:02X}>": 1 + b for b in range(256)}, "▁": 257, "h": 258, "i": 259,
             "▁h": 260, "▁hi": 261}
    tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[("▁", "h"), ("▁h", "i")], unk_token="<unk>",
                                          byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.save(str(tmp_path / "tokenizer.json"))
    sp = HFTokenizer(str(tmp_path / "tokenizer.json"))
    for text in ("hi 你 hi", "hi🙂"):
        ids = sp.encode(text)
        assert sp.decode(ids) == text and any(sp.decode([t]) == "�" for t in ids)  # a character split in bytes
        assert b"".join(sp.token_bytes(t) for t in ids) == b" " + text.encode()


def test_incremental_decoder_text_is_the_whole_decode(model_dir, tmp_path, kimi_tok):
    """Token by token, for byte-level BPE, SentencePiece-style BPE (context-dependent leading
    spaces), Kimi's tiktoken (CJK and emoji bytes split across tokens) and UTF-8 bytes: the text is
    decode(all ids) at every step, less a character not yet complete. Random ids too (invalid
    UTF-8 in the middle, ids past the vocabulary)."""
    hf = mixserve.load(checkpoint_with(model_dir, tmp_path, tokenizer__json=byte_level_bpe_json()),
                       dtype="float32", progress=False).tokenizer
    for tok in (hf, metaspace_bpe(), kimi_tok, ByteTokenizer()):
        for text in TEXTS:
            assert_incremental_text_follows_decode(tok, tok.encode(text))
    rng = np.random.default_rng(0)
    for tok, vocab in ((hf, 400), (kimi_tok, 263), (ByteTokenizer(), 256)):
        for _ in range(40):
            assert_incremental_text_follows_decode(tok, [int(t) for t in rng.integers(0, vocab + 10, 40)])


class LetterCodes:
    """A tokenizer without special_ids (the attribute is newer than the protocol's first users)."""

    def encode(self, text):
        return [ord(c) for c in text]

    def decode(self, ids):
        return "".join(map(chr, ids))


class PieceTokenizer:
    """Ids are byte strings (a byte-level vocabulary in miniature): one may end a character and
    start the next, as b"!\xf0\x9f" does."""

    def __init__(self, pieces):
        self.pieces = pieces

    def decode(self, ids):
        return b"".join(self.pieces[i] for i in ids if 0 <= i < len(self.pieces)).decode("utf-8", errors="replace")


def serve(tok, tokens, stop, max_new_tokens=3000, **options):
    r = Request(0, [1], max_new_tokens=max_new_tokens, temperature=0.0, top_p=1.0, seed=0, stop=stop, **options)
    for token in tokens:
        r.accept(token, 0.0, (), None, tok)
        if r.result:
            break
    return r


def test_a_stop_string_is_found_at_the_token_that_completes_it():
    """Also when that token starts the next character: "Hi" + "!\xf0\x9f" shows "Hi!" and an
    unfinished emoji; the request stops there (not one token later, when the emoji completes, or
    never, at max_new_tokens = 2)."""
    tok = PieceTokenizer([b"Hi", b"!\xf0\x9f", b"\x98\x80", b" there"])
    for max_new in (4, 2):
        r = serve(tok, [0, 1, 2, 3], ("!",), max_new)
        assert r.stop_reason == "!" and r.out == [0, 1], max_new
    r = serve(tok, [0, 1, 2, 3], ("\U0001F600 th",))  # a stop string with the emoji, across three tokens
    assert r.stop_reason == "\U0001F600 th" and r.out == [0, 1, 2, 3]


def test_no_stop_string_ends_a_request_before_its_min_tokens():
    """vLLM's rule: a stop string completed before the output has min_tokens tokens is passed over
    for good; the first completed by a token at or after it (begun before or not) stops the request.
    (Stop tokens are the steps' to hold back: tests/test_engine.py.)"""
    text = b"abcabxab"
    r = serve(ByteTokenizer(), text, ("ab",), min_tokens=3)
    assert r.stop_reason == "ab" and bytes(r.out) == b"abcab"  # not at 2 tokens: at 5
    r.finish("ok")  # the text is cut at the occurrence that stopped it, not the one passed over
    assert output_text(ByteTokenizer(), r.result) == "abc" and output_text(ByteTokenizer(), r.result, True) == "abcab"
    r = serve(ByteTokenizer(), text, ("ab", "bc"), min_tokens=3)
    assert r.stop_reason == "bc" and bytes(r.out) == b"abc"  # begun at the 2nd token, completed at the 3rd
    r = serve(ByteTokenizer(), text, ("ab",), min_tokens=6)
    assert r.stop_reason == "ab" and bytes(r.out) == b"abcabxab"


def test_stop_strings_cost_linear_decoding():
    """A request with stop strings decodes a bounded number of ids per token, not its whole output
    each time (quadratic): 3000 tokens decode under 6 ids each (where decoding the output at every
    token would decode 4.5 million), and under 60 each in runs that add no text (ids past the
    vocabulary) or only text held back (lone UTF-8 continuation bytes)."""
    text = "the cheapest token is the one you never compute; " * 62
    for tokens, per_token in ((list(text.encode()[:3000]), 6), ([300] * 3000, 6), ([0x80] * 3000, 60)):
        tok = Counting(ByteTokenizer())
        r = serve(tok, tokens, ("zz",))
        assert r.result is not None and r.stop_reason is None and len(r.out) == 3000
        assert tok.decoded < per_token * 3000, (tokens[0], tok.decoded)
    # and the string is still found, here where it first completes
    r = serve(ByteTokenizer(), text.encode(), ("never", "you"))
    assert r.stop_reason == "you" and bytes(r.out).decode() == text[:text.find("you") + 3]


def test_the_output_text_leaves_out_what_stopped_it(model_dir, tmp_path):
    """vLLM's text: without the end token that stopped the request (a special token that
    tokenizers decodes to its name) or the stop string, unless include_stop_str_in_output; the
    tokens keep the end token either way."""
    tok = mixserve.load(checkpoint_with(model_dir, tmp_path, tokenizer__json=byte_level_bpe_json()), dtype="float32",
                        progress=False).tokenizer
    end = tok.encode("<|endoftext|>")
    assert len(end) == 1 and tok.decode(end) == "<|endoftext|>"
    said = tok.encode("Hello, world! The quick")
    ended = Result([*said, *end], "ok", stop_reason=end[0])
    assert output_text(tok, ended) == "Hello, world! The quick"
    assert output_text(tok, ended, include_stop_str=True) == "Hello, world! The quick<|endoftext|>"
    assert output_text(tok, Result(said, "ok")) == "Hello, world! The quick"  # at the length: all of it
    stopped = Result(said, "ok", stop_reason="world")  # what the completing token holds past it goes too
    assert output_text(tok, stopped) == "Hello, " and output_text(tok, stopped, include_stop_str=True) == "Hello, world"


# --- skip_special_tokens (vLLM's, true by default) --------------------------------------------------
def test_skip_special_tokens_leaves_out_what_tokenizers_skips(model_dir, tmp_path):
    """A tokenizer.json's special tokens are its added tokens marked special: the text leaves them
    out exactly as tokenizers' decode(skip_special_tokens=True) does, an added token not marked
    (GLM marks some so) stays; kept ids (a reply's markup) stay too. Random id runs, fresh each run."""
    reference = tokenizers.Tokenizer.from_str(byte_level_bpe_json())
    reference.add_special_tokens(["<|user|>", "<think>"])
    reference.add_tokens(["<arg_key>"])
    path = checkpoint_with(model_dir, tmp_path, tokenizer__json=reference.to_str())
    tok = mixserve.load(path, dtype="float32", progress=False).tokenizer
    ids = {t: reference.token_to_id(t) for t in ("<|endoftext|>", "<|user|>", "<think>", "<arg_key>")}
    assert tok.special_ids == {ids["<|endoftext|>"], ids["<|user|>"], ids["<think>"]}
    rng = np.random.default_rng()
    for _ in range(50):
        run = [int(rng.choice(list(ids.values()))) if rng.random() < 0.3 else int(rng.integers(0, 256))
               for _ in range(int(rng.integers(1, 20)))]
        assert text_tokenizer(tok, True).decode(run) == reference.decode(run, skip_special_tokens=True), run
        assert text_tokenizer(tok, False).decode(run) == reference.decode(run, skip_special_tokens=False), run
    hello = tok.encode("hello")
    run = [ids["<think>"], *hello, ids["<|user|>"], ids["<arg_key>"]]
    assert text_tokenizer(tok, True, {ids["<think>"]}).decode(run) == "<think>hello<arg_key>"
    # A GLM reply read for reasoning keeps <think>, the special one of its markup here
    parser = ReplyParser.for_request(ReplyFormat(True, GLM45), "<|assistant|>", [{"function": {"name": "f"}}])
    assert parser.markup_ids(tok) == {ids["<think>"]}
    assert ReplyParser.for_request(ReplyFormat(False, None), "", None).markup_ids(tok) == frozenset()
    bare = LetterCodes()  # a tokenizer of the caller's own, which does not say its special tokens
    assert parser.markup_ids(bare) == frozenset() and text_tokenizer(bare, True) is bare


KIMI_CONFIG = {"added_tokens_decoder": {**SPECIALS, "302": {"content": "<|tool_call_begin|>", "special": True},
                                        "303": {"content": "[BOS]", "special": True}},
               "bos_token": "[BOS]", "eos_token": {"content": "<|im_end|>", "__type": "AddedToken"}, "unk_token": None,
               "add_bos_token": False, "additional_special_tokens": ["<|im_user|>", "<|not_a_token|>"]}


def test_kimi_special_tokens_are_those_its_config_names_special(model_dir, tmp_path):
    """A Python tokenizer's (Kimi's tiktoken) special tokens, as transformers 5 reads its
    all_special_ids: the config's `*_token` keys' tokens (a string or an AddedToken's content;
    model-specific keys too) and its additional (extra) special tokens; special_tokens_map.json
    only for a config without added tokens. Not every added token: a tool-call marker stays (the
    reply parser reads it). A stop string is found in the text without them."""
    media = 256 + len(MERGES) + 5  # an unnamed reserved id, named special by a model-specific key
    config = {**KIMI_CONFIG, "media_placeholder_token": f"<|reserved_token_{media}|>"}
    files = {**tiktoken_files(), "tokenizer_config__json": json.dumps(config),
             "special_tokens_map__json": json.dumps({"sep_token": "<|tool_call_begin|>"})}  # not read
    tok = mixserve.load(checkpoint_with(model_dir, tmp_path / "kimi", **files), dtype="float32",
                        progress=False).tokenizer
    assert tok.special_ids == {300, 301, 303, media}
    run = [303, ID[b"hello"], 302, 301, media, ID[b"12"], 300]
    assert text_tokenizer(tok, True).decode(run) == "hello<|tool_call_begin|>12"
    assert text_tokenizer(tok, False).decode(run) == tok.decode(run)
    kimi = ReplyParser.for_request(ReplyFormat(True, KIMI_K2), "", [{"function": {"name": "f"}}])
    assert kimi.markup_ids(tok) == frozenset()  # none of its markup is special here: nothing to keep
    files = {**tiktoken_files(), "tokenizer_config__json": json.dumps({"bos_token": None}),
             "special_tokens_map__json": json.dumps({"eos_token": f"<|reserved_token_{media}|>"})}
    legacy = mixserve.load(checkpoint_with(model_dir, tmp_path / "legacy", **files), dtype="float32",
                           progress=False).tokenizer
    assert legacy.special_ids == {media}
    # stop strings are found in the request's text: "hello12" only once <|im_user|> is left out
    tokens = [ID[b"hello"], 301, ID[b"12"], ord("!")]
    assert serve(tok, tokens, ("hello12",)).stop_reason == "hello12"
    for options in ({"skip_special_tokens": False}, {"kept_special_ids": {301}}):
        r = serve(tok, tokens, ("hello12",), **options)
        assert r.stop_reason is None and r.out == tokens, options


def test_a_left_out_token_keeps_the_next_words_space_as_tokenizers_does(tmp_path):
    """A SentencePiece-style decoder (Metaspace) strips the text's first space: the incremental text
    and the stop strings must see a left-out special token as absent, not as the text's start
    ("Hi there", not "Hithere"), as tokenizers' decode(skip_special_tokens=True) and run.output_text do."""
    reference = tokenizers.Tokenizer(models.WordLevel({"▁Hi": 0, "▁there": 1, "!": 2}, unk_token="!"))
    reference.decoder = decoders.Metaspace()
    reference.add_special_tokens(["<x>"])
    (tmp_path / "tokenizer.json").write_text(reference.to_str())
    tok = HFTokenizer(str(tmp_path / "tokenizer.json"))
    ids = [0, reference.token_to_id("<x>"), 1, 2]
    text = text_tokenizer(tok, True)
    decoder = IncrementalDecoder(text)
    for n in range(1, len(ids) + 1):
        decoder.add(ids[:n])
        assert decoder.visible == text.decode(ids[:n]) == reference.decode(ids[:n], skip_special_tokens=True)
    assert decoder.visible == "Hi there!"
    r = serve(tok, ids, ("i t",))
    assert r.stop_reason == "i t" and r.out == ids[:3]
