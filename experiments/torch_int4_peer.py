"""PyTorch's own W4A16 kernel beside a bf16 cuBLAS matmul, at the benchmark's INT4 shapes.

    python experiments/torch_int4_peer.py [--out PATH]

Why: the issue's INT4 goals (>= 3.3x bf16 at M=1, >= 1.5x at M=64) are
ratios against a bf16 matmul on the same device. This measures what a
production W4A16 CUDA kernel reaches on the same device, at the same shapes
and with weights drawn the same way: tinygemm, `torch.ops.aten._weight_int4pack_mm`,
the int4 weight-only path of gpt-fast and torchao. Its ratio against cuBLAS
(`torch.nn.functional.linear` in bf16) says how much of a goal is reachable
at this shape at all; gpu_kernels.py gives ours against `jnp.dot`.

Weights: drawn as experiments/gpu_kernels.py draws its INT4 weights (random
values in [-8, 7], group scales), packed by pallas_kernels.pack_int4 and converted to tinygemm's
input: tinygemm dequantizes (q - 8) * scale + zero with q the stored nibble,
and our nibble is value + 8, so zero = 0 makes the two formats the same
numbers (the scales are shared as they are). Every row is checked against a
float64 dequantize-then-dot before it is timed; over 1e-2 relative (the
issue's bf16 bound) it is reported WRONG and not timed.

Timing on a GPU, two ways in the same run, the variants interleaved per sample:
  * kernels: torch.profiler's CUDA records (CUPTI), every kernel a call
    launches, summed; the method of gpu_kernels.py (launch gaps excluded);
    one profiler session per shape (see _kernel_us);
  * graph: a CUDA graph of the calls, replayed, timed with CUDA events
    (launch gaps included).
Each sample calls the op on `copies` copies of its weights in turn, together
>= 256 MB, so no call finds its weights in L2; per call = sample / copies,
median over samples.

Without a GPU it runs tiny shapes through tinygemm's CPU version, so that the
script keeps working; those times say nothing about the GPU.
"""

import argparse
import datetime
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, NamedTuple

os.environ["JAX_PLATFORMS"] = "cpu"  # JAX only builds the weights; the GPU is torch's

import jax  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from experiments.gpu_kernels import CPU, GPU, RESULTS_DIR, Config, _int4_weights, copies_for  # noqa: E402
from pallas_kernels.int4_matmul import unpack_int4  # noqa: E402

GROUPS = (32, 128)  # the group sizes
INNER_K_TILES = 8  # tinygemm's widest (16-byte) weight loads, as gpt-fast uses
BOUND = 1e-2  # relative Frobenius error against float64 (the INT4 bound)


class Weights(NamedTuple):
    values_NK: np.ndarray  # int8 in [-8, 7], [N, K] (torch's nn.Linear layout)
    scales_GN: np.ndarray  # float32 holding bf16 values, [K/g, N]
    group: int


def benchmark_weights(cfg: Config, group: int, seed: int = 0) -> Weights:
    """INT4 weights drawn as gpu_kernels.py draws them, through our packed layout."""
    packed_QN, scales_GN, _ = _int4_weights(jax.random.key(seed), (), cfg.matmul_k, cfg.matmul_n, group)
    values_KN = np.asarray(unpack_int4(packed_QN))
    return Weights(np.ascontiguousarray(values_KN.T), np.array(scales_GN.astype(np.float32)), group)


