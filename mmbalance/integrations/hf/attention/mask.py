"""The mask side of the ``"mmbalance_varlen"`` backend: what transformers' mask functions express,
kept in a form the varlen op can run.

transformers builds every attention mask in ``masking_utils`` from a *mask function*
``f(batch, head, q_idx, kv_idx) -> bool`` composed of a few known pieces (causal or bidirectional,
sliding window, chunked, packed sequences, padding), and hands it to the mask function registered
for the backend (``AttentionMaskInterface``). flash-attention's mask function keeps only the 2-D
padding mask and so loses the rest (chunked attention, for one). Ours, :func:`varlen_mask`, reads
the composition back into a :class:`VarlenMask` (no ``Lq x Lk`` tensor is ever built) and refuses
what the op cannot express (e.g. bidirectional attention inside images, arbitrary ``or`` overlays)
with a ``ValueError`` naming the backend and the piece.

Positions follow ``masking_utils``: query ``i`` sits at ``q_offset + i`` and key ``j`` at
``kv_offset + j`` (absolute indices: a cache's past tokens come first), the padding mask is indexed
by the absolute key index, and with packed sequences the comparisons use the ``position_ids``
values instead (``remap_positions_for_packed_sequence``, transformers >= 5.23; earlier versions
compose packed rows without it, and their positions are the row indices). Which pieces the
installed transformers has comes from the compatibility layer (``compat.mask_pieces``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor

# transformers passes a prepared BlockMask (or 4-D tensor) through its mask builders unchanged
from torch.nn.attention.flex_attention import BlockMask as _Prepared

from ..compat import mask_pieces
from .compile import outside_graph

__all__ = [
    "ATTENTION_NAME",
    "VarlenMask",
    "dense_mask_runs",
    "mask_allowed",
    "parse_mask_function",
    "set_planner",
    "varlen_mask",
]

ATTENTION_NAME = "mmbalance_varlen"


@dataclass(kw_only=True)
class _Terms:
    """The mask terms a description (:class:`VarlenMask`) and a parsed mask function share."""

    window: tuple[int, int] | None = None
    chunk: int | None = None
    left_padding: Tensor | None = None
    padding: Tensor | None = None
    segments: Tensor | None = None
    positions: Tensor | None = None
    blocks: Tensor | None = None


@dataclass(eq=False, repr=False)
class VarlenMask(_Prepared, _Terms):
    """What one transformers mask says, in the terms of the varlen op.

    A key ``j`` is allowed for query ``i`` of batch row ``b`` iff, with ``qa``/``ka`` their
    positions (absolute indices, or the ``positions`` values for packed rows):
    ``(not causal or ka <= qa)``, ``qa - window[0] <= ka <= qa + window[1]`` (a negative bound is
    unbounded), ``(ka - left_padding[b]) // chunk == (qa - left_padding[b]) // chunk`` when
    ``chunk`` is set, the key is not padding (``padding[b, kv_offset + j]``) and, for packed rows,
    both lie in one sequence (``segments``). ``blocks`` (``[B, >= kv_offset + kv_length]``,
    transformers' ``block_sequence_ids``: image tokens of one image share an id >= 0) widens the
    causal condition: a query also sees the later keys of its own block (bidirectional images,
    Gemma3), with the window still applied on top.
    """

    batch_size: int
    q_length: int
    kv_length: int
    q_offset: int = 0
    kv_offset: int = 0
    causal: bool = True
    # host-side plans, one per (query length, key length, batch, device), shared by every layer
    # (the mask function makes the usual one before the layers run)
    plans: dict = field(default_factory=dict, repr=False)

    # transformers treats a prepared mask as a tensor or a flex BlockMask in a few places:
    # ``generate`` builds the masks once and the model's mask builders pass a prepared
    # ``[B, 1, Lq, Lk]`` mask through, ``generate`` makes masks contiguous, model-parallel code
    # moves them. Those work on this description; anything else (slicing, arithmetic) fails.
    @property
    def shape(self) -> tuple[int, int, int, int]:
        """``(batch, 1, q_length, kv_length)``, the shape of the dense mask this describes."""
        return (self.batch_size, 1, self.q_length, self.kv_length)

    @property
    def ndim(self) -> int:
        """4, as a prepared mask."""
        return 4

    def dim(self) -> int:
        """4, as a prepared mask."""
        return 4

    def __repr__(self) -> str:
        return (
            f"VarlenMask(batch={self.batch_size}, q={self.q_length}@{self.q_offset}, "
            f"kv={self.kv_length}@{self.kv_offset}, causal={self.causal}, window={self.window}, "
            f"chunk={self.chunk}, padded={self.padding is not None}, packed={self.segments is not None})"
        )

    __str__ = __repr__

    def __getitem__(self, index):
        raise TypeError(
            f"{ATTENTION_NAME}: its attention mask description cannot be indexed (this model reads the mask itself "
            "instead of calling the attention function); use attn_implementation='sdpa' or 'eager' for it"
        )

    def to(self, *args, **kwargs) -> VarlenMask:
        """No-op (the description is device-free until planned)."""
        return self

    def contiguous(self) -> VarlenMask:
        """No-op."""
        return self


@dataclass
class _Pattern(_Terms):
    """Constraints read from a mask function (all and-ed)."""

    causal: bool | None = None
    q_shift: int = 0
    kv_shift: int = 0


# transformers' mask-function pieces, ``{code object: (kind, closure renames)}``, from the
# compatibility layer (the pieces differ between versions); filled on first use
_PIECES: dict[Any, tuple[str, dict[str, str]]] = {}

_REFUSED: dict[str, str] = {}


def _name(fn) -> str:
    return getattr(fn, "__qualname__", None) or repr(fn)


def _cells(fn) -> dict[str, Any]:
    cells = {n: c.cell_contents for n, c in zip(fn.__code__.co_freevars, fn.__closure__ or ())}
    for old, new in _PIECES[fn.__code__][1].items():
        cells[new] = cells.pop(old)
    return cells


def _kind(fn) -> str | None:
    piece = _PIECES.get(getattr(fn, "__code__", None))
    return None if piece is None else piece[0]


def _refuse(what: str) -> ValueError:
    return ValueError(
        f"{ATTENTION_NAME} cannot run this attention mask: {what}. Use attn_implementation='sdpa' or "
        "'eager' for this model or input"
    )


def _and_window(a: tuple[int, int] | None, b: tuple[int, int]) -> tuple[int, int]:
    if a is None:
        return b

    def tighter(x: int, y: int) -> int:
        return y if x < 0 else x if y < 0 else min(x, y)

    return tighter(a[0], b[0]), tighter(a[1], b[1])


def _window_covers_blocks(window: tuple[int, int], block_ids) -> bool:
    """Whether a causal window ``(left, right < 0)`` reaches every earlier token of each block of
    ``block_ids`` (``[B, L]``, ``-1`` outside blocks; a block's tokens are contiguous)."""
    left, right = window
    if right >= 0:
        return False
    if left < 0:
        return True
    ids = block_ids.detach().cpu().numpy()
    longest = max(
        (int(np.unique(row[row >= 0], return_counts=True)[1].max(initial=0)) for row in ids), default=0
    )
    return longest - 1 <= left


def _parse(fn, pat: _Pattern, remapped: bool) -> None:
    kind = _kind(fn)
    if kind is None:
        raise _refuse(f"the mask function `{_name(fn)}` is not one of transformers' standard pieces")
    if kind in _REFUSED:
        raise _refuse(f"{_REFUSED[kind]} (`{_name(fn)}`)")
    if kind == "causal":
        pat.causal = True
    elif kind == "bidirectional":
        pat.causal = bool(pat.causal)  # causal if also and-ed with a causal piece
    elif kind == "and":
        for sub in _cells(fn)["mask_functions"]:
            _parse(sub, pat, remapped)
    elif kind == "or":
        subs = list(_cells(fn)["mask_functions"])
        blocks = [s for s in subs if _kind(s) == "blockwise"]
        rest = [s for s in subs if _kind(s) != "blockwise"]
        if len(rest) != 1 or len(blocks) > 1:
            names = ", ".join(f"`{_name(s)}`" for s in subs)
            raise _refuse(f"a union of mask functions ({names}), e.g. a bidirectional decoder")
        if not blocks:
            _parse(rest[0], pat, remapped)
            return
        # causal OR same image block (Gemma3's `block_sequence_ids`): the base must be plain
        # causal (windows may only narrow the union from outside, as transformers composes it)
        sub = _Pattern()
        _parse(rest[0], sub, remapped)
        ids = _cells(blocks[0])["block_sequence_ids"]
        if sub.window is not None and sub.causal and _window_covers_blocks(sub.window, ids):
            # (causal AND window) OR block, as transformers before 5.9 composes Gemma 3's sliding
            # layers: the same keys as (causal OR block) AND window when no block is longer than
            # the window reaches back
            pat.window = _and_window(pat.window, sub.window)
            sub.window = None
        if (
            sub.window is not None
            or sub.chunk is not None
            or sub.padding is not None
            or pat.blocks is not None
        ):
            raise _refuse(
                "bidirectional blocks united with a window, chunks or padding inside the union (an image block "
                "longer than the sliding window)"
            )
        pat.segments, pat.positions = sub.segments, sub.positions
        pat.q_shift += sub.q_shift
        pat.kv_shift += sub.kv_shift
        if not sub.causal:  # a bidirectional base: the union allows every key, the blocks add nothing
            pat.causal = bool(pat.causal)
            return
        pat.causal = True
        pat.blocks = ids
    elif kind == "sliding":
        w = int(_cells(fn)["sliding_window"])
        pat.window = _and_window(pat.window, (w - 1, -1))  # kv_idx > q_idx - w
    elif kind == "sliding_bidirectional":
        w = int(_cells(fn)["sliding_window"])
        pat.window = _and_window(pat.window, (w, w))  # |q_idx - kv_idx| <= w
    elif kind == "chunked":
        cells = _cells(fn)
        if pat.chunk is not None:
            raise _refuse("two chunked overlays")
        pat.chunk, pat.left_padding = int(cells["chunk_size"]), cells["left_padding"]
    elif kind == "padding":
        if remapped:
            raise _refuse("a padding mask inside packed-sequence positions")
        pad = _cells(fn)["padding_mask"]
        pat.padding = pad if pat.padding is None else _and_padding(pat.padding, pad)
    elif kind == "packed":
        pat.segments = _cells(fn)["packed_sequence_mask"]
    elif kind == "remap":
        cells = _cells(fn)
        if remapped:
            raise _refuse("nested packed-sequence position maps")
        pat.positions = cells["position_ids"]
        _parse(cells["mask_function"], pat, True)
    elif kind == "blockwise":
        raise _refuse(f"bidirectional blocks (`{_name(fn)}`) outside a union with a causal mask")
    elif kind == "offsets":
        cells = _cells(fn)
        pat.q_shift += int(cells["q_offset"])
        pat.kv_shift += int(cells["kv_offset"])
        _parse(cells["mask_function"], pat, remapped)


def parse_mask_function(mask_function) -> _Pattern:
    """Read a transformers mask function back into its constraints; ``ValueError`` (naming
    ``mmbalance_varlen`` and the piece) for what the varlen op cannot express."""
    if not _PIECES:
        _PIECES.update(mask_pieces())
    pat = _Pattern()
    _parse(mask_function, pat, False)
    if pat.causal is None:
        raise _refuse(
            f"the mask function `{_name(mask_function)}` has neither a causal nor a bidirectional base"
        )
    if pat.positions is not None and pat.segments is None:
        raise _refuse("a packed-sequence position map without its packed-sequence mask")
    return pat


def _as_int(x) -> int:
    return int(x.item()) if isinstance(x, Tensor) else int(x)


def varlen_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function=None,
    attention_mask: Tensor | None = None,
    **kwargs,
) -> VarlenMask:
    """``AttentionMaskInterface`` function of ``"mmbalance_varlen"`` (the signature of
    ``masking_utils.sdpa_mask``): a :class:`VarlenMask`, never a dense mask.

    Given the ``device`` (transformers passes it) it also plans the op calls of the mask's layers
    right away (their usual shape: this batch, query and key length), so that the layers only look
    the plan up. Inside ``torch.compile`` it runs outside the graph (reading transformers' mask
    function back is host work: one graph break per mask), and the layers trace through to the op
    without a break; ``fullgraph=True`` raises ``NotImplementedError`` here (``compile.py``).
    A mask built outside the compiled region (``generate`` builds its decoding masks before it
    calls the compiled forward) is planned already, so such a forward compiles even with
    ``fullgraph=True``.
    """
    return _mask_and_plan(
        batch_size,
        q_length,
        kv_length,
        q_offset,
        kv_offset,
        mask_function,
        attention_mask,
        kwargs.get("device"),
    )


@outside_graph(ATTENTION_NAME, "its mask function")
def _mask_and_plan(
    batch_size, q_length, kv_length, q_offset, kv_offset, mask_function, attention_mask, device
):
    spec = _describe(batch_size, q_length, kv_length, q_offset, kv_offset, mask_function, attention_mask)
    if device is not None and _PLANNER:
        _PLANNER[0](spec, torch.device(device))
    return spec


# the planner of a mask's op calls: it lives in plan.py, which hands it over when it is imported
# (this module does not import that one: no circle)
_PLANNER: list = []


def set_planner(planner) -> None:
    """Plan every mask this function builds with ``planner(spec, device)`` (the attention's own)."""
    _PLANNER[:] = [planner]


def _describe(
    batch_size, q_length, kv_length, q_offset, kv_offset, mask_function, attention_mask: Tensor | None
) -> VarlenMask:
    from transformers.masking_utils import causal_mask_function

    pat = parse_mask_function(causal_mask_function if mask_function is None else mask_function)
    padding = attention_mask
    if pat.padding is not None:
        padding = pat.padding if padding is None else _and_padding(padding, pat.padding)
    if padding is not None:
        if padding.dim() != 2:
            raise _refuse(f"a {padding.dim()}-D padding mask (expected [batch, keys])")
        padding = padding.to(torch.bool)
    segments = pat.segments
    positions = pat.positions
    if segments is not None:
        if q_length != kv_length:
            raise _refuse("packed sequences with a key length different from the query length (a cache)")
        if positions is None:  # composed without a position map (transformers < 5.23): row indices
            positions = torch.arange(q_length, device=segments.device)[None]
        positions = positions.expand(batch_size, -1)
        if positions.shape[-1] != q_length:
            raise _refuse("packed sequences with a key length different from the query length (a cache)")
    return VarlenMask(
        batch_size=int(batch_size),
        q_length=int(q_length),
        kv_length=int(kv_length),
        q_offset=_as_int(q_offset) + pat.q_shift,
        kv_offset=_as_int(kv_offset) + pat.kv_shift,
        causal=bool(pat.causal),
        window=pat.window,
        chunk=pat.chunk,
        left_padding=pat.left_padding,
        padding=padding,
        segments=segments,
        positions=positions,
        blocks=pat.blocks,
    )


def _and_padding(a: Tensor, b: Tensor) -> Tensor:
    width = max(a.shape[-1], b.shape[-1])
    a = torch.nn.functional.pad(a.to(torch.bool), (0, width - a.shape[-1]))
    b = torch.nn.functional.pad(b.to(torch.bool), (0, width - b.shape[-1]))
    return a & b


def mask_allowed(mask: Tensor, b: int, lq: int, lk: int) -> np.ndarray:
    """The keys each query may see under a 4-D mask ``[B or 1, 1, Lq or 1, Lk]`` (boolean, True:
    attend; or float and additive with only ``0`` and ``-inf`` or the dtype's minimum), as a
    boolean array ``[B or 1, Lq or 1, Lk]``; anything else is refused with a ``ValueError``
    naming the backend."""
    shape = tuple(mask.shape)
    if mask.dim() != 4 or shape[0] not in (1, b) or shape[2] not in (1, lq) or shape[3] != lk:
        raise _refuse(f"a 4-D mask of shape {shape} for {b} rows of {lq} queries x {lk} keys")
    if shape[1] != 1:
        raise _refuse(f"a 4-D mask with one mask per head (shape {shape})")
    m = mask.detach()
    if m.dtype == torch.bool:
        allowed = m
    elif m.is_floating_point():
        allowed = m == 0
        blocked = m <= torch.finfo(m.dtype).min / 2
        if not bool((allowed | blocked).all()):
            raise _refuse(
                "a 4-D mask with additive values other than 0 and -inf (an attention bias, e.g. ALiBi or a "
                "relative position bias)"
            )
    else:
        raise _refuse(f"a 4-D mask of dtype {m.dtype} (expected bool or float)")
    return allowed[:, 0].to("cpu").numpy()


def dense_mask_runs(
    mask: Tensor, b: int, lq: int, lk: int
) -> list[tuple[int, int, int, list[tuple[int, int]]]]:
    """The keys each query may see under a 4-D mask handed to the attention function (Mllama's
    cross-attention mask, or one passed in from outside), as ``(row, first query, queries, key
    runs)``: consecutive queries of a row that see the same keys form one entry, its keys at most
    two runs ``(first key, length)``.

    ``mask``: ``[B or 1, 1, Lq or 1, Lk]``, boolean (True: attend, as sdpa reads it) or float and
    additive with only ``0`` (attend) and ``-inf`` or the dtype's minimum (masked), as eager adds
    it. Anything else (an attention bias, per-head masks, a row with more than two runs of keys) is
    refused with a ``ValueError`` naming the backend. A query that sees no key gets ``0`` (eager
    would average the values under the dtype's minimum, or return NaN under ``-inf``).
    """
    grid = mask_allowed(mask, b, lq, lk)
    out = []
    for r in range(b):
        rows = grid[r if grid.shape[0] > 1 else 0]
        starts = [0]
        if rows.shape[0] > 1:
            starts += (np.flatnonzero((rows[1:] != rows[:-1]).any(axis=1)) + 1).tolist()
        ends = starts[1:] + [lq]
        for s, e in zip(starts, ends):
            edges = np.diff(np.concatenate([[0], rows[min(s, rows.shape[0] - 1)].astype(np.int8), [0]]))
            runs = list(zip(np.flatnonzero(edges == 1).tolist(), np.flatnonzero(edges == -1).tolist()))
            if len(runs) > 2:
                raise _refuse(
                    f"a 4-D mask whose row {r}, query {s} sees {len(runs)} separate runs of keys (at most 2)"
                )
            out.append((r, s, e - s, [(a, z - a) for a, z in runs]))
    return out
