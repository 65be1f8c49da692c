"""MiniCPM-V 4.6, MiniCPM-V 4.7 and MiniCPM-OCR: a SigLIP tower at each slice's own size (NaViT),
one item per slice.

The processor cuts an image into a thumbnail and its slices (a video frame likewise) and packs
the patches of all of them into one row, ``pixel_values [1, C, p, patches * p]`` (each patch
``p`` consecutive columns), with ``target_sizes [slices, 2]`` their patch grids. The tower runs
the slices of a call as one sequence but attends within a slice only (``cu_seqlens``), takes
position embeddings from the slice's own grid, merges 2 x 2 windows inside the slice and then
the merger's cells, and returns each slice's rows apart (``pooler_output`` is a list per slice):
a slice encoded apart gives exactly its rows, so every slice (of an image or a video frame) is
an item. Only a slice's own patches travel, as rows ``[patches, C * p * p]``; the encoding rank
packs its items into one row again. The forward's ``downsample_mode`` (``"4x"`` skips the
window merger) is honoured; every rank must pass the same one. ``target_sizes`` stay in the
forward's keywords: MiniCPM-V 4.7 computes its M-RoPE positions from them.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from ...compat import merges_one_slice_size
from ..adapter import EncoderAdapter, Items, flops_linear, packed_rows, register_adapter
from .common import as_int, core, dtype_device, mm_outputs, pooled

__all__ = ["MiniCPMV46Adapter"]

_STREAMS = (
    ("image", "pixel_values", "target_sizes"),
    ("video", "pixel_values_videos", "target_sizes_videos"),
)


@register_adapter
class MiniCPMV46Adapter(EncoderAdapter):
    encoder = "vision"
    meta_columns = ("video", "height", "width")
    model_classes = (
        "MiniCPMV4_6ForConditionalGeneration",
        "MiniCPMV4_6Model",
        "MiniCPMV4_7ForConditionalGeneration",
        "MiniCPMV4_7Model",
        "MiniCPMOcrForConditionalGeneration",
        "MiniCPMOcrModel",
    )
    splits_frames = True  # the tower sees one slice at a time: slices are items whatever this says

    def _tower(self, model):
        return core(model).vision_tower

    def refusal(self, model):
        if merges_one_slice_size(self._tower(model)):
            return (
                "the installed transformers' MiniCPM-V window merger takes every slice of a call at the first "
                "slice's size, so a call holding several ranks' slices would merge them on the wrong grids "
                "(the releases before 5.16 and from 5.19 on merge slice by slice)"
            )
        return None

    def _patch(self, model) -> int:
        return as_int(self._tower(model).config.patch_size)

    def _channels(self, model) -> int:
        return int(getattr(self._tower(model).config, "num_channels", 3))

    def _mode(self, model, options: dict) -> str:
        mode = options.get("downsample_mode")
        return str(mode if mode else model.config.downsample_mode)

    def _steps(self, model, mode: str) -> list[int]:
        """The factor each side is divided by, merge after merge (the window merger's first)."""
        window = [int(x) for x in self._tower(model).config.window_kernel_size]
        merge = [int(x) for x in model.config.merge_kernel_size]
        if len(set(window)) != 1 or len(set(merge)) != 1:
            raise ValueError(
                f"window_kernel_size {window} and merge_kernel_size {merge} must be square (the model requires it)"
            )
        return ([] if mode == "4x" else [window[0]]) + [merge[0]] * int(model.config.merger_times)

    def call_options(self, model, kwargs):
        return {"downsample_mode": self._mode(model, kwargs)}

    def _slices(
        self, model, pix: Tensor, sizes, key: str, size_key: str, mode: str
    ) -> tuple[Tensor, np.ndarray]:
        """``(patch rows [patches, C * p * p], target sizes [slices, 2])`` of one stream, checked."""
        p, c = self._patch(model), self._channels(model)
        if sizes is None:
            raise ValueError(f"{key} is given without {size_key}")
        sizes_t = torch.as_tensor(sizes).reshape(-1, 2).cpu().long()
        if key == "pixel_values_videos" and pix.dim() == 4 and pix.shape[0] > 1:
            # frames stacked on the first axis, sharing their slices' sizes: as get_video_features reads them
            sizes_t = sizes_t.repeat(int(pix.shape[0]), 1)
            pix = pix.permute(1, 2, 0, 3).reshape(1, pix.shape[1], pix.shape[2], -1)
        if pix.dim() != 4 or pix.shape[0] != 1 or pix.shape[1] != c or pix.shape[2] != p:
            raise ValueError(
                f"{key} must be [1, {c}, {p}, patches * {p}] (MiniCPM-V packs every slice's patches into one row), "
                f"got shape {tuple(pix.shape)}"
            )
        sizes_np = sizes_t.numpy().astype(np.int64)
        step = int(np.prod(self._steps(model, mode)))
        if (sizes_np <= 0).any() or (sizes_np % step).any():
            raise ValueError(
                f"{size_key} {sizes_np.tolist()}: every side must be a positive multiple of {step} patches (the "
                f"merges of downsample_mode {mode!r})"
            )
        patches = int((sizes_np[:, 0] * sizes_np[:, 1]).sum())
        if patches * p != pix.shape[-1]:
            raise ValueError(
                f"{size_key} gives {patches} patches but {key} holds {pix.shape[-1] / p:g} ({pix.shape[-1]} columns "
                f"of {p})"
            )
        rows = pix[0].reshape(c, p, patches, p).permute(2, 0, 1, 3).reshape(patches, c * p * p)
        return rows, sizes_np

    def extract(self, model, kwargs):
        mm = mm_outputs(kwargs)
        mode = self._mode(model, kwargs)
        parts, meta, context = [], [], {}
        for video, (name, key, size_key) in enumerate(_STREAMS):
            pix = kwargs.get(key)
            if pix is None or mm.get(name) is not None:
                continue
            rows, sizes = self._slices(model, pix, kwargs.get(size_key), key, size_key, mode)
            parts.append(rows)
            meta += [(video, int(h), int(w)) for h, w in sizes.tolist()]
            context[name] = len(sizes)
            kwargs[key] = None  # (the sizes stay: MiniCPM-V 4.7 lays out its M-RoPE canvas from them)
        if not parts:
            return None
        dtype, _ = dtype_device(self._tower(model))
        meta_np = np.array(meta, dtype=np.int64).reshape(-1, 3)
        return Items([torch.cat(parts).to(dtype)], meta_np[:, 1] * meta_np[:, 2], meta_np,
                     {"streams": context, "options": self.call_options(model, kwargs)})  # fmt: skip

    def empty_payload(self, model):
        dtype, device = dtype_device(self._tower(model))
        p = self._patch(model)
        return [torch.empty(0, self._channels(model) * p * p, dtype=dtype, device=device)]

    def dummy(self, model):
        dtype, device = dtype_device(self._tower(model))
        side = int(np.prod(self._steps(model, "16x")))  # every merge's multiple: valid in either mode
        p = self._patch(model)
        x = torch.zeros(side * side, self._channels(model) * p * p, dtype=dtype, device=device)
        return [x], np.array([[0, side, side]], dtype=np.int64)

    def out_rows(self, model, meta, **options):
        step = int(np.prod(self._steps(model, self._mode(model, options))))
        return (meta[:, 1] // step) * (meta[:, 2] // step)

    def encode(self, model, payload, meta, **options):
        options = options or self.call_options(model, {})
        p, c = self._patch(model), self._channels(model)
        n = int(payload[0].shape[0])
        pix = payload[0].reshape(n, c, p, p).permute(1, 2, 0, 3).reshape(1, c, p, n * p)
        sizes = torch.as_tensor(meta[:, 1:3], dtype=torch.int32, device=pix.device)
        out = core(model).get_image_features(pix, sizes, return_dict=True, **options).pooler_output
        return [torch.cat(list(out))]

    def restore(self, model, kwargs, items, outputs):
        per = packed_rows(outputs[0], self.out_rows(model, items.meta, **items.context["options"]))
        mm = mm_outputs(kwargs)
        start = 0
        for name, count in items.context["streams"].items():
            mm[name] = pooled(tuple(per[start : start + count]))
            start += count
        kwargs["mm_encoder_outputs"] = mm
        return kwargs

    def cost(self, model, meta, rows):
        """The tower's layers up to the window merger on every patch, the rest on a quarter of them
        (each attending within its slice), plus the window merger's attention and MLP."""
        cfg = self._tower(model).config
        hidden, ffn, depth = int(cfg.hidden_size), int(cfg.intermediate_size), int(cfg.num_hidden_layers)
        n = np.asarray(rows, dtype=np.float64)
        per_layer = lambda t: flops_linear(hidden, ffn) * t + 4.0 * hidden * t * t  # noqa: E731
        if str(model.config.downsample_mode) == "4x":
            return depth * per_layer(n)
        before = min(int(cfg.insert_layer_id) + 1, depth)
        window = int(np.prod([int(x) for x in cfg.window_kernel_size]))
        merger = flops_linear(hidden, ffn) * n + 2.0 * (hidden * window) * (ffn * window) * 2.0 * n / window
        return before * per_layer(n) + (depth - before) * per_layer(n / window) + merger
