"""``"mmbalance_varlen"`` against transformers' own mask functions, call by call.

Every mask transformers composes (causal or bidirectional; sliding windows, both kinds; Llama4's
chunks with left padding; packed rows; padding on either side and around generated tokens; a
cache's query and key offsets, a static cache's empty slots) goes through our mask function and the
attention function, and is checked against a float64 softmax under the dense boolean mask that
``masking_utils.sdpa_mask`` builds from the same mask function. Explicit ``cu_seq_lens_q/k`` of
different lengths are causal bottom-right (flash-attention's alignment). What the op cannot express
is refused with the backend's name and the feature.
"""

from __future__ import annotations

import math

import pytest
import torch

transformers = pytest.importorskip("transformers", minversion="5.6")

from transformers import masking_utils as mu  # noqa: E402

from mmbalance.integrations.hf.attention import varlen_attention, varlen_mask  # noqa: E402

H, HKV, D = 4, 2, 8


class _Layer(torch.nn.Module):
    def __init__(self, causal=True):
        super().__init__()
        self.is_causal = causal
        self.eval()


def _dense(q, k, v, allowed, scale):
    """float64 softmax attention under a boolean ``[B, Lq, Lk]`` mask; rows with no key -> 0."""
    q, k, v = (t.double() for t in (q, k, v))
    k = k.repeat_interleave(H // HKV, 1)
    v = v.repeat_interleave(H // HKV, 1)
    s = torch.einsum("bhqd,bhkd->bhqk", q, k) * scale
    s = s.masked_fill(~allowed[:, None], -math.inf)
    p = torch.softmax(s, -1).nan_to_num(0.0)
    return torch.einsum("bhqk,bhkd->bqhd", p, v)


def _case(b, lq, lk, q_offset, kv_offset, mask_function, attention_mask, causal=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, H, lq, D, generator=g)
    k = torch.randn(b, HKV, lk, D, generator=g)
    v = torch.randn(b, HKV, lk, D, generator=g)
    dense = mu.sdpa_mask(batch_size=b, q_length=lq, kv_length=lk, q_offset=q_offset, kv_offset=kv_offset,
                         mask_function=mask_function, attention_mask=attention_mask, allow_is_causal_skip=False,
                         allow_is_bidirectional_skip=False, allow_torch_fix=False)  # fmt: skip
    allowed = dense.expand(b, 1, lq, lk)[:, 0]
    spec = varlen_mask(b, lq, lk, q_offset, kv_offset, mask_function, attention_mask)
    out, _ = varlen_attention(_Layer(causal), q, k, v, spec, scaling=0.3)
    want = _dense(q, k, v, allowed, 0.3)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)


def _pad(b, width, lens, side):
    m = torch.zeros(b, width, dtype=torch.bool)
    for i, n in enumerate(lens):
        if side == "left":
            m[i, width - n :] = True
        else:
            m[i, :n] = True
    return m


def _left_padding(mask):
    return (mask.cumsum(-1) == 0).sum(-1)


CAUSAL, BIDIR = mu.causal_mask_function, mu.bidirectional_mask_function


def _packed(mask_function, position_ids, packed_sequence_mask):
    """A mask function for packed rows as the installed transformers composes it (5.23 and later
    remap the positions inside the sequences; earlier versions add the packed piece alone)."""
    if hasattr(mu, "packed_sequence_compatibility_function"):
        return mu.packed_sequence_compatibility_function(mask_function, position_ids, packed_sequence_mask)
    if not hasattr(mu, "remap_positions_for_packed_sequence"):
        return mu.and_masks(mask_function, mu.packed_sequence_mask_function(packed_sequence_mask))
    return mu.and_masks(
        mu.remap_positions_for_packed_sequence(mask_function, position_ids),
        mu.packed_sequence_mask_function(packed_sequence_mask),
    )


def _blocks(block_sequence_ids):
    """The bidirectional image-block overlay as the installed transformers writes it
    (``blockwise_overlay``; before 5.10 Gemma 3's own ``token_type_ids_mask_function``)."""
    if hasattr(mu, "blockwise_overlay"):
        return mu.blockwise_overlay(block_sequence_ids)
    from transformers.models.gemma3.modeling_gemma3 import token_type_ids_mask_function

    return token_type_ids_mask_function(block_sequence_ids)


def _cases():
    left = _pad(3, 9, [9, 4, 6], "left")
    right = _pad(3, 9, [9, 4, 6], "right")
    cache = _pad(2, 9, [9, 5], "left")
    # right padding, then 3 generated tokens on every row: valid keys in two runs
    around = torch.cat([_pad(2, 6, [6, 2], "right"), torch.ones(2, 3, dtype=torch.bool)], 1)
    pos = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4, 5], [0, 1, 0, 1, 2, 3, 4, 5, 6, 0]])
    psm = mu.find_packed_sequence_indices(pos)
    # image blocks (Gemma3's block_sequence_ids): bidirectional inside a block
    ids = torch.tensor([[-1, -1, 0, 0, 0, -1, 1, 1, -1], [-1, 0, 0, 0, 0, -1, -1, -1, -1]])
    blocks = mu.or_masks(CAUSAL, _blocks(ids))
    cache_ids = torch.tensor([[-1, -1, -1, 0, 0, 0, 0, -1, -1], [-1, -1, -1, -1, -1, 0, 0, 0, -1]])
    return {
        "causal": (2, 7, 7, 0, 0, CAUSAL, None),
        "causal_left_padding": (3, 9, 9, 0, 0, CAUSAL, left),
        "causal_right_padding": (3, 9, 9, 0, 0, CAUSAL, right),
        "cache_decode_padded": (2, 1, 9, 8, 0, CAUSAL, cache),
        "cache_chunked_prefill": (2, 3, 9, 6, 0, CAUSAL, cache),
        "static_cache_empty_slots": (2, 3, 12, 6, 0, CAUSAL, cache),
        "static_cache_no_mask": (2, 3, 12, 6, 0, CAUSAL, None),
        "padding_around_generated": (2, 2, 9, 7, 0, CAUSAL, around),
        "sliding": (3, 9, 9, 0, 0, mu.sliding_window_causal_mask_function(3), left),
        "sliding_cache_offset": (2, 2, 6, 7, 3, mu.sliding_window_causal_mask_function(4), cache),
        "sliding_short_sequences": (3, 9, 9, 0, 0, mu.sliding_window_causal_mask_function(16), left),
        "chunked_left_padding": (3, 9, 9, 0, 0, mu.chunked_causal_mask_function(3, _left_padding(left)), left),
        "chunked_cache": (2, 3, 9, 6, 0, mu.chunked_causal_mask_function(4, _left_padding(cache)), cache),
        "bidirectional_padding": (3, 9, 9, 0, 0, BIDIR, right),
        "cross_attention_longer_queries": (3, 12, 9, 0, 0, BIDIR, left),
        "bidirectional_sliding": (3, 9, 9, 0, 0, mu.sliding_window_bidirectional_mask_function(2), right),
        "packed_rows": (2, 10, 10, 0, 0, _packed(CAUSAL, pos, psm), None),
        "packed_rows_sliding": (
            2, 10, 10, 0, 0,
            _packed(mu.sliding_window_causal_mask_function(3), pos, psm), None,
        ),
        "image_blocks": (2, 9, 9, 0, 0, blocks, None),
        "image_blocks_padded": (3, 9, 9, 0, 0, mu.or_masks(CAUSAL, _blocks(
            torch.tensor([[-1, 0, 0, -1, 1, 1, 1, -1, -1], [-1] * 5 + [0, 0, 0, -1], [-1] * 4 + [0, 0, 0, 0, 0]]))), left),
        "image_blocks_sliding": (2, 9, 9, 0, 0, mu.and_masks(blocks, mu.sliding_window_overlay(2)), None),
        "image_blocks_prefill_on_cache": (2, 5, 9, 4, 0, mu.or_masks(CAUSAL, _blocks(cache_ids)), None),
        # the window inside the union, as early 5.x compose Gemma 3's sliding layers: images no longer
        # than the window reaches back (blocks of 3, window 3: the same keys as the window outside)
        "image_blocks_window_inside": (2, 9, 9, 0, 0, mu.or_masks(mu.sliding_window_causal_mask_function(3), _blocks(
            torch.tensor([[-1, 0, 0, 0, -1, 1, 1, -1, -1], [-1] * 4 + [0, 0, 0, -1, -1]]))), None),
    }  # fmt: skip


