"""``mmbalance::delta_rule_chunk_state`` and ``compose_chunk_states`` (``pyops/delta_rule.py``): the
chunk maps against a float64 reference written token by token (``delta_rule_expected.py``) on fresh
random inputs with odd sizes, empty chunks, no chunks and no value columns; a sequence cut into
chunks whose starting states come from the composed maps runs exactly as the sequence whole, in its
outputs, its last state and every gradient (the state hand-off of a context-parallel group of any
degree); ``opcheck``, gradcheck and the refusals of bad input."""

from __future__ import annotations

import pytest
import torch

import mmbalance.pyops as P
from mmbalance.kernels.dispatch import INTERPRET
from mmbalance.pyops.delta_rule import delta_rule_chunk_state_ref
from tests.pyops.delta_rule_expected import chunk_maps, random_inputs, run

CASES = [
    # tokens, heads, key dim, value dim, chunk boundaries
    (11, 3, 5, 7, [0, 4, 4, 11]),
    (17, 2, 16, 9, [0, 1, 8, 17]),
    (0, 2, 4, 4, [0, 0, 0]),
    (5, 1, 3, 0, [0, 2, 5]),
    (0, 1, 2, 2, [0]),
    (9, 4, 1, 1, [0, 9]),
]


def _longest(cu) -> int:
    return max((b - a for a, b in zip(cu, cu[1:])), default=0)


