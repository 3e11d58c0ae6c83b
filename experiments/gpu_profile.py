"""Nsight Compute counters for the Pallas kernels at serving shapes: what the
warps wait on, beside how long they take.

    python experiments/gpu_profile.py --out DIR    # on a machine with a CUDA GPU and ncu

The CUPTI times of gpu_kernels.py say how long each kernel takes, and the
offline SASS counts (sm90_compile.py --sass) how much it issues; from those
two the notes infer that the kernels are latency-bound. This measures it. The
script runs itself under `ncu` (--child), which calls each case below once, so
each profiled launch is one case, in order. ncu replays each launch once per
metric pass, with caches flushed before each pass (cold L2, as in the
benchmark) and the clocks left as they are (--clock-control none).

Writes DIR/gpu_profile.md, a row per case: duration, DRAM throughput,
occupancy (achieved and theoretical), issue-slot use, eligible warps per
scheduler, and the largest stall reasons; and DIR/gpu_profile_raw_PART.csv,
every metric ncu collected, so one this table does not pick is still there.
Each part (INT4, GQA, MLA) is its own ncu run and both files are written
after each, so a time limit costs only the parts it cuts off. ncu
needs hardware counters: on a runtime without them it fails, and so does this.
"""

import argparse
import csv
import dataclasses
import datetime
import functools
import io
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterator, NamedTuple

_STARTED = time.monotonic()  # before JAX's import, which --timeout-s counts too

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from experiments import gpu_kernels as gk  # noqa: E402
from pallas_kernels import AttentionTuning, Int4Tuning, int4_matmul  # noqa: E402

# Every kernel this profiles; ncu leaves other launches (XLA's) alone.
KERNEL_REGEX = "regex:^(int4_matmul|paged_attention)"
SECTIONS = ("SpeedOfLight", "LaunchStats", "Occupancy", "SchedulerStats", "WarpStateStats", "MemoryWorkloadAnalysis")
# The defaults, and beside each the sweep's leading candidate for its goal. INT4:
# swap_ab=False (the pair-order kernel in x's orientation: its stalls with the
# weights' shared-memory round trip at M=64) replaced gather_x with
# block_n=64, whose run-3 profile was the slowest at M=64 (30 us).
# Attention: swap_pv (the values product as wgmma; 12-16% fewer loop
# instructions, not fewer shared-memory loads) and MLA at 16 warps (twice the
# warps per scheduler) replaced GQA prefetch, MLA block_tokens=32 (both timed
# slower than the defaults in runs 3-4) and MLA prefetch (as fast), all three
# profiled in run 3.
INT4_PROFILED = (Int4Tuning(), Int4Tuning(block_k=128), Int4Tuning(swap_ab=False))
GQA_PROFILED = (AttentionTuning(), AttentionTuning(swap_pv=True))
MLA_PROFILED = (AttentionTuning(), AttentionTuning(swap_pv=True), AttentionTuning(num_warps=16))


class Call(NamedTuple):
    label: str
    kernel: str  # the start of the kernel's name, as ncu reports it
    fn: Callable
    args: tuple


def int4_calls(cfg: gk.Config, key) -> Iterator[Call]:
    k, g = cfg.matmul_k, cfg.group_size
    kw, key = jax.random.split(key)
    packed, scales, _ = gk._int4_weights(kw, (), k, cfg.matmul_n, g)
    for m in (min(cfg.matmul_ms), max(cfg.matmul_ms)):
        kx, key = jax.random.split(key)
        x = jax.random.normal(kx, (m, k), jnp.bfloat16)
        for tuning in INT4_PROFILED:
            yield Call(f"INT4 matmul M={m} g={g} {gk.tuning_label(tuning)}", "int4_matmul",
                       functools.partial(int4_matmul, group_size=g, backend=cfg.kernel_backend, tuning=tuning),
                       (x, packed, scales))


def gqa_calls(cfg: gk.Config, key) -> Iterator[Call]:
    for batch, context, tunings, with_peer in ((max(cfg.batches), max(cfg.contexts), GQA_PROFILED, True),
                                               (min(cfg.batches), min(cfg.contexts), GQA_PROFILED[:1], False)):
        key, sub = jax.random.split(key)
        case = gk._gqa_case(cfg, sub, batch, context)
        shape = f"B={batch} ctx={context}"
        kp, vp, ks = case.pages["fp8"]
        for tuning in tunings:
            yield Call(f"GQA fp8 {shape} {gk.tuning_label(tuning)}", "paged_attention_gqa",
                       functools.partial(gk._gqa_op(cfg, ks, tuning), backend=cfg.kernel_backend),
                       (case.q, kp, vp, case.table, case.lengths))
        if with_peer and gk.jax_paged is not None:
            kp, vp, ks = case.pages["bf16"]
            yield Call(f"GQA bf16 {shape} JAX paged_attention", "paged_attention_block",
                       gk.jax_paged_call("bf16", kp, case.table, ks, interpret=not cfg.on_gpu),
                       (case.q * cfg.gqa_head_dim**-0.5, kp, vp, case.table, case.lengths))
        del case, kp, vp


