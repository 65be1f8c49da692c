"""The ``torch_flash`` backend of the attention block ops: torch's own FlashAttention varlen kernels
(``aten::_flash_attention_forward/backward``), between flash-attn and Triton in ``"auto"``'s order.

On the CPU the choice and every refusal reason are checked with the CUDA capability, the build and
the ops faked where needed; the wrappers' argument mapping (int32 boundaries, the window, the LSE's
``+inf``/``-inf`` convention) with the ops replaced by a float64 reference that follows
FlashAttention's conventions, and the real ops' signatures on meta tensors. On a GPU the ``gpu``
tests run the real kernels against the float64 reference.
"""

from __future__ import annotations

import math

import pytest
import torch

import mmbalance.pyops  # noqa: F401 - registers the ops
from mmbalance.kernels.dispatch import select_backend
from mmbalance.pyops import attention_backends as B
from mmbalance.pyops import attention_ops as ops
from mmbalance.pyops.attention_backends import (
    ATTENTION_BACKENDS,
    BACKENDS,
    AttentionInputs,
    select_attention_backend,
    torch_flash_unsupported_reasons,
)
from tests.pyops.attention_dense import dense_attention

CUDA = torch.device("cuda")


def _cuda_call(**features) -> AttentionInputs:
    base = dict(q_shape=(10, 4, 64), k_shape=(10, 2, 64), dtype=torch.bfloat16, device=CUDA, causal=True)
    return AttentionInputs(**{**base, **features})


@pytest.fixture
def fake_gpu(monkeypatch):
    """An sm_90 device with torch's FlashAttention built and its ops present (no GPU needed)."""
    monkeypatch.setattr(B, "_capability", lambda device: (9, 0))
    monkeypatch.setattr(B, "_flash_built", lambda: True)
    monkeypatch.setattr(B, "_torch_flash_ops", lambda: ("fwd", "bwd"))
    monkeypatch.delenv("MMBALANCE_ATTN_BACKEND", raising=False)


def test_the_name_is_accepted_everywhere_a_backend_is():
    assert "torch_flash" in BACKENDS
    names = [b.name for b in ATTENTION_BACKENDS]
    assert names == ["flash_attn", "torch_flash", "triton", "reference"]  # auto's order


def test_cpu_tensors_are_refused_by_the_device_alone():
    call = AttentionInputs(
        q_shape=(4, 2, 8), k_shape=(4, 2, 8), dtype=torch.float16, device=torch.device("cpu")
    )
    assert torch_flash_unsupported_reasons(call) == ["torch's FlashAttention kernels need CUDA tensors"]


def test_a_plain_packed_call_runs_on_torch_flash(fake_gpu):
    for call in (
        _cuda_call(),
        _cuda_call(causal=False, same_cu_seqlens=False),  # full attention over other key boundaries
        _cuda_call(window_left=127),
        _cuda_call(dtype=torch.float16, q_shape=(10, 8, 128), k_shape=(10, 1, 128)),  # GQA, head dim 128
        _cuda_call(backward=True),
    ):
        assert torch_flash_unsupported_reasons(call) == [], call
    # flash-attn is not installed here: auto takes torch's kernels before Triton
    assert select_attention_backend("auto", _cuda_call()) == "torch_flash"
    assert select_attention_backend("torch_flash", _cuda_call()) == "torch_flash"


def test_auto_puts_triton_before_flashattention2_on_hopper_at_head_dim_128(fake_gpu, monkeypatch):
    """On sm_90 the Triton kernels outran torch's FlashAttention-2 at head dim 128 (measured on an
    H200): auto tries them first there, forward and backward; elsewhere the order stays."""
    import dataclasses

    d128 = _cuda_call(q_shape=(10, 8, 128), k_shape=(10, 2, 128))
    assert select_attention_backend("auto", d128) == "triton"
    assert select_attention_backend("auto", dataclasses.replace(d128, backward=True)) == "triton"
    assert select_attention_backend("auto", _cuda_call()) == "torch_flash"  # head dim 64
    assert select_attention_backend("torch_flash", d128) == "torch_flash"  # a forced choice holds
    monkeypatch.setenv("MMBALANCE_ATTN_BACKEND", "torch_flash")
    assert select_attention_backend("auto", d128) == "torch_flash"
    monkeypatch.delenv("MMBALANCE_ATTN_BACKEND")
    monkeypatch.setattr(B, "_capability", lambda device: (8, 0))  # Ampere: FlashAttention-2 first
    assert select_attention_backend("auto", d128) == "torch_flash"
    monkeypatch.setattr(B, "_capability", lambda device: (9, 0))
    monkeypatch.setattr(B, "torch_flash_impl", lambda: "FA3")  # Hopper's own FlashAttention
    assert select_attention_backend("auto", d128) == "torch_flash"
    assert B.auto_order(d128) == ("flash_attn", "torch_flash", "triton", "reference")


