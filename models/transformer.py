"""The decoder-only transformer shared by the three families.

    embed -> [input_layernorm -> attention -> + -> post_attention_layernorm -> MLP or MoE -> +] x L
          -> norm -> lm_head

and the multi-token-prediction (MTP) layer that DeepSeek-V3 (Kimi's architecture), GLM-4.5 and
GLM-5 checkpoints ship after the decoder layers (model.layers.{L}.*), the draft of speculative
decoding (mixserve/speculative.py), as SGLang runs it (deepseek_nextn.py, glm4_moe_nextn.py):

    x   = eh_proj([enorm(embed(t_{p+1})) ; hnorm(h_p)])   h_p: the model's output at position p
    x   = shared_head.norm(decoder layer L (x))            (after the final norm: what lm_head reads)
    out = lm_head(x)                                       -> a guess at t_{p+2}

at RoPE position p, over the layer's own KV cache. embed_tokens and lm_head are the model's
(checkpoints that store copies in layer L are read without them, as SGLang loads them). A second
draft step feeds x back as h with the first guess as the token: SGLang feeds the normed x, vLLM
the x before shared_head.norm; this follows SGLang, so every step's h is what a head reads.
vLLM also zeroes the embedding at position 0, a leftover of its V0 alignment; SGLang does not,
nor does this.
"""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp

from models.attention import GQAAttention, MLAAttention
from models.config import ModelConfig
from models.kv import NoCache
from models.layers import Dtype, GatedMLP, Linear, RMSNorm, rope_cos_sin
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
    def __call__(self, x_BTD, cos, sin, kv, index_mask=None, valid_BT=None, replay_BTK=None, index_replay_BTK=None):
        return self.block(x_BTD, cos, sin, kv, index_mask, valid_BT, replay_BTK, index_replay_BTK)

    def block(self, x_BTD, cos, sin, kv, index_mask, valid_BT, replay_BTK=None, index_replay_BTK=None):
        """The layer itself (called from a compact __call__: the MTP layer reuses it)."""
        cfg = self.cfg
        common = dict(dtype=self.dtype, backend=self.backend)
        h = RMSNorm(cfg.rms_norm_eps, self.dtype, "embed", name="input_layernorm")(x_BTD)
        if cfg.attention_kind == "gqa":
            attn = GQAAttention(cfg, self.plan.linear, name="self_attn", **common)(h, cos, sin, kv)
        else:
            runs_indexer = cfg.runs_indexer(self.layer)
            attn, index_mask = MLAAttention(cfg, self.plan.linear, runs_indexer=runs_indexer, name="self_attn", **common)(
                h, cos, sin, kv, index_mask, index_replay_BTK
            )
        x_BTD = x_BTD + attn
        h = RMSNorm(cfg.rms_norm_eps, self.dtype, "embed", name="post_attention_layernorm")(x_BTD)
        if cfg.is_moe_layer(self.layer):
            mlp_out = MoE(cfg, self.plan.experts, self.plan.linear, expert_parallel=self.expert_parallel, name="mlp",
                          **common)(h, valid_BT, replay_BTK)
        else:
            mlp_out = GatedMLP(cfg.intermediate_size, self.plan.linear, name="mlp", **common)(h)
        return x_BTD + mlp_out, index_mask


class NextTokenPredictor(DecoderLayer):
    """The MTP layer: embedded_BTD (embed(t_{p+1})), hidden_BTD (h_p) -> x_BTD (normed, for lm_head)."""

    @nn.compact
    def __call__(self, embedded_BTD, hidden_BTD, cos, sin, kv, valid_BT=None):
        cfg = self.cfg
        norm = lambda name: RMSNorm(cfg.rms_norm_eps, self.dtype, "embed", name=name)
        joined = jnp.concatenate([norm("enorm")(embedded_BTD), norm("hnorm")(hidden_BTD)], axis=-1)
        x_BTD = Linear(cfg.hidden_size, ("embed_pair", "embed"), fmt=self.plan.linear, dtype=self.dtype,
                       backend=self.backend, name="eh_proj")(joined)
        x_BTD, _ = self.block(x_BTD, cos, sin, kv, None, valid_BT)
        return SharedHeadNorm(cfg.rms_norm_eps, self.dtype, name="shared_head")(x_BTD)


