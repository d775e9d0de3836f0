# relay front door. Every target installs what it needs into .venv first.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
MODEL ?= debug
ARGS ?=
SERVICE ?=

.PHONY: install launch stop status test test-fast lint format clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# The CPU torch wheel lies on disk on our machines; installing it first keeps pip from
	# resolving a multi-GB CUDA build. Skipped when a torch (e.g. a CUDA one) is already there.
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

launch: $(STAMP)
	$(PY) -m sbatch.launch run $(MODEL) $(ARGS)

stop: $(STAMP)
	$(PY) -m sbatch.launch stop

status: $(STAMP)
	$(PY) -m sbatch.launch status

test: $(STAMP)
	$(PY) -m pytest -q -ra

test-fast: $(STAMP)
	$(PY) -m pytest -q -ra -m "not slow"

lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

format: $(STAMP)
	$(PY) -m ruff format .
	$(PY) -m ruff check --fix .

clean:
	rm -rf $(VENV) runs .pytest_cache .ruff_cache
