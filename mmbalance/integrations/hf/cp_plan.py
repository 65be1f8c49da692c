"""The numpy side of dynamic context parallelism, shared by the text path (``dynamic_cp.py``),
the vision-language path (``dynamic_cp_vlm*.py``) and the Trainer's data side (``cp_trainer.py``):
a batch read into its sequences (:func:`split_sequences`), the planner's cost for a model
(:func:`cost_model_of`), one step's plan (:func:`plan_layout`: CP groups under the token budget,
each sequence cut into the zigzag chunks of its group's ranks), and a rank's shard and model
keywords from a plan. No communication happens here.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from mmbalance.balancing import CostModel, cp_schedule, post_balance
from mmbalance.balancing.cp_schedule import CPGroup
from mmbalance.collectives.ring_plan import ring_plan

from .cp_attention import CP_KEYWORD, CPShard

__all__ = [
    "IGNORE", "Layout", "Sequences", "cost_key", "cost_model_of", "idle_shard", "model_device", "model_kwargs",
    "pad_id", "pieces", "plan_layout", "positions", "shard_of", "split_sequences", "text_config",
]  # fmt: skip

IGNORE = -100
# batch keys that describe the packing of the input (recomputed for the shard, so dropped)
_PACKING_KEYS = {
    "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx", "num_items_in_batch",
}  # fmt: skip
_COLUMNS = ("input_ids", "labels", "shift_labels", "position_ids")


# ------------------------------------------------------------------------------- the sequences
@dataclass
class Sequences:
    """This rank's sequences, back to back (int64 ``[T]`` each), in batch order.

    ``lengths`` ``[n]``; ``labels``/``shift_labels`` are all ``-100`` when the batch had none.
    ``spans``: ``(row, start, end)`` of every sequence in the batch's ``[B, L]`` tensors (what
    slices another per-token input, such as ``mm_token_type_ids``, the same way).
    """

    input_ids: Tensor
    labels: Tensor
    shift_labels: Tensor
    lengths: np.ndarray
    has_labels: bool
    spans: list[tuple[int, int, int]] | None = None

    @property
    def labelled(self) -> np.ndarray:
        """Labelled tokens (``shift_labels != -100``) of every sequence, int64 ``[n]``."""
        if not self.lengths.size:
            return np.zeros(0, dtype=np.int64)
        seg = np.repeat(np.arange(self.lengths.size), self.lengths)
        mask = (self.shift_labels != IGNORE).numpy()
        return np.bincount(seg[mask], minlength=self.lengths.size).astype(np.int64)


def _as_2d(batch: Mapping, name: str) -> Tensor | None:
    t = batch.get(name)
    if t is None:
        return None
    if not isinstance(t, Tensor):
        raise TypeError(f"batch[{name!r}] must be a tensor, got {type(t).__name__}")
    if t.dim() == 1:
        t = t.unsqueeze(0)
    if t.dim() != 2:
        raise ValueError(f"batch[{name!r}] must be [B, L] (or [1, T] packed), got shape {tuple(t.shape)}")
    return t


def split_sequences(batch: Mapping) -> Sequences:
    """The sequences of a batch, packed or padded (see :meth:`DynamicCPHandle.shard`).

    Rows are cut at ``attention_mask`` (one run of valid tokens per row: left or right padding)
    and, inside it, where ``position_ids`` restart (packed rows: every sequence starts at 0 and
    counts up by one). Raises ValueError/TypeError naming the batch key for anything else.
    """
    if not isinstance(batch, Mapping):
        raise TypeError(f"batch must be a mapping of model inputs, got {type(batch).__name__}")
    ids = _as_2d(batch, "input_ids")
    if ids is None:
        raise ValueError(
            "batch has no 'input_ids' (handle.shard needs token ids; inputs_embeds are not split)"
        )
    if ids.dtype.is_floating_point:
        raise TypeError(f"batch['input_ids'] must be integer token ids, got {ids.dtype}")
    known = set(_COLUMNS) | _PACKING_KEYS | {"attention_mask", "use_cache", "return_dict"}
    for key, val in batch.items():
        if key not in known and val is not None:
            raise ValueError(
                f"batch[{key!r}]: handle.shard does not know how to split this input (it splits input_ids, "
                f"attention_mask, position_ids and labels)"
            )
    b, length = ids.shape
    shapes = {}
    for name in ("attention_mask", "position_ids", "labels"):
        t = _as_2d(batch, name)
        if t is not None and tuple(t.shape) != (b, length):
            raise ValueError(f"batch[{name!r}] has shape {tuple(t.shape)}, input_ids {(b, length)}")
        shapes[name] = t
    mask, pos, labels = shapes["attention_mask"], shapes["position_ids"], shapes["labels"]
    ids_np = ids.detach().cpu().to(torch.int64)
    lab_np = labels.detach().cpu().to(torch.int64) if labels is not None else None
    keep_rows: list[tuple[int, int, int]] = []  # (row, start, end) of valid tokens
    valid = (
        mask.detach().cpu().to(torch.bool).numpy() if mask is not None else np.ones((b, length), dtype=bool)
    )
    for r in range(b):
        d = np.diff(np.concatenate([[0], valid[r].astype(np.int8), [0]]))
        starts, ends = np.flatnonzero(d == 1), np.flatnonzero(d == -1)
        if starts.size > 1:
            raise ValueError(
                f"batch['attention_mask'] row {r} has {starts.size} separate runs of valid tokens; handle.shard "
                "takes left or right padding (one run per row), or packed rows without attention_mask"
            )
        if starts.size:
            keep_rows.append((r, int(starts[0]), int(ends[0])))
    pos_np = pos.detach().cpu().to(torch.int64).numpy() if pos is not None else None
    lengths: list[int] = []
    spans: list[tuple[int, int, int]] = []
    id_parts, lab_parts, shift_parts = [], [], []
    for r, s, e in keep_rows:
        if pos_np is not None:
            p = pos_np[r, s:e]
            cuts = np.flatnonzero(np.diff(p) != 1) + 1
            bounds = np.concatenate([[0], cuts, [e - s]])
            for a in bounds[:-1].tolist():
                if p[a] != 0:
                    raise ValueError(
                        f"batch['position_ids'] row {r}: a sequence starts at position {int(p[a])} (token {s + a}); "
                        "every sequence must count 0, 1, 2, ... (packed rows restart at 0, as "
                        "DataCollatorWithFlattening gives them)"
                    )
            seqs = [(s + a, s + z) for a, z in zip(bounds[:-1].tolist(), bounds[1:].tolist())]
        else:
            seqs = [(s, e)]
        for a, z in seqs:
            lengths.append(z - a)
            spans.append((r, a, z))
            id_parts.append(ids_np[r, a:z])
            lab = lab_np[r, a:z] if lab_np is not None else torch.full((z - a,), IGNORE, dtype=torch.int64)
            lab_parts.append(lab)
            shift = torch.full((z - a,), IGNORE, dtype=torch.int64)
            shift[:-1] = lab[1:]
            shift_parts.append(shift)
    empty = torch.zeros(0, dtype=torch.int64)
    return Sequences(
        input_ids=torch.cat(id_parts) if id_parts else empty,
        labels=torch.cat(lab_parts) if lab_parts else empty,
        shift_labels=torch.cat(shift_parts) if shift_parts else empty,
        lengths=np.asarray(lengths, dtype=np.int64),
        has_labels=labels is not None,
        spans=spans,
    )


# ------------------------------------------------------------------------------------ the cost
def cost_model_of(model, cost) -> CostModel | Callable:
    """The planner's cost for ``cost``: ``"quadratic"`` (a dense transformer of the model's text
    shape, :meth:`CostModel.transformer`: linear + causal attention + ring terms), ``"linear"``
    (tokens), a :class:`CostModel`, or a callable as :func:`~mmbalance.balancing.cp_schedule`
    takes it."""
    if isinstance(cost, CostModel) or (callable(cost) and not isinstance(cost, str)):
        return cost
    if cost == "linear":
        return CostModel(linear=1.0)
    if cost != "quadratic":
        raise ValueError(f"cost must be 'quadratic', 'linear', a CostModel or a callable, got {cost!r}")
    text = text_config(model)
    h = int(getattr(text, "hidden_size", 4096) or 4096)
    heads = int(getattr(text, "num_attention_heads", 32) or 32)
    head_dim = int(getattr(text, "head_dim", None) or h // heads)
    kv = int(getattr(text, "num_key_value_heads", heads) or heads) * head_dim
    ffn = getattr(text, "intermediate_size", None)
    return CostModel.transformer(
        hidden_size=h,
        num_layers=int(getattr(text, "num_hidden_layers", 32) or 32),
        kv_size=kv,
        ffn_size=int(ffn) if ffn else None,
    )


def cost_key(cost) -> str:
    if isinstance(cost, CostModel):
        return repr(cost)
    return f"callable {getattr(cost, '__qualname__', type(cost).__name__)}"


# ------------------------------------------------------------------------------------ the plan
@dataclass(frozen=True)
class Layout:
    """One step's plan: the schedule, and the pieces (zigzag chunks) that move."""

    schedule: list  # CPGroup list
    group_of_rank: np.ndarray  # [world] group index of every rank, -1 idle
    rank_in_group: np.ndarray  # [world]
    piece_len: np.ndarray
    piece_src: np.ndarray
    piece_dst: np.ndarray
    shard_tokens: np.ndarray  # [world]
    plan_s: float


