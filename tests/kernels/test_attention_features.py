"""Sliding windows, logit softcapping, attention sinks and per-sequence bottom-right alignment in the
Triton attention kernels, against a dense float64 reference written here from the definitions.

The reference builds each sequence's mask matrix from the position formulas (query ``i`` at
``causal_offset + i`` or at its two-run position, key ``j`` at ``j`` or its run position; key
allowed iff ``(not causal or pk <= pq) and (wl < 0 or pk >= pq - wl) and (wr < 0 or pk <= pq +
wr)``), applies ``softcap * tanh(s / softcap)`` and adds the sink to the softmax denominator; the
bottom-right test builds flash-attn's mask from the lengths alone (``j <= i + Lk - Lq``). It
shares no code with the kernels or ``pyops/attention_ref.py``.

Like ``test_attention_kernels.py`` this needs CUDA or ``TRITON_INTERPRET=1`` at import; a plain
``pytest tests`` run re-runs it under the interpreter (``test_under_interpreter.py``). float32 is
held to the tolerance table, float16 to "2x PyTorch's own error" (the same math in float16).
Outputs are poisoned with NaN before every launch; lengths include empty query and key sequences,
more queries than keys and sizes off the 16-wide interpreter tiles.
"""

from __future__ import annotations

import math

import pytest
import torch

from mmbalance.kernels import _launch, attention_common
from mmbalance.kernels import attention_bwd as KB
from mmbalance.kernels import attention_fwd as KF
from tests.tolerances import assert_close_lowp, tol

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"

if not (HAS_CUDA or (_launch.INTERPRET and type(KF.attn_fwd_kernel).__name__ == "InterpretedFunction")):
    pytest.skip(
        "kernels need TRITON_INTERPRET=1 at import (run via test_under_interpreter.py) or CUDA",
        allow_module_level=True,
    )

# (q, k) lengths: ragged, empty queries, empty keys, more queries than keys, more keys than queries
LQ, LK = [29, 0, 11, 23, 6], [21, 5, 0, 9, 34]
Q_RUNS = [[0, 10, 30], [3, 0, 3], [7, 11, 18], [-5, 12, 20], [10, 2, 40]]
K_RUNS = [[0, 13, 25], [0, 2, 50], [0, 0, 0], [0, 9, 9], [0, 20, 32]]


# ------------------------------------------------------------------------------------ reference
def _positions(length: int, runs_row, default_start: int) -> torch.Tensor:
    if runs_row is None:
        return torch.arange(length) + default_start
    start0, len0, start1 = (int(x) for x in runs_row)
    t = torch.arange(length)
    return torch.where(t < len0, start0 + t, start1 + (t - len0))


def _position_mask(b, lq, lk, spec):
    qr = None if spec.get("q_runs") is None else spec["q_runs"][b]
    kr = None if spec.get("k_runs") is None else spec["k_runs"][b]
    pq = _positions(lq, qr, spec.get("causal_offset", 0))[:, None]
    pk = _positions(lk, kr, 0)[None, :]
    allowed = torch.ones(lq, lk, dtype=torch.bool)
    if spec.get("causal"):
        allowed &= pk <= pq
    if spec.get("window_left", -1) >= 0:
        allowed &= pk >= pq - spec["window_left"]
    if spec.get("window_right", -1) >= 0:
        allowed &= pk <= pq + spec["window_right"]
    return allowed


