"""The OpenAI-compatible server (mixserve/server.py), over real HTTP on a free local port: what it
serves equals what `mixserve.run` serves for the same prompt and flags, streamed or not; a chat
reply is the completion of its messages' rendered prompt; bad input
is a 400 naming the fault and leaves the server serving; a client that goes away has its request
cancelled and its pages freed; an integrity abort is an error, never an answer; an engine that
raises (strict) stops the server."""

import argparse
import contextlib
import http.client
import itertools
import json
import re
import socket
import threading
import time
import types
import uuid

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import mixserve
from mixserve import faults, run, server
from mixserve.checkpoint import generation_sampling_defaults
from mixserve.cors import CorsPolicy
from mixserve.engine import Engine
from mixserve.frontend import Frontend
from mixserve.grammar import Grammars
from mixserve.replies import KIMI_K2
from mixserve.tokenizer import ByteTokenizer

FLAGS = ["--model", "tiny-kimi", "--page-size", "4", "--concurrency", "2"]
PROMPT = "KV cache pages"
NEW = 12
# A chat template as checkpoints write them: a header per message, a role it does not know refused,
# a variable of its own (chat_template_kwargs's), the assistant's header to end with.
CHAT_TEMPLATE = ("{% for m in messages %}"
                 "{% if m.role not in ('system', 'user', 'assistant') %}{{ raise_exception('no role ' + m.role) }}"
                 "{% endif %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% if brief %}Briefly: {% endif %}{% endif %}")
MESSAGES = [{"role": "system", "content": "Be terse."},
            {"role": "user", "content": [{"type": "text", "text": "KV cache"}, {"type": "text", "text": "pages"}]}]
RENDERED = "<system>Be terse.\n<user>KV cache\npages\n<assistant>"  # text parts join with newlines
CHAT = "/v1/chat/completions"


def serving(srv: server.Server) -> server.Server:
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    template = tmp_path_factory.mktemp("chat") / "template.jinja"
    template.write_text(CHAT_TEMPLATE)
    s = serving(server.make_server([*FLAGS, "--port", "0", "--chat-template", str(template)]))
    yield s
    s.close()


@pytest.fixture(scope="module")
def reference():
    """What mixserve.run serves for PROMPT with the same engine flags, greedy."""
    report = run.main([*FLAGS, "--prompt", PROMPT, "--max-new-tokens", str(NEW), "--json", "--logprobs", "2"])
    return report["requests"][0]


def connect(s):
    return http.client.HTTPConnection(*s.server_address[:2], timeout=120)


def post(s, body, path="/v1/completions"):
    with contextlib.closing(connect(s)) as c:
        c.request("POST", path, body if isinstance(body, bytes) else json.dumps(body), {"Content-Type": "application/json"})
        r = c.getresponse()
        return r.status, json.loads(r.read())


def get(s, path):
    with contextlib.closing(connect(s)) as c:
        c.request("GET", path)
        r = c.getresponse()
        return r.status, json.loads(r.read())


def events(s, body, path="/v1/completions") -> list:
    """A streamed completion's server-sent events, parsed ("[DONE]" kept as the string)."""
    with contextlib.closing(connect(s)) as c:
        c.request("POST", path, json.dumps({**body, "stream": True}))
        r = c.getresponse()
        assert r.status == 200 and r.getheader("Content-Type") == "text/event-stream"
        lines = r.read().decode().split("\n\n")
    assert lines[-1] == ""
    assert all(line.startswith("data: ") for line in lines[:-1])
    return [line[6:] if line[6:] == "[DONE]" else json.loads(line[6:]) for line in lines[:-1]]


def greedy(**extra):
    return {"prompt": PROMPT, "max_tokens": NEW, "temperature": 0, **extra}


def chat(**extra):
    return {"messages": MESSAGES, "max_tokens": NEW, "temperature": 0, **extra}


def test_a_completion_is_what_mixserve_run_serves(srv, reference):
    # a salt of its own: it computes its whole prompt as mixserve.run did, whatever ran before it
    status, body = post(srv, greedy(return_token_ids=True, logprobs=2, cache_salt=str(uuid.uuid4())))
    assert status == 200, body
    (choice,) = body["choices"]
    assert choice["token_ids"] == reference["tokens"] and choice["text"] == reference["text"]
    assert choice["prompt_token_ids"] == ByteTokenizer().encode(PROMPT)
    assert choice["finish_reason"] == "length" and choice["stop_reason"] is None
    lp = choice["logprobs"]
    assert lp["token_logprobs"] == pytest.approx([t["logprob"] for t in reference["logprobs"]], abs=1e-6)
    assert [len(top) for top in lp["top_logprobs"]] <= [2] * NEW  # keyed by text: two tokens may share one
    assert len(lp["tokens"]) == len(lp["text_offset"]) == NEW and lp["text_offset"][0] == 0
    assert body["usage"] == {"prompt_tokens": len(PROMPT), "completion_tokens": NEW, "total_tokens": len(PROMPT) + NEW,
                             "prompt_tokens_details": {"cached_tokens": 0}}
    assert body["object"] == "text_completion" and body["model"] == "tiny-kimi"
    _, named = post(srv, greedy(return_tokens_as_token_ids=True, logprobs=1))
    assert named["choices"][0]["logprobs"]["tokens"] == [f"token_id:{t}" for t in reference["tokens"]]
    # logprobs=0: the token's own logprob alone (OpenAI's legacy API lists the sampled token beside the n likeliest)
    _, sampled = post(srv, {"prompt": PROMPT, "max_tokens": 4, "temperature": 5.0, "seed": 3, "logprobs": 0,
                            "return_tokens_as_token_ids": True})
    lp = sampled["choices"][0]["logprobs"]
    assert lp["top_logprobs"] == [{t: v} for t, v in zip(lp["tokens"], lp["token_logprobs"])]


def test_a_streamed_completion_adds_up_to_the_whole_one(srv, reference):
    got = events(srv, greedy(return_token_ids=True, stream_options={"include_usage": True}))
    assert got[-1] == "[DONE]"
    *chunks, usage = got[:-1]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == NEW
    choices = [c["choices"][0] for c in chunks]
    assert "".join(c["text"] for c in choices) == reference["text"]
    assert [t for c in choices for t in c["token_ids"]] == reference["tokens"]
    assert [c["finish_reason"] for c in choices] == [None] * (len(choices) - 1) + ["length"]
    assert len({c["id"] for c in chunks}) == 1
    assert all("usage" in c and c["usage"] is None for c in chunks)  # include_usage: null but in the last (OpenAI's)
    assert all("usage" not in c for c in events(srv, greedy(max_tokens=2))[:-1])
    status, error = post(srv, greedy(stream_options={"include_usage": True}))  # no stream: OpenAI's and vLLM's 400
    assert status == 400 and "stream_options is for a stream" in error["error"]["message"]


def test_a_stop_string_ends_the_text_before_it_and_is_never_streamed(srv, reference):
    text = reference["text"]
    # Two characters, so at least two tokens: the first must be held back until the second decides.
    stop = next(text[i : i + 2] for i in range(1, len(text) - 1) if "\ufffd" not in text[i : i + 2])
    cut = text[: text.find(stop)]
    status, body = post(srv, greedy(stop=[stop, "never produced"]))
    assert status == 200, body
    assert body["choices"][0]["text"] == cut
    assert body["choices"][0]["finish_reason"] == "stop" and body["choices"][0]["stop_reason"] == stop
    choices = [c["choices"][0] for c in events(srv, greedy(stop=stop))[:-1]]
    assert "".join(c["text"] for c in choices) == cut
    assert choices[-1]["finish_reason"] == "stop"


def test_a_list_of_prompts_gets_a_choice_each(srv, reference):
    status, body = post(srv, greedy(prompt=[PROMPT, ByteTokenizer().encode(PROMPT)], return_token_ids=True))
    assert status == 200, body
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert body["choices"][0]["prompt_token_ids"] == body["choices"][1]["prompt_token_ids"]
    assert body["usage"]["completion_tokens"] == 2 * NEW


def lm_eval_loglikelihood(choice: dict, context_tokens: int) -> tuple[float, bool]:
    """What lm-eval's local-completions model reads from an echoed completion (its parse_logprobs):
    the continuation's log-likelihood, and whether each of its tokens was the likeliest."""
    lps = choice["logprobs"]["token_logprobs"][context_tokens:-1]
    tops = choice["logprobs"]["top_logprobs"][context_tokens:-1]
    return sum(lps), all(lp == max(top.values()) for lp, top in zip(lps, tops))


