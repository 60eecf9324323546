# Two entry points, each working from nothing on a fresh machine:
#   make test   - create .venv, install the project, run the whole CPU test suite
#   make gate   - create .venv, install the project, run the main job (the canary gate)
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: test gate install clean

install: $(STAMP)

# On hosts without CUDA, torch comes from the CPU build on disk (a bare `torch` pulls a multi-GB
# CUDA build); the project's own lower bound (torch>=2.11) is then already satisfied.
$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	if ! command -v nvidia-smi >/dev/null 2>&1; then $(PY) -m pip install -q torch==2.13.0; fi
	$(PY) -m pip install -q -e .
	touch $(STAMP)

# The stress gate and the other tests whose oracle measures speed (marker `timing`) run alone after
# the rest: the gate compares against a baseline measured on an otherwise idle machine and the A/B
# controls compare two servers' speed, so they must not share the two cores with other test workers.
test: $(STAMP)
	$(PY) -m pytest -n 2 -m "not stress and not timing" $(PYTEST_ARGS)
	$(PY) -m pytest -m "stress or timing" --sessions 80 $(PYTEST_ARGS)

gate: $(STAMP)
	$(PY) -m pytest -m stress --sessions 80 -p no:cacheprovider

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
