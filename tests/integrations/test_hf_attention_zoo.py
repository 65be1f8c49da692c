"""A model zoo for ``"mmbalance_varlen"``: every feature transformers hands an attention function,
through the models that use it, against ``eager`` (transformers' reference implementation).

Each tiny model (2 layers, hidden 32, fp32, random weights) runs a packed batch of two rows, each
row several sequences back to back with restarting ``position_ids``, against every sequence on its
own (logits and gradients); padded batches; a chunked prefill on a cache; and greedy ``generate()``
with dynamic and static caches at batch 1 and 3 (left padding), token for token. Sequences are
longer than the sliding windows and chunks, so those are exercised. A model whose feature the
backend refuses is tested for the refusal: the error names ``mmbalance_varlen`` and the feature.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass, field

import pytest
import torch

transformers = pytest.importorskip("transformers", minversion="5.6")

from mmbalance.integrations.hf import ATTENTION_NAME, register_attention  # noqa: E402

VOCAB = 64
# two packed rows of equal width (15 tokens), each with several sequences; some exceed every
# window (4) and chunk (4) of the zoo
ROWS = [[5, 1, 9], [3, 12]]
BASE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128, pad_token_id=0, bos_token_id=1, eos_token_id=2)  # fmt: skip


def _llama():
    return transformers.LlamaConfig(**BASE), transformers.LlamaForCausalLM


def _qwen2():
    # one sliding-window layer and one full layer
    cfg = transformers.Qwen2Config(**BASE, use_sliding_window=True, sliding_window=4, max_window_layers=1,
                                   layer_types=["sliding_attention", "full_attention"])  # fmt: skip
    return cfg, transformers.Qwen2ForCausalLM


def _qwen3():
    return transformers.Qwen3Config(**BASE, head_dim=8), transformers.Qwen3ForCausalLM


def _mistral():
    return transformers.MistralConfig(**BASE, sliding_window=4), transformers.MistralForCausalLM


def _gemma2():
    cfg = transformers.Gemma2Config(**BASE, head_dim=8, sliding_window=4, attn_logit_softcapping=2.0,
                                    final_logit_softcapping=30.0, query_pre_attn_scalar=8)  # fmt: skip
    return cfg, transformers.Gemma2ForCausalLM


def _gemma3_text():
    cfg = transformers.Gemma3TextConfig(**BASE, head_dim=8, sliding_window=4, query_pre_attn_scalar=8,
                                        layer_types=["sliding_attention", "full_attention"])  # fmt: skip
    return cfg, transformers.Gemma3ForCausalLM


def _gpt_oss():
    cfg = transformers.GptOssConfig(**BASE, head_dim=8, sliding_window=4, num_local_experts=2,
                                    num_experts_per_tok=1, layer_types=["sliding_attention", "full_attention"])  # fmt: skip
    return cfg, transformers.GptOssForCausalLM


def _llama4_text():
    cfg = transformers.Llama4TextConfig(**BASE, head_dim=8, intermediate_size_mlp=64, num_local_experts=1,
                                        interleave_moe_layer_step=2, attention_chunk_size=4,
                                        no_rope_layers=[1, 0], layer_types=["chunked_attention", "full_attention"],
                                        attn_temperature_tuning=False)  # fmt: skip
    return cfg, transformers.Llama4ForCausalLM


@dataclass
class Entry:
    name: str
    build: object
    generate: bool = True
    sinks: bool = False
    features: list[str] = field(default_factory=list)


ZOO = [
    Entry("llama", _llama),
    Entry("qwen2", _qwen2, features=["sliding window (one layer)"]),
    Entry("qwen3", _qwen3),
    Entry("mistral", _mistral, features=["sliding window"]),
    Entry("gemma2", _gemma2, features=["softcap", "sliding window"]),
    Entry("gemma3_text", _gemma3_text, features=["sliding window"]),
    Entry("gpt_oss", _gpt_oss, sinks=True, features=["sinks", "sliding window"]),
    Entry("llama4_text", _llama4_text, features=["chunked attention"]),
]


@dataclass
class Pair:
    entry: Entry
    ref: torch.nn.Module
    mine: torch.nn.Module


def _build(entry: Entry) -> Pair:
    register_attention()
    cfg, cls = entry.build()
    torch.manual_seed(0)
    ref = cls._from_config(copy.deepcopy(cfg), attn_implementation="eager").float().eval()
    mine = cls._from_config(copy.deepcopy(cfg), attn_implementation=ATTENTION_NAME).float().eval()
    mine.load_state_dict(ref.state_dict())
    # the reference must not run the backend under test (a shared config object would make it)
    assert not any(getattr(getattr(m, "config", None), "_attn_implementation", None) == ATTENTION_NAME
                   for m in ref.modules())  # fmt: skip
    if entry.sinks:  # random sinks, so that they matter
        with torch.no_grad():
            for m in (ref, mine):
                for name, p in m.named_parameters():
                    if name.endswith("sinks"):
                        p.copy_(torch.linspace(-1.0, 1.0, p.numel()))
    return Pair(entry, ref, mine)


@pytest.fixture(scope="module", params=ZOO, ids=lambda e: e.name)
def pair(request) -> Pair:
    return _build(request.param)


def _sequences(seed: int) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [[torch.randint(3, VOCAB, (n,), generator=g) for n in row] for row in ROWS]


def test_packed_rows_match_each_sequence_alone(pair):
    """Two packed rows (batch 2), restarting position_ids: logits and every gradient match eager
    run on each sequence alone."""
    rows = _sequences(1)
    ids = torch.stack([torch.cat(r) for r in rows])
    pos = torch.stack([torch.cat([torch.arange(len(s)) for s in r]) for r in rows])
    g = torch.Generator().manual_seed(2)
    weight = torch.randn(*ids.shape, VOCAB, generator=g)  # a random linear loss per token
    pair.mine.zero_grad(), pair.ref.zero_grad()
    out = pair.mine(input_ids=ids, position_ids=pos, use_cache=False).logits
    (out * weight).sum().backward()
    if "chunked attention" in pair.entry.features and not hasattr(
        transformers.masking_utils, "remap_positions_for_packed_sequence"
    ):
        # before 5.23 transformers counts the chunks of packed rows from the row's start, not the
        # sequence's: what it says is eager on the same rows, not every sequence alone
        lg = pair.ref(input_ids=ids, position_ids=pos, use_cache=False).logits
        (lg * weight).sum().backward()
        torch.testing.assert_close(out, lg, rtol=1e-5, atol=1e-5)
        _assert_same_grads(pair)
        return
    ref_logits = []
    for r, row in enumerate(rows):
        at = 0
        for s in row:
            lg = pair.ref(input_ids=s[None], use_cache=False).logits[0]
            (lg * weight[r, at : at + len(s)]).sum().backward()
            ref_logits.append(lg)
            at += len(s)
    torch.testing.assert_close(out.reshape(-1, VOCAB), torch.cat(ref_logits), rtol=1e-5, atol=1e-5)
    _assert_same_grads(pair)


def _assert_same_grads(pair: Pair) -> None:
    for (n, a), (_, b) in zip(pair.mine.named_parameters(), pair.ref.named_parameters()):
        if b.grad is None:
            assert a.grad is None or not a.grad.any(), n
            continue
        assert a.grad is not None, f"{n} got no gradient"
        # element by element (1e-5), or relative to the gradient's norm (float32 sums in another order)
        err = float((a.grad - b.grad).norm() / b.grad.norm().clamp_min(1e-6))
        close = torch.allclose(a.grad, b.grad, rtol=1e-4, atol=1e-5)
        assert close or err < 1e-5, f"{n}: relative gradient error {err:.2e}"


def test_padded_batch_and_chunked_prefill(pair):
    """A left-padded batch, then a second chunk of tokens on its cache (queries bottom-right of
    their keys), against eager on the same inputs."""
    from transformers import DynamicCache

    g = torch.Generator().manual_seed(3)
    lens, width = [7, 3, 10], 10
    ids = torch.zeros(3, width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lens):
        ids[i, width - n :] = torch.randint(3, VOCAB, (n,), generator=g)
        mask[i, width - n :] = 1
    more = torch.randint(3, VOCAB, (3, 5), generator=g)
    outs = []
    with torch.no_grad():
        for m in (pair.mine, pair.ref):
            cache = DynamicCache(config=m.config)
            a = m(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True).logits
            full = torch.cat([mask, torch.ones_like(more)], 1)
            b = m(input_ids=more, attention_mask=full, past_key_values=cache, use_cache=True).logits
            outs.append((a[mask.bool()], b))
    torch.testing.assert_close(outs[0][0], outs[1][0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(outs[0][1], outs[1][1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("batch", [1, 3])
def test_generate_matches_eager(pair, batch, cache):
    if not pair.entry.generate:
        pytest.skip("generation not covered for this model")
    g = torch.Generator().manual_seed(4 + batch)
    lens = [6, 2, 9][:batch]
    width = max(lens)
    ids = torch.zeros(batch, width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lens):
        ids[i, width - n :] = torch.randint(3, VOCAB, (n,), generator=g)
        mask[i, width - n :] = 1
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, eos_token_id=None)
    if cache == "static":
        kw["cache_implementation"] = "static"
    with torch.no_grad():
        try:
            b = pair.ref.generate(ids, attention_mask=mask, **kw)
        except (TypeError, AttributeError) as exc:
            # the release's own generate fails for every attention (transformers 5.10's static
            # cache hands the chunked mask a keyword it does not take, and asks a reused static
            # cache of sliding layers for a size it does not keep): ours fails the same way
            with pytest.raises(type(exc), match=re.escape(str(exc))):
                pair.mine.generate(ids, attention_mask=mask, **kw)
            return
        a = pair.mine.generate(ids, attention_mask=mask, **kw)
    assert torch.equal(a, b), (a, b)


# more decoder families, packed rows only (logits and gradients): MoE, parallel blocks, partial
# rotary, no-rope layers, MLA (DeepSeek-V3: values narrower than queries), more sliding windows
MORE = {
    "mixtral": ("Mixtral", dict(num_local_experts=2, num_experts_per_tok=1, sliding_window=4)),
    "qwen2_moe": ("Qwen2Moe", dict(num_experts=2, num_experts_per_tok=1, moe_intermediate_size=32,
                                   shared_expert_intermediate_size=32)),
    "phi3": ("Phi3", {}),
    "olmo2": ("Olmo2", {}),
    "cohere2": ("Cohere2", dict(sliding_window=4, layer_types=["sliding_attention", "full_attention"])),
    "starcoder2": ("Starcoder2", dict(sliding_window=4)),
    "gpt_neox": ("GPTNeoX", {}),
    "gemma": ("Gemma", dict(head_dim=8)),
    "smollm3": ("SmolLM3", {}),
    "exaone4": ("Exaone4", dict(sliding_window=4, layer_types=["sliding_attention", "full_attention"])),
    "deepseek_v3": ("DeepseekV3", dict(num_key_value_heads=4, head_dim=4, q_lora_rank=16, kv_lora_rank=16,
                                       qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=6, n_routed_experts=2,
                                       num_experts_per_tok=1, moe_intermediate_size=32, first_k_dense_replace=1,
                                       n_group=1, topk_group=1)),
}  # fmt: skip


@pytest.mark.parametrize("name", list(MORE))
def test_more_families_packed_rows(name):
    family, extra = MORE[name]
    cfg = getattr(transformers, family + "Config")(**{**BASE, **extra})
    cls = getattr(transformers, family + "ForCausalLM")
    test_packed_rows_match_each_sequence_alone(_build(Entry(name, lambda: (cfg, cls))))


def test_refused_model_features_name_the_backend():
    """A bidirectional Gemma3 decoder (``use_bidirectional_attention``: a union of the causal mask
    with "everything") and ``output_attentions=True`` are refused by name, not computed wrongly."""
    cfg, cls = _gemma3_text()
    cfg.use_bidirectional_attention = True
    model = _build(Entry("gemma3_bidirectional", lambda: (cfg, cls))).mine
    ids = torch.randint(3, VOCAB, (1, 6))
    with pytest.raises(
        ValueError, match="mmbalance_varlen cannot run this attention mask: a union of mask functions"
    ):
        model(input_ids=ids, use_cache=False)
    cfg, cls = _llama()
    model = _build(Entry("llama", lambda: (cfg, cls))).mine
    with pytest.raises(ValueError, match="mmbalance_varlen does not implement returning attention weights"):
        model(input_ids=ids, use_cache=False, output_attentions=True)
