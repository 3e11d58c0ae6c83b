"""Continuous-batching engine over paged KV pools, with KV integrity tags checked every decode step.

One request's path: `generate` validates it (bad input -> status "rejected", per request) and
queues it; `_admit` gives it a batch slot and pages from the page table (mixserve/page_table.py);
`_prefill` runs its prompt in fixed-size chunks; then every `_decode` step runs all live slots
at once (jitted over a fixed max_batch), after the integrity check when it is on:
  off     no check is traced into the step at all
  check   a separate batched verify() before the step touches the pages; a failing request
          writes and reads nothing, is aborted with a reason naming the page and the tags, and
          the others go on untouched
  strict  the same check raised as an error through jax.experimental.checkify
When pages run out, the youngest running request is preempted (pages freed, requeued to be
recomputed from its prompt plus what it generated): nothing is dropped.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
import time
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify

import pallas_kernels
from mixserve import page_table as pt
from mixserve.kv_cache import PagedKV, StepInputs, bytes_per_token, init_pools, storage_dtype
from mixserve.model import Model

Integrity = Literal["off", "check", "strict"]


@dataclasses.dataclass
class Result:
    tokens: list[int]
    status: Literal["ok", "aborted", "rejected"]
    reason: str | None = None
    ttft_s: float | None = None  # time to first token
    token_latencies_s: list[float] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class _Request:
    rid: int
    prompt: list[int]
    max_new_tokens: int
    temperature: float
    top_p: float
    seed: int
    index: int = 0  # position in its generate() call: with the seed, it fixes the sampling keys
    out: list[int] = dataclasses.field(default_factory=list)
    slot: int | None = None
    pages: int = 0  # pages held (host mirror of the page table)
    cached: int = 0  # tokens whose KV is in the pages
    t_submit: float = 0.0
    t_last: float = 0.0
    ttft: float | None = None
    latencies: list[float] = dataclasses.field(default_factory=list)
    result: Result | None = None

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.out


@dataclasses.dataclass
class Counters:
    steps: int = 0
    prefill_chunks: int = 0
    preemptions: int = 0
    aborts: int = 0
    rejections: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    peak_pages_in_use: int = 0
    shared_pages: int = 0  # pages a request got from another's identical prompt prefix
    decode_step_s: list[float] = dataclasses.field(default_factory=list)


class Engine:
    def __init__(self, model: Model, *, kv_dtype: str = "auto", page_size: int = 16, num_pages: int | None = None,
                 kv_memory_bytes: int | None = None, max_batch: int = 8, max_seq_len: int | None = None,
                 prefill_chunk: int = 64, integrity: Integrity = "off", k_scale=1.0, v_scale=1.0,
                 stop_tokens: tuple[int, ...] | None = None, attention_backend: str = "xla",
                 prefix_sharing: bool = True, decode_model: Model | None = None, fault_hook=None):
        cfg = model.config
        if integrity not in ("off", "check", "strict"):
            raise ValueError(f"integrity must be 'off', 'check' or 'strict', got {integrity!r}")
        if page_size <= 0 or max_batch <= 0 or prefill_chunk <= 0:
            raise ValueError("page_size, max_batch and prefill_chunk must be positive")
        if (num_pages is None) == (kv_memory_bytes is None):
            raise ValueError("give exactly one of num_pages or kv_memory_bytes")
        if decode_model is not None and decode_model.config != cfg:
            raise ValueError("decode_model must be the same model (same config) in another weight format")
        # Hybrid precision: prefill runs `model` (e.g. FP8 weights), decode `decode_model` (e.g.
        # INT4); the KV pages written by prefill are what decode reads. On one device this holds
        # two weight sets.
        self.model, self.decode_model, self.cfg, self.integrity = model, decode_model or model, cfg, integrity
        self.prefix_sharing = prefix_sharing
        self._prefix_pages: dict[int, int] = {}  # chained page hash -> live physical page
        self.kv_dtype = storage_dtype(kv_dtype, model.dtype)
        self.page_size = page_size
        self.bytes_per_token = bytes_per_token(cfg, self.kv_dtype)
        if num_pages is None:
            num_pages = kv_memory_bytes // (self.bytes_per_token * page_size)
        if num_pages <= 0:
            raise ValueError(f"the KV budget holds no page ({self.bytes_per_token * page_size} bytes per page)")
        self.num_pages, self.max_batch, self.prefill_chunk = int(num_pages), max_batch, prefill_chunk
        self.max_seq_len = min(max_seq_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
        self.max_pages_per_seq = math.ceil(self.max_seq_len / page_size)
        k_scale, v_scale = jnp.asarray(k_scale, jnp.float32), jnp.asarray(v_scale, jnp.float32)
        if cfg.attention_kind == "mla" and (k_scale.ndim or v_scale.ndim):
            raise ValueError("MLA keeps one latent per token: use a per-tensor (scalar) k_scale")
        for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
            if s.ndim and s.shape != (cfg.num_kv_heads,):
                raise ValueError(f"{name} must be a scalar or one value per KV head ({cfg.num_kv_heads})")
            if not bool(jnp.all(jnp.isfinite(s) & (s > 0))):
                raise ValueError(f"{name} must be finite and positive")
        self.k_scale, self.v_scale = k_scale, v_scale
        self.stop_tokens = tuple(cfg.eos_token_ids if stop_tokens is None else stop_tokens)
        self.attention_backend = pallas_kernels.resolve_backend(attention_backend)  # "auto" -> pallas on GPU
        # fault_hook(table, decode_step) -> table runs before each decode step: tests and notebooks
        # use it with mixserve.faults to corrupt the bookkeeping on purpose.
        self.fault_hook = fault_hook
        self.pools = init_pools(cfg, self.num_pages, page_size, self.kv_dtype)
        self.table = pt.init_page_table(self.num_pages, max_batch, self.max_pages_per_seq)
        self.free_pages = self.num_pages
        self.counters = Counters()
        self._next_rid = 0

    # ---- public ---------------------------------------------------------------------------------
    @property
    def capacity_tokens(self) -> int:
        return self.num_pages * self.page_size

    @property
    def pages_in_use(self) -> int:
        return self.num_pages - self.free_pages

    def generate(self, prompts: list[list[int]], *, max_new_tokens: int, temperature: float = 0.0,
                 top_p: float = 1.0, seed: int = 0) -> list[Result]:
        requests = []
        for index, prompt in enumerate(prompts):
            req = _Request(self._next_rid, list(prompt) if isinstance(prompt, (list, tuple)) else prompt,
                           max_new_tokens, temperature, top_p, seed, index, t_submit=time.perf_counter())
            self._next_rid += 1
            reason = self._reject_reason(req)
            if reason:
                req.result = Result([], "rejected", reason)
                self.counters.rejections += 1
            requests.append(req)
        self._run(collections.deque(r for r in requests if r.result is None))
        return [r.result for r in requests]

    # ---- validation -----------------------------------------------------------------------------
    def _reject_reason(self, req: _Request) -> str | None:
        p = req.prompt
        if not isinstance(p, list) or not all(isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in p):
            return "prompt must be a list of integer token ids"
        if not p:
            return "empty prompt"
        bad = [t for t in p if not 0 <= t < self.cfg.vocab_size]
        if bad:
            return f"token ids outside the vocabulary [0, {self.cfg.vocab_size}): {bad[:5]}"
        if not isinstance(req.max_new_tokens, (int, np.integer)) or isinstance(req.max_new_tokens, bool) or req.max_new_tokens <= 0:
            return f"max_new_tokens must be a positive integer, got {req.max_new_tokens!r}"
        for name in ("temperature", "top_p"):
            v = getattr(req, name)
            if not isinstance(v, (int, float, np.floating, np.integer)) or isinstance(v, bool) or not math.isfinite(v):
                return f"{name} must be a finite number, got {v!r}"
        if req.temperature < 0 or not 0 < req.top_p <= 1:
            return f"need temperature >= 0 and 0 < top_p <= 1, got {req.temperature}, {req.top_p}"
        if not isinstance(req.seed, (int, np.integer)):
            return f"seed must be an integer, got {req.seed!r}"
        total = len(p) + req.max_new_tokens
        if total > self.max_seq_len:
            return f"prompt ({len(p)}) + max_new_tokens ({req.max_new_tokens}) = {total} exceeds the context limit {self.max_seq_len}"
        if self._pages_for(total) > self.num_pages:
            return f"needs {self._pages_for(total)} pages, the pool has {self.num_pages} in all"
        return None

    def _pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    # ---- scheduling -----------------------------------------------------------------------------
    def _run(self, waiting: collections.deque) -> None:
        running: list[_Request] = []
        while waiting or running:
            self._admit(waiting, running)
            if running:
                self._ensure_decode_pages(running, waiting)
                self._decode(running)
            for req in [r for r in running if r.result is not None]:
                self._release(req)
                running.remove(req)

    def _admit(self, waiting, running) -> None:
        """Give waiting requests a slot and pages (sharing cached full prompt pages), then prefill
        them right away, so that the next admission can share their pages."""
        free_slots = sorted(set(range(self.max_batch)) - {r.slot for r in running})
        while waiting and free_slots:
            req = waiting[0]
            shared = self._shared_prefix(req)
            need = self._pages_for(len(req.tokens)) - len(shared)
            if need > self.free_pages:
                if not running:  # nothing will ever free pages: only leaked pages can cause this
                    waiting.popleft().result = Result(list(req.out), "aborted", f"KV pool exhausted: {self.free_pages} free pages, "
                                                      f"{need} needed (pages leaked after a detected bookkeeping fault)")
                    self.counters.aborts += 1
                    continue
                break
            req.slot = free_slots.pop(0)
            if shared:
                ids = np.zeros(self.max_pages_per_seq, np.int32)
                ids[: len(shared)] = shared
                self.table, ok = _share_jit(self.table, jnp.int32(req.slot), jnp.asarray(ids), jnp.int32(len(shared)))
                assert bool(ok), "prefix index points at a page that is not live"
                req.pages, req.cached = len(shared), len(shared) * self.page_size
                self.counters.shared_pages += len(shared)
            self._allocate(req, need)
            waiting.popleft()
            running.append(req)
            self._prefill(req)

    # ---- prefix sharing (full pages of identical token prefixes, as in nano-vllm's BlockManager) --
    def _page_hashes(self, tokens: list[int]) -> list[int]:
        """One hash per full page of tokens[:-1] (the last token is fed by decode), chained so a
        page's hash covers the whole prefix before it."""
        S, hashes, h = self.page_size, [], 0
        for i in range((len(tokens) - 1) // S):
            h = hash((h, tuple(tokens[i * S : (i + 1) * S])))
            hashes.append(h)
        return hashes

    def _shared_prefix(self, req: _Request) -> list[int]:
        if not self.prefix_sharing:
            return []
        pages = []
        for h in self._page_hashes(req.tokens):
            if h not in self._prefix_pages:
                break
            pages.append(self._prefix_pages[h])
        return pages

    def _register_prefix(self, req: _Request) -> None:
        if not self.prefix_sharing:
            return
        row = np.asarray(self.table.pages_BN[req.slot])
        for i, h in enumerate(self._page_hashes(req.tokens)):
            self._prefix_pages.setdefault(h, int(row[i]))

    def _forget_freed_pages(self) -> None:
        refs = np.asarray(self.table.ref_count_P)
        self._prefix_pages = {h: p for h, p in self._prefix_pages.items() if refs[p] > 0}

    def _allocate(self, req: _Request, n: int) -> None:
        self.table, ok = _allocate_jit(self.table, jnp.int32(req.slot), jnp.int32(n))
        assert bool(ok), "host page accounting disagrees with the page table"
        req.pages += n
        self.free_pages -= n
        self.counters.peak_pages_in_use = max(self.counters.peak_pages_in_use, self.num_pages - self.free_pages)

    def _release(self, req: _Request) -> None:
        self.table = _release_jit(self.table, jnp.int32(req.slot))
        self.free_pages = int(pt.num_free(self.table))  # the table is the authority (a fault may leak pages)
        self._forget_freed_pages()
        req.slot, req.pages, req.cached = None, 0, 0

    def _ensure_decode_pages(self, running: list, waiting: collections.deque) -> None:
        """Each running request needs room for the token it decodes next; preempt the youngest if not."""
        for req in sorted(running, key=lambda r: r.rid):
            if req.result is not None or req.slot is None:
                continue
            while self._pages_for(len(req.tokens)) > req.pages:
                if self.free_pages > 0:
                    self._allocate(req, 1)
                    continue
                victim = max((r for r in running if r.slot is not None and r.result is None), key=lambda r: r.rid)
                self._release(victim)
                running.remove(victim)
                waiting.appendleft(victim)  # recomputed from prompt + generated tokens when readmitted
                self.counters.preemptions += 1
                if victim is req:
                    break

    # ---- device steps ---------------------------------------------------------------------------
    def _step_inputs(self, start, count):
        return StepInputs(self.table.pages_BN, jnp.asarray(start, jnp.int32), jnp.asarray(count, jnp.int32))

    def _prefill(self, req: _Request) -> None:
        """Cache every token not yet in the pages, one chunk at a time, and sample the first new
        token from the last position (so prefill's weights choose it, as in disaggregated serving)."""
        t0 = time.perf_counter()
        tokens = req.tokens
        B, C = self.max_batch, self.prefill_chunk
        while req.cached < len(tokens):
            n = min(C, len(tokens) - req.cached)
            chunk, start, count = np.zeros((B, C), np.int32), np.zeros(B, np.int32), np.zeros(B, np.int32)
            chunk[req.slot, :n] = tokens[req.cached : req.cached + n]
            start[req.slot], count[req.slot] = req.cached, n
            self.pools, next_tok = self._forward_fn(
                self.model.params, self.pools, self._step_inputs(start, count), jnp.asarray(chunk), *self._sampling([req])
            )
            req.cached += n
            self.counters.prefill_chunks += 1
            self.counters.prefill_tokens += n
        token = int(next_tok[req.slot])
        self.counters.prefill_s += time.perf_counter() - t0
        self._register_prefix(req)
        self._accept(req, token, time.perf_counter())

    def _decode(self, running: list[_Request]) -> None:
        live = [r for r in running if r.result is None and r.slot is not None]
        if not live:
            return
        t0 = time.perf_counter()
        B = self.max_batch
        tokens, start, count = np.zeros((B, 1), np.int32), np.zeros(B, np.int32), np.zeros(B, np.int32)
        for r in live:
            tokens[r.slot, 0], start[r.slot], count[r.slot] = r.tokens[-1], len(r.tokens) - 1, 1
        active = jnp.asarray(count > 0)
        if self.fault_hook is not None:
            self.table = self.fault_hook(self.table, self.counters.steps)
        args = (self.decode_model.params, self.pools, self.table, self._step_inputs(start, count), jnp.asarray(tokens),
                active, *self._sampling(live))
        if self.integrity == "strict":
            err, (self.pools, next_tok, ok) = self._decode_fn(*args)
            err.throw()
        else:
            self.pools, next_tok, ok = self._decode_fn(*args)
        next_tok, ok = np.asarray(next_tok), np.asarray(ok)
        now = time.perf_counter()
        self.counters.steps += 1
        self.counters.decode_s += now - t0
        self.counters.decode_step_s.append(now - t0)
        report = None
        for r in live:
            if not ok[r.slot]:
                report = report or _verify_jit(self.table, active)
                r.result = Result(list(r.out), "aborted", "KV integrity check failed: " + pt.describe(report, r.slot),
                                  *self._timing(r))
                self.counters.aborts += 1
                continue
            r.cached = len(r.tokens)
            self.counters.decode_tokens += 1
            self._accept(r, int(next_tok[r.slot]), now)

    def _sampling(self, reqs: list[_Request]):
        """Per-slot temperature, top-p and the three integers the sampling key is derived from in
        the step (seed, position of the request in its generate call, token index): the same call
        gives the same tokens on any engine, and a preempted, recomputed request samples what it
        would have."""
        B = self.max_batch
        temp, top_p, key_ints = np.zeros(B, np.float32), np.ones(B, np.float32), np.zeros((B, 3), np.uint32)
        for r in reqs:
            temp[r.slot], top_p[r.slot] = r.temperature, r.top_p
            key_ints[r.slot] = (r.seed % 2**32, r.index, len(r.out))
        return jnp.asarray(temp), jnp.asarray(top_p), jnp.asarray(key_ints)

    def _accept(self, r: _Request, token: int, now: float) -> None:
        r.out.append(token)
        if len(r.out) == 1:
            r.ttft = now - r.t_submit
        else:
            r.latencies.append(now - r.t_last)
        r.t_last = now
        if token in self.stop_tokens or len(r.out) >= r.max_new_tokens:
            r.result = Result(list(r.out), "ok", None, *self._timing(r))

    @staticmethod
    def _timing(r: _Request):
        return r.ttft, list(r.latencies)

    # ---- jitted functions -------------------------------------------------------------------------
    def _paged_kv(self, pools, step):
        return PagedKV(pools, step, self.page_size, self.k_scale, self.v_scale, self.attention_backend)

    @functools.cached_property
    def _forward_fn(self):
        module = self.model.module

        def forward(params, pools, step, tokens, temp, top_p, keys):
            kv = self._paged_kv(pools, step)
            logits = module.apply({"params": params}, tokens, step.start_B[:, None] + jnp.arange(tokens.shape[1]), kv,
                                  logits_at=jnp.maximum(step.count_B - 1, 0))
            return kv.new_pools, sample(logits[:, 0], temp, top_p, keys)

        return jax.jit(forward, donate_argnums=1)

    @functools.cached_property
    def _decode_fn(self):
        module, integrity = self.decode_model.module, self.integrity

        def decode(params, pools, table, step, tokens, active, temp, top_p, keys):
            if integrity == "off":  # no check traced at all
                ok = active | True
            else:
                with jax.named_scope("kv_integrity_check"):
                    report = pt.verify(table, active)
                if integrity == "strict":
                    pt.checked(report)
                ok = report.ok_B
                # A failing row neither writes nor reads: its mapping may point into another
                # request's pages, and this step's KV write would corrupt them.
                step = dataclasses.replace(step, count_B=jnp.where(ok, step.count_B, 0))
            kv = self._paged_kv(pools, step)
            logits = module.apply({"params": params}, tokens, step.start_B[:, None], kv)[:, 0]
            return kv.new_pools, sample(logits, temp, top_p, keys), ok

        return jax.jit(checkify.checkify(decode) if integrity == "strict" else decode, donate_argnums=1)

    def lowered_decode_text(self) -> str:
        """The decode step's lowered HLO text (to show that integrity='off' traces no check)."""
        B = self.max_batch
        z = jnp.zeros(B, jnp.int32)
        args = (self.decode_model.params, self.pools, self.table, self._step_inputs(z, z), jnp.zeros((B, 1), jnp.int32),
                jnp.zeros(B, bool), jnp.zeros(B), jnp.ones(B), jnp.zeros((B, 3), jnp.uint32))
        return self._decode_fn.lower(*args).as_text(debug_info=True)


def sample(logits_BV, temp_B, top_p_B, key_ints_B3):
    """Greedy where temperature == 0, else temperature + nucleus (top-p) sampling, per row.
    key_ints_B3 = (seed, request index, token index) per row, folded into a key here (in the step,
    so the decode loop makes no per-request host calls)."""
    greedy = jnp.argmax(logits_BV, axis=-1)
    scaled = logits_BV / jnp.maximum(temp_B, 1e-6)[:, None]
    order = jnp.argsort(-scaled, axis=-1)
    sorted_logits = jnp.take_along_axis(scaled, order, axis=-1)
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    keep = (jnp.cumsum(probs, axis=-1) - probs) < top_p_B[:, None]  # always keeps the top token
    masked = jnp.where(keep, sorted_logits, -jnp.inf)
    keys = jax.vmap(lambda k: jax.random.fold_in(jax.random.fold_in(jax.random.key(k[0]), k[1]), k[2]))(key_ints_B3)
    choice = jax.vmap(jax.random.categorical)(keys, masked)
    sampled = jnp.take_along_axis(order, choice[:, None], axis=-1)[:, 0]
    return jnp.where(temp_B > 0, sampled, greedy).astype(jnp.int32)


_allocate_jit = jax.jit(pt.allocate)
_share_jit = jax.jit(pt.share)
_release_jit = jax.jit(pt.release)
_verify_jit = jax.jit(pt.verify)
