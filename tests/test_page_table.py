"""Tests for mixserve.page_table: model-checked properties over random op sequences, plus the
edge cases of each operation, `describe` and the checkify strict mode."""

import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.experimental import checkify

from mixserve import faults
from mixserve import page_table as pt

# One small shape for the whole module, so every jitted op compiles exactly once.
P, B, N = 10, 4, 6
TRACES = collections.Counter()


def _jit_counted(fn, name=None):
    def traced(*args):
        TRACES[name or fn.__name__] += 1  # runs only while tracing
        return fn(*args)

    return jax.jit(traced)


allocate = _jit_counted(pt.allocate)
share = _jit_counted(pt.share)
share_tagged = _jit_counted(pt.share, "share with tags")  # the prefix cache's hits
release = _jit_counted(pt.release)
truncate = _jit_counted(pt.truncate)
verify = _jit_counted(pt.verify)
cache = _jit_counted(pt.cache)
uncache = _jit_counted(pt.uncache)
evict = _jit_counted(pt.evict)
evictable = _jit_counted(pt.evictable)
ALL_ACTIVE_B = np.ones(B, bool)


def fresh():
    return pt.init_page_table(P, B, N)


def host(table):
    return jax.device_get(table)


def assert_same(a, b):
    for x, y in zip(jax.tree.leaves(host(a)), jax.tree.leaves(host(b)), strict=True):
        np.testing.assert_array_equal(x, y)


def slot_pages(table, slot):
    t = host(table)
    return t.pages_BN[slot, : t.num_pages_B[slot]].tolist()


def corrupt(table, slot, index, **fields):
    """Table with slot's index-th mapping changed, e.g. corrupt(t, 0, 1, pages_BN=P)."""
    return table.replace(
        **{name: getattr(table, name).at[slot, index].set(v) for name, v in fields.items()}
    )


class Model:
    """Reference model: which pages each slot holds, which the prefix cache holds (with the tag
    it recorded), and which live pages were shared."""

    def __init__(self):
        self.pages = [[] for _ in range(B)]
        self.cached = {}  # page -> tag, in the order cached
        self.shared = set()  # pages shared during their current allocation

    def live(self):
        return {p for ps in self.pages for p in ps} | set(self.cached)

    def truncate(self, slot, n):
        self.pages[slot] = self.pages[slot][: max(n, 0)]
        self.shared &= self.live()


slots = st.integers(0, B - 1)
allocate_op = st.tuples(st.just("allocate"), slots, st.integers(-1, N + 1))
share_op = st.tuples(st.just("share"), slots, slots, st.integers(0, N))
release_op = st.tuples(st.just("release"), slots)
truncate_op = st.tuples(st.just("truncate"), slots, st.integers(-1, N + 1))
cache_op = st.tuples(st.just("cache"), slots, st.integers(0, N))  # the first k of the slot's pages
uncache_op = st.tuples(st.just("uncache"), st.integers(0, P), st.integers(0, N))  # k cached, from the i-th
hit_op = st.tuples(st.just("hit"), slots, st.integers(0, N))  # share the first k cached pages, tag-checked
evict_op = st.tuples(st.just("evict"), st.integers(0, P), st.integers(0, N))  # up to `want`, from the i-th cached
# allocate listed twice: drawn more often, so sequences also run the pool dry.
op_strategy = st.one_of(allocate_op, allocate_op, share_op, release_op, truncate_op, cache_op, uncache_op, hit_op,
                        evict_op)


def padded(values, dtype=np.int32):
    out = np.zeros(N, dtype)
    out[: len(values)] = values
    return out


