"""Tiny real Hugging Face multimodal models (random weights, hidden size 32, no downloads) and
batches whose placeholder tokens match their encoder inputs.

``build(name, seed)`` returns the model; ``batch(name, model, spec, seed)`` a training batch for a
per-rank ``spec``: a list of sequences, each a list of item sizes in the model's own terms (image
sizes in patches for the Qwen ViTs, ``("video", t, h, w)`` for videos, tile counts for InternVL,
original image sizes for LLaVA-NeXT, tile counts for Idefics3, valid mel frames for audio clips).
``spec == []``: one
text-only sequence.
"""

from __future__ import annotations

import functools

import torch

TEXT = 5  # an ordinary text token
IMG, VID, VS, VE = 100, 101, 102, 103
AUD, AS, AE = 104, 105, 106
PATCH, TPATCH, MERGE = 4, 2, 2
S, P = 16, 4  # tile side and patch of the CLIP/InternViT towers
PINPOINTS = [[16, 32], [32, 16], [32, 32]]
GEMMA3_TOKENS = 4  # Gemma 3's projector pools a tile's (S / P)**2 patches into 4 tokens
MEL, MSP = 8, 16  # Qwen2-Audio: fixed 2 * MSP = 32 mel frames per clip

MODELS = (
    "qwen2_vl",
    "qwen2_5_vl",
    "qwen3_vl",
    "llava",
    "llava_next",
    "internvl",
    "qwen2_audio",
    "qwen2_5_omni",
    "qwen3_vl_moe",
    "idefics3",
    "qwen3_5",
    "qwen3_5_moe",
    "glm4v",
    "glm4v_moe",
    "glm46v",
    "kimi_k25",
    "gemma3",
    "paligemma",
    "mistral3",
    "qwen3_omni_moe",
    "llava_onevision",
    "gemma4",
    "minicpmv4_6",
    "minicpmv4_7",
    "minicpm_ocr",
    "molmo2",
    "ernie4_5_vl_moe",
)
# the config class a family needs, where some release of the test matrix lacks it
NEEDS = {"qwen3_5": "Qwen3_5Config", "qwen3_5_moe": "Qwen3_5MoeConfig", "kimi_k25": "Kimi_K25Config",
         "gemma4": "Gemma4Config", "minicpmv4_6": "MiniCPMV4_6Config", "minicpmv4_7": "MiniCPMV4_7Config",
         "minicpm_ocr": "MiniCPMOcrConfig", "molmo2": "Molmo2Config"}  # fmt: skip


def kimi_videos_run() -> bool:
    """Whether the installed transformers runs Kimi-K2.5's video clips itself (5.16.1 and 5.19.0 split
    a clip's pooled rows by its frames and fail; 5.24 runs them)."""
    import transformers as tf

    return tuple(int(x) for x in tf.__version__.split(".")[:2]) >= (5, 24)


def onevision_videos_shard() -> bool:
    """Whether dynamic CP splits LLaVA-OneVision's videos on the installed transformers: from the
    release whose forward takes ``mm_encoder_outputs`` (before, the forward appends each video's
    newline row to the rows it is given, and ``handle.shard`` refuses videos by name)."""
    import inspect

    import transformers as tf

    return "mm_encoder_outputs" in inspect.signature(tf.LlavaOnevisionModel.forward).parameters


def onevision_rows(model, batch: dict) -> int:
    """The tower rows of a LLaVA-OneVision batch: every image's real tiles, every video's frames."""
    from transformers.models.llava_onevision.modeling_llava_onevision import image_size_to_num_patches

    sizes = batch["image_sizes"].tolist() if "image_sizes" in batch else []
    rows = sum(image_size_to_num_patches(s, model.config.image_grid_pinpoints, S) for s in sizes)
    return rows + (
        int(batch["pixel_values_videos"].shape[:2].numel()) if "pixel_values_videos" in batch else 0
    )


