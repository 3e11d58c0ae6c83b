"""Continuous-batching engine over paged KV pools, with KV integrity tags checked every step.

One request's path through the files:
  `Engine.submit` (mixserve/frontend.py) validates it (mixserve/request.py: bad input -> status
  "rejected", per request) and queues it; each `Engine.step` is one turn of the loop
  (`_advance`, here) and reports what every request got in it (`generate` submits a batch and
  steps until it is done). In a step the
  Scheduler (mixserve/scheduler.py) gives the request a batch slot and pages from the functional
  page table (mixserve/page_table.py); the ModelRunner (mixserve/model_runner.py) prefills its
  prompt in chunks, one call per step by default (chunked prefill: the running requests decode
  between its chunks), then every decode step runs all live requests at once (as many rows as
  they need, rounded up to a power of two), after the integrity check when it is on; with
  speculative_tokens, each step verifies every request's drafts too and may give it several
  tokens (mixserve/speculative.py). The model (models/) reads and writes the pages through
  PagedKV (mixserve/kv_cache.py), which calls the attention kernels (pallas_kernels/) or their
  XLA references.
When pages run out, the youngest running request is preempted and recomputed later: nothing is
dropped. A request whose pages fail the integrity check (in any prefill or decode call) is aborted
with a reason naming the page and the tags; the others go on untouched (integrity "strict" then
raises the check's error, and the next step goes on). A prefill_only engine stops after the first token:
mixserve/disaggregated.py hands the request's pages to a decode engine.
"""

from __future__ import annotations

import dataclasses
import math
import time
import weakref
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

import pallas_kernels
from mixserve import page_table as pt
from mixserve import sharding, speculative
from mixserve.frontend import Frontend
from mixserve.grammar import Grammars
from mixserve.host_cache import HostKVCache
from mixserve.device_memory import holders, let_go
from mixserve.kv_cache import bytes_per_token, is_fp8, kv_format, layer_scales
from mixserve.model import Model, committed, on_host, placed_like, skeleton
from mixserve.model_runner import LOGPROBS_MODES, ModelRunner, RunnerConfig
from mixserve.request import Request, Result, TokenLogprobs, Update, reject_reason, replay_dtype
from mixserve.scheduler import Counters, PageManager, Scheduler

__all__ = ["Counters", "Engine", "EngineBusy", "Result", "SLEEP_TAGS", "TokenLogprobs", "Update", "WeightsDiscarded"]

_verify_jit = jax.jit(pt.verify)
DRAFTS = ("mtp", "ngram")  # who guesses the tokens speculative decoding verifies (mixserve/speculative.py)
RESTARTS = ("recompute", "abort")  # what update_weights does with the requests that ran on the old weights
SLEEP_TAGS = ("weights", "kv_cache")  # what sleep frees and wake_up takes back (vLLM's and SGLang's names)
# Engine.sleep_state: awake; the KV pools freed, the weights on the device; the weights in host
# memory (level 1) or discarded (level 2), the pools freed or not
SLEEP_STATES = ("awake", "kv_cache_freed", "weights_offloaded", "discard_all")


