"""Per-row sampling inside the jitted steps: a logit bias, then greedy, or temperature, min-p,
top-k, top-p (vLLM's order), with each row's key derived in the step from (seed, request index,
token index)."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from mixserve.request import MAX_LOGIT_BIAS


class Sampling(NamedTuple):
    """One step's per-row sampling inputs (a pytree: one argument of the jitted step)."""
    temperature_B: jax.Array  # float32; 0 = greedy
    top_p_B: jax.Array  # float32 in (0, 1]
    top_k_B: jax.Array  # int32; 0 = every token
    min_p_B: jax.Array  # float32 in [0, 1]; 0 = every token
    key_ints_B3: jax.Array  # uint32 (seed, request index, token index), folded into a key in the step
    logprobs_B: jax.Array  # bool: the row's request asked for logprobs
    bias_ids_BK: jax.Array  # int32 token ids whose logits get bias_BK added (K = MAX_LOGIT_BIAS; 0-padded)
    bias_BK: jax.Array  # float32; 0 past a row's own entries

    @classmethod
    def greedy(cls, batch: int, xp=jnp) -> "Sampling":
        """Every row greedy, no logprobs, in jnp or (xp=np: host arrays, no wait on the device) numpy."""
        return cls(xp.zeros(batch, xp.float32), xp.ones(batch, xp.float32), xp.zeros(batch, xp.int32),
                   xp.zeros(batch, xp.float32), xp.zeros((batch, 3), xp.uint32), xp.zeros(batch, bool),
                   xp.zeros((batch, MAX_LOGIT_BIAS), xp.int32), xp.zeros((batch, MAX_LOGIT_BIAS), xp.float32))


def add_logit_bias(logits_BV, s: Sampling):
    """The logits with each row's logit bias added (OpenAI's logit_bias: greedy rows too)."""
    rows_B1 = jnp.arange(logits_BV.shape[0])[:, None]
    return logits_BV.at[rows_B1, s.bias_ids_BK].add(s.bias_BK.astype(logits_BV.dtype))


def slow_path(s: Sampling):
    """Whether a step needs more than each row's raw argmax: a row samples, or has a logit bias. The
    common step (all greedy, no bias) skips the bias's scatter and the sampling; a greedy step with
    a bias takes the sampling branch (on CPU, B=64, V=163840, logits made in the step: 264 ms, as a
    step with one sampled row, 268 ms; all greedy 31 ms; interleaved medians of 30)."""
    return jnp.any(s.temperature_B > 0) | jnp.any(s.bias_BK != 0)


def sample(logits_BV, s: Sampling):
    """Greedy where temperature == 0, else temperature, then min-p, top-k, and nucleus (top-p) over
    what is left (vLLM's order), per row, after the logit bias. The key is folded here, in the
    step, so the decode loop makes no per-request host calls."""
    return jax.lax.cond(slow_path(s), _sampled, lambda l_BV, _s: greedy_tokens(l_BV), logits_BV, s)


def greedy_tokens(logits_BV):
    return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)


def _sampled(logits_BV, s: Sampling):
    logits_BV = add_logit_bias(logits_BV, s)
    greedy_B = greedy_tokens(logits_BV)
    choice_B = jax.vmap(jax.random.categorical)(sampling_keys(s), sampling_logits(logits_BV, s))
    return jnp.where(s.temperature_B > 0, choice_B.astype(jnp.int32), greedy_B)


def sampling_keys(s: Sampling):
    """Each row's key, from its (seed, request index, token index)."""
    return jax.vmap(lambda k: jax.random.fold_in(jax.random.fold_in(jax.random.key(k[0]), k[1]), k[2]))(s.key_ints_B3)


def sampling_logits(logits_BV, s: Sampling):
    """The logits a sampled row draws from: temperature applied, the tokens min-p, top-k and top-p
    leave out at -inf (rows with temperature 0 come out as at temperature 1e-6: not for them)."""
    scaled_BV = logits_BV / jnp.maximum(s.temperature_B, 1e-6)[:, None]
    sampled_B = s.temperature_B > 0
    # min-p: tokens less likely than min_p times the likeliest (after temperature) are out; no sort.
    scaled_BV = jnp.where(scaled_BV >= jnp.max(scaled_BV, axis=-1, keepdims=True) + jnp.log(s.min_p_B)[:, None],
                          scaled_BV, -jnp.inf)
    # Only top-k and top-p need the vocabulary sorted: a step that samples at temperature alone
    # skips the sort. Either way the draw is over the tokens in vocabulary order, so a row's
    # token depends on its own key and options, not on what the other rows asked.
    truncated = jnp.any(sampled_B & (((s.top_k_B > 0) & (s.top_k_B < scaled_BV.shape[1])) | (s.top_p_B < 1)))
    kept_BV = jax.lax.cond(truncated, _kept_by_top_k_top_p, lambda x, _: jnp.ones(x.shape, bool), scaled_BV, s)
    return jnp.where(kept_BV, scaled_BV, -jnp.inf)


def _kept_by_top_k_top_p(scaled_BV, s: Sampling):
    """Which tokens survive top-k, then top-p over what top-k kept, in vocabulary order."""
    B, V = scaled_BV.shape
    order_BV = jnp.argsort(-scaled_BV, axis=-1)
    sorted_BV = jnp.take_along_axis(scaled_BV, order_BV, axis=-1)
    rank_V = jnp.arange(V)
    in_top_k_BV = (s.top_k_B[:, None] == 0) | (rank_V < s.top_k_B[:, None])
    probs_BV = jax.nn.softmax(jnp.where(in_top_k_BV, sorted_BV, -jnp.inf), axis=-1)
    # Keeps the top token, whatever top_p (one below float32's range is 0 here); top_p = 1 keeps
    # all (a float32 cumsum can reach 1 before the tail).
    below_p_BV = (((jnp.cumsum(probs_BV, axis=-1) - probs_BV) < s.top_p_B[:, None]) | (rank_V == 0)
                  | (s.top_p_B[:, None] >= 1))
    keep_BV = in_top_k_BV & below_p_BV
    return jnp.zeros((B, V), bool).at[jnp.arange(B)[:, None], order_BV].set(keep_BV)
