"""The agreement step: one small collective before any data moves, so a fault raises on every rank.

Every entry point of ``mmbalance.collectives`` that talks between ranks starts with :func:`agree`.
Each rank contributes one fixed-size int64 word vector::

    [tag, ok, digest, v0, v1, v2, v3, v4]

* ``tag``: which entry point the rank is in (ranks in different collectives are caught here);
* ``ok``: whether this rank's own inputs passed its local validation. Validation that can fail on
  one rank only is never raised before the agreement: it is reported here, so every rank raises;
* ``digest``: a hash of the *fields* that must be equal on every rank (plan hash, dtypes, trailing
  shapes, flags, global sizes);
* ``v0..v4``: per-rank *values* the caller needs from every rank (row counts, requires-grad bits).

One ``all_gather`` of 64 bytes per rank. When every rank is ok and the digests agree the call
returns the values; otherwise every rank joins a second gather of a short text (its problems, or
its fields when the digests differ) and raises the same message, naming the ranks, the argument
and each rank's value. The vector has the same size for every entry point, so even ranks that
entered different collectives pair up and fail cleanly instead of mismatching sizes (which would
abort the process inside the communication library).

Ranks that never arrive (a dead process, a rank that left the step) can only be noticed by the
process group's timeout: the gather then raises on every waiting rank.

Entry points use it through :class:`Entry`, the one protocol every cross-rank call follows::

    with Entry("rebalance", group) as e:       # local validation: a TypeError/ValueError raised
        check(...)                               # here is recorded, not raised
        e.fields["plan"] = plan.key              # must be equal on every rank
        e.values = [grad_bits, torch.is_grad_enabled()]
        e.like = tensor                          # the device the control tensors go to
    agreed = e.agree()                           # raises on every rank if any rank had a problem
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence

import torch
import torch.distributed as dist

from .group import comm_device, initialized, world_of
from .inflight import run

__all__ = ["RankMismatchError", "Agreement", "Entry", "agree", "global_grad_bits"]

WORDS = 8
VALUES = WORDS - 3
MESSAGE_BYTES = 1024
_SEP = "\x1e"  # between a rank's fields and its problems in the explanation gather
_MAGIC = 0x6D6D62 << 40  # "mmb" in the high bits of the tag


class RankMismatchError(ValueError, RuntimeError):
    """Ranks of a collective disagree (inputs, flags, plans), or some rank's input is invalid.

    Raised on every rank of the group with the same message, before any data moves. It is a
    ``ValueError`` (bad input) and a ``RuntimeError`` (the collective cannot run).
    """


def _hash64(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little", signed=True)


def _render(value) -> str:
    if isinstance(value, torch.dtype):
        return str(value).replace("torch.", "")
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, (tuple, list)):
        return "(" + ", ".join(_render(v) for v in value) + ("," if len(value) == 1 else "") + ")"
    return str(value)


def describe(fields: Mapping[str, object]) -> str:
    """The canonical text of ``fields`` (what is hashed, and shown when ranks differ)."""
    return "; ".join(f"{k}={_render(v)}" for k, v in fields.items())


class Agreement:
    """What every rank reported: ``values[r]`` is rank ``r``'s tuple of ints."""

    def __init__(self, values: list[tuple[int, ...]]):
        self.values = values

    def column(self, j: int) -> list[int]:
        return [v[j] for v in self.values]

    def any(self, j: int) -> int:
        """Bitwise OR of value ``j`` over the ranks."""
        out = 0
        for v in self.values:
            out |= v[j]
        return out


def global_grad_bits(entry: str, agreed: Agreement, index: int) -> int:
    """The OR over ranks of the requires-grad bits in value ``index``; value ``index + 1`` holds
    each rank's ``torch.is_grad_enabled()``.

    When any rank needs a gradient, every rank must reach the backward collective, so a rank
    running without grad mode then is refused on every rank (it would never call backward).
    """
    bits = agreed.any(index)
    if bits:
        off = [r for r, on in enumerate(agreed.column(index + 1)) if not on]
        if off:
            raise RankMismatchError(
                f"{entry} refused on every rank, nothing was moved: ranks {off} run without gradients "
                "(torch.no_grad / inference mode) while other ranks need them; the backward "
                "collective would wait for them forever"
            )
    return bits


