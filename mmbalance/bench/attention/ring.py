"""Ring attention against one rank: its time and how much of its communication is hidden.

Ring: ``degree`` processes (NCCL when that many GPUs are visible, gloo on CPU otherwise) run
``ring_attention`` forward, and forward + backward, on one long causal sequence in the zigzag
layout; compared with one rank doing all the work (``attention_block`` on the whole sequence).
The forward is also run with communication only (``comm_ms``: k/v circulate, no blocks) and
computation only (``compute_ms``: blocks on pre-gathered k/v, no transfers), and the full loop
measures the time it blocks waiting for transfers (``exposed_comm_ms``);
``comm_hidden = 1 - exposed / comm`` is the fraction of the ring's communication hidden behind
computation (1 = fully overlapped).
"""

from __future__ import annotations

import dataclasses
import os
import time

import numpy as np
import torch

from ..harness import Row, device_name
from ..processes import spawn


@dataclasses.dataclass(frozen=True)
class RingConfig:
    seqlen: int
    heads: int
    kv_heads: int
    head_dim: int
    degree: int
    layout: str = "zigzag"

    @property
    def name(self) -> str:
        return f"L{self.seqlen}xH{self.heads}/{self.kv_heads}xD{self.head_dim}-causal-cp{self.degree}"


def _median_ms(fn, reps: int, sync) -> float:
    fn()
    times = []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    return float(np.median(times))


def _ring_worker(rank: int, world: int, cfg: RingConfig, reps: int) -> dict[str, float]:
    """One rank of the ring benchmark (run by :func:`~mmbalance.bench.processes.spawn`)."""
    import torch.distributed as dist

    from mmbalance.collectives import cp_shard, ring_attention
    from mmbalance.collectives.ring.attention import make_ring, ring_forward
    from mmbalance.pyops.attention_ops import attention_block

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    backend = dist.get_backend()
    device = f"cuda:{rank}" if backend == "nccl" else "cpu"
    dtype = torch.bfloat16 if backend == "nccl" else torch.float32
    g = torch.Generator().manual_seed(0)
    L = cfg.seqlen
    q, k, v = (
        torch.randn(L, h, cfg.head_dim, generator=g).to(device, dtype)
        for h in (cfg.heads, cfg.kv_heads, cfg.kv_heads)
    )
    cu = torch.tensor([0, L], dtype=torch.int32)
    ql, kl, vl = (cp_shard(t, cu, layout=cfg.layout) for t in (q, k, v))

    def sync() -> None:
        if backend == "nccl":
            torch.cuda.synchronize()
        dist.barrier()

    ring = make_ring(
        ql, kl, vl, cu, causal=True, softmax_scale=None, group=None, layout=cfg.layout, backend="auto"
    )
    # every rank's k/v shard, gathered once (untimed) for the computation-only run
    sizes = ring.plan.tokens
    ks = [torch.empty((max(sizes), *kl.shape[1:]), dtype=dtype, device=device) for _ in range(world)]
    vs = [torch.empty_like(t) for t in ks]
    dist.all_gather(ks, torch.cat([kl, kl.new_zeros((max(sizes) - kl.shape[0], *kl.shape[1:]))]))
    dist.all_gather(vs, torch.cat([vl, vl.new_zeros((max(sizes) - vl.shape[0], *vl.shape[1:]))]))
    kv_all = {s: (ks[s][: sizes[s]], vs[s][: sizes[s]]) for s in range(world)}
    res = {
        "ring": _median_ms(lambda: ring_forward(ring, ql, kl, vl), reps, sync),
        "compute": _median_ms(
            lambda: ring_forward(ring, ql, kl, vl, communicate=False, kv_blocks=kv_all), reps, sync
        ),
        "comm": _median_ms(lambda: ring_forward(ring, ql, kl, vl, compute=False), reps, sync),
    }
    stats: dict[str, float] = {}
    for _ in range(reps):
        ring_forward(ring, ql, kl, vl, stats=stats)
    res["exposed"] = stats.get("wait_s", 0.0) * 1e3 / reps
    qg, kg, vg = (t.detach().requires_grad_() for t in (ql, kl, vl))
    dout = torch.randn_like(ql)

    def ring_fwd_bwd():
        out = ring_attention(qg, kg, vg, cu, causal=True, layout=cfg.layout)
        torch.autograd.grad(out, (qg, kg, vg), dout)

    res["ring_fwd_bwd"] = _median_ms(ring_fwd_bwd, reps, sync)
    if rank == 0:
        cu_d = cu.to(device)
        full = [t.detach().requires_grad_() for t in (q, k, v)]
        dfull = torch.randn_like(q)
        fwd1 = lambda: attention_block(full[0], full[1], full[2], cu_d, cu_d, L, L, causal=True)  # noqa: E731

        def single_fwd_bwd():
            torch.autograd.grad(fwd1()[0], full, dfull)

        nosync = (lambda: torch.cuda.synchronize()) if backend == "nccl" else (lambda: None)
        with torch.no_grad():
            res["single"] = _median_ms(fwd1, reps, nosync)
        res["single_fwd_bwd"] = _median_ms(single_fwd_bwd, reps, nosync)
    return res


def bench_ring(cfg: RingConfig, reps: int) -> list[Row]:
    backend = "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= cfg.degree else "gloo"
    results = dict(enumerate(spawn(_ring_worker, cfg.degree, cfg, reps, backend=backend)))
    worst = {
        key: max(r[key] for r in results.values())
        for key in ("ring", "compute", "comm", "ring_fwd_bwd", "exposed")
    }
    single, single_fb = results[0]["single"], results[0]["single_fwd_bwd"]
    # communication not overlapped = time blocked waiting for transfers in the full ring loop
    hidden = 1.0 - worst["exposed"] / worst["comm"] if worst["comm"] > 0 else 1.0
    dev = device_name("cuda" if backend == "nccl" else "cpu")
    dtype = "bfloat16" if backend == "nccl" else "float32"
    provider = f"ring-{cfg.layout}-{backend}"
    return [
        Row("ring_attention_fwd", provider, cfg.name, dtype, dev, worst["ring"], {
            "single_rank_ms": single, "speedup": single / worst["ring"], "compute_ms": worst["compute"],
            "comm_ms": worst["comm"], "exposed_comm_ms": worst["exposed"], "comm_hidden": min(1.0, max(0.0, hidden))}),
        Row("ring_attention_fwd_bwd", provider, cfg.name, dtype, dev, worst["ring_fwd_bwd"], {
            "single_rank_ms": single_fb, "speedup": single_fb / worst["ring_fwd_bwd"]}),
    ]  # fmt: skip
