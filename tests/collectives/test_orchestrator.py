"""The orchestrator: a two-encoder model trained with and without it gives the same loss and grads."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mmbalance.balancing import PhaseSpec
from mmbalance.collectives import Orchestrator
from tests.dist_utils import run_distributed

pytestmark = pytest.mark.distributed

DV, DA, DT, H = 5, 4, 3, 6
DS_V, DS_A = 2, 3
ORDERS = [("vision", "audio", "text"), ("text", "vision", "audio")]


def _params(seed=0):
    g = torch.Generator().manual_seed(seed)

    def p(*shape):
        return (torch.randn(*shape, generator=g, dtype=torch.float64) * 0.4).requires_grad_(True)

    return {
        "wv": p(DV, H),
        "wvc": p(DS_V * H, H),
        "wa": p(DA, H),
        "wac": p(DS_A * H, H),
        "wt": p(DT, H),
        "w1": p(H, H),
        "w2": p(H, H),
        "wo": p(H),
    }


def _examples(world, step, per_rank=5):
    """Global example list: dict with vision/audio/text features and an order id; per-rank split."""
    rng = np.random.default_rng(100 + step)
    g = torch.Generator().manual_seed(100 + step)
    ex, owner = [], []
    for r in range(world):
        for _ in range(int(rng.integers(0, per_rank + 3)) if r else per_rank):
            lv = DS_V * int(rng.integers(0, 5)) if rng.random() < 0.7 else 0
            la = DS_A * int(rng.integers(0, 4)) if rng.random() < 0.5 else 0
            lt = int(rng.integers(1, 7))
            ex.append(
                {
                    "vision": torch.randn(lv, DV, generator=g, dtype=torch.float64),
                    "audio": torch.randn(la, DA, generator=g, dtype=torch.float64),
                    "text": torch.randn(lt, DT, generator=g, dtype=torch.float64),
                    "order": int(rng.integers(0, 2)),
                }
            )
            owner.append(r)
    return ex, np.asarray(owner)


def _encode(P, part, x):
    if part == "vision":
        h = torch.tanh(x @ P["wv"])
        return h.reshape(-1, DS_V * H) @ P["wvc"]
    if part == "audio":
        h = torch.tanh(x @ P["wa"])
        return h.reshape(-1, DS_A * H) @ P["wac"]
    return x @ P["wt"]


def _llm_loss_sum(P, seq, seg, n):
    """Per-token MLP plus each example's mean (a per-example interaction)."""
    sums = torch.zeros(n, H, dtype=seq.dtype).index_add(0, seg, seq)
    cnt = (
        torch.zeros(n, dtype=seq.dtype).index_add(0, seg, torch.ones_like(seg, dtype=seq.dtype)).clamp(min=1)
    )
    y = torch.tanh(seq @ P["w1"] + (sums / cnt[:, None])[seg] @ P["w2"])
    return ((y @ P["wo"]) ** 2).sum()


def _loss_examples(P, examples, total_tokens):
    """Reference: every example encoded and assembled on its own."""
    seqs = []
    for e in examples:
        parts = {k: _encode(P, k, e[k]) for k in ("vision", "audio", "text")}
        seqs.append(torch.cat([parts[k] for k in ORDERS[e["order"]]]))
    if not seqs:
        return torch.zeros((), dtype=torch.float64)
    seq = torch.cat(seqs)
    seg = torch.repeat_interleave(torch.arange(len(seqs)), torch.tensor([s.shape[0] for s in seqs]))
    return _llm_loss_sum(P, seq, seg, len(seqs)) / total_tokens


def _llm_tokens(e):
    return e["vision"].shape[0] // DS_V + e["audio"].shape[0] // DS_A + e["text"].shape[0]


def _packed(mine, part):
    xs = [e[part] for e in mine]
    lens = np.array([x.shape[0] for x in xs], dtype=np.int64)
    cu = torch.zeros(len(xs) + 1, dtype=torch.int32)
    cu[1:] = torch.from_numpy(np.cumsum(lens)).to(torch.int32)
    width = {"vision": DV, "audio": DA, "text": DT}[part]
    return (torch.cat(xs) if xs else torch.zeros(0, width, dtype=torch.float64)), cu, lens


