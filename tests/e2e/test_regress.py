import json

from mmbalance.bench import regress


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_regression_gate(tmp_path):
    row = {
        "op": "pack",
        "provider": "mmbalance",
        "shape": "s",
        "dtype": "fp16",
        "device": "gpu",
        "time_ms": 1.0,
    }
    base, new = tmp_path / "base.jsonl", tmp_path / "new.jsonl"
    _write(base, [row])
    _write(new, [{**row, "time_ms": 1.05}, {**row, "op": "unpack"}])
    assert regress.main([str(new), str(base)]) == 0
    _write(new, [{**row, "time_ms": 1.2}])
    assert regress.main([str(new), str(base)]) == 1
    assert regress.main([str(new), str(tmp_path / "missing.jsonl")]) == 2  # never a silent pass
