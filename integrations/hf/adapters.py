"""Built-in encoder adapters (transformers >= 5.18: the ``mm_encoder_outputs`` hook).

=====================================  ========  =============================  ==========================
model class                            encoder   item                           cost ("auto")
=====================================  ========  =============================  ==========================
Qwen2-VL, Qwen2.5-VL, Qwen3-VL         vision    an image or a video            linear in its patches plus
(and the Qwen2.5-Omni thinker's ViT)             (``*_grid_thw`` row)           attention per frame
                                                                                (windowed in Qwen2.5)
LLaVA (1.5)                            vision    an image (one tile)            one per tile
LLaVA-NeXT                             vision    a tile (``image_sizes``:       one per tile
                                                 base tile + grid tiles)
InternVL                               vision    a tile                         one per tile
Qwen2-Audio                            audio     a clip (always 30 s)           one per clip
Qwen2.5-Omni thinker                   audio     a clip (its valid frames)      linear in its frames
=====================================  ========  =============================  ==========================

Encoder outputs go back through the models' public hooks: ``mm_encoder_outputs`` for images and
videos (the model then skips its encoder and scatters the given features), the input embeddings
for audio towers (which have no such hook). Everything after the encoder (LLaVA-NeXT's tile
packing, M-RoPE positions, the language model) runs on the item's own rank, unchanged.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from .adapter import EncoderAdapter, Items, flops_linear, packed_rows
from .balance import register_adapter

_TOWERS = ("visual", "vision_tower", "audio_tower")


def _core(model):
    """The module holding the towers and ``get_*_features``: the inner ``...Model``
    (``model.model``) where it has them, else the model itself (the Qwen2.5-Omni thinker before
    transformers 5.21 keeps its towers on itself; its ``model`` is the text model)."""
    inner = getattr(model, "model", None)
    if isinstance(inner, torch.nn.Module) and any(t in inner._modules for t in _TOWERS):
        return inner
    return model


def _mm(kwargs: dict) -> dict:
    mm = kwargs.get("mm_encoder_outputs")
    return dict(mm) if mm else {}


def _pooled(features, deepstack=None):
    from transformers.modeling_outputs import BaseModelOutputWithPooling

    if deepstack is None:
        return BaseModelOutputWithPooling(pooler_output=features)
    from transformers.models.qwen3_vl.modeling_qwen3_vl import BaseModelOutputWithDeepstackFeatures

    return BaseModelOutputWithDeepstackFeatures(pooler_output=features, deepstack_features=deepstack)


def _int(value) -> int:
    return int(value[0] if isinstance(value, (list, tuple)) else value)


# ---------------------------------------------------------------------------------- Qwen ViTs
@register_adapter
class QwenVisionAdapter(EncoderAdapter):
    """Natural-resolution Qwen ViTs: one item per image or video (a ``*_grid_thw`` row of ``t x h
    x w`` patches, ``t*h*w`` rows of ``pixel_values``); each attends only to itself (per frame), and
    returns ``t*h*w / merge**2`` rows (and as many per deepstack layer in Qwen3-VL). Images and
    videos of all ranks are encoded together in one call of the tower."""

    encoder = "vision"
    meta_columns = ("video", "t", "h", "w")
    model_classes = (
        "Qwen2VLForConditionalGeneration",
        "Qwen2VLModel",
        "Qwen2_5_VLForConditionalGeneration",
        "Qwen2_5_VLModel",
        "Qwen3VLForConditionalGeneration",
        "Qwen3VLModel",
        "Qwen2_5OmniThinkerForConditionalGeneration",
    )
    _SOURCES = (
        ("image", "pixel_values", "image_grid_thw"),
        ("video", "pixel_values_videos", "video_grid_thw"),
    )

    def _visual(self, model):
        return _core(model).visual

    def _row(self, model) -> int:
        return self._visual(model).patch_embed.proj.weight[0].numel()

    def _merge(self, model) -> int:
        return int(self._visual(model).spatial_merge_size)

    def extract(self, model, kwargs):
        mm = _mm(kwargs)
        visual = self._visual(model)
        parts, metas, kinds = [], [], []
        for kind, (name, pix_key, grid_key) in enumerate(self._SOURCES):
            pix = kwargs.get(pix_key)
            if pix is None or mm.get(name) is not None:
                continue
            grid = kwargs.get(grid_key)
            if grid is None:
                raise ValueError(f"{pix_key} is given without {grid_key}")
            grid = torch.as_tensor(grid).reshape(-1, 3)
            rows = grid.prod(-1)
            if int(rows.sum()) != pix.shape[0]:
                raise ValueError(
                    f"{grid_key} describes {int(rows.sum())} patches but {pix_key} has {pix.shape[0]} rows"
                )
            parts.append(pix.reshape(pix.shape[0], -1).type(visual.dtype))
            metas.append(np.concatenate([np.full((grid.shape[0], 1), kind), grid.cpu().numpy()], axis=1))
            kinds.append(name)
            kwargs[pix_key] = None
        if not parts:
            return None
        meta = np.concatenate(metas)
        return Items([torch.cat(parts)], meta[:, 1:].prod(1), meta, {"kinds": kinds})

    def empty_payload(self, model):
        visual = self._visual(model)
        return [
            torch.empty(0, self._row(model), dtype=visual.dtype, device=visual.patch_embed.proj.weight.device)
        ]

    def encode(self, model, payload, meta):
        grid = torch.as_tensor(meta[:, 1:4], dtype=torch.long, device=payload[0].device)
        out = _core(model).get_image_features(payload[0], grid, return_dict=True)
        outs = [torch.cat(list(out.pooler_output))]
        for layer in getattr(out, "deepstack_features", None) or []:
            outs.append(torch.cat(list(layer)))
        return outs

    def out_rows(self, model, meta):
        return meta[:, 1:4].prod(1) // self._merge(model) ** 2

    def dummy(self, model):
        m = self._merge(model)
        visual = self._visual(model)
        x = torch.zeros(
            m * m, self._row(model), dtype=visual.dtype, device=visual.patch_embed.proj.weight.device
        )
        return [x], np.array([[0, 1, m, m]], dtype=np.int64)

    def restore(self, model, kwargs, items, outputs):
        per_item = self.out_rows(model, items.meta)
        feats = packed_rows(outputs[0], per_item)
        deep = [packed_rows(t, per_item) for t in outputs[1:]]
        mm = _mm(kwargs)
        for kind, name in enumerate(("image", "video")):
            sel = np.flatnonzero(items.meta[:, 0] == kind)
            if sel.size == 0:
                continue
            pooled = tuple(feats[i] for i in sel)
            layers = [tuple(layer[i] for i in sel) for layer in deep] if deep else None
            mm[name] = _pooled(pooled, layers)
        kwargs["mm_encoder_outputs"] = mm
        return kwargs

    def cost(self, model, meta, rows):
        cfg = self._visual(model).config
        depth = int(cfg.depth)
        hidden = int(getattr(cfg, "embed_dim", None) or cfg.hidden_size)
        ffn = int(getattr(cfg, "intermediate_size", 0) or hidden * getattr(cfg, "mlp_ratio", 4))
        frame = (meta[:, 2] * meta[:, 3]).astype(np.float64)  # patches per frame
        t = meta[:, 1].astype(np.float64)
        full = depth
        window = frame
        if getattr(cfg, "window_size", None) and getattr(cfg, "fullatt_block_indexes", None) is not None:
            full = len(cfg.fullatt_block_indexes)  # Qwen2.5: windowed attention in the other layers
            side = int(cfg.window_size) // _int(cfg.patch_size)
            window = np.minimum(frame, float(side * side))
        attention = 4.0 * hidden * t * frame * (full * frame + (depth - full) * window)
        return depth * flops_linear(hidden, ffn) * t * frame + attention


# ---------------------------------------------------------------------------------- tile ViTs
class _TileAdapter(EncoderAdapter):
    """Fixed-resolution towers: one item per tile (a row of ``pixel_values [tiles, C, S, S]``),
    all of equal cost."""

    encoder = "vision"
    meta_columns = ("tile",)

    def _tower(self, model):
        return _core(model).vision_tower

    def _tile_shape(self, model) -> tuple[int, int, int]:
        cfg = self._tower(model).config
        size = _int(cfg.image_size)
        return int(getattr(cfg, "num_channels", 3)), size, size

    def _dtype_device(self, model):
        p = next(self._tower(model).parameters())
        return p.dtype, p.device

    def empty_payload(self, model):
        dtype, device = self._dtype_device(model)
        return [torch.empty(0, *self._tile_shape(model), dtype=dtype, device=device)]

    def dummy(self, model):
        dtype, device = self._dtype_device(model)
        return [torch.zeros(1, *self._tile_shape(model), dtype=dtype, device=device)], np.zeros(
            (1, 1), dtype=np.int64
        )

    def cost(self, model, meta, rows):
        return np.ones(rows.size)

    def _tiles(self, model, kwargs, tiles: Tensor, context: dict | None = None) -> Items:
        dtype, _ = self._dtype_device(model)
        kwargs["pixel_values"] = None
        n = tiles.shape[0]
        return Items(
            [tiles.to(dtype)], np.ones(n, dtype=np.int64), np.zeros((n, 1), dtype=np.int64), context or {}
        )

    def _selected(self, model, tiles: Tensor) -> Tensor:
        """The configured hidden state(s) of the tower, CLS dropped for the "default" strategy."""
        cfg = model.config
        layer, strategy = cfg.vision_feature_layer, cfg.vision_feature_select_strategy
        hs = self._tower(model)(tiles, output_hidden_states=True, return_dict=True).hidden_states
        if isinstance(layer, int):
            feat = hs[layer]
            return feat[:, 1:] if strategy == "default" else feat
        pool = [hs[k][:, 1:] if strategy == "default" else hs[k] for k in layer]
        return torch.cat(pool, dim=-1)

    def _tokens_per_tile(self, model) -> int:
        cfg = self._tower(model).config
        side = _int(cfg.image_size) // _int(cfg.patch_size)
        return side * side + (0 if model.config.vision_feature_select_strategy == "default" else 1)

    def out_rows(self, model, meta):
        return np.full(meta.shape[0], self._tokens_per_tile(model), dtype=np.int64)


@register_adapter
class LlavaAdapter(_TileAdapter):
    model_classes = ("LlavaForConditionalGeneration", "LlavaModel")

    def extract(self, model, kwargs):
        pix = kwargs.get("pixel_values")
        if pix is None or _mm(kwargs).get("image") is not None:
            return None
        if kwargs.get("image_sizes") is not None:
            raise ValueError("image_sizes (variable-resolution backbones such as Pixtral) are not supported")
        if pix.dim() != 4:
            raise ValueError(f"pixel_values must be [images, C, H, W], got shape {tuple(pix.shape)}")
        return self._tiles(model, kwargs, pix)

    def encode(self, model, payload, meta):
        feats = _core(model).multi_modal_projector(self._selected(model, payload[0]))
        return [feats.reshape(-1, feats.shape[-1])]

    def restore(self, model, kwargs, items, outputs):
        mm = _mm(kwargs)
        mm["image"] = _pooled(packed_rows(outputs[0], self.out_rows(model, items.meta)))
        kwargs["mm_encoder_outputs"] = mm
        return kwargs


@register_adapter
class LlavaNextAdapter(_TileAdapter):
    """Items are the real tiles of every image (the base tile and the grid tiles that
    ``image_sizes`` implies; padding tiles are dropped before anything moves). The tower, feature
    selection and projector run per tile anywhere; unpadding and the newline tokens (which need
    ``image_sizes``) run on the image's own rank."""

    model_classes = ("LlavaNextForConditionalGeneration", "LlavaNextModel")

    def extract(self, model, kwargs):
        pix = kwargs.get("pixel_values")
        if pix is None or _mm(kwargs).get("image") is not None:
            return None
        sizes = kwargs.get("image_sizes")
        if sizes is None:
            raise ValueError("pixel_values is given without image_sizes")
        from transformers.models.llava_next.modeling_llava_next import image_size_to_num_patches

        cfg = model.config
        ntiles = [
            image_size_to_num_patches(
                image_size=s, grid_pinpoints=cfg.image_grid_pinpoints, patch_size=cfg.vision_config.image_size
            )  # fmt: skip
            for s in torch.as_tensor(sizes).tolist()
        ]
        if pix.dim() == 5:
            tiles = torch.cat([p[:n] for p, n in zip(pix, ntiles)])
        elif pix.dim() == 4 and pix.shape[0] == sum(ntiles):
            tiles = pix
        else:
            raise ValueError(
                f"pixel_values of shape {tuple(pix.shape)} does not match image_sizes ({sum(ntiles)} tiles)"
            )
        return self._tiles(model, kwargs, tiles, {"ntiles": ntiles, "image_sizes": sizes})

    def encode(self, model, payload, meta):
        feats = _core(model).multi_modal_projector(self._selected(model, payload[0]))
        return [feats.reshape(-1, feats.shape[-1])]

    def restore(self, model, kwargs, items, outputs):
        core = _core(model)
        per_tile = self._tokens_per_tile(model)
        feats = outputs[0].reshape(len(items), per_tile, outputs[0].shape[-1])
        packed, _ = core.pack_image_features(
            torch.split(feats, items.context["ntiles"]),
            items.context["image_sizes"],
            vision_feature_select_strategy=model.config.vision_feature_select_strategy,
            image_newline=core.image_newline,
        )
        mm = _mm(kwargs)
        mm["image"] = _pooled(packed)
        kwargs["mm_encoder_outputs"] = mm
        return kwargs


