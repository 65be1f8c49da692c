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
    every rank, as a plain ``IterableDataset`` gives it), also split over data-loader workers.

    A ``datasets.IterableDataset`` already splits its shards over the workers of a loader (each
    worker reads its own shards), so in a worker it is split by rank only; any other stream is read
    whole by every worker, and split by rank and worker."""

    def __init__(self, dataset, rank: int, world: int):
        self.dataset, self.rank, self.world = dataset, int(rank), int(world)

    def set_epoch(self, epoch: int) -> None:
        fn = getattr(self.dataset, "set_epoch", None)
        if callable(fn):
            fn(epoch)

    def _splits_over_workers(self) -> bool:
        try:
            import datasets
        except ImportError:  # pragma: no cover - datasets is optional
            return False
        return isinstance(self.dataset, datasets.IterableDataset)

    def __iter__(self):
        info = get_worker_info()
        workers, wid = (info.num_workers, info.id) if info is not None else (1, 0)
        if workers > 1 and self._splits_over_workers():
            workers, wid = 1, 0  # this worker's stream is its own shards already
        stride = self.world * workers
        first = self.rank + self.world * wid
        for i, row in enumerate(self.dataset):
            if i % stride == first:
                yield row


class StreamLoader:
    """A rank's loader of a stream whose micro-batches come out post-balanced (``handle.batches``),
    ``grad_accum`` to an optimizer step.

    Iterating yields model keywords until every rank's loader has ended, a multiple of
    ``grad_accum`` per pass (a last, partial step completed with idle micro-batches: every pass ends
    in an optimizer step, so a run always reaches ``max_steps``, also on a stream shorter than one
    step). It has no length (Trainer then needs ``max_steps``). ``set_epoch`` reaches the stream.
    ``collate``: the loader yields lists of raw examples, and each step's micro-batches are formed
    under the budget before the collator runs (context parallelism).
    """

    def __init__(self, loader, handle, dataset: RankSlice, grad_accum: int = 1, collate=None):
        self.loader, self.handle, self.dataset = loader, handle, dataset
        self.grad_accum, self.collate = int(grad_accum), collate
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)
        self.dataset.set_epoch(epoch)

    def __iter__(self):
        for kw in self.handle.batches(self.loader, grad_accum=self.grad_accum, collate=self.collate):
            kw.pop("num_items_in_batch", None)  # Trainer counts it (shift_labels, across devices)
            yield kw
