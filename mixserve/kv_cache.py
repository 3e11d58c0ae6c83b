"""Paged KV pools (BF16 or FP8) and the attention the models run over them.

Layouts, per layer (P pages of S tokens):
  GQA (GLM-4.x)  k_KPSD, v_KPSD      [KVH, P, S, head_dim]
  MLA (Kimi, GLM-5) latent_PSC       [P, S, kv_lora_rank + qk_rope_head_dim]  (c_kv then roped k_pe)
  DSA indexer keys (GLM-5) index_PSD [P, S, index_head_dim], same storage, scale 1 (LayerNorm output)
FP8 pools quantize on write: stored = saturate(value / scale), real = stored * scale, with a
per-tensor scale (1.0 by default, or calibrated) or per-KV-head scales (GQA). e4m3fn has no
infinity, so the saturating clamp is what keeps an outlier from becoming NaN.

"fp8_ds_mla" (MLA only; vLLM's name for FlashMLA's FP8 layout, pallas_kernels/tiled_fp8.py)
stores each latent as latent_PSL [P, S, L] e4m3 with latent_scale_PSJ [P, S, L/128] float32
(a power of two per token and 128-column tile) and rope_PSR [P, S, R] bfloat16: 656 bytes per
token and layer at L = 512, R = 64. Its DSA index keys are e4m3 with index_scale_PS1 [P, S, 1],
one scale per token (as DeepSeek-V3.2's indexer cache). The scales are computed at write time
from each token's own values, so there is nothing to calibrate. A pool dict describes itself:
an entry `name` is tiled when `name + "_scale"` is among its arrays (`encode_entry`, `decode_entry`).

`PagedKV` implements the model-facing interface of models/kv.py for one engine step: each layer
writes this step's fresh keys/values into its pages, then attends. Decode (one token per row)
reads everything from the pages, through the pluggable attention backend (XLA reference or the
Pallas kernels). Prefill chunks attend in the model dtype over the fresh keys and read only
earlier chunks from the pages. GLM-5's DSA decode hands the chosen token positions to the sparse
MLA kernel (a `TokenSelection`) instead of a mask over the whole context.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

import pallas_kernels
from models import partitioning
from models.config import ModelConfig
from models.kv import (NoCache, chosen_positions, expand_mla, index_scores, masked_attention, top_k_mask,
                       top_k_positions)
from models.weights import saturating_cast
from pallas_kernels.flash_decoding import merge_over_axis
from pallas_kernels.paged_attention_mla import TiledLatentPages
from pallas_kernels.tiled_fp8 import dequantize_tiles, quantize_tiles, tile_width

STORAGE = {"bfloat16": jnp.bfloat16, "float32": jnp.float32, "fp8_e4m3": jnp.float8_e4m3fn, "fp8_e5m2": jnp.float8_e5m2}
TILED = "fp8_ds_mla"
KV_CACHE_DTYPES = ("auto", *STORAGE, TILED)  # the names kv_format takes
SPLIT_ENTRY = "latent"  # the entry decode context parallelism splits by slots (DSA index keys stay whole)


@dataclasses.dataclass(frozen=True)
class KVFormat:
    """How an engine's pools store keys and values.

    dtype: the storage dtype (FP8 with the engine's per-tensor or per-head scales).
    tiled: FlashMLA's layout (kv_cache_dtype "fp8_ds_mla"; MLA only): e4m3 with a scale per
      token and tile, and the RoPE part in bf16 (module docstring).
    """

    dtype: jnp.dtype
    tiled: bool = False


def kv_format(kv_dtype: str, model_dtype) -> KVFormat:
    """The format a --kv-cache-dtype names ("auto": the model's dtype)."""
    if kv_dtype == "auto":
        return KVFormat(jnp.dtype(model_dtype))
    if kv_dtype == TILED:
        return KVFormat(jnp.dtype(jnp.float8_e4m3fn), tiled=True)
    if kv_dtype not in STORAGE:
        raise ValueError(f"unknown KV cache dtype {kv_dtype!r} (kv_dtype, --kv-cache-dtype); expected one of "
                         f"{', '.join(KV_CACHE_DTYPES)}")
    return KVFormat(jnp.dtype(STORAGE[kv_dtype]))


def is_fp8(dtype) -> bool:
    return jnp.dtype(dtype) in (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))


def _check_format(cfg: ModelConfig, fmt: KVFormat) -> None:
    if fmt.tiled and cfg.attention_kind != "mla":
        raise ValueError(f"KV cache dtype {TILED} is FlashMLA's layout for MLA latents; this model uses "
                         f"{cfg.attention_kind.upper()} attention: use fp8_e4m3")


def _mla_layer_pool(cfg: ModelConfig, layer: int, num_pages: int, page_size: int, fmt: KVFormat) -> dict:
    """The arrays of one MLA layer: [P, S, width] each, by name."""
    L, R = cfg.kv_lora_rank, cfg.qk_rope_head_dim
    dsa = cfg.runs_indexer(layer)
    if fmt.tiled:
        widths = {"latent": (L, fmt.dtype), "latent_scale": (L // tile_width(L), jnp.float32), "rope": (R, jnp.bfloat16)}
        if dsa:
            widths |= {"index": (cfg.index_head_dim, fmt.dtype), "index_scale": (1, jnp.float32)}
    else:
        widths = {"latent": (L + R, fmt.dtype)} | ({"index": (cfg.index_head_dim, fmt.dtype)} if dsa else {})
    return {name: jax.ShapeDtypeStruct((num_pages, page_size, width), dtype) for name, (width, dtype) in widths.items()}


def cache_layers(cfg: ModelConfig, mtp: bool = False) -> int:
    """Layers with a KV cache: the decoder layers, and the MTP layer when it drafts (the last pool)."""
    return cfg.num_layers + int(mtp)


def layer_scales(scale, name: str, cfg: ModelConfig, mtp: bool = False) -> jax.Array:
    """An engine's k_scale or v_scale as one per cache layer: [layers] (per tensor) or [layers, KVH]
    (GQA, per KV head). Given as a scalar or [KVH] (every layer alike), or per layer as [L, 1] or
    [L, KVH], L = cache_layers (or num_layers: the MTP draft's layer, calibrated by no one, then
    takes the layers' largest scale, the widest range)."""
    s = jnp.asarray(scale, jnp.float32)
    layers, kvh = cache_layers(cfg, mtp), cfg.num_kv_heads if cfg.attention_kind == "gqa" else 1
    if s.ndim == 2 and s.shape[0] == cfg.num_layers < layers:
        s = jnp.concatenate([s, jnp.max(s, axis=0, keepdims=True)])
    if s.ndim == 2 and s.shape[0] == cache_layers(cfg, True) > layers:  # the MTP layer's, unused without its pool
        s = s[:layers]
    if s.ndim < 2:
        s = jnp.broadcast_to(s.reshape(1, -1), (layers, s.size))
    if cfg.attention_kind == "mla" and s.shape[1:] != (1,):
        raise ValueError(f"MLA keeps one latent per token: {name} must be per tensor (a scalar, or [layers, 1]), "
                         f"got {jnp.shape(scale)}")
    if s.ndim != 2 or s.shape[0] != layers or s.shape[1] not in (1, kvh):
        raise ValueError(f"{name} must be a scalar, one value per KV head ({kvh}), or per cache layer "
                         f"[{layers} (or {cfg.num_layers}), 1 or {kvh}], got {jnp.shape(scale)}")
    if not bool(jnp.all(jnp.isfinite(s) & (s > 0))):
        raise ValueError(f"{name} must be finite and positive")
    return s[:, 0] if s.shape[1] == 1 else s


def bytes_per_token(cfg: ModelConfig, fmt: KVFormat, entry: str | None = None, mtp: bool = False) -> int:
    """KV bytes per token over all layers (the MTP draft's too, if mtp), DSA indexer keys (and tile
    scales) included; of one MLA entry only ("latent", "index") if given."""
    _check_format(cfg, fmt)
    if entry is not None and cfg.attention_kind != "mla":
        raise ValueError(f"entry {entry!r}: only MLA pools hold more than one entry per token")
    if cfg.attention_kind == "gqa":
        return cache_layers(cfg, mtp) * 2 * cfg.num_kv_heads * cfg.head_dim * jnp.dtype(fmt.dtype).itemsize
    total = 0
    for layer in range(cache_layers(cfg, mtp)):
        pool = _mla_layer_pool(cfg, layer, 1, 1, fmt)
        names = pool if entry is None else stored_names(pool, entry) if entry in pool else ()
        total += sum(pool[name].shape[2] * pool[name].dtype.itemsize for name in names)
    return total


def init_pools(cfg: ModelConfig, num_pages: int, page_size: int, fmt: KVFormat, mtp: bool = False) -> list[dict]:
    """Zeroed pools, one dict per layer (the MTP draft's last, if mtp)."""
    _check_format(cfg, fmt)
    if cfg.attention_kind == "gqa":
        shape = (cfg.num_kv_heads, num_pages, page_size, cfg.head_dim)
        return [{"k": jnp.zeros(shape, fmt.dtype), "v": jnp.zeros(shape, fmt.dtype)} for _ in range(cache_layers(cfg, mtp))]
    return [{name: jnp.zeros(x.shape, x.dtype) for name, x in _mla_layer_pool(cfg, layer, num_pages, page_size, fmt).items()}
            for layer in range(cache_layers(cfg, mtp))]


def pool_scale(name: str, k_scale, v_scale):
    """The scale a pool entry is stored with: keys and values their own (scalar or one per KV
    head), the MLA latent one scalar (k_scale's mean: keys and values share the latent), the DSA
    index keys 1 (LayerNorm outputs)."""
    return {"k": k_scale, "v": v_scale, "latent": jnp.mean(k_scale), "index": jnp.float32(1.0)}[name]


def quantize_for_pool(x, dtype, scale):
    """value -> stored: divide by the scale, then saturate into FP8's finite range."""
    if not is_fp8(dtype):
        return x.astype(dtype)
    return saturating_cast(x.astype(jnp.float32) / scale, dtype)


def dequantize_from_pool(x, scale, dtype):
    if not is_fp8(x.dtype):
        return x.astype(dtype)
    return (x.astype(jnp.float32) * scale).astype(dtype)


def stored_scale(pool, scale):
    """The scale the decode kernels undo on `pool`: an FP8 pool stores value / scale, a BF16 or
    float32 one the value itself (quantize_for_pool), whatever scale the engine was given."""
    return scale if is_fp8(pool.dtype) else jnp.ones_like(scale)


def stored_names(pools: dict, name: str) -> tuple[str, ...]:
    """The arrays that hold entry `name` ("k", "v", "latent", "index") in one layer's pools."""
    if name + "_scale" not in pools:
        return (name,)
    return (name, name + "_scale") + (("rope",) if name == "latent" else ())


def encode_entry(pools: dict, name: str, real, scale) -> dict:
    """Real values of entry `name` [..., width] -> its stored arrays {array name: [..., width']},
    as `pools` (one layer's) lay them out. scale: the entry's per-tensor scale (untiled FP8)."""
    if name + "_scale" not in pools:
        return {name: quantize_for_pool(real, pools[name].dtype, scale)}
    width, tiles = pools[name].shape[-1], pools[name + "_scale"].shape[-1]
    stored, scales = quantize_tiles(real[..., :width], width // tiles)
    rope = {"rope": real[..., width:].astype(pools["rope"].dtype)} if name == "latent" else {}
    return {name: stored, name + "_scale": scales, **rope}


def decode_entry(stored: dict, name: str, scale, dtype):
    """encode's inverse: the arrays of entry `name` (whole pools or gathered pages) -> real values."""
    if name + "_scale" not in stored:
        return dequantize_from_pool(stored[name], scale, dtype)
    real = dequantize_tiles(stored[name], stored[name + "_scale"], dtype)
    return jnp.concatenate([real, stored["rope"].astype(dtype)], axis=-1) if name == "latent" else real


def entries(pools: dict) -> tuple[str, ...]:
    """The entries one layer's pools hold (each stored in one array, or tiled in two or three)."""
    return tuple(n for n in ("k", "v", "latent", "index") if n in pools)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class StepInputs:
    """Where this step's tokens go. Row b holds tokens at positions start_B[b] + t for t < count_B[b]."""

    pages_BN: jax.Array  # int32 physical page per logical page
    start_B: jax.Array  # int32 position of the row's first token in this step (= tokens already cached)
    count_B: jax.Array  # int32 tokens of this step that are real (0 for an idle slot)


class TokenSelection(NamedTuple):
    """DSA decode with a kernel backend: row b attends to token_ids_BK[b, :count_B[b]] (logical
    positions), not to a [B, 1, N*S] mask; 'shared' indexer layers reuse it as they would a mask."""

    token_ids_BK: jax.Array
    count_B: jax.Array


def latent_attention(q_BHC, arrays: dict, scale, pages_BN, lengths_or_selection, *, kv_lora_rank: int,
                     softmax_scale: float, backend: str, return_lse: bool = False, verify_tokens: int = 1):
    """The MLA decode kernel (or its reference) over one layer's latent arrays (SPLIT_ENTRY's, as
    stored_names lists them), for the rows' lengths_B, or a TokenSelection (DSA: each row its own
    tokens, so verification rows are not folded; PagedKV.verify_tokens)."""
    tiled = SPLIT_ENTRY + "_scale" in arrays
    pool = TiledLatentPages(*(arrays[a] for a in stored_names(arrays, SPLIT_ENTRY))) if tiled else arrays[SPLIT_ENTRY]
    common = dict(kv_lora_rank=kv_lora_rank, scale=None if tiled else stored_scale(pool, scale), softmax_scale=softmax_scale,
                  backend=backend, return_lse=return_lse)
    if isinstance(selection := lengths_or_selection, TokenSelection):
        return pallas_kernels.sparse_paged_attention_mla(q_BHC, pool, pages_BN, selection.token_ids_BK,
                                                         selection.count_B, **common)
    q, pages, lengths = fold_tokens(verify_tokens, q_BHC, pages_BN, lengths_or_selection)
    out = pallas_kernels.paged_attention_mla(q, pool, pages, lengths, **common)
    return tuple(unfold_tokens(verify_tokens, x) for x in out) if return_lse else unfold_tokens(verify_tokens, out)


def fold_tokens(tokens: int, q_X, pages_XN, lengths_X):
    """Verification rows as the decode kernels' per-request form: runs of `tokens` consecutive rows
    (one request's query tokens, on its pages) -> q [X / tokens, tokens, ...], pages [X / tokens, N],
    lengths [X / tokens, tokens]. unfold_tokens undoes it on the output."""
    if tokens == 1:
        return q_X, pages_XN, lengths_X
    lengths = lengths_X.reshape(-1, tokens)
    # A row past a request's drafts (length 0; its output is dropped) takes the first row's length:
    # the kernels take the masked path from the shortest row's block on, so a 0 would mask them all.
    lengths = jnp.where(lengths > 0, lengths, lengths[:, :1])
    return q_X.reshape(-1, tokens, *q_X.shape[1:]), pages_XN[::tokens], lengths


def unfold_tokens(tokens: int, out):
    return out if tokens == 1 else out.reshape(-1, *out.shape[2:])


@dataclasses.dataclass
class PagedKV:
    """One engine step's view of all layers' pools. `new_pools[i]` receives layer i's updated pool."""

    pools: list[dict]
    step: StepInputs
    page_size: int
    k_scale: jax.Array  # per layer (layer_scales): [layers] or [layers, KVH] (GQA); the MLA latent uses k_scale
    v_scale: jax.Array
    backend: str = "xla"
    # Decode context parallelism (MLA): each device of the mesh's "model" axis holds a contiguous
    # share of every page's slots of the latent pools (SPLIT_ENTRY's arrays), pool_shardings.
    split_slots: bool = False
    # Speculative verification: the rows come in runs of verify_tokens, one request's query tokens
    # (its last token and drafts, each a row of one token) on the same pages; the decode kernels
    # take each run as one request of several query tokens (fold_tokens), so its pages are read
    # once, not once per token.
    verify_tokens: int = 1
    new_pools: list = dataclasses.field(default_factory=list)

    def __post_init__(self):
        self.new_pools = list(self.pools)

    def layer(self, i: int) -> "LayerKV":
        return LayerKV(self, i)


@dataclasses.dataclass
class LayerKV:
    kv: PagedKV
    i: int

    @property
    def scales(self) -> tuple[jax.Array, jax.Array]:
        """This layer's (k_scale, v_scale): [] or [KVH]."""
        return self.kv.k_scale[self.i], self.kv.v_scale[self.i]

    # ---- writing ------------------------------------------------------------------------------
    def _slots(self, T: int):
        """Flat (page, offset) of each fresh token; padding tokens, and any past the table's width
        (the engine sizes the width to cover every write: a guard, not a path), point past the pool
        (dropped) rather than into the last page's slots."""
        step, S = self.kv.step, self.kv.page_size
        pos_BT = step.start_B[:, None] + jnp.arange(T)[None, :]
        column_BT = pos_BT // S
        page_BT = jnp.take_along_axis(step.pages_BN, jnp.minimum(column_BT, step.pages_BN.shape[1] - 1), axis=1)
        num_pages = self.kv.pools[self.i][next(iter(self.kv.pools[self.i]))].shape[-3]
        real = (jnp.arange(T)[None, :] < step.count_B[:, None]) & (column_BT < step.pages_BN.shape[1])
        return jnp.where(real, page_BT, num_pages), pos_BT % S

    def _write(self, name: str, fresh, scale, head_axis: bool) -> dict:
        """Stores this step's fresh values of entry `name`; returns the entry's updated arrays."""
        layer = self.kv.new_pools[self.i]
        page, off = self._slots(fresh.shape[1])
        encoded = encode_entry(layer, name, fresh, scale[:, None] if scale.ndim else scale)
        if head_axis:  # fresh [B, T, KVH, D] -> pool [KVH, P, S, D]
            updated = {array: layer[array].at[:, page, off].set(jnp.moveaxis(stored, 2, 0), mode="drop")
                       for array, stored in encoded.items()}
        elif (mesh := self._slot_mesh(name)) is None:
            updated = {array: layer[array].at[page, off].set(stored, mode="drop") for array, stored in encoded.items()}
        else:  # each device stores the tokens whose slots it holds
            def store(arrays, encoded, page, off):
                share = next(iter(arrays.values())).shape[1]
                local = off - jax.lax.axis_index(partitioning.MODEL_AXIS) * share
                page = jnp.where((local >= 0) & (local < share), page, jnp.iinfo(jnp.int32).max)  # others: dropped
                return {a: arrays[a].at[page, jnp.clip(local, 0, share - 1)].set(encoded[a], mode="drop") for a in arrays}

            split = P(None, partitioning.MODEL_AXIS)
            updated = partitioning.per_device(store, mesh, (split, P(), P(), P()), split)(
                {a: layer[a] for a in encoded}, encoded, page, off)
        self.kv.new_pools[self.i] = {**layer, **updated}
        return updated

    def _slot_mesh(self, name: str):
        """The mesh whose devices each hold a share of entry `name`'s slots (decode context
        parallelism), or None when every device holds whole pages."""
        return partitioning.context_mesh() if self.kv.split_slots and name == SPLIT_ENTRY else None

    # ---- reading ------------------------------------------------------------------------------
    def _kernel_table(self, num_pages: int):
        """Page table and lengths for the decode kernels. A row with nothing to do this step (idle,
        or stopped by the integrity check) reads nothing; page ids are clamped because the
        kernels index pages without bounds checks."""
        step = self.kv.step
        lengths = jnp.where(step.count_B > 0, step.start_B + step.count_B, 0)
        return jnp.clip(step.pages_BN, 0, num_pages - 1), lengths

    def _context_mask(self, T: int, is_decode: bool):
        """[B, T, N*S]: which cached positions each query sees."""
        step = self.kv.step
        ctx = jnp.arange(step.pages_BN.shape[1] * self.kv.page_size)[None, None, :]
        q_pos = step.start_B[:, None, None] + jnp.arange(T)[None, :, None]
        if is_decode:  # a row with nothing to do this step (idle, or stopped by the check) sees nothing
            limit = jnp.where(step.count_B[:, None, None] > 0, q_pos + 1, 0)
        else:  # prefill: earlier chunks only; this chunk's tokens are attended fresh
            limit = jnp.broadcast_to(step.start_B[:, None, None], q_pos.shape)
        return ctx < limit

    def _fresh_mask(self, T: int):
        step = self.kv.step
        causal = jnp.tril(jnp.ones((T, T), bool))[None]
        return causal & (jnp.arange(T)[None, None, :] < step.count_B[:, None, None])

    def _gather(self, pool, head_axis: bool):
        """Pages of every request in logical order: [B, N*S, ...] (GQA: [B, N*S, KVH, D]), one per
        run of PagedKV.verify_tokens rows (the decode paths fold those rows with _per_request)."""
        pages = self.kv.step.pages_BN[::self.kv.verify_tokens]
        B, N = pages.shape
        if head_axis:
            g = pool[:, pages]  # [KVH, B, N, S, D]
            return jnp.moveaxis(g, 0, -2).reshape(B, N * pool.shape[2], pool.shape[0], pool.shape[-1])
        return pool[pages].reshape(B, N * pool.shape[1], *pool.shape[2:])

    def _per_request(self, x_X1):
        """A decode tensor [rows, 1, ...] as [requests, verify_tokens, ...]: a verify run's rows are
        its request's query tokens over the pages _gather reads once (fold_tokens' XLA twin)."""
        return x_X1.reshape(-1, self.kv.verify_tokens, *x_X1.shape[2:])

    def _read(self, stored: dict, name: str, scale, dtype):
        """Entry `name` (MLA latent or DSA index keys) of every request in logical order: [B, N*S, width]."""
        return decode_entry({array: self._gather(pool, False) for array, pool in stored.items()}, name, scale, dtype)

    # ---- the model-facing interface ------------------------------------------------------------
    def attend_gqa(self, q_BTHD, k_BTKD, v_BTKD, *, scale):
        kv = self.kv
        T = q_BTHD.shape[1]
        k_scale, v_scale = self.scales
        k_pool = self._write("k", k_BTKD, k_scale, head_axis=True)["k"]
        v_pool = self._write("v", v_BTKD, v_scale, head_axis=True)["v"]
        if T == 1 and kv.backend != "xla":
            pages, lengths = self._kernel_table(k_pool.shape[1])

            def kernel(q, k, v, ks, vs, pages, lengths):
                q, pages, lengths = fold_tokens(kv.verify_tokens, q, pages, lengths)
                return unfold_tokens(kv.verify_tokens, pallas_kernels.paged_attention_gqa(
                    q, k, v, pages, lengths, k_scale=ks, v_scale=vs, softmax_scale=scale, backend=kv.backend))

            # Tensor parallel: each device attends with its query heads over its KV heads' pools.
            mesh = partitioning.context_mesh()
            head = partitioning.split_if(k_pool.shape[0] % partitioning.tp_size(mesh) == 0)
            scale_spec = lambda s: P(head) if s.ndim else P()
            kernel = partitioning.per_device(kernel, mesh, (P(None, head), P(head), P(head), scale_spec(k_scale),
                                                            scale_spec(v_scale), P(), P()), P(None, head))
            return kernel(q_BTHD[:, 0], k_pool, v_pool, stored_scale(k_pool, k_scale), stored_scale(v_pool, v_scale),
                          pages, lengths)[:, None]
        dt = q_BTHD.dtype
        head_scale = lambda s: s[:, None] if s.ndim else s  # [KVH] broadcasts over head_dim
        k_ctx = dequantize_from_pool(self._gather(k_pool, True), head_scale(k_scale), dt)
        v_ctx = dequantize_from_pool(self._gather(v_pool, True), head_scale(v_scale), dt)
        if T == 1:
            out = masked_attention(self._per_request(q_BTHD), k_ctx, v_ctx, self._per_request(self._context_mask(T, True)),
                                   scale)
            return out.reshape(q_BTHD.shape)
        keys = jnp.concatenate([k_ctx, k_BTKD.astype(dt)], axis=1)
        values = jnp.concatenate([v_ctx, v_BTKD.astype(dt)], axis=1)
        return masked_attention(q_BTHD, keys, values, self._prefill_mask(T), scale)

    def attend_mla(self, q_nope, q_pe, c_kv, k_pe, kv_b, *, scale, index_mask=None):
        kv = self.kv
        B, T, H, N = q_nope.shape
        L = c_kv.shape[-1]
        latent_scale = pool_scale("latent", *self.scales)
        stored = self._write("latent", jnp.concatenate([c_kv, k_pe.astype(c_kv.dtype)], axis=-1), latent_scale, False)
        dt = q_nope.dtype
        if T == 1:  # absorbed decode: queries move into latent space; values stay latent until W_UV
            w = kv_b.dense_kernel().reshape(L, H, -1)
            w_uk, w_uv = w[..., :N], w[..., N:]
            q_lat = jnp.einsum("bhn,lhn->bhl", q_nope[:, 0], w_uk.astype(dt), preferred_element_type=jnp.float32)
            q = jnp.concatenate([q_lat.astype(dt), q_pe[:, 0]], axis=-1)
            if self._slot_mesh(SPLIT_ENTRY) is not None:
                out_lat = self._attend_slot_shares(q, stored, latent_scale, index_mask, L, scale)
            elif kv.backend != "xla":  # the indexer gave a TokenSelection (or none): see index_select
                pages, lengths = self._kernel_table(stored[SPLIT_ENTRY].shape[0])
                kernel = functools.partial(latent_attention, kv_lora_rank=L, softmax_scale=scale, backend=kv.backend,
                                           verify_tokens=kv.verify_tokens)
                # Tensor parallel: each device runs its query heads over the whole (replicated) latent pool.
                mesh = partitioning.context_mesh()
                head = partitioning.split_if(H % partitioning.tp_size(mesh) == 0)
                kernel = partitioning.per_device(kernel, mesh, (P(None, head),) + (P(),) * 4, P(None, head))
                out_lat = kernel(q, stored, latent_scale, pages, lengths if index_mask is None else index_mask)
            else:
                latent = self._read(stored, "latent", latent_scale, dt)  # [requests, N*S, C]
                mask = self._context_mask(1, True) if index_mask is None else index_mask
                out_lat = masked_attention(self._per_request(q[:, None]), latent[:, :, None, :], latent[:, :, None, :L],
                                           self._per_request(mask), scale).reshape(B, H, L)
            out = jnp.einsum("bhl,lhv->bhv", out_lat.astype(dt), w_uv.astype(dt), preferred_element_type=jnp.float32)
            return out.astype(dt)[:, None]
        latent = self._read(stored, "latent", latent_scale, dt)
        c_all = jnp.concatenate([latent[..., :L], c_kv.astype(dt)], axis=1)
        pe_all = jnp.concatenate([latent[..., L:], k_pe.astype(dt)], axis=1)
        q, k, v = expand_mla(q_nope, q_pe, c_all, pe_all, kv_b)
        mask = self._prefill_mask(T) if index_mask is None else index_mask
        return masked_attention(q, k, v, mask, scale)

    def _attend_slot_shares(self, q_BHC, stored: dict, latent_scale, selection, L: int, scale):
        """Absorbed decode over latent pools split by slots (decode context parallelism): every
        device attends with all heads over the slots it holds (the kernels, or with backend "xla"
        their references), and the devices' outputs merge through their log-sum-exps. A row's
        tokens in a device's share are a prefix of it: all of its full pages' share, then the part
        of its last page's share below the length. DSA: the chosen positions in the share."""
        S = self.kv.page_size
        pages, lengths = self._kernel_table(stored[SPLIT_ENTRY].shape[0])

        def per_device(q, arrays, s, pages, row):
            share = arrays[SPLIT_ENTRY].shape[1]
            first = jax.lax.axis_index(partitioning.MODEL_AXIS) * share
            if isinstance(row, TokenSelection):
                slot = row.token_ids_BK % S - first
                mine = (slot >= 0) & (slot < share) & (jnp.arange(slot.shape[1])[None, :] < row.count_B[:, None])
                first_mine = jnp.argsort(~mine, axis=1, stable=True)  # the sparse kernel reads the first `count`
                local_ids = jnp.take_along_axis(row.token_ids_BK // S * share + slot, first_mine, axis=1)
                row = TokenSelection(local_ids, mine.sum(1, dtype=jnp.int32))
            else:
                row = row // S * share + jnp.clip(row % S - first, 0, share)
            out, lse = latent_attention(q, arrays, s, pages, row, kv_lora_rank=L, softmax_scale=scale,
                                        backend=self.kv.backend, return_lse=True, verify_tokens=self.kv.verify_tokens)
            return merge_over_axis(out, lse, partitioning.MODEL_AXIS)

        mesh, split = partitioning.context_mesh(), P(None, partitioning.MODEL_AXIS)
        run = partitioning.per_device(per_device, mesh, (P(), split, P(), P(), P()), P())
        return run(q_BHC, stored, latent_scale, pages, lengths if selection is None else selection)

    def _prefill_mask(self, T: int):
        return jnp.concatenate([self._context_mask(T, False), self._fresh_mask(T)], axis=-1)

    def index_select(self, q_BTHD, k_BTD, w_BTH, *, scale, top_k):
        """DSA over the cache: the index keys live in their own pool; same masks as attention.
        The chosen positions are logical: a key's index in the pages is its position."""
        T = q_BTHD.shape[1]
        scale_1 = pool_scale("index", *self.scales)
        k_ctx = self._read(self._write("index", k_BTD, scale_1, False), "index", scale_1, jnp.float32)
        if T == 1:  # each verified token scores the keys its request's pages hold, read once
            valid_B1S = self._context_mask(1, True)
            scores = index_scores(self._per_request(q_BTHD), k_ctx, self._per_request(w_BTH), scale)
            chosen_B1K = chosen_positions(scores, self._per_request(valid_B1S), top_k).reshape(-1, 1, top_k)
            if self.kv.backend == "xla" and self._slot_mesh(SPLIT_ENTRY) is None:
                return top_k_mask(scores, self._per_request(valid_B1S), top_k).reshape(valid_B1S.shape), chosen_B1K
            # top_k_mask's choice, kept as positions for the sparse kernel (or its reference).
            if top_k >= valid_B1S.shape[-1]:
                return None, chosen_B1K  # every cached token is chosen: the dense kernel reads them page by page
            picked_BK = top_k_positions(scores, self._per_request(valid_B1S), top_k).reshape(-1, top_k)
            return TokenSelection(picked_BK, jnp.minimum(jnp.sum(valid_B1S[:, 0], axis=-1), top_k)), chosen_B1K
        keys = jnp.concatenate([k_ctx, k_BTD], axis=1)
        ctx = k_ctx.shape[1]
        key_positions_BS = jnp.concatenate([jnp.broadcast_to(jnp.arange(ctx), (q_BTHD.shape[0], ctx)),
                                            self.kv.step.start_B[:, None] + jnp.arange(T)], axis=1)
        scores, valid = index_scores(q_BTHD, keys, w_BTH, scale), self._prefill_mask(T)
        return top_k_mask(scores, valid, top_k), chosen_positions(scores, valid, top_k, key_positions_BS)


@dataclasses.dataclass
class _RecordingKV:
    """Cache-free attention that records the absmax of every key/value it sees (for calibration)."""

    per_head: bool
    k_max: list = dataclasses.field(default_factory=list)
    v_max: list = dataclasses.field(default_factory=list)

    def layer(self, i: int) -> "_RecordingKV":
        return self

    def attend_gqa(self, q, k_BTKD, v_BTKD, *, scale):
        axes = (0, 1, 3) if self.per_head else None
        self.k_max.append(jnp.max(jnp.abs(k_BTKD), axis=axes))
        self.v_max.append(jnp.max(jnp.abs(v_BTKD), axis=axes))
        return NoCache().attend_gqa(q, k_BTKD, v_BTKD, scale=scale)

    def attend_mla(self, q_nope, q_pe, c_kv, k_pe, kv_b, *, scale, index_mask=None):
        m = jnp.maximum(jnp.max(jnp.abs(c_kv)), jnp.max(jnp.abs(k_pe)))
        self.k_max.append(m)
        self.v_max.append(m)
        return NoCache().attend_mla(q_nope, q_pe, c_kv, k_pe, kv_b, scale=scale, index_mask=index_mask)

    def index_select(self, *args, **kw):
        return NoCache().index_select(*args, **kw)


def calibrate_scales(model, tokens_BT, *, kv_dtype: str = "fp8_e4m3", per_head: bool = False,
                     per_layer: bool = False):
    """(k_scale, v_scale) = absmax over a calibration batch / the format's largest finite value,
    so the batch's largest key or value lands exactly on it: one scale for all layers, or with
    per_layer one per decoder layer ([num_layers, 1], or [num_layers, KVH] per head: Engine's
    layer_scales forms), as ModelOpt and llm-compressor calibrate the k_scale/v_scale they ship.
    MLA gets one scale for its latent."""
    if per_head and model.config.attention_kind == "mla":
        raise ValueError("MLA keeps one latent per token for all heads: per-head scales do not apply")
    fmt = kv_format(kv_dtype, model.dtype)
    if fmt.tiled:
        raise ValueError(f"{TILED} computes a scale per token and tile as it writes: there is nothing to calibrate")
    fp8_max = float(jnp.finfo(fmt.dtype).max)

    def absmax(params, tokens):
        kv = _RecordingKV(per_head)
        model.module.apply({"params": params}, tokens, kv=kv)
        k_max, v_max = jnp.stack(kv.k_max), jnp.stack(kv.v_max)  # [layers] or [layers, KVH]
        if not per_layer:
            return jnp.max(k_max, axis=0), jnp.max(v_max, axis=0)
        return (k_max, v_max) if per_head else (k_max[:, None], v_max[:, None])

    k_max, v_max = jax.jit(absmax)(model.params, jnp.asarray(tokens_BT, jnp.int32))
    return k_max / fp8_max, v_max / fp8_max
