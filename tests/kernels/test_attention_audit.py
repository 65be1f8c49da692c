"""The attention kernels in ``python -m mmbalance.bench.kernel_audit``: registered (bf16 at head dims 64 and
128, float32 at 128), and tensor cores without spills when compiled for sm_90 at head dim 128 (the
tightest register budget)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

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
def test_attention_kernels_use_tensor_cores_without_spills(tmp_path):
    """A fresh process (the audit needs compilable, not interpreted, kernels)."""
    out = tmp_path / "audit.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [
        sys.executable,
        "-m",
        "mmbalance.bench.kernel_audit",
        "--arch",
        "sm_90",
        "--only",
        "bf16_d128_causal",
        "--json",
        str(out),
    ]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads(out.read_text())["kernels"]
    assert {r["kernel"] for r in rows} == {"_attn_fwd_kernel", "_attn_bwd_dq_kernel", "_attn_bwd_dkdv_kernel"}
    for r in rows:
        assert r["tensor_cores"] in ("wgmma", "mma") and r["spill_bytes"] == 0 and r["local_bytes"] == 0, r