@pytest.mark.parametrize("tokens,heads,key_dim,value_dim,cu", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_chunk_maps_against_the_token_by_token_reference(tokens, heads, key_dim, value_dim, cu, dtype):
    k, v, g, beta, _ = random_inputs(tokens, heads, key_dim, value_dim, seed=tokens + 7 * heads, dtype=dtype)
    bounds = torch.tensor(cu, dtype=torch.int32)
    m, u = P.delta_rule_chunk_state(k, v, g, beta, bounds, _longest(cu))
    want_m, want_u = chunk_maps(k, v, g, beta, cu)
    assert m.dtype == u.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert m.shape == (len(cu) - 1, heads, key_dim, key_dim) and u.shape == (
        len(cu) - 1,
        heads,
        key_dim,
        value_dim,
    )
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(m.double(), want_m, rtol=tol, atol=tol)
    torch.testing.assert_close(u.double(), want_u, rtol=tol, atol=tol)


@pytest.mark.parametrize("cuts", [[0, 23], [0, 5, 23], [0, 3, 3, 9, 16, 23], [0, 1, 2, 3, 4, 23]])
def test_chunks_run_from_their_composed_states_equal_the_sequence_whole(cuts):
    """The hand-off of a CP group: every chunk's map from its own tokens, the states composed, each
    chunk run from its state: outputs, last state and the gradients of q, k, v, g and beta."""
    k, v, g, beta, q = random_inputs(23, 2, 6, 5, seed=3)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, g, beta)]
    q1, k1, v1, g1, b1 = leaves
    init = torch.randn(2, 6, 5, dtype=torch.float64)
    whole, last = run(q1, k1, v1, g1, b1, init)
    loss = (
        whole * torch.linspace(-1, 1, whole.numel(), dtype=torch.float64).view_as(whole)
    ).sum() + last.square().sum()
    want = torch.autograd.grad(loss, leaves)

    leaves2 = [t.clone().requires_grad_() for t in (q, k, v, g, beta)]
    q2, k2, v2, g2, b2 = leaves2
    bounds = torch.tensor(cuts)
    m, u = P.delta_rule_chunk_state(k2, v2, g2, b2, bounds, _longest(cuts))
    starts, end = P.compose_chunk_states(m, u, init)
    outs = []
    for c in range(len(cuts) - 1):
        piece = slice(cuts[c], cuts[c + 1])
        out, _ = run(q2[piece], k2[piece], v2[piece], g2[piece], b2[piece], starts[c])
        outs.append(out)
    chunked = torch.cat(outs)
    torch.testing.assert_close(chunked, whole.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(end, last.detach(), rtol=1e-12, atol=1e-12)
    loss2 = (chunked * torch.linspace(-1, 1, chunked.numel(), dtype=torch.float64).view_as(chunked)).sum()
    got = torch.autograd.grad(loss2 + end.square().sum(), leaves2)
    for name, a, b in zip("q k v g beta".split(), got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=name)


def test_gradcheck_and_opcheck():
    k, v, g, beta, _ = random_inputs(7, 2, 3, 2, seed=1)
    cu = torch.tensor([0, 3, 3, 7], dtype=torch.int64)
    args = [t.clone().requires_grad_() for t in (k, v, g, beta)]
    assert torch.autograd.gradcheck(lambda *a: P.delta_rule_chunk_state(*a, cu, 4), args)
    # float32 (the path models take); float64 inputs run the same reference (gradcheck above)
    sample = [t.detach().float().requires_grad_() for t in (k, v, g, beta)]
    torch.library.opcheck(torch.ops.mmbalance.delta_rule_chunk_state.default, (*sample, cu, 4, "auto"))


def test_the_reference_does_not_read_what_it_should_not():
    """Tokens outside every chunk's span are never read (poisoned), and the outputs are fresh."""
    k, v, g, beta, _ = random_inputs(10, 2, 4, 3, seed=5)
    m, u = delta_rule_chunk_state_ref(k, v, g, beta, torch.tensor([0, 4, 10]), 6)
    for t in (k, v, g, beta):
        t[10:] = float("nan")
    m2, u2 = P.delta_rule_chunk_state(k, v, g, beta, torch.tensor([0, 4, 10]), 6)
    assert torch.equal(m, m2) and torch.equal(u, u2) and not m2.isnan().any()


def test_bad_input_is_refused_by_name():
    k, v, g, beta, _ = random_inputs(6, 2, 3, 2, seed=0)
    cu = torch.tensor([0, 6])
    with pytest.raises(ValueError, match="max_seqlen is 2 but a chunk"):
        P.delta_rule_chunk_state(k, v, g, beta, cu, 2)
    with pytest.raises(ValueError, match="cu_seqlens must start at 0"):
        P.delta_rule_chunk_state(k, v, g, beta, torch.tensor([0, 5]), 6)
    with pytest.raises(ValueError, match=r"v must have shape \[T, H, V\]"):
        P.delta_rule_chunk_state(k, v[:, :1], g, beta, cu, 6)
    with pytest.raises(ValueError, match=r"beta must have shape \[T, H\]"):
        P.delta_rule_chunk_state(k, v, g, beta[:, :1], cu, 6)
    with pytest.raises(TypeError, match="cu_seqlens must be a 1-D int32 or int64"):
        P.delta_rule_chunk_state(k, v, g, beta, cu.float(), 6)
    with pytest.raises(ValueError, match="backend must be one of"):
        P.delta_rule_chunk_state(k, v, g, beta, cu, 6, backend="cuda")
    if not (INTERPRET or torch.cuda.is_available()):  # the kernel runs nowhere here
        with pytest.raises(ValueError, match="backend='triton' cannot run"):
            P.delta_rule_chunk_state(k, v, g, beta, cu, 6, backend="triton")
    with pytest.raises(ValueError, match=r"initial must have shape"):
        m, u = P.delta_rule_chunk_state(k, v, g, beta, cu, 6)
        P.compose_chunk_states(m, u, torch.zeros(2, 3, 3))


def test_maps_and_their_composition_stay_in_float32_under_autocast():
    """Trainer's ``bf16=True`` runs the forward under autocast: the maps and the composed state of
    float32 inputs stay float32 there (against float64, as without autocast; before, the
    composition's products ran in bfloat16, 3.8e-3 off, and the maps' 3.9e-4)."""
    torch.manual_seed(0)
    tokens, heads, key_dim, value_dim = 40, 2, 16, 16
    k = torch.nn.functional.normalize(torch.randn(tokens, heads, key_dim), dim=-1)
    v, g, beta = torch.randn(tokens, heads, value_dim), -torch.rand(tokens, heads), torch.rand(tokens, heads)
    cu = torch.tensor([0, 13, 13, 40])
    want_m, want_u = P.delta_rule_chunk_state(k.double(), v.double(), g.double(), beta.double(), cu, 27)
    want = P.compose_chunk_states(want_m, want_u)[1]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        m, u = P.delta_rule_chunk_state(k, v, g, beta, cu, 27)
        state = P.compose_chunk_states(m, u)[1]
    assert m.dtype == u.dtype == state.dtype == torch.float32
    for got, ref in ((m, want_m), (u, want_u), (state, want)):
        err = float((got.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30))
        assert err < 1e-5, err


def test_the_fused_backward_refuses_bad_input_by_name():
    """``mmbalance::delta_rule_chunk_state_backward``: the maps' gradients of another shape, and
    (without CUDA or the interpreter) the kernel it needs."""
    k, v, g, beta, _ = random_inputs(5, 2, 3, 4, seed=3, dtype=torch.float32)
    cu = torch.tensor([0, 2, 5], dtype=torch.int64)
    op = torch.ops.mmbalance.delta_rule_chunk_state_backward
    if not (INTERPRET or torch.cuda.is_available()):
        with pytest.raises(ValueError, match="Triton kernel runs on CUDA"):
            op(k, v, g, beta, cu, 3, torch.zeros(2, 2, 3, 3), None)
        return
    with pytest.raises(ValueError, match="du must have shape"):
        op(k, v, g, beta, cu, 3, None, torch.zeros(2, 2, 3, 3))
