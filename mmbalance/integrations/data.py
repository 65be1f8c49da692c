"""Balancing on the data side: per-rank batches planned from lengths alone, no communication.

:class:`BalancedBatchSampler` is a drop-in batch sampler for any trainer's ``DataLoader``: every
rank draws the same seeded shuffle (as ``DistributedSampler`` does), takes the next
``batch_size * num_replicas * grad_accum`` examples each optimizer step, and splits them into
``grad_accum`` micro-batches per rank, balanced in cost slot by slot (ranks synchronize at every
micro-batch). Every rank computes the same split independently, so nothing is exchanged; the
examples are assigned before loading, so nothing moves either.
"""

from __future__ import annotations

import math
import numbers
import time
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.data import Sampler

from mmbalance.balancing import CostModel
from mmbalance.balancing.accum import batch_costs_of, plan_equal_counts, plan_micro_batches, sampled_costs
from mmbalance.balancing.plan import DEFAULT_BETA
from mmbalance.balancing.post_balance import check_cost_range
from mmbalance.balancing.validate import as_coefficient, as_count, as_lengths

__all__ = ["BalancedBatchSampler", "EpochPlan"]


@dataclass(frozen=True)
class EpochPlan:
    """The plan of every rank for one epoch (what every rank's sampler computes).

    Attributes:
        indices: int64 ``[steps, n]``: the dataset indices of each optimizer step, in sampling order
            (``n = batch_size * num_replicas * grad_accum``).
        rank: int64 ``[steps, n]``: the rank each of them goes to.
        micro: int64 ``[steps, n]``: the micro-batch (gradient-accumulation slot, ``0..G-1``) it is in.
        costs: float64 ``[steps, G, num_replicas]``: the cost of every rank's micro-batch of every slot.
    """

    indices: np.ndarray
    rank: np.ndarray
    micro: np.ndarray
    costs: np.ndarray

    @property
    def step_times(self) -> np.ndarray:
        """float64 ``[steps]``: the modelled time of each step, the sum over its micro-batch slots of
        the slowest rank's micro-batch (ranks wait for each other at every micro-batch)."""
        return self.costs.max(axis=2).sum(axis=1)


