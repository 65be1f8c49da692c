"""The command line: dispatch, and one-line errors (exit 2, no traceback) for its users' mistakes."""

from __future__ import annotations

import os
import sys
import types

import pytest

from mmbalance import cli
from mmbalance.bench.demo import train as demo
from mmbalance.bench.planners import simulate as sim
from tests import procs


def fake_benchmarks(monkeypatch) -> list[tuple[str, list[str]]]:
    calls: list[tuple[str, list[str]]] = []

    def fake_load(name):
        def main(argv):
            calls.append((f"mmbalance.bench.{name}", list(argv)))
            return 0

        return types.SimpleNamespace(main=main)

    monkeypatch.setattr(cli, "load_benchmark", fake_load)
    return calls


def assert_usage_error(rc: int, capsys, *needles: str) -> str:
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    for needle in needles:
        assert needle in err, err
    return err


def test_version(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["--version"])
    assert exc.value.code == 0
    from mmbalance import __version__

    assert capsys.readouterr().out.strip() == f"mmbalance {__version__}"


def test_every_benchmark_loads_by_its_name():
    """A benchmark's module is its room of ``mmbalance.bench`` (whose face holds ``main``) or a module
    of a room (``moves``, ``planners``) named after it."""
    for name in (*cli.BENCHES, "kernel_audit"):
        module = cli.load_benchmark(name)
        rooms = (
            f"mmbalance.bench.{name}",
            f"mmbalance.bench.moves.{name}",
            f"mmbalance.bench.planners.{name}",
            f"mmbalance.bench.cp.{name}",
        )
        assert module.__name__ in rooms and callable(module.main), module.__name__
    with pytest.raises(ValueError, match="name must be one of"):
        cli.load_benchmark("nonsense")


@pytest.mark.parametrize("name", [*cli.BENCHES, "kernel_audit", "demo", "simulate"])
def test_every_command_prints_its_help(name, capsys):
    """``--help`` of every benchmark and command prints its usage and exits 0 (argparse formats
    help texts with ``%``: a dataset named ``long_tail_1%`` once made ``bench.cp --help`` raise)."""
    main = cli.load_benchmark(name).main if name not in ("demo", "simulate") else None
    with pytest.raises(SystemExit) as exc:
        if main is not None:
            main(["--help"])
        else:
            cli.main([name, "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage:") and "--help" in out, out[:500]


def test_commands_without_torch_do_not_import_it():
    """``mmbalance --version``, ``simulate`` and ``bench planners`` start without torch."""
    code = (
        "import sys\nfrom mmbalance import cli\nfrom mmbalance.bench.planners import simulate\n"
        "cli.load_benchmark('planners')\nassert 'torch' not in sys.modules, 'torch'"
    )
    out = procs.run([sys.executable, "-c", code], timeout=300)
    assert out.returncode == 0, out.stderr


def test_bench_rejects_unknown_names(capsys):
    assert_usage_error(cli.main(["bench", "nonsense"]), capsys, "unknown benchmark")


def test_bench_without_names_runs_every_benchmark_and_the_audit(monkeypatch, tmp_path):
    calls = fake_benchmarks(monkeypatch)
    out = tmp_path / "rows.jsonl"
    assert cli.main(["bench", "--json", str(out)]) == 0
    names = [n for n, _ in calls]
    assert names[: len(cli.BENCHES)] == [f"mmbalance.bench.{b}" for b in cli.BENCHES]
    assert names.count("mmbalance.bench.kernel_audit") == 2  # sm_90 and sm_80
    assert all(argv[-2:] == ["--json", str(out)] for n, argv in calls if not n.endswith("kernel_audit"))


def test_bench_named_runs_only_those(monkeypatch, tmp_path):
    calls = fake_benchmarks(monkeypatch)
    assert cli.main(["bench", "planners", "--full", "--json", str(tmp_path / "x.jsonl")]) == 0
    assert [n for n, _ in calls] == ["mmbalance.bench.planners"]
    assert calls[0][1][0] == "--full"


def test_bench_never_deletes_a_users_file(monkeypatch, tmp_path, capsys):
    """Without --json every run writes a new file in the working directory and says where."""
    calls = fake_benchmarks(monkeypatch)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "results").mkdir()
    keep = tmp_path / "results" / "bench.jsonl"
    keep.write_text('{"op": "mine"}\n')
    assert cli.main(["bench", "planners"]) == 0
    assert cli.main(["bench", "planners"]) == 0
    assert keep.read_text() == '{"op": "mine"}\n'
    written = [argv[-1] for _, argv in calls]
    assert len(set(written)) == 2
    for path in written:
        assert os.path.dirname(path) == str(tmp_path) and os.path.basename(path).startswith(
            "mmbalance-bench-"
        )
        assert os.path.exists(path)
    out = capsys.readouterr().out
    assert all(path in out for path in written)


