"""Which requests run and which pages they hold (nano-vllm's Scheduler and BlockManager).

`PageManager` drives the functional page table (mixserve/page_table.py) from the host: it
allocates, shares and releases pages through jitted table updates, mirrors the free count, and
indexes full prompt pages by a chained hash so that an identical prefix reuses them (ref counts).
`Scheduler` admits waiting requests while a batch slot and their pages are free, to prefill beside
those still prefilling (a request that would share a prefix page still being prefilled waits
until that prefill is done), and before each decode step makes room for every running request's
next token, preempting the youngest when the pool is full: the victim (mid-prefill or decoding)
is requeued and recomputed from its prompt plus what it generated, so nothing is dropped. Pages a
request holds past its tokens (taken for speculative drafts, then rejected) go back first.
"""

from __future__ import annotations

import collections
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from mixserve import page_table as pt
from mixserve.request import Request

_allocate_jit = jax.jit(pt.allocate)
_share_jit = jax.jit(pt.share)
_truncate_jit = jax.jit(pt.truncate)


@dataclasses.dataclass
class Counters:
    steps: int = 0
    prefill_chunks: int = 0  # prefill calls (each runs one chunk of every request in its batch)
    preemptions: int = 0
    aborts: int = 0
    rejections: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    peak_pages_in_use: int = 0
    shared_pages: int = 0  # pages a request got from another's identical prompt prefix
    drafted_tokens: int = 0  # speculative: draft tokens verified
    accepted_tokens: int = 0  # speculative: of those, kept (each request's step emits these plus one)
    verified_rows: int = 0  # speculative: requests' decode steps (tokens per step = 1 + accepted / this)
    decode_step_s: list[float] = dataclasses.field(default_factory=list)


