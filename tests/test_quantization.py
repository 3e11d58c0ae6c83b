"""Quantization: the on-disk INT4 pack and NVFP4 quantization against compressed-tensors, GPTQ vs RTN, weight bytes vs the
seed, Orbax round trip. Load-time corruption errors live in test_checkpoint.py; pack/unpack of
the kernel layout in test_kernels_int4.py."""

import base64
import dataclasses
import glob
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hf_reference as ref
import torch
from safetensors import safe_open
from compressed_tensors.compressors.nvfp4.helpers import pack_fp4_to_uint8, unpack_fp4_from_uint8
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32
from compressed_tensors.quantization import QuantizationArgs, preset_name_to_scheme
from compressed_tensors.quantization.lifecycle.forward import quantize as ct_quantize
from compressed_tensors.quantization.utils.helpers import calculate_qparams, generate_gparam
import mixserve
from mixserve.gptq import Calibration, gptq_quantize, reconstruction_error
from mixserve.orbax_io import restore_params, save_params
from mixserve.quantize import main as quantize_main
from mixserve.quantize import FP8_KV_SCHEME, plan_for, quantize_checkpoint, quantize_model
from mixserve.safetensors_io import CheckpointError, index_tensors, load_tensor, write_safetensors
from mixserve.weight_bytes import device_bytes
from models.presets import get_preset
from models.weights import (BF16, Fp8BlockWeight, Int4Weight, Nvfp4Weight, WeightFormat, WeightPlan, expert_matmul,
                            matmul, quantize, reblock)
from pallas_kernels import quantize_nvfp4, quantize_nvfp4_activations
from pallas_kernels.int4_matmul import unpack_nibbles
from pallas_kernels.nvfp4_matmul import E2M1_VALUES, from_compressed_tensors, to_compressed_tensors

GIB = 2**30
EXPERT = "model.layers.1.mlp.experts.3.up_proj"


@pytest.fixture(scope="module")
def bf16_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("bf16")
    ref.save(ref.build("kimi-yarn-groups"), path)
    return str(path)


@pytest.fixture(scope="module")
def wide_model(tmp_path_factory):
    """kimi-yarn-groups with hidden and expert width 128, so groups of 128 divide every expert input."""
    cls, kwargs = ref.CONFIGS["kimi-yarn-groups"]
    ref.CONFIGS["kimi-wide"] = (cls, {**kwargs, "hidden_size": 128, "moe_intermediate_size": 128})
    try:
        path = tmp_path_factory.mktemp("wide")
        ref.save(ref.build("kimi-wide"), path)
    finally:
        del ref.CONFIGS["kimi-wide"]
    return mixserve.load(str(path), dtype="float32", progress=False)


def _disk(directory: str) -> dict[str, np.ndarray]:
    return {k: np.asarray(load_tensor(v)) for k, v in index_tensors(directory).items()}


# ---- the on-disk pack ---------------------------------------------------------------------------


def _spec_unpack(packed_NQ: np.ndarray) -> np.ndarray:
    """compressed-tensors pack-quantized, literally: 8 nibbles per int32, low nibble first, value + 8."""
    words = packed_NQ.view(np.uint32)[..., None]
    return ((words >> (4 * np.arange(8, dtype=np.uint32))) & 15).astype(np.int8).reshape(*packed_NQ.shape[:-1], -1) - 8


def test_written_int4_is_compressed_tensors_pack_quantized(bf16_dir, tmp_path):
    """Every int4 tensor the writer emits decodes, by the spec, to RTN of the BF16 weight: values
    clamp(round(w / s), -8, 7) bit for bit under the stored bf16 scale s, and s = absmax(group) / 7.5
    to bf16 rounding (XLA may divide by multiplying with 1/7.5, one bf16 ulp off a true division).
    The compressed-tensors package's own pack/unpack must agree too."""
    quantize_checkpoint(bf16_dir, str(tmp_path), plan_for(WeightFormat("int4", 32), "experts"))
    src, out = _disk(bf16_dir), _disk(str(tmp_path))
    config = json.load(open(tmp_path / "config.json"))["quantization_config"]
    assert config["format"] == "pack-quantized" and config["config_groups"]["group_0"]["weights"]["group_size"] == 32
    units = sorted(k.removesuffix(".weight_packed") for k in out if k.endswith(".weight_packed"))
    assert units and all(".mlp.experts." in u for u in units)
    for unit in units:
        w_NK = src[unit + ".weight"].astype(np.float32)
        packed_NQ, scale_NG = out[unit + ".weight_packed"], out[unit + ".weight_scale"]
        assert packed_NQ.dtype == np.int32 and tuple(out[unit + ".weight_shape"]) == w_NK.shape
        groups = w_NK.reshape(w_NK.shape[0], -1, 32)
        scale = np.asarray(jnp.asarray(scale_NG, jnp.float32))
        np.testing.assert_allclose(scale, np.abs(groups).max(-1) / 7.5, rtol=2**-8, err_msg=unit)
        expect = np.clip(np.round(groups / scale[..., None]), -8, 7).astype(np.int8).reshape(w_NK.shape)
        np.testing.assert_array_equal(_spec_unpack(packed_NQ), expect, err_msg=unit)
        np.testing.assert_array_equal(pack_to_int32(torch.as_tensor(expect), 4).numpy(), packed_NQ, err_msg=unit)
        np.testing.assert_array_equal(unpack_from_int32(torch.from_numpy(packed_NQ.copy()), 4, w_NK.shape).numpy(),
                                      expect, err_msg=unit)