def test_bench_json_that_is_a_directory(tmp_path, capsys):
    assert_usage_error(cli.main(["bench", "planners", "--json", str(tmp_path)]), capsys, "--json")


# ---------------------------------------------------------------------------------- simulate
@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--steps", "0"], "--steps"),
        (["--per-rank", "0"], "--per-rank"),
        (["--per-rank", "-1"], "--per-rank"),
        (["--ranks", "0"], "--ranks"),
        (["--ranks", "8,x"], "--ranks"),
        (["--ranks", "100000000"], "--ranks"),
        (["--seed", "-3"], "--seed"),
    ],
    ids=["steps0", "per-rank0", "per-rank-neg", "ranks0", "ranks-text", "ranks-huge", "seed-neg"],
)
def test_simulate_bad_flags(argv, needle, capsys):
    assert_usage_error(sim.main(["--ranks", "8", *argv] if argv[0] != "--ranks" else argv), capsys, needle)


@pytest.mark.parametrize(
    ("name", "content", "needles"),
    [
        (
            "typo.csv",
            "vison,audio,text\n1024,0,5\n",
            ("unknown column(s) ['vison']", "missing column(s) ['vision']"),
        ),
        ("missing.csv", "vision,text\n1024,5\n", ("missing column(s) ['audio']",)),
        ("dup.csv", "vision,audio,text,vision\n1,0,5,2\n", ("duplicate column(s) ['vision']",)),
        ("short.csv", "vision,audio,text\n1,0\n", ("line 2", "2 fields")),
        ("notext.jsonl", '{"vision": 1024, "audio": 0}\n', ("line 1", "missing column(s) ['text']")),
        ("extra.jsonl", '{"vision": 1, "audio": 0, "text": 3, "id": 7}\n', ("unknown column(s) ['id']",)),
        ("huge.csv", f"vision,audio,text\n{10**30},0,5\n", ("line 2", "too large")),
        ("huge.jsonl", '{"vision": 1e300, "audio": 0, "text": 5}\n', ("line 1", "too large")),
        ("inf.jsonl", '{"vision": Infinity, "audio": 0, "text": 5}\n', ("line 1", "'vision'")),
        ("bool.jsonl", '{"vision": true, "audio": 0, "text": 5}\n', ("line 1", "'vision'")),
        ("zeros.csv", "vision,audio,text\n0,0,0\n0,0,0\n", ("every example is empty",)),
        ("empty.csv", "", ("empty file",)),
        ("binary.csv", None, ("binary.csv",)),
    ],
)
def test_simulate_bad_data_files(tmp_path, capsys, name, content, needles):
    path = tmp_path / name
    if content is None:
        path.write_bytes(b"\xff\xfe\x00\x01garbage")
    else:
        path.write_text(content)
    assert_usage_error(sim.main(["--data", str(path), "--ranks", "2", "--steps", "1"]), capsys, *needles)


def test_simulate_missing_file(tmp_path, capsys):
    assert_usage_error(sim.main(["--data", str(tmp_path / "nope.csv")]), capsys, "cannot read")


def test_simulate_reads_a_csv_with_a_byte_order_mark(tmp_path):
    """Excel saves CSV with a UTF-8 BOM: the first column must still be read, not zeroed."""
    path = tmp_path / "excel.csv"
    path.write_bytes("\ufeffvision,audio,text\n1024,0,5\n3,7,9\n".encode())
    sizes = sim.load_table(str(path))
    assert sizes.vision.tolist() == [1024, 3]
    assert sizes.audio.tolist() == [0, 7]
    assert sizes.text.tolist() == [5, 9]