@functools.cache
def gemma4_videos_run() -> bool:
    """Whether the installed transformers runs Gemma 4's videos itself (5.19.0 asks every video for
    ``num_frames_per_video`` and does not hand it on to its own ``get_video_features``)."""
    if not available("gemma4"):
        return False
    model = build("gemma4")
    try:
        with torch.no_grad():
            model(**batch("gemma4", model, [[("video", 1, 2, 2)]]))
    except ValueError as exc:
        if "num_frames_per_video" in str(exc):
            return False
        raise
    return True


def more():
    """:mod:`tests.integrations.hf_zoo_more`, the families this module hands on (imported late: it
    imports this module's helpers)."""
    from tests.integrations import hf_zoo_more

    return hf_zoo_more


@functools.cache
def refused(name: str) -> str | None:
    """Why the installed transformers' ``name`` cannot have its encoders balanced nor its media
    sharded (``EncoderAdapter.refusal``: MiniCPM-V on 5.16), or ``None``."""
    from mmbalance.integrations.hf.encoders import adapters_for

    if not available(name):
        return None
    model = build(name)
    return next((r for r in (a.refusal(model) for a in adapters_for(model)) if r), None)


def available(name: str) -> bool:
    """Whether the installed transformers has the family ``name``."""
    import transformers as tf

    return hasattr(tf, NEEDS.get(name, "PreTrainedModel"))


# the families whose items are the Qwen ViTs' (flattened patches with *_grid_thw rows)
GRID_FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen2_5_omni", "qwen3_5", "qwen3_5_moe",
                 "glm4v", "glm4v_moe", "glm46v", "kimi_k25", "qwen3_omni_moe")  # fmt: skip


def _text(**extra):
    base = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1, max_position_embeddings=1024, pad_token_id=0, bos_token_id=1,
                eos_token_id=2)  # fmt: skip
    base.update(extra)
    return base


def _qwen_rope(section, **extra):
    return {"rope_type": "default", "mrope_section": section, "rope_theta": 10000.0, **extra}