def apply_and_check(table, model, op):
    """Apply `op` to table and model; check what the op itself promises. Returns the new table."""
    before = host(table)
    kind, slot, *args = op
    if kind == "allocate":
        (n,) = args
        table, ok = allocate(table, np.int32(slot), np.int32(n))
        held = len(model.pages[slot])
        expect_ok = 0 <= n <= P - len(model.live()) and held + n <= N
        assert bool(ok) == expect_ok
        if not ok:
            assert_same(table, before)  # all or nothing
            return table
        new = slot_pages(table, slot)[held:]
        assert len(new) == n and len(set(new)) == n
        assert not set(new) & model.live(), "allocate handed out a live page"
        expected_tags = before.next_tag + np.arange(n, dtype=np.uint32)
        np.testing.assert_array_equal(host(table).tag_P[new], expected_tags)
        assert host(table).next_tag == before.next_tag + n
        model.pages[slot] += new
    elif kind == "share":
        src, k = args
        k = min(k, len(model.pages[src]))
        table, ok = share(table, np.int32(slot), before.pages_BN[src], np.int32(k))
        assert bool(ok) == (len(model.pages[slot]) + k <= N)
        if not ok:
            assert_same(table, before)
            return table
        shared = model.pages[src][:k]
        model.pages[slot] += shared
        model.shared |= set(shared)
        # Sharing records the page's current tag and never changes tags.
        np.testing.assert_array_equal(host(table).tag_P, before.tag_P)
        held = len(model.pages[slot])
        got_tags = host(table).expected_tag_BN[slot, held - k : held]
        np.testing.assert_array_equal(got_tags, before.tag_P[shared])
    elif kind == "cache":
        (k,) = args
        pages = model.pages[slot][:k]
        tags = before.expected_tag_BN[slot, : len(pages)]
        table, ok = cache(table, padded(pages), padded(tags, np.uint32), np.int32(len(pages)))
        assert bool(ok) == (len(set(pages)) == len(pages) and not set(pages) & set(model.cached))
        if not ok:
            assert_same(table, before)
            return table
        model.cached.update(zip(pages, tags.tolist()))
        np.testing.assert_array_equal(host(table).ref_count_P[pages], before.ref_count_P[pages] + 1)
    elif kind == "uncache":
        i, k = slot, args[0]
        entries = list(model.cached.items())
        entries = (entries[i % len(entries):] + entries[: i % len(entries)])[:k] if entries else []
        table = uncache(table, padded([p for p, _ in entries]), padded([t for _, t in entries], np.uint32),
                        np.int32(len(entries)))
        for page, _ in entries:
            del model.cached[page]
        freed = {p for p, _ in entries} - model.live()
        t = host(table)
        assert set(t.free_stack_P[: t.num_free].tolist()) == set(before.free_stack_P[: before.num_free].tolist()) | freed
    elif kind == "evict":
        i, want = slot, args[0]
        entries = list(model.cached.items())
        entries = (entries[i % len(entries):] + entries[: i % len(entries)])[:N] if entries else []
        table, evicted = evict(table, padded([p for p, _ in entries]), padded([t for _, t in entries], np.uint32),
                               np.int32(len(entries)), np.int32(want))
        mapped = {p for ps in model.pages for p in ps}
        expect = [p for p, _ in entries if p not in mapped][:want]
        assert [p for (p, _), out in zip(entries, np.asarray(evicted)) if out] == expect
        for page in expect:
            del model.cached[page]
        t = host(table)
        assert set(t.free_stack_P[: t.num_free].tolist()) == set(before.free_stack_P[: before.num_free].tolist()) | set(expect)
    elif kind == "hit":
        (k,) = args
        entries = list(model.cached.items())[:k]
        table, ok = share_tagged(table, np.int32(slot), padded([p for p, _ in entries]), np.int32(len(entries)),
                          padded([t for _, t in entries], np.uint32))
        assert bool(ok) == (len(model.pages[slot]) + len(entries) <= N)
        if not ok:
            assert_same(table, before)
            return table
        model.pages[slot] += [p for p, _ in entries]
        model.shared |= {p for p, _ in entries}
    else:
        n = args[0] if kind == "truncate" else 0
        table = truncate(table, np.int32(slot), np.int32(n)) if kind == "truncate" else release(table, np.int32(slot))
        kept = model.pages[slot][: max(n, 0)]
        model.truncate(slot, n)
        assert slot_pages(table, slot) == kept  # the first n stay, with their recorded tags
        np.testing.assert_array_equal(host(table).expected_tag_BN[slot, : len(kept)], before.expected_tag_BN[slot, : len(kept)])
        np.testing.assert_array_equal(host(table).tag_P, before.tag_P)  # tags stay until reuse
    return table


