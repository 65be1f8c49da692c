"""``pip install .`` into an environment that already has another torch keeps that torch.

A fresh virtual environment gets stand-ins of torch 2.11.0 and of the other runtime dependencies
(wheels of metadata only, written here: nothing of size is downloaded); then pip resolves the
checkout (``pip install --dry-run --report``: the metadata is prepared, nothing is installed) and
the report must install mmbalance alone. The same environment with a package that pins
``torch==2.13.0``, as this project's own metadata used to, would replace torch: the check can fail.
"""

from __future__ import annotations

import base64
import hashlib
import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STANDS_IN = {"torch": "2.11.0", "triton": "3.6.0", "numpy": "2.0.0", "matplotlib": "3.9.0"}

pytestmark = pytest.mark.slow


def stub_wheel(name: str, version: str, out: Path, body: str = "", console_scripts: str = "") -> Path:
    """A wheel of ``name`` ``version`` holding its metadata and a package whose ``__init__`` is
    ``__version__`` and ``body``; ``console_scripts``: lines ``cmd = module:function``."""
    dist = f"{name}-{version}.dist-info"
    files = {
        f"{name}/__init__.py": f'__version__ = "{version}"\n{body}',
        f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
        f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    if console_scripts:
        files[f"{dist}/entry_points.txt"] = f"[console_scripts]\n{console_scripts}\n"

    def record(text: str) -> str:
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        return f"sha256={digest},{len(text.encode())}"

    files[f"{dist}/RECORD"] = "".join(f"{p},{record(c)}\n" for p, c in files.items()) + f"{dist}/RECORD,,\n"
    path = out / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for p, c in files.items():
            z.writestr(p, c)
    return path


def copy_tree(dst: Path) -> Path:
    """The checkout's tracked and new files (nothing ignored, no build output) under ``dst``."""
    names = subprocess.run(["git", "ls-files", "-z", "-co", "--exclude-standard"], cwd=ROOT, check=True,
                           capture_output=True).stdout.split(b"\0")  # fmt: skip
    for raw in filter(None, names):
        src = ROOT / raw.decode()
        if src.is_file():
            target = dst / raw.decode()
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(src.read_bytes())
    return dst


def dry_run(python: Path, target: Path, report: Path) -> list[str]:
    """The distributions ``pip install target`` would install, by name."""
    done = subprocess.run(
        [str(python), "-m", "pip", "install", "--dry-run", "--quiet", "--report", str(report), str(target)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    if done.returncode and any(
        words in done.stderr
        for words in ("No matching distribution found", "Could not fetch", "NewConnectionError")
    ):  # the build's own requirements (setuptools, wheel, pybind11) come from the package index
        pytest.skip(f"the package index is out of reach: {done.stderr.strip().splitlines()[-1]}")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return [item["metadata"]["name"].lower() for item in json.loads(report.read_text())["install"]]


@pytest.fixture(scope="module")
def env_with_torch_211(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("packaging")
    subprocess.run([sys.executable, "-m", "venv", str(tmp / "venv")], check=True, timeout=300)
    python = tmp / "venv" / "bin" / "python"
    wheels = [stub_wheel(n, v, tmp) for n, v in STANDS_IN.items()]
    subprocess.run([str(python), "-m", "pip", "install", "--quiet", "--no-index", "--no-deps", *map(str, wheels)],
                   check=True, timeout=300)  # fmt: skip
    torch_version = subprocess.run([str(python), "-c", "import torch; print(torch.__version__)"],
                                   capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    assert torch_version == "2.11.0"  # the stand-in is what the environment imports
    return python


def test_installing_the_checkout_keeps_the_torch_it_finds(env_with_torch_211, tmp_path):
    tree = copy_tree(tmp_path / "src")
    installs = dry_run(env_with_torch_211, tree, tmp_path / "report.json")
    assert installs == ["mmbalance"], installs


def test_a_pinned_torch_would_be_replaced(env_with_torch_211, tmp_path):
    """The control: a package that pins torch==2.13.0 makes pip install that torch over 2.11."""
    pkg = tmp_path / "pinned"
    pkg.mkdir()
    (pkg / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["setuptools>=69"]\nbuild-backend = "setuptools.build_meta"\n'
        '[project]\nname = "pins-torch"\nversion = "0.0.1"\ndependencies = ["torch==2.13.0"]\n'
        "[tool.setuptools]\npy-modules = []\n"
    )
    installs = dry_run(env_with_torch_211, pkg, tmp_path / "report.json")
    assert "torch" in installs, installs
