"""Encoder adapters and their registry: what mmbalance needs to know to balance one encoder of a
model class, and which adapters exist.

An encoder's inputs in one forward are a set of independent *items* (an image or video for a
natural-resolution ViT, a tile for a fixed-resolution one, an audio clip): each item is encoded
without looking at the others, so items can be encoded on any rank and the outputs sent back.
An adapter says, for one model class and one encoder,

* :meth:`~EncoderAdapter.extract`: which items this forward holds (taken out of the forward's
  keyword arguments), as packed payload tensors (rows per item) plus per-item integer metadata;
* :meth:`~EncoderAdapter.cost`: what each item costs to encode (from the metadata, the same on
  every rank), which the planner balances;
* :meth:`~EncoderAdapter.encode`: how to run the encoder once on any set of items (metadata and
  payloads of items from any ranks) and return the outputs packed per item;
* :meth:`~EncoderAdapter.restore`: how to put the outputs of this forward's own items, back in
  their original order, into the forward's keyword arguments, so the rest of the model runs
  exactly as if it had encoded them itself.

Three optional parts:

* :attr:`~EncoderAdapter.splits_frames`: the encoder attends within each temporal frame only, so
  ``extract`` gives one item per frame of a video and ``restore`` reassembles them (exact): one
  long video no longer bounds the step;
* :meth:`~EncoderAdapter.call_options`: per-call keyword arguments that change the encoder's output
  (``vision_feature_layer`` ...): every rank must pass the same ones, and ``encode`` gets them;
* :meth:`~EncoderAdapter.refusal`: why the installed release cannot balance this encoder.

Register a new adapter with :func:`register_adapter` (or pass adapters to
``apply_encoder_balance(..., adapters=[...])``); nothing in mmbalance needs to change. The built-in
adapters are in ``models/``, one file per model family.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

__all__ = [
    "EncoderAdapter",
    "Items",
    "adapters_for",
    "flops_linear",
    "packed_rows",
    "register_adapter",
    "registered_adapters",
    "supported_classes",
]


@dataclasses.dataclass
class Items:
    """The items of one encoder in one forward on one rank.

    Attributes:
        payload: tensors ``[rows, *]`` holding the items back to back (item ``i`` is rows
            ``rows[:i].sum() .. rows[:i+1].sum()`` of each); every rank uses the same dtypes and
            trailing shapes (see :meth:`EncoderAdapter.empty_payload`).
        rows: int64 ``[n]``: rows of each item in the payload.
        meta: int64 ``[n, k]``: what another rank needs to encode item ``i`` (grid sizes, valid
            lengths, a modality tag ...) and what the planner prices; ``k`` is fixed per adapter.
        context: anything :meth:`EncoderAdapter.restore` needs later on this rank (not sent).
    """

    payload: list[Tensor]
    rows: np.ndarray
    meta: np.ndarray
    context: dict = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        self.rows = np.ascontiguousarray(self.rows, dtype=np.int64).reshape(-1)
        self.meta = np.ascontiguousarray(self.meta, dtype=np.int64).reshape(self.rows.size, -1)

    def __len__(self) -> int:
        return int(self.rows.size)


class EncoderAdapter:
    """Base class of encoder adapters (see the module docstring). Subclasses set :attr:`encoder`,
    :attr:`meta_columns` and :attr:`model_classes` and implement the methods that raise here.
    """

    #: key of this encoder in ``handle.stats`` (``"vision"``, ``"audio"``, ...)
    encoder: str = "vision"
    #: names of the metadata columns (their count must match ``Items.meta.shape[1]``)
    meta_columns: tuple[str, ...] = ()
    #: class names (``type(model).__name__``) this adapter handles
    model_classes: tuple[str, ...] = ()
    #: ``True`` for encoders that attend within each temporal frame only: ``extract`` then gives
    #: one item per frame of a video and ``restore`` puts each video's frames back together, which
    #: is exact. ``apply_encoder_balance(..., split_frames=False)`` sets it to ``False`` on the
    #: adapter instance (whole videos as items).
    splits_frames: bool = False

    # ------------------------------------------------------------------ required
    def extract(self, model, kwargs: dict) -> Items | None:
        """Take this encoder's inputs out of ``kwargs`` (in place) and return them as items, or
        ``None`` if this forward has none (a text-only batch). Inputs of a modality the caller
        already encoded (e.g. ``mm_encoder_outputs`` given) must be left alone (return ``None``)."""
        raise NotImplementedError

    def empty_payload(self, model) -> list[Tensor]:
        """Zero-row payload tensors with the dtypes and trailing shapes every rank uses."""
        raise NotImplementedError

    def encode(self, model, payload: list[Tensor], meta: np.ndarray) -> list[Tensor]:
        """Encode the items described by ``meta`` (``[m, k]``, ``m >= 1``) whose inputs are
        ``payload``; return the outputs packed per item, rows per item as :meth:`out_rows`.
        Runs the encoder exactly once (per-forward hooks of FSDP and DDP count the calls)."""
        raise NotImplementedError

    def out_rows(self, model, meta: np.ndarray) -> np.ndarray:
        """Output rows of each item, from its metadata (no encoding)."""
        raise NotImplementedError

    def dummy(self, model) -> tuple[list[Tensor], np.ndarray]:
        """``(payload, meta)`` of one tiny item: encoded by a rank whose share is empty, so every
        rank runs the encoder once (FSDP and DDP need the same calls on every rank; no encoder
        here accepts zero items)."""
        raise NotImplementedError

    def restore(self, model, kwargs: dict, items: Items, outputs: list[Tensor]) -> dict:
        """Put ``outputs`` (this rank's items, in their original order, packed per item) into
        ``kwargs`` where the model expects its encoder's results; return the new kwargs."""
        raise NotImplementedError

    # ------------------------------------------------------------------ optional
    def call_options(self, model, kwargs: dict) -> dict:
        """Keyword arguments of this forward that change what the encoder returns (e.g. LLaVA's
        ``vision_feature_layer``), taken from ``kwargs``; ``{}`` when there are none. Items of
        every rank are encoded together, so every rank must pass the same options (the handle
        checks it); ``encode`` then receives them as keyword arguments. Raise ``ValueError``
        naming an option the adapter cannot honour."""
        return {}

    def cost(self, model, meta: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """Relative cost of encoding each item (float64 ``[n]``); default: its input rows."""
        return rows.astype(np.float64)

    def refusal(self, model) -> str | None:
        """Why the installed release's ``model`` cannot have this encoder balanced (its own encoder
        would run the items of several ranks differently than it runs them apart), or ``None``.
        ``apply_encoder_balance`` and ``apply_dynamic_cp`` raise it by name on every rank."""
        return None

    def matches(self, model) -> bool:
        return any(c.__name__ in self.model_classes for c in type(model).__mro__)


def packed_rows(t: Tensor, rows: np.ndarray) -> list[Tensor]:
    """Split ``t`` into items of ``rows`` rows."""
    return list(torch.split(t, [int(r) for r in rows]))


def flops_linear(hidden: int, ffn: int) -> float:
    """Multiply-add FLOPs per token of a transformer layer's linear parts (qkv, out, two MLP GEMMs)."""
    return 2.0 * (4 * hidden * hidden + 2 * hidden * ffn)


def as_meta(rows: Sequence[Sequence[int]], columns: int) -> np.ndarray:
    return np.asarray(rows, dtype=np.int64).reshape(-1, columns)


# ---------------------------------------------------------------------------------- the registry
_REGISTRY: list[type[EncoderAdapter]] = []
_LOCK = threading.Lock()


def register_adapter(adapter: type[EncoderAdapter]) -> type[EncoderAdapter]:
    """Register an :class:`EncoderAdapter` subclass (usable as a class decorator). Later
    registrations win over earlier ones for the same model class and encoder."""
    if not (isinstance(adapter, type) and issubclass(adapter, EncoderAdapter)):
        raise TypeError(f"adapter must be an EncoderAdapter subclass, got {adapter!r}")
    with _LOCK:
        _REGISTRY.insert(0, adapter)
    return adapter


def registered_adapters() -> list[type[EncoderAdapter]]:
    """Every registered adapter class, the most recent first (the built-ins are registered when
    :mod:`mmbalance.integrations.hf` is imported)."""
    with _LOCK:
        return list(_REGISTRY)


def adapters_for(model) -> list[EncoderAdapter]:
    """One adapter instance per encoder of ``model``: for each encoder, the most recently
    registered adapter that matches the model's class."""
    chosen, seen = [], set()
    for cls in registered_adapters():
        a = cls()
        if a.matches(model) and a.encoder not in seen:
            seen.add(a.encoder)
            chosen.append(a)
    return chosen


def supported_classes() -> list[str]:
    """The model class names some registered adapter handles."""
    return sorted({c for a in registered_adapters() for c in a.model_classes})
