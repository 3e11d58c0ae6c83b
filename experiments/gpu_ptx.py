"""The Pallas kernels as the GPU machine's own jaxlib compiles them: registers,
spills, shared memory and inner-loop instructions, to check the predictions
of experiments/sm90_compile.py (made on CPU with a pip Triton 3.6).

    python experiments/gpu_ptx.py --out PATH      # on a machine with a CUDA GPU

jax 0.10.2's pallas_call lowering compiles each Triton kernel to PTX in
Python (`jax._src.lib.triton.compile`) when its jaxlib is newer than 0.10.2.
jax 0.11.2 (the lent H200's, 2026-11-30) has no such call (its lowering
module has no `triton`): the kernels compile out of Python's reach, and this
script can only say so. Where the call exists,
this keeps that PTX, assembles it with `ptxas -v` and disassembles it with
cuobjdump, and reports per kernel what sm90_compile.md and sm90_sass.md
report for the same shapes. It lowers only (nothing runs on the GPU).
"""

import argparse
import dataclasses
import datetime
import importlib.util
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from unittest import mock

import jax

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from experiments.gpu_kernels import GPU  # noqa: E402
from experiments.sass_loop import SASS_KINDS, LoopMix, ptx_target, ptx_warps, ptxas_usage  # noqa: E402
from experiments.sm90_compile import Case, Compiled, cases  # noqa: E402

# The serving-shape kernels whose offline numbers the notes lean on.
CHECKED = ("GQA fp8 | B=64 ctx=4096", "GQA fp8 f16-dots | B=64 ctx=4096", "GQA fp8 prefetch | B=64 ctx=4096",
           "MLA fp8 | B=64 ctx=4096", "MLA fp8 block-32 | B=64 ctx=4096", "INT4 matmul | M=1 g=32",
           "INT4 matmul | M=64 g=32", "INT4 matmul gather-x | M=1 g=32", "INT4 matmul block_k=128 | M=64 g=32")


@dataclasses.dataclass(frozen=True)
class KernelPtx:
    ptx: str
    smem: int  # bytes, as jaxlib's compile reports them
    num_warps: int
    num_stages: int


def compiled_ptx(case: Case) -> list[KernelPtx]:
    """The PTX of every Pallas kernel in case.fn, from jaxlib's own Triton compile."""
    from jax._src.pallas.triton import pallas_call_registration as registration

    kept: list[KernelPtx] = []
    jaxlib_compile = registration.triton.compile

    def keep(*args, **kwargs):
        result = jaxlib_compile(*args, **kwargs)
        # Stages only reach the compile as an argument (0: not passed by this jaxlib's lowering).
        kept.append(KernelPtx(result.asm, result.smem_bytes, ptx_warps(result.asm), kwargs.get("num_stages", 0)))
        return result

    jax.clear_caches()  # lower afresh, so that the compile runs (and is kept) every time
    with mock.patch.object(registration.triton, "compile", keep):
        jax.jit(case.fn).lower(*case.specs)
    return kept


def cuda_tool(name: str) -> list[Path]:
    """Candidates for a CUDA binary: JAX's CUDA wheels (the toolkit its PTX was
    made for) first, then Triton's, then PATH and /usr/local/cuda."""
    found = []
    for package in ("nvidia.cuda_nvcc", "nvidia.cu13", "nvidia.cu12", "triton"):
        try:
            spec = importlib.util.find_spec(package)
        except ModuleNotFoundError:
            spec = None
        for root in (spec.submodule_search_locations or []) if spec else []:
            found += sorted(Path(root).rglob(f"bin/{name}"))
    on_path = shutil.which(name)
    found += [Path(on_path)] if on_path else []
    found += [Path("/usr/local/cuda/bin") / name]
    return [path for path in dict.fromkeys(found) if path.is_file()]


