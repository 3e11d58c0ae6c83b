"""The prefix cache's host tier (mixserve/host_cache.py): pages the device evicts are copied to
host memory and come back, bit for bit, into fresh pages for a later request with that prefix,
which then prefills only the rest and decodes the cache-free forward's tokens."""

import numpy as np
import pytest

import mixserve
from mixserve import page_table as pt
from mixserve.disaggregated import DisaggregatedEngine
from mixserve.engine import Engine
from mixserve.host_cache import HostKVCache

from conftest import ONE_STEP_SHAPE
from test_engine import greedy_reference
from test_prefix_cache import S, tokens, written_pages


def test_the_host_tier_drops_its_least_recently_used_pages_past_its_bytes():
    """Fake device pages of random bytes: stored, counted to the byte, dropped least recently used
    first (a stored, touched or loaded page counts as used), written back as they were read, and
    the prefix stops at the first page not held."""
    rng = np.random.default_rng()
    device = {p: [{"k": rng.normal(size=(2, 3)).astype(np.float32)}, {"c": rng.integers(0, 255, 5, np.uint8)}]
              for p in range(10)}
    written = {}
    host = HostKVCache(3 * 29, read=lambda ids: [device[p] for p in ids],
                       write=lambda ids, pages: written.update(zip(ids, pages)))
    page_bytes = 2 * 3 * 4 + 5
    host.store([b"a", b"b"], [0, 1])
    assert (len(host), host.bytes, host.stored_pages) == (2, 2 * page_bytes, 2)
    host.store([b"a", b"c"], [7, 2])  # "a" is held: not read again, used now
    assert host.stored_pages == 3 and host.prefix([b"b", b"c", b"a"]) == 3
    host.store([b"d"], [3])  # 4 pages of 29 bytes past 87: the least recently used ("b") goes
    assert b"b" not in host and host.dropped_pages == 1 and host.bytes == 3 * page_bytes
    assert host.prefix([b"a", b"c", b"b", b"d"]) == 2 and host.prefix([b"x"]) == 0
    host.touch([b"a"])
    host.load([b"c", b"d"], [8, 9])  # used now: "a" is the oldest
    assert written == {8: device[2], 9: device[3]} and host.loaded_pages == 2
    host.store([b"e"], [4])
    assert b"a" not in host and len(host) == 3
    assert host.clear() == 3 and (len(host), host.bytes) == (0, 0)
    with pytest.raises(ValueError, match="positive capacity"):
        HostKVCache(0, read=None, write=None)


@pytest.mark.parametrize("preset, kv_dtype, mtp", [("tiny-kimi", "auto", False), ("tiny-kimi", "fp8_e4m3", True),
                                                  ("tiny-glm4", "fp8_e4m3", False), ("tiny-glm5", "fp8_ds_mla", False)])
def test_a_prefix_the_device_evicted_comes_back_from_the_host(preset, kv_dtype, mtp):
    """Turn 1, then other prompts that evict every page of it from a small pool: with a host
    tier, turn 2 (turn 1's prompt, reply and a new message) gets turn 1's pages back, their bytes
    those evicted, prefills only what follows, and decodes the tokens of an engine that computes
    the whole prompt (BF16: the cache-free forward's; MTP: the MTP layer's entries come back too);
    without one, it prefills everything. GQA pools (page axis 1), MLA latents, GLM-5's indexer
    keys; BF16, FP8 and tile-scaled FP8 pages (FP8: half the host bytes)."""
    model = mixserve.load(preset, dtype="float32", mtp=mtp)
    options = dict(num_pages=12, page_size=S, max_batch=2, prefill_chunk=8, stop_tokens=(), integrity="check",
                   kv_dtype=kv_dtype, speculative_tokens=2 if mtp else 0, **ONE_STEP_SHAPE)
    first, others, new = tokens(1, 13), [tokens(10 + i, 14) for i in range(3)], 6
    runs = {}
    for host_bytes in (0, 1 << 20):
        e = Engine(model, host_kv_bytes=host_bytes, **options)
        [r1] = e.generate([first], max_new_tokens=new)
        cached_before = dict(e.page_manager._cache)
        evicted_bytes = e.runner.read_pages([page for page, _ in cached_before.values()])
        e.generate(others, max_new_tokens=new)
        assert not set(cached_before) & set(e.page_manager._cache), "turn 1's pages must all be evicted"
        second = first + r1.tokens + tokens(2, 5)
        prefilled = e.counters.prefill_tokens
        [r2] = e.generate([second], max_new_tokens=new)
        runs[host_bytes] = r2
        if not host_bytes:
            assert r2.cached_tokens == 0 and e.host_cache is None
            continue
        hit = written_pages(first + r1.tokens) * S
        assert r2.cached_tokens == e.counters.host_restored_tokens == hit == len(cached_before) * S
        assert e.counters.prefill_tokens - prefilled == len(second) - hit
        restored = e.runner.read_pages([e.page_manager._cache[key][0] for key in cached_before])
        for before, after in zip(evicted_bytes, restored, strict=True):
            for a, b in zip(before, after, strict=True):
                assert a.keys() == b.keys() and all(np.array_equal(a[n], b[n]) for n in a)
        page_bytes = e.host_cache.bytes / len(e.host_cache)
        assert page_bytes == e.bytes_per_token * S, (page_bytes, e.bytes_per_token)
        pt.assert_consistent(e.table)
    fresh = Engine(model, prefix_caching=False, **{**options, "num_pages": 64}).generate([second], max_new_tokens=new)
    assert runs[0].tokens == runs[1 << 20].tokens == fresh[0].tokens
    if kv_dtype == "auto":  # FP8 pages round the KV: the cache-free forward's tokens are the unrounded ones
        assert fresh[0].tokens == greedy_reference(model, second, new)


