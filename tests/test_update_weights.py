"""Engine.update_weights: new weights of the same model served between two steps, with nothing
compiled again and no KV of the old weights read with the new (the HTTP endpoint:
tests/test_server.py)."""

import contextlib
import dataclasses
import http.client
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mixserve
from mixserve.disaggregated import DisaggregatedEngine
from mixserve.quantize import plan_for, quantize_model
from mixserve import run, server
from models.weights import WeightFormat
from test_engine import engine, greedy_reference
from test_server import PROMPT, Scripted, get, metrics, post, serving

NEW = 6


@pytest.fixture(scope="module")
def kimi():
    """Two weight sets of one model (random, seeds 0 and 1)."""
    return mixserve.load("tiny-kimi", dtype="float32"), mixserve.load("tiny-kimi", dtype="float32", seed=1)


def fresh_prompts(lengths=(5, 11, 14)):
    rng = np.random.default_rng()
    return [[int(t) for t in rng.integers(0, 256, n)] for n in lengths]


def test_new_weights_serve_as_a_fresh_engine_and_compile_nothing(kimi):
    """After an update the tokens are the cache-free forward's of the new weights, the compiled
    decode steps are the same programs, and a prompt the cache held before is computed anew (the
    device cache and the host tier are empty)."""
    old, new = kimi
    e = engine(old, num_pages=24, host_kv_bytes=1 << 20)
    prompts = fresh_prompts()
    assert [r.tokens for r in e.generate(prompts, max_new_tokens=NEW)] == [greedy_reference(old, p, NEW) for p in prompts]
    e.generate(fresh_prompts((14, 14, 14, 14)), max_new_tokens=NEW)  # pushes some of prompts' pages to the host
    assert e.cached_pages > 0 and len(e.host_cache) > 0
    compiled = [f._cache_size() for f in (e.runner.decode_step, e.runner.prefill_step)]
    # as a trainer may hand them over: committed to a device, and a leaf of weak type
    handed = jax.device_put(new.params, jax.devices()[0])
    norm = handed["norm"]["scale"]
    assert np.all(np.asarray(norm) == 1)  # initialized to ones: the same values, made of a Python scalar
    handed["norm"]["scale"] = jax.device_put(jnp.broadcast_to(jnp.array(1.0), norm.shape), jax.devices()[0])
    assert handed["norm"]["scale"].weak_type and handed["norm"]["scale"].committed
    assert e.update_weights(dataclasses.replace(new, params=handed)) == 0  # nothing was running
    assert e.cached_pages == 0 and len(e.host_cache) == 0 and e.page_manager.cached == 0
    results = e.generate(prompts, max_new_tokens=NEW)
    assert [r.tokens for r in results] == [greedy_reference(new, p, NEW) for p in prompts]
    assert [r.cached_tokens for r in results] == [0, 0, 0]
    assert [f._cache_size() for f in (e.runner.decode_step, e.runner.prefill_step)] == compiled
    assert all(x.sharding == y.sharding for x, y in zip(jax.tree.leaves(e.runner.model.params),
                                                         jax.tree.leaves(old.params)))


def test_each_shape_compiles_once_before_and_after_an_update(kimi):
    """A fresh engine's pools and params are committed as its steps return them, so the second
    call of a shape finds the first's program, and new weights change nothing of that."""
    old, new = kimi
    e, prompts = engine(old, num_pages=40), fresh_prompts()

    def sizes():
        e.generate(prompts, max_new_tokens=NEW)
        e.reset_prefix_cache()  # the same shapes each time: whole prompts
        return [f._cache_size() for f in (e.runner.prefill_step, e.runner.decode_step)]

    first = sizes()
    assert sizes() == first
    e.update_weights(new)
    assert sizes() == first


def pair(model, **kw):
    return DisaggregatedEngine(engine(model, prefill_only=True, **kw), engine(model, **kw))


@pytest.fixture(scope="module")
def kimi_mtp():
    return tuple(mixserve.load("tiny-kimi", dtype="float32", seed=seed, mtp=True) for seed in (0, 1))


