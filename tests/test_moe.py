"""MoE routing with padding tokens: a padded batch (idle decode slots, the tail of a prefill chunk)
must not activate experts that no real token chose, and must not change the real tokens' output."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mixserve
from mixserve.quantize import plan_for, quantize_model
from models.layers import GatedMLP
from models.moe import MoE, expert_groups, routed_ffn
from models.weights import WeightFormat


def test_padding_tokens_join_no_expert_group():
    rng = np.random.default_rng()
    num_tokens, k, num_experts = 12, 3, 16
    experts_TK = jnp.asarray(np.stack([rng.choice(num_experts, k, replace=False) for _ in range(num_tokens)]), jnp.int32)
    valid_T = jnp.asarray(rng.random(num_tokens) < 0.4).at[0].set(True)
    order, sizes = expert_groups(experts_TK, jnp.broadcast_to(valid_T[:, None], (num_tokens, k)), num_experts)
    real = np.asarray(experts_TK)[np.asarray(valid_T)]
    np.testing.assert_array_equal(sizes, np.bincount(real.reshape(-1), minlength=num_experts))
    # The grouped rows are exactly the real tokens' (token, choice) rows, sorted by expert.
    rows = np.asarray(order)[: int(sizes.sum())]
    assert set(rows // k) == set(np.flatnonzero(np.asarray(valid_T)))
    assert np.all(np.diff(np.asarray(experts_TK).reshape(-1)[rows]) >= 0)
    _, all_sizes = expert_groups(experts_TK, jnp.ones((num_tokens, k), bool), num_experts)
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


@pytest.mark.parametrize("weights", ["f32-xla", "int4-interpret"])
def test_expert_slices_sum_to_all_experts(weights):
    """Expert parallelism's arithmetic on one device: routed_ffn over each quarter of the experts
    (the experts device i of 4 holds, first_expert = 2i) is zero on every token that chose none of
    them, and the quarters sum to routed_ffn over all experts. Padding tokens get zero from every
    quarter."""
    model = mixserve.load("tiny-kimi", dtype="float32")
    backend = "xla"
    if weights == "int4-interpret":
        model, backend = quantize_model(model, plan_for(WeightFormat("int4", 16), "experts"))[0], "interpret"
    cfg = model.config
    experts = model.params[f"layers_{next(i for i in range(cfg.num_layers) if cfg.is_moe_layer(i))}"]["mlp"]["experts"]
    seed = int(np.random.default_rng().integers(2**31))
    rng = np.random.default_rng(seed)  # every input below follows from the seed in the messages
    num_tokens, k, per_device = 12, cfg.num_experts_per_tok, cfg.n_routed_experts // 4
    x_TD = jax.random.normal(jax.random.key(seed), (num_tokens, cfg.hidden_size))
    experts_TK = jnp.asarray(np.stack([rng.choice(cfg.n_routed_experts, k, replace=False) for _ in range(num_tokens)]), jnp.int32)
    weights_TK = jnp.asarray(rng.uniform(0.1, 1.0, (num_tokens, k)), jnp.float32)
    keep_TK = jnp.broadcast_to(jnp.asarray(rng.random(num_tokens) < 0.8)[:, None], (num_tokens, k))
    run = lambda first, ws: np.asarray(routed_ffn(x_TD, weights_TK, experts_TK, keep_TK, *ws, first, backend=backend))
    whole = run(0, (experts["gate_proj"], experts["up_proj"], experts["down_proj"]))
    parts = []
    for first in range(0, cfg.n_routed_experts, per_device):
        local = [jax.tree.map(lambda a: a[first : first + per_device], experts[name])
                 for name in ("gate_proj", "up_proj", "down_proj")]
        parts.append(run(first, local))
        chose = np.any(np.asarray(keep_TK) & (np.asarray(experts_TK) // per_device == first // per_device), axis=1)
        assert np.all(parts[-1][~chose] == 0) and np.all(np.abs(parts[-1][chose]).max(axis=1) > 0), (seed, first)
    # Exact, not close: with k = 2 a token's output is one float32 addition of its two weighted
    # expert rows whichever devices hold them (0 + a is exact, a + b = b + a), and an expert row's
    # matmul does not depend on which other rows share its group.
    assert k == 2
    np.testing.assert_array_equal(np.sum(parts, axis=0), whole, err_msg=f"seed {seed}")
    assert np.all(whole[~np.asarray(keep_TK)[:, 0]] == 0) and np.abs(whole).max() > 0
