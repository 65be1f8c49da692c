"""``torch.ops.mmbalance.attention_block_fwd``/``_bwd`` and ``merge_attention_states`` on CPU.

Without ``TRITON_INTERPRET`` CPU tensors take the torch reference path (``pyops/attention_ref.py``),
checked here against the independent float64 attention of ``attention_expected.py``; gradients by
``gradcheck`` in float64, registrations by ``opcheck``; every bad input raises naming its argument.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.library import opcheck

import mmbalance.pyops  # noqa: F401 - registers the ops
from mmbalance.kernels import _launch
from mmbalance.kernels.dispatch import select_backend
from mmbalance.pyops import attention_ops as ops
from mmbalance.pyops.attention_backends import (
    ATTENTION_BACKENDS,
    BACKENDS,
    AttentionInputs,
    flash_attn_unsupported_reasons,
    select_attention_backend,
)
from tests.pyops.attention_expected import attention_f64, merge_f64, varlen_batch
from tests.tolerances import tol

LQ, LK = [7, 0, 5, 3, 6], [6, 2, 0, 9, 6]
RUNS = {"q_runs": [[0, 3, 10], [0, 0, 0], [4, 5, 9], [1, 1, 7], [0, 2, 4]],
        "k_runs": [[0, 4, 9], [0, 1, 5], [0, 0, 0], [0, 5, 6], [1, 3, 8]]}  # fmt: skip
MASKS = {
    "none": dict(causal=False),
    "causal": dict(causal=True),
    "offset+2": dict(causal=True, causal_offset=2),
    "offset-3": dict(causal=True, causal_offset=-3),
    "runs": dict(causal=True, q_runs=RUNS["q_runs"], k_runs=RUNS["k_runs"]),
}
reference_only = pytest.mark.skipif(
    _launch.INTERPRET, reason="CPU tensors run the kernels under TRITON_INTERPRET"
)


def _kw(mask: str) -> dict:
    kw = dict(MASKS[mask])
    for name in ("q_runs", "k_runs"):
        if name in kw:
            kw[name] = torch.tensor(kw[name], dtype=torch.int32)
    return kw


def _expected(q, k, v, cu_q, cu_k, scale, kw):
    runs = {n: (kw[n].tolist() if n in kw else None) for n in ("q_runs", "k_runs")}
    return attention_f64(q, k, v, cu_q, cu_k, scale, kw["causal"], kw.get("causal_offset", 0), **runs)


@reference_only
@pytest.mark.parametrize("mask", list(MASKS), ids=list(MASKS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
def test_forward_matches_float64(dtype, mask):
    q, k, v, cu_q, cu_k = varlen_batch(LQ, LK, 4, 2, 8, dtype, seed=0)
    kw = _kw(mask)
    out, lse = ops.attention_block(q, k, v, cu_q, cu_k, max(LQ), max(LK), softmax_scale=0.4, **kw)
    ref_out, ref_lse = _expected(q, k, v, cu_q, cu_k, 0.4, kw)
    assert out.dtype == dtype and lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    torch.testing.assert_close(out.double(), ref_out, **tol(dtype, max(LK)))
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
    finite = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse.double()[finite], ref_lse[finite], **tol(dtype, max(LK)))


@reference_only
def test_float32_output_for_low_precision_inputs():
    q, k, v, cu_q, cu_k = varlen_batch(LQ, LK, 2, 2, 8, torch.float16, seed=1)
    out, lse = ops.attention_block(
        q, k, v, cu_q, cu_k, max(LQ), max(LK), causal=True, out_dtype=torch.float32
    )
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    ref_out, _ = attention_f64(q, k, v, cu_q, cu_k, 8**-0.5, True)
    torch.testing.assert_close(out.double(), ref_out, **tol(torch.float32, max(LK)))


# every query row sees at least one key, so the LSE is finite and numerically differentiable
GRAD_LQ, GRAD_LK = [4, 3, 5], [5, 2, 6]
GRAD_MASKS = {"none": dict(causal=False), "causal": dict(causal=True), "offset+1": dict(causal=True, causal_offset=1),
              "runs": dict(causal=True, q_runs=[[2, 2, 6], [1, 3, 9], [0, 5, 9]], k_runs=[[0, 3, 5], [0, 1, 4], [0, 6, 6]])}  # fmt: skip


@reference_only
@pytest.mark.parametrize("mask", list(GRAD_MASKS), ids=list(GRAD_MASKS))
def test_gradcheck_out_and_lse(mask):
    q, k, v, cu_q, cu_k = varlen_batch(GRAD_LQ, GRAD_LK, 4, 2, 3, torch.float64, seed=2)
    kw = dict(GRAD_MASKS[mask])
    for name in ("q_runs", "k_runs"):
        if name in kw:
            kw[name] = torch.tensor(kw[name], dtype=torch.int32)
    inputs = tuple(t.requires_grad_() for t in (q, k, v))

    def fn(q, k, v):
        return ops.attention_block(q, k, v, cu_q, cu_k, 5, 6, softmax_scale=0.7, **kw)

    assert torch.autograd.gradcheck(fn, inputs)


@reference_only
def test_backward_op_matches_autograd_of_float64():
    q, k, v, cu_q, cu_k = varlen_batch(LQ, LK, 4, 2, 8, torch.float32, seed=3)
    kw = _kw("runs")
    out, lse = ops.attention_block(q, k, v, cu_q, cu_k, max(LQ), max(LK), softmax_scale=0.4, **kw)
    g = torch.Generator().manual_seed(4)
    dout = torch.randn(q.shape, generator=g)
    dq, dk, dv = ops.attention_block_backward(dout, q, k, v, out, lse, cu_q, cu_k, max(LQ), max(LK),
                                              softmax_scale=0.4, **kw)  # fmt: skip
    leaves = tuple(t.double().requires_grad_() for t in (q, k, v))
    ref_out, _ = _expected(*leaves, cu_q, cu_k, 0.4, kw)
    expected = torch.autograd.grad((ref_out * dout.double()).sum(), leaves)
    for got, want in zip((dq, dk, dv), expected):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got.double(), want, **tol(torch.float32, max(LQ) + max(LK)))


def _fwd_args(requires_grad: bool, runs: bool):
    q, k, v, cu_q, cu_k = varlen_batch(LQ, LK, 4, 2, 8, torch.float32, seed=5)
    kw = _kw("runs" if runs else "offset+2")
    return (q.requires_grad_(requires_grad), k.requires_grad_(requires_grad), v, cu_q, cu_k, max(LQ), max(LK), 0.3,
            True, kw.get("causal_offset", 0), kw.get("q_runs"), kw.get("k_runs"), None, "auto")  # fmt: skip


@pytest.mark.parametrize("runs", [False, True], ids=["offset", "runs"])
def test_opcheck_forward(runs):
    opcheck(torch.ops.mmbalance.attention_block_fwd, _fwd_args(True, runs))


def test_opcheck_backward():
    args = _fwd_args(False, True)
    out, lse = torch.ops.mmbalance.attention_block_fwd(*args)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(6))
    dlse = torch.randn(lse.shape, generator=torch.Generator().manual_seed(7))
    q, k, v, cu_q, cu_k, mq, mk, scale, causal, offset, q_runs, k_runs, _, backend = args
    opcheck(torch.ops.mmbalance.attention_block_bwd,
            (dout, q, k, v, out, lse, cu_q, cu_k, mq, mk, scale, causal, offset, q_runs, k_runs, dlse, backend))  # fmt: skip


def test_opcheck_backward_with_a_float64_lse():
    """A float64 LSE with float32 q: the gradients are float32, as the fake implementation says."""
    args = _fwd_args(False, True)
    out, lse = torch.ops.mmbalance.attention_block_fwd(*args)
    q, k, v, cu_q, cu_k, mq, mk, scale, causal, offset, q_runs, k_runs, _, backend = args
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(9))
    call = (dout, q, k, v, out, lse.double(), cu_q, cu_k, mq, mk, scale, causal, offset, q_runs, k_runs, None,
            backend)  # fmt: skip
    grads = torch.ops.mmbalance.attention_block_bwd(*call)
    assert [g.dtype for g in grads] == [torch.float32] * 3
    opcheck(torch.ops.mmbalance.attention_block_bwd, call)


def _merge_inputs(dtype_b=torch.float32, with_empty=True):
    g = torch.Generator().manual_seed(8)
    t, h, d = 9, 3, 5
    out_a, out_b = torch.randn(t, h, d, generator=g), torch.randn(t, h, d, generator=g).to(dtype_b)
    lse_a, lse_b = torch.randn(h, t, generator=g), torch.randn(h, t, generator=g)
    if with_empty:
        lse_a[0, :3] = -math.inf
        lse_b[1, 2:5] = -math.inf
        lse_a[2, 6:] = lse_b[2, 6:] = -math.inf
        out_a[2, 6:] = out_b[2, 6:] = 0.0
    return out_a, lse_a, out_b, lse_b


@reference_only
@pytest.mark.parametrize("dtype_b", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_merge_matches_float64(dtype_b):
    out_a, lse_a, out_b, lse_b = _merge_inputs(dtype_b)
    out, lse = ops.merge_attention_states(out_a, lse_a, out_b, lse_b)
    ref_out, ref_lse = merge_f64(out_a, lse_a, out_b, lse_b)
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref_out, **tol(torch.float32, 2))
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
    finite = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse.double()[finite], ref_lse[finite], **tol(torch.float32, 2))


@reference_only
def test_merge_gradcheck():
    inputs = tuple(t.double().requires_grad_() for t in _merge_inputs(with_empty=False))
    assert torch.autograd.gradcheck(lambda *x: ops.merge_attention_states(*x), inputs)


def test_opcheck_merge():
    out_a, lse_a, out_b, lse_b = _merge_inputs()
    opcheck(torch.ops.mmbalance.merge_attention_states, (out_a.requires_grad_(), lse_a, out_b, lse_b, "auto"))


@reference_only
def test_empty_batches():
    q, k, v, cu_q, cu_k = varlen_batch([], [], 2, 1, 4, torch.float32, seed=0)
    out, lse = ops.attention_block(q, k, v, cu_q, cu_k, 0, 0, causal=True)
    assert out.shape == (0, 2, 4) and lse.shape == (2, 0)
    q, k, v, cu_q, cu_k = varlen_batch([3, 0], [0, 0], 2, 1, 4, torch.float32, seed=0)
    out, lse = ops.attention_block(q, k, v, cu_q, cu_k, 3, 0)
    assert torch.equal(out, torch.zeros_like(out)) and bool(torch.isneginf(lse).all())


def _inputs(**features) -> AttentionInputs:
    """A call described without tensors (a CUDA call needs no GPU to be described)."""
    base = dict(q_shape=(6, 4, 8), k_shape=(5, 2, 8), dtype=torch.float32, device=torch.device("cpu"))
    return AttentionInputs(**{**base, **features})


def _refusal(message: str) -> tuple[list[str], dict[str, list[str]]]:
    """The headline and inputs lines of a refusal, and each backend's reasons."""
    lines = message.splitlines()
    head, why, current = lines[:2], {}, None
    for line in lines[2:]:
        if line.startswith("`"):
            current = line.split("`")[1]
            assert line == f"`{current}` cannot run it because:", line
            why[current] = []
        else:
            assert line.startswith("    ") and current is not None, line
            why[current].append(line.strip())
    return head, why


