"""The balance in the logs people read: ``mmbalance/*`` keys in every ``Trainer.log`` call of a
balanced trainer, so TensorBoard, W&B and a framework's own log files show them with no setup.

Sources record one row of numbers per optimizer step (a callback's ``on_step_end``; an encoder
records every forward, averaged over its step); each ``Trainer.log`` call gets the averages over
the steps since the call before it (the logging interval), or the last interval's where none
passed (the run's closing summary). The keys, by phase:

* ``mmbalance/batches/cost_before``, ``cost_after``: max/mean over the ranks of a step's cost, its
  examples dealt as sampled (as ``DistributedSampler`` deals them) and as balanced;
  ``micro_before``, ``micro_after``: the same of the worst micro-batch slot of the step;
  ``plan_ms``: the epoch's planning, per step;
* ``mmbalance/<encoder>/before``, ``after``: max/mean over the ranks of an encoder's cost (e.g.
  ``vision``, ``audio``); ``moved``: the fraction of its items encoded on another rank;
  ``plan_ms``: the size exchange and planning of a forward;
* ``mmbalance/cp/max_degree``, ``groups``, ``largest_shard``: the context-parallel schedule of a
  micro-batch (its largest degree, its number of groups, the most tokens a rank held); for
  streamed data also ``before``, ``after`` (max/mean modelled time as drawn and as planned),
  ``moved_tokens`` and ``plan_ms``.
"""

from __future__ import annotations

import math
from collections.abc import Callable

__all__ = ["PREFIX", "BalanceLog", "balance_log", "mean_rows"]

PREFIX = "mmbalance/"
_ATTR = "_mmbalance_log"


class BalanceLog:
    """The ``mmbalance/*`` keys of one trainer (:func:`balance_log` makes it and hooks it in)."""

    def __init__(self) -> None:
        #: ``name -> fn(state) -> {key: value}``: each called at every step's end with Trainer's
        #: state (``global_step`` is the step that just ended)
        self.sources: dict[str, Callable[..., dict[str, float]]] = {}
        self.rows: list[dict[str, float]] = []
        self.last: dict[str, float] = {}

    def add_source(self, name: str, fn: Callable[..., dict[str, float]]) -> None:
        """Record ``fn(state)`` (keys without the prefix) at the end of every optimizer step."""
        self.sources[name] = fn

    def step_end(self, state=None) -> None:
        row: dict[str, float] = {}
        for fn in self.sources.values():
            for key, value in fn(state).items():
                if isinstance(value, (int, float)) and math.isfinite(value):
                    row[PREFIX + key] = float(value)
        if row:
            self.rows.append(row)

    def keys(self) -> dict[str, float]:
        """The averages over the steps since the last call (then forgotten), or that call's."""
        if self.rows:
            self.last, self.rows = mean_rows(self.rows), []
        return dict(self.last)


def mean_rows(rows: list[dict[str, float]]) -> dict[str, float]:
    """Each key's mean over the rows that hold it."""
    names = sorted({k for row in rows for k in row})
    return {k: sum(row[k] for row in rows if k in row) / sum(1 for row in rows if k in row) for k in names}


_CALLBACK_CLASS: type | None = None


def _callback_class() -> type:
    global _CALLBACK_CLASS
    if _CALLBACK_CLASS is None:
        from transformers import TrainerCallback

        class BalanceLogCallback(TrainerCallback):
            """Records every optimizer step's balance for the next ``Trainer.log`` call."""

            def __init__(self, log: BalanceLog):
                self.log = log

            def on_step_end(self, args, state, control, **kwargs):
                self.log.step_end(state)

        _CALLBACK_CLASS = BalanceLogCallback
    return _CALLBACK_CLASS


def balance_log(trainer) -> BalanceLog:
    """The trainer's :class:`BalanceLog`, made and hooked in on first use: a callback records each
    step, and the trainer's ``log`` (on the instance) adds the keys to every call."""
    log = trainer.__dict__.get(_ATTR)
    if log is not None:
        return log
    log = BalanceLog()
    trainer.__dict__[_ATTR] = log
    trainer.add_callback(_callback_class()(log))
    stock = trainer.log

    def with_balance(logs: dict, *args, **kwargs):
        if isinstance(logs, dict):
            logs = {**logs, **log.keys()}
        return stock(logs, *args, **kwargs)

    with_balance.__wrapped__ = stock  # type: ignore[attr-defined]
    trainer.log = with_balance
    return log
