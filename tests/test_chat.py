"""Chat templates (mixserve/chat.py) against transformers' `apply_chat_template`, the reference:
the same text and the same token ids for random conversations, on templates written here in the
styles of GLM's and Kimi's (special-token headers, namespaces, tojson tools, raise_exception,
reasoning, loop controls, {% generation %}), and the same choice of template where a checkpoint
keeps several. Each checkpoint is a tokenizer.json trained here with those special tokens."""

import json
import os

import pytest
import tokenizers
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer

import hf_reference as ref
import mixserve
from mixserve import run
from mixserve.chat import ChatTemplate, ChatTemplateError
from mixserve.quantize import plan_for, quantize_checkpoint
from mixserve.replies import ReplyFormat, ReplyParser
from mixserve.tokenizer import HFTokenizer
from models.weights import WeightFormat

SPECIALS = ["<|endoftext|>", "[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>",
            "<think>", "</think>", "<|im_system|>", "<|im_user|>", "<|im_assistant|>", "<|im_middle|>", "<|im_end|>"]

GLM_STYLE = """[gMASK]<sop>
{%- if tools -%}
<|system|>
# Tools
{% for tool in tools %}
{{ tool | tojson }}
{% endfor %}
{%- endif -%}
{%- set ns = namespace(last_user=-1) -%}
{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}{%- endfor -%}
{% for m in messages %}
{%- if m.role == 'system' -%}
<|system|>
{{ m.content }}
{%- elif m.role == 'user' -%}
<|user|>
{{ m.content }}
{%- elif m.role == 'assistant' -%}
<|assistant|>
{%- if loop.index0 > ns.last_user and m.reasoning_content is defined -%}
<think>{{ m.reasoning_content.strip() }}</think>
{%- else -%}
<think></think>
{%- endif %}
{{ m.content.strip() if m.content is defined else '' }}
{%- else -%}
{{ raise_exception('unknown role ' + m.role) }}
{%- endif -%}
{% endfor %}
{%- if add_generation_prompt -%}
<|assistant|>
{%- if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}
{%- endif -%}"""

KIMI_STYLE = """{%- for message in messages -%}
{%- if loop.first and message.role != 'system' -%}<|im_system|>system<|im_middle|>You are Kimi.<|im_end|>{%- endif -%}
{%- if message.role not in ['system', 'user', 'assistant'] -%}{{ raise_exception('bad role: ' ~ message.role) }}{%- endif -%}
<|im_{{ message.role }}|>{{ message.name if message.name is defined else message.role }}<|im_middle|>
{%- if message.content is string -%}{{ message.content }}
{%- else -%}{% for part in message.content %}{% if part.type == 'text' %}{{ part.text }}{% endif %}{% endfor %}{%- endif -%}
<|im_end|>
{%- endfor -%}
{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}"""

# trim_blocks and lstrip_blocks at work (no "-" anywhere), loop controls, dict(), {% generation %}.
PLAIN_STYLE = """{{ bos_token }}{% for m in messages %}
  {% if m.role == 'system' %}{% continue %}{% endif %}
{{ m.role | upper }}: {% if m.role == 'assistant' %}{% generation %}{{ m.content }}{{ eos_token }}{% endgeneration %}{% else %}{{ m.content }}{% endif %}

  {% if loop.index > 4 %}{% break %}{% endif %}
{% endfor %}
{% set meta = dict(n=messages|length) %}
{% if add_generation_prompt %}ASSISTANT ({{ meta.n }}):{% endif %}"""

TEMPLATES = {"glm": GLM_STYLE, "kimi": KIMI_STYLE, "plain": PLAIN_STYLE}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "天气 & <weather>",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


def tokenizer_json() -> str:
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=SPECIALS, show_progress=False)
    tok.train_from_iterator(["the user asks the assistant about the weather in Paris"] * 5, trainer)
    return tok.to_str()


def write_checkpoint(directory, chat_template=None, **files) -> str:
    """A tokenizer directory: tokenizer.json, a tokenizer_config.json (with chat_template if given)
    and more files (name -> text; a name with "/" in a folder)."""
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "tokenizer.json"), "w") as f:
        f.write(tokenizer_json())
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<sop>",
              "eos_token": {"content": "<|endoftext|>", "__type": "AddedToken"}}
    if chat_template is not None:
        config["chat_template"] = chat_template
    files = {"tokenizer_config.json": json.dumps(config), **files}
    for name, text in files.items():
        os.makedirs(os.path.dirname(os.path.join(directory, name)), exist_ok=True)
        with open(os.path.join(directory, name), "w") as f:
            f.write(text)
    return str(directory)


