"""Sliced all-gather + GEMM and GEMM + reduce-scatter (``collectives/overlap/matmul.py``).

Multi-rank checks run in one 4-process gloo job (spawning is the expensive part on CPU) that
builds sub-groups of 2, 3 and 4 ranks and runs every case on each; the parametrized tests below
then compare each case's outputs and gradients with a float64 reference computed here, in the
test process, from the same seeded inputs.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import zlib

import pytest
import torch

from mmbalance.collectives import all_gather_matmul, matmul_reduce_scatter
from mmbalance.collectives.overlap import plan as plan_mod
from mmbalance.collectives.overlap._copy_engine import not_supported_reasons
from mmbalance.collectives.overlap.plan import (
    OverlapCostModel,
    ShardLayout,
    choose_chunks,
    chunk_plan,
    exchange_shard_sizes,
)
from tests.dist_utils import run_distributed
from tests.tolerances import tol

K, N = 13, 11  # deliberately not multiples of anything
LAYOUTS = {
    2: [(7, 4), (0, 9)],
    3: [(5, 0, 6), (4, 4, 4)],
    4: [(2, 7, 0, 4), (3, 3, 3, 3)],
}


@dataclasses.dataclass(frozen=True)
class Case:
    op: str  # "ag" (all_gather_matmul) or "rs" (matmul_reduce_scatter)
    sizes: tuple[int, ...]
    chunks: int | None
    bias: bool = True
    pass_sizes: bool = True
    save_gathered: bool = True
    dtype: str = "float64"

    @property
    def id(self) -> str:
        s = "-".join(map(str, self.sizes))
        extra = "" if self.bias else "-nobias"
        extra += "" if self.pass_sizes else "-exchange"
        extra += "" if self.save_gathered else "-regather"
        extra += "" if self.dtype == "float64" else f"-{self.dtype}"
        return f"{self.op}-w{len(self.sizes)}-rows{s}-chunks{self.chunks}{extra}"


def _cases() -> list[Case]:
    out = []
    for layouts in LAYOUTS.values():
        for sizes in layouts:
            m = sum(sizes)
            for op in ("ag", "rs"):
                for c in [None, *range(1, m + 3)]:
                    out.append(
                        Case(
                            op,
                            sizes,
                            c,
                            pass_sizes=(c is None or c % 2 == 0 or op == "rs"),
                            save_gathered=not (op == "ag" and c in (2, m)),
                        )
                    )
                out.append(Case(op, sizes, 3, bias=False))
                out.append(Case(op, sizes, 3, dtype="float32"))
    return out


CASES = _cases()


def _inputs(case: Case) -> dict[str, torch.Tensor]:
    """Full (unsharded) float64 inputs of a case, identical in every process."""
    g = torch.Generator().manual_seed(zlib.crc32(case.id.encode()))
    w, m = len(case.sizes), sum(case.sizes)
    r = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64)
    if case.op == "ag":
        return {"x": r(m, K), "w": r(w, N, K), "b": r(w, N), "g": r(w, m, N)}
    return {"x": r(w, m, K), "w": r(w, N, K), "b": r(N), "g": r(m, N)}


def _reference(case: Case) -> list[dict[str, torch.Tensor | None]]:
    """Per-rank expected output and gradients, in float64, with plain torch math."""
    t = _inputs(case)
    lay = ShardLayout(case.sizes)
    out = []
    for r in range(len(case.sizes)):
        rows = lay.rows(r)
        if case.op == "ag":
            y = t["x"] @ t["w"][r].T + (t["b"][r] if case.bias else 0)
            gx = sum(t["g"][s] @ t["w"][s] for s in range(len(case.sizes)))[rows]
            gw = t["g"][r].T @ t["x"]
            gb = t["g"][r].sum(0) if case.bias else None
        else:
            full = sum(t["x"][s] @ t["w"][s].T for s in range(len(case.sizes)))
            y = full[rows] + (t["b"] if case.bias else 0)
            gx = t["g"] @ t["w"][r]
            gw = t["g"].T @ t["x"][r]
            gb = t["g"].sum(0) if case.bias else None
        out.append({"y": y, "gx": gx, "gw": gw, "gb": gb})
    return out


def _run_case(case: Case, rank: int, group) -> dict[str, torch.Tensor | None]:
    t = _inputs(case)
    dtype = getattr(torch, case.dtype)
    lay = ShardLayout(case.sizes)
    sizes = case.sizes if case.pass_sizes else None
    if case.op == "ag":
        x = t["x"][lay.rows(rank)].to(dtype).requires_grad_()
        w = t["w"][rank].to(dtype).requires_grad_()
        b = t["b"][rank].to(dtype).requires_grad_() if case.bias else None
        y = all_gather_matmul(
            x, w, group, chunks=case.chunks, bias=b, shard_sizes=sizes, save_gathered=case.save_gathered
        )
        y.backward(t["g"][rank].to(dtype))
    else:
        x = t["x"][rank].to(dtype).requires_grad_()
        w = t["w"][rank].to(dtype).requires_grad_()
        b = t["b"].to(dtype).requires_grad_() if case.bias else None
        y = matmul_reduce_scatter(x, w, group, chunks=case.chunks, bias=b, shard_sizes=sizes)
        y.backward(t["g"][lay.rows(rank)].to(dtype))
    # numpy, not tensors: tensors travel through the result queue as shared memory handles that
    # die with the worker process
    grads = {"y": y.detach(), "gx": x.grad, "gw": w.grad, "gb": None if b is None else b.grad}
    return {k: None if v is None else v.numpy() for k, v in grads.items()}


def _adjoint(rank: int, group, sizes: tuple[int, ...]) -> tuple[float, float]:
    """<A x, g> and <x, A* g> summed over the group, A = all_gather_matmul, A* = matmul_reduce_scatter."""
    import torch.distributed as dist

    gen = torch.Generator().manual_seed(7 + len(sizes))
    w = len(sizes)
    xs = torch.randn(sum(sizes), K, generator=gen, dtype=torch.float64)
    ws = torch.randn(w, N, K, generator=gen, dtype=torch.float64)
    gs = torch.randn(w, sum(sizes), N, generator=gen, dtype=torch.float64)
    x = xs[ShardLayout(sizes).rows(rank)]
    lhs = (all_gather_matmul(x, ws[rank], group, chunks=3, shard_sizes=sizes) * gs[rank]).sum()
    rhs = (
        x * matmul_reduce_scatter(gs[rank], ws[rank].T.contiguous(), group, chunks=2, shard_sizes=sizes)
    ).sum()
    both = torch.stack([lhs, rhs])
    dist.all_reduce(both, group=group)
    return float(both[0]), float(both[1])


def _suite(rank: int, world: int) -> dict:
    """Runs in each of 4 processes: every case on a sub-group of its size (ranks 0..w-1), then
    the failure checks on ranks 0-1 while ranks 2-3 check that a missing peer times out."""
    from datetime import timedelta

    import torch.distributed as dist

    groups = {w: dist.new_group(list(range(w))) for w in (2, 3)}
    groups[4] = None  # the default group
    short = dist.new_group([2, 3], timeout=timedelta(seconds=5))
    results: dict = {"cases": {}, "adjoint": {}, "failures": {}, "exchange": {}}
    for w, layouts in LAYOUTS.items():
        if rank < w:
            for case in CASES:
                if len(case.sizes) == w:
                    results["cases"][case.id] = _run_case(case, rank, groups[w])
            results["adjoint"][w] = _adjoint(rank, groups[w], layouts[0])
            results["exchange"][w] = exchange_shard_sizes(layouts[0][rank], groups[w]).sizes
        dist.barrier()
    if rank < 2:
        results["failures"] = _failures(rank, groups[2])
    else:
        results["failures"] = _timeout(rank - 2, short)
    return results


@functools.lru_cache(maxsize=1)
def _suite_results() -> list[dict]:
    return run_distributed(_suite, 4, timeout=240)


@pytest.mark.distributed
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_matches_float64_reference(case: Case):
    got = _suite_results()
    ref = _reference(case)
    dtype = getattr(torch, case.dtype)
    for r in range(len(case.sizes)):
        out = {k: None if v is None else torch.from_numpy(v) for k, v in got[r]["cases"][case.id].items()}
        for name in ("y", "gx", "gw", "gb"):
            if ref[r][name] is None:
                assert out[name] is None, f"rank {r} {name}"
                continue
            reduction = max(K, N, sum(case.sizes)) * len(case.sizes)
            torch.testing.assert_close(
                out[name],
                ref[r][name].to(dtype),
                **tol(dtype, reduction),
                msg=lambda m, r=r, name=name: f"rank {r} {name}: {m}",
            )


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 3, 4], ids=lambda w: f"w{w}")
def test_the_two_ops_are_adjoint(world: int):
    lhs, rhs = _suite_results()[0]["adjoint"][world]
    assert lhs == pytest.approx(rhs, rel=1e-12, abs=1e-9)


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 3, 4], ids=lambda w: f"w{w}")
def test_exchange_shard_sizes(world: int):
    for r in range(world):
        assert _suite_results()[r]["exchange"][world] == LAYOUTS[world][0]


# ----------------------------------------------------------------------------- failures, loudly


def _failures(rank: int, group) -> dict[str, str]:
    out: dict[str, str] = {}
    x = torch.randn(2 + rank, 5, dtype=torch.float64)
    w = torch.randn(3, 5, dtype=torch.float64)
    try:  # chunks differ between ranks: caught by the size exchange, on every rank
        all_gather_matmul(x, w, group, chunks=2 + rank)
    except ValueError as exc:
        out["chunks_mismatch"] = str(exc)
    try:
        all_gather_matmul(x, w, group, shard_sizes=(5, 5))
    except ValueError as exc:
        out["wrong_local_size"] = str(exc)
    try:
        all_gather_matmul(x, w, group, shard_sizes=(2, 3, 4))
    except ValueError as exc:
        out["wrong_length"] = str(exc)
    try:
        matmul_reduce_scatter(torch.randn(4, 5, dtype=torch.float64), w, group, shard_sizes=(1, 1))
    except ValueError as exc:
        out["wrong_total"] = str(exc)
    try:
        all_gather_matmul(x, w, group, backend="copy_engine", shard_sizes=(2, 3))
    except ValueError as exc:
        out["copy_engine_on_cpu"] = str(exc)
    return out


def _timeout(rank: int, group) -> dict[str, str]:
    """Rank 1 of ``group`` never joins: rank 0 must raise within the group's 5 s timeout, not hang."""
    import time

    if rank == 1:
        time.sleep(8)
        return {}
    x, w = torch.randn(2, 5), torch.randn(3, 5)
    t0 = time.perf_counter()
    try:
        all_gather_matmul(x, w, group, shard_sizes=(2, 3), chunks=2)
    except RuntimeError as exc:
        return {"timeout": f"{time.perf_counter() - t0:.1f}s {exc}"}
    return {}


