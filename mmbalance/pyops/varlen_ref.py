"""Input validation and the plain-torch reference (CPU path) of the varlen ops.

The references are what CPU tensors run without ``TRITON_INTERPRET=1``; tests and benchmarks share
them. They are written without host syncs or data-dependent shapes (output sizes come from the
caller's host ints through ``repeat_interleave(..., output_size=...)``), so they run on any device.
Semantics are those of ``kernels/varlen.py``; there is no arithmetic on the payload, so results are
bit-exact in every dtype.

Validation is split in two: metadata checks (ranks, dtypes, devices, sizes) cost nothing and run
everywhere, including on fake tensors under ``torch.compile``; value checks (monotonic
``cu_seqlens``, ids in range, sums matching the host ints) read the index tensors and therefore run
on CPU always and on CUDA only with ``MMBALANCE_DEBUG=1`` (a device-to-host sync otherwise has no
place on the training step's critical path).
"""

from __future__ import annotations

import torch
from torch import Tensor

INDEX_DTYPES = (torch.int32, torch.int64)
PAYLOAD_DTYPES = (
    torch.float64,
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.int8,
    torch.uint8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.bool,
)


# ----------------------------------------------------------------------------------------------
# validation


def check_size(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, torch.SymInt)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")


def check_pad_value(pad_value, dtype: torch.dtype) -> None:
    if isinstance(pad_value, bool) or not isinstance(pad_value, (int, float)):
        raise TypeError(f"pad_value must be a float, got {type(pad_value).__name__}")
    if dtype.is_floating_point:
        return
    lo, hi = (0, 1) if dtype == torch.bool else (torch.iinfo(dtype).min, torch.iinfo(dtype).max)
    if not (float(pad_value).is_integer() and lo <= pad_value <= hi):
        raise ValueError(
            f"pad_value = {pad_value} is not representable in {dtype} (need an integer in [{lo}, {hi}])"
        )


def check_payload(name: str, x, min_dim: int) -> None:
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in PAYLOAD_DTYPES:
        raise TypeError(
            f"{name} has unsupported dtype {x.dtype}; supported: float64/32/16, bfloat16, integer, bool"
        )
    if x.dim() < min_dim:
        raise ValueError(f"{name} must have at least {min_dim} dimensions, got shape {tuple(x.shape)}")


def check_index(name: str, t, like: Tensor, like_name: str) -> None:
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in INDEX_DTYPES:
        raise TypeError(f"{name} must be int32 or int64, got {t.dtype}")
    if t.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(t.shape)}")
    if t.device != like.device:
        raise ValueError(f"{name} is on {t.device} but {like_name} is on {like.device}")


def check_cu_seqlens(name: str, cu: Tensor, like: Tensor, like_name: str) -> None:
    check_index(name, cu, like, like_name)
    if cu.shape[0] < 1:
        raise ValueError(f"{name} must have n + 1 >= 1 entries (it starts with 0), got an empty tensor")


def check_cu_seqlens_values(name: str, cu: Tensor, total: int, total_name: str) -> None:
    """``cu[0] == 0``, non-decreasing, ``cu[-1] == total``. Reads values: call only when enabled."""
    first, last = int(cu[0]), int(cu[-1])
    if first != 0:
        raise ValueError(f"{name} must start at 0, got {first}")
    if cu.shape[0] > 1 and bool((cu[1:] < cu[:-1]).any()):
        bad = int(torch.nonzero(cu[1:] < cu[:-1])[0, 0])
        raise ValueError(f"{name} must be non-decreasing, but {name}[{bad + 1}] < {name}[{bad}]")
    if last != total:
        raise ValueError(f"{name}[-1] = {last} does not match {total_name} = {total}")


def check_lengths_values(name: str, lengths: Tensor) -> None:
    if lengths.numel() and bool((lengths < 0).any()):
        bad = int(torch.nonzero(lengths < 0)[0, 0])
        raise ValueError(f"{name} must be >= 0, but {name}[{bad}] = {int(lengths[bad])}")


def check_order_values(order: Tensor, n_segments: int, bound_name: str = "cu_seqlens") -> None:
    """Every id in ``[0, n_segments)`` and no id twice. Reads values: call only when enabled."""
    if order.numel() == 0:
        return
    lo, hi = int(order.min()), int(order.max())
    if lo < 0 or hi >= n_segments:
        bad = lo if lo < 0 else hi
        raise ValueError(f"order contains segment id {bad}, outside [0, {n_segments}) given by {bound_name}")
    counts = torch.bincount(order.long(), minlength=n_segments)
    if bool((counts > 1).any()):
        dup = int(torch.nonzero(counts > 1)[0, 0])
        raise ValueError(f"order must not repeat a segment id, but {dup} appears {int(counts[dup])} times")


