# Relay: `make demo` runs the demo job through Airflow; `make test` runs the tests.
# Both build .venv with the pinned dependencies on first use.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.relay-installed
export RELAY_HOME ?= $(CURDIR)/.relay
# pytest's default selection (addopts in pyproject.toml), repeated where `make test` adds to it.
DEFAULT_TESTS := not services and not postgres and not slow and not cluster_ns

.PHONY: venv demo test lint bench clean up down test-slow test-services test-postgres \
	cluster-up cluster-down test-cluster test-cluster-demo

# This machine's pip config names local indexes that may not exist; pip warns about each.
PIP := $(BIN)/python -m pip install -q --disable-pip-version-check
QUIET_PIP := 2> >(grep -v 'is ignored: it is neither a file nor a directory' >&2)

$(STAMP): requirements.lock requirements-callbacks.lock pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@echo "Installing pinned dependencies into $(VENV) (first run takes a few minutes)..."
	@# torch first: the pinned CPU build, so nothing can pull a multi-GB CUDA build.
	$(PIP) torch==2.13.0 $(QUIET_PIP)
	$(PIP) -r requirements.lock $(QUIET_PIP)
	@# The `callbacks` extra (Lightning, transformers): optional for users, run by CI.
	$(PIP) -r requirements-callbacks.lock $(QUIET_PIP)
	$(PIP) --no-deps --no-build-isolation -e . $(QUIET_PIP)
	@touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/relay demo

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/lint-imports
	@# Tests that start no real workload (not marked integration) run on both cores,
	@# one file per pytest-xdist worker (module fixtures stay in one process; each worker
	@# has its own RELAY_HOME, tests/conftest.py); the real multi-process runs then run
	@# alone, as the detector's timing expects.
	$(BIN)/python -m pytest -q --durations=15 -n 2 --dist loadfile -m "$(DEFAULT_TESTS) and not integration"
	$(BIN)/python -m pytest -q --durations=15 -m "$(DEFAULT_TESTS) and integration"

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/lint-imports

# A real Airflow (API server + UI, scheduler, DAG processor, triggerer) and an
# MLflow server on 127.0.0.1, free ports unless RELAY_API_PORT/RELAY_MLFLOW_PORT are set.
up: $(STAMP)
	$(BIN)/relay services up

down: $(STAMP)
	$(BIN)/relay services down

# Long end-to-end recoveries through Airflow (user script, three faults, DCP, evidence, observe).
test-slow: $(STAMP)
	$(BIN)/python -m pytest -q --tb=short --durations=10 -m 'slow and not cluster_ns'

# Slow tests against the services of `make up` (each test starts and stops its own).
test-services: $(STAMP)
	bash scripts/system-deps.sh
	$(BIN)/python -m pytest -q --tb=short --durations=10 -m services tests/services

# `make up` with Airflow's metadata in a private PostgreSQL (apt-get install postgresql), and
# two workers sharing the node pool through one (RELAY_NODE_POOL_URL).
test-postgres: $(STAMP)
	bash scripts/system-deps.sh
	$(BIN)/python -m pytest -q --tb=short -m postgres tests/services

# Namespace hosts on a private bridge (198.18.0.0/24) with a real Slurm cluster (root only):
# slurmctld on host slurmctl, slurmd on node1..node$(NODES). `cluster-down` removes exactly what was
# made. `make cluster-up NODES=5` is the bed `relay demo --launcher slurm` runs on (else it makes one).
NODES ?= 3
cluster-up: $(STAMP)
	bash scripts/system-deps.sh slurm
	$(BIN)/relay testbed up --nodes $(NODES)

cluster-down: $(STAMP)
	$(BIN)/relay testbed down

# The test bed's own tests (marked cluster_ns; each brings hosts (+ Slurm) up and down),
# the Kubernetes launcher's pods run as rendered on such hosts, and the Slurm demo.
test-cluster: $(STAMP)
	bash scripts/system-deps.sh slurm
	$(BIN)/python -m pytest -q --tb=short --durations=10 -m 'cluster_ns and not slow' tests/testbed

# Only `relay demo --launcher slurm`'s test (also in test-cluster; docs/testing.md has its time).
test-cluster-demo: $(STAMP)
	bash scripts/system-deps.sh slurm
	$(BIN)/python -m pytest -q --tb=short -m cluster_ns tests/testbed/test_slurm_demo.py

bench: $(STAMP)
	$(BIN)/relay bench checkpoint

clean:
	rm -rf $(VENV) .relay
