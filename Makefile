# Two commands on a fresh machine: `make serve` and `make test`. Each bootstraps .venv once;
# the stamp file makes later runs skip installing unless pyproject.toml changed.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PORT ?= 5006
# `make serve` listens on this machine only; to share it, e.g. `make serve ADDRESS=0.0.0.0 ORIGIN=myhost:5006`
# (README, "Safety"; ORIGIN may list several). SERVE_ARGS passes more `panel serve` options (e.g. --basic-auth).
# The websocket limit (32 MiB) fits a 20 MB upload, which travels base64-encoded in one message.
ADDRESS ?= 127.0.0.1
ORIGIN ?=
SERVE_ARGS ?=
export NUMBA_CACHE_DIR ?= $(CURDIR)/.numba_cache

.PHONY: serve test bench install

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

test: $(STAMP)
	$(PY) -m pytest

bench: $(STAMP)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q 'torch==2.13.0'
	$(PY) -m qatlab.bench all
