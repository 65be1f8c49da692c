"""Fault injection: one rank of 3 gets a fault; every live rank must raise quickly, naming it.

For every collective entry point (``scenarios.py``) each fault class is injected on rank
``FAULTY`` of 3 gloo ranks with a short process-group timeout. A fault the library can detect must
raise on *every* rank well within that timeout (from the agreement step, not the timeout), with a
message that names the faulty rank and the argument; the faulty rank raises its own ``ValueError``
/``TypeError``, the others :class:`~mmbalance.collectives.RankMismatchError`. Differences that are
not faults (one rank's input does not require grad, features that do not divide evenly) must give
every rank the right values and gradients. A rank that dies or leaves the step can only be noticed
by the timeout: every other rank must still raise (never hang, never abort).
"""

from __future__ import annotations

import concurrent.futures
import functools

import numpy as np
import pytest
import torch

from tests.faults import scenarios as S
from tests.faults.harness import Outcome, run_ranks

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

PG_TIMEOUT = 20.0  # the process group's timeout while faults are injected
QUICK = 10.0  # a detected fault raises well within PG_TIMEOUT
LOST_TIMEOUT = 6.0  # dead and departed ranks: detected by the timeout only, so keep it short


@functools.cache
def outcomes(scenario: str) -> list[Outcome]:
    results = run_ranks(getattr(S, scenario), S.WORLD, pg_timeout=PG_TIMEOUT, timeout=300)
    for o in results:
        assert o.reported, f"rank {o.rank} died with exit code {o.exitcode} (an abort is never acceptable)"
        assert o.error is None, f"rank {o.rank} failed outside the injected faults:\n{o.error}"
        assert o.exited_cleanly, f"rank {o.rank} passed, then its process ended with {o.exit_status}"
    return results


def rows(scenario: str, fault: str) -> list[dict]:
    return [o.value[fault] for o in outcomes(scenario)]


def names_rank(message: str, rank: int) -> bool:
    return f"rank {rank}" in message or f"ranks [{rank}]" in message


# (scenario, fault, words every rank's message must contain)
RAISES = [
    ("gather_lengths_faults", "wrong lengths", ["local_lengths", "non-negative"]),
    ("gather_lengths_faults", "wrong dtype", ["local_lengths", "integers"]),
    ("gather_lengths_faults", "wrong trailing shape", ["columns differs"]),
    ("gather_lengths_faults", "empty stand-in", ["columns differs"]),
    ("rebalance_faults", "different plan", ["plan differs"]),
    ("rebalance_faults", "wrong lengths", ["cu_seqlens: example", "length"]),
    ("rebalance_faults", "wrong dtype", ["packed[0] differs", "float64"]),
    ("rebalance_faults", "wrong trailing shape", ["packed[0] differs", "(3,)"]),
    ("rebalance_faults", "different flags", ["check differs"]),
    ("rebalance_faults", "empty stand-in of the wrong dtype", ["packed[0] differs", "float64"]),
    ("rebalance_faults", "empty stand-in of the wrong shape", ["packed[0] differs"]),
    ("rebalance_faults", "no_grad on one rank", ["without gradients"]),
    ("orchestrator_faults", "wrong lengths", ["sizes['vision']", "non-negative"]),
    ("orchestrator_faults", "wrong dtype", ["sizes['vision']", "integers"]),
    ("orchestrator_faults", "wrong trailing shape", ["one entry per example"]),
    ("orchestrator_faults", "different plan", ["configuration differs", "alpha=2.0"]),
    ("orchestrator_faults", "different flags", ["configuration differs"]),
    ("orchestrator_faults", "wrong dtype in a move", ["packed[0] differs", "float64"]),
    ("ring_faults", "different plan", ["cu_seqlens differs"]),
    ("ring_faults", "different flags", ["causal differs"]),
    ("ring_faults", "wrong dtype", ["q differs", "float64"]),
    ("ring_faults", "wrong trailing shape", ["q differs", "(1, 8)"]),
    ("ring_faults", "wrong lengths", ["tokens"]),
    ("ring_faults", "wrong layout", ["contiguous shard"]),
    ("ring_faults", "cp_unshard lengths", ["cu_seqlens"]),
    ("all_gather_matmul_faults", "different flags", ["chunks differs"]),
    ("all_gather_matmul_faults", "wrong dtype", ["dtype differs"]),
    ("all_gather_matmul_faults", "wrong trailing shape", ["(K) differs"]),
    ("all_gather_matmul_faults", "different plan", ["shard_sizes"]),
    ("all_gather_matmul_faults", "wrong lengths", ["shard_sizes"]),
    ("all_gather_matmul_faults", "empty stand-in", ["dtype differs"]),
    ("all_gather_matmul_faults", "no_grad on one rank", ["without gradients"]),
    ("matmul_reduce_scatter_faults", "different flags", ["chunks differs"]),
    ("matmul_reduce_scatter_faults", "wrong dtype", ["dtype differs"]),
    ("matmul_reduce_scatter_faults", "wrong lengths", ["(M) differs"]),
    ("matmul_reduce_scatter_faults", "wrong trailing shape", ["(N) differs"]),
    ("matmul_reduce_scatter_faults", "different plan", ["shard_sizes differs"]),
    ("matmul_reduce_scatter_faults", "empty stand-in", ["(M) differs"]),
    ("tp_module_faults", "different plan", ["random state"]),
    ("tp_module_faults", "different flags", ["chunks differs"]),
    ("tp_module_faults", "wrong dtype", ["dtype"]),
    ("tp_module_faults", "wrong lengths", ["shard_sizes"]),
    ("hf_faults", "wrong lengths", ["image_grid_thw", "pixel_values"]),
    ("hf_faults", "different plan", ["cost differs"]),
    ("dynamic_cp_faults", "different budget", ["max_tokens_per_rank"]),
    ("dynamic_cp_faults", "bad position_ids", ["position_ids", "restart at 0"]),
    ("dynamic_cp_faults", "missing labels", ["labels"]),
]


