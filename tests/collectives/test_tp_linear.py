"""``ColumnParallelLinear`` -> activation -> ``RowParallelLinear`` equals the unsharded MLP.

One 4-process gloo job builds sub-groups of 2, 3 and 4 ranks; on each, a two-layer MLP sharded with
the tensor-parallel modules (sequence-parallel input, uneven shards with an empty one, a middle
batch dimension) must give the loss and every gradient of the plain ``nn.Linear`` MLP, computed
here in float64.
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

from mmbalance.collectives import ColumnParallelLinear, RowParallelLinear, ShardLayout, sequence_shards
from tests.dist_utils import run_distributed
from tests.tolerances import tol

H, F, B = 10, 7, 2  # hidden, MLP width (not divisible by 2, 3 or 4), middle (batch) dimension
SETUPS = {
    # name: (per-rank sequence lengths, chunks, how the lengths reach the modules)
    "w2-argument-chunks2": ((3, 2), 2, "argument"),
    "w3-context-auto": ((0, 4, 1), None, "context"),
    "w4-context-chunks3": ((2, 0, 3, 1), 3, "context"),
    # neither: the column layer exchanges the lengths, the row layer assumes the even split
    "w4-even-exchanged": ((2, 2, 2, 2), 2, "none"),
}


def _model_and_data(name: str):
    seed = 100 + sum(map(ord, name))
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    fc1, fc2 = nn.Linear(H, F, dtype=torch.float64), nn.Linear(F, H, dtype=torch.float64)
    t = sum(SETUPS[name][0])
    x = torch.randn(t, B, H, generator=g, dtype=torch.float64)
    probe = torch.randn(t, B, H, generator=g, dtype=torch.float64)
    return fc1, fc2, x, probe


def _loss(out: torch.Tensor, probe: torch.Tensor) -> torch.Tensor:
    return (out * probe).sum() + 0.5 * (out**2).sum()


def _mlp_rank(rank: int, name: str, group) -> dict:
    sizes, chunks, how = SETUPS[name]
    fc1, fc2, x, probe = _model_and_data(name)
    col = ColumnParallelLinear.from_linear(fc1, group, chunks=chunks)
    row = RowParallelLinear.from_linear(fc2, group, chunks=chunks)
    rows = ShardLayout(sizes).rows(rank)
    x_r = x[rows].clone().requires_grad_()
    if how == "argument":
        out = row(torch.nn.functional.gelu(col(x_r, shard_sizes=sizes)), shard_sizes=sizes)
    elif how == "none":
        out = row(torch.nn.functional.gelu(col(x_r)))
    else:
        with sequence_shards(sizes):
            out = row(torch.nn.functional.gelu(col(x_r)))
    loss = _loss(out, probe[rows])
    loss.backward()
    grads = {
        "out_shape": tuple(out.shape),
        "loss": loss.detach(),
        "x": x_r.grad,
        "w1": col.weight.grad,
        "b1": col.bias.grad,
        "w2": row.weight.grad,
        "b2": row.bias.grad,
        "slices": (col.out_slice, row.in_slice),
    }
    return {k: v.numpy() if isinstance(v, torch.Tensor) else v for k, v in grads.items()}


def _suite(rank: int, world: int) -> dict[str, dict]:
    import torch.distributed as dist

    groups = {w: dist.new_group(list(range(w))) for w in (2, 3)}
    groups[4] = None
    out = {}
    for name, (sizes, _, _) in SETUPS.items():
        if rank < len(sizes):
            out[name] = _mlp_rank(rank, name, groups[len(sizes)])
        dist.barrier()
    return out


@functools.lru_cache(maxsize=1)
def _results() -> list[dict[str, dict]]:
    return run_distributed(_suite, 4, timeout=180)


@pytest.mark.distributed
@pytest.mark.parametrize("name", list(SETUPS))
def test_tensor_parallel_mlp_matches_unsharded(name: str):
    sizes = SETUPS[name][0]
    world = len(sizes)
    fc1, fc2, x, probe = _model_and_data(name)
    x = x.clone().requires_grad_()
    loss = _loss(fc2(torch.nn.functional.gelu(fc1(x))), probe)
    loss.backward()
    got = [_results()[r][name] for r in range(world)]
    t = tol(torch.float64, reduction=F * H)
    close = lambda a, b, what: torch.testing.assert_close(
        torch.as_tensor(a, dtype=torch.float64), b, **t, msg=lambda m: f"{what}: {m}"
    )
    close(sum(float(g["loss"]) for g in got), loss.detach(), "loss")
    layout = ShardLayout(sizes)
    for r, g in enumerate(got):
        out_slice, in_slice = g["slices"]
        assert g["out_shape"] == (sizes[r], B, H)
        close(g["x"], x.grad[layout.rows(r)], f"rank {r} input grad")
        close(g["w1"], fc1.weight.grad[out_slice], f"rank {r} column weight grad")
        close(g["b1"], fc1.bias.grad[out_slice], f"rank {r} column bias grad")
        close(g["w2"], fc2.weight.grad[:, in_slice], f"rank {r} row weight grad")
        close(g["b2"], fc2.bias.grad, f"rank {r} row bias grad (replicated, summed over the group)")
