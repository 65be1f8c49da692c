"""Shard layouts, chunk plans and the cost model behind the all-gather/GEMM overlap.

Everything here is host-side arithmetic on Python ints, identical on every rank by construction:
the collectives of a sliced all-gather or reduce-scatter must be issued in the same order, with
the same sizes, on every rank of the group, or they mismatch. Only global quantities enter (the
per-rank row counts, ``K``, ``N``, the world size, the dtype and the device type), never anything
that differs between ranks.

Slicing (StepCCL, DistTrain section 7 / MMScale section 6, "decomposing the single GEMM
and the corresponding communication into several smaller pairs"): the gathered rows ``[0, M)``
are cut into ``chunks`` contiguous, near-equal row ranges. A chunk is computed by one GEMM whose
result is written straight into rows ``[start, stop)`` of the output, so no layout remap is
needed afterwards. Its communication is the set of *pieces* it covers: a piece is the part of one
rank's shard that falls into the chunk (a chunk that crosses a shard boundary has several).
"""

from __future__ import annotations

import dataclasses
import functools
import numbers
import os
from collections.abc import Sequence

import torch
import torch.distributed as dist

from ..agreement import Entry

__all__ = [
    "ShardLayout",
    "Piece",
    "Chunk",
    "chunk_plan",
    "OverlapCostModel",
    "choose_chunks",
    "exchange_shard_sizes",
]


@dataclasses.dataclass(frozen=True)
class ShardLayout:
    """Row counts of a tensor sharded along dim 0 over the ranks of a group.

    ``sizes[r]`` is the number of rows held by group rank ``r`` (zero is legal). Rank ``r``'s rows
    sit at ``[offsets[r], offsets[r] + sizes[r])`` of the gathered tensor, in rank order.
    """

    sizes: tuple[int, ...]

    def __post_init__(self) -> None:
        if not isinstance(self.sizes, tuple) or not self.sizes:
            raise ValueError(f"shard_sizes must be a non-empty tuple of ints, got {self.sizes!r}")
        for s in self.sizes:
            if isinstance(s, bool) or not isinstance(s, int) or s < 0:
                raise ValueError(f"shard_sizes must hold non-negative ints, got {self.sizes!r}")

    @classmethod
    def from_sizes(cls, sizes: Sequence[int] | ShardLayout, world_size: int | None = None) -> ShardLayout:
        """Build (and validate) a layout from a sequence of per-rank row counts."""
        if isinstance(sizes, ShardLayout):
            layout = sizes
        else:
            if isinstance(sizes, torch.Tensor):
                if sizes.is_cuda:
                    raise TypeError("shard_sizes must be host data (ints or a CPU tensor), not a CUDA tensor")
                sizes = sizes.tolist()
            try:
                items = list(sizes)
            except TypeError as exc:
                raise TypeError(f"shard_sizes must be a sequence of ints, got {sizes!r}") from exc
            if any(isinstance(s, bool) or not isinstance(s, numbers.Integral) for s in items):
                raise TypeError(f"shard_sizes must be a sequence of ints, got {sizes!r}")
            layout = cls(tuple(int(s) for s in items))
        if world_size is not None and layout.world_size != world_size:
            raise ValueError(
                f"shard_sizes has {layout.world_size} entries but the group has {world_size} ranks"
            )
        return layout

    @classmethod
    def even(cls, total: int, world_size: int) -> ShardLayout:
        """The ``torch.tensor_split`` convention: the first ``total % world_size`` ranks get one more."""
        q, r = divmod(total, world_size)
        return cls(tuple(q + (1 if i < r else 0) for i in range(world_size)))

    @property
    def world_size(self) -> int:
        return len(self.sizes)

    @property
    def total(self) -> int:
        return sum(self.sizes)

    @functools.cached_property
    def offsets(self) -> tuple[int, ...]:
        out, acc = [], 0
        for s in self.sizes:
            out.append(acc)
            acc += s
        return tuple(out)

    @property
    def is_even(self) -> bool:
        return len(set(self.sizes)) == 1

    def rows(self, rank: int) -> slice:
        """The slice of the gathered rows that belongs to ``rank``."""
        return slice(self.offsets[rank], self.offsets[rank] + self.sizes[rank])


