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
attention kernels (attention_backend). A decode step is two programs: the forward, dispatched
first, and the sampling of its logits; JAX runs the forward asynchronously, so the host builds the
sampling inputs (structured outputs' masks included) meanwhile, off the step's critical path
(SGLang's overlap scheduling, for the inputs: on CPU, 0.78x the time per decoded token).

A step sees only the first `attended_pages` columns of the page table: enough for its longest row,
rounded up to a power of two. The XLA attention gathers and masks every column it is given, so
with the whole table (max_seq_len / page_size columns: 8192 for Kimi's 131072 positions at page 16)
a short request would pay for the longest one possible. Likewise a decode step runs `step_rows`
rows, the live requests rounded up to a power of two, not max_batch: 3 live requests in an engine
of 64 slots pay for 4 rows of experts, attention and sampling, not 64 (what CUDA-graph batch sizes
do in vLLM and SGLang), and a prefill chunk is as long as its tokens rounded up to a power of two
(`prefill_tokens`, for the longest row of the call), not prefill_chunk: a 5-token prompt does not
pay for 64; a prefill call's rows are its requests rounded up alike. The powers of two keep the
compiled shapes to a handful: each (rows, width) of decode and (rows, chunk, width) of prefill
compiles once, and raising min_decode_rows, min_prefill_rows or min_prefill_tokens trades padding
for fewer compiles. The steps are plain functions of their arguments and a StepSpec, jitted once
per spec (steps_for): engines of an equal spec in one process share their compiled programs.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from mixserve import page_table as pt
from mixserve import kv_transfer, sharding, speculative
from mixserve.grammar import Grammars
from mixserve.kv_cache import KVFormat, PagedKV, StepInputs, init_pools
from mixserve.model import Model
from mixserve.request import INDEXER_TOPK, ROUTED_EXPERTS, Request, TokenLogprobs
from mixserve.sampling import Sampling, sample, seed_words
from models import attention, moe
from models.transformer import Transformer


class Output(NamedTuple):
    """What a prefill or decode returns, per request (decode: per row, padding rows after)."""
    tokens: list[int | None] | np.ndarray  # next token (prefill: None while the prompt goes on)
    ok: list[bool] | np.ndarray  # its integrity check passed (always True with integrity "off")
    errors: list[checkify.Error]  # strict: the calls' checks, to throw once failing rows are aborted
    logprobs: list[TokenLogprobs | None]  # per request: None where it asked for none (or has no token)
    calls: int = 1
    # Speculative decoding: the tokens after the next one (the next step's drafts), per request
    # (None where it has no new token); and (decode) all tokens each request got, 1 .. k + 1.
    drafts: list[list[int] | None] | None = None
    emitted: list[list[int]] | None = None
    emitted_logprobs: list[list[TokenLogprobs] | None] | None = None


VOCAB_BLOCK = 4096  # vocabulary entries per block of prompt logprobs (blocked_logprobs)


LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs", "raw_logits", "processed_logits")  # vLLM's --logprobs-mode


class Logprobs(NamedTuple):
    """One step's logprobs per row, of the logits the engine's logprobs mode names (all zeros when
    no row asked: the step skips them)."""
    token_B: jax.Array  # float32: the sampled token's log-probability (a "*_logits" mode: its logit)
    rank_B: jax.Array  # int32: 1 + how many tokens have a larger logit
    top_ids_BN: jax.Array  # int32: the N likeliest tokens, likeliest first (N: max_logprobs)
    top_BN: jax.Array  # float32: their log-probabilities (or logits)


@dataclasses.dataclass(frozen=True)
class RunnerConfig:
    num_pages: int
    page_size: int
    kv_format: KVFormat
    max_batch: int
    prefill_chunk: int
    k_scale: jax.Array  # per cache layer: [layers] or [layers, KVH] (kv_cache.layer_scales)
    v_scale: jax.Array
    attention_backend: str
    integrity: str
    min_attended_tokens: int  # the smallest attended width, in tokens (see attended_pages)
    min_decode_rows: int  # the fewest rows a decode step runs (see step_rows)
    min_prefill_tokens: int  # the shortest prefill chunk (see prefill_tokens)
    min_prefill_rows: int = 1  # the fewest rows a prefill call runs (see step_rows)
    mesh: Mesh | None = None  # tensor parallel: params and pools split over its "model" axis
    split_slots: bool = False  # decode context parallelism: MLA latent pools split by page slots
    max_logprobs: int = 0  # how many likeliest tokens a request may ask for (the steps compute that many)
    speculative_tokens: int = 0  # draft tokens per decode step (mixserve/speculative.py); 0: none
    draft: str = "mtp"  # who drafts them: the MTP layer (in the steps) or "ngram" (the engine, on the host)
    # the rows the steps return per token (request.replay_dtype: the experts each MoE layer chose,
    # the positions each DSA indexer layer chose; Request.replay_rows); None: neither
    replay_dtype: np.dtype | None = None
    logprobs_mode: str = "raw_logprobs"  # what a request's logprobs are of (LOGPROBS_MODES; token_logprobs)
    stop_tokens: tuple[int, ...] = ()  # the engine's: held back, with a request's own, until its min_tokens

    @property
    def mtp_drafts(self) -> bool:
        return self.speculative_tokens > 0 and self.draft == "mtp"


@dataclasses.dataclass(frozen=True)
class StepSpec:
    """What a runner's jitted steps depend on besides the rows, chunk and width of a call: runners
    of equal specs share their steps and compiled programs (steps_for), so a second engine of a
    model in one process (a notebook's, an ablation's, a test suite's) compiles only the shapes
    no engine of its spec has run yet."""
    module: Transformer  # hashable: config, weight plan, dtype, backend
    page_size: int
    attention_backend: str
    integrity: str
    mesh: Mesh | None
    split_slots: bool
    max_logprobs: int
    speculative_tokens: int
    mtp_drafts: bool
    routed_experts: bool
    indexer_topk: bool
    logprobs_mode: str
    # The pools' and page table's shapes: the trace does not read them, but with them in the key
    # one cached Steps compiles one engine size's programs, so the cache's bound bounds memory.
    num_pages: int
    kv_format: KVFormat
    max_batch: int


@functools.lru_cache(maxsize=32)
def _pool_maker(config, num_pages: int, page_size: int, kv_format, mtp: bool, where: tuple, where_def):
    """init_pools jitted to make its zeros in place (out_shardings): one compile per pool spec."""
    return jax.jit(functools.partial(init_pools, config, num_pages, page_size, kv_format, mtp),
                   out_shardings=jax.tree.unflatten(where_def, where))


class ModelRunner:
    # Decode builds the sampling inputs (grammar masks included) while its forward runs; False:
    # before dispatching it (an ablation: experiments/structured_outputs.py)
    overlap_inputs = True

    def __init__(self, model: Model, decode_model: Model, cfg: RunnerConfig, grammars: Grammars):
        self.model, self.decode_model, self.cfg, self.grammars = model, decode_model, cfg, grammars
        returned = () if cfg.replay_dtype is None else cfg.replay_dtype.names
        spec = StepSpec(model.module, cfg.page_size, cfg.attention_backend, cfg.integrity, cfg.mesh, cfg.split_slots,
                        cfg.max_logprobs, cfg.speculative_tokens, cfg.mtp_drafts, ROUTED_EXPERTS in returned,
                        INDEXER_TOPK in returned, cfg.logprobs_mode, cfg.num_pages, cfg.kv_format, cfg.max_batch)
        decode_steps = steps_for(dataclasses.replace(spec, module=decode_model.module))
        self.prefill_step, self.decode_step = steps_for(spec).prefill, decode_steps.decode
        self.speculative_step = decode_steps.speculative
        self.pick_step = decode_steps.pick
        self.scales = self.placed_scales(cfg.k_scale, cfg.v_scale)  # arguments: engines that differ in scales alone share steps
        self.pools = self.new_pools()

    def new_pools(self) -> list[dict]:
        """Zeroed KV pools, made where the steps leave them: split over a mesh (each device makes
        only its share; made whole on one device first, a GQA pool at TP8 would be eight devices'
        budgets there), or committed to the params' device (as the steps return them: one
        compiled entry per shape)."""
        cfg = self.cfg
        args = (self.model.config, cfg.num_pages, cfg.page_size, cfg.kv_format, cfg.mtp_drafts)
        shapes = jax.eval_shape(functools.partial(init_pools, *args))
        if cfg.mesh is not None:
            where = sharding.pool_shardings(shapes, cfg.mesh, cfg.split_slots)
        else:
            device = jax.tree.leaves(self.model.params)[0].sharding
            where = jax.tree.map(lambda _: device, shapes)
        leaves, tree = jax.tree.flatten(where)
        return _pool_maker(*args, tuple(leaves), tree)()

    def placed_scales(self, k_scale, v_scale) -> tuple:
        """The pools' FP8 KV scales as the steps take them: on every device of a mesh."""
        if self.cfg.mesh is None:
            return k_scale, v_scale
        return jax.device_put((k_scale, v_scale), NamedSharding(self.cfg.mesh, PartitionSpec()))

    def read_pages(self, page_ids: list[int]) -> list[list[dict[str, np.ndarray]]]:
        """Pages page_ids on the host (the prefix cache's host tier, mixserve/host_cache.py): per
        page, per layer, each pool's slice of it, in the pools' format."""
        sent = jax.device_get(kv_transfer.export_pages(self.pools, kv_transfer.padded(page_ids, 0), None, None,
                                                       dst_layout=kv_transfer.layout(self.pools), convert=False))
        return [[{name: np.take(x, i, axis=kv_transfer.page_axis(name)) for name, x in layer.items()} for layer in sent]
                for i in range(len(page_ids))]

    def write_pages(self, page_ids: list[int], pages: list[list[dict[str, np.ndarray]]]) -> None:
        """Put read_pages' slices into device pages page_ids (padded: the padding is dropped)."""
        ids = kv_transfer.padded(page_ids, self.cfg.num_pages)
        pad = ids.shape[0] - len(pages)
        sent = [{name: np.stack([p[i][name] for p in pages] + [np.zeros_like(pages[0][i][name])] * pad,
                                axis=kv_transfer.page_axis(name)) for name in layer}
                for i, layer in enumerate(self.pools)]
        sent = jax.device_put(sent, jax.tree.map(lambda pool: pool.sharding, self.pools))
        self.pools = kv_transfer.import_pages(self.pools, ids, sent)

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
        last_call = [None] * len(reqs)  # (sampled tokens, logprobs, its row, drafts) of the call that finished reqs[i]
        checks, errors, calls = [], [], 0  # checks: (ok per row of a call, index in reqs of each row)
        prompt_rows = []  # (a call's prompt logprobs, its chunk length, row, index in reqs, first position, count)
        replay_rows = []  # (a call's replay rows, row, index in reqs, first position, count)
        while (max_calls is None or calls < max_calls) and (
                todo := [(i, r) for i, r in enumerate(reqs) if r.cached < len(r.tokens)]):
            n = [min(c.prefill_chunk, len(r.tokens) - r.cached) for _, r in todo]
            R = step_rows(len(todo), c.max_batch, c.min_prefill_rows)
            slots, start, count = np.zeros(R, np.int32), np.zeros(R, np.int32), np.zeros(R, np.int32)
            chunk = np.zeros((R, prefill_tokens(max(n), c.prefill_chunk, c.min_prefill_tokens)), np.int32)
            # The token after each position (0 past the last): only when a row wants prompt logprobs.
            targets = np.zeros_like(chunk) if any(r.wants_prompt_logprobs for _, r in todo) else None
            # Speculative: the token after each chunk (-1: the one this call samples) feeds the MTP layer.
            after_R, room = (np.full(R, -1, np.int32), np.zeros(R, np.int32)) if c.mtp_drafts else (None, None)
            for row, ((_, r), k) in enumerate(zip(todo, n)):  # rows past len(todo): slot 0, no tokens
                slots[row], start[row], count[row] = r.slot, r.cached, k
                chunk[row, :k] = r.tokens[r.cached : r.cached + k]
                if targets is not None:
                    after = r.tokens[r.cached + 1 : r.cached + k + 1]
                    targets[row, :len(after)] = after
                if after_R is not None:
                    after_R[row] = r.tokens[r.cached + k] if r.cached + k < len(r.tokens) else -1
                    room[row] = r.num_pages * c.page_size
            sampled, logprobs, prompt_lp, ok_R, drafts, rows = self._run(
                errors, self.prefill_step, self.model.params, table, jnp.asarray(slots), jnp.asarray(start),
                jnp.asarray(count), jnp.asarray(chunk),
                self._sampling([r for _, r in todo], range(len(todo)), R,
                               kept=[r.cached + k == len(r.tokens) for (_, r), k in zip(todo, n)]),
                None if targets is None else jnp.asarray(targets), None if after_R is None else jnp.asarray(after_R),
                None if room is None else jnp.asarray(room),
                width=self._width(table, np.maximum(start + count, 0 if room is None else room)))
            if c.integrity != "off":  # else all pass: no host read of ok, which would wait for the call
                checks.append((ok_R, [i for i, _ in todo]))
            for row, ((i, r), k) in enumerate(zip(todo, n)):
                if r.wants_prompt_logprobs:
                    prompt_rows.append((prompt_lp, chunk.shape[1], row, i, r.cached, k))
                if rows is not None:
                    replay_rows.append((rows, row, i, r.cached, k))
                r.cached += k
                if r.cached == len(r.tokens):
                    last_call[i] = (sampled, logprobs, row, drafts)  # read once all calls are queued: no sync per chunk
            calls += 1
        host = {id(call[0]): np.asarray(call[0]) for call in last_call if call is not None}
        ok = [True] * len(reqs)
        for ok_R, indices in checks:
            for i, row_ok in zip(indices, np.asarray(ok_R)):
                ok[i] &= bool(row_ok)
        self._keep_prompt_logprobs(reqs, prompt_rows, ok)
        by_id = {id(call): call for call, *_ in replay_rows}
        host_rows = {key: self._host_rows(call) for key, call in by_id.items()}  # one read per call
        for call, row, i, first, k in replay_rows:
            if ok[i]:
                reqs[i].keep_replay_rows(first, host_rows[id(call)][row, :k])
        tokens = [None if call is None else int(host[id(call[0])][call[2]]) for call in last_call]
        asked = [call is not None and r.logprobs is not None for r, call in zip(reqs, last_call)]
        host_lp = {id(call[1]): jax.device_get(call[1]) for call, a in zip(last_call, asked) if a}  # once per call
        logprobs = [_token_logprobs(host_lp[id(call[1])], call[2], r.logprobs) if a else None
                    for r, call, a in zip(reqs, last_call, asked)]
        drafts = None
        if c.mtp_drafts:
            host_drafts = {id(call[3]): np.asarray(call[3]) for call in last_call if call is not None}
            drafts = [None if call is None else host_drafts[id(call[3])][call[2]].tolist() for call in last_call]
        return Output(tokens, ok, errors, logprobs, calls=calls, drafts=drafts)

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
        R = step_rows(len(live), c.max_batch, c.min_decode_rows)
        slots, tokens = np.zeros(R, np.int32), np.zeros((R, 1), np.int32)
        start, count = np.zeros(R, np.int32), np.zeros(R, np.int32)
        for i, r in enumerate(live):
            slots[i], tokens[i, 0], start[i], count[i] = r.slot, r.tokens[-1], len(r.tokens) - 1, 1
        errors = []
        inputs = (table, jnp.asarray(slots), jnp.asarray(start), jnp.asarray(count), jnp.asarray(tokens))
        width = self._width(table, start + count)
        sampling = None if self.overlap_inputs else self._sampling(live, range(len(live)), R)
        logits, ok, rows = self._run(errors, self.decode_step, self.decode_model.params, *inputs, width=width)
        if sampling is None:  # built while the forward runs (JAX dispatches it asynchronously)
            sampling = self._sampling(live, range(len(live)), R)
        with jax.set_mesh(self.cfg.mesh):
            next_tok, logprobs = self.pick_step(logits, sampling)
        host_lp = jax.device_get(logprobs) if any(r.logprobs is not None for r in live) else None  # read only if asked
        ok = np.asarray(ok)
        self._keep_replay_rows(live, rows, start, count, ok)
        return Output(np.asarray(next_tok), ok, errors,
                      [None if r.logprobs is None else _token_logprobs(host_lp, i, r.logprobs) for i, r in enumerate(live)])

    def _host_rows(self, rows: dict) -> np.ndarray:
        """A step's replay rows ({Result field: [R, J, ...]} on the device) as one structured
        array [R, J] of request.replay_dtype (one read)."""
        host = jax.device_get(rows)
        out = np.empty(next(iter(host.values())).shape[:2], self.cfg.replay_dtype)
        for name, array in host.items():
            out[name] = array
        return out

    def _keep_replay_rows(self, live: list[Request], rows: dict | None, start: np.ndarray, count: np.ndarray,
                          ok: np.ndarray) -> None:
        """Give each request that passed its check the rows of the first count[i] positions of
        its row (from start[i]); nothing when the step returns none."""
        if rows is None:
            return
        host = self._host_rows(rows)
        for i, r in enumerate(live):
            if ok[i]:
                r.keep_replay_rows(int(start[i]), host[i, : count[i]])

    def _run(self, errors: list, step: Callable, params, *args, width: int):
        """Call a jitted step on the runner's pools and scales under the mesh (the kernels run per
        device, models/partitioning.py) and keep its new pools, even when its strict check failed
        (the old ones were donated). Returns the step's other outputs; appends its checkify error
        to `errors` (strict)."""
        with jax.set_mesh(self.cfg.mesh):
            out = step(params, self.pools, self.scales, *args, width=width)
        if self.cfg.integrity == "strict":
            error, out = out
            errors.append(error)
        self.pools, *rest = out
        return rest

    def _sampling(self, reqs: list[Request], rows, batch: int, drafts: list[list[int]] | None = None,
                  kept: list[bool] | None = None) -> Sampling:
        """Per-row temperature, top-p, top-k, min-p, the integers the sampling key is derived from in
        the step (the seed's two 32-bit words, position of the request in its generate call, token
        index: the same call gives the same tokens on any engine, and a preempted, recomputed
        request samples what it would have; speculative decoding draws them otherwise, from the
        same distribution) and whether it wants logprobs, its logit bias and its penalties, with
        the token counts they read (as many columns as the most distinct tokens a penalized request
        holds, a power of two: `penalty_width`), the stop tokens its min_tokens holds back (while
        it is short of them; as many columns, a power of two, as the most a short request holds),
        and the tokens its structured output or allowed_token_ids allows (speculative: drafts[i]
        are reqs[i]'s drafts, and its row gets a mask per verified position; kept[i] false: the
        call samples reqs[i] a token that is not kept, a prefill chunk short of the prompt's end,
        and its grammar's mask is not computed). reqs[i] goes to row rows[i] of `batch` rows; other rows are greedy."""
        counts = [r.token_counts() if r.penalized else () for r in reqs]
        held = [r.held_stops(self.cfg.stop_tokens) for r in reqs]
        most_held = max(map(len, held), default=0)
        # numpy: a device array read back here would wait for the last call
        s = Sampling.greedy(batch, np, seen=penalty_width(max(map(len, counts), default=0)),
                            held=most_held and _power_of_two_at_least(most_held, 1 << 31))
        largest = float(np.finfo(np.float32).max)
        for r, row, seen, stops in zip(reqs, rows, counts, held):  # top_k >= vocab keeps every token, a temperature (or
            # repetition penalty) past float32's largest acts as its largest: the clamps keep them in int32 and float32
            s.temperature_B[row] = min(r.temperature, largest)
            s.top_p_B[row], s.top_k_B[row] = r.top_p, min(max(r.top_k, 0), 2**31 - 1)
            s.min_p_B[row] = r.min_p
            s.key_ints_B4[row] = (*seed_words(r.seed), r.index, len(r.out))
            s.logprobs_B[row] = r.logprobs is not None
            s.min_tokens_B[row], s.held_ids_BS[row, :len(stops)] = r.min_tokens, stops
            if r.logit_bias:
                s.bias_ids_BK[row, :len(r.logit_bias)] = list(r.logit_bias)
                s.bias_BK[row, :len(r.logit_bias)] = list(r.logit_bias.values())
            if seen:
                s.repetition_B[row] = min(r.repetition_penalty, largest)
                s.frequency_B[row], s.presence_B[row] = r.frequency_penalty, r.presence_penalty
                s.seen_ids_BU[row, :len(seen)], s.output_counts_BU[row, :len(seen)] = seen.ids, seen.counts
        starts = [r.grammar_start(drafts[i] if drafts else []) if kept is None or kept[i] else None
                  for i, r in enumerate(reqs)]
        held = [(r.matcher, row, first, drafts[i][first:] if drafts else [])
                for i, (r, row, first) in enumerate(zip(reqs, rows, starts)) if first is not None]
        openers = [(r.matcher if r.matcher_alive else None, row, token) for i, (r, row) in enumerate(zip(reqs, rows))
                   if (kept is None or kept[i]) and (token := r.opener()) is not None]
        listed = [(row, r) for r, row in zip(reqs, rows) if r.allowed_token_ids is not None]
        if held or openers or listed:
            positions = 1 + self.cfg.speculative_tokens if drafts else 1
            allowed = self.grammars.allowed(held, batch, positions, openers)  # every token where no grammar
            for row, r in listed:  # allowed_token_ids: the same mask at each verified position
                allowed[row] &= np.tile(r.allowed_mask(self.grammars.words), positions)
            s = s._replace(allowed_BW=allowed)
        return Sampling(*(jnp.asarray(a) for a in s))

    def _width(self, table: pt.PageTable, end_B: np.ndarray) -> int:
        c = self.cfg
        return attended_pages(int(np.max(end_B)), c.page_size, table.max_pages_per_seq, c.min_attended_tokens)

    def speculate(self, live: list[Request], table: pt.PageTable, n_drafts: list[int]) -> Output:
        """One speculative decode step for every live request: its last token and the first
        n_drafts[i] of its drafts (req.drafts; the engine counts what its pages and limits allow)
        verified at once.
        Output.emitted[i]: the 1 .. k + 1 tokens live[i] got (emitted_logprobs beside them, if it
        asked); drafts[i]: its next drafts (None with n-gram drafts: the engine finds them);
        tokens[i]: its first new token."""
        c, K = self.cfg, self.cfg.speculative_tokens
        R = step_rows(len(live), c.max_batch, c.min_decode_rows)
        slots, start, count, room = (np.zeros(R, np.int32) for _ in range(4))
        tokens = np.zeros((R, K + 1), np.int32)
        for i, (r, n) in enumerate(zip(live, n_drafts)):
            drafts = r.drafts[:n]
            slots[i], start[i], count[i], room[i] = r.slot, len(r.tokens) - 1, 1 + len(drafts), r.num_pages * c.page_size
            tokens[i, : 1 + len(drafts)] = [r.tokens[-1], *drafts]
        errors = []
        emitted, accepted, drafts, logprobs, ok, rows = self._run(
            errors, self.speculative_step, self.decode_model.params, table, jnp.asarray(slots),
            jnp.asarray(start), jnp.asarray(count), jnp.asarray(tokens), jnp.asarray(room),
            self._sampling(live, range(len(live)), R, [r.drafts[:n] for r, n in zip(live, n_drafts)]),
            width=self._width(table, np.maximum(start + count, room if c.mtp_drafts else 0)))  # the MTP's writes reach room
        emitted, accepted, ok = np.asarray(emitted), np.asarray(accepted), np.asarray(ok)
        self._keep_replay_rows(live, rows, start, accepted + 1, ok)  # the fed token and the kept drafts
        drafts = None if drafts is None else [d.tolist() for d in np.asarray(drafts)[: len(live)]]
        host_lp = jax.device_get(logprobs) if any(r.logprobs is not None for r in live) else None
        got = [emitted[i, : accepted[i] + 1].tolist() for i in range(len(live))]
        got_lp = [None if r.logprobs is None else [_token_logprobs(host_lp, i * (K + 1) + j, r.logprobs)
                                                   for j in range(len(got[i]))] for i, r in enumerate(live)]
        return Output(emitted[:, 0], ok, errors, [lp and lp[0] for lp in got_lp], drafts=drafts, emitted=got,
                      emitted_logprobs=got_lp)

    def lowered_decode_text(self, table: pt.PageTable) -> str:
        """The decode step's lowered HLO text (to show that integrity='off' traces no check)."""
        B = self.cfg.max_batch
        z = jnp.zeros(B, jnp.int32)
        args = (self.decode_model.params, self.pools, self.scales, table, z, z, z, jnp.zeros((B, 1), jnp.int32))
        with jax.set_mesh(self.cfg.mesh):
            return self.decode_step.lower(*args, width=table.max_pages_per_seq).as_text(debug_info=True)


# ---- the jitted steps ---------------------------------------------------------------------------
# Plain functions of their arguments and a StepSpec; steps_for jits them for one spec.

class Steps(NamedTuple):
    """One spec's jitted steps: each takes (params, pools, scales, table, ...) and a static width.
    Under integrity 'strict' they are checkify-wrapped and return (error, outputs): the runner
    raises the error once the failing requests are aborted."""
    prefill: Callable
    decode: Callable  # the forward: logits; pick samples them
    speculative: Callable
    pick: Callable  # (logits, sampling) -> tokens and logprobs: no pools, no width


@functools.lru_cache(maxsize=8)
def steps_for(spec: StepSpec) -> Steps:
    """The jitted steps of `spec`, the same objects for every runner of an equal spec, so their
    compiled programs too. The cache keeps the steps of the last 8 specs asked for: a program
    outlives the engines that ran it only that long, which bounds a process's memory (a compiled
    tiny-model step holds megabytes; a test worker runs hundreds of engines)."""

    def jit(step_fn):
        step_fn = functools.partial(step_fn, spec=spec)
        step_fn = checkify.checkify(step_fn) if spec.integrity == "strict" else step_fn
        return jax.jit(step_fn, donate_argnums=1, static_argnames="width")  # argument 1: the pools

    return Steps(jit(_prefill), jit(_decode), jit(_speculative), jax.jit(functools.partial(pick, spec=spec)))


def _paged_kv(spec: StepSpec, pools, scales, step: StepInputs, width: int, verify_tokens: int = 1) -> PagedKV:
    step = dataclasses.replace(step, pages_BN=step.pages_BN[:, :width])
    return PagedKV(pools, step, spec.page_size, *scales, spec.attention_backend, spec.split_slots, verify_tokens)


def _placed(spec: StepSpec, pools):
    """The step's new pools, kept in the pools' sharding (so the next step neither reshards nor
    recompiles)."""
    if spec.mesh is None:
        return pools
    return jax.lax.with_sharding_constraint(pools, sharding.pool_shardings(pools, spec.mesh, spec.split_slots))


def _forward(spec: StepSpec, params, *args, **kwargs):
    """spec.module's forward -> (its output, and the replay rows the spec returns, {Result field:
    [B, T, ...]}: the experts each MoE layer chose per token, int16 [B, T, L, K], and the positions
    each DSA indexer layer chose, int32 [B, T, L, index_topk]; None: neither)."""
    if not (spec.routed_experts or spec.indexer_topk):
        return spec.module.apply({"params": params}, *args, **kwargs), None
    out, state = spec.module.apply({"params": params}, *args, mutable=["intermediates"], **kwargs)
    cfg, rows = spec.module.cfg, {}
    if spec.routed_experts:
        rows[ROUTED_EXPERTS] = moe.sown_routes(state["intermediates"], cfg)
    if spec.indexer_topk:
        rows[INDEXER_TOPK] = attention.sown_indexer_topk(state["intermediates"], cfg)
    return out, rows


def _checked_step(spec: StepSpec, table: pt.PageTable, slots_R, start_R, count_R) -> tuple[StepInputs, jax.Array]:
    """The rows' view of the page table, after the integrity check of their slots (traced only
    when it is on) -> (step inputs, ok per row). A failing row neither writes nor reads: its
    mapping may point into another request's pages, and the call's KV write would corrupt them."""
    step = StepInputs(table.pages_BN[slots_R], start_R, count_R)
    if spec.integrity == "off":
        return step, jnp.ones(count_R.shape, bool)
    # The check runs over slots; padding rows repeat slot 0 with no token (max = or).
    active_B = jnp.zeros(table.pages_BN.shape[0], bool).at[slots_R].max(count_R > 0)
    with jax.named_scope("kv_integrity_check"):
        report = pt.verify(table, active_B)
    if spec.integrity == "strict":
        pt.checked(report)
    ok_R = report.ok_B[slots_R]
    return dataclasses.replace(step, count_B=jnp.where(ok_R, count_R, 0)), ok_R


def _prefill(params, pools, scales, table, slots_R, start_R, count_R, tokens_RC, sampling, targets_RC, after_R, room_R,
             *, spec: StepSpec, width: int):
    """One prefill call. targets_RC: the token after each position, to compute prompt logprobs
    (None: none, and only the last position of each row meets the vocabulary projection). after_R,
    room_R (speculative only, else None): the token after each row's chunk (-1: the sampled one)
    and the positions its pages hold."""
    step, ok_R = _checked_step(spec, table, slots_R, start_R, count_R)
    kv = _paged_kv(spec, pools, scales, step, width)
    R, C = tokens_RC.shape
    positions_RC = start_R[:, None] + jnp.arange(C)
    valid_RC = jnp.arange(C)[None, :] < step.count_B[:, None]
    last_R = jnp.maximum(step.count_B - 1, 0)
    prompt_logprobs = None
    return_hidden = after_R is not None
    if targets_RC is None:
        out, rows_RC = _forward(spec, params, tokens_RC, positions_RC, kv, logits_at=last_R,
                                    valid_BT=valid_RC, return_hidden=return_hidden)
    elif spec.mesh is not None:  # each device holds its share of the vocabulary's logits
        out, rows_RC = _forward(spec, params, tokens_RC, positions_RC, kv, valid_BT=valid_RC,
                                    return_hidden=return_hidden)
    else:  # rows flattened: position j of row r is row r * C + j

        def project(x_RCD, head_DV):
            x_last = jnp.take_along_axis(x_RCD, last_R[:, None, None], axis=1)
            return (jnp.einsum("btd,dv->btv", x_last, head_DV, preferred_element_type=jnp.float32),
                    blocked_logprobs(x_RCD.reshape(R * C, -1), head_DV, targets_RC.reshape(-1), spec.max_logprobs))

        out, rows_RC = _forward(spec, params, tokens_RC, positions_RC, kv, valid_BT=valid_RC, project=project,
                                    return_hidden=return_hidden)
    out, hidden_RCD = out if return_hidden else (out, None)
    if targets_RC is None:
        logits = out
    elif spec.mesh is not None:
        prompt_logprobs = logprobs_of(out.reshape(R * C, -1), targets_RC.reshape(-1), spec.max_logprobs)
        logits = jnp.take_along_axis(out, last_R[:, None, None], axis=1)
    else:
        logits, prompt_logprobs = out
    tokens_R, picked_RV = sample(logits[:, 0], sampling)
    pools, drafts_RK = kv.new_pools, None
    if after_R is not None:  # the MTP layer over the chunk: position p pairs h_p with token p + 1
        after_R = jnp.where(after_R < 0, tokens_R, after_R)
        shifted_RC = jnp.concatenate([tokens_RC[:, 1:], jnp.zeros((R, 1), tokens_RC.dtype)], axis=1)
        shifted_RC = jnp.where(jnp.arange(C)[None, :] == last_R[:, None], after_R[:, None], shifted_RC)
        pools, drafts_RK = _draft(spec, params, pools, scales, step, shifted_RC, hidden_RCD, room_R, width)
    return (_placed(spec, pools), tokens_R, token_logprobs(spec, logits[:, 0], picked_RV, tokens_R, sampling),
            prompt_logprobs, ok_R, drafts_RK, rows_RC)


def _draft(spec: StepSpec, params, pools, scales, step: StepInputs, tokens_RT, hidden_RTD, room_R, width: int):
    """The MTP layer over each row's step positions (its KV cache written there; token p + 1 and
    hidden state h_p at position p), then speculative_tokens - 1 single steps on its own guesses
    -> (pools, the next step's drafts [R, speculative_tokens]). Nothing is written at or past
    room_R (the positions the row's pages hold): a draft step there sees nothing and guesses
    junk, which the next verify rejects."""
    module, T = spec.module, tokens_RT.shape[1]
    count_R = jnp.clip(jnp.minimum(step.count_B, room_R - step.start_B), 0, None)
    kv = _paged_kv(spec, pools, scales, dataclasses.replace(step, count_B=count_R), width)
    last_R = jnp.maximum(count_R - 1, 0)
    logits, hidden_RTD = module.apply({"params": params}, tokens_RT, step.start_B[:, None] + jnp.arange(T), kv,
                                      logits_at=last_R, valid_BT=jnp.arange(T)[None, :] < count_R[:, None],
                                      draft_from=hidden_RTD)
    guess_R = jnp.argmax(logits[:, 0], axis=-1).astype(jnp.int32)
    hidden_R1D = jnp.take_along_axis(hidden_RTD, last_R[:, None, None], axis=1)
    position_R, drafts = step.start_B + last_R + 1, [guess_R]
    for _ in range(spec.speculative_tokens - 1):
        pools = kv.new_pools
        one_R = ((count_R > 0) & (position_R < room_R)).astype(jnp.int32)
        kv = _paged_kv(spec, pools, scales, StepInputs(step.pages_BN, position_R, one_R), width)
        logits, hidden_R1D = module.apply({"params": params}, guess_R[:, None], position_R[:, None], kv,
                                          valid_BT=one_R[:, None] > 0, draft_from=hidden_R1D)
        guess_R = jnp.argmax(logits[:, 0], axis=-1).astype(jnp.int32)
        drafts.append(guess_R)
        position_R = position_R + 1
    return kv.new_pools, jnp.stack(drafts, axis=1)


def _speculative(params, pools, scales, table, slots_R, start_R, count_R, tokens_RJ, room_R, sampling, *,
                 spec: StepSpec, width: int):
    """One speculative decode step (mixserve/speculative.py): verify each request's token and
    drafts, one row per position (the attention reads each request's pages once for its rows:
    PagedKV.verify_tokens), accept, and draft the next ones."""
    R, J = tokens_RJ.shape
    start_X = (start_R[:, None] + jnp.arange(J)).reshape(-1)
    count_X = (jnp.arange(J)[None, :] < count_R[:, None]).reshape(-1).astype(jnp.int32)
    step_X, ok_X = _checked_step(spec, table, jnp.repeat(slots_R, J), start_X, count_X)
    kv = _paged_kv(spec, pools, scales, step_X, width, verify_tokens=J)  # the kernels read a request's pages once
    (logits_X1V, hidden_X1D), rows_X1 = _forward(spec, params, tokens_RJ.reshape(-1, 1), start_X[:, None], kv,
                                                     valid_BT=step_X.count_B[:, None] > 0, return_hidden=True)
    ok_R = ok_X.reshape(R, J)[:, 0]  # a request's rows share its slot, so its check
    s_X = speculative.per_position(sampling, J)
    accepted_R, emitted_RJ, picked_XV = speculative.accept(logits_X1V.reshape(R, J, -1), tokens_RJ[:, 1:],
                                                           jnp.maximum(count_R - 1, 0), s_X)
    logprobs = token_logprobs(spec, logits_X1V[:, 0], picked_XV, emitted_RJ.reshape(-1), s_X)
    pools, drafts_RK = kv.new_pools, None
    if spec.mtp_drafts:  # the MTP layer pairs each kept position's hidden state with the token emitted after it
        kept = StepInputs(table.pages_BN[slots_R], start_R, jnp.where(ok_R & (count_R > 0), accepted_R + 1, 0))
        pools, drafts_RK = _draft(spec, params, pools, scales, kept, emitted_RJ, hidden_X1D.reshape(R, J, -1),
                                  room_R, width)
    rows_RJ = None if rows_X1 is None else {name: a.reshape(R, J, *a.shape[2:]) for name, a in rows_X1.items()}
    return _placed(spec, pools), emitted_RJ, accepted_R, drafts_RK, logprobs, ok_R, rows_RJ


def _decode(params, pools, scales, table, slots_R, start_R, count_R, tokens_R1, *, spec: StepSpec, width: int):
    """A decode step's forward: the new pools, each row's logits and its integrity ok (pick
    samples them, a program of its own: the host builds its inputs while this one runs)."""
    step, ok_R = _checked_step(spec, table, slots_R, start_R, count_R)
    kv = _paged_kv(spec, pools, scales, step, width)
    logits_R1V, rows_R1 = _forward(spec, params, tokens_R1, start_R[:, None], kv, valid_BT=step.count_B[:, None] > 0)
    return _placed(spec, kv.new_pools), logits_R1V[:, 0], ok_R, rows_R1


def pick(logits_RV, sampling, *, spec: StepSpec):
    """A decode step's sampling: each row's token and its logprobs."""
    tokens_R, picked_RV = sample(logits_RV, sampling)
    return tokens_R, token_logprobs(spec, logits_RV, picked_RV, tokens_R, sampling)


def attended_pages(tokens: int, page_size: int, max_pages: int, min_tokens: int) -> int:
    """Page-table columns a step attends over when its longest row ends at `tokens` tokens: a
    power of two of pages covering max(tokens, min_tokens), at most the whole table."""
    return _power_of_two_at_least(-(-max(tokens, min_tokens) // page_size), max_pages)


def penalty_width(tokens: int) -> int:
    """Columns of a step's penalty token lists when its most varied penalized request holds `tokens`
    distinct tokens: 0 when none is penalized, else a power of two >= max(tokens, 64), so a
    request's growing output compiles a new step only when it doubles its distinct tokens."""
    return 0 if tokens == 0 else _power_of_two_at_least(max(tokens, 64), 1 << 31)


def step_rows(requests: int, max_batch: int, min_rows: int) -> int:
    """Rows a decode step or prefill call runs for its requests: a power of two >= max(requests,
    min_rows), at most max_batch (min_rows = max_batch: every call runs max_batch rows)."""
    return _power_of_two_at_least(max(requests, min_rows), max_batch)


def prefill_tokens(n: int, prefill_chunk: int, min_tokens: int) -> int:
    """Length of a prefill chunk holding n tokens: a power of two >= max(n, min_tokens), at most
    prefill_chunk (min_tokens = prefill_chunk pads every chunk to prefill_chunk)."""
    return _power_of_two_at_least(max(n, min_tokens), prefill_chunk)


def _power_of_two_at_least(n: int, cap: int) -> int:
    return min(1 << (n - 1).bit_length(), cap)


def token_logprobs(spec: StepSpec, raw_BV, picked_BV, tokens_B, s: Sampling) -> Logprobs:
    """Each row's token's log-probability and rank, and its max_logprobs likeliest tokens, in the
    spec's logprobs mode (vLLM's): of the model's raw logits, or of those the token was picked from
    (picked_BV: sampling.sample's, with the temperature, truncation, bias, penalties and grammar
    the row applied; what it left out is at -inf), as log-probabilities or as logits ("*_logits").
    Computed only when a row asked (lax.cond: a top-n over the vocabulary is no free pass)."""
    B, n = raw_BV.shape[0], spec.max_logprobs
    logits_BV = picked_BV if spec.logprobs_mode.startswith("processed") else raw_BV

    def skip(_):
        return Logprobs(jnp.zeros(B), jnp.zeros(B, jnp.int32), jnp.zeros((B, n), jnp.int32), jnp.zeros((B, n)))

    normalized = spec.logprobs_mode.endswith("logprobs")
    return jax.lax.cond(jnp.any(s.logprobs_B), lambda x: logprobs_of(x, tokens_B, n, normalized), skip, logits_BV)


def logprobs_of(logits_BV, tokens_B, n: int, normalized: bool = True) -> Logprobs:
    """Each row's log_softmax at its token (normalized=False: its logit), the token's rank, and the
    row's n likeliest tokens."""
    B = logits_BV.shape[0]
    logits_BV = logits_BV.astype(jnp.float32)
    norm_B = jax.nn.logsumexp(logits_BV, axis=-1) if normalized else jnp.zeros(B)
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
    """Row `row` of a step's logprobs (read to the host), with its n likeliest tokens: fewer where
    a processed mode's truncation left fewer than n (those past it, at -inf, name no token)."""
    top = zip(host.top_ids_BN[row, :n].tolist(), host.top_BN[row, :n].tolist())
    return TokenLogprobs(float(host.token_B[row]), int(host.rank_B[row]), tuple((t, v) for t, v in top if v != -np.inf))
