"""``balance_trainer(..., context_parallel=True)`` and streamed data, in transformers' Trainer and
in a plain loop (``trainer_cp.py``, launched as torchrun would).

* Map-style, 4 ranks: the CP run's final weights equal the run without CP (same examples in every
  optimizer step), no rank embeds more than the budget, every example is trained once per epoch,
  and a run resumed from a mid-epoch checkpoint ends at the same weights.
* Streamed ``IterableDataset``, 2 and 4 ranks, Trainer with and without CP and a plain loop over
  ``handle.batches``: every drawn example is trained once, and the weights equal a one-process
  replay of the logged micro-batches.
* Streams of every shape (``trainer_stream_end.py``): 0 to 20 examples, 1 to 3 shards, batch 1 to
  4, accumulation 1 to 4, ``max_steps`` below and above a pass, with and without CP: every run ends
  at ``max_steps`` (or at once on an empty stream) within a hard timeout, and every drawn example
  is trained once.
"""

from __future__ import annotations

import json
import math
import tempfile
from collections import Counter
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", minversion="5.6")
pytest.importorskip("accelerate")

from tests.dist_utils import launch  # noqa: E402
from tests.integrations import trainer_cp as S  # noqa: E402
from tests.tolerances import worst_rel  # noqa: E402

SCRIPT = Path(S.__file__)
N = len(S.lengths())

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def test_trainer_with_context_parallel_trains_like_without_it_and_resumes():
    with tempfile.TemporaryDirectory() as tmp:
        launch(SCRIPT, nproc=4, timeout=600, env={"MMB_TMP": tmp})  # every rank must exit with code 0
        logs = {(n, r): json.loads((Path(tmp) / f"{n}-rank{r}.json").read_text())
                for n in ("plain", "cp", "resumed") for r in range(4)}  # fmt: skip
        w = {n: torch.load(Path(tmp) / f"{n}.pt") for n in ("plain", "cp", "resumed")}
    assert worst_rel(w["cp"], w["plain"]) <= 1e-5
    # gradient checkpointing in the CP run: every forward's attention ran again in backward
    assert all(logs["cp", r]["attention"] == 2 * logs["cp", r]["forwards"] for r in range(4))
    assert all(logs["plain", r]["attention"] == logs["plain", r]["forwards"] for r in range(4))
    assert worst_rel(w["resumed"], w["cp"]) <= 1e-5
    assert max(logs["cp", r]["max_tokens"] for r in range(4)) <= S.BUDGET
    assert max(logs["plain", r]["max_tokens"] for r in range(4)) > S.BUDGET  # the budget splits something
    # every example once per epoch: each micro-batch slot is the union of the groups' examples
    # (every member of a group loads the group's examples)
    slots = len(logs["cp", 0]["batches"])
    per_epoch = slots // S.EPOCHS
    plain_slots = [
        set().union(*(set(logs["plain", r]["batches"][k]) for r in range(4))) for k in range(slots)
    ]
    cp_slots = [set().union(*(set(logs["cp", r]["batches"][k]) for r in range(4))) for k in range(slots)]
    assert cp_slots == plain_slots, "each micro-batch slot trains the same examples as without CP"
    for e in range(S.EPOCHS):
        seen = Counter(i for s in cp_slots[e * per_epoch : (e + 1) * per_epoch] for i in s)
        assert set(seen) == set(range(N))
        step = S.BATCH * 4 * S.ACCUM  # examples per optimizer step; the last is padded with repeats
        assert sum(seen.values()) == -(-N // step) * step


@pytest.mark.slow
@pytest.mark.distributed
def test_trainer_with_context_parallel_on_a_gated_deltanet_hybrid_trains_like_without_it():
    """balance_trainer on a tiny Qwen3.5 on 4 ranks, with and without context_parallel=True (the long
    examples split over CP groups, their Gated DeltaNet states handed along): the same weights."""
    with tempfile.TemporaryDirectory() as tmp:
        env = {"MMB_TMP": tmp, "MMB_MODE": "hybrid", "MMB_FAMILY": "qwen3_5"}
        launch(SCRIPT, nproc=4, timeout=600, env=env)
        w = {n: torch.load(Path(tmp) / f"{n}.pt") for n in ("plain", "cp")}
        logs = {r: json.loads((Path(tmp) / f"cp-rank{r}.json").read_text()) for r in range(4)}
        plain = {r: json.loads((Path(tmp) / f"plain-rank{r}.json").read_text()) for r in range(4)}
    assert max(logs[r]["max_tokens"] for r in range(4)) <= S.BUDGET
    assert max(plain[r]["max_tokens"] for r in range(4)) > S.BUDGET  # the budget splits something
    assert worst_rel(w["cp"], w["plain"]) <= 1e-5


def _replay(drawn: list[list], world: int) -> dict:
    """Plain SGD on the logged micro-batches: those logged at one optimizer step (every rank's,
    every slot's) form the step, normalized by its labelled tokens over all ranks. Every pass ends
    in a step of its own (a partial last step is completed with idle micro-batches), so no step
    spans two passes."""
    model = S.build_model()
    model.set_attn_implementation("eager")
    rows = [S.example(i, n) for i, n in enumerate(S.lengths())]
    opt = torch.optim.SGD(model.parameters(), lr=S.LR)
    steps: dict[int, list[int]] = {}
    for d in drawn:
        for step, ids in d:
            steps.setdefault(step, []).extend(ids)
    for step in sorted(steps):
        opt.zero_grad()
        exs = steps[step]
        count = sum(int(rows[i]["labels"][1:].ne(-100).sum()) for i in exs)
        for i in exs:
            out = model(input_ids=rows[i]["input_ids"][None], labels=rows[i]["labels"][None],
                        num_items_in_batch=count)  # fmt: skip
            out.loss.backward()
        opt.step()
    return model.state_dict()


@pytest.mark.parametrize("world", [2, 4])
def test_streamed_data_in_trainer_and_plain_loop_matches_the_replay(world):
    names = ("stream", "stream-cp", "loop")
    with tempfile.TemporaryDirectory() as tmp:
        launch(SCRIPT, nproc=world, timeout=600, env={"MMB_TMP": tmp, "MMB_MODE": "stream"})
        logs = {
            (n, r): json.loads((Path(tmp) / f"{n}-rank{r}.json").read_text())
            for n in names
            for r in range(world)
        }
        w = {n: torch.load(Path(tmp) / f"{n}.pt") for n in names}
    for n in names:
        drawn = [logs[n, r]["drawn"] for r in range(world)]
        # every drawn example trained once: each rank drew its slice, pass after pass, nothing twice
        # (with context parallelism a step's examples are collated slot by slot: in another order)
        for r in range(world):
            ids = [i for _, mb in drawn[r] for i in mb]
            mine = list(range(r, N, world))
            want = (mine * 3)[: len(ids)]
            assert (sorted(ids) == sorted(want)) if n == "stream-cp" else (ids == want), (n, r, ids)
        assert worst_rel(w[n], _replay(drawn, world)) <= 1e-5, n
    budget = 48 if world >= 4 else 50
    for n in ("stream-cp", "loop"):
        assert max(logs[n, r]["max_tokens"] for r in range(world)) <= budget
    assert any(max(d) >= 2 for r in range(world) for d in logs["loop", r]["degrees"]), (
        "some sequence is split"
    )


@pytest.mark.parametrize("world", [2, 4])
def test_every_stream_ends_and_trains_each_draw_once(world):
    """The runs of ``trainer_stream_end.py``, one launch per world size, a hard timeout on the whole
    (a stream shorter than one optimizer step used to restart its pass forever at step 0)."""
    E = load_stream_end()
    with tempfile.TemporaryDirectory() as tmp:
        launch(Path(E.__file__), nproc=world, timeout=420, env={"MMB_TMP": tmp})
        runs = [json.loads((Path(tmp) / f"stream-end-rank{r}.json").read_text()) for r in range(world)]
    cases = E.CASES if world <= 2 else E.CASES[::2]  # as the script runs them
    assert len(runs[0]) == len(cases)
    for k, case in enumerate(cases):
        n, shards, batch, accum, max_steps, cp, workers = case
        per_rank = [runs[r][k] for r in range(world)]
        assert all(x["case"] == list(case) for x in per_rank)
        steps = {x["global_step"] for x in per_rank}
        assert steps == {max_steps if n else 0}, (case, steps)
        seen = Counter(i for x in per_rank for i in x["seen"])  # every marker the models embedded
        if n == 0:
            assert not seen
            continue
        if not workers:  # (with workers the collator runs in them: their draws are not logged)
            drawn = Counter(i for x in per_rank for i in x["drawn"])
            assert seen == drawn, (case, seen, drawn)  # trained once each, none lost, none twice
        # the draws follow the stream pass after pass
        total = sum(seen.values())
        passes, rest = divmod(total, n)
        assert all(passes <= c <= passes + 1 for c in seen.values()), (case, seen)
        assert sum(1 for c in seen.values() if c == passes + 1) == rest, (case, seen)


def load_stream_end():
    from tests.integrations import trainer_stream_end

    return trainer_stream_end


def test_slots_over_the_budget_are_re_formed_and_train_like_without_cp():
    """Long-tail data (``trainer_cp_slots.py``: 96 short texts and 3 of 173 tokens, 4 ranks,
    max_tokens_per_rank=64): the balanced slots of some steps hold more than 256 tokens, so with
    context parallelism they are re-formed (no refusal), and with batch 2 and 4 the final weights
    equal the run without CP within 1e-5 of the weights' change (SGD; the same examples in every
    optimizer step). TRL's SFTTrainer (bfloat16, padding-free) with the same data trains too."""
    from tests.integrations import trainer_cp_slots as C

    with tempfile.TemporaryDirectory() as tmp:
        launch(Path(C.__file__), nproc=4, timeout=600, env={"MMB_TMP": tmp})
        for batch in (2, 4):
            plain = torch.load(Path(tmp) / f"plain-{batch}.pt")
            cp = torch.load(Path(tmp) / f"cp-{batch}.pt")
            info = json.loads((Path(tmp) / f"cp-{batch}.json").read_text())
            tokens = info["tokens"]
            assert max(sum(tokens[i] for i in s) for s in info["balanced"]) > 4 * C.BUDGET  # must re-form
            assert all(sum(tokens[i] for i in s) <= 4 * C.BUDGET for s in info["slots"])
            assert info["slots"] != info["balanced"] and info["max_tokens"] <= C.BUDGET
            # every step keeps its examples: slots of a step, together, are the balanced ones
            g = C.ACCUM[batch]
            for k in range(0, len(info["slots"]), g):
                together = sorted(i for s in info["slots"][k : k + g] for i in s)
                assert together == sorted(i for s in info["balanced"][k : k + g] for i in s)
            keys = list(plain["final"])
            diff = torch.cat([(cp["final"][k] - plain["final"][k]).flatten() for k in keys])
            change = torch.cat([(plain["final"][k] - plain["init"][k]).flatten() for k in keys])
            assert float(diff.norm() / change.norm()) <= 1e-5  # measured 2.2e-7 and 2.6e-7
        sft = json.loads((Path(tmp) / "sft.json").read_text())
    assert sft["global_step"] == 3 and len(sft["losses"]) == 3  # logging_steps=1
    assert all(math.isfinite(x) for x in sft["losses"])
