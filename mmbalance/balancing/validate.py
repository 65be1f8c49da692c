"""Input validation shared by every planner, and by the layers above that take lengths, ranks and
coefficients: a clear ``ValueError``/``TypeError`` naming the argument, never a crash or a silently
wrong plan."""

from __future__ import annotations

import numbers

import numpy as np

__all__ = [
    "MAX_LENGTH",
    "MAX_RANKS",
    "MAX_TOTAL",
    "as_coefficient",
    "as_count",
    "as_lengths",
    "as_nonnegative",
    "as_num_ranks",
    "as_ranks",
]

# Limits that keep every plan exact and its memory bounded. Plans allocate O(num_ranks) per call,
# so a rank count far above any real job is refused rather than left to exhaust memory; lengths
# and their total stay within what float64 costs (53-bit mantissa) and int64 token counts hold.
MAX_RANKS = 1 << 20  # 1,048,576 ranks: 64x today's largest training jobs
MAX_LENGTH = 1 << 40  # tokens of one example
MAX_TOTAL = 1 << 53  # tokens of all examples together


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
        flat = arr.reshape(-1) if arr.ndim else [arr.item()]
        if all(isinstance(v, numbers.Integral) and not isinstance(v, bool) for v in flat):
            # Python ints beyond int64: report the value instead of a conversion failure.
            bad = next(k for k, v in enumerate(flat) if not -(2**63) <= int(v) < 2**63)
            raise ValueError(f"{name}[{bad}] = {int(flat[bad])} is too large (at most {MAX_LENGTH})")
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
        if arr.size and np.max(np.abs(arr)) > MAX_LENGTH:
            bad = int(np.argmax(np.abs(arr)))
            raise ValueError(f"{name}[{bad}] = {arr[bad]!r} is too large (at most {MAX_LENGTH})")
    elif arr.dtype.kind not in "iu":
        raise TypeError(f"{name} must hold integers, got dtype {arr.dtype}")
    if arr.dtype.kind == "u" and arr.size and arr.max() > MAX_LENGTH:
        bad = int(np.argmax(arr))
        raise ValueError(f"{name}[{bad}] = {arr[bad]} is too large (at most {MAX_LENGTH})")
    arr = np.ascontiguousarray(arr, dtype=np.int64)
    if arr.size:
        if arr.min() < 0:
            bad = int(np.flatnonzero(arr < 0)[0])
            raise ValueError(f"{name} must be non-negative; {name}[{bad}] = {arr[bad]}")
        if arr.max() > MAX_LENGTH:
            bad = int(np.argmax(arr))
            raise ValueError(f"{name}[{bad}] = {arr[bad]} is too large (at most {MAX_LENGTH})")
        if arr.size > MAX_TOTAL // MAX_LENGTH and float(arr.sum(dtype=np.float64)) > MAX_TOTAL:
            raise ValueError(f"{name} sum to more than {MAX_TOTAL} tokens")
    return arr


def as_count(value, name: str, minimum: int = 1, maximum: int | None = None) -> int:
    """A Python int in ``[minimum, maximum]`` (numpy integers accepted, bools and floats rejected)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    value = int(value)
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be <= {maximum}, got {value}")
    return value


def as_num_ranks(value, name: str = "num_ranks") -> int:
    """A rank count in ``[1, MAX_RANKS]``."""
    return as_count(value, name, 1, MAX_RANKS)


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


def as_nonnegative(x, name: str, ndim: int = 1, size: int | None = None, dims: str = "") -> np.ndarray:
    """``x`` as a contiguous float64 array of ``ndim`` dimensions with finite entries >= 0 (times,
    costs, sizes); ``size``: the length of a 1-D array, when it is fixed; ``dims``: the axes'
    names for messages (``"[microbatches, stages]"``)."""
    what = f"a {ndim}-D array of numbers"
    if isinstance(x, (str, bytes)):
        raise TypeError(f"{name} must be {what}, got {type(x).__name__}")
    try:
        a = np.asarray(x, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"{name} must be {what}") from exc
    if a.ndim != ndim or (size is not None and a.shape[0] != size):
        entries = f" with {size} entries" if size is not None else ""
        raise ValueError(
            f"{name} must be {ndim}-D{(' ' + dims) if dims else ''}{entries}, got shape {a.shape}"
        )
    bad = ~(np.isfinite(a) & (a >= 0))
    if bad.any():
        at = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ValueError(f"{name} must be finite and >= 0 ({name}{list(at)} = {float(a[at])!r})")
    return np.ascontiguousarray(a)
