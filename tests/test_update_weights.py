"""Engine.update_weights: new weights of the same model served between two steps, with nothing
compiled again and no KV of the old weights read with the new (the HTTP endpoint:
tests/test_server.py)."""

import dataclasses
import re

import jax
import numpy as np
import pytest

import mixserve
from mixserve.disaggregated import DisaggregatedEngine
from mixserve.quantize import plan_for, quantize_model
from mixserve import run, server
from models.weights import WeightFormat
from test_engine import engine, greedy_reference
from test_server import PROMPT, post, serving

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
    compiled = e.runner.decode_step._cache_size()
    assert e.update_weights(new) == 0  # nothing was running
    assert e.cached_pages == 0 and len(e.host_cache) == 0
    results = e.generate(prompts, max_new_tokens=NEW)
    assert [r.tokens for r in results] == [greedy_reference(new, p, NEW) for p in prompts]
    assert [r.cached_tokens for r in results] == [0, 0, 0]
    assert e.runner.decode_step._cache_size() == compiled
    assert all(x.sharding == y.sharding for x, y in zip(jax.tree.leaves(e.runner.model.params),
                                                         jax.tree.leaves(old.params)))


def pair(model, **kw):
    return DisaggregatedEngine(engine(model, prefill_only=True, **kw), engine(model, **kw))


@pytest.mark.parametrize("kind", ["engine", "pair"])
@pytest.mark.parametrize("running", ["recompute", "abort"])
def test_running_requests_are_recomputed_or_aborted_and_waiting_ones_run_on_the_new_weights(kimi, kind, running):
    """Two slots, three requests, two steps: two run with tokens of the old weights and the third
    waits (a pair's prefill side has begun it: it runs there, with KV of the old weights).
    "recompute" keeps each running request's tokens and continues it greedily under the new
    weights from its prompt and output so far; "abort" ends it with the reason and the tokens it
    had. A request that was not running is the new weights' alone."""
    old, new = kimi
    e = engine(old, max_batch=2) if kind == "engine" else pair(old, max_batch=2)
    sides = [e] if kind == "engine" else [e.prefill, e.decode]
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
    assert e.update_weights(new, running=running) == len(was_running)
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
        else:
            assert results[rid].status == "ok"
            assert got[rid] == kept + greedy_reference(new, prompt + kept, NEW - len(kept))


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
    assert e.runner.model.params is old.params


def test_an_engine_of_two_weight_sets_takes_both(kimi):
    """FP8-block prefill weights and INT4 decode weights (the seed's split): both swapped, the
    tokens those of a fresh engine on the new pair; one set alone is refused."""
    old, new = kimi
    formats = [plan_for(WeightFormat("fp8_block"), "all"), plan_for(WeightFormat("int4", 16), "experts")]
    old_sets, new_sets = ([quantize_model(m, plan)[0] for plan in formats] for m in (old, new))
    e = engine(old_sets[0], decode_model=old_sets[1])
    with pytest.raises(ValueError, match="give decode_model too"):
        e.update_weights(new_sets[0])
    prompts = fresh_prompts()
    e.update_weights(new_sets[0], decode_model=new_sets[1])
    want = engine(new_sets[0], decode_model=new_sets[1]).generate(prompts, max_new_tokens=NEW)
    assert [r.tokens for r in e.generate(prompts, max_new_tokens=NEW)] == [r.tokens for r in want]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Two checkpoints of one tiny Kimi (seeds 0 and 1) and one of a tiny GLM, as transformers saves them."""
    import hf_reference

    dirs = {}
    for key, name, seed in (("a", "kimi-yarn-groups", 0), ("b", "kimi-yarn-groups", 1), ("glm", "glm4-plain", 0)):
        dirs[key] = str(tmp_path_factory.mktemp(key))
        hf_reference.save(hf_reference.build(name, seed, vocab_size=320), dirs[key])  # byte tokens are ids < 256
    return dirs


def test_update_weights_from_disk_serves_the_new_checkpoint_and_refuses_another_model(checkpoints):
    """SGLang's endpoint: after it, a completion is what mixserve.run serves on the new checkpoint
    with the same flags, and the prompt the cache held before is computed anew. A missing
    directory, an unknown field, a bad type and another model's checkpoint are 400s that change
    nothing."""
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

        old, _ = complete()
        assert complete() == (old, 12) and old != new  # 3 pages of 4 cached
        status, reply = post(s, {"model_path": checkpoints["b"]}, "/update_weights_from_disk")
        assert status == 200 and reply["success"] and reply["num_running_requests"] == 0, reply
        assert complete() == (new, 0)
        for fields, message in (({"model_path": "/nowhere"}, "must be a checkpoint directory"),
                                ({"model_path": checkpoints["a"], "flush_cache": True}, r"unknown fields \['flush_cache'\]"),
                                ({"model_path": checkpoints["a"], "abort_all_requests": "yes"}, "must be a boolean"),
                                ({"model_path": checkpoints["glm"]}, "its family is 'glm4_moe'")):
            status, error = post(s, fields, "/update_weights_from_disk")
            assert status == 400 and re.search(message, error["error"]["message"]), error
        assert complete() == (new, 12)
        status, reply = post(s, {"model_path": checkpoints["a"], "abort_all_requests": True}, "/update_weights_from_disk")
        assert status == 200 and "aborted" in reply["message"]
        assert complete() == (old, 0)
    finally:
        s.close()