CASES = _cases()


@pytest.mark.parametrize("name", list(CASES))
def test_matches_transformers_mask(name):
    b, lq, lk, q_off, kv_off, fn, mask = CASES[name]
    causal = fn is not BIDIR and "bidirectional" not in name and "cross" not in name
    _case(b, lq, lk, q_off, kv_off, fn, mask, causal=causal)


def test_cu_seq_lens_of_different_lengths_are_bottom_right():
    """Explicit boundaries, 3 / 1 / 0 / 4 queries against 5 / 4 / 2 / 4 keys: query ``i`` of a
    sequence sits at ``nk - nq + i`` (flash-attention's causal alignment, a KV cache's)."""
    g = torch.Generator().manual_seed(1)
    nq, nk = [3, 1, 0, 4], [5, 4, 2, 4]
    q = torch.randn(1, H, sum(nq), D, generator=g)
    k = torch.randn(1, HKV, sum(nk), D, generator=g)
    v = torch.randn(1, HKV, sum(nk), D, generator=g)
    cu_q = torch.tensor([0, *torch.tensor(nq).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(nk).cumsum(0).tolist()], dtype=torch.int32)
    allowed = torch.zeros(1, sum(nq), sum(nk), dtype=torch.bool)
    for s in range(len(nq)):
        for i in range(nq[s]):
            for j in range(nk[s]):
                allowed[0, cu_q[s] + i, cu_k[s] + j] = j <= nk[s] - nq[s] + i
    out, _ = varlen_attention(_Layer(), q, k, v, None, scaling=0.3, cu_seq_lens_q=cu_q, cu_seq_lens_k=cu_k,
                              max_length_q=max(nq), max_length_k=max(nk))  # fmt: skip
    torch.testing.assert_close(out.double(), _dense(q, k, v, allowed, 0.3), rtol=1e-5, atol=1e-5)


