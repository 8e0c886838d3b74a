# kvlab: `make lab` (JupyterLab on the chapters), `make demo` (headless report), `make test` (the test suite).
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# torch is installed first and pinned: an open range with no torch present may pull a multi-GB build.
TORCH  ?= torch==2.13.0
STAMP  := $(VENV)/.kvlab-installed

.PHONY: install lab demo test test-long bench html clean

$(STAMP): pyproject.toml hatch_build.py kvlab/_fastpath.c kvlab/_paged_attention.c
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet "$(TORCH)"
	$(BIN)/python -m pip install --quiet -e ".[jupyter,test]"
	touch $(STAMP)

install: $(STAMP)

lab: $(STAMP)
	$(BIN)/jupyter lab chapters/index.ipynb

demo: $(STAMP)
	$(BIN)/python -m kvlab demo

test: $(STAMP)
	$(BIN)/python -m pytest

test-long: $(STAMP)
	KVLAB_LONG=1 $(BIN)/python -m pytest tests/test_reliability.py

bench: $(STAMP)
	$(BIN)/python -m kvlab bench

html: $(STAMP)
	$(BIN)/python -m kvlab html

clean:
	rm -rf $(VENV) build dist site .pytest_cache .hypothesis kvlab/_fastpath*.so kvlab/_paged_attention*.so