@pytest.mark.parametrize(
    ("features", "words"),
    [
        ({"dtype": torch.float32}, "float16/bfloat16, not torch.float32"),
        ({"q_shape": (10, 4, 12), "k_shape": (10, 2, 12)}, "multiple of 8, got 12"),
        ({"q_shape": (10, 4, 264), "k_shape": (10, 2, 264)}, "head dim <= 256"),
        ({"has_runs": True}, "position runs"),
        ({"causal_offset": 3}, "causal offset"),
        ({"same_cu_seqlens": False}, "identical cu_seqlens"),
        ({"causal": False, "window_left": 2, "same_cu_seqlens": False}, "identical cu_seqlens"),
        ({"softcap": 30.0}, "no softcap"),
        ({"has_sinks": True}, "no attention sinks"),
        ({"backward": True, "has_dlse": True}, "no gradient of the LSE"),
    ],
    ids=[
        "fp32",
        "head-dim-12",
        "head-dim-264",
        "runs",
        "offset",
        "cu",
        "window-cu",
        "softcap",
        "sinks",
        "dlse",
    ],
)
def test_each_refusal_names_what_it_cannot_run(fake_gpu, features, words):
    reasons = torch_flash_unsupported_reasons(_cuda_call(**features))
    assert len(reasons) == 1 and words in reasons[0], reasons
    if features.get("dtype") != torch.float32:  # (Triton takes it; on this CPU it is refused too)
        with pytest.raises(ValueError, match="backend='torch_flash' cannot run"):
            select_attention_backend("torch_flash", _cuda_call(**features))


def test_the_device_build_and_torch_version_are_checked(monkeypatch):
    monkeypatch.setattr(B, "_capability", lambda device: (7, 5))
    monkeypatch.setattr(B, "_flash_built", lambda: False)
    monkeypatch.setattr(B, "_torch_flash_ops", lambda: ("fwd", "bwd"))
    reasons = torch_flash_unsupported_reasons(_cuda_call())
    assert any("sm_80 or newer, the device is sm_75" in r for r in reasons)
    assert any("built without its FlashAttention kernels" in r for r in reasons)
    monkeypatch.setattr(B, "_torch_flash_ops", lambda: None)
    reasons = torch_flash_unsupported_reasons(_cuda_call())
    assert any("torch >= 2.11" in r and torch.__version__ in r for r in reasons)


def test_when_nothing_runs_a_call_every_backend_says_why(fake_gpu):
    call = _cuda_call(dtype=torch.float64, has_sinks=True)
    with pytest.raises(ValueError) as err:
        select_backend("attention_block", ATTENTION_BACKENDS[:3], "auto", call)
    text = str(err.value)
    for name in ("`flash_attn` cannot run it", "`torch_flash` cannot run it", "`triton` cannot run it"):
        assert name in text
    assert "torch's FlashAttention has no attention sinks" in text


def test_the_environment_variable_forces_it(fake_gpu, monkeypatch):
    monkeypatch.setenv("MMBALANCE_ATTN_BACKEND", "torch_flash")
    assert select_attention_backend("auto", _cuda_call()) == "torch_flash"
    with pytest.raises(ValueError, match="MMBALANCE_ATTN_BACKEND"):
        select_attention_backend("auto", _cuda_call(softcap=1.0))


def test_which_flash_attention_runs_is_named(monkeypatch):
    assert B.torch_flash_impl() == "FA2"  # nothing activated here
    monkeypatch.setattr(torch.nn.attention, "current_flash_attention_impl", lambda: "FA3", raising=False)
    assert B.torch_flash_impl() == "FA3"


# ----------------------------------------------------------------------- the wrappers, ops faked
class FlashLike:
    """FlashAttention's varlen ops in float64 on the CPU, with its conventions: int32 boundaries,
    ``[H, T]`` LSE with ``+inf`` for rows without keys, the window in keywords."""

    def __init__(self):
        self.calls: list[dict] = []

    def fwd(self, q, k, v, cu_q, cu_k, max_q, max_k, dropout, causal, debug, *, scale, window_size_left=-1,
            window_size_right=-1):  # fmt: skip
        assert cu_q.dtype == cu_k.dtype == torch.int32 and dropout == 0.0 and debug is False
        assert isinstance(max_q, int) and isinstance(max_k, int)
        self.calls.append(dict(causal=causal, scale=scale, left=window_size_left, right=window_size_right))
        out, lse = dense_attention(q, k, v, cu_q, cu_k, scale, causal=causal, window_left=window_size_left,
                                   window_right=window_size_right)  # fmt: skip
        lse = torch.where(lse == -math.inf, math.inf, lse).float()
        return (
            out.to(q.dtype),
            lse,
            torch.zeros(2, dtype=torch.uint64),
            torch.zeros((), dtype=torch.uint64),
            q[:0],
        )

    def bwd(self, dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, dropout, causal, rng, unused, *, scale,
            window_size_left=-1, window_size_right=-1):  # fmt: skip
        assert lse.dtype == torch.float32 and not bool((lse == -math.inf).any()), "rows without keys: +inf"
        assert rng.dtype == unused.dtype == torch.uint64 and cu_q.dtype == torch.int32
        leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
        ref, _ = dense_attention(*leaves, cu_q, cu_k, scale, causal=causal, window_left=window_size_left,
                                 window_right=window_size_right)  # fmt: skip
        return tuple(g.to(q.dtype) for g in torch.autograd.grad(ref, leaves, dout.double()))


