"""Launch configurations and feature switches of the attention kernels (``attention.py``,
``attention_bwd.py``): tile sizes per architecture, the padded head dimension, the product
precision, and the runtime arguments and constexprs of the optional features.
"""

from __future__ import annotations

from typing import Any

import torch
import triton

from ._launch import INTERPRET

LOG2E = 1.4426950408889634


def block_d(head_dim: int) -> int:
    """The padded head dimension the kernels work on (a power of two, at least 16)."""
    return max(16, triton.next_power_of_2(head_dim))


def dot_precision(dtype: torch.dtype) -> str:
    """IEEE products for float32 inputs (reference quality); 16-bit inputs ignore the setting."""
    return "ieee" if dtype == torch.float32 else "tf32"


def device_capability(device: torch.device) -> int:
    """``major * 10 + minor`` of a CUDA device (90 for sm_90); 0 for anything else."""
    if device.type != "cuda":
        return 0
    major, minor = torch.cuda.get_device_capability(device)
    return major * 10 + minor


def fwd_config(
    head_dim: int,
    device: torch.device,
    dtype: torch.dtype = torch.bfloat16,
    *,
    capability: int | None = None,
    window: bool = False,
    softcap: bool = False,
) -> dict:
    """Tile sizes and warps of the forward kernel, chosen per architecture for zero spills.

    ``capability`` is ``major * 10 + minor`` (default: the device's); the kernel audit calls this
    with 80 and 90 and holds every variant it launches to zero spills. ``window``: a sliding-window
    variant (a third key loop, more live registers); ``softcap``: the tanh-logit variant. The
    ``overflow`` entry is the configuration of the tail launch that runs only when a host
    ``max_seqlen_q`` understated a sequence (same ``BLOCK_M``, so it starts where the main grid
    ends): one pipeline stage and narrow key tiles, so its extra loop never spills.
    float32 uses IEEE products (FMA, not tensor cores) on 4-byte tiles: small tiles, one stage.
    """
    if INTERPRET or (device.type != "cuda" and capability is None):
        return dict(BLOCK_M=16, BLOCK_N=16, num_warps=4, num_stages=1)
    if capability is None:
        capability = device_capability(device)
    if dtype == torch.float32:
        # the FMA products of a window or softcap variant need narrower key tiles on both archs
        return dict(BLOCK_M=32, BLOCK_N=16 if window or softcap else 32, num_warps=8, num_stages=1)
    if block_d(head_dim) > 128:
        return dict(BLOCK_M=64, BLOCK_N=32, num_warps=8, num_stages=2)
    cfg: dict[str, Any] = dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3)
    if window:
        # sm_90: one stage fewer; sm_80 (no wgmma, fragments held in registers): narrower key tiles
        if capability >= 90:
            cfg["num_stages"] = 2
        else:
            cfg["BLOCK_N"] = 32
    cfg["overflow"] = dict(BLOCK_N=32, num_warps=8, num_stages=1)
    return cfg


def bwd_config(
    head_dim: int,
    device: torch.device,
    dtype: torch.dtype = torch.bfloat16,
    *,
    capability: int | None = None,
    window: bool = False,
    softcap: bool = False,
) -> dict:
    """Tiles of the dq kernel (``dq_*``) and the dk/dv kernel (``kv_*``), zero spills on sm_80/sm_90.

    ``capability`` is ``major * 10 + minor`` (default: the device's); the kernel audit calls this
    with 80 and 90 and holds every variant it lists to zero spills with it. 16-bit inputs: one
    table serves both architectures and every variant. float32 with a window or softcap (IEEE FMA
    products, whose register allocation is fragile) takes narrower tiles, per architecture. ``overflow`` overrides entries for the tail launches that run only when a host
    ``max_seqlen`` understated a sequence: the dq tail keeps ``dq_BLOCK_M`` (it starts where the
    main grid ends) but takes narrower key tiles, so its extra loop never spills. float32 uses
    IEEE products (FMA, not tensor cores) on 4-byte tiles: small tiles, one stage.
    """
    names = ("dq_BLOCK_M", "dq_BLOCK_N", "dq_warps", "kv_BLOCK_M", "kv_BLOCK_N", "kv_warps", "stages")
    if INTERPRET or (device.type != "cuda" and capability is None):
        return dict(zip(names, (16, 16, 4, 16, 16, 4, 1)))
    if capability is None:
        capability = device_capability(device)
    if dtype == torch.float32 and (window or softcap):
        tiles = (16, 16, 8, 32, 16, 8, 1) if capability >= 90 else (16, 16, 8, 16, 32, 8, 1)
    elif dtype == torch.float32:
        tiles = (16, 32, 8, 16, 32, 8, 1)
    elif block_d(head_dim) <= 64:
        tiles = (128, 32, 8, 32, 64, 4, 2)
    elif block_d(head_dim) <= 128:
        tiles = (64, 64, 8, 32, 64, 8, 2)
    else:
        tiles = (32, 32, 8, 16, 32, 8, 1)
    cfg: dict[str, Any] = dict(zip(names, tiles))
    if cfg["dq_BLOCK_N"] > 32:
        cfg["overflow"] = dict(dq_BLOCK_N=32)
    elif dtype == torch.float32 and cfg["dq_BLOCK_N"] == 32 and capability >= 90:
        cfg["overflow"] = dict(dq_BLOCK_N=16)  # the float32 dq tail spills 64 bytes at 32 on sm_90
    elif dtype == torch.float32 and softcap and not window and capability < 90:
        cfg["overflow"] = dict(dq_BLOCK_N=32)  # and the float32 softcap dq tail 8 bytes at 16 on sm_80
    return cfg


# Window sizes are clamped to this, so ``position +- window`` stays inside int32 for positions
# within +-2**30 (a window that wide is unbounded for any sequence the kernels can hold).
_WINDOW_MAX = 2**30


def _features(
    causal: bool, window_left: int, window_right: int, softcap: float, softmax_scale: float
) -> dict:
    """Runtime arguments and constexpr switches of the optional features, shared by both passes.

    A right window adds nothing to a causal mask (``window_right >= 0`` admits a superset of the
    causal keys), so it is dropped there and the causal variant runs unchanged. With ``softcap``
    the kernels compute ``tanh(qk * qk_scale) * softcap_log2e``, so ``qk_scale`` becomes
    ``scale / softcap`` instead of ``scale * log2(e)``.
    """
    win_left = int(window_left) >= 0
    win_right = int(window_right) >= 0 and not causal
    use_softcap = float(softcap) > 0.0
    return dict(
        WIN_LEFT=win_left,
        WIN_RIGHT=win_right,
        SOFTCAP=use_softcap,
        window_left=min(int(window_left), _WINDOW_MAX) if win_left else 0,
        window_right=min(int(window_right), _WINDOW_MAX) if win_right else 0,
        qk_scale=softmax_scale / softcap if use_softcap else softmax_scale * LOG2E,
        softcap_log2e=float(softcap) * LOG2E if use_softcap else 0.0,
    )
