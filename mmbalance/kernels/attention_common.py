"""What the attention forward (``attention_fwd.py``) and backward (``attention_bwd.py`` with
``attention_bwd_dkdv.py``) share: the positions of a sequence's tokens and the masks on them, the
loop bounds that follow, the softcap's ``tanh``, the features' switches and runtime arguments, and
the launch configurations per architecture. Everything here is public inside ``kernels``: the
``@triton.jit`` helpers are inlined into the kernels of both passes.

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
length is closed-form (``count_at_most``), so every program computes its loop bounds without a
search, and every row's allowed keys are one contiguous range ``[lo_i, hi_i)``. For a block of
rows: keys ``[n_full_lo, n_full)`` are visible to every row (no mask arithmetic), keys
``[n_full, n_end)`` (the diagonal band, the right window edge, the ragged tail) and, with a left
window, ``[lo_first, n_full_lo)`` (where the rows' windows start) are masked element-wise, and
keys outside ``[lo_first, n_end)`` are never loaded: with a window ``W`` a long sequence costs
``O(L * W)``, not ``O(L^2)``. Without a window ``n_full_lo = lo_first = 0``.

Launch configurations (``fwd_config``, ``bwd_config``) are chosen per architecture for zero spills;
the kernel audit (``python -m mmbalance.bench.kernel_audit``) compiles every variant for sm_80 and
sm_90 with the configuration the launchers pick there and holds it to that.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from ._launch import INTERPRET

__all__ = [
    "LOG2E",
    "run_position",
    "count_at_most",
    "tanh",
    "load_runs",
    "row_bounds",
    "feature_args",
    "bottom_right_runs",
    "block_d",
    "dot_precision",
    "device_capability",
    "fwd_config",
    "bwd_config",
]

LOG2E = 1.4426950408889634


# ----------------------------------------------------------------------------- @triton.jit helpers
@triton.jit
def run_position(t, start0, len0, start1):
    """Absolute position of token(s) ``t`` of a sequence laid out as two runs."""
    return tl.where(t < len0, start0 + t, start1 + (t - len0))


@triton.jit
def count_at_most(t, length, start0, len0, start1):
    """How many tokens of a two-run sequence have position <= ``t`` (they form a prefix)."""
    first = tl.minimum(tl.maximum(t - start0 + 1, 0), len0)
    second = tl.minimum(tl.maximum(t - start1 + 1, 0), length - len0)
    return first + second


@triton.jit
def tanh(x):
    """``tanh(x)`` as ``2 / (1 + exp(-2x)) - 1``: one exp2 and one division, exact limits +-1 at
    +-inf, absolute error of a few float32 ulps (the logits it feeds are compared absolutely)."""
    return 2.0 / (1.0 + tl.math.exp2(x * -2.8853900817779268)) - 1.0


@triton.jit
def load_runs(runs_ptr, b, length, default_start, HAS_RUNS: tl.constexpr):
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
def row_bounds(
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
    count (``count_at_most``). Without a mask (no ``CAUSAL``, ``WIN_LEFT``, ``WIN_RIGHT``) every
    row sees all ``seqlen_k`` keys and nothing is loaded."""
    if CAUSAL or WIN_LEFT or WIN_RIGHT:
        q_start0, q_len0, q_start1 = load_runs(q_runs_ptr, pid_b, seqlen_q, causal_offset, HAS_RUNS)
        k_start0, k_len0, k_start1 = load_runs(k_runs_ptr, pid_b, seqlen_k, 0, HAS_RUNS)
        qpos = run_position(offs_m, q_start0, q_len0, q_start1)
        m_last = tl.minimum(m0 + BLOCK_M, seqlen_q) - 1
        q_first_pos = run_position(m0, q_start0, q_len0, q_start1)
        q_last_pos = run_position(m_last, q_start0, q_len0, q_start1)
        if CAUSAL:
            qhi = qpos
            n_full = count_at_most(q_first_pos, seqlen_k, k_start0, k_len0, k_start1)
            n_end = count_at_most(q_last_pos, seqlen_k, k_start0, k_len0, k_start1)
        elif WIN_RIGHT:
            qhi = qpos + window_right
            n_full = count_at_most(q_first_pos + window_right, seqlen_k, k_start0, k_len0, k_start1)
            n_end = count_at_most(q_last_pos + window_right, seqlen_k, k_start0, k_len0, k_start1)
        else:
            qhi = qpos
            n_full = seqlen_k
            n_end = seqlen_k
        if WIN_LEFT:
            qlo = qpos - window_left
            lo_first = count_at_most(q_first_pos - window_left - 1, seqlen_k, k_start0, k_len0, k_start1)
            lo_last = count_at_most(q_last_pos - window_left - 1, seqlen_k, k_start0, k_len0, k_start1)
        else:
            qlo = qpos
            lo_first = 0
            lo_last = 0
    else:
        # no mask: every row sees every key of its sequence; the runs are not loaded
        qhi = offs_m
        qlo = offs_m
        n_full = seqlen_k
        n_end = seqlen_k
        lo_first = 0
        lo_last = 0
        k_start0 = 0
        k_len0 = seqlen_k
        k_start1 = 0
    return qhi, qlo, n_full, n_end, lo_first, lo_last, k_start0, k_len0, k_start1


