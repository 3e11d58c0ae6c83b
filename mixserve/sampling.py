"""Per-row sampling inside the jitted steps: a logit bias, the repetition, frequency and presence
penalties, a structured output's mask (mixserve/grammar.py) and the stop tokens min_tokens holds
back, then greedy, or temperature, min-p, top-k, top-p (vLLM's order), with each row's key
derived in the step from (seed, request index, token index)."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from mixserve.request import MAX_LOGIT_BIAS

NO_TOKEN = np.iinfo(np.int32).max  # pads seen_ids_BU: past any vocabulary, so gathers fill and scatters drop it


class Sampling(NamedTuple):
    """One step's per-row sampling inputs (a pytree: one argument of the jitted step)."""
    temperature_B: jax.Array  # float32; 0 = greedy
    top_p_B: jax.Array  # float32 in (0, 1]
    top_k_B: jax.Array  # int32; 0 = every token
    min_p_B: jax.Array  # float32 in [0, 1]; 0 = every token
    # uint32 (seed's high word, seed's low word, request index, token index), made a key in the step
    key_ints_B4: jax.Array
    logprobs_B: jax.Array  # bool: the row's request asked for logprobs
    bias_ids_BK: jax.Array  # int32 token ids whose logits get bias_BK added (K = MAX_LOGIT_BIAS; 0-padded)
    bias_BK: jax.Array  # float32; 0 past a row's own entries
    repetition_B: jax.Array  # float32 > 0; 1 = off (vLLM's repetition_penalty)
    frequency_B: jax.Array  # float32; 0 = off (OpenAI's frequency_penalty)
    presence_B: jax.Array  # float32; 0 = off (OpenAI's presence_penalty)
    # Each penalized row's distinct prompt and output tokens (NO_TOKEN-padded) and how often each
    # occurs in its output (0: the prompt only). U, a power of two, is 0 when no row is penalized.
    seen_ids_BU: jax.Array  # int32
    output_counts_BU: jax.Array  # int32
    # Structured outputs: the tokens each row may take, bit v % 32 of word v // 32 (-1: all; W =
    # ceil(V / 32), 0 when no row is held to a grammar: then nothing of it is traced). A
    # speculative step's input holds J masks a row, [B, J * W], position j's at words j * W...
    allowed_BW: jax.Array  # int32
    # min_tokens: while a row's token index is below min_tokens_B, the tokens that would stop it
    # (Request.held_stops; NO_TOKEN-padded) are taken out. S, a power of two, is 0 when no row is
    # short of its min_tokens: then nothing of it is traced.
    min_tokens_B: jax.Array  # int32; 0 = off
    held_ids_BS: jax.Array  # int32

    @classmethod
    def greedy(cls, batch: int, xp=jnp, seen: int = 0, words: int = 0, held: int = 0) -> "Sampling":
        """Every row greedy, no logprobs, no penalty, no grammar, no min_tokens, in jnp or (xp=np:
        host arrays, no wait on the device) numpy; `seen`: the width U of the penalties' token
        lists; `words`: the width of the grammar masks; `held`: the width S of the held stop tokens."""
        return cls(xp.zeros(batch, xp.float32), xp.ones(batch, xp.float32), xp.zeros(batch, xp.int32),
                   xp.zeros(batch, xp.float32), xp.zeros((batch, 4), xp.uint32), xp.zeros(batch, bool),
                   xp.zeros((batch, MAX_LOGIT_BIAS), xp.int32), xp.zeros((batch, MAX_LOGIT_BIAS), xp.float32),
                   xp.ones(batch, xp.float32), xp.zeros(batch, xp.float32), xp.zeros(batch, xp.float32),
                   xp.full((batch, seen), NO_TOKEN, xp.int32), xp.zeros((batch, seen), xp.int32),
                   xp.full((batch, words), -1, xp.int32), xp.zeros(batch, xp.int32),
                   xp.full((batch, held), NO_TOKEN, xp.int32))