@register_adapter
class InternVLAdapter(_TileAdapter):
    model_classes = ("InternVLForConditionalGeneration", "InternVLModel")

    def extract(self, model, kwargs):
        pix = kwargs.get("pixel_values")
        if pix is None or _mm(kwargs).get("image") is not None:
            return None
        if pix.dim() != 4:
            raise ValueError(f"pixel_values must be [tiles, C, H, W], got shape {tuple(pix.shape)}")
        return self._tiles(model, kwargs, pix)

    def _tokens_per_tile(self, model) -> int:
        cfg = self._tower(model).config
        side = _int(cfg.image_size) // _int(cfg.patch_size)
        return int(round(side * model.config.downsample_ratio) ** 2)

    def encode(self, model, payload, meta):
        feats = _core(model).get_image_features(pixel_values=payload[0], return_dict=True).pooler_output
        return [feats.reshape(-1, feats.shape[-1])]

    def restore(self, model, kwargs, items, outputs):
        mm = _mm(kwargs)
        per_tile = self._tokens_per_tile(model)
        mm["image"] = _pooled(outputs[0].reshape(len(items), per_tile, outputs[0].shape[-1]))
        kwargs["mm_encoder_outputs"] = mm
        return kwargs


# ---------------------------------------------------------------------------------- audio towers
def _audio_out_len(frames: np.ndarray) -> np.ndarray:
    """Encoder outputs of a clip with ``frames`` valid mel frames (stride-2 conv, then stride-2 pooling)."""
    after_conv = (frames - 1) // 2 + 1
    return (after_conv - 2) // 2 + 1


