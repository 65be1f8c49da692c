"""``balance_trainer``: transformers' Trainer on balanced per-rank batches.

On 2 CPU ranks (as torchrun starts them) a Trainer with gradient accumulation trains two epochs;
its final weights equal a one-process replay of the micro-batches every rank logged (plain torch:
per step, the token losses of all ranks' micro-batches over the step's token count, one SGD step);
every example is trained once per epoch (3 padding repeats aside), in a new order each epoch, on
exactly the micro-batches the sampler planned for that rank (accelerate does not shard them again);
a second Trainer resumed from a mid-epoch checkpoint continues the same order to the same weights.
Both runs exit with code 0. In one process: the loader keeps Trainer's settings, and bad input
gets clear errors."""

from __future__ import annotations

import importlib.util
import json
import tempfile
import warnings
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers", minversion="5.6")
pytest.importorskip("accelerate")

from mmbalance.integrations.data import BalancedBatchSampler  # noqa: E402
from tests.dist_utils import launch  # noqa: E402

SCRIPT = Path(__file__).with_name("trainer_balanced_batches.py")
_spec = importlib.util.spec_from_file_location("trainer_balanced_batches", SCRIPT)
S = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(S)


# the labels Trainer counts for a step's loss normalization: the predicted ones (labels[:, 1:]) from
# transformers 5.10 on, every labelled one before (its unbalanced runs normalize the same way)
COUNTED = 1 if tuple(int(p) for p in transformers.__version__.split(".")[:2]) >= (5, 10) else 0


def _replay(batches_by_step: list[list[list[int]]], each_its_own_mean: bool = False) -> dict:
    """Final weights of plain SGD on the logged micro-batches: per step the summed token losses of
    every micro-batch of every rank over the step's count of labels, counted as Trainer counts them
    (``each_its_own_mean``: the mean of the micro-batches' own token means instead, what a model
    that opts out of the count trains to without the count)."""
    model = S.build_model()
    rows = [S.example(i, l) for i, l in enumerate(S.lengths())]
    opt = torch.optim.SGD(model.parameters(), lr=S.LR)
    for step in batches_by_step:
        batches = [S.collate([rows[i] for i in mb]) for mb in step]
        count = sum(int(b["labels"][:, COUNTED:].ne(-100).sum()) for b in batches)
        opt.zero_grad()
        for b in batches:
            logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits.float()
            loss = torch.nn.functional.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]),
                b["labels"][:, 1:].reshape(-1),
                ignore_index=-100,
                reduction="sum",
            )
            if each_its_own_mean:
                loss = loss * count / (int(b["labels"][:, 1:].ne(-100).sum()) * len(batches))
            (loss / count).backward()
        opt.step()
    return model.state_dict()


#: by the script's ``MMB_FAMILY``, the class each family must be: the vision-language classes opt
#: out of the step's token count (``accepts_loss_kwargs = False``); Qwen3.5's language model mixes
#: Gated DeltaNet layers with attention
OPT_OUTS = {
    "qwen3_5": "Qwen3_5ForCausalLM",
    "qwen3_5_vlm": "Qwen3_5ForConditionalGeneration",
    "gemma4": "Gemma4ForConditionalGeneration",
}


