"""The numpy side of dynamic context parallelism, shared by the text step (``step.py``), the
vision-language step (``vlm_step.py``, ``vlm_plan.py``) and the Trainer's data side
(``collate.py``): the planner's cost for a model (:func:`cost_model_of`), one step's plan
(:func:`plan_layout`: CP groups under the token budget, each sequence cut into the zigzag chunks of
its group's ranks; :func:`layout_fits`, whether a slot of examples has one), a rank's shard of a plan (:func:`shard_of`) and the step's statistics
(:func:`step_stats`). No communication happens here.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from mmbalance.balancing import CostModel, Plan, cp_schedule, imbalance, post_balance
from mmbalance.balancing.cp_schedule import CPGroup
from mmbalance.collectives import RankMismatchError
from mmbalance.collectives.ring.plan import ring_plan

from .inputs import ffn_size, layer_mix, linear_state, text_config
from .shard import CPShard

__all__ = [
    "Layout",
    "cost_key",
    "cost_model_of",
    "labels_of",
    "layout_fits",
    "pieces",
    "plan_layout",
    "shard_of",
    "step_stats",
]


# ------------------------------------------------------------------------------------ the cost
def cost_model_of(model, cost) -> CostModel | Callable:
    """The planner's cost for ``cost``: ``"quadratic"`` (a transformer of the model's text shape,
    :meth:`CostModel.transformer`: linear + causal attention + ring terms, the quadratic and ring
    terms only for its softmax-attention layers: ``inputs.layer_mix``), ``"linear"``
    (tokens), a :class:`CostModel`, or a callable as :func:`~mmbalance.balancing.cp_schedule`
    takes it."""
    if isinstance(cost, CostModel) or (callable(cost) and not isinstance(cost, str)):
        return cost
    if cost == "linear":
        return CostModel(linear=1.0)
    if cost != "quadratic":
        raise ValueError(f"cost must be 'quadratic', 'linear', a CostModel or a callable, got {cost!r}")
    text = text_config(model)
    h = int(getattr(text, "hidden_size", 4096) or 4096)
    heads = int(getattr(text, "num_attention_heads", 32) or 32)
    head_dim = int(getattr(text, "head_dim", None) or h // heads)
    kv = int(getattr(text, "num_key_value_heads", heads) or heads) * head_dim
    ffn = ffn_size(text)
    layers, attention = layer_mix(text)  # a hybrid's linear-attention layers cost linearly
    return CostModel.transformer(
        hidden_size=h,
        num_layers=layers,
        kv_size=kv,
        ffn_size=round(ffn) if ffn else None,
        attention_layers=attention,
        linear_state=linear_state(text),
    )


def cost_key(cost) -> str:
    if isinstance(cost, CostModel):
        return repr(cost)
    return f"callable {getattr(cost, '__qualname__', type(cost).__name__)}"


# ------------------------------------------------------------------------------------ the plan
@dataclass(frozen=True)
class Layout:
    """One step's plan: the schedule, and the pieces (zigzag chunks) that move."""

    schedule: list  # CPGroup list
    group_of_rank: np.ndarray  # [world] group index of every rank, -1 idle
    rank_in_group: np.ndarray  # [world]
    piece_len: np.ndarray
    piece_src: np.ndarray
    piece_dst: np.ndarray
    shard_tokens: np.ndarray  # [world]
    plan_s: float


def pieces(lengths: np.ndarray, src: np.ndarray, schedule, world: int):
    """Every sequence cut into the zigzag chunks of its group's ranks, in (sequence, offset) order:
    ``(length, source rank, destination rank)`` per non-empty piece, and tokens per rank."""
    n = lengths.size
    seq_ids, offsets, lens, dsts = [], [], [], []
    tokens = np.zeros(world, dtype=np.int64)
    for g in schedule:
        members = np.asarray(g.sequences, dtype=np.int64)
        if members.size == 0:
            continue
        cu = np.concatenate([[0], np.cumsum(lengths[members])])
        rp = ring_plan(cu, g.degree, "zigzag")
        for j, rank in enumerate(g.ranks):
            start0, len0, start1 = rp.runs[j, :, 0], rp.runs[j, :, 1], rp.runs[j, :, 2]
            len1 = rp.local_lengths[j] - len0
            for st, ln in ((start0, len0), (start1, len1)):
                keep = ln > 0
                seq_ids.append(members[keep])
                offsets.append(st[keep].astype(np.int64))
                lens.append(ln[keep].astype(np.int64))
                dsts.append(np.full(int(keep.sum()), rank, dtype=np.int64))
            tokens[rank] = rp.tokens[j]
    if not seq_ids:
        z = np.zeros(0, dtype=np.int64)
        return z, z, z, tokens
    seq = np.concatenate(seq_ids)
    off = np.concatenate(offsets)
    order = np.lexsort((off, seq))
    if (
        seq.size
        and np.bincount(seq, weights=np.concatenate(lens), minlength=n).astype(np.int64).tolist()
        != lengths.tolist()
    ):
        raise AssertionError("the pieces do not cover every sequence once")  # a planner bug, never input
    return np.concatenate(lens)[order], src[seq[order]], np.concatenate(dsts)[order], tokens


