"""An assistant's reply text -> OpenAI's message fields: its reasoning (`reasoning_content`), its
text (`content`) and its tool calls (`tool_calls`), read from the markup its family was trained to
write (what SGLang's --reasoning-parser and --tool-call-parser read):

- reasoning: `<think>...</think>` (GLM-4.5 and later, Kimi K2 Thinking, K2.5 and K2.6). A reply
  is in its reasoning from its first character when its prompt ends inside an open `<think>` (a
  template that opens it for the model, as GLM-4.7's and GLM-5's do), or when it begins with
  `<think>`; a reply cut short inside it is reasoning only.
- tool calls, Kimi K2 (`kimi_k2`): `<|tool_calls_section_begin|>`, then per call
  `<|tool_call_begin|>functions.NAME:I<|tool_call_argument_begin|>{JSON}<|tool_call_end|>`, then
  `<|tool_calls_section_end|>`. The call's id is the model's own (`functions.NAME:I`): Kimi's
  template writes it back into the next prompt.
- tool calls, GLM (`glm45`): `<tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value>...</tool_call>`,
  with newlines between the tags (GLM-4.5) or none (GLM-4.7, GLM-5). V is JSON, unless the tool's
  schema declares the argument a string, or V is not JSON: then it is the text as written.

- forced calls (tool_choice "required" or a named function, as vLLM serves them): the answer is
  JSON that a structured output held to `forced_calls_schema`, whatever the family's markup: a
  list of {"name", "parameters"} objects, or the named function's arguments.

A call that does not read (arguments that are not a JSON object, a GLM call with text between its
tags) or that the reply cuts short stays in the content as the model wrote it: nothing is lost,
and the client sees what it got. Content and reasoning are stripped of surrounding whitespace.

Streaming: `parse(text, final=False)` of a reply's text so far gives only what cannot change (text
that may still begin a marker is held back, a call shows once it is whole), so each field of it is
a prefix of the final parse's, and the deltas of successive parses add up to the whole reply."""

from __future__ import annotations

import dataclasses
import json
import re
import uuid
from typing import Callable

from mixserve.grammar import StructuredOutput
from mixserve.tokenizer import special_ids_of

THINK, END_THINK = "<think>", "</think>"


@dataclasses.dataclass(frozen=True)
class ToolCall:
    id: str | None  # the model's (Kimi), or None: the stream names it
    name: str
    arguments: str  # a JSON object's text, OpenAI's form


@dataclasses.dataclass(frozen=True)
class Reply:
    reasoning: str
    content: str
    tool_calls: tuple[ToolCall, ...]


def read_kimi_call(body: str, schemas: dict[str, dict]) -> ToolCall:
    """`functions.NAME:I<|tool_call_argument_begin|>{JSON}` -> the call (ValueError if it does not read)."""
    call_id, sep, arguments = body.partition("<|tool_call_argument_begin|>")
    call_id = call_id.strip()
    name = re.sub(r":\d+$", "", call_id).removeprefix("functions.")
    if not sep or not name:
        raise ValueError(f"not a Kimi tool call: {body!r}")
    if not isinstance(json.loads(arguments), dict):  # a JSONDecodeError is a ValueError
        raise ValueError(f"the arguments are not a JSON object: {arguments!r}")
    return ToolCall(call_id, name, arguments.strip())


GLM_ARGUMENT = re.compile(r"\s*<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>\s*", re.DOTALL)


def read_glm_call(body: str, schemas: dict[str, dict]) -> ToolCall:
    """`NAME<arg_key>K</arg_key><arg_value>V</arg_value>...` -> the call (ValueError if it does not read)."""
    name, _, _ = body.partition("<arg_key>")
    name = name.strip()
    pairs, at = [], len(body) - len(body.lstrip()) + len(name)
    while at < len(body) and (match := GLM_ARGUMENT.match(body, at)):
        pairs.append(match.groups())
        at = match.end()
    if not re.fullmatch(r"[^\s<>]+", name) or body[at:].strip():
        raise ValueError(f"not a GLM tool call: {body!r}")
    properties = (schemas.get(name) or {}).get("properties") or {}
    arguments = {}
    for key, value in pairs:
        declared = properties.get(key.strip())
        arguments[key.strip()] = value if isinstance(declared, dict) and declared.get("type") == "string" \
            else json_or_text(value)
    return ToolCall(None, name, json.dumps(arguments, ensure_ascii=False))


def json_or_text(value: str):
    try:
        return json.loads(value)
    except ValueError:
        return value


@dataclasses.dataclass(frozen=True)
class ToolCallFormat:
    """Where a family's calls begin and end, the markers around a run of them (dropped), what a chat
    template that renders calls in this form contains, how one call's body reads, and the markers
    inside a body that it reads."""
    name: str
    begin: str
    end: str
    wrappers: tuple[str, ...]
    signature: str
    read: Callable[[str, dict[str, dict]], ToolCall]
    inner: tuple[str, ...] = ()

    @property
    def markup(self) -> tuple[str, ...]:
        return (self.begin, self.end, *self.wrappers, *self.inner)


