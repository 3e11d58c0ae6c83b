"""Chat templates: the checkpoint's Jinja template that turns OpenAI-style messages into the prompt
text its model was trained on, rendered as transformers' `apply_chat_template` renders it:

- a sandboxed Jinja environment (the template is code from the checkpoint), with trim_blocks,
  lstrip_blocks and loop controls;
- `tojson` keeping non-ASCII text, `raise_exception(message)` and `strftime_now(format)`;
- the tokenizer's named special tokens (bos_token, eos_token, ...) as variables;
- a no-op `{% generation %}` block (it only marks training masks).

A checkpoint keeps its template where transformers looks for it, in this order:
`chat_template.jinja` (the default) and `additional_chat_templates/NAME.jinja`, else
tokenizer_config.json's "chat_template" (a string, or a list of {"name", "template"}). Of named
templates, "tool_use" renders a request that has tools, and "default" the others.

The rendered text is encoded with the model's tokenizer as it stands, special tokens parsed
(transformers' default, and vLLM's): text in a message that spells a special token becomes that
token."""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import os
from typing import Any, Mapping

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox
import jinja2.utils

TEMPLATE_FILE = "chat_template.jinja"
NAMED_TEMPLATES_DIR = "additional_chat_templates"
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# A marker appended to the message that continue_final_message leaves open: the text is cut where it renders.
CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
RENDER_ARGUMENTS = frozenset({"messages", "tools", "documents", "add_generation_prompt", "continue_final_message"})


class ChatTemplateError(ValueError):
    """The template refused these messages (its raise_exception), or failed on them."""


@dataclasses.dataclass(frozen=True)
class ChatTemplate:
    """A checkpoint's chat templates (name -> Jinja source; "default" for a lone one) and the
    special tokens they may name."""

    templates: dict[str, str]
    special_tokens: dict[str, str] = dataclasses.field(default_factory=dict)

    @classmethod
    def from_dir(cls, directory: str) -> ChatTemplate | None:
        """The template a checkpoint directory holds, or None if it holds none."""
        templates = {}
        if os.path.exists(path := os.path.join(directory, TEMPLATE_FILE)):
            templates["default"] = read_text(path)
        named_dir = os.path.join(directory, NAMED_TEMPLATES_DIR)
        if os.path.isdir(named_dir):
            for name in sorted(os.listdir(named_dir)):
                if name.endswith(".jinja"):
                    templates[name.removesuffix(".jinja")] = read_text(os.path.join(named_dir, name))
        if not templates:  # files take priority over the config's entry, as in transformers
            entry = read_json(os.path.join(directory, "tokenizer_config.json")).get("chat_template")
            if isinstance(entry, str):
                templates["default"] = entry
            elif isinstance(entry, list):
                templates = {t["name"]: t["template"] for t in entry}
        if not templates:
            return None
        return cls(templates, special_tokens_in(directory))

    @classmethod
    def from_file(cls, path: str, directory: str | None = None) -> ChatTemplate:
        """A template file given by hand (`--chat-template`), with the special tokens of a checkpoint
        directory's tokenizer config (none without one)."""
        return cls({"default": read_text(path)}, special_tokens_in(directory) if directory else {})

    def source(self, tools: list | None = None) -> str:
        if tools is not None and "tool_use" in self.templates:
            return self.templates["tool_use"]
        if "default" in self.templates:
            return self.templates["default"]
        raise ChatTemplateError(f"the checkpoint has chat templates {sorted(self.templates)} and none named default")

    def render(self, messages: list[dict], *, add_generation_prompt: bool = False,
               continue_final_message: bool = False, tools: list | None = None, documents: list | None = None,
               variables: Mapping[str, Any] | None = None) -> str:
        """The prompt text of messages (dicts with a "role" and usually a "content"; keys whose value
        is None are dropped, as transformers drops them). add_generation_prompt: end with the header of
        the assistant's reply. continue_final_message: leave the last message open, for the model to
        go on with it (the two exclude each other). variables: more template variables (GLM's
        enable_thinking, ...), over the special tokens of the same name; not the arguments above."""
        variables = dict(variables or {})
        if taken := sorted(set(variables) & RENDER_ARGUMENTS):
            raise ChatTemplateError(f"template variables (chat_template_kwargs) may not set {', '.join(taken)}: "
                                    "they are render's own arguments")
        if add_generation_prompt and continue_final_message:
            raise ChatTemplateError("add_generation_prompt and continue_final_message exclude each other")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise ChatTemplateError("messages must be a non-empty list of objects")
        messages = [with_reasoning_aliases({k: v for k, v in m.items() if v is not None}) for m in messages]
        final = None
        if continue_final_message:
            final = messages[-1].get("content")
            if not isinstance(final, str):
                raise ChatTemplateError("continue_final_message needs the last message's content as a string")
            messages[-1] = {**messages[-1], "content": final + CONTINUE_TAG}
        try:
            text = compiled(self.source(tools)).render({  # a dict: a variable may be named self
                **self.special_tokens, **variables, "messages": messages, "tools": tools, "documents": documents,
                "add_generation_prompt": add_generation_prompt})
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"the chat template refused these messages: {e}") from e
        except Exception as e:  # noqa: BLE001 - a template indexing a field these messages lack, ...
            raise ChatTemplateError(f"the chat template failed on these messages: {e!r}") from e
        return text if final is None else cut_at_tag(text, final)


