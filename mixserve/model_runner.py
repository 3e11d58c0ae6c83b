"""Runs the model over the paged KV pools (nano-vllm's ModelRunner): chunked prefill of the
prefilling requests (a row each, every call one chunk of each, as many calls as the engine's
budget allows) and the batched decode step over the live requests, with the integrity check
traced into every call (prefill and decode) when it is on:
  off     no check is traced into the calls at all
  check   a batched verify() of the page table before the call touches the pages; a failing row
          writes and reads nothing, and the engine aborts its request with the reason
  strict  the same, and the check's error (jax.experimental.checkify) is raised once the engine
          has aborted the failing requests: the pools stay valid and the others go on
The model reaches the pools only through PagedKV (mixserve/kv_cache.py), which also picks the
attention kernels (attention_backend).

A step sees only the first `attended_pages` columns of the page table: enough for its longest row,
rounded up to a power of two. The XLA attention gathers and masks every column it is given, so
with the whole table (max_seq_len / page_size columns: 8192 for Kimi's 131072 positions at page 16)
a short request would pay for the longest one possible. Likewise a decode step runs `decode_rows`
rows, the live requests rounded up to a power of two, not max_batch: 3 live requests in an engine
of 64 slots pay for 4 rows of experts, attention and sampling, not 64 (what CUDA-graph batch sizes
do in vLLM and SGLang), and a prefill chunk is as long as its tokens rounded up to a power of two
(`prefill_tokens`, for the longest row of the call), not prefill_chunk: a 5-token prompt does not
pay for 64. The powers of two keep the compiled shapes to a handful: each (rows, width) of decode
and (rows, chunk, width) of prefill compiles once, and raising min_decode_rows or
min_prefill_tokens trades padding for fewer compiles.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify
from jax.sharding import Mesh

from mixserve import page_table as pt
from mixserve import sharding
from mixserve.kv_cache import KVFormat, PagedKV, StepInputs, init_pools
from mixserve.model import Model
from mixserve.request import Request, TokenLogprobs


class Output(NamedTuple):
    """What a prefill or decode returns, per request (decode: per row, padding rows after)."""
    tokens: list[int | None] | np.ndarray  # next token (prefill: None while the prompt goes on)
    ok: list[bool] | np.ndarray  # its integrity check passed (always True with integrity "off")
    errors: list[checkify.Error]  # strict: the calls' checks, to throw once failing rows are aborted
    logprobs: list[TokenLogprobs | None]  # per request: None where it asked for none (or has no token)
    calls: int = 1


class Sampling(NamedTuple):
    """One step's per-row sampling inputs (a pytree: one argument of the jitted step)."""
    temperature_B: jax.Array  # float32; 0 = greedy
    top_p_B: jax.Array  # float32 in (0, 1]
    top_k_B: jax.Array  # int32; 0 = every token
    min_p_B: jax.Array  # float32 in [0, 1]; 0 = every token
    key_ints_B3: jax.Array  # uint32 (seed, request index, token index), folded into a key in the step
    logprobs_B: jax.Array  # bool: the row's request asked for logprobs

    @classmethod
    def greedy(cls, batch: int, xp=jnp) -> "Sampling":
        """Every row greedy, no logprobs, in jnp or (xp=np: host arrays, no wait on the device) numpy."""
        return cls(xp.zeros(batch, xp.float32), xp.ones(batch, xp.float32), xp.zeros(batch, xp.int32),
                   xp.zeros(batch, xp.float32), xp.zeros((batch, 3), xp.uint32), xp.zeros(batch, bool))


VOCAB_BLOCK = 4096  # vocabulary entries per block of prompt logprobs (blocked_logprobs)


class Logprobs(NamedTuple):
    """One step's logprobs per row under the raw logits (all zeros when no row asked: the step
    skips them)."""
    token_B: jax.Array  # float32: the sampled token's log-probability
    rank_B: jax.Array  # int32: 1 + how many tokens have a larger logit
    top_ids_BN: jax.Array  # int32: the N likeliest tokens, likeliest first (N: max_logprobs)
    top_BN: jax.Array  # float32: their log-probabilities