def _worker(rank, world, steps):
    import torch.distributed as dist

    from mmbalance.balancing import PhaseSpec
    from mmbalance.collectives import Orchestrator

    out = []
    orch = Orchestrator(
        {"vision": PhaseSpec("sum", downsample=DS_V), "audio": PhaseSpec("padded", downsample=DS_A)},
        orders=ORDERS,
    )
    for step in range(steps):
        examples, owner = _examples(world, step)
        total = sum(_llm_tokens(e) for e in examples)
        mine = [e for e, o in zip(examples, owner) if o == rank]
        res = {}
        for mode in ("balanced", "local"):
            P = _params()
            if mode == "local":
                loss = _loss_examples(P, mine, total)
            else:
                v, v_cu, v_len = _packed(mine, "vision")
                a, a_cu, a_len = _packed(mine, "audio")
                t, t_cu, t_len = _packed(mine, "text")
                plan = orch.submit(
                    {"vision": v_len, "audio": a_len, "text": t_len}, order_ids=[e["order"] for e in mine]
                ).result()
                parts = {}
                for name, x, cu, ds in (("vision", v, v_cu, DS_V), ("audio", a, a_cu, DS_A)):
                    xe, cue = plan.to_encoder(name, x, cu)
                    feats = _encode(P, name, xe)
                    parts[name] = plan.to_llm(
                        name, feats, torch.div(cue, ds, rounding_mode="floor").to(torch.int32)
                    )
                parts["text"] = plan.to_llm("text", _encode(P, "text", t), t_cu)
                seq, cu = plan.assemble(parts)
                n = cu.shape[0] - 1
                lens = (cu[1:] - cu[:-1]).long()
                seg = torch.repeat_interleave(torch.arange(n), lens)
                loss = _llm_loss_sum(P, seq, seg, n) / total
                res["summary"] = plan.summary()
            loss.backward()
            grads = torch.cat([p.grad.reshape(-1) for p in P.values()])
            lt = loss.detach().clone()
            dist.all_reduce(grads)
            dist.all_reduce(lt)
            res[mode] = (float(lt), grads.numpy())
        # single-process reference on all examples
        P = _params()
        ref = _loss_examples(P, examples, total)
        ref.backward()
        res["ref"] = (float(ref), torch.cat([p.grad.reshape(-1) for p in P.values()]).detach().numpy())
        out.append(res)
    orch.close()
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_two_encoder_model_same_loss_and_grads(world):
    results = run_distributed(_worker, world, 2, timeout=240)
    for res in results[0]:
        ref_loss, ref_grad = res["ref"]
        for mode in ("balanced", "local"):
            loss, grad = res[mode]
            assert abs(loss - ref_loss) <= 1e-12 * max(1.0, abs(ref_loss)), (mode, loss, ref_loss)
            np.testing.assert_allclose(grad, ref_grad, rtol=1e-10, atol=1e-12)
        assert set(res["summary"]) == {"vision", "audio", "llm"}


@pytest.mark.parametrize(
    ("make", "word"),
    [
        (lambda: PhaseSpec("max"), "policy"),
        (lambda: PhaseSpec("conv", alpha=-1.0), "alpha"),
        (lambda: PhaseSpec("conv", beta=float("nan")), "beta"),
        (lambda: PhaseSpec(downsample=0), "downsample"),
        (lambda: PhaseSpec(downsample=True), "downsample"),
        # an order that leaves a modality out would drop its tokens at assembly
        (
            lambda: Orchestrator({"vision": PhaseSpec(), "audio": PhaseSpec()}, orders=[("vision", "text")]),
            "order",
        ),
        (lambda: Orchestrator({"vision": PhaseSpec()}, orders=[("vision", "vision", "text")]), "order"),
        (lambda: Orchestrator({"vision": PhaseSpec()}, llm="sum"), "llm"),
        (lambda: Orchestrator({"vision": PhaseSpec()}, ranks_per_node=0), "ranks_per_node"),
    ],
    ids=[
        "policy",
        "alpha",
        "beta",
        "downsample0",
        "downsample-bool",
        "order-missing",
        "order-dup",
        "llm",
        "rpn",
    ],
)
def test_bad_configuration_is_refused_at_construction(make, word):
    """Not at ``future.result()`` in the planning thread: where the user wrote it."""
    with pytest.raises((ValueError, TypeError), match=word):
        make()


def test_phase_spec_uses_the_same_default_beta():
    from mmbalance.balancing import DEFAULT_BETA, PhaseSpec

    assert PhaseSpec("quadratic").beta == PhaseSpec("conv").beta == DEFAULT_BETA
    assert PhaseSpec("sum").beta == 0.0 and PhaseSpec("quadratic", beta=0.0).beta == 0.0
