"""Float64 references of the gated delta rule, written from the recurrence token by token (no
shared code with ``pyops/delta_rule.py``): the chunk maps ``(M, U)``, and the layer's read-out run
over a sequence from a given state, for the tests of the op and of its kernel."""

from __future__ import annotations

import torch


def random_inputs(tokens: int, heads: int, key_dim: int, value_dim: int, seed: int, dtype=torch.float64):
    """Normalized keys (as the layer feeds them), decays in (0, 1], write strengths in [0, 1]."""
    g = torch.Generator().manual_seed(seed)
    k = torch.nn.functional.normalize(
        torch.randn(tokens, heads, key_dim, generator=g, dtype=torch.float64), dim=-1
    )
    v = torch.randn(tokens, heads, value_dim, generator=g, dtype=torch.float64)
    decay = -2.0 * torch.rand(tokens, heads, generator=g, dtype=torch.float64)
    beta = torch.rand(tokens, heads, generator=g, dtype=torch.float64)
    q = torch.randn(tokens, heads, key_dim, generator=g, dtype=torch.float64)
    return [t.to(dtype) for t in (k, v, decay, beta, q)]


def chunk_maps(k, v, decay, beta, cu) -> tuple[torch.Tensor, torch.Tensor]:
    """``M`` (the product of ``exp(g_t) (I - beta_t k_t k_t^T)``) and ``U`` (the state from zero)
    of every chunk and head, float64."""
    k, v, decay, beta = (t.double() for t in (k, v, decay, beta))
    bounds = [int(x) for x in cu]
    heads, key_dim, value_dim = k.shape[1], k.shape[2], v.shape[2]
    ms, us = [], []
    for p in range(len(bounds) - 1):
        m_p, u_p = [], []
        for h in range(heads):
            m = torch.eye(key_dim, dtype=torch.float64)
            s = torch.zeros(key_dim, value_dim, dtype=torch.float64)
            for t in range(bounds[p], bounds[p + 1]):
                a, kt = decay[t, h].exp(), k[t, h]
                m = a * (torch.eye(key_dim, dtype=torch.float64) - beta[t, h] * torch.outer(kt, kt)) @ m
                s = a * s
                s = s + torch.outer(kt, beta[t, h] * (v[t, h] - s.T @ kt))
            m_p.append(m)
            u_p.append(s)
        ms.append(torch.stack(m_p) if m_p else torch.zeros(0, key_dim, key_dim, dtype=torch.float64))
        us.append(torch.stack(u_p) if u_p else torch.zeros(0, key_dim, value_dim, dtype=torch.float64))
    if not ms:
        return (torch.zeros(0, heads, key_dim, key_dim, dtype=torch.float64),
                torch.zeros(0, heads, key_dim, value_dim, dtype=torch.float64))  # fmt: skip
    return torch.stack(ms), torch.stack(us)


def run(q, k, v, decay, beta, state):
    """The layer's recurrence over one sequence (``[L, H, *]``) from ``state [H, K, V]``: the
    read-out ``o_t = S_t^T q_t`` of every token and the state it leaves (differentiable)."""
    outs = []
    for t in range(k.shape[0]):
        a = decay[t].exp()[:, None, None]
        state = a * state
        delta = beta[t][:, None] * (v[t] - torch.einsum("hkv,hk->hv", state, k[t]))
        state = state + k[t][:, :, None] * delta[:, None, :]
        outs.append(torch.einsum("hkv,hk->hv", state, q[t]))
    return (torch.stack(outs) if outs else q.new_zeros((0, q.shape[1], v.shape[2]))), state