def test_echo_returns_the_prompt_and_its_logprobs_as_lm_eval_scores_them(srv):
    """lm-eval's loglikelihood request (its payload as sent): the prompt is context + continuation,
    and the echoed logprobs score the continuation; they are the engine's prompt logprobs."""
    context, continuation = ByteTokenizer().encode("KV cache"), ByteTokenizer().encode(" pages")
    lm_eval = {"prompt": [context + continuation] * 2, "temperature": 0, "max_tokens": 1, "logprobs": 1, "seed": 1234,
               "echo": True}
    status, body = post(srv, {**lm_eval, "prompt_logprobs": 3, "return_token_ids": True})
    assert status == 200, body
    for choice in body["choices"]:
        tokens = context + continuation
        lp, prompt = choice["logprobs"], [None, *(p[str(t)] for t, p in zip(tokens[1:], choice["prompt_logprobs"][1:]))]
        assert choice["text"] == "KV cache pages" + ByteTokenizer().decode(choice["token_ids"])
        assert lp["tokens"][:14] == list("KV cache pages") and lp["text_offset"] == list(range(15))
        assert lp["token_logprobs"][:14] == [p and p["logprob"] for p in prompt] and lp["token_logprobs"][0] is None
        assert lp["top_logprobs"][0] is None  # logprobs=1: the likeliest, and the token itself (OpenAI's, vLLM's)
        assert all(top[t] == v and len(top) <= 2 for t, v, top in zip(lp["tokens"][1:14], lp["token_logprobs"][1:14],
                                                                      lp["top_logprobs"][1:14]))
        assert max(len(p) for p in choice["prompt_logprobs"][1:]) == 4  # prompt_logprobs=3, and the token's own
        total, likeliest = lm_eval_loglikelihood(choice, len(context))
        assert total == pytest.approx(sum(p["logprob"] for p in prompt[len(context):]))
        assert likeliest == all(p["rank"] == 1 for p in prompt[len(context):])
    assert post(srv, lm_eval)[1]["choices"][0]["logprobs"] == body["choices"][0]["logprobs"]
    chunks = events(srv, {**lm_eval, "prompt": PROMPT, "max_tokens": 4})[:-1]
    _, whole = post(srv, {**lm_eval, "prompt": PROMPT, "max_tokens": 4})
    assert chunks[0]["choices"][0]["text"].startswith(PROMPT)
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["choices"][0]["text"]
    for key in ("tokens", "token_logprobs", "text_offset"):
        assert [x for c in chunks for x in c["choices"][0]["logprobs"][key]] == whole["choices"][0]["logprobs"][key]
    assert post(srv, greedy(echo=True))[1]["choices"][0]["text"].startswith(PROMPT)  # without logprobs: the text
    (more,) = post(srv, greedy(echo=True, max_tokens=1, logprobs=3, prompt_logprobs=1,
                               return_tokens_as_token_ids=True))[1]["choices"]  # named apart
    assert all(len(top) in (3, 4) for top in more["logprobs"]["top_logprobs"][1:])  # the most asked is computed,
    assert all(len(p) <= 2 for p in more["prompt_logprobs"][1:])  # and each field shows what it asked


def test_tokenize_and_detokenize_are_the_completion_endpoints_encoding(srv):
    status, body = post(srv, {"prompt": PROMPT, "add_special_tokens": False}, "/tokenize")
    assert status == 200 and body == {"count": len(PROMPT), "max_model_len": 512,
                                      "tokens": ByteTokenizer().encode(PROMPT)}, body
    _, chat_tokens = post(srv, {"messages": MESSAGES}, "/tokenize")
    _, reply = post(srv, chat(max_tokens=1, return_token_ids=True, prompt_logprobs=1), CHAT)
    # vLLM's chat form: the conversation's prompt fields beside the choices (a completion's are in each choice)
    assert chat_tokens["tokens"] == reply["prompt_token_ids"] == ByteTokenizer().encode(RENDERED)
    assert len(reply["prompt_logprobs"]) == len(chat_tokens["tokens"]) and reply["prompt_logprobs"][0] is None
    assert not {"prompt_token_ids", "prompt_logprobs"} & set(reply["choices"][0]), reply["choices"][0]
    first = events(srv, chat(max_tokens=2, return_token_ids=True), CHAT)[0]
    assert first["prompt_token_ids"] == reply["prompt_token_ids"] and "prompt_token_ids" not in first["choices"][0]
    assert post(srv, {"tokens": body["tokens"]}, "/detokenize") == (200, {"prompt": PROMPT})
    status, info = get(srv, "/tokenizer_info")  # what lm-eval's remote tokenizer checks for
    assert status == 200 and "eos_token" in info and info["chat_template"] == CHAT_TEMPLATE
    for path, bad, message in [("/tokenize", {"prompt": "x", "add_special_tokens": True}, "add_special_tokens=True"),
                               ("/tokenize", {}, "give prompt (a string) or messages"),
                               ("/tokenize", {"prompt": "x", "messages": MESSAGES}, "give prompt"),
                               ("/tokenize", {"prompt": "x", "temperature": 0}, "unknown fields: temperature"),
                               ("/tokenize", {"messages": [{"role": "tool", "content": "1"}]}, "no role tool"),
                               ("/detokenize", {"tokens": [1, -2]}, "tokens must be a list of token ids"),
                               ("/detokenize", {"tokens": [1, True]}, "tokens must be a list of token ids"),
                               ("/detokenize", {"tokens": "12"}, "tokens must be list"),
                               ("/detokenize", {"tokens": [1, 320, 7, 10**6]},
                                "tokens must be ids in [0, 320), the model's vocabulary, got [320, 1000000]")]:
        status, error = post(srv, bad, path)
        assert status == 400 and message in error["error"]["message"], (bad, error)


def test_a_logit_bias_is_served_by_token_id(srv):
    for path, body in (("/v1/completions", greedy(max_tokens=4)), (CHAT, chat(max_tokens=4))):
        for temperature in (0, 1.0):
            status, out = post(srv, {**body, "temperature": temperature, "logit_bias": {"65": 100}}, path)
            (choice,) = out["choices"]
            assert status == 200 and choice.get("text", choice.get("message", {}).get("content")) == "AAAA", out


def test_penalties_are_served_as_mixserve_run_serves_them(srv, reference, capsys):
    """The three penalties through both endpoints: the tokens `mixserve.run` serves with its
    flags of the same values (and says it used), other than the unpenalized ones; out of range,
    a 400 naming them."""
    penalties = {"repetition_penalty": 1.5, "frequency_penalty": 1.0, "presence_penalty": -0.5}
    flags = [f"--{name.replace('_', '-')}={value}" for name, value in penalties.items()]
    report = run.main([*FLAGS, "--prompt", PROMPT, "--max-new-tokens", str(NEW), *flags])
    assert "penalties: repetition 1.5, frequency 1.0, presence -0.5" in capsys.readouterr().out
    assert report["sampling"]["repetition_penalty"] == 1.5 and report["requests"][0]["tokens"] != reference["tokens"]
    status, body = post(srv, greedy(return_token_ids=True, **penalties))
    assert status == 200 and body["choices"][0]["token_ids"] == report["requests"][0]["tokens"], body
    status, body = post(srv, chat(**penalties), CHAT)
    assert status == 200 and body["choices"][0]["message"]["content"], body
    for bad, name in (({"repetition_penalty": 0}, "repetition_penalty > 0"), ({"frequency_penalty": 2.5}, "[-2, 2]"),
                      ({"presence_penalty": "high"}, "presence_penalty must be a finite number"),
                      ({"min_tokens": 17}, "min_tokens must be an integer from 0 to max_tokens ("),
                      ({"skip_special_tokens": "no"}, "skip_special_tokens must be True or False"),
                      ({"allowed_token_ids": []}, "allowed_token_ids must be None or a non-empty list")):
        for path, request in (("/v1/completions", greedy(**bad)), (CHAT, chat(**bad))):
            status, error = post(srv, request, path)
            assert status == 400 and name in error["error"]["message"], (bad, error)


def test_n_samples_are_the_requests_seeded_one_apart(srv):
    """vLLM's rule: with a seed, choice j samples as one request with seed + j; a list of prompts
    gets n choices each, prompt i's j-th at index i * n + j; each prompt's tokens count once."""
    sample = {"max_tokens": 6, "temperature": 1.0, "seed": 11, "return_token_ids": True}
    status, body = post(srv, {"prompt": [PROMPT, "pages"], "n": 3, **sample})
    assert status == 200, body
    assert [c["index"] for c in body["choices"]] == list(range(6))
    for i, prompt in enumerate([PROMPT, "pages"]):
        for j in range(3):
            _, one = post(srv, {"prompt": prompt, **sample, "seed": 11 + j})
            assert body["choices"][3 * i + j]["token_ids"] == one["choices"][0]["token_ids"]
            assert body["choices"][3 * i + j]["prompt_token_ids"] == ByteTokenizer().encode(prompt)
    assert len({tuple(c["token_ids"]) for c in body["choices"][:3]}) > 1  # a random model's samples differ
    # seeds are int64 (vLLM's range): past its largest, seed + j wraps round as a 64-bit counter would
    _, last = post(srv, {"prompt": PROMPT, "n": 2, **sample, "seed": 2**63 - 1})
    for j, seed in enumerate((2**63 - 1, -2**63)):
        _, one = post(srv, {"prompt": PROMPT, **sample, "seed": seed})
        assert last["choices"][j]["token_ids"] == one["choices"][0]["token_ids"], seed
    status, error = post(srv, {"prompt": PROMPT, **sample, "seed": 2**63})
    assert status == 400 and "seed must be an integer in [-2**63, 2**63)" in error["error"]["message"], error
    assert body["usage"]["prompt_tokens"] == len(PROMPT) + len("pages") and body["usage"]["completion_tokens"] == 36
    chunks = events(srv, chat(n=2, seed=3, temperature=1.0, max_tokens=4, stream_options={"include_usage": True}),
                    CHAT)[:-1]
    _, whole = post(srv, chat(n=2, seed=3, temperature=1.0, max_tokens=4), CHAT)
    for j in range(2):
        deltas = [c["choices"][0]["delta"] for c in chunks[:-1] if c["choices"][0]["index"] == j]
        assert deltas[0]["role"] == "assistant"
        assert "".join(d["content"] for d in deltas) == whole["choices"][j]["message"]["content"]
    details = [u.pop("prompt_tokens_details") for u in (chunks[-1]["usage"], whole["usage"])]
    assert chunks[-1]["usage"] == whole["usage"] and whole["usage"]["prompt_tokens"] == len(RENDERED)
    assert details[1] == {"cached_tokens": (len(RENDERED) - 1) // 4 * 4}  # the streamed request's pages (of 4)


def test_a_chat_reply_is_the_completion_of_its_rendered_prompt(srv):
    encode = ByteTokenizer().encode
    # salts of their own: both compute the whole prompt (cached FP8 pages would move logprobs by ~1e-3)
    status, body = post(srv, chat(return_token_ids=True, logprobs=True, top_logprobs=2, cache_salt=str(uuid.uuid4())),
                        CHAT)
    assert status == 200, body
    _, plain = post(srv, greedy(prompt=encode(RENDERED), return_token_ids=True, logprobs=2, cache_salt=str(uuid.uuid4())))
    (choice,), (expected,) = body["choices"], plain["choices"]
    assert choice["message"] == {"role": "assistant", "content": expected["text"]}
    assert body["prompt_token_ids"] == encode(RENDERED) and choice["token_ids"] == expected["token_ids"]
    assert choice["finish_reason"] == "length" and body["usage"] == plain["usage"]
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    content = choice["logprobs"]["content"]  # OpenAI's chat form: a list per token, alternatives as lists
    assert [t["token"] for t in content] == [ByteTokenizer().decode([t]) for t in expected["token_ids"]]
    assert [t["logprob"] for t in content] == pytest.approx(expected["logprobs"]["token_logprobs"], abs=1e-6)
    assert all(len(t["top_logprobs"]) == 2 and t["top_logprobs"][0]["logprob"] == pytest.approx(t["logprob"])
               for t in content)  # greedy: the chosen token is the likeliest
    # each token's own bytes, also where its text alone is U+FFFD (a byte of a character), and none past the bytes
    own = lambda t: [t] if t < 256 else []
    assert [t["bytes"] for t in content] == [own(t) for t in expected["token_ids"]]
    assert all(a["bytes"] == own(ByteTokenizer().encode(a["token"])[0]) for t in content for a in t["top_logprobs"]
               if a["token"] != "\ufffd" and a["token"])


FLAG = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
        "additionalProperties": False, "x-guidance": {"whitespace_flexible": False}}


