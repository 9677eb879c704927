# `make demo` and `make test` set everything up themselves on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
SOURCES := tether tests $(wildcard bench) $(wildcard examples)

.PHONY: setup demo test lint typecheck unit clean browser

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	$(PY) -m pip install -q --no-deps nixl-cu12==1.5.1
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/tether demo

lint: $(STAMP)
	$(VENV)/bin/ruff check $(SOURCES)
	$(VENV)/bin/ruff format --check $(SOURCES)

typecheck: $(STAMP)
	$(VENV)/bin/mypy

# Headless Chromium for the debug server's browser test (tests/test_server_integ.py); needs root.
browser:
	@test -x /usr/bin/chromium || { apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; }

unit: $(STAMP) browser
	$(PY) -m pytest

test: lint typecheck unit

clean:
	rm -rf $(VENV) tether-dumps .pytest_cache .mypy_cache .ruff_cache
