"""Functional page table for a paged KV cache, with generation tags for integrity checks.

Every physical KV page carries a generation tag that changes each time the page is allocated
from the free stack. A request (batch slot) records the tag of every page it was given; before a
step (a prefill chunk or a decode) reads the cache, `verify` checks, for all slots at once, that each mapped page is in
range, still live and still carries the recorded tag. A failing slot must be aborted, never
answered from someone else's (or no one's) KV.

The prefix cache (mixserve/scheduler.py) keeps pages past the requests that wrote them: it holds a
reference of its own on each (`cache`, `uncache`), records the page's tag as a slot does, and
hands a cached page to a later request only through `share` with that tag, so a hit on a page
that was freed or reallocated behind the cache's back is refused like a stale slot mapping.

Everything here is a pure function of a fixed-shape pytree, so it runs under `jax.jit` without
recompiling. Axis suffixes: P = physical pages in the pool, B = batch slots, N = logical pages per
slot.
"""

from __future__ import annotations

import enum

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.experimental import checkify


@struct.dataclass
class PageTable:
    """Page pool state plus the per-slot page mappings.

    free_stack_P:    int32 [P]    free page ids; entries [0, num_free) are free, the top is last.
    num_free:        int32 []
    ref_count_P:     int32 [P]    slot mappings per page (> 1 when a prefix is shared), plus one
                                  while the prefix cache holds it.
    cached_P:        bool [P]     the prefix cache holds one of the page's references.
    tag_P:           uint32 [P]   tag of the page's current allocation (0 = never allocated).
    next_tag:        uint32 []    global counter, so a tag names one (page, allocation) pair.
                                  It wraps after 2^32 page allocations (days of allocating
                                  10^4 pages/s); a stale mapping then goes unseen only if it
                                  outlives all of them and its page draws the same tag again.
    pages_BN:        int32 [B, N] physical page of each slot's n-th logical page.
    expected_tag_BN: uint32 [B, N] tag each slot recorded when it got that page.
    num_pages_B:     int32 [B]    logical pages held by each slot.
    """

    free_stack_P: jax.Array
    num_free: jax.Array
    ref_count_P: jax.Array
    cached_P: jax.Array
    tag_P: jax.Array
    next_tag: jax.Array
    pages_BN: jax.Array
    expected_tag_BN: jax.Array
    num_pages_B: jax.Array

    @property
    def num_pool_pages(self) -> int:
        return self.tag_P.shape[0]

    @property
    def max_pages_per_seq(self) -> int:
        return self.pages_BN.shape[1]


class Violation(enum.IntEnum):
    """Why a mapping failed `verify` (`IntegrityReport.kind_B`)."""

    OK = 0
    OUT_OF_RANGE = 1  # page id outside [0, P)
    FREED = 2  # page has no references: it is (or was) back on the free stack
    TAG_MISMATCH = 3  # page now holds another allocation, or the slot maps a page it never got


@struct.dataclass
class IntegrityReport:
    """Result of `verify`, per slot; the bad_*/tag fields describe the slot's first bad page.

    ok_B:           bool [B]    True for inactive slots and slots whose mappings all check out.
    kind_B:         int32 [B]   a `Violation` code.
    bad_index_B:    int32 [B]   logical page index (-1 when ok).
    bad_page_B:     int32 [B]   physical page id as mapped (-1 when ok).
    expected_tag_B: uint32 [B]  tag the slot recorded (0 when ok).
    found_tag_B:    uint32 [B]  tag the page carries now (0 when ok or out of range).
    """

    ok_B: jax.Array
    kind_B: jax.Array
    bad_index_B: jax.Array
    bad_page_B: jax.Array
    expected_tag_B: jax.Array
    found_tag_B: jax.Array


def init_page_table(num_pages: int, max_batch: int, max_pages_per_seq: int) -> PageTable:
    """All `num_pages` pages free, no slot holding any page."""
    shape_BN = (max_batch, max_pages_per_seq)
    return PageTable(
        # Reversed so that pops hand out pages 0, 1, 2, ... (readable in tests and logs).
        free_stack_P=jnp.arange(num_pages - 1, -1, -1, dtype=jnp.int32),
        num_free=jnp.int32(num_pages),
        ref_count_P=jnp.zeros(num_pages, jnp.int32),
        cached_P=jnp.zeros(num_pages, bool),
        tag_P=jnp.zeros(num_pages, jnp.uint32),
        # Tags start at 1, so no recorded tag ever matches a never-allocated page.
        next_tag=jnp.uint32(1),
        # Page 0 is a safe in-range filler: entries at n >= num_pages_B[b] are never read.
        pages_BN=jnp.zeros(shape_BN, jnp.int32),
        expected_tag_BN=jnp.zeros(shape_BN, jnp.uint32),
        num_pages_B=jnp.zeros(max_batch, jnp.int32),
    )


