"""Dynamic context parallelism in Hugging Face models (``apply_dynamic_cp``).

The multi-rank runs (``cp_plain_loop.py``, 4 ranks as torchrun starts them) check loss and
gradients against a one-process reference; the rest runs in one process: parsing the two batch
forms, the plan's invariants, refusals by name.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

pytest.importorskip("transformers", minversion="5.6")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from mmbalance.balancing import CostModel  # noqa: E402
from mmbalance.integrations.hf import apply_dynamic_cp, register_attention  # noqa: E402
from mmbalance.integrations.hf.cp import plan_layout, split_sequences  # noqa: E402
from mmbalance.integrations.hf.cp.shard import CPShard  # noqa: E402
from tests.dist_utils import REPO, launch, run_distributed  # noqa: E402

SCRIPT = REPO / "tests" / "integrations" / "cp_plain_loop.py"


@pytest.mark.slow
@pytest.mark.distributed
def test_plain_loop_matches_one_process_reference_on_4_ranks():
    """The world as the group (long; mixed under DDP; fsdp2 under FSDP2; ckpt with gradient
    checkpointing; amp under bfloat16 autocast), and data-parallel sub-groups (strided, triple)."""
    world = ["llama:packed:long", "qwen2:padded:long", "llama:padded:mixed", "qwen2:packed:mixed"]
    world += ["qwen2:padded:fsdp2", "llama:packed:ckpt", "qwen2:packed:amp"]
    sub = ["llama:packed:strided", "qwen2:padded:triple"]
    out = launch(SCRIPT, *world, *sub, nproc=4, timeout=600)
    lines = [json.loads(x) for x in out.splitlines() if x.startswith("{")]
    assert [x["run"] for x in lines] == world + sub, out[-3000:]
    for x in lines[: len(world)]:
        assert max(x["degrees"]) >= 3 and x["largest_shard"] <= 64
        amp = x["run"].endswith("amp")  # bfloat16 autocast against the float32 reference
        assert x["loss_rel"] <= (1e-3 if amp else 1e-5) and x["grad_rel"] <= (0.05 if amp else 1e-5), x
        assert x["after"] < x["before"]
    assert all(sorted(x["degrees"]) == [1, 3] for x in lines if x["run"].endswith("mixed"))
    strided, triple = (x["groups"] for x in lines[len(world) :])
    assert [g["ranks"] for g in strided] == [[0, 2], [1, 3]] and all(g["degrees"] == [2] for g in strided)
    assert [(g["ranks"], sorted(g["degrees"])) for g in triple] == [([0], [1]), ([1, 2, 3], [1, 2])]
    for g in strided + triple:
        assert g["largest_shard"] <= 64 and g["loss_rel"] <= 1e-5 and g["grad_rel"] <= 1e-5, g


HYBRID_RUNS = ["qwen3_5:packed:long", "qwen3_5_moe:padded:long", "qwen3_next:packed:mixed", "qwen3_5:padded:fsdp2",
               "qwen3_next:packed:ckpt", "olmo_hybrid:packed:long"]  # fmt: skip


@pytest.mark.slow
@pytest.mark.distributed
def test_gated_deltanet_hybrids_match_the_reference_on_4_ranks():
    """Qwen3.5, Qwen3.5-MoE, Qwen3-Next and OLMo hybrid (a Gated DeltaNet layer and a full-attention one; the
    conv windows and the recurrent states handed along each CP group, cp/linear.py): one sequence
    over twice the budget split over 3 ranks beside a rank of degree 1 (long), degrees 3 and 1 under
    DDP (mixed), under FSDP2 and with gradient checkpointing; the summed loss and every gradient
    against each sequence alone through the stock layers."""
    out = launch(SCRIPT, *HYBRID_RUNS, nproc=4, timeout=900)
    lines = [json.loads(x) for x in out.splitlines() if x.startswith("{")]
    assert [x["run"] for x in lines] == HYBRID_RUNS, out[-3000:]
    for x in lines:
        assert sorted(x["degrees"]) == [1, 3] and x["largest_shard"] <= 64, x
        assert x["loss_rel"] <= 1e-5 and x["grad_rel"] <= 1e-5, x


PAIR_RUNS = ["qwen3_5:packed:pair", "qwen3_5:packed:apart", "qwen3_5:packed:apart0"]


@pytest.mark.distributed
def test_a_gated_deltanet_sequence_split_over_two_ranks_matches_the_reference():
    """Also with ``keep_sequences_apart`` installed after ``apply_dynamic_cp`` (apart: before the
    fix its wrapper replaced the CP path's, and each piece ran from a zero state, 3.4e-5 of the
    loss off) and before it (apart0), each taken off in either order, nothing left behind."""
    out = launch(SCRIPT, *PAIR_RUNS, nproc=2, timeout=600)
    lines = [json.loads(x) for x in out.splitlines() if x.startswith("{")]
    assert [x["run"] for x in lines] == PAIR_RUNS, out[-3000:]
    for line in lines:
        assert line["degrees"] == [2] and line["loss_rel"] <= 1e-5 and line["grad_rel"] <= 1e-5, line


FEATURE_RUNS = ["mistral16:packed:long", "mistral:padded:long", "gemma2:packed:long", "gemma3:padded:long",
                "cohere2:packed:long", "gptoss:packed:long", "qwen2sw:padded:long"]  # fmt: skip


@pytest.mark.slow
@pytest.mark.distributed
def test_windows_softcap_and_sinks_match_the_reference_on_4_ranks():
    """Every attention feature under the ring, each run with one sequence split over 3 ranks:
    Mistral with a window of 16 (shorter than the zigzag chunks, so the ring skips key shards) and
    with its default window (4096: plain causal attention), Gemma 2 (window on alternate layers and
    logit softcap), Gemma 3 and Cohere2 (a local and a global layer), gpt-oss (window and a sink per
    head) and Qwen2's use_sliding_window; loss and summed gradients against every sequence alone through the
    stock eager attention."""
    out = launch(SCRIPT, *FEATURE_RUNS, nproc=4, timeout=600)
    lines = [json.loads(x) for x in out.splitlines() if x.startswith("{")]
    assert [x["run"] for x in lines] == FEATURE_RUNS, out[-3000:]
    for x in lines:
        assert max(x["degrees"]) >= 3 and x["largest_shard"] <= 64, x
        assert x["loss_rel"] <= 1e-5 and x["grad_rel"] <= 1e-5, x


@pytest.mark.slow
@pytest.mark.distributed
def test_compiled_model_matches_the_reference_and_compiles_once():
    """``torch.compile`` (aot_eager) of a model whose shard splits a sequence over 2 ranks: loss and
    gradients as the reference; then steps with and without a split sequence compile no new graph
    after the second, on every rank (the shard's attention is one graph break: traced, the ring
    broke the graph dozens of times and hit dynamo's recompile limit in the first step)."""
    out = launch(SCRIPT, "llama:packed:compile", nproc=2, timeout=600)
    (x,) = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert x["degrees"] == [2] and x["largest_shard"] <= 64, x
    assert x["loss_rel"] <= 1e-5 and x["grad_rel"] <= 1e-5, x
    # per rank: graphs after each of the 5 CP steps, then of the same steps without CP. After the
    # second step (dynamic shapes) no new graph; and no more graphs than without CP (traced, the
    # ring made 34 against 16)
    for graphs in x["graphs"]:
        *cp, plain = graphs
        assert len(set(cp[1:])) == 1 and cp[-1] <= plain, x


@pytest.mark.distributed
def test_two_ranks_with_a_lora_model_match_the_reference_and_a_switched_attention_raises():
    """2 ranks, one sequence over the budget split over both: the plain model and a peft LoRA
    model (the model inside is sharded; ``remove()`` leaves it without a hook) match the
    one-process reference. Then the attention switched after ``apply_dynamic_cp`` (Mistral with a
    window to sdpa, Gemma 2 to eager; by ``set_attn_implementation`` and by the config's field):
    a forward of a shard and the next ``shard`` raise on every rank, instead of a wrong loss; one
    rank alone switching after ``shard`` makes both raise within 5 seconds, naming the attention."""
    runs = ["llama:packed:pair", "qwen2:padded:lora", "mistral16:packed:switch", "gemma2:padded:switch",
            "llama:packed:switch1"]  # fmt: skip
    out = launch(SCRIPT, *runs, nproc=2, timeout=600)
    lines = [json.loads(x) for x in out.splitlines() if x.startswith("{")]
    assert [x["run"] for x in lines] == runs, out[-3000:]
    # one rank alone switched after shard: both raise at once (the group agrees before any ring)
    assert all(t < 5.0 for t in lines.pop()["seconds"]), lines
    for x in lines[:2]:
        assert x["degrees"] == [2] and x["largest_shard"] <= 64, x
        assert x["loss_rel"] <= 1e-5 and x["grad_rel"] <= 1e-5, x
    every = [
        f"{how}:{where}" for how in ("set_attn_implementation", "config") for where in ("forward", "shard")
    ]
    for x in lines[2:]:
        assert x["raised"] == [every, every], x


def _tiny(attn="mmbalance_varlen", **extra):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    register_attention()
    cfg = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, **extra)  # fmt: skip
    torch.manual_seed(0)
    return Qwen2ForCausalLM._from_config(cfg, attn_implementation=attn)