#: the token budget of the context-parallel runs: the 8 examples of a step (207 tokens, the
#: longest 56) fit 2 micro-batches of 2 ranks only with the longest split over both
CP_BUDGET = 53


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("cp", [False, True], ids=["dp", "cp"])
@pytest.mark.parametrize("family", list(OPT_OUTS))
def test_models_that_opt_out_of_the_token_count_train_like_the_replay(monkeypatch, family, cp):
    """Qwen3.5's and Gemma 4's vision-language classes (text only), which opt out of the step's
    token count, and a tiny Qwen3.5 language model (Gated DeltaNet beside full attention); padded
    micro-batches of different sizes, 3 SGD steps: ``balance_trainer`` on 2 ranks, with and without
    ``context_parallel=True`` (a sequence split over both ranks), trains to the weights of the
    one-process replay of the logged examples normalized by each step's global token count (1e-5
    of the change), not to the mean of each micro-batch's own mean."""
    if not hasattr(transformers, OPT_OUTS[family]):
        pytest.skip(f"transformers {transformers.__version__} has no {OPT_OUTS[family]}")
    monkeypatch.setenv("MMB_FAMILY", family)
    model = S.build_model()
    assert type(model).__name__ == OPT_OUTS[family]
    env = {"MMB_FAMILY": family, "MMB_STEPS": "3", **({"MMB_CP": str(CP_BUDGET)} if cp else {})}
    with tempfile.TemporaryDirectory() as tmp:
        args = transformers.TrainingArguments(output_dir=tmp, use_cpu=True, report_to=[])
        opts_out = transformers.Trainer(model=model, args=args).model_accepts_loss_kwargs is False
        launch(SCRIPT, nproc=2, timeout=600, env={"MMB_TMP": tmp, **env})
        full = [json.loads((Path(tmp) / f"full-rank{r}.json").read_text())["batches"] for r in (0, 1)]
        got = torch.load(Path(tmp) / "full.pt")
    g = S.ACCUM
    steps = [
        [mb for r in range(2) for mb in full[r][s * g : (s + 1) * g]] for s in range(3)
    ]  # (then prefetched)
    if cp:  # a split sequence's members load its micro-batch alike: each example once, on its own
        shared = [set(a) & set(b) for a, b in zip(full[0][: 3 * g], full[1][: 3 * g])]
        assert any(shared), "no sequence was split over the two ranks"
        steps = [[[i] for i in sorted({i for mb in step for i in mb})] for step in steps]
    want = _replay(steps)
    start = S.build_model().state_dict()

    def norm(a: dict, b: dict) -> float:
        return sum(float(((a[k] - b[k]).double() ** 2).sum()) for k in b) ** 0.5

    change = norm(want, start)
    assert change > 0 and norm(got, want) / change <= 1e-5, norm(got, want) / change
    if family != "qwen3_5" and not cp:  # the vision-language classes opt out; what they train to without it:
        assert opts_out
        assert norm(_replay(steps, each_its_own_mean=True), want) / change > 1e-2  # the check can tell