class Engine(Frontend):
    def __init__(self, model: Model, *, kv_dtype: str = "auto", page_size: int = 16, num_pages: int | None = None,
                 kv_memory_bytes: int | None = None, max_batch: int = 8, max_seq_len: int | None = None,
                 prefill_chunk: int = 64, integrity: str = "off", k_scale=None, v_scale=None,
                 stop_tokens: tuple[int, ...] | None = None, attention_backend: str = "xla",
                 prefix_caching: bool = True, decode_model: Model | None = None, fault_hook=None,
                 min_attended_tokens: int = 256, min_decode_rows: int = 1, min_prefill_tokens: int = 16,
                 min_prefill_rows: int = 1, max_prefill_rows: int | None = None, prefill_calls_per_step: int | None = 1,
                 mesh: Mesh | None = None, expert_parallel: bool = False, decode_context_parallel: bool = False,
                 prefill_only: bool = False, max_logprobs: int = 20, speculative_tokens: int = 0,
                 draft: str = "mtp", schedule_policy: str = "fcfs", host_kv_bytes: int = 0,
                 return_routed_experts: bool = False, return_indexer_topk: bool = False,
                 logprobs_mode: str = "raw_logprobs"):
        super().__init__()
        cfg = model.config
        if integrity not in ("off", "check", "strict"):
            raise ValueError(f"integrity must be 'off', 'check' or 'strict', got {integrity!r}")
        max_prefill_rows = max_batch if max_prefill_rows is None else max_prefill_rows
        for name, value in (("page_size", page_size), ("max_batch", max_batch), ("prefill_chunk", prefill_chunk),
                            ("min_attended_tokens", min_attended_tokens), ("min_decode_rows", min_decode_rows),
                            ("min_prefill_tokens", min_prefill_tokens), ("min_prefill_rows", min_prefill_rows),
                            ("max_prefill_rows", max_prefill_rows)):
            if value <= 0:
                raise ValueError(f"{name} must be positive, got {value}")
        if not isinstance(max_logprobs, int) or isinstance(max_logprobs, bool) or not 0 <= max_logprobs <= cfg.vocab_size:
            raise ValueError(f"max_logprobs must be an integer in [0, vocab_size={cfg.vocab_size}], got {max_logprobs!r}")
        if logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {', '.join(LOGPROBS_MODES)}, got {logprobs_mode!r}")
        if prefill_calls_per_step is not None and prefill_calls_per_step <= 0:
            raise ValueError(f"prefill_calls_per_step must be positive or None, got {prefill_calls_per_step}")
        if host_kv_bytes and not prefix_caching:
            raise ValueError("host_kv_bytes is the prefix cache's host tier: it needs prefix_caching")
        self.replay_dtype = replay_dtype(cfg, return_routed_experts, return_indexer_topk)
        if (num_pages is None) == (kv_memory_bytes is None):
            raise ValueError("give exactly one of num_pages or kv_memory_bytes")
        decode_model = None if decode_model is model else decode_model  # one set, held once
        _check_speculative(speculative_tokens, draft, model, decode_model)
        # Speculative decoding (mixserve/speculative.py): each decode step verifies up to this many
        # tokens guessed by the checkpoint's MTP layer ("mtp": its KV cache is one more layer in the
        # pools; a prefill_only engine fills it and makes the first drafts, for the decode engine),
        # or looked up in the request's own text ("ngram").
        self.speculative_tokens, self.draft = speculative_tokens, draft
        self.mtp_drafts = mtp = speculative_tokens > 0 and draft == "mtp"
        if decode_model is not None and decode_model.config != cfg:
            raise ValueError("decode_model must be the same model (same config) in another weight format")
        self.cfg, self.integrity = cfg, integrity
        self.kv_format = kv_format(kv_dtype, model.dtype)
        self.page_size = page_size
        self.bytes_per_token = bytes_per_token(cfg, self.kv_format, mtp=mtp)
        # Tensor parallel over mesh axis "model" (mixserve/sharding.py): kv_memory_bytes is per device.
        self.mesh = mesh = None if mesh is None else sharding.as_auto(mesh)
        self.attention_backend = pallas_kernels.resolve_backend(attention_backend)  # "auto" -> pallas on GPU
        if decode_context_parallel:
            _check_context_parallel(cfg, mesh, page_size, self.attention_backend)
        self.kv_bytes_per_token_per_device = sharding.kv_bytes_per_device(cfg, self.kv_format, mesh,
                                                                          decode_context_parallel, mtp)
        if num_pages is None:
            num_pages = kv_memory_bytes // (self.kv_bytes_per_token_per_device * page_size)
        if num_pages <= 0:
            raise ValueError(f"the KV budget holds no page ({self.kv_bytes_per_token_per_device * page_size} bytes "
                             "per page on a device)")
        if num_pages >= 2**31:  # the page table's ids and the kernels' page indices are int32
            raise ValueError(f"{int(num_pages)} pages: the page table holds at most 2**31 - 1 (int32 page ids)")
        self.num_pages, self.max_batch = int(num_pages), max_batch
        # Prefilling requests share each prefill call, a row each (at most max_prefill_rows x
        # prefill_chunk tokens per call); 1 prefills one request at a time.
        self.max_prefill_rows = max_prefill_rows
        # Chunked prefill: a step runs at most this many prefill calls before its decode step, so a
        # long prompt delays the running requests' next token by one call, not by its whole
        # prefill. None prefills every admitted prompt fully first (better time to first token).
        self.prefill_calls_per_step = prefill_calls_per_step
        # A prefill server (mixserve/disaggregated.py): it never decodes; a prefilled request keeps
        # its pages until the decode server has taken them.
        self.prefill_only = prefill_only
        # How many likeliest tokens a request may ask for (vLLM's default, 20): every step computes
        # that many when a row asks, so it is fixed with the compiled shapes.
        self.max_logprobs = max_logprobs
        # What those logprobs are of (vLLM's --logprobs-mode): the model's own distribution ("raw"),
        # or the one each token was drawn from ("processed": temperature, truncation, bias,
        # penalties, grammar), as log-probabilities or logits. RL wants the processed ones: they
        # are the rollout policy's. Prompt logprobs are the raw log-probabilities in every mode (vLLM's).
        self.logprobs_mode = logprobs_mode
        if max_seq_len is not None and not 0 < max_seq_len <= cfg.max_position_embeddings:
            raise ValueError(f"max_seq_len={max_seq_len} must be in [1, max_position_embeddings={cfg.max_position_embeddings}]")
        self.max_seq_len = max_seq_len or cfg.max_position_embeddings
        self.max_pages_per_seq = math.ceil(self.max_seq_len / page_size)
        # FP8 KV scales (real = stored * scale): given as a scalar, per KV head or per layer
        # (kv_cache.layer_scales); None: the checkpoint's calibrated ones when it ships them and the
        # pools are untiled FP8 (tiled pools carry their own), else 1.
        shipped = model.kv_scales if is_fp8(self.kv_format.dtype) and not self.kv_format.tiled else None
        self.kv_scales_from_checkpoint = shipped is not None and k_scale is None and v_scale is None  # both
        defaults = (1.0, 1.0) if shipped is None else (shipped[0][:, None], shipped[1][:, None])
        k_scale = layer_scales(defaults[0] if k_scale is None else k_scale, "k_scale", cfg, mtp)
        v_scale = layer_scales(defaults[1] if v_scale is None else v_scale, "v_scale", cfg, mtp)
        self.stop_tokens = tuple(cfg.eos_token_ids if stop_tokens is None else stop_tokens)
        self.tokenizer = model.tokenizer  # decodes the outputs of requests with stop strings
        self.grammars = Grammars(self.tokenizer, cfg.vocab_size, self.stop_tokens)  # structured outputs
        sharding.check_mesh(mesh, cfg.n_routed_experts, expert_parallel)
        if mesh is not None:
            model = sharding.shard_model(model, mesh, expert_parallel)
            decode_model = None if decode_model is None else sharding.shard_model(decode_model, mesh, expert_parallel)
        else:  # as update_weights places new weights: jit's cache keys on it
            model, decode_model = committed(model), decode_model and committed(decode_model)
        # fault_hook(table, decode_step) -> table runs before each decode step: tests and notebooks
        # use it with mixserve.faults to corrupt the bookkeeping on purpose.
        self.fault_hook = fault_hook
        self.counters = Counters()
        # Prefix caching (mixserve/scheduler.py): full pages outlive their requests until evicted,
        # and an identical prefix shares them; False computes every prompt whole (the ablation).
        self.page_manager = PageManager(self.num_pages, page_size, max_batch, self.max_pages_per_seq, prefix_caching,
                                        self.counters, lookahead=int(mtp),
                                        replay_rows=self.replay_dtype is not None)
        self.scheduler = Scheduler(self.page_manager, max_batch, self.counters, schedule_policy)
        # Hybrid precision: prefill runs `model` (e.g. FP8 weights), decode `decode_model` (e.g.
        # INT4); the KV pages written by prefill are what decode reads. On one device this holds
        # two weight sets.
        self.runner = ModelRunner(model, decode_model or model, RunnerConfig(
            num_pages=self.num_pages, page_size=page_size, kv_format=self.kv_format, max_batch=max_batch,
            prefill_chunk=prefill_chunk, k_scale=k_scale, v_scale=v_scale, attention_backend=self.attention_backend,
            integrity=integrity, min_attended_tokens=min_attended_tokens, min_decode_rows=min_decode_rows,
            min_prefill_tokens=min_prefill_tokens, min_prefill_rows=min_prefill_rows, mesh=mesh, split_slots=decode_context_parallel,
            max_logprobs=max_logprobs, speculative_tokens=speculative_tokens, draft=draft,
            replay_dtype=self.replay_dtype, logprobs_mode=logprobs_mode, stop_tokens=self.stop_tokens),
            self.grammars)
        self._weights_asleep = False  # sleep let go of the weights (runner.model's params: their skeleton)
        # sleep level 1's copies of the weight sets, and what it let go that others may still hold
        self._host_weights: tuple[Model, Model, dict] | None = None
        # The prefix cache's host tier (mixserve/host_cache.py): evicted pages wait in host
        # memory, up to host_kv_bytes, for a prefix to bring them back; 0: none.
        if host_kv_bytes:
            self.page_manager.host = HostKVCache(host_kv_bytes, self.runner.read_pages, self.runner.write_pages)

    # ---- public ---------------------------------------------------------------------------------
    @property
    def capacity_tokens(self) -> int:
        return self.num_pages * self.page_size

    @property
    def free_pages(self) -> int:
        """Pages a request can get: free, or held only by the prefix cache (evicted on demand)."""
        return self.page_manager.available

    @property
    def pages_in_use(self) -> int:
        """Pages running requests hold (a shared one once)."""
        return self.num_pages - self.free_pages

    @property
    def cached_pages(self) -> int:
        """Pages only the prefix cache holds: counted free, kept until an allocation evicts them."""
        return self.page_manager.evictable

    @property
    def host_cache(self) -> HostKVCache | None:
        """The prefix cache's host tier (host_kv_bytes), or None."""
        return self.page_manager.host

    def reset_prefix_cache(self) -> int:
        """Evict every cached page no running request maps (vLLM's reset_prefix_cache, e.g.
        between benchmark runs), and empty the host tier; returns how many pages that freed."""
        return self.page_manager.reset_prefix_cache()

    def update_weights(self, model: Model, decode_model: Model | None = None, running: str = "recompute",
                       version: str | None = None) -> int:
        """Serve new weights of the same model in the same formats (an RL trainer's latest policy,
        a fine-tune's checkpoint), between two steps; nothing compiles again (model.placed_like).
        An engine of two weight sets (decode_model at construction) takes both. KV computed with
        the old weights is never read with the new: the prefix cache and its host tier are
        emptied, and each request that ran on the old weights is, by `running`,
          "recompute": preempted if running, and recomputed from its prompt and output so far when
                       (re)admitted (it keeps those tokens: they came from the old weights);
          "abort":     finished "aborted" with the reason (running, or preempted and waiting),
                       its pages freed.
        Requests not yet admitted run on the new weights alone. Where the pools hold the served
        checkpoint's calibrated FP8 KV scales, the new weights' own replace them (they must ship
        some); other scales stay. The tokenizer and chat template stay. Arrays already placed as
        the served ones are served as they are, not copied: a trainer that donates or deletes
        them afterwards deletes the served weights. version: the new weights' name
        (weight_version; None: it stays), in the Result.weight_versions of every request that
        gets tokens from them. Returns how many requests it recomputes or aborts. All or nothing:
        a ValueError changes nothing."""
        check_running(running)
        self._swap_in(self.weights_like(model, decode_model))
        restarted = self._restart(running)
        self._weights_changed(version)
        return restarted

    def weights_like(self, model: Model, decode_model: Model | None = None) -> tuple[Model, Model, tuple | None]:
        """What update_weights swaps in, checked and placed as the served weights are: the prefill
        and decode weight sets, and the pools' new FP8 KV scales, one per cache layer (None: they
        stay)."""
        two_sets = self.runner.decode_model is not self.runner.model
        if two_sets != (decode_model is not None):
            raise ValueError("this engine serves two weight sets: give decode_model too" if two_sets else
                             "this engine serves one weight set for prefill and decode: give no decode_model")
        if self.mesh is not None:  # split (quantized scales re-blocked to the shares) as at construction
            expert_parallel = self.runner.model.expert_parallel
            model = sharding.shard_model(model, self.mesh, expert_parallel)
            decode_model = decode_model and sharding.shard_model(decode_model, self.mesh, expert_parallel)
        new = placed_like(self.runner.model, model)
        decode = new if decode_model is None else placed_like(self.runner.decode_model, decode_model, "decode_model")
        scales = None
        if self.kv_scales_from_checkpoint:
            if model.kv_scales is None:
                raise ValueError("the pools hold the served checkpoint's calibrated FP8 KV scales, and the new "
                                 "weights ship none")
            scales = self._layer_scales(model.kv_scales)
        return new, decode, scales

    def _layer_scales(self, kv_scales) -> tuple:
        """A checkpoint's (k, v) scales, one per cache layer, as the pools take them."""
        return tuple(layer_scales(x[:, None], name, self.cfg, self.mtp_drafts)
                     for x, name in zip(kv_scales, ("k_scale", "v_scale")))

    def _swap_in(self, weights: tuple[Model, Model, tuple | None]) -> None:
        self.runner.model, self.runner.decode_model, scales = weights
        self._weights_asleep, self._host_weights = False, None  # weights asleep are awake now: the new ones
        if scales is not None:  # the config keeps them unplaced (a disaggregated pair's hand-over reads them)
            self.runner.cfg = dataclasses.replace(self.runner.cfg, k_scale=scales[0], v_scale=scales[1])
            self.runner.scales = self.runner.placed_scales(*scales)

    def _restart(self, running: str) -> int:
        """KV and tokens of the old weights: recompute or abort the requests that hold them, and
        forget the cache."""
        if running == "abort":
            reqs = self.scheduler.abort_admitted("the weights were updated")
        else:
            reqs = self.scheduler.preempt_all()
        self.page_manager.forget_cache()  # after preempt_all, whose releases cache the pages once more
        return len(reqs)

    @property
    def asleep(self) -> frozenset[str]:
        """What sleep freed and neither wake_up nor update_weights has taken back (SLEEP_TAGS)."""
        freed = (self._weights_asleep, self.runner.pools is None)
        return frozenset(tag for tag, asleep in zip(SLEEP_TAGS, freed) if asleep)

    @property
    def sleeping(self) -> bool:
        return bool(self.asleep)

    @property
    def sleep_state(self) -> str:
        """One of SLEEP_STATES: vLLM's engine_sleep_state, and the pools freed alone."""
        if "weights" in self.asleep:
            return "discard_all" if self._host_weights is None else "weights_offloaded"
        return "kv_cache_freed" if self.sleeping else "awake"

    @property
    def weights_discarded(self) -> bool:
        """Asleep at level 2: no weights to wake until update_weights brings some."""
        return "weights" in self.asleep and self._host_weights is None

    def sleep(self, level: int = 1, tags=SLEEP_TAGS) -> int:
        """Free device memory between rollouts for a trainer that shares the devices (vLLM's
        sleep; SGLang's release_memory_occupation). tags: what to free,
          "kv_cache": the KV pools; the prefix cache's pages go to its host tier if it has one,
                      else they are dropped;
          "weights":  every weight set (the MTP layer's too), by level: 1, copied to host memory
                      (wake_up puts them back); 2, discarded (update_weights brings new ones).
        The engine lets go of them: arrays someone else still holds (the model given to the
        engine, whose arrays it serves as they are, while the caller keeps it; a trainer's
        parameters taken by update_weights) stay theirs, and their memory is freed when they
        let go too. Asleep, submitted requests wait for wake_up, and update_weights places new
        weights, waking those. Refused (EngineBusy) while requests run. Sleeping deeper is
        allowed (level 2 after 1 drops the host copy). Returns the device bytes freed, each
        buffer once and each device's replica counted. A failure (host memory) changes nothing."""
        tags = check_sleep(level, tags)
        if self.scheduler.has_work() and not self.sleeping:  # asleep, submitted requests only wait
            raise EngineBusy(f"{len(self.scheduler.running) + len(self.scheduler.waiting)} requests are "
                             "unfinished: sleep between them (or cancel them)")
        dropped = self._prepare_sleep(level, tags, {})()
        return let_go(dropped)

    def _prepare_sleep(self, level: int, tags: frozenset[str], made: dict) -> Callable[[], list[jax.Array]]:
        """sleep's part that may fail (the weights' host copies, then the cached pages to the host
        tier), changing nothing but the prefix cache; returns the rest, which cannot fail: it puts
        the engine to sleep and returns the arrays to let go. made: the host copies, as
        model.copied's (a pair's two sides may serve one buffer: it is copied once)."""
        weights = "weights" in tags - self.asleep
        slept_weights = None
        if weights and level == 1:
            model, decode = self.runner.model, self.runner.decode_model
            host = on_host(model, made)
            host_decode = host if decode is model else on_host(decode, made)
            # what wake_up takes back as it is, if someone still holds it: the served array, or another of its value
            served = jax.tree.leaves([model.params, decode.params])
            others = holders(served)
            held = {id(h): (weakref.ref(x), *others[id(x)])
                    for h, x in zip(jax.tree.leaves([host.params, host_decode.params]), served)}
            slept_weights = (host, host_decode, held)
        pools = "kv_cache" in tags - self.asleep
        if pools:
            self.page_manager.evict_all()

        def asleep() -> list[jax.Array]:
            dropped = []
            if pools:
                dropped += jax.tree.leaves(self.runner.pools)
                self.runner.pools = None
            if weights:
                model, decode = self.runner.model, self.runner.decode_model
                dropped += jax.tree.leaves([model.params, decode.params])
                self._host_weights = slept_weights
                self.runner.model = skeleton(model)
                self.runner.decode_model = self.runner.model if decode is model else skeleton(decode)
                self._weights_asleep = True
            elif "weights" in tags and level == 2:
                self._host_weights = None
            return dropped
        return asleep

    def wake_up(self, tags=SLEEP_TAGS) -> None:
        """Take back what sleep freed, of tags: the weights from their host copy, and the KV
        pools, allocated again (zeroed: nothing is read before it is written). Waiting requests
        go on at the next step once nothing is asleep. Weights discarded at level 2 are refused
        (WeightsDiscarded), and nothing is woken: update_weights brings new ones first (vLLM
        wakes empty weight buffers for a reload to fill; JAX arrays are replaced, not filled)."""
        tags = check_sleep(1, tags)
        if "weights" in tags and self.weights_discarded:
            raise WeightsDiscarded()
        self._wake(tags, {})

    def _wake(self, tags: frozenset[str], made: dict) -> None:
        if "weights" in tags & self.asleep:
            host, host_decode, held = self._host_weights

            def source(m: Model) -> Model:  # what someone held through the sleep as it is (no second copy), else the host's
                return dataclasses.replace(m, params=jax.tree.map(
                    lambda h: next((x for ref in held[id(h)] if (x := ref()) is not None and not x.is_deleted()), h),
                    m.params))

            model = placed_like(self.runner.model, source(host), made=made)
            decode = model if host_decode is host else placed_like(self.runner.decode_model, source(host_decode),
                                                                   "decode_model", made)
            self._swap_in((model, decode, None))
        if "kv_cache" in tags & self.asleep:
            self.runner.pools = self.runner.new_pools()

    @property
    def table(self) -> pt.PageTable:
        return self.page_manager.table

    def step(self) -> list[Update]:
        if self.prefill_only:  # its requests would never get past their first token
            raise RuntimeError("a prefill_only engine never decodes: serve through DisaggregatedEngine(it, decode_engine)")
        return super().step()

    def _reject_reason(self, req: Request) -> str | None:
        return reject_reason(req, vocab_size=self.cfg.vocab_size, max_seq_len=self.max_seq_len,
                             page_size=self.page_size, num_pages=self.num_pages, max_logprobs=self.max_logprobs,
                             has_tokenizer=self.tokenizer is not None, prompt_only=self.prefill_only,
                             schedule_policy=self.scheduler.policy)

    def _enqueue(self, req: Request) -> None:
        self.scheduler.waiting.append(req)

    def _drop(self, req: Request) -> None:
        self.scheduler.drop(req)

    def _advance(self) -> None:
        """Admit what fits and run up to prefill_calls_per_step prefill calls, one decode step over
        the requests whose prefill is done (none with prefill_only), retire the finished."""
        if self.scheduler.has_work() and not self.sleeping:
            self._prefill()
            if self.scheduler.running and not self.prefill_only:
                self.scheduler.make_room_for_decode()
                self._decode(self.scheduler.live())
            self.scheduler.retire_finished()

    def lowered_decode_text(self) -> str:
        """The decode step's lowered HLO text (to show that integrity='off' traces no check)."""
        if self.sleeping:
            raise RuntimeError("the engine is asleep: wake_up() first")
        return self.runner.lowered_decode_text(self.page_manager.table)

    def integrity_failures(self, reqs: list[Request]) -> list[str | None]:
        """The integrity check of reqs' page mappings, run on its own: for each, None if it
        passes, else which page failed and how."""
        active = jnp.zeros(self.max_batch, bool).at[jnp.asarray([r.slot for r in reqs])].set(True)
        report = _verify_jit(self.page_manager.table, active)
        ok = np.asarray(report.ok_B)
        return [None if ok[r.slot] else pt.describe(report, r.slot) for r in reqs]

    def abort(self, req: Request, reason: str) -> None:
        req.finish("aborted", reason)
        self.counters.aborts += 1

    # ---- one step's parts ------------------------------------------------------------------------
    def _prefill(self) -> None:
        """Prefill calls over the prefilling requests plus those admitted now, within the budget."""
        budget = self.prefill_calls_per_step
        while budget is None or budget > 0:
            prefilling = self.scheduler.prefilling()
            batch = prefilling + self.scheduler.admit(self.max_prefill_rows - len(prefilling))
            if not batch:
                return
            t0 = time.perf_counter()
            cached = [r.cached for r in batch]
            row = {id(r): i for i, r in enumerate(batch)}
            out = self.runner.prefill(batch, self.page_manager.table, budget)
            now = time.perf_counter()
            self.counters.prefill_chunks += out.calls
            self.counters.prefill_s += now - t0
            budget = None if budget is None else budget - out.calls
            for req, token, logprobs in self._passed(batch, out):
                if token is not None:
                    req.prefilled = True
                    req.drafts = out.drafts[row[id(req)]] if out.drafts else []
                    self.page_manager.register_prefix(req)  # later admissions can share its full prompt pages
                    req.accept(token, now, self.stop_tokens, logprobs, self.tokenizer)
                    self._host_drafts(req)
            self.counters.prefill_tokens += sum(r.cached - c for r, c, ok in zip(batch, cached, out.ok) if ok)
            for error in out.errors:  # strict: raised once the failing requests are aborted
                error.throw()

    def _decode(self, live: list[Request]) -> None:
        if not live:
            return
        t0 = time.perf_counter()
        if self.fault_hook is not None:
            self.page_manager.table = self.fault_hook(self.page_manager.table, self.counters.steps)
        if self.speculative_tokens:
            # an output that may still open its free part takes no drafts: its mask is its first token's
            n_drafts = [self.scheduler.room_for_drafts(r, min(len(r.drafts) if r.opener() is None else 0,
                                                              self.speculative_tokens,
                                                              r.max_new_tokens - len(r.out) - 1,
                                                              self.max_seq_len - len(r.tokens))) for r in live]
            out = self.runner.speculate(live, self.page_manager.table, n_drafts)
        else:
            out = self.runner.decode(live, self.page_manager.table)
        now = time.perf_counter()
        self.counters.steps += 1
        self.counters.decode_s += now - t0
        self.counters.decode_step_s.append(now - t0)
        passed = {id(r) for r, _, _ in self._passed(live, out)}
        for i, r in enumerate(live):
            if id(r) not in passed:
                continue
            tokens = [int(out.tokens[i])] if out.emitted is None else out.emitted[i]
            logprobs = [out.logprobs[i]] if out.emitted is None else out.emitted_logprobs[i] or [None] * len(tokens)
            r.cached = len(r.tokens) + len(tokens) - 1  # the fed token and the kept drafts
            before = len(r.out)
            for token, token_logprobs in zip(tokens, logprobs):
                self.counters.decode_tokens += 1
                r.accept(token, now, self.stop_tokens, token_logprobs, self.tokenizer)
                if r.result is not None:
                    break
            if self.speculative_tokens:  # accepted: the drafts kept and emitted (none past a stop)
                self.counters.drafted_tokens += n_drafts[i]
                self.counters.verified_rows += 1
                self.counters.accepted_tokens += min(len(r.out) - before, len(tokens) - 1)
                r.drafts = out.drafts[i] if out.drafts is not None else []
                self._host_drafts(r)
        for error in out.errors:  # strict: raised once the failing requests are aborted
            error.throw()

    def _host_drafts(self, req: Request) -> None:
        """The drafts the host finds: the tokens a structured output forces next (SGLang's
        jump-forward, verified as any draft: kept where the masked sample agrees), else n-grams."""
        if not self.speculative_tokens or req.result is not None:
            return
        if forced := req.forced_tokens():
            req.drafts = forced[:self.speculative_tokens]
        elif self.draft == "ngram":
            req.drafts = speculative.ngram_drafts(req.tokens, self.speculative_tokens)

    def _passed(self, reqs: list[Request], out) -> list[tuple[Request, int | None, TokenLogprobs | None]]:
        """Abort the requests whose rows failed the call's integrity check, with the reason; the
        others, with their tokens and logprobs."""
        passed, why = [], None
        for i, (req, row_ok, token, logprobs) in enumerate(zip(reqs, out.ok, out.tokens, out.logprobs)):
            if row_ok:
                passed.append((req, token, logprobs))
                continue
            why = why or self.integrity_failures(reqs)  # the call's check said which rows; this says why
            self.abort(req, "KV integrity check failed: " + why[i])
        return passed