def pieces(lengths: np.ndarray, src: np.ndarray, schedule, world: int):
    """Every sequence cut into the zigzag chunks of its group's ranks, in (sequence, offset) order:
    ``(length, source rank, destination rank)`` per non-empty piece, and tokens per rank."""
    n = lengths.size
    seq_ids, offsets, lens, dsts = [], [], [], []
    tokens = np.zeros(world, dtype=np.int64)
    for g in schedule:
        members = np.asarray(g.sequences, dtype=np.int64)
        if members.size == 0:
            continue
        cu = np.concatenate([[0], np.cumsum(lengths[members])])
        rp = ring_plan(cu, g.degree, "zigzag")
        for j, rank in enumerate(g.ranks):
            start0, len0, start1 = rp.runs[j, :, 0], rp.runs[j, :, 1], rp.runs[j, :, 2]
            len1 = rp.local_lengths[j] - len0
            for st, ln in ((start0, len0), (start1, len1)):
                keep = ln > 0
                seq_ids.append(members[keep])
                offsets.append(st[keep].astype(np.int64))
                lens.append(ln[keep].astype(np.int64))
                dsts.append(np.full(int(keep.sum()), rank, dtype=np.int64))
            tokens[rank] = rp.tokens[j]
    if not seq_ids:
        z = np.zeros(0, dtype=np.int64)
        return z, z, z, tokens
    seq = np.concatenate(seq_ids)
    off = np.concatenate(offsets)
    order = np.lexsort((off, seq))
    if (
        seq.size
        and np.bincount(seq, weights=np.concatenate(lens), minlength=n).astype(np.int64).tolist()
        != lengths.tolist()
    ):
        raise AssertionError("the pieces do not cover every sequence once")  # a planner bug, never input
    return np.concatenate(lens)[order], src[seq[order]], np.concatenate(dsts)[order], tokens