def num_free(table: PageTable) -> jax.Array:
    """int32 []: pages on the free stack."""
    return table.num_free


def pages_in_use(table: PageTable) -> jax.Array:
    """int32 []: distinct live pages (a shared page counts once, a cached one too)."""
    return table.num_pool_pages - table.num_free


def evictable(table: PageTable) -> jax.Array:
    """int32 []: pages only the prefix cache holds (`uncache` would free them)."""
    return jnp.sum(table.cached_P & (table.ref_count_P == 1), dtype=jnp.int32)


def _clamp_pages(table: PageTable, page_X: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(in_range_X, safe_X): whether each page id is in [0, P), and the ids clamped for gathers."""
    in_range_X = (page_X >= 0) & (page_X < table.num_pool_pages)
    return in_range_X, jnp.clip(page_X, 0, table.num_pool_pages - 1)


def _append(table: PageTable, slot, take_K, page_K, tag_K) -> PageTable:
    """Append the entries selected by the prefix mask take_K to slot's mappings.

    The caller has checked that they fit in N.
    """
    start = table.num_pages_B[slot]
    k_K = jnp.arange(take_K.shape[0], dtype=jnp.int32)
    # Column N is out of bounds, so the scatters drop the entries not taken.
    col_K = jnp.where(take_K, start + k_K, table.max_pages_per_seq)
    return table.replace(
        pages_BN=table.pages_BN.at[slot, col_K].set(page_K, mode="drop"),
        expected_tag_BN=table.expected_tag_BN.at[slot, col_K].set(tag_K, mode="drop"),
        num_pages_B=table.num_pages_B.at[slot].add(take_K.sum(dtype=jnp.int32)),
    )


def allocate(table: PageTable, slot, n) -> tuple[PageTable, jax.Array]:
    """Append `n` fresh pages from the free stack to `slot` (0 <= slot < B), each with a new tag.

    All or nothing: if fewer than n pages are free or the slot would exceed N pages, returns the
    table unchanged and ok=False. slot and n are int scalars and may be traced.
    """
    n = jnp.asarray(n, jnp.int32)
    ok = (n >= 0) & (n <= table.num_free) & (table.num_pages_B[slot] + n <= table.max_pages_per_seq)
    # One slot never takes more than N pages, so N candidate pops cover every valid request.
    i_N = jnp.arange(table.max_pages_per_seq, dtype=jnp.int32)
    take_N = ok & (i_N < n)
    # The i-th page taken is the i-th from the top of the stack.
    page_N = table.free_stack_P[jnp.clip(table.num_free - 1 - i_N, 0, table.num_pool_pages - 1)]
    tag_N = table.next_tag + i_N.astype(jnp.uint32)
    n_taken = take_N.sum(dtype=jnp.int32)
    page_idx_N = jnp.where(take_N, page_N, table.num_pool_pages)  # P is out of bounds: dropped
    table = table.replace(
        num_free=table.num_free - n_taken,
        ref_count_P=table.ref_count_P.at[page_idx_N].set(1, mode="drop"),
        # A page on the free stack has no holder; one pushed there by a bug loses the cache's hold.
        cached_P=table.cached_P.at[page_idx_N].set(False, mode="drop"),
        tag_P=table.tag_P.at[page_idx_N].set(tag_N, mode="drop"),
        next_tag=table.next_tag + n_taken.astype(jnp.uint32),
    )
    return _append(table, slot, take_N, page_N, tag_N), ok


def share(table: PageTable, slot, page_ids_K: jax.Array, n, tag_K: jax.Array | None = None
          ) -> tuple[PageTable, jax.Array]:
    """Append the first `n` of page_ids_K (live pages: a common full-page prompt prefix that the
    prefix cache holds, or that another slot holds) to `slot`, adding a reference to each and
    recording its current tag.

    The tag stays: it changes only when a page changes hands through release + allocate.
    All or nothing: ok=False (table unchanged) if a page is out of range or not live, its tag is
    not tag_K's (when given: the tags the prefix cache recorded, so a page reallocated since is
    refused), or the slot would exceed N pages. page_ids_K: int32 [K]; tag_K: uint32 [K].
    """
    n = jnp.asarray(n, jnp.int32)
    want_K = jnp.arange(page_ids_K.shape[0], dtype=jnp.int32) < n
    in_range_K, safe_K = _clamp_pages(table, page_ids_K)
    live_K = in_range_K & (table.ref_count_P[safe_K] > 0)
    if tag_K is not None:
        live_K &= table.tag_P[safe_K] == tag_K
    ok = (
        (n >= 0)
        & (n <= page_ids_K.shape[0])
        & (table.num_pages_B[slot] + n <= table.max_pages_per_seq)
        & jnp.all(live_K | ~want_K)
    )
    take_K = ok & want_K
    page_idx_K = jnp.where(take_K, page_ids_K, table.num_pool_pages)
    # add (not set) so that a page listed twice gets two references.
    table = table.replace(ref_count_P=table.ref_count_P.at[page_idx_K].add(1, mode="drop"))
    return _append(table, slot, take_K, page_ids_K, table.tag_P[safe_K]), ok


def cache(table: PageTable, page_ids_K: jax.Array, tag_K: jax.Array, n) -> tuple[PageTable, jax.Array]:
    """The prefix cache takes a reference to each of the first `n` of page_ids_K, pages a slot
    holds now with the tags tag_K (what the slot recorded), so that they outlive the slot.

    All or nothing: ok=False (table unchanged) if a page is out of range, not live, carries
    another tag, is cached already, or is listed twice.
    """
    n = jnp.asarray(n, jnp.int32)
    want_K = jnp.arange(page_ids_K.shape[0], dtype=jnp.int32) < n
    in_range_K, safe_K = _clamp_pages(table, page_ids_K)
    P = table.num_pool_pages
    listed_P = jnp.zeros(P, jnp.int32).at[jnp.where(want_K, page_ids_K, P)].add(1, mode="drop")
    fit_K = (in_range_K & (table.ref_count_P[safe_K] > 0) & (table.tag_P[safe_K] == tag_K)
             & ~table.cached_P[safe_K] & (listed_P[safe_K] == 1))
    ok = (n >= 0) & (n <= page_ids_K.shape[0]) & jnp.all(fit_K | ~want_K)
    page_idx_K = jnp.where(ok & want_K, page_ids_K, P)
    return table.replace(
        ref_count_P=table.ref_count_P.at[page_idx_K].add(1, mode="drop"),
        cached_P=table.cached_P.at[page_idx_K].set(True, mode="drop"),
    ), ok


def uncache(table: PageTable, page_ids_K: jax.Array, tag_K: jax.Array, n) -> PageTable:
    """The prefix cache drops its hold on each of the first `n` of page_ids_K (evicted); a page
    left with no reference goes back on the free stack. As in `truncate`, only a hold that still
    owns its page (cached, tag tag_K) gives a reference back: a page re-stamped behind the cache's
    back is no longer the cache's (its flag is cleared) but keeps the reference, and leaks, which
    costs capacity but never hands its KV to anyone."""
    return _drop_holds(table, page_ids_K, tag_K, jnp.arange(page_ids_K.shape[0], dtype=jnp.int32) < n)


def evict(table: PageTable, page_ids_K: jax.Array, tag_K: jax.Array, n, want) -> tuple[PageTable, jax.Array]:
    """`uncache` the first `want` of the first `n` of page_ids_K (candidates in the cache's
    eviction order) that only the cache holds, under the tags it recorded (tag_K), freeing them.
    Returns the table and which candidates were evicted (bool [K])."""
    want_K = jnp.arange(page_ids_K.shape[0], dtype=jnp.int32) < n
    in_range_K, safe_K = _clamp_pages(table, page_ids_K)
    idle_K = (want_K & in_range_K & table.cached_P[safe_K] & (table.ref_count_P[safe_K] == 1)
              & (table.tag_P[safe_K] == tag_K))
    evicted_K = idle_K & (jnp.cumsum(idle_K, dtype=jnp.int32) <= want)
    return _drop_holds(table, page_ids_K, tag_K, evicted_K), evicted_K


def _drop_holds(table: PageTable, page_ids_K: jax.Array, tag_K: jax.Array, listed_K: jax.Array) -> PageTable:
    """The cache's holds on the pages listed_K selects end; those still under tag_K give their
    reference back."""
    in_range_K, safe_K = _clamp_pages(table, page_ids_K)
    held_K = listed_K & in_range_K & table.cached_P[safe_K]
    P = table.num_pool_pages
    owned_idx_K = jnp.where(held_K & (table.tag_P[safe_K] == tag_K), page_ids_K, P)
    drops_P = jnp.zeros(P, jnp.int32).at[owned_idx_K].set(1, mode="drop")
    table = table.replace(cached_P=table.cached_P.at[jnp.where(held_K, page_ids_K, P)].set(False, mode="drop"))
    return _drop_references(table, drops_P)


def _drop_references(table: PageTable, drops_P: jax.Array) -> PageTable:
    """Take drops_P[p] references off each page p, pushing the pages left with none on the free stack."""
    P = table.num_pool_pages
    ref_count_P = jnp.maximum(table.ref_count_P - drops_P, 0)
    # Push only pages whose count drops to 0 now: a page already free is never pushed twice.
    freed_P = (table.ref_count_P > 0) & (ref_count_P == 0)
    push_at_P = table.num_free + jnp.cumsum(freed_P, dtype=jnp.int32) - 1
    free_stack_P = table.free_stack_P.at[jnp.where(freed_P, push_at_P, P)].set(
        jnp.arange(P, dtype=jnp.int32), mode="drop"
    )
    return table.replace(free_stack_P=free_stack_P, num_free=table.num_free + freed_P.sum(dtype=jnp.int32),
                         ref_count_P=ref_count_P)


def truncate(table: PageTable, slot, n) -> PageTable:
    """Drop `slot`'s pages past its first `n` (n >= what it holds: no change); pages left with
    no reference go back on the free stack. slot and n are int scalars and may be traced.

    Tags stay until the page is reallocated. Only mappings that still own their page (in range,
    tag matches) give back a reference: a corrupted mapping (the slot is being aborted) must not
    free a page that now belongs to another slot. Such a page leaks instead, which costs capacity
    but never correctness.
    """
    n = jnp.clip(jnp.asarray(n, jnp.int32), 0, table.num_pages_B[slot])
    pages_N = table.pages_BN[slot]
    in_range_N, safe_N = _clamp_pages(table, pages_N)
    i_N = jnp.arange(table.max_pages_per_seq)
    dropped_N = (i_N >= n) & (i_N < table.num_pages_B[slot])
    owned_N = dropped_N & in_range_N & (table.tag_P[safe_N] == table.expected_tag_BN[slot])
    P = table.num_pool_pages
    table = _drop_references(table, jnp.zeros(P, jnp.int32).at[jnp.where(owned_N, pages_N, P)].add(1, mode="drop"))
    kept_N = i_N < n
    return table.replace(
        pages_BN=table.pages_BN.at[slot].set(jnp.where(kept_N, pages_N, 0)),
        expected_tag_BN=table.expected_tag_BN.at[slot].set(jnp.where(kept_N, table.expected_tag_BN[slot], 0)),
        num_pages_B=table.num_pages_B.at[slot].set(n),
    )


def release(table: PageTable, slot) -> PageTable:
    """Drop all of `slot`'s pages (`truncate` to none)."""
    return truncate(table, slot, 0)


