"""Tile sweep of the Triton attention kernels: every candidate tiling per shape, audited, checked, timed.

    python -m mmbalance.bench.attention.tiles [--device cuda|cpu] [--shapes NAME ...] [--audit-only]
        [--arch sm_90] [--jobs N] [--warm-jobs N] [--budget-s S] [--limit N] [--json FILE]

The Triton kernels run whatever ``torch_flash`` cannot (softcap, sinks, position runs, LSE
gradients, float32, ring blocks that need them); their tiles come from one table
(``kernels/attention_common.py``: ``fwd_config``, ``bwd_config``). This command measures that table
against the alternatives on a GPU, per shape (``SHAPES``, in this order: head dim 128 on 8 x 2048
tokens causal and full, head dim 64 on 32 x 512 causal, then head dim 128 causal with a softcap of
50 and with sinks):

1. candidates: the table's choice first, then a grid of tiles, warps and pipeline depths for the
   forward kernel, the dq pass and the dk/dv pass (``fwd_candidates``, ``bwd_candidates``). The
   passes are separate kernels, so each is swept with the other at the table's choice;
2. audit: each candidate compiled for ``--arch`` (the device's own on a GPU) by the kernel audit in
   ``--jobs`` processes; one that spills, or runs 16-bit inputs without tensor-core instructions, is
   dropped (status ``audit: ...``). The table's choice is kept whatever its audit says;
3. check (outputs poisoned with NaN first): each survivor runs once and is compared with the torch
   reference (``pyops/attention_ref.py``, float32, from the same inputs): an error relative to the
   largest reference value over twice the table's plus one unit of the input's precision, or over
   ``TABLE_TOLERANCE``, is dropped (``accepted``); then row by row with the table's own result
   (``row_error``: each row against its own size, so an error confined to a few rows is not
   diluted), over ``CONSISTENCY_TOLERANCE`` is dropped (status ``check: ...``);
4. time: the median of ``triton.testing.do_bench``; each pass's table and three fastest are timed
   twice more, interleaved, and keep the median of their three times (``retimed``). Rows
   ``tiles_fwd``, ``tiles_bwd_dq`` and ``tiles_bwd_kv`` (provider ``table`` or ``candidate``) carry
   TFLOP/s (FLOPs as ``bench attention`` counts them: ``4 * pairs * H * D`` forward, 2.5x that
   backward; a backward row times the whole backward, the preprocess and both passes, with its
   pass's candidate), the tiles, registers and ``vs_table`` (the table's time over this one's). Then
   per shape the fastest of each pass together, ``tiles_fwd_bwd`` with provider ``best``, beside
   the table's choice (``table``) and SDPA's forward + backward (``torch_sdpa``, on the shapes it
   can run): ``vs_sdpa``, and on the softcap and sinks shapes ``vs_plain`` (the plain causal
   shape's time over this one's, provider by provider).

On CUDA, before a shape is timed, ``--warm-jobs`` spawned processes (default up to 8) launch each
surviving candidate once on the same inputs, the tables first, so Triton's compiles run in parallel
and the timing process finds them in its cache; a candidate that fails there fails, and a worker
left unusable by a device error exits (its pool is rebuilt once). ``--budget-s`` bounds the run: no
candidate starts after it (status ``budget``; the tables still run) and no shape starts after it
(named at the end); rows are appended to ``--json`` shape by shape, so a run cut short keeps what
it measured. The summary at the end prints each shape's winners as table entries.

``--audit-only`` needs no GPU: steps 1 and 2 for ``--arch``. ``--device cpu`` runs the same steps
1, 3 and 4 under Triton's interpreter (set here when it is not) on the small ``smoke-*`` shapes in
float32, with the interpreter's tiles; its times are the interpreter's, not a GPU's.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import math
import os
import sys
import time
import traceback
from typing import Any

import torch

from ..harness import Row, device_name, module_prog, report, time_fn

__all__ = [
    "SHAPES",
    "TileShape",
    "bwd_candidates",
    "distinct_tiles",
    "fwd_candidates",
    "main",
    "sweep_shape",
]

FWD_KEYS = ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages")
PASS_KEYS = {
    "dq": ("dq_BLOCK_M", "dq_BLOCK_N", "dq_warps", "dq_stages"),
    "kv": ("kv_BLOCK_M", "kv_BLOCK_N", "kv_warps", "kv_stages"),
}


@dataclasses.dataclass(frozen=True)
class TileShape:
    name: str
    n_seqs: int
    seqlen: int
    heads: int
    kv_heads: int
    head_dim: int
    causal: bool
    softcap: float = 0.0
    sinks: bool = False
    lengths: tuple[int, ...] | None = None  # uneven lengths (seqlen: the longest)
    plain: str | None = None  # the same shape without softcap and sinks (``vs_plain``)

    @property
    def all_lengths(self) -> list[int]:
        return list(self.lengths) if self.lengths else [self.seqlen] * self.n_seqs

    @property
    def features(self) -> dict[str, bool]:
        """The kernels' feature switches for this shape (the audit's ``features``)."""
        return dict(CAUSAL=self.causal, SOFTCAP=self.softcap > 0, SINKS=self.sinks)

    def flops_fwd(self) -> float:
        from .blocks import BlockConfig

        cfg = BlockConfig(len(self.all_lengths), self.seqlen, self.heads, self.kv_heads, self.head_dim,
                          self.causal, torch.float32, lengths=self.lengths)  # fmt: skip
        return cfg.flops_fwd()


# in the order they run: the plain causal shape first (vs_plain needs it), the features last
_GPU = (
    TileShape("d128-causal", 8, 2048, 16, 4, 128, True),
    TileShape("d128-full", 8, 2048, 16, 4, 128, False),
    TileShape("d64-causal-short", 32, 512, 16, 4, 64, True),
    TileShape("d128-causal-softcap", 8, 2048, 16, 4, 128, True, softcap=50.0, plain="d128-causal"),
    TileShape("d128-causal-sinks", 8, 2048, 16, 4, 128, True, sinks=True, plain="d128-causal"),
)
# under the interpreter: lengths that cross every candidate tile, an empty sequence, GQA
_SMOKE_LENGTHS = (200, 0, 131, 67)
_SMOKE = (
    TileShape("smoke-full", 4, 200, 2, 1, 32, False, lengths=_SMOKE_LENGTHS),
    TileShape("smoke-causal", 4, 200, 2, 1, 32, True, lengths=_SMOKE_LENGTHS),
    TileShape(
        "smoke-causal-softcap",
        4,
        200,
        2,
        1,
        32,
        True,
        softcap=5.0,
        lengths=_SMOKE_LENGTHS,
        plain="smoke-causal",
    ),  # fmt: skip
    TileShape(
        "smoke-causal-sinks", 4, 200, 2, 1, 32, True, sinks=True, lengths=_SMOKE_LENGTHS, plain="smoke-causal"
    ),  # fmt: skip
)
SHAPES: dict[str, TileShape] = {s.name: s for s in (*_GPU, *_SMOKE)}


# ------------------------------------------------------------------------------------ candidates
def _grid(keys: tuple[str, ...], *values) -> list[dict]:
    return [dict(zip(keys, combo)) for combo in itertools.product(*values)]


def _table_first(table: dict, grid: list[dict], keys: tuple[str, ...]) -> list[dict]:
    """The table's choice, then the grid's other entries in order (each once)."""
    own = {k: table[k] for k in keys}
    return [own] + [c for c in grid if c != own]


def fwd_candidates(
    head_dim: int, dtype: torch.dtype, capability: int, *, softcap: bool = False, interpret: bool = False
) -> list[dict]:
    """Forward launches to try (``BLOCK_M``, ``BLOCK_N``, ``num_warps``, ``num_stages``), the
    table's choice for ``sm_<capability>`` first. ``interpret``: the interpreter's (tile shapes
    only: warps and stages mean nothing there)."""
    from mmbalance.kernels.attention_common import fwd_config

    if interpret:  # the table's choice there: fwd_config without a capability off CUDA
        table = fwd_config(head_dim, torch.device("cpu"), dtype)
        return _table_first(table, _grid(FWD_KEYS, (16, 64, 128), (16, 32, 128), (4,), (1,)), FWD_KEYS)
    table = fwd_config(head_dim, torch.device("cuda"), dtype, capability=capability, softcap=softcap)
    if dtype == torch.float32:  # IEEE FMA products on 4-byte tiles
        grid = _grid(FWD_KEYS, (16, 32, 64), (16, 32), (4, 8), (1,))
    else:
        grid = _grid(FWD_KEYS, (64, 128), (32, 64, 128), (4, 8), (2, 3))
    return _table_first(table, grid, FWD_KEYS)


def bwd_candidates(
    head_dim: int, dtype: torch.dtype, capability: int, *, softcap: bool = False, interpret: bool = False
) -> dict[str, list[dict]]:
    """Backward launches to try per pass, ``{"dq": [...], "kv": [...]}`` with each pass's four
    ``bwd_config`` keys, the table's choice first (see :func:`fwd_candidates`)."""
    from mmbalance.kernels.attention_common import bwd_config

    if interpret:
        table = bwd_config(head_dim, torch.device("cpu"), dtype)
        grids = {
            "dq": _grid(PASS_KEYS["dq"], (16, 64, 128), (16, 32, 64), (4,), (1,)),
            "kv": _grid(PASS_KEYS["kv"], (16, 32, 64), (16, 64, 128), (4,), (1,)),
        }
    else:
        table = bwd_config(head_dim, torch.device("cuda"), dtype, capability=capability, softcap=softcap)
        if dtype == torch.float32:
            grids = {
                "dq": _grid(PASS_KEYS["dq"], (16, 32), (16, 32), (4, 8), (1,)),
                "kv": _grid(PASS_KEYS["kv"], (16, 32), (16, 32), (4, 8), (1,)),
            }
        else:
            grids = {
                "dq": _grid(PASS_KEYS["dq"], (64, 128), (32, 64), (4, 8), (1, 2)),
                "kv": _grid(PASS_KEYS["kv"], (32, 64), (64, 128), (4, 8), (1, 2)),
            }
    return {p: _table_first(table, grids[p], PASS_KEYS[p]) for p in PASS_KEYS}


