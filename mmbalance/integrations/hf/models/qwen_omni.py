"""The Qwen2.5-Omni thinker's audio tower: one item per clip, only its valid frames travel. (Its
vision tower is the Qwen ViT of ``qwen_vl.py``.)"""

from __future__ import annotations

import numpy as np
import torch

from ..encoder_adapter import EncoderAdapter, Items, register_adapter
from .common import audio_out_len, core, dtype_device, scatter_audio

__all__ = ["QwenOmniAudioAdapter"]


@register_adapter
class QwenOmniAudioAdapter(EncoderAdapter):
    """The Qwen2.5-Omni thinker's audio tower: one item per clip, only its valid frames travel
    (attention runs in fixed windows, so a clip costs in proportion to its frames)."""

    encoder = "audio"
    meta_columns = ("frames",)
    model_classes = ("Qwen2_5OmniThinkerForConditionalGeneration",)

    def _tower(self, model):
        return core(model).audio_tower

    def _dtype_device(self, model):
        return dtype_device(self._tower(model))

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
        return audio_out_len(meta[:, 0])

    def encode(self, model, payload, meta):
        frames = meta[:, 0]
        longest = int(frames.max())
        clips = torch.split(payload[0], frames.tolist())
        feats = payload[0].new_zeros(len(clips), self._mel(model), longest)
        mask = torch.zeros(len(clips), longest, dtype=torch.long, device=payload[0].device)
        for i, c in enumerate(clips):
            feats[i, :, : c.shape[0]] = c.t()
            mask[i, : c.shape[0]] = 1
        out = core(model).get_audio_features(feats, mask, return_dict=True).last_hidden_state
        return [out]

    def restore(self, model, kwargs, items, outputs):
        return scatter_audio(model, kwargs, outputs[0], model.config.audio_token_id, keep_ids=True)
