"""GPTQ (Frantar et al., 2022) into the 4-bit formats that round-to-nearest writes (INT4, NVFP4).

Per linear layer, with X its calibration inputs [n, K] and W its weight [K, N]:

    H = 2/n X^T X + damp * mean(diag H) * I            (damp = 1% by default)
    U = upper Cholesky factor of H^-1                    (H^-1 = U^T U)
    for k in 0..K-1 (input rows of W, the columns of HF's [out, in]):
        at a group's first row: scale_N = the format's scale of the current rows of the group
        q_N = the nearest value of W[k] under that scale
        err_N = (W[k] - q) / U[k, k]
        W[k+1:] -= U[k, k+1:]^T err                       (error feedback to the rows not yet rounded)

The scales (_Grid): INT4's absmax / 7.5 in bf16 and values clamp(round(W / scale), -8, 7); NVFP4's
e4m3 group scales under a global scale fixed from the weight before any feedback (as
llm-compressor fixes it), values the nearest e2m1 code.

The group scale is decided when the group's first row is reached, from the rows as they are then
(with the error of earlier groups folded in): reference GPTQ without static groups, except that
it reads all rows of the group with the feedback so far (the reference reads rows of a later lazy
block without the current block's updates). The scale rules are round-to-nearest's, so the
result is the same on-disk format as RTN; with H = I there is no feedback and GPTQ equals RTN
bit for bit. Updates are applied to all remaining rows each step (no lazy blocks): O(K^2 N) per
matrix, fine for the small models this runs on. Inputs nobody fed (diag H = 0) get H_kk = 1 and
keep their weights (the reference zeroes them, which would break them for unseen inputs).

Calibration inputs are captured in one jitted pass of the float model per batch (flax
`nn.intercept_methods`, no change to model code): each targeted Linear / kv_b_proj sees its input;
each routed expert sees the tokens routed to it (gate/up: the hidden state; down: silu(x gate_e) *
(x up_e), recomputed from the captured x and the float weights). So every layer's inputs come from the unquantized model
(not re-run through the already quantized earlier layers). An expert no calibration token reaches,
or a layer the forward never calls, falls back to RTN, and the report lists it.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Callable, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from models.attention import LatentUpProjection
from models.layers import Linear
from models.moe import RoutedExperts
from models.transformer import Transformer
from models.weights import QUANTIZED, Int4Weight, Nvfp4Weight, WeightFormat, WeightPlan, quantize
from pallas_kernels.nvfp4_matmul import (E2M1_VALUES, global_scale_of_amax, nvfp4_codes, nvfp4_global_scale,
                                         nvfp4_group_scales)
from pallas_kernels.int4_matmul import pack_nibbles

log = logging.getLogger(__name__)
Path = tuple[str, ...]
HIGHEST = jax.lax.Precision.HIGHEST


@dataclasses.dataclass(frozen=True)
class Calibration:
    """Random token ids: `tokens` in sequences of `seq_len` (a real text set can be passed as ids instead)."""

    tokens: int = 2048
    seq_len: int = 128
    seed: int = 0

    def __post_init__(self):
        if not 1 <= self.seq_len <= self.tokens:
            raise ValueError(f"calibration needs 1 <= seq_len <= tokens (at least one sequence), got "
                             f"seq_len={self.seq_len}, tokens={self.tokens}")

    def token_ids(self, vocab_size: int) -> np.ndarray:
        """int32 [tokens // seq_len, seq_len]."""
        rng = np.random.default_rng(self.seed)
        return rng.integers(0, vocab_size, (self.tokens // self.seq_len, self.seq_len), dtype=np.int32)


@dataclasses.dataclass
class Gram:
    """Running sum of x x^T over calibration inputs: xtx_KK [..., K, K], count [...] and the largest
    |x| seen, amax [...] (per expert if stacked): GPTQ's Hessian and a W4A4 input scale."""

    xtx: jax.Array
    count: jax.Array
    amax: jax.Array

    def add(self, xtx, count, amax) -> None:
        self.xtx, self.count, self.amax = self.xtx + xtx, self.count + count, jnp.maximum(self.amax, amax)

    @property
    def hessian(self) -> jax.Array:
        """H = 2/n X^T X (identity where no input came, which makes GPTQ equal RTN there)."""
        n = self.count[..., None, None]
        eye = jnp.eye(self.xtx.shape[-1], dtype=jnp.float32)
        return jnp.where(n > 0, 2 * self.xtx / jnp.maximum(n, 1), eye)


@dataclasses.dataclass
class LayerReport:
    """One quantized weight: calibration rows seen (token-expert pairs for experts), and
    ||X (W - Q)||^2 on the calibration set for RTN and for GPTQ."""

    path: str
    rows: int
    rtn_error: float
    gptq_error: float
    rtn_fallback_experts: list[int] = dataclasses.field(default_factory=list)


# ---- the algorithm ---------------------------------------------------------------------------------


class _Grid(NamedTuple):
    """A 4-bit format as GPTQ rounds into it: a row at a time, under scales fixed per group."""

    group_size: int
    scale_dtype: object
    group_scale: Callable  # the group's rows as they are now [g, N] -> its scale [N]
    round_row: Callable  # (row [N], scale [N]) -> (stored code [N] uint8, value [N] float32)
    build: Callable  # (codes [K, N] uint8, scales [K/g, N]) -> the weight


def _grid(fmt: WeightFormat, w_KN: jax.Array) -> _Grid:
    g = fmt.group_size
    if fmt.kind == "int4":
        def round_int4(row_N, scale_N):
            scale = scale_N.astype(jnp.float32)
            q = jnp.clip(jnp.round(row_N / jnp.maximum(scale, jnp.finfo(jnp.float32).tiny)), -8, 7)
            return (q + 8).astype(jnp.uint8), q * scale

        return _Grid(g, jnp.bfloat16, lambda rows: Int4Weight.quantize(rows, g).scales_GN[0], round_int4,
                     lambda codes, scales: Int4Weight(pack_nibbles(codes), scales, g))
    if fmt.kind == "nvfp4":
        global_1 = nvfp4_global_scale(w_KN)

        def round_fp4(row_N, scale_N):
            codes = nvfp4_codes(row_N, scale_N, global_1)
            return codes, jnp.asarray(E2M1_VALUES)[codes.astype(jnp.int32)] * (scale_N.astype(jnp.float32) / global_1)

        return _Grid(g, jnp.float8_e4m3fn,
                     lambda rows: nvfp4_group_scales(jnp.max(jnp.abs(rows), axis=0), global_1), round_fp4,
                     lambda codes, scales: Nvfp4Weight(pack_nibbles(codes), scales, global_1))
    raise ValueError(f"GPTQ rounds into int4 or nvfp4, not {fmt}")


@functools.partial(jax.jit, static_argnames=("fmt",))
def gptq_quantize(w_KN: jax.Array, h_KK: jax.Array, fmt: WeightFormat, damp: float = 0.01) -> Int4Weight | Nvfp4Weight:
    """GPTQ of one weight [K, N] under Hessian [K, K] into fmt (int4 or nvfp4)."""
    k, n = w_KN.shape
    w_KN = w_KN.astype(jnp.float32)
    grid = _grid(fmt, w_KN)
    if k % grid.group_size:
        raise ValueError(f"{fmt.kind} group_size {grid.group_size} does not divide the input dimension {k}")
    h = h_KK.astype(jnp.float32)
    h = h + jnp.diag(jnp.where(jnp.diagonal(h) == 0, 1.0, 0.0))  # dead inputs
    h = h + damp * jnp.mean(jnp.diagonal(h)) * jnp.eye(k, dtype=jnp.float32)
    chol = jax.scipy.linalg.cholesky(h, lower=True)
    h_inv = jax.scipy.linalg.cho_solve((chol, True), jnp.eye(k, dtype=jnp.float32))
    u_KK = jax.scipy.linalg.cholesky(h_inv, lower=False)

    def step(i, carry):
        w, codes, scales, scale = carry
        group = jax.lax.dynamic_slice_in_dim(w, i, grid.group_size, axis=0)
        fresh = grid.group_scale(group)  # unused (and clamped) off a group start
        scale = jnp.where(i % grid.group_size == 0, fresh.astype(jnp.float32), scale.astype(jnp.float32)).astype(scale.dtype)
        code, value = grid.round_row(w[i], scale)
        err = (w[i] - value) / u_KK[i, i]
        w = w - u_KK[i][:, None] * err[None, :]  # U is upper triangular: rows <= i are done
        return w, codes.at[i].set(code), scales.at[i // grid.group_size].set(scale), scale

    init = (w_KN, jnp.zeros((k, n), jnp.uint8), jnp.zeros((k // grid.group_size, n), grid.scale_dtype),
            jnp.zeros((n,), grid.scale_dtype))
    _, codes, scales, _ = jax.lax.fori_loop(0, k, step, init)
    return grid.build(codes, scales)


def reconstruction_error(w_KN: jax.Array, q: Int4Weight | Nvfp4Weight, xtx_KK: jax.Array) -> jax.Array:
    """||X W - X Q||_F^2 = tr(D^T X^T X D), D = W - dequant(Q); stacked [E, ...] inputs give [E]."""
    d = w_KN.astype(jnp.float32) - q.dequantize(jnp.float32)
    return jnp.sum(d * jnp.matmul(xtx_KK, d, precision=HIGHEST), axis=(-2, -1))


# ---- capturing the calibration inputs -------------------------------------------------------------


def is_quantized(x) -> bool:
    return isinstance(x, QUANTIZED)


def flat_params(tree) -> dict[Path, object]:
    """Leaves by path; a quantized weight is one leaf."""
    flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_quantized)[0]
    return {tuple(getattr(k, "key", getattr(k, "name", None)) for k in path): leaf for path, leaf in flat}


def require_unquantized(flat: dict[Path, object]) -> None:
    quantized = [p for p, leaf in flat.items() if is_quantized(leaf)]
    if quantized:
        raise ValueError(f"quantizing needs the unquantized model, but {'/'.join(quantized[0])} is already quantized: "
                         "load the BF16 checkpoint")


def abstract_params(cfg, plan: WeightPlan, dtype, mtp_plan: WeightPlan | None = None):
    """Shape-only params of Transformer(cfg, plan, dtype, mtp_plan=mtp_plan), unboxed."""
    init = lambda: Transformer(cfg, plan, dtype, mtp_plan=mtp_plan).init(jax.random.key(0), jnp.zeros((1, 1), jnp.int32))
    return nn.unbox(jax.eval_shape(init)["params"])


def _xtx(x_MK: jax.Array) -> jax.Array:
    x = x_MK.reshape(-1, x_MK.shape[-1]).astype(jnp.float32)
    return jnp.matmul(x.T, x, precision=HIGHEST)


def _input_stats(x_MK: jax.Array, with_xtx: bool) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(x^T x, or 0 without with_xtx, rows, max |x|) of a layer's inputs."""
    xtx = _xtx(x_MK) if with_xtx else jnp.float32(0)
    return xtx, jnp.float32(np.prod(x_MK.shape[:-1])), jnp.max(jnp.abs(x_MK.astype(jnp.float32)))


def _expert_grams(mod: RoutedExperts, x_TD, experts_TK, with_xtx: bool) -> dict[str, tuple[jax.Array, jax.Array, jax.Array]]:
    """Per-expert x^T x (0 without with_xtx), rows and max |x| of the gate/up inputs (tokens routed to e)
    and of the down inputs."""
    params = mod.variables["params"]
    x = x_TD.astype(jnp.float32)
    routed_TE = jax.nn.one_hot(experts_TK, mod.cfg.n_routed_experts, dtype=jnp.float32).sum(1)  # 0/1: top-k is distinct
    gate = jnp.einsum("td,edf->tef", x, params["gate_proj"].astype(jnp.float32), precision=HIGHEST)
    up = jnp.einsum("td,edf->tef", x, params["up_proj"].astype(jnp.float32), precision=HIGHEST)
    h_TEF = nn.silu(gate) * up
    count_E = routed_TE.sum(0)
    xtx_in = jnp.einsum("te,td,tc->edc", routed_TE, x, x, precision=HIGHEST) if with_xtx else jnp.float32(0)
    xtx_down = jnp.einsum("te,tef,teg->efg", routed_TE, h_TEF, h_TEF, precision=HIGHEST) if with_xtx else jnp.float32(0)
    amax_in = jnp.max(routed_TE * jnp.max(jnp.abs(x), axis=-1, keepdims=True), axis=0)
    amax_down = jnp.max(routed_TE * jnp.max(jnp.abs(h_TEF), axis=-1), axis=0)
    return {"gate_proj": (xtx_in, count_E, amax_in), "up_proj": (xtx_in, count_E, amax_in),
            "down_proj": (xtx_down, count_E, amax_down)}


@functools.partial(jax.jit, static_argnames=("module", "targets", "with_xtx"))
def _batch_grams(params, ids_BT, *, module: Transformer, targets: frozenset[Path], with_xtx: bool) -> dict[str, tuple]:
    """One forward of a batch -> {"/".join(path): (x^T x, rows, max |x|)} for the target weights it
    reached (x^T x only with_xtx: [E, K, K] per expert layer is most of a pass's memory)."""
    found: dict[Path, tuple[jax.Array, jax.Array, jax.Array]] = {}  # filled while tracing, returned as outputs

    def add(path, xtx, count, amax):
        if path in targets:
            old = found.get(path, (0.0, 0.0, 0.0))
            found[path] = (old[0] + xtx, old[1] + count, jnp.maximum(old[2], amax))

    def interceptor(next_fun, args, kwargs, context):
        out = next_fun(*args, **kwargs)
        mod = context.module
        if context.method_name != "__call__":
            return out
        if isinstance(mod, (Linear, LatentUpProjection)):
            add((*mod.path, "kernel"), *_input_stats(args[0], with_xtx))
        elif isinstance(mod, RoutedExperts):
            x_TD, _, experts_TK, *_ = args  # calibration batches hold no padding (valid_T is None)
            for proj, stats in _expert_grams(mod, x_TD, experts_TK, with_xtx).items():
                add((*mod.path, proj), *stats)
        return out

    with nn.intercept_methods(interceptor):
        module.apply({"params": params}, ids_BT)
    return {"/".join(path): value for path, value in found.items()}


def collect_grams(model, targets: set[Path], ids_BT: np.ndarray, batch: int = 8, with_xtx: bool = True) -> dict[Path, Gram]:
    """Run the float model over ids_BT (in batches of rows) and sum x^T x (without with_xtx:
    only rows and max |x|, and xtx is 0) for every target weight path."""
    grams: dict[Path, Gram] = {}
    ids = np.asarray(ids_BT, np.int32)
    for start in range(0, len(ids), batch):
        found = _batch_grams(model.params, jnp.asarray(ids[start:start + batch]), module=model.module,
                             targets=frozenset(targets), with_xtx=with_xtx)
        for name, (xtx, count, amax) in found.items():
            zeros = Gram(jnp.zeros_like(xtx), jnp.zeros_like(count), jnp.zeros_like(amax))
            grams.setdefault(tuple(name.split("/")), zeros).add(xtx, count, amax)
    return grams


def input_global_scales(model, plan: WeightPlan, ids_BT: np.ndarray, grams: dict[Path, Gram] | None = None
                        ) -> dict[Path, jax.Array]:
    """The NVFP4 input global scale [..., 1] of every weight that `plan` puts in W4A4: 448 * 6 / the
    largest |input| over the calibration tokens (llm-compressor's static min-max observer), per
    expert for routed experts. An expert no token reaches takes its layer's largest input (the
    scale a shared observer would give), with a warning; so does a layer the forward never calls
    (then scale 1, inputs up to 2688). kv_b_proj's too, which mixserve runs weight-only but a
    checkpoint's other readers may not (models.attention.LatentUpProjection). grams: GPTQ's pass over
    the same ids (gptq_weights), which has every NVFP4 weight's amax; else a pass without X^T X."""
    layout = flat_params(abstract_params(model.config, plan, model.dtype))
    targets = {p for p, leaf in layout.items()
               if isinstance(leaf, Nvfp4Weight) and (plan.experts if "experts" in p else plan.linear).w4a4}
    grams = collect_grams(model, targets, ids_BT, with_xtx=False) if grams is None else grams
    scales = {}
    for path in sorted(targets):
        shape = layout[path].global_scale.shape[:-1]
        amax = grams[path].amax if path in grams else jnp.zeros(shape, jnp.float32)
        if np.any(np.asarray(amax) == 0):
            log.warning("%s: no calibration input reached %s; their input scale is the layer's largest", "/".join(path),
                        f"experts {np.flatnonzero(np.asarray(amax) == 0).tolist()}" if amax.ndim else "it")
            amax = jnp.where(amax == 0, jnp.max(amax), amax)
        scales[path] = global_scale_of_amax(amax[..., None])
    return scales


# ---- the whole model ------------------------------------------------------------------------------


def gptq_weights(model, plan: WeightPlan, ids_BT: np.ndarray, *, damp: float = 0.01
                 ) -> tuple[dict[Path, Int4Weight | Nvfp4Weight], list[LayerReport], dict[Path, Gram]]:
    """GPTQ of every weight that `plan` puts in int4 or nvfp4, from a float model run over ids_BT.

    model: a mixserve Model with plain (unquantized) weights. Returns ({param path: weight},
    [LayerReport], the calibration statistics {param path: Gram}); paths are those of
    Transformer(cfg, plan) (experts stacked [E, K, N]).
    """
    source = flat_params(model.params)
    require_unquantized(source)
    layout = flat_params(abstract_params(model.config, plan, model.dtype))
    targets = {p: plan.experts if "experts" in p else plan.linear
               for p, leaf in layout.items() if isinstance(leaf, (Int4Weight, Nvfp4Weight))}
    grams = collect_grams(model, set(targets), ids_BT)
    weights, reports = {}, []
    for path in sorted(targets):
        weights[path], report = _gptq_weight(path, source[path], targets[path], grams.get(path), damp)
        reports.append(report)
    return weights, reports, grams


def _gptq_weight(path: Path, w, fmt: WeightFormat, gram: Gram | None, damp: float) -> tuple[Int4Weight | Nvfp4Weight, LayerReport]:
    name = "/".join(path)
    w = w.astype(jnp.float32)
    if gram is None:  # the forward never called this layer
        log.warning("%s: no calibration input reached it; RTN", name)
        return quantize(w, fmt), LayerReport(name, 0, float("nan"), float("nan"))
    fn = functools.partial(gptq_quantize, fmt=fmt, damp=damp)
    q = jax.vmap(fn)(w, gram.hessian) if w.ndim == 3 else fn(w, gram.hessian)
    rtn = quantize(w, fmt)
    empty = [int(e) for e in np.flatnonzero(np.asarray(gram.count) == 0)] if w.ndim == 3 else []
    if empty:  # their Hessian is the identity, under which GPTQ is RTN
        log.warning("%s: experts %s got no calibration tokens; RTN for them", name, empty)
    report = LayerReport(name, int(np.sum(gram.count)), float(reconstruction_error(w, rtn, gram.xtx).sum()),
                         float(reconstruction_error(w, q, gram.xtx).sum()), empty)
    return q, report