@settings(max_examples=150, deadline=None)
@given(ops=st.lists(op_strategy, max_size=25))
def test_random_op_sequences_keep_invariants(ops):
    table, model = fresh(), Model()
    for op in ops:
        before = host(table)
        table = apply_and_check(table, model, op)
        t = host(table)
        pt.assert_consistent(table)  # ref counts, free stack, free + live == P
        assert [slot_pages(table, b) for b in range(B)] == model.pages
        mappings_P = np.bincount(t.pages_BN[np.arange(N) < t.num_pages_B[:, None]], minlength=P)
        assert set(np.flatnonzero(mappings_P > 1)) <= model.shared, "page in two slots unshared"
        assert np.all(t.tag_P >= before.tag_P) and t.next_tag >= before.next_tag
        assert bool(jnp.all(verify(table, ALL_ACTIVE_B).ok_B))
        assert jax.tree.map(lambda x: x.dtype, t) == jax.tree.map(lambda x: x.dtype, before)
        assert set(np.flatnonzero(t.cached_P)) == set(model.cached)
        assert all(t.tag_P[p] == tag for p, tag in model.cached.items())  # a cached page keeps its tag
        mapped = {p for ps in model.pages for p in ps}
        assert int(evictable(table)) == len(set(model.cached) - mapped)
    # Slots and sizes are traced, so no example triggered a recompile.
    assert all(count <= 1 for count in TRACES.values()), TRACES


def test_init_is_all_free_and_consistent():
    table = fresh()
    pt.assert_consistent(table)
    assert int(pt.num_free(table)) == P and int(pt.pages_in_use(table)) == 0
    assert int(table.next_tag) == 1 and not np.any(host(table).tag_P)
    assert bool(jnp.all(verify(table, ALL_ACTIVE_B).ok_B))


def test_allocate_stamps_consecutive_tags_and_counts_pages():
    table, ok = allocate(fresh(), np.int32(0), np.int32(3))
    table, ok2 = allocate(table, np.int32(1), np.int32(2))
    assert ok and ok2
    assert slot_pages(table, 0) == [0, 1, 2] and slot_pages(table, 1) == [3, 4]
    np.testing.assert_array_equal(host(table).expected_tag_BN[1, :2], [4, 5])
    assert int(pt.num_free(table)) == P - 5 and int(pt.pages_in_use(table)) == 5


@pytest.mark.parametrize("n", [N - 1, -1])
def test_allocate_rejects_slot_overflow_and_negative_sizes_without_side_effects(n):
    table, _ = allocate(fresh(), np.int32(0), np.int32(2))
    after, ok = allocate(table, np.int32(0), np.int32(n))
    assert not ok
    assert_same(after, table)


def test_allocate_rejects_when_pool_is_short():
    table, _ = allocate(fresh(), np.int32(0), np.int32(N))
    left = P - N
    assert int(pt.num_free(table)) == left and left + 1 <= N
    after, ok = allocate(table, np.int32(1), np.int32(left + 1))
    assert not ok
    assert_same(after, table)
    _, ok = allocate(table, np.int32(1), np.int32(left))
    assert ok


def test_share_refuses_dead_or_out_of_range_pages_and_overflow():
    table, _ = allocate(fresh(), np.int32(0), np.int32(2))
    table, _ = allocate(table, np.int32(1), np.int32(N))
    # A free page, ids out of range, more pages than given.
    for page_ids, n in [([0, 9], 2), ([0, P], 2), ([0, -1], 2), ([0, 1], N + 1)]:
        page_ids_K = np.array(page_ids + [0] * (N - 2), np.int32)
        after, ok = share(table, np.int32(2), page_ids_K, np.int32(n))
        assert not ok, (page_ids, n)
        assert_same(after, table)
    full, ok = share(table, np.int32(1), host(table).pages_BN[0], np.int32(1))
    assert not ok
    assert_same(full, table)


