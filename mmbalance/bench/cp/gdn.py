"""A Gated DeltaNet layer under context parallelism: the state hand-off against gathering the sequence.

    python -m mmbalance.bench.cp.gdn [--quick | --full] [--json FILE]   (mmbalance bench gdn)

A sequence of ``length`` tokens split over a CP group of ``degree`` ranks (gloo on CPU, NCCL where
every rank has a GPU), each rank holding ``length / degree`` tokens of one Gated DeltaNet layer's
inputs (on a GPU Qwen3.5's shape: 32 value heads and 16 key heads of 128, a conv window of 4; on a
CPU, and with ``--quick``, 8 heads of 64, where the maps' reference loop runs instead of the kernel). Per layer and rank, what ``cp/linear.py`` exchanges and what gathering
the whole sequence would:

* ``handoff``: the maps of the rank's piece (``torch.ops.mmbalance.delta_rule_chunk_state``), their
  all-gather over the group (``K (K + V)`` values a head, whatever the length) and the composition
  of the state the piece starts from; bytes sent: the maps and the conv window (``3 x conv_dim``);
* ``gather``: an all-gather of every rank's conv inputs, keys, values, decays and write strengths
  (what a layer that recomputes the whole sequence on every rank, or a head-parallel all-to-all,
  moves: ``length x (conv_dim + 2 heads)`` values in all).

Times are the slowest rank's median; ``ratio`` is gather over handoff, in bytes and in time, taken
in one run on one machine (``device`` says which). The hand-off costs the same whatever the length;
the gather grows with it.

``gdn_maps_backward``: the memory of the maps' backward for one rank's piece, one process. The
fused kernel's buffers besides its outputs (what its launcher allocates for a GPU's blocks:
checkpoints every ``sqrt(piece)`` tokens, one segment's states, the column blocks' partial sums)
against what autograd keeps through the torch reference for its backward (measured in the
reference's forward: every tensor it saves, each storage once). On a GPU, forward + backward of
each path is also timed (``time_ms``: the kernel's), with its peak memory; on a CPU no backward
runs.
"""

from __future__ import annotations

import time

import numpy as np
import torch
import torch.distributed as dist

from ..harness import Row, base_parser, device_name, report
from ..processes import spawn

SHAPES = {
    "qwen3.5": dict(v_heads=32, k_heads=16, key=128, value=128),
    "small": dict(v_heads=8, k_heads=8, key=64, value=64),
}


def _median_ms(fn, reps: int, cuda: bool) -> float:
    times = []
    for _ in range(reps):
        if cuda:
            torch.cuda.synchronize()
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    t = torch.tensor([float(np.median(times))])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _worker(rank, world, args):
    from mmbalance.pyops.delta_rule import compose_chunk_states, delta_rule_chunk_state

    cuda = dist.get_backend() == "nccl"
    dev = torch.device("cuda") if cuda else torch.device("cpu")
    shape = SHAPES[args.shape]
    heads, kh, dk, dv = shape["v_heads"], shape["k_heads"], shape["key"], shape["value"]
    conv_dim = 2 * kh * dk + heads * dv
    rows = []
    for length in args.lengths:
        local = length // world
        g = torch.Generator(device="cpu").manual_seed(rank)
        k = torch.nn.functional.normalize(torch.randn(local, heads, dk, generator=g), dim=-1).to(dev)
        v = torch.randn(local, heads, dv, generator=g).to(dev)
        decay = (-torch.rand(local, heads, generator=g)).to(dev)
        beta = torch.rand(local, heads, generator=g).to(dev)
        cu = torch.tensor([0, local], dtype=torch.int64, device=dev)
        inputs = torch.randn(local, conv_dim + 2 * heads, generator=g).to(dev)

        def handoff():
            m, u = delta_rule_chunk_state(k, v, decay, beta, cu, local)
            maps = torch.cat([m, u], dim=-1).contiguous()
            parts = [torch.empty_like(maps) for _ in range(world)]
            dist.all_gather(parts, maps)
            every = torch.cat(parts)
            if rank:
                compose_chunk_states(every[:rank, ..., :dk], every[:rank, ..., dk:])

        def gather():
            parts = [torch.empty_like(inputs) for _ in range(world)]
            dist.all_gather(parts, inputs)

        handoff()
        gather()
        t_handoff = _median_ms(handoff, args.reps, cuda)
        t_gather = _median_ms(gather, args.reps, cuda)
        bytes_handoff = 4 * (heads * dk * (dk + dv) + 3 * conv_dim)
        bytes_gather = 4 * local * (conv_dim + 2 * heads)
        rows.append(
            dict(
                degree=world, length=length, handoff_ms=t_handoff, gather_ms=t_gather,
                handoff_KB=bytes_handoff / 1e3, gather_KB=bytes_gather / 1e3,
                bytes_ratio=bytes_gather / bytes_handoff, time_ratio=t_gather / max(t_handoff, 1e-9),
            )
        )  # fmt: skip
    return rows if rank == 0 else None