@dataclasses.dataclass(frozen=True)
class Piece:
    """Rows ``[start, stop)`` of group rank ``rank``'s shard, at gathered row ``row``."""

    rank: int
    start: int
    stop: int
    row: int

    @property
    def rows(self) -> slice:
        """The same rows as a slice of the gathered tensor."""
        return slice(self.row, self.row + self.stop - self.start)


@dataclasses.dataclass(frozen=True)
class Chunk:
    """Gathered rows ``[start, stop)``: one GEMM, and the pieces of communication it needs."""

    start: int
    stop: int
    pieces: tuple[Piece, ...]

    def remote(self, rank: int) -> tuple[Piece, ...]:
        return tuple(p for p in self.pieces if p.rank != rank)


@functools.lru_cache(maxsize=256)
def chunk_plan(layout: ShardLayout, chunks: int) -> tuple[Chunk, ...]:
    """Cut the gathered rows of ``layout`` into ``min(chunks, M)`` near-equal contiguous chunks.

    Chunk ``i`` covers rows ``[i*M // c, (i+1)*M // c)``; each chunk lists its pieces in rank
    order. Empty input (``M == 0``) gives no chunks. Deterministic, so identical on every rank.
    """
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"chunks must be a positive int, got {chunks!r}")
    total = layout.total
    c = min(chunks, total)
    out = []
    for i in range(c):
        lo, hi = i * total // c, (i + 1) * total // c
        pieces = []
        for r, (off, size) in enumerate(zip(layout.offsets, layout.sizes)):
            a, b = max(lo, off), min(hi, off + size)
            if a < b:
                pieces.append(Piece(rank=r, start=a - off, stop=b - off, row=a))
        out.append(Chunk(start=lo, stop=hi, pieces=tuple(pieces)))
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class OverlapCostModel:
    """A two-resource pipeline model used to pick the number of slices.

    With GEMM time ``g`` and transfer time ``t`` for the whole operation, ``c`` slices cost about
    ``max(g, t) + min(g, t) / c + c * latency`` (one slice of the smaller resource stays exposed,
    at the start for an all-gather and at the end for a reduce-scatter; each slice pays a fixed
    launch/message latency and some GEMM efficiency). ``c = 1`` is the plain sequence ``g + t``.
    Slices are kept at least ``min_rows`` rows tall so the GEMMs stay efficient.
    """

    flops: float  # sustained GEMM FLOP/s
    bandwidth: float  # bytes/s moved into (or out of) one rank
    latency: float  # seconds of fixed cost per slice
    min_rows: int = 1
    max_chunks: int = 16

    def times(self, m: int, k: int, n: int, world_size: int, element_size: int) -> tuple[float, float]:
        """(GEMM seconds, transfer seconds) for an ``[m, k] x [k, n]`` GEMM over ``world_size`` ranks."""
        gemm = 2.0 * m * k * n / self.flops
        comm = m * k * element_size * (world_size - 1) / world_size / self.bandwidth
        return gemm, comm

    def predict(self, chunks: int, m: int, k: int, n: int, world_size: int, element_size: int) -> float:
        """Predicted seconds with ``chunks`` slices."""
        gemm, comm = self.times(m, k, n, world_size, element_size)
        if chunks <= 1:
            return gemm + comm + self.latency
        return max(gemm, comm) + min(gemm, comm) / chunks + chunks * self.latency

    def choose(self, m: int, k: int, n: int, world_size: int, element_size: int) -> int:
        """The slice count with the smallest predicted time (ties go to fewer slices)."""
        if world_size <= 1 or m == 0:
            return 1
        upper = max(1, min(self.max_chunks, m // max(1, self.min_rows)))
        best, best_t = 1, self.predict(1, m, k, n, world_size, element_size)
        for c in range(2, upper + 1):
            t = self.predict(c, m, k, n, world_size, element_size)
            if t < best_t:
                best, best_t = c, t
        return best


# Defaults per device type. CUDA: an H100/H800-class GPU in bf16/fp16 (fp32 GEMMs about 8x slower)
# over NVLink; CPU: one GEMM thread per rank and gloo over loopback TCP. Both are deliberately
# round numbers: the choice is flat near its optimum, and ``MMBALANCE_OVERLAP_CHUNKS`` or an
# explicit ``chunks=`` override it.
_DEFAULT_MODELS: dict[str, OverlapCostModel] = {
    "cuda": OverlapCostModel(flops=4.0e14, bandwidth=2.0e11, latency=1.5e-5, min_rows=512, max_chunks=16),
    "cpu": OverlapCostModel(flops=5.0e10, bandwidth=1.5e9, latency=2.0e-4, min_rows=32, max_chunks=8),
}


def default_cost_model(device_type: str, dtype: torch.dtype) -> OverlapCostModel:
    """The built-in cost model for ``device_type`` (``"cuda"`` or anything else = CPU) and ``dtype``."""
    model = _DEFAULT_MODELS["cuda" if device_type == "cuda" else "cpu"]
    if device_type == "cuda" and dtype in (torch.float32, torch.float64):
        model = dataclasses.replace(model, flops=model.flops / 8)
    elif device_type != "cuda" and dtype == torch.float64:
        model = dataclasses.replace(model, flops=model.flops / 2)
    return model


def choose_chunks(
    m: int,
    k: int,
    n: int,
    world_size: int,
    dtype: torch.dtype,
    device_type: str,
    model: OverlapCostModel | None = None,
) -> int:
    """Number of slices for a sliced all-gather + ``[m, k] x [k, n]`` GEMM (or GEMM + reduce-scatter).

    ``m`` is the *gathered* row count (the same on every rank), ``k`` the dimension that travels,
    ``n`` the local output width. The environment variable ``MMBALANCE_OVERLAP_CHUNKS`` (a
    positive int) overrides the model, for experiments.
    """
    env = os.environ.get("MMBALANCE_OVERLAP_CHUNKS")
    if env:
        try:
            forced = int(env)
        except ValueError as exc:
            raise ValueError(f"MMBALANCE_OVERLAP_CHUNKS must be a positive int, got {env!r}") from exc
        if forced < 1:
            raise ValueError(f"MMBALANCE_OVERLAP_CHUNKS must be a positive int, got {env!r}")
        return forced
    model = model or default_cost_model(device_type, dtype)
    element_size = dtype.itemsize
    return model.choose(m, k, n, world_size, element_size)


def exchange_shard_sizes(
    local_rows: int, group: dist.ProcessGroup | None = None, *, device: torch.device | None = None
) -> ShardLayout:
    """Collective: every rank passes its own row count and gets the layout of the whole group.

    Call it once per batch (all tensor-parallel layers of a step share the sequence sharding) and
    pass the result as ``shard_sizes=``; on NCCL it costs one small all-gather and one host sync,
    on gloo none. Often the sizes are already known on the host from the balancing plan, and
    ``ShardLayout(sizes)`` needs no communication at all. An invalid ``local_rows`` on any rank
    raises on every rank.
    """
    with Entry("exchange_shard_sizes", group) as e:
        e.values = [0]
        e.like = torch.empty(0, device=device) if device is not None else None
        if isinstance(local_rows, bool) or not isinstance(local_rows, int) or local_rows < 0:
            raise ValueError(f"local_rows must be a non-negative int, got {local_rows!r}")
        e.values = [local_rows]
    return ShardLayout(tuple(e.agree().column(0)))
