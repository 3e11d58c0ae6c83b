"""The prefix cache (mixserve/scheduler.py): full pages kept past their requests, evicted least
recently used first, shared by a later identical prefix only under the tag they were cached with,
and only between requests of one cache salt."""

import numpy as np
import pytest

import mixserve
from mixserve import page_table as pt
from mixserve.disaggregated import DisaggregatedEngine
from mixserve.engine import Engine

from test_engine import greedy_reference
from conftest import ONE_STEP_SHAPE

S = 4  # page size


@pytest.fixture(scope="module", params=["tiny-kimi", "tiny-glm4", "tiny-glm5"])
def model(request):
    return mixserve.load(request.param, dtype="float32")


def engine(model, **kw):
    return Engine(model, **{**dict(num_pages=48, page_size=S, max_batch=4, prefill_chunk=8, stop_tokens=(),
                                   integrity="check", **ONE_STEP_SHAPE), **kw})


def tokens(seed, n):
    return [int(t) for t in np.random.default_rng(seed).integers(0, 256, n)]


def written_pages(tokens_of_finished: list[int]) -> int:
    """Full pages a finished request leaves in the cache: its last token was never fed, so the KV
    covers tokens[:-1]."""
    return (len(tokens_of_finished) - 1) // S


def test_the_next_turn_reuses_the_pages_of_the_last_prompt_and_reply(model):
    """Turn 2's prompt is turn 1's prompt, reply and a new message: its prefill computes only what
    the cache lacks, and the tokens stay the cache-free forward's."""
    first, new = tokens(1, 10), 6
    e = engine(model)
    [r1] = e.generate([first], max_new_tokens=new)
    assert r1.cached_tokens == 0 and e.cached_pages == written_pages(first + r1.tokens)  # 15 tokens: 3 pages
    second = first + r1.tokens + tokens(2, 5)
    prefilled = e.counters.prefill_tokens
    [r2] = e.generate([second], max_new_tokens=new)
    hit = written_pages(first + r1.tokens) * S
    assert r2.status == "ok" and r2.cached_tokens == hit == 12
    assert e.counters.prefill_tokens - prefilled == len(second) - hit
    assert r2.tokens == greedy_reference(model, second, new)
    assert (e.counters.prefix_cache_queries, e.counters.prefix_cache_hits) == (len(first) + len(second), hit)
    assert e.free_pages == e.num_pages  # cached pages count as free: nothing leaked
    pt.assert_consistent(e.table)
    off = engine(model, prefix_caching=False)
    off.generate([first], max_new_tokens=new)
    [cold] = off.generate([second], max_new_tokens=new)
    assert cold.cached_tokens == 0 and cold.tokens == r2.tokens and off.cached_pages == 0


def test_eviction_takes_the_least_recently_used_pages_and_a_prefix_tail_first():
    model = mixserve.load("tiny-glm4", dtype="float32")
    e = engine(model, num_pages=8, max_batch=1)
    a, b = tokens(3, 13), tokens(4, 9)  # a leaves 3 full pages (13 + 1 tokens), b 2
    e.generate([a], max_new_tokens=1)
    e.generate([b], max_new_tokens=1)
    assert e.cached_pages == 5 and e.page_manager.free_pages == 3
    # 4 fresh pages for an unrelated prompt: one more than are free, so the least recently used
    # page goes, and of a prefix's pages its last: a's third.
    e.generate([tokens(5, 14)], max_new_tokens=1)
    assert e.counters.evicted_pages == 1
    [again] = e.generate([a], max_new_tokens=1)
    assert again.cached_tokens == 2 * S  # a's first two pages were kept
    # a shares 2 and needs 2 fresh with 1 free: the next in line goes, b's tail (a's own are in use).
    assert e.counters.evicted_pages == 2
    [b_again] = e.generate([b], max_new_tokens=1)
    assert b_again.cached_tokens == S
    cached = e.cached_pages
    assert e.reset_prefix_cache() == cached
    assert e.cached_pages == 0 and e.page_manager.free_pages == e.num_pages
    pt.assert_consistent(e.table)


