"""``mmbalance bench cp --vlm``: context parallelism of vision-language sequences, modelled: static
CP degrees and NeMo-style pre-embedding against ours, with and without encoder balancing.

Datasets, from the shipped sizes (``mmbalance/data``), in Qwen2-VL's layout (448 px images and
frames, 14 px patches, 2x2 merge; two frames make one temporal patch):

* ``activitynet_long``: ActivityNet Captions videos at 1 frame a second, up to 480 frames (8
  minutes). Every two frames are one encoder item of 1024 ViT patches and 256 LLM tokens; the
  caption (1.3 tokens a word) and a 32-token prompt complete the sequence. Median about 15k LLM
  tokens, longest about 62k.
* ``documents``: a mixture with image documents: 40% documents of 4 to 32 pages (page sizes of
  DocVQA: every 448 px tile of a page is one item of 1024 patches and 256 LLM tokens, plus the
  page's text), 40% single images of the four image sets, 20% the long videos above.

Time, per step (one packed micro-batch, drawn as in ``bench cp``): the LLM phase by the run's
:class:`~mmbalance.balancing.CostModel` (default: the 8B transformer), per group of ``d`` ranks as
in ``bench cp``; an item's encoder seconds by the same formula for Qwen2-VL's ViT (32 layers,
hidden 1280, MLP 5120, full attention inside the item) at the same FLOP rate. Schemes:

* ``static_cp<c>`` (c = 1, 2, 4, 8): ``world // c`` groups of ``c`` ranks, balanced greedily on the
  LLM time plus each sequence's encoder seconds over ``c``. A group's media are encoded once, the
  items dealt to its members longest first; the group takes its busiest member's encoder time plus
  its LLM time, and the step its slowest group (groups do not wait for each other before the
  gradient reduction). A degree must hold the longest sequence of the data (100k draws).
* ``preembed_cp<c>``: the same groups, the media embedded before the sequence is split, on every
  member of the group (NeMo Automodel's fix for VLMs under CP: each CP rank runs the vision tower
  on the whole sample's media, then keeps its slice of the embeddings); a group takes all its
  media's encoder time plus its LLM time.
* ``mmbalance``: what ``apply_dynamic_cp`` does without encoder balancing: of the two plans of
  :func:`~mmbalance.balancing.cp_schedule`, with the groups' encoder share (``encoder_seconds``)
  and on the LLM cost alone, the faster by :meth:`CostModel.step_with_encoders`
  (``exchange="group"``); each
  group's items dealt to its members. The feature rows move inside each group, so, as for the
  static schemes, a group takes its busiest member's encoder time plus its LLM time and the step
  its slowest group.
* ``mmbalance_eb``: with ``apply_encoder_balance`` on the same model: ``cp_schedule`` on the LLM
  cost alone, every item dealt over the whole world longest first; busiest rank's encoder time
  plus the slowest group's LLM time.

Every placement is checked (each sequence in one group, memory held, every item encoded once, or
by every member for pre-embedding) before it is timed. Rows: op ``cp_vlm_step``; ``time_ms`` the
mean modelled step, ``encoder_ms`` and ``llm_ms`` its parts (for ``static`` and ``preembed`` the
slowest group's), ``ours_speedup`` the scheme's mean over ``mmbalance``'s.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np

from mmbalance.balancing import CostModel, cp_schedule
from mmbalance.balancing.datasets import load_sizes

from ..harness import Row, device_name, ms_cell, ratio_plot
from . import schemes
from .data import cut_steps

DATASETS = ("activitynet_long", "documents")
STATIC_DEGREES = (1, 2, 4, 8)
SCHEMES = (
    *(f"static_cp{c}" for c in STATIC_DEGREES),
    *(f"preembed_cp{c}" for c in STATIC_DEGREES),
    "mmbalance",
    "mmbalance_eb",
)
OURS = ("mmbalance", "mmbalance_eb")
RANKS_PER_NODE = 8
PATCHES_PER_ITEM, LLM_PER_ITEM = 1024, 256  # a 448 px image tile, or two 448 px frames
FRAMES_PER_S, MAX_FRAMES = 1.0, 480
DOC_SHARE, IMAGE_SHARE = 0.4, 0.4  # the rest of ``documents`` is long videos
DOC_PAGES = (4, 32)
LONGEST_DRAWS = 100_000


def vit_cost(llm: CostModel) -> CostModel:
    """Qwen2-VL's vision tower (675M parameters; its GELU MLP as the SwiGLU width of equal FLOPs)
    at the FLOP rate of ``llm`` relative to the default 8B transformer at 400 TFLOP/s."""
    rate = 400e12 * CostModel.transformer().linear / llm.linear if llm.linear > 0 else 400e12
    return CostModel.transformer(hidden_size=1280, num_layers=32, kv_size=1280, ffn_size=5120 * 2 // 3,
                                 mask="full", flops=rate)  # fmt: skip


def item_seconds(llm: CostModel) -> float:
    """Encoder seconds (forward + backward) of one item of ``PATCHES_PER_ITEM`` patches."""
    return vit_cost(llm).time([PATCHES_PER_ITEM])


@dataclasses.dataclass(frozen=True)
class Examples:
    """Examples as arrays: ``llm`` LLM tokens (vision included), ``items`` encoder items (int64)."""

    llm: np.ndarray
    items: np.ndarray

    def __len__(self) -> int:
        return int(self.llm.size)

    def __getitem__(self, rows) -> Examples:
        return Examples(self.llm[rows], self.items[rows])


def _examples(items: np.ndarray, text: np.ndarray) -> Examples:
    items = np.asarray(items).astype(np.int64)
    return Examples(np.asarray(text).astype(np.int64) + LLM_PER_ITEM * items, items)


def _videos(n: int, rng: np.random.Generator) -> Examples:
    raw = load_sizes()
    j = rng.integers(0, raw["video_duration_ms"].shape[0], size=n)
    frames = np.clip(np.round(raw["video_duration_ms"][j] / 1000.0 * FRAMES_PER_S), 2, MAX_FRAMES)
    return _examples(np.ceil(frames / 2), np.round(raw["video_caption_words"][j] * 1.3) + 32)


def _images(n: int, rng: np.random.Generator) -> Examples:
    raw = load_sizes()
    j = rng.integers(0, raw["image_tiles"].shape[0], size=n)
    return _examples(raw["image_tiles"][j], raw["image_text_tokens"][j])


def _documents(n: int, rng: np.random.Generator) -> Examples:
    raw = load_sizes()
    docvqa = np.flatnonzero(raw["image_set_names"][raw["image_set"]] == "docvqa_train_10k")
    pages = rng.integers(DOC_PAGES[0], DOC_PAGES[1] + 1, size=n)
    j = docvqa[rng.integers(0, docvqa.size, size=int(pages.sum()))]
    doc = np.repeat(np.arange(n), pages)
    tiles = np.bincount(doc, weights=raw["image_tiles"][j], minlength=n)
    return _examples(tiles, np.bincount(doc, weights=raw["image_text_tokens"][j], minlength=n))


def draw(dataset: str, n: int, rng: np.random.Generator) -> Examples:
    """``n`` examples of ``dataset``, in stream order."""
    if dataset == "activitynet_long":
        return _videos(n, rng)
    if dataset != "documents":
        raise ValueError(f"dataset must be one of {list(DATASETS)}, got {dataset!r}")
    kind = rng.choice(3, size=n, p=[DOC_SHARE, IMAGE_SHARE, 1.0 - DOC_SHARE - IMAGE_SHARE])
    parts = [f(int((kind == k).sum()), rng) for k, f in enumerate((_documents, _images, _videos))]
    llm, items = np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.int64)
    for k, part in enumerate(parts):
        llm[kind == k], items[kind == k] = part.llm, part.items
    return Examples(llm, items)


@functools.cache
def longest(dataset: str) -> int:
    """The longest sequence of ``LONGEST_DRAWS`` draws (seed 0): what a fixed degree must hold."""
    return int(draw(dataset, LONGEST_DRAWS, np.random.default_rng(0)).llm.max())


def step_batches(
    dataset: str, world: int, memory_per_rank: int, steps: int, fill: float, seed: int
) -> list[Examples]:
    """``steps`` consecutive micro-batches of one stream: examples until the next would pass
    ``fill * world * memory_per_rank`` LLM tokens (at least one)."""
    rng = np.random.default_rng([seed, world, memory_per_rank, DATASETS.index(dataset), 7])
    target = fill * world * memory_per_rank
    chunk = max(64, int(4 * target / 10_000))
    drawn: list[Examples] = []

    def more() -> np.ndarray:
        drawn.append(draw(dataset, chunk, rng))
        return drawn[-1].llm

    bounds = cut_steps(more, steps, target)
    stream = Examples(np.concatenate([d.llm for d in drawn]), np.concatenate([d.items for d in drawn]))
    out = [stream[a:b] for a, b in bounds]
    for batch in out:
        if int(batch.llm.max()) > world * memory_per_rank:
            raise ValueError(
                f"{dataset}: a sequence of {int(batch.llm.max())} tokens exceeds {world} x {memory_per_rank}"
            )
    return out


def busiest(items: int, ranks: int) -> int:
    """Items on the busiest of ``ranks`` when ``items`` equal items are dealt out (longest
    processing time first is round robin for equal items)."""
    return -(-int(items) // int(ranks))


@dataclasses.dataclass
class StepTime:
    """One scheme's step: its time and parts (seconds), its largest shard, or why it cannot run."""

    total: float = math.nan
    encoder: float = math.nan
    llm: float = math.nan
    shard: int = -1
    infeasible: str | None = None