@reference_only
def test_backend_selection(monkeypatch):
    cpu = _inputs(causal=True)
    assert select_attention_backend("auto", cpu) == "reference"
    with pytest.raises(ValueError, match="flash_attn"):
        select_attention_backend("flash_attn", _inputs())
    with pytest.raises(ValueError, match="triton"):
        select_attention_backend("triton", _inputs())
    monkeypatch.setenv("MMBALANCE_ATTN_BACKEND", "reference")
    assert select_attention_backend("auto", _inputs()) == "reference"
    monkeypatch.setenv("MMBALANCE_ATTN_BACKEND", "bogus")
    with pytest.raises(ValueError, match="MMBALANCE_ATTN_BACKEND"):
        select_attention_backend("auto", _inputs())
    assert set(BACKENDS) == {"auto", "flash_attn", "torch_flash", "triton", "reference"}


def test_the_inputs_of_a_call_are_read_from_its_arguments():
    q, k, v, cu_q, cu_k = varlen_batch([3, 4], [2, 5], 4, 2, 8, torch.float32, seed=0)
    runs = torch.zeros(2, 3, dtype=torch.int32)
    inputs = AttentionInputs.of(q, k, cu_q, cu_k, causal=True, causal_offset=2, q_runs=runs, window_left=3,
                                window_right=-1, softcap=0.5, sinks=torch.zeros(4), backward=True,
                                dlse=torch.zeros(4, 7))  # fmt: skip
    assert inputs == AttentionInputs(q_shape=(7, 4, 8), k_shape=(7, 2, 8), dtype=torch.float32,
                                     device=torch.device("cpu"), causal=True, causal_offset=2, has_runs=True,
                                     same_cu_seqlens=False, window_left=3, softcap=0.5, has_sinks=True,
                                     backward=True, has_dlse=True)  # fmt: skip
    same = AttentionInputs.of(q, q, cu_q, cu_q, causal=False, causal_offset=0, q_runs=None, window_left=-1,
                              window_right=-1, softcap=0.0)  # fmt: skip
    assert same.same_cu_seqlens and not same.windowed and not same.backward and same.head_dim == 8
    # meta tensors are not CUDA tensors: flash-attn's reasons stop at the device
    meta = torch.empty(3, 2, 8, device="meta")
    on_meta = AttentionInputs.of(meta, meta, cu_q, cu_q, causal=False, causal_offset=0, q_runs=None,
                                 window_left=-1, window_right=-1, softcap=0.0)  # fmt: skip
    assert flash_attn_unsupported_reasons(on_meta) == ["flash-attn needs CUDA tensors"]
    assert flash_attn_unsupported_reasons(_inputs(causal=True, causal_offset=2)) == [
        "flash-attn needs CUDA tensors"
    ]


