"""MoE routing with padding tokens: a padded batch (idle decode slots, the tail of a prefill chunk)
must not activate experts that no real token chose, and must not change the real tokens' output."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mixserve
from mixserve.quantize import plan_for, quantize_model
from models.layers import GatedMLP
from models.moe import MoE, expert_groups
from models.weights import WeightFormat


def test_padding_tokens_join_no_expert_group():
    rng = np.random.default_rng()
    num_tokens, k, num_experts = 12, 3, 16
    experts_TK = jnp.asarray(np.stack([rng.choice(num_experts, k, replace=False) for _ in range(num_tokens)]), jnp.int32)
    valid_T = jnp.asarray(rng.random(num_tokens) < 0.4).at[0].set(True)
    order, sizes = expert_groups(experts_TK, valid_T, num_experts)
    real = np.asarray(experts_TK)[np.asarray(valid_T)]
    np.testing.assert_array_equal(sizes, np.bincount(real.reshape(-1), minlength=num_experts))
    # The grouped rows are exactly the real tokens' (token, choice) rows, sorted by expert.
    rows = np.asarray(order)[: int(sizes.sum())]
    assert set(rows // k) == set(np.flatnonzero(np.asarray(valid_T)))
    assert np.all(np.diff(np.asarray(experts_TK).reshape(-1)[rows]) >= 0)
    _, all_sizes = expert_groups(experts_TK, None, num_experts)
    assert int(all_sizes.sum()) == num_tokens * k


@pytest.mark.parametrize("weights", ["bf16-xla", "int4-interpret"])
def test_padding_leaves_real_tokens_unchanged(weights):
    """Real tokens get the output they get when nothing is masked; padding tokens get only the
    shared experts (their routed part is exactly zero), in both grouped-matmul paths."""
    model = mixserve.load("tiny-kimi", dtype="float32")
    backend = "xla"
    if weights == "int4-interpret":
        model, backend = quantize_model(model, plan_for(WeightFormat("int4", 16), "experts"))[0], "interpret"
    cfg = model.config
    layer = next(i for i in range(cfg.num_layers) if cfg.is_moe_layer(i))
    params = {"params": model.params[f"layers_{layer}"]["mlp"]}
    moe = MoE(cfg, model.plan.experts, model.plan.linear, jnp.float32, backend)
    x_BTD = jax.random.normal(jax.random.key(np.random.default_rng().integers(2**31)), (3, 5, cfg.hidden_size))
    valid_BT = jnp.arange(5)[None, :] < jnp.array([5, 2, 0])[:, None]  # full row, short row, idle slot
    masked = moe.apply(params, x_BTD, valid_BT)
    unmasked = moe.apply(params, x_BTD)
    np.testing.assert_array_equal(np.asarray(masked)[np.asarray(valid_BT)], np.asarray(unmasked)[np.asarray(valid_BT)])
    assert cfg.n_shared_experts
    shared = GatedMLP(cfg.moe_intermediate_size * cfg.n_shared_experts, model.plan.linear, jnp.float32, backend)
    shared_only = shared.apply({"params": params["params"]["shared_experts"]}, x_BTD)
    np.testing.assert_array_equal(np.asarray(masked)[~np.asarray(valid_BT)], np.asarray(shared_only)[~np.asarray(valid_BT)])
