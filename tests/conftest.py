import os
import sys

# tests/ holds shared helpers (hf_reference.py); make them importable from every test module.
sys.path.insert(0, os.path.dirname(__file__))