def mla_calls(cfg: gk.Config, key) -> Iterator[Call]:
    for batch, tunings in ((max(cfg.batches), MLA_PROFILED), (min(cfg.batches), MLA_PROFILED[:1])):
        key, sub = jax.random.split(key)
        context = max(cfg.contexts)
        case = gk._mla_case(cfg, sub, batch, context, names=("fp8",))
        pages, sc = case.pages["fp8"]
        for tuning in tunings:
            yield Call(f"MLA fp8 B={batch} ctx={context} {gk.tuning_label(tuning)}", "paged_attention_mla",
                       functools.partial(gk._mla_op(cfg, sc, tuning), backend=cfg.kernel_backend),
                       (case.q, pages, case.table, case.lengths))
        del case, pages


# Each part is profiled by its own ncu run, in this order, so that a part cut
# off at the time limit loses only its own launches (ncu writes its report
# when the process it profiles exits). Inputs are built only when reached, so
# at most one shape's pages are alive at a time.
PARTS: dict[str, Callable[[gk.Config, jax.Array], Iterator[Call]]] = {
    "int4": int4_calls, "gqa": gqa_calls, "mla": mla_calls}


def profiled_calls(cfg: gk.Config, key) -> Iterator[Call]:
    """Every part's cases, in launch order."""
    for i, calls in enumerate(PARTS.values()):
        yield from calls(cfg, jax.random.fold_in(key, i))


def run_child(manifest: Path, part: str) -> None:
    """Under ncu: each case of the part once (its first call compiles, then launches once)."""
    cfg = gk.GPU if jax.default_backend() == "gpu" else gk.CPU
    with manifest.open("w") as log:
        for call in PARTS[part](cfg, jax.random.fold_in(jax.random.key(0), list(PARTS).index(part))):
            try:
                jax.block_until_ready(call.fn(*call.args))
                status = "ran"
            except Exception as error:  # recorded; the other cases still run
                status = "FAILED: " + " ".join(f"{type(error).__name__}: {error}".split())[:300]
            print(call.label, status, flush=True)
            log.write(json.dumps({"label": call.label, "kernel": call.kernel, "status": status}) + "\n")
            log.flush()


# ---- reading ncu's raw CSV (ncu --import R --csv --page raw --print-units base)

Record = dict[str, tuple[str, str]]  # metric -> (value as printed, unit)


def ncu_records(text: str) -> list[Record]:
    """One dict per profiled launch. The header is the first row naming
    "Kernel Name"; a units row may follow it (its ID column is empty)."""
    rows = list(csv.reader(io.StringIO(text)))
    start = next(i for i, row in enumerate(rows) if "Kernel Name" in row)
    header, body = rows[start], rows[start + 1:]
    units = [""] * len(header)
    if body and not body[0][0].strip().isdigit():
        units, body = body[0], body[1:]
    return [{name: (value, unit) for name, value, unit in zip(header, row, units)}
            for row in body if len(row) == len(header)]


# Units as ncu 2025's --print-units base prints them (H200, 2026-11-30: "ns",
# "byte/s"), and the long forms of older versions ("nsecond").
_UNITS = {
    "second": {"ns": 1e-9, "nsecond": 1e-9, "us": 1e-6, "usecond": 1e-6, "ms": 1e-3, "msecond": 1e-3,
               "s": 1.0, "second": 1.0},
    "byte/s": {f"{prefix}byte/{per}": scale for prefix, scale in (("", 1.0), ("K", 1e3), ("M", 1e6), ("G", 1e9),
                                                                   ("T", 1e12)) for per in ("s", "second")},
}


def number(record: Record, *names: str, base: str = "") -> float:
    """The first of names that the record has, as a float; with base ("second",
    "byte/s"), converted from the record's unit (ns, Gbyte/s) to that base; an
    unknown unit gives NaN rather than a number off by its prefix."""
    for name in names:
        if name in record:
            text, unit = record[name]
            try:
                value = float(text.replace(",", ""))
            except ValueError:
                return math.nan
            if base:
                value *= _UNITS[base].get(unit, math.nan)
            return value
    return math.nan


_STALL = re.compile(r"^smsp__average_warps_issue_stalled_(\w+?)_per_issue_active\.ratio$")