def test_window_is_judged_per_sequence(monkeypatch):
    """Packed sequences all shorter than the window call the op without a window; one longer
    sequence passes flash-attention's ``window_left = W - 1``."""
    import mmbalance.integrations.hf.attention.backend as attn

    seen = []

    def spy(*args, **kwargs):
        seen.append({k: kwargs.get(k) for k in ("window_left", "window_right")})
        raise RuntimeError("stop")

    monkeypatch.setattr(attn, "attention_block", spy)
    q = torch.randn(1, H, 10, D)
    k = torch.randn(1, HKV, 10, D)
    for lens in ([4, 3, 3], [2, 8]):
        pos = torch.cat([torch.arange(n) for n in lens])[None]
        with pytest.raises(RuntimeError, match="stop"):
            varlen_attention(_Layer(), q, k, k, None, sliding_window=5, position_ids=pos)
    assert seen == [{"window_left": None, "window_right": None}, {"window_left": 4, "window_right": -1}]


def _refused(match, fn, *args, exc=ValueError, **kwargs):
    with pytest.raises(exc, match=match):
        fn(*args, **kwargs)


def test_refusals_name_the_backend_and_the_feature():
    q = torch.randn(1, H, 6, D)
    k = torch.randn(1, HKV, 6, D)
    layer = _Layer()
    name = "mmbalance_varlen"
    layer.train()
    _refused(
        f"{name} does not implement attention dropout", varlen_attention, layer, q, k, k, None, dropout=0.1
    )
    layer.eval()
    _refused(f"{name} does not implement returning attention weights", varlen_attention, layer, q, k, k, None,
             output_attentions=True)  # fmt: skip
    _refused(f"{name} does not implement paged attention caches", varlen_attention, layer, q, k, k, None,
             block_table=torch.zeros(1, 1))  # fmt: skip
    _refused(f"{name} does not implement the attention keyword `alibi`", varlen_attention, layer, q, k, k, None,
             alibi=torch.ones(H), exc=NotImplementedError)  # fmt: skip
    _refused(f"{name} cannot run this attention mask: a 4-D mask with additive values other than 0 and -inf",
             varlen_attention, layer, q, k, k, torch.ones(1, 1, 6, 6))  # fmt: skip
    # unions of mask functions: Gemma3's bidirectional image blocks, bidirectional decoders
    image = mu.or_masks(CAUSAL, lambda b, h, qi, ki: qi >= 0)
    _refused(
        f"{name} cannot run this attention mask: a union of mask functions", varlen_mask, 1, 6, 6, 0, 0, image
    )
    _refused(f"{name} cannot run this attention mask: the mask function `.*` is not one of", varlen_mask, 1, 6, 6,
             0, 0, lambda b, h, qi, ki: qi >= ki)  # fmt: skip
    # the window inside the union with an image longer than the window reaches back: its early keys
    # are allowed by the block but not by the window, which the op applies on top
    long_image = mu.or_masks(
        mu.sliding_window_causal_mask_function(2), _blocks(torch.tensor([[-1, 0, 0, 0, -1, -1]]))
    )
    _refused(f"{name} cannot run this attention mask: .*an image block longer than the sliding window",
             varlen_mask, 1, 6, 6, 0, 0, long_image)  # fmt: skip
    # valid keys in three runs
    holes = torch.tensor([[1, 0, 1, 0, 1, 1]], dtype=torch.bool)
    spec = varlen_mask(1, 6, 6, 0, 0, CAUSAL, holes)
    _refused(f"{name} does not implement a padding mask whose valid keys form 3 separate runs", varlen_attention,
             layer, q, k, k, spec)  # fmt: skip
    # a layer asking for a window its mask does not have
    spec = varlen_mask(1, 6, 6, 0, 0, CAUSAL, None)
    _refused(
        f"{name}: the layer asks for sliding_window=3",
        varlen_attention,
        layer,
        q,
        k,
        k,
        spec,
        sliding_window=3,
    )


def test_value_head_dim_smaller_than_query_head_dim():
    """MLA-style heads (DeepSeek): values narrower than queries/keys are padded to one width for
    the op and the output cropped back, as flash-attention does."""
    g = torch.Generator().manual_seed(2)
    q = torch.randn(2, H, 6, D, generator=g)
    k = torch.randn(2, HKV, 6, D, generator=g)
    v = torch.randn(2, HKV, 6, 5, generator=g)
    left = _pad(2, 6, [6, 4], "left")
    spec = varlen_mask(2, 6, 6, 0, 0, CAUSAL, left)
    out, _ = varlen_attention(_Layer(), q, k, v, spec, scaling=0.3)
    assert out.shape == (2, 6, H, 5)
    allowed = torch.tril(torch.ones(6, 6, dtype=torch.bool)) & left[:, None, :]
    torch.testing.assert_close(out.double(), _dense(q, k, v, allowed, 0.3), rtol=1e-5, atol=1e-5)