def test_a_cached_page_reallocated_behind_the_cache_is_never_served():
    """A bookkeeping bug re-stamps a cached page (as if it had been handed to someone else): the
    next request with that prefix is refused the stale page at its hit, drops the entry, and
    computes the prefix; its tokens are the cache-free forward's and nothing aborts."""
    model = mixserve.load("tiny-glm4", dtype="float32")
    e = engine(model)
    prompt, new = tokens(6, 13), 4
    e.generate([prompt], max_new_tokens=new)
    page, tag = list(e.page_manager._cache.values())[-1]  # the prompt's first page: used last (tails go first)
    t = e.page_manager.table
    e.page_manager.table = t.replace(tag_P=t.tag_P.at[page].set(t.next_tag), next_tag=t.next_tag + 1)
    [r] = e.generate([prompt], max_new_tokens=new)
    assert r.status == "ok" and r.cached_tokens == 0
    assert r.tokens == greedy_reference(model, prompt, new)
    assert e.counters.stale_cache_entries == 1 and e.counters.aborts == 0
    # The re-stamped page is no longer the cache's: it leaks (one page of capacity), and every
    # page the table counts evictable is one the cache can evict.
    assert e.free_pages == e.num_pages - 1 and e.cached_pages == e.page_manager.cached
    cached = e.cached_pages
    assert e.reset_prefix_cache() == cached and e.cached_pages == 0 and e.free_pages == e.num_pages - 1


def test_a_freed_cached_page_is_never_served():
    model = mixserve.load("tiny-glm4", dtype="float32")
    e = engine(model)
    prompt, new = tokens(7, 13), 4
    e.generate([prompt], max_new_tokens=new)
    page, _ = list(e.page_manager._cache.values())[-1]
    t = e.page_manager.table
    e.page_manager.table = t.replace(ref_count_P=t.ref_count_P.at[page].set(0))  # freed behind the cache
    [r] = e.generate([prompt], max_new_tokens=new)
    assert r.status == "ok" and r.cached_tokens == 0 and r.tokens == greedy_reference(model, prompt, new)
    assert e.counters.stale_cache_entries == 1


def test_requests_share_cached_pages_only_under_one_cache_salt():
    model = mixserve.load("tiny-kimi", dtype="float32")
    e = engine(model)
    prompt = tokens(8, 11)
    results = {}
    for salt in (None, "tenant-a", "tenant-b", "tenant-a", None):
        [results[salt, len(results)]] = e.generate([prompt], max_new_tokens=2, cache_salt=salt)
    assert [r.cached_tokens for r in results.values()] == [0, 0, 0, 8, 8]
    assert len({tuple(r.tokens) for r in results.values()}) == 1
    [bad] = e.generate([prompt], max_new_tokens=2, cache_salt="")
    assert bad.status == "rejected" and "cache_salt" in bad.reason


def test_a_preempted_request_recomputes_from_its_cached_pages():
    model = mixserve.load("tiny-glm4", dtype="float32")
    ps, new = [tokens(9, 9), tokens(10, 9)], 16
    # 11 pages: both fit after prefill (3 pages each) but not once each feeds its 24th token (6 each).
    e = engine(model, num_pages=11)
    results = e.generate(ps, max_new_tokens=new)
    assert e.counters.preemptions >= 1 and e.counters.shared_pages >= 1
    assert [r.tokens for r in results] == [greedy_reference(model, p, new) for p in ps]
    pt.assert_consistent(e.table)


def test_a_disaggregated_pair_caches_on_both_sides():
    """The prefill server skips a cached prefix; the decode server shares the pages it cached
    itself instead of receiving them again."""
    model = mixserve.load("tiny-kimi", dtype="float32")
    pair = DisaggregatedEngine(engine(model, prefill_only=True), engine(model))
    prompt, new = tokens(11, 13), 4
    [r1] = pair.generate([prompt], max_new_tokens=new)
    sent = pair.counters.pages_sent
    [r2] = pair.generate([prompt], max_new_tokens=new)
    assert r1.tokens == r2.tokens == greedy_reference(model, prompt, new)
    assert r2.cached_tokens == 3 * S and pair.prefill.counters.prefill_tokens == len(prompt) + 1
    assert pair.counters.pages_sent - sent == 1  # the last, partial page; the decode pool had the rest
    assert pair.reset_prefix_cache() > 0 and pair.prefill.cached_pages == pair.decode.cached_pages == 0