def test_a_forced_backend_that_cannot_run_names_the_call_and_its_reasons():
    inputs = _inputs(dtype=torch.float64, causal=True, window_left=3, has_sinks=True)
    with pytest.raises(ValueError) as err:
        select_attention_backend("triton", inputs)
    head, why = _refusal(str(err.value))
    assert head == ["attention_block: backend='triton' cannot run this call with inputs:", f"    {inputs}"]
    assert head[1].strip() == (
        "forward: q [6, 4, 8], k/v [5, 2, 8], torch.float64 on cpu, causal, window (3, -1), sinks"
    )
    cuda = [] if _launch.INTERPRET else [
        "the Triton kernels need CUDA tensors (or TRITON_INTERPRET=1, set before import), got cpu"
    ]  # fmt: skip
    # only the forced backend is asked
    assert why == {"triton": [*cuda, "the Triton kernels take float16, bfloat16 and float32, not float64"]}


def test_when_no_backend_can_run_every_backend_says_why():
    inputs = _inputs(q_shape=(6, 4, 12), k_shape=(5, 2, 12), dtype=torch.float64, device=torch.device("cuda"),
                     causal=True, causal_offset=2, has_sinks=True, backward=True, has_dlse=True)  # fmt: skip
    with pytest.raises(ValueError) as err:
        two = [b for b in ATTENTION_BACKENDS if b.name in ("flash_attn", "triton")]
        select_backend("attention_block", two, "auto", inputs)
    head, why = _refusal(str(err.value))
    assert head[0] == "attention_block: no backend can run this call with inputs:"
    assert head[1].strip().startswith("backward: q [6, 4, 12], k/v [5, 2, 12], torch.float64 on cuda")
    assert "causal (offset 2)" in head[1] and "a gradient of the LSE" in head[1]
    assert list(why) == ["flash_attn", "triton"]
    flash = why["flash_attn"]
    for reason in (
        "flash-attn supports float16/bfloat16, not torch.float64",
        "flash-attn needs a head dim <= 256 and a multiple of 8, got 12",
        "flash-attn has no position runs / causal offset (needs identical cu_seqlens)",
        "flash-attn 2 has no attention sinks",
        "flash-attn's backward takes no gradient of the LSE",
    ):
        assert reason in flash, (reason, flash)
    assert why["triton"] == ["the Triton kernels take float16, bfloat16 and float32, not float64"]


