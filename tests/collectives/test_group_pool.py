"""The process-group pool creates each rank set once and the groups work."""

from __future__ import annotations

import pytest

from tests.dist_utils import run_distributed

pytestmark = pytest.mark.distributed


def _worker(rank, world):
    import torch
    import torch.distributed as dist

    from mmbalance.collectives import GroupPool

    pool = GroupPool()
    steps = [[(0, 1), (2,)], [(2, 1, 0)], [(1, 0), (2,)], [(0, 2), (1,)], [(1, 0), (2,)]]
    sums = []
    for groups in steps:
        for ranks in groups:
            group = pool.get(ranks)
            if rank in ranks:
                t = torch.tensor([float(rank + 1)])
                dist.all_reduce(t, group=group)
                sums.append((tuple(sorted(ranks)), float(t)))
    errors = []
    for bad in ([], [0, 0], [3]):
        try:
            pool.get(bad)
        except ValueError:
            errors.append(True)
    from mmbalance.collectives.group import group_timeout

    groups = {r: pool.get(r) for r in ((0, 1), (0, 2))}  # cached: no new group, the same on every rank
    timeouts = [group_timeout(g).total_seconds() for r, g in groups.items() if rank in r]
    return {"created": pool.created, "hits": pool.hits, "sums": sums, "errors": errors, "timeouts": timeouts}


def test_groups_are_created_once_and_work():
    results = run_distributed(_worker, 3, timeout=120)
    for rank, res in enumerate(results):
        # distinct non-world sets: (0,1), (2,), (0,2), (1,); the world is never created
        assert res["created"] == 4 and res["hits"] == 5 + 2  # + the two lookups of the timeout check
        assert res["errors"] == [True, True, True]
        # the world's timeout (run_distributed's pg_timeout), not new_group's 30-minute default
        assert res["timeouts"] == [60.0] * (2 if rank == 0 else 1)
        for ranks, total in res["sums"]:
            assert rank in ranks and total == sum(r + 1 for r in ranks)
