"""``"mmbalance_varlen"`` in encoders and encoder-decoders, and in multimodal decoders.

BERT (a padded batch, bidirectional) and BART (a padded encoder under the decoder's
cross-attention, decoders longer and shorter than their encoder) must match eager in the outputs
at every real token and in every gradient; T5's relative ``position_bias`` is refused by name;
Qwen2-VL's and Ernie-4.5-VL's 3-D M-RoPE ``position_ids`` (text row first, ``[4, B, L]``) mark
packed sequences by the text row, as transformers reads them, and plain ``[3, B, L]`` ones do not;
Gemma3's image tokens attend to each other in both directions, and so does PaliGemma's prefix
in a padded batch.
"""

from __future__ import annotations

import copy
import re

import pytest
import torch

transformers = pytest.importorskip("transformers", minversion="5.6")

from mmbalance.integrations.hf import ATTENTION_NAME, register_attention  # noqa: E402

VOCAB = 64


def _pair(cfg, cls):
    register_attention()
    torch.manual_seed(0)
    ref = cls._from_config(copy.deepcopy(cfg), attn_implementation="eager").float().eval()
    mine = cls._from_config(copy.deepcopy(cfg), attn_implementation=ATTENTION_NAME).float().eval()
    mine.load_state_dict(ref.state_dict())
    # the reference must not run the backend under test (a shared config object would make it)
    assert not any(getattr(getattr(m, "config", None), "_attn_implementation", None) == ATTENTION_NAME
                   for m in ref.modules())  # fmt: skip
    return ref, mine


def _padded(lens, width, seed, side="right"):
    g = torch.Generator().manual_seed(seed)
    ids = torch.zeros(len(lens), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lens):
        sl = slice(0, n) if side == "right" else slice(width - n, width)
        ids[i, sl] = torch.randint(3, VOCAB, (n,), generator=g)
        mask[i, sl] = 1
    return ids, mask


def _assert_grads(mine, ref):
    for (n, a), (_, b) in zip(mine.named_parameters(), ref.named_parameters()):
        if b.grad is None:
            continue
        assert a.grad is not None, f"{n} got no gradient"
        # element by element, or relative to the norm where gradients reach 1e6 (Gemma3's projection)
        err = float((a.grad - b.grad).norm() / b.grad.norm().clamp_min(1e-6))
        close = torch.allclose(a.grad, b.grad, rtol=1e-4, atol=1e-5)
        assert close or err < 1e-5, f"{n}: relative gradient error {err:.2e}"


@pytest.mark.parametrize("side", ["right", "left"])
def test_bert_padded_batch(side):
    cfg = transformers.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=64, max_position_embeddings=64)  # fmt: skip
    ref, mine = _pair(cfg, transformers.BertModel)
    ids, mask = _padded([7, 3, 10], 10, 1, side)
    w = torch.randn(3, 10, 32, generator=torch.Generator().manual_seed(2)) * mask[..., None]
    outs = []
    for m in (mine, ref):
        h = m(input_ids=ids, attention_mask=mask).last_hidden_state
        (h * w).sum().backward()
        outs.append(h[mask.bool()])
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)
    _assert_grads(mine, ref)


@pytest.mark.parametrize("dec_len", [4, 13])
def test_bart_cross_attention_with_a_padded_encoder(dec_len):
    cfg = transformers.BartConfig(vocab_size=VOCAB, d_model=32, encoder_layers=1, decoder_layers=1,
                                  encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
                                  decoder_ffn_dim=64, max_position_embeddings=64, pad_token_id=0, bos_token_id=1,
                                  eos_token_id=2, decoder_start_token_id=2, forced_eos_token_id=None)  # fmt: skip
    ref, mine = _pair(cfg, transformers.BartForConditionalGeneration)
    ids, mask = _padded([7, 3, 10], 10, 3)
    dec, dec_mask = _padded([dec_len, max(dec_len - 2, 1), dec_len], dec_len, 4)
    w = torch.randn(3, dec_len, VOCAB, generator=torch.Generator().manual_seed(5)) * dec_mask[..., None]
    outs = []
    for m in (mine, ref):
        lg = m(
            input_ids=ids, attention_mask=mask, decoder_input_ids=dec, decoder_attention_mask=dec_mask
        ).logits
        (lg * w).sum().backward()
        outs.append(lg[dec_mask.bool()])
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)
    _assert_grads(mine, ref)
    with torch.no_grad():
        kw = dict(max_new_tokens=5, do_sample=False, num_beams=1)
        a = mine.generate(ids, attention_mask=mask, **kw)
        b = ref.generate(ids, attention_mask=mask, **kw)
    assert torch.equal(a, b)