def verify(table: PageTable, active_B: jax.Array) -> IntegrityReport:
    """Batched integrity check of every active slot's page mappings; run before attention reads.

    active_B: bool [B]. For each active slot and each n < num_pages_B[b], the page must be in
    [0, P), have ref_count > 0 and carry tag expected_tag_BN[b, n]. Inactive slots are ok.
    """
    in_range_BN, safe_BN = _clamp_pages(table, table.pages_BN)
    found_BN = jnp.where(in_range_BN, table.tag_P[safe_BN], jnp.uint32(0))
    kind_BN = jnp.select(
        [~in_range_BN, table.ref_count_P[safe_BN] <= 0, found_BN != table.expected_tag_BN],
        [Violation.OUT_OF_RANGE, Violation.FREED, Violation.TAG_MISMATCH],
        Violation.OK,
    ).astype(jnp.int32)
    n_N = jnp.arange(table.max_pages_per_seq, dtype=jnp.int32)
    checked_BN = active_B[:, None] & (n_N[None, :] < table.num_pages_B[:, None])
    kind_BN = jnp.where(checked_BN, kind_BN, Violation.OK)
    ok_B = jnp.all(kind_BN == Violation.OK, axis=1)
    first_B = jnp.argmax(kind_BN != Violation.OK, axis=1).astype(jnp.int32)

    def first_bad(x_BN, ok_value):
        return jnp.where(ok_B, ok_value, jnp.take_along_axis(x_BN, first_B[:, None], axis=1)[:, 0])

    return IntegrityReport(
        ok_B=ok_B,
        kind_B=first_bad(kind_BN, Violation.OK),
        bad_index_B=jnp.where(ok_B, -1, first_B),
        bad_page_B=first_bad(table.pages_BN, -1),
        expected_tag_B=first_bad(table.expected_tag_BN, jnp.uint32(0)),
        found_tag_B=first_bad(found_BN, jnp.uint32(0)),
    )


