"""The direct path of the attention block (eager calls on plain CUDA tensors skip ``torch.ops``
dispatch, ``pyops/attention_ops.py``): the same outputs and gradients as the dispatched op, the
backward of a direct forward, and the cases that must keep the dispatch (CPU, autocast, a recorded
backward, ``MMBALANCE_DEBUG``, tensor subclasses).

On a CPU the direct path is forced (``_direct`` patched), so the implementation it runs is the
reference; what is checked is the plumbing: autograd through :class:`_AttentionDirect`, the
registered setup and backward, and that nothing differs from the custom op's answers.
"""

from __future__ import annotations

import pytest
import torch

import mmbalance.pyops  # noqa: F401 - registers the ops
from mmbalance.kernels import _launch
from mmbalance.pyops import attention_ops as A
from mmbalance.pyops import varlen as V
from tests.pyops.attention_expected import varlen_batch

pytestmark = pytest.mark.skipif(_launch.INTERPRET, reason="the reference path runs on CPU tensors")

LQ, LK = [7, 0, 5, 3, 6], [6, 2, 0, 9, 6]
CASES = {
    "causal": dict(causal=True),
    "offset": dict(causal=True, causal_offset=2),
    "window-softcap": dict(causal=True, window_left=2, softcap=3.0),
    "full-sinks": dict(causal=False, sinks=True),
}


def _call(case: str, seed: int = 0):
    q, k, v, cu_q, cu_k = varlen_batch(LQ, LK, 4, 2, 8, torch.float64, seed=seed)
    kw = dict(CASES[case])
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    if kw.pop("sinks", False):
        kw["sinks"] = torch.tensor([0.3, -1.0, 0.0, 2.0], dtype=torch.float64, requires_grad=True)
        leaves.append(kw["sinks"])
    out, lse = A.attention_block(*leaves[:3], cu_q, cu_k, max(LQ), max(LK), softmax_scale=0.4, **kw)
    return leaves, out, lse


@pytest.mark.parametrize("case", list(CASES))
def test_direct_calls_equal_the_dispatched_op(case, monkeypatch):
    want_leaves, want_out, want_lse = _call(case)
    calls = []
    real = A._AttentionDirect.apply
    monkeypatch.setattr(A, "_direct", lambda q: True)
    monkeypatch.setattr(A._AttentionDirect, "apply", lambda *a: calls.append(1) or real(*a))
    got_leaves, got_out, got_lse = _call(case)
    assert calls, "the forced direct path did not run"
    torch.testing.assert_close(got_out, want_out, rtol=0, atol=0)
    torch.testing.assert_close(got_lse, want_lse, rtol=0, atol=0)
    # gradients through both outputs (a gradient reaching the LSE too, as the ring's merge gives)
    g = torch.Generator().manual_seed(3)
    dout = torch.randn(got_out.shape, generator=g, dtype=torch.float64)
    dlse = torch.randn(got_lse.shape, generator=g, dtype=torch.float64).masked_fill(torch.isinf(got_lse), 0.0)
    got = torch.autograd.grad((got_out * dout).sum() + (got_lse.nan_to_num(0, 0, 0) * dlse).sum(), got_leaves)
    want = torch.autograd.grad(
        (want_out * dout).sum() + (want_lse.nan_to_num(0, 0, 0) * dlse).sum(), want_leaves
    )
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_direct_gradients_check_in_float64(monkeypatch):
    monkeypatch.setattr(A, "_direct", lambda q: True)
    q, k, v, cu_q, cu_k = varlen_batch([4, 0, 3], [5, 1, 3], 2, 1, 4, torch.float64, seed=1)

    def fn(q, k, v):
        out, lse = A.attention_block(q, k, v, cu_q, cu_k, 4, 5, causal=True, causal_offset=1)
        return out, lse.nan_to_num(0.0, 0.0, 0.0)

    assert torch.autograd.gradcheck(fn, tuple(t.clone().requires_grad_() for t in (q, k, v)))