@pytest.mark.parametrize(("scenario", "fault", "words"), RAISES, ids=[f"{s[:-7]}-{f}" for s, f, _ in RAISES])
def test_fault_raises_on_every_rank(scenario, fault, words):
    if scenario.startswith(("hf", "dynamic_cp")):
        pytest.importorskip("transformers", minversion="5.6")
    for r, row in enumerate(rows(scenario, fault)):
        assert row["raised"], f"rank {r} returned normally from '{fault}'"
        assert row["seconds"] < QUICK, f"rank {r} took {row['seconds']:.1f}s: found by a timeout, not checked"
        msg = row["message"]
        assert names_rank(msg, S.FAULTY), f"rank {r}'s message does not name rank {S.FAULTY}: {msg}"
        for w in words:
            assert w in msg, f"rank {r}'s message lacks {w!r}: {msg}"
        if r == S.FAULTY:
            assert row["type"] in ("ValueError", "TypeError", "RankMismatchError"), row["type"]
        else:
            assert "RankMismatchError" in row["bases"] and "ValueError" in row["bases"], row["type"]


def test_a_rank_without_examples_takes_part():
    rows_ = rows("gather_lengths_faults", "empty rank")
    for row in rows_:
        assert not row["raised"]
        lengths, src = row["value"]
        assert lengths == [3, 1, 4, 3, 1, 4] and src == [0, 0, 0, 2, 2, 2]


def _expected_rows(recv: list[int], lengths: list[int], src_counts: list[int], hidden: int = 4) -> np.ndarray:
    """The rows ``_examples`` made for the global examples ``recv`` (ids in the gathered order)."""
    ids = []
    for r, c in enumerate(src_counts):
        base = sum((3, 2, 4)[:r])
        ids += [base + j for j in range(c)]
    out = [[ids[g] * 100 + p + 0.25 * c for c in range(hidden)] for g in recv for p in range(lengths[g])]
    return np.asarray(out, dtype=np.float32).reshape(-1, hidden)


def test_rebalance_with_a_different_requires_grad_moves_data_and_gradients():
    """Rank 1's payload does not require grad: the backward all-to-all still runs on every rank
    (no hang), and the ranks that need gradients get exactly 2 x (loss = sum of squares)."""
    outs = outcomes("rebalance_faults")
    lengths = sum((S._examples(r)[0].tolist() for r in range(S.WORLD)), [])
    for o in outs:
        row = o.value["different requires_grad"]
        assert not row["raised"], row["message"]
        want = _expected_rows(o.value["expected"]["recv"], lengths, [3, 2, 4])
        np.testing.assert_array_equal(row["value"]["y"], want)
        if o.rank == S.FAULTY:
            assert row["value"]["grad"] is None
        else:
            np.testing.assert_array_equal(row["value"]["grad"], 2 * S._examples(o.rank)[1].numpy())


