"""Engine.sleep / wake_up: the KV pools' and weights' device memory freed between rollouts for a
trainer on the same devices, and taken back, with nothing lost and nothing compiled again."""

import contextlib
import dataclasses
import http.client
import json
import re
import threading

import jax
import jax.numpy as jnp
import pytest

import mixserve
from mixserve import server
from mixserve.device_memory import buffers, live_bytes
from mixserve.disaggregated import DisaggregatedEngine
from mixserve.engine import EngineBusy, WeightsDiscarded
from mixserve.quantize import plan_for, quantize_model
from models.weights import WeightFormat
from test_engine import engine, greedy_reference
from test_server import FLAGS, get, metrics, post, serving
from test_update_weights import NEW, fresh_prompts


@pytest.fixture(scope="module")
def kimi():
    return mixserve.load("tiny-kimi", dtype="float32"), mixserve.load("tiny-kimi", dtype="float32", seed=1)


def nbytes(tree) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(tree))


def copy_of(model):
    """model on arrays of its own: an engine given it (and nothing else holding it) frees them asleep."""
    return dataclasses.replace(model, params=jax.tree.map(jnp.copy, model.params))


def compiled(e) -> list[int]:
    return [f._cache_size() for f in (e.runner.prefill_step, e.runner.decode_step)]


def outputs(e, rids) -> dict:
    results = {}
    while e.has_work():
        results.update({u.rid: u.result for u in e.step() if u.result is not None})
    return {rid: results[rid].tokens for rid in rids}


def test_sleep_frees_the_pools_and_wake_up_serves_on_from_the_host_tier(kimi):
    """Asleep, the pools are freed (their bytes leave the device), a request submitted
    waits, and sleeping again or with work is refused or a no-op; awake, the waiting request is
    served, a prompt of before comes back from the host tier, the tokens are the cache-free
    forward's, and no step compiled again. Weights someone else holds are let go, not freed, and
    woken as they are."""
    old, _ = kimi
    e, prompts = engine(old, host_kv_bytes=1 << 20), fresh_prompts()
    e.generate(prompts, max_new_tokens=NEW)
    e.generate(fresh_prompts((7,)), max_new_tokens=NEW)  # the waiting request's shapes below
    compiled_before = compiled(e)
    pools, before = nbytes(e.runner.pools), live_bytes()
    freed = e.sleep(tags=("kv_cache",))
    assert freed == pools > 0 and before - live_bytes() == freed
    assert e.asleep == {"kv_cache"} and e.sleep(tags="kv_cache") == 0
    assert e.page_manager.cached == 0 and len(e.host_cache) > 0  # the cached prompt pages went to the host
    waiting = fresh_prompts((7,))[0]
    rid = e.submit(waiting, max_new_tokens=NEW)
    for _ in range(3):
        assert e.step() == [] and e.has_work()
    e.wake_up()
    assert outputs(e, [rid]) == {rid: greedy_reference(old, waiting, NEW)}
    e.generate(fresh_prompts(), max_new_tokens=NEW)  # the first call's shapes
    assert compiled(e) == compiled_before
    again = e.generate(prompts, max_new_tokens=NEW)
    assert [r.tokens for r in again] == [greedy_reference(old, p, NEW) for p in prompts]
    assert all(r.cached_tokens > 0 for r in again) and e.counters.host_restored_tokens > 0
    # its weights are the fixture's arrays, held there: let go asleep, not freed, and taken back
    # awake as they are (no second copy beside the fixture's)
    before = live_bytes()
    assert e.sleep() == pools and e.asleep == {"weights", "kv_cache"}
    e.wake_up()
    assert live_bytes() == before
    assert all(buffers(a) == buffers(b) for a, b in zip(*(jax.tree.leaves(m.params) for m in (e.runner.model, old))))
    assert [r.tokens for r in e.generate(prompts, max_new_tokens=NEW)] == [greedy_reference(old, p, NEW) for p in prompts]
    assert compiled(e) == compiled_before
    e.submit(waiting, max_new_tokens=NEW)
    with pytest.raises(RuntimeError, match="1 requests are unfinished"):
        e.sleep()


