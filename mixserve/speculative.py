"""Speculative decoding: the pure parts the decode step is built from. The drafts come from the
checkpoint's MTP layer (SGLang's and vLLM's "MTP"/EAGLE path for DeepSeek-V3 and GLM), or, for
a model without one (Kimi), from the request's own text (`ngram_drafts`, vLLM's "ngram" prompt
lookup).

One decode step of a request with n tokens t_0..t_{n-1} and k draft tokens d_1..d_k (guesses at
t_n.., made by the MTP layer in the previous step):
  1. verify: the model runs t_{n-1}, d_1, .., d_k at positions n-1 .. n-1+k, one row each (the
     rows share the request's pages: each writes its token's KV, then attends to the pages up to
     its own position, its earlier siblings' writes included), so its logits at every position
     are the ones plain decode would compute there. The attention takes the k + 1 rows as one
     request of k + 1 query tokens, reading its pages once (kv_cache.PagedKV.verify_tokens);
  2. `accept`: d_{j+1} is kept while the model agrees (greedy: it is the argmax; sampled: with
     probability p_j(d_{j+1}), the rejection sampling of Leviathan et al. / Chen et al. for a
     deterministic draft, vLLM's rejection sampler without draft probabilities); the first
     disagreement is replaced by a draw from p_j without d_{j+1} (greedy: the argmax), and if all
     k are kept a bonus token is drawn from p_k. So each step emits 1 .. k+1 tokens, distributed
     as the model's own sampling;
  3. draft: the MTP layer runs over the accepted positions (writing its own KV cache, one more
     layer in the pools), then k-1 more single steps on its own guesses, for the next step; or
     the engine looks the request's last tokens up in its earlier text.
The KV written at rejected positions is garbage past the request's length: the next step
overwrites it before anything reads it (attention reads positions below each row's own).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from mixserve.sampling import NO_TOKEN, Sampling, adjusted_logits, greedy_tokens, sampling_keys, sampling_logits, slow_path


def per_position(s: Sampling, J: int) -> Sampling:
    """A request's sampling row repeated for its J verified positions, row r * J + j drawing with
    the key of token index (its token count) + j: the key plain decode would use for that token,
    and taking the grammar mask of position j (the row's J masks, side by side in s)."""
    rep = lambda a: jnp.repeat(a, J, axis=0)
    B = s.key_ints_B4.shape[0]
    keys = rep(s.key_ints_B4).at[:, 3].add(jnp.tile(jnp.arange(J, dtype=jnp.uint32), B))
    own = ("key_ints_B4", "allowed_BW")
    return s._replace(**{name: rep(a) for name, a in s._asdict().items() if name not in own}, key_ints_B4=keys,
                      allowed_BW=s.allowed_BW.reshape(B * J, s.allowed_BW.shape[1] // J))


def accept(logits_RJV, drafts_RK, n_drafts_R, s_X: Sampling):
    """logits_RJV: the model's (raw) logits at each verified position j of each request; drafts_RK
    (K = J - 1): the guess for the token after position j; n_drafts_R: how many of them are real;
    s_X: per_position(sampling, J). Returns (accepted_R: leading drafts kept, tokens_RJ: the
    tokens emitted, tokens_RJ[r, :accepted_R[r] + 1]; past those, filler; and picked_XV, the
    float32 logits position j's token comes from, as sampling.sample returns them: a token kept
    or drawn from the residual is, either way, a draw from that distribution). Each row's logit bias
    and penalties are applied first, position j's penalties counting drafts 1..j as output (what
    the output holds there if they are kept), as plain decoding would count them, and position
    j's grammar mask is the one after drafts 1..j: a draft the grammar refuses is never kept."""
    R, J, V = logits_RJV.shape
    logits_XV = logits_RJV.reshape(R * J, V).astype(jnp.float32)
    draft_X = jnp.concatenate([drafts_RK, jnp.zeros((R, 1), drafts_RK.dtype)], axis=1).reshape(-1)
    has_draft_X = (jnp.arange(J)[None, :] < n_drafts_R[:, None]).reshape(-1)
    sampled_X = s_X.temperature_B > 0
    K = J - 1
    before_RJK = (jnp.arange(K)[None, None, :] < jnp.arange(J)[None, :, None]) & \
        (jnp.arange(K)[None, None, :] < n_drafts_R[:, None, None])
    drafted_XK = jnp.where(before_RJK, drafts_RK[:, None, :], NO_TOKEN).reshape(R * J, K)

    def adjusted(_):  # a logit bias, penalties or a grammar; all greedy: no draw
        biased_XV = adjusted_logits(logits_XV, s_X, drafted_XK)
        greedy_X = greedy_tokens(biased_XV)
        return jax.lax.cond(jnp.any(sampled_X), sampled, lambda b_XV, g_X: (g_X == draft_X, g_X, b_XV), biased_XV,
                            greedy_X)

    def sampled(biased_XV, greedy_X):
        draw_XV = sampling_logits(biased_XV, s_X)
        p_draft_X = jnp.take_along_axis(jax.nn.softmax(draw_XV, axis=-1), draft_X[:, None], axis=-1)[:, 0]
        keys = sampling_keys(s_X)
        u_X = jax.vmap(lambda k: jax.random.uniform(jax.random.fold_in(k, 1)))(keys)
        # A rejected draft leaves p without it (renormalised): the residual max(p - q, 0) of a one-hot q.
        residual_XV = jnp.where(has_draft_X[:, None] & (jnp.arange(V)[None, :] == draft_X[:, None]), -jnp.inf, draw_XV)
        # p(draft) rounded below 1 with no other token left: a rejection (u >= p(draft)) must not draw from nothing.
        residual_XV = jnp.where(jnp.any(residual_XV > -jnp.inf, axis=-1, keepdims=True), residual_XV, draw_XV)
        drawn_X = jax.vmap(jax.random.categorical)(keys, residual_XV).astype(jnp.int32)
        return (jnp.where(sampled_X, u_X < p_draft_X, greedy_X == draft_X), jnp.where(sampled_X, drawn_X, greedy_X),
                jnp.where(sampled_X[:, None], draw_XV, biased_XV))

    def greedy(_):
        greedy_X = greedy_tokens(logits_XV)
        return greedy_X == draft_X, greedy_X, logits_XV

    kept_X, replacement_X, picked_XV = jax.lax.cond(slow_path(s_X), adjusted, greedy, None)
    kept_RJ = (kept_X & has_draft_X).reshape(R, J)
    accepted_R = jnp.sum(jnp.cumprod(kept_RJ, axis=1), axis=1).astype(jnp.int32)
    position_J = jnp.arange(J)[None, :]
    tokens_RJ = jnp.where(position_J < accepted_R[:, None], draft_X.reshape(R, J), replacement_X.reshape(R, J))
    return accepted_R, tokens_RJ, picked_XV


def ngram_drafts(tokens: list[int], k: int, max_n: int = 4, min_n: int = 1) -> list[int]:
    """Up to k guesses at what follows `tokens`: the tokens after the latest earlier occurrence of
    its last n tokens, for the longest n in [min_n, max_n] that occurs (vLLM's prompt_lookup_max
    and _min). [] when none does. Copying from the prompt or from itself (code, quotes, tables,
    repeated phrases) is where such guesses are right. One pass over the tokens finds where the
    last token occurred before; only those places are compared further back."""
    t = np.asarray(tokens, np.int64)
    L = len(t)
    ends = np.flatnonzero(t[:-1] == t[-1])  # earlier occurrences of the last token: candidate n-gram ends
    matched = np.ones(len(ends), np.int64)  # how many tokens each candidate matches, counted back from its end
    for back in range(1, min(max_n, L - 1)):
        ok = (matched == back) & (ends >= back)
        ok[ok] = t[ends[ok] - back] == t[L - 1 - back]
        matched[ok] += 1
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        hits = ends[matched >= n]
        if hits.size:
            start = int(hits[-1]) + 1
            return t[start:start + k].tolist()
    return []
