"""More tiny families for :mod:`tests.integrations.hf_zoo` (its ``build``, ``batch`` and ``collate``
hand them here): the towers that take an image at its own size (Gemma 4, Mistral 3, MiniCPM-V,
Molmo2's crops, Ernie-4.5-VL), LLaVA-OneVision's anyres tiles and the tile towers of InternVL and
Idefics3. Same conventions: hidden size 32, random weights,
placeholder tokens that match the encoder inputs, ``spec`` as ``hf_zoo`` describes it.
"""

from __future__ import annotations

import inspect

import torch

from tests.integrations.hf_zoo import (
    AE,
    AS,
    AUD,
    IMG,
    MERGE,
    PATCH,
    TEXT,
    VE,
    VID,
    VS,
    P,
    S,
    _finish,
    _text,
    anyres_pixels,
)

G4_PATCH, G4_POOL, G4_MAX = 2, 2, 64  # Gemma 4: patch side, pooling kernel, patches an image is padded to
# MiniCPM-V: patch side; patches a side per placeholder: a 2 x 2 window, then a 2 x 2 merge ("16x",
# MiniCPM-V 4.6's and 4.7's default), or the merge alone ("4x", MiniCPM-OCR's)
MC_PATCH = 2
MINICPM = ("minicpmv4_6", "minicpmv4_7", "minicpm_ocr")
MOLMO_SIDE = 4  # Molmo2: a crop's side in patches (28 pixels, patches of 7)
FAMILIES = (
    "gemma4",
    "mistral3",
    "llava_onevision",
    *MINICPM,
    "molmo2",
    "ernie4_5_vl_moe",
    "internvl",
    "idefics3",
)