# ------------------------------------------------------------------------- features and launches
# Window sizes are clamped to this, so ``position +- window`` stays inside int32 for positions
# within +-2**30 (a window that wide is unbounded for any sequence the kernels can hold).
_WINDOW_MAX = 2**30


def feature_args(
    causal: bool, window_left: int, window_right: int, softcap: float, softmax_scale: float
) -> dict:
    """Runtime arguments and constexpr switches of the optional features, shared by both passes.

    A right window adds nothing to a causal mask (``window_right >= 0`` admits a superset of the
    causal keys), so it is dropped there and the causal variant runs unchanged. With ``softcap``
    the kernels compute ``tanh(qk * qk_scale) * softcap_log2e``, so ``qk_scale`` becomes
    ``scale / softcap`` instead of ``scale * log2(e)``.
    """
    win_left = int(window_left) >= 0
    win_right = int(window_right) >= 0 and not causal
    use_softcap = float(softcap) > 0.0
    return dict(
        WIN_LEFT=win_left,
        WIN_RIGHT=win_right,
        SOFTCAP=use_softcap,
        window_left=min(int(window_left), _WINDOW_MAX) if win_left else 0,
        window_right=min(int(window_right), _WINDOW_MAX) if win_right else 0,
        qk_scale=softmax_scale / softcap if use_softcap else softmax_scale * LOG2E,
        softcap_log2e=float(softcap) * LOG2E if use_softcap else 0.0,
    )


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


def block_d(head_dim: int) -> int:
    """The padded head dimension the kernels work on (a power of two, at least 16)."""
    return max(16, triton.next_power_of_2(head_dim))


def dot_precision(dtype: torch.dtype) -> str:
    """IEEE products for float32 inputs (reference quality); 16-bit inputs ignore the setting."""
    return "ieee" if dtype == torch.float32 else "tf32"


def device_capability(device: torch.device) -> int:
    """``major * 10 + minor`` of a CUDA device (90 for sm_90); 0 for anything else."""
    if device.type != "cuda":
        return 0
    major, minor = torch.cuda.get_device_capability(device)
    return major * 10 + minor


def fwd_config(
    head_dim: int,
    device: torch.device,
    dtype: torch.dtype = torch.bfloat16,
    *,
    capability: int | None = None,
    window: bool = False,
    softcap: bool = False,
    causal: bool = True,
) -> dict:
    """Tile sizes and warps of the forward kernel, chosen per architecture for zero spills.

    ``capability`` is ``major * 10 + minor`` (default: the device's, or the interpreter's small
    tiles under ``TRITON_INTERPRET`` and off CUDA); the kernel audit calls this with 80 and 90 and
    holds every variant it launches to zero spills. 16-bit inputs on sm_90 (the tile sweep,
    ``python -m mmbalance.bench.attention.tiles``, on an H200 with Triton 3.6): one warpgroup per
    64 x 64 tile, three pipeline stages at head dim 64 (7.6% faster than two at 32 x 512 causal);
    at head dim 128 two stages for masked variants, and 128 x 128 tiles with two warpgroups and
    three stages for full attention without a window or softcap (8.4% faster than 64 x 64 at
    8 x 2048). ``window``: a sliding-window variant (a third key loop, more live registers);
    ``softcap``: the tanh-logit variant; ``causal``: the causal mask (``False``: full). The
    ``overflow`` entry is the configuration of the tail launch that runs only when a host
    ``max_seqlen_q`` understated a sequence (same ``BLOCK_M``, so it starts where the main grid
    ends): one pipeline stage and narrow key tiles, so its extra loop never spills.
    float32 uses IEEE products (FMA, not tensor cores) on 4-byte tiles: small tiles, one stage.
    """
    if capability is None and (INTERPRET or device.type != "cuda"):
        return dict(BLOCK_M=16, BLOCK_N=16, num_warps=4, num_stages=1)
    if capability is None:
        capability = device_capability(device)
    if dtype == torch.float32:
        # the FMA products of a window or softcap variant need narrower key tiles on both archs
        return dict(BLOCK_M=32, BLOCK_N=16 if window or softcap else 32, num_warps=8, num_stages=1)
    if block_d(head_dim) > 128:
        return dict(BLOCK_M=64, BLOCK_N=32, num_warps=8, num_stages=2)
    if capability >= 90:
        cfg: dict[str, Any]
        if block_d(head_dim) <= 64:
            cfg = dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3)
        elif not causal and not window and not softcap:
            cfg = dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=3)
        else:
            cfg = dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2)
        cfg["overflow"] = dict(BLOCK_N=32, num_warps=cfg["num_warps"], num_stages=1)
        return cfg
    cfg = dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3)
    if window:  # sm_80 (no wgmma, fragments held in registers): narrower key tiles
        cfg["BLOCK_N"] = 32
    cfg["overflow"] = dict(BLOCK_N=32, num_warps=8, num_stages=1)
    return cfg


