"""The experiment scripts keep running (smallest settings), so they cannot rot between the
sessions that have a GPU or the time to run them in full."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(script, *args, timeout=600):
    result = subprocess.run([sys.executable, os.path.join(ROOT, "experiments", script), *args],
                            capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def test_gpu_kernels_script_runs_on_cpu(tmp_path):
    out = run("gpu_kernels.py", "--out", str(tmp_path / "k.md"))
    assert "NOT kernel performance" in out and "| MLA fp8 |" in out
    assert (tmp_path / "k.md").read_text().count("\n") > 10


def test_serving_script_runs(tmp_path):
    out = run("serving.py", "--repeats", "1", "--new-tokens", "2", "--concurrency", "2",
              "--context-limits", "1024", "--out", str(tmp_path / "s.md"))
    assert "| kimi-k2.6 | 70,272 | 35,136 |" in out and "Integrity check overhead" in out
    assert "| 1,024 | 64 |" in out  # attended width: 1024 tokens in pages of 16


def test_gpu_benchmark_reports_a_failing_or_late_row_and_goes_on():
    """On the GPU a kernel may fail to compile where interpret mode passed: that
    row says FAILED with the error, the rest of the table is still measured, and
    rows past the time budget are listed as skipped instead of running."""
    import jax.numpy as jnp

    sys.path.insert(0, ROOT)
    from experiments import gpu_kernels as gk

    def broken(x):
        raise RuntimeError("Triton compile error: out of resource")

    bench = gk.Bench(gk.CPU, budget_s=60)
    x = jnp.ones((4,), jnp.float32)
    bench.measure("INT4 matmul", "M=1 K=4 N=4 g=32", "interpret", broken, (x,), 16)
    bench.measure("INT4 matmul", "M=1 K=4 N=4 g=32", "bf16 jnp.dot", lambda x: x * 2, (x,), 16)
    bench.deadline = 0.0
    bench.measure("MLA fp8", "B=1 ctx=4", "interpret", lambda x: x, (x,), 16)
    failed, timed, skipped = bench.rows
    assert failed.note.startswith("FAILED: RuntimeError: Triton compile error") and timed.seconds > 0
    assert skipped.note == "skipped: time budget"
    goals = gk.goal_lines(bench.rows, copy_bw=1e9, kernel_backend="interpret")
    assert all("not measured" in line for line in goals), goals
    table = gk.markdown(bench.rows, 1e9, goals, "cpu", on_gpu=False)
    assert "| FAILED: RuntimeError: Triton compile error: out of resource |" in table


def test_gpu_benchmark_loop_has_a_known_trip_count():
    """A traced trip count makes XLA's GPU while loop sync with the host on every
    iteration; the benchmark's loop must compile with its count known."""
    import jax
    import jax.numpy as jnp

    sys.path.insert(0, ROOT)
    from experiments import gpu_kernels as gk

    x = jnp.ones((4, 8), jnp.float32)
    loop = gk._dependent_calls(lambda x, w: x @ w, reps=37)
    hlo = jax.jit(loop).lower(x, x.T).compile().as_text()
    assert '"known_trip_count":{"n":"37"}' in hlo
    # The harness keeps its work in the loop: one reduction over the input, one over an
    # output-sized buffer (XLA folds nothing away: x * 0 is not 0 for floats).
    harness = gk._dependent_calls(gk._harness_only, reps=37)
    hlo = jax.jit(harness).lower(x, x.T, jnp.ones((4, 4), jnp.float32)).compile().as_text()
    assert '"known_trip_count":{"n":"37"}' in hlo
    assert hlo.count("while/body/closed_call/reduce_sum") >= 2


def test_gpu_benchmark_uses_net_times_and_flags_unresolved_rows():
    sys.path.insert(0, ROOT)
    from experiments import gpu_kernels as gk

    shape = "M=1 K=4 N=4 g=32"
    ours = gk.Row("INT4 matmul", shape, "pallas", 5e-6, 8000, 0.0, harness_seconds=3e-6)
    dot = gk.Row("INT4 matmul", shape, "bf16 jnp.dot", 11e-6, 32000, harness_seconds=3e-6)
    assert abs(ours.gb_per_s - 4.0) < 1e-9  # 8000 B in 5 - 3 us
    assert "4.00x at M=1 (met)" in gk.goal_lines([ours, dot], 1e12, "pallas")[2]  # (11-3) / (5-3)
    lost = gk.Row("INT4 matmul", shape, "pallas", 2e-6, 8000, 0.0, harness_seconds=3e-6)
    assert "not measured" in gk.goal_lines([lost, dot], 1e12, "pallas")[2]
    assert "| 2.0 | 3.0 | - | - | - |" in gk.markdown([lost], 1e12, [], "cpu", on_gpu=False)