def tinygemm_operands(w: Weights, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed weight, qScaleAndZeros [K/g, N, 2]) for _weight_int4pack_mm on `device`.

    The CUDA converter takes uint8 [N, K/2] with the even k in the high nibble
    (aten/src/ATen/native/cuda/int4mm.cu, matrix_to_m16n8k16_Bint4_layout);
    the CPU one takes the int32 nibbles [N, K].
    """
    q_NK = torch.from_numpy(w.values_NK.astype(np.int32) + 8)
    scales = torch.from_numpy(w.scales_GN).to(torch.bfloat16)
    scale_and_zero = torch.stack([scales, torch.zeros_like(scales)], dim=-1).contiguous().to(device)
    if device.type == "cuda":
        pairs = (q_NK[:, 0::2] << 4 | q_NK[:, 1::2]).to(torch.uint8).contiguous()
        packed = torch.ops.aten._convert_weight_to_int4pack(pairs.to(device), INNER_K_TILES)
    else:
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q_NK.contiguous(), INNER_K_TILES)
    return packed, scale_and_zero


def tinygemm_call(device: torch.device, group: int) -> Callable:
    mm = torch.ops.aten._weight_int4pack_mm if device.type == "cuda" else torch.ops.aten._weight_int4pack_mm_for_cpu
    return lambda x, packed, scale_and_zero: mm(x, packed, group, scale_and_zero)


def dense_bf16(w: Weights) -> torch.Tensor:
    """The same weights dequantized to bf16, [N, K]: one rounding of value * scale."""
    scales_NK = np.repeat(w.scales_GN, w.group, axis=0).T
    return torch.from_numpy(w.values_NK.astype(np.float32) * scales_NK).to(torch.bfloat16)


def reference(x: torch.Tensor, w: Weights) -> np.ndarray:
    """float64 x @ dequantize(w)^T."""
    scales_NK = np.repeat(w.scales_GN.astype(np.float64), w.group, axis=0).T
    return x.double().cpu().numpy() @ (w.values_NK.astype(np.float64) * scales_NK).T


def relative_error(y: torch.Tensor, ref: np.ndarray) -> float:
    y64 = y.double().cpu().numpy()
    if not np.isfinite(y64).all():
        return float("inf")
    return float(np.linalg.norm(y64 - ref) / np.linalg.norm(ref))


class Timing(NamedTuple):
    kernel_us: float | None  # CUPTI kernel time per call (GPU), else None
    graph_us: float | None  # CUDA-graph replay per call (GPU), else None
    wall_us: float  # CPU: host wall time per call (meaningless for the GPU)


def time_interleaved(variants: dict[str, list[Callable[[], torch.Tensor]]], samples: int) -> dict[str, Timing]:
    """Median per-call time of each variant: its calls (one per weight copy) run
    in turn, the variants alternating within every sample (so drift in clocks
    or neighbours' load reaches all of them alike)."""
    for calls in variants.values():  # warm-up: tinygemm/cuBLAS handles, lazy module loads
        _run_all(calls)
        _run_all(calls)
    if not torch.cuda.is_available():
        walls: dict[str, list[float]] = {name: [] for name in variants}
        for _ in range(samples):
            for name, calls in variants.items():
                start = time.perf_counter()
                _run_all(calls)
                walls[name].append((time.perf_counter() - start) / len(calls) * 1e6)
        return {name: Timing(None, None, statistics.median(w)) for name, w in walls.items()}
    torch.cuda.synchronize()
    graphs = {}
    for name, calls in variants.items():
        graphs[name] = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graphs[name]):
            _run_all(calls)
    graph_us: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(samples):
        for name, calls in variants.items():
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            graphs[name].replay()
            end.record()
            end.synchronize()
            graph_us[name].append(begin.elapsed_time(end) * 1e3 / len(calls))
    kernel_us = _kernel_us(variants, samples)
    return {name: Timing(kernel_us[name], statistics.median(graph_us[name]), float("nan")) for name in variants}


def _run_all(calls: list[Callable[[], torch.Tensor]]) -> None:
    for call in calls:
        call()


_SAMPLE = "sample"  # record_function label prefix


def _kernel_us(variants: dict[str, list[Callable[[], torch.Tensor]]], samples: int) -> dict[str, float | None]:
    """Median per call of the CUDA activity (kernels, copies) each variant's
    calls launch, from one profiler session (CUPTI) for all samples: each
    sample runs inside a record_function range that ends with a synchronize,
    and owns the device records that start inside it. Sample 0 is dropped:
    records can go missing at the start of a session. A variant whose samples
    hold unequal record counts is not reported (None): a record went missing."""
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        for i in range(samples + 1):
            for name, calls in variants.items():
                with torch.profiler.record_function(f"{_SAMPLE} {i} {name}"):
                    _run_all(calls)
                    torch.cuda.synchronize()
    return split_samples(prof.events(), {name: len(calls) for name, calls in variants.items()}, samples)


def split_samples(events, calls_per_variant: dict[str, int], samples: int) -> dict[str, float | None]:
    """Median over samples 1..samples of each variant's device time per call
    (us), from the profiler's events: the device records that start inside
    the CPU range "sample i variant" belong to it."""
    cpu, cuda = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA
    windows = {e.name: e.time_range for e in events if e.name.startswith(_SAMPLE) and e.device_type == cpu}
    # GPU-side copies of the record_function ranges are CUDA events too: not activity.
    on_device = [e for e in events if e.device_type == cuda and not e.name.startswith(_SAMPLE)]
    result: dict[str, float | None] = {}
    for name, calls in calls_per_variant.items():
        counts, per_call = set(), []
        for i in range(1, samples + 1):
            window = windows.get(f"{_SAMPLE} {i} {name}")
            inside = [e for e in on_device if window and window.start <= e.time_range.start <= window.end]
            counts.add(len(inside))
            per_call.append(sum(e.time_range.elapsed_us() for e in inside) / calls)
        if len(counts) == 1 and 0 not in counts:
            result[name] = statistics.median(per_call)
        else:
            result[name] = None
            print(f"{name}: device records per sample {sorted(counts)} (unequal or none): kernel time not reported",
                  flush=True)
    return result