def _kept_until_exit(rank: int, world: int) -> list[bool]:
    import torch.distributed as dist

    from mmbalance.collectives import teardown

    handle = apply_dynamic_cp(_tiny(), max_tokens_per_rank=64)
    held = [any(g is dist.group.WORLD for g in teardown._HELD), any(g is handle.own for g in teardown._HELD)]
    handle.remove()
    return held


@pytest.mark.slow
@pytest.mark.distributed
def test_the_world_is_kept_until_exit_and_the_handles_groups_are_not():
    # freeing a DDP model then cannot destroy the world while a gloo worker needs the GIL
    assert run_distributed(_kept_until_exit, 2) == [[True, False], [True, False]]


def test_split_sequences_reads_packed_and_padded_batches_alike():
    ids = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    packed = {
        "input_ids": torch.tensor([sum(ids, [])]),
        "position_ids": torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3]]),
        "labels": torch.tensor([[-100, 6, 7, -100, 9, -100, 11, 12, 13]]),
    }
    pad = torch.zeros((3, 4), dtype=torch.int64)
    mask = torch.zeros((3, 4), dtype=torch.int64)
    lab = torch.full((3, 4), -100)
    for i, s in enumerate(ids):
        sl = slice(4 - len(s), 4) if i == 1 else slice(0, len(s))  # row 1 padded on the left
        pad[i, sl], mask[i, sl], lab[i, sl] = torch.tensor(s), 1, torch.tensor(s)
    a = split_sequences(packed)
    b = split_sequences({"input_ids": pad, "attention_mask": mask, "labels": lab})
    assert a.lengths.tolist() == b.lengths.tolist() == [3, 2, 4]
    assert a.input_ids.tolist() == b.input_ids.tolist() == sum(ids, [])
    # the next token's label, shifted inside each sequence; the last token of a sequence has none
    assert a.shift_labels.tolist() == b.shift_labels.tolist() == [6, 7, -100, 9, -100, 11, 12, 13, -100]
    assert a.labelled.tolist() == [2, 1, 3]


