"""What-if simulator: what would balancing give on my data at my scale?

    mmbalance simulate [--data FILE.csv|FILE.jsonl] [--ranks 8,64,512,2560] [--model mllm-10b]
                       [--per-rank 60] [--steps 8] [--json FILE] [--plot FILE.png]

From per-example sizes (the shipped real-data mixture by default, or a file with one example per
row and columns ``vision`` (ViT patches), ``audio`` (audio-encoder frames), ``text`` (text tokens))
and a cost model per phase built from the model's shape (OrchMLLM table 1 configurations), it
samples ``--steps`` steps of ``--per-rank`` examples per rank, plans every step with four strategies
and reports per-phase imbalance (max/mean cost over ranks) and the predicted step time:

* ``none``: every rank runs its own sample in every phase;
* ``llm-only``: the LLM lengths are balanced and examples move whole (pre-balancing, e.g. DistTrain);
* ``per-phase``: OrchMLLM's post-balancing with the paper's algorithms per phase (alg. 1 for packed
  phases, alg. 2 for the padded audio encoder);
* ``ours``: ``post_balance`` per phase with the phase's own cost model (``quadratic`` for packed
  transformers, ``padded_quadratic`` for the padded encoder) and locality.

Phase cost (forward + backward, FLOPs / effective throughput): packed transformer phases
``alpha * sum(l) + beta * sum(l^2)``; the padded audio encoder ``alpha * b * max(l) + beta * b *
max(l)^2``; ``alpha = 6 * layers * (4 h^2 + 2 h f)`` (linear layers) and ``beta = 12 * layers * h``
(attention scores and values; half of it for the causal LLM). Step time = sum over phases of the
slowest rank (every phase ends in a collective). The predicted speedup is a model, not a
measurement.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from dataclasses import dataclass

import numpy as np

from mmbalance.balancing import imbalance, post_balance
from mmbalance.balancing.datasets import ExampleSizes, mixture
from mmbalance.balancing.paper import paper_algorithm

from ..harness import check_outputs, command_parser, save_plot, usage_error, write_output

PEAK_FLOPS = 989e12 * 0.45  # H100 dense bf16 at a 45% efficiency, the same for every phase


@dataclass(frozen=True)
class Tower:
    layers: int
    hidden: int
    ffn: int
    causal: bool = False

    @property
    def alpha(self) -> float:  # FLOPs per token, forward + backward
        return 6.0 * self.layers * (4 * self.hidden**2 + 2 * self.hidden * self.ffn)

    @property
    def beta(self) -> float:  # FLOPs per token pair (attention), forward + backward
        return 12.0 * self.layers * self.hidden * (0.5 if self.causal else 1.0)


@dataclass(frozen=True)
class ModelConfig:
    llm: Tower
    vision: Tower
    audio: Tower
    vision_downsample: int
    audio_downsample: int


# OrchMLLM table 1 and the downsample rates of section 8
MODELS = {
    "mllm-10b": ModelConfig(Tower(28, 3584, 18944, True), Tower(36, 2048, 8192), Tower(32, 1280, 5120), 1, 2),
    "mllm-18b": ModelConfig(Tower(48, 5120, 13824, True), Tower(40, 2400, 9600), Tower(32, 1280, 5120), 4, 2),
    "mllm-84b": ModelConfig(
        Tower(80, 8192, 29568, True), Tower(45, 3200, 12800), Tower(48, 3072, 12288), 4, 4
    ),
}
PHASES = ("vision", "audio", "llm")
STRATEGIES = ("none", "llm-only", "per-phase", "ours")


COLUMNS = ("vision", "audio", "text")
MAX_SIZE = 2**31 - 1  # tokens of one example part: what an int32 cu_seqlens can address


def _int_value(v) -> int | None:
    """``v`` as a non-negative int within ``MAX_SIZE``, or ``None`` (bools and fractions are not sizes)."""
    if isinstance(v, bool):
        return None
    if isinstance(v, str):
        v = v.strip()
        try:
            return int(v) if v else None
        except ValueError:
            try:
                f = float(v)
            except ValueError:
                return None
            v = f
    if isinstance(v, float):
        if not (v == v and abs(v) != float("inf")) or not v.is_integer():
            return None
        return int(v)
    return v if isinstance(v, int) else None


def _check_columns(path: str, lineno: int, names: list[str]) -> None:
    seen, dup = set(), []
    for c in names:
        if c in seen:
            dup.append(c)
        seen.add(c)
    unknown = [c for c in names if c not in COLUMNS]
    missing = [c for c in COLUMNS if c not in seen]
    problems = []
    if dup:
        problems.append(f"duplicate column(s) {sorted(set(dup))}")
    if unknown:
        problems.append(f"unknown column(s) {unknown}")
    if missing:
        problems.append(f"missing column(s) {missing}")
    if problems:
        raise ValueError(
            f"{path} line {lineno}: {'; '.join(problems)} (the columns are exactly {', '.join(COLUMNS)})"
        )


def load_table(path: str) -> ExampleSizes:
    """Per-example sizes from a CSV (header row) or JSONL file; errors name the line.

    The columns (CSV header, JSONL keys) are exactly ``vision``, ``audio`` and ``text``, in any
    order: an unknown, missing or repeated column is an error, never a column of zeros. A UTF-8
    byte-order mark (as Excel writes it) is skipped. Values are integers in ``[0, 2**31)``.
    """
    rows: list[tuple[int, dict]] = []
    with open(path, encoding="utf-8-sig", newline="") as f:
        if path.endswith((".jsonl", ".json")):
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    rows.append((lineno, json.loads(line)))
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{path} line {lineno}: not valid JSON ({exc.msg})") from None
            for lineno, r in rows:
                if not isinstance(r, dict):
                    raise ValueError(
                        f"{path} line {lineno}: expected an object with keys vision, audio, text"
                    )
                _check_columns(path, lineno, list(r))
        else:
            reader = csv.reader(f)
            header = next(reader, None)
            if header is None:
                raise ValueError(f"{path}: empty file (expected a header naming vision, audio, text)")
            names = [h.strip() for h in header]
            _check_columns(path, 1, names)
            for values in reader:
                lineno = reader.line_num
                if not values or all(not v.strip() for v in values):
                    continue
                if len(values) != len(names):
                    raise ValueError(
                        f"{path} line {lineno}: {len(values)} fields, the header has {len(names)}"
                    )
                rows.append((lineno, dict(zip(names, values))))
    if not rows:
        raise ValueError(f"{path}: no examples")
    cols = {c: np.zeros(len(rows), dtype=np.int64) for c in COLUMNS}
    for k, (lineno, r) in enumerate(rows):
        for c in COLUMNS:
            v = r[c]
            iv = _int_value(v)
            if iv is None or iv < 0:
                raise ValueError(f"{path} line {lineno}: {c!r} must be a non-negative integer, got {v!r}")
            if iv > MAX_SIZE:
                raise ValueError(f"{path} line {lineno}: {c!r} = {iv} is too large (at most {MAX_SIZE})")
            cols[c][k] = iv
    if not (cols["vision"].any() or cols["audio"].any() or cols["text"].any()):
        raise ValueError(f"{path}: every example is empty (all sizes are 0)")
    kind = np.where(cols["vision"] > 0, 0, np.where(cols["audio"] > 0, 2, 0))
    z = np.zeros_like(cols["text"])
    return ExampleSizes(cols["vision"], cols["audio"], z, z, cols["text"], kind)


def _llm_lengths(s: ExampleSizes, m: ModelConfig) -> np.ndarray:
    return (
        s.text
        + (s.vision + m.vision_downsample - 1) // m.vision_downsample
        + (s.audio + m.audio_downsample - 1) // m.audio_downsample
    )


def phase_times(lengths: np.ndarray, dst: np.ndarray, ranks: int, tower: Tower, padded: bool) -> np.ndarray:
    """Predicted seconds of one phase on every rank."""
    l = lengths.astype(np.float64)
    if padded:
        has = l > 0
        b = np.bincount(dst[has], minlength=ranks).astype(np.float64)
        mx = np.zeros(ranks)
        np.maximum.at(mx, dst, l)
        flops = tower.alpha * b * mx + tower.beta * b * mx * mx
    else:
        flops = tower.alpha * np.bincount(dst, weights=l, minlength=ranks) + tower.beta * np.bincount(
            dst, weights=l * l, minlength=ranks
        )
    return flops / PEAK_FLOPS


def plan_step(s: ExampleSizes, ranks: int, m: ModelConfig) -> dict[str, dict[str, np.ndarray]]:
    """Destination rank per example and phase for every strategy."""
    n = len(s)
    src = np.repeat(np.arange(ranks), n // ranks)
    llm = _llm_lengths(s, m)
    out = {"none": {p: src for p in PHASES}}
    lo = post_balance(llm, ranks, "sum").dst_rank
    out["llm-only"] = {p: lo for p in PHASES}
    pp = {}
    for p, lengths in (("vision", s.vision), ("audio", s.audio), ("llm", llm)):
        sel = np.flatnonzero(lengths > 0) if p != "llm" else np.arange(n)
        dst = src.copy()
        dst[sel] = paper_algorithm(lengths[sel], ranks, 2 if p == "audio" else 1)
        pp[p] = dst
    out["per-phase"] = pp
    ours = {}
    for p, lengths, tower, pols in (
        ("vision", s.vision, m.vision, ("quadratic",)),
        ("audio", s.audio, m.audio, ("padded_quadratic",)),
        ("llm", llm, m.llm, ("quadratic",)),
    ):
        sel = np.flatnonzero(lengths > 0) if p != "llm" else np.arange(n)
        best, best_t = src.copy(), np.inf
        for pol in pols:
            dst = src.copy()
            dst[sel] = post_balance(
                lengths[sel], ranks, pol, src_ranks=src[sel], alpha=1.0, beta=tower.beta / tower.alpha
            ).dst_rank
            t = phase_times(lengths, dst, ranks, tower, p == "audio").max()
            if t < best_t:
                best, best_t = dst, t
        ours[p] = best
    out["ours"] = ours
    return out


def simulate(
    s_all: ExampleSizes, ranks_list: list[int], m: ModelConfig, per_rank: int, steps: int, seed: int = 0
) -> list[dict]:
    rng = np.random.default_rng(seed)
    rows = []
    for ranks in ranks_list:
        acc: dict[str, dict[str, list[float]]] = {
            st: {"step_s": [], **{f"{p}_imb": [] for p in PHASES}} for st in STRATEGIES
        }
        for _ in range(steps):
            idx = rng.integers(0, len(s_all), size=ranks * per_rank)
            s = s_all.take(idx)
            llm = _llm_lengths(s, m)
            plans = plan_step(s, ranks, m)
            for st, dsts in plans.items():
                total = 0.0
                for p, lengths, tower, padded in (
                    ("vision", s.vision, m.vision, False),
                    ("audio", s.audio, m.audio, True),
                    ("llm", llm, m.llm, False),
                ):
                    t = phase_times(lengths, dsts[p], ranks, tower, padded)
                    total += t.max()
                    acc[st][f"{p}_imb"].append(imbalance(t))
                acc[st]["step_s"].append(total)
        base = float(np.mean(acc["none"]["step_s"]))
        for st in STRATEGIES:
            r: dict = {"ranks": ranks, "strategy": st, "step_s": float(np.mean(acc[st]["step_s"]))}
            r.update({k: float(np.mean(v)) for k, v in acc[st].items() if k != "step_s"})
            r["speedup_vs_none"] = base / r["step_s"]
            rows.append(r)
    return rows


def _print(rows: list[dict], model: str) -> None:
    print(f"predicted step time and per-phase imbalance (max/mean), model {model}")
    print(f"{'ranks':>6} {'strategy':<10} {'step s':>8} {'speedup':>8} {'vision':>7} {'audio':>7} {'llm':>7}")
    for r in rows:
        print(
            f"{r['ranks']:>6} {r['strategy']:<10} {r['step_s']:>8.3f} {r['speedup_vs_none']:>8.2f} "
            f"{r['vision_imb']:>7.3f} {r['audio_imb']:>7.3f} {r['llm_imb']:>7.3f}"
        )
    print(
        "\nfor comparison: OrchMLLM reports 1.4-2.0x training throughput over no balancing at 2560 GPUs (section 8.1),"
        "\nand per-phase post-balancing ahead of LLM-only balancing (figure 10) and of one algorithm for all phases"
        "\n(figure 11); OmniBal's table 5 reports Dist Ratios of 0.02 (ViT) and 0.14 (LLM) for its batching."
    )


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.8))
    for st in STRATEGIES:
        rs = [r for r in rows if r["strategy"] == st]
        ax.plot([r["ranks"] for r in rs], [r["speedup_vs_none"] for r in rs], "o-", label=st)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("data-parallel ranks")
    ax.set_ylabel("predicted speedup over no balancing")
    ax.legend()
    save_plot(fig, path)


def parser() -> argparse.ArgumentParser:
    p = command_parser("mmbalance simulate", __doc__)
    p.add_argument(
        "--data",
        help="CSV/JSONL with exactly the columns vision, audio, text; each step samples its examples "
        "from the file's rows with replacement (default: the shipped real-data mixture)",
    )
    p.add_argument("--ranks", default="8,64,512,2560", help="comma-separated data-parallel sizes")
    p.add_argument(
        "--model", default="mllm-10b", choices=sorted(MODELS), help="model shape (OrchMLLM table 1)"
    )
    p.add_argument("--per-rank", type=int, default=60, help="examples each rank samples per step")
    p.add_argument("--steps", type=int, default=8, help="sampled steps per scale")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (>= 0)")
    p.add_argument("--json", metavar="FILE", help="write the rows as JSON to FILE")
    p.add_argument("--plot", metavar="FILE.png", help="plot the predicted speedups to FILE.png")
    return p


MAX_EXAMPLES = 2**24  # examples of one simulated step (ranks x per-rank)


def _check_args(args) -> tuple[list[int] | None, str | None]:
    """The parsed ``--ranks``, or the message that rejects the arguments."""
    try:
        ranks = [int(x) for x in args.ranks.split(",") if x.strip()]
    except ValueError:
        ranks = []
    if not ranks or min(ranks) < 1:
        return None, f"--ranks must be positive integers separated by commas, got {args.ranks!r}"
    if args.per_rank < 1:
        return None, f"--per-rank must be >= 1, got {args.per_rank}"
    if args.steps < 1:
        return None, f"--steps must be >= 1, got {args.steps}"
    if args.seed < 0:
        return None, f"--seed must be >= 0, got {args.seed}"
    if max(ranks) * args.per_rank > MAX_EXAMPLES:
        return None, (
            f"--ranks {max(ranks)} x --per-rank {args.per_rank} is {max(ranks) * args.per_rank} examples per "
            f"step; at most {MAX_EXAMPLES} are simulated"
        )
    from mmbalance.balancing.validate import MAX_RANKS

    if max(ranks) > MAX_RANKS:
        return None, f"--ranks {max(ranks)} is above the planners' limit of {MAX_RANKS} ranks"
    msg = check_outputs("mmbalance simulate", args.json, args.plot)
    if msg:
        return None, msg
    return ranks, None


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    ranks, msg = _check_args(args)
    if msg or ranks is None:
        return usage_error("mmbalance simulate", msg or "--ranks: nothing to simulate")
    try:
        sizes = load_table(args.data) if args.data else mixture(200_000, args.seed)
    except OSError as exc:
        return usage_error("mmbalance simulate", f"cannot read {args.data}: {exc.strerror or exc}")
    except UnicodeDecodeError as exc:
        return usage_error(
            "mmbalance simulate", f"{args.data} is not UTF-8 text ({exc.reason} at byte {exc.start})"
        )
    except ValueError as exc:
        return usage_error("mmbalance simulate", str(exc))
    source = f"{args.data}: {len(sizes)} rows" if args.data else f"the shipped mixture: {len(sizes)} examples"
    print(
        f"data: {source}; each simulated step samples ranks x {args.per_rank} of them with replacement "
        f"({args.steps} steps per scale)"
    )
    rows = simulate(sizes, ranks, MODELS[args.model], args.per_rank, args.steps, args.seed)
    _print(rows, args.model)
    if args.json:

        def write_json(path):
            with open(path, "w") as f:
                json.dump({"model": args.model, "rows": rows}, f, indent=2)

        rc = write_output("mmbalance simulate", args.json, write_json)
        if rc:
            return rc
    if args.plot:
        rc = write_output("mmbalance simulate", args.plot, lambda path: plot(rows, path))
        if rc:
            return rc
    return 0


if __name__ == "__main__":
    sys.exit(main())
