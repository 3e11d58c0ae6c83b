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
    out = run("serving.py", "--repeats", "1", "--new-tokens", "2", "--concurrency", "1", "2",
              "--out", str(tmp_path / "s.md"))
    assert "| kimi-k2.6 | 70,272 | 35,136 |" in out and "Integrity check overhead" in out
