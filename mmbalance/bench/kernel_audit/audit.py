"""Compile every Triton kernel in ``kernels/`` for a GPU architecture and audit the machine code.

    python -m mmbalance.bench.kernel_audit --arch sm_90 [--json FILE] [--only SUBSTRING] [--jobs N]

Needs no GPU: ``triton.compile`` lowers each kernel to PTX and a cubin for the target
(``GPUTarget("cuda", 90, 32)``), ``cuobjdump --dump-resource-usage`` reads registers and local
memory from the cubin, ``ptxas -v`` reports spill stores/loads, and the PTX gives the widest global
load and store (``ld.global.v4.b32`` = 128 bits; ``cp.async`` counts as a load) and whether
tensor-core instructions appear (``mma.sync``, ``wgmma``, ``tcgen05``). This is the bandwidth
floor of DESIGN.md on CPU-only machines: bandwidth kernels must show 128-bit global loads and
stores and zero spills. The entries compile in ``--jobs`` forked processes (default one a CPU):
a cold run of the 83 entries takes 101 s on one core of the 2-core CI machine, 49 s on two.

Registry. The entries are listed in ``variants.py`` (``variants(capability)``), each
a dict with keys

    name             str, unique in the report
    kernel           the ``@triton.jit`` function
    signature        {arg: triton type} for the non-constexpr args ("*fp16", "i32", "fp32", ...);
                     constexpr args may be listed as "constexpr" or left out
    constexprs       {arg: value}
    divisible_by_16  arg names Triton may assume are multiples of 16 (as it specialises them at a
                     launch); default: every pointer and every ``stride*`` argument
    num_warps        default 4;  num_stages  default 3
    expect           checks that fail the audit: "load_bits", "store_bits" (minimum widest
                     width), "spill_bytes" (maximum), "mma" (True: tensor-core instructions required)

The list is built for the target's capability (90 for sm_90), so launch configurations chosen per
architecture are audited as they launch there. Adding a kernel to the audit is adding its entries
there. The exit status is 1 when any expectation fails or a kernel does not compile.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import warnings

from ..processes import die_with_parent, lifeline

warnings.filterwarnings("ignore", message="TRITON_DEFAULT_FP_FUSION")

_MEM_INSTR = re.compile(r"^\s*(?:@!?%p\d+\s+)?(ld|st|cp\.async)\.([\w.:]+)", re.MULTILINE)
_TYPE_BITS = re.compile(r"^[bsuf](\d+)$")


def _instr_bits(suffix: str) -> int | None:
    """Width in bits of one PTX ``ld``/``st`` instruction, or None if it is not a global access."""
    parts = suffix.split(".")
    if "global" not in parts:
        return None
    vec = 1
    bits = None
    for p in parts:
        if p.startswith("v") and p[1:].isdigit():
            vec = int(p[1:])
        m = _TYPE_BITS.match(p)
        if m:
            bits = int(m.group(1))
    return None if bits is None else vec * bits


def ptx_memory_widths(ptx: str) -> dict:
    """Widest global load/store in bits and a histogram ``{"ld.v4.b32": count, ...}``."""
    widest = {"ld": 0, "st": 0}
    hist: dict[str, int] = {}
    for line in ptx.splitlines():
        m = _MEM_INSTR.match(line)
        if not m:
            continue
        kind, suffix = m.group(1), m.group(2)
        if kind == "cp.async":
            # cp.async.{ca,cg}.shared.global [dst], [src], 16: the byte count is an operand
            if "global" in suffix and "bulk" not in suffix:
                size = re.search(r",\s*(\d+)\s*(?:,|;)", line)
                if size:
                    nbits = int(size.group(1)) * 8
                    widest["ld"] = max(widest["ld"], nbits)
                    hist[f"cp.async.{nbits}"] = hist.get(f"cp.async.{nbits}", 0) + 1
            elif "bulk" in suffix:
                hist["tma"] = hist.get("tma", 0) + 1
            continue
        bits = _instr_bits(suffix)
        if bits is None:
            continue
        widest[kind] = max(widest[kind], bits)
        key = f"{kind}.{bits}"
        hist[key] = hist.get(key, 0) + 1
    return {"load_bits": widest["ld"], "store_bits": widest["st"], "global_access_hist": hist}


def tensor_core_kind(ptx: str) -> str:
    if "tcgen05.mma" in ptx:
        return "tcgen05"
    if "wgmma.mma_async" in ptx:
        return "wgmma"
    if re.search(r"\bmma\.sync\b", ptx):
        return "mma"
    return "-"


def _tool(name: str) -> str | None:
    try:
        import triton.knobs

        path = getattr(triton.knobs.nvidia, name).path
        if path and os.path.exists(path):
            return path
    except Exception:  # noqa: BLE001 - fall back to PATH when the bundled tool is missing
        pass
    return shutil.which(name)


def ptxas_path(capability: int) -> str | None:
    """The ptxas Triton itself uses for this target (it picks a newer one for sm_90+)."""
    try:
        from triton.backends.nvidia.compiler import get_ptxas

        path = get_ptxas(capability).path
        if path and os.path.exists(path):
            return path
    except Exception:  # noqa: BLE001 - fall back to PATH
        pass
    return shutil.which("ptxas")


def resource_usage(ptx: str, cubin: bytes, arch: str, capability: int) -> dict:
    """Registers, stack/local bytes and spill bytes, from cuobjdump (cubin) and ptxas -v (PTX)."""
    out: dict = {"registers": None, "local_bytes": None, "spill_bytes": None, "stack_bytes": None}
    with tempfile.TemporaryDirectory() as tmp:
        cubin_path = os.path.join(tmp, "k.cubin")
        ptx_path = os.path.join(tmp, "k.ptx")
        with open(cubin_path, "wb") as f:
            f.write(cubin)
        with open(ptx_path, "w") as f:
            f.write(ptx)
        cuobjdump = _tool("cuobjdump")
        if cuobjdump:
            res = subprocess.run(
                [cuobjdump, "--dump-resource-usage", cubin_path], capture_output=True, text=True
            )
            m = re.search(r"REG:(\d+)\s+STACK:(\d+).*?LOCAL:(\d+)", res.stdout)
            if m:
                out["registers"], out["stack_bytes"], out["local_bytes"] = map(int, m.groups())
        ptxas = ptxas_path(capability)
        if ptxas:
            # the flags Triton compiles with, so the spill report matches its cubin
            cmd = [
                ptxas,
                "-lineinfo",
                "-v",
                "--regAllocOptLevel=2",
                f"--gpu-name={arch}",
                ptx_path,
                "-o",
                os.devnull,
            ]
            log = subprocess.run(cmd, capture_output=True, text=True).stderr
            spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
            if spills:
                out["spill_bytes"] = int(spills.group(1)) + int(spills.group(2))
            regs = re.search(r"Used (\d+) registers", log)
            if regs and out["registers"] is None:
                out["registers"] = int(regs.group(1))
    return out


def normalise_entry(entry: dict) -> dict:
    cfg = dict(entry)
    cfg.setdefault("num_warps", 4)
    cfg.setdefault("num_stages", 3)
    cfg.setdefault("expect", {})
    cfg["module"] = cfg["kernel"].__module__.rsplit(".", 1)[-1]
    return cfg


def discover(only: str | None = None, capability: int = 90) -> tuple[list[dict], list[dict]]:
    """The entries of ``variants.variants(capability)`` whose name contains ``only``
    (all when None), plus an error row when the kernels do not import.

    ``capability`` picks the launch configurations (per-architecture choices of the launchers).
    """
    try:
        # imported here, not at the top: ``main`` clears TRITON_INTERPRET before the kernels load
        from .variants import variants
    except Exception as e:  # noqa: BLE001 - a broken kernel module is a failed row, not a crash
        return [], [{"name": "mmbalance.bench.kernel_audit.variants", "error": f"import failed: {e!r}"}]
    configs = [normalise_entry(entry) for entry in variants(capability)]
    return [cfg for cfg in configs if only is None or only in cfg["name"]], []


def attention_entry(pass_: str, name: str, dtype, head_dim: int, features: dict, cfg: dict, **kw) -> dict:
    """An entry for one attention kernel launched with ``cfg`` (``pass_``: ``"fwd"``, ``"dq"`` or
    ``"kv"``), normalised for :func:`audit_all`: ``variants.fwd_entry``/``bwd_entry`` with
    ``features`` and ``kw`` (``group``, ``has_runs``, ``overflow``). For sweeps of launch
    configurations (``bench/attention/tiles.py``); the kernels load here, on first use."""
    from .variants import bwd_entry, fwd_entry

    if pass_ == "fwd":
        return normalise_entry(fwd_entry(name, dtype, head_dim, features, cfg, **kw))
    if pass_ not in ("dq", "kv"):
        raise ValueError(f"pass_ must be 'fwd', 'dq' or 'kv', got {pass_!r}")
    return normalise_entry(bwd_entry(name, pass_, dtype, head_dim, features, cfg, **kw))


def parse_arch(arch: str) -> tuple[int, str]:
    m = re.fullmatch(r"sm_(\d+)a?", arch)
    if not m:
        raise ValueError(f"--arch must look like sm_90 or sm_80, got {arch!r}")
    capability = int(m.group(1))
    from triton.backends.nvidia.compiler import sm_arch_from_capability

    return capability, sm_arch_from_capability(capability)


def audit_one(cfg: dict, capability: int, ptxas_arch: str) -> dict:
    import triton
    from triton.backends.compiler import GPUTarget

    kernel = cfg["kernel"]
    names = list(kernel.arg_names)
    signature = {n: cfg["signature"].get(n, "constexpr") for n in names}
    for n in cfg["constexprs"]:
        signature[n] = "constexpr"
    divisible = cfg.get("divisible_by_16")
    if divisible is None:
        divisible = [n for n in names if signature[n].startswith("*") or n.startswith("stride")]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in divisible}
    src = triton.compiler.ASTSource(fn=kernel, signature=signature, constexprs=cfg["constexprs"], attrs=attrs)
    t0 = time.perf_counter()
    compiled = triton.compile(
        src,
        target=GPUTarget("cuda", capability, 32),
        options={"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]},
    )
    ptx = compiled.asm["ptx"]
    row = {"name": cfg["name"], "module": cfg["module"], "kernel": kernel.__name__}
    row.update(resource_usage(ptx, compiled.asm["cubin"], ptxas_arch, capability))
    row["shared_bytes"] = int(getattr(compiled.metadata, "shared", 0))
    row.update(ptx_memory_widths(ptx))
    row["tensor_cores"] = tensor_core_kind(ptx)
    row["compile_s"] = round(time.perf_counter() - t0, 2)
    row["constexprs"] = {k: v for k, v in cfg["constexprs"].items()}
    row["num_warps"] = cfg["num_warps"]
    row["failures"] = check_expectations(row, cfg["expect"])
    return row


def check_expectations(row: dict, expect: dict) -> list[str]:
    fails = []
    for key in ("load_bits", "store_bits"):
        if key in expect and row[key] < expect[key]:
            fails.append(f"{key} {row[key]} < {expect[key]}")
    if "spill_bytes" in expect:
        spilled = (row["spill_bytes"] or 0) + (row["local_bytes"] or 0)
        if row["spill_bytes"] is None and row["local_bytes"] is None:
            fails.append("spills unknown (no ptxas/cuobjdump)")
        elif spilled > expect["spill_bytes"]:
            fails.append(f"spill/local bytes {spilled} > {expect['spill_bytes']}")
    if expect.get("mma") and row["tensor_cores"] == "-":
        fails.append("no tensor-core instructions")
    return fails


def format_rows(rows: list[dict]) -> str:
    cols = ["name", "regs", "spill", "stack", "local", "smem", "ld_bits", "st_bits", "tc", "status"]
    cells = []
    for r in rows:
        if "error" in r:
            cells.append([r["name"], *([""] * (len(cols) - 2)), "ERROR " + r["error"]])
            continue
        cells.append(
            [
                r["name"],
                str(r["registers"]),
                str(r["spill_bytes"]),
                str(r["stack_bytes"]),
                str(r["local_bytes"]),
                str(r["shared_bytes"]),
                str(r["load_bits"]),
                str(r["store_bits"]),
                r["tensor_cores"],
                "ok" if not r["failures"] else "FAIL: " + "; ".join(r["failures"]),
            ]
        )
    widths = [max(len(c), *(len(x[i]) for x in cells)) if cells else len(c) for i, c in enumerate(cols)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(cols, widths)), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(v.ljust(w) for v, w in zip(x, widths)) for x in cells]
    return "\n".join(lines)


_JOB: tuple[list[dict], int, str] = ([], 0, "")  # (configs, capability, ptxas arch) for forked workers


def _audit_or_fail(cfg: dict, capability: int, ptxas_arch: str) -> dict:
    try:
        return audit_one(cfg, capability, ptxas_arch)
    except Exception as e:  # noqa: BLE001 - a kernel that does not compile is a failed row
        return {"name": cfg["name"], "module": cfg["module"], "error": f"compile failed: {e!r}"[:300]}


def _audit_index(i: int) -> dict:
    configs, capability, ptxas_arch = _JOB
    return _audit_or_fail(configs[i], capability, ptxas_arch)


def audit_all(configs: list[dict], capability: int, ptxas_arch: str, jobs: int = 1) -> list[dict]:
    """One row per entry, in the entries' order; ``jobs > 1`` compiles in that many forked
    processes (compilation is CPU-bound and single-threaded; the entries are read from the parent
    after the fork, so nothing unpicklable crosses). A compiling process that dies (a crash in the
    compiler) fails its entry, not the audit: the entries it left unfinished are compiled again,
    each in a process of its own, and the one that kills its process again is an error row."""
    global _JOB
    jobs = max(1, min(jobs, len(configs)))
    if jobs == 1 or sys.platform != "linux":
        return [_audit_or_fail(cfg, capability, ptxas_arch) for cfg in configs]
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor
    from concurrent.futures.process import BrokenProcessPool

    _JOB = (configs, capability, ptxas_arch)
    rows: dict[int, dict] = {}
    try:
        context = multiprocessing.get_context("fork")
        # the compiling processes end with this one, however it ends (processes.die_with_parent)
        parent = lifeline()
        with ProcessPoolExecutor(
            jobs, mp_context=context, initializer=die_with_parent, initargs=parent
        ) as pool:
            futures = {i: pool.submit(_audit_index, i) for i in range(len(configs))}
            for i, fut in futures.items():
                try:
                    rows[i] = fut.result()
                except BrokenProcessPool:
                    break
        for i in range(len(configs)):  # after a death: one process each, so only the culprit fails
            if i in rows:
                continue
            with ProcessPoolExecutor(
                1, mp_context=context, initializer=die_with_parent, initargs=parent
            ) as alone:
                try:
                    rows[i] = alone.submit(_audit_index, i).result()
                except BrokenProcessPool:
                    cfg = configs[i]
                    rows[i] = {"name": cfg["name"], "module": cfg["module"],
                               "error": "compile failed: the compiling process died"}  # fmt: skip
    finally:
        _JOB = ([], 0, "")
    return [rows[i] for i in range(len(configs))]


def main(argv: list[str] | None = None) -> int:
    from ..harness import git_sha, module_prog

    p = argparse.ArgumentParser(prog=module_prog(), description=__doc__.splitlines()[0])
    p.add_argument("--arch", default="sm_90", help="target, e.g. sm_90 or sm_80 (default sm_90)")
    p.add_argument("--json", metavar="FILE", help="write the report as JSON to FILE")
    p.add_argument("--only", metavar="SUBSTRING", help="audit only entries whose name contains this")
    p.add_argument(
        "--jobs", type=int, default=os.cpu_count() or 1, help="compiling processes (default: one a CPU)"
    )
    args = p.parse_args(argv)
    if args.jobs < 1:
        p.error(f"--jobs must be at least 1, got {args.jobs}")
    # Under the interpreter ``@triton.jit`` returns functions that cannot be compiled; the kernel
    # modules are imported below (by ``discover``), after this.
    os.environ.pop("TRITON_INTERPRET", None)

    import triton

    capability, ptxas_arch = parse_arch(args.arch)
    configs, rows = discover(args.only, capability)
    rows += audit_all(configs, capability, ptxas_arch, args.jobs)
    print(f"kernel audit: {args.arch} ({ptxas_arch}), triton {triton.__version__}, {len(configs)} entries")
    print(format_rows(rows))
    failed = [r for r in rows if "error" in r or r.get("failures")]
    print(f"{len(rows) - len(failed)} ok, {len(failed)} failed")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        report = {"arch": args.arch, "triton": triton.__version__, "sha": git_sha(), "kernels": rows}
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1, default=str)
    return 1 if failed else 0
