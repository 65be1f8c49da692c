"""The attention ops with windows, softcapping, sinks and bottom-right causal blocks on the Triton
path (CUDA, or CPU tensors under ``TRITON_INTERPRET=1``, which ``tests/kernels/
test_under_interpreter.py`` runs), through autograd, against the dense float64 reference: what the
Hugging Face backend calls on a GPU."""

from __future__ import annotations

import pytest
import torch

import mmbalance.pyops  # noqa: F401 - registers the ops
from mmbalance.kernels import _launch
from mmbalance.pyops import attention_ops as ops
from tests.pyops.test_attention_op_features import (
    SCALE,
    _assert_lse,
    _batch,
    _dense_grads,
    _kwargs,
    _random_like,
)
from tests.tolerances import tol

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(
    not (_launch.INTERPRET or torch.cuda.is_available()),
    reason="the Triton path needs CUDA or TRITON_INTERPRET=1 at import",
)


@pytest.mark.parametrize(
    "feature", ["window-causal", "window-both", "softcap", "sinks", "bottom-right", "combined"]
)
def test_triton_path_matches_dense(feature):
    q, k, v, cu_q, cu_k, lq, lk, sinks = _batch(seed=21 + len(feature), dtype=torch.float32)
    kw = _kwargs(feature, lq, lk, sinks)
    q, k, v, cu_q, cu_k = (t.to(DEVICE) for t in (q, k, v, cu_q, cu_k))
    kw = {n: (t.to(DEVICE) if isinstance(t, torch.Tensor) else t) for n, t in kw.items()}
    leaves = [t.requires_grad_() for t in (q, k, v)]
    if "sinks" in kw:
        kw["sinks"] = kw["sinks"].requires_grad_()
        leaves.append(kw["sinks"])
    out, lse = ops.attention_block(
        q, k, v, cu_q, cu_k, max(lq), max(lk), softmax_scale=SCALE, backend="triton", **kw
    )
    dout = _random_like(q.shape, 5).to(DEVICE)
    dlse = torch.where(torch.isfinite(lse), _random_like(lse.shape, 6).to(DEVICE), 0.0)
    loss = (out.double() * dout).sum() + torch.where(torch.isfinite(lse), lse.double() * dlse, 0.0).sum()
    got = torch.autograd.grad(loss, leaves)
    cpu_kw = {n: (t.detach().cpu() if isinstance(t, torch.Tensor) else t) for n, t in kw.items()}
    want_out, want_lse, want = _dense_grads(
        q.cpu(), k.cpu(), v.cpu(), cu_q.cpu(), cu_k.cpu(), cpu_kw, dout.cpu(), dlse.cpu()
    )
    n = max(lq) + max(lk)
    torch.testing.assert_close(out.detach().double().cpu(), want_out, **tol(torch.float32, n))
    _assert_lse(lse.detach().cpu(), want_lse, torch.float32, n)
    for g, w in zip(got, want):
        torch.testing.assert_close(g.double().cpu(), w, **tol(torch.float32, n))
