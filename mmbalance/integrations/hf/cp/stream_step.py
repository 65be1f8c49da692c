"""A stream's micro-batches, post-balanced, in whole optimizer steps: what
:meth:`~.handle.DynamicCPHandle.batches` runs.

Every rank draws from its own loader; the ranks agree on the end of the stream with one small
all-reduce per draw (a rank whose loader ends first takes part with empty batches), and every pass
over the stream yields a multiple of ``grad_accum`` micro-batches: a last, partial step is filled
with micro-batches in which every rank is idle (one stand-in token, no label), so its gradient is
that of a shorter final step, as Trainer takes one at the end of a sized loader. A pass therefore
always ends in an optimizer step; Trainer without a length would otherwise carry a partial step's
gradients into the next pass, or never step at all on a stream shorter than one step.

With a budget and context parallelism, and a loader of raw examples (``collate`` given), a step's
micro-batch slots are formed under ``max_tokens_per_rank`` first (:func:`~.slots.plan_slots` on
the gathered example lengths, the same on every rank), then each rank collates its examples of
each slot: a step whose examples fit together is never refused for how the loader cut them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping

import numpy as np
import torch
import torch.distributed as dist

from mmbalance.collectives.agreement import Entry
from mmbalance.collectives.exchange.alltoall import gather_table
from mmbalance.collectives.inflight import any_rank

from .plan import layout_fits
from .slots import plan_slots

__all__ = ["example_tokens", "raw_rows", "stream_steps"]


def _guarded(what: str, fn: Callable, *args):
    """``fn(*args)``, with any exception of it as a ValueError naming ``what`` (inside an ``Entry``
    it is then this rank's problem, raised on every rank, not an exception of this rank alone)."""
    try:
        return fn(*args)
    except (TypeError, ValueError):
        raise
    except Exception as exc:  # noqa: BLE001 - whatever a user's collator raises
        raise ValueError(f"{what} failed: {exc!r}") from exc


def raw_rows(rows: list) -> list:
    """A ``DataLoader``'s ``collate_fn`` that keeps the drawn examples as they are (picklable)."""
    return list(rows)


def example_tokens(example, collate: Callable) -> int:
    """An example's language-model tokens: ``len(input_ids)`` where it has them, else those of the
    collator's batch of it alone (its attention mask, or every ``input_ids`` token)."""
    if isinstance(example, Mapping) and example.get("input_ids") is not None:
        return int(len(example["input_ids"]))
    batch = collate([example])
    mask = batch.get("attention_mask")
    if mask is not None:
        return int(torch.as_tensor(mask).sum())
    return int(torch.as_tensor(batch["input_ids"]).numel())


def _more(handle, local: bool, labels: bool) -> tuple[bool, bool]:
    """Whether any rank still draws, and whether any rank's stream has labels (one small
    all-reduce): every rank then builds its idle micro-batches with the same keys."""
    if handle.own is None:
        return local, labels
    more, any_labels = any_rank([local, labels], handle.own)
    return more, any_labels


def _empty(labels: bool) -> dict:
    batch = {"input_ids": torch.zeros((1, 0), dtype=torch.int64)}
    if labels:
        batch["labels"] = torch.zeros((1, 0), dtype=torch.int64)
    return batch


def stream_steps(
    handle, loader: Iterable, grad_accum: int = 1, collate: Callable | None = None
) -> Iterator[dict]:
    """``handle.shard`` of every micro-batch of ``loader``, ``grad_accum`` to an optimizer step, until
    every rank's loader has ended (see the module docstring). ``collate``: ``loader`` yields lists
    of raw examples, and each step's slots are formed under the budget before collating."""
    if collate is not None and handle.own is not None and handle.context_parallel:
        yield from _slotted(handle, loader, grad_accum, collate)
        return
    it = iter(loader)
    drawn = count = 0
    labels = False  # whether this rank's stream has labels (the last batch it drew)
    while True:
        got = next(it, None)
        batch = None
        if got is not None:
            batch = _collated(got, collate)
            labels = batch.get("labels") is not None
        more, any_labels = _more(handle, batch is not None, labels)
        if not more:
            break
        if batch is None:
            batch = _empty(any_labels)
        kw = handle.shard(batch)
        drawn += int(handle.stats.get("local_sequences", 0))
        handle.stats["drawn"] = drawn
        count += 1
        yield kw
    for _ in range(-count % grad_accum):  # the last step, completed with idle micro-batches
        kw = handle.shard(_empty(any_labels))
        handle.stats["drawn"] = drawn
        yield kw


def _collated(got, collate: Callable | None) -> dict:
    """A drawn batch, through ``collate`` where the loader yields raw examples."""
    return got if collate is None else collate(got)


def _tokens_of(rows: list, collate: Callable) -> np.ndarray:
    """int64 ``[n, 1]``: every drawn example's tokens."""
    return np.asarray([[example_tokens(r, collate)] for r in rows], dtype=np.int64).reshape(-1, 1)


def _collate_slots(picked: list[list], collate: Callable) -> list:
    """Each slot's examples collated (``None`` for a slot of none)."""
    return [collate(m) if m else None for m in picked]


def _slotted(handle, loader: Iterable, grad_accum: int, collate: Callable) -> Iterator[dict]:
    """Whole steps of raw examples, their slots formed under the budget."""
    it = iter(loader)
    world = dist.get_world_size(handle.own)
    budget = handle.max_tokens_per_rank
    drawn = step = 0
    labels = False
    while True:
        rows: list = []
        for _ in range(grad_accum):
            got = next(it, None)
            if got is None:
                break
            rows.extend(got)
        more, any_labels = _more(handle, bool(rows), labels)
        if not more:
            return
        mine: np.ndarray | None = None
        with Entry("apply_dynamic_cp.batches", handle.own) as e:
            e.fields = {"grad_accum": grad_accum, "max_tokens_per_rank": budget}
            mine = _guarded("the stream's examples", _tokens_of, rows, collate)
        table, src = gather_table(mine, handle.own, entry=e)
        tokens = table[:, 0]
        fits = layout_fits(tokens, src, world, budget, handle.cost)
        found = plan_slots(tokens, tokens.astype(np.float64) ** 2, grad_accum, world * budget, fits)
        if found.slots is None:
            raise ValueError(
                f"streamed step {step}: no split of its {tokens.size} examples ({int(tokens.sum())} tokens, the "
                f"longest {int(tokens.max(initial=0))}) into {grad_accum} micro-batches fits {world} x "
                f"max_tokens_per_rank={budget} = {world * budget} tokens each"
                + (f" (the search stopped after {found.nodes} tries)" if found.exhausted else "")
                + "; raise max_tokens_per_rank or gradient_accumulation_steps, or draw fewer examples per rank"
            )
        slot_of_mine = found.slots[src == dist.get_rank(handle.own)]
        picked = [[r for r, s in zip(rows, slot_of_mine.tolist()) if s == k] for k in range(grad_accum)]
        batches: list[dict] = []
        with Entry("apply_dynamic_cp.batches collate", handle.own) as e:  # one rank's failure on every rank
            batches = _guarded("the collator", _collate_slots, picked, collate)
            mine_labelled = [b.get("labels") is not None for b in batches if b is not None]
            labels = mine_labelled[-1] if mine_labelled else labels
            e.values = [int(labels)]
        any_labels = any_labels or bool(e.agree().any(0))  # the keys of the idle slots, alike everywhere
        for k, batch in enumerate(batches):
            kw = handle.shard(batch if batch is not None else _empty(any_labels))
            drawn += len(picked[k])
            handle.stats["drawn"] = drawn
            yield kw
        step += 1
