"""What the built-in adapters share: where a model keeps its towers (``core``: the compatibility
layer's :func:`~mmbalance.integrations.hf.compat.feature_owner`), the ``mm_encoder_outputs``
hook, the tile-tower and audio-tower base classes and the audio placeholder scatter."""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from ...compat import feature_owner as core
from ..adapter import EncoderAdapter, Items, flops_linear


def mm_outputs(kwargs: dict) -> dict:
    """A copy of the forward's ``mm_encoder_outputs`` dict (empty when none was given)."""
    mm = kwargs.get("mm_encoder_outputs")
    return dict(mm) if mm else {}


def pending_pixels(kwargs: dict, dims: int | None = None, layout: str = "") -> Tensor | None:
    """The forward's ``pixel_values`` when they are still to be encoded: ``None`` when there are
    none or the images' features are given already (``mm_encoder_outputs``). With ``dims``, a
    tensor of another rank is refused, naming the expected ``layout``."""
    pix = kwargs.get("pixel_values")
    if pix is None or mm_outputs(kwargs).get("image") is not None:
        return None
    if dims is not None and pix.dim() != dims:
        raise ValueError(f"pixel_values must be [{layout}], got shape {tuple(pix.shape)}")
    return pix


def pooled(features, deepstack=None):
    """Encoder outputs in the form ``mm_encoder_outputs`` takes them."""
    from transformers.modeling_outputs import BaseModelOutputWithPooling

    if deepstack is None:
        return BaseModelOutputWithPooling(pooler_output=features)
    from transformers.models.qwen3_vl.modeling_qwen3_vl import BaseModelOutputWithDeepstackFeatures

    return BaseModelOutputWithDeepstackFeatures(pooler_output=features, deepstack_features=deepstack)


def image_attention_flops(tower_config, patches: np.ndarray) -> np.ndarray:
    """Forward FLOPs of a ViT (``tower_config``'s sizes) on items of ``patches`` patches each, every
    item attending to itself only: linear in its patches plus the quadratic attention term."""
    cfg = tower_config
    hidden, ffn, depth = int(cfg.hidden_size), int(cfg.intermediate_size), int(cfg.num_hidden_layers)
    n = np.asarray(patches, dtype=np.float64)
    return depth * (flops_linear(hidden, ffn) * n + 4.0 * hidden * n * n)


def as_int(value) -> int:
    """A config size that may be an int or a pair (``image_size``, ``patch_size``)."""
    return int(value[0] if isinstance(value, (list, tuple)) else value)


def dtype_device(module) -> tuple[torch.dtype, torch.device]:
    """A module's parameter dtype and device, from metadata only: nothing is read or gathered, so it
    is safe on FSDP2-sharded towers on a rank that is not running them."""
    p = next(module.parameters())
    return p.dtype, p.device


def vision_feature_options(model, kwargs: dict) -> tuple:
    """This call's ``(vision_feature_layer, vision_feature_select_strategy)``: the forward's when
    given there, else the config's, as the models themselves read them."""
    cfg = model.config
    layer = kwargs.get("vision_feature_layer")
    strategy = kwargs.get("vision_feature_select_strategy")
    layer = cfg.vision_feature_layer if layer is None else layer
    strategy = cfg.vision_feature_select_strategy if strategy is None else strategy
    return layer, strategy


