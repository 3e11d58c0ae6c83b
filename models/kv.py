"""The attention interface the models call, and its cache-free implementation.

An attention module projects q/k/v and calls one of:
  kv.attend_gqa(q_BTHD, k_BTKD, v_BTKD, scale)                           -> out_BTHD
  kv.attend_mla(q_nope_BTHN, q_pe_BTHR, c_kv_BTL, k_pe_BTR, kv_b, scale, index_mask) -> out_BTHV
  kv.index_select(q_BTHD, k_BTD, w_BTH, scale, top_k)    -> (index_mask, chosen_BTK) (DSA)
`NoCache` attends causally over the T tokens it is given (the plain forward). The paged pools in
mixserve.kv_cache implement the same three calls over their pages. `chosen_BTK` names the keys
the indexer chose by their positions in the request (chosen_positions), whatever form index_mask
takes; NoCache also replays such a choice (index_replay: DSA indexer replay for RL).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

MASKED = float(jnp.finfo(jnp.float32).min)  # finite, so a fully masked row cannot produce NaN


def masked_attention(q_BTHD, k_BSKD, v_BSKV, mask_BTS, scale: float):
    """Softmax attention with K kv-heads shared by H/K query heads; float32 logits and softmax."""
    B, T, H, D = q_BTHD.shape
    K = k_BSKD.shape[2]
    q = q_BTHD.reshape(B, T, K, H // K, D)
    logits = jnp.einsum("btkgd,bskd->bkgts", q, k_BSKD, preferred_element_type=jnp.float32) * scale
    logits = jnp.where(mask_BTS[:, None, None], logits, MASKED)
    probs = jax.nn.softmax(logits, axis=-1).astype(v_BSKV.dtype)
    out = jnp.einsum("bkgts,bskv->btkgv", probs, v_BSKV, preferred_element_type=jnp.float32)
    return out.reshape(B, T, H, -1).astype(q_BTHD.dtype)


def expand_mla(q_nope_BTHN, q_pe_BTHR, c_kv_BSL, k_pe_BSR, kv_b):
    """Per-head keys/values from the latent (the 'naive' form, good for prefill).

    Returns q_BTHE, k_BSHE, v_BSHV with E = N + R: nope part per head, rope part shared by all heads.
    """
    H, N = q_nope_BTHN.shape[2:]
    B, S, _ = c_kv_BSL.shape
    kv = kv_b(c_kv_BSL).reshape(B, S, H, -1)
    k_nope, v = kv[..., :N], kv[..., N:]
    k_pe = jnp.broadcast_to(k_pe_BSR[:, :, None, :], (B, S, H, k_pe_BSR.shape[-1])).astype(k_nope.dtype)
    q = jnp.concatenate([q_nope_BTHN, q_pe_BTHR], axis=-1)
    return q, jnp.concatenate([k_nope, k_pe], axis=-1), v


def index_scores(q_BTHD, k_BSD, w_BTH, scale: float):
    """DSA index score [B, T, S] = sum_h w_h * relu(q_h . k * scale), in float32."""
    scores = jax.nn.relu(jnp.einsum("bthd,bsd->bhts", q_BTHD, k_BSD, preferred_element_type=jnp.float32) * scale)
    return jnp.einsum("bth,bhts->bts", w_BTH.astype(jnp.float32), scores)


def top_k_positions(scores_BTS, valid_BTS, top_k: int):
    """Positions [B, T, top_k] of the highest valid scores, best first: the valid ones come before
    any invalid one (those score -inf), so a query with n < top_k valid positions has them first."""
    return jax.lax.top_k(jnp.where(valid_BTS, scores_BTS, -jnp.inf), top_k)[1]


def chosen_positions(scores_BTS, valid_BTS, top_k: int, key_positions_BS=None):
    """int32 [B, T, top_k]: the positions of the keys top_k_mask chooses, ascending, then -1 (a
    query with fewer valid keys than top_k). key_positions_BS: key s's position in its request
    (None: s). The rows Engine(return_indexer_topk=True) returns (SGLang's sequence-relative
    indexer top-k): a set, so its order is the positions', not the scores' (which rounding reorders)."""
    B, T, S = scores_BTS.shape
    k = min(top_k, S)
    picked = top_k_positions(scores_BTS, valid_BTS, k)  # the same top_k as top_k_mask's: XLA computes it once
    taken = jnp.take_along_axis(valid_BTS, picked, axis=-1)
    if key_positions_BS is not None:
        picked = jnp.take_along_axis(jnp.broadcast_to(key_positions_BS[:, None], (B, T, S)), picked, axis=-1)
    none = jnp.iinfo(jnp.int32).max  # sorts after every position
    ordered = jnp.sort(jnp.where(taken, picked.astype(jnp.int32), none), axis=-1)
    ordered = jnp.where(ordered == none, -1, ordered)
    return jnp.pad(ordered, ((0, 0), (0, 0), (0, top_k - k)), constant_values=-1)


def top_k_mask(scores_BTS, valid_BTS, top_k: int):
    """Boolean mask of the top_k highest valid scores per query (all valid ones if fewer)."""
    S = scores_BTS.shape[-1]
    k = min(top_k, S)
    if k == S:
        return valid_BTS
    chosen = top_k_positions(scores_BTS, valid_BTS, k)
    B, T = scores_BTS.shape[:2]
    picked = jnp.zeros((B, T, S), bool).at[jnp.arange(B)[:, None, None], jnp.arange(T)[None, :, None], chosen].set(True)
    return picked & valid_BTS


@dataclasses.dataclass(frozen=True)
class NoCache:
    """Causal attention over exactly the tokens of this call (no history)."""

    def layer(self, i: int) -> "NoCache":
        return self

    @staticmethod
    def causal_mask(B: int, T: int):
        return jnp.broadcast_to(jnp.tril(jnp.ones((T, T), bool)), (B, T, T))

    def attend_gqa(self, q_BTHD, k_BTKD, v_BTKD, *, scale):
        B, T = q_BTHD.shape[:2]
        return masked_attention(q_BTHD, k_BTKD, v_BTKD, self.causal_mask(B, T), scale)

    def attend_mla(self, q_nope, q_pe, c_kv, k_pe, kv_b, *, scale, index_mask=None):
        B, T = q_nope.shape[:2]
        q, k, v = expand_mla(q_nope, q_pe, c_kv, k_pe, kv_b)
        mask = self.causal_mask(B, T) if index_mask is None else index_mask
        return masked_attention(q, k, v, mask, scale)

    def index_select(self, q_BTHD, k_BTD, w_BTH, *, scale, top_k):
        B, T = q_BTHD.shape[:2]
        scores, causal = index_scores(q_BTHD, k_BTD, w_BTH, scale), self.causal_mask(B, T)
        return top_k_mask(scores, causal, top_k), chosen_positions(scores, causal, top_k)

    def index_replay(self, chosen_BTK):
        """The mask of a given choice (chosen_positions' rows, -1 for none): query t attends to
        the keys at those positions (model.Model.replayed_indexer_topk checks they are causal)."""
        B, T, _ = chosen_BTK.shape
        columns = jnp.where(chosen_BTK < 0, T, chosen_BTK)  # -1 goes to a column past the keys, dropped
        rows = (jnp.arange(B)[:, None, None], jnp.arange(T)[None, :, None], columns)
        return jnp.zeros((B, T, T + 1), bool).at[rows].set(True)[..., :T]
