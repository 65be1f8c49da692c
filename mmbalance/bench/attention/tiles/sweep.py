"""The tile sweep of one shape: the candidates audited, checked and timed, the fastest of each pass
together beside the table's choice and SDPA, and the rows and summary they give."""

from __future__ import annotations

import math
import time
from typing import Any

import torch

from ...harness import Row, time_fn
from ..batch import sdpa_runner
from .check import (
    CONSISTENCY_TOLERANCE,
    TABLE_TOLERANCE,
    Case,
    accepted,
    make_case,
    pass_outputs,
    reference_error,
    row_error,
    table_config,
)
from .shapes import FWD_KEYS, PASS_KEYS, SHAPES, TileShape, each_candidate, tile_label


# ------------------------------------------------------------------------------------ audit
def audit_candidates(shape: TileShape, dtype: torch.dtype, capability: int, cands: dict, jobs: int) -> dict:
    """``{(pass, label): audit row}`` for every candidate; ``{}`` where the audit cannot run (no
    ptxas): then nothing is dropped for it, and the rows say ``unaudited``."""
    from mmbalance.bench import kernel_audit

    if kernel_audit.ptxas_path(capability) is None:
        return {}
    _, ptxas_arch = kernel_audit.parse_arch(f"sm_{capability}")
    group = shape.heads // shape.kv_heads
    entries, keys = [], []
    for pass_, cfg in each_candidate(cands):
        label = tile_label(cfg, FWD_KEYS if pass_ == "fwd" else PASS_KEYS[pass_])
        entries.append(kernel_audit.attention_entry(pass_, f"{shape.name}:{pass_}:{label}", dtype, shape.head_dim,
                                                    shape.features, cfg, group=group, has_runs=False))  # fmt: skip
        keys.append((pass_, label))
    rows = kernel_audit.audit_all(entries, capability, ptxas_arch, jobs=jobs)
    return dict(zip(keys, rows))


def audit_verdict(row: dict | None) -> str:
    if row is None:
        return "unaudited"
    if "error" in row:
        return f"audit: {row['error'][:120]}"
    return "ok" if not row["failures"] else "audit: " + "; ".join(row["failures"])


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
    warmer: Any = None,
    dev_name: str = "",
) -> tuple[list[Row], dict]:
    """Check and time every candidate of one shape; the rows and the winners (``{"fwd": tiles,
    "dq": tiles, "kv": tiles, "fwd_bwd_ms": ms}``, the fastest accepted of each pass).

    ``warmer``: a :class:`~.warm.Warmer` (passed in by the command) that compiles the candidates
    in parallel before they are timed; None compiles them here, one by one.
    """
    case = make_case(shape, device, dtype)
    dname = str(dtype).replace("torch.", "")
    flops = {"fwd": shape.flops_fwd(), "dq": 2.5 * shape.flops_fwd(), "kv": 2.5 * shape.flops_fwd()}
    tables = {"fwd": table_config(case, "fwd"), "bwd": table_config(case, "bwd")}
    # the table's forward output feeds every backward candidate (the reference's, should it fail)
    try:
        out_t, lse_t = case.fwd(tables["fwd"], out=torch.empty_like(case.out), lse=torch.empty_like(case.lse))
    except Exception:  # noqa: BLE001 - the table's own row says why
        out_t, lse_t = case.ref["out"].to(dtype), case.ref["lse"].float()
    launches = []  # (pass, candidate, launch configuration, audit status); the tables first in each pass
    rows: list[Row] = []
    for pass_, cand in each_candidate(cands):
        keys = FWD_KEYS if pass_ == "fwd" else PASS_KEYS[pass_]
        status = audit_verdict(audit_rows.get((pass_, tile_label(cand, keys)))) if audit_rows else "unaudited"
        if status.startswith("audit") and cand is not cands[pass_][0]:  # the table runs regardless
            rows.append(result_row(pass_, cand, shape, dname, dev_name, math.nan, status, audit_rows, flops))
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
            rows.append(result_row(pass_, cand, shape, dname, dev_name, math.nan, status, audit_rows, flops, err=err,
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
            for t in pass_outputs(case, "fwd") + list(case.grads):
                t.fill_(math.nan)
            t0 = time.perf_counter()
            run()
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            once_ms = (time.perf_counter() - t0) * 1e3
        except Exception as e:  # noqa: BLE001 - a candidate that does not launch is a row
            say(f"launch: {type(e).__name__}: {e}"[:200])
            continue
        err = reference_error(case, pass_)
        if is_table:
            table_err[pass_] = err
            table_out[pass_] = [t.clone() for t in pass_outputs(case, pass_)]
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
                off = max(
                    row_error(got, want) for got, want in zip(pass_outputs(case, pass_), table_out[pass_])
                )
                if not off <= CONSISTENCY_TOLERANCE[dtype]:
                    say(f"check: a row {off:.3g} off the table's result", err)
                    continue
        ms = _time(run, device) if device.startswith("cuda") else once_ms  # the interpreter: run once
        status = "ok" if audit_status == "ok" else audit_status
        row = result_row(
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


def result_row(
    pass_, cand, shape, dname, dev_name, ms, status, audit_rows, flops, err=math.nan, provider="candidate"
):
    keys = FWD_KEYS if pass_ == "fwd" else PASS_KEYS[pass_]
    label = tile_label(cand, keys)
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


def _together(case: Case, shape: TileShape, device: str, dname: str, dev_name: str, tables: dict,
              winners: dict) -> list[Row]:  # fmt: skip
    """Forward + backward with the table's tiles, with each pass's fastest, and SDPA's."""
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
                f"{p} {tile_label(c, FWD_KEYS if p == 'fwd' else PASS_KEYS[p])}" for p, c in winners.items()
            )
        rows.append(Row("tiles_fwd_bwd", provider, shape.name, dname, dev_name, ms, metrics))
    if shape.softcap == 0 and not shape.sinks:
        block = shape.block(case.q.dtype)
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


def relate_plain(rows: list[Row]) -> None:
    """``vs_plain`` on the softcap and sinks shapes' ``tiles_fwd_bwd`` rows."""
    by = {(r.provider, r.shape): r for r in rows if r.op == "tiles_fwd_bwd"}
    for (provider, name), r in by.items():
        plain = SHAPES[name].plain
        if plain and (provider, plain) in by:
            r.metrics["vs_plain"] = by[(provider, plain)].time_ms / r.time_ms


def summary(winners: dict[str, dict]) -> str:
    lines = ["", "== winners (table entries: fwd_config / bwd_config keys) =="]
    for name, w in winners.items():
        fwd = {k: w["fwd"][k] for k in FWD_KEYS} if "fwd" in w else None
        bwd = {**w.get("dq", {}), **w.get("kv", {})}
        lines.append(f"{name}: fwd {fwd}  bwd {bwd}")
    return "\n".join(lines)
