"""One function per collective entry point: every injectable fault in turn, on rank ``FAULTY`` of 3.

Each scenario runs in one healthy process group. A fault the agreement step catches leaves the
group usable (no data moved), so the faults run one after another, each through
``harness.attempt`` (which records the outcome and then meets the other ranks at a barrier).
Faults that must *not* raise (a different ``requires_grad``, an uneven feature split) return
what the rank computed, compared with a single-rank float64 reference in the test.

Dead and departed ranks need a fresh group each: :func:`lost_rank` sets an entry point up, then
the faulty rank dies (``os._exit``) or leaves (returns without calling, and lingers), and the others
call the entry point.
"""

from __future__ import annotations

import os
import time

import numpy as np
import torch

from tests.faults.harness import attempt

FAULTY = 1
WORLD = 3


def _examples(rank: int, counts=(3, 2, 4), hidden: int = 4, seed: int = 0):
    """This rank's examples: lengths (one of them 0) and float32 rows naming (example, position)."""
    rng = np.random.default_rng([seed, rank])
    lengths = rng.integers(1, 6, size=counts[rank])
    lengths[rank % counts[rank]] = 0
    offset = sum(counts[:rank])
    rows = [
        [(offset + j) * 100 + p + 0.25 * c for c in range(hidden)]
        for j, n in enumerate(lengths)
        for p in range(n)
    ]
    x = torch.tensor(rows, dtype=torch.float32).reshape(-1, hidden)
    cu = torch.zeros(lengths.size + 1, dtype=torch.int32)
    cu[1:] = torch.from_numpy(np.cumsum(lengths)).to(torch.int32)
    return lengths, x, cu


# ---------------------------------------------------------------------------------- gather_lengths
def gather_lengths_faults(rank: int, world: int) -> dict:
    from mmbalance.collectives import gather_lengths

    bad = rank == FAULTY
    mine = [3, 1, 4]
    out = {}
    out["wrong lengths"] = attempt(lambda: gather_lengths([3, -1, 4] if bad else mine))
    out["wrong dtype"] = attempt(lambda: gather_lengths([3.5, 1, 4] if bad else mine))
    out["wrong trailing shape"] = attempt(
        lambda: gather_lengths(np.ones((3, 2), dtype=np.int64) if bad else np.ones((3, 1), dtype=np.int64))
    )
    out["empty stand-in"] = attempt(
        lambda: gather_lengths(np.zeros((0, 2), dtype=np.int64) if bad else np.ones((3, 1), dtype=np.int64))
    )
    ok = attempt(lambda: gather_lengths([] if bad else mine))
    out["empty rank"] = ok
    if not ok["raised"]:
        lengths, src = ok["value"]
        ok["value"] = (lengths.tolist(), src.tolist())
    return out