def test_t5_relative_position_bias_is_refused():
    cfg = transformers.T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4,
                                relative_attention_num_buckets=8, decoder_start_token_id=0)  # fmt: skip
    _, mine = _pair(cfg, transformers.T5ForConditionalGeneration)
    ids, mask = _padded([5, 3], 5, 6)
    # T5 calls the attention function from transformers 5.15 on (refused there for its bias); before,
    # it computes attention itself from the mask (refused when it reads the mask)
    with pytest.raises(
        (ValueError, TypeError),
        match="mmbalance_varlen( does not implement an additive attention bias .*T5|: its attention mask "
        "description cannot be indexed .*reads the mask itself)",
    ):
        mine(input_ids=ids, attention_mask=mask, decoder_input_ids=ids[:, :3])


def _qwen2_vl():
    cfg = transformers.Qwen2VLConfig(
        text_config=dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=[2, 1, 1])),
        vision_config=dict(depth=1, embed_dim=32, hidden_size=32, num_heads=4, mlp_ratio=2, patch_size=14,
                           spatial_merge_size=2, in_channels=3, temporal_patch_size=2),
        image_token_id=60, video_token_id=61, vision_start_token_id=62, vision_end_token_id=63,
    )  # fmt: skip
    return _pair(cfg, transformers.Qwen2VLForConditionalGeneration)


@pytest.fixture(scope="module")
def qwen2_vl():
    return _qwen2_vl()


def test_qwen2_vl_packed_rows_with_3d_position_ids(qwen2_vl):
    """``[4, B, L]``: row 0 (text positions) marks the sequences; the M-RoPE rows differ from it
    (as for image tokens) and must not split anything."""
    ref, mine = qwen2_vl
    rows = [[5, 1, 9], [3, 12]]
    g = torch.Generator().manual_seed(7)
    seqs = [[torch.randint(3, 60, (n,), generator=g) for n in row] for row in rows]
    ids = torch.stack([torch.cat(r) for r in seqs])
    text = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in rows])
    # M-RoPE rows: the text positions, with a plateau (as image tokens have) inside the 9 and 12 tokens
    mrope = text.clone()
    mrope[0, 9:12] = mrope[0, 8]
    mrope[1, 6:10] = mrope[1, 5]
    pos = torch.stack([text, mrope, mrope, mrope])
    w = torch.randn(*ids.shape, VOCAB, generator=torch.Generator().manual_seed(8))
    mine.zero_grad(), ref.zero_grad()
    out = mine(input_ids=ids, position_ids=pos, use_cache=False).logits
    (out * w).sum().backward()
    want = []
    for r, row in enumerate(seqs):
        at = 0
        for s in row:
            p = pos[:, r : r + 1, at : at + len(s)]
            lg = ref(input_ids=s[None], position_ids=p[1:], use_cache=False).logits[0]
            (lg * w[r, at : at + len(s)]).sum().backward()
            want.append(lg)
            at += len(s)
    torch.testing.assert_close(out.reshape(-1, VOCAB), torch.cat(want), rtol=1e-5, atol=1e-5)
    _assert_grads(mine, ref)


def test_qwen2_vl_3d_position_ids_without_text_row_are_one_sequence(qwen2_vl):
    ref, mine = qwen2_vl
    ids = torch.randint(3, 60, (2, 11), generator=torch.Generator().manual_seed(9))
    pos = torch.arange(11).repeat(3, 2, 1)
    pos[1:, :, 4:7] = 3  # an image-like plateau: no restart
    with torch.no_grad():
        a = mine(input_ids=ids, position_ids=pos, use_cache=False).logits
        b = ref(input_ids=ids, position_ids=pos, use_cache=False).logits
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def _gemma3_mm(window: int = 3):
    text = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        sliding_window=window,
        query_pre_attn_scalar=8,
        layer_types=["sliding_attention", "full_attention"],
        max_position_embeddings=128,
    )
    vision = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        image_size=28,
        patch_size=14,
    )
    cfg = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                                    boi_token_index=61, eoi_token_index=62, image_token_index=60)  # fmt: skip
    return _pair(cfg, transformers.Gemma3ForConditionalGeneration)


# Gemma 3's sliding layers: early 5.x releases compose (causal AND window) OR image block, later
# ones (causal OR image block) AND window: the same keys while no image is longer than the window
# reaches back, which is what the varlen op runs (test_hf_attention_masks reads both forms)
_REFUSED_LONG_IMAGE = "mmbalance_varlen .*an image block longer than the sliding window"


