# `make main` runs the main job and `make test` the tests; each sets up .venv on first use.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
SCENARIO ?= scenarios/decode_sweep.yaml

.PHONY: setup main test lint

setup: $(STAMP)

# llama-cpp-python compiles llama.cpp from source (3-16 min on 2 cores); pip caches the wheel.
# On x86-64 ggml's AMX kernels are left out: on Sapphire Rapids-class CPUs they segfault in
# Q8_0 prefill (llama.cpp issue #20824). pip's wheel cache ignores CMAKE_ARGS, so a cached
# build that still has them is dropped and rebuilt once (scripts/check_llama_build.py).
LLAMA_CMAKE_ARGS := -DLLAVA_BUILD=OFF
ifeq ($(shell uname -m),x86_64)
LLAMA_CMAKE_ARGS += -DCMAKE_C_FLAGS=-mno-amx-int8 -DCMAKE_CXX_FLAGS=-mno-amx-int8
endif

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" $(PY) -m pip install -q -c constraints.txt -e '.[dev]'
	$(PY) scripts/check_llama_build.py || { $(PY) -m pip cache remove llama_cpp_python; \
	  CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" $(PY) -m pip install -q -c constraints.txt \
	    --force-reinstall --no-deps llama-cpp-python && $(PY) scripts/check_llama_build.py; }
	touch $(STAMP)

main: $(STAMP)
	$(VENV)/bin/harness run $(SCENARIO)

# Two pytest workers (the machines have 2 cores; most tests wait on subprocesses, servers and
# Ray), then the tests marked serial alone.
test: $(STAMP)
	$(VENV)/bin/ruff check harness tests scripts
	$(VENV)/bin/lint-imports
	$(PY) -m pytest -n 2 -m "not serial"
	$(PY) -m pytest -m serial

lint: $(STAMP)
	$(VENV)/bin/ruff check harness tests scripts
