"""Decoders that mix tokens outside softmax attention are refused by name where the integration
cannot run them exactly (``hf/mixers.py``): at ``apply_dynamic_cp`` (read from the model) and at
the first packed forward under ``mmbalance_varlen`` (read from the layer's config), never a wrong
loss without an error.

``test_the_release_has_no_unseen_mixer`` walks every causal-LM and image-text-to-text family of
the installed transformers: a family whose modeling source holds a token mixer (found by markers of
the test's own) must be one the packed-forward check sees, so a hybrid a newer release adds cannot
slip through.
"""

from __future__ import annotations

import os
import re

import pytest
import torch

transformers = pytest.importorskip("transformers", minversion="5.6")

from mmbalance.integrations.hf import apply_dynamic_cp, register_attention  # noqa: E402
from mmbalance.integrations.hf.mixers import config_mixers  # noqa: E402
from tests.integrations.hybrids import HYBRIDS, tiny  # noqa: E402

# the classes that hold the mixers, as each family names them
MIXER_CLASS = {
    "qwen3_5": "Qwen3_5GatedDeltaNet", "qwen3_5_moe": "Qwen3_5MoeGatedDeltaNet",
    "qwen3_next": "Qwen3NextGatedDeltaNet", "olmo_hybrid": "OlmoHybridGatedDeltaNet",
    "minimax": "MiniMaxLightningAttention", "lfm2": "Lfm2ShortConv", "jamba": "JambaMambaMixer",
    "bamba": "BambaMixer", "nemotron_h": "NemotronHMamba2Mixer", "falcon_h1": "FalconH1Mixer",
    "granitemoehybrid": "GraniteMoeHybridMambaLayer", "zamba2": "Zamba2MambaMixer", "mamba2": "Mamba2Mixer",
}  # fmt: skip


def _family(model_type: str):
    from transformers import CONFIG_MAPPING

    if model_type not in CONFIG_MAPPING:
        pytest.skip(f"transformers {transformers.__version__} has no {model_type}")
    return tiny(model_type)


def _packed(n=(5, 9, 4)):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 64, (1, sum(n)), generator=g)
    pos = torch.cat([torch.arange(k) for k in n])[None]
    return {"input_ids": ids, "position_ids": pos, "labels": ids.clone()}


# the Gated DeltaNet layers that run under a shard (cp/linear.py; tests/integrations/test_dynamic_cp.py)
CP_RUNS = {"qwen3_5", "qwen3_5_moe", "qwen3_next", "olmo_hybrid"}


@pytest.mark.parametrize("model_type", sorted(CP_RUNS))
def test_dynamic_cp_takes_the_gated_deltanet_hybrids(model_type):
    from mmbalance.integrations.hf.cp.linear import CP_LINEAR

    model = _family(model_type)
    assert MIXER_CLASS[model_type] in CP_LINEAR
    register_attention()
    model.set_attn_implementation("mmbalance_varlen")
    handle = apply_dynamic_cp(model, max_tokens_per_rank=64)
    layer = next(m for m in model.modules() if type(m).__name__ == MIXER_CLASS[model_type])
    assert "forward" in layer.__dict__  # the layer takes a shard now
    handle.remove()
    assert "forward" not in layer.__dict__


@pytest.mark.parametrize("model_type", sorted(set(HYBRIDS) - CP_RUNS))
def test_dynamic_cp_refuses_a_hybrid_by_its_mixer(model_type):
    model = _family(model_type)
    register_attention()
    model.set_attn_implementation("mmbalance_varlen")
    with pytest.raises(
        ValueError, match=rf"does not run {type(model).__name__}, whose decoder mixes tokens"
    ) as err:
        apply_dynamic_cp(model, max_tokens_per_rank=64)
    assert MIXER_CLASS[model_type] in str(err.value) and "layers 0" in str(err.value), str(err.value)


