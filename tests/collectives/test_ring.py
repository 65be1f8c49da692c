"""Ring attention (``collectives/ring/attention.py``) and its shard layout (``collectives/ring/plan.py``).

The distributed cases run on 2, 3 and 4 gloo ranks: each world size is one spawn that runs every
case (layouts, causal or not, float32/float64, GQA, random varlen lengths including sequences
shorter than the number of chunks) and returns the errors against float64 attention over the
unsharded batch, forward and gradients; the test functions then judge them case by case.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mmbalance.collectives import cp_shard
from mmbalance.collectives.ring.attention import make_ring
from mmbalance.collectives.ring.plan import ring_plan
from tests.dist_utils import run_distributed
from tests.tolerances import tol

CASES = {
    f"{layout}-{'causal' if causal else 'full'}-{dt}": (layout, causal, dt, {})
    for layout in ("zigzag", "contiguous")
    for causal in (True, False)
    for dt in ("f64", "f32")
}
# the block ops' features inside the ring: windows that skip shards, softcap, sinks (once per query)
CASES.update({
    "zigzag-causal-f64-window3": ("zigzag", True, "f64", {"window_left": 3}),
    "zigzag-causal-f64-window11": ("zigzag", True, "f64", {"window_left": 11}),
    "contiguous-causal-f64-window5": ("contiguous", True, "f64", {"window_left": 5}),
    "zigzag-full-f64-window2-3": ("zigzag", False, "f64", {"window_left": 2, "window_right": 3}),
    "zigzag-causal-f64-softcap": ("zigzag", True, "f64", {"softcap": 0.8}),
    "zigzag-causal-f64-sinks": ("zigzag", True, "f64", {"sinks": True}),
    "contiguous-causal-f64-sinks": ("contiguous", True, "f64", {"sinks": True}),
    "zigzag-causal-f32-window-softcap-sinks": ("zigzag", True, "f32", {"window_left": 6, "softcap": 1.5, "sinks": True}),
})  # fmt: skip


def _lengths(world: int, seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    # ragged lengths, an empty sequence and ones shorter than 2 * world (empty chunks)
    return [int(x) for x in rng.integers(0, 40, size=4)] + [0, 1, 2 * world - 1]


def _ring_worker(rank, world, cases, lengths):
    import torch
    import torch.distributed as dist

    from mmbalance.collectives import cp_shard, cp_unshard, ring_attention
    from tests.pyops.attention_dense import dense_attention

    cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32)
    total = int(cu[-1])
    results = {}
    for seed, (name, (layout, causal, dt, feats)) in enumerate(cases.items()):
        dtype = torch.float64 if dt == "f64" else torch.float32
        g = torch.Generator().manual_seed(seed)  # the same tensors on every rank
        q, k, v, dout = (torch.randn(total, h, 8, generator=g, dtype=dtype) for h in (4, 2, 2, 4))
        kw = {key: val for key, val in feats.items() if key != "sinks"}
        sinks = torch.randn(4, generator=g, dtype=dtype).requires_grad_() if feats.get("sinks") else None
        shards = [cp_shard(t, cu, layout=layout).requires_grad_() for t in (q, k, v)]
        out_l, lse_l = ring_attention(
            *shards, cu, causal=causal, layout=layout, softmax_scale=0.3, return_lse=True, sinks=sinks, **kw
        )
        (out_l * cp_shard(dout, cu, layout=layout)).sum().backward()
        out = cp_unshard(out_l.detach(), cu, layout=layout)
        leaves = [t.double().requires_grad_() for t in (q, k, v)]
        ref_sinks = sinks.detach().double().requires_grad_() if sinks is not None else None
        ref_out, ref_lse = dense_attention(*leaves, cu, cu, 0.3, causal=causal, sinks=ref_sinks, **kw)
        grads = torch.autograd.grad(
            (ref_out * dout.double()).sum(), leaves + ([ref_sinks] if ref_sinks is not None else [])
        )
        sink_error = 0.0
        if sinks is not None:  # each rank's gradient covers its own queries: summed, the whole
            d_sinks = sinks.grad.double().clone()
            dist.all_reduce(d_sinks)
            sink_error = (d_sinks - grads[3]).abs().max().item()
        lse_ref = cp_shard(ref_lse.T, cu, layout=layout).T
        finite = torch.isfinite(lse_ref)
        results[name] = {
            "out": (out.double() - ref_out).abs().max().item() if total else 0.0,
            "lse": (lse_l.double()[finite] - lse_ref[finite]).abs().max().item() if finite.any() else 0.0,
            "lse_inf_agree": bool(torch.equal(torch.isinf(lse_l), torch.isinf(lse_ref))),
            "dsinks": sink_error,
            **{
                f"d{n}": (t.grad.double() - cp_shard(ref, cu, layout=layout)).abs().max().item()
                if t.numel()
                else 0.0
                for n, t, ref in zip("qkv", shards, grads)
            },
        }
    # cp_unshard is differentiable: every rank gets its rows of the (replicated) gradient
    x = cp_shard(torch.arange(total, dtype=torch.float64)[:, None], cu).requires_grad_()
    full = cp_unshard(x, cu)
    (full * torch.arange(total, dtype=torch.float64)[:, None]).sum().backward()
    results["unshard"] = bool(torch.equal(full[:, 0], torch.arange(total, dtype=torch.float64))) and bool(
        torch.equal(x.grad, x.detach())
    )
    try:
        ring_attention(
            torch.zeros(total + 1, 4, 8), torch.zeros(total + 1, 2, 8), torch.zeros(total + 1, 2, 8), cu
        )
        results["bad_q_raises"] = False
    except ValueError as e:
        results["bad_q_raises"] = "q has" in str(e)
    return results


@pytest.fixture(scope="module", params=[2, 3, 4], ids=["cp2", "cp3", "cp4"])
def ring_results(request):
    world = request.param
    lengths = _lengths(world, seed=world)
    return world, run_distributed(_ring_worker, world, CASES, lengths, timeout=240)


@pytest.mark.distributed
@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_ring_matches_unsharded_attention(ring_results, case):
    world, per_rank = ring_results
    dtype = torch.float64 if case.endswith("f64") else torch.float32
    atol = tol(dtype, 80)["atol"] * 10
    for rank, results in enumerate(per_rank):
        errors = results[case]
        assert errors["lse_inf_agree"], f"rank {rank}: rows without keys must have lse = -inf"
        for key in ("out", "lse", "dq", "dk", "dv", "dsinks"):
            assert errors[key] <= atol, f"rank {rank} of {world}: {key} error {errors[key]:.3e} > {atol:.1e}"


@pytest.mark.distributed
def test_unshard_and_validation_on_ranks(ring_results):
    _, per_rank = ring_results
    assert all(r["unshard"] for r in per_rank)
    assert all(r["bad_q_raises"] for r in per_rank)


# ------------------------------------------------------------------------------ plan, no spawn
@pytest.mark.parametrize("degree", [1, 2, 3, 5, 6])
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_plan_covers_every_token_once(layout, degree):
    lengths = [0, 1, 7, 12, 100, 2 * degree + 1]
    cu = np.concatenate([[0], np.cumsum(lengths)])
    plan = ring_plan(cu, degree, layout)
    order = np.concatenate([plan.global_index(r) for r in range(degree)])
    assert sorted(order.tolist()) == list(range(int(cu[-1])))
    assert sum(plan.tokens) == cu[-1]
    # per sequence, shards differ by at most one token per chunk (no padding)
    chunks = 2 if layout == "zigzag" else 1
    assert (plan.local_lengths.max(0) - plan.local_lengths.min(0) <= chunks).all()
    for r in range(degree):
        pos = plan.positions(r)
        local_cu = plan.local_cu_seqlens(r)
        for b in range(len(lengths)):
            seq = pos[local_cu[b] : local_cu[b + 1]]
            assert (np.diff(seq) > 0).all(), "positions must increase inside a local sequence"


def test_zigzag_balances_causal_work():
    def imbalance(layout):
        plan = ring_plan([0, 1000], 4, layout)
        # causal (query, key) pairs whose query lives on each rank
        work = [int(sum(p + 1 for p in plan.positions(r))) for r in range(4)]
        return max(work) / (sum(work) / 4)

    assert imbalance("zigzag") <= 1.01
    assert imbalance("contiguous") >= 1.5


@pytest.mark.parametrize("seed", range(40))
def test_visibility_matches_the_positions(seed):
    """The mask relation of every rank pair, windows included, against every (query, key) pair of
    every sequence written out from the positions."""
    rng = np.random.default_rng(seed)
    degree = int(rng.integers(1, 5))
    layout = ("zigzag", "contiguous")[seed % 2]
    lengths = rng.integers(0, 30, size=int(rng.integers(1, 4)))
    causal = bool(rng.integers(0, 4))  # mostly causal, as context parallelism runs it
    wl = int(rng.choice([-1, 0, 1, 3, 9, 40]))
    wr = -1 if causal else int(rng.choice([-1, 0, 2, 7]))
    plan = ring_plan(np.concatenate([[0], np.cumsum(lengths)]), degree, layout)
    for r in range(degree):
        for s in range(degree):
            qs, ks = plan.local_cu_seqlens(r), plan.local_cu_seqlens(s)
            qp, kp = plan.positions(r), plan.positions(s)
            pairs = []
            for b in range(lengths.size):
                a = qp[qs[b] : qs[b + 1]][:, None]
                c = kp[ks[b] : ks[b + 1]][None, :]
                ok = np.ones((a.size, c.size), dtype=bool)
                if causal:
                    ok &= c <= a
                if wl >= 0:
                    ok &= c >= a - wl
                if wr >= 0:
                    ok &= c <= a + wr
                pairs.append(ok.reshape(-1))
            ok = np.concatenate(pairs) if pairs else np.zeros(0, dtype=bool)
            want = "none" if not ok.any() else ("full" if ok.all() else "partial")
            got = plan.visibility(r, s, causal=causal, window_left=wl, window_right=wr)
            assert got == want, (r, s, degree, layout, lengths.tolist(), causal, wl, wr)


def test_a_window_skips_the_shards_it_cannot_reach():
    """8 ranks of one 4096-token sequence (zigzag chunks of 256): a window of 100 reaches only a
    rank's own chunks and their left neighbours, 22 of the 64 rank pairs; causal alone needs 64."""
    plan = ring_plan([0, 4096], 8, "zigzag")
    run = lambda **kw: sum(plan.visibility(r, s, **kw) != "none" for r in range(8) for s in range(8))
    assert run() == 64
    assert run(window_left=99) == 8 + 7 * 2
    assert all(plan.visibility(r, r, window_left=99) == "partial" for r in range(8))


