"""The tile sweep's command: ``python -m mmbalance.bench.attention.tiles`` (the package's docstring
says what it does)."""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
import traceback

import torch

from ...harness import Row, device_name, module_prog, report
from .shapes import (
    FWD_KEYS,
    GPU_SHAPES,
    PASS_KEYS,
    SHAPES,
    SMOKE_SHAPES,
    bwd_candidates,
    each_candidate,
    fwd_candidates,
    tile_label,
)
from .sweep import audit_candidates, audit_verdict, relate_plain, result_row, summary, sweep_shape
from .warm import Warmer


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
    default = [s.name for s in (SMOKE_SHAPES if interpret else GPU_SHAPES)]
    shapes = [SHAPES[n] for n in (args.shapes or default)]
    dtype = torch.float32 if interpret else torch.bfloat16
    deadline = time.monotonic() + args.budget_s
    # every shape's candidates audited first: the audit forks its compiling processes, which must
    # not inherit a process that has been running kernels
    planned = []
    for shape in shapes:
        soft = shape.softcap > 0
        cands: dict[str, list[dict]] = {
            "fwd": fwd_candidates(
                shape.head_dim, dtype, capability, softcap=soft, interpret=interpret, causal=shape.causal
            ),
            **bwd_candidates(
                shape.head_dim, dtype, capability, softcap=soft, interpret=interpret, causal=shape.causal
            ),
        }
        if args.limit:
            cands = {p: c[: args.limit] for p, c in cands.items()}
        t0 = time.monotonic()
        audit_rows = {} if interpret else audit_candidates(shape, dtype, capability, cands, args.jobs)
        n = sum(len(c) for c in cands.values())
        where = "interpreted: not audited" if interpret else f"audited for sm_{capability}"
        if not audit_rows and not interpret:
            where = "not audited: no ptxas"
        print(f"{shape.name}: {n} candidates, {where} ({time.monotonic() - t0:.0f} s)", flush=True)
        planned.append((shape, cands, audit_rows))
    if args.audit_only:
        for shape, cands, audit_rows in planned:
            rows = [result_row(p, c, shape, "bfloat16", "", math.nan, audit_verdict(audit_rows.get(
                (p, tile_label(c, FWD_KEYS if p == "fwd" else PASS_KEYS[p])))), audit_rows, {p: 0.0},
                provider="table" if c is cands[p][0] else "candidate") for p, c in each_candidate(cands)]  # fmt: skip
            for r in rows:  # tiles_audit_fwd, tiles_audit_dq, tiles_audit_kv
                r.op = "tiles_audit_" + r.op.rsplit("_", 1)[-1]
            report(rows, args.json, title=f"{shape.name}: sm_{capability} audit")
        return 0
    dev_name = device_name(device)
    if args.warm_jobs is not None:
        warm_jobs = args.warm_jobs
    else:  # one device context each: a few are enough to keep the compiles busy
        warm_jobs = min(len(os.sched_getaffinity(0)), 8) if device.startswith("cuda") else 0
    warmer = Warmer(warm_jobs) if warm_jobs > 0 else None
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
            relate_plain(all_rows + rows)
            report(rows, args.json, title=f"{shape.name}: tiles ({time.monotonic() - t0:.0f} s)")
            all_rows += rows
    finally:
        if warmer is not None:
            warmer.close()
    if skipped:
        print(f"not started, past --budget-s: {', '.join(skipped)}")
    if winners:
        print(summary(winners))
    if failed:
        print(f"failed shapes: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0
