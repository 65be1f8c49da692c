"""Copy-engine transport for the sliced all-gather / reduce-scatter (GPU only, optional, CuPy).

The key idea of StepCCL (DistTrain section 7, MMScale section 6): NCCL's kernels occupy SMs
and slow down the GEMM they are meant to overlap with, so move the data with the GPU's DMA (copy)
engines instead, which use no SM at all. Here every rank of a single-node group owns a small
*symmetric heap*: one ``cudaMalloc`` block, split in two regions (double buffering), whose CUDA IPC
handle is opened once by every peer. Data then moves by *pulling*: a rank copies what it needs
straight out of the peer's region with ``cudaMemcpyAsync`` on a dedicated copy stream. Under
unified addressing an IPC-mapped pointer names the peer's memory, so this is the same DMA transfer
as ``cudaMemcpyPeerAsync`` (which needs the peer's device ordinal to be visible in this process).

Protocol for one operation (``parity`` flips every operation, so the region written now was last
read two operations ago)::

    all-gather     compute stream: x_shard -> my region[parity]; local rows -> gathered
                   ready = 1-element NCCL all-reduce (stream-ordered: a device-side barrier)
                   copy stream:    wait(ready); per chunk: pull its remote pieces; record event
                   compute stream: chunk i's GEMM waits on event i
    reduce-scatter compute stream: chunk i's GEMM writes its partial rows into my region[parity]
                   ready_i = 1-element NCCL all-reduce
                   copy stream:    wait(ready_i); pull every peer's partial of my rows of chunk i
                   compute stream: after GEMM i+1, wait event i and add the pulled partials

Reuse safety: every operation ends with the compute stream waiting on its last barrier, and a
rank's contribution to a barrier comes after its compute stream has waited on all its earlier
copies; so by the time a region is written again, every peer has finished reading it. There is
no host synchronization on the per-call path (only when the heap grows, which is rare and
collective).

Requirements (checked once per group by ``group_supported``, a collective handshake):
CuPy importable, CUDA tensors, an NCCL process group (for the barriers), all ranks on one host,
distinct GPUs that are all visible in every process and have peer access to each other. This
module imports without CuPy or a GPU; it just reports why it cannot be used.
"""

from __future__ import annotations

import socket
from typing import Any

import torch
import torch.distributed as dist

from ..inflight import gather_objects
from .plan import Chunk, ShardLayout

try:  # pragma: no cover - depends on the machine
    import cupy as _cp

    _CUPY_ERROR: str | None = None
except Exception as exc:  # ImportError, or a CUDA runtime mismatch raised at import
    _cp = None
    _CUPY_ERROR = f"{type(exc).__name__}: {exc}"

__all__ = ["not_supported_reasons", "group_supported", "CopyEngineTransport", "release_buffers"]

_MEMCPY_DEFAULT = 4  # cudaMemcpyDefault: direction inferred from unified addresses
_IPC_LAZY_ENABLE_PEER_ACCESS = 1  # cudaIpcMemLazyEnablePeerAccess

_SUPPORT: dict[tuple[int, int], list[str]] = {}
_HEAPS: dict[tuple[int, int], _SymmetricHeap] = {}


def _cupy() -> Any:
    if _cp is None:
        raise RuntimeError(f"the copy-engine transport needs CuPy ({_CUPY_ERROR})")
    return _cp


def _group_key(group: dist.ProcessGroup | None, device: torch.device) -> tuple[int, int]:
    g = group if group is not None else dist.group.WORLD
    return id(g), device.index if device.index is not None else torch.cuda.current_device()


def not_supported_reasons(tensor: torch.Tensor) -> list[str]:
    """Why this process alone cannot use the copy engine for ``tensor`` (empty list: it can)."""
    reasons = []
    if _cp is None:
        reasons.append(f"CuPy is not importable ({_CUPY_ERROR}); install the 'gpu' extra (cupy-cuda12x)")
    if not tensor.is_cuda:
        reasons.append(f"tensors are on {tensor.device}; the copy-engine path needs CUDA tensors")
    return reasons


