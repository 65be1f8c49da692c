"""The training loaders a balanced ``Trainer`` iterates (:func:`~mmbalance.integrations.hf.balance_trainer`
binds them as the trainer's ``get_train_dataloader``): the balanced batch sampler's loader (under
context parallelism the CP sampler's, with the shard-cutting collator), the streamed loader
post-balanced by all-to-all, and :class:`TrainerDraw`, the trainer's own draw read as the sampler's
order. Each keeps the trainer's collator with unused columns removed, its workers and their
seeding, pinned memory and prefetching."""

from __future__ import annotations

from functools import partial
from typing import Any

import numpy as np

from mmbalance.integrations.data import BalancedBatchSampler

from .compat import loader_options
from .cp import (
    CPBatchSampler,
    CPCollator,
    GroupCutter,
    RankSlice,
    StreamLoader,
    TaggedDataset,
    install_attention_check,
    install_media_hook,
    make_handle,
    pad_id,
    raw_rows,
    vlm_family,
)
from .wrappers import inner_model

__all__ = ["TrainerDraw", "balanced_train_dataloader", "stream_train_dataloader"]


class TrainerDraw:
    """Each epoch's draw of a trainer's own training loader (``order`` of the balanced sampler):
    the dataset indices of every optimizer step, as the trainer would have given them to all
    ranks (and the balanced loader then reads the examples through that loader's dataset and
    collator, as the trainer would: a framework's own columns included). The loader is the one the
    trainer's class builds (its ``get_train_dataloader``: a framework's own sampler included), asked
    for its batches' indices only (nothing is loaded); every rank's share of the epoch is gathered
    (one small gather when the epoch starts). Step ``s`` is every rank's micro-batches
    ``s * grad_accum .. (s + 1) * grad_accum - 1``, laid out as they are dealt (a rank's ``j``-th
    example of the step at position ``j * ranks + rank``, what the sampler's ``cost_before``
    prices); a last, partial step (fewer than ``grad_accum`` micro-batches left) is the sampler's
    ``tail``, trained as drawn."""

    def __init__(self, trainer, batch_size: int, grad_accum: int):
        self.loader = type(trainer).get_train_dataloader(trainer)
        self.batch_size, self.grad_accum = int(batch_size), int(grad_accum)
        batches = len(self.loader)  # this rank's micro-batches of an epoch (every rank the same)
        #: whole steps of an epoch, and the micro-batches of its last, partial step
        self.steps = (batches // self.grad_accum, batches % self.grad_accum)
        self._tails: dict[int, list] = {}

    def _set_epoch(self, epoch: int) -> None:
        seen: set[int] = set()
        stack = [self.loader]
        while stack:
            obj = stack.pop()
            if obj is None or id(obj) in seen:
                continue
            seen.add(id(obj))
            if callable(getattr(obj, "set_epoch", None)):
                obj.set_epoch(epoch)
            stack += [getattr(obj, "batch_sampler", None), getattr(obj, "sampler", None)]

    def __call__(self, epoch: int) -> np.ndarray:
        import torch.distributed as dist

        from mmbalance.collectives.inflight import gather_objects

        self._set_epoch(epoch)
        batches = self.loader.batch_sampler
        if batches is None:
            raise ValueError(
                "order='trainer': the trainer's training loader has no batch sampler to read its draw from"
            )
        mine = [[int(i) for i in batch] for batch in batches]
        every = gather_objects(mine) if dist.is_available() and dist.is_initialized() else [mine]
        full, _ = self.steps
        g, b, world = self.grad_accum, self.batch_size, len(every)
        per = g * b
        out = np.empty(full * per * world, dtype=np.int64)
        for s in range(full):
            block = out[s * per * world : (s + 1) * per * world]
            for r, theirs in enumerate(every):
                vals = [i for mb in theirs[s * g : (s + 1) * g] for i in mb]
                if len(vals) != per:
                    raise ValueError(
                        f"order='trainer': rank {r}'s loader gives step {s} of epoch {epoch} {len(vals)} examples, "
                        f"not grad_accum x batch_size = {per}"
                    )
                block[np.arange(per) * world + r] = vals
        self._tails[epoch] = [theirs[full * g :] for theirs in every]
        return out

    def tail(self, epoch: int) -> list:
        """Every rank's micro-batches of the partial last step of ``epoch`` (after ``self(epoch)``)."""
        return self._tails.pop(epoch)


def _collator_of(self, dataset):
    """The trainer's collator with unused columns removed, and the dataset as Trainer reads it."""
    from transformers.utils import is_datasets_available

    collator = self.data_collator
    if is_datasets_available():
        import datasets

        if isinstance(dataset, datasets.Dataset):
            return self._remove_unused_columns(dataset, description="Training"), collator
    return dataset, self._get_collator_with_removed_columns(collator, description="Training")


def stream_train_dataloader(self):
    """``Trainer.get_train_dataloader`` for a streamed dataset: this rank's slice, batched by the
    trainer's collator, post-balanced by all-to-all (bound to the instance)."""
    from torch.utils.data import DataLoader

    context_parallel, budget, cost = self._mmbalance_stream
    handle = getattr(self, "_mmbalance_stream_handle", None)
    if handle is None:
        handle = make_handle(self.model, budget, cost, None, context_parallel)
        self._mmbalance_stream_handle = handle
    args = self.args
    world = max(1, args.world_size)
    dataset, collator = _collator_of(self, self.train_dataset)
    part = RankSlice(dataset, args.process_index if world > 1 else 0, world)
    # with a budget the steps are formed from raw examples before collating (the slots under it)
    slotted = context_parallel and world > 1
    loader = DataLoader(
        part, batch_size=self._train_batch_size, collate_fn=raw_rows if slotted else collator,
        num_workers=args.dataloader_num_workers, pin_memory=args.dataloader_pin_memory, drop_last=False,
    )  # fmt: skip
    return StreamLoader(loader, handle, part, args.gradient_accumulation_steps, collator if slotted else None)


def balanced_train_dataloader(self):
    """``Trainer.get_train_dataloader`` with the balanced batch sampler (bound to the instance)."""
    import torch
    from accelerate.data_loader import prepare_data_loader
    from torch.utils.data import DataLoader
    from transformers.trainer_utils import seed_worker

    dataset = self.train_dataset
    sampler: BalancedBatchSampler = self.balanced_sampler
    if dataset is None or len(dataset) != sampler.table.shape[0]:
        raise ValueError(
            "trainer.train_dataset changed after balance_trainer (its size differs from the lengths the "
            "sampler was built for): call balance_trainer again"
        )
    if sampler.batch_size != self._train_batch_size:  # auto_find_batch_size lowered it: same lengths
        options = dict(self._mmbalance_options)
        if isinstance(options.get("order"), TrainerDraw):  # the trainer's own draw at the new size
            options["order"] = TrainerDraw(
                self, self._train_batch_size, self.args.gradient_accumulation_steps
            )
        self._mmbalance_options = options
        sampler = BalancedBatchSampler(sampler.table, self._train_batch_size, **options)
        self.balanced_sampler = sampler
    draw = sampler.order
    if isinstance(draw, TrainerDraw):  # the trainer's own loader's dataset and collator, as they are
        dataset, collator = draw.loader.dataset, draw.loader.collate_fn
    else:
        dataset, collator = _collator_of(self, dataset)
    batch_sampler: Any = sampler
    if self._mmbalance_cp is not None:
        budget, cost = self._mmbalance_cp
        batch_sampler = getattr(self, "cp_sampler", None)
        if batch_sampler is None or batch_sampler.base is not sampler:
            batch_sampler = CPBatchSampler(sampler, budget, cost)
            self.cp_sampler = batch_sampler
        dataset = TaggedDataset(dataset)
        model = inner_model(self.model)
        vlm = None
        if vlm_family(model) is not None:
            vlm = GroupCutter(model, cost)
            install_media_hook(model, self.model)
        install_attention_check(model, self.model)
        collator = CPCollator(collator, pad_id(model), vlm)
    args = self.args
    params = {
        "batch_sampler": batch_sampler,
        "collate_fn": collator,
        "num_workers": args.dataloader_num_workers,
        "pin_memory": args.dataloader_pin_memory,
        "persistent_workers": args.dataloader_persistent_workers,
        "prefetch_factor": args.dataloader_prefetch_factor,
        **loader_options(args),
        "worker_init_fn": partial(
            seed_worker, num_workers=args.dataloader_num_workers, rank=args.process_index
        ),
    }
    if isinstance(dataset, torch.utils.data.IterableDataset):
        raise ValueError("balanced batches need a map-style train_dataset, not an IterableDataset")
    acc = self.accelerator
    # One process's loader: accelerate places batches on the device and synchronizes the RNGs, but
    # leaves the batches as they are (they are this rank's already).
    loader = prepare_data_loader(
        DataLoader(dataset, **params),
        acc.device,
        num_processes=1,
        process_index=0,
        split_batches=False,
        put_on_device=acc.device_placement,
        rng_types=list(acc.rng_types),
        dispatch_batches=False,
        even_batches=True,
        non_blocking=getattr(acc, "non_blocking", False),
        use_stateful_dataloader=getattr(acc, "use_stateful_dataloader", False),
    )
    return loader
