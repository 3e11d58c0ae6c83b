"""NVIDIA ModelOpt NVFP4 checkpoints, as ModelOpt itself quantizes and exports them (tests/modelopt_export.py,
run in a subprocess), and the compressed-tensors W4A4 checkpoints its converter makes of them.

The reference is transformers on the same weights as ModelOpt dequantizes them, so each test checks
mixserve's reading of the format against the tool that writes it.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import subprocess
import sys
import types
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

import hf_reference as ref
import mixserve
from compressed_tensors.quantization import QuantizationArgs
from compressed_tensors.quantization.lifecycle.forward import fake_quantize
from compressed_tensors.quantization.utils.helpers import calculate_qparams
from mixserve.quantize import quantize_checkpoint
from mixserve.safetensors_io import CheckpointError, index_tensors, load_tensor
from models.weights import WeightFormat, WeightPlan
from pallas_kernels.nvfp4_matmul import dequantize_nvfp4, from_compressed_tensors
from test_checkpoint import _copy, _rewrite
from test_model_parity import TOL, rel_err, tie_free_ids

EXPORT = os.path.join(os.path.dirname(__file__), "modelopt_export.py")
W4A4 = "quantizes activations to NVFP4 \\(W4A4\\); mixserve serves it weight-only"
KV = "declares a quantized KV cache"
# One model of each family; Kimi and GLM-5 also with ModelOpt's FP8 KV cache calibration.
FAMILIES = {"kimi-yarn-groups": True, "glm4-qknorm-bias": False, "glm5-dsa-shared": True}


def exported(name: str, tmp_path_factory, kv_only: bool = False) -> str:
    """OUT with OUT/modelopt, OUT/dequantized and OUT/plain (tests/modelopt_export.py), once per
    test run: NVFP4 (with FP8 KV scales for FAMILIES[name]), or with kv_only FP8 KV scales alone.
    The run's xdist workers share it (an export is a 10 s subprocess, 6 s of it importing
    ModelOpt): the first to ask writes it under a file lock, the others wait and read it. Tests
    read it; those that edit a checkpoint edit a copy."""
    flags = ["--kv-only"] if kv_only else ["--kv-fp8"] if FAMILIES[name] else []
    run_dir = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):  # each worker's base is a directory of the run's
        run_dir = run_dir.parent
    out = run_dir / f"modelopt-{name}{'-kv-only' if kv_only else ''}"
    with open(f"{out}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not (out / "done").exists():
            shutil.rmtree(out, ignore_errors=True)  # what a failed export left
            subprocess.run([sys.executable, EXPORT, name, str(out), *flags], check=True, capture_output=True)
            (out / "done").touch()
    return str(out)


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
    """Older ModelOpt exports may carry the quantization in hf_quant_config.json alone."""
    d = _copy(os.path.join(exported("glm4-qknorm-bias", tmp_path_factory), "modelopt"), tmp_path / "c")
    path = os.path.join(d, "config.json")
    config = json.load(open(path))
    del config["quantization_config"]
    json.dump(config, open(path, "w"))
    assert str(load(str(d), W4A4).plan) == "experts=nvfp4, linear=nvfp4"


def test_a_modelopt_kv_cache_only_export_serves_and_quantizes_with_its_scales(tmp_path_factory, tmp_path):
    """ModelOpt's export of an FP8 KV calibration alone (quant_algo null, kv_cache_quant_algo FP8,
    self_attn.k_proj.k_scale) holds unquantized weights: it loads as the plain model with its
    per-layer scales, without a notice, and an FP8 engine serves with them. quantize_checkpoint
    takes it as a source, as it takes llm-compressor's KV-only one: the scales and scheme are
    kept, written where and as compressed-tensors reads them."""
    from mixserve.engine import Engine

    out = exported("glm4-qknorm-bias", tmp_path_factory, kv_only=True)
    src = os.path.join(out, "modelopt")
    assert json.load(open(os.path.join(src, "hf_quant_config.json")))["quantization"]["quant_algo"] is None
    disk = {k: np.asarray(load_tensor(v)) for k, v in index_tensors(src).items() if k.endswith(("k_scale", "v_scale"))}
    layers = len(disk) // 2
    written = [np.array([disk[f"model.layers.{i}.self_attn.{kv}_proj.{kv}_scale"] for i in range(layers)]) for kv in "kv"]
    assert layers == 3 and all(np.all(w > 0) for w in written)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model = mixserve.load(src, dtype="float32", progress=False)
    plain = mixserve.load(os.path.join(out, "plain"), dtype="float32", progress=False)
    assert model.plan == plain.plan and str(model.plan) == "experts=bf16, linear=bf16"
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(model.params), jax.tree.leaves(plain.params), strict=True))
    for loaded, want in zip(model.kv_scales, written, strict=True):
        np.testing.assert_array_equal(loaded, want)
    engine = Engine(model, kv_dtype="fp8_e4m3", num_pages=8, page_size=8, max_batch=1, stop_tokens=())
    assert engine.kv_scales_from_checkpoint and np.array_equal(engine.runner.cfg.v_scale, written[1])
    assert len(engine.generate([[3, 1, 4, 1, 5]], max_new_tokens=2)[0].tokens) == 2
    # Also from an older export's hf_quant_config.json alone, whose scheme is the string "FP8".
    older = _copy(src, tmp_path / "older")
    config = json.load(open(os.path.join(older, "config.json")))
    del config["quantization_config"]
    json.dump(config, open(os.path.join(older, "config.json"), "w"))
    for source in (src, str(older)):
        dst = str(tmp_path / f"int4-{os.path.basename(source)}")
        quantize_checkpoint(source, dst, WeightPlan(experts=WeightFormat("int4", 16)))
        quant = json.load(open(os.path.join(dst, "config.json")))["quantization_config"]
        scheme = QuantizationArgs.model_validate(quant["kv_cache_scheme"])
        assert (scheme.num_bits, scheme.type, scheme.strategy, scheme.dynamic) == (8, "float", "tensor", False)
        names = {k for k in index_tensors(dst) if k.endswith(("k_scale", "v_scale"))}
        assert names == {f"model.layers.{i}.self_attn.{kv}_scale" for i in range(layers) for kv in "kv"}
        quantized = mixserve.load(dst, dtype="float32", progress=False)
        assert str(quantized.plan) == "experts=int4-g16, linear=bf16"
        for loaded, want in zip(quantized.kv_scales, written, strict=True):
            np.testing.assert_array_equal(loaded, want)


def _edit_both_configs(directory, edit):
    """Apply edit to the quantization in config.json and hf_quant_config.json alike."""
    for name, key in (("config.json", "quantization_config"), ("hf_quant_config.json", "quantization")):
        path = os.path.join(directory, name)
        config = json.load(open(path))
        edit(config[key])
        json.dump(config, open(path, "w"))


@pytest.mark.parametrize("edit,error", [
    (lambda q: q.update(quant_algo="FP8"), r"quant_algo 'FP8' \(mixserve reads ModelOpt NVFP4 and W4A16_NVFP4\)"),
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


_UNIT = "model.layers.1.mlp.experts.3.up_proj"
_NORM = "model.layers.1.input_layernorm"


def _set(name, value):
    return lambda t: t.__setitem__(name, np.asarray(value, np.float32))


def _dense_beside_scale_2(t):
    t[f"{_UNIT}.weight"] = np.ones((32, 64), np.float32)
    del t[f"{_UNIT}.weight_scale"]


@pytest.mark.parametrize("edit,error", [
    (lambda t: t.pop(f"{_UNIT}.weight_scale_2"), rf"{_UNIT}\.weight_scale_2 or \.weight_global_scale \(its weight is U8"),
    (_dense_beside_scale_2, rf"{_UNIT}\.weight_packed \(its weight is F32 beside a weight_scale_2"),
    (_set(f"{_UNIT}.weight_scale_2", np.inf), rf"{_UNIT}\.weight_scale_2 is inf: a per-matrix scale is finite and positive"),
    (_set(f"{_UNIT}.weight_scale_2", np.nan), rf"{_UNIT}\.weight_scale_2 is nan"),
    (_set(f"{_UNIT}.weight_scale_2", -1e-4), rf"{_UNIT}\.weight_scale_2 is -0.0001"),
    (_set(f"{_UNIT}.weight_scale_2", [[1e-4]]), rf"{_UNIT}\.weight_scale_2 has shape \(1, 1\), expected \(\) or \(1,\)"),
    (_set(f"{_UNIT}.weight_global_scale", [1.0]), rf"{_UNIT} has both weight_scale_2 \(ModelOpt\) and weight_global_scale"),
    (lambda t: t.__setitem__(f"{_UNIT}.weight_scale", t[f"{_UNIT}.weight_scale"][:, :2]),
     rf"{_UNIT}\.weight_scale has shape \(32, 2\) where {_UNIT}\.weight_packed \(32, 32\) holds 64 inputs"),
    (lambda t: t.__setitem__(f"{_UNIT}.weight_packed", t[f"{_UNIT}.weight"]), rf"unexpected tensor.*{_UNIT}\.weight'"),
    (_set(f"{_NORM}.input_scale", 1.0), rf"unexpected tensor.*{_NORM}\.input_scale"),  # dropped only on NVFP4 layers
    (_set("model.layers.1.mlp.shared_experts.up_proj.k_scale", 1.0), r"unexpected tensor.*shared_experts\.up_proj\.k_scale"),
], ids=["no-scale-2", "dense-weight", "inf", "nan", "negative", "shape-1x1", "both-globals", "scale-shape",
        "pack-twice", "norm-input-scale", "kv-scale-off-attention"])
def test_inconsistent_modelopt_tensors_are_named(tmp_path_factory, tmp_path, edit, error):
    """Each of these would load as other weights than ModelOpt's (or as NaN): refused before the
    packs are read, naming the tensor."""
    d = _copy(os.path.join(exported("glm4-qknorm-bias", tmp_path_factory), "modelopt"), tmp_path / "c")
    _edit_both_configs(d, lambda q: q.update(kv_cache_quant_algo="FP8"))
    _rewrite(d, edit)
    with pytest.raises(CheckpointError, match=error):
        mixserve.load(str(d), progress=False)


def test_scales_are_checked_where_a_unit_loads_dequantized(tmp_path_factory, tmp_path):
    """With one attention projection kept dense, the other linear layers load dequantized: their
    scales' shapes are checked as on the NVFP4 path."""
    out = exported("glm4-qknorm-bias", tmp_path_factory)
    d = _copy(os.path.join(out, "modelopt"), tmp_path / "c")
    dense = "model.layers.0.self_attn.o_proj"
    weight = np.array(load_tensor(index_tensors(os.path.join(out, "dequantized"))[f"{dense}.weight"]))
    unit = "model.layers.0.self_attn.q_proj"
    _rewrite(d, lambda t: ([t.pop(f"{dense}.{p}") for p in ("weight_scale", "weight_scale_2", "input_scale")],
                           t.__setitem__(f"{dense}.weight", weight),
                           t.__setitem__(f"{unit}.weight_scale", t[f"{unit}.weight_scale"][:, :2])))
    with pytest.raises(CheckpointError, match=rf"{unit}\.weight_scale has shape \(64, 2\)"):
        mixserve.load(str(d), progress=False)


