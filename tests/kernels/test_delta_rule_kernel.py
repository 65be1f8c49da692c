"""The chunk-state kernel of the gated delta rule (``kernels/delta_rule.py``) against the float64
reference written token by token (``tests/pyops/delta_rule_expected.py``): fresh random inputs,
odd sizes, empty chunks, no value columns, strided token rows, float32 / float16 / bfloat16 inputs,
outputs poisoned before the launch, and the op's ``backend="triton"`` path; the fused backward
against autograd through that reference (several checkpoint segments a chunk, one output's gradient
alone, the op's backward on the kernel path equal to the reference's).

They need a CUDA device or ``TRITON_INTERPRET=1`` set before the kernel modules are imported
(``tests/kernels/test_under_interpreter.py`` runs this file so):
``TRITON_INTERPRET=1 python -m pytest tests/kernels/test_delta_rule_kernel.py``.
"""

from __future__ import annotations

import pytest
import torch

import mmbalance.pyops as P
from mmbalance.kernels import _launch
from mmbalance.kernels import delta_rule as K
from tests.pyops.delta_rule_expected import chunk_maps, random_inputs

pytestmark = pytest.mark.skipif(
    not (_launch.INTERPRET or torch.cuda.is_available()), reason="kernels need TRITON_INTERPRET=1 or CUDA"
)
DEVICE = "cuda" if torch.cuda.is_available() and not _launch.INTERPRET else "cpu"

CASES = [
    (11, 3, 5, 7, [0, 4, 4, 11]),
    (19, 2, 16, 20, [0, 19]),
    (9, 1, 33, 3, [0, 2, 2, 9]),
    (6, 2, 3, 0, [0, 2, 6]),
    (0, 2, 4, 4, [0, 0]),
]


