import os
import shutil
import sys
import tempfile

# tests/ holds shared helpers (hf_reference.py); make them importable from every test module.
sys.path.insert(0, os.path.dirname(__file__))

# Backend of the kernel tests: the Pallas interpreter (CPU CI). On a GPU,
# MIXSERVE_KERNEL_BACKEND=pallas runs the same tests on the compiled kernels
# (experiments/gpu_check.sh). Output poisoning is the interpreter's; compiled
# runs still read NaN from every cache slot and scale they must not use.
KERNEL_BACKEND = os.environ.get("MIXSERVE_KERNEL_BACKEND", "interpret")

# One persistent compilation cache per test run, shared by the xdist workers and the scripts the
# tests start (they inherit the environment, set here before anything imports jax). Every Engine
# jits its own closures, so without it each test recompiles the same programs: with it the engine,
# run and fault tests took 355 s instead of 595 s on 2 cores. A fresh directory per run keeps each
# run compiling everything once; a cache the caller set is left alone.
_OWN_CACHE = None
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _OWN_CACHE = tempfile.mkdtemp(prefix="mixserve-test-jax-cache-")
    os.environ.update(JAX_COMPILATION_CACHE_DIR=_OWN_CACHE, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                      JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="-1")


def pytest_unconfigure(config):
    if _OWN_CACHE is not None:
        shutil.rmtree(_OWN_CACHE, ignore_errors=True)