@pytest.mark.parametrize("window", [(-1, -1), (2, -1)], ids=["causal", "window2"])
def test_the_wrappers_map_arguments_and_conventions(monkeypatch, window):
    fake = FlashLike()
    monkeypatch.setattr(B, "_torch_flash_ops", lambda: (fake.fwd, fake.bwd))
    g = torch.Generator().manual_seed(0)
    lengths = [5, 0, 9]
    cu = torch.tensor([0, 5, 5, 14], dtype=torch.int64)  # int64 in: the wrappers give int32
    q, dout = (torch.randn(14, 4, 8, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(14, 2, 8, generator=g, dtype=torch.float64) for _ in range(2))
    out, lse = B.torch_flash_fwd(q, k, v, cu, cu, max(lengths), max(lengths), 0.3, True, *window)
    # causal and windowed: the right edge is said (0); no window: no window keywords
    assert fake.calls[-1] == dict(causal=True, scale=0.3, left=window[0], right=0 if window[0] >= 0 else -1)
    ref, ref_lse = dense_attention(q, k, v, cu, cu, 0.3, causal=True, window_left=window[0])
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(lse, ref_lse.float())
    grads = B.torch_flash_bwd(dout, q, k, v, out, lse, cu, cu, 9, 9, 0.3, True, *window)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    want = torch.autograd.grad(dense_attention(*leaves, cu, cu, 0.3, causal=True, window_left=window[0])[0], leaves,
                               dout)  # fmt: skip
    for got, exp in zip(grads, want):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got.double(), exp, atol=1e-6, rtol=1e-6)


def test_rows_without_keys_carry_minus_infinity(monkeypatch):
    fake = FlashLike()
    monkeypatch.setattr(B, "_torch_flash_ops", lambda: (fake.fwd, fake.bwd))
    q = torch.randn(4, 2, 8, dtype=torch.float64)
    k = torch.randn(3, 2, 8, dtype=torch.float64)
    cu_q, cu_k = torch.tensor([0, 2, 4]), torch.tensor([0, 0, 3])  # the first sequence has no keys
    _, lse = B.torch_flash_fwd(q, k, k, cu_q, cu_k, 2, 3, 0.5, False)
    assert torch.isneginf(lse[:, :2]).all() and torch.isfinite(lse[:, 2:]).all()


def test_the_real_ops_take_these_arguments_on_meta_tensors():
    """torch's ops themselves (their meta kernels): the keywords and shapes the wrappers rely on."""
    if B._torch_flash_ops() is None:
        pytest.skip(f"torch {torch.__version__} has no windowed varlen FlashAttention ops")
    q = torch.empty(10, 4, 64, dtype=torch.bfloat16, device="meta")
    k = torch.empty(10, 2, 64, dtype=torch.bfloat16, device="meta")
    cu = torch.empty(3, dtype=torch.int32, device="meta")
    out, lse = B.torch_flash_fwd(q, k, k, cu, cu, 6, 6, 0.125, True, 3, -1)
    assert out.shape == q.shape and lse.shape == (4, 10) and lse.dtype == torch.float32
    dq, dk, dv = B.torch_flash_bwd(q, q, k, k, out, lse, cu, cu, 6, 6, 0.125, True, 3, -1)
    assert dq.shape == q.shape and dk.shape == dv.shape == k.shape and dq.dtype == torch.float32