class TileAdapter(EncoderAdapter):
    """Fixed-resolution towers: one item per tile (a row of ``pixel_values [tiles, C, S, S]``),
    all of equal cost."""

    encoder = "vision"
    meta_columns: tuple[str, ...] = ("tile",)

    def _tower(self, model):
        return core(model).vision_tower

    def _tile_shape(self, model) -> tuple[int, int, int]:
        cfg = self._tower(model).config
        size = as_int(cfg.image_size)
        return int(getattr(cfg, "num_channels", 3)), size, size

    def empty_payload(self, model):
        dtype, device = dtype_device(self._tower(model))
        return [torch.empty(0, *self._tile_shape(model), dtype=dtype, device=device)]

    def dummy(self, model):
        dtype, device = dtype_device(self._tower(model))
        return [torch.zeros(1, *self._tile_shape(model), dtype=dtype, device=device)], np.zeros(
            (1, 1), dtype=np.int64
        )

    def cost(self, model, meta, rows):
        return np.ones(rows.size)

    def _tiles(self, model, kwargs, tiles: Tensor, context: dict | None = None) -> Items:
        dtype, _ = dtype_device(self._tower(model))
        kwargs["pixel_values"] = None
        n = tiles.shape[0]
        return Items(
            [tiles.to(dtype)], np.ones(n, dtype=np.int64), np.zeros((n, 1), dtype=np.int64), context or {}
        )


# ---------------------------------------------------------------------------------- audio towers
def audio_out_len(frames: np.ndarray) -> np.ndarray:
    """Encoder outputs of a clip with ``frames`` valid mel frames (stride-2 conv, then stride-2 pooling)."""
    after_conv = (frames - 1) // 2 + 1
    return (after_conv - 2) // 2 + 1


def embed_rows(model, ids: Tensor, embeds: Tensor | None, rows: Tensor, token_id: int, source: str,
               what: str, hint: str = "") -> Tensor:  # fmt: skip
    """The input embeddings (``embeds``, else the model's embedding of ``ids``) with ``rows`` at the
    ``token_id`` placeholders of ``ids``, in order; raises ValueError naming ``source`` when the
    counts differ (``hint`` ends the message)."""
    mask = ids == token_id
    if int(mask.sum()) != int(rows.shape[0]):
        raise ValueError(
            f"{source}: {int(rows.shape[0])} rows for the {int(mask.sum())} {what} placeholder tokens of "
            f"input_ids{hint}"
        )
    if embeds is None:
        embeds = model.get_input_embeddings()(ids)
    return embeds.masked_scatter(mask.unsqueeze(-1), rows.to(embeds.dtype))


def scatter_audio(model, kwargs: dict, features: Tensor, token_id: int, keep_ids: bool) -> dict:
    """Put audio features at their placeholder tokens of the input embeddings (audio towers have
    no ``mm_encoder_outputs`` hook)."""
    ids = kwargs.get("input_ids")
    if ids is None:
        raise ValueError("audio balancing needs input_ids (its placeholder tokens locate the clips)")
    kwargs["inputs_embeds"] = embed_rows(model, ids, None, features, token_id, "the audio clips' features", "audio",
                                         " (expand the audio placeholders with the processor)")  # fmt: skip
    if not keep_ids:
        kwargs["input_ids"] = None
    return kwargs


class AudioAdapter(EncoderAdapter):
    """Audio towers: one item per clip, the clip's valid mel frames as its metadata."""

    encoder = "audio"
    meta_columns = ("frames",)

    def _tower(self, model):
        return core(model).audio_tower

    def _dtype_device(self, model):
        return dtype_device(self._tower(model))

    def _clips(self, model, kwargs: dict) -> tuple[Tensor, np.ndarray] | None:
        """``(input_features in the tower's dtype, valid frames of each clip)`` of a forward that
        passes audio features; ``None`` when it passes none (or passes ``inputs_embeds`` instead).

        Raises:
            ValueError: ``input_features`` without ``feature_attention_mask``.
        """
        feats = kwargs.get("input_features")
        if feats is None or kwargs.get("inputs_embeds") is not None:
            return None
        mask = kwargs.get("feature_attention_mask")
        if mask is None:
            raise ValueError("input_features is given without feature_attention_mask")
        dtype, _ = self._dtype_device(model)
        return feats.to(dtype), torch.as_tensor(mask).sum(-1).cpu().numpy().astype(np.int64)

    def out_rows(self, model, meta):
        return audio_out_len(meta[:, 0])
