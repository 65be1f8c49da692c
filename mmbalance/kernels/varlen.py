"""Varlen data-movement kernels: pack, unpack and segment gather.

Math. With ``cu = cu_seqlens`` (length ``n + 1``, ``cu[0] = 0``, non-decreasing) segment ``i`` of a
packed tensor is rows ``cu[i] .. cu[i+1] - 1``. The three copies are

    pack            packed[cu[b] + s]        = padded[b, s]                 for s < len[b]
    unpack          padded[b, s]             = packed[cu[b] + s] if s < len[b] else pad
    segment gather  out[dst_cu[j] + s]       = src[src_cu[order[j]] + s]    (zeros if order[j] < 0)

``segment_gather_fwd`` with a negative entry in ``order`` fills that output segment with zeros; the
backward of a gather (a scatter with the inverse order, zeros for segments that were not selected)
is the same kernel with source and destination offsets swapped.

Layout. Trailing dimensions are flattened by the caller into one row of ``row_elems`` elements whose
last stride is 1; every other dimension is addressed through a stride argument, so views that are
contiguous only in the last dimension need no copy. All row offsets are computed in int64
(``T * row_elems`` may exceed 2**31), segment ids in int32.

Work split. Each program copies a ``BLOCK_T x BLOCK_R`` tile of the *output*: every output row is
written exactly once, no atomics, no per-token index tensor. The source row is computed from
``cu_seqlens``: pack and segment gather find the segment of each output token with a vectorised
binary search over the destination ``cu_seqlens`` (``n_iters = ceil(log2 n)`` probes, all hitting
L1/L2 since ``cu_seqlens`` is tiny); unpack needs no search (row ``r`` of the padded output is
segment ``r // max_seqlen``). ``BLOCK_R`` spans 16-byte-aligned runs of the row so the loads and
stores vectorise to 128-bit accesses when the pointers are 16-byte aligned and the row length and
strides, counted in elements, are multiples of 16 (Triton specialises integer arguments on
divisibility by 16 elements at launch, not 16 bytes). No arithmetic is done on
the payload, so there is no accumulation dtype: every dtype (float or integer) is copied bit-exactly.

Where the idea comes from: the packed layout is flash-attention's varlen convention
(``cu_seqlens``); fusing flash-attn's ``bert_padding`` (``nonzero`` + ``index_select``) into one
copy and regrouping examples by destination rank into one send buffer before the all-to-all
follows OrchMLLM's All-to-All Batch Communicator (OrchMLLM section 5.2.1, Figure 5); the same
gather applies DistTrain's data reordering (DistTrain section 6) on device.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._launch import launchable

# Bytes copied by one program: enough 16-byte vectors in flight per thread (8 per thread at 4 warps)
# to cover memory latency, small enough that many programs share an SM.
_TILE_BYTES = 16384
_MAX_ROW_CHUNK_BYTES = 8192
NUM_WARPS = 4


@triton.jit
def _find_segment(cu_ptr, toks, n_segments, n_iters):
    """Largest ``j < n_segments`` with ``cu[j] <= tok`` for each token (a vector binary search).

    Invariant ``cu[lo] <= tok < cu[hi]``; ``n_iters = ceil(log2(n_segments))`` halvings shrink
    ``hi - lo`` to 1. Zero-length segments (``cu[j] == cu[j+1]``) are skipped automatically.
    """
    lo = tl.zeros_like(toks).to(tl.int32)
    hi = lo + n_segments
    for _ in range(n_iters):
        mid = (lo + hi) // 2
        v = tl.load(cu_ptr + mid).to(tl.int64)
        right = v <= toks
        lo = tl.where(right, mid, lo)
        hi = tl.where(right, hi, mid)
    return lo


@triton.jit
def pack_fwd_kernel(
    padded_ptr,
    cu_ptr,
    out_ptr,
    total_tokens,
    row_elems,
    max_len,
    n_segments,
    n_iters,
    stride_p_b,
    stride_p_s,
    stride_o_t,
    BLOCK_T: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    pid_t = tl.program_id(0).to(tl.int64)
    pid_r = tl.program_id(1)
    toks = pid_t * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)
    tok_ok = toks < total_tokens
    seg = _find_segment(cu_ptr, toks, n_segments, n_iters)
    start = tl.load(cu_ptr + seg, mask=tok_ok, other=0).to(tl.int64)
    end = tl.load(cu_ptr + seg + 1, mask=tok_ok, other=0).to(tl.int64)
    pos = toks - start
    # Rows the plan does not cover (inconsistent seqlens, only possible unchecked on CUDA) are
    # written as zeros instead of reading out of bounds.
    src_ok = tok_ok & (pos >= 0) & (pos < end - start) & (pos < max_len)
    src_row = seg.to(tl.int64) * stride_p_b + pos * stride_p_s
    cols = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    col_ok = cols < row_elems
    x = tl.load(
        padded_ptr + src_row[:, None] + cols[None, :], mask=src_ok[:, None] & col_ok[None, :], other=0
    )
    dst_row = toks * stride_o_t
    tl.store(out_ptr + dst_row[:, None] + cols[None, :], x, mask=tok_ok[:, None] & col_ok[None, :])


@triton.jit
def unpack_fwd_kernel(
    packed_ptr,
    cu_ptr,
    out_ptr,
    total_tokens,
    row_elems,
    max_seqlen,
    n_rows,
    pad_ptr,
    stride_p_t,
    stride_o_b,
    stride_o_s,
    BLOCK_T: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    pid_t = tl.program_id(0).to(tl.int64)
    pid_r = tl.program_id(1)
    rows = pid_t * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)
    row_ok = rows < n_rows
    b = rows // max_seqlen
    s = rows - b * max_seqlen
    start = tl.load(cu_ptr + b, mask=row_ok, other=0).to(tl.int64)
    end = tl.load(cu_ptr + b + 1, mask=row_ok, other=0).to(tl.int64)
    src_t = start + s
    src_ok = row_ok & (src_t < end) & (src_t < total_tokens)
    cols = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    col_ok = cols < row_elems
    src_row = src_t * stride_p_t
    x = tl.load(
        packed_ptr + src_row[:, None] + cols[None, :], mask=src_ok[:, None] & col_ok[None, :], other=0
    )
    # The pad comes in as a one-element tensor of the payload dtype, so it is exact in every dtype.
    x = tl.where(src_ok[:, None], x, tl.load(pad_ptr))
    dst_row = b * stride_o_b + s * stride_o_s
    tl.store(out_ptr + dst_row[:, None] + cols[None, :], x, mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def segment_gather_fwd_kernel(
    src_ptr,
    src_cu_ptr,
    dst_cu_ptr,
    order_ptr,
    out_ptr,
    src_tokens,
    out_tokens,
    row_elems,
    n_src_segments,
    n_dst_segments,
    n_iters,
    stride_s_t,
    stride_o_t,
    BLOCK_T: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    pid_t = tl.program_id(0).to(tl.int64)
    pid_r = tl.program_id(1)
    toks = pid_t * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)
    tok_ok = toks < out_tokens
    j = _find_segment(dst_cu_ptr, toks, n_dst_segments, n_iters)
    dst_start = tl.load(dst_cu_ptr + j, mask=tok_ok, other=0).to(tl.int64)
    k = tl.load(order_ptr + j, mask=tok_ok, other=-1).to(tl.int64)
    # k < 0 marks an output segment with no source (the scatter's unselected segments): zeros.
    has_src = tok_ok & (k >= 0) & (k < n_src_segments)
    src_start = tl.load(src_cu_ptr + k, mask=has_src, other=0).to(tl.int64)
    src_end = tl.load(src_cu_ptr + k + 1, mask=has_src, other=0).to(tl.int64)
    src_t = src_start + (toks - dst_start)
    src_ok = has_src & (src_t >= src_start) & (src_t < src_end) & (src_t < src_tokens)
    cols = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    col_ok = cols < row_elems
    src_row = src_t * stride_s_t
    x = tl.load(src_ptr + src_row[:, None] + cols[None, :], mask=src_ok[:, None] & col_ok[None, :], other=0)
    dst_row = toks * stride_o_t
    tl.store(out_ptr + dst_row[:, None] + cols[None, :], x, mask=tok_ok[:, None] & col_ok[None, :])


def _next_pow2(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


def tile_shape(n_rows: int, row_elems: int, element_size: int) -> tuple[int, int]:
    """``(BLOCK_T, BLOCK_R)`` for a copy of ``n_rows`` rows of ``row_elems`` elements.

    ``BLOCK_R`` covers the row (up to 8 KiB of it) so each thread moves whole 16-byte vectors;
    ``BLOCK_T`` fills the rest of a 16 KiB tile and never exceeds the number of rows.
    """
    block_r = min(_next_pow2(row_elems), max(1, _MAX_ROW_CHUNK_BYTES // element_size))
    block_t = max(1, _TILE_BYTES // (block_r * element_size))
    block_t = min(block_t, _next_pow2(n_rows), 4096)
    return block_t, block_r


def _search_iters(n_segments: int) -> int:
    return max(0, n_segments - 1).bit_length()


def pack_fwd(padded, cu_seqlens, out) -> None:
    """Launch the pack kernel: ``out[T, R] <- padded[B, S, R]`` along ``cu_seqlens[B + 1]``.

    ``padded`` and ``out`` must have last stride 1; ``cu_seqlens`` int32 or int64, contiguous.
    Launches nothing when ``out`` is empty.
    """
    total, row_elems = out.shape
    if total == 0 or row_elems == 0:
        return
    n_segments = cu_seqlens.shape[0] - 1
    if n_segments == 0:
        out.zero_()  # no segment covers any row; nothing to search
        return
    block_t, block_r = tile_shape(total, row_elems, out.element_size())
    grid = (triton.cdiv(total, block_t), triton.cdiv(row_elems, block_r))
    launchable(pack_fwd_kernel)[grid](
        padded,
        cu_seqlens,
        out,
        total,
        row_elems,
        padded.shape[1],
        n_segments,
        _search_iters(n_segments),
        padded.stride(0),
        padded.stride(1),
        out.stride(0),
        BLOCK_T=block_t,
        BLOCK_R=block_r,
        num_warps=NUM_WARPS,
    )


def unpack_fwd(packed, cu_seqlens, out, pad) -> None:
    """Launch the unpack kernel: ``out[B, M, R] <- packed[T, R]``, rows past a segment's end = pad.

    ``pad`` is a one-element tensor of ``out``'s dtype on ``out``'s device.
    Every element of ``out`` is written. Launches nothing when ``out`` is empty.
    """
    n_batch, max_seqlen, row_elems = out.shape
    n_rows = n_batch * max_seqlen
    if n_rows == 0 or row_elems == 0:
        return
    block_t, block_r = tile_shape(n_rows, row_elems, out.element_size())
    grid = (triton.cdiv(n_rows, block_t), triton.cdiv(row_elems, block_r))
    launchable(unpack_fwd_kernel)[grid](
        packed,
        cu_seqlens,
        out,
        packed.shape[0],
        row_elems,
        max_seqlen,
        n_rows,
        pad,
        packed.stride(0),
        out.stride(0),
        out.stride(1),
        BLOCK_T=block_t,
        BLOCK_R=block_r,
        num_warps=NUM_WARPS,
    )


def segment_gather_fwd(src, src_cu_seqlens, dst_cu_seqlens, order, out) -> None:
    """Launch the segment-gather kernel: output segment ``j`` <- source segment ``order[j]``.

    ``src`` ``[T_src, R]``, ``out`` ``[T_out, R]`` (last stride 1); ``dst_cu_seqlens`` has
    ``len(order) + 1`` entries and gives where each output segment starts; a negative
    ``order[j]`` writes zeros. Launches nothing when ``out`` is empty.
    """
    total, row_elems = out.shape
    if total == 0 or row_elems == 0:
        return
    n_dst = dst_cu_seqlens.shape[0] - 1
    if n_dst == 0:
        out.zero_()
        return
    block_t, block_r = tile_shape(total, row_elems, out.element_size())
    grid = (triton.cdiv(total, block_t), triton.cdiv(row_elems, block_r))
    launchable(segment_gather_fwd_kernel)[grid](
        src,
        src_cu_seqlens,
        dst_cu_seqlens,
        order,
        out,
        src.shape[0],
        total,
        row_elems,
        src_cu_seqlens.shape[0] - 1,
        n_dst,
        _search_iters(n_dst),
        src.stride(0),
        out.stride(0),
        BLOCK_T=block_t,
        BLOCK_R=block_r,
        num_warps=NUM_WARPS,
    )
