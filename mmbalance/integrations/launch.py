"""``mmbalance launch``: run a training program with every ``transformers.Trainer`` it builds balanced,
without editing it (LLaMA-Factory's ``llamafactory-cli``, ms-swift's ``swift``, a script).

    mmbalance launch [--no-encoders] [--no-batches [--token-mean-loss]]
                     [--context-parallel --max-tokens-per-rank N] -- PROGRAM [ARGS...]

PROGRAM runs in this process, as Python would run it: a console script (``llamafactory-cli``,
``swift``), a ``.py`` file, or ``-m module``; or, typed as one runs Python (``python train.py``,
``python -m pkg.train``, ``python -c CODE``, ``/path/to/python ...``), in that interpreter as a
child process, which balances itself as the program's other processes do. Its exit status is the
command's: 127 when there is no such program, file, module (at any depth) or interpreter, 2 when
the transformers where it runs is older than the releases the switch supports (before it starts).
A program that ends without having built a ``transformers.Trainer`` gets one line saying nothing
was balanced. The switch
(:func:`~mmbalance.integrations.hf.balance_every_trainer`) is set from the environment
(``MMBALANCE_LAUNCH``, the options as JSON) when transformers' ``trainer`` module is imported,
here and in every Python process the program starts: a ``sitecustomize`` module in a directory of
its own, first on ``PYTHONPATH``, reads the same variable (and runs the ``sitecustomize`` it
hides, if any). So a framework that starts its own workers (LLaMA-Factory's ``FORCE_TORCHRUN``,
ms-swift's ``NPROC_PER_NODE``: ``torchrun`` under them) has them balanced too. Each of those
processes also watches the process that started it and ends when that one does (SIGTERM, then
SIGKILL 10 s later), so however the command ends (SIGTERM, SIGKILL, a crash) none of its
workers is left running. A process that never
imports transformers' trainer is not touched (nothing is imported at its start but this module).

This module imports nothing of transformers or torch when it is imported: processes pay for the
switch only when they build a trainer.
"""

from __future__ import annotations

import argparse
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import re
import runpy
import shutil
import sys
import tempfile
import textwrap
import traceback
from importlib import metadata

__all__ = ["ENV", "install_from_environment", "main", "parser"]

#: the environment variable that carries the switch's options (JSON) to the program's processes
ENV = "MMBALANCE_LAUNCH"
_TRIGGER = "transformers.trainer"
NOT_FOUND = 127  # the exit status of a PROGRAM that is no console script, Python file or module

_BOOT = '''"""Written by `mmbalance launch`: every transformers Trainer this Python process builds is
balanced ({env} holds the options). Then the sitecustomize module this one hides, if any, runs."""

import os as _os
import sys as _sys


def _mmbalance_watch_parent():
    """This process ends with the one that started it, however that one ends (SIGTERM first, so a
    torchrun here stops its workers; SIGKILL 10 s later); a fork of it watches its own parent."""
    import signal as _signal
    import threading as _threading
    import time as _time

    parent = _os.getppid()
    if parent <= 1:
        return

    def watch():
        while True:
            _time.sleep(0.5)
            if _os.getppid() != parent:
                _os.kill(_os.getpid(), _signal.SIGTERM)
                _time.sleep(10)
                _os._exit(1)

    _threading.Thread(target=watch, name="mmbalance-parent-watch", daemon=True).start()


def _mmbalance_launch():
    if _os.environ.get("{env}"):
        _mmbalance_watch_parent()
        if hasattr(_os, "register_at_fork"):
            _os.register_at_fork(after_in_child=_mmbalance_watch_parent)
        try:
            from mmbalance.integrations.launch import install_from_environment
        except Exception as exc:  # a broken install must not stop the program
            _sys.stderr.write("mmbalance launch: this process is not balanced: %r\\n" % (exc,))
        else:
            install_from_environment()
    here = _os.path.dirname(_os.path.abspath(__file__))
    import importlib.machinery as _machinery
    import importlib.util as _util

    spec = _machinery.PathFinder.find_spec(
        "sitecustomize", [p for p in _sys.path if _os.path.abspath(p or ".") != here]
    )
    if spec is not None and spec.loader is not None:
        module = _util.module_from_spec(spec)
        spec.loader.exec_module(module)


_mmbalance_launch()
'''