def group_supported(group: dist.ProcessGroup | None, device: torch.device) -> list[str]:
    """Collective, once per (group, device): every rank gets the same list of reasons (empty: usable).

    Exchanges host name, PCI bus id and local reasons with ``all_gather_object``, then each rank
    checks peer access to every peer and a second exchange makes the verdict identical everywhere.
    """
    key = _group_key(group, device)
    if key in _SUPPORT:
        return _SUPPORT[key]
    device = torch.device("cuda", key[1])
    probe = torch.empty(0, device=device)
    local = not_supported_reasons(probe)
    backend = str(dist.get_backend(group)).lower()
    if "nccl" not in backend:
        local.append(f"the process group backend is {backend!r}; the barriers need NCCL")
    bus_id = ""
    if _cp is not None:
        try:
            bus_id = _cp.cuda.runtime.deviceGetPCIBusId(device.index)
        except Exception as exc:  # pragma: no cover - GPU only
            local.append(f"cannot read the PCI bus id: {exc}")
    info = {"host": socket.gethostname(), "bus": bus_id, "reasons": local}
    world = dist.get_world_size(group)
    infos: list[Any] = gather_objects(info, group)
    mine: list[str] = []
    for r, other in enumerate(infos):
        mine += [f"rank {r}: {why}" for why in other["reasons"]]
    if len({o["host"] for o in infos}) > 1:
        mine.append("the group spans several hosts; IPC peer copies work within one node only")
    buses = [o["bus"] for o in infos]
    if len(set(buses)) < world:
        mine.append(f"ranks share GPUs (PCI bus ids {buses}); IPC needs one GPU per rank")
    if not mine and _cp is not None:  # pragma: no cover - GPU only
        me = device.index
        for r, bus in enumerate(buses):
            if r == dist.get_rank(group):
                continue
            try:
                ordinal = _cp.cuda.runtime.deviceGetByPCIBusId(bus)
            except Exception:
                mine.append(f"rank {r}'s GPU {bus} is not visible in rank {dist.get_rank(group)}'s process")
                continue
            if not _cp.cuda.runtime.deviceCanAccessPeer(me, ordinal):
                mine.append(f"GPU {me} has no peer access to GPU {ordinal} (rank {r})")
    verdicts: list[Any] = gather_objects(sorted(set(mine)), group)
    reasons = sorted({why for v in verdicts for why in v})
    _SUPPORT[key] = reasons
    return reasons


