# Two commands on a fresh machine with Python 3.11 and pip:  `make run`  and  `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin

.PHONY: run test test-all bench models clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# Runtime install (the main job needs no torch).
$(VENV)/.installed: pyproject.toml setup.py | $(BIN)/python
	$(BIN)/pip install -q -e .
	touch $@

# Test install: adds torch (CPU, parity tests only), pytest and the notebook runner.
$(VENV)/.installed-test: pyproject.toml setup.py | $(BIN)/python
	$(BIN)/pip install -q -e '.[test]'
	touch $@ $(VENV)/.installed

run: $(VENV)/.installed
	$(BIN)/jaxdecode demo

# XLA's CPU compiler segfaulted worker processes that had compiled ~10k programs (each holds memory
# mappings up to vm.max_map_count; tests/conftest.py now drops JAX's caches before that). As a guard, a
# test whose worker *crashes* runs once more on a fresh worker; an ordinary failure is never rerun
# (--only-rerun matches no error).
RERUN_CRASHED := --reruns 1 --only-rerun '(?!)'

test: $(VENV)/.installed-test
	$(BIN)/python -m pytest -q -n 2 --durations=15 $(RERUN_CRASHED)

test-all: $(VENV)/.installed-test
	$(BIN)/python -m pytest -q -n 2 -m "slow or not slow" $(RERUN_CRASHED)

bench: $(VENV)/.installed-test
	$(BIN)/python benchmarks/bench_autoregressive.py

models: $(VENV)/.installed-test
	$(BIN)/python -m jaxdecode.training.build_embedded

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