@pytest.mark.parametrize("stream", [False, True])
def test_response_format_and_structured_outputs_hold_the_reply(srv, stream):
    """OpenAI's response_format (json_schema) on a chat reply, vLLM's structured_outputs (choice,
    regex) on a completion: the text matches and ends on the end token (finish_reason "stop"),
    streamed or not; {"type": "text"} leaves the reply as it was."""
    def text(body, path):
        if not stream:
            status, whole = post(srv, body, path)
            assert status == 200, whole
            (choice,) = whole["choices"]
            return choice.get("text", (choice.get("message") or {}).get("content")), choice["finish_reason"]
        *chunks, done = events(srv, body, path)
        parts = [c["choices"][0] for c in chunks]
        return "".join(p.get("text", p.get("delta", {}).get("content", "")) for p in parts), parts[-1]["finish_reason"]

    schema = {"type": "json_schema", "json_schema": {"name": "flag", "schema": FLAG}}
    reply, finish = text(chat(max_tokens=24, response_format=schema), CHAT)
    assert isinstance(json.loads(reply)["ok"], bool) and finish == "stop", reply
    assert text(chat(response_format={"type": "text"}), CHAT) == text(chat(), CHAT)
    choices = ["KV", "cache", "pages"]
    reply, finish = text(greedy(structured_outputs={"choice": choices}), "/v1/completions")
    assert reply in choices and finish == "stop"
    reply, finish = text(greedy(max_tokens=8, structured_outputs={"regex": "[0-9]{3}"}), "/v1/completions")
    assert len(reply) == 3 and reply.isdigit() and finish == "stop"


def test_a_streamed_chat_reply_adds_up_to_the_whole_one(srv):
    # salts of their own: neither finds the other's (or an earlier test's) pages cached, so their usages agree
    _, whole = post(srv, chat(cache_salt=str(uuid.uuid4())), CHAT)
    got = events(srv, chat(stream_options={"include_usage": True}, cache_salt=str(uuid.uuid4())), CHAT)
    assert got[-1] == "[DONE]"
    *chunks, usage = got[:-1]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[0]["role"] == "assistant" and all("role" not in d for d in deltas[1:])
    assert "".join(d["content"] for d in deltas) == whole["choices"][0]["message"]["content"]
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"} and chunks[-1]["choices"][0]["finish_reason"]
    assert usage["usage"] == whole["usage"]


@pytest.mark.parametrize("extra, prompt", [
    ({"chat_template_kwargs": {"brief": True}}, RENDERED + "Briefly: "),  # the template's own variable
    ({"add_generation_prompt": False}, RENDERED.removesuffix("<assistant>")),
    ({"messages": [*MESSAGES, {"role": "assistant", "content": "Pages"}], "continue_final_message": True},
     RENDERED + "Pages"),  # the reply goes on with the open message, and has no new header
])
def test_the_template_options_shape_the_prompt(srv, extra, prompt):
    status, body = post(srv, chat(max_tokens=1, return_token_ids=True, **extra), CHAT)
    assert status == 200, body
    assert body["prompt_token_ids"] == ByteTokenizer().encode(prompt)


def test_a_chat_reply_without_max_tokens_may_fill_the_context(srv):
    """As in vLLM: the context limit (512, the model's) less the prompt. max_completion_tokens, OpenAI's
    newer name, wins over max_tokens."""
    messages = [{"role": "user", "content": "x" * (512 - len("<user>\n<assistant>") - 5)}]
    status, body = post(srv, {"messages": messages, "temperature": 0, "ignore_eos": True}, CHAT)
    assert status == 200, body
    assert body["usage"]["total_tokens"] == 512 and body["usage"]["completion_tokens"] == 5
    assert body["choices"][0]["finish_reason"] == "length"
    status, body = post(srv, chat(max_tokens=NEW, max_completion_tokens=3, ignore_eos=True), CHAT)
    assert status == 200 and body["usage"]["completion_tokens"] == 3, body


def test_a_model_without_a_chat_template_names_the_flag_that_gives_one():
    served = server.Served("tiny-kimi", ByteTokenizer(), None, 512, 320)
    with pytest.raises(server.BadRequest, match="--chat-template FILE, or POST /v1/completions"):
        server.Completion.parse_chat(chat(), served)


def test_a_port_in_use_fails_before_the_model_loads(capsys):
    """make_server binds first: a port another socket listens on is a usage error at once, naming
    the port, and the model (here a checkpoint path that does not exist) is never read."""
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        with pytest.raises(SystemExit) as exit_:
            server.make_server(["--model", "/no/such/checkpoint", "--host", "127.0.0.1", "--port", str(port)])
    assert exit_.value.code == 2
    assert f"cannot listen on --host 127.0.0.1 --port {port}: Address already in use" in capsys.readouterr().err


class Scripted(Frontend):
    """An engine whose every request replies `reply` (its UTF-8 bytes: the tiny presets' tokens) and
    then EOS, two tokens a step: the server's side of a reply, without a model to write it."""
    EOS = 300

    def __init__(self, reply: str = "", tokenizer=ByteTokenizer()):
        super().__init__()
        self.counters, self.reply, self.live = types.SimpleNamespace(rejections=0), reply, []
        self.tokenizer = tokenizer  # the reply's tokens are its encoding
        self.grammars = Grammars(ByteTokenizer(), 320, (self.EOS,))  # a structured reply is checked as it comes

    def _reject_reason(self, req):
        return None

    def _enqueue(self, req):
        self.live.append(req)

    def _drop(self, req):
        self.live.remove(req)

    def _advance(self):
        script = [*self.tokenizer.encode(self.reply), self.EOS]
        for req in list(self.live):
            for token in script[len(req.out):len(req.out) + 2]:
                req.accept(token, time.perf_counter(), (self.EOS,), tokenizer=self.tokenizer)
            if req.result is not None:
                self.live.remove(req)


# Chat templates as Kimi K2's and GLM-4.7's write a turn: the tools declared, reasoning, and calls
# in their families' markup, ids and arguments as given (Kimi) or arguments iterated (GLM); GLM's
# generation prompt opens <think> unless thinking is switched off.
KIMI_TEMPLATE = ("{% if tools %}<|im_system|>tools<|im_middle|>{{ tools | tojson }}<|im_end|>{% endif %}"
                 "{% for m in messages %}<|im_{{ m.role }}|>{% if m.reasoning_content %}<think>{{ m.reasoning_content }}"
                 "</think>{% endif %}{{ m.content or '' }}{% if m.tool_calls %}<|tool_calls_section_begin|>"
                 "{% for c in m.tool_calls %}<|tool_call_begin|>{{ c.id }}<|tool_call_argument_begin|>"
                 "{{ c.function.arguments if c.function.arguments is string else c.function.arguments | tojson }}"
                 "<|tool_call_end|>{% endfor %}<|tool_calls_section_end|>{% endif %}<|im_end|>{% endfor %}"
                 "{% if add_generation_prompt %}<|im_assistant|>{% endif %}")
GLM_TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content or '' }}{% for c in m.tool_calls or [] %}"
                "<tool_call>{{ c.function.name }}{% for k, v in c.function.arguments.items() %}<arg_key>{{ k }}"
                "</arg_key><arg_value>{{ v if v is string else v | tojson }}</arg_value>{% endfor %}</tool_call>"
                "{% endfor %}{% endfor %}{% if add_generation_prompt %}<|assistant|>"
                "{{ '<think></think>' if enable_thinking is defined and not enable_thinking else '<think>' }}{% endif %}")
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}]
ASK = [{"role": "user", "content": "Weather in Oslo?"}]
KIMI_REPLY = ("<think>Look it up.</think>Checking.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
              '<|tool_call_argument_begin|>{"city": "Oslo", "days": 2}<|tool_call_end|><|tool_calls_section_end|>')