def time_step(
    scheme: str,
    batch: Examples,
    world: int,
    memory_per_rank: int,
    llm: CostModel,
    item_s: float,
    longest: int,
) -> StepTime:
    """Place one step with ``scheme`` and time it (see the module docstring); ``item_s`` is one
    item's encoder seconds, ``longest`` the data's longest sequence."""
    lengths, items = batch.llm, batch.items
    enc_seq = items * item_s
    if scheme in OURS:
        eb = scheme == "mmbalance_eb"
        rpn = min(RANKS_PER_NODE, world)
        plan = cp_schedule(lengths, world, memory_per_rank, llm, ranks_per_node=rpn)
        if not eb:  # as apply_dynamic_cp: the better of the plans with and without the encoder share
            other = cp_schedule(
                lengths, world, memory_per_rank, llm, ranks_per_node=rpn, encoder_seconds=enc_seq
            )
            plan = min(
                (other, plan), key=lambda p: llm.step_with_encoders(p, lengths, enc_seq, exchange="group")
            )
        group_of = plan.group_of(lengths.size)
        degree = np.array([g.degree for g in plan], dtype=np.int64)
        sched = schemes.Schedule(scheme, (schemes.Round(degree, group_of),))
        schemes.check_schedule(sched, lengths, world, memory_per_rank)
        group_items = np.bincount(group_of, weights=items, minlength=degree.size).astype(np.int64)
        llm_g = schemes.group_times(llm, lengths, sched.rounds[0])
        shard = schemes.largest_shard(sched, lengths)
        if eb:  # every item dealt over the whole world; one exchange over the world between the phases
            enc_t = busiest(int(items.sum()), world) * item_s
            llm_t = float(llm_g.max(initial=0.0))
            return StepTime(enc_t + llm_t, enc_t, llm_t, shard)
        # each group's items over its own ranks, the rows kept inside the group
        group_enc = np.array([busiest(n, d) for n, d in zip(group_items.tolist(), degree.tolist())]) * item_s
        return _slowest_group(group_enc, llm_g, shard)
    c = int(scheme.rsplit("cp", 1)[1])
    need = max(longest, int(lengths.max(initial=0)))
    if c * memory_per_rank < need:
        return StepTime(
            infeasible=f"{c} x {memory_per_rank} tokens cannot hold the data's longest sequence ({need})"
        )
    sched = schemes.static_cp(lengths, world, memory_per_rank, c, llm, enc_seq)
    if not sched.feasible:
        return StepTime(infeasible=str(sched.infeasible))
    schemes.check_schedule(sched, lengths, world, memory_per_rank)
    ((rnd),) = sched.rounds
    group_items = np.bincount(rnd.group_of, weights=items, minlength=rnd.degree.size).astype(np.int64)
    if scheme.startswith("preembed"):  # every member embeds the whole group's media
        enc_g = group_items * item_s
    else:
        enc_g = np.array([busiest(n, c) for n in group_items.tolist()], dtype=np.float64) * item_s
    return _slowest_group(
        enc_g, schemes.group_times(llm, lengths, rnd), schemes.largest_shard(sched, lengths)
    )


