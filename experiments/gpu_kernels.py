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
    576 = 512 + 64, page 64), against the XLA reference (JAX has no MLA op),
    and the sparse variant over GLM-5's DSA top-2048 of the longest context;
  * the INT4 W4A16 expert matmul 7168 x 2048 (group 32), M = 1..64, against
    `jnp.dot` on the BF16 weights and the XLA reference, and the grouped MoE
    version over 48 experts against `lax.ragged_dot` on BF16 weights.
Each row reports the median time, bytes moved / time, and that as a share of a
device-to-device copy bandwidth measured in the same run; each kernel row also
reports its max |error| against the XLA reference, so a fast but wrong kernel
shows. The goals are printed next to the results. On GPU the markdown table
is written to experiments/results/ (or --out) after every kernel family. A row
that fails (a compile error interpret mode could not show) is listed as FAILED
with its error and the run goes on; rows after --budget-s are listed as skipped.

Timing: each op runs `reps` times inside one jitted fori_loop whose input
depends on the previous result (so XLA can neither hoist nor overlap the
calls); time per call = loop time / reps, median over samples. `reps` is a
Python int, so XLA knows the trip count: with a traced count, XLA's GPU while
loop copies the loop predicate to the host and waits for the stream on every
iteration (WhileThunk), a host round trip per call that would swamp a
microsecond kernel. The dependency and the sum of the output add a few tiny
kernels per call. That "harness" is measured too: the same loop, with the
op replaced by one that computes nothing but still reads the input and hands
an output-sized buffer to the sum (see _harness_only), interleaved sample by
sample with the op; the table shows both, and bandwidths and goal ratios use
the net time (op minus harness). triton.testing.do_bench is not used: it needs PyTorch CUDA events,
and JAX dispatch is asynchronous to them.

