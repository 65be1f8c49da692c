"""Attention block forward: softmax(scale * q k^T + mask) v and the log-sum-exp, packed varlen.

Math. For sequence ``b``, query row ``i`` and head ``h`` (kv head ``h // (H / Hkv)``, GQA):

    s_ij   = scale * <q_i, k_j>                        j allowed by the mask
           = softcap * tanh(scale * <q_i, k_j> / softcap)   with logit softcapping (softcap > 0)
    lse_i  = log (exp(sink_h) + sum_j exp(s_ij))        the sink term only with attention sinks
    out_i  = sum_j exp(s_ij - lse_i) v_j

A row with no allowed key has ``out = 0`` and ``lse = -inf``, or ``lse = sink_h`` with sinks.
Logit softcapping is Gemma 2's (the logits stay inside ``(-softcap, softcap)``); the kernel takes
``tanh`` as ``2 / (1 + exp(-2x)) - 1``. An attention sink (gpt-oss's per-head ``s_aux``) is one
extra logit per head with no value vector: it joins the softmax denominator only, so the returned
``lse`` includes it and the backward, which recomputes ``p`` from ``lse``, needs nothing new. Its
own gradient, ``d sink_h = sum_i exp(sink_h - lse_hi) (dlse_hi - rowsum(dout_i * out_i))``, is
left to the caller.

Computed block by block with the online softmax of flash-attention: a running row maximum ``m``
and row sum ``l`` in base 2 (``exp2`` with the scale folded into ``scale * log2(e)``; with a
softcap, ``tanh(scale / softcap * qk) * softcap * log2(e)``), the accumulator rescaled by
``exp2(m_old - m_new)`` when the maximum grows. A row whose keys are all masked so far keeps
``m = -inf``; the update then uses 0 in place of ``m`` so no ``-inf - -inf`` NaN appears. With a
sink the row starts at ``m = sink, l = 1`` instead of ``m = -inf, l = 0``.

Masks. Key ``j`` is allowed for query ``i`` iff, with absolute positions ``pq = pos_q(i)`` and
``pk = pos_k(j)``,

    (not causal or pk <= pq) and (window_left < 0 or pk >= pq - window_left)
                             and (window_right < 0 or pk <= pq + window_right)

flash-attn's sliding window (negative: unbounded on that side; inclusive bounds, so ``(4, 0)`` is
the query and the 4 keys before it). transformers' flash path passes ``sliding_window = W`` as
``(W - 1, W - 1)``, i.e. ``window_left = W - 1`` for a causal decoder (a right window never adds
to a causal mask, so the kernels drop it there). Windows apply without causality too (an encoder's
symmetric window). The positions of one sequence are at most two runs of consecutive integers,
``(start0, len0, start1)``: token ``t`` sits at ``start0 + t`` for ``t < len0`` and at ``start1 +
(t - len0)`` after, with ``start1 >= start0 + len0``. Without run tensors, queries sit at
``causal_offset + i`` and keys at ``j`` (query ``i`` sees ``j <= i + causal_offset``, top-left
aligned; ``causal_offset = Lk - Lq`` is flash-attn's bottom-right). ``causal_offset`` is one
number for the batch; bottom-right alignment per sequence (a KV cache, chunked prefill, each
sequence with its own ``Lq``, ``Lk``) is the query run ``(Lk - Lq, Lq, Lk)`` against the key run
``(0, Lk, Lk)``; with ``Lq > Lk`` the first ``Lq - Lk`` rows see no key, as in flash-attn.
Two runs are what ring attention needs: a zigzag shard holds chunks ``r`` and ``2d - 1 - r`` of
every sequence, so any (query shard, key shard) pair of a ring step is one launch.

Loop bounds. Because the positions are increasing, "keys with position <= t" is a prefix whose
length is closed-form (``_count_at_most``), so every program computes its loop bounds without a
search, and every row's allowed keys are one contiguous range ``[lo_i, hi_i)``. For a block of
rows: keys ``[n_full_lo, n_full)`` are visible to every row (no mask arithmetic), keys
``[n_full, n_end)`` (the diagonal band, the right window edge, the ragged tail) and, with a left
window, ``[lo_first, n_full_lo)`` (where the rows' windows start) are masked element-wise, and
keys outside ``[lo_first, n_end)`` are never loaded: with a window ``W`` a long sequence costs
``O(L * W)``, not ``O(L^2)``. Without a window ``n_full_lo = lo_first = 0``.

Specialisation. Causality, each window side, the softcap and the sinks are ``tl.constexpr``
switches (``CAUSAL``, ``WIN_LEFT``, ``WIN_RIGHT``, ``SOFTCAP``, ``SINKS``): a variant that does
not use a feature compiles to the same code as before the feature existed (the PTX of the plain
variants is unchanged by the features' code), and each feature adds only its own instructions.

Layout. ``q [Tq, H, D]``, ``k``/``v [Tk, Hkv, D]`` with the last dimension contiguous (other
strides are arguments); ``cu_seqlens_q``/``cu_seqlens_k`` int32 ``[B + 1]``; ``out [Tq, H, D]``;
``lse [H, Tq]`` float32 (natural log), flash-attn's varlen layout. Grid: (query blocks of the
longest sequence, H, B); programs past their sequence's end exit at once. Token offsets are int64.

Accumulation: ``q k^T`` and ``p v`` on tensor cores with float32 accumulators; softmax statistics
in float32; ``p`` is rounded to the value dtype for the second product as in flash-attention.
float32 inputs use IEEE products (no TF32) so they can serve as a reference.

Where the idea comes from: FlashAttention-2 (Dao, 2023) forward with the LSE output, which ring
attention (Liu et al., 2023; Brandon et al., 2023, cited in DHP section 3.2) needs to merge
partial results; DHP (section 4.1) runs ring CP of any degree, hence arbitrary chunk pairs and
uneven lengths. Sliding windows, softcapping and sinks follow flash-attn's and transformers'
definitions (Mistral's sliding window, Gemma 2's logit softcapping, gpt-oss's sinks).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._attention_launch import (  # noqa: F401 - launch configurations, public here as before
    LOG2E,
    _features,
    block_d,
    device_capability,
    dot_precision,
    fwd_config,
)
from ._launch import launchable

LN2 = 0.6931471805599453


@triton.jit
def _run_position(t, start0, len0, start1):
    """Absolute position of token(s) ``t`` of a sequence laid out as two runs."""
    return tl.where(t < len0, start0 + t, start1 + (t - len0))


@triton.jit
def _count_at_most(t, length, start0, len0, start1):
    """How many tokens of a two-run sequence have position <= ``t`` (they form a prefix)."""
    first = tl.minimum(tl.maximum(t - start0 + 1, 0), len0)
    second = tl.minimum(tl.maximum(t - start1 + 1, 0), length - len0)
    return first + second


@triton.jit
def _tanh(x):
    """``tanh(x)`` as ``2 / (1 + exp(-2x)) - 1``: one exp2 and one division, exact limits +-1 at
    +-inf, absolute error of a few float32 ulps (the logits it feeds are compared absolutely)."""
    return 2.0 / (1.0 + tl.math.exp2(x * -2.8853900817779268)) - 1.0


@triton.jit
def _load_runs(runs_ptr, b, length, default_start, HAS_RUNS: tl.constexpr):
    """``(start0, len0, start1)`` of sequence ``b``: from the run tensor, or one run at ``default_start``."""
    if HAS_RUNS:
        start0 = tl.load(runs_ptr + 3 * b)
        len0 = tl.minimum(tl.load(runs_ptr + 3 * b + 1), length)
        start1 = tl.load(runs_ptr + 3 * b + 2)
    else:
        start0 = default_start
        len0 = length
        start1 = default_start + length
    return start0, len0, start1


@triton.jit
def _attn_fwd_inner(
    acc,
    l_i,
    m_i,
    q,
    qpos,
    qlo,
    k_base,
    v_base,
    stride_k_tok,
    stride_v_tok,
    seqlen_k,
    k_start0,
    k_len0,
    k_start1,
    lo,
    hi,
    qk_scale,
    softcap_log2e,
    offs_n,
    offs_d,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
    CAUSAL: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    WIN_LEFT: tl.constexpr = False,
    WIN_RIGHT: tl.constexpr = False,
    SOFTCAP: tl.constexpr = False,
):
    """Online-softmax update of ``(acc, l_i, m_i)`` with key blocks ``[lo, hi)``.

    ``qpos`` is each row's highest visible key position (its own position when causal, plus
    ``window_right`` for a right window), ``qlo`` its lowest (``WIN_LEFT``); ``MASKED`` applies
    them element-wise, together with the sequence end.
    """
    d_ok = offs_d < HEAD_DIM
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        kt_ptrs = k_base + cols.to(tl.int64)[None, :] * stride_k_tok + offs_d[:, None]
        v_ptrs = v_base + cols.to(tl.int64)[:, None] * stride_v_tok + offs_d[None, :]
        if MASKED:
            col_ok = cols < seqlen_k
            kt = tl.load(kt_ptrs, mask=col_ok[None, :] & d_ok[:, None], other=0.0)
        elif BLOCK_D != HEAD_DIM:
            kt = tl.load(kt_ptrs, mask=d_ok[:, None], other=0.0)
        else:
            kt = tl.load(kt_ptrs)
        qk = tl.dot(q, kt, input_precision=DOT_PRECISION) * qk_scale
        if SOFTCAP:
            # qk_scale = scale / softcap here: s = softcap * tanh(scale * qk / softcap), base 2
            qk = _tanh(qk) * softcap_log2e
        if MASKED:
            allowed = col_ok[None, :]
            if CAUSAL or WIN_RIGHT or WIN_LEFT:
                kpos = _run_position(cols, k_start0, k_len0, k_start1)
                if CAUSAL or WIN_RIGHT:
                    allowed = allowed & (kpos[None, :] <= qpos[:, None])
                if WIN_LEFT:
                    allowed = allowed & (kpos[None, :] >= qlo[:, None])
            qk = tl.where(allowed, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        if MASKED:
            # rows with every key masked so far keep m = -inf; subtract 0 instead (no NaN)
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_ref = m_new
        p = tl.math.exp2(qk - m_ref[:, None])
        alpha = tl.math.exp2(m_i - m_ref)
        l_i = l_i * alpha + tl.sum(p, 1)
        if MASKED:
            v = tl.load(v_ptrs, mask=col_ok[:, None] & d_ok[None, :], other=0.0)
        elif BLOCK_D != HEAD_DIM:
            v = tl.load(v_ptrs, mask=d_ok[None, :], other=0.0)
        else:
            v = tl.load(v_ptrs)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _row_bounds(
    m0,
    seqlen_q,
    seqlen_k,
    q_runs_ptr,
    k_runs_ptr,
    pid_b,
    causal_offset,
    window_left,
    window_right,
    offs_m,
    BLOCK_M: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_RUNS: tl.constexpr,
    WIN_LEFT: tl.constexpr,
    WIN_RIGHT: tl.constexpr,
):
    """Key bounds of query rows ``[m0, m0 + BLOCK_M)``: per row, the highest (``qhi``) and lowest
    (``qlo``) visible key position; for the block, the key prefix counts ``n_full`` (keys below it
    are under every row's upper bound), ``n_end`` (no row sees a key from it on), ``lo_first`` (no
    row sees a key below it) and ``lo_last`` (every row's lower bound is at or below it), and the
    key runs for the element-wise mask. Positions are increasing, so every bound is a closed-form
    count (``_count_at_most``)."""
    q_start0, q_len0, q_start1 = _load_runs(q_runs_ptr, pid_b, seqlen_q, causal_offset, HAS_RUNS)
    k_start0, k_len0, k_start1 = _load_runs(k_runs_ptr, pid_b, seqlen_k, 0, HAS_RUNS)
    qpos = _run_position(offs_m, q_start0, q_len0, q_start1)
    m_last = tl.minimum(m0 + BLOCK_M, seqlen_q) - 1
    q_first_pos = _run_position(m0, q_start0, q_len0, q_start1)
    q_last_pos = _run_position(m_last, q_start0, q_len0, q_start1)
    if CAUSAL:
        qhi = qpos
        n_full = _count_at_most(q_first_pos, seqlen_k, k_start0, k_len0, k_start1)
        n_end = _count_at_most(q_last_pos, seqlen_k, k_start0, k_len0, k_start1)
    elif WIN_RIGHT:
        qhi = qpos + window_right
        n_full = _count_at_most(q_first_pos + window_right, seqlen_k, k_start0, k_len0, k_start1)
        n_end = _count_at_most(q_last_pos + window_right, seqlen_k, k_start0, k_len0, k_start1)
    else:
        qhi = qpos
        n_full = seqlen_k
        n_end = seqlen_k
    if WIN_LEFT:
        qlo = qpos - window_left
        lo_first = _count_at_most(q_first_pos - window_left - 1, seqlen_k, k_start0, k_len0, k_start1)
        lo_last = _count_at_most(q_last_pos - window_left - 1, seqlen_k, k_start0, k_len0, k_start1)
    else:
        qlo = qpos
        lo_first = 0
        lo_last = 0
    return qhi, qlo, n_full, n_end, lo_first, lo_last, k_start0, k_len0, k_start1


@triton.jit
def _attn_fwd_block(
    m0,
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    lse_ptr,
    q_runs_ptr,
    k_runs_ptr,
    sinks_ptr,
    stride_q_tok,
    stride_q_head,
    stride_k_tok,
    stride_k_head,
    stride_v_tok,
    stride_v_head,
    stride_o_tok,
    stride_o_head,
    stride_lse_head,
    qk_scale,
    causal_offset,
    window_left,
    window_right,
    softcap_log2e,
    pid_h,
    pid_hk,
    pid_b,
    q_beg,
    seqlen_q,
    k_beg,
    seqlen_k,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_RUNS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    WIN_LEFT: tl.constexpr,
    WIN_RIGHT: tl.constexpr,
    SOFTCAP: tl.constexpr,
    SINKS: tl.constexpr,
):
    """Queries ``[m0, m0 + BLOCK_M)`` of sequence ``pid_b``, head ``pid_h``: out and lse."""
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < seqlen_q
    d_ok = offs_d < HEAD_DIM
    q_ptrs = q_ptr + (q_beg + offs_m).to(tl.int64)[:, None] * stride_q_tok + pid_h * stride_q_head
    q = tl.load(q_ptrs + offs_d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    k_base = k_ptr + k_beg.to(tl.int64) * stride_k_tok + pid_hk * stride_k_head
    v_base = v_ptr + k_beg.to(tl.int64) * stride_v_tok + pid_hk * stride_v_head

    if CAUSAL or WIN_LEFT or WIN_RIGHT:
        qpos, qlo, n_full, n_end, lo_first, lo_last, k_start0, k_len0, k_start1 = _row_bounds(
            m0, seqlen_q, seqlen_k, q_runs_ptr, k_runs_ptr, pid_b, causal_offset, window_left,
            window_right, offs_m, BLOCK_M, CAUSAL, HAS_RUNS, WIN_LEFT, WIN_RIGHT,
        )  # fmt: skip
    else:
        k_start0 = 0
        k_len0 = seqlen_k
        k_start1 = 0
        qpos = offs_m
        qlo = offs_m
        n_full = seqlen_k
        n_end = seqlen_k
        lo_first = 0
        lo_last = 0
    n_split = (n_full // BLOCK_N) * BLOCK_N

    if SINKS:
        # the sink joins the denominator only: start from m = sink, l = exp(sink - m) = 1
        m_i = tl.zeros([BLOCK_M], dtype=tl.float32) + tl.load(sinks_ptr + pid_h) * 1.4426950408889634
        l_i = tl.full([BLOCK_M], 1.0, dtype=tl.float32)
    else:
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    n_full_lo = 0
    if WIN_LEFT:
        # keys left of the window are never loaded; the band where some rows' windows start
        # [lo_first, lo_last) is masked element-wise
        n_full_lo = tl.cdiv(lo_last, BLOCK_N) * BLOCK_N
        acc, l_i, m_i = _attn_fwd_inner(
            acc, l_i, m_i, q, qpos, qlo, k_base, v_base, stride_k_tok, stride_v_tok, seqlen_k,
            k_start0, k_len0, k_start1, (lo_first // BLOCK_N) * BLOCK_N, n_full_lo, qk_scale,
            softcap_log2e, offs_n, offs_d, HEAD_DIM, BLOCK_D, BLOCK_N, True, CAUSAL, DOT_PRECISION,
            WIN_LEFT, WIN_RIGHT, SOFTCAP,
        )  # fmt: skip
        n_split = tl.maximum(n_split, n_full_lo)
    # keys every row of the block may see: no mask arithmetic
    acc, l_i, m_i = _attn_fwd_inner(
        acc, l_i, m_i, q, qpos, qlo, k_base, v_base, stride_k_tok, stride_v_tok, seqlen_k,
        k_start0, k_len0, k_start1, n_full_lo, n_split, qk_scale, softcap_log2e, offs_n, offs_d,
        HEAD_DIM, BLOCK_D, BLOCK_N, False, CAUSAL, DOT_PRECISION, WIN_LEFT, WIN_RIGHT, SOFTCAP,
    )  # fmt: skip
    # the diagonal band and the ragged tail of the sequence
    acc, l_i, m_i = _attn_fwd_inner(
        acc, l_i, m_i, q, qpos, qlo, k_base, v_base, stride_k_tok, stride_v_tok, seqlen_k,
        k_start0, k_len0, k_start1, n_split, n_end, qk_scale, softcap_log2e, offs_n, offs_d,
        HEAD_DIM, BLOCK_D, BLOCK_N, True, CAUSAL, DOT_PRECISION, WIN_LEFT, WIN_RIGHT, SOFTCAP,
    )  # fmt: skip

    if SINKS:
        # l_i >= exp(sink - m_i) > 0 unless the sink is -inf; then an empty row has l = 1, m = -inf
        out = acc / l_i[:, None]
        lse = (m_i + tl.math.log2(l_i)) * 0.6931471805599453
    else:
        empty = l_i == 0.0
        out = acc / tl.where(empty, 1.0, l_i)[:, None]
        lse = tl.where(
            empty, float("-inf"), (m_i + tl.math.log2(tl.where(empty, 1.0, l_i))) * 0.6931471805599453
        )
    o_ptrs = out_ptr + (q_beg + offs_m).to(tl.int64)[:, None] * stride_o_tok + pid_h * stride_o_head
    tl.store(o_ptrs + offs_d[None, :], out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    tl.store(lse_ptr + pid_h.to(tl.int64) * stride_lse_head + q_beg + offs_m, lse, mask=row_ok)


@triton.jit
def _attn_fwd_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    lse_ptr,
    cu_q_ptr,
    cu_k_ptr,
    q_runs_ptr,
    k_runs_ptr,
    stride_q_tok,
    stride_q_head,
    stride_k_tok,
    stride_k_head,
    stride_v_tok,
    stride_v_head,
    stride_o_tok,
    stride_o_head,
    stride_lse_head,
    qk_scale,
    causal_offset,
    main_blocks,
    sinks_ptr,
    window_left,
    window_right,
    softcap_log2e,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_RUNS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    OVERFLOW: tl.constexpr,
    WIN_LEFT: tl.constexpr,
    WIN_RIGHT: tl.constexpr,
    SOFTCAP: tl.constexpr,
    SINKS: tl.constexpr,
):
    pid_m = tl.program_id(0)
    # int64 head index: pid_h * stride_*_head can pass 2**31 elements on large batches
    pid_h = tl.program_id(1).to(tl.int64)
    pid_b = tl.program_id(2)
    q_beg = tl.load(cu_q_ptr + pid_b)
    seqlen_q = tl.load(cu_q_ptr + pid_b + 1) - q_beg
    k_beg = tl.load(cu_k_ptr + pid_b)
    seqlen_k = tl.load(cu_k_ptr + pid_b + 1) - k_beg
    pid_hk = pid_h // GROUP
    if OVERFLOW:
        # The blocks past the main grid (``main_blocks`` per sequence, from the host's
        # max_seqlen_q): none when max_seqlen_q is right; a sequence longer than it (possible
        # unchecked on CUDA) is still computed in full instead of leaving rows unwritten. A
        # separate specialization, so the loop costs the main kernel no registers.
        for m0 in range((main_blocks + pid_m) * BLOCK_M, seqlen_q, tl.num_programs(0) * BLOCK_M):
            _attn_fwd_block(
                m0, q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, q_runs_ptr, k_runs_ptr, sinks_ptr,
                stride_q_tok, stride_q_head, stride_k_tok, stride_k_head, stride_v_tok, stride_v_head,
                stride_o_tok, stride_o_head, stride_lse_head, qk_scale, causal_offset, window_left,
                window_right, softcap_log2e, pid_h, pid_hk, pid_b, q_beg, seqlen_q, k_beg, seqlen_k,
                HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N, CAUSAL, HAS_RUNS, DOT_PRECISION, WIN_LEFT,
                WIN_RIGHT, SOFTCAP, SINKS,
            )  # fmt: skip
    else:
        m0 = pid_m * BLOCK_M
        if m0 < seqlen_q:
            _attn_fwd_block(
                m0, q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, q_runs_ptr, k_runs_ptr, sinks_ptr,
                stride_q_tok, stride_q_head, stride_k_tok, stride_k_head, stride_v_tok, stride_v_head,
                stride_o_tok, stride_o_head, stride_lse_head, qk_scale, causal_offset, window_left,
                window_right, softcap_log2e, pid_h, pid_hk, pid_b, q_beg, seqlen_q, k_beg, seqlen_k,
                HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N, CAUSAL, HAS_RUNS, DOT_PRECISION, WIN_LEFT,
                WIN_RIGHT, SOFTCAP, SINKS,
            )  # fmt: skip


def attn_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    softmax_scale: float,
    causal: bool,
    causal_offset: int = 0,
    q_runs: torch.Tensor | None = None,
    k_runs: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    config: dict | None = None,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    window_left: int = -1,
    window_right: int = -1,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the forward kernel; returns ``out [Tq, H, D]`` (``out_dtype``, default q's) and ``lse [H, Tq]``.

    Inputs are assumed validated (``pyops.attention`` does it). ``out``/``lse`` may be passed
    preallocated (last dim contiguous; ``lse`` float32). Rows of sequences with no allowed key get
    ``out = 0`` and ``lse = -inf`` (``lse = sink`` with ``sinks``); an empty batch launches nothing.
    ``window_left``/``window_right`` (negative: unbounded), ``softcap`` (``> 0``: on) and ``sinks``
    (``[H]``, cast to float32) are described in the module docstring.
    """
    tq, n_heads, head_dim = q.shape
    n_kv_heads = k.shape[1]
    batch = cu_seqlens_q.numel() - 1
    if out is None:
        out = torch.empty((tq, n_heads, head_dim), dtype=out_dtype or q.dtype, device=q.device)
    if lse is None:
        lse = torch.empty((n_heads, tq), dtype=torch.float32, device=q.device)
    if tq == 0 or batch == 0:
        return out, lse
    feats = _features(causal, window_left, window_right, softcap, softmax_scale)
    window = feats["WIN_LEFT"] or feats["WIN_RIGHT"]
    cfg = dict(config or fwd_config(head_dim, q.device, q.dtype, window=window, softcap=feats["SOFTCAP"]))
    has_runs = q_runs is not None
    if sinks is not None:
        sinks = sinks.to(device=q.device, dtype=torch.float32).contiguous()
    main_blocks = triton.cdiv(max_seqlen_q, cfg["BLOCK_M"])
    # The main grid covers max_seqlen_q; one program per (head, sequence) then covers whatever a
    # wrong max_seqlen_q left out (it exits at once when nothing was), so no row stays unwritten.
    for overflow, m_grid in ((False, main_blocks), (True, 1)):
        if m_grid == 0:
            continue
        launch = dict(cfg, **cfg.get("overflow", {})) if overflow else cfg
        launchable(_attn_fwd_kernel)[(m_grid, n_heads, batch)](
            q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k,
            q_runs if has_runs else cu_seqlens_q, k_runs if has_runs else cu_seqlens_k,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            out.stride(0), out.stride(1), lse.stride(0),
            feats["qk_scale"], causal_offset, main_blocks, lse if sinks is None else sinks,
            feats["window_left"], feats["window_right"], feats["softcap_log2e"],
            GROUP=n_heads // n_kv_heads, HEAD_DIM=head_dim, BLOCK_D=block_d(head_dim),
            BLOCK_M=cfg["BLOCK_M"], BLOCK_N=launch["BLOCK_N"], CAUSAL=causal, HAS_RUNS=has_runs,
            DOT_PRECISION=dot_precision(q.dtype), OVERFLOW=overflow, WIN_LEFT=feats["WIN_LEFT"],
            WIN_RIGHT=feats["WIN_RIGHT"], SOFTCAP=feats["SOFTCAP"], SINKS=sinks is not None,
            num_warps=launch["num_warps"], num_stages=launch["num_stages"],
        )  # fmt: skip
    return out, lse


def bottom_right_runs(
    cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q_runs, k_runs)`` int32 ``[B, 3]`` that align every sequence bottom-right (flash-attn's
    causal convention for ``Lq != Lk``: the last query sits with the last key; a KV cache, chunked
    prefill): query run ``(Lk - Lq, Lq, Lk)``, key run ``(0, Lk, Lk)``, from each sequence's own
    lengths. With ``Lq > Lk`` the first ``Lq - Lk`` queries see no key. Tensor ops only (no host
    sync), on ``cu_seqlens_q``'s device."""
    lq = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).to(torch.int32)
    lk = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).to(torch.int32).to(lq.device)
    q_runs = torch.stack([lk - lq, lq, lk], 1)
    k_runs = torch.stack([torch.zeros_like(lk), lk, lk], 1)
    return q_runs.contiguous(), k_runs.contiguous()


def audit_configs(capability: int) -> list[dict]:
    """The forward variants the kernel audit compiles for ``sm_<capability>`` (see
    ``_attention_audit.fwd_audit_configs``)."""
    from ._attention_audit import fwd_audit_configs

    return fwd_audit_configs(capability)


# Read by ``bench/kernel_audit.py`` through ``audit_configs(capability)``; this list (sm_90) is
# what the registry tests inspect.
AUDIT_CONFIGS: list[dict] = audit_configs(90)