@dataclasses.dataclass(frozen=True)
class RunnerConfig:
    num_pages: int
    page_size: int
    kv_format: KVFormat
    max_batch: int
    prefill_chunk: int
    k_scale: jax.Array
    v_scale: jax.Array
    attention_backend: str
    integrity: str
    min_attended_tokens: int  # the smallest attended width, in tokens (see attended_pages)
    min_decode_rows: int  # the fewest rows a decode step runs (see decode_rows)
    min_prefill_tokens: int  # the shortest prefill chunk (see prefill_tokens)
    mesh: Mesh | None = None  # tensor parallel: params and pools split over its "model" axis
    split_slots: bool = False  # decode context parallelism: MLA latent pools split by page slots
    max_logprobs: int = 0  # how many likeliest tokens a request may ask for (the steps compute that many)


class ModelRunner:
    def __init__(self, model: Model, decode_model: Model, cfg: RunnerConfig):
        self.model, self.decode_model, self.cfg = model, decode_model, cfg
        self.pools = init_pools(model.config, cfg.num_pages, cfg.page_size, cfg.kv_format)
        self._pool_shardings = None if cfg.mesh is None else sharding.pool_shardings(self.pools, cfg.mesh, cfg.split_slots)
        if cfg.mesh is not None:
            self.pools = jax.device_put(self.pools, self._pool_shardings)

    def prefill(self, reqs: list[Request], table: pt.PageTable, max_calls: int | None = None) -> Output:
        """Cache the tokens of reqs not yet in their pages, a chunk of each per call (one row per
        request that still has tokens, rows rounded up to a power of two), at most max_calls calls
        (None: until every prompt is cached). A request whose last chunk ran samples its next token
        from its last position (so prefill's weights choose it, as in disaggregated serving).
        Returns the next token of each of reqs (None where its prefill goes on) and its logprobs
        (if it asked), whether each passed the integrity check of every call it was in, and the
        calls run. A request that failed wrote nothing from that call on (each call checks the
        same table again). A request that wants prompt logprobs gets those of the positions
        computed here appended to its out_prompt_logprobs (a call with such a row projects every
        chunk position onto the vocabulary: R x C x V float32 logits, not R x V)."""
        c = self.cfg
        last_call = [None] * len(reqs)  # (sampled tokens, logprobs of the call that finished reqs[i], its row)
        checks, errors, calls = [], [], 0  # checks: (ok per row of a call, index in reqs of each row)
        prompt_rows = []  # (a call's prompt logprobs, its chunk length, row, index in reqs, first position, count)
        while (max_calls is None or calls < max_calls) and (
                todo := [(i, r) for i, r in enumerate(reqs) if r.cached < len(r.tokens)]):
            n = [min(c.prefill_chunk, len(r.tokens) - r.cached) for _, r in todo]
            R = _power_of_two_at_least(len(todo), c.max_batch)
            slots, start, count = np.zeros(R, np.int32), np.zeros(R, np.int32), np.zeros(R, np.int32)
            chunk = np.zeros((R, prefill_tokens(max(n), c.prefill_chunk, c.min_prefill_tokens)), np.int32)
            # The token after each position (0 past the last): only when a row wants prompt logprobs.
            targets = np.zeros_like(chunk) if any(r.wants_prompt_logprobs for _, r in todo) else None
            for row, ((_, r), k) in enumerate(zip(todo, n)):  # rows past len(todo): slot 0, no tokens
                slots[row], start[row], count[row] = r.slot, r.cached, k
                chunk[row, :k] = r.tokens[r.cached : r.cached + k]
                if targets is not None:
                    after = r.tokens[r.cached + 1 : r.cached + k + 1]
                    targets[row, :len(after)] = after
            sampled, logprobs, prompt_lp, ok_R = self._run(
                errors, self._prefill_fn, self.model.params, self.pools, table, jnp.asarray(slots), jnp.asarray(start),
                jnp.asarray(count), jnp.asarray(chunk), self._sampling([r for _, r in todo], range(len(todo)), R),
                None if targets is None else jnp.asarray(targets), width=self._width(table, start + count))
            if c.integrity != "off":  # else all pass: no host read of ok, which would wait for the call
                checks.append((ok_R, [i for i, _ in todo]))
            for row, ((i, r), k) in enumerate(zip(todo, n)):
                if r.wants_prompt_logprobs:
                    prompt_rows.append((prompt_lp, chunk.shape[1], row, i, r.cached, k))
                r.cached += k
                if r.cached == len(r.tokens):
                    last_call[i] = (sampled, logprobs, row)  # read once all calls are queued: no sync per chunk
            calls += 1
        host = {id(call[0]): np.asarray(call[0]) for call in last_call if call is not None}
        ok = [True] * len(reqs)
        for ok_R, indices in checks:
            for i, row_ok in zip(indices, np.asarray(ok_R)):
                ok[i] &= bool(row_ok)
        self._keep_prompt_logprobs(reqs, prompt_rows, ok)
        tokens = [None if call is None else int(host[id(call[0])][call[2]]) for call in last_call]
        asked = [call is not None and r.logprobs is not None for r, call in zip(reqs, last_call)]
        host_lp = {id(call[1]): jax.device_get(call[1]) for call, a in zip(last_call, asked) if a}  # once per call
        logprobs = [_token_logprobs(host_lp[id(call[1])], call[2], r.logprobs) if a else None
                    for r, call, a in zip(reqs, last_call, asked)]
        return Output(tokens, ok, errors, logprobs, calls)

    @staticmethod
    def _keep_prompt_logprobs(reqs: list[Request], prompt_rows: list, ok: list[bool]) -> None:
        """Append to each request the prompt logprobs its rows computed, in position order: those
        of prompt[p + 1] at position p, each once (a recomputed prefix adds nothing), none from a
        request that failed its integrity check (its rows computed nothing)."""
        host = {id(call): jax.device_get(call) for call, *_ in prompt_rows}  # one read per call
        for call, C, row, i, first, k in prompt_rows:
            r = reqs[i]
            if not ok[i]:
                continue
            for p in range(first, min(first + k, len(r.prompt) - 1)):
                if p == len(r.out_prompt_logprobs):
                    r.out_prompt_logprobs.append(_token_logprobs(host[id(call)], row * C + p - first, r.prompt_logprobs))

    def decode(self, live: list[Request], table: pt.PageTable) -> Output:
        """One step for every live request (one token each): next token, integrity ok and (if
        asked) logprobs, row i for live[i]. Rows past len(live) are padding: they point at slot 0
        with no token."""
        c = self.cfg
        R = decode_rows(len(live), c.max_batch, c.min_decode_rows)
        slots, tokens = np.zeros(R, np.int32), np.zeros((R, 1), np.int32)
        start, count = np.zeros(R, np.int32), np.zeros(R, np.int32)
        for i, r in enumerate(live):
            slots[i], tokens[i, 0], start[i], count[i] = r.slot, r.tokens[-1], len(r.tokens) - 1, 1
        args = (self.decode_model.params, self.pools, table, jnp.asarray(slots), jnp.asarray(start),
                jnp.asarray(count), jnp.asarray(tokens), self._sampling(live, range(len(live)), R))
        errors = []
        next_tok, logprobs, ok = self._run(errors, self._decode_fn, *args, width=self._width(table, start + count))
        host_lp = jax.device_get(logprobs) if any(r.logprobs is not None for r in live) else None  # read only if asked
        return Output(np.asarray(next_tok), np.asarray(ok), errors,
                      [None if r.logprobs is None else _token_logprobs(host_lp, i, r.logprobs) for i, r in enumerate(live)])

    def _run(self, errors: list, fn, *args, width: int):
        """Call a jitted step under the mesh (the kernels run per device, models/partitioning.py)
        and keep its new pools, even when its strict check failed (the old ones were donated).
        Returns the step's other outputs; appends its checkify error to `errors` (strict)."""
        with jax.set_mesh(self.cfg.mesh):
            out = fn(*args, width=width)
        if self.cfg.integrity == "strict":
            error, out = out
            errors.append(error)
        self.pools, *rest = out
        return rest

    @staticmethod
    def _sampling(reqs: list[Request], rows, batch: int) -> Sampling:
        """Per-row temperature, top-p, top-k, min-p, the three integers the sampling key is derived from
        in the step (seed, position of the request in its generate call, token index: the same
        call gives the same tokens on any engine, and a preempted, recomputed request samples what
        it would have) and whether it wants logprobs. reqs[i] goes to row rows[i] of `batch` rows;
        other rows are greedy."""
        s = Sampling.greedy(batch, np)  # numpy: a device array read back here would wait for the last call
        for r, row in zip(reqs, rows):  # top_k >= vocab keeps every token; the clamp keeps it in int32
            s.temperature_B[row], s.top_p_B[row], s.top_k_B[row] = r.temperature, r.top_p, min(max(r.top_k, 0), 2**31 - 1)
            s.min_p_B[row] = r.min_p
            s.key_ints_B3[row] = (r.seed, r.index, len(r.out))  # seed: in [0, 2**32) (reject_reason)
            s.logprobs_B[row] = r.logprobs is not None
        return Sampling(*(jnp.asarray(a) for a in s))

    def _width(self, table: pt.PageTable, end_B: np.ndarray) -> int:
        c = self.cfg
        return attended_pages(int(np.max(end_B)), c.page_size, table.max_pages_per_seq, c.min_attended_tokens)

    # ---- jitted functions -------------------------------------------------------------------------
    def _paged_kv(self, pools, step, width: int):
        c = self.cfg
        step = dataclasses.replace(step, pages_BN=step.pages_BN[:, :width])
        return PagedKV(pools, step, c.page_size, c.k_scale, c.v_scale, c.attention_backend, c.split_slots)

    def _placed(self, pools):
        """The step's new pools, kept in the pools' sharding (so the next step neither reshards
        nor recompiles)."""
        return pools if self._pool_shardings is None else jax.lax.with_sharding_constraint(pools, self._pool_shardings)

    def _checked_step(self, table: pt.PageTable, slots_R, start_R, count_R) -> tuple[StepInputs, jax.Array]:
        """The rows' view of the page table, after the integrity check of their slots (traced only
        when it is on) -> (step inputs, ok per row). A failing row neither writes nor reads: its
        mapping may point into another request's pages, and the call's KV write would corrupt them."""
        step = StepInputs(table.pages_BN[slots_R], start_R, count_R)
        if self.cfg.integrity == "off":
            return step, jnp.ones(count_R.shape, bool)
        # The check runs over slots; padding rows repeat slot 0 with no token (max = or).
        active_B = jnp.zeros(table.pages_BN.shape[0], bool).at[slots_R].max(count_R > 0)
        with jax.named_scope("kv_integrity_check"):
            report = pt.verify(table, active_B)
        if self.cfg.integrity == "strict":
            pt.checked(report)
        ok_R = report.ok_B[slots_R]
        return dataclasses.replace(step, count_B=jnp.where(ok_R, count_R, 0)), ok_R

    def _jit(self, step_fn):
        step_fn = checkify.checkify(step_fn) if self.cfg.integrity == "strict" else step_fn
        return jax.jit(step_fn, donate_argnums=1, static_argnames="width")

    @functools.cached_property
    def _prefill_fn(self):
        module, c = self.model.module, self.cfg

        def prefill(params, pools, table, slots_R, start_R, count_R, tokens_RC, sampling, targets_RC, *, width):
            """targets_RC: the token after each position, to compute prompt logprobs (None: none, and
            only the last position of each row meets the vocabulary projection)."""
            step, ok_R = self._checked_step(table, slots_R, start_R, count_R)
            kv = self._paged_kv(pools, step, width)
            R, C = tokens_RC.shape
            positions_RC = start_R[:, None] + jnp.arange(C)
            valid_RC = jnp.arange(C)[None, :] < step.count_B[:, None]
            last_R = jnp.maximum(step.count_B - 1, 0)
            prompt_logprobs = None
            if targets_RC is None:
                logits = module.apply({"params": params}, tokens_RC, positions_RC, kv, logits_at=last_R,
                                      valid_BT=valid_RC)
            elif self.cfg.mesh is not None:  # each device holds its share of the vocabulary's logits
                logits = module.apply({"params": params}, tokens_RC, positions_RC, kv, valid_BT=valid_RC)
                prompt_logprobs = logprobs_of(logits.reshape(R * C, -1), targets_RC.reshape(-1), c.max_logprobs)
                logits = jnp.take_along_axis(logits, last_R[:, None, None], axis=1)
            else:  # rows flattened: position j of row r is row r * C + j

                def project(x_RCD, head_DV):
                    x_last = jnp.take_along_axis(x_RCD, last_R[:, None, None], axis=1)
                    return (jnp.einsum("btd,dv->btv", x_last, head_DV, preferred_element_type=jnp.float32),
                            blocked_logprobs(x_RCD.reshape(R * C, -1), head_DV, targets_RC.reshape(-1), c.max_logprobs))

                logits, prompt_logprobs = module.apply({"params": params}, tokens_RC, positions_RC, kv,
                                                       valid_BT=valid_RC, project=project)
            tokens_R = sample(logits[:, 0], sampling)
            return (self._placed(kv.new_pools), tokens_R, token_logprobs(logits[:, 0], tokens_R, sampling, c.max_logprobs),
                    prompt_logprobs, ok_R)

        return self._jit(prefill)

    @functools.cached_property
    def _decode_fn(self):
        module, c = self.decode_model.module, self.cfg

        def decode(params, pools, table, slots_R, start_R, count_R, tokens_R1, sampling, *, width):
            step, ok_R = self._checked_step(table, slots_R, start_R, count_R)
            kv = self._paged_kv(pools, step, width)
            logits = module.apply({"params": params}, tokens_R1, start_R[:, None], kv,
                                  valid_BT=step.count_B[:, None] > 0)[:, 0]
            tokens_R = sample(logits, sampling)
            return self._placed(kv.new_pools), tokens_R, token_logprobs(logits, tokens_R, sampling, c.max_logprobs), ok_R

        return self._jit(decode)

    def lowered_decode_text(self, table: pt.PageTable) -> str:
        """The decode step's lowered HLO text (to show that integrity='off' traces no check)."""
        B = self.cfg.max_batch
        z = jnp.zeros(B, jnp.int32)
        args = (self.decode_model.params, self.pools, table, z, z, z, jnp.zeros((B, 1), jnp.int32), Sampling.greedy(B))
        with jax.set_mesh(self.cfg.mesh):
            return self._decode_fn.lower(*args, width=table.max_pages_per_seq).as_text(debug_info=True)