def _slowest_group(enc_g: np.ndarray, llm_g: np.ndarray, shard: int) -> StepTime:
    """A step whose groups run their encoder and LLM phases without waiting for each other: the
    slowest group's time and parts."""
    if not enc_g.size:
        return StepTime(0.0, 0.0, 0.0, shard)
    total = enc_g + llm_g
    k = int(np.argmax(total))
    return StepTime(float(total[k]), float(enc_g[k]), float(llm_g[k]), shard)


@dataclasses.dataclass
class VLMResult:
    """Per-step results of one (dataset, ranks, budget): every scheme's :class:`StepTime` per step."""

    dataset: str
    world: int
    memory_per_rank: int
    steps: list[dict[str, StepTime]]
    sequences: list[int]
    items: list[int]

    def mean(self, scheme: str, part: str = "total") -> float:
        vals = [getattr(s[scheme], part) for s in self.steps]
        return float(np.mean(vals)) if all(math.isfinite(v) for v in vals) else math.nan

    def reason(self, scheme: str) -> str:
        return next((s[scheme].infeasible for s in self.steps if s[scheme].infeasible), None) or ""

    def worst_ratio(self, scheme: str, other: str) -> float:
        """The largest per-step ``scheme / other`` over the steps both ran."""
        r = [s[scheme].total / s[other].total for s in self.steps
             if math.isfinite(s[scheme].total) and math.isfinite(s[other].total) and s[other].total > 0]  # fmt: skip
        return max(r, default=math.nan)