def distinct_tiles(
    capability: int = 90, dtype: torch.dtype = torch.bfloat16
) -> dict[str, list[tuple[int, int]]]:
    """The distinct ``(BLOCK_M, BLOCK_N)`` of every pass over the GPU shapes' candidates: what the
    interpreter must check against the reference (warps and stages do not change the results)."""
    tiles: dict[str, set[tuple[int, int]]] = {"fwd": set(), "dq": set(), "kv": set()}
    for shape in _GPU:
        soft = shape.softcap > 0
        for c in fwd_candidates(shape.head_dim, dtype, capability, softcap=soft):
            tiles["fwd"].add((c["BLOCK_M"], c["BLOCK_N"]))
        for p, cands in bwd_candidates(shape.head_dim, dtype, capability, softcap=soft).items():
            for c in cands:
                tiles[p].add((c[f"{p}_BLOCK_M"], c[f"{p}_BLOCK_N"]))
    return {p: sorted(t) for p, t in tiles.items()}


def _label(cfg: dict, keys: tuple[str, ...]) -> str:
    m, n, w, s = (cfg[k] for k in keys)
    return f"M{m} N{n} w{w} s{s}"


# ------------------------------------------------------------------------------------ audit
def _audit(shape: TileShape, dtype: torch.dtype, capability: int, cands: dict, jobs: int) -> dict:
    """``{(pass, label): audit row}`` for every candidate; ``{}`` where the audit cannot run (no
    ptxas): then nothing is dropped for it, and the rows say ``unaudited``."""
    from mmbalance.bench import kernel_audit

    if kernel_audit.ptxas_path(capability) is None:
        return {}
    _, ptxas_arch = kernel_audit.parse_arch(f"sm_{capability}")
    group = shape.heads // shape.kv_heads
    entries, keys = [], []
    for pass_, cfg in _each(cands):
        label = _label(cfg, FWD_KEYS if pass_ == "fwd" else PASS_KEYS[pass_])
        entries.append(kernel_audit.attention_entry(pass_, f"{shape.name}:{pass_}:{label}", dtype, shape.head_dim,
                                                    shape.features, cfg, group=group, has_runs=False))  # fmt: skip
        keys.append((pass_, label))
    rows = kernel_audit.audit_all(entries, capability, ptxas_arch, jobs=jobs)
    return dict(zip(keys, rows))


