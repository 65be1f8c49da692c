"""One encoder's balanced step in a forward: read the items, agree, plan, move the inputs, encode,
move the outputs back (:func:`balance_encoder`).

1. the encoder's items are taken out of the forward's arguments (``Items``);
2. every rank's item sizes are all-gathered (one small collective, with the agreement step, so a
   bad input on one rank, or ranks that disagree on the forward's encoder options or grad mode,
   raise on every rank);
3. every rank computes the same plan (``plan.py``);
4. the inputs move with one all-to-all (``rebalance``), each rank encodes its share with one
   encoder call (a tiny stand-in item when its share is empty, so FSDP/DDP see the same calls on
   every rank), and the outputs return with one all-to-all along the inverse plan;
5. the outputs, back in their rank and order, go where the model expects its encoder's results
   (the adapter's ``restore``).
"""

from __future__ import annotations

import time

import numpy as np
import torch
from torch import Tensor

from mmbalance.collectives import rebalance
from mmbalance.collectives.agreement import Entry
from mmbalance.collectives.exchange.alltoall import gather_table
from mmbalance.collectives.group import world_of
from mmbalance.pyops import cu_seqlens_from_lengths

from .adapter import EncoderAdapter
from .plan import check_items, encoder_plan, item_costs

__all__ = ["EncoderStep", "balance_encoder"]


class EncoderStep:
    """What one balanced encoder call reports: ``stats`` (``before``/``after``/``moved``, see
    :func:`~.plan.encoder_plan`) and ``timings`` (``plan_ms``, ``move_in_ms``, ``encode_ms``,
    ``move_back_ms``); both ``None`` when no rank had an item."""

    def __init__(self, kwargs: dict, stats: dict | None = None, timings: dict | None = None):
        self.kwargs, self.stats, self.timings = kwargs, stats, timings


def _describe_cost(cost) -> str:
    return cost if isinstance(cost, str) else f"callable {getattr(cost, '__qualname__', '?')}"


def balance_encoder(model, adapter: EncoderAdapter, kwargs: dict, links: list[Tensor], *, group, cost,
                    ranks_per_node: int | None) -> EncoderStep:  # fmt: skip
    """Balance ``adapter``'s items of this forward over ``group`` and put the outputs back into
    ``kwargs``. ``links`` gets the tensors every rank's backward must reach (the returned outputs,
    a stand-in encoding)."""
    rank, world = world_of(group)
    t0 = time.perf_counter()
    items, options, mat = None, {}, None
    n_meta = len(adapter.meta_columns)
    with Entry(f"apply_encoder_balance[{adapter.encoder}]", group) as e:
        e.fields = {
            "adapter": type(adapter).__name__,
            "training": bool(model.training),
            "grad enabled": torch.is_grad_enabled(),
            "cost": _describe_cost(cost),
            "ranks_per_node": ranks_per_node,
            "split_frames": bool(adapter.splits_frames),
        }
        options = adapter.call_options(model, kwargs)
        e.fields["encoder options"] = repr(sorted(options.items()))
        try:
            items = adapter.extract(model, kwargs)
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"{adapter.encoder} inputs: {exc}") from exc
        if items is not None:
            check_items(adapter, items)
        mat = np.zeros((0, 1 + n_meta), dtype=np.int64)
        if items is not None and len(items):
            mat = np.concatenate([items.rows[:, None], items.meta], axis=1)
    table, src = gather_table(mat, group, entry=e)
    if table.shape[0] == 0:  # no rank has an item: the stock path, on every rank alike
        return EncoderStep(kwargs)
    rows_all, meta_all = table[:, 0], table[:, 1:]
    plan, stats = encoder_plan(
        item_costs(cost, model, adapter, meta_all, rows_all), src, world, ranks_per_node
    )

    # inputs to the encoder layout
    t1 = time.perf_counter()
    mine = items if items is not None and len(items) else None
    payload = mine.payload if mine is not None else adapter.empty_payload(model)
    in_rows = mine.rows if mine is not None else np.zeros(0, dtype=np.int64)
    device = payload[0].device
    moved, _ = rebalance(
        list(payload), cu_seqlens_from_lengths(in_rows, device=device), plan.with_lengths(rows_all), group
    )
    recv = plan.recv_order(rank)
    t2 = time.perf_counter()
    if recv.size:
        outputs = adapter.encode(model, moved, meta_all[recv], **options)
    else:  # nothing to encode here: a tiny item keeps the encoder calls equal on every rank
        d_payload, d_meta = adapter.dummy(model)
        dummy_out = adapter.encode(model, d_payload, d_meta, **options)
        links.extend(dummy_out)
        outputs = [t[:0] for t in dummy_out]
    # outputs back to their items' ranks and order
    t3 = time.perf_counter()
    out_rows_all = np.asarray(adapter.out_rows(model, meta_all, **options), dtype=np.int64)
    back_plan = plan.with_lengths(out_rows_all).inverse()
    back, _ = rebalance(
        outputs, cu_seqlens_from_lengths(out_rows_all[recv], device=outputs[0].device), back_plan, group
    )
    links.extend(back)
    t4 = time.perf_counter()
    timings = {
        "plan_ms": 1e3 * (t1 - t0),
        "move_in_ms": 1e3 * (t2 - t1),
        "encode_ms": 1e3 * (t3 - t2),
        "move_back_ms": 1e3 * (t4 - t3),
    }
    restored = kwargs if mine is None else adapter.restore(model, kwargs, mine, back)
    return EncoderStep(restored, stats, timings)