def test_the_ops_refuse_a_forced_backend_with_the_call_and_the_reasons():
    q, k, v, cu_q, cu_k = varlen_batch([3, 4], [2, 5], 4, 2, 8, torch.float64, seed=0)
    with pytest.raises(ValueError) as err:
        ops.attention_block(q, k, v, cu_q, cu_k, 4, 5, causal=True, backend="flash_attn")
    head, why = _refusal(str(err.value))
    assert head[0] == "attention_block: backend='flash_attn' cannot run this call with inputs:"
    assert (
        head[1].strip() == "forward: q [7, 4, 8], k/v [7, 2, 8], torch.float64 on cpu, causal, separate "
        "cu_seqlens_q/cu_seqlens_k"
    )
    assert why == {"flash_attn": ["flash-attn needs CUDA tensors"]}
    out, lse = ops.attention_block(q, k, v, cu_q, cu_k, 4, 5, backend="reference")
    with pytest.raises(ValueError) as err:
        ops.merge_attention_states(out, lse, out, lse, backend="triton")
    head, why = _refusal(str(err.value))
    assert head == [
        "merge_attention_states: backend='triton' cannot run this call with inputs:",
        "    out [7, 4, 8], dtypes (out_a, lse_a, out_b, lse_b) torch.float64, torch.float64, torch.float64, "
        "torch.float64 on cpu",
    ]
    assert why["triton"][-1] == "the Triton kernels take float16, bfloat16 and float32, not float64"