def test_rebalance_with_an_empty_rank_moves_the_right_rows():
    outs = outcomes("rebalance_faults")
    for o in outs:
        row = o.value["empty stand-in of the right kind"]
        assert not row["raised"], row["message"]
        exp = o.value["expected"]
        counts = [3, 0, 4] if S.FAULTY == 1 else None
        want = _expected_rows(exp["empty_recv"], exp["empty_lengths"], counts)
        np.testing.assert_array_equal(row["value"], want)


def test_orchestrator_with_an_empty_rank_plans():
    for row in rows("orchestrator_faults", "empty stand-in"):
        assert not row["raised"], row["message"]
        # ceil(vision / 2) + text per example, rank 1 contributes none
        assert sorted(row["value"]) == sorted([2 + 5, 0 + 6, 4 + 7] * 2)


def _ring_reference():
    from tests.pyops.attention_expected import attention_f64

    (q, k, v, cu), _ = S.ring_inputs(0, S.WORLD)
    q, k, v = (t.clone().requires_grad_(True) for t in (q, k, v))
    out, _ = attention_f64(q, k, v, cu, cu, 8**-0.5, causal=True)
    (out * out).sum().backward()
    return out.detach(), (q.grad, k.grad, v.grad), cu


def test_ring_attention_with_a_different_requires_grad():
    from mmbalance.collectives import cp_shard

    out, grads, cu = _ring_reference()
    for o in outcomes("ring_faults"):
        row = o.value["different requires_grad"]
        assert not row["raised"], row["message"]
        shard = lambda t, r=o.rank: cp_shard(t, cu, rank=r, degree=S.WORLD, layout="zigzag").numpy()  # noqa: E731
        np.testing.assert_allclose(row["value"]["out"], shard(out), atol=2e-5, rtol=1e-4)
        for got, want in zip(row["value"]["grads"], grads):
            if o.rank == S.FAULTY:
                assert got is None
            else:
                np.testing.assert_allclose(got, shard(want), atol=1e-4, rtol=1e-4)


def _gather_matmul_reference():
    xs, ws = S.tp_tensors(0)
    x = torch.cat(xs).requires_grad_(True)
    w = [t.clone().requires_grad_(True) for t in ws]
    ys = [x @ wi.t() for wi in w]
    sum((y * y).sum() for y in ys).backward()
    return ys, x.grad, [wi.grad for wi in w]


@pytest.mark.parametrize("fault", ["uneven feature split", "different requires_grad"])
def test_all_gather_matmul_uneven_and_mixed_grad(fault):
    ys, gx, gws = _gather_matmul_reference()
    offsets = np.cumsum([0, *S.M_SPLIT])
    for o in outcomes("all_gather_matmul_faults"):
        row = o.value[fault]
        assert not row["raised"], row["message"]
        r = o.rank
        np.testing.assert_allclose(row["value"]["y"], ys[r].detach().numpy(), rtol=1e-12, atol=1e-12)
        if fault == "uneven feature split" or r != S.FAULTY:
            np.testing.assert_allclose(
                row["value"]["gx"], gx[offsets[r] : offsets[r + 1]].numpy(), rtol=1e-10
            )
        else:
            assert row["value"]["gx"] is None
        if fault == "uneven feature split":
            np.testing.assert_allclose(row["value"]["gw"], gws[r].numpy(), rtol=1e-10)


@pytest.mark.parametrize("fault", ["uneven feature split", "different requires_grad"])
def test_matmul_reduce_scatter_uneven_and_mixed_grad(fault):
    outs = outcomes("matmul_reduce_scatter_faults")
    inputs = outs[0].value["inputs"]
    xs = [torch.from_numpy(t).requires_grad_(True) for t in inputs["xs"]]
    ws = [torch.from_numpy(t).requires_grad_(True) for t in inputs["ws"]]
    z = sum(x @ w.t() for x, w in zip(xs, ws))
    (z * z).sum().backward()
    rows_of = np.cumsum([0, 3, 2, 2])  # the even split of 7 rows over 3 ranks
    for o in outs:
        row = o.value[fault]
        assert not row["raised"], row["message"]
        r = o.rank
        np.testing.assert_allclose(
            row["value"]["z"], z[rows_of[r] : rows_of[r + 1]].detach().numpy(), rtol=1e-10
        )
        if fault == "uneven feature split" or r != S.FAULTY:
            np.testing.assert_allclose(row["value"]["gx"], xs[r].grad.numpy(), rtol=1e-10)
        else:
            assert row["value"]["gx"] is None
        if fault == "uneven feature split":
            np.testing.assert_allclose(row["value"]["gw"], ws[r].grad.numpy(), rtol=1e-10)


