"""Backend selection shared by every public op in `pallas_kernels`.

Each op has a plain jnp reference ("xla") and a Pallas kernel. The kernel runs
compiled on an NVIDIA GPU ("pallas") or in the Pallas interpreter
("interpret"), which executes the same kernel body with jnp on any device and
is how CI (CPU only) tests the kernels.
"""

import dataclasses
import importlib.metadata
from typing import Literal, get_args

import jax

Backend = Literal["xla", "pallas", "interpret"]
BACKENDS: tuple[str, ...] = get_args(Backend)


def resolve_backend(backend: str | None) -> str:
    """Maps None / "auto" to "pallas" on GPU and "xla" elsewhere.

    Raises ValueError for a name that is not a backend, so a typo never silently
    falls back to a slow or untested path.
    """
    if backend is None or backend == "auto":
        return "pallas" if jax.default_backend() == "gpu" else "xla"
    if backend not in BACKENDS:
        raise ValueError(
            f"unknown backend {backend!r}; expected one of {BACKENDS} or 'auto'/None"
        )
    return backend


_TRITON_CALL = "__gpu$xla.gpu.triton"


def _export_for_cuda(fn, arg_specs):
    from jax import export  # Only the CUDA lowering helpers need it.

    triton_call = export.DisabledSafetyCheck.custom_call(_TRITON_CALL)
    return export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=[triton_call])(*arg_specs)


def lower_for_cuda(fn, *arg_specs: jax.ShapeDtypeStruct) -> str:
    """MLIR text of `fn` lowered for an NVIDIA GPU, on any host (no GPU needed).

    This runs the Pallas -> Triton IR lowering of every kernel inside `fn` (the
    step that rejects non-power-of-two blocks, unsupported dtypes and ops), so
    CPU-only CI catches kernels that could not run on GPU. It does not run
    Triton's own compiler to PTX: `triton_kernels_for_cuda` hands the Triton IR
    to that compiler (experiments/sm90_compile.py).
    """
    return _export_for_cuda(fn, arg_specs).mlir_module()


@dataclasses.dataclass(frozen=True)
class TritonKernelIR:
    """One Pallas kernel of a CUDA lowering, as Triton will compile it."""

    name: str
    ttir: str  # Triton-dialect MLIR text (what Triton's make_ttir stage reads)
    num_warps: int
    num_stages: int
    grid: tuple[int, int, int]


def triton_kernels_for_cuda(fn, *arg_specs: jax.ShapeDtypeStruct) -> list[TritonKernelIR]:
    """The Triton IR and launch parameters of every Pallas kernel in `fn`.

    jaxlib <= 0.10.2 embeds each kernel's Triton IR (MLIR bytecode) in a custom
    call that XLA compiles; this reads it back out, so that a real Triton can
    compile it for sm_90 on a machine without a GPU. Newer jaxlibs compile to
    PTX during lowering instead (which needs their CUDA plugin): there this
    raises, naming the version. Uses jax internals (the MLIR context and the
    Triton dialect registration), as the lowering itself does.
    """
    from jax._src.interpreters import mlir as jax_mlir
    from jax._src.lib import triton as jax_triton
    from jax._src.lib.mlir import ir

    text = lower_for_cuda(fn, *arg_specs)
    context = jax_mlir.make_ir_context()
    jax_triton.dialect.register_dialect(context)
    kernels = []
    with context:
        for op in _walk(ir.Module.parse(text).operation):
            if op.name != "stablehlo.custom_call" or ir.StringAttr(op.attributes["call_target_name"]).value != _TRITON_CALL:
                continue
            config = ir.DictAttr(op.attributes["mhlo.backend_config"])
            number = lambda key: ir.IntegerAttr(config[key]).value
            ttir = ir.Module.parse(ir.StringAttr(config["ir"]).value_bytes).operation.get_asm()
            kernels.append(TritonKernelIR(
                ir.StringAttr(config["name"]).value, ttir, number("num_warps"), number("num_stages"),
                (number("grid_x"), number("grid_y"), number("grid_z"))))
    if not kernels:
        raise RuntimeError(
            f"no {_TRITON_CALL} custom call in the CUDA lowering: either fn has no Pallas kernel, or this "
            f"jaxlib ({importlib.metadata.version('jaxlib')}) compiles kernels during lowering (jaxlib > 0.10.2)")
    return kernels


def _walk(op):
    for region in op.regions:
        for block in region:
            for child in block.operations:
                yield child.operation
                yield from _walk(child.operation)