def test_shared_page_is_freed_only_when_last_reference_drops():
    table, _ = allocate(fresh(), np.int32(0), np.int32(2))
    table, ok = share(table, np.int32(1), host(table).pages_BN[0], np.int32(1))
    assert ok and host(table).ref_count_P[0] == 2
    table = release(table, np.int32(0))
    pt.assert_consistent(table)
    assert host(table).ref_count_P[0] == 1 and int(pt.num_free(table)) == P - 1
    table = release(table, np.int32(1))
    pt.assert_consistent(table)
    assert int(pt.num_free(table)) == P


def test_reallocated_page_gets_a_new_tag_and_the_old_mapping_fails():
    table, _ = allocate(fresh(), np.int32(0), np.int32(1))
    assert slot_pages(table, 0) == [0] and host(table).tag_P[0] == 1
    table, _ = allocate(release(table, np.int32(0)), np.int32(1), np.int32(1))
    assert slot_pages(table, 1) == [0] and host(table).tag_P[0] == 2
    # Slot 0 keeps its old mapping by mistake: the page is live again, but in a new life.
    table = corrupt(table, 0, 0, pages_BN=0, expected_tag_BN=1)
    table = table.replace(num_pages_B=table.num_pages_B.at[0].set(1))
    report = verify(table, ALL_ACTIVE_B)
    assert host(report.ok_B).tolist() == [False, True, True, True]
    assert pt.describe(report, 0) == (
        "page 0 (logical 0): expected tag 1, found tag 2 "
        "(page was reallocated or the mapping is corrupt)"
    )
    assert pt.describe(report, 1) == "ok"


def test_verify_reports_first_bad_page_and_ignores_inactive_slots():
    table, _ = allocate(fresh(), np.int32(0), np.int32(4))
    table, _ = allocate(table, np.int32(1), np.int32(2))
    table = corrupt(corrupt(table, 0, 3, pages_BN=P), 0, 1, expected_tag_BN=99)
    table = corrupt(table, 1, 0, pages_BN=-5)
    report = host(verify(table, np.array([True, False, True, True])))
    assert report.ok_B.tolist() == [False, True, True, True]
    assert report.bad_index_B.tolist() == [1, -1, -1, -1]
    assert report.kind_B[0] == pt.Violation.TAG_MISMATCH
    assert (report.expected_tag_B[0], report.found_tag_B[0]) == (99, 2)
    report = verify(table, ALL_ACTIVE_B)
    assert pt.describe(report, 1) == (
        "page -5 (logical 0): expected tag 5, found no tag (page id out of range)"
    )


def test_verify_flags_mapping_to_freed_page():
    table, _ = allocate(fresh(), np.int32(0), np.int32(2))
    table = table.replace(ref_count_P=table.ref_count_P.at[1].set(0))
    report = verify(table, ALL_ACTIVE_B)
    assert int(report.kind_B[0]) == pt.Violation.FREED
    assert pt.describe(report, 0) == (
        "page 1 (logical 1): expected tag 2, found tag 2 (page was freed)"
    )


def test_checkify_strict_mode_turns_a_bad_mapping_into_an_error():
    def strict_step(table, active_B):
        pt.checked(pt.verify(table, active_B))

    strict = checkify.checkify(jax.jit(strict_step))
    table, _ = allocate(fresh(), np.int32(2), np.int32(3))
    err, _ = strict(table, ALL_ACTIVE_B)
    err.throw()  # clean table: no error
    bad = corrupt(table, 2, 1, expected_tag_BN=7)
    err, _ = strict(bad, ALL_ACTIVE_B)
    expected = "slot 2 page 1 .*expected tag 7, found tag 2"
    with pytest.raises(checkify.JaxRuntimeError, match=expected):
        err.throw()
    err, _ = strict(bad, np.array([True, True, False, True]))  # the bad slot is inactive
    err.throw()