@pytest.mark.parametrize("shape", [(64, 8), (3, 128, 24)])
def test_nvfp4_quantization_and_pack_match_compressed_tensors(shape):
    """quantize_nvfp4 against the compressed-tensors package (what llm-compressor writes), in
    float32: the same global scale (448 * 6 / amax), the same e4m3 group scales and the same codes,
    bit for bit; to_compressed_tensors gives its pack_fp4_to_uint8 bytes, and both unpackings agree."""
    seed = int.from_bytes(os.urandom(4), "little")
    w = np.random.default_rng(seed).standard_normal(shape).astype(np.float32) * 0.02
    packed, scales, global_scale = quantize_nvfp4(jnp.asarray(w))
    args = QuantizationArgs(num_bits=4, type="float", strategy="tensor_group", group_size=16, symmetric=True,
                            dynamic=False, scale_dtype=torch.float8_e4m3fn)
    for e in range(int(np.prod(shape[:-2], dtype=int))):
        w_NK = torch.from_numpy(w.reshape(-1, *shape[-2:])[e].T.copy())
        amax = w_NK.abs().max()
        g = generate_gparam(-amax, amax)
        groups = w_NK.reshape(w_NK.shape[0], -1, 16)
        scale, zero = calculate_qparams(groups.amin(-1), groups.amax(-1), args, global_scale=g)
        q = ct_quantize(w_NK, scale, zero, args, global_scale=g)  # e2m1 values as float32
        at = (e,) if len(shape) == 3 else ()
        np.testing.assert_array_equal(np.asarray(global_scale)[at], g.numpy().reshape(1), err_msg=f"seed={seed}")
        # compressed-tensors rounds its scales to e4m3 and keeps them in float32.
        np.testing.assert_array_equal(np.asarray(scales[at].astype(jnp.float32)).T, scale.numpy(), err_msg=f"seed={seed}")
        codes_NK = np.asarray(unpack_nibbles(packed[at])).T
        np.testing.assert_array_equal(E2M1_VALUES[codes_NK], q.numpy(), err_msg=f"seed={seed}")
        bytes_NH, scale_NG, g_disk = to_compressed_tensors(packed[at], scales[at], global_scale[at])
        np.testing.assert_array_equal(bytes_NH, pack_fp4_to_uint8(q).numpy(), err_msg=f"seed={seed}")
        unpacked = unpack_fp4_from_uint8(torch.from_numpy(bytes_NH), *w_NK.shape, dtype=torch.float32)
        np.testing.assert_array_equal(unpacked.numpy(), q.numpy(), err_msg=f"seed={seed}")
        back = from_compressed_tensors(bytes_NH, scale_NG, g_disk)
        np.testing.assert_array_equal(back[0], np.asarray(packed[at]))


_NVFP4_ACTS = QuantizationArgs(num_bits=4, type="float", strategy="tensor_group", group_size=16, symmetric=True,
                               dynamic="local", scale_dtype=torch.float8_e4m3fn)


def _ct_nvfp4_activations(x_MK: np.ndarray, g: float) -> tuple[np.ndarray, np.ndarray]:
    """compressed-tensors' NVFP4 activation quantization of rows x (W4A4, dynamic 'local' group
    scales under a static global scale g): (e2m1 values, e4m3 scales as float32 [M, K/16])."""
    x = torch.from_numpy(x_MK)
    groups = x.reshape(x.shape[0], -1, 16)
    global_scale = torch.tensor([g], dtype=torch.float32)
    scale, zero = calculate_qparams(groups.amin(-1), groups.amax(-1), _NVFP4_ACTS, global_scale=global_scale)
    return ct_quantize(x, scale, zero, _NVFP4_ACTS, global_scale=global_scale).numpy(), scale.numpy()


def test_nvfp4_activation_quantization_matches_compressed_tensors():
    """quantize_nvfp4_activations gives compressed-tensors' e2m1 values times its e4m3 scales, bit for
    bit, on rows spread over 40 binades (scales saturated at 448, subnormal and zero), a zero row, and
    a row with an infinity (its scale saturates, its values clamp at 6: e4m3fn and e2m1 have no
    infinity), in float32 and, for bf16 rows, exactly representable in bf16."""
    seed = int.from_bytes(os.urandom(4), "little")
    rng = np.random.default_rng(seed)
    # One row near each of 2^-20, 2^-7, 2^7 and 2^20, not 2^uniform(-20, 20) per row: four rows drawn
    # all large saturate every scale and round nothing to zero (5 seeds of 300 failed the check below).
    binades = np.array([-20.0, -7.0, 7.0, 20.0, 0.0, 0.0]) + rng.uniform(-1, 1, 6)
    x = (rng.standard_normal((6, 96)) * 2.0 ** binades[:, None]).astype(np.float32)
    x[4] = 0
    x[5, 3] = np.inf
    g = float(rng.uniform(1, 3000))
    values, scales = _ct_nvfp4_activations(x, g)
    want = values * np.repeat(scales, 16, axis=-1)
    got = np.asarray(quantize_nvfp4_activations(jnp.asarray(x), jnp.float32(g)))
    np.testing.assert_array_equal(got, want, err_msg=f"seed={seed}")
    assert np.all(np.isfinite(got)) and np.any(scales == 448) and np.any(got[:4] == 0), f"seed={seed}"
    as_bf16 = jnp.asarray(x, jnp.bfloat16)
    values, scales = _ct_nvfp4_activations(np.asarray(as_bf16, np.float32), g)
    got = quantize_nvfp4_activations(as_bf16, jnp.float32(g))
    assert got.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(got, np.float32), values * np.repeat(scales, 16, axis=-1), err_msg=f"seed={seed}")