@pytest.mark.parametrize(
    ("batch", "words"),
    [
        ({"input_ids": torch.ones(1, 4, dtype=torch.int64), "position_ids": torch.tensor([[1, 2, 3, 4]])},
         ["position_ids", "starts at position 1"]),
        ({"input_ids": torch.ones(2, 4, dtype=torch.int64), "attention_mask": torch.tensor([[1, 0, 1, 1], [1] * 4])},
         ["attention_mask", "row 0"]),
        ({"input_ids": torch.ones(1, 4, dtype=torch.int64), "pixel_values": torch.ones(2, 3)}, ["pixel_values"]),
        ({"input_ids": torch.ones(1, 4), "labels": None}, ["input_ids", "integer"]),
        ({"input_ids": torch.ones(1, 4, dtype=torch.int64), "labels": torch.ones(1, 5, dtype=torch.int64)},
         ["labels", "shape"]),
        ({"attention_mask": torch.ones(1, 4)}, ["input_ids"]),
    ],
)  # fmt: skip
def test_bad_batches_are_refused_by_name(batch, words):
    with pytest.raises((ValueError, TypeError)) as info:
        split_sequences(batch)
    for w in words:
        assert w in str(info.value), str(info.value)


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 300), min_size=0, max_size=12),
    world=st.integers(1, 6),
    budget=st.integers(40, 200),
    seed=st.integers(0, 3),
)
def test_plan_places_every_token_once_within_the_budget(lengths, world, budget, seed):
    lengths = np.asarray(lengths, dtype=np.int64)
    src = np.sort(np.random.default_rng(seed).integers(0, world, size=lengths.size))
    cost = CostModel.transformer(hidden_size=32, num_layers=2, kv_size=16)
    if lengths.sum() > world * budget:
        with pytest.raises(ValueError, match="max_tokens_per_rank"):
            plan_layout(lengths, src, world, budget, cost)
        return
    try:
        lay = plan_layout(lengths, src, world, budget, cost)
    except ValueError as exc:  # rounding can leave no fitting schedule: said by name, never a bad plan
        assert "max_tokens_per_rank" in str(exc)
        return
    assert int(lay.shard_tokens.max(initial=0)) <= budget
    assert int(lay.piece_len.sum()) == int(lengths.sum())
    assert np.bincount(lay.piece_dst, weights=lay.piece_len, minlength=world).astype(np.int64).tolist() == \
        lay.shard_tokens.tolist()  # fmt: skip
    placed = sorted(int(s) for g in lay.schedule for s in g.sequences)
    assert placed == sorted(range(lengths.size)) if lengths.size else placed == []
    # deterministic: every rank computes the same plan
    again = plan_layout(lengths, src, world, budget, cost)
    assert np.array_equal(again.piece_dst, lay.piece_dst) and np.array_equal(again.piece_len, lay.piece_len)