def test_truncate_frees_only_the_tail_it_owns():
    """truncate keeps a slot's first n pages; a dropped page another slot shares stays live, and a
    corrupted tail mapping (a page now another slot's) leaks rather than frees that slot's page."""
    table, _ = allocate(fresh(), np.int32(0), np.int32(4))
    table, _ = share(table, np.int32(1), host(table).pages_BN[0], np.int32(4))
    table = truncate(table, np.int32(0), np.int32(2))
    pt.assert_consistent(table)
    assert slot_pages(table, 0) == [0, 1] and int(pt.num_free(table)) == P - 4  # slot 1 still maps 2 and 3
    table = truncate(table, np.int32(1), np.int32(3))
    assert int(pt.num_free(table)) == P - 3 and host(table).free_stack_P[P - 4] == 3
    same = truncate(table, np.int32(1), np.int32(N))  # past what it holds: nothing changes
    assert_same(same, table)
    table, _ = allocate(release(table, np.int32(1)), np.int32(2), np.int32(2))
    table = corrupt(table, 2, 1, pages_BN=0)  # slot 2's second mapping points at slot 0's page
    table = truncate(table, np.int32(2), np.int32(1))
    assert slot_pages(table, 0) == [0, 1] and host(table).ref_count_P[0] == 1
    assert bool(jnp.all(verify(table, ALL_ACTIVE_B).ok_B))


def test_cached_pages_outlive_their_slot_and_a_hit_is_checked_against_the_cached_tag():
    table, _ = allocate(fresh(), np.int32(0), np.int32(2))
    pages, tags = slot_pages(table, 0), host(table).expected_tag_BN[0, :2]
    table, ok = cache(table, padded(pages), padded(tags, np.uint32), np.int32(2))
    assert ok and int(evictable(table)) == 0  # slot 0 still maps them
    table = release(table, np.int32(0))
    assert int(pt.num_free(table)) == P - 2 and int(evictable(table)) == 2  # the cache's hold keeps them
    hit, ok = share_tagged(table, np.int32(1), padded(pages), np.int32(2), padded(tags, np.uint32))
    assert ok and slot_pages(hit, 1) == pages and int(evictable(hit)) == 0
    pt.assert_consistent(hit)
    # The same hit after page 1 was pushed free by a bug and reallocated (a new tag): refused whole.
    stolen = faults.use_after_free(hit, 1, 1)
    stolen = release(stolen, np.int32(1))
    stolen, ok = allocate(stolen, np.int32(2), np.int32(1))
    assert ok and slot_pages(stolen, 2) == [pages[1]] and not host(stolen).cached_P[pages[1]]  # the hold went with it
    before = host(stolen)
    refused, ok = share_tagged(stolen, np.int32(3), padded(pages), np.int32(2), padded(tags, np.uint32))
    assert not ok
    assert_same(refused, before)
    # Evicting the stale entry leaves the new owner's page alone; the good entry's page goes free.
    evicted = uncache(refused, padded(pages), padded(tags, np.uint32), np.int32(2))
    t = host(evicted)
    assert t.ref_count_P[pages[1]] == 1 and slot_pages(evicted, 2) == [pages[1]]
    assert t.ref_count_P[pages[0]] == 0 and pages[0] in t.free_stack_P[: t.num_free]
    assert not t.cached_P.any()


def test_cache_refuses_dead_listed_twice_or_already_cached_pages():
    table, _ = allocate(fresh(), np.int32(0), np.int32(2))
    pages, tags = slot_pages(table, 0), host(table).expected_tag_BN[0, :2]
    for ids, tag_list in (([pages[0], pages[0]], [tags[0], tags[0]]),  # listed twice
                          ([pages[0], 7], [tags[0], 0]),  # page 7 was never allocated
                          ([pages[0]], [tags[0] + 1])):  # another tag
        after, ok = cache(table, padded(ids), padded(tag_list, np.uint32), np.int32(len(ids)))
        assert not ok
        assert_same(after, table)
    table, ok = cache(table, padded(pages[:1]), padded(tags[:1], np.uint32), np.int32(1))
    assert ok
    again, ok = cache(table, padded(pages[:1]), padded(tags[:1], np.uint32), np.int32(1))
    assert not ok and host(again).ref_count_P[pages[0]] == 2