@pytest.mark.parametrize("backend", ["xla", "interpret"])
def test_w4a4_matmuls_compute_the_fp4_products(backend):
    """A W4A4 weight's matmul (dense) and grouped matmul (experts, each with its own input scale,
    ragged groups, an empty one) against float64: compressed-tensors' quantized rows times the
    dequantized weights, divided by the input scale. The kernels see e2m1 * e4m3 operands (exact
    in float32) and one division of each sum by input * weight global scale, so the float32 bound of
    test_kernels_nvfp4 (1e-5 of |x_q| @ |W|) holds."""
    seed = int.from_bytes(os.urandom(4), "little")
    rng = np.random.default_rng(seed)
    k, n, sizes = 64, 24, (5, 0, 9, 2)
    w = Nvfp4Weight(*quantize_nvfp4(jnp.asarray(rng.standard_normal((len(sizes), k, n)), jnp.float32)))
    g_E1 = rng.uniform(100, 2000, (len(sizes), 1)).astype(np.float32)
    w4a4 = Nvfp4Weight(w.packed_QN, w.scales_GN, w.global_scale, input_global_scale=jnp.asarray(g_E1))
    x = (rng.standard_normal((sum(sizes), k)) * 2.0 ** rng.uniform(-4, 4, (sum(sizes), 1))).astype(np.float32)
    w_f64 = np.asarray(w.dequantize(jnp.float32), np.float64)
    expected, magnitude, row = np.zeros((x.shape[0], n)), np.zeros((x.shape[0], n)), 0
    for e, size in enumerate(sizes):
        if not size:
            continue
        values, scales = _ct_nvfp4_activations(x[row:row + size], float(g_E1[e, 0]))
        x_q = values.astype(np.float64) * np.repeat(scales, 16, axis=-1) / g_E1[e, 0]
        expected[row:row + size], magnitude[row:row + size] = x_q @ w_f64[e], np.abs(x_q) @ np.abs(w_f64[e])
        row += size
    got = np.asarray(expert_matmul(jnp.asarray(x), w4a4, jnp.asarray(sizes, jnp.int32), backend=backend), np.float64)
    assert np.all(np.abs(got - expected) <= 1e-5 * magnitude), f"seed={seed}"
    one = Nvfp4Weight(w.packed_QN[2], w.scales_GN[2], w.global_scale[2], input_global_scale=jnp.asarray(g_E1[2]))
    rows = slice(sizes[0], sizes[0] + sizes[2])
    got = np.asarray(matmul(jnp.asarray(x[rows]), one, backend=backend), np.float64)
    assert np.all(np.abs(got - expected[rows]) <= 1e-5 * magnitude[rows]), f"seed={seed}"


def _hf_input_amax(model, ids: np.ndarray) -> dict[str, np.ndarray]:
    """The largest |input| of every nn.Linear and of each routed expert's projections (over the
    tokens routed to it; 0 for an expert none reaches), as transformers computes them on ids."""
    amax, hooks = {}, []
    record = lambda name, value: amax.__setitem__(name, np.maximum(amax.get(name, 0), value))

    def experts_hook(name, module, args):
        hidden, top_k_index, _ = args
        for e in range(module.num_experts):
            x = hidden[(top_k_index == e).any(-1)]
            gate, up = torch.nn.functional.linear(x, module.gate_up_proj[e]).chunk(2, dim=-1)
            h = module.act_fn(gate) * up
            for proj, value in (("gate_proj", x), ("up_proj", x), ("down_proj", h)):
                record(f"{name}.{e}.{proj}", float(value.abs().max()) if value.numel() else 0.0)

    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            hooks.append(module.register_forward_pre_hook(lambda m, a, n=name: record(n, float(a[0].abs().max()))))
        elif name.endswith("mlp.experts"):
            hooks.append(module.register_forward_pre_hook(lambda m, a, n=name: experts_hook(n, m, a)))
    with torch.no_grad():
        model(torch.as_tensor(ids, dtype=torch.long))
    for h in hooks:
        h.remove()
    return amax


def _quantize_with_cli(model, tmp_path, *flags: str):
    """Save `model` and run `python -m mixserve.quantize FLAGS` on it over 256 calibration tokens of a
    drawn seed -> (source dir, output dir, the Calibration, the written quantization_config)."""
    src, dst = str(tmp_path / "bf16"), str(tmp_path / "quantized")
    ref.save(model, src)
    calibration = Calibration(256, 32, seed=int.from_bytes(os.urandom(2), "little"))
    quantize_main(["--model", src, "--out", dst, *flags, "--calibration-tokens", "256", "--seq-len", "32",
                   "--seed", str(calibration.seed)])
    return src, dst, calibration, json.load(open(os.path.join(dst, "config.json")))["quantization_config"]


@pytest.mark.parametrize("name, overrides", [("glm4-qknorm-bias", {}), ("kimi-yarn-groups", {"kv_lora_rank": 32})],
                         ids=["glm4", "kimi"])
