"""Hybrid decoders keep a packed row's sequences apart (``mixers.keep_sequences_apart``): tiny
Qwen3.5, Qwen3.5-MoE, Qwen3-Next and OLMo hybrid (Gated DeltaNet), Jamba, Bamba, Nemotron-H,
Falcon-H1 and Zamba2 (Mamba mixers), LFM2 (short convolutions) and MiniMax (lightning attention),
each with a mixer layer and an attention layer, float32, a packed row of 3 sequences from transformers' own ``DataCollatorWithFlattening``
(positions only, and with ``cu_seq_lens``) under ``mmbalance_varlen`` against each sequence alone
under ``sdpa``: the loss and every gradient within 1e-5 relative. Without it the packed row is
refused by name (``test_mixers.py``); ``remove()`` puts it back."""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers", minversion="5.6")

from mmbalance.integrations.hf import balance_trainer, keep_sequences_apart, register_attention  # noqa: E402
from tests.integrations.hybrids import tiny  # noqa: E402

FAMILIES = ["qwen3_5", "qwen3_5_moe", "qwen3_next", "olmo_hybrid", "jamba", "bamba", "nemotron_h", "falcon_h1",
            "zamba2", "lfm2", "minimax"]  # fmt: skip
LENGTHS = (7, 13, 4)


def _pair(model_type):
    from transformers import CONFIG_MAPPING

    if model_type not in CONFIG_MAPPING:
        pytest.skip(f"transformers {transformers.__version__} has no {model_type}")
    register_attention()
    ref = tiny(model_type)
    ours = copy.deepcopy(ref)
    ref.set_attn_implementation("sdpa")
    ours.set_attn_implementation("mmbalance_varlen")
    return ours, ref


def _rows(seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 64, (k,), generator=g) for k in LENGTHS]


def _alone(ref, rows):
    """The token-weighted mean of each sequence's loss alone, as the packed row's loss is."""
    total, count = 0.0, 0
    for r in rows:
        total = total + ref(input_ids=r[None], labels=r[None], use_cache=False).loss * (len(r) - 1)
        count += len(r) - 1
    return total / count


def _grads_close(ours, ref):
    for (name, p), q in zip(ours.named_parameters(), ref.parameters()):
        if q.grad is None:
            assert p.grad is None or not p.grad.any(), name
            continue
        err = float((p.grad - q.grad).norm() / q.grad.norm().clamp_min(1e-30))
        assert err < 1e-5, (name, err)


@pytest.mark.parametrize("flash_kwargs", [False, True], ids=["positions", "cu_seq_lens"])
@pytest.mark.parametrize("model_type", FAMILIES)
def test_a_packed_row_is_each_sequence_alone(model_type, flash_kwargs):
    ours, ref = _pair(model_type)
    handle = keep_sequences_apart(ours)
    assert handle is not None and keep_sequences_apart(ours) is handle  # once per model
    rows = _rows()
    collate = transformers.DataCollatorWithFlattening(
        return_tensors="pt", return_flash_attn_kwargs=flash_kwargs
    )
    batch = collate([{"input_ids": r.tolist()} for r in rows])
    assert ("cu_seq_lens_q" in batch) == flash_kwargs
    got = ours(**batch, use_cache=False).loss
    want = _alone(ref, rows)
    assert abs(float(got) - float(want)) <= 1e-5 * abs(float(want)), (float(got), float(want))
    got.backward()
    want.backward()
    _grads_close(ours, ref)


@pytest.mark.parametrize("model_type", ["qwen3_5"])
def test_a_padded_batch_and_remove(model_type):
    ours, ref = _pair(model_type)
    handle = keep_sequences_apart(ours)
    rows = _rows(seed=2)
    width = max(map(len, rows))
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, : len(r)], mask[i, : len(r)] = r, 1
    labels = ids.masked_fill(mask == 0, -100)
    got = ours(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False).loss
    want = ref(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False).loss
    assert abs(float(got) - float(want)) <= 1e-5 * float(want)
    handle.remove()
    assert "forward" not in vars(next(m for m in ours.modules() if "GatedDeltaNet" in type(m).__name__))
    batch = transformers.DataCollatorWithFlattening(return_tensors="pt")(
        [{"input_ids": r.tolist()} for r in rows]
    )
    with pytest.raises(ValueError, match="mixes tokens outside attention"):
        ours(**batch, use_cache=False)


def test_balance_trainer_keeps_them_apart(tmp_path):
    """A trainer balanced with ``balance_trainer`` gets its mixers kept apart (its collator may
    pack rows)."""
    import datasets

    ours, _ = _pair("qwen3_5")
    rows = [r.tolist() for r in _rows()] * 4
    args = transformers.TrainingArguments(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=4,
                                          report_to=[], use_cpu=True, save_strategy="no", disable_tqdm=True)  # fmt: skip
    trainer = transformers.Trainer(
        model=ours, args=args, train_dataset=datasets.Dataset.from_dict({"input_ids": rows}),
        data_collator=transformers.DataCollatorWithFlattening(return_tensors="pt"),
    )  # fmt: skip
    balance_trainer(trainer)
    assert keep_sequences_apart(ours) is not None
    trainer.train()
    assert trainer.state.global_step == 1


