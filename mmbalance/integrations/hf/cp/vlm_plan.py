"""The numpy side of a vision-language step of dynamic context parallelism (see
:mod:`.families`): a rank's batch read into sequences, M-RoPE positions and encoder items
(:func:`read_batch`), the rows it contributes to the gathered table and the table read back
(:class:`GatheredStep`), the placeholder runs, the feature segments that compose the encoder's plan
with the LLM's pieces, and the encoding ranks of a group's items without encoder balancing. Shared
by :func:`~.vlm_step.shard_vlm` and the Trainer's :class:`~.vlm_cut.GroupCutter`;
nothing here communicates."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor

from mmbalance.balancing import Plan

from ..encoders import EncoderAdapter, Items
from .family import VLMFamily, assign_media
from .inputs import Sequences, split_sequences

__all__ = [
    "GatheredStep",
    "block_spans",
    "LocalBatch",
    "PendingEntry",
    "PendingMedia",
    "PlaceholderRuns",
    "feature_segments",
    "placeholder_order",
    "local_table",
    "parse_table",
    "piece_coords",
    "read_alone",
    "read_batch",
    "spread_items",
    "table_width",
]

_TEXT_KEYS = ("input_ids", "attention_mask", "position_ids", "labels")


# ------------------------------------------------------------------------------ the local batch
@dataclass
class LocalBatch:
    """This rank's batch read (:func:`read_batch`): its sequences, their positions and placeholder
    kinds, and per encoder adapter its items with their sequence, stream and feature rows."""

    seqs: Sequences
    positions: Tensor | None  # int64 [T, 3]
    kinds: list[np.ndarray]  # per sequence: 0 text, 1 + stream at placeholders
    items: list[Items | None]  # per adapter
    item_seq: list[np.ndarray]  # per adapter: local sequence of every item
    item_stream: list[np.ndarray]
    out_rows: list[np.ndarray]
    options: list[dict]
    #: per sequence: the tokens of its bidirectional prefix (PaliGemma; 0: none)
    prefix: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))


def read_batch(handle, family: VLMFamily, adapters: list[EncoderAdapter], batch: Mapping) -> LocalBatch:
    if not isinstance(batch, Mapping):
        raise TypeError(f"batch must be a mapping of model inputs, got {type(batch).__name__}")
    known = set(_TEXT_KEYS) | family.batch_keys | {"use_cache", "return_dict", "num_items_in_batch"}
    if family.mrope:
        # a collator's precomputed M-RoPE deltas (LLaMA-Factory's): derived from the positions that
        # shard computes itself on the whole sequence, and read by the model only when it continues
        # a generation from a cache, so they are left out of the split batch
        known.add("rope_deltas")
    for key, val in batch.items():
        if key not in known and val is not None:
            raise ValueError(
                f"batch[{key!r}]: handle.shard does not know how to split this input of {family.label} (it takes "
                f"{', '.join(sorted(set(_TEXT_KEYS) | family.batch_keys))})"
            )
    pos = batch.get("position_ids")
    given = None
    if isinstance(pos, Tensor) and pos.dim() == 3:
        # a collator's precomputed M-RoPE rows (LLaMA-Factory's, [3, B, L] or [4, B, L] with the
        # text row): shard computes them itself on every whole sequence, and checks they agree
        if not family.mrope or pos.shape[0] not in (3, 4):
            raise ValueError(
                "batch['position_ids']: handle.shard computes the M-RoPE positions of every sequence itself (the "
                "model's get_rope_index on the whole sequence); pass none, 1-D packed positions [1, T], or the "
                f"model's own rows [3 or 4, B, L] (got shape {tuple(pos.shape)})"
            )
        given = pos
        batch = {k: v for k, v in batch.items() if k != "position_ids"}
    seqs = split_sequences({k: batch[k] for k in _TEXT_KEYS if k in batch})
    model = handle.model
    streams = family.streams(model)
    batch = _without_masked_media(family, streams, batch)
    lengths = seqs.lengths
    starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    ids_np = seqs.input_ids.numpy()
    kinds = []
    for s in range(lengths.size):
        x = ids_np[starts[s] : starts[s + 1]]
        kind = np.zeros(x.size, dtype=np.int64)
        for k, (_, token) in enumerate(streams):
            kind[x == token] = k + 1
        kinds.append(kind)
    counts = np.array([[int((kd == k + 1).sum()) for k in range(len(streams))] for kd in kinds],
                      dtype=np.int64).reshape(-1, len(streams))  # fmt: skip
    ids = [seqs.input_ids[starts[s] : starts[s + 1]] for s in range(lengths.size)]
    family.check_batch(model, batch, kinds, seqs.spans)
    prefix = family.prefix_lengths(model, batch, kinds, seqs.spans)
    positions = family.positions(model, batch, ids, kinds, seqs.spans) if family.mrope else None
    if given is not None:
        _check_given_positions(given, positions, seqs)
    items: list[Items | None] = []
    item_seq: list[np.ndarray] = []
    item_stream: list[np.ndarray] = []
    out_rows: list[np.ndarray] = []
    options: list[dict] = []
    covered = np.zeros(len(streams), dtype=bool)
    for adapter in adapters:
        call = dict(batch)
        opts = adapter.call_options(model, call)
        got = adapter.extract(model, call)
        if got is not None and len(got) == 0:
            got = None
        options.append(opts)
        if got is None:
            items.append(None)
            for a in (item_seq, item_stream, out_rows):
                a.append(np.zeros(0, dtype=np.int64))
            continue
        rows_out = np.asarray(adapter.out_rows(model, got.meta, **opts), dtype=np.int64)
        order = family.item_order(model, batch, kinds, seqs.spans, got, rows_out)
        if order is not None:
            got, rows_out = _reordered(got, order), rows_out[order]
        stream = family.item_streams(adapter, got.meta)
        seq_of = np.full(len(got), -1, dtype=np.int64)
        for k in np.unique(stream).tolist():
            idx = np.flatnonzero(stream == k)
            name = streams[k][0]
            per_seq = assign_media(rows_out[idx], counts[:, k], _media_key(family, name), name)
            for s, mine in enumerate(per_seq):
                seq_of[idx[mine]] = s
            covered[k] = True
        items.append(got)
        item_seq.append(seq_of)
        item_stream.append(stream)
        out_rows.append(rows_out)
    for k, (name, _) in enumerate(streams):
        if not covered[k] and int(counts[:, k].sum()):
            raise ValueError(
                f"input_ids holds {int(counts[:, k].sum())} {name} placeholder tokens but the batch has no "
                f"{_media_key(family, name)}"
            )
    return LocalBatch(seqs, positions, kinds, items, item_seq, item_stream, out_rows, options, prefix)


def _reordered(items: Items, order: np.ndarray) -> Items:
    """``items`` in ``order`` (their payload rows moved with them)."""
    ends = np.cumsum(items.rows)
    starts = ends - items.rows
    idx = np.concatenate([np.arange(starts[i], ends[i]) for i in order] or [np.zeros(0, dtype=np.int64)])
    index = torch.from_numpy(idx.astype(np.int64))
    payload = [t.index_select(0, index.to(t.device)) for t in items.payload]
    return Items(payload, items.rows[order], items.meta[order], items.context)


def _check_given_positions(given: Tensor, positions: Tensor | None, seqs: Sequences) -> None:
    """The collator's M-RoPE rows ``given`` ([3 or 4, B, L]) against the positions shard computed
    (``[T, 3]``, sequence after sequence): a ``ValueError`` naming the first sequence where they
    differ (the split would train other positions than the collator's)."""
    if seqs.spans is None or positions is None:
        raise ValueError(
            "batch['position_ids']: M-RoPE rows [3 or 4, B, L] come with a padded batch [B, L] (its attention_mask "
            "says where each sequence is)"
        )
    rows = given[-3:]
    at = 0
    for s, (row, start, end) in enumerate(seqs.spans):
        mine = positions[at : at + end - start]
        at += end - start
        theirs = rows[:, row, start:end].transpose(0, 1).to(mine.device, mine.dtype)
        if theirs.shape != mine.shape or not torch.equal(theirs, mine):
            raise ValueError(
                f"batch['position_ids']: the collator's M-RoPE positions of sequence {s} (row {row}) differ from the "
                "model's get_rope_index on the whole sequence, which handle.shard splits; leave position_ids out"
            )


# what each vision stream's media is read from, besides its pixels (the media key)
_STREAM_KEYS = {"image": ("image_grid_thw",), "video": ("video_grid_thw", "second_per_grid_ts")}


def _without_masked_media(family: VLMFamily, streams: list[tuple[str, int]], batch: Mapping) -> Mapping:
    """``batch`` without the media of a vision stream whose placeholder tokens all lie under
    ``attention_mask == 0``: LLaMA-Factory's collator appends a stand-in image to a batch that has
    none (its tokens masked, their labels ignored), so that every rank's tower runs under ZeRO-3
    and FSDP. Its features reach only masked tokens, which no loss and no attending token reads,
    so leaving it out changes nothing; the CP group's own stand-in keeps every tower in the step."""
    mask = batch.get("attention_mask")
    ids = batch.get("input_ids")
    if not isinstance(mask, Tensor) or not isinstance(ids, Tensor) or mask.shape != ids.shape:
        return batch
    valid = mask.bool()
    drop: list[str] = []
    for name, token in streams:
        if name not in _STREAM_KEYS or batch.get(_media_key(family, name)) is None:
            continue
        here = ids == token
        if int(here.sum()) and not bool((here & valid).any()):
            drop += [_media_key(family, name), *_STREAM_KEYS[name]]
    return {k: v for k, v in batch.items() if k not in drop} if drop else batch


def _media_key(family: VLMFamily, name: str) -> str:
    return family.media_keys.get(name, "pixel_values")


def local_table(local: LocalBatch, width: int) -> np.ndarray:
    """The rows this rank contributes to the gathered table (see :func:`~.vlm_step.shard_vlm`)."""
    rows = []
    seqs = local.seqs
    labelled = seqs.labelled
    for s, n in enumerate(seqs.lengths.tolist()):
        rows.append([0, s, n, int(labelled[s]), int(seqs.has_labels), int(local.prefix[s])])
    for a, got in enumerate(local.items):
        if got is None:
            continue
        for i in range(len(got)):
            rows.append([1, int(local.item_seq[a][i]), a, int(local.item_stream[a][i]), int(got.rows[i]),
                         int(local.out_rows[a][i]), *got.meta[i].tolist()])  # fmt: skip
    for s, kind in enumerate(local.kinds):
        if not kind.size:
            continue
        cut = np.flatnonzero(np.diff(kind)) + 1
        starts = np.concatenate([[0], cut])
        ends = np.concatenate([cut, [kind.size]])
        for a, z in zip(starts.tolist(), ends.tolist()):
            rows.append([2, s, int(kind[a]), z - a])
    out = np.zeros((len(rows), width), dtype=np.int64)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return out


# ----------------------------------------------------------------------------- the gathered step
@dataclass
class GatheredStep:
    """The gathered table of every rank read back (:func:`parse_table`): the sequences in global
    order, their placeholder runs, and per encoder adapter the items of every rank, rank-major."""

    lengths: np.ndarray
    labelled: np.ndarray
    seq_src: np.ndarray
    run_seq: np.ndarray  # runs of placeholder kinds, per sequence in order
    run_kind: np.ndarray
    run_len: np.ndarray
    # per adapter: the items of every rank, rank-major
    src: list[np.ndarray]
    seq: list[np.ndarray]
    stream: list[np.ndarray]
    rows: list[np.ndarray]
    out_rows: list[np.ndarray]
    meta: list[np.ndarray]
    #: per sequence: its rank passed labels
    has_labels: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    #: per sequence: the tokens of its bidirectional prefix (0: none)
    prefix: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))


