"""``python -m mmbalance.bench.kernel_audit``: the PTX parsing, the registry, and one real sm_90 compile."""

from __future__ import annotations

import importlib
import json
import os
import pkgutil
import sys
from pathlib import Path

import pytest

import mmbalance.kernels
from mmbalance.bench.kernel_audit import audit as kernel_audit
from mmbalance.bench.kernel_audit import variants
from mmbalance.kernels import varlen
from tests import procs

REPO = Path(__file__).resolve().parents[2]

PTX = """
    ld.global.b32 %r1, [%rd1+0];
    @%p1 ld.global.v4.b32 { %r2, %r3, %r4, %r5 }, [ %rd2 + 0 ];
    @!%p2 ld.global.L1::evict_last.v2.b16 { %rs1, %rs2 }, [ %rd3 + 0 ];
    ld.shared.v4.b32 { %r6, %r7, %r8, %r9 }, [ %r10 + 0 ];
    cp.async.cg.shared.global [ %r11 + 0 ], [ %rd4 + 0 ], 16, %r12;
    @%p3 st.global.v2.b32 [ %rd5 + 0 ], { %r13, %r14 };
    st.global.b8 [ %rd6 + 0 ], %rs3;
    mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%f1}, {%r1}, {%r2}, {%f2};
"""


def test_ptx_memory_widths():
    widths = kernel_audit.ptx_memory_widths(PTX)
    assert widths["load_bits"] == 128  # v4.b32 and the 16-byte cp.async; shared loads ignored
    assert widths["store_bits"] == 64
    assert widths["global_access_hist"] == {"ld.32": 2, "ld.128": 1, "cp.async.128": 1, "st.64": 1, "st.8": 1}


def test_tensor_core_kind():
    assert kernel_audit.tensor_core_kind(PTX) == "mma"
    assert kernel_audit.tensor_core_kind("wgmma.mma_async.sync.aligned.m64n64k16") == "wgmma"
    assert kernel_audit.tensor_core_kind(PTX.replace("mma.sync", "add.f32")) == "-"


def test_expectations_fail_loudly():
    row = {"load_bits": 64, "store_bits": 128, "spill_bytes": 8, "local_bytes": 0, "tensor_cores": "-"}
    fails = kernel_audit.check_expectations(row, {"load_bits": 128, "spill_bytes": 0, "mma": True})
    assert len(fails) == 3


def test_every_varlen_kernel_is_registered():
    kernels = {
        name for name, obj in vars(varlen).items() if name.endswith("_kernel") and hasattr(obj, "arg_names")
    }
    audited = {cfg["kernel"].__name__ for cfg in variants.varlen_variants()}
    assert kernels == audited
    configs, errors = kernel_audit.discover("fwd_kernel[")
    assert not errors
    assert {c["name"] for c in variants.varlen_variants()} <= {c["name"] for c in configs}


def test_every_kernel_of_the_kernels_package_is_audited():
    """A ``@triton.jit`` kernel (``*_kernel``) added to any module of ``kernels/`` fails this until
    ``bench/kernel_audit/variants.py`` lists it; the kernel modules build no audit entries."""
    audited = {id(cfg["kernel"]) for cfg in variants.variants(90)}
    found = []
    for info in pkgutil.iter_modules(mmbalance.kernels.__path__):
        module = importlib.import_module(f"mmbalance.kernels.{info.name}")
        assert not hasattr(module, "AUDIT_CONFIGS") and not hasattr(module, "audit_configs"), info.name
        for name, obj in vars(module).items():
            if name.endswith("_kernel") and hasattr(obj, "arg_names") and obj.__module__ == module.__name__:
                found.append(name)
                assert id(obj) in audited, f"{info.name}.{name} is not in the kernel audit"
    assert len(found) == len(audited) == 10


def test_a_broken_kernel_import_is_a_failed_row(monkeypatch):
    monkeypatch.setitem(sys.modules, "mmbalance.bench.kernel_audit.variants", None)
    configs, errors = kernel_audit.discover()
    assert configs == [] and errors and "import failed" in errors[0]["error"]


