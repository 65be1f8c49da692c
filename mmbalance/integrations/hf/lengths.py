"""What a trainer's dataset holds, read before training: the tokens of every example
(:func:`dataset_lengths`) or of every preference pair (:func:`pair_lengths`), and whether the
trainer's collator packs (:func:`collator_packs`). :func:`~.trainer.balance_trainer` prices the
examples with them when it is given no ``lengths``."""

from __future__ import annotations

import numpy as np

__all__ = ["collator_packs", "dataset_lengths", "pair_lengths"]


def dataset_lengths(trainer, dataset) -> np.ndarray:
    """``args.length_column_name`` of a ``datasets.Dataset``, else ``len(input_ids)`` of every item."""
    column = trainer.args.length_column_name
    names = getattr(dataset, "column_names", None)
    if names is not None and column in names:
        return np.asarray(dataset[column])
    key = "input_ids"
    processing = getattr(trainer, "processing_class", None)
    if processing is not None and getattr(processing, "model_input_names", None):
        key = processing.model_input_names[0]
    if names is not None and key in names:
        return np.asarray([len(x) for x in dataset[key]], dtype=np.int64)
    out = np.empty(len(dataset), dtype=np.int64)
    for i in range(len(dataset)):
        item = dataset[i]
        if not hasattr(item, "keys") or key not in item:
            raise ValueError(
                f"lengths: the dataset has no {column!r} column (args.length_column_name) and item {i} has no "
                f"{key!r} to measure; pass lengths= (one per example)"
            )
        out[i] = len(item[key])
    return out


def pair_lengths(trainer, dataset, padded: bool) -> np.ndarray:
    """Tokens of every preference pair of ``dataset``: its longer row (prompt and chosen, prompt and
    rejected) where the collator pads, both rows' tokens where it packs. Read from the trainer's
    token columns (TRL's ``prompt_ids`` / ``chosen_ids`` / ``rejected_ids``, earlier TRL's
    ``prompt_input_ids`` / ``chosen_input_ids`` / ``rejected_input_ids``, LLaMA-Factory's whole
    ``chosen_input_ids`` / ``rejected_input_ids``), cut at ``args.max_length``; else (a dataset
    of texts and images, which the collator tokenizes: TRL's vision DPO) measured by the trainer's
    own collator, a chunk of pairs at a time (its ``attention_mask`` rows: the chosen rows, then
    the rejected ones), image tokens included."""
    names = set(getattr(dataset, "column_names", None) or [])

    def column(*keys):
        for key in keys:
            if key in names:
                return [len(x) for x in dataset[key]]
        return None

    chosen = column("chosen_ids", "chosen_input_ids")
    rejected = column("rejected_ids", "rejected_input_ids")
    if chosen is not None and rejected is not None:
        prompt = column("prompt_ids", "prompt_input_ids") or [0] * len(chosen)
        rows = np.asarray([chosen, rejected], dtype=np.int64) + np.asarray(prompt, dtype=np.int64)
        cap = getattr(trainer.args, "max_length", None)
        if isinstance(cap, int) and cap > 0:
            rows = np.minimum(rows, cap)
    else:
        rows = _measured_by_collator(trainer, dataset)
    return rows.max(axis=0) if padded else rows.sum(axis=0)


def _measured_by_collator(trainer, dataset, chunk: int = 32) -> np.ndarray:
    """``[2, n]`` tokens of the chosen and the rejected row of every pair, as the trainer's
    collator makes them (its ``attention_mask``: ``2k`` rows for ``k`` pairs, chosen first)."""
    import copy

    collate, n = trainer.data_collator, len(dataset)
    out = np.empty((2, n), dtype=np.int64)
    for start in range(0, n, chunk):
        items = [copy.deepcopy(dataset[i]) for i in range(start, min(n, start + chunk))]
        batch = collate(items)
        mask = batch.get("attention_mask") if hasattr(batch, "get") else None
        if mask is None or mask.dim() != 2 or mask.shape[0] != 2 * len(items):
            raise ValueError(
                f"lengths: {type(trainer).__name__}'s collator gave no attention_mask of chosen and rejected rows "
                f"for {len(items)} pairs (and the dataset has no chosen_ids / rejected_ids columns); pass "
                "lengths= (tokens per pair)"
            )
        counts = mask.sum(dim=1).cpu().numpy().astype(np.int64)
        out[0, start : start + len(items)] = counts[: len(items)]
        out[1, start : start + len(items)] = counts[len(items) :]
    return out


def collator_packs(trainer) -> bool:
    """Whether the collator packs (no padding): transformers' DataCollatorWithFlattening or TRL's
    ``padding_free`` / ``packing`` arguments."""
    from transformers import DataCollatorWithFlattening

    if isinstance(trainer.data_collator, DataCollatorWithFlattening):
        return True
    args = trainer.args
    return bool(getattr(args, "padding_free", False) or getattr(args, "packing", False))
