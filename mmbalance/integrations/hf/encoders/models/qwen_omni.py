"""The Qwen2.5-Omni thinker's audio tower: one item per clip, only its valid frames travel. (Its
vision tower is the Qwen ViT of ``qwen_vl.py``.)

The Qwen3-Omni thinker's audio tower is left to the thinker: it cuts the clips of a call into
chunks padded to the call's longest, and although a clip's rows do not depend on its neighbours,
its conv layers' gradients do (3 to 7 % between one call of four clips and four calls of one), so
moving clips would change training. Its vision tower is balanced (``qwen_vl.py``)."""

from __future__ import annotations

import numpy as np
import torch

from ..adapter import Items, register_adapter
from .common import AudioAdapter, core, scatter_audio

__all__ = ["QwenOmniAudioAdapter"]


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
