"""Process-group pool for dynamic context-parallel groups (DHP section 5 (1)).

``torch.distributed.new_group`` is a collective over the whole world and costs milliseconds (tens
on NCCL); dynamic CP scheduling (``mmbalance.balancing.cp_schedule``) picks a new set of groups every
step, but the same rank sets recur. The pool creates each distinct rank set once and hands the
cached group back afterwards. Plans are identical on every rank, so every rank asks for groups in
the same order and creates the missing ones in the same order, as ``new_group`` requires.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from datetime import timedelta

import torch.distributed as dist

from .group import group_timeout, world_of
from .inflight import gather_objects

__all__ = ["GroupPool", "own_group", "ranks_group"]


class GroupPool:
    """Cache of process groups keyed by their sorted rank tuple.

    Args:
        backend: backend of the new groups (default: the world's).
        timeout: timeout of the new groups (default: the world's, as ``init_process_group`` set it).

    Example::

        pool = GroupPool()
        for g in cp_schedule(lengths, world, memory_per_rank):   # identical on every rank
            group = pool.get(g.ranks)                             # created once, reused after
            if dist.get_rank() in g.ranks:
                out = ring_attention(q, k, v, cu, group=group, causal=True)
    """

    def __init__(self, backend: str | None = None, timeout: timedelta | None = None):
        self.backend = backend
        self.timeout = timeout
        self._groups: dict[tuple[int, ...], object] = {}
        self.created = 0
        self.hits = 0

    def get(self, ranks: Sequence[int]):
        """The process group of ``ranks`` (every rank must call this with the same sequence of rank
        sets, members or not)."""
        world_of(None)
        key = tuple(sorted(int(r) for r in ranks))
        world = dist.get_world_size()
        if not key:
            raise ValueError("ranks must not be empty")
        if len(set(key)) != len(key) or key[0] < 0 or key[-1] >= world:
            raise ValueError(f"ranks must be distinct ranks in [0, {world}), got {list(ranks)}")
        if key == tuple(range(world)):
            self.hits += 1
            return dist.group.WORLD
        group = self._groups.get(key)
        if group is None:
            kw: dict[str, object] = {}
            if self.backend is not None:
                kw["backend"] = self.backend
            timeout = self.timeout if self.timeout is not None else group_timeout()
            if timeout is not None:
                kw["timeout"] = timeout
            group = dist.new_group(list(key), **kw)  # type: ignore[arg-type]
            self._groups[key] = group
            self.created += 1
        else:
            self.hits += 1
        return group

    def get_all(self, rank_sets: Iterable[Sequence[int]]) -> list:
        """Groups of several rank sets, in order (e.g. all groups of one CP schedule)."""
        return [self.get(r) for r in rank_sets]

    def __len__(self) -> int:
        return len(self._groups)


def own_group(base):
    """A process group with ``base``'s ranks for one caller alone: its all-to-alls (also those of
    the backward, which autograd schedules) then never interleave with DDP's or FSDP's collectives
    on a shared communicator. It takes ``base``'s timeout. ``new_group`` is collective over the
    world and needs the same calls in the same order on every rank, so every rank learns every
    rank's group first and all create all of them."""
    every = gather_objects(tuple(dist.get_process_group_ranks(base)))
    timeout = group_timeout(base)
    me, own = dist.get_rank(), None
    for ranks in sorted(set(every)):
        g = (
            dist.new_group(list(ranks), timeout=timeout)
            if timeout is not None
            else dist.new_group(list(ranks))
        )
        if me in ranks:
            own = g
    return own


# groups named by their ranks (ranks_group): created once per rank set and process, then reused
_NAMED: dict[tuple[int, ...], object] = {}


def ranks_group(ranks: tuple[int, ...]):
    """The process group of the global ``ranks``, created at the first call with the world's
    timeout and reused afterwards; a group of its own also for the whole world (never
    ``WORLD``, whose collectives a trainer's DDP or FSDP may share). ``new_group`` is collective
    over the world: every rank must ask for the same rank sets in the same order."""
    group = _NAMED.get(ranks)
    if group is None:
        timeout = group_timeout()
        kw = {} if timeout is None else {"timeout": timeout}
        group = _NAMED[ranks] = dist.new_group(list(ranks), **kw)  # type: ignore[arg-type]
    return group
