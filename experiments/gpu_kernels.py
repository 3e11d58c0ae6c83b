"""Benchmark of the pallas_kernels ops against their peers, in one command.

    python experiments/gpu_kernels.py [--out PATH] [--budget-s S]

(experiments/gpu_check.sh runs it on a GPU together with the kernel tests.)

On an NVIDIA GPU (target: H200, < 8 minutes) it times, at serving shapes:
  * FP8 / BF16 paged GQA decode attention, GLM-4.6 per GPU at 8-way TP
    (12 query heads, 1 KV head of 128, page 16), batch 1..64, context 4k..32k,
    against JAX's own `jax.experimental.pallas.ops.gpu.paged_attention` on the
    same pages (BF16, and FP8 with its per-token scale arrays) and against our
    XLA reference;
  * FP8 / BF16 absorbed MLA decode, Kimi K2 per GPU (64 / 8 = 8 heads, latent
    576 = 512 + 64, page 64), and FlashMLA's tile-scaled FP8 layout ("fp8
    tiled", 656 B per token), against the XLA reference (JAX has no MLA op),
    and the sparse variant over GLM-5's DSA top-2048 of the longest context;
    and what one device runs under decode context parallelism at 8 ways
    ("MLA fp8, DCP8 share": all 64 heads over 1/8 of the context, in pages
    of 64 / 8 = 8 slots), beside the TP8 rows of the same batch and context;
  * the INT4 W4A16 expert matmul 7168 x 2048 (group 32), M = 1..64, against
    `jnp.dot` on the BF16 weights, the XLA reference, and the same weights in
    the seed's baseline format, FP8 with 128x128 block scales, through
    mixserve's XLA path (dequantize, then dot); and the grouped MoE
    version over 48 experts against `lax.ragged_dot` on BF16 weights.
Each row reports the median time, bytes moved / time, and that as a share of a
device-to-device copy bandwidth measured in the same run; each kernel row also
reports its max |error| against the XLA reference, so a fast but wrong kernel
shows. The goals are printed next to the results. On GPU the markdown table
is written to experiments/results/ (or --out) after every row. A row
that fails (a compile error interpret mode could not show) is listed as FAILED
with its error and the run goes on; rows after --budget-s are listed as skipped.

Timing on a GPU: CUPTI kernel durations (jax.experimental.mosaic.gpu.profiler
.measure), summed over the kernels one call launches (a call may be several:
INT4's x permute, kernel and split-K sum; attention's kernel and combine), so
the time is device time alone, without launch gaps or host dispatch. Each
sample runs the op on `copies` copies of its inputs in turn, together at least
256 MB (the H200's L2 is 50-60 MB), so no call finds its weights or pages in L2
from the call before; time per call = sample / copies, median over samples.
This replaced, after the first H200 run (experiments/results/
gpu_kernels_h200_2026-11-29.md), the fallback below, which measured the host:
an op that does nothing took 8-160 us per call in that loop, more than most
kernels, so the small shapes could not be resolved.

Fallback (no CUPTI, and on CPU): each op runs `reps` times inside one jitted
fori_loop whose input depends on the previous result; time per call = loop
time / reps, median over samples. `reps` is a Python int, so XLA knows the
trip count (a traced count makes XLA's GPU while loop sync with the host on
every iteration). The loop's own cost ("harness": the same loop around an op
that computes nothing but reads the input and hands an output-sized buffer to
the sum, see _harness_only) is measured alternately and subtracted.

--sweep adds a tuning table: the kernels' launch choices (AttentionTuning,
Int4Tuning) at a few serving shapes, each row with its error against the XLA
reference, which is how the defaults were chosen.

Without a GPU it runs tiny shapes with backends "interpret" and "xla" so that
the script keeps working; those CPU times say nothing about kernel speed.
"""

import argparse
import dataclasses
import datetime
import functools
import importlib.metadata
import itertools
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pallas_kernels import (  # noqa: E402  (needs the repo root on sys.path)
    AttentionTuning, Fp8BlockTuning, Int4Tuning, fp8_block_matmul, int4_matmul, moe_fp8_block_matmul, moe_int4_matmul,
    nvfp4_matmul, pack_int4, paged_attention_gqa, paged_attention_mla, sparse_paged_attention_mla)
from pallas_kernels.paged_attention_mla import TiledLatentPages, latent_bytes_per_token  # noqa: E402
from pallas_kernels.tiled_fp8 import quantize_tiles, tile_width  # noqa: E402
from models import weights  # noqa: E402  (the FP8-block weight format and mixserve's XLA path for it)

try:
    from jax.experimental.pallas.ops.gpu import paged_attention as jax_paged
except ImportError:  # The peer moved or was removed in this JAX version.
    jax_paged = None

RESULTS_DIR = Path(__file__).resolve().parent / "results"
# The bandwidth goal counts rows that move at least this much: more than the
# L2, and >= 15 us at the H200's copy bandwidth (launch costs are a few us).
BANDWIDTH_BOUND_BYTES = 64 << 20
GOALS = (
    "FP8 paged attention >= 80% of copy bandwidth",
    "FP8 paged GQA >= 1.8x JAX's paged_attention on BF16 pages",
    "INT4 matmul >= 3.3x bf16 jnp.dot at M=1 and >= 1.5x at M=64",
)


@dataclasses.dataclass(frozen=True)
class Config:
    """Shapes and timing effort for one device class."""

    on_gpu: bool
    kernel_backend: str  # "pallas" on GPU, "interpret" on CPU
    batches: tuple[int, ...]
    contexts: tuple[int, ...]
    gqa_q_heads: int
    gqa_head_dim: int
    gqa_page: int
    mla_heads: int
    mla_rank: int
    mla_rope: int
    mla_page: int
    matmul_k: int
    matmul_n: int
    matmul_ms: tuple[int, ...]
    group_size: int
    experts: int
    moe_tokens: tuple[int, ...]
    copy_bytes: int
    samples: int
    target_sample_s: float
    dsa_top_k: int  # GLM-5's index_topk: tokens the sparse MLA decode attends to


GPU = Config(True, "pallas", (1, 16, 64), (4096, 32768), 12, 128, 16, 8, 512, 64, 64,
             7168, 2048, (1, 8, 64), 32, 48, (8 * 8, 256 * 8), 1 << 30, 7, 0.02, dsa_top_k=2048)
CPU = Config(False, "interpret", (2,), (48,), 4, 32, 16, 8, 64, 32, 16,
             256, 64, (1, 16), 32, 4, (6,), 1 << 22, 3, 0.0, dsa_top_k=16)


@dataclasses.dataclass(frozen=True)
class Row:
    kernel: str
    shape: str
    impl: str
    seconds: float  # median per call inside the timing loop; nan when failed or skipped (see note)
    bytes_moved: int
    max_err: float | None = None
    note: str = ""  # why there is no time: the error, or the time budget
    harness_seconds: float = 0.0  # the same loop around an op that does nothing (loop timing)
    method: str = "loop"  # "cupti": kernel time alone; "loop": see the module docstring

    @property
    def net_seconds(self) -> float:
        """The op's own time; nan when it is within the harness's (not resolved)."""
        net = self.seconds - self.harness_seconds
        return net if net > 0 else float("nan")

    @property
    def gb_per_s(self) -> float:
        return self.bytes_moved / self.net_seconds / 1e9