def seed_words(seed: int) -> tuple[int, int]:
    """A seed's 64 bits (two's complement: an int64 seed, reject_reason's range) as (high word, low
    word), the threefry key data jax.random.key(seed) makes of it."""
    bits = int(seed) % 2**64
    return bits >> 32, bits & 0xFFFFFFFF


def first_token_keys(seed: int, n: int) -> np.ndarray:
    """key_ints_B4 of a generate call's n requests sampled with one seed, at their first tokens."""
    return np.stack([np.broadcast_to(np.uint32(w), n) for w in seed_words(seed)]
                    + [np.arange(n, dtype=np.uint32), np.zeros(n, np.uint32)], 1)


def add_logit_bias(logits_BV, s: Sampling):
    """The logits with each row's logit bias added (OpenAI's logit_bias: greedy rows too)."""
    rows_B1 = jnp.arange(logits_BV.shape[0])[:, None]
    return logits_BV.at[rows_B1, s.bias_ids_BK].add(s.bias_BK.astype(logits_BV.dtype))


def apply_penalties(logits_BV, s: Sampling, drafted_BE=None):
    """The logits after each row's penalties, as vLLM applies them: a token of the prompt or the
    output has its logit divided by the repetition penalty where it is positive and multiplied by
    it elsewhere; then each output token's logit loses frequency x its count, and presence once.
    Only the row's U listed tokens are gathered, changed and scattered back: nothing [B, V] beyond
    the logits. drafted_BE: tokens the row's output also holds, beyond its counts (a speculative
    position's earlier drafts), NO_TOKEN where none. Every entry of one token computes the same
    value from that token's total count, so a token listed twice (a draft also among the seen)
    is written twice with one value."""
    rows_B1 = jnp.arange(logits_BV.shape[0])[:, None]
    ids_BU, counts_BU = s.seen_ids_BU, s.output_counts_BU
    if drafted_BE is not None:
        drafted_BE = drafted_BE.astype(jnp.int32)
        # a draft's count: its count among the seen, if listed there; either list's count: the drafts equal to it
        counts_BE = jnp.sum(jnp.where(drafted_BE[:, :, None] == ids_BU[:, None, :], counts_BU[:, None, :], 0), axis=-1)
        ids_BU = jnp.concatenate([ids_BU, drafted_BE], axis=1)
        counts_BU = jnp.concatenate([counts_BU, counts_BE], axis=1)
        counts_BU += jnp.sum(ids_BU[:, :, None] == drafted_BE[:, None, :], axis=-1)
    # Every listed token is seen; NO_TOKEN entries compute from a filled 0 and are dropped.
    x_BU = logits_BV.at[rows_B1, ids_BU].get(mode="fill", fill_value=0)
    repetition_B1 = s.repetition_B[:, None].astype(x_BU.dtype)
    x_BU = jnp.where(x_BU > 0, x_BU / repetition_B1, x_BU * repetition_B1)
    x_BU = x_BU - (s.frequency_B[:, None] * counts_BU + s.presence_B[:, None] * (counts_BU > 0)).astype(x_BU.dtype)
    return logits_BV.at[rows_B1, ids_BU].set(x_BU, mode="drop")


def allowed_only(logits_BV, allowed_BW):
    """The logits with every token a row's mask leaves out at -inf (no mask: unchanged)."""
    B, V = logits_BV.shape
    if allowed_BW.shape[1] == 0:
        return logits_BV
    bits_BV = ((allowed_BW[:, :, None] >> jnp.arange(32, dtype=allowed_BW.dtype)) & 1).reshape(B, -1)[:, :V]
    return jnp.where(bits_BV == 1, logits_BV, -jnp.inf)


def without_held_stops(logits_BV, s: Sampling):
    """The logits with a row's held stop tokens at -inf while its token index is below its
    min_tokens; but a row left no token (a structured output complete, so that only its end may
    follow) keeps them: the grammar ends it before its min_tokens, rather than nothing valid."""
    if s.held_ids_BS.shape[1] == 0:
        return logits_BV
    short_B1 = (s.key_ints_B4[:, 3] < s.min_tokens_B.astype(jnp.uint32))[:, None]
    held_BS = jnp.where(short_B1, -jnp.inf, 0).astype(logits_BV.dtype)
    held_BV = logits_BV.at[jnp.arange(logits_BV.shape[0])[:, None], s.held_ids_BS].add(held_BS, mode="drop")
    return jnp.where(jnp.any(held_BV > -jnp.inf, axis=-1, keepdims=True), held_BV, logits_BV)


