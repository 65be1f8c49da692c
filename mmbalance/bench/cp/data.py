"""The data of ``mmbalance bench cp``: sequence lengths of its datasets and the steps drawn from them.

* ``mixture``: LLM lengths of the shipped multimodal sizes
  (:func:`mmbalance.balancing.datasets.mixture`: images, videos, speech; median about 1k tokens,
  longest 16.6k);
* ``long_tail_1%`` and ``long_tail_0.2%``: the same, with 1% (0.2%) of the sequences replaced by
  rare long ones of 16-64 times the mixture's median length (uniform in between, up to 65k).

A step is one packed micro-batch: sequences of one stream, taken until the next would pass
``fill`` of all ranks' memory.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np

from mmbalance.balancing.datasets import mixture

DATASETS = {"mixture": 0.0, "long_tail_1%": 0.01, "long_tail_0.2%": 0.002}
RARE_TIMES_MEDIAN = (16.0, 64.0)
FILL = 0.75
EPOCH = 1_000_000


@functools.lru_cache(maxsize=1)
def median_length() -> float:
    """The median LLM length of the shipped mixture (100k draws, seed 0)."""
    return float(np.median(mixture(100_000, 0).llm))


def draw(dataset: str, n: int, rng: np.random.Generator) -> np.ndarray:
    """``n`` sequence lengths of ``dataset`` (int64)."""
    if dataset not in DATASETS:
        raise ValueError(f"dataset must be one of {list(DATASETS)}, got {dataset!r}")
    lengths = np.maximum(mixture(n, rng).llm, 1).astype(np.int64)
    rare = rng.random(n) < DATASETS[dataset]
    lo, hi = RARE_TIMES_MEDIAN
    lengths[rare] = np.round(median_length() * rng.uniform(lo, hi, int(rare.sum()))).astype(np.int64)
    return lengths


@functools.cache
def epoch_longest(dataset: str, examples: int = EPOCH) -> int:
    """The longest sequence of a ``examples``-sequence epoch of ``dataset`` (seed 0): the length a
    fixed CP degree must hold to train on that data, whatever the steps sampled here contain."""
    return int(draw(dataset, examples, np.random.default_rng(0)).max())


def cut_steps(draw_chunk: Callable[[], np.ndarray], steps: int, target: float) -> list[tuple[int, int]]:
    """``steps`` consecutive micro-batches of a stream of lengths that ``draw_chunk()`` extends a
    chunk at a time: each takes lengths until the next would pass ``target`` (at least one).
    Returns ``[start, stop)`` positions in the stream (the chunks drawn, concatenated)."""
    lengths = draw_chunk()
    start, out = 0, list[tuple[int, int]]()
    while len(out) < steps:
        rest = lengths[start:]
        k = int(np.searchsorted(np.cumsum(rest), target, side="right"))
        if k == rest.size:  # the stream ran out before the step filled up
            lengths = np.concatenate([lengths, draw_chunk()])
            continue
        k = max(k, 1)
        out.append((start, start + k))
        start += k
    return out


def step_batches(
    dataset: str, world: int, memory_per_rank: int, steps: int, fill: float, seed: int
) -> list[np.ndarray]:
    """``steps`` consecutive micro-batches of one stream of ``dataset``: each takes sequences until
    the next would pass ``fill * world * memory_per_rank`` tokens (at least one sequence)."""
    rng = np.random.default_rng([seed, world, memory_per_rank, list(DATASETS).index(dataset)])
    target = fill * world * memory_per_rank
    chunk = max(64, int(2 * target / 1000))
    drawn: list[np.ndarray] = []

    def more() -> np.ndarray:
        drawn.append(draw(dataset, chunk, rng))
        return drawn[-1]

    bounds = cut_steps(more, steps, target)
    stream = np.concatenate(drawn)
    out = [stream[a:b] for a, b in bounds]
    for batch in out:
        if int(batch.max()) > world * memory_per_rank:
            raise ValueError(
                f"{dataset}: a sequence of {int(batch.max())} tokens exceeds {world} ranks x {memory_per_rank}"
            )
    return out
