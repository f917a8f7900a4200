# Relay: `make demo` runs the demo job through Airflow; `make test` runs the tests.
# Both build .venv with the pinned dependencies on first use.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.relay-installed
export RELAY_HOME ?= $(CURDIR)/.relay

.PHONY: venv demo test lint bench clean

$(STAMP): requirements.lock pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@echo "Installing pinned dependencies into $(VENV) (first run takes a few minutes)..."
	@# torch first: the pinned CPU build, so nothing can pull a multi-GB CUDA build.
	$(BIN)/python -m pip install -q --disable-pip-version-check torch==2.13.0
	$(BIN)/python -m pip install -q --disable-pip-version-check -r requirements.lock
	$(BIN)/python -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e .
	@touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/relay demo

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q

lint: $(STAMP)
	$(BIN)/ruff check .

bench: $(STAMP)
	$(BIN)/relay bench checkpoint

clean:
	rm -rf $(VENV) .relay
