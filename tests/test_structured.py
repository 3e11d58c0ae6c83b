"""Structured outputs (mixserve/grammar.py): the step's mask against a numpy statement of it, the
masks llguidance computes against the prefixes of a choice worked out here, greedy decoding
against the cache-free forward restricted to those prefixes (plain, speculative with right and
wrong drafts, and disaggregated), sampled JSON that parses and fits its schema, and per-request
errors."""

import dataclasses
import json
import re

import jax.numpy as jnp
import numpy as np
import pytest

import mixserve
from mixserve.disaggregated import DisaggregatedEngine
from mixserve.engine import Engine
from mixserve.grammar import ALL_ALLOWED, Grammars, StructuredOutput
from mixserve.sampling import Sampling, adjusted_logits
from mixserve.tokenizer import ByteTokenizer, HFTokenizer
from conftest import ONE_STEP_SHAPE
from test_speculative import _run_with_oracle

EOS = 257  # the tiny presets' end token; their ids 0-255 are bytes
CHOICES = ("yes", "yesterday", "no", "not now", "maybe")


def byte_model(preset: str, **kw):
    return dataclasses.replace(mixserve.load(preset, dtype="float32", **kw), tokenizer=ByteTokenizer())


def choice_allowed(prefix: bytes, choices=CHOICES) -> set[int]:
    """The tokens that may follow `prefix` under a choice of strings, worked out from the strings:
    each longer choice's next byte, and the end token where prefix is a choice."""
    encoded = [c.encode() for c in choices]
    return ({c[len(prefix)] for c in encoded if c.startswith(prefix) and len(c) > len(prefix)}
            | ({EOS} if prefix in encoded else set()))