def test_w4a4_quantizer_calibrates_input_scales_as_llm_compressor(tmp_path, name, overrides):
    """`mixserve.quantize --format nvfp4 --scope all --nvfp4-activations` writes compressed-tensors'
    NVFP4 (W4A4) scheme: the config's input_activations are its NVFP4 preset's, and every layer's
    input_global_scale is its generate_gparam of the largest |input| over the calibration tokens,
    with the inputs as transformers computes them (each expert over the tokens routed to it; one
    no token reaches takes its layer's largest), within float32 forward rounding (1e-5); kv_b_proj's
    too, which mixserve does not use (MLA: kv_lora_rank 32, a multiple of 16). It loads with
    nvfp4_activations=True to what quantize_model gives in memory, bit for bit."""
    model = ref.build(name, **overrides)
    src, dst, calibration, quant = _quantize_with_cli(model, tmp_path, "--format", "nvfp4", "--scope", "all",
                                                      "--nvfp4-activations")
    (group,) = quant["config_groups"].values()
    ours, preset = QuantizationArgs.model_validate(group["input_activations"]), preset_name_to_scheme("NVFP4", ["Linear"])
    fields = ("num_bits", "type", "symmetric", "strategy", "group_size", "dynamic")
    assert [getattr(ours, f) for f in fields] == [getattr(preset.input_activations, f) for f in fields]
    amax = _hf_input_amax(model, calibration.token_ids(model.config.vocab_size))
    disk = _disk(dst)
    scales = {k.removesuffix(".input_global_scale"): v for k, v in disk.items() if k.endswith(".input_global_scale")}
    assert len(scales) == sum(1 for k in disk if k.endswith(".weight_packed")) > 40
    for unit, got in scales.items():
        experts, _, proj = unit.rpartition(".")  # an expert's unit: LAYER.mlp.experts.E.PROJ
        layer = experts.rpartition(".")[0]
        layer_max = max(v for k, v in amax.items() if k.startswith(layer + ".") and k.endswith("." + proj))
        a = torch.tensor(amax[unit] or layer_max)
        want = generate_gparam(-a, a).numpy()
        np.testing.assert_allclose(got, want, rtol=1e-5, err_msg=f"{unit} seed={calibration.seed}")
    loaded = mixserve.load(dst, dtype="float32", progress=False, nvfp4_activations=True)
    in_memory, _ = quantize_model(mixserve.load(src, dtype="float32", progress=False),
                                  plan_for(WeightFormat("nvfp4", w4a4=True), "all"), calibration=calibration)
    assert loaded.plan == in_memory.plan
    assert jax.tree.structure(loaded.params) == jax.tree.structure(in_memory.params)
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(loaded.params), jax.tree.leaves(in_memory.params)))


def _hf_kv_amax(model, ids: np.ndarray) -> tuple[list[float], list[float]]:
    """The largest |key| and |value| transformers caches in each decoder layer (after the k norm and RoPE)."""
    with torch.no_grad():
        cache = model(torch.from_numpy(ids).long(), use_cache=True).past_key_values
    return ([float(layer.keys.abs().max()) for layer in cache.layers],
            [float(layer.values.abs().max()) for layer in cache.layers])


def _kv_scales_of(directory: str) -> dict[str, np.ndarray]:
    return {k: v for k, v in _disk(directory).items() if k.endswith(("self_attn.k_scale", "self_attn.v_scale"))}


def test_fp8_kv_scales_are_calibrated_per_layer_as_llm_compressor_writes_them(tmp_path, monkeypatch):
    """`mixserve.quantize --fp8-kv-scales` writes each decoder layer's self_attn.k_scale and v_scale:
    compressed-tensors' own qparams (static per-tensor FP8, the config's kv_cache_scheme) of the
    largest |key| and |value| transformers caches over the calibration tokens, within float32
    forward rounding (1e-5). The checkpoint loads with them, with no notice, and quantize_model
    gives the same in memory. A source that declares only a KV cache scheme keeps its scales
    through quantization, or gets new ones with the flag; an MLA model is refused by name."""
    import warnings

    model = ref.build("glm4-qknorm-bias")
    src, dst, calibration, quant = _quantize_with_cli(model, tmp_path, "--format", "int4", "--group-size", "8",
                                                      "--fp8-kv-scales")
    scheme = QuantizationArgs.model_validate(quant["kv_cache_scheme"])
    layers = model.config.num_hidden_layers
    disk = _kv_scales_of(dst)
    assert len(disk) == 2 * layers
    for kv, amax in zip("kv", _hf_kv_amax(model, calibration.token_ids(model.config.vocab_size))):
        for i, a in enumerate(amax):
            want, _ = calculate_qparams(torch.tensor([-a]), torch.tensor([a]), scheme)
            np.testing.assert_allclose(disk[f"model.layers.{i}.self_attn.{kv}_scale"], want.numpy()[0], rtol=1e-5,
                                       err_msg=f"layer {i} {kv} seed={calibration.seed}")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a scheme mixserve reads: no notice
        loaded = mixserve.load(dst, dtype="float32", progress=False)
    for i, kv in enumerate("kv"):
        np.testing.assert_array_equal(loaded.kv_scales[i], [disk[f"model.layers.{j}.self_attn.{kv}_scale"]
                                                            for j in range(layers)])
    in_memory, _ = quantize_model(mixserve.load(src, dtype="float32", progress=False),
                                  plan_for(WeightFormat("int4", 8), "experts"), calibration=calibration,
                                  fp8_kv_scales=True)
    assert all(np.array_equal(a, b) for a, b in zip(loaded.kv_scales, in_memory.kv_scales))

    # A KV-only source (llm-compressor with a kv_cache_scheme alone): its own scales, doubled so
    # that they differ from a calibration's, go through quantization, or are replaced with the flag.
    kv_only = str(tmp_path / "bf16-kv")
    shutil.copytree(src, kv_only)
    tensors = {k: 2 * v for k, v in disk.items()} | _disk(src)  # first in file order, so in an early shard
    os.remove(os.path.join(kv_only, "model.safetensors"))
    write_safetensors(os.path.join(kv_only, "model.safetensors"), tensors)
    config = json.load(open(os.path.join(src, "config.json")))
    config["quantization_config"] = {"quant_method": "compressed-tensors", "kv_cache_scheme": quant["kv_cache_scheme"]}
    json.dump(config, open(os.path.join(kv_only, "config.json"), "w"))
    plan = plan_for(WeightFormat("int4", 8), "experts")
    monkeypatch.setattr(mixserve.quantize, "SHARD_BYTES", 1 << 14)  # a new scale and the old in different shards
    for flag, factor in ((False, 2), (True, 1)):
        out = str(tmp_path / f"from-kv-only-{flag}")
        quantize_checkpoint(kv_only, out, plan, calibration=calibration, fp8_kv_scales=flag)
        shards = [safe_open(f, "np").keys() for f in glob.glob(os.path.join(out, "*.safetensors"))]
        assert len(shards) > 2 and sum(map(len, shards)) == len(set().union(*shards))  # each tensor written once
        got = _kv_scales_of(out)
        assert got.keys() == disk.keys()
        for name, scale in disk.items():
            np.testing.assert_allclose(got[name], factor * scale, rtol=1e-5 if flag else 0, err_msg=name)
        served = mixserve.load(out, dtype="float32", progress=False)
        assert served.plan == plan
        np.testing.assert_allclose(served.kv_scales[0], [factor * disk[f"model.layers.{i}.self_attn.k_scale"]
                                                         for i in range(layers)], rtol=1e-5 if flag else 0)

    kimi = str(tmp_path / "kimi")
    ref.save(ref.build("kimi-yarn-groups"), kimi)
    with pytest.raises(ValueError, match="MLA latent"):
        quantize_checkpoint(kimi, str(tmp_path / "kimi-int4"), plan, fp8_kv_scales=True)