def test_an_all_zero_weight_loads_as_zeros(tmp_path_factory, tmp_path):
    """ModelOpt exports a weight whose largest magnitude is 0 with weight_scale_2 = 0, NaN e4m3
    scales (0 / 0) and codes saturated at 6 (what ModelOpt 0.47 wrote for an all-zero expert): it
    loads as the zeros it was, where ModelOpt's own dequantization gives NaN. A NaN scale beside a
    positive weight_scale_2 has no such reading and is refused."""
    d = _copy(os.path.join(exported("glm4-qknorm-bias", tmp_path_factory), "modelopt"), tmp_path / "c")
    nan_scales = lambda t: np.full(t[f"{_UNIT}.weight_scale"].shape, np.nan, np.float32).astype(
        t[f"{_UNIT}.weight_scale"].dtype)
    _rewrite(d, lambda t: t.update({f"{_UNIT}.weight_scale_2": np.float32(0), f"{_UNIT}.weight_scale": nan_scales(t),
                                    f"{_UNIT}.weight": np.full_like(t[f"{_UNIT}.weight"], 0x77)}))
    model = load(str(d), W4A4)
    up = model.params["layers_1"]["mlp"]["experts"]["up_proj"].dequantize(jnp.float32)
    assert np.all(np.asarray(up[3]) == 0) and np.any(np.asarray(up[2]) != 0)
    assert np.all(np.isfinite(np.asarray(model.logits(jnp.asarray([[1, 2, 3]])))))
    _rewrite(d, lambda t: t.update({f"{_UNIT}.weight_scale_2": np.float32(1e-4)}))
    with pytest.raises(CheckpointError, match=rf"{_UNIT}\.weight_scale holds NaN"):
        mixserve.load(str(d), progress=False)


