"""Attention blocks and ring attention: throughput and how much ring communication is hidden.

    python -m mmbalance.bench.attention [--full|--quick] [--json FILE] [--device cpu|cuda] [--degree N]
        [--no-ring] [--no-long] [--long-seqlen L]

The command runs three parts: one long sequence on CPU (``long.py``), the blocks (here) and the
ring (``ring.py``).

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
Rows are keyed and written by the shared harness (``bench/harness.py``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import numpy as np
import torch

from ..harness import Row, base_parser, device_name, draw_lengths, host_us, report, time_fn
from .batch import BlockConfig, sdpa_runner
from .long import bench_long, long_worker
from .ring import RingConfig, bench_ring


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
    base.append(BlockConfig(4, 8192, 32, 8, 128, True, dtype))
    ship = tuple(draw_lengths(16384, 4096, seed=0))  # the shipped mixture, as bench hf draws it
    base.append(BlockConfig(len(ship), max(ship), 16, 4, 128, True, dtype, lengths=ship))
    if full:
        base.append(BlockConfig(16, 1024, 32, 8, 64, True, dtype))
    return base


def _inputs(cfg: BlockConfig, device: str, requires_grad: bool):
    g = torch.Generator().manual_seed(0)
    tokens = sum(cfg.all_lengths)
    q = torch.randn(tokens, cfg.heads, cfg.head_dim, generator=g).to(device, cfg.dtype)
    k = torch.randn(tokens, cfg.kv_heads, cfg.head_dim, generator=g).to(device, cfg.dtype)
    v = torch.randn(tokens, cfg.kv_heads, cfg.head_dim, generator=g).to(device, cfg.dtype)
    cu = torch.tensor([0, *np.cumsum(cfg.all_lengths).tolist()], dtype=torch.int32, device=device)
    return [t.requires_grad_(requires_grad) for t in (q, k, v)], cu


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

    providers = {"mmbalance": ours("auto"), "torch_sdpa": sdpa_runner(cfg, device)}
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
        print(json.dumps(long_worker(provider, int(seqlen), int(heads), int(head_dim), timed=2)))
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