@dataclasses.dataclass(frozen=True)
class KernelProfile:
    name: str
    grid: str
    block: str
    registers: float
    waves: float  # per SM
    seconds: float
    dram_pct: float  # of peak, over the kernel's duration
    dram_bytes_per_s: float  # read + written, over the kernel's duration
    achieved_occupancy: float  # % of the SM's warp slots
    theoretical_occupancy: float
    issue_pct: float  # issue slots used
    eligible: float  # warps ready to issue per scheduler per cycle
    stalls: tuple[tuple[str, float], ...]  # (reason, warps stalled on it per issued instruction), largest first

    @classmethod
    def of(cls, r: Record) -> "KernelProfile":
        stalls = [(m.group(1), number(r, name)) for name in r if (m := _STALL.match(name))]
        stalls = tuple(sorted(((k, v) for k, v in stalls if math.isfinite(v)), key=lambda kv: -kv[1]))
        return cls(
            name=r.get("Kernel Name", ("?", ""))[0], grid=r.get("Grid Size", ("?", ""))[0],
            block=r.get("Block Size", ("?", ""))[0],
            registers=number(r, "launch__registers_per_thread"), waves=number(r, "launch__waves_per_multiprocessor"),
            seconds=number(r, "gpu__time_duration.sum", base="second"),
            dram_pct=number(r, "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed",
                            "dram__throughput.avg.pct_of_peak_sustained_elapsed"),
            dram_bytes_per_s=number(r, "dram__bytes.sum.per_second", base="byte/s"),
            achieved_occupancy=number(r, "sm__warps_active.avg.pct_of_peak_sustained_active"),
            theoretical_occupancy=number(r, "sm__maximum_warps_per_active_cycle_pct"),
            issue_pct=number(r, "smsp__issue_active.avg.pct_of_peak_sustained_active"),
            eligible=number(r, "smsp__warps_eligible.avg.per_cycle_active"),
            stalls=stalls)

    def row(self, label: str) -> str:
        stalls = ", ".join(f"{k} {v:.1f}" for k, v in self.stalls[:4]) or "-"
        gb_s = self.dram_bytes_per_s / 1e9
        return (f"| {label} | {self.name} | {self.grid} x {self.block} | {self.registers:.0f} | {self.waves:.2f} | "
                f"{self.seconds * 1e6:.1f} | {self.dram_pct:.0f} | {gb_s:.0f} | {self.achieved_occupancy:.0f} "
                f"({self.theoretical_occupancy:.0f}) | {self.issue_pct:.0f} | {self.eligible:.2f} | {stalls} |")


def case_rows(manifest: list[dict], profiles: list[KernelProfile]) -> list[str]:
    """A row per case, pairing the manifest's cases that ran with ncu's launches in order."""
    lines = []
    launches = iter(profiles)
    for case in manifest:
        if case["status"] != "ran":
            lines.append(f"| {case['label']} | {case['status']} |")
            continue
        profile = next(launches, None)
        if profile is None or not profile.name.startswith(case["kernel"]):
            found = profile.name if profile else "no launch"
            lines.append(f"| {case['label']} | unmatched: expected {case['kernel']}, ncu's next launch is {found} |")
            return lines  # the order is lost from here on: the raw CSV has the rest
        lines.append(profile.row(case["label"]))
    extra = list(launches)
    if extra:
        lines.append(f"| {len(extra)} more profiled launch(es) than cases: see the raw CSV |")
    return lines


def table(rows: list[str], device: str, stamp: str) -> str:
    return "\n".join([
        f"# Nsight Compute profile of the Pallas kernels on {device}, {stamp}", "",
        "One launch per case, cold L2 (ncu flushes caches before each replay pass), clocks as they are. "
        "Occupancy: % of the SM's 64 warp slots, achieved (theoretical). Stalls: warps waiting on each reason "
        "per issued instruction (ncu's smsp__average_warps_issue_stalled_*), the largest four.", "",
        "| case | kernel | grid x block | regs | waves/SM | us | DRAM % peak | DRAM GB/s | occupancy % | "
        "issue % | eligible/cycle | stalls |",
        "|---|---|---|---:|---:|---:|---:|---:|---|---:|---:|---|", *rows]) + "\n"


def markdown(manifest: list[dict], profiles: list[KernelProfile], device: str, stamp: str) -> str:
    """The table of one ncu run."""
    return table(case_rows(manifest, profiles), device, stamp)


def find_ncu() -> Path | None:
    on_path = shutil.which("ncu")
    found = [Path(on_path)] if on_path else []
    found += sorted(Path("/opt/nvidia").glob("nsight-compute/*/ncu"), reverse=True)
    found += [Path("/usr/local/cuda/bin/ncu")]
    return next((path for path in found if path.is_file()), None)


