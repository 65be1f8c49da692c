"""The Triton attention block and merge kernels, launched directly and through the ops.

They need a CUDA device or ``TRITON_INTERPRET=1`` set before the kernel modules are imported; a
plain ``pytest tests`` run re-runs this file in a subprocess with the interpreter
(``test_under_interpreter.py``) and these tests skip in-process. Directly:
``TRITON_INTERPRET=1 python -m pytest tests/kernels/test_attention_kernels.py``.

Expectations are float64 attention computed per sequence (``tests/pyops/attention_expected.py``).
float32 is held to the tolerance table; float16 (and bfloat16 on GPU) to the "2x PyTorch's own
error" rule, PyTorch's error being that of plain attention math in the same dtype. Every output
buffer is poisoned with NaN before the launch, so a row the kernel forgets to write shows up.
Shapes are small (the interpreter is slow) but never multiples of the 16-wide interpreter tiles.
"""

from __future__ import annotations

import math

import pytest
import torch

from mmbalance.collectives.ring.attention import make_ring, ring_forward
from mmbalance.collectives.ring.plan import ring_plan
from mmbalance.kernels import _launch
from mmbalance.kernels import attention_bwd as KB
from mmbalance.kernels import attention_fwd as KF
from mmbalance.kernels import merge as KM
from mmbalance.pyops import attention_ops as ops
from tests.pyops.attention_expected import attention_f64, merge_f64, varlen_batch
from tests.tolerances import assert_close_lowp, tol

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"

if not (HAS_CUDA or (_launch.INTERPRET and type(KF.attn_fwd_kernel).__name__ == "InterpretedFunction")):
    pytest.skip(
        "kernels need TRITON_INTERPRET=1 at import (run via test_under_interpreter.py) or CUDA",
        allow_module_level=True,
    )

# lengths (q, k): ragged, an empty query sequence, an empty key sequence, more keys than queries
LQ, LK = [37, 0, 20, 5], [30, 4, 0, 41]
Q_RUNS = [[0, 10, 40], [3, 0, 3], [100, 20, 200], [2, 2, 20]]  # two-run positions, as a zigzag shard
K_RUNS = [[0, 15, 35], [0, 2, 50], [0, 0, 0], [0, 20, 30]]
MASKS = {
    "none": dict(causal=False),
    "causal": dict(causal=True),
    "offset+3": dict(causal=True, causal_offset=3),
    "offset-9": dict(causal=True, causal_offset=-9),
    "runs": dict(causal=True, runs=True),
}
# heads (H, Hkv) and head dim: GQA with a padded head dim (24 -> 32) for fp32, MHA at 16 for fp16
SHAPES = {torch.float32: (4, 2, 24), torch.float16: (2, 2, 16)}


def _mask_args(mask: dict, device) -> dict:
    args = dict(causal=mask["causal"], causal_offset=mask.get("causal_offset", 0))
    if mask.get("runs"):
        args["q_runs"] = torch.tensor(Q_RUNS, dtype=torch.int32, device=device)
        args["k_runs"] = torch.tensor(K_RUNS, dtype=torch.int32, device=device)
    return args


def _batch(dtype, seed=0, lq=LQ, lk=LK):
    h, hk, d = SHAPES.get(dtype, (4, 2, 64))
    q, k, v, cu_q, cu_k = varlen_batch(lq, lk, h, hk, d, dtype, seed)
    return [t.to(DEVICE) for t in (q, k, v, cu_q, cu_k)]


def _expected(q, k, v, cu_q, cu_k, scale, args, requires_grad=False):
    q64, k64, v64 = (t.detach().cpu().double().requires_grad_(requires_grad) for t in (q, k, v))
    runs = {n: (None if args.get(n) is None else args[n].tolist()) for n in ("q_runs", "k_runs")}
    out, lse = attention_f64(q64, k64, v64, cu_q.cpu(), cu_k.cpu(), scale, args["causal"], args["causal_offset"],
                             runs["q_runs"], runs["k_runs"])  # fmt: skip
    return (q64, k64, v64), out, lse


