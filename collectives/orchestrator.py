"""The multi-phase orchestrator (OrchMLLM section 6): one plan per phase, composed moves.

Every rank hands in the per-modality sizes of the examples it sampled. The orchestrator
all-gathers them, and (in a background thread, overlapping the previous step) plans

* one post-balancing plan per encoder phase over that encoder's input lengths (examples without
  the modality stay where they are), with the phase's own policy (``"sum"`` for a packed ViT,
  ``"padded"``/``"conv"`` for a padded audio encoder, ...);
* one plan for the LLM over the interleaved sequence length of each example: its text plus every
  encoder's output after the connector (``ceil(len / downsample)`` tokens);
* the composed moves ``plan_llm ∘ plan_encoder⁻¹``, so encoder outputs go straight from the encoder
  layout to the rank where the LLM needs them: one all-to-all instead of two, forward and backward.

:meth:`StepPlan.assemble` then interleaves each example's text and encoder subsequences in the
example's declared order ("subsequences assembly"), with one ``segment_gather``.

Loss normalization: the rearrangement does not change the result only if the loss is a sum over
tokens divided by the *global* token count (all ranks together). A per-rank mean averaged over ranks
weights tokens by the size of the batch they landed in, so it depends on the placement.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from mmbalance.balancing import POLICIES, Plan, post_balance
from mmbalance.balancing._core_api import batch_costs
from mmbalance.balancing._validate import as_coefficient, as_lengths
from mmbalance.balancing.plan import default_beta

from .agreement import agree, comm_device, global_grad_bits
from .alltoall import _plan_key, _world, gather_table, rebalance

__all__ = ["PhaseSpec", "Orchestrator", "StepPlan", "TEXT", "broadcast_from_leader", "connector_lengths"]

TEXT = "text"


@dataclass(frozen=True)
class PhaseSpec:
    """How one phase is balanced.

    ``policy``/``alpha``/``beta``: the cost model of :func:`~mmbalance.balancing.post_balance`
    (``beta=None``: :data:`~mmbalance.balancing.DEFAULT_BETA` for the policies with an attention
    term, as there; the resolved value is what ``spec.beta`` holds). ``downsample``: encoder tokens per LLM token after the connector (e.g. 4 for a 2x2 pixel
    shuffle, 2 for an audio adapter); ignored for the LLM phase.
    """

    policy: str = "sum"
    alpha: float = 1.0
    beta: float | None = None
    downsample: int = 1

    def __post_init__(self):
        if not isinstance(self.policy, str) or self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {list(POLICIES)}, got {self.policy!r}")
        object.__setattr__(self, "beta", default_beta(self.policy, self.beta))
        for name in ("alpha", "beta"):
            as_coefficient(getattr(self, name), name)
        if isinstance(self.downsample, bool) or not isinstance(self.downsample, int) or self.downsample < 1:
            raise ValueError(f"downsample must be an int >= 1, got {self.downsample!r}")


def _phase_plan(lengths: np.ndarray, world: int, spec: PhaseSpec, src: np.ndarray, rpn: int | None) -> Plan:
    """Plan over the examples that have this modality; the others stay home (and cost nothing)."""
    sel = np.flatnonzero(lengths > 0)
    sub = post_balance(
        lengths[sel],
        world,
        spec.policy,
        src_ranks=src[sel],
        ranks_per_node=rpn,
        alpha=spec.alpha,
        beta=spec.beta,
    )
    dst = src.copy()
    dst[sel] = sub.dst_rank
    return _relocated(dst, lengths, world, src, spec, sub.costs)


def _relocated(
    plan_dst: np.ndarray,
    lengths: np.ndarray,
    world: int,
    src: np.ndarray,
    spec: PhaseSpec,
    costs: np.ndarray | None = None,
) -> Plan:
    """A world-level plan sending example ``i`` to rank ``plan_dst[i]``."""
    return Plan.from_destinations(
        lengths, plan_dst, world, src, policy=spec.policy, alpha=spec.alpha, beta=spec.beta, costs=costs
    )


def _group_plan(
    lengths: np.ndarray, world: int, k: int, spec: PhaseSpec, src: np.ndarray, rpn: int | None, balance: bool
) -> Plan:
    """LLM plan over ``world // k`` groups of ``k`` ranks (TP/CP groups); examples go to each group's
    first rank. Without ``balance`` every example stays in its own rank's group."""
    groups = world // k
    gsrc = src // k
    if balance:
        grpn = rpn // k if rpn and rpn % k == 0 and rpn >= k else None
        gplan = post_balance(
            lengths,
            groups,
            spec.policy,
            src_ranks=gsrc,
            ranks_per_node=grpn,
            alpha=spec.alpha,
            beta=spec.beta,
        )
        gdst = gplan.dst_rank
    else:
        gdst = gsrc
    costs = np.zeros(world)
    costs[::k] = batch_costs(lengths, gdst, groups, spec.policy, spec.alpha, spec.beta)
    return _relocated(gdst * k, lengths, world, src, spec, costs)


