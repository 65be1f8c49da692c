"""``"mmbalance_varlen"`` in cross-attention: queries of one sequence over the keys of another.

A module without ``is_causal`` (Mllama's cross-attention) or with ``is_causal=False`` (Whisper's,
BART's) is bidirectional; causal bottom-right alignment is for self-attention over a cache (fewer
queries than keys) or explicit ``cu_seq_lens``, and a causal call with more queries than keys is
refused rather than leaving the first queries without keys. Mllama's cross-attention layers
(with and without its 4-D ``cross_attention_mask``) and Whisper's decoder (cross-attention
without a mask, before and after a cache) must match eager in the logits and every gradient.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

transformers = pytest.importorskip("transformers", minversion="5.6")

from mmbalance.integrations.hf import ATTENTION_NAME, register_attention  # noqa: E402
from mmbalance.integrations.hf.attention import varlen_attention  # noqa: E402

VOCAB = 64
H, HKV, D = 4, 2, 8


def _pair(cfg, cls):
    register_attention()
    torch.manual_seed(0)
    ref = cls._from_config(copy.deepcopy(cfg), attn_implementation="eager").float().eval()
    mine = cls._from_config(copy.deepcopy(cfg), attn_implementation=ATTENTION_NAME).float().eval()
    with torch.no_grad():  # gates and scales initialised to 0 would hide the cross-attention
        for name, p in ref.named_parameters():
            if name.endswith("_gate"):
                p.fill_(0.8)
    mine.load_state_dict(ref.state_dict())
    assert not any(getattr(getattr(m, "config", None), "_attn_implementation", None) == ATTENTION_NAME
                   for m in ref.modules())  # fmt: skip
    return ref, mine


def _assert_grads(mine, ref):
    for (n, a), (_, b) in zip(mine.named_parameters(), ref.named_parameters()):
        if b.grad is None:
            assert a.grad is None or not a.grad.any(), n
            continue
        assert a.grad is not None, f"{n} got no gradient"
        err = float((a.grad - b.grad).norm() / b.grad.norm().clamp_min(1e-6))
        assert torch.allclose(a.grad, b.grad, rtol=1e-4, atol=1e-5) or err < 1e-5, f"{n}: error {err:.2e}"


def _dense(q, k, v, allowed, scale):
    """float64 attention under a boolean ``[B, Lq, Lk]`` mask; a row with no key gives 0."""
    q, k, v = (t.double() for t in (q, k, v))
    k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], 1) for t in (k, v))
    s = torch.einsum("bhqd,bhkd->bhqk", q, k) * scale
    p = torch.softmax(s.masked_fill(~allowed[:, None], -math.inf), -1).nan_to_num(0.0)
    return torch.einsum("bhqk,bhkd->bqhd", p, v)


def test_call_semantics_without_a_mask():
    """9 queries over 6 keys, no mask: bidirectional for a module without ``is_causal`` (the case
    that returned zeros for the first queries) and for ``is_causal=False``, in the module or the
    call; causal with fewer queries than keys is bottom-right (a cache); causal with more is refused."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, H, 9, D, generator=g)
    k = torch.randn(2, HKV, 6, D, generator=g)
    v = torch.randn(2, HKV, 6, D, generator=g)
    every = torch.ones(2, 9, 6, dtype=torch.bool)
    plain, off, on = torch.nn.Module(), torch.nn.Module(), torch.nn.Module()
    off.is_causal, on.is_causal = False, True
    for module, kw in ((plain, {}), (off, {}), (on, {"is_causal": False})):
        out, _ = varlen_attention(module, q, k, v, None, scaling=0.3, **kw)
        torch.testing.assert_close(out.double(), _dense(q, k, v, every, 0.3), rtol=1e-5, atol=1e-5)
    with pytest.raises(
        ValueError, match=f"{ATTENTION_NAME}: causal attention with more queries \\(9\\) than keys"
    ):
        varlen_attention(on, q, k, v, None, scaling=0.3)
    with pytest.raises(ValueError, match="more queries"):
        varlen_attention(plain, q, k, v, None, scaling=0.3, is_causal=True)
    cached = torch.ones(4, 6, dtype=torch.bool).tril(2)[None].expand(2, -1, -1)  # query i sees keys <= i + 2
    out, _ = varlen_attention(on, q[:, :, :4], k, v, None, scaling=0.3)
    torch.testing.assert_close(out.double(), _dense(q[:, :, :4], k, v, cached, 0.3), rtol=1e-5, atol=1e-5)


