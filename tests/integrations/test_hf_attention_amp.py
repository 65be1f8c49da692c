"""``"mmbalance_varlen"`` in mixed precision: ``torch.autocast`` (bf16 and fp16, on CPU) and
half-precision weights.

Under autocast HF decoders hand the attention function float32 queries and keys (RoPE multiplies
by float32 cos/sin) and half-precision values; the backend runs them in the autocast dtype, as
transformers' flash-attention path does. Tiny Llama and Qwen2 models, packed rows (the batches
``DataCollatorWithFlattening`` makes) and padded batches, float32 master weights: the logits and
every parameter's gradient must be as close to a float64 run as sdpa's under the same autocast
(within 2x its error, the rule of ``tests/tolerances.py``), and the op must have run in the
autocast dtype. Outside autocast, mixed dtypes are a TypeError naming the backend. TRL's
``SFTTrainer`` with its default config (bf16) and ``balance_trainer`` trains on 2 ranks, padded and
packed, every rank exiting with code 0.
"""

from __future__ import annotations

import copy
import json
import tempfile
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers", minversion="5.6")

import mmbalance.integrations.hf.attention.backend as attn  # noqa: E402
from mmbalance.integrations.hf import ATTENTION_NAME, register_attention  # noqa: E402
from tests.dist_utils import launch  # noqa: E402
from tests.tolerances import LOWP_FACTOR  # noqa: E402

VOCAB = 64
LENS = [5, 1, 9, 3, 12]
EPS = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


def _models(family: str) -> dict[str, torch.nn.Module]:
    register_attention()
    cfg = getattr(transformers, family + "Config")(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    cls = getattr(transformers, family + "ForCausalLM")
    torch.manual_seed(0)
    ref = cls._from_config(copy.deepcopy(cfg), attn_implementation="sdpa")
    mine = cls._from_config(copy.deepcopy(cfg), attn_implementation=ATTENTION_NAME)
    mine.load_state_dict(ref.state_dict())
    return {"sdpa": ref, ATTENTION_NAME: mine}


@pytest.fixture(scope="module", params=["Llama", "Qwen2"])
def models(request):
    return _models(request.param)


def _batch(layout: str) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(3, VOCAB, (n,), generator=g) for n in LENS]
    if layout == "packed":  # one row, position_ids restarting at every sequence
        return transformers.DataCollatorWithFlattening()([{"input_ids": s.tolist()} for s in seqs])
    width = max(LENS)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    labels = torch.full_like(ids, -100)
    for i, s in enumerate(seqs):
        sl = slice(0, len(s)) if i % 2 else slice(width - len(s), width)  # right and left padding
        ids[i, sl], mask[i, sl], labels[i, sl] = s, 1, s
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _run(model, batch, amp: torch.dtype | None, weights: torch.dtype):
    """Logits and every parameter's gradient of the model's own loss, as float64."""
    model = copy.deepcopy(model).to(weights)
    ctx = torch.autocast("cpu", dtype=amp) if amp is not None else nullcontext()
    with ctx:
        out = model(**batch, use_cache=False)
    out.loss.backward()
    return out.logits.double(), {n: p.grad.double() for n, p in model.named_parameters()}


def _spy(monkeypatch) -> list[tuple[torch.dtype, ...]]:
    seen: list[tuple[torch.dtype, ...]] = []
    real = attn.attention_block

    def spy(q, k, v, *args, **kwargs):
        seen.append((q.dtype, k.dtype, v.dtype))
        return real(q, k, v, *args, **kwargs)

    monkeypatch.setattr(attn, "attention_block", spy)
    return seen


def _check(models, batch, amp, weights, monkeypatch):
    ref_logits, ref_grads = _run(models["sdpa"], batch, None, torch.float64)
    theirs_logits, theirs_grads = _run(models["sdpa"], batch, amp, weights)
    seen = _spy(monkeypatch)
    ours_logits, ours_grads = _run(models[ATTENTION_NAME], batch, amp, weights)
    low = amp or weights
    assert seen and all(s == (low, low, low) for s in seen), f"the op ran in {set(seen)}, not {low}"
    keep = batch["attention_mask"].bool() if "attention_mask" in batch else slice(None)
    eps = EPS[low]

    def within(name, ours, theirs, ref):
        err = (ours - ref).abs().max().item()
        torch_err = (theirs - ref).abs().max().item()
        assert torch_err > 0, f"{name}: sdpa matched float64 exactly: the run was not in low precision"
        # 2x sdpa's own error, plus a quarter of an ulp of the result's scale
        bound = LOWP_FACTOR * torch_err + 0.25 * eps * ref.abs().max().item()
        assert err <= bound, f"{name}: error {err:.3e} > {LOWP_FACTOR} x sdpa's {torch_err:.3e} (+ atol)"

    within("logits", ours_logits[keep], theirs_logits[keep], ref_logits[keep])
    for n in ref_grads:
        within(f"grad of {n}", ours_grads[n], theirs_grads[n], ref_grads[n])


@pytest.mark.parametrize("amp", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("layout", ["packed", "padded"])
def test_autocast_with_float32_weights_matches_sdpa(models, layout, amp, monkeypatch):
    _check(models, _batch(layout), amp, torch.float32, monkeypatch)


@pytest.mark.parametrize(
    "amp, weights",
    [(None, torch.bfloat16), (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16)],
    ids=["bf16-weights", "bf16-weights-autocast", "fp16-weights-autocast"],
)
def test_half_precision_weights_match_sdpa(models, amp, weights, monkeypatch):
    _check(models, _batch("packed"), amp, weights, monkeypatch)


def test_mixed_dtypes_outside_autocast_name_the_backend():
    from mmbalance.integrations.hf.attention import varlen_attention

    module = torch.nn.Module()
    module.is_causal = True
    q = torch.randn(1, 4, 6, 8)
    k = torch.randn(1, 2, 6, 8)
    v = k.to(torch.bfloat16)
    with pytest.raises(TypeError, match=f"{ATTENTION_NAME}: query, key and value must share a dtype outside "
                       r"torch.autocast, got torch.float32, torch.float32 and torch.bfloat16"):  # fmt: skip
        varlen_attention(module, q, k, v, None)
    # inside autocast the same call runs in bfloat16, float64 is never lowered (so it still differs)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, _ = varlen_attention(module, q, k, v, None)
        assert out.dtype == torch.bfloat16
        with pytest.raises(TypeError, match=f"{ATTENTION_NAME}: .*torch.float64"):
            varlen_attention(module, q.double(), k, v, None)


@pytest.mark.distributed
@pytest.mark.slow
def test_trl_sft_trainer_defaults_on_two_ranks():
    """SFTConfig's defaults are bf16=True and gradient checkpointing: the run that failed on every
    rank at the first step. Padded, then packed (``packing=True``): 3 steps each, finite losses,
    the attention in bfloat16, and packed calls holding more sequences than rows."""
    pytest.importorskip("trl")
    pytest.importorskip("datasets")
    with tempfile.TemporaryDirectory() as tmp:
        launch(Path(__file__).with_name("trainer_sft_amp.py"), nproc=2, timeout=600, env={"MMB_TMP": tmp})
        logs = {(run, r): json.loads((Path(tmp) / f"sft-{run}-rank{r}.json").read_text())
                for run in ("padded", "packed") for r in (0, 1)}  # fmt: skip
    for (run, r), log in logs.items():
        assert log["steps"] == 3 and log["dtypes"] == ["torch.bfloat16"], (run, r, log)
    assert max(logs["packed", r]["sequences"] for r in (0, 1)) > 2, "packed rows: several sequences per row"
