"""Logit parity with the transformers reference on tiny random configs of all three families.

transformers builds the model, save_pretrained writes it, mixserve loads the directory, both run in
float32: ||mixserve - reference|| / ||reference|| < 1e-4 (float32 rounding through a 3-layer model
is ~1e-6; 1e-4 leaves room for summation-order differences in attention and the MoE scatter).
"""

import json
import os
import shutil

import numpy as np
import pytest

import hf_reference as ref
import mixserve
from mixserve.safetensors_io import index_tensors, load_tensor, write_safetensors
from models.config import ModelConfig

TOL = 1e-4


def tie_free_ids(model, name, shape=(2, 11)):
    """DSA top-k on exact ties (ReLU zeros) is order-dependent: draw inputs without boundary ties."""
    cfg = ref.CONFIGS[name][1]
    for seed in range(100):
        ids = np.random.default_rng(seed).integers(0, cfg["vocab_size"], shape)
        if "index_topk" not in cfg or not any(
            ref.has_topk_boundary_tie(s, cfg["index_topk"]) for s in ref.dsa_index_scores(model, ids)
        ):
            return ids
    raise AssertionError("no tie-free input found in 100 draws")


def rel_err(a, b):
    return float(np.linalg.norm(np.asarray(a) - b) / np.linalg.norm(b))


_SAVED = {}


def save_once(name, tmp_path_factory):
    if name not in _SAVED:
        model = ref.build(name)
        path = tmp_path_factory.mktemp(name)
        ref.save(model, path)
        _SAVED[name] = (name, model, str(path))
    return _SAVED[name]


@pytest.fixture(params=sorted(ref.CONFIGS))
def saved(request, tmp_path_factory):
    return save_once(request.param, tmp_path_factory)


def test_logits_match_transformers(saved):
    name, model, path = saved
    ids = tie_free_ids(model, name)
    ours = mixserve.load(path, dtype="float32", progress=False)
    err = rel_err(ours.logits(ids), ref.reference_logits(model, ids))
    assert err < TOL, f"{name}: relative logit error {err:.2e}"


def test_dsa_top_k_is_smaller_than_sequence():
    """The DSA config must actually drop tokens, or the indexer path is not exercised."""
    _, cfg = ref.CONFIGS["glm5-dsa-shared"]
    assert cfg["index_topk"] < 11 and "shared" in cfg["indexer_types"]


def test_sharded_checkpoint_with_index(tmp_path):
    model = ref.build("glm4-qknorm-bias")
    model.save_pretrained(tmp_path, max_shard_size="100KB")
    assert os.path.exists(tmp_path / "model.safetensors.index.json")
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    ids = np.random.default_rng(1).integers(0, 160, (1, 9))
    ours = mixserve.load(str(tmp_path), dtype="float32", progress=False)
    assert rel_err(ours.logits(ids), ref.reference_logits(model, ids)) < TOL


def test_kimi_k25_wrapper_layout(tmp_path):
    """K2.5/K2.6 nest the text config in text_config and prefix weights with language_model.;
    the vision tower is skipped."""
    model = ref.build("kimi-yarn-groups")
    plain = tmp_path / "plain"
    ref.save(model, plain)
    wrapped = tmp_path / "wrapped"
    wrapped.mkdir()
    text_config = json.loads((plain / "config.json").read_text())
    (wrapped / "config.json").write_text(json.dumps(
        {"model_type": "kimi_k25", "architectures": ["KimiK25ForConditionalGeneration"],
         "text_config": text_config, "vision_config": {"hidden_size": 8}}))
    tensors = {f"language_model.{k}": np.asarray(load_tensor(v)) for k, v in index_tensors(str(plain)).items()}
    tensors["vision_tower.patch_embed.proj.weight"] = np.ones((8, 3), np.float32)
    write_safetensors(str(wrapped / "model.safetensors"), tensors)
    ids = np.random.default_rng(2).integers(0, 160, (1, 7))
    ours = mixserve.load(str(wrapped), dtype="float32", progress=False)
    assert rel_err(ours.logits(ids), ref.reference_logits(model, ids)) < TOL
    # The wrapper's own eos/bos stand when its text_config names none (they used to be dropped).
    text_config.pop("eos_token_id", None)
    text_config.pop("bos_token_id", None)
    wrapper = {"model_type": "kimi_k25", "eos_token_id": 7, "bos_token_id": 6, "text_config": text_config}
    read = ModelConfig.from_hf(wrapper)
    assert (read.eos_token_ids, read.bos_token_id) == ((7,), 6)


_MLA_SHAPE = dict(kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8)
_REQUIRED = {  # the keys ModelConfig.from_hf cannot do without
    "DeepseekV3Config": ("deepseek_v3", _MLA_SHAPE),
    "Glm4MoeConfig": ("glm4_moe", dict(num_key_value_heads=2)),
    "GlmMoeDsaConfig": ("glm_moe_dsa", _MLA_SHAPE),
}