def test_fp8_kv_scales_of_silent_layers_wrapped_sources_and_rotations(tmp_path):
    """Edge cases of --fp8-kv-scales and KV-only sources: a layer whose values are all 0 gets
    compressed-tensors' scale for amax 0 (eps), not 0, which no engine takes; a KV-only source that
    also declares a rotation (transform_config) is refused as loading it is; a wrapper's KV-only
    config at the top level is replaced, so the output has one quantization_config (in text_config)
    and is then refused as already quantized."""
    from mixserve.checkpoint import read_config
    from mixserve.engine import Engine

    model = ref.build("glm4-qknorm-bias")
    with torch.no_grad():
        model.model.layers[1].self_attn.v_proj.weight.zero_()
        model.model.layers[1].self_attn.v_proj.bias.zero_()
    src = str(tmp_path / "glm4")
    ref.save(model, src)
    plan = plan_for(WeightFormat("int4", 8), "experts")
    quantized, _ = quantize_model(mixserve.load(src, dtype="float32", progress=False), plan,
                                  calibration=Calibration(64, 16), fp8_kv_scales=True)
    eps, _ = calculate_qparams(torch.tensor([0.0]), torch.tensor([0.0]), QuantizationArgs.model_validate(FP8_KV_SCHEME))
    assert quantized.kv_scales[1][1] == eps.item() and (quantized.kv_scales[1][[0, 2]] > 1e-3).all()
    Engine(quantized, kv_dtype="fp8_e4m3", num_pages=8, page_size=8, max_batch=1)

    def kv_only(directory, extra, wrap=None):
        config = json.load(open(os.path.join(directory, "config.json")))
        config = {"text_config": config, **wrap} if wrap else config
        config["quantization_config"] = {"quant_method": "compressed-tensors", "kv_cache_scheme": FP8_KV_SCHEME, **extra}
        json.dump(config, open(os.path.join(directory, "config.json"), "w"))

    kv_only(src, {"transform_config": {"config_groups": {"R3": {"type": "hadamard", "apply": []}}}})
    with pytest.raises(CheckpointError, match="transform_config"):
        quantize_checkpoint(src, str(tmp_path / "rotated"), plan)

    kimi, out = str(tmp_path / "kimi"), str(tmp_path / "kimi-int4")
    ref.save(ref.build("kimi-yarn-groups"), kimi)
    kv_only(kimi, {}, wrap={"model_type": "kimi_k25", "architectures": ["KimiK25ForConditionalGeneration"]})
    quantize_checkpoint(kimi, out, plan)
    written = json.load(open(os.path.join(out, "config.json")))
    assert "quantization_config" not in written and written["text_config"]["quantization_config"]["config_groups"]
    assert read_config(out)[1]["kv_cache_scheme"] == FP8_KV_SCHEME
    with pytest.raises(CheckpointError, match="already quantized"):
        quantize_checkpoint(out, str(tmp_path / "again"), plan)


def test_config_ignores_every_unquantized_linear_layer(tmp_path):
    """compressed-tensors readers (transformers, vLLM) quantize every nn.Linear its config targets
    unless ignored: GLM-5's DSA weights_proj, which mixserve keeps in the model dtype, is listed with
    lm_head (it was not, and transformers then looked for its packed weights)."""
    src, dst = str(tmp_path / "bf16"), str(tmp_path / "int4")
    ref.save(ref.build("glm5-dsa-shared"), src)
    quantize_checkpoint(src, dst, plan_for(WeightFormat("int4", 8), "all"))
    ignore = set(json.load(open(os.path.join(dst, "config.json")))["quantization_config"]["ignore"])
    proj = {k.removesuffix(".weight") for k in _disk(dst) if k.endswith("weights_proj.weight")}
    assert proj and proj | {"lm_head"} == ignore


# ---- GPTQ ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", [WeightFormat("int4", 32), WeightFormat("int4", 128), WeightFormat("nvfp4")], ids=str)
def test_gptq_with_identity_hessian_is_rtn(fmt):
    """No input correlation, no error feedback: GPTQ must reduce to RTN exactly (same scales, same
    rounding, NVFP4's global scale too). A zero Hessian (inputs never seen) counts as the identity."""
    w_KN = jax.random.normal(jax.random.key(1), (256, 48), jnp.float32)
    rtn = quantize(w_KN, fmt)
    for h_KK in (jnp.eye(256), jnp.zeros((256, 256))):
        q = gptq_quantize(w_KN, h_KK, fmt)
        assert type(q) is type(rtn)
        for a, b in zip(jax.tree.leaves(q), jax.tree.leaves(rtn), strict=True):
            np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8), err_msg=str(fmt))


