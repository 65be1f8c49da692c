"""``Plan``: where every example goes, as data.

A plan maps example ``i`` (a global index; with :func:`mmbalance.collectives.gather_lengths` it is
rank-major sampling order) from its source position ``(src_rank[i], src_slot[i])`` to its
destination ``(dst_rank[i], dst_slot[i])``. It is a pure value: identical bytes on every rank for
identical inputs, which is what lets every rank compute it independently and still agree on one
all-to-all. Plans compose like the rearrangements of OrchMLLM section 6: ``b.compose(a)`` is "a,
then b", and ``p.inverse()`` moves every example back.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass, field

import numpy as np

POLICIES = ("sum", "padded", "quadratic", "conv", "padded_quadratic")

# The policies with an attention term (``beta * l^2`` or ``beta * b * m^2``) and its coefficient
# when none is given: attention FLOPs per token pair over linear-layer FLOPs per token of a
# 4096-wide transformer layer (``4 h`` over ``24 h^2``), so the quadratic term matters from about
# 25k tokens on. Every entry point (``post_balance``, ``lower_bound``, ``PhaseSpec``, the batch
# sampler, the command line) uses this same default.
QUADRATIC_POLICIES = ("quadratic", "conv", "padded_quadratic")
DEFAULT_BETA = 1.0 / (6 * 4096)


def default_beta(policy: str, beta: float | None) -> float:
    """``beta`` if given, else :data:`DEFAULT_BETA` for the policies with an attention term (0 for
    "sum" and "padded", which have none). Validation of the value is the caller's."""
    if beta is not None:
        return beta
    return DEFAULT_BETA if policy in QUADRATIC_POLICIES else 0.0


def imbalance(loads) -> float:
    """Max over mean of per-rank loads (costs, tokens, seconds): 1.0 is perfect balance; 1.0 also
    for no load at all. The one definition every statistic of the package uses."""
    loads = np.asarray(loads, dtype=np.float64)
    mean = float(loads.mean()) if loads.size else 0.0
    return float(loads.max() / mean) if mean > 0 else 1.0


def _slots(ranks: np.ndarray, num_ranks: int) -> np.ndarray:
    """Position of each example among the examples of its rank, in index order."""
    order = np.argsort(ranks, kind="stable")
    starts = np.zeros(num_ranks + 1, dtype=np.int64)
    np.cumsum(np.bincount(ranks, minlength=num_ranks), out=starts[1:])
    slot = np.empty_like(ranks)
    slot[order] = np.arange(ranks.shape[0], dtype=np.int64) - starts[ranks[order]]
    return slot


@dataclass(frozen=True)
class Route:
    """One rank's side of a plan, all on the host: what an all-to-all that runs the plan needs
    there (:meth:`Plan.route`).

    ``send_order``: local segment ids (source slots) in send order (by destination rank, then
    slot); ``send_tokens`` / ``recv_tokens``: rows to / from each rank; ``recv_perm``: segment ids
    of the receive buffer in slot order, ``None`` when it already is; ``in_lengths``: this rank's
    examples' lengths before the move; ``out_lengths``: after, in slot order.
    """

    send_order: np.ndarray
    send_tokens: list[int]
    recv_tokens: list[int]
    recv_perm: np.ndarray | None
    in_lengths: np.ndarray
    out_lengths: np.ndarray

    @property
    def in_tokens(self) -> int:
        return int(self.in_lengths.sum())

    @property
    def out_tokens(self) -> int:
        return int(self.out_lengths.sum())


