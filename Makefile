# The two set-up commands: `make demo` and `make test` (see README.md).
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
export DSEC_URL ?= http://127.0.0.1:7070

.PHONY: setup demo test lint typecheck unit openapi bench clean-home

setup:
	@bash scripts/bootstrap.sh

demo: setup
	@bash scripts/demo.sh

lint: setup
	$(VENV)/bin/ruff check src tests benchmarks scripts examples
	$(VENV)/bin/ruff format --check src tests benchmarks scripts examples

typecheck: setup
	$(VENV)/bin/mypy

test: setup lint typecheck
	$(PY) -m pytest -q -ra --durations=15 $(PYTEST_ARGS)

unit: setup
	$(PY) -m pytest -q -m "not root" $(PYTEST_ARGS)

openapi: setup
	$(PY) scripts/gen_openapi.py

# the benchmarks' peers (podman) are not needed by the tests: installed here only
bench: setup
	@DSEC_EXTRA_APT="podman $${DSEC_EXTRA_APT:-}" bash scripts/bootstrap.sh
	$(PY) benchmarks/container.py
