"""Engine.sleep / wake_up: the KV pools' device memory freed between rollouts for a trainer on
the same devices, and taken back, with nothing lost and nothing compiled again."""

import contextlib
import http.client
import json
import threading

import jax
import pytest

import mixserve
from mixserve import server
from mixserve.disaggregated import DisaggregatedEngine
from mixserve.engine import EngineBusy
from test_engine import engine, greedy_reference
from test_server import FLAGS, get, post, serving
from test_update_weights import NEW, fresh_prompts


@pytest.fixture(scope="module")
def kimi():
    return mixserve.load("tiny-kimi", dtype="float32"), mixserve.load("tiny-kimi", dtype="float32", seed=1)


def live_bytes() -> int:
    return sum(x.nbytes for x in jax.live_arrays())


def test_sleep_frees_the_pools_and_wake_up_serves_on_from_the_host_tier(kimi):
    """Asleep, the pools are deleted (their bytes leave the live arrays), a request submitted
    waits, and sleeping again or with work is refused or a no-op; awake, the waiting request is
    served, a prompt of before comes back from the host tier, the tokens are the cache-free
    forward's, and no step compiled again."""
    old, _ = kimi
    e, prompts = engine(old, host_kv_bytes=1 << 20), fresh_prompts()
    e.generate(prompts, max_new_tokens=NEW)
    e.generate(fresh_prompts((7,)), max_new_tokens=NEW)  # the waiting request's shapes below
    compiled = [f._cache_size() for f in (e.runner.prefill_step, e.runner.decode_step)]
    pools, before = jax.tree.leaves(e.runner.pools), live_bytes()
    freed = e.sleep()
    assert freed == sum(x.nbytes for x in pools) > 0 and all(x.is_deleted() for x in pools)
    assert before - live_bytes() >= freed and e.sleeping and e.sleep() == 0
    assert e.page_manager.cached == 0 and len(e.host_cache) > 0  # the cached prompt pages went to the host
    waiting = fresh_prompts((7,))[0]
    rid = e.submit(waiting, max_new_tokens=NEW)
    for _ in range(3):
        assert e.step() == [] and e.has_work()
    e.wake_up()
    results = {}
    while e.has_work():
        results.update({u.rid: u.result for u in e.step() if u.result is not None})
    assert results[rid].tokens == greedy_reference(old, waiting, NEW)
    e.generate(fresh_prompts(), max_new_tokens=NEW)  # the first call's shapes
    assert [f._cache_size() for f in (e.runner.prefill_step, e.runner.decode_step)] == compiled
    again = e.generate(prompts, max_new_tokens=NEW)
    assert [r.tokens for r in again] == [greedy_reference(old, p, NEW) for p in prompts]
    assert all(r.cached_tokens > 0 for r in again) and e.counters.host_restored_tokens > 0
    e.submit(waiting, max_new_tokens=NEW)
    with pytest.raises(RuntimeError, match="1 requests are unfinished"):
        e.sleep()


def test_new_weights_taken_asleep_serve_once_awake_and_a_pair_sleeps_whole(kimi):
    old, new = kimi
    pair = DisaggregatedEngine(engine(old, prefill_only=True), engine(old))
    prompts = fresh_prompts()
    pair.generate(prompts, max_new_tokens=NEW)
    assert pair.sleep() > 0 and pair.prefill.sleeping and pair.decode.sleeping
    pair.update_weights(new)
    pair.wake_up()
    assert [r.tokens for r in pair.generate(prompts, max_new_tokens=NEW)] == \
        [greedy_reference(new, p, NEW) for p in prompts]
    pair.submit(prompts[0], max_new_tokens=NEW)
    pair.step()  # prefilled, waiting for the decode side or decoding
    with pytest.raises(EngineBusy, match="engine has unfinished requests"):
        pair.sleep()
    assert not pair.prefill.sleeping and not pair.decode.sleeping
    while pair.has_work():
        pair.step()
    # a wake_up that fails on one side (out of memory: a trainer still holds it) leaves the pair
    # asleep, its steps doing nothing, until a wake_up that succeeds
    pair.sleep()
    make = pair.decode.runner.new_pools
    pair.decode.runner.new_pools = lambda: (_ for _ in ()).throw(MemoryError("held by the trainer"))
    with pytest.raises(MemoryError):
        pair.wake_up()
    assert pair.sleeping and not pair.prefill.sleeping
    rid = pair.submit(prompts[1], max_new_tokens=NEW)
    assert pair.step() == [] and pair.has_work()
    with pytest.raises(RuntimeError, match="asleep: wake_up"):
        pair.generate(prompts, max_new_tokens=NEW)
    pair.decode.runner.new_pools = make
    pair.wake_up()
    results = {}
    while pair.has_work():
        results.update({u.rid: u.result for u in pair.step() if u.result is not None})
    assert results[rid].tokens == greedy_reference(new, prompts[1], NEW)


def test_the_servers_sleep_holds_completions_until_wake_up():
    """vLLM's endpoints: asleep, a completion waits (it is not refused) and is served on wake_up;
    /sleep while one runs is a 409."""
    s = serving(server.make_server([*FLAGS, "--port", "0"]))
    try:
        body = {"prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0}
        status, awake = post(s, body)
        assert status == 200 and get(s, "/is_sleeping") == (200, {"is_sleeping": False})
        status, reply = post(s, {}, "/sleep")
        assert status == 200 and reply["freed_bytes"] > 0 and get(s, "/is_sleeping")[1] == {"is_sleeping": True}
        got = {}
        waiter = threading.Thread(target=lambda: got.update(zip(("status", "reply"), post(s, body))))
        waiter.start()
        waiter.join(timeout=2.0)
        assert waiter.is_alive()  # held while asleep
        assert post(s, {}, "/wake_up") == (200, {})
        waiter.join(timeout=60)
        assert got["status"] == 200 and got["reply"]["choices"][0]["text"] == awake["choices"][0]["text"]
        assert post(s, {}, "/sleep")[0] == 200
        status, error = post(s, {**body, "prompt": [5, 6, 99999]})  # asleep, bad input is still a 400 at once
        assert status == 400 and "99999" in error["error"]["message"], error
        assert post(s, {}, "/wake_up") == (200, {})
        with contextlib.closing(http.client.HTTPConnection(*s.server_address[:2], timeout=60)) as c:
            c.request("POST", "/v1/completions", json.dumps({**body, "max_tokens": 400, "ignore_eos": True,
                                                             "stream": True}))
            stream = c.getresponse()
            assert stream.readline()  # its headers are read; its first chunk is on its way: it runs
            status, error = post(s, {}, "/sleep")
            assert status == 409 and "unfinished" in error["error"]["message"], error
    finally:
        s.close()