def plan_layout(lengths: np.ndarray, src: np.ndarray, world: int, budget: int | None, cost,
                context_parallel: bool = True, encoder_seconds: np.ndarray | None = None) -> Layout:  # fmt: skip
    """The schedule under ``budget`` tokens per rank, zigzag rounding included (re-planned with a
    smaller nominal budget until every real shard fits). Identical on every rank.
    ``encoder_seconds``: per sequence, the encoder seconds its group's members share
    (:func:`~mmbalance.balancing.cp_schedule`'s argument), or ``None``.

    ``context_parallel=False``: degree 1 everywhere, every sequence whole on one rank
    (OrchMLLM's post-balancing of the LLM phase, :func:`~mmbalance.balancing.post_balance` with
    the cost's linear and attention terms); ``budget`` may then be ``None`` (no limit).
    """
    t0 = time.perf_counter()
    if not context_parallel:
        return _degree_one(lengths, src, world, budget, cost, t0)
    assert budget is not None
    longest = int(lengths.max(initial=0))
    if longest > world * budget:
        raise ValueError(
            f"max_tokens_per_rank={budget}: a sequence of {longest} tokens does not fit the {world} ranks "
            f"together ({world * budget} tokens); raise max_tokens_per_rank or drop the sequence"
        )
    if int(lengths.sum()) > world * budget:
        raise ValueError(
            f"max_tokens_per_rank={budget}: the step's {int(lengths.sum())} tokens do not fit the {world} ranks "
            f"together ({world * budget} tokens); draw fewer examples per rank or raise max_tokens_per_rank"
        )
    nominal = budget
    for _ in range(16):
        try:
            schedule = (
                cp_schedule(lengths, world, nominal, cost, encoder_seconds=encoder_seconds)
                if lengths.size
                else []
            )
        except ValueError as exc:
            raise ValueError(
                f"max_tokens_per_rank={budget}: no CP schedule of the step's {lengths.size} sequences fits "
                f"({exc})"
            ) from None
        plen, psrc, pdst, tokens = pieces(lengths, src, schedule, world)
        over = int(tokens.max(initial=0)) - budget
        if over <= 0:
            break
        nominal -= max(over, 1)
        if nominal < 1:
            break
    else:
        over = 1
    if over > 0:
        raise ValueError(
            f"max_tokens_per_rank={budget}: zigzag shards of the step's sequences do not fit (the busiest rank "
            f"would hold {budget + over} tokens)"
        )
    return _finish(list(schedule), lengths, src, world, t0, (plen, psrc, pdst, tokens))


def layout_fits(tokens: np.ndarray, src: np.ndarray, world: int, budget: int, cost,
                keep: dict | None = None) -> Callable[[np.ndarray], bool]:  # fmt: skip
    """A slot predicate for :func:`~.slots.plan_slots`: whether the examples ``members`` (indices
    into ``tokens``/``src``) can be laid out by :func:`plan_layout` under ``budget`` tokens per
    rank. ``keep``: a dict that receives each fitting slot's :class:`Layout` under
    ``tuple(members)``."""

    def fits(members: np.ndarray) -> bool:
        try:
            lay = plan_layout(tokens[members], src[members], world, budget, cost)
        except ValueError:
            return False
        if keep is not None:
            keep[tuple(members.tolist())] = lay
        return True

    return fits


def _finish(schedule: list, lengths, src, world: int, t0: float, cut=None) -> Layout:
    plen, psrc, pdst, tokens = pieces(lengths, src, schedule, world) if cut is None else cut
    group_of = np.full(world, -1, dtype=np.int64)
    rank_in = np.zeros(world, dtype=np.int64)
    for gi, g in enumerate(schedule):
        for j, r in enumerate(g.ranks):
            group_of[r], rank_in[r] = gi, j
    return Layout(schedule, group_of, rank_in, plen, psrc, pdst, tokens, time.perf_counter() - t0)