@pytest.fixture(scope="module", params=sorted(TEMPLATES))
def checkpoint(request, tmp_path_factory):
    """(ours, transformers' tokenizer, our tokenizer) of a directory with that template."""
    path = write_checkpoint(tmp_path_factory.mktemp(request.param), TEMPLATES[request.param])
    return ChatTemplate.from_dir(path), AutoTokenizer.from_pretrained(path), HFTokenizer(f"{path}/tokenizer.json")


def ours(render):
    """What our render gives: its text, or "raised" for a ChatTemplateError (any other error fails)."""
    try:
        return render()
    except ChatTemplateError:
        return "raised"


def theirs(render):
    """What transformers' gives: its text, or "raised" (a TemplateError, or a ValueError of its own)."""
    try:
        return render()
    except Exception:  # noqa: BLE001
        return "raised"


# Text pieces that trip renderers up: special-token spellings, Jinja syntax, whitespace, non-ASCII.
PIECES = ["the", " weather", "Paris", " ", "  ", "\n", "\t", "é", "你好", "🙂", "<|user|>", "</think>", "<|im_end|>",
          "{{ x }}", "{% if %}", "\\n", '"', "'"]
TEXT = st.lists(st.sampled_from(PIECES), max_size=8).map("".join)
MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "user", "assistant", "assistant"]),
                                 "content": TEXT}, optional={"reasoning_content": TEXT, "reasoning": TEXT})
CONVERSATION = st.lists(MESSAGE, min_size=1, max_size=5)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(messages=CONVERSATION, add=st.booleans(), tools=st.sampled_from([None, TOOLS]),
       thinking=st.sampled_from([None, True, False]))
def test_a_conversation_renders_and_encodes_as_transformers_does(checkpoint, messages, add, tools, thinking):
    template, hf, tok = checkpoint
    variables = {} if thinking is None else {"enable_thinking": thinking}
    text = ours(lambda: template.render(messages, add_generation_prompt=add, tools=tools, variables=variables))
    expected = theirs(lambda: hf.apply_chat_template(messages, add_generation_prompt=add, tools=tools,
                                                       tokenize=False, **variables))
    assert text == expected
    if isinstance(text, str):
        ids = hf.apply_chat_template(messages, add_generation_prompt=add, tools=tools, tokenize=True,
                                     return_dict=False, **variables)
        assert tok.encode(text) == ids
        assert ids  # every template here writes a header


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(messages=CONVERSATION, last=TEXT)
def test_continue_final_message_leaves_the_reply_open_as_transformers_does(checkpoint, messages, last):
    template, hf, _ = checkpoint
    messages = [*messages, {"role": "assistant", "content": last}]
    assert (ours(lambda: template.render(messages, continue_final_message=True)) ==
            theirs(lambda: hf.apply_chat_template(messages, continue_final_message=True, tokenize=False)))


def test_continue_final_message_ends_at_the_open_reply():
    t = ChatTemplate({"default": KIMI_STYLE})
    text = t.render([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "The weather in"}],
                    continue_final_message=True)
    assert text.endswith("<|im_assistant|>assistant<|im_middle|>The weather in")
    with pytest.raises(ChatTemplateError, match="exclude each other"):
        t.render([{"role": "user", "content": "hi"}], continue_final_message=True, add_generation_prompt=True)


