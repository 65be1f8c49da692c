"""The command line: argument handling (the benchmarks themselves run in their own tests)."""

from mmbalance import cli


def test_bench_rejects_unknown_names(capsys):
    assert cli.main(["bench", "nonsense"]) == 2
    assert "unknown benchmark" in capsys.readouterr().err


def test_bench_parses_without_names():
    parser_args = ["bench", "--json", "x.jsonl"]
    # parse only: no benchmark runs
    import argparse

    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd")
    b = sub.add_parser("bench")
    b.add_argument("only", nargs="*", metavar="NAME")
    b.add_argument("--json")
    assert p.parse_args(parser_args).only == []