GLM_REPLY = "Look it up.</think>Checking.<tool_call>get_weather<arg_key>city</arg_key><arg_value>Oslo</arg_value>" \
            "<arg_key>days</arg_key><arg_value>2</arg_value></tool_call>"


@contextlib.contextmanager
def scripted_server(template: str, reply: str, api_key: str | None = None, cors=CorsPolicy(), tokenizer=ByteTokenizer(),
                    **parsers):
    chat_template = mixserve.chat.ChatTemplate({"default": template})
    flags = argparse.Namespace(**{"reasoning_parser": "auto", "tool_call_parser": "auto", **parsers})
    served = server.Served("scripted", tokenizer, chat_template, 4096, 256, server.reply_format(flags, chat_template))
    s = serving(server.Server(("127.0.0.1", 0), Scripted(reply, tokenizer), served, api_key=api_key, cors=cors))
    try:
        yield s
    finally:
        s.close()


@pytest.mark.parametrize("template, reply", [(KIMI_TEMPLATE, KIMI_REPLY), (GLM_TEMPLATE, GLM_REPLY)],
                         ids=["kimi_k2", "glm45"])
def test_a_reply_calling_a_tool_is_read_into_tool_calls_streamed_or_not(template, reply):
    body = {"messages": ASK, "tools": TOOLS, "return_token_ids": True}
    with scripted_server(template, reply) as s:
        status, whole = post(s, body, CHAT)
        assert status == 200, whole
        (choice,) = whole["choices"]
        assert choice["finish_reason"] == "tool_calls"
        (call,) = choice["message"].pop("tool_calls")
        assert choice["message"] == {"role": "assistant", "content": "Checking.", "reasoning_content": "Look it up."}
        assert call["type"] == "function" and call["function"] == {"name": "get_weather",
                                                                   "arguments": '{"city": "Oslo", "days": 2}'}
        assert call["id"] == "functions.get_weather:0" if template is KIMI_TEMPLATE else call["id"].startswith("call_")
        prompt = ByteTokenizer().decode(whole["prompt_token_ids"])
        assert ('"name": "get_weather"' in prompt) == (template is KIMI_TEMPLATE)  # the tools, declared
        chunks = events(s, body, CHAT)[:-1]  # two bytes a step: the markers arrive in pieces
        deltas = [c["choices"][0]["delta"] for c in chunks]
        assert deltas[0]["role"] == "assistant" and chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
        for field in ("content", "reasoning_content"):
            assert "".join(d.get(field, "") for d in deltas) == choice["message"][field]
        (streamed,) = [c for d in deltas for c in d.get("tool_calls", ())]
        assert streamed["index"] == 0 and streamed["function"] == call["function"]
        # The call, sent back as the client got it, is written into the next prompt as the model wrote it.
        history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call]},
                   {"role": "tool", "tool_call_id": call["id"], "content": "sunny"}]
        status, again = post(s, {"messages": history, "tools": TOOLS, "return_token_ids": True}, CHAT)
        markup = reply[reply.index("<|tool_calls" if template is KIMI_TEMPLATE else "<tool_call>"):]
        assert markup in ByteTokenizer().decode(again["prompt_token_ids"]), again


class WithSpecials(ByteTokenizer):
    """Bytes, and each of `texts` a token of its own (ids from 301), as a real tokenizer holds a chat
    format's markers; special_ids: those of `special`, the ones HF's skip_special_tokens skips."""

    def __init__(self, texts, special):
        self.ids = {t: 301 + i for i, t in enumerate(texts)}
        self.special_ids = frozenset(self.ids[t] for t in special)
        self.pattern = re.compile("|".join(map(re.escape, texts)))

    def encode(self, text):
        pieces = self.pattern.split(text)  # the text between markers, then each marker in its place
        markers = [self.ids[m] for m in self.pattern.findall(text)]
        as_bytes = ByteTokenizer().encode
        return [*as_bytes(pieces[0]), *(t for m, piece in zip(markers, pieces[1:]) for t in (m, *as_bytes(piece)))]

    def decode(self, ids):
        names = {i: t for t, i in self.ids.items()}
        runs = itertools.groupby(ids, lambda t: t in names)
        return "".join("".join(names[t] for t in run) if named else ByteTokenizer().decode(list(run))
                       for named, run in runs)


def test_special_tokens_leave_the_text_but_the_markup_its_reply_is_read_for():
    """vLLM's skip_special_tokens, true by default: a special token is left out of the text (here
    one inside the content; an added token not special stays), but a chat reply keeps the markup
    its parser reads (Kimi's <think> and tool-call markers, special tokens all) and takes it out; a
    completion, read for nothing, loses the markers too. skip_special_tokens false keeps them; the
    token ids keep every token."""
    markup = ["<think>", "</think>", *KIMI_K2.markup]
    tok = WithSpecials([*markup, "<|im_middle|>", "<|im_user|>"], special=[*markup, "<|im_middle|>"])
    reply = KIMI_REPLY.replace("Checking.", "Check<|im_middle|>ing<|im_user|>.")
    with scripted_server(KIMI_TEMPLATE, reply, tokenizer=tok) as s:
        for skip, content in ((None, "Checking<|im_user|>."), (False, "Check<|im_middle|>ing<|im_user|>.")):
            body = {"messages": ASK, "tools": TOOLS, **({} if skip is None else {"skip_special_tokens": skip})}
            status, whole = post(s, body, CHAT)
            assert status == 200, whole
            message = whole["choices"][0]["message"]
            (call,) = message.pop("tool_calls")
            assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo", "days": 2}'}
            assert message == {"role": "assistant", "content": content, "reasoning_content": "Look it up."}, skip
            deltas = [c["choices"][0]["delta"] for c in events(s, body, CHAT)[:-1]]
            assert "".join(d.get("content", "") for d in deltas) == content
        bare = "Look it up.Checking<|im_user|>.functions.get_weather:0" + '{"city": "Oslo", "days": 2}'
        for skip, text in ((None, bare), (False, reply)):
            body = {"prompt": "x", "max_tokens": 500, "return_token_ids": True,
                    **({} if skip is None else {"skip_special_tokens": skip})}
            status, whole = post(s, body)
            assert status == 200 and whole["choices"][0]["text"] == text, whole
            assert whole["choices"][0]["token_ids"] == [*tok.encode(reply), Scripted.EOS]
            assert "".join(c["choices"][0]["text"] for c in events(s, body)[:-1]) == text


def test_truncate_prompt_tokens_keeps_a_prompts_last_tokens():
    """vLLM's truncate_prompt_tokens: each prompt (text, ids, a chat's rendering) keeps its last k
    tokens, which usage and echo count and show; -1 is the context limit; past it, 0, or not an
    integer is a 400 that names the field."""
    with scripted_server(KIMI_TEMPLATE, "ok") as s:
        body = {"prompt": ["abcdefgh", [1, 2, 3]], "max_tokens": 4, "return_token_ids": True, "echo": True}
        for keep, kept in ((3, ["fgh", "\x01\x02\x03"]), (-1, ["abcdefgh", "\x01\x02\x03"])):
            status, whole = post(s, {**body, "truncate_prompt_tokens": keep})
            assert status == 200, whole
            assert [c["prompt_token_ids"] for c in whole["choices"]] == [list(k.encode()) for k in kept]
            assert [c["text"] for c in whole["choices"]] == [k + "ok" for k in kept]  # echo: the prompt kept
            assert whole["usage"]["prompt_tokens"] == sum(map(len, kept))
        status, whole = post(s, {"messages": ASK, "truncate_prompt_tokens": 5, "return_token_ids": True}, CHAT)
        assert status == 200 and whole["prompt_token_ids"] == list(b"ant|>"), whole  # the rendering's last 5
        for keep in (0, -2, 4097, "3", True, 2.0):
            for path, request in (("/v1/completions", {"prompt": "abc", "truncate_prompt_tokens": keep}),
                                  (CHAT, {"messages": ASK, "truncate_prompt_tokens": keep})):
                status, error = post(s, request, path)
                assert status == 400 and "truncate_prompt_tokens must be -1" in error["error"]["message"], keep


FORCED = [("required", '[{"name": "get_weather", "parameters": {"city": "Oslo", "days": 2}}]', "tool_calls"),
          ({"type": "function", "function": {"name": "get_weather"}}, '{"city": "Oslo", "days": 2}', "stop")]


