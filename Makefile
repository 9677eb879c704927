# `make demo` and `make test` set everything up themselves on a fresh machine.
PYTHON ?= python3
TORCH ?= 2.13.0
VENV ?= .venv
PIP_ENV ?=
# Each venv's pip runs as $(PIP_ENV) $(PY) -m pip (the 2.15 leg reads no pip configuration).
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
NATIVE := $(VENV)/.native
SOURCES := tether tests $(wildcard bench) $(wildcard examples)
# Which tests run where comes from their markers (pyproject.toml; tests/conftest.py sets each
# test's part from its folder). `make test` runs the fast tier: every part's tests but those marked
# slow (each part keeps its in-process tests and a real job of each kind), then the recorder's own
# tests (tests/core) again on the Python recorder. `make test-all` runs every test, and every
# recorder-marked one on the Python recorder. The torch legs run what depends on torch's version,
# then torch's own regrouping on the Python recorder.
FAST := -m "not slow"
FAST_PYTHON_RECORDER := -m "python_recorder and core and not slow"
TORCH_LEG := -m every_torch
TORCH_LEG_PYTHON_RECORDER := -m regroup

# The second CI leg: torch 2.14.1 in a venv of its own (the CUDA build from this machine's disk,
# running on CPU, with its nvidia-* wheels: ~5.6 GB), its own native core beside 2.13's (each is
# named for its torch).
VENV214 := .venv-torch214

# The third CI leg: torch 2.15.0, the release whose names tether gives 2.13 and 2.14, on Python
# 3.12 (the native core then builds for a second CPython too). It is not on this machine's disk:
# pip takes it from PyPI (the CUDA 13.2 build, run on CPU, with its nvidia-* and cuda-* wheels:
# ~5 GB, ~2 minutes). The machine's pip configuration caps torch at 2.14.1, the releases on its
# disk; it is left as it is, and this venv's pip reads no configuration file instead
# (PIP_CONFIG_FILE=/dev/null), so the certificate bundle that configuration names is passed here.
VENV215 := .venv-torch215
PYTHON312 ?= $(or $(lastword $(wildcard $(HOME)/.pyenv/versions/3.12*/bin/python3.12)),python3.12)
PIP215 := PIP_CONFIG_FILE=/dev/null PIP_CERT=/etc/ssl/certs/ca-certificates.crt

.PHONY: setup native demo etcd test test-all unit-all test-python test-torch214 test-torch215 test-torch-suite lint typecheck unit clean browser

# torch is installed without pip's cache: the CUDA builds of the torch legs would otherwise sit on
# the disk twice (~3 GB of wheels in ~/.cache/pip beside the ~6 GB venv).
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP_ENV) $(PY) -m pip install -q --no-cache-dir torch==$(TORCH) 'setuptools>=68' wheel
	TETHER_BUILD_NATIVE=0 $(PIP_ENV) $(PY) -m pip install -q --no-build-isolation -e '.[dev]'
	$(PIP_ENV) $(PY) -m pip install -q --no-deps nixl-cu12==1.5.1
	touch $(STAMP)

# The native recording core, compiled against the venv's torch (about a minute); rebuilt only
# when its source changes. Without a compiler tether still installs, on its Python recorder.
$(NATIVE): $(STAMP) $(wildcard tether/csrc/*) setup.py
	$(PIP_ENV) $(PY) -m pip install -q --no-build-isolation --no-deps -e .
	$(VENV)/bin/tether doctor
	touch $(NATIVE)

setup: $(STAMP) $(NATIVE)

native: $(NATIVE)

demo: $(STAMP) $(NATIVE)
	$(VENV)/bin/tether demo

lint: $(STAMP)
	$(VENV)/bin/ruff check $(SOURCES)
	$(VENV)/bin/ruff format --check $(SOURCES)

typecheck: $(STAMP)
	$(VENV)/bin/mypy

# Headless Chromium for the debug server's browser test (tests/watchdog/test_server_integ.py); needs root.
browser:
	@test -x /usr/bin/chromium || { apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; }

# A real etcd (Debian's etcd-server, 3.4) for the tests of the job's store on etcd; needs root.
etcd:
	@command -v etcd >/dev/null || { apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq etcd-server etcd-client; }

unit: $(STAMP) $(NATIVE) browser etcd
	$(VENV)/bin/tether doctor --require-native
	$(PY) -m pytest $(FAST) --durations=15
	TETHER_RECORDER=python $(PY) -m pytest $(FAST_PYTHON_RECORDER)

unit-all: $(STAMP) $(NATIVE) browser etcd
	$(VENV)/bin/tether doctor --require-native
	$(PY) -m pytest --durations=30
	TETHER_RECORDER=python $(PY) -m pytest -m python_recorder --durations=15

test: lint typecheck unit

test-all: lint typecheck unit-all

test-torch214: browser etcd
	$(MAKE) TORCH=2.14.1 VENV=$(VENV214) setup
	$(VENV214)/bin/tether doctor --require-native
	$(VENV214)/bin/python -m pytest $(TORCH_LEG)
	TETHER_RECORDER=python $(VENV214)/bin/python -m pytest $(TORCH_LEG_PYTHON_RECORDER)

test-torch215: browser etcd
	$(MAKE) TORCH=2.15.0 VENV=$(VENV215) PYTHON=$(PYTHON312) PIP_ENV='$(PIP215)' setup
	$(VENV215)/bin/tether doctor --require-native
	$(VENV215)/bin/python -m pytest $(TORCH_LEG)
	TETHER_RECORDER=python $(VENV215)/bin/python -m pytest $(TORCH_LEG_PYTHON_RECORDER)

# torch's own distributed tests, on plain torch and with tether installed in every process; every
# test must end the same way (tests/torch_suite/run.py; K=... selects, as pytest's -k).
test-torch-suite: $(STAMP) $(NATIVE)
	$(PY) tests/torch_suite/run.py $(if $(K),-k "$(K)")

test-python: $(STAMP) browser etcd
	TETHER_RECORDER=python $(PY) -m pytest

clean:
	rm -rf $(VENV) $(VENV214) $(VENV215) tether-dumps .pytest_cache .mypy_cache .ruff_cache build tether/_native*.so
