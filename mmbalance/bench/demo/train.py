"""End-to-end demo: a balanced three-modality training step on real data sizes, on N ranks.

    mmbalance demo [--ranks 4] [--steps 6] [--per-rank 16] [--no-balance] [--json F] [--plot F.png]

Every rank samples examples whose sizes come from the shipped real-data mixture (images with
tiles, videos, speech with ASR or spoken-QA text; scaled down 16-64x so a CPU runs it), with
synthetic contents. Each step uses every part of the library: ``gather_lengths`` and per-phase
locality-aware plans (``Orchestrator``, planned in a background thread one step ahead),
``rebalance`` with ``segment_gather`` into the encoders' balanced layouts, packed varlen encoders,
composed moves of encoder outputs to the LLM layout, subsequence assembly, and an LLM block run by
pairs of ranks with ring attention and tensor-parallel linears (all-gather/GEMM overlap).

By default it trains twice from the same initialization, balanced and unbalanced, and checks that
the losses agree: the loss is a sum over text tokens divided by the *global* text-token count, so
moving examples between ranks cannot change it (a per-rank mean averaged over ranks would).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import textwrap
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..harness import check_outputs, command_parser, cpu_cores, save_plot, usage_error
from ..processes import spawn

ORDERS = [("vision", "audio", "text"), ("text", "vision", "audio")]
HIDDEN, HEADS, ENC_HIDDEN = 64, 4, 32
GROUP = 2  # ranks per LLM group (ring attention + tensor parallelism)


def step_data(seed: int, step: int, rank: int, per_rank: int, dtype):
    """This rank's examples of one step: sizes from the real-data mixture, synthetic contents."""
    from mmbalance.balancing.datasets import mixture

    from .model import FRAME_DIM, PATCH_DIM, VOCAB

    rng = np.random.default_rng([seed, step, rank])
    s = mixture(per_rank, rng)
    vision = s.vision // 64  # 16 patches per 448px tile, 4 per video frame: multiples of 4
    audio = (s.audio // 16) // 2 * 2  # ~3 frames per second of speech, even
    text = np.maximum(1, s.text // 16)
    g = torch.Generator().manual_seed(int(rng.integers(2**31)))

    def cu(lengths):
        c = torch.zeros(lengths.size + 1, dtype=torch.int32)
        c[1:] = torch.from_numpy(np.cumsum(lengths)).to(torch.int32)
        return c

    return {
        "sizes": {"vision": vision, "audio": audio, "text": text},
        "order_ids": rng.integers(0, len(ORDERS), size=per_rank),
        "patches": torch.randn(int(vision.sum()), PATCH_DIM, generator=g, dtype=dtype),
        "frames": torch.randn(int(audio.sum()), FRAME_DIM, generator=g, dtype=dtype),
        "text_ids": torch.randint(0, VOCAB, (int(text.sum()),), generator=g),
        "labels": torch.randint(0, VOCAB, (int(text.sum()),), generator=g),
        "cu": {"vision": cu(vision), "audio": cu(audio), "text": cu(text)},
    }


def _groups(world: int):
    """Every rank creates every group in the same order (a torch.distributed rule)."""
    pairs = [dist.new_group(list(range(g * GROUP, (g + 1) * GROUP))) for g in range(world // GROUP)]
    shards = [dist.new_group(list(range(i, world, GROUP))) for i in range(GROUP)]
    rank = dist.get_rank()
    return pairs[rank // GROUP], shards[rank % GROUP]


def _train(rank, world, args, balance: bool, pair, shard_dp, device, dtype):
    from mmbalance.balancing import PhaseSpec
    from mmbalance.collectives import Orchestrator, cp_shard
    from mmbalance.collectives.exchange.broadcast import broadcast_from_leader
    from mmbalance.collectives.ring.plan import ring_plan

    from .model import AudioEncoder, LLMBlock, VisionEncoder, init_

    torch.manual_seed(0)
    vision = VisionEncoder(ENC_HIDDEN, HIDDEN, dtype=dtype).to(device)
    audio = AudioEncoder(ENC_HIDDEN, HIDDEN, dtype=dtype).to(device)
    llm = LLMBlock(HIDDEN, HEADS, pair, dtype=dtype, seed=args.seed).to(device)
    init_(vision, args.seed + 10)
    init_(audio, args.seed + 20)
    init_(llm, args.seed + 30, skip=("up.", "down."))
    tp = {id(p) for p in llm.tp_parameters()}
    params = [*vision.parameters(), *audio.parameters(), *llm.parameters()]
    opt = torch.optim.SGD(params, lr=args.lr)
    orch = Orchestrator(
        {
            "vision": PhaseSpec("sum", downsample=4),
            "audio": PhaseSpec("conv", alpha=1.0, beta=1.0 / 64, downsample=2),
        },
        orders=ORDERS,
        ranks_per_node=args.ranks_per_node or None,
        llm_group_size=GROUP,
        balance=balance,
    )
    leader = (rank // GROUP) * GROUP
    losses, times, summaries, plan_ms, wait_ms = [], [], [], [], []
    data = step_data(args.seed, 0, rank, args.per_rank, dtype)
    fut = orch.submit(data["sizes"], data["order_ids"])
    for step in range(args.steps):
        dist.barrier()
        t0 = time.perf_counter()
        plan = fut.result()
        wait_ms.append((time.perf_counter() - t0) * 1e3)
        plan_ms.append(plan.plan_ms)
        if step + 1 < args.steps:  # plan the next step while this one computes
            nxt = step_data(args.seed, step + 1, rank, args.per_rank, dtype)
            fut = orch.submit(nxt["sizes"], nxt["order_ids"])
        mv = lambda k: data[k].to(device)  # noqa: E731
        # encoders on their balanced layouts; outputs go straight to the LLM layout
        parts = {}
        for name, enc, x, ds in (("vision", vision, "patches", 4), ("audio", audio, "frames", 2)):
            xe, cue = plan.to_encoder(name, mv(x), data["cu"][name].to(device))
            lens = plan.encoder[name].lengths[plan.encoder[name].recv_order(rank)]
            feats = enc(xe, cue, int(lens.max()) if lens.size else 0)
            parts[name] = plan.to_llm(name, feats, torch.div(cue, ds, rounding_mode="floor").to(torch.int32))
        (emb, labels), tcu = plan.to_llm(
            "text", [llm.embed(mv("text_ids")), mv("labels")], data["cu"]["text"].to(device)
        )
        parts["text"] = (emb, tcu)
        seq, cu = plan.assemble(parts)
        ignore = {
            n: (torch.full((p[0].shape[0],), -100, dtype=torch.int64, device=device), p[1])
            for n, p in parts.items()
            if n != "text"
        }
        lab, _ = plan.assemble({**ignore, "text": (labels, tcu)})
        # the LLM group: the leader's batch, sequence-sharded over the group (zigzag)
        lens = plan.llm.lengths[plan.llm.recv_order(leader)]
        cu_global = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
        total = int(cu_global[-1])
        seq_all = broadcast_from_leader(seq, (total, HIDDEN), pair, leader)
        lab_all = lab if rank == leader else torch.empty(total, dtype=torch.int64, device=device)
        dist.broadcast(lab_all, src=leader, group=pair)
        cu_t = torch.from_numpy(cu_global).to(device)
        x_local = cp_shard(seq_all, cu_t, group=pair, layout="zigzag")
        lab_local = cp_shard(lab_all, cu_t, group=pair, layout="zigzag")
        shard_sizes = list(ring_plan(cu_global, GROUP, "zigzag").tokens)
        logits = llm(x_local, cu_t, shard_sizes)
        text_tokens = int(plan.sizes["text"].sum())  # global, known from the plan: no reduction
        loss = (
            F.cross_entropy(
                logits.float() if dtype != torch.float64 else logits,
                lab_local,
                ignore_index=-100,
                reduction="sum",
            )
            / text_tokens
        )
        opt.zero_grad(set_to_none=False)
        loss.backward()
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad, group=shard_dp if id(p) in tp else None)
        opt.step()
        total_loss = loss.detach().clone().double()
        dist.all_reduce(total_loss)
        dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)
        losses.append(float(total_loss))
        times.append(float(dt) * 1e3)
        summaries.append(plan.summary())
        if rank == 0:
            _progress(step + 1, args.steps, "balanced" if balance else "unbalanced", losses[-1], times[-1])
        data = nxt if step + 1 < args.steps else None
    orch.close()
    return {
        "losses": losses,
        "step_ms": times,
        "summary": summaries,
        "plan_ms": plan_ms,
        "wait_ms": wait_ms,
        "offnode": _offnode(plan, args.ranks_per_node) if balance else None,
    }


def _offnode(plan, rpn):
    out = {}
    for name, p in {**plan.encoder, "llm": plan.llm}.items():
        out[name] = int(p.off_node_send(rpn).sum()) if rpn else 0
    return out


def _progress(done: int, total: int, label: str, loss: float, ms: float) -> None:
    width = 24
    bar = "#" * (width * done // total) + "-" * (width - width * done // total)
    tty = sys.stdout.isatty()
    end = "\n" if done == total or not tty else ""
    prefix = "\r" if tty else ""
    print(
        f"{prefix}{label:>10} [{bar}] step {done}/{total}  loss {loss:.6f}  {ms:7.1f} ms/step",
        end=end,
        flush=True,
    )


def _worker(rank, world, args):
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if dist.get_backend() == "nccl"
        else torch.device("cpu")
    )
    dtype = torch.float64 if args.dtype == "float64" else torch.float32
    pair, shard_dp = _groups(world)
    result = {}
    modes = [False] if args.no_balance else [True, False]
    for balance in modes:
        result["balanced" if balance else "unbalanced"] = _train(
            rank, world, args, balance, pair, shard_dp, device, dtype
        )
    dist.barrier()
    return result if rank == 0 else None


def _on_gpus(args) -> bool:
    return torch.cuda.is_available() and torch.cuda.device_count() >= args.ranks and not args.cpu


def run(args) -> dict:
    """Run the demo on ``args.ranks`` spawned processes; return the report (also as JSON)."""
    msg = check_args(args)
    if msg:
        raise ValueError(msg)
    backend = "nccl" if _on_gpus(args) else "gloo"
    result = spawn(
        _worker, args.ranks, args, backend=backend, pg_timeout=args.timeout, timeout=args.timeout * 4
    )[0]
    return _report(result, args)


def _report(result: dict, args) -> dict:
    balanced = "balanced" in result
    main = result.get("balanced") or result["unbalanced"]
    phases = {}
    for name in main["summary"][0]:
        steps = [s[name] for s in main["summary"]]
        before = float(np.mean([s["before"] for s in steps]))
        if not balanced:  # nothing was planned or moved: only the imbalance as sampled
            phases[name] = {"before": before, "after": before}
            continue
        phases[name] = {
            "before": before,
            "after": float(np.mean([s["after"] for s in steps])),
            "moved_tokens": int(sum(s["moved_tokens"] for s in steps)),
        }
        if main.get("offnode"):
            phases[name]["offnode_tokens_last_step"] = main["offnode"][name]
    on_gpus = _on_gpus(args)
    cores = cpu_cores()
    report = {
        "ranks": args.ranks,
        "steps": args.steps,
        "balanced": balanced,
        "device": "cuda" if on_gpus else "cpu",
        "cpu_cores": cores,
        "ranks_share_cores": (not on_gpus) and args.ranks > cores,
        "losses": main["losses"],
        "phases": phases,
        "step_ms": float(np.median(main["step_ms"][1:] or main["step_ms"])),
    }
    if balanced:
        report["plan_ms"] = float(np.median(main["plan_ms"]))
        report["plan_wait_ms"] = float(np.median(main["wait_ms"][1:] or main["wait_ms"]))
    if balanced and "unbalanced" in result:
        b, u = np.array(result["balanced"]["losses"]), np.array(result["unbalanced"]["losses"])
        report["losses_unbalanced"] = u.tolist()
        report["max_relative_loss_difference"] = float(np.max(np.abs(b - u) / np.maximum(np.abs(u), 1e-30)))
        report["step_ms_unbalanced"] = float(
            np.median(result["unbalanced"]["step_ms"][1:] or result["unbalanced"]["step_ms"])
        )
    _print(report)
    for path in (args.json, args.plot):
        if path:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    if args.plot:
        plot(report, args.plot)
    return report


def timing_note(rep: dict) -> str:
    """What the step times of this run can and cannot say (printed under them)."""
    if rep["device"] == "cuda":
        return "each rank has a GPU of its own: a step lasts as long as its slowest rank"
    if rep["ranks_share_cores"]:
        return (
            f"{rep['ranks']} ranks share {rep['cpu_cores']} CPU cores here: they take turns, so a step costs "
            "about the sum of all ranks' work, which balancing does not change; it only adds its moves. "
            "With a device per rank a step lasts as long as the slowest rank: the max/mean columns above "
            "are what balancing saves there (`mmbalance simulate` predicts it for real models)"
        )
    return (
        "each rank has a CPU core, but the demo's model is tiny, so the all-to-alls and the planning weigh "
        "as much as the compute: these step times do not show what balancing saves on a real model (the "
        "max/mean columns do; `mmbalance simulate` predicts the step time)"
    )


def _print(rep: dict) -> None:
    groups = rep["ranks"] // GROUP
    group = f"(LLM: {groups} group{'s' if groups > 1 else ''} of {GROUP})"
    if not rep["balanced"]:
        print(f"\nper phase over {rep['steps']} steps on {rep['ranks']} ranks {group}, not balanced:")
        print(f"{'phase':<8} {'max/mean':>9}")
        for name, p in rep["phases"].items():
            print(f"{name:<8} {p['before']:>9.3f}")
        print(f"\nstep time: {rep['step_ms']:.1f} ms (median, slowest rank)")
        print(textwrap.fill(f"note: {timing_note(rep)}", 100, initial_indent="  ", subsequent_indent="  "))
        print(f"losses: {', '.join(f'{x:.6f}' for x in rep['losses'])}")
        return
    print(f"\nper phase over {rep['steps']} steps on {rep['ranks']} ranks {group}:")
    print(
        f"{'phase':<8} {'max/mean before':>16} {'max/mean after':>15} {'tokens moved':>13} {'off-node (last)':>16}"
    )
    for name, p in rep["phases"].items():
        print(
            f"{name:<8} {p['before']:>16.3f} {p['after']:>15.3f} {p['moved_tokens']:>13d} {p.get('offnode_tokens_last_step', 0):>16d}"
        )
    print(
        f"\nplanning: {rep['plan_ms']:.1f} ms per step in a background thread, one step ahead; "
        f"the step waited {rep['plan_wait_ms']:.1f} ms for it"
    )
    if "step_ms_unbalanced" in rep:
        print(
            f"step time: balanced {rep['step_ms']:.1f} ms, unbalanced {rep['step_ms_unbalanced']:.1f} ms "
            "(median, slowest rank)"
        )
        print(textwrap.fill(f"note: {timing_note(rep)}", 100, initial_indent="  ", subsequent_indent="  "))
        print("losses (balanced / unbalanced):")
        for k, (a, b) in enumerate(zip(rep["losses"], rep["losses_unbalanced"])):
            print(f"  step {k}: {a:.10f}  {b:.10f}")
        print(f"max relative difference: {rep['max_relative_loss_difference']:.2e}")


def plot(rep: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    both = "losses_unbalanced" in rep
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.8))
    a.plot(rep["losses"], "o-", label="balanced" if both else "not balanced")
    if both:
        a.plot(rep["losses_unbalanced"], "x--", label="unbalanced")
        a.set_title(
            f"loss, balanced and not: equal to {rep['max_relative_loss_difference']:.1e} (relative)",
            fontsize=10,
        )
    else:
        a.set_title("loss (a run without balancing)", fontsize=10)
    a.set_xlabel("step")
    a.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    a.set_ylabel("loss (sum / global text tokens)")
    a.legend()
    names = list(rep["phases"])
    x = np.arange(len(names))
    if rep["balanced"]:
        b.bar(x - 0.2, [rep["phases"][n]["before"] for n in names], 0.4, label="before")
        b.bar(x + 0.2, [rep["phases"][n]["after"] for n in names], 0.4, label="after")
        b.legend()
        b.set_title("per-phase imbalance, before and after balancing", fontsize=10)
    else:
        b.bar(x, [rep["phases"][n]["before"] for n in names], 0.5)
        b.set_title("per-phase imbalance as sampled (not balanced)", fontsize=10)
    b.axhline(1.0, color="k", lw=0.5)
    b.set_xticks(x, names)
    b.set_ylabel("max / mean load across ranks")
    save_plot(fig, path)


def parser() -> argparse.ArgumentParser:
    p = command_parser("mmbalance demo", __doc__)
    p.add_argument(
        "--ranks",
        type=int,
        default=4,
        help=f"processes to spawn (a multiple of {GROUP}: LLM groups of {GROUP})",
    )
    p.add_argument("--steps", type=int, default=6, help="training steps (of each run)")
    p.add_argument("--per-rank", type=int, default=16, help="examples each rank samples per step")
    p.add_argument("--no-balance", action="store_true", help="train only without balancing")
    p.add_argument("--ranks-per-node", type=int, default=2, help="ranks per (simulated) node; 0: one node")
    p.add_argument(
        "--dtype", choices=["float32", "float64"], default="float32", help="parameter and activation dtype"
    )
    p.add_argument("--lr", type=float, default=0.05, help="SGD learning rate")
    p.add_argument("--seed", type=int, default=0, help="seed of the data and the initialization (>= 0)")
    p.add_argument("--cpu", action="store_true", help="stay on CPU/gloo even when GPUs are present")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds before a stuck collective fails")
    p.add_argument("--json", metavar="FILE", help="write the report as JSON to FILE")
    p.add_argument("--plot", metavar="FILE.png", help="plot losses and per-phase balance to FILE.png")
    return p


MAX_RANKS = 64  # processes on one machine


def check_args(args) -> str | None:
    """Why the arguments cannot run, or ``None``. Checked before any process starts."""
    if args.ranks < GROUP or args.ranks % GROUP:
        return f"--ranks must be a positive multiple of {GROUP}, got {args.ranks}"
    if args.ranks > MAX_RANKS:
        return (
            f"--ranks {args.ranks} is more processes than this demo runs on one machine (at most {MAX_RANKS})"
        )
    if args.steps < 1:
        return f"--steps must be >= 1, got {args.steps}"
    if args.per_rank < 1:
        return f"--per-rank must be >= 1, got {args.per_rank}"
    if args.ranks_per_node < 0 or (args.ranks_per_node and args.ranks % args.ranks_per_node):
        return f"--ranks-per-node must divide --ranks ({args.ranks}), got {args.ranks_per_node}"
    if not (args.lr > 0 and math.isfinite(args.lr)):
        return f"--lr must be a positive number, got {args.lr}"
    if args.seed < 0:
        return f"--seed must be >= 0, got {args.seed}"
    if not (args.timeout > 0 and math.isfinite(args.timeout)):
        return f"--timeout must be a positive number of seconds, got {args.timeout}"
    return check_outputs("mmbalance demo", args.json, args.plot)


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    msg = check_args(args)
    if msg:
        return usage_error("mmbalance demo", msg)
    try:
        rep = run(args)
    except OSError as exc:  # the outputs were checked first; a special file system can still refuse
        return usage_error(
            "mmbalance demo", f"cannot write {exc.filename or 'an output'}: {exc.strerror or exc}"
        )
    if "max_relative_loss_difference" in rep and rep["max_relative_loss_difference"] > (
        1e-6 if args.dtype == "float64" else 1e-3
    ):
        print("balanced and unbalanced losses disagree", file=sys.stderr)
        return 1
    return 0