@pytest.mark.parametrize("tool_choice, answer, finish", FORCED, ids=["required", "named"])
def test_a_forced_tool_call_is_read_from_its_json_streamed_or_not(tool_choice, answer, finish):
    """tool_choice "required" (a list of {name, parameters}) or a named function (its arguments):
    after the free reasoning, the answer is held to forced_calls_schema (the scripted engine's
    tokens pass through the matcher: "Checking." before the JSON would abort it) and read into
    tool_calls, whatever the family's markup; a named call finishes as "stop", as OpenAI's does."""
    body = {"messages": ASK, "tools": TOOLS, "tool_choice": tool_choice}
    with scripted_server(GLM_TEMPLATE, "Look it up.</think>" + answer) as s:
        status, whole = post(s, body, CHAT)
        assert status == 200, whole
        (choice,) = whole["choices"]
        (call,) = choice["message"].pop("tool_calls")
        assert choice["message"] == {"role": "assistant", "content": None, "reasoning_content": "Look it up."}
        assert json.loads(call["function"]["arguments"]) == {"city": "Oslo", "days": 2}
        assert call["function"]["name"] == "get_weather" and choice["finish_reason"] == finish
        chunks = events(s, body, CHAT)[:-1]
        deltas = [c["choices"][0]["delta"] for c in chunks]
        (streamed,) = [c for d in deltas for c in d.get("tool_calls", ())]
        assert streamed["function"] == call["function"] and chunks[-1]["choices"][0]["finish_reason"] == finish
        assert "".join(d.get("content", "") for d in deltas) == ""
    with scripted_server(GLM_TEMPLATE, "Look it up.</think>Checking." + answer) as s:
        status, error = post(s, body, CHAT)
        assert status == 500 and "breaks the structured output" in error["error"]["message"], error
    # Parameters that reference their own $defs (as pydantic writes them) still compile once nested.
    city = {"type": "object", "properties": {"city": {"$ref": "#/$defs/City"}, "days": {"type": "integer"}},
            "$defs": {"City": {"type": "string"}}}
    with_defs = [{"type": "function", "function": {"name": "get_weather", "parameters": city}}]
    with scripted_server(GLM_TEMPLATE, "Look it up.</think>" + answer) as s:
        status, whole = post(s, {**body, "tools": with_defs}, CHAT)
        assert status == 200 and whole["choices"][0]["message"]["tool_calls"], whole


def test_forced_calls_on_a_model_ends_on_a_call_of_the_offered_tools(srv):
    """The tiny model, greedy, with tools whose parameters the schema bounds: "required" and
    parallel_tool_calls false gives exactly one call of an offered tool, with arguments of its
    schema; the named function's call is that function's. The schema bounds the answer (at most
    [{"name": "right", "parameters": {"x": "b"}}], 45 bytes), so it ends within max_tokens."""
    pick = {"type": "object", "properties": {"x": {"enum": ["a", "b"]}}, "required": ["x"], "additionalProperties": False}
    tools = [{"type": "function", "function": {"name": n, "parameters": pick}} for n in ("left", "right")]
    for tool_choice in ("required", {"type": "function", "function": {"name": "right"}}):
        status, body = post(srv, chat(tools=tools, tool_choice=tool_choice, parallel_tool_calls=False, max_tokens=64), CHAT)
        assert status == 200, body
        (call,) = body["choices"][0]["message"]["tool_calls"]
        assert call["function"]["name"] in (("left", "right") if tool_choice == "required" else ("right",))
        assert json.loads(call["function"]["arguments"])["x"] in ("a", "b")


def test_an_api_key_guards_all_but_health_and_metrics(monkeypatch):
    def ask(s, method, path, key=None, body=None):
        with contextlib.closing(connect(s)) as c:
            c.request(method, path, None if body is None else json.dumps(body),
                      {} if key is None else {"Authorization": f"Bearer {key}"})
            r = c.getresponse()
            return r.status, r.read()

    with scripted_server(KIMI_TEMPLATE, "hi", api_key="sesame") as s:
        for key in (None, "open", "sesame "):
            assert ask(s, "POST", CHAT, key, {"messages": ASK})[0] == 401
            status, text = ask(s, "GET", "/v1/models", key)
            assert status == 401 and b"Authorization: Bearer KEY" in text
        assert ask(s, "POST", CHAT, "sesame", {"messages": ASK})[0] == 200
        assert ask(s, "GET", "/v1/models", "sesame")[0] == 200
        assert ask(s, "GET", "/health")[0] == 200
        status, text = ask(s, "GET", "/metrics")  # no key asked; a scripted engine has no scheduler to report
        assert status == 500 and b"'Scripted' object has no attribute 'scheduler'" in text
    monkeypatch.setenv("MIXSERVE_API_KEY", "from-env")
    assert server.build_parser().parse_args([]).api_key == "from-env"
    monkeypatch.setenv("MIXSERVE_API_KEY", "")
    assert server.build_parser().parse_args([]).api_key is None


def test_browser_pages_call_only_from_allowed_origins(capsys):
    """CORS (mixserve/cors.py): by default no page may call, and one that tries is refused before
    the server acts (a text/plain POST needs no preflight); allowed pages get their preflights
    answered without the API key, and every response, a 401 too, carries their CORS headers."""
    def ask(s, method, path, headers, body=None):
        with contextlib.closing(connect(s)) as c:
            c.request(method, path, None if body is None else json.dumps(body), headers)
            r = c.getresponse()
            return r.status, dict(r.getheaders()), r.read()

    page, other = "http://app.example", "http://elsewhere.example"
    preflight = lambda origin, method="POST", headers="authorization, content-type": {
        "Origin": origin, "Access-Control-Request-Method": method, "Access-Control-Request-Headers": headers}
    with scripted_server(KIMI_TEMPLATE, "hi") as s:  # the default: none
        status, headers, text = ask(s, "POST", CHAT, {"Origin": page, "Content-Type": "text/plain"}, {"messages": ASK})
        assert status == 403 and f"cross-origin request from {page} refused" in json.loads(text)["error"]["message"]
        assert "Access-Control-Allow-Origin" not in headers and s.loop.engine._next_rid == 0  # nothing was served
        assert ask(s, "OPTIONS", CHAT, preflight(page))[0] == 403
        status, headers, _ = ask(s, "POST", CHAT, {}, {"messages": ASK})  # not a browser's: served
        assert status == 200 and "Access-Control-Allow-Origin" not in headers
    with scripted_server(KIMI_TEMPLATE, "hi", api_key="sesame", cors=CorsPolicy((page,))) as s:
        status, headers, body = ask(s, "OPTIONS", CHAT, preflight(page))
        assert status == 204 and body == b"" and headers["Access-Control-Allow-Origin"] == page
        assert headers["Vary"] == "Origin" and "Access-Control-Allow-Credentials" not in headers
        assert headers["Access-Control-Allow-Methods"] == "GET, POST" and headers["Access-Control-Max-Age"] == "600"
        assert headers["Access-Control-Allow-Headers"] == "authorization, content-type"
        assert ask(s, "OPTIONS", CHAT, preflight(other))[0] == 403
        assert ask(s, "GET", "/health", {"Origin": other})[0] == 403
        for key, expected in (("sesame", 200), ("wrong", 401)):
            status, headers, _ = ask(s, "POST", CHAT, {"Origin": page, "Authorization": f"Bearer {key}"},
                                     {"messages": ASK, "stream": key == "sesame"})
            assert status == expected and headers["Access-Control-Allow-Origin"] == page, key
        with contextlib.closing(connect(s)) as c:  # a kept-alive connection's next request has only its own
            for method, expected in (("GET", 200), ("HEAD", 501)):
                c.request(method, "/health", headers={"Origin": page} if method == "GET" else {})
                r = c.getresponse()
                r.read()
                assert r.status == expected and (r.getheader("Access-Control-Allow-Origin") is None) == (method == "HEAD")
    for origins, credentials, answer in ((("*",), False, "*"), (("*",), True, page)):
        with scripted_server(KIMI_TEMPLATE, "hi", cors=CorsPolicy(origins, credentials=credentials)) as s:
            status, headers, _ = ask(s, "GET", "/v1/models", {"Origin": page})
            assert status == 200 and headers["Access-Control-Allow-Origin"] == answer
            assert headers.get("Access-Control-Allow-Credentials") == ("true" if credentials else None)
    with scripted_server(KIMI_TEMPLATE, "hi", cors=CorsPolicy((page,), ("GET",), ("x-trace",))) as s:
        status, _, text = ask(s, "OPTIONS", CHAT, preflight(page))
        assert status == 403 and b"method POST is not among --allowed-methods ['GET']" in text
        status, _, text = ask(s, "OPTIONS", CHAT, preflight(page, "GET"))
        assert status == 403 and b"headers ['authorization'] are not among --allowed-headers ['x-trace']" in text
        status, headers, _ = ask(s, "OPTIONS", CHAT, preflight(page, "GET", "Content-Type, X-Trace"))
        assert status == 204 and headers["Access-Control-Allow-Headers"] == "x-trace, Content-Type"  # always allowed
    args = server.build_parser().parse_args(["--allowed-origins", '["*"]', "--allow-credentials"])
    assert (args.allowed_origins, args.allowed_methods, args.allow_credentials) == (["*"], ["*"], True)
    with pytest.raises(SystemExit):
        server.build_parser().parse_args(["--allowed-origins", "*"])
    assert "need a JSON list of strings" in capsys.readouterr().err


class EndNamed(ByteTokenizer):
    """Bytes, with the scripted end token decoded to its name, as tokenizers decodes a special token."""

    def decode(self, ids):
        return "".join("<|im_end|>" if t == Scripted.EOS else super(EndNamed, self).decode([t]) for t in ids)