def build(name: str):
    """The family's tiny model (the caller seeds torch and puts it in float32 training mode)."""
    import transformers as tf

    if name == "gemma4":
        # a ViT at each image's size (patches pooled 2 x 2), images as bidirectional blocks; weights
        # at 0.2: at the default 0.02 the q/k norms' weight gradients of so small a model cancel, at
        # 1.0 its activations grow, and either way float32 rounding reaches 1e-5 on 2 ranks
        text = tf.Gemma4TextConfig(**_text(head_dim=16, global_head_dim=16, num_hidden_layers=2, sliding_window=16,
                                           layer_types=["sliding_attention", "full_attention"],
                                           hidden_size_per_layer_input=4, vocab_size_per_layer_input=128,
                                           use_bidirectional_attention="vision", initializer_range=0.2))  # fmt: skip
        vision = tf.models.gemma4.Gemma4VisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                                     num_attention_heads=2, num_key_value_heads=2, head_dim=16,
                                                     patch_size=G4_PATCH, pooling_kernel_size=G4_POOL,
                                                     position_embedding_size=64, initializer_range=0.2)  # fmt: skip
        cfg = tf.Gemma4Config(text_config=text.to_dict(), vision_config=vision.to_dict(), audio_config=None,
                              image_token_id=IMG, video_token_id=VID, boi_token_id=VS, eoi_token_id=VE,
                              audio_token_id=AUD)  # fmt: skip
        return tf.Gemma4ForConditionalGeneration(cfg)
    if name == "mistral3":
        pixtral = dict(model_type="pixtral", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=2, head_dim=16, image_size=32, patch_size=P)  # fmt: skip
        cfg = tf.Mistral3Config(vision_config=pixtral, text_config=_text(model_type="mistral", head_dim=16),
                                image_token_index=IMG, spatial_merge_size=2, vision_feature_layer=-1)  # fmt: skip
        return tf.Mistral3ForConditionalGeneration(cfg)
    if name == "llava_onevision":
        siglip = dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, image_size=S, patch_size=P, vision_use_head=False)  # fmt: skip
        cfg = tf.LlavaOnevisionConfig(vision_config=siglip, text_config=_text(model_type="qwen2"),
                                      image_token_index=IMG, video_token_index=VID, vision_feature_layer=-1,
                                      vision_feature_select_strategy="full",
                                      image_grid_pinpoints=[[16, 16], [16, 32], [32, 16], [32, 32]])  # fmt: skip
        return tf.LlavaOnevisionForConditionalGeneration(cfg)
    if name in MINICPM:
        # a SigLIP tower on each slice's own grid, a Qwen3.5 (Gated DeltaNet) text model; 4.7's M-RoPE
        # canvas reads its markers: <image> </image> around a thumbnail, <slice> </slice> around a crop
        text = _text(model_type="qwen3_5_text", num_hidden_layers=2, head_dim=16,
                     layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2,
                     linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=8)  # fmt: skip
        vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                      image_size=16, patch_size=MC_PATCH)  # fmt: skip
        ids = dict(insert_layer_id=0, image_token_id=IMG, video_token_id=VID)
        if name == "minicpmv4_7":
            text["rope_parameters"] = {"rope_type": "default", "mrope_section": [4, 2, 2], "mrope_interleaved": True,
                                       "rope_theta": 10000.0}  # fmt: skip
            ids.update(
                image_start_id=VS, image_end_id=VE, slice_start_id=AS, slice_end_id=AE, newline_id=TEXT + 2
            )
        cls = {"minicpmv4_6": "MiniCPMV4_6", "minicpmv4_7": "MiniCPMV4_7", "minicpm_ocr": "MiniCPMOcr"}[name]
        cfg = getattr(tf, f"{cls}Config")(text_config=text, vision_config=vision, **ids)
        model = getattr(tf, f"{cls}ForConditionalGeneration")(cfg)
        with torch.no_grad():  # decays of e^-0.1..e^-1.3 a token (cp_plain_loop.py says why)
            for module in model.modules():
                if hasattr(module, "A_log"):
                    module.A_log.copy_(torch.linspace(0.1, 1.0, module.A_log.numel()).log())
        return model
    if name == "internvl":
        cfg = tf.InternVLConfig(
            vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                               image_size=[S, S], patch_size=[P, P]),  # fmt: skip
            text_config=_text(model_type="qwen2"),
            image_token_id=IMG, image_seq_length=int((S // P * 0.5) ** 2), downsample_ratio=0.5,
            vision_feature_layer=-1, vision_feature_select_strategy="default",
        )  # fmt: skip
        return tf.InternVLForConditionalGeneration(cfg)
    if name == "idefics3":
        cfg = tf.Idefics3Config(
            vision_config=dict(
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=1,
                num_attention_heads=2,
                image_size=S,
                patch_size=P,
            ),  # fmt: skip
            text_config=_text(model_type="llama"),
            image_token_id=IMG,
            scale_factor=2,
        )
        return tf.Idefics3ForConditionalGeneration(cfg)
    if name == "molmo2":  # a ViT over each image's crops, attention pooling of patch windows into its tokens
        text = _text(head_dim=16, additional_vocab_size=8)
        vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2,
                      num_key_value_heads=2, head_dim=16, image_size=[28, 28], patch_size=7)  # fmt: skip
        adapter = dict(vision_feature_layer=[-1, -2], hidden_size=32, num_attention_heads=2, num_key_value_heads=2,
                       head_dim=16, text_hidden_size=32, intermediate_size=64)  # fmt: skip
        cfg = tf.Molmo2Config(vision_config=vision, text_config=text, adapter_config=adapter, image_patch_id=IMG,
                              image_start_token_id=VS, image_end_token_id=VE, low_res_image_start_token_id=AS,
                              frame_start_token_id=AS, frame_end_token_id=AE)  # fmt: skip
        return tf.Molmo2ForConditionalGeneration(cfg)
    if name == "ernie4_5_vl_moe":  # the Qwen ViT's inputs, a resampler merging 2 x 2 patches and frame pairs
        text = _text(head_dim=16, num_hidden_layers=2, moe_intermediate_size=[32, 32], moe_k=1, moe_num_experts=2,
                     moe_num_shared_experts=0,
                     rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=[3, 3, 2]))  # fmt: skip
        vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=PATCH,
                      spatial_merge_size=MERGE)  # fmt: skip
        cfg = tf.Ernie4_5_VLMoeConfig(text_config=text, vision_config=vision, image_token_id=IMG, video_token_id=VID,
                                      image_start_token_id=VS, image_end_token_id=VE, video_start_token_id=AS,
                                      video_end_token_id=AE)  # fmt: skip
        return tf.Ernie4_5_VLMoeForConditionalGeneration(cfg)
    raise ValueError(name)


