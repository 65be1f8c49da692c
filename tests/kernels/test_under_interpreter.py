"""Runs the kernel test files under the Triton interpreter in a fresh process.

``TRITON_INTERPRET`` is read when ``@triton.jit`` runs (and by ``kernels/_launch.py`` at import), so
one process can only be in one mode. The ordinary test process stays without the interpreter, so
``tests/pyops`` covers the CPU reference path; this test re-runs each kernel test file with
``TRITON_INTERPRET=1`` so the same ``pytest tests`` run also executes the real kernel code on CPU
tensors. It skips itself when the kernels already run in-process (interpreter set for the whole
run, or a CUDA device).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

from mmbalance.kernels import _launch
from tests import procs

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.skipif(
    _launch.INTERPRET or torch.cuda.is_available(),
    reason="the kernel tests run in this process (TRITON_INTERPRET=1 or CUDA)",
)
@pytest.mark.parametrize(
    "kernel_tests",
    [
        "kernels/test_varlen_kernels.py",
        "kernels/test_attention_kernels.py",
        "kernels/test_attention_features.py",
        "kernels/test_attention_tiles.py",
        "pyops/test_attention_op_features_triton.py",
        "kernels/test_delta_rule_kernel.py",
    ],
)
def test_kernels_under_interpreter(kernel_tests):
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONDONTWRITEBYTECODE="1")
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-x",
        "-rs",
        "-p",
        "no:cacheprovider",
        f"tests/{kernel_tests}",
    ]
    proc = procs.run(cmd, cwd=REPO, env=env, timeout=840)
    tail = (proc.stdout + proc.stderr)[-6000:]
    assert proc.returncode == 0, f"interpreter run failed (rc={proc.returncode}):\n{tail}"
    # the kernels must really have run, not skipped for want of the interpreter
    assert " passed" in proc.stdout and "kernels need TRITON_INTERPRET" not in proc.stdout, tail
