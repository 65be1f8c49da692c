"""Input validation of the attention ops: the host scalars of the public functions (checked before
the dispatcher sees them), shapes, dtypes, devices, ``cu_seqlens`` and run tensors, the optional
features (windows, softcap, sinks), the backward's saved tensors and the merge inputs. Checks that
read tensor values follow the one rule of every ``pyops`` module (``pyops/checks.py``).
"""

from __future__ import annotations

import math

import torch

from .checks import value_checks_enabled

__all__ = [
    "FLOAT_DTYPES",
    "check_host_int",
    "check_host_args",
    "check_host_features",
    "check_block_args",
    "check_bwd_args",
    "check_lse",
    "check_merge_args",
    "check_features",
]

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _check_tensor(name: str, t, ndim: int | None = None) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")


def _check_float(name: str, t: torch.Tensor, op: str) -> None:
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{op}: {name} must be float16, bfloat16, float32 or float64, got {t.dtype}")


def _check_last_dim(name: str, t: torch.Tensor) -> None:
    if t.numel() and t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dimension (stride {t.stride(-1)})")


def _check_cu(
    name: str, cu: torch.Tensor, total: int, device: torch.device, max_seqlen, max_name: str
) -> None:
    _check_tensor(name, cu, 1)
    if cu.dtype != torch.int32:
        raise TypeError(f"{name} must be int32, got {cu.dtype}")
    if cu.device != device:
        raise ValueError(f"{name} is on {cu.device} but q is on {device}")
    if cu.numel() < 1:
        raise ValueError(f"{name} must have at least one entry (B + 1 with B >= 0)")
    if not value_checks_enabled(cu):
        return
    vals = cu.tolist()
    if vals[0] != 0:
        raise ValueError(f"{name} must start at 0, got {vals[0]}")
    if any(b < a for a, b in zip(vals, vals[1:])):
        raise ValueError(f"{name} must be non-decreasing")
    if vals[-1] != total:
        raise ValueError(f"{name} must end at the number of tokens {total}, got {vals[-1]}")
    longest = max((b - a for a, b in zip(vals, vals[1:])), default=0)
    if max_seqlen is not None and longest > max_seqlen:
        raise ValueError(f"{max_name} is {max_seqlen} but a sequence of {name} has {longest} tokens")


def _check_runs(name: str, runs: torch.Tensor, cu: torch.Tensor, device: torch.device) -> None:
    _check_tensor(name, runs, 2)
    if runs.dtype != torch.int32:
        raise TypeError(f"{name} must be int32, got {runs.dtype}")
    if runs.shape != (cu.numel() - 1, 3):
        raise ValueError(f"{name} must have shape (B, 3) = ({cu.numel() - 1}, 3), got {tuple(runs.shape)}")
    if runs.device != device:
        raise ValueError(f"{name} is on {runs.device} but q is on {device}")
    if not runs.is_contiguous():
        raise ValueError(f"{name} must be contiguous")
    if not value_checks_enabled(runs):
        return
    lengths = (cu[1:] - cu[:-1]).tolist()
    for b, ((start0, len0, start1), length) in enumerate(zip(runs.tolist(), lengths)):
        if len0 < 0:
            raise ValueError(f"{name}[{b}]: the first run length must be >= 0, got {len0}")
        if len0 < length and start1 < start0 + len0:
            raise ValueError(
                f"{name}[{b}]: the second run must start at or after {start0 + len0}, got {start1}"
            )


def check_host_int(name: str, val, minimum: int | None = None) -> None:
    """``val`` must be a host int (never a tensor: that would need a device sync), >= ``minimum``."""
    if isinstance(val, bool) or not isinstance(val, (int, torch.SymInt)):
        raise TypeError(f"{name} must be a Python int computed on the host, got {type(val).__name__}")
    if minimum is not None and val < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {val}")