def parser() -> argparse.ArgumentParser:
    """The command line of ``mmbalance launch``."""
    p = argparse.ArgumentParser(
        prog="mmbalance launch",
        usage="mmbalance launch [options] -- PROGRAM [ARGS...]",
        description=textwrap.fill(
            "Run PROGRAM (a console script such as llamafactory-cli or swift, a .py file, -m module, or python "
            "... as you would type it) with every transformers Trainer it builds balanced: the encoders of supported "
            "multimodal models (apply_encoder_balance), the per-rank batches (balance_trainer), the loss "
            "normalized by the step's global token count, and mmbalance/* keys in every Trainer.log call. "
            "Python processes the program starts (torchrun workers) are balanced too, and end with the process "
            "that started them. The exit status is PROGRAM's (127 when there is no such program, file, module or "
            "interpreter; 2 when transformers is older than the supported releases).",
            width=100,
        ),
        epilog="examples:\n"
        "  torchrun --nproc-per-node 8 --no-python mmbalance launch -- llamafactory-cli train config.yaml\n"
        "  FORCE_TORCHRUN=1 mmbalance launch -- llamafactory-cli train config.yaml\n"
        "  NPROC_PER_NODE=8 mmbalance launch -- swift sft --model ... --dataset ...\n"
        "  mmbalance launch -- python train.py --config c.yaml\n"
        "  mmbalance launch --context-parallel --max-tokens-per-rank 8192 -- python -m mypkg.train",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--no-encoders", action="store_true", help="leave the vision and audio encoders unbalanced"
    )
    p.add_argument(
        "--no-batches", action="store_true", help="leave the per-rank batches as the trainer draws them"
    )
    p.add_argument(
        "--token-mean-loss",
        action="store_true",
        help="with --no-batches: the loss over the step's global token count all the same, as balanced batches "
        "have it (SFT trainers only): the reference run a balanced run is compared with",
    )
    p.add_argument(
        "--context-parallel",
        action="store_true",
        help="dynamic context parallelism of any degree (needs --max-tokens-per-rank; the model runs the "
        "mmbalance_varlen attention)",
    )
    p.add_argument(
        "--max-tokens-per-rank",
        type=int,
        metavar="N",
        help="tokens one rank may hold in a forward (with --context-parallel)",
    )
    p.add_argument(
        "--cost", choices=("quadratic", "sum"), default="quadratic",
        help="the cost the batches are balanced on (default: %(default)s)",
    )  # fmt: skip
    p.add_argument("program", nargs=argparse.REMAINDER, metavar="-- PROGRAM [ARGS...]", help="what to run")
    return p


def _options(args: argparse.Namespace) -> dict:
    return {
        "encoders": not args.no_encoders,
        "batches": not args.no_batches,
        "context_parallel": bool(args.context_parallel),
        "max_tokens_per_rank": args.max_tokens_per_rank,
        "cost": args.cost,
        "token_mean_loss": bool(args.token_mean_loss),
    }


# ---------------------------------------------------------------------- when the trainer loads
class _Then(importlib.abc.Loader):
    """A loader that runs ``then()`` once the module it loads has run."""

    def __init__(self, loader, then):
        self.loader, self.then = loader, then

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        self.loader.exec_module(module)
        self.then()


class _WhenImported(importlib.abc.MetaPathFinder):
    """Runs ``then()`` right after the module ``name`` is first imported (then steps aside)."""

    def __init__(self, name: str, then):
        self.name, self.then, self.busy = name, then, False

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name or self.busy:
            return None
        self.busy = True
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self.busy = False
        if spec is None or spec.loader is None:
            return spec

        def then() -> None:
            if self in sys.meta_path:
                sys.meta_path.remove(self)
            self.then()

        spec.loader = _Then(spec.loader, then)
        return spec


def install_from_environment() -> None:
    """Switch :func:`~mmbalance.integrations.hf.balance_every_trainer` on with the options in
    ``MMBALANCE_LAUNCH``: now if transformers' trainer is loaded, else when it is (nothing is
    imported before). A bad variable is reported on stderr and leaves the process as it is."""
    text = os.environ.get(ENV)
    if not text:
        return
    try:
        options = json.loads(text)
        if not isinstance(options, dict):
            raise ValueError("not a JSON object")
    except ValueError as exc:
        sys.stderr.write(f"mmbalance launch: {ENV}={text!r} is not the options' JSON ({exc}); not balanced\n")
        return

    def switch_on() -> None:
        try:
            from .hf import balance_every_trainer

            handle = balance_every_trainer(**options)
        except Exception as exc:  # the program goes on as it is, and says so
            sys.stderr.write(f"mmbalance launch: this process is not balanced: {exc}\n")
            return
        handle.on_build.append(_note_trainer)

    if _TRIGGER in sys.modules:
        switch_on()
    elif not any(isinstance(f, _WhenImported) for f in sys.meta_path):
        sys.meta_path.insert(0, _WhenImported(_TRIGGER, switch_on))


