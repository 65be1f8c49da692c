"""The Triton kernels of ``kernels/varlen.py``, launched directly and through the ops.

They need a CUDA device or ``TRITON_INTERPRET=1`` set before the kernel modules are imported. A
plain ``pytest tests`` run imports the kernels without the interpreter (so ``tests/pyops`` checks
the CPU reference path); there ``test_under_interpreter.py`` re-runs this file in a subprocess
with ``TRITON_INTERPRET=1`` and these tests skip in-process. Directly:
``TRITON_INTERPRET=1 python -m pytest tests/kernels/test_varlen_kernels.py``.

Every output buffer is poisoned (NaN / the dtype's max) before the launch, so a row or column the
kernel forgets to write, or a write past the mask, shows up.
"""

from __future__ import annotations

import pytest
import torch

import mmbalance.pyops as P
from mmbalance.kernels import _launch
from mmbalance.kernels import varlen as K
from mmbalance.pyops import varlen as ops_module
from tests.pyops.varlen_expected import (
    LENGTHS,
    assert_same,
    cu_of,
    expected_gather,
    expected_pack,
    expected_scatter,
    expected_unpack,
    padded_input,
    payload,
    poison,
    some_orders,
    widen,
)

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"


def kernels_runnable() -> bool:
    if HAS_CUDA:
        return True
    return _launch.INTERPRET and type(K.pack_fwd_kernel).__name__ == "InterpretedFunction"


if not kernels_runnable():
    pytest.skip(
        "kernels need TRITON_INTERPRET=1 at import (run via test_under_interpreter.py) or CUDA",
        allow_module_level=True,
    )

# fp16/fp32/int64/uint8 payloads; rows of 1 (labels), odd, vector-sized, and two column tiles
KDTYPES = {"f32": torch.float32, "f16": torch.float16, "i64": torch.int64, "u8": torch.uint8}
ROWS = {"r1": 1, "r3": 3, "r32": 32, "r2053": 2053}


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _poisoned(shape, dtype) -> torch.Tensor:
    return torch.full(shape, poison(dtype), dtype=dtype, device=DEVICE)


def _dev(x: torch.Tensor) -> torch.Tensor:
    return x.to(DEVICE)


def test_tile_shape_covers_rows_with_16_byte_vectors():
    assert K.tile_shape(1 << 20, 4096, 2) == (2, 4096)
    assert K.tile_shape(1 << 20, 1024, 2) == (8, 1024)
    assert K.tile_shape(1 << 20, 8192, 4) == (2, 2048)
    assert K.tile_shape(5, 1, 8) == (8, 1)  # never more rows than the next power of two
    for rows, row_elems, esize in [(3, 3, 4), (1 << 20, 7, 1), (10, 100_000, 2)]:
        bt, br = K.tile_shape(rows, row_elems, esize)
        assert bt >= 1 and br >= 1 and bt * br * esize <= 16384 and (br & (br - 1)) == 0


def _copy_cases():
    """lengths x dtype x row; the two-column-tile row only with one length pattern (interpreter time)."""
    return [
        pytest.param(lengths, dtype, row, id=f"{lk}-{dk}-{rk}")
        for lk, lengths in LENGTHS.items()
        for dk, dtype in KDTYPES.items()
        for rk, row in ROWS.items()
        if row != 2053 or lk == "odd"
    ]


@pytest.mark.parametrize("lengths, dtype, row", _copy_cases())
def test_pack_fwd(lengths, dtype, row):
    padded = _dev(padded_input(lengths, max(lengths, default=0) + 1, (row,), dtype, _gen(10)))
    out = _poisoned((sum(lengths), row), dtype)
    K.pack_fwd(padded, _dev(cu_of(lengths)), out)
    assert_same(out.cpu(), expected_pack(padded.cpu(), lengths))


@pytest.mark.parametrize("lengths, dtype, row", _copy_cases())
def test_unpack_fwd(lengths, dtype, row):
    packed = _dev(payload((sum(lengths), row), dtype, _gen(11)))
    max_seqlen = max(lengths, default=0) + 2
    out = _poisoned((len(lengths), max_seqlen, row), dtype)
    pad = torch.full((1,), 5, dtype=dtype, device=DEVICE)
    K.unpack_fwd(packed, _dev(cu_of(lengths)), out, pad)
    assert_same(out.cpu(), expected_unpack(packed.cpu(), lengths, max_seqlen, 5))


