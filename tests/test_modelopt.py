"""NVIDIA ModelOpt NVFP4 checkpoints, as ModelOpt itself quantizes and exports them (tests/modelopt_export.py,
run in a subprocess), and the compressed-tensors W4A4 checkpoints its converter makes of them.

The reference is transformers on the same weights as ModelOpt dequantizes them, so each test checks
mixserve's reading of the format against the tool that writes it.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

import hf_reference as ref
import mixserve
from mixserve.safetensors_io import CheckpointError, index_tensors, load_tensor
from pallas_kernels.nvfp4_matmul import dequantize_nvfp4, from_compressed_tensors
from test_checkpoint import _copy, _rewrite
from test_model_parity import TOL, rel_err, tie_free_ids

EXPORT = os.path.join(os.path.dirname(__file__), "modelopt_export.py")
W4A4 = "quantizes activations to NVFP4 \\(W4A4\\); mixserve serves it weight-only"
KV = "declares a quantized KV cache"
# One model of each family; Kimi and GLM-5 also with ModelOpt's FP8 KV cache calibration.
FAMILIES = {"kimi-yarn-groups": True, "glm4-qknorm-bias": False, "glm5-dsa-shared": True}
_EXPORTED: dict[str, str] = {}


def exported(name: str, tmp_path_factory) -> str:
    """OUT with OUT/modelopt and OUT/dequantized (tests/modelopt_export.py), once per session."""
    if name not in _EXPORTED:
        out = str(tmp_path_factory.mktemp(name))
        subprocess.run([sys.executable, EXPORT, name, out] + (["--kv-fp8"] if FAMILIES[name] else []),
                       check=True, capture_output=True)
        _EXPORTED[name] = out
    return _EXPORTED[name]


def load(directory: str, *notices: str):
    """mixserve.load in float32, asserting that its notices (checkpoint.check_quantization_config)
    match `notices`, one each."""
    with pytest.warns(UserWarning) as record:
        model = mixserve.load(directory, dtype="float32", progress=False)
    messages = [str(w.message) for w in record if str(w.message).startswith("the checkpoint ")]
    assert len(messages) == len(notices) and all(re.search(n, m) for n, m in zip(notices, messages)), messages
    return model


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_modelopt_nvfp4_matches_transformers_on_modelopt_dequantized_weights(name, tmp_path_factory):
    """Every linear layer ModelOpt quantized (attention, indexer, dense and shared MLPs, routed experts)
    loads as NVFP4 and the logits equal transformers' on ModelOpt's own dequantization of the export.
    TOL is the float32 parity bound of test_model_parity: the weights agree to a few float32 ulps
    (test_modelopt_weight_decode_matches_modelopt), far below it."""
    out = exported(name, tmp_path_factory)
    notices = (W4A4, KV) if FAMILIES[name] else (W4A4,)
    model = load(os.path.join(out, "modelopt"), *notices)
    assert str(model.plan) == "experts=nvfp4, linear=nvfp4"
    hf = transformers.AutoModelForCausalLM.from_pretrained(os.path.join(out, "dequantized"), dtype=torch.float32).eval()
    hf.config._attn_implementation = "eager"
    ids = tie_free_ids(hf, name)  # a DSA top-k boundary tie would pick tokens by rounding
    assert rel_err(model.logits(jnp.asarray(ids)), ref.reference_logits(hf, ids)) < TOL


def test_modelopt_weight_decode_matches_modelopt(tmp_path_factory):
    """Each exported unit decodes as ModelOpt's NVFP4QTensor.dequantize does: e2m1 * (scale * weight_scale_2).
    mixserve keeps compressed-tensors' global scale g = fl(1 / weight_scale_2) and multiplies by
    fl(1 / g): at most two roundings (2u, u = 2^-24) from weight_scale_2, then scale * that and
    e2m1 * that round once each on both sides: |ours - theirs| <= 6u |theirs|."""
    out = exported("glm5-dsa-shared", tmp_path_factory)
    disk = {k: np.asarray(load_tensor(v)) for k, v in index_tensors(os.path.join(out, "modelopt")).items()}
    want = {k: np.asarray(load_tensor(v)) for k, v in index_tensors(os.path.join(out, "dequantized")).items()}
    units = [k.removesuffix(".weight_scale_2") for k in disk if k.endswith(".weight_scale_2")]
    assert len(units) > 20
    exact = 0
    for unit in units:
        packed, scales, global_scale = from_compressed_tensors(
            disk[f"{unit}.weight"], disk[f"{unit}.weight_scale"], 1 / disk[f"{unit}.weight_scale_2"].reshape(1))
        ours = np.asarray(dequantize_nvfp4(jnp.asarray(packed), jnp.asarray(scales), jnp.asarray(global_scale), jnp.float32)).T
        theirs = want[f"{unit}.weight"]
        assert np.all(np.abs(ours - theirs) <= 6 * 2.0**-24 * np.abs(theirs)), unit
        exact += np.array_equal(ours, theirs)
    assert np.any(want[f"{units[0]}.weight"] != 0)
    print(f"{exact} of {len(units)} units bit-equal")


def test_compressed_tensors_conversion_of_modelopt_loads_the_same(tmp_path_factory, tmp_path):
    """compressed-tensors' own ModelOpt converter makes a W4A4 nvfp4-pack-quantized checkpoint
    (weight_global_scale = 1 / weight_scale_2 as a scalar, input_global_scale): it loads to the same
    parameters, bit for bit, with the same notice."""
    from compressed_tensors.entrypoints.convert import ModelOptNvfp4Converter, convert_checkpoint

    src = os.path.join(exported("glm4-qknorm-bias", tmp_path_factory), "modelopt")
    exclude = json.load(open(os.path.join(src, "hf_quant_config.json")))["quantization"]["exclude_modules"]
    dst = str(tmp_path / "ct")
    convert_checkpoint(src, dst, ModelOptNvfp4Converter(ignore=exclude, targets=["re:.*_proj$"]), max_workers=1,
                       device="cpu")
    quant = json.load(open(os.path.join(dst, "config.json")))["quantization_config"]
    assert quant["format"] == "nvfp4-pack-quantized"
    assert all(group["input_activations"]["num_bits"] == 4 for group in quant["config_groups"].values())
    assert any(k.endswith("input_global_scale") for k in index_tensors(dst))
    a, b = load(dst, W4A4), load(src, W4A4)
    assert a.plan == b.plan
    leaves_a, leaves_b = jax.tree.leaves(a.params), jax.tree.leaves(b.params)
    assert len(leaves_a) == len(leaves_b) and all(np.array_equal(x, y) for x, y in zip(leaves_a, leaves_b))


def test_hf_quant_config_alone_is_read(tmp_path_factory, tmp_path):
    """ModelOpt before 0.29 wrote the quantization only to hf_quant_config.json."""
    d = _copy(os.path.join(exported("glm4-qknorm-bias", tmp_path_factory), "modelopt"), tmp_path / "c")
    path = os.path.join(d, "config.json")
    config = json.load(open(path))
    del config["quantization_config"]
    json.dump(config, open(path, "w"))
    assert str(load(str(d), W4A4).plan) == "experts=nvfp4, linear=nvfp4"


def _edit_both_configs(directory, edit):
    """Apply edit to the quantization in config.json and hf_quant_config.json alike."""
    for name, key in (("config.json", "quantization_config"), ("hf_quant_config.json", "quantization")):
        path = os.path.join(directory, name)
        config = json.load(open(path))
        edit(config[key])
        json.dump(config, open(path, "w"))


@pytest.mark.parametrize("edit,error", [
    (lambda q: q.update(quant_algo="FP8"), r"quant_algo 'FP8' \(mixserve reads ModelOpt 'NVFP4'\)"),
    (lambda q: q.update(quant_algo="NVFP4_AWQ"), r"quant_algo 'NVFP4_AWQ'"),
    (lambda q: q.update(quant_algo="MIXED_PRECISION"), r"quant_algo 'MIXED_PRECISION'"),
    (lambda q: q.update(group_size=32), r"group_size \[16, 32\] \(NVFP4 groups are 16\)"),
], ids=["fp8", "awq", "mixed", "group-32"])
def test_other_modelopt_schemes_are_refused(tmp_path_factory, tmp_path, edit, error):
    d = _copy(os.path.join(exported("glm4-qknorm-bias", tmp_path_factory), "modelopt"), tmp_path / "c")
    _edit_both_configs(d, edit)
    with pytest.raises(CheckpointError, match="unsupported quantization_config: " + error):
        mixserve.load(str(d), progress=False)


def test_undeclared_scales_are_refused(tmp_path_factory, tmp_path):
    """KV and input scales are left out only where the config declares what they calibrate:
    without kv_cache_quant_algo, ModelOpt's k_scale is an unexpected tensor, as before."""
    d = _copy(os.path.join(exported("kimi-yarn-groups", tmp_path_factory), "modelopt"), tmp_path / "c")
    _edit_both_configs(d, lambda q: (q.pop("kv_cache_scheme", None), q.update(kv_cache_quant_algo=None)))
    with pytest.raises(CheckpointError, match=r"unexpected tensor\(s\) in the checkpoint: .*self_attn\.k_proj\.k_scale"):
        mixserve.load(str(d), progress=False)


def test_modelopt_pack_without_its_scale_2_is_named(tmp_path_factory, tmp_path):
    """A uint8 `weight` whose weight_scale_2 is missing is not read as a dense weight."""
    d = _copy(os.path.join(exported("glm4-qknorm-bias", tmp_path_factory), "modelopt"), tmp_path / "c")
    unit = "model.layers.1.mlp.experts.3.up_proj"
    _rewrite(d, lambda t: t.pop(f"{unit}.weight_scale_2"))
    with pytest.raises(CheckpointError, match=rf"{unit}"):
        mixserve.load(str(d), progress=False)