@pytest.mark.parametrize("fault", ["uneven feature split", "different requires_grad"])
def test_tp_modules_uneven_and_mixed_grad(fault):
    outs = outcomes("tp_module_faults")
    w = [o.value["weights"] for o in outs]
    w1 = torch.from_numpy(np.concatenate([x["w1"] for x in w])).requires_grad_(True)
    b1 = torch.from_numpy(np.concatenate([x["b1"] for x in w]))
    w2 = torch.from_numpy(np.concatenate([x["w2"] for x in w], axis=1)).requires_grad_(True)
    b2 = torch.from_numpy(w[0]["b2"])
    x = torch.from_numpy(np.concatenate(outs[0].value["xs"])).requires_grad_(True)
    y = torch.tanh(x @ w1.t() + b1) @ w2.t() + b2
    (y * y).sum().backward()
    offsets = np.cumsum([0, 3, 2, 4])
    for o in outs:
        row = o.value[fault]
        assert not row["raised"], row["message"]
        r = o.rank
        out_slice, in_slice = o.value["weights"]["slices"]
        np.testing.assert_allclose(
            row["value"]["y"], y[offsets[r] : offsets[r + 1]].detach().numpy(), rtol=1e-10
        )
        np.testing.assert_allclose(row["value"]["w1"], w1.grad[out_slice].numpy(), rtol=1e-9, atol=1e-12)
        np.testing.assert_allclose(row["value"]["w2"], w2.grad[:, in_slice].numpy(), rtol=1e-9, atol=1e-12)
        if fault == "uneven feature split" or r != S.FAULTY:
            np.testing.assert_allclose(
                row["value"]["gx"], x.grad[offsets[r] : offsets[r + 1]].numpy(), rtol=1e-9
            )
        else:
            assert row["value"]["gx"] is None


def test_hf_balance_casts_pixel_values_of_another_dtype():
    pytest.importorskip("transformers", minversion="5.6")
    for row in rows("hf_faults", "wrong dtype"):
        assert not row["raised"], row["message"]
        assert row["value"] == pytest.approx(row["reference"], rel=1e-5)


# ---------------------------------------------------------------------------------- lost ranks
ENTRIES = [
    "gather_lengths",
    "rebalance",
    "Orchestrator",
    "ring_attention",
    "all_gather_matmul",
    "matmul_reduce_scatter",
    "TP modules",
    "HF encoder balance",
]
LOST = [(e, how) for e in ENTRIES for how in ("dies", "leaves")]


@functools.lru_cache(maxsize=1)
def lost_outcomes() -> dict[tuple[str, str], list[Outcome]]:
    """Every (entry, dies/leaves) case in its own process group, six groups at a time (they mostly
    wait for the timeout)."""

    def one(case):
        entry, how = case
        return run_ranks(
            S.lost_rank, S.WORLD, entry, how, LOST_TIMEOUT + 4, pg_timeout=LOST_TIMEOUT, timeout=500
        )

    with concurrent.futures.ThreadPoolExecutor(max_workers=6) as pool:
        return dict(zip(LOST, pool.map(one, LOST)))


@pytest.mark.parametrize(("entry", "how"), LOST, ids=[f"{e}-{h}" for e, h in LOST])
def test_a_lost_rank_makes_every_other_rank_raise(entry, how):
    for o in lost_outcomes()[(entry, how)]:
        if o.rank == S.FAULTY:
            if how == "dies":
                assert o.exitcode == 17, f"the dying rank ended with {o.exitcode}"
            else:
                assert o.error is None and o.value == {"left": True}, o.error
                assert o.exited_cleanly, f"the departed rank's process ended with {o.exit_status}"
            continue
        assert o.reported, f"rank {o.rank} died with exit code {o.exitcode} (an abort) instead of raising"
        assert o.error is None, o.error
        assert o.value["raised"], f"rank {o.rank} returned normally although rank {S.FAULTY} never called"
        assert o.value["seconds"] < LOST_TIMEOUT + 15, o.value["seconds"]
        assert o.exited_cleanly, (
            f"rank {o.rank} raised as it should, then its process ended with {o.exit_status}"
        )


def test_dynamic_cp_shard_works_after_refused_faults():
    """After the refused batches the handle still shards: the group is usable and nothing moved."""
    got = [row["value"] for row in rows("dynamic_cp_faults", "healthy")]
    for row in rows("dynamic_cp_faults", "healthy"):
        assert not row["raised"], row["message"]
    # 3 ranks x sequences of 5 and 7 tokens: 36 tokens in all, each rank's positions within a sequence
    assert sum(len(v) for v in got) == 36
