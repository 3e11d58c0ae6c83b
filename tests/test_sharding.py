"""Tensor-parallel serving: the engine over 8 CPU devices (XLA's host device count) serves the
tokens of one device, with weights and GQA KV heads split, no weight gathered, and the Pallas
kernels run per device. Each test runs a script in a subprocess: the device count is fixed when
JAX starts."""

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mixserve.quantize import plan_for, quantize_checkpoint
from mixserve.sharding import tp_mesh
from models.partitioning import quantized_spec
from models.weights import Fp8BlockWeight, Int4Weight, WeightFormat, split_for_tp
from conftest import host_devices_env

PRELUDE = """
import dataclasses, re
import jax, numpy as np, pytest
import mixserve
from mixserve import run, sharding
from mixserve.engine import Engine
from mixserve.sampling import Sampling
from mixserve.quantize import plan_for, quantize_model
from mixserve.weight_bytes import device_bytes
from models.weights import WeightFormat
assert jax.device_count() == 8
rng = np.random.default_rng(0)
prompts = [[int(t) for t in rng.integers(0, 256, n)] for n in (5, 11, 1, 14)]
# One decode row count and one prefill shape: fewer shapes to compile (tested elsewhere).
kw = dict(kv_dtype="fp8_e4m3", page_size=4, kv_memory_bytes=64 << 10, max_batch=4, prefill_chunk=8,
          stop_tokens=(), integrity="check", min_decode_rows=4, min_prefill_tokens=8, min_prefill_rows=4)
CASES = (("tiny-glm4", 2), ("tiny-kimi", 4), ("tiny-glm5", 4))
mesh_for = lambda tp: jax.make_mesh((8 // tp, tp), ("data", "model"))  # Explicit axes: the engine makes them Auto


def assert_no_weight_gathered(engine, label, prefill=False):
    # The step's collectives move activations (and, in prefill, the rows' pages) only: no all-gather
    # yields a split weight or a whole split pool.
    r, z, sampling = engine.runner, np.zeros(4, np.int32), Sampling.greedy(4)
    with jax.set_mesh(engine.mesh):
        if prefill:
            step = r.prefill_step.lower(r.model.params, r.pools, r.scales, engine.table, z, z, z,
                                        np.zeros((4, 8), np.int32), sampling, None, None, None, width=4)
        else:
            step = r.decode_step.lower(r.decode_model.params, r.pools, r.scales, engine.table, z, z, z,
                                       np.zeros((4, 1), np.int32), width=4)
        text = step.compile().as_text()
    gathered = {tuple(int(d) for d in m.group(1).split(",") if d)
                for m in re.finditer(r"= \\w+\\[([\\d,]*)\\][^ ]* all-gather", text)}
    params = r.model.params if prefill else r.decode_model.params
    split_shapes = {x.shape for x in jax.tree.leaves((params, engine.runner.pools)) if not x.sharding.is_fully_replicated}
    # prefill samples in the program (its vocabulary-split logits are gathered: the regex finds
    # all-gathers); decode's forward leaves them split for its sampling program
    assert (gathered or not prefill) and not gathered & split_shapes, (label, gathered & split_shapes)
"""

