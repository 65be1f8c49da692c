"""Qwen2-Audio: a Whisper tower over fixed 30 s inputs, one item per clip."""

from __future__ import annotations

import numpy as np
import torch

from ..adapter import Items, register_adapter
from .common import AudioAdapter, core, scatter_audio

__all__ = ["Qwen2AudioAdapter"]


@register_adapter
class Qwen2AudioAdapter(AudioAdapter):
    """Qwen2-Audio's Whisper tower: one item per clip (every clip is padded to the fixed 30 s
    input, so every clip costs the same); the clip's valid frames travel as metadata."""

    model_classes = ("Qwen2AudioForConditionalGeneration",)

    def _shape(self, model) -> tuple[int, int]:
        cfg = self._tower(model).config
        return int(cfg.num_mel_bins), 2 * int(cfg.max_source_positions)

    def extract(self, model, kwargs):
        found = self._clips(model, kwargs)
        if found is None:
            return None
        feats, frames = found
        kwargs["input_features"] = None
        kwargs["feature_attention_mask"] = None
        n = feats.shape[0]
        return Items([feats], np.ones(n, dtype=np.int64), frames[:, None])

    def empty_payload(self, model):
        dtype, device = self._dtype_device(model)
        return [torch.empty(0, *self._shape(model), dtype=dtype, device=device)]

    def dummy(self, model):
        dtype, device = self._dtype_device(model)
        mel, frames = self._shape(model)
        return [torch.zeros(1, mel, frames, dtype=dtype, device=device)], np.array([[frames]], dtype=np.int64)

    def cost(self, model, meta, rows):
        return np.ones(rows.size)

    def encode(self, model, payload, meta):
        from transformers.masking_utils import create_bidirectional_mask

        c, feats = core(model), payload[0]
        tower = self._tower(model)
        lengths = torch.as_tensor(meta[:, 0], device=feats.device)
        after_conv, out_len = tower._get_feat_extract_output_lengths(lengths)
        steps = (feats.shape[-1] - 2) // 2 + 1
        mask2d = (torch.arange(steps, device=feats.device)[None] < after_conv[:, None]).long()
        dummy_embeds = torch.zeros(feats.shape[0], steps, 1, dtype=feats.dtype, device=feats.device)
        mask = create_bidirectional_mask(
            config=tower.config, inputs_embeds=dummy_embeds, attention_mask=mask2d
        )
        hidden = c.multi_modal_projector(tower(feats, attention_mask=mask).last_hidden_state)
        return [torch.cat([hidden[i, : int(n)] for i, n in enumerate(out_len.tolist())])]

    def restore(self, model, kwargs, items, outputs):
        return scatter_audio(model, kwargs, outputs[0], model.config.audio_token_id, keep_ids=False)