def test_the_text_leaves_out_the_stop_token_and_string_unless_asked():
    """vLLM's text: the end token (in token_ids) and a stop string are not in it, streamed or not,
    chat or not; include_stop_str_in_output keeps them."""
    with scripted_server(KIMI_TEMPLATE, "Hi there", tokenizer=EndNamed()) as s:
        for extra, text in (({}, "Hi there"), ({"include_stop_str_in_output": True}, "Hi there<|im_end|>"),
                            ({"stop": ["the"]}, "Hi "), ({"stop": ["the"], "include_stop_str_in_output": True}, "Hi the")):
            body = {"prompt": "x", "return_token_ids": True, **extra}
            status, whole = post(s, body)
            assert status == 200 and whole["choices"][0]["text"] == text, (extra, whole)
            assert whole["choices"][0]["token_ids"][-1] == (Scripted.EOS if "stop" not in extra else ord("e"))
            assert "".join(c["choices"][0]["text"] for c in events(s, body)[:-1]) == text, extra
            _, reply = post(s, {"messages": ASK, **extra}, CHAT)
            assert reply["choices"][0]["message"]["content"] == text.strip(), (extra, reply)  # the reply parser trims
        status, error = post(s, {"prompt": "x", "include_stop_str_in_output": 1})
        assert status == 400 and "include_stop_str_in_output must be bool" in error["error"]["message"]
        # vLLM's min_tokens: "i", completed by the 2nd token, does not stop a request held to 4
        _, held = post(s, {"prompt": "x", "stop": ["i"], "min_tokens": 4})
        assert held["choices"][0]["text"] == "Hi there" and held["choices"][0]["finish_reason"] == "stop"


def test_the_checkpoints_generation_config_gives_the_sampling_defaults(tmp_path, capsys):
    """--generation-config auto (vLLM's default): generation_config.json's recommended sampling
    values stand in for the fields a request leaves out or sends as null; vllm keeps OpenAI's."""
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": None, "eos_token_id": [3, 4]}))
    assert server.generation_config_dir("auto", str(tmp_path)) == str(tmp_path)
    assert server.generation_config_dir("vllm", str(tmp_path)) is None is server.generation_config_dir("auto", "tiny-kimi")
    assert server.generation_config_dir(str(tmp_path), "tiny-kimi") == str(tmp_path)  # another directory's
    defaults = generation_sampling_defaults(str(tmp_path))
    assert defaults == {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
    served = server.Served("m", ByteTokenizer(), mixserve.chat.ChatTemplate({"default": CHAT_TEMPLATE}), 4096, 320,
                           sampling_defaults=defaults)
    for body, parse in (({"prompt": "x"}, server.Completion.parse), ({"messages": ASK}, server.Completion.parse_chat)):
        options = parse(body, served).options
        assert (options["temperature"], options["top_p"], options["top_k"], options["min_p"]) == (0.6, 0.95, 20, 0), body
        options = parse({**body, "temperature": 0, "top_p": None}, served).options
        assert (options["temperature"], options["top_p"]) == (0, 0.95), body  # given wins; null is left out
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": "warm"}))
    for value in (str(tmp_path / "none"), str(tmp_path)):
        with pytest.raises(SystemExit):
            server.make_server(["--model", "tiny-kimi", "--port", "0", "--generation-config", value])
    err = capsys.readouterr().err
    assert "neither auto, vllm nor a directory" in err and "sampling values must be numbers, got {'temperature'" in err


def test_parallel_tool_calls_false_keeps_the_first_call():
    second = KIMI_REPLY.replace("<|tool_calls_section_end|>", "<|tool_call_begin|>functions.get_weather:1"
                                '<|tool_call_argument_begin|>{"city": "Bergen"}<|tool_call_end|><|tool_calls_section_end|>')
    with scripted_server(KIMI_TEMPLATE, second) as s:
        for parallel, ids in [(None, ["functions.get_weather:0", "functions.get_weather:1"]),
                              (False, ["functions.get_weather:0"])]:
            _, body = post(s, {"messages": ASK, "tools": TOOLS, "parallel_tool_calls": parallel}, CHAT)
            assert [c["id"] for c in body["choices"][0]["message"]["tool_calls"]] == ids
            streamed = events(s, {"messages": ASK, "tools": TOOLS, "parallel_tool_calls": parallel}, CHAT)[:-1]
            assert [c["id"] for e in streamed for c in e["choices"][0]["delta"].get("tool_calls", ())] == ids


def test_tool_choice_none_shows_no_tools_and_reads_no_calls_and_thinking_can_be_off():
    with scripted_server(GLM_TEMPLATE, GLM_REPLY) as s:
        _, body = post(s, {"messages": ASK, "tools": TOOLS, "tool_choice": "none", "return_token_ids": True}, CHAT)
        (choice,) = body["choices"]
        assert choice["finish_reason"] == "stop" and "tool_calls" not in choice["message"]
        assert choice["stop_reason"] is None  # the model's end token, not one the request named (vLLM's)
        assert choice["message"]["content"] == GLM_REPLY[GLM_REPLY.index("Checking"):]
        off = {"messages": ASK, "chat_template_kwargs": {"enable_thinking": False}}
        assert post(s, off, CHAT)[1]["choices"][0]["message"]["content"] == GLM_REPLY  # no open <think>
    with scripted_server(GLM_TEMPLATE, GLM_REPLY, reasoning_parser="none", tool_call_parser="none") as s:
        message = post(s, {"messages": ASK}, CHAT)[1]["choices"][0]["message"]
        assert message == {"role": "assistant", "content": GLM_REPLY}
        status, error = post(s, {"messages": ASK, "tools": TOOLS}, CHAT)
        assert status == 400 and "--tool-call-parser" in error["error"]["message"]


def test_a_thinking_models_reasoning_is_free_and_its_answer_holds_the_response_format():
    """GLM's generation prompt leaves <think> open: the structure holds from after </think> (a
    reply whose reasoning is not JSON is served), but from the first token once thinking is off
    (a reply opening <think> then breaks it).
    The scripted engine's tokens pass through each request's matcher: one it refuses aborts it."""
    answer = '{"ok":true}'
    fmt = {"type": "json_schema", "json_schema": {"name": "flag", "schema": FLAG}}
    with scripted_server(GLM_TEMPLATE, "Look it up.</think>" + answer) as s:
        status, body = post(s, {"messages": ASK, "response_format": fmt}, CHAT)
        assert status == 200 and body["choices"][0]["message"] == {
            "role": "assistant", "reasoning_content": "Look it up.", "content": answer}, body
        off = {"messages": ASK, "response_format": fmt, "chat_template_kwargs": {"enable_thinking": False}}
        status, error = post(s, off, CHAT)  # no open <think>: "L" is not JSON
        assert status == 500 and "breaks the structured output" in error["error"]["message"], error
    with scripted_server(GLM_TEMPLATE, answer) as s:
        assert post(s, off, CHAT)[1]["choices"][0]["message"]["content"] == answer
    with scripted_server(GLM_TEMPLATE, "<think>Look it up.</think>" + answer) as s:
        status, error = post(s, off, CHAT)  # thinking off: no <think> to open
        message = error["error"]["message"]
        assert status == 500 and "breaks the structured output" in message and "free part" not in message, error
    # Kimi's generation prompt opens no <think>: a reply may open it (then its reasoning is free
    # too) or answer at once (StructuredOutput.opens); anything else breaks the structure.
    for reply, message in [("<think>Look it up.</think>" + answer, {"reasoning_content": "Look it up.", "content": answer}),
                           (answer, {"reasoning_content": None, "content": answer})]:
        with scripted_server(KIMI_TEMPLATE, reply) as s:
            status, body = post(s, {"messages": ASK, "response_format": fmt}, CHAT)
            assert status == 200 and body["choices"][0]["message"] == {"role": "assistant", **message}, body
    with scripted_server(KIMI_TEMPLATE, "Look it up.</think>" + answer) as s:
        status, error = post(s, {"messages": ASK, "response_format": fmt}, CHAT)
        assert status == 500 and "does not open its free part" in error["error"]["message"], error


@pytest.mark.parametrize("body, message", [
    ({"max_tokens": 3}, "messages is required"),
    ({"messages": None}, "messages is required"),
    ({"messages": "hi"}, "messages must be list"),
    ({"messages": []}, "non-empty list"),
    ({"messages": [{"content": "hi"}]}, "messages[0] must be an object with a string role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "only text parts"),
    ({"messages": [{"role": "user", "content": 7}]}, "a string or a list of text parts"),
    ({"messages": [{"role": "tool", "content": "42"}]}, "no role tool"),  # the template's raise_exception
    (chat(tools=[{"type": "function", "function": {"name": "f"}}]), "start the server with --tool-call-parser"),
    (chat(tool_choice="required"), 'tool_choice "required" needs tools'),
    (chat(tools=[{"type": "function", "function": {"name": "f"}}], tool_choice={"type": "function", "function": {}}),
     "a named tool_choice is"),
    (chat(tools=[{"type": "function", "function": {"name": "f"}}],
          tool_choice={"type": "function", "function": {"name": "g"}}), "names 'g', which tools does not offer"),
    (chat(tools=[{"type": "function", "function": {"name": "f"}}], tool_choice="required",
          response_format={"type": "json_object"}), "no response_format or structured_outputs beside it"),
    (chat(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "objectx"}}}],
          tool_choice="required"), "objectx"),
    (chat(tools=[{"type": "function", "function": {"name": n, "parameters": {"$defs": {"P": {"type": t}}}}}
                 for n, t in (("f", "string"), ("g", "integer"))], tool_choice="required"),
     "tools define $defs/P differently"),
    (chat(tool_choice="any"), "tool_choice must be 'auto', 'none', 'required' or a named function, got 'any'"),
    (chat(tools=[{"type": "function", "function": {"name": ""}}]), 'tools[0] must be {"type": "function"'),
    (chat(tools=[{"name": "f"}]), "tools[0] must be"),
    (chat(tools=[{"type": "function", "function": {"name": "f", "parameters": []}}]), "tools[0] must be"),
    (chat(tools={"f": 1}), "tools must be list"),
    (chat(messages=[{"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]}]),
     "messages[0].tool_calls must be a list of"),
    (chat(top_logprobs=2), "top_logprobs needs logprobs: true"),
    (chat(logprobs=True, top_logprobs=21), "top_logprobs must be None or an integer in [0, max_logprobs=20]"),
    (chat(max_completion_tokens=0), "max_completion_tokens must be a positive integer"),
    (chat(stop=["logprobs", ""]), "got ['logprobs', '']"),  # a value is not renamed as a field
    (chat(chat_template_kwargs={"messages": [], "add_generation_prompt": False}),
     "may not set add_generation_prompt, messages"),
    (chat(add_generation_prompt=True, continue_final_message=True), "exclude each other"),
    (chat(prompt="x"), "unknown fields: prompt"),
    (chat(max_completion_tokens=600), "exceeds the context limit 512"),
    (chat(n="3"), "n must be an integer from 1 to 128, got '3'"),
])
def test_bad_chat_input_is_a_clear_error_and_the_server_goes_on(srv, body, message):
    status, error = post(srv, body, CHAT)
    assert status == 400 and message in error["error"]["message"], error
    assert post(srv, chat(max_tokens=2), CHAT)[0] == 200


@pytest.mark.parametrize("body, status, message", [
    (b"{not json", 400, "not JSON"),
    ([1, 2], 400, "JSON object"),
    ({"max_tokens": 3}, 400, "prompt is required"),
    ({"prompt": [[1], 2]}, 400, "prompt must be"),
    ({"prompt": "x", "frobnicate": 1}, 400, "unknown fields: frobnicate"),
    ({"prompt": "x", "n": 0}, 400, "n must be an integer from 1 to 128, got 0"),
    ({"prompt": "x", "n": 129}, 400, "n must be an integer from 1 to 128"),
    ({"prompt": "x", "n": True}, 400, "n must be an integer"),
    ({"prompt": [[1], [1, -1]], "n": 3}, 400, "prompt 1: token ids outside the vocabulary"),
    ({"prompt": "x", "echo": 1}, 400, "echo must be bool"),
    ({"prompt": "x", "logit_bias": {"five": 1}}, 400, "logit_bias must map at most 300 token ids"),
    ({"prompt": "x", "logit_bias": {"5": 101}}, 400, "logit_bias must map"),
    ({"prompt": "x", "model": "gpt-4"}, 404, "`gpt-4` does not exist"),
    ({"prompt": "x", "temperature": "hot"}, 400, "temperature must be a finite number"),
    ({"prompt": "x", "priority": "high"}, 400, "priority must be an integer"),
    ({"prompt": "x", "priority": -2}, 400, "priority -2 needs schedule_policy 'priority'"),
    ({"prompt": [1, 2, 999]}, 400, "outside the vocabulary"),
    ({"prompt": [1, True]}, 400, "list of integer token ids"),
    ({"prompt": "x", "max_tokens": 600}, 400, "exceeds the context limit 512"),
    ({"prompt": "x", "logprobs": 21}, 400, "max_logprobs=20"),
    ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens must be a positive integer"),
    ({"prompt": "x", "stop": [""]}, 400, "non-empty strings"),
    ({"prompt": ["fine", [1, -1]]}, 400, "prompt 1: token ids outside"),
    ({"prompt": "x", "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "objectx"}}}},
     400, "objectx"),
    ({"prompt": "x", "response_format": {"type": "json"}}, 400, 'response_format must be {"type": "text"}'),
    ({"prompt": "x", "response_format": {"type": "text"}, "structured_outputs": {"regex": "a"}}, 400, "not both"),
    ({"prompt": "x", "structured_outputs": {"regex": "a("}}, 400, "unclosed group"),
    ({"prompt": "x", "structured_outputs": {"choices": ["a"]}}, 400, "unknown fields choices"),
    ({"prompt": "x", "structured_outputs": {"regex": "a", "choice": ["a"]}}, 400, "exactly one of"),
    ({"prompt": "x", "structured_outputs": {"regex": "a"}, "ignore_eos": True}, 400, "ignore_eos"),
])
def test_bad_input_is_a_clear_error_and_the_server_goes_on(srv, body, status, message):
    got, error = post(srv, body)
    assert got == status and message in error["error"]["message"], error
    assert error["error"]["code"] == status
    assert post(srv, {"prompt": "ok", "max_tokens": 2})[0] == 200


JSON = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=4),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3),
                    max_leaves=6)