# ---------------------------------------------------------------------------------- rebalance
def rebalance_faults(rank: int, world: int) -> dict:
    from mmbalance.balancing import Plan, post_balance
    from mmbalance.collectives import gather_lengths, rebalance

    bad = rank == FAULTY
    mine, x, cu = _examples(rank)
    lengths, src = gather_lengths(mine)
    plan = post_balance(lengths, world, src_ranks=src)
    out: dict = {}

    other = Plan.from_destinations(lengths, (src + 1) % world, world, src)
    out["different plan"] = attempt(lambda: rebalance(x, cu, other if bad else plan))
    # the faulty rank's cu_seqlens move one token between its first two examples (same total)
    wrong_cu = cu.clone()
    wrong_cu[1] = cu[1] - 1 if cu[1] > 0 else cu[1] + 1
    out["wrong lengths"] = attempt(lambda: rebalance(x, wrong_cu if bad else cu, plan))
    out["wrong dtype"] = attempt(lambda: rebalance(x.double() if bad else x, cu, plan))
    out["wrong trailing shape"] = attempt(lambda: rebalance(x[:, :3] if bad else x, cu, plan))
    out["different check"] = attempt(lambda: rebalance(x, cu, plan, check=not bad))
    out["different flags"] = out["different check"]

    # a rank with no examples passes an empty stand-in
    empty_mine = np.zeros(0, dtype=np.int64) if bad else mine
    e_lengths, e_src = gather_lengths(empty_mine)
    e_plan = post_balance(e_lengths, world, src_ranks=e_src)
    e_cu = torch.zeros(1, dtype=torch.int32) if bad else cu
    stand_in = {
        "empty stand-in of the wrong dtype": torch.empty(0, 4, dtype=torch.float64),
        "empty stand-in of the wrong shape": torch.empty(0),
    }
    for name, t in stand_in.items():
        out[name] = attempt(lambda t=t: rebalance(t if bad else x, e_cu, e_plan))
    good = attempt(lambda: rebalance(torch.empty(0, 4) if bad else x, e_cu, e_plan)[0])
    out["empty stand-in of the right kind"] = _numpy(good)

    # requires_grad differs: not a fault; the backward all-to-all must still run on every rank
    def grad_call():
        xi = x.clone().requires_grad_(not bad)
        y, _ = rebalance(xi, cu, plan)
        (y * y).sum().backward()
        return {"y": y.detach().numpy(), "grad": None if xi.grad is None else xi.grad.numpy()}

    out["different requires_grad"] = attempt(grad_call)
    out["no_grad on one rank"] = attempt(
        lambda: _no_grad_if(bad, lambda: rebalance(x.clone().requires_grad_(True), cu, plan))
    )
    out["expected"] = {
        "recv": plan.recv_order(rank).tolist(),
        "empty_recv": e_plan.recv_order(rank).tolist(),
        "empty_lengths": e_plan.lengths.tolist(),
    }
    return out


def _numpy(outcome: dict) -> dict:
    if not outcome["raised"] and isinstance(outcome["value"], torch.Tensor):
        outcome["value"] = outcome["value"].detach().numpy()
    return outcome


def _no_grad_if(cond: bool, fn):
    if cond:
        with torch.no_grad():
            return fn()
    return fn()


# ---------------------------------------------------------------------------------- Orchestrator
def orchestrator_faults(rank: int, world: int) -> dict:
    from mmbalance.balancing import PhaseSpec
    from mmbalance.collectives import Orchestrator

    bad = rank == FAULTY
    sizes = {"vision": [4, 0, 8], "text": [5, 6, 7]}
    out: dict = {}
    orch = Orchestrator({"vision": PhaseSpec("sum", downsample=2)}, background=False)
    out["wrong lengths"] = attempt(
        lambda: orch.plan({"vision": [4, -2, 8], "text": [5, 6, 7]} if bad else sizes)
    )
    out["wrong dtype"] = attempt(
        lambda: orch.plan({"vision": [4.5, 0, 8], "text": [5, 6, 7]} if bad else sizes)
    )
    out["wrong trailing shape"] = attempt(
        lambda: orch.plan({"vision": [4, 0], "text": [5, 6, 7]} if bad else sizes)
    )
    other = Orchestrator({"vision": PhaseSpec("sum", alpha=2.0, downsample=2)}, background=False)
    out["different plan"] = attempt(lambda: (other if bad else orch).plan(sizes))
    unbalanced = Orchestrator({"vision": PhaseSpec("sum", downsample=2)}, background=False, balance=False)
    out["different flags"] = attempt(lambda: (unbalanced if bad else orch).plan(sizes))
    ok = attempt(lambda: orch.plan({"vision": [], "text": []} if bad else sizes))
    out["empty stand-in"] = ok
    if not ok["raised"]:
        ok["value"] = ok["value"].llm.lengths.tolist()
    # a bad input to one rank's move: caught by the move's own agreement
    step = orch.plan(sizes)
    patches = torch.randn(12, 3)
    cu = torch.tensor([0, 4, 4, 12], dtype=torch.int32)
    out["wrong dtype in a move"] = attempt(
        lambda: step.to_encoder("vision", patches.double() if bad else patches, cu)
    )
    for o in (orch, other, unbalanced):
        o.close()
    return out