def reference(q, k, v, cu_q, cu_k, scale, spec, sinks=None, mask_fn=_position_mask):
    """``(out [Tq, H, D], lse [H, Tq])`` in q's dtype, differentiable in q, k, v and ``sinks``."""
    n_heads, group = q.shape[1], q.shape[1] // k.shape[1]
    softcap = spec.get("softcap", 0.0)
    cu_q, cu_k = [int(x) for x in cu_q], [int(x) for x in cu_k]
    outs, lses = [], []
    for b in range(len(cu_q) - 1):
        qs, qe, ks, ke = cu_q[b], cu_q[b + 1], cu_k[b], cu_k[b + 1]
        allowed = mask_fn(b, qe - qs, ke - ks, spec)
        out_h, lse_h = [], []
        for h in range(n_heads):
            kh, vh = k[ks:ke, h // group], v[ks:ke, h // group]
            s = q[qs:qe, h] @ kh.T * scale
            if softcap > 0:
                s = softcap * torch.tanh(s / softcap)
            s = s.masked_fill(~allowed, -math.inf)
            if sinks is not None:
                s_all = torch.cat([s, sinks[h].to(s.dtype).expand(qe - qs, 1)], 1)
                lse = torch.logsumexp(s_all, 1)
                p = torch.exp(s - lse[:, None])
            else:
                seen = allowed.any(1)
                s_safe = torch.where(seen[:, None], s, torch.zeros_like(s))
                lse = torch.logsumexp(s_safe, 1)
                p = torch.where(seen[:, None], torch.exp(s_safe - lse[:, None]), torch.zeros_like(s))
                lse = torch.where(seen, lse, torch.full_like(lse, -math.inf))
            out_h.append(p @ vh)
            lse_h.append(lse)
        outs.append(torch.stack(out_h, 1) if out_h else q.new_zeros((qe - qs, 0, q.shape[2])))
        lses.append(torch.stack(lse_h, 0) if lse_h else q.new_zeros((0, qe - qs)))
    return torch.cat(outs), torch.cat(lses, 1)


# ------------------------------------------------------------------------------------ helpers
def _batch(lq, lk, n_heads, n_kv, head_dim, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    cu_q = torch.tensor([0, *torch.tensor(lq).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(lk).cumsum(0).tolist()], dtype=torch.int32)
    # scaled up so a softcap of a few units really bends the logits
    q = (torch.randn(int(cu_q[-1]), n_heads, head_dim, generator=g) * 1.5).to(dtype)
    k = (torch.randn(int(cu_k[-1]), n_kv, head_dim, generator=g) * 1.5).to(dtype)
    v = torch.randn(int(cu_k[-1]), n_kv, head_dim, generator=g).to(dtype)
    sinks = torch.randn(n_heads, generator=g) * 2.0
    return q, k, v, cu_q, cu_k, sinks


def _nan(shape, dtype):
    return torch.full(shape, math.nan, dtype=dtype, device=DEVICE)


def _kernel_kwargs(spec, device=DEVICE):
    kw = dict(causal=bool(spec.get("causal")), causal_offset=spec.get("causal_offset", 0))
    for name in ("q_runs", "k_runs"):
        if spec.get(name) is not None:
            kw[name] = torch.tensor(spec[name], dtype=torch.int32, device=device)
    feats = dict(window_left=spec.get("window_left", -1), window_right=spec.get("window_right", -1))
    feats["softcap"] = spec.get("softcap", 0.0)
    return kw, feats


def _run(q, k, v, cu_q, cu_k, scale, spec, sinks, dout, dlse, config=None, bwd_config=None):
    """Forward and backward through the kernels, outputs poisoned with NaN first."""
    kw, feats = _kernel_kwargs(spec)
    dq_, dk_, dv_ = (t.to(DEVICE) for t in (q, k, v))
    cq, ck = cu_q.to(DEVICE), cu_k.to(DEVICE)
    max_q = max(int((cu_q[1:] - cu_q[:-1]).max()), 0) if cu_q.numel() > 1 else 0
    max_k = max(int((cu_k[1:] - cu_k[:-1]).max()), 0) if cu_k.numel() > 1 else 0
    out, lse = _nan(q.shape, q.dtype), _nan((q.shape[1], q.shape[0]), torch.float32)
    KF.attn_fwd(dq_, dk_, dv_, cq, ck, max_q, scale, kw["causal"], kw["causal_offset"], kw.get("q_runs"),
                kw.get("k_runs"), out=out, lse=lse, config=config,
                sinks=None if sinks is None else sinks.to(DEVICE), **feats)  # fmt: skip
    grads = tuple(_nan(t.shape, torch.float32) for t in (q, k, v))
    KB.attn_bwd(dout.to(DEVICE), dq_, dk_, dv_, out, lse, cq, ck, max_q, max_k, scale, kw["causal"],
                kw["causal_offset"], kw.get("q_runs"), kw.get("k_runs"), dlse=dlse.to(DEVICE),
                grads=grads, config=bwd_config, **feats)  # fmt: skip
    return out.cpu(), lse.cpu(), tuple(g.cpu() for g in grads)


def _expected(q, k, v, cu_q, cu_k, scale, spec, sinks, dout, dlse, mask_fn=_position_mask):
    """float64 out, lse and the gradients of ``sum(out * dout) + sum(lse * dlse)`` (finite lse)."""
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    s64 = None if sinks is None else sinks.double().requires_grad_()
    out, lse = reference(*leaves, cu_q, cu_k, scale, spec, s64, mask_fn)
    loss = (out * dout.double()).sum() + (lse.nan_to_num(0.0, 0.0, 0.0) * dlse.double()).sum()
    wrt = leaves + ([s64] if s64 is not None else [])
    grads = torch.autograd.grad(loss, wrt, allow_unused=True, materialize_grads=True)
    return out.detach(), lse.detach(), grads


def _check_lse(lse, want):
    lse = lse.double()
    assert not torch.isnan(lse).any(), "an lse row was left unwritten"
    assert torch.equal(torch.isinf(lse), torch.isinf(want)), "rows without keys (and no sink) have lse = -inf"
    finite = torch.isfinite(want)
    torch.testing.assert_close(lse[finite], want[finite], atol=3e-5, rtol=1e-5)


def _check_all(
    q, k, v, cu_q, cu_k, scale, spec, sinks, seed, mask_fn=_position_mask, config=None, bwd_config=None
):
    g = torch.Generator().manual_seed(seed)
    dout = torch.randn(q.shape, generator=g).to(q.dtype)
    dlse = torch.randn((q.shape[1], q.shape[0]), generator=g)
    out, lse, grads = _run(q, k, v, cu_q, cu_k, scale, spec, sinks, dout, dlse, config, bwd_config)
    want_out, want_lse, want_grads = _expected(q, k, v, cu_q, cu_k, scale, spec, sinks, dout, dlse, mask_fn)
    n_k = int((cu_k[1:] - cu_k[:-1]).max()) if cu_k.numel() > 1 else 1
    n_q = int((cu_q[1:] - cu_q[:-1]).max()) if cu_q.numel() > 1 else 1
    _check_lse(lse, want_lse)
    if q.dtype == torch.float32:
        torch.testing.assert_close(out.double(), want_out, **tol(torch.float32, n_k))
        for got, want in zip(grads, want_grads):
            torch.testing.assert_close(got.double(), want, **tol(torch.float32, n_q + n_k))
    else:
        # PyTorch's own error: the same reference evaluated in the input dtype
        lowp = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        out_lp, _ = reference(
            *lowp, cu_q, cu_k, scale, spec, None if sinks is None else sinks.to(q.dtype), mask_fn
        )
        assert_close_lowp(out, want_out, out_lp, atol=1e-3)
        theirs = torch.autograd.grad((out_lp * dout).sum(), lowp, allow_unused=True, materialize_grads=True)
        # the LSE part of the loss, in float64 on both sides (as test_attention_kernels.py does)
        leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
        _, lse64 = reference(
            *leaves, cu_q, cu_k, scale, spec, None if sinks is None else sinks.double(), mask_fn
        )
        lse_part = torch.autograd.grad((lse64.nan_to_num(0.0, 0.0, 0.0) * dlse.double()).sum(), leaves,
                                       allow_unused=True, materialize_grads=True)  # fmt: skip
        for got, want, their, extra in zip(grads, want_grads, theirs, lse_part):
            assert_close_lowp(got, want, their.double() + extra, atol=2e-3)
    if sinks is not None:
        # the sink gradient the op layer computes from the kernel's outputs (the interface's formula)
        delta = (dout.double() * out.double()).sum(-1).T  # [H, Tq]
        d_sinks = (torch.exp(sinks.double()[:, None] - lse.double()) * (dlse.double() - delta)).sum(1)
        torch.testing.assert_close(
            d_sinks, want_grads[3], atol=2e-3 if q.dtype != torch.float32 else 1e-5, rtol=1e-3
        )
    return out, lse, grads


# ------------------------------------------------------------------------------------ each feature, combined
CASES = {
    # name: (dtype, (H, Hkv, D), spec, sinks)
    "window-causal": (torch.float32, (4, 2, 24), dict(causal=True, window_left=5), False),
    "window-causal-runs": (torch.float32, (2, 1, 16), dict(causal=True, window_left=7, runs=True), False),
    "window-bidir": (torch.float32, (2, 2, 16), dict(window_left=3, window_right=6, causal_offset=2), False),
    "window-right-only": (torch.float32, (2, 1, 16), dict(window_right=4, runs=True), False),
    "window-left-only-offset": (torch.float32, (2, 1, 16), dict(window_left=2, causal_offset=-4), False),
    "window-causal+right": (
        torch.float32,
        (2, 1, 16),
        dict(causal=True, window_left=4, window_right=3),
        False,
    ),
    "softcap": (torch.float32, (4, 2, 80), dict(causal=True, softcap=2.5), False),
    "softcap-full-f16": (torch.float16, (2, 1, 16), dict(softcap=3.0), False),
    "sinks": (torch.float32, (4, 2, 24), dict(causal=True, causal_offset=-6), True),
    "sinks-full-f16": (torch.float16, (2, 2, 16), dict(), True),
    "all-runs": (torch.float32, (4, 2, 96), dict(causal=True, window_left=6, softcap=4.0, runs=True), True),
    "all-bidir-f16": (torch.float16, (2, 1, 96), dict(window_left=5, window_right=2, softcap=2.0), True),
}


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_features_forward_backward(case):
    dtype, (h, hk, d), spec, use_sinks = CASES[case]
    spec = dict(spec)
    if spec.pop("runs", False):
        spec["q_runs"], spec["k_runs"] = Q_RUNS, K_RUNS
    q, k, v, cu_q, cu_k, sinks = _batch(LQ, LK, h, hk, d, dtype, seed=list(CASES).index(case))
    _check_all(q, k, v, cu_q, cu_k, 0.3, spec, sinks if use_sinks else None, seed=7)


def test_sink_rows_without_keys_get_the_sink():
    """A row that sees no key: lse = sink, out = 0 (bottom-right with more queries than keys)."""
    lq, lk = [5, 3], [2, 0]
    q, k, v, cu_q, cu_k, sinks = _batch(lq, lk, 2, 1, 16, torch.float32, seed=3)
    kw = dict(q_runs=torch.tensor([[-3, 5, 2], [0, 3, 3]], dtype=torch.int32, device=DEVICE),
              k_runs=torch.tensor([[0, 2, 2], [0, 0, 0]], dtype=torch.int32, device=DEVICE))  # fmt: skip
    out, lse = _nan(q.shape, q.dtype), _nan((2, 8), torch.float32)
    KF.attn_fwd(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), cu_q.to(DEVICE), cu_k.to(DEVICE), 5, 0.3, True,
                out=out, lse=lse, sinks=sinks.to(DEVICE), **kw)  # fmt: skip
    empty_rows = [0, 1, 2, 5, 6, 7]  # the first three of sequence 0 sit before every key; sequence 1 has none
    assert torch.equal(out.cpu()[empty_rows], torch.zeros(6, 2, 16))
    torch.testing.assert_close(lse.cpu()[:, empty_rows], sinks[:, None].expand(2, 6))


# ------------------------------------------------------------------------------------ bottom-right alignment
def _bottom_right(b, lq, lk, spec):
    """flash-attn's causal mask for Lq != Lk, from the lengths alone: j <= i + Lk - Lq (and its window)."""
    i = torch.arange(lq)[:, None]
    j = torch.arange(lk)[None, :]
    allowed = j <= i + lk - lq
    if spec.get("window_left", -1) >= 0:
        allowed &= j >= i + lk - lq - spec["window_left"]
    return allowed


@pytest.mark.parametrize("window_left", [-1, 4], ids=["causal", "causal-window"])
def test_bottom_right_alignment_per_sequence(window_left):
    """Per-sequence bottom-right alignment (KV cache, chunked prefill) through the two-run positions
    ``bottom_right_runs`` builds (query run ``(Lk - Lq, Lq, Lk)`` against keys ``(0, Lk, Lk)``),
    against flash-attn's mask built from the lengths alone."""
    lq = [3, 17, 0, 9, 20, 1]
    lk = [19, 17, 6, 0, 7, 1]  # decode-like, square, empty queries, empty keys, Lq > Lk, single token
    q, k, v, cu_q, cu_k, _ = _batch(lq, lk, 2, 1, 32, torch.float32, seed=11)
    q_runs, k_runs = attention_common.bottom_right_runs(cu_q, cu_k)
    spec = dict(causal=True, window_left=window_left, q_runs=q_runs.tolist(), k_runs=k_runs.tolist())
    out, lse, _ = _check_all(q, k, v, cu_q, cu_k, 0.25, spec, None, seed=12, mask_fn=_bottom_right)
    # Lq > Lk: the first Lq - Lk rows see nothing (out = 0, lse = -inf), as in flash-attn
    first = int(cu_q[4])
    assert (
        torch.equal(out[first : first + 13], torch.zeros(13, 2, 32))
        and torch.isinf(lse[:, first : first + 13]).all()
    )


# ------------------------------------------------------------------------------------ loop bounds
@pytest.mark.parametrize("window", [0, 15], ids=lambda w: f"w={w}")
@pytest.mark.parametrize("side", ["left", "right"])
def test_window_at_tile_edges(side, window):
    """Windows next to the 16-wide interpreter tiles, with offsets that move a window's edge
    across a tile edge (an off-by-one in a loop bound shows only there): a causal left window, and
    a right window without causality (its key-side loop bound is a different formula)."""
    offsets = [-17, -16, -15, -1, 0, 1, 16]
    n = len(offsets)
    q, k, v, cu_q, cu_k, _ = _batch([33] * n, [35] * n, 1, 1, 16, torch.float32, seed=20 + window)
    spec = dict(q_runs=[[o, 33, o + 33] for o in offsets], k_runs=[[0, 35, 35]] * n)
    spec.update(dict(causal=True, window_left=window) if side == "left" else dict(window_right=window))
    _check_all(q, k, v, cu_q, cu_k, 0.5, spec, None, seed=21)


TILE16 = dict(BLOCK_M=16, BLOCK_N=16, num_warps=4, num_stages=1)
TILE16_BWD = dict(
    dq_BLOCK_M=16, dq_BLOCK_N=16, dq_warps=4, kv_BLOCK_M=16, kv_BLOCK_N=16, kv_warps=4, stages=1
)


def test_blocks_outside_the_window_are_never_loaded():
    """With a window the loops skip whole blocks (O(L * W) work), not just mask them: keys far
    left of a row's window and queries far past a key's reach are NaN here, and everything whose
    windows stay clear of them (by at least a 16-wide tile) comes out finite and right."""
    length, wl = 128, 8
    q, k, v, cu_q, cu_k, _ = _batch([length], [length], 1, 1, 16, torch.float32, seed=30)
    clean = [t.clone() for t in (q, k, v)]
    k[:32] = math.nan
    v[:32] = math.nan
    q[96:] = math.nan
    spec = dict(causal=True, window_left=wl)
    g = torch.Generator().manual_seed(31)
    dout, dlse = torch.randn(q.shape, generator=g), torch.randn((1, length), generator=g)
    out, lse, (dq, dk, dv) = _run(q, k, v, cu_q, cu_k, 0.5, spec, None, dout, dlse, TILE16, TILE16_BWD)
    want_out, want_lse, (wq, wk, wv) = _expected(*clean, cu_q, cu_k, 0.5, spec, None, dout, dlse)
    # query blocks that start at >= 32 + 16; key blocks whose rows (key + 15 + wl) end before 96
    rows, keys = slice(48, 96), slice(48, 80)
    torch.testing.assert_close(out[rows].double(), want_out[rows], **tol(torch.float32, wl))
    torch.testing.assert_close(lse[:, rows].double(), want_lse[:, rows], atol=3e-5, rtol=1e-5)
    torch.testing.assert_close(dq[rows].double(), wq[rows], **tol(torch.float32, 2 * wl))
    torch.testing.assert_close(dk[keys].double(), wk[keys], **tol(torch.float32, 2 * wl))
    torch.testing.assert_close(dv[keys].double(), wv[keys], **tol(torch.float32, 2 * wl))


def test_feature_switches_off_are_the_plain_kernel():
    """``window_left=-1``, ``softcap=0`` and no sinks give bit-identical results to a call without them,
    and a right window on a causal mask changes nothing (it only admits keys causality forbids)."""
    q, k, v, cu_q, cu_k, _ = _batch(LQ, LK, 2, 1, 16, torch.float32, seed=40)
    args = [t.to(DEVICE) for t in (q, k, v, cu_q, cu_k)] + [max(LQ), 0.3, True, 2]
    # one tiling for every call (on a GPU a window variant picks narrower tiles by default, which
    # sums in another order): the kernels' code paths are compared, not the tile choice
    cfg = attention_common.fwd_config(16, torch.device(DEVICE), torch.float32)
    plain = KF.attn_fwd(*args, config=cfg)
    off = KF.attn_fwd(*args, window_left=-1, window_right=-1, softcap=0.0, sinks=None, config=cfg)
    right = KF.attn_fwd(*args, window_right=3, config=cfg)
    # a window wider than any sequence (past int32 even: clamped on the host) is no window
    wide = KF.attn_fwd(*args, window_left=10**12, window_right=10**12, config=cfg)
    for a, b in ((plain, off), (plain, right), (plain, wide)):
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@pytest.mark.parametrize("lengths", [[], [0, 0]], ids=["no-sequences", "empty-sequences"])
def test_empty_batches_with_every_feature(lengths):
    q, k, v, cu_q, cu_k, sinks = (
        t.to(DEVICE) for t in _batch(lengths, lengths, 2, 1, 16, torch.float32, seed=50)
    )
    feats = dict(window_left=3, window_right=1, softcap=5.0)
    out, lse = KF.attn_fwd(q, k, v, cu_q, cu_k, 0, 0.5, False, sinks=sinks, **feats)
    assert out.shape == (0, 2, 16) and lse.shape == (2, 0)
    grads = KB.attn_bwd(q, q, k, v, out, lse, cu_q, cu_k, 0, 0, 0.5, False, **feats)
    assert [tuple(g.shape) for g in grads] == [(0, 2, 16), (0, 1, 16), (0, 1, 16)]


@pytest.mark.parametrize("spec", [dict(causal=True, window_left=9), dict(window_left=4, window_right=11)],
                         ids=["causal-window", "two-sided"])  # fmt: skip
def test_windows_with_unequal_tiles(spec):
    """The GPU configurations use query tiles wider than key tiles (128 x 64, 128 x 32) and the
    dk/dv pass the reverse: the loop bounds must not assume square tiles."""
    q, k, v, cu_q, cu_k, sinks = _batch(LQ, LK, 2, 1, 16, torch.float32, seed=60)
    spec = dict(spec, q_runs=Q_RUNS, k_runs=K_RUNS, softcap=3.0)
    fwd = dict(BLOCK_M=32, BLOCK_N=16, num_warps=4, num_stages=1)
    bwd = dict(dq_BLOCK_M=32, dq_BLOCK_N=16, dq_warps=4, kv_BLOCK_M=16, kv_BLOCK_N=32, kv_warps=4, stages=1)
    _check_all(q, k, v, cu_q, cu_k, 0.3, spec, sinks, seed=61, config=fwd, bwd_config=bwd)