@pytest.mark.parametrize("window", [3, 4], ids=["window3_shorter_than_an_image", "window4"])
def test_gemma3_image_tokens_attend_bidirectionally(window):
    """Gemma3 with images: the image tokens of one image see each other in both directions (the
    ``block_sequence_ids`` union), under the sliding window in the sliding layers; outputs and
    every gradient (vision tower included) match eager, and so does generation. Where the installed
    transformers lets an image reach past the window (its early releases), an image of 4 tokens
    under a window of 3 is refused by name; one no longer than the window runs on every release."""
    ref, mine = _gemma3_mm(window)
    g = torch.Generator().manual_seed(11)
    img = [61, 60, 60, 60, 60, 62]
    rows = [[5, 7, *img, 9, 10, 11], [*img, 3, 4, 5, 6, 8]]
    ids = torch.tensor(rows)
    tt = (ids == 60).long()
    pixels = torch.randn(2, 3, 28, 28, generator=g)
    w = torch.randn(*ids.shape, VOCAB, generator=g)
    outs = []
    for m in (mine, ref):
        try:
            lg = m(input_ids=ids, pixel_values=pixels, token_type_ids=tt, use_cache=False).logits
        except ValueError as exc:
            assert m is mine and window < 4 and re.search(_REFUSED_LONG_IMAGE, str(exc)), exc
            return
        (lg * w).sum().backward()
        outs.append(lg)
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)
    _assert_grads(mine, ref)
    with torch.no_grad():
        kw = dict(max_new_tokens=4, do_sample=False, pad_token_id=0, eos_token_id=None)
        a = mine.generate(ids, pixel_values=pixels, token_type_ids=tt, **kw)
        b = ref.generate(ids, pixel_values=pixels, token_type_ids=tt, **kw)
    assert torch.equal(a, b)


def test_ernie_4_5_vl_packed_rows_with_3d_position_ids():
    """Ernie-4.5-VL's text model hands its layers the three M-RoPE rows and builds the mask from
    the text row: packed rows split where the text row restarts, every gradient included."""
    cfg = transformers.Ernie4_5_VLMoeTextConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, moe_intermediate_size=[32, 32], moe_k=1,
        moe_num_experts=2, moe_num_shared_experts=0,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=[1, 1, 2]),
    )  # fmt: skip
    ref, mine = _pair(cfg, transformers.Ernie4_5_VLMoeTextModel)
    rows = [[5, 1, 9], [3, 12]]
    ids = torch.randint(3, 60, (2, 15), generator=torch.Generator().manual_seed(12))
    text = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in rows])
    mrope = text.clone()
    mrope[0, 9:12] = mrope[0, 8]  # an image-like plateau inside the 9-token sequence
    pos = torch.stack([text, mrope, mrope, mrope])
    w = torch.randn(2, 15, 32, generator=torch.Generator().manual_seed(13))
    out = mine(input_ids=ids, position_ids=pos, use_cache=False).last_hidden_state
    (out * w).sum().backward()
    want = []
    for r, row in enumerate(rows):
        at = 0
        for n in row:
            h = ref(input_ids=ids[r : r + 1, at : at + n], position_ids=pos[1:, r : r + 1, at : at + n],
                    use_cache=False).last_hidden_state[0]  # fmt: skip
            (h * w[r, at : at + n]).sum().backward()
            want.append(h)
            at += n
    torch.testing.assert_close(out.reshape(-1, 32), torch.cat(want), rtol=1e-5, atol=1e-5)
    _assert_grads(mine, ref)


@pytest.mark.parametrize("side", ["right", "left"])
def test_paligemma_prefix_attends_bidirectionally_in_a_padded_batch(side):
    """PaliGemma: each row's prefix (image and prompt, ``token_type_ids`` 0) is one bidirectional
    block; its processor marks padding 0 as well, which is no key of the block: a padded batch
    matches eager at every real token and in every gradient, padded on either side. A packed row
    equals each sequence alone, or is refused by name where the model makes its prefixes one
    block."""
    from tests.integrations import hf_zoo

    register_attention()
    ref = hf_zoo.build("paligemma")
    ref.set_attn_implementation("eager")
    mine = hf_zoo.build("paligemma")
    mine.set_attn_implementation(ATTENTION_NAME)
    rows = [hf_zoo.batch("paligemma", ref, [spec], seed=i) for i, spec in enumerate([[1], [1, 1]])]
    batch = hf_zoo.collate(rows, left=side == "left")
    real = batch["attention_mask"].bool()
    assert not bool(batch["token_type_ids"][~real].any())  # padding marked 0, as the prefix
    w = torch.randn(*batch["input_ids"].shape, ref.config.text_config.vocab_size,
                    generator=torch.Generator().manual_seed(3)) * real[..., None]  # fmt: skip
    outs = []
    for m in (mine, ref):
        lg = m(**{k: v for k, v in batch.items() if k != "labels"}, use_cache=False).logits
        (lg * w).sum().backward()
        outs.append(lg[real])
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)
    _assert_grads(mine, ref)
    # a packed row: refused by name where the release's mask makes all its prefixes one block, each
    # sequence alone where it keeps them apart
    keys = ("input_ids", "token_type_ids", "pixel_values")
    packed = {k: torch.cat([r[k] for r in rows], dim=1) for k in ("input_ids", "token_type_ids")}
    packed["position_ids"] = torch.cat([torch.arange(int(r["input_ids"].shape[1])) for r in rows])[None]
    packed["pixel_values"] = torch.cat([r["pixel_values"] for r in rows])
    with torch.no_grad():
        try:
            got = mine(**packed, use_cache=False).logits
        except ValueError as exc:
            assert "mmbalance_varlen does not implement bidirectional blocks that are not contiguous" in str(
                exc
            )
            return
        want = torch.cat([ref(**{k: r[k] for k in keys}, use_cache=False).logits for r in rows], dim=1)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
