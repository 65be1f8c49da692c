"""The README's "API in ten lines" block runs as written, on two gloo ranks: its loss and gradients
are the unbalanced ones, and under ``torchrun`` every run exits with code 0."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from mmbalance.bench.processes import describe_exit
from tests.dist_utils import run_distributed

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
pytestmark = pytest.mark.distributed

VOCAB, HIDDEN = 7, 4


def readme_block(section: str) -> str:
    text = README.read_text()
    start = text.index(f"## {section}")
    return re.search(r"```python\n(.*?)```", text[start:], re.S).group(1)


def _data(rank: int):
    import torch

    g = torch.Generator().manual_seed(100 + rank)
    n = 6 if rank == 0 else 2  # rank 0 has far more work: the plan must move some of it
    seq = torch.randint(1, 40 if rank == 0 else 5, (n,), generator=g)
    cu = torch.zeros(n + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(seq, 0)
    tokens = torch.randn(int(cu[-1]), HIDDEN, dtype=torch.float64, generator=g)
    labels = torch.randint(0, VOCAB, (int(cu[-1]),), generator=g)
    return tokens, labels, cu


def _weight():
    import torch

    return torch.linspace(-1.0, 1.0, HIDDEN * VOCAB, dtype=torch.float64).reshape(HIDDEN, VOCAB)


def _run_block(rank: int, world: int, code: str):
    import torch
    import torch.distributed as dist

    tokens, labels, cu_seqlens = _data(rank)
    tokens.requires_grad_(True)
    home = tokens
    weight = _weight().requires_grad_(True)

    def model(x, cu):
        assert cu.dtype == torch.int32 and int(cu[-1]) == x.shape[0]
        return x @ weight

    scope = dict(tokens=tokens, labels=labels, cu_seqlens=cu_seqlens, model=model)
    exec(compile(code, str(README), "exec"), scope)  # noqa: S102 - the README's own code
    total = scope["loss"].detach().clone()
    dist.all_reduce(total)
    grad_w = weight.grad.clone()
    dist.all_reduce(grad_w)
    moved = int(scope["plan"].moved().sum())
    return float(total), moved, int(scope["tokens"].shape[0]), grad_w.numpy(), home.grad.numpy()


def _reference():
    """Every rank's tokens, unmoved, the same per-token loss, normalized by the global token count."""
    import torch

    parts = [_data(r) for r in range(2)]
    count = sum(t.shape[0] for t, _, _ in parts)
    weight = _weight().requires_grad_(True)
    xs = [t.clone().requires_grad_(True) for t, _, _ in parts]
    loss = (
        sum(
            torch.nn.functional.cross_entropy(x @ weight, y, reduction="sum")
            for x, (_, y, _) in zip(xs, parts)
        )
        / count
    )
    loss.backward()
    return float(loss.detach()), weight.grad.numpy(), [x.grad.numpy() for x in xs], parts


def test_readme_api_block_runs_and_keeps_the_loss_and_gradients():
    code = readme_block("API in ten lines")
    assert 'reduction="none"' in code  # a copy of the block must not average per rank
    got = run_distributed(_run_block, 2, code)
    ref, ref_grad_w, ref_grad_x, parts = _reference()
    for rank, (total, moved, _, grad_w, grad_x) in enumerate(got):
        assert total == pytest.approx(ref, rel=1e-12)
        assert moved > 0  # the block did balance something
        np.testing.assert_allclose(grad_w, ref_grad_w, rtol=1e-12, atol=1e-15)
        np.testing.assert_allclose(grad_x, ref_grad_x[rank], rtol=1e-12, atol=1e-15)
    sizes = np.array([g[2] for g in got])
    before = np.array([p[0].shape[0] for p in parts])
    assert sizes.sum() == before.sum() and sizes.max() < before.max()


# ----------------------------------------------------------------------------- exit under torchrun
# The block is the script's last work: its final collectives (the backward all-to-all) end right
# before the interpreter finalizes. Each rank is pinned to one core and keeps the GIL for as long
# as it runs Python, so a backend worker thread that still held a collective's tensors then would
# free them during finalization and abort the process; before collectives waited for the backend
# to let go, this setup aborted in about three runs of four.
SCRIPT = """
import os, sys
cpus = sorted(os.sched_getaffinity(0))
os.sched_setaffinity(0, {{cpus[int(os.environ["RANK"]) % len(cpus)]}})
sys.setswitchinterval(100)
with open(os.path.join({pids!r}, os.environ["RANK"]), "w") as f:
    f.write(str(os.getpid()))
import torch
import torch.distributed as dist
sys.path.insert(0, {repo!r})
from tests.e2e.test_readme import _data, _weight
dist.init_process_group("gloo")
tokens, labels, cu_seqlens = _data(dist.get_rank())
weight = _weight().requires_grad_(True)
model = lambda x, cu: x @ weight
{block}
print(f"rank {{dist.get_rank()}} loss {{float(loss.detach())!r}}", flush=True)
"""

RUNS = 4


def _torchrun(script: Path, pids: Path, timeout: float = 120.0) -> tuple[int, str]:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        str(script),
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen(
        cmd,
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        # torchrun's workers live in sessions of their own: kill them by the pids they wrote
        os.killpg(proc.pid, signal.SIGKILL)
        for f in pids.iterdir():
            try:
                os.kill(int(f.read_text()), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
        try:
            out, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:  # a worker that wrote no pid still holds the pipe
            proc.kill()
            out = ""
        return -999, out
    return proc.returncode, out


@pytest.mark.slow
def test_readme_block_exits_cleanly_under_torchrun_every_time():
    block = readme_block("API in ten lines")
    with tempfile.TemporaryDirectory() as tmp:
        pids = Path(tmp) / "pids"
        pids.mkdir()
        script = Path(tmp) / "readme_block.py"
        script.write_text(SCRIPT.format(pids=str(pids), repo=str(REPO), block=textwrap.dedent(block)))
        ref = _reference()[0]
        for run in range(RUNS):
            t0 = time.monotonic()
            code, out = _torchrun(script, pids)
            assert code == 0, (
                f"run {run + 1} of {RUNS}: torchrun {describe_exit(code) if code != -999 else 'hung'} "
                f"after {time.monotonic() - t0:.0f}s:\n{out[-3000:]}"
            )
            per_rank = dict(re.findall(r"rank (\d) loss (\d+\.\d+(?:e-?\d+)?)", out))
            assert sorted(per_rank) == ["0", "1"], out[-3000:]
            assert sum(float(v) for v in per_rank.values()) == pytest.approx(ref, rel=1e-12)