def bits(mask_W: np.ndarray, vocab: int) -> set[int]:
    return {v for v in range(vocab) if (int(mask_W[v // 32]) >> (v % 32)) & 1}


def test_the_mask_leaves_exactly_the_allowed_tokens_and_nothing_else_changes():
    """Fresh random logits and random bit patterns (a vocabulary not a multiple of 32, a row
    allowing all, a row allowing one token: bit 31 among the tested bits), against numpy: allowed
    logits come back bit for bit, the rest are -inf. Without masks (W = 0) the logits are unchanged."""
    rng = np.random.default_rng()
    B, V = 5, 77
    W = -(-V // 32)
    logits = rng.normal(0, 3, (B, V)).astype(np.float32)
    allowed = rng.integers(-2**31, 2**31, (B, W), dtype=np.int64).astype(np.int32)
    allowed[1] = ALL_ALLOWED
    allowed[2] = 0
    allowed[2, 0] = np.int32(-2**31)  # token 31 alone
    want = np.where(np.unpackbits(allowed.view(np.uint8), axis=1, bitorder="little")[:, :V] == 1, logits, -np.inf)
    s = Sampling.greedy(B, np, words=W)._replace(allowed_BW=allowed)
    got = np.asarray(adjusted_logits(jnp.asarray(logits), Sampling(*map(jnp.asarray, s))))
    np.testing.assert_array_equal(got, want)
    assert bits(allowed[2], V) == {31} and np.isfinite(got[2]).sum() == 1 and np.isfinite(got[1]).all()
    unmasked = Sampling(*map(jnp.asarray, Sampling.greedy(B, np)))
    np.testing.assert_array_equal(np.asarray(adjusted_logits(jnp.asarray(logits), unmasked)), logits)


def test_llguidance_masks_are_the_choices_next_bytes_per_draft_position():
    """Grammars.allowed against choice_allowed: a request's mask, and with drafts one per verified
    position (the state after the drafts before it); past a draft the grammar refuses, all tokens
    (verification stops at that draft). A row without a matcher allows every token, and the
    matcher is where it began (its next mask is the same)."""
    V = 320
    grammars = Grammars(ByteTokenizer(), V, (EOS,))
    m = grammars.matcher(StructuredOutput(choice=CHOICES))
    assert m.consume_tokens(list(b"ye"))
    drafts = list(b"sX")  # "s" is fine, "X" is refused
    got = grammars.allowed([(m, 1, 0, drafts)], batch=3, positions=4).reshape(3, 4, -1)
    assert bits(got[1, 0], V) == choice_allowed(b"ye") == {ord("s")}
    assert bits(got[1, 1], V) == choice_allowed(b"yes") == {ord("t"), EOS}
    assert ord("X") not in bits(got[1, 1], V)  # so verification never keeps "X", nor reads the masks after it
    assert (got[1, 2:] == ALL_ALLOWED).all() and (got[[0, 2]] == ALL_ALLOWED).all()
    again = grammars.allowed([(m, 0, 0, [])], batch=1)
    np.testing.assert_array_equal(again[0], got[1, 0])


def choice_reference(model, prompt, new):
    """Greedy decoding with the cache-free forward over the growing sequence, each step's argmax
    taken among choice_allowed(output so far), ending at the end token."""
    seq = np.zeros((1, max(24, len(prompt) + new)), np.int32)
    seq[0, :len(prompt)] = prompt
    out = []
    for pos in range(len(prompt), len(prompt) + new):
        logits = np.asarray(model.logits(seq))[0, pos - 1]
        allowed = sorted(choice_allowed(bytes(out)))
        out.append(allowed[int(np.argmax(logits[allowed]))])
        seq[0, pos] = out[-1]
        if out[-1] == EOS:
            break
    return out


def test_a_complete_structured_output_ends_before_min_tokens():
    """min_tokens holds the end token back, but a complete choice allows nothing else: the grammar
    wins, and the request ends there (greedy and sampled), not aborted on a token it refuses."""
    model = byte_model("tiny-kimi")
    engine = Engine(model, num_pages=48, page_size=4, max_batch=4, prefill_chunk=8, **ONE_STEP_SHAPE)
    for temperature in (0.0, 1.0):
        r = engine.generate([[1, 2, 3]], max_new_tokens=12, min_tokens=8, temperature=temperature, seed=1,
                            structured_output=StructuredOutput(choice=["ab", "cd"]))[0]
        assert r.status == "ok" and bytes(r.tokens[:-1]).decode() in ("ab", "cd"), (temperature, r)
        assert r.stop_reason == r.tokens[-1] in model.config.eos_token_ids


@pytest.mark.parametrize("preset", ["tiny-kimi", "tiny-glm4"])
def test_greedy_choice_equals_the_cache_free_forward_restricted_to_the_choices(preset):
    """Prefill's first token and every decode step take the mask of the output so far: the tokens
    of greedy decoding among the choices' next bytes, a choice then the end token (stop_reason).
    A request beside them without a grammar keeps its own tokens."""
    model = byte_model(preset)
    rng = np.random.default_rng(2)
    prompts = [[int(t) for t in rng.integers(0, 256, n)] for n in (5, 11, 14)]
    engine = Engine(model, num_pages=48, page_size=4, max_batch=4, prefill_chunk=8)
    plain = engine.generate(prompts[:1], max_new_tokens=6)
    assert mixserve.StructuredOutput is StructuredOutput  # the README's examples name it from the package
    rids = [engine.submit(p, max_new_tokens=12, structured_output=StructuredOutput(choice=CHOICES)) for p in prompts]
    rids.append(engine.submit(prompts[0], max_new_tokens=6))
    got = {}
    while engine.has_work():
        got.update({u.rid: u.result for u in engine.step() if u.result is not None})
    for p, rid in zip(prompts, rids):
        r = got[rid]
        assert r.status == "ok" and r.tokens == choice_reference(model, p, 12), r
        assert bytes(r.tokens[:-1]).decode() in CHOICES and r.stop_reason == EOS
    assert got[rids[3]].tokens == plain[0].tokens


def test_speculative_verification_keeps_only_drafts_the_grammar_allows():
    """Oracle drafts (the plain structured tokens, right or with one changed, which the grammar
    may refuse) and the MTP's own: the tokens of plain structured decoding."""
    model = byte_model("tiny-glm4", mtp=True)
    prompts = [[int(t) for t in np.random.default_rng(i).integers(0, 256, 5 + 7 * i)] for i in range(3)]
    request = dict(max_new_tokens=12, structured_output=StructuredOutput(choice=CHOICES))
    engine = lambda **kw: Engine(model, num_pages=64, page_size=8, max_batch=4, **ONE_STEP_SHAPE, **kw)
    plain = engine().generate(prompts, **request)
    for k, wrong_at in ((3, None), (3, 0), (2, 1)):
        spec = engine(speculative_tokens=k)
        got = _run_with_oracle(spec, prompts, plain, k, wrong_at, **request)
        assert [r.tokens for r in got] == [r.tokens for r in plain], (k, wrong_at)
        # a wrong first draft keeps none (but a first decode step's own: forced or MTP drafts)
        assert spec.counters.accepted_tokens > 0 or wrong_at == 0
    assert [r.tokens for r in engine(speculative_tokens=2).generate(prompts, **request)] == [r.tokens for r in plain]


def test_allowed_token_ids_leave_only_those_tokens_plain_and_speculative():
    """vLLM's allowed_token_ids, through the masks structured outputs use: prefill's first token
    and every decode step sample among them only. Greedy, the tokens of a +100 logit bias on them
    (the tiny models' logits span far less); sampled, none outside them; speculative verification
    of oracle drafts, right or with one moved outside the set, keeps the plain tokens. Refused per
    request: empty, outside the vocabulary, or beside a structured output."""
    model = byte_model("tiny-glm4", mtp=True)
    prompts = [[int(t) for t in np.random.default_rng(i).integers(0, 256, 5 + 7 * i)] for i in range(3)]
    allowed = (10, 65, 67, 69, 120)  # each id + 1 (the oracle's wrong draft) is outside: no end token
    request = dict(max_new_tokens=10, allowed_token_ids=allowed)
    engine = lambda **kw: Engine(model, num_pages=64, page_size=8, max_batch=4, **ONE_STEP_SHAPE, **kw)
    plain_engine = engine()
    plain = plain_engine.generate(prompts, **request)
    biased = plain_engine.generate(prompts, max_new_tokens=10, logit_bias={t: 100 for t in allowed})
    assert [r.tokens for r in plain] == [r.tokens for r in biased]
    assert all(r.status == "ok" and len(r.tokens) == 10 and set(r.tokens) <= set(allowed) for r in plain), plain
    sampled = plain_engine.generate(prompts, temperature=1.0, seed=3, **request)
    tokens = [t for r in sampled for t in r.tokens]
    assert set(tokens) <= set(allowed) and len(set(tokens)) > 1, tokens
    for wrong_at in (None, 1):
        got = _run_with_oracle(engine(speculative_tokens=3), prompts, plain, 3, wrong_at, **request)
        assert [r.tokens for r in got] == [r.tokens for r in plain], wrong_at
    for options, why in (({"allowed_token_ids": ()}, "non-empty list of token ids"),
                         ({"allowed_token_ids": (1, model.config.vocab_size)}, "non-empty list of token ids"),
                         ({"allowed_token_ids": [65], "structured_output": StructuredOutput(choice=["A"])},
                          "not both")):
        r = plain_engine.generate(prompts[:1], max_new_tokens=2, **options)[0]
        assert r.status == "rejected" and why in r.reason, (options, r.reason)


def test_a_grammar_after_a_free_part_starts_at_its_end_plain_and_speculative():
    """StructuredOutput.after (a thinking model's `</think>`): take the first token after the
    first that plain greedy decoding emits for the first time as the end of the free part (so it
    ends there, not before). The output is plain decoding's up to it, then
    greedy decoding among the choices from there; speculative with oracle drafts that cross the
    end (the grammar's mask starts at the position after it) and one wrong draft, the same."""
    model = byte_model("tiny-glm4", mtp=True)
    prompts = [[int(t) for t in np.random.default_rng(i).integers(0, 256, 6 + 5 * i)] for i in range(2)]
    engine = lambda **kw: Engine(model, num_pages=64, page_size=8, max_batch=4, **ONE_STEP_SHAPE, **kw)
    free = []
    for f in engine().generate(prompts, max_new_tokens=6):
        end = next(i for i in range(1, 6) if f.tokens[i] not in f.tokens[:i])
        assert EOS not in f.tokens[:end + 1], f.tokens
        free.append(f.tokens[:end + 1])
    want = [f + choice_reference(model, p + f, 12) for p, f in zip(prompts, free)]
    requests = [dict(max_new_tokens=len(f) + 12, structured_output=StructuredOutput(choice=CHOICES, after=(f[-1],)))
                for f in free]
    plain = engine()
    rids = [plain.submit(p, **r) for p, r in zip(prompts, requests)]
    got = {}
    while plain.has_work():
        got.update({u.rid: u.result for u in plain.step() if u.result is not None})
    assert [got[rid].tokens for rid in rids] == want
    for wrong_at in (None, 1):
        spec = engine(speculative_tokens=3)
        for p, r, w in zip(prompts, requests, want):  # one prompt at a time: each has its own `after`
            (result,) = _run_with_oracle(spec, [p], [dataclasses.replace(got[rids[0]], tokens=w)], 3, wrong_at, **r)
            assert result.tokens == w, wrong_at
        assert spec.counters.accepted_tokens > 0


def test_the_first_tokens_may_open_the_free_part_or_start_the_grammar():
    """StructuredOutput.opens (a thinking model's reply opening `<think>` itself): while the output
    may still be either, the mask is the grammar's tokens and the opener's next one, worked out
    here from the strings; the grammar's choice "<tag>" and the opener "<think>" share "<t". Each
    path's tokens are taken; a token of neither aborts the request with the reason."""
    tok = ByteTokenizer()
    grammars = Grammars(tok, 320, (EOS,))
    choices = ("<tag>", "no")
    structured = StructuredOutput(choice=choices, after=tuple(tok.encode("</think>")), opens=tuple(tok.encode("<think>")))
    assert hash(StructuredOutput(json_schema={"a": 1, "b": [2]})) == hash(StructuredOutput(json_schema={"b": [2], "a": 1}))

    def run(text: str) -> tuple[mixserve.Result | None, list[set[int]]]:
        req = mixserve.request.Request(0, [1], 64, 0.0, 1.0, 0, structured_output=structured)
        req.matcher, req.opener_taken = grammars.matcher(structured), 0
        masks = []
        for token in [*tok.encode(text), EOS]:
            first = req.grammar_start([])
            held = [] if first is None else [(req.matcher, 0, first, [])]
            openers = [] if req.opener() is None else [(req.matcher if req.matcher_alive else None, 0, req.opener())]
            masks.append(bits(grammars.allowed(held, 1, 1, openers)[0], 320))
            req.accept(token, 0.0, (EOS,))
            if req.result is not None:
                return req.result, masks
        return None, masks

    def grammar_then_opener(prefix: str) -> set[int]:
        opener = "<think>"[len(prefix)] if "<think>".startswith(prefix) and len(prefix) < 7 else None
        return choice_allowed(prefix.encode(), choices) | ({ord(opener)} if opener else set())

    result, masks = run("<think>free {</think><tag>")
    assert result.status == "ok" and bytes(result.tokens[:-1]) == b"<think>free {</think><tag>"
    assert masks[:3] == [grammar_then_opener(""), grammar_then_opener("<"), grammar_then_opener("<t")]
    assert masks[1] == {ord("t")} and masks[2] == {ord("a"), ord("h")}
    assert masks[3] == {ord("i")}  # "<th": no choice reads on
    assert all(len(m) == 320 for m in masks[7:21])  # the free part, up to </think> taken
    assert masks[21:23] == [choice_allowed(b"", choices), {ord("t")}]  # the grammar, from its first token after
    result, masks = run("<tag>")
    assert result.status == "ok" and masks[3] == choice_allowed(b"<ta", choices) and masks[-1] == {EOS}
    result, _ = run("no")
    assert result.status == "ok" and bytes(result.tokens[:-1]) == b"no"
    for wrong in ("x", "<x", "<thx"):
        result, _ = run(wrong)
        assert result.status == "aborted" and "does not open its free part" in result.reason, wrong
    assert "opens starts a free part" in StructuredOutput(regex="a", opens=(1,)).reason()


def test_an_output_opening_its_free_part_is_free_to_its_end_plain_and_speculative():
    """The opener (f0, 301), f0 greedy decoding's first token (no choice's first byte), so the
    mask's only token after it is 301: then free greedy decoding up to a token it emits for the
    first time (`after`), then greedy among the choices, as the cache-free forward computes them.
    Pushed off the opener (logit bias -100 on its first token; or on its third, where its first two
    are the choices' first two), the output is the choices'. Speculative (MTP drafts; oracle
    drafts, right and one wrong: none verified while the output may still open) gives the same."""
    model = byte_model("tiny-glm4", mtp=True)
    prompts = [[int(t) for t in np.random.default_rng(i).integers(0, 256, 6 + 5 * i)] for i in range(2)]
    engine = lambda **kw: Engine(model, num_pages=64, page_size=8, max_batch=4, **ONE_STEP_SHAPE, **kw)
    for p in prompts:
        (first,) = engine().generate([p], max_new_tokens=1)
        f0 = first.tokens[0]
        assert f0 not in {c.encode()[0] for c in CHOICES}, "pick prompts whose first token opens alone"
        (free,) = engine().generate([p + [f0, 301]], max_new_tokens=6)
        end = next(i for i in range(1, 6) if free.tokens[i] not in free.tokens[:i])
        opened = [f0, 301, *free.tokens[:end + 1]]
        chosen = choice_reference(model, p, 12)
        cases = [(StructuredOutput(choice=CHOICES, opens=(f0, 301), after=(free.tokens[end],)), None,
                  opened + choice_reference(model, p + opened, 12)),
                 (StructuredOutput(choice=CHOICES, opens=(300, 301), after=(f0,)), {300: -100.0}, chosen)]
        cases.append((StructuredOutput(choice=CHOICES, opens=(*chosen[:2], 301), after=(f0,)), {301: -100.0}, chosen))
        for structured, bias, want in cases:
            request = dict(max_new_tokens=len(want) + 2, structured_output=structured, logit_bias=bias)
            (plain,) = engine().generate([p], **request)
            assert plain.tokens == want
            assert engine(speculative_tokens=3).generate([p], **request)[0].tokens == want
            for wrong_at in (None, 1):
                (spec,) = _run_with_oracle(engine(speculative_tokens=3), [p], [plain], 3, wrong_at, **request)
                assert spec.tokens == want, wrong_at


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_forced_tokens_are_drafted_and_all_kept(temperature):
    """With speculative decoding (n-gram drafts, which a random model's output never repeats) the
    bytes a regex forces are drafted (llguidance's fast-forward tokens). After "a" or "b" the F
    bytes of "lpha-constant-suffix-" (21) or "eta-constant-suffix-" (20) are forced: each step
    keeps its K = 3 forced drafts and samples the next forced byte as its bonus token (the mask
    leaves one), so F - F // 4 drafts are kept and the span takes ceil(F / 4) steps, not F.
    Greedy, the tokens are plain decoding's; sampled, the output still matches."""
    model = byte_model("tiny-glm4")
    prompts = [[int(t) for t in np.random.default_rng(i).integers(0, 256, 5 + 7 * i)] for i in range(3)]
    regex = "(alpha|beta)-constant-suffix-[0-9]"
    request = dict(max_new_tokens=40, temperature=temperature, seed=1, structured_output=StructuredOutput(regex=regex))
    spec = Engine(model, num_pages=64, page_size=8, max_batch=4, **ONE_STEP_SHAPE, speculative_tokens=3, draft="ngram")
    got = spec.generate(prompts, **request)
    spans = [21 if r.tokens[0] == ord("a") else 20 for r in got]
    assert spec.counters.accepted_tokens == sum(f - f // 4 for f in spans)
    for r in got:
        assert re.fullmatch(regex, bytes(r.tokens[:-1]).decode()) and r.stop_reason == EOS, r.tokens
    if temperature == 0:
        plain = Engine(model, num_pages=64, page_size=8, max_batch=4, **ONE_STEP_SHAPE)
        assert [r.tokens for r in plain.generate(prompts, **request)] == [r.tokens for r in got]


def test_a_disaggregated_pair_drafts_the_forced_tokens_from_its_first_decode_step():
    """With MTP drafts, a regex's forced run after the first token (sampled on the prefill side,
    which drafts the forced tokens in place of the MTP's) is drafted from the decode side's first
    step, as on one engine: the same tokens and the same drafts kept."""
    model = byte_model("tiny-glm4", mtp=True)
    prompts = [[int(t) for t in np.random.default_rng(i).integers(0, 256, 5 + 7 * i)] for i in range(3)]
    request = dict(max_new_tokens=40, structured_output=StructuredOutput(regex="(alpha|beta)-constant-suffix-[0-9]"))
    engine = lambda **kw: Engine(model, num_pages=64, page_size=8, max_batch=4, **ONE_STEP_SHAPE, speculative_tokens=3, **kw)
    one = engine()
    want = one.generate(prompts, **request)
    pair = DisaggregatedEngine(engine(prefill_only=True), engine())
    assert [r.tokens for r in pair.generate(prompts, **request)] == [r.tokens for r in want]
    assert pair.decode.counters.accepted_tokens == one.counters.accepted_tokens > 0


def fits(value, schema) -> bool:
    """Whether a parsed JSON value fits the schema's object, required, properties, enum, integer
    minimum and maximum, string maxLength and array items and maxItems (what SCHEMA uses)."""
    if "enum" in schema:
        return value in schema["enum"]
    kind = schema.get("type")
    if kind == "object":
        return (isinstance(value, dict) and set(schema.get("required", ())) <= set(value)
                and (schema.get("additionalProperties", True) or set(value) <= set(schema["properties"]))
                and all(fits(value[k], s) for k, s in schema["properties"].items() if k in value))
    if kind == "integer":
        return (isinstance(value, int) and not isinstance(value, bool)
                and schema.get("minimum", value) <= value <= schema.get("maximum", value))
    if kind == "string":
        return isinstance(value, str) and len(value) <= schema.get("maxLength", len(value))
    if kind == "array":
        return (isinstance(value, list) and len(value) <= schema.get("maxItems", len(value))
                and all(fits(v, schema["items"]) for v in value))
    raise ValueError(kind)


SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 6}, "age": {"type": "integer", "minimum": -9, "maximum": 99},
                         "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}},
          "x-guidance": {"whitespace_flexible": False}}  # compact JSON: no whitespace between JSON tokens
# The longest compact JSON SCHEMA allows: {"name":" (9), six characters escaped as \uXXXX (36),
# ","age": (8), -9 (2; 99 is 2 too), ,"tags": (8), ["a","b"] (9), } (1).
MAX_JSON_BYTES = 9 + 36 + 8 + 2 + 8 + 9 + 1


def test_sampled_json_parses_and_fits_the_schema_disaggregated_as_one_engine():
    """Sampling at temperature 1 from a random model, through a prefill/decode pair (the first
    token on the prefill side, the rest on the decode side): SCHEMA bounds every value, so every
    output ends on the end token within MAX_JSON_BYTES, as JSON that fits the schema (the bounds
    included), and the pair's tokens equal one engine's."""
    model = byte_model("tiny-glm4")
    prompts = [[int(t) for t in np.random.default_rng(i).integers(0, 256, 4 + i)] for i in range(6)]
    request = dict(max_new_tokens=MAX_JSON_BYTES + 1, temperature=1.0, seed=5,
                   structured_output=StructuredOutput(json_schema=SCHEMA))
    one = Engine(model, num_pages=96, page_size=8, max_batch=6).generate(prompts, **request)
    pair = DisaggregatedEngine(Engine(model, num_pages=96, page_size=8, max_batch=6, prefill_only=True),
                               Engine(model, num_pages=96, page_size=8, max_batch=6))
    assert [r.tokens for r in pair.generate(prompts, **request)] == [r.tokens for r in one]
    assert pair.decode.grammars.lltokenizer() is pair.prefill.grammars.lltokenizer()  # read once for the pair
    assert pair.decode.grammars.mask_s > 0 and pair.prefill.grammars.mask_s > 0  # the first token's, the rest's
    for r in one:
        assert r.stop_reason == EOS, r.tokens
        value = json.loads(bytes(r.tokens[:-1]).decode())
        assert fits(value, SCHEMA), value


def test_a_preempted_structured_request_samples_what_it_would_have():
    """A pool too small for four JSON outputs preempts one; recomputed, its matcher is where its
    output ends, and every output is the roomy engine's."""
    model = byte_model("tiny-glm4")
    prompts = [[int(t) for t in np.random.default_rng(i).integers(0, 256, 6 + i)] for i in range(4)]
    request = dict(max_new_tokens=MAX_JSON_BYTES + 1, temperature=1.0, seed=5,
                   structured_output=StructuredOutput(json_schema=SCHEMA))
    want = Engine(model, num_pages=96, page_size=4, max_batch=4).generate(prompts, **request)
    small = Engine(model, num_pages=40, page_size=4, max_batch=4)
    assert [r.tokens for r in small.generate(prompts, **request)] == [r.tokens for r in want]
    assert small.counters.preemptions > 0


@pytest.mark.parametrize("structured, options, message", [
    (StructuredOutput(regex="a(b"), {}, "unclosed group"),
    (StructuredOutput(json_schema={"type": "objectx"}), {}, "objectx"),
    (StructuredOutput(json_schema="{not json"), {}, "structured output"),
    (StructuredOutput(grammar="start: undefined_rule"), {}, "undefined_rule"),
    (StructuredOutput(regex="a", choice=("a",)), {}, "exactly one of"),
    (StructuredOutput(), {}, "exactly one of"),
    (StructuredOutput(choice=()), {}, "non-empty list of strings"),
    (StructuredOutput(choice=("a", 1)), {}, "non-empty list of strings"),
    (StructuredOutput(regex=5), {}, "regex must be a string"),
    (StructuredOutput(json_object=True), {"ignore_eos": True}, "ignore_eos"),
    ({"json": {}}, {}, "must be a StructuredOutput"),
])
def test_bad_structured_outputs_are_rejected_per_request(structured, options, message):
    model = byte_model("tiny-kimi")
    engine = Engine(model, num_pages=16, page_size=4, max_batch=2)
    bad = engine.submit([1, 2, 3], max_new_tokens=2, structured_output=structured, **options)
    good = engine.submit([1, 2, 3], max_new_tokens=2, structured_output=StructuredOutput(regex="[0-9]+"))
    results = {}
    while engine.has_work():
        results.update({u.rid: u.result for u in engine.step() if u.result is not None})
    assert results[bad].status == "rejected" and message in results[bad].reason, results[bad].reason
    assert results[good].status == "ok" and all(ord("0") <= t <= ord("9") for t in results[good].tokens)


def test_a_tokenizer_llguidance_cannot_read_is_a_reason_not_a_raise(tmp_path):
    """A Metaspace decoder (SentencePiece-style), or more tokens than the model's vocabulary: every
    structured request is refused with llguidance's reason, and prepare() (a server's start) says
    it rather than raising."""
    from test_tokenizer import byte_level_bpe_json, metaspace_bpe
    path = tmp_path / "tokenizer.json"
    path.write_text(byte_level_bpe_json())  # 400 tokens
    for tokenizer, vocab, message in ((metaspace_bpe(), 320, "Metaspace"), (HFTokenizer(str(path)), 300, "too small")):
        grammars = Grammars(tokenizer, vocab, (0,))
        assert message in grammars.prepare() and "cannot read this model's tokenizer" in grammars.prepare()
        assert grammars.matcher(StructuredOutput(regex="a")) == grammars.prepare()


def test_kimis_tiktoken_tokenizer_is_read_with_its_merges(tmp_path):
    """The tiktoken path (Kimi K2's tokenizer): "hello 42" encoded with the merged token "hello"
    fits a regex, and after "hello" the mask allows the space and the rest of a word, no digit."""
    from test_tokenizer import tiktoken_files
    from mixserve.tokenizer import TiktokenTokenizer
    for name, text in tiktoken_files().items():
        (tmp_path / name.replace("__", ".")).write_text(text)
    tok = TiktokenTokenizer(str(tmp_path / "tiktoken.model"), str(tmp_path / "tokenizer_config.json"))
    vocab = len(tok.encoding._mergeable_ranks) + len(tok.encoding._special_tokens)
    grammars = Grammars(tok, vocab, (300,))  # <|im_end|> (test_tokenizer.SPECIALS)
    m = grammars.matcher(StructuredOutput(regex="[a-z]+ [0-9]{2}"))
    ids = tok.encode("hello 42")
    assert tok.decode(ids[:1]) == "hello" and m.consume_tokens(ids[:1])
    allowed = bits(grammars.allowed([(m, 0, 0, [])], batch=1)[0], vocab)
    assert {ord(" "), ord("a")} <= allowed and not allowed & set(range(ord("0"), ord("9") + 1))
    assert m.consume_tokens(ids[1:]) and m.is_accepting()


def test_an_engine_that_cannot_end_the_output_rejects_it():
    """No tokenizer (no bytes to match), or no stop token (nothing to end on)."""
    for model, stop in ((mixserve.load("tiny-kimi", dtype="float32"), None), (byte_model("tiny-kimi"), ())):
        engine = Engine(model, num_pages=16, page_size=4, max_batch=2, stop_tokens=stop)
        why = engine.options_reason(max_new_tokens=2, temperature=0.0, top_p=1.0,
                                    structured_output=StructuredOutput(json_object=True))
        assert why and ("tokenizer" in why if stop is None else "stop tokens" in why), why
