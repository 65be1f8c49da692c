"""``mmbalance launch`` as users type it: ``-- python script.py``, ``-- python -m module``,
``-- python -c CODE``, an interpreter's path, each with its exit status; a missing file, module (at
any depth) or interpreter exits 127 with a message; a transformers below the floor exits 2 before
the program starts; a program that builds no ``transformers.Trainer`` gets one line at the end."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from mmbalance.integrations import launch
from tests import procs

REPO = Path(__file__).resolve().parents[2]
NOTHING = "the program built no transformers Trainer, so nothing was balanced"


def _mmbalance(*args: str, cwd=REPO, env=None):
    env = {k: v for k, v in (env or os.environ).items() if not k.startswith("MMBALANCE_")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    code = "import sys; from mmbalance.cli import main; sys.exit(main(sys.argv[1:]))"
    return procs.run([sys.executable, "-c", code, "launch", *args], cwd=cwd, env=env, timeout=300)


@pytest.fixture(scope="module")
def scripts(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("forms")
    (tmp / "prog.py").write_text(
        "import os, sys\nprint('ARGV', sys.argv[1:], bool(os.environ.get('MMBALANCE_LAUNCH')))\nsys.exit(7)\n"
    )
    pkg = tmp / "pkg_here"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "mod.py").write_text("import sys\nprint('MODULE', sys.argv[1:])\nsys.exit(3)\n")
    # a program that builds a Trainer: the switch comes on in its process, no "nothing" line
    (tmp / "trainer_prog.py").write_text(
        "import transformers\n"
        "from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments\n"
        "cfg = LlamaConfig(vocab_size=32, hidden_size=8, intermediate_size=16, num_hidden_layers=1,\n"
        "                  num_attention_heads=2, num_key_value_heads=1)\n"
        "args = TrainingArguments(output_dir='out', use_cpu=True, report_to=[])\n"
        "Trainer(model=LlamaForCausalLM(cfg), args=args)\n"
        "print('BUILT')\n"
    )
    return tmp


@pytest.mark.slow
@pytest.mark.parametrize("python", ["python", "path"], ids=["python-on-PATH", "interpreter-path"])
def test_python_forms_run_the_program_with_its_status(scripts, python):
    interp = "python" if python == "python" else sys.executable
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    done = _mmbalance("--", interp, "-u", str(scripts / "prog.py"), "a", "b", env=env)
    assert done.returncode == 7 and "ARGV ['a', 'b'] True" in done.stdout, done.stderr
    assert NOTHING in done.stderr  # it built no Trainer
    done = _mmbalance("--", interp, "-m", "pkg_here.mod", "x", cwd=scripts, env=env)
    assert done.returncode == 3 and "MODULE ['x']" in done.stdout, done.stderr
    done = _mmbalance(
        "--", interp, "-c", "import sys; print('CODE', sys.argv[1:]); sys.exit(5)", "y", env=env
    )
    assert done.returncode == 5 and "CODE ['y']" in done.stdout, done.stderr
    done = _mmbalance("--", interp, str(scripts / "trainer_prog.py"), cwd=scripts, env=env)
    assert done.returncode == 0 and "BUILT" in done.stdout, done.stderr
    assert NOTHING not in done.stderr, done.stderr


def test_what_is_missing_exits_127_with_a_message(scripts):
    cases = [
        (["python", str(scripts / "missing.py")], "missing.py: no such Python file"),
        ([sys.executable, "-m", "pkg_here.missing"], "-m pkg_here.missing: no module of that name"),
        ([sys.executable, "-m", "no_such_top.deeper.module"], "no module of that name"),
        (["-m", "pkg_here.missing"], "pkg_here.missing: no console script, Python file or module"),
        (["-m", "no_such_top_module"], "no console script, Python file or module"),
        (["python3.99"], "python3.99: no such Python interpreter"),
        ([str(scripts / "no" / "python")], "no such Python interpreter"),
    ]
    for program, words in cases:
        done = _mmbalance("--", *program, cwd=scripts)
        assert done.returncode == 127, (program, done.returncode, done.stderr)
        assert words in done.stderr and "Traceback" not in done.stderr, (program, done.stderr)
    done = _mmbalance("--", sys.executable, "-m", cwd=scripts)
    assert done.returncode == 2 and "-m: the option needs an argument" in done.stderr, done.stderr


def test_the_module_form_in_process_still_runs_any_depth(scripts):
    done = _mmbalance("--", "-m", "pkg_here.mod", "z", cwd=scripts)
    assert done.returncode == 3 and "MODULE ['z']" in done.stdout, done.stderr


def test_options_of_the_interpreter_are_read_past(scripts):
    target = launch._python_target
    assert target(["-u", "-X", "dev", "-W", "ignore", "s.py", "a"]) == (
        "script", "s.py", ["-u", "-X", "dev", "-W", "ignore"]
    )  # fmt: skip
    assert target(["-Bm", "pkg.mod", "x"]) == ("-m", "pkg.mod", ["-B"])
    assert target(["-mpkg.mod"]) == ("-m", "pkg.mod", [])
    assert target(["-c", "print(1)"]) == ("-c", "print(1)", [])
    assert target(["-Xfrozen_modules=off", "-"]) == ("stdin", None, ["-Xfrozen_modules=off"])
    assert target(["-u"]) == ("repl", None, ["-u"])
    assert launch._interpreter("python3.12") in ("", launch.shutil.which("python3.12"))
    assert launch._interpreter("torchrun") is None and launch._interpreter("pythonic") is None


def test_a_transformers_below_the_floor_stops_before_the_program(monkeypatch, capsys, tmp_path):
    ran = tmp_path / "ran"
    script = tmp_path / "p.py"
    script.write_text(f"open({str(ran)!r}, 'w').close()\n")
    monkeypatch.setattr(launch, "_installed_transformers", lambda: "5.5.4")
    assert launch.main(["--", str(script)]) == 2
    err = capsys.readouterr().err
    assert "transformers 5.5.4 is older than the releases the launch balances (5.6 to the newest)" in err
    assert not ran.exists(), "the program ran"
    monkeypatch.setattr(launch, "_installed_transformers", lambda: None)
    assert launch.main(["--", str(script)]) == 2
    assert "transformers is not installed" in capsys.readouterr().err
    assert launch._floor_refusal("5.6.0") is None and launch._floor_refusal("5.10.4") is None
    assert "older" in launch._floor_refusal("4.57.1")


def test_the_floor_is_the_integrations_floor():
    from mmbalance.integrations.hf.compat import TRANSFORMERS_FLOOR

    assert launch.FLOOR == TRANSFORMERS_FLOOR