def test_cached_pages_carry_the_mtp_layers_entries_to_the_next_turn():
    """With MTP drafts the pages also hold the MTP layer's cache (its entry at position p holds
    token p + 1, so a page's key covers the token after it). Turn 2 drafts from cached entries
    written while turn 1 decoded: every step's drafts are those it makes with every page
    recomputed, and the tokens stay the plain greedy ones."""
    model = mixserve.load("tiny-glm4", dtype="float32", mtp=True)
    first, new = tokens(13, 10), 8
    runs = {}
    for caching in (True, False):
        e = engine(model, speculative_tokens=2, prefix_caching=caching)
        [r1] = e.generate([first], max_new_tokens=new)
        second = first + r1.tokens + tokens(14, 3)
        e.submit(second, max_new_tokens=new)
        drafts, results = [], []
        while e.has_work():
            results += [u.result for u in e.step() if u.result is not None]
            drafts += [(len(r.tokens), list(r.drafts)) for r in e.scheduler.running if r.prefilled]
        runs[caching] = (results[0], drafts)
    (hot, hot_drafts), (cold, cold_drafts) = runs[True], runs[False]
    assert hot.cached_tokens == written_pages(second[: len(first) + new]) * S == 16 and cold.cached_tokens == 0
    assert hot.tokens == cold.tokens == greedy_reference(model, second, new)
    assert hot_drafts == cold_drafts and any(hot_drafts)


def test_a_request_preempted_mid_prefill_caches_only_the_pages_its_chunks_wrote():
    """B is preempted after one prefill chunk of 7 tokens: page 0 is whole, page 1 holds 3 of its
    4 positions. Only page 0 is cached; B comes back, shares it, and computes the rest."""
    model = mixserve.load("tiny-glm4", dtype="float32")
    a, b = tokens(15, 4), tokens(16, 30)
    # 9 pages: a's 1 and b's 8 at admission; a's second token needs a second page, so b (the
    # youngest) is preempted in the first step, right after its first chunk.
    e = engine(model, num_pages=9, max_batch=2, prefill_chunk=7, min_prefill_tokens=7)
    ra = e.submit(a, max_new_tokens=20)
    rb = e.submit(b, max_new_tokens=2)
    results = {}
    e.step()
    assert e.counters.preemptions == 1 and e.cached_pages == 1
    while e.has_work():
        results |= {u.rid: u.result for u in e.step() if u.result is not None}
    assert results[ra].tokens == greedy_reference(model, a, 20)
    assert results[rb].tokens == greedy_reference(model, b, 2)
    assert e.counters.shared_pages == 1 and e.counters.prefill_tokens == 4 + 7 + 30 - S


def test_a_cached_prefix_that_no_longer_fits_a_leaked_pool_is_aborted_not_left_waiting():
    """Pages leaked after a fault, nothing running: a request whose cached prefix it would share
    plus its fresh pages exceed what is left is aborted with the reason, not queued forever."""
    model = mixserve.load("tiny-glm4", dtype="float32")
    e = engine(model, num_pages=8)
    prompt = tokens(17, 13)
    e.generate([prompt], max_new_tokens=1)  # 3 cached pages, 5 free
    table, ok = pt.allocate(e.page_manager.table, 3, 3)  # a bug hands 3 pages to a slot no request holds
    assert ok
    e.page_manager.table = table
    rid = e.submit(prompt + tokens(18, 8), max_new_tokens=1)  # 6 pages: its 3 cached, 3 fresh; 5 left in all
    results = {}
    for _ in range(4):
        results |= {u.rid: u.result for u in e.step() if u.result is not None}
    assert results[rid].status == "aborted" and "KV pool exhausted" in results[rid].reason
    assert not e.has_work()


def test_a_disaggregated_prefill_server_keeps_its_hot_prefix_cached():
    """The prefill engine never releases a request (its pages are handed over), so a hit must
    count as a use there: a prompt hit again outlives an older, colder one."""
    model = mixserve.load("tiny-glm4", dtype="float32")
    pair = DisaggregatedEngine(engine(model, prefill_only=True, num_pages=8), engine(model))
    hot, cold = tokens(19, 13), tokens(20, 9)
    for prompt in (hot, cold, hot):
        pair.generate([prompt], max_new_tokens=1)
    pair.generate([tokens(21, 14)], max_new_tokens=1)  # 4 fresh pages, 3 free: one cached page goes
    assert pair.prefill.counters.evicted_pages == 1
    [again] = pair.generate([hot], max_new_tokens=1)
    assert again.cached_tokens == 3 * S


