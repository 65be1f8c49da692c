"""Dynamic context parallelism for vision-language models: :meth:`DynamicCPHandle.shard` on the
batches their processors give (images, videos), for Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3-VL-MoE
and LLaVA.

One step, on every rank (every decision from gathered facts, so identical everywhere):

1. The batch is cut into sequences (:func:`~.dynamic_cp.split_sequences`). The M-RoPE positions
   of every sequence come from the model's own ``get_rope_index`` over the whole sequence, before
   anything is split; they travel with the tokens, so every shard has exactly the positions the
   unsplit sequence gives its tokens.
2. The media become encoder items (the adapters of ``models/``: an image, one frame of a video
   for the Qwen ViTs, an image for LLaVA) and are matched to their sequences by placeholder count.
3. One gather of a small integer table: per sequence its tokens (vision tokens included) and
   labelled tokens, per item its sequence, stream (image or video), input and output rows and
   metadata, per sequence the run-length code of its placeholder tokens. Every rank then computes
   the same plan: CP groups under ``max_tokens_per_rank`` (:func:`~.dynamic_cp.plan_layout`),
   the zigzag pieces, and an encoding rank for every item:

   * with :func:`~.balance.apply_encoder_balance` on the same model: the encoder balancing's own
     plan over the whole world (its cost, ``ranks_per_node`` and ``split_frames``);
   * without it: each CP group encodes its own sequences' items, spread over its members
     (longest-processing-time first on the items' encoder cost; video frames are items).

4. Three all-to-alls: the token columns (ids, labels, shifted labels, text and M-RoPE positions)
   to the ranks of their pieces; the encoder inputs to their encoding ranks; and, after one
   encoder call per rank, the feature rows straight to the ranks that hold their placeholder
   tokens: OrchMLLM's rearrangement composition (``plan_LLM o plan_encoder^-1``, section 6), so no
   feature returns to its source first. An item whose placeholder tokens straddle two shards is
   cut at the boundary. Backward sends the features' gradients back along the same move (one
   all-to-all) to the rank that encoded them.
5. The shard's keywords give the features through the model's own hook (``mm_encoder_outputs``,
   in the order of the shard's placeholder tokens) and ``position_ids`` ``[4, 1, T]`` (each
   token's position in its own sequence, then the three M-RoPE rows: the layout the Qwen text
   models read; LLaVA takes ``[1, T]``).

Every image and frame is encoded exactly once in the world. A rank with nothing to encode (for an
encoder that has items somewhere) encodes one tiny stand-in item, so every rank runs the encoder
once and DDP/FSDP see the same calls; its output, and every rank's received features, feed a zero
that the shard's attention adds (:attr:`CPShard.anchor`), so every rank's backward reaches the
feature all-to-all.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from mmbalance.balancing import CostModel, Plan, post_balance
from mmbalance.collectives import rebalance
from mmbalance.collectives.agreement import Entry
from mmbalance.collectives.alltoall import gather_table
from mmbalance.collectives.group import comm_device
from mmbalance.pyops import cu_seqlens_from_lengths

from .balance import HANDLE_ATTR as _ENCODER_BALANCE_ATTR
from .balance import ZeroLink
from .cp_attention import CP_KEYWORD
from .cp_plan import (
    Sequences,
    cost_key,
    idle_shard,
    model_device,
    pad_id,
    pieces,
    plan_layout,
    positions,
    shard_of,
    split_sequences,
    text_config,
)
from .encoder_adapter import EncoderAdapter, Items, adapters_for, flops_linear
from .models.common import as_int, core, pooled

__all__ = [
    "MEDIA_KEYWORD",
    "SUPPORTED",
    "GroupCutter",
    "VLMFamily",
    "encoder_seconds",
    "install_media_hook",
    "shard_vlm",
    "vlm_family",
]

IGNORE = -100
_TEXT_KEYS = ("input_ids", "attention_mask", "position_ids", "labels")
_QWEN = {
    "Qwen2VLForConditionalGeneration": "Qwen2-VL",
    "Qwen2_5_VLForConditionalGeneration": "Qwen2.5-VL",
    "Qwen3VLForConditionalGeneration": "Qwen3-VL",
    "Qwen3VLMoeForConditionalGeneration": "Qwen3-VL-MoE",
}
_LLAVA = {"LlavaForConditionalGeneration": "LLaVA"}
#: the vision-language model classes ``apply_dynamic_cp`` shards (text decoders work as they are)
SUPPORTED: tuple[str, ...] = tuple(_QWEN) + tuple(_LLAVA)
# a FLOP rate to turn encoder FLOPs into the seconds of the "quadratic" cost (CostModel.transformer)
_FLOPS = 400e12


# --------------------------------------------------------------------------------- the families
class VLMFamily:
    """What the sharding needs to know about one family of vision-language models.

    Attributes:
        label: the family's name in messages.
        batch_keys: the batch keys of its processor besides ``input_ids``, ``attention_mask``,
            ``position_ids`` and ``labels``.
        mrope: its language model takes M-RoPE positions (``[4, 1, T]``) instead of ``[1, T]``.
    """

    label = ""
    batch_keys: frozenset[str] = frozenset()
    mrope = False

    def streams(self, model) -> list[tuple[str, int]]:
        """``(mm_encoder_outputs key, placeholder token id)`` of every feature stream."""
        raise NotImplementedError

    def item_streams(self, adapter: EncoderAdapter, meta: np.ndarray) -> np.ndarray:
        """The stream (index into :meth:`streams`) of every item."""
        raise NotImplementedError

    def positions(
        self, model, batch: Mapping, ids: list[Tensor], kinds: list[np.ndarray], spans
    ) -> Tensor | None:
        """int64 ``[T, 3]``: the M-RoPE positions of every token, sequence by sequence (``None``
        for models without M-RoPE)."""
        return None

    def encoder_flops(self, model, adapter: EncoderAdapter, meta: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """Forward FLOPs of encoding every item (float64 ``[n]``)."""
        raise NotImplementedError


def _assign(sizes: np.ndarray, counts: np.ndarray, key: str, what: str) -> list[np.ndarray]:
    """Media (``sizes`` placeholder tokens each, in order of appearance) to sequences holding
    ``counts`` placeholders each: the indices of every sequence's media. Raises ValueError naming
    ``key`` when the counts do not add up or a medium would straddle two sequences."""
    ends = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)])
    bounds = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])
    if int(ends[-1]) != int(bounds[-1]):
        raise ValueError(
            f"batch[{key!r}] gives {int(ends[-1])} {what} feature rows but input_ids holds {int(bounds[-1])} "
            f"{what} placeholder tokens (in its valid tokens)"
        )
    at = np.searchsorted(ends, bounds)
    if not np.array_equal(ends[np.minimum(at, ends.size - 1)], bounds):
        raise ValueError(
            f"batch[{key!r}]: the {what} placeholders of a sequence do not end where one of its {what}s ends "
            "(the media sizes do not match the placeholder tokens of input_ids)"
        )
    return [np.arange(at[s], at[s + 1], dtype=np.int64) for s in range(counts.size)]


class _Qwen(VLMFamily):
    """Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3-VL-MoE: images and videos through the Qwen ViT,
    M-RoPE positions from ``get_rope_index``."""

    mrope = True

    def __init__(self, cls_name: str):
        self.label = _QWEN[cls_name]
        keys = {
            "pixel_values",
            "image_grid_thw",
            "pixel_values_videos",
            "video_grid_thw",
            "mm_token_type_ids",
        }
        if cls_name.startswith("Qwen2_5"):
            keys.add("second_per_grid_ts")
        self.batch_keys = frozenset(keys)

    def streams(self, model):
        cfg = model.config
        return [("image", int(cfg.image_token_id)), ("video", int(cfg.video_token_id))]

    def item_streams(self, adapter, meta):
        return meta[:, 0].astype(np.int64)  # the adapter's "video" column

    def positions(self, model, batch, ids, kinds, spans):
        c = core(model)
        merge2 = int(c.visual.spatial_merge_size) ** 2
        counts = np.array(
            [[int((k == 1).sum()), int((k == 2).sum())] for k in kinds], dtype=np.int64
        ).reshape(-1, 2)
        grids = {}
        for col, (name, key) in enumerate((("image", "image_grid_thw"), ("video", "video_grid_thw"))):
            g = batch.get(key)
            if g is None and int(counts[:, col].sum()):
                pix = "pixel_values_videos" if name == "video" else "pixel_values"
                raise ValueError(
                    f"input_ids holds {int(counts[:, col].sum())} {name} placeholder tokens but the batch has no "
                    f"{pix} and {key}"
                )
            g = (
                torch.zeros(0, 3, dtype=torch.long)
                if g is None
                else torch.as_tensor(g).reshape(-1, 3).cpu().long()
            )
            grids[name] = (g, _assign(g.prod(-1).numpy() // merge2, counts[:, col], key, name))
        seconds = batch.get("second_per_grid_ts")
        tt_all = batch.get("mm_token_type_ids")
        rope = c.get_rope_index
        takes_seconds = "second_per_grid_ts" in inspect.signature(rope).parameters
        out = []
        with torch.no_grad():
            for s, (seq_ids, kind) in enumerate(zip(ids, kinds)):
                n = seq_ids.numel()
                if not bool((kind != 0).any()):
                    out.append(torch.arange(n, dtype=torch.int64)[:, None].expand(n, 3))
                    continue
                if tt_all is not None:
                    r, a, z = spans[s]
                    tt = torch.as_tensor(tt_all)[r, a:z].reshape(1, -1).cpu().to(torch.int32)
                else:  # as the processor writes it: 1 at image placeholders, 2 at video ones
                    tt = torch.from_numpy(kind.astype(np.int32)).reshape(1, -1)
                img, vid = grids["image"][0][grids["image"][1][s]], grids["video"][0][grids["video"][1][s]]
                kw = {
                    "mm_token_type_ids": tt,
                    "image_grid_thw": img if img.shape[0] else None,
                    "video_grid_thw": vid if vid.shape[0] else None,
                    "attention_mask": None,
                }
                if takes_seconds and seconds is not None and vid.shape[0]:
                    kw["second_per_grid_ts"] = torch.as_tensor(seconds).reshape(-1)[grids["video"][1][s]]
                pos, _ = rope(seq_ids.reshape(1, -1), **kw)
                out.append(pos[:, 0, :].t().to(torch.int64).cpu())
        return torch.cat(out) if out else torch.zeros(0, 3, dtype=torch.int64)

    def encoder_flops(self, model, adapter, meta, rows):
        return np.asarray(adapter.cost(model, meta, rows), dtype=np.float64)  # the adapter's FLOP model


class _Llava(VLMFamily):
    """LLaVA (1.5): one CLIP tile per image, projector outputs at the image placeholders."""

    label = "LLaVA"
    batch_keys = frozenset(
        {"pixel_values", "vision_feature_layer", "vision_feature_select_strategy", "image_sizes"}
    )

    def streams(self, model):
        return [("image", int(model.config.image_token_id))]

    def item_streams(self, adapter, meta):
        return np.zeros(meta.shape[0], dtype=np.int64)

    def encoder_flops(self, model, adapter, meta, rows):
        cfg = core(model).vision_tower.config
        hidden = int(cfg.hidden_size)
        tokens = (as_int(cfg.image_size) // as_int(cfg.patch_size)) ** 2 + 1
        per = int(cfg.num_hidden_layers) * (flops_linear(hidden, int(cfg.intermediate_size)) * tokens
                                            + 4.0 * hidden * tokens * tokens)  # fmt: skip
        return np.full(meta.shape[0], per, dtype=np.float64)


def vlm_family(model) -> VLMFamily | None:
    """The family of ``model`` if it is a supported vision-language model, ``None`` for a text
    model; raises ValueError naming the class, with the supported list, for any other multimodal
    model."""
    name = type(model).__name__
    if name in _QWEN:
        return _Qwen(name)
    if name in _LLAVA:
        return _Llava()
    config = getattr(model, "config", None)
    multimodal = any(
        getattr(config, key, None) is not None for key in ("vision_config", "audio_config", "thinker_config")
    )
    if multimodal or adapters_for(model):
        raise ValueError(
            f"model: apply_dynamic_cp does not shard {name} (its media would not reach the shards); supported "
            f"vision-language models: {', '.join(SUPPORTED)}; text decoders (Llama, Qwen2, Qwen3, ...) work as "
            "they are"
        )
    return None


def encoder_seconds(
    handle, family: VLMFamily, adapter: EncoderAdapter, meta: np.ndarray, rows: np.ndarray
) -> np.ndarray:
    """Modelled seconds (forward + backward) of encoding every item, in the units of the handle's
    cost: ``encoder_cost`` when it is a callable, else the family's FLOP model at the LLM cost's
    rate per FLOP (``cost.linear / (6 * LLM parameters)``, which is ``1 / 400e12`` for the
    default ``"quadratic"`` cost)."""
    if callable(handle.encoder_cost):
        out = np.asarray(handle.encoder_cost(adapter.encoder, meta, rows), dtype=np.float64).reshape(-1)
        if out.shape != rows.shape or not np.all(np.isfinite(out)) or np.any(out < 0):
            raise ValueError(
                f"encoder_cost must give one finite time >= 0 per {adapter.encoder} item, got {out!r}"
            )
        return out
    flops = 3.0 * family.encoder_flops(handle.model, adapter, meta, rows)
    cost = handle.cost
    per_flop = (
        cost.linear / (6.0 * _llm_params(handle.model)) if isinstance(cost, CostModel) else 1.0 / _FLOPS
    )
    return flops * per_flop


def _llm_params(model) -> float:
    text = text_config(model)
    h = int(getattr(text, "hidden_size", 4096) or 4096)
    heads = int(getattr(text, "num_attention_heads", 32) or 32)
    head_dim = int(getattr(text, "head_dim", None) or h // heads)
    kv = int(getattr(text, "num_key_value_heads", heads) or heads) * head_dim
    ffn = float(getattr(text, "intermediate_size", None) or 3.5 * h)
    layers = int(getattr(text, "num_hidden_layers", 32) or 32)
    return max(layers * (2.0 * h * h + 2.0 * h * kv + 3.0 * h * ffn), 1.0)


def group_cost(llm: CostModel, enc: np.ndarray):
    """The per-sequence cost :func:`~mmbalance.balancing.cp_schedule` plans with when a group's
    members also encode: sequence ``s`` on ``d`` ranks takes
    ``linear*l/d + max(attention*(1+eta)*l^2/d, ring*l*(d-1)/d + ring_latency*(d-1)) + E_s/d``
    (``a + c`` without ``overlap``; ``fixed`` once per sequence), ``E_s`` the encoder seconds of
    its media (spread over the group's members); a group takes the sum over its sequences."""
    eta = llm.eta

    def cost(lengths: np.ndarray, degree: int) -> np.ndarray:
        if lengths.shape != enc.shape:
            raise AssertionError("cp_schedule called the per-sequence cost with other sequences")
        x = lengths.astype(np.float64)
        d = float(degree)
        a = llm.attention * (1.0 + eta) * x * x / d
        c = llm.ring * x * (d - 1.0) / d + llm.ring_latency * (d - 1.0) if degree > 1 else np.zeros_like(x)
        t = llm.fixed + llm.linear * x / d + (np.maximum(a, c) if llm.overlap else a + c) + enc / d
        return np.where(lengths > 0, t, 0.0)

    cost.__qualname__ = "llm_and_encoder_cost"
    return cost


# ------------------------------------------------------------------------------ the local batch
@dataclass
class _Local:
    seqs: Sequences
    positions: Tensor | None  # int64 [T, 3]
    kinds: list[np.ndarray]  # per sequence: 0 text, 1 + stream at placeholders
    items: list[Items | None]  # per adapter
    item_seq: list[np.ndarray]  # per adapter: local sequence of every item
    item_stream: list[np.ndarray]
    out_rows: list[np.ndarray]
    options: list[dict]


def _prepare(handle, family: VLMFamily, adapters: list[EncoderAdapter], batch: Mapping) -> _Local:
    if not isinstance(batch, Mapping):
        raise TypeError(f"batch must be a mapping of model inputs, got {type(batch).__name__}")
    known = set(_TEXT_KEYS) | family.batch_keys | {"use_cache", "return_dict", "num_items_in_batch"}
    for key, val in batch.items():
        if key not in known and val is not None:
            raise ValueError(
                f"batch[{key!r}]: handle.shard does not know how to split this input of {family.label} (it takes "
                f"{', '.join(sorted(set(_TEXT_KEYS) | family.batch_keys))})"
            )
    pos = batch.get("position_ids")
    if isinstance(pos, Tensor) and pos.dim() == 3:
        raise ValueError(
            "batch['position_ids']: handle.shard computes the M-RoPE positions of every sequence itself (the "
            "model's get_rope_index on the whole sequence); pass none, or 1-D packed positions [1, T]"
        )
    seqs = split_sequences({k: batch[k] for k in _TEXT_KEYS if k in batch})
    model = handle.model
    streams = family.streams(model)
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
    positions = family.positions(model, batch, ids, kinds, seqs.spans) if family.mrope else None
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
        stream = family.item_streams(adapter, got.meta)
        rows_out = np.asarray(adapter.out_rows(model, got.meta, **opts), dtype=np.int64)
        seq_of = np.full(len(got), -1, dtype=np.int64)
        for k in np.unique(stream).tolist():
            idx = np.flatnonzero(stream == k)
            name = streams[k][0]
            per_seq = _assign(rows_out[idx], counts[:, k], _media_key(family, name), name)
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
    return _Local(seqs, positions, kinds, items, item_seq, item_stream, out_rows, options)


def _media_key(family: VLMFamily, name: str) -> str:
    return "pixel_values_videos" if name == "video" else "pixel_values"


def _table(local: _Local, width: int) -> np.ndarray:
    """The rows this rank contributes to the gathered table (see :func:`shard_vlm`)."""
    rows = []
    seqs = local.seqs
    labelled = seqs.labelled
    for s, n in enumerate(seqs.lengths.tolist()):
        rows.append([0, s, n, int(labelled[s])])
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
class _Step:
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


def _parse(table: np.ndarray, src: np.ndarray, world: int, adapters: list[EncoderAdapter]) -> _Step:
    kind = table[:, 0]
    is_seq, is_item, is_run = kind == 0, kind == 1, kind == 2
    offset = np.concatenate([[0], np.cumsum(np.bincount(src[is_seq], minlength=world))]).astype(np.int64)

    def glob(mask):
        return offset[src[mask]] + table[mask, 1]

    it = table[is_item]
    it_src, it_seq = src[is_item], glob(is_item)
    per = [it[:, 2] == a for a in range(len(adapters))]
    return _Step(
        lengths=table[is_seq, 2].copy(),
        labelled=table[is_seq, 3].copy(),
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


def _piece_coords(lengths: np.ndarray, piece_len: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Sequence and offset of every piece (pieces are in (sequence, offset) order and cover every
    sequence back to back)."""
    ends = np.cumsum(lengths)
    start = np.cumsum(piece_len) - piece_len
    seq = np.searchsorted(ends, start, side="right")
    return seq.astype(np.int64), (start - (ends - lengths)[seq]).astype(np.int64)


class _Runs:
    """Placeholder counts of every sequence before any offset, from the gathered run-length code."""

    def __init__(self, step: _Step, n: int):
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


def _feature_segments(
    step: _Step, a: int, runs: _Runs, piece_seq, piece_off, piece_len, piece_dst, enc, slot
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


def _spread(step: _Step, a: int, layout, seconds: np.ndarray, load: np.ndarray) -> np.ndarray:
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


# ---------------------------------------------------------------------------------------- moves
class _Comm:
    """The step's collectives over the handle's group, or their one-process identities."""

    def __init__(self, own):
        self.own = own
        self.rank = dist.get_rank(own) if own is not None else 0
        self.world = dist.get_world_size(own) if own is not None else 1
        self.device = comm_device(own) if own is not None else torch.device("cpu")

    def move(self, tensors: list[Tensor], lengths: np.ndarray, plan: Plan) -> list[Tensor]:
        """``rebalance`` of ``tensors`` (this rank's examples of ``lengths`` rows) along ``plan``."""
        if self.own is None:  # one rank: every plan keeps the order
            if not np.array_equal(plan.recv_order(0), np.arange(plan.num_examples)):
                raise AssertionError("a one-rank plan reorders its examples")
            return list(tensors)
        moved = [t.to(self.device) for t in tensors]
        cu = cu_seqlens_from_lengths(lengths.astype(np.int64), device=self.device)
        out, _ = rebalance(moved, cu, plan, self.own)
        return list(out)


def _encoder_handle(model):
    """The :class:`~.balance.EncoderBalanceHandle` applied to ``model``, if one is active."""
    handle = model.__dict__.get(_ENCODER_BALANCE_ATTR)
    return handle if handle is not None and handle.active else None


def _gather(handle, family: VLMFamily, adapters: list[EncoderAdapter], batch: Mapping, eh, comm: _Comm):
    """This rank's batch read, the agreement, and the gathered table: ``(local, step)``."""
    model = handle.model
    width = 6 + max([len(a.meta_columns) for a in adapters] + [1])
    if handle.own is None:
        local = _prepare(handle, family, adapters, batch)
        table = _table(local, width)
        return local, _parse(table, np.zeros(table.shape[0], dtype=np.int64), 1, adapters)
    own_ranks = tuple(dist.get_process_group_ranks(handle.own))
    enc_ranks = None if eh is None else tuple(dist.get_process_group_ranks(eh.group))
    found: _Local | None = None
    table_in = None
    with Entry("apply_dynamic_cp.shard", handle.own) as e:
        e.fields = {
            "max_tokens_per_rank": handle.max_tokens_per_rank,
            "cost": cost_key(handle.cost),
            "model": type(model).__name__,
            "encoder balance": enc_ranks,
            "adapters": [f"{type(a).__name__}(split_frames={a.splits_frames})" for a in adapters],
        }
        if enc_ranks is not None and enc_ranks != own_ranks:
            raise ValueError(
                "group: apply_encoder_balance on this model balances over other ranks than apply_dynamic_cp; "
                "give both the same group"
            )
        found = _prepare(handle, family, adapters, batch)
        e.fields["labels"] = found.seqs.has_labels
        e.fields["encoder options"] = repr([sorted(o.items()) for o in found.options])
        table_in = _table(found, width)
    table, src = gather_table(table_in, handle.own, entry=e)
    assert found is not None  # a rank whose batch failed has raised in gather_table
    return found, _parse(table, src, comm.world, adapters)


@dataclass
class _Media:
    """What the media moves leave on this rank."""

    mm: dict[str, object]  # mm_encoder_outputs
    links: list[Tensor]  # what the anchor ties into every rank's backward
    load: np.ndarray  # modelled encoder seconds per rank, as planned
    home: np.ndarray  # ... as sampled (every rank encoding its own media)
    split_items: dict[str, int]
    encoded_rows: int
    encoders: dict[str, dict]


def _media(handle, family: VLMFamily, adapters, local: _Local, step: _Step, layout, seconds, eh,
           comm: _Comm) -> _Media:  # fmt: skip
    """Encode every item once and send its feature rows to the shards of its placeholders."""
    model = handle.model
    rank, world = comm.rank, comm.world
    device = model_device(model)
    streams = family.streams(model)
    piece_seq, piece_off = _piece_coords(step.lengths, layout.piece_len)
    runs = _Runs(step, step.lengths.size)
    res = _Media({}, [], np.zeros(world), np.zeros(world), {}, 0, {})
    for k, adapter in enumerate(adapters):
        n_items = step.seq[k].size
        if not n_items:  # no rank has an item of this encoder: nobody runs it
            continue
        rows = step.rows[k]
        if eh is not None:  # the encoder balancing's plan, over the whole world
            costs = eh.item_costs(adapter, step.meta[k], rows)
            units = np.maximum(1, np.rint(costs * (1e9 / max(float(costs.max()), 1e-300)))).astype(np.int64)
            pix_plan = post_balance(units, world, "sum", src_ranks=step.src[k],
                                    ranks_per_node=eh.ranks_per_node).with_lengths(rows)  # fmt: skip
            enc = pix_plan.dst_rank
            np.add.at(res.load, enc, seconds[k])
        else:  # each group encodes its own sequences' items
            enc = _spread(step, k, layout, seconds[k], res.load)
            pix_plan = Plan.from_destinations(rows, enc, world, step.src[k])
        np.add.at(res.home, step.src[k], seconds[k])
        slot = np.zeros(n_items, dtype=np.int64)
        for r in range(world):
            o = pix_plan.recv_order(r)
            slot[o] = np.arange(o.size)
        got = local.items[k]
        pay = got.payload if got is not None else adapter.empty_payload(model)
        my_rows = got.rows if got is not None else np.zeros(0, dtype=np.int64)
        moved = comm.move(pay, my_rows, pix_plan)
        recv = pix_plan.recv_order(rank)
        opts = local.options[k]
        if recv.size:
            tower = model_device(core(model))
            outputs = adapter.encode(model, [t.to(tower) for t in moved], step.meta[k][recv], **opts)
            res.encoded_rows += int(rows[recv].sum())
        else:  # nothing to encode here: a tiny item keeps the encoder calls equal on every rank
            d_payload, d_meta = adapter.dummy(model)
            dummy_out = adapter.encode(model, d_payload, d_meta, **opts)
            res.links.extend(dummy_out)
            outputs = [t[:0] for t in dummy_out]
        seg = _feature_segments(
            step, k, runs, piece_seq, piece_off, layout.piece_len, layout.piece_dst, enc, slot
        )
        feat_plan = Plan.from_destinations(seg["len"], seg["dst"], world, seg["src"])
        mine = seg["src"] == rank
        if int(seg["len"][mine].sum()) != int(outputs[0].shape[0]):
            raise AssertionError("the encoder outputs do not match the feature move")  # a planner bug
        received = comm.move(outputs, seg["len"][mine], feat_plan)
        res.links.extend(received)
        # the rows of every stream, in the order of the shard's placeholders
        got_seg = feat_plan.recv_order(rank)
        starts = np.concatenate([[0], np.cumsum(seg["len"][got_seg])]).astype(np.int64)
        for st in np.unique(step.stream[k]).tolist():
            sel = np.flatnonzero(seg["stream"][got_seg] == st)
            if sel.size:
                sel = sel[np.lexsort((seg["row"][got_seg][sel], seg["piece"][got_seg][sel]))]
                index = np.concatenate([np.arange(starts[j], starts[j + 1]) for j in sel.tolist()])
                idx = torch.from_numpy(index).to(received[0].device)
                feats = [t.index_select(0, idx).to(device) for t in received]
                deep = [(f,) for f in feats[1:]] if len(feats) > 1 else None
                res.mm[streams[st][0]] = pooled((feats[0],), deep)
            # items whose rows reach more than one rank
            of = seg["stream"] == st
            pairs = np.unique(np.stack([seg["src"][of], seg["slot"][of], seg["dst"][of]], 1), axis=0)
            _, ranks_per_item = np.unique(pairs[:, :2], axis=0, return_counts=True)
            name = streams[st][0]
            res.split_items[name] = res.split_items.get(name, 0) + int((ranks_per_item > 1).sum())
        mine_home = np.bincount(step.src[k], weights=seconds[k], minlength=world)
        mine_load = np.bincount(enc, weights=seconds[k], minlength=world)
        res.encoders[adapter.encoder] = {
            "items": int(n_items), "rows": int(rows.sum()), "before": _ratio(mine_home), "after": _ratio(mine_load),
        }  # fmt: skip
    return res


def shard_vlm(handle, batch: Mapping) -> dict:
    """:meth:`DynamicCPHandle.shard` for a vision-language model (see the module docstring)."""
    model = handle.model
    family: VLMFamily = handle.vlm
    comm = _Comm(handle.own)
    rank, world = comm.rank, comm.world
    eh = _encoder_handle(model)
    adapters = list(eh.adapters.values()) if eh is not None else handle.adapters
    local, step = _gather(handle, family, adapters, batch, eh, comm)
    lengths, labelled = step.lengths, step.labelled

    # ---- the plan: CP groups under the budget, with the encoder phase in the cost
    seconds = [
        encoder_seconds(handle, family, a, step.meta[k], step.rows[k]) if step.rows[k].size else np.zeros(0)
        for k, a in enumerate(adapters)
    ]
    enc_seq = np.zeros(lengths.size)
    for k in range(len(adapters)):
        np.add.at(enc_seq, step.seq[k], seconds[k])
    cost = handle.cost
    if enc_seq.any() and eh is None and handle.encoder_cost is not None and isinstance(cost, CostModel):
        cost = group_cost(cost, enc_seq)
    layout = plan_layout(
        lengths, step.seq_src, world, handle.max_tokens_per_rank, cost, handle.context_parallel
    )
    groups = handle.ring_groups(layout) if handle.own is not None else {}

    # ---- the token columns to their pieces
    seqs = local.seqs
    cols = [seqs.input_ids, seqs.labels, seqs.shift_labels, positions(seqs.lengths)]
    if family.mrope:
        assert local.positions is not None
        cols += [local.positions[:, j] for j in range(3)]
    plan = Plan.from_destinations(layout.piece_len, layout.piece_dst, world, layout.piece_src)
    out = comm.move([torch.stack(cols, dim=1)], layout.piece_len[layout.piece_src == rank], plan)[0].cpu()

    # ---- the media, then the shard
    media = _media(handle, family, adapters, local, step, layout, seconds, eh, comm)
    mm = media.mm
    shard = shard_of(layout, lengths, rank, groups, int(out.shape[0]))
    if shard is None:
        shard = idle_shard()
        stand_in = [pad_id(model), IGNORE, IGNORE, 0] + ([0, 0, 0] if family.mrope else [])
        out = torch.tensor([stand_in], dtype=torch.int64)
    ids = out[:, 0].numpy()
    for name, token in family.streams(model):
        want = int((ids == token).sum())
        entry = mm.get(name)
        have = int(entry.pooler_output[0].shape[0]) if entry is not None else 0  # type: ignore[attr-defined]
        if want != have:
            raise AssertionError(
                f"the shard holds {want} {name} placeholders but {have} feature rows arrived"
            )
    links = [t for t in media.links if t.requires_grad]
    if links and handle.own is not None:
        shard.anchor = ZeroLink.apply(*links)

    # ---- stats: modelled LLM time (the handle's cost) plus every rank's encoder seconds
    before, after = _modelled(handle.cost, lengths, step.seq_src, layout, world)
    if before is not None and after is not None:
        before, after = before + media.home, after + media.load
    handle.record(lengths, step.seq_src, labelled, layout, world, plan, before, after)
    handle.stats["encoders"] = media.encoders
    handle.stats["split_items"] = media.split_items
    handle.stats["encoded_rows"] = media.encoded_rows
    handle.stats["local_sequences"] = int(seqs.lengths.size)

    out = out.to(model_device(model))
    kw: dict = {"input_ids": out[:, 0].unsqueeze(0), "use_cache": False, CP_KEYWORD: shard}
    if family.mrope:
        kw["position_ids"] = out[:, 3:7].t().contiguous().unsqueeze(1)  # [4, 1, T]: text, t, h, w
    else:
        kw["position_ids"] = out[:, 3].unsqueeze(0)
    if mm:
        kw["mm_encoder_outputs"] = mm
    if seqs.has_labels:
        kw["labels"] = out[:, 1].unsqueeze(0)
        kw["shift_labels"] = out[:, 2].unsqueeze(0)
        kw["num_items_in_batch"] = int(labelled.sum())
    return kw


def _ratio(load: np.ndarray) -> float:
    mean = float(load.mean()) if load.size else 0.0
    return float(load.max() / mean) if mean > 0 else 1.0


def _modelled(cost, lengths, src, layout, world):
    """Modelled LLM time per rank as sampled and as planned, with a :class:`CostModel` (else
    ``(None, None)``: the handle's own statistics)."""
    if not isinstance(cost, CostModel):
        return None, None
    before = np.array([cost.time(lengths[src == r]) if (src == r).any() else 0.0 for r in range(world)])
    after = np.zeros(world)
    for g in layout.schedule:
        t = cost.time(lengths[np.asarray(g.sequences, dtype=np.int64)], g.degree)
        for r in g.ranks:
            after[r] = t
    return before, after


# ------------------------------------------------------------------- Trainer: cut without talking
#: the model keyword that carries a shard's :class:`PendingMedia` to the forward
MEDIA_KEYWORD = "mmbalance_media"


@dataclass
class _PendingEntry:
    adapter: EncoderAdapter
    payload: list[Tensor]  # inputs of the items this rank encodes, in order
    meta: np.ndarray  # their metadata
    options: dict
    segments: np.ndarray  # rows of this rank's outputs per segment it sends, in order
    plan: Plan | None  # the feature move over the group's ranks (None: the group has no item)
    index: dict[str, Tensor]  # stream -> rows of the received buffer, in the shard's placeholder order
    rows: int  # input rows this rank encodes


@dataclass(eq=False)
class PendingMedia:
    """The encoder work of one shard that :func:`~mmbalance.integrations.hf.balance_trainer`'s
    collator leaves for the forward (the collator cuts shards without communication): every rank
    encodes its share of its CP group's items (a stand-in where it has none), and one all-to-all
    over the group sends the feature rows to the members holding their placeholders. The forward
    pre-hook :func:`resolve_media` runs it."""

    entries: list[_PendingEntry]
    degree: int
    streams: list[tuple[str, int]]

    def __repr__(self) -> str:
        return f"PendingMedia(degree={self.degree}, items={[int(e.meta.shape[0]) for e in self.entries]})"


class GroupCutter:
    """Cuts this rank's part of its CP group's collated processor batch (the same batch on every
    member): the sequences, their M-RoPE positions (``get_rope_index`` on every whole sequence)
    and the :class:`PendingMedia` of this rank; items are spread over the members as
    :func:`shard_vlm` spreads them without encoder balancing."""

    def __init__(self, model, cost, encoder_cost="auto"):
        family = vlm_family(model)
        if family is None:
            raise ValueError(f"model: {type(model).__name__} is not a vision-language model GroupCutter cuts")
        self.model = model
        self.family = family
        self.cost = cost
        self.encoder_cost = encoder_cost
        self.adapters = adapters_for(model)

    def cut(
        self, batch: Mapping, degree: int, group_rank: int
    ) -> tuple[Sequences, Tensor | None, PendingMedia]:
        from mmbalance.balancing.cp_schedule import CPGroup

        local = _prepare(self, self.family, self.adapters, batch)
        adapters = self.adapters
        width = 6 + max([len(a.meta_columns) for a in adapters] + [1])
        table = _table(local, width)
        step = _parse(table, np.zeros(table.shape[0], dtype=np.int64), 1, adapters)
        n = step.lengths.size
        group = CPGroup(int(degree), tuple(range(degree)), np.arange(n, dtype=np.int64), 0.0)
        plen, _, pdst, _ = pieces(step.lengths, np.zeros(n, dtype=np.int64), [group], degree)
        piece_seq, piece_off = _piece_coords(step.lengths, plen)
        runs = _Runs(step, n)
        layout = _GroupLayout([group])
        load = np.zeros(degree)
        streams = self.family.streams(self.model)
        entries = []
        for k, adapter in enumerate(adapters):
            got = local.items[k]
            n_items = step.seq[k].size
            empty = adapter.empty_payload(self.model)
            if not n_items or got is None:
                entries.append(_PendingEntry(adapter, empty, np.zeros((0, len(adapter.meta_columns)), np.int64),
                                             local.options[k], np.zeros(0, np.int64), None, {}, 0))  # fmt: skip
                continue
            seconds = encoder_seconds(self, self.family, adapter, step.meta[k], step.rows[k])
            enc = _spread(step, k, layout, seconds, load)
            slot = np.zeros(n_items, dtype=np.int64)
            for e in range(degree):
                of = np.flatnonzero(enc == e)
                slot[of] = np.arange(of.size)
            seg = _feature_segments(step, k, runs, piece_seq, piece_off, plen, pdst, enc, slot)
            plan = Plan.from_destinations(seg["len"], seg["dst"], degree, seg["src"])
            mine = np.flatnonzero(enc == group_rank)
            starts = np.concatenate([[0], np.cumsum(got.rows)]).astype(np.int64)
            spans = [np.arange(starts[i], starts[i + 1]) for i in mine.tolist()]
            take = torch.from_numpy(np.concatenate(spans + [np.zeros(0, np.int64)]).astype(np.int64))
            payload = [t.index_select(0, take) for t in got.payload]
            recv = plan.recv_order(group_rank)
            offs = np.concatenate([[0], np.cumsum(seg["len"][recv])]).astype(np.int64)
            index = {}
            for st in np.unique(step.stream[k]).tolist():
                sel = np.flatnonzero(seg["stream"][recv] == st)
                if sel.size:
                    sel = sel[np.lexsort((seg["row"][recv][sel], seg["piece"][recv][sel]))]
                    index[streams[st][0]] = torch.from_numpy(
                        np.concatenate([np.arange(offs[j], offs[j + 1]) for j in sel.tolist()])
                    )
            entries.append(_PendingEntry(adapter, payload, step.meta[k][mine], local.options[k],
                                         seg["len"][seg["src"] == group_rank], plan, index,
                                         int(step.rows[k][mine].sum())))  # fmt: skip
        return local.seqs, local.positions, PendingMedia(entries, int(degree), streams)


@dataclass
class _GroupLayout:
    schedule: list


def resolve_media(model, kwargs: dict) -> dict:
    """The forward's part of a :class:`PendingMedia` in ``kwargs``: encode, exchange within the CP
    group, and give the features to the model (``mm_encoder_outputs``), with the anchor that keeps
    every member's backward in the exchange. Returns the new keywords."""
    pending = kwargs.pop(MEDIA_KEYWORD, None)
    if pending is None:
        return kwargs
    if not isinstance(pending, PendingMedia):
        raise TypeError(f"{MEDIA_KEYWORD} must be a PendingMedia (from balance_trainer's collator)")
    shard = kwargs.get(CP_KEYWORD)
    group = shard.process_group() if shard is not None else None
    device = model_device(model)
    tower = model_device(core(model))
    mm: dict[str, object] = dict(kwargs.get("mm_encoder_outputs") or {})
    links: list[Tensor] = []
    for e in pending.entries:
        if e.meta.shape[0]:
            outputs = e.adapter.encode(model, [t.to(tower) for t in e.payload], e.meta, **e.options)
        else:  # a stand-in item: every rank runs the encoder once, whatever its share
            d_payload, d_meta = e.adapter.dummy(model)
            dummy = e.adapter.encode(model, d_payload, d_meta, **e.options)
            links.extend(dummy)
            outputs = [t[:0] for t in dummy]
        if e.plan is None:
            continue
        if pending.degree > 1:
            comm = comm_device(group)
            cu = cu_seqlens_from_lengths(e.segments.astype(np.int64), device=comm)
            received, _ = rebalance([t.to(comm) for t in outputs], cu, e.plan, group)
        else:
            received = outputs
        links.extend(received)
        for name, index in e.index.items():
            idx = index.to(received[0].device)
            feats = [t.index_select(0, idx).to(device) for t in received]
            mm[name] = pooled((feats[0],), [(f,) for f in feats[1:]] if len(feats) > 1 else None)
    ids = kwargs.get("input_ids")
    if ids is not None:
        for name, token in pending.streams:
            want = int((ids == token).sum())
            entry = mm.get(name)
            have = int(entry.pooler_output[0].shape[0]) if entry is not None else 0  # type: ignore[attr-defined]
            if want != have:
                raise AssertionError(
                    f"the shard holds {want} {name} placeholders but {have} feature rows arrived"
                )
    if mm:
        kwargs["mm_encoder_outputs"] = mm
    links = [t for t in links if t.requires_grad]
    if links and shard is not None:
        shard.anchor = ZeroLink.apply(*links)
    return kwargs


def install_media_hook(model) -> None:
    """Make ``model``'s forward resolve :class:`PendingMedia` (idempotent): a forward pre-hook, so
    DDP and the other wrappers call it, and the forward's signature stays the model's."""
    if getattr(model, "_mmbalance_media_hook", None) is not None:
        return

    def hook(module, args, kwargs):
        if MEDIA_KEYWORD not in kwargs:
            return None
        return args, resolve_media(module, dict(kwargs))

    model._mmbalance_media_hook = model.register_forward_pre_hook(hook, with_kwargs=True)