# Every field each endpoint reads, with a body that is valid without it (two tokens at most).
ENDPOINTS = (("/v1/completions", server.COMPLETIONS), (CHAT, server.CHAT_COMPLETIONS), ("/tokenize", server.TOKENIZE),
             ("/detokenize", server.DETOKENIZE))
FIELDS = [(path, field) for path, endpoint in ENDPOINTS
          for field in sorted({*server.SAMPLING_FIELDS, *endpoint.default_only, *endpoint.other})]
BASE = {"/v1/completions": {"prompt": [1, 2, 3], "max_tokens": 2},
        CHAT: {"messages": MESSAGES, "max_tokens": 2, "max_completion_tokens": 2},
        "/tokenize": {"messages": MESSAGES}, "/detokenize": {"tokens": [75, 86]}}


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(path_field=st.sampled_from(FIELDS), value=JSON)
def test_any_json_in_any_field_is_served_or_refused_and_the_server_goes_on(srv, path_field, value):
    """Python's json reads NaN and Infinity too: they are among the floats."""
    path, field = path_field
    assume(not (field.startswith("max_") and isinstance(value, int) and value > 4))  # valid, but slow to serve
    body = {**BASE[path], field: value}
    with contextlib.closing(connect(srv)) as c:
        c.request("POST", path, json.dumps(body))
        r = c.getresponse()
        r.read()
    assert r.status in (200, 400, 404), (r.status, body)
    assert srv.loop.alive


@pytest.fixture(scope="module")
def kimi():
    with scripted_server(KIMI_TEMPLATE, KIMI_REPLY) as s:
        yield s


