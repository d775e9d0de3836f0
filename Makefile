# relay front door. Every target installs what it needs into .venv first.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
MODEL ?= debug
ARGS ?=
SERVICE ?=
# DRY_RUN=1: print the plan (and, for Slurm runs, the het-job script) without starting anything.
DRY_RUN ?=
# NODES=<n>: make plan's GPU nodes in all (default: the config's split).
NODES ?=
# RUN=<run dir>: which run status/stop/restart/logs act on (default runs/latest).
RUN ?=
RUN_ENV := $(if $(RUN),RELAY_RUN_DIR=$(RUN))

.PHONY: install launch plan resume stop status restart logs cluster cluster-stop test test-fast bench-check tasks lint format clean chromium

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
	$(PY) -m sbatch.launch run $(MODEL) $(if $(DRY_RUN),--dry-run) $(ARGS)

# make plan MODEL=glm5 [NODES=28]: memory per GPU, predicted step time and the balanced node split
# from the config and the rates measured in bench/ (configs/plan/rates.toml, docs/capacity.md).
plan: $(STAMP)
	$(PY) -m sbatch.plan $(MODEL) $(if $(NODES),--nodes $(NODES)) $(ARGS)

# make resume RUN=runs/<dir> [ARGS="--run.max_steps=800"]: continue a stopped run in its directory
# (its Redis data, ledger, checkpoints; step lines go on after the last one printed).
resume: $(STAMP)
	$(RUN_ENV) $(PY) -m sbatch.launch resume $(ARGS)

stop: $(STAMP)
	$(RUN_ENV) $(PY) -m sbatch.launch stop

status: $(STAMP)
	$(RUN_ENV) $(PY) -m sbatch.launch status

# make restart SERVICE=decode (every replica) | decode.1 | orchestrator | trainer
restart: $(STAMP)
	$(RUN_ENV) $(PY) -m sbatch.launch restart $(SERVICE)

# make logs SERVICE=decode.0 (SERVICE=slurm: the job's per-task logs; no SERVICE: list them)
logs: $(STAMP)
	$(RUN_ENV) $(PY) -m sbatch.launch logs $(SERVICE)

# A single-host Slurm cluster for tests and trying the Slurm launcher (sbatch/cluster.sh).
cluster:
	bash sbatch/cluster.sh start

cluster-stop:
	bash sbatch/cluster.sh stop

# Two xdist workers: most tests wait on subprocesses, servers and sockets, so two share the CI's
# 2 cores well (the whole of `make test` with its install: 15.4 min on the quiet 2-core dev
# machine). Each test module runs whole, in order, on one worker (--dist loadfile: some
# modules' tests build on the ones before them), the longest modules first (tests/conftest.py
# LONGEST_FIRST; xdist would otherwise order them by test count); tests of the one Slurm cluster
# take a lock (tests/conftest.py).
test: $(STAMP) chromium
	$(PY) -m pytest -q -ra -m "not full" -n 2 --dist loadfile --no-loadscope-reorder

test-full: $(STAMP) chromium
	$(PY) -m pytest -q -ra

test-fast: $(STAMP)
	$(PY) -m pytest -q -ra -m "not slow"

# The benchmark scripts' own checks on CPU (bench/tests/: their parsers, grids and smoke runs);
# not part of `make test`, which tests the product.
bench-check: $(STAMP)
	$(PY) -m pytest -q -ra -n 2 --dist loadfile bench/tests

# Real-repository SWE tasks (docs/environments.md, "swe-real"): >= 500 verified tasks from the 12
# projects, reproducible from SEED; cached and resumable (.cache/swe-real). Needs root + bubblewrap.
SEED ?= 0
TASKS ?= 500
tasks: $(STAMP)
	bash services/sandbox/install_bwrap.sh >/dev/null
	$(PY) -m services.sandbox.swe_real --seed $(SEED) --tasks $(TASKS)

# The dashboard test loads the page in a real headless browser: Debian's chromium package,
# installed once (apt-get, as root or through sudo) when it is not on PATH.
chromium:
	@command -v chromium >/dev/null || command -v chromium-browser >/dev/null || { \
	  echo "installing chromium (the dashboard test's headless browser)"; \
	  SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); \
	  $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get update -qq && \
	  $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; }

# lint-imports: the layering contracts in pyproject.toml ([tool.importlinter]).
lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(VENV)/bin/lint-imports --no-cache

format: $(STAMP)
	$(PY) -m ruff format .
	$(PY) -m ruff check --fix .

clean:
	rm -rf $(VENV) runs .pytest_cache .ruff_cache
