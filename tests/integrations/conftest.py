"""The integration tests that the older transformers releases of the test matrix run.

``make test-matrix`` runs ``tests/integrations -m "not slow or matrix"`` on every release of
``TF_MATRIX`` (the whole of ``tests/integrations`` runs in ``make test`` on the newest). What differs
between releases is where transformers hands the model its inputs and its attention: the forwards,
the hooks (``mm_encoder_outputs``, ``get_image_features``, the attention interface, packed-sequence
masks) and the Trainer's loss and batches. The tests below take more than a few seconds (marked
``slow``) and are the ones on those paths that the quick ones do not reach, so every release runs
them too: encoder balancing of each family on 2 ranks (with LoRA and FSDP2 once each), Trainer
steps through ``balance_trainer`` and through the switch ``mmbalance launch`` installs, a video split
by frame, and generation and evaluation under the handle. The longer ones (4 ranks, torch.compile, the interpreter, launched programs)
repeat paths these reach and run on the newest release only. A release between 5.10 and 5.14
takes the floor's encoder and media paths (compat.py switches them at 5.15 and later): there the
encoder, loop and media runs are left to the floor's, and only the Trainer's run again.
"""

from __future__ import annotations

import pytest

ON_EVERY_RELEASE = (
    "test_hf_balance.py::test_balanced_model_gives_the_unbalanced_loss_and_gradients[",  # -2ranks-plain, below
    "test_hf_balance.py::test_balanced_model_gives_the_unbalanced_loss_and_gradients[qwen2_vl-2ranks-lora]",
    "test_hf_balance.py::test_balanced_model_gives_the_unbalanced_loss_and_gradients[qwen3_vl-2ranks-fsdp2]",
    "test_balance_trainer.py::test_two_ranks_train_like_the_replay_and_resume_in_order",
    "test_every_trainer.py::test_trainers_built_after_the_call_are_balanced_and_remove_restores",
    "test_hf_loops.py::test_a_video_is_split_by_frame_exactly",
    "test_hf_loops.py::test_generate_and_eval_run_as_without_the_handle",
    "test_dynamic_cp_vlm.py::test_families_since_qwen3_vl_split_their_media_over_2_ranks_exactly",
)


# The encoder and media paths differ between releases only where compat.py switches them (5.15,
# 5.17, 5.18, ...): a release between 5.10 and 5.14 takes 5.6's paths, which the floor's run
# checks, so there these runs are left to the floor; the Trainer's are not (5.10 changed its loss
# normalization).
SAME_MEDIA_PATHS_AS_THE_FLOOR = ((5, 10), (5, 15))
MEDIA_PATHS = ("test_hf_balance.py", "test_hf_loops.py", "test_dynamic_cp_vlm.py")


def _media_paths_checked_by_the_floor() -> bool:
    import transformers

    release = tuple(int(x) for x in transformers.__version__.split(".")[:2])
    low, high = SAME_MEDIA_PATHS_AS_THE_FLOOR
    return low <= release < high


def _on_every_release(nodeid: str) -> bool:
    name = nodeid.rsplit("/", 1)[-1]
    if name.startswith(MEDIA_PATHS) and _media_paths_checked_by_the_floor():
        return False
    for want in ON_EVERY_RELEASE:
        if want.endswith("["):  # each family, two ranks, plain (Qwen3.5-MoE: Qwen3.5's path again)
            if name.startswith(want) and name.endswith("-2ranks-plain]") and "qwen3_5_moe" not in name:
                return True
        elif name == want:
            return True
    return False


def pytest_collection_modifyitems(config, items):
    for item in items:
        if _on_every_release(item.nodeid):
            item.add_marker(pytest.mark.matrix)