def parse_table(
    table: np.ndarray, src: np.ndarray, world: int, adapters: list[EncoderAdapter]
) -> GatheredStep:
    kind = table[:, 0]
    is_seq, is_item, is_run = kind == 0, kind == 1, kind == 2
    offset = np.concatenate([[0], np.cumsum(np.bincount(src[is_seq], minlength=world))]).astype(np.int64)

    def glob(mask):
        return offset[src[mask]] + table[mask, 1]

    it = table[is_item]
    it_src, it_seq = src[is_item], glob(is_item)
    per = [it[:, 2] == a for a in range(len(adapters))]
    return GatheredStep(
        lengths=table[is_seq, 2].copy(),
        labelled=table[is_seq, 3].copy(),
        has_labels=table[is_seq, 4].copy(),
        prefix=table[is_seq, 5].copy(),
        seq_src=src[is_seq].copy(),
        run_seq=glob(is_run),
        run_kind=table[is_run, 2].copy(),
        run_len=table[is_run, 3].copy(),
        src=[it_src[m] for m in per],
        seq=[it_seq[m] for m in per],
        stream=[it[m, 3] for m in per],
        rows=[it[m, 4] for m in per],
        out_rows=[it[m, 5] for m in per],
        meta=[np.ascontiguousarray(it[m, 6 : 6 + len(a.meta_columns)]) for a, m in zip(adapters, per)],
    )