Without a GPU it runs tiny shapes with backends "interpret" and "xla" so that
the script keeps working; those CPU times say nothing about kernel speed.
"""

import argparse
import dataclasses
import datetime
import functools
import importlib.metadata
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
    int4_matmul, moe_int4_matmul, pack_int4, paged_attention_gqa, paged_attention_mla, sparse_paged_attention_mla)

try:
    from jax.experimental.pallas.ops.gpu import paged_attention as jax_paged
except ImportError:  # The peer moved or was removed in this JAX version.
    jax_paged = None

RESULTS_DIR = Path(__file__).resolve().parent / "results"
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
    harness_seconds: float = 0.0  # the same loop around an op that does nothing

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

    def __init__(self, cfg: Config, budget_s: float):
        self.cfg = cfg
        self.rows: list[Row] = []
        self.deadline = time.perf_counter() + budget_s

    def measure(self, kernel: str, shape: str, impl: str, fn: Callable, args: tuple, bytes_moved: int,
                ref: jax.Array | None = None) -> None:
        if time.perf_counter() > self.deadline:
            self.rows.append(Row(kernel, shape, impl, float("nan"), bytes_moved, note="skipped: time budget"))
            return
        try:
            out = jax.block_until_ready(fn(*args))  # compiles
            err = None if ref is None else max_err(out, ref)
            once = _wall_seconds(lambda: fn(*args))
            timing = time_per_call(fn, args, _reps(once, self.cfg), self.cfg.samples)
        except Exception as error:  # Reported in the table; the other rows still run.
            message = " ".join(f"{type(error).__name__}: {error}".split())[:300]
            print(f"FAILED {kernel} {shape} {impl}: {message}", flush=True)
            self.rows.append(Row(kernel, shape, impl, float("nan"), bytes_moved, note=f"FAILED: {message}"))
            return
        self.rows.append(Row(kernel, shape, impl, timing.seconds, bytes_moved, err,
                             harness_seconds=timing.harness_seconds))


class Timing(NamedTuple):
    seconds: float  # median per call of the op inside the timing loop
    harness_seconds: float  # median per call of the loop alone (dependency + sum)


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


def copy_bandwidth(cfg: Config) -> float:
    """Bytes/s of reading and writing cfg.copy_bytes once (x <- x + 1 in place)."""
    x = jnp.zeros((cfg.copy_bytes // 4,), jnp.float32)
    add_one = jax.jit(lambda x: x + 1)
    jax.block_until_ready(add_one(x))
    reps = _reps(_wall_seconds(lambda: add_one(x)), cfg)
    run = _timed_loop(lambda x: jax.lax.fori_loop(0, reps, lambda _, x: x + 1, x), (x,))
    return 2 * cfg.copy_bytes / statistics.median(run() / reps for _ in range(cfg.samples))


def _scattered_pages(key, batch: int, pages_per_seq: int) -> jax.Array:
    """Page table [B, N] over a pool of B * N pages in random order."""
    return jax.random.permutation(key, batch * pages_per_seq).reshape(batch, pages_per_seq).astype(jnp.int32)


def _fp8(x: jax.Array) -> tuple[jax.Array, float]:
    """N(0, 1) values to e4m3 with a per-tensor scale (amax ~ 5 -> ~320 of 448)."""
    scale = 1.0 / 64
    return (x / scale).astype(jnp.float8_e4m3fn), scale


def gqa_rows(bench: Bench, key) -> None:
    cfg = bench.cfg
    h, d, s = cfg.gqa_q_heads, cfg.gqa_head_dim, cfg.gqa_page
    for batch in cfg.batches:
        for context in cfg.contexts:
            kq, kk, kv, kt, key = jax.random.split(key, 5)
            n = context // s
            q = jax.random.normal(kq, (batch, h, d), jnp.bfloat16)
            k = jax.random.normal(kk, (1, batch * n, s, d), jnp.float32)
            v = jax.random.normal(kv, (1, batch * n, s, d), jnp.float32)
            table = _scattered_pages(kt, batch, n)
            lengths = jnp.full((batch,), context, jnp.int32)
            k8, scale = _fp8(k)
            v8, _ = _fp8(v)
            kb, vb = k.astype(jnp.bfloat16), v.astype(jnp.bfloat16)
            del k, v
            shape = f"B={batch} ctx={context}"
            for name, kp, vp, ks in (("bf16", kb, vb, 1.0), ("fp8", k8, v8, scale)):
                kv_bytes = 2 * batch * context * d * kp.dtype.itemsize
                op = functools.partial(paged_attention_gqa, k_scale=ks, v_scale=ks, softmax_scale=d**-0.5)
                args = (q, kp, vp, table, lengths)
                ref = op(*args, backend="xla")
                bench.measure(f"GQA {name}", shape, cfg.kernel_backend,
                              functools.partial(op, backend=cfg.kernel_backend), args, kv_bytes, ref)
                bench.measure(f"GQA {name}", shape, "xla", functools.partial(op, backend="xla"), args, kv_bytes)
                if jax_paged is not None:
                    _jax_op_row(bench, name, shape, q * d**-0.5, kp, vp, table, lengths, ks, kv_bytes, ref)


def _jax_op_row(bench: Bench, name, shape, q_scaled, kp, vp, table, lengths, scale, kv_bytes, ref) -> None:
    """JAX's op: no softmax scale (q is pre-scaled) and per-token fp8 scales [K, P, S]."""
    pages_per_seq = table.shape[1]
    splits = max(d for d in (1, 2, 4, 8, 16) if pages_per_seq % d == 0)
    scales = None if name == "bf16" else jnp.full(kp.shape[:3], scale, jnp.float32)
    op = functools.partial(jax_paged.paged_attention, k_splits=splits, interpret=not bench.cfg.on_gpu)

    def call(q, kp, vp, table, lengths):
        return op(q, kp, vp, table, lengths, scales, scales)

    bench.measure(f"GQA {name}", shape, "jax paged_attention", call, (q_scaled, kp, vp, table, lengths),
                  kv_bytes, ref)


