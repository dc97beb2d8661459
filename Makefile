# `make main` runs the main job and `make test` the tests; each sets up .venv on first use.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
SCENARIO ?= scenarios/decode_sweep.yaml

.PHONY: setup main test lint

setup: $(STAMP)

# llama-cpp-python compiles llama.cpp from source (12-16 min on 2 cores); pip caches the wheel.
$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	CMAKE_ARGS="-DLLAVA_BUILD=OFF" $(PY) -m pip install -q -c constraints.txt -e '.[dev]'
	touch $(STAMP)

main: $(STAMP)
	$(VENV)/bin/harness run $(SCENARIO)

test: $(STAMP)
	$(VENV)/bin/ruff check harness tests scripts
	$(VENV)/bin/lint-imports
	$(PY) -m pytest

lint: $(STAMP)
	$(VENV)/bin/ruff check harness tests scripts