_REASON = {
    Violation.OUT_OF_RANGE: "page id out of range",
    Violation.FREED: "page was freed",
    Violation.TAG_MISMATCH: "page was reallocated or the mapping is corrupt",
}


def describe(report: IntegrityReport, slot: int) -> str:
    """Host-side abort reason for `slot`, e.g.
    'page 17 (logical 3): expected tag 42, found tag 57 (page was reallocated or ...)'."""
    r = jax.device_get(jax.tree.map(lambda x_B: x_B[slot], report))
    kind = Violation(int(r.kind_B))
    if kind is Violation.OK:
        return "ok"
    found = "no tag" if kind is Violation.OUT_OF_RANGE else f"tag {int(r.found_tag_B)}"
    return (
        f"page {int(r.bad_page_B)} (logical {int(r.bad_index_B)}): "
        f"expected tag {int(r.expected_tag_B)}, found {found} ({_REASON[kind]})"
    )


def checked(report: IntegrityReport) -> None:
    """Strict mode: a `checkify.check` that fails when any active slot failed `verify`.

    Only meaningful inside `checkify.checkify(fn)`; the error names the first failing slot.
    """
    slot = jnp.argmin(report.ok_B)  # first False
    checkify.check(
        jnp.all(report.ok_B),
        "KV integrity check failed: slot {slot} page {page} (logical {index}): "
        "expected tag {expected}, found tag {found} (violation {kind})",
        slot=slot,
        page=report.bad_page_B[slot],
        index=report.bad_index_B[slot],
        expected=report.expected_tag_B[slot],
        found=report.found_tag_B[slot],
        kind=report.kind_B[slot],
    )


