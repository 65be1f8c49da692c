"""Batch samplers side by side: ours, transformers' ``BatchRebalanceSampler``, torch's ``DistributedSampler``.

    mmbalance bench sampler [--quick | --full] [--json FILE]
    python -m mmbalance.bench.planners.sampler [--quick | --full] [--json FILE]

Configurations: the shipped real-data mixture (LLM tokens of :func:`mmbalance.balancing.datasets.mixture`),
long-tail lengths (lognormal, up to 32k tokens) and bimodal ones (85% short, 15% of 4-8k tokens);
8, 32 and 64 ranks; batch 4, 8 and 32 examples per rank per micro-batch; gradient accumulation
G = 1 and 4; packed (varlen attention) and padded (every micro-batch padded to its longest) training.

Every sampler takes the same examples per optimizer step (``batch * ranks * G``). The micro-batches
of every rank are priced with one cost model, ``alpha * l + beta * l**2`` with ``alpha = 1`` and
:data:`~mmbalance.balancing.DEFAULT_BETA`: packed, a micro-batch costs the sum over its examples;
padded, ``examples * h(longest)``. Ranks synchronize at every micro-batch, so a step is modelled
as the sum over its micro-batch slots of the slowest rank's micro-batch. The rows report:

* ``step``: the mean modelled step time (token-equivalents), ``vs_dist`` the ratio of means against
  ``DistributedSampler`` (with a ``BatchSampler`` of ``batch``, ``G`` consecutive micro-batches per
  step), ``vs_hf`` ours against transformers';
* ``slot_max_mean``: max over mean of the ranks' micro-batch costs, averaged over slots and steps;
* ``empty``: the fraction of per-rank micro-batches with no example, ``max_examples`` the most
  examples in one micro-batch;
* ``iter_s``: seconds for one rank to iterate a 1M-example epoch (``--quick``: 20k examples),
  planning included; for transformers' sampler, slow at large steps, estimated from the steps it
  iterated here (``iter_est``: 1). ``time_ms`` is the same per optimizer step.

transformers' sampler plans with its own fixed cost model (padded, ``bs * max + 0.001 * bs *
max**2``) whatever the training does; that is how it runs. The modelled step times need every rank's
micro-batches, so its per-step plan is taken from its ``_assign`` (what each rank computes and keeps
its own part of), on the same shuffle its ``__iter__`` draws.
"""

from __future__ import annotations

import math
import time

import numpy as np

from mmbalance.balancing.plan import DEFAULT_BETA

from ..harness import Row, base_parser, device_name, report

DATASETS = ("mixture", "long_tail", "bimodal")
MODES = ("packed", "padded")
ALPHA, BETA = 1.0, DEFAULT_BETA
PROVIDERS = ("mmbalance", "transformers", "torch_distributed")


def lengths_of(name: str, n: int, seed: int = 0) -> np.ndarray:
    """``n`` LLM lengths of one of :data:`DATASETS` (int64)."""
    rng = np.random.default_rng(seed)
    if name == "mixture":
        from mmbalance.balancing.datasets import mixture

        return np.maximum(mixture(n, rng).llm, 1).astype(np.int64)
    if name == "long_tail":
        return np.clip(np.round(rng.lognormal(np.log(600.0), 1.1, n)), 16, 32768).astype(np.int64)
    if name == "bimodal":
        long = rng.random(n) < 0.15
        return np.where(long, rng.integers(4096, 8193, n), rng.integers(64, 513, n)).astype(np.int64)
    raise ValueError(f"dataset must be one of {DATASETS}, got {name!r}")


def micro_costs(lengths: np.ndarray, step, slot, rank, steps: int, g: int, d: int, padded: bool):
    """Cost ``[steps, g, d]`` and example count of every micro-batch, from where each example went
    (``step``, ``slot``, ``rank`` per example, ``lengths`` its length), float64."""
    key = (np.asarray(step) * g + np.asarray(slot)) * d + np.asarray(rank)
    size = steps * g * d
    l = lengths.astype(np.float64)
    count: np.ndarray = np.bincount(key, minlength=size).astype(np.float64)
    cost: np.ndarray
    if padded:
        longest = np.zeros(size)
        np.maximum.at(longest, key, l)
        cost = count * (ALPHA * longest + BETA * longest * longest)
    else:
        cost = np.bincount(key, weights=ALPHA * l + BETA * l * l, minlength=size)
    return cost.reshape(steps, g, d), count.reshape(steps, g, d)


def summarize(cost: np.ndarray, count: np.ndarray) -> dict:
    """The metrics of one sampler's micro-batches."""
    mean = cost.mean(axis=2)
    slot = np.where(mean > 0, cost.max(axis=2) / np.where(mean > 0, mean, 1.0), 1.0)
    return {
        "step": float(cost.max(axis=2).sum(axis=1).mean()),
        "slot_max_mean": float(slot.mean()),
        "empty": float((count == 0).mean()),
        "max_examples": int(count.max()),
    }


