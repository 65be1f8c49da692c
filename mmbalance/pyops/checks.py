"""When the value checks run: the one reading of ``MMBALANCE_DEBUG``.

Checks that read tensor values (``cu_seqlens`` monotonic, lengths that match a plan, indices in
range) need a device-to-host sync on CUDA. Every op and collective of the package runs them on
CPU tensors always, on CUDA tensors only with ``MMBALANCE_DEBUG=1``, and never while
``torch.compile`` traces (or on fake and meta tensors, which have no values).
"""

from __future__ import annotations

import os

import torch
from torch._subclasses.fake_tensor import FakeTensor

__all__ = ["debug_enabled", "value_checks_enabled"]


def debug_enabled() -> bool:
    """``MMBALANCE_DEBUG`` is set to something other than ``0`` (read at every call, so a test or
    a user can flip it at run time)."""
    return os.environ.get("MMBALANCE_DEBUG", "0") not in ("", "0")


def value_checks_enabled(t: torch.Tensor) -> bool:
    """Whether checks that read the values of ``t`` should run (see the module docstring)."""
    if isinstance(t, FakeTensor) or t.device.type == "meta" or torch.compiler.is_compiling():
        return False
    return t.device.type == "cpu" or debug_enabled()