def test_one_process_handle_matches_the_stock_model():
    model, ref = _tiny(), _tiny("eager")
    handle = apply_dynamic_cp(model, max_tokens_per_rank=64)
    ids = torch.randint(1, 64, (1, 20))
    batch = {
        "input_ids": ids,
        "position_ids": torch.tensor([list(range(12)) + list(range(8))]),
        "labels": ids,
    }
    inputs = handle.shard(batch)
    loss = model(**inputs).loss
    n = inputs["num_items_in_batch"]
    assert n == 18
    want = sum(
        ref(input_ids=ids[:, a:b], labels=ids[:, a:b], num_items_in_batch=n).loss
        for a, b in ((0, 12), (12, 20))
    )
    assert float(loss.detach()) == pytest.approx(float(want.detach()), rel=1e-5)
    assert handle.stats["degrees"] == [1]
    handle.remove()
    with pytest.raises(RuntimeError, match="removed"):
        handle.shard(batch)
    apply_dynamic_cp(model, max_tokens_per_rank=64).remove()  # applies again after remove


def test_apply_refuses_bad_arguments_by_name():
    with pytest.raises(ValueError, match="attn_implementation"):
        apply_dynamic_cp(_tiny("sdpa"), max_tokens_per_rank=64)
    model = _tiny()
    with pytest.raises(ValueError, match="max_tokens_per_rank"):
        apply_dynamic_cp(model, max_tokens_per_rank=0)
    with pytest.raises(TypeError, match="max_tokens_per_rank"):
        apply_dynamic_cp(model, max_tokens_per_rank=1.5)
    with pytest.raises(ValueError, match="cost"):
        apply_dynamic_cp(model, max_tokens_per_rank=64, cost="cubic")
    handle = apply_dynamic_cp(model, max_tokens_per_rank=64)
    with pytest.raises(ValueError, match="already"):
        apply_dynamic_cp(model, max_tokens_per_rank=64)
    with pytest.raises(ValueError, match="max_tokens_per_rank=64"):
        handle.shard({"input_ids": torch.ones(1, 80, dtype=torch.int64)})
    handle.remove()