XLA_PATH = """
for preset, tp in CASES:
    model = mixserve.load(preset, dtype="float32")
    single = Engine(model, **kw)
    expected = [r.tokens for r in single.generate(prompts, max_new_tokens=6)]
    split = Engine(model, mesh=mesh_for(tp), **kw)
    assert [r.tokens for r in split.generate(prompts, max_new_tokens=6)] == expected, preset
    assert split.runner.decode_step._cache_size() == single.runner.decode_step._cache_size()  # no resharding
    # Weights: expert hidden width and attention heads split tp ways.
    params = split.runner.model.params
    gate = params["layers_1"]["mlp"]["experts"]["gate_proj"]
    assert gate.addressable_shards[0].data.shape == (8, 64, model.config.moe_intermediate_size // tp)
    total = sum(x.nbytes for x in jax.tree.leaves(model.params))
    assert sharding.bytes_per_device(params) < total * {2: 0.55, 4: 0.35}[tp], preset
    # KV: GQA splits its KV heads, so a device's budget holds tp times the pages; MLA's latent is
    # read by every head and is replicated.
    pool = jax.tree.leaves(split.runner.pools)[0]
    if model.config.attention_kind == "gqa":
        assert pool.addressable_shards[0].data.shape[0] == model.config.num_kv_heads // tp
        assert split.num_pages == tp * single.num_pages
    else:
        assert pool.sharding.is_fully_replicated and split.num_pages == single.num_pages
    assert_no_weight_gathered(split, preset)
# Asleep, MLA's replicated pools free a copy on each of the mesh's 8 devices; awake, the same tokens.
pools = jax.tree.leaves(split.runner.pools)
assert all(x.sharding.is_fully_replicated for x in pools) and split.mesh.size == 8
pool_bytes = sum(x.nbytes for x in pools)
del pools, pool  # held here, they would not be freed
assert split.sleep(tags="kv_cache") == 8 * pool_bytes
split.wake_up()
assert [r.tokens for r in split.generate(prompts, max_new_tokens=6)] == expected
# `model` (one device) is held here, and the engine's replicated weights reuse its buffers on the
# first device: through a level-1 sleep those replicas are let go, not freed, and taken back as
# they are (no second copy there); the rest comes back from host memory
from mixserve.device_memory import live_bytes
before = live_bytes()
assert 0 < split.sleep() < before - sum(x.nbytes for x in jax.tree.leaves(model.params))
split.wake_up()
assert live_bytes() == before
assert [r.tokens for r in split.generate(prompts, max_new_tokens=6)] == expected
# New weights swap in place (Engine.update_weights): each array stays on its devices, nothing
# compiles again, and the tokens are a one-device engine's on the new weights.
glm, other = (mixserve.load("tiny-glm4", dtype="float32", seed=s) for s in (0, 1))
split = Engine(glm, mesh=mesh_for(2), **kw)
split.generate(prompts, max_new_tokens=6)
shardings, compiled = [x.sharding for x in jax.tree.leaves(split.runner.model.params)], split.runner.decode_step._cache_size()
split.update_weights(other)
want = [r.tokens for r in Engine(other, **kw).generate(prompts, max_new_tokens=6)]
assert [r.tokens for r in split.generate(prompts, max_new_tokens=6)] == want
assert [x.sharding for x in jax.tree.leaves(split.runner.model.params)] == shardings
assert split.runner.decode_step._cache_size() == compiled
# A structured output's mask (replicated, [rows, W] words) over the vocabulary-split logits: the same
# sample, and the same logprobs of what it was drawn from (the grammar's mask at temperature 1).
from mixserve.grammar import StructuredOutput
from mixserve.tokenizer import ByteTokenizer
byte_glm = dataclasses.replace(mixserve.load("tiny-glm4", dtype="float32"), tokenizer=ByteTokenizer())
held = dict(max_new_tokens=8, temperature=1.0, seed=3, structured_output=StructuredOutput(regex="[a-z]{2,5}"), logprobs=2)
held_kw = {**kw, "stop_tokens": (257,), "logprobs_mode": "processed_logprobs"}
one = Engine(byte_glm, **held_kw).generate(prompts, **held)
want = [r.tokens for r in one]
assert all(bytes(w[:-1]).isalpha() and w[-1] == 257 for w in want), want
got = Engine(byte_glm, mesh=mesh_for(2), **held_kw).generate(prompts, **held)
assert [r.tokens for r in got] == want
# (a grammar's mask may leave one token: top holds what it kept)
ids = lambda results: [[i for i, _ in lp.top] for r in results for lp in r.logprobs]
values = lambda results: np.array([x for r in results for lp in r.logprobs for x in (lp.logprob, *(p for _, p in lp.top))])
assert ids(got) == ids(one)
# TP2 sums each row-parallel product in two halves: a logit moves by a few float32 ulps of its size
# (a random model's are O(1): ulp ~1e-7), a logprob by about twice that (its logit and the
# logsumexp), and the sampled tokens are the same: 1e-5 is a wide margin. Measured 4.8e-7 (2026-12-07).
np.testing.assert_allclose(values(got), values(one), rtol=0, atol=1e-5)
# Quantized weights whose TP4 shares would cut their scale groups (tiny-kimi: 8 rows of down_proj's
# 2 INT4 g16 groups): the scales are re-blocked (g8) and split with the values, and no weight moves
# in prefill or decode. (FP8-block's re-blocked shares are served in KERNELS; placing, swapping and
# sleeping are the same code for every format.)
model = mixserve.load("tiny-kimi", dtype="float32")
fmt = WeightFormat("int4", 16)
quantized, _ = quantize_model(model, plan_for(fmt, "all"))
expected = [r.tokens for r in Engine(quantized, **kw).generate(prompts, max_new_tokens=3)]
split = Engine(quantized, mesh=mesh_for(4), **kw)
assert [r.tokens for r in split.generate(prompts, max_new_tokens=3)] == expected, fmt
down = split.runner.model.params["layers_1"]["mlp"]["experts"]["down_proj"]
assert down.values_per_scale == (1, 1)
assert all(not x.sharding.is_fully_replicated for x in down.stored), fmt
assert_no_weight_gathered(split, str(fmt))
assert_no_weight_gathered(split, str(fmt), prefill=True)
# new weights in this format are split and re-blocked as the served ones were, then swapped in
other, _ = quantize_model(mixserve.load("tiny-kimi", dtype="float32", seed=1), plan_for(fmt, "all"))
compiled = split.runner.decode_step._cache_size()
split.update_weights(other)
want = [r.tokens for r in Engine(other, **kw).generate(prompts, max_new_tokens=3)]
assert [r.tokens for r in split.generate(prompts, max_new_tokens=3)] == want, fmt
assert split.runner.decode_step._cache_size() == compiled
# asleep, the shares go to host memory whole; awake, each is split again as it was
shardings = [x.sharding for x in jax.tree.leaves(split.runner.model.params)]
split.sleep()
split.wake_up()
assert [x.sharding for x in jax.tree.leaves(split.runner.model.params)] == shardings
assert [r.tokens for r in split.generate(prompts, max_new_tokens=3)] == want, fmt
assert split.runner.decode_step._cache_size() == compiled
with pytest.raises(ValueError, match="needs a 'model' axis"):
    Engine(model, mesh=jax.make_mesh((8,), ("data",)), **kw)
# What 3 devices do not divide stays whole on each, and is named (the flattened widths of the axes).
import warnings
with pytest.warns(UserWarning, match=r"over 3 devices replicates .* heads \\(64, 128\\), mlp \\(32, 128\\), "
                                     r"moe_mlp \\(32\\), vocab \\(320\\)$"):
    sharding.shard_model(model, sharding.tp_mesh(3))
with warnings.catch_warnings():
    warnings.simplefilter("error")
    sharding.shard_model(model, sharding.tp_mesh(4))
report = run.main(["--tensor-parallel", "2", "--model", "tiny-glm4", "--max-new-tokens", "3", "--json"])
assert report["kv_bytes_per_token_per_device"] * 2 == report["kv_bytes_per_token"]
assert all(r["status"] == "ok" for r in report["requests"])
(plan, total, per_device), = report["weight_sets"].values()
assert per_device < 0.55 * total
print("ok")
"""

