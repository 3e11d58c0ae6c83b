"""One typed config for the three model families, read from and written to HF `config.json`.

Families (transformers 5.x is the reference):
  deepseek_v3  Kimi K2 / K2.5 / K2.6 text model: MLA + MoE.
  glm4_moe     GLM-4.5 / 4.6 / 4.7: GQA (bias, QK-norm, partial rotary) + MoE.
  glm_moe_dsa  GLM-5.x: MLA + DeepSeek Sparse Attention indexer + MoE.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Literal

Family = Literal["deepseek_v3", "glm4_moe", "glm_moe_dsa"]
FAMILIES: tuple[str, ...] = ("deepseek_v3", "glm4_moe", "glm_moe_dsa")
# transformers' defaults (DeepseekV3Config, Glm4MoeConfig, GlmMoeDsaConfig) for keys a config.json
# may leave out; keys with one default in all three (attention_bias False, ...) are read in place.
_MOE = ("n_routed_experts", "n_shared_experts", "num_experts_per_tok", "moe_intermediate_size", "n_group",
        "topk_group", "routed_scaling_factor", "first_k_dense_replace")
HF_CLASS_DEFAULTS: dict[str, dict[str, Any]] = {
    "deepseek_v3": dict(zip(_MOE, (256, 1, 8, 2048, 8, 4, 2.5, 3)), rms_norm_eps=1e-6, max_position_embeddings=4096,
                        num_nextn_predict_layers=1, q_lora_rank=1536, bos_token_id=0, eos_token_id=1),
    "glm4_moe": dict(zip(_MOE, (128, 1, 8, 1408, 1, 1, 1.0, 1)), rms_norm_eps=1e-5, max_position_embeddings=131072,
                     num_nextn_predict_layers=1),
    "glm_moe_dsa": dict(zip(_MOE, (256, 1, 8, 2048, 1, 1, 2.5, 3)), rms_norm_eps=1e-5, max_position_embeddings=202752,
                        q_lora_rank=2048, bos_token_id=0, eos_token_id=1, index_topk=2048, index_head_dim=128,
                        index_n_heads=32),
}


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding: plain, or YaRN (Kimi K2 uses YaRN with factor 32..64)."""

    theta: float = 10000.0
    type: Literal["default", "yarn"] = "default"
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    family: Family
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int  # dense MLP layers
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    rope: RopeConfig = RopeConfig()
    # GQA (glm4_moe)
    num_kv_heads: int = 1
    head_dim: int = 128
    partial_rotary_factor: float = 1.0
    use_qk_norm: bool = False
    attention_bias: bool = False
    # MLA (deepseek_v3, glm_moe_dsa)
    q_lora_rank: int | None = None
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    rope_interleave: bool = True
    # MoE
    n_routed_experts: int = 0
    n_shared_experts: int = 1
    num_experts_per_tok: int = 8
    moe_intermediate_size: int = 2048
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    first_k_dense_replace: int = 0
    # DSA indexer (glm_moe_dsa)
    index_topk: int = 2048
    index_head_dim: int = 128
    index_n_heads: int = 32
    indexer_types: tuple[str, ...] = ()  # per layer: "full" runs the indexer, "shared" reuses the last one
    # MTP (multi-token prediction) layers the checkpoint ships after the decoder layers: not part
    # of the forward; models/mtp.py runs the first as the speculative-decoding draft.
    num_mtp_layers: int = 0
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        if self.family not in FAMILIES:
            raise ValueError(f"unknown model family {self.family!r}; expected one of {FAMILIES}")
        if self.is_moe:
            if self.n_routed_experts % self.n_group:
                raise ValueError(f"n_routed_experts={self.n_routed_experts} is not divisible by n_group={self.n_group}")
            if not 1 <= self.topk_group <= self.n_group:
                raise ValueError(f"topk_group={self.topk_group} must be in [1, n_group={self.n_group}]")
            if self.topk_group < self.n_group and self.n_routed_experts // self.n_group < 2:
                raise ValueError(f"group-limited routing scores each group by its top 2 experts: n_routed_experts="
                                 f"{self.n_routed_experts} / n_group={self.n_group} leaves fewer than 2 per group")
            if self.num_experts_per_tok > self.topk_group * self.n_routed_experts // self.n_group:
                raise ValueError("num_experts_per_tok exceeds the experts left after group selection")
        if self.family == "glm4_moe" and self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        if self.family == "glm_moe_dsa":
            if len(self.indexer_types) != self.num_layers:
                raise ValueError(f"indexer_types has {len(self.indexer_types)} entries for {self.num_layers} layers")
            if self.indexer_types and self.indexer_types[0] != "full":
                raise ValueError("the first DSA layer must run its own indexer ('full')")

    # ---- derived ---------------------------------------------------------------------------
    @property
    def attention_kind(self) -> Literal["mla", "gqa"]:
        return "gqa" if self.family == "glm4_moe" else "mla"

    @property
    def is_moe(self) -> bool:
        return self.n_routed_experts > 0

    def is_moe_layer(self, layer: int) -> bool:
        return self.is_moe and layer >= self.first_k_dense_replace

    def runs_indexer(self, layer: int) -> bool:
        """GLM-5: does this layer run its own DSA indexer? An MTP layer (past the decoder layers) does:
        it has no earlier layer's selection to reuse."""
        return self.family == "glm_moe_dsa" and (layer >= self.num_layers or self.indexer_types[layer] == "full")

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """The decoder layers with routed experts: routed-experts rows have a column per layer here."""
        return tuple(i for i in range(self.num_layers) if self.is_moe_layer(i))

    @property
    def indexer_layers(self) -> tuple[int, ...]:
        """The decoder layers that run their own DSA indexer (GLM-5's "full" ones; none elsewhere):
        indexer top-k rows have a column per layer here, in this order (the MTP layer's is not one)."""
        return tuple(i for i in range(self.num_layers) if self.runs_indexer(i))

    @property
    def mtp_layer(self) -> int:
        """The index of the first MTP layer (its weights are model.layers.{mtp_layer}.*)."""
        return self.num_layers

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def rotary_dim(self) -> int:
        if self.attention_kind == "mla":
            return self.qk_rope_head_dim
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def softmax_scale(self) -> float:
        """1/sqrt(d), times YaRN's mscale(factor, mscale_all_dim)^2 for MLA (as in the reference)."""
        if self.attention_kind == "gqa":
            return self.head_dim**-0.5
        scale = self.qk_head_dim**-0.5
        r = self.rope
        if r.type == "yarn" and r.mscale_all_dim and r.factor > 1:
            m = 0.1 * r.mscale_all_dim * math.log(r.factor) + 1.0
            scale *= m * m
        return scale

    def replace(self, **kw) -> "ModelConfig":
        return dataclasses.replace(self, **kw)

    # ---- HF config.json ----------------------------------------------------------------------
    @classmethod
    def from_hf(cls, raw: dict[str, Any], generation_eos: int | list[int] | None = None) -> "ModelConfig":
        """Read an HF config dict. K2.5/K2.6 nest the text model under `text_config`. A key the dict
        leaves out takes its transformers config class's default. generation_eos: the
        generation_config.json's eos_token_id, stop tokens beside the config's (as vLLM adds them)."""
        if "text_config" in raw:  # K2.5/K2.6: a multimodal wrapper; we serve its text model
            outer_ids = {k: raw[k] for k in ("bos_token_id", "eos_token_id") if k in raw}
            raw = {**outer_ids, **raw["text_config"]}
        model_type = raw.get("model_type")
        if model_type in ("kimi_k2", "kimi_k25"):  # Moonshot's remote-code names for the DeepseekV3 text model
            model_type = "deepseek_v3"
        if model_type not in FAMILIES:
            raise ValueError(f"unsupported model_type {model_type!r}; mixserve reads {FAMILIES}")
        if raw.get("hidden_act", "silu") not in ("silu", "swish"):
            raise ValueError(f"unsupported hidden_act {raw['hidden_act']!r}: mixserve's MLPs and experts use SiLU")
        defaults = HF_CLASS_DEFAULTS[model_type]
        get = lambda key, fallback=None: raw.get(key, defaults.get(key, fallback))
        n_layers = raw["num_hidden_layers"]
        eos_ids = tuple(dict.fromkeys(_ids(get("eos_token_id")) + _ids(generation_eos)))
        common = dict(
            family=model_type,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            num_layers=n_layers,
            num_heads=raw["num_attention_heads"],
            intermediate_size=raw["intermediate_size"],
            rms_norm_eps=get("rms_norm_eps"),
            max_position_embeddings=get("max_position_embeddings"),
            tie_word_embeddings=bool(get("tie_word_embeddings", False)),
            rope=_rope_from_hf(raw, get("max_position_embeddings")),
            attention_bias=bool(get("attention_bias", False)),
            n_routed_experts=_routed_experts(raw, model_type, get("n_routed_experts")) or 0,
            n_shared_experts=get("n_shared_experts") or 0,
            num_experts_per_tok=get("num_experts_per_tok") or 1,
            moe_intermediate_size=get("moe_intermediate_size"),
            n_group=get("n_group") or 1,
            topk_group=get("topk_group") or 1,
            norm_topk_prob=bool(get("norm_topk_prob", True)),
            routed_scaling_factor=float(get("routed_scaling_factor")),
            first_k_dense_replace=get("first_k_dense_replace") or 0,
            num_mtp_layers=raw.get("num_nextn_predict_layers", raw.get("num_mtp_layers", get("num_nextn_predict_layers", 0))) or 0,
            bos_token_id=get("bos_token_id"),
            eos_token_ids=eos_ids,
        )
        if model_type == "glm4_moe":
            partial = _rope_parameters(raw).get("partial_rotary_factor", get("partial_rotary_factor", 0.5))
            return cls(
                **common,
                num_kv_heads=raw["num_key_value_heads"],
                head_dim=get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"],
                partial_rotary_factor=float(partial),
                use_qk_norm=bool(get("use_qk_norm", False)),
            )
        mla = dict(
            q_lora_rank=get("q_lora_rank"),
            kv_lora_rank=raw["kv_lora_rank"],
            qk_nope_head_dim=raw["qk_nope_head_dim"],
            qk_rope_head_dim=raw["qk_rope_head_dim"],
            v_head_dim=raw["v_head_dim"],
        )
        if model_type == "deepseek_v3":
            return cls(**common, **mla, rope_interleave=bool(get("rope_interleave", True)))
        mlp_types = get("mlp_layer_types")
        if mlp_types is not None:  # GLM-5 may list dense/sparse per layer; we need a dense prefix
            n_dense = sum(t == "dense" for t in mlp_types)
            if list(mlp_types) != ["dense"] * n_dense + ["sparse"] * (n_layers - n_dense):
                raise ValueError(f"mlp_layer_types must be dense layers then sparse layers, got {mlp_types}")
            common["first_k_dense_replace"] = n_dense
        return cls(
            **common,
            **mla,
            rope_interleave=True,  # GlmMoeDsa always applies interleaved RoPE
            index_topk=get("index_topk"),
            index_head_dim=get("index_head_dim"),
            index_n_heads=get("index_n_heads"),
            indexer_types=tuple(get("indexer_types") or _default_indexer_types(raw, n_layers)),
        )


