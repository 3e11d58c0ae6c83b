import os
import sys

# tests/ holds shared helpers (hf_reference.py); make them importable from every test module.
sys.path.insert(0, os.path.dirname(__file__))

# Backend of the kernel tests: the Pallas interpreter (CPU CI). On a GPU,
# MIXSERVE_KERNEL_BACKEND=pallas runs the same tests on the compiled kernels
# (experiments/gpu_check.sh). Output poisoning is the interpreter's; compiled
# runs still read NaN from every cache slot and scale they must not use.
KERNEL_BACKEND = os.environ.get("MIXSERVE_KERNEL_BACKEND", "interpret")