def _each(cands: dict):
    for c in cands["fwd"]:
        yield "fwd", c
    for p in PASS_KEYS:
        for c in cands[p]:
            yield p, c


def _audit_status(row: dict | None) -> str:
    if row is None:
        return "unaudited"
    if "error" in row:
        return f"audit: {row['error'][:120]}"
    return "ok" if not row["failures"] else "audit: " + "; ".join(row["failures"])


# ------------------------------------------------------------------------------------ inputs and runs
@dataclasses.dataclass
class _Case:
    """One shape's inputs, outputs and reference on a device."""

    shape: TileShape
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    cu: torch.Tensor
    dout: torch.Tensor
    sinks: torch.Tensor | None
    scale: float
    longest: int
    out: torch.Tensor
    lse: torch.Tensor
    grads: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    ref: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)

    def fwd(self, cfg: dict, out=None, lse=None):
        from mmbalance.kernels.attention_fwd import attn_fwd

        return attn_fwd(self.q, self.k, self.v, self.cu, self.cu, self.longest, self.scale, self.shape.causal,
                        out=self.out if out is None else out, lse=self.lse if lse is None else lse,
                        config=cfg, softcap=self.shape.softcap, sinks=self.sinks)  # fmt: skip

    def bwd(self, cfg: dict, out: torch.Tensor, lse: torch.Tensor):
        from mmbalance.kernels.attention_bwd import attn_bwd

        return attn_bwd(self.dout, self.q, self.k, self.v, out, lse, self.cu, self.cu, self.longest,
                        self.longest, self.scale, self.shape.causal, grads=self.grads, config=cfg,
                        softcap=self.shape.softcap)  # fmt: skip


def _case(shape: TileShape, device: str, dtype: torch.dtype, with_reference: bool = True) -> _Case:
    g = torch.Generator().manual_seed(0)
    lengths = shape.all_lengths
    tokens = sum(lengths)
    q, k, v = (torch.randn(tokens, h, shape.head_dim, generator=g).to(device, dtype)
               for h in (shape.heads, shape.kv_heads, shape.kv_heads))  # fmt: skip
    dout = torch.randn(tokens, shape.heads, shape.head_dim, generator=g).to(device, dtype)
    sinks = (torch.randn(shape.heads, generator=g) * 2).to(device) if shape.sinks else None
    cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=device)
    out = torch.empty_like(q)
    lse = torch.empty((shape.heads, tokens), dtype=torch.float32, device=device)
    grads = tuple(torch.empty(t.shape, dtype=torch.float32, device=device) for t in (q, k, v))
    case = _Case(shape, q, k, v, cu, dout, sinks, 1.0 / math.sqrt(shape.head_dim), max(lengths), out, lse,
                 grads)  # type: ignore[arg-type]  # fmt: skip
    if with_reference:
        from mmbalance.pyops.attention_ref import attention_block_bwd_ref, attention_block_fwd_ref

        q32, k32, v32, do32 = (t.float() for t in (q, k, v, dout))
        ref_out, ref_lse = attention_block_fwd_ref(q32, k32, v32, cu, cu, case.scale, shape.causal,
                                                   softcap=shape.softcap, sinks=sinks)  # fmt: skip
        dq, dk, dv = attention_block_bwd_ref(do32, q32, k32, v32, ref_out, ref_lse, cu, cu, case.scale,
                                             shape.causal, softcap=shape.softcap)  # fmt: skip
        case.ref = dict(out=ref_out, lse=ref_lse, dq=dq, dk=dk, dv=dv)
    return case


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest absolute error over the largest reference value (NaN for a non-finite result)."""
    if got.numel() == 0:
        return 0.0
    diff = (got.float() - want.float()).abs().max().item()
    return diff / max(want.abs().max().item(), 1e-30) if math.isfinite(diff) else math.nan


def _errors(case: _Case, pass_: str) -> float:
    """The pass's error against the reference: the forward's output, the dq pass's dq, the dk/dv
    pass's worse of dk and dv."""
    if pass_ == "fwd":
        return _rel_err(case.out, case.ref["out"])
    if pass_ == "dq":
        return _rel_err(case.grads[0], case.ref["dq"])
    return max(_rel_err(case.grads[1], case.ref["dk"]), _rel_err(case.grads[2], case.ref["dv"]))