def test_reconstruction_error_is_the_output_error():
    x_MK = jax.random.normal(jax.random.key(2), (64, 32))
    w_KN = jax.random.normal(jax.random.key(3), (32, 16))
    q = Int4Weight.quantize(w_KN, 8)
    direct = jnp.sum((x_MK @ w_KN - x_MK @ q.dequantize(jnp.float32)) ** 2)
    np.testing.assert_allclose(float(reconstruction_error(w_KN, q, x_MK.T @ x_MK)), float(direct), rtol=1e-4)


@pytest.mark.parametrize("fmt", [WeightFormat("int4", 32), WeightFormat("int4", 128), WeightFormat("nvfp4")], ids=str)
def test_gptq_beats_rtn(wide_model, fmt):
    """Same calibration tokens for both; GPTQ must lower every layer's ||X(W - Q)||^2 on them and the
    logit error against the float model on held-out tokens."""
    plan = WeightPlan(experts=fmt)
    calibration = Calibration(tokens=1024, seq_len=64, seed=0)
    held_out = Calibration(tokens=256, seq_len=64, seed=1).token_ids(wide_model.config.vocab_size)
    rtn, _ = quantize_model(wide_model, plan)
    gptq, reports = quantize_model(wide_model, plan, method="gptq", calibration=calibration)
    assert len(reports) == 6  # gate/up/down of the two MoE layers
    for r in reports:
        assert r.gptq_error < 0.8 * r.rtn_error, r
    base = wide_model.logits(held_out)
    rtn_logits, gptq_logits = rtn.logits(held_out), gptq.logits(held_out)
    rtn_err, gptq_err = (float(jnp.mean((x - base) ** 2)) for x in (rtn_logits, gptq_logits))
    agree = lambda x: float(jnp.mean(jnp.argmax(x, -1) == jnp.argmax(base, -1)))
    print(f"{fmt}: logit MSE RTN {rtn_err:.3g} GPTQ {gptq_err:.3g}; greedy agreement {agree(rtn_logits):.3f} / {agree(gptq_logits):.3f}")
    assert gptq_err < 0.9 * rtn_err


def test_gptq_checkpoint_matches_in_memory_and_falls_back_to_rtn(bf16_dir, tmp_path, capsys):
    """The CLI writes GPTQ's weights in the RTN format; they load back bit-exact to quantize_model's,
    and experts no calibration token reached are exactly RTN."""
    out = tmp_path / "gptq"
    quantize_main(["--model", bf16_dir, "--out", str(out), "--format", "int4", "--group-size", "32",
                   "--method", "gptq", "--calibration-tokens", "64", "--seq-len", "32", "--seed", "0"])
    assert "RTN for experts" in capsys.readouterr().out
    loaded = mixserve.load(str(out), progress=False)
    assert loaded.plan == WeightPlan(experts=WeightFormat("int4", 32))
    source = mixserve.load(bf16_dir, dtype="float32", progress=False)
    plan, calibration = loaded.plan, Calibration(tokens=64, seq_len=32, seed=0)
    expected, reports = quantize_model(source, plan, method="gptq", calibration=calibration)
    rtn, _ = quantize_model(source, plan)
    fallbacks = 0
    for r in reports:
        layer, _, _, proj = r.path.split("/")
        got, want, plain = (m.params[layer]["mlp"]["experts"][proj] for m in (loaded, expected, rtn))
        np.testing.assert_array_equal(np.asarray(got.packed_QN), np.asarray(want.packed_QN), err_msg=r.path)
        np.testing.assert_array_equal(np.asarray(got.scales_GN), np.asarray(want.scales_GN), err_msg=r.path)
        for e in r.rtn_fallback_experts:
            np.testing.assert_array_equal(np.asarray(got.packed_QN[e]), np.asarray(plain.packed_QN[e]), err_msg=f"{r.path} expert {e}")
            fallbacks += 1
    assert fallbacks > 0


def test_an_output_that_holds_a_checkpoint_or_cannot_be_made_is_a_usage_error(bf16_dir, tmp_path, capsys):
    """Quantizing into a checkpoint's directory left its old shards beside the new ones (the
    output then served as whatever its config said); a path that cannot be made raised a
    traceback, after GPTQ had run. Both are usage errors now (exit 2), before any work."""
    occupied, a_file = tmp_path / "occupied", tmp_path / "a-file"
    quantize_checkpoint(bf16_dir, str(occupied), plan_for(WeightFormat("int4", 32), "experts"))
    a_file.write_text("")
    for out, message in ((occupied, "already holds a checkpoint"), (a_file / "out", "Not a directory")):
        with pytest.raises(SystemExit) as exit_:
            quantize_main(["--model", bf16_dir, "--out", str(out), "--format", "int4", "--method", "gptq"])
        assert exit_.value.code == 2 and message in capsys.readouterr().err, out


def test_gptq_rejects_bad_requests(bf16_dir, tmp_path):
    source = mixserve.load(bf16_dir, dtype="float32", progress=False)
    with pytest.raises(ValueError, match="GPTQ quantizes int4"):
        quantize_checkpoint(bf16_dir, str(tmp_path), plan_for(WeightFormat("fp8_block"), "all"), method="gptq")
    with pytest.raises(ValueError, match="method must be"):
        quantize_model(source, plan_for(WeightFormat("int4", 32), "experts"), method="awq")
    with pytest.raises(ValueError, match=r"\[batch, time\]"):
        quantize_model(source, plan_for(WeightFormat("int4", 32), "experts"), method="gptq", calibration=np.arange(5))
    quantized, _ = quantize_model(source, plan_for(WeightFormat("int4", 32), "experts"))
    for method in ("rtn", "gptq"):
        with pytest.raises(ValueError, match="unquantized model, but layers_1/mlp/experts/down_proj"):
            quantize_model(quantized, quantized.plan, method=method, calibration=np.zeros((1, 4), np.int32))


