"""Real steps of dynamic context parallelism on gloo ranks (the second part of ``mmbalance bench cp``).

    mmbalance bench cp --real [--json FILE]          # the modelled part, then this one
    python -m mmbalance.bench.cp --real-only [--real-steps 8] [--real-budget 512] [--json FILE]

The bench starts ``torchrun --standalone --nproc-per-node 4 -m mmbalance.bench.cp.real`` (CPU,
gloo) and reads back what rank 0 wrote. Every rank holds the same tiny Llama (transformers'
``LlamaForCausalLM``: hidden 32, 2 layers, 4 heads of which 2 KV heads, vocabulary 128, random
weights, float32, ``attn_implementation="mmbalance_varlen"``). A step is drawn like the modelled
part's (the ``long_tail_1%`` data, every length divided by 32, so the rare long sequences span 1-4
ranks' budget of 512 tokens; ``fill`` 0.75 of all ranks' budget), cut into 4 contiguous parts: each
rank's own draw, packed as ``DataCollatorWithFlattening`` packs it (``input_ids``, restarting
``position_ids``, ``labels``).

Schemes, each through :func:`mmbalance.integrations.hf.apply_dynamic_cp` on the same weights:

* ``mmbalance``: ``cost="quadratic"`` (the library's default);
* ``static_cp1``, ``static_cp2``, ``static_cp4``: a fixed degree ``c``, realized by the same handle
  with a per-sequence cost that only degree ``c`` meets (:class:`StaticDegree`; every other degree
  costs a million times more), so every group has ``c`` ranks: ``world // c`` groups balanced
  greedily, as in the modelled part, through the same all-to-all and ring. (accelerate itself
  loads a CP group's batch on each of its ranks instead of moving tokens; its ring is the same.)
  A degree whose ranks cannot hold some sequence of the run is infeasible, with the reason.

Per step: ``shard`` (plan + agreement + the all-to-all), forward, backward and the gradient sum
over ranks (an all-reduce per parameter, as DDP does), timed on every rank; the step time is the
slowest rank's. Rows (op ``cp_real_step``): ``time_ms`` the median step, ``shard_ms`` the median of
``shard``'s part, ``alltoall_tokens`` / ``alltoall_bytes`` per step (tokens that leave their rank;
4 int64 columns a token: ids, labels, shifted labels, positions), the degrees used, the largest
shard, and ``loss_rel_to_ours``: every scheme computes the same global loss on the same weights
(the weights are not updated), so it is a check, near 1e-7.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np

from mmbalance.balancing import CostModel

from ..harness import Row, device_name
from ..processes import child_dies_with_parent
from . import schemes
from .data import FILL, draw

WORLD = 4
DEGREES = (1, 2, 4)
SCHEMES = ("mmbalance", *(f"static_cp{c}" for c in DEGREES))
VOCAB = 128
PAYLOAD_BYTES = 4 * 8  # int64 columns a token moves with: ids, labels, shifted labels, positions


class StaticDegree:
    """A per-sequence cost (vectorized, as :func:`~mmbalance.balancing.cp_schedule` takes it) that
    only degree ``degree`` meets: ``base``'s time of each sequence alone there, a million times
    that (plus one) on any other degree."""

    def __init__(self, degree: int, base: CostModel):
        self.degree, self.base = int(degree), base

    def __call__(self, lengths: np.ndarray, degree: int) -> np.ndarray:
        x = lengths.astype(np.float64)
        t = schemes.times_of(self.base, x, x * x, np.ones_like(x), np.full(x.shape, degree))
        return t if degree == self.degree else 1e6 * t + 1.0


def real_steps(dataset: str, world: int, budget: int, steps: int, fill: float, seed: int, scale: int):
    """``steps`` global batches (lengths divided by ``scale``), each cut into ``world`` contiguous
    parts: ``[step][rank]`` int64 lengths (a rank may have none)."""
    rng = np.random.default_rng([seed, world, budget, 7])
    target = fill * world * budget
    out: list[list[np.ndarray]] = []
    buf = np.zeros(0, dtype=np.int64)
    while len(out) < steps:
        k = int(np.searchsorted(np.cumsum(buf), target, side="right"))
        if k == buf.size:  # the stream ran out before the step filled up
            more = np.maximum(1, np.round(draw(dataset, 1024, rng) / scale)).astype(np.int64)
            buf = np.concatenate([buf, more])
            continue
        step, buf = buf[: max(k, 1)], buf[max(k, 1) :]
        if int(step.max()) > world * budget:
            raise ValueError(
                f"budget {budget}: a sequence of {int(step.max())} tokens does not fit {world} ranks; "
                "raise the budget or the length scale"
            )
        out.append(np.array_split(step, world))
    return out


def _packed(lengths: np.ndarray, step: int, rank: int):
    """A rank's packed batch: random token ids (seeded by step and rank), restarting positions,
    labels = ids with each sequence's first token unlabelled."""
    import torch

    g = torch.Generator().manual_seed(1000 * step + rank)
    total = int(lengths.sum())
    ids = torch.randint(1, VOCAB, (1, total), generator=g)
    starts = np.repeat(np.cumsum(lengths) - lengths, lengths)
    pos = torch.from_numpy(np.arange(total, dtype=np.int64) - starts).unsqueeze(0)
    labels = ids.clone()
    labels[0, torch.from_numpy((np.cumsum(lengths) - lengths).astype(np.int64))] = -100
    return {"input_ids": ids, "position_ids": pos, "labels": labels}


