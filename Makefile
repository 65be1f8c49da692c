# The two commands of the README, plus what they need. Every target creates/reuses .venv.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed

.PHONY: run test bench lint audit clean peers wheel-check

$(PY):
	$(PYTHON) -m venv $(VENV)

# torch==2.13.0 first: that CPU build installs from local disk; the rest from the package index.
$(STAMP): $(PY) pyproject.toml setup.py $(wildcard csrc/*.cpp csrc/*.hpp)
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e ".[dev]"
	touch $(STAMP)

PEERS := $(VENV)/.peers

# verl's Karmarkar-Karp balancer, the peer the planner benchmark compares against (its own
# dependency set is large; only the parts its balancer module imports are installed).
$(PEERS): $(STAMP)
	$(PIP) install -q --no-deps verl==0.9.1
	$(PIP) install -q packaging omegaconf 'tensordict>=0.8,<=0.10' 'transformers>=5.5.3,<5.11' ray
	touch $(PEERS)

peers: $(PEERS)

run: $(STAMP) $(PEERS)
	$(VENV)/bin/mmbalance bench planners
	$(VENV)/bin/mmbalance demo --json results/demo.json --plot results/demo.png

test: $(STAMP)
	$(PY) -m pytest -q tests
	$(PY) -m mmbalance.bench.kernel_audit --arch sm_90
	PYTHON=$(PYTHON) .ci/check_wheel

bench: $(STAMP)
	$(VENV)/bin/mmbalance bench

# Build the wheel, install it into a fresh environment and run every command outside the tree.
wheel-check:
	PYTHON=$(PYTHON) .ci/check_wheel

lint: $(STAMP)
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

clean:
	rm -rf $(VENV) build *.egg-info mmbalance/_core*.so