@pytest.mark.parametrize(
    ("extra", "call", "feature"),
    [
        ({}, {"attention_mask": torch.tensor([[1] * 10 + [0] * 2])}, "padding masks"),
        ({}, {"cu_seq_lens_q": torch.tensor([0, 12], dtype=torch.int32)}, "cu_seq_lens"),
    ],
)
def test_features_the_ring_cannot_run_are_refused_by_name(extra, call, feature):
    model = _tiny(**extra)
    handle = apply_dynamic_cp(model, max_tokens_per_rank=64)
    inputs = handle.shard({"input_ids": torch.randint(1, 64, (1, 12))})
    with pytest.raises(NotImplementedError) as info:
        model(**inputs, **call)
    assert "mmbalance_varlen" in str(info.value) and feature in str(info.value), str(info.value)
    handle.remove()


def test_refusals_name_chunks_blocks_and_cross_attention():
    from mmbalance.integrations.hf.attention import VarlenMask
    from mmbalance.integrations.hf.cp.attention import refusal

    class Layer:
        is_causal = True
        config = None

    # windows, softcap and sinks run under the ring
    assert refusal(Layer(), None, {"sliding_window": 4, "softcap": 30.0, "s_aux": torch.zeros(4)}) is None
    windowed = VarlenMask(batch_size=1, q_length=4, kv_length=4, causal=True)
    windowed.window = (3, -1)
    assert refusal(Layer(), windowed, {"sliding_window": 4}) is None
    windowed.window = (3, 3)
    assert "two-sided" in str(refusal(Layer(), windowed, {}))
    chunked = type("C", (), {"is_causal": True, "config": type("Cfg", (), {"attention_chunk_size": 8})()})()
    assert "chunked" in str(refusal(chunked, None, {}))
    blocks = VarlenMask(batch_size=1, q_length=4, kv_length=4, causal=True)
    blocks.blocks = torch.zeros(1, 4, dtype=torch.int64)
    assert "block masks" in str(refusal(Layer(), blocks, {}))
    # a shard that carries its images' blocks runs them (cp/blocks.py)
    with_blocks = CPShard(1, 0, None, np.array([0, 4]), 4, blocks=np.array([[1, 3]]))
    assert refusal(Layer(), blocks, {}, with_blocks) is None
    assert "block masks" in str(refusal(Layer(), torch.ones(1, 1, 4, 4), {}))
    cross = type("X", (), {"is_causal": False, "config": None})()
    assert "cross-attention" in str(refusal(cross, None, {}))


@pytest.mark.parametrize(
    ("extra", "word"),
    [({"attention_chunk_size": 8}, "chunked"), ({"use_bidirectional_attention": True}, "bidirectional")],
    ids=["chunked", "bidirectional"],
)
def test_what_the_ring_cannot_run_is_refused_when_applied(extra, word):
    """Refused by the model's config when the handle is made, before any token moves (not at the
    first forward)."""
    with pytest.raises(ValueError, match=word):
        apply_dynamic_cp(_tiny(**extra), max_tokens_per_rank=64)


