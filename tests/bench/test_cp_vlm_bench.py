"""``mmbalance bench cp --vlm``: the vision-language data against the shipped sizes, every scheme's
step against a reference written here (each group's encoder and LLM parts), pre-embedding never
faster than encoding once, ours with encoder balancing at or below every other scheme on the
bench's data, and the rows of a quick run."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from mmbalance import cli
from mmbalance.balancing import CostModel
from mmbalance.balancing.datasets import load_sizes
from mmbalance.bench.cp import schemes as cp_schemes
from mmbalance.bench.cp import sweep as cp
from mmbalance.bench.cp import vlm as cp_vlm

COST = CostModel.transformer()


def test_examples_are_text_plus_their_items_and_fit_eight_ranks():
    rng = np.random.default_rng(0)
    raw = load_sizes()
    longest_caption = int(np.round(raw["video_caption_words"].max() * 1.3)) + 32
    for ds in cp_vlm.DATASETS:
        ex = cp_vlm.draw(ds, 5000, rng)
        text = ex.llm - cp_vlm.LLM_PER_ITEM * ex.items
        assert (ex.items >= 1).all() and (text >= 0).all()
        assert ex.items.max() <= cp_vlm.MAX_FRAMES // 2 or ds == "documents"
        assert cp_vlm.longest(ds) <= 8 * 8192  # a step of 8 ranks at 8192 tokens holds every example
    videos = cp_vlm.draw("activitynet_long", 20000, rng)
    assert videos.items.max() == cp_vlm.MAX_FRAMES // 2  # the 8-minute cap is reached
    assert (videos.llm - cp_vlm.LLM_PER_ITEM * videos.items).max() <= longest_caption
    assert 10_000 < np.median(videos.llm) < 20_000
    docs = cp_vlm.draw("documents", 20000, rng)
    assert np.median(docs.llm) < np.median(videos.llm)  # the mixture has short single images too


def test_step_batches_fill_the_memory():
    for ds in cp_vlm.DATASETS:
        for b in cp_vlm.step_batches(ds, 8, 8192, 6, 0.75, 0):
            assert b.llm.sum() <= 0.75 * 8 * 8192 or len(b) == 1


def _static_reference(batch, world, mem, c, item_s, every_member):
    """A static degree's step from its groups, written plainly: each group's encoder part (its
    items dealt to its ``c`` members, or all of them on every member) plus its LLM time."""
    enc = batch.items * item_s
    sched = cp_schemes.static_cp(batch.llm, world, mem, c, COST, enc)
    (rnd,) = sched.rounds
    worst = 0.0
    for g in range(rnd.degree.size):
        members = [i for i in range(len(batch)) if rnd.group_of[i] == g]
        n = sum(int(batch.items[i]) for i in members)
        encode = n * item_s if every_member else math.ceil(n / c) * item_s
        worst = max(worst, encode + COST.time([int(batch.llm[i]) for i in members], c))
    return worst


@pytest.mark.parametrize("world, mem", [(8, 8192), (16, 16384)])
def test_every_scheme_against_the_parts_of_its_groups(world, mem):
    item_s = cp_vlm.item_seconds(COST)
    need = cp_vlm.longest("documents")
    for batch in cp_vlm.step_batches("documents", world, mem, 3, 0.75, 1):
        times = {s: cp_vlm.time_step(s, batch, world, mem, COST, item_s, need) for s in cp_vlm.SCHEMES}
        for c in cp_vlm.STATIC_DEGREES:
            st, pre = times[f"static_cp{c}"], times[f"preembed_cp{c}"]
            if c * mem < need:
                assert st.infeasible and pre.infeasible and math.isnan(st.total)
                continue
            assert st.total == pytest.approx(st.encoder + st.llm) and pre.total == pytest.approx(
                pre.encoder + pre.llm
            )
            assert st.total == pytest.approx(
                _static_reference(batch, world, mem, c, item_s, False), rel=1e-12
            )
            assert pre.total == pytest.approx(
                _static_reference(batch, world, mem, c, item_s, True), rel=1e-12
            )
            assert pre.total >= st.total  # every member embedding all media is never faster
        for s in cp_vlm.OURS:
            t = times[s]
            assert t.infeasible is None and 0 < t.shard <= mem
            assert t.total == pytest.approx(t.encoder + t.llm)
        # with encoder balancing the encoder phase is the whole step's items dealt over the world
        eb = times["mmbalance_eb"]
        assert eb.encoder == pytest.approx(-(-int(batch.items.sum()) // world) * item_s)


def test_preembedding_pays_every_item_on_every_member():
    item_s = cp_vlm.item_seconds(COST)
    batch = cp_vlm.Examples(np.array([3000, 2500]), np.array([4, 2]))
    t = cp_vlm.time_step("preembed_cp2", batch, 2, 8192, COST, item_s, 3000)
    # one group of 2 ranks holds both sequences (the greedy fills the only group)
    assert t.encoder == pytest.approx(6 * item_s)
    assert t.llm == pytest.approx(COST.time([3000, 2500], 2))
    s = cp_vlm.time_step("static_cp2", batch, 2, 8192, COST, item_s, 3000)
    assert s.encoder == pytest.approx(3 * item_s) and s.llm == pytest.approx(t.llm)


def test_ours_with_encoder_balance_at_or_below_every_other_scheme_on_the_data():
    results = [
        cp_vlm.run_config(ds, w, m, 4, COST, fill=0.75, seed=0)
        for ds in cp_vlm.DATASETS
        for w in (8, 64)
        for m in (8192, 16384)
    ]
    checks = {what: ok for what, ok, _ in cp_vlm.acceptance(results)}
    assert all(ok for what, ok in checks.items() if "mmbalance_eb" in what), checks
    for r in results:
        for s in cp_vlm.SCHEMES:
            if s.startswith("preembed") and math.isfinite(r.mean(s)):
                assert r.mean("mmbalance") < r.mean(s)  # far below pre-embedding everywhere


def test_quick_run_through_the_command_line(tmp_path, capsys):
    out = tmp_path / "rows.jsonl"
    assert cli.main(["bench", "cp", "--vlm", "--quick", "--json", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert {r["op"] for r in rows} == {"cp_vlm_step"}
    assert len({r["shape"] for r in rows}) == len(cp_vlm.DATASETS) * 2 * len(cp.BUDGETS)
    for r in rows:
        assert r["provider"] in cp_vlm.SCHEMES
        assert {"encoder_ms", "llm_ms", "largest_shard", "items_per_step", "infeasible"} <= set(r)
        if r["feasible"]:
            assert r["time_ms"] == pytest.approx(r["encoder_ms"] + r["llm_ms"], rel=1e-9)
        else:
            assert math.isnan(r["time_ms"]) and r["infeasible"]
    text = capsys.readouterr().out
    assert "pre-embed 8" in text and "== acceptance ==" in text
    assert cli.main(["bench", "planners", "--vlm"]) == 2  # --vlm belongs to cp


def test_vlm_plot_and_unknown_dataset(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    png = tmp_path / "vlm.png"
    assert cp.main(["--vlm", "--ranks", "8", "--steps", "1", "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert cp.main(["--vlm", "--datasets", "mixture"]) == 2
    assert "activitynet_long" in capsys.readouterr().err