def mla_rows(bench: Bench, key) -> None:
    cfg = bench.cfg
    h, width, s = cfg.mla_heads, cfg.mla_rank + cfg.mla_rope, cfg.mla_page
    for batch in cfg.batches:
        for context in cfg.contexts:
            kq, kl, kt, ki, key = jax.random.split(key, 5)
            n = context // s
            q = jax.random.normal(kq, (batch, h, width), jnp.bfloat16)
            latent = jax.random.normal(kl, (batch * n, s, width), jnp.float32)
            table = _scattered_pages(kt, batch, n)
            lengths = jnp.full((batch,), context, jnp.int32)
            l8, scale = _fp8(latent)
            lb = latent.astype(jnp.bfloat16)
            del latent
            for name, pages, sc in (("bf16", lb, 1.0), ("fp8", l8, scale)):
                op = functools.partial(paged_attention_mla, kv_lora_rank=cfg.mla_rank, scale=sc,
                                       softmax_scale=width**-0.5)
                args = (q, pages, table, lengths)
                ref = op(*args, backend="xla")
                nbytes = batch * context * width * pages.dtype.itemsize
                shape = f"B={batch} ctx={context}"
                bench.measure(f"MLA {name}", shape, cfg.kernel_backend,
                              functools.partial(op, backend=cfg.kernel_backend), args, nbytes, ref)
                bench.measure(f"MLA {name}", shape, "xla", functools.partial(op, backend="xla"), args, nbytes)
                if context == max(cfg.contexts):  # GLM-5 DSA decode: top-k of the longest context
                    _sparse_mla_rows(bench, name, shape, q, pages, table, sc, ki)


def _sparse_mla_rows(bench: Bench, name, shape, q, pages, table, scale, key) -> None:
    """The sparse (DSA) MLA decode over dsa_top_k random distinct positions per request."""
    cfg = bench.cfg
    batch, context = table.shape[0], table.shape[1] * cfg.mla_page
    top_k = min(cfg.dsa_top_k, context)
    ids = jax.vmap(lambda k: jax.random.permutation(k, context)[:top_k])(jax.random.split(key, batch))
    args = (q, pages, table, ids.astype(jnp.int32), jnp.full((batch,), top_k, jnp.int32))
    op = functools.partial(sparse_paged_attention_mla, kv_lora_rank=cfg.mla_rank, scale=scale,
                           softmax_scale=q.shape[-1] ** -0.5)
    nbytes = batch * top_k * q.shape[-1] * pages.dtype.itemsize
    ref = op(*args, backend="xla")
    shape = f"{shape} top-k={top_k}"
    bench.measure(f"MLA sparse {name}", shape, cfg.kernel_backend, functools.partial(op, backend=cfg.kernel_backend),
                  args, nbytes, ref)
    bench.measure(f"MLA sparse {name}", shape, "xla", functools.partial(op, backend="xla"), args, nbytes)


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


def moe_rows(bench: Bench, key) -> None:
    cfg = bench.cfg
    e, k, n, g = cfg.experts, cfg.matmul_k, cfg.matmul_n, cfg.group_size
    kw, key = jax.random.split(key)
    packed, scales, w_bf16 = _int4_weights(kw, (e,), k, n, g)
    for tokens in cfg.moe_tokens:
        kx, key = jax.random.split(key)
        rng = np.random.default_rng(tokens)
        sizes = jnp.asarray(rng.multinomial(tokens, np.ones(e) / e), jnp.int32)
        active = int(jnp.sum(sizes > 0))
        x = jax.random.normal(kx, (tokens, k), jnp.bfloat16)
        op = functools.partial(moe_int4_matmul, group_size=g)
        args = (x, packed, scales, sizes)
        ref = op(*args, backend="xla")
        shape = f"T={tokens} E={e} active={active}"
        per_expert_int4 = (packed.size * 4 + scales.size * 2) // e
        bench.measure("MoE INT4", shape, cfg.kernel_backend, functools.partial(op, backend=cfg.kernel_backend),
                      args, active * per_expert_int4, ref)
        ragged = lambda x, w, sizes: jax.lax.ragged_dot(x, w, sizes)
        bench.measure("MoE INT4", shape, "bf16 ragged_dot", ragged, (x, w_bf16, sizes), active * k * n * 2, ref)


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
    if fp8:
        worst = min(fp8, key=lambda r: r.gb_per_s)
        share = worst.gb_per_s * 1e9 / copy_bw
        lines.append(f"{GOALS[0]}: worst {100 * share:.0f}% ({worst.kernel} {worst.shape}), {_verdict(share, 0.8)}")
    else:
        lines.append(f"{GOALS[0]}: not measured (no timed FP8 kernel row)")
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
    lines.append(f"{GOALS[2]}: " + (", ".join(speedups) if speedups else "not measured (no timed pair of rows)"))
    return lines