def _scatter_audio(model, kwargs: dict, features: Tensor, token_id: int, keep_ids: bool) -> dict:
    ids = kwargs.get("input_ids")
    if ids is None:
        raise ValueError("audio balancing needs input_ids (its placeholder tokens locate the clips)")
    embeds = model.get_input_embeddings()(ids)
    mask = ids == token_id
    if int(mask.sum()) != features.shape[0]:
        raise ValueError(
            f"input_ids holds {int(mask.sum())} audio tokens but the clips give {features.shape[0]} features "
            "(expand the audio placeholders with the processor)"
        )
    kwargs["inputs_embeds"] = embeds.masked_scatter(mask.unsqueeze(-1), features.to(embeds.dtype))
    if not keep_ids:
        kwargs["input_ids"] = None
    return kwargs


@register_adapter
class Qwen2AudioAdapter(EncoderAdapter):
    """Qwen2-Audio's Whisper tower: one item per clip (every clip is padded to the fixed 30 s
    input, so every clip costs the same); the clip's valid frames travel as metadata."""

    encoder = "audio"
    meta_columns = ("frames",)
    model_classes = ("Qwen2AudioForConditionalGeneration",)

    def _tower(self, model):
        return _core(model).audio_tower

    def _shape(self, model) -> tuple[int, int]:
        cfg = self._tower(model).config
        return int(cfg.num_mel_bins), 2 * int(cfg.max_source_positions)

    def _dtype_device(self, model):
        p = self._tower(model).conv1.weight
        return p.dtype, p.device

    def extract(self, model, kwargs):
        feats = kwargs.get("input_features")
        if feats is None or kwargs.get("inputs_embeds") is not None:
            return None
        mask = kwargs.get("feature_attention_mask")
        if mask is None:
            raise ValueError("input_features is given without feature_attention_mask")
        frames = torch.as_tensor(mask).sum(-1).cpu().numpy().astype(np.int64)
        dtype, _ = self._dtype_device(model)
        kwargs["input_features"] = None
        kwargs["feature_attention_mask"] = None
        n = feats.shape[0]
        return Items([feats.to(dtype)], np.ones(n, dtype=np.int64), frames[:, None])

    def empty_payload(self, model):
        dtype, device = self._dtype_device(model)
        return [torch.empty(0, *self._shape(model), dtype=dtype, device=device)]

    def dummy(self, model):
        dtype, device = self._dtype_device(model)
        mel, frames = self._shape(model)
        return [torch.zeros(1, mel, frames, dtype=dtype, device=device)], np.array([[frames]], dtype=np.int64)

    def out_rows(self, model, meta):
        return _audio_out_len(meta[:, 0])

    def cost(self, model, meta, rows):
        return np.ones(rows.size)

    def encode(self, model, payload, meta):
        from transformers.masking_utils import create_bidirectional_mask

        core, feats = _core(model), payload[0]
        tower = self._tower(model)
        lengths = torch.as_tensor(meta[:, 0], device=feats.device)
        after_conv, out_len = tower._get_feat_extract_output_lengths(lengths)
        steps = (feats.shape[-1] - 2) // 2 + 1
        mask2d = (torch.arange(steps, device=feats.device)[None] < after_conv[:, None]).long()
        dummy_embeds = torch.zeros(feats.shape[0], steps, 1, dtype=feats.dtype, device=feats.device)
        mask = create_bidirectional_mask(
            config=tower.config, inputs_embeds=dummy_embeds, attention_mask=mask2d
        )
        hidden = core.multi_modal_projector(tower(feats, attention_mask=mask).last_hidden_state)
        return [torch.cat([hidden[i, : int(n)] for i, n in enumerate(out_len.tolist())])]

    def restore(self, model, kwargs, items, outputs):
        return _scatter_audio(model, kwargs, outputs[0], model.config.audio_token_id, keep_ids=False)