def _outputs(case: _Case, pass_: str) -> list[torch.Tensor]:
    """What the pass writes: the forward's output and LSE, dq, or dk and dv."""
    return {"fwd": [case.out, case.lse], "dq": [case.grads[0]], "kv": [case.grads[1], case.grads[2]]}[pass_]


def row_error(got: torch.Tensor, want: torch.Tensor, floor: float = 1e-2) -> float:
    """The largest error of any row (a head's vector of one token; each LSE value alone) over that
    row's own largest value, or over ``floor`` times the largest of all where the row is smaller:
    an error confined to a few rows (a tile that skipped keys for the last queries) shows at its
    size, not diluted by the largest rows. Equal values (infinities too) differ by 0; NaN where
    ``got`` is not finite where ``want`` is."""
    if got.numel() == 0:
        return 0.0
    g = got.detach().double().reshape(-1, got.shape[-1] if got.dim() == 3 else 1)
    w = want.detach().double().reshape(g.shape)
    diff = torch.where(g == w, torch.zeros_like(g), (g - w).abs()).amax(1)
    finite = w[torch.isfinite(w)].abs()
    scale = (
        w.abs()
        .nan_to_num(0.0, 0.0, 0.0)
        .amax(1)
        .clamp_min(floor * (float(finite.max()) if finite.numel() else 1.0))
    )
    err = float((diff / scale.clamp_min(1e-30)).max())
    return err if math.isfinite(err) else math.nan


# the table's own error against the reference must stay under this (relative to the largest
# reference value); a candidate's under twice the table's plus one unit of precision, and never over this
TABLE_TOLERANCE = {torch.float32: 1e-4, torch.float16: 0.02, torch.bfloat16: 0.05}
# a candidate against the table's own result, row by row: the same products, summed in another
# order (16-bit outputs may round one unit apart)
CONSISTENCY_TOLERANCE = {
    torch.float32: 1e-4,
    torch.float16: 2 * torch.finfo(torch.float16).eps,
    torch.bfloat16: 2 * torch.finfo(torch.bfloat16).eps,
}


def accepted(err: float, table_err: float, dtype: torch.dtype) -> bool:
    """A candidate's error against the reference (relative to the largest reference value) is
    accepted within twice the table's plus one unit of ``dtype``'s precision, and never over
    ``TABLE_TOLERANCE``; a table error that is NaN or itself over the tolerance counts as half the
    tolerance. NaN is never accepted."""
    tol = TABLE_TOLERANCE[dtype]
    base = table_err if math.isfinite(table_err) and table_err <= tol else tol / 2
    return math.isfinite(err) and err <= min(2.0 * base + torch.finfo(dtype).eps, tol)


# ------------------------------------------------------------------------------------ warm-up
_WARM: dict[str, Any] = {}
_DEAD_WORKER = 70  # a worker's exit status after a sticky device error


def _warm_one(job: tuple[str, str, str, str, dict]) -> str | None:
    """In a worker: launch one candidate once on its shape's inputs (compiling it into Triton's
    cache); the error in words, or None. After an error that leaves the device unusable (an
    illegal address) the worker exits: a process in that state can launch nothing more."""
    shape_name, dtype_name, device, pass_, cfg = job
    try:
        key = f"{shape_name}:{dtype_name}:{device}"
        if key not in _WARM:
            _WARM.clear()
            case = _case(SHAPES[shape_name], device, getattr(torch, dtype_name), with_reference=False)
            _WARM[key] = (case, case.fwd(_table_cfg(case, "fwd")))
        case, (out, lse) = _WARM[key]
        if pass_ == "fwd":
            case.fwd(cfg, out=torch.empty_like(out), lse=torch.empty_like(lse))
        else:
            case.bwd(cfg, out, lse)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        return None
    except Exception as e:  # noqa: BLE001 - reported as the candidate's row
        if device.startswith("cuda"):
            try:
                torch.cuda.synchronize()
            except Exception:  # noqa: BLE001 - sticky: this process is done
                os._exit(_DEAD_WORKER)
        return f"{type(e).__name__}: {e}"[:200]


