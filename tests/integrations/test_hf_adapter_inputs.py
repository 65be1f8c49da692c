"""What the built-in adapters read from a forward's keywords, on real tiny models (one process):
the audio clips and their valid frames, and the vision feature options of the call."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers", minversion="5.6")

from mmbalance.integrations.hf.encoders.models import (  # noqa: E402
    InternVLAdapter,
    LlavaAdapter,
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