@pytest.mark.parametrize("kind", ["engine", "pair", "mtp"])
@pytest.mark.parametrize("running", ["recompute", "abort"])
def test_running_requests_are_recomputed_or_aborted_and_waiting_ones_run_on_the_new_weights(kimi, kimi_mtp, kind,
                                                                                            running):
    """Two slots, three requests, two steps: two run with tokens of the old weights and the third
    waits (a pair's prefill side has begun it: it runs there, with KV of the old weights). With MTP
    drafts their greedy tokens are the same, and the drafts of the old MTP layer are dropped.
    "recompute" keeps each running request's tokens and continues it greedily under the new
    weights from its prompt and output so far; "abort" ends it with the reason and the tokens it
    had. A request that was not running is the new weights' alone. Each Result's weight_versions
    says where the new weights' tokens begin."""
    old, new = kimi_mtp if kind == "mtp" else kimi  # mtp: the MTP layer drafts 2 tokens a step
    e = pair(old, max_batch=2) if kind == "pair" else engine(old, max_batch=2, speculative_tokens=2 * (kind == "mtp"))
    sides = [e.prefill, e.decode] if kind == "pair" else [e]
    prompts = fresh_prompts()
    rids = [e.submit(p, max_new_tokens=NEW) for p in prompts]
    got = {rid: [] for rid in rids}
    for _ in range(2):
        for u in e.step():
            got[u.rid] += u.new_tokens
    before = {rid: list(tokens) for rid, tokens in got.items()}
    was_running = {r.rid for side in sides for r in side.scheduler.running}
    assert {rids[0], rids[1]} <= was_running and all(before[r] for r in rids[:2]) and not before[rids[2]]
    assert (rids[2] in was_running) == (kind == "pair")
    assert e.update_weights(new, running=running, version="step-1") == len(was_running)
    assert e.weight_version == "step-1"
    results = {}
    while e.has_work():
        for u in e.step():
            got[u.rid] += u.new_tokens
            if u.result is not None:
                results[u.rid] = u.result
    for rid, prompt in zip(rids, prompts):
        kept = before[rid]
        if rid in was_running and running == "abort":
            assert results[rid].status == "aborted" and results[rid].reason == "the weights were updated"
            assert results[rid].tokens == got[rid] == kept
            assert results[rid].weight_versions == [(0, "default")]
        else:
            assert results[rid].status == "ok"
            assert got[rid] == kept + greedy_reference(new, prompt + kept, NEW - len(kept))
            assert results[rid].weight_versions == [(0, "default")] * bool(kept) + [(len(kept), "step-1")]


def test_each_update_mid_request_starts_a_weight_version_span(kimi):
    """An unnamed update keeps the name and still splits the spans; two updates with no token
    between them leave one span, the last's; a request that ends before the new weights give it
    a token has no span of theirs."""
    old, new = kimi
    e = engine(old)
    rid = e.submit(fresh_prompts()[0], max_new_tokens=NEW)
    req = e._unreported[rid]
    while not req.out:
        e.step()
    first = len(req.out)
    e.update_weights(new)
    while len(req.out) == first:
        e.step()
    second = len(req.out)
    e.update_weights(old, version="v2")
    e.update_weights(new, version="v3")
    while e.has_work():
        result = next((u.result for u in e.step() if u.result is not None), None)
    assert e.weight_version == "v3" and 0 < first < second < NEW
    assert result.weight_versions == [(0, "default"), (first, "default"), (second, "v3")]
    rid = e.submit(fresh_prompts()[1], max_new_tokens=NEW)
    while not e._unreported[rid].out:
        e.step()
    e.update_weights(old, version="v4")
    e.cancel(rid)
    [update] = e.step()
    assert update.result.status == "aborted" and update.result.weight_versions == [(0, "v3")]


