"""Independent float64 attention for the attention tests: one dense softmax per sequence.

Written from the definitions (positions, masks, GQA head mapping), sharing no code with
``pyops/attention_ref.py`` or the kernels, so a bug there cannot hide in the expectation.
"""

from __future__ import annotations

import math

import torch


def positions(length: int, runs_row, default_start: int) -> list[int]:
    if runs_row is None:
        return [default_start + t for t in range(length)]
    start0, len0, start1 = (int(x) for x in runs_row)
    return [start0 + t if t < len0 else start1 + (t - len0) for t in range(length)]


def attention_f64(q, k, v, cu_q, cu_k, scale, causal=False, causal_offset=0, q_runs=None, k_runs=None):
    """``(out [Tq, H, D], lse [H, Tq])`` in float64, differentiable in q, k, v.

    Rows that see no key: ``out = 0``, ``lse = -inf``.
    """
    q, k, v = q.double(), k.double(), v.double()
    n_heads, n_kv = q.shape[1], k.shape[1]
    group = n_heads // n_kv
    cu_q, cu_k = [int(x) for x in cu_q], [int(x) for x in cu_k]
    outs, lses = [], []
    for b in range(len(cu_q) - 1):
        qs, qe, ks, ke = cu_q[b], cu_q[b + 1], cu_k[b], cu_k[b + 1]
        qpos = torch.tensor(positions(qe - qs, None if q_runs is None else q_runs[b], causal_offset))
        kpos = torch.tensor(positions(ke - ks, None if k_runs is None else k_runs[b], 0))
        out_b = torch.zeros((qe - qs, n_heads, q.shape[2]), dtype=torch.float64)
        lse_b = torch.full((n_heads, qe - qs), -math.inf, dtype=torch.float64)
        out_rows, lse_rows = [], []
        for h in range(n_heads):
            kh, vh = k[ks:ke, h // group], v[ks:ke, h // group]
            s = q[qs:qe, h] @ kh.T * scale
            if causal:
                s = s.masked_fill(kpos[None, :] > qpos[:, None], -math.inf)
            seen = torch.isfinite(s).any(1, keepdim=True)
            s_safe = torch.where(seen, s, torch.zeros_like(s))
            lse_h = torch.logsumexp(s_safe, 1, keepdim=True)
            p = torch.where(seen, torch.exp(s_safe - lse_h), torch.zeros_like(s))
            out_rows.append(p @ vh)
            lse_rows.append(torch.where(seen[:, 0], lse_h[:, 0], torch.full_like(lse_h[:, 0], -math.inf)))
        if qe > qs and n_heads:
            out_b = torch.stack(out_rows, 1)
            lse_b = torch.stack(lse_rows, 0)
        outs.append(out_b)
        lses.append(lse_b)
    out = torch.cat(outs) if outs else q.new_zeros(q.shape)
    lse = torch.cat(lses, 1) if lses else q.new_zeros((n_heads, 0))
    return out, lse


def merge_f64(out_a, lse_a, out_b, lse_b):
    """Merged ``(out, lse)`` of two partial results, float64, from the definition."""
    lse_a, lse_b = lse_a.double(), lse_b.double()
    lse = torch.logaddexp(lse_a, lse_b)
    both_empty = torch.isinf(lse_a) & torch.isinf(lse_b)
    w_a = torch.where(both_empty, 0.0, torch.exp(lse_a - torch.where(both_empty, 0.0, lse)))
    w_b = torch.where(both_empty, 0.0, torch.exp(lse_b - torch.where(both_empty, 0.0, lse)))
    out = out_a.double() * w_a.T[..., None] + out_b.double() * w_b.T[..., None]
    return out, torch.where(both_empty, -math.inf, lse)


def varlen_batch(lengths_q, lengths_k, n_heads, n_kv, head_dim, dtype, seed):
    """Seeded random ``q, k, v`` and int32 ``cu_seqlens`` for the given sequence lengths."""
    g = torch.Generator().manual_seed(seed)
    cu_q = torch.tensor(
        [0, *torch.tensor(lengths_q, dtype=torch.int64).cumsum(0).tolist()], dtype=torch.int32
    )
    cu_k = torch.tensor(
        [0, *torch.tensor(lengths_k, dtype=torch.int64).cumsum(0).tolist()], dtype=torch.int32
    )
    q = torch.randn(int(cu_q[-1]), n_heads, head_dim, generator=g).to(dtype)
    k = torch.randn(int(cu_k[-1]), n_kv, head_dim, generator=g).to(dtype)
    v = torch.randn(int(cu_k[-1]), n_kv, head_dim, generator=g).to(dtype)
    return q, k, v, cu_q, cu_k
