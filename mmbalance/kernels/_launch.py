"""The one launch shim every launcher goes through.

Under ``TRITON_INTERPRET=1`` the raw ``@triton.jit`` function is launched (the interpreter runs it on
CPU tensors); otherwise it is wrapped with ``torch.library.wrap_triton`` so ``torch.compile`` can
trace through the custom ops that call it.
"""

from __future__ import annotations

import torch

from .dispatch import INTERPRET, VARLEN_BACKENDS, triton_unsupported_reasons, use_triton

__all__ = ["INTERPRET", "VARLEN_BACKENDS", "launchable", "triton_unsupported_reasons", "use_triton"]


def launchable(kernel):
    """Return ``kernel`` in the form that can be indexed with a grid and called."""
    if INTERPRET or not hasattr(torch.library, "wrap_triton"):
        return kernel
    return torch.library.wrap_triton(kernel)
