"""Launched by test_hf_attention_amp.py on 2 CPU ranks (the environment torchrun gives its
workers): TRL's ``SFTTrainer`` with its default ``SFTConfig`` (``bf16=True``: mixed precision, and
gradient checkpointing) on a tiny Llama with ``attn_implementation="mmbalance_varlen"`` and
``balance_trainer``, padded batches, then the same with ``packing=True`` (TRL packs sequences into rows,
restarting ``position_ids``). Each rank writes the dtypes the attention op ran in, the most
sequences one op call held, and the losses it logged to ``$MMB_TMP/sft-<run>-rank<r>.json``."""

from __future__ import annotations

import json
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

N, VOCAB = 24, 64


def build_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    from mmbalance.integrations.hf import register_attention

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      pad_token_id=0, bos_token_id=1, eos_token_id=2)  # fmt: skip
    return LlamaForCausalLM._from_config(cfg, attn_implementation=register_attention())


def train(run: str, **config) -> None:
    import datasets
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast
    from trl import SFTConfig, SFTTrainer

    import mmbalance.integrations.hf.attention.backend as attn
    from mmbalance.integrations.hf import balance_trainer

    seen: set[str] = set()
    sequences = [0]
    real = attn.attention_block

    def spy(q, k, v, cu_q, *args, **kwargs):
        seen.add(str(q.dtype))
        sequences[0] = max(sequences[0], cu_q.numel() - 1)
        return real(q, k, v, cu_q, *args, **kwargs)

    attn.attention_block = spy
    tmp = os.environ["MMB_TMP"]
    vocab = {f"t{i}": i for i in range(VOCAB)}
    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t1")), pad_token="t0", eos_token="t2"
    )
    g = torch.Generator().manual_seed(3)
    lengths = (4 + torch.rand(N, generator=g) ** 3 * 40).long().tolist()
    ids = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lengths]
    # the defaults, except what a CPU test needs: no GPU, no logging integrations, no checkpoints
    args = SFTConfig(output_dir=os.path.join(tmp, run), use_cpu=True, report_to=[], disable_tqdm=True,
                     save_strategy="no", per_device_train_batch_size=2, max_steps=3, logging_steps=1,
                     **config)  # fmt: skip
    assert args.bf16, "SFTConfig's default is bf16=True"
    trainer = SFTTrainer(model=build_model(), args=args, processing_class=tok,
                         train_dataset=datasets.Dataset.from_dict({"input_ids": ids}))  # fmt: skip
    balance_trainer(trainer)
    trainer.train()
    attn.attention_block = real
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    assert losses and all(math.isfinite(x) for x in losses), losses
    with open(os.path.join(tmp, f"sft-{run}-rank{os.environ['RANK']}.json"), "w") as f:
        json.dump({"dtypes": sorted(seen), "sequences": sequences[0], "losses": losses,
                   "steps": trainer.state.global_step}, f)  # fmt: skip


def main() -> None:
    train("padded")
    train("packed", packing=True, max_length=48)
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