def test_two_ranks_train_like_the_replay_and_resume_in_order():
    with tempfile.TemporaryDirectory() as tmp:
        launch(SCRIPT, nproc=2, timeout=600, env={"MMB_TMP": tmp})  # every rank must exit with code 0
        logs = {(name, r): json.loads((Path(tmp) / f"{name}-rank{r}.json").read_text())
                for name in ("full", "resumed") for r in (0, 1)}  # fmt: skip
        full_w = torch.load(Path(tmp) / "full.pt")
        resumed_w = torch.load(Path(tmp) / "resumed.pt")
    for log in logs.values():  # one train-end callback, the default group kept until exit
        assert log["teardown"] == {"callbacks": 1, "world held": True}
    g, world = S.ACCUM, 2
    per_epoch = logs["full", 0]["per_epoch"]
    steps_per_epoch = -(-S.N // (S.BATCH * world * g))
    assert per_epoch == steps_per_epoch * g, "len(loader) counts this rank's micro-batches"
    full = [logs["full", r]["batches"] for r in range(world)]
    assert all(len(b) == S.EPOCHS * per_epoch for b in full)
    assert all(mb for b in full for mb in b), "no empty micro-batch"
    # exactly what the sampler plans for each rank, epoch by epoch: nothing sharded again
    for r in range(world):
        s = BalancedBatchSampler(S.lengths(), S.BATCH, world, r, grad_accum=g, seed=0, padding=True)
        want = []
        for e in range(S.EPOCHS):
            s.set_epoch(e)
            want += list(s)
        assert full[r] == want
    orders = []
    for e in range(S.EPOCHS):
        seen = Counter(
            i for r in range(world) for mb in full[r][e * per_epoch : (e + 1) * per_epoch] for i in mb
        )
        assert set(seen) == set(range(S.N)) and sum(seen.values()) == steps_per_epoch * S.BATCH * world * g
        orders.append([mb for r in range(world) for mb in full[r][e * per_epoch : (e + 1) * per_epoch]])
    assert orders[0] != orders[1], "a new order each epoch"
    # the replay: step s takes micro-batches s*g .. s*g+g-1 of every rank
    steps = [
        [mb for r in range(world) for mb in full[r][s * g : (s + 1) * g]] for s in range(len(full[0]) // g)
    ]
    replay = _replay(steps)
    for k, v in full_w.items():
        torch.testing.assert_close(v, replay[k], rtol=1e-6, atol=1e-6, msg=f"weights of {k}")
    # resumed after 3 optimizer steps (mid-epoch): the same micro-batches from step 4 on, same weights
    for r in range(world):
        assert logs["resumed", r]["batches"] == full[r][3 * g :]
    for k, v in full_w.items():
        torch.testing.assert_close(resumed_w[k], v, rtol=1e-6, atol=1e-6, msg=f"resumed weights of {k}")


def _trainer(tmp, **kw):
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(output_dir=tmp, per_device_train_batch_size=2, report_to=[], use_cpu=True,
                             disable_tqdm=True, **kw)  # fmt: skip
    data = S.Logged()
    return Trainer(model=S.build_model(), args=args, train_dataset=data, data_collator=S.collate)


def test_loader_keeps_trainer_settings_and_lengths_default(tmp_path):
    from transformers import Trainer

    from mmbalance.integrations.hf import balance_trainer

    class MyTrainer(Trainer):
        pass

    t = _trainer(str(tmp_path), dataloader_num_workers=1, dataloader_persistent_workers=True,
                 dataloader_prefetch_factor=3, gradient_accumulation_steps=3, seed=5)  # fmt: skip
    t.__class__ = MyTrainer  # any subclass
    assert balance_trainer(t) is t
    s = t.balanced_sampler
    assert s.table[:, -1].tolist() == S.lengths(), "lengths from len(input_ids)"
    assert (s.grad_accum, s.batch_size, s.num_replicas, s.seed, s.padding) == (3, 2, 1, 5, True)
    loader = t.get_train_dataloader()
    inner = loader.base_dataloader if hasattr(loader, "base_dataloader") else loader
    assert loader.batch_sampler is s
    assert (inner.num_workers, inner.persistent_workers, inner.prefetch_factor) == (1, True, 3)
    assert inner.worker_init_fn is not None
    assert len(loader) == len(s) == s.num_steps * 3
    batches = [b["input_ids"].shape[0] for b in loader]
    assert sum(batches) == s.total_size
    # the trainer's own column removal wraps the collator
    assert type(inner.collate_fn).__name__ == "RemoveColumnsCollator"
    t._train_batch_size = 1  # what auto_find_batch_size does after an out-of-memory error
    assert t.get_train_dataloader().batch_sampler.batch_size == 1 and t.balanced_sampler.grad_accum == 3
    with pytest.raises(ValueError, match="lengths has 3 entries"):
        balance_trainer(t, [1, 2, 3])
    with pytest.raises(TypeError, match="trainer"):
        balance_trainer(object())
    with pytest.raises(TypeError, match="padding"):
        balance_trainer(t, padding="yes")


def test_clear_errors_for_tiny_datasets_and_flattening(tmp_path):
    from transformers import DataCollatorWithFlattening

    from mmbalance.integrations.hf import balance_trainer

    t = _trainer(str(tmp_path), dataloader_drop_last=True, gradient_accumulation_steps=32)
    with pytest.raises(ValueError, match="smaller than one optimizer step"):
        balance_trainer(t)
    t = _trainer(str(tmp_path))
    t.data_collator = DataCollatorWithFlattening()
    assert balance_trainer(t).balanced_sampler.padding is False, "a packing collator means packed costs"
    t.train_dataset = list(range(5))
    with pytest.raises(ValueError, match="changed after balance_trainer"):
        t.get_train_dataloader()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        balance_trainer(_trainer(str(tmp_path)), np.ones(S.N, dtype=np.int64))  # one rank: no warning


def test_warns_when_tokens_are_not_averaged_across_ranks(tmp_path, monkeypatch):
    from mmbalance.integrations.hf import balance_trainer

    t = _trainer(str(tmp_path), average_tokens_across_devices=False)
    monkeypatch.setattr(type(t.args), "world_size", property(lambda self: 2))
    with pytest.warns(UserWarning, match="average_tokens_across_devices"):
        balance_trainer(t)
    assert t.balanced_sampler.num_replicas == 2


def test_several_ranks_get_the_teardown_callback_once(tmp_path, monkeypatch):
    from mmbalance.collectives import teardown
    from mmbalance.integrations.hf import balance_trainer
    from mmbalance.integrations.hf.trainer import _teardown_callback_class

    cls = _teardown_callback_class()
    one = balance_trainer(_trainer(str(tmp_path)))
    # one rank: nothing to arrange
    assert not any(isinstance(cb, cls) for cb in one.callback_handler.callbacks)
    t = _trainer(str(tmp_path))
    monkeypatch.setattr(type(t.args), "world_size", property(lambda self: 2))
    balance_trainer(t)
    balance_trainer(t)  # again (a new dataset): still one callback
    assert sum(isinstance(cb, cls) for cb in t.callback_handler.callbacks) == 1
    called = []
    monkeypatch.setattr(teardown, "_HELD", [])
    monkeypatch.setattr(
        "mmbalance.integrations.hf.trainer.wait_for_backend_threads", lambda *a: called.append(a) or True
    )
    t.callback_handler.on_train_end(t.args, t.state, t.control)  # what Trainer calls at the end of train()
    assert called == [()]


def test_datasets_length_column_and_unused_columns(tmp_path):
    datasets = pytest.importorskip("datasets")
    from transformers import Trainer, TrainingArguments

    from mmbalance.integrations.hf import balance_trainer

    rows = [S.example(i, l) for i, l in enumerate(S.lengths())]
    claimed = [100 + i for i in range(S.N)]  # the column wins over len(input_ids)
    ds = datasets.Dataset.from_dict(
        {"input_ids": [r["input_ids"].tolist() for r in rows], "length": claimed, "note": ["x"] * S.N}
    ).with_format("torch")
    ds = ds.map(lambda r: {"attention_mask": torch.ones_like(r["input_ids"]), "labels": r["input_ids"]})
    args = TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=2, report_to=[], use_cpu=True
    )
    t = balance_trainer(Trainer(model=S.build_model(), args=args, train_dataset=ds, data_collator=S.collate))
    assert t.balanced_sampler.table[:, -1].tolist() == claimed
    batch = next(iter(t.get_train_dataloader()))
    assert set(batch) == {"input_ids", "attention_mask", "labels"}, "unused columns removed as Trainer does"


def test_trl_sft_trainer(tmp_path):
    pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast
    from trl import SFTConfig, SFTTrainer

    from mmbalance.integrations.hf import balance_trainer

    vocab = {f"t{i}": i for i in range(S.VOCAB)}
    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t1")), pad_token="t0", eos_token="t2"
    )
    ids = [S.example(i, l)["input_ids"].tolist() for i, l in enumerate(S.lengths())]
    cfg = SFTConfig(output_dir=str(tmp_path), per_device_train_batch_size=2, gradient_accumulation_steps=2,
                    max_steps=3, report_to=[], use_cpu=True, disable_tqdm=True, save_strategy="no")  # fmt: skip
    t = SFTTrainer(model=S.build_model(), args=cfg, train_dataset=datasets.Dataset.from_dict({"input_ids": ids}),
                   processing_class=tok)  # fmt: skip
    assert balance_trainer(t) is t
    s = t.balanced_sampler
    assert s.table[:, -1].tolist() == S.lengths() and s.padding and s.grad_accum == 2
    assert t.get_train_dataloader().batch_sampler is s
    t.train()
    assert t.state.global_step == 3