@pytest.mark.parametrize("policy", ["fcfs", "lpm"])
def test_lpm_admits_the_longest_cached_prefix_first_and_a_preempted_request_before_any(policy):
    model = mixserve.load("tiny-glm4", dtype="float32")
    e = engine(model, max_batch=1, schedule_policy=policy)
    system = tokens(22, 8)  # two full pages
    e.generate([system + tokens(23, 3)], max_new_tokens=1)  # system's pages cached
    plain, half, whole = tokens(24, 11), system[:4] + tokens(25, 7), system + tokens(26, 3)
    order = [e.submit(p, max_new_tokens=2) for p in (plain, half, whole)]
    admitted, results = [], {}  # one slot: a request's first update comes in the step that admits it
    while e.has_work():
        for u in e.step():
            admitted += [u.rid] if u.rid not in admitted else []
            results |= {u.rid: u.result} if u.result is not None else {}
    assert admitted == (order if policy == "fcfs" else [order[2], order[1], order[0]])
    assert [results[rid].cached_tokens for rid in order] == [0, S, 2 * S]
    assert [results[rid].tokens for rid in order] == [greedy_reference(model, p, 2) for p in (plain, half, whole)]
    victim = e.submit(tokens(27, 11), max_new_tokens=2)  # nothing of it cached
    e.scheduler.waiting[0].cache_hit_tokens = 0  # as if admitted once and preempted: it goes first
    e.submit(whole, max_new_tokens=2)
    while not (first := e.step()):  # its prefill takes two chunks of 8
        pass
    assert [u.rid for u in first] == [victim]
    with pytest.raises(ValueError, match="schedule policy"):
        engine(model, schedule_policy="sjf")


def test_lpm_orders_by_arrival_past_its_queue_limit(monkeypatch):
    """Past LPM_MAX_WAITING waiting requests, lpm is first come, first served, in arrival order
    even after an earlier lpm pass reordered the queue."""
    from mixserve import scheduler
    model = mixserve.load("tiny-glm4", dtype="float32")
    e = engine(model, max_batch=1, schedule_policy="lpm")
    system = tokens(28, 8)
    e.generate([system + tokens(29, 3)], max_new_tokens=1)
    prompts = [tokens(30, 11), system + tokens(31, 3), tokens(32, 11)]
    order = [e.submit(p, max_new_tokens=2) for p in prompts]
    e.scheduler._longest_prefix_first()
    assert [r.rid for r in e.scheduler.waiting] == [order[1], order[0], order[2]]  # the cached one first
    monkeypatch.setattr(scheduler, "LPM_MAX_WAITING", 2)
    admitted = []
    while e.has_work():
        admitted += [u.rid for u in e.step() if u.rid not in admitted]
    assert admitted == order


@pytest.mark.parametrize("policy", ["fcfs", "lpm"])
def test_a_request_waiting_for_a_prefix_being_cached_holds_back_others_only_first_come_first_served(policy):
    """A's 3-chunk prefill will cache 4 pages that A2's prompt starts with: A2 waits for them. B,
    behind A2 and sharing nothing, waits too first come, first served; under lpm it is admitted
    beside A. A2 then shares A's pages either way, and every output is the cache-free forward's."""
    model = mixserve.load("tiny-glm4", dtype="float32")
    e = engine(model, schedule_policy=policy)
    system = tokens(40, 4 * S)
    prompts = [system + tokens(41, 6), system + tokens(42, 3), tokens(43, 9)]
    a, a2, b = (e.submit(p, max_new_tokens=2) for p in prompts)
    e.step()
    assert {r.rid for r in e.scheduler.running} == ({a} if policy == "fcfs" else {a, b})
    assert [r.rid for r in e.scheduler.waiting] == ([a2, b] if policy == "fcfs" else [a2])
    results = {}
    while e.has_work():
        results |= {u.rid: u.result for u in e.step() if u.result is not None}
    assert results[a2].cached_tokens == 4 * S
    assert [results[r].tokens for r in (a, a2, b)] == [greedy_reference(model, p, 2) for p in prompts]