def test_a_model_whose_attention_cannot_see_the_packing_stays_refused():
    """GraniteMoeHybrid hands its attention no positions: its mixers could be kept apart, its
    attention could not, so a packed row is refused even with ``keep_sequences_apart``."""
    ours, _ = _pair("granitemoehybrid")
    keep_sequences_apart(ours)
    batch = transformers.DataCollatorWithFlattening(return_tensors="pt")(
        [{"input_ids": r.tolist()} for r in _rows()]
    )
    with pytest.raises(ValueError, match="neither positions, sequence boundaries nor a padding mask"):
        ours(**batch, use_cache=False)


@pytest.mark.parametrize("padded", [True, False], ids=["padded", "all_ones"])
def test_an_attention_mask_makes_the_row_one_sequence_as_transformers_reads_it(padded):
    """LLaMA-Factory's collator gives Qwen3.5 ``[4, B, L]`` positions whose text row is the temporal
    M-RoPE row (one position repeated over an image's tokens) beside an ``attention_mask``: no
    packing (transformers and the attention read none from positions when there is a mask), so
    the Gated DeltaNet layers must not cut the row at the image either. Under
    ``keep_sequences_apart`` the step equals the stock model's (before the fix 1.4e-3 of a weight
    change off in LLaMA-Factory, the layers' state reset at every image token)."""
    from mmbalance.integrations.hf.encoders import core
    from tests.integrations import hf_zoo

    register_attention()
    ref = hf_zoo.build("qwen3_5", seed=0)
    ours = copy.deepcopy(ref)
    ref.set_attn_implementation("sdpa")
    ours.set_attn_implementation("mmbalance_varlen")
    keep_sequences_apart(ours)
    batch = hf_zoo.batch("qwen3_5", ref, [[(4, 4), (8, 4)]], seed=3)
    n = int(batch["input_ids"].shape[1])
    pad = 5 if padded else 0
    ids = torch.cat([batch["input_ids"], torch.zeros(1, pad, dtype=torch.long)], 1)
    mask = torch.cat([torch.ones(1, n, dtype=torch.long), torch.zeros(1, pad, dtype=torch.long)], 1)
    types = torch.cat(
        [batch["mm_token_type_ids"], torch.zeros(1, pad, dtype=batch["mm_token_type_ids"].dtype)], 1
    )
    rope, _ = core(ref).get_rope_index(ids, mm_token_type_ids=types, image_grid_thw=batch["image_grid_thw"],
                                       attention_mask=mask)  # fmt: skip
    pos = torch.cat([rope[:1], rope])  # the text row as the collator writes it: the temporal row
    assert bool((pos[0, 0, 1:n] == pos[0, 0, : n - 1]).any())  # an image's tokens share a position
    labels = ids.masked_fill(mask == 0, -100)
    kw = dict(input_ids=ids, attention_mask=mask, position_ids=pos, labels=labels, use_cache=False,
              pixel_values=batch["pixel_values"], image_grid_thw=batch["image_grid_thw"])  # fmt: skip
    got, want = ours(**kw).loss, ref(**kw).loss
    assert abs(float(got) - float(want)) <= 1e-5 * abs(float(want)), (float(got), float(want))
    got.backward()
    want.backward()
    _grads_close(ours, ref)


def test_rotary_rows_alone_make_the_row_one_sequence_as_transformers_reads_them():
    """Qwen3.5's forward with an image and neither ``attention_mask`` nor ``position_ids`` hands
    its text model the three rotary rows it computed (``[3, B, L]``, no text row): transformers
    reads no packing from them (its mask and attention see one sequence), so the Gated DeltaNet
    layers must not cut the row where the temporal row repeats a position over an image's
    tokens. Under ``keep_sequences_apart`` the step equals the stock model's (``sdpa``; under
    ``mmbalance_varlen`` such a hybrid forward is refused by name, ``test_mixers.py``)."""
    from tests.integrations import hf_zoo

    ref = hf_zoo.build("qwen3_5", seed=0)
    ref.set_attn_implementation("sdpa")
    ours = copy.deepcopy(ref)
    keep_sequences_apart(ours)
    batch = hf_zoo.batch("qwen3_5", ref, [[(4, 4), (8, 4)]], seed=3)
    seen = []
    hook = core_text(ours).register_forward_pre_hook(
        lambda m, a, kw: seen.append(kw.get("position_ids")), with_kwargs=True
    )
    kw = dict(input_ids=batch["input_ids"], labels=batch["input_ids"], use_cache=False,
              pixel_values=batch["pixel_values"], image_grid_thw=batch["image_grid_thw"],
              mm_token_type_ids=batch["mm_token_type_ids"])  # fmt: skip
    got, want = ours(**kw).loss, ref(**kw).loss
    hook.remove()
    pos = seen[0]
    assert pos is not None and pos.shape[0] == 3, None if pos is None else pos.shape
    assert bool((pos[0, 0, 1:] == pos[0, 0, :-1]).any())  # an image's tokens share a temporal position
    assert abs(float(got) - float(want)) <= 1e-5 * abs(float(want)), (float(got), float(want))
    got.backward()
    want.backward()
    _grads_close(ours, ref)


