"""``balance_trainer(..., context_parallel=True)`` and streamed data, in transformers' Trainer and
in a plain loop (``trainer_cp.py``, launched as torchrun would).

* Map-style, 4 ranks: the CP run's final weights equal the run without CP (same examples in every
  optimizer step), no rank embeds more than the budget, every example is trained once per epoch,
  and a run resumed from a mid-epoch checkpoint ends at the same weights.
* Streamed ``IterableDataset``, 2 and 4 ranks, Trainer with and without CP and a plain loop over
  ``handle.batches``: every drawn example is trained once, and the weights equal a one-process
  replay of the logged micro-batches.
"""

from __future__ import annotations

import json
import tempfile
from collections import Counter
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", minversion="5.18")
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


def _replay(drawn: list[list], world: int) -> dict:
    """Plain SGD on the logged micro-batches: micro-batch ``j`` of every rank forms one group,
    normalized by its labelled tokens over all ranks; groups logged at the same optimizer step
    add their gradients (Trainer carries a partial accumulation over an epoch's end)."""
    model = S.build_model()
    model.set_attn_implementation("eager")
    rows = [S.example(i, n) for i, n in enumerate(S.lengths())]
    opt = torch.optim.SGD(model.parameters(), lr=S.LR)
    # a rank whose stream ended takes part with empty micro-batches (not logged)
    n = max(len(d) for d in drawn)
    assert all(len(d) >= n - 1 for d in drawn)
    keys, epoch = [], 0
    for j in range(n):
        if j and drawn[0][j][1][0] < drawn[0][j - 1][1][0]:
            epoch += 1
        keys.append((drawn[0][j][0], epoch))
    for step in sorted({k[0] for k in keys}):
        opt.zero_grad()
        for key in sorted({k for k in keys if k[0] == step}):
            exs = [i for d in drawn for j in range(len(d)) if keys[j] == key for i in d[j][1]]
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
        # every drawn example trained once: each rank drew its slice, in stream order, nothing twice
        for r in range(world):
            ids = [i for _, mb in drawn[r] for i in mb]
            mine = list(range(r, N, world))
            assert ids == (mine * 3)[: len(ids)], (n, r, ids)  # the slice in order, epoch after epoch
        assert worst_rel(w[n], _replay(drawn, world)) <= 1e-5, n
    budget = 48 if world >= 4 else 50
    for n in ("stream-cp", "loop"):
        assert max(logs[n, r]["max_tokens"] for r in range(world)) <= budget
    assert any(max(d) >= 2 for r in range(world) for d in logs["loop", r]["degrees"]), (
        "some sequence is split"
    )
