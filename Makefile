# The two commands of the README, plus what they need. Every target creates/reuses .venv.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed

.PHONY: run test test-matrix test-frameworks bench lint typecheck audit clean peers wheel-check

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

# The Hugging Face integration's test matrix: the transformers releases the trainers people run
# resolve to (llamafactory 0.9.5: 5.6.0, the floor; verl 0.9.1: 5.10.4; axolotl 0.19.0: 5.16.1;
# ms-swift 4.6.0: 5.19.0); .venv holds the newest. Each release gets an environment of its own, built
# once and reused: torch 2.13.0 first, then the package's test requirements (scripts/requirements.py
# reads them from pyproject.toml) with that transformers. The tests import the package from the
# checkout, whose compiled core .venv has built (no second build per environment).
TF_MATRIX := 5.6.0 5.10.4 5.16.1 5.19.0
TF_STAMPS := $(TF_MATRIX:%=.venv-tf%/.installed)

$(TF_STAMPS): .venv-tf%/.installed: pyproject.toml scripts/requirements.py | $(STAMP)
	@echo "setting up .venv-tf$*: transformers $* for the test matrix (log: .venv-tf$*/install.log)"
	@$(PYTHON) -m venv .venv-tf$*
	@( set -e; \
	  .venv-tf$*/bin/pip install -q torch==2.13.0; \
	  $(PYTHON) scripts/requirements.py test > .venv-tf$*/requirements.txt; \
	  .venv-tf$*/bin/pip install -q -r .venv-tf$*/requirements.txt "transformers==$*"; \
	) > .venv-tf$*/install.log 2>&1 || { tail -n 20 .venv-tf$*/install.log; echo "setting up .venv-tf$* failed"; exit 1; }
	@.venv-tf$*/bin/python -c "import transformers, sys; sys.exit(transformers.__version__ != '$*')" \
	  || { echo ".venv-tf$* does not hold transformers $*"; exit 1; }
	@touch $@

# tests/integrations, distributed ones included, on every release of the matrix
test-matrix: $(STAMP) $(TF_STAMPS)
	@failed=""; for v in $(TF_MATRIX); do \
	  echo "== tests/integrations on transformers $$v"; \
	  PYTHONPATH=$(CURDIR) .venv-tf$$v/bin/python -m pytest -q -p no:cacheprovider tests/integrations || failed="$$failed $$v"; \
	done; \
	if [ -n "$$failed" ]; then echo "tests/integrations failed on transformers$$failed"; exit 1; fi

# The frameworks people start training from, each in an environment of its own (they pin torch and
# transformers differently): LLaMA-Factory 0.9.5 (transformers 5.6.0) and ms-swift 4.6.0 (5.19.0),
# with this checkout installed in place (pip install --no-deps -e .). Qwen2-VL's processor needs
# torchvision, which loads only beside the torch it was built for: torch 2.14.1 and torchvision
# 0.29.1, pinned on every install so that pip keeps them (on this project's machines both come from
# the local disk).
FW_TORCH := torch==2.14.1 torchvision==0.29.1
FRAMEWORKS := llamafactory swift
FW_STAMPS := $(FRAMEWORKS:%=.venv-%/.installed)
FW_PACKAGE_llamafactory := llamafactory==0.9.5
FW_PACKAGE_swift := ms-swift==4.6.0 qwen_vl_utils

$(FW_STAMPS): .venv-%/.installed: pyproject.toml setup.py scripts/requirements.py | $(STAMP)
	@echo "setting up .venv-$*: $(FW_PACKAGE_$*) for the framework tests (log: .venv-$*/install.log)"
	@$(PYTHON) -m venv .venv-$*
	@( set -e; \
	  .venv-$*/bin/pip install -q $(FW_TORCH); \
	  .venv-$*/bin/pip install -q $(FW_PACKAGE_$*) $(FW_TORCH); \
	  $(PYTHON) scripts/requirements.py hf > .venv-$*/requirements.txt; \
	  .venv-$*/bin/pip install -q -r .venv-$*/requirements.txt pytest $(FW_TORCH); \
	  .venv-$*/bin/pip install -q --no-deps -e .; \
	  .venv-$*/bin/pip check; \
	) > .venv-$*/install.log 2>&1 || { tail -n 20 .venv-$*/install.log; echo "setting up .venv-$* failed"; exit 1; }
	@touch $@

# LLaMA-Factory's and ms-swift's SFT of a tiny Qwen2-VL on 2 CPU ranks, plain and through
# `mmbalance launch` (tests/frameworks: pytest runs here, the frameworks in their environments)
test-frameworks: $(STAMP) $(FW_STAMPS)
	$(PY) -m pytest -q -p no:cacheprovider tests/frameworks

run: $(STAMP) $(PEERS)
	$(VENV)/bin/mmbalance bench planners
	$(VENV)/bin/mmbalance demo --json results/demo.json --plot results/demo.png

test: $(STAMP) $(TF_STAMPS)
	$(PY) -m pytest -q tests --ignore=tests/frameworks
	$(MAKE) --no-print-directory test-matrix
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
	rm -rf $(VENV) $(PEERS_VENV) .venv-tf* .venv-llamafactory .venv-swift build *.egg-info mmbalance/_core*.so
