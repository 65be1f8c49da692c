"""The one launch shim every launcher goes through.

Under ``TRITON_INTERPRET=1`` the raw ``@triton.jit`` function is launched (the interpreter runs it on
CPU tensors); otherwise it is wrapped with ``torch.library.wrap_triton`` so ``torch.compile`` can
trace through the custom ops that call it.
"""

from __future__ import annotations

import torch

from .dispatch import INTERPRET

__all__ = ["INTERPRET", "launchable"]


def launchable(kernel):
    """Return ``kernel`` in the form that can be indexed with a grid and called."""
    if INTERPRET or not hasattr(torch.library, "wrap_triton"):
        return kernel
    return torch.library.wrap_triton(kernel)
