"""Backend selection shared by every public op in `pallas_kernels`.

Each op has a plain jnp reference ("xla") and a Pallas kernel. The kernel runs
compiled on an NVIDIA GPU ("pallas") or in the Pallas interpreter
("interpret"), which executes the same kernel body with jnp on any device and
is how CI (CPU only) tests the kernels.
"""

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


def lower_for_cuda(fn, *arg_specs: jax.ShapeDtypeStruct) -> str:
    """MLIR text of `fn` lowered for an NVIDIA GPU, on any host (no GPU needed).

    This runs the Pallas -> Triton IR lowering of every kernel inside `fn` (the
    step that rejects non-power-of-two blocks, unsupported dtypes and ops), so
    CPU-only CI catches kernels that could not run on GPU. It does not run
    Triton's own compiler to PTX, which needs the CUDA jaxlib plugin.
    """
    from jax import export  # Only this helper needs it.

    triton_call = export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")
    exported = export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=[triton_call])(*arg_specs)
    return exported.mlir_module()
