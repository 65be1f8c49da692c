"""Backend selection, one rule for every op that has more than one implementation.

Each implementation (a *backend*) says why it cannot run a given call: ``not_supported_reasons``
takes one object that describes the call (the op's typed inputs, such as the attention ops'
``AttentionInputs``: shapes, dtypes, device and the features used) and returns a list of short
sentences, empty when it can (as xformers' attention operators do). The choice is then made the
same way everywhere:

* a backend named by the caller (``backend="triton"``) runs if it can, and otherwise raises a
  ``ValueError`` that names the argument, describes the call and lists the reasons;
* ``"auto"`` (or ``None``) reads the op's environment variable (``MMBALANCE_ATTN_BACKEND``,
  ``MMBALANCE_VARLEN_BACKEND``, ``MMBALANCE_OVERLAP_BACKEND``), which forces a backend for a whole
  run the same way, and otherwise takes the first backend in the op's order of preference that
  can run; when none can, the ``ValueError`` lists every backend with its reasons;
* an unknown name, in the argument or in the variable, is a ``ValueError`` naming both.

Nothing falls back silently: a forced backend that cannot run is an error, and "auto" only ever
picks among backends that can run the call exactly.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

import torch

__all__ = [
    "INTERPRET",
    "Backend",
    "select_backend",
    "describe_inputs",
    "triton_unsupported_reasons",
    "use_triton",
    "VARLEN_BACKENDS",
]

INTERPRET: bool = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


Inputs = TypeVar("Inputs")


@dataclass(frozen=True)
class Backend(Generic[Inputs]):
    """One implementation of an op: its name and why it cannot run a call, read from the one
    object that describes the call (``[]``: it can)."""

    name: str
    not_supported_reasons: Callable[[Inputs], list[str]]


def describe_inputs(inputs: object) -> str:
    """One line for messages: a tensor by its shape, dtype and device (never its values), any
    other description of a call by its ``str``."""
    if isinstance(inputs, torch.Tensor):
        return f"a {inputs.dtype} tensor of shape {tuple(inputs.shape)} on {inputs.device}"
    return str(inputs)


def _refusal(headline: str, inputs: object, why: dict[str, list[str]]) -> str:
    """xformers' layout: what was asked, the call, then every backend tried with its reasons."""
    lines = [f"{headline} with inputs:", f"    {describe_inputs(inputs)}"]
    for name, reasons in why.items():
        lines.append(f"`{name}` cannot run it because:")
        lines += [f"    {reason}" for reason in reasons]
    return "\n".join(lines)


def select_backend(
    op: str,
    backends: Sequence[Backend[Inputs]],
    requested: str | None,
    inputs: Inputs,
    *,
    env: str | None = None,
    argument: str = "backend",
    prefer: Callable[[Inputs], Sequence[str]] | None = None,
) -> str:
    """The backend that runs this call of ``op`` (see the module docstring).

    Args:
        op: the op's name, for messages.
        backends: the op's backends, in order of preference for ``"auto"``.
        requested: the caller's choice: a backend name, ``"auto"`` or ``None``.
        inputs: what describes the call; every backend's ``not_supported_reasons`` reads it.
        env: the environment variable that can force a backend for the run.
        argument: the caller's name for ``requested`` (messages name it).
        prefer: for ``"auto"``, the names to try first for this call, in order (measured speed on
            the call's device); the other backends follow in ``backends``' order. Only the order
            changes: every backend still runs only calls it can run exactly.

    Raises:
        ValueError: an unknown name; a forced backend that cannot run the call (the call and the
            reasons); no backend that can (the call, and every backend with its reasons).
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
        # only the forced backend is asked: another's check may be a collective the run never makes
        backend = backends[names.index(requested)]
        reasons = backend.not_supported_reasons(inputs)
        if reasons:
            raise ValueError(
                _refusal(f"{op}: {source} cannot run this call", inputs, {backend.name: reasons})
            )
        return backend.name
    why = {}
    if prefer is not None:
        first = [n for n in prefer(inputs) if n in names]
        backends = [backends[names.index(n)] for n in first] + [b for b in backends if b.name not in first]
    for backend in backends:
        reasons = backend.not_supported_reasons(inputs)
        if not reasons:
            return backend.name
        why[backend.name] = reasons
    raise ValueError(_refusal(f"{op}: no backend can run this call", inputs, why))


def triton_unsupported_reasons(device: torch.device) -> list[str]:
    """Why the Triton kernels cannot run on tensors of ``device`` (empty: they can)."""
    if device.type == "cuda" or INTERPRET:
        return []
    return [f"the Triton kernels need CUDA tensors (or TRITON_INTERPRET=1, set before import), got {device}"]


# the varlen ops' calls are described by their payload tensor (its device)
VARLEN_BACKENDS: tuple[Backend[torch.Tensor], ...] = (
    Backend("triton", lambda t: triton_unsupported_reasons(t.device)),
    Backend("reference", lambda t: []),
)


def use_triton(t: torch.Tensor) -> bool:
    """True when the Triton kernel (rather than the torch reference) should run on ``t``.

    CUDA tensors take the kernel and CPU tensors the reference, except under the interpreter
    (``TRITON_INTERPRET=1``), where CPU tensors take the kernel too. ``MMBALANCE_VARLEN_BACKEND``
    forces the choice for the varlen ops (:func:`select_backend`):
    ``reference`` (plain torch everywhere) or ``triton`` (the kernel; a ``ValueError`` says why
    where it cannot run).
    """
    return select_backend("varlen ops", VARLEN_BACKENDS, None, t, env="MMBALANCE_VARLEN_BACKEND") == "triton"
