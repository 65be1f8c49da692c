"""Benchmark of the sliced all-gather/GEMM overlap: ``python -m mmbalance.bench.moves.overlap [--full] [--json FILE]``.

For each shape, backend and chunk count it reports the time of the overlapped op over
``max(GEMM alone, collective alone)`` (1.0 is perfect overlap; the floor in DESIGN.md) and over
the unoverlapped sequence (``chunks=1``: one collective, then one GEMM; below 1.0 is a win).

Ops (tensor-parallel MLP shapes, ``hidden`` = h, ``W`` ranks, ``tokens`` = M gathered rows):

* ``all_gather_matmul``: x_r ``[M/W, h]`` gathered, times the column shard ``[4h/W, h]``.
* ``matmul_reduce_scatter``: ``[M, 4h/W]`` times the row shard ``[h, 4h/W]``, reduce-scattered.
* ``all_gather_matmul+bwd`` (``--full``): forward and backward together, against ``chunks=1``.

Ranks are spawned with ``torch.multiprocessing``: NCCL, one GPU per rank, when CUDA is present
(shapes: hidden 4096-8192, tokens 4k-64k, bf16); gloo on CPU otherwise, with scaled-down shapes
and one GEMM thread per rank so the quick run stays well under a minute on two cores. Timing is a
fixed number of repetitions per rank, round-robin over the variants of a shape
(``bench.harness.time_cpu`` around a synchronized call; an adaptive timer such as ``do_bench``
would run a different number of collectives per rank and deadlock), and a row reports the slowest
rank's median.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import tempfile
from datetime import timedelta
from typing import Any

import torch
import torch.multiprocessing as mp

from ..harness import Row, base_parser, device_name, report, time_cpu
from ..processes import exit_code, exits_in_words, send_report, settle, start_processes


@dataclasses.dataclass(frozen=True)
class Config:
    op: str
    tokens: int
    hidden: int
    dtype: str

    @property
    def shape(self) -> str:
        return f"M={self.tokens},h={self.hidden}"


def configs(cuda: bool, full: bool) -> list[Config]:
    ops = ["all_gather_matmul", "matmul_reduce_scatter"] + (["all_gather_matmul+bwd"] if full else [])
    if cuda:
        shapes = [(4096, 4096), (16384, 8192)]
        if full:
            shapes = [(t, h) for h in (4096, 8192) for t in (4096, 16384, 65536)]
        dtype = "bfloat16"
    else:
        shapes = (
            [(2048, 256), (4096, 512)]
            if not full
            else [(t, h) for h in (256, 512) for t in (2048, 4096, 8192)]
        )
        dtype = "float32"
    return [Config(op, t, h, dtype) for op in ops for t, h in shapes]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _measure_interleaved(fns: dict[str, Any], device: torch.device, reps: int) -> dict[str, float]:
    """Median ms per variant, the slowest rank's, with the variants timed round-robin.

    Interleaving (rep 1 of every variant, then rep 2, ...) spreads slow drifts of a shared machine
    over all variants instead of penalizing whichever ran during a busy spell. The count of calls
    is fixed and identical on every rank, so the collectives inside always match.
    """
    import torch.distributed as dist

    times: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():  # warm-up: allocator, gloo pairs, NCCL communicators
        fn()
    _sync(device)
    dist.barrier()

    def synced(fn: Any) -> Any:
        def call() -> None:
            fn()
            _sync(device)

        return call

    calls = {name: synced(fn) for name, fn in fns.items()}
    for _ in range(reps):
        for name, call in calls.items():
            times[name].append(time_cpu(call, warmup=0, reps=1))
    medians = [sorted(ts)[len(ts) // 2] for ts in times.values()]
    t = torch.tensor(medians, dtype=torch.float64, device=device if device.type == "cuda" else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return dict(zip(fns, t.tolist()))


def _comm_alone(op: str, backend: str, layout, x: torch.Tensor, h: int, rand):
    """The collective of ``op`` alone, unsliced, through the same transport the op uses."""
    from mmbalance.collectives.overlap.comm import make_transport
    from mmbalance.collectives.overlap.plan import chunk_plan

    transport = make_transport(backend, None, layout, chunk_plan(layout, 1))
    if op == "matmul_reduce_scatter":
        partial = rand(layout.total, h)

        def reduce_scatter() -> None:
            handle = transport.start_reduce(h, x.dtype, x.device)
            handle.target(0).copy_(partial)
            handle.submit(0)
            handle.finish()

        return reduce_scatter
    buf = torch.empty(layout.total, h, device=x.device, dtype=x.dtype)
    return lambda: transport.start_gather(x, buf).wait_all()


def _op(op: str, backend: str, layout, x: torch.Tensor, w: torch.Tensor, rand):
    """``run(chunks)`` for the op under test."""
    from mmbalance.collectives import all_gather_matmul, matmul_reduce_scatter

    if op == "all_gather_matmul":
        return lambda c: all_gather_matmul(x, w, None, chunks=c, shard_sizes=layout, backend=backend)
    if op == "matmul_reduce_scatter":
        return lambda c: matmul_reduce_scatter(x, w, None, chunks=c, shard_sizes=layout, backend=backend)
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    grad = rand(layout.total, w.shape[0])

    def fwd_bwd(c: int | None) -> None:
        all_gather_matmul(xg, wg, None, chunks=c, shard_sizes=layout, backend=backend).backward(grad)
        xg.grad = wg.grad = None

    return fwd_bwd


def _bench_config(cfg: Config, rank: int, world: int, device: torch.device, chunk_list, backends, reps):
    import torch.distributed as dist

    from mmbalance.collectives.overlap.comm import resolve_backend
    from mmbalance.collectives.overlap.plan import ShardLayout, choose_chunks

    dtype = getattr(torch, cfg.dtype)
    m, h = cfg.tokens, cfg.hidden
    f_r = 4 * h // world
    layout = ShardLayout.even(m, world)
    gen = torch.Generator(device=device).manual_seed(rank)
    rand = lambda *s: torch.randn(*s, generator=gen, device=device, dtype=dtype) * 0.02
    rows: list[dict[str, Any]] = []
    if cfg.op == "matmul_reduce_scatter":
        x, w = rand(m, f_r), rand(h, f_r)
        k, n = f_r, h
        gemm = lambda: torch.mm(x, w.t())
    else:
        x, w = rand(layout.sizes[rank], h), rand(f_r, h)
        gathered = rand(m, h)
        k, n = h, f_r
        gemm = lambda: torch.mm(gathered, w.t())
    auto = choose_chunks(m, k, n, world, dtype, device.type)
    for backend in backends:
        try:
            resolve_backend(backend, x, None)
        except ValueError as exc:
            if rank == 0:
                print(f"skipping backend {backend}: {exc}")
            continue
        variants: list[int | None] = [1, *[c for c in chunk_list if c != 1], None]
        fns: dict[str, Any] = {"gemm": gemm, "comm": _comm_alone(cfg.op, backend, layout, x, h, rand)}
        run = _op(cfg.op, backend, layout, x, w, rand)
        fns.update({f"chunks={c}": functools.partial(run, c) for c in variants})
        ms = _measure_interleaved(fns, device, reps)
        bound = max(ms["gemm"], ms["comm"])
        for c in variants:
            t = ms[f"chunks={c}"]
            metrics = {
                "backend": backend,
                "world": world,
                "chunks": c if c is not None else f"auto({auto})",
                "gemm_ms": ms["gemm"],
                "comm_ms": ms["comm"],
                "over_max_gemm_comm": t / bound if "+bwd" not in cfg.op else None,
                "over_plain": t / ms["chunks=1"],
            }
            rows.append({"time_ms": t, "metrics": metrics})
    dist.barrier()
    return rows


def _worker(rank: int, world: int, init_file: str, cfgs, chunk_list, backends, reps, queue) -> None:
    import torch.distributed as dist

    from mmbalance.collectives.teardown import wait_for_backend_threads

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    else:
        torch.set_num_threads(1)
        device = torch.device("cpu")
    dist.init_process_group(
        "nccl" if cuda else "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=300),
    )
    try:
        for cfg in cfgs:
            rows = _bench_config(cfg, rank, world, device, chunk_list, backends, reps)
            if rank == 0:
                queue.put((cfg, rows))
    finally:
        wait_for_backend_threads(10)  # the last collectives' tensors released first (teardown.py)
        dist.destroy_process_group()
    if rank == 0:  # the end of the stream, flushed before the process exits (a rank that raised sends none)
        send_report(queue, (None, None))


def _collect(queue, procs, on_rows, exit_grace: float = 60.0) -> None:
    """Hand every ``(cfg, rows)`` that rank 0 streams to ``on_rows`` until its end marker. A rank
    that dies stops the run within a second or so, with how it ended; after the marker every process
    must exit with code 0 within ``exit_grace`` seconds."""
    import queue as queue_mod

    def take(wait: float | None) -> bool | None:
        """One message: ``True`` the end marker, ``False`` rows, ``None`` nothing within ``wait``."""
        try:
            cfg, rows = queue.get(timeout=wait) if wait else queue.get_nowait()
        except queue_mod.Empty:
            return None
        if cfg is None:
            return True
        on_rows(cfg, rows)
        return False

    finished = False
    try:
        while not finished:
            got = take(0.5)
            if got is not None:
                finished = got
                continue
            codes = [(r, exit_code(p)) for r, p in enumerate(procs)]
            failed: list[tuple[int, int | None]] = [(r, c) for r, c in codes if c not in (None, 0)]
            if not failed and not all(c == 0 for _, c in codes):
                continue  # every rank still at work
            while (got := take(None)) is False:  # what was sent before the processes ended
                pass
            finished = bool(got)
            if not finished:
                raise SystemExit(
                    "benchmark ranks ended before the run finished: "
                    + exits_in_words(failed or codes, set(), 0)
                )
    finally:
        hung = settle(procs, exit_grace if finished else 5.0)
    bad = [(r, exit_code(p)) for r, p in enumerate(procs) if exit_code(p) != 0]
    if bad:
        raise SystemExit(f"the benchmark finished, but then {exits_in_words(bad, hung, exit_grace)}")


def main(argv: list[str] | None = None) -> list[Row]:
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=None, help="ranks (default: all GPUs, or 2 on CPU)")
    p.add_argument("--chunks", type=int, nargs="+", default=None, help="chunk counts besides 1 and auto")
    p.add_argument("--backend", choices=["torch", "copy_engine", "all"], default="all")
    p.add_argument("--reps", type=int, default=None, help="timed repetitions per point")
    args = p.parse_args(argv)
    cuda = torch.cuda.is_available()
    world = args.world or (torch.cuda.device_count() if cuda else 2)
    chunk_list = args.chunks or ([2, 4, 8] if args.full or cuda else [2, 4])
    backends = ["torch", "copy_engine"] if args.backend == "all" else [args.backend]
    if not cuda:
        backends = [b for b in backends if b == "torch"] or ["torch"]
    reps = args.reps or (20 if cuda else 9)
    cfgs = configs(cuda, args.full)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    device = device_name("cuda:0" if cuda else "cpu")
    out: list[Row] = []

    def on_rows(cfg, rows) -> None:
        batch = [
            Row(
                op=cfg.op,
                provider=f"{r['metrics']['backend']}/chunks={r['metrics']['chunks']}",
                shape=cfg.shape,
                dtype=cfg.dtype,
                device=f"{device} x{world} ({'nccl' if cuda else 'gloo'})",
                time_ms=r["time_ms"],
                metrics={k: v for k, v in r["metrics"].items() if k != "backend"},
            )
            for r in rows
        ]
        report(batch, json_path=args.json, title=f"{cfg.op} {cfg.shape} {cfg.dtype}")
        out.extend(batch)

    with tempfile.TemporaryDirectory() as tmp:
        procs = [
            ctx.Process(
                target=_worker,
                args=(r, world, os.path.join(tmp, "rdv"), cfgs, chunk_list, backends, reps, queue),
                daemon=True,
            )
            for r in range(world)
        ]
        start_processes(procs)
        _collect(queue, procs, on_rows)
    return out


if __name__ == "__main__":
    main()
