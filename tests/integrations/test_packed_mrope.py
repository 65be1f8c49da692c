"""Packed rows of M-RoPE vision-language models, and the keywords and configs of the families
released since Qwen3-VL that the integration used to trip on.

* transformers' M-RoPE text models (Qwen2-VL to Qwen3-VL, GLM-4.xV, Ernie-4.5-VL, ...) given 2-D
  ``position_ids`` that restart inside a row (``DataCollatorWithFlattening``) expand them into
  rotary rows and build no packing from them: the sequences attend to each other. Under
  ``keep_sequences_apart`` (which ``balance_trainer`` and ``mmbalance launch`` install) they get
  the ``[4, B, L]`` positions with the text row, and a packed row is each sequence alone under
  ``mmbalance_varlen``, ``sdpa`` and eager alike (outputs and gradients), with the cache the model
  makes by default too (transformers skips the packed mask when it has one: the row runs without);
  GLM-4.5V and Ernie-4.5-VL, whose layers never see the text row, refuse a cache given with a
  packed row by name, and so does every model under an attention whose only packing is the mask.
* LLaVA-OneVision hands ``logits_to_keep`` to every attention call: the backend runs it.
* Gemma 3n keeps one feed-forward width per layer: the default cost model takes their mean.
"""

from __future__ import annotations

import inspect

import pytest
import torch

transformers = pytest.importorskip("transformers", minversion="5.6")

from mmbalance.integrations.hf import ATTENTION_NAME, keep_sequences_apart, register_attention  # noqa: E402
from tests.integrations import hf_zoo  # noqa: E402

register_attention()
TEXT = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256)  # fmt: skip
VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=32, patch_size=2,
              spatial_merge_size=2, temporal_patch_size=2)  # fmt: skip
ROPE = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]}


def _qwen2_vl():
    return hf_zoo.build("qwen2_vl")


def _glm4v():
    cfg = transformers.Glm4vConfig(text_config=dict(TEXT, rope_parameters=dict(ROPE, partial_rotary_factor=1.0)),
                                   vision_config=dict(VISION, image_size=8))  # fmt: skip
    return transformers.Glm4vForConditionalGeneration(cfg)


def _glm4v_moe():
    text = dict(TEXT, moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
                first_k_dense_replace=1, head_dim=8, rope_parameters=dict(ROPE, partial_rotary_factor=1.0))  # fmt: skip
    cfg = transformers.Glm4vMoeConfig(text_config=text, vision_config=dict(VISION, image_size=8))
    return transformers.Glm4vMoeForConditionalGeneration(cfg)


def _ernie_vl_text():
    cfg = transformers.Ernie4_5_VLMoeTextConfig(
        **TEXT, moe_intermediate_size=[32, 32], moe_k=1, moe_num_experts=2, moe_num_shared_experts=0,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=[1, 1, 2]),
    )  # fmt: skip
    return transformers.Ernie4_5_VLMoeTextModel(cfg)


FAMILIES = {
    "qwen2_vl": _qwen2_vl,
    "glm4v": _glm4v,
    "glm4v_moe": _glm4v_moe,
    "ernie4_5_vl_moe": _ernie_vl_text,
}
LENGTHS = [7, 1, 5]


def _out(model, ids, pos=None, **kw):
    got = model(input_ids=ids, position_ids=pos, **({"use_cache": False} if not kw else kw))
    return got.logits if hasattr(got, "logits") else got.last_hidden_state


def _packed_and_alone(model, **kw):
    """A packed row of three sequences (2-D positions restarting) and each sequence alone: the
    outputs and the gradients of a weighted sum (``kw``: the packed call's keywords)."""
    g = torch.Generator().manual_seed(3)
    seqs = [torch.randint(5, 80, (1, n), generator=g) for n in LENGTHS]
    row = torch.cat(seqs, 1)
    pos = torch.cat([torch.arange(n) for n in LENGTHS])[None]
    out = _out(model, row, pos, **kw)
    w = torch.randn(out.shape, generator=g)
    model.zero_grad()
    (out * w).sum().backward()
    packed_grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    alone, at = [], 0
    for s in seqs:
        o = _out(model, s)
        (o * w[:, at : at + s.shape[1]]).sum().backward()
        alone.append(o)
        at += s.shape[1]
    alone_grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
    return out, torch.cat(alone, 1), packed_grads, alone_grads


