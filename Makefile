# The two set-up commands: `make demo` and `make test` (see README.md).
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
export DSEC_URL ?= http://127.0.0.1:7070

# parallel test workers (pytest-xdist): the suite mostly waits (image builds, VM boots,
# servers), so more workers than the 2 cores of a CI machine keep them busy
TEST_WORKERS ?= 4

.PHONY: setup demo test lint typecheck unit openapi bench clean-home warm-images test-flakes host-matrix

setup:
	@bash scripts/bootstrap.sh

demo: setup
	@bash scripts/demo.sh

lint: setup
	$(VENV)/bin/ruff check src tests benchmarks scripts examples hosts
	$(VENV)/bin/ruff format --check src tests benchmarks scripts examples hosts

typecheck: setup
	$(VENV)/bin/mypy

# builds the images the root tests need (once per machine: a cache keyed by recipe) in the
# background, while lint, typecheck and the root-free tests run; root tests wait for it
warm-images: setup
	@if [[ $$(id -u) -eq 0 ]]; then $(PY) -m tests.warm_images --background; fi

test: setup warm-images lint typecheck
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadgroup -q -ra --durations=15 $(PYTEST_ARGS)

unit: setup
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadgroup -q -m "not root" $(PYTEST_ARGS)

# every test that did not pass every time, under a CPU load beside it (scripts/flakes.py)
test-flakes: setup
	$(PY) scripts/flakes.py $(FLAKES_ARGS)

openapi: setup
	$(PY) scripts/gen_openapi.py

# the benchmarks' peers (podman) and tools (strace) are not needed by the tests: installed here only
bench: setup
	@DSEC_EXTRA_APT="podman strace $${DSEC_EXTRA_APT:-}" bash scripts/bootstrap.sh
	$(PY) benchmarks/container.py

# dsec on the hosts users run: stock Debian kernels (6.1, 6.12; cgroup v2 and v1) booted in
# QEMU guests, checks through the SDK inside each, a table and benchmarks/results/host_matrix.json
# (hosts/README.md). Root; images cached in /var/cache/dsec-hosts. HOST_MATRIX_ARGS, e.g.
# --hosts debian12-6.1-v2 --mode smoke
host-matrix: setup
	$(PY) -m hosts.matrix $(HOST_MATRIX_ARGS)
