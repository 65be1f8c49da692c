"""Balanced pipeline partition and resource allocation: exact optima against brute force, errors."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mmbalance.balancing import ModuleCost, allocate_resources, balanced_partition
from mmbalance.balancing.paper import paper_partition

SETTINGS = settings(
    max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)


def metrics(fwd, act, cuts, w):
    """Eqs. 4-5 written out for one partition (cuts: first layer of every stage after the first)."""
    bounds = [0, *cuts, len(fwd)]
    stages = [sum(fwd[bounds[i] : bounds[i + 1]]) for i in range(len(bounds) - 1)]
    mean = sum(fwd) / len(stages)
    var = sum((s - mean) ** 2 for s in stages)
    comm = sum(act[c - 1] for c in cuts)
    return var + w * comm, max(stages)


layers = st.integers(1, 9).flatmap(
    lambda n: st.tuples(
        st.lists(st.floats(0.0, 10.0), min_size=n, max_size=n),
        st.lists(st.floats(0.0, 5.0), min_size=n, max_size=n),
    )
)


@SETTINGS
@given(model=layers, stages=st.integers(1, 4), w=st.sampled_from([0.0, 0.1, 1.0]), radius=st.integers(0, 2))
def test_partition_is_the_exact_optimum_of_the_papers_metric(model, stages, w, radius):
    fwd, act = model
    if stages > len(fwd):
        return
    plan = balanced_partition(fwd, act, stages, radius=radius, comm_weight=w, top_k=3)
    allcuts = list(itertools.combinations(range(1, len(fwd)), stages - 1))
    best = min(metrics(fwd, act, c, w)[0] for c in allcuts)
    assert plan.best.score == pytest.approx(best, rel=1e-9, abs=1e-9)
    b = plan.best.boundaries
    assert len(b) == stages and b[-1] == len(fwd) and all(x < y for x, y in zip((0,) + b, b))
    assert plan.best.score == pytest.approx(metrics(fwd, act, b[:-1], w)[0], rel=1e-9, abs=1e-9)
    paper = paper_partition(fwd, act, stages, radius=radius, comm_weight=w)
    assert plan.best.score <= paper.best.score + 1e-9
    scores = [c.score for c in plan.candidates]
    assert scores == sorted(scores) and len(plan.candidates) <= 3
    # the min-bottleneck partition is among the candidates considered
    minmax = min(metrics(fwd, act, c, w)[1] for c in allcuts)
    full = balanced_partition(fwd, act, stages, radius=radius, comm_weight=w, top_k=10**6)
    assert min(c.bottleneck for c in full.candidates) == pytest.approx(minmax, rel=1e-9, abs=1e-9)


def test_partition_example_vision_then_language():
    vit = [1.0] * 8  # cheap layers with large activations
    llm = [3.0] * 8
    fwd = vit + llm
    act = [64.0] * 7 + [4.0] + [16.0] * 8  # cutting after the projector (layer 8) is cheap
    plan = balanced_partition(fwd, act, 4, comm_weight=0.01)
    assert plan.best.source in ("dp-optimal", "dp-jitter", "minmax", "paper-jitter", "paper-anchor")
    assert "chosen" in plan.explain()
    timed = balanced_partition(fwd, act, 4, evaluate=lambda b: float(b[0]))  # fastest = earliest first cut
    assert timed.best.measured == min(c.measured for c in timed.candidates)


def brute_allocation(times, batch, num_gpus, tps, llm, cap=0.0, mem=None):
    """Every TP, DP (DP_llm | batch, DP_m | DP_llm) and PP within the GPUs: the least iteration time."""
    names = list(times)
    best = None
    for tp in itertools.product(tps, repeat=len(names)):
        for dl in [d for d in range(1, batch + 1) if batch % d == 0]:
            divs = [d for d in range(1, dl + 1) if dl % d == 0]
            for dps in itertools.product(divs, repeat=len(names)):
                dp = [dl if names[m] == llm else dps[m] for m in range(len(names))]
                for pp in itertools.product(range(1, num_gpus + 1), repeat=len(names)):
                    units = sum(tp[m] * dp[m] * pp[m] for m in range(len(names)))
                    if units > num_gpus:
                        continue
                    ok = True
                    stage, warm = [], 0.0
                    for m, name in enumerate(names):
                        mb = dl // dp[m]
                        c = mb * times[name](tp[m])
                        if mem:
                            p_, o_, a_ = mem[name]
                            use = p_ / (pp[m] * tp[m]) + o_ / (tp[m] * dp[m] * pp[m]) + mb * a_ / tp[m]
                            ok &= use <= cap * (1 + 1e-12)
                        stage.append(c / pp[m])
                        warm += c
                    if ok:
                        t = warm + max(stage) * (batch // dl - 1)
                        best = t if best is None else min(best, t)
    return best


@pytest.mark.parametrize("num_gpus", [3, 6, 9, 12], ids=lambda n: f"gpus{n}")
@pytest.mark.parametrize("batch", [2, 4], ids=lambda b: f"batch{b}")
def test_allocation_is_the_exact_optimum(num_gpus, batch):
    times = {
        "vit": lambda tp: 3.0 / tp + 0.2 * tp,
        "llm": lambda tp: 10.0 / tp + 0.1 * tp,
        "gen": lambda tp: 1.0,
    }
    a = allocate_resources(times, num_gpus, batch, tp_options=(1, 2))
    brute = brute_allocation(times, batch, num_gpus, (1, 2), "llm")
    assert a.iteration_time == pytest.approx(brute, rel=1e-12)
    assert a.gpus <= num_gpus and sum(m.gpus for m in a.modules.values()) == a.gpus
    relaxed = allocate_resources(times, num_gpus, batch, tp_options=(1, 2), relaxed=True)
    assert a.iteration_time <= relaxed.iteration_time + 1e-12


def test_allocation_respects_memory():
    times = {"vit": lambda tp: 2.0 / tp, "llm": lambda tp: 8.0 / tp}
    mem = {"vit": (10.0, 20.0, 1.0), "llm": (80.0, 160.0, 4.0)}
    mods = {k: ModuleCost(times[k], params=p, optimizer=o, activation=a) for k, (p, o, a) in mem.items()}
    a = allocate_resources(mods, 12, 4, tp_options=(1, 2), gpu_memory=40.0)
    brute = brute_allocation(times, 4, 12, (1, 2), "llm", cap=40.0, mem=mem)
    assert a.iteration_time == pytest.approx(brute, rel=1e-12)
    for name, m in a.modules.items():
        p_, o_, a_ = mem[name]
        mb = a.modules["llm"].dp // m.dp
        assert p_ / (m.pp * m.tp) + o_ / (m.tp * m.dp * m.pp) + mb * a_ / m.tp <= 40.0 + 1e-9
    assert "GPUs" in a.explain()


def test_allocation_with_a_table_of_times():
    a = allocate_resources(
        {"vit": {1: 2.0, 2: 1.2}, "llm": {1: 8.0, 2: 4.4, 4: 2.5}}, 8, 4, tp_options=(1, 2, 4)
    )
    assert a.modules["vit"].tp in (1, 2)


@pytest.mark.parametrize(
    "call, err, match",
    [
        (lambda: balanced_partition([1.0, 2.0], [1.0], 2), ValueError, "activations"),
        (lambda: balanced_partition([1.0, -2.0], [1.0, 1.0], 2), ValueError, "layer_times"),
        (lambda: balanced_partition([1.0, 2.0], [1.0, 1.0], 3), ValueError, "num_stages"),
        (lambda: balanced_partition([1.0, 2.0], [1.0, 1.0], 2, comm_weight=-1), ValueError, "comm_weight"),
        (lambda: balanced_partition([1.0, 2.0], [1.0, 1.0], 2, radius=-1), ValueError, "radius"),
        (lambda: allocate_resources({"vit": lambda tp: 1.0}, 8, 4), ValueError, "llm"),
        (lambda: allocate_resources({"llm": lambda tp: -1.0}, 8, 4), ValueError, "llm"),
        (lambda: allocate_resources({"llm": lambda tp: 1.0}, 0, 4), ValueError, "num_gpus"),
        (lambda: allocate_resources({"llm": lambda tp: 1.0}, 8, 4, gpu_memory=0), ValueError, "gpu_memory"),
        (
            lambda: allocate_resources({"llm": lambda tp: 1.0}, 8, 4, tp_options=(16,)),
            ValueError,
            "no configuration",
        ),
        (lambda: allocate_resources([], 8, 4), TypeError, "modules"),
    ],
    ids=[
        "act-length",
        "negative",
        "stages",
        "weight",
        "radius",
        "no-llm",
        "bad-time",
        "gpus",
        "memory",
        "nothing",
        "type",
    ],
)
def test_errors_name_the_argument(call, err, match):
    with pytest.raises(err, match=match):
        call()


def test_deterministic():
    rng = np.random.default_rng(2)
    fwd, act = rng.random(40), rng.random(40)
    a = balanced_partition(fwd, act, 6)
    b = balanced_partition(fwd, act, 6)
    assert [c.boundaries for c in a.candidates] == [c.boundaries for c in b.candidates]


def test_a_huge_radius_is_the_whole_model_not_a_hang():
    # the paper's jitter set grows as (2 radius + 1)^stages; a radius past the layer count means
    # "every cut", which is answered directly
    rng = np.random.default_rng(0)
    fwd, act = rng.uniform(1, 10, 24), rng.uniform(0, 1, 24)
    huge = balanced_partition(fwd, act, 4, radius=10**6, comm_weight=0.1)
    whole = balanced_partition(fwd, act, 4, radius=24, comm_weight=0.1)
    assert list(huge.best.boundaries) == list(whole.best.boundaries)
    assert huge.best.score == whole.best.score
