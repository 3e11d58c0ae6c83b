"""Attention: GQA (GLM-4.x), MLA (Kimi K2 / GLM-5) and the DSA lightning indexer (GLM-5).

Each module projects its inputs, then hands the attention itself to `kv`, an object that either
attends causally over the tokens given (`models.kv.NoCache`, the plain forward behind
`Model.logits`) or reads and writes a paged KV pool (`mixserve.kv_cache`). The projections are
the same in both cases, so the engine and the reference forward share all model code.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp

from models.config import ModelConfig
from models.layers import Dtype, LayerNorm, Linear, RMSNorm, apply_rope, weight_param
from models.weights import BF16, WeightFormat, dequantize, matmul

MLA_NORM_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm use the RMSNorm default, not config.rms_norm_eps
# Each DSA indexer sows the positions it chose per token (models.kv.chosen_positions) under this
# name in the "intermediates" collection, as the MoE layers sow their experts (models/moe.py).
INDEXER_TOPK = "indexer_topk"


class GQAAttention(nn.Module):
    """Grouped-query attention with optional QK-norm, attention bias and partial rotary."""

    cfg: ModelConfig
    fmt: WeightFormat = BF16
    dtype: Dtype = jnp.bfloat16
    backend: str = "xla"

    @nn.compact
    def __call__(self, x_BTD, cos, sin, kv):
        cfg = self.cfg
        B, T, _ = x_BTD.shape
        H, K, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        lin = dict(fmt=self.fmt, dtype=self.dtype, backend=self.backend)
        q = Linear(H * D, ("embed", "heads"), cfg.attention_bias, name="q_proj", **lin)(x_BTD).reshape(B, T, H, D)
        k = Linear(K * D, ("embed", "kv_heads"), cfg.attention_bias, name="k_proj", **lin)(x_BTD).reshape(B, T, K, D)
        v = Linear(K * D, ("embed", "kv_heads"), cfg.attention_bias, name="v_proj", **lin)(x_BTD).reshape(B, T, K, D)
        if cfg.use_qk_norm:
            q = RMSNorm(cfg.rms_norm_eps, self.dtype, "head_dim", name="q_norm")(q)
            k = RMSNorm(cfg.rms_norm_eps, self.dtype, "head_dim", name="k_norm")(k)
        r = cfg.rotary_dim
        q = jnp.concatenate([apply_rope(q[..., :r], cos, sin, interleaved=False), q[..., r:]], axis=-1)
        k = jnp.concatenate([apply_rope(k[..., :r], cos, sin, interleaved=False), k[..., r:]], axis=-1)
        out_BTHD = kv.attend_gqa(q, k, v, scale=cfg.softmax_scale)
        return Linear(cfg.hidden_size, ("heads", "embed"), name="o_proj", **lin)(out_BTHD.reshape(B, T, H * D))


class MLAAttention(nn.Module):
    """Multi-head latent attention. Per token the cache holds only c_kv (kv_lora_rank, normalised)
    and the shared roped key k_pe (qk_rope_head_dim); kv_b_proj expands them per head."""

    cfg: ModelConfig
    fmt: WeightFormat = BF16
    dtype: Dtype = jnp.bfloat16
    backend: str = "xla"
    runs_indexer: bool = False  # GLM-5 "full" layers; "shared" layers reuse the previous selection

    @nn.compact
    def __call__(self, x_BTD, cos, sin, kv, index_mask=None, index_replay_BTK=None):
        """Returns (out_BTD, index_mask): GLM-5's indexer selection, reused by 'shared' layers.
        index_replay_BTK: the positions its indexer chooses instead (DSAIndexer)."""
        cfg = self.cfg
        B, T, _ = x_BTD.shape
        H, N, R, V, L = cfg.num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
        lin = dict(fmt=self.fmt, dtype=self.dtype, backend=self.backend)
        if cfg.q_lora_rank is None:
            q_resid = None
            q = Linear(H * (N + R), ("embed", "heads"), name="q_proj", **lin)(x_BTD)
        else:
            q_resid = Linear(cfg.q_lora_rank, ("embed", "q_lora"), cfg.attention_bias, name="q_a_proj", **lin)(x_BTD)
            q_resid = RMSNorm(MLA_NORM_EPS, self.dtype, "q_lora", name="q_a_layernorm")(q_resid)
            q = Linear(H * (N + R), ("q_lora", "heads"), name="q_b_proj", **lin)(q_resid)
        q = q.reshape(B, T, H, N + R)
        q_nope, q_pe = q[..., :N], apply_rope(q[..., N:], cos, sin, interleaved=cfg.rope_interleave)

        ckv = Linear(L + R, ("embed", "kv_lora"), cfg.attention_bias, name="kv_a_proj_with_mqa", **lin)(x_BTD)
        c_kv = RMSNorm(MLA_NORM_EPS, self.dtype, "kv_lora", name="kv_a_layernorm")(ckv[..., :L])
        k_pe = apply_rope(ckv[..., L:], cos, sin, interleaved=cfg.rope_interleave)

        if self.runs_indexer:
            index_mask = DSAIndexer(cfg, self.fmt, self.dtype, self.backend, name="indexer")(x_BTD, q_resid, cos, sin, kv,
                                                                                           index_replay_BTK)

        kv_b = LatentUpProjection(L, H * (N + V), name="kv_b_proj", **lin | {"fmt": dataclasses.replace(self.fmt, w4a4=False)})
        out_BTHV = kv.attend_mla(q_nope, q_pe, c_kv, k_pe, kv_b, scale=cfg.softmax_scale, index_mask=index_mask)
        out = Linear(cfg.hidden_size, ("heads", "embed"), cfg.attention_bias, name="o_proj", **lin)(out_BTHV.reshape(B, T, H * V))
        return out, index_mask


def sown_indexer_topk(intermediates: dict, cfg: ModelConfig) -> jax.Array:
    """int32 [B, T, L, index_topk]: the positions each of the L indexer layers (cfg.indexer_layers)
    chose per token, from a forward applied with mutable=["intermediates"] (the MTP layer's
    indexer drafts; its choices are not the model's)."""
    return jnp.stack([intermediates[f"layers_{i}"]["self_attn"]["indexer"][INDEXER_TOPK][0]
                      for i in cfg.indexer_layers], axis=2)


class LatentUpProjection(nn.Module):
    """kv_b_proj: latent c_kv [L] -> per-head (k_nope, v). Besides applying it (prefill, the
    'naive' form), decode absorbs its weight into q and the output (`dense_kernel`). Its format is
    never W4A4 (MLAAttention builds it weight-only): absorbed decode never multiplies the latent by
    it, and prefill must compute what decode does (vLLM's FP4 prefill quantizes the latent, its
    decode not)."""

    in_features: int
    features: int
    fmt: WeightFormat = BF16
    dtype: Dtype = jnp.bfloat16
    backend: str = "xla"

    def setup(self):
        self.kernel = weight_param(self, "kernel", self.fmt, ("kv_lora", "heads"), self.dtype,
                                   (self.in_features, self.features))

    def __call__(self, c_kv):
        return matmul(c_kv.astype(self.dtype), self.kernel, backend=self.backend, axes=("kv_lora", "heads"))

    def dense_kernel(self):
        return dequantize(self.kernel, self.dtype)


class DSAIndexer(nn.Module):
    """DeepSeek Sparse Attention lightning indexer: picks index_topk past tokens per query.

    score[t, s] = sum_h w_h(x_t) * relu(q_h(t) . k(s) / sqrt(index_head_dim)), w = weights_proj(x) / sqrt(n_heads).
    Keys use interleaved RoPE on their first qk_rope_head_dim dims and a LayerNorm.
    replay_BTK (optional int [B, T, index_topk], indexer replay): the positions each token attends
    to instead of its own choice, as chosen_positions gives them (-1: none); nothing is scored,
    since the selection is all that attention takes from the indexer.
    """

    cfg: ModelConfig
    fmt: WeightFormat = BF16
    dtype: Dtype = jnp.bfloat16
    backend: str = "xla"

    @nn.compact
    def __call__(self, x_BTD, q_resid, cos, sin, kv, replay_BTK=None):
        cfg = self.cfg
        if replay_BTK is not None:
            self.sow("intermediates", INDEXER_TOPK, replay_BTK)
            return kv.index_replay(replay_BTK)
        B, T, _ = x_BTD.shape
        nh, hd, R = cfg.index_n_heads, cfg.index_head_dim, cfg.qk_rope_head_dim
        lin = dict(fmt=self.fmt, dtype=self.dtype, backend=self.backend)
        q = Linear(nh * hd, ("q_lora", "index_heads"), name="wq_b", **lin)(q_resid).reshape(B, T, nh, hd)
        k = LayerNorm(1e-6, self.dtype, "index_head_dim", name="k_norm")(Linear(hd, ("embed", "index_head_dim"), name="wk", **lin)(x_BTD))
        q = jnp.concatenate([apply_rope(q[..., :R], cos, sin, interleaved=True), q[..., R:]], axis=-1)
        k = jnp.concatenate([apply_rope(k[..., :R], cos, sin, interleaved=True), k[..., R:]], axis=-1)
        # weights_proj stays float32, as transformers keeps it.
        w = Linear(nh, ("embed", "index_heads"), name="weights_proj", dtype=jnp.float32)(x_BTD.astype(jnp.float32))
        w = w * nh**-0.5
        index_mask, chosen_BTK = kv.index_select(q.astype(jnp.float32), k.astype(jnp.float32), w, scale=hd**-0.5,
                                                 top_k=cfg.index_topk)
        self.sow("intermediates", INDEXER_TOPK, chosen_BTK)
        return index_mask
