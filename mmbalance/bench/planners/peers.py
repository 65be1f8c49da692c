"""The benchmarks' peers, run in an environment of their own.

verl's Karmarkar-Karp balancer (``verl.utils.seqlen_balancing.karmarkar_karp``) is the peer of the
planner benchmark. Its pins (``transformers<5.11``) conflict with ours, so ``make peers`` installs
it, with only what its balancer module imports, into ``.venv-peers``, and the benchmark calls it in
a subprocess of that environment's Python: lengths go in as a ``.npy`` file, the partition comes
back as another, the peer's own timing as JSON. Where no such environment is found the benchmark
says so (printed, and a ``peers`` row in the JSON), never leaves the peer out silently.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile

import numpy as np

from ..harness import Row
from ..processes import child_dies_with_parent

# Runs in the peers' environment (``.venv-peers``): lengths in from a .npy file, destination ranks
# out to another, the peer's own times and version as JSON on stdout.
_PEER_SCRIPT = """
import importlib.metadata, json, sys, time
import numpy as np
from verl.utils.seqlen_balancing import karmarkar_karp
lengths_path, k, reps, out_path = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
lengths = np.load(lengths_path).tolist()
times = []
for _ in range(reps):
    t0 = time.perf_counter()
    parts = karmarkar_karp(lengths, k, False)
    times.append((time.perf_counter() - t0) * 1e3)
dst = np.full(len(lengths), -1, dtype=np.int64)
for rank, part in enumerate(parts):
    dst[part] = rank
np.save(out_path, dst)
print(json.dumps({"times_ms": times, "version": importlib.metadata.version("verl")}))
"""

PEERS_ENV = ".venv-peers"
PEERS_PYTHON_VAR = "MMBALANCE_PEERS_PYTHON"
# what verl's balancer module imports (the Makefile's peers target installs the same)
PEER_DEPS = "numpy packaging omegaconf 'tensordict>=0.8,<=0.10' 'transformers>=5.5.3,<5.11' ray"


def peer_python() -> tuple[str | None, str]:
    """The Python of the peers' environment, or ``None`` and why there is none.

    ``$MMBALANCE_PEERS_PYTHON`` if set, else ``.venv-peers/bin/python`` in the source tree this
    module runs from (``make peers`` creates it) or in the working directory. An installed wheel
    has no source tree, so there the peer is unavailable unless the variable names one.
    """
    named = os.environ.get(PEERS_PYTHON_VAR)
    if named:
        if os.path.isfile(named) and os.access(named, os.X_OK):
            return named, ""
        return None, f"{PEERS_PYTHON_VAR}={named} is not an executable file"
    # this file is <root>/mmbalance/bench/planners/peers.py
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    for base in dict.fromkeys((root, os.getcwd())):
        cand = os.path.join(base, PEERS_ENV, "bin", "python")
        if os.path.isfile(cand) and os.access(cand, os.X_OK):
            return cand, ""
    if os.path.isfile(os.path.join(root, "Makefile")) and os.path.isfile(
        os.path.join(root, "pyproject.toml")
    ):
        return None, f"no {PEERS_ENV} environment (`make peers` creates it) and {PEERS_PYTHON_VAR} is not set"
    return None, (
        f"verl is not set up: set {PEERS_PYTHON_VAR} to the python of an environment of its own with "
        f"`pip install torch==2.13.0 && pip install --no-deps verl==0.9.1 && pip install {PEER_DEPS}` "
        "(its pins conflict with ours)"
    )


def run_verl(python: str, lengths: np.ndarray, k: int, reps: int = 1, timeout: float = 900.0) -> dict:
    """verl's ``karmarkar_karp(lengths, k, equal_size=False)`` in a subprocess of ``python``.

    Returns ``{"dst": int64 [n] destination rank per example, "time_ms": median of the peer's own
    timing of ``reps`` calls (the subprocess's start and imports excluded), "version": verl's}``.
    Raises ``RuntimeError`` with the peer's last line of stderr if it fails.
    """
    with tempfile.TemporaryDirectory(prefix="mmbalance-peer-") as tmp:
        src, out = os.path.join(tmp, "lengths.npy"), os.path.join(tmp, "dst.npy")
        np.save(src, np.asarray(lengths, dtype=np.int64))
        try:
            res = subprocess.run(
                [python, "-c", _PEER_SCRIPT, src, str(k), str(reps), out],
                capture_output=True,
                text=True,
                timeout=timeout,
                cwd=tmp,  # never import this source tree's packages in the peer's interpreter
                preexec_fn=child_dies_with_parent(),
            )
        except (OSError, subprocess.SubprocessError) as exc:
            raise RuntimeError(f"{python}: {exc}") from exc
        if res.returncode != 0:
            lines = [ln for ln in res.stderr.splitlines() if ln.strip()] or [f"exit status {res.returncode}"]
            raise RuntimeError(lines[-1].strip())
        info = json.loads(res.stdout.strip().splitlines()[-1])
        dst = np.load(out)
    if dst.shape != (len(lengths),) or dst.min(initial=0) < 0 or dst.max(initial=0) >= k:
        raise RuntimeError("the peer returned an invalid partition")
    return {"dst": dst, "time_ms": float(np.median(info["times_ms"])), "version": info["version"]}


def peer_status_row(provider: str, shape: str, dev: str, python: str | None, why: str) -> Row:
    """A ``peers`` row: whether the peer ran (and from which interpreter) or why it did not. Printed
    too, so a table without the peer never passes for a complete one."""
    if python is None:
        print(f"({provider} not run at {shape}: {why})")
    return Row(
        "peers",
        provider,
        shape,
        "int64",
        dev,
        0.0,
        {"available": python is not None, "python": python or "", "reason": why},
    )
