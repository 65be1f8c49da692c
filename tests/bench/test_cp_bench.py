"""``mmbalance bench cp``: every scheme places every sequence once (or says why it cannot), the
timings and shard sizes against references written here, ours at or below the static degrees and
the power-of-two hybrid on the bench's data, and the JSON rows of a quick run."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from mmbalance import cli
from mmbalance.balancing import CostModel
from mmbalance.bench.cp import data as cp_data
from mmbalance.bench.cp import schemes as cp_schemes
from mmbalance.bench.cp import sweep as cp
from mmbalance.bench.cp import window as cp_window

COST = CostModel.transformer()
OTHER = CostModel(linear=1.0, attention=2e-4, ring=0.2, ring_latency=50.0, fixed=10.0, mask="full")
NO_OVERLAP = CostModel(linear=1e-4, attention=2e-9, ring=8e-6, ring_latency=1e-3, fixed=2e-3, overlap=False)


def random_step(rng, world, mem, long_share=0.1):
    """Lengths of one step: short ones and some longer than a rank holds, within world * mem."""
    n = int(rng.integers(1, 6 * world))
    lengths = rng.integers(1, mem, n)
    long = rng.random(n) < long_share
    lengths[long] = rng.integers(mem, max(mem + 1, world * mem // 2), int(long.sum()))
    keep = np.cumsum(lengths) <= world * mem
    return lengths[keep] if keep.any() else lengths[:1] % mem + 1


def placed_once(schedule, n):
    """Independent of check_schedule: how often each sequence is placed over the rounds."""
    count = np.zeros(n, dtype=np.int64)
    for rnd in schedule.rounds:
        for i, k in enumerate(rnd.group_of.tolist()):
            if k >= 0:
                count[i] += 1
    return count


@pytest.mark.parametrize("world", [1, 3, 8, 64])
def test_every_scheme_places_every_sequence_once_or_says_why_not(world):
    rng = np.random.default_rng(world)
    mem = 1000
    for _ in range(10):
        lengths = random_step(rng, world, mem)
        schedules = [cp_schemes.static_cp(lengths, world, mem, c, COST) for c in cp.STATIC_DEGREES]
        schedules += [
            cp_schemes.hybrid_pow2(lengths, world, mem),
            cp_schemes.hybrid_pow2(lengths, world, mem, COST),
        ]
        schedules.append(cp_schemes.ours(lengths, world, mem, COST)[0])
        for s in schedules:
            cp_schemes.check_schedule(s, lengths, world, mem)
            if not s.feasible:
                assert s.infeasible and not s.rounds
                assert math.isnan(cp_schemes.step_time(s, lengths, COST))
                continue
            assert (placed_once(s, lengths.size) == 1).all(), s.scheme
            for rnd in s.rounds:
                assert int(rnd.degree.sum()) <= world
                for k, d in enumerate(rnd.degree.tolist()):
                    assert int(lengths[rnd.group_of == k].sum()) <= d * mem
                    assert (rnd.group_of == k).any()  # no empty group
        static = {s.scheme: s for s in schedules[: len(cp.STATIC_DEGREES)]}
        for c in cp.STATIC_DEGREES:
            fits = c <= world and int(lengths.max()) <= c * mem
            if not fits:
                assert not static[f"static_cp{c}"].feasible
            else:
                assert all((r.degree == c).all() for r in static[f"static_cp{c}"].rounds)


def test_static_degree_that_cannot_hold_a_sequence_is_infeasible():
    lengths = np.array([2500, 10, 10])
    s = cp_schemes.static_cp(lengths, 8, 1000, 2, COST)
    assert not s.feasible and "2500" in s.infeasible
    assert cp_schemes.static_cp(lengths, 8, 1000, 4, COST).feasible
    packed = cp_schemes.static_cp(np.array([900, 900, 900]), 2, 1000, 1, COST)
    assert not packed.feasible and "pack" in packed.infeasible


def test_check_schedule_catches_broken_schedules():
    lengths = np.array([5, 7, 9])
    good = cp_schemes.Schedule("x", (cp_schemes.Round(np.array([1, 2]), np.array([0, 1, 1])),))
    cp_schemes.check_schedule(good, lengths, 3, 10)
    bad = {
        "placed 0 times": cp_schemes.Round(np.array([1, 2]), np.array([0, -1, 1])),
        "for 2 ranks": cp_schemes.Round(np.array([1, 2]), np.array([0, 1, 1])),
        "holds 16 tokens": cp_schemes.Round(np.array([2, 1]), np.array([0, 1, 1])),
        "does not have": cp_schemes.Round(np.array([1]), np.array([0, 1, 0])),
    }
    for why, rnd in bad.items():
        with pytest.raises(ValueError, match=why):
            cp_schemes.check_schedule(
                cp_schemes.Schedule("x", (rnd,)), lengths, 2 if "2 ranks" in why else 3, 10
            )
    twice = cp_schemes.Schedule("x", (good.rounds[0], good.rounds[0]))
    with pytest.raises(ValueError, match="placed 2 times"):
        cp_schemes.check_schedule(twice, lengths, 3, 10)
    with pytest.raises(ValueError, match="gives no reason"):
        cp_schemes.check_schedule(cp_schemes.Schedule("x", infeasible=""), lengths, 3, 10)


@pytest.mark.parametrize("cost", [COST, OTHER, NO_OVERLAP], ids=["8b", "latency", "no-overlap"])
def test_step_time_against_the_cost_model(cost):
    rng = np.random.default_rng(0)
    lengths = rng.integers(0, 5000, 40)
    rounds = []
    for _ in range(3):
        degree = rng.integers(1, 9, 5)
        group_of = rng.integers(-1, 5, 40)
        group_of[rng.integers(0, 40, 5)] = np.arange(5)  # every group holds a sequence
        rounds.append(cp_schemes.Round(degree, group_of))
    want = 0.0
    for rnd in rounds:
        times = [cost.time(lengths[rnd.group_of == k].tolist(), int(d)) for k, d in enumerate(rnd.degree)]
        want += max(times)
    got = cp_schemes.step_time(cp_schemes.Schedule("x", tuple(rounds)), lengths, cost)
    assert got == pytest.approx(want, rel=1e-12)


def test_zigzag_shards_match_the_ring_layout():
    from mmbalance.collectives.ring.plan import ring_plan

    rng = np.random.default_rng(1)
    for degree in (1, 2, 3, 5, 8):
        for _ in range(5):
            lengths = rng.integers(0, 300, int(rng.integers(1, 7)))
            cu = np.concatenate([[0], np.cumsum(lengths)])
            want = np.array(ring_plan(cu, degree, "zigzag").tokens)
            assert np.array_equal(cp_schemes.zigzag_tokens(lengths, degree), want)
    lengths = np.array([1001, 7, 30])
    sched = cp_schemes.Schedule("x", (cp_schemes.Round(np.array([4, 1]), np.array([0, 1, 0])),))
    busiest = max(int(cp_schemes.zigzag_tokens(np.array([1001, 30]), 4).max()), 7)
    assert cp_schemes.largest_shard(sched, lengths) == busiest > (1001 + 30) // 4


def test_static_greedy_against_a_plain_reference():
    rng = np.random.default_rng(2)
    for cost in (COST, OTHER):
        for _ in range(5):
            world, mem, c = 8, 3000, int(rng.choice([1, 2, 4]))
            lengths = rng.integers(1, 2000, int(rng.integers(1, 30)))
            s = cp_schemes.static_cp(lengths, world, mem, c, cost)
            groups: list[list[int]] = [[] for _ in range(world // c)]
            ok = True
            for i in sorted(range(lengths.size), key=lambda i: (-lengths[i], i)):
                options = [
                    (cost.time([lengths[j] for j in g] + [lengths[i]], c), k)
                    for k, g in enumerate(groups)
                    if sum(lengths[j] for j in g) + lengths[i] <= c * mem
                ]
                if not options:
                    ok = False
                    break
                groups[min(options)[1]].append(i)
            assert s.feasible == ok
            if ok:
                want = max(cost.time([lengths[j] for j in g], c) for g in groups if g)
                assert cp_schemes.step_time(s, lengths, cost) == pytest.approx(want, rel=1e-12)


def test_hybrid_uses_powers_of_two_and_every_rank():
    rng = np.random.default_rng(3)
    for world in (1, 8, 64):
        for cost in (None, COST):
            lengths = random_step(rng, world, 1000, long_share=0.2)
            s = cp_schemes.hybrid_pow2(lengths, world, 1000, cost)
            need = cp_schemes.pow2_degree(lengths, world, 1000)
            for rnd in s.rounds:
                assert int(rnd.degree.sum()) == world  # free ranks go to the smallest groups
                assert all(d & (d - 1) == 0 for d in rnd.degree.tolist())
                inside = rnd.group_of >= 0
                assert (rnd.degree[rnd.group_of[inside]] >= need[inside]).all()
    assert cp_schemes.pow2_degree(np.array([1, 1000, 1001, 3000, 5000]), 8, 1000).tolist() == [1, 1, 2, 4, 8]


def test_step_batches_fill_the_memory_and_long_tails_are_16_to_64_times_the_median():
    med = cp_data.median_length()
    for ds in cp.DATASETS:
        batches = cp.step_batches(ds, 8, 8192, 5, 0.75, 0)
        assert len(batches) == 5
        for b in batches:
            assert b.size >= 1 and (b.size == 1 or b.sum() <= 0.75 * 8 * 8192)
            assert b.min() >= 1
        again = cp.step_batches(ds, 8, 8192, 5, 0.75, 0)
        assert all(np.array_equal(a, b) for a, b in zip(batches, again))  # seeded
    rng = np.random.default_rng(0)
    tail = cp_data.draw("long_tail_1%", 200_000, rng)
    base = cp_data.draw("mixture", 200_000, np.random.default_rng(0))
    rare = tail[tail > base.max()]
    assert 0.005 < (tail >= 16 * med - 1).mean() < 0.02
    assert rare.min() >= round(16 * med) - 1 and rare.max() <= round(64 * med) + 1


@pytest.mark.parametrize("dataset", list(cp.DATASETS))
def test_ours_at_or_below_static_and_hybrid_on_the_data(dataset):
    for world, mem in ((8, 8192), (64, 16384)):
        res = cp.run_config(dataset, world, mem, 3, COST, plan_reps=1)
        ours = res.step["mmbalance"]
        assert np.isfinite(ours).all()
        for s in cp.SCHEMES[:-1]:
            other = res.step[s]
            ok = np.isfinite(other)
            assert (ours[ok] <= other[ok] * (1 + 1e-9)).all(), (s, ours, other)
        assert (ours >= res.lower_bound * (1 - 1e-9)).all()
        assert (res.shard["mmbalance"] > 0).all()


def test_quick_run_through_the_command_line(tmp_path, capsys):
    out = tmp_path / "rows.jsonl"
    table = tmp_path / "cp.md"
    assert cli.main(["bench", "cp", "--quick", "--json", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    window = [r for r in rows if r["op"] == "cp_window_step"]  # the sliding-window model line
    rows = [r for r in rows if r["op"] != "cp_window_step"]
    shapes = {r["shape"] for r in rows}
    assert len(shapes) == len(cp.DATASETS) * 2 * len(cp.BUDGETS)  # 8 and 64 ranks with --quick
    assert len(rows) == len(cp.SCHEMES) * len(shapes)
    long_tail = [d for d, share in cp.DATASETS.items() if share > 0]
    assert len(window) == len(cp_window.SCHEMES) * len(long_tail) * 2 * len(cp.BUDGETS)
    common = {
        "op",
        "provider",
        "shape",
        "device",
        "sha",
        "time_ms",
        "data",
        "ranks",
        "memory_per_rank",
        "steps",
    }
    common |= {"feasible", "feasible_steps", "infeasible", "step_ms_max", "largest_shard", "ours_speedup"}
    mine = {"plan_ms_median", "plan_ms_max", "best_static", "vs_best_static", "worst_vs_static"}
    mine |= {"over_lower_bound", "vs_hybrid_pow2", "worst_vs_hybrid_pow2", "degrees"}
    for r in rows:
        assert r["op"] == "cp_step" and r["provider"] in cp.SCHEMES
        assert common <= set(r), common - set(r)
        if r["provider"] == "mmbalance":
            assert mine <= set(r), mine - set(r)
            assert r["feasible"] and r["plan_ms_median"] > 0 and r["over_lower_bound"] >= 1 - 1e-9
            assert r["worst_vs_static"] <= 1 + 1e-9 and r["worst_vs_hybrid_pow2"] <= 1 + 1e-9
        if r["feasible"]:
            assert r["time_ms"] > 0 and r["infeasible"] == "" and r["ours_speedup"] >= 1 - 1e-9
        else:
            assert math.isnan(r["time_ms"]) and r["infeasible"]
    assert any(not r["feasible"] for r in rows)  # static degree 1 cannot hold the long sequences
    text = capsys.readouterr().out
    assert "| data | ranks |" in text and "== acceptance ==" in text
    assert cp.main(["--quick", "--ranks", "8", "--datasets", "mixture", "--markdown", str(table)]) == 0
    assert table.read_text().startswith("| data | ranks |")


def test_plot(tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "cp.png"
    assert cp.main(["--ranks", "8", "--steps", "1", "--datasets", "long_tail_1%", "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--fill", "2"], "--fill"),
        (["--datasets", "nope"], "unknown dataset"),
        (["--steps", "0"], "--steps"),
        (["--cost", "/nonexistent.json"], "--cost"),
    ],
)
def test_bad_arguments_exit_2(argv, needle, capsys):
    assert cp.main(["--ranks", "8", *argv]) == 2
    assert needle in capsys.readouterr().err


def test_cost_file_fits_measurements(tmp_path):
    truth = CostModel(linear=2e-4, attention=3e-9, ring=1e-5, ring_latency=1e-3)
    meas = [[[n], d, truth.time([n], d)] for n in (512, 1024, 4096, 16384, 32768) for d in (1, 2, 4, 8)]
    path = tmp_path / "cost.json"
    path.write_text(json.dumps(meas))
    fitted = cp.load_cost(str(path))
    assert fitted.fit_report is not None and fitted.fit_report.mean_error < 0.01
    path.write_text(json.dumps({"linear": 1.0, "attention": 1e-4}))
    assert cp.load_cost(str(path)) == CostModel(linear=1.0, attention=1e-4)


@pytest.mark.distributed
@pytest.mark.slow
def test_real_steps_on_four_gloo_ranks_through_torchrun(tmp_path):
    pytest.importorskip("transformers")
    from mmbalance.bench.cp import real as cp_real

    # seed 11: the second measured step holds a sequence of 1108 tokens, more than 2 x 512
    res = cp_real.launch(str(tmp_path / "real.json"), steps=2, extra=["--warmup", "1", "--seed", "11"])
    rows = {r.provider: r for r in cp_real.rows_of(res)}
    assert list(rows) == list(cp_real.SCHEMES)
    for c in (1, 2):
        m = rows[f"static_cp{c}"].metrics
        assert not m["feasible"] and "1108" in m["infeasible"] and math.isnan(rows[f"static_cp{c}"].time_ms)
    for name in ("mmbalance", "static_cp4"):
        r = rows[name]
        m = r.metrics
        assert m["feasible"] and r.time_ms > 0 and 0 < m["shard_ms"] <= m["step_ms_max"]
        assert m["alltoall_bytes"] == m["alltoall_tokens"] * cp_real.PAYLOAD_BYTES
        assert 0 < m["largest_shard"] <= 512
        assert m["loss_rel_to_ours"] <= 1e-5  # the same global loss on the same weights
    assert set(rows["static_cp4"].metrics["degrees"].split(",")) == {"4x2"}
    assert max(int(d.split("x")[0]) for d in rows["mmbalance"].metrics["degrees"].split(",")) >= 3
    assert "| mmbalance |" in cp_real.summary_table(list(rows.values()))


def test_static_degree_cost_only_meets_its_degree():
    from mmbalance.bench.cp import real as cp_real

    cost = cp_real.StaticDegree(2, COST)
    lengths = np.array([100, 3000, 12000])
    assert np.allclose(cost(lengths, 2), [COST.time([x], 2) for x in lengths.tolist()], rtol=1e-12)
    assert (cost(lengths, 1) > 1e5 * cost(lengths, 2)).all() and (
        cost(lengths, 3) > 1e5 * cost(lengths, 2)
    ).all()
    steps = cp_real.real_steps("long_tail_1%", 4, 512, 3, 0.75, 0, 32)
    assert all(len(s) == 4 and sum(int(p.sum()) for p in s) <= 0.75 * 4 * 512 for s in steps)


def test_summary_table_columns_line_up():
    res = cp.run_config("long_tail_1%", 8, 8192, 1, COST, plan_reps=1)
    lines = cp.summary_table([res]).splitlines()
    assert len({line.count("|") for line in lines}) == 1, lines


def test_window_model_prices_what_a_window_reaches():
    """Inside the window a sequence costs l**2 (the causal unit); beyond, 2 l W - W**2: twice the
    pairs (query, key) with 0 <= q - k < W, as the causal unit counts l**2 for about l**2 / 2
    pairs; layers without the window keep l**2."""
    model = cp_window.WindowModel(window=100, local_fraction=1.0)
    for length in (1, 50, 100, 101, 1000, 100_000):
        pairs = sum(min(q + 1, 100) for q in range(length))  # keys each query sees
        full = length * (length + 1) // 2
        assert model.squares([length])[0] == pytest.approx(length**2 * pairs / full, rel=0.02 + 2 / length)
    half = cp_window.WindowModel(window=100, local_fraction=0.5)
    assert half.squares([1000])[0] == pytest.approx(0.5 * (2 * 1000 * 100 - 100**2) + 0.5 * 1000**2)
    assert cp_window.WindowModel(window=100, local_fraction=0.0).squares([1000])[0] == 1000**2


def test_window_line_times_every_scheme_on_the_windowed_model():
    cost = CostModel.transformer()
    res = cp_window.run_config("long_tail_1%", 8, 16384, 2, cost)
    ours = res.step["mmbalance"]
    assert np.isfinite(ours).all()
    best = res.best_static()
    assert best is not None and (ours <= res.step[best] * (1 + 1e-9)).all()
    # the window-aware plan is at least as fast as the plan for causal attention, timed alike
    assert (ours <= res.step["mmbalance_causal_plan"] * (1 + 1e-9)).all()
    # windows make long sequences cheaper: every scheme's step is faster than on full attention
    full = cp_window.run_config("long_tail_1%", 8, 16384, 2, cost, cp_window.WindowModel(local_fraction=0.0))
    assert (ours < full.step["mmbalance"]).all()
    rows = cp_window.rows_of(res)
    assert [r.provider for r in rows] == list(cp_window.SCHEMES)
    assert rows[-1].metrics["vs_best_static"] >= 1 - 1e-9