def test_level_1_puts_the_weights_in_host_memory_and_level_2_discards_them(kimi):
    """Level 1 frees the weights and pools, and wake_up serves the same tokens from the host copy,
    a part at a time, compiling nothing; level 2 drops the host copy, wake_up is refused (nothing
    woken) until update_weights places new weights, whose tokens are then served. A trainer's
    parameters taken by update_weights stay the trainer's: the next sleep lets go of them
    without deleting them."""
    old, new = kimi
    e, prompts = engine(copy_of(old)), fresh_prompts()  # nothing else holds its weights
    e.generate(prompts, max_new_tokens=NEW)
    compiled_before = compiled(e)
    weights, pools, before = nbytes(e.runner.model.params), nbytes(e.runner.pools), live_bytes()
    freed = e.sleep()
    assert freed == weights + pools and before - live_bytes() == freed
    assert e.asleep == {"weights", "kv_cache"} and e.sleep() == 0
    rid = e.submit(prompts[1], max_new_tokens=NEW)
    e.wake_up("kv_cache")
    assert e.asleep == {"weights"} and e.step() == [] and e.has_work()
    with pytest.raises(RuntimeError, match="asleep: wake_up"):
        e.lowered_decode_text()
    e.wake_up()
    assert outputs(e, [rid]) == {rid: greedy_reference(old, prompts[1], NEW)} and compiled(e) == compiled_before
    assert e.sleep(tags=["weights"]) == weights
    assert e.sleep(level=2) == pools  # the weights went before; their host copy goes now
    with pytest.raises(WeightsDiscarded, match="update_weights first"):
        e.wake_up()
    with pytest.raises(WeightsDiscarded):
        e.wake_up(["weights"])
    assert e.asleep == {"weights", "kv_cache"} and e.sleep(level=1) == 0 and e.weights_discarded
    trainer = copy_of(new)  # an RL trainer's parameters, served as they are
    e.update_weights(trainer)
    assert e.asleep == {"kv_cache"}
    e.wake_up()
    want = [greedy_reference(new, p, NEW) for p in prompts]
    assert [r.tokens for r in e.generate(prompts, max_new_tokens=NEW)] == want and compiled(e) == compiled_before
    assert e.sleep(level=2) == pools  # the trainer's parameters are the trainer's: let go, not freed
    assert not any(x.is_deleted() for x in jax.tree.leaves(trainer.params))
    assert [greedy_reference(trainer, p, NEW) for p in prompts] == want
    e.update_weights(trainer)
    e.wake_up()
    assert [r.tokens for r in e.generate(prompts, max_new_tokens=NEW)] == want
    for level, tags, message in ((0, ["weights"], "level must be 1"), (1, ["weights", "pools"], "tags must be some"),
                                 (2, [], "tags must be some")):
        with pytest.raises(ValueError, match=message):
            e.sleep(level, tags)
    assert not e.sleeping


def test_two_weight_sets_in_their_formats_sleep_and_wake_as_they_were(kimi):
    """FP8-block prefill and INT4 decode weights (the seed's split): through host memory and back,
    each leaf keeps its dtype and placement, the two sets stay two, and the tokens are unchanged."""
    old, _ = kimi
    formats = [plan_for(WeightFormat("fp8_block"), "all"), plan_for(WeightFormat("int4", 16), "experts")]
    e = engine(*(quantize_model(copy_of(old), plan)[0] for plan in formats[:1]),
               decode_model=quantize_model(copy_of(old), formats[1])[0])
    prompts = fresh_prompts()
    want = [r.tokens for r in e.generate(prompts, max_new_tokens=NEW)]
    placed = [(x.dtype, x.sharding) for m in (e.runner.model, e.runner.decode_model) for x in jax.tree.leaves(m.params)]
    assert {"float8_e4m3fn", "int32"} <= {str(dtype) for dtype, _ in placed}  # FP8 values, packed INT4 nibbles
    e.sleep()
    e.wake_up()
    assert e.runner.decode_model is not e.runner.model
    assert [(x.dtype, x.sharding) for m in (e.runner.model, e.runner.decode_model)
            for x in jax.tree.leaves(m.params)] == placed
    assert [r.tokens for r in e.generate(prompts, max_new_tokens=NEW)] == want


