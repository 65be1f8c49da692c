"""Balancing on the data side: per-rank batches planned from lengths alone, no communication.

:class:`BalancedBatchSampler` is a drop-in batch sampler for any trainer's ``DataLoader``: every
rank draws the same seeded shuffle (as ``DistributedSampler`` does), takes the next
``batch_size * num_replicas`` examples each step, and splits them over the ranks with the
post-balancing planner on their lengths. Every rank computes the same split independently, so
nothing is exchanged; the examples are assigned before loading, so nothing moves either.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterator

import numpy as np
import torch
from torch.utils.data import Sampler

from mmbalance.balancing import CostModel, post_balance
from mmbalance.balancing._validate import as_coefficient, as_count, as_lengths

__all__ = ["BalancedBatchSampler"]

# "quadratic" default: attention FLOPs per token pair over linear FLOPs per token of a
# 4096-wide transformer layer (4h / 24h^2): the attention term matters from ~25k tokens on.
DEFAULT_BETA = 1.0 / (6 * 4096)


class BalancedBatchSampler(Sampler[list[int]]):
    """Per-rank batches of dataset indices, balanced in the cost of what each rank processes.

    Args:
        lengths: tokens per example: a sequence of ints ``[n]``, or a 2-D array ``[n, phases]``
            with one column per phase (e.g. vision patches, audio frames, LLM tokens) and the LLM
            tokens last. The last column is balanced; :attr:`stats` reports every column.
        batch_size: examples per rank per step *on average*: each step takes ``batch_size *
            num_replicas`` examples and splits them by cost, so a rank may get more or fewer.
        num_replicas, rank: the data-parallel size and this rank (default: from
            ``torch.distributed``).
        cost: ``"sum"`` (tokens), ``"quadratic"`` (``alpha * l + beta * l**2``: linear layers
            plus attention), or a fitted :class:`~mmbalance.balancing.CostModel`.
        shuffle, seed: a permutation seeded by ``(seed, epoch)``, the same on every rank; call
            :meth:`set_epoch` at the start of every epoch.
        drop_last: drop the tail that does not fill a whole step; otherwise pad it with examples
            from the start of the permutation, as ``DistributedSampler`` does.
        alpha, beta: coefficients of ``"quadratic"`` (default ``beta``: the attention-to-linear
            FLOP ratio of a 4096-wide transformer).

    Per-rank batch sizes differ (that is the balancing). Normalize the loss by the *global* count
    of loss tokens of the step (summed over ranks; in transformers' Trainer, ``num_items_in_batch``),
    not by a per-rank mean: a per-rank mean would weight every token by the size of the batch it
    landed in, and the result would depend on the split.

    Every rank yields a list of indices per step, the same number of steps on every rank
    (``len(sampler)``); over an epoch every example is yielded exactly once (plus the padding
    repeats with ``drop_last=False``). Use it as ``DataLoader(dataset, batch_sampler=sampler,
    collate_fn=...)``.
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
        if num_replicas is None or rank is None:
            import torch.distributed as dist

            if not (dist.is_available() and dist.is_initialized()):
                raise ValueError("num_replicas and rank are needed when torch.distributed is not initialized")
            num_replicas = dist.get_world_size() if num_replicas is None else num_replicas
            rank = dist.get_rank() if rank is None else rank
        self.num_replicas = as_count(num_replicas, "num_replicas")
        self.rank = as_count(rank, "rank", minimum=0, maximum=self.num_replicas - 1)
        self.policy, self.alpha, self.beta = self._cost(cost, alpha, beta)
        self.shuffle = bool(shuffle)
        if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or seed < 0:
            raise ValueError(f"seed must be an int >= 0, got {seed!r}")
        self.seed = int(seed)
        self.drop_last = bool(drop_last)
        self.epoch = 0
        n = self.table.shape[0]
        step = self.batch_size * self.num_replicas
        self.num_steps = n // step if self.drop_last else math.ceil(n / step)
        self.total_size = self.num_steps * step
        names = [f"phase{j}" for j in range(self.table.shape[1] - 1)] + ["llm"]
        self.columns = names
        #: max/mean over ranks of each column's tokens (and of the balanced cost, ``"cost"``) in
        #: the last step yielded
        self.stats: dict[str, float] = {}

    @staticmethod
    def _cost(cost, alpha, beta) -> tuple[str, float, float]:
        if isinstance(cost, CostModel):
            weight = cost.attention * (1.0 + cost.eta)
            return ("padded_quadratic" if cost.padded else "quadratic"), float(cost.linear), float(weight)
        if cost == "sum":
            return "sum", 1.0, 0.0
        if cost == "quadratic":
            return "quadratic", as_coefficient(alpha, "alpha"), as_coefficient(beta, "beta")
        raise ValueError(f"cost must be 'sum', 'quadratic' or a CostModel, got {cost!r}")

    def set_epoch(self, epoch: int) -> None:
        """Use the permutation of ``epoch`` (call it at every epoch, on every rank)."""
        if isinstance(epoch, bool) or not isinstance(epoch, numbers.Integral) or epoch < 0:
            raise ValueError(f"epoch must be an int >= 0, got {epoch!r}")
        self.epoch = int(epoch)

    def __len__(self) -> int:
        return self.num_steps

    def _order(self) -> np.ndarray:
        n = self.table.shape[0]
        if self.shuffle:
            order = np.random.default_rng([self.seed, self.epoch]).permutation(n)
        else:
            order = np.arange(n)
        if self.total_size <= n:
            return order[: self.total_size]
        reps = math.ceil((self.total_size - n) / max(n, 1))
        return np.concatenate([order, np.tile(order, reps)[: self.total_size - n]])

    def steps(self) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """Every step of the epoch as ``(indices, rank of each, cost of each rank's batch)``: the
        plan of all ranks (what every rank's sampler computes)."""
        order = self._order()
        step = self.batch_size * self.num_replicas
        for s in range(self.num_steps):
            idx = order[s * step : (s + 1) * step]
            plan = post_balance(
                self.table[idx, -1], self.num_replicas, self.policy, alpha=self.alpha, beta=self.beta
            )
            yield idx, plan.dst_rank, plan.costs

    def __iter__(self) -> Iterator[list[int]]:
        for idx, dst, costs in self.steps():
            self.stats = self._stats(idx, dst, costs)
            yield idx[dst == self.rank].tolist()

    def _stats(self, idx: np.ndarray, dst: np.ndarray, costs: np.ndarray) -> dict[str, float]:
        def ratio(load: np.ndarray) -> float:
            return float(load.max() / load.mean()) if load.mean() > 0 else 1.0

        out = {
            name: ratio(np.bincount(dst, weights=self.table[idx, j], minlength=self.num_replicas))
            for j, name in enumerate(self.columns)
        }
        out["cost"] = ratio(costs)
        return out

    def __repr__(self) -> str:
        return (
            f"BalancedBatchSampler(n={self.table.shape[0]}, batch_size={self.batch_size}, "
            f"num_replicas={self.num_replicas}, rank={self.rank}, policy={self.policy!r}, steps={self.num_steps})"
        )
