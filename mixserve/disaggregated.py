"""Disaggregated serving: a prefill engine and a decode engine, with KV pages handed between them.

The seed's measurements come from disaggregated H200 deployments (separate prefill and decode
servers), and its hybrid split lives there: prefill runs FP8 weights over a BF16 KV pool (it is
compute-bound), decode runs INT4 weights over an FP8 KV pool (it is memory-bound). Here each side
is an `Engine` with its own weights, pool, page table and integrity tags, and optionally its own
devices (a mesh each); one request's path:

  1. `submit` checks it against both engines' limits and queues it on the prefill engine, which is
     built with prefill_only=True: it admits, prefills (chunked, batched) and samples the first
     token as any engine does, then keeps the request's pages instead of decoding.
  2. Each step, `_hand_over` checks the prefilled requests' page mappings on the prefill side
     (the seed's check just before pages are read: a request that fails is aborted with the
     reason, not sent), then moves them, oldest first, while the decode engine has a slot and
     pages (`Scheduler.adopt`, which also shares a prompt prefix the decode pool already holds,
     so those pages are not sent). Their pages are gathered and converted to the
     decode pool's format on the prefill side (mixserve/kv_transfer.py), moved to the decode
     engine's devices, and written into the pages adopt allocated, which carry fresh integrity
     tags. The prefill engine then frees its copy. A request the decode engine cannot take yet
     waits on the prefill side, holding its pages: when decode is full, prefill admission stops
     too (back-pressure), and nothing is dropped.
  3. The decode engine decodes it with the others, checking the tags every step. If it must
     preempt the request, it recomputes it itself, like any preempted request.

Both engines run in this one Python loop, so they take turns: what this shows is the formats, the
hand-over and its bytes, not two servers overlapping in time.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import numpy as np

from mixserve import kv_transfer
from mixserve.device_memory import let_go
from mixserve.engine import SLEEP_TAGS, Engine, EngineBusy, WeightsDiscarded, check_running, check_sleep
from mixserve.model import Model
from mixserve.frontend import Frontend
from mixserve.request import Request
from mixserve.scheduler import priority_order


@dataclasses.dataclass
class HandoverCounters:
    rejections: int = 0
    handovers: int = 0  # requests moved from the prefill engine to the decode engine
    pages_sent: int = 0
    bytes_sent: int = 0  # in the decode pool's format, padding not counted
    pages_shared: int = 0  # prompt pages the decode pool already held: not sent
    handover_s: float = 0.0


class DisaggregatedEngine(Frontend):
    def __init__(self, prefill: Engine, decode: Engine):
        if not prefill.prefill_only or decode.prefill_only:
            raise ValueError("build the prefill engine with prefill_only=True and the decode engine without it")
        if prefill.cfg != decode.cfg:
            raise ValueError("prefill and decode must serve the same model (same config); weight formats may differ")
        if set(prefill.stop_tokens) != set(decode.stop_tokens):  # the first token is judged by the prefill engine's
            raise ValueError(f"prefill and decode must stop on the same tokens, got {prefill.stop_tokens} and "
                             f"{decode.stop_tokens}")
        if prefill.page_size != decode.page_size:
            raise ValueError(f"pages move whole: page sizes must match, got {prefill.page_size} and {decode.page_size}")
        if prefill.mtp_drafts != decode.mtp_drafts:
            # MTP drafts go on from the prompt's MTP cache and first drafts, which the prefill
            # engine computes and sends with the pages (one more pool layer on both sides).
            raise ValueError("MTP speculative decoding needs speculative_tokens with draft='mtp' on both engines or on "
                             f"neither, got {prefill.speculative_tokens} ({prefill.draft}) and "
                             f"{decode.speculative_tokens} ({decode.draft})")
        if prefill.replay_dtype != decode.replay_dtype:  # a request's rows go with it to the decode engine
            raise ValueError("return_routed_experts and return_indexer_topk must each be on both engines or on "
                             "neither")
        if prefill.logprobs_mode != decode.logprobs_mode:  # the first token's logprobs are the prefill engine's
            raise ValueError(f"logprobs_mode must be the same on both engines, got {prefill.logprobs_mode!r} and "
                             f"{decode.logprobs_mode!r}")
        if decode.host_cache is not None:  # adopt shares device-cached pages only
            raise ValueError("the decode engine takes prefilled requests and never reads a host KV tier: give "
                             "host_kv_bytes to the prefill engine")
        super().__init__()
        self.prefill, self.decode = prefill, decode
        self.replay_dtype = prefill.replay_dtype
        self.grammars = prefill.grammars  # a request's matcher goes with it to the decode engine
        decode.grammars.share_tokenizer(prefill.grammars)  # which prepare() reads for both
        self.counters = HandoverCounters()
        self._transfer_scales()
        self._dst_layout = kv_transfer.layout(decode.runner.pools)
        # Where the pages land: the decode pools' devices and sharding (GQA: split by KV head).
        self._dst_shardings = jax.tree.map(lambda pool: pool.sharding, decode.runner.pools)
        # Committed there from the start, as a step's output is: else the first import compiles twice.
        decode.runner.pools = jax.device_put(decode.runner.pools, self._dst_shardings)

    def _transfer_scales(self) -> None:
        """Each pool's FP8 KV scales (unplaced, per cache layer), which the hand-over converts pages by."""
        p_cfg, d_cfg = self.prefill.runner.cfg, self.decode.runner.cfg
        self._src_scales, self._dst_scales = (p_cfg.k_scale, p_cfg.v_scale), (d_cfg.k_scale, d_cfg.v_scale)
        self._convert = kv_transfer.needs_conversion(self.prefill.kv_format, self._src_scales, self.decode.kv_format,
                                                     self._dst_scales)

    def reset_prefix_cache(self) -> int:
        """Evict both pools' cached pages that no request maps; returns how many pages that freed."""
        return self.prefill.reset_prefix_cache() + self.decode.reset_prefix_cache()

    def update_weights(self, model: Model, decode_model: Model | None = None, running: str = "recompute",
                       version: str | None = None) -> int:
        """Engine.update_weights on both sides: the prefill engine takes model, the decode engine
        decode_model (None: model too); both checked before either changes."""
        check_running(running)
        prefill, decode = self.prefill.weights_like(model), self.decode.weights_like(decode_model or model)
        self.prefill._swap_in(prefill)
        self.decode._swap_in(decode)
        self._transfer_scales()  # a side's scales may have changed with its weights
        restarted = self.prefill._restart(running) + self.decode._restart(running)
        self._weights_changed(version)
        return restarted

    def _reject_reason(self, req: Request) -> str | None:
        for name, engine in (("prefill", self.prefill), ("decode", self.decode)):
            reason = engine._reject_reason(req)
            if reason:
                return f"{name} engine: {reason}"
        return None

    def _enqueue(self, req: Request) -> None:
        self.prefill._enqueue(req)

    def _drop(self, req: Request) -> None:
        self.prefill._drop(req)  # waiting, prefilling, or prefilled and waiting for the decode side
        self.decode._drop(req)

    @property
    def asleep(self) -> frozenset[str]:
        return self.prefill.asleep | self.decode.asleep  # half awake (a wake_up that failed): asleep

    @property
    def sleeping(self) -> bool:
        return bool(self.asleep)

    def sleep(self, level: int = 1, tags=SLEEP_TAGS) -> int:
        """Engine.sleep on both sides: both freed, or neither (refused while either works)."""
        tags = check_sleep(level, tags)
        busy = [name for name, e in (("prefill", self.prefill), ("decode", self.decode)) if e.scheduler.has_work()]
        if busy and not self.sleeping:
            raise EngineBusy(f"the {' and '.join(busy)} engine has unfinished requests: sleep between them")
        made = {}  # one host copy of a buffer both sides serve
        finish = [self.prefill._prepare_sleep(level, tags, made), self.decode._prepare_sleep(level, tags, made)]
        dropped = [x for asleep in finish for x in asleep()]  # neither side asleep unless both are
        return let_go(dropped)

    @property
    def weights_discarded(self) -> bool:
        return self.prefill.weights_discarded or self.decode.weights_discarded

    def wake_up(self, tags=SLEEP_TAGS) -> None:
        """Engine.wake_up on both sides; weights discarded on either are refused before either wakes."""
        tags = check_sleep(1, tags)
        if "weights" in tags and self.weights_discarded:
            raise WeightsDiscarded()
        made = {}  # an array both sides served, placed once
        self.prefill._wake(tags, made)
        self.decode._wake(tags, made)

    def _advance(self) -> None:
        if self.sleeping:
            return
        self.prefill._advance()  # prefill only: prefilled requests wait, holding their pages
        self._hand_over()
        self.prefill.scheduler.retire_finished()  # those it aborted free their pages now, not a step later
        self.decode._advance()

    def _checked(self, ready: list[Request]) -> list[Request]:
        """The seed's check before pages are read, on the prefill side (unless its integrity is
        "off"): a request whose mapping fails may point at another request's KV, so it is aborted
        with the reason, not handed over (strict: then raised; the next step goes on)."""
        p = self.prefill
        if p.integrity == "off" or not ready:
            return ready
        passed, failed = [], []
        for req, why in zip(ready, p.integrity_failures(ready)):
            if why is None:
                passed.append(req)
            else:
                failed.append(f"KV integrity check failed before hand-over: {why}")
                p.abort(req, failed[-1])
        if failed and p.integrity == "strict":
            raise RuntimeError("; ".join(failed))
        return passed

    def _hand_over(self) -> None:
        """Move every prefilled request the decode engine can take now, in one transfer."""
        p, d = self.prefill, self.decode
        t0 = time.perf_counter()
        ready = self._checked(p.scheduler.live())  # prefilled, not finished: oldest first
        if not ready:
            return  # most steps: no host round trip
        if d.scheduler.policy == "priority":
            ready.sort(key=priority_order)
        src_table, src_ids, moved = np.asarray(p.table.pages_BN), [], []
        for req in ready:
            src_slot, n = req.slot, req.num_pages
            shared = d.scheduler.adopt(req)  # req's slot and pages are the decode engine's from here
            if shared is None:
                if why := d.scheduler.never_adopted(req):
                    p.abort(req, f"decode engine: {why}")  # the prefill side then frees its pages
                    continue
                break  # no room on the decode side yet: it waits here, with its pages
            src_ids += src_table[src_slot, shared:n].tolist()
            p.scheduler.running.remove(req)
            moved.append((req, shared, src_slot))
        if not moved:
            return
        dst_table = np.asarray(d.table.pages_BN)
        dst_ids = [page for req, shared, _ in moved for page in dst_table[req.slot, shared : req.num_pages].tolist()]
        if src_ids:
            sent = kv_transfer.export_pages(p.runner.pools, kv_transfer.padded(src_ids, 0), self._src_scales,
                                            self._dst_scales, dst_layout=self._dst_layout, convert=self._convert)
            sent = jax.device_put(sent, self._dst_shardings)
            d.runner.pools = kv_transfer.import_pages(d.runner.pools, kv_transfer.padded(dst_ids, d.num_pages), sent)
            jax.block_until_ready(d.runner.pools)  # the next decode step waits for it anyway: time it here
        for req, shared, src_slot in moved:
            if not req.drafts:
                d._host_drafts(req)  # forced or n-gram drafts for its first decode step (MTP drafts came with it)
            p.page_manager.release_slot(src_slot)  # the prefill engine's copy is no longer needed
            d.page_manager.register_prefix(req)  # its prompt pages hold their KV now: later requests share them
            self.counters.pages_shared += shared
        self.counters.handovers += len(moved)
        self.counters.pages_sent += len(src_ids)
        self.counters.bytes_sent += len(src_ids) * d.bytes_per_token * d.page_size
        self.counters.handover_s += time.perf_counter() - t0
