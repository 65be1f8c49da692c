"""``apply_encoder_balance`` inside the loops people run: what the model looks like to tools that
inspect it, in-place ops on the loss, ``generate``, per-call encoder options, base models with a
loss on hidden states, FSDP2 with the tower sharded on its own, a rank under ``no_grad`` alone,
the internal group's timeout, apply/remove in a loop, and videos split by frame. Each case on real
transformers classes (tiny configs), against the same model without the handle.
"""

from __future__ import annotations

import functools
import inspect
import os
import time

import numpy as np
import pytest
import torch

pytest.importorskip("transformers", minversion="5.6")

from tests.dist_utils import run_distributed  # noqa: E402
from tests.integrations import hf_zoo as Z  # noqa: E402
from tests.integrations.test_hf_balance import _grad_err, _grads, _summed  # noqa: E402

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

PG_TIMEOUT = 40.0


def _reference(model, batch, loss_fn=lambda out: out.loss):
    loss = loss_fn(model(**batch))
    loss.backward()
    grads = _summed(_grads(model))
    model.zero_grad(set_to_none=True)
    return float(loss), grads


def _compare(model, batch, loss_fn=lambda out: out.loss, **apply):
    from mmbalance.integrations.hf import apply_encoder_balance

    ref_loss, ref_grads = _reference(model, batch, loss_fn)
    with apply_encoder_balance(model, **apply) as handle:
        loss = loss_fn(model(**batch))
        loss.backward()
    got = _summed(_grads(model))
    model.zero_grad(set_to_none=True)
    return {
        "loss": (ref_loss, float(loss)),
        "grad_err": _grad_err(ref_grads, got),
        "stats": dict(handle.stats),
    }


def _two_ranks(rank: int, world: int) -> dict:
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    from mmbalance.collectives import RankMismatchError
    from mmbalance.collectives.group import group_timeout
    from mmbalance.integrations.hf import apply_encoder_balance

    out: dict = {}
    qwen = Z.build("qwen2_vl", seed=1)
    heavy = [[(8, 8)] * 2] if rank == 0 else []  # rank 1 is text-only

    # the forward keeps its signature; the internal group takes the world's timeout
    stock = inspect.signature(qwen.forward)
    with apply_encoder_balance(qwen) as handle:
        out["signature"] = inspect.signature(qwen.forward) == stock
        out["timeout"] = group_timeout(handle.group).total_seconds()

    # in-place ops on the loss (loss /= accumulation, Trainer's loss *= n)
    def inplace(o):
        loss = o.loss
        loss /= 4
        loss *= 3
        return loss

    out["inplace"] = _compare(qwen, Z.batch("qwen2_vl", qwen, heavy, seed=rank), inplace)

    # generate runs the stock forward, in train mode too (ranks generate different lengths)
    gen = Z.batch("qwen2_vl", qwen, [[(4, 4)]] * (1 + rank), seed=7 + rank)
    gen.pop("labels")
    ref = qwen.generate(**gen, max_new_tokens=3 + 2 * rank, do_sample=False)
    with apply_encoder_balance(qwen):
        got_train = qwen.generate(**gen, max_new_tokens=3 + 2 * rank, do_sample=False)
        qwen.eval()
        with torch.no_grad():
            eval_loss = float(qwen(**Z.batch("qwen2_vl", qwen, heavy, seed=rank)).loss)
        got_eval = qwen.generate(**gen, max_new_tokens=3 + 2 * rank, do_sample=False)
        qwen.train()
    with torch.no_grad():
        qwen.eval()
        stock_eval = float(qwen(**Z.batch("qwen2_vl", qwen, heavy, seed=rank)).loss)
        qwen.train()
    out["generate"] = (torch.equal(ref, got_train), torch.equal(ref, got_eval), eval_loss == stock_eval)

    # a per-call option that changes the encoder's output is honoured (LLaVA's config says -2)
    llava = Z.build("llava", seed=2)
    lb = Z.batch("llava", llava, [[1, 1], [1]] if rank == 0 else [], seed=rank)
    out["feature_layer"] = _compare(llava, {**lb, "vision_feature_layer": -1})
    with apply_encoder_balance(llava):
        llava(**{**lb, "vision_feature_layer": -1}).loss.backward()
    last = {n: g for n, g in _summed(_grads(llava)).items() if "vision_tower" in n and "layers.1." in n}
    out["last_layer_grad"] = (len(last), max(float(np.abs(g).max()) for g in last.values()))
    llava.zero_grad(set_to_none=True)

    # a base model with a loss on hidden states, and a text-only rank: every rank reaches the exchange
    from transformers import Qwen2VLModel

    base = Qwen2VLModel(Z.build("qwen2_vl", seed=3).config).float().train()
    bb = Z.batch("qwen2_vl", base, heavy, seed=rank)
    bb.pop("labels")
    out["base_model"] = _compare(base, bb, lambda o: o.last_hidden_state.square().mean())

    # one rank under no_grad in train mode: every rank raises at once, nothing hangs
    b = Z.batch("qwen2_vl", qwen, heavy, seed=rank)
    with apply_encoder_balance(qwen):
        t0 = time.perf_counter()
        try:
            if rank == 0:
                with torch.no_grad():
                    qwen(**b)
            else:
                qwen(**b).loss.backward()
            out["no_grad"] = ("no error", time.perf_counter() - t0)
        except RankMismatchError as exc:
            out["no_grad"] = (str(exc), time.perf_counter() - t0)
    qwen.zero_grad(set_to_none=True)

    # apply/remove in a loop leaves no process group and no file descriptor behind
    dist.barrier()
    groups, fds = len(c10d._world.pg_map), len(os.listdir("/proc/self/fd"))
    for _ in range(12):
        handle = apply_encoder_balance(qwen)
        qwen(**b).loss.backward()
        handle.remove()
    out["leaks"] = (len(c10d._world.pg_map) - groups, len(os.listdir("/proc/self/fd")) - fds)

    # one 8-frame video on rank 0: its frames are items of their own
    video = [[("video", 8, 4, 4)]] if rank == 0 else [[(2, 2)]]
    qwen.zero_grad(set_to_none=True)
    out["frames"] = _compare(qwen, Z.batch("qwen2_vl", qwen, video, seed=rank))
    out["whole_videos"] = _compare(qwen, Z.batch("qwen2_vl", qwen, video, seed=rank), split_frames=False)
    return out