def plan_ours(lengths, d, b, g, padded, seed=0):
    """Where our sampler puts every example of the epoch: (step, slot, rank, lengths) per example."""
    from mmbalance.integrations.data import BalancedBatchSampler

    s = BalancedBatchSampler(lengths, b, d, 0, grad_accum=g, padding=padded, seed=seed, drop_last=True)
    plan = s.plan_epoch()
    steps = plan.indices.shape[0]
    step = np.repeat(np.arange(steps), plan.indices.shape[1])
    return steps, step, plan.micro.reshape(-1), plan.rank.reshape(-1), lengths[plan.indices.reshape(-1)]


def plan_hf(lengths, d, b, g, seed=0):
    """The same for transformers' BatchRebalanceSampler (every rank's part of each step)."""
    import torch
    from transformers.trainer_pt_utils import BatchRebalanceSampler

    n = b * d * g
    s = BatchRebalanceSampler(lengths.tolist(), n, d, g, shuffle=True, seed=seed, rank=0, drop_last=True)
    gen = torch.Generator()
    gen.manual_seed(s.seed + s.epoch)
    order = torch.randperm(len(lengths), generator=gen).tolist()
    steps_, slots, ranks, idx = [], [], [], []
    for st in range(s.num_global_batches):
        batch = order[st * n : (st + 1) * n]
        per_rank = s._assign(batch, [s.lengths[i] for i in batch])
        for r in range(d):
            for k in range(g):
                mb = per_rank[r][k]
                idx += mb
                steps_ += [st] * len(mb)
                slots += [k] * len(mb)
                ranks += [r] * len(mb)
    idx = np.asarray(idx, dtype=np.int64)
    return s.num_global_batches, np.asarray(steps_), np.asarray(slots), np.asarray(ranks), lengths[idx]


