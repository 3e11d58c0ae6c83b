import os
import re
import shutil
import sys
import tempfile

# tests/ holds shared helpers (hf_reference.py); make them importable from every test module.
sys.path.insert(0, os.path.dirname(__file__))
pytest_plugins = ("jax_times",)  # --jax-times: JAX's compile, trace and lowering time per test file

# Backend of the kernel tests: the Pallas interpreter (CPU CI). On a GPU,
# MIXSERVE_KERNEL_BACKEND=pallas runs the same tests on the compiled kernels
# (experiments/gpu_check.sh). Output poisoning is the interpreter's; compiled
# runs still read NaN from every cache slot and scale they must not use.
KERNEL_BACKEND = os.environ.get("MIXSERVE_KERNEL_BACKEND", "interpret")

_TT_DOT = re.compile(r"tt\.dot [^:]*: tensor<([0-9x]+)x(\w+)> \* tensor<([0-9x]+)x(\w+)>")


def ttir_dots(ttir: str) -> list[tuple[tuple[int, ...], tuple[int, ...], str]]:
    """(a's shape, b's shape, operand type) of every tt.dot in a kernel's Triton IR."""
    return [(tuple(map(int, a.split("x"))), tuple(map(int, b.split("x"))), a_type)
            for a, a_type, b, _ in _TT_DOT.findall(ttir)]


def dots_below_the_mma_minimum(ttir: str) -> list:
    """The 16-/8-bit dots with a dimension < 16: on the H200 (2026-11-30) a bf16
    dot contracting 8 compiled and returned twice the product."""
    return [dot for dot in ttir_dots(ttir) if dot[2] != "f32" and min(dot[0] + dot[1]) < 16]

# Test engines run every decode step and prefill call at max_batch rows and every prefill chunk at
# prefill_chunk tokens (minimums past any max_batch and chunk): one shape of each to compile, where
# serving rounds rows and chunks up to powers of two. Compiling dominates the suite: test_engine.py
# took 90 s against 129 s with the rows (2 cores, 2026-12-07), and the speculative, prefix-cache,
# structured and logprobs-mode files 355 s against 437 s of test time with the chunks too (the
# same day). The tests of that rounding pass their own minimums.
ONE_STEP_SHAPE = dict(min_decode_rows=1 << 16, min_prefill_rows=1 << 16, min_prefill_tokens=1 << 16)

# One persistent compilation cache per test run, shared by the xdist workers and the scripts the
# tests start (they inherit the environment, set here before anything imports jax). In one process
# engines of an equal spec share their jitted steps (mixserve.model_runner.steps_for); across
# processes this shares XLA's compiles (each process still traces and lowers): with it the engine,
# run and fault tests took 355 s instead of 595 s on 2 cores (2026-12-01, when every engine jitted
# its own steps). A fresh directory per run keeps each run compiling everything once; a cache the
# caller set is left alone.
_OWN_CACHE = None
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _OWN_CACHE = tempfile.mkdtemp(prefix="mixserve-test-jax-cache-")
    os.environ.update(JAX_COMPILATION_CACHE_DIR=_OWN_CACHE, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                      JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="-1")


# XLA's CPU backend compiling for the tests' speed, not for the code's: compiling dominates the suite
# (12 of the 21 s of an engine test, 38 compiles). The tests check results, not CPU speed. With all
# of the below (`make test PYTEST_ARGS=--jax-times`, 2026-12-07, 998 s wall, 1944 s of test time):
# 539 s of XLA compiling in the tests' own processes (7162 programs; 1424 more from the persistent
# cache), 233 s of tracing, 220 s of lowering; most of the rest in the scripts and notebooks the
# tests start (sharding 226 s, experiments 229 s, notebooks 122 s), which compile the same way.
# - LLVM optimization level 0: the engine tests ran 27% faster, the interpret-mode kernel tests
#   15%, and the whole suite (`make test`, 2 cores, 2026-12-01) in 19:00 against 32:50, with 31
#   against 56 CPU-minutes.
# - XLA's older loop emitters instead of its MLIR fusion emitters, and LLVM code generation in one
#   piece rather than split over threads: on top of level 0 (2026-12-02, 2 cores, one process),
#   two engines serving 4 prompts (tiny-kimi, tiny-glm4) took 11.8-12.8 s against 17.1-17.7 s
#   (10 runs), and one interpret-mode engine test with the INT4 kernel file (71 tests) 67 s
#   against 108 s.
# - LLVM's expensive passes off (what jax_disable_most_optimizations adds to level 0): on top of the
#   above (2026-12-03, 2 cores, one process, 6 engine tests, 4 runs interleaved) 51-58 s against
#   62-75 s, medians 54 and 67.
# Kept off the GPU runs (MIXSERVE_KERNEL_BACKEND=pallas), whose compiled code is what they test.
CPU_XLA_FLAGS = ("--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false "
                 "--xla_cpu_parallel_codegen_split_count=1 --xla_llvm_disable_expensive_passes=true"
                 ) if KERNEL_BACKEND == "interpret" else ""
if CPU_XLA_FLAGS and "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {CPU_XLA_FLAGS}".strip()


def host_devices_env(n: int) -> dict[str, str]:
    """The environment of a test's script that runs JAX on n CPU devices (the count is fixed when
    JAX starts), with this run's flags and compilation cache."""
    return {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={n} {CPU_XLA_FLAGS}".strip(),
            "JAX_PLATFORMS": "cpu"}


def pytest_unconfigure(config):
    if _OWN_CACHE is not None:
        shutil.rmtree(_OWN_CACHE, ignore_errors=True)


# The modules whose tests take the longest (the 8-device scripts, 55-80 s each; the experiment
# scripts and notebooks, 10-35 s), and two long tests elsewhere (a 4-device script, 58 s; an
# 8-device one, 26 s), go first: xdist deals the first tests out in turn, so the two workers start
# on them together and the run does not end with one worker alone on a long test.
_LONG_FIRST = ("test_sharding.py", "test_speculative.py::test_tensor_expert_and_context_parallel",
               "test_modelopt.py::test_nvfp4_activations_under_tensor_and_expert_parallelism", "test_experiments.py",
               "test_notebooks.py", "test_run.py")


def pytest_collection_modifyitems(items):
    rank = lambda item: next((i for i, m in enumerate(_LONG_FIRST) if m in item.nodeid), len(_LONG_FIRST))
    items.sort(key=rank)
