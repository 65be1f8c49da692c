"""One training step on one device: ``mmbalance_varlen`` (packed) against ``sdpa`` (the same
examples padded) and ``flash_attention_2`` (packed, where flash-attn is installed).

    mmbalance bench hf --device cuda [--quick] [--json FILE]
    python -m mmbalance.bench.hf --device cuda [--step-config qwen2vl-2b] [--tokens 8192] [--steps 5]

The model is the language model of Qwen2-VL-2B (a Qwen2 decoder: hidden 1536, 28 layers, 12 heads
with 2 key/value heads, MLP 8960, vocabulary 151936: 1.5 B parameters), built from its config with
random weights in bfloat16 (no download); ``tiny`` (hidden 64, 2 layers, float32) is the CPU
smoke size. A step is forward, backward and an AdamW step on about ``--tokens`` tokens of
sequences drawn from the shipped multimodal length distribution (``mmbalance/data/mm_sizes.npz``:
images, videos and speech, the media's LLM tokens counted as tokens; no pixels: this measures the
language model's step, where the attention runs), cut at ``--max-length`` (8192 tokens a step and 2048 a sequence by default on a GPU: about 45 GiB
packed and 65 GiB padded of an H100's 80, with the 150k-word vocabulary's logits). Every provider trains
the same examples from the same weights: ``mmbalance_varlen`` and ``flash_attention_2`` on one
packed row (``DataCollatorWithFlattening``), ``sdpa`` on the examples padded to the longest.

Rows (op ``hf_train_step``, one per provider): ``time_ms`` the median step, ``tokens_per_s`` (real
tokens), ``peak_gib`` (``torch.cuda.max_memory_allocated``; 0 on CPU), ``loss`` of the first step
(before any update, so the providers' losses agree to their precision), ``padded_tokens`` (what the
attention ran over), and for ours ``vs_sdpa`` (the sdpa step over ours) and the block ops'
backend for such a call (``torch_flash`` with the FlashAttention torch runs, or what flash-attn,
Triton, the reference give).
"""

from __future__ import annotations

import dataclasses
import statistics
import time

from ..harness import Row, device_name, draw_lengths

CONFIGS = {
    # name: (hidden, layers, heads, kv heads, MLP, vocabulary, dtype)
    "tiny": (64, 2, 4, 2, 128, 512, "float32"),
    "qwen2vl-2b": (1536, 28, 12, 2, 8960, 151936, "bfloat16"),
}
PROVIDERS = ("mmbalance_varlen", "sdpa", "flash_attention_2")


@dataclasses.dataclass(frozen=True)
class StepConfig:
    config: str
    device: str
    tokens: int
    max_length: int
    steps: int
    seed: int = 0


def _model(cfg: StepConfig):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    hidden, layers, heads, kv, mlp, vocab, dtype = CONFIGS[cfg.config]
    config = Qwen2Config(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=mlp, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=32768, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
    )  # fmt: skip
    torch.manual_seed(cfg.seed)
    # built on the device: 1.5 B parameters' random initialization takes the GPU a fraction of a second
    with torch.device(cfg.device):
        model = Qwen2ForCausalLM._from_config(config, attn_implementation="sdpa", dtype=getattr(torch, dtype))
    return model.to(cfg.device).train()


def _batches(cfg: StepConfig, vocab: int) -> tuple[dict, dict, list[int]]:
    """The step's examples packed and padded, and their lengths."""
    import torch
    from transformers import DataCollatorWithFlattening

    lengths = draw_lengths(cfg.tokens, cfg.max_length, cfg.seed)
    g = torch.Generator().manual_seed(cfg.seed)
    rows = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]
    packed = DataCollatorWithFlattening(return_tensors="pt")([{"input_ids": r, "labels": r} for r in rows])
    width = max(lengths)
    ids = torch.zeros((len(rows), width), dtype=torch.int64)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
        mask[i, : len(r)] = 1
    padded = {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}
    move = lambda b: {k: v.to(cfg.device) for k, v in b.items()}
    return move(packed), move(padded), lengths


