"""Hugging Face models: encoder balancing's overhead against the encoder, or (``--device``) one
end-to-end training step with ``mmbalance_varlen`` against the stock attention.

    python -m mmbalance.bench.hf [--world 2] [--steps 8] [--json FILE]
    mmbalance bench hf --device cuda        # the end-to-end step (bench/hf/train_step.py)

A Qwen2-VL (random weights, built from a config: no download) trains on ``--world`` ranks with a
skewed batch (rank 0 several large images, the others one small image each), balanced with
``apply_encoder_balance``. Per forward the handle times the size exchange and planning, the
all-to-all of the inputs, the encoder, and the all-to-all of the outputs; the rows report their
medians over the steps (the slowest rank), the overhead (planning plus both all-to-alls) over the
encoder's time, the vision max/mean before and after, and the step time balanced vs unbalanced.
Two sizes: ``tiny`` (hidden 32, the test configuration) and ``small`` (ViT width 256, 4 layers,
larger images), where the encoder does real work. A third case, ``video``, gives rank 0 one 8-frame
video and every other rank one small image, balanced with the video's frames as items of their own
(``split_frames=True``, the default) and as one item (``split_frames=False``). On a CPU with gloo
these are loopback numbers.
"""

from __future__ import annotations

import time

import numpy as np

from ..harness import Row, base_parser, device_name, report
from ..processes import spawn
from . import train_step

CONFIGS = {
    # name: (ViT depth, ViT width, LLM width, large image side in patches, large images on rank 0;
    # for "video": the frames of rank 0's one video)
    "tiny": (1, 32, 32, 8, 4),
    "small": (4, 256, 256, 24, 6),
    "video": (2, 64, 64, 12, 8),
}
IMAGE, VSTART, VEND, VIDEO = 100, 101, 102, 103


