"""A hybrid is priced by its layer mix (``cp/inputs.layer_mix``, ``CostModel.transformer``'s
``attention_layers``): its Gated DeltaNet layers cost linearly in length, its full-attention layers
quadratically; dynamic CP (``cost_model_of``) and ``balance_trainer``'s sampler use it."""

from __future__ import annotations

import pytest

transformers = pytest.importorskip("transformers", minversion="5.6")

from mmbalance.balancing import CostModel  # noqa: E402
from mmbalance.balancing.plan import DEFAULT_BETA  # noqa: E402
from mmbalance.integrations.hf.cp import cost_model_of, layer_mix  # noqa: E402
from tests.integrations.hybrids import tiny_config  # noqa: E402


@pytest.mark.parametrize("model_type", ["qwen3_5", "qwen3_5_moe", "qwen3_next"])
def test_the_gated_deltanet_layers_cost_linearly(model_type):
    cfg = tiny_config(model_type)
    cfg.num_hidden_layers, cfg.layer_types = 4, ["linear_attention"] * 3 + ["full_attention"]
    assert layer_mix(cfg) == (4, 1)

    class Holder:  # cost_model_of reads the model's text config
        config = cfg

    got = cost_model_of(Holder(), "quadratic")
    dense = CostModel.transformer(
        hidden_size=cfg.hidden_size, num_layers=4, kv_size=cfg.num_key_value_heads * cfg.head_dim,
        ffn_size=cfg.intermediate_size,
    )  # fmt: skip
    assert got.attention == pytest.approx(dense.attention / 4, rel=1e-12)  # one layer in four
    assert got.ring == pytest.approx(dense.ring / 4, rel=1e-12)
    state = cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim
    assert got.linear == pytest.approx(dense.linear + 18.0 * state * 3 / 400e12, rel=1e-12)
    # so a long sequence weighs less against short ones than in the dense model of its shape
    long, short = 4096, 512
    assert got.time([long]) / got.time([short]) < dense.time([long]) / dense.time([short])


def test_a_config_without_layer_types_is_all_attention_and_bad_counts_are_refused():
    cfg = transformers.LlamaConfig(num_hidden_layers=3)
    assert layer_mix(cfg) == (3, 3)
    with pytest.raises(ValueError, match="attention_layers"):
        CostModel.transformer(num_layers=2, attention_layers=3)
    with pytest.raises(TypeError, match="linear_state"):
        CostModel.transformer(linear_state=1.5)


def test_balance_trainer_scales_the_samplers_attention_weight(tmp_path):
    from mmbalance.integrations.hf import balance_trainer
    from tests.integrations.hybrids import tiny
    from tests.integrations.test_every_trainer import _args, _collate, _rows

    model = tiny("qwen3_5")  # layer_types: one linear-attention layer, one full-attention layer
    assert layer_mix(model.config) == (2, 1)
    trainer = transformers.Trainer(
        model=model, args=_args(tmp_path), train_dataset=_rows(), data_collator=_collate
    )
    balance_trainer(trainer)
    assert trainer.balanced_sampler.beta == pytest.approx(DEFAULT_BETA / 2)