#: the launch's run directory (its boot directory), where each process that builds a Trainer leaves
#: a mark, so the launch can say at the end when the program built none
RUN_DIR = "MMBALANCE_LAUNCH_RUN"


def _note_trainer(trainer) -> None:
    where = os.environ.get(RUN_DIR)
    if where and os.path.isdir(where):
        try:
            with open(os.path.join(where, f"trainer.{os.getpid()}"), "w") as f:
                f.write(type(trainer).__name__)
        except OSError:
            pass


def _say_if_nothing_balanced(boot: str) -> None:
    """One line when no process of the program built a ``transformers.Trainer``."""
    try:
        built = any(name.startswith("trainer.") for name in os.listdir(boot))
    except OSError:
        built = True
    if not built:
        sys.stderr.write(
            "mmbalance launch: the program built no transformers Trainer, so nothing was balanced (a custom "
            "loop or another framework's trainer, verl's for one, calls mmbalance itself: README, \"Use with "
            'Hugging Face transformers" and "API in ten lines")\n'
        )


# ----------------------------------------------------------------------------- the program
def _resolve(program: list[str]):
    """``(what to run, sys.argv[0], description)`` of PROGRAM, or ``None`` when there is none."""
    head = program[0]
    if head == "-m":  # as `python -m`: the current folder first on the path
        if len(program) < 2:
            return None
        module = program[1]
        sys.path.insert(0, os.getcwd())
        if not _module_exists(module):
            sys.path.pop(0)
            return None

        def run_module():
            return runpy.run_module(module, run_name="__main__", alter_sys=True)

        return run_module, module, f"module {module}"
    if head.endswith(".py") or (os.sep in head and os.path.isfile(head)):
        if not os.path.isfile(head):
            return None
        return _script(head), head, f"file {head}"
    path = shutil.which(head)
    found = [ep for ep in metadata.entry_points(group="console_scripts") if ep.name == head]
    if len(found) > 1 and path:  # two distributions name a script alike: the one on PATH
        text = _text_of(path)
        found = [ep for ep in found if ep.module in text] or found
    if found:
        ep = found[0]
        return (lambda: ep.load()()), head, f"console script {head} ({ep.value})"
    if path and _is_python_script(path):
        return _script(path), path, f"Python script {path}"
    return None


def _module_exists(name: str) -> bool:
    """Whether ``name`` (dotted, any depth) can be run with ``-m``: found, or a package with a
    ``__main__`` (finding a submodule imports its parents, as ``python -m`` does)."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return False
    return spec is not None


# ------------------------------------------------------------------- PROGRAM as `python ...`
_PYTHON = re.compile(r"python(\d+(\.\d+)?t?)?(\.exe)?")
_WITH_ARGUMENT = ("-X", "-W", "--check-hash-based-pycs")
# in the interpreter PROGRAM names: whether the module exists, and its transformers release
_CHECK = """import importlib.util, sys
try:
    from importlib import metadata
    print(metadata.version("transformers"))
except Exception:
    print("none")
if len(sys.argv) > 1:
    try:
        found = importlib.util.find_spec(sys.argv[1]) is not None
    except (ImportError, ValueError):
        found = False
    sys.exit(0 if found else 127)