def markdown(rows: list[Row], copy_bw: float, goals: list[str], device: str, on_gpu: bool) -> str:
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    versions = f"jax {jax.__version__}, jaxlib {importlib.metadata.version('jaxlib')}"
    out = [f"# pallas_kernels benchmark, {device}, {stamp}", "", f"Software: {versions}.", ""]
    if not on_gpu:
        out += ["**No GPU: tiny shapes, kernels in the Pallas interpreter. These CPU times are NOT kernel "
                "performance; this run only shows that the script works.**", ""]
    out += [f"Device-to-device copy bandwidth: {copy_bw / 1e9:.1f} GB/s", "",
            "Times are medians per call in a loop of dependent calls; \"harness\" is that loop around an "
            "op that does nothing, and \"net\" = op - harness, which GB/s and the goals use "
            "(\"-\": not resolved from the harness).", "",
            "| kernel | shape | impl | median us | harness us | net us | GB/s | % copy BW | max abs err vs xla |",
            "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if r.note:
            out.append(f"| {r.kernel} | {r.shape} | {r.impl} | {r.note} | | | | | |")
            continue
        err = "" if r.max_err is None else f"{r.max_err:.2e}"
        resolved = math.isfinite(r.net_seconds)
        net = f"{r.net_seconds * 1e6:.1f}" if resolved else "-"
        bandwidth = f"{r.gb_per_s:.1f} | {100 * r.gb_per_s * 1e9 / copy_bw:.0f}" if resolved else "- | -"
        out.append(f"| {r.kernel} | {r.shape} | {r.impl} | {r.seconds * 1e6:.1f} | {r.harness_seconds * 1e6:.1f} | "
                   f"{net} | {bandwidth} | {err} |")
    heading = "Goals (measured):" if on_gpu else "Goals (CPU run: the numbers below do NOT measure them):"
    out += ["", heading] + [f"- {line}" for line in goals] + [""]
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="write the markdown table here (default on GPU: experiments/results/)")
    parser.add_argument("--budget-s", type=float, default=360.0,
                        help="start no new row after this many seconds; later rows are listed as skipped")
    cli = parser.parse_args()
    on_gpu = jax.default_backend() == "gpu"
    cfg = GPU if on_gpu else CPU
    device = jax.devices()[0].device_kind
    if not on_gpu:
        print(f"No GPU ({device}): tiny shapes, backends 'interpret' and 'xla'. CPU times are NOT kernel performance.")
    out = cli.out
    if out is None and on_gpu:
        safe_device = "".join(c if c.isalnum() else "-" for c in device)
        out = RESULTS_DIR / f"gpu_kernels-{safe_device}-{datetime.date.today().isoformat()}.md"
    key = jax.random.key(0)
    start = time.perf_counter()
    bench = Bench(cfg, cli.budget_s)
    copy_bw = copy_bandwidth(cfg)
    # The matmuls first: few rows, so a tight budget cannot skip the INT4 goal.
    for part in (int4_rows, moe_rows, gqa_rows, mla_rows):
        key, sub = jax.random.split(key)
        part(bench, sub)
        print(f"{part.__name__} done after {time.perf_counter() - start:.0f} s", flush=True)
        text = markdown(bench.rows, copy_bw, goal_lines(bench.rows, copy_bw, cfg.kernel_backend), device, on_gpu)
        if out is not None:  # after every part, so a run killed later still leaves a table
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(text)
    print(text)
    if out is not None:
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
