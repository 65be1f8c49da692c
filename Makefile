# The two commands of the README, plus what they need. Every target creates/reuses .venv.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed

.PHONY: run test bench lint typecheck audit clean peers wheel-check

$(PY):
	$(PYTHON) -m venv $(VENV)

# torch==2.13.0 first: that CPU build installs from local disk; the rest from the package index.
$(STAMP): $(PY) pyproject.toml setup.py $(wildcard csrc/*.cpp csrc/*.hpp)
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e ".[dev]"
	touch $(STAMP)

PEERS_VENV := .venv-peers
PEERS := $(PEERS_VENV)/.installed

# verl's Karmarkar-Karp balancer, the peer the planner benchmark compares against, in an environment
# of its own: its pins (transformers<5.11) conflict with ours, so the benchmark runs it in a
# subprocess of $(PEERS_VENV)/bin/python. Only what its balancer module imports is installed. A
# .venv that got verl from an older version of this target gets our own pins back.
# verl is installed with --no-deps on purpose, so pip's resolver reports verl's unmet pins as
# "ERROR: pip's dependency resolver ..." lines: expected, and kept in $(PEERS_LOG), not on screen.
PEERS_LOG := $(PEERS_VENV)/install.log
$(PEERS):
	@echo "setting up $(PEERS_VENV): verl 0.9.1, the planner benchmark's peer, in an environment of its own (its pins conflict with ours; pip's expected resolver messages go to $(PEERS_LOG))"
	@$(PYTHON) -m venv $(PEERS_VENV)
	@( set -e; \
	  $(PEERS_VENV)/bin/pip install -q torch==2.13.0; \
	  $(PEERS_VENV)/bin/pip install -q --no-deps verl==0.9.1; \
	  $(PEERS_VENV)/bin/pip install -q numpy packaging omegaconf 'tensordict>=0.8,<=0.10' 'transformers>=5.5.3,<5.11' ray; \
	) > $(PEERS_LOG) 2>&1 || { tail -n 20 $(PEERS_LOG); echo "setting up $(PEERS_VENV) failed: see $(PEERS_LOG)"; exit 1; }
	@$(PEERS_VENV)/bin/python -c "import verl.utils.seqlen_balancing" >> $(PEERS_LOG) 2>&1 || { tail -n 20 $(PEERS_LOG); echo "verl does not import in $(PEERS_VENV): see $(PEERS_LOG)"; exit 1; }
	@if [ -f $(VENV)/.peers ]; then $(PIP) uninstall -q -y verl && $(PIP) install -q -e ".[dev]" && rm -f $(VENV)/.peers; fi
	@touch $(PEERS)

peers: $(PEERS)

run: $(STAMP) $(PEERS)
	$(VENV)/bin/mmbalance bench planners
	$(VENV)/bin/mmbalance demo --json results/demo.json --plot results/demo.png

test: $(STAMP)
	$(PY) -m pytest -q tests
	$(VENV)/bin/mypy
	$(PY) -m mmbalance.bench.kernel_audit --arch sm_90
	$(PY) -m mmbalance.bench.kernel_audit --arch sm_80
	PYTHON=$(PYTHON) .ci/check_wheel

bench: $(STAMP)
	$(VENV)/bin/mmbalance bench

# Build the wheel, install it into a fresh environment and run every command outside the tree.
wheel-check:
	PYTHON=$(PYTHON) .ci/check_wheel

# the type check `make test` runs: mypy over the package, configured in pyproject.toml
typecheck: $(STAMP)
	$(VENV)/bin/mypy

lint: $(STAMP)
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

clean:
	rm -rf $(VENV) $(PEERS_VENV) build *.egg-info mmbalance/_core*.so
