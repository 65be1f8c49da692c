"""Dynamic context parallelism of any degree for a Hugging Face model (DHP; OrchMLLM's LLM phase).

After every rank has drawn its own batch, :meth:`DynamicCPHandle.shard` gathers the sequence
lengths (a few bytes per sequence), computes on every rank the same plan
(:func:`~mmbalance.balancing.cp_schedule`: CP groups of any integer degree under
``max_tokens_per_rank``, each sequence in one group, degree 1 a plain data-parallel rank), moves
every sequence's tokens to its group in one all-to-all (:func:`~mmbalance.collectives.rebalance`,
each zigzag chunk straight to the rank that holds it, so no rank sends a token twice) and returns
this rank's model keywords. Inside the model, ``mmbalance_varlen`` reads the shard from those
keywords and runs ring attention over the rank's group, or plain varlen attention at degree 1
(``cp_attention.py``)::

    handle = apply_dynamic_cp(model, max_tokens_per_rank=8192)   # after init_process_group
    for batch in loader:                                          # each rank its own batch
        inputs = handle.shard(batch)
        loss = model(**inputs).loss       # this rank's token-loss sum over the global count
        loss.backward()                   # DDP averages: scale by world size, or use no_sync + all_reduce(SUM)
        ...
    handle.stats   # {"degrees": [3, 1], "largest_shard": 8190, "before": 2.7, "after": 1.1, ...}

The loss: ``labels`` are shifted on the whole sequence before it is split (``shift_labels``), so
the last token of a shard is scored against the first token of the next one, and
``num_items_in_batch`` is the global count of labelled tokens. Every rank's loss is the sum of its
tokens' losses over that count, so the gradients *summed* over ranks are exactly those of the
unsharded global mean (DDP averages over ranks: multiply the loss by the world size, as
transformers' Trainer does with ``average_tokens_across_devices``).
"""

from __future__ import annotations

import numbers
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from mmbalance.balancing import CostModel, Plan, cp_schedule, post_balance
from mmbalance.balancing.cp_schedule import CPGroup
from mmbalance.collectives import GroupPool, rebalance
from mmbalance.collectives.agreement import Entry
from mmbalance.collectives.alltoall import gather_table
from mmbalance.collectives.group import comm_device, world_of
from mmbalance.collectives.inflight import gather_objects, mark_distributed_run, run
from mmbalance.collectives.ring_plan import ring_plan

from .attention_mask import ATTENTION_NAME
from .balance import own_group
from .cp_attention import CP_KEYWORD, CPShard