class EngineBusy(RuntimeError):
    """Engine.sleep refused: requests are unfinished."""


class WeightsDiscarded(RuntimeError):
    """Engine.wake_up refused: sleep level 2 discarded the weights, and no update_weights since."""

    def __init__(self):
        super().__init__("the weights were discarded (sleep level 2): update_weights first, then wake_up")


def check_sleep(level: int, tags) -> frozenset[str]:
    tags = frozenset([tags] if isinstance(tags, str) else tags)
    if level not in (1, 2):
        raise ValueError(f"level must be 1 (weights to host memory) or 2 (weights discarded), got {level!r}")
    if not tags or not tags <= set(SLEEP_TAGS):
        raise ValueError(f"tags must be some of {SLEEP_TAGS}, got {sorted(tags)}")
    return tags


def check_running(running: str) -> None:
    if running not in RESTARTS:
        raise ValueError(f"running must be one of {RESTARTS}, got {running!r}")


def _check_context_parallel(cfg, mesh, page_size: int, attention_backend: str) -> None:
    """Decode context parallelism splits each page's slots of the MLA latent over the mesh."""
    tp = sharding.tp_size(mesh)
    if tp < 2:
        raise ValueError("decode_context_parallel splits the MLA latent pool over a mesh: give one with a 'model' "
                         "axis of 2 or more devices (mixserve.sharding.tp_mesh(n))")
    if cfg.attention_kind != "mla":
        raise ValueError("decode_context_parallel splits MLA latent pools; GQA pools already split by KV head")
    if page_size % tp:
        raise ValueError(f"decode_context_parallel gives each of {tp} devices page_size / {tp} slots of every page: "
                         f"page_size {page_size} does not divide")
    share = page_size // tp
    if attention_backend != "xla" and share & (share - 1):
        raise ValueError(f"the Pallas kernels need a power-of-two page share: page_size {page_size} / {tp} = {share}")


def _check_speculative(speculative_tokens: int, draft: str, model: Model, decode_model: Model | None) -> None:
    if not isinstance(speculative_tokens, int) or isinstance(speculative_tokens, bool) or speculative_tokens < 0:
        raise ValueError(f"speculative_tokens must be a non-negative integer, got {speculative_tokens!r}")
    if draft not in DRAFTS:
        raise ValueError(f"draft must be one of {DRAFTS}, got {draft!r}")
    if not speculative_tokens or draft == "ngram":
        return
    for name, m in (("model", model), ("decode_model", decode_model)):
        if m is not None and not m.has_mtp:
            raise ValueError(f"speculative_tokens needs the checkpoint's MTP layer, which {name} does not hold "
                             f"(num_nextn_predict_layers={m.config.num_mtp_layers}; load(..., mtp=True) to require it); "
                             "draft='ngram' needs none")