def _lowp_attention(q, k, v, cu_q, cu_k, scale, args):
    """Plain attention math entirely in q's dtype (PyTorch's own low-precision error)."""
    q, k, v = (t.detach().cpu() for t in (q, k, v))
    if q.dtype != torch.float32:
        q, k, v = (t.requires_grad_() for t in (q, k, v))
    return q, k, v, _lowp_forward(q, k, v, cu_q, cu_k, scale, args)


def _lowp_forward(q, k, v, cu_q, cu_k, scale, args):
    from tests.pyops.attention_expected import positions

    group = q.shape[1] // k.shape[1]
    outs = []
    cu_q, cu_k = cu_q.tolist(), cu_k.tolist()
    for b in range(len(cu_q) - 1):
        qs, qe, ks, ke = cu_q[b], cu_q[b + 1], cu_k[b], cu_k[b + 1]
        kh = k[ks:ke].repeat_interleave(group, 1).transpose(0, 1)
        vh = v[ks:ke].repeat_interleave(group, 1).transpose(0, 1)
        s = q[qs:qe].transpose(0, 1) @ kh.transpose(1, 2) * scale
        if args["causal"]:
            qr = None if args.get("q_runs") is None else args["q_runs"].tolist()[b]
            kr = None if args.get("k_runs") is None else args["k_runs"].tolist()[b]
            qpos = torch.tensor(positions(qe - qs, qr, args["causal_offset"]))
            kpos = torch.tensor(positions(ke - ks, kr, 0))
            s = s.masked_fill(kpos[None, None, :] > qpos[None, :, None], -math.inf)
        p = torch.softmax(s, -1).nan_to_num(0.0)
        outs.append((p @ vh).transpose(0, 1))
    return torch.cat(outs)


def _poisoned(shape, dtype):
    return torch.full(shape, math.nan, dtype=dtype, device=DEVICE)


def _check(out, ref64, torch_out, dtype, reduction):
    if dtype == torch.float32:
        torch.testing.assert_close(out.double().cpu(), ref64, **tol(torch.float32, reduction))
    else:
        assert_close_lowp(out.cpu(), ref64, torch_out, atol=1e-3)


def _check_lse(lse, ref64):
    lse = lse.double().cpu()
    assert torch.equal(torch.isinf(lse), torch.isinf(ref64)), "rows without keys must have lse = -inf"
    finite = torch.isfinite(ref64)
    torch.testing.assert_close(lse[finite], ref64[finite], atol=2e-5, rtol=1e-5)


FWD_CASES = {f"f32-{mask}": (torch.float32, mask) for mask in MASKS} | {
    "f16-none": (torch.float16, "none"),
    "f16-runs": (torch.float16, "runs"),
}


@pytest.mark.parametrize("case", list(FWD_CASES), ids=list(FWD_CASES))
def test_forward_kernel(case):
    dtype, mask = FWD_CASES[case]
    q, k, v, cu_q, cu_k = _batch(dtype)
    args = _mask_args(MASKS[mask], DEVICE)
    scale = 0.37
    out, lse = _poisoned(q.shape, dtype), _poisoned((q.shape[1], q.shape[0]), torch.float32)
    KF.attn_fwd(q, k, v, cu_q, cu_k, max(LQ), scale, args["causal"], args["causal_offset"],
                args.get("q_runs"), args.get("k_runs"), out=out, lse=lse)  # fmt: skip
    _, ref_out, ref_lse = _expected(q, k, v, cu_q, cu_k, scale, args)
    torch_out = None if dtype == torch.float32 else _lowp_attention(q, k, v, cu_q, cu_k, scale, args)[3]
    _check(out, ref_out, torch_out, dtype, max(LK))
    _check_lse(lse, ref_lse)