@register_adapter
class QwenOmniAudioAdapter(EncoderAdapter):
    """The Qwen2.5-Omni thinker's audio tower: one item per clip, only its valid frames travel
    (attention runs in fixed windows, so a clip costs in proportion to its frames)."""

    encoder = "audio"
    meta_columns = ("frames",)
    model_classes = ("Qwen2_5OmniThinkerForConditionalGeneration",)

    def _tower(self, model):
        return _core(model).audio_tower

    def _dtype_device(self, model):
        p = self._tower(model).conv1.weight
        return p.dtype, p.device

    def _mel(self, model) -> int:
        return int(self._tower(model).config.num_mel_bins)

    def extract(self, model, kwargs):
        feats = kwargs.get("input_features")
        if feats is None or kwargs.get("inputs_embeds") is not None:
            return None
        mask = kwargs.get("feature_attention_mask")
        if mask is None:
            raise ValueError("input_features is given without feature_attention_mask")
        frames = torch.as_tensor(mask).sum(-1).cpu().numpy().astype(np.int64)
        dtype, _ = self._dtype_device(model)
        # clips as rows of frames: [sum of valid frames, mel] (padding never travels)
        rows = (
            torch.cat([f[:, : int(n)].t() for f, n in zip(feats, frames)])
            if len(frames)
            else feats.new_zeros(0)
        )
        kwargs["input_features"] = None  # the mask stays: the thinker's rope positions use it
        return Items([rows.to(dtype)], frames, frames[:, None])

    def empty_payload(self, model):
        dtype, device = self._dtype_device(model)
        return [torch.empty(0, self._mel(model), dtype=dtype, device=device)]

    def dummy(self, model):
        dtype, device = self._dtype_device(model)
        return [torch.zeros(3, self._mel(model), dtype=dtype, device=device)], np.array([[3]], dtype=np.int64)

    def out_rows(self, model, meta):
        return _audio_out_len(meta[:, 0])

    def encode(self, model, payload, meta):
        frames = meta[:, 0]
        longest = int(frames.max())
        clips = torch.split(payload[0], frames.tolist())
        feats = payload[0].new_zeros(len(clips), self._mel(model), longest)
        mask = torch.zeros(len(clips), longest, dtype=torch.long, device=payload[0].device)
        for i, c in enumerate(clips):
            feats[i, :, : c.shape[0]] = c.t()
            mask[i, : c.shape[0]] = 1
        out = _core(model).get_audio_features(feats, mask, return_dict=True).last_hidden_state
        return [out]

    def restore(self, model, kwargs, items, outputs):
        return _scatter_audio(model, kwargs, outputs[0], model.config.audio_token_id, keep_ids=True)