@pytest.mark.parametrize("order_kind", ["reversed", "permutation", "subset", "none"])
@pytest.mark.parametrize("dtype", KDTYPES.values(), ids=KDTYPES.keys())
@pytest.mark.parametrize("lengths", LENGTHS.values(), ids=LENGTHS.keys())
def test_segment_gather_fwd(lengths, dtype, order_kind):
    gen = _gen(12)
    order = some_orders(len(lengths), gen)[order_kind]
    packed = _dev(payload((sum(lengths), 5), dtype, gen))
    cu = cu_of(lengths)
    dst_cu = cu_of([lengths[k] for k in order])
    out = _poisoned((int(dst_cu[-1]), 5), dtype)
    K.segment_gather_fwd(packed, _dev(cu), _dev(dst_cu), _dev(torch.tensor(order, dtype=torch.int64)), out)
    assert_same(out.cpu(), expected_gather(packed.cpu(), lengths, order))


def test_segment_gather_fwd_negative_ids_write_zeros():
    lengths = [2, 3, 1]
    packed = _dev(payload((6, 4), torch.float32, _gen(13)))
    dst_lengths = [3, 4, 2]  # output segment 1 has no source: zeros
    out = _poisoned((9, 4), torch.float32)
    order = _dev(torch.tensor([1, -1, 0]))
    K.segment_gather_fwd(packed, _dev(cu_of(lengths)), _dev(cu_of(dst_lengths)), order, out)
    expected = torch.zeros(9, 4, dtype=torch.float64)
    expected[0:3] = widen(packed[2:5].cpu())
    expected[7:9] = widen(packed[0:2].cpu())
    assert_same(out.cpu(), expected)


def test_strided_rows_and_writes_stay_inside_the_row():
    """Row strides larger than the row; the columns of the out buffer beyond it keep their poison."""
    lengths = LENGTHS["zero_len"]
    gen = _gen(14)
    big = _dev(padded_input(lengths, 6, (40,), torch.float32, gen))
    padded = big[:, :, 3:20]  # stride (240, 40, 1)
    out_buf = _poisoned((sum(lengths), 24), torch.float32)
    out = out_buf[:, :17]
    K.pack_fwd(padded, _dev(cu_of(lengths)), out)
    assert_same(out.cpu(), expected_pack(padded.cpu(), lengths))
    assert torch.isnan(out_buf[:, 17:]).all()
    un_buf = _poisoned((len(lengths), 5, 20), torch.float32)
    K.unpack_fwd(out, _dev(cu_of(lengths)), un_buf[:, :, :17], torch.zeros(1, device=DEVICE))
    assert_same(un_buf[:, :, :17].cpu(), expected_unpack(out.cpu(), lengths, 5, 0.0))
    assert torch.isnan(un_buf[:, :, 17:]).all()


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64], ids=["cu_i32", "cu_i64"])
def test_many_segments_deep_search(index_dtype):
    """200 segments of length 0-3 (many empty): the binary search runs 8 levels."""
    gen = _gen(15)
    lengths = torch.randint(0, 4, (200,), generator=gen).tolist()
    packed = _dev(payload((sum(lengths), 8), torch.float16, gen))
    cu = _dev(cu_of(lengths, index_dtype))
    order = torch.randperm(200, generator=gen)
    out = _poisoned((sum(lengths), 8), torch.float16)
    dst_cu = _dev(cu_of([lengths[k] for k in order.tolist()], index_dtype))
    K.segment_gather_fwd(packed, cu, dst_cu, _dev(order), out)
    assert_same(out.cpu(), expected_gather(packed.cpu(), lengths, order.tolist()))
    padded = _dev(padded_input(lengths, 3, (8,), torch.float16, gen))
    out = _poisoned((sum(lengths), 8), torch.float16)
    K.pack_fwd(padded, cu, out)
    assert_same(out.cpu(), expected_pack(padded.cpu(), lengths))


# ---------------------------------------------------------------------------------------------
# the ops on the kernel path: every output allocation poisoned, launches counted


@pytest.fixture
def kernel_path(monkeypatch):
    calls = []

    def poisoned_output(like, shape):
        return torch.full(shape, poison(like.dtype), dtype=like.dtype, device=like.device)

    for name in ("pack_fwd", "unpack_fwd", "segment_gather_fwd"):
        real = getattr(K, name)

        def spy(*args, _real=real, _name=name):
            calls.append(_name)
            return _real(*args)

        monkeypatch.setattr(ops_module._kernels, name, spy)
    monkeypatch.setattr(ops_module, "_new_output", poisoned_output)
    return calls


OP_DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "i32": torch.int32, "bool": torch.bool}


