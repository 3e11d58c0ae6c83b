"""Tiny random transformers models, saved with save_pretrained: the reference for parity tests.

Test-only: torch and transformers are test dependencies, never runtime ones.
"""

from __future__ import annotations

import numpy as np
import torch
import transformers

BASE = dict(vocab_size=160, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
            max_position_embeddings=256, tie_word_embeddings=False)
MOE = dict(n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, moe_intermediate_size=32,
           first_k_dense_replace=1, norm_topk_prob=True, routed_scaling_factor=2.5)
MLA = dict(q_lora_rank=32, kv_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12)

# name -> (transformers config class, kwargs). Each config switches on a different feature mix.
CONFIGS = {
    "kimi-yarn-groups": ("DeepseekV3Config", {**BASE, **MOE, **MLA, "num_key_value_heads": 4, "n_group": 4, "topk_group": 2,
        "routed_scaling_factor": 2.827, "rope_interleave": True,
        "rope_parameters": {"rope_type": "yarn", "rope_theta": 50000.0, "factor": 8.0, "original_max_position_embeddings": 32,
                            "beta_fast": 1.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}}),
    "kimi-noqlora-plainrope": ("DeepseekV3Config", {**BASE, **MOE, **MLA, "q_lora_rank": None, "num_key_value_heads": 4,
        "n_group": 1, "topk_group": 1, "rope_interleave": False, "first_k_dense_replace": 2, "norm_topk_prob": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}),
    "glm4-qknorm-bias": ("Glm4MoeConfig", {**BASE, **MOE, "num_key_value_heads": 2, "head_dim": 16, "use_qk_norm": True,
        "attention_bias": True, "n_group": 2, "topk_group": 1,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}}),
    "glm4-plain": ("Glm4MoeConfig", {**BASE, **MOE, "num_key_value_heads": 1, "head_dim": 16, "use_qk_norm": False,
        "attention_bias": False, "first_k_dense_replace": 0,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "partial_rotary_factor": 0.5}}),
    "glm5-dsa-shared": ("GlmMoeDsaConfig", {**BASE, **MOE, **MLA, "num_key_value_heads": 4, "n_group": 2, "topk_group": 1,
        "index_topk": 4, "index_head_dim": 16, "index_n_heads": 4, "indexer_types": ["full", "shared", "full"],
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}),
}


def build(name: str, seed: int = 0, **overrides):
    cls_name, kwargs = CONFIGS[name]
    config = getattr(transformers, cls_name)(**{**kwargs, **overrides})
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = getattr(transformers, cls_name.replace("Config", "ForCausalLM"))(config).eval()
    with torch.no_grad():  # random (not default-zero) router biases and norm scales, so they are tested
        for pname, p in model.named_parameters():
            if "norm" in pname or "layernorm" in pname:
                p.copy_(1 + 0.1 * torch.randn_like(p))
        for mod in model.modules():
            if hasattr(mod, "e_score_correction_bias"):
                mod.e_score_correction_bias.copy_(0.05 * torch.randn_like(mod.e_score_correction_bias))
    return model


def save(model, directory) -> None:
    model.save_pretrained(directory)


def reference_logits(model, ids: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.as_tensor(ids, dtype=torch.long)).logits.float().numpy()


def dsa_index_scores(model, ids: np.ndarray) -> list[np.ndarray]:
    """The index scores [B, T, T] of every layer that runs a DSA indexer (causally masked with -inf),
    recomputed from the reference indexer's own submodules and inputs (transformers returns only
    the chosen indices)."""
    from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import apply_rotary_pos_emb_interleave

    captured = []
    hooks = [
        layer.self_attn.indexer.register_forward_hook(lambda mod, args, out: captured.append((mod, args)))
        for layer in model.model.layers if layer.self_attn.indexer is not None
    ]
    reference_logits(model, ids)
    for h in hooks:
        h.remove()
    scores = []
    with torch.no_grad():
        for mod, (x, q_resid, (cos, sin), _mask, _pos) in captured:
            B, T, _ = x.shape
            q = mod.wq_b(q_resid).view(B, T, mod.n_heads, mod.head_dim)
            k = mod.k_norm(mod.wk(x)).unsqueeze(2)
            r = mod.qk_rope_head_dim
            q_rot, k_rot = apply_rotary_pos_emb_interleave(q[..., :r], k[..., :r], cos, sin, unsqueeze_dim=2)
            q = torch.cat([q_rot, q[..., r:]], -1)
            k = torch.cat([k_rot, k[..., r:]], -1)[:, :, 0]
            per_head = torch.relu(torch.einsum("bthd,bsd->bhts", q.float(), k.float()) * mod.softmax_scale)
            w = mod.weights_proj(x).float() * mod.n_heads**-0.5
            s = torch.einsum("bth,bhts->bts", w, per_head)
            s = s.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
            scores.append(s.numpy())
    return scores