class _SymmetricHeap:  # pragma: no cover - GPU only
    """Two regions of ``region_bytes`` per rank, IPC-mapped into every peer of the group."""

    def __init__(self, group: dist.ProcessGroup | None, device: torch.device, region_bytes: int):
        cp = _cupy()
        self.group = group
        self.device = device
        self.rank = dist.get_rank(group)
        self.region_bytes = region_bytes
        self.parity = 1
        with cp.cuda.Device(device.index):
            self.base = cp.cuda.runtime.malloc(2 * region_bytes)
            handle = cp.cuda.runtime.ipcGetMemHandle(self.base)
        handles: list[Any] = gather_objects(handle, group)
        self.ptrs: list[int] = []
        self._opened: list[int] = []
        with cp.cuda.Device(device.index):
            for r, h in enumerate(handles):
                if r == self.rank:
                    self.ptrs.append(self.base)
                else:
                    p = cp.cuda.runtime.ipcOpenMemHandle(h, _IPC_LAZY_ENABLE_PEER_ACCESS)
                    self.ptrs.append(p)
                    self._opened.append(p)
        mem = cp.cuda.UnownedMemory(self.base, 2 * region_bytes, self, device_id=device.index)
        raw = cp.ndarray((2 * region_bytes,), dtype=cp.uint8, memptr=cp.cuda.MemoryPointer(mem, 0))
        self._bytes = torch.from_dlpack(raw)
        self.flag = torch.zeros(1, dtype=torch.int32, device=device)
        self.copy_stream = torch.cuda.Stream(device=device)

    def flip(self) -> int:
        self.parity ^= 1
        return self.parity

    def ptr(self, rank: int, parity: int) -> int:
        return self.ptrs[rank] + parity * self.region_bytes

    def view(self, parity: int, rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
        """This rank's region ``parity`` as a ``[rows, cols]`` tensor of ``dtype``."""
        nbytes = rows * cols * dtype.itemsize
        start = parity * self.region_bytes
        return self._bytes[start : start + nbytes].view(dtype).view(rows, cols)

    def barrier(self) -> dist.Work:
        """A stream-ordered barrier: completes once every rank's current stream has reached it."""
        work = dist.all_reduce(self.flag, group=self.group, async_op=True)
        if work is None:
            raise RuntimeError("this process is not a member of the copy-engine group")
        return work

    def close(self) -> None:
        """Collective: free the heap once no rank can still be using it."""
        cp = _cupy()
        torch.cuda.synchronize(self.device)
        dist.barrier(group=self.group)
        with cp.cuda.Device(self.device.index):
            for p in self._opened:
                cp.cuda.runtime.ipcCloseMemHandle(p)
        dist.barrier(group=self.group)
        self._bytes = torch.empty(0)
        with cp.cuda.Device(self.device.index):
            cp.cuda.runtime.free(self.base)


def _heap(
    group: dist.ProcessGroup | None, device: torch.device, need: int
) -> _SymmetricHeap:  # pragma: no cover
    """The group's heap with regions of at least ``need`` bytes (grows collectively; ``need`` is global)."""
    key = _group_key(group, device)
    heap = _HEAPS.get(key)
    if heap is not None and heap.region_bytes >= need:
        return heap
    size = 1 << max(20, (need - 1).bit_length())
    if heap is not None:
        heap.close()
    heap = _SymmetricHeap(group, device, size)
    _HEAPS[key] = heap
    return heap


def release_buffers() -> None:
    """Collective over every group that used the copy engine: free the symmetric heaps."""
    for key in list(_HEAPS):  # pragma: no cover - GPU only
        _HEAPS.pop(key).close()


def _pull(dst: int, src: int, nbytes: int, stream: torch.cuda.Stream) -> None:  # pragma: no cover
    if nbytes:
        _cupy().cuda.runtime.memcpyAsync(dst, src, nbytes, _MEMCPY_DEFAULT, stream.cuda_stream)


class _CopyGather:  # pragma: no cover - GPU only
    def __init__(self, events: list[torch.cuda.Event], ready: dist.Work):
        self._events = events
        self._ready = ready

    def wait(self, index: int) -> None:
        torch.cuda.current_stream().wait_event(self._events[index])

    def wait_all(self) -> None:
        if self._events:
            torch.cuda.current_stream().wait_event(self._events[-1])
        self._ready.wait()


class _CopyReduce:  # pragma: no cover - GPU only
    def __init__(self, tr: CopyEngineTransport, n_cols: int, dtype: torch.dtype, device: torch.device):
        self._tr = tr
        layout = tr.layout
        elt = dtype.itemsize
        self._heap = _heap(tr.group, device, layout.total * n_cols * elt)
        self._parity = self._heap.flip()
        self._partial = self._heap.view(self._parity, layout.total, n_cols, dtype)
        self._row_bytes = n_cols * elt
        m_r = layout.sizes[tr.rank]
        self._out = torch.empty(m_r, n_cols, dtype=dtype, device=device)
        # One slot per peer: slot q for ranks below this one, q - 1 above.
        self._recv = torch.empty(max(0, layout.world_size - 1), m_r, n_cols, dtype=dtype, device=device)
        self._recv.record_stream(self._heap.copy_stream)
        self._events: list[torch.cuda.Event | None] = []
        self._added = 0
        self._last: dist.Work | None = None

    def target(self, index: int) -> torch.Tensor:
        c = self._tr.plan[index]
        return self._partial[c.start : c.stop]

    def submit(self, index: int) -> None:
        tr, heap = self._tr, self._heap
        ready = heap.barrier()
        self._last = ready
        mine = [p for p in tr.plan[index].pieces if p.rank == tr.rank]
        event = None
        if mine:
            with torch.cuda.stream(heap.copy_stream):
                ready.wait()
                for p in mine:
                    for q in range(tr.layout.world_size):
                        if q == tr.rank:
                            continue
                        dst = self._recv[q - (q > tr.rank), p.start : p.stop]
                        src = heap.ptr(q, self._parity) + p.row * self._row_bytes
                        _pull(dst.data_ptr(), src, (p.stop - p.start) * self._row_bytes, heap.copy_stream)
                event = torch.cuda.Event()
                event.record(heap.copy_stream)
        self._events.append(event)
        # The GEMM of this chunk is already queued: add up the previous chunk behind it.
        self._add_until(index)

    def _add_until(self, limit: int) -> None:
        tr = self._tr
        while self._added < limit:
            i = self._added
            self._added += 1
            event = self._events[i]
            if event is None:
                continue
            torch.cuda.current_stream().wait_event(event)
            for p in tr.plan[i].pieces:
                if p.rank != tr.rank:
                    continue
                rows = self._out[p.start : p.stop]
                rows.copy_(self._partial[p.rows])
                for q in range(tr.layout.world_size):
                    if q != tr.rank:
                        rows.add_(self._recv[q - (q > tr.rank), p.start : p.stop])

    def finish(self) -> torch.Tensor:
        self._add_until(len(self._tr.plan))
        if self._last is not None:
            self._last.wait()
        return self._out


class CopyEngineTransport:  # pragma: no cover - GPU only
    """Pieces moved by DMA copies out of peers' IPC-mapped symmetric heaps (see the module doc)."""

    name = "copy_engine"

    def __init__(self, group: dist.ProcessGroup | None, layout: ShardLayout, plan: tuple[Chunk, ...]):
        _cupy()
        self.group = group
        self.layout = layout
        self.plan = plan
        self.rank = dist.get_rank(group)

    def start_gather(self, x_shard: torch.Tensor, buf: torch.Tensor) -> _CopyGather:
        layout, me = self.layout, self.rank
        k = buf.shape[1]
        elt = buf.element_size()
        heap = _heap(self.group, buf.device, max(layout.sizes) * k * elt)
        parity = heap.flip()
        heap.view(parity, layout.sizes[me], k, buf.dtype).copy_(x_shard)
        buf[layout.rows(me)].copy_(x_shard)
        ready = heap.barrier()
        buf.record_stream(heap.copy_stream)
        events = []
        with torch.cuda.stream(heap.copy_stream):
            ready.wait()
            for c in self.plan:
                for p in c.remote(me):
                    src = heap.ptr(p.rank, parity) + p.start * k * elt
                    _pull(buf[p.rows].data_ptr(), src, (p.stop - p.start) * k * elt, heap.copy_stream)
                event = torch.cuda.Event()
                event.record(heap.copy_stream)
                events.append(event)
        return _CopyGather(events, ready)

    def start_reduce(self, n_cols: int, dtype: torch.dtype, device: torch.device) -> _CopyReduce:
        return _CopyReduce(self, n_cols, dtype, device)
