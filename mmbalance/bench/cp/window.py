"""``bench cp``'s sliding-window model line: static CP degrees against ours on a model whose layers
attend within a window (Gemma 3: five of every six layers a window of 4096 tokens; Mistral: all).

Ring attention with a window skips the key blocks no query can reach (``collectives/ring/attention.py``:
whole key shards of the ring, and inside a block the kernels' key tiles), so a windowed layer's
causal attention over a sequence of ``l`` tokens costs its window's share of the pairs: ``l**2``
(the cost model's causal unit) while ``l <= W``, ``2 l W - W**2`` beyond. A group's modelled time
is :class:`~mmbalance.balancing.CostModel`'s formula with that sum in place of ``sum(l**2)`` (the
ring still carries every key and value around, so its term is unchanged). The schemes:

* ``static_cp<c>``: :func:`~mmbalance.bench.schemes.static_cp`, its greedy balancing on the
  windowed times;
* ``mmbalance``: :func:`~mmbalance.balancing.cp_schedule` with the windowed group time as its cost
  (a callable: planning takes 0.1 s rather than milliseconds, a benchmark's price);
* ``mmbalance_causal_plan``: the plan made for full causal attention (what
  ``apply_dynamic_cp``'s ``"quadratic"`` cost plans today), timed on the windowed model.

Rows: op ``cp_window_step``, one per dataset, ranks, budget and scheme (``time_ms``: the modelled
step, mean over the steps; ``ours_speedup``: the scheme's mean step over ours).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from mmbalance.balancing import CostModel, cp_schedule

from ..harness import Row, device_name, ms_cell
from . import schemes
from .data import FILL, epoch_longest, step_batches

WINDOW, LOCAL_FRACTION = 4096, 5 / 6
STATIC_DEGREES = (1, 2, 4, 8)
SCHEMES = (*(f"static_cp{c}" for c in STATIC_DEGREES), "mmbalance_causal_plan", "mmbalance")


@dataclasses.dataclass(frozen=True)
class WindowModel:
    """``local_fraction`` of the layers attend within ``window`` tokens, the rest to every earlier
    token."""

    window: int = WINDOW
    local_fraction: float = LOCAL_FRACTION

    def squares(self, lengths) -> np.ndarray:
        """Each sequence's attention in the cost model's causal unit (``l**2`` without a window)."""
        x = np.asarray(lengths, dtype=np.float64)
        w = float(self.window)
        local = np.where(x <= w, x * x, 2.0 * x * w - w * w)
        return self.local_fraction * local + (1.0 - self.local_fraction) * x * x

    def __str__(self) -> str:
        return f"{self.local_fraction:.3g} of the layers a window of {self.window} tokens"


def group_time(cost: CostModel, model: WindowModel):
    """The windowed time of one group, as :func:`cp_schedule` takes a callable cost."""

    def time(lengths: np.ndarray, degree: int) -> float:
        x = np.asarray(lengths, dtype=np.float64)
        return float(
            schemes.times_of(
                cost,
                np.array([x.sum()]),
                np.array([model.squares(x).sum()]),
                np.array([x.size]),
                np.array([degree]),
            )[0]  # fmt: skip
        )

    return time


@dataclasses.dataclass
class WindowResult:
    dataset: str
    world: int
    memory_per_rank: int
    model: WindowModel
    step: dict[str, np.ndarray]
    reason: dict[str, str]

    def feasible(self, scheme: str) -> bool:
        return bool(np.isfinite(self.step[scheme]).all())

    def best_static(self) -> str | None:
        ok = [s for s in SCHEMES[: len(STATIC_DEGREES)] if self.feasible(s)]
        return min(ok, key=lambda s: float(self.step[s].mean())) if ok else None


def run_config(dataset: str, world: int, memory_per_rank: int, steps: int, cost: CostModel,
               model: WindowModel = WindowModel(), *, fill: float = FILL, seed: int = 0) -> WindowResult:  # fmt: skip
    """Every scheme on ``steps`` steps of ``dataset``, timed on the windowed model."""
    batches = step_batches(dataset, world, memory_per_rank, steps, fill, seed)
    step = {s: np.full(len(batches), math.nan) for s in SCHEMES}
    reason: dict[str, str] = {}
    longest = epoch_longest(dataset)
    timed = group_time(cost, model)
    for t, lengths in enumerate(batches):
        schedules = []
        for c in STATIC_DEGREES:
            if c * memory_per_rank < longest:
                reason.setdefault(f"static_cp{c}", f"{c} x {memory_per_rank} tokens cannot hold {longest}")
                continue
            schedules.append(
                schemes.static_cp(lengths, world, memory_per_rank, c, cost, squares=model.squares)
            )
        causal, _ = schemes.ours(lengths, world, memory_per_rank, cost)
        schedules.append(dataclasses.replace(causal, scheme="mmbalance_causal_plan"))
        plan = cp_schedule(lengths, world, memory_per_rank, timed, vectorized=False)
        degree = np.array([g.degree for g in plan], dtype=np.int64)
        schedules.append(schemes.Schedule("mmbalance", (schemes.Round(degree, plan.group_of(lengths.size)),)))
        for sched in schedules:
            schemes.check_schedule(sched, lengths, world, memory_per_rank)
            if not sched.feasible:
                reason.setdefault(sched.scheme, str(sched.infeasible))
                continue
            step[sched.scheme][t] = schemes.step_time(sched, lengths, cost, model.squares(lengths))
    return WindowResult(dataset, world, memory_per_rank, model, step, reason)


def rows_of(res: WindowResult) -> list[Row]:
    dev = device_name()
    shape = f"{res.dataset}/R{res.world}/M{res.memory_per_rank}/W{res.model.window}"
    ours = float(res.step["mmbalance"].mean())
    best = res.best_static()
    rows = []
    for s in SCHEMES:
        mean = float(res.step[s].mean()) if res.feasible(s) else math.nan
        metrics = {
            "data": res.dataset, "ranks": res.world, "memory_per_rank": res.memory_per_rank, "modelled": True,
            "window": res.model.window, "local_fraction": res.model.local_fraction, "feasible": res.feasible(s),
            "infeasible": res.reason.get(s, ""), "ours_speedup": mean / ours,
        }  # fmt: skip
        if s == "mmbalance":
            metrics["best_static"] = best or "none"
            metrics["vs_best_static"] = float(res.step[best].mean()) / ours if best else math.nan
        rows.append(Row("cp_window_step", s, shape, "-", dev, 1e3 * mean, metrics))
    return rows


def summary_table(results: list[WindowResult]) -> str:
    if not results:
        return ""
    head = " | ".join(f"static {c}" for c in STATIC_DEGREES)
    lines = [
        f"sliding-window model ({results[0].model}), mean modelled step time (ms):",
        "",
        f"| data | ranks | tokens/rank | {head} | ours, planned for causal | ours | ours vs best static |",
        "|---|---|---|" + "---|" * len(STATIC_DEGREES) + "---|---|---|",
    ]
    for r in results:
        mean = {s: float(r.step[s].mean()) if r.feasible(s) else math.nan for s in SCHEMES}
        best = r.best_static()
        cells = schemes.static_cells(mean, best, STATIC_DEGREES)
        vs = f"{mean[best] / mean['mmbalance']:.2f}x" if best else "-"
        lines.append(
            f"| {r.dataset} | {r.world} | {r.memory_per_rank} | {cells} | {ms_cell(mean['mmbalance_causal_plan'])} "
            f"| {ms_cell(mean['mmbalance'])} | {vs} |"
        )
    return "\n".join(lines)
