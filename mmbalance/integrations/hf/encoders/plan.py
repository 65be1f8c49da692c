"""The numpy side of encoder balancing: what every item costs, and the plan over the ranks.

Every rank computes the same plan from the gathered item table: a locality-aware post-balancing
of the items' encoder costs (``post_balance(costs, ranks, "sum", src_ranks=...)``: items stay home
unless balance needs the move, moved items prefer node-mates). No communication happens here.
"""

from __future__ import annotations

import numpy as np

from mmbalance.balancing import Plan, imbalance, post_balance

from .adapter import EncoderAdapter, Items

__all__ = ["check_items", "encoder_plan", "item_costs"]

_COST_UNITS = 1e9  # the largest item cost, in the integer units the planner balances


def item_costs(cost, model, adapter: EncoderAdapter, meta: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """The cost of every item of ``adapter`` in the gathered table (float64 ``[n]``) under
    ``apply_encoder_balance``'s ``cost``: ``"auto"`` (the adapter's model), ``"rows"``, ``"items"``
    or a callable ``cost(encoder, meta, rows)``."""
    if callable(cost):
        costs = np.asarray(cost(adapter.encoder, meta, rows), dtype=np.float64).reshape(-1)
    elif cost == "rows":
        costs = rows.astype(np.float64)
    elif cost == "items":
        costs = np.ones(rows.size)
    else:
        costs = np.asarray(adapter.cost(model, meta, rows), dtype=np.float64).reshape(-1)
    if costs.shape != rows.shape or not np.all(np.isfinite(costs)) or np.any(costs < 0):
        raise ValueError(f"cost for {adapter.encoder} must give one finite cost >= 0 per item, got {costs!r}")
    return costs


def encoder_plan(
    costs: np.ndarray, src: np.ndarray, world: int, ranks_per_node: int | None
) -> tuple[Plan, dict]:
    """The plan that balances ``costs`` (items gathered from ranks ``src``) over ``world`` ranks, and
    its statistics: max/mean of the per-rank cost ``before`` and ``after``, and the fraction of
    items ``moved``."""
    units = np.maximum(1, np.rint(costs * (_COST_UNITS / max(float(costs.max()), 1e-300)))).astype(np.int64)
    plan = post_balance(units, world, "sum", src_ranks=src, ranks_per_node=ranks_per_node)
    stats = {
        "before": imbalance(np.bincount(src, weights=costs, minlength=world)),
        "after": imbalance(np.bincount(plan.dst_rank, weights=costs, minlength=world)),
        "moved": float(np.mean(src != plan.dst_rank)),
    }
    return plan, stats


def check_items(adapter: EncoderAdapter, items: Items) -> None:
    """What an adapter's ``extract`` gave is consistent: its metadata columns and payload rows."""
    if items.meta.shape[1] != len(adapter.meta_columns):
        raise ValueError(
            f"{type(adapter).__name__}.extract gave {items.meta.shape[1]} metadata columns, "
            f"meta_columns names {len(adapter.meta_columns)}"
        )
    total = int(items.rows.sum())
    for k, t in enumerate(items.payload):
        if t.shape[0] != total:
            raise ValueError(f"payload[{k}] has {t.shape[0]} rows, the items {total}")