def adjusted_logits(logits_BV, s: Sampling, drafted_BE=None):
    """What a row picks from: its logit bias added, then its penalties applied (vLLM's order), then
    the tokens its structured output refuses, and the stop tokens its min_tokens holds back, taken
    out (last, so that nothing adds them back)."""
    return without_held_stops(allowed_only(apply_penalties(add_logit_bias(logits_BV, s), s, drafted_BE), s.allowed_BW),
                              s)


def slow_path(s: Sampling):
    """Whether a step needs more than each row's raw argmax: a row samples, or has a logit bias, a
    penalty, a structured output or stop tokens held back by min_tokens. The common step (all
    greedy, none of them) skips their scatters and the sampling (on CPU, B=64, V=163840, logits
    made in the step: all greedy 31 ms, one sampled row 268 ms; interleaved medians of 30). An
    all-greedy step with a bias or a mask adjusts the logits and takes their argmax, with no draw:
    61 ms with a bias, 67 ms with a mask, where drawing as well took 239 and 233 ms (medians of 15 interleaved, 2026-12-06)."""
    return (jnp.any(s.temperature_B > 0) | jnp.any(s.bias_BK != 0) | jnp.any(s.repetition_B != 1)
            | jnp.any(s.frequency_B != 0) | jnp.any(s.presence_B != 0) | (s.allowed_BW.shape[1] > 0)
            | (s.held_ids_BS.shape[1] > 0))


def sample(logits_BV, s: Sampling):
    """Greedy where temperature == 0, else temperature, then min-p, top-k, and nucleus (top-p) over
    what is left (vLLM's order), per row, after the logit bias, penalties and grammar mask. The
    key is folded here, in the step, so the decode loop makes no per-request host calls.
    Returns each row's token and the float32 logits it was picked from (what the processed
    logprobs modes report): a sampled row's after temperature, with what min-p, top-k and top-p
    leave out at -inf; a greedy row's adjusted logits (temperature 1, nothing truncated). A caller
    that discards them costs nothing: XLA drops a conditional's unused outputs."""
    logits_BV = logits_BV.astype(jnp.float32)
    return jax.lax.cond(slow_path(s), _sampled, lambda l_BV, _s: (greedy_tokens(l_BV), l_BV), logits_BV, s)


def greedy_tokens(logits_BV):
    return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)


def _sampled(logits_BV, s: Sampling):
    logits_BV = adjusted_logits(logits_BV, s)
    greedy_B = greedy_tokens(logits_BV)
    # all greedy (a bias, a penalty or a grammar brought it here): no draw
    return jax.lax.cond(jnp.any(s.temperature_B > 0), _drawn, lambda l_BV, _s, g_B: (g_B, l_BV), logits_BV, s, greedy_B)


def _drawn(logits_BV, s: Sampling, greedy_B):
    drawn_BV = sampling_logits(logits_BV, s)
    choice_B = jax.vmap(jax.random.categorical)(sampling_keys(s), drawn_BV)
    sampled_B = s.temperature_B > 0
    return (jnp.where(sampled_B, choice_B.astype(jnp.int32), greedy_B),
            jnp.where(sampled_B[:, None], drawn_BV, logits_BV))


def sampling_keys(s: Sampling):
    """Each row's key, from its (seed, request index, token index). The seed's two words are the
    threefry key's data as jax.random.key(seed) sets it (high word first), so a 64-bit seed needs
    no x64 mode and a seed below 2**32 gives the key it always gave."""
    def key(k):
        seeded = jax.random.wrap_key_data(k[:2], impl="threefry2x32")
        return jax.random.fold_in(jax.random.fold_in(seeded, k[2]), k[3])
    return jax.vmap(key)(s.key_ints_B4)


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