def tiny_llama(layers: int):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=8192, pad_token_id=0, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    return LlamaForCausalLM._from_config(cfg, attn_implementation="mmbalance_varlen", dtype=torch.float32)


def worker(argv: list[str]) -> None:
    """One rank of the run (started by torchrun); rank 0 writes the results to ``--out``."""
    import torch
    import torch.distributed as dist

    from mmbalance.collectives.teardown import wait_for_backend_threads
    from mmbalance.integrations.hf import apply_dynamic_cp, register_attention

    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--budget", type=int, default=512)
    p.add_argument("--dataset", default="long_tail_1%")
    p.add_argument("--scale", type=int, default=32)
    p.add_argument("--fill", type=float, default=FILL)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--layers", type=int, default=2)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    register_attention()
    model = tiny_llama(args.layers)
    params = [q for q in model.parameters() if q.requires_grad]
    total_steps = args.warmup + args.steps
    data = real_steps(args.dataset, world, args.budget, total_steps, args.fill, args.seed, args.scale)
    longest = max(int(part.max(initial=0)) for step in data for part in step)
    from mmbalance.integrations.hf.cp import cost_model_of

    base = cost_model_of(model, "quadratic")
    assert isinstance(base, CostModel)
    results: dict[str, dict] = {}
    for scheme in SCHEMES:
        c = 0 if scheme == "mmbalance" else int(scheme[len("static_cp") :])
        if c and (c > world or longest > c * args.budget):
            results[scheme] = {
                "infeasible": f"{c} x {args.budget} tokens cannot hold a sequence of {longest}"
            }
            continue
        handle = apply_dynamic_cp(
            model, max_tokens_per_rank=args.budget, cost=StaticDegree(c, base) if c else "quadratic"
        )
        rec: dict[str, list] = {k: [] for k in ("step_s", "shard_s", "moved", "loss", "largest", "degrees")}
        for s in range(total_steps):
            batch = _packed(data[s][rank], s, rank)
            dist.barrier()
            t0 = time.perf_counter()
            kw = handle.shard(batch)
            t1 = time.perf_counter()
            loss = model(**kw).loss
            loss.backward()
            for q in params:
                dist.all_reduce(q.grad)
            t2 = time.perf_counter()
            model.zero_grad(set_to_none=True)
            times = torch.tensor([t2 - t0, t1 - t0], dtype=torch.float64)
            dist.all_reduce(times, op=dist.ReduceOp.MAX)
            total = loss.detach().to(torch.float64)
            dist.all_reduce(total)
            stats = handle.stats
            if c and set(stats["degrees"]) != {c}:
                raise RuntimeError(f"{scheme}: the schedule has degrees {stats['degrees']}")
            if s >= args.warmup:
                rec["step_s"].append(float(times[0]))
                rec["shard_s"].append(float(times[1]))
                rec["moved"].append(int(stats["moved_tokens"]))
                rec["loss"].append(float(total))
                rec["largest"].append(int(stats["largest_shard"]))
                rec["degrees"].append(list(stats["degrees"]))
        handle.remove()
        results[scheme] = rec
    if rank == 0:
        meta = {"world": world, "budget": args.budget, "dataset": args.dataset, "scale": args.scale,
                "steps": args.steps, "layers": args.layers,
                "sequences": [int(sum(p.size for p in step)) for step in data[args.warmup :]]}  # fmt: skip
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "results": results}, f)
    dist.barrier()
    wait_for_backend_threads(10)  # the barrier's tensors released before the group goes (teardown.py)
    dist.destroy_process_group()


