"""Backend selection, one rule for every op that has more than one implementation.

Each implementation (a *backend*) says why it cannot run a given call: ``not_supported_reasons``
returns a list of short sentences, empty when it can (as xformers' attention operators do). The
choice is then made the same way everywhere:

* a backend named by the caller (``backend="triton"``) runs if it can, and otherwise raises a
  ``ValueError`` that names the argument and lists the reasons;
* ``"auto"`` (or ``None``) reads the op's environment variable (``MMBALANCE_ATTN_BACKEND``,
  ``MMBALANCE_VARLEN_BACKEND``, ``MMBALANCE_OVERLAP_BACKEND``), which forces a backend for a whole
  run the same way, and otherwise takes the first backend in the op's order of preference that
  can run;
* an unknown name, in the argument or in the variable, is a ``ValueError`` naming both.

Nothing falls back silently: a forced backend that cannot run is an error, and "auto" only ever
picks among backends that can run the call exactly.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

__all__ = ["INTERPRET", "Backend", "select_backend", "triton_unsupported_reasons", "use_triton"]

INTERPRET: bool = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@dataclass(frozen=True)
class Backend:
    """One implementation of an op: its name and why it cannot run a call (``[]``: it can)."""

    name: str
    not_supported_reasons: Callable[..., list[str]]


def select_backend(
    op: str,
    backends: Sequence[Backend],
    requested: str | None,
    *call,
    env: str | None = None,
    argument: str = "backend",
) -> str:
    """The backend that runs this call of ``op`` (see the module docstring).

    Args:
        op: the op's name, for messages.
        backends: the op's backends, in order of preference for ``"auto"``.
        requested: the caller's choice: a backend name, ``"auto"`` or ``None``.
        *call: what the backends' ``not_supported_reasons`` take (tensors, flags, ...).
        env: the environment variable that can force a backend for the run.
        argument: the caller's name for ``requested`` (messages name it).

    Raises:
        ValueError: an unknown name, or a forced backend that cannot run the call (with why).
    """
    names = [b.name for b in backends]
    choices = ("auto", *names)
    if requested is None:
        requested = "auto"
    if not isinstance(requested, str) or requested not in choices:
        raise ValueError(f"{argument} must be one of {choices}, got {requested!r}")
    source = f"{argument}={requested!r}"
    if requested == "auto" and env:
        forced = os.environ.get(env, "").strip().lower()
        if forced and forced != "auto":
            if forced not in names:
                raise ValueError(f"{env} must be one of {choices}, got {forced!r}")
            requested, source = forced, f"{env}={forced}"
    if requested != "auto":
        backend = backends[names.index(requested)]
        reasons = backend.not_supported_reasons(*call)
        if reasons:
            raise ValueError(f"{op}: {source} cannot run this call: {'; '.join(reasons)}")
        return backend.name
    why = {}
    for backend in backends:
        reasons = backend.not_supported_reasons(*call)
        if not reasons:
            return backend.name
        why[backend.name] = reasons
    detail = "; ".join(f"{name}: {', '.join(r)}" for name, r in why.items())
    raise ValueError(f"{op}: no backend can run this call ({detail})")


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
    forces the choice for the varlen ops (:func:`select_backend`):
    ``reference`` (plain torch everywhere) or ``triton`` (the kernel; a ``ValueError`` says why
    where it cannot run).
    """
    return select_backend("varlen ops", VARLEN_BACKENDS, None, t, env="MMBALANCE_VARLEN_BACKEND") == "triton"