def _molmo_windows(tokens: int, patches: int, side: int, first: int) -> torch.Tensor:
    """``tokens`` pooling windows of ``side x side`` patches each, walking over ``patches`` patches from
    ``first`` on; a window's last entry is padding (``-1``) on every third token, as at an image's edge."""
    k = side * side
    idx = (torch.arange(tokens * k) % patches + first).reshape(tokens, k)
    idx[::3, -1] = -1
    return idx


def batch(name: str, model, spec: list[list], g: torch.Generator) -> dict:
    """A batch for ``spec`` (``hf_zoo.batch``'s, with its generator)."""
    if name == "gemma4":  # images (w, h) in patches, ("video", t, w, h): each frame pooled 2 x 2
        rows, images, frames, per_video, types = [], [], [], [], []
        for seq in spec:
            ids, tt = [TEXT] * 4, [0] * 4
            for item in seq:
                video = item[0] == "video"
                t, w, h = item[1:] if video else (1, *item)
                n = (w // G4_POOL) * (h // G4_POOL)
                for _ in range(t):
                    (frames if video else images).append((w, h))
                    ids += [VS] + [VID if video else IMG] * n + [VE]
                    tt += [0] + [2 if video else 1] * n + [0]
                if video:
                    per_video.append(t)
                ids.append(TEXT + 1)
                tt.append(0)
            rows.append(ids + [TEXT + 3] * 3)
            types.append(tt + [0] * 3)
        out = _finish(rows, types)
        for key, pos_key, grids in (("pixel_values", "image_position_ids", images),
                                    ("pixel_values_videos", "video_position_ids", frames)):  # fmt: skip
            if not grids:
                continue
            pv = torch.zeros(len(grids), G4_MAX, 3 * G4_PATCH**2)
            pos = torch.full((len(grids), G4_MAX, 2), -1, dtype=torch.long)
            for i, (w, h) in enumerate(grids):
                yy, xx = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
                pv[i, : w * h] = torch.randn(w * h, 3 * G4_PATCH**2, generator=g)
                pos[i, : w * h] = torch.stack([xx.reshape(-1), yy.reshape(-1)], dim=1)
            out[key], out[pos_key] = pv, pos
        if (
            per_video
            and "num_frames_per_video" in inspect.signature(model.model.get_video_features).parameters
        ):
            out["num_frames_per_video"] = torch.tensor(per_video)
        elif per_video:  # before: [videos, frames, ...], every video of a batch with one frame count
            for key in ("pixel_values_videos", "video_position_ids"):
                out[key] = out[key].reshape(len(per_video), per_video[0], *out[key].shape[1:])
        return out
    if name == "mistral3":  # images at their own sizes (pixels, multiples of patch x merge = 8)
        rows, sizes = [], []
        for seq in spec:
            ids = [TEXT] * 4
            for h, w in seq:
                ids += [VS] + [IMG] * ((h // (2 * P)) * (w // (2 * P))) + [VE, TEXT + 1]
                sizes.append([h, w])
            rows.append(ids + [TEXT + 3] * 3)
        out = _finish(rows)
        if sizes:
            hm, wm = max(s[0] for s in sizes), max(s[1] for s in sizes)
            pv = torch.zeros(len(sizes), 3, hm, wm)
            for i, (h, w) in enumerate(sizes):
                pv[i, :, :h, :w] = torch.randn(3, h, w, generator=g)
            out.update(pixel_values=pv, image_sizes=torch.tensor(sizes))
        return out
    if name == "llava_onevision":  # images at their sizes (anyres tiles), ("video", frames) clips
        from transformers.models.llava_onevision.modeling_llava_onevision import image_size_to_num_patches

        core = model.model
        pinpoints = model.config.image_grid_pinpoints
        rows, sizes, tiles, videos = [], [], [], []
        for seq in spec:
            ids = [TEXT] * 4
            for item in seq:
                if item[0] == "video":
                    ids += [VID] * (item[1] * (-(-S // P // 2)) ** 2 + 1) + [TEXT + 1]
                    videos.append(item[1])
                    continue
                n = image_size_to_num_patches(list(item), pinpoints, S)
                with torch.no_grad():  # the token count the model's own packing gives
                    packed, _ = core.pack_image_features([torch.zeros(n, (S // P) ** 2, 32)], torch.tensor([item]),
                                                         image_newline=core.image_newline)  # fmt: skip
                ids += [IMG] * packed[0].shape[0] + [TEXT + 1]
                sizes.append(list(item))
                tiles.append(n)
            rows.append(ids + [TEXT + 3] * 3)
        out = _finish(rows)
        if sizes:
            out.update(pixel_values=anyres_pixels(tiles, g), image_sizes=torch.tensor(sizes))
        if videos:  # every video of a batch has the same frame count
            out["pixel_values_videos"] = torch.randn(len(videos), videos[0], 3, S, S, generator=g)
        return out
    if name in MINICPM:
        # images (h, w) in patches, or [(h, w), ...]: a thumbnail and its slices; ("video", t, h, w): t frames
        cell = 2 if model.config.downsample_mode == "4x" else 4
        rows, types, slices = [], [], {"image": [], "video": []}
        for seq in spec:
            ids, tt = [TEXT] * 4, [0] * 4
            for item in seq:
                video = item[0] == "video"
                parts = (
                    [tuple(item[2:])] * item[1] if video else ([item] if isinstance(item, tuple) else item)
                )
                for k, (h, w) in enumerate(parts):
                    n = (h // cell) * (w // cell)
                    start, end = (AS, AE) if k and not video else (VS, VE)  # a crop of an image, or a frame
                    ids += [start] + [VID if video else IMG] * n + [end]
                    tt += [0] + [2 if video else 1] * n + [0]
                    slices["video" if video else "image"].append((h, w))
                ids.append(TEXT + 1)
                tt.append(0)
            rows.append(ids + [TEXT + 3] * 3)
            types.append(tt + [0] * 3)
        out = _finish(rows, types if name == "minicpmv4_7" else None)
        for key, size_key, sizes in (("pixel_values", "target_sizes", slices["image"]),
                                     ("pixel_values_videos", "target_sizes_videos", slices["video"])):  # fmt: skip
            if sizes:  # every slice's patches, p columns each, in one row
                cols = sum(h * w for h, w in sizes) * MC_PATCH
                out[key] = torch.randn(1, 3, MC_PATCH, cols, generator=g)
                out[size_key] = torch.tensor(sizes, dtype=torch.int32)
        return out
    if name == "internvl":
        rows, per_tile = [], int((S // P * 0.5) ** 2)
        n_tiles = 0
        for seq in spec:
            ids = [TEXT] * 4
            for k in seq:
                ids += [VS] + [IMG] * (k * per_tile) + [VE, TEXT + 1]
                n_tiles += k
            rows.append(ids + [TEXT + 3] * 3)
        out = _finish(rows)
        if n_tiles:
            out["pixel_values"] = torch.randn(n_tiles, 3, S, S, generator=g)
        return out
    if name == "idefics3":
        rows, per_tile = [], (S // P) ** 2 // 4  # scale factor 2
        counts = []
        for seq in spec:
            ids = [TEXT] * 4
            for k in seq:
                ids += [IMG] * (k * per_tile) + [TEXT + 1]
            counts.append(sum(seq))
            rows.append(ids + [TEXT + 3] * 3)
        out = _finish(rows)
        if any(counts):
            pv = torch.zeros(len(rows), max(counts), 3, S, S)
            mask = torch.zeros(len(rows), max(counts), S, S, dtype=torch.bool)
            for i, k in enumerate(counts):
                pv[i, :k] = torch.randn(k, 3, S, S, generator=g)
                mask[i, :k] = True
            out.update(pixel_values=pv, pixel_attention_mask=mask)
        return out
    if name == "molmo2":
        # images (tiles, h2, w2): the resized view pooled to 2 x 2 tokens and `tiles` crops pooled to
        # h2 x w2 tokens (2 x 2 windows); ("video", frames): 2 x 2 tokens a frame (3 x 3 windows). A
        # batch holds images or videos, not both (the model refuses both in one call).
        per = MOLMO_SIDE * MOLMO_SIDE
        rows, types, crops, grids, pools, vgrids, vpools, patches = [], [], [], [], [], [], [], [0, 0]
        for seq in spec:
            ids, tt = [TEXT] * 4, [0] * 4
            for item in seq:
                if item[0] == "video":
                    frames = item[1]
                    vgrids.append([frames, 2, 2])
                    vpools.append(_molmo_windows(frames * 4, frames * per, 3, patches[1]))
                    patches[1] += frames * per
                    n, kind = frames * 4, 2
                else:
                    tiles, h2, w2 = item
                    grids.append([2, 2, h2, w2])
                    crops.append(1 + tiles)
                    view = _molmo_windows(4, per, 2, patches[0])
                    pools.append(torch.cat([view, _molmo_windows(h2 * w2, tiles * per, 2, patches[0] + per)]))
                    patches[0] += (1 + tiles) * per
                    n, kind = 4 + h2 * w2, 1
                ids += [VS] + [IMG] * n + [VE, TEXT + 1]
                tt += [0] + [kind] * n + [0, 0]
            rows.append(ids + [TEXT + 3] * 3)
            types.append(tt + [0] * 3)
        out = _finish(rows, types)
        pixels = 7 * 7 * 3
        if crops:
            out.update(pixel_values=torch.randn(sum(crops), per, pixels, generator=g), image_token_pooling=torch.cat(pools),
                       image_grids=torch.tensor(grids), image_num_crops=torch.tensor(crops))  # fmt: skip
        if vgrids:
            out.update(pixel_values_videos=torch.randn(patches[1] // per, per, pixels, generator=g),
                       video_token_pooling=torch.cat(vpools), video_grids=torch.tensor(vgrids))  # fmt: skip
        return out
    if name == "ernie4_5_vl_moe":  # images (h, w) in patches, ("video", t, h, w) with t even: frames paired
        rows, types, media = [], [], {"image": ([], []), "video": ([], [])}
        for seq in spec:
            ids, tt = [TEXT] * 4, [0] * 4
            for item in seq:
                video = item[0] == "video"
                t, h, w = item[1:] if video else (1, *item)
                n = t * h * w // MERGE**2 // (2 if video else 1)
                ids += [AS if video else VS] + [VID if video else IMG] * n + [AE if video else VE, TEXT + 1]
                tt += [0] + [2 if video else 1] * n + [0, 0]
                pix, grids = media["video" if video else "image"]
                pix.append(torch.randn(t * h * w, 3 * PATCH * PATCH, generator=g))
                grids.append([t, h, w])
            rows.append(ids + [TEXT + 3] * 3)
            types.append(tt + [0] * 3)
        out = _finish(rows, types)
        ids = out["input_ids"]  # its processor's experts by token: vision tokens and their markers
        out["moe_mm_token_type_ids"] = (
            torch.isin(ids, torch.tensor([IMG, VS, VE])).long()
            + 2 * torch.isin(ids, torch.tensor([VID, AS, AE])).long()
        )
        for key, grid_key, (pix, grids) in (("pixel_values", "image_grid_thw", media["image"]),
                                            ("pixel_values_videos", "video_grid_thw", media["video"])):  # fmt: skip
            if pix:
                out.update({key: torch.cat(pix), grid_key: torch.tensor(grids)})
        return out
    raise ValueError(name)


def collate(batches: list[dict], out: dict) -> None:
    """MiniCPM-V 4.6's media of one-row batches into ``out``: one row of every slice's patches."""
    for key, size_key in (("pixel_values", "target_sizes"), ("pixel_values_videos", "target_sizes_videos")):
        parts = [b for b in batches if key in b]
        if parts:
            out[key] = torch.cat([b[key] for b in parts], dim=-1)
            out[size_key] = torch.cat([b[size_key] for b in parts])
