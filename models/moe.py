"""Mixture of experts: the sigmoid group-limited router of DeepSeek-V3 / GLM, routed experts, shared experts."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from models import partitioning
from models.config import ModelConfig
from models.layers import Dtype, GatedMLP, weight_param
from models.weights import BF16, WeightFormat, expert_matmul

UP_AXES, DOWN_AXES = ("experts", "embed", "moe_mlp"), ("experts", "moe_mlp", "embed")
# Each MoE layer sows the experts it chose per token under this name in the "intermediates"
# collection: a forward applied with that collection mutable returns them (sown_routes), any other
# forward ignores the sow (routed experts return, mixserve.model_runner).
ROUTES = "routed_experts"


def route(logits_TE: jax.Array, bias_E: jax.Array, cfg: ModelConfig,
          replay_TK: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Pick experts per token -> (weights_TK float32, experts_TK int32).

    s = sigmoid(logits); the correction bias is added only for choosing. Each of n_group groups
    scores the sum of its top-2 choices; the best topk_group groups stay; top-k over what is left.
    Weights are s at the chosen experts, optionally normalised, times routed_scaling_factor.
    replay_TK (routing replay, R3): these experts instead of the choice; their weights are still
    the router's scores (a trainer's gradient reaches the router), only the selection is replayed.
    """
    num_tokens, num_experts = logits_TE.shape
    scores = jax.nn.sigmoid(logits_TE.astype(jnp.float32))
    if replay_TK is not None:
        return _weighted(scores, replay_TK.astype(jnp.int32), cfg)
    choice = scores + bias_E.astype(jnp.float32)
    if cfg.topk_group < cfg.n_group:
        grouped = choice.reshape(num_tokens, cfg.n_group, num_experts // cfg.n_group)
        group_scores = jax.lax.top_k(grouped, 2)[0].sum(-1)
        kept_groups = jax.lax.top_k(group_scores, cfg.topk_group)[1]
        group_mask = jnp.zeros((num_tokens, cfg.n_group), bool).at[jnp.arange(num_tokens)[:, None], kept_groups].set(True)
        expert_mask = jnp.repeat(group_mask, num_experts // cfg.n_group, axis=1)
        choice = jnp.where(expert_mask, choice, -jnp.inf)
    return _weighted(scores, jax.lax.top_k(choice, cfg.num_experts_per_tok)[1].astype(jnp.int32), cfg)


def _weighted(scores_TE: jax.Array, experts_TK: jax.Array, cfg: ModelConfig) -> tuple[jax.Array, jax.Array]:
    weights = jnp.take_along_axis(scores_TE, experts_TK, axis=1)
    if cfg.norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
    return weights * cfg.routed_scaling_factor, experts_TK


def expert_groups(experts_TK: jax.Array, keep_TK: jax.Array, num_experts: int):
    """(order, group_sizes_E): the T*K (token, choice) rows sorted by expert, and rows per expert.

    A row not kept (keep_TK False: a padding token, i.e. an idle batch slot or the tail of a
    prefill chunk; under expert parallelism, an expert another device holds) joins no group: it
    sorts after every kept row, where the grouped matmuls return zeros. The INT4 grouped kernel
    streams only experts with rows, so it reads no weights for padding alone (the XLA paths
    dequantize every expert whatever the routing). Measured on tiny-kimi widened to 64 experts,
    top-8: one live request among 8 decode slots had 8 active experts per layer, 14-16 with the
    idle slots routed (they share one input, token 0 at position 0); a 64-token prefill chunk
    holding 1 real token, 8 against 13-17.
    """
    flat_experts = jnp.where(keep_TK.reshape(-1), experts_TK.reshape(-1), num_experts)  # bincount drops num_experts
    order = jnp.argsort(flat_experts)
    return order, jnp.bincount(flat_experts, length=num_experts).astype(jnp.int32)


def routed_ffn(x_TD, weights_TK, experts_TK, keep_TK, gate, up, down, first_expert, *, backend: str):
    """float32 [T, D]: the routed experts' weighted output from experts [first_expert, first_expert
    + E_local) only, the ones gate/up/down [E_local, ...] hold (all of them without expert
    parallelism). Choices of other experts contribute nothing, so the devices' outputs sum to the whole."""
    num_local, k = gate.shape[0], experts_TK.shape[1]
    local_TK = experts_TK - first_expert
    order, group_sizes = expert_groups(local_TK, keep_TK & (local_TK >= 0) & (local_TK < num_local), num_local)
    token_of_row = order // k
    x_sorted = x_TD[token_of_row]
    mm = lambda a, w, axes: expert_matmul(a, w, group_sizes, backend=backend, axes=axes)
    h = nn.silu(mm(x_sorted, gate, UP_AXES)) * mm(x_sorted, up, UP_AXES)
    y_sorted = mm(h, down, DOWN_AXES).astype(jnp.float32) * weights_TK.reshape(-1)[order][:, None]
    return jnp.zeros(x_TD.shape, jnp.float32).at[token_of_row].add(y_sorted)


class Router(nn.Module):
    cfg: ModelConfig

    @nn.compact
    def __call__(self, x_TD, replay_TK=None):
        # The router stays in float32 whatever the model dtype (as transformers keeps it).
        kernel = self.param(
            "kernel", nn.with_logical_partitioning(nn.initializers.normal(0.02), ("embed", "expert_scores")),
            (x_TD.shape[-1], self.cfg.n_routed_experts), jnp.float32,
        )
        bias = self.param(
            "e_score_correction_bias", nn.with_logical_partitioning(nn.initializers.zeros, ("expert_scores",)),
            (self.cfg.n_routed_experts,), jnp.float32,
        )
        logits = jnp.dot(x_TD.astype(jnp.float32), kernel, precision=jax.lax.Precision.HIGHEST)
        return route(logits, bias, self.cfg, replay_TK)


class RoutedExperts(nn.Module):
    """Stacked expert weights gate/up [E, D, F], down [E, F, D]; tokens sorted by expert, then grouped matmuls.

    expert_parallel: under a mesh with a "model" axis of n > 1 devices, each device holds E/n whole
    experts (mixserve.sharding places them so) and runs them on every token; the devices' outputs
    are summed (one all-reduce, as TP's row-parallel down projection needs anyway).
    """

    cfg: ModelConfig
    fmt: WeightFormat = BF16
    dtype: Dtype = jnp.bfloat16
    backend: str = "xla"
    expert_parallel: bool = False

    @nn.compact
    def __call__(self, x_TD, weights_TK, experts_TK, valid_T=None):
        cfg = self.cfg
        num_experts, inter, hidden = cfg.n_routed_experts, cfg.moe_intermediate_size, x_TD.shape[-1]
        param = lambda name, axes, shape: weight_param(self, name, self.fmt, axes, self.dtype, shape)
        gate = param("gate_proj", UP_AXES, (num_experts, hidden, inter))
        up = param("up_proj", UP_AXES, (num_experts, hidden, inter))
        down = param("down_proj", DOWN_AXES, (num_experts, inter, hidden))

        out_dtype, x_TD = x_TD.dtype, x_TD.astype(self.dtype)
        keep_TK = jnp.ones(experts_TK.shape, bool) if valid_T is None else jnp.broadcast_to(valid_T[:, None], experts_TK.shape)
        mesh = partitioning.context_mesh() if self.expert_parallel else None
        if mesh is None:
            y = routed_ffn(x_TD, weights_TK, experts_TK, keep_TK, gate, up, down, 0, backend=self.backend)
        else:
            partitioning.check_expert_parallel(num_experts, partitioning.tp_size(mesh))

            def per_device(x, w, e, keep, gate, up, down):
                first = jax.lax.axis_index(partitioning.MODEL_AXIS) * gate.shape[0]
                return jax.lax.psum(routed_ffn(x, w, e, keep, gate, up, down, first, backend=self.backend),
                                    partitioning.MODEL_AXIS)

            split = P(partitioning.MODEL_AXIS)  # a prefix: every leaf of a quantized weight splits its experts
            y = partitioning.per_device(per_device, mesh, (P(),) * 4 + (split,) * 3, P())(
                x_TD, weights_TK, experts_TK, keep_TK, gate, up, down)
        return y.astype(out_dtype)


class MoE(nn.Module):
    cfg: ModelConfig
    experts_fmt: WeightFormat = BF16
    linear_fmt: WeightFormat = BF16
    dtype: Dtype = jnp.bfloat16
    backend: str = "xla"
    expert_parallel: bool = False

    @nn.compact
    def __call__(self, x_BTD, valid_BT=None, replay_BTK=None):
        """replay_BTK (optional int [B, T, K]): route each token to these experts (routing replay)."""
        cfg = self.cfg
        x_TD = x_BTD.reshape(-1, x_BTD.shape[-1])
        valid_T = None if valid_BT is None else valid_BT.reshape(-1)
        replay_TK = None if replay_BTK is None else replay_BTK.reshape(x_TD.shape[0], -1)
        weights, experts = Router(cfg, name="gate")(x_TD, replay_TK)
        self.sow("intermediates", ROUTES, experts.reshape(*x_BTD.shape[:2], -1).astype(jnp.int16))
        routed = RoutedExperts(cfg, self.experts_fmt, self.dtype, self.backend, self.expert_parallel, name="experts")(
            x_TD, weights, experts, valid_T)
        out = routed.reshape(x_BTD.shape)
        if cfg.n_shared_experts:
            shared = GatedMLP(cfg.moe_intermediate_size * cfg.n_shared_experts, self.linear_fmt, self.dtype, self.backend, name="shared_experts")
            out = out + shared(x_BTD)
        return out


def sown_routes(intermediates: dict, cfg: ModelConfig) -> jax.Array:
    """int16 [B, T, L, K]: the K experts each MoE layer (L of them, in layer order; the dense
    first_k_dense_replace layers have none) chose for each token, from a forward applied with
    mutable=["intermediates"]. The MTP layer's are not among them (it drafts; it is not the model)."""
    return jnp.stack([intermediates[f"layers_{i}"]["mlp"][ROUTES][0] for i in cfg.moe_layers], axis=2)
