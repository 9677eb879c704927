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
# The recorder's tests, run a second time on the Python recorder (the first run uses the core):
# recording on every issue path, clients bit-identical, dumps torch's analyzer reads, the ring
# file after a death, the fault corpus's diagnoses, regrouping. `make test-python` runs the whole
# suite on it.
RECORDER_TESTS := tests/test_recorder_integ.py tests/test_clients_integ.py tests/test_api.py \
	tests/test_dump_write.py tests/test_ringfile.py tests/test_launcher_faults_integ.py \
	tests/test_analyze_jobs_integ.py tests/test_fault_corpus_integ.py tests/test_reconfigure_integ.py \
	tests/test_reconfigure.py tests/test_split_integ.py tests/test_elastic_integ.py

# The tests of what touches torch, run again on torch 2.14.1 and on torch 2.15.0: recorder,
# watchdog, clients (DDP, FSDP2, DTensor, pipelining), torch's test backends, debug server,
# transport, torch's own reconfigure and split on recorded groups, --elastic, and tether.fsdp's and
# tether.pipelining's behavioural tests (on 2.15 they run against torch's own classes, which the
# tether.fsdp and tether.pipelining imports hand out there).
TORCH_TESTS := tests/test_recorder_integ.py tests/test_clients_integ.py tests/test_native.py \
	tests/test_torch_variables_integ.py tests/test_watchdog_integ.py tests/test_watchdog_faults.py tests/test_torch_backends_integ.py \
	tests/test_api.py tests/test_server.py tests/test_server_integ.py tests/test_transport.py \
	tests/test_transport_contract.py \
	tests/test_transport_example.py tests/test_reconfigure_integ.py tests/test_reconfigure.py \
	tests/test_split_integ.py tests/test_elastic_integ.py tests/test_elastic_launcher.py \
	tests/test_fsdp.py tests/test_fsdp_integ.py tests/test_pipelining.py tests/test_pipelining_integ.py \
	tests/test_pipelining_fsdp.py tests/test_pipelining_edges.py
# ...and on the Python recorder too: torch's own reconfigure and split.
TORCH_PYTHON_RECORDER_TESTS := tests/test_reconfigure_integ.py tests/test_reconfigure.py \
	tests/test_split_integ.py

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

.PHONY: setup native demo test test-python test-torch214 test-torch215 test-torch-suite lint typecheck unit clean browser

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP_ENV) $(PY) -m pip install -q torch==$(TORCH) 'setuptools>=68' wheel
	TETHER_BUILD_NATIVE=0 $(PIP_ENV) $(PY) -m pip install -q --no-build-isolation -e '.[dev]'
	$(PIP_ENV) $(PY) -m pip install -q --no-deps nixl-cu12==1.5.1
	touch $(STAMP)

# The native recording core, compiled against the venv's torch (about a minute); rebuilt only
# when its source changes. Without a compiler tether still installs, on its Python recorder.
$(NATIVE): $(STAMP) tether/csrc/recording.cpp setup.py
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

# Headless Chromium for the debug server's browser test (tests/test_server_integ.py); needs root.
browser:
	@test -x /usr/bin/chromium || { apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; }

unit: $(STAMP) $(NATIVE) browser
	$(VENV)/bin/tether doctor --require-native
	$(PY) -m pytest
	TETHER_RECORDER=python $(PY) -m pytest $(RECORDER_TESTS)

test: lint typecheck unit

test-torch214: browser
	$(MAKE) TORCH=2.14.1 VENV=$(VENV214) setup
	$(VENV214)/bin/tether doctor --require-native
	$(VENV214)/bin/python -m pytest $(TORCH_TESTS)
	TETHER_RECORDER=python $(VENV214)/bin/python -m pytest $(TORCH_PYTHON_RECORDER_TESTS)

test-torch215: browser
	$(MAKE) TORCH=2.15.0 VENV=$(VENV215) PYTHON=$(PYTHON312) PIP_ENV='$(PIP215)' setup
	$(VENV215)/bin/tether doctor --require-native
	$(VENV215)/bin/python -m pytest $(TORCH_TESTS)
	TETHER_RECORDER=python $(VENV215)/bin/python -m pytest $(TORCH_PYTHON_RECORDER_TESTS)

# torch's own distributed tests, on plain torch and with tether installed in every process; every
# test must end the same way (tests/torch_suite/run.py; K=... selects, as pytest's -k).
test-torch-suite: $(STAMP) $(NATIVE)
	$(PY) tests/torch_suite/run.py $(if $(K),-k "$(K)")

test-python: $(STAMP) browser
	TETHER_RECORDER=python $(PY) -m pytest

clean:
	rm -rf $(VENV) $(VENV214) $(VENV215) tether-dumps .pytest_cache .mypy_cache .ruff_cache build tether/_native*.so
