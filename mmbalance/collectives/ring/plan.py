"""Token layout of context parallelism: which tokens of each sequence a CP rank holds.

Every sequence of the global (unsharded) batch is cut into chunks at ``bounds[c] = (c * L) // n``:

- ``"zigzag"``: ``n = 2 * degree`` chunks; rank ``r`` holds chunks ``r`` and ``n - 1 - r``, so under
  a causal mask every rank gets the same amount of attention work (an early and a late chunk);
- ``"contiguous"``: ``n = degree`` chunks; rank ``r`` holds chunk ``r``.

Lengths need not be multiples of ``n``: chunks differ by at most one token, short sequences give
empty chunks, nothing is padded. On a rank the tokens are sequence-major (all of sequence 0's
tokens on that rank, then sequence 1's ...), in position order, so each local sequence is at most
two runs of consecutive positions: exactly the ``(start0, len0, start1)`` runs the attention block
kernels take (``kernels/attention_common.py``). The plan is a pure function of (lengths, degree, layout),
computed on the host with numpy and cached, so every rank derives identical shapes for the ring's
send/receive buffers without any communication.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import torch

LAYOUTS = ("zigzag", "contiguous")


@dataclasses.dataclass(frozen=True, eq=False)
class RingPlan:
    """Per-rank shard geometry of a packed batch under context parallelism of ``degree`` ranks.

    Attributes (``B`` sequences, ``d = degree``):
        lengths: ``[B]`` global sequence lengths.
        runs: ``[d, B, 3]`` int32 ``(start0, len0, start1)`` positions of each rank's tokens.
        local_lengths: ``[d, B]`` tokens of each sequence on each rank.
        tokens: ``[d]`` tokens per rank; ``max_seqlen``: ``[d]`` longest local sequence per rank.
    """

    degree: int
    layout: str
    lengths: np.ndarray
    runs: np.ndarray
    local_lengths: np.ndarray
    tokens: tuple[int, ...]
    max_seqlen: tuple[int, ...]
    # visibility of (q_rank, k_rank, causal, window) pairs, computed once per plan (the plan is
    # cached per batch, so every layer's ring and its backward reuse them)
    _seen: dict = dataclasses.field(default_factory=dict, repr=False, compare=False)

    def local_cu_seqlens(self, rank: int) -> np.ndarray:
        """``cu_seqlens`` (int32, ``[B + 1]``) of the tokens held by ``rank``."""
        return np.concatenate([[0], np.cumsum(self.local_lengths[rank])]).astype(np.int32)

    def global_index(self, rank: int) -> np.ndarray:
        """Global token index (int64) of each token held by ``rank``, in local order."""
        starts = np.concatenate([[0], np.cumsum(self.lengths)])[:-1]
        start0, len0, start1 = self.runs[rank, :, 0], self.runs[rank, :, 1], self.runs[rank, :, 2]
        len1 = self.local_lengths[rank] - len0
        pieces = []
        for b in range(len(self.lengths)):
            pieces.append(starts[b] + start0[b] + np.arange(len0[b]))
            pieces.append(starts[b] + start1[b] + np.arange(len1[b]))
        return np.concatenate(pieces).astype(np.int64) if pieces else np.zeros(0, np.int64)

    def positions(self, rank: int) -> np.ndarray:
        """Position of each local token inside its sequence (for rotary embeddings), int64."""
        start0, len0, start1 = self.runs[rank, :, 0], self.runs[rank, :, 1], self.runs[rank, :, 2]
        len1 = self.local_lengths[rank] - len0
        pieces = []
        for b in range(len(self.lengths)):
            pieces.append(start0[b] + np.arange(len0[b]))
            pieces.append(start1[b] + np.arange(len1[b]))
        return np.concatenate(pieces).astype(np.int64) if pieces else np.zeros(0, np.int64)

    @functools.cached_property
    def unshard_index(self) -> np.ndarray:
        """Permutation taking the concatenation of all ranks' tokens back to global order."""
        order = np.concatenate([self.global_index(r) for r in range(self.degree)])
        inverse = np.empty_like(order)
        inverse[order] = np.arange(order.size)
        return inverse

    def visibility(self, q_rank: int, k_rank: int, *, causal: bool = True, window_left: int = -1,
                   window_right: int = -1) -> str:  # fmt: skip
        """Mask relation of ``q_rank``'s queries to ``k_rank``'s keys over all sequences.

        Key ``j`` is allowed for query ``i`` of one sequence when ``pos_j <= pos_i`` (``causal``),
        ``pos_j >= pos_i - window_left`` and ``pos_j <= pos_i + window_right`` (``-1``: unbounded).
        ``"none"``: no query sees any key (the ring step can be skipped: a window far behind the
        queries, or later keys under a causal mask); ``"full"``: every query sees every key of its
        sequence (no mask needed); ``"partial"``: a mask is needed.
        """
        key = (q_rank, k_rank, bool(causal), int(window_left), int(window_right))
        found = self._seen.get(key)
        if found is None:
            found = self._seen[key] = self._visibility(q_rank, k_rank, causal, window_left, window_right)
        return found

    def _visibility(self, q_rank: int, k_rank: int, causal: bool, window_left: int, window_right: int) -> str:
        lo = -np.inf if window_left < 0 else -float(window_left)  # allowed pos_j - pos_i
        hi = np.inf if window_right < 0 else float(window_right)
        if causal:
            hi = min(hi, 0.0)
        seen = masked = valid_any = False
        for qa, qb in _chunks(self.runs[q_rank], self.local_lengths[q_rank]):
            for ka, kb in _chunks(self.runs[k_rank], self.local_lengths[k_rank]):
                valid = (qb > qa) & (kb > ka)
                if not valid.any():
                    continue
                valid_any = True
                # pos_j - pos_i over the pair of runs spans [ka - (qb - 1), (kb - 1) - qa]
                dmin, dmax = (ka - (qb - 1))[valid], ((kb - 1) - qa)[valid]
                seen = seen or bool(((dmax >= lo) & (dmin <= hi)).any())
                masked = masked or not bool(((dmin >= lo) & (dmax <= hi)).all())
        if not valid_any or not seen:
            return "none"
        return "partial" if masked else "full"


