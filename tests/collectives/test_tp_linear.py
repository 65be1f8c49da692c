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

from mmbalance.collectives import ColumnParallelLinear, RowParallelLinear
from mmbalance.collectives.overlap.plan import ShardLayout
from mmbalance.collectives.overlap.tp_linear import sequence_shards
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


# ------------------------------------------------------------------ initialization (master weights)
INIT_H, INIT_F = 12, 10  # F = 10 over 4 ranks: uneven shards (3, 3, 2, 2)


def _init_rank(rank: int, world: int, seed: int) -> dict:
    import torch.distributed as dist

    torch.manual_seed(seed)  # every rank alike: the generator state the master weights come from
    col = ColumnParallelLinear(INIT_H, INIT_F, dtype=torch.float64)
    row = RowParallelLinear(INIT_F, INIT_H, dtype=torch.float64)
    out = {"col_w": col.weight.detach().numpy(), "col_b": col.bias.detach().numpy()}
    out.update(row_w=row.weight.detach().numpy(), row_b=row.bias.detach().numpy())
    out["slices"] = (col.out_slice, row.in_slice)
    # a rank seeded differently would draw other master weights (and another replicated bias):
    # refused on every rank at construction
    torch.manual_seed(seed + (1 if rank == world - 1 else 0))
    try:
        ColumnParallelLinear(INIT_H, INIT_F, dtype=torch.float64)
        out["mismatch"] = None
    except ValueError as exc:
        out["mismatch"] = str(exc)
    dist.barrier()
    return out


@pytest.mark.distributed
def test_sharded_init_equals_the_dense_init_shard_for_shard():
    """Megatron's rule: the gathered shards are the weights nn.Linear draws from the same seed, so
    the TP weight has full rank (identical shards on every rank would give rank F / W)."""
    seed, world = 1234, 4
    got = run_distributed(_init_rank, world, seed, timeout=120)
    torch.manual_seed(seed)
    dense_col = nn.Linear(INIT_H, INIT_F, dtype=torch.float64)
    dense_row = nn.Linear(INIT_F, INIT_H, dtype=torch.float64)
    col_w = torch.cat([torch.from_numpy(g["col_w"]) for g in got])
    col_b = torch.cat([torch.from_numpy(g["col_b"]) for g in got])
    row_w = torch.cat([torch.from_numpy(g["row_w"]) for g in got], dim=1)
    assert torch.equal(col_w, dense_col.weight.detach()) and torch.equal(col_b, dense_col.bias.detach())
    assert torch.equal(row_w, dense_row.weight.detach())
    for g in got:
        assert torch.equal(torch.from_numpy(g["row_b"]), dense_row.bias.detach())  # replicated
    assert int(torch.linalg.matrix_rank(col_w)) == INIT_F
    assert int(torch.linalg.matrix_rank(row_w)) == INIT_F
    for g in got:
        assert g["mismatch"] is not None and "random state" in g["mismatch"] and "rank 3" in g["mismatch"]
