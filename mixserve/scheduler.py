"""Which requests run and which pages they hold (nano-vllm's Scheduler and BlockManager).

`PageManager` drives the functional page table (mixserve/page_table.py) from the host: it
allocates, shares and releases pages through jitted table updates, mirrors the free count, and
keeps the prefix cache: full pages keyed by a chained hash of the tokens up to their end, held
past the requests that wrote them (prompt pages after prefill, output pages when a request
leaves) and evicted least recently used first when an allocation needs them, so that an identical
prefix, now or later (a shared system prompt, the next turn of a chat), reuses their KV.
`Scheduler` admits waiting requests while a batch slot and their pages are free, to prefill beside
those still prefilling (a request that would share a prefix page still being prefilled waits
until that prefill is done), and before each decode step makes room for every running request's
next token, preempting the youngest (under "priority": of the highest priority value) when the
pool is full: the victim (mid-prefill or decoding) is requeued and recomputed from its prompt
plus what it generated, so nothing is dropped. The prefix cache's host tier
(mixserve/host_cache.py) keeps what eviction drops, for an admission to copy back. Pages a
request holds past its tokens (taken for speculative drafts, then rejected) go back first.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import itertools
import time

import jax
import jax.numpy as jnp
import numpy as np

from mixserve import page_table as pt
from mixserve.host_cache import HostKVCache
from mixserve.request import Request

def _counted(update):
    """A table update (table, ...) -> (table, *outputs), jitted with the free and evictable counts
    after it appended to its outputs: the host's mirrors come back in the same transfer."""
    def run(table, *args):
        table, *outputs = update(table, *args)
        return (table, *outputs, pt.num_free(table), pt.evictable(table))
    return jax.jit(run)


_allocate_jit = jax.jit(pt.allocate)
_share_jit = _counted(pt.share)
_truncate_jit = _counted(lambda table, slot, n: (pt.truncate(table, slot, n),))
_uncache_jit = _counted(lambda table, ids_K, tag_K, n: (pt.uncache(table, ids_K, tag_K, n),))
_evict_jit = _counted(pt.evict)
# Host reads, one dispatch and one transfer each (eager indexing dispatches an op per index).
_counts_jit = jax.jit(lambda table: (pt.num_free(table), pt.evictable(table)))
_idle_jit = jax.jit(lambda table, ids_K, n: jnp.sum((table.ref_count_P[ids_K] == 1) & (jnp.arange(ids_K.shape[0]) < n)))


@jax.jit
def _cache_slot_jit(table: pt.PageTable, slot, want_N):
    """pt.cache of the slot's logical pages where want_N, under the tags the slot recorded; also
    returns the slot's pages and tags, so the host reads all it records in one transfer."""
    pages_N, tags_N = table.pages_BN[slot], table.expected_tag_BN[slot]
    first_N = jnp.argsort(~want_N, stable=True)  # the wanted ones first, in order
    table, ok = pt.cache(table, pages_N[first_N], tags_N[first_N], want_N.sum(dtype=jnp.int32))
    return table, ok, pages_N, tags_N


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
    shared_pages: int = 0  # pages a request got from the prefix cache (another's identical prefix)
    prefix_cache_queries: int = 0  # tokens of admitted requests' prompts, looked up in the prefix cache
    prefix_cache_hits: int = 0  # of those, tokens whose KV the device cache held (their prefill skipped)
    evicted_pages: int = 0  # cached pages freed for allocations
    host_restored_tokens: int = 0  # of those, tokens whose KV came back from the host tier instead (not prefilled)
    stale_cache_entries: int = 0  # cached pages a hit found freed or reallocated: refused, recomputed
    drafted_tokens: int = 0  # speculative: draft tokens verified
    accepted_tokens: int = 0  # speculative: of those, kept (each request's step emits these plus one)
    verified_rows: int = 0  # speculative: requests' decode steps (tokens per step = 1 + accepted / this)
    decode_step_s: list[float] = dataclasses.field(default_factory=list)