__all__ = [
    "IGNORE", "DynamicCPHandle", "Sequences", "apply_dynamic_cp", "cost_model_of", "idle_shard", "make_handle",
    "pad_id", "plan_layout", "shard_of", "split_sequences",
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
    text = _text_config(model)
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


def _cost_key(cost) -> str:
    if isinstance(cost, CostModel):
        return repr(cost)
    return f"callable {getattr(cost, '__qualname__', type(cost).__name__)}"


# ------------------------------------------------------------------------------------ the plan
@dataclass(frozen=True)
class _Layout:
    """One step's plan: the schedule, and the pieces (zigzag chunks) that move."""

    schedule: list  # CPGroup list
    group_of_rank: np.ndarray  # [world] group index of every rank, -1 idle
    rank_in_group: np.ndarray  # [world]
    piece_len: np.ndarray
    piece_src: np.ndarray
    piece_dst: np.ndarray
    shard_tokens: np.ndarray  # [world]
    plan_s: float


def _pieces(lengths: np.ndarray, src: np.ndarray, schedule, world: int):
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
                context_parallel: bool = True) -> _Layout:  # fmt: skip
    """The schedule under ``budget`` tokens per rank, zigzag rounding included (re-planned with a
    smaller nominal budget until every real shard fits). Identical on every rank.

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
            schedule = cp_schedule(lengths, world, nominal, cost) if lengths.size else []
        except ValueError as exc:
            raise ValueError(
                f"max_tokens_per_rank={budget}: no CP schedule of the step's {lengths.size} sequences fits "
                f"({exc})"
            ) from None
        plen, psrc, pdst, tokens = _pieces(lengths, src, schedule, world)
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


def _finish(schedule: list, lengths, src, world: int, t0: float, pieces=None) -> _Layout:
    plen, psrc, pdst, tokens = _pieces(lengths, src, schedule, world) if pieces is None else pieces
    group_of = np.full(world, -1, dtype=np.int64)
    rank_in = np.zeros(world, dtype=np.int64)
    for gi, g in enumerate(schedule):
        for j, r in enumerate(g.ranks):
            group_of[r], rank_in[r] = gi, j
    return _Layout(schedule, group_of, rank_in, plen, psrc, pdst, tokens, time.perf_counter() - t0)


def _degree_one(lengths, src, world: int, budget: int | None, cost, t0: float) -> _Layout:
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


# ---------------------------------------------------------------------------------- the handle
class DynamicCPHandle:
    """What :func:`apply_dynamic_cp` returns: :meth:`shard` per step, :attr:`stats`, :meth:`remove`."""

    def __init__(self, model, budget: int | None, cost, group, own, pool: GroupPool | None,
                 context_parallel: bool = True, vlm=None, encoder_cost="auto"):  # fmt: skip
        self.model = model
        self.context_parallel = bool(context_parallel)
        self.max_tokens_per_rank = budget
        self.cost = cost
        self.encoder_cost = encoder_cost
        self.group = group
        self._own = own
        self._pool = pool
        self._groups: dict[tuple[int, ...], object] = {}
        self._vlm = vlm  # a VLMFamily for the vision-language models (dynamic_cp_vlm.py)
        self._adapters = []
        if vlm is not None:
            from .encoder_adapter import adapters_for

            self._adapters = adapters_for(model)
        self.removed = False
        #: statistics of the last :meth:`shard`: ``degrees`` (every group's degree), ``largest_shard``
        #: (tokens of the busiest rank), ``before``/``after`` (max/mean over ranks of the modelled
        #: time as sampled and as planned), ``max_before``, ``mean_before``, ``max_after``,
        #: ``mean_after``, ``moved_tokens``, ``plan_ms``, ``sequences``, ``num_items_in_batch``;
        #: for a vision-language model (the modelled times then include every rank's encoding)
        #: also ``encoders`` (per encoder: ``items``, ``rows``, and ``before``/``after``, max/mean
        #: of the encoding over the ranks), ``split_items`` (per stream, the images or frames whose
        #: feature rows reach more than one rank) and ``encoded_rows`` (input rows this rank encoded)
        self.stats: dict = {}

    # ----------------------------------------------------------------------------- the step
    def shard(self, batch: Mapping) -> dict:
        """Post-balance this rank's batch over the group and return this rank's model kwargs.

        Every rank of the group calls it with its own batch, in either form:

        * packed (``DataCollatorWithFlattening``): ``input_ids [1, T]``, ``position_ids [1, T]``
          restarting at 0 at every sequence, ``labels [1, T]``;
        * padded (a tokenizer or processor): ``input_ids [B, L]``, ``attention_mask [B, L]``
          (left or right padding), ``labels [B, L]``.

        ``labels`` may be left out (no loss). A rank may pass no sequence at all (``[1, 0]``).

        For a vision-language model the batch is what its processor gives: the padded form plus
        ``pixel_values`` with ``image_grid_thw``, ``pixel_values_videos`` with ``video_grid_thw``
        (media in order of appearance), ``mm_token_type_ids`` and ``second_per_grid_ts`` where
        the model takes them (LLaVA: ``pixel_values``). The keywords then also hold
        ``mm_encoder_outputs`` (the shard's feature rows) and ``position_ids`` ``[4, 1, T]`` for
        the M-RoPE models (the token's position in its sequence, then the three M-RoPE rows the
        model's ``get_rope_index`` gives the whole sequence); see :mod:`.dynamic_cp_vlm`.

        Returns the model keywords: ``input_ids``, ``position_ids`` (each token's position in its
        own sequence), ``labels``, ``shift_labels`` (the next token's label, shifted on the whole
        sequence), ``num_items_in_batch`` (global labelled tokens), ``use_cache=False`` and the
        shard itself under ``mmbalance_cp`` (what the attention layers read); all ``[1, T_r]`` on
        the model's device. A rank the plan leaves idle gets one stand-in token with label
        ``-100``, so its forward and backward still run.

        Raises on every rank, before any data moves, naming the argument: a rank's bad batch
        (:class:`~mmbalance.collectives.RankMismatchError` elsewhere), ranks that disagree on
        ``max_tokens_per_rank`` or the cost, a sequence longer than
        ``world * max_tokens_per_rank``.
        """
        if self.removed:
            raise RuntimeError("this dynamic-CP handle was removed (handle.remove()); apply_dynamic_cp again")
        if self._vlm is not None:
            from .dynamic_cp_vlm import shard_vlm

            return shard_vlm(self, batch)
        device = _model_device(self.model)
        seqs: Sequences | None = None
        if self._own is None:  # one process: every sequence whole, on this rank
            seqs = split_sequences(batch)
            return self._single(seqs, device)
        world = dist.get_world_size(self._own)
        with Entry("apply_dynamic_cp.shard", self._own) as e:
            e.fields = {"max_tokens_per_rank": self.max_tokens_per_rank, "cost": _cost_key(self.cost)}
            seqs = split_sequences(batch)
            e.fields["labels"] = seqs.has_labels
        table_in = None if seqs is None else np.stack([seqs.lengths, seqs.labelled], axis=1)
        table, src = gather_table(table_in, self._own, entry=e)
        assert seqs is not None
        lengths, labelled = table[:, 0], table[:, 1]
        layout = plan_layout(lengths, src, world, self.max_tokens_per_rank, self.cost, self.context_parallel)
        rank = dist.get_rank(self._own)
        groups = self._ring_groups(layout)
        payload = torch.stack(
            [seqs.input_ids, seqs.labels, seqs.shift_labels, _positions(seqs.lengths)], dim=1
        )
        mine = layout.piece_src == rank
        cu = torch.from_numpy(np.concatenate([[0], np.cumsum(layout.piece_len[mine])]).astype(np.int64))
        plan = Plan.from_destinations(layout.piece_len, layout.piece_dst, world, layout.piece_src)
        comm = comm_device(self._own)
        out, _ = rebalance(payload.to(comm), cu.to(comm), plan, self._own)
        out = out.cpu()
        shard = shard_of(layout, lengths, rank, groups, int(out.shape[0]))
        if shard is None:
            shard = idle_shard()
            out = torch.tensor([[pad_id(self.model), IGNORE, IGNORE, 0]], dtype=torch.int64)
        self._record(lengths, src, labelled, layout, world, plan)
        self.stats["local_sequences"] = int(seqs.lengths.size)
        return _kwargs(out, shard, int(labelled.sum()), seqs.has_labels, device)

    def batches(self, loader) -> Iterator[dict]:
        """:meth:`shard` of every batch of this rank's ``loader`` (any iterable of batches), until
        every rank's loader has ended: a rank whose loader ends first takes part with empty
        batches, so no draw is lost and no rank waits for one that has stopped. One small
        all-reduce per batch agrees on the end. :attr:`stats` ``"drawn"`` counts the sequences
        this rank has drawn so far."""
        it = iter(loader)
        drawn = 0
        labels = True
        while True:
            batch = next(it, None)
            if self._own is not None:
                flag = torch.tensor(
                    [0 if batch is None else 1], dtype=torch.int64, device=comm_device(self._own)
                )
                run(dist.all_reduce, flag, op=dist.ReduceOp.MAX, group=self._own)
                more = bool(flag.item())
            else:
                more = batch is not None
            if not more:
                return
            if batch is None:
                batch = {"input_ids": torch.zeros((1, 0), dtype=torch.int64)}
                if labels:
                    batch["labels"] = torch.zeros((1, 0), dtype=torch.int64)
            else:
                labels = batch.get("labels") is not None
            kw = self.shard(batch)
            drawn += int(self.stats.get("local_sequences", 0))
            self.stats["drawn"] = drawn
            yield kw

    def _single(self, seqs: Sequences, device) -> dict:
        lengths = seqs.lengths
        budget = self.max_tokens_per_rank
        if budget is not None and int(lengths.sum()) > budget:
            raise ValueError(
                f"max_tokens_per_rank={budget}: one process holds all {int(lengths.sum())} tokens of the batch"
            )
        payload = torch.stack([seqs.input_ids, seqs.labels, seqs.shift_labels, _positions(lengths)], dim=1)
        if not lengths.size:
            payload = torch.tensor([[pad_id(self.model), IGNORE, IGNORE, 0]], dtype=torch.int64)
            lengths = np.array([1], dtype=np.int64)
        cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        shard = CPShard(
            1, 0, None, cu, int(cu[-1]), torch.from_numpy(cu.astype(np.int32)), int(lengths.max())
        )
        t = self.cost.time(seqs.lengths) if isinstance(self.cost, CostModel) else 0.0
        self.stats = {
            "degrees": [1], "largest_shard": int(cu[-1]), "before": 1.0, "after": 1.0, "max_before": t,
            "mean_before": t, "max_after": t, "mean_after": t, "moved_tokens": 0, "plan_ms": 0.0,
            "sequences": int(seqs.lengths.size), "num_items_in_batch": int(seqs.labelled.sum()),
            "local_sequences": int(seqs.lengths.size),
        }  # fmt: skip
        return _kwargs(payload, shard, int(seqs.labelled.sum()), seqs.has_labels, device)

    def _ring_groups(self, layout: _Layout) -> dict[int, object]:
        """The process group of every group of degree > 1, created in the same order on every rank."""
        base_ranks = dist.get_process_group_ranks(self._own)
        wanted = {}
        for gi, g in enumerate(layout.schedule):
            if g.degree > 1:
                wanted[gi] = tuple(base_ranks[r] for r in g.ranks)
        new = [r for r in wanted.values() if r not in self._groups and len(r) < len(base_ranks)]
        if len(base_ranks) < dist.get_world_size():
            # new_group is collective over the world: every rank creates every rank set any
            # data-parallel group needs, in one order
            new = sorted({r for sets in gather_objects(new) for r in sets})
        assert self._pool is not None
        for ranks in new:
            if ranks not in self._groups:
                self._groups[ranks] = self._pool.get(ranks)
        # the whole group runs on the handle's own communicator, never on DDP's
        return {gi: self._own if len(r) == len(base_ranks) else self._groups[r] for gi, r in wanted.items()}

    def _record(self, lengths, src, labelled, layout: _Layout, world: int, plan: Plan,
                before: np.ndarray | None = None, after: np.ndarray | None = None) -> None:  # fmt: skip
        """``handle.stats`` of a step; ``before``/``after`` (modelled time per rank as sampled and
        as planned) are computed here unless given."""
        cost = self.cost
        if before is None:
            before = np.zeros(world)
            if isinstance(cost, CostModel):
                for r in range(world):
                    before[r] = cost.time(lengths[src == r]) if (src == r).any() else 0.0
        if after is None:
            after = np.zeros(world)
            for g in layout.schedule:
                t = float(g.time)
                for r in g.ranks:
                    after[r] = t
        self.stats = {
            "degrees": [int(g.degree) for g in layout.schedule],
            "largest_shard": int(layout.shard_tokens.max(initial=0)),
            "before": _ratio(before),
            "after": _ratio(after),
            "max_before": float(before.max(initial=0.0)),
            "mean_before": float(before.mean()) if world else 0.0,
            "max_after": float(after.max(initial=0.0)),
            "mean_after": float(after.mean()) if world else 0.0,
            "moved_tokens": int(plan.moved_tokens()),
            "plan_ms": 1e3 * layout.plan_s,
            "sequences": int(lengths.size),
            "num_items_in_batch": int(labelled.sum()),
        }

    def remove(self) -> None:
        """Detach from the model: later :meth:`shard` calls raise; the model's attention runs as
        without the handle (a shard's kwargs no longer reach it). Idempotent."""
        if self.removed:
            return
        self.removed = True
        if getattr(self.model, "_mmbalance_dynamic_cp", None) is self:
            del self.model._mmbalance_dynamic_cp

    def __repr__(self) -> str:
        return f"DynamicCPHandle(max_tokens_per_rank={self.max_tokens_per_rank}, removed={self.removed})"


def shard_of(layout: _Layout, lengths: np.ndarray, rank: int, groups: dict, tokens: int) -> CPShard | None:
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


def _ratio(load: np.ndarray) -> float:
    mean = float(load.mean()) if load.size else 0.0
    return float(load.max() / mean) if mean > 0 else 1.0


def _positions(lengths: np.ndarray) -> Tensor:
    if not lengths.size:
        return torch.zeros(0, dtype=torch.int64)
    starts = np.repeat(np.cumsum(lengths) - lengths, lengths)
    return torch.from_numpy(np.arange(int(lengths.sum()), dtype=np.int64) - starts)


def _text_config(model):
    config = getattr(model, "config", None)
    get = getattr(config, "get_text_config", None)
    return get() if callable(get) else config


def pad_id(model) -> int:
    pad = getattr(_text_config(model), "pad_token_id", None)
    return int(pad) if isinstance(pad, int) and pad >= 0 else 0


def _model_device(model) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def _kwargs(out: Tensor, shard: CPShard, items: int, has_labels: bool, device) -> dict:
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


def apply_dynamic_cp(model, *, max_tokens_per_rank: int, cost="quadratic", group=None,
                     encoder_cost="auto") -> DynamicCPHandle:  # fmt: skip
    """Dynamic context parallelism of any degree for ``model``'s language model; returns the handle.

    Args:
        model: a transformers model that uses ``attn_implementation="mmbalance_varlen"``
            (``register_attention()``, then ``from_config(..., attn_implementation=...)`` or
            ``model.set_attn_implementation("mmbalance_varlen")``). The plain text decoders
            (Llama, Qwen2, Qwen3, Mistral, ...) are supported, and the vision-language models
            Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3-VL-MoE and LLaVA (``...ForConditionalGeneration``;
            :mod:`.dynamic_cp_vlm`: M-RoPE positions from the whole sequence, every image and
            frame encoded once, feature rows sent straight to the shards of their placeholders).
            Any other multimodal model is refused by name. What the ring cannot run (sliding
            windows, softcap, sinks, chunked attention, block masks, padding masks) raises
            ``NotImplementedError`` at the first forward.
        max_tokens_per_rank: tokens one rank may hold in a forward (its LLM-phase activations;
            for a vision-language model the vision tokens count).
        cost: the planner's cost of a group of sequences on ``d`` ranks: ``"quadratic"`` (a dense
            transformer of the model's shape: linear layers, causal attention, ring exchange),
            ``"linear"``, a :class:`~mmbalance.balancing.CostModel`, or a callable as
            :func:`~mmbalance.balancing.cp_schedule` takes it.
        group: the data-parallel group the ranks balance over (default: the world). Every rank
            of the world calls :meth:`~DynamicCPHandle.shard` at each step (the CP groups are
            ``new_group``s, collective over the world). Without ``torch.distributed`` the handle
            runs one process (every sequence whole).
        encoder_cost: vision-language models only: the encoder phase in the plan's cost.
            ``"auto"``: the encoder's FLOPs (the adapters' model: linear layers plus attention
            within every image or frame, forward + backward) at the LLM cost's rate per FLOP
            (``cost.linear / (6 * LLM parameters)``); a callable ``encoder_cost(encoder, meta,
            rows) -> seconds`` per item (as ``apply_encoder_balance``'s ``cost`` takes it); or
            ``None``: the language model alone. Without encoder balancing, where each CP group
            encodes its own media, the planner prices sequence ``s`` on a group of ``d`` ranks
            at ``linear*l/d + max(attention*(1+eta)*l**2/d, ring*l*(d-1)/d + ring_latency*(d-1))
            + E_s/d`` (``E_s``: the encoder seconds of its media, spread over the members) and a
            group at the sum over its sequences. With :func:`~.balance.apply_encoder_balance` on
            the same model the encoders are balanced over the whole world, the same for every
            schedule, so the groups are priced by ``cost`` alone.

    The handle creates process groups of its own (one over ``group``'s ranks, plus one per CP
    rank set that the schedules use, created once and reused: :class:`GroupPool`), so its
    all-to-alls and rings never interleave with DDP's or FSDP's collectives.

    Raises:
        ValueError: a model not using ``mmbalance_varlen``, a multimodal model the sharding does
            not support (the message lists those it does), a bad ``max_tokens_per_rank``,
            ``cost`` or ``encoder_cost`` (a callable ``cost`` for a vision-language model needs
            ``encoder_cost=None``), the handle applied twice.
        TypeError: ``model`` is not a ``torch.nn.Module``.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if isinstance(max_tokens_per_rank, bool) or not isinstance(max_tokens_per_rank, numbers.Integral):
        raise TypeError(f"max_tokens_per_rank must be an int, got {type(max_tokens_per_rank).__name__}")
    if max_tokens_per_rank < 1:
        raise ValueError(f"max_tokens_per_rank must be >= 1, got {max_tokens_per_rank}")
    from .dynamic_cp_vlm import vlm_family

    vlm_family(model)  # an unsupported multimodal model is refused by name before anything else
    config = getattr(model, "config", None)
    impl = getattr(config, "_attn_implementation", None)
    if impl != ATTENTION_NAME:
        raise ValueError(
            f"model: apply_dynamic_cp needs attn_implementation={ATTENTION_NAME!r} (the attention that runs the "
            f"ring), the model uses {impl!r}: call register_attention() and "
            f"model.set_attn_implementation({ATTENTION_NAME!r})"
        )
    if getattr(model, "_mmbalance_dynamic_cp", None) is not None:
        raise ValueError("model: apply_dynamic_cp was already applied to this model (handle.remove() first)")
    if not (encoder_cost is None or encoder_cost == "auto" or callable(encoder_cost)):
        raise ValueError(f"encoder_cost must be 'auto', None or a callable, got {encoder_cost!r}")
    return make_handle(model, int(max_tokens_per_rank), cost, group, True, encoder_cost)


def make_handle(model, budget: int | None, cost, group, context_parallel: bool,
                encoder_cost="auto") -> DynamicCPHandle:  # fmt: skip
    """The handle behind :func:`apply_dynamic_cp` (``context_parallel=False``: degree 1
    everywhere, the streamed post-balancing of ``balance_trainer``; ``budget`` may be ``None``)."""
    from .dynamic_cp_vlm import vlm_family

    family = vlm_family(model)
    costm = cost_model_of(model, cost)
    if family is not None and encoder_cost is not None and not isinstance(costm, CostModel):
        raise ValueError(
            "cost: a callable cost cannot take the encoder phase of a vision-language model into account; "
            "pass a CostModel (or 'quadratic'), or encoder_cost=None to plan the language model alone"
        )
    own = pool = None
    if dist.is_available() and dist.is_initialized():
        world_of(group)
        base = dist.group.WORLD if group is None else group
        own = own_group(base)
        pool = GroupPool()
        mark_distributed_run()
        with Entry("apply_dynamic_cp", own) as e:
            e.fields = {
                "max_tokens_per_rank": budget,
                "cost": _cost_key(costm),
                "model": type(model).__name__,
                "context_parallel": context_parallel,
                "encoder_cost": encoder_cost if not callable(encoder_cost) else "callable",
            }
        e.agree()
    handle = DynamicCPHandle(model, budget, costm, group, own, pool, context_parallel, family, encoder_cost)
    model._mmbalance_dynamic_cp = handle
    return handle
