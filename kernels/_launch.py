"""The one launch shim every launcher goes through.

Under ``TRITON_INTERPRET=1`` the raw ``@triton.jit`` function is launched (the interpreter runs it on
CPU tensors); otherwise it is wrapped with ``torch.library.wrap_triton`` so ``torch.compile`` can
trace through the custom ops that call it.
"""

from __future__ import annotations

import os

import torch

from .dispatch import Backend, select_backend

INTERPRET: bool = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def launchable(kernel):
    """Return ``kernel`` in the form that can be indexed with a grid and called."""
    if INTERPRET or not hasattr(torch.library, "wrap_triton"):
        return kernel
    return torch.library.wrap_triton(kernel)


def triton_unsupported_reasons(t: torch.Tensor) -> list[str]:
    """Why the Triton kernels cannot run on ``t`` (empty: they can)."""
    if t.is_cuda or INTERPRET:
        return []
    return [
        f"the Triton kernels need CUDA tensors (or TRITON_INTERPRET=1, set before import), got {t.device}"
    ]


VARLEN_BACKENDS = (Backend("triton", triton_unsupported_reasons), Backend("reference", lambda t: []))


def use_triton(t: torch.Tensor) -> bool:
    """True when the Triton kernel (rather than the torch reference) should run on ``t``.

    CUDA tensors take the kernel and CPU tensors the reference, except under the interpreter
    (``TRITON_INTERPRET=1``), where CPU tensors take the kernel too. ``MMBALANCE_VARLEN_BACKEND``
    forces the choice for the varlen ops (:func:`~mmbalance.kernels.dispatch.select_backend`):
    ``reference`` (plain torch everywhere) or ``triton`` (the kernel; a ``ValueError`` says why
    where it cannot run).
    """
    return select_backend("varlen ops", VARLEN_BACKENDS, None, t, env="MMBALANCE_VARLEN_BACKEND") == "triton"