def connector_lengths(lengths: np.ndarray, downsample: int) -> np.ndarray:
    """LLM tokens an encoder output of ``lengths`` tokens becomes: ``ceil(lengths / downsample)``."""
    return (lengths + downsample - 1) // downsample


@dataclass
class StepPlan:
    """All plans of one training step, identical on every rank, and the moves that use them."""

    rank: int
    world: int
    src_ranks: np.ndarray
    sizes: dict[str, np.ndarray]  # global per-example encoder-input lengths per modality, and text
    llm_parts: dict[str, np.ndarray]  # per-example LLM tokens of every part (text and modalities)
    orders: list[tuple[str, ...]]
    order_ids: np.ndarray
    encoder: dict[str, Plan]
    llm: Plan
    moves: dict[str, Plan] = field(default_factory=dict)  # part -> plan into the LLM layout
    group: object = None
    check: bool = True
    llm_group_size: int = 1
    plan_ms: float = 0.0  # time spent planning (in the background thread)

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

    # ------------------------------------------------------------------ numbers
    def summary(self) -> dict[str, dict[str, float]]:
        """Per phase: max/mean cost over ranks (LLM: over LLM groups) before and after, tokens moved."""
        out = {}
        k = self.llm_group_size
        phases = {**self.encoder, "llm": self.llm}
        for name, plan in phases.items():
            if name == "llm" and k > 1:
                groups = self.world // k
                before = batch_costs(
                    plan.lengths, plan.src_rank // k, groups, plan.policy, plan.alpha, plan.beta
                )
                after = plan.costs[::k]
            else:
                before = batch_costs(
                    plan.lengths, plan.src_rank, self.world, plan.policy, plan.alpha, plan.beta
                )
                after = plan.costs
            mean_b = before.mean() if before.size else 0.0
            mean_a = after.mean() if after.size else 0.0
            out[name] = {
                "before": float(before.max() / mean_b) if mean_b else 1.0,
                "after": float(after.max() / mean_a) if mean_a else 1.0,
                "moved_tokens": int(plan.moved_tokens()),
            }
        return out


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, anchor, shape, group, leader):
        ctx.group, ctx.leader, ctx.in_shape = group, leader, x.shape
        ctx.is_leader = torch.distributed.get_rank() == leader
        buf = x.contiguous().clone() if ctx.is_leader else x.new_empty(tuple(shape))
        torch.distributed.broadcast(buf, src=leader, group=group)
        return buf

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        torch.distributed.reduce(grad, dst=ctx.leader, group=ctx.group)
        if not ctx.is_leader:
            grad = grad.new_zeros(ctx.in_shape)
        return (grad if ctx.needs_input_grad[0] else None), None, None, None, None


def broadcast_from_leader(x: Tensor, shape: Sequence[int], group, leader: int) -> Tensor:
    """The leader's ``x`` on every rank of ``group``; differentiable (gradients are summed back to
    the leader).

    Non-leaders pass their own local tensor (for example the empty batch the plan gave them): it
    is not read, but it keeps the non-leader's earlier collectives (the moves that produced it) in
    the autograd graph, so their backward all-to-alls run on every rank. ``shape`` is the leader's
    shape, known from the plan (no size exchange). ``leader`` is a global rank.

    One agreement collective first: ``shape``, ``leader`` and the dtype must be the same on every
    rank, and the leader's ``x`` must have ``shape``; otherwise every rank raises. When any rank
    needs a gradient, every rank's output requires grad, so the backward reduction runs everywhere.
    """
    problems, err, fields, values = [], None, {}, [0, 0]
    try:
        if not isinstance(x, Tensor):
            raise TypeError(f"x must be a tensor, got {type(x).__name__}")
        shape = tuple(int(s) for s in shape)
        if torch.distributed.get_rank() == leader and tuple(x.shape) != shape:
            raise ValueError(f"x has shape {tuple(x.shape)} on the leader, expected {shape}")
        fields = {"shape": shape, "leader": int(leader), "dtype": x.dtype, "device": x.device.type}
        values = [int(x.requires_grad), int(torch.is_grad_enabled())]
    except (TypeError, ValueError) as exc:
        problems, err = [str(exc)], exc
    agreed = agree(
        "broadcast_from_leader",
        group,
        fields=fields,
        values=values,
        problems=problems,
        device=comm_device(group, x if isinstance(x, Tensor) else None),
        local_error=err,
    )
    needed = global_grad_bits("broadcast_from_leader", agreed, 0)
    anchor = torch.empty(0, device=x.device, requires_grad=bool(needed))
    return _Broadcast.apply(x, anchor, shape, group, leader)


