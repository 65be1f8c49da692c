"""``"mmbalance_varlen"`` under ``torch.compile``, and its planning once per forward.

The backend plans on the host. Default compile must break the graph only at the mask function (a
tiny packed Llama of 4 layers: at most 3 breaks per forward, one break point counted in the three
nested frames around it, whatever the number of layers; 13 before planning moved out of the layers)
and give eager's logits; ``fullgraph=True`` must either work (static-cache decoding in
``generate``, whose masks are planned before the compiled forward runs) or raise
``NotImplementedError`` naming the backend and ``fullgraph`` at the first call. The layers of one
forward plan once: packed rows, ``cu_seq_lens`` and cross-attention masks alike.
"""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers", minversion="5.6")

import mmbalance.integrations.hf.attention.backend as attn  # noqa: E402
import mmbalance.integrations.hf.attention.plan as attn_plan  # noqa: E402
from mmbalance.integrations.hf import ATTENTION_NAME, register_attention  # noqa: E402

VOCAB = 64
LENS = [5, 1, 9, 3, 12]
# graph breaks per forward of the packed Llama below (torch._dynamo.explain): the mask function,
# counted in each of the three frames around it
MAX_BREAKS = 3


def _llama(layers: int = 2, impl: str = ATTENTION_NAME):
    register_attention()
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                   pad_token_id=0, bos_token_id=1, eos_token_id=2)  # fmt: skip
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM._from_config(cfg, attn_implementation=impl).eval()


def _packed(lens=LENS, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (1, sum(lens)), generator=g)
    pos = torch.cat([torch.arange(n) for n in lens])[None]
    return ids, pos


@pytest.fixture
def plans(monkeypatch) -> list[int]:
    """How many times the backend plans (``host_plan`` or a 4-D mask's plan)."""
    calls: list[int] = []
    for name in ("host_plan", "dense_mask_runs"):  # the planner's module: attention/plan.py
        real = getattr(attn_plan, name)

        def spy(*args, _real=real, **kwargs):
            calls.append(1)
            return _real(*args, **kwargs)

        monkeypatch.setattr(attn_plan, name, spy)
    return calls


@pytest.mark.slow
def test_default_compile_breaks_only_at_the_mask_function():
    """4 layers, two packings of one length: at most MAX_BREAKS breaks per forward (fewer than
    layers), all at the mask function, and eager's logits for both (the second plan replaces the
    first: no stale plan in the compiled code)."""
    from torch._dynamo.utils import counters

    model = _llama(4)
    graphs: list[int] = []

    def backend(gm, example_inputs):
        def run(*args):
            graphs.append(1)
            return gm.forward(*args)

        return run

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, backend=backend)
    with torch.no_grad():
        for lens in (LENS, [7, 7, 7, 9]):
            ids, pos = _packed(lens)
            graphs.clear()
            got = compiled(input_ids=ids, position_ids=pos, use_cache=False).logits
            assert len(graphs) - 1 <= MAX_BREAKS, f"{len(graphs) - 1} graph breaks in one forward"
            want = model(input_ids=ids, position_ids=pos, use_cache=False).logits
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    reasons = {str(r).split("\n")[0] for r in counters["graph_break"]}
    assert reasons and all("torch.compiler.disable" in r for r in reasons), reasons


def test_fullgraph_forward_raises_naming_the_backend():
    model = _llama(1)
    ids, pos = _packed()
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    with pytest.raises(NotImplementedError, match=f"{ATTENTION_NAME} does not support torch.compile\\(fullgraph=True\\)"
                       ".*Compile without fullgraph"):  # fmt: skip
        compiled(input_ids=ids, position_ids=pos, use_cache=False)


@pytest.mark.slow
def test_static_cache_decoding_compiles_with_fullgraph():
    """``generate(cache_implementation="static")`` with ``CompileConfig(fullgraph=True)``: the
    decoding masks come planned from ``generate``, the compiled forward has no break, and the
    tokens are eager's (a left-padded batch of two)."""
    from transformers import CompileConfig

    model = _llama(2)
    ids = torch.tensor([[0, 0, 5, 9, 11, 3], [4, 5, 6, 7, 8, 9]])
    kw = dict(attention_mask=(ids != 0).long(), max_new_tokens=6, do_sample=False, pad_token_id=0,
              eos_token_id=None, cache_implementation="static")  # fmt: skip
    graphs: list[int] = []

    def backend(gm, example_inputs):
        graphs.append(1)
        return gm.forward

    config = CompileConfig(fullgraph=True, backend=backend, mode=None)
    config._compile_all_devices = True  # generate compiles on CUDA only, unless told
    torch._dynamo.reset()
    with torch.no_grad():
        want = model.generate(ids, **kw)
        got = model.generate(ids, compile_config=config, **kw)
    assert graphs, "generate did not compile the forward"
    assert torch.equal(got, want), (got, want)