def _failure_results() -> list[dict[str, str]]:
    return [r["failures"] for r in _suite_results()]


@pytest.mark.distributed
@pytest.mark.parametrize(
    "key, words",
    [
        ("chunks_mismatch", "chunks differs between ranks"),
        ("wrong_local_size", "shard_sizes[0]"),
        ("wrong_length", "shard_sizes has 3 entries"),
        ("wrong_total", "shard_sizes sums to 2 but x has 4 rows"),
        ("copy_engine_on_cpu", "copy_engine"),
    ],
    ids=["chunks-differ", "wrong-local-size", "wrong-length", "wrong-total", "copy-engine-on-cpu"],
)
def test_inconsistent_calls_raise_on_every_rank(key: str, words: str):
    for r, res in enumerate(_failure_results()[:2]):
        if key == "wrong_local_size" and r == 1:
            assert "shard_sizes[1]" in res[key]
            continue
        assert words in res.get(key, ""), f"rank {r}: {res.get(key)!r}"


@pytest.mark.distributed
def test_missing_peer_times_out_instead_of_hanging():
    msg = _failure_results()[2].get("timeout")
    assert msg is not None, "rank 0 did not raise"
    assert float(msg.split("s ")[0]) < 30


# ----------------------------------------------------------------------------- single-process


