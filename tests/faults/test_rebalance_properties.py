"""Property tests of ``rebalance`` on 2 to 5 gloo ranks (hypothesis).

Every rank runs the same derandomized hypothesis search, so all ranks draw the same examples in
the same order: random plans (any destination for any example, not only balanced ones), random
empty ranks and zero-length examples, every dtype and several trailing shapes, several payloads
at once. The payload of each example is bits hashed from (example, position, column), viewed as
the dtype, so arrival is checked bit for bit (NaN patterns included). Each property is decided
globally (an all-reduce of every rank's verdict) so that a failure makes every rank shrink the
same way, in lockstep.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.dist_utils import run_distributed

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
]
SHAPES = [(), (1,), (3,), (2, 3)]
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def payload(
    ids: np.ndarray, lengths: np.ndarray, dtype: torch.dtype, shape: tuple, salt: int
) -> torch.Tensor:
    """Rows of the examples ``ids`` (each ``lengths[id]`` long): hashed bits viewed as ``dtype``."""
    rows = [(g, p) for g in ids for p in range(int(lengths[g]))]
    width = int(np.prod(shape)) if shape else 1
    g = np.array([r[0] for r in rows], dtype=np.uint64).reshape(-1, 1)
    p = np.array([r[1] for r in rows], dtype=np.uint64).reshape(-1, 1)
    c = np.arange(width, dtype=np.uint64).reshape(1, -1)
    with np.errstate(over="ignore"):
        h = (g * np.uint64(0x9E3779B97F4A7C15)) ^ (p * np.uint64(0xBF58476D1CE4E5B9)) ^ (c + np.uint64(salt))
        h ^= h >> np.uint64(31)
        h *= np.uint64(0x94D049BB133111EB)
        h ^= h >> np.uint64(29)
    size = torch.tensor([], dtype=dtype).element_size()
    if dtype == torch.bool:
        t = torch.from_numpy((h & np.uint64(1)).astype(np.uint8)).to(torch.bool)
    else:
        raw = (h >> np.uint64(64 - 8 * size)).astype(f"u{size}").view(f"i{size}" if size > 1 else "u1")
        t = torch.from_numpy(np.ascontiguousarray(raw)).to(_BITS[size]).view(dtype)
    return t.reshape(len(rows), *shape)


def bits(t: torch.Tensor) -> torch.Tensor:
    if t.dtype == torch.bool:
        return t.to(torch.uint8)
    return t.contiguous().view(_BITS[t.element_size()])


def _search(rank: int, world: int, max_examples: int) -> int:
    import torch.distributed as dist
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from mmbalance.balancing import Plan
    from mmbalance.collectives import rebalance

    ran = [0]

    def agree(ok: bool) -> bool:
        flag = torch.tensor([1 if ok else 0])
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag.item())

    @st.composite
    def cases(draw):
        counts = draw(st.lists(st.integers(0, 5), min_size=world, max_size=world))
        n = sum(counts)
        lengths = draw(st.lists(st.integers(0, 4), min_size=n, max_size=n))
        dst = draw(st.lists(st.integers(0, world - 1), min_size=n, max_size=n))
        payloads = draw(
            st.lists(st.tuples(st.sampled_from(DTYPES), st.sampled_from(SHAPES)), min_size=1, max_size=3)
        )
        return counts, lengths, dst, payloads

    @settings(
        max_examples=max_examples,
        derandomize=True,
        database=None,
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(cases())
    def prop(case):
        counts, lengths, dst, payloads = case
        ran[0] += 1
        lengths = np.asarray(lengths, dtype=np.int64)
        src = np.repeat(np.arange(world), counts).astype(np.int64)
        plan = Plan.from_destinations(lengths, np.asarray(dst, dtype=np.int64), world, src)
        mine = plan.source_order(rank)
        cu = torch.zeros(mine.size + 1, dtype=torch.int32)
        cu[1:] = torch.from_numpy(np.cumsum(lengths[mine])).to(torch.int32)
        xs = [payload(mine, lengths, dt, sh, salt) for salt, (dt, sh) in enumerate(payloads)]
        outs, out_cu = rebalance(xs, cu, plan)
        recv = plan.recv_order(rank)
        want = [payload(recv, lengths, dt, sh, salt) for salt, (dt, sh) in enumerate(payloads)]
        arrived = all(
            o.dtype == w.dtype and o.shape == w.shape and torch.equal(bits(o), bits(w))
            for o, w in zip(outs, want)
        )
        arrived = arrived and out_cu.tolist() == [0, *np.cumsum(lengths[recv]).tolist()]
        assert agree(arrived), "some rank received other bits than the plan sends it"
        back, back_cu = rebalance(outs, out_cu, plan.inverse())
        home = all(torch.equal(bits(b), bits(x)) for b, x in zip(back, xs)) and torch.equal(back_cu, cu)
        assert agree(home), "the inverse plan did not bring every example back"

    prop()
    return ran[0]


@pytest.mark.parametrize("world", [2, 3, 4, 5])
def test_every_example_arrives_once_bit_identical_and_comes_back(world):
    examples = 60 if world <= 3 else 30
    ran = run_distributed(_search, world, examples, timeout=600)
    assert ran == [ran[0]] * world and ran[0] >= examples // 2  # every rank ran the same search