def launch(
    out: str, *, steps: int = 8, budget: int = 512, timeout: float = 900.0, extra: list[str] | None = None
) -> dict:
    """Run :func:`worker` on ``WORLD`` local ranks through torchrun; return rank 0's results."""
    port = str(29700 + int.from_bytes(os.urandom(2), "little") % 300)
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(WORLD),
        "--master-addr", "127.0.0.1", "--master-port", port, "-m", "mmbalance.bench.cp.real",
        "--out", out, "--steps", str(steps), "--budget", str(budget), *(extra or []),
    ]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1")
    with tempfile.TemporaryFile("w+") as log:
        # torchrun leads a session of its own (so the time limit can end its workers with it), and
        # gets SIGTERM, on which it stops its workers, when this process ends however it ends
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                preexec_fn=child_dies_with_parent(signal.SIGTERM))  # fmt: skip
        rc = None
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass
        finally:
            if proc.poll() is None:  # the time limit, or an exception here (KeyboardInterrupt)
                os.killpg(proc.pid, signal.SIGTERM)  # torchrun stops its workers on SIGTERM
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
        log.seek(0)
        text = log.read()
    if rc != 0 or not os.path.exists(out):
        why = f"did not finish within {timeout:.0f} s" if rc is None else f"exited with code {rc}"
        raise RuntimeError(f"torchrun {' '.join(cmd[3:])} {why}:\n{text[-4000:]}")
    with open(out) as f:
        return json.load(f)


def rows_of(res: dict) -> list[Row]:
    """One row per scheme (see the module docstring)."""
    meta, results = res["meta"], res["results"]
    shape = f"{meta['dataset']}/{meta['world']} gloo ranks/M{meta['budget']}/llama-h32x{meta['layers']}"
    ours_loss = np.array(results["mmbalance"]["loss"])
    rows = []
    for scheme in SCHEMES:
        r = results[scheme]
        metrics: dict = {
            "data": meta["dataset"],
            "ranks": meta["world"],
            "memory_per_rank": meta["budget"],
            "steps": meta["steps"],
            "sequences_per_step": float(np.mean(meta["sequences"])),
            "feasible": "infeasible" not in r,
            "infeasible": r.get("infeasible", ""),
        }
        if "infeasible" in r:
            rows.append(Row("cp_real_step", scheme, shape, "float32", device_name(), float("nan"), metrics))
            continue
        degrees: dict[int, int] = {}
        for ds in r["degrees"]:
            for d in ds:
                degrees[d] = degrees.get(d, 0) + 1
        metrics.update(
            {
                "shard_ms": 1e3 * float(np.median(r["shard_s"])),
                "step_ms_max": 1e3 * float(np.max(r["step_s"])),
                "alltoall_tokens": float(np.mean(r["moved"])),
                "alltoall_bytes": float(np.mean(r["moved"])) * PAYLOAD_BYTES,
                "largest_shard": int(max(r["largest"])),
                "degrees": ",".join(f"{d}x{n}" for d, n in sorted(degrees.items())),
                "loss_rel_to_ours": float(
                    np.max(np.abs(np.array(r["loss"]) - ours_loss) / np.abs(ours_loss))
                ),
            }
        )
        step_ms = 1e3 * float(np.median(r["step_s"]))
        rows.append(Row("cp_real_step", scheme, shape, "float32", device_name(), step_ms, metrics))
    ours = rows[0].time_ms
    for row in rows:
        row.metrics["ours_speedup"] = row.time_ms / ours
    return rows


def summary_table(rows: list[Row]) -> str:
    """Markdown: one line per scheme."""
    lines = [
        "| scheme | median step ms | shard ms (plan + all-to-all) | all-to-all per step: tokens / KB | degrees used "
        "| largest shard | loss vs ours |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        m = r.metrics
        if not m["feasible"]:
            lines.append(f"| {r.provider} | cannot run: {m['infeasible']} | | | | | |")
            continue
        lines.append(
            f"| {r.provider} | {r.time_ms:.0f} | {m['shard_ms']:.1f} | {m['alltoall_tokens']:.0f} / "
            f"{m['alltoall_bytes'] / 1024:.1f} | {m['degrees']} | {m['largest_shard']} | {m['loss_rel_to_ours']:.1e} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    worker(sys.argv[1:])