def check_host_args(q, max_seqlen_q, max_seqlen_k, causal_offset, softmax_scale) -> float:
    """Check the host scalars of a block call before the dispatcher sees them (it would coerce or
    reject them with a schema error); returns the softmax scale (default ``D ** -0.5``)."""
    check_host_int("max_seqlen_q", max_seqlen_q, 0)
    check_host_int("max_seqlen_k", max_seqlen_k, 0)
    check_host_int("causal_offset", causal_offset)
    if softmax_scale is None:
        if isinstance(q, torch.Tensor) and q.dim() == 3 and q.shape[-1] == 0:
            raise ValueError("q must have a head dim >= 1, got shape " + str(tuple(q.shape)))
        return q.shape[-1] ** -0.5 if isinstance(q, torch.Tensor) and q.dim() == 3 else 1.0
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)):
        raise TypeError(f"softmax_scale must be a float, got {type(softmax_scale).__name__}")
    return float(softmax_scale)


def check_host_features(window_left, window_right, softcap, sinks=None) -> float:
    """Check the feature scalars (and that ``sinks`` is a tensor or None) before the dispatcher
    sees them; returns ``softcap`` as a float."""
    check_host_int("window_left", window_left, -1)
    check_host_int("window_right", window_right, -1)
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)):
        raise TypeError(f"softcap must be a float, got {type(softcap).__name__}")
    if not math.isfinite(softcap) or softcap < 0:
        raise ValueError(f"softcap must be a finite float >= 0 (0 turns it off), got {softcap!r}")
    if sinks is not None and not isinstance(sinks, torch.Tensor):
        raise TypeError(f"sinks must be a torch.Tensor or None, got {type(sinks).__name__}")
    return float(softcap)


