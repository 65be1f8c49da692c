"""Launch every example script many times under torchrun and count the runs that hang or fail.

    python scripts/launch_loop.py [--runs 50] [--timeout 300] [--examples hf_trainer.py ...]
                                  [--modes balanced no-balance ...] [--budget-min 90] [--stacks DIR] [--json F]

Each launch is ``python -m torch.distributed.run --standalone --nproc-per-node N examples/<script>``
plus the mode's flags, from the repository root, with ``OMP_NUM_THREADS=1``. The examples, their
ranks and their modes (what their docstrings offer):

* ``hf_trainer.py``, 2 ranks: ``balanced`` (``balance_trainer``), ``no-balance`` (``--no-balance``);
* ``hf_qwen2vl.py``, 2 ranks: ``balanced`` (``apply_encoder_balance``), ``no-balance``;
* ``hf_qwen2vl_long.py``, 4 ranks: ``dynamic-cp`` (``apply_dynamic_cp``), ``encoder-balance``
  (``--encoder-balance``: the encoders balanced over the world too).

A launch is

* ``ok``: torchrun exited with code 0 within ``--timeout`` seconds;
* ``hang``: it did not (every process of the launch is then killed; with ``--stacks DIR`` the Python
  and native stacks of every worker still alive are written there first, by gdb when installed);
* ``fail``: torchrun exited with another code (its output's tail is kept).

Launches are interleaved (run 1 of every example and mode, then run 2 ...), so a time budget
(``--budget-min``) that stops the loop early still leaves every example and mode with about the same
number of runs; the report says exactly how many ran. The table is Markdown; ``--json`` keeps every
launch (time, outcome, output tail).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# example -> (ranks, {mode: flags})
EXAMPLES: dict[str, tuple[int, dict[str, list[str]]]] = {
    "hf_trainer.py": (2, {"balanced": [], "no-balance": ["--no-balance"]}),
    "hf_qwen2vl.py": (2, {"balanced": [], "no-balance": ["--no-balance"]}),
    "hf_qwen2vl_long.py": (4, {"dynamic-cp": [], "encoder-balance": ["--encoder-balance"]}),
}
MODES = sorted({m for _, modes in EXAMPLES.values() for m in modes})


def _children(pid: int) -> list[int]:
    """Every descendant of ``pid`` (from /proc), deepest last."""
    parent_of: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # the command name may hold spaces and parentheses: the fields after it start at the last ')'
        fields = stat[stat.rindex(")") + 2 :].split()
        parent_of[int(entry.name)] = int(fields[1])
    out, frontier = [], [pid]
    while frontier:
        nxt = [c for c, p in parent_of.items() if p in frontier]
        out.extend(nxt)
        frontier = nxt
    return out


def _stacks(pids: list[int], path: Path) -> None:
    """The native (gdb) and, when py-spy is installed, Python stacks of ``pids`` into ``path``."""
    gdb, pyspy = shutil.which("gdb"), shutil.which("py-spy")
    with path.open("w") as f:
        for pid in pids:
            f.write(f"===== pid {pid}\n")
            f.flush()
            if pyspy:
                subprocess.run([pyspy, "dump", "--native", "--pid", str(pid)], stdout=f, stderr=subprocess.STDOUT,
                               timeout=60, check=False)  # fmt: skip
            if gdb:
                subprocess.run([gdb, "-p", str(pid), "-batch", "-nx", "-ex", "set pagination off",
                                "-ex", "thread apply all bt 25"], stdout=f, stderr=subprocess.STDOUT,
                               timeout=120, check=False)  # fmt: skip
            if not (gdb or pyspy):
                f.write("neither gdb nor py-spy is installed: no stacks\n")


def launch(script: str, mode: str, timeout: float, stacks: Path | None, tag: str) -> dict:
    nproc, modes = EXAMPLES[script]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           str(REPO / "examples" / script), *modes[mode]]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)  # fmt: skip
    try:
        out, _ = proc.communicate(timeout=timeout)
        outcome = "ok" if proc.returncode == 0 else "fail"
    except subprocess.TimeoutExpired:
        outcome = "hang"
        alive = _children(proc.pid)
        if stacks is not None and alive:
            stacks.mkdir(parents=True, exist_ok=True)
            _stacks(alive, stacks / f"{tag}.txt")
        for pid in [proc.pid, *alive]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            out, _ = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:  # a process nobody found still holds the pipe
            out = ""
    return {"example": script, "mode": mode, "outcome": outcome, "returncode": proc.returncode,
            "seconds": round(time.monotonic() - t0, 2), "tail": out[-3000:]}  # fmt: skip


def report(rows: list[dict], configs: list[tuple[str, str]]) -> str:
    lines = ["| example | ranks | mode | launches | ok | hangs | failures | median s | max s (ok) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for script, mode in configs:
        mine = [r for r in rows if r["example"] == script and r["mode"] == mode]
        ok = [r["seconds"] for r in mine if r["outcome"] == "ok"]
        hangs = sum(r["outcome"] == "hang" for r in mine)
        fails = sum(r["outcome"] == "fail" for r in mine)
        med = f"{statistics.median(ok):.1f}" if ok else "-"
        mx = f"{max(ok):.1f}" if ok else "-"
        ranks = EXAMPLES[script][0]
        lines.append(
            f"| {script} | {ranks} | {mode} | {len(mine)} | {len(ok)} | {hangs} | {fails} | {med} | {mx} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=50, help="launches of every example and mode (default 50)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds before a launch counts as hung")
    p.add_argument("--examples", nargs="+", default=list(EXAMPLES), choices=list(EXAMPLES))
    p.add_argument(
        "--modes", nargs="+", default=None, choices=MODES, help="default: every mode of each example"
    )
    p.add_argument(
        "--budget-min", type=float, default=None, help="stop starting launches after this many minutes"
    )
    p.add_argument(
        "--stacks", type=Path, default=None, help="write the stacks of hung workers into this folder"
    )
    p.add_argument("--json", type=Path, default=None, help="write every launch here (JSON)")
    args = p.parse_args(argv)
    if args.runs < 1 or args.timeout <= 0:
        p.error("--runs and --timeout must be positive")
    for script in args.examples:
        if not (REPO / "examples" / script).is_file():
            p.error(f"--examples: no examples/{script}")
    configs = [(s, m) for s in args.examples for m in EXAMPLES[s][1] if args.modes is None or m in args.modes]
    if not configs:
        p.error(f"--modes: none of {args.modes} is a mode of {args.examples}")
    rows: list[dict] = []
    start = time.monotonic()
    stopped = False
    for run in range(args.runs):
        for script, mode in configs:
            if args.budget_min is not None and time.monotonic() - start > 60 * args.budget_min:
                stopped = True
                break
            row = launch(script, mode, args.timeout, args.stacks, f"{Path(script).stem}-{mode}-{run}")
            row["run"] = run
            rows.append(row)
            print(f"[{len(rows)}] {script} {mode} run {run + 1}: {row['outcome']} in {row['seconds']:.1f} s",
                  flush=True)  # fmt: skip
            if row["outcome"] != "ok":
                print(row["tail"][-1500:], flush=True)
            if args.json is not None:
                args.json.write_text(json.dumps(rows, indent=1))
        if stopped:
            break
    minutes = (time.monotonic() - start) / 60
    print(f"\n{len(rows)} launches in {minutes:.1f} min" + (" (stopped by --budget-min)" if stopped else ""))
    print(report(rows, configs))
    return 0 if all(r["outcome"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