class Row(NamedTuple):
    m: int
    group: int
    impl: str
    error: float
    timing: Timing | None  # None: WRONG, not timed


def measure(cfg: Config, device: torch.device, samples: int,
            after_shape: Callable[[list[Row]], None] = lambda rows: None) -> list[Row]:
    """Rows per (group, M); after_shape(rows so far) runs after each shape."""
    rows: list[Row] = []
    gen = torch.Generator().manual_seed(0)
    for group in GROUPS:
        w = benchmark_weights(cfg, group)
        int4_ops = [tinygemm_operands(w, device)]
        dense = [dense_bf16(w).to(device)]
        int4_bytes = int4_ops[0][0].nbytes + int4_ops[0][1].nbytes
        # Copies of the weights, so a sample streams >= ROTATION_BYTES (cold L2).
        int4_ops += [tuple(t.clone() for t in int4_ops[0]) for _ in range(copies_for(int4_bytes) - 1)]
        dense += [dense[0].clone() for _ in range(copies_for(dense[0].nbytes) - 1)]
        tinygemm = tinygemm_call(device, group)
        linear = torch.nn.functional.linear
        for m in cfg.matmul_ms:
            x = torch.randn(m, cfg.matmul_k, generator=gen).to(torch.bfloat16).to(device)
            ref = reference(x, w)
            variants = {
                "tinygemm int4": [lambda ops=ops: tinygemm(x, *ops) for ops in int4_ops],
                "torch bf16 linear": [lambda d=d: linear(x, d) for d in dense],
            }
            errors = {name: relative_error(calls[0](), ref) for name, calls in variants.items()}
            timed = time_interleaved({name: calls for name, calls in variants.items() if errors[name] <= BOUND}, samples)
            for name in variants:
                rows.append(Row(m, group, name, errors[name], timed.get(name)))
                print(f"M={m} g={group} {name}: error {errors[name]:.2e} {timed.get(name)}", flush=True)
            after_shape(rows)
    return rows


def _us(value: float | None) -> str:
    return "" if value is None or value != value else f"{value:.1f}"


def _speedup(int4: Row, dense: Row) -> str:
    """dense time / int4 time: from the kernel records, else from the graph replays."""
    for field, note in (("kernel_us", ""), ("graph_us", " (graph)")):
        a = dense.timing and getattr(dense.timing, field)
        b = int4.timing and getattr(int4.timing, field)
        if a and b:
            return f"{a / b:.2f}x{note}"
    return ""


def markdown(rows: list[Row], cfg: Config, device_name: str, on_gpu: bool) -> str:
    lines = [f"# tinygemm W4A16 against bf16 cuBLAS, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
             "",
             f"Device: {device_name}; torch {torch.__version__}. Produced by `python experiments/torch_int4_peer.py`. "
             f"K={cfg.matmul_k} N={cfg.matmul_n}, bf16 activations, weights drawn as experiments/gpu_kernels.py draws them.",
             ""]
    if not on_gpu:
        lines += ["No GPU: tiny shapes through tinygemm's CPU version; the times say nothing about a GPU.", ""]
    lines += ["| M | group | impl | rel. error vs f64 | kernels us/call | graph us/call | host us/call | int4 speedup |",
              "|---:|---:|---|---:|---:|---:|---:|---:|"]
    by_key = {(r.m, r.group, r.impl): r for r in rows}
    for r in rows:
        dense = by_key.get((r.m, r.group, "torch bf16 linear"))
        speedup = _speedup(r, dense) if r.impl.startswith("tinygemm") and dense else ""
        if r.timing is None:
            cells = "WRONG, not timed | |"
        else:
            cells = f"{_us(r.timing.kernel_us)} | {_us(r.timing.graph_us)} | {_us(r.timing.wall_us)}"
        lines.append(f"| {r.m} | {r.group} | {r.impl} | {r.error:.2e} | {cells} | {speedup} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="markdown table (default on GPU: experiments/results/)")
    parser.add_argument("--samples", type=int, default=None)
    cli = parser.parse_args()
    on_gpu = torch.cuda.is_available()
    cfg = GPU if on_gpu else CPU
    device = torch.device("cuda" if on_gpu else "cpu")
    device_name = torch.cuda.get_device_name() if on_gpu else "CPU"
    out = cli.out
    if out is None and on_gpu:
        out = RESULTS_DIR / f"torch_int4_peer-{datetime.date.today().isoformat()}.md"

    def write(rows: list[Row]) -> None:  # after every shape: a timeout loses only the shape in flight
        if out is not None:
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(markdown(rows, cfg, device_name, on_gpu))

    rows = measure(cfg, device, cli.samples or cfg.samples, write)
    print(markdown(rows, cfg, device_name, on_gpu))
    if out is not None:
        print(f"wrote {out}")
    if any(r.timing is None for r in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