def _default_indexer_types(raw: dict, n_layers: int) -> list[str]:
    """The reference's schedule when a checkpoint gives no explicit per-layer list."""
    pattern = raw.get("index_topk_pattern")
    if pattern is not None:
        return [{"F": "full", "S": "shared"}[c] for c in pattern] if isinstance(pattern, str) else list(pattern)
    freq = max(raw.get("index_topk_freq", 1), 1)
    offset = raw.get("index_skip_topk_offset", 2)
    return ["full" if (max(i - offset + 1, 0) % freq) == 0 else "shared" for i in range(n_layers)]


def _ids(value: int | list[int] | None) -> tuple[int, ...]:
    return tuple(value) if isinstance(value, list) else (() if value is None else (value,))


def _routed_experts(raw: dict, model_type: str, default: int | None) -> int | None:
    """n_routed_experts, or a name transformers reads as it: num_local_experts (the classes'
    attribute_map), and GLM-5's older num_experts. Names that disagree are refused."""
    names = ("n_routed_experts", "num_local_experts") + (("num_experts",) if model_type == "glm_moe_dsa" else ())
    given = {name: raw[name] for name in names if raw.get(name) is not None}
    if len(set(given.values())) > 1:
        raise ValueError(f"the config's routed expert counts disagree: {given}")
    return next(iter(given.values()), default)


def _rope_parameters(raw: dict) -> dict:
    """transformers 5 writes `rope_parameters`; older checkpoints write `rope_theta` + `rope_scaling`.
    A config with both is read as transformers reads it: `rope_scaling` replaces `rope_parameters`."""
    return dict(raw.get("rope_scaling") or raw.get("rope_parameters") or {})


def _rope_from_hf(raw: dict, max_position_embeddings: int) -> RopeConfig:
    params = _rope_parameters(raw)
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ("default", "yarn"):
        raise ValueError(f"unsupported rope type {rope_type!r} (mixserve implements default and yarn)")
    if rope_type == "default":
        return RopeConfig(theta=float(theta))
    return RopeConfig(
        theta=float(theta),
        type="yarn",
        factor=float(params["factor"]),
        original_max_position_embeddings=int(
            raw.get("original_max_position_embeddings")
            or params.get("original_max_position_embeddings")
            or max_position_embeddings
        ),
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        mscale=params.get("mscale"),
        mscale_all_dim=params.get("mscale_all_dim"),
        attention_factor=params.get("attention_factor"),
        truncate=bool(params.get("truncate", True)),
    )
