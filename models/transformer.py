"""The decoder-only transformer shared by the three families.

    embed -> [input_layernorm -> attention -> + -> post_attention_layernorm -> MLP or MoE -> +] x L
          -> norm -> lm_head

Parameter names follow the HF checkpoints (layers_{i}/self_attn/q_a_proj/kernel ...), so
loading is a mechanical renaming (models/hf_names.py).
"""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp

from models.attention import GQAAttention, MLAAttention
from models.config import ModelConfig
from models.kv import NoCache
from models.layers import Dtype, GatedMLP, RMSNorm, rope_cos_sin
from models.moe import MoE
from models.weights import WeightPlan


class DecoderLayer(nn.Module):
    cfg: ModelConfig
    layer: int
    plan: WeightPlan = WeightPlan()
    dtype: Dtype = jnp.bfloat16
    backend: str = "xla"
    expert_parallel: bool = False

    @nn.compact
    def __call__(self, x_BTD, cos, sin, kv, index_mask=None, valid_BT=None):
        cfg = self.cfg
        common = dict(dtype=self.dtype, backend=self.backend)
        h = RMSNorm(cfg.rms_norm_eps, self.dtype, "embed", name="input_layernorm")(x_BTD)
        if cfg.attention_kind == "gqa":
            attn = GQAAttention(cfg, self.plan.linear, name="self_attn", **common)(h, cos, sin, kv)
        else:
            runs_indexer = cfg.family == "glm_moe_dsa" and cfg.indexer_types[self.layer] == "full"
            attn, index_mask = MLAAttention(cfg, self.plan.linear, runs_indexer=runs_indexer, name="self_attn", **common)(
                h, cos, sin, kv, index_mask
            )
        x_BTD = x_BTD + attn
        h = RMSNorm(cfg.rms_norm_eps, self.dtype, "embed", name="post_attention_layernorm")(x_BTD)
        if cfg.is_moe_layer(self.layer):
            mlp_out = MoE(cfg, self.plan.experts, self.plan.linear, expert_parallel=self.expert_parallel, name="mlp",
                          **common)(h, valid_BT)
        else:
            mlp_out = GatedMLP(cfg.intermediate_size, self.plan.linear, name="mlp", **common)(h)
        return x_BTD + mlp_out, index_mask


class Transformer(nn.Module):
    """tokens_BT, positions_BT -> logits_BTV (float32).

    `kv` decides how attention sees the past: NoCache() for a plain causal forward, or a paged
    pool (mixserve.kv_cache) in the engine. `logits_at` (optional int [B]) keeps one position per
    row, so decode and chunked prefill do not pay for the full vocabulary projection of every token.
    `valid_BT` (optional bool) marks the real tokens of a padded batch: padding tokens take no
    routed expert, so they cannot make the INT4 MoE kernel read experts no real token chose.
    `expert_parallel`: the routed experts run per device on the experts each holds (models/moe.py).
    `project` (optional): project(x_BTD, head_DV) -> anything, in place of the vocabulary
    projection x @ head (float32 logits), for a caller that must not hold [B, T, vocab] logits
    (prompt logprobs take them a vocabulary block at a time: mixserve.model_runner).
    """

    cfg: ModelConfig
    plan: WeightPlan = WeightPlan()
    dtype: Dtype = jnp.bfloat16
    backend: str = "xla"
    expert_parallel: bool = False

    @nn.compact
    def __call__(self, tokens_BT, positions_BT=None, kv=None, logits_at=None, valid_BT=None, project=None):
        cfg = self.cfg
        kv = NoCache() if kv is None else kv
        if positions_BT is None:
            positions_BT = jnp.broadcast_to(jnp.arange(tokens_BT.shape[1]), tokens_BT.shape)
        embed = nn.Embed(
            cfg.vocab_size, cfg.hidden_size, dtype=self.dtype, param_dtype=self.dtype,
            embedding_init=nn.with_logical_partitioning(nn.initializers.normal(0.02), ("vocab", "embed")),
            name="embed_tokens",
        )
        x = embed(tokens_BT)
        cos, sin = rope_cos_sin(cfg, positions_BT)
        index_mask = None
        for i in range(cfg.num_layers):
            layer = DecoderLayer(cfg, i, self.plan, self.dtype, self.backend, self.expert_parallel, name=f"layers_{i}")
            x, index_mask = layer(x, cos, sin, kv.layer(i), index_mask, valid_BT)
        x = RMSNorm(cfg.rms_norm_eps, self.dtype, "embed", name="norm")(x)
        if logits_at is not None:
            x = jnp.take_along_axis(x, logits_at[:, None, None], axis=1)
        if cfg.tie_word_embeddings:
            if project is None:
                return embed.attend(x).astype(jnp.float32)
            head = embed.embedding.T
        else:
            head = self.param(
                "lm_head", nn.with_logical_partitioning(nn.initializers.normal(0.02), ("embed", "vocab")),
                (cfg.hidden_size, cfg.vocab_size), self.dtype,
            )
        if project is not None:
            return project(x, head)
        return jnp.einsum("btd,dv->btv", x, head, preferred_element_type=jnp.float32)