@pytest.mark.parametrize(
    "sizes, chunks",
    [((7, 4), 1), ((7, 4), 3), ((0, 9), 4), ((2, 7, 0, 4), 5), ((2, 7, 0, 4), 40), ((0, 0), 3), ((1,), 2)],
    ids=str,
)
def test_chunk_plan_partitions_rows(sizes, chunks):
    layout = ShardLayout(sizes)
    plan = chunk_plan(layout, chunks)
    assert len(plan) == min(chunks, layout.total)
    covered = []
    for c in plan:
        assert c.stop > c.start
        assert sum(p.stop - p.start for p in c.pieces) == c.stop - c.start
        for p in c.pieces:
            assert layout.offsets[p.rank] + p.start == p.row
            assert 0 <= p.start < p.stop <= sizes[p.rank]
            covered += list(range(p.row, p.row + p.stop - p.start))
    assert covered == list(range(layout.total))
    sizes_of_chunks = [c.stop - c.start for c in plan]
    assert not sizes_of_chunks or max(sizes_of_chunks) - min(sizes_of_chunks) <= 1


def test_shard_layout_validation():
    assert ShardLayout.even(10, 4).sizes == (3, 3, 2, 2)
    assert ShardLayout.from_sizes(torch.tensor([1, 2])).offsets == (0, 1)
    with pytest.raises(ValueError, match="shard_sizes"):
        ShardLayout((1, -1))
    with pytest.raises(ValueError, match="shard_sizes has 2 entries"):
        ShardLayout.from_sizes([1, 2], world_size=3)
    with pytest.raises(TypeError, match="shard_sizes"):
        ShardLayout.from_sizes("ab")  # type: ignore[arg-type]