def check_order_total(order: Tensor, cu: Tensor, out_tokens: int, out_name: str) -> None:
    selected = int((cu[1:] - cu[:-1]).long()[order.long()].sum()) if order.numel() else 0
    if selected != out_tokens:
        raise ValueError(
            f"{out_name} = {out_tokens} does not match the total length of the segments in order ({selected})"
        )


# ----------------------------------------------------------------------------------------------
# small sync-free index helpers (shared by the references and the public helpers)


def exclusive_cumsum(lengths: Tensor, dtype: torch.dtype) -> Tensor:
    """``[0, l0, l0 + l1, ...]`` (``n + 1`` entries) in ``dtype`` (two kernels on a GPU)."""
    return torch.nn.functional.pad(torch.cumsum(lengths, 0, dtype=dtype), (1, 0))


def segment_ids(lengths: Tensor, total: int) -> Tensor:
    """Segment id of every token (int64 ``[total]``); ``total`` must equal ``lengths.sum()``."""
    ids = torch.arange(lengths.shape[0], device=lengths.device)
    return torch.repeat_interleave(ids, lengths.long(), output_size=total)


def gather_rows(lengths: Tensor, starts: Tensor, total: int) -> Tensor:
    """Source row of every output token when segment ``j`` (``lengths[j]`` rows) starts at ``starts[j]``."""
    seg = segment_ids(lengths, total)
    dst_starts = exclusive_cumsum(lengths.long(), torch.int64)[:-1]
    return starts.long()[seg] + torch.arange(total, device=lengths.device) - dst_starts[seg]


# ----------------------------------------------------------------------------------------------
# references


def pack_ref(padded: Tensor, seqlens: Tensor, total_tokens: int) -> Tensor:
    """``[B, S, *]`` -> ``[total_tokens, *]``: the first ``seqlens[b]`` rows of every example."""
    n_batch, max_len = padded.shape[:2]
    seg = segment_ids(seqlens, total_tokens)
    starts = exclusive_cumsum(seqlens.long(), torch.int64)[:-1]
    pos = torch.arange(total_tokens, device=padded.device) - starts[seg]
    return padded.reshape(n_batch * max_len, *padded.shape[2:]).index_select(0, seg * max_len + pos)


def unpack_ref(packed: Tensor, cu_seqlens: Tensor, max_seqlen: int, pad_value: float) -> Tensor:
    """``[T, *]`` -> ``[B, max_seqlen, *]``; rows past a segment's end hold ``pad_value``."""
    n = cu_seqlens.shape[0] - 1
    trailing = packed.shape[1:]
    total = packed.shape[0]
    out = torch.full((n * max_seqlen, *trailing), pad_value, dtype=packed.dtype, device=packed.device)
    if total and n and max_seqlen:
        cu = cu_seqlens.long()
        seg = segment_ids(cu[1:] - cu[:-1], total)
        pos = torch.arange(total, device=packed.device) - cu[:-1][seg]
        out.index_copy_(0, seg * max_seqlen + pos, packed)
    return out.view(n, max_seqlen, *trailing)


def segment_gather_ref(packed: Tensor, cu_seqlens: Tensor, order: Tensor, out_tokens: int) -> Tensor:
    """Segments ``order[0], order[1], ...`` of ``packed`` concatenated: ``[out_tokens, *]``."""
    order = order.long()
    cu = cu_seqlens.long()
    rows = gather_rows((cu[1:] - cu[:-1])[order], cu[:-1][order], out_tokens)
    return packed.index_select(0, rows)


def segment_scatter_ref(src: Tensor, cu_seqlens: Tensor, order: Tensor, total_tokens: int) -> Tensor:
    """Adjoint of :func:`segment_gather_ref`: segment ``j`` of ``src`` goes to segment ``order[j]``
    of a ``[total_tokens, *]`` output; segments not in ``order`` are zero."""
    order = order.long()
    cu = cu_seqlens.long()
    rows = gather_rows((cu[1:] - cu[:-1])[order], cu[:-1][order], src.shape[0])
    out = src.new_zeros((total_tokens, *src.shape[1:]))
    return out.index_copy(0, rows, src)
