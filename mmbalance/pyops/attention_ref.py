"""Torch reference implementations of the attention block ops and their input validation.

These are the CPU path of ``torch.ops.mmbalance.attention_block_fwd``, ``attention_block_bwd`` and
``merge_attention_states`` (and what tests and benchmarks compare against). They loop over the
sequences of the packed batch and compute each one densely in float32 (float64 for float64
inputs), with the same masking, empty-row and GQA semantics as the Triton kernels documented in
``kernels/attention.py``.
"""

from __future__ import annotations

import math
import os

import torch
from torch._subclasses.fake_tensor import FakeTensor

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def acc_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """float64 when any input is float64, float32 otherwise."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def run_positions(length: int, runs_row: list[int] | None, default_start: int) -> torch.Tensor:
    """Absolute positions of a sequence's tokens: one run at ``default_start`` or two runs."""
    t = torch.arange(length)
    if runs_row is None:
        return t + default_start
    start0, len0, start1 = runs_row
    return torch.where(t < len0, start0 + t, start1 + (t - len0))


# ------------------------------------------------------------------------------------ validation
def value_checks_enabled(t: torch.Tensor) -> bool:
    """Whether checks that read tensor values (a device-to-host sync on CUDA) run on ``t``: always on
    CPU, on CUDA only with ``MMBALANCE_DEBUG=1`` (the rule of every ``pyops`` module)."""
    if isinstance(t, FakeTensor) or t.device.type == "meta" or torch.compiler.is_compiling():
        return False
    return t.device.type == "cpu" or os.environ.get("MMBALANCE_DEBUG", "0") not in ("", "0")


def _check_tensor(name: str, t, ndim: int | None = None) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")


def _check_float(name: str, t: torch.Tensor) -> None:
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be float16, bfloat16, float32 or float64, got {t.dtype}")


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


def check_block_args(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, q_runs, k_runs
) -> None:
    """Validate the inputs shared by the forward and backward block ops (ValueError/TypeError)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_tensor(name, t, 3)
        _check_float(name, t)
        _check_last_dim(name, t)
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"q, k and v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
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


def check_lse(name: str, lse: torch.Tensor, n_heads: int, n_tokens: int, device: torch.device) -> None:
    """``lse`` must be a floating ``[H, T]`` tensor on ``device``."""
    _check_tensor(name, lse, 2)
    if lse.dtype not in (torch.float32, torch.float64):
        raise TypeError(f"{name} must be float32 (or float64), got {lse.dtype}")
    if tuple(lse.shape) != (n_heads, n_tokens):
        raise ValueError(f"{name} must have shape (H, T) = ({n_heads}, {n_tokens}), got {tuple(lse.shape)}")
    if lse.device != device:
        raise ValueError(f"{name} is on {lse.device} but q is on {device}")
    _check_last_dim(name, lse)


def check_merge_args(out_a, lse_a, out_b, lse_b) -> None:
    """Validate the inputs of ``merge_attention_states``."""
    for name, t in (("out_a", out_a), ("out_b", out_b)):
        _check_tensor(name, t, 3)
        _check_float(name, t)
        _check_last_dim(name, t)
    if out_a.shape != out_b.shape:
        raise ValueError(
            f"out_a and out_b must have the same shape, got {tuple(out_a.shape)} and {tuple(out_b.shape)}"
        )
    if out_b.device != out_a.device:
        raise ValueError(f"out_b is on {out_b.device} but out_a is on {out_a.device}")
    t, h, _ = out_a.shape
    check_lse("lse_a", lse_a, h, t, out_a.device)
    check_lse("lse_b", lse_b, h, t, out_a.device)


# ----------------------------------------------------------------------------------- references
def _sequence_probs(q, k, cu_q, cu_k, b, scale, causal, causal_offset, q_runs, k_runs, group, acc):
    """Scores ``s [H, Lq, Lk]`` and the allowed-key mask of sequence ``b`` (or None if empty)."""
    qs, qe, ks, ke = cu_q[b], cu_q[b + 1], cu_k[b], cu_k[b + 1]
    qb = q[qs:qe].to(acc).transpose(0, 1)
    kb = k[ks:ke].to(acc).transpose(0, 1).repeat_interleave(group, 0)
    s = torch.matmul(qb, kb.transpose(1, 2)) * scale
    allowed = None
    if causal:
        qpos = run_positions(qe - qs, None if q_runs is None else q_runs[b], causal_offset)
        kpos = run_positions(ke - ks, None if k_runs is None else k_runs[b], 0)
        allowed = (kpos[None, :] <= qpos[:, None]).to(s.device)
        s = s.masked_fill(~allowed, -math.inf)
    return qb, kb, s, allowed


def attention_block_fwd_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    softmax_scale: float,
    causal: bool,
    causal_offset: int = 0,
    q_runs: torch.Tensor | None = None,
    k_runs: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference forward: ``out [Tq, H, D]`` (``out_dtype``, default q's) and ``lse [H, Tq]``.

    ``lse`` is float32 (float64 for float64 inputs); rows without an allowed key get ``out = 0``
    and ``lse = -inf``. Works on any device (one dense product per sequence).
    """
    acc = acc_dtype(q)
    tq, n_heads, head_dim = q.shape
    group = n_heads // k.shape[1]
    cu_q, cu_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    qr = None if q_runs is None else q_runs.tolist()
    kr = None if k_runs is None else k_runs.tolist()
    out = torch.zeros((tq, n_heads, head_dim), dtype=acc, device=q.device)
    lse = torch.full((n_heads, tq), -math.inf, dtype=acc, device=q.device)
    for b in range(len(cu_q) - 1):
        if cu_q[b + 1] == cu_q[b] or cu_k[b + 1] == cu_k[b]:
            continue
        _, _, s, _ = _sequence_probs(
            q, k, cu_q, cu_k, b, softmax_scale, causal, causal_offset, qr, kr, group, acc
        )
        lse_b = torch.logsumexp(s, dim=-1)
        p = torch.exp(s - torch.where(lse_b == -math.inf, 0.0, lse_b)[..., None])
        vb = v[cu_k[b] : cu_k[b + 1]].to(acc).transpose(0, 1).repeat_interleave(group, 0)
        out[cu_q[b] : cu_q[b + 1]] = torch.matmul(p, vb).transpose(0, 1)
        lse[:, cu_q[b] : cu_q[b + 1]] = lse_b
    return out.to(out_dtype or q.dtype), lse