@dataclass(frozen=True, eq=False)
class Plan:
    """A rearrangement of ``n`` examples over ``num_ranks`` ranks.

    Attributes:
        dst_rank: int64 ``[n]``, the rank that receives example ``i``.
        dst_slot: int64 ``[n]``, position of example ``i`` in that rank's new batch. Slots of one rank
            are ``0..count-1``, in order of (source rank, source slot), so an all-to-all receive
            buffer is already in slot order.
        costs: float64 ``[num_ranks]``, each new batch's cost under ``policy``.
        num_ranks: number of ranks.
        lengths: int64 ``[n]``, the lengths the plan was made for.
        src_rank / src_slot: int64 ``[n]``, where example ``i`` is before the move (slots in index
            order). ``None`` when the planner was not told the sources (``src_ranks=None``); such a
            plan describes the new batches but cannot drive a move.
        policy, alpha, beta: the cost model the plan was made for.
    """

    dst_rank: np.ndarray
    dst_slot: np.ndarray
    costs: np.ndarray
    num_ranks: int
    lengths: np.ndarray
    src_rank: np.ndarray | None = None
    src_slot: np.ndarray | None = None
    policy: str = "sum"
    alpha: float = 1.0
    beta: float = 0.0
    info: dict = field(default_factory=dict, compare=False)

    def __post_init__(self):
        for name in ("dst_rank", "dst_slot", "costs", "lengths", "src_rank", "src_slot"):
            value = getattr(self, name)
            if value is not None:
                value.setflags(write=False)

    # ------------------------------------------------------------------ summary numbers
    @property
    def num_examples(self) -> int:
        return int(self.dst_rank.shape[0])

    @property
    def makespan(self) -> float:
        """Largest batch cost."""
        return float(self.costs.max()) if self.costs.size else 0.0

    @property
    def counts(self) -> np.ndarray:
        """Examples received by each rank, int64 ``[num_ranks]``."""
        return np.bincount(self.dst_rank, minlength=self.num_ranks).astype(np.int64)

    @property
    def tokens(self) -> np.ndarray:
        """Tokens (sum of lengths) received by each rank, int64 ``[num_ranks]``."""
        return np.bincount(self.dst_rank, weights=self.lengths, minlength=self.num_ranks).astype(np.int64)

    def batch_costs(self, ranks=None, num_ranks: int | None = None) -> np.ndarray:
        """float64 ``[num_ranks]``: the cost of each batch that putting example ``i`` on rank
        ``ranks[i]`` would form, under this plan's cost model (``policy``, ``alpha``, ``beta``).
        Default: the plan's own batches (``dst_rank``, which is :attr:`costs`); pass
        ``num_ranks`` for another number of batches (e.g. groups of ranks)."""
        if ranks is None:
            return np.array(self.costs)
        from .validate import as_ranks

        n = self.num_ranks if num_ranks is None else int(num_ranks)
        ranks = as_ranks(ranks, self.num_examples, n, "ranks")
        return _costs_of(self.lengths, ranks, n, self.policy, self.alpha, self.beta)

    def source_costs(self) -> np.ndarray:
        """float64 ``[num_ranks]``: each rank's batch cost before the move (requires a source)."""
        src_rank, src_slot = self._source("source_costs")
        return self.batch_costs(src_rank)

    def imbalance(self, before: bool = False) -> float:
        """Max/mean batch cost over the ranks after the move (``before=True``: as sampled)."""
        return imbalance(self.source_costs() if before else self.costs)

    @functools.cached_property
    def key(self) -> str:
        """A short hex hash of the plan (the first 8 bytes of :meth:`digest`), computed once: what
        the collectives compare across ranks before they move anything."""
        return self.digest()[:8].hex()

    def moved(self) -> np.ndarray:
        """Boolean ``[n]``: examples whose rank changes (requires a source)."""
        src_rank, src_slot = self._source("moved")
        return self.dst_rank != src_rank

    def moved_tokens(self) -> int:
        return int(self.lengths[self.moved()].sum())

    def send_matrix(self) -> np.ndarray:
        """Tokens sent from rank ``s`` to rank ``d``: int64 ``[num_ranks, num_ranks]``."""
        src_rank, src_slot = self._source("send_matrix")
        m = np.zeros(self.num_ranks * self.num_ranks, dtype=np.int64)
        np.add.at(m, src_rank * self.num_ranks + self.dst_rank, self.lengths)
        return m.reshape(self.num_ranks, self.num_ranks)

    def off_node_send(self, ranks_per_node: int) -> np.ndarray:
        """Tokens each source rank sends to other nodes, int64 ``[num_ranks]`` (eq. 5 of OrchMLLM)."""
        src_rank, src_slot = self._source("off_node_send")
        off = (src_rank // ranks_per_node) != (self.dst_rank // ranks_per_node)
        return np.bincount(src_rank[off], weights=self.lengths[off], minlength=self.num_ranks).astype(
            np.int64
        )

    def digest(self) -> bytes:
        """SHA-256 of the plan's arrays: equal on every rank iff the plans are identical."""
        h = hashlib.sha256()
        h.update(np.int64(self.num_ranks).tobytes())
        for a in (self.dst_rank, self.dst_slot, self.src_rank, self.src_slot, self.lengths):
            h.update(b"-" if a is None else np.ascontiguousarray(a).tobytes())
        return h.digest()

    # ------------------------------------------------------------------ per-rank views
    def send_order(self, rank: int) -> np.ndarray:
        """Source slots of ``rank``'s examples in send order (by destination rank, then slot)."""
        src_rank, src_slot = self._source("send_order")
        idx = np.flatnonzero(src_rank == rank)
        key = np.lexsort((self.dst_slot[idx], self.dst_rank[idx]))
        return src_slot[idx[key]]

    def send_counts(self, rank: int) -> np.ndarray:
        """Examples ``rank`` sends to each rank, int64 ``[num_ranks]``."""
        src_rank, src_slot = self._source("send_counts")
        sel = src_rank == rank
        return np.bincount(self.dst_rank[sel], minlength=self.num_ranks).astype(np.int64)

    def recv_order(self, rank: int) -> np.ndarray:
        """Global ids of the examples ``rank`` receives, in slot order."""
        idx = np.flatnonzero(self.dst_rank == rank)
        out = np.empty_like(idx)
        out[self.dst_slot[idx]] = idx
        return out

    def source_order(self, rank: int) -> np.ndarray:
        """Global ids of the examples on ``rank`` before the move, in source-slot order."""
        src_rank, src_slot = self._source("source_order")
        idx = np.flatnonzero(src_rank == rank)
        out = np.empty_like(idx)
        out[src_slot[idx]] = idx
        return out

    def route(self, rank: int) -> Route:
        """:class:`Route`: ``rank``'s side of the move (computed once per rank and plan).

        Raises:
            TypeError: ``rank`` is not an integer.
            ValueError: ``rank`` is not in ``[0, num_ranks)``, or the plan has no source layout.
        """
        if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)):
            raise TypeError(f"rank must be an int, got {type(rank).__name__}")
        rank = int(rank)
        if not 0 <= rank < self.num_ranks:
            raise ValueError(f"rank must be in [0, {self.num_ranks}), got {rank}")
        cache = self._routes
        if rank in cache:
            return cache[rank]
        if self.src_rank is None or self.src_slot is None:
            raise ValueError("plan has no source layout: make it with post_balance(..., src_ranks=...)")
        src_rank, src_slot = self.src_rank, self.src_slot
        w, lengths = self.num_ranks, self.lengths
        mine = self.source_order(rank)  # global ids in local (source slot) order
        key = np.lexsort((self.dst_slot[mine], self.dst_rank[mine]))
        send_order = src_slot[mine[key]]
        send_tokens = np.bincount(self.dst_rank[mine], weights=lengths[mine], minlength=w).astype(np.int64)
        incoming = np.flatnonzero(self.dst_rank == rank)
        recv_seq = incoming[np.lexsort((self.dst_slot[incoming], src_rank[incoming]))]
        recv_tokens = np.bincount(src_rank[incoming], weights=lengths[incoming], minlength=w).astype(np.int64)
        slots = self.dst_slot[recv_seq]  # slot of the j-th received example
        recv_perm = None
        if not np.array_equal(slots, np.arange(slots.size)):
            recv_perm = np.empty_like(slots)
            recv_perm[slots] = np.arange(slots.size)
        route = Route(
            send_order=np.ascontiguousarray(send_order, dtype=np.int64),
            send_tokens=send_tokens.tolist(),
            recv_tokens=recv_tokens.tolist(),
            recv_perm=recv_perm,
            in_lengths=lengths[mine],
            out_lengths=lengths[self.recv_order(rank)],
        )
        cache[rank] = route
        return route

    @functools.cached_property
    def _routes(self) -> dict[int, Route]:
        return {}

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_destinations(
        cls,
        lengths: np.ndarray,
        dst_rank: np.ndarray,
        num_ranks: int,
        src_rank: np.ndarray,
        *,
        policy: str = "sum",
        alpha: float = 1.0,
        beta: float | None = None,
        costs: np.ndarray | None = None,
    ) -> Plan:
        """The plan that sends example ``i`` from ``src_rank[i]`` to ``dst_rank[i]``.

        Slots follow the usual rules (source slots in index order, destination slots in (source
        rank, index) order); ``costs`` are recomputed under the policy unless given.
        """
        from . import _core_api

        dst = np.ascontiguousarray(dst_rank, dtype=np.int64)
        src = np.ascontiguousarray(src_rank, dtype=np.int64)
        beta = default_beta(policy, beta)
        if costs is None:
            costs = _costs_of(lengths, dst, num_ranks, policy, alpha, beta)
        core = _core_api.core()
        return cls(
            dst_rank=dst,
            dst_slot=core.slots(dst, num_ranks, src),
            costs=np.asarray(costs, dtype=np.float64),
            num_ranks=num_ranks,
            lengths=lengths,
            src_rank=src,
            src_slot=core.slots(src, num_ranks),
            policy=policy,
            alpha=alpha,
            beta=beta,
        )

    # ------------------------------------------------------------------ algebra
    def inverse(self) -> Plan:
        """The plan that moves every example back to where it came from."""
        src_rank, src_slot = self._source("inverse")
        return Plan(
            dst_rank=src_rank.copy(),
            dst_slot=src_slot.copy(),
            costs=_costs_of(self.lengths, src_rank, self.num_ranks, self.policy, self.alpha, self.beta),
            num_ranks=self.num_ranks,
            lengths=self.lengths,
            src_rank=self.dst_rank.copy(),
            src_slot=self.dst_slot.copy(),
            policy=self.policy,
            alpha=self.alpha,
            beta=self.beta,
        )

    def compose(self, first: Plan) -> Plan:
        """``first`` followed by ``self``, as one plan (one all-to-all instead of two).

        ``first``'s destination layout must be ``self``'s source layout, example by example; the
        result moves from ``first``'s source straight to ``self``'s destination. The usual use is
        ``plan_llm.compose(plan_encoder.inverse())``: encoder outputs go straight to the LLM layout.
        Lengths may differ between the two plans (an encoder's tokens vs the LLM's); the result
        carries ``first``'s lengths (the payload that actually moves) and ``self``'s cost model.
        """
        if not isinstance(first, Plan):
            raise TypeError(f"first must be a Plan, got {type(first).__name__}")
        if first.num_ranks != self.num_ranks:
            raise ValueError(f"first has {first.num_ranks} ranks, this plan {self.num_ranks}")
        if first.num_examples != self.num_examples:
            raise ValueError(f"first has {first.num_examples} examples, this plan {self.num_examples}")
        src_rank, src_slot = self._source("compose")
        if not (np.array_equal(first.dst_rank, src_rank) and np.array_equal(first.dst_slot, src_slot)):
            raise ValueError("first's destination layout is not this plan's source layout")
        return Plan(
            dst_rank=self.dst_rank.copy(),
            dst_slot=self.dst_slot.copy(),
            costs=_costs_of(first.lengths, self.dst_rank, self.num_ranks, self.policy, self.alpha, self.beta),
            num_ranks=self.num_ranks,
            lengths=first.lengths,
            src_rank=None if first.src_rank is None else first.src_rank.copy(),
            src_slot=None if first.src_slot is None else first.src_slot.copy(),
            policy=self.policy,
            alpha=self.alpha,
            beta=self.beta,
        )

    def with_lengths(self, lengths) -> Plan:
        """The same moves for another payload of the same examples (e.g. labels, encoder outputs)."""
        from .validate import as_lengths

        lengths = as_lengths(lengths)
        if lengths.shape[0] != self.num_examples:
            raise ValueError(f"lengths must have {self.num_examples} entries, got {lengths.shape[0]}")
        return Plan(
            dst_rank=self.dst_rank,
            dst_slot=self.dst_slot,
            costs=_costs_of(lengths, self.dst_rank, self.num_ranks, self.policy, self.alpha, self.beta),
            num_ranks=self.num_ranks,
            lengths=lengths,
            src_rank=self.src_rank,
            src_slot=self.src_slot,
            policy=self.policy,
            alpha=self.alpha,
            beta=self.beta,
        )

    def _source(self, what: str) -> tuple[np.ndarray, np.ndarray]:
        """``(src_rank, src_slot)``, or a ``ValueError`` saying that ``what`` needs them."""
        if self.src_rank is None or self.src_slot is None:
            raise ValueError(f"Plan.{what} needs the source layout: plan with src_ranks=...")
        return self.src_rank, self.src_slot

    def __repr__(self) -> str:
        return (
            f"Plan(n={self.num_examples}, num_ranks={self.num_ranks}, policy={self.policy!r}, "
            f"makespan={self.makespan:.6g}, located={self.src_rank is not None})"
        )


def _costs_of(lengths, dst_rank, num_ranks, policy, alpha, beta) -> np.ndarray:
    from . import _core_api

    return _core_api.batch_costs(lengths, dst_rank, num_ranks, policy, alpha, beta)
