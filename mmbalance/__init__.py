"""mmbalance: load balancing for multimodal LLM training.

The package has one folder per layer (see DESIGN.md): ``balancing``
(planners, numpy only), ``kernels`` (Triton), ``pyops`` (``torch.ops.mmbalance.*``),
``collectives`` (everything that talks between ranks), ``integrations`` (Hugging Face models, data
samplers) and ``bench`` (benchmarks, demo, simulator). Importing ``mmbalance`` is cheap and does
not import torch, so ``mmbalance.balancing`` can be used in data-loader workers.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_SUBMODULES = ("balancing", "kernels", "pyops", "collectives", "integrations", "bench")


def __getattr__(name: str):
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    if name in ("post_balance", "Plan"):
        return getattr(importlib.import_module(f"{__name__}.balancing"), name)
    raise AttributeError(f"module 'mmbalance' has no attribute {name!r}")


# ``from mmbalance import *`` binds only what needs no torch: the planners. The torch layers
# (``kernels``, ``pyops``, ``collectives``, ``integrations``, ``bench``) load on attribute access.
__all__ = ["Plan", "post_balance", "__version__", "balancing"]
