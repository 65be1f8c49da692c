"""What the built-in adapters read from a forward's keywords, on real tiny models (one process):
the audio clips and their valid frames, and the vision feature options of the call."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers", minversion="5.6")

from mmbalance.integrations.hf.encoders.models import (  # noqa: E402
    InternVLAdapter,
    LlavaAdapter,
    LlavaOnevisionAdapter,
    Qwen2AudioAdapter,
    QwenOmniAudioAdapter,
)
from tests.integrations import hf_zoo  # noqa: E402


@pytest.mark.parametrize(
    ("name", "adapter"),
    [("qwen2_audio", Qwen2AudioAdapter), ("qwen2_5_omni", QwenOmniAudioAdapter)],
    ids=["qwen2_audio", "qwen2_5_omni"],
)
def test_audio_clips_and_their_frames(name, adapter):
    model = hf_zoo.build(name).to(torch.float64)
    mel = model.config.audio_config.num_mel_bins
    feats = torch.randn(2, mel, 16)
    mask = torch.zeros(2, 16, dtype=torch.long)
    mask[0, :5], mask[1, :16] = 1, 1
    a = adapter()
    assert a.extract(model, {"input_ids": None}) is None
    assert a.extract(model, {"input_features": feats, "inputs_embeds": torch.zeros(1)}) is None
    with pytest.raises(ValueError, match="feature_attention_mask"):
        a.extract(model, {"input_features": feats})
    kwargs = {"input_features": feats, "feature_attention_mask": mask}
    items = a.extract(model, kwargs)
    assert kwargs["input_features"] is None
    assert items.meta[:, 0].tolist() == [5, 16]
    assert items.payload[0].dtype == torch.float64  # the tower's dtype
    if adapter is QwenOmniAudioAdapter:  # only the valid frames travel, as rows
        assert torch.equal(items.payload[0], torch.cat([feats[0, :, :5].t(), feats[1].t()]).double())
    else:
        assert torch.equal(items.payload[0], feats.double())


@pytest.mark.parametrize(("name", "adapter"), [("llava", LlavaAdapter), ("internvl", InternVLAdapter)])
def test_vision_feature_options_come_from_the_call_else_the_config(name, adapter):
    model = hf_zoo.build(name)
    a = adapter()
    cfg = model.config
    got = a.call_options(model, {})
    assert got == {
        "vision_feature_layer": cfg.vision_feature_layer,
        "vision_feature_select_strategy": cfg.vision_feature_select_strategy,
    }
    assert a.call_options(model, {"vision_feature_layer": -1})["vision_feature_layer"] == -1
    with pytest.raises(ValueError, match="vision_feature_select_strategy"):
        a.call_options(model, {"vision_feature_select_strategy": "bogus"})


def test_onevision_packs_at_the_configs_aspect_ratio_whatever_the_call_says():
    """LLaVA-OneVision's forward takes ``vision_aspect_ratio`` but encodes at the config's (it calls
    ``get_image_features`` without it): the adapter packs the images at the config's too."""
    model = hf_zoo.build("llava_onevision")
    a = LlavaOnevisionAdapter()
    want = model.config.vision_aspect_ratio
    other = "anyres_max_1" if want != "anyres_max_1" else "anyres_max_4"
    assert a.call_options(model, {})["vision_aspect_ratio"] == want
    assert a.call_options(model, {"vision_aspect_ratio": other})["vision_aspect_ratio"] == want


@pytest.mark.parametrize("name", ["glm4v", "qwen2_vl"])
def test_a_whole_video_encodes_to_the_models_own_video_rows(name):
    """``split_frames=False`` keeps a video's frames in one item: its rows are the model's own
    video rows (GLM-4.xV's tower takes one grid row per frame, as its ``get_video_features`` gives
    them; a whole video's grid would index its position table out of range)."""
    from mmbalance.integrations.hf.encoders import adapters_for, core

    model = hf_zoo.build(name).double()
    batch = hf_zoo.batch(name, model, [[("video", 2, 4, 4)]], seed=1)
    (a,) = [x for x in adapters_for(model) if x.encoder == "vision"]
    a.splits_frames = False
    kwargs = {k: (v.double() if torch.is_floating_point(v) else v) for k, v in batch.items()}
    items = a.extract(model, dict(kwargs))
    assert items.meta.shape[0] == 1 and int(items.meta[0, 1]) == 2  # one item, both frames
    (got, *_) = a.encode(model, items.payload, items.meta)
    want = core(model).get_video_features(
        kwargs["pixel_values_videos"], kwargs["video_grid_thw"], return_dict=True
    )
    want = want.pooler_output
    want = torch.cat(list(want)) if isinstance(want, (tuple, list)) else want
    torch.testing.assert_close(torch.cat(list(got)) if isinstance(got, (tuple, list)) else got, want)