def test_calls_without_our_mask_compile_and_plan_once(plans):
    """A vision-tower style call (``cu_seq_lens``, no mask) and a cross-attention call with a 4-D
    mask, three "layers" each: compiled (default) they match eager, plan once per set of tensors,
    and refuse fullgraph."""
    g = torch.Generator().manual_seed(4)
    q = torch.randn(1, 4, 12, 8, generator=g)
    kv = torch.randn(1, 2, 12, 8, generator=g)
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    module = torch.nn.Module()
    cross = torch.zeros(1, 1, 12, 12, dtype=torch.bool)
    cross[..., :6, :4] = True
    cross[..., 6:, :] = True

    def layers(q, kv, mask, **kw):
        out = q
        for _ in range(3):
            out = attn.varlen_attention(module, out, kv, kv, mask, **kw)[0].transpose(1, 2)
        return out

    cu_kw = dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=7, max_length_k=7)
    for mask, kw in ((None, cu_kw), (cross, {})):
        plans.clear()
        want = layers(q, kv, mask, **kw)
        assert len(plans) == 1, f"planned {len(plans)} times for 3 layers"
        torch._dynamo.reset()
        got = torch.compile(layers, backend="eager")(q, kv, mask, **kw)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        torch._dynamo.reset()
        with pytest.raises(NotImplementedError, match=f"{ATTENTION_NAME} .*fullgraph"):
            torch.compile(layers, backend="eager", fullgraph=True)(q, kv, mask, **kw)


@pytest.mark.parametrize("lq, lk", [(6, 6), (4, 9), (9, 4)])
@pytest.mark.parametrize("causal, window", [(False, None), (True, None), (True, (2, -1)), (False, (1, 3))])
def test_shape_only_plans_equal_the_host_plan(lq, lk, causal, window):
    """Calls without a mask, cu_seq_lens or packing are planned from their shapes in tensor ops
    (no graph break): the same plan the host planner makes."""
    if causal and lq > lk:
        assert attn_plan.shape_plan(2, lq, lk, causal, window) is None  # refused by the host planner
        return
    shaped = attn_plan.shape_plan(2, lq, lk, causal, window)
    mine = attn_plan.rows_plan(2, lq, lk, shaped, torch.device("cpu"))
    spec = attn_plan.mask_from_keywords(None, 2, lq, lk, causal, window, None)
    want = attn_plan.host_plan(spec, 2, lq, lk, None, torch.device("cpu"))
    for name in ("cu_q", "cu_k", "k_index", "q_runs", "k_runs"):
        a, b = getattr(mine, name), getattr(want, name)
        assert (a is None and b is None) or torch.equal(a, b), name
    assert (mine.cu_k is mine.cu_q) == (want.cu_k is want.cu_q)
    for name in ("max_q", "max_k", "causal_offset", "window"):
        assert getattr(mine, name) == getattr(want, name), name


def test_cross_attention_without_a_mask_compiles_with_fullgraph(plans):
    """Whisper-style cross-attention (no mask, 9 queries over 6 keys, bidirectional) needs no host
    planning: fullgraph compiles it, as eager."""
    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, 4, 9, 8, generator=g)
    kv = torch.randn(2, 2, 6, 8, generator=g)
    module = torch.nn.Module()
    module.is_causal = False

    def layer(q, kv):
        return attn.varlen_attention(module, q, kv, kv, None, scaling=0.3)[0]

    want = layer(q, kv)
    torch._dynamo.reset()
    got = torch.compile(layer, backend="eager", fullgraph=True)(q, kv)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert not plans, "planned on the host"


def test_one_plan_per_forward(plans):
    """Packed rows through a 3-layer Llama: one plan per forward (made by the mask function), a
    second forward with other tensors plans anew; a tensor changed in place is planned again."""
    model = _llama(3)
    ids, pos = _packed()
    with torch.no_grad():
        model(input_ids=ids, position_ids=pos, use_cache=False)
        assert len(plans) == 1
        model(input_ids=ids, position_ids=pos.clone(), use_cache=False)
        assert len(plans) == 2
    # calls without our mask: the cache is keyed by the tensors and their version counters
    module = torch.nn.Module()
    module.is_causal = True
    q = torch.randn(1, 4, 12, 8)
    pos = torch.cat([torch.arange(5), torch.arange(7)])[None]
    first = attn.varlen_attention(module, q, q[:, :2], q[:, :2], None, position_ids=pos)[0]
    attn.varlen_attention(module, q, q[:, :2], q[:, :2], None, position_ids=pos)
    assert len(plans) == 3
    pos[0, 5:] += 5  # one sequence now: planned again, and the result changes
    again = attn.varlen_attention(module, q, q[:, :2], q[:, :2], None, position_ids=pos)[0]
    assert len(plans) == 4 and not torch.allclose(first, again)


@pytest.mark.slow
def test_compiled_training_step_matches_eager():
    """Forward and backward of the packed Llama compiled (aot_eager: the op's fake and autograd
    registrations traced) against eager: every gradient."""
    model = _llama(1)
    twin = copy.deepcopy(model)
    ids, pos = _packed()
    torch._dynamo.reset()
    compiled = torch.compile(twin, backend="aot_eager")
    for m in (model, compiled):
        out = m(input_ids=ids, position_ids=pos, labels=ids, use_cache=False)
        out.loss.backward()
    for (n, a), (_, b) in zip(model.named_parameters(), twin.named_parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-6, msg=lambda m, n=n: f"{n}: {m}")