class PageManager:
    def __init__(self, num_pages: int, page_size: int, max_batch: int, max_pages_per_seq: int,
                 prefix_sharing: bool, counters: Counters, lookahead: int = 0):
        self.num_pages, self.page_size, self.max_pages_per_seq = num_pages, page_size, max_pages_per_seq
        # Tokens past a page its KV depends on: 1 when the MTP layer's cache is in the pages (its
        # entry at position p holds token p + 1), so a page is shared only where that token agrees.
        self.lookahead = lookahead
        self.table = pt.init_page_table(num_pages, max_batch, max_pages_per_seq)
        self.free_pages = num_pages
        self.prefix_sharing = prefix_sharing
        self.counters = counters
        self._prefix_pages: dict[int, int] = {}  # chained page hash -> live physical page

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def allocate(self, req: Request, n: int) -> bool:
        """Append n fresh pages to req's slot. False, with nothing allocated, when the page table
        refuses: the host mirror disagreed with it (after a bookkeeping fault, e.g. a page handed to
        req behind its back), and is resynced from the table, the authority."""
        self.table, ok = _allocate_jit(self.table, jnp.int32(req.slot), jnp.int32(n))
        if not bool(ok):
            self.free_pages = int(pt.num_free(self.table))
            req.num_pages = int(self.table.num_pages_B[req.slot])
            return False
        req.num_pages += n
        self.free_pages -= n
        self.counters.peak_pages_in_use = max(self.counters.peak_pages_in_use, self.num_pages - self.free_pages)
        return True

    def take(self, req: Request, slot: int, shared: list[int], n: int) -> bool:
        """Give req the free `slot`, mapping the live pages `shared` (an identical prefix) as its
        first pages, then n fresh ones. All or nothing: False, with req as it was and the slot
        emptied, when the table refuses (a fault freed a page the prefix index still names, or the
        host mirror is off: both are resynced), so the caller can try again later."""
        before, shared_ok = (req.slot, req.num_pages, req.cached), True
        req.slot, req.num_pages = slot, 0
        if shared:
            ids = np.zeros(self.max_pages_per_seq, np.int32)
            ids[: len(shared)] = shared
            self.table, ok = _share_jit(self.table, jnp.int32(slot), jnp.asarray(ids), jnp.int32(len(shared)))
            shared_ok = bool(ok)
            req.num_pages, req.cached = len(shared), len(shared) * self.page_size
        if not shared_ok or not self.allocate(req, n):
            self.release_slot(slot)  # also prunes the prefix index of pages no longer live
            req.slot, req.num_pages, req.cached = before
            return False
        self.counters.shared_pages += len(shared)
        return True

    def release(self, req: Request) -> None:
        self.release_slot(req.slot)
        req.slot, req.num_pages, req.cached, req.prefilled, req.drafts = None, 0, 0, False, []

    def release_slot(self, slot: int) -> None:
        """Return a slot's pages (a page another request shares stays theirs)."""
        self._truncate_slot(slot, 0)

    def trim(self, req: Request) -> None:
        """Return req's pages past those its tokens need (speculative drafts' pages, kept after a
        rejection)."""
        keep = self.pages_for(len(req.tokens))
        if req.slot is not None and req.num_pages > keep:
            self._truncate_slot(req.slot, keep)
            req.num_pages = keep

    def _truncate_slot(self, slot: int, keep: int) -> None:
        self.table = _truncate_jit(self.table, jnp.int32(slot), jnp.int32(keep))
        self.free_pages = int(pt.num_free(self.table))  # the table is the authority (a fault may leak pages)
        refs = np.asarray(self.table.ref_count_P)
        self._prefix_pages = {h: p for h, p in self._prefix_pages.items() if refs[p] > 0}

    # ---- prefix sharing: full pages of identical token prefixes, as nano-vllm's BlockManager ----
    def _page_hashes(self, tokens: list[int]) -> list[int]:
        """One hash per full page of tokens[:-1] (the last token is fed by decode), chained so a
        page's hash covers the whole prefix before it (and the lookahead tokens after it)."""
        S, hashes, h = self.page_size, [], 0
        for i in range((len(tokens) - 1) // S):  # token (i + 1) * S, the lookahead's, is at most the last
            h = hash((h, tuple(tokens[i * S : (i + 1) * S + self.lookahead])))
            hashes.append(h)
        return hashes

    def unindexed_prefix(self, req: Request) -> set[int]:
        """Hashes of req's full prompt pages that no live page holds yet (what its prefill will index)."""
        return {h for h in self._page_hashes(req.tokens) if h not in self._prefix_pages} if self.prefix_sharing else set()

    def shared_prefix(self, req: Request) -> list[int]:
        pages = []
        for h in self._page_hashes(req.tokens) if self.prefix_sharing else []:
            if h not in self._prefix_pages:
                break
            pages.append(self._prefix_pages[h])
        return pages

    def register_prefix(self, req: Request) -> None:
        """After prefill: index req's full prompt pages for later requests to share."""
        if not self.prefix_sharing:
            return
        row = np.asarray(self.table.pages_BN[req.slot])
        for i, h in enumerate(self._page_hashes(req.tokens)):
            self._prefix_pages.setdefault(h, int(row[i]))


class Scheduler:
    def __init__(self, page_manager: PageManager, max_batch: int, counters: Counters):
        self.page_manager, self.max_batch, self.counters = page_manager, max_batch, counters
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def admit(self, max_rows: int) -> list[Request]:
        """Give waiting requests, in order, a slot and pages (sharing cached full prompt pages): at
        most max_rows of them, to prefill beside those still prefilling. A request with a full prompt
        page that a prefilling one will index waits, so that it is admitted after that prefill and
        shares the page (unless it wants prompt logprobs, which only computing the prompt gives)."""
        free_slots = self._free_slots()
        batch = []
        indexing = set().union(*(self.page_manager.unindexed_prefix(r) for r in self.prefilling()))
        while self.waiting and free_slots and len(batch) < max_rows:
            req = self.waiting[0]
            new_pages = self.page_manager.unindexed_prefix(req)
            # Prompt logprobs come from computing the prompt: such a request shares no cached page.
            computes_all = req.wants_prompt_logprobs
            if new_pages & indexing and not computes_all:
                break
            shared = [] if computes_all else self.page_manager.shared_prefix(req)
            need = self.page_manager.pages_for(len(req.tokens)) - len(shared)
            if self._short_of(need):
                if why := self._never_fits(need):
                    self.waiting.popleft().finish("aborted", why)
                    self.counters.aborts += 1
                    continue
                break
            if not self.page_manager.take(req, free_slots.pop(0), shared, need):
                break  # the bookkeeping was resynced: the next step tries again
            self.waiting.popleft()
            self.running.append(req)
            batch.append(req)
            indexing |= new_pages
        return batch

    def adopt(self, req: Request) -> int | None:
        """Take a request prefilled elsewhere (disaggregated serving): a slot, and pages for its
        req.cached tokens, sharing its indexed prompt prefix. Returns how many of its pages were
        shared (the rest await their KV), or None, changing nothing, when there is no room or a
        request this scheduler preempted is waiting (it goes first)."""
        free_slots = self._free_slots()
        if self.waiting or not free_slots:
            return None
        cached, (shared, need) = req.cached, self._adoption(req)
        if self._short_of(need):
            return None
        if not self.page_manager.take(req, free_slots[0], shared, need):
            return None
        req.cached, req.prefilled = cached, True
        self.running.append(req)
        return len(shared)

    def never_adopted(self, req: Request) -> str | None:
        """Why adopt will never take req (None: it may, later): nothing here runs or waits, so
        nothing will free the pages it lacks."""
        return None if self.waiting else self._never_fits(self._adoption(req)[1])

    def _adoption(self, req: Request) -> tuple[list[int], int]:
        """The pages adopting req would share (its indexed prompt prefix) and how many more it needs."""
        shared = self.page_manager.shared_prefix(req)
        return shared, self.page_manager.pages_for(req.cached) - len(shared)

    def _never_fits(self, need: int) -> str | None:
        """An abort reason when `need` pages exceed the free ones and no running request will free
        any: only pages leaked after a detected bookkeeping fault can cause that."""
        if need <= self.page_manager.free_pages or self.running:
            return None
        return (f"KV pool exhausted: {self.page_manager.free_pages} free pages, {need} needed (pages leaked after a "
                "detected bookkeeping fault)")

    def _free_slots(self) -> list[int]:
        return sorted(set(range(self.max_batch)) - {r.slot for r in self.running})

    def make_room_for_decode(self) -> None:
        """Each running request needs a page for the token it decodes next; preempt the youngest if not."""
        for req in sorted(self.running, key=lambda r: r.rid):
            if req.result is not None or req.slot is None:
                continue
            while self.page_manager.pages_for(len(req.tokens)) > req.num_pages:
                if not self._short_of(1):
                    self.page_manager.allocate(req, 1)  # if refused, the resynced counts decide again
                    continue
                victim = max((r for r in self.running if r.slot is not None and r.result is None), key=lambda r: r.rid)
                self.page_manager.release(victim)
                self.running.remove(victim)
                self.waiting.appendleft(victim)  # recomputed from prompt + generated tokens when readmitted
                self.counters.preemptions += 1
                if victim is req:
                    break

    def _short_of(self, need: int) -> bool:
        """Whether fewer than `need` pages are free, once the pages running requests hold past
        their tokens (drafts' pages, kept after a rejection) are taken back: nobody waits or is
        preempted for pages that only hold rejected drafts."""
        if need > self.page_manager.free_pages:
            for r in self.running:
                if r.result is None:
                    self.page_manager.trim(r)
        return need > self.page_manager.free_pages

    def room_for_drafts(self, req: Request, drafts: int) -> int:
        """Pages for up to `drafts` tokens past req's next one, from free pages only (a draft never
        preempts anyone): how many of them fit."""
        while self.page_manager.pages_for(len(req.tokens) + drafts) > req.num_pages and self.page_manager.free_pages > 0:
            if not self.page_manager.allocate(req, 1):
                break
        return max(0, min(drafts, req.num_pages * self.page_manager.page_size - len(req.tokens)))

    def prefilling(self) -> list[Request]:
        """Admitted requests whose prefill has not finished (it may take several steps)."""
        return [r for r in self.running if r.result is None and r.slot is not None and not r.prefilled]

    def live(self) -> list[Request]:
        """The requests the next decode step runs."""
        return [r for r in self.running if r.result is None and r.slot is not None and r.prefilled]

    def drop(self, req: Request) -> None:
        """Forget req, finished between steps (cancelled): out of the queue, or its pages freed."""
        self.waiting = collections.deque(r for r in self.waiting if r is not req)
        if any(r is req for r in self.running):
            self.retire_finished()

    def retire_finished(self) -> None:
        for req in [r for r in self.running if r.result is not None]:
            self.page_manager.release(req)
            self.running.remove(req)
