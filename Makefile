# The two commands of the README, plus what they need. Every target creates/reuses .venv.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed

.PHONY: run test bench lint audit clean

$(PY):
	$(PYTHON) -m venv $(VENV)

# torch==2.13.0 first: that CPU build installs from local disk; the rest from the package index.
$(STAMP): $(PY) pyproject.toml setup.py $(wildcard csrc/*.cpp csrc/*.hpp)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e ".[dev]"
	touch $(STAMP)

run: $(STAMP)
	$(VENV)/bin/mmbalance run

test: $(STAMP)
	$(PY) -m pytest -q tests
	$(PY) -m bench.kernel_audit --arch sm_90 --check

bench: $(STAMP)
	$(VENV)/bin/mmbalance bench

lint: $(STAMP)
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

clean:
	rm -rf $(VENV) build *.egg-info mmbalance/_core*.so