@functools.cache
def _two():
    return run_distributed(_two_ranks, 2, timeout=600, pg_timeout=PG_TIMEOUT)


def _assert_same(res, rel=1e-5):
    ref, got = res["loss"]
    assert got == pytest.approx(ref, rel=rel)
    err, where = res["grad_err"]
    assert err < 1e-4, f"summed gradient of {where} off by {err:.2e}"


def test_the_forward_keeps_its_signature_and_the_group_the_users_timeout():
    for res in _two():
        assert res["signature"]
        assert res["timeout"] == PG_TIMEOUT


def test_in_place_ops_on_the_loss():
    for res in _two():
        _assert_same(res["inplace"])


def test_generate_and_eval_run_as_without_the_handle():
    for res in _two():
        assert res["generate"] == (True, True, True)


def test_a_per_call_vision_feature_layer_is_honoured():
    for res in _two():
        _assert_same(res["feature_layer"])
        count, largest = res["last_layer_grad"]
        assert count > 0 and largest > 0  # the last vision layer is used, so it learns


def test_a_base_model_with_a_loss_on_hidden_states_and_a_text_only_rank():
    for res in _two():
        _assert_same(res["base_model"])


def test_one_rank_under_no_grad_raises_on_every_rank_at_once():
    for res in _two():
        message, seconds = res["no_grad"]
        assert "grad enabled differs" in message and seconds < 10


def test_apply_and_remove_in_a_loop_leak_nothing():
    for res in _two():
        assert res["leaks"] == (0, 0)


def test_a_video_is_split_by_frame_exactly():
    for res in _two():
        _assert_same(res["frames"])
        _assert_same(res["whole_videos"])
        frames, whole = res["frames"]["stats"]["vision"], res["whole_videos"]["stats"]["vision"]
        assert whole["before"] > 1.8 and whole["after"] > 1.8  # one item: nothing to balance
        assert frames["after"] < 1.2