KERNELS = """
two = [prompts[1], prompts[3]]  # 11 and 14 tokens: every prefill call has the same shape (one compile)
for preset, tp in CASES:
    model = mixserve.load(preset, dtype="float32")
    int4, _ = quantize_model(model, plan_for(WeightFormat("int4", 16), "all"))
    # GLM-5 over FlashMLA's tile-scaled pages: three replicated pools per latent into shard_map.
    kv_kw = {**kw, "kv_dtype": "fp8_ds_mla"} if preset == "tiny-glm5" else kw
    want = [r.tokens for r in Engine(int4, **kv_kw).generate(two, max_new_tokens=3)]
    kernels = Engine(dataclasses.replace(int4, backend="interpret"), attention_backend="interpret",
                     mesh=mesh_for(tp), **kv_kw)
    assert [r.tokens for r in kernels.generate(two, max_new_tokens=3)] == want, preset
    text = kernels.lowered_decode_text()
    assert "int4_matmul/pallas_call" in text and "_attention_" in text
    # Every layer's attention kernel and at least its INT4 projections sit inside shard_map.
    assert text.count("sdy.manual_computation") >= 2 * model.config.num_layers, preset
# FP8-block weights (every linear layer and the experts) through the FP8 kernels at TP4. The tiny
# model's 64-wide inputs and outputs give 16-wide shares of a 128-block (8-wide for the experts'
# 32-row down_proj): the scales are re-blocked to the shares and split with the values
# (models.weights.split_for_tp; the INT4 run above re-blocks the experts' down_proj to g8).
model = mixserve.load("tiny-kimi", dtype="float32")
fp8, _ = quantize_model(model, plan_for(WeightFormat("fp8_block"), "all"))
want = [r.tokens for r in Engine(fp8, **kw).generate(two, max_new_tokens=3)]
kernels = Engine(dataclasses.replace(fp8, backend="interpret"), mesh=mesh_for(4), **kw)
assert [r.tokens for r in kernels.generate(two, max_new_tokens=3)] == want
text = kernels.lowered_decode_text()
assert "fp8_block_matmul/pallas_call" in text and "moe_fp8_block_matmul" in text
down = kernels.runner.model.params["layers_1"]["mlp"]["experts"]["down_proj"]
assert down.scale_block == (8, 128) and not any(x.sharding.is_fully_replicated for x in down.stored)
assert_no_weight_gathered(kernels, "tiny-kimi fp8")
assert_no_weight_gathered(kernels, "tiny-kimi fp8", prefill=True)
print("ok")
"""