class _Warmer:
    """Processes (spawned: each with a device context of its own) that launch candidates once, so
    their compiles run in parallel and the timing process finds them in Triton's cache."""

    def __init__(self, workers: int, fn=None):
        self.workers = workers
        self.fn = fn or _warm_one  # what a worker runs per job (a module-level function)
        self.pool: Any = None

    def close(self) -> None:
        if self.pool is not None:
            procs = list((getattr(self.pool, "_processes", None) or {}).values())
            self.pool.shutdown(wait=False, cancel_futures=True)
            for proc in procs:
                proc.kill()  # a compile in flight is not waited for
            self.pool = None

    def run(self, jobs: list[tuple], deadline: float) -> dict[int, str]:
        """Each job once; ``{index: error}`` of those that failed. Jobs left when ``deadline``
        passes are neither warmed nor failed (the timing process compiles what it still runs). A
        worker that dies (a sticky device error) breaks the pool: it is rebuilt once for the jobs
        left; if it breaks again, those jobs fail (one of them kills its process)."""
        from concurrent.futures import TimeoutError as FutureTimeout
        from concurrent.futures import as_completed
        from concurrent.futures.process import BrokenProcessPool

        errors: dict[int, str] = {}
        pending = set(range(len(jobs)))
        for _attempt in range(2):
            if not pending:
                break
            if self.pool is None:
                import concurrent.futures
                import multiprocessing

                self.pool = concurrent.futures.ProcessPoolExecutor(
                    self.workers, mp_context=multiprocessing.get_context("spawn")
                )
            futures = {self.pool.submit(self.fn, jobs[i]): i for i in sorted(pending)}
            try:
                for fut in as_completed(futures, timeout=max(0.0, deadline - time.monotonic())):
                    err = fut.result()
                    pending.discard(futures[fut])
                    if err:
                        errors[futures[fut]] = err
                return errors
            except FutureTimeout:
                for fut in futures:
                    fut.cancel()
                return errors
            except BrokenProcessPool:
                for fut, i in futures.items():  # what finished before the break
                    if fut.done() and not fut.cancelled() and fut.exception() is None:
                        pending.discard(i)
                        if fut.result():
                            errors[i] = fut.result()
                self.close()
        for i in pending:
            errors[i] = "a warm-up process died twice on this shape's remaining candidates"
        return errors


# ------------------------------------------------------------------------------------ the sweep
def _table_cfg(case: _Case, pass_: str) -> dict:
    """The launch configuration the table gives this case's pass (the whole ``bwd_config`` dict
    for either backward pass)."""
    from mmbalance.kernels.attention_common import bwd_config, fwd_config

    s = case.shape
    pick = fwd_config if pass_ == "fwd" else bwd_config
    return pick(s.head_dim, case.q.device, case.q.dtype, softcap=s.softcap > 0)