class Orchestrator:
    """Plans every phase of each step, ahead of time, identically on every rank.

    Args:
        encoders: modality name -> :class:`PhaseSpec` (e.g. ``{"vision": PhaseSpec("sum",
            downsample=4), "audio": PhaseSpec("conv", beta=1e-3, downsample=2)}``).
        llm: the LLM phase's :class:`PhaseSpec` (``"sum"`` or ``"quadratic"``).
        orders: the possible interleavings of an example's parts; default one order: every
            modality in the given order, then ``"text"``.
        group: the data-parallel process group.
        ranks_per_node: enables node-aware placement of moved examples.
        check_plans: verify before each move that all ranks hold the same plan (a small
            all-gather per plan).
        background: plan in a worker thread (``submit`` returns at once).
        llm_group_size: ranks per LLM group (tensor/context parallel): the LLM phase is balanced
            over ``world / llm_group_size`` groups and each example lands on its group's first
            rank, which shares the assembled batch with the group (:func:`broadcast_from_leader`).
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
        llm: PhaseSpec = PhaseSpec(),
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
        mat, problems, err = None, [], None
        _, world = _world(self.group)
        try:
            if world % self.llm_group_size:
                raise ValueError(
                    f"llm_group_size ({self.llm_group_size}) must divide the world size ({world})"
                )
            if self.ranks_per_node and world % self.ranks_per_node:
                raise ValueError(
                    f"ranks_per_node ({self.ranks_per_node}) must divide the world size ({world})"
                )
            mat = self._table(sizes, order_ids, names)
        except (TypeError, ValueError) as exc:
            problems, err = [str(exc)], exc
        table, src = gather_table(
            mat,
            self.group,
            entry="Orchestrator.submit",
            problems=problems,
            local_error=err,
            fields={"configuration": self._config_text()},
        )
        rank, world = _world(self.group)
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
        t0 = time.perf_counter()
        names = [*self.encoders, TEXT]
        sizes = {n: np.ascontiguousarray(table[:, k]) for k, n in enumerate(names)}
        order_ids = np.ascontiguousarray(table[:, -1])
        rpn = self.ranks_per_node
        k = self.llm_group_size
        if world % k:
            raise ValueError(f"llm_group_size ({k}) must divide the world size ({world})")
        if self.balance:
            encoder = {m: _phase_plan(sizes[m], world, spec, src, rpn) for m, spec in self.encoders.items()}
        else:
            encoder = {m: _relocated(src, sizes[m], world, src, spec) for m, spec in self.encoders.items()}
        llm_parts = {m: connector_lengths(sizes[m], spec.downsample) for m, spec in self.encoders.items()}
        llm_parts[TEXT] = sizes[TEXT]
        total = np.ascontiguousarray(sum(llm_parts.values()), dtype=np.int64)
        if k == 1 and self.balance:
            llm = post_balance(
                total,
                world,
                self.llm.policy,
                src_ranks=src,
                ranks_per_node=rpn,
                alpha=self.llm.alpha,
                beta=self.llm.beta,
            )
        else:
            llm = _group_plan(total, world, k, self.llm, src, rpn, self.balance)
        moves = {TEXT: llm.with_lengths(llm_parts[TEXT])}
        for m in self.encoders:
            out_len = llm_parts[m]
            moves[m] = llm.with_lengths(out_len).compose(encoder[m].with_lengths(out_len).inverse())
        for p in [*encoder.values(), *moves.values()]:
            _plan_key(p)  # hash the plans here, off the training thread (every move checks them)
        return StepPlan(
            rank=rank,
            world=world,
            src_ranks=src,
            sizes=sizes,
            llm_parts=llm_parts,
            orders=self.orders,
            order_ids=order_ids,
            encoder=encoder,
            llm=llm,
            moves=moves,
            group=self.group,
            check=self.check_plans,
            llm_group_size=k,
            plan_ms=(time.perf_counter() - t0) * 1e3,
        )

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