def run_config(
    dataset: str, world: int, memory_per_rank: int, steps: int, llm: CostModel, *, fill: float, seed: int
) -> VLMResult:
    """Every scheme on ``steps`` steps of ``dataset``."""
    item_s = item_seconds(llm)
    need = longest(dataset)
    batches = step_batches(dataset, world, memory_per_rank, steps, fill, seed)
    out = [{s: time_step(s, b, world, memory_per_rank, llm, item_s, need) for s in SCHEMES} for b in batches]
    return VLMResult(dataset, world, memory_per_rank, out, [len(b) for b in batches],
                     [int(b.items.sum()) for b in batches])  # fmt: skip


def rows_of(res: VLMResult) -> list[Row]:
    """One row per scheme (see the module docstring)."""
    dev = device_name()
    shape = f"{res.dataset}/R{res.world}/M{res.memory_per_rank}"
    ours = res.mean("mmbalance")
    rows = []
    for s in SCHEMES:
        mean = res.mean(s)
        metrics: dict = {
            "data": res.dataset,
            "ranks": res.world,
            "memory_per_rank": res.memory_per_rank,
            "steps": len(res.steps),
            "sequences_per_step": float(np.mean(res.sequences)),
            "items_per_step": float(np.mean(res.items)),
            "modelled": True,
            "feasible": math.isfinite(mean),
            "infeasible": res.reason(s),
            "encoder_ms": 1e3 * res.mean(s, "encoder"),
            "llm_ms": 1e3 * res.mean(s, "llm"),
            "largest_shard": max(st[s].shard for st in res.steps),
            "ours_speedup": mean / ours,
        }
        if s in OURS:
            metrics.update({f"worst_vs_{o}": res.worst_ratio(s, o) for o in SCHEMES if o not in OURS})
        rows.append(Row("cp_vlm_step", s, shape, "-", dev, 1e3 * mean, metrics))
    return rows


def acceptance(results: list[VLMResult]) -> list[tuple[str, bool, str]]:
    """Ours (both variants) at or below every static and pre-embedding scheme that runs, on every
    dataset (mean step of every configuration)."""
    checks = []
    for ds in dict.fromkeys(r.dataset for r in results):
        mine = [r for r in results if r.dataset == ds]
        for o in OURS:
            worst, where = 0.0, ""
            for r in mine:
                for s in SCHEMES:
                    if s in OURS or not math.isfinite(r.mean(s)):
                        continue
                    ratio = r.mean(o) / r.mean(s)
                    if ratio > worst:
                        worst, where = ratio, f"{s} at {r.world} ranks, {r.memory_per_rank} tokens"
            checks.append((f"{ds}: {o} <= every static and pre-embedding degree (mean step)",
                           worst <= 1.0 + 1e-9, f"worst {o}/other {worst:.4f} ({where})"))  # fmt: skip
    return checks


def summary_table(results: list[VLMResult]) -> str:
    """Markdown: one line per (dataset, ranks, budget), mean modelled step times in ms."""
    stat = " | ".join(f"static {c}" for c in STATIC_DEGREES)
    pre = " | ".join(f"pre-embed {c}" for c in STATIC_DEGREES)
    lines = [
        f"| data | ranks | tokens/rank | seqs (items)/step | {stat} | {pre} | ours | ours + encoder balance "
        "| ours vs best other | largest shard, ours / budget |",
        "|---|---|---|---|" + "---|" * (2 * len(STATIC_DEGREES)) + "---|---|---|---|",
    ]
    for r in results:
        others = [r.mean(s) for s in SCHEMES if s not in OURS and math.isfinite(r.mean(s))]
        ours = r.mean("mmbalance")
        cells = " | ".join(ms_cell(r.mean(s)) for s in SCHEMES if s not in OURS)
        shard = max(st["mmbalance"].shard for st in r.steps) / r.memory_per_rank
        lines.append(
            f"| {r.dataset} | {r.world} | {r.memory_per_rank} | {np.mean(r.sequences):.0f} ({np.mean(r.items):.0f}) "
            f"| {cells} | {ms_cell(ours)} | {ms_cell(r.mean('mmbalance_eb'))} "
            f"| {(min(others) / ours if others else math.nan):.2f}x | {shard:.3f} |"
        )
    return "\n".join(lines)


def plot(results: list[VLMResult], path: str) -> None:
    """:func:`~mmbalance.bench.harness.ratio_plot` of the results: each scheme's mean over ours."""
    ratio_plot(path, results, SCHEMES, lambda r, s: r.mean(s) / r.mean("mmbalance"), bold=OURS)
