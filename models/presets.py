"""Named configs: the full-size published models, and tiny ones for tests and the default demo.

Full sizes come from the models' config.json files (see shared/ANCHORS.md); they are for
count_params / weight_bytes and for sharding plans, never for random initialisation here.
"""

from __future__ import annotations

from models.config import ModelConfig, RopeConfig

_KIMI_K2 = ModelConfig(
    family="deepseek_v3", vocab_size=163840, hidden_size=7168, num_layers=61, num_heads=64,
    intermediate_size=18432, rms_norm_eps=1e-6, max_position_embeddings=131072,
    rope=RopeConfig(theta=50000.0, type="yarn", factor=32.0, original_max_position_embeddings=4096,
                    beta_fast=1.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0),
    q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
    n_routed_experts=384, n_shared_experts=1, num_experts_per_tok=8, moe_intermediate_size=2048,
    n_group=1, topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.827, first_k_dense_replace=1,
    bos_token_id=163584, eos_token_ids=(163585,),
)

_GLM_45 = ModelConfig(
    family="glm4_moe", vocab_size=151552, hidden_size=5120, num_layers=92, num_heads=96,
    intermediate_size=12288, rms_norm_eps=1e-5, max_position_embeddings=131072,
    rope=RopeConfig(theta=1_000_000.0), num_kv_heads=8, head_dim=128, partial_rotary_factor=0.5,
    use_qk_norm=True, attention_bias=True,
    n_routed_experts=160, n_shared_experts=1, num_experts_per_tok=8, moe_intermediate_size=1536,
    n_group=1, topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.5, first_k_dense_replace=3,
    num_mtp_layers=1, eos_token_ids=(151329, 151336, 151338),
)

_GLM_5 = ModelConfig(
    family="glm_moe_dsa", vocab_size=154880, hidden_size=6144, num_layers=78, num_heads=64,
    intermediate_size=12288, rms_norm_eps=1e-5, max_position_embeddings=202752,
    rope=RopeConfig(theta=1_000_000.0),
    q_lora_rank=2048, kv_lora_rank=512, qk_nope_head_dim=192, qk_rope_head_dim=64, v_head_dim=256,
    n_routed_experts=256, n_shared_experts=1, num_experts_per_tok=8, moe_intermediate_size=2048,
    n_group=1, topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.5, first_k_dense_replace=3,
    index_topk=2048, index_head_dim=128, index_n_heads=32, indexer_types=("full",) * 78,
    num_mtp_layers=1, eos_token_ids=(154820, 154827, 154829),
)

FULL_PRESETS: dict[str, ModelConfig] = {
    "kimi-k2": _KIMI_K2,
    # K2.5 / K2.6 share K2's text backbone; later copies stretch YaRN to 256k context.
    "kimi-k2.6": _KIMI_K2.replace(
        max_position_embeddings=262144,
        rope=RopeConfig(theta=50000.0, type="yarn", factor=64.0, original_max_position_embeddings=4096,
                        beta_fast=1.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0),
    ),
    "glm-4.5": _GLM_45,
    "glm-4.6": _GLM_45.replace(max_position_embeddings=202752),
    "glm-4.7": _GLM_45.replace(max_position_embeddings=202752),
    "glm-4.5-air": _GLM_45.replace(
        hidden_size=4096, num_layers=46, intermediate_size=10944, n_routed_experts=128,
        moe_intermediate_size=1408, first_k_dense_replace=1, routed_scaling_factor=1.0, use_qk_norm=False,
    ),
    "glm-5": _GLM_5,
}

# Tiny presets: every feature of the family switched on, small enough for CPU tests.
# vocab 320 = 256 byte tokens + a few specials, so a random model can still "speak" bytes.
TINY_PRESETS: dict[str, ModelConfig] = {
    "tiny-kimi": ModelConfig(
        family="deepseek_v3", vocab_size=320, hidden_size=64, num_layers=3, num_heads=4,
        intermediate_size=128, max_position_embeddings=512,
        rope=RopeConfig(theta=50000.0, type="yarn", factor=8.0, original_max_position_embeddings=64,
                        beta_fast=1.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0),
        q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
        n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, moe_intermediate_size=32,
        n_group=2, topk_group=1, routed_scaling_factor=2.827, first_k_dense_replace=1,
        bos_token_id=256, eos_token_ids=(257,),
    ),
    "tiny-glm4": ModelConfig(
        family="glm4_moe", vocab_size=320, hidden_size=64, num_layers=3, num_heads=4,
        intermediate_size=128, rms_norm_eps=1e-5, max_position_embeddings=512,
        rope=RopeConfig(theta=10000.0), num_kv_heads=2, head_dim=16, partial_rotary_factor=0.5,
        use_qk_norm=True, attention_bias=True,
        n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, moe_intermediate_size=32,
        routed_scaling_factor=2.5, first_k_dense_replace=1, bos_token_id=256, eos_token_ids=(257,),
    ),
    "tiny-glm5": ModelConfig(
        family="glm_moe_dsa", vocab_size=320, hidden_size=64, num_layers=3, num_heads=4,
        intermediate_size=128, rms_norm_eps=1e-5, max_position_embeddings=512,
        rope=RopeConfig(theta=10000.0),
        q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
        n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, moe_intermediate_size=32,
        routed_scaling_factor=2.5, first_k_dense_replace=1,
        index_topk=16, index_head_dim=16, index_n_heads=2, indexer_types=("full", "shared", "full"),
        bos_token_id=256, eos_token_ids=(257,),
    ),
}

PRESETS: dict[str, ModelConfig] = {**FULL_PRESETS, **TINY_PRESETS}


def get_preset(name: str) -> ModelConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; known presets: {', '.join(sorted(PRESETS))}")
    return PRESETS[name]
