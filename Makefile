# Two commands on a fresh machine with only Python 3:
#   make demo   - build the small synthetic model and run the swarm on it
#   make test   - run the test suite
# Both create .venv and install what they need on first use (llama-cpp-python compiles from
# source once per machine, about 5 minutes on 2 cores, into ~/.cache/kvasir/wheels).

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.kvasir-installed
MODELS := models
DEMO_MODEL := $(MODELS)/small-qwen3moe-q4_k.gguf
DEMO_PROMPT ?= Once upon a time, in a swarm of small machines,

export CMAKE_BUILD_PARALLEL_LEVEL ?= $(shell nproc 2>/dev/null || echo 2)

# The official NATS CLI (tests/interop/ runs it against a real swarm): built once per machine
# with Go into a cache folder; without Go the target says so and the interop tests skip.
NATS_CLI_VERSION := v0.5.0
NATS_CLI_DIR ?= $(HOME)/.cache/kvasir/natscli-$(NATS_CLI_VERSION)
NATS_CLI := $(NATS_CLI_DIR)/nats
export KVASIR_NATS_CLI ?= $(NATS_CLI)

.PHONY: demo test install clean bench nats-cli browser-worker

install: $(STAMP) browser-worker

# The browser worker page (GET /worker on the weights server): npm installs the NATS project's
# JS client, msgpack and esbuild from browser/package-lock.json, and esbuild bundles the page
# into backbone/static/worker/ (gitignored, shipped as package data). Without npm it says so and
# the browser tests skip.
BROWSER_OUT := backbone/static/worker/worker.js
browser-worker: $(BROWSER_OUT)

$(BROWSER_OUT): browser/package-lock.json browser/build.mjs browser/index.html $(wildcard browser/src/*.js browser/src/*.mjs browser/src/*.wat)
	@if command -v npm >/dev/null 2>&1; then \
	  cd browser && npm ci --no-audit --no-fund --loglevel=error && node build.mjs; \
	else echo "browser-worker: no npm on this machine: /worker is not built and tests/browser/ will skip" >&2; fi

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# llama-cpp-python is built once per machine into a wheel folder of ours, keyed by its version and
# build flags (pip's own cache keys a source build by the sdist alone, not by CMAKE_ARGS). Where
# the CPU has AMX, -march=native would compile in ggml's AMX matmul, and that crashes (SIGSEGV in
# ggml_backend_amx_mul_mat) on the Q4_K models the tests synthesise, at llama.cpp's defaults: it is
# built without AMX there, and with every other instruction set of the machine.
LLAMA_CPP_VERSION := 0.3.36
LLAMA_CPU_HAS_AMX := $(shell grep -qs amx_int8 /proc/cpuinfo && echo 1)
ifeq ($(LLAMA_CPU_HAS_AMX),1)
LLAMA_VARIANT := native-noamx
LLAMA_NO_AMX := -mno-amx-tile -mno-amx-int8 -mno-amx-bf16
export LLAMA_CMAKE_ARGS := -DCMAKE_C_FLAGS="$(LLAMA_NO_AMX)" -DCMAKE_CXX_FLAGS="$(LLAMA_NO_AMX)"
else
LLAMA_VARIANT := native
export LLAMA_CMAKE_ARGS :=
endif
LLAMA_WHEELS ?= $(HOME)/.cache/kvasir/wheels/llama-cpp-python-$(LLAMA_CPP_VERSION)-$(LLAMA_VARIANT)

$(STAMP): pyproject.toml Makefile | $(BIN)/python
	$(BIN)/python -m pip install --quiet --upgrade pip setuptools wheel
	@if ! ls "$(LLAMA_WHEELS)"/llama_cpp_python-$(LLAMA_CPP_VERSION)-*.whl >/dev/null 2>&1; then \
	  echo "building llama-cpp-python $(LLAMA_CPP_VERSION) ($(LLAMA_VARIANT)) once per machine into $(LLAMA_WHEELS): ~5 min"; \
	  mkdir -p "$(LLAMA_WHEELS)" && \
	  CMAKE_ARGS="$$LLAMA_CMAKE_ARGS" $(BIN)/python -m pip wheel --quiet --no-deps --no-cache-dir \
	    -w "$(LLAMA_WHEELS)" llama-cpp-python==$(LLAMA_CPP_VERSION); \
	fi
	@echo "installing kvasir-bus with the backbone and test extras"
	$(BIN)/python -m pip install --quiet --find-links "$(LLAMA_WHEELS)" -e '.[backbone,test]' \
	  llama-cpp-python==$(LLAMA_CPP_VERSION)
	touch $@

$(DEMO_MODEL): | $(STAMP)
	@mkdir -p $(MODELS)
	$(BIN)/kvasir synth --arch qwen3moe --preset small --type q4_k --seed 0 --force -o $@

demo: $(STAMP) browser-worker $(DEMO_MODEL)
	$(BIN)/kvasir up --model $(DEMO_MODEL) --workers 4 --prompt "$(DEMO_PROMPT)" -n 24 --check

# nats.js for tests/net/test_creds_default.py (the NATS project's own client reads our .creds files):
# npm installs it from tests/net/natsjs/package-lock.json; without npm that test skips and says why.
NATSJS := tests/net/natsjs/node_modules/@nats-io/transport-node/package.json
$(NATSJS): tests/net/natsjs/package-lock.json
	@if command -v npm >/dev/null 2>&1; then \
	  cd tests/net/natsjs && npm ci --no-audit --no-fund --loglevel=error; \
	else echo "natsjs: no npm on this machine: the nats.js creds test will skip" >&2; fi

test: $(STAMP) nats-cli browser-worker $(NATSJS)
	$(BIN)/python -m pytest -q

nats-cli:
	@if [ -x "$(NATS_CLI)" ]; then :; \
	elif command -v go >/dev/null 2>&1; then \
	  echo "building the nats CLI $(NATS_CLI_VERSION) with go install (once per machine) into $(NATS_CLI_DIR)"; \
	  GOBIN="$(NATS_CLI_DIR)" go install github.com/nats-io/natscli/nats@$(NATS_CLI_VERSION) || \
	    echo "nats-cli: go install failed: the interop tests will skip" >&2; \
	else echo "nats-cli: no Go on this machine: tests/interop/ will skip (install Go to run them)" >&2; fi

bench: $(STAMP)
	$(BIN)/python bench/engine.py
	$(BIN)/python bench/kernel.py

clean:
	rm -rf $(MODELS) .pytest_cache build *.egg-info