@pytest.mark.parametrize("tokens,heads,key_dim,value_dim,cu", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_kernel_against_the_reference(tokens, heads, key_dim, value_dim, cu, dtype):
    k, v, g, beta, _ = random_inputs(tokens, heads, key_dim, value_dim, seed=tokens + key_dim, dtype=dtype)
    k, v, g, beta = (t.to(DEVICE) for t in (k, v, g, beta))
    bounds = torch.tensor(cu, dtype=torch.int32, device=DEVICE)
    pieces = len(cu) - 1
    m = torch.full((pieces, heads, key_dim, key_dim), float("nan"), device=DEVICE)
    u = torch.full((pieces, heads, key_dim, value_dim), float("nan"), device=DEVICE)
    K.delta_rule_chunk_state(k, v, g, beta, bounds, m=m, u=u)
    want_m, want_u = chunk_maps(k.cpu(), v.cpu(), g.cpu(), beta.cpu(), cu)  # of the rounded inputs
    torch.testing.assert_close(m.cpu().double(), want_m, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(u.cpu().double(), want_u, rtol=2e-5, atol=2e-5)


def test_strided_rows_and_the_ops_triton_path():
    k, v, g, beta, _ = random_inputs(13, 2, 8, 6, seed=4, dtype=torch.float32)
    wide_k = torch.zeros(13, 3, 8)
    wide_k[:, ::2][:, :2] = k  # token and head strides of a wider buffer
    k_view = wide_k[:, ::2][:, :2]
    cu = [0, 6, 13]
    bounds = torch.tensor(cu, dtype=torch.int64, device=DEVICE)
    args = [t.to(DEVICE) for t in (k_view, v, g, beta)]
    m, u = P.delta_rule_chunk_state(*args, bounds, 7, backend="triton")
    want_m, want_u = chunk_maps(k, v, g, beta, cu)
    torch.testing.assert_close(m.cpu().double(), want_m, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(u.cpu().double(), want_u, rtol=2e-5, atol=2e-5)


BWD_CASES = [
    *CASES,
    (40, 1, 4, 4, [0, 1, 40]),  # 39 tokens: segments of 7, the last one short
    (50, 2, 6, 5, [0, 25, 25, 50]),  # 25 tokens: segments of exactly 5
]


def _reference_grads(k, v, g, beta, cu, dm, du):
    """Gradients of float64 ``(M, U)`` (the token-by-token reference) at the rounded inputs."""
    leaves = [t.cpu().double().requires_grad_() for t in (k, v, g, beta)]
    m, u = chunk_maps(*leaves, cu)
    if k.shape[0] == 0:
        return [torch.zeros_like(t) for t in leaves]
    got = torch.autograd.grad((m, u), leaves, (dm.cpu().double(), du.cpu().double()), allow_unused=True)
    return [torch.zeros_like(t) if d is None else d for t, d in zip(leaves, got, strict=True)]


@pytest.mark.parametrize("tokens,heads,key_dim,value_dim,cu", BWD_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_backward_kernel_against_autograd_through_the_reference(tokens, heads, key_dim, value_dim, cu, dtype):
    k, v, g, beta, _ = random_inputs(
        tokens, heads, key_dim, value_dim, seed=3 * tokens + value_dim, dtype=dtype
    )
    k, v, g, beta = (t.to(DEVICE) for t in (k, v, g, beta))
    bounds = torch.tensor(cu, dtype=torch.int64, device=DEVICE)
    pieces = len(cu) - 1
    gen = torch.Generator().manual_seed(tokens)
    dm = torch.randn(pieces, heads, key_dim, key_dim, generator=gen).to(DEVICE)
    du = torch.randn(pieces, heads, key_dim, value_dim, generator=gen).to(DEVICE)
    longest = max((b - a for a, b in zip(cu, cu[1:])), default=0)
    dv = torch.full((tokens, heads, value_dim), float("nan"), device=DEVICE)
    got = K.delta_rule_chunk_state_bwd(k, v, g, beta, bounds, longest, dm, du, dv=dv)
    want = _reference_grads(k, v, g, beta, cu, dm, du)
    assert got[1] is dv
    for name, have, ref in zip(("dk", "dv", "dg", "dbeta"), got, want, strict=True):
        assert have.dtype == torch.float32 and have.shape == ref.shape, name
        torch.testing.assert_close(have.cpu().double(), ref, rtol=5e-5, atol=5e-5, msg=name)


def test_the_ops_backward_on_the_kernel_path_equals_the_references():
    """``backend="triton"`` and ``"reference"``: the same gradients, with both outputs' gradients
    and with one alone (the other ``None`` in the backward), for float32 and bfloat16 leaves."""
    cu = [0, 7, 7, 30]
    bounds = torch.tensor(cu, dtype=torch.int32, device=DEVICE)
    for dtype in (torch.float32, torch.bfloat16):
        base = [t.to(DEVICE) for t in random_inputs(30, 2, 8, 6, seed=11, dtype=dtype)[:4]]
        weights = [
            torch.randn(3, 2, 8, n, generator=torch.Generator().manual_seed(n)).to(DEVICE) for n in (8, 6)
        ]
        for use in ((0, 1), (0,), (1,)):
            grads = {}
            for backend in ("triton", "reference"):
                leaves = [t.clone().requires_grad_() for t in base]
                outs = P.delta_rule_chunk_state(*leaves, bounds, 23, backend=backend)
                loss = sum((outs[i] * weights[i]).sum() for i in use)
                grads[backend] = torch.autograd.grad(loss, leaves)
            for have, ref, leaf in zip(grads["triton"], grads["reference"], base, strict=True):
                assert have.dtype == leaf.dtype
                tol = 2e-5 if dtype == torch.float32 else 2e-2
                torch.testing.assert_close(have.float(), ref.float(), rtol=tol, atol=tol)


def test_segments_are_the_fewest_states():
    """``S`` checkpoint segments of the backward: ``chunk / S + S`` states at its least (``S`` the
    ceiling of the square root), one segment for a chunk of one token."""
    assert K.segment_length(0) == 1 and K.segment_length(1) == 1
    for n in range(1, 3000):
        s = K.segment_length(n)
        assert (s - 1) ** 2 < n <= s * s, n


@pytest.mark.gpu
def test_compiled_kernels_at_qwen3_5s_head_dims_against_float64():
    """On a GPU, the compiled forward and backward at key and value dims of 128 (16 heads, 700 tokens
    in chunks of 1, 0, 211 and 488: several checkpoint segments), bfloat16 inputs, against the
    torch reference in float64 on the same inputs (forward maps and every gradient)."""
    cu = [0, 1, 1, 212, 700]
    bounds = torch.tensor(cu, dtype=torch.int32, device="cuda")
    base = [t.cuda() for t in random_inputs(700, 16, 128, 128, seed=5, dtype=torch.bfloat16)[:4]]
    weights = [torch.randn(4, 16, 128, 128, device="cuda") for _ in range(2)]
    outs, grads = {}, {}
    for name, cast in (("kernel", lambda t: t), ("float64", lambda t: t.double())):
        leaves = [cast(t).requires_grad_() for t in base]
        m, u = P.delta_rule_chunk_state(
            *leaves, bounds, 488, backend="triton" if name == "kernel" else "reference"
        )
        outs[name] = (m, u)
        grads[name] = torch.autograd.grad((m * weights[0]).sum() + (u * weights[1]).sum(), leaves)
    for have, want in zip(outs["kernel"], outs["float64"], strict=True):
        torch.testing.assert_close(have.double(), want.detach(), rtol=1e-4, atol=1e-4)
    for have, want in zip(grads["kernel"], grads["float64"], strict=True):
        # the kernel's gradients are float32 rounded to the leaves' bfloat16
        scale = want.abs().max().clamp_min(1.0)
        assert (have.double() - want).abs().max() <= 1e-2 * scale


def test_opcheck_on_the_kernel_path():
    """The op with the kernel forward and the fused backward: schema, fake kernel and autograd
    registration as torch checks them."""
    k, v, g, beta, _ = random_inputs(9, 2, 5, 3, seed=2, dtype=torch.float32)
    sample = [t.to(DEVICE).requires_grad_() for t in (k, v, g, beta)]
    cu = torch.tensor([0, 4, 4, 9], dtype=torch.int64, device=DEVICE)
    torch.library.opcheck(torch.ops.mmbalance.delta_rule_chunk_state.default, (*sample, cu, 5, "triton"))


def test_a_chunk_longer_than_max_seqlen_gets_nan_gradients_and_the_others_stay_right():
    """The buffers are sized for ``max_seqlen`` (a host int the op checks only where it checks
    values): a longer chunk must not write outside them, and its gradients say so (NaN), while the
    chunks that fit are exact."""
    k, v, g, beta, _ = random_inputs(12, 2, 5, 4, seed=8, dtype=torch.float32)
    k, v, g, beta = (t.to(DEVICE) for t in (k, v, g, beta))
    cu = [0, 3, 12]
    bounds = torch.tensor(cu, dtype=torch.int32, device=DEVICE)
    dm = torch.randn(2, 2, 5, 5, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    du = torch.randn(2, 2, 5, 4, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    got = K.delta_rule_chunk_state_bwd(k, v, g, beta, bounds, 4, dm, du)  # room for 4 tokens, not 9
    want = _reference_grads(k, v, g, beta, cu, dm, du)
    for have, ref in zip(got, want, strict=True):
        torch.testing.assert_close(have[:3].cpu().double(), ref[:3], rtol=5e-5, atol=5e-5)
        assert bool(have[3:].isnan().all())