@pytest.mark.parametrize("dtype", OP_DTYPES.values(), ids=OP_DTYPES.keys())
@pytest.mark.parametrize("lengths", [LENGTHS["odd"], LENGTHS["zero_len"]], ids=["odd", "zero_len"])
def test_ops_take_the_kernel_path(kernel_path, lengths, dtype):
    gen = _gen(16)
    total = sum(lengths)
    padded = _dev(padded_input(lengths, 8, (2, 3), dtype, gen))
    seqlens = _dev(torch.tensor(lengths, dtype=torch.int32))
    cu = _dev(cu_of(lengths))
    packed = P.pack(padded, seqlens, total)
    assert_same(packed.cpu(), expected_pack(padded.cpu(), lengths))
    pad = 1.0 if dtype == torch.bool else -2.0
    assert_same(P.unpack(packed, cu, 9, pad).cpu(), expected_unpack(packed.cpu(), lengths, 9, pad))
    order = [4, 0, 2]
    n_out = sum(lengths[k] for k in order)
    gathered = P.segment_gather(packed, cu, _dev(torch.tensor(order)), n_out)
    assert_same(gathered.cpu(), expected_gather(packed.cpu(), lengths, order))
    back = P.segment_scatter(gathered, cu, _dev(torch.tensor(order)), total)
    assert_same(back.cpu(), expected_scatter(gathered.cpu(), lengths, order))
    assert kernel_path == ["pack_fwd", "unpack_fwd", "segment_gather_fwd", "segment_gather_fwd"]


def test_ops_empty_inputs_launch_nothing(kernel_path):
    x = _dev(torch.randn(0, 4, 3))
    assert P.pack(x, _dev(torch.zeros(0, dtype=torch.int64)), 0).shape == (0, 3)
    empty_cu = _dev(torch.zeros(1, dtype=torch.int32))
    assert P.unpack(_dev(torch.randn(0, 3)), empty_cu, 4).shape == (0, 4, 3)
    cu = _dev(cu_of([0, 0]))
    out = P.unpack(_dev(torch.randn(0, 3)), cu, 2, 7.0)
    assert out.shape == (2, 2, 3) and bool((out == 7).all())
    none = _dev(torch.zeros(0, dtype=torch.int64))
    assert P.segment_gather(_dev(torch.randn(0, 3)), cu, none, 0).shape == (0, 3)
    assert P.segment_scatter(_dev(torch.randn(0, 3)), cu, _dev(torch.tensor([1, 0])), 0).shape == (0, 3)
    assert kernel_path == ["pack_fwd", "unpack_fwd", "unpack_fwd", "segment_gather_fwd", "segment_gather_fwd"]


def _small_grad_case():
    gen = _gen(17)
    lengths = [2, 0, 3]
    seqlens = _dev(torch.tensor(lengths))
    cu = _dev(cu_of(lengths))
    padded = _dev(torch.randn(3, 3, 2, generator=gen, dtype=torch.float64)).requires_grad_()
    packed = _dev(torch.randn(5, 2, generator=gen, dtype=torch.float64)).requires_grad_()
    order = _dev(torch.tensor([2, 0]))
    return seqlens, cu, padded, packed, order


def test_gradcheck_on_the_kernel_path():
    seqlens, cu, padded, packed, order = _small_grad_case()
    assert torch.autograd.gradcheck(lambda x: P.pack(x, seqlens, 5), (padded,))
    assert torch.autograd.gradcheck(lambda x: P.unpack(x, cu, 3, 0.5), (packed,))
    assert torch.autograd.gradcheck(lambda x: P.segment_gather(x, cu, order[:1], 3), (packed,))
    assert torch.autograd.gradcheck(lambda x: P.segment_scatter(x, cu, order, 5), (packed,))


def test_opcheck_on_the_kernel_path():
    seqlens, cu, padded, packed, order = _small_grad_case()
    torch.library.opcheck(torch.ops.mmbalance.pack.default, (padded, seqlens, 5))
    torch.library.opcheck(torch.ops.mmbalance.unpack.default, (packed, cu, 3, -1.0))
    torch.library.opcheck(torch.ops.mmbalance.segment_gather.default, (packed, cu, order, 5))
    torch.library.opcheck(torch.ops.mmbalance.segment_scatter.default, (packed, cu, order, 5))


@pytest.mark.gpu
@pytest.mark.slow
def test_int64_offsets_beyond_2_31_elements():
    """T * row > 2**31: row offsets must be computed in int64 (uint8 payload, ~4.3 GB on device)."""
    row = 1 << 16
    lengths = [20_000, 0, 12_769]  # 32_769 rows * 65_536 > 2**31
    total = sum(lengths)
    packed = torch.empty((total, row), dtype=torch.uint8, device="cuda")
    packed[:, 0] = (torch.arange(total, device="cuda") % 251).to(torch.uint8)
    packed[:, -1] = 7
    cu = cu_of(lengths).cuda()
    order = torch.tensor([2, 0], device="cuda")
    out = P.segment_gather(packed, cu, order, total)
    assert torch.equal(out[:12_769, 0], packed[20_000:, 0]) and torch.equal(
        out[12_769:, 0], packed[:20_000, 0]
    )
    assert bool((out[:, -1] == 7).all())
