"""The one launch shim every launcher goes through.

Under ``TRITON_INTERPRET=1`` the raw ``@triton.jit`` function is launched (the interpreter runs it on
CPU tensors). While ``torch.compile`` traces, it is wrapped with ``torch.library.wrap_triton`` so the
trace can go through the launch; eagerly (and when compiled code runs a custom op's body) the raw
kernel is launched, since the wrapper's eager path costs about a quarter of a millisecond of host
time per launch, many times a small kernel's own time.
"""

from __future__ import annotations

import torch

from .dispatch import INTERPRET

__all__ = ["INTERPRET", "launchable"]


def launchable(kernel):
    """Return ``kernel`` in the form that can be indexed with a grid and called."""
    if INTERPRET or not hasattr(torch.library, "wrap_triton") or not torch.compiler.is_compiling():
        return kernel
    return torch.library.wrap_triton(kernel)
