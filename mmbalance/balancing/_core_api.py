"""The compiled core, imported once, with a clear message when it is missing."""

from __future__ import annotations

import importlib
from types import ModuleType

import numpy as np

_core: ModuleType | None
_IMPORT_ERROR: ImportError | None
try:
    _core = importlib.import_module("mmbalance._core")
except ImportError as exc:  # pragma: no cover - only without a build
    _core = None
    _IMPORT_ERROR = exc
else:
    _IMPORT_ERROR = None

POLICY_IDS = {"sum": 0, "padded": 1, "quadratic": 2, "conv": 3, "padded_quadratic": 4}


def core():
    if _core is None:
        raise ImportError(
            "mmbalance._core (the compiled planners) is not built: install the package with "
            "`pip install -e .` (needs a C++17 compiler)"
        ) from _IMPORT_ERROR
    return _core


def batch_costs(lengths, dst_rank, num_ranks: int, policy: str, alpha: float, beta: float) -> np.ndarray:
    return core().batch_costs(
        lengths, dst_rank, int(num_ranks), POLICY_IDS[policy], float(alpha), float(beta)
    )
