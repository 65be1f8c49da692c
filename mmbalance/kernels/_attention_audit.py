"""What the kernel audit (``bench/kernel_audit.py``) compiles of the attention kernels: every
forward and backward variant, each with the launch configuration its architecture gets.

``attention.audit_configs`` and ``attention_bwd.audit_configs`` hand these lists to the audit;
the kernels are imported when a list is built, so this module imports none of them at load.
"""

from __future__ import annotations

import torch

from ._attention_launch import block_d, bwd_config, dot_precision, fwd_config


def _audit_signature(kernel, ptr_dtype: str, overrides: dict[str, str]) -> dict[str, str]:
    """Argument types for an ahead-of-time compile: pointers of ``ptr_dtype``, int32 scalars."""
    sig = {}
    for name in kernel.arg_names:
        if name in overrides:
            sig[name] = overrides[name]
        elif name.endswith("_ptr"):
            sig[name] = f"*{ptr_dtype}"
        elif name.isupper():
            continue
        else:
            sig[name] = "i32"
    return sig


# Feature switches of the audited variants: the plain causal kernel, then each new feature alone
# and all of them together (the overflow tail of each is audited too; it compiles separately).
FWD_FEATURES: dict[str, dict] = {
    "": dict(CAUSAL=True),
    "_window": dict(CAUSAL=True, WIN_LEFT=True),
    "_window2": dict(CAUSAL=False, WIN_LEFT=True, WIN_RIGHT=True),
    "_softcap": dict(CAUSAL=True, SOFTCAP=True),
    "_sinks": dict(CAUSAL=True, SINKS=True),
    "_window_softcap_sinks": dict(CAUSAL=True, WIN_LEFT=True, SOFTCAP=True, SINKS=True),
}


def _feature_constexprs(features: dict) -> dict:
    names = ("CAUSAL", "WIN_LEFT", "WIN_RIGHT", "SOFTCAP")
    return {n: bool(features.get(n, False)) for n in names}


def _fwd_audit_entry(dtype: torch.dtype, head_dim: int, capability: int, suffix: str, overflow: bool) -> dict:
    from .attention import _attn_fwd_kernel

    features = FWD_FEATURES[suffix]
    window = bool(features.get("WIN_LEFT") or features.get("WIN_RIGHT"))
    cfg = fwd_config(head_dim, torch.device("cuda"), dtype, capability=capability, window=window,
                     softcap=features.get("SOFTCAP", False))  # fmt: skip
    if overflow:
        cfg = dict(cfg, **cfg.get("overflow", {}))  # the tail launch's own configuration
    short = "bf16" if dtype == torch.bfloat16 else "fp32"
    mask = "causal" if features["CAUSAL"] else "full"
    return dict(
        name=f"attn_fwd_{short}_d{head_dim}_{mask}{suffix}_runs" + ("_overflow" if overflow else ""),
        kernel=_attn_fwd_kernel,
        signature=_audit_signature(
            _attn_fwd_kernel,
            short,
            {
                "lse_ptr": "*fp32",
                "cu_q_ptr": "*i32",
                "cu_k_ptr": "*i32",
                "q_runs_ptr": "*i32",
                "k_runs_ptr": "*i32",
                "sinks_ptr": "*fp32",
                "qk_scale": "fp32",
                "softcap_log2e": "fp32",
            },
        ),
        constexprs=dict(
            GROUP=1,
            HEAD_DIM=head_dim,
            BLOCK_D=block_d(head_dim),
            BLOCK_M=cfg["BLOCK_M"],
            BLOCK_N=cfg["BLOCK_N"],
            HAS_RUNS=True,
            DOT_PRECISION=dot_precision(dtype),
            OVERFLOW=overflow,
            SINKS=bool(features.get("SINKS", False)),
            **_feature_constexprs(features),
        ),
        # float32 runs IEEE FMA products by design: no tensor cores expected there
        expect={"spill_bytes": 0, "mma": dtype != torch.float32},
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )


def fwd_audit_configs(capability: int) -> list[dict]:
    """The forward variants the kernel audit compiles for ``sm_<capability>``, each with the
    launch configuration ``fwd_config`` picks on that architecture.

    bfloat16 at head dims 64 and 128 and float32 at 128, causal with two-run positions; at head
    dim 128 (the tightest register budget) every feature variant and its overflow tail, in bfloat16
    and in float32.
    """
    configs = [
        _fwd_audit_entry(dtype, head_dim, capability, "", False)
        for dtype, head_dim in ((torch.bfloat16, 64), (torch.bfloat16, 128), (torch.float32, 128))
    ]
    configs.append(_fwd_audit_entry(torch.bfloat16, 128, capability, "", True))
    configs.append(_fwd_audit_entry(torch.float32, 128, capability, "", True))
    # float32 runs IEEE FMA products, whose register allocation differs: each feature in both
    for dtype in (torch.bfloat16, torch.float32):
        for suffix in FWD_FEATURES:
            if suffix:
                configs += [_fwd_audit_entry(dtype, 128, capability, suffix, o) for o in (False, True)]
    return configs