def assemble(kernel: KernelPtx, tmp: str) -> tuple[Compiled, LoopMix | None, str]:
    """(ptxas -v usage, the SASS inner loop if cuobjdump is found, which ptxas)."""
    ptx = Path(tmp) / "kernel.ptx"
    ptx.write_text(kernel.ptx)
    cubin = Path(tmp) / "kernel.cubin"
    errors = []
    for ptxas in cuda_tool("ptxas"):
        run = subprocess.run([str(ptxas), f"--gpu-name={ptx_target(kernel.ptx)}", "-v", str(ptx), "-o", str(cubin)],
                             capture_output=True, text=True)
        if run.returncode:
            errors.append(f"{ptxas}: {run.stderr.strip()[:200]}")
            continue
        registers, spill_bytes = ptxas_usage(run.stderr)
        usage = Compiled(kernel.num_warps, kernel.num_stages, registers, spill_bytes, kernel.smem, 0.0)
        cuobjdump = ptxas.with_name("cuobjdump")
        if not cuobjdump.is_file():
            return usage, None, str(ptxas)
        sass = subprocess.run([str(cuobjdump), "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
        return usage, LoopMix.of(sass), str(ptxas)
    raise RuntimeError("no ptxas assembled the PTX: " + ("; ".join(errors) or "none found"))


def table_row(case: Case, usage: Compiled, mix: LoopMix | None) -> str:
    blocks, limiter = usage.blocks_per_sm()
    loop = ("no loop" if not mix.instructions else f"{mix.instructions} | {mix.fast_path} | " + " | ".join(
        str(mix.kinds[k]) for k in SASS_KINDS)) if mix else "no cuobjdump"
    return (f"| {case.kernel} | {case.shape} | {usage.num_warps} | {usage.num_stages} | {usage.registers} | "
            f"{usage.spill_bytes} | {usage.smem / 1024:.1f} | {blocks} ({limiter}) | {loop} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    cli = parser.parse_args()
    if jax.default_backend() != "gpu":
        raise SystemExit(f"needs a CUDA GPU (jax backend here: {jax.default_backend()})")
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [f"# Pallas kernels as compiled on {jax.devices()[0].device_kind}, {stamp}", "",
             f"jax {jax.__version__}: the PTX of jaxlib's Triton compile, through ptxas -v and cuobjdump. "
             "Compare with experiments/results/sm90_compile.md and sm90_sass.md (same shapes, offline).", "",
             "| kernel | shape | warps | stages | regs | spill B | smem KiB | blocks/SM | loop instrs | fast path | "
             + " | ".join(SASS_KINDS) + " |",
             "|---|---|---:|---:|---:|---:|---:|---|---:|---:|" + "---:|" * len(SASS_KINDS)]
    from jax._src.pallas.triton import pallas_call_registration as registration
    if not hasattr(registration, "triton"):
        # jax 0.11.2 on the H200 (2026-11-30): the lowering hands Triton IR to
        # XLA's custom call, which compiles it out of Python's reach.
        lines = lines[:4] + [f"Not measured: jax {jax.__version__} compiles Pallas Triton kernels inside XLA, "
                             "with no Python-side compile to read the PTX from. The offline sm_90a compiles "
                             "(experiments/sm90_compile.py) are what there is.", ""]
        cli.out.parent.mkdir(parents=True, exist_ok=True)
        cli.out.write_text("\n".join(lines))
        print(lines[-2])
        return
    tools = set()
    for case in cases(GPU):
        if f"{case.kernel} | {case.shape}" not in CHECKED:
            continue
        try:
            with tempfile.TemporaryDirectory() as tmp:
                for kernel in compiled_ptx(case):
                    usage, mix, ptxas = assemble(kernel, tmp)
                    tools.add(ptxas)
                    lines.append(table_row(case, usage, mix))
        except Exception as error:  # a failure is a row, and the other kernels still report
            lines.append(f"| {case.kernel} | {case.shape} | FAILED: {' '.join(str(error).split())[:300]} |")
        print(lines[-1], flush=True)
    lines += ["", "ptxas: " + (", ".join(sorted(tools)) or "none"), ""]
    cli.out.parent.mkdir(parents=True, exist_ok=True)
    cli.out.write_text("\n".join(lines))
    print(f"wrote {cli.out}")


if __name__ == "__main__":
    main()
