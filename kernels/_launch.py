"""The one launch shim every launcher goes through.

Under ``TRITON_INTERPRET=1`` the raw ``@triton.jit`` function is launched (the interpreter runs it on
CPU tensors); otherwise it is wrapped with ``torch.library.wrap_triton`` so ``torch.compile`` can
trace through the custom ops that call it.
"""

from __future__ import annotations

import os

import torch

INTERPRET: bool = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def launchable(kernel):
    """Return ``kernel`` in the form that can be indexed with a grid and called."""
    if INTERPRET or not hasattr(torch.library, "wrap_triton"):
        return kernel
    return torch.library.wrap_triton(kernel)


def use_triton(t: torch.Tensor) -> bool:
    """True when the Triton kernel (rather than the torch reference) should run on ``t``.

    CUDA tensors take the kernel and CPU tensors the reference, except under the interpreter
    (``TRITON_INTERPRET=1``), where CPU tensors take the kernel too. ``MMBALANCE_VARLEN_BACKEND``
    forces the choice for the varlen ops: ``reference`` (plain torch everywhere) or ``triton`` (the
    kernel; on CPU tensors only under the interpreter, otherwise a ``RuntimeError`` says why).
    """
    forced = os.environ.get("MMBALANCE_VARLEN_BACKEND", "").strip().lower()
    if forced == "reference":
        return False
    if forced == "triton":
        if not (t.is_cuda or INTERPRET):
            raise RuntimeError("MMBALANCE_VARLEN_BACKEND=triton needs CUDA tensors or TRITON_INTERPRET=1")
        return True
    if forced not in ("", "auto"):
        raise ValueError(f"MMBALANCE_VARLEN_BACKEND must be auto, reference or triton, got {forced!r}")
    return t.is_cuda or INTERPRET