BWD_CASES = {
    "f32-none": (torch.float32, "none"),
    "f32-causal": (torch.float32, "causal"),
    "f32-offset-9": (torch.float32, "offset-9"),
    "f32-runs": (torch.float32, "runs"),
    "f16-offset+3": (torch.float16, "offset+3"),
    "f16-runs": (torch.float16, "runs"),
}


@pytest.mark.parametrize("case", list(BWD_CASES), ids=list(BWD_CASES))
def test_backward_kernels(case):
    dtype, mask = BWD_CASES[case]
    q, k, v, cu_q, cu_k = _batch(dtype, seed=1)
    args = _mask_args(MASKS[mask], DEVICE)
    scale = 0.37
    g = torch.Generator().manual_seed(2)
    dout = torch.randn(q.shape, generator=g).to(dtype).to(DEVICE)
    dlse = torch.randn((q.shape[1], q.shape[0]), generator=g).to(DEVICE)
    out, lse = KF.attn_fwd(q, k, v, cu_q, cu_k, max(LQ), scale, args["causal"], args["causal_offset"],
                           args.get("q_runs"), args.get("k_runs"))  # fmt: skip
    grads = tuple(_poisoned(t.shape, torch.float32) for t in (q, k, v))
    dq, dk, dv = KB.attn_bwd(dout, q, k, v, out, lse, cu_q, cu_k, max(LQ), max(LK), scale, args["causal"],
                             args["causal_offset"], args.get("q_runs"), args.get("k_runs"), dlse=dlse, grads=grads)  # fmt: skip
    (q64, k64, v64), ref_out, ref_lse = _expected(q, k, v, cu_q, cu_k, scale, args, requires_grad=True)
    loss = (ref_out * dout.cpu().double()).sum() + (
        ref_lse.nan_to_num(0.0, 0.0, 0.0) * dlse.cpu().double()
    ).sum()
    expected = torch.autograd.grad(loss, (q64, k64, v64), retain_graph=True)
    if dtype == torch.float32:
        for got, want in zip((dq, dk, dv), expected):
            torch.testing.assert_close(got.double().cpu(), want, **tol(torch.float32, max(LQ) + max(LK)))
        return
    ql, kl, vl, out_lp = _lowp_attention(q, k, v, cu_q, cu_k, scale, args)
    # PyTorch's own fp16 gradients of the output part; the LSE part is added in float64 on both sides
    torch_grads = torch.autograd.grad((out_lp * dout.cpu()).sum(), (ql, kl, vl))
    lse_loss = (ref_lse.nan_to_num(0.0, 0.0, 0.0) * dlse.cpu().double()).sum()
    lse_part = torch.autograd.grad(lse_loss, (q64, k64, v64), allow_unused=True, materialize_grads=True)
    for got, want, theirs, extra in zip((dq, dk, dv), expected, torch_grads, lse_part):
        assert_close_lowp(got.cpu(), want, theirs.double() + extra, atol=2e-3)


# one sequence per mask: causal offsets that put loop bounds on and next to the 16-wide interpreter
# tiles (an off-by-one in a bound only shows there), then two-run layouts split at a tile edge
BOUNDARY_OFFSETS = [-17, -16, -15, -1, 0, 1, 15, 16, 17]
BOUNDARY_RUNS = [((0, 16, 40), (0, 16, 40)), ((5, 15, 31), (0, 17, 33)), ((0, 0, 20), (3, 35, 38))]


