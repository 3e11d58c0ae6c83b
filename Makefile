# Quick start: `make run` and `make test`. Both create .venv from the project's own files.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: run test clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]' --config-settings editable_mode=compat
	touch $(STAMP)

run: $(STAMP)
	$(PY) -m mixserve.run $(ARGS)

# The 15 slowest tests close the report: the suite must stay under 20 minutes on CI's 2 cores.
# `make test PYTEST_ARGS=--jax-times` adds each test file's XLA compile, trace and lowering seconds.
PYTEST_ARGS ?= --durations=15

test: $(STAMP)
	$(PY) -m pytest -q -n 2 $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