def test_a_template_refusal_and_a_bad_template_are_named():
    with pytest.raises(ChatTemplateError, match="bad role: tool"):
        ChatTemplate({"default": KIMI_STYLE}).render([{"role": "tool", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="not valid Jinja"):
        ChatTemplate({"default": "{% for m in messages %}"}).render([{"role": "user", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="non-empty list"):
        ChatTemplate({"default": KIMI_STYLE}).render([])
    with pytest.raises(ChatTemplateError, match="may not set add_generation_prompt, messages"):
        ChatTemplate({"default": KIMI_STYLE}).render([{"role": "user", "content": "x"}],
                                                     variables={"messages": [], "add_generation_prompt": True})
    assert ChatTemplate({"default": "{{ brief }}"}).render(  # any other name, self (Jinja's own) too
        [{"role": "user", "content": "x"}], variables={"self": 1, "brief": True}) == "True"


def test_the_sandbox_holds():
    """The template is the checkpoint's code: it may not reach Python's internals, nor change its inputs."""
    escapes = ["{{ messages.__class__.__mro__ }}", "{{ ''.__class__.__subclasses__() }}",
               "{% set ns = namespace() %}{% set ns._x = 1 %}", "{{ messages.append(1) }}"]
    for source in escapes:
        with pytest.raises(ChatTemplateError):
            ChatTemplate({"default": source}).render([{"role": "user", "content": "x"}])


def test_none_fields_are_dropped_and_special_tokens_are_variables():
    t = ChatTemplate({"default": "{{ bos_token }}{% for m in messages %}[{{ m.name | default('-') }}]{% endfor %}"},
                     {"bos_token": "<s>"})
    assert t.render([{"role": "user", "content": "x", "name": None}]) == "<s>[-]"
    assert t.render([{"role": "user", "content": "x", "name": "ann"}], variables={"bos_token": "<b>"}) == "<b>[ann]"


TOOL_USE = "TOOLS {{ tools | length }}{% for m in messages %}|{{ m.content }}{% endfor %}"
DEFAULT = "PLAIN{% for m in messages %}|{{ m.content }}{% endfor %}"


@pytest.mark.parametrize("layout", ["config_list", "files"])
def test_named_templates_are_chosen_as_transformers_chooses(tmp_path, layout):
    """tool_use for a request with tools, default for the others; files over the config's entry."""
    if layout == "config_list":
        path = write_checkpoint(tmp_path, [{"name": "default", "template": DEFAULT},
                                           {"name": "tool_use", "template": TOOL_USE}])
    else:
        path = write_checkpoint(tmp_path, "CONFIG'S{{ messages | length }}", **{
            "chat_template.jinja": DEFAULT, "additional_chat_templates/tool_use.jinja": TOOL_USE})
    template, hf = ChatTemplate.from_dir(path), AutoTokenizer.from_pretrained(path)
    messages = [{"role": "user", "content": "hi"}]
    for tools in (None, TOOLS):
        expected = hf.apply_chat_template(messages, tools=tools, tokenize=False)
        assert template.render(messages, tools=tools) == expected
        assert expected.startswith("TOOLS 1" if tools else "PLAIN")


def test_a_checkpoint_without_a_template_has_none_and_a_loaded_model_has_its_own(tmp_path):
    assert ChatTemplate.from_dir(write_checkpoint(tmp_path / "none")) is None
    path = tmp_path / "model"
    ref.save(ref.build("glm4-plain"), path)
    write_checkpoint(path, GLM_STYLE)
    model = mixserve.load(str(path), dtype="float32", progress=False)
    ids = model.tokenizer.encode(model.chat_template.render([{"role": "user", "content": "hi"}],
                                                            add_generation_prompt=True))
    assert ids == AutoTokenizer.from_pretrained(str(path)).apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=True, return_dict=False)
    assert model.tokenizer.decode(ids).startswith("[gMASK]<sop><|user|>\nhi<|assistant|>")


def test_a_quantized_copy_keeps_the_checkpoints_templates(tmp_path):
    """mixserve.quantize copies the template files (a folder of named ones too) with the tokenizer."""
    src = tmp_path / "bf16"
    ref.save(ref.build("glm4-plain"), src)
    write_checkpoint(src, **{"chat_template.jinja": DEFAULT, "additional_chat_templates/tool_use.jinja": TOOL_USE})
    quantize_checkpoint(str(src), str(tmp_path / "int4"), plan_for(WeightFormat("int4", 32), "experts"))
    template = mixserve.load(str(tmp_path / "int4"), dtype="float32", progress=False).chat_template
    assert template == ChatTemplate.from_dir(str(src)) and sorted(template.templates) == ["default", "tool_use"]


def test_run_chat_renders_each_prompt_as_a_users_message(tmp_path, capsys):
    """`mixserve.run --chat`: the prompt is the template's rendering of one user message; the reply
    is read for reasoning as the server reads it; a model without a template is a usage error."""
    path = tmp_path / "model"
    ref.save(ref.build("glm4-plain", vocab_size=400), path)  # the tokenizer's
    write_checkpoint(path, GLM_STYLE)
    flags = ["--model", str(path), "--max-new-tokens", "3", "--json", "--kv-memory", "64KiB"]
    report = run.main([*flags, "--chat", "--prompt", "weather in Paris?"])
    (r,) = report["requests"]
    ours_text = ChatTemplate.from_dir(str(path)).render([{"role": "user", "content": "weather in Paris?"}],
                                                        add_generation_prompt=True)
    rendered = AutoTokenizer.from_pretrained(str(path)).apply_chat_template(
        [{"role": "user", "content": "weather in Paris?"}], add_generation_prompt=True, tokenize=True, return_dict=False)
    assert r["prompt_tokens"] == len(rendered) and r["status"] == "ok"
    read = ReplyParser.for_request(ReplyFormat(reasoning=True), ours_text, None).parse(r["text"], final=True)
    assert (r["content"], r["reasoning_content"]) == (read.content, read.reasoning or None)  # it writes </think>
    plain = run.main([*flags, "--prompt", "weather in Paris?"])["requests"][0]
    assert plain["prompt_tokens"] < len(rendered) and "content" not in plain
    os.remove(path / "tokenizer_config.json")
    with pytest.raises(SystemExit):
        run.main([*flags, "--chat"])
    assert "has none" in capsys.readouterr().err