@pytest.mark.parametrize("model_type", sorted(t for t in HYBRIDS if t != "mamba2"))  # mamba2 has no attention
def test_a_packed_row_is_refused_at_its_first_forward_and_a_padded_batch_runs(model_type):
    model = _family(model_type)
    register_attention()
    model.set_attn_implementation("mmbalance_varlen")
    kinds = config_mixers(model.config)
    assert kinds, model_type
    with pytest.raises(ValueError, match="mixes tokens outside attention") as err:
        model(**_packed(), use_cache=False)
    text = str(err.value)
    assert any(k in text for k in kinds), text
    # GraniteMoeHybrid hands its attention no positions: the row cannot be told from one sequence
    assert "packed rows cannot run exactly" in text or "neither positions, sequence boundaries" in text, text
    # one sequence a row, padded: nothing to keep apart, the model runs as transformers runs it
    ids = _packed()["input_ids"][:, :9].repeat(2, 1)
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    batch = {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}
    assert torch.isfinite(model(**batch, use_cache=False).loss)


def test_a_model_without_mixers_is_left_alone():
    cfg = transformers.Qwen3_5TextConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                         layer_types=["full_attention"] * 2)  # fmt: skip
    assert config_mixers(cfg) == []
    model = transformers.Qwen3_5ForCausalLM(cfg)
    register_attention()
    model.set_attn_implementation("mmbalance_varlen")
    assert torch.isfinite(model(**_packed(), use_cache=False).loss)
    apply_dynamic_cp(model, max_tokens_per_rank=64).remove()


# markers of a token mixer in a modeling file, independent of the library's own detection
_MARKERS = re.compile(
    r"causal_conv1d|selective_scan|gated_delta|delta_rule|short_?conv|ShortConv|lightning_attn|LightningAttention|"
    r"rglru|Rglru|RwkvSelfAttention|Mamba2?Mixer|MambaMixer|ssm_state_size|xLSTM"
)
# the layer types (config.layer_types) other than softmax attention that the installed releases
# have: token mixers, and attention kinds the backend does not run exactly either (refused alike)
_KNOWN_KINDS = {"linear_attention", "conv", "hybrid", "hybrid_sliding", "mamba", "indexed_attention",
                "compressed_sparse_attention", "heavily_compressed_attention", "reference_sliding_attention",
                "deepseek_sparse_attention", "qwen_sparse_attention"}  # fmt: skip


def _families():
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
    )

    base = os.path.dirname(transformers.models.__file__)
    for model_type in sorted(
        set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES) | set(MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)
    ):
        folder = model_type.replace("-", "_")
        path = os.path.join(base, folder, f"modeling_{folder}.py")
        if os.path.exists(path):
            yield model_type, folder, open(path).read()


def test_the_release_has_no_unseen_mixer():
    import importlib

    from transformers import CONFIG_MAPPING

    from mmbalance.integrations.hf import mixers

    unseen, flagged = [], []
    for model_type, folder, source in _families():
        marked = bool(_MARKERS.search(source))
        try:
            base = CONFIG_MAPPING[model_type]()
            text = base.get_text_config() if hasattr(base, "get_text_config") else base
        except Exception:  # noqa: BLE001 - a config that needs arguments, or has two text configs (an
            text = None  # encoder-decoder): its modeling classes speak for it
        module = importlib.import_module(f"transformers.models.{folder}.modeling_{folder}")
        seen = set(config_mixers(text)) if text is not None else set()
        seen |= set(mixers._module_mixers(module.__name__))
        if marked:
            flagged.append(model_type)
            if not seen:
                unseen.append(model_type)
        kinds = set(config_mixers(text)) if text is not None else set()
        if kinds - _KNOWN_KINDS:  # a kind of layer this test has not seen: look at it, then name it here
            unseen.append(f"{model_type} (layer types {sorted(kinds - _KNOWN_KINDS)})")
    assert not unseen, f"token mixers the packed-forward check does not see, or kinds not looked at: {unseen}"
    # the families the issue names are among those found
    assert {"qwen3_5", "qwen3_next", "jamba", "bamba", "nemotron_h", "falcon_h1", "lfm2", "minimax"} <= set(
        flagged
    )
