"""mmbalance: load balancing for multimodal LLM training.

The package is assembled from the repository's layer folders (see DESIGN.md): ``balancing``
(planners, numpy only), ``kernels`` (Triton), ``pyops`` (``torch.ops.mmbalance.*``),
``collectives`` (everything that talks between ranks), ``integrations`` (Hugging Face models, data
samplers) and ``bench`` (benchmarks, demo, simulator). Importing ``mmbalance`` is cheap and does
not import torch, so ``mmbalance.balancing`` can be used in data-loader workers.
"""

from __future__ import annotations

import importlib
import os

__version__ = "0.1.0"

# In a source checkout the layer folders sit next to this package rather than inside it. Extending
# ``__path__`` makes ``mmbalance.balancing`` resolve to ``<repo>/balancing`` there; an installed
# wheel has them inside the package and this does nothing.
_repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if os.path.isfile(os.path.join(_repo, "pyproject.toml")) and os.path.isdir(os.path.join(_repo, "balancing")):
    __path__.append(_repo)  # type: ignore[name-defined]  # noqa: F821

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