def plan_layout(lengths: np.ndarray, src: np.ndarray, world: int, budget: int | None, cost,
                context_parallel: bool = True, encoder_seconds: np.ndarray | None = None) -> Layout:  # fmt: skip
    """The schedule under ``budget`` tokens per rank, zigzag rounding included (re-planned with a
    smaller nominal budget until every real shard fits). Identical on every rank.
    ``encoder_seconds``: per sequence, the encoder seconds its group's members share
    (:func:`~mmbalance.balancing.cp_schedule`'s argument), or ``None``.

    ``context_parallel=False``: degree 1 everywhere, every sequence whole on one rank
    (OrchMLLM's post-balancing of the LLM phase, :func:`~mmbalance.balancing.post_balance` with
    the cost's linear and attention terms); ``budget`` may then be ``None`` (no limit).
    """
    t0 = time.perf_counter()
    if not context_parallel:
        return _degree_one(lengths, src, world, budget, cost, t0)
    assert budget is not None
    longest = int(lengths.max(initial=0))
    if longest > world * budget:
        raise ValueError(
            f"max_tokens_per_rank={budget}: a sequence of {longest} tokens does not fit the {world} ranks "
            f"together ({world * budget} tokens); raise max_tokens_per_rank or drop the sequence"
        )
    if int(lengths.sum()) > world * budget:
        raise ValueError(
            f"max_tokens_per_rank={budget}: the step's {int(lengths.sum())} tokens do not fit the {world} ranks "
            f"together ({world * budget} tokens); draw fewer examples per rank or raise max_tokens_per_rank"
        )
    nominal = budget
    for _ in range(16):
        try:
            schedule = (
                cp_schedule(lengths, world, nominal, cost, encoder_seconds=encoder_seconds)
                if lengths.size
                else []
            )
        except ValueError as exc:
            raise ValueError(
                f"max_tokens_per_rank={budget}: no CP schedule of the step's {lengths.size} sequences fits "
                f"({exc})"
            ) from None
        plen, psrc, pdst, tokens = pieces(lengths, src, schedule, world)
        over = int(tokens.max(initial=0)) - budget
        if over <= 0:
            break
        nominal -= max(over, 1)
        if nominal < 1:
            break
    else:
        over = 1
    if over > 0:
        raise ValueError(
            f"max_tokens_per_rank={budget}: zigzag shards of the step's sequences do not fit (the busiest rank "
            f"would hold {budget + over} tokens)"
        )
    return _finish(list(schedule), lengths, src, world, t0, (plen, psrc, pdst, tokens))