def test_weight_only_modelopt_nvfp4_loads(tmp_path_factory, tmp_path):
    """ModelOpt's W4A16_NVFP4 (NVFP4 weights, activations unquantized: no input scales) loads as the
    same weights, with no W4A4 notice; NVFP4 activations cannot be asked of it."""
    src = os.path.join(exported("glm4-qknorm-bias", tmp_path_factory), "modelopt")
    d = _copy(src, tmp_path / "c")
    _edit_both_configs(d, lambda q: (q.update(quant_algo="W4A16_NVFP4"),
                                     [g.pop("input_activations") for g in q.get("config_groups", {}).values()]))
    _rewrite(d, lambda t: [t.pop(k) for k in list(t) if k.endswith(".input_scale")])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        a = mixserve.load(str(d), dtype="float32", progress=False)
    b = load(src, W4A4)
    assert a.plan == b.plan and all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a.params), jax.tree.leaves(b.params)))
    with pytest.raises(CheckpointError, match="declares no NVFP4 activations"):
        mixserve.load(str(d), progress=False, nvfp4_activations=True)
    _edit_both_configs(d, lambda q: [g["weights"].update(num_bits=8) for g in q.get("config_groups", {}).values()])
    with pytest.raises(CheckpointError, match=r"config_groups\.group_0\.weights\.num_bits 8 \(expected 4\)"):
        mixserve.load(str(d), progress=False)


