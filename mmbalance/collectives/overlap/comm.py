"""Transports and the sliced loops of the all-gather/GEMM overlap.

A *transport* moves the pieces of a chunk plan (see ``plan.py``) between ranks:

``start_gather(x_shard, buf)``
    Start moving every piece into its rows of ``buf`` (``[M, K]``, the gathered input) and
    return a handle; ``handle.wait(i)`` makes chunk ``i``'s rows usable by the caller (host wait
    on gloo, a stream-ordered wait on CUDA), ``handle.wait_all()`` finishes everything.
``start_reduce(n_cols, dtype, device)``
    Return a handle for a sliced reduce-scatter: ``target(i)`` is where the caller writes chunk
    ``i``'s partial rows (``[stop - start, n_cols]``), ``submit(i)`` starts reducing them to
    their owners, ``finish()`` waits and returns this rank's rows of the sum (``[m_r, n_cols]``).

Two transports exist. ``TorchTransport`` uses ``torch.distributed`` async collectives: on NCCL
they run on the process group's own communication stream and ``Work.wait()`` only makes the
compute stream wait on an event (no host sync); on gloo they run on gloo's worker threads while
the calling thread runs the GEMMs (torch releases the GIL inside them). ``CopyEngineTransport``
(``_copy_engine``) moves the same pieces with ``cudaMemcpyPeerAsync`` between IPC-shared buffers,
on GPUs with peer access, so no SM is spent on communication.

The loops (``gather_matmul``, ``matmul_reduce``) are shared by both transports and by the forward
and backward passes. Collectives are issued in the same order on every rank: all gather pieces
first (in plan order), then reduce pieces chunk by chunk.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist

from mmbalance.kernels.dispatch import Backend, select_backend

from ..inflight import Inflight
from .plan import Chunk, ShardLayout

__all__ = [
    "BACKENDS",
    "GatherHandle",
    "ReduceHandle",
    "Transport",
    "TorchTransport",
    "OverlapInputs",
    "resolve_backend",
    "make_transport",
    "gather_matmul",
    "matmul_reduce",
]

BACKENDS = ("torch", "copy_engine")


class GatherHandle(Protocol):
    def wait(self, index: int) -> None: ...

    def wait_all(self) -> None: ...


class ReduceHandle(Protocol):
    def target(self, index: int) -> torch.Tensor: ...

    def submit(self, index: int) -> None: ...

    def finish(self) -> torch.Tensor: ...


class Transport(Protocol):
    name: str
    layout: ShardLayout
    plan: tuple[Chunk, ...]
    rank: int

    def start_gather(self, x_shard: torch.Tensor, buf: torch.Tensor) -> GatherHandle: ...

    def start_reduce(self, n_cols: int, dtype: torch.dtype, device: torch.device) -> ReduceHandle: ...


def _wait(works: Sequence[dist.Work | None]) -> None:
    for w in works:
        if w is not None:
            w.wait()


class _TorchGather:
    def __init__(self, remote: list[list[dist.Work | None]], every: list[dist.Work | None], flight: Inflight):
        self._remote = remote
        self._every = every
        self._flight = flight

    def wait(self, index: int) -> None:
        _wait(self._remote[index])

    def wait_all(self) -> None:
        _wait(self._every)
        self._remote.clear()
        self._every.clear()
        self._flight.wait()  # the backend has let go of every piece when this returns


class _TorchReduce:
    def __init__(self, tr: TorchTransport, n_cols: int, dtype: torch.dtype, device: torch.device):
        self._tr = tr
        self._partial = torch.empty(tr.layout.total, n_cols, dtype=dtype, device=device)
        self._works: list[dist.Work | None] = []
        self._flight = Inflight()
        self._out: torch.Tensor | None = None
        m_r = tr.layout.sizes[tr.rank]
        # A single chunk over an even layout is exactly reduce_scatter_single: the plain path.
        if len(tr.plan) == 1 and tr.layout.is_even:
            self._out = torch.empty(m_r, n_cols, dtype=dtype, device=device)

    def target(self, index: int) -> torch.Tensor:
        c = self._tr.plan[index]
        return self._partial[c.start : c.stop]

    def submit(self, index: int) -> None:
        tr = self._tr
        if self._out is not None:
            alias = self._flight.alias
            self._works.append(
                dist.reduce_scatter_single(
                    alias(self._out), alias(self._partial), group=tr.group, async_op=True
                )
            )
            return
        for p in tr.plan[index].pieces:
            w = dist.reduce(
                self._flight.alias(self._partial[p.rows]),
                group_dst=p.rank,
                op=dist.ReduceOp.SUM,
                group=tr.group,
                async_op=True,
            )
            self._works.append(w)

    def finish(self) -> torch.Tensor:
        _wait(self._works)
        self._works.clear()
        self._flight.wait()
        if self._out is not None:
            return self._out
        # Copy this rank's rows out so the [M, n] scratch is freed (it would otherwise stay alive
        # as long as the result): m_r * n elements, small next to the GEMM that produced them.
        return self._partial[self._tr.layout.rows(self._tr.rank)].clone()


class TorchTransport:
    """Pieces moved by ``torch.distributed`` async collectives (gloo or NCCL).

    Gather pieces are broadcasts from their owner; reduce pieces are reduces to their owner. A
    plan of one chunk over an even layout uses ``all_gather_single`` / ``reduce_scatter_single``
    instead: that is the plain, unsliced path.
    """

    name = "torch"

    def __init__(self, group: dist.ProcessGroup | None, layout: ShardLayout, plan: tuple[Chunk, ...]):
        self.group = group
        self.layout = layout
        self.plan = plan
        self.rank = dist.get_rank(group)

    def start_gather(self, x_shard: torch.Tensor, buf: torch.Tensor) -> GatherHandle:
        flight = Inflight()
        if len(self.plan) == 1 and self.layout.is_even:
            w = dist.all_gather_single(
                flight.alias(buf), flight.alias(x_shard.contiguous()), group=self.group, async_op=True
            )
            return _TorchGather([[w]], [w], flight)
        buf[self.layout.rows(self.rank)].copy_(x_shard)
        remote: list[list[dist.Work | None]] = []
        every: list[dist.Work | None] = []
        for c in self.plan:
            mine = []
            for p in c.pieces:
                w = dist.broadcast(
                    flight.alias(buf[p.rows]), group_src=p.rank, group=self.group, async_op=True
                )
                every.append(w)
                if p.rank != self.rank:
                    mine.append(w)
            remote.append(mine)
        return _TorchGather(remote, every, flight)

    def start_reduce(self, n_cols: int, dtype: torch.dtype, device: torch.device) -> ReduceHandle:
        return _TorchReduce(self, n_cols, dtype, device)


@dataclass(frozen=True, eq=False)
class OverlapInputs:
    """What the transport choice reads of a call: the local shard and the process group."""

    tensor: torch.Tensor
    group: dist.ProcessGroup | None

    def __str__(self) -> str:
        group = "the default group" if self.group is None else f"a group of {dist.get_world_size(self.group)}"
        return f"a {self.tensor.dtype} shard on {self.tensor.device}, {group}"


def _copy_engine_reasons(inputs: OverlapInputs) -> list[str]:
    from . import _copy_engine

    if not inputs.tensor.is_cuda:
        return _copy_engine.not_supported_reasons(inputs.tensor)
    return _copy_engine.group_supported(inputs.group, inputs.tensor.device)


_BACKENDS: tuple[Backend[OverlapInputs], ...] = (
    Backend("copy_engine", _copy_engine_reasons),
    Backend("torch", lambda inputs: []),
)


def resolve_backend(backend: str | None, tensor: torch.Tensor, group: dist.ProcessGroup | None) -> str:
    """Pick the transport (:func:`mmbalance.kernels.dispatch.select_backend`): ``backend`` if given,
    else ``$MMBALANCE_OVERLAP_BACKEND``, else automatic.

    Automatic: ``"copy_engine"`` for CUDA tensors when every rank of ``group`` agrees it can use it
    (a one-time collective handshake per group, see ``_copy_engine.group_supported``), otherwise
    ``"torch"``. Forcing ``"copy_engine"`` where it is unsupported raises ``ValueError`` with the
    reasons. Every rank must make the same choice: pass the same ``backend`` everywhere.
    """
    return select_backend(
        "all-gather/GEMM overlap",
        _BACKENDS,
        backend,
        OverlapInputs(tensor, group),
        env="MMBALANCE_OVERLAP_BACKEND",
    )


def make_transport(
    backend: str, group: dist.ProcessGroup | None, layout: ShardLayout, plan: tuple[Chunk, ...]
) -> Transport:
    if backend == "copy_engine":
        from ._copy_engine import CopyEngineTransport

        return CopyEngineTransport(group, layout, plan)
    return TorchTransport(group, layout, plan)


def compute_order(plan: tuple[Chunk, ...], rank: int) -> list[int]:
    """Chunks that need nothing from other ranks first, then the rest in arrival order."""
    local = [i for i, c in enumerate(plan) if not c.remote(rank)]
    return local + [i for i, c in enumerate(plan) if c.remote(rank)]


def gather_matmul(
    transport: Transport,
    x_shard: torch.Tensor,
    rhs: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    on_chunk: Callable[[int, int, torch.Tensor], None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``gathered = cat(all_gather(x_shard))`` and ``y = gathered @ rhs (+ bias)``, sliced.

    ``x_shard`` is ``[m_r, K]``, ``rhs`` any strided ``[K, N]`` view (e.g. ``weight.t()``), ``bias``
    ``[N]``. Each chunk's GEMM writes straight into its rows of ``y`` as soon as its pieces have
    arrived, while later pieces are still in flight. ``on_chunk(start, stop, gathered_rows)`` runs
    after each chunk's GEMM (the backward uses it to accumulate the weight gradient).
    Returns ``(gathered [M, K], y [M, N])``.
    """
    layout = transport.layout
    m, k, n = layout.total, x_shard.shape[1], rhs.shape[1]
    buf = torch.empty(m, k, dtype=x_shard.dtype, device=x_shard.device)
    y = torch.empty(m, n, dtype=x_shard.dtype, device=x_shard.device)
    if m == 0:
        return buf, y
    handle = transport.start_gather(x_shard, buf)
    for i in compute_order(transport.plan, transport.rank):
        c = transport.plan[i]
        handle.wait(i)
        rows = buf[c.start : c.stop]
        if bias is None:
            torch.mm(rows, rhs, out=y[c.start : c.stop])
        else:
            torch.addmm(bias, rows, rhs, out=y[c.start : c.stop])
        if on_chunk is not None:
            on_chunk(c.start, c.stop, rows)
    handle.wait_all()
    return buf, y


def matmul_reduce(
    transport: Transport,
    a: torch.Tensor,
    rhs: torch.Tensor,
    *,
    before_finish: Callable[[], None] | None = None,
) -> torch.Tensor:
    """``reduce_scatter(a @ rhs)`` along rows, sliced: this rank's ``[m_r, N]`` rows of the sum.

    ``a`` is ``[M, K]`` (any row/col strides with a contiguous last dim), ``rhs`` ``[K, N]``. Chunk
    ``i``'s partial product is reduced to its owners while chunk ``i + 1``'s GEMM runs.
    ``before_finish()`` runs after the last GEMM and before the wait for the last reductions, so
    independent work (the weight gradient in the backward) hides the exposed tail.
    """
    layout = transport.layout
    n = rhs.shape[1]
    if layout.total == 0:
        if before_finish is not None:
            before_finish()
        return torch.empty(0, n, dtype=a.dtype, device=a.device)
    handle = transport.start_reduce(n, a.dtype, a.device)
    for i, c in enumerate(transport.plan):
        torch.mm(a[c.start : c.stop], rhs, out=handle.target(i))
        handle.submit(i)
    if before_finish is not None:
        before_finish()
    return handle.finish()
