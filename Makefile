# One command sets up and runs each job, from a fresh clone.
#   make generate   set up, then complete "def fibonacci(n):" with the embedded model
#   make serve      set up, then serve the embedded model on 127.0.0.1:8000 (OpenAI API)
#   make test       set up with the test extras, then lint, type-check and run the test suite (CPU; what CI runs)
#   make lint       ruff (lint and format), the import-layer contracts and mypy on the package
#   make gpu-test   the GPU tests (needs a CUDA GPU)
#   make test-all   make test, then the GPU tests
#   make test TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
#                   the same, with torch from PyTorch's CPU-only wheel index (on Linux the default
#                   index serves the CUDA build: several GB with the NVIDIA libraries)
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# torch pinned to the tested version unless a CUDA driver is present.
TORCH_SPEC ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && echo torch || echo torch==2.13.0)
# Where torch alone is installed from (pip's --index-url); empty: pip's configured index.
TORCH_INDEX_URL ?=
PROMPT ?= def fibonacci(n):

.PHONY: setup setup-test generate serve lint test gpu-test test-all clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.torch: $(BIN)/python
	$(BIN)/pip install -q $(if $(TORCH_INDEX_URL),--index-url "$(TORCH_INDEX_URL)" )"$(TORCH_SPEC)"
	touch $@

setup: $(VENV)/.torch
	$(BIN)/pip install -q -e .

setup-test: $(VENV)/.torch
	$(BIN)/pip install -q -e ".[test]"

generate: setup
	$(BIN)/tokenmill generate "$(PROMPT)"

serve: setup
	$(BIN)/tokenmill serve --host 127.0.0.1 --port 8000

lint: setup-test
	$(BIN)/ruff check tokenmill
	$(BIN)/ruff format --check tokenmill
	$(BIN)/lint-imports
	$(BIN)/mypy

test: lint
	$(BIN)/python -m pytest -q

gpu-test: setup-test
	$(BIN)/python -m pytest -q -m gpu

test-all: test gpu-test

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