# ---------------------------------------------------------------------------------- ring attention
RING_LENGTHS = [9, 4, 13]


def ring_inputs(rank: int, world: int, dtype=torch.float32, heads: int = 2, lengths=RING_LENGTHS):
    from mmbalance.collectives import cp_shard

    g = torch.Generator().manual_seed(11)
    total = sum(lengths)
    q, k, v = (torch.randn(total, heads, 8, generator=g, dtype=torch.float64) for _ in range(3))
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32)
    shard = lambda t: cp_shard(t, cu, layout="zigzag", rank=rank, degree=world).to(dtype)  # noqa: E731
    return (q, k, v, cu), (shard(q), shard(k), shard(v))


def ring_faults(rank: int, world: int) -> dict:
    from mmbalance.collectives import cp_unshard, ring_attention

    bad = rank == FAULTY
    (q, k, v, cu), (ql, kl, vl) = ring_inputs(rank, world)
    out: dict = {}
    other_cu = torch.tensor([0, 9, 14, 26], dtype=torch.int32)  # same total, other boundaries
    out["different plan"] = attempt(lambda: ring_attention(ql, kl, vl, other_cu if bad else cu, causal=True))
    out["different flags"] = attempt(lambda: ring_attention(ql, kl, vl, cu, causal=not bad))
    out["wrong dtype"] = attempt(lambda: ring_attention(ql.double() if bad else ql, kl.double() if bad else kl,
                                                        vl.double() if bad else vl, cu, causal=True))  # fmt: skip
    out["wrong trailing shape"] = attempt(
        lambda: ring_attention(
            ql[:, :1] if bad else ql, kl[:, :1] if bad else kl, vl[:, :1] if bad else vl, cu
        )
    )
    out["wrong lengths"] = attempt(lambda: ring_attention(ql[1:] if bad else ql, kl[1:] if bad else kl,
                                                          vl[1:] if bad else vl, cu))  # fmt: skip
    out["wrong layout"] = attempt(
        lambda: ring_attention(ql, kl, vl, cu, causal=True, layout="contiguous" if bad else "zigzag")
    )
    out["cp_unshard lengths"] = attempt(lambda: cp_unshard(ql, other_cu if bad else cu))

    def grad_call():
        qi, ki, vi = (t.clone().requires_grad_(not bad) for t in (ql, kl, vl))
        o = ring_attention(qi, ki, vi, cu, causal=True)
        (o * o).sum().backward()
        grads = [None if t.grad is None else t.grad.numpy() for t in (qi, ki, vi)]
        return {"out": o.detach().numpy(), "grads": grads}

    out["different requires_grad"] = attempt(grad_call)
    return out


# ---------------------------------------------------------------------------------- TP overlap
K_FEAT = 5
N_SPLIT = (4, 4, 3)  # an uneven split of 11 output features over 3 ranks
M_SPLIT = (3, 0, 4)


def tp_tensors(rank: int):
    g = torch.Generator().manual_seed(21)
    xs = [torch.randn(m, K_FEAT, generator=g, dtype=torch.float64) for m in M_SPLIT]
    ws = [torch.randn(n, K_FEAT, generator=g, dtype=torch.float64) for n in N_SPLIT]
    return xs, ws


