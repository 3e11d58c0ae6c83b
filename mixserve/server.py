"""`python -m mixserve.server`: the engine behind an OpenAI-compatible HTTP API, as vLLM and SGLang serve.

  POST /v1/completions  OpenAI's completions (and vLLM's sampling extensions); "stream": true sends
                        server-sent events, a chunk per engine step that gave the request tokens
  POST /v1/chat/completions  the same for a conversation (OpenAI's messages), through the model's chat
                        template (mixserve/chat.py), or --chat-template's; the reply read for its
                        reasoning and tool calls (mixserve/replies.py)
  POST /update_weights_from_disk  SGLang's: serve the weights of another checkpoint of the model
                        (an RL trainer's step), swapped in between two engine steps
  GET  /get_weight_version  SGLang's: the weight_version the last update named (a response's metadata
                        says which weights gave its last tokens, each choice's weight_versions where
                        each weight set's tokens begin)
  POST /sleep?level=1|2, /wake_up?tags=weights&tags=kv_cache; GET /is_sleeping  vLLM's: free the
                        weights' and KV pools' device memory for a trainer (completions wait), and
                        take it back (Engine.sleep)
  POST /tokenize, /detokenize  text (or messages) <-> token ids, as the completion endpoints encode them
  GET  /tokenizer_info  the special tokens and chat template (with the two above: lm-eval's remote tokenizer)
  GET  /v1/models       the one model served
  GET  /health          200 while the engine loop runs, 503 once it has stopped
  GET  /metrics         the engine's gauges and counters, and per-request latency histograms, for
                        Prometheus (vLLM's names, under mixserve:; mixserve/metrics.py)

One thread runs the engine (`EngineLoop`): it is the only one that touches it. Each HTTP request
has a thread of its own (the standard library's ThreadingHTTPServer), which hands its prompts to
the loop and reads what every step gave them. Bad input is a 400 with the reason, per request; a
client that goes away before its completion ends has it cancelled (`Frontend.cancel`): its pages
go back at once. A browser page may call only from an origin --allowed-origins names (CORS:
mixserve/cors.py). The engine flags are mixserve.run's.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import hmac
import http.server
import json
import os
import queue
import re
import select
import socket
import sys
import threading
import time
import traceback
import urllib.parse
import uuid
from collections.abc import Callable

from mixserve import run
from mixserve.chat import SPECIAL_TOKEN_NAMES, ChatTemplate, ChatTemplateError, special_tokens_in
from mixserve.checkpoint import CheckpointError, generation_sampling_defaults
from mixserve.cors import CorsPolicy
from mixserve.engine import SLEEP_TAGS, EngineBusy, WeightsDiscarded
from mixserve.frontend import Frontend, stop_strings
from mixserve.grammar import StructuredOutput
from mixserve.metrics import RequestMetrics, prometheus
from mixserve.replies import TOOL_CALL_FORMATS, ReplyFormat, ReplyParser, ReplyStream, forced_calls_schema
from mixserve.request import Result, TokenLogprobs, Update
from mixserve.tokenizer import IncrementalDecoder, LeavingOut, Tokenizer, text_tokenizer

# The sampling fields of both endpoints (vLLM's extensions among them) -> Frontend.submit's keywords,
# with the value a missing or null field takes.
SAMPLING_FIELDS = {
    "temperature": ("temperature", 1.0), "top_p": ("top_p", 1.0), "top_k": ("top_k", 0), "min_p": ("min_p", 0.0),
    "seed": ("seed", None), "stop": ("stop", None), "stop_token_ids": ("stop_token_ids", ()),
    "ignore_eos": ("ignore_eos", False), "min_tokens": ("min_tokens", 0), "prompt_logprobs": ("prompt_logprobs", None),
    "logit_bias": ("logit_bias", None), "allowed_token_ids": ("allowed_token_ids", None),
    "presence_penalty": ("presence_penalty", 0.0), "frequency_penalty": ("frequency_penalty", 0.0),
    "repetition_penalty": ("repetition_penalty", 1.0),
    "cache_salt": ("cache_salt", None), "priority": ("priority", 0),
    "skip_special_tokens": ("skip_special_tokens", True),
}
# The other fields both take, and the JSON types they take.
COMMON_FIELDS = {"model": (str,), "n": None, "stream": (bool,), "stream_options": (dict,), "user": (str,),
                 "return_token_ids": (bool,), "return_tokens_as_token_ids": (bool,), "include_stop_str_in_output": (bool,),
                 "response_format": (dict,), "structured_outputs": (dict,), "truncate_prompt_tokens": None}


@dataclasses.dataclass(frozen=True)
class Endpoint:
    """What one endpoint's body may hold beyond SAMPLING_FIELDS: fields served at their default only,
    and the other fields with their JSON types (None: a value the engine checks, as it checks the
    sampling fields', per request)."""
    default_only: dict
    other: dict
    sampled: bool = True  # whether it takes SAMPLING_FIELDS

    def check(self, body: dict, model_name: str) -> None:
        """A field this server does not know or does not compute is refused by name."""
        unknown = sorted(set(body) - set(SAMPLING_FIELDS if self.sampled else ()) - set(self.default_only)
                         - set(self.other))
        if unknown:
            raise BadRequest(f"unknown fields: {', '.join(unknown)}")
        for name, default in self.default_only.items():
            if body.get(name) not in (None, default, {}, []):
                why = f" ({WHY_DEFAULT_ONLY[name]})" if name in WHY_DEFAULT_ONLY else ""
                raise BadRequest(f"{name}={body[name]!r} is not supported: only {default!r}{why}")
        for name, kinds in self.other.items():
            if kinds is not None and body.get(name) is not None and not isinstance(body[name], kinds):
                raise BadRequest(f"{name} must be {' or '.join(k.__name__ for k in kinds)}, got {body[name]!r}")
        if body.get("model") is not None and body["model"] != model_name:
            raise BadRequest(f"the model `{body['model']}` does not exist: this server serves `{model_name}`", 404,
                             "not_found_error")
        usage_option = (body.get("stream_options") or {}).get("include_usage")
        if usage_option is not None and not isinstance(usage_option, bool):
            raise BadRequest(f"stream_options.include_usage must be bool, got {usage_option!r}")
        if body.get("stream_options") is not None and not body.get("stream"):  # OpenAI's and vLLM's rule
            raise BadRequest("stream_options is for a stream: set stream to true, or leave stream_options out")

    @staticmethod
    def sampling(body: dict, defaults: dict) -> dict:
        """submit's sampling keywords: the body's fields, else `defaults` (the served model's), else ours."""
        options = {keyword: defaults.get(name, default) if body.get(name) is None else body[name]
                   for name, (keyword, default) in SAMPLING_FIELDS.items()}
        for keyword in ("stop_token_ids", "allowed_token_ids"):
            if isinstance(options[keyword], list):
                options[keyword] = tuple(options[keyword])
        if isinstance(bias := options["logit_bias"], dict):  # JSON keys are strings: the token ids as text
            options["logit_bias"] = {int(k) if k.isdecimal() else k: v for k, v in bias.items()}
        options["structured_output"] = structured_output_of(body)
        return options


STRUCTURED_OUTPUTS = {"json": "json_schema", "json_object": "json_object", "regex": "regex", "choice": "choice",
                      "grammar": "grammar"}  # vLLM's structured_outputs keys -> StructuredOutput's fields


def structured_output_of(body: dict) -> StructuredOutput | None:
    """What the output must match: OpenAI's response_format ({"type": "text"}, {"type":
    "json_object"}, or {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}) or
    vLLM's structured_outputs ({"json": schema} or "regex", "choice", "grammar" (Lark), "json_object");
    not both. The engine checks what they hold (a schema that does not compile is that request's 400)."""
    fmt, vllm = body.get("response_format"), body.get("structured_outputs")
    if fmt is not None and vllm is not None:
        raise BadRequest("give response_format or structured_outputs, not both")
    if vllm is not None:
        if unknown := sorted(set(vllm) - set(STRUCTURED_OUTPUTS)):
            raise BadRequest(f"structured_outputs: unknown fields {', '.join(unknown)} (known: "
                             f"{', '.join(STRUCTURED_OUTPUTS)})")
        given = {STRUCTURED_OUTPUTS[k]: tuple(v) if k == "choice" and isinstance(v, list) else v
                 for k, v in vllm.items() if v is not None and v is not False}
        return StructuredOutput(**given)
    kind = (fmt or {}).get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput(json_object=True)
    schema = fmt.get("json_schema")
    if kind == "json_schema" and isinstance(schema, dict) and isinstance(schema.get("schema", {}), dict):
        return StructuredOutput(json_schema=schema.get("schema", {}))  # no schema: any JSON, as OpenAI reads it
    raise BadRequest('response_format must be {"type": "text"}, {"type": "json_object"} or {"type": "json_schema", '
                     f'"json_schema": {{"name": ..., "schema": {{...}}}}}}, got {fmt!r}')


WHY_DEFAULT_ONLY = {"add_special_tokens": "prompts are encoded as given, as the completion endpoints encode them"}
# POST /v1/completions: max_tokens 16 and logprobs n by default, as OpenAI's; echo (with logprobs:
# the prompt's too) is how lm-eval scores multiple choice through this endpoint.
COMPLETIONS = Endpoint({"best_of": 1, "suffix": None},
                       {**COMMON_FIELDS, "prompt": (str, list), "max_tokens": None, "logprobs": None, "echo": (bool,)})
# POST /v1/chat/completions: OpenAI's fields, and vLLM's template extensions (add_generation_prompt,
# continue_final_message, chat_template_kwargs).
CHAT_COMPLETIONS = Endpoint({},
                            {**COMMON_FIELDS, "messages": (list,), "max_tokens": None, "max_completion_tokens": None,
                             "tools": (list,), "tool_choice": None, "parallel_tool_calls": (bool,),
                             "logprobs": (bool,), "top_logprobs": None,
                             "add_generation_prompt": (bool,), "continue_final_message": (bool,),
                             "chat_template_kwargs": (dict,)})
# POST /tokenize and /detokenize, vLLM's (lm-eval's remote tokenizer uses them, with GET /tokenizer_info).
TOKENIZE = Endpoint({"add_special_tokens": False}, {
    "model": (str,), "prompt": (str,), "messages": (list,), "add_generation_prompt": (bool,),
    "continue_final_message": (bool,), "chat_template_kwargs": (dict,), "tools": (list,), "tool_choice": None},
    sampled=False)
DETOKENIZE = Endpoint({}, {"model": (str,), "tokens": (list,)}, sampled=False)
POLL_S = 0.25  # how often a waiting handler looks whether its client is still there
OPEN_PATHS = ("/health", "/metrics")  # served without the API key
SGLANG_MEMORY_TAGS = (*SLEEP_TAGS, "cuda_graph")  # what SGLang's release and resume take


class BadRequest(Exception):
    """A request this server refuses, with the HTTP status and OpenAI's error type."""

    def __init__(self, message: str, status: int = 400, kind: str = "invalid_request_error",
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.kind, self.headers = status, kind, headers or {}


@dataclasses.dataclass
class Call:
    """One HTTP request's engine requests as the loop serves them, a (prompt, submit's keywords) per
    choice: (choice index, Update) pairs, in step order, on `updates`; an exception there instead
    once the loop has stopped. n: the choices per prompt (choice i is prompt i // n's)."""
    requests: list[tuple[list[int], dict]]
    n: int = 1
    updates: queue.SimpleQueue = dataclasses.field(default_factory=queue.SimpleQueue)
    rids: list[int] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class Cancel:
    """An inbox item: cancel what is left of call's requests."""
    call: Call


@dataclasses.dataclass(eq=False)
class Between:
    """An inbox item: run fn(engine) between two steps, on the engine's thread; its result (or
    the exception it raised) goes to `done`. One its caller stopped waiting for before the loop
    started it is never run (`start` says False)."""
    fn: Callable
    done: queue.SimpleQueue = dataclasses.field(default_factory=queue.SimpleQueue)
    state: str = "queued"  # "started" or "dropped" once decided, under `lock`
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    def start(self) -> bool:
        with self.lock:
            if self.state == "queued":
                self.state = "started"
            return self.state == "started"

    def drop(self) -> bool:
        """Give up on it, if the loop has not started it (True); once started, it runs to the end."""
        with self.lock:
            if self.state == "queued":
                self.state = "dropped"
            return self.state == "dropped"


class EngineLoop:
    """Runs an engine (Engine or DisaggregatedEngine) on a thread of its own: it submits what
    handlers hand it, steps while there is work, and routes each Update to its Call. An engine
    that raises (integrity "strict" on a failed check, as it is meant to) stops the loop: every
    open Call gets the error, and so does every later one."""

    def __init__(self, engine: Frontend):
        self.engine = engine
        self.cancelled = 0  # requests cancelled unfinished: their client gone, a prompt beside them rejected
        self.requests = RequestMetrics()  # each finished request's latencies and lengths, for /metrics
        self.error: BaseException | None = None  # what stopped the loop
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()  # a Call to submit, a Cancel, or None: stop
        self._routes: dict[int, tuple[Call, int]] = {}  # rid -> its Call and prompt index
        self._thread = threading.Thread(target=self._run, name="mixserve-engine", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self.error is None and self._thread.is_alive()

    def submit(self, call: Call | Between) -> Call | Between:
        self._inbox.put(call)
        if self.error is not None:  # set before the loop's last look at the inbox: that look may have missed it
            self._fail_inbox()
        return call

    def cancel(self, call: Call) -> None:
        self._inbox.put(Cancel(call))

    def between_steps(self, fn: Callable, timeout_s: float = 60.0):
        """fn(engine), run on the engine's thread between two steps (the engine is not thread-safe)."""
        if not self._thread.is_alive():
            raise self.stopped()
        item = Between(fn)
        self.submit(item)
        try:
            result = item.done.get(timeout=timeout_s)
        except queue.Empty:
            if item.drop():  # never to run: a client told it failed must not find it done later
                raise BadRequest(f"the engine did not get to it within {timeout_s:.0f} s", 503, "server_error")
            result = item.done.get()  # begun just now: it finishes
        if isinstance(result, BaseException):
            raise result
        return result

    def close(self) -> None:
        self._inbox.put(None)
        self.join()

    def join(self) -> None:
        self._thread.join()

    def _run(self) -> None:
        try:
            while True:
                # nothing to step (asleep: requests wait for wake_up): block until something comes in
                idle = not self.engine.has_work() or self.engine.sleeping
                item = self._inbox.get() if idle else self._next_item()
                while item is not False:  # everything handed over by now, then one step
                    if item is None:
                        return
                    self._take(item)
                    item = self._next_item()
                if self.engine.has_work():  # asleep, a step only reports (a rejection, a cancellation)
                    self._route(self.engine.step())
        except BaseException as e:  # noqa: BLE001 - every waiting client must learn of it
            self.error = e
            traceback.print_exc()
            for call in {id(c): c for c, _ in self._routes.values()}.values():
                call.updates.put(self.stopped())
            self._fail_inbox()

    def _next_item(self):
        try:
            return self._inbox.get_nowait()
        except queue.Empty:
            return False

    def _take(self, item: Call | Cancel | Between) -> None:
        if isinstance(item, Cancel):
            self.cancelled += sum(self.engine.cancel(rid) for rid in item.call.rids)
            return
        if isinstance(item, Between):
            if not item.start():
                return
            try:
                item.done.put(item.fn(self.engine))
            except Exception as e:  # noqa: BLE001 - its caller's failure, not the loop's
                item.done.put(e)
            except BaseException as e:  # the loop's end too: its caller must not wait forever
                item.done.put(BadRequest(f"the engine stopped: {e!r}", 503, "server_error"))
                raise
            return
        try:
            for i, (prompt, options) in enumerate(item.requests):
                item.rids.append(self.engine.submit(prompt, **options))
                self._routes[item.rids[-1]] = (item, i)
        except Exception as e:  # noqa: BLE001 - input the engine's checks missed fails its request, not the server
            traceback.print_exc()
            self._take(Cancel(item))
            item.updates.put(BadRequest(f"the engine could not take this request: {e!r}", 500, "server_error"))

    def _route(self, updates: list[Update]) -> None:
        for update in updates:
            call, index = self._routes[update.rid]
            call.updates.put((index, update))
            if update.result is not None:
                del self._routes[update.rid]
                self.requests.observe(len(call.requests[index][0]), update.result)

    def stopped(self) -> BadRequest:
        return BadRequest(f"the engine has stopped: {self.error!r}", 503, "server_error")

    def _fail_inbox(self) -> None:
        while (item := self._next_item()) is not False:
            if isinstance(item, Call):
                item.updates.put(self.stopped())
            elif isinstance(item, Between):
                item.done.put(self.stopped())


@dataclasses.dataclass(frozen=True)
class Returned:
    """What a request asked to get back beside the text (vLLM's extensions, OpenAI's echo)."""
    token_ids: bool = False  # token_ids per choice; prompt_token_ids in the first chunk (a chat: beside the choices)
    ids_as_names: bool = False  # logprobs name tokens "token_id:N", not by their text
    echo: bool = False  # the prompt's text before the completion's (and its tokens' logprobs before theirs)
    top: int = 0  # the likeliest tokens logprobs lists: the request's logprobs=n
    prompt_top: int | None = None  # the same for vLLM's prompt_logprobs field (None: not shown)
    include_stop_str: bool = False  # the text keeps the stop token's or stop string's (vLLM's include_stop_str_in_output)


@dataclasses.dataclass(frozen=True)
class Served:
    """What requests are read against: the model's name, its tokenizer and chat template, the tokens
    one request may hold (prompt and output: the context limit, or the whole KV pool if smaller), the
    model's vocabulary size (token ids run from 0 to it; a tokenizer may know fewer), and what its
    chat replies are read for (reasoning, tool calls)."""
    model_name: str
    tokenizer: Tokenizer
    chat_template: ChatTemplate | None
    max_model_len: int
    vocab_size: int
    reply_format: ReplyFormat = ReplyFormat()
    special_tokens: dict[str, str] = dataclasses.field(default_factory=dict)  # bos_token, eos_token, ... as text
    # what a request that leaves a sampling field out gets (--generation-config: the checkpoint's recommendation)
    sampling_defaults: dict[str, float] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Completion:
    """A /v1/completions or /v1/chat/completions body, parsed: the prompts (token ids), submit's
    keywords for each, the choices per prompt, and how the answer goes back (a chat reply read for
    reasoning and tool calls by `reply`, keeping only its first call if one_call)."""
    prompts: list[list[int]]
    options: dict
    n: int
    stream: bool
    include_usage: bool
    returned: Returned
    chat: bool = False
    reply: ReplyParser | None = None
    one_call: bool = False
    # submit's keywords whose body field is named otherwise: a rejection names the field sent
    fields: tuple[tuple[str, str], ...] = (("max_new_tokens", "max_tokens"),)

    def in_body_terms(self, reason: str) -> str:
        for keyword, field in self.fields:  # where the reason names it ("x must ...", "x (4)"), not in a value
            reason = re.sub(rf"\b{keyword}(?= must| \()", field, reason)
        return reason

    @classmethod
    def parse(cls, body: dict, served: Served) -> Completion:
        """A /v1/completions body."""
        COMPLETIONS.check(body, served.model_name)
        if body.get("prompt") is None:
            raise BadRequest("prompt is required")
        options = {**Endpoint.sampling(body, served.sampling_defaults), "logprobs": body.get("logprobs"),
                   "max_new_tokens": 16 if body.get("max_tokens") is None else body["max_tokens"]}
        top, asked = options["logprobs"], options["prompt_logprobs"]
        if body.get("echo") and top is not None:  # the prompt's logprobs too: the engine computes the most asked
            options["prompt_logprobs"] = top if asked is None else max(top, asked) if counts(top, asked) else asked
        prompts = [truncated(p, body, served) for p in prompts_of(body["prompt"], served.tokenizer)]
        return cls(prompts, options, choices_per_prompt(body), *answer_form(body))

    @classmethod
    def parse_chat(cls, body: dict, served: Served) -> Completion:
        """A /v1/chat/completions body: its messages through the chat template, encoded. Without a
        max_tokens (or max_completion_tokens) the reply may fill the context, as in vLLM."""
        CHAT_COMPLETIONS.check(body, served.model_name)
        if body.get("top_logprobs") is not None and not body.get("logprobs"):
            raise BadRequest("top_logprobs needs logprobs: true")
        text, tools = rendered_chat(body, served)
        encoded = served.tokenizer.encode(text)
        prompt = truncated(encoded, body, served)
        if len(prompt) < len(encoded):  # its reply is read against what the model sees (an open <think>)
            text = served.tokenizer.decode(prompt)
        limit = next((body[k] for k in ("max_completion_tokens", "max_tokens") if body.get(k) is not None),
                     max(1, served.max_model_len - len(prompt)))
        options = {**Endpoint.sampling(body, served.sampling_defaults), "max_new_tokens": limit,
                   "logprobs": (body.get("top_logprobs") or 0) if body.get("logprobs") else None}
        fmt = served.reply_format
        one_call = body.get("parallel_tool_calls") is False
        if (forced := forced_call(body, tools)) is not None:
            if options["structured_output"] is not None:
                raise BadRequest(f"tool_choice {body['tool_choice']!r} holds the answer to the tools' calls: "
                                 "no response_format or structured_outputs beside it")
            try:
                options["structured_output"] = StructuredOutput(json_schema=forced_calls_schema(tools, forced, one_call))
            except ValueError as e:
                raise BadRequest(str(e))
        reply = ReplyParser.for_request(fmt, text, tools, forced) if fmt.reasoning or tools else None
        if reply is not None:  # its text keeps the markup the parser reads, special tokens or not
            options["kept_special_ids"] = reply.markup_ids(served.tokenizer)
        if reply is not None and options["structured_output"] is not None:  # the reasoning is free
            options["structured_output"] = reply.hold_answer(options["structured_output"], served.tokenizer)
        limit_field = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        return cls([prompt], options, choices_per_prompt(body), *answer_form(body), chat=True, reply=reply,
                   one_call=one_call, fields=(("max_new_tokens", limit_field), ("logprobs", "top_logprobs")))

    def call(self) -> Call:
        """An engine request per choice, in OpenAI's order (prompt i's j-th is choice i * n + j); a
        seeded request's j-th has seed + j (vLLM's rule), so that its n samples differ and repeat."""
        seed = self.options["seed"]
        return Call([(p, {**self.options, "seed": choice_seed(seed, j)} if counts(seed) else self.options)  # else refused by name
                     for p in self.prompts for j in range(self.n)], self.n)


def choice_seed(seed: int, j: int) -> int:
    """Choice j's seed: seed + j, past int64's largest wrapped round to its smallest, which has the
    same 64 bits (the sampling key's), as a 64-bit counter would; a seed out of int64 is left as it
    is, to be refused by name."""
    return (seed + j + 2**63) % 2**64 - 2**63 if -2**63 <= seed < 2**63 else seed


PARSERS = {"/v1/completions": Completion.parse, "/v1/chat/completions": Completion.parse_chat}


def tokenize(body: dict, served: Served) -> dict:
    """A prompt's tokens, or a conversation's through the chat template, as the completion endpoints
    encode them."""
    TOKENIZE.check(body, served.model_name)
    if (body.get("prompt") is None) == (body.get("messages") is None):
        raise BadRequest("give prompt (a string) or messages")
    text = body["prompt"] if body.get("prompt") is not None else rendered_chat(body, served)[0]
    tokens = served.tokenizer.encode(text)
    return {"count": len(tokens), "max_model_len": served.max_model_len, "tokens": tokens}


def detokenize(body: dict, served: Served) -> dict:
    DETOKENIZE.check(body, served.model_name)
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not counts(*tokens) or min(tokens, default=0) < 0:
        raise BadRequest(f"tokens must be a list of token ids, got {tokens!r}")
    # An id the model has but its tokenizer lacks (a vocabulary padded past it) decodes to nothing, as
    # in generated text; one past the model is refused, as in a prompt, not dropped unseen.
    if past := [t for t in tokens if t >= served.vocab_size]:
        raise BadRequest(f"tokens must be ids in [0, {served.vocab_size}), the model's vocabulary, got {past[:5]}")
    return {"prompt": served.tokenizer.decode(tokens)}


def tokenizer_info(served: Served) -> dict:
    """The tokenizer's named special tokens and chat template (vLLM's GET /tokenizer_info)."""
    template = served.chat_template
    return {name: None for name in SPECIAL_TOKEN_NAMES} | served.special_tokens | {
        "chat_template": template.templates.get("default") if template else None,
        "model_max_length": served.max_model_len}


TOKENIZER_POSTS = {"/tokenize": tokenize, "/detokenize": detokenize}
GET_PATHS = ("/health", "/v1/models", "/tokenizer_info", "/get_weight_version", "/is_sleeping", "/metrics")
POST_PATHS = (*PARSERS, *TOKENIZER_POSTS, "/reset_prefix_cache", "/update_weights_from_disk", "/sleep", "/wake_up",
              "/release_memory_occupation", "/resume_memory_occupation")


MAX_N = 128  # OpenAI's limit on n


def choices_per_prompt(body: dict) -> int:
    n = 1 if body.get("n") is None else body["n"]
    if not counts(n) or not 1 <= n <= MAX_N:
        raise BadRequest(f"n must be an integer from 1 to {MAX_N}, got {n!r}")
    return n


def counts(*values) -> bool:
    """Whether each value is an integer (JSON's true and false are not)."""
    return all(isinstance(v, int) and not isinstance(v, bool) for v in values)


def answer_form(body: dict) -> tuple[bool, bool, Returned]:
    """stream, include_usage and what else comes back, from a checked body (logprobs counts that
    are not counts the engine refuses)."""
    top = body.get("logprobs") if counts(body.get("logprobs")) else 0
    prompt_top = body.get("prompt_logprobs") if counts(body.get("prompt_logprobs")) else None
    return (bool(body.get("stream")), bool((body.get("stream_options") or {}).get("include_usage")),
            Returned(bool(body.get("return_token_ids")), bool(body.get("return_tokens_as_token_ids")),
                     bool(body.get("echo")), top, prompt_top, bool(body.get("include_stop_str_in_output"))))


def rendered_chat(body: dict, served: Served) -> tuple[str, list[dict] | None]:
    """A checked body's messages (and tools) through the chat template: the prompt text, and the
    tools the reply is to be read for."""
    if served.chat_template is None:
        raise BadRequest("this model has no chat template (chat_template.jinja, or tokenizer_config.json's "
                         "chat_template): start the server with --chat-template FILE, or POST /v1/completions")
    if body.get("messages") is None:
        raise BadRequest("messages is required")
    go_on = bool(body.get("continue_final_message"))
    add = not go_on if body.get("add_generation_prompt") is None else body["add_generation_prompt"]
    tools = offered_tools(body, served.reply_format)
    try:
        return served.chat_template.render(chat_messages(body["messages"]), add_generation_prompt=add,
                                           continue_final_message=go_on, tools=tools,
                                           variables=body.get("chat_template_kwargs")), tools
    except ChatTemplateError as e:
        raise BadRequest(str(e))


def offered_tools(body: dict, fmt: ReplyFormat) -> list[dict] | None:
    """The request's tools, checked, for the template to render and the reply to be read for; None
    when it offers none or tool_choice is "none" (the model is not shown them)."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if choice not in (None, "auto", "none", "required") and not isinstance(choice, dict):
        raise BadRequest(f"tool_choice must be 'auto', 'none', 'required' or a named function, got {choice!r}")
    for i, tool in enumerate(tools or ()):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not (isinstance(function, dict) and tool.get("type") == "function" and isinstance(function.get("name"), str)
                and function["name"] and isinstance(function.get("parameters", {}), (dict, type(None)))):
            raise BadRequest(f'tools[{i}] must be {{"type": "function", "function": {{"name": ..., "parameters": '
                             f'{{...}}}}}}, got {tool!r}')
    if not tools or choice == "none":
        return None
    if fmt.tool_calls is None and forced_call(body, tools) is None:  # a forced answer is JSON, in no family's markup
        raise BadRequest("this model's tool calls are not read: its chat template writes none in a format mixserve "
                         f"knows ({', '.join(TOOL_CALL_FORMATS)}); start the server with --tool-call-parser NAME")
    return tools


def forced_call(body: dict, tools: list[dict] | None) -> str | None:
    """tool_choice "required" or the named function's name (the answer is a call, held to
    forced_calls_schema), or None (the model may call or not); a tool_choice that forces a call of
    tools not offered is refused."""
    choice = body.get("tool_choice")
    if choice == "required":
        if not tools:
            raise BadRequest('tool_choice "required" needs tools')
        return choice
    if not isinstance(choice, dict):
        return None
    name = (choice.get("function") or {}).get("name") if isinstance(choice.get("function"), dict) else None
    if choice.get("type") != "function" or not isinstance(name, str):
        raise BadRequest(f'a named tool_choice is {{"type": "function", "function": {{"name": ...}}}}, got {choice!r}')
    if name not in {t["function"]["name"] for t in tools or ()}:
        raise BadRequest(f"tool_choice names {name!r}, which tools does not offer")
    return name


def chat_messages(messages: list) -> list[dict]:
    """OpenAI's messages as the template reads them: a content given as parts becomes their texts
    joined by newlines (vLLM's "string" content form, which chat templates read); a tool call's
    arguments given as a JSON object's text become the object (vLLM's rule: GLM's template iterates
    them); other fields (name, tool_call_id, reasoning_content, ...) pass as they are. Parts other
    than text are refused: this server serves text models."""
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise BadRequest(f"messages[{i}] must be an object with a string role, got {message!r}")
        content = message.get("content")
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise BadRequest(f"messages[{i}].content: only text parts ({{\"type\": \"text\", \"text\": ...}}) "
                                 f"are served, got {content!r}")
            content = "\n".join(p["text"] for p in content)
        elif content is not None and not isinstance(content, str):
            raise BadRequest(f"messages[{i}].content must be a string or a list of text parts, got {content!r}")
        out.append({**message, "content": content})
        if message.get("tool_calls") is not None:
            out[-1]["tool_calls"] = template_tool_calls(f"messages[{i}].tool_calls", message["tool_calls"])
    return out


def template_tool_calls(where: str, calls) -> list[dict]:
    if not isinstance(calls, list) or not all(isinstance(c, dict) and isinstance(c.get("function"), dict)
                                              and isinstance(c["function"].get("name"), str) for c in calls):
        raise BadRequest(f'{where} must be a list of {{"id": ..., "type": "function", "function": {{"name": ..., '
                         f'"arguments": ...}}}}, got {calls!r}')
    out = []
    for call in calls:
        arguments = call["function"].get("arguments")
        if isinstance(arguments, str):
            with contextlib.suppress(ValueError):
                parsed = json.loads(arguments)
                arguments = parsed if isinstance(parsed, dict) else arguments
        out.append({**call, "function": {**call["function"], "arguments": arguments}})
    return out


def truncated(prompt: list[int], body: dict, served: Served) -> list[int]:
    """The prompt's last truncate_prompt_tokens tokens (vLLM's left truncation; -1: the context
    limit); the whole prompt without the field."""
    keep = body.get("truncate_prompt_tokens")
    if keep is None:
        return prompt
    if not counts(keep) or not (keep == -1 or 1 <= keep <= served.max_model_len):
        raise BadRequest(f"truncate_prompt_tokens must be -1 (the context limit) or an integer from 1 to the "
                         f"context limit, max_model_len ({served.max_model_len}), got {keep!r}")
    return prompt[-(served.max_model_len if keep == -1 else keep):]


def prompts_of(prompt, tokenizer: Tokenizer) -> list[list[int]]:
    """OpenAI's prompt forms: a string, a list of token ids, or a list of either (one choice each).
    The engine checks the ids (it refuses booleans, which JSON's true would give)."""
    def token_ids(p) -> bool:
        return isinstance(p, list) and all(isinstance(t, int) for t in p)

    if isinstance(prompt, str) or token_ids(prompt):
        prompt = [prompt]
    elif not (isinstance(prompt, list) and prompt and all(isinstance(p, str) or token_ids(p) for p in prompt)):
        raise BadRequest("prompt must be a string, a list of token ids, or a non-empty list of strings or of "
                         "token-id lists")
    return [tokenizer.encode(p) if isinstance(p, str) else p for p in prompt]


class Choice:
    """One prompt's completion as it streams: its tokens, its text so far (less what may still turn
    out to start a stop string: that is held back, as vLLM holds it) and its logprobs, in OpenAI's form
    (a text completion's, or with chat: an assistant message's, streamed as deltas)."""

    def __init__(self, index: int, prompt: list[int], tokenizer: Tokenizer, stop, returned: Returned,
                 chat: bool = False, reply: ReplyStream | None = None, stop_token_ids=(),
                 text: Tokenizer | LeavingOut | None = None):
        self.index, self.prompt, self.tokenizer, self.returned, self.chat = index, prompt, tokenizer, returned, chat
        # the completion's text is decoded with `text` (skip_special_tokens: tokenizer.text_tokenizer's);
        # logprobs name tokens, and echo gives the prompt, by the tokenizer's own decoding
        self.text_tokenizer = text or tokenizer
        self.stop_token_ids = stop_token_ids  # the request's own (its stop_reason names them, not the model's end)
        self.reply = reply  # a chat reply read for reasoning and tool calls (else its text is the content)
        self.announced = False  # a chat stream's first delta names the role
        self.hold = max(map(len, stop_strings(stop)), default=1) - 1
        self.tokens: list[int] = []
        self.decoder = IncrementalDecoder(self.text_tokenizer)
        self.offsets: list[int] = []  # each token's first character in the text
        self.sent = 0  # characters of the text already sent
        self.result: Result | None = None
        self.prompt_logprobs = None
        # echo: the prompt's text, and each of its tokens' first character there
        self.echo_text, self.echo_offsets = decoded_with_offsets(prompt, tokenizer) if returned.echo else ("", [])

    def add(self, update: Update) -> dict:
        """The update as a chunk's choice: the text, tokens and logprobs it adds."""
        start = len(self.tokens)
        self._extend(update.new_tokens)
        self.prompt_logprobs = self.prompt_logprobs or update.prompt_logprobs
        self.result = update.result
        if self.result is None:
            text = self.decoder.visible[: max(self.sent, len(self.decoder) - self.hold)]
        else:
            text = run.output_text(self.text_tokenizer, self.result, self.returned.include_stop_str)
        new, self.sent = text[self.sent:], max(self.sent, len(text))
        return self.choice(self.streamed_part(new, text), start, update.new_logprobs)

    def whole(self, result: Result) -> dict:
        """The finished completion as one choice (a response not streamed), from its Result alone: the
        steps before it cost the handler nothing (its thread would take the GIL from the engine's)."""
        self.result, self.prompt_logprobs = result, result.prompt_logprobs
        if result.logprobs is not None:
            self._extend(result.tokens)  # the text offsets
        else:
            self.tokens = list(result.tokens)
        return self.choice(self.whole_part(run.output_text(self.text_tokenizer, result, self.returned.include_stop_str)), 0,
                           result.logprobs)

    def _extend(self, tokens: list[int]) -> None:
        extend_decoded(self.decoder, self.tokens, self.offsets, tokens)

    def whole_part(self, text: str) -> dict:
        """The finished text's field: a text completion's text, or a chat reply's message."""
        if not self.chat:
            return {"text": text}
        return {"message": self.reply.message(text) if self.reply else {"role": "assistant", "content": text}}

    def streamed_part(self, new: str, text: str) -> dict:
        """A stream chunk's field for the new text (text: all of it so far): a text completion's text,
        or a chat stream's delta."""
        if not self.chat:
            return {"text": new}
        delta = self.reply.delta(text, final=self.result is not None) if self.reply else {"content": new}
        if not self.announced:
            delta, self.announced = {"role": "assistant", **delta}, True
        return {"delta": delta}

    def choice(self, part: dict, start: int, logprobs: list[TokenLogprobs] | None) -> dict:
        r = self.result
        done = r is not None and r.status == "ok"
        if self.echo_text and start == 0:
            part = {"text": self.echo_text + part["text"]}
        out = {"index": self.index, **part,
               "logprobs": None if logprobs is None else self.openai_logprobs(start, logprobs),
               "finish_reason": self.finish_reason() if done else None,
               "stop_reason": self.stop_reason() if done else None}
        if done:  # which weights gave which tokens (a span per update_weights it ran through)
            out["weight_versions"] = [[first, version] for first, version in r.weight_versions]
        # --enable-return-routed-experts: [position][MoE layer][k]; --enable-return-indexer-topk:
        # [position][indexer layer][index_topk]. The output's rows: the tokens fed back, all but the last.
        for name, rows in (("routed_experts", r.routed_experts), ("indexer_topk", r.indexer_topk)) if done else ():
            if rows is not None:
                out[f"prompt_{name}"], out[name] = rows[: len(self.prompt)].tolist(), rows[len(self.prompt):].tolist()
        if self.returned.token_ids:
            out["token_ids"] = self.tokens[start:]
            if start == 0:
                out["prompt_token_ids"] = self.prompt
        top = self.returned.prompt_top
        if top is not None and self.prompt_logprobs is not None and start == 0:  # vLLM's form: {id: logprob, rank, text}
            out["prompt_logprobs"] = [lp and {str(t): {"logprob": v, "rank": rank, "decoded_token": self.name(t)}
                                              for t, (v, rank) in ranked(token, lp, top).items()}
                                      for token, lp in zip(self.prompt, self.prompt_logprobs)]
        return out

    def stop_reason(self) -> int | str | None:
        """vLLM's: the stop string or stop_token_ids token that ended it; None for the length or the
        model's end token."""
        why = self.result.stop_reason
        return why if isinstance(why, str) or why in self.stop_token_ids else None

    def finish_reason(self) -> str:
        if self.result.stop_reason is None:
            return "length"
        # OpenAI's: a call of the function tool_choice named finishes as "stop"
        called = self.reply is not None and self.reply.called and self.reply.parser.forced in (None, "required")
        return "tool_calls" if called else "stop"

    def openai_logprobs(self, start: int, logprobs: list[TokenLogprobs]) -> dict:
        if self.chat:  # each token with its own bytes (part of a character's, maybe), and its likeliest alternatives
            named = lambda t, v: {"token": self.name(t), "logprob": v, "bytes": list(self.tokenizer.token_bytes(t))}
            return {"content": [{**named(t, lp.logprob), "top_logprobs": [named(a, v) for a, v in lp.top]}
                                for t, lp in zip(self.tokens[start:], logprobs)]}
        tokens = self.tokens[start : start + len(logprobs)]
        offsets = [len(self.echo_text) + o for o in self.offsets[start : start + len(logprobs)]]
        if self.returned.echo and start == 0:  # the prompt's first, as OpenAI echoes them (null for the first)
            tokens, offsets = [*self.prompt, *tokens], [*self.echo_offsets, *offsets]
            logprobs = [*self.prompt_logprobs, *logprobs]
        top = self.returned.top  # with the token itself, as OpenAI's legacy API and vLLM list them: up to top + 1
        return {"tokens": [self.name(t) for t in tokens],
                "token_logprobs": [lp and lp.logprob for lp in logprobs],
                "top_logprobs": [lp and {self.name(t): v for t, v in [*lp.top[:top], (token, lp.logprob)]}
                                 for token, lp in zip(tokens, logprobs)],
                "text_offset": offsets}

    def name(self, token: int) -> str:
        """A token as logprobs name it: its text, or "token_id:N" (vLLM's return_tokens_as_token_ids)."""
        return f"token_id:{token}" if self.returned.ids_as_names else self.tokenizer.decode([token])


def lift_prompt_fields(choices: list[dict], chat: bool) -> dict:
    """vLLM's chat response holds the conversation's prompt_token_ids and prompt_logprobs once, beside
    the choices (all of them share the prompt), where a completion's choices each hold their own
    prompt's: for a chat, these fields taken off the choices."""
    return {name: c.pop(name) for c in choices for name in ("prompt_token_ids", "prompt_logprobs")
            if chat and name in c}


def ranked(token: int, lp: TokenLogprobs, top: int) -> dict[int, tuple[float, int]]:
    """The token's (logprob, rank), then each of the top likeliest's."""
    return {token: (lp.logprob, lp.rank), **{t: (v, i + 1) for i, (t, v) in enumerate(lp.top[:top]) if t != token}}


def extend_decoded(decoder: IncrementalDecoder, ids: list[int], offsets: list[int], tokens: list[int]) -> None:
    """Append tokens to ids (decoder's), and each one's first character in the text to offsets."""
    for token in tokens:
        offsets.append(len(decoder))
        ids.append(token)
        decoder.add(ids)


def decoded_with_offsets(ids: list[int], tokenizer: Tokenizer) -> tuple[str, list[int]]:
    """ids' text, and each token's first character in it."""
    offsets = []
    extend_decoded(IncrementalDecoder(tokenizer), [], offsets, ids)
    return tokenizer.decode(ids), offsets


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: a benchmark client reuses its connections
    timeout = 5  # seconds a kept-alive connection may idle before its thread closes it (uvicorn's default)
    server: "Server"
    looked = 0.0  # when next_update last looked whether the client is still there
    responded = False  # whether this POST has begun its response (a later failure can only cut it)
    cors_headers: dict[str, str] = {}  # what every response to this request carries (mixserve/cors.py)

    def log_message(self, fmt, *args):  # one line per request on stderr, as vLLM logs them
        if self.server.verbose:
            super().log_message(fmt, *args)

    def authorized(self) -> bool:
        """Whether the request carries the server's API key (--api-key; /health and /metrics need
        none: load balancers and Prometheus ask without). Else it has its 401."""
        key = self.server.api_key
        if key is None or self.path in OPEN_PATHS:
            return True
        if hmac.compare_digest(self.headers.get("Authorization", "").encode(), f"Bearer {key}".encode()):
            return True
        self.close_connection = True  # its body is left unread
        self.send_json(401, error_body(BadRequest("a missing or wrong API key: send the header "
                                                  "`Authorization: Bearer KEY` (the server's --api-key)", 401,
                                                  "authentication_error")))
        return False

    def allowed_origin(self) -> bool:
        """Whether the request may go on: it came from no browser page, or from one whose origin the
        server allows (it then carries the CORS headers). A preflight is answered here, a request
        from another origin refused (403): both need no API key, as browsers send none with them."""
        cors, origin = self.server.cors, self.headers.get("Origin")
        method = self.headers.get("Access-Control-Request-Method")
        if self.command == "OPTIONS" and origin is not None and method is not None:
            why, self.cors_headers = cors.preflight(origin, method, self.headers.get("Access-Control-Request-Headers", ""),
                                                    ("GET", "POST"))
        elif (why := cors.refusal(origin)) is None:
            self.cors_headers = cors.response_headers(origin)
            return True
        self.close_connection = True  # a body it may have sent is left unread
        if why is None:  # an allowed preflight
            self.send_response(204)
            self.send_header("Content-Length", "0")
            self.end_headers()
        else:
            self.send_json(403, error_body(BadRequest(why, 403, "permission_error")))
        return False

    def do_GET(self):
        self.respond(self.get)

    def do_POST(self):
        self.respond(self.post)

    def do_PUT(self):
        self.respond(self.not_served)

    do_DELETE = do_PATCH = do_OPTIONS = do_PUT

    def respond(self, handle) -> None:
        """handle() the request, if authorized: a BadRequest is its 4xx, any other failure (a bug)
        its 500 (or its stream cut), and the server goes on."""
        self.responded = False
        self.path, _, query = self.path.partition("?")
        self.query = urllib.parse.parse_qs(query, keep_blank_values=True)
        if not self.allowed_origin() or not self.authorized():
            return
        try:
            handle()
        except BadRequest as e:
            self.send_json(e.status, error_body(e), e.headers)
        except (BrokenPipeError, ConnectionResetError):
            pass
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            self.close_connection = True
            if not self.responded:
                self.send_json(500, error_body(BadRequest(f"the server failed on this request: {e!r}", 500,
                                                          "server_error")))

    def get(self) -> None:
        if self.path == "/health":
            alive = self.server.loop.alive
            self.send_json(200 if alive else 503, {} if alive else error_body(self.server.loop.stopped()))
        elif self.path == "/v1/models":
            self.send_json(200, {"object": "list", "data": [{
                "id": self.server.served.model_name, "object": "model", "created": self.server.started,
                "owned_by": "mixserve", "max_model_len": self.server.served.max_model_len}]})
        elif self.path == "/is_sleeping":  # vLLM's
            self.send_json(200, {"is_sleeping": self.server.loop.engine.sleeping})
        elif self.path == "/get_weight_version":  # SGLang's: the weight_version of the last update
            self.send_json(200, {"weight_version": self.server.loop.engine.weight_version})
        elif self.path == "/tokenizer_info":
            self.send_json(200, tokenizer_info(self.server.served))
        elif self.path == "/metrics":
            loop = self.server.loop
            payload = prometheus(loop.engine, loop.requests, loop.cancelled).encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)
        else:
            self.not_served()

    def post(self) -> None:
        if self.path == "/reset_prefix_cache":  # vLLM's: cached pages no request maps are freed
            self.read_body()  # whatever it holds: left unread, it would be read as the next request
            self.send_json(200, {"freed_pages": self.server.loop.between_steps(lambda e: e.reset_prefix_cache())})
        elif self.path in ("/sleep", "/wake_up"):  # vLLM's: free memory for a trainer, and take it back
            self.read_body()
            self.send_json(200, self.sleep_or_wake())
        elif self.path in ("/release_memory_occupation", "/resume_memory_occupation"):  # SGLang's
            self.send_json(200, self.release_or_resume())
        elif self.path == "/update_weights_from_disk":
            self.send_json(200, self.update_weights(self.read_json()))
        elif self.path in TOKENIZER_POSTS:
            self.send_json(200, TOKENIZER_POSTS[self.path](self.read_json(), self.server.served))
        elif self.path in PARSERS:
            self.complete(PARSERS[self.path](self.read_json(), self.server.served))
        else:
            self.not_served()

    def not_served(self) -> None:
        """A path this server does not serve (404), or not with this method (405, with what it takes)."""
        self.close_connection = True  # a body it may have sent is left unread
        takes = "GET" if self.path in GET_PATHS else "POST" if self.path in POST_PATHS else None
        if takes is not None:
            raise BadRequest(f"{self.command} {self.path}: it takes {takes}", 405, headers={"Allow": takes})
        raise BadRequest(f"no {self.command} {self.path}: this server serves GET {', '.join(GET_PATHS)} and POST "
                         f"{', '.join(POST_PATHS)}", 404)

    def sleep_or_wake(self) -> dict:
        """vLLM's /sleep?level=N (what Engine.sleep frees: tags too, as SGLang's release takes
        them) and /wake_up?tags=T&tags=U (every tag if none)."""
        fields = {"/sleep": {"level", "tags"}, "/wake_up": {"tags"}}[self.path]
        if unknown := sorted(set(self.query) - fields):
            raise BadRequest(f"unknown query parameters {unknown}: {self.path} takes {sorted(fields)}")
        level, tags = self.query.get("level", ["1"]), self.query.get("tags", SLEEP_TAGS)
        if len(level) != 1 or not level[0].isdigit():
            raise BadRequest(f"level must be one integer, got {level}")
        level = int(level[0])
        try:
            if self.path == "/sleep":
                return {"freed_bytes": self.server.loop.between_steps(lambda e: e.sleep(level, tags), 600.0)}
            self.server.loop.between_steps(lambda e: e.wake_up(tags), 600.0)
            return {}
        except ValueError as e:  # the engine's check of level and tags, before it changes anything
            raise BadRequest(str(e)) from e
        except (EngineBusy, WeightsDiscarded) as e:
            raise BadRequest(str(e), 409, "conflict") from e

    def release_or_resume(self) -> dict:
        """SGLang's /release_memory_occupation and /resume_memory_occupation, {"tags": [...]} (every
        tag if none or null), as an RL trainer on the same devices calls them (verl, slime):
        release is sleep at level 2, the weights discarded as SGLang's memory saver drops them, or at
        level 1 with --enable-weights-cpu-backup (SGLang's flag: they come back on resume). Resume
        wakes what was released, but discarded weights: SGLang allocates them empty for an update to
        fill; JAX arrays are replaced, not filled, so they come with the next update_weights, which
        wakes them. "cuda_graph" frees nothing here (XLA's programs keep no graph memory pool) and is
        accepted so that SGLang's clients work."""
        release = self.path == "/release_memory_occupation"
        body = self.read_json(empty={})  # SGLang's client may send none
        if unknown := sorted(set(body) - {"tags"}):
            raise BadRequest(f"unknown fields {unknown}: {self.path} takes ['tags']")
        tags = body.get("tags")
        tags = list(SGLANG_MEMORY_TAGS) if tags is None else tags
        if not (isinstance(tags, list) and tags and all(t in SGLANG_MEMORY_TAGS for t in tags)):
            raise BadRequest(f"tags must be a non-empty list of {list(SGLANG_MEMORY_TAGS)}, got {tags!r}")
        engine_tags = set(tags) & set(SLEEP_TAGS)
        level = 1 if self.server.weights_cpu_backup else 2

        def call(engine: Frontend) -> int:
            if release:
                return engine.sleep(level, engine_tags) if engine_tags else 0
            woken = engine_tags - ({"weights"} if engine.weights_discarded else set())
            if woken:
                engine.wake_up(woken)
            return 0

        try:
            freed = self.server.loop.between_steps(call, 600.0)
        except EngineBusy as e:
            raise BadRequest(str(e), 409, "conflict") from e
        return {"freed_bytes": freed} if release else {}

    def update_weights(self, body: dict) -> dict:
        """SGLang's /update_weights_from_disk: the checkpoint at model_path, loaded as the server's
        flags load one (on this thread, while the engine steps), then swapped in between two steps
        (Engine.update_weights); the requests that ran on the old weights are recomputed, or aborted
        with abort_all_requests. One update at a time, in the order they came."""
        fields = {"model_path", "abort_all_requests", "weight_version", "load_format", "flush_cache"}
        if unknown := sorted(set(body) - fields):
            raise BadRequest(f"unknown fields {unknown}: /update_weights_from_disk takes {sorted(fields)}")
        path, abort = body.get("model_path"), body.get("abort_all_requests", False)
        version = body.get("weight_version")
        if not isinstance(path, str) or not os.path.isdir(path):
            raise BadRequest(f"model_path must be a checkpoint directory on the server, got {path!r}")
        for field, ok, what in (("abort_all_requests", isinstance(abort, bool), "a boolean"),
                                ("weight_version", version is None or isinstance(version, str) and version,
                                 "a non-empty string"),
                                ("load_format", body.get("load_format") in (None, "auto"), "auto (safetensors)"),
                                ("flush_cache", body.get("flush_cache", True) is True,
                                 "true: KV of the old weights is never read with the new")):
            if not ok:
                raise BadRequest(f"{field} must be {what}, got {body[field]!r}")
        if self.server.reload is None:
            raise BadRequest("this server was built without a way to load weights", 501, "server_error")
        running = "abort" if abort else "recompute"

        def swap(engine: Frontend) -> int:
            try:
                return engine.update_weights(*weights, running=running, version=version)
            except ValueError as e:
                raise BadRequest(f"{path}: {e}") from e

        with self.server.updating:
            try:
                weights = self.server.reload(path)
            except (ValueError, OSError) as e:
                raise BadRequest(f"{path}: {e}") from e
            n = self.server.loop.between_steps(swap, timeout_s=600.0)
        return {"success": True, "message": f"serving the weights of {path}; {n} requests "
                                            f"{'aborted' if abort else 'recomputed'}", "num_requests": n}

    def parse_request(self) -> bool:
        self.cors_headers = {}  # one that fails here (a bad request line, a method not served) carries none
        return super().parse_request()

    def send_response(self, code, message=None):
        self.responded = True
        super().send_response(code, message)
        for name, value in self.cors_headers.items():
            self.send_header(name, value)

    def read_body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":  # curl's when it reads stdin
            return self.read_chunks()
        length = self.headers.get("Content-Length", "0")
        if not length.isdigit():  # read(-1) would wait for a kept-alive connection to close
            raise BadRequest(f"Content-Length must be a byte count, got {length!r}")
        return self.rfile.read(int(length))

    def read_chunks(self) -> bytes:
        """A chunked body (HTTP/1.1): hexadecimal size lines, each chunk after its own, until size 0,
        then trailer lines until an empty one."""
        parts = []
        while True:
            line = self.rfile.readline(1 << 16)
            digits = line.split(b";")[0].strip()  # a chunk extension follows ';'
            if not re.fullmatch(rb"[0-9A-Fa-f]{1,16}", digits):  # int() would take -1 (read to the end), 0x, _
                self.close_connection = True  # the rest of the body is left unread
                raise BadRequest(f"a chunk's size must be hexadecimal, got {line[:40]!r}")
            size = int(digits, 16)
            if size == 0:
                break
            parts.append(self.rfile.read(size))
            self.rfile.readline(1 << 16)  # the chunk's line end
        while self.rfile.readline(1 << 16) not in (b"\r\n", b"\n", b""):
            pass
        return b"".join(parts)

    def read_json(self, empty: dict | None = None) -> dict:
        """The body's JSON object; `empty` (if given) for an empty body, which is otherwise refused."""
        body = self.read_body()
        if not body and empty is not None:
            return empty
        try:
            body = json.loads(body)
        except (ValueError, UnicodeDecodeError) as e:
            raise BadRequest(f"the body is not JSON: {e}")
        if not isinstance(body, dict):
            raise BadRequest("the body must be a JSON object")
        return body

    def complete(self, request: Completion) -> None:
        s, served = self.server, self.server.served
        call = s.loop.submit(request.call())
        kind = ("chat.completion.chunk" if request.stream else "chat.completion") if request.chat else "text_completion"
        head = {"id": f"{'chatcmpl' if request.chat else 'cmpl'}-{uuid.uuid4().hex}", "object": kind,
                "created": int(time.time()), "model": served.model_name}
        try:
            first = self.first_updates(call, request.in_body_terms)  # a rejection comes in the first: a 400
            text = text_tokenizer(served.tokenizer, request.options["skip_special_tokens"],
                                  request.options.get("kept_special_ids", ()))
            choices = [Choice(i, p, served.tokenizer, request.options["stop"], request.returned, request.chat,
                              None if request.reply is None else ReplyStream(request.reply, request.one_call),
                              request.options["stop_token_ids"], text)
                       for i, (p, _) in enumerate(call.requests)]
            if request.stream:
                self.send_stream(call, choices, head, first, request.include_usage)
                return
            results = {index: update.result for index, update in self.updates(call, first) if update.result}
            if failed := [(i, r.reason) for i, r in sorted(results.items()) if r.status != "ok"]:
                raise BadRequest("; ".join(f"choice {i}: {why}" for i, why in failed), 500, "server_error")
            whole = [c.whole(results[c.index]) for c in choices]
            # SGLang's: the weights that gave the (first choice's) last tokens
            metadata = {"weight_version": results[0].weight_versions[-1][1]}
            self.send_json(200, {**head, **lift_prompt_fields(whole, request.chat), "choices": whole,
                                 "usage": usage(choices, call.n), "metadata": metadata})
        except (BrokenPipeError, ConnectionResetError, ClientGone):
            pass  # the client has gone
        finally:  # whatever is left of the call (nothing, once answered): its client gone, a rejection, an error here
            s.loop.cancel(call)

    def first_updates(self, call: Call, in_body_terms: Callable[[str], str]) -> list[tuple[int, Update]]:
        """The updates until every choice has had its first; a 400 naming each rejected prompt (once,
        however many of its choices were), in the body's field names."""
        got, seen = [], set()
        while len(seen) < len(call.requests):
            got.append(self.next_update(call))
            seen.add(got[-1][0])
        rejected = {}
        for i, u in sorted(got, key=lambda item: item[0]):
            if u.result is not None and u.result.status == "rejected":
                rejected.setdefault(i // call.n, u.result.reason)
        if rejected:
            several = len(call.requests) > call.n
            raise BadRequest(in_body_terms("; ".join(f"prompt {i}: {why}" if several else why
                                                     for i, why in rejected.items())))
        return got

    def updates(self, call: Call, first: list):
        """first, then every later update, until each choice has its Result."""
        open_choices = len(call.requests)
        for index, update in first:
            open_choices -= update.result is not None
            yield index, update
        while open_choices:
            index, update = self.next_update(call)
            open_choices -= update.result is not None
            yield index, update

    def next_update(self, call: Call) -> tuple[int, Update]:
        """The call's next (prompt index, Update); every POLL_S, whether updates come or not, a look
        at whether the client is still there (a response not streamed writes nothing until the end)."""
        while True:
            if time.monotonic() - self.looked >= POLL_S:
                if self.client_gone():
                    raise ClientGone()
                self.looked = time.monotonic()
            try:
                item = call.updates.get(timeout=POLL_S)
            except queue.Empty:
                continue
            if isinstance(item, BaseException):
                raise item
            return item

    def client_gone(self) -> bool:
        """Whether the client closed its end while we wait (readable, and nothing to read)."""
        readable, _, _ = select.select([self.connection], [], [], 0)
        try:
            return bool(readable) and not self.connection.recv(1, socket.MSG_PEEK)
        except OSError:
            return True

    def send_stream(self, call: Call, choices: list[Choice], head: dict, first: list, include_usage) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        try:
            for index, update in self.updates(call, first):
                choice = choices[index]
                chunk = choice.add(update)
                if choice.result is not None and choice.result.status != "ok":  # streamed tokens passed their checks
                    self.send_event(error_body(BadRequest(f"choice {index}: {choice.result.reason}", 500, "server_error")))
                    continue
                # with include_usage every chunk has the field, null but in the last (OpenAI's form)
                self.send_event({**head, **lift_prompt_fields([chunk], choice.chat), "choices": [chunk],
                                 **({"usage": None} if include_usage else {})})
            if include_usage:
                self.send_event({**head, "choices": [], "usage": usage(choices, call.n)})
        except BadRequest as e:  # the loop stopped mid-stream
            self.send_event(error_body(e))
        self.send_event("[DONE]")
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()

    def send_event(self, data) -> None:
        text = data if isinstance(data, str) else json.dumps(run.finite_or_null(data), allow_nan=False)
        payload = f"data: {text}\n\n".encode()
        self.wfile.write(f"{len(payload):x}\r\n".encode() + payload + b"\r\n")
        self.wfile.flush()

    def send_json(self, status: int, body: dict, headers: dict[str, str] | None = None) -> None:
        payload = json.dumps(run.finite_or_null(body), allow_nan=False).encode()
        self.send_response(status)
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)


class ClientGone(Exception):
    pass


def usage(choices: list[Choice], n: int) -> dict:
    """Each prompt's tokens once, however many choices it has (as vLLM counts them), and of those
    the tokens the prefix cache held (OpenAI's prompt_tokens_details.cached_tokens)."""
    prompt, completion = sum(len(c.prompt) for c in choices[::n]), sum(len(c.tokens) for c in choices)
    cached = sum(c.result.cached_tokens for c in choices[::n] if c.result is not None)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def error_body(e: BadRequest) -> dict:
    return {"error": {"message": str(e), "type": e.kind, "param": None, "code": e.status}}


class Server(http.server.ThreadingHTTPServer):
    """The HTTP server around one EngineLoop. `serve_forever` serves; `close` stops both."""
    daemon_threads = True

    def __init__(self, address: tuple[str, int] | socket.socket, engine: Frontend, served: Served, verbose: bool = False,
                 api_key: str | None = None, reload: Callable[[str], tuple] | None = None,
                 weights_cpu_backup: bool = False, cors: CorsPolicy = CorsPolicy()):
        """address: where to bind, or a socket already listening (make_server binds before it loads);
        cors: the browser pages that may call it (by default none)."""
        bound = isinstance(address, socket.socket)
        super().__init__(address.getsockname() if bound else address, Handler, bind_and_activate=not bound)
        if bound:
            self.socket.close()
            self.socket, self.server_address = address, address.getsockname()
        self.weights_cpu_backup = weights_cpu_backup  # SGLang's release keeps the weights in host memory
        self.loop = EngineLoop(engine)
        self.served, self.verbose, self.api_key, self.started = served, verbose, api_key, int(time.time())
        self.cors = cors
        # checkpoint path -> the engine's weight sets, as update_weights takes them (None: no reloads)
        self.reload = reload
        self.updating = threading.Lock()  # one weight update at a time: each loads a whole weight set

    def handle_error(self, request, client_address) -> None:
        if not isinstance(sys.exc_info()[1], (BrokenPipeError, ConnectionResetError)):  # else: its client went away
            super().handle_error(request, client_address)

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"

    def stop_with_the_loop(self) -> None:
        """Wait until the engine loop stops (integrity "strict" on a failed check), then stop serving."""
        self.loop.join()
        self.shutdown()

    def close(self) -> None:
        self.shutdown()
        self.server_close()
        self.loop.close()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m mixserve.server", description=__doc__.split("\n\n")[0])
    run.add_engine_flags(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    p.add_argument("--port", type=run.counted(0), default=8000, help="port to listen on (0: any free one)")
    p.add_argument("--served-model-name", help="the model's name in requests and responses (default: --model)")
    p.add_argument("--max-logprobs", type=run.counted(0), default=20,
                   help="the most likeliest tokens a request may ask for (vLLM's --max-logprobs)")
    p.add_argument("--chat-template", metavar="FILE",
                   help="a Jinja chat template for /v1/chat/completions, over the checkpoint's own (if it has one)")
    p.add_argument("--reasoning-parser", choices=("auto", "think", "none"), default="auto",
                   help="read a chat reply's <think>...</think> as its reasoning_content (auto: if the chat "
                        "template writes </think>)")
    p.add_argument("--tool-call-parser", choices=("auto", *TOOL_CALL_FORMATS, "none"), default="auto",
                   help="read a chat reply's tool calls in this family's markup (auto: the one the chat template "
                        "writes; none: refuse requests with tools)")
    p.add_argument("--api-key", default=os.environ.get("MIXSERVE_API_KEY") or None,
                   help="refuse requests without `Authorization: Bearer KEY` (but /health and /metrics); "
                        "default: $MIXSERVE_API_KEY, else none needed")
    p.add_argument("--generation-config", default="auto", metavar="auto|vllm|DIR",
                   help="where requests' sampling defaults come from (vLLM's flag): auto, the checkpoint's "
                        "generation_config.json (temperature, top_p, top_k, min_p, repetition_penalty, where it "
                        "recommends them); vllm, OpenAI's; DIR, another directory's generation_config.json")
    p.add_argument("--log-requests", action="store_true", help="log a line per HTTP request on stderr")
    for flag, default, what in (("origins", [], "origins of the browser pages that may call the server (default: none; "
                                                 "vLLM's is [\"*\"]); a request from any other is refused (403)"),
                                ("methods", ["*"], "methods those pages may use"),
                                ("headers", ["*"], "request headers those pages may send")):
        p.add_argument(f"--allowed-{flag}", type=json_strings, default=default, metavar="JSON",
                       help=f"CORS: a JSON list of the {what}; \"*\": any (vLLM's flag)")
    p.add_argument("--allow-credentials", action="store_true",
                   help="CORS: those pages may send cookies and HTTP authentication (vLLM's flag)")
    p.add_argument("--enable-weights-cpu-backup", action="store_true",
                   help="/release_memory_occupation keeps the weights in host memory for /resume_memory_occupation "
                        "(SGLang's flag); without it they are discarded until /update_weights_from_disk")
    return p


def json_strings(text: str) -> list[str]:
    """A flag's JSON list of strings (vLLM's form for its CORS flags)."""
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
        raise argparse.ArgumentTypeError(f"need a JSON list of strings, e.g. '[\"http://localhost:3000\"]', got {text!r}")
    return value


def make_server(argv=None) -> Server:
    """Bind, then load the model and build the engine as mixserve.run does (not yet serving): a
    port in use fails at once, not after a checkpoint's load (as vLLM binds first)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.chat_template is not None and not os.path.isfile(args.chat_template):
        parser.error(f"--chat-template {args.chat_template}: no such file")
    if args.generation_config not in ("auto", "vllm") and not os.path.isdir(args.generation_config):
        parser.error(f"--generation-config {args.generation_config}: neither auto, vllm nor a directory")
    source = generation_config_dir(args.generation_config, args.model)
    try:
        defaults = generation_sampling_defaults(source) if source else {}
    except CheckpointError as e:
        parser.error(f"--generation-config {args.generation_config}: {e}")
    try:
        sock = socket.create_server((args.host, args.port))
    except OSError as e:
        parser.error(f"cannot listen on --host {args.host} --port {args.port}: {e.strerror or e}")
    backend, _, setup = run.start(parser, args, progress=True)
    template = setup.model.chat_template
    if args.chat_template is not None:
        template = ChatTemplate.from_file(args.chat_template, args.model if os.path.isdir(args.model) else None)
    setup.engine.grammars.prepare()  # a model without a tokenizer: its structured requests say why
    d = setup.decoder
    served = Served(args.served_model_name or args.model, setup.model.tokenizer, template,
                    min(d.max_seq_len, d.num_pages * d.page_size), setup.model.config.vocab_size,
                    reply_format(args, template),
                    special_tokens_in(args.model) if os.path.isdir(args.model) else {},
                    defaults)
    if served.sampling_defaults:  # vLLM says so too: a request's output depends on them
        print(f"sampling defaults from {source}/generation_config.json, for requests that leave them out: "
              f"{served.sampling_defaults} (--generation-config vllm: OpenAI's)", file=sys.stderr)
    return Server(sock, setup.engine, served, verbose=args.log_requests, api_key=args.api_key,
                  reload=functools.partial(reloaded, args, backend, setup.prefiller.mesh,
                                           setup.prefiller is setup.decoder),
                  weights_cpu_backup=args.enable_weights_cpu_backup,
                  cors=CorsPolicy(tuple(args.allowed_origins), tuple(args.allowed_methods), tuple(args.allowed_headers),
                                  args.allow_credentials))


def generation_config_dir(generation_config: str, model: str) -> str | None:
    """Where --generation-config reads generation_config.json for a model (a checkpoint directory or
    a preset); None: nowhere (vllm, or a preset with auto)."""
    directory = {"vllm": None, "auto": model}.get(generation_config, generation_config)
    return directory if directory is not None and os.path.isdir(directory) else None


def reloaded(args, backend: str, mesh, one_engine: bool, path: str) -> tuple:
    """The checkpoint at path as update_weights takes it, loaded as the flags loaded the served one
    (onto the prefill mesh): (prefill set, decode set), the decode set None where one set serves both
    on one engine. (Only what it reads is bound: the served weights are not kept alive.)"""
    _, prefill, decode = run.weight_sets(args, path, backend, mesh, progress=False)
    return prefill, None if one_engine and decode is prefill else decode


def reply_format(args, template: ChatTemplate | None) -> ReplyFormat:
    """--reasoning-parser and --tool-call-parser, "auto" read from what the chat template writes."""
    found = ReplyFormat.detect(list(template.templates.values()) if template else [])
    reasoning = found.reasoning if args.reasoning_parser == "auto" else args.reasoning_parser == "think"
    calls = found.tool_calls if args.tool_call_parser == "auto" else TOOL_CALL_FORMATS.get(args.tool_call_parser)
    return ReplyFormat(reasoning, calls)


def main(argv=None) -> None:
    server = make_server(argv)
    served = server.served
    fmt = served.reply_format
    read = [*(["reasoning"] if fmt.reasoning else []), *([f"{fmt.tool_calls.name} tool calls"] if fmt.tool_calls else [])]
    chat = "" if served.chat_template is None else " and /v1/chat/completions" + (
        f"; replies read for {' and '.join(read)}" if read else "")
    print(f"mixserve: serving {served.model_name} at {server.url} (POST /v1/completions{chat})", file=sys.stderr,
          flush=True)
    threading.Thread(target=server.stop_with_the_loop, daemon=True).start()
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    server.server_close()
    if server.loop.error is not None:
        sys.exit(f"mixserve: the engine stopped: {server.loop.error!r}")


if __name__ == "__main__":
    main()