@pytest.mark.parametrize("kind", ["parallelism_config", "get_tp_size", "sequence_parallel_size"])
def test_parallelism_whose_ranks_share_a_batch_is_refused_by_name(tmp_path, kind):
    """Tensor, context or sequence parallelism gives the ranks of one group the same batch; the
    balanced sampler gives every rank its own: refused by name, the trainer left as it was (and by
    the launch's switch too)."""
    import types

    from mmbalance.integrations.hf import balance_trainer
    from mmbalance.integrations.hf.trainer import shared_batch_parallelism

    t = _trainer(str(tmp_path))
    assert shared_batch_parallelism(t) is None
    if kind == "parallelism_config":
        t.args.parallelism_config = types.SimpleNamespace(tp_size=1, cp_size=2, sp_size=None)
        if getattr(t.accelerator, "parallelism_config", None) is not None:
            pytest.skip("the accelerator holds a parallelism config of its own")
        want = "cp_size=2"
    elif kind == "get_tp_size":
        t.get_tp_size = lambda: 2
        want = "tensor parallelism of 2"
    else:
        t.args.sequence_parallel_size = 4  # ms-swift's
        want = "sequence_parallel_size=4"
    assert shared_batch_parallelism(t) == want
    with pytest.raises(
        ValueError, match=rf"balance_trainer: the trainer runs {want}: the ranks of one such group"
    ):
        balance_trainer(t)
    assert not hasattr(t, "balanced_sampler")
