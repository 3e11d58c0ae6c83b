"""Checkpoint formats (FP8 block, INT4 compressed-tensors) and clear errors for bad checkpoints."""

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hf_reference as ref
import mixserve
from mixserve.model import Model
from mixserve.quantize import plan_for, quantize_checkpoint
from mixserve.safetensors_io import CheckpointError, index_tensors, load_tensor, write_safetensors
from models.weights import Fp8BlockWeight, Int4Weight, WeightFormat, dequantize


@pytest.fixture(scope="module")
def bf16_dir(tmp_path_factory):
    model = ref.build("kimi-yarn-groups")
    path = tmp_path_factory.mktemp("bf16")
    ref.save(model, path)
    return str(path)


def _dequantized_twin(model: Model) -> Model:
    params = jax.tree.map(lambda w: dequantize(w, jnp.float32), model.params,
                          is_leaf=lambda x: isinstance(x, (Fp8BlockWeight, Int4Weight)))
    return Model(model.config, params, dtype=jnp.float32)


@pytest.mark.parametrize("fmt,scope", [
    (WeightFormat("fp8_block"), "all"),
    (WeightFormat("int4", 32), "experts"),
    (WeightFormat("int4", 8), "all"),
])
def test_quantized_checkpoint_loads_and_tracks_bf16(bf16_dir, tmp_path, fmt, scope):
    """Two checks. (1) Exact: the quantized checkpoint's logits equal those of the BF16 model with
    each weight replaced by its dequantized value (same float32 arithmetic: < 1e-6), so loading
    adds no error beyond the format. (2) The format's own error: each weight's RTN error is at most
    half a quantization step (FP8 e4m3: 2^-4 relative; INT4: scale/2 = group absmax/15), with RMS
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
    flat_q = dict(jax.tree_util.tree_flatten_with_path(quant.params, is_leaf=lambda x: isinstance(x, (Fp8BlockWeight, Int4Weight)))[0])
    flat_b = dict(jax.tree_util.tree_flatten_with_path(base.params)[0])
    for path, w in flat_q.items():
        if isinstance(w, (Fp8BlockWeight, Int4Weight)):
            orig = flat_b[path]
            errs.append(float(jnp.linalg.norm(w.dequantize(jnp.float32) - orig) / jnp.linalg.norm(orig)))
    r = float(np.sqrt(np.mean(np.square(errs))))
    n = (6 if scope == "all" else 3) * base.config.num_layers
    err = float(np.linalg.norm(lq - lb) / np.linalg.norm(lb))
    assert 0 < err < 2 * np.sqrt(n) * r, f"{fmt}: logit error {err:.3f}, weight error r={r:.3f}, n={n}"


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def _rewrite(directory, edit):
    """Apply edit(dict of tensors) to the single-file checkpoint in directory (tensors are copied
    out of the memory map first: the file is rewritten in place)."""
    path = os.path.join(directory, "model.safetensors")
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


def test_corrupt_int4_pack_is_named(bf16_dir, tmp_path):
    q = tmp_path / "q"
    quantize_checkpoint(bf16_dir, str(q), plan_for(WeightFormat("int4", 32), "experts"))
    files = list(q.glob("*.safetensors"))
    assert len(files) == 1
    name = "model.layers.1.mlp.experts.0.gate_proj"

    def rewrite(edit):
        tensors = {k: np.array(load_tensor(v)) for k, v in index_tensors(str(q)).items()}
        edit(tensors)
        write_safetensors(str(files[0]), tensors)

    rewrite(lambda t: t.pop(f"{name}.weight_scale"))
    with pytest.raises(CheckpointError, match=f"{name}.weight_scale"):
        mixserve.load(str(q), progress=False)
    quantize_checkpoint(bf16_dir, str(q), plan_for(WeightFormat("int4", 32), "experts"))
    rewrite(lambda t: t.__setitem__(f"{name}.weight_packed", t[f"{name}.weight_packed"][:, :-1]))
    with pytest.raises(CheckpointError, match=f"{name}.weight_packed"):
        mixserve.load(str(q), progress=False)
    quantize_checkpoint(bf16_dir, str(q), plan_for(WeightFormat("int4", 32), "experts"))
    rewrite(lambda t: t.__setitem__(f"{name}.weight_scale", np.ones((32, 3), np.float32)))
    with pytest.raises(CheckpointError, match=f"{name}"):
        mixserve.load(str(q), progress=False)


def test_quantizer_rejects_group_not_dividing(bf16_dir, tmp_path):
    with pytest.raises(CheckpointError, match="does not divide"):
        quantize_checkpoint(bf16_dir, str(tmp_path), plan_for(WeightFormat("int4", 24), "experts"))


def test_int4_weight_shape_must_match_the_pack(bf16_dir, tmp_path):
    q = tmp_path / "q"
    quantize_checkpoint(bf16_dir, str(q), plan_for(WeightFormat("int4", 32), "experts"))
    (path,) = q.glob("*.safetensors")
    tensors = {k: np.array(load_tensor(v)) for k, v in index_tensors(str(q)).items()}
    name = "model.layers.2.mlp.experts.5.down_proj"
    tensors[f"{name}.weight_shape"] = np.array([64, 64], np.int64)
    write_safetensors(str(path), tensors)
    with pytest.raises(CheckpointError, match=rf"{name}\.weight_shape says \(64, 64\), weight_packed holds \(64, 32\)"):
        mixserve.load(str(q), progress=False)