def build(name: str, seed: int = 0):
    import transformers as tf

    torch.manual_seed(seed)
    if not available(name):
        import pytest

        pytest.skip(f"transformers {tf.__version__} has no {name} ({NEEDS[name]})")
    if name in more().FAMILIES:
        return more().build(name).float().train()
    ids = dict(image_token_id=IMG, video_token_id=VID, vision_start_token_id=VS, vision_end_token_id=VE)
    qwen_vision = dict(patch_size=PATCH, temporal_patch_size=TPATCH, spatial_merge_size=MERGE)
    qwen3_vision = dict(depth=2, hidden_size=32, out_hidden_size=32, intermediate_size=64, num_heads=2,
                        num_position_embeddings=16, deepstack_visual_indexes=[0, 1], **qwen_vision)  # fmt: skip
    qwen3_text = dict(num_hidden_layers=2, head_dim=16,
                      rope_parameters=_qwen_rope([4, 2, 2], mrope_interleaved=True))  # fmt: skip
    clip = dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=2, image_size=S, patch_size=P, projection_dim=32)  # fmt: skip
    if name == "qwen2_vl":
        cfg = tf.Qwen2VLConfig(
            text_config=_text(rope_parameters=_qwen_rope([2, 3, 3])),
            vision_config=dict(
                depth=1, embed_dim=32, hidden_size=32, num_heads=2, mlp_ratio=2, **qwen_vision
            ),
            **ids,
        )
        model = tf.Qwen2VLForConditionalGeneration(cfg)
    elif name == "qwen2_5_vl":
        cfg = tf.Qwen2_5_VLConfig(
            text_config=_text(rope_parameters=_qwen_rope([2, 3, 3])),
            vision_config=dict(
                depth=2,
                hidden_size=32,
                out_hidden_size=32,
                intermediate_size=64,
                num_heads=2,
                window_size=16,
                fullatt_block_indexes=[1],
                **qwen_vision,
            ),  # fmt: skip
            **ids,
        )
        model = tf.Qwen2_5_VLForConditionalGeneration(cfg)
    elif name == "qwen3_vl":
        cfg = tf.Qwen3VLConfig(
            text_config=_text(**qwen3_text),
            vision_config=qwen3_vision,
            **ids,
        )
        model = tf.Qwen3VLForConditionalGeneration(cfg)
    elif name == "qwen3_vl_moe":
        cfg = tf.Qwen3VLMoeConfig(
            text_config=_text(
                **qwen3_text,
                num_experts=4,
                num_experts_per_tok=2,
                moe_intermediate_size=16,
                decoder_sparse_step=1,
            ),  # fmt: skip
            vision_config=qwen3_vision,
            **ids,
        )
        model = tf.Qwen3VLMoeForConditionalGeneration(cfg)
    elif name in (
        "qwen3_5",
        "qwen3_5_moe",
    ):  # Gated DeltaNet beside full attention in the language model, Qwen3-VL's tower
        if not hasattr(tf, "Qwen3_5MoeConfig"):
            import pytest

            pytest.skip(f"transformers {tf.__version__} has no Qwen3.5")
        vision = {k: v for k, v in qwen3_vision.items() if k != "deepstack_visual_indexes"}
        text = _text(num_hidden_layers=2, head_dim=16, layer_types=["linear_attention", "full_attention"],
                     linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                     linear_value_head_dim=8, rope_parameters=_qwen_rope([4, 2, 2], mrope_interleaved=True))  # fmt: skip
        if name == "qwen3_5":
            cfg = tf.Qwen3_5Config(text_config=text, vision_config=vision, **ids)
            model = tf.Qwen3_5ForConditionalGeneration(cfg)
        else:
            text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                        shared_expert_intermediate_size=16)  # fmt: skip
            cfg = tf.Qwen3_5MoeConfig(text_config=text, vision_config=vision, **ids)
            model = tf.Qwen3_5MoeForConditionalGeneration(cfg)
        with torch.no_grad():  # decays of e^-0.1..e^-1.3 a token (cp_plain_loop.py says why)
            for module in model.modules():
                if hasattr(module, "A_log"):
                    module.A_log.copy_(torch.linspace(0.1, 1.0, module.A_log.numel()).log())
    elif name in ("glm4v", "glm4v_moe", "glm46v"):
        rope = _qwen_rope([4, 2, 2], partial_rotary_factor=1.0)
        vision = dict(depth=2, hidden_size=32, out_hidden_size=32, intermediate_size=64, num_heads=2, image_size=16,
                      **qwen_vision)  # fmt: skip
        glm_ids = dict(image_token_id=IMG, video_token_id=VID, image_start_token_id=VS, image_end_token_id=VE,
                       video_start_token_id=VS, video_end_token_id=VE)  # fmt: skip
        if name == "glm4v":
            cfg = tf.Glm4vConfig(text_config=_text(rope_parameters=rope), vision_config=vision, **glm_ids)
            model = tf.Glm4vForConditionalGeneration(cfg)
        elif name == "glm46v":
            cfg = tf.Glm46VConfig(text_config=_text(model_type="glm4v_text", rope_parameters=rope),
                                  vision_config=dict(vision, model_type="glm4v_vision"), **glm_ids)  # fmt: skip
            model = tf.Glm46VForConditionalGeneration(cfg)
        else:
            text = _text(rope_parameters=rope, moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2,
                         n_shared_experts=1, first_k_dense_replace=1, num_hidden_layers=2, head_dim=16)  # fmt: skip
            cfg = tf.Glm4vMoeConfig(text_config=text, vision_config=vision, **glm_ids)
            model = tf.Glm4vMoeForConditionalGeneration(cfg)
    elif name == "kimi_k25":
        if not hasattr(tf, "Kimi_K25Config"):
            import pytest

            pytest.skip(f"transformers {tf.__version__} has no Kimi-K2.5")
        text = _text(model_type="deepseek_v3", num_hidden_layers=2, num_key_value_heads=2, moe_intermediate_size=16,
                     n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1, n_shared_experts=1,
                     first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8,
                     qk_nope_head_dim=8, v_head_dim=16)  # fmt: skip
        vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                      patch_size=PATCH, pos_emb_height=8, pos_emb_width=8, pos_emb_time=4, merge_kernel_size=[2, 2])  # fmt: skip
        cfg = tf.Kimi_K25Config(text_config=text, vision_config=vision, projection_hidden_size=32,
                                image_token_id=IMG, video_token_id=VID, vision_start_token_id=VS,
                                vision_end_token_id=VE, tie_word_embeddings=False)  # fmt: skip
        model = tf.Kimi_K25ForConditionalGeneration(cfg)
    elif name in ("gemma3", "paligemma"):  # (their towers' pooling head goes unused, as in their checkpoints)
        siglip = dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, image_size=S, patch_size=P, vision_use_head=False)  # fmt: skip
        gemma = _text(head_dim=16, hidden_activation="gelu_pytorch_tanh")
        if name == "gemma3":
            gemma.update(model_type="gemma3_text", num_hidden_layers=2, sliding_window=8,
                         layer_types=["sliding_attention", "full_attention"])  # fmt: skip
            cfg = tf.Gemma3Config(vision_config=siglip, text_config=gemma, mm_tokens_per_image=GEMMA3_TOKENS,
                                  image_token_index=IMG, boi_token_index=VS, eoi_token_index=VE)  # fmt: skip
            model = tf.Gemma3ForConditionalGeneration(cfg)
        else:
            gemma.update(model_type="gemma")
            cfg = tf.PaliGemmaConfig(vision_config=dict(siglip, projection_dim=32), text_config=gemma,
                                     image_token_index=IMG, projection_dim=32)  # fmt: skip
            model = tf.PaliGemmaForConditionalGeneration(cfg)
    elif name == "qwen3_omni_moe":  # the thinker: Qwen3-VL's tower, an audio tower, an MoE language model
        audio = dict(d_model=32, encoder_layers=1, encoder_attention_heads=2, encoder_ffn_dim=64, num_mel_bins=MEL,
                     max_source_positions=64, n_window=50, n_window_infer=800, output_dim=32,
                     downsample_hidden_size=8)  # fmt: skip
        text = _text(**qwen3_text, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                     decoder_sparse_step=1)  # fmt: skip
        cfg = tf.Qwen3OmniMoeThinkerConfig(audio_config=audio, vision_config=qwen3_vision, text_config=text,
                                           audio_token_id=AUD, image_token_id=IMG, video_token_id=VID,
                                           vision_start_token_id=VS, audio_start_token_id=AS)  # fmt: skip
        model = tf.Qwen3OmniMoeThinkerForConditionalGeneration(cfg)
    elif name == "llava":
        cfg = tf.LlavaConfig(vision_config=clip, text_config=_text(model_type="llama"), image_token_index=IMG,
                             image_seq_length=(S // P) ** 2, vision_feature_layer=-2,
                             vision_feature_select_strategy="default")  # fmt: skip
        model = tf.LlavaForConditionalGeneration(cfg)
    elif name == "llava_next":
        cfg = tf.LlavaNextConfig(vision_config=clip, text_config=_text(model_type="llama"), image_token_index=IMG,
                                 image_grid_pinpoints=PINPOINTS, vision_feature_layer=-2,
                                 vision_feature_select_strategy="default")  # fmt: skip
        model = tf.LlavaNextForConditionalGeneration(cfg)
    elif name == "qwen2_audio":
        cfg = tf.Qwen2AudioConfig(
            audio_config=dict(
                d_model=32,
                encoder_layers=1,
                encoder_attention_heads=2,
                encoder_ffn_dim=64,
                num_mel_bins=MEL,
                max_source_positions=MSP,
            ),  # fmt: skip
            text_config=_text(model_type="qwen2"),
            audio_token_index=AUD,
        )
        model = tf.Qwen2AudioForConditionalGeneration(cfg)
    elif name == "qwen2_5_omni":
        cfg = tf.Qwen2_5OmniThinkerConfig(
            audio_config=dict(d_model=32, encoder_layers=1, encoder_attention_heads=2, encoder_ffn_dim=64,
                              num_mel_bins=MEL, max_source_positions=64, n_window=4, output_dim=32),  # fmt: skip
            vision_config=dict(depth=2, hidden_size=32, out_hidden_size=32, intermediate_size=64, num_heads=2,
                               window_size=16, fullatt_block_indexes=[1], **qwen_vision),  # fmt: skip
            text_config=_text(rope_parameters=_qwen_rope([2, 3, 3])),
            audio_token_index=AUD, image_token_index=IMG, video_token_index=VID, vision_start_token_id=VS,
            vision_end_token_id=VE, audio_start_token_id=AS, audio_end_token_id=AE,
        )  # fmt: skip
        model = tf.Qwen2_5OmniThinkerForConditionalGeneration(cfg)
    else:
        raise ValueError(name)
    return model.float().train()


def _finish(rows: list[list[int]], types: list[list[int]] | None = None) -> dict:
    length = max(map(len, rows))
    input_ids = torch.zeros(len(rows), length, dtype=torch.long)
    attn = torch.zeros_like(input_ids)
    for i, r in enumerate(rows):
        input_ids[i, : len(r)] = torch.tensor(r)
        attn[i, : len(r)] = 1
    special = (input_ids >= IMG) & (input_ids <= AE)
    out = dict(
        input_ids=input_ids, attention_mask=attn, labels=input_ids.masked_fill((attn == 0) | special, -100)
    )
    if types is not None:
        tt = torch.zeros_like(input_ids, dtype=torch.int)
        for i, t in enumerate(types):
            tt[i, : len(t)] = torch.tensor(t)
        out["mm_token_type_ids"] = tt
    return out


def _audio3_out_len(n: int) -> int:  # Qwen3-Omni: chunks of 100 frames, 13 rows each, then the rest
    rest = (n % 100 - 1) // 2 + 1
    return ((rest - 1) // 2 + 1 - 1) // 2 + 1 + (n // 100) * 13


def _audio_out_len(n: int) -> int:
    return ((n - 1) // 2 + 1 - 2) // 2 + 1


def batch(name: str, model, spec: list[list], seed: int = 0) -> dict:
    """A batch for ``spec`` (see the module docstring)."""
    g = torch.Generator().manual_seed(seed)
    spec = spec or [[]]
    if name in more().FAMILIES:
        return more().batch(name, model, spec, g)
    rows, types = [], []
    if name in GRID_FAMILIES:
        kimi, glm = name == "kimi_k25", name.startswith("glm")
        row = 3 * (1 if kimi else TPATCH) * PATCH * PATCH
        pix, grids, vpix, vgrids, feats = [], [], [], [], []
        img = IMG
        for seq in spec:
            ids, tt = [TEXT] * 4, [0] * 4
            for item in seq:
                if isinstance(item, tuple) and item[0] == "video":
                    _, t, h, w = item
                    n = (1 if kimi else t) * h * w // MERGE**2  # Kimi-K2.5 averages a clip's frames
                    per_frame = name.startswith(("qwen3_vl", "qwen3_5", "glm"))
                    groups = [h * w // MERGE**2] * t if per_frame else [n]
                    for k in groups:  # GLM-4.xV: a video's placeholders are image tokens
                        ids += [TEXT + 2, VS] + [IMG if glm else VID] * k + [VE]
                        tt += [0, 0] + [2] * k + [0]
                    vgrids.append([t, h, w])
                    vpix.append(torch.randn(t * h * w, row, generator=g))
                    if kimi:
                        vpix[-1] = vpix[-1].reshape(-1, 3, PATCH, PATCH)
                elif isinstance(item, tuple) and item[0] == "audio":
                    n = _audio3_out_len(item[1]) if name == "qwen3_omni_moe" else _audio_out_len(item[1])
                    ids += [AS] + [AUD] * n + [AE, TEXT + 1]
                    tt += [0] * (n + 3)
                    feats.append(item[1])
                else:
                    h, w = item
                    n = h * w // MERGE**2
                    ids += [VS] + [img] * n + [VE, TEXT + 1]
                    tt += [0] + [1] * n + [0, 0]
                    grids.append([1, h, w])
                    pix.append(torch.randn(h * w, row, generator=g))
                    if kimi:
                        pix[-1] = pix[-1].reshape(-1, 3, PATCH, PATCH)
            ids += [TEXT + 3] * 3
            tt += [0] * 3
            rows.append(ids)
            types.append(tt)
        out = _finish(rows, types if name not in ("qwen2_5_omni", "kimi_k25", "qwen3_omni_moe") else None)
        if pix:
            out.update(pixel_values=torch.cat(pix), image_grid_thw=torch.tensor(grids))
        if vpix:
            out.update(pixel_values_videos=torch.cat(vpix), video_grid_thw=torch.tensor(vgrids))
            if name == "qwen3_omni_moe":  # its processor's seconds per temporal patch (integer positions)
                out["video_second_per_grid"] = torch.ones(len(vgrids))
        if feats:
            longest = max(feats)
            f = torch.zeros(len(feats), MEL, longest)
            m = torch.zeros(len(feats), longest, dtype=torch.long)
            for i, n in enumerate(feats):
                f[i, :, :n] = torch.randn(MEL, n, generator=g)
                m[i, :n] = 1
            out.update(input_features=f, feature_attention_mask=m)
        return out
    if name in ("gemma3", "paligemma"):  # one image a tile; the image tokens are one block (token_type_ids)
        n_tok = GEMMA3_TOKENS if name == "gemma3" else (S // P) ** 2
        count = 0
        for seq in spec:
            ids = [TEXT] * 4
            for _ in seq:
                ids += [VS] + [IMG] * n_tok + [VE, TEXT + 1]
                count += 1
            rows.append(ids + [TEXT + 3] * 3)
        out = _finish(rows)
        out["token_type_ids"] = (out["input_ids"] == IMG).long()
        if name == "paligemma":  # a prefix (images and prompt) seen whole, then the answer
            out["token_type_ids"] = torch.zeros_like(out["input_ids"])
            out["token_type_ids"][:, -3:] = 1
        if count:
            out["pixel_values"] = torch.randn(count, 3, S, S, generator=g)
        return out
    if name == "llava":
        n_tok = (S // P) ** 2
        count = 0
        for seq in spec:
            ids = [TEXT] * 4
            for _ in seq:
                ids += [IMG] * n_tok + [TEXT + 1]
                count += 1
            rows.append(ids + [TEXT + 3] * 3)
        out = _finish(rows)
        if count:
            out["pixel_values"] = torch.randn(count, 3, S, S, generator=g)
        return out
    if name == "llava_next":
        from transformers.models.llava_next.modeling_llava_next import (
            get_anyres_image_grid_shape,
            image_size_to_num_patches,
            unpad_image,
        )

        side = S // P
        sizes, tiles = [], []
        for seq in spec:
            ids = [TEXT] * 4
            for hw in seq:
                n_tiles = image_size_to_num_patches(list(hw), PINPOINTS, S)
                nph, npw = get_anyres_image_grid_shape(list(hw), PINPOINTS, S)
                h, w = unpad_image(torch.empty(1, nph * side, npw * side), list(hw)).shape[1:]
                ids += [IMG] * (side * side + h * (w + 1)) + [TEXT + 1]
                sizes.append(list(hw))
                tiles.append(n_tiles)
            rows.append(ids + [TEXT + 3] * 3)
        out = _finish(rows)
        if sizes:
            out.update(pixel_values=anyres_pixels(tiles, g), image_sizes=torch.tensor(sizes))
        return out
    if name == "qwen2_audio":
        frames = 2 * MSP
        feats = []
        for seq in spec:
            ids = [TEXT] * 4
            for n in seq:
                ids += [AS] + [AUD] * _audio_out_len(n) + [AE, TEXT + 1]
                feats.append(n)
            rows.append(ids + [TEXT + 3] * 3)
        out = _finish(rows)
        if feats:
            f = torch.zeros(len(feats), MEL, frames)
            m = torch.zeros(len(feats), frames, dtype=torch.long)
            for i, n in enumerate(feats):
                f[i, :, :n] = torch.randn(MEL, n, generator=g)
                m[i, :n] = 1
            out.update(input_features=f, feature_attention_mask=m)
        return out
    raise ValueError(name)


def varlen_model(name: str, attn: str = "mmbalance_varlen", seed: int = 0):
    """``build(name, seed)`` with the attention ``attn`` (registering ``mmbalance_varlen``)."""
    from mmbalance.integrations.hf import register_attention

    register_attention()
    model = build(name, seed=seed)
    model.set_attn_implementation(attn)
    return model


@functools.cache
def own_mean_loss(name: str) -> bool:
    """Whether ``name``'s forward computes its loss as a mean over each call on the installed
    release (Gemma 3 before 5.17): its shards' labels are refused."""
    from mmbalance.integrations.hf.compat import loss_takes_token_count

    return name in MODELS and available(name) and not loss_takes_token_count(build(name))


def anyres_pixels(tiles: list[int], g: torch.Generator) -> torch.Tensor:
    """``[images, most tiles, 3, S, S]``: each image's ``tiles`` random tiles, zeros after them (the
    anyres processors pad an image's tiles so)."""
    pv = torch.zeros(len(tiles), max(tiles), 3, S, S)
    for i, t in enumerate(tiles):
        pv[i, :t] = torch.randn(t, 3, S, S, generator=g)
    return pv


def summed_loss(model, batch: dict, count: int):
    """The causal-LM loss of ``batch`` through the stock ``model``: the sum of its token losses
    over ``count`` (a step's labelled tokens), computed here from the logits. The models' own loss
    is not the reference: some releases drop ``num_items_in_batch`` (Qwen3-VL before 5.18) and
    return a per-batch mean."""
    call = {k: v for k, v in batch.items() if k != "labels"}
    logits = model(**call).logits
    labels = batch["labels"][:, 1:].reshape(-1).to(logits.device)
    flat = logits[:, :-1].reshape(-1, logits.shape[-1]).float()
    return torch.nn.functional.cross_entropy(flat, labels, ignore_index=-100, reduction="sum") / count


def collate(batches: list[dict], left=False) -> dict:
    """One padded batch of one-row batches (``batch(name, model, [spec])``), as a processor gives
    it: rows padded on the right (``left=True``: on the left; a list of bools: per row), the media
    of every row in order."""
    width = max(int(b["input_ids"].shape[1]) for b in batches)
    lefts = left if isinstance(left, (list, tuple)) else [left] * len(batches)
    out: dict = {}
    for key in (
        "input_ids",
        "attention_mask",
        "labels",
        "mm_token_type_ids",
        "token_type_ids",
        "moe_mm_token_type_ids",
    ):
        if key not in batches[0]:
            continue
        fill = -100 if key == "labels" else 0
        rows = []
        for b, on_left in zip(batches, lefts):
            t = b[key][0]
            pad = torch.full((width - t.numel(),), fill, dtype=t.dtype)
            rows.append(torch.cat([pad, t]) if on_left else torch.cat([t, pad]))
        out[key] = torch.stack(rows)
    media = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw", "second_per_grid_ts",
             "video_second_per_grid", "image_sizes", "image_position_ids", "video_position_ids",
             "num_frames_per_video")  # fmt: skip
    navit = any("target_sizes" in b or "target_sizes_videos" in b for b in batches)
    for key in media:
        parts = [b[key] for b in batches if key in b and not navit]
        if parts and key == "pixel_values" and "image_sizes" in batches[0] and parts[0].dim() == 4:
            h, w = (
                max(int(p.shape[-2]) for p in parts),
                max(int(p.shape[-1]) for p in parts),
            )  # Mistral 3's sizes
            parts = [
                torch.nn.functional.pad(p, (0, w - int(p.shape[-1]), 0, h - int(p.shape[-2]))) for p in parts
            ]
        if parts and key == "pixel_values" and parts[0].dim() == 5:  # anyres tiles: padded to the most
            most = max(int(p.shape[1]) for p in parts)
            parts = [
                torch.cat([p, p.new_zeros(p.shape[0], most - p.shape[1], *p.shape[2:])], 1) for p in parts
            ]
        if parts:
            out[key] = torch.cat(parts)
    if navit:  # MiniCPM-V: every slice in one row
        more().collate(batches, out)
    clips = [b for b in batches if "input_features" in b]
    if clips:  # audio clips: one row each, frames padded to the longest
        frames = max(int(b["input_features"].shape[-1]) for b in clips)
        for key in ("input_features", "feature_attention_mask"):
            out[key] = torch.cat(
                [torch.nn.functional.pad(b[key], (0, frames - int(b[key].shape[-1]))) for b in clips]
            )
    return out
