"""The README's "API in ten lines" block runs as written, on two gloo ranks, and its loss is the
unbalanced loss."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from tests.dist_utils import run_distributed

README = Path(__file__).resolve().parents[2] / "README.md"
pytestmark = pytest.mark.distributed


def readme_block(section: str) -> str:
    text = README.read_text()
    start = text.index(f"## {section}")
    return re.search(r"```python\n(.*?)```", text[start:], re.S).group(1)


def _data(rank: int):
    import torch

    g = torch.Generator().manual_seed(100 + rank)
    n = 6 if rank == 0 else 2  # rank 0 has far more work: the plan must move some of it
    seq = torch.randint(1, 40 if rank == 0 else 5, (n,), generator=g)
    cu = torch.zeros(n + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(seq, 0)
    tokens = torch.randn(int(cu[-1]), 4, dtype=torch.float64, generator=g)
    labels = torch.randn(int(cu[-1]), dtype=torch.float64, generator=g)
    return tokens, labels, cu


def _run_block(rank: int, world: int, code: str):
    import torch
    import torch.distributed as dist

    tokens, labels, cu_seqlens = _data(rank)
    weight = torch.linspace(-1.0, 1.0, 4, dtype=torch.float64)

    def model(x, cu):
        assert cu.dtype == torch.int32 and int(cu[-1]) == x.shape[0]
        return x @ weight

    def loss_fn(out, y):
        return (out - y) ** 2

    scope = dict(tokens=tokens, labels=labels, cu_seqlens=cu_seqlens, model=model, loss_fn=loss_fn)
    exec(compile(code, str(README), "exec"), scope)  # noqa: S102 - the README's own code
    total = scope["loss"].detach().clone()
    dist.all_reduce(total)
    moved = int(scope["plan"].moved().sum())
    return float(total), moved, int(scope["tokens"].shape[0])


def test_readme_api_block_runs_and_keeps_the_loss():
    code = readme_block("API in ten lines")
    got = run_distributed(_run_block, 2, code)
    # the reference: every rank's tokens, unmoved, normalized by the global token count
    import torch

    weight = torch.linspace(-1.0, 1.0, 4, dtype=torch.float64)
    parts = [_data(r) for r in range(2)]
    ref = sum(float(((t @ weight - y) ** 2).sum()) for t, y, _ in parts) / sum(
        t.shape[0] for t, _, _ in parts
    )
    for total, moved, _ in got:
        assert total == pytest.approx(ref, rel=1e-12)
        assert moved > 0  # the block did balance something
    sizes = np.array([g[2] for g in got])
    before = np.array([p[0].shape[0] for p in parts])
    assert sizes.sum() == before.sum() and sizes.max() < before.max()