def cut_at_tag(text: str, final: str) -> str:
    """The rendered text up to where the open final message ends (transformers' rule: the marker
    with its space if the template kept it, else the text before it less trailing space)."""
    at = text.rfind(CONTINUE_TAG.strip())
    if at < 0 or final.strip() not in text:
        raise ChatTemplateError("continue_final_message: the chat template does not render the last message's "
                                "content as given, so it cannot be left open")
    return text[:at] if text[at:at + len(CONTINUE_TAG)] == CONTINUE_TAG else text[:at].rstrip()


REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")  # reasoning_content is what templates read


def with_reasoning_aliases(message: dict) -> dict:
    """A message's reasoning under every name templates read it by (transformers 5 does the same:
    GLM's and Kimi's templates read reasoning_content, gpt-oss's thinking)."""
    reasoning = next((message[k] for k in REASONING_FIELDS if message.get(k) is not None), None)
    return message if reasoning is None else {"thinking": reasoning, **message, "reasoning_content": reasoning}


def special_tokens_in(directory: str) -> dict[str, str]:
    """A checkpoint's named special tokens as text: tokenizer_config.json's, else
    special_tokens_map.json's (each a string, or an AddedToken's {"content": ...})."""
    config = read_json(os.path.join(directory, "tokenizer_config.json"))
    legacy = read_json(os.path.join(directory, "special_tokens_map.json"))
    tokens = {}
    for name in SPECIAL_TOKEN_NAMES:
        value = config.get(name, legacy.get(name))
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            tokens[name] = value
    return tokens


class GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: marks the assistant's text for training masks in
    transformers; rendering keeps the body as it is (in a scope of its own, as there)."""
    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


class Namespace(jinja2.utils.Namespace):
    """Jinja's namespace() without underscore names, which could reach Python's internals."""

    def __init__(*args, **kwargs):  # Jinja's signature: namespace(self=...) stays a plain attribute
        self, attrs = args[0], dict(*args[1:], **kwargs)
        for name in attrs:
            Namespace.check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        Namespace.check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def check(name) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a chat template may not set {name!r} on a namespace")


def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # Jinja's own tojson escapes HTML characters, which the templates were not trained with.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@functools.lru_cache(maxsize=16)
def compiled(source: str) -> jinja2.Template:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                      extensions=[GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, namespace=Namespace,
                       strftime_now=lambda fmt: datetime.datetime.now().strftime(fmt))
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"the chat template is not valid Jinja: {e} (line {e.lineno})") from e


def read_text(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def read_json(path: str) -> dict:
    if not os.path.exists(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)