# ---- weight bytes -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def glm5_bytes():
    fp8 = mixserve.weight_bytes("glm-5", "fp8", tp=8)
    int4 = mixserve.weight_bytes("glm-5", "int4", 32, tp=8)
    return fp8, int4


def test_weight_bytes_reproduce_the_seed(glm5_bytes):
    """Seed (GLM 5.2): 705 -> 421 "GB", 88 -> 52 "GB" per GPU at TP8. Those are GiB of the whole
    checkpoint, MTP layer included: FP8 = every linear layer block-FP8; INT4 = routed experts INT4
    g32 with everything else BF16 (the Kimi K2 Thinking recipe), not experts INT4 + rest FP8."""
    fp8, int4 = glm5_bytes
    assert fp8.plan == WeightPlan(WeightFormat("fp8_block"), WeightFormat("fp8_block"))
    assert int4.plan == WeightPlan(WeightFormat("int4", 32), BF16)
    assert fp8.checkpoint / GIB == pytest.approx(705, rel=0.01)
    assert int4.checkpoint / GIB == pytest.approx(421, rel=0.01)
    # Without MTP (the count_params convention) both are a little smaller, still within 5%.
    assert fp8.total / GIB == pytest.approx(705, rel=0.05) and int4.total / GIB == pytest.approx(421, rel=0.05)
    # The seed's per-GPU numbers are the checkpoint split evenly 8 ways ...
    assert fp8.checkpoint / 8 / GIB == pytest.approx(88, rel=0.01)
    assert int4.checkpoint / 8 / GIB == pytest.approx(52, rel=0.02)
    # ... ours keep norms, router, MLA down-projections and the DSA indexer whole on every rank,
    # which costs FP8 2% and INT4 (those layers BF16) 8% more per GPU.
    assert fp8.per_gpu / GIB == pytest.approx(88, rel=0.05)
    assert int4.per_gpu - int4.checkpoint / 8 == pytest.approx(int4.replicated * 7 / 8)
    assert int4.per_gpu / GIB == pytest.approx(52, rel=0.09)


def test_device_bytes_tp_splits_ungroupable_int4_experts_with_their_scales_re_blocked():
    """GLM-4.5's experts at INT4 g128: at TP8 a device's share of down_proj's 1536 input rows is
    192, 1.5 groups. mixserve.sharding splits the packed values anyway, and the scales with them,
    re-blocked to g64 (models.weights.split_for_tp): twice the scales, an eighth of them a device.
    EP8 holds 20 whole experts of 160, an eighth of the g128 scales. The difference is exactly 1/8
    of all down_proj scales: 24.55 against 24.34 GiB (keeping the scales whole on every device, as
    2026-12-01's first version did, held 25.8; keeping down_proj whole, as before, 71.4). Kimi K2 at
    g32 splits evenly either way (2048 / 8 = 256 rows, 8 groups)."""
    g128, g32 = (WeightPlan(WeightFormat("int4", g), BF16) for g in (128, 32))
    tp, ep = (device_bytes("glm-4.5", g128, 8, flag) for flag in (False, True))
    cfg = get_preset("glm-4.5")
    moe_layers = sum(cfg.is_moe_layer(i) for i in range(cfg.num_layers))
    f, d = cfg.moe_intermediate_size, cfg.hidden_size
    down_proj_scales = moe_layers * cfg.n_routed_experts * f // 128 * d * 2  # bf16
    assert tp - ep == down_proj_scales // 8
    assert ep / GIB == pytest.approx(24.34, abs=0.005) and tp / GIB == pytest.approx(24.55, abs=0.005)
    assert device_bytes("kimi-k2", g32, 8) == device_bytes("kimi-k2", g32, 8, True)
    with pytest.raises(ValueError, match=r"routed expert count \(384\) to divide"):
        device_bytes("kimi-k2", g32, 5, True)


def test_weight_bytes_components_and_scales(glm5_bytes):
    fp8, int4 = glm5_bytes
    assert fp8.total == fp8.experts + fp8.attention + fp8.dense + fp8.embeddings + fp8.other
    # Unquantized in both: embeddings (BF16), norms and router. INT4 keeps attention BF16.
    assert fp8.embeddings == int4.embeddings and fp8.other == int4.other
    # FP8 block: 1 byte per weight + a float32 scale per 128x128 block (0.02%, more at ragged edges
    # like kv_a_proj's 576 columns); the indexer's weights_proj stays float32 in both.
    assert int4.attention / 2 < fp8.attention < int4.attention / 2 * 1.003
    # INT4: 0.5 byte per weight + a bf16 scale per group: 9/16 byte at g32, 33/64 at g128.
    bf16 = mixserve.weight_bytes("tiny-glm5", "bf16").experts
    assert mixserve.weight_bytes("tiny-glm5", "int4", 32).experts * 32 == bf16 // 2 * 18
    assert mixserve.weight_bytes("tiny-glm5", "int4", 8).experts * 8 == bf16 // 2 * (4 + 2)


def test_weight_bytes_equal_real_params():
    """On a tiny preset with every kind of layer (dense and MoE, DSA indexer full and shared) and
    every kind of weight (bf16, fp8 block, int4), the abstract count equals the bytes of really
    initialised params."""
    plan = WeightPlan(WeightFormat("int4", 32), WeightFormat("fp8_block"))
    model = mixserve.load("tiny-glm5", plan=plan)
    real = sum(leaf.nbytes for leaf in jax.tree.leaves(model.params))
    assert mixserve.weight_bytes("tiny-glm5", plan=plan).total == real


