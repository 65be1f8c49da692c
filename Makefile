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
# subprocess of $(PEERS_VENV)/bin/python. Only what its balancer module imports is installed, on
# .venv's packages (layered as the test matrix is, below: torch 2.13.0 is not installed twice). A
# .venv that got verl from an older version of this target gets our own pins back.
# verl is installed with --no-deps on purpose, so pip's resolver reports verl's unmet pins as
# "ERROR: pip's dependency resolver ..." lines: expected, and kept in $(PEERS_LOG), not on screen.
PEERS_LOG := $(PEERS_VENV)/install.log
$(PEERS): scripts/layer_venv.py | $(STAMP)
	@echo "setting up $(PEERS_VENV): verl 0.9.1, the planner benchmark's peer, in an environment of its own (its pins conflict with ours; pip's expected resolver messages go to $(PEERS_LOG))"
	@rm -rf $(PEERS_VENV)
	@$(PYTHON) -m venv $(PEERS_VENV)
	@( set -e; \
	  $(call layer,$(PEERS_VENV),$(VENV)); \
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
# once and reused, layered on .venv (scripts/layer_venv.py: .venv's packages come after its own),
# so pip takes torch 2.13.0 and whatever else .venv already satisfies from there and installs only
# what the release needs differently (transformers itself, for older releases huggingface_hub and
# tokenizers): about 150 MB instead of 2.7 GB with a torch and triton of its own. The requirements
# are the package's test requirements (scripts/requirements.py reads them from pyproject.toml) with
# that transformers. The tests import the package from the checkout, whose compiled core .venv has
# built.
TF_MATRIX := 5.6.0 5.10.4 5.16.1 5.19.0
TF_STAMPS := $(TF_MATRIX:%=.venv-tf%/.installed)

# $(call layer,NEW_VENV,BASE_VENV): NEW_VENV sees BASE_VENV's packages after its own, and runs BASE_VENV's
# console scripts (torchrun) with its own interpreter (scripts/layer_venv.py)
layer = $(1)/bin/python scripts/layer_venv.py $(1) $(2)

$(TF_STAMPS): .venv-tf%/.installed: pyproject.toml scripts/requirements.py scripts/layer_venv.py | $(STAMP)
	@echo "setting up .venv-tf$*: transformers $* for the test matrix, on .venv's packages (log: .venv-tf$*/install.log)"
	@rm -rf .venv-tf$*
	@$(PYTHON) -m venv .venv-tf$*
	@( set -e; \
	  $(call layer,.venv-tf$*,$(VENV)); \
	  $(PYTHON) scripts/requirements.py test > .venv-tf$*/requirements.txt; \
	  .venv-tf$*/bin/pip install -r .venv-tf$*/requirements.txt "transformers==$*"; \
	) > .venv-tf$*/install.log 2>&1 || { tail -n 20 .venv-tf$*/install.log; echo "setting up .venv-tf$* failed"; exit 1; }
	@.venv-tf$*/bin/python -c "import transformers, torch, sys; sys.exit(transformers.__version__ != '$*' or torch.__version__.split('+')[0] != '2.13.0')" \
	  || { echo ".venv-tf$* does not hold transformers $* beside torch 2.13.0"; exit 1; }
	@touch $@

# tests/integrations on every release of the matrix, but for the slow tests that repeat paths the
# others reach (tests/integrations/conftest.py names the slow ones every release runs); the whole of
# tests/integrations runs on the newest release in .venv (make test's suite). scripts/test_matrix.sh
# runs them (MATRIX_JOBS releases at a time, default 1)
MATRIX_MARKS := not slow or matrix
test-matrix: $(STAMP) $(TF_STAMPS)
	@MATRIX_MARKS="$(MATRIX_MARKS)" scripts/test_matrix.sh $(TF_MATRIX)

# The frameworks people start training from, each in an environment of its own (they pin torch and
# transformers differently): LLaMA-Factory 0.9.5 (transformers 5.6.0) and ms-swift 4.6.0 (5.19.0),
# with this checkout installed in place (pip install --no-deps -e .). Qwen2-VL's processor needs
# torchvision, which loads only beside the torch it was built for: torch 2.14.1 and torchvision
# 0.29.1, pinned on every install so that pip keeps them (on this project's machines both come from
# the local disk). That pair is a CUDA build of about 5.5 GB, so it is installed once, in
# .venv-fw-torch, and both framework environments are layered on it (as the matrix is on .venv).
FW_TORCH := torch==2.14.1 torchvision==0.29.1
FW_BASE := .venv-fw-torch
FRAMEWORKS := llamafactory swift
FW_STAMPS := $(FRAMEWORKS:%=.venv-%/.installed)
FW_PACKAGE_llamafactory := llamafactory==0.9.5
FW_PACKAGE_swift := ms-swift==4.6.0 qwen_vl_utils

$(FW_BASE)/.installed:
	@echo "setting up $(FW_BASE): $(FW_TORCH), shared by the framework environments (log: $(FW_BASE)/install.log)"
	@rm -rf $(FW_BASE)
	@$(PYTHON) -m venv $(FW_BASE)
	@$(FW_BASE)/bin/pip install $(FW_TORCH) > $(FW_BASE)/install.log 2>&1 \
	  || { tail -n 20 $(FW_BASE)/install.log; echo "setting up $(FW_BASE) failed"; exit 1; }
	@touch $@

$(FW_STAMPS): .venv-%/.installed: pyproject.toml setup.py scripts/requirements.py scripts/layer_venv.py \
  | $(STAMP) $(FW_BASE)/.installed
	@echo "setting up .venv-$*: $(FW_PACKAGE_$*) for the framework tests, on $(FW_BASE) (log: .venv-$*/install.log)"
	@rm -rf .venv-$*
	@$(PYTHON) -m venv .venv-$*
	@( set -e; \
	  $(call layer,.venv-$*,$(FW_BASE)); \
	  .venv-$*/bin/pip install $(FW_PACKAGE_$*) $(FW_TORCH); \
	  $(PYTHON) scripts/requirements.py hf > .venv-$*/requirements.txt; \
	  .venv-$*/bin/pip install -r .venv-$*/requirements.txt pytest $(FW_TORCH); \
	  .venv-$*/bin/pip install --no-deps -e .; \
	  .venv-$*/bin/pip check; \
	) > .venv-$*/install.log 2>&1 || { tail -n 20 .venv-$*/install.log; echo "setting up .venv-$* failed"; exit 1; }
	@.venv-$*/bin/python -c "import torch, torchvision, sys; sys.exit(not torch.__file__.startswith('$(CURDIR)/$(FW_BASE)/'))" \
	  || { echo ".venv-$* does not take torch from $(FW_BASE)"; exit 1; }
	@touch $@

# LLaMA-Factory's and ms-swift's SFT of a tiny Qwen2-VL on 2 CPU ranks, plain and through
# `mmbalance launch` (tests/frameworks: pytest runs here, the frameworks in their environments)
# (FW_MARKS="not extended": the runs .ci/run keeps, tests/frameworks/conftest.py)
FW_MARKS ?= not soak
test-frameworks: $(STAMP) $(FW_STAMPS)
	$(PY) -m pytest -q -p no:cacheprovider --durations 10 -m "$(FW_MARKS)" tests/frameworks

run: $(STAMP) $(PEERS)
	$(VENV)/bin/mmbalance bench planners
	$(VENV)/bin/mmbalance demo --json results/demo.json --plot results/demo.png

# every step runs even when one before it failed; each step's time as it ends, and at the end the
# steps that failed, by name (exit 1). STEPS="suite mypy" runs some of them only.
test: $(STAMP) $(TF_STAMPS)
	@PY=$(PY) VENV=$(VENV) PYTHON=$(PYTHON) MAKE="$(MAKE)" scripts/make_test.sh $(STEPS)

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
	rm -rf $(VENV) $(PEERS_VENV) .venv-tf* $(FW_BASE) .venv-llamafactory .venv-swift build *.egg-info mmbalance/_core*.so