@pytest.mark.parametrize("attention", [ATTENTION_NAME, "sdpa", "eager"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_packed_row_with_2d_positions_is_each_sequence_alone(family, attention):
    """Without a cache, and with the one the model makes by default (``use_cache`` left out: the
    packed row then runs without one, or transformers would build its mask without the packing)."""
    torch.manual_seed(0)
    model = FAMILIES[family]().float().eval()
    model.set_attn_implementation(attention)
    handle = keep_sequences_apart(model)
    assert handle is not None
    for kw in ({"use_cache": False}, {"use_cache": None}):
        got, want, got_g, want_g = _packed_and_alone(model, **kw)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert got_g.keys() == want_g.keys() and got_g
        for k in want_g:
            torch.testing.assert_close(got_g[k], want_g[k], rtol=1e-4, atol=1e-5, msg=k)
    handle.remove()  # transformers alone: the sequences run into one another
    got, want, _, _ = _packed_and_alone(model)
    assert (got - want).abs().max() > 1e-3


@pytest.mark.parametrize(("family", "text_model"), [("glm4v_moe", "Glm4vMoeTextModel"),
                                                     ("ernie4_5_vl_moe", "Ernie4_5_VLMoeTextModel")])  # fmt: skip
def test_a_cache_given_with_a_packed_row_is_refused_where_the_layers_cannot_see_the_packing(
    family, text_model
):
    """GLM-4.5V's and Ernie-4.5-VL's text models hand their layers the rotary rows: with a cache
    (which makes transformers build its mask without the packing) their attention cannot tell the
    sequences apart, so a cache given with a packed row is refused by name, in either form of
    positions, under ``mmbalance_varlen`` too; without one the row runs (the test above), as do one
    sequence a row and padded rows with it."""
    from mmbalance.integrations.hf.mixers import _rotary_rows_to_layers

    torch.manual_seed(0)
    model = FAMILIES[family]().eval()
    model.set_attn_implementation(ATTENTION_NAME)
    keep_sequences_apart(model)
    text = next(m for m in model.modules() if type(m).__name__ == text_model)
    assert _rotary_rows_to_layers(type(text))
    cfg = getattr(model.config, "text_config", model.config)
    key = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    row = torch.randint(5, 80, (1, 12))
    pos = torch.cat([torch.arange(7), torch.arange(5)])[None]
    for given in (pos, torch.cat([pos[None]] * 4)):
        with pytest.raises(
            ValueError, match=rf"packed rows .* with a cache in {text_model}: .*use_cache=False"
        ):
            model(input_ids=row, position_ids=given, **{key: transformers.DynamicCache(config=cfg)})
    assert _out(model, row, **{key: transformers.DynamicCache(config=cfg)}).shape[:2] == (1, 12)
    mask = torch.ones(1, 12, dtype=torch.long)
    mask[0, :3] = 0
    assert torch.isfinite(_out(model, row, attention_mask=mask, use_cache=True)).all()


def test_the_models_whose_layers_get_the_text_row_are_told_from_their_source():
    """Every M-RoPE text model of the installed release whose forward takes ``[4, B, L]`` rows is
    read as handing its layers the text row or not: GLM-4.5V and Ernie-4.5-VL not, Qwen2-VL,
    Qwen2.5-VL, Qwen3-VL, GLM-4.1V and Qwen3.5 do."""
    import importlib

    from mmbalance.integrations.hf.mixers import ROTARY_ROWS_TO_LAYERS, _rotary_rows_to_layers

    names = {"qwen2_vl": "Qwen2VLTextModel", "qwen2_5_vl": "Qwen2_5_VLTextModel", "qwen3_vl": "Qwen3VLTextModel",
             "glm4v": "Glm4vTextModel", "qwen3_5": "Qwen3_5TextModel", "glm4v_moe": "Glm4vMoeTextModel",
             "ernie4_5_vl_moe": "Ernie4_5_VLMoeTextModel"}  # fmt: skip
    for module, name in names.items():
        cls = getattr(importlib.import_module(f"transformers.models.{module}.modeling_{module}"), name, None)
        if cls is None:
            continue
        assert _rotary_rows_to_layers(cls) == (name in ROTARY_ROWS_TO_LAYERS), name
        if name in ROTARY_ROWS_TO_LAYERS:  # the source says so too, without the names
            src = inspect.getsource(cls.forward)
            assert "position_ids=text_position_ids" not in src.split("decoder_layer(")[-1].split(")")[0], name


def _onevision():
    text = transformers.Qwen2Config(**TEXT)
    vision = transformers.SiglipVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                             num_attention_heads=2, image_size=28, patch_size=14)  # fmt: skip
    cfg = transformers.LlavaOnevisionConfig(text_config=text, vision_config=vision, image_token_index=90,
                                            video_token_index=91, image_grid_pinpoints=[[28, 28]],
                                            vision_feature_layer=-1)  # fmt: skip
    return transformers.LlavaOnevisionForConditionalGeneration(cfg).eval()


def test_llava_onevision_runs_on_the_backend_as_on_sdpa():
    """Its forward hands ``logits_to_keep`` to every attention call (nothing about attention)."""
    torch.manual_seed(0)
    model = _onevision()
    text = torch.randint(3, 80, (1, 12))
    image = torch.cat([torch.full((1, 10), 90), torch.randint(3, 80, (1, 8))], 1)  # base + 1 crop: 10 tokens
    inputs = [dict(input_ids=text),
              dict(input_ids=image, pixel_values=torch.randn(1, 2, 3, 28, 28), image_sizes=torch.tensor([[28, 28]]))]  # fmt: skip
    for kw in inputs:
        model.set_attn_implementation("sdpa")
        want = model(**kw).logits
        model.set_attn_implementation(ATTENTION_NAME)
        got = model(**kw, logits_to_keep=0).logits
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert model(input_ids=text, logits_to_keep=1).logits.shape == (1, 1, 96)


def test_a_per_layer_feed_forward_width_prices_as_its_mean():
    from mmbalance.integrations.hf.cp.plan import cost_model_of

    per_layer = transformers.Gemma3nTextConfig(
        vocab_size=64, hidden_size=32, intermediate_size=[64, 96], num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, layer_types=["sliding_attention", "full_attention"],
        num_kv_shared_layers=0, altup_num_inputs=2, laurel_rank=4, hidden_size_per_layer_input=8,
        vocab_size_per_layer_input=64, activation_sparsity_pattern=[0.0, 0.0],
    )  # fmt: skip
    model = transformers.Gemma3nForCausalLM(per_layer)
    got = cost_model_of(model, "quadratic")
    per_layer.intermediate_size = 80  # the mean, as one width
    assert got == cost_model_of(model, "quadratic")
    per_layer.intermediate_size = 64
    assert got != cost_model_of(model, "quadratic")


# the vision-language families since Qwen3-VL (tests/integrations/hf_zoo.py), their language models
# given a packed row of text sequences with the collator's 2-D positions
SINCE_QWEN3_VL = ("gemma3", "glm46v", "kimi_k25", "llava_onevision", "mistral3", "qwen3_omni_moe", "gemma4",
                  "minicpmv4_6", "minicpmv4_7", "minicpm_ocr", "molmo2")  # fmt: skip


@pytest.mark.slow  # 10 models, about 60 s: the newest release (their packing is transformers' own mask)
@pytest.mark.parametrize("name", SINCE_QWEN3_VL)
def test_a_packed_row_of_a_newer_family_is_each_sequence_alone_under_sdpa(name):
    """Under ``mmbalance_varlen`` (and ``keep_sequences_apart`` where the model needs it), the packed
    row's logits and the gradients of a weighted sum equal each sequence alone through the stock
    model under ``sdpa`` (1e-5)."""
    if not hf_zoo.available(name):
        pytest.skip(f"transformers {transformers.__version__} has no {name}")
    model, ref = hf_zoo.build(name, seed=4).eval(), hf_zoo.build(name, seed=4).eval()
    if name == "gemma4":  # its tiny model's float32 rounding alone reaches 1e-5 (hf_zoo.py): float64
        model, ref = model.double(), ref.double()
    model.set_attn_implementation(ATTENTION_NAME)
    ref.set_attn_implementation("sdpa")
    handle = keep_sequences_apart(model)
    g = torch.Generator().manual_seed(5)
    seqs = [torch.randint(5, 80, (1, n), generator=g) for n in LENGTHS]
    pos = torch.cat([torch.arange(n) for n in LENGTHS])[None]
    out = _out(model, torch.cat(seqs, 1), pos)
    w = torch.randn(out.shape, generator=g, dtype=out.dtype)
    (out * w).sum().backward()
    alone, at = [], 0
    for s in seqs:
        o = _out(ref, s)
        (o * w[:, at : at + s.shape[1]]).sum().backward()
        alone.append(o)
        at += s.shape[1]
    torch.testing.assert_close(out, torch.cat(alone, 1), rtol=1e-5, atol=1e-5)
    got = dict(model.named_parameters())
    checked = 0
    for k, p in ref.named_parameters():
        if p.grad is None:
            continue
        # element by element, or relative to the tensor's norm where its entries are large (Gemma 4's
        # unit-scale weights)
        err = float((got[k].grad - p.grad).norm() / p.grad.norm().clamp_min(1e-12))
        assert torch.allclose(got[k].grad, p.grad, rtol=1e-4, atol=1e-5) or err <= 1e-5, (k, err)
        checked += 1
    assert checked
    if handle is not None:
        handle.remove()


def test_molmo2_images_in_a_packed_row_are_refused_by_name():
    """Molmo2 makes all image tokens of a row one bidirectional block: in a packed row the images
    of different sequences would see one another, so the backend refuses the row (by what it does
    not implement) instead of running it."""
    if not hf_zoo.available("molmo2"):
        pytest.skip(f"transformers {transformers.__version__} has no Molmo2")
    register_attention()
    model = hf_zoo.build("molmo2", seed=4).eval()
    model.set_attn_implementation(ATTENTION_NAME)
    keep_sequences_apart(model)
    rows = [
        hf_zoo.batch("molmo2", model, [[spec]], seed=7 + i) for i, spec in enumerate([(1, 2, 1), (2, 2, 2)])
    ]
    first = (
        rows[0]["pixel_values"].shape[0] * rows[0]["pixel_values"].shape[1]
    )  # the second image's patches follow
    pool = rows[1]["image_token_pooling"]
    packed = dict(
        input_ids=torch.cat([r["input_ids"] for r in rows], 1),
        mm_token_type_ids=torch.cat([r["mm_token_type_ids"] for r in rows], 1),
        position_ids=torch.cat([torch.arange(r["input_ids"].shape[1]) for r in rows])[None],
        pixel_values=torch.cat([r["pixel_values"] for r in rows]),
        image_token_pooling=torch.cat(
            [rows[0]["image_token_pooling"], torch.where(pool >= 0, pool + first, pool)]
        ),
        image_grids=torch.cat([r["image_grids"] for r in rows]),
        image_num_crops=torch.cat([r["image_num_crops"] for r in rows]),
    )
    with pytest.raises(ValueError, match="bidirectional blocks that are not contiguous"), torch.no_grad():
        model(**packed)
    with torch.no_grad():  # one sequence with one image runs
        model(**{k: v for k, v in rows[0].items() if k not in ("labels", "attention_mask")})


@pytest.mark.parametrize("family", sorted(set(FAMILIES) - {"glm4v_moe", "ernie4_5_vl_moe"}))
def test_a_cache_given_with_a_packed_row_runs_only_where_the_attention_reads_the_positions(family):
    """With a cache transformers builds its mask without the packing: under ``sdpa`` and eager,
    whose only packing is the mask, a cache given with a packed row is refused by name; under
    ``mmbalance_varlen``, which reads the packing from the text row, the row is each sequence alone."""
    torch.manual_seed(0)
    model = FAMILIES[family]().float().eval()
    keep_sequences_apart(model)
    key = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    cfg = getattr(model.config, "text_config", model.config)
    for attention in ("sdpa", "eager"):
        model.set_attn_implementation(attention)
        with pytest.raises(
            ValueError, match=rf"packed rows .* with a cache in .* under attn_implementation='{attention}'"
        ):
            _packed_and_alone(model, **{key: transformers.DynamicCache(config=cfg)})
    model.set_attn_implementation(ATTENTION_NAME)
    got, want, got_g, want_g = _packed_and_alone(model, **{key: transformers.DynamicCache(config=cfg)})
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for k in want_g:
        torch.testing.assert_close(got_g[k], want_g[k], rtol=1e-4, atol=1e-5, msg=k)
