# The project's commands. `make serve` and `make test` do all set-up on a fresh machine.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
CKPT := build/default_checkpoint
DEFAULT_ENGINE := engines/default
PYTEST_ARGS ?=

.PHONY: install build serve test test-unit test-integration test-gpu lint bench clean help soak bench-serve

help:
	@echo "make serve   build the default engine if missing and run tritonserver on 127.0.0.1 (HTTP_PORT, GRPC_PORT,"
	@echo "             METRICS_PORT, ENGINE, MAX_BATCH_SIZE, MULTI_BLOCK, PROFILE_PINNING, DEVICE,"
	@echo "             GPU_MEMORY_FRACTION, INSTANCE_KIND=gpu override the defaults) and the"
	@echo "             OpenAI-compatible frontend beside it on 127.0.0.1:9000 (FRONTEND_PORT; FRONTEND_PORT=off: none)"
	@echo "make test    install, build, lint and run every CPU test, including against a live tritonserver"
	@echo "make bench   offline CPU benchmarks (ratios against transformers measured in the same run)"
	@echo "make soak    locust soak + fault test with a pass/fail verdict (USERS, DURATION, MULTI_BLOCK, PROFILE_PINNING,"
	@echo "             FAULT_SHARE, URL=host:http_port to use a running server; memory: MEMORY_BUDGET MiB/h, MEMORY_FLOOR,"
	@echo "             HEAP_DEBUG=0|1, HEAP_SNAPSHOT_S; FAULT_CANCEL_AFTER_FINAL=0 drops that fault;"
	@echo "             FAULT_REUSE_STREAM_AFTER_ERROR=1 reuses a gRPC stream after an error; PROTOCOL=both|grpc|http:"
	@echo "             the transports driven); reports in reports/"
	@echo "make bench-serve  genai-perf at concurrency 1, 4, 16 (CONCURRENCY=): Triton's kserve gRPC endpoint and the"
	@echo "             OpenAI frontend's chat endpoint side by side (ENDPOINTS=triton,chat; REPEATS=N: medians of N runs;"
	@echo "             URL=, FRONTEND_URL= to use running ones)"

install: $(STAMP)

# torch first, pinned to the CPU wheel that lies on disk: a looser spec would pull a multi-GB CUDA build.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[dev]"
	touch $(STAMP)

# The embedded checkpoint is a function of builder/default_model.py: rebuilt (with the engine) when it changes.
$(CKPT)/config.json: builder/default_model.py | $(STAMP)
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

# ---- load, soak and fault tests (loadtests/) ----------------------------------------------------------
# The short CI soak (tests/integration/test_soak.py, ~1.5 min) runs in `make test` through pytest.
# make soak USERS=16 DURATION=30m MULTI_BLOCK=on FAULT_SHARE=0.2 [PROFILE_PINNING=per_context] [URL=127.0.0.1:8000]
# Starts its own tritonserver on free loopback ports unless URL (a running server's HTTP host:port) is given.
# Exit code 0 only when every check of the verdict passes; CSV/HTML/JSON reports go to reports/.
USERS ?= 16
DURATION ?= 5m
MULTI_BLOCK ?= auto
PROFILE_PINNING ?= per_context
FAULT_SHARE ?= 0.2
URL ?=
PROTOCOL ?= both
soak: build
	USERS=$(USERS) DURATION=$(DURATION) MULTI_BLOCK=$(MULTI_BLOCK) PROFILE_PINNING=$(PROFILE_PINNING) \
	FAULT_SHARE=$(FAULT_SHARE) URL=$(URL) PROTOCOL=$(PROTOCOL) $(BIN)/python -m loadtests.soak

# genai-perf lives in its own venv (about 1 GB), never in the test environment. genai-perf 0.0.16 runs
# perf_analyzer from PATH: the tritonclient 2.51.0 manylinux1 wheel ships one that runs here with Debian's
# libb64-0d and libcudart.so.12 from nvidia-cuda-runtime-cu12 (found by loadtests.bench_serve).
GENAI_VENV := build/genai-perf-venv
GENAI_STAMP := $(GENAI_VENV)/.installed
$(GENAI_STAMP):
	@ldconfig -p | grep -q 'libb64\.so\.0d' || { apt-get install -y -q libb64-0d || \
	  { apt-get update -q && apt-get install -y -q libb64-0d; }; }
	$(PYTHON) -m venv $(GENAI_VENV)
	$(GENAI_VENV)/bin/pip install -q --upgrade pip
	$(GENAI_VENV)/bin/pip install -q genai-perf==0.0.16 nvidia-cuda-runtime-cu12
	$(GENAI_VENV)/bin/pip install -q --no-deps --force-reinstall tritonclient==2.51.0
	touch $(GENAI_STAMP)

FRONTEND_URL ?=
ENDPOINTS ?= triton,chat
REPEATS ?= 1
CONCURRENCY ?= 1,4,16
bench-serve: build $(GENAI_STAMP)
	URL=$(URL) FRONTEND_URL=$(FRONTEND_URL) ENDPOINTS=$(ENDPOINTS) REPEATS=$(REPEATS) CONCURRENCY=$(CONCURRENCY) \
	MULTI_BLOCK=$(MULTI_BLOCK) PROFILE_PINNING=$(PROFILE_PINNING) \
	$(BIN)/python -m loadtests.bench_serve --genai-perf $(GENAI_VENV)/bin/genai-perf
