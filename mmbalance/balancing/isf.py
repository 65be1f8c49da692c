"""Balanced dynamic mini-batches by ISF (OmniBal section 4.1), and the paper's Pad and Dist Ratios.

Each training sample has a vision size (images or 448px tiles, or ViT tokens) and a text size (its
LLM tokens). ISF packs samples into mini-batches whose vision total stays under ``Q_v`` and text
total under ``Q_t`` and keeps only mini-batches that reach ``Q'_v`` or ``Q'_t``, repeating on the
rest, so every device's mini-batch is close to the caps in at least one modality: packed (Pad Ratio
0) and similar across devices (low Dist Ratio).

Beyond the paper: what is left after the iterations is packed first-fit-decreasing instead of one
more random pass, and with ``num_devices`` the mini-batches are arranged into steps of similar
size (sorted by text, then vision, then chunked; step order shuffled), which lowers the Dist Ratio
further; ``balance_steps=False`` keeps the paper's random order.

>>> pad_ratio([4, 2, 2])          # eq. 1: (0 + 2 + 2) / (4 * 3)
0.3333333333333333
>>> dist_ratio([100, 80, 100, 60])  # eq. 2: (0 + 20 + 0 + 40) / (100 * 4)
0.15
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ._core_api import core
from .validate import as_count, as_lengths


def pad_ratio(lengths_of_one_batch) -> float:
    """OmniBal eq. 1: padding of one padded mini-batch, ``sum(t_max - t_i) / (t_max * B)``.

    Empty or all-zero batches: 0.
    """
    t = as_lengths(lengths_of_one_batch, "lengths_of_one_batch").astype(np.float64)
    if t.size == 0 or t.max() == 0:
        return 0.0
    return float((t.max() - t).sum() / (t.max() * t.size))


def dist_ratio(tokens_per_device) -> float:
    """OmniBal eq. 2: idle share across devices in one step, ``sum(T_max - T_i) / (T_max * N)``.

    ``tokens_per_device``: the mini-batch tokens of each of the ``N`` devices. Empty or all-zero: 0.
    """
    t = as_lengths(tokens_per_device, "tokens_per_device").astype(np.float64)
    if t.size == 0 or t.max() == 0:
        return 0.0
    return float((t.max() - t).sum() / (t.max() * t.size))


class Batches(list):
    """ISF mini-batches: a ``list`` of int64 index arrays, in the order devices consume them.

    With ``num_devices = N`` device ``r`` of step ``t`` takes ``self[t * N + r]``. Attributes:
    ``num_leftover`` (samples grouped after the last iteration), ``num_oversized`` (samples larger
    than a cap, each alone in a mini-batch), ``max_vision``, ``max_text``.
    """

    def __init__(self, batches, info: dict):
        super().__init__(batches)
        self.info = info
        for k, v in info.items():
            setattr(self, k, v)


def _sizes(vision, text):
    v = as_lengths(vision, "vision")
    t = as_lengths(text, "text")
    if v.shape != t.shape:
        raise ValueError(f"vision and text must have one entry per sample, got {v.shape[0]} and {t.shape[0]}")
    return v, t


def isf_batches(
    vision,
    text,
    *,
    max_vision: int,
    max_text: int,
    min_vision: int | None = None,
    min_text: int | None = None,
    iterations: int = 10,
    seed: int = 0,
    num_devices: int | None = None,
    pack_leftovers: bool = True,
    balance_steps: bool = True,
) -> Batches:
    """Iterative sampling and filtering into balanced mini-batches (OmniBal section 4.1, algs. 1-2).

    Args:
        vision, text: ``[n]`` per-sample sizes (e.g. 448px tiles and LLM tokens).
        max_vision, max_text: the caps ``Q_v`` and ``Q_t`` of a mini-batch.
        min_vision, min_text: the targets ``Q'_v`` and ``Q'_t`` a kept mini-batch reaches in one of
            the two; default ``Q_v`` and ``Q_t - 128`` (the paper's setting).
        iterations: sampling-and-filtering rounds ``T`` (the paper uses 10).
        seed: the random permutations (a platform-independent generator: the same batches on every
            rank and machine).
        num_devices: arrange the mini-batches in steps of this many devices.
        pack_leftovers: first-fit-decreasing for the samples left after the last round (else one
            more random pass, as the paper's code).
        balance_steps: with ``num_devices``, steps of similar mini-batches (else random order).

    Returns:
        :class:`Batches`. Every sample is in exactly one mini-batch; a sample larger than a cap is
        alone in its mini-batch (the paper's code drops it).

    Example:
        >>> v, t = [1, 2, 3, 1, 2, 3, 2, 2], [10, 20, 30, 10, 20, 30, 20, 20]
        >>> b = isf_batches(v, t, max_vision=4, max_text=40, min_text=40)
        >>> sorted(sorted(x.tolist()) for x in b)  # every mini-batch exactly at both caps
        [[0, 5], [1, 6], [2, 3], [4, 7]]
    """
    v, t = _sizes(vision, text)
    qv = as_count(max_vision, "max_vision")
    qt = as_count(max_text, "max_text")
    mv = qv if min_vision is None else as_count(min_vision, "min_vision", minimum=0)
    mt = max(0, qt - 128) if min_text is None else as_count(min_text, "min_text", minimum=0)
    iters = as_count(iterations, "iterations", minimum=0)
    seed = as_count(seed, "seed", minimum=0)
    group, num_groups, leftover = core().isf_groups(v, t, qv, qt, mv, mt, iters, seed, bool(pack_leftovers))
    order = np.argsort(group, kind="stable")
    bounds = np.concatenate([[0], np.cumsum(np.bincount(group, minlength=num_groups))])
    batches = [order[bounds[k] : bounds[k + 1]].astype(np.int64) for k in range(num_groups)]
    gv = np.bincount(group, weights=v, minlength=num_groups)
    gt = np.bincount(group, weights=t, minlength=num_groups)
    if num_devices is not None and balance_steps and num_groups:
        nd = as_count(num_devices, "num_devices")
        by_size = np.lexsort((np.arange(num_groups), -gv, -gt))  # text, then vision, descending
        full = num_groups // nd
        steps = core().permutation(full, seed + 1) if full else np.zeros(0, dtype=np.int64)
        seq = [by_size[s * nd : (s + 1) * nd] for s in steps] + [by_size[full * nd :]]
        perm = np.concatenate(seq).astype(np.int64)
    else:
        if num_devices is not None:
            as_count(num_devices, "num_devices")
        perm = core().permutation(num_groups, seed + 1)
    info = {
        "num_leftover": int(leftover),
        "num_oversized": int(np.count_nonzero((v > qv) | (t > qt))),
        "max_vision": qv,
        "max_text": qt,
    }
    return Batches([batches[k] for k in perm], info)


@dataclass(frozen=True)
class BatchStats:
    """Balance of mini-batches consumed ``num_devices`` at a time (OmniBal table 5 columns).

    ``pad_ratio``: padding share over all mini-batches if each were padded to its longest text
    (0 for packed ISF batches when ``packed``); ``vision_dist_ratio`` / ``text_dist_ratio``: eq. 2
    per step, averaged over the full steps; ``mean_batch_size``: samples per mini-batch.
    """

    pad_ratio: float
    vision_dist_ratio: float
    text_dist_ratio: float
    mean_batch_size: float
    steps: int


def batch_stats(batches, vision, text, num_devices: int, *, packed: bool = True) -> BatchStats:
    """Pad and Dist Ratios of ``batches`` as the paper measures them (its ``get_pad_dist_ratio``).

    Step ``s`` is ``batches[s * N : (s + 1) * N]``; an incomplete last step is left out. A device's
    text tokens are its mini-batch's sum (``packed``) or ``B * max`` (padded); vision is the sum.
    """
    v, t = _sizes(vision, text)
    nd = as_count(num_devices, "num_devices")
    bv = np.array([v[b].sum() for b in batches], dtype=np.int64)
    bt = np.array([t[b].sum() if packed else (t[b].max(initial=0) * len(b)) for b in batches], dtype=np.int64)
    pad_tokens = (
        sum(int(t[b].max(initial=0)) * len(b) - int(t[b].sum()) for b in batches) if not packed else 0
    )
    all_tokens = sum(int(t[b].max(initial=0)) * len(b) for b in batches) if not packed else 1
    steps = len(batches) // nd
    vd = [dist_ratio(bv[s * nd : (s + 1) * nd]) for s in range(steps)]
    td = [dist_ratio(bt[s * nd : (s + 1) * nd]) for s in range(steps)]
    sizes = [len(b) for b in batches]
    return BatchStats(
        pad_ratio=float(pad_tokens / all_tokens) if all_tokens else 0.0,
        vision_dist_ratio=float(np.mean(vd)) if vd else 0.0,
        text_dist_ratio=float(np.mean(td)) if td else 0.0,
        mean_batch_size=float(np.mean(sizes)) if sizes else 0.0,
        steps=steps,
    )


def isf_limits(
    vision,
    text,
    *,
    target_batch_size: float | None = None,
    max_text: int | None = None,
    num_devices: int = 8,
    iterations: int = 10,
    seed: int = 0,
) -> tuple[int, int]:
    """The caps ``(Q_v, Q_t)`` from the data's statistics (OmniBal section 5.1).

    ``Q_t`` is the longest text (or ``max_text``) and ``Q_v`` the vision that goes with it at the
    data set's text-to-vision ratio. With ``target_batch_size``, as the paper's code: both move in
    steps of one vision unit and its share of text; of the caps whose ISF mini-batches average
    ``target_batch_size`` to ``target_batch_size + 1`` samples, the one with the smallest sum of
    vision and text Dist Ratios over ``num_devices`` devices (random order) wins.

    >>> isf_limits([1, 2, 1, 4], [300, 500, 200, 1000])
    (4, 1000)
    """
    v, t = _sizes(vision, text)
    if v.size == 0 or v.sum() == 0:
        raise ValueError("vision must have a positive total")
    per_unit = float(t.sum()) / float(v.sum())
    qt = int(t.max()) if max_text is None else as_count(max_text, "max_text")
    qv = max(1, int(round(qt / per_unit)))
    if target_batch_size is None:
        return qv, qt
    if not target_batch_size > 0:
        raise ValueError(f"target_batch_size must be > 0, got {target_batch_size!r}")
    step = max(16, int(per_unit // 16) * 16)
    best, seen = None, set()
    for _ in range(200):
        if qv in seen or qv < 1:
            break
        seen.add(qv)
        b = isf_batches(
            v,
            t,
            max_vision=qv,
            max_text=qt,
            iterations=iterations,
            seed=seed,
            num_devices=num_devices,
            balance_steps=False,
        )
        mean = len(v) / max(1, len(b))
        if target_batch_size <= mean <= target_batch_size + 1:
            st = batch_stats(b, v, t, num_devices)
            score = st.vision_dist_ratio + st.text_dist_ratio
            if best is None or score < best[0]:
                best = (score, qv, qt)
        elif mean > target_batch_size + 1:
            if best is not None:
                break
            qv, qt = qv - 1, max(1, qt - step)
            continue
        qv, qt = qv + 1, qt + step
    return (best[1], best[2]) if best else (qv, qt)
