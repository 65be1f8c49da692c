"""Tiny decoders that mix tokens outside softmax attention, from the installed transformers' own
config classes (random weights, hidden size 32, a few layers, no downloads).

``tiny(model_type)`` builds the causal LM of a hybrid family with at least one mixer layer and,
where the family has them, one attention layer; ``HYBRIDS`` names the families with the settings
that make them tiny. A family the installed release lacks is skipped by the caller.
"""

from __future__ import annotations

import torch

SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1,
             head_dim=16, max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2)  # fmt: skip
# (twice the value heads as key heads, as the released Qwen3.5 and Qwen3-Next have them)
GDN = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)
MAMBA = dict(
    mamba_d_state=8, mamba_n_heads=4, mamba_d_head=16, mamba_head_dim=16, mamba_n_groups=1, mamba_expand=2
)
TWO = ["linear_attention", "full_attention"]

#: model_type -> the settings of its tiny config (on top of SMALL)
HYBRIDS: dict[str, dict] = {
    "qwen3_5": dict(num_hidden_layers=2, layer_types=TWO, **GDN),
    "qwen3_5_moe": dict(num_hidden_layers=2, layer_types=TWO, **GDN, **MOE),
    "qwen3_next": dict(num_hidden_layers=2, layer_types=TWO, **GDN, **MOE),
    "olmo_hybrid": dict(num_hidden_layers=2, layer_types=TWO, **GDN),
    "minimax": dict(num_hidden_layers=2, layer_types=TWO, num_local_experts=4, num_experts_per_tok=2),
    "lfm2": dict(num_hidden_layers=2, full_attn_idxs=[1]),
    "jamba": dict(
        num_hidden_layers=2,
        attn_layer_period=2,
        attn_layer_offset=1,
        expert_layer_period=2,
        expert_layer_offset=1,
        num_experts=2,
        num_experts_per_tok=1,
        mamba_d_state=8,
        mamba_dt_rank=4,
    ),
    "bamba": dict(num_hidden_layers=2, attn_layer_indices=[1], **MAMBA),
    # (its own names for the Mamba sizes: 128 heads and states by default)
    "nemotron_h": dict(
        num_hidden_layers=2, hybrid_override_pattern="M*", mamba_num_heads=4, ssm_state_size=8, **MAMBA
    ),
    "falcon_h1": dict(num_hidden_layers=2, mamba_d_ssm=64, **MAMBA),
    "granitemoehybrid": dict(
        num_hidden_layers=2,
        layer_types=["mamba", "attention"],
        num_local_experts=2,
        num_experts_per_tok=1,
        **MAMBA,
    ),
    "zamba2": dict(num_hidden_layers=2, layers_block_type=["mamba", "hybrid"], **MAMBA),
    "mamba2": dict(num_hidden_layers=2, num_heads=4, head_dim=16, state_size=8, n_groups=1, expand=2),
}


def tiny_config(model_type: str):
    from transformers import CONFIG_MAPPING

    base = CONFIG_MAPPING[model_type]()
    text = base.get_text_config() if hasattr(base, "get_text_config") else base
    return type(text)(**{**SMALL, **HYBRIDS[model_type]})


def tiny(model_type: str):
    """The tiny causal LM of ``model_type`` (refused if it would not be tiny)."""
    from transformers import AutoModelForCausalLM

    cfg = tiny_config(model_type)
    with torch.device("meta"):
        shape = AutoModelForCausalLM.from_config(cfg)
    size = sum(p.numel() for p in shape.parameters())
    assert size < 5e6, f"{model_type}: the tiny config has {size / 1e6:.1f}M parameters"
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg)
