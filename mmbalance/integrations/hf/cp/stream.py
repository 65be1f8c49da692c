"""Streamed data (an ``IterableDataset``) in transformers' ``Trainer``: every rank draws its own
examples from its slice of the stream (:class:`RankSlice`), and
:meth:`~.handle.DynamicCPHandle.batches` post-balances each micro-batch over the ranks by
all-to-all (degree 1 everywhere without context parallelism), until every rank's slice has ended
(:class:`StreamLoader`).
"""

from __future__ import annotations

from torch.utils.data import IterableDataset, get_worker_info

__all__ = ["RankSlice", "StreamLoader"]


class RankSlice(IterableDataset):
    """This rank's slice of a stream: the examples ``rank, rank + world, ...`` (the same stream on
    every rank, as a plain ``IterableDataset`` gives it), also split over data-loader workers."""

    def __init__(self, dataset, rank: int, world: int):
        self.dataset, self.rank, self.world = dataset, int(rank), int(world)

    def set_epoch(self, epoch: int) -> None:
        fn = getattr(self.dataset, "set_epoch", None)
        if callable(fn):
            fn(epoch)

    def __iter__(self):
        info = get_worker_info()
        workers, wid = (info.num_workers, info.id) if info is not None else (1, 0)
        stride = self.world * workers
        first = self.rank + self.world * wid
        for i, row in enumerate(self.dataset):
            if i % stride == first:
                yield row


class StreamLoader:
    """A rank's loader of a stream whose micro-batches come out post-balanced (``handle.batches``).

    Iterating yields model keywords until every rank's loader has ended; it has no length
    (Trainer then needs ``max_steps``). ``set_epoch`` reaches the stream.
    """

    def __init__(self, loader, handle, dataset: RankSlice):
        self.loader, self.handle, self.dataset = loader, handle, dataset
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)
        self.dataset.set_epoch(epoch)

    def __iter__(self):
        for kw in self.handle.batches(self.loader):
            kw.pop("num_items_in_batch", None)  # Trainer counts it (shift_labels, across devices)
            yield kw
