"""Seeded generator of small post-balancing instances with a known-hard mix.

    from tests.balancing.instances import generate
    for inst in generate(1000, seed=0): inst.lengths, inst.num_ranks, inst.alpha, inst.beta, inst.kind

Every instance is small enough for the exact solver of :mod:`tests.balancing.exact` (n 8..40 — the
Graham family of d <= 3 has 2d+1 < 8 jobs — d 2..6, integer lengths 0..5000). Kinds, cycled so any
prefix of the list mixes all of them:

* ``lognormal`` / ``pareto``: heavy-tailed lengths (sigma 0.5..1.6 / shape 1.1..2.5), some with
  a fraction of zeros (examples without this modality);
* ``bimodal``: many short examples and a few long ones (text-only vs. image-heavy);
* ``ties``: lengths drawn from 2..6 distinct values (bucketed or fixed-resolution data);
* ``graham``: Graham's LPT-worst-case family, 2d+1 jobs 2d-1, 2d-1, 2d-2, 2d-2, ..., d+1, d+1, d,
  d, d, scaled by a random factor (LPT gets 4d-1, the optimum is 3d), optionally with +-1 noise
  or zeros appended to reach n >= 8;
* ``planted``: a perfect "sum" partition planted on purpose: each rank's items are cut from the same
  total, so the "sum" optimum is exactly total/d (3-partition-like when items are 3 per rank, where
  LPT usually misses it);
* ``few_per_rank``: n between 2d and 3d, where the makespan is decided by a handful of items.

``alpha, beta`` cycle through ``beta/alpha`` in BETA_RATIOS; "sum" and "padded" ignore them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

LMAX = 5000
BETA_RATIOS = (0.0, 1e-4, 1e-3, 1e-2, 1.0)
ALPHAS = (1.0, 1.0, 1.0, 0.5, 2.0)
KINDS = ("lognormal", "pareto", "bimodal", "ties", "planted", "lognormal", "few_per_rank", "graham", "pareto")


@dataclass(frozen=True)
class Instance:
    index: int
    kind: str
    lengths: tuple[int, ...]
    num_ranks: int
    alpha: float
    beta: float

    def as_dict(self) -> dict:
        return {
            "index": self.index,
            "kind": self.kind,
            "lengths": list(self.lengths),
            "num_ranks": self.num_ranks,
            "alpha": self.alpha,
            "beta": self.beta,
        }

    @property
    def key(self) -> str:
        """Content key (for caches): lengths, ranks and coefficients."""
        return f"{','.join(map(str, self.lengths))}|{self.num_ranks}|{self.alpha!r}|{self.beta!r}"


def _clip(x: np.ndarray) -> np.ndarray:
    return np.clip(np.rint(x), 1, LMAX).astype(np.int64)


def _zeros(rng: np.random.Generator, l: np.ndarray) -> np.ndarray:
    if rng.random() < 0.3:
        l = l.copy()
        l[rng.random(l.size) < rng.uniform(0.05, 0.3)] = 0
    return l


def _lengths(kind: str, rng: np.random.Generator, n: int, d: int) -> np.ndarray:
    if kind == "lognormal":
        mu = np.log(rng.uniform(100, 1500))
        return _zeros(rng, _clip(rng.lognormal(mu, rng.uniform(0.5, 1.6), n)))
    if kind == "pareto":
        xm = rng.uniform(20, 400)
        return _zeros(rng, _clip(xm * (1 + rng.pareto(rng.uniform(1.1, 2.5), n))))
    if kind == "bimodal":
        big = max(1, int(rng.integers(1, max(2, n // 4) + 1)))
        small = _clip(rng.lognormal(np.log(rng.uniform(20, 200)), 0.6, n - big))
        large = _clip(rng.uniform(1500, LMAX, big))
        l = np.concatenate([small, large])
        return _zeros(rng, rng.permutation(l))
    if kind == "ties":
        vals = _clip(rng.lognormal(np.log(600), 1.0, int(rng.integers(2, 7))))
        return _zeros(rng, rng.choice(vals, n))
    if kind == "few_per_rank":
        return _zeros(rng, _clip(rng.lognormal(np.log(rng.uniform(300, 1500)), rng.uniform(0.3, 1.2), n)))
    raise ValueError(kind)


def _planted(rng: np.random.Generator, d: int, n_min: int, n_max: int) -> np.ndarray:
    per = int(rng.integers(max(2, -(-n_min // d)), max(3, n_max // d) + 1))
    total = int(rng.integers(per * 40, min(per * 1200, 4 * LMAX) + 1))
    items = []
    for _ in range(d):
        # cut [0, total] at per-1 distinct points: per positive parts (heavy-tailed when per is large)
        while True:
            cuts = np.sort(rng.choice(np.arange(1, total), per - 1, replace=False))
            parts = np.diff(np.concatenate([[0], cuts, [total]]))
            if parts.max() <= LMAX:
                break
        items.extend(int(x) for x in parts)
    l = np.array(items, dtype=np.int64)
    if rng.random() < 0.2 and l.size < n_max:  # zeros never change the "sum" optimum
        l = np.concatenate([l, np.zeros(int(rng.integers(1, n_max - l.size + 1)), dtype=np.int64)])
    return rng.permutation(l)


def _graham(rng: np.random.Generator, d: int) -> np.ndarray:
    base = [2 * d - k for k in range(1, d + 1) for _ in range(2)] + [d]  # 2d-1,2d-1,...,d,d + d
    scale = int(rng.integers(1, LMAX // (2 * d - 1) + 1))
    l = np.array(base, dtype=np.int64) * scale
    v = rng.integers(0, 3)
    if v == 1 and scale > 1:
        l = np.clip(l + rng.integers(-1, 2, l.size), 1, LMAX)
    elif v == 2 and l.size < 8:
        l = np.concatenate([l, np.zeros(8 - l.size, dtype=np.int64)])
    return rng.permutation(l)


def generate(
    count: int = 1000, seed: int = 0, n_range: tuple[int, int] = (8, 40), d_range: tuple[int, int] = (2, 6)
):
    """``count`` instances, deterministic in ``seed`` (instance k depends only on seed and k)."""
    out = []
    for k in range(count):
        rng = np.random.default_rng([seed, k])
        kind = KINDS[k % len(KINDS)]
        d = int(rng.integers(d_range[0], d_range[1] + 1))
        if kind == "graham":
            l = _graham(rng, d)
        elif kind == "planted":
            l = _planted(rng, d, n_range[0], n_range[1])
        elif kind == "few_per_rank":
            n = int(rng.integers(max(n_range[0], 2 * d), max(n_range[0], 3 * d) + 1))
            l = _lengths(kind, rng, n, d)
        else:
            n = int(rng.integers(n_range[0], n_range[1] + 1))
            l = _lengths(kind, rng, n, d)
        ratio = BETA_RATIOS[(k // len(KINDS)) % len(BETA_RATIOS)]
        alpha = ALPHAS[(k // (len(KINDS) * len(BETA_RATIOS))) % len(ALPHAS)]
        out.append(
            Instance(
                index=k,
                kind=kind,
                lengths=tuple(int(x) for x in l),
                num_ranks=d,
                alpha=float(alpha),
                beta=float(alpha * ratio),
            )
        )
    return out