def _feature_model(family: str, attn: str):
    import transformers as tf

    register_attention()
    common = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2)  # fmt: skip
    if family.startswith("qwen2-w"):
        window = int(family[len("qwen2-w") :])
        cls, cfg = tf.Qwen2ForCausalLM, tf.Qwen2Config(**common, use_sliding_window=True, sliding_window=window,
                                                       max_window_layers=0)  # fmt: skip
    elif family == "gemma2":
        cls, cfg = tf.Gemma2ForCausalLM, tf.Gemma2Config(**common, head_dim=8, sliding_window=6,
                                                         attn_logit_softcapping=1.5, query_pre_attn_scalar=8)  # fmt: skip
    else:
        cls, cfg = tf.GptOssForCausalLM, tf.GptOssConfig(**common, head_dim=8, sliding_window=6, num_local_experts=4,
                                                         num_experts_per_tok=2,
                                                         rope_parameters={"rope_type": "default", "rope_theta": 1e4})  # fmt: skip
    torch.manual_seed(0)
    model = cls._from_config(cfg, attn_implementation=attn, dtype=torch.float32)
    if family == "gptoss":
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.sinks.copy_(torch.linspace(-1.0, 2.0, 4))
    return model


@pytest.mark.parametrize("family", ["qwen2-w3", "qwen2-w8", "qwen2-w40", "gemma2", "gptoss"])
def test_one_process_window_softcap_and_sinks_match_the_stock_model(family):
    """One process (degree 1): Qwen2's sliding window on both layers (3, 8, and 40, which covers
    every sequence), Gemma 2 (window and softcap) and gpt-oss (window and sinks) against every
    sequence alone through the stock eager attention."""
    model, ref = _feature_model(family, "mmbalance_varlen"), _feature_model(family, "eager")
    handle = apply_dynamic_cp(model, max_tokens_per_rank=64)
    ids = torch.randint(1, 64, (1, 30), generator=torch.Generator().manual_seed(len(family)))
    pos = torch.tensor([list(range(20)) + list(range(10))])
    inputs = handle.shard({"input_ids": ids, "position_ids": pos, "labels": ids})
    loss = model(**inputs).loss
    loss.backward()
    n = inputs["num_items_in_batch"]
    want = sum(
        ref(input_ids=ids[:, a:b], labels=ids[:, a:b], num_items_in_batch=n).loss
        for a, b in ((0, 20), (20, 30))
    )
    want.backward()
    assert float(loss.detach()) == pytest.approx(float(want.detach()), rel=1e-5)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        if q.grad is not None:
            assert float((p.grad - q.grad).norm()) <= 1e-5 * max(float(q.grad.norm()), 1e-6), name
    handle.remove()


def test_the_window_of_a_call_and_of_its_mask_must_agree():
    from mmbalance.integrations.hf.attention import VarlenMask
    from mmbalance.integrations.hf.cp.attention import features

    mask = VarlenMask(batch_size=1, q_length=4, kv_length=4, causal=True)
    mask.window = (7, -1)
    assert features(mask, {"sliding_window": 8}, 4, 100) == {"window_left": 7}
    assert features(mask, {}, 4, 100) == {"window_left": 7}
    assert features(None, {"sliding_window": 8}, 4, 8) == {}  # covers every sequence: plain causal
    with pytest.raises(ValueError, match="sliding_window=5"):
        features(mask, {"sliding_window": 5}, 4, 100)
    with pytest.raises(ValueError, match="one logit per query head"):
        features(None, {"s_aux": torch.zeros(3)}, 4, 100)


def _empty_rank_without_labels(rank: int, world: int):
    import torch.distributed as dist

    model = _tiny()
    handle = apply_dynamic_cp(model, max_tokens_per_rank=16)  # the 30 tokens split over both ranks
    ids = (torch.arange(30).reshape(1, 30) * 7) % 60 + 1
    batch = (
        {"input_ids": ids, "labels": ids}
        if rank == 0
        else {"input_ids": torch.zeros((1, 0), dtype=torch.int64)}
    )
    kw = handle.shard(batch)
    loss = model(**kw).loss
    loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total)
    degrees = handle.stats["degrees"]
    handle.remove()
    return float(total), "labels" in kw, degrees


