"""Attention blocks and ring attention: throughput and how much ring communication is hidden.

    python -m mmbalance.bench.attention [--full|--quick] [--json FILE] [--device cpu|cuda] [--degree N]
        [--no-ring] [--no-long] [--long-seqlen L]

Block ops (``attention_block`` forward, and forward + backward) against ``torch`` SDPA on the same
batch and, on GPUs with it installed, flash-attn's varlen function. Equal lengths run SDPA batched
with its fastest kernel; a batch of the shipped multimodal lengths (``mmbalance/data/mm_sizes.npz``,
16k tokens, sequences up to 4096) runs ours packed and SDPA padded to the longest with a mask, as a
user would otherwise run it; a window of 512 tokens over 32k runs next to full causal attention of
the same length (``vs_full_causal``). On CUDA ``mmbalance`` is ``backend="auto"`` (the ``backend``
column: which backend ran, forward / backward, with the FlashAttention torch runs), beside the
Triton kernels forced and torch's FlashAttention forced (``mmbalance_torch_flash_<FA2|FA3|FA4>``).
Reported in TFLOP/s with FLOPs ``4 * pairs * H * D`` for the forward (``pairs`` = allowed (query,
key) pairs, about half under a causal mask; padding is not work) and 2.5x that for the backward;
``vs_sdpa`` is SDPA's time over ours; ``host_us`` the host time of one forward call on a tiny input
(the launch cost). On CPU ``mmbalance`` runs the torch reference path (the kernels need a GPU).

Ring: ``degree`` processes (NCCL when that many GPUs are visible, gloo on CPU otherwise) run
``ring_attention`` forward, and forward + backward, on one long causal sequence in the zigzag
layout; compared with one rank doing all the work (``attention_block`` on the whole sequence).
The forward is also run with communication only (``comm_ms``: k/v circulate, no blocks) and
computation only (``compute_ms``: blocks on pre-gathered k/v, no transfers), and the full loop
measures the time it blocks waiting for transfers (``exposed_comm_ms``);
``comm_hidden = 1 - exposed / comm`` is the fraction of the ring's communication hidden behind
computation (1 = fully overlapped).
Long sequence on CPU (``attention_long_fwd_bwd``): one causal sequence (default 8192 tokens, 8
heads of 64, float32), forward + backward through autograd, ``attention_block`` (the blockwise CPU
path) against ``torch`` SDPA (its CPU flash kernel). Each variant runs in a fresh process, the
variants alternating, ``--long-rounds`` rounds; reported are the medians of the time per
forward + backward (the median of 2 timed calls after a measured warm-up call, per process) and of
the peak resident memory (``VmHWM``, reset through ``/proc/self/clear_refs`` once the inputs
exist and a tiny warm-up call has paid the one-time costs of a first call): ``peak_mib`` of the whole process and ``added_mib``, what the call added above the
inputs; ``time_vs_sdpa`` and ``added_vs_sdpa`` are ours over SDPA's.
Rows are keyed and written by the shared harness (``bench/harness.py``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import subprocess
import sys
import time

import numpy as np
import torch

from .harness import Row, base_parser, device_name, host_us, report, spawn, time_fn
from .hf_step import draw_lengths


@dataclasses.dataclass(frozen=True)
class BlockConfig:
    n_seqs: int
    seqlen: int
    heads: int
    kv_heads: int
    head_dim: int
    causal: bool
    dtype: torch.dtype
    window: int = -1  # window_left in positions (-1: none); a window of W tokens is W - 1
    lengths: tuple[int, ...] | None = None  # varlen: the sequences' lengths (seqlen: the longest)

    @property
    def name(self) -> str:
        mask = "causal" if self.causal else "full"
        if self.window >= 0:
            mask += f"-w{self.window + 1}"
        batch = (
            f"shipped{len(self.lengths)}x<={self.seqlen}"
            if self.lengths
            else f"B{self.n_seqs}xL{self.seqlen}"
        )
        return f"{batch}xH{self.heads}/{self.kv_heads}xD{self.head_dim}-{mask}"

    @property
    def all_lengths(self) -> list[int]:
        return list(self.lengths) if self.lengths else [self.seqlen] * self.n_seqs

    def flops_fwd(self) -> float:
        """``4 * pairs * H * D``: the allowed (query, key) pairs only (padding is not work)."""
        pairs = 0.0
        for n in self.all_lengths:
            if not self.causal:
                pairs += n * n
            elif self.window < 0 or self.window >= n - 1:
                pairs += n * (n + 1) / 2
            else:  # the first window+1 queries see every earlier key, the rest window+1 keys each
                w = self.window + 1
                pairs += w * (w + 1) / 2 + (n - w) * w
        return 4.0 * pairs * self.heads * self.head_dim


def block_configs(full: bool, device: str) -> list[BlockConfig]:
    if device == "cpu":
        dtype = torch.float32
        base = [BlockConfig(4, 256, 4, 2, 64, causal, dtype) for causal in (False, True)]
        base.append(BlockConfig(4, 256, 4, 2, 64, True, dtype, window=63))
        mixed = (37, 200, 5, 129, 64)
        base.append(BlockConfig(len(mixed), max(mixed), 4, 2, 64, True, dtype, lengths=mixed))
        if full:
            base += [
                BlockConfig(2, 1024, 8, 2, 64, True, dtype),
                BlockConfig(1, 2048, 4, 4, 128, True, dtype),
            ]
        return base
    dtype = torch.bfloat16
    base = [BlockConfig(8, 2048, 16, 4, 128, causal, dtype) for causal in (False, True)]
    base.append(BlockConfig(32, 512, 16, 4, 64, True, dtype))  # head dim 64 on short sequences
    # a window of 512 over 32k tokens, and full causal attention of the same length
    base += [BlockConfig(1, 32768, 32, 8, 128, True, dtype, window=w) for w in (511, -1)]
    ship = tuple(draw_lengths(16384, 4096, seed=0))  # the shipped mixture, as bench hf draws it
    base.append(BlockConfig(len(ship), max(ship), 16, 4, 128, True, dtype, lengths=ship))
    if full:
        base += [BlockConfig(b, n, h, h // 4, d, True, dtype) for b, n, h, d in
                 ((4, 8192, 32, 128), (1, 32768, 32, 128), (16, 1024, 32, 64))]  # fmt: skip
    return base


def _inputs(cfg: BlockConfig, device: str, requires_grad: bool):
    g = torch.Generator().manual_seed(0)
    tokens = sum(cfg.all_lengths)
    q = torch.randn(tokens, cfg.heads, cfg.head_dim, generator=g).to(device, cfg.dtype)
    k = torch.randn(tokens, cfg.kv_heads, cfg.head_dim, generator=g).to(device, cfg.dtype)
    v = torch.randn(tokens, cfg.kv_heads, cfg.head_dim, generator=g).to(device, cfg.dtype)
    cu = torch.tensor([0, *np.cumsum(cfg.all_lengths).tolist()], dtype=torch.int32, device=device)
    return [t.requires_grad_(requires_grad) for t in (q, k, v)], cu


def _sdpa(cfg: BlockConfig, device: str):
    """SDPA as a user runs it: a batch of equal lengths batched with its own causal flag; mixed
    lengths padded to the longest with a mask (causal and keys past each sequence's end); a window
    as a band mask."""
    lengths = cfg.all_lengths
    b, n = len(lengths), cfg.seqlen
    uniform = cfg.lengths is None
    mask = None
    if not uniform or cfg.window >= 0:
        pos = torch.arange(n, device=device)
        allowed = torch.ones(n, n, dtype=torch.bool, device=device)
        if cfg.causal:
            allowed &= pos[None, :] <= pos[:, None]
        if cfg.window >= 0:
            allowed &= pos[None, :] >= pos[:, None] - cfg.window
        keys = pos[None, :] < torch.tensor(lengths, device=device)[:, None]  # [B, n]
        mask = (allowed[None] & keys[:, None, :])[:, None]  # [B, 1, n, n]
    masking: dict = {"is_causal": cfg.causal} if mask is None else {"attn_mask": mask}
    index = torch.cat([torch.arange(length, device=device) + i * n for i, length in enumerate(lengths)])

    def run(q, k, v, cu):
        if uniform:  # equal lengths are a batch already: views, nothing copied
            qb, kb, vb = (t.view(b, n, t.shape[1], cfg.head_dim).transpose(1, 2) for t in (q, k, v))
            out = torch.nn.functional.scaled_dot_product_attention(qb, kb, vb, **masking, enable_gqa=True)
            return out.transpose(1, 2).reshape(q.shape)
        padded = []
        for t in (q, k, v):
            x = t.new_zeros((b * n, *t.shape[1:]))
            x = x.index_copy(0, index, t)
            padded.append(x.view(b, n, t.shape[1], cfg.head_dim).transpose(1, 2))
        out = torch.nn.functional.scaled_dot_product_attention(*padded, **masking, enable_gqa=True)
        return out.transpose(1, 2).reshape(b * n, cfg.heads, cfg.head_dim).index_select(0, index)

    return run


def _providers(cfg: BlockConfig, device: str) -> dict:
    from mmbalance.pyops.attention_backends import torch_flash_impl, torch_flash_unsupported_reasons
    from mmbalance.pyops.attention_ops import attention_block

    longest = cfg.seqlen
    window = {"window_left": cfg.window} if cfg.window >= 0 else {}

    def ours(backend):
        def run(q, k, v, cu):
            return attention_block(
                q, k, v, cu, cu, longest, longest, causal=cfg.causal, backend=backend, **window
            )[0]

        return run

    providers = {"mmbalance": ours("auto"), "torch_sdpa": _sdpa(cfg, device)}
    if device.startswith("cuda"):
        providers["mmbalance_triton"] = ours("triton")
        if not torch_flash_unsupported_reasons(_describe(cfg, device)):
            providers[f"mmbalance_torch_flash_{torch_flash_impl()}"] = ours("torch_flash")
        try:
            from flash_attn import flash_attn_varlen_func

            wsize = {"window_size": (cfg.window, 0 if cfg.causal else cfg.window)} if cfg.window >= 0 else {}

            def flash(q, k, v, cu):
                return flash_attn_varlen_func(q, k, v, cu, cu, longest, longest, causal=cfg.causal, **wsize)

            providers["flash_attn"] = flash
        except ImportError:
            pass
    return providers


def _describe(cfg: BlockConfig, device: str, backward: bool = False):
    from mmbalance.pyops.attention_backends import AttentionInputs

    tokens = sum(cfg.all_lengths)
    return AttentionInputs(q_shape=(tokens, cfg.heads, cfg.head_dim), k_shape=(tokens, cfg.kv_heads, cfg.head_dim),
                           dtype=cfg.dtype, device=torch.device(device), causal=cfg.causal,
                           window_left=cfg.window, backward=backward)  # fmt: skip


def _auto_backend(cfg: BlockConfig, device: str) -> str:
    """What ``backend="auto"`` runs for this configuration, forward / backward."""
    from mmbalance.pyops.attention_backends import select_attention_backend, torch_flash_impl

    names = []
    for backward in (False, True):
        try:
            name = select_attention_backend("auto", _describe(cfg, device, backward))
        except ValueError:
            name = "none"
        names.append(f"torch_flash({torch_flash_impl()})" if name == "torch_flash" else name)
    return " / ".join(names)


def _host_us(fn, cfg: BlockConfig, device: str) -> float:
    """Host time of one forward call on a tiny input (16 tokens) of this configuration's heads."""
    tiny = dataclasses.replace(cfg, n_seqs=1, seqlen=16)
    (q, k, v), cu = _inputs(tiny, device, requires_grad=False)
    with torch.no_grad():
        return host_us(lambda: fn(q, k, v, cu), device, calls=50 if device == "cpu" else 200)


def bench_blocks(full: bool, device: str, reps: int) -> list[Row]:
    rows = []
    dev_name = device_name(device)
    for cfg in block_configs(full, device):
        auto = _auto_backend(cfg, device)
        for name, fn in _providers(cfg, device).items():
            (q, k, v), cu = _inputs(cfg, device, requires_grad=True)
            grad = torch.randn_like(q)

            def fwd(fn=fn, q=q, k=k, v=v, cu=cu):
                with torch.no_grad():
                    return fn(q, k, v, cu)

            def fwd_bwd(fn=fn, q=q, k=k, v=v, cu=cu, grad=grad):
                out = fn(q, k, v, cu)
                torch.autograd.grad(out, (q, k, v), grad)

            extra: dict = {"backend": auto} if name == "mmbalance" else {}
            if name.startswith("mmbalance") and cfg.lengths is None and cfg.window < 0:
                extra["host_us"] = _host_us(fn, cfg, device)
            for op, call, flops in (
                ("attention_fwd", fwd, cfg.flops_fwd()),
                ("attention_fwd_bwd", fwd_bwd, 3.5 * cfg.flops_fwd()),
            ):
                ms = time_fn(call, device, warmup=1, reps=reps)
                rows.append(Row(op, name, cfg.name, str(cfg.dtype).replace("torch.", ""), dev_name, ms,
                                {"tflops": flops / ms / 1e9, **extra}))  # fmt: skip
    _relate(rows)
    return rows


def _relate(rows: list[Row]) -> None:
    """Ratios the acceptance reads, on the ``mmbalance`` rows: ``vs_sdpa`` (SDPA's time over ours,
    in the same run and shape) and, on a windowed row, ``vs_full_causal`` (ours at full causal
    attention of the same length over ours with the window)."""
    by = {(r.op, r.provider, r.shape): r for r in rows}
    for r in rows:
        if not r.provider.startswith("mmbalance"):
            continue
        sdpa = by.get((r.op, "torch_sdpa", r.shape))
        if sdpa is not None:
            r.metrics["vs_sdpa"] = sdpa.time_ms / r.time_ms
        if "-w" in r.shape:
            full = by.get((r.op, r.provider, r.shape.split("-w")[0]))
            if full is not None:
                r.metrics["vs_full_causal"] = full.time_ms / r.time_ms


# ---------------------------------------------------------------------------- long sequence, CPU
def _rss_kib(field: str) -> int:
    """``VmRSS``/``VmHWM`` of this process in KiB (Linux ``/proc/self/status``)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not found in /proc/self/status")


def _long_worker(provider: str, seqlen: int, heads: int, head_dim: int, timed: int) -> dict:
    """One variant in this (fresh) process: peak memory of the first forward + backward, then the
    median time of ``timed`` more."""
    from mmbalance.pyops.attention_ops import attention_block

    def inputs(length: int):
        g = torch.Generator().manual_seed(0)
        qkv = [torch.randn(length, heads, head_dim, generator=g).requires_grad_() for _ in range(3)]
        return (
            qkv,
            torch.randn(length, heads, head_dim, generator=g),
            torch.tensor([0, length], dtype=torch.int32),
        )

    def ours(q, k, v, cu):
        return attention_block(q, k, v, cu, cu, q.shape[0], q.shape[0], causal=True)[0]

    def sdpa(q, k, v, cu):
        qb, kb, vb = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
        out = torch.nn.functional.scaled_dot_product_attention(qb, kb, vb, is_causal=True)
        return out[0].transpose(0, 1)

    fn = ours if provider == "mmbalance" else sdpa
    # one tiny call first: one-time costs (lazy imports and registrations on the first call of an
    # op, about 85 MiB for a custom op) are not the call's memory
    (q, k, v), dout, cu = inputs(16)
    torch.autograd.grad(fn(q, k, v, cu), (q, k, v), dout)
    (q, k, v), dout, cu = inputs(seqlen)

    def step():
        torch.autograd.grad(fn(q, k, v, cu), (q, k, v), dout)

    try:  # reset the peak to the current resident size (Linux >= 4.0)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        resettable = True
    except OSError:
        resettable = False
    base = _rss_kib("VmRSS")
    step()
    peak = _rss_kib("VmHWM")
    times = []
    for _ in range(timed):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return {"time_ms": float(np.median(times)) * 1e3, "peak_mib": peak / 1024, "base_mib": base / 1024,
            "added_mib": (peak - base) / 1024, "peak_resettable": resettable}  # fmt: skip


def bench_long(seqlen: int, heads: int = 8, head_dim: int = 64, rounds: int = 3) -> list[Row]:
    """``attention_block`` vs SDPA on one long causal sequence on CPU: time and peak memory of
    forward + backward, each measurement in a fresh process (see the module docstring)."""
    providers = ("mmbalance", "torch_sdpa")
    results: dict[str, list[dict]] = {p: [] for p in providers}
    for _ in range(rounds):
        for provider in providers:
            cmd = [sys.executable, "-m", "mmbalance.bench.attention", "--long-worker", provider,
                   str(seqlen), str(heads), str(head_dim)]  # fmt: skip
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
            if done.returncode != 0:
                raise RuntimeError(f"long-sequence worker {provider} failed:\n{done.stderr[-3000:]}")
            results[provider].append(json.loads(done.stdout.strip().splitlines()[-1]))
    med = {p: {key: float(np.median([r[key] for r in rs])) for key in ("time_ms", "peak_mib", "added_mib", "base_mib")}
           for p, rs in results.items()}  # fmt: skip
    shape = f"B1xL{seqlen}xH{heads}/{heads}xD{head_dim}-causal"
    dev = device_name("cpu")
    rows = []
    for provider in providers:
        m = med[provider]
        metrics = {"peak_mib": m["peak_mib"], "added_mib": m["added_mib"], "base_mib": m["base_mib"],
                   "rounds": rounds, "threads": torch.get_num_threads()}  # fmt: skip
        if provider == "mmbalance":
            ref = med["torch_sdpa"]
            metrics["time_vs_sdpa"] = m["time_ms"] / ref["time_ms"]
            metrics["peak_vs_sdpa"] = m["peak_mib"] / ref["peak_mib"]
            # nan when SDPA added nothing measurable (tiny sizes: freed memory reused)
            metrics["added_vs_sdpa"] = m["added_mib"] / ref["added_mib"] if ref["added_mib"] > 0 else math.nan
        rows.append(Row("attention_long_fwd_bwd", provider, shape, "float32", dev, m["time_ms"], metrics))
    return rows


# ------------------------------------------------------------------------------------------ ring
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
    """One rank of the ring benchmark (run by :func:`~mmbalance.bench.harness.spawn`)."""
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


def main(argv=None) -> None:
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument(
        "--degree", type=int, default=None, help="CP degree of the ring (default 2 quick, 2 and 3 full)"
    )
    p.add_argument("--no-ring", action="store_true", help="skip the multi-process ring benchmark")
    p.add_argument("--no-long", action="store_true", help="skip the long-sequence CPU case")
    p.add_argument(
        "--long-seqlen", type=int, default=None, help="tokens of the long CPU case (8192; 2048 quick)"
    )
    p.add_argument("--long-rounds", type=int, default=3, help="fresh processes per variant of the long case")
    p.add_argument("--long-worker", nargs=4, metavar=("PROVIDER", "L", "H", "D"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.long_worker:
        provider, seqlen, heads, head_dim = args.long_worker
        print(json.dumps(_long_worker(provider, int(seqlen), int(heads), int(head_dim), timed=2)))
        return
    cpu = args.device == "cpu"
    reps = (3 if cpu else 20) if not args.full else (10 if cpu else 50)
    if cpu and not args.no_long:
        seqlen = args.long_seqlen or (2048 if args.quick else 8192)
        report(
            bench_long(seqlen, rounds=args.long_rounds),
            args.json,
            title="one long causal sequence on CPU, forward + backward: time and peak memory vs SDPA",
        )
    rows = bench_blocks(args.full, args.device, reps)
    report(rows, args.json, title="attention blocks (TFLOP/s)")
    degrees = [args.degree] if args.degree else ([2, 3] if args.full else [2])
    if not cpu and torch.cuda.device_count() < max(degrees) and not args.no_ring:
        # with fewer GPUs than ranks the ring's workers would run on gloo and the CPU, at these sizes
        # for far longer than the blocks
        print(f"ring skipped: {torch.cuda.device_count()} GPU(s) for a ring of {max(degrees)} ranks")
        args.no_ring = True
    if not args.no_ring:
        seqlen = (1024 if not args.full else 4096) if cpu else (32768 if not args.full else 131072)
        shape = (4, 2, 64) if cpu else (32, 8, 128)
        ring_rows = []
        for degree in degrees:
            ring_rows += bench_ring(RingConfig(seqlen, *shape, degree), reps=3 if cpu else 10)
        report(
            ring_rows,
            args.json,
            title="ring attention vs one rank (comm_hidden: fraction of communication overlapped)",
        )


if __name__ == "__main__":
    main()
