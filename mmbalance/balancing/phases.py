"""Plans of one multimodal training step, phase by phase (OrchMLLM section 6), numpy only.

Given every example's size in every part (each encoder's input length, and its text tokens), the
rank each example was sampled on, and a :class:`PhaseSpec` per phase, :func:`plan_step` makes

* one post-balancing plan per encoder phase over that encoder's input lengths (examples without
  the modality stay where they are), with the phase's own policy (``"sum"`` or ``"quadratic"`` for
  a packed ViT, ``"padded"``/``"conv"`` for a padded audio encoder, ...);
* one plan for the LLM over each example's interleaved sequence: its text plus every encoder's
  output after the connector (``ceil(len / downsample)`` tokens), over ranks or over groups of
  ranks (tensor/context parallel groups: each example lands on its group's first rank);
* the composed moves ``plan_llm o plan_encoder^-1``: encoder outputs go straight from the encoder
  layout to the rank where the LLM needs them, one all-to-all instead of two.

Everything here is a pure function of its inputs, so every rank computes the same plans; the
moves themselves are :class:`mmbalance.collectives.StepPlan`'s, and
:class:`mmbalance.collectives.Orchestrator` gathers the sizes and plans in a background thread.
Being numpy only, the planning also runs in data-loader workers.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from .plan import POLICIES, Plan, default_beta, imbalance
from .post_balance import post_balance
from .validate import as_coefficient, as_count, as_lengths, as_ranks

__all__ = ["TEXT", "PhaseSpec", "PhasePlans", "connector_lengths", "phase_plan", "group_plan", "plan_step"]

TEXT = "text"


@dataclass(frozen=True)
class PhaseSpec:
    """How one phase is balanced.

    ``policy``/``alpha``/``beta``: the cost model of :func:`~mmbalance.balancing.post_balance`
    (``beta=None``: :data:`~mmbalance.balancing.DEFAULT_BETA` for the policies with an attention
    term, as there; the resolved value is what ``spec.beta`` holds). ``downsample``: encoder tokens
    per LLM token after the connector (e.g. 4 for a 2x2 pixel shuffle, 2 for an audio adapter);
    ignored for the LLM phase.
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


def connector_lengths(lengths, downsample: int) -> np.ndarray:
    """LLM tokens an encoder output of ``lengths`` tokens becomes: ``ceil(lengths / downsample)``."""
    lengths = as_lengths(lengths)
    downsample = as_count(downsample, "downsample")
    return (lengths + downsample - 1) // downsample


def _relocated(
    dst: np.ndarray, lengths: np.ndarray, world: int, src: np.ndarray, spec: PhaseSpec, costs=None
) -> Plan:
    return Plan.from_destinations(
        lengths, dst, world, src, policy=spec.policy, alpha=spec.alpha, beta=spec.beta, costs=costs
    )


def phase_plan(
    lengths,
    world: int,
    spec: PhaseSpec,
    src_ranks,
    ranks_per_node: int | None = None,
    *,
    balance: bool = True,
) -> Plan:
    """One encoder phase: a located plan over the examples that have this modality (``lengths >
    0``); the others stay home and cost nothing. ``balance=False``: everything stays home."""
    lengths = as_lengths(lengths)
    src = as_ranks(src_ranks, lengths.size, world, "src_ranks")
    if not balance:
        return _relocated(src, lengths, world, src, spec)
    sel = np.flatnonzero(lengths > 0)
    sub = post_balance(
        lengths[sel], world, spec.policy, src_ranks=src[sel], ranks_per_node=ranks_per_node,
        alpha=spec.alpha, beta=spec.beta,
    )  # fmt: skip
    dst = src.copy()
    dst[sel] = sub.dst_rank
    return _relocated(dst, lengths, world, src, spec, sub.costs)


def group_plan(
    lengths,
    world: int,
    group_size: int,
    spec: PhaseSpec,
    src_ranks,
    ranks_per_node: int | None = None,
    *,
    balance: bool = True,
) -> Plan:
    """A plan over ``world // group_size`` groups of ranks (TP/CP groups): examples go to their
    group's first rank; ``costs`` hold each group's cost at its first rank (0 elsewhere). Without
    ``balance`` every example stays in its own rank's group."""
    lengths = as_lengths(lengths)
    src = as_ranks(src_ranks, lengths.size, world, "src_ranks")
    k = as_count(group_size, "group_size")
    if world % k:
        raise ValueError(f"group_size ({k}) must divide the world size ({world})")
    groups = world // k
    gsrc = src // k
    if balance:
        grpn = (
            ranks_per_node // k
            if ranks_per_node and ranks_per_node % k == 0 and ranks_per_node >= k
            else None
        )
        gdst = post_balance(
            lengths,
            groups,
            spec.policy,
            src_ranks=gsrc,
            ranks_per_node=grpn,
            alpha=spec.alpha,
            beta=spec.beta,
        ).dst_rank
    else:
        gdst = gsrc
    probe = _relocated(gdst * k, lengths, world, src, spec)
    costs = np.zeros(world)
    costs[::k] = probe.batch_costs(gdst, groups)
    return _relocated(gdst * k, lengths, world, src, spec, costs)


