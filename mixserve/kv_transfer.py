"""Moving KV pages from one engine's pool into another's (disaggregated prefill/decode).

The two pools may differ in format. The seed keeps prefill's KV in BF16 (prefill is
compute-bound) and decode's in FP8 (decode is memory-bound, and FP8 holds twice the tokens).
`export_pages` gathers pages and converts them on the sender into the receiver's storage dtype
and scales, so the transfer carries the receiver's bytes (FP8: half of BF16). `import_pages`
writes them into the pages the receiver allocated for them.

Conversion goes through float32, one entry (k, v, latent, index) at a time: `decode` with the
sender's layout and scale (real = stored * scale; a BF16 pool stores real values: scales apply
to FP8 pools only), then `encode` with the receiver's, the same code and saturating cast a write
into the receiver's pool runs. A tiled receiver ("fp8_ds_mla") computes each token's tile scales
on the sender, and an entry tiled on one side only changes arrays on the way (one latent array
into three, or back).
So a BF16 page of a BF16 model arrives as exactly the FP8 bytes the receiver would have stored
had it computed those keys itself. When dtypes and scales are equal, pages are copied unchanged.

Pages per layer, as mixserve/kv_cache.py lays them out: the page axis is 1 in a GQA pool
[KVH, P, S, D] and 0 in the others ([P, S, width]). Page id lists are padded to a power of two
(bounded compiles); padding reads page 0 on the sender and is dropped on the receiver.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from mixserve.kv_cache import KVFormat, decode_entry, encode_entry, entries, pool_scale, stored_names


def page_axis(name: str) -> int:
    return 1 if name in ("k", "v") else 0


def _per_page(scale):
    """A per-KV-head scale [KVH] broadcast over a GQA pool's [KVH, N, S, D]."""
    return scale.reshape(scale.shape + (1, 1, 1)) if scale.ndim else scale


def layout(pools) -> tuple:
    """What `encode` needs of a pool, hashable (static under jit): per layer, per array, its
    name, last-axis width and dtype."""
    return tuple(tuple((name, x.shape[-1], jnp.dtype(x.dtype).name) for name, x in layer.items()) for layer in pools)


@functools.partial(jax.jit, static_argnames=("dst_layout", "convert"))
def export_pages(pools, page_ids_N, src_scales, dst_scales, *, dst_layout: tuple, convert: bool):
    """Pages page_ids_N of every layer, as the receiver stores them (dst_layout: `layout` of its
    pools): a list (per layer) of dicts of [..., N, S, ...] arrays. src_scales / dst_scales:
    (k_scale, v_scale) of the two engines, one per layer (kv_cache.layer_scales)."""
    sent = []
    for i, (layer, dst) in enumerate(zip(pools, dst_layout)):
        pages = {name: jnp.take(pool, page_ids_N, axis=page_axis(name), mode="clip") for name, pool in layer.items()}
        if convert:
            like = {name: jax.ShapeDtypeStruct((width,), jnp.dtype(dtype)) for name, width, dtype in dst}
            converted = {}
            for entry in entries(layer):
                real = decode_entry({n: pages[n] for n in stored_names(layer, entry)}, entry,
                              _per_page(pool_scale(entry, *(x[i] for x in src_scales))), jnp.float32)
                converted |= encode_entry(like, entry, real, _per_page(pool_scale(entry, *(x[i] for x in dst_scales))))
            pages = converted
        sent.append(pages)
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


def needs_conversion(src: KVFormat, src_scales, dst: KVFormat, dst_scales) -> bool:
    """Whether pages change on the way (host-side: the scales are small concrete arrays). Tiled
    pools carry their scales in their pages, so they copy whatever the engines' scales."""
    same_scales = all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(src_scales, dst_scales))
    return not (src == dst and (src.tiled or same_scales))


def padded(ids: list[int], fill: int) -> jax.Array:
    """ids padded with `fill` to a power of two."""
    n = 1 << max(len(ids) - 1, 0).bit_length()
    return jnp.asarray(list(ids) + [fill] * (n - len(ids)), jnp.int32)