def core_text(model):
    from mmbalance.integrations.hf.compat import language_model
    from mmbalance.integrations.hf.wrappers import inner_model

    return language_model(inner_model(model))


def _flash_standin(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Causal attention that reads a row as transformers' flash attention does, for a CPU test:
    the 2-D padding mask its mask function leaves (none when the mask has no zero), else for one
    row, positions that do not count up from their smallest split it at each smallest one."""
    b, _, length, dim = query.shape
    k = key.repeat_interleave(query.shape[1] // key.shape[1], 1)
    v = value.repeat_interleave(query.shape[1] // value.shape[1], 1)
    allowed = torch.ones(b, length, length, dtype=torch.bool).tril()
    pos = kwargs.get("position_ids")
    if attention_mask is not None:
        allowed &= attention_mask.bool()[:, None, -length:]
    elif b == 1 and pos is not None and bool((pos[0] != pos[0].min() + torch.arange(length)).any()):
        seq = torch.cumsum((pos[0] == pos[0].min()).long(), 0)
        allowed &= seq[:, None] == seq[None, :]
    scores = (query @ k.transpose(-1, -2)) * (scaling if scaling is not None else dim**-0.5)
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    return (scores.softmax(-1) @ v).transpose(1, 2).contiguous(), None


@pytest.mark.parametrize("mask", ["none", "all_ones"])
def test_under_a_flash_attention_the_mixers_read_the_packing_it_reads(mask):
    """Under a flash attention transformers drops a mask without a zero and the attention reads
    one row's packing from its positions: the Gated DeltaNet layers must then keep the sequences
    apart too (a stand-in of that attention, ``flash_standin``, on the CPU). A packed row with an
    all-ones mask (as LLaMA-Factory's packing collators give) equals each sequence alone."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import flash_attention_mask

    AttentionInterface.register("flash_standin", _flash_standin)
    AttentionMaskInterface.register("flash_standin", flash_attention_mask)
    ref = tiny("qwen3_5")
    ref.set_attn_implementation("sdpa")
    ours = copy.deepcopy(ref)
    # set on the configs, past set_attn_implementation's loading of flash-attn's kernels
    for c in {
        id(m.config): m.config for m in ours.modules() if getattr(m, "config", None) is not None
    }.values():
        c._attn_implementation = "flash_standin"
    rows = _rows()
    batch = transformers.DataCollatorWithFlattening(return_tensors="pt")(
        [{"input_ids": r.tolist()} for r in rows]
    )
    if mask == "all_ones":
        batch["attention_mask"] = torch.ones_like(batch["input_ids"])
    want = _alone(ref, rows)
    stock = ours(**batch, use_cache=False).loss  # the attention keeps them apart, the mixers do not
    assert abs(float(stock) - float(want)) > 1e-5 * abs(float(want)), (float(stock), float(want))
    keep_sequences_apart(ours)
    got = ours(**batch, use_cache=False).loss
    assert abs(float(got) - float(want)) <= 1e-5 * abs(float(want)), (float(got), float(want))
    got.backward()
    want.backward()
    _grads_close(ours, ref)


def test_the_cp_keyword_is_the_backends():
    """The mixers stand aside under a dynamic-CP shard, told by the keyword the backend defines."""
    from mmbalance.integrations.hf import mixers
    from mmbalance.integrations.hf.attention import CP_KEYWORD

    assert mixers.CP_KEYWORD == CP_KEYWORD


@pytest.mark.parametrize("order", ["top_first", "bottom_first"])
def test_forwards_stacked_on_a_module_come_off_in_either_order(order):
    """Two wrappers on one module (dynamic CP's and the mixers'): taking the lower one off first
    leaves it passing calls through until the upper one goes; then the module has its class's."""
    from mmbalance.integrations.hf.mixers import unwrap_forward, wrap_forward

    m = torch.nn.Linear(2, 2)
    calls = []

    def wrapper(name, below):
        def forward(x):
            calls.append(name)
            return below(x)

        return forward

    low = wrap_forward(m, wrapper("low", m.forward))
    high = wrap_forward(m, wrapper("high", m.forward))
    m(torch.zeros(1, 2))
    assert calls == ["high", "low"]
    first, second = (high, low) if order == "top_first" else (low, high)
    unwrap_forward(m, first)
    assert ("forward" in vars(m)) and (m.forward is (low if order == "top_first" else high))
    unwrap_forward(m, second)
    assert "forward" not in vars(m)