class Bench:
    """Collects rows; one failing or late row costs that row, not the run.

    A lowering or compile error on the GPU (what interpret mode cannot catch)
    becomes a FAILED row with the message, and rows past the time budget are
    listed as skipped, so one device run always returns a whole table.
    """

    def __init__(self, cfg: Config, budget_s: float, cupti_measure: Callable | None = None):
        self.cfg = cfg
        self.rows: list[Row] = []
        self.deadline = time.perf_counter() + budget_s
        self.cupti_measure = cupti_measure  # None: loop timing
        # Called after each row, so that a run killed at its time limit still leaves every row it measured.
        self.after_row: Callable[[], object] = lambda: None

    def measure(self, kernel: str, shape: str, impl: str, fn: Callable, args: tuple, bytes_moved: int,
                ref: jax.Array | None = None) -> None:
        self.rows.append(self._row(kernel, shape, impl, fn, args, bytes_moved, ref))
        self.after_row()

    def _row(self, kernel: str, shape: str, impl: str, fn: Callable, args: tuple, bytes_moved: int,
             ref: jax.Array | None) -> Row:
        if time.perf_counter() > self.deadline:
            return Row(kernel, shape, impl, float("nan"), bytes_moved, note="skipped: time budget")
        try:
            out = jax.block_until_ready(fn(*args))  # compiles
            err = None if ref is None else max_err(out, ref)
            timing = self.time_call(fn, args)
        except Exception as error:  # Reported in the table; the other rows still run.
            message = " ".join(f"{type(error).__name__}: {error}".split())[:300]
            print(f"FAILED {kernel} {shape} {impl}: {message}", flush=True)
            return Row(kernel, shape, impl, float("nan"), bytes_moved, note=f"FAILED: {message}")
        if timing.kernels:  # the per-kernel CUPTI breakdown goes to the log as it is measured
            print(f"{kernel} {shape} {impl}: " + ", ".join(f"{name} {us:.1f} us" for name, us in timing.kernels),
                  flush=True)
        return Row(kernel, shape, impl, timing.seconds, bytes_moved, err,
                   harness_seconds=timing.harness_seconds, method=timing.method)

    def time_call(self, fn: Callable, args: tuple) -> "Timing":
        """fn(*args) timed by CUPTI when this bench has it, else by the loop."""
        if self.cupti_measure is not None:
            return cupti_time_per_call(fn, args, self.cfg.samples, self.cupti_measure)
        once = _wall_seconds(lambda: fn(*args))
        return time_per_call(fn, args, _reps(once, self.cfg), self.cfg.samples)


class Timing(NamedTuple):
    seconds: float  # median per call of the op (loop timing: inside the timing loop)
    harness_seconds: float = 0.0  # loop timing: median per call of the loop alone
    method: str = "loop"
    kernels: tuple[tuple[str, float], ...] = ()  # CUPTI: (kernel name, median us per call)


# The inputs of one sample span at least this many bytes, so that no call finds
# its inputs in L2 (50-60 MB on an H200) from the call before.
ROTATION_BYTES = 256 << 20
MAX_COPIES = 64