def test_a_model_with_re_blocked_scales_computes_the_same_logits_and_a_wrong_format_is_named():
    """Tensor parallelism places quantized weights with finer scale blocks (models.weights.split_for_tp):
    the model takes them without a mesh too, and every layer's output is the same, so the logits are
    equal. A weight of the wrong format or shape is refused by name, as Flax's own check would."""
    model = mixserve.load("tiny-kimi", dtype="float32")
    ids = jnp.asarray(np.random.default_rng().integers(0, model.config.vocab_size, (2, 7)), jnp.int32)
    for fmt in (WeightFormat("int4", 16), WeightFormat("fp8_block")):
        quantized, _ = quantize_model(model, plan_for(fmt, "all"))
        finer = lambda w: reblock(w, tuple(max(1, v // 2) for v in w.values_per_scale))
        leaves = (Fp8BlockWeight, Int4Weight)
        params = jax.tree.map(lambda w: finer(w) if isinstance(w, leaves) else w, quantized.params,
                              is_leaf=lambda x: isinstance(x, leaves))
        down = params["layers_1"]["mlp"]["experts"]["down_proj"]
        assert down.values_per_scale == {"int4": (1, 1), "fp8_block": (64, 64)}[fmt.kind]
        np.testing.assert_array_equal(np.asarray(dataclasses.replace(quantized, params=params).logits(ids)),
                                      np.asarray(quantized.logits(ids)), err_msg=str(fmt))
    dense = quantized.params["layers_1"]["mlp"]["experts"]["down_proj"].dequantize(jnp.float32)
    params["layers_1"]["mlp"]["experts"]["down_proj"] = Int4Weight.quantize(dense, 16)
    with pytest.raises(ValueError, match=r"'down_proj' of 'experts' is Int4Weight \(8, 32, 64\), expected fp8_block"):
        dataclasses.replace(quantized, params=params).logits(ids)
    # Scales that do not tile the values (one block row too many), or blocks coarser than the format's.
    down = quantized.params["layers_1"]["mlp"]["experts"]["down_proj"]
    for bad in (down.with_stored(down.values_KN, jnp.concatenate([down.scale_inv_kn] * 2, axis=-2)),
                down.with_stored(down.values_KN, down.scale_inv_kn, (256, 128))):
        params["layers_1"]["mlp"]["experts"]["down_proj"] = bad
        with pytest.raises(ValueError, match=r"'down_proj' of 'experts': scales .* do not tile its values"):
            dataclasses.replace(quantized, params=params).logits(ids)


# ---- Orbax --------------------------------------------------------------------------------------


def test_orbax_round_trip_is_bit_exact(bf16_dir, tmp_path):
    source = mixserve.load(bf16_dir, progress=False)
    model, _ = quantize_model(source, WeightPlan(WeightFormat("int4", 32), WeightFormat("fp8_block")))
    save_params(str(tmp_path / "ckpt"), model)
    ids = np.arange(24).reshape(2, 12)
    forward = jax.jit(lambda params: model.module.apply({"params": params}, ids))  # one compile for all
    expected = np.asarray(forward(model.params))
    devices = jax.devices()[:1]
    sharding = jax.sharding.NamedSharding(jax.sharding.Mesh(devices, ("x",)), jax.sharding.PartitionSpec())
    placed = jax.tree.map(lambda _: sharding, model.params)
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), model.params)
    for kwargs in ({}, {"shardings": placed}, {"target": abstract}):
        back = restore_params(str(tmp_path / "ckpt"), **kwargs)
        assert (back.config, back.plan, back.dtype) == (model.config, model.plan, model.dtype)
        assert jax.tree.structure(back.params) == jax.tree.structure(model.params)
        kinds = {type(x) for x in jax.tree.leaves(back.params, is_leaf=lambda x: isinstance(x, (Int4Weight, Fp8BlockWeight)))}
        assert {Int4Weight, Fp8BlockWeight} <= kinds
        for a, b in zip(jax.tree.leaves(model.params), jax.tree.leaves(back.params)):
            assert a.dtype == b.dtype and a.shape == b.shape
            np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
        np.testing.assert_array_equal(np.asarray(forward(back.params)), expected)


def test_orbax_restore_names_a_wrong_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="model.json"):
        restore_params(str(tmp_path))


def test_orbax_save_keeps_only_the_saved_models_tokenizer(tmp_path):
    """Saving over an earlier save left its tokenizer files, so the restored model came back with
    another model's tokenizer; re-saving a restored model into its own directory raised
    SameFileError after the params were written."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "tiktoken.model").write_text("".join(f"{base64.b64encode(bytes([b])).decode()} {b}\n" for b in range(256)))
    (src / "tokenizer_config.json").write_text(json.dumps({"added_tokens_decoder": {"256": {"content": "<|im_end|>"}}}))
    (src / "chat_template.jinja").write_text("{% for m in messages %}[{{ m.content }}]{% endfor %}")
    (src / "additional_chat_templates").mkdir()
    (src / "additional_chat_templates" / "tool_use.jinja").write_text("{{ tools | length }}")
    out = str(tmp_path / "ckpt")
    save_params(out, dataclasses.replace(mixserve.load("tiny-kimi", dtype="float32"), source=str(src)))
    restored = restore_params(out)
    assert restored.chat_template.render([{"role": "user", "content": "hi"}]) == "[hi]"
    assert restored.chat_template.render([{"role": "user", "content": "hi"}], tools=[{}, {}]) == "2"
    save_params(out, restored)  # into its own source directory
    assert restore_params(out).tokenizer.decode([104, 105, 256]) == "hi<|im_end|>"
    assert sorted(restore_params(out).chat_template.templates) == ["default", "tool_use"]
    save_params(out, mixserve.load("tiny-glm4", dtype="float32"))  # a model without tokenizer files
    back = restore_params(out)
    assert back.config.family == "glm4_moe" and back.tokenizer is None and back.chat_template is None
    assert sorted(os.listdir(out)) == ["model.json", "params"]