def _time(fn, device: str) -> float:
    """Median ms: ``do_bench`` on CUDA; one call on CPU (the interpreter: the code path, not speed)."""
    if device.startswith("cuda"):
        return time_fn(fn, device)
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def sweep_shape(
    shape: TileShape,
    device: str,
    dtype: torch.dtype,
    cands: dict,
    audit_rows: dict,
    *,
    deadline: float,
    warmer: _Warmer | None = None,
    dev_name: str = "",
) -> tuple[list[Row], dict]:
    """Check and time every candidate of one shape; the rows and the winners (``{"fwd": tiles,
    "dq": tiles, "kv": tiles, "fwd_bwd_ms": ms}``, the fastest accepted of each pass)."""
    case = _case(shape, device, dtype)
    dname = str(dtype).replace("torch.", "")
    flops = {"fwd": shape.flops_fwd(), "dq": 2.5 * shape.flops_fwd(), "kv": 2.5 * shape.flops_fwd()}
    tables = {"fwd": _table_cfg(case, "fwd"), "bwd": _table_cfg(case, "bwd")}
    # the table's forward output feeds every backward candidate (the reference's, should it fail)
    try:
        out_t, lse_t = case.fwd(tables["fwd"], out=torch.empty_like(case.out), lse=torch.empty_like(case.lse))
    except Exception:  # noqa: BLE001 - the table's own row says why
        out_t, lse_t = case.ref["out"].to(dtype), case.ref["lse"].float()
    launches = []  # (pass, candidate, launch configuration, audit status); the tables first in each pass
    rows: list[Row] = []
    for pass_, cand in _each(cands):
        keys = FWD_KEYS if pass_ == "fwd" else PASS_KEYS[pass_]
        status = _audit_status(audit_rows.get((pass_, _label(cand, keys)))) if audit_rows else "unaudited"
        if status.startswith("audit") and cand is not cands[pass_][0]:  # the table runs regardless
            rows.append(_row(pass_, cand, shape, dname, dev_name, math.nan, status, audit_rows, flops))
            continue
        table = tables["fwd" if pass_ == "fwd" else "bwd"]
        # the table's configuration (its overflow tail included) with the candidate's entries
        launches.append((pass_, cand, dict(table, **cand), status))
    warm_errors: dict[int, str] = {}
    if warmer is not None:
        jobs = [(shape.name, dname, device, p, cfg) for p, _, cfg, _ in launches]
        # the tables first (each backward job runs both passes and the preprocess, so the other
        # pass's table kernels are compiled once, not by every worker at the same time)
        first = [i for i, (p, cand, _, _) in enumerate(launches) if cand is cands[p][0]]
        rest = [i for i in range(len(launches)) if i not in first]
        for batch in (first, rest):
            errors = warmer.run([jobs[i] for i in batch], deadline)
            warm_errors.update({batch[j]: e for j, e in errors.items()})
    table_err: dict[str, float] = {}
    table_out: dict[str, list[torch.Tensor]] = {}
    timed: dict[str, list[tuple[Row, Any, dict]]] = {}  # per pass: (row, its timing callable, candidate)
    for i, (pass_, cand, cfg, audit_status) in enumerate(launches):
        is_table = cand is cands[pass_][0]  # each pass lists the table's choice first
        provider = "table" if is_table else "candidate"

        def say(status: str, err: float = math.nan, pass_=pass_, cand=cand, provider=provider) -> None:
            rows.append(_row(pass_, cand, shape, dname, dev_name, math.nan, status, audit_rows, flops, err=err,
                             provider=provider))  # fmt: skip

        if time.monotonic() > deadline and not is_table:
            say("budget")
            continue
        if i in warm_errors and not is_table:  # the table still runs here: its row says how
            say(f"launch: {warm_errors[i]}")
            continue
        if pass_ == "fwd":
            run = lambda cfg=cfg: case.fwd(cfg)  # noqa: E731
        else:
            run = lambda cfg=cfg: case.bwd(cfg, out_t, lse_t)  # noqa: E731
        try:
            for t in _outputs(case, "fwd") + list(case.grads):
                t.fill_(math.nan)
            t0 = time.perf_counter()
            run()
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            once_ms = (time.perf_counter() - t0) * 1e3
        except Exception as e:  # noqa: BLE001 - a candidate that does not launch is a row
            say(f"launch: {type(e).__name__}: {e}"[:200])
            continue
        err = _errors(case, pass_)
        if is_table:
            table_err[pass_] = err
            table_out[pass_] = [t.clone() for t in _outputs(case, pass_)]
            if not err <= TABLE_TOLERANCE[dtype]:  # reported, and still timed: the figures are the table's
                audit_status = f"check: the table's own error {err:.3g} > {TABLE_TOLERANCE[dtype]:g}"
        else:
            if not accepted(err, table_err.get(pass_, math.nan), dtype):
                say(
                    f"check: error {err:.3g} against the reference, the table's {table_err.get(pass_, math.nan):.3g}",
                    err,
                )
                continue
            if pass_ in table_out:
                off = max(row_error(got, want) for got, want in zip(_outputs(case, pass_), table_out[pass_]))
                if not off <= CONSISTENCY_TOLERANCE[dtype]:
                    say(f"check: a row {off:.3g} off the table's result", err)
                    continue
        ms = _time(run, device) if device.startswith("cuda") else once_ms  # the interpreter: run once
        status = "ok" if audit_status == "ok" else audit_status
        row = _row(
            pass_, cand, shape, dname, dev_name, ms, status, audit_rows, flops, err=err, provider=provider
        )
        rows.append(row)
        timed.setdefault(pass_, []).append((row, run, cand))
    if device.startswith("cuda"):
        _retime(timed, device, flops)
    winners: dict[str, Any] = {}
    for pass_, entries in timed.items():
        table_ms = next((r.time_ms for r, _, _ in entries if r.provider == "table"), math.nan)
        for r, _, _ in entries:
            r.metrics["vs_table"] = table_ms / r.time_ms
        winners[pass_] = min(entries, key=lambda e: e[0].time_ms)[2]
    try:
        together = _together(case, shape, device, dname, dev_name, tables, winners)
    except Exception as e:  # noqa: BLE001 - the candidates' rows are kept
        together = [Row("tiles_fwd_bwd", "best", shape.name, dname, dev_name, math.nan,
                        {"status": f"failed: {type(e).__name__}: {e}"[:200]})]  # fmt: skip
    rows += together
    for r in together:
        if r.provider == "best" and math.isfinite(r.time_ms):
            winners["fwd_bwd_ms"] = r.time_ms
    return rows, winners


def _retime(timed: dict, device: str, flops: dict) -> None:
    """Each pass's table and its three fastest candidates timed twice more, interleaved, and each
    row's time made the median of its three: a clock that drifted over the sweep (the table is
    timed first) does not pick the winner."""
    for pass_, entries in timed.items():
        table = [e for e in entries if e[0].provider == "table"]
        fastest = sorted((e for e in entries if e[0].provider != "table"), key=lambda e: e[0].time_ms)[:3]
        chosen = table + fastest
        if len(chosen) < 2:
            continue
        times: dict[int, list[float]] = {id(e[0]): [e[0].time_ms] for e in chosen}
        for _ in range(2):
            for row, run, _ in chosen:
                times[id(row)].append(_time(run, device))
        for row, _, _ in chosen:
            row.time_ms = sorted(times[id(row)])[1]
            row.metrics["tflops"] = flops[pass_] / row.time_ms / 1e9
            row.metrics["retimed"] = True


def _row(
    pass_, cand, shape, dname, dev_name, ms, status, audit_rows, flops, err=math.nan, provider="candidate"
):
    keys = FWD_KEYS if pass_ == "fwd" else PASS_KEYS[pass_]
    label = _label(cand, keys)
    audit = (audit_rows or {}).get((pass_, label)) or {}
    metrics: dict[str, Any] = {"tiles": label, "status": status}
    if math.isfinite(ms):
        metrics["tflops"] = flops[pass_] / ms / 1e9
    if math.isfinite(err):
        metrics["rel_err"] = err
    for key in ("registers", "spill_bytes", "shared_bytes", "tensor_cores"):
        if key in audit:
            metrics[key] = audit[key]
    op = "tiles_fwd" if pass_ == "fwd" else f"tiles_bwd_{pass_}"
    return Row(op, provider, shape.name, dname, dev_name, ms, metrics)