def _model(depth: int, width: int, llm: int):
    import torch
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    torch.manual_seed(0)
    half = llm // 8  # half the head dim of 4 heads: the M-RoPE sections must add up to it
    section = [half - 2 * (half // 3), half // 3, half // 3]
    cfg = Qwen2VLConfig(
        text_config=dict(vocab_size=256, hidden_size=llm, intermediate_size=2 * llm, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, bos_token_id=1,
                         eos_token_id=2, rope_parameters={"rope_type": "default", "mrope_section": section}),
        vision_config=dict(depth=depth, embed_dim=width, hidden_size=llm, num_heads=4, mlp_ratio=4,
                           patch_size=4, temporal_patch_size=2, spatial_merge_size=2),
        image_token_id=IMAGE, vision_start_token_id=VSTART, vision_end_token_id=VEND, video_token_id=VIDEO,
    )  # fmt: skip
    return Qwen2VLForConditionalGeneration(cfg).train()


def _batch(rank: int, step: int, side: int, count: int, video: bool = False) -> dict:
    import torch

    g = torch.Generator().manual_seed(1000 * step + rank)
    if video and rank == 0:  # one video of `count` frames
        n = count * side * side // 4
        ids = torch.tensor([[5] * 3 + [VSTART] + [VIDEO] * n + [VEND] + [7] * 8])
        tt = torch.tensor([[0] * 4 + [2] * n + [0] * 9], dtype=torch.int)
        return dict(input_ids=ids, attention_mask=torch.ones_like(ids), mm_token_type_ids=tt,
                    labels=ids.masked_fill(tt != 0, -100), pixel_values_videos=torch.randn(n * 4, 96, generator=g),
                    video_grid_thw=torch.tensor([[count, side, side]]))  # fmt: skip
    grids = [(side, side)] * count if rank == 0 else [(4, 4)]
    rows, types, pix = [], [], []
    for h, w in grids:
        n = h * w // 4
        rows.append([5] * 3 + [VSTART] + [IMAGE] * n + [VEND] + [7] * 8)
        types.append([0] * 4 + [1] * n + [0] * 9)
        pix.append(torch.randn(h * w, 96, generator=g))
    width = max(map(len, rows))
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask, tt = torch.zeros_like(ids), torch.zeros(len(rows), width, dtype=torch.int)
    for i, (r, t) in enumerate(zip(rows, types)):
        ids[i, : len(r)], mask[i, : len(r)], tt[i, : len(t)] = torch.tensor(r), 1, torch.tensor(t)
    return dict(input_ids=ids, attention_mask=mask, mm_token_type_ids=tt, labels=ids.masked_fill(tt != 0, -100),
                pixel_values=torch.cat(pix), image_grid_thw=torch.tensor([[1, h, w] for h, w in grids]))  # fmt: skip


def _worker(rank: int, world: int, config: str, steps: int) -> dict:
    import torch
    import torch.distributed as dist

    from mmbalance.integrations.hf import apply_encoder_balance

    depth, width, llm, side, count = CONFIGS[config]
    video = config == "video"
    out = {}
    modes = ("balanced", "whole_videos", "unbalanced") if video else ("balanced", "unbalanced")
    for key in modes:
        model = _model(depth, width, llm)
        handle = None if key == "unbalanced" else apply_encoder_balance(model, split_frames=key == "balanced")
        timings, stats, step_ms = [], [], []
        for step in range(steps + 2):  # two warm-up steps
            batch = _batch(rank, step, side, count, video)
            dist.barrier()
            t0 = time.perf_counter()
            model(**batch).loss.backward()
            dt = torch.tensor([time.perf_counter() - t0])
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)
            if step >= 2:
                step_ms.append(1e3 * float(dt))
                if handle:
                    t = handle.timings["vision"]
                    vec = torch.tensor([t["plan_ms"], t["move_in_ms"], t["encode_ms"], t["move_back_ms"]])
                    dist.all_reduce(vec, op=dist.ReduceOp.MAX)
                    timings.append(vec.tolist())
                    stats.append(handle.stats["vision"])
        out[key] = {"step_ms": float(np.median(step_ms))}
        if handle:
            med = np.median(np.asarray(timings), axis=0)
            out[key].update(plan_ms=med[0], move_in_ms=med[1], encode_ms=med[2], move_back_ms=med[3])
            out[key].update(before=stats[-1]["before"], after=stats[-1]["after"], moved=stats[-1]["moved"])
            handle.remove()
    return out


def bench(world: int, steps: int, configs) -> list[Row]:
    rows = []
    for config in configs:
        res = spawn(_worker, world, config, steps)[0]
        b, u = res["balanced"], res["unbalanced"]
        overhead = b["plan_ms"] + b["move_in_ms"] + b["move_back_ms"]
        depth, width, llm, side, count = CONFIGS[config]
        what = f"one {count}-frame video of" if config == "video" else f"{count} images of"
        extra = {}
        if "whole_videos" in res:
            w = res["whole_videos"]
            extra = {"vision_after_whole_videos": w["after"], "step_ms_whole_videos": w["step_ms"]}
        rows.append(
            Row(
                "hf_encoder_balance[qwen2_vl]",
                "mmbalance",
                f"{config}: ViT {depth}x{width}, {world} ranks, rank 0 {what} {side}x{side} patches",
                "float32",
                device_name(),
                overhead,
                {
                    "plan_ms": b["plan_ms"],
                    "all_to_alls_ms": b["move_in_ms"] + b["move_back_ms"],
                    "encoder_ms": b["encode_ms"],
                    "overhead/encoder": overhead / max(b["encode_ms"], 1e-9),
                    "vision_before": b["before"],
                    "vision_after": b["after"],
                    "moved": b["moved"],
                    "step_ms_balanced": b["step_ms"],
                    "step_ms_unbalanced": u["step_ms"],
                    **extra,
                },
            )
        )
    return rows


def main(argv=None) -> None:
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--steps", type=int, help="steps per case (default 8; with --device 5, --quick 2)")
    p.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        help="run one end-to-end training step on this device instead (mmbalance_varlen against sdpa and "
        "flash_attention_2; bench/hf/train_step.py)",
    )
    p.add_argument("--step-config", choices=sorted(train_step.CONFIGS), help="with --device: the model (default: "
                   "tiny on cpu, qwen2vl-2b on cuda)")  # fmt: skip
    p.add_argument(
        "--tokens", type=int, help="with --device: tokens per step (default 1024 on cpu, 8192 on cuda)"
    )
    p.add_argument(
        "--max-length", type=int, help="with --device: the longest example (default 2048 on cuda, 256 on cpu)"
    )
    args = p.parse_args(argv)
    try:
        import transformers  # noqa: F401
    except ImportError:
        print('mmbalance bench hf needs transformers (pip install "mmbalance[hf]"); skipped')
        return
    if args.device is not None:
        cuda = args.device == "cuda"
        if cuda:
            import torch

            if not torch.cuda.is_available():
                raise SystemExit("bench.hf: --device cuda, but torch sees no CUDA device")
        cfg = train_step.StepConfig(
            config=args.step_config or ("qwen2vl-2b" if cuda else "tiny"),
            device=args.device,
            tokens=args.tokens if args.tokens is not None else (8192 if cuda else 1024),
            max_length=args.max_length if args.max_length is not None else (2048 if cuda else 256),
            steps=args.steps if args.steps is not None else (2 if args.quick else 5),
        )
        if cfg.tokens < 1 or cfg.max_length < 8 or cfg.steps < 1:
            raise SystemExit("bench.hf: --tokens and --steps must be >= 1 and --max-length >= 8")
        report(
            train_step.bench(cfg),
            args.json,
            f"one training step on {args.device}: {cfg.config}, ~{cfg.tokens} tokens",
        )
        return
    steps = args.steps or 8
    configs = ["tiny", "video"] if args.quick else ["tiny", "small", "video"]
    report(
        bench(args.world, max(2, steps // 2) if args.quick else steps, configs),
        args.json,
        "encoder balancing of a Hugging Face Qwen2-VL: overhead (plan + two all-to-alls) vs the encoder",
    )
