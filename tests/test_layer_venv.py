"""``scripts/layer_venv.py``, which the Makefile uses to build the test matrix's and the framework
tests' environments on a shared base: the layered environment sees the base's packages after its
own, pip in it installs only what the base does not satisfy (and that copy wins), and the base's
console scripts run with the layered environment's interpreter (LLaMA-Factory starts ``torchrun``
from ``PATH``: its workers must see the framework, which only the layered environment holds).

Packages are stand-ins written here (tests/test_packaging.py's ``stub_wheel``): nothing is
downloaded.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests import procs
from tests.test_packaging import stub_wheel

ROOT = Path(__file__).resolve().parents[1]
LAYER = ROOT / "scripts" / "layer_venv.py"
WHERE = (
    "import sys\ndef main():\n    print('PREFIX', sys.prefix, 'VERSION', __version__, 'ARGV', sys.argv[1:])\n"
)

pytestmark = pytest.mark.slow


def run(*cmd, check=True) -> subprocess.CompletedProcess:
    done = procs.run([str(c) for c in cmd], timeout=600)
    if check:
        assert done.returncode == 0, done.stdout + done.stderr
    return done


def pip_install(python: Path, wheels: Path, *reqs: str) -> str:
    return run(python, "-m", "pip", "install", "--no-index", "--find-links", wheels, *reqs).stdout


@pytest.fixture(scope="module")
def envs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("layer")
    wheels = tmp / "wheels"
    wheels.mkdir()
    stub_wheel("basetool", "1.0", wheels, WHERE, "basetool = basetool:main\nbasetool-again = basetool:main")
    stub_wheel("shadowed", "1.0", wheels, WHERE)
    stub_wheel("shadowed", "2.0", wheels, WHERE)
    base, new = tmp / "base", tmp / "new"
    for venv in (base, new):
        run(sys.executable, "-m", "venv", venv)
    pip_install(base / "bin" / "python", wheels, "basetool==1.0", "shadowed==1.0")
    return base, new, wheels


def test_a_layered_environment_sees_the_base_installs_only_what_differs_and_runs_its_scripts(envs):
    base, new, wheels = envs
    python = new / "bin" / "python"
    said = run(python, LAYER, new, base).stdout
    assert "2 console scripts wrapped" in said, said
    # the base's packages are found, after the environment's own
    assert run(python, "-c", "import basetool; print(basetool.__version__)").stdout.strip() == "1.0"
    out = pip_install(python, wheels, "basetool", "shadowed==2.0")
    assert "Requirement already satisfied: basetool" in out, out
    assert "Successfully installed shadowed-2.0" in out and "basetool-" not in out.split("Successfully")[1], (
        out
    )
    code = "import shadowed, basetool; print(shadowed.__version__, shadowed.__file__, basetool.__file__)"
    version, shadowed_at, tool_at = run(python, "-c", code).stdout.split()
    assert version == "2.0" and shadowed_at.startswith(str(new)) and tool_at.startswith(str(base))
    # the base itself is untouched
    assert (
        run(base / "bin" / "python", "-c", "import shadowed; print(shadowed.__version__)").stdout.strip()
        == "1.0"
    )
    # the base's console scripts run with this environment's interpreter, arguments passed on
    for name in ("basetool", "basetool-again"):
        out = run(new / "bin" / name, "a", "--b").stdout.split()
        assert out == ["PREFIX", str(new), "VERSION", "1.0", "ARGV", "['a',", "'--b']"], out
    # a script the environment has of its own is left alone
    own = new / "bin" / "basetool"
    own.write_text("#!/bin/sh\necho OWN\n")
    run(python, LAYER, new, base)
    assert run(own).stdout.strip() == "OWN"


def test_layering_refuses_the_wrong_interpreter_and_a_base_that_is_no_environment(envs, tmp_path):
    base, new, _ = envs
    done = run(base / "bin" / "python", LAYER, new, base, check=False)
    assert done.returncode != 0 and f"run it with {new}/bin/python" in done.stderr
    done = run(new / "bin" / "python", LAYER, new, tmp_path, check=False)
    assert done.returncode != 0 and "0 site-packages folders" in done.stderr
    done = run(new / "bin" / "python", LAYER, new, check=False)
    assert done.returncode != 0 and "usage:" in done.stderr