def attended_pages(tokens: int, page_size: int, max_pages: int, min_tokens: int) -> int:
    """Page-table columns a step attends over when its longest row ends at `tokens` tokens: a
    power of two of pages covering max(tokens, min_tokens), at most the whole table."""
    return _power_of_two_at_least(-(-max(tokens, min_tokens) // page_size), max_pages)


def decode_rows(live: int, max_batch: int, min_rows: int) -> int:
    """Rows a decode step runs for `live` requests: a power of two >= max(live, min_rows), at most
    max_batch (min_rows = max_batch runs every slot each step)."""
    return _power_of_two_at_least(max(live, min_rows), max_batch)


def prefill_tokens(n: int, prefill_chunk: int, min_tokens: int) -> int:
    """Length of a prefill chunk holding n tokens: a power of two >= max(n, min_tokens), at most
    prefill_chunk (min_tokens = prefill_chunk pads every chunk to prefill_chunk)."""
    return _power_of_two_at_least(max(n, min_tokens), prefill_chunk)


def _power_of_two_at_least(n: int, cap: int) -> int:
    return min(1 << (n - 1).bit_length(), cap)


def sample(logits_BV, s: Sampling):
    """Greedy where temperature == 0, else temperature, then min-p, top-k, and nucleus (top-p) over
    what is left (vLLM's order), per row. The key is folded here, in the step, so the decode loop
    makes no per-request host calls."""
    greedy = jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
    # A step whose rows are all greedy skips the sort over the vocabulary (lax.cond runs one branch).
    return jax.lax.cond(jnp.any(s.temperature_B > 0), _sampled, lambda _logits, _s, g: g, logits_BV, s, greedy)


def _sampled(logits_BV, s: Sampling, greedy_B):
    scaled_BV = logits_BV / jnp.maximum(s.temperature_B, 1e-6)[:, None]
    sampled_B = s.temperature_B > 0
    # min-p: tokens less likely than min_p times the likeliest (after temperature) are out; no sort.
    scaled_BV = jnp.where(scaled_BV >= jnp.max(scaled_BV, axis=-1, keepdims=True) + jnp.log(s.min_p_B)[:, None],
                          scaled_BV, -jnp.inf)
    # Only top-k and top-p need the vocabulary sorted: a step that samples at temperature alone
    # skips the sort. Either way the draw is over the tokens in vocabulary order, so a row's
    # token depends on its own key and options, not on what the other rows asked.
    truncated = jnp.any(sampled_B & (((s.top_k_B > 0) & (s.top_k_B < scaled_BV.shape[1])) | (s.top_p_B < 1)))
    kept_BV = jax.lax.cond(truncated, _kept_by_top_k_top_p, lambda x, _: jnp.ones(x.shape, bool), scaled_BV, s)
    keys = jax.vmap(lambda k: jax.random.fold_in(jax.random.fold_in(jax.random.key(k[0]), k[1]), k[2]))(s.key_ints_B3)
    choice_B = jax.vmap(jax.random.categorical)(keys, jnp.where(kept_BV, scaled_BV, -jnp.inf))
    return jnp.where(sampled_B, choice_B.astype(jnp.int32), greedy_B)


def _kept_by_top_k_top_p(scaled_BV, s: Sampling):
    """Which tokens survive top-k, then top-p over what top-k kept, in vocabulary order."""
    B, V = scaled_BV.shape
    order_BV = jnp.argsort(-scaled_BV, axis=-1)
    sorted_BV = jnp.take_along_axis(scaled_BV, order_BV, axis=-1)
    rank_V = jnp.arange(V)
    in_top_k_BV = (s.top_k_B[:, None] == 0) | (rank_V < s.top_k_B[:, None])
    probs_BV = jax.nn.softmax(jnp.where(in_top_k_BV, sorted_BV, -jnp.inf), axis=-1)
    # Keeps the top token; top_p = 1 keeps all (a float32 cumsum can reach 1 before the tail).
    below_p_BV = ((jnp.cumsum(probs_BV, axis=-1) - probs_BV) < s.top_p_B[:, None]) | (s.top_p_B[:, None] >= 1)
    keep_BV = in_top_k_BV & below_p_BV
    return jnp.zeros((B, V), bool).at[jnp.arange(B)[:, None], order_BV].set(keep_BV)


def token_logprobs(logits_BV, tokens_B, s: Sampling, n: int) -> Logprobs:
    """The raw distribution's log-probability and rank of each row's token, and its n likeliest
    tokens, computed only when a row asked (lax.cond: a top-n over the vocabulary is no free pass)."""
    B = logits_BV.shape[0]

    def skip(_):
        return Logprobs(jnp.zeros(B), jnp.zeros(B, jnp.int32), jnp.zeros((B, n), jnp.int32), jnp.zeros((B, n)))

    return jax.lax.cond(jnp.any(s.logprobs_B), lambda x: logprobs_of(x, tokens_B, n), skip, logits_BV)


def logprobs_of(logits_BV, tokens_B, n: int) -> Logprobs:
    """Each row's log_softmax at its token, the token's rank, and the row's n likeliest tokens."""
    B = logits_BV.shape[0]
    logits_BV = logits_BV.astype(jnp.float32)
    norm_B = jax.nn.logsumexp(logits_BV, axis=-1)
    chosen_B = jnp.take_along_axis(logits_BV, tokens_B[:, None], axis=-1)[:, 0]
    rank_B = 1 + jnp.sum(logits_BV > chosen_B[:, None], axis=-1, dtype=jnp.int32)
    top_BN, ids_BN = jax.lax.top_k(logits_BV, n) if n else (jnp.zeros((B, 0)), jnp.zeros((B, 0), jnp.int32))
    return Logprobs(chosen_B - norm_B, rank_B, ids_BN.astype(jnp.int32), top_BN - norm_B[:, None])


def blocked_logprobs(x_ND: jax.Array, head_DV: jax.Array, tokens_N: jax.Array, n: int,
                     block: int = VOCAB_BLOCK) -> Logprobs:
    """logprobs_of(x @ head, tokens, n), a vocabulary block at a time: [rows, block] float32 logits
    at once, not [rows, vocab] (Kimi's 163,840-entry vocabulary over 8 rows of 64 prompt positions
    would be 335 MB). One pass keeps a running log-sum-exp, the token's logit and the n likeliest;
    a second counts the logits above the token's for its rank (the same products, so the same
    values). The head is read twice. (Under tensor parallelism the prefill keeps whole logits
    instead: each device holds only its share of the vocabulary, and blocks would cut across the
    shares.)"""
    rows, vocab = x_ND.shape[0], head_DV.shape[1]
    block = min(block, vocab)
    blocks = -(-vocab // block)

    def logits_of(b):
        # The last block ends at the vocabulary's end, overlapping the one before: its columns
        # already counted read as -inf. (No padded copy of the head.)
        start = jnp.minimum(b * block, vocab - block)
        w = jax.lax.dynamic_slice_in_dim(head_DV, start, block, axis=1)
        logits = jnp.dot(x_ND, w, preferred_element_type=jnp.float32)
        return jnp.where(start + jnp.arange(block) >= b * block, logits, -jnp.inf)

    def first(b, carry):
        peak_N, total_N, chosen_N, top_NK, ids_NK = carry
        logits = logits_of(b)
        new_peak = jnp.maximum(peak_N, jnp.max(logits, axis=-1))
        total_N = total_N * jnp.exp(peak_N - new_peak) + jnp.sum(jnp.exp(logits - new_peak[:, None]), axis=-1)
        start = jnp.minimum(b * block, vocab - block)
        offset = tokens_N - start
        inside = (tokens_N >= b * block) & (offset < block)
        chosen_N = jnp.where(inside, jnp.take_along_axis(logits, jnp.clip(offset, 0, block - 1)[:, None], -1)[:, 0],
                             chosen_N)
        if n:
            top_NK, at = jax.lax.top_k(jnp.concatenate([top_NK, logits], axis=-1), n)
            ids = jnp.concatenate([ids_NK, start + jnp.broadcast_to(jnp.arange(block), logits.shape)], axis=-1)
            ids_NK = jnp.take_along_axis(ids, at, axis=-1)
        return new_peak, total_N, chosen_N, top_NK, ids_NK

    start = (jnp.full(rows, -jnp.inf), jnp.zeros(rows), jnp.zeros(rows), jnp.full((rows, n), -jnp.inf),
             jnp.zeros((rows, n), jnp.int32))
    peak_N, total_N, chosen_N, top_NK, ids_NK = jax.lax.fori_loop(0, blocks, first, start)
    rank_N = 1 + jax.lax.fori_loop(0, blocks, lambda b, r: r + jnp.sum(logits_of(b) > chosen_N[:, None], axis=-1,
                                                                       dtype=jnp.int32), jnp.zeros(rows, jnp.int32))
    norm_N = peak_N + jnp.log(total_N)
    return Logprobs(chosen_N - norm_N, rank_N, ids_NK.astype(jnp.int32), top_NK - norm_N[:, None])


def _token_logprobs(host: Logprobs, row: int, n: int) -> TokenLogprobs:
    """Row `row` of a step's logprobs (read to the host), with its n likeliest tokens."""
    return TokenLogprobs(float(host.token_B[row]), int(host.rank_B[row]),
                         tuple(zip(host.top_ids_BN[row, :n].tolist(), host.top_BN[row, :n].tolist())))
