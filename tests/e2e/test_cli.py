"""The command line: argument handling and dispatch (the benchmarks run in their own tests)."""

import types

from mmbalance import cli


def test_bench_rejects_unknown_names(capsys):
    assert cli.main(["bench", "nonsense"]) == 2
    assert "unknown benchmark" in capsys.readouterr().err


def test_bench_without_names_runs_every_benchmark_and_the_audit(monkeypatch, tmp_path):
    calls = []

    def fake_import(name):
        def main(argv):
            calls.append((name, list(argv)))
            return 0

        return types.SimpleNamespace(main=main)

    monkeypatch.setattr(cli.importlib, "import_module", fake_import)
    out = tmp_path / "rows.jsonl"
    assert cli.main(["bench", "--json", str(out)]) == 0
    names = [n for n, _ in calls]
    assert names[: len(cli.BENCHES)] == [f"bench.{b}" for b in cli.BENCHES]
    assert names.count("bench.kernel_audit") == 2  # sm_90 and sm_80
    assert all(argv[-2:] == ["--json", str(out)] for n, argv in calls if n != "bench.kernel_audit")


def test_bench_named_runs_only_those(monkeypatch):
    calls = []
    monkeypatch.setattr(
        cli.importlib,
        "import_module",
        lambda name: types.SimpleNamespace(main=lambda argv: calls.append(name)),
    )
    assert cli.main(["bench", "planners", "--full"]) == 0
    assert calls == ["bench.planners"]