def has_topk_boundary_tie(scores: np.ndarray, k: int, rel: float = 1e-5) -> bool:
    """True if, for some query with more than k past tokens, the k-th and (k+1)-th scores (nearly) tie."""
    ordered = -np.sort(-scores, axis=-1)
    T = scores.shape[-1]
    for t in range(k, T):  # query t sees t + 1 tokens
        kth, nxt = ordered[:, t, k - 1], ordered[:, t, k]
        if np.any(np.abs(kth - nxt) <= rel * np.maximum(np.abs(kth), 1e-6)):
            return True
    return False


class MTPReference:
    """A checkpoint's MTP layer for `model` (built by `build(name)`): its decoder block is layer L
    of the same model built with L + 1 layers (so transformers serialises it under the names
    checkpoints use), composed as SGLang's deepseek_nextn.py does (models/transformer.py):
    lm_head(shared_head.norm(block(eh_proj([enorm(embed(t_{p+1})); hnorm(h_p)])))), h_p the
    model's output after its final norm."""

    def __init__(self, name: str, model, seed: int = 1, **overrides):
        cfg = model.config
        self.L = L = cfg.num_hidden_layers
        extra = {"indexer_types": [*cfg.indexer_types, "full"]} if hasattr(cfg, "indexer_types") else {}
        self.big = build(name, seed, num_hidden_layers=L + 1, **extra, **overrides)
        self.model = model
        H = cfg.hidden_size
        torch.manual_seed(seed + 1)
        norm_cls = type(model.model.norm)
        self.enorm, self.hnorm, self.shared_norm = (norm_cls(H, eps=cfg.rms_norm_eps) for _ in range(3))
        self.eh_proj = torch.nn.Linear(2 * H, H, bias=False)
        with torch.no_grad():
            for norm in (self.enorm, self.hnorm, self.shared_norm):
                norm.weight.copy_(1 + 0.1 * torch.randn_like(norm.weight))
            self.eh_proj.weight.copy_(0.05 * torch.randn_like(self.eh_proj.weight))

    def tensors(self, directory_of_big: str) -> dict[str, torch.Tensor]:
        """The MTP layer's tensors as a checkpoint ships them, with copies of embed_tokens and
        lm_head (DeepSeek-V3's checkpoint has them; the loader must not need them)."""
        from safetensors.torch import load_file
        import glob

        head = f"model.layers.{self.L}."
        big = {}
        for path in glob.glob(f"{directory_of_big}/*.safetensors"):
            big |= {k: v for k, v in load_file(path).items() if k.startswith(head)}
        own = {"enorm.weight": self.enorm.weight, "hnorm.weight": self.hnorm.weight, "eh_proj.weight": self.eh_proj.weight,
               "shared_head.norm.weight": self.shared_norm.weight,
               "shared_head.head.weight": self.model.lm_head.weight, "embed_tokens.weight": self.model.model.embed_tokens.weight}
        return big | {head + k: v.detach().clone().contiguous() for k, v in own.items()}

    def logits(self, ids: np.ndarray) -> np.ndarray:
        """ids [1, T + 1] -> the MTP's logits [1, T, V] at positions 0 .. T - 1 (token p + 1 with h_p)."""
        ids = torch.as_tensor(ids, dtype=torch.long)
        captured = {}
        hook = self.model.model.layers[0].register_forward_pre_hook(
            lambda _m, _a, kwargs: captured.update(kwargs), with_kwargs=True)
        try:
            with torch.no_grad():
                h = self.model.model(ids[:, :-1]).last_hidden_state
                e = self.model.model.embed_tokens(ids[:, 1:])
                x = self.eh_proj(torch.cat([self.enorm(e), self.hnorm(h)], dim=-1))
                keep = ("attention_mask", "position_embeddings", "position_ids")
                out = self.big.model.layers[self.L](x, **{k: captured[k] for k in keep if k in captured})
                x = out[0] if isinstance(out, tuple) else out
                return self.model.lm_head(self.shared_norm(x)).float().numpy()
        finally:
            hook.remove()


def save_with_mtp(name: str, directory: str, seed: int = 0, **overrides):
    """A tiny checkpoint with an MTP layer (num_nextn_predict_layers=1) -> (model, MTPReference)."""
    import tempfile

    from safetensors.torch import save_file

    model = build(name, seed, num_nextn_predict_layers=1, **overrides)
    mtp = MTPReference(name, model, seed + 1, **overrides)
    save(model, directory)
    with tempfile.TemporaryDirectory() as big_dir:
        save(mtp.big, big_dir)
        save_file(mtp.tensors(big_dir), f"{directory}/mtp.safetensors")
    return model, mtp
