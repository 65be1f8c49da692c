"""Sliding windows, softcapping, sinks and bottom-right causal blocks on the attention ops' CPU
path (the blockwise torch path of ``pyops/attention_ref.py``), against the independent dense
float64 attention of ``attention_dense.py``, forward and backward, alone and combined.

Small block sizes make every multi-block path (masked edge blocks, skipped blocks, several query
blocks per thread) run at small shapes; outputs are allocated NaN-filled, so a row the path forgets
to write fails the comparison.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.library import opcheck

import mmbalance.pyops  # noqa: F401 - registers the ops
from mmbalance.kernels import _launch
from mmbalance.pyops import attention_ops as ops
from mmbalance.pyops import attention_ref as ref
from mmbalance.pyops.attention_backends import AttentionInputs, flash_attn_unsupported_reasons
from tests.pyops.attention_dense import dense_attention
from tests.tolerances import tol

pytestmark = pytest.mark.skipif(
    _launch.INTERPRET, reason="CPU tensors run the kernels under TRITON_INTERPRET"
)

H, HKV, D = 4, 2, 8
SCALE = 0.45


@pytest.fixture(autouse=True)
def poisoned_outputs(monkeypatch):
    """Every output of the CPU path starts as NaN."""

    def poisoned(shape, dtype, device):
        return torch.full(shape, math.nan, dtype=dtype, device=device)

    monkeypatch.setattr(ref, "_new_output", poisoned)


def _batch(seed: int, dtype=torch.float64, n_seqs: int = 5, max_len: int = 13):
    """Random lengths (zero-length sequences included), Lq != Lk, and inputs."""
    g = torch.Generator().manual_seed(seed)
    lq = torch.randint(0, max_len + 1, (n_seqs,), generator=g).tolist()
    lk = torch.randint(0, max_len + 1, (n_seqs,), generator=g).tolist()
    lq[seed % n_seqs], lk[(seed + 2) % n_seqs] = 0, 0
    cu_q = torch.tensor([0, *torch.tensor(lq).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(lk).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(int(cu_q[-1]), H, D, generator=g).to(dtype)
    k = torch.randn(int(cu_k[-1]), HKV, D, generator=g).to(dtype)
    v = torch.randn(int(cu_k[-1]), HKV, D, generator=g).to(dtype)
    sinks = torch.randn(H, generator=g).to(dtype)
    return q, k, v, cu_q, cu_k, lq, lk, sinks


def _bottom_right_runs(lq, lk):
    """Runs that put each sequence's queries at the end of its keys (flash-attn's alignment,
    the KV-cache case): query ``i`` at ``Lk - Lq + i``."""
    q_runs = torch.tensor([[b - a, a, b] for a, b in zip(lq, lk)], dtype=torch.int32)
    k_runs = torch.tensor([[0, b, b] for b in lk], dtype=torch.int32)
    return q_runs, k_runs


FEATURES = {
    "plain": dict(),
    "causal": dict(causal=True),
    "window-causal": dict(causal=True, window_left=3),
    "window-both": dict(window_left=2, window_right=1),
    "window-offset": dict(causal=True, causal_offset=-2, window_left=4, window_right=0),
    "softcap": dict(causal=True, softcap=1.5),
    "sinks": dict(causal=True, sinks=True),
    "sinks-plain": dict(sinks=True),
    "bottom-right": dict(causal=True, bottom_right=True),
    "combined": dict(causal=True, bottom_right=True, window_left=5, softcap=2.0, sinks=True),
}


def _kwargs(feature: str, lq, lk, sinks):
    kw = dict(FEATURES[feature])
    if kw.pop("bottom_right", False):
        kw["q_runs"], kw["k_runs"] = _bottom_right_runs(lq, lk)
    if kw.get("sinks"):
        kw["sinks"] = sinks
    else:
        kw.pop("sinks", None)
    return kw


def _dense_kw(kw):
    out = dict(kw)
    for name in ("q_runs", "k_runs"):
        if name in out:
            out[name] = out[name].tolist()
    return out


def _dense_grads(q, k, v, cu_q, cu_k, kw, dout, dlse):
    """Dense float64 ``out``, ``lse`` and, by autograd, the gradients of
    ``sum(out * dout) + sum(lse * dlse)`` (``dlse`` is zero where ``lse`` is ``-inf``)."""
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    dkw = _dense_kw(kw)
    if "sinks" in dkw:
        dkw["sinks"] = dkw["sinks"].detach().double().requires_grad_()
        leaves.append(dkw["sinks"])
    out, lse = dense_attention(*leaves[:3], cu_q, cu_k, SCALE, **dkw)
    finite = torch.isfinite(lse)
    loss = (out * dout.double()).sum() + torch.where(finite, lse * dlse.double(), 0.0).sum()
    grads = (
        torch.autograd.grad(loss, leaves, allow_unused=True) if leaves[0].shape[0] else [None] * len(leaves)
    )
    grads = [torch.zeros_like(x) if g is None else g for g, x in zip(grads, leaves)]
    return out.detach(), lse.detach(), grads


def _random_like(shape, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _assert_lse(lse, want, dtype, n):
    assert torch.equal(torch.isneginf(lse), torch.isneginf(want))
    finite = torch.isfinite(want)
    torch.testing.assert_close(lse.double()[finite], want[finite], **tol(dtype, n))


@pytest.mark.parametrize("blocks", [(2, 3), (5, 4)], ids=["b2x3", "b5x4"])
@pytest.mark.parametrize("feature", list(FEATURES))
def test_blockwise_path_matches_dense(feature, blocks):
    q, k, v, cu_q, cu_k, lq, lk, sinks = _batch(seed=len(feature) + blocks[0])
    kw = _kwargs(feature, lq, lk, sinks)
    bq, bk = blocks
    fwd_kw = {n: kw[n] for n in ("window_left", "window_right", "softcap", "sinks") if n in kw}
    out, lse = ref.attention_block_fwd_ref(
        q, k, v, cu_q, cu_k, SCALE, kw.get("causal", False), kw.get("causal_offset", 0), kw.get("q_runs"),
        kw.get("k_runs"), block_q=bq, block_k=bk, **fwd_kw,
    )  # fmt: skip
    dout = _random_like(q.shape, 1)
    dlse = torch.where(torch.isfinite(lse), _random_like(lse.shape, 2), 0.0)
    want_out, want_lse, grads = _dense_grads(q, k, v, cu_q, cu_k, kw, dout, dlse)
    n = max(lk) + 1
    torch.testing.assert_close(out, want_out, **tol(torch.float64, n))
    _assert_lse(lse, want_lse, torch.float64, n)
    bwd_kw = {n: kw[n] for n in ("window_left", "window_right", "softcap") if n in kw}
    dq, dk, dv = ref.attention_block_bwd_ref(
        dout, q, k, v, out, lse, cu_q, cu_k, SCALE, kw.get("causal", False), kw.get("causal_offset", 0),
        kw.get("q_runs"), kw.get("k_runs"), dlse, block_q=bq, block_k=bk, **bwd_kw,
    )  # fmt: skip
    for got, want in zip((dq, dk, dv), grads):
        torch.testing.assert_close(got, want, **tol(torch.float64, max(lq) + max(lk)))
    if "sinks" in kw:
        torch.testing.assert_close(
            ref.sinks_grad(sinks, out, lse, dout, dlse), grads[3], **tol(torch.float64, n)
        )


@pytest.fixture
def small_blocks(monkeypatch):
    monkeypatch.setattr(ref, "BLOCK_Q", 3)
    monkeypatch.setattr(ref, "BLOCK_K", 2)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("feature", ["window-offset", "softcap", "sinks", "bottom-right", "combined"])
def test_op_autograd_matches_dense(feature, dtype, small_blocks):
    """``attention_block`` with autograd (``out`` and ``lse`` both reach the loss) against autograd
    through the dense float64 reference: dq, dk, dv and d sinks."""
    q, k, v, cu_q, cu_k, lq, lk, sinks = _batch(seed=11 + len(feature), dtype=dtype)
    kw = _kwargs(feature, lq, lk, sinks)
    leaves = [t.requires_grad_() for t in (q, k, v)]
    if "sinks" in kw:
        kw["sinks"] = sinks.requires_grad_()
        leaves.append(kw["sinks"])
    out, lse = ops.attention_block(q, k, v, cu_q, cu_k, max(lq), max(lk), softmax_scale=SCALE, **kw)
    dout = _random_like(q.shape, 3)
    dlse = torch.where(torch.isfinite(lse), _random_like(lse.shape, 4), 0.0)
    loss = (out.double() * dout).sum() + torch.where(torch.isfinite(lse), lse.double() * dlse, 0.0).sum()
    got = torch.autograd.grad(loss, leaves)
    want_out, want_lse, want = _dense_grads(q, k, v, cu_q, cu_k, kw, dout, dlse)
    n = max(lq) + max(lk)
    assert out.dtype == dtype and lse.dtype == dtype
    torch.testing.assert_close(out.detach().double(), want_out, **tol(dtype, n))
    _assert_lse(lse.detach(), want_lse, dtype, n)
    for g, w in zip(got, want):
        assert g.dtype == dtype
        torch.testing.assert_close(g.double(), w, **tol(dtype, n))


def test_gradcheck_every_feature_combined(small_blocks):
    """Numerical gradients of out and lse in q, k, v and sinks (sinks keep every LSE finite)."""
    q, k, v, cu_q, cu_k, lq, lk, sinks = _batch(seed=5, n_seqs=3, max_len=6)
    q_runs, k_runs = _bottom_right_runs(lq, lk)
    inputs = tuple(t.requires_grad_() for t in (q, k, v, sinks))

    def fn(q, k, v, sinks):
        return ops.attention_block(q, k, v, cu_q, cu_k, 6, 6, softmax_scale=SCALE, causal=True, q_runs=q_runs,
                                   k_runs=k_runs, window_left=3, softcap=1.5, sinks=sinks)  # fmt: skip

    assert torch.autograd.gradcheck(fn, inputs)


def test_empty_batches_and_rows_without_keys():
    for lq, lk in (([], []), ([0, 0], [0, 3]), ([3, 0, 2], [0, 0, 0])):
        cu_q = torch.tensor([0, *torch.tensor(lq, dtype=torch.long).cumsum(0).tolist()], dtype=torch.int32)
        cu_k = torch.tensor([0, *torch.tensor(lk, dtype=torch.long).cumsum(0).tolist()], dtype=torch.int32)
        q, k = torch.randn(sum(lq), H, D), torch.randn(sum(lk), HKV, D)
        sinks = torch.randn(H)
        out, lse = ops.attention_block(q, k, k, cu_q, cu_k, max(lq, default=0), max(lk, default=0),
                                       causal=True, window_left=1, sinks=sinks)  # fmt: skip
        assert torch.equal(out, torch.zeros_like(out))
        assert torch.equal(lse, sinks[:, None].expand(H, sum(lq)))
        out, lse = ops.attention_block(
            q, k, k, cu_q, cu_k, max(lq, default=0), max(lk, default=0), softcap=2.0
        )
        assert torch.equal(out, torch.zeros_like(out)) and bool(torch.isneginf(lse).all())


def test_threads_agree(small_blocks):
    """One thread and two threads give the same results (the work is split by query blocks)."""
    q, k, v, cu_q, cu_k, lq, lk, sinks = _batch(seed=8, dtype=torch.float32, n_seqs=4, max_len=30)
    kw = dict(causal=True, window_left=9, softcap=3.0, sinks=sinks)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(9))
    results = []
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            out, lse = ops.attention_block(q, k, v, cu_q, cu_k, max(lq), max(lk), **kw)
            grads = ops.attention_block_backward(dout, q, k, v, out, lse, cu_q, cu_k, max(lq), max(lk),
                                                 causal=True, window_left=9, softcap=3.0)  # fmt: skip
            results.append((out, lse, *grads))
            assert torch.get_num_threads() == n
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_inference_mode(small_blocks):
    """Worker threads run under the caller's inference mode (its outputs are inference tensors)."""
    q, k, v, cu_q, cu_k, lq, lk, sinks = _batch(seed=12, dtype=torch.float32, n_seqs=3, max_len=20)
    kw = dict(causal=True, window_left=6, sinks=sinks)
    want_out, want_lse = ops.attention_block(q, k, v, cu_q, cu_k, max(lq), max(lk), **kw)
    with torch.inference_mode():
        out, lse = ops.attention_block(q, k, v, cu_q, cu_k, max(lq), max(lk), **kw)
    assert out.is_inference()
    torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-6)