# ---- W4A4: NVFP4 activations, as an FP4 tensor-core GPU computes them ------------------------------

_NVFP4_ACTS = QuantizationArgs(num_bits=4, type="float", strategy="tensor_group", group_size=16, symmetric=True,
                               dynamic="local", scale_dtype=torch.float8_e4m3fn)


def ct_fake_quantize(x: torch.Tensor, input_global_scale: torch.Tensor) -> torch.Tensor:
    """compressed-tensors' own NVFP4 activation quantization (W4A4 as llm-compressor simulates it):
    e4m3 scales from each token's groups of 16, under the calibrated global scale."""
    flat = x.reshape(-1, x.shape[-1])
    groups = flat.reshape(flat.shape[0], -1, 16)
    scale, zero = calculate_qparams(groups.amin(-1), groups.amax(-1), _NVFP4_ACTS, global_scale=input_global_scale)
    return fake_quantize(flat, scale, zero, _NVFP4_ACTS, global_scale=input_global_scale).reshape(x.shape)


def _quantized_experts_forward(gate_up_g_E, down_g_E):
    """transformers' fused-experts forward with each expert's inputs fake-quantized under its scales."""
    def forward(self, hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states)
        for e in range(self.num_experts):
            token_idx, top_k_pos = torch.where(top_k_index == e)
            if token_idx.numel() == 0:
                continue
            x = ct_fake_quantize(hidden_states[token_idx], gate_up_g_E[e])
            gate, up = torch.nn.functional.linear(x, self.gate_up_proj[e]).chunk(2, dim=-1)
            h = ct_fake_quantize(self.act_fn(gate) * up, down_g_E[e])
            y = torch.nn.functional.linear(h, self.down_proj[e]) * top_k_weights[token_idx, top_k_pos, None]
            out.index_add_(0, token_idx, y.to(out.dtype))
        return out
    return forward