def test_loop_bounds_at_tile_edges():
    runs_q = [(off, 33, off + 33) for off in BOUNDARY_OFFSETS] + [r[0] for r in BOUNDARY_RUNS]
    runs_k = [(0, 35, 35)] * len(BOUNDARY_OFFSETS) + [r[1] for r in BOUNDARY_RUNS]
    n = len(runs_q)
    q, k, v, cu_q, cu_k = (
        t.to(DEVICE) for t in varlen_batch([33] * n, [35] * n, 2, 1, 16, torch.float32, seed=9)
    )
    args = dict(causal=True, causal_offset=0, q_runs=torch.tensor(runs_q, dtype=torch.int32, device=DEVICE),
                k_runs=torch.tensor(runs_k, dtype=torch.int32, device=DEVICE))  # fmt: skip
    out, lse = KF.attn_fwd(q, k, v, cu_q, cu_k, 33, 0.5, True, 0, args["q_runs"], args["k_runs"])
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(10)).to(DEVICE)
    grads = KB.attn_bwd(
        dout, q, k, v, out, lse, cu_q, cu_k, 33, 35, 0.5, True, 0, args["q_runs"], args["k_runs"]
    )
    leaves, ref_out, ref_lse = _expected(q, k, v, cu_q, cu_k, 0.5, args, requires_grad=True)
    torch.testing.assert_close(out.double().cpu(), ref_out.detach(), **tol(torch.float32, 35))
    _check_lse(lse, ref_lse.detach())
    expected = torch.autograd.grad((ref_out * dout.cpu().double()).sum(), leaves)
    for got, want in zip(grads, expected):
        torch.testing.assert_close(got.double().cpu(), want, **tol(torch.float32, 70))


@pytest.mark.parametrize("lengths", [[], [0, 0]], ids=["no-sequences", "empty-sequences"])
def test_empty_batches_launch_nothing(lengths):
    q, k, v, cu_q, cu_k = (
        t.to(DEVICE) for t in varlen_batch(lengths, lengths, 2, 1, 16, torch.float32, seed=0)
    )
    out, lse = KF.attn_fwd(q, k, v, cu_q, cu_k, 0, 0.5, True)
    assert out.shape == (0, 2, 16) and lse.shape == (2, 0)
    grads = KB.attn_bwd(q, q, k, v, out, lse, cu_q, cu_k, 0, 0, 0.5, True)
    assert [tuple(g.shape) for g in grads] == [(0, 2, 16), (0, 1, 16), (0, 1, 16)]


def test_merge_kernel_handles_empty_sides():
    g = torch.Generator().manual_seed(3)
    t, h, d = 37, 3, 24
    out_a = torch.randn(t, h, d, generator=g).to(DEVICE)
    out_b = torch.randn(t, h, d, generator=g).half().to(DEVICE)
    lse_a, lse_b = torch.randn(h, t, generator=g).to(DEVICE), torch.randn(h, t, generator=g).to(DEVICE)
    lse_a[0, :5] = -math.inf  # only b has keys
    lse_b[1, 3:9] = -math.inf  # only a has keys
    lse_a[2, 10:12] = lse_b[2, 10:12] = -math.inf  # neither: stays empty
    out_a[2, 10:12] = 0.0
    out_b[2, 10:12] = 0.0
    out, lse = _poisoned((t, h, d), torch.float32), _poisoned((h, t), torch.float32)
    KM.merge_attn_fwd(out_a, lse_a, out_b, lse_b, out=out, lse=lse)
    ref_out, ref_lse = merge_f64(out_a.cpu(), lse_a.cpu(), out_b.cpu(), lse_b.cpu())
    torch.testing.assert_close(out.double().cpu(), ref_out, **tol(torch.float32, 2))
    _check_lse(lse, ref_lse)


