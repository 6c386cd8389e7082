# Two commands on a fresh machine: `make serve` and `make test`. Each bootstraps .venv once;
# the stamp file makes later runs skip installing unless pyproject.toml changed.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PORT ?= 5006
export NUMBA_CACHE_DIR ?= $(CURDIR)/.numba_cache

.PHONY: serve test bench install

install: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/panel serve app/ --port $(PORT) --static-dirs assets=./assets --warm

test: $(STAMP)
	$(PY) -m pytest

bench: $(STAMP)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q 'torch==2.13.0'
	$(PY) -m qatlab.bench all