def table_width(adapters: list[EncoderAdapter]) -> int:
    """Columns of the gathered table: 6 fixed, then the widest adapter's metadata."""
    return 6 + max([len(a.meta_columns) for a in adapters] + [1])


def read_alone(handle, family: VLMFamily, adapters: list[EncoderAdapter], batch: Mapping):
    """This rank's batch read and parsed as if it were the whole world: ``(local, step)``, what
    a step without communication plans from (one process, or a Trainer group's own batch)."""
    local = read_batch(handle, family, adapters, batch)
    table = local_table(local, table_width(adapters))
    return local, parse_table(table, np.zeros(table.shape[0], dtype=np.int64), 1, adapters)


def piece_coords(lengths: np.ndarray, piece_len: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Sequence and offset of every piece (pieces are in (sequence, offset) order and cover every
    sequence back to back)."""
    ends = np.cumsum(lengths)
    start = np.cumsum(piece_len) - piece_len
    seq = np.searchsorted(ends, start, side="right")
    return seq.astype(np.int64), (start - (ends - lengths)[seq]).astype(np.int64)


class PlaceholderRuns:
    """Placeholder counts of every sequence before any offset, from the gathered run-length code."""

    def __init__(self, step: GatheredStep, n: int):
        order = np.argsort(step.run_seq, kind="stable")
        self.seq, self.kind, self.len = step.run_seq[order], step.run_kind[order], step.run_len[order]
        self.first = np.searchsorted(self.seq, np.arange(n + 1))

    def before(self, s: int, k: int, x: np.ndarray) -> np.ndarray:
        """Placeholders of kind ``k`` (``1 + stream``) in ``[0, x)`` of sequence ``s``."""
        a, b = self.first[s], self.first[s + 1]
        ln, kd = self.len[a:b], self.kind[a:b]
        if not ln.size:
            return np.zeros_like(x)
        ends = np.cumsum(ln)
        starts = ends - ln
        upto = np.concatenate([[0], np.cumsum(np.where(kd == k, ln, 0))])
        j = np.searchsorted(ends, x, side="right")  # the run holding token x (ln.size: x is the end)
        jj = np.minimum(j, ln.size - 1)
        partial = np.where((j < ln.size) & (kd[jj] == k), x - starts[jj], 0)
        return (upto[j] + partial).astype(np.int64)


def block_spans(step: GatheredStep, sequences: np.ndarray, family: VLMFamily, streams: list) -> np.ndarray:
    """int64 ``[n, 2]``: the ``[start, end)`` of the family's bidirectional blocks in ``sequences``
    (global indices), in the coordinates of those sequences laid end to end in that order (a CP
    group's ``cu_seqlens``): every maximal run of a block stream's placeholders (Gemma 3's images;
    ``streams``: the family's ``(name, token)`` list) and every sequence's prefix (PaliGemma's)."""
    kinds = [1 + k for k, (name, _) in enumerate(streams) if name in family.block_streams]
    out = []
    offset = 0
    for s in np.asarray(sequences, dtype=np.int64).tolist():
        if step.prefix.size and int(step.prefix[s]) > 0:
            out.append((offset, offset + int(step.prefix[s])))
        at = np.flatnonzero(step.run_seq == s)  # the sequence's runs, in order
        ln = step.run_len[at]
        ends = offset + np.cumsum(ln)
        first = len(out)  # this sequence's blocks start here
        for j in np.flatnonzero(np.isin(step.run_kind[at], kinds)).tolist():
            a, e = int(ends[j] - ln[j]), int(ends[j])
            if (
                len(out) > first and out[-1][1] == a
            ):  # touching runs of two block streams: one block (Gemma 4)
                out[-1] = (out[-1][0], e)
            else:
                out.append((a, e))
        offset += int(step.lengths[s])
    return np.array(out, dtype=np.int64).reshape(-1, 2)


def feature_segments(
    step: GatheredStep, a: int, runs: PlaceholderRuns, piece_seq, piece_off, piece_len, piece_dst, enc, slot
):
    """The feature move of adapter ``a``: every item's output rows cut by the pieces that hold
    their placeholders. Returns arrays per segment, sorted by (encoding rank, slot, row): length,
    source (encoding) rank, destination rank, stream, global piece index, row in the stream of the
    sequence."""
    seq, stream, out_rows = step.seq[a], step.stream[a], step.out_rows[a]
    n_items = seq.size
    # the first stream row of every item: items of one (sequence, stream) follow each other in order
    row0 = np.zeros(n_items, dtype=np.int64)
    nxt: dict[tuple[int, int], int] = {}
    for i in range(n_items):
        key = (int(seq[i]), int(stream[i]))
        row0[i] = nxt.get(key, 0)
        nxt[key] = row0[i] + int(out_rows[i])
    first = np.searchsorted(piece_seq, np.arange(step.lengths.size + 1))
    bounds: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}
    out: dict[str, list[np.ndarray]] = {
        k: [] for k in ("len", "src", "dst", "stream", "piece", "row", "slot", "off")
    }
    for i in range(n_items):
        s, k = int(seq[i]), int(stream[i])
        p = np.arange(first[s], first[s + 1])
        if (s, k) not in bounds:
            bounds[(s, k)] = (
                runs.before(s, k + 1, piece_off[p]),
                runs.before(s, k + 1, piece_off[p] + piece_len[p]),
            )
        lo, hi = bounds[(s, k)]
        a0 = np.maximum(lo, row0[i])
        b0 = np.minimum(hi, row0[i] + out_rows[i])
        keep = b0 > a0
        m = int(keep.sum())
        out["len"].append(b0[keep] - a0[keep])
        out["src"].append(np.full(m, enc[i], dtype=np.int64))
        out["dst"].append(piece_dst[p[keep]])
        out["stream"].append(np.full(m, k, dtype=np.int64))
        out["piece"].append(p[keep])
        out["row"].append(a0[keep])
        out["slot"].append(np.full(m, slot[i], dtype=np.int64))
        out["off"].append(a0[keep] - row0[i])
        if int((b0[keep] - a0[keep]).sum()) != int(out_rows[i]):
            raise AssertionError("an item's feature rows are not covered by the pieces once")  # a planner bug
    cat = {
        k: np.concatenate(v).astype(np.int64) if v else np.zeros(0, dtype=np.int64) for k, v in out.items()
    }
    order = np.lexsort((cat["off"], cat["slot"], cat["src"]))
    return {k: v[order] for k, v in cat.items()}


def placeholder_order(seg: dict, received: np.ndarray, streams: list, item_streams: np.ndarray) -> dict:
    """The rows of a received feature buffer (the segments ``seg[received]``, back to back) of every
    stream, in the order of the shard's placeholders: ``{stream name: int64 row index}``."""
    index: dict[str, Tensor] = {}
    starts = np.concatenate([[0], np.cumsum(seg["len"][received])]).astype(np.int64)
    for st in np.unique(item_streams).tolist():
        sel = np.flatnonzero(seg["stream"][received] == st)
        if sel.size:
            sel = sel[np.lexsort((seg["row"][received][sel], seg["piece"][received][sel]))]
            index[streams[st][0]] = torch.from_numpy(
                np.concatenate([np.arange(starts[j], starts[j + 1]) for j in sel.tolist()])
            )
    return index


def spread_items(step: GatheredStep, a: int, layout, seconds: np.ndarray, load: np.ndarray) -> np.ndarray:
    """Encoding rank of every item of adapter ``a`` without encoder balancing: its sequence's CP
    group, the least loaded member (longest item first; ties to the lower rank)."""
    n = step.lengths.size
    gseq = _group_of(layout.schedule, n)
    enc = np.full(step.seq[a].size, -1, dtype=np.int64)
    gi_of = gseq[step.seq[a]] if step.seq[a].size else np.zeros(0, dtype=np.int64)
    for gi, g in enumerate(layout.schedule):
        idx = np.flatnonzero(gi_of == gi)
        if not idx.size:
            continue
        members = np.asarray(g.ranks, dtype=np.int64)
        for i in idx[np.argsort(-seconds[idx], kind="stable")].tolist():
            r = members[int(np.argmin(load[members]))]
            enc[i] = r
            load[r] += seconds[i]
    return enc


def _group_of(schedule, n: int) -> np.ndarray:
    out = np.full(n, -1, dtype=np.int64)
    for k, g in enumerate(schedule):
        out[np.asarray(g.sequences, dtype=np.int64)] = k
    return out


# ------------------------------------------------------------------- the work left to the forward
@dataclass
class PendingEntry:
    """One encoder's part of a :class:`PendingMedia`."""

    adapter: EncoderAdapter
    payload: list[Tensor]  # inputs of the items this rank encodes, in order
    meta: np.ndarray  # their metadata
    options: dict
    segments: np.ndarray  # rows of this rank's outputs per segment it sends, in order
    plan: Plan | None  # the feature move (over the group's ranks; the world's under encoder balancing)
    index: dict[str, Tensor]  # stream -> rows of the received buffer, in the shard's placeholder order


@dataclass(eq=False)
class PendingMedia:
    """The encoder work of one shard that :func:`~mmbalance.integrations.hf.balance_trainer`'s
    collator leaves for the forward (the collator cuts shards without communication): every rank
    encodes its share of its CP group's items (a stand-in where it has none), and one all-to-all
    over the group sends the feature rows to the members holding their placeholders. The forward
    pre-hook :func:`~.media.resolve_media` runs it. A plain loop's ``shard`` under FSDP2 leaves one too,
    with the communicator of its feature move (``mover``: the CP group's, or the world's under
    encoder balancing)."""

    entries: list[PendingEntry]
    degree: int
    streams: list[tuple[str, int]]
    mover: Any = None  # ``.move(tensors, rows per segment, plan)``; None: over the shard's ring group

    def __repr__(self) -> str:
        return f"PendingMedia(degree={self.degree}, items={[int(e.meta.shape[0]) for e in self.entries]})"