def test_simulate_columns_in_any_order(tmp_path):
    path = tmp_path / "order.csv"
    path.write_text("text, audio ,vision\n5,0,1024\n")
    sizes = sim.load_table(str(path))
    assert (sizes.vision.tolist(), sizes.audio.tolist(), sizes.text.tolist()) == ([1024], [0], [5])


def test_simulate_text_only_data_runs(tmp_path):
    path = tmp_path / "text.csv"
    path.write_text("vision,audio,text\n" + "".join(f"0,0,{k + 1}\n" for k in range(16)))
    assert sim.main(["--data", str(path), "--ranks", "2", "--per-rank", "2", "--steps", "1"]) == 0


def hide_matplotlib(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # ``import matplotlib`` now fails


def test_simulate_plot_without_matplotlib_fails_before_the_run(monkeypatch, tmp_path, capsys):
    hide_matplotlib(monkeypatch)
    monkeypatch.setattr(sim, "simulate", lambda *a, **k: pytest.fail("ran before checking --plot"))
    rc = sim.main(["--ranks", "2", "--steps", "1", "--plot", str(tmp_path / "p.png")])
    assert_usage_error(rc, capsys, "--plot needs matplotlib")


def test_simulate_plot_is_written(tmp_path):
    out = tmp_path / "sim.png"
    assert sim.main(["--ranks", "2,4", "--per-rank", "4", "--steps", "1", "--plot", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ---------------------------------------------------------------------------------- demo
@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--steps", "0"], "--steps"),
        (["--per-rank", "0"], "--per-rank"),
        (["--ranks", "3"], "--ranks"),
        (["--ranks", "0"], "--ranks"),
        (["--ranks", "1000"], "--ranks"),
        (["--ranks-per-node", "3"], "--ranks-per-node"),
        (["--lr", "nan"], "--lr"),
        (["--timeout", "0"], "--timeout"),
        (["--seed", "-1"], "--seed"),
    ],
    ids=["steps0", "per-rank0", "ranks-odd", "ranks0", "ranks-huge", "rpn", "lr-nan", "timeout0", "seed-neg"],
)
def test_demo_bad_flags(argv, needle, monkeypatch, capsys):
    monkeypatch.setattr(demo, "run", lambda args: pytest.fail("ran with bad flags"))
    assert_usage_error(demo.main(argv), capsys, needle)


def test_demo_plot_without_matplotlib_fails_before_the_run(monkeypatch, tmp_path, capsys):
    hide_matplotlib(monkeypatch)
    monkeypatch.setattr(demo, "run", lambda args: pytest.fail("ran before checking --plot"))
    assert_usage_error(demo.main(["--plot", str(tmp_path / "d.png")]), capsys, "--plot needs matplotlib")


def test_demo_json_that_is_a_directory(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(demo, "run", lambda args: pytest.fail("ran with an unwritable --json"))
    assert_usage_error(demo.main(["--json", str(tmp_path)]), capsys, "--json")


@pytest.mark.parametrize("parser", [demo.parser, sim.parser], ids=["demo", "simulate"])
def test_every_flag_has_help_and_shows_its_default(parser):
    p = parser()
    for action in p._actions:
        if action.dest == "help":
            continue
        assert action.help, f"{action.option_strings} has no help text"
        if action.default not in (None, False):
            assert "%(default)s" in p.formatter_class("x")._get_help_string(action), action.option_strings


def test_star_import_does_not_import_torch():
    code = (
        "import sys\nfrom mmbalance import *\nassert 'torch' not in sys.modules, 'torch'\nprint(post_balance)"
    )
    out = procs.run([sys.executable, "-c", code], timeout=300)
    assert out.returncode == 0, out.stderr


def test_bench_real_goes_to_the_cp_benchmark_only(monkeypatch, tmp_path, capsys):
    calls = fake_benchmarks(monkeypatch)
    assert cli.main(["bench", "cp", "sampler", "--real", "--quick", "--json", str(tmp_path / "x.jsonl")]) == 0
    argv = dict(calls)
    assert argv["mmbalance.bench.cp"][:2] == ["--quick", "--real"]
    assert "--real" not in argv["mmbalance.bench.sampler"]
    assert_usage_error(cli.main(["bench", "sampler", "--real"]), capsys, "--real", "cp")