def _degree_one(lengths, src, world: int, budget: int | None, cost, t0: float) -> Layout:
    """Every sequence whole on one rank, the ranks' costs balanced (post-balancing)."""
    if isinstance(cost, CostModel):
        alpha, beta = float(cost.linear), float(cost.attention * (1.0 + cost.eta))
    else:
        alpha, beta = 1.0, 0.0
    policy = "quadratic" if beta > 0 else "sum"
    plan = post_balance(lengths, world, policy, src_ranks=src, alpha=alpha, beta=beta if beta > 0 else None)
    groups = []
    for r in range(world):
        members = np.flatnonzero(plan.dst_rank == r).astype(np.int64)
        if members.size:
            t = cost.time(lengths[members]) if isinstance(cost, CostModel) else float(lengths[members].sum())
            groups.append(CPGroup(1, (r,), members, float(t)))
    lay = _finish(groups, lengths, src, world, t0)
    if budget is not None and int(lay.shard_tokens.max(initial=0)) > budget:
        raise ValueError(
            f"max_tokens_per_rank={budget}: whole sequences do not fit (the busiest rank would hold "
            f"{int(lay.shard_tokens.max())} tokens); switch context parallelism on"
        )
    return lay


def shard_of(layout: Layout, lengths: np.ndarray, rank: int, groups: dict, tokens: int) -> CPShard | None:
    """The :class:`CPShard` of ``rank`` under ``layout`` (``tokens`` received), or ``None`` for a
    rank the plan leaves idle."""
    gi = int(layout.group_of_rank[rank])
    if gi < 0 or tokens == 0:
        return None
    g = layout.schedule[gi]
    members = np.asarray(g.sequences, dtype=np.int64)
    gcu = np.concatenate([[0], np.cumsum(lengths[members])]).astype(np.int64)
    if g.degree == 1:
        local = torch.from_numpy(gcu.astype(np.int32))
        return CPShard(1, 0, None, gcu, tokens, local, int(lengths[members].max()))
    return CPShard(g.degree, int(layout.rank_in_group[rank]), groups[gi], gcu, tokens)


def step_stats(cost, lengths: np.ndarray, src: np.ndarray, labelled: np.ndarray, layout: Layout, world: int,
               plan: Plan, before: np.ndarray | None = None, after: np.ndarray | None = None) -> dict:  # fmt: skip
    """A step's statistics (``handle.stats``); ``before``/``after`` (modelled time per rank as
    sampled and as planned) are computed here under ``cost`` unless given."""
    if before is None:
        before = np.zeros(world)
        if isinstance(cost, CostModel):
            for r in range(world):
                before[r] = cost.time(lengths[src == r]) if (src == r).any() else 0.0
    if after is None:
        after = np.zeros(world)
        for g in layout.schedule:
            for r in g.ranks:
                after[r] = float(g.time)
    return {
        "degrees": [int(g.degree) for g in layout.schedule],
        "largest_shard": int(layout.shard_tokens.max(initial=0)),
        "before": imbalance(before),
        "after": imbalance(after),
        "max_before": float(before.max(initial=0.0)),
        "mean_before": float(before.mean()) if world else 0.0,
        "max_after": float(after.max(initial=0.0)),
        "mean_after": float(after.mean()) if world else 0.0,
        "moved_tokens": int(plan.moved_tokens()),
        "plan_ms": 1e3 * layout.plan_s,
        "sequences": int(lengths.size),
        "num_items_in_batch": int(labelled.sum()),
    }


def labels_of(flags: np.ndarray, src: np.ndarray, default: bool = False) -> bool:
    """Whether the step has labels, from every gathered sequence's flag (its rank passed
    ``labels``); ``default`` (this rank's batch) when no rank has a sequence. A rank without
    sequences has nothing to score and may leave them out; ranks with sequences must agree. Raises :class:`~mmbalance.collectives.RankMismatchError` (a
    ValueError; on every rank alike: the table is the same) naming the ranks otherwise."""
    flags = np.asarray(flags, dtype=bool)
    if not flags.size:
        return bool(default)
    if flags.all() or not flags.any():
        return bool(flags.all())
    with_labels = sorted(set(np.asarray(src)[flags].tolist()))
    without = sorted(set(np.asarray(src)[~flags].tolist()))
    raise RankMismatchError(
        f"apply_dynamic_cp.shard refused on every rank, nothing was moved: batch['labels'] is passed by ranks "
        f"{with_labels} but not by ranks {without}, which pass sequences; every rank that passes sequences must "
        "pass the same keys (a rank with none may leave labels out)"
    )