def all_gather_matmul_faults(rank: int, world: int) -> dict:
    from mmbalance.collectives import all_gather_matmul

    bad = rank == FAULTY
    xs, ws = tp_tensors(rank)
    x, w = xs[rank], ws[rank]
    out: dict = {}
    out["different flags"] = attempt(lambda: all_gather_matmul(x, w, chunks=3 if bad else 2))
    out["wrong dtype"] = attempt(lambda: all_gather_matmul(x.float() if bad else x, w.float() if bad else w))
    out["wrong trailing shape"] = attempt(
        lambda: all_gather_matmul(x[:, :4] if bad else x, w[:, :4] if bad else w)
    )
    out["different plan"] = attempt(
        lambda: all_gather_matmul(x, w, shard_sizes=(3, 0, 4) if not bad else (3, 0, 4, 0))
    )
    out["wrong lengths"] = attempt(lambda: all_gather_matmul(x, w, shard_sizes=(2, 1, 4) if bad else M_SPLIT))
    out["empty stand-in"] = attempt(
        lambda: all_gather_matmul(
            torch.empty(0, K_FEAT, dtype=torch.float32) if bad else x, w.float() if bad else w
        )  # fmt: skip
    )

    def uneven():  # chunks=None with N_SPLIT uneven: every rank must slice alike (was SIGABRT)
        xi = x.clone().requires_grad_(True)
        wi = w.clone().requires_grad_(True)
        y = all_gather_matmul(xi, wi)
        (y * y).sum().backward()
        return {"y": y.detach().numpy(), "gx": xi.grad.numpy(), "gw": wi.grad.numpy()}

    out["uneven feature split"] = attempt(uneven)

    def grad_call():
        xi = x.clone().requires_grad_(not bad)
        y = all_gather_matmul(xi, w)
        (y * y).sum().backward()
        return {"y": y.detach().numpy(), "gx": None if xi.grad is None else xi.grad.numpy()}

    out["different requires_grad"] = attempt(grad_call)
    out["no_grad on one rank"] = attempt(
        lambda: _no_grad_if(bad, lambda: all_gather_matmul(x.clone().requires_grad_(True), w))
    )
    return out


def matmul_reduce_scatter_faults(rank: int, world: int) -> dict:
    from mmbalance.collectives import matmul_reduce_scatter

    bad = rank == FAULTY
    g = torch.Generator().manual_seed(31)
    k_split = (3, 3, 2)  # the contraction dimension split unevenly
    m, n = 7, 6
    xs = [torch.randn(m, kr, generator=g, dtype=torch.float64) for kr in k_split]
    ws = [torch.randn(n, kr, generator=g, dtype=torch.float64) for kr in k_split]
    x, w = xs[rank], ws[rank]
    out: dict = {}
    out["different flags"] = attempt(lambda: matmul_reduce_scatter(x, w, chunks=1 if bad else None))
    out["wrong dtype"] = attempt(
        lambda: matmul_reduce_scatter(x.float() if bad else x, w.float() if bad else w)
    )
    out["wrong lengths"] = attempt(lambda: matmul_reduce_scatter(x[:6] if bad else x, w))
    out["wrong trailing shape"] = attempt(lambda: matmul_reduce_scatter(x, w[:5] if bad else w))
    out["different plan"] = attempt(
        lambda: matmul_reduce_scatter(x, w, shard_sizes=(1, 3, 3) if bad else (3, 3, 1))
    )
    out["empty stand-in"] = attempt(
        lambda: matmul_reduce_scatter(torch.empty(0, k_split[rank], dtype=torch.float64) if bad else x, w)
    )

    def uneven():
        xi = x.clone().requires_grad_(True)
        wi = w.clone().requires_grad_(True)
        z = matmul_reduce_scatter(xi, wi, bias=None)
        (z * z).sum().backward()
        return {"z": z.detach().numpy(), "gx": xi.grad.numpy(), "gw": wi.grad.numpy()}

    out["uneven feature split"] = attempt(uneven)

    def grad_call():
        xi = x.clone().requires_grad_(not bad)
        z = matmul_reduce_scatter(xi, w)
        (z * z).sum().backward()
        return {"z": z.detach().numpy(), "gx": None if xi.grad is None else xi.grad.numpy()}

    out["different requires_grad"] = attempt(grad_call)
    out["inputs"] = {"xs": [t.numpy() for t in xs], "ws": [t.numpy() for t in ws]}
    return out


