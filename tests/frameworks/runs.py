"""What the framework tests share: the frameworks' environments (``make test-frameworks`` builds
``.venv-llamafactory`` and ``.venv-swift``), a tiny Qwen2-VL and a dataset made in them, runs on 2
CPU ranks with a time limit, and the comparison of their saved weights and logs.

pytest runs in the project's environment; every framework command runs in the framework's own
(its ``bin`` first on ``PATH``: LLaMA-Factory starts a bare ``torchrun``), offline.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
from pathlib import Path

import pytest

from tests import procs

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
RUN_TIMEOUT = 600  # seconds a 2-rank run of a few steps may take (they take 20 to 60 here)


def venv(name: str) -> Path:
    """The framework's environment, or a skip that says how to build it."""
    path = REPO / f".venv-{name}"
    if not (path / ".installed").exists():
        pytest.skip(f"{path.name} is not built: `make test-frameworks` builds it and runs these tests")
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def environment(env_dir: Path, **extra: str) -> dict[str, str]:
    """The framework's environment variables: its ``bin`` first, offline, one thread per rank."""
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("MMBALANCE_", "PYTHONPATH", "VIRTUAL_ENV"))
    }
    env.update(
        PATH=f"{env_dir / 'bin'}{os.pathsep}{env.get('PATH', '')}", VIRTUAL_ENV=str(env_dir), HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1", MODELSCOPE_OFFLINE="1", OMP_NUM_THREADS="1",
        TOKENIZERS_PARALLELISM="false", DISABLE_VERSION_CHECK="1", MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()), **extra,
    )  # fmt: skip
    return env


def run(cmd: list[str], env: dict[str, str], cwd: Path, log: Path) -> subprocess.CompletedProcess:
    """Run ``cmd`` (its output to ``log`` and returned), failing the test on the time limit."""
    try:
        done = procs.run(cmd, env=env, cwd=cwd, timeout=RUN_TIMEOUT)
    except AssertionError as exc:  # the time limit: what still ran, its stacks, the output's end
        log.write_text(str(exc))
        pytest.fail(f"{' '.join(cmd[:6])} ... ran past {RUN_TIMEOUT} s (output: {log})")
    log.write_text(f"$ {' '.join(cmd)}\n{done.stdout}\n{done.stderr}")
    return done


def make_model_and_data(env_dir: Path, where: Path) -> tuple[Path, Path]:
    """A tiny Qwen2-VL and the dataset, made with the framework's own transformers."""
    model, data = where / "model", where / "data"
    py = str(env_dir / "bin" / "python")
    env = environment(env_dir)
    for script, out in (("tiny_qwen2vl.py", model), ("tiny_data.py", data)):
        done = run([py, str(HERE / script), str(out)], env, where, where / f"{script}.log")
        assert done.returncode == 0, done.stderr[-3000:]
    return model, data


def load_weights(path: Path) -> dict:
    from safetensors.torch import load_file

    files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
    assert files, f"no safetensors in {path}"
    out = {}
    for f in files:
        out.update(load_file(str(f)))
    return out


# what the runs measured, printed at the end of the session (conftest.py): one line per balanced run
MEASURED: list[str] = []


def record(run: str, gap: float, keys: dict[str, list[float]]) -> None:
    """Keep ``run``'s weights gap and the balance its logs show for the session's summary."""
    before = keys.get("mmbalance/batches/cost_before", [])
    after = keys.get("mmbalance/batches/cost_after", [])
    moved = keys.get("mmbalance/vision/moved", [])
    degree = keys.get("mmbalance/cp/max_degree", [])
    logged = max(len(before), len(degree))
    line = f"{run}: weights {gap:.2e} of the change from the plain run's; {logged} logged intervals"
    if degree:
        line += f", CP degree up to {max(degree):.0f}"
    if before and after:
        line += f", batch cost max/mean before {max(before):.4g} after {max(after):.4g}"
    if moved:
        line += f", vision items encoded on another rank up to {max(moved):.0%} of a step's"
    MEASURED.append(line)


def tuned_weights_gap(plain_dir: Path, balanced_dir: Path, model_dir: Path, tuning: str) -> float:
    """The balanced run's trainable weights (saved in ``balanced_dir``) against the plain run's
    (``plain_dir``), relative to the plain run's change from the start (``model_dir``'s weights):
    the whole model for ``tuning == "full"``, else the LoRA adapters' ``B`` matrices, which start at
    zero (a stricter scale than the whole adapter's change)."""
    weights = "model.safetensors" if tuning == "full" else "adapter_model.safetensors"
    want = load_weights(plain_dir / weights)
    got = load_weights(balanced_dir / weights)
    start = load_weights(model_dir / "model.safetensors") if tuning == "full" else {}
    if tuning != "full":
        want = {k: v for k, v in want.items() if "lora_B" in k}
    return relative_change_gap(got, want, start)


def balanced_batches(keys: dict[str, list[float]]) -> bool:
    """Whether the logged keys show some step's worst rank made cheaper by balancing."""
    before = keys.get("mmbalance/batches/cost_before", [])
    return any(b > a for b, a in zip(before, keys.get("mmbalance/batches/cost_after", [])))


def relative_change_gap(got: dict, want: dict, start: dict) -> float:
    """``|got - want| / |want - start|`` over the tensors of ``want`` (``start`` missing a tensor:
    it started at zero, as LoRA's ``B`` does)."""
    import torch

    gap = change = 0.0
    for name, w in want.items():
        assert name in got, f"{name} missing from the balanced run's weights"
        s = start.get(name, torch.zeros_like(w))
        gap += float(((got[name].double() - w.double()) ** 2).sum())
        change += float(((w.double() - s.double()) ** 2).sum())
    assert change > 0, "the plain run did not change the weights"
    return (gap / change) ** 0.5


def log_rows(path: Path) -> list[dict]:
    """The ``log_history`` of a ``trainer_state.json``, or the rows of a ``.jsonl`` log."""
    if path.suffix == ".jsonl":
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return json.loads(path.read_text())["log_history"]


def balance_keys(rows: list[dict]) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {}
    for row in rows:
        for k, v in row.items():
            if k.startswith("mmbalance/"):
                out.setdefault(k, []).append(float(v))
    return out