EXPERT_PARALLEL = """
for preset in ("tiny-kimi",):  # the MoE code is the same under GQA (tiny-glm4 in the run below)
    model = mixserve.load(preset, dtype="float32")
    int4, _ = quantize_model(model, plan_for(WeightFormat("int4", 16), "experts"))
    want = Engine(int4, return_routed_experts=True, **kw).generate(prompts, max_new_tokens=6)
    split = Engine(int4, mesh=mesh_for(4), expert_parallel=True, return_routed_experts=True, **kw)
    got = split.generate(prompts, max_new_tokens=6)
    assert [r.tokens for r in got] == [r.tokens for r in want], preset
    # every device routes every token (the router is replicated): the routing returned is one device's
    assert all(np.array_equal(g.routed_experts, w.routed_experts) for g, w in zip(got, want)), preset
    # Whole experts, two per device. TP4 splits down_proj's 32-wide input 8 rows a device, which would
    # cut its 2 groups of 16: it re-blocks the scales to g8 (twice as many) and splits them. That is
    # all TP holds above EP: a quarter of the g8 scales against a quarter of the g16 ones.
    experts = lambda m: m.runner.model.params["layers_1"]["mlp"]["experts"]
    cfg, ep_down = model.config, experts(split)["down_proj"]
    assert ep_down.packed_QN.addressable_shards[0].data.shape == (2, cfg.moe_intermediate_size // 8, cfg.hidden_size)
    tp_experts = sharding.shard_model(int4, split.mesh)
    tp_down = tp_experts.params["layers_1"]["mlp"]["experts"]["down_proj"]
    assert tp_down.packed_QN.addressable_shards[0].data.shape == (8, 1, cfg.hidden_size)
    assert tp_down.group_size == 8 and tp_down.scales_GN.addressable_shards[0].data.shape == (8, 1, cfg.hidden_size)
    expert_bytes = sum(x.nbytes for x in jax.tree.leaves(experts(split)))
    assert sharding.bytes_per_device(experts(split)) * 4 == expert_bytes
    moe_layers = sum(cfg.is_moe_layer(i) for i in range(cfg.num_layers))
    assert (sharding.bytes_per_device(tp_experts.params) - sharding.bytes_per_device(split.runner.model.params)
            == moe_layers * tp_down.scales_GN.nbytes // 8), preset
    # mixserve.weight_bytes.device_bytes, the abstract count for full-size models, agrees.
    for ep, placed in ((True, split.runner.model), (False, tp_experts)):
        assert device_bytes(preset, int4.plan, 4, ep, np.float32) == sharding.bytes_per_device(placed.params), (preset, ep)
    assert_no_weight_gathered(split, preset)
# The Pallas kernels: each device's INT4 grouped matmul over its own experts (and GLM-5's sparse MLA).
model = mixserve.load("tiny-glm5", dtype="float32")
int4, _ = quantize_model(model, plan_for(WeightFormat("int4", 16), "all"))
two = [prompts[1], prompts[3]]
want = [r.tokens for r in Engine(int4, **kw).generate(two, max_new_tokens=3)]
kernels = Engine(dataclasses.replace(int4, backend="interpret"), attention_backend="interpret",
                 mesh=mesh_for(4), expert_parallel=True, **kw)
assert [r.tokens for r in kernels.generate(two, max_new_tokens=3)] == want
assert "moe_int4_matmul" in kernels.lowered_decode_text()
# NVFP4 experts through the kernels per device, at TP4 (down_proj's 8-row shares cut its groups of 16:
# re-blocked to 8) and at EP4 (each device's experts with their own global scales).
model = mixserve.load("tiny-kimi", dtype="float32")
nvfp4, _ = quantize_model(model, plan_for(WeightFormat("nvfp4"), "experts"))
want = [r.tokens for r in Engine(nvfp4, **kw).generate(two, max_new_tokens=3)]
for ep in (False, True):
    kernels = Engine(dataclasses.replace(nvfp4, backend="interpret"), mesh=mesh_for(4), expert_parallel=ep, **kw)
    assert [r.tokens for r in kernels.generate(two, max_new_tokens=3)] == want, ep
    assert "nvfp4_matmul/pallas_call" in kernels.lowered_decode_text()
    down = kernels.runner.model.params["layers_1"]["mlp"]["experts"]["down_proj"]
    assert down.group_size == (16 if ep else 8)
    assert down.global_scale.addressable_shards[0].data.shape == ((2, 1) if ep else (8, 1))
    assert_no_weight_gathered(kernels, f"nvfp4 ep={ep}")
with pytest.raises(ValueError, match=r"routed expert count \\(8\\) to divide"):
    Engine(model, mesh=sharding.tp_mesh(3), expert_parallel=True, **kw)
with pytest.raises(ValueError, match="expert_parallel splits the routed experts over a mesh"):
    Engine(model, expert_parallel=True, **kw)
one, split = (run.main(["--model", "tiny-glm4", "--max-new-tokens", "3", "--json"] + flags)
              for flags in ([], ["--tensor-parallel", "4", "--expert-parallel"]))
assert split["expert_parallel"] and [r["tokens"] for r in split["requests"]] == [r["tokens"] for r in one["requests"]]
print("ok")
"""

