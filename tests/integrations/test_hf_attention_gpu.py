"""``mmbalance_varlen`` in Hugging Face models on a GPU (``pytest -m gpu``; skipped without CUDA).

A tiny Qwen2 in bfloat16 on CUDA, packed through ``mmbalance_varlen`` against the stock ``sdpa`` on
the same examples padded: the loss, the logits of every real token and the gradients agree to
bfloat16's precision, and the block ops ran on torch's own FlashAttention (``torch_flash``) where it
can (flash-attn not installed). Gemma 2's softcap (in bfloat16), which no FlashAttention runs, goes to
the Triton kernels and matches eager attention.
"""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers", minversion="5.6")

from mmbalance.integrations.hf import register_attention  # noqa: E402
from mmbalance.pyops import attention_backends  # noqa: E402

pytestmark = pytest.mark.gpu


def _cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")


def _examples(lengths, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g) for n in lengths]


def _packed(rows):
    ids = torch.cat(rows)[None]
    pos = torch.cat([torch.arange(len(r)) for r in rows])[None]
    labels = ids.clone()
    starts = torch.tensor([0, *torch.tensor([len(r) for r in rows]).cumsum(0)[:-1].tolist()])
    labels[0, starts] = -100  # no token predicts the first of the next sequence
    return {"input_ids": ids.cuda(), "position_ids": pos.cuda(), "labels": labels.cuda()}


def _padded(rows):
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.int64)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = r
        mask[i, : len(r)] = 1
    return {
        "input_ids": ids.cuda(),
        "attention_mask": mask.cuda(),
        "labels": ids.masked_fill(mask == 0, -100).cuda(),
    }


def _spy(monkeypatch) -> list[str]:
    chosen: list[str] = []
    real = attention_backends.select_attention_backend

    def spy(backend, inputs):
        name = real(backend, inputs)
        chosen.append(name)
        return name

    from mmbalance.pyops import attention_ops

    monkeypatch.setattr(attention_ops, "select_attention_backend", spy)
    return chosen


def test_packed_varlen_matches_padded_sdpa_in_bf16(monkeypatch):
    _cuda()
    from transformers import Qwen2Config, Qwen2ForCausalLM

    register_attention()
    cfg = Qwen2Config(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    torch.manual_seed(0)
    ours = Qwen2ForCausalLM._from_config(
        cfg, attn_implementation="mmbalance_varlen", dtype=torch.bfloat16
    ).cuda()
    # a config of its own: _from_config sets the attention on the config it is given, which would
    # switch the first model to sdpa too
    ref = Qwen2ForCausalLM._from_config(
        copy.deepcopy(cfg), attn_implementation="sdpa", dtype=torch.bfloat16
    ).cuda()
    ref.load_state_dict(ours.state_dict())
    assert (ours.config._attn_implementation, ref.config._attn_implementation) == ("mmbalance_varlen", "sdpa")
    rows = _examples([37, 200, 5, 129, 64], 256)
    chosen = _spy(monkeypatch)
    a = ours(**_packed(rows))
    b = ref(**_padded(rows))
    a.loss.backward()
    b.loss.backward()
    assert abs(float(a.loss) - float(b.loss)) < 2e-2 * float(b.loss)
    # every real token's logits, sequence by sequence
    off = 0
    for i, r in enumerate(rows):
        n = len(r)
        diff = (a.logits[0, off : off + n].float() - b.logits[i, :n].float()).abs().max()
        assert float(diff) < 0.1, (i, float(diff))
        off += n
    for (name, p), q in zip(ours.named_parameters(), ref.parameters()):
        err = (p.grad.float() - q.grad.float()).norm() / q.grad.float().norm().clamp_min(1e-12)
        assert float(err) < 0.05, (name, float(err))
    if not attention_backends.torch_flash_unsupported_reasons(
        attention_backends.AttentionInputs(
            q_shape=(8, 4, 64),
            k_shape=(8, 2, 64),
            dtype=torch.bfloat16,
            device=torch.device("cuda"),
            causal=True,
        )  # fmt: skip
    ):
        assert "torch_flash" in chosen, chosen


def test_softcap_runs_on_the_triton_kernels_and_matches_eager(monkeypatch):
    _cuda()
    from transformers import Gemma2Config, Gemma2ForCausalLM

    register_attention()
    cfg = Gemma2Config(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=32, sliding_window=48,
                       attn_logit_softcapping=5.0, query_pre_attn_scalar=32)  # fmt: skip
    torch.manual_seed(0)
    ours = Gemma2ForCausalLM._from_config(cfg, attn_implementation="mmbalance_varlen", dtype=torch.bfloat16)
    ref = Gemma2ForCausalLM._from_config(
        copy.deepcopy(cfg), attn_implementation="eager", dtype=torch.bfloat16
    )
    ours, ref = ours.cuda(), ref.cuda()
    ref.load_state_dict(ours.state_dict())
    assert (ours.config._attn_implementation, ref.config._attn_implementation) == (
        "mmbalance_varlen",
        "eager",
    )
    rows = _examples([70, 9, 120], 256, seed=1)
    chosen = _spy(monkeypatch)
    a = ours(**_packed(rows)).loss
    want = sum(ref(input_ids=r[None].cuda(), labels=r[None].cuda()).loss * (len(r) - 1) for r in rows) / sum(
        len(r) - 1 for r in rows
    )
    assert abs(float(a) - float(want)) < 2e-2 * float(want)  # bfloat16 against eager's bfloat16
    # bfloat16, so it is the softcap that keeps it from torch's FlashAttention
    assert "triton" in chosen and "torch_flash" not in chosen, chosen
