"""A plain training step with dynamic context parallelism on every rank (run by test_dynamic_cp.py
through tests.dist_utils.launch, as torchrun would start it).

Every rank draws its own examples; ``handle.shard`` post-balances them into CP groups; the loss and
every parameter gradient, summed over ranks, must equal a one-process reference (each sequence
alone through the stock eager attention, token-loss sum over the global count).

argv: one or more ``family:form:scenario`` runs: family llama | qwen2, one with attention
features (sliding windows, softcap, sinks: see :func:`tiny_model`), or a Gated DeltaNet hybrid
(qwen3_5, qwen3_5_moe, qwen3_next, olmo_hybrid: a linear-attention layer and a full-attention one),
batch form packed | padded,
scenario long (one sequence over 2x the budget) | mixed (a schedule of degrees 3 and 1, forced by a
cost with an expensive ring; the model wrapped in DDP, which averages the gradients) | fsdp2 (the
data of long, the model under FSDP2: every decoder layer and the root ``fully_shard``-ed) | ckpt (the
data of long, with transformers' gradient checkpointing: backward recomputes every layer, its ring
attention included) | amp (the
data of long, the forward under ``torch.autocast`` in bfloat16, as Trainer's ``bf16=True`` runs it;
tolerances of bfloat16) | compile (2 ranks: a sequence split over both, the model under
``torch.compile`` with the ``aot_eager`` backend; then more steps of other lengths, with and
without a split sequence; every rank's compiled graphs after each step, and those of the same steps
without CP: the attention of a shard is one graph break, not traced) | strided (the
handle balances over a data-parallel sub-group, ranks {0, 2} and {1, 3} as under tensor parallelism
of 2, each splitting a sequence over its two ranks) | triple (sub-groups {0} and {1, 2, 3}; in the
second a sequence is split over two of its ranks, a ring inside the sub-group that rank 0 helps
create, and the third runs degree 1) | pair (2 ranks: a sequence over the budget split over both)
| apart, apart0 (the data of pair, ``keep_sequences_apart`` called after ``apply_dynamic_cp`` and
taken off after it, or before it and taken off before it: the Gated DeltaNet layers still run the
CP path under a shard, and nothing is left on the model after both are removed) | lora (the data
of pair, the model a peft LoRA ``PeftModel``: the handle shards the model inside,
and ``remove()`` leaves it without a hook) | switch (2 ranks: the attention switched away from
mmbalance_varlen after ``apply_dynamic_cp``, sdpa for Mistral, eager otherwise; a forward of a
shard and the next ``shard`` raise on every rank) | switch1 (2 ranks: rank 0 alone switches to
eager after ``shard``; both ranks raise within seconds, naming the attention and the rank). In the
sub-group scenarios each group is
checked against its own reference (its examples, its count). Rank 0 prints one JSON line per run.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import torch
import torch.distributed as dist

FAMILY = FORM = SCENARIO = ""
BUDGET = 64
VOCAB = 96


def tiny_model(attn: str):
    """The run's tiny model. Families with attention features: mistral16 (a window of 16 on every
    layer, shorter than the zigzag chunks of the long sequence), mistral (its default window of
    4096: plain causal attention here), gemma2 (window 16 on alternate layers, logit softcap 2),
    gemma3 (a local layer of window 16 and a global one), cohere2 (the same mix; RoPE on the local
    layer only), gptoss (window 16 on alternate layers and a sink per head), qwen2sw (Qwen2's
    use_sliding_window on its upper layer)."""
    import transformers as tf

    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  pad_token_id=0, tie_word_embeddings=False)  # fmt: skip
    families = {
        "llama": (tf.LlamaForCausalLM, tf.LlamaConfig, {}),
        "qwen2": (tf.Qwen2ForCausalLM, tf.Qwen2Config, {}),
        "qwen2sw": (tf.Qwen2ForCausalLM, tf.Qwen2Config,
                    {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 1}),
        "mistral16": (tf.MistralForCausalLM, tf.MistralConfig, {"sliding_window": 16}),
        "mistral": (tf.MistralForCausalLM, tf.MistralConfig, {}),
        "gemma2": (tf.Gemma2ForCausalLM, tf.Gemma2Config,
                   {"head_dim": 8, "sliding_window": 16, "attn_logit_softcapping": 2.0, "query_pre_attn_scalar": 8}),
        "gemma3": (tf.Gemma3ForCausalLM, tf.Gemma3TextConfig,
                   {"head_dim": 8, "sliding_window": 16, "query_pre_attn_scalar": 8,
                    "layer_types": ["sliding_attention", "full_attention"]}),
        "cohere2": (tf.Cohere2ForCausalLM, tf.Cohere2Config,
                    {"sliding_window": 16, "layer_types": ["sliding_attention", "full_attention"]}),
        "gptoss": (tf.GptOssForCausalLM, tf.GptOssConfig,
                   {"head_dim": 8, "sliding_window": 16, "num_local_experts": 4, "num_experts_per_tok": 2,
                    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}),
    }  # fmt: skip
    if FAMILY in (
        "qwen3_5",
        "qwen3_5_moe",
        "qwen3_next",
        "olmo_hybrid",
    ):  # Gated DeltaNet beside full attention
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
        from tests.integrations.hybrids import tiny_config

        cfg = tiny_config(FAMILY)
        cfg.vocab_size, cfg.pad_token_id, cfg.max_position_embeddings = VOCAB, 0, 512
        torch.manual_seed(0)
        model = tf.AutoModelForCausalLM.from_config(cfg, attn_implementation=attn, dtype=torch.float32)
        # decays of e^-0.1 to e^-1.3 a token: transformers initialises A up to 16 (e^-21 a token), where the
        # stock chunked rule's float32 gradient of the decay is itself far off the float64 truth (74% in one
        # head of this model, against 3e-6 here), so no reference could hold the split run to 1e-5
        with torch.no_grad():
            for module in model.modules():
                if hasattr(module, "A_log"):
                    module.A_log.copy_(torch.linspace(0.1, 1.0, module.A_log.numel()).log())
        return model
    cls, cfg_cls, extra = families[FAMILY]
    cfg = cfg_cls(**common, **extra)
    torch.manual_seed(0)
    model = cls._from_config(cfg, attn_implementation=attn, dtype=torch.float32)
    if FAMILY == "gptoss":  # sinks far from zero, so a sink counted twice or never would show
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.sinks.copy_(torch.linspace(-1.0, 2.0, layer.self_attn.sinks.numel()))
    return model


def examples(world: int) -> list[list[dict]]:
    """Per rank, its examples: ``input_ids`` and ``labels`` (prompt tokens masked with -100)."""
    rng = np.random.default_rng(7)
    if SCENARIO in ("long", "fsdp2", "ckpt", "amp"):
        lengths = [[9, 23], [150, 5], [17, 30, 2], [12]]  # 150 > 2 * BUDGET
    elif SCENARIO == "strided":
        lengths = [[9, 11], [17, 20, 2], [90, 5], [12, 70]]  # 90 and 70 > BUDGET, in {0, 2} and {1, 3}
    elif SCENARIO in (
        "compile",
        "pair",
        "lora",
        "switch",
        "switch1",
        "apart",
        "apart0",
    ):  # 2 ranks: 90 > BUDGET
        lengths = [[9, 90], [17, 5]]

    elif SCENARIO == "triple":
        lengths = [[9, 23, 30], [100, 3], [17, 2], [12, 20]]  # 100 > BUDGET in {1, 2, 3}
    else:
        lengths = [[11], [180], [20, 9], [14, 1]]  # forced 3 + 1 by the cost below
    out = []
    for r in range(world):
        mine = []
        for n in lengths[r]:
            ids = rng.integers(1, VOCAB, size=n).tolist()
            labels = list(ids)
            for i in range(min(3, n)):
                labels[i] = -100
            mine.append({"input_ids": ids, "labels": labels})
        out.append(mine)
    return out


def batch_of(mine: list[dict]) -> dict:
    if FORM == "packed":
        from transformers import DataCollatorWithFlattening

        return DataCollatorWithFlattening(return_tensors="pt")(mine)
    width = max(len(e["input_ids"]) for e in mine)
    left = dist.get_rank() % 2 == 1  # odd ranks pad on the left
    ids = torch.zeros((len(mine), width), dtype=torch.int64)
    lab = torch.full((len(mine), width), -100, dtype=torch.int64)
    mask = torch.zeros((len(mine), width), dtype=torch.int64)
    for i, e in enumerate(mine):
        n = len(e["input_ids"])
        sl = slice(width - n, width) if left else slice(0, n)
        ids[i, sl] = torch.tensor(e["input_ids"])
        lab[i, sl] = torch.tensor(e["labels"])
        mask[i, sl] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": lab}


LAYOUTS = {"strided": [[0, 2], [1, 3]], "triple": [[0], [1, 2, 3]]}


def as_trained(model):
    """The run's model as the training loop calls it: a peft LoRA model around it (lora; adapters
    on the attention and MLP projections, initialised at random so that they matter), else itself."""
    if SCENARIO != "lora":
        return model
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(1)
    config = LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False
    )
    return get_peft_model(model, config)


def hooks_of(model) -> tuple:
    """What the handle may add to a model: forward hooks and a loss function of its own."""
    return len(model._forward_pre_hooks), len(model._forward_hooks), "_loss_function" in model.__dict__


def run_one() -> None:
    if SCENARIO in LAYOUTS:
        run_in_subgroups(LAYOUTS[SCENARIO])
        return
    if SCENARIO == "switch":
        run_switch()
        return
    if SCENARIO == "switch1":
        run_switch_one()
        return
    from mmbalance.balancing import CostModel
    from mmbalance.integrations.hf import apply_dynamic_cp, keep_sequences_apart

    rank, world = dist.get_rank(), dist.get_world_size()
    base = tiny_model("mmbalance_varlen")
    model = as_trained(base)
    cost = "quadratic" if SCENARIO != "mixed" else CostModel(linear=1.0, ring=0.5, overlap=False)
    if SCENARIO == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
    attn_calls = []
    if SCENARIO != "compile":  # (hooks are guarded by dynamo: they would cost recompiles there)
        # the dtype the attention gave (o_proj's input: its output is bfloat16 under autocast anyway)
        next(
            layer for layer in base.model.layers if hasattr(layer, "self_attn")
        ).self_attn.o_proj.register_forward_pre_hook(lambda m, a: attn_calls.append(a[0].dtype))
    if SCENARIO == "ckpt":
        model.gradient_checkpointing_enable()
        model.train()
    bare = hooks_of(base)
    apart = None
    if SCENARIO == "apart0":  # the mixers kept apart first, dynamic CP on them
        apart = keep_sequences_apart(model)
    handle = apply_dynamic_cp(model, max_tokens_per_rank=BUDGET, cost=cost)
    if SCENARIO == "apart":  # dynamic CP first, the mixers kept apart on it
        apart = keep_sequences_apart(model)
    assert (apart is not None) == (SCENARIO in ("apart", "apart0")), f"rank {rank}: no mixers to keep apart"
    data = examples(world)
    seen = []
    if SCENARIO != "compile":
        embed = model.get_input_embeddings()
        embed.register_forward_hook(lambda m, i, o: seen.append(int(i[0].numel())))
    inputs = handle.shard(batch_of(data[rank]))
    ddp = SCENARIO in ("mixed", "fsdp2")  # they average the gradients over ranks: scale by the world
    if SCENARIO == "mixed":
        from torch.nn.parallel import DistributedDataParallel

        wrapped = DistributedDataParallel(model)  # kept alive until backward has reduced the gradients
        loss = wrapped(**inputs).loss
        (loss * world).backward()
        del wrapped
    elif SCENARIO == "fsdp2":
        loss = model(**inputs).loss  # the model was sharded (every decoder layer, then the root) above
        (loss * world).backward()
    elif SCENARIO == "compile":
        import torch._dynamo as dynamo
        from torch._dynamo.utils import counters

        dynamo.reset()  # this run's caches and counters only
        counters.clear()
        compiled = torch.compile(model, backend="aot_eager")  # dynamo and AOT autograd
        loss = compiled(**inputs).loss
        loss.backward()
        first_graphs = int(counters["stats"]["unique_graphs"])
    elif SCENARIO == "amp":  # as Trainer's bf16=True (TRL's default) runs the forward
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(**inputs).loss
        loss.backward()
        assert attn_calls == [torch.bfloat16], f"rank {rank}: the attention gave {attn_calls}"
    else:
        loss = model(**inputs).loss
        loss.backward()
    stats = handle.stats
    want = 2 if SCENARIO == "ckpt" else 0 if SCENARIO == "compile" else 1  # forward, and recompute
    assert len(attn_calls) == want, (
        f"rank {rank}: layer 0's attention ran {len(attn_calls)} times, not {want}"
    )
    if SCENARIO in ("compile", "pair", "lora", "apart", "apart0"):  # 2 ranks, one sequence split over both
        assert stats["largest_shard"] <= BUDGET and stats["degrees"] == [2], stats
    elif SCENARIO != "mixed":
        assert max(seen) <= BUDGET, f"rank {rank} embedded {max(seen)} tokens, budget {BUDGET}"
        assert stats["largest_shard"] <= BUDGET, stats
        assert max(stats["degrees"]) >= 3, stats
    else:
        assert max(seen) <= BUDGET and stats["largest_shard"] <= BUDGET, (seen, stats)
        assert sorted(stats["degrees"]) == [1, 3], stats
    total = loss.detach().clone()
    dist.all_reduce(total)
    grads = {n: full(p.grad).detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    if not ddp:
        for g in grads.values():
            dist.all_reduce(g)
    graphs = None
    if SCENARIO == "compile":  # every rank's compiled graphs after each step
        stats = dict(stats)
        mine = [first_graphs, *more_compiled_steps(handle, compiled, rank)]
        mine.append(graphs_without_cp(data[rank], rank))  # last: the same steps without CP
        graphs = [None] * world
        dist.all_gather_object(graphs, mine)
    if rank == 0:
        ref, ref_total, count = reference([e for mine in data for e in mine])
        assert inputs["num_items_in_batch"] == count, (inputs["num_items_in_batch"], count)
        rel = abs(float(total) - ref_total) / abs(ref_total)
        # under autocast, bfloat16's rounding against the float32 reference (measured: loss
        # 4e-6 to 9e-6, gradients 0.7%-0.75%); a token scored twice or not at all is off by its
        # whole share
        tol_loss, tol_grad = (1e-3, 0.05) if SCENARIO == "amp" else (1e-5, 1e-5)
        assert rel <= tol_loss, f"loss {float(total)} vs reference {ref_total} (rel {rel:.2e})"
        worst = 0.0
        for n, p in ref.named_parameters():
            if not p.requires_grad:  # a LoRA model's frozen base
                continue
            diff = (grads[n] - p.grad).norm() / p.grad.norm().clamp_min(1e-30)
            worst = max(worst, float(diff))
            assert diff <= tol_grad, f"gradient of {n}: relative error {float(diff):.2e}"
        print(json.dumps({"run": f"{FAMILY}:{FORM}:{SCENARIO}", "degrees": stats["degrees"], "largest_shard": stats["largest_shard"], "loss_rel": rel,
                          "grad_rel": worst, "before": stats["before"], "after": stats["after"], "graphs": graphs}))  # fmt: skip
    if SCENARIO == "apart0":  # taken off in the order they came: each wrapper under the other
        apart.remove()
    handle.remove()
    if SCENARIO == "apart":
        apart.remove()
    # the model inside a wrapper was sharded, and remove() leaves it as it was
    assert handle.model is base, f"rank {rank}: the handle held {type(handle.model).__name__}"
    assert hooks_of(base) == bare, f"rank {rank}: hooks {hooks_of(base)} after remove(), {bare} before"
    left = [type(m).__name__ for m in base.modules() if "forward" in vars(m)]
    assert not left, f"rank {rank}: forwards left on {left}"
    dist.barrier()


def more_compiled_steps(handle, compiled, rank: int) -> list[int]:
    """Four more steps of the compiled model, with a sequence split over both ranks or only whole
    ones; returns the compiled graphs so far after each (dynamo's counter of this process)."""
    from torch._dynamo.utils import counters

    graphs = []
    for step, mine in enumerate(later_batches(rank)):
        compiled(**handle.shard(batch_of(mine))).loss.backward()
        split = step % 2 == 0
        assert max(handle.stats["degrees"]) == (2 if split else 1), (step, handle.stats)
        graphs.append(int(counters["stats"]["unique_graphs"]))
    return graphs


def later_batches(rank: int) -> list[list[dict]]:
    """This rank's examples of four more steps: a sequence over the budget on rank 0 every other."""
    rng = np.random.default_rng(100 + rank)
    out = []
    for step in range(4):
        split = step % 2 == 0
        lengths = [int(rng.integers(3, 20))] + ([int(rng.integers(70, 90))] if split and rank == 0 else [])
        mine = []
        for n in lengths:
            ids = rng.integers(1, VOCAB, size=n).tolist()
            mine.append({"input_ids": ids, "labels": ids})
        out.append(mine)
    return out


def graphs_without_cp(first: list[dict], rank: int) -> int:
    """The graphs dynamo compiles for the same model and steps without the handle (each rank's own
    packed batch through varlen attention): what the CP steps are held to."""
    import torch._dynamo as dynamo
    from torch._dynamo.utils import counters

    dynamo.reset()
    counters.clear()
    model = tiny_model("mmbalance_varlen")
    compiled = torch.compile(model, backend="aot_eager")
    for mine in [first, *later_batches(rank)]:
        compiled(**batch_of(mine)).loss.backward()
    return int(counters["stats"]["unique_graphs"])


def full(grad: torch.Tensor) -> torch.Tensor:
    """A gradient as one tensor: FSDP2 keeps each rank's shard of it (a ``DTensor``)."""
    return grad.full_tensor() if hasattr(grad, "full_tensor") else grad


def reference(examples: list[dict]):
    """The one-process reference: every example alone through eager attention, the token-loss sum
    over the examples' labelled count. Returns the model (its gradients) and the summed loss."""
    ref = as_trained(tiny_model("eager"))
    count = sum(sum(1 for x in e["labels"][1:] if x != -100) for e in examples)
    total = torch.zeros(())
    for e in examples:
        out = ref(input_ids=torch.tensor([e["input_ids"]]), labels=torch.tensor([e["labels"]]),
                  num_items_in_batch=count)  # fmt: skip
        out.loss.backward()
        total += out.loss.detach()
    return ref, float(total), count


def run_switch() -> None:
    """The attention switched after ``apply_dynamic_cp`` (``set_attn_implementation``, then the
    config's field alone): the forward of a shard's keywords and the next ``shard`` raise
    ValueError on every rank, naming the attention found and the fix."""
    from mmbalance.integrations.hf import apply_dynamic_cp

    rank, world = dist.get_rank(), dist.get_world_size()
    model = tiny_model("mmbalance_varlen")
    handle = apply_dynamic_cp(model, max_tokens_per_rank=BUDGET)
    data = examples(world)
    inputs = handle.shard(batch_of(data[rank]))
    assert max(handle.stats["degrees"]) == 2, handle.stats
    other = "sdpa" if FAMILY.startswith("mistral") else "eager"
    caught = []
    for how in ("set_attn_implementation", "config"):
        if how == "set_attn_implementation":
            model.set_attn_implementation(other)
        else:
            model.set_attn_implementation("mmbalance_varlen")
            model.config._attn_implementation = other
        for where in ("forward", "shard"):
            try:
                if where == "forward":
                    model(**inputs)
                else:
                    handle.shard(batch_of(data[rank]))
            except ValueError as exc:
                text = str(exc)
                assert repr(other) in text and "set_attn_implementation('mmbalance_varlen')" in text, text
                caught.append(f"{how}:{where}")
            else:
                raise AssertionError(f"rank {rank}: a {where} under {other} ({how}) did not raise")
    model.set_attn_implementation("mmbalance_varlen")
    model(**handle.shard(batch_of(data[rank]))).loss.backward()  # switched back, it trains again
    every = [None] * world
    dist.all_gather_object(every, caught)
    if rank == 0:
        print(json.dumps({"run": f"{FAMILY}:{FORM}:{SCENARIO}", "raised": every}))
    handle.remove()
    dist.barrier()


def run_switch_one() -> None:
    """Rank 0 alone switches its attention to eager after ``shard``: both ranks raise within
    seconds (rank 0 naming eager, rank 1 naming rank 0), none waits in the ring for the other."""
    import time

    from mmbalance.integrations.hf import apply_dynamic_cp

    rank, world = dist.get_rank(), dist.get_world_size()
    model = tiny_model("mmbalance_varlen")
    handle = apply_dynamic_cp(model, max_tokens_per_rank=BUDGET)
    inputs = handle.shard(batch_of(examples(world)[rank]))
    assert max(handle.stats["degrees"]) == 2, handle.stats
    if rank == 0:
        model.set_attn_implementation("eager")
    start = time.monotonic()
    try:
        model(**inputs)
    except ValueError as exc:
        text = str(exc)
    else:
        raise AssertionError(f"rank {rank}: the forward ran")
    took = time.monotonic() - start
    want = "'eager'" if rank == 0 else "rank 0 of this rank's context-parallel group runs another attention"
    assert want in text and "mmbalance_varlen" in text, text
    every = [None] * world
    dist.all_gather_object(every, took)
    if rank == 0:
        print(json.dumps({"run": f"{FAMILY}:{FORM}:{SCENARIO}", "seconds": every}))
    handle.remove()
    dist.barrier()


def run_in_subgroups(layout: list[list[int]]) -> None:
    """``apply_dynamic_cp(..., group=...)`` over each data-parallel sub-group of ``layout``: the
    plan, the all-to-all and the rings stay inside the group, whose loss and gradients (summed over
    its ranks) equal the reference of its own examples."""
    from mmbalance.integrations.hf import apply_dynamic_cp

    rank, world = dist.get_rank(), dist.get_world_size()
    groups = [dist.new_group(ranks) for ranks in layout]  # collective: every rank creates each
    mine = next(i for i, ranks in enumerate(layout) if rank in ranks)
    group = groups[mine]
    model = tiny_model("mmbalance_varlen")
    handle = apply_dynamic_cp(model, max_tokens_per_rank=BUDGET, cost="quadratic", group=group)
    data = examples(world)
    inputs = handle.shard(batch_of(data[rank]))
    loss = model(**inputs).loss
    loss.backward()
    stats = handle.stats
    assert stats["largest_shard"] <= BUDGET, stats
    total = loss.detach().clone()
    dist.all_reduce(total, group=group)
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    for g in grads.values():
        dist.all_reduce(g, group=group)
    result = None
    if rank == layout[mine][0]:
        ref, ref_total, count = reference([e for r in layout[mine] for e in data[r]])
        assert inputs["num_items_in_batch"] == count, (inputs["num_items_in_batch"], count)
        rel = abs(float(total) - ref_total) / abs(ref_total)
        worst = max(
            float((grads[n] - p.grad).norm() / p.grad.norm().clamp_min(1e-30))
            for n, p in ref.named_parameters()
        )
        result = {"ranks": layout[mine], "degrees": stats["degrees"], "largest_shard": stats["largest_shard"],
                  "loss_rel": rel, "grad_rel": worst}  # fmt: skip
    every = [None] * world
    dist.all_gather_object(every, result)
    if rank == 0:
        print(json.dumps({"run": f"{FAMILY}:{FORM}:{SCENARIO}", "groups": [x for x in every if x]}))
    handle.remove()
    dist.barrier()


def main() -> None:
    global FAMILY, FORM, SCENARIO
    from mmbalance.integrations.hf import register_attention

    dist.init_process_group("gloo")
    register_attention()
    for spec in sys.argv[1:]:
        FAMILY, FORM, SCENARIO = spec.split(":")
        run_one()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