def test_four_d_masks_by_rows_of_key_runs():
    """A 4-D mask handed to the attention function: boolean or additive (0 / -inf / the dtype's
    minimum), batch and query dims broadcast; each query sees its own keys; values other than
    0 and -inf, per-head masks and three runs of keys in a row are refused by name."""
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, H, 5, D, generator=g)
    k = torch.randn(2, HKV, 7, D, generator=g)
    allowed = torch.zeros(2, 5, 7, dtype=torch.bool)
    allowed[0, :2, :3] = True  # one run
    allowed[0, 2:4, [0, 1, 5, 6]] = True  # two runs
    allowed[0, 4] = False  # no key
    allowed[1] = torch.rand(5, 7, generator=g) < 2  # every key
    allowed[1, 3, 2:] = False
    module = torch.nn.Module()
    want = _dense(q, k, k, allowed, 0.3)
    for mask in (
        allowed[:, None],
        torch.zeros(2, 1, 5, 7).masked_fill(~allowed[:, None], -math.inf),
        torch.zeros(2, 1, 5, 7).masked_fill(~allowed[:, None], torch.finfo(torch.float32).min),
    ):
        out, _ = varlen_attention(module, q, k, k, mask, scaling=0.3)
        torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
    one = allowed[1:2, 3:4, None]  # [1, 1, 1, 7]: every row, every query
    out, _ = varlen_attention(module, q, k, k, one, scaling=0.3)
    torch.testing.assert_close(
        out.double(), _dense(q, k, k, one[:, 0].expand(2, 5, 7), 0.3), rtol=1e-5, atol=1e-5
    )
    name = f"{ATTENTION_NAME} cannot run this attention mask"
    with pytest.raises(ValueError, match=f"{name}: a 4-D mask with additive values other than 0"):
        varlen_attention(module, q, k, k, torch.randn(2, 1, 5, 7), scaling=0.3)
    with pytest.raises(ValueError, match=f"{name}: a 4-D mask with one mask per head"):
        varlen_attention(module, q, k, k, allowed[:, None].expand(2, H, 5, 7), scaling=0.3)
    three = allowed.clone()
    three[0, 0] = torch.tensor([1, 0, 1, 0, 1, 0, 0], dtype=torch.bool)
    with pytest.raises(ValueError, match=f"{name}: a 4-D mask whose row 0, query 0 sees 3 separate runs"):
        varlen_attention(module, q, k, k, three[:, None], scaling=0.3)


def _mllama():
    cfg = transformers.MllamaTextConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, cross_attention_layers=[1],
                                        max_position_embeddings=128, pad_token_id=0, bos_token_id=1,
                                        eos_token_id=2)  # fmt: skip
    return _pair(cfg, transformers.MllamaForCausalLM)


@pytest.mark.parametrize("with_mask", [False, True], ids=["no-mask", "cross_attention_mask"])
def test_mllama_cross_attention_layers(with_mask):
    """Mllama's text model with image states (2 rows of 9 tokens over 2 images x 2 tiles x 3
    vision tokens): without a mask every token sees every image token; with Mllama's own
    ``cross_attention_mask`` (prepared by transformers' ``_prepare_cross_attention_mask`` into a
    4-D additive mask) tokens before an image see no tile (Mllama then lets them see all, and
    zeroes their MLP), later ones one or two images, some tiles missing (two runs of keys)."""
    from transformers.models.mllama.modeling_mllama import _prepare_cross_attention_mask

    ref, mine = _mllama()
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(3, VOCAB, (2, 9), generator=g)
    states = torch.randn(2, 12, 32, generator=g)
    kw = {}
    if with_mask:
        cm = torch.zeros(2, 9, 2, 2, dtype=torch.long)
        cm[0, 3:, 0, :] = 1  # image 0 (both tiles) from token 3
        cm[0, 6:, 1, 0] = 1  # and image 1's first tile from token 6: keys 0-8
        cm[1, 1:, 0, 0] = 1  # image 0's first tile ...
        cm[1, 5:, 1, 0] = 1  # ... and image 1's first tile: keys 0-2 and 6-8
        mask, rows = _prepare_cross_attention_mask(cm, num_vision_tokens=3, dtype=torch.float32)
        kw = dict(cross_attention_mask=mask, full_text_row_masked_out_mask=rows)
    w = torch.randn(2, 9, VOCAB, generator=g)
    outs = []
    for m in (mine, ref):
        m.zero_grad()
        lg = m(input_ids=ids, cross_attention_states=states, use_cache=False, **kw).logits
        (lg * w).sum().backward()
        outs.append(lg)
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)
    _assert_grads(mine, ref)
    # the cross-attention changes the logits (so a wrong attention could not pass unseen)
    with torch.no_grad():
        alone = ref(input_ids=ids, use_cache=False).logits
    assert (alone - outs[1]).abs().max() > 1e-2


def _whisper():
    cfg = transformers.WhisperConfig(vocab_size=VOCAB, num_mel_bins=8, d_model=32, encoder_layers=1, decoder_layers=1,
                                     encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
                                     decoder_ffn_dim=64, max_source_positions=6, max_target_positions=32,
                                     pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1)  # fmt: skip
    return _pair(cfg, transformers.WhisperForConditionalGeneration)


def test_whisper_decoder_cross_attention():
    """Whisper's decoder over its (unmasked) encoder: 9 decoder tokens over 6 encoder frames, then
    4 more on the cache (cross-attention 4 over 6, self-attention 4 over 13)."""
    from transformers import DynamicCache, EncoderDecoderCache

    ref, mine = _whisper()
    g = torch.Generator().manual_seed(3)
    feats = torch.randn(2, 8, 12, generator=g)
    dec = torch.randint(3, VOCAB, (2, 9), generator=g)
    more = torch.randint(3, VOCAB, (2, 4), generator=g)
    w = torch.randn(2, 9, VOCAB, generator=g)
    outs = []
    for m in (mine, ref):
        m.zero_grad()
        lg = m(input_features=feats, decoder_input_ids=dec, use_cache=False).logits
        (lg * w).sum().backward()
        with torch.no_grad():
            cache = EncoderDecoderCache(DynamicCache(config=m.config), DynamicCache(config=m.config))
            enc = m.model.encoder(feats).last_hidden_state
            m(encoder_outputs=(enc,), decoder_input_ids=dec, past_key_values=cache, use_cache=True)
            step = m(
                encoder_outputs=(enc,), decoder_input_ids=more, past_key_values=cache, use_cache=True
            ).logits
        outs.append((lg, step))
    torch.testing.assert_close(outs[0][0], outs[1][0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(outs[0][1], outs[1][1], rtol=1e-5, atol=1e-5)
    _assert_grads(mine, ref)