# Feature switches of the audited backward variants (sinks need nothing in the backward).
BWD_FEATURES: dict[str, dict] = {
    "": dict(CAUSAL=True),
    "_window": dict(CAUSAL=True, WIN_LEFT=True),
    "_window2": dict(CAUSAL=False, WIN_LEFT=True, WIN_RIGHT=True),
    "_softcap": dict(CAUSAL=True, SOFTCAP=True),
    "_window_softcap": dict(CAUSAL=True, WIN_LEFT=True, SOFTCAP=True),
}

_AUDIT_TYPES = {name: "*fp32" for name in ("lse_ptr", "delta_ptr", "dlse_ptr", "dq_ptr", "dk_ptr", "dv_ptr")}
_AUDIT_TYPES.update({name: "*i32" for name in ("cu_q_ptr", "cu_k_ptr", "q_runs_ptr", "k_runs_ptr")})
_AUDIT_TYPES.update(qk_scale="fp32", sm_scale="fp32", softcap_log2e="fp32")


def _bwd_audit_entries(
    dtype: torch.dtype, head_dim: int, capability: int, suffix: str, overflow: bool
) -> list[dict]:
    """The dq and dk/dv entries of one variant, with the configuration ``bwd_config`` picks."""
    from ._attention_bwd_dkdv import _attn_bwd_dkdv_kernel
    from .attention_bwd import _attn_bwd_dq_kernel

    features = BWD_FEATURES[suffix]
    window = bool(features.get("WIN_LEFT") or features.get("WIN_RIGHT"))
    cfg = bwd_config(head_dim, torch.device("cuda"), dtype, capability=capability, window=window,
                     softcap=features.get("SOFTCAP", False))  # fmt: skip
    if overflow:
        cfg = dict(cfg, **cfg.get("overflow", {}))  # the tail launches' own configuration
    short = "bf16" if dtype == torch.bfloat16 else "fp32"
    mask = "causal" if features["CAUSAL"] else "full"
    common = dict(
        GROUP=2, HEAD_DIM=head_dim, BLOCK_D=block_d(head_dim), HAS_RUNS=True,
        DOT_PRECISION=dot_precision(dtype), OVERFLOW=overflow,
        **{n: bool(features.get(n, False)) for n in ("CAUSAL", "WIN_LEFT", "WIN_RIGHT", "SOFTCAP")},
    )  # fmt: skip
    entries = []
    for kernel, prefix in ((_attn_bwd_dq_kernel, "dq"), (_attn_bwd_dkdv_kernel, "kv")):
        entries.append(
            dict(
                name=f"attn_bwd_{prefix}_{short}_d{head_dim}_{mask}{suffix}_runs_gqa"
                + ("_overflow" if overflow else ""),
                kernel=kernel,
                signature=_audit_signature(kernel, short, _AUDIT_TYPES),
                constexprs=dict(common, BLOCK_M=cfg[f"{prefix}_BLOCK_M"], BLOCK_N=cfg[f"{prefix}_BLOCK_N"]),
                num_warps=cfg[f"{prefix}_warps"],
                num_stages=cfg["stages"],
                # float32 runs IEEE FMA products by design: no tensor cores expected there
                expect={"spill_bytes": 0, "mma": dtype != torch.float32},
            )
        )
    return entries


def bwd_audit_configs(capability: int) -> list[dict]:
    """The backward variants the kernel audit compiles for ``sm_<capability>``, each with the
    launch configuration ``bwd_config`` picks on that architecture: bfloat16 at head dims 64 and
    128 and float32 at 128 (causal, two-run positions, GQA), the preprocess kernel, and at head
    dim 128 every feature variant with its overflow tail, in bfloat16 and in float32."""
    from .attention_bwd import _attn_bwd_preprocess_kernel

    configs = []
    for dtype, head_dim in ((torch.bfloat16, 64), (torch.bfloat16, 128), (torch.float32, 128)):
        configs += _bwd_audit_entries(dtype, head_dim, capability, "", False)
        if dtype == torch.float32:
            continue
        configs.append(
            dict(
                name=f"attn_bwd_preprocess_bf16_d{head_dim}",
                kernel=_attn_bwd_preprocess_kernel,
                signature=_audit_signature(_attn_bwd_preprocess_kernel, "bf16", _AUDIT_TYPES),
                constexprs=dict(HEAD_DIM=head_dim, BLOCK_D=block_d(head_dim), BLOCK_T=64, HAS_DLSE=False),
                num_warps=4,
                expect={"spill_bytes": 0},
            )
        )
    configs += _bwd_audit_entries(torch.bfloat16, 128, capability, "", True)
    for suffix in BWD_FEATURES:
        if suffix:
            for overflow in (False, True):
                configs += _bwd_audit_entries(torch.bfloat16, 128, capability, suffix, overflow)
    # float32 (IEEE FMA products: a register allocation of its own) with each feature
    configs += _bwd_audit_entries(torch.float32, 128, capability, "", True)
    for suffix in BWD_FEATURES:
        if suffix:
            for overflow in (False, True):
                configs += _bwd_audit_entries(torch.float32, 128, capability, suffix, overflow)
    return configs