def test_the_host_tier_is_emptied_with_the_cache_and_refused_where_it_cannot_serve():
    model = mixserve.load("tiny-kimi", dtype="float32")
    options = dict(num_pages=12, page_size=S, max_batch=2, stop_tokens=(), **ONE_STEP_SHAPE)
    e = Engine(model, host_kv_bytes=1 << 20, **options)
    e.generate([tokens(i, 14) for i in range(4)], max_new_tokens=4)
    assert len(e.host_cache) > 0 and e.counters.evicted_pages == e.host_cache.stored_pages
    e.reset_prefix_cache()
    assert len(e.host_cache) == 0 and e.cached_pages == 0
    with pytest.raises(ValueError, match="needs prefix_caching"):
        Engine(model, host_kv_bytes=1 << 20, prefix_caching=False, **options)
    with pytest.raises(ValueError, match="give host_kv_bytes to the prefill engine"):
        DisaggregatedEngine(Engine(model, prefill_only=True, **options), Engine(model, host_kv_bytes=1 << 20, **options))


def test_pages_the_allocation_drops_from_a_full_host_are_computed_instead():
    """Turn 1 leaves 4 pages; a longer prompt evicts its last 3 to a host that holds 4 pages. Turn
    2 finds page 0 on the device and pages 1-3 on the host, but its own allocation evicts 4 more
    pages and more to the host, which drops the 3 (the newest stay): they are prefilled, not restored, and
    the tokens are the cache-free forward's."""
    model = mixserve.load("tiny-kimi", dtype="float32")
    options = dict(num_pages=8, page_size=S, max_batch=2, prefill_chunk=8, stop_tokens=(), integrity="check",
                   **ONE_STEP_SHAPE)
    page_bytes = Engine(model, **options).bytes_per_token * S
    e = Engine(model, host_kv_bytes=4 * page_bytes, **options)
    first, new = tokens(1, 13), 6
    [r1] = e.generate([first], max_new_tokens=new)
    e.generate([tokens(3, 26)], max_new_tokens=2)
    assert e.host_cache.stored_pages == 3 and e.host_cache.dropped_pages == 0
    second = first + r1.tokens + tokens(2, 5)
    prefilled = e.counters.prefill_tokens
    [r2] = e.generate([second], max_new_tokens=new)
    assert e.host_cache.dropped_pages >= 3 and e.counters.host_restored_tokens == 0 and e.host_cache.loaded_pages == 0
    assert r2.cached_tokens == S and e.counters.prefill_tokens - prefilled == len(second) - S
    assert r2.tokens == greedy_reference(model, second, new)
    pt.assert_consistent(e.table)


def test_a_page_keeps_its_routing_rows_beside_its_kv():
    """Routed experts return: a page stored with its rows gives them back with its KV, they count
    in the host's bytes, and a held page stored again keeps its own (those of its KV)."""
    host = HostKVCache(1 << 10, read=lambda ids: [[{"x": np.full(4, i, np.float32)}] for i in ids],
                       write=lambda ids, pages: None)
    rows = [np.full((4, 2, 2), i, np.int16) for i in range(3)]
    host.store([b"a", b"b"], [0, 1], rows[:2])
    assert host.bytes == 2 * (16 + rows[0].nbytes)
    host.store([b"a"], [2], rows[2:])  # held: the host keeps its KV, and so its rows
    assert [r[0, 0, 0] for r in host.load([b"a", b"b"], [5, 6])] == [0, 1]
    host.store([b"c"], [3])  # without rows (no routing returned): None back
    assert host.load([b"c"], [7]) == [None] and host.bytes == 3 * 16 + 2 * rows[0].nbytes


def test_a_restored_prefix_evicted_again_keeps_its_first_pages_longest():
    """The device evicts a prefix's last page first; the host keeps that order for pages it already
    holds too (a restored prefix evicted again), so it drops the prefix's tail, not its head."""
    host = HostKVCache(3 * 4, read=lambda ids: [[{"x": np.zeros(1, np.float32)}] for _ in ids], write=None)
    host.store([b"k3", b"k2", b"k1"], [3, 2, 1])
    host.store([b"k4", b"k3", b"k2", b"k1"], [4, 3, 2, 1])  # k4 new, the others held: k1 newest
    assert host.prefix([b"k1", b"k2", b"k3", b"k4"]) == 3 and b"k4" not in host
