"""Independent dense float64 attention with every feature of the block ops, differentiable.

Written from the definitions (absolute positions, the causal and window rules, softcapping,
sinks in the softmax denominator, GQA head mapping), one head and one sequence at a time, sharing
no code with the blockwise CPU path or the kernels, so a bug there cannot hide in the expectation.
"""

from __future__ import annotations

import math

import torch


def token_positions(length: int, runs_row, default_start: int) -> torch.Tensor:
    """Positions of a sequence's tokens: ``default_start + t``, or the two runs of ``runs_row``."""
    if runs_row is None:
        return torch.arange(length) + default_start
    start0, len0, start1 = (int(x) for x in runs_row)
    return torch.tensor(
        [start0 + t if t < len0 else start1 + t - len0 for t in range(length)], dtype=torch.long
    )


def dense_attention(
    q, k, v, cu_q, cu_k, scale, *, causal=False, causal_offset=0, q_runs=None, k_runs=None,
    window_left=-1, window_right=-1, softcap=0.0, sinks=None,
):  # fmt: skip
    """``(out [Tq, H, D], lse [H, Tq])`` in float64, differentiable in q, k, v and sinks.

    Rows without an allowed key: ``out = 0`` and ``lse = -inf``, or ``lse = sinks[h]`` with sinks.
    """
    q, k, v = q.double(), k.double(), v.double()
    n_heads, n_kv = q.shape[1], k.shape[1]
    group = n_heads // n_kv
    cu_q, cu_k = [int(x) for x in cu_q], [int(x) for x in cu_k]
    out_rows, lse_cols = [], []
    for b in range(len(cu_q) - 1):
        qs, qe, ks, ke = cu_q[b], cu_q[b + 1], cu_k[b], cu_k[b + 1]
        if qe == qs:
            continue
        qpos = token_positions(qe - qs, None if q_runs is None else q_runs[b], causal_offset)
        kpos = token_positions(ke - ks, None if k_runs is None else k_runs[b], 0)
        allowed = torch.ones(qe - qs, ke - ks, dtype=torch.bool)
        if causal:
            allowed &= kpos[None, :] <= qpos[:, None]
        if window_left >= 0:
            allowed &= kpos[None, :] >= qpos[:, None] - window_left
        if window_right >= 0:
            allowed &= kpos[None, :] <= qpos[:, None] + window_right
        heads_out, heads_lse = [], []
        for h in range(n_heads):
            s = q[qs:qe, h] @ k[ks:ke, h // group].T * scale
            if softcap > 0:
                s = softcap * torch.tanh(s / softcap)
            s = torch.where(allowed, s, torch.full_like(s, -math.inf))
            if sinks is not None:
                sink = sinks[h].double().expand(qe - qs, 1)
                lse = torch.logsumexp(torch.cat([s, sink], 1), 1)
                p = torch.exp(s - lse[:, None])
            else:
                seen = allowed.any(1)
                lse_safe = torch.logsumexp(torch.where(seen[:, None], s, torch.zeros_like(s)), 1)
                p = torch.where(seen[:, None], torch.exp(s - lse_safe[:, None]), torch.zeros_like(s))
                lse = torch.where(seen, lse_safe, torch.full_like(lse_safe, -math.inf))
            heads_out.append(p @ v[ks:ke, h // group])
            heads_lse.append(lse)
        out_rows.append(torch.stack(heads_out, 1))
        lse_cols.append(torch.stack(heads_lse, 0))
    if not out_rows:
        return q.new_zeros(q.shape), q.new_zeros((n_heads, q.shape[0]))
    return torch.cat(out_rows), torch.cat(lse_cols, 1)