# ---------------------------------------------------------------------------------- the README's adapter
def _readme_adapter(rank: int, world: int) -> dict:
    """The README's worked adapter, as written, on a model mmbalance does not know."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    start = text.index("### Another model: an adapter")
    code = re.search(r"```python\n(.*?)```", text[start:], re.S).group(1)
    scope: dict = {}
    exec(compile(code, "README.md", "exec"), scope)  # noqa: S102 - the README's own code

    class MyModelForConditionalGeneration(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(4)
            self.encoder = torch.nn.Linear(3, 5)
            self.head = torch.nn.Linear(5, 1)

        def forward(self, items=None, lengths=None, features=None):
            if features is None:
                features = self.encoder(items) if items is not None else torch.zeros(0, 5)
            loss = self.head(torch.tanh(features)).square().sum()
            return type("Out", (), {"loss": loss})()

    g = torch.Generator().manual_seed(rank)
    lengths = np.array([5, 1, 7, 2] if rank == 0 else [], dtype=np.int64)
    batch = (
        {"items": torch.randn(int(lengths.sum()), 3, generator=g), "lengths": lengths} if rank == 0 else {}
    )
    return _compare(MyModelForConditionalGeneration(), batch)


def test_the_readme_adapter_balances_a_model_mmbalance_does_not_know():
    for res in run_distributed(_readme_adapter, 2, timeout=300, pg_timeout=PG_TIMEOUT):
        _assert_same(res)
        assert res["stats"]["vision"]["after"] < res["stats"]["vision"]["before"]


# ---------------------------------------------------------------------------------- FSDP2
def _fsdp_tower(rank: int, world: int) -> dict:
    """FSDP2 with the vision tower as a unit of its own (and the root): rank 1 has nothing to encode
    and must not touch the tower's sharded weights outside the encoder call every rank makes.
    (LLaVA's CLIP tower cannot be its own unit even without balancing: transformers' hidden-state
    capture does not see an FSDP2-wrapped CLIP model.)"""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from mmbalance.integrations.hf import apply_encoder_balance

    out = {}
    for name in ("qwen2_vl", "internvl"):
        model = Z.build(name, seed=4)
        spec = {"qwen2_vl": [[(6, 6), (4, 4)]], "internvl": [[2, 1]]}[name] if rank == 0 else []
        batch = Z.batch(name, model, spec, seed=rank)
        ref_loss, ref_grads = _reference(model, batch)
        mesh = init_device_mesh("cpu", (world,))
        tower = model.model.visual if name == "qwen2_vl" else model.model.vision_tower
        fully_shard(tower, mesh=mesh)
        fully_shard(model, mesh=mesh)
        with apply_encoder_balance(model):
            loss = model(**batch).loss
            loss.backward()
        got = {n: g.numpy() * world for n, g in _grads(model).items()}  # reduce-scatter averages
        out[name] = {"loss": (ref_loss, float(loss)), "grad_err": _grad_err(ref_grads, got)}
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_fsdp2_with_the_tower_sharded_on_its_own(world):
    for res in run_distributed(_fsdp_tower, world, timeout=600, pg_timeout=PG_TIMEOUT):
        for name in ("qwen2_vl", "internvl"):
            _assert_same(res[name])


def test_a_video_split_by_frame_is_planned_per_frame():
    """The items the planner sees (no process group needed: the adapter alone)."""
    from mmbalance.integrations.hf.encoders.models import QwenVisionAdapter

    model = Z.build("qwen2_vl", seed=1)
    batch = Z.batch("qwen2_vl", model, [[(4, 4), ("video", 3, 4, 6)]], seed=0)
    items = QwenVisionAdapter().extract(model, dict(batch))
    assert items.meta.tolist() == [[0, 1, 4, 4], [1, 1, 4, 6], [1, 1, 4, 6], [1, 1, 4, 6]]
    assert items.rows.tolist() == [16, 24, 24, 24] and items.context["frames"] == [(0, 1), (1, 3)]
    whole = QwenVisionAdapter()
    whole.splits_frames = False
    assert whole.extract(model, dict(batch)).meta.tolist() == [[0, 1, 4, 4], [1, 3, 4, 6]]
    assert np.array_equal(QwenVisionAdapter().out_rows(model, items.meta), [4, 6, 6, 6])
