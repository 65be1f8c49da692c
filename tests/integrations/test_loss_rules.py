"""Which trainers' losses regrouping keeps (``hf/loss.py``), and what ``balance_trainer`` and
``balance_every_trainer`` do with the others: refuse, or leave the batches and the loss as they
are with a warning, never switch the normalization on where it would change the loss."""

from __future__ import annotations

import warnings

import pytest

transformers = pytest.importorskip("transformers", minversion="5.6")

from mmbalance.integrations.hf import balance_every_trainer, balance_trainer  # noqa: E402
from mmbalance.integrations.hf import loss as L  # noqa: E402
from tests.integrations.test_every_trainer import _args, _collate, _rows, _tiny  # noqa: E402


class OwnLoss(transformers.Trainer):
    """A loss of one's own: a mean over the micro-batch (as preference and RL trainers have)."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        out = model(**inputs)
        return (out.loss, out) if return_outputs else out.loss


class KeepsTrainersLoss(transformers.Trainer):
    """A subclass that leaves ``compute_loss`` as transformers has it."""


class MeanPerCall(transformers.LlamaForCausalLM):
    """A model whose forward takes no loss keywords (its loss is a mean over each call)."""

    def forward(self, input_ids=None, attention_mask=None, labels=None):
        return super().forward(input_ids=input_ids, attention_mask=attention_mask, labels=labels)


def _trainer(tmp, cls=transformers.Trainer, model=None, **extra):
    return cls(
        model=model or _tiny(), args=_args(tmp, **extra), train_dataset=_rows(), data_collator=_collate
    )


def test_the_class_that_defines_compute_loss_decides(tmp_path):
    plain, keeps, own = _trainer(tmp_path), _trainer(tmp_path, KeepsTrainersLoss), _trainer(tmp_path, OwnLoss)
    assert L.loss_owner(plain) == L.loss_owner(keeps) == "transformers.trainer.Trainer"
    assert L.loss_owner(own) == f"{__name__}.OwnLoss"
    assert L.regrouping_changes_loss(plain, plain.model) is None
    assert L.regrouping_changes_loss(keeps, keeps.model) is None
    why = L.regrouping_changes_loss(own, own.model)
    assert why.startswith("OwnLoss's loss (") and "not a token mean" in why and "TOKEN_MEAN_LOSSES" in why, (
        why
    )
    # a compute_loss that is the step's token sum over the count can say so
    L.TOKEN_MEAN_LOSSES[L.loss_owner(own)] = False
    try:
        assert L.regrouping_changes_loss(own, own.model) is None
    finally:
        del L.TOKEN_MEAN_LOSSES[L.loss_owner(own)]
    # transformers' loss over a model that does not take the count: a mean per micro-batch
    import torch

    torch.manual_seed(0)
    mean = MeanPerCall(_tiny().config)
    trainer = _trainer(tmp_path, model=mean)
    assert "MeanPerCall's loss is a mean over each micro-batch" in L.regrouping_changes_loss(trainer, mean)
    trainer.compute_loss_func = lambda outputs, labels, num_items_in_batch=None: outputs.loss
    assert L.regrouping_changes_loss(trainer, mean) is None  # transformers hands it the count

    def mean_loss(outputs, labels):  # as LLaMA-Factory's ASFT loss: no count taken
        return outputs.loss

    trainer.compute_loss_func = mean_loss
    why = L.regrouping_changes_loss(trainer, mean)
    assert "loss function (" in why and "mean_loss) takes no num_items_in_batch" in why, why


def test_the_normalization_is_switched_on_and_back(tmp_path):
    trainer = _trainer(tmp_path)
    trainer.model_accepts_loss_kwargs = False  # as LLaMA-Factory sets it for multimodal models
    undo = L.normalize_over_step(trainer, trainer.model)
    assert trainer.model_accepts_loss_kwargs is True
    undo()
    assert trainer.model_accepts_loss_kwargs is False
    fresh = _trainer(tmp_path)
    assert "model_accepts_loss_kwargs" in fresh.__dict__  # Trainer sets it in __init__
    del fresh.__dict__["model_accepts_loss_kwargs"]
    L.normalize_over_step(fresh, fresh.model)()
    assert "model_accepts_loss_kwargs" not in fresh.__dict__


def test_balance_trainer_refuses_a_loss_it_would_change_and_leaves_the_trainer(tmp_path):
    own = _trainer(tmp_path, OwnLoss)
    own.model_accepts_loss_kwargs = False
    with pytest.raises(ValueError, match=r"balance_trainer: OwnLoss's loss .* not a token mean"):
        balance_trainer(own)
    assert own.model_accepts_loss_kwargs is False and not hasattr(own, "balanced_sampler")
    # an SFT trainer that had the normalization off gets it on (and balanced batches)
    plain = _trainer(tmp_path)
    plain.model_accepts_loss_kwargs = False
    balance_trainer(plain)
    assert plain.model_accepts_loss_kwargs is True and hasattr(plain, "balanced_sampler")


def test_the_switch_leaves_other_losses_and_unbalanced_batches_alone(tmp_path):
    with balance_every_trainer(encoders=False) as handle:
        own = _trainer(tmp_path / "own", OwnLoss)
        own.model_accepts_loss_kwargs = False
        with pytest.warns(UserWarning, match=r"OwnLoss: batches are left as drawn: OwnLoss's loss"):
            own.train()
        assert own.model_accepts_loss_kwargs is False and not hasattr(own, "balanced_sampler")
        assert own in handle.trainers
    with balance_every_trainer(encoders=False, batches=False):
        plain = _trainer(tmp_path / "plain")
        plain.model_accepts_loss_kwargs = False
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)  # nothing to say: nothing was asked
            plain.train()
        assert plain.model_accepts_loss_kwargs is False, "no batches balanced: the loss is the trainer's"
    # the reference of a balanced run: the normalization alone, for the trainers it keeps
    with balance_every_trainer(encoders=False, batches=False, token_mean_loss=True):
        ref = _trainer(tmp_path / "ref")
        ref.model_accepts_loss_kwargs = False
        ref.train()
        assert ref.model_accepts_loss_kwargs is True and not hasattr(ref, "balanced_sampler")
        own = _trainer(tmp_path / "own2", OwnLoss)
        own.model_accepts_loss_kwargs = False
        with pytest.warns(
            UserWarning, match="the loss is left as the trainer computes it: OwnLoss's loss"
        ) as got:
            own.train()
        assert own.model_accepts_loss_kwargs is False
        # the warning names all it leaves, what the options asked for too
        text = str(got[0].message)
        assert text.endswith(
            "batches are left as drawn (--no-batches) (left as the framework runs them: the batches)"
        )


def test_context_parallelism_on_a_loss_it_would_change_is_refused(tmp_path):
    with balance_every_trainer(encoders=False, context_parallel=True, max_tokens_per_rank=64):
        own = _trainer(tmp_path, OwnLoss)
        with pytest.raises(
            ValueError, match="--context-parallel regroups the sequences of every step: OwnLoss"
        ):
            own.train()


def _moe(**extra):
    import torch

    torch.manual_seed(0)
    cfg = transformers.Qwen3MoeConfig(vocab_size=64, hidden_size=16, intermediate_size=32, moe_intermediate_size=8,
                                      num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                                      num_experts=4, num_experts_per_tok=2, **extra)  # fmt: skip
    return transformers.Qwen3MoeForCausalLM(cfg)


def test_a_router_auxiliary_loss_is_refused_by_name(tmp_path):
    """A mixture-of-experts model with ``output_router_logits`` on adds its router's auxiliary loss,
    a mean over each forward's tokens: ``balance_trainer`` refuses it, the launch's switch leaves
    the batches as drawn, and dynamic CP refuses it when applied; with it off (or a zero
    coefficient) the loss is a token mean again."""
    from mmbalance.integrations.hf import apply_dynamic_cp, register_attention

    on = _moe(output_router_logits=True, router_aux_loss_coef=0.01)
    register_attention()
    on.set_attn_implementation("mmbalance_varlen")
    assert L.router_aux_loss(on) == "output_router_logits=True, router_aux_loss_coef=0.01"
    assert L.router_aux_loss(_moe()) is None
    assert L.router_aux_loss(_moe(output_router_logits=True, router_aux_loss_coef=0.0)) is None
    trainer = _trainer(tmp_path, model=on)
    with pytest.raises(ValueError, match=r"balance_trainer: Qwen3MoeForCausalLM adds its router's auxiliary loss "
                                         r"\(output_router_logits=True, router_aux_loss_coef=0.01\)"):  # fmt: skip
        balance_trainer(trainer)
    assert not hasattr(trainer, "balanced_sampler")
    with pytest.raises(
        ValueError, match=r"model: dynamic context parallelism does not run the router's auxiliary"
    ):
        apply_dynamic_cp(on, max_tokens_per_rank=64)
    # a vision-language model's text config is read too
    vlm = transformers.Qwen3VLMoeConfig(
        text_config=dict(output_router_logits=True, router_aux_loss_coef=0.001)
    )
    holder = type("M", (), {"config": vlm})()
    assert L.router_aux_loss(holder) == "output_router_logits=True, router_aux_loss_coef=0.001"
    assert L.regrouping_changes_loss(_trainer(tmp_path), _moe()) is None


def test_label_smoothing_without_the_count_is_refused_by_name(tmp_path):
    """Label smoothing is the step's token sum over its count where transformers' LabelSmoother
    takes ``num_items_in_batch`` (5.15 on); a smoother that does not is a mean over each
    micro-batch, refused by name."""
    smoothed = _trainer(tmp_path, label_smoothing_factor=0.1)
    takes = (
        "num_items_in_batch" in __import__("inspect").signature(smoothed.label_smoother.__call__).parameters
    )
    assert (L.regrouping_changes_loss(smoothed, smoothed.model) is None) == takes

    class OldSmoother:  # as transformers' before 5.15
        epsilon = 0.1

        def __call__(self, model_output, labels, shift_labels=False):
            raise AssertionError("not called")

    smoothed.label_smoother = OldSmoother()
    why = L.regrouping_changes_loss(smoothed, smoothed.model)
    assert (
        why is not None
        and "label smoothing (label_smoothing_factor=0.1) is a mean over each micro-batch" in why
    )