def _chunks(runs: np.ndarray, length: np.ndarray) -> tuple[tuple[np.ndarray, np.ndarray], ...]:
    """The position intervals ``[start, end)`` of a rank's two runs of every sequence."""
    start0, len0, start1 = (
        runs[:, 0].astype(np.int64),
        runs[:, 1].astype(np.int64),
        runs[:, 2].astype(np.int64),
    )
    return (start0, start0 + len0), (start1, start1 + (length.astype(np.int64) - len0))


def host_lengths(cu_seqlens) -> np.ndarray:
    """Sequence lengths from ``cu_seqlens`` (tensor on any device, numpy array or list), validated."""
    if isinstance(cu_seqlens, torch.Tensor):
        if cu_seqlens.dim() != 1 or cu_seqlens.dtype.is_floating_point:
            raise ValueError(
                f"cu_seqlens must be a 1-D integer tensor, got {cu_seqlens.dtype} {tuple(cu_seqlens.shape)}"
            )
        cu = cu_seqlens.detach().cpu().numpy().astype(np.int64)  # one small copy on CUDA
    else:
        cu = np.asarray(cu_seqlens, dtype=np.int64)
    if cu.ndim != 1 or cu.size < 1:
        raise ValueError("cu_seqlens must be 1-D with at least one entry")
    if cu[0] != 0:
        raise ValueError(f"cu_seqlens must start at 0, got {cu[0]}")
    lengths = np.diff(cu)
    if (lengths < 0).any():
        raise ValueError("cu_seqlens must be non-decreasing")
    return lengths


@functools.lru_cache(maxsize=64)
def _ring_plan_cached(lengths: tuple[int, ...], degree: int, layout: str) -> RingPlan:
    lengths_np = np.asarray(lengths, dtype=np.int64)
    n_chunks = 2 * degree if layout == "zigzag" else degree
    bounds = (np.arange(n_chunks + 1)[None, :] * lengths_np[:, None]) // n_chunks  # [B, n + 1]
    runs = np.zeros((degree, len(lengths), 3), dtype=np.int32)
    local = np.zeros((degree, len(lengths)), dtype=np.int64)
    for r in range(degree):
        first = r
        second = n_chunks - 1 - r if layout == "zigzag" else None
        start0, end0 = bounds[:, first], bounds[:, first + 1]
        runs[r, :, 0] = start0
        runs[r, :, 1] = end0 - start0
        if second is None:
            runs[r, :, 2] = end0
            local[r] = end0 - start0
        else:
            runs[r, :, 2] = bounds[:, second]
            local[r] = (end0 - start0) + (bounds[:, second + 1] - bounds[:, second])
    tokens = tuple(int(x) for x in local.sum(1))
    max_seqlen = tuple(int(x) for x in (local.max(1) if len(lengths) else np.zeros(degree, np.int64)))
    return RingPlan(degree, layout, lengths_np, runs, local, tokens, max_seqlen)


def ring_plan(cu_seqlens, degree: int, layout: str = "zigzag") -> RingPlan:
    """The shard geometry of the batch ``cu_seqlens`` (global boundaries) over ``degree`` CP ranks.

    ``cu_seqlens``: int tensor (any device; copied to the host once), numpy array or list.
    Raises ValueError for a bad layout, degree or ``cu_seqlens``.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if isinstance(degree, bool) or not isinstance(degree, int) or degree < 1:
        raise ValueError(f"degree must be a positive int, got {degree!r}")
    lengths = host_lengths(cu_seqlens)
    return _ring_plan_cached(tuple(int(x) for x in lengths), degree, layout)
