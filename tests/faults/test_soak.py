"""Soak: thousands of Orchestrator + rebalance steps on 3 gloo ranks, each with a new plan.

Not in the default run (marker ``soak``; ``pytest -m soak tests/faults/test_soak.py``). Every step
plans new random sizes in the background thread, moves vision inputs to the encoder layout, the
encoder outputs and the text to the LLM layout (composed plans), assembles, and runs a backward
through every move. After a warm-up, resident memory must grow by less than 2%, the thread and
file-descriptor counts must stay flat, and no cache may grow with the number of steps.
``MMBALANCE_SOAK_STEPS`` overrides the 5,000 steps.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from tests.dist_utils import run_distributed

pytestmark = [pytest.mark.soak, pytest.mark.distributed, pytest.mark.timeout(3600)]

STEPS = int(os.environ.get("MMBALANCE_SOAK_STEPS", "5000"))
WARMUP = max(1, STEPS // 10)


def _rss_kb() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def _counts() -> dict[str, int]:
    import gc
    import importlib

    alltoall = importlib.import_module("mmbalance.collectives.exchange.alltoall")
    overlap_plan = importlib.import_module("mmbalance.collectives.overlap.plan")
    ring_plan = importlib.import_module("mmbalance.collectives.ring.plan")

    import warnings

    gc.collect()
    with warnings.catch_warnings():  # touching every object also touches deprecated torch aliases
        warnings.simplefilter("ignore")
        tensors = sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor))
    return {
        "rss_kb": _rss_kb(),
        "threads": len(os.listdir("/proc/self/task")),
        "fds": len(os.listdir("/proc/self/fd")),
        "routes": len(alltoall._ROUTES),
        "inverses": len(alltoall._INVERSES),
        "parked": len(importlib.import_module("mmbalance.collectives.inflight")._PARKED),
        "chunk_plans": overlap_plan.chunk_plan.cache_info().currsize,
        "ring_plans": ring_plan._ring_plan_cached.cache_info().currsize,
        "tensors": tensors,
    }


def _soak(rank: int, world: int, steps: int, warmup: int) -> dict:
    from mmbalance.balancing import PhaseSpec
    from mmbalance.collectives import Orchestrator

    orch = Orchestrator({"vision": PhaseSpec("sum", downsample=2)}, ranks_per_node=1)
    proj = torch.nn.Linear(3, 3)
    rng = np.random.default_rng([7, rank])

    def sizes():
        n = int(rng.integers(0, 6))
        vision = rng.integers(0, 9, size=n) * (rng.random(n) < 0.7)
        return {"vision": vision, "text": rng.integers(1, 6, size=n)}

    fut = orch.submit(sizes())
    snapshots = {}
    for step in range(steps):
        plan = fut.result()
        nxt = sizes()
        fut = orch.submit(nxt)  # the next step plans while this one runs
        vis = plan.sizes["vision"][plan.src_ranks == rank]
        txt = plan.sizes["text"][plan.src_ranks == rank]
        cu_v = torch.zeros(vis.size + 1, dtype=torch.int32)
        cu_v[1:] = torch.from_numpy(np.cumsum(vis)).to(torch.int32)
        cu_t = torch.zeros(txt.size + 1, dtype=torch.int32)
        cu_t[1:] = torch.from_numpy(np.cumsum(txt)).to(torch.int32)
        patches = torch.randn(int(vis.sum()), 3, requires_grad=True)
        x, cu_x = plan.to_encoder("vision", patches, cu_v)
        feats = proj(x)
        # "connector": every second patch (ceil(len / 2) tokens per example, as the plan says)
        lens = (cu_x[1:] - cu_x[:-1]).tolist()
        keep = [int(cu_x[j]) + i for j, n in enumerate(lens) for i in range(0, n, 2)]
        out = feats[torch.tensor(keep, dtype=torch.long)] if keep else feats[:0]
        cu_o = torch.zeros(len(lens) + 1, dtype=torch.int32)
        cu_o[1:] = torch.tensor(np.cumsum([(n + 1) // 2 for n in lens]), dtype=torch.int32)
        v_llm = plan.to_llm("vision", out, cu_o)
        t_llm = plan.to_llm("text", torch.randn(int(txt.sum()), 3), cu_t)
        seq, _ = plan.assemble({"vision": v_llm, "text": t_llm})
        seq.square().sum().backward()
        proj.zero_grad(set_to_none=True)
        if step + 1 == warmup:
            snapshots["warm"] = _counts()
    fut.result()
    snapshots["end"] = _counts()
    orch.close()
    return snapshots


def test_soak_memory_threads_and_caches_stay_flat():
    results = run_distributed(_soak, 3, STEPS, WARMUP, timeout=3600, pg_timeout=120)
    report = []
    for rank, snap in enumerate(results):
        warm, end = snap["warm"], snap["end"]
        growth = end["rss_kb"] / warm["rss_kb"] - 1
        report.append(
            f"rank {rank}: rss {warm['rss_kb']} -> {end['rss_kb']} kB ({100 * growth:+.2f}%), {end}"
        )
        assert growth < 0.02, report[-1]
        for key in ("threads", "fds", "routes", "inverses", "parked", "chunk_plans", "ring_plans"):
            assert end[key] <= warm[key], f"rank {rank}: {key} grew from {warm[key]} to {end[key]}"
        assert end["tensors"] <= warm["tensors"] + 16, (
            f"rank {rank}: live tensors {warm['tensors']} -> {end['tensors']}"
        )
    print("\n" + "\n".join(report))
