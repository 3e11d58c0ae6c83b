"""Checkpoint formats (FP8 block, INT4 compressed-tensors) and clear errors for bad checkpoints."""

import glob
import json
import os
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hf_reference as ref
import torch
from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
import mixserve
from mixserve.model import Model
from mixserve.quantize import plan_for, quantize_checkpoint, quantize_model
from mixserve.safetensors_io import CheckpointError, index_tensors, load_tensor, write_safetensors
from models.weights import QUANTIZED, Nvfp4Weight, WeightFormat, WeightPlan, dequantize


@pytest.fixture(scope="module")
def bf16_dir(tmp_path_factory):
    model = ref.build("kimi-yarn-groups")
    path = tmp_path_factory.mktemp("bf16")
    ref.save(model, path)
    return str(path)


@pytest.fixture(scope="module")
def int4_dir(bf16_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("int4")
    quantize_checkpoint(bf16_dir, str(path), plan_for(WeightFormat("int4", 32), "experts"))
    return str(path)


def _dequantized_twin(model: Model) -> Model:
    params = jax.tree.map(lambda w: dequantize(w, jnp.float32), model.params, is_leaf=lambda x: isinstance(x, QUANTIZED))
    return Model(model.config, params, dtype=jnp.float32)


@pytest.mark.parametrize("fmt,scope", [
    (WeightFormat("fp8_block"), "all"),
    (WeightFormat("int4", 32), "experts"),
    (WeightFormat("int4", 8), "all"),
    (WeightFormat("nvfp4"), "experts"),  # "all" would need kv_lora_rank 24 in groups of 16
])
def test_quantized_checkpoint_loads_and_tracks_bf16(bf16_dir, tmp_path, fmt, scope):
    """Two checks. (1) Exact: the quantized checkpoint's logits equal those of the BF16 model with
    each weight replaced by its dequantized value (same float32 arithmetic: < 1e-6), so loading
    adds no error beyond the format. (2) The format's own error: each weight's RTN error is at most
    half a quantization step (FP8 e4m3: 2^-4 relative; INT4: scale/2 = group absmax/15; NVFP4: half
    the e2m1 spacing at the value times the group's step), with RMS
    relative weight error r (measured below). To first order a matmul's output error is r relative;
    independent errors along a path of n quantized matmuls add in quadrature, so the logit error is
    about sqrt(n) * r. We assert < 2 * sqrt(n) * r, with n = quantized matmuls per layer x layers."""
    quantize_checkpoint(bf16_dir, str(tmp_path), plan_for(fmt, scope))
    config = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == ("fp8" if fmt.kind == "fp8_block" else "compressed-tensors")
    ids = np.random.default_rng(0).integers(0, 160, (2, 11))
    base = mixserve.load(bf16_dir, dtype="float32", progress=False)
    quant = mixserve.load(str(tmp_path), dtype="float32", progress=False)
    assert quant.plan == plan_for(fmt, scope)
    lq, lb = np.asarray(quant.logits(ids)), np.asarray(base.logits(ids))
    ld = np.asarray(_dequantized_twin(quant).logits(ids))
    assert np.linalg.norm(lq - ld) / np.linalg.norm(ld) < 1e-6

    # r: RMS relative weight error over the quantized leaves
    errs = []
    flat_q = dict(jax.tree_util.tree_flatten_with_path(quant.params, is_leaf=lambda x: isinstance(x, QUANTIZED))[0])
    flat_b = dict(jax.tree_util.tree_flatten_with_path(base.params)[0])
    for path, w in flat_q.items():
        if isinstance(w, QUANTIZED):
            orig = flat_b[path]
            errs.append(float(jnp.linalg.norm(w.dequantize(jnp.float32) - orig) / jnp.linalg.norm(orig)))
    r = float(np.sqrt(np.mean(np.square(errs))))
    n = (6 if scope == "all" else 3) * base.config.num_layers
    err = float(np.linalg.norm(lq - lb) / np.linalg.norm(lb))
    assert 0 < err < 2 * np.sqrt(n) * r, f"{fmt}: logit error {err:.3f}, weight error r={r:.3f}, n={n}"


_UNIT = "model.layers.1.mlp.experts.0.gate_proj"  # an INT4 unit of int4_dir


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def _rewrite(directory, edit):
    """Apply edit(dict of tensors) to the single-file checkpoint in directory (tensors are copied
    out of the memory map first: the file is rewritten in place)."""
    (path,) = glob.glob(os.path.join(directory, "*.safetensors"))
    tensors = {k: np.array(load_tensor(v)) for k, v in index_tensors(directory).items()}
    edit(tensors)
    write_safetensors(path, tensors)


def test_missing_tensor_is_named_with_shape(bf16_dir, tmp_path):
    d = _copy(bf16_dir, tmp_path / "c")
    _rewrite(d, lambda t: t.pop("model.layers.1.mlp.experts.3.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.mlp\.experts\.3\.up_proj\.weight \(expected shape \(32, 64\)\)"):
        mixserve.load(str(d), progress=False)


def test_unexpected_tensor_is_named(bf16_dir, tmp_path):
    d = _copy(bf16_dir, tmp_path / "c")
    _rewrite(d, lambda t: t.__setitem__("model.layers.0.self_attn.mystery.weight", np.zeros((2, 2), np.float32)))
    with pytest.raises(CheckpointError, match=r"unexpected.*model\.layers\.0\.self_attn\.mystery\.weight"):
        mixserve.load(str(d), progress=False)


def test_misshaped_tensor_is_named(bf16_dir, tmp_path):
    d = _copy(bf16_dir, tmp_path / "c")
    _rewrite(d, lambda t: t.__setitem__("model.norm.weight", np.ones((63,), np.float32)))
    with pytest.raises(CheckpointError, match=r"model\.norm\.weight has shape \(63,\), expected \(64,\)"):
        mixserve.load(str(d), progress=False)


def test_truncated_file_is_reported(bf16_dir, tmp_path):
    d = _copy(bf16_dir, tmp_path / "c")
    path = os.path.join(d, "model.safetensors")
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 100)
    with pytest.raises(CheckpointError, match="truncated"):
        mixserve.load(str(d), progress=False)
    with open(path, "r+b") as f:
        f.truncate(5)
    with pytest.raises(CheckpointError, match="truncated"):
        mixserve.load(str(d), progress=False)


@pytest.mark.parametrize("edit,error", [
    (lambda t: t.pop(f"{_UNIT}.weight_scale"), rf"{_UNIT}\.weight_scale"),
    (lambda t: t.__setitem__(f"{_UNIT}.weight_packed", t[f"{_UNIT}.weight_packed"][:, :-1]), rf"{_UNIT}\.weight_packed"),
    (lambda t: t.__setitem__(f"{_UNIT}.weight_scale", np.ones((32, 3), np.float32)), _UNIT),
], ids=["no-scale", "short-pack", "scale-columns"])
def test_corrupt_int4_pack_is_named(int4_dir, tmp_path, edit, error):
    d = _copy(int4_dir, tmp_path / "c")
    _rewrite(d, edit)
    with pytest.raises(CheckpointError, match=error):
        mixserve.load(d, progress=False)


@pytest.fixture(scope="module")
def nvfp4_dir(bf16_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("nvfp4")
    quantize_checkpoint(bf16_dir, str(path), plan_for(WeightFormat("nvfp4"), "experts"))
    return str(path)


def test_written_nvfp4_decodes_with_compressed_tensors(nvfp4_dir):
    """The checkpoint is compressed-tensors nvfp4-pack-quantized as llm-compressor writes it (uint8
    packs [out, in/2], e4m3 scales [out, in/16], a float32 global scale [1] per weight), and the
    package's own unpacking, times scale / global scale, gives the weights mixserve loads."""
    config = json.loads(open(os.path.join(nvfp4_dir, "config.json")).read())["quantization_config"]
    assert config["format"] == "nvfp4-pack-quantized"
    weights = config["config_groups"]["group_0"]["weights"]
    assert {k: weights[k] for k in ("type", "strategy", "group_size", "num_bits")} == {
        "type": "float", "strategy": "tensor_group", "group_size": 16, "num_bits": 4}
    disk = {k: np.asarray(load_tensor(v)) for k, v in index_tensors(nvfp4_dir).items()}
    model = mixserve.load(nvfp4_dir, dtype="float32", progress=False)
    assert model.plan == plan_for(WeightFormat("nvfp4"), "experts")
    experts = model.params["layers_1"]["mlp"]["experts"]
    assert isinstance(experts["gate_proj"], Nvfp4Weight)
    for e in (0, 5):
        unit = f"model.layers.1.mlp.experts.{e}.gate_proj"
        packed, scale, g = (disk[f"{unit}.{p}"] for p in ("weight_packed", "weight_scale", "weight_global_scale"))
        assert (packed.dtype, scale.dtype, g.dtype, g.shape) == (np.uint8, jnp.float8_e4m3fn, np.float32, (1,))
        n, half = packed.shape
        values = unpack_fp4_from_uint8(torch.from_numpy(packed.copy()), n, 2 * half, dtype=torch.float32).numpy()
        w_NK = values * np.repeat(scale.astype(np.float32), 16, axis=1) / g[0]
        loaded = np.asarray(experts["gate_proj"].dequantize(jnp.float32)[e]).T
        np.testing.assert_allclose(loaded, w_NK, rtol=2.0**-22, atol=0, err_msg=unit)


def test_nvfp4_beside_bf16_experts_loads_dequantized(nvfp4_dir, tmp_path):
    """One expert stored dense among NVFP4 ones: the experts load dense, each NVFP4 one dequantized
    on load, and the logits equal the NVFP4 model's dequantized twin."""
    d = _copy(nvfp4_dir, tmp_path / "c")
    quantized = mixserve.load(nvfp4_dir, dtype="float32", progress=False)
    unit = "model.layers.1.mlp.experts.2.up_proj"
    w = np.asarray(quantized.params["layers_1"]["mlp"]["experts"]["up_proj"].dequantize(jnp.float32)[2]).T

    def densify(t):
        for part in ("weight_packed", "weight_scale", "weight_global_scale"):
            t.pop(f"{unit}.{part}")
        t[f"{unit}.weight"] = w

    _rewrite(d, densify)
    mixed = mixserve.load(d, dtype="float32", progress=False)
    assert mixed.plan == WeightPlan()
    ids = np.random.default_rng(0).integers(0, 160, (2, 9))
    np.testing.assert_allclose(np.asarray(mixed.logits(ids)), np.asarray(_dequantized_twin(quantized).logits(ids)),
                               rtol=1e-6, atol=1e-6)


_NVFP4_UNIT = "model.layers.2.mlp.experts.1.down_proj"


@pytest.mark.parametrize("edit,error", [
    (lambda t: t.pop(f"{_NVFP4_UNIT}.weight_global_scale"), rf"{_NVFP4_UNIT}\.weight_packed is U8, where int4 stores I32"),
    (lambda t: t.__setitem__(f"{_NVFP4_UNIT}.weight_scale", t[f"{_NVFP4_UNIT}.weight_scale"].astype(np.float32)),
     rf"{_NVFP4_UNIT}\.weight_scale is F32, where nvfp4 stores F8_E4M3"),
    (lambda t: t.__setitem__(f"{_NVFP4_UNIT}.weight_packed", t[f"{_NVFP4_UNIT}.weight_packed"][:, :-1]),
     rf"{_NVFP4_UNIT}\.weight_packed"),
], ids=["no-global-scale", "f32-scales", "short-pack"])
def test_corrupt_nvfp4_pack_is_named(nvfp4_dir, tmp_path, edit, error):
    d = _copy(nvfp4_dir, tmp_path / "c")
    _rewrite(d, edit)
    with pytest.raises(CheckpointError, match=error):
        mixserve.load(d, progress=False)


@pytest.mark.parametrize("edit,error", [
    (lambda q: q["config_groups"]["group_0"].update(input_activations={"num_bits": 4, "type": "float"}),
     r"input_activations .* \(W4A16, or NVFP4 served as W4A16\)"),
    (lambda q: q["config_groups"]["group_0"]["weights"].update(group_size=32), r"weights\.group_size 32 \(expected 16\)"),
    (lambda q: q["config_groups"]["group_0"]["weights"].update(type="int"), r"weights\.type 'int' \(expected 'float'\)"),
], ids=["fp4-acts-not-nvfp4", "group-32", "int-type"])
def test_unsupported_nvfp4_quantization_config_is_refused(nvfp4_dir, tmp_path, edit, error):
    d = _copy(nvfp4_dir, tmp_path / "c")
    _edit_quant_config(d, edit)
    with pytest.raises(CheckpointError, match="unsupported quantization_config: .*" + error):
        mixserve.load(str(d), progress=False)


def test_quantizer_rejects_group_not_dividing(bf16_dir, tmp_path):
    with pytest.raises(CheckpointError, match="does not divide"):
        quantize_checkpoint(bf16_dir, str(tmp_path), plan_for(WeightFormat("int4", 24), "experts"))


def test_int4_weight_shape_must_match_the_pack(int4_dir, tmp_path):
    d = _copy(int4_dir, tmp_path / "c")
    name = "model.layers.2.mlp.experts.5.down_proj"
    _rewrite(d, lambda t: t.__setitem__(f"{name}.weight_shape", np.array([64, 64], np.int64)))
    with pytest.raises(CheckpointError, match=rf"{name}\.weight_shape says \(64, 64\), weight_packed holds \(64, 32\)"):
        mixserve.load(d, progress=False)


def _edit_quant_config(directory, edit):
    path = os.path.join(directory, "config.json")
    config = json.loads(open(path).read())
    edit(config["quantization_config"])
    open(path, "w").write(json.dumps(config))


def _weights(quant):
    return quant["config_groups"]["group_0"]["weights"]


@pytest.mark.parametrize("edit,error", [
    (lambda q: _weights(q).update(actorder="group"), r"weights\.actorder 'group'"),
    (lambda q: _weights(q).update(symmetric=False), r"weights\.symmetric False \(expected True\)"),
    (lambda q: _weights(q).update(num_bits=8), r"weights\.num_bits 8 \(expected 4\)"),
    (lambda q: _weights(q).update(strategy="tensor"), r"weights\.strategy 'tensor'"),
    (lambda q: q["config_groups"]["group_0"].update(input_activations={"num_bits": 8, "type": "int"}),
     r"input_activations .* \(W4A16, or NVFP4 served as W4A16\)"),
    (lambda q: q.update(format="int-quantized"), r"format 'int-quantized'"),
    (lambda q: q.update(sparsity_config={"format": "sparse-24-bitmask"}), r"sparsity_config"),
    (lambda q: q.update(quant_method="awq"), r"quant_method 'awq'"),
], ids=["actorder-group", "asymmetric", "8-bit", "per-tensor", "w4a8", "int-quantized", "sparse-24", "awq"])
def test_unsupported_int4_quantization_config_is_refused(int4_dir, tmp_path, edit, error):
    """Each of these checkpoints' tensors would load, but mean other weights than mixserve computes."""
    d = _copy(int4_dir, tmp_path / "c")
    _edit_quant_config(d, edit)
    with pytest.raises(CheckpointError, match="unsupported quantization_config: .*" + error):
        mixserve.load(str(d), progress=False)


def test_kv_cache_scheme_is_a_notice(int4_dir, tmp_path):
    """A declared kv_cache_scheme (FP8 KV calibration) changes no weight: the checkpoint loads, its
    attention-level k_scale/v_scale are left out, and a notice says so (the KV format is chosen when
    serving). Undeclared, the same tensors are refused."""
    d = _copy(int4_dir, tmp_path / "c")
    _rewrite(d, lambda t: t.update({f"model.layers.{i}.self_attn.{kv}_scale": np.array(0.25, np.float32)
                                    for i in range(3) for kv in "kv"}))
    with pytest.raises(CheckpointError, match=r"unexpected tensor\(s\) .*self_attn\.k_scale"):
        mixserve.load(str(d), progress=False)
    _edit_quant_config(d, lambda q: q.update(kv_cache_scheme={"num_bits": 8, "type": "float", "strategy": "tensor"}))
    with pytest.warns(UserWarning, match=r"declares a quantized KV cache .*k_scale/v_scale are not read"):
        model = mixserve.load(str(d), progress=False)
    assert model.plan == plan_for(WeightFormat("int4", 32), "experts")


FP8_KV_SCHEME = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}


@pytest.mark.parametrize("name", ["self_attn.{kv}_scale", "self_attn.{kv}_proj.{kv}_scale"],
                         ids=["compressed-tensors", "modelopt"])
def test_fp8_kv_scales_of_a_gqa_checkpoint_are_read_and_served(tmp_path, name):
    """A GQA checkpoint's calibrated FP8 KV scales (per tensor, per layer; named as llm-compressor
    or ModelOpt writes them) load with the model, and an FP8 KV engine writes its pages with them
    unless given others; a BF16 cache ignores them. A layer without its scales is named."""
    import warnings
    from mixserve.engine import Engine

    d = str(tmp_path / "glm4")
    ref.save(ref.build("glm4-qknorm-bias"), d)
    layers = json.loads(open(os.path.join(d, "config.json")).read())["num_hidden_layers"]
    written = {(kv, i): 0.01 * (i + 2) * (3 if kv == "v" else 1) for i in range(layers) for kv in "kv"}
    _rewrite(d, lambda t: t.update({f"model.layers.{i}.{name.format(kv=kv)}": np.asarray(v, np.float32)
                                    for (kv, i), v in written.items()}))
    path = os.path.join(d, "config.json")
    config = json.loads(open(path).read())
    config["quantization_config"] = {"quant_method": "compressed-tensors", "kv_cache_scheme": FP8_KV_SCHEME}
    open(path, "w").write(json.dumps(config))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # read as declared: no notice
        model = mixserve.load(d, dtype="float32", progress=False)
    for i, kv in enumerate("kv"):
        np.testing.assert_allclose(model.kv_scales[i], [written[kv, j] for j in range(layers)], rtol=1e-7)
    broken = _copy(d, tmp_path / "broken")
    _rewrite(broken, lambda t: t.pop(f"model.layers.1.{name.format(kv='v')}"))
    with pytest.raises(CheckpointError, match="FP8 KV scales miss layer 1 v_scale"):
        mixserve.load(str(broken), dtype="float32", progress=False)
    if "proj" in name:
        return  # served alike whatever their names: the engines once
    kw = dict(kv_dtype="fp8_e4m3", num_pages=16, page_size=8, max_batch=2, stop_tokens=())
    shipped, explicit, unit = (Engine(model, **kw, **scales) for scales in (
        {}, dict(k_scale=model.kv_scales[0][:, None], v_scale=model.kv_scales[1][:, None]),
        dict(k_scale=1.0, v_scale=1.0)))
    np.testing.assert_array_equal(shipped.runner.cfg.k_scale, model.kv_scales[0])
    prompts = [list(map(int, np.random.default_rng(i).integers(0, 150, 9 + 5 * i))) for i in range(2)]
    out = [e.generate(prompts, max_new_tokens=3) for e in (shipped, explicit, unit)]
    assert [r.tokens for r in out[0]] == [r.tokens for r in out[1]]
    stored = [np.asarray(e.runner.pools[layers - 1]["v"], np.float32) for e in (shipped, explicit, unit)]
    np.testing.assert_array_equal(stored[0], stored[1])
    assert not np.array_equal(stored[0], stored[2])  # value / 0.03 * layers, not the value
    bf16 = Engine(model, **{**kw, "kv_dtype": "auto"})
    assert np.all(np.asarray(bf16.runner.cfg.k_scale) == 1.0)
    assert shipped.kv_scales_from_checkpoint and not explicit.kv_scales_from_checkpoint
    from mixserve import run
    from mixserve.orbax_io import restore_params, save_params
    flags = ["--json", "--model", d, "--max-new-tokens", "1", "--integrity", "off", "--prompt", "hi"]
    assert run.main(flags)["kv_scales"] == "checkpoint"
    assert run.main([*flags, "--kv-cache-dtype", "bfloat16"])["kv_scales"] == "1"
    save_params(str(tmp_path / "orbax"), model)  # a restart keeps them
    for restored, loaded in zip(restore_params(str(tmp_path / "orbax")).kv_scales, model.kv_scales):
        np.testing.assert_array_equal(restored, loaded)


def test_supported_int4_config_variants_load(int4_dir, tmp_path):
    """actorder 'weight' reorders only during quantization (no tensor records it); llm-compressor
    writes sparsity_config format 'dense' for no sparsity."""
    d = _copy(int4_dir, tmp_path / "c")
    _edit_quant_config(d, lambda q: (_weights(q).update(actorder="weight"), q.update(sparsity_config={"format": "dense"})))
    assert mixserve.load(str(d), progress=False).plan == plan_for(WeightFormat("int4", 32), "experts")


@pytest.mark.parametrize("edit,error", [
    (lambda q: q.update(activation_scheme="static"), r"activation_scheme 'static'"),
    (lambda q: q.update(weight_block_size=[64, 64]), r"weight_block_size \[64, 64\]"),
    (lambda q: q.update(fmt="e5m2"), r"fmt 'e5m2'"),
], ids=["static-activations", "64x64-blocks", "e5m2"])
def test_unsupported_fp8_quantization_config_is_refused(bf16_dir, tmp_path, edit, error):
    quantize_checkpoint(bf16_dir, str(tmp_path), plan_for(WeightFormat("fp8_block"), "all"))
    _edit_quant_config(str(tmp_path), edit)
    with pytest.raises(CheckpointError, match="unsupported quantization_config: .*" + error):
        mixserve.load(str(tmp_path), progress=False)


def _add_beside(suffix, part, value):
    """An edit that adds `part` = value(existing tensor) beside every tensor named '*.{suffix}'."""
    def edit(tensors):
        for name in [n for n in tensors if n.endswith("." + suffix)]:
            tensors[name.rpartition(".")[0] + "." + part] = value(tensors[name])
    return edit


@pytest.mark.parametrize("edit,error", [
    # zero points beside symmetric INT4 tensors: silently dropped, every weight would shift
    (_add_beside("weight_scale", "weight_zero_point", lambda s: np.zeros((s.shape[0] // 8, s.shape[1]), np.int32)),
     r"experts\.0\.down_proj\.weight_zero_point.*asymmetric"),
    (_add_beside("weight_packed", "weight_g_idx", lambda p: np.arange(p.shape[1] * 8, dtype=np.int32) // 32),
     r"experts\.0\.down_proj\.weight_g_idx.*actorder"),
    (_add_beside("layers.0.self_attn.o_proj.weight", "bias", lambda w: np.ones(w.shape[0], np.float32)),
     r"\['model\.layers\.0\.self_attn\.o_proj\.bias'\]"),
], ids=["zero-points", "group-indices", "undeclared-bias"])
def test_extra_parts_of_known_weights_are_refused(int4_dir, tmp_path, edit, error):
    """A tensor beside a weight the model has (a bias the config does not declare, the zero points or
    group indices of a scheme mixserve does not implement) is refused by name, not dropped."""
    d = _copy(int4_dir, tmp_path / "c")
    _rewrite(d, edit)
    with pytest.raises(CheckpointError, match=r"unexpected tensor\(s\).*" + error):
        mixserve.load(str(d), progress=False)


def _edit_config(directory, edit):
    path = os.path.join(directory, "config.json")
    config = json.loads(open(path).read())
    edit(config)
    open(path, "w").write(json.dumps(config))


def test_quantizing_into_the_source_directory_is_refused_before_writing(bf16_dir, tmp_path):
    """Its shards would be rewritten while still read (a bus error, the BF16 weights gone)."""
    d = _copy(bf16_dir, tmp_path / "c")
    before = {name: open(os.path.join(d, name), "rb").read() for name in os.listdir(d)}
    with pytest.raises(CheckpointError, match="is the source checkpoint"):
        quantize_checkpoint(d, os.path.join(d, "."), plan_for(WeightFormat("int4", 32), "experts"))
    assert {name: open(os.path.join(d, name), "rb").read() for name in os.listdir(d)} == before


def test_non_finite_weights_are_refused_before_quantizing(bf16_dir, tmp_path):
    """One inf used to turn its whole 128 x 128 FP8 block (or INT4 group) into NaN without a word.
    A weight the plan keeps in BF16 may hold anything: it is copied, not scaled."""
    d = _copy(bf16_dir, tmp_path / "c")
    unit, kept = _UNIT + ".weight", "model.layers.0.self_attn.o_proj.weight"

    def poison(t):
        t[unit][1, 2] = np.inf
        t[kept][0, 0] = np.nan
    _rewrite(d, poison)
    for fmt in (WeightFormat("int4", 32), WeightFormat("fp8_block")):
        with pytest.raises(ValueError, match=rf"{re.escape(unit)} has 1 non-finite value"):
            quantize_checkpoint(d, str(tmp_path / fmt.kind), plan_for(fmt, "experts"))
    model = mixserve.load(d, dtype="float32", progress=False)
    with pytest.raises(ValueError, match="layers_1/mlp/experts/gate_proj has 1 non-finite"):
        quantize_model(model, plan_for(WeightFormat("int4", 32), "experts"))


def test_layers_past_the_config_are_refused_unless_they_are_mtp_layers(bf16_dir, tmp_path):
    """A config with one layer fewer than stored used to drop the last layer silently (other
    logits). Only the num_nextn_predict_layers MTP layers after the decoder are skipped."""
    d = _copy(bf16_dir, tmp_path / "c")
    layers = json.loads(open(os.path.join(d, "config.json")).read())["num_hidden_layers"]
    _edit_config(d, lambda c: c.update(num_hidden_layers=layers - 1, num_nextn_predict_layers=0))
    with pytest.raises(CheckpointError, match=rf"unexpected tensor\(s\).*model\.layers\.{layers - 1}\."):
        mixserve.load(d, progress=False)
    _edit_config(d, lambda c: c.update(num_nextn_predict_layers=1))  # now it is the MTP layer
    assert mixserve.load(d, progress=False).config.num_layers == layers - 1


def test_an_index_without_a_weight_map_and_a_contradictory_router_are_named(bf16_dir, tmp_path):
    d = _copy(bf16_dir, tmp_path / "c")
    open(os.path.join(d, "model.safetensors.index.json"), "w").write(json.dumps({"metadata": {}}))
    with pytest.raises(CheckpointError, match="model.safetensors.index.json: no weight_map"):
        mixserve.load(d, progress=False)
    os.remove(os.path.join(d, "model.safetensors.index.json"))
    _edit_config(d, lambda c: c.update(n_routed_experts=4))  # n_group 4, topk_group 2: 1 expert per group
    with pytest.raises(ValueError, match="top 2 experts: n_routed_experts=4 / n_group=4"):
        mixserve.load(d, progress=False)


def test_quantize_cli_reports_bad_arguments_as_usage_errors(bf16_dir, tmp_path, capsys):
    from mixserve.quantize import main
    for extra, message in ((["--method", "gptq", "--seq-len", "0"], "1 <= seq_len <= tokens"),
                           (["--method", "gptq", "--calibration-tokens", "5"], "seq_len=128, tokens=5"),
                           (["--group-size", "24"], "does not divide"),
                           (["--group-size", "0"], "int4 group_size must be a positive multiple of 8, got 0"),
                           # flags that would change nothing as the others stand
                           (["--format", "fp8", "--group-size", "128"], "--group-size is int4's"),
                           (["--nvfp4-activations"], "--nvfp4-activations quantizes the inputs of --format nvfp4"),
                           (["--seed", "3"], "--seed draw the tokens of --method gptq")):
        with pytest.raises(SystemExit) as exit_:
            main(["--model", bf16_dir, "--out", str(tmp_path / "q"), "--format", "int4", *extra])  # the last --format counts
        assert exit_.value.code == 2 and message in capsys.readouterr().err, extra
