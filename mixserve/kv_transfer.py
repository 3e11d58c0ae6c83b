"""Moving KV pages from one engine's pool into another's (disaggregated prefill/decode).

The two pools may differ in format. The seed keeps prefill's KV in BF16 (prefill is
compute-bound) and decode's in FP8 (decode is memory-bound, and FP8 holds twice the tokens).
`export_pages` gathers pages and converts them on the sender into the receiver's storage dtype
and scales, so the transfer carries the receiver's bytes (FP8: half of BF16). `import_pages`
writes them into the pages the receiver allocated for them.

Conversion goes through float32: real = stored * sender's scale (a BF16 pool stores real values:
scales apply to FP8 pools only), then `quantize_for_pool(real, receiver's dtype, receiver's
scale)`, the saturating cast a write into the receiver's pool makes.
So a BF16 page of a BF16 model arrives as exactly the FP8 bytes the receiver would have stored
had it computed those keys itself. When dtypes and scales are equal, pages are copied unchanged.

Pages per layer, as mixserve/kv_cache.py lays them out: the page axis is 1 in a GQA pool
[KVH, P, S, D] and 0 in the others ([P, S, C]). Page id lists are padded to a power of two
(bounded compiles); padding reads page 0 on the sender and is dropped on the receiver.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from mixserve.kv_cache import dequantize_from_pool, pool_scale, quantize_for_pool


def page_axis(name: str) -> int:
    return 1 if name in ("k", "v") else 0


def _per_page(scale):
    """A per-KV-head scale [KVH] broadcast over a GQA pool's [KVH, N, S, D]."""
    return scale.reshape(scale.shape + (1, 1, 1)) if scale.ndim else scale


@functools.partial(jax.jit, static_argnames=("dst_dtype", "convert"))
def export_pages(pools, page_ids_N, src_scales, dst_scales, *, dst_dtype, convert: bool):
    """Pages page_ids_N of every layer, in the receiver's dtype: a list (per layer) of dicts of
    [..., N, S, ...] arrays. src_scales / dst_scales: (k_scale, v_scale) of the two engines."""
    sent = []
    for layer in pools:
        out = {}
        for name, pool in layer.items():
            pages = jnp.take(pool, page_ids_N, axis=page_axis(name), mode="clip")
            if convert:
                real = dequantize_from_pool(pages, _per_page(pool_scale(name, *src_scales)), jnp.float32)
                pages = quantize_for_pool(real, dst_dtype, _per_page(pool_scale(name, *dst_scales)))
            out[name] = pages
        sent.append(out)
    return sent


@functools.partial(jax.jit, donate_argnums=0)
def import_pages(pools, page_ids_N, sent):
    """Write sent pages into pages page_ids_N of every layer (ids past the pool: dropped)."""
    new = []
    for layer, got in zip(pools, sent):
        out = {}
        for name, pool in layer.items():
            index = (slice(None), page_ids_N) if page_axis(name) == 1 else (page_ids_N,)
            out[name] = pool.at[index].set(got[name], mode="drop")
        new.append(out)
    return new


def needs_conversion(src_dtype, src_scales, dst_dtype, dst_scales) -> bool:
    """Whether pages change on the way (host-side: the scales are small concrete arrays)."""
    same = jnp.dtype(src_dtype) == jnp.dtype(dst_dtype) and all(
        np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(src_scales, dst_scales))
    return not same


def padded(ids: list[int], fill: int) -> jax.Array:
    """ids padded with `fill` to a power of two."""
    n = 1 << max(len(ids) - 1, 0).bit_length()
    return jnp.asarray(list(ids) + [fill] * (n - len(ids)), jnp.int32)
