# stargym: every target that needs Python runs `setup` first, so one command works on a fresh machine.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PYTEST := $(BIN)/python -m pytest

.PHONY: setup test test-fast demo bench lint clean

setup: $(STAMP)

# Reinstalls only when the dependency list changes; editable, so code edits need no reinstall.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

# pytest's exit code 5 means it collected nothing: a suite that ran no test has failed.
test: setup
	$(PYTEST) tests; status=$$?; \
	if [ $$status -eq 5 ]; then echo "pytest collected no tests" >&2; exit 1; fi; exit $$status

test-fast: setup
	$(PYTEST) tests -m "not slow and not vllm and not compose and not browser"

demo: setup
	$(BIN)/python -m deploy.demo

bench: setup
	$(BIN)/python bench/env_server.py

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