@dataclass
class PhasePlans:
    """Every plan of one step, identical on every rank (see the module docstring).

    ``sizes``: per part (each modality and ``"text"``), every example's input length; ``llm_parts``:
    per part, every example's LLM tokens; ``encoder``: per modality, its phase plan; ``llm``: the
    LLM plan; ``moves``: per part, the plan that takes that part from where it is produced (the
    encoder layout, or the sampling layout for text) to the LLM layout.
    """

    world: int
    src_ranks: np.ndarray
    sizes: dict[str, np.ndarray]
    llm_parts: dict[str, np.ndarray]
    orders: list[tuple[str, ...]]
    order_ids: np.ndarray
    encoder: dict[str, Plan]
    llm: Plan
    moves: dict[str, Plan] = field(default_factory=dict)
    llm_group_size: int = 1
    plan_ms: float = 0.0  # time spent planning

    def summary(self) -> dict[str, dict[str, float]]:
        """Per phase: max/mean cost over ranks (the LLM: over its groups) before and after the
        move, and the tokens moved."""
        out = {}
        k = self.llm_group_size
        for name, plan in {**self.encoder, "llm": self.llm}.items():
            if name == "llm" and k > 1:
                groups = self.world // k
                before = plan.batch_costs(self.src_ranks // k, groups)
                after = plan.costs[::k]
            else:
                before = plan.source_costs()
                after = plan.costs
            out[name] = {
                "before": imbalance(before),
                "after": imbalance(after),
                "moved_tokens": int(plan.moved_tokens()),
            }
        return out


def plan_step(
    sizes: Mapping[str, np.ndarray],
    src_ranks,
    world: int,
    encoders: Mapping[str, PhaseSpec],
    llm: PhaseSpec | None = None,
    *,
    orders: Sequence[Sequence[str]] | None = None,
    order_ids=None,
    ranks_per_node: int | None = None,
    llm_group_size: int = 1,
    balance: bool = True,
) -> PhasePlans:
    """All plans of one step from the global per-example sizes (rank-major, as gathered).

    Args:
        sizes: ``{modality: [n] encoder input lengths, ..., "text": [n] text tokens}`` (0 where an
            example lacks a modality).
        src_ranks: ``[n]`` the rank each example was sampled on.
        world: data-parallel ranks.
        encoders, llm: the phases' :class:`PhaseSpec` (``llm`` default: ``PhaseSpec()``, "sum").
        orders, order_ids: the interleavings of an example's parts and each example's (default:
            the encoders in the given order, then text).
        ranks_per_node: node-aware placement of moved examples.
        llm_group_size: ranks per LLM group; the LLM phase is balanced over the groups.
        balance: ``False`` keeps everything where it was sampled (the same plans' shapes, for
            comparisons).
    """
    t0 = time.perf_counter()
    llm = PhaseSpec() if llm is None else llm
    names = [*encoders, TEXT]
    sizes = {n: as_lengths(sizes[n], f"sizes[{n!r}]") for n in names}
    n = sizes[TEXT].size
    src = as_ranks(src_ranks, n, world, "src_ranks")
    order_ids = np.zeros(n, dtype=np.int64) if order_ids is None else as_lengths(order_ids, "order_ids")
    order_list: list[tuple[str, ...]] = [tuple(o) for o in (orders or [names])]
    k = as_count(llm_group_size, "llm_group_size")
    if world % k:
        raise ValueError(f"llm_group_size ({k}) must divide the world size ({world})")
    rpn = ranks_per_node
    encoder = {
        m: phase_plan(sizes[m], world, spec, src, rpn, balance=balance) for m, spec in encoders.items()
    }
    llm_parts = {m: connector_lengths(sizes[m], spec.downsample) for m, spec in encoders.items()}
    llm_parts[TEXT] = sizes[TEXT]
    total = np.ascontiguousarray(sum(llm_parts.values()), dtype=np.int64)
    if k == 1 and balance:
        llm_plan = post_balance(
            total, world, llm.policy, src_ranks=src, ranks_per_node=rpn, alpha=llm.alpha, beta=llm.beta
        )
    else:
        llm_plan = group_plan(total, world, k, llm, src, rpn, balance=balance)
    moves = {TEXT: llm_plan.with_lengths(llm_parts[TEXT])}
    for m in encoders:
        out_len = llm_parts[m]
        moves[m] = llm_plan.with_lengths(out_len).compose(encoder[m].with_lengths(out_len).inverse())
    for p in [*encoder.values(), *moves.values()]:
        p.key  # noqa: B018 - hash the plans here, off the training thread (every move checks them)
    return PhasePlans(
        world=world,
        src_ranks=src,
        sizes=sizes,
        llm_parts=llm_parts,
        orders=order_list,
        order_ids=order_ids,
        encoder=encoder,
        llm=llm_plan,
        moves=moves,
        llm_group_size=k,
        plan_ms=(time.perf_counter() - t0) * 1e3,
    )
