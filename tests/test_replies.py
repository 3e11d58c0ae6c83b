"""Reading a chat reply's reasoning and tool calls (mixserve/replies.py): Kimi K2's and GLM's
markup read into OpenAI's fields, a call that does not read kept as text, and any split of any
reply into stream chunks adding up to the whole reply."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mixserve.replies import GLM45, KIMI_K2, ReplyFormat, ReplyParser, ReplyStream, ToolCall

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}
KIMI_CALL = ("<|tool_call_begin|>functions.get_weather:{i}<|tool_call_argument_begin|>"
             '{{"city": "{city}", "days": 3}}<|tool_call_end|>')


def kimi_calls(*cities: str) -> str:
    calls = "".join(KIMI_CALL.format(i=i, city=c) for i, c in enumerate(cities))
    return f"<|tool_calls_section_begin|>{calls}<|tool_calls_section_end|>"


def parser(calls=None, reasoning=True, prompt="<|assistant|>", tools=(WEATHER,)) -> ReplyParser:
    return ReplyParser.for_request(ReplyFormat(reasoning, calls), prompt, list(tools) or None)


def test_kimi_calls_keep_the_models_ids_and_arguments():
    reply = parser(KIMI_K2).parse("<think> weather? </think>\n\nLet me look." + kimi_calls("Beijing", "Paris"), True)
    assert reply.reasoning == "weather?" and reply.content == "Let me look."
    assert reply.tool_calls == (ToolCall("functions.get_weather:0", "get_weather", '{"city": "Beijing", "days": 3}'),
                                ToolCall("functions.get_weather:1", "get_weather", '{"city": "Paris", "days": 3}'))


@pytest.mark.parametrize("sep", ["\n", ""])  # GLM-4.5 puts newlines between the tags; GLM-4.7 and GLM-5 none
def test_glm_arguments_are_json_unless_the_schema_says_string(sep):
    call = (f"<tool_call>get_weather{sep}<arg_key>city</arg_key>{sep}<arg_value>123</arg_value>{sep}"
            f"<arg_key>days</arg_key>{sep}<arg_value>3</arg_value>{sep}<arg_key>units</arg_key>{sep}"
            f"<arg_value>metric</arg_value>{sep}<arg_key>hours</arg_key><arg_value>[1, 2]</arg_value>{sep}</tool_call>")
    reply = parser(GLM45).parse(f"OK.{sep}{call}{sep}<tool_call>get_weather{sep}</tool_call>", True)
    assert reply.content == "OK." and reply.reasoning == ""
    assert [(c.id, c.name, json.loads(c.arguments)) for c in reply.tool_calls] == [
        (None, "get_weather", {"city": "123", "days": 3, "units": "metric", "hours": [1, 2]}),
        (None, "get_weather", {})]


def test_reasoning_opened_by_the_prompt_runs_from_the_first_character():
    glm47 = parser(GLM45, prompt="<|user|>hi<|assistant|><think>")
    reply = glm47.parse("Plan.</think>Done", True)
    assert (reply.reasoning, reply.content) == ("Plan.", "Done")
    assert glm47.parse("cut short, still thinking", True).reasoning == "cut short, still thinking"
    closed = parser(GLM45, prompt="<|assistant|><think></think>")  # thinking switched off: the model answers
    assert closed.parse("Plan.</think>Done", True).content == "Plan.</think>Done"
    assert parser(reasoning=False).parse("<think>x</think>y", True).content == "<think>x</think>y"


@pytest.mark.parametrize("fmt, bad", [
    (KIMI_K2, "<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{\"a\": "
              "<|tool_call_end|>"),  # arguments that are not JSON
    (KIMI_K2, "<|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>[1]<|tool_call_end|>"),  # not an object
    (KIMI_K2, "<|tool_call_begin|>functions.f:0 {}<|tool_call_end|>"),  # no argument marker
    (GLM45, "<tool_call>get weather</tool_call>"),  # not a name
    (GLM45, "<tool_call>f<arg_key>a</arg_key>stray<arg_value>1</arg_value></tool_call>"),
    (GLM45, "<tool_call>f<arg_key>a</arg_key><arg_value>1</arg_value>"),  # cut short
])
def test_a_call_that_does_not_read_stays_in_the_content(fmt, bad):
    reply = parser(fmt).parse("Here: " + bad, True)
    assert reply.tool_calls == ()
    assert reply.content == "Here: " + bad.replace("<|tool_calls_section_begin|>", "")


def test_without_tools_calls_are_not_read_and_one_call_keeps_the_first():
    text = "x" + kimi_calls("Oslo", "Rome")
    assert parser(KIMI_K2, tools=()).parse(text, True).content == text
    stream = ReplyStream(parser(KIMI_K2), one_call=True)
    message = stream.message(text)
    assert [c["id"] for c in message["tool_calls"]] == ["functions.get_weather:0"] and stream.called
    assert message["content"] == "x" and message["reasoning_content"] is None


# Replies built of pieces that stress the stream: text with the markers' characters, reasoning,
# calls that read and calls that do not, in either family's markup, cut anywhere.
TEXT = st.text(alphabet="ab <>/|_\nthinkol", max_size=12)


@st.composite
def replies(draw):
    fmt = draw(st.sampled_from([KIMI_K2, GLM45]))
    pieces = []
    if draw(st.booleans()):
        pieces.append(f"{draw(st.sampled_from(['', ' ', chr(10)]))}<think>{draw(TEXT)}</think>")
    for _ in range(draw(st.integers(0, 4))):
        kind = draw(st.sampled_from(["text", "call", "bad", "wrapper"]))
        if kind == "text":
            pieces.append(draw(TEXT))
        elif fmt is KIMI_K2:
            body = KIMI_CALL.format(i=len(pieces), city=draw(TEXT).replace("\n", " ").replace('"', ""))
            pieces.append({"call": body, "bad": body.replace("argument_begin", "arg"),
                           "wrapper": draw(st.sampled_from(KIMI_K2.wrappers))}[kind])
        else:
            pieces.append({"call": f"<tool_call>get_weather<arg_key>city</arg_key><arg_value>{draw(TEXT)}</arg_value>"
                                   "</tool_call>",
                           "bad": f"<tool_call>{draw(TEXT)} x</tool_call>", "wrapper": "<tool_call>"}[kind])
    text = "".join(pieces)
    text = text[:draw(st.integers(0, len(text)))] if draw(st.booleans()) else text
    cuts = sorted(draw(st.lists(st.integers(0, len(text)), max_size=12)))
    prompt = draw(st.sampled_from(["<|assistant|>", "<|assistant|><think>"]))
    return fmt, prompt, text, cuts


@settings(max_examples=300, deadline=None)
@given(replies())
def test_any_split_of_any_reply_streams_to_the_whole_reply(case):
    fmt, prompt, text, cuts = case
    read = parser(fmt, prompt=prompt)
    whole = ReplyStream(read).message(text)
    stream = ReplyStream(read)
    deltas = [stream.delta(text[:cut], final=False) for cut in cuts] + [stream.delta(text, final=True)]
    for field in ("content", "reasoning_content"):
        assert ("".join(d.get(field, "") for d in deltas) or None) == whole[field], field
    calls = [c for d in deltas for c in d.get("tool_calls", ())]
    assert [c["index"] for c in calls] == list(range(len(calls)))
    assert [c["function"] for c in calls] == [c["function"] for c in whole.get("tool_calls", ())]
    if fmt is KIMI_K2:
        assert [c["id"] for c in calls] == [c["id"] for c in whole.get("tool_calls", ())]
    assert len({c["id"] for c in calls}) == len(calls)
