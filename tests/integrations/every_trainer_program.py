"""A training program that knows nothing of mmbalance (run by test_every_trainer.py, plain or as
``mmbalance launch -- torchrun ... every_trainer_program.py``): transformers' Trainer on a tiny
Qwen2-VL whose examples carry very different images, SGD, 4 steps of gradient accumulation 2.

argv: OUT_DIR [--split-batches] [--exit N] [--examples N] [--hard-exit]. Rank 0 saves the final weights
(``weights.pt``), the log history (``log.json``) and, where the trainer was balanced, the
sampler's stats of every epoch (``planned.json``) to OUT_DIR; ``--split-batches`` sets
accelerate's ``split_batches``; ``--exit N`` ends the program with status N after training;
``--examples N`` trains on the first N examples (default 16: 2 whole steps an epoch);
``--hard-exit`` leaves with ``os._exit`` after a barrier, skipping the interpreter's teardown: a
plain gloo program whose DDP reducer outlives the run can abort there (SIGABRT, "terminate called
without an active exception"; the torch bug of the README's "The gloo teardown hang"), which
mmbalance covers in the processes it balances but not in a plain reference run.
"""

from __future__ import annotations

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tests.integrations.trainer_encoder_balance import Examples, collate  # noqa: E402


def main() -> int:
    from transformers import Trainer, TrainingArguments

    from tests.integrations import hf_zoo

    out = sys.argv[1]
    extra = {"accelerator_config": {"split_batches": True}} if "--split-batches" in sys.argv else {}
    model = hf_zoo.build("qwen2_vl", seed=1)
    args = TrainingArguments(
        output_dir=out, max_steps=4, per_device_train_batch_size=2, gradient_accumulation_steps=2,
        learning_rate=0.5, optim="sgd", lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=0.0,
        logging_steps=2, report_to=[], save_strategy="no", seed=0, use_cpu=True, disable_tqdm=True, **extra,
    )  # fmt: skip
    data = Examples(model)
    if "--examples" in sys.argv:
        data.rows = data.rows[: int(sys.argv[sys.argv.index("--examples") + 1])]
    trainer = Trainer(model=model, args=args, train_dataset=data, data_collator=collate)
    planned = []  # the balanced sampler's stats of every epoch, when there is one (the test reads them)

    from transformers import TrainerCallback

    class EpochStats(TrainerCallback):
        def on_epoch_end(self, args, state, control, **kwargs):
            sampler = getattr(trainer, "balanced_sampler", None)
            if sampler is not None:
                planned.append(list(sampler.epoch_stats))

    trainer.add_callback(EpochStats())
    trainer.train()
    if int(os.environ.get("RANK", "0")) == 0:
        torch.save(
            {k: v.detach().clone() for k, v in model.state_dict().items()}, os.path.join(out, "weights.pt")
        )
        with open(os.path.join(out, "log.json"), "w") as f:
            json.dump(trainer.state.log_history, f)
        with open(os.path.join(out, "planned.json"), "w") as f:
            json.dump(planned, f)
    if "--exit" in sys.argv:
        return int(sys.argv[sys.argv.index("--exit") + 1])
    return 0


if __name__ == "__main__":
    code = main()
    if "--hard-exit" in sys.argv:
        from tests.dist_utils import exit_after_barrier

        exit_after_barrier(code)
    sys.exit(code)