def _bad_inputs():
    q, k, v, cu_q, cu_k = varlen_batch([3, 4], [2, 5], 4, 2, 8, torch.float32, seed=0)
    runs = torch.zeros(2, 3, dtype=torch.int32)
    good = dict(q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=4, max_seqlen_k=5)
    return good, [
        ("q", dict(q=q[0]), ValueError),
        ("k", dict(k=k.half()), TypeError),
        ("v", dict(v=v[:, :1]), ValueError),
        ("heads", dict(q=torch.zeros(7, 3, 8)), ValueError),
        ("q", dict(q=q.transpose(1, 2).contiguous().transpose(1, 2)), ValueError),
        ("cu_seqlens_q", dict(cu_seqlens_q=cu_q.long()), TypeError),
        ("cu_seqlens_q", dict(cu_seqlens_q=torch.tensor([1, 3, 7], dtype=torch.int32)), ValueError),
        ("cu_seqlens_k", dict(cu_seqlens_k=torch.tensor([0, 5, 2], dtype=torch.int32)), ValueError),
        ("cu_seqlens_k", dict(cu_seqlens_k=torch.tensor([0, 2, 6], dtype=torch.int32)), ValueError),
        ("cu_seqlens_k", dict(cu_seqlens_k=torch.tensor([0, 7], dtype=torch.int32)), ValueError),
        ("max_seqlen_q", dict(max_seqlen_q=3), ValueError),
        ("max_seqlen_k", dict(max_seqlen_k=5.0), TypeError),
        ("softmax_scale", dict(softmax_scale=math.nan), ValueError),
        ("q_runs and k_runs", dict(q_runs=runs), ValueError),
        ("q_runs", dict(q_runs=runs[:1], k_runs=runs), ValueError),
        (
            "k_runs",
            dict(q_runs=runs, k_runs=torch.tensor([[0, 1, 0], [0, 0, 0]], dtype=torch.int32)),
            ValueError,
        ),
        ("backend", dict(backend="cuda"), ValueError),
        ("head dim", dict(q=q[..., :0], k=k[..., :0], v=v[..., :0]), ValueError),
    ]


@reference_only
@pytest.mark.parametrize(
    "case", range(len(_bad_inputs()[1])), ids=[f"{c[0]}-{i}" for i, c in enumerate(_bad_inputs()[1])]
)
def test_bad_forward_input_raises_naming_it(case):
    good, cases = _bad_inputs()
    name, change, error = cases[case]
    kw = dict(good, causal=True, **change)
    with pytest.raises(error, match=name.split("-")[0]):
        ops.attention_block(**kw)


@reference_only
def test_bad_backward_and_merge_inputs_raise_naming_them():
    q, k, v, cu_q, cu_k = varlen_batch([3], [3], 2, 2, 4, torch.float32, seed=0)
    out, lse = ops.attention_block(q, k, v, cu_q, cu_k, 3, 3)
    with pytest.raises(TypeError, match="dout"):
        ops.attention_block_backward(q.double(), q, k, v, out, lse, cu_q, cu_k, 3, 3)
    with pytest.raises(ValueError, match="lse"):
        ops.attention_block_backward(q, q, k, v, out, lse.t(), cu_q, cu_k, 3, 3)
    with pytest.raises(ValueError, match="out_b"):
        ops.merge_attention_states(out, lse, out[:2], lse)
    with pytest.raises(TypeError, match="lse_b"):
        ops.merge_attention_states(out, lse, out, lse.half())


def test_one_boundary_tensor_stays_one_through_saved_tensor_hooks(monkeypatch):
    """A hook that copies every saved tensor (offloading does) must not turn the queries' and keys'
    one boundary tensor into two in the backward (the FlashAttention kernels need one)."""
    seen: list[bool] = []
    real = ops.select_attention_backend

    def spy(backend, inputs):
        seen.append(inputs.same_cu_seqlens)
        return real(backend, inputs)

    monkeypatch.setattr(ops, "select_attention_backend", spy)
    q, k, v, cu, _ = varlen_batch([5, 3], [5, 3], 4, 2, 8, torch.float64, seed=1)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t.clone(), lambda t: t):
        out, _ = ops.attention_block(*leaves, cu, cu, 5, 5, causal=True)
    out.sum().backward()
    assert seen == [True, True], seen