KIMI_K2 = ToolCallFormat("kimi_k2", "<|tool_call_begin|>", "<|tool_call_end|>",
                         ("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"), "<|tool_call_begin|>",
                         read_kimi_call, ("<|tool_call_argument_begin|>",))
GLM45 = ToolCallFormat("glm45", "<tool_call>", "</tool_call>", (), "<arg_key>", read_glm_call,
                       ("<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"))
TOOL_CALL_FORMATS = {f.name: f for f in (KIMI_K2, GLM45)}


@dataclasses.dataclass(frozen=True)
class ReplyFormat:
    """What a served model's replies are read for: reasoning, and tool calls in which form (None: not read)."""
    reasoning: bool = False
    tool_calls: ToolCallFormat | None = None

    @classmethod
    def detect(cls, template_sources: list[str]) -> ReplyFormat:
        """The format a model's chat templates write its own turns in: what it was trained to reply in."""
        reasoning = any(END_THINK in source for source in template_sources)
        calls = next((f for f in TOOL_CALL_FORMATS.values() if any(f.signature in s for s in template_sources)), None)
        return cls(reasoning, calls)


def forced_calls_schema(tools: list[dict], forced: str, one_call: bool) -> dict:
    """The JSON schema a forced answer is held to: for "required", a list of at least one call (at
    most one if one_call) of the offered tools, each {"name": NAME, "parameters": {...its schema}};
    for a named function, its parameters. Written as json.dumps writes (", " and ": ", no other
    whitespace): a grammar that allows any whitespace lets a model pad forever."""
    parameters = {t["function"]["name"]: t["function"].get("parameters") or {"type": "object"} for t in tools}
    layout = {"x-guidance": {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}}
    if forced != "required":
        return {**parameters[forced], **layout}
    # each tool's definitions, moved to the root that its "#/$defs/..." references name (as vLLM does)
    defs = {"$defs": {}, "definitions": {}}
    calls = []
    for name, schema in parameters.items():
        for where, held in defs.items():
            for key, value in (schema.get(where) or {}).items():
                if held.setdefault(key, value) != value:
                    raise ValueError(f"tools define {where}/{key} differently: give the definitions distinct names")
        schema = {k: v for k, v in schema.items() if k not in defs}
        calls.append({"type": "object", "properties": {"name": {"const": name}, "parameters": schema},
                      "required": ["name", "parameters"], "additionalProperties": False})
    return {"type": "array", "minItems": 1, **({"maxItems": 1} if one_call else {}), "items": {"anyOf": calls},
            **{where: held for where, held in defs.items() if held}, **layout}


def read_forced_calls(text: str, forced: str) -> list[ToolCall]:
    """A forced answer (forced_calls_schema's JSON) -> its calls (ValueError if it does not read:
    cut short)."""
    value = json.loads(text)
    if forced != "required":
        if not isinstance(value, dict):
            raise ValueError(f"the arguments are not a JSON object: {text!r}")
        return [ToolCall(None, forced, text.strip())]
    if not (isinstance(value, list) and all(isinstance(c, dict) and isinstance(c.get("name"), str) for c in value)):
        raise ValueError(f"not a list of calls: {text!r}")
    return [ToolCall(None, c["name"], json.dumps(c.get("parameters", {}), ensure_ascii=False)) for c in value]