def _finish(schedule: list, lengths, src, world: int, t0: float, cut=None) -> Layout:
    plen, psrc, pdst, tokens = pieces(lengths, src, schedule, world) if cut is None else cut
    group_of = np.full(world, -1, dtype=np.int64)
    rank_in = np.zeros(world, dtype=np.int64)
    for gi, g in enumerate(schedule):
        for j, r in enumerate(g.ranks):
            group_of[r], rank_in[r] = gi, j
    return Layout(schedule, group_of, rank_in, plen, psrc, pdst, tokens, time.perf_counter() - t0)


def _degree_one(lengths, src, world: int, budget: int | None, cost, t0: float) -> Layout:
    """Every sequence whole on one rank, the ranks' costs balanced (post-balancing)."""
    if isinstance(cost, CostModel):
        alpha, beta = float(cost.linear), float(cost.attention * (1.0 + cost.eta))
    else:
        alpha, beta = 1.0, 0.0
    policy = "quadratic" if beta > 0 else "sum"
    plan = post_balance(lengths, world, policy, src_ranks=src, alpha=alpha, beta=beta if beta > 0 else None)
    groups = []
    for r in range(world):
        members = np.flatnonzero(plan.dst_rank == r).astype(np.int64)
        if members.size:
            t = cost.time(lengths[members]) if isinstance(cost, CostModel) else float(lengths[members].sum())
            groups.append(CPGroup(1, (r,), members, float(t)))
    lay = _finish(groups, lengths, src, world, t0)
    if budget is not None and int(lay.shard_tokens.max(initial=0)) > budget:
        raise ValueError(
            f"max_tokens_per_rank={budget}: whole sequences do not fit (the busiest rank would hold "
            f"{int(lay.shard_tokens.max())} tokens); switch context parallelism on"
        )
    return lay


def shard_of(layout: Layout, lengths: np.ndarray, rank: int, groups: dict, tokens: int) -> CPShard | None:
    """The :class:`CPShard` of ``rank`` under ``layout`` (``tokens`` received), or ``None`` for a
    rank the plan leaves idle."""
    gi = int(layout.group_of_rank[rank])
    if gi < 0 or tokens == 0:
        return None
    g = layout.schedule[gi]
    members = np.asarray(g.sequences, dtype=np.int64)
    gcu = np.concatenate([[0], np.cumsum(lengths[members])]).astype(np.int64)
    if g.degree == 1:
        local = torch.from_numpy(gcu.astype(np.int32))
        return CPShard(1, 0, None, gcu, tokens, local, int(lengths[members].max()))
    return CPShard(g.degree, int(layout.rank_in_group[rank]), groups[gi], gcu, tokens)


def idle_shard() -> CPShard:
    """The shard of a rank with nothing to run: one stand-in token (label ``-100``)."""
    cu = np.array([0, 1], dtype=np.int64)
    return CPShard(1, 0, None, cu, 1, torch.tensor([0, 1], dtype=torch.int32), 1)


def positions(lengths: np.ndarray) -> Tensor:
    if not lengths.size:
        return torch.zeros(0, dtype=torch.int64)
    starts = np.repeat(np.cumsum(lengths) - lengths, lengths)
    return torch.from_numpy(np.arange(int(lengths.sum()), dtype=np.int64) - starts)


def text_config(model):
    config = getattr(model, "config", None)
    get = getattr(config, "get_text_config", None)
    return get() if callable(get) else config


def pad_id(model) -> int:
    pad = getattr(text_config(model), "pad_token_id", None)
    return int(pad) if isinstance(pad, int) and pad >= 0 else 0


def model_device(model) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def model_kwargs(out: Tensor, shard: CPShard, items: int, has_labels: bool, device) -> dict:
    out = out.to(device)
    kw = {
        "input_ids": out[:, 0].unsqueeze(0),
        "position_ids": out[:, 3].unsqueeze(0),
        "use_cache": False,
        CP_KEYWORD: shard,
    }
    if has_labels:
        kw["labels"] = out[:, 1].unsqueeze(0)
        kw["shift_labels"] = out[:, 2].unsqueeze(0)
        kw["num_items_in_batch"] = items
    return kw