def attention_block_bwd_ref(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    softmax_scale: float,
    causal: bool,
    causal_offset: int = 0,
    q_runs: torch.Tensor | None = None,
    k_runs: torch.Tensor | None = None,
    dlse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Reference backward from the saved ``out``/``lse``: ``dq``, ``dk``, ``dv`` in float32 (float64
    for float64 ``q``), whatever the dtype of ``lse``; computed in float64 if any input is.

    ``lse`` may be a merged LSE over more keys than this block holds (a ring); ``dlse`` is the
    gradient reaching ``lse``, if any.
    """
    acc = acc_dtype(q, lse)
    grad_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    tq, n_heads, head_dim = q.shape
    n_kv = k.shape[1]
    group = n_heads // n_kv
    cu_q, cu_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    qr = None if q_runs is None else q_runs.tolist()
    kr = None if k_runs is None else k_runs.tolist()
    dq = torch.zeros((tq, n_heads, head_dim), dtype=acc, device=q.device)
    dk = torch.zeros((k.shape[0], n_kv, head_dim), dtype=acc, device=q.device)
    dv = torch.zeros_like(dk)
    delta = (dout.to(acc) * out.to(acc)).sum(-1).transpose(0, 1)
    if dlse is not None:
        delta = delta - dlse.to(acc)
    for b in range(len(cu_q) - 1):
        qs, qe, ks, ke = cu_q[b], cu_q[b + 1], cu_k[b], cu_k[b + 1]
        if qe == qs or ke == ks:
            continue
        qb, kb, s, _ = _sequence_probs(
            q, k, cu_q, cu_k, b, softmax_scale, causal, causal_offset, qr, kr, group, acc
        )
        lse_b = lse[:, qs:qe].to(acc)
        p = torch.exp(s - lse_b[..., None])
        p = torch.where((lse_b == -math.inf)[..., None], 0.0, p)
        vb = v[ks:ke].to(acc).transpose(0, 1).repeat_interleave(group, 0)
        dob = dout[qs:qe].to(acc).transpose(0, 1)
        ds = p * (torch.matmul(dob, vb.transpose(1, 2)) - delta[:, qs:qe, None])
        dq[qs:qe] = (torch.matmul(ds, kb) * softmax_scale).transpose(0, 1)
        dk_b = torch.matmul(ds.transpose(1, 2), qb) * softmax_scale
        dv_b = torch.matmul(p.transpose(1, 2), dob)
        dk[ks:ke] = dk_b.view(n_kv, group, ke - ks, head_dim).sum(1).transpose(0, 1)
        dv[ks:ke] = dv_b.view(n_kv, group, ke - ks, head_dim).sum(1).transpose(0, 1)
    return dq.to(grad_dtype), dk.to(grad_dtype), dv.to(grad_dtype)


def merge_weights(
    lse_a: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Merged ``lse`` and the normalised weights ``exp(lse_a - lse)``, ``exp(lse_b - lse)`` ([H, T])."""
    m = torch.maximum(lse_a, lse_b)
    m = torch.where(m == -math.inf, 0.0, m)
    w_a = torch.exp(lse_a - m)
    w_b = torch.exp(lse_b - m)
    total = w_a + w_b
    empty = total == 0
    safe = torch.where(empty, 1.0, total)
    lse = torch.where(empty, -math.inf, m + torch.log(safe))
    return lse, w_a / safe, w_b / safe


def merge_attention_states_ref(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference merge: float32 (float64 if any input is) ``out [T, H, D]`` and ``lse [H, T]``."""
    acc = acc_dtype(out_a, out_b, lse_a, lse_b)
    lse, w_a, w_b = merge_weights(lse_a.to(acc), lse_b.to(acc))
    out = out_a.to(acc) * w_a.t()[..., None] + out_b.to(acc) * w_b.t()[..., None]
    return out, lse
