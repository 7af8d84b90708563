# The project's commands. `make serve` and `make test` do all set-up on a fresh machine.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
CKPT := build/default_checkpoint
DEFAULT_ENGINE := engines/default
PYTEST_ARGS ?=

.PHONY: install build serve test test-unit test-integration test-gpu lint bench clean help

help:
	@echo "make serve   build the default engine if missing and run tritonserver on 127.0.0.1 (HTTP_PORT, GRPC_PORT,"
	@echo "             METRICS_PORT, ENGINE, MAX_BATCH_SIZE, MULTI_BLOCK, PROFILE_PINNING override the defaults)"
	@echo "make test    install, build, lint and run every CPU test, including against a live tritonserver"
	@echo "make bench   offline CPU benchmarks (ratios against transformers measured in the same run)"

install: $(STAMP)

# torch first, pinned to the CPU wheel that lies on disk: a looser spec would pull a multi-GB CUDA build.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[dev]"
	touch $(STAMP)

$(CKPT)/config.json: | $(STAMP)
	$(BIN)/python -m builder default-checkpoint $(CKPT)

$(DEFAULT_ENGINE)/manifest.json: $(CKPT)/config.json
	$(BIN)/python -m builder build --checkpoint $(CKPT) --output $(DEFAULT_ENGINE)

build: $(DEFAULT_ENGINE)/manifest.json

serve: build
	$(BIN)/python -m deploy serve

lint: install
	$(BIN)/ruff check .

test-unit: install
	$(BIN)/pytest tests/unit -m "not gpu" $(PYTEST_ARGS)

test-integration: build
	$(BIN)/pytest tests/integration $(PYTEST_ARGS)

# pytest exits 5 when it collects no test: make treats any non-zero exit as failure.
test: lint build
	$(BIN)/pytest tests -m "not gpu" $(PYTEST_ARGS)

# On the GPU machine: `pytest -m gpu` (skips cleanly elsewhere).
test-gpu: install
	$(BIN)/pytest tests -m gpu $(PYTEST_ARGS)

bench: build
	$(BIN)/python -m benchmarks.offline

clean:
	rm -rf build engines/default reports .pytest_cache