class PageManager:
    def __init__(self, num_pages: int, page_size: int, max_batch: int, max_pages_per_seq: int,
                 prefix_caching: bool, counters: Counters, lookahead: int = 0, replay_rows: bool = False):
        self.num_pages, self.page_size, self.max_pages_per_seq = num_pages, page_size, max_pages_per_seq
        # Tokens past a page its KV depends on: 1 when the MTP layer's cache is in the pages (its
        # entry at position p holds token p + 1), so a page is shared only where that token agrees.
        self.lookahead = lookahead
        self.table = pt.init_page_table(num_pages, max_batch, max_pages_per_seq)
        self.free_pages = num_pages  # host mirror of the free stack
        self.evictable = 0  # host mirror: cached pages no request maps (`pt.evictable`)
        self.prefix_caching = prefix_caching
        self.counters = counters
        # The prefix cache: page key -> (physical page, the tag it had when cached), least
        # recently used first. The cache holds a reference to each page (pt.cache), so the pages
        # outlive the requests that wrote them until an allocation evicts them.
        self._cache: collections.OrderedDict[bytes, tuple[int, int]] = collections.OrderedDict()
        # The host tier (mixserve/host_cache.py; the engine's, if it has one): evicted pages go
        # there, and a prefix found there comes back into fresh pages.
        self.host: HostKVCache | None = None
        # Routed experts / indexer top-k return: page key -> its tokens' rows (request.replay_dtype,
        # [S]), for every key the device cache holds (the host tier keeps its pages' own), so a
        # request sharing a cached prefix gets the rows of the forward that computed its KV (None:
        # not returned).
        self.replay_rows: dict[bytes, np.ndarray] | None = {} if replay_rows else None

    @property
    def available(self) -> int:
        """Pages an allocation can get: free ones, and cached ones it would evict."""
        return self.free_pages + self.evictable

    @property
    def cached(self) -> int:
        """Pages in the prefix cache (mapped by requests or not)."""
        return len(self._cache)

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def allocate(self, req: Request, n: int) -> bool:
        """Append n fresh pages to req's slot, evicting cached pages first if too few are free.
        False, with nothing allocated, when the page table refuses: the host mirror disagreed
        with it (after a bookkeeping fault, e.g. a page handed to req behind its back), and is
        resynced from the table, the authority."""
        if n > self.free_pages:
            self._evict(n - self.free_pages)
        self.table, ok = _allocate_jit(self.table, jnp.int32(req.slot), jnp.int32(n))
        if not bool(ok):
            self._sync()
            req.num_pages = int(self.table.num_pages_B[req.slot])
            return False
        req.num_pages += n
        self.free_pages -= n
        self.counters.peak_pages_in_use = max(self.counters.peak_pages_in_use, self.num_pages - self.available)
        return True

    def take(self, req: Request, slot: int, shared: list[tuple[int, int]], n: int, restored: int = 0) -> bool:
        """Give req the free `slot`, mapping the cached pages `shared` ((page, tag) pairs: an
        identical prefix) as its first pages, then n fresh ones, the first `restored` of them
        copied back from the host tier (host_prefix: its prefix past `shared`, cached on the device
        again). All or nothing: False, with req as
        it was and the slot emptied, when the table refuses (a cached page was freed or
        reallocated behind the cache's back: such entries leave the cache, and the request computes
        that prefix; or the host mirror is off: it is resynced), so the caller can try again later."""
        before, shared_ok = (req.slot, req.num_pages, req.cached), True
        req.slot, req.num_pages = slot, 0
        if shared:
            ids, tags = self._padded([p for p, _ in shared]), self._padded([t for _, t in shared], np.uint32)
            self.table, ok, *counts = _share_jit(self.table, jnp.int32(slot), ids, jnp.int32(len(shared)), tags)
            [ok] = self._mirror(counts, ok)  # the shared pages are no longer evictable
            shared_ok = bool(ok)
            req.num_pages, req.cached = len(shared), len(shared) * self.page_size
            if not shared_ok:
                self._forget_stale(shared)
        keys = self.page_keys(req)[len(shared):len(shared) + restored] if restored else []
        if restored:  # used now: the allocation's evictions fill the host, least recently used out first
            self.host.touch(keys)
        if not shared_ok or not self.allocate(req, n):
            self.release_slot(slot)
            req.slot, req.num_pages, req.cached = before
            return False
        self.counters.shared_pages += len(shared)
        restored = self.host.prefix(keys) if restored else 0  # a host smaller than the evictions dropped some
        if self.replay_rows is not None and shared:
            req.keep_replay_rows(0, np.concatenate([self.replay_rows[h] for h in self.page_keys(req)[:len(shared)]]))
        if restored:
            pages = np.asarray(self.table.pages_BN[slot, len(shared):len(shared) + restored]).tolist()
            rows = self.host.load(keys[:restored], pages)
            if self.replay_rows is not None:
                req.keep_replay_rows(len(shared) * self.page_size, np.concatenate(rows))
            req.cached = (len(shared) + restored) * self.page_size
            self.register_prefix(req)  # which marks its cached pages used, as below
        else:
            self._touch(req)  # a hit is a use
        if req.cache_hit_tokens is None:  # its first admission: what it asked the cache and got
            req.cache_hit_tokens = (len(shared) + restored) * self.page_size
            req.queue_s = time.perf_counter() - req.t_submit
            looked_up = self.prefix_caching and not req.wants_prompt_logprobs
            self.counters.prefix_cache_queries += len(req.tokens) if looked_up else 0
            self.counters.prefix_cache_hits += len(shared) * self.page_size
            self.counters.host_restored_tokens += restored * self.page_size
        return True

    def release(self, req: Request) -> None:
        """Return req's pages. Those whose KV it wrote in full stay in the prefix cache, unless it
        was aborted (its pages failed the integrity check, or are not trusted)."""
        if req.result is None or req.result.status == "ok":  # finished, or preempted (recomputed later)
            self.register_prefix(req)
        self.release_slot(req.slot)
        req.slot, req.num_pages, req.cached, req.prefilled, req.drafts = None, 0, 0, False, []
        req.replay_end = 0  # its replay rows are those of positions computed (or shared) once admitted again

    def release_slot(self, slot: int) -> None:
        """Return a slot's pages (a page another request shares, or the cache holds, stays theirs)."""
        self._truncate_slot(slot, 0)

    def trim(self, req: Request) -> None:
        """Return req's pages past those its tokens need (speculative drafts' pages, kept after a
        rejection)."""
        keep = self.pages_for(len(req.tokens))
        if req.slot is not None and req.num_pages > keep:
            self._truncate_slot(req.slot, keep)
            req.num_pages = keep

    def _truncate_slot(self, slot: int, keep: int) -> None:
        self.table, *counts = _truncate_jit(self.table, jnp.int32(slot), jnp.int32(keep))
        self._mirror(counts)

    def _sync(self) -> None:
        """Read the free and evictable counts from the table, the authority (a fault may leak pages)."""
        self._mirror(_counts_jit(self.table))

    def _mirror(self, counts, *outputs) -> list:
        """Set the host's free and evictable counts from a table update's (free, evictable), read
        in one transfer with the update's other outputs, which it returns on the host."""
        *outputs, free, evictable = jax.device_get((*outputs, *counts))
        self.free_pages, self.evictable = int(free), int(evictable)
        return outputs

    def _padded(self, values: list[int], dtype=np.int32) -> np.ndarray:
        """values as one array of the table's width N (one compiled shape for every call)."""
        out = np.zeros(self.max_pages_per_seq, dtype)
        out[: len(values)] = values
        return out

    # ---- the prefix cache: full pages of token prefixes, kept past their requests (vLLM's
    # automatic prefix caching, at page granularity) and shared by identical prefixes ----
    def page_keys(self, req: Request) -> list[bytes]:
        """One key per full page of req.tokens[:-1] (the last token is fed by decode): a SHA-256
        chained over the request's cache salt and every token before the page's end (and the
        lookahead tokens after it), so equal keys mean equal prefixes. A strong hash, as vLLM's,
        because a collision would hand one request another's KV. Kept on the request and extended
        as its tokens grow."""
        S, tokens = self.page_size, req.tokens
        keys = req.page_keys.setdefault((S, self.lookahead), [])
        h = keys[-1] if keys else hashlib.sha256(b"salt:" + (req.cache_salt or "").encode()).digest()
        for i in range(len(keys), (len(tokens) - 1) // S):  # token (i + 1) * S, the lookahead's, is at most the last
            h = hashlib.sha256(h + np.asarray(tokens[i * S : (i + 1) * S + self.lookahead], np.int64).tobytes()).digest()
            keys.append(h)
        return keys

    def unindexed_prefix(self, req: Request) -> set[bytes]:
        """Keys of req's full prompt pages that the cache does not hold yet (what its prefill will add)."""
        return {h for h in self.page_keys(req) if h not in self._cache} if self.prefix_caching else set()

    def shared_prefix(self, req: Request) -> list[tuple[int, int]]:
        """The cached (page, tag) pairs of req's longest cached prefix."""
        pages = []
        for h in self.page_keys(req) if self.prefix_caching else []:
            if h not in self._cache:
                break
            pages.append(self._cache[h])
        return pages

    def host_prefix(self, req: Request, start: int) -> int:
        """How many of req's full pages past its first `start` (its cached prefix on the device)
        the host tier holds, from there on."""
        if self.host is None or not self.prefix_caching:
            return 0
        return self.host.prefix(self.page_keys(req)[start:])

    def register_prefix(self, req: Request) -> None:
        """Cache req's full pages whose KV it has written (its prompt's after prefill; its output's
        too when it leaves) for later requests to share, and mark them used now."""
        if not self.prefix_caching or req.slot is None:
            return
        keys = self.page_keys(req)[: req.cached // self.page_size]
        want = np.zeros(self.max_pages_per_seq, bool)
        want[: len(keys)] = [h not in self._cache for h in keys]
        if want.any():
            self.table, *read = _cache_slot_jit(self.table, jnp.int32(req.slot), want)
            ok, row, tags = jax.device_get(read)
            if ok:  # else a fault broke req's mappings: nothing of it is cached
                self._cache.update((h, (int(row[i]), int(tags[i]))) for i, h in enumerate(keys) if want[i])
                self._cache_replay_rows(req, [i for i in range(len(keys)) if want[i]])
        self._touch(req)

    def _cache_replay_rows(self, req: Request, pages: list[int]) -> None:
        """Keep the replay rows of req's newly cached pages: their tokens' rows of req.replay_rows."""
        if self.replay_rows is not None:
            S, keys = self.page_size, self.page_keys(req)
            self.replay_rows.update((keys[i], req.replay_rows[i * S:(i + 1) * S].copy()) for i in pages)

    def _uncache(self, keys: list[bytes]) -> list[tuple[int, int]]:
        """Take keys out of the device cache (and their replay rows); returns their (page, tag) pairs."""
        if self.replay_rows is not None:
            for h in keys:
                del self.replay_rows[h]
        return [self._cache.pop(h) for h in keys]

    def _touch(self, req: Request) -> None:
        """Mark req's cached pages used now, its first page last: eviction takes a prefix's tail
        first, so what stays is still a prefix."""
        for h in reversed(self.page_keys(req) if self.prefix_caching else []):
            if h in self._cache:
                self._cache.move_to_end(h)

    def _evict(self, n: int, offload: bool = True) -> None:
        """Free up to n pages that only the cache holds, least recently used first: the table
        picks them among the oldest entries, N candidates at a time. With a host tier (and
        offload), their KV goes there first: nothing has written them since they were evicted."""
        oldest, gone = iter(self._cache.items()), []
        while len(gone) < n and (part := list(itertools.islice(oldest, self.max_pages_per_seq))):
            self.table, evicted, *counts = _evict_jit(self.table, self._padded([p for _, (p, _) in part]),
                                                      self._padded([t for _, (_, t) in part], np.uint32),
                                                      np.int32(len(part)), np.int32(n - len(gone)))
            [evicted] = self._mirror(counts, evicted)
            out = [h for (h, _), out in zip(part, evicted) if out]
            if offload and self.host is not None and out:  # a part at a time: a device copy of N pages at most
                self.host.store(out, [self._cache[h][0] for h in out],
                                None if self.replay_rows is None else [self.replay_rows[h] for h in out])
            gone += out
            if not self.evictable:  # every page left in the cache is mapped: scanning on frees none
                break
        self._uncache(gone)
        self.counters.evicted_pages += len(gone)

    def idle(self, shared: list[tuple[int, int]]) -> int:
        """How many of the cached pages `shared` only the cache holds: sharing them makes that many
        fewer pages evictable."""
        if not shared:
            return 0
        return int(_idle_jit(self.table, self._padded([p for p, _ in shared]), jnp.int32(len(shared))))

    def reset_prefix_cache(self) -> int:
        """Evict every cached page no request maps (vLLM's reset_prefix_cache), and empty the host
        tier; returns how many device pages that freed."""
        before = self.free_pages
        self._evict(len(self._cache), offload=False)
        if self.host is not None:
            self.host.clear()
        return self.free_pages - before

    def evict_all(self) -> None:
        """Evict every cached page no request maps, into the host tier if there is one (the pools
        are about to be freed: Engine.sleep)."""
        self._evict(len(self._cache))

    def forget_cache(self) -> None:
        """Empty the prefix cache, device and host, whatever maps its pages (new weights:
        Engine.update_weights): reset_prefix_cache, then the cache gives up its hold on any page
        a request still maps (the page goes back with that request)."""
        self.reset_prefix_cache()
        held = self._uncache(list(self._cache))
        for i in range(0, len(held), self.max_pages_per_seq):
            part = held[i:i + self.max_pages_per_seq]
            self.table, *counts = _uncache_jit(self.table, self._padded([p for p, _ in part]),
                                               self._padded([t for _, t in part], np.uint32), jnp.int32(len(part)))
            self._mirror(counts)

    def _forget_stale(self, shared: list[tuple[int, int]]) -> None:
        """Drop the cache entries among `shared` whose page no longer holds what was cached (freed,
        or reallocated with a new tag), as a failed `share` found them: never served, they are
        computed again. Their hold is released where it still owns the page (else it leaks)."""
        refs, tags = (np.asarray(a) for a in jax.device_get((self.table.ref_count_P, self.table.tag_P)))
        stale = {(page, tag) for page, tag in shared if not 0 <= page < self.num_pages or refs[page] == 0
                 or tags[page] != tag}
        gone = self._uncache([h for h, entry in self._cache.items() if entry in stale])
        self.table, *counts = _uncache_jit(self.table, self._padded([p for p, _ in gone]),
                                           self._padded([t for _, t in gone], np.uint32), jnp.int32(len(gone)))
        self._mirror(counts)
        self.counters.stale_cache_entries += len(gone)


SCHEDULE_POLICIES = ("fcfs", "lpm", "priority")
LPM_MAX_WAITING = 128  # past this many waiting requests, "lpm" orders them first come, first served (SGLang's rule)


def priority_order(req: Request) -> tuple[int, int]:
    return req.priority, req.rid


class Scheduler:
    def __init__(self, page_manager: PageManager, max_batch: int, counters: Counters, policy: str = "fcfs"):
        if policy not in SCHEDULE_POLICIES:
            raise ValueError(f"schedule policy must be one of {SCHEDULE_POLICIES}, got {policy!r}")
        self.page_manager, self.max_batch, self.counters = page_manager, max_batch, counters
        # Admission order: "fcfs" first come, first served; "lpm" the longest cached prefix first
        # (SGLang's longest prefix match: a cached history is used before other admissions evict it);
        # "priority" the lowest Request.priority first, then first come, and preemption takes the
        # highest (vLLM's priority scheduling).
        self.policy = policy
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def admit(self, max_rows: int) -> list[Request]:
        """Give waiting requests, in order, a slot and pages (sharing cached full prompt pages): at
        most max_rows of them, to prefill beside those still prefilling. A request with a full prompt
        page that a prefilling one will index waits, so that it is admitted after that prefill and
        shares the page (unless it wants prompt logprobs, which only computing the prompt gives):
        the requests behind it wait too (fcfs and priority keep their order), but under lpm those
        behind a new request go on."""
        free_slots = self._free_slots()
        batch = []
        indexing = set().union(*(self.page_manager.unindexed_prefix(r) for r in self.prefilling()))
        if self.policy == "lpm" and free_slots and len(self.waiting) > 1:
            self._longest_prefix_first()
        if self.policy == "priority":  # preempted requests among the others: by priority, then by arrival
            self.waiting = collections.deque(sorted(self.waiting, key=priority_order))
        deferred = []  # lpm: new requests passed over this time for a prefix that a prefill is caching
        try:
            while self.waiting and free_slots and len(batch) < max_rows:
                req = self.waiting[0]
                new_pages = self.page_manager.unindexed_prefix(req)
                # Prompt logprobs come from computing the prompt: such a request shares no cached page.
                computes_all = req.wants_prompt_logprobs
                if new_pages & indexing and not computes_all:
                    if self.policy != "lpm" or req.cache_hit_tokens is not None:  # preempted ones stay first
                        break
                    deferred.append(self.waiting.popleft())
                    continue
                shared = [] if computes_all else self.page_manager.shared_prefix(req)
                restored = 0 if computes_all else self.page_manager.host_prefix(req, len(shared))
                fresh = self.page_manager.pages_for(len(req.tokens)) - len(shared)
                need = fresh + self.page_manager.idle(shared)  # shared pages only the cache holds stop being evictable
                if self._short_of(need):
                    if why := self._never_fits(need):
                        self.waiting.popleft().finish("aborted", why)
                        self.counters.aborts += 1
                        continue
                    break
                if not self.page_manager.take(req, free_slots.pop(0), shared, fresh, restored):
                    break  # the bookkeeping was resynced: the next step tries again
                self.waiting.popleft()
                self.running.append(req)
                batch.append(req)
                indexing |= new_pages
        finally:
            self.waiting.extendleft(reversed(deferred))
        return batch

    def _longest_prefix_first(self) -> None:
        """Order the waiting requests by their cached prefix, longest first, then by arrival (past
        LPM_MAX_WAITING, by arrival alone); preempted requests stay ahead of the rest, in their order."""
        preempted = [r for r in self.waiting if r.cache_hit_tokens is not None]
        new = [r for r in self.waiting if r.cache_hit_tokens is None]
        if len(self.waiting) > LPM_MAX_WAITING:
            new.sort(key=lambda r: r.rid)  # rids count arrivals
        else:
            cached = {id(r): 0 if r.wants_prompt_logprobs else self._cached_pages(r) for r in new}
            new.sort(key=lambda r: (-cached[id(r)], r.rid))
        self.waiting = collections.deque(preempted + new)

    def _cached_pages(self, req: Request) -> int:
        """The pages of req's longest cached prefix, on the device and then the host."""
        on_device = len(self.page_manager.shared_prefix(req))
        return on_device + self.page_manager.host_prefix(req, on_device)

    def adopt(self, req: Request) -> int | None:
        """Take a request prefilled elsewhere (disaggregated serving): a slot, and pages for its
        req.cached tokens, sharing its indexed prompt prefix. Returns how many of its pages were
        shared (the rest await their KV), or None, changing nothing, when there is no room or a
        request this scheduler preempted is waiting (it goes first; under "priority", if it comes
        first by priority)."""
        free_slots = self._free_slots()
        waits_ahead = any(priority_order(w) < priority_order(req) for w in self.waiting) \
            if self.policy == "priority" else self.waiting
        if waits_ahead or not free_slots:
            return None
        cached, (shared, need) = req.cached, self._adoption(req)
        if self._short_of(need):
            return None
        if not self.page_manager.take(req, free_slots[0], shared, self.page_manager.pages_for(cached) - len(shared)):
            return None
        req.cached, req.prefilled = cached, True
        self.running.append(req)
        return len(shared)

    def never_adopted(self, req: Request) -> str | None:
        """Why adopt will never take req (None: it may, later): nothing here runs or waits, so
        nothing will free the pages it lacks."""
        return None if self.waiting else self._never_fits(self._adoption(req)[1])

    def _adoption(self, req: Request) -> tuple[list[tuple[int, int]], int]:
        """The cached pages adopting req would share (its prompt's cached prefix) and how many
        pages it needs beside them: fresh ones, plus those shared pages only the cache holds now
        (sharing them makes them unevictable)."""
        shared = self.page_manager.shared_prefix(req)
        return shared, self.page_manager.pages_for(req.cached) - len(shared) + self.page_manager.idle(shared)

    def _never_fits(self, need: int) -> str | None:
        """An abort reason when `need` pages exceed the free (or evictable) ones and no running
        request will free any: only pages leaked after a detected bookkeeping fault can cause that."""
        if need <= self.page_manager.available or self.running:
            return None
        return (f"KV pool exhausted: {self.page_manager.available} free pages, {need} needed (pages leaked after a "
                "detected bookkeeping fault)")

    def _free_slots(self) -> list[int]:
        return sorted(set(range(self.max_batch)) - {r.slot for r in self.running})

    def make_room_for_decode(self) -> None:
        """Each running request needs a page for the token it decodes next; preempt the youngest if not
        (under "priority": the youngest of the highest priority value)."""
        for req in sorted(self.running, key=lambda r: r.rid):
            if req.result is not None or req.slot is None:
                continue
            while self.page_manager.pages_for(len(req.tokens)) > req.num_pages:
                if not self._short_of(1):
                    self.page_manager.allocate(req, 1)  # if refused, the resynced counts decide again
                    continue
                order = priority_order if self.policy == "priority" else (lambda r: r.rid)  # rids count arrivals
                victim = max((r for r in self.running if r.slot is not None and r.result is None), key=order)
                self.page_manager.release(victim)
                self.running.remove(victim)
                self.waiting.appendleft(victim)  # recomputed from prompt + generated tokens when readmitted
                self.counters.preemptions += 1
                if victim is req:
                    break

    def abort_admitted(self, reason: str) -> list[Request]:
        """Finish "aborted" every request ever admitted (running, or preempted and waiting): what
        ran on weights since replaced (Engine.update_weights); running ones' pages go back."""
        reqs = [r for r in self.running if r.result is None] + [r for r in self.waiting if r.cache_hit_tokens is not None]
        for req in reqs:
            req.finish("aborted", reason)
        self.waiting = collections.deque(r for r in self.waiting if r.result is None)
        self.retire_finished()
        return reqs

    def preempt_all(self) -> list[Request]:
        """Preempt every running request: its pages go back, and it waits first, in its order, to
        be recomputed from its prompt and output (Engine.update_weights: KV of other weights)."""
        victims = [r for r in self.running if r.result is None]
        for req in victims:
            self.page_manager.release(req)
            self.running.remove(req)
        self.waiting.extendleft(reversed(victims))
        return victims

    def _short_of(self, need: int) -> bool:
        """Whether fewer than `need` pages are free or evictable, once the pages running requests
        hold past their tokens (drafts' pages, kept after a rejection) are taken back: nobody waits
        or is preempted for pages that only hold rejected drafts (or a cached prefix)."""
        if need > self.page_manager.available:
            for r in self.running:
                if r.result is None:
                    self.page_manager.trim(r)
        return need > self.page_manager.available

    def room_for_drafts(self, req: Request, drafts: int) -> int:
        """Pages for up to `drafts` tokens past req's next one, from free or evictable pages only (a
        draft never preempts anyone): how many of them fit."""
        while self.page_manager.pages_for(len(req.tokens) + drafts) > req.num_pages and self.page_manager.available > 0:
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