def assert_consistent(table: PageTable) -> None:
    """Host-side invariant check for tests: raises AssertionError on the first broken invariant."""
    t = jax.device_get(table)
    P, N = t.num_pool_pages, t.max_pages_per_seq
    num_free = int(t.num_free)
    assert 0 <= num_free <= P, f"num_free {num_free} outside [0, {P}]"
    free = t.free_stack_P[:num_free]
    assert np.all((free >= 0) & (free < P)), f"free stack holds out-of-range ids {free}"
    assert len(np.unique(free)) == num_free, f"free stack has duplicates {np.sort(free)}"
    assert np.all((t.num_pages_B >= 0) & (t.num_pages_B <= N)), f"num_pages_B {t.num_pages_B}"
    mapped_BN = np.arange(N)[None, :] < t.num_pages_B[:, None]
    pages = t.pages_BN[mapped_BN]
    assert np.all((pages >= 0) & (pages < P)), f"mapped pages out of range {pages}"
    holders_P = np.bincount(pages, minlength=P) + t.cached_P
    assert np.array_equal(t.ref_count_P, holders_P), (
        f"ref counts {t.ref_count_P} != mappings plus cache holds per page {holders_P}"
    )
    assert np.all(t.ref_count_P[free] == 0), "a free page has references"
    assert num_free + np.count_nonzero(t.ref_count_P) == P, "free + live pages != P"
    assert np.array_equal(t.expected_tag_BN[mapped_BN], t.tag_P[pages]), "stale expected tag"
    assert np.all(t.tag_P < t.next_tag), "a page tag is not below next_tag"