def check_block_args(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, q_runs, k_runs,
    op: str = "attention_block",
) -> None:  # fmt: skip
    """Validate the inputs shared by the forward and backward block ops (ValueError/TypeError);
    dtype errors name ``op``."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_tensor(name, t, 3)
        _check_float(name, t, op)
        _check_last_dim(name, t)
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(
            f"{op}: q, k and v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype} (under torch.autocast "
            "the op casts them to the autocast dtype; outside it, cast them to one dtype)"
        )
    if k.device != q.device or v.device != q.device:
        raise ValueError(f"q, k and v must be on one device, got {q.device}, {k.device}, {v.device}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"q and k must have the same head dim, got {q.shape[2]} and {k.shape[2]}")
    if q.shape[2] == 0:
        raise ValueError(f"q, k and v must have a head dim >= 1, got shape {tuple(q.shape)}")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1] != 0:
        raise ValueError(f"the number of q heads ({q.shape[1]}) must be a multiple of k's ({k.shape[1]})")
    check_host_int("max_seqlen_q", max_seqlen_q, 0)
    check_host_int("max_seqlen_k", max_seqlen_k, 0)
    if not isinstance(softmax_scale, (int, float)) or not math.isfinite(softmax_scale):
        raise ValueError(f"softmax_scale must be a finite float, got {softmax_scale!r}")
    _check_cu("cu_seqlens_q", cu_seqlens_q, q.shape[0], q.device, max_seqlen_q, "max_seqlen_q")
    _check_cu("cu_seqlens_k", cu_seqlens_k, k.shape[0], q.device, max_seqlen_k, "max_seqlen_k")
    if cu_seqlens_q.numel() != cu_seqlens_k.numel():
        raise ValueError(
            f"cu_seqlens_q and cu_seqlens_k must describe the same number of sequences, got "
            f"{cu_seqlens_q.numel() - 1} and {cu_seqlens_k.numel() - 1}"
        )
    if (q_runs is None) != (k_runs is None):
        raise ValueError("q_runs and k_runs must be given together")
    if q_runs is not None:
        _check_runs("q_runs", q_runs, cu_seqlens_q, q.device)
        _check_runs("k_runs", k_runs, cu_seqlens_k, q.device)


def check_bwd_args(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale, q_runs, k_runs, dlse) -> None:
    """Validate the inputs of the backward block op: the forward's, plus ``dout`` (q's shape and
    dtype), ``out`` (q's shape, any float dtype), ``lse`` and ``dlse`` (``[H, Tq]``); dtype errors
    name the op."""
    op = "attention_block_backward"
    check_block_args(q, k, v, cu_q, cu_k, max_q, max_k, scale, q_runs, k_runs, op=op)
    for name, t in (("dout", dout), ("out", out)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.shape != q.shape:
            raise ValueError(f"{name} must have q's shape {tuple(q.shape)}, got {tuple(t.shape)}")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}")
        if t.numel() and t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension")
    if dout.dtype != q.dtype:
        raise TypeError(f"{op}: dout must have q's dtype {q.dtype}, got {dout.dtype}")
    if not out.is_floating_point():
        raise TypeError(f"{op}: out must be a float tensor, got {out.dtype}")
    check_lse("lse", lse, q.shape[1], q.shape[0], q.device, op)
    if dlse is not None:
        check_lse("dlse", dlse, q.shape[1], q.shape[0], q.device, op)


def check_lse(
    name: str,
    lse: torch.Tensor,
    n_heads: int,
    n_tokens: int,
    device: torch.device,
    op: str = "attention_block",
) -> None:
    """``lse`` must be a floating ``[H, T]`` tensor on ``device``; a dtype error names ``op``."""
    _check_tensor(name, lse, 2)
    if lse.dtype not in (torch.float32, torch.float64):
        raise TypeError(f"{op}: {name} must be float32 (or float64), got {lse.dtype}")
    if tuple(lse.shape) != (n_heads, n_tokens):
        raise ValueError(f"{name} must have shape (H, T) = ({n_heads}, {n_tokens}), got {tuple(lse.shape)}")
    if lse.device != device:
        raise ValueError(f"{name} is on {lse.device} but q is on {device}")
    _check_last_dim(name, lse)


def check_merge_args(out_a, lse_a, out_b, lse_b) -> None:
    """Validate the inputs of ``merge_attention_states``."""
    op = "merge_attention_states"
    for name, t in (("out_a", out_a), ("out_b", out_b)):
        _check_tensor(name, t, 3)
        _check_float(name, t, op)
        _check_last_dim(name, t)
    if out_a.shape != out_b.shape:
        raise ValueError(
            f"out_a and out_b must have the same shape, got {tuple(out_a.shape)} and {tuple(out_b.shape)}"
        )
    if out_b.device != out_a.device:
        raise ValueError(f"out_b is on {out_b.device} but out_a is on {out_a.device}")
    t, h, _ = out_a.shape
    check_lse("lse_a", lse_a, h, t, out_a.device, op)
    check_lse("lse_b", lse_b, h, t, out_a.device, op)


def check_features(q, window_left, window_right, softcap, sinks) -> None:
    """Validate the optional mask and logit features (ValueError/TypeError naming the argument).

    ``window_left``/``window_right``: host ints >= -1 (-1: unbounded); ``softcap``: a finite float
    >= 0 (0: off); ``sinks``: ``None`` or a floating ``[H]`` tensor on q's device (finite values).
    """
    check_host_features(window_left, window_right, softcap, sinks)
    if sinks is None:
        return
    _check_tensor("sinks", sinks, 1)
    _check_float("sinks", sinks, "attention_block")
    if sinks.shape[0] != q.shape[1]:
        raise ValueError(f"sinks must have shape (H,) = ({q.shape[1]},), got {tuple(sinks.shape)}")
    if sinks.device != q.device:
        raise ValueError(f"sinks is on {sinks.device} but q is on {q.device}")
    if value_checks_enabled(sinks) and not bool(torch.isfinite(sinks).all()):
        raise ValueError("sinks must be finite")