@pytest.mark.slow
@pytest.mark.skipif(kernel_audit.ptxas_path(90) is None, reason="no ptxas (Triton's bundled one or on PATH)")
def test_audit_compiles_varlen_kernels_to_128_bit_accesses(tmp_path, arch="sm_90"):
    """A fresh process (the audit needs compilable, not interpreted, kernels)."""
    out = tmp_path / "audit.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [
        sys.executable,
        "-m",
        "mmbalance.bench.kernel_audit",
        "--arch",
        arch,
        "--only",
        "row=4096",
        "--json",
        str(out),
    ]
    proc = procs.run(cmd, cwd=REPO, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads(out.read_text())["kernels"]
    names = {r["name"] for r in rows}
    assert {"pack_fwd_kernel[fp16,row=4096]", "unpack_fwd_kernel[fp16,row=4096]"} <= names
    for r in rows:
        assert r["load_bits"] == 128 and r["store_bits"] == 128 and r["spill_bytes"] == 0, r


@pytest.mark.parametrize("jobs", [1, 2])
def test_audit_all_keeps_the_order_and_fails_a_row_per_broken_kernel(monkeypatch, jobs):
    """Forked workers (``--jobs``) give the rows in the entries' order, and a kernel that does not
    compile is a failed row there too, not a lost one or a crashed run."""

    def fake_audit(cfg, capability, ptxas_arch):
        if cfg["name"] == "broken":
            raise RuntimeError("ptxas says no")
        return {"name": cfg["name"], "pid": os.getpid(), "capability": capability, "arch": ptxas_arch}

    monkeypatch.setattr(kernel_audit, "audit_one", fake_audit)
    names = [f"k{i}" for i in range(7)]
    names.insert(3, "broken")
    configs = [{"name": n, "module": "m"} for n in names]
    rows = kernel_audit.audit_all(configs, 90, "sm_90a", jobs=jobs)
    assert [r["name"] for r in rows] == names
    assert "compile failed" in rows[3]["error"] and "ptxas says no" in rows[3]["error"]
    assert all(r["capability"] == 90 and r["arch"] == "sm_90a" for i, r in enumerate(rows) if i != 3)
    pids = {r["pid"] for i, r in enumerate(rows) if i != 3}
    assert (os.getpid() in pids) == (jobs == 1)  # forked workers did the work
    assert kernel_audit._JOB == ([], 0, "")  # nothing kept from the run


def test_a_compiler_that_kills_its_process_fails_its_row_only(monkeypatch):
    """A crash in the compiler (here: the process exits mid-entry) neither hangs the parallel
    audit nor loses the other rows: the unfinished entries are compiled again one process each."""

    def fake_audit(cfg, capability, ptxas_arch):
        if cfg["name"] == "crash":
            os._exit(3)
        return {"name": cfg["name"], "pid": os.getpid()}

    monkeypatch.setattr(kernel_audit, "audit_one", fake_audit)
    names = ["a", "b", "crash", "c", "d", "e"]
    rows = kernel_audit.audit_all([{"name": n, "module": "m"} for n in names], 90, "sm_90a", jobs=2)
    assert [r["name"] for r in rows] == names
    assert rows[2]["error"] == "compile failed: the compiling process died"
    assert all("error" not in r and r["pid"] != os.getpid() for i, r in enumerate(rows) if i != 2)
    assert kernel_audit._JOB == ([], 0, "")


@pytest.mark.slow
@pytest.mark.skipif(kernel_audit.ptxas_path(90) is None, reason="no ptxas (Triton's bundled one or on PATH)")
def test_parallel_audit_gives_the_serial_report(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    reports = []
    for jobs in (1, 2):
        out = tmp_path / f"audit{jobs}.json"
        cmd = [sys.executable, "-m", "mmbalance.bench.kernel_audit", "--only", "fwd_kernel[fp16",
               "--jobs", str(jobs), "--json", str(out)]  # fmt: skip
        proc = procs.run(cmd, cwd=REPO, env=env, timeout=600)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        reports.append(
            [{k: v for k, v in r.items() if k != "compile_s"} for r in json.loads(out.read_text())["kernels"]]
        )
    assert len(reports[0]) >= 2 and reports[0] == reports[1]
