"""``mmbalance launch``: run a training program with every ``transformers.Trainer`` it builds balanced,
without editing it (LLaMA-Factory's ``llamafactory-cli``, ms-swift's ``swift``, a script).

    mmbalance launch [--no-encoders] [--no-batches [--token-mean-loss]]
                     [--context-parallel --max-tokens-per-rank N] -- PROGRAM [ARGS...]

PROGRAM runs in this process, as Python would run it: a console script (``llamafactory-cli``,
``swift``), a ``.py`` file, or ``-m module``; its exit status is the command's. The switch
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
            "Run PROGRAM (a console script such as llamafactory-cli or swift, a .py file, or -m module) in "
            "this process with every transformers Trainer it builds balanced: the encoders of supported "
            "multimodal models (apply_encoder_balance), the per-rank batches (balance_trainer), the loss "
            "normalized by the step's global token count, and mmbalance/* keys in every Trainer.log call. "
            "Python processes the program starts (torchrun workers) are balanced too. The exit status is "
            "PROGRAM's (127 when there is no such program).",
            width=100,
        ),
        epilog="examples:\n"
        "  torchrun --nproc-per-node 8 --no-python mmbalance launch -- llamafactory-cli train config.yaml\n"
        "  FORCE_TORCHRUN=1 mmbalance launch -- llamafactory-cli train config.yaml\n"
        "  NPROC_PER_NODE=8 mmbalance launch -- swift sft --model ... --dataset ...\n"
        "  mmbalance launch --context-parallel --max-tokens-per-rank 8192 -- train.py --config c.yaml",
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

            balance_every_trainer(**options)
        except Exception as exc:  # the program goes on as it is, and says so
            sys.stderr.write(f"mmbalance launch: this process is not balanced: {exc}\n")

    if _TRIGGER in sys.modules:
        switch_on()
    elif not any(isinstance(f, _WhenImported) for f in sys.meta_path):
        sys.meta_path.insert(0, _WhenImported(_TRIGGER, switch_on))


# ----------------------------------------------------------------------------- the program
def _resolve(program: list[str]):
    """``(what to run, sys.argv[0], description)`` of PROGRAM, or ``None`` when there is none."""
    head = program[0]
    if head == "-m":  # as `python -m`: the current folder first on the path
        if len(program) < 2:
            return None
        module = program[1]
        sys.path.insert(0, os.getcwd())
        if importlib.util.find_spec(module.split(".")[0]) is None:
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
    found = _resolve(program)
    if found is None:
        sys.stderr.write(
            f"mmbalance launch: {' '.join(program[:2])}: no console script, Python file or module of that name "
            "(PROGRAM must be a Python program: a console script, a .py file, or -m module)\n"
        )
        return NOT_FOUND
    run, argv0, _ = found
    boot = _boot_directory()
    os.environ[ENV] = json.dumps(_options(args))
    os.environ["PYTHONPATH"] = os.pathsep.join([boot, *filter(None, [os.environ.get("PYTHONPATH")])])
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
        shutil.rmtree(boot, ignore_errors=True)
