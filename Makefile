# `make demo` and `make test` set everything up themselves on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
NATIVE := $(VENV)/.native
SOURCES := tether tests $(wildcard bench) $(wildcard examples)
# The recorder's tests, run a second time on the Python recorder (the first run uses the core):
# recording on every issue path, clients bit-identical, dumps torch's analyzer reads, the ring
# file after a death, the fault corpus's diagnoses. `make test-python` runs the whole suite on it.
RECORDER_TESTS := tests/test_recorder_integ.py tests/test_clients_integ.py tests/test_api.py \
	tests/test_dump_write.py tests/test_ringfile.py tests/test_launcher_faults_integ.py \
	tests/test_analyze_jobs_integ.py tests/test_fault_corpus_integ.py

.PHONY: setup native demo test test-python lint typecheck unit clean browser

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0 'setuptools>=68' wheel
	TETHER_BUILD_NATIVE=0 $(PY) -m pip install -q --no-build-isolation -e '.[dev]'
	$(PY) -m pip install -q --no-deps nixl-cu12==1.5.1
	touch $(STAMP)

# The native recording core, compiled against the venv's torch (about a minute); rebuilt only
# when its source changes. Without a compiler tether still installs, on its Python recorder.
$(NATIVE): $(STAMP) tether/csrc/recording.cpp setup.py
	$(PY) -m pip install -q --no-build-isolation --no-deps -e .
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

test-python: $(STAMP) browser
	TETHER_RECORDER=python $(PY) -m pytest

clean:
	rm -rf $(VENV) tether-dumps .pytest_cache .mypy_cache .ruff_cache build tether/_native*.so