def _available(provider: str, device: str) -> str | None:
    """Why ``provider`` cannot run here, or ``None``."""
    if provider == "flash_attention_2":
        if not device.startswith("cuda"):
            return "flash_attention_2 needs CUDA"
        try:
            import flash_attn  # noqa: F401
        except ImportError:
            return "flash-attn is not installed"
    return None


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def run_provider(model, state: dict, provider: str, batch: dict, cfg: StepConfig) -> dict:
    """Train ``cfg.steps`` steps (one of warm-up first) of ``batch`` from ``state``; the median
    step time, the peak memory and the first step's loss."""
    import torch

    model.load_state_dict(state)
    model.set_attn_implementation(provider)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=True)
    cuda = cfg.device.startswith("cuda")
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    times, first = [], None
    for step in range(cfg.steps + 1):
        _sync(cfg.device)
        t0 = time.perf_counter()
        loss = model(**batch, use_cache=False).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        _sync(cfg.device)
        if step:
            times.append(1e3 * (time.perf_counter() - t0))
        if first is None:
            first = float(loss.detach())
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0
    del opt
    return {"step_ms": statistics.median(times), "peak_gib": peak, "loss": first}


def _attention_backend(cfg: StepConfig) -> str:
    """The block ops' backend for this model's packed causal call, with the FlashAttention torch
    runs where that is torch's."""
    import torch

    from mmbalance.pyops.attention_backends import AttentionInputs, select_attention_backend, torch_flash_impl

    hidden, _, heads, kv, _, _, dtype = CONFIGS[cfg.config]
    d = hidden // heads
    inputs = AttentionInputs(q_shape=(cfg.tokens, heads, d), k_shape=(cfg.tokens, kv, d), dtype=getattr(torch, dtype),
                             device=torch.device(cfg.device), causal=True)  # fmt: skip
    try:
        name = select_attention_backend("auto", inputs)
    except ValueError as exc:
        return f"none ({exc})"
    return f"torch_flash ({torch_flash_impl()})" if name == "torch_flash" else name


def bench(cfg: StepConfig) -> list[Row]:
    import torch

    from mmbalance.integrations.hf import register_attention

    register_attention()
    model = _model(cfg)
    state = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}  # not on the GPU
    packed, padded, lengths = _batches(cfg, CONFIGS[cfg.config][5])
    tokens, padded_tokens = sum(lengths), len(lengths) * max(lengths)
    results: dict[str, dict] = {}
    skipped: dict[str, str] = {}
    for provider in PROVIDERS:
        why = _available(provider, cfg.device)
        if why:
            skipped[provider] = why
            continue
        batch = padded if provider == "sdpa" else packed
        try:
            results[provider] = run_provider(model, state, provider, batch, cfg)
        except torch.cuda.OutOfMemoryError:
            skipped[provider] = f"out of memory at {batch['input_ids'].numel()} tokens a step"
            model.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()
    dtype = CONFIGS[cfg.config][6]
    shape = f"{cfg.config}/T{tokens}/S{len(lengths)}"
    dev = device_name(cfg.device)
    rows = []
    for provider, res in results.items():
        metrics = {
            "tokens": tokens,
            "padded_tokens": padded_tokens if provider == "sdpa" else tokens,
            "tokens_per_s": tokens / (res["step_ms"] / 1e3),
            "peak_gib": res["peak_gib"],
            "loss": res["loss"],
            "steps": cfg.steps,
            "parameters_b": sum(p.numel() for p in model.parameters()) / 1e9,
        }
        if provider == "mmbalance_varlen":
            metrics["attention_backend"] = _attention_backend(cfg)
            if "sdpa" in results:
                metrics["vs_sdpa"] = results["sdpa"]["step_ms"] / res["step_ms"]
                metrics["loss_vs_sdpa"] = abs(res["loss"] - results["sdpa"]["loss"])
        rows.append(Row("hf_train_step", provider, shape, dtype, dev, res["step_ms"], metrics))
    for provider, why in skipped.items():
        rows.append(Row("hf_train_step", provider, shape, dtype, dev, float("nan"), {"skipped": why}))
    del model
    if cfg.device.startswith("cuda"):
        torch.cuda.empty_cache()
    return rows
