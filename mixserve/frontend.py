"""What users call on any engine: `submit`, `step`, `generate`, `has_work`, `cancel`.

One engine (mixserve/engine.py) and a prefill/decode pair (mixserve/disaggregated.py) serve
requests the same way; this base class holds that part once. A subclass says how a request is
checked (`_reject_reason`), where it is queued (`_enqueue`), what one turn of its loop does
(`_advance`), and how a request cancelled between turns leaves its queues (`_drop`). Reporting
goes by the requests themselves, so it does not matter which engine of a pair gave a request its
tokens.
"""

from __future__ import annotations

import time
from collections.abc import Collection

import numpy as np

from mixserve.grammar import Grammars, StructuredOutput
from mixserve.request import Request, Result, Update


class Frontend:
    counters: object  # the subclass's counters: `rejections` is counted here
    grammars: Grammars  # the subclass's: the matchers of structured outputs

    def __init__(self):
        self._next_rid = 0
        self.weight_version = "default"  # the served weights' name (SGLang's), set by update_weights
        # return_routed_experts / return_indexer_topk: a position's rows (request.replay_dtype:
        # a field per Result array returned, routed_experts, indexer_topk). None: neither.
        self.replay_dtype: np.dtype | None = None
        self._unreported: dict[int, Request] = {}  # submitted, not yet reported finished by step()
        self._seeds = np.random.default_rng()  # fresh entropy: the seeds of requests that give none

    def _reject_reason(self, req: Request) -> str | None:
        raise NotImplementedError

    def _enqueue(self, req: Request) -> None:
        raise NotImplementedError

    def _advance(self) -> None:
        raise NotImplementedError

    def _drop(self, req: Request) -> None:
        raise NotImplementedError

    def submit(self, prompt: list[int], *, max_new_tokens: int, temperature: float = 0.0, top_p: float = 1.0,
               top_k: int = 0, min_p: float = 0.0, seed: int | None = None, stop_token_ids: tuple[int, ...] = (),
               stop: str | tuple[str, ...] | None = (), ignore_eos: bool = False, min_tokens: int = 0,
               logprobs: int | None = None, prompt_logprobs: int | None = None, logit_bias: dict[int, float] | None = None,
               allowed_token_ids: tuple[int, ...] | None = None, repetition_penalty: float = 1.0,
               frequency_penalty: float = 0.0, presence_penalty: float = 0.0,
               structured_output: StructuredOutput | None = None, cache_salt: str | None = None,
               priority: int = 0, skip_special_tokens: bool = True, kept_special_ids: Collection[int] = ()) -> int:
        """Queue one request and return its id; `step` runs it. A request that can never be served
        is rejected here, without raising: its Update (status "rejected", with the reason) comes
        out of the next step. Requests with the same prompt, seed and options sample the same;
        without a seed each request draws its own (vLLM's rule), reported in its Result. Sampling
        follows vLLM's order: temperature, min_p, top_k, then top_p over what is left.
        stop_token_ids: this request's stop tokens beside the engine's; ignore_eos: it stops on
        its own stop tokens only (a benchmark's fixed output length), as in vLLM. stop: a string or
        strings that end it once its output, decoded by the model's tokenizer, contains one (its
        Result's stop_reason says which). min_tokens: neither ends it before it has that many
        tokens (its stop tokens are not sampled until then; vLLM's), unless its structured output
        is complete sooner, and allows only its end. logprobs=n: each token's
        log-probability and rank, and the n likeliest tokens (n <= the engine's max_logprobs), in
        its Updates and Result.
        prompt_logprobs=n: the same for each prompt token after the first, from the prefill that
        computes it (the request then shares no cached prefix), in its first Update and Result.
        logit_bias: token id -> a number in [-100, 100] added to its logit before sampling, greedy
        included (OpenAI's; at most MAX_LOGIT_BIAS ids); logprobs stay the model's own.
        allowed_token_ids: the only tokens it may sample, greedy included (vLLM's; the end token
        too only if listed), applied as a structured output's mask is (not both).
        Then the penalties, as vLLM applies them, greedy included: a token of the prompt or output
        has its logit divided by repetition_penalty (> 0; 1: off) where positive, multiplied
        where not; a token of the output loses frequency_penalty (in [-2, 2]) per occurrence and
        presence_penalty (in [-2, 2]) once. logprobs stay the model's own.
        structured_output: a JSON schema, regex, choice or grammar the output must match (vLLM's
        structured outputs, mixserve/grammar.py): tokens that cannot continue a match are never
        picked, and the output ends on a stop token once the match is complete (one that does not
        compile is rejected with llguidance's reason). cache_salt: prefix-cache pages are shared only
        between requests of the same salt (vLLM's: one per tenant, so that no tenant can time
        another's cached prompts); its Result's cached_tokens counts the prompt tokens the cache gave.
        priority: with the engine's schedule_policy "priority", lower values are admitted first and
        preempted last (vLLM's; ties: first come, first served); other policies refuse any but 0.
        skip_special_tokens: the text its stop strings are found in leaves out the tokenizer's
        special tokens (vLLM's, true by default; Tokenizer.special_ids), but kept_special_ids."""
        return self._submit(prompt, 0, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                            top_k=top_k, min_p=min_p, seed=self._seed(seed), stop_token_ids=stop_token_ids,
                            stop=stop_strings(stop), ignore_eos=ignore_eos, min_tokens=min_tokens, logprobs=logprobs,
                            prompt_logprobs=prompt_logprobs, logit_bias=logit_bias, allowed_token_ids=allowed_token_ids,
                            repetition_penalty=repetition_penalty, frequency_penalty=frequency_penalty,
                            presence_penalty=presence_penalty, structured_output=structured_output,
                            cache_salt=cache_salt, priority=priority, skip_special_tokens=skip_special_tokens,
                            kept_special_ids=kept_special_ids).rid

    def cancel(self, rid: int) -> bool:
        """Stop request rid now (its client has gone, as vLLM aborts a disconnected request): it
        finishes "aborted" with the reason "cancelled", keeping the tokens it has, its pages go back
        at once, and its Update comes out of the next step. False, changing nothing, if it has
        already finished or was never submitted."""
        req = self._unreported.get(rid)
        if req is None or req.result is not None:
            return False
        req.finish("aborted", "cancelled")
        self._drop(req)
        return True

    def _weights_changed(self, version: str | None) -> None:
        """New weights serve from the next step: every unfinished request's next tokens are
        theirs. version: their name (None: the name stays, and the spans still split there)."""
        if version is not None:
            self.weight_version = version
        for req in self._unreported.values():
            if req.result is None:
                req.weights_changed(self.weight_version)

    @property
    def sleeping(self) -> bool:
        """Whether sleep freed its KV pools or weights (Engine.sleep): steps run nothing until wake_up."""
        return False

    def has_work(self) -> bool:
        """Whether a submitted request has not yet been reported finished by `step`."""
        return bool(self._unreported)

    def step(self) -> list[Update]:
        """One turn of the loop. Returns an Update for every request that got tokens or finished
        in it (a request whose prefill ends gets its first token)."""
        self._advance()
        updates = []
        for req in list(self._unreported.values()):
            if len(req.out) > req.streamed or req.result is not None:
                new_logprobs = None if req.logprobs is None else req.out_logprobs[req.streamed:]
                prompt_logprobs = None
                if req.streamed == 0:  # its first Update (the only one before a token streamed) has them
                    prompt_logprobs = req.result.prompt_logprobs if req.result else req.reported_prompt_logprobs()
                updates.append(Update(req.rid, req.out[req.streamed:], req.result, new_logprobs, prompt_logprobs))
                req.streamed = len(req.out)
                if req.result is not None:
                    del self._unreported[req.rid]
        return updates

    def generate(self, prompts: list[list[int]], *, max_new_tokens: int, temperature: float = 0.0,
                 top_p: float = 1.0, top_k: int = 0, min_p: float = 0.0, seed: int | None = None,
                 stop_token_ids: tuple[int, ...] = (), stop: str | tuple[str, ...] | None = (), ignore_eos: bool = False,
                 min_tokens: int = 0, logprobs: int | None = None, prompt_logprobs: int | None = None,
                 logit_bias: dict[int, float] | None = None, allowed_token_ids: tuple[int, ...] | None = None,
                 repetition_penalty: float = 1.0,
                 frequency_penalty: float = 0.0, presence_penalty: float = 0.0,
                 structured_output: StructuredOutput | None = None, cache_salt: str | None = None,
                 priority: int = 0, skip_special_tokens: bool = True,
                 kept_special_ids: Collection[int] = ()) -> list[Result]:
        """Serve prompts to completion (one batch: they share the slots, pages and steps); results
        in prompt order. Prompt i samples with keys from (seed, i, token index); without a seed the
        call draws one, reported in each Result. The options are submit's, for every prompt."""
        if self.sleeping:  # nothing would ever step it
            raise RuntimeError("the engine is asleep: wake_up() before generate()")
        if self._unreported:
            raise RuntimeError(f"{len(self._unreported)} submitted requests are unfinished: step() until "
                               "has_work() is False before generate(), which would swallow their updates")
        options = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
                       seed=self._seed(seed), stop_token_ids=stop_token_ids, stop=stop_strings(stop),
                       ignore_eos=ignore_eos, min_tokens=min_tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                       logit_bias=logit_bias, allowed_token_ids=allowed_token_ids,
                       repetition_penalty=repetition_penalty, frequency_penalty=frequency_penalty,
                       presence_penalty=presence_penalty, structured_output=structured_output, cache_salt=cache_salt,
                       priority=priority, skip_special_tokens=skip_special_tokens,
                       kept_special_ids=kept_special_ids)
        requests = [self._submit(p, i, **options) for i, p in enumerate(prompts)]
        while self._unreported:
            self.step()
        return [r.result for r in requests]

    def options_reason(self, **options) -> str | None:
        """Why every request with these options (submit's keyword arguments) would be rejected,
        whatever its prompt (None: a one-token prompt would be served): a CLI's shared flags."""
        options = {**options, "seed": self._seed(options.get("seed")), "stop": stop_strings(options.get("stop"))}
        req = Request(-1, [0], **options)
        return self._reject_reason(req) or self._start_matcher(req)

    def _start_matcher(self, req: Request) -> str | None:
        """Give a request with a structured output its matcher; or why it can have none."""
        if req.structured_output is None:
            return None
        if not isinstance(req.structured_output, StructuredOutput):
            return f"structured_output must be a StructuredOutput, got {req.structured_output!r}"
        matcher = self.grammars.matcher(req.structured_output, req.ignore_eos)
        if isinstance(matcher, str):
            return matcher
        req.matcher, req.governed = matcher, not req.structured_output.after
        req.opener_taken = 0 if req.structured_output.opens else None
        return None

    def _seed(self, seed):
        # 63 drawn bits: with 32, two of 100k unseeded requests would share a seed with odds of 2 in 3
        return int(self._seeds.integers(2**63)) if seed is None else seed

    def _submit(self, prompt, index: int, **options) -> Request:
        """options: Request's per-request fields (max_new_tokens, temperature, ..., ignore_eos)."""
        req = Request(self._next_rid, list(prompt) if isinstance(prompt, (list, tuple)) else prompt, index=index,
                      t_submit=time.perf_counter(), **options)
        self._next_rid += 1
        reason = self._reject_reason(req) or self._start_matcher(req)
        if reason:
            req.result = Result([], "rejected", reason, seed=req.seed, logprobs=None if req.logprobs is None else [],
                                prompt_logprobs=None if req.prompt_logprobs is None else [])
            self.counters.rejections += 1
        else:
            req.max_new_tokens = int(req.max_new_tokens)  # the engine's arithmetic on it must not wrap (numpy)
            req.weights_changed(self.weight_version)
            if self.replay_dtype is not None:
                req.replay_rows = np.zeros(0, self.replay_dtype)
            self._enqueue(req)
        self._unreported[req.rid] = req
        return req


def stop_strings(stop) -> tuple:
    """stop as vLLM takes it: None (none), one string, or several."""
    return () if stop is None else (stop,) if isinstance(stop, str) else stop
