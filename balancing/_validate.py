"""Input validation shared by every planner: clear ``ValueError``/``TypeError`` naming the argument."""

from __future__ import annotations

import numbers

import numpy as np


def as_lengths(lengths, name: str = "lengths") -> np.ndarray:
    """``lengths`` as a contiguous int64 array of non-negative integers (1-D)."""
    if isinstance(lengths, (str, bytes)):
        raise TypeError(f"{name} must be a sequence of non-negative integers, got {type(lengths).__name__}")
    if hasattr(lengths, "detach") and hasattr(lengths, "cpu"):  # a torch tensor, without importing torch
        lengths = lengths.detach().cpu().numpy()
    try:
        arr = np.asarray(lengths)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"{name} must be a sequence of non-negative integers") from exc
    if arr.dtype == object:
        raise TypeError(f"{name} must be a sequence of non-negative integers, got objects")
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {arr.shape}")
    if arr.dtype.kind == "b":
        raise TypeError(f"{name} must hold integers, got booleans")
    if arr.dtype.kind == "f":
        if not np.all(np.isfinite(arr)):
            raise ValueError(f"{name} must be finite integers")
        if np.any(arr != np.round(arr)):
            bad = int(np.flatnonzero(arr != np.round(arr))[0])
            raise ValueError(f"{name} must be integers; {name}[{bad}] = {arr[bad]!r}")
        if arr.size and np.max(np.abs(arr)) >= 2**62:
            raise ValueError(f"{name} values are too large")
    elif arr.dtype.kind not in "iu":
        raise TypeError(f"{name} must hold integers, got dtype {arr.dtype}")
    if arr.dtype.kind == "u" and arr.size and arr.max() >= 2**62:
        raise ValueError(f"{name} values are too large")
    arr = np.ascontiguousarray(arr, dtype=np.int64)
    if arr.size and arr.min() < 0:
        bad = int(np.flatnonzero(arr < 0)[0])
        raise ValueError(f"{name} must be non-negative; {name}[{bad}] = {arr[bad]}")
    return arr


def as_count(value, name: str, minimum: int = 1) -> int:
    """A Python int >= ``minimum`` (numpy integers accepted, bools and floats rejected)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    value = int(value)
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def as_ranks(values, n: int, num_ranks: int, name: str) -> np.ndarray:
    """Per-example rank ids: int64 [n], each in [0, num_ranks)."""
    arr = as_lengths(values, name)  # same integer checks
    if arr.shape[0] != n:
        raise ValueError(f"{name} must have one entry per example ({n}), got {arr.shape[0]}")
    if arr.size and arr.max() >= num_ranks:
        bad = int(np.flatnonzero(arr >= num_ranks)[0])
        raise ValueError(f"{name}[{bad}] = {arr[bad]} is out of range for {num_ranks} ranks")
    return arr


def as_coefficient(value, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
    value = float(value)
    if not np.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be finite and >= 0, got {value}")
    return value
