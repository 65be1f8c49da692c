"""``balance_trainer(..., context_parallel=True)`` on a vision-language model (``trainer_cp_vlm.py``,
4 ranks launched as torchrun would): a tiny Qwen2-VL whose 8-frame video exceeds twice the budget,
the Qwen2.5-Omni thinker with a long audio clip in its place, Gemma 3 with a document of twenty
images (each a bidirectional block, cut by the shards) and PaliGemma with a prefix of seven
images (one bidirectional block over three ranks).

The CP run's final weights equal the run without CP (the same examples in every micro-batch slot),
no rank embeds more than the budget, every example is trained once, and every image and frame is
encoded exactly once in the world (the vision tower's rows; the only extra is a 4-row stand-in
where a rank has nothing of its group's media to encode).
"""

from __future__ import annotations

import json
import tempfile
from collections import Counter
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", minversion="5.6")
pytest.importorskip("accelerate")

from tests.dist_utils import launch  # noqa: E402
from tests.integrations import trainer_cp_vlm as S  # noqa: E402
from tests.tolerances import worst_rel  # noqa: E402

SCRIPT = Path(S.__file__)

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_omni", "gemma3", "paligemma"])
def test_trainer_with_context_parallel_on_a_vlm_trains_like_without_it(family):
    from mmbalance.integrations.hf.compat import loss_takes_token_count
    from tests.integrations import hf_zoo

    if not loss_takes_token_count(hf_zoo.build(family)):  # balance_trainer refuses it (test_balance_trainer)
        pytest.skip(f"{family}'s loss is a mean over each call on this release")
    with tempfile.TemporaryDirectory() as tmp:
        # every rank must exit with code 0
        launch(SCRIPT, nproc=4, timeout=840, env={"MMB_TMP": tmp, "MMB_FAMILY": family})
        logs = {(n, r): json.loads((Path(tmp) / f"{n}-rank{r}.json").read_text())
                for n in ("plain", "cp") for r in range(4)}  # fmt: skip
        w = {n: torch.load(Path(tmp) / f"{n}.pt") for n in ("plain", "cp")}
    # (SigLIP's key biases start at zero and stay there up to rounding: Gemma 3's are noise)
    assert worst_rel(w["cp"], w["plain"], floor=1e-5) <= 1e-5
    # the CP runs use gradient checkpointing, but the thinker's
    recomputed = 2 if family != "qwen2_5_omni" else 1
    assert all(logs["cp", r]["attention"] == recomputed * logs["cp", r]["forwards"] for r in range(4))
    assert max(logs["cp", r]["max_tokens"] for r in range(4)) <= S.BUDGET
    assert max(logs["plain", r]["max_tokens"] for r in range(4)) > 2 * S.BUDGET  # the video is split
    slots = len(logs["cp", 0]["batches"])
    plain = [set().union(*(set(logs["plain", r]["batches"][k]) for r in range(4))) for k in range(slots)]
    cp = [set().union(*(set(logs["cp", r]["batches"][k]) for r in range(4))) for k in range(slots)]
    # the same examples in every micro-batch slot; PaliGemma's long prefix leaves its slot one
    # rank, so there the slots of an optimizer step share their examples differently
    per = S.ACCUM if family == "paligemma" else 1
    assert [set().union(*cp[k : k + per]) for k in range(0, slots, per)] == [
        set().union(*plain[k : k + per]) for k in range(0, slots, per)
    ], "each micro-batch slot (PaliGemma: optimizer step) trains the same examples as without CP"
    assert Counter(i for s in cp for i in s) == Counter(range(S.N)), "every example once"
    # the video (example 0) is loaded by every member of its group: 3 ranks or more
    assert sum(1 for r in range(4) if any(0 in b for b in logs["cp", r]["batches"])) >= 3
    media = logs["cp", 0]["media_rows"]
    # stand-in items where a rank has nothing of its group's media: 4 patches (Gemma 3: a zero
    # tile, logged as 0), 3 audio frames
    stand_in = S.STAND_IN[family]
    real = sum(x for r in range(4) for x in logs["cp", r]["tower_rows"] if x != stand_in)
    real += sum(x for r in range(4) for x in logs["cp", r]["audio_rows"] if x != 3)
    stand_ins = sum(1 for r in range(4) for x in logs["cp", r]["tower_rows"] if x == stand_in)
    assert real == sum(media), (real, sum(media))
    assert all(len(logs["cp", r]["tower_rows"]) == slots for r in range(4))  # one tower call per forward
    assert all(len(logs["cp", r]["audio_rows"]) <= slots for r in range(4))
    assert stand_ins < 4 * slots
    if family == "qwen2_5_omni":
        assert sum(len(logs["cp", r]["audio_rows"]) for r in range(4)) > 0
