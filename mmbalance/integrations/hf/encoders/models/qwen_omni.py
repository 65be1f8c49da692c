"""The Qwen2.5-Omni and Qwen3-Omni thinkers' audio towers: one item per clip, only its valid frames
travel. (Their vision towers are the Qwen ViT of ``qwen_vl.py``.)"""

from __future__ import annotations

import numpy as np
import torch

from ..adapter import Items, register_adapter
from .common import AudioAdapter, core, scatter_audio

__all__ = ["Qwen3OmniAudioAdapter", "QwenOmniAudioAdapter"]


@register_adapter
class QwenOmniAudioAdapter(AudioAdapter):
    """The Qwen2.5-Omni thinker's audio tower: one item per clip, only its valid frames travel
    (attention runs in fixed windows, so a clip costs in proportion to its frames)."""

    model_classes = ("Qwen2_5OmniThinkerForConditionalGeneration",)

    def _mel(self, model) -> int:
        return int(self._tower(model).config.num_mel_bins)

    def extract(self, model, kwargs):
        found = self._clips(model, kwargs)
        if found is None:
            return None
        feats, frames = found
        # clips as rows of frames: [sum of valid frames, mel] (padding never travels)
        rows = (
            torch.cat([f[:, : int(n)].t() for f, n in zip(feats, frames)])
            if len(frames)
            else feats.new_zeros(0)
        )
        kwargs["input_features"] = None  # the mask stays: the thinker's rope positions use it
        return Items([rows], frames, frames[:, None])

    def empty_payload(self, model):
        dtype, device = self._dtype_device(model)
        return [torch.empty(0, self._mel(model), dtype=dtype, device=device)]

    def dummy(self, model):
        dtype, device = self._dtype_device(model)
        return [torch.zeros(3, self._mel(model), dtype=dtype, device=device)], np.array([[3]], dtype=np.int64)

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


@register_adapter
class Qwen3OmniAudioAdapter(QwenOmniAudioAdapter):
    """The Qwen3-Omni thinker's audio tower. It cuts a clip into chunks of ``2 * n_window`` frames
    (the chunks of a call padded to the longest, which its convolutions' own zero padding makes
    exact) and attends in windows inside each clip, so a clip gives the same rows wherever it is
    encoded: the count ``_get_feat_extract_output_lengths`` gives."""

    model_classes = ("Qwen3OmniMoeThinkerForConditionalGeneration",)

    def out_rows(self, model, meta):
        from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
            _get_feat_extract_output_lengths,
        )

        frames = torch.as_tensor(meta[:, 0])
        n_window = int(self._tower(model).n_window)
        return _get_feat_extract_output_lengths(frames, n_window).numpy().astype(np.int64)
