"""The attention kernels in ``python -m mmbalance.bench.kernel_audit``: registered (bf16 at head dims 64 and
128, float32 at 128, and at 128 the window, softcap and sinks variants), and tensor cores without
spills when compiled for sm_90 and sm_80 at head dim 128 (the tightest register budget)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mmbalance.bench import kernel_audit
from mmbalance.kernels import _attention_bwd_dkdv, attention, attention_bwd, merge

REPO = Path(__file__).resolve().parents[2]


def test_every_attention_kernel_is_registered_at_both_head_dims():
    assert hasattr(attention_bwd, "_attn_bwd_dkdv_kernel") and _attention_bwd_dkdv  # the dk/dv part
    for module in (attention, attention_bwd, merge):
        kernels = {
            n for n, obj in vars(module).items() if n.endswith("_kernel") and hasattr(obj, "arg_names")
        }
        # defined in the module or in its private parts (kernels/_attention_bwd_dkdv.py)
        own = {module.__name__, module.__name__.replace(".attention_bwd", "._attention_bwd_dkdv")}
        kernels = {n for n in kernels if getattr(module, n).__module__ in own}
        audited = {cfg["kernel"].__name__ for cfg in module.AUDIT_CONFIGS}
        assert kernels == audited, module.__name__
        for cfg in module.AUDIT_CONFIGS:
            assert cfg["expect"]["spill_bytes"] == 0
            tensor_cores = (
                "preprocess" not in cfg["name"] and "fp32" not in cfg["name"] and module is not merge
            )
            assert cfg["expect"].get("mma", False) == tensor_cores, cfg["name"]
        dims = {cfg["constexprs"]["HEAD_DIM"] for cfg in module.AUDIT_CONFIGS}
        assert dims == {64, 128}
    configs, errors = kernel_audit.discover("attn")
    assert not [e for e in errors if "attention" in e["name"] or "merge" in e["name"]]
    assert len(configs) == len(attention.AUDIT_CONFIGS) + len(attention_bwd.AUDIT_CONFIGS) + len(
        merge.AUDIT_CONFIGS
    )


@pytest.mark.slow
@pytest.mark.skipif(kernel_audit._ptxas(90) is None, reason="no ptxas (Triton's bundled one or on PATH)")
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
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads(out.read_text())["kernels"]
    assert {r["kernel"] for r in rows} == {"_attn_fwd_kernel", "_attn_bwd_dq_kernel", "_attn_bwd_dkdv_kernel"}
    assert any(r["name"].endswith("_overflow") for r in rows) and len(rows) >= 6
    for r in rows:
        assert r["tensor_cores"] in ("wgmma", "mma") and r["spill_bytes"] == 0 and r["local_bytes"] == 0, r


def test_feature_variants_are_audited_per_architecture():
    """Windows (causal and two-sided), softcap and sinks are in the audit with their overflow
    tails, and each architecture's entries carry the configuration the launcher picks there."""
    for module, features in ((attention, ("window", "window2", "softcap", "sinks")),
                             (attention_bwd, ("window", "window2", "softcap"))):  # fmt: skip
        names = {cfg["name"] for cfg in module.AUDIT_CONFIGS}
        for feature in features:
            assert any(f"_{feature}_runs" in n and not n.endswith("_overflow") for n in names), (
                module,
                feature,
            )
            assert any(f"_{feature}_runs" in n and n.endswith("_overflow") for n in names), (module, feature)
    sm80 = {c["name"]: c for c in attention.audit_configs(80)}
    sm90 = {c["name"]: c for c in attention.audit_configs(90)}
    assert sm80.keys() == sm90.keys()
    window = "attn_fwd_bf16_d128_causal_window_runs"
    cuda = torch.device("cuda")
    for arch, table in ((80, sm80), (90, sm90)):
        want = attention.fwd_config(128, cuda, torch.bfloat16, capability=arch, window=True)
        got = table[window]
        assert (got["constexprs"]["BLOCK_N"], got["num_stages"]) == (want["BLOCK_N"], want["num_stages"])
        tail = table[window + "_overflow"]
        assert tail["constexprs"]["BLOCK_M"] == want["BLOCK_M"]  # the tail starts where the main grid ends
        assert (tail["constexprs"]["BLOCK_N"], tail["num_stages"]) == (
            want["overflow"]["BLOCK_N"],
            want["overflow"]["num_stages"],
        )