def test_abort_ends_a_preempted_request_too_and_the_cache_lets_go_of_mapped_pages(kimi):
    """A request preempted before the update waits with tokens of the old weights: "abort" ends
    it like the running ones. forget_cache drops entries whose pages a request still maps (its
    hold given up, the page freed with the request: no page leaks)."""
    old, new = kimi
    e = engine(old, max_batch=2)
    prompts = fresh_prompts()
    rids = [e.submit(p, max_new_tokens=NEW) for p in prompts]
    for _ in range(3):
        e.step()
    [first, second] = e.scheduler.running
    assert e.page_manager.cached > 0  # their full prompt pages, mapped and cached
    e.page_manager.forget_cache()
    assert e.page_manager.cached == 0
    e.scheduler.preempt_all()  # as make_room_for_decode would preempt them for pages
    assert e.scheduler.admit(1) == [first]  # readmitted; the second waits with its tokens, the third new
    assert e.update_weights(new, running="abort") == 2
    assert e.page_manager.cached == 0
    results = {}
    while e.has_work():
        results.update({u.rid: u.result for u in e.step() if u.result is not None})
    assert [results[r].status for r in rids] == ["aborted", "aborted", "ok"] and first.out and second.out
    assert results[rids[2]].tokens == greedy_reference(new, prompts[2], NEW)
    assert e.free_pages == e.num_pages  # cached pages (the third's) count free: none leaked


def test_weights_of_another_model_format_or_shape_are_refused_and_change_nothing(kimi):
    """Each refusal names what differs; the engine then serves its old weights, a request running
    across the refusals included."""
    old, new = kimi
    e = engine(old)
    prompt = fresh_prompts((11,))[0]
    rid = e.submit(prompt, max_new_tokens=NEW)
    e.step()
    glm = mixserve.load("tiny-glm4", dtype="float32")
    int4, _ = quantize_model(new, plan_for(WeightFormat("int4", 16), "experts"))
    embed = new.params["embed_tokens"]["embedding"]
    cut = dataclasses.replace(new, params={**new.params, "embed_tokens": {"embedding": embed[:, :-1]}})
    refusals = [
        (dict(model=mixserve.load("tiny-kimi", seed=1)), "its dtype is 'bfloat16', the served model's 'float32'"),
        (dict(model=glm), "its family is 'glm4_moe', the served model's 'deepseek_v3'"),
        (dict(model=int4), "its plan is"),
        (dict(model=cut), r"\['embed_tokens'\]\['embedding'\] is float32\[320, 63\], the served model's float32\[320, 64\]"),
        (dict(model=new, decode_model=new), "serves one weight set"),
        (dict(model=new, running="keep"), "running must be one of"),
    ]
    for kwargs, message in refusals:
        with pytest.raises(ValueError, match=message):
            e.update_weights(**kwargs)
    results = {}
    while e.has_work():
        results.update({u.rid: u.result for u in e.step() if u.result is not None})
    assert results[rid].tokens == greedy_reference(old, prompt, NEW)


def test_an_engine_of_two_weight_sets_takes_both(kimi):
    """FP8-block prefill weights and INT4 decode weights (the seed's split): both swapped, the
    tokens those of a fresh engine on the new pair; one set alone is refused."""
    old, new = kimi
    formats = [plan_for(WeightFormat("fp8_block"), "all"), plan_for(WeightFormat("int4", 16), "experts")]
    old_sets, new_sets = ([quantize_model(m, plan)[0] for plan in formats] for m in (old, new))
    e = engine(old_sets[0], decode_model=old_sets[1])
    with pytest.raises(ValueError, match="give decode_model too"):
        e.update_weights(new_sets[0])
    same = engine(old, decode_model=old)  # one set, given twice: held once, and taken alone
    assert same.runner.decode_model is same.runner.model and same.update_weights(new) == 0
    prompts = fresh_prompts()
    e.update_weights(new_sets[0], decode_model=new_sets[1])
    want = engine(new_sets[0], decode_model=new_sets[1]).generate(prompts, max_new_tokens=NEW)
    assert [r.tokens for r in e.generate(prompts, max_new_tokens=NEW)] == [r.tokens for r in want]