def _two_rank_cases(rank: int, world: int) -> dict:
    """The 2-rank cases of this module in one spawn: an empty rank without labels, then a collator
    failing on rank 1 (each on its own handle)."""
    return {
        "labels": _empty_rank_without_labels(rank, world),
        "collator": _a_collator_fails_on_one_rank(rank, world),
    }


@pytest.fixture(scope="module")
def two_ranks() -> list[dict]:
    return run_distributed(_two_rank_cases, 2, timeout=300)


@pytest.mark.distributed
def test_an_empty_rank_may_leave_labels_out(two_ranks):
    """Rank 1 passes no sequence and no labels while rank 0 passes both: the step runs, both ranks
    score (rank 1 holds half of rank 0's sequence), and the loss is the reference's."""
    ids = (torch.arange(30).reshape(1, 30) * 7) % 60 + 1
    want = float(_tiny("eager")(input_ids=ids, labels=ids).loss)
    for total, has_labels, degrees in (r["labels"] for r in two_ranks):
        assert has_labels and degrees == [2]
        assert total == pytest.approx(want, rel=1e-5)


def test_labels_of_reads_every_ranks_sequences():
    from mmbalance.collectives import RankMismatchError
    from mmbalance.integrations.hf.cp.plan import labels_of

    assert labels_of(np.array([1, 1, 1]), np.array([0, 0, 2])) is True
    assert labels_of(np.array([0, 0]), np.array([0, 1])) is False
    assert labels_of(np.zeros(0), np.zeros(0)) is False and labels_of(np.zeros(0), np.zeros(0), True) is True
    with pytest.raises(RankMismatchError, match=r"not by ranks \[1\]"):
        labels_of(np.array([1, 0, 1]), np.array([0, 1, 2]))


def _a_collator_fails_on_one_rank(rank: int, world: int) -> str:
    from transformers import DataCollatorWithFlattening

    handle = apply_dynamic_cp(_tiny(), max_tokens_per_rank=64)
    flat = DataCollatorWithFlattening(return_tensors="pt")

    def collate(items):
        if rank == 1:
            raise KeyError("no such column")  # not a ValueError: still this rank's problem alone
        return flat(items)

    loader = [[{"input_ids": list(range(1, 9)), "labels": list(range(1, 9))}]]
    try:
        list(handle.batches(loader, grad_accum=2, collate=collate))
    except ValueError as exc:  # RankMismatchError on the others
        return f"{type(exc).__name__}: {exc}"
    finally:
        handle.remove()
    return "no error"


@pytest.mark.distributed
def test_a_collator_failing_on_one_rank_raises_on_every_rank(two_ranks):
    """A streamed step's collator raising on rank 1 (a KeyError) is refused on both ranks, naming
    rank 1, instead of leaving rank 0 in the next collective."""
    for message in (r["collator"] for r in two_ranks):
        assert "collator failed" in message and "rank 1" in message and "no such column" in message, message


def test_batches_collate_raw_examples_in_one_process():
    """Without a group, ``batches(loader, collate=...)`` collates every draw, and a last partial
    step is completed with idle micro-batches (no labelled token)."""
    from transformers import DataCollatorWithFlattening

    model = _tiny()
    handle = apply_dynamic_cp(model, max_tokens_per_rank=64)
    loader = [[{"input_ids": list(range(1, 9)), "labels": list(range(1, 9))}] for _ in range(3)]
    out = list(handle.batches(loader, grad_accum=2, collate=DataCollatorWithFlattening(return_tensors="pt")))
    assert len(out) == 4  # 3 draws and one idle micro-batch: two whole steps
    assert all("labels" in kw for kw in out)
    assert int((out[-1]["shift_labels"] != -100).sum()) == 0 and out[0]["num_items_in_batch"] == 7
    for kw in out:
        model(**kw).loss.backward()
    handle.remove()