def test_cost_model_choices():
    gpu = plan_mod.default_cost_model("cuda", torch.bfloat16)
    # hidden 8192, 16k tokens, TP 8: both sides are milliseconds, slicing pays
    assert 2 <= choose_chunks(16384, 8192, 1024, 8, torch.bfloat16, "cuda") <= gpu.max_chunks
    # a tiny GEMM is not worth slicing, one rank never is
    assert choose_chunks(64, 64, 64, 8, torch.bfloat16, "cuda") == 1
    assert choose_chunks(1 << 16, 8192, 8192, 1, torch.bfloat16, "cuda") == 1
    model = OverlapCostModel(flops=1e12, bandwidth=1e9, latency=1e-6, min_rows=100, max_chunks=64)
    assert model.choose(1000, 4096, 4096, 4, 2) <= 10  # at least min_rows rows per slice
    assert model.predict(4, 1000, 4096, 4096, 4, 2) < model.predict(1, 1000, 4096, 4096, 4, 2)


def test_env_overrides_chunks(monkeypatch):
    monkeypatch.setenv("MMBALANCE_OVERLAP_CHUNKS", "5")
    assert choose_chunks(64, 64, 64, 8, torch.float32, "cpu") == 5
    monkeypatch.setenv("MMBALANCE_OVERLAP_CHUNKS", "0")
    with pytest.raises(ValueError, match="MMBALANCE_OVERLAP_CHUNKS"):
        choose_chunks(64, 64, 64, 8, torch.float32, "cpu")


@pytest.mark.parametrize(
    "kwargs, exc, words",
    [
        ({"x_shard": torch.zeros(3, 4, 2)}, ValueError, "x_shard must be 2-D"),
        ({"weight": torch.zeros(5, 3)}, ValueError, "weight must be [N, K] with K"),
        ({"weight": torch.zeros(5, 4, dtype=torch.float64)}, TypeError, "weight dtype"),
        ({"weight": torch.zeros(5, 4, device="meta")}, ValueError, "weight is on meta"),
        ({"bias": torch.zeros(4)}, ValueError, "bias must be [N]"),
        ({"x_shard": torch.zeros(3, 4, dtype=torch.int32)}, TypeError, "x_shard must be a floating"),
        ({"x_shard": [[1.0]]}, TypeError, "x_shard must be a torch.Tensor"),
        ({"chunks": 0}, ValueError, "chunks must be a positive int"),
        ({"chunks": 2.5}, TypeError, "chunks must be None or a positive int"),
        ({"backend": "mpi"}, ValueError, "backend must be None or one of"),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_all_gather_matmul_validates_arguments(kwargs, exc, words):
    args = {"x_shard": torch.zeros(3, 4), "weight": torch.zeros(5, 4), "group": None}
    args.update(kwargs)
    with pytest.raises(exc, match=words.replace("[", r"\[").replace("]", r"\]")):
        all_gather_matmul(**args)


def test_matmul_reduce_scatter_validates_arguments():
    with pytest.raises(ValueError, match="weight must be"):
        matmul_reduce_scatter(torch.zeros(3, 4), torch.zeros(5, 6), None)
    with pytest.raises(ValueError, match="chunks"):
        matmul_reduce_scatter(torch.zeros(3, 4), torch.zeros(5, 4), None, chunks=-1)
    with pytest.raises(RuntimeError, match="not initialized"):
        matmul_reduce_scatter(torch.zeros(3, 4), torch.zeros(5, 4), None)


def test_copy_engine_reports_why_not_on_cpu():
    reasons = not_supported_reasons(torch.zeros(1))
    assert any("CUDA" in r for r in reasons)


@pytest.mark.gpu
def test_copy_engine_reasons_on_gpu():
    reasons = not_supported_reasons(torch.zeros(1, device="cuda"))
    assert all("CUDA tensors" not in r for r in reasons)
    assert os.environ.get("MMBALANCE_OVERLAP_BACKEND", "auto") in ("auto", "torch", "copy_engine")