@pytest.mark.parametrize("kind", ["engine", "pair"])
def test_the_new_weights_calibrated_fp8_kv_scales_replace_the_served_checkpoints(kind):
    """A GQA model whose checkpoint ships FP8 KV scales writes its FP8 pools with them; new
    weights bring their own (all KV is recomputed), as a fresh engine on them would use, or are
    refused without any. A pair (BF16 prefill pool, FP8 decode pool: the seed's split) converts
    the pages it hands over by the new scales too."""
    glm = [mixserve.load("tiny-glm4", dtype="float32", seed=seed) for seed in (0, 1)]
    layers = glm[0].config.num_layers
    rng = np.random.default_rng()
    old, new = (dataclasses.replace(m, kv_scales=tuple(rng.uniform(0.01, 0.05, layers).astype(np.float32)
                                                       for _ in range(2))) for m in glm)

    def build(model):
        if kind == "engine":
            return engine(model, kv_dtype="fp8_e4m3")
        return DisaggregatedEngine(engine(model, kv_dtype="bfloat16", prefill_only=True),
                                   engine(model, kv_dtype="fp8_e4m3"))

    e, prompts = build(old), fresh_prompts()
    e.generate(prompts, max_new_tokens=NEW)
    with pytest.raises(ValueError, match="the new weights ship none"):
        e.update_weights(glm[1])
    e.update_weights(new)
    fresh = build(new)
    decoders = (e, fresh) if kind == "engine" else (e.decode, fresh.decode)
    assert decoders[0].kv_scales_from_checkpoint
    for mine, want in zip(decoders[0].runner.scales, decoders[1].runner.scales):
        np.testing.assert_array_equal(np.asarray(mine), np.asarray(want))
    assert [r.tokens for r in e.generate(prompts, max_new_tokens=NEW)] == \
        [r.tokens for r in fresh.generate(prompts, max_new_tokens=NEW)]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Two checkpoints of one tiny Kimi (seeds 0 and 1) and one of a tiny GLM, as transformers saves them."""
    import hf_reference

    dirs = {}
    for key, name, seed in (("a", "kimi-yarn-groups", 0), ("b", "kimi-yarn-groups", 1), ("glm", "glm4-plain", 0)):
        dirs[key] = str(tmp_path_factory.mktemp(key))
        # byte tokens are ids < 256; room for a request that runs until an update aborts it
        hf_reference.save(hf_reference.build(name, seed, vocab_size=320, max_position_embeddings=4096), dirs[key])
    return dirs


def test_update_weights_from_disk_serves_the_new_checkpoint_and_refuses_another_model(checkpoints):
    """SGLang's endpoint: after it, a completion is what mixserve.run serves on the new checkpoint
    with the same flags, and the prompt the cache held before is computed anew. A missing
    directory, an unknown field, bad values and another model's checkpoint are 400s that change
    nothing. With abort_all_requests a streamed request running on the old weights ends with an
    error event; weight_version is reported."""
    flags = ["--page-size", "4", "--concurrency", "2"]
    new = run.main(["--model", checkpoints["b"], *flags, "--prompt", PROMPT, "--max-new-tokens", "6", "--ignore-eos",
                    "--json"])["requests"][0]["tokens"]
    s = serving(server.make_server(["--model", checkpoints["a"], *flags, "--port", "0"]))
    try:
        body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "ignore_eos": True, "return_token_ids": True}

        def complete():
            status, reply = post(s, body)
            assert status == 200, reply
            return reply["choices"][0]["token_ids"], reply["usage"]["prompt_tokens_details"]["cached_tokens"]

        def update(**fields):
            return post(s, fields, "/update_weights_from_disk")

        old, _ = complete()
        assert complete() == (old, 12) and old != new  # 3 pages of 4 cached
        status, reply = update(model_path=checkpoints["b"], weight_version="step-1", load_format="auto")
        assert status == 200 and reply["success"] and reply["num_requests"] == 0, reply
        assert get(s, "/get_weight_version") == (200, {"weight_version": "step-1"})
        assert complete() == (new, 0)
        status, reply = post(s, body)
        assert reply["metadata"] == {"weight_version": "step-1"} and reply["choices"][0]["weight_versions"] == \
            [[0, "step-1"]], reply
        for fields, message in (({"model_path": "/nowhere"}, "must be a checkpoint directory"),
                                ({"model_path": checkpoints["a"], "strict": True}, r"unknown fields \['strict'\]"),
                                ({"model_path": checkpoints["a"], "abort_all_requests": "yes"}, "must be a boolean"),
                                ({"model_path": checkpoints["a"], "flush_cache": False}, "flush_cache must be true"),
                                ({"model_path": checkpoints["a"], "load_format": "pt"}, "load_format must be auto"),
                                ({"model_path": checkpoints["a"], "weight_version": ""}, "a non-empty string"),
                                ({"model_path": checkpoints["glm"]}, "its family is 'glm4_moe'")):
            status, error = update(**fields)
            assert status == 400 and re.search(message, error["error"]["message"]), error
        assert complete() == (new, 12)
        assert get(s, "/get_weight_version")[1] == {"weight_version": "step-1"}
        with contextlib.closing(http.client.HTTPConnection(*s.server_address[:2], timeout=120)) as c:
            c.request("POST", "/v1/completions", json.dumps({**body, "max_tokens": 4000, "stream": True}))
            stream = c.getresponse()
            assert stream.status == 200
            while not (line := stream.readline()).startswith(b"data:"):  # its first chunk: it runs
                assert line, "the stream ended before its first chunk"
            status, reply = update(model_path=checkpoints["a"], abort_all_requests=True)
            assert status == 200 and reply["num_requests"] == 1 and "aborted" in reply["message"], reply
            rest = stream.read().decode()
        assert "the weights were updated" in rest and rest.rstrip().endswith("data: [DONE]")
        assert complete() == (old, 0)
        # an RL step on shared devices: the weights discarded while the trainer runs, the new ones
        # loaded into the memory they freed, then the KV pools
        status, reply = post(s, {}, "/sleep?level=2")
        assert status == 200 and reply["freed_bytes"] > 0, reply
        assert metrics(s)['engine_sleep_state{role="engine",sleep_state="discard_all"}'] == 1
        status, error = post(s, {}, "/wake_up")
        assert status == 409 and "update_weights first" in error["error"]["message"], error
        status, reply = update(model_path=checkpoints["b"], weight_version="step-2")
        assert status == 200 and get(s, "/is_sleeping")[1] == {"is_sleeping": True}, reply  # the pools still are
        assert post(s, {}, "/wake_up") == (200, {})
        assert complete() == (new, 0)
        # The same step through SGLang's endpoints (verl's and slime's order): release everything,
        # resume the weights (discarded: they come with the update), update, resume the KV cache.
        for fields, message in (({"tags": ["pools"]}, "tags must be a non-empty list"), ({"tags": "weights"}, "list"),
                                ({"tags": []}, "non-empty"), ({"level": 1}, r"unknown fields \['level'\]")):
            status, error = post(s, fields, "/release_memory_occupation")
            assert status == 400 and re.search(message, error["error"]["message"]), error
        assert get(s, "/is_sleeping")[1] == {"is_sleeping": False}
        status, reply = post(s, b"", "/release_memory_occupation")  # no body: every tag
        assert status == 200 and reply["freed_bytes"] > 0, reply
        assert metrics(s)['engine_sleep_state{role="engine",sleep_state="discard_all"}'] == 1
        assert post(s, {"tags": ["weights"]}, "/resume_memory_occupation") == (200, {})
        assert metrics(s)['engine_sleep_state{role="engine",sleep_state="discard_all"}'] == 1  # nothing to wake
        status, reply = update(model_path=checkpoints["a"])
        assert status == 200 and get(s, "/is_sleeping")[1] == {"is_sleeping": True}, reply
        assert post(s, {"tags": ["kv_cache", "cuda_graph"]}, "/resume_memory_occupation") == (200, {})
        assert get(s, "/is_sleeping")[1] == {"is_sleeping": False} and complete() == (old, 0)
    finally:
        s.close()


def test_a_between_steps_call_given_up_on_never_runs():
    """A call the HTTP thread stopped waiting for (its client told it failed) is skipped by the
    loop; one the loop has started cannot be given up on; one that ends the loop tells its caller."""
    loop, ran = server.EngineLoop(Scripted("x")), []
    try:
        given_up = server.Between(lambda e: ran.append("given up"))
        assert given_up.drop()
        loop.submit(given_up)
        loop.between_steps(lambda e: ran.append("next"))  # after it in the inbox
        assert ran == ["next"]
        started = server.Between(lambda e: None)
        assert started.start() and not started.drop()

        def stop(e):
            raise SystemExit("stop")

        with pytest.raises(server.BadRequest, match="the engine stopped: SystemExit"):  # its caller is told
            loop.between_steps(stop)
        loop.join()
        assert not loop.alive
    finally:
        loop.close()
