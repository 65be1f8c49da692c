"""``"mmbalance_varlen"`` under ``torch.compile``, and its plans cached across a forward's layers.

The backend plans every batch on the host: where each packed sequence starts, which keys a padded
row keeps (``plan.py``, ``host_plan``). That reads tensor values, so Dynamo cannot trace it. The
planning stays out of the graph:

* the mask function (``mask.varlen_mask``) plans the mask it returns right away, so the
  model's layers only look the plan up and trace through to the op. Inside a compiled region the
  mask function itself runs outside the graph: one graph break per forward and mask type (Dynamo
  counts it once in every frame around it), whatever the number of layers. A mask built before
  the compiled function runs (``generate``'s decoding masks) costs no break at all;
* a call without our mask that brings tensors to read (a vision tower's ``cu_seq_lens``, a 2-D or
  4-D mask handed in from outside, packed ``position_ids``) plans outside the graph, one break per
  call, and the plan is cached (see :class:`PlanCache`) so the layers of one forward plan once; a
  call with nothing to read (cross-attention without a mask) is planned from its shapes in the
  graph (``plan.rows_plan``).

Where a break is needed, ``torch.compile(fullgraph=True)`` (and ``torch.export``) raise
:class:`FullgraphUnsupported` at the first call, a ``NotImplementedError`` naming the backend and
what to do instead.
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, TypeVar

import torch

__all__ = ["FullgraphUnsupported", "refuse_fullgraph", "outside_graph", "PlanCache"]

try:  # Dynamo re-raises its own Unsupported errors unchanged, so ours reaches the caller as it is
    from torch._dynamo.exc import Unsupported as _Unsupported
except ImportError:  # pragma: no cover - torch without Dynamo
    _Unsupported = RuntimeError  # type: ignore[misc, assignment]


class FullgraphUnsupported(NotImplementedError, _Unsupported):  # type: ignore[misc]
    """``mmbalance_varlen`` inside ``torch.compile(fullgraph=True)`` or ``torch.export``."""

    def __init__(self, backend: str, where: str):
        msg = (
            f"{backend} does not support torch.compile(fullgraph=True) (nor torch.export): {where} "
            "reads the batch's sequence boundaries and padding on the host, a graph break. Compile without "
            "fullgraph (torch.compile's default: the backend then breaks the graph at its mask function only, "
            "once per forward), build the attention mask outside the compiled function (generate() does for its "
            "decoding steps, so static-cache decoding compiles with fullgraph=True), or use "
            "attn_implementation='sdpa'"
        )
        if _Unsupported is RuntimeError:  # pragma: no cover
            NotImplementedError.__init__(self, msg)
        else:
            _Unsupported.__init__(self, msg, "mmbalance_varlen under fullgraph")


@functools.lru_cache(maxsize=1)
def _tracer_state() -> Callable[[], Any] | None:
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator
    except ImportError:  # pragma: no cover
        return None
    return InstructionTranslator.current_tx


def _check_fullgraph(backend: str, where: str) -> bool:
    """Run by Dynamo at trace time (``assume_constant_result``), outside the graph: raise when the
    frame being traced may not break."""
    current = _tracer_state()
    tx = current() if current is not None else None
    if tx is not None and (getattr(tx, "one_graph", False) or getattr(tx, "error_on_graph_break", False)):
        raise FullgraphUnsupported(backend, where)
    return True


try:
    _check_fullgraph_traced = torch._dynamo.assume_constant_result(_check_fullgraph)
except AttributeError:  # pragma: no cover
    _check_fullgraph_traced = _check_fullgraph


def refuse_fullgraph(backend: str, where: str) -> None:
    """Under Dynamo with ``fullgraph=True``: raise :class:`FullgraphUnsupported` (``backend``'s
    ``where`` cannot be traced). Otherwise nothing."""
    if torch.compiler.is_compiling():
        _check_fullgraph_traced(backend, where)


F = TypeVar("F", bound=Callable[..., Any])


def outside_graph(backend: str, where: str) -> Callable[[F], F]:
    """``fn`` runs eagerly even inside a compiled region: a graph break there, or
    :class:`FullgraphUnsupported` under ``fullgraph=True``. Eager callers call ``fn`` directly."""

    def wrap(fn: F) -> F:
        disabled = torch.compiler.disable(fn, reason=f"{backend}: {where} runs on the host")

        @functools.wraps(fn)
        def call(*args, **kwargs):
            if torch.compiler.is_compiling():
                refuse_fullgraph(backend, where)
                return disabled(*args, **kwargs)
            return fn(*args, **kwargs)

        return call  # type: ignore[return-value]

    return wrap


class PlanCache:
    """The last few plans of calls that bring no mask description of ours, keyed by the tensors
    they were planned from (the same ``cu_seq_lens``, padding mask or ``position_ids`` object,
    unchanged since: its version counter) and the call's shape and settings.

    Every layer of a forward gets the same tensors, so the layers after the first reuse its plan.
    Tensors are held weakly: a freed tensor's entry can never match a new one. Inference tensors
    have no version counter; calls with them are planned every time.
    """

    def __init__(self, size: int = 8):
        self.size = size
        self._entries: OrderedDict[tuple, tuple[tuple, Any]] = OrderedDict()
        self._lock = threading.Lock()

    @staticmethod
    def _stamp(tensors: tuple) -> tuple | None:
        stamp: list[tuple[int, int] | None] = []
        for t in tensors:
            if t is None:
                stamp.append(None)
                continue
            try:
                stamp.append((id(t), t._version))
            except RuntimeError:  # an inference tensor: no version counter, no way to see changes
                return None
        return tuple(stamp)

    def get_or_plan(self, tensors: tuple, settings: tuple, plan: Callable[[], Any]):
        """The cached plan for these tensors and settings, else ``plan()`` (then cached)."""
        stamp = self._stamp(tensors)
        if stamp is None:
            return plan()
        key = (stamp, settings)
        with self._lock:
            hit = self._entries.get(key)
            if hit is not None and all(
                (r is None and t is None) or (r is not None and r() is t) for r, t in zip(hit[0], tensors)
            ):
                self._entries.move_to_end(key)
                return hit[1]
        value = plan()
        refs = tuple(None if t is None else weakref.ref(t) for t in tensors)
        with self._lock:
            self._entries[key] = (refs, value)
            while len(self._entries) > self.size:
                self._entries.popitem(last=False)
        return value

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
