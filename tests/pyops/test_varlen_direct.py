"""The direct path of the varlen ops (eager calls on plain CUDA tensors skip ``torch.ops`` dispatch,
``pyops/varlen.py``): the same values, gradients and double backward as the dispatched ops, and the
cases that must keep the dispatch (compiling, ``MMBALANCE_DEBUG``, tensor subclasses, CPU).

On a CPU the direct path is forced (``direct_eligible`` patched), so the implementation it runs is the
reference; what is checked is the plumbing: autograd through :class:`_Direct`, the registered
backward, and that nothing differs from the custom op's answers.
"""

from __future__ import annotations

import pytest
import torch

import mmbalance.pyops as P
from mmbalance.pyops import varlen as V


def _case(dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    seqlens = torch.tensor([3, 0, 5, 2])
    cu = P.cu_seqlens_from_lengths(seqlens)
    packed = torch.randn(10, 3, 2, generator=g, dtype=dtype)
    order = torch.tensor([2, 0, 3])
    return seqlens, cu, packed, order


CALLS = {
    "pack": lambda s, cu, x, o: P.pack(P.unpack(x, cu, 5).detach().requires_grad_(), s, 10),
    "unpack": lambda s, cu, x, o: P.unpack(x, cu, 6, 0.0),
    "segment_gather": lambda s, cu, x, o: P.segment_gather(x, cu, o, 10),
    "segment_scatter": lambda s, cu, x, o: P.segment_scatter(P.segment_gather(x, cu, o, 10), cu, o, 10),
}


@pytest.mark.parametrize("op", list(CALLS))
def test_direct_calls_equal_the_dispatched_ops(op, monkeypatch):
    s, cu, x, o = _case()
    want_in = x.clone().requires_grad_()
    want = CALLS[op](s, cu, want_in, o)
    monkeypatch.setattr(V, "direct_eligible", lambda t: True)
    got_in = x.clone().requires_grad_()
    got = CALLS[op](s, cu, got_in, o)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    dout = torch.randn_like(got).requires_grad_()
    if op == "pack":  # the input of pack is the leaf unpack made inside the call
        return
    (g_got,) = torch.autograd.grad(got, got_in, dout, create_graph=True)
    (g_want,) = torch.autograd.grad(want, want_in, dout, create_graph=True)
    torch.testing.assert_close(g_got, g_want, rtol=0, atol=0)
    # double backward (the gradient's gradient in dout) goes through the direct path again
    w = torch.randn_like(g_got)
    (gg_got,) = torch.autograd.grad((g_got * w).sum(), dout)
    (gg_want,) = torch.autograd.grad((g_want * w).sum(), dout)
    torch.testing.assert_close(gg_got, gg_want, rtol=0, atol=0)


def test_direct_gradients_check_in_float64(monkeypatch):
    monkeypatch.setattr(V, "direct_eligible", lambda t: True)
    s, cu, x, o = _case()
    for fn in (
        lambda t: P.unpack(t, cu, 6, 0.0),
        lambda t: P.segment_gather(t, cu, o, 10),
        lambda t: P.pack(P.unpack(t, cu, 5), s, 10),
    ):
        assert torch.autograd.gradcheck(fn, (x.clone().requires_grad_(),))
        assert torch.autograd.gradgradcheck(fn, (x.clone().requires_grad_(),))


def test_without_grad_the_implementation_runs_alone(monkeypatch):
    monkeypatch.setattr(V, "direct_eligible", lambda t: True)
    called = []
    real = V._Direct.apply
    monkeypatch.setattr(V._Direct, "apply", lambda *a: called.append(1) or real(*a))
    s, cu, x, o = _case()
    with torch.no_grad():
        P.segment_gather(x.requires_grad_(), cu, o, 10)
    P.segment_gather(x.detach(), cu, o, 10)
    assert not called
    P.segment_gather(x.detach().requires_grad_(), cu, o, 10)
    assert called


def test_who_takes_the_direct_path(monkeypatch):
    cpu = torch.zeros(2)
    assert not V.direct_eligible(cpu)  # CPU tensors: the dispatched op (its reference path and value checks)
    meta = torch.zeros(2, device="meta")
    assert not V.direct_eligible(meta)

    class Sub(torch.Tensor):
        pass

    assert not V.direct_eligible(cpu.as_subclass(Sub))

    class FakeCuda(torch.Tensor):  # a plain type that says it is on CUDA
        pass

    monkeypatch.setattr(V, "_PLAIN", (torch.Tensor, torch.nn.Parameter, FakeCuda))
    fake = torch.zeros(2).as_subclass(FakeCuda)
    monkeypatch.setattr(FakeCuda, "is_cuda", property(lambda self: True))
    assert V.direct_eligible(fake)
    monkeypatch.setenv("MMBALANCE_DEBUG", "1")  # the value checks run in the dispatched op
    assert not V.direct_eligible(fake)


def test_dispatch_modes_see_the_op(monkeypatch):
    """Under a dispatch mode (make_fx, FlopCounterMode, debug modes) calls take the registered op,
    which the mode then sees."""
    from torch.utils.flop_counter import FlopCounterMode

    class FakeCuda(torch.Tensor):
        pass

    monkeypatch.setattr(V, "_PLAIN", (torch.Tensor, torch.nn.Parameter, FakeCuda))
    monkeypatch.setattr(FakeCuda, "is_cuda", property(lambda self: True))
    fake = torch.zeros(2).as_subclass(FakeCuda)
    assert V.direct_eligible(fake)
    with FlopCounterMode(display=False):
        assert not V.direct_eligible(fake)