CONTEXT_PARALLEL = """
# 8-slot pages over 4 devices: 2 slots each, so a row's last page can end inside a device's share.
k8 = {**kw, "page_size": 8}
for preset, kv_dtype in (("tiny-kimi", "fp8_e4m3"), ("tiny-glm5", "fp8_ds_mla")):
    model = mixserve.load(preset, dtype="float32")
    k = {**k8, "kv_dtype": kv_dtype}
    single = Engine(model, **k)
    want = [r.tokens for r in single.generate(prompts, max_new_tokens=6)]
    # The Pallas kernels (interpret) per device: dense MLA (Kimi), DSA top-16 over 20-token rows
    # on tile-scaled pages (GLM-5).
    split = Engine(dataclasses.replace(model, backend="interpret"), attention_backend="interpret", mesh=mesh_for(4),
                   decode_context_parallel=True, **k)
    assert [r.tokens for r in split.generate(prompts, max_new_tokens=6)] == want, preset
    # Each device holds 2 slots of every page of the latent; GLM-5's index keys stay whole.
    per_device = 0
    for layer in split.runner.pools:
        for name, pool in layer.items():
            shard = pool.addressable_shards[0].data
            assert shard.shape == (pool.shape if name.startswith("index") else (pool.shape[0], 2, pool.shape[2]))
            per_device += shard.nbytes
    assert split.kv_bytes_per_token_per_device * split.capacity_tokens == per_device < split.bytes_per_token * split.capacity_tokens
    if preset == "tiny-kimi":
        assert split.kv_bytes_per_token_per_device * 4 == split.bytes_per_token
        assert split.num_pages >= 4 * single.num_pages
    assert_no_weight_gathered(split, preset)
    assert_no_weight_gathered(split, preset, prefill=True)
# The prefix cache's host tier over split pools (Kimi's latent split by slot, GLM-4's KV by head):
# the pages a small pool evicts come back to their shards bit for bit, and the tokens are one device's.
for preset, split in (("tiny-kimi", dict(mesh=mesh_for(4), decode_context_parallel=True)), ("tiny-glm4", dict(mesh=mesh_for(2)))):
    model = mixserve.load(preset, dtype="float32")
    small = {**kw, "page_size": 8, "kv_memory_bytes": None, "num_pages": 8}
    first = prompts[3] + prompts[1]
    e = Engine(model, host_kv_bytes=1 << 20, **small, **split)
    [r1] = e.generate([first], max_new_tokens=6)
    cached = dict(e.page_manager._cache)
    evicted = e.runner.read_pages([page for page, _ in cached.values()])
    for other in (prompts[1] * 4, prompts[0] * 9):  # no page of first
        e.generate([other], max_new_tokens=6)
    assert cached and not set(cached) & set(e.page_manager._cache), preset
    second = first + r1.tokens + [1, 2, 3]
    [r2] = e.generate([second], max_new_tokens=6)
    assert r2.cached_tokens == e.counters.host_restored_tokens == 8 * len(cached), preset
    restored = e.runner.read_pages([e.page_manager._cache[key][0] for key in cached])
    assert all(np.array_equal(a[n], b[n]) for x, y in zip(evicted, restored) for a, b in zip(x, y) for n in a)
    assert r2.tokens == Engine(model, **small).generate([second], max_new_tokens=6)[0].tokens, preset
    placed = sharding.pool_shardings(e.runner.pools, e.mesh, e.runner.cfg.split_slots)
    assert jax.tree.map(lambda pool: pool.sharding, e.runner.pools) == placed, preset  # written back in place
# Handed over from a prefill engine with whole pages on its devices and BF16 KV: with prompts of one
# chunk, the FP8 pages that arrive are an FP8 engine's, so its tokens follow.
model = mixserve.load("tiny-kimi", dtype="float32")
short = [p[:8] for p in prompts]
want = [r.tokens for r in Engine(model, **k8).generate(short, max_new_tokens=6)]
pair = mixserve.DisaggregatedEngine(
    Engine(model, mesh=sharding.tp_mesh(4), prefill_only=True, **{**k8, "kv_dtype": "bfloat16"}),
    Engine(model, mesh=sharding.tp_mesh(4, first=4), decode_context_parallel=True, **k8))
assert [r.tokens for r in pair.generate(short, max_new_tokens=6)] == want
model = mixserve.load("tiny-glm4", dtype="float32")
with pytest.raises(ValueError, match="GQA pools already split by KV head"):
    Engine(model, mesh=mesh_for(4), decode_context_parallel=True, **kw)
model = mixserve.load("tiny-kimi", dtype="float32")
with pytest.raises(ValueError, match="page_size 6 does not divide"):
    Engine(model, mesh=mesh_for(4), decode_context_parallel=True, **{**kw, "page_size": 6})
with pytest.raises(ValueError, match="power-of-two page share: page_size 24 / 4 = 6"):
    Engine(model, mesh=mesh_for(4), decode_context_parallel=True, attention_backend="interpret", **{**kw, "page_size": 24})
for mesh in (None, sharding.tp_mesh(1)):
    with pytest.raises(ValueError, match="over a mesh"):
        Engine(model, mesh=mesh, decode_context_parallel=True, **kw)
# The XLA path (the kernels' references per device), DSA steps included: one device's tokens.
one, split = (run.main(["--model", "tiny-glm5", "--max-new-tokens", "4", "--json"] + flags)
              for flags in ([], ["--tensor-parallel", "2", "--decode-context-parallel"]))
assert [r["tokens"] for r in split["requests"]] == [r["tokens"] for r in one["requests"]]
assert split["decode_context_parallel"] and split["kv_bytes_per_token_per_device"] < split["kv_bytes_per_token"]
print("ok")
"""