def plan_dist(lengths, d, b, g, seed=0):
    """The same for DistributedSampler + BatchSampler: rank r's micro-batches are ``b`` consecutive
    examples of its shard, ``g`` of them per step."""
    import torch
    from torch.utils.data import DistributedSampler

    n = b * d * g
    steps = len(lengths) // n
    shard = [
        np.asarray(
            list(DistributedSampler(range(len(lengths)), d, r, shuffle=True, seed=seed)), dtype=np.int64
        )
        for r in range(d)
    ]
    per = steps * g * b
    idx = np.stack([sh[:per] for sh in shard])  # [d, per]
    pos = np.arange(per)
    step = np.broadcast_to(pos // (g * b), idx.shape).reshape(-1)
    slot = np.broadcast_to((pos // b) % g, idx.shape).reshape(-1)
    rank = np.broadcast_to(np.arange(d)[:, None], idx.shape).reshape(-1)
    del torch
    return steps, step, slot, rank, lengths[idx.reshape(-1)]


def iteration_seconds(provider, lengths, d, b, g, padded) -> tuple[float, bool]:
    """Seconds for rank 0 to iterate one epoch of ``lengths`` (planning included), and whether the
    number is an estimate (transformers': timed on at most ``HF_TIMED_STEPS`` steps)."""
    n = b * d * g
    if provider == "mmbalance":
        from mmbalance.integrations.data import BalancedBatchSampler

        s = BalancedBatchSampler(lengths, b, d, 0, grad_accum=g, padding=padded, drop_last=True)
        s.set_epoch(1)
        t = time.perf_counter()
        for _ in s:
            pass
        return time.perf_counter() - t, False
    if provider == "torch_distributed":
        from torch.utils.data import BatchSampler, DistributedSampler

        t = time.perf_counter()
        shard: DistributedSampler = DistributedSampler(range(len(lengths)), d, 0, shuffle=True, seed=0)  # type: ignore[arg-type]
        for _ in BatchSampler(shard, b, drop_last=True):
            pass
        return time.perf_counter() - t, False
    from transformers.trainer_pt_utils import BatchRebalanceSampler

    steps = len(lengths) // n
    timed = min(steps, HF_TIMED_STEPS)
    peer = BatchRebalanceSampler(lengths[: timed * n].tolist(), n, d, g, seed=0, rank=0, drop_last=True)
    t = time.perf_counter()
    for _ in peer:
        pass
    return (time.perf_counter() - t) * steps / max(timed, 1), timed < steps


HF_TIMED_STEPS = 8


def grid(args) -> list[tuple[str, int, int, int, str]]:
    if args.quick:
        return [(ds, 8, 4, g, m) for ds in DATASETS for g in (1, 4) for m in MODES]
    return [
        (ds, d, b, g, m)
        for ds in DATASETS
        for d in (8, 32, 64)
        for b in (4, 8, 32)
        for g in (1, 4)
        for m in MODES
    ]


def bench(args) -> list[Row]:
    modelled = 2048 if args.quick else 65536 if args.full else 16384  # examples per configuration
    epoch = 20000 if args.quick else 1_000_000
    dev = device_name("cpu")
    rows: list[Row] = []
    epochs: dict[str, np.ndarray] = {}
    for ds, d, b, g, mode in grid(args):
        n = b * d * g
        padded = mode == "padded"
        steps = max(2, math.ceil(modelled / n))
        lengths = lengths_of(ds, steps * n, seed=d * 1000 + b * 10 + g)
        if ds not in epochs:
            epochs[ds] = lengths_of(ds, epoch, seed=1)
        results = {}
        for prov in PROVIDERS:
            if prov == "mmbalance":
                st, step, slot, rank, l = plan_ours(lengths, d, b, g, padded)
            elif prov == "transformers":
                st, step, slot, rank, l = plan_hf(lengths, d, b, g)
            else:
                st, step, slot, rank, l = plan_dist(lengths, d, b, g)
            cost, count = micro_costs(l, step, slot, rank, st, g, d, padded)
            m = summarize(cost, count)
            secs, est = iteration_seconds(prov, epochs[ds], d, b, g, padded)
            m["iter_s"] = secs
            m["iter_est"] = int(est)
            results[prov] = m
        base = results["torch_distributed"]["step"]
        for prov in PROVIDERS:
            m = results[prov]
            m["vs_dist"] = m["step"] / base if base > 0 else 1.0
            if prov == "mmbalance":
                m["vs_hf"] = m["step"] / results["transformers"]["step"]
            steps_per_epoch = max(len(epochs[ds]) // n, 1)
            rows.append(
                Row(
                    op="sampler",
                    provider=prov,
                    shape=f"{ds}/R{d}/B{b}/G{g}/{mode}",
                    dtype="-",
                    device=dev,
                    time_ms=1e3 * m["iter_s"] / steps_per_epoch,
                    metrics={"data": ds, "ranks": d, "batch": b, "grad_accum": g, "mode": mode, **m},
                )
            )
    return rows


def summary_table(rows: list[Row]) -> str:
    """Markdown: per (data, mode, G), the worst case over ranks and batch sizes."""
    by: dict[tuple, dict[str, list[dict]]] = {}
    for r in rows:
        d = r.as_dict()
        by.setdefault((d["data"], d["mode"], d["grad_accum"]), {}).setdefault(d["provider"], []).append(d)
    lines = [
        "| data | mode | G | ours / DistributedSampler | transformers' / DistributedSampler | ours / transformers' "
        "(worst) | empty micro-batches, ours / transformers' | slot max/mean, ours / transformers' | "
        "epoch iteration s (1M examples), ours / transformers' |",
        "|---|---|---|---|---|---|---|---|---|",
    ]

    def span(vals, fmt="{:.2f}"):
        lo, hi = min(vals), max(vals)
        return fmt.format(lo) if fmt.format(lo) == fmt.format(hi) else f"{fmt.format(lo)}-{fmt.format(hi)}"

    for (ds, mode, g), p in by.items():
        ours, hf = p["mmbalance"], p["transformers"]
        est = "~" if any(h["iter_est"] for h in hf) else ""
        lines.append(
            f"| {ds} | {mode} | {g} | {span([o['vs_dist'] for o in ours])} | {span([h['vs_dist'] for h in hf])} "
            f"| {max(o['vs_hf'] for o in ours):.3f} "
            f"| {max(o['empty'] for o in ours):.0%} / {max(h['empty'] for h in hf):.0%} "
            f"| {span([o['slot_max_mean'] for o in ours], '{:.3f}')} / {span([h['slot_max_mean'] for h in hf], '{:.3f}')} "
            f"| {max(o['iter_s'] for o in ours):.2f} / {est}{max(h['iter_s'] for h in hf):.1f} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--markdown", metavar="FILE", help="also write the summary table as Markdown to FILE")
    args = p.parse_args(argv)
    try:
        import transformers  # noqa: F401
    except ImportError:
        print(
            "mmbalance bench sampler compares with transformers' own sampler and needs transformers "
            '(pip install "mmbalance[hf]"); skipped'
        )
        return 2
    rows = bench(args)
    report(
        rows, args.json, "batch samplers: modelled step time (sum over micro-batch slots of the slowest rank)"
    )
    table = summary_table(rows)
    print("\n== summary: worst case over ranks and batch sizes ==\n" + table)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(table + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
