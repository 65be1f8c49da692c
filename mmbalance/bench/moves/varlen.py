"""Bandwidth of the varlen ops (pack, unpack, segment_gather) against torch baselines and a copy.

    python -m mmbalance.bench.moves.varlen [--full] [--json FILE] [--device cpu|cuda] [--lengths lognormal]
                           [--plot FILE.png]

For every shape each op is timed with three kinds of provider:

- ``mmbalance``: ``mmbalance.pyops.<op>`` (the Triton kernel on CUDA, the reference on CPU);
- the obvious torch baseline: flash-attn ``bert_padding`` style (a mask, ``nonzero`` indices and
  ``index_select`` / ``index_put``) for pack and unpack, a Python loop of slices and ``torch.cat``
  and a per-token ``index_select`` for segment_gather;
- ``copy``: ``clone`` of a buffer with the same number of bytes read plus written, the achievable
  device bandwidth in the same run.

Reported per row: time, ``host_us`` (mmbalance rows: the host time of one eager call on a tiny
input, what a call costs the CPU), GB/s as (bytes read + bytes written) / time (CUDA only: on a CPU the working
sets fit in the last-level cache, so the figure would not be a memory bandwidth), and ``frac_of_copy``, the
copy's time over the provider's time (the DESIGN.md floor; the target on an H100 is >= 0.9 for the
mmbalance rows). Sequence lengths come from a named source (``LENGTH_SOURCES``); the default is a
synthetic lognormal until shipped real-data lengths replace it.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable

import numpy as np
import torch

from ..harness import Row, base_parser, device_name, host_us, report, time_fn

# ---------------------------------------------------------------------------------------------
# lengths sources: name -> f(n_seqs, mean_len, seed) -> int64 array of n_seqs lengths


def lognormal_lengths(n_seqs: int, mean_len: int, seed: int = 0) -> np.ndarray:
    """Lognormal lengths with mean about ``mean_len`` (sigma 0.8, long tail), clipped to [1, 8x mean]."""
    rng = np.random.default_rng(seed)
    sigma = 0.8
    raw = rng.lognormal(mean=np.log(mean_len) - sigma**2 / 2, sigma=sigma, size=n_seqs)
    return np.clip(np.rint(raw), 1, 8 * mean_len).astype(np.int64)


LENGTH_SOURCES: dict[str, Callable[[int, int, int], np.ndarray]] = {"lognormal": lognormal_lengths}


@dataclasses.dataclass(frozen=True)
class Config:
    n_seqs: int
    mean_len: int
    hidden: int
    dtype: torch.dtype = torch.bfloat16

    @property
    def name(self) -> str:
        return f"n{self.n_seqs}xL{self.mean_len}xH{self.hidden}"


def configs(full: bool, device: str) -> list[Config]:
    if not full:
        return [Config(16, 512, 1024), Config(16, 512, 4096)]
    scale = 4 if device.startswith("cuda") else 1
    out = []
    for hidden in (1024, 2048, 4096, 8192):
        for n_seqs, mean_len in ((16 * scale, 512), (4 * scale, 2048)):
            out.append(Config(n_seqs, mean_len, hidden))
    return out


# ---------------------------------------------------------------------------------------------
# torch baselines


def bert_padding_pack(padded: torch.Tensor, seqlens: torch.Tensor) -> torch.Tensor:
    """flash-attn ``unpad_input``: mask -> ``nonzero`` indices (a host sync) -> ``index_select``."""
    mask = torch.arange(padded.shape[1], device=padded.device)[None, :] < seqlens[:, None]
    indices = torch.nonzero(mask.flatten(), as_tuple=False).flatten()
    return padded.flatten(0, 1).index_select(0, indices)


def bert_padding_unpack(packed: torch.Tensor, seqlens: torch.Tensor, max_seqlen: int) -> torch.Tensor:
    """flash-attn ``pad_input``: ``nonzero`` indices -> zeros -> ``index_put``."""
    mask = torch.arange(max_seqlen, device=packed.device)[None, :] < seqlens[:, None]
    indices = torch.nonzero(mask.flatten(), as_tuple=False).flatten()
    out = packed.new_zeros((seqlens.shape[0] * max_seqlen, *packed.shape[1:]))
    out[indices] = packed
    return out.view(seqlens.shape[0], max_seqlen, *packed.shape[1:])


def cat_gather(packed: torch.Tensor, cu_host: list[int], order_host: list[int]) -> torch.Tensor:
    """The Python loop: one slice per segment, then ``torch.cat``."""
    return torch.cat([packed[cu_host[k] : cu_host[k + 1]] for k in order_host])


def index_select_gather(packed: torch.Tensor, cu: torch.Tensor, order: torch.Tensor, out_tokens: int):
    """Per-token source index built with ``repeat_interleave``, then one ``index_select``."""
    lengths = (cu[1:] - cu[:-1])[order]
    seg = torch.repeat_interleave(
        torch.arange(order.shape[0], device=cu.device), lengths, output_size=out_tokens
    )
    dst_start = torch.cumsum(lengths, 0) - lengths
    rows = cu[:-1][order][seg] + torch.arange(out_tokens, device=cu.device) - dst_start[seg]
    return packed.index_select(0, rows)


# ---------------------------------------------------------------------------------------------


def _rows_for(op, cfg, device, providers: dict[str, Callable], moved_bytes: int, copy_src, rows_out):
    copy_ms = time_fn(lambda: copy_src.clone(), device)
    dtype = str(cfg.dtype).replace("torch.", "")
    for provider, fn in [("copy", lambda: copy_src.clone()), *providers.items()]:
        ms = copy_ms if provider == "copy" else time_fn(fn, device)
        rows_out.append(
            Row(
                op=op,
                provider=provider,
                shape=cfg.name,
                dtype=dtype,
                device=device_name(device),
                time_ms=ms,
                metrics={
                    # a bandwidth only where it is one: on CPUs these working sets (tens of MB) sit
                    # in the last-level cache, and bytes over time would read as 60-130 GB/s
                    **({"GB/s": moved_bytes / ms / 1e6} if str(device).startswith("cuda") else {}),
                    "frac_of_copy": copy_ms / ms,
                    "MB": moved_bytes / 1e6,
                },
            )
        )


def run_config(cfg: Config, device: str, lengths_source: str, seed: int = 0) -> list[Row]:
    import mmbalance.pyops as P

    lengths = LENGTH_SOURCES[lengths_source](cfg.n_seqs, cfg.mean_len, seed)
    total, max_len = int(lengths.sum()), int(lengths.max())
    gen = torch.Generator().manual_seed(seed)
    seqlens = torch.from_numpy(lengths).to(device)
    cu = P.cu_seqlens_from_lengths(seqlens)
    cu_host = cu.tolist()
    esize = torch.empty((), dtype=cfg.dtype).element_size()
    packed = torch.randn(total, cfg.hidden, generator=gen).to(device=device, dtype=cfg.dtype)
    padded = P.unpack(packed, cu, max_len)
    order = torch.randperm(cfg.n_seqs, generator=gen).to(device)
    order_host = order.tolist()
    token_bytes = cfg.hidden * esize
    rows: list[Row] = []

    # pack reads and writes T rows; the padding is never touched
    pack_bytes = 2 * total * token_bytes
    _rows_for(
        "pack",
        cfg,
        device,
        {
            "mmbalance": lambda: P.pack(padded, seqlens, total),
            "bert_padding": lambda: bert_padding_pack(padded, seqlens),
        },
        pack_bytes,
        torch.empty(pack_bytes // 2, dtype=torch.uint8, device=device),
        rows,
    )
    # unpack reads T rows and writes B x max_len rows (data and padding)
    unpack_bytes = (total + cfg.n_seqs * max_len) * token_bytes
    _rows_for(
        "unpack",
        cfg,
        device,
        {
            "mmbalance": lambda: P.unpack(packed, cu, max_len),
            "bert_padding": lambda: bert_padding_unpack(packed, seqlens, max_len),
        },
        unpack_bytes,
        torch.empty(unpack_bytes // 2, dtype=torch.uint8, device=device),
        rows,
    )
    _rows_for(
        "segment_gather",
        cfg,
        device,
        {
            "mmbalance": lambda: P.segment_gather(packed, cu, order, total),
            "torch_cat": lambda: cat_gather(packed, cu_host, order_host),
            "index_select": lambda: index_select_gather(packed, cu, order, total),
        },
        pack_bytes,
        torch.empty(pack_bytes // 2, dtype=torch.uint8, device=device),
        rows,
    )
    host = host_times(cfg, device)
    for r in rows:
        if r.provider == "mmbalance":
            r.metrics["host_us"] = host[r.op]
    return rows


def host_times(cfg: Config, device: str) -> dict[str, float]:
    """Host time per eager call of each op on a tiny input (4 segments of a few tokens, hidden 64):
    on a GPU what a call costs the CPU (dispatch, checks, the launch), the kernel's own time being
    negligible there."""
    import mmbalance.pyops as P

    seqlens = torch.tensor([3, 8, 0, 5], device=device)
    cu = P.cu_seqlens_from_lengths(seqlens)
    packed = torch.randn(16, 64, device=device).to(cfg.dtype)
    padded = P.unpack(packed, cu, 8)
    order = torch.tensor([2, 0, 3, 1], device=device)
    return {
        "pack": host_us(lambda: P.pack(padded, seqlens, 16), device),
        "unpack": host_us(lambda: P.unpack(packed, cu, 8), device),
        "segment_gather": host_us(lambda: P.segment_gather(packed, cu, order, 16), device),
    }


def plot(rows: list[Row], path: str) -> None:
    """Bar chart of ``frac_of_copy`` per op and provider, one group per shape (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ops = sorted({r.op for r in rows})
    fig, axes = plt.subplots(1, len(ops), figsize=(5 * len(ops), 4), squeeze=False)
    for ax, op in zip(axes[0], ops):
        sub = [r for r in rows if r.op == op and r.provider != "copy"]
        shapes = sorted({r.shape for r in sub})
        providers = sorted({r.provider for r in sub})
        width = 0.8 / max(1, len(providers))
        for i, prov in enumerate(providers):
            vals = [
                next((r.metrics["frac_of_copy"] for r in sub if r.shape == s and r.provider == prov), 0)
                for s in shapes
            ]
            ax.bar(np.arange(len(shapes)) + i * width, vals, width, label=prov)
        ax.axhline(1.0, color="k", lw=0.8, ls="--")
        ax.set_xticks(np.arange(len(shapes)) + 0.4 - width / 2, shapes, rotation=20, fontsize=7)
        ax.set_title(op)
        ax.set_ylabel("fraction of copy bandwidth")
        ax.legend(fontsize=7)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--lengths", default="lognormal", choices=sorted(LENGTH_SOURCES))
    p.add_argument("--plot", metavar="FILE", help="also write a PNG bar chart of frac_of_copy")
    args = p.parse_args(argv)
    rows: list[Row] = []
    for cfg in configs(args.full, args.device):
        rows += run_config(cfg, args.device, args.lengths)
    path = (
        "Triton kernels"
        if args.device.startswith("cuda")
        else "CPU reference path; no GB/s: the working sets fit in the CPU's caches, so only times and "
        "the fraction of a same-size copy are shown"
    )
    report(
        rows, args.json, title=f"varlen ops on {device_name(args.device)} ({path}, lengths: {args.lengths})"
    )
    if args.plot:
        plot(rows, args.plot)


if __name__ == "__main__":
    main()
