# Two commands on a fresh machine: `make serve` and `make test`. Each bootstraps .venv once;
# the stamp file makes later runs skip installing unless pyproject.toml changed.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PORT ?= 5006
# `make test-fast` spreads its tests over this many pytest-xdist workers (0: one process, as `make test`).
FAST_WORKERS ?= 2
# `make serve` listens on this machine only; to share it, e.g. `make serve ADDRESS=0.0.0.0 ORIGIN=myhost:5006`
# (README, "Safety"; ORIGIN may list several). SERVE_ARGS passes more `panel serve` options (e.g. --basic-auth).
# The websocket limit (32 MiB) fits a 20 MB upload, which travels base64-encoded in one message.
ADDRESS ?= 127.0.0.1
ORIGIN ?=
SERVE_ARGS ?=
# Numba's compiled kernels: qatlab keeps them in ~/.cache/qatlab/numba (or $NUMBA_CACHE_DIR), shared
# by the server, the notebooks, the CLI and the tests; it sets that itself, so nothing is set here.
NB_STAMP := $(VENV)/.notebooks-installed
NB_PORT ?= 8888

.PHONY: serve test test-fast bench install notebooks

install: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/panel serve app/ --address $(ADDRESS) --port $(PORT) --static-dirs assets=./assets --warm \
		--allow-websocket-origin 127.0.0.1:$(PORT) --allow-websocket-origin localhost:$(PORT) \
		--websocket-max-message-size 33554432 \
		$(foreach o,$(ORIGIN),--allow-websocket-origin $(o)) $(SERVE_ARGS)

# The test targets let Python cache bytecode (__pycache__/, git-ignored) even where the environment sets
# PYTHONDONTWRITEBYTECODE: recompiling qatlab, the tests and their imports costs ~18 s on every run.
PYTEST := env -u PYTHONDONTWRITEBYTECODE $(PY) -m pytest

test: $(STAMP)
	$(PYTEST)

# Everything but the tests marked slow (they train real models or start Python processes, a Dask cluster,
# a server or a browser) or browser: the kernels against their references, config, store, UI pieces.
# Whole test files go to each worker (--dist loadfile), so a module's fixtures are built once.
test-fast: $(STAMP)
	$(PYTEST) -m "not slow and not browser" -q -n $(FAST_WORKERS) --dist loadfile

bench: $(STAMP)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q 'torch==2.13.0'
	$(PY) -m qatlab.bench all

# JupyterLab on this machine only (127.0.0.1), opened in notebooks/; the `notebooks` extra is
# installed into .venv on first use (and again when pyproject.toml changes). Jupyter refuses to run
# as root unless told: containers and CI machines run as root, so it is told there.
$(NB_STAMP): $(STAMP)
	$(PY) -m pip install -q -e '.[test,notebooks]'
	touch $(NB_STAMP)

notebooks: $(NB_STAMP)
	$(VENV)/bin/jupyter lab --ip 127.0.0.1 --port $(NB_PORT) --ServerApp.root_dir=$(CURDIR)/notebooks \
		$(if $(filter 0,$(shell id -u)),--allow-root)