class SharedHeadNorm(nn.Module):
    """shared_head.norm; the vocabulary projection is the model's lm_head (module docstring)."""

    eps: float
    dtype: Dtype

    @nn.compact
    def __call__(self, x_BTD):
        return RMSNorm(self.eps, self.dtype, "embed", name="norm")(x_BTD)


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
    `return_hidden`: also return what the vocabulary projection reads (after the final norm: the
    MTP's h), as (logits, hidden_BTD).
    `routed_experts` (optional int [B, T, L, K], routing replay): MoE layer l (the l-th of the
    model's MoE layers) routes token t to routed_experts[:, t, l] instead of its own top-k, with
    its own router's weights for them (mixserve.Engine(return_routed_experts=True) gives a
    rollout's; an RL trainer replays them so its forward routes as the rollout did).
    `indexer_topk` (optional int [B, T, L, index_topk], DSA indexer replay, GLM-5): indexer layer l
    (cfg.indexer_layers[l]) lets token t attend to the positions indexer_topk[:, t, l] (-1: none)
    instead of its own choice (Engine(return_indexer_topk=True) gives a rollout's). Plain forward only.
    `mtp_plan` (None: no MTP layer): the MTP layer's weight formats. Then `draft_from` (hidden_BTD)
    runs the MTP layer alone, on tokens_BT = the tokens after those positions, and returns
    (logits, its x_BTD); the MTP's KV cache is kv.layer(cfg.mtp_layer).
    """

    cfg: ModelConfig
    plan: WeightPlan = WeightPlan()
    dtype: Dtype = jnp.bfloat16
    backend: str = "xla"
    expert_parallel: bool = False
    mtp_plan: WeightPlan | None = None

    @nn.compact
    def __call__(self, tokens_BT, positions_BT=None, kv=None, logits_at=None, valid_BT=None, project=None,
                 return_hidden=False, draft_from=None, routed_experts=None, indexer_topk=None):
        cfg = self.cfg
        kv = NoCache() if kv is None else kv
        if positions_BT is None:
            positions_BT = jnp.broadcast_to(jnp.arange(tokens_BT.shape[1]), tokens_BT.shape)
        embed = nn.Embed(
            cfg.vocab_size, cfg.hidden_size, dtype=self.dtype, param_dtype=self.dtype,
            embedding_init=nn.with_logical_partitioning(nn.initializers.normal(0.02), ("vocab", "embed")),
            name="embed_tokens",
        )
        cos, sin = rope_cos_sin(cfg, positions_BT)
        if draft_from is not None or self.mtp_plan is not None and self.is_initializing():
            mtp = NextTokenPredictor(cfg, cfg.mtp_layer, self.mtp_plan, self.dtype, self.backend, self.expert_parallel,
                                     name=f"layers_{cfg.mtp_layer}")
        if draft_from is not None:
            x = mtp(embed(tokens_BT), draft_from, cos, sin, kv.layer(cfg.mtp_layer), valid_BT)
        else:
            x = embed(tokens_BT)
            index_mask = None
            for i in range(cfg.num_layers):
                layer = DecoderLayer(cfg, i, self.plan, self.dtype, self.backend, self.expert_parallel, name=f"layers_{i}")
                replay = None if routed_experts is None or not cfg.is_moe_layer(i) else \
                    routed_experts[:, :, i - cfg.first_k_dense_replace]  # the MoE layers follow the dense ones
                index_replay = None if indexer_topk is None or i not in cfg.indexer_layers else \
                    indexer_topk[:, :, cfg.indexer_layers.index(i)]
                x, index_mask = layer(x, cos, sin, kv.layer(i), index_mask, valid_BT, replay, index_replay)
            x = RMSNorm(cfg.rms_norm_eps, self.dtype, "embed", name="norm")(x)
            if self.mtp_plan is not None and self.is_initializing():  # create the MTP layer's parameters
                mtp(embed(tokens_BT), x, cos, sin, kv.layer(cfg.mtp_layer), valid_BT)
        out = self._head(embed, x, logits_at, project)
        return (out, x) if return_hidden or draft_from is not None else out

    def _head(self, embed, x, logits_at, project):
        cfg = self.cfg
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