def profile_part(ncu: Path, part: str, tmp: Path, deadline: float) -> tuple[list[dict], str, int]:
    """(the part's manifest, ncu's raw CSV, ncu's exit code); raises
    subprocess.TimeoutExpired at the deadline (time.monotonic()), after
    killing ncu and what it profiles."""
    manifest, report = tmp / f"manifest_{part}.jsonl", tmp / f"profile_{part}"
    sections = [arg for section in SECTIONS for arg in ("--section", section)]
    profiled = subprocess.Popen([str(ncu), "--clock-control", "none", "--target-processes", "all",
                                 "--kernel-name", KERNEL_REGEX, *sections, "-f", "-o", str(report),
                                 sys.executable, str(Path(__file__).resolve()), "--child", str(manifest),
                                 "--part", part],
                                start_new_session=True)
    try:
        profiled.wait(timeout=max(0.0, deadline - time.monotonic()))
    finally:  # ncu and the process it profiles go together, so nothing outlives this step on the GPU
        if profiled.poll() is None:
            os.killpg(profiled.pid, signal.SIGKILL)
            profiled.wait()
    report_file = report.with_name(report.name + ".ncu-rep")
    if profiled.returncode and not report_file.exists():
        raise RuntimeError(f"ncu exited with {profiled.returncode}")
    raw = subprocess.run([str(ncu), "--import", str(report_file), "--csv", "--page", "raw", "--print-units", "base"],
                         capture_output=True, text=True, check=True,
                         timeout=max(1.0, deadline - time.monotonic())).stdout
    return [json.loads(line) for line in manifest.read_text().splitlines()], raw, profiled.returncode


def profile(ncu: Path, out: Path, device: str, timeout_s: float) -> tuple[str, bool]:
    """Profiles PARTS in turn within timeout_s in all; after each part writes
    out/gpu_profile.md and out/gpu_profile_raw_PART.csv. Returns (the table,
    whether every part was profiled)."""
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    out.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + timeout_s
    rows: list[str] = []
    complete = True
    with tempfile.TemporaryDirectory() as tmp:
        for part in PARTS:
            try:
                if time.monotonic() >= deadline:
                    raise subprocess.TimeoutExpired(part, 0)
                manifest, raw, returncode = profile_part(ncu, part, Path(tmp), deadline)
            except subprocess.TimeoutExpired:
                rows.append(f"| {part}: not profiled, the {timeout_s:.0f} s limit was reached |")
                complete = False
            except Exception as error:  # reported; the next part still runs
                rows.append(f"| {part}: {' '.join(f'{type(error).__name__}: {error}'.split())[:300]} |")
                complete = False
            else:
                (out / f"gpu_profile_raw_{part}.csv").write_text(raw)
                rows += case_rows(manifest, [KernelProfile.of(r) for r in ncu_records(raw)])
                if returncode:
                    rows.append(f"| {part}: ncu exited with {returncode} after writing its report |")
                    complete = False
            text = table(rows, device, stamp)
            (out / "gpu_profile.md").write_text(text)
    return text, complete


def unwind_on_sigterm() -> None:
    """`timeout` stops this with SIGTERM, whose default action skips the
    `finally` in profile_part that kills ncu (in its own session, so the
    signal does not reach it). Raise instead, so that the `finally` runs."""
    def stop(signum, frame):
        raise SystemExit(f"stopped by signal {signum}")

    signal.signal(signal.SIGTERM, stop)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="folder for gpu_profile.md and gpu_profile_raw_PART.csv")
    parser.add_argument("--timeout-s", type=float, default=80.0, help="stop ncu (and what it profiles) this many seconds after this script starts")
    parser.add_argument("--child", type=Path, metavar="MANIFEST", help=argparse.SUPPRESS)  # the process ncu profiles
    parser.add_argument("--part", choices=list(PARTS), help=argparse.SUPPRESS)  # the child's part
    cli = parser.parse_args()
    if cli.child:
        run_child(cli.child, cli.part)
        return
    if cli.out is None:
        parser.error("--out is required")
    ncu = find_ncu()
    if ncu is None or jax.default_backend() != "gpu":
        raise SystemExit(f"needs ncu and a CUDA GPU (ncu: {ncu}, jax backend: {jax.default_backend()})")
    unwind_on_sigterm()
    left = cli.timeout_s - (time.monotonic() - _STARTED)  # the limit counts from this process's start
    text, complete = profile(ncu, cli.out, jax.devices()[0].device_kind, left)
    print(text)
    if not complete:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