def _saved_bytes(fn) -> int:
    """Bytes of every tensor autograd saves while ``fn()`` runs (each storage once)."""
    storages: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        storages[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    del out
    return sum(storages.values())


def _backward_rows(args) -> list[Row]:
    """``gdn_maps_backward`` rows (module docstring) for every piece length ``length / degree``."""
    from mmbalance.kernels.delta_rule import backward_buffers
    from mmbalance.pyops.delta_rule import delta_rule_chunk_state, delta_rule_chunk_state_ref

    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    shape = SHAPES[args.shape]
    heads, dk, dv = shape["v_heads"], shape["key"], shape["value"]
    rows = []
    for local in sorted({length // d for length in args.lengths for d in args.degrees}):
        if local > args.backward_max:
            continue
        g = torch.Generator(device="cpu").manual_seed(local)
        base = [
            torch.nn.functional.normalize(torch.randn(local, heads, dk, generator=g), dim=-1),
            torch.randn(local, heads, dv, generator=g),
            -torch.rand(local, heads, generator=g),
            torch.rand(local, heads, generator=g),
        ]
        base = [t.to(dev) for t in base]
        cu = torch.tensor([0, local], dtype=torch.int64, device=dev)
        kk, vv, gg, bb = (t.clone().requires_grad_() for t in base)
        reference = _saved_bytes(lambda: delta_rule_chunk_state_ref(kk, vv, gg, bb, cu, local))
        shapes = backward_buffers(1, heads, dk, dv, local, local)
        fused = 4 * sum(int(np.prod(sh)) for sh in shapes.values())
        metrics = dict(
            piece=local, reference_MB=reference / 1e6, fused_MB=fused / 1e6, memory_ratio=reference / fused
        )
        times = {}
        if cuda:  # both backwards run: time and peak memory of forward + backward
            for backend in ("triton", "reference"):

                def step(backend=backend):
                    xs = [t.clone().requires_grad_() for t in base]
                    m, u = delta_rule_chunk_state(*xs, cu, local, backend=backend)
                    (m.sum() + u.sum()).backward()

                step()
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                t0 = time.perf_counter()
                for _ in range(args.reps):
                    step()
                torch.cuda.synchronize()
                times[backend] = (time.perf_counter() - t0) * 1e3 / args.reps
                metrics[f"{backend}_peak_MB"] = torch.cuda.max_memory_allocated() / 1e6
            metrics["time_ratio"] = times["reference"] / times["triton"]
            torch.cuda.empty_cache()  # the reference's blocks go back before the ranks start
        dname = device_name(dev.type)
        rows.append(Row("gdn_maps_backward", "mmbalance", f"L{local}/{args.shape}", "fp32", dname,
                        times.get("triton", float("nan")), metrics))  # fmt: skip
    return rows


def run(args) -> list[Row]:
    out = _backward_rows(args)
    dev = device_name("cuda" if torch.cuda.is_available() else "cpu")
    for degree in args.degrees:
        for r in spawn(_worker, degree, args, pg_timeout=120.0)[0]:
            metrics = {k: v for k, v in r.items() if k not in ("handoff_ms",)}
            out.append(Row("gdn_cp_handoff", "mmbalance", f"d{r['degree']}xL{r['length']}/{args.shape}", "fp32", dev,
                           r["handoff_ms"], metrics))  # fmt: skip
    return out


def main(argv=None) -> None:
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument(
        "--backward-max",
        type=int,
        default=None,
        help="longest piece whose maps' backward memory is measured (default: 2048; autograd through the reference keeps several states a token)",
    )
    args = p.parse_args(argv)
    gpu = torch.cuda.is_available()
    if args.backward_max is None:
        args.backward_max = 2048
    if args.quick:
        args.shape, args.degrees, args.lengths = "small", [2], [1024]
    elif args.full:
        args.shape = "qwen3.5" if gpu else "small"
        args.degrees, args.lengths = [2, 3, 4], ([8192, 32768, 131072] if gpu else [4096, 16384, 65536])
    else:
        args.shape, args.degrees = ("qwen3.5" if gpu else "small"), [2, 4]
        args.lengths = [8192, 32768] if gpu else [4096, 16384]
    report(
        run(args),
        args.json,
        "Gated DeltaNet under CP: the state hand-off against gathering the sequence, per layer; the maps' "
        "backward memory, fused kernel against autograd through the reference",
    )


if __name__ == "__main__":
    main()
