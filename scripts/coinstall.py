"""Can ``mmbalance[hf]`` be installed beside the trainers people fine-tune multimodal models with?

    python scripts/coinstall.py [--torch 2.13.0] [TRAINER==VERSION ...]

For each trainer (default: llamafactory 0.9.5, verl 0.9.1, axolotl 0.19.0, ms-swift 4.6.0) pip
resolves, without installing anything (``pip install --dry-run --report``), in a fresh virtual
environment that holds ``--torch``:

1. the trainer alone: the torch it keeps or asks for, and the transformers it takes;
2. this checkout with the ``hf`` extra beside the trainer, with the trainer's torch pinned: whether
   that resolves, and the transformers it takes.

A row resolves when step 2 does: adding ``mmbalance[hf]`` changes neither the trainer's torch nor
its transformers range. Prints a Markdown table (the README's "Installing beside the trainers");
exits 1 when a row does not resolve. Needs the package index (downloads metadata only, where the
index serves it).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import venv
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TRAINERS = ["llamafactory==0.9.5", "verl==0.9.1", "axolotl==0.19.0", "ms-swift==4.6.0"]


def _pip(env: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(env / "bin" / "python"), "-m", "pip", *args], capture_output=True, text=True)


def _resolve(env: Path, report: Path, *reqs: str) -> tuple[dict[str, str] | None, str]:
    """``{name: version}`` pip would install for ``reqs`` (None and pip's last words when it cannot)."""
    run = _pip(env, "install", "--dry-run", "--quiet", "--report", str(report), *reqs)
    if run.returncode != 0:
        lines = [x for x in (run.stderr or run.stdout).splitlines() if x.strip() and "WARNING" not in x]
        return None, " ".join(lines[-3:])[:300]
    data = json.loads(report.read_text())
    return {i["metadata"]["name"].lower(): i["metadata"]["version"] for i in data["install"]}, ""


def _installed(env: Path, name: str) -> str | None:
    run = _pip(env, "show", name)
    for line in run.stdout.splitlines():
        if line.startswith("Version:"):
            return line.split(":", 1)[1].strip()
    return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "trainers", nargs="*", default=TRAINERS, help="trainer requirements (default: %(default)s)"
    )
    ap.add_argument(
        "--torch", default="2.13.0", help="the torch the environment holds (default: %(default)s)"
    )
    args = ap.parse_args()
    rows, failed = [], False
    with tempfile.TemporaryDirectory() as tmp:
        env = Path(tmp) / "env"
        venv.create(env, with_pip=True)
        _pip(env, "install", "--quiet", "--upgrade", "pip")
        run = _pip(env, "install", "--quiet", f"torch=={args.torch}")
        if run.returncode != 0:
            print(run.stderr[-2000:], file=sys.stderr)
            return 2
        here = _installed(env, "torch")
        for trainer in args.trainers:
            alone, why = _resolve(env, Path(tmp) / "alone.json", trainer)
            if alone is None:
                rows.append((trainer, "-", "-", "-", f"the trainer alone does not resolve: {why}"))
                failed = True
                continue
            torch = alone.get("torch", here)
            kept = "kept" if torch == here else f"asks for {torch}"
            both, why = _resolve(env, Path(tmp) / "both.json", f"{REPO}[hf]", trainer, f"torch=={torch}")
            tf_alone = alone.get("transformers", _installed(env, "transformers") or "-")
            if both is None:
                rows.append((trainer, f"{torch} ({kept})", tf_alone, "-", f"no: {why}"))
                failed = True
                continue
            ok = both.get("torch", here) == torch
            failed |= not ok
            rows.append(
                (trainer, f"{torch} ({kept})", tf_alone, both.get("transformers", "-"), "yes" if ok else "no")
            )
    print(
        f"| trainer | torch (environment: {args.torch}) | transformers, trainer alone | transformers, with mmbalance[hf] | resolves |"
    )
    print("| --- | --- | --- | --- | --- |")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