SHARDED_LOAD = """
# Checkpoints (BF16, INT4 g16 experts, FP8 everywhere) placed on 4 devices as they are read: the same
# leaves, shardings and re-blocked scales as loading on one device and placing the whole model.
import sys
# Every tensor reaches its devices from the host: the loader never puts a whole one on a device first.
placement = sharding.placement


def from_host(put):
    def checked(x):
        assert isinstance(x, np.ndarray), type(x)
        return put(x)
    return checked


def streamed_load(directory, **kwargs):
    sharding.placement = lambda *a, **k: jax.tree.map(from_host, placement(*a, **k))
    try:
        return mixserve.load(directory, dtype="float32", progress=False, **kwargs)
    finally:
        sharding.placement = placement


mesh = sharding.tp_mesh(4)
for directory in sys.argv[1:]:
    for ep in (False, True):
        streamed = streamed_load(directory, mesh=mesh, expert_parallel=ep)
        placed = sharding.shard_model(mixserve.load(directory, dtype="float32", progress=False), mesh, ep)
        assert streamed.expert_parallel == ep and jax.tree.structure(streamed.params) == jax.tree.structure(placed.params)
        for a, b in zip(jax.tree.leaves(streamed.params), jax.tree.leaves(placed.params), strict=True):
            assert a.sharding == b.sharding and a.sharding.mesh == mesh, (directory, ep, a.sharding, b.sharding)
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        down = streamed.params["layers_1"]["mlp"]["experts"]["down_proj"]
        if not isinstance(down, jax.Array):  # TP4: 8 of the 32 rows a device, re-blocked; EP4: whole experts
            assert down.values_per_scale == {(False, "Int4Weight"): (1, 1), (True, "Int4Weight"): (2, 1),
                                             (False, "Nvfp4Weight"): (1, 1), (True, "Nvfp4Weight"): (2, 1),
                                             (False, "Fp8BlockWeight"): (8, 128), (True, "Fp8BlockWeight"): (128, 128)}[ep, type(down).__name__]
# Named errors before any tensor is read: no mesh, no "model" axis, experts the devices do not divide.
for kwargs, error in (({"expert_parallel": True}, "expert_parallel splits the routed experts over a mesh"),
                      ({"mesh": jax.make_mesh((4,), ("data",))}, "needs a 'model' axis"),
                      ({"mesh": sharding.tp_mesh(3), "expert_parallel": True}, r"routed expert count \\(8\\) to divide")):
    with pytest.raises(ValueError, match=error):
        mixserve.load(sys.argv[1], **kwargs)
# Orbax saves the model as its plan stores it, so a placed one with re-blocked scales is refused.
from mixserve.orbax_io import save_params
with pytest.raises(ValueError, match="re-blocked for tensor parallelism"):
    save_params(sys.argv[-1] + "-orbax", mixserve.load(sys.argv[2], progress=False, mesh=mesh))
print("ok")
"""