"""


def _interpreter(head: str) -> str | None:
    """The path of the Python interpreter ``head`` names (``python``, ``python3.12``, a path to one),
    ``""`` when it names one that does not exist, ``None`` when it names no interpreter."""
    if not _PYTHON.fullmatch(os.path.basename(head)):
        return None
    if os.sep in head:
        return head if os.path.isfile(head) and os.access(head, os.X_OK) else ""
    return shutil.which(head) or ""


def _python_target(args: list[str]) -> tuple[str, str | None, list[str]]:
    """What ``python ARGS`` runs: ``(kind, value, options)`` with ``kind`` one of ``"-m"`` (value:
    the module), ``"-c"`` (the code), ``"script"`` (the path), ``"stdin"`` or ``"repl"``, and the
    interpreter's own options before it."""
    i = 0
    while i < len(args):
        a = args[i]
        if a in ("-m", "-c"):
            return a, args[i + 1] if i + 1 < len(args) else None, args[:i]
        if a in _WITH_ARGUMENT:
            i += 2
            continue
        if a == "-":
            return "stdin", None, args[:i]
        if a.startswith("--"):
            i += 1
            continue
        if a.startswith("-"):  # single-letter options, one or several (-u, -uB; -X and -W take one)
            letters = a[1:]
            if letters[:1] in ("X", "W"):
                i += 1 if len(letters) > 1 else 2
                continue
            for j, ch in enumerate(letters):
                if ch in "mc":
                    rest = letters[j + 1 :]
                    value = rest or (args[i + 1] if i + 1 < len(args) else None)
                    return "-" + ch, value, [*args[:i], "-" + letters[:j]] if j else args[:i]
            i += 1
            continue
        return "script", a, args[:i]
    return "repl", None, args


def _run_python(interpreter: str, args: list[str]) -> int:
    """``interpreter ARGS`` as a child process of this one (its own interpreter and packages: it
    balances itself through the boot directory on ``PYTHONPATH``); its exit status (128 + N for a
    signal N, as a shell gives it)."""
    import subprocess

    options = _python_target(args)[2]
    if any(o.startswith("-") and not o.startswith("--") and set("IE") & set(o[1:]) for o in options):
        sys.stderr.write(
            "mmbalance launch: -I and -E make Python ignore PYTHONPATH: this program is not balanced\n"
        )
    proc = subprocess.Popen([interpreter, *args])
    while True:
        try:
            code = proc.wait()
            break
        except KeyboardInterrupt:  # the terminal's Ctrl-C reached the child too: wait for its end
            continue
    return 128 - code if code < 0 else code


def _check_python(interpreter: str, args: list[str]) -> tuple[int, str] | None:
    """Refuse ``interpreter ARGS`` before it runs: ``(status, message)``, or ``None`` to run it."""
    import subprocess

    kind, value, _ = _python_target(args)
    if kind in ("-m", "-c") and value is None:
        return 2, f"mmbalance launch: {os.path.basename(interpreter)} {kind}: the option needs an argument"
    if kind == "script" and not os.path.isfile(str(value)):
        return NOT_FOUND, f"mmbalance launch: {value}: no such Python file"
    env = {k: v for k, v in os.environ.items() if k not in (ENV, "PYTHONPATH")}
    if os.environ.get("PYTHONPATH"):
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    probe = [interpreter, "-c", _CHECK, *([str(value)] if kind == "-m" else [])]
    try:
        done = subprocess.run(probe, capture_output=True, text=True, env=env, timeout=300)
    except (OSError, subprocess.SubprocessError) as exc:
        return NOT_FOUND, f"mmbalance launch: {interpreter}: cannot run it ({exc})"
    release = (done.stdout.strip().splitlines() or ["none"])[-1]
    if done.returncode == NOT_FOUND:
        return NOT_FOUND, f"mmbalance launch: {interpreter} -m {value}: no module of that name"
    if done.returncode != 0:
        return NOT_FOUND, f"mmbalance launch: {interpreter}: it does not run ({done.stderr.strip()[-300:]})"
    why = _floor_refusal(release)
    return (2, why) if why else None


# ------------------------------------------------------------------------ transformers' floor
#: the oldest transformers release the switch supports (compat.TRANSFORMERS_FLOOR; this module
#: imports nothing of the integration before the program runs)
FLOOR = (5, 6)


def _release(text: str) -> tuple[int, int]:
    parts = (re.findall(r"\d+", text) + ["0", "0"])[:2]
    return int(parts[0]), int(parts[1])


def _floor_refusal(release: str | None) -> str | None:
    """Why the transformers ``release`` cannot be balanced (``"none"``/``None``: not installed)."""
    floor = ".".join(map(str, FLOOR))
    if release in (None, "none"):
        return f"mmbalance launch: transformers is not installed where PROGRAM runs (supported: {floor} to the newest)"
    if _release(release) < FLOOR:
        return (
            f"mmbalance launch: transformers {release} is older than the releases the launch balances "
            f"({floor} to the newest): pip install 'transformers>={floor}'"
        )
    return None


def _installed_transformers() -> str | None:
    try:
        return metadata.version("transformers")
    except metadata.PackageNotFoundError:
        return None