CALL = {"id": "functions.get_weather:0", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
TOOL_FIELDS = [("tools",), ("tool_choice",), ("parallel_tool_calls",), ("tools", 0, "function"),
               ("tools", 0, "function", "parameters"), ("messages", 1, "tool_calls"),
               ("messages", 1, "tool_calls", 0, "function"), ("messages", 1, "tool_calls", 0, "function", "arguments")]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(where=st.sampled_from(TOOL_FIELDS), value=JSON, stream=st.booleans())
def test_any_json_in_the_tool_fields_is_served_or_refused(kimi, where, value, stream):
    body = json.loads(json.dumps({"messages": [*ASK, {"role": "assistant", "content": None, "tool_calls": [CALL]}],
                                  "tools": TOOLS, "stream": stream}))
    parent = body
    for key in where[:-1]:
        parent = parent[key]
    parent[where[-1]] = value
    with contextlib.closing(connect(kimi)) as c:
        c.request("POST", CHAT, json.dumps(body))
        r = c.getresponse()
        r.read()
    assert r.status in (200, 400), (r.status, body)
    assert kimi.loop.alive


def test_a_bug_in_a_handler_is_that_requests_500_and_the_server_goes_on(srv, monkeypatch):
    def broken(body, served):
        raise KeyError("a bug")

    monkeypatch.setitem(server.PARSERS, "/v1/completions", broken)
    status, error = post(srv, {"prompt": "x"})
    assert status == 500 and "KeyError('a bug')" in error["error"]["message"], error
    monkeypatch.undo()
    assert post(srv, {"prompt": "ok", "max_tokens": 2})[0] == 200


def test_a_chunked_body_is_read_as_a_whole_one(srv):
    """Transfer-Encoding: chunked (curl's when it posts stdin, http.client's for an iterable body):
    the same completion as a sized body's; a chunk size that is not hexadecimal is a 400."""
    fresh = lambda: greedy(max_tokens=3, cache_salt=str(uuid.uuid4()))  # both compute the whole prompt (FP8 KV)
    body = json.dumps(fresh()).encode()
    with contextlib.closing(connect(srv)) as c:
        c.request("POST", "/v1/completions", iter([body[:7], body[7:20], body[20:]]), encode_chunked=True,
                  headers={"Content-Type": "application/json", "Transfer-Encoding": "chunked"})
        r = c.getresponse()
        assert r.status == 200
        chunked = json.loads(r.read())
    assert chunked["choices"][0]["text"] == post(srv, fresh())[1]["choices"][0]["text"]
    for size in (b"zz", b"-1", b"0x2"):  # int(, 16) takes the last two: -1 would read to the connection's end
        with contextlib.closing(connect(srv)) as c:  # the body as given: a Transfer-Encoding header stops http.client's
            c.request("POST", "/v1/completions", size + b"\r\n{}\r\n0\r\n\r\n", headers={"Transfer-Encoding": "chunked"})
            r = c.getresponse()
            error = json.loads(r.read())["error"]
        assert r.status == 400 and "a chunk's size must be hexadecimal" in error["message"], error


def test_a_bad_content_length_is_refused_not_waited_on(srv):
    with socket.create_connection(srv.server_address[:2], timeout=30) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n{}")
        assert sock.recv(4096).startswith(b"HTTP/1.1 400 ")


def test_the_other_endpoints(srv):
    assert get(srv, "/health") == (200, {})
    status, models = get(srv, "/v1/models")
    assert status == 200 and [m["id"] for m in models["data"]] == ["tiny-kimi"]
    assert models["data"][0]["max_model_len"] == 512
    assert get(srv, "/nowhere")[0] == 404
    status, error = post(srv, {"prompt": "x"}, path="/v1/nowhere")
    assert status == 404 and "/v1/completions, /v1/chat/completions, /tokenize, /detokenize" in error["error"]["message"]
    # a served path with another method: 405 with what it takes (Allow), in OpenAI's error form as every other
    for method, path, takes, status in (("GET", "/v1/completions", "POST", 405), ("DELETE", "/v1/models", "GET", 405),
                                        ("OPTIONS", "/tokenize", "POST", 405), ("PUT", "/nowhere", None, 404)):
        with contextlib.closing(connect(srv)) as c:
            c.request(method, path)
            r = c.getresponse()
            error = json.loads(r.read())["error"]
        assert r.status == status and r.getheader("Allow") == takes and error["code"] == status, (method, path, error)


def metrics(s) -> dict[str, float]:
    with contextlib.closing(connect(s)) as c:
        c.request("GET", "/metrics")
        r = c.getresponse()
        assert r.status == 200 and r.getheader("Content-Type").startswith("text/plain")
        samples = [line.rsplit(" ", 1) for line in r.read().decode().splitlines() if not line.startswith("#")]
    return {name.removeprefix("mixserve:").removesuffix('{role="engine"}'): float(value) for name, value in samples}


def test_metrics_count_what_the_engine_did(srv):
    before = metrics(srv)
    assert post(srv, {"prompt": [7, 8, 9, 10, 11], "max_tokens": 5, "temperature": 0})[0] == 200
    assert post(srv, {"prompt": [1, 999]})[0] == 400
    after = metrics(srv)
    grew = {name: after[name] - before[name] for name in after}
    assert grew["prompt_tokens_total"] == 5 and grew["generation_tokens_total"] == 4  # the first comes from prefill
    assert grew["decode_steps_total"] == 4 and grew["rejections_total"] == 1
    assert after["kv_pages_used"] == after["num_requests_running"] == after["num_requests_waiting"] == 0
    assert after["kv_pages_total"] == srv.loop.engine.num_pages and after["integrity_aborts_total"] == 0


def test_the_servers_histograms_count_each_finished_request(srv):
    """Two requests of 5 prompt tokens: one to max_tokens, one to a stop token of the first's
    output; /metrics' histograms grow by them, their buckets cumulative, +Inf equal to the count.
    The second computes its prompt anew (a salt of its own): the prefix cache's page would compute
    its last prompt token in another chunk, whose float32 roundoff can flip a near-tie."""
    prompt = [int(t) for t in np.random.default_rng().integers(0, 256, 5)]
    before = metrics(srv)
    status, first = post(srv, {"prompt": prompt, "max_tokens": 6, "temperature": 0, "return_token_ids": True,
                                "ignore_eos": True})
    assert status == 200, first
    tokens = first["choices"][0]["token_ids"]
    status, second = post(srv, {"prompt": prompt, "max_tokens": 6, "temperature": 0, "return_token_ids": True,
                                "ignore_eos": True, "stop_token_ids": [tokens[2]], "cache_salt": str(prompt)})
    assert status == 200, second
    stopped = len(second["choices"][0]["token_ids"])
    assert stopped == tokens.index(tokens[2]) + 1
    assert second["choices"][0]["stop_reason"] == tokens[2] and first["choices"][0]["stop_reason"] is None
    after = metrics(srv)
    grew = {name: after[name] - before.get(name, 0) for name in after}

    def hist(name, part):
        return grew[f"{name}_{part}"]  # metrics() drops a lone role label

    assert grew['request_success_total{role="engine",finished_reason="length"}'] == 1
    assert grew['request_success_total{role="engine",finished_reason="stop"}'] == 1
    assert grew['request_success_total{role="engine",finished_reason="abort"}'] == 0
    assert hist("request_prompt_tokens", "sum") == 10 and hist("request_prompt_tokens", "count") == 2
    assert hist("request_generation_tokens", "sum") == 6 + stopped
    assert hist("inter_token_latency_seconds", "count") == 5 + stopped - 1  # one decode step per token here
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
                 "request_prefill_time_seconds", "request_decode_time_seconds"):
        assert hist(name, "count") == 2 and hist(name, "sum") > 0
        buckets = [after[k] for k in after if k.startswith(f'{name}_bucket{{')]
        assert buckets == sorted(buckets) and buckets[-1] == after[f"{name}_count"]


def test_a_repeated_prompt_reports_its_cached_tokens_per_cache_salt_until_a_reset(srv):
    prompt = [int(t) for t in np.random.default_rng(12).integers(0, 256, 13)]  # no other test's pages
    body = {"prompt": prompt, "max_tokens": 2, "temperature": 0}
    cached = []
    for extra in ({}, {"priority": 0}, {"cache_salt": "tenant-a"}, {"cache_salt": "tenant-a"}):
        status, reply = post(srv, {**body, **extra})
        assert status == 200, reply
        cached.append(reply["usage"]["prompt_tokens_details"]["cached_tokens"])
    assert cached == [0, 12, 0, 12]  # 3 full pages of 4 (the last prompt token is always computed)
    status, error = post(srv, {**body, "cache_salt": 3})
    assert status == 400 and "cache_salt" in error["error"]["message"]
    before = metrics(srv)
    assert before["kv_pages_cached"] >= 6 and before["prefix_cache_hits_total"] >= 24
    assert before["prefix_cache_stale_pages_total"] == 0
    assert before["kv_host_pages"] == before["prefix_cache_host_hits_total"] == 0  # this engine has no host tier
    assert before["prefix_cache_evicted_pages_total"] == srv.loop.engine.counters.evicted_pages  # idle between requests
    status, reset = post(srv, {}, path="/reset_prefix_cache")
    assert status == 200 and reset == {"freed_pages": before["kv_pages_cached"]}
    assert metrics(srv)["kv_pages_cached"] == 0
    assert post(srv, body)[1]["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}


def test_grammar_mask_seconds_count_only_structured_requests(srv):
    before = metrics(srv)["grammar_mask_seconds_total"]
    assert post(srv, greedy(max_tokens=3))[0] == 200
    assert metrics(srv)["grammar_mask_seconds_total"] == before
    assert post(srv, greedy(max_tokens=3, structured_outputs={"regex": "[a-z]+"}))[0] == 200
    assert metrics(srv)["grammar_mask_seconds_total"] > before


def wait_until(condition, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_goes_away_has_its_request_cancelled_and_its_pages_freed(srv, stream):
    """The request would run 400 steps; it is cancelled (streamed: after its first chunk; else
    while it waits) and the engine frees its pages."""
    engine, before = srv.loop.engine, srv.loop.cancelled
    tokens_before = engine.counters.decode_tokens
    body = json.dumps({"prompt": "x", "max_tokens": 400, "ignore_eos": True, "stream": stream}).encode()
    with socket.create_connection(srv.server_address[:2]) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        received = b""
        while stream and b"data: " not in received:  # the headers and the first chunk may come apart
            chunk = sock.recv(4096)
            assert chunk, "the server closed the stream"
            received += chunk
    wait_until(lambda: srv.loop.cancelled == before + 1 and not engine.has_work())
    assert engine.pages_in_use == 0
    assert engine.counters.decode_tokens - tokens_before < 200, engine.counters.decode_tokens - tokens_before


def fault_engine(integrity: str):
    """An engine as FLAGS build it (with integrity "check", it shares their compiled steps) whose page
    table a bookkeeping bug corrupts at its third decode step."""
    def stale_tag_at_step_2(table, step):
        return faults.inject(table, faults.FaultKind.STALE_TAG, slot=jnp.int32(0)) if step == 2 else table

    return Engine(mixserve.load("tiny-kimi"), kv_dtype="fp8_e4m3", page_size=4, max_batch=2, kv_memory_bytes=4 << 20,
                  integrity=integrity, fault_hook=stale_tag_at_step_2)


def served(engine: Engine) -> server.Server:
    return serving(server.Server(("127.0.0.1", 0), engine, server.Served("tiny-kimi", ByteTokenizer(), None,
                                                                        engine.max_seq_len, engine.cfg.vocab_size)))


def test_an_integrity_abort_is_an_error_never_an_answer():
    s = served(fault_engine("check"))
    try:
        status, error = post(s, greedy())
        assert status == 500 and "KV integrity check failed" in error["error"]["message"], error
        got = events(s, greedy())  # the fault comes once: this one is served
        assert got[-1] == "[DONE]" and got[-2]["choices"][0]["finish_reason"] == "length"
        assert get(s, "/health")[0] == 200
    finally:
        s.close()


def test_a_strict_engine_that_raises_stops_the_server():
    s = served(fault_engine("strict"))
    try:
        status, error = post(s, greedy())
        assert status == 503 and "KV integrity check failed" in error["error"]["message"], error
        assert get(s, "/health")[0] == 503
        assert post(s, greedy())[0] == 503  # later requests are refused, not left waiting
        s.stop_with_the_loop()  # what main runs beside serve_forever: returns once the loop has stopped
    finally:
        s.server_close()


def test_reset_prefix_cache_reads_its_body_on_a_kept_alive_connection(srv):
    with contextlib.closing(connect(srv)) as c:
        c.request("POST", "/reset_prefix_cache", json.dumps({}), {"Content-Type": "application/json"})
        r = c.getresponse()
        assert r.status == 200 and "freed_pages" in json.loads(r.read())
        c.request("POST", "/v1/completions", json.dumps(greedy(max_tokens=2)), {"Content-Type": "application/json"})
        r = c.getresponse()
        assert r.status == 200, r.read()
        r.read()
