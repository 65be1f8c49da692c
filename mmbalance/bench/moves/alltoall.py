"""All-to-all batch communicator benchmark on real-data mixtures.

    python -m mmbalance.bench.moves.alltoall [--world 4] [--ranks-per-node 2] [--hidden 512] [--full] [--json FILE]

Spawns ``--world`` ranks (gloo on CPU here, NCCL when CUDA is present), each sampling 60 examples
of the shipped real-data mixture (LLM lengths), payload ``[T, hidden]`` fp32 (bf16 on GPU). For
three plans of the same step it reports the time of ``rebalance`` (slowest rank, median), the
largest per-rank send volume, the largest per-rank off-node volume, and the LLM balance:

* ``none``: no balancing (nothing moves; max/mean shows the imbalance left in place);
* ``plain+alg3``: post-balancing without sources, then the node-wise permutation (OrchMLLM);
* ``located``: our locality-aware plan (examples stay unless needed, node-mates first).
"""

from __future__ import annotations

import time

import numpy as np
import torch
import torch.distributed as dist

from ..harness import Row, base_parser, device_name, report
from ..processes import spawn

PER_RANK = 60


def _worker(rank, world, args):
    cuda = dist.get_backend() == "nccl"
    from mmbalance.balancing import Plan, imbalance, node_wise_permutation, post_balance
    from mmbalance.balancing.datasets import mixture
    from mmbalance.collectives import gather_lengths, rebalance

    dev = torch.device("cuda") if cuda else torch.device("cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    rows = []
    for step in range(args.steps):
        local = mixture(PER_RANK, 1000 * step + rank).llm
        if args.scale > 1:
            local = np.maximum(1, local // args.scale)
        lengths, src = gather_lengths(local)
        x = torch.randn(int(local.sum()), args.hidden, device=dev, dtype=dtype)
        cu = torch.zeros(local.size + 1, dtype=torch.int32, device=dev)
        cu[1:] = torch.from_numpy(np.cumsum(local)).to(dev, torch.int32)
        rpn = args.ranks_per_node
        plans = {
            # every example stays where it was sampled
            "none": Plan.from_destinations(lengths, src, world, src),
            "plain+alg3": node_wise_permutation(
                post_balance(lengths, world), rpn, src_ranks=src, method="fast"
            ),
            "located": post_balance(lengths, world, src_ranks=src, ranks_per_node=rpn),
        }
        for name, plan in plans.items():
            rebalance(x, cu, plan)  # warm-up and plan check
            times = []
            for _ in range(args.reps):
                if cuda:
                    torch.cuda.synchronize()
                dist.barrier()
                t0 = time.perf_counter()
                rebalance(x, cu, plan, check=False)
                if cuda:
                    torch.cuda.synchronize()
                times.append((time.perf_counter() - t0) * 1e3)
            t = torch.tensor([float(np.median(times))])
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            sent = plan.send_matrix()
            np.fill_diagonal(sent, 0)
            offn = plan.off_node_send(rpn) if plan.src_rank is not None else np.zeros(world)
            loads = np.bincount(plan.dst_rank, weights=lengths, minlength=world)
            elt = x.element_size() * args.hidden
            rows.append(
                dict(
                    step=step,
                    plan=name,
                    time_ms=float(t),
                    max_send_MB=sent.sum(1).max() * elt / 1e6,
                    max_offnode_MB=offn.max() * elt / 1e6,
                    total_moved_MB=sent.sum() * elt / 1e6,
                    llm_max_over_mean=imbalance(loads),
                )
            )
    return rows if rank == 0 else None


def run(args) -> list[Row]:
    result = spawn(_worker, args.world, args, pg_timeout=120.0)[0]
    dev = device_name("cuda" if torch.cuda.is_available() else "cpu")
    out = []
    for r in result:
        metrics = {k: v for k, v in r.items() if k not in ("plan", "time_ms")}
        out.append(
            Row(
                "rebalance",
                r["plan"],
                f"{args.world}x{PER_RANK}x{args.hidden}",
                "bf16" if torch.cuda.is_available() else "fp32",
                dev,
                r["time_ms"],
                metrics,
            )
        )
    return out


def main(argv=None) -> None:
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--ranks-per-node", type=int, default=2)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument(
        "--scale", type=int, default=4, help="divide lengths by this on CPU to keep payloads small"
    )
    args = p.parse_args(argv)
    if args.steps is None:
        args.steps = 3 if args.full else 1
    if torch.cuda.is_available():
        args.scale = 1
    if args.world % args.ranks_per_node:
        p.error("--ranks-per-node must divide --world")
    report(run(args), args.json, "rebalance: time (slowest rank), volumes, and LLM balance per plan")


if __name__ == "__main__":
    main()