@dataclasses.dataclass(frozen=True)
class ReplyParser:
    """How one request's replies read: in_reasoning, whether its prompt leaves a `<think>` open; calls,
    the tool-call format when the request offers tools; schemas, each tool's parameters by name;
    forced, tool_choice "required" or the named function (the answer is forced_calls_schema's JSON);
    thinking_off, whether the prompt ends on a closed `<think></think>` (GLM's template with
    thinking switched off)."""
    reasoning: bool
    in_reasoning: bool
    calls: ToolCallFormat | None
    schemas: dict[str, dict]
    forced: str | None = None
    thinking_off: bool = False

    @classmethod
    def for_request(cls, fmt: ReplyFormat, prompt_text: str, tools: list[dict] | None,
                    forced: str | None = None) -> ReplyParser:
        open_think = fmt.reasoning and prompt_text.rfind(THINK) > prompt_text.rfind(END_THINK)
        schemas = {t["function"]["name"]: t["function"].get("parameters") or {} for t in tools or ()}
        off = fmt.reasoning and prompt_text.rstrip().endswith(END_THINK)
        return cls(fmt.reasoning, open_think, fmt.tool_calls if tools else None, schemas, forced, off)

    def markup_ids(self, tokenizer) -> frozenset[int]:
        """The tokenizer's special tokens among the markup this parser reads (`<think>`, the tool-call
        format's markers), each a token of its own: a text that leaves out special tokens (vLLM's
        skip_special_tokens) keeps these, for the parser to read and take out."""
        markup = ((THINK, END_THINK) if self.reasoning else ()) + (self.calls.markup if self.calls else ())
        ids = [tokenizer.encode(m) for m in markup]
        return frozenset(i[0] for i in ids if len(i) == 1 and i[0] in special_ids_of(tokenizer))

    def hold_answer(self, structured: StructuredOutput, tokenizer) -> StructuredOutput:
        """`structured`, held to the answer only (as vLLM holds a thinking model's answer, not its
        reasoning): after `</think>` encoded (StructuredOutput.after) when the prompt leaves <think>
        open; when the reply may open it itself, its first tokens may be `<think>` encoded too
        (StructuredOutput.opens: reasoning, then the answer) or the answer's; with thinking
        switched off, from the first token."""
        if not self.reasoning or self.thinking_off:
            return structured
        opens = () if self.in_reasoning else tuple(tokenizer.encode(THINK))
        return dataclasses.replace(structured, after=tuple(tokenizer.encode(END_THINK)), opens=opens)

    def parse(self, text: str, final: bool) -> Reply:
        """The reply text's fields; before the final text, only what later text cannot change."""
        reasoning, rest = "", text
        if self.reasoning:
            start = 0 if self.in_reasoning else None
            lead = text.lstrip()
            if start is None and lead.startswith(THINK):
                start = len(text) - len(lead) + len(THINK)
            elif start is None and not final and THINK.startswith(lead):  # it may yet open
                return Reply("", "", ())
            if start is not None:
                close = text.find(END_THINK, start)
                if close < 0:
                    reasoning, rest = text[start:] if final else held_back(text[start:], (END_THINK,)), ""
                else:
                    reasoning, rest = text[start:close], text[close + len(END_THINK):]
        content, calls = self.split_calls(rest, final)
        return Reply(reasoning.strip(), content.strip(), tuple(calls))

    def split_calls(self, text: str, final: bool) -> tuple[str, list[ToolCall]]:
        if self.forced is not None:  # the calls show once the answer is whole; cut short, it is the content
            try:
                return ("", read_forced_calls(text, self.forced)) if final else ("", [])
            except ValueError:
                return text, []
        f = self.calls
        if f is None:
            return text, []
        pieces, calls, at = [], [], 0
        while True:
            begin = text.find(f.begin, at)
            if begin < 0:
                pieces.append(text[at:] if final else held_back(text[at:], (f.begin, *f.wrappers)))
                break
            pieces.append(text[at:begin])
            end = text.find(f.end, begin + len(f.begin))
            if end < 0:  # an open call: not yet whole, or (final) cut short
                pieces.append(text[begin:] if final else "")
                break
            try:
                calls.append(f.read(text[begin + len(f.begin):end], self.schemas))
            except ValueError:
                pieces.append(text[begin:end + len(f.end)])
            at = end + len(f.end)
        content = "".join(pieces)
        for wrapper in f.wrappers:
            content = content.replace(wrapper, "")
        return content, calls


def held_back(text: str, markers: tuple[str, ...]) -> str:
    """text less its longest end that may be the start of a marker."""
    for k in range(min(len(text), max(map(len, markers)) - 1), 0, -1):
        if any(m.startswith(text[-k:]) for m in markers):
            return text[:-k]
    return text


class ReplyStream:
    """One choice's reply as OpenAI's fields: whole (`message`) or as the deltas of a stream (`delta`),
    which add up to the whole. one_call: keep only the first call (parallel_tool_calls false)."""

    def __init__(self, parser: ReplyParser, one_call: bool = False):
        self.parser, self.one_call = parser, one_call
        self.reasoning = self.content = 0  # characters sent
        self.ids: list[str] = []  # the calls sent, by id
        self.called = False  # the final reply made a call

    def calls_of(self, reply: Reply) -> tuple[ToolCall, ...]:
        return reply.tool_calls[:1] if self.one_call else reply.tool_calls

    def message(self, text: str) -> dict:
        reply = self.parser.parse(text, final=True)
        calls = self.calls_of(reply)
        self.called = bool(calls)
        out = {"role": "assistant", "content": reply.content or None}
        if self.parser.reasoning:
            out["reasoning_content"] = reply.reasoning or None
        if calls:
            out["tool_calls"] = [self.openai_call(i, c) for i, c in enumerate(calls)]
        return out

    def delta(self, text: str, final: bool) -> dict:
        reply = self.parser.parse(text, final)
        calls = self.calls_of(reply)
        self.called = bool(calls)
        out = {}
        if len(reply.reasoning) > self.reasoning:
            out["reasoning_content"], self.reasoning = reply.reasoning[self.reasoning:], len(reply.reasoning)
        if len(reply.content) > self.content:
            out["content"], self.content = reply.content[self.content:], len(reply.content)
        if len(calls) > (sent := len(self.ids)):
            out["tool_calls"] = [{"index": i, **self.openai_call(i, c)} for i, c in enumerate(calls[sent:], sent)]
        return out

    def openai_call(self, index: int, call: ToolCall) -> dict:
        if index == len(self.ids):
            self.ids.append(call.id or f"call_{uuid.uuid4().hex[:24]}")
        return {"id": self.ids[index], "type": "function",
                "function": {"name": call.name, "arguments": call.arguments}}
