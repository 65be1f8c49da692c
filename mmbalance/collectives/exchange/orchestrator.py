"""The multi-phase orchestrator (OrchMLLM section 6): gathers the sizes, plans every phase of a step
ahead of time, and moves the tensors by those plans.

The planning itself is :func:`mmbalance.balancing.phases.plan_step` (numpy only): one located
plan per encoder phase, one for the LLM over each example's interleaved sequence, and the composed
moves ``plan_llm o plan_encoder^-1`` that take encoder outputs straight to their LLM rank. This
module adds what needs ranks and tensors: :class:`Orchestrator` all-gathers every rank's sizes and
plans in a background thread, one step ahead; :class:`StepPlan` moves examples into the encoders'
layouts (:meth:`StepPlan.to_encoder`), into the LLM layout (:meth:`StepPlan.to_llm`), and
interleaves each example's parts in its declared order (:meth:`StepPlan.assemble`, "subsequence
assembly", one ``segment_gather``).

Loss normalization: the rearrangement does not change the result only if the loss is a sum over
tokens divided by the *global* token count (all ranks together). A per-rank mean averaged over ranks
weights tokens by the size of the batch it landed in, so it depends on the placement.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from mmbalance.balancing import Plan
from mmbalance.balancing.phases import TEXT, PhasePlans, PhaseSpec, plan_step
from mmbalance.balancing.validate import as_lengths

from ..agreement import Entry
from ..group import world_of
from .alltoall import gather_table, rebalance

__all__ = ["Orchestrator", "StepPlan"]


@dataclass
class StepPlan(PhasePlans):
    """All plans of one training step (:class:`~mmbalance.balancing.phases.PhasePlans`, identical
    on every rank) and, for this ``rank``, the moves that use them."""

    rank: int = 0
    group: object = None
    check: bool = True

    # ------------------------------------------------------------------ moves
    def to_encoder(self, modality: str, packed, cu_seqlens: Tensor):
        """Encoder inputs of this rank's sampled examples -> the encoder's balanced layout."""
        return rebalance(packed, cu_seqlens, self._enc(modality), self.group, check=self.check)

    def to_llm(self, part: str, packed, cu_seqlens: Tensor):
        """Move a part into the LLM layout: encoder outputs (``ceil(len/downsample)`` tokens per
        example, in the encoder layout) in one composed all-to-all, or ``"text"`` from the sampling
        layout."""
        if part not in self.moves:
            raise ValueError(f"unknown part {part!r}; known: {sorted(self.moves)}")
        return rebalance(packed, cu_seqlens, self.moves[part], self.group, check=self.check)

    def _enc(self, modality: str) -> Plan:
        if modality not in self.encoder:
            raise ValueError(f"unknown modality {modality!r}; known: {sorted(self.encoder)}")
        return self.encoder[modality]

    # ------------------------------------------------------------------ assembly
    @property
    def llm_examples(self) -> np.ndarray:
        """Global ids of the examples this rank's LLM processes, in slot order."""
        return self.llm.recv_order(self.rank)

    @property
    def llm_lengths(self) -> np.ndarray:
        return self.llm.lengths[self.llm_examples]

    def assemble(self, parts: Mapping[str, tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor]:
        """Interleave every example's parts (all in the LLM layout) in its declared order.

        Args:
            parts: part name -> ``(packed, cu_seqlens)`` in the LLM layout, as returned by
                :meth:`to_llm`; all with the same trailing shape and dtype.

        Returns:
            ``(sequence, cu_seqlens)`` of this rank's LLM batch.
        """
        names = list(self.llm_parts)
        missing = [p for p in names if p not in parts]
        if missing:
            raise ValueError(f"assemble needs every part; missing {missing}")
        ids = self.llm_examples
        m = ids.size
        pieces, cus, offset = [], [], 0
        for p in names:
            x, cu = parts[p]
            if cu.shape[0] != m + 1:
                raise ValueError(f"part {p!r} has {cu.shape[0] - 1} examples, the LLM layout {m}")
            pieces.append(x)
            cus.append(cu[:-1].to(torch.int64) + offset)
            offset += x.shape[0]
        device = pieces[0].device
        allx = torch.cat(pieces, dim=0)
        all_cu = torch.cat([*cus, torch.tensor([offset], dtype=torch.int64, device=device)])
        index = {p: k for k, p in enumerate(names)}
        seg = [index[p] * m + j for j in range(m) for p in self.orders[self.order_ids[ids[j]]]]
        order = torch.tensor(seg, dtype=torch.int64, device=device)
        lengths = self.llm_lengths
        seq = torch.ops.mmbalance.segment_gather(allx, all_cu, order, int(lengths.sum()))
        cu_out = np.zeros(m + 1, dtype=np.int32)
        np.cumsum(lengths, out=cu_out[1:])
        return seq, torch.from_numpy(cu_out).to(device)


class Orchestrator:
    """Plans every phase of each step, ahead of time, identically on every rank.

    Args:
        encoders: modality name -> :class:`PhaseSpec` (e.g. ``{"vision": PhaseSpec("sum",
            downsample=4), "audio": PhaseSpec("conv", beta=1e-3, downsample=2)}``).
        llm: the LLM phase's :class:`PhaseSpec` (``"sum"`` or ``"quadratic"``; default ``"sum"``).
        orders: the possible interleavings of an example's parts; default one order: every
            modality in the given order, then ``"text"``.
        group: the data-parallel process group.
        ranks_per_node: enables node-aware placement of moved examples.
        check_plans: verify before each move that all ranks hold the same plan (a small
            all-gather per plan).
        background: plan in a worker thread (``submit`` returns at once).
        llm_group_size: ranks per LLM group (tensor/context parallel): the LLM phase is balanced
            over ``world / llm_group_size`` groups and each example lands on its group's first
            rank, which shares the assembled batch with the group
            (:func:`~mmbalance.collectives.exchange.broadcast.broadcast_from_leader`).
        balance: ``False`` keeps every example where it was sampled (encoders on their rank, the
            LLM on that rank's group): the same code path without balancing, for comparisons.

    Example::

        orch = Orchestrator({"vision": PhaseSpec("sum", downsample=4)})
        step = orch.submit({"vision": vit_lens, "text": text_lens}).result()
        patches, cu = step.to_encoder("vision", patches, cu)
        feats, feats_cu = step.to_llm("vision", connector(vit(patches, cu)), step_cu)
    """

    def __init__(
        self,
        encoders: Mapping[str, PhaseSpec],
        *,
        llm: PhaseSpec | None = None,
        orders: Sequence[Sequence[str]] | None = None,
        group=None,
        ranks_per_node: int | None = None,
        check_plans: bool = True,
        background: bool = True,
        llm_group_size: int = 1,
        balance: bool = True,
    ):
        if not isinstance(encoders, Mapping) or not encoders:
            raise ValueError("encoders must be a non-empty mapping of modality -> PhaseSpec")
        for name, spec in encoders.items():
            if name == TEXT or not isinstance(name, str):
                raise ValueError(f"invalid modality name {name!r}")
            if not isinstance(spec, PhaseSpec):
                raise TypeError(f"encoders[{name!r}] must be a PhaseSpec")
        self.encoders = dict(encoders)
        llm = PhaseSpec() if llm is None else llm
        if not isinstance(llm, PhaseSpec):
            raise TypeError(f"llm must be a PhaseSpec, got {type(llm).__name__}")
        self.llm = llm
        parts = [*self.encoders, TEXT]
        self.orders = [tuple(o) for o in (orders or [parts])]
        if not self.orders:
            raise ValueError("orders must name at least one order")
        for o in self.orders:
            # every part exactly once: a part left out would silently drop its tokens at assembly
            if len(o) != len(set(o)) or set(o) != set(parts):
                raise ValueError(f"order {o} must name every part exactly once: {parts}")
        self.group = group
        self.ranks_per_node = ranks_per_node
        self.check_plans = check_plans
        if isinstance(llm_group_size, bool) or not isinstance(llm_group_size, int) or llm_group_size < 1:
            raise ValueError(f"llm_group_size must be an int >= 1, got {llm_group_size!r}")
        if ranks_per_node is not None and (
            isinstance(ranks_per_node, bool) or not isinstance(ranks_per_node, int) or ranks_per_node < 1
        ):
            raise ValueError(f"ranks_per_node must be None or an int >= 1, got {ranks_per_node!r}")
        self.llm_group_size = llm_group_size
        self.balance = bool(balance)
        self._pool = (
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="mmbalance-plan") if background else None
        )

    def submit(self, sizes: Mapping[str, Sequence[int]], order_ids=None) -> Future:
        """All-gather this rank's example sizes now (collective), plan in the background.

        Args:
            sizes: ``{modality: [n_r] encoder input lengths, ..., "text": [n_r] text tokens}`` for
                the examples this rank sampled (0 where an example lacks a modality).
            order_ids: ``[n_r]`` index into ``orders`` per example (default 0).

        Returns:
            A future of the step's :class:`StepPlan`.

        Raises:
            RankMismatchError on every rank (``ValueError``/``TypeError`` on the rank at fault)
            when some rank's sizes are invalid or the ranks' orchestrators are configured
            differently: the sizes are validated inside the exchange, so no rank is left waiting.
        """
        names = [*self.encoders, TEXT]
        mat = None
        _, world = world_of(self.group)
        with Entry("Orchestrator.submit", self.group) as e:
            e.fields["configuration"] = self._config_text()
            if world % self.llm_group_size:
                raise ValueError(
                    f"llm_group_size ({self.llm_group_size}) must divide the world size ({world})"
                )
            if self.ranks_per_node and world % self.ranks_per_node:
                raise ValueError(
                    f"ranks_per_node ({self.ranks_per_node}) must divide the world size ({world})"
                )
            mat = self._table(sizes, order_ids, names)
        table, src = gather_table(mat, self.group, entry=e)
        rank, world = world_of(self.group)
        job = (table, src, rank, world)
        if self._pool is None:
            fut: Future = Future()
            fut.set_result(self._plan(*job))
            return fut
        return self._pool.submit(self._plan, *job)

    def _table(self, sizes, order_ids, names: list[str]) -> np.ndarray:
        """This rank's sizes and order ids as one int64 ``[n_r, parts + 1]`` table (validated)."""
        if not isinstance(sizes, Mapping):
            raise TypeError(f"sizes must be a mapping of part -> lengths, got {type(sizes).__name__}")
        missing = [n for n in names if n not in sizes]
        unknown = [n for n in sizes if n not in names]
        if missing or unknown:
            raise ValueError(
                f"sizes must have exactly the parts {names}"
                + (f"; missing {missing}" if missing else "")
                + (f"; unknown {unknown}" if unknown else "")
            )
        cols = [as_lengths(np.asarray(sizes[n]).reshape(-1), f"sizes[{n!r}]") for n in names]
        n_local = cols[0].size
        if any(c.size != n_local for c in cols):
            raise ValueError(
                "sizes must have one entry per example for every part: "
                + ", ".join(f"sizes[{n!r}] has {c.size}" for n, c in zip(names, cols))
            )
        if order_ids is None:
            ids = np.zeros(n_local, dtype=np.int64)
        else:
            ids = as_lengths(np.asarray(order_ids).reshape(-1), "order_ids")
            if ids.size != n_local or (ids.size and ids.max() >= len(self.orders)):
                raise ValueError(f"order_ids must be {n_local} indices into the {len(self.orders)} orders")
        if not n_local:
            return np.zeros((0, len(names) + 1), dtype=np.int64)
        return np.stack([*cols, ids], axis=1)

    def _config_text(self) -> str:
        """The configuration every rank's orchestrator must share (checked at each exchange)."""
        return repr(
            (
                sorted((k, v) for k, v in self.encoders.items()),
                self.llm,
                self.orders,
                self.ranks_per_node,
                self.llm_group_size,
                self.balance,
                self.check_plans,
            )
        )

    def plan(self, sizes, order_ids=None) -> StepPlan:
        """:meth:`submit` and wait."""
        return self.submit(sizes, order_ids).result()

    def _plan(self, table: np.ndarray, src: np.ndarray, rank: int, world: int) -> StepPlan:
        names = [*self.encoders, TEXT]
        plans = plan_step(
            {n: np.ascontiguousarray(table[:, k]) for k, n in enumerate(names)},
            src,
            world,
            self.encoders,
            self.llm,
            orders=self.orders,
            order_ids=np.ascontiguousarray(table[:, -1]),
            ranks_per_node=self.ranks_per_node,
            llm_group_size=self.llm_group_size,
            balance=self.balance,
        )
        fields = {f: getattr(plans, f) for f in PhasePlans.__dataclass_fields__}
        return StepPlan(**fields, rank=rank, group=self.group, check=self.check_plans)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