def run_on_8_devices(body: str, *args: str) -> None:
    env = host_devices_env(8)
    script = textwrap.dedent(PRELUDE) + textwrap.dedent(body)
    result = subprocess.run([sys.executable, "-c", script, *args], env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-4000:]


def test_tensor_parallel_engine_serves_the_one_device_tokens_and_gathers_no_weight():
    """GLM-4 (GQA) at TP2 and Kimi, GLM-5 (MLA) at TP4 on the XLA path: the same greedy tokens as
    one device (FP8 KV, chunked prefill of ragged prompts, integrity check on), no recompile,
    expert and head weights split, GQA pools split by KV head (twice the pages at TP2 for the same
    per-device budget), MLA pools replicated, and the compiled decode step gathers no split
    weight; the same for INT4 weights whose shares would cut their scale groups (re-blocked to the
    shares and split with the values). At TP3 what 3 does not divide is
    replicated, with a warning that names it. `mixserve.run --tensor-parallel 2` reports the
    per-device bytes. A structured output samples the same at TP2, with the same processed logprobs
    (logprobs_mode). New weights swapped in (GLM-4 at
    TP2; INT4 Kimi at TP4, re-blocked) keep their placement and compiled steps and
    serve the one-device tokens, and so do those woken from host memory after sleep."""
    run_on_8_devices(XLA_PATH)


def test_tensor_parallel_runs_the_pallas_kernels_per_device():
    """INT4 weights (group 16, every linear layer and the experts) and the Pallas kernels in
    interpret mode under the same meshes: INT4 dense and grouped-MoE matmuls (column-parallel,
    row-parallel with a psum; the experts' down_proj at TP4 would cut its 2 groups, and is placed
    re-blocked to g8), GQA attention on each device's KV heads, MLA and GLM-5's sparse MLA on
    each device's query heads (GLM-5 over fp8_ds_mla pages). Same greedy tokens as one device on
    the XLA references. Then FP8-block weights through the FP8 kernels at TP4, whose 16-wide
    shares would cut the scale blocks: one device's tokens, no weight gathered in decode or prefill."""
    run_on_8_devices(KERNELS)


def test_expert_parallel_serves_the_one_device_tokens_with_whole_experts_per_device():
    """Expert parallelism at EP4 (tiny-kimi, INT4 g16 experts, XLA path): the same greedy tokens as
    one device (and the same routed experts returned), two whole experts per device (a quarter of the expert bytes; TP4 holds more by
    exactly a quarter of the down_proj scales, which it re-blocks to g8; mixserve.weight_bytes.device_bytes
    agrees), no split weight gathered by the
    decode step; GLM-5 with the Pallas kernels (interpret) per device, INT4 everywhere; tiny-kimi's
    NVFP4 experts through the kernels at TP4 (down_proj re-blocked to groups of 8) and EP4 (global
    scales split with their experts), one device's tokens, nothing gathered; named errors
    for an expert count the devices do not divide and for no mesh; `mixserve.run --expert-parallel`
    serves tiny-glm4 (GQA) with one device's tokens."""
    run_on_8_devices(EXPERT_PARALLEL)


def test_decode_context_parallel_splits_mla_pages_by_slot_and_serves_the_one_device_tokens():
    """Decode context parallelism at 4 devices: each holds 2 slots of every 8-slot latent page, so
    Kimi's per-device budget holds 4x the pages (the shards' bytes are what the engine counts);
    decode attends with all heads over each device's slots and merges by log-sum-exp. One device's
    greedy tokens with the interpret kernels (tiny-kimi dense; tiny-glm5 DSA top-16 over 20-token
    rows on fp8_ds_mla pages), on the XLA path (`mixserve.run --decode-context-parallel`, tiny-glm5),
    and from a BF16-KV prefill engine handing pages over into a split pool. Neither step gathers
    a split weight or pool (prefill gathers only its rows' pages). The prefix cache's host tier
    brings evicted pages back to their shards (latent split by slot; GLM-4's KV by head at TP2). Named errors: GQA, a page size
    the devices do not divide, a non-power-of-two share for the kernels, no mesh or one device."""
    run_on_8_devices(CONTEXT_PARALLEL)