def test_without_grad_the_implementation_runs_alone(monkeypatch):
    monkeypatch.setattr(A, "_direct", lambda q: True)
    called = []
    real = A._AttentionDirect.apply
    monkeypatch.setattr(A._AttentionDirect, "apply", lambda *a: called.append(1) or real(*a))
    q, k, v, cu_q, cu_k = varlen_batch(LQ, LK, 2, 2, 8, torch.float64, seed=2)
    with torch.no_grad():
        A.attention_block(q.requires_grad_(), k, v, cu_q, cu_k, max(LQ), max(LK))
    A.attention_block(q.detach(), k, v, cu_q, cu_k, max(LQ), max(LK))
    assert not called
    A.attention_block(q.detach(), k.requires_grad_(), v, cu_q, cu_k, max(LQ), max(LK))
    assert called


def test_a_backward_that_records_a_graph_takes_the_op(monkeypatch):
    """create_graph=True records the backward: it takes the dispatched backward op (which has no
    derivative and says so when one is asked for), never a silent graph-less direct result."""
    monkeypatch.setattr(A, "_direct", lambda q: True)
    seen = []
    real = torch.ops.mmbalance.attention_block_bwd

    class Spy:
        def __call__(self, *args):
            seen.append("op")
            return real(*args)

    monkeypatch.setattr(torch.ops.mmbalance, "attention_block_bwd", Spy())
    leaves, out, _ = _call("causal")
    torch.autograd.grad(out.sum(), leaves)
    assert not seen  # a plain backward: the implementation straight
    leaves, out, _ = _call("causal")
    torch.autograd.grad(out.sum(), leaves, create_graph=True)
    assert seen == ["op"]


def test_attention_block_backward_direct_only_when_nothing_is_recorded(monkeypatch):
    monkeypatch.setattr(A, "_direct", lambda q: True)
    impl_calls = []
    real = A._attention_block_bwd_impl
    monkeypatch.setattr(A, "_attention_block_bwd_impl", lambda *a: impl_calls.append(1) or real(*a))
    q, k, v, cu_q, cu_k = varlen_batch(LQ, LK, 2, 2, 8, torch.float64, seed=4)
    out, lse = A.attention_block(q, k, v, cu_q, cu_k, max(LQ), max(LK), causal=True)
    dout = torch.randn_like(out)
    plain = A.attention_block_backward(dout, q, k, v, out, lse, cu_q, cu_k, max(LQ), max(LK), causal=True)
    assert len(impl_calls) == 1
    # an input that requires grad under grad mode: the op (impl called through it once more)
    recorded = A.attention_block_backward(dout.requires_grad_(), q, k, v, out, lse, cu_q, cu_k, max(LQ),
                                          max(LK), causal=True)  # fmt: skip
    assert len(impl_calls) == 2
    for a, b in zip(plain, recorded):
        torch.testing.assert_close(a, b.detach(), rtol=0, atol=0)


def test_who_takes_the_direct_path(monkeypatch):
    cpu = torch.zeros(2, 1, 8)
    assert not A._direct(cpu)  # CPU tensors: the dispatched op (its reference path and value checks)

    class FakeCuda(torch.Tensor):  # a plain type that says it is on CUDA
        pass

    monkeypatch.setattr(V, "_PLAIN", (torch.Tensor, torch.nn.Parameter, FakeCuda))
    monkeypatch.setattr(FakeCuda, "is_cuda", property(lambda self: True))
    fake = torch.zeros(2).as_subclass(FakeCuda)
    assert A._direct(fake)
    monkeypatch.setattr(torch, "is_autocast_enabled", lambda device_type=None: device_type == "cuda")
    assert not A._direct(fake)  # autocast's casting rules live on the op
    monkeypatch.undo()
    monkeypatch.setattr(V, "_PLAIN", (torch.Tensor, torch.nn.Parameter, FakeCuda))
    monkeypatch.setattr(FakeCuda, "is_cuda", property(lambda self: True))
    monkeypatch.setenv("MMBALANCE_DEBUG", "1")  # the value checks run in the dispatched op
    assert not A._direct(fake)