def w4a4_reference(out: str, experts_only: bool = False):
    """transformers on ModelOpt's dequantized weights, each quantized layer's input fake-quantized by
    compressed-tensors under the checkpoint's input scale (1 / input_scale, as its converter maps
    it), except what mixserve keeps weight-only: kv_b_proj (absorbed MLA) and weights_proj (and,
    experts_only, every layer but the routed experts)."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(os.path.join(out, "dequantized"), dtype=torch.float32).eval()
    hf.config._attn_implementation = "eager"
    disk = {k: np.asarray(load_tensor(v)) for k, v in index_tensors(os.path.join(out, "modelopt")).items()
            if k.endswith(".input_scale")}
    g = {k.removesuffix(".input_scale"): torch.tensor(1 / v.reshape(1)) for k, v in disk.items()}
    for name, module in hf.named_modules():
        if name in g and not name.endswith(("kv_b_proj", "weights_proj")) and not experts_only:
            module.register_forward_pre_hook(lambda m, args, s=g[name]: (ct_fake_quantize(args[0], s),))
        if name.endswith("mlp.experts"):
            stack = lambda proj: [g[f"{name}.{e}.{proj}"] for e in range(module.num_experts)]
            assert all(torch.equal(a, b) for a, b in zip(stack("gate_proj"), stack("up_proj")))  # one input
            module.forward = types.MethodType(_quantized_experts_forward(stack("gate_proj"), stack("down_proj")), module)
    return hf


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_nvfp4_activations_match_compressed_tensors_w4a4(name, tmp_path_factory):
    """load(nvfp4_activations=True) computes what compressed-tensors' W4A4 simulation computes on the
    same checkpoint, within the float32 parity bound. Served weight-only, the same checkpoint is far
    from it (0.1 in these models), so the bound tells the two apart."""
    out = exported(name, tmp_path_factory)
    hf = w4a4_reference(out)
    ids = tie_free_ids(hf, name)
    want = ref.reference_logits(hf, ids)
    notices = (KV,) if FAMILIES[name] else ()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        w4a4 = mixserve.load(os.path.join(out, "modelopt"), dtype="float32", progress=False, nvfp4_activations=True)
    messages = [str(w.message) for w in record if str(w.message).startswith("the checkpoint ")]
    assert len(messages) == len(notices) and all(re.search(n, m) for n, m in zip(notices, messages)), messages
    assert str(w4a4.plan) == "experts=nvfp4-w4a4, linear=nvfp4-w4a4"
    assert rel_err(w4a4.logits(jnp.asarray(ids)), want) < TOL
    weight_only = load(os.path.join(out, "modelopt"), *((W4A4, KV) if FAMILIES[name] else (W4A4,)))
    assert rel_err(weight_only.logits(jnp.asarray(ids)), want) > 100 * TOL


def test_nvfp4_activations_need_declared_input_scales(tmp_path_factory, tmp_path):
    """Nothing to quantize activations with: a preset, a W4A16 checkpoint, or a category whose NVFP4
    layers load dequantized (beside another format) is refused by name."""
    out = exported("glm4-qknorm-bias", tmp_path_factory)
    w4a4 = WeightFormat("nvfp4", w4a4=True)
    for kw in (dict(nvfp4_activations=True), dict(plan=WeightPlan(experts=w4a4, linear=w4a4))):
        with pytest.raises(ValueError, match="calibrated input scales, which a preset has none of"):
            mixserve.load("tiny-glm4", **kw)
    w4a16 = str(tmp_path / "w4a16")
    quantize_checkpoint(os.path.join(out, "plain"), w4a16, WeightPlan(experts=WeightFormat("nvfp4")))
    with pytest.raises(CheckpointError, match="declares no NVFP4 activations"):
        mixserve.load(w4a16, progress=False, nvfp4_activations=True)
    mixed = _copy(os.path.join(out, "modelopt"), tmp_path / "mixed")
    unit = "model.layers.0.self_attn.o_proj"
    dense = load_tensor(index_tensors(os.path.join(out, "dequantized"))[f"{unit}.weight"])
    _rewrite(mixed, lambda t: ([t.pop(f"{unit}.{p}") for p in ("weight_scale", "weight_scale_2", "input_scale")],
                               t.__setitem__(f"{unit}.weight", np.array(dense))))
    assert str(load(str(mixed), W4A4).plan) == "experts=nvfp4, linear=bf16"  # weight-only: dequantized, as before
    everything_mixed = _copy(mixed, tmp_path / "everything")
    expert = "model.layers.1.mlp.experts.0.down_proj"
    dense = load_tensor(index_tensors(os.path.join(out, "dequantized"))[f"{expert}.weight"])
    _rewrite(everything_mixed, lambda t: ([t.pop(f"{expert}.{p}") for p in ("weight_scale", "weight_scale_2", "input_scale")],
                                          t.__setitem__(f"{expert}.weight", np.array(dense))))
    with pytest.raises(CheckpointError, match="no category of layers .* is NVFP4 alone"):
        mixserve.load(str(everything_mixed), progress=False, nvfp4_activations=True)


def test_nvfp4_activations_where_a_category_mixes_formats(tmp_path_factory, tmp_path):
    """As NVIDIA's DeepSeek-R1 NVFP4 keeps some layers' attention in BF16: the other linear layers then
    load dequantized and run weight-only (a warning says so), and the routed experts, NVFP4 alone, run
    W4A4: the logits equal compressed-tensors' simulation with only the experts' inputs quantized."""
    out = exported("glm4-qknorm-bias", tmp_path_factory)
    mixed = _copy(os.path.join(out, "modelopt"), tmp_path / "mixed")
    unit = "model.layers.0.self_attn.o_proj"
    dense = load_tensor(index_tensors(os.path.join(out, "dequantized"))[f"{unit}.weight"])
    _rewrite(mixed, lambda t: ([t.pop(f"{unit}.{p}") for p in ("weight_scale", "weight_scale_2", "input_scale")],
                               t.__setitem__(f"{unit}.weight", np.array(dense))))
    with pytest.warns(UserWarning, match=r"linear layers mix NVFP4 with \['bf16'\]: they load dequantized and run weight-only"):
        model = mixserve.load(str(mixed), dtype="float32", progress=False, nvfp4_activations=True)
    assert str(model.plan) == "experts=nvfp4-w4a4, linear=bf16"
    hf = w4a4_reference(out, experts_only=True)
    ids = tie_free_ids(hf, "glm4-qknorm-bias")
    want = ref.reference_logits(hf, ids)
    assert rel_err(model.logits(jnp.asarray(ids)), want) < TOL
    assert rel_err(model.logits(jnp.asarray(ids)), ref.reference_logits(w4a4_reference(out), ids)) > 100 * TOL


W4A4_SHARDED = """
import sys
model = mixserve.load(sys.argv[1], dtype="float32", progress=False, nvfp4_activations=True)
ids = np.asarray([prompts[3]]) % 160  # the tiny export's vocabulary
rel = lambda a, b: float(np.linalg.norm(np.asarray(a) - b) / np.linalg.norm(b))
one = np.asarray(model.logits(ids))
assert rel(mixserve.load(sys.argv[1], dtype="float32", progress=False).logits(ids), one) > 0.01  # weight-only
mesh = sharding.tp_mesh(4)
for ep in (False, True):
    placed = sharding.shard_model(dataclasses.replace(model, backend="interpret"), mesh, ep)
    down = placed.params["layers_1"]["mlp"]["experts"]["down_proj"]
    assert down.group_size == (16 if ep else 8)  # TP4: 8-row shares, so activation groups span two devices
    assert down.input_global_scale.addressable_shards[0].data.shape == ((2, 1) if ep else (8, 1))
    with jax.set_mesh(mesh):
        assert rel(placed.logits(ids), one) < 1e-5, ep