# ---------------------------------------------------------------------------------- on a GPU
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("window", [-1, 17], ids=["causal", "window17"])
def test_torch_flash_against_the_reference_on_cuda(dtype, window):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    inputs = AttentionInputs(q_shape=(8, 8, 128), k_shape=(8, 2, 128), dtype=dtype, device=CUDA, causal=True,
                             window_left=window)  # fmt: skip
    if torch_flash_unsupported_reasons(inputs):
        pytest.skip(f"torch_flash cannot run here: {torch_flash_unsupported_reasons(inputs)}")
    g = torch.Generator().manual_seed(1)
    lengths = [0, 1, 63, 200, 129]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    t = int(cu[-1])
    q, dout = (torch.randn(t, 8, 128, generator=g).to("cuda", dtype) for _ in range(2))
    k, v = (torch.randn(t, 2, 128, generator=g).to("cuda", dtype) for _ in range(2))
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out, lse = ops.attention_block(*leaves, cu, cu, max(lengths), max(lengths), causal=True, softmax_scale=0.088,
                                   window_left=window, backend="torch_flash")  # fmt: skip
    grads = torch.autograd.grad(out, leaves, dout)
    ref_leaves = [x.double().cpu().requires_grad_() for x in (q, k, v)]
    ref, ref_lse = dense_attention(*ref_leaves, cu.cpu(), cu.cpu(), 0.088, causal=True, window_left=window)
    ref_grads = torch.autograd.grad(ref, ref_leaves, dout.double().cpu())
    # low precision: fixed bounds of a few ulps near 1 (7.8e-3 in bfloat16), gradients scaled by their largest entry
    assert (out.double().cpu() - ref).abs().max() < 2e-2
    torch.testing.assert_close(lse.cpu().double(), ref_lse, atol=1e-2, rtol=1e-3)
    for got, want in zip(grads, ref_grads):
        assert (got.double().cpu() - want).abs().max() < 5e-2 * max(1.0, float(want.abs().max()))


def test_launch_sizes_and_empty_batches(monkeypatch):
    """One query a sequence (FlashAttention-2's grouped-query reshape) and no key are never what the
    kernels are told; no query or no sequence returns without a launch."""
    assert B._launch_sizes(1, 0) == (2, 1) and B._launch_sizes(37, 9) == (37, 9)
    fake = FlashLike()
    monkeypatch.setattr(B, "_torch_flash_ops", lambda: (fake.fwd, fake.bwd))
    q = torch.zeros(0, 4, 8, dtype=torch.float64)
    out, lse = B.torch_flash_fwd(q, q[:, :2], q[:, :2], torch.tensor([0]), torch.tensor([0]), 0, 0, 0.5, True)
    assert out.shape == (0, 4, 8) and lse.shape == (4, 0) and not fake.calls
    grads = B.torch_flash_bwd(q, q, q[:, :2], q[:, :2], out, lse, torch.tensor([0]), torch.tensor([0]), 0, 0, 0.5,
                              True)  # fmt: skip
    assert [tuple(g.shape) for g in grads] == [(0, 4, 8), (0, 2, 8), (0, 2, 8)] and not fake.calls


def test_older_torch_and_large_backward_heads_are_refused(monkeypatch):
    monkeypatch.setattr(B, "_torch_version", lambda: (2, 10))
    B._torch_flash_ops.cache_clear()
    try:
        assert B._torch_flash_ops() is None
    finally:
        monkeypatch.undo()
        B._torch_flash_ops.cache_clear()
    monkeypatch.setattr(B, "_capability", lambda device: (8, 6))
    monkeypatch.setattr(B, "_flash_built", lambda: True)
    monkeypatch.setattr(B, "_torch_flash_ops", lambda: ("fwd", "bwd"))
    big = dict(q_shape=(10, 4, 256), k_shape=(10, 2, 256))
    assert torch_flash_unsupported_reasons(_cuda_call(**big)) == []  # the forward runs
    assert any(
        "head dims <= 192" in r for r in torch_flash_unsupported_reasons(_cuda_call(**big, backward=True))
    )


@pytest.mark.gpu
def test_one_query_sequences_with_gqa_on_cuda():
    """Sequences of one query and an empty one, grouped-query, causal: FlashAttention-2's one-query
    path would reshape through the empty sequence; told at least 2 queries, it does not."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    inputs = AttentionInputs(
        q_shape=(2, 8, 64), k_shape=(2, 2, 64), dtype=torch.bfloat16, device=CUDA, causal=True
    )
    if torch_flash_unsupported_reasons(inputs):
        pytest.skip(f"torch_flash cannot run here: {torch_flash_unsupported_reasons(inputs)}")
    g = torch.Generator().manual_seed(2)
    cu = torch.tensor([0, 0, 1, 2], dtype=torch.int32, device="cuda")
    q = torch.randn(2, 8, 64, generator=g).to("cuda", torch.bfloat16)
    k, v = (torch.randn(2, 2, 64, generator=g).to("cuda", torch.bfloat16) for _ in range(2))
    out, lse = ops.attention_block(
        q, k, v, cu, cu, 1, 1, causal=True, softmax_scale=0.125, backend="torch_flash"
    )
    ref, ref_lse = dense_attention(
        *(t.double().cpu() for t in (q, k, v)), cu.cpu(), cu.cpu(), 0.125, causal=True
    )
    assert (out.double().cpu() - ref).abs().max() < 2e-2
    torch.testing.assert_close(lse.cpu().double(), ref_lse, atol=1e-2, rtol=1e-3)