def test_visibility_skips_and_unmasks_steps():
    plan = ring_plan([0, 10, 25], 3, "contiguous")
    assert (
        plan.visibility(1, 2) == "none"
        and plan.visibility(2, 0) == "full"
        and plan.visibility(1, 1) == "partial"
    )
    zig = ring_plan([0, 24], 3, "zigzag")
    assert {zig.visibility(r, s) for r in range(3) for s in range(3)} == {"partial"}


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(cu_seqlens=[0, 3], degree=2, layout="stripes"), "layout"),
        (dict(cu_seqlens=[0, 3], degree=0, layout="zigzag"), "degree"),
        (dict(cu_seqlens=[1, 3], degree=2, layout="zigzag"), "cu_seqlens"),
        (dict(cu_seqlens=[0, 5, 3], degree=2, layout="zigzag"), "cu_seqlens"),
    ],
    ids=["layout", "degree", "start", "decreasing"],
)
def test_plan_rejects_bad_input(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ring_plan(**kwargs)


def test_degree_one_ring_is_plain_attention():
    """One rank: no transfers, the forward and backward loops reduce to one block."""
    from mmbalance.collectives.ring.attention import ring_backward, ring_forward
    from mmbalance.pyops.attention_ops import attention_block
    from tests.pyops.attention_expected import varlen_batch

    q, k, v, cu, _ = varlen_batch([5, 0, 9], [5, 0, 9], 4, 2, 8, torch.float64, seed=0)
    ring = make_ring(q, k, v, cu, causal=True, softmax_scale=0.3, group=None, layout="zigzag", backend="auto",
                     rank=0, degree=1)  # fmt: skip
    out, lse = ring_forward(ring, q, k, v)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref_out, ref_lse = attention_block(*leaves, cu, cu, 9, 9, causal=True, softmax_scale=0.3)
    torch.testing.assert_close(out, ref_out.detach())
    torch.testing.assert_close(lse, ref_lse)
    dout = torch.randn(q.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    grads = ring_backward(ring, dout, q, k, v, out, lse)
    for got, want in zip(grads, torch.autograd.grad(ref_out, leaves, dout)):
        torch.testing.assert_close(got, want)


def test_shard_and_ring_inputs_are_validated():
    cu = torch.tensor([0, 5, 9], dtype=torch.int32)
    x = torch.arange(9.0)[:, None]
    assert cp_shard(x, cu, rank=1, degree=2, layout="contiguous")[:, 0].tolist() == [2, 3, 4, 7, 8]
    assert cp_shard(x, cu, rank=0, degree=2)[:, 0].tolist() == [0, 3, 4, 5, 8]  # chunks 0 and 3
    with pytest.raises(ValueError, match="x has"):
        cp_shard(x[:8], cu, rank=0, degree=2)
    with pytest.raises(ValueError, match="rank"):
        cp_shard(x, cu, rank=2, degree=2)
    q = torch.zeros(4, 4, 8)
    common = dict(causal=True, softmax_scale=None, group=None, backend="auto", rank=0, degree=2)
    with pytest.raises(ValueError, match="layout"):
        make_ring(q, q[:, :2], q[:, :2], cu, layout="diagonal", **common)
    with pytest.raises(ValueError, match="k and v"):
        make_ring(q, q[:, :2], q[:3, :2], cu, layout="zigzag", **common)
    with pytest.raises(ValueError, match="q has 3 tokens"):
        make_ring(q[:3], q[:3, :2], q[:3, :2], cu, layout="zigzag", **common)
