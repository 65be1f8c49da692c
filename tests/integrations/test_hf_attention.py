"""``register_attention()``: "mmbalance_varlen" in transformers' AttentionInterface.

A tiny Qwen2 language model with packed (padding-free) batches must match sdpa run on the same
sequences one by one (fp32, 1e-5), in the loss and the gradients; padded batches (left or right)
and cached decoding must match sdpa too; what the backend cannot do is refused, not approximated.
"""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers", minversion="5.6")

from mmbalance.integrations.hf import ATTENTION_NAME, register_attention  # noqa: E402

LENS = [5, 1, 9, 3, 12]


def _models(**cfg_kw):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    name = register_attention()
    assert name == ATTENTION_NAME == "mmbalance_varlen"
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      bos_token_id=1, eos_token_id=2, pad_token_id=0, **cfg_kw)  # fmt: skip
    ref = Qwen2ForCausalLM._from_config(copy.deepcopy(cfg), attn_implementation="sdpa").float()
    mine = Qwen2ForCausalLM._from_config(cfg, attn_implementation=name).float()
    mine.load_state_dict(ref.state_dict())
    return ref, mine


def _sequences(seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 64, (n,), generator=g) for n in LENS]


@pytest.mark.parametrize("boundaries", ["position_ids", "cu_seq_lens"])
def test_packed_batch_matches_sdpa_per_sequence(boundaries):
    ref, mine = _models()
    seqs = _sequences()
    ids = torch.cat(seqs)[None]
    pos = torch.cat([torch.arange(n) for n in LENS])[None]
    kw = dict(position_ids=pos, use_cache=False, labels=ids)
    if boundaries == "cu_seq_lens":
        cu = torch.tensor([0, *torch.tensor(LENS).cumsum(0).tolist()], dtype=torch.int32)
        kw.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max(LENS), max_length_k=max(LENS))
    out = mine(input_ids=ids, **kw)
    logits_ref = torch.cat([ref(input_ids=s[None], use_cache=False).logits[0] for s in seqs])
    torch.testing.assert_close(out.logits[0], logits_ref, rtol=1e-5, atol=1e-5)
    # gradients: the summed per-token loss of the packed row vs every sequence on its own
    logp = torch.log_softmax(out.logits[0, :-1], -1)
    tgt = ids[0, 1:]
    keep = torch.cat([torch.cat([torch.ones(n - 1), torch.zeros(1)]) for n in LENS])[:-1].bool()
    (-logp[keep].gather(1, tgt[keep, None]).sum()).backward()
    total = 0
    for s in seqs:
        lg = torch.log_softmax(ref(input_ids=s[None], use_cache=False).logits[0, :-1], -1)
        total = total - lg.gather(1, s[1:, None]).sum()
    total.backward()
    for (n, a), (_, b) in zip(mine.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-6, msg=lambda m, n=n: f"{n}: {m}")


@pytest.mark.parametrize("side", ["right", "left"])
def test_padded_batch_matches_sdpa(side):
    ref, mine = _models()
    seqs = _sequences(2)
    width = max(LENS)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        sl = slice(0, len(s)) if side == "right" else slice(width - len(s), width)
        ids[i, sl], mask[i, sl] = s, 1
    a = mine(input_ids=ids, attention_mask=mask, use_cache=False).logits
    b = ref(input_ids=ids, attention_mask=mask, use_cache=False).logits
    torch.testing.assert_close(a[mask.bool()], b[mask.bool()], rtol=1e-5, atol=1e-5)


def test_cached_decoding_matches_sdpa():
    ref, mine = _models()
    ref.eval(), mine.eval()
    prompt = torch.tensor([[5, 9, 11, 3, 7, 8]])
    with torch.no_grad():
        a = mine.generate(prompt, max_new_tokens=6, do_sample=False)
        b = ref.generate(prompt, max_new_tokens=6, do_sample=False)
    assert torch.equal(a, b)


def test_unsupported_settings_are_refused():
    from mmbalance.integrations.hf.attention import varlen_attention

    q = torch.randn(1, 2, 8, 4)
    module = torch.nn.Module()
    module.is_causal = True
    module.train()
    with pytest.raises(ValueError, match="dropout"):
        varlen_attention(module, q, q, q, None, dropout=0.1)
    module.eval()
    with pytest.raises(ValueError, match="mmbalance_varlen.*position_bias"):
        varlen_attention(module, q, q, q, None, position_bias=torch.zeros(1, 2, 8, 8))
    with pytest.raises(ValueError, match="mmbalance_varlen.*4-D mask with one mask per head"):
        varlen_attention(module, q, q, q, torch.ones(1, 2, 8, 8, dtype=torch.bool))
    with pytest.raises(NotImplementedError, match="mmbalance_varlen.*`alibi_slopes`"):
        varlen_attention(module, q, q, q, None, alibi_slopes=torch.ones(2))
