"""The inputs of a dynamic context-parallel step, read: a batch cut into its sequences
(:func:`split_sequences`), each token's position in its sequence, and the model facts every step
needs (its text config, pad token and device). No communication happens here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from ..attention import ATTENTION_NAME
from ..compat import language_model

__all__ = [
    "IGNORE", "Sequences", "check_attention", "ffn_size", "layer_mix", "linear_state", "model_device", "pad_id",
    "positions", "split_sequences", "text_config",
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


def positions(lengths: np.ndarray) -> Tensor:
    if not lengths.size:
        return torch.zeros(0, dtype=torch.int64)
    starts = np.repeat(np.cumsum(lengths) - lengths, lengths)
    return torch.from_numpy(np.arange(int(lengths.sum()), dtype=np.int64) - starts)


def text_config(model):
    config = getattr(model, "config", None)
    get = getattr(config, "get_text_config", None)
    return get() if callable(get) else config


def _attention_configs(model) -> list:
    """The configs the language model's attention layers read their implementation from (every
    config under the decoder; shared objects, so found once per model)."""
    cached = model.__dict__.get("_mmbalance_attention_configs")
    if cached is None:
        seen: dict[int, object] = {}
        for m in language_model(model).modules():
            cfg = getattr(m, "config", None)
            if cfg is not None and hasattr(cfg, "_attn_implementation"):
                seen.setdefault(id(cfg), cfg)
        seen.setdefault(id(text_config(model)), text_config(model))
        cached = model.__dict__["_mmbalance_attention_configs"] = list(seen.values())
    return cached


def check_attention(model) -> None:
    """Raise ValueError, naming what it found and the fix, when a layer of ``model``'s language
    model does not run ``mmbalance_varlen`` (switched after ``apply_dynamic_cp``, e.g.
    ``model.set_attn_implementation("sdpa")``): another attention ignores the shard, and the
    tokens of a sequence split over ranks would attend only within their own piece."""
    found = sorted({str(cfg._attn_implementation) for cfg in _attention_configs(model)} - {ATTENTION_NAME})
    if found:
        raise ValueError(
            f"model: its language model's attention runs {', '.join(map(repr, found))}, but dynamic context "
            f"parallelism runs in {ATTENTION_NAME!r} (another attention ignores the shard: a sequence split "
            f"over ranks would attend only within each rank's piece). Call "
            f"model.set_attn_implementation({ATTENTION_NAME!r}) to keep context parallelism, or handle.remove() "
            "first to train without it"
        )


def pad_id(model) -> int:
    pad = getattr(text_config(model), "pad_token_id", None)
    return int(pad) if isinstance(pad, int) and pad >= 0 else 0


def model_device(model) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def layer_mix(text) -> tuple[int, int]:
    """``(layers, attention_layers)`` of a text config: every decoder layer, and those whose
    ``layer_types`` entry is softmax attention (full, sliding or chunked); without ``layer_types``
    every layer is. The others (``linear_attention``: Gated DeltaNet, ...) cost linearly in length."""
    from ..mixers import ATTENTION_TYPES

    layers = int(getattr(text, "num_hidden_layers", 32) or 32)
    types = getattr(text, "layer_types", None)
    if not types:
        return layers, layers
    types = list(types)[:layers]
    return layers, sum(1 for t in types if str(t) in ATTENTION_TYPES) + max(layers - len(types), 0)


def linear_state(text) -> int:
    """Values of one linear-attention layer's recurrent state per token's update (heads x key dim
    x value dim, from Qwen3.5's and Qwen3-Next's ``linear_num_value_heads``,
    ``linear_key_head_dim``, ``linear_value_head_dim``); 0 where the config has none."""
    heads = getattr(text, "linear_num_value_heads", None)
    dk = getattr(text, "linear_key_head_dim", None)
    dv = getattr(text, "linear_value_head_dim", None)
    return int(heads) * int(dk) * int(dv) if heads and dk and dv else 0


def ffn_size(text) -> float | None:
    """The text config's feed-forward width, the mean over its layers where the config keeps one
    per layer (Gemma 3n's ``intermediate_size`` list); ``None`` where it has none."""
    ffn = getattr(text, "intermediate_size", None)
    if isinstance(ffn, (list, tuple)):
        sizes = [float(x) for x in ffn if x]
        return sum(sizes) / len(sizes) if sizes else None
    return float(ffn) if ffn else None
