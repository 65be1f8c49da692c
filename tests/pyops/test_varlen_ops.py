"""torch.ops.mmbalance.{pack, unpack, segment_gather, segment_scatter} and the index helpers.

Run in the ordinary test process these exercise the CPU reference path (``pyops/varlen_ref.py``);
under ``TRITON_INTERPRET=1`` the same tests run the Triton kernels. Kernel-specific tests (poisoned
outputs, tiling, strides) live in ``tests/kernels/test_varlen_kernels.py``.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import mmbalance.pyops as P
from tests.pyops.varlen_expected import (
    DTYPES,
    LENGTHS,
    assert_same,
    cu_of,
    expected_gather,
    expected_pack,
    expected_scatter,
    expected_unpack,
    padded_input,
    payload,
    some_orders,
)

TRAILING = {"row": (), "h2x3": (2, 3)}


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("trailing", TRAILING.values(), ids=TRAILING.keys())
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("lengths", LENGTHS.values(), ids=LENGTHS.keys())
def test_pack(lengths, dtype, trailing):
    gen = _gen(1)
    padded = padded_input(lengths, max(lengths, default=0) + 2, trailing, dtype, gen)
    seqlens = torch.tensor(lengths, dtype=torch.int64)
    out = P.pack(padded, seqlens, sum(lengths))
    assert out.dtype == dtype
    assert_same(out, expected_pack(padded, lengths))


@pytest.mark.parametrize("trailing", TRAILING.values(), ids=TRAILING.keys())
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("lengths", LENGTHS.values(), ids=LENGTHS.keys())
def test_unpack(lengths, dtype, trailing):
    gen = _gen(2)
    packed = payload((sum(lengths), *trailing), dtype, gen)
    max_seqlen = max(lengths, default=0) + 1
    pad = {torch.bool: 1.0, torch.uint8: 7.0}.get(dtype, -3.0)
    out = P.unpack(packed, cu_of(lengths), max_seqlen, pad)
    assert out.dtype == dtype
    assert_same(out, expected_unpack(packed, lengths, max_seqlen, pad))


@pytest.mark.parametrize("order_kind", ["identity", "reversed", "permutation", "subset", "none"])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("lengths", LENGTHS.values(), ids=LENGTHS.keys())
def test_segment_gather_and_scatter(lengths, dtype, order_kind):
    gen = _gen(3)
    order = some_orders(len(lengths), gen)[order_kind]
    packed = payload((sum(lengths), 3), dtype, gen)
    cu = cu_of(lengths)
    order_t = torch.tensor(order, dtype=torch.int64)
    out_tokens = sum(lengths[k] for k in order)
    gathered = P.segment_gather(packed, cu, order_t, out_tokens)
    assert_same(gathered, expected_gather(packed, lengths, order))
    back = P.segment_scatter(gathered, cu, order_t, sum(lengths))
    assert_same(back, expected_scatter(gathered, lengths, order))


def test_int32_index_dtypes_and_int64_cu_seqlens():
    gen = _gen(4)
    lengths = LENGTHS["zero_len"]
    packed = payload((sum(lengths), 4), torch.float32, gen)
    for cu in (cu_of(lengths, torch.int32), cu_of(lengths, torch.int64)):
        order = torch.tensor([4, 1], dtype=torch.int32)
        out = P.segment_gather(packed, cu, order, lengths[4] + lengths[1])
        assert_same(out, expected_gather(packed, lengths, [4, 1]))
        assert_same(P.unpack(packed, cu, 5), expected_unpack(packed, lengths, 5, 0.0))


def test_strided_inputs():
    """Only the last dim needs to be contiguous; other layouts are copied, never misread."""
    gen = _gen(5)
    lengths = LENGTHS["odd"]
    wide = padded_input(lengths, 8, (12,), torch.float32, gen)
    sliced = wide[:, :, 2:9]  # row stride 12, last stride 1
    seqlens = torch.tensor(lengths)
    assert_same(P.pack(sliced, seqlens, sum(lengths)), expected_pack(sliced, lengths))
    transposed = padded_input(lengths, 8, (3, 4), torch.float32, gen).transpose(2, 3)  # last stride 4
    assert_same(P.pack(transposed, seqlens, sum(lengths)), expected_pack(transposed, lengths))
    packed = payload((sum(lengths), 10), torch.float16, gen)[:, ::2]  # last stride 2
    assert_same(P.unpack(packed, cu_of(lengths), 7), expected_unpack(packed, lengths, 7, 0.0))
    gathered = P.segment_gather(packed, cu_of(lengths), torch.tensor([2, 0]), 10)
    assert_same(gathered, expected_gather(packed, lengths, [2, 0]))


def test_repeated_calls_are_fresh_and_identical():
    gen = _gen(6)
    lengths = LENGTHS["odd"]
    padded = padded_input(lengths, 7, (4,), torch.float32, gen)
    seqlens = torch.tensor(lengths)
    first = P.pack(padded, seqlens, sum(lengths))
    second = P.pack(padded, seqlens, sum(lengths))
    assert torch.equal(first, second)
    assert first.data_ptr() != second.data_ptr() and first.data_ptr() != padded.data_ptr()
    first.zero_()
    assert_same(P.pack(padded, seqlens, sum(lengths)), expected_pack(padded, lengths))


# ---------------------------------------------------------------------------------------------
# autograd, opcheck, torch.compile


def _grad_inputs(seed=7):
    gen = _gen(seed)
    lengths = [2, 0, 3, 1]
    seqlens = torch.tensor(lengths)
    cu = cu_of(lengths)
    padded = torch.randn(4, 4, 3, generator=gen, dtype=torch.float64, requires_grad=True)
    packed = torch.randn(6, 3, generator=gen, dtype=torch.float64, requires_grad=True)
    order = torch.tensor([2, 0, 1])
    return lengths, seqlens, cu, padded, packed, order


GRAD_CASES = {
    "pack": lambda s, cu, pd, pk, o: (lambda x: P.pack(x, s, 6), pd),
    "unpack": lambda s, cu, pd, pk, o: (lambda x: P.unpack(x, cu, 4, 1.5), pk),
    "segment_gather": lambda s, cu, pd, pk, o: (lambda x: P.segment_gather(x, cu, o, 5), pk),
    "segment_gather_subset": lambda s, cu, pd, pk, o: (lambda x: P.segment_gather(x, cu, o[:1], 3), pk),
    "segment_scatter": lambda s, cu, pd, pk, o: (lambda x: P.segment_scatter(x[:5], cu, o, 6), pk),
}


@pytest.mark.parametrize("case", GRAD_CASES.keys())
def test_gradcheck_float64(case):
    _, seqlens, cu, padded, packed, order = _grad_inputs()
    fn, x = GRAD_CASES[case](seqlens, cu, padded, packed, order)
    assert torch.autograd.gradcheck(fn, (x,))
    assert torch.autograd.gradgradcheck(fn, (x,))


def _opcheck_cases():
    _, seqlens, cu, padded, packed, order = _grad_inputs()
    empty_cu = torch.zeros(1, dtype=torch.int32)
    return {
        "pack": (torch.ops.mmbalance.pack.default, (padded, seqlens, 6)),
        "pack_int": (torch.ops.mmbalance.pack.default, (padded.detach().long(), seqlens, 6)),
        "unpack": (torch.ops.mmbalance.unpack.default, (packed, cu, 4, -1.0)),
        "unpack_empty": (torch.ops.mmbalance.unpack.default, (packed[:0], empty_cu, 3, 0.0)),
        "segment_gather": (torch.ops.mmbalance.segment_gather.default, (packed, cu, order, 5)),
        "segment_scatter": (torch.ops.mmbalance.segment_scatter.default, (packed[:5], cu, order, 6)),
    }


@pytest.mark.parametrize("case", list(_opcheck_cases()))
def test_opcheck(case):
    op, args = _opcheck_cases()[case]
    torch.library.opcheck(op, args)


def _step(padded, seqlens, cu, order, max_seqlen: int):
    packed = P.pack(padded, seqlens, 6)
    moved = P.segment_gather(packed, cu, order, 5)
    return P.unpack(moved, P.gathered_cu_seqlens(cu, order), max_seqlen, 0.0)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
def test_torch_compile_fullgraph():
    torch._dynamo.reset()
    _, seqlens, cu, padded, _, order = _grad_inputs()
    compiled = torch.compile(_step, fullgraph=True)
    out = compiled(padded, seqlens, cu, order, 3)
    ref = _step(padded, seqlens, cu, order, 3)
    assert torch.equal(out, ref)
    (g_compiled,) = torch.autograd.grad(out.sum(), padded)
    (g_eager,) = torch.autograd.grad(ref.sum(), padded)
    assert torch.equal(g_compiled, g_eager)


# ---------------------------------------------------------------------------------------------
# validation


def _bad_calls():
    x = torch.randn(3, 4, 2)
    s = torch.tensor([1, 4, 0])
    packed = torch.randn(5, 2)
    cu = torch.tensor([0, 1, 5, 5], dtype=torch.int32)
    o = torch.tensor([1, 0])
    return {
        "pack_total": (lambda: P.pack(x, s, 6), ValueError, "total_tokens"),
        "pack_negative_total": (lambda: P.pack(x, s, -1), ValueError, "total_tokens"),
        "pack_seqlen_too_long": (lambda: P.pack(x, torch.tensor([1, 5, 0]), 6), ValueError, "seqlens"),
        "pack_negative_seqlen": (lambda: P.pack(x, torch.tensor([2, 4, -1]), 5), ValueError, "seqlens"),
        "pack_seqlens_count": (lambda: P.pack(x, s[:2], 5), ValueError, "seqlens"),
        "pack_seqlens_dtype": (lambda: P.pack(x, s.float(), 5), TypeError, "seqlens"),
        "pack_payload_dtype": (lambda: P.pack(x.to(torch.complex64), s, 5), TypeError, "padded"),
        "pack_payload_rank": (lambda: P.pack(x[0, 0], s, 5), ValueError, "padded"),
        "pack_device": (lambda: P.pack(x, s.to("meta"), 5), ValueError, "seqlens"),
        "unpack_not_monotonic": (
            lambda: P.unpack(packed, torch.tensor([0, 3, 2, 5]), 4),
            ValueError,
            "non-decreasing",
        ),
        "unpack_not_zero_based": (
            lambda: P.unpack(packed, torch.tensor([1, 3, 5]), 4),
            ValueError,
            "start at 0",
        ),
        "unpack_total": (lambda: P.unpack(packed, torch.tensor([0, 1, 4]), 4), ValueError, "cu_seqlens"),
        "unpack_max_seqlen": (lambda: P.unpack(packed, cu, 3), ValueError, "max_seqlen"),
        "unpack_empty_cu": (lambda: P.unpack(packed, cu[:0], 3), ValueError, "cu_seqlens"),
        "unpack_pad_int": (lambda: P.unpack(packed.long(), cu, 4, 0.5), ValueError, "pad_value"),
        "unpack_pad_range": (lambda: P.unpack(packed.to(torch.uint8), cu, 4, -1.0), ValueError, "pad_value"),
        "unpack_cu_2d": (lambda: P.unpack(packed, cu[None], 4), ValueError, "cu_seqlens"),
        "gather_order_range": (
            lambda: P.segment_gather(packed, cu, torch.tensor([3]), 0),
            ValueError,
            "order",
        ),
        "gather_order_negative": (
            lambda: P.segment_gather(packed, cu, torch.tensor([-1]), 1),
            ValueError,
            "order",
        ),
        "gather_order_repeat": (
            lambda: P.segment_gather(packed, cu, torch.tensor([1, 1]), 8),
            ValueError,
            "order",
        ),
        "gather_order_dtype": (lambda: P.segment_gather(packed, cu, o.float(), 5), TypeError, "order"),
        "gather_out_tokens": (lambda: P.segment_gather(packed, cu, o, 4), ValueError, "out_tokens"),
        "gather_out_tokens_type": (lambda: P.segment_gather(packed, cu, o, 5.0), TypeError, "out_tokens"),
        "gather_cu_mismatch": (
            lambda: P.segment_gather(packed, torch.tensor([0, 1, 4]), o, 4),
            ValueError,
            "packed.shape",
        ),
        "scatter_src_tokens": (lambda: P.segment_scatter(packed[:4], cu, o, 5), ValueError, "src.shape"),
        "scatter_total": (lambda: P.segment_scatter(packed, cu, o, 6), ValueError, "total_tokens"),
        "lengths_negative": (lambda: P.cu_seqlens_from_lengths(torch.tensor([1, -2])), ValueError, "lengths"),
        "lengths_float": (lambda: P.cu_seqlens_from_lengths(torch.tensor([1.0])), TypeError, "lengths"),
        "position_ids_total": (lambda: P.position_ids_from_cu_seqlens(cu, 4), ValueError, "total_tokens"),
        "inverse_not_perm": (lambda: P.inverse_permutation(torch.tensor([0, 2])), ValueError, "order"),
        "inverse_size": (lambda: P.inverse_permutation(torch.tensor([0, 1, 2]), 2), ValueError, "size"),
    }


@pytest.mark.parametrize("case", list(_bad_calls()))
def test_bad_input_raises_naming_the_argument(case):
    call, exc, match = _bad_calls()[case]
    with pytest.raises(exc, match=match):
        call()


@pytest.mark.gpu
def test_value_checks_on_cuda_only_in_debug_mode(monkeypatch):
    packed = torch.randn(5, 2, device="cuda")
    bad_cu = torch.tensor([0, 3, 2, 5], dtype=torch.int32, device="cuda")
    monkeypatch.setenv("MMBALANCE_DEBUG", "0")
    P.unpack(packed, bad_cu, 4)  # no sync, no check: memory-safe garbage
    torch.cuda.synchronize()
    monkeypatch.setenv("MMBALANCE_DEBUG", "1")
    with pytest.raises(ValueError, match="non-decreasing"):
        P.unpack(packed, bad_cu, 4)


# ---------------------------------------------------------------------------------------------
# helpers


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64], ids=["i32", "i64"])
@pytest.mark.parametrize("lengths", LENGTHS.values(), ids=LENGTHS.keys())
def test_cu_seqlens_position_and_segment_ids(lengths, dtype):
    lens = torch.tensor(lengths, dtype=torch.int64)
    cu = P.cu_seqlens_from_lengths(lens, dtype=dtype)
    assert cu.dtype == dtype and cu.tolist() == cu_of(lengths).tolist()
    total = sum(lengths)
    assert P.position_ids_from_cu_seqlens(cu, total).tolist() == [s for n in lengths for s in range(n)]
    assert P.segment_ids_from_cu_seqlens(cu, total).tolist() == [
        b for b, n in enumerate(lengths) for _ in range(n)
    ]


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64], ids=["i32", "i64"])
@pytest.mark.parametrize("lengths", LENGTHS.values(), ids=LENGTHS.keys())
def test_cu_seqlens_from_host_lengths(lengths, dtype):
    import numpy as np

    for host in (list(lengths), np.asarray(lengths, dtype=np.int64), np.asarray(lengths, dtype=np.int32)):
        cu = P.cu_seqlens_from_lengths(host, dtype=dtype, device="cpu")
        assert cu.dtype == dtype and cu.tolist() == cu_of(lengths).tolist()


@pytest.mark.parametrize(
    ("lengths", "dtype", "exc", "word"),
    [
        ([1, -2], torch.int32, ValueError, "non-negative"),
        ([[1, 2]], torch.int32, ValueError, "1-D"),
        ([1.5], torch.int32, TypeError, "integers"),
        (["a"], torch.int32, TypeError, "integers"),
        ([2**31 - 1, 1], torch.int32, ValueError, "int64"),
        ([1], torch.float32, TypeError, "dtype"),
    ],
    ids=["negative", "2d", "float", "str", "int32_overflow", "bad_dtype"],
)
def test_cu_seqlens_from_host_lengths_rejects(lengths, dtype, exc, word):
    with pytest.raises(exc, match=word):
        P.cu_seqlens_from_lengths(lengths, dtype=dtype)


def test_inverse_permutation_and_ungather():
    gen = _gen(8)
    perm = torch.randperm(7, generator=gen)
    inv = P.inverse_permutation(perm)
    assert inv.dtype == torch.int64 and torch.equal(perm[inv], torch.arange(7))
    sub = P.inverse_permutation(torch.tensor([4, 1]), 6)
    assert sub.tolist() == [-1, 1, -1, -1, 0, -1]
    assert P.inverse_permutation(torch.tensor([], dtype=torch.int64)).numel() == 0
    lengths = [2, 0, 3, 1, 4, 0, 2]
    packed = payload((sum(lengths), 3), torch.float32, gen)
    cu = cu_of(lengths)
    moved = P.segment_gather(packed, cu, perm, sum(lengths))
    moved_cu = P.gathered_cu_seqlens(cu, perm)
    assert moved_cu.dtype == cu.dtype
    assert torch.equal(P.segment_gather(moved, moved_cu, inv, sum(lengths)), packed)


@settings(max_examples=30, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 6), min_size=0, max_size=8),
    seed=st.integers(0, 2**16),
    hidden=st.integers(1, 4),
)
def test_round_trips(lengths, seed, hidden):
    gen = _gen(seed)
    total = sum(lengths)
    max_len = max(lengths, default=0)
    packed = payload((total, hidden), torch.float32, gen)
    cu = cu_of(lengths)
    padded = P.unpack(packed, cu, max_len, 0.0)
    assert torch.equal(P.pack(padded, torch.tensor(lengths, dtype=torch.int32), total), packed)
    perm = torch.randperm(len(lengths), generator=gen)
    moved = P.segment_gather(packed, cu, perm, total)
    assert torch.equal(P.segment_scatter(moved, cu, perm, total), packed)


def test_backend_can_be_forced(monkeypatch):
    from mmbalance.kernels import dispatch

    x = torch.zeros(3, 2)
    monkeypatch.setenv("MMBALANCE_VARLEN_BACKEND", "reference")
    assert dispatch.use_triton(x) is False
    monkeypatch.setenv("MMBALANCE_VARLEN_BACKEND", "triton")
    if dispatch.INTERPRET:
        assert dispatch.use_triton(x) is True
    else:
        with pytest.raises(ValueError, match="TRITON_INTERPRET"):
            dispatch.use_triton(x)
    monkeypatch.setenv("MMBALANCE_VARLEN_BACKEND", "fast")
    with pytest.raises(ValueError, match="MMBALANCE_VARLEN_BACKEND"):
        dispatch.use_triton(x)