def tp_module_faults(rank: int, world: int) -> dict:
    from mmbalance.collectives import ColumnParallelLinear, RowParallelLinear

    bad = rank == FAULTY
    h, f = 6, 10  # 10 features over 3 ranks: (4, 3, 3)
    out: dict = {}
    torch.manual_seed(5 + (1 if bad else 0))
    out["different plan"] = attempt(lambda: ColumnParallelLinear(h, f, dtype=torch.float64))  # seeds differ
    torch.manual_seed(5)
    col = ColumnParallelLinear(h, f, dtype=torch.float64)
    row = RowParallelLinear(f, h, dtype=torch.float64)
    col_other = ColumnParallelLinear.from_linear(
        torch.nn.Linear(h, f, dtype=torch.float64), chunks=3 if bad else 2
    )
    g = torch.Generator().manual_seed(41)
    xs = [torch.randn(t, h, generator=g, dtype=torch.float64) for t in (3, 2, 4)]
    x = xs[rank]
    out["different flags"] = attempt(lambda: col_other(x))
    out["wrong dtype"] = attempt(lambda: col(x.float() if bad else x))
    out["wrong trailing shape"] = attempt(lambda: col(x[:, None, :] if bad else x))
    out["wrong lengths"] = attempt(lambda: col(x, shard_sizes=(3, 3, 4) if bad else (3, 2, 4)))

    def mlp(requires_grad: bool):
        xi = x.clone().requires_grad_(requires_grad)
        y = row(torch.tanh(col(xi, shard_sizes=(3, 2, 4))), shard_sizes=(3, 2, 4))
        (y * y).sum().backward()
        grads = {n: p.grad.numpy().copy() for n, p in (("w1", col.weight), ("w2", row.weight))}
        for p in (*col.parameters(), *row.parameters()):
            p.grad = None
        return {"y": y.detach().numpy(), "gx": None if xi.grad is None else xi.grad.numpy(), **grads}

    out["uneven feature split"] = attempt(lambda: mlp(True))
    out["different requires_grad"] = attempt(lambda: mlp(not bad))
    out["weights"] = {
        "w1": col.weight.detach().numpy(),
        "b1": col.bias.detach().numpy(),
        "w2": row.weight.detach().numpy(),
        "b2": row.bias.detach().numpy(),
        "slices": (col.out_slice, row.in_slice),
    }
    out["xs"] = [t.numpy() for t in xs]
    return out


# ---------------------------------------------------------------------------------- dead and departed
def _level() -> None:
    """Wait, with a generous timeout, until every rank has done its local work. The lost-rank groups
    time out after a few seconds, and a rank that is still importing or building a model when its
    peers already call a collective (several groups share two cores) must not look lost."""
    from datetime import timedelta

    import torch.distributed as dist

    dist.monitored_barrier(timeout=timedelta(seconds=120), wait_all_ranks=True)


def lost_rank(rank: int, world: int, entry: str, how: str, linger: float) -> dict:
    """Set ``entry`` up on every rank, then the faulty rank dies or leaves and the others call it."""
    from mmbalance.balancing import PhaseSpec, post_balance
    from mmbalance.collectives import (
        ColumnParallelLinear,
        Orchestrator,
        all_gather_matmul,
        gather_lengths,
        matmul_reduce_scatter,
        rebalance,
        ring_attention,
    )

    _level()
    if entry == "gather_lengths":
        call = lambda: gather_lengths([1, 2, 3])  # noqa: E731
    elif entry == "rebalance":
        mine, x, cu = _examples(rank)
        lengths, src = gather_lengths(mine)
        plan = post_balance(lengths, world, src_ranks=src)
        call = lambda: rebalance(x, cu, plan)  # noqa: E731
    elif entry == "Orchestrator":
        orch = Orchestrator({"vision": PhaseSpec()}, background=True)
        call = lambda: orch.submit({"vision": [3, 0], "text": [2, 2]}).result()  # noqa: E731
    elif entry == "ring_attention":
        (_, _, _, cu), (ql, kl, vl) = ring_inputs(rank, world)
        call = lambda: ring_attention(ql, kl, vl, cu, causal=True)  # noqa: E731
    elif entry == "all_gather_matmul":
        xs, ws = tp_tensors(rank)
        call = lambda: all_gather_matmul(xs[rank], ws[rank])  # noqa: E731
    elif entry == "matmul_reduce_scatter":
        x, w = torch.randn(6, 3, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64)
        call = lambda: matmul_reduce_scatter(x, w)  # noqa: E731
    elif entry == "TP modules":
        torch.manual_seed(0)
        col = ColumnParallelLinear(4, 7, dtype=torch.float64)
        call = lambda: col(torch.randn(2, 4, dtype=torch.float64))  # noqa: E731
    elif entry == "HF encoder balance":
        from mmbalance.integrations.hf import apply_encoder_balance
        from tests.integrations import hf_zoo as Z

        model = Z.build("qwen2_vl", seed=1)
        _level()
        apply_encoder_balance(model)
        batch = Z.batch("qwen2_vl", model, [[(4, 4)]], seed=rank)
        call = lambda: model(**batch).loss  # noqa: E731
    else:
        raise ValueError(entry)
    import torch.distributed as dist

    dist.barrier()  # everything above succeeded on every rank
    if rank == FAULTY:
        if how == "dies":
            os._exit(17)
        time.sleep(linger)  # left the step: alive, but never calls
        return {"left": True}
    return attempt(call, barrier=False)