class BalancedBatchSampler(Sampler[list[int]]):
    """Per-rank micro-batches of dataset indices, balanced in the cost of what each rank processes.

    Args:
        lengths: tokens per example: a sequence of ints ``[n]``, or a 2-D array ``[n, phases]``
            with one column per phase (e.g. vision patches, audio frames, LLM tokens) and the LLM
            tokens last. The last column is balanced; :attr:`stats` reports every column.
        batch_size: examples per rank per micro-batch *on average*: each optimizer step takes
            ``batch_size * num_replicas * grad_accum`` examples and splits them by cost, so a
            micro-batch may hold more or fewer.
        num_replicas, rank: the data-parallel size and this rank (default: from
            ``torch.distributed``).
        cost: ``"sum"`` (tokens), ``"quadratic"`` (``alpha * l + beta * l**2``: linear layers
            plus attention), or a fitted :class:`~mmbalance.balancing.CostModel` (a padded one
            turns ``padding`` on).
        shuffle, seed: a permutation seeded by ``(seed, epoch)``, the same on every rank; call
            :meth:`set_epoch` at the start of every epoch.
        order: where each epoch's draw comes from instead: a callable ``order(epoch)`` giving the
            dataset indices of the whole epoch in sampling order (the steps are its consecutive
            ``batch_size * num_replicas * grad_accum`` indices; at least one step of them; the
            same on every rank). Used to keep another sampler's draw (a trainer's own loader):
            every step then holds the examples it would have held, and only their split changes.
        drop_last: drop the tail that does not fill a whole step (a dataset smaller than one step
            is then an error, not an empty epoch); otherwise pad it with examples from the start
            of the permutation, as ``DistributedSampler`` does.
        alpha, beta: coefficients of ``"quadratic"`` (default ``beta``: the attention-to-linear
            FLOP ratio of a 4096-wide transformer, :data:`~mmbalance.balancing.DEFAULT_BETA`).
        grad_accum: micro-batches per rank per optimizer step (``G``). Every micro-batch slot is
            balanced across ranks (the k-th micro-batch of every rank costs about the same), and so
            are the step's per-rank totals. ``len(sampler)`` counts micro-batches.
        padding: the collator pads each micro-batch to its longest example, so a micro-batch costs
            ``examples * h(longest)`` with ``h(l) = l`` (``"sum"``) or ``alpha * l + beta * l**2``
            (``"quadratic"``); without it (packed, varlen attention) a micro-batch costs the sum of
            its examples' costs.
        equal_counts: every micro-batch holds exactly ``batch_size`` examples, as without
            balancing, and only which examples go together changes (for a loss that is a mean over
            each micro-batch's units, such as DPO's pairs: the mean stays the step's mean).
            Planned by :func:`~mmbalance.balancing.accum.plan_equal_counts`; a step is dealt as
            sampled where that plan would be worse, so the stats are never worse than the draw.

    How the split works (per step, from the longest examples down): while the longest example left
    outweighs an even share of what is left, the next slot is filled on every rank up to that
    example's cost; the rest is split into micro-batches of even cost (packed: LPT and a move/swap
    search; padded: the exact min-max split of the length order), the costliest ``num_replicas``
    of them forming one slot, and so on. In each slot the costliest micro-batch goes to the rank
    with the least total so far. No micro-batch is empty when the step has at least
    ``num_replicas * grad_accum`` examples. Planning costs microseconds for small steps and about
    a millisecond for steps of thousands of examples, done for the whole epoch when iteration
    starts.

    Memory per micro-batch: micro-batches are sized by cost, not by count. Each stays near its
    slot's level, an even share of the cost the step has left or the costliest remaining example
    where that is larger (packed: at most that level plus one example's cost; padded: at most the
    least that any split of those examples into that many micro-batches allows). The tokens a
    micro-batch holds (padded: ``examples * longest``; packed: the sum of its lengths) are at most
    its cost over ``alpha``. So a micro-batch of short examples may hold many more than
    ``batch_size`` examples and one with a long example fewer; size activation memory for about the
    step's tokens over ``num_replicas * grad_accum`` (or the longest example, where that is more),
    not for ``batch_size`` examples of the longest length.

    Per-rank batch sizes differ (that is the balancing). Normalize the loss by the *global* count
    of loss tokens of the step (summed over ranks and micro-batches; in transformers' Trainer,
    ``num_items_in_batch`` with ``average_tokens_across_devices=True``), not by a per-rank mean: a
    per-rank mean would weight every token by the size of the batch it landed in, and the result
    would depend on the split.

    Every rank yields a list of indices per micro-batch, the same number on every rank
    (``len(sampler)``), ``grad_accum`` consecutive ones per optimizer step; over an epoch every
    example is yielded exactly once (plus the padding repeats with ``drop_last=False``). Use it as
    ``DataLoader(dataset, batch_sampler=sampler, collate_fn=...)``.
    """

    def __init__(
        self,
        lengths,
        batch_size: int,
        num_replicas: int | None = None,
        rank: int | None = None,
        *,
        cost="quadratic",
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        alpha: float = 1.0,
        beta: float = DEFAULT_BETA,
        grad_accum: int = 1,
        padding: bool = False,
        order=None,
        equal_counts: bool = False,
    ) -> None:
        table = np.asarray(lengths.detach().cpu().numpy() if isinstance(lengths, torch.Tensor) else lengths)
        if table.ndim == 2:
            if table.shape[1] == 0:
                raise ValueError("lengths must have at least one column")
            cols = [as_lengths(table[:, j], f"lengths[:, {j}]") for j in range(table.shape[1])]
            self.table = np.stack(cols, axis=1)
        else:
            self.table = as_lengths(table, "lengths")[:, None]
        self.batch_size = as_count(batch_size, "batch_size")
        self.grad_accum = as_count(grad_accum, "grad_accum")
        if not isinstance(padding, (bool, np.bool_)):
            raise TypeError(f"padding must be a bool, got {type(padding).__name__}")
        if num_replicas is None or rank is None:
            import torch.distributed as dist

            if not (dist.is_available() and dist.is_initialized()):
                raise ValueError("num_replicas and rank are needed when torch.distributed is not initialized")
            num_replicas = dist.get_world_size() if num_replicas is None else num_replicas
            rank = dist.get_rank() if rank is None else rank
        self.num_replicas = as_count(num_replicas, "num_replicas")
        self.rank = as_count(rank, "rank", minimum=0, maximum=self.num_replicas - 1)
        self.policy, self.alpha, self.beta = _sampler_policy(cost, alpha, beta, bool(padding))
        self.padding = self.policy in ("padded", "padded_quadratic")
        if not isinstance(equal_counts, (bool, np.bool_)):
            raise TypeError(f"equal_counts must be a bool, got {type(equal_counts).__name__}")
        self.equal_counts = bool(equal_counts)
        check_cost_range(self.table[:, -1], self.policy, self.alpha, self.beta)
        if order is not None and not callable(order):
            raise TypeError(
                f"order must be callable (epoch -> dataset indices) or None, got {type(order).__name__}"
            )
        self.order = order
        self.shuffle = bool(shuffle)
        if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or seed < 0:
            raise ValueError(f"seed must be an int >= 0, got {seed!r}")
        self.seed: int = int(seed)
        self.drop_last = bool(drop_last)
        self.epoch: int = 0
        n = self.table.shape[0]
        step = self.step_size
        if self.drop_last and n < step:
            raise ValueError(
                f"drop_last=True and the dataset ({n} examples) is smaller than one optimizer step "
                f"(batch_size {self.batch_size} x num_replicas {self.num_replicas} x grad_accum "
                f"{self.grad_accum} = {step}): the epoch would be empty"
            )
        self.num_steps: int = n // step if self.drop_last else math.ceil(n / step)
        #: with ``order``: the micro-batches of every rank in a last, partial step of the draw,
        #: dealt as drawn (``[rank][micro-batch] -> indices``; empty without one)
        self.tail: list[list[list[int]]] = []
        if order is not None and getattr(order, "steps", None) is not None:
            self.num_steps, tail = order.steps
            if tail:
                self.tail = [[[] for _ in range(tail)] for _ in range(self.num_replicas)]
        self.total_size: int = self.num_steps * step
        names = [f"phase{j}" for j in range(self.table.shape[1] - 1)] + ["llm"]
        self.columns: list[str] = names
        #: max/mean over ranks, in the last step yielded, of each column's tokens and of the cost of
        #: the step (``"cost"``); ``"micro_cost"``: the largest max/mean over the step's micro-batch
        #: slots; ``"cost_before"`` and ``"micro_cost_before"``: the same of the step's examples
        #: dealt as sampled (example ``p`` of the step to rank ``p % num_replicas``, as
        #: ``DistributedSampler`` deals them), what the balancing is measured against
        self.stats: dict[str, float] = {}
        #: seconds the last epoch's plan took (every step of the epoch at once)
        self.plan_seconds: float = 0.0
        #: :attr:`stats` of every step of the epoch being iterated, by step (a loader runs ahead of
        #: training, so the step a trainer finished is looked up here, not in :attr:`stats`)
        self.epoch_stats: list[dict[str, float]] = []
        self._cache: tuple[int, EpochPlan] | None = None

    @property
    def step_size(self) -> int:
        """Examples per optimizer step, over all ranks and micro-batches."""
        return self.batch_size * self.num_replicas * self.grad_accum

    def set_epoch(self, epoch: int) -> None:
        """Use the permutation of ``epoch`` (call it at every epoch, on every rank)."""
        if isinstance(epoch, bool) or not isinstance(epoch, numbers.Integral) or epoch < 0:
            raise ValueError(f"epoch must be an int >= 0, got {epoch!r}")
        self.epoch = int(epoch)

    def __len__(self) -> int:
        return self.num_steps * self.grad_accum + (len(self.tail[0]) if self.tail else 0)

    def plan_epoch(self) -> EpochPlan:
        """The plan of every rank for the current epoch (computed once per epoch, then cached)."""
        if self._cache is not None and self._cache[0] == self.epoch:
            return self._cache[1]
        start = time.perf_counter()
        if self.order is not None:
            order = self._given_order()
        else:
            order = _epoch_order(self.table.shape[0], self.total_size, self.shuffle, self.seed, self.epoch)
        steps, n = self.num_steps, self.step_size
        planner = plan_equal_counts if self.equal_counts else plan_micro_batches
        rank, micro, costs = planner(
            self.table[order, -1], steps, n, self.num_replicas, self.grad_accum, self.policy, self.alpha,
            self.beta, self.padding,
        )  # fmt: skip
        plan = EpochPlan(
            indices=order.reshape(steps, n),
            rank=rank.reshape(steps, n),
            micro=micro.reshape(steps, n),
            costs=costs,
        )
        for a in (plan.indices, plan.rank, plan.micro, plan.costs):
            a.setflags(write=False)
        self._cache = (self.epoch, plan)
        self.plan_seconds = time.perf_counter() - start
        return plan

    def _given_order(self) -> np.ndarray:
        """This epoch's draw from ``order``: its whole steps (a partial last step, which ``order``
        gives as ``order.tail(epoch)``, goes to :attr:`tail`); refused by name when it is no list of
        dataset indices or holds no whole step. Without ``order.steps`` the epoch then has its
        number of steps."""
        got = np.asarray(self.order(self.epoch))
        n, step = self.table.shape[0], self.step_size
        if got.ndim != 1 or (got.size and not np.issubdtype(got.dtype, np.integer)):
            raise ValueError(
                f"order({self.epoch}) must give a 1-D list of dataset indices, got shape {got.shape}"
            )
        if got.size and (int(got.min()) < 0 or int(got.max()) >= n):
            raise ValueError(f"order({self.epoch}) gives an index outside the dataset's 0..{n - 1}")
        steps = got.size // step
        if getattr(self.order, "steps", None) is not None:
            if steps != self.num_steps:
                raise ValueError(
                    f"order({self.epoch}) gives {steps} whole steps, its steps said {self.num_steps}"
                )
            tail = self.order.tail(self.epoch)
            if len(tail) != self.num_replicas or len({len(t) for t in tail}) > 1:
                raise ValueError(
                    f"order.tail({self.epoch}) must give every rank the same number of micro-batches"
                )
            self.tail = [[list(map(int, mb)) for mb in t] for t in tail] if len(tail[0]) else []
        elif steps == 0:
            raise ValueError(
                f"order({self.epoch}) gives {got.size} indices, less than one step ({step} = batch_size x "
                "num_replicas x grad_accum)"
            )
        self.num_steps, self.total_size = steps, steps * step
        return got[: self.total_size].astype(np.int64)

    def steps(self) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """Every step of the epoch as ``(indices, rank of each, cost of each rank's share of the
        step)``: the plan of all ranks (what every rank's sampler computes). The micro-batch of
        each index and the cost of every micro-batch are in :meth:`plan_epoch`."""
        plan = self.plan_epoch()
        totals = plan.costs.sum(axis=1)
        for s in range(self.num_steps):
            yield plan.indices[s], plan.rank[s], totals[s]

    def __iter__(self) -> Iterator[list[int]]:
        plan = self.plan_epoch()
        steps, g = self.num_steps, self.grad_accum
        mine = plan.rank.reshape(-1) == self.rank
        keys = (np.repeat(np.arange(steps, dtype=np.int64) * g, self.step_size) + plan.micro.reshape(-1))[
            mine
        ]
        pick = np.argsort(keys, kind="stable")
        flat = plan.indices.reshape(-1)[mine][pick].tolist()
        bounds = np.concatenate(([0], np.cumsum(np.bincount(keys, minlength=steps * g)))).tolist()
        sampled = sampled_costs(self.table[plan.indices.reshape(-1), -1], steps, self.step_size, self.num_replicas,
                                g, self.policy, self.alpha, self.beta)  # fmt: skip
        stats = _step_stats(plan, self.table, self.columns, self.num_replicas, sampled)
        if self.tail:  # a last, partial step of the draw: dealt as drawn
            stats.append(self._tail_stats())
        self.epoch_stats = stats
        for s in range(steps):
            self.stats = stats[s]
            for k in range(s * g, (s + 1) * g):
                yield flat[bounds[k] : bounds[k + 1]]
        if self.tail:
            self.stats = stats[-1]
            yield from (list(mb) for mb in self.tail[self.rank])

    def _tail_stats(self) -> dict[str, float]:
        """:attr:`stats` of the partial last step, dealt as drawn (before and after alike)."""
        g = len(self.tail[0])
        key = [
            (k * self.num_replicas + r, i)
            for r, t in enumerate(self.tail)
            for k, mb in enumerate(t)
            for i in mb
        ]
        slots = np.asarray([k for k, _ in key], dtype=np.int64)
        idx = np.asarray([i for _, i in key], dtype=np.int64)
        costs = np.asarray(
            batch_costs_of(
                self.table[idx, -1], slots, g * self.num_replicas, self.policy, self.alpha, self.beta
            )
        ).reshape(1, g, self.num_replicas)
        step = EpochPlan(
            indices=idx[None], rank=(slots % self.num_replicas)[None], micro=(slots // self.num_replicas)[None],
            costs=costs,
        )  # fmt: skip
        return _step_stats(step, self.table, self.columns, self.num_replicas, costs)[0]

    def __repr__(self) -> str:
        return (
            f"BalancedBatchSampler(n={self.table.shape[0]}, batch_size={self.batch_size}, "
            f"num_replicas={self.num_replicas}, rank={self.rank}, grad_accum={self.grad_accum}, "
            f"policy={self.policy!r}, steps={self.num_steps}"
            + (", equal_counts=True)" if self.equal_counts else ")")
        )


def _sampler_policy(cost, alpha, beta, padding: bool) -> tuple[str, float, float]:
    """The planner's policy and coefficients ``(policy, alpha, beta)`` of the sampler's ``cost``
    (``"sum"``, ``"quadratic"`` or a :class:`~mmbalance.balancing.CostModel`) and ``padding``."""
    if isinstance(cost, CostModel):
        weight = cost.attention * (1.0 + cost.eta)
        padded = padding or cost.padded
        return ("padded_quadratic" if padded else "quadratic"), float(cost.linear), float(weight)
    if cost == "sum":
        return ("padded" if padding else "sum"), 1.0, 0.0
    if cost == "quadratic":
        policy = "padded_quadratic" if padding else "quadratic"
        return policy, as_coefficient(alpha, "alpha"), as_coefficient(beta, "beta")
    raise ValueError(f"cost must be 'sum', 'quadratic' or a CostModel, got {cost!r}")


def _epoch_order(n: int, total: int, shuffle: bool, seed: int, epoch: int) -> np.ndarray:
    """The ``total`` dataset indices an epoch draws, in order (int64): the permutation seeded by
    ``(seed, epoch)`` (or ``0..n-1``), cut to ``total`` or padded with its own start."""
    order = np.random.default_rng([seed, epoch]).permutation(n) if shuffle else np.arange(n)
    order = order.astype(np.int64)
    if total <= n:
        return order[:total]
    reps = math.ceil((total - n) / max(n, 1))
    return np.concatenate([order, np.tile(order, reps)[: total - n]])


def _step_stats(
    plan: EpochPlan, table: np.ndarray, columns: list[str], world: int, sampled: np.ndarray
) -> list[dict[str, float]]:
    """:attr:`BalancedBatchSampler.stats` of every step of ``plan``, computed for the whole epoch
    at once: max/mean over ranks of each column's tokens and of the step's cost, and the largest
    max/mean over the step's micro-batch slots (``"micro_cost"``); the same two costs of the
    step dealt as sampled (``sampled``, ``[steps, G, ranks]``: ``"cost_before"``,
    ``"micro_cost_before"``)."""
    steps = plan.indices.shape[0]
    key = (np.arange(steps, dtype=np.int64)[:, None] * world + plan.rank).reshape(-1)

    def ratio(load: np.ndarray) -> np.ndarray:
        mean = load.mean(axis=-1)
        return np.where(mean > 0, load.max(axis=-1) / np.where(mean > 0, mean, 1.0), 1.0)

    cols = {}
    for j, name in enumerate(columns):
        w = table[plan.indices.reshape(-1), j].astype(np.float64)
        cols[name] = ratio(
            np.bincount(key, weights=w, minlength=steps * world).reshape(steps, world)
        ).tolist()
    cols["cost"] = ratio(plan.costs.sum(axis=1)).tolist()
    cols["micro_cost"] = ratio(plan.costs).max(axis=1).tolist() if steps else []
    cols["cost_before"] = ratio(sampled.sum(axis=1)).tolist()
    cols["micro_cost_before"] = ratio(sampled).max(axis=1).tolist() if steps else []
    return [{name: vals[s] for name, vals in cols.items()} for s in range(steps)]