def bwd_config(
    head_dim: int,
    device: torch.device,
    dtype: torch.dtype = torch.bfloat16,
    *,
    capability: int | None = None,
    window: bool = False,
    softcap: bool = False,
    causal: bool = True,
) -> dict:
    """Tiles of the dq kernel (``dq_*``) and the dk/dv kernel (``kv_*``), zero spills on sm_80/sm_90.

    ``capability`` is ``major * 10 + minor`` (default: the device's, or the interpreter's small
    tiles as in :func:`fwd_config`); the kernel audit calls this with 80 and 90 and holds every
    variant it lists to zero spills with it. 16-bit inputs: at head dim 128 sm_90 runs one
    warpgroup a program, sm_80 two. On sm_90 (the tile sweep on an H200, Triton 3.6) both passes
    take 64 x 64 tiles in one warpgroup at head dim 64, dq two pipeline stages and dk/dv one (12%
    faster than the sm_80 row); at head dim 128 dq the same, dk/dv 32 x 64 tiles with two stages
    (64 x 64 with one stage was 1.5% faster there but spills with Triton 3.9), and full attention
    without a window or softcap runs dk/dv on 64 x 128 tiles with two warpgroups (4.7% faster).
    ``causal``: the causal mask (``False``: full).
    float32 with a window or softcap (IEEE FMA products, whose register allocation is fragile)
    takes narrower tiles, per architecture. ``overflow`` overrides entries for the tail launches
    that run only when a host ``max_seqlen`` understated a sequence: the dq tail keeps ``dq_BLOCK_M`` (it starts where the
    main grid ends) but takes narrower key tiles, and the dk/dv tail more warps, so their extra
    loops never spill. Pipeline depths are per pass (``dq_stages``, ``kv_stages``). float32 uses
    IEEE products (FMA, not tensor cores) on 4-byte tiles: small tiles, one stage.
    """
    # a table row: dq tiles, warps and pipeline depth, then dk/dv's
    names = (
        "dq_BLOCK_M",
        "dq_BLOCK_N",
        "dq_warps",
        "dq_stages",
        "kv_BLOCK_M",
        "kv_BLOCK_N",
        "kv_warps",
        "kv_stages",
    )
    interpret = capability is None and (INTERPRET or device.type != "cuda")
    arch = 0 if interpret else device_capability(device) if capability is None else capability
    plain_full = not causal and not window and not softcap
    if interpret:
        tiles = (16, 16, 4, 1, 16, 16, 4, 1)
    else:
        if dtype == torch.float32 and (window or softcap):
            tiles = (16, 16, 8, 1, 32, 16, 8, 1) if arch >= 90 else (16, 16, 8, 1, 16, 32, 8, 1)
        elif dtype == torch.float32:
            tiles = (16, 32, 8, 1, 16, 32, 8, 1)
        elif block_d(head_dim) <= 64 and arch >= 90:
            tiles = (64, 64, 4, 2, 64, 64, 4, 1)
        elif block_d(head_dim) <= 64:
            tiles = (128, 32, 8, 2, 32, 64, 4, 2)
        elif block_d(head_dim) <= 128 and arch >= 90:
            # one warpgroup per program: 8 warps took 2.2x (causal) to 2.5x (full) as long on an H200
            tiles = (64, 64, 4, 2, 64, 128, 8, 1) if plain_full else (64, 64, 4, 2, 32, 64, 4, 2)
        elif block_d(head_dim) <= 128:
            tiles = (64, 64, 8, 2, 32, 64, 8, 2)  # sm_80 holds mma.sync fragments in registers: 4 warps spill
        else:
            tiles = (32, 32, 8, 1, 16, 32, 8, 1)
    cfg: dict[str, Any] = dict(zip(names, tiles))
    if interpret:
        return cfg
    overflow: dict[str, int] = {}
    if cfg["dq_BLOCK_N"] > 32:
        overflow["dq_BLOCK_N"] = 32
    elif dtype == torch.float32 and cfg["dq_BLOCK_N"] == 32 and arch >= 90:
        overflow["dq_BLOCK_N"] = 16  # the float32 dq tail spills 64 bytes at 32 on sm_90
        if not causal and not window:
            overflow["dq_warps"] = 4  # and the full-attention one 16 bytes with 8 warps
    elif dtype == torch.float32 and softcap and not window and arch < 90:
        overflow["dq_BLOCK_N"] = 32  # and the float32 softcap dq tail 8 bytes at 16 on sm_80
    if cfg["kv_warps"] == 4 and 64 < block_d(head_dim) <= 128:
        overflow["kv_warps"] = 8  # the dk/dv tail's extra loop spills 8-48 bytes in one warpgroup
    if overflow:
        cfg["overflow"] = overflow
    return cfg
