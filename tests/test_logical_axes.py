"""Every parameter carries logical axis names, so 8-device sharding is a table of rules."""

import subprocess
import sys
import textwrap

import jax
from jax.sharding import PartitionSpec

import mixserve
from conftest import host_devices_env

KNOWN_AXES = {"embed", "vocab", "heads", "kv_heads", "head_dim", "q_lora", "kv_lora", "mlp", "moe_mlp",
              "experts", "expert_scores", "index_heads", "index_head_dim", "norm", "embed_pair"}


def test_every_parameter_has_logical_axes():
    for preset in ("tiny-kimi", "tiny-glm4", "tiny-glm5"):
        model = mixserve.load(preset, dtype="float32", mtp=True)  # the MTP layer's too
        axes = model.param_axes
        leaves = jax.tree.leaves(model.params)
        specs = jax.tree.leaves(axes, is_leaf=lambda x: isinstance(x, PartitionSpec))
        assert len(leaves) == len(specs)
        for leaf, spec in zip(leaves, specs):
            assert len(spec) == leaf.ndim and all(name in KNOWN_AXES for name in spec), (preset, spec)


def test_sharded_forward_on_8_cpu_devices_matches():
    """A rules table maps logical axes to an 8-device mesh (data x model); the sharded forward
    equals the unsharded one. Runs in a subprocess: the device count is fixed at JAX start-up."""
    script = textwrap.dedent("""
        import jax, jax.numpy as jnp, numpy as np, flax.linen as nn
        import mixserve
        assert jax.device_count() == 8
        auto = jax.sharding.AxisType.Auto
        mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(auto, auto))
        rules = (("experts", "model"), ("heads", "model"), ("kv_heads", "model"), ("mlp", "model"),
                 ("vocab", "model"), ("embed", None), ("moe_mlp", None), ("q_lora", None), ("kv_lora", None),
                 ("head_dim", None), ("index_heads", None), ("index_head_dim", None), ("norm", None),
                 ("expert_scores", None))
        model = mixserve.load("tiny-kimi", dtype="float32")
        shardings = nn.logical_to_mesh_sharding(model.param_axes, mesh, rules)
        sharded = jax.device_put(model.params, shardings)
        ids = jnp.asarray(np.random.default_rng(0).integers(0, 256, (4, 8)), jnp.int32)
        ref = np.asarray(model.logits(ids))
        out = np.asarray(model._logits_fn(sharded, ids))
        experts = sharded["layers_1"]["mlp"]["experts"]["gate_proj"]
        assert len(experts.sharding.device_set) == 8 and experts.addressable_shards[0].data.shape[0] == 2
        err = np.abs(out - ref).max() / np.abs(ref).max()
        assert err < 1e-5, err
        print("ok", err)
    """)
    env = host_devices_env(8)
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-3000:]