def _together(case: _Case, shape: TileShape, device: str, dname: str, dev_name: str, tables: dict,
              winners: dict) -> list[Row]:  # fmt: skip
    """Forward + backward with the table's tiles, with each pass's fastest, and SDPA's."""
    from .blocks import BlockConfig, sdpa_runner

    flops = 3.5 * shape.flops_fwd()
    rows = []
    best_fwd = dict(tables["fwd"], **winners.get("fwd", {}))
    best_bwd = dict(tables["bwd"], **winners.get("dq", {}), **winners.get("kv", {}))
    for provider, f_cfg, b_cfg in (("table", tables["fwd"], tables["bwd"]), ("best", best_fwd, best_bwd)):

        def step(f_cfg=f_cfg, b_cfg=b_cfg):
            out, lse = case.fwd(f_cfg)
            case.bwd(b_cfg, out, lse)

        ms, metrics = _time_or_say(step, device, flops)
        if provider == "best":
            metrics["tiles"] = " | ".join(
                f"{p} {_label(c, FWD_KEYS if p == 'fwd' else PASS_KEYS[p])}" for p, c in winners.items()
            )
        rows.append(Row("tiles_fwd_bwd", provider, shape.name, dname, dev_name, ms, metrics))
    if shape.softcap == 0 and not shape.sinks:
        block = BlockConfig(len(shape.all_lengths), shape.seqlen, shape.heads, shape.kv_heads, shape.head_dim,
                            shape.causal, case.q.dtype, lengths=shape.lengths)  # fmt: skip
        sdpa = sdpa_runner(block, device)
        q, k, v = (t.detach().clone().requires_grad_() for t in (case.q, case.k, case.v))

        def sdpa_step():
            out = sdpa(q, k, v, case.cu)
            torch.autograd.grad(out, (q, k, v), case.dout)

        ms, metrics = _time_or_say(sdpa_step, device, flops)
        rows.append(Row("tiles_fwd_bwd", "torch_sdpa", shape.name, dname, dev_name, ms, metrics))
        for r in rows[:-1]:
            r.metrics["vs_sdpa"] = ms / r.time_ms
    return rows


def _time_or_say(fn, device: str, flops: float) -> tuple[float, dict[str, Any]]:
    """``fn``'s time and TFLOP/s, or NaN and the error in words (the row is kept either way)."""
    try:
        ms = _time(fn, device)
    except Exception as e:  # noqa: BLE001 - a step that fails is a row saying so
        return math.nan, {"status": f"failed: {type(e).__name__}: {e}"[:200]}
    return ms, {"tflops": flops / ms / 1e9}


def _relate_plain(rows: list[Row]) -> None:
    """``vs_plain`` on the softcap and sinks shapes' ``tiles_fwd_bwd`` rows."""
    by = {(r.provider, r.shape): r for r in rows if r.op == "tiles_fwd_bwd"}
    for (provider, name), r in by.items():
        plain = SHAPES[name].plain
        if plain and (provider, plain) in by:
            r.metrics["vs_plain"] = by[(provider, plain)].time_ms / r.time_ms


def _summary(winners: dict[str, dict]) -> str:
    lines = ["", "== winners (table entries: fwd_config / bwd_config keys) =="]
    for name, w in winners.items():
        fwd = {k: w["fwd"][k] for k in FWD_KEYS} if "fwd" in w else None
        bwd = {**w.get("dq", {}), **w.get("kv", {})}
        lines.append(f"{name}: fwd {fwd}  bwd {bwd}")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------ command
