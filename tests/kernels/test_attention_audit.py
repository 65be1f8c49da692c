"""The attention kernels in ``python -m mmbalance.bench.kernel_audit``: registered (bf16 at head dims 64 and
128, float32 at 128, and at 128 the window, softcap and sinks variants), and tensor cores without
spills when compiled for sm_90 and sm_80 at head dim 128 (the tightest register budget)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

from mmbalance.bench.kernel_audit import audit as kernel_audit
from mmbalance.bench.kernel_audit import variants
from mmbalance.kernels import attention_bwd, attention_bwd_dkdv, attention_common, attention_fwd, merge
from tests import procs

REPO = Path(__file__).resolve().parents[2]

AUDITED = {
    "fwd": ((attention_fwd,), variants.attention_fwd_variants(90)),
    "bwd": ((attention_bwd, attention_bwd_dkdv), variants.attention_bwd_variants(90)),
    "merge": ((merge,), variants.merge_variants()),
}


@pytest.mark.parametrize("part", list(AUDITED))
def test_every_attention_kernel_is_audited_at_both_head_dims(part):
    modules, entries = AUDITED[part]
    kernels = {
        name
        for module in modules
        for name, obj in vars(module).items()
        if name.endswith("_kernel") and hasattr(obj, "arg_names") and obj.__module__ == module.__name__
    }
    assert kernels and kernels == {cfg["kernel"].__name__ for cfg in entries}
    for cfg in entries:
        assert cfg["expect"]["spill_bytes"] == 0
        tensor_cores = "preprocess" not in cfg["name"] and "fp32" not in cfg["name"] and part != "merge"
        assert cfg["expect"].get("mma", False) == tensor_cores, cfg["name"]
    assert {cfg["constexprs"]["HEAD_DIM"] for cfg in entries} == {64, 128}


def test_the_audit_lists_the_attention_variants_once():
    configs, errors = kernel_audit.discover("attn")
    assert not errors
    names = [c["name"] for c in configs]
    assert len(names) == len(set(names)) == sum(len(entries) for _, entries in AUDITED.values())
    assert {c["module"] for c in configs} == {"attention_fwd", "attention_bwd", "attention_bwd_dkdv", "merge"}


@pytest.mark.slow
@pytest.mark.skipif(kernel_audit.ptxas_path(90) is None, reason="no ptxas (Triton's bundled one or on PATH)")
@pytest.mark.parametrize(
    "arch,only",
    # the plain causal variants with their overflow tails on both architectures (the tail once
    # spilled on sm_80), and the variant with every feature (window, softcap; sinks in the forward)
    [
        ("sm_90", "bf16_d128_causal_runs"),
        ("sm_80", "bf16_d128_causal_runs"),
        ("sm_90", "bf16_d128_causal_window_softcap"),
    ],
)
def test_attention_kernels_use_tensor_cores_without_spills(tmp_path, arch, only):
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
        only,
        "--json",
        str(out),
    ]
    proc = procs.run(cmd, cwd=REPO, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads(out.read_text())["kernels"]
    assert {r["kernel"] for r in rows} == {"attn_fwd_kernel", "attn_bwd_dq_kernel", "attn_bwd_dkdv_kernel"}
    assert any(r["name"].endswith("_overflow") for r in rows) and len(rows) >= 6
    for r in rows:
        assert r["tensor_cores"] in ("wgmma", "mma") and r["spill_bytes"] == 0 and r["local_bytes"] == 0, r


def test_feature_variants_are_audited_per_architecture():
    """Windows (causal and two-sided), softcap and sinks are in the audit with their overflow
    tails, and each architecture's entries carry the configuration the launcher picks there."""
    for part, features in (
        ("fwd", ("window", "window2", "softcap", "sinks")),
        ("bwd", ("window", "window2", "softcap")),
    ):
        names = {cfg["name"] for cfg in AUDITED[part][1]}
        for feature in features:
            assert any(f"_{feature}_runs" in n and not n.endswith("_overflow") for n in names), (
                part,
                feature,
            )
            assert any(f"_{feature}_runs" in n and n.endswith("_overflow") for n in names), (part, feature)
    sm80 = {c["name"]: c for c in variants.attention_fwd_variants(80)}
    sm90 = {c["name"]: c for c in variants.attention_fwd_variants(90)}
    assert sm80.keys() == sm90.keys()
    window = "attn_fwd_bf16_d128_causal_window_runs"
    cuda = torch.device("cuda")
    for arch, table in ((80, sm80), (90, sm90)):
        want = attention_common.fwd_config(128, cuda, torch.bfloat16, capability=arch, window=True)
        got = table[window]
        assert (got["constexprs"]["BLOCK_N"], got["num_stages"]) == (want["BLOCK_N"], want["num_stages"])
        tail = table[window + "_overflow"]
        assert tail["constexprs"]["BLOCK_M"] == want["BLOCK_M"]  # the tail starts where the main grid ends
        assert (tail["constexprs"]["BLOCK_N"], tail["num_stages"]) == (
            want["overflow"]["BLOCK_N"],
            want["overflow"]["num_stages"],
        )