def test_new_weights_taken_asleep_serve_once_awake_and_a_pair_sleeps_whole(kimi, monkeypatch):
    """A pair whose two engines serve the same arrays sleeps whole (each array freed once, copied
    to the host once) and wakes sharing them again; a sleep that fails on one side leaves both
    awake; new weights taken asleep are served."""
    old, new = kimi
    served = copy_of(old)
    pair = DisaggregatedEngine(engine(served, prefill_only=True), engine(served))
    del served  # the pair's alone
    prompts = fresh_prompts()
    pair.generate(prompts, max_new_tokens=NEW)
    sides = [jax.tree.leaves(side.runner.model.params) for side in (pair.prefill, pair.decode)]
    assert all(buffers(a) == buffers(b) for a, b in zip(*sides))  # two Array objects, one buffer
    weights, pools = nbytes(sides[0]), nbytes([pair.prefill.runner.pools, pair.decode.runner.pools])
    del sides
    copy_to_host = mixserve.engine.on_host

    def out_of_host_memory_on_the_decode_side(model, made):
        if model is pair.decode.runner.model:
            raise MemoryError("host memory")
        return copy_to_host(model, made)

    monkeypatch.setattr(mixserve.engine, "on_host", out_of_host_memory_on_the_decode_side)
    with pytest.raises(MemoryError):
        pair.sleep()
    assert not pair.prefill.sleeping and not pair.decode.sleeping
    monkeypatch.undo()
    before = live_bytes()
    freed = pair.sleep()
    assert freed == weights + pools and before - live_bytes() == freed
    assert pair.prefill.asleep == pair.decode.asleep == pair.asleep == {"weights", "kv_cache"}
    pair.wake_up()
    shared = [a is b for a, b in zip(*(jax.tree.leaves(side.runner.model.params) for side in (pair.prefill, pair.decode)))]
    assert all(shared) and not pair.sleeping
    assert [r.tokens for r in pair.generate(prompts, max_new_tokens=NEW)] == \
        [greedy_reference(old, p, NEW) for p in prompts]
    pair.sleep(level=2)
    with pytest.raises(WeightsDiscarded):
        pair.wake_up()
    assert pair.prefill.asleep == pair.decode.asleep == {"weights", "kv_cache"}  # neither side woke
    pair.update_weights(copy_of(new))
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
    pair.sleep(tags="kv_cache")
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
    assert outputs(pair, [rid]) == {rid: greedy_reference(new, prompts[1], NEW)}


def sleep_states(s) -> list[str]:
    """The states /metrics' engine_sleep_state marks 1."""
    marked = [name for name, value in metrics(s).items() if name.startswith("engine_sleep_state") and value == 1]
    return [re.search(r'sleep_state="(\w+)"', name)[1] for name in marked]


def test_the_servers_sleep_holds_completions_until_wake_up():
    """vLLM's endpoints: asleep, a completion waits (it is not refused) and is served on wake_up;
    /sleep while one runs is a 409. SGLang's release and resume with --enable-weights-cpu-backup:
    the weights to host memory and back, and a release while a request runs is a 409 too."""
    s = serving(server.make_server([*FLAGS, "--port", "0", "--enable-weights-cpu-backup"]))
    try:
        body = {"prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0}
        status, awake = post(s, body)
        assert status == 200 and get(s, "/is_sleeping") == (200, {"is_sleeping": False}) and sleep_states(s) == ["awake"]
        for path, message in (("/sleep?level=3", "level must be 1"), ("/sleep?level=one", "one integer"),
                              ("/sleep?tags=pools", "tags must be some"), ("/wake_up?level=1", r"unknown query.*\['level'\]")):
            status, error = post(s, {}, path)
            assert status == 400 and re.search(message, error["error"]["message"]), (path, error)
        assert get(s, "/is_sleeping")[1] == {"is_sleeping": False}
        status, reply = post(s, {}, "/sleep?tags=kv_cache")
        assert status == 200 and get(s, "/is_sleeping")[1] == {"is_sleeping": True}
        assert sleep_states(s) == ["kv_cache_freed"]
        assert post(s, {}, "/wake_up?tags=kv_cache") == (200, {}) and get(s, "/is_sleeping")[1] == {"is_sleeping": False}
        runner = s.loop.engine.runner  # read between steps: the loop is idle
        held = nbytes(runner.model.params) + nbytes(runner.pools)
        status, reply = post(s, {}, "/sleep?level=1")  # the server holds its weights nowhere else: all freed
        assert status == 200 and reply["freed_bytes"] == held and get(s, "/is_sleeping")[1] == {"is_sleeping": True}
        assert sleep_states(s) == ["weights_offloaded"]
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
        status, reply = post(s, {"tags": ["cuda_graph", "kv_cache", "weights"]}, "/release_memory_occupation")
        assert status == 200 and reply["freed_bytes"] == held and sleep_states(s) == ["weights_offloaded"], reply
        assert post(s, b"", "/resume_memory_occupation") == (200, {}) and sleep_states(s) == ["awake"]
        assert post(s, body)[1]["choices"][0]["text"] == awake["choices"][0]["text"]
        with contextlib.closing(http.client.HTTPConnection(*s.server_address[:2], timeout=60)) as c:
            c.request("POST", "/v1/completions", json.dumps({**body, "max_tokens": 400, "ignore_eos": True,
                                                             "stream": True}))
            stream = c.getresponse()
            assert stream.readline()  # its headers are read; its first chunk is on its way: it runs
            status, error = post(s, {}, "/sleep")
            assert status == 409 and "unfinished" in error["error"]["message"], error
            status, error = post(s, b"", "/release_memory_occupation")
            assert status == 409 and "unfinished" in error["error"]["message"], error
    finally:
        s.close()