def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=module_prog(), description=__doc__.splitlines()[0])
    p.add_argument(
        "--device", default=None, help="cuda (default where there is one) or cpu (the interpreter)"
    )
    p.add_argument(
        "--shapes",
        nargs="+",
        metavar="NAME",
        default=None,
        help=f"shapes to sweep (default: the GPU ones on cuda, the smoke ones on cpu): {', '.join(SHAPES)}",
    )
    p.add_argument(
        "--audit-only", action="store_true", help="compile and audit the candidates for --arch; no runs"
    )
    p.add_argument(
        "--arch", default=None, help="audit target, e.g. sm_90 (default: the device's; sm_90 without one)"
    )
    p.add_argument(
        "--jobs",
        type=int,
        default=os.cpu_count() or 1,
        help="processes that compile the candidates for the audit; default one a CPU",
    )
    p.add_argument(
        "--warm-jobs",
        type=int,
        default=None,
        help="processes that launch each candidate once before a shape is timed, so its "
        "compiles run in parallel (default: up to 8 on CUDA, one a CPU; none on CPU)",
    )
    p.add_argument(
        "--budget-s", type=float, default=420.0, help="no candidate starts after this many seconds"
    )
    p.add_argument("--limit", type=int, default=None, help="the first N candidates of each pass only")
    p.add_argument("--json", metavar="FILE", help="append result rows to FILE as JSON lines")
    return p  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    errors = []
    if args.jobs < 1:
        errors.append(f"--jobs must be at least 1, got {args.jobs}")
    if args.warm_jobs is not None and args.warm_jobs < 0:
        errors.append(f"--warm-jobs must be at least 0, got {args.warm_jobs}")
    if args.limit is not None and args.limit < 1:
        errors.append(f"--limit must be at least 1, got {args.limit}")
    if not args.budget_s > 0:
        errors.append(f"--budget-s must be positive, got {args.budget_s}")
    unknown = [s for s in args.shapes or () if s not in SHAPES]
    if unknown:
        errors.append(f"--shapes: unknown {unknown}; choose from {', '.join(SHAPES)}")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device not in ("cuda", "cpu") and not device.startswith("cuda:"):
        errors.append(f"--device must be cuda or cpu, got {device!r}")
    if errors:
        print("; ".join(errors), file=sys.stderr)
        return 2
    interpret = device == "cpu" and not args.audit_only
    kernels_loaded = "mmbalance.kernels.dispatch" in sys.modules
    if interpret and not kernels_loaded:
        os.environ["TRITON_INTERPRET"] = "1"  # read when the kernel modules load
    if args.audit_only and not kernels_loaded:
        os.environ.pop("TRITON_INTERPRET", None)  # interpreted kernels cannot be compiled
    from mmbalance.kernels.dispatch import INTERPRET

    if interpret != INTERPRET and not args.audit_only:
        print(f"--device {device}: the kernels were loaded with TRITON_INTERPRET={int(INTERPRET)}; "
              "run in a fresh process", file=sys.stderr)  # fmt: skip
        return 2
    if args.audit_only and INTERPRET:
        print(
            "--audit-only: the kernels were loaded under TRITON_INTERPRET; run in a fresh process",
            file=sys.stderr,
        )
        return 2
    if device.startswith("cuda") and not torch.cuda.is_available():
        print("--device cuda: no CUDA device here (--device cpu runs the interpreter)", file=sys.stderr)
        return 2
    from mmbalance.kernels.attention_common import device_capability

    if args.arch:
        from mmbalance.bench.kernel_audit import parse_arch

        try:
            capability, _ = parse_arch(args.arch)
        except ValueError as e:
            print(str(e), file=sys.stderr)
            return 2
    elif device.startswith("cuda") and not args.audit_only:
        capability = device_capability(torch.device(device))
    else:
        capability = 90
    default = [s.name for s in (_SMOKE if interpret else _GPU)]
    shapes = [SHAPES[n] for n in (args.shapes or default)]
    dtype = torch.float32 if interpret else torch.bfloat16
    deadline = time.monotonic() + args.budget_s
    # every shape's candidates audited first: the audit forks its compiling processes, which must
    # not inherit a process that has been running kernels
    planned = []
    for shape in shapes:
        soft = shape.softcap > 0
        cands: dict[str, list[dict]] = {
            "fwd": fwd_candidates(shape.head_dim, dtype, capability, softcap=soft, interpret=interpret),
            **bwd_candidates(shape.head_dim, dtype, capability, softcap=soft, interpret=interpret),
        }
        if args.limit:
            cands = {p: c[: args.limit] for p, c in cands.items()}
        t0 = time.monotonic()
        audit_rows = {} if interpret else _audit(shape, dtype, capability, cands, args.jobs)
        n = sum(len(c) for c in cands.values())
        where = "interpreted: not audited" if interpret else f"audited for sm_{capability}"
        if not audit_rows and not interpret:
            where = "not audited: no ptxas"
        print(f"{shape.name}: {n} candidates, {where} ({time.monotonic() - t0:.0f} s)", flush=True)
        planned.append((shape, cands, audit_rows))
    if args.audit_only:
        for shape, cands, audit_rows in planned:
            rows = [_row(p, c, shape, "bfloat16", "", math.nan, _audit_status(audit_rows.get(
                (p, _label(c, FWD_KEYS if p == "fwd" else PASS_KEYS[p])))), audit_rows, {p: 0.0},
                provider="table" if c is cands[p][0] else "candidate") for p, c in _each(cands)]  # fmt: skip
            for r in rows:  # tiles_audit_fwd, tiles_audit_dq, tiles_audit_kv
                r.op = "tiles_audit_" + r.op.rsplit("_", 1)[-1]
            report(rows, args.json, title=f"{shape.name}: sm_{capability} audit")
        return 0
    dev_name = device_name(device)
    if args.warm_jobs is not None:
        warm_jobs = args.warm_jobs
    else:  # one device context each: a few are enough to keep the compiles busy
        warm_jobs = min(len(os.sched_getaffinity(0)), 8) if device.startswith("cuda") else 0
    warmer = _Warmer(warm_jobs) if warm_jobs > 0 else None
    all_rows: list[Row] = []
    winners: dict[str, dict] = {}
    failed, skipped = [], []
    try:
        for shape, cands, audit_rows in planned:
            if time.monotonic() > deadline:  # a shape takes its reference, tables and SDPA: not started late
                skipped.append(shape.name)
                continue
            t0 = time.monotonic()
            try:
                rows, winners[shape.name] = sweep_shape(shape, device, dtype, cands, audit_rows, deadline=deadline,
                                                        warmer=warmer, dev_name=dev_name)  # fmt: skip
            except Exception:  # noqa: BLE001 - the other shapes still run
                traceback.print_exc()
                failed.append(shape.name)
                continue
            _relate_plain(all_rows + rows)
            report(rows, args.json, title=f"{shape.name}: tiles ({time.monotonic() - t0:.0f} s)")
            all_rows += rows
    finally:
        if warmer is not None:
            warmer.close()
    if skipped:
        print(f"not started, past --budget-s: {', '.join(skipped)}")
    if winners:
        print(_summary(winners))
    if failed:
        print(f"failed shapes: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