# ---------------------------------------------------------------------------------- HF encoder balancing
def hf_faults(rank: int, world: int) -> dict:
    from mmbalance.integrations.hf import apply_encoder_balance
    from tests.integrations import hf_zoo as Z

    bad = rank == FAULTY
    out: dict = {}
    model = Z.build("qwen2_vl", seed=1)
    handle = apply_encoder_balance(model)
    spec = [[(4, 4), (2, 6)]] if rank != 2 else [[(6, 4)]]
    batch = Z.batch("qwen2_vl", model, spec, seed=rank)
    wrong = dict(batch, image_grid_thw=batch["image_grid_thw"] + 2) if bad else batch
    out["wrong lengths"] = attempt(lambda: model(**wrong).loss)
    # a rank whose handle prices items differently would plan differently: refused on every rank
    # already when the handles are made, before any forward
    handle.remove()
    out["different plan"] = attempt(lambda: apply_encoder_balance(model, cost="items" if bad else "rows"))
    # pixel values in another dtype are cast to the tower's dtype: not a fault
    mixed = dict(batch, pixel_values=batch["pixel_values"].double()) if bad else batch
    handle = apply_encoder_balance(model)
    ok = attempt(lambda: float(model(**mixed).loss))
    ref = float(type(model).forward(model, **batch).loss)
    out["wrong dtype"] = dict(ok, reference=ref)
    handle.remove()
    return out


def dynamic_cp_faults(rank: int, world: int) -> dict:
    """``apply_dynamic_cp`` / ``handle.shard`` with one rank's batch or settings wrong."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from mmbalance.integrations.hf import apply_dynamic_cp, register_attention

    register_attention()
    bad = rank == FAULTY
    out: dict = {}
    cfg = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    torch.manual_seed(1)
    model = Qwen2ForCausalLM._from_config(cfg, attn_implementation="mmbalance_varlen")
    out["different budget"] = attempt(lambda: apply_dynamic_cp(model, max_tokens_per_rank=32 if bad else 64))
    model.__dict__.pop("_mmbalance_dynamic_cp", None)  # rank 1's handle may exist: start over everywhere
    handle = apply_dynamic_cp(model, max_tokens_per_rank=64)
    ids = torch.arange(1, 13).reshape(1, 12) % 50 + 1
    good = {
        "input_ids": ids,
        "position_ids": torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6]]),
        "labels": ids,
    }
    broken = dict(good, position_ids=torch.tensor([[0, 1, 2, 3, 4, 2, 3, 4, 5, 6, 7, 8]]))
    out["bad position_ids"] = attempt(lambda: handle.shard(broken if bad else good))
    out["missing labels"] = attempt(
        lambda: handle.shard({k: v for k, v in good.items() if k != "labels"} if bad else good)
    )
    ok = attempt(lambda: sorted(handle.shard(good)["position_ids"][0].tolist()))
    out["healthy"] = ok
    handle.remove()
    return out