@pytest.mark.parametrize("mask", ["none", "causal", "runs"], ids=["none", "causal", "runs"])
def test_ops_take_the_kernel_path(mask, monkeypatch):
    monkeypatch.setattr(
        ops,
        "_new_output",
        lambda shape, dtype, device: torch.full(shape, math.nan, dtype=dtype, device=device),
    )
    q, k, v, cu_q, cu_k = _batch(torch.float32, seed=4)
    args = _mask_args(MASKS[mask], DEVICE)
    kw = dict(softmax_scale=0.5, **args)
    got = ops.attention_block(q, k, v, cu_q, cu_k, max(LQ), max(LK), backend="triton", **kw)
    want = ops.attention_block(q.cpu(), k.cpu(), v.cpu(), cu_q.cpu(), cu_k.cpu(), max(LQ), max(LK), backend="reference",
                               **{n: (a.cpu() if isinstance(a, torch.Tensor) else a) for n, a in kw.items()})  # fmt: skip
    torch.testing.assert_close(got[0].cpu(), want[0], **tol(torch.float32, max(LK)))
    torch.testing.assert_close(got[1].cpu(), want[1], atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_ring_steps_with_kernels(layout):
    """A 3-rank causal ring emulated in one process: the shard pairs, runs and merges of a real ring."""
    degree, lengths = 3, [13, 0, 5, 29]
    q, k, v, cu, _ = varlen_batch(lengths, lengths, 4, 2, 16, torch.float32, seed=5)
    plan = ring_plan(cu, degree, layout)
    shards = [[t.index_select(0, torch.from_numpy(plan.global_index(r))).to(DEVICE) for t in (q, k, v)]
              for r in range(degree)]  # fmt: skip
    _, ref_out, _ = _expected(q, k, v, cu, cu, 0.25, dict(causal=True, causal_offset=0))
    kv_blocks = {s: (shards[s][1], shards[s][2]) for s in range(degree)}
    for r in range(degree):
        ring = make_ring(*shards[r], cu, causal=True, softmax_scale=0.25, group=None, layout=layout,
                         backend="triton", rank=r, degree=degree)  # fmt: skip
        out, _ = ring_forward(ring, *shards[r], communicate=False, kv_blocks=kv_blocks)
        want = ref_out.index_select(0, torch.from_numpy(plan.global_index(r)))
        torch.testing.assert_close(out.double().cpu(), want, **tol(torch.float32, 29))


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_bf16_forward_backward_gpu(causal, head_dim):
    lq = [300, 0, 129, 1000]
    q, k, v, cu_q, cu_k = varlen_batch(lq, lq, 8, 2, head_dim, torch.bfloat16, seed=6)
    q, k, v, cu_q, cu_k = (t.cuda() for t in (q, k, v, cu_q, cu_k))
    args = dict(causal=causal, causal_offset=0)
    dout = torch.randn(q.shape, device="cuda").bfloat16()
    out, lse = KF.attn_fwd(q, k, v, cu_q, cu_k, max(lq), 0.125, causal)
    dq, dk, dv = KB.attn_bwd(dout, q, k, v, out, lse, cu_q, cu_k, max(lq), max(lq), 0.125, causal)
    (q64, k64, v64), ref_out, _ = _expected(q, k, v, cu_q, cu_k, 0.125, args, requires_grad=True)
    expected = torch.autograd.grad((ref_out * dout.cpu().double()).sum(), (q64, k64, v64))
    ql, kl, vl, out_lp = _lowp_attention(q, k, v, cu_q, cu_k, 0.125, args)
    theirs = torch.autograd.grad((out_lp * dout.cpu()).sum(), (ql, kl, vl))
    assert_close_lowp(out.cpu(), ref_out, out_lp, atol=1e-3)
    for got, want, their in zip((dq, dk, dv), expected, theirs):
        assert_close_lowp(got.cpu(), want, their, atol=1e-3)


# ------------------------------------------------------------------ faults the fast path must survive
@pytest.mark.parametrize("max_q,max_k", [(5, 3), (0, 0), (16, 17)], ids=["understated", "zero", "tile"])
def test_understated_max_seqlen_still_writes_every_row(max_q, max_k):
    """On CUDA without MMBALANCE_DEBUG nobody checks the host's max_seqlen against cu_seqlens: a
    too-small value must still give every row its correct value (no NaN from unwritten memory)."""
    q, k, v, cu_q, cu_k = _batch(torch.float32, seed=3)
    args = _mask_args(MASKS["causal"], DEVICE)
    scale = 0.41
    out, lse = _poisoned(q.shape, torch.float32), _poisoned((q.shape[1], q.shape[0]), torch.float32)
    KF.attn_fwd(q, k, v, cu_q, cu_k, max_q, scale, True, 0, out=out, lse=lse)
    (q64, k64, v64), ref_out, ref_lse = _expected(q, k, v, cu_q, cu_k, scale, args, requires_grad=True)
    torch.testing.assert_close(out.double().cpu(), ref_out, **tol(torch.float32, max(LK)))
    _check_lse(lse, ref_lse)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    grads = tuple(_poisoned(t.shape, torch.float32) for t in (q, k, v))
    dq, dk, dv = KB.attn_bwd(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale, True, grads=grads)
    expected = torch.autograd.grad((ref_out * dout.cpu().double()).sum(), (q64, k64, v64))
    for got, want in zip((dq, dk, dv), expected):
        torch.testing.assert_close(got.double().cpu(), want, **tol(torch.float32, max(LQ) + max(LK)))


def test_strided_cu_seqlens_are_read_by_value():
    """A non-contiguous int32 cu_seqlens view (every other element of a buffer) gives the same
    result as the contiguous one: the op hands the kernels a contiguous copy."""
    q, k, v, cu_q, cu_k = _batch(torch.float32, seed=5)
    junk_q = torch.stack([cu_q, torch.full_like(cu_q, 10**6)], 1)[:, 0]
    junk_k = torch.stack([cu_k, torch.full_like(cu_k, -7)], 1)[:, 0]
    assert not junk_q.is_contiguous() and torch.equal(junk_q, cu_q)
    got = ops.attention_block(q, k, v, junk_q, junk_k, max(LQ), max(LK), softmax_scale=0.3, causal=True,
                              backend="triton")  # fmt: skip
    want = ops.attention_block(q, k, v, cu_q, cu_k, max(LQ), max(LK), softmax_scale=0.3, causal=True,
                               backend="triton")  # fmt: skip
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_head_offsets_past_2_to_the_31():
    """Head offsets are int64: a view whose head stride puts the last head past 2**31 elements (the
    buffer is reserved, only the touched pages are ever written) reads and writes the right rows."""
    n_heads, d, t = 3, 16, 20
    stride_head = 2**30  # head 2 starts at element 2**31: wraps to a negative offset in int32
    buf = torch.empty(stride_head * (n_heads - 1) + t * d, dtype=torch.float16, device=DEVICE)
    q = buf.as_strided((t, n_heads, d), (d, stride_head, 1))
    g = torch.Generator().manual_seed(6)
    q.copy_(torch.randn(t, n_heads, d, generator=g).to(torch.float16))
    k = torch.randn(t, n_heads, d, generator=g).to(torch.float16).to(DEVICE)
    v = torch.randn(t, n_heads, d, generator=g).to(torch.float16).to(DEVICE)
    cu = torch.tensor([0, 7, t], dtype=torch.int32, device=DEVICE)
    out, lse = _poisoned((t, n_heads, d), torch.float16), _poisoned((n_heads, t), torch.float32)
    KF.attn_fwd(q, k, v, cu, cu, 13, 0.25, True, out=out, lse=lse)
    args = dict(causal=True, causal_offset=0)
    (q64, k64, v64), ref_out, ref_lse = _expected(q, k, v, cu, cu, 0.25, args, requires_grad=True)
    torch_out = _lowp_attention(q.contiguous(), k, v, cu, cu, 0.25, args)[3]
    _check(out, ref_out, torch_out, torch.float16, t)
    _check_lse(lse, ref_lse)
    dout = torch.randn(t, n_heads, d, generator=g).to(torch.float16).to(DEVICE)
    grads = tuple(_poisoned((t, n_heads, d), torch.float32) for _ in range(3))
    dq, _, _ = KB.attn_bwd(dout, q, k, v, out, lse, cu, cu, 13, 13, 0.25, True, grads=grads)
    want = torch.autograd.grad((ref_out * dout.cpu().double()).sum(), q64)[0]
    torch.testing.assert_close(dq.double().cpu(), want, atol=2e-2, rtol=2e-2)