print("ok")
"""


def test_nvfp4_activations_under_tensor_and_expert_parallelism(tmp_path_factory):
    """The W4A4 Kimi export placed on 4 of 8 CPU devices, through the Pallas kernels per device
    (interpret), gives one device's logits within float32 rounding (1e-5; served weight-only they
    differ by more than 1e-2, so the check can tell): at TP4, where down_proj's groups of 16 are cut
    to 8 a device (the activations are quantized before the split), and at EP4, each device's
    experts with their own input scales."""
    from test_sharding import run_on_8_devices

    run_on_8_devices(W4A4_SHARDED, os.path.join(exported("kimi-yarn-groups", tmp_path_factory), "modelopt"))


def test_run_serves_nvfp4_activations(tmp_path_factory):
    """`python -m mixserve.run --nvfp4-activations` serves a W4A4 checkpoint with them."""
    from mixserve import run

    model = os.path.join(exported("glm4-qknorm-bias", tmp_path_factory), "modelopt")
    report = run.main(["--model", model, "--nvfp4-activations", "--max-new-tokens", "2", "--json", "--prompt", "hi"])
    assert report["weight_sets"]["prefill"][0] == "experts=nvfp4-w4a4, linear=nvfp4-w4a4"
    assert all(r["status"] == "ok" and len(r["tokens"]) == 2 for r in report["requests"])


@pytest.mark.parametrize("edit,error", [
    (lambda t: t.__setitem__(f"{_UNIT}.input_scale", t[f"{_UNIT}.input_scale"].astype(np.float16)),
     rf"{_UNIT}\.input_scale is F16, where nvfp4 stores F32"),
    (_set(f"{_UNIT}.input_scale", 0.0), rf"{_UNIT}\.input_scale is 0: a per-matrix scale is finite and positive"),
    (lambda t: t.pop(f"{_UNIT}.input_scale"), rf"missing from the checkpoint: {_UNIT}\.input_scale"),
], ids=["f16", "zero", "missing"])
def test_input_scales_are_checked_when_read(tmp_path_factory, tmp_path, edit, error):
    """With nvfp4_activations the input scales are read, and checked as the weights' per-matrix scales
    are (dtype, value, presence under ModelOpt's own name)."""
    d = _copy(os.path.join(exported("glm4-qknorm-bias", tmp_path_factory), "modelopt"), tmp_path / "c")
    _rewrite(d, edit)
    with pytest.raises(CheckpointError, match=error):
        mixserve.load(str(d), progress=False, nvfp4_activations=True)


def test_kv_b_proj_needs_no_input_scale(tmp_path_factory, tmp_path):
    """kv_b_proj runs weight-only, so W4A4 loading neither needs nor reads its input scale."""
    d = _copy(os.path.join(exported("kimi-yarn-groups", tmp_path_factory), "modelopt"), tmp_path / "c")
    _rewrite(d, lambda t: [t.pop(k) for k in list(t) if k.endswith("kv_b_proj.input_scale")])
    model = mixserve.load(str(d), progress=False, nvfp4_activations=True)
    assert model.params["layers_0"]["self_attn"]["kv_b_proj"]["kernel"].input_global_scale is None