@pytest.fixture
def one_thread():
    """One intra-op thread: CPU matmuls split over threads may sum in another order from one call
    to the next (a float32 ulp apart), and the test below compares calls bit for bit."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("amp", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_autocast_runs_the_ops_in_the_autocast_dtype(small_blocks, one_thread, amp):
    """Under autocast both block ops cast q, k, v (and dout) to the autocast dtype, as torch's own
    attention does: mixed inputs (float32 q and k, half-precision v, as HF decoders pass them under
    autocast) give exactly what the same inputs cast outside autocast give, lse stays float32,
    gradients reach every input in its own dtype; compiled (fullgraph) alike. Outside autocast
    the mix is a TypeError naming the op."""
    q, k, v, cu_q, cu_k, lq, lk, sinks = _batch(seed=12, dtype=torch.float32, n_seqs=3, max_len=20)
    v = v.to(amp)
    args = (cu_q, cu_k, max(lq), max(lk))
    kw = dict(causal=True, window_left=6, sinks=sinks)
    mixed = [t.clone().requires_grad_() for t in (q, k, v)]
    low = [t.detach().to(amp).requires_grad_() for t in (q, k, v)]
    with torch.autocast("cpu", dtype=amp):
        out, lse = ops.attention_block(*mixed, *args, **kw)
        compiled = torch.compile(
            lambda *t: ops.attention_block(*t, *args, **kw), backend="aot_eager", fullgraph=True
        )
        out_c, lse_c = compiled(*(t.detach() for t in mixed))
    want, want_lse = ops.attention_block(*low, *args, **kw)
    assert out.dtype == amp and lse.dtype == torch.float32
    for got in ((out, lse), (out_c, lse_c)):
        assert torch.equal(got[0], want) and torch.equal(got[1], want_lse)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
    (out.float() * dout).sum().backward()
    (want.float() * dout).sum().backward()
    for a, b in zip(mixed, low):
        assert a.grad.dtype == a.dtype
        assert torch.equal(a.grad, b.grad.to(a.dtype))
    # the backward op called directly under autocast: a float32 dout meets half-precision v
    with torch.autocast("cpu", dtype=amp):
        grads = ops.attention_block_backward(dout, q, k, v, want, want_lse, *args, causal=True, window_left=6)
    want_grads = ops.attention_block_backward(
        dout.to(amp), q.to(amp), k.to(amp), v, want, want_lse, *args, causal=True, window_left=6
    )
    for a, b in zip(grads, want_grads):
        assert torch.equal(a, b)
    with pytest.raises(TypeError, match=f"attention_block: q, k and v must share a dtype, got torch.float32, "
                       f"torch.float32, {amp}"):  # fmt: skip
        ops.attention_block(q, k, v, *args, **kw)
    with pytest.raises(TypeError, match="attention_block_backward: q, k and v must share a dtype"):
        ops.attention_block_backward(dout, q, k, v, want, want_lse, *args, causal=True)


def test_parallel_reraises_a_worker_error_and_thread_count_is_restored():
    def run(_worker, task):
        if task == 3:
            raise RuntimeError("task 3 failed")

    threads = torch.get_num_threads()
    with pytest.raises(RuntimeError, match="task 3"):
        with ref._single_threaded_ops(torch.device("cpu")) as workers:
            assert workers == threads and torch.get_num_threads() == 1
            ref._parallel(list(range(8)), run, 2)
    assert torch.get_num_threads() == threads


def test_opcheck_with_features():
    q, k, v, cu_q, cu_k, lq, lk, sinks = _batch(seed=4, dtype=torch.float32)
    q_runs, k_runs = _bottom_right_runs(lq, lk)
    args = (q.requires_grad_(), k, v, cu_q, cu_k, max(lq), max(lk), SCALE, True, 0, q_runs, k_runs, None, "auto",
            2, -1, 1.5, sinks.requires_grad_())  # fmt: skip
    opcheck(torch.ops.mmbalance.attention_block_fwd, args)
    out, lse = torch.ops.mmbalance.attention_block_fwd(*args)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(6))
    bwd = (dout, q.detach(), k, v, out.detach(), lse.detach(), cu_q, cu_k, max(lq), max(lk), SCALE, True, 0,
           q_runs, k_runs, None, "auto", 2, -1, 1.5)  # fmt: skip
    opcheck(torch.ops.mmbalance.attention_block_bwd, bwd)


def _good_call():
    q, k, v, cu_q, cu_k, lq, lk, _ = _batch(seed=0, dtype=torch.float32, n_seqs=2, max_len=4)
    return dict(
        q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max(lq), max_seqlen_k=max(lk)
    )


BAD_FEATURES = [
    ("window_left", dict(window_left=-2), ValueError),
    ("window_right", dict(window_right=1.5), TypeError),
    ("window_left", dict(window_left=torch.tensor(3)), TypeError),
    ("softcap", dict(softcap=-1.0), ValueError),
    ("softcap", dict(softcap=math.inf), ValueError),
    ("softcap", dict(softcap=True), TypeError),
    ("sinks", dict(sinks=torch.zeros(H + 1)), ValueError),
    ("sinks", dict(sinks=torch.zeros(1, H)), ValueError),
    ("sinks", dict(sinks=torch.zeros(H, dtype=torch.int64)), TypeError),
    ("sinks", dict(sinks=torch.tensor([0.0, math.inf, 0.0, 0.0])), ValueError),
    ("sinks", dict(sinks=[0.0] * H), TypeError),
]


@pytest.mark.parametrize(
    "case", range(len(BAD_FEATURES)), ids=[f"{c[0]}-{i}" for i, c in enumerate(BAD_FEATURES)]
)
def test_bad_feature_raises_naming_it(case):
    name, change, error = BAD_FEATURES[case]
    with pytest.raises(error, match=name):
        ops.attention_block(**_good_call(), causal=True, **change)
    if name != "sinks":
        good = _good_call()
        out, lse = ops.attention_block(**good)
        with pytest.raises(error, match=name):
            ops.attention_block_backward(torch.zeros_like(good["q"]), good["q"], good["k"], good["v"], out, lse,
                                         good["cu_seqlens_q"], good["cu_seqlens_k"], good["max_seqlen_q"],
                                         good["max_seqlen_k"], **change)  # fmt: skip


def test_flash_attn_refuses_sinks_and_offset_windows_by_name():
    cuda = dict(q_shape=(4, 2, 64), k_shape=(4, 2, 64), dtype=torch.float16, device=torch.device("cuda"))
    reasons = flash_attn_unsupported_reasons(AttentionInputs(**cuda, has_sinks=True))
    assert any("sinks" in r for r in reasons)
    reasons = flash_attn_unsupported_reasons(AttentionInputs(**cuda, causal_offset=3, window_left=2))
    assert any("causal offset" in r for r in reasons)
    reasons = flash_attn_unsupported_reasons(AttentionInputs(**cuda, window_left=2, softcap=1.0))
    assert not any("causal offset" in r or "sinks" in r for r in reasons)