def _script(path: str):
    """Run the file ``path`` as Python runs a script: its folder first on the path."""

    def run():
        sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
        return runpy.run_path(path, run_name="__main__")

    return run


def _text_of(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read(4096)
    except OSError:
        return ""


def _is_python_script(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            first = f.readline(200)
    except OSError:
        return False
    return first.startswith(b"#!") and b"python" in first


def _exit_status(code) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    sys.stderr.write(f"{code}\n")
    return 1


def _boot_directory() -> str:
    """A directory holding the ``sitecustomize`` that balances the program's other processes."""
    boot = tempfile.mkdtemp(prefix="mmbalance-launch-")
    with open(os.path.join(boot, "sitecustomize.py"), "w") as f:
        f.write(_BOOT.format(env=ENV))
    return boot


def main(argv: list[str] | None = None) -> int:
    """``mmbalance launch``; returns PROGRAM's exit status."""
    p = parser()
    args = p.parse_args(argv)
    program = list(args.program)
    if program and program[0] == "--":
        program = program[1:]
    if not program:
        p.print_usage(sys.stderr)
        sys.stderr.write(
            "mmbalance launch: error: no PROGRAM to run (mmbalance launch [options] -- PROGRAM ...)\n"
        )
        return 2
    if args.context_parallel and args.max_tokens_per_rank is None:
        sys.stderr.write("mmbalance launch: error: --context-parallel needs --max-tokens-per-rank N\n")
        return 2
    if args.context_parallel and args.no_batches:
        sys.stderr.write(
            "mmbalance launch: error: --context-parallel balances the batches: drop --no-batches\n"
        )
        return 2
    if args.token_mean_loss and not args.no_batches:
        sys.stderr.write(
            "mmbalance launch: error: --token-mean-loss is for --no-batches runs (balanced batches have it already)\n"
        )
        return 2
    if args.max_tokens_per_rank is not None and args.max_tokens_per_rank < 1:
        sys.stderr.write(
            f"mmbalance launch: error: --max-tokens-per-rank must be >= 1, got {args.max_tokens_per_rank}\n"
        )
        return 2
    interpreter = _interpreter(program[0])
    if interpreter == "":
        sys.stderr.write(f"mmbalance launch: {program[0]}: no such Python interpreter\n")
        return NOT_FOUND
    if interpreter is not None:  # `python ...`: that interpreter, as a child process
        refused = _check_python(interpreter, program[1:])
        if refused is not None:
            sys.stderr.write(refused[1] + "\n")
            return refused[0]
        boot = _boot_directory()
        _switch_environment(args, boot)
        try:
            return _run_python(interpreter, program[1:])
        finally:
            _say_if_nothing_balanced(boot)
            shutil.rmtree(boot, ignore_errors=True)
    why = _floor_refusal(_installed_transformers())
    if why is not None:
        sys.stderr.write(why + "\n")
        return 2
    found = _resolve(program)
    if found is None:
        sys.stderr.write(
            f"mmbalance launch: {' '.join(program[:2])}: no console script, Python file or module of that name "
            "(PROGRAM must be a Python program: a console script, a .py file, or -m module)\n"
        )
        return NOT_FOUND
    run, argv0, _ = found
    boot = _boot_directory()
    _switch_environment(args, boot)
    install_from_environment()
    sys.argv = [argv0, *program[2 if program[0] == "-m" else 1 :]]
    try:
        result = run()
        # a console script's return value is its status, as its wrapper's sys.exit(main()) gives it
        # (a script's or module's namespace is not)
        return _exit_status(result if program[0] != "-m" and not isinstance(result, dict) else None)
    except SystemExit as exc:
        return _exit_status(exc.code)
    except KeyboardInterrupt:
        return 130
    except BaseException:  # noqa: BLE001 - the program's failure is its exit status, as Python reports it
        traceback.print_exc()
        return 1
    finally:
        _say_if_nothing_balanced(boot)
        shutil.rmtree(boot, ignore_errors=True)


def _switch_environment(args: argparse.Namespace, boot: str) -> None:
    """The options and the boot directory in the environment the program and its processes get."""
    os.environ[ENV] = json.dumps(_options(args))
    os.environ[RUN_DIR] = boot
    os.environ["PYTHONPATH"] = os.pathsep.join([boot, *filter(None, [os.environ.get("PYTHONPATH")])])