def _gather(vec: Sequence[int], group, device: torch.device) -> list[list[int]]:
    world = dist.get_world_size(group)
    local = torch.tensor(list(vec), dtype=torch.int64, device=device)
    out = torch.empty(world * local.numel(), dtype=torch.int64, device=device)
    run(dist.all_gather_single, out, local, group=group)
    flat = out.tolist()
    n = local.numel()
    return [flat[r * n : (r + 1) * n] for r in range(world)]


def _gather_text(text: str, group, device: torch.device) -> list[str]:
    raw = text.encode("utf-8")[:MESSAGE_BYTES]
    buf = torch.zeros(MESSAGE_BYTES, dtype=torch.uint8, device=device)
    if raw:
        buf[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(device)
    world = dist.get_world_size(group)
    out = torch.empty(world * MESSAGE_BYTES, dtype=torch.uint8, device=device)
    run(dist.all_gather_single, out, buf, group=group)
    data = out.cpu().numpy().tobytes()
    return [
        data[r * MESSAGE_BYTES : (r + 1) * MESSAGE_BYTES].rstrip(b"\0").decode("utf-8", "replace")
        for r in range(world)
    ]


def _field_values(text: str) -> dict[str, str]:
    out = {}
    for part in text.split("; "):
        k, sep, v = part.partition("=")
        if sep:
            out[k] = v
    return out


def agree(
    entry: str,
    group=None,
    *,
    fields: Mapping[str, object] | None = None,
    values: Iterable[int] = (),
    problems: Sequence[str] = (),
    device: torch.device | None = None,
    local_error: BaseException | None = None,
) -> Agreement:
    """The agreement collective of ``entry`` (see the module docstring); returns every rank's values.

    Args:
        entry: the public name of the calling entry point (it starts every message).
        group: the process group.
        fields: name -> value that must be equal on every rank (ints, bools, strings, dtypes,
            tuples; compared by a hash of their text).
        values: up to five non-negative ints this rank reports (returned for every rank).
        problems: what is wrong with this rank's inputs; any problem on any rank raises everywhere.
        device: where the control tensors live (default: the group backend's device).
        local_error: the exception behind ``problems`` on this rank; this rank re-raises its type
            (``TypeError`` stays a ``TypeError``) with the agreed message.

    Raises:
        RankMismatchError on every rank (the failing rank: its own error type) when some rank has
        problems, ranks are in different entry points, or a field differs between ranks.
    """
    vals = [int(v) for v in values]
    if len(vals) > VALUES:
        raise ValueError(f"agree: at most {VALUES} values, got {len(vals)}")
    vals += [0] * (VALUES - len(vals))
    fields = dict(fields or {})
    text = describe(fields)
    dev = device if device is not None else comm_device(group)
    tag = _MAGIC ^ (_hash64(entry) & ((1 << 40) - 1))
    rows = _gather([tag, 0 if problems else 1, _hash64(text), *vals], group, dev)
    tags = [r[0] for r in rows]
    bad = [r for r, row in enumerate(rows) if row[1] != 1]
    digests = {row[2] for row in rows}
    if tags.count(tag) == len(tags) and not bad and len(digests) == 1:
        return Agreement([tuple(row[3 : 3 + VALUES]) for row in rows])
    # Some rank is unhappy: every rank knows it now, so every rank joins the explanation.
    texts = _gather_text(text + _SEP + "\n".join(problems), group, dev)
    msg = _explain(entry, tag, rows, texts, fields)
    if local_error is not None:
        try:
            err = type(local_error)(msg)
        except Exception:  # noqa: BLE001 - an exception type that takes other arguments
            err = RankMismatchError(msg)
        raise err from local_error
    raise RankMismatchError(msg)


def _explain(
    entry: str, tag: int, rows: list[list[int]], texts: list[str], fields: Mapping[str, object]
) -> str:
    lines = []
    others = [r for r, row in enumerate(rows) if row[0] != tag]
    if others:
        lines.append(
            f"ranks {others} are in a different collective than {entry} (or a different version of "
            "mmbalance): every rank of the group must make the same calls in the same order"
        )
    parts = [t.partition(_SEP) for t in texts]
    bad = [r for r, row in enumerate(rows) if row[1] != 1 and row[0] == tag]
    for r in bad:
        lines.append(f"rank {r}: {parts[r][2].replace(chr(10), '; ') or '(message lost)'}")
    good = [r for r, row in enumerate(rows) if row[1] == 1 and row[0] == tag]
    if len({rows[r][2] for r in good}) > 1:
        mine = _field_values(describe(fields))
        per_rank = {r: _field_values(parts[r][0]) for r in good}
        differing = [k for k in mine if len({p.get(k, "?") for p in per_rank.values()}) > 1]
        if not differing:  # a field's text was cut by the message size limit
            differing = ["(fields)"]
            per_rank = {r: {"(fields)": parts[r][0]} for r in good}
        for k in differing:
            by_value: dict[str, list[int]] = {}
            for r, p in per_rank.items():
                by_value.setdefault(p.get(k, "?"), []).append(r)
            shown = ", ".join(
                f"ranks {rs}: {v}" if len(rs) > 1 else f"rank {rs[0]}: {v}" for v, rs in by_value.items()
            )
            lines.append(f"{k} differs between ranks ({shown})")
    return f"{entry} refused on every rank, nothing was moved: " + "; ".join(lines)


class Entry:
    """The agreement protocol of one call of a cross-rank entry point (see the module docstring).

    Inside the ``with`` block the entry point validates its local inputs and fills ``fields``
    (what must be equal on every rank), ``values`` (up to five ints it needs from every rank) and
    ``like`` (a tensor on the device the control tensors should use). A ``TypeError`` or
    ``ValueError`` raised in the block is kept as this rank's problem instead of propagating, so
    the rank still joins the agreement; :meth:`agree` then raises the same error on every rank.
    ``problem(text)`` records a problem found without raising.
    """

    __slots__ = ("name", "group", "fields", "values", "like", "problems", "error")

    def __init__(self, name: str, group=None):
        self.name = name
        self.group = group
        self.fields: dict[str, object] = {}
        self.values: list[int] = []
        self.like: torch.Tensor | None = None
        self.problems: list[str] = []
        self.error: BaseException | None = None

    def __enter__(self) -> Entry:
        return self

    def __exit__(self, typ, exc, tb) -> bool:
        if isinstance(exc, (TypeError, ValueError)) and not isinstance(exc, RankMismatchError):
            self.problems.append(str(exc))
            self.error = exc
            return True
        return False

    def problem(self, text: str) -> None:
        self.problems.append(text)

    def agree(self) -> Agreement:
        """Run the agreement collective; returns every rank's values or raises on every rank."""
        if self.error is not None and not initialized():
            raise self.error  # no process group: nobody to agree with, the local error stands
        world_of(self.group)
        like = self.like if isinstance(self.like, torch.Tensor) else None
        return agree(
            self.name,
            self.group,
            fields=self.fields,
            values=[int(v) for v in self.values],
            problems=self.problems,
            device=comm_device(self.group, like),
            local_error=self.error,
        )

    def grad_bits(self, agreed: Agreement, index: int) -> int:
        """:func:`global_grad_bits` of this entry point (value ``index``: requires-grad bits,
        ``index + 1``: grad mode)."""
        return global_grad_bits(self.name, agreed, index)