def test_a_checkpoint_streams_onto_the_mesh_as_the_engine_would_place_it(tmp_path):
    """mixserve.load(dir, mesh=) puts each tensor on its devices as it is read (a full model does not
    fit one device): BF16, INT4 g16 (experts), FP8-block and NVFP4 (experts) checkpoints of a tiny Kimi at
    TP4 and EP4 give the
    leaves, shardings and re-blocked scales (INT4 g8, FP8 8-row blocks for down_proj's 8-row
    shares) of loading whole and placing, each tensor put from the host; named errors before any
    read for meshes that cannot take the model, and for saving (Orbax) a placed model whose scales
    were re-blocked."""
    import hf_reference as ref

    bf16 = str(tmp_path / "bf16")
    ref.save(ref.build("kimi-yarn-groups"), bf16)
    dirs = [bf16]
    for name, plan in (("int4", plan_for(WeightFormat("int4", 16), "experts")),  # MLA's 24-wide kv_b_proj: no g16
                       ("fp8", plan_for(WeightFormat("fp8_block"), "all")),
                       ("nvfp4", plan_for(WeightFormat("nvfp4"), "experts"))):
        dirs.append(str(tmp_path / name))
        quantize_checkpoint(bf16, dirs[-1], plan)
    run_on_8_devices(SHARDED_LOAD, *dirs)


@pytest.mark.parametrize("group, rows, columns, tp, axis, block", [
    (None, 1536, 64, 8, -2, (64, 128)),  # FP8, GLM-4.5's expert width at TP8: 192 rows, 3 blocks of 64
    (None, 200, 64, 4, -2, (2, 128)),  # FP8, a last block that ends early: 50 rows, blocks of 2
    (None, 64, 1536, 8, -1, (128, 64)),  # FP8, column-parallel
    (None, 1024, 64, 8, -2, (128, 128)),  # FP8, shares of whole blocks: nothing to re-block
    (128, 192, 64, 8, -2, (8, 1)),  # INT4 g128 (16 packed rows), 1536 / 8 rows a device: g64
    (16, 4, 64, 4, -2, (1, 1)),  # INT4, tiny-kimi's down_proj at g16 and TP4: one packed row, g8
])
def test_split_for_tp_gives_each_share_whole_scale_blocks_and_the_same_weight(group, rows, columns, tp, axis, block):
    """A weight whose shares would cut its scale blocks is re-blocked to gcd(block, share) values
    per scale and split, values and scales alike: each device's share dequantizes to exactly its
    slice of the whole weight. Random FP8 bit patterns (NaN excluded) or packed INT4 words, random
    power-of-two-spread scales, three experts."""
    seed = int.from_bytes(os.urandom(4), "little")
    rng = np.random.default_rng(seed)
    spread = lambda *shape: 2.0 ** rng.uniform(-12, -4, shape)
    if group is None:
        bits = rng.integers(0, 256, (3, rows, columns), dtype=np.uint8)
        bits[(bits & 0x7F) == 0x7F] = 0x3C  # e4m3fn's NaNs
        w = Fp8BlockWeight(jnp.asarray(bits).view(jnp.float8_e4m3fn),
                           jnp.asarray(spread(3, -(-rows // 128), -(-columns // 128)), jnp.float32))
    else:  # rows of 8 packed values
        packed = rng.integers(-2**31, 2**31, (3, rows, columns), dtype=np.int64).astype(np.int32)
        w = Int4Weight(jnp.asarray(packed), jnp.asarray(spread(3, rows * 8 // group, columns), jnp.bfloat16), group)
    names = ("experts", "moe_mlp", "embed") if axis == -2 else ("experts", "embed", "moe_mlp")
    placed, spec = split_for_tp(w, names, tp)
    assert placed.values_per_scale == block and spec[axis] == "model" and spec[-3] is None
    abstract, abstract_spec = split_for_tp(jax.eval_shape(lambda x: x, w), names, tp)  # mixserve.weight_bytes
    assert abstract_spec == spec and [x.shape for x in abstract.stored] == [x.shape for x in placed.stored]
    whole = np.asarray(w.dequantize(jnp.float32))
    shares = zip(*(np.split(np.asarray(x), tp, axis=axis) for x in placed.stored))
    for device, (want, (v, s)) in enumerate(zip(np.split(whole, tp, axis=axis), shares)):
        got = placed.with_stored(jnp.asarray(v), jnp.asarray(s)).dequantize(jnp.float32)
        np.testing.assert_array_equal(np.asarray(got), want, err_msg=f"device {device}, seed={seed}")
    if placed is not w:
        with pytest.raises(ValueError, match="re-block them first"):
            quantized_spec(names, w, tp)


def test_tp_mesh_names_what_is_wrong():
    """tp=0 used to advise --xla_force_host_platform_device_count=0: one message for three faults."""
    for tp, first in ((0, 0), (-2, 0), (1, -1)):
        with pytest.raises(ValueError, match=rf"tp must be positive and first at least 0, got tp={tp}, first={first}"):
            tp_mesh(tp, first)
    n = jax.device_count()
    with pytest.raises(ValueError, match=rf"{n} devices available .*device_count={n + 1} "):
        tp_mesh(1, first=n)