def copies_for(nbytes: int) -> int:
    """Copies of inputs of nbytes that together span ROTATION_BYTES (at most MAX_COPIES)."""
    return max(1, min(MAX_COPIES, -(-ROTATION_BYTES // max(nbytes, 1))))


def rotation_copies(args: tuple) -> int:
    """Copies for args, a tuple of pytrees (e.g. TiledLatentPages, three arrays)."""
    return copies_for(sum(a.nbytes for a in jax.tree.leaves(args) if isinstance(a, jax.Array)))


def cupti_time_per_call(fn: Callable, args: tuple, samples: int, measure: Callable) -> Timing:
    """Median device time per call of fn(*args) from CUPTI kernel records.

    measure is jax.experimental.mosaic.gpu.profiler.measure (tests pass a fake
    with its interface): measure(f, aggregate=False, iterations=n)(*a) runs f
    n times after a warm-up and returns (out, [[(kernel, ms), ...] per run]).
    """
    copies = rotation_copies(args)
    arg_sets = [args] + [jax.tree.map(lambda a: jnp.array(a, copy=True), args) for _ in range(copies - 1)]
    all_calls = jax.jit(lambda sets: [fn(*one) for one in sets])
    _, runs = measure(all_calls, aggregate=False, iterations=max(samples, 2))(arg_sets)
    if not runs:
        raise RuntimeError("CUPTI recorded no kernel")
    seconds = statistics.median(sum(ms for _, ms in run) for run in runs) / 1e3 / copies
    per_name: dict[str, list[float]] = {}
    for run in runs:
        totals: dict[str, float] = {}
        for name, ms in run:
            totals[name] = totals.get(name, 0.0) + ms
        for name, ms in totals.items():
            per_name.setdefault(name, []).append(ms)
    kernels = sorted(((name, statistics.median(ms) * 1e3 / copies) for name, ms in per_name.items()),
                     key=lambda item: -item[1])
    return Timing(seconds, method="cupti", kernels=tuple(kernels))


def cupti_measure_or_none() -> Callable | None:
    """profiler.measure when CUPTI works here (probed on a tiny op), else None."""
    try:
        from jax.experimental.mosaic.gpu import profiler

        _, runs = profiler.measure(jax.jit(lambda x: x + 1), aggregate=False, iterations=2)(jnp.ones((1024,)))
        if not runs or not runs[0]:
            raise RuntimeError("no kernel records")
        return profiler.measure
    except Exception as error:  # Reported; the loop timing still measures.
        print(f"CUPTI timing unavailable ({type(error).__name__}: {error}); using loop timing", flush=True)
        return None


def _wall_seconds(call: Callable[[], object]) -> float:
    start = time.perf_counter()
    jax.block_until_ready(call())
    return max(time.perf_counter() - start, 1e-7)


def _reps(once: float, cfg: Config) -> int:
    """Calls per sample, aiming at samples of cfg.target_sample_s.

    `once` is one dispatched call, host overhead included: for microsecond
    kernels it overestimates a call in the loop, so samples come out shorter
    than the target. That costs precision (more noise per sample), not bias.
    """
    return max(3, min(1000, int(cfg.target_sample_s / once)))


def _timed_loop(loop: Callable, args: tuple) -> Callable[[], float]:
    """Compiles and warms jit(loop)(*args); returns a timer of one more run."""
    compiled = jax.jit(loop)
    jax.block_until_ready(compiled(*args))
    return lambda: _wall_seconds(lambda: compiled(*args))


def _dependent_calls(fn: Callable, reps: int) -> Callable:
    """fn applied reps times, each call's first input depending on the last output."""

    def loop(*args):
        def body(_, carry):
            # carry * 0 is not folded for floats (NaN semantics): a true
            # dependency on the previous call. Summing the whole (small)
            # output keeps XLA from computing only part of it.
            first = args[0] + (carry * 0).astype(args[0].dtype)
            return carry + jnp.sum(fn(first, *args[1:]).astype(jnp.float32))

        # reps is a Python int: the trip count is known (see the module docstring).
        return jax.lax.fori_loop(0, reps, body, jnp.float32(0))

    return loop


def _harness_only(first, *rest):
    """The op's stand-in, computing nothing of its own: it reads all of `first`
    (one reduction, as the op loop's kernel that makes `first`) and returns an
    output-shaped buffer (the last argument) for the loop's sum, both tied to
    the carry. Not matched: the op loop also writes `first` once per call (one
    input's bytes: 14 KB for INT4 M=1, 29 MB for MoE T=2048, ~6 us against
    ~100 us), so net times lean slightly high, for every implementation alike."""
    touch = (jnp.sum(first.astype(jnp.float32)) * 0).astype(rest[-1].dtype)
    return rest[-1] + touch


def time_per_call(fn: Callable, args: tuple, reps: int, samples: int) -> Timing:
    """Median seconds per call of fn(*args) in the timing loop, and of the loop
    alone, sampled alternately; args[0] must be a float array."""
    out = jax.eval_shape(fn, *args)
    op = _timed_loop(_dependent_calls(fn, reps), args)
    harness = _timed_loop(_dependent_calls(_harness_only, reps), (*args, jnp.ones(out.shape, out.dtype)))
    op_s, harness_s = [], []
    for _ in range(samples):  # interleaved, so that drift on a shared machine hits both
        op_s.append(op() / reps)
        harness_s.append(harness() / reps)
    return Timing(statistics.median(op_s), statistics.median(harness_s))


def max_err(a: jax.Array, b: jax.Array) -> float:
    return float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))


def copy_bandwidth(bench: Bench) -> float:
    """Bytes/s of reading and writing cfg.copy_bytes once (x + 1), timed like the ops."""
    x = jnp.ones((bench.cfg.copy_bytes // 4,), jnp.float32)
    if bench.cupti_measure is not None:
        return 2 * bench.cfg.copy_bytes / bench.time_call(lambda x: x + 1, (x,)).seconds
    add_one = jax.jit(lambda x: x + 1)
    jax.block_until_ready(add_one(x))
    reps = _reps(_wall_seconds(lambda: add_one(x)), bench.cfg)
    run = _timed_loop(lambda x: jax.lax.fori_loop(0, reps, lambda _, x: x + 1, x), (x,))
    return 2 * bench.cfg.copy_bytes / statistics.median(run() / reps for _ in range(bench.cfg.samples))


def _scattered_pages(key, batch: int, pages_per_seq: int) -> jax.Array:
    """Page table [B, N] over a pool of B * N pages in random order."""
    return jax.random.permutation(key, batch * pages_per_seq).reshape(batch, pages_per_seq).astype(jnp.int32)


def _fp8(x: jax.Array) -> tuple[jax.Array, float]:
    """N(0, 1) values to e4m3 with a per-tensor scale (amax ~ 5 -> ~320 of 448)."""
    scale = 1.0 / 64
    return (x / scale).astype(jnp.float8_e4m3fn), scale


def _ragged_lengths(key, batch: int, context: int) -> jax.Array:
    """Lengths a little under the context (0-63 short, never empty): most
    requests end inside a page and inside a kernel block, so the masked tail is
    measured and checked too."""
    return context - jax.random.randint(key, (batch,), 0, min(64, context), jnp.int32)


class GqaCase(NamedTuple):
    q: jax.Array  # [B, H, D] bf16
    pages: dict  # name ("bf16", "fp8") -> (k_pages, v_pages, scale)
    table: jax.Array
    lengths: jax.Array


def _gqa_case(cfg: Config, key, batch: int, context: int, names=("bf16", "fp8")) -> GqaCase:
    h, d, s = cfg.gqa_q_heads, cfg.gqa_head_dim, cfg.gqa_page
    kq, kk, kv, kt, kl = jax.random.split(key, 5)
    n = context // s
    k = jax.random.normal(kk, (1, batch * n, s, d), jnp.float32)
    v = jax.random.normal(kv, (1, batch * n, s, d), jnp.float32)
    pages = {}
    if "bf16" in names:
        pages["bf16"] = (k.astype(jnp.bfloat16), v.astype(jnp.bfloat16), 1.0)
    if "fp8" in names:
        (k8, scale), (v8, _) = _fp8(k), _fp8(v)
        pages["fp8"] = (k8, v8, scale)
    return GqaCase(jax.random.normal(kq, (batch, h, d), jnp.bfloat16), pages,
                   _scattered_pages(kt, batch, n), _ragged_lengths(kl, batch, context))


def _gqa_op(cfg: Config, scale: float, tuning: AttentionTuning = AttentionTuning()) -> Callable:
    return functools.partial(paged_attention_gqa, k_scale=scale, v_scale=scale,
                             softmax_scale=cfg.gqa_head_dim**-0.5, tuning=tuning)


def _gqa_bytes(case: GqaCase, kp: jax.Array) -> int:
    return 2 * int(jnp.sum(case.lengths)) * kp.shape[-1] * kp.dtype.itemsize


def attention_shapes(cfg: Config) -> list[tuple[int, int]]:
    """(batch, context), the most bytes first: the goals' shapes (B=64 ctx=32k)
    get measured before a part's time budget runs out (runs 3 and 4 skipped
    them when they came last)."""
    return sorted(itertools.product(cfg.batches, cfg.contexts), key=lambda bc: (-bc[0] * bc[1], -bc[0]))


def gqa_rows(bench: Bench, key) -> None:
    cfg = bench.cfg
    d = cfg.gqa_head_dim
    for batch, context in attention_shapes(cfg):
        key, sub = jax.random.split(key)
        case = _gqa_case(cfg, sub, batch, context)
        shape = f"B={batch} ctx={context}"
        for name, (kp, vp, ks) in case.pages.items():
            kv_bytes = _gqa_bytes(case, kp)
            op = _gqa_op(cfg, ks)
            args = (case.q, kp, vp, case.table, case.lengths)
            ref = op(*args, backend="xla")
            bench.measure(f"GQA {name}", shape, cfg.kernel_backend,
                          functools.partial(op, backend=cfg.kernel_backend), args, kv_bytes, ref)
            bench.measure(f"GQA {name}", shape, "xla", functools.partial(op, backend="xla"), args, kv_bytes)
            if jax_paged is not None:
                _jax_op_row(bench, name, shape, case.q * d**-0.5, kp, vp, case.table, case.lengths, ks,
                            kv_bytes, ref)


def jax_paged_call(name: str, kp: jax.Array, table: jax.Array, scale: float, interpret: bool) -> Callable:
    """JAX's op on our pages: q comes pre-scaled (it has no softmax scale), FP8
    pages take per-token scales [K, P, S], and k_splits is the largest of
    1..16 dividing the pages per request."""
    pages_per_seq = table.shape[1]
    splits = max(d for d in (1, 2, 4, 8, 16) if pages_per_seq % d == 0)
    scales = None if name == "bf16" else jnp.full(kp.shape[:3], scale, jnp.float32)
    op = functools.partial(jax_paged.paged_attention, k_splits=splits, interpret=interpret)

    def call(q, kp, vp, table, lengths):
        return op(q, kp, vp, table, lengths, scales, scales)

    return call


def _jax_op_row(bench: Bench, name, shape, q_scaled, kp, vp, table, lengths, scale, kv_bytes, ref) -> None:
    call = jax_paged_call(name, kp, table, scale, interpret=not bench.cfg.on_gpu)
    bench.measure(f"GQA {name}", shape, "jax paged_attention", call, (q_scaled, kp, vp, table, lengths),
                  kv_bytes, ref)


class MlaCase(NamedTuple):
    q: jax.Array  # [B, H, C] bf16
    pages: dict  # name ("bf16", "fp8", "fp8 tiled") -> (latent pages, scale; None for tiled pages)
    table: jax.Array
    lengths: jax.Array


def _mla_case(cfg: Config, key, batch: int, context: int, names=("bf16", "fp8", "fp8 tiled")) -> MlaCase:
    width, s = cfg.mla_rank + cfg.mla_rope, cfg.mla_page
    kq, kl, kt, kn = jax.random.split(key, 4)
    n = context // s
    latent = jax.random.normal(kl, (batch * n, s, width), jnp.float32)
    pages = {}
    if "bf16" in names:
        pages["bf16"] = (latent.astype(jnp.bfloat16), 1.0)
    if "fp8" in names:
        pages["fp8"] = _fp8(latent)
    if "fp8 tiled" in names:  # FlashMLA's layout (kv_cache_dtype fp8_ds_mla): 656 B per token
        nope, tile_scales = quantize_tiles(latent[..., :cfg.mla_rank], tile_width(cfg.mla_rank))
        pages["fp8 tiled"] = (TiledLatentPages(nope, tile_scales, latent[..., cfg.mla_rank:].astype(jnp.bfloat16)), None)
    return MlaCase(jax.random.normal(kq, (batch, cfg.mla_heads, width), jnp.bfloat16), pages,
                   _scattered_pages(kt, batch, n), _ragged_lengths(kn, batch, context))


def _mla_op(cfg: Config, scale: float, tuning: AttentionTuning = AttentionTuning()) -> Callable:
    return functools.partial(paged_attention_mla, kv_lora_rank=cfg.mla_rank, scale=scale,
                             softmax_scale=(cfg.mla_rank + cfg.mla_rope) ** -0.5, tuning=tuning)


def _mla_bytes(case: MlaCase, pages) -> int:
    return int(jnp.sum(case.lengths)) * latent_bytes_per_token(pages)


def mla_rows(bench: Bench, key) -> None:
    cfg = bench.cfg
    for batch, context in attention_shapes(cfg):
        key, sub, ki = jax.random.split(key, 3)
        case = _mla_case(cfg, sub, batch, context)
        shape = f"B={batch} ctx={context}"
        for name, (pages, sc) in case.pages.items():
            op = _mla_op(cfg, sc)
            args = (case.q, pages, case.table, case.lengths)
            ref = op(*args, backend="xla")
            nbytes = _mla_bytes(case, pages)
            bench.measure(f"MLA {name}", shape, cfg.kernel_backend,
                          functools.partial(op, backend=cfg.kernel_backend), args, nbytes, ref)
            bench.measure(f"MLA {name}", shape, "xla", functools.partial(op, backend="xla"), args, nbytes)
            if context == max(cfg.contexts):  # GLM-5 DSA decode: top-k of the longest context
                _sparse_mla_rows(bench, name, shape, case.q, pages, case.table, sc, ki)
    _dcp_share_rows(bench, key)


DCP = 8  # decode context parallelism's ways (mixserve Engine(decode_context_parallel=True) at TP8)


def _dcp_share_rows(bench: Bench, key) -> None:
    """One device's decode attention under decode context parallelism: every head (TP8's 8 x 8)
    over 1/8 of each request's tokens, the device's share of each page (page / 8 slots). Its
    partial output still merges with the other devices' (not timed here)."""
    cfg = bench.cfg
    share = dataclasses.replace(cfg, mla_heads=cfg.mla_heads * DCP, mla_page=cfg.mla_page // DCP)
    context = max(cfg.contexts)
    for batch in sorted(cfg.batches, reverse=True):
        key, sub = jax.random.split(key)
        case = _mla_case(share, sub, batch, context // DCP, names=("fp8",))
        pages, sc = case.pages["fp8"]
        args = (case.q, pages, case.table, case.lengths)
        op = _mla_op(share, sc)
        bench.measure(f"MLA fp8, DCP{DCP} share", f"B={batch} ctx={context}", cfg.kernel_backend,
                      functools.partial(op, backend=cfg.kernel_backend), args, _mla_bytes(case, pages),
                      op(*args, backend="xla"))


def _sparse_mla_rows(bench: Bench, name, shape, q, pages, table, scale, key) -> None:
    """The sparse (DSA) MLA decode over dsa_top_k random distinct positions per request."""
    cfg = bench.cfg
    batch, context = table.shape[0], table.shape[1] * cfg.mla_page
    top_k = min(cfg.dsa_top_k, context)
    ids = jax.vmap(lambda k: jax.random.permutation(k, context)[:top_k])(jax.random.split(key, batch))
    args = (q, pages, table, ids.astype(jnp.int32), jnp.full((batch,), top_k, jnp.int32))
    op = functools.partial(sparse_paged_attention_mla, kv_lora_rank=cfg.mla_rank, scale=scale,
                           softmax_scale=q.shape[-1] ** -0.5)
    nbytes = batch * top_k * latent_bytes_per_token(pages)
    ref = op(*args, backend="xla")
    shape = f"{shape} top-k={top_k}"
    bench.measure(f"MLA sparse {name}", shape, cfg.kernel_backend, functools.partial(op, backend=cfg.kernel_backend),
                  args, nbytes, ref)
    bench.measure(f"MLA sparse {name}", shape, "xla", functools.partial(op, backend="xla"), args, nbytes)


VERIFY_TOKENS = 3  # speculative verification with 2 drafts: a request's last token and its drafts


def verify_rows(bench: Bench, key) -> None:
    """Speculative verification over FP8 pages at the longest context: each request's
    VERIFY_TOKENS query tokens (query j sees the cache up to itself) folded into one program's
    rows (q [B, Q, H, D]: the pages read once), against one kernel row per token (q [B * Q, H, D]
    on a repeated page table: what the engine ran before 2026-12-02), and for GQA folded in
    programs of 32 rows (AttentionTuning.gqa_rows) instead of 64. Bytes: the folded call's
    (each request's pages once), so the other rows' GB/s is an effective rate."""
    cfg = bench.cfg
    context = max(cfg.contexts)
    steps = jnp.arange(VERIFY_TOKENS, dtype=jnp.int32) - (VERIFY_TOKENS - 1)
    for batch in sorted(cfg.batches, reverse=True):
        key, kg, km, kq = jax.random.split(key, 4)
        shape = f"B={batch} ctx={context} Q={VERIFY_TOKENS}"
        gqa, mla = _gqa_case(cfg, kg, batch, context, names=("fp8",)), _mla_case(cfg, km, batch, context, names=("fp8",))
        (kp, vp, ks), (latent, ls) = gqa.pages["fp8"], mla.pages["fp8"]
        cases = (("GQA", _gqa_op(cfg, ks), (kp, vp), gqa, 2 * kp.shape[-1]),
                 ("MLA", _mla_op(cfg, ls), (latent,), mla, latent_bytes_per_token(latent)))
        for name, op, pools, case, token_bytes in cases:
            lengths_BQ = case.lengths[:, None] + steps
            q_BQ = jax.random.normal(kq, (batch, VERIFY_TOKENS, *case.q.shape[1:]), jnp.bfloat16)
            folded = (q_BQ, *pools, case.table, lengths_BQ)
            per_token = (q_BQ.reshape(-1, *case.q.shape[1:]), *pools, jnp.repeat(case.table, VERIFY_TOKENS, axis=0),
                         lengths_BQ.reshape(-1))
            ref = op(*folded, backend="xla")
            nbytes = int(jnp.sum(case.lengths)) * token_bytes
            run = functools.partial(op, backend=cfg.kernel_backend)
            bench.measure(f"{name} fp8 verify, folded", shape, cfg.kernel_backend, run, folded, nbytes, ref)
            bench.measure(f"{name} fp8 verify, a row per token", shape, cfg.kernel_backend,
                          lambda *args, run=run: run(*args).reshape(ref.shape), per_token, nbytes, ref)
            if name == "GQA":  # Q x G rows in programs of 32: pages read twice, at fewer registers than 64
                halves = functools.partial(_gqa_op(cfg, ks, AttentionTuning(gqa_rows=32)), backend=cfg.kernel_backend)
                bench.measure("GQA fp8 verify, folded, gqa_rows=32", shape, cfg.kernel_backend, halves, folded, nbytes, ref)


def _int4_weights(key, lead: tuple[int, ...], k: int, n: int, group: int):
    kv, ks = jax.random.split(key)
    values = jax.random.randint(kv, (*lead, k, n), -8, 8, jnp.int8)
    scales = (jax.random.uniform(ks, (*lead, k // group, n)) * 0.01).astype(jnp.bfloat16)
    packed = pack_int4(values)
    dense_bf16 = (values.astype(jnp.float32) * jnp.repeat(scales.astype(jnp.float32), group, axis=-2)).astype(jnp.bfloat16)
    return packed, scales, dense_bf16


def int4_rows(bench: Bench, key) -> None:
    cfg = bench.cfg
    k, n, g = cfg.matmul_k, cfg.matmul_n, cfg.group_size
    kw, key = jax.random.split(key)
    packed, scales, w_bf16 = _int4_weights(kw, (), k, n, g)
    int4_bytes = packed.size * 4 + scales.size * 2
    # The same weights in NVFP4 (the seed's next step; on Hopper the INT4 kernel with an e2m1 decode):
    # the same 4.5 bits per weight as g32, so the same bytes, and 665 inner-loop instructions per
    # 256 inputs at M=1 against INT4's 489 in the sm_90a SASS (experiments/results/sm90_sass.md).
    nvfp4 = weights.Nvfp4Weight.quantize(w_bf16)
    nvfp4_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(nvfp4))
    for m in cfg.matmul_ms:
        kx, key = jax.random.split(key)
        x = jax.random.normal(kx, (m, k), jnp.bfloat16)
        op = functools.partial(int4_matmul, group_size=g)
        args = (x, packed, scales)
        ref = op(*args, backend="xla")
        shape = f"M={m} K={k} N={n} g={g}"
        bench.measure("INT4 matmul", shape, cfg.kernel_backend, functools.partial(op, backend=cfg.kernel_backend),
                      args, int4_bytes, ref)
        bench.measure("INT4 matmul", shape, "xla", functools.partial(op, backend="xla"), args, int4_bytes)
        bench.measure("INT4 matmul", shape, "bf16 jnp.dot", jnp.dot, (x, w_bf16), w_bf16.size * 2, ref)
        fp4_args = (x, nvfp4.packed_QN, nvfp4.scales_GN, nvfp4.global_scale)
        bench.measure("NVFP4 matmul", f"M={m} K={k} N={n}", cfg.kernel_backend,
                      functools.partial(nvfp4_matmul, backend=cfg.kernel_backend), fp4_args, nvfp4_bytes,
                      nvfp4_matmul(*fp4_args, backend="xla"))
    # What one kernel takes just to read the bytes once (XLA's sum, 4 bytes a
    # value): the floor under each matmul at these sizes, where a kernel is a
    # few microseconds and its ramp-up counts. Goal 3.3x needs the INT4
    # kernel within dot/3.3 of this floor.
    for name, nbytes in (("read the INT4 bytes (sum)", int4_bytes), ("read the bf16 bytes (sum)", w_bf16.size * 2)):
        kr, key = jax.random.split(key)
        words = jax.random.normal(kr, (nbytes // 4,), jnp.float32)
        bench.measure("INT4 matmul", f"K={k} N={n} g={g}", name, jnp.sum, (words,), nbytes)


# The default (float16 dots) and bfloat16 dots, whose SASS has 64 more conversions per block at M=1.
FP8_DOTS = (("{}", Fp8BlockTuning()), ("{}, bf16 dots", Fp8BlockTuning(dot_dtype="bfloat16")))


def fp8_block_rows(bench: Bench, key) -> None:
    """The seed's baseline weight format, FP8 with 128 x 128 block scales (the same weights as the
    INT4 rows, rounded to FP8), dense and over experts: the Pallas kernel against mixserve's XLA
    path (models.weights: dequantize to bf16, then dot or ragged_dot over every expert)."""
    cfg = bench.cfg
    e, k, n, g = cfg.experts, cfg.matmul_k, cfg.matmul_n, cfg.group_size
    kw, key = jax.random.split(key)
    packed, scales, w_bf16 = _int4_weights(kw, (e,), k, n, g)
    experts = weights.Fp8BlockWeight.quantize(w_bf16)
    dense = weights.Fp8BlockWeight(experts.values_KN[0], experts.scale_inv_kn[0])
    dense_bytes = dense.values_KN.size + dense.scale_inv_kn.size * 4
    for m in cfg.matmul_ms:
        kx, key = jax.random.split(key)
        args = (jax.random.normal(kx, (m, k), jnp.bfloat16), dense.values_KN, dense.scale_inv_kn)
        ref = fp8_block_matmul(*args, backend="xla")
        shape = f"M={m} K={k} N={n}"
        for impl, tuning in FP8_DOTS:
            bench.measure("FP8-block matmul", shape, impl.format(cfg.kernel_backend),
                          functools.partial(fp8_block_matmul, backend=cfg.kernel_backend, tuning=tuning), args,
                          dense_bytes, ref)
        bench.measure("FP8-block matmul", shape, "xla: dequantize, dot", _fp8_xla_matmul, args, dense_bytes, ref)
    for tokens in cfg.moe_tokens:
        kx, key = jax.random.split(key)
        case = _moe_case(cfg, kx, packed, scales, tokens)
        x, _, _, sizes = case.args
        args = (x, experts.values_KN, experts.scale_inv_kn, sizes)
        ref = moe_fp8_block_matmul(*args, backend="xla")
        active_bytes = case.active * dense_bytes
        for impl, tuning in FP8_DOTS:
            bench.measure("MoE FP8-block", case.shape, impl.format(cfg.kernel_backend),
                          functools.partial(moe_fp8_block_matmul, backend=cfg.kernel_backend, tuning=tuning), args,
                          active_bytes, ref)
        bench.measure("MoE FP8-block", case.shape, "xla: dequantize all, ragged_dot", _fp8_xla_expert_matmul, args,
                      active_bytes, ref)


def _fp8_xla_matmul(x, values, scale_inv):
    return weights.matmul(x, weights.Fp8BlockWeight(values, scale_inv))


def _fp8_xla_expert_matmul(x, values, scale_inv, sizes):
    return weights.expert_matmul(x, weights.Fp8BlockWeight(values, scale_inv), sizes)


class MoeCase(NamedTuple):
    args: tuple  # (x [T, K] bf16, packed [E, K/8, N], scales [E, K/g, N], group sizes [E])
    shape: str
    int4_bytes: int  # the active experts' packed weights and scales
    active: int


def _moe_case(cfg: Config, key, packed, scales, tokens: int) -> MoeCase:
    """tokens spread over the experts at random (a fixed draw per token count)."""
    e, k = cfg.experts, cfg.matmul_k
    sizes = jnp.asarray(np.random.default_rng(tokens).multinomial(tokens, np.ones(e) / e), jnp.int32)
    active = int(jnp.sum(sizes > 0))
    x = jax.random.normal(key, (tokens, k), jnp.bfloat16)
    int4_bytes = active * (packed.size * 4 + scales.size * 2) // e
    return MoeCase((x, packed, scales, sizes), f"T={tokens} E={e} active={active}", int4_bytes, active)


def moe_rows(bench: Bench, key) -> None:
    cfg = bench.cfg
    e, k, n, g = cfg.experts, cfg.matmul_k, cfg.matmul_n, cfg.group_size
    kw, key = jax.random.split(key)
    packed, scales, w_bf16 = _int4_weights(kw, (e,), k, n, g)
    for tokens in cfg.moe_tokens:
        kx, key = jax.random.split(key)
        case = _moe_case(cfg, kx, packed, scales, tokens)
        op = functools.partial(moe_int4_matmul, group_size=g)
        ref = op(*case.args, backend="xla")
        bench.measure("MoE INT4", case.shape, cfg.kernel_backend, functools.partial(op, backend=cfg.kernel_backend),
                      case.args, case.int4_bytes, ref)
        x, _, _, sizes = case.args
        ragged = lambda x, w, sizes: jax.lax.ragged_dot(x, w, sizes)
        bench.measure("MoE INT4", case.shape, "bf16 ragged_dot", ragged, (x, w_bf16, sizes),
                      case.active * k * n * 2, ref)


def _verdict(value: float, target: float) -> str:
    return "met" if value >= target else "MISSED"


def _speedup(peer: Row, ours: Row) -> float:
    """Net-time ratio peer / ours; nan when either is within the harness."""
    return peer.net_seconds / ours.net_seconds


def goal_lines(rows: list[Row], copy_bw: float, kernel_backend: str) -> list[str]:
    """One line per goal: the measured worst case and whether it meets the target.

    Only timed rows count, with net times (op minus harness); a goal whose rows
    all failed, were skipped or were not resolved from the harness says so.
    """
    timed = [r for r in rows if not r.note and math.isfinite(r.net_seconds)]
    ours = [r for r in timed if r.impl == kernel_backend]
    by_key = {(r.kernel, r.shape, r.impl): r for r in timed}
    lines = []
    fp8 = [r for r in ours if r.kernel in ("GQA fp8", "MLA fp8")]
    # Bandwidth is a goal where bandwidth can bind: a 2 MB read (B=1 ctx=4k)
    # takes 0.5 us at 4.3 TB/s, under one kernel launch and the split combine,
    # so there every implementation, JAX's op included, is at 1-3%.
    large = [r for r in fp8 if r.bytes_moved >= BANDWIDTH_BOUND_BYTES]
    if large:
        worst = min(large, key=lambda r: r.gb_per_s)
        share = worst.gb_per_s * 1e9 / copy_bw
        smallest = min(fp8, key=lambda r: r.gb_per_s)
        lines.append(f"{GOALS[0]} (rows moving >= {BANDWIDTH_BOUND_BYTES >> 20} MiB): worst {100 * share:.0f}% "
                     f"({worst.kernel} {worst.shape}), {_verdict(share, 0.8)}; over all rows the worst is "
                     f"{100 * smallest.gb_per_s * 1e9 / copy_bw:.0f}% ({smallest.kernel} {smallest.shape})")
    else:
        lines.append(f"{GOALS[0]}: not measured (no timed FP8 kernel row moving >= {BANDWIDTH_BOUND_BYTES >> 20} MiB)")
    ratios = [(_speedup(by_key[("GQA bf16", r.shape, "jax paged_attention")], r), r.shape)
              for r in ours if r.kernel == "GQA fp8" and ("GQA bf16", r.shape, "jax paged_attention") in by_key]
    if ratios:
        ratio, shape = min(ratios)
        lines.append(f"{GOALS[1]}: worst {ratio:.2f}x ({shape}), {_verdict(ratio, 1.8)}")
    else:
        lines.append(f"{GOALS[1]}: not measured (no timed pair of rows)")
    targets = {1: 3.3, 64: 1.5}
    speedups = []
    for r in ours:
        m = int(r.shape.split()[0].removeprefix("M=")) if r.kernel == "INT4 matmul" else None
        dot = by_key.get(("INT4 matmul", r.shape, "bf16 jnp.dot"))
        if m in targets and dot is not None:
            speedup = _speedup(dot, r)
            speedups.append(f"{speedup:.2f}x at M={m} ({_verdict(speedup, targets[m])})")
    floor = next((r for r in rows if r.impl == "read the INT4 bytes (sum)" and r.net_seconds > 0), None)
    dot_m1 = next((r for r in rows if r.kernel == "INT4 matmul" and r.shape.startswith("M=1 ")
                   and r.impl == "bf16 jnp.dot" and r.net_seconds > 0), None)
    if floor is not None and dot_m1 is not None:  # NaN (unresolved) compares False above
        speedups.append(f"at most {dot_m1.net_seconds / floor.net_seconds:.2f}x at M=1 for any kernel that reads the "
                        f"INT4 bytes no faster than one XLA sum does ({floor.net_seconds * 1e6:.1f} us)")
    lines.append(f"{GOALS[2]}: " + (", ".join(speedups) if speedups else "not measured (no timed pair of rows)"))
    return lines


_TIMING_NOTE = {
    True: "us: median device time per call from CUPTI kernel records (all kernels of the call, "
          "inputs rotated through 256 MB so that L2 holds none of them); GB/s and the goals use it.",
    False: "us: net time per call = median in a loop of dependent calls (\"timing\" column) minus the "
           "same loop around an op that does nothing (harness); GB/s and the goals use it "
           "(\"-\": not resolved from the harness).",
}


def _table_row(r: Row, copy_bw: float) -> str:
    if r.note:
        return f"| {r.kernel} | {r.shape} | {r.impl} | {r.note} | | | | |"
    err = "" if r.max_err is None else f"{r.max_err:.2e}"
    timing = "cupti" if r.method == "cupti" else (
        f"loop {r.seconds * 1e6:.1f}, harness {r.harness_seconds * 1e6:.1f}")
    if not math.isfinite(r.net_seconds):
        return f"| {r.kernel} | {r.shape} | {r.impl} | - | {timing} | - | - | {err} |"
    share = 100 * r.gb_per_s * 1e9 / copy_bw
    return (f"| {r.kernel} | {r.shape} | {r.impl} | {r.net_seconds * 1e6:.1f} | {timing} | "
            f"{r.gb_per_s:.1f} | {share:.0f} | {err} |")


def markdown(rows: list[Row], copy_bw: float, goals: list[str], device: str, on_gpu: bool) -> str:
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    versions = f"jax {jax.__version__}, jaxlib {importlib.metadata.version('jaxlib')}"
    out = [f"# pallas_kernels benchmark, {device}, {stamp}", "", f"Software: {versions}.", ""]
    if not on_gpu:
        out += ["**No GPU: tiny shapes, kernels in the Pallas interpreter. These CPU times are NOT kernel "
                "performance; this run only shows that the script works.**", ""]
    methods = sorted({r.method for r in rows if not r.note})
    out += [f"Device-to-device copy bandwidth: {copy_bw / 1e9:.1f} GB/s", "", _TIMING_NOTE[tuple(methods) == ("cupti",)], "",
            "| kernel | shape | impl | us | timing | GB/s | % copy BW | max abs err vs xla |",
            "|---|---|---|---:|---|---:|---:|---:|"]
    out += [_table_row(r, copy_bw) for r in rows]
    heading = "Goals (measured):" if on_gpu else "Goals (CPU run: the numbers below do NOT measure them):"
    out += ["", heading] + [f"- {line}" for line in goals] + [""]
    return "\n".join(out)


# The sweep: launch choices at a few serving shapes (FP8 attention, the
# product's format): the defaults first, then the untimed candidates, then
# the rest; the budget may cut the tail. Run 3 (H200, 2026-11-30) set the
# defaults (float16 dots; 512 GQA and 128 MLA programs); the defaults before
# it (bfloat16 dots, 264 programs) stay as BEFORE_RUN_3, so that each run
# measures that change again. Choices that runs 3-4 timed slower than the
# defaults at B=64 ctx=32k are no longer swept (results/gpu_kernels_h200_2026-11-30_run4.md):
# GQA prefetch (313 us, 376 at 8 warps, against 262), 640 programs with
# bfloat16 dots (284), partial_share=8 (262; 23.6 against 21.5 us at B=1),
# 264 programs (340; 18.9 at B=1); MLA block_tokens=32 (1543 against 1245),
# 264 programs (1490), bfloat16 dots (1362).
# Untimed (sm_90a compiles, results/sm90_compile.md and sm90_sass.md):
# the masks of tokens past the length now sit in a branch only a request's
# last block takes (AttentionTuning.branch_masks, the default since
# 2026-12-01): a block of valid tokens issues GQA 422 instructions per thread
# against 679 with every block masked, MLA 694 against 1147. The unbranched
# masks come second, so that each run measures that change. swap_pv runs the
# values product as wgmma: with every block masked it cut GQA to 578 and MLA
# to 997; with the branch, a valid block issues 436 and 703.
# MLA runs one program per SM, so at 8 warps each scheduler has 2 warps to
# hide latency with (issue slots 29% busy in run 3's profile); at 16 warps it
# compiles to 98 registers (103 with swap_pv), no spills, and a valid block
# issues 603 (606) instructions per thread against 694 (703) at 8 warps: 1.7x
# the warp instructions per block for twice the warps. GQA partial_share=2 asks for two blocks per program at any
# context: at B=1 ctx=32k that is 256 programs of two blocks, the plan that
# 264 programs gave (18.9 us); GQA block_tokens=128 (281 us at B=64, 18.8
# at B=1) halves the programs the same way at B=1. combine="pallas" merges
# the split partials in one kernel instead of XLA's reductions: at B=1 run 4
# logged 12.9 us of small XLA kernels beside GQA's 8.6 us kernel (5.6 us of
# them the merge's reductions) and 8.2 beside MLA's 26.0.
BEFORE_RUN_3 = AttentionTuning(fp8_dots="bfloat16", target_programs=264, branch_masks=False)
ATTENTION_SWEEP = {
    "GQA": (AttentionTuning(), AttentionTuning(branch_masks=False), AttentionTuning(swap_pv=True),
            AttentionTuning(combine="pallas"),
            AttentionTuning(partial_share=2), AttentionTuning(swap_pv=True, partial_share=2),
            AttentionTuning(block_tokens=128), BEFORE_RUN_3),
    "MLA": (AttentionTuning(), AttentionTuning(branch_masks=False), AttentionTuning(swap_pv=True),
            AttentionTuning(combine="pallas"),
            AttentionTuning(num_warps=16), AttentionTuning(num_warps=16, swap_pv=True),
            AttentionTuning(prefetch=True), BEFORE_RUN_3),
}
# INT4 since 2026-12-01 contracts K in pair order (int4_matmul's docstring)
# with swap_ab on: never timed. The 8-plane kernel it replaced ran run 4's
# 10.5 us at M=1 and run 3's 16.5 at M=64, the yardstick across runs; in one
# run, swap_ab=False (pair order, x w) is its interleaved comparison. sm_90a
# compiles (experiments/results/sm90_compile.md, sm90_sass.md): at M=1 the
# default takes 92 registers at 8 warps, 2 programs per SM, so the 224
# programs are one wave at 1.7 per SM, and 489 loop instructions per step
# (519 with 8 planes); at M=64, 143 registers and 82 KiB, 2 per SM, 984
# (1111). gather_x drops the x permute kernel (1.6 us of run 4's 10.5 at M=1)
# for more loop instructions: 552 against 489 at M=1, 1611 against 984 at
# M=64. block_k=128 halves the x tile: 41 KiB at M=64, 4 programs per SM,
# for 284 / 524 instructions per 128 K at M=1 / 64 (+16% / +6% per weight
# byte). The MoE sweep runs the first MOE_SWEEP_SIZE choices.
# Run 3 (8 planes, then at 3 stages) timed these at M=1 / M=64 (us): 3 stages
# 11.6 / 19.7, 2 stages 10.6 / 16.5, gather_x 10.3 / 21.4, block_k=128 14.4 /
# 17.0, target_programs=132 11.7 / 17.0, block_n=64 at 2 stages 12.5 / 17.4;
# MoE T=64: 187 default, 194 gather_x, 375 block_k=128. No longer swept:
# gather_x at 8 warps (10.4 / 33.5), block_k=128 at 396 programs (the same
# plan and times as block_k=128), block_n=64 at 528 programs (12.8 / 24.5).
INT4_SWEEP = (Int4Tuning(), Int4Tuning(swap_ab=False), Int4Tuning(gather_x=True), Int4Tuning(num_stages=3),
              Int4Tuning(block_k=128), Int4Tuning(target_programs=132))
MOE_SWEEP_SIZE = 4

def tuning_label(tuning) -> str:
    """The fields that differ from the defaults, or "default"."""
    default = type(tuning)()
    changed = [f"{f.name}={getattr(tuning, f.name)}" for f in dataclasses.fields(tuning)
               if getattr(tuning, f.name) != getattr(default, f.name)]
    return " ".join(changed) or "default"


def sweep_rows(bench: Bench, key) -> None:
    """Each launch choice at its shapes, with its error against the XLA reference:
    INT4 first (runs 3 and 4 ran out of time after its first two choices at
    M=1; the attention sweep ran whole in both), then attention, then MoE."""
    k_attention, k_int4, k_moe = jax.random.split(key, 3)
    _int4_sweep_rows(bench, k_int4)
    _attention_sweep_rows(bench, k_attention)
    _moe_sweep_rows(bench, k_moe, min(bench.cfg.moe_tokens))


def _int4_sweep_rows(bench: Bench, key) -> None:
    cfg = bench.cfg
    backend = cfg.kernel_backend
    m_values = (min(cfg.matmul_ms), max(cfg.matmul_ms))
    k, n, g = cfg.matmul_k, cfg.matmul_n, cfg.group_size
    kw, key = jax.random.split(key)
    packed, scales, _ = _int4_weights(kw, (), k, n, g)
    for m in m_values:
        kx, key = jax.random.split(key)
        args = (jax.random.normal(kx, (m, k), jnp.bfloat16), packed, scales)
        ref = int4_matmul(*args, group_size=g, backend="xla")
        for tuning in INT4_SWEEP:
            op = functools.partial(int4_matmul, group_size=g, backend=backend, tuning=tuning)
            bench.measure("INT4 matmul", f"M={m} K={k} N={n} g={g}", tuning_label(tuning), op, args,
                          packed.size * 4 + scales.size * 2, ref)


def _attention_sweep_rows(bench: Bench, key) -> None:
    cfg = bench.cfg
    backend = cfg.kernel_backend
    contexts = (max(cfg.contexts),)  # the bandwidth-bound end
    batches = sorted({min(cfg.batches), max(cfg.batches)}, reverse=True)
    for batch in batches:
        for context in contexts:
            key, sub = jax.random.split(key)
            case = _gqa_case(cfg, sub, batch, context, names=("fp8",))
            kp, vp, ks = case.pages["fp8"]
            args = (case.q, kp, vp, case.table, case.lengths)
            ref = _gqa_op(cfg, ks)(*args, backend="xla")
            for tuning in ATTENTION_SWEEP["GQA"]:
                bench.measure("GQA fp8", f"B={batch} ctx={context}", tuning_label(tuning),
                              functools.partial(_gqa_op(cfg, ks, tuning), backend=backend), args,
                              _gqa_bytes(case, kp), ref)
            del case, args
            key, sub = jax.random.split(key)
            case = _mla_case(cfg, sub, batch, context, names=("fp8",))
            pages, sc = case.pages["fp8"]
            args = (case.q, pages, case.table, case.lengths)
            ref = _mla_op(cfg, sc)(*args, backend="xla")
            for tuning in ATTENTION_SWEEP["MLA"]:
                bench.measure("MLA fp8", f"B={batch} ctx={context}", tuning_label(tuning),
                              functools.partial(_mla_op(cfg, sc, tuning), backend=backend), args,
                              _mla_bytes(case, pages), ref)


def _moe_sweep_rows(bench: Bench, key, tokens: int) -> None:
    """Decode-sized MoE (16-row tiles, most experts idle) under the INT4 sweep's choices."""
    cfg = bench.cfg
    kw, kx = jax.random.split(key)
    packed, scales, _ = _int4_weights(kw, (cfg.experts,), cfg.matmul_k, cfg.matmul_n, cfg.group_size)
    case = _moe_case(cfg, kx, packed, scales, tokens)
    ref = moe_int4_matmul(*case.args, group_size=cfg.group_size, backend="xla")
    for tuning in INT4_SWEEP[:MOE_SWEEP_SIZE]:
        op = functools.partial(moe_int4_matmul, group_size=cfg.group_size, backend=cfg.kernel_backend, tuning=tuning)
        bench.measure("MoE INT4", case.shape, tuning_label(tuning), op, case.args, case.int4_bytes, ref)


def sweep_markdown(rows: list[Row], copy_bw: float) -> str:
    out = ["", "## Tuning sweep", "",
           "The kernels' launch choices (AttentionTuning, Int4Tuning; \"impl\" lists the fields that differ from "
           "the defaults) at a few shapes, timed as above. Attention: FP8 pages, lengths 0-63 under the context.", "",
           "| kernel | shape | impl | us | timing | GB/s | % copy BW | max abs err vs xla |",
           "|---|---|---|---:|---|---:|---:|---:|"]
    out += [_table_row(r, copy_bw) for r in rows]
    best = {}
    for r in rows:
        if not r.note and math.isfinite(r.net_seconds):
            key = (r.kernel, r.shape)
            if key not in best or r.net_seconds < best[key].net_seconds:
                best[key] = r
    out += ["", "Fastest per shape:"] + [f"- {r.kernel} {r.shape}: {r.impl}, {r.net_seconds * 1e6:.1f} us"
                                          for r in best.values()] + [""]
    return "\n".join(out)


PARTS = {"int4": int4_rows, "moe": moe_rows, "fp8": fp8_block_rows, "gqa": gqa_rows, "mla": mla_rows,
         "verify": verify_rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="write the markdown table here (default on GPU: experiments/results/)")
    parser.add_argument("--budget-s", type=float, default=360.0,
                        help="start no new row after this many seconds; later rows are listed as skipped")
    parser.add_argument("--sweep", action="store_true", help="add the tuning sweep after the benchmark")
    parser.add_argument("--sweep-budget-s", type=float, default=150.0,
                        help="the sweep's own budget, counted from its start")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"benchmark parts to run, of {','.join(PARTS)}")
    parser.add_argument("--batches", help="attention batch sizes instead of the config's (e.g. 1,64)")
    parser.add_argument("--contexts", help="attention contexts instead of the config's (e.g. 32768)")
    cli = parser.parse_args()
    on_gpu = jax.default_backend() == "gpu"
    cfg = GPU if on_gpu else CPU
    ints = lambda text: tuple(int(v) for v in text.split(","))
    cfg = dataclasses.replace(cfg, **{name: ints(getattr(cli, name)) for name in ("batches", "contexts")
                                      if getattr(cli, name)})
    parts = [PARTS[name] for name in cli.parts.split(",") if name]
    device = jax.devices()[0].device_kind
    if not on_gpu:
        print(f"No GPU ({device}): tiny shapes, backends 'interpret' and 'xla'. CPU times are NOT kernel performance.")
    out = cli.out
    if out is None and on_gpu:
        safe_device = "".join(c if c.isalnum() else "-" for c in device)
        out = RESULTS_DIR / f"gpu_kernels-{safe_device}-{datetime.date.today().isoformat()}.md"
    key = jax.random.key(0)
    start = time.perf_counter()
    cupti = cupti_measure_or_none() if on_gpu else None
    bench = Bench(cfg, cli.budget_s, cupti)
    copy_bw = copy_bandwidth(bench)
    sweep = Bench(cfg, cli.sweep_budget_s, cupti) if cli.sweep else None

    def write_table() -> str:
        """The whole table so far; written to `out` after every row."""
        text = markdown(bench.rows, copy_bw, goal_lines(bench.rows, copy_bw, cfg.kernel_backend), device, on_gpu)
        if sweep is not None and sweep.rows:
            text += sweep_markdown(sweep.rows, copy_bw)
        if out is not None:
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(text)
        return text

    bench.after_row = write_table
    # Each part may use its share of what is left, so a slow part cannot skip
    # the later ones (run 2 lost its MLA rows past B=16 that way). The matmuls first.
    end = start + cli.budget_s
    for left, part in zip(range(len(parts), 0, -1), parts):
        now = time.perf_counter()
        bench.deadline = now + (end - now) / left
        key, sub = jax.random.split(key)
        part(bench, sub)
        print(f"{part.__name__} done after {time.perf_counter() - start:.0f} s", flush=True)
    if sweep is not None:
        sweep.deadline = time.perf_counter() + cli.sweep_budget_s  # counted from the sweep's start
        sweep.after_row = write_table
        sweep_rows(sweep, key)
        print(f"sweep_rows done after {time.perf_counter() - start:.0f} s", flush=True)
    print(write_table())
    if out is not None:
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