@pytest.mark.parametrize("class_name", sorted(_REQUIRED))
def test_config_keys_left_out_take_the_transformers_class_defaults(class_name):
    """A config.json without n_group, routed_scaling_factor, rms_norm_eps, ... once got mixserve's
    own fallbacks (1, 1.0, 1e-6): other logits than transformers (0.096 relative) without a word."""
    import transformers

    model_type, shape = _REQUIRED[class_name]
    minimal = dict(model_type=model_type, vocab_size=64, hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
                   intermediate_size=64, **shape)
    complete = getattr(transformers, class_name)(**minimal).to_dict()
    assert ModelConfig.from_hf(minimal) == ModelConfig.from_hf(complete)


@pytest.mark.parametrize("class_name", sorted(_REQUIRED))
def test_config_spellings_transformers_accepts_read_as_it_reads_them(class_name):
    """An expert count under num_local_experts (every class's attribute_map) fell back to the
    default 256 and failed to load by missing tensors; rope_scaling beside a disagreeing
    rope_parameters was merged, where transformers takes rope_scaling whole (1.3e-3 relative in
    the logits of a tiny Kimi)."""
    import transformers

    model_type, shape = _REQUIRED[class_name]
    raw = dict(model_type=model_type, vocab_size=64, hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
               intermediate_size=64, max_position_embeddings=256, **shape,
               rope_parameters={"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32,
                                "rope_theta": 50000.0, "beta_fast": 1.0},
               rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64})
    raw.update(n_group=1, topk_group=1)
    theirs = getattr(transformers, class_name)(**{**raw, "num_local_experts": 12})
    ours = ModelConfig.from_hf({**raw, "num_local_experts": 12})
    assert ours.n_routed_experts == theirs.n_routed_experts == 12
    p = theirs.rope_parameters
    assert (ours.rope.factor, ours.rope.theta, ours.rope.beta_fast) == (p["factor"], p["rope_theta"], p.get("beta_fast", 32.0))
    assert ours.rope.original_max_position_embeddings == p["original_max_position_embeddings"] == 64
    with pytest.raises(ValueError, match="routed expert counts disagree"):
        ModelConfig.from_hf({**raw, "num_local_experts": 12, "n_routed_experts": 16})


def test_config_values_mixserve_does_not_compute_are_refused_and_generation_eos_stops(tmp_path, tmp_path_factory):
    raw = dict(model_type="glm4_moe", vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
               intermediate_size=64, num_key_value_heads=2, eos_token_id=[3, 4])
    for act in ("gelu", "gelu_pytorch_tanh", "relu"):  # every MLP and expert is SiLU: another was silently ignored
        with pytest.raises(ValueError, match=f"unsupported hidden_act '{act}'"):
            ModelConfig.from_hf({**raw, "hidden_act": act})
    assert ModelConfig.from_hf({**raw, "hidden_act": "swish"}).eos_token_ids == (3, 4)
    # generation_config.json's eos ids stop generation too (transformers' generate and vLLM use them).
    assert ModelConfig.from_hf(raw, generation_eos=[4, 9]).eos_token_ids == (3, 4, 9)
    # Through the loader: a greedy request stops on the token generation_config.json names.
    _, _, saved_dir = save_once("glm4-plain", tmp_path_factory)
    directory = shutil.copytree(saved_dir, tmp_path / "c")
    prompt = [[5, 9, 2, 7]]
    free = mixserve.Engine(mixserve.load(str(directory), dtype="float32", progress=False), num_pages=8).generate(prompt, max_new_tokens=4)
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [free[0].tokens[0]]}))
    stopped = mixserve.Engine(mixserve.load(str(directory), dtype="float32", progress=False), num_pages=8).generate(prompt, max_new_tokens=4)
    assert len(free[0].tokens) == 4 and stopped[0].tokens == free[0].tokens[:1] and stopped[0].status == "ok"


@pytest.mark.parametrize("name", sorted(n for n, (_, c) in ref.CONFIGS.items() if "index_topk" not in c))
def test_bfloat16_load_runs_close_to_float32(name, tmp_path_factory):
    """bf16 params and activations: agreement with the float32 reference at bf16 precision (2^-8
    relative per rounding; a few percent after 3 layers). DSA is left out: bf16 rounding can
    legitimately flip the indexer's top-k choice between near-equal scores."""
    name, model, path = save_once(name, tmp_path_factory)
    ids = tie_free_ids(model, name)
    ours = mixserve.load(path, dtype="bfloat16", progress=False)
    logits = ours.logits(ids)
    assert logits.dtype == np.float32 and logits.shape == (*ids.shape, 160)
    assert rel_err(logits, ref.reference_logits(model, ids)) < 0.05
