"""Every kernel variant that ``python -m mmbalance.bench.kernel_audit`` compiles, each with the
launch configuration its launcher picks on the audited architecture.

``variants(capability)`` lists them all; an entry is a dict in the audit's format (its module
docstring): ``name``, ``kernel``, ``signature``, ``constexprs`` and optionally
``divisible_by_16``, ``num_warps``, ``num_stages`` and ``expect``. Adding a kernel to ``kernels/``
is adding its variants here (``tests/kernels/test_kernel_audit.py`` fails for a kernel that has
none).

- Varlen copies (``kernels/varlen.py``): rows of 1-8 K elements as in LLM/encoder hidden states,
  tiles as the launchers pick them, 16-byte-divisible pointers, row lengths and strides as Triton
  specialises them at a real launch; bandwidth kernels, so 128-bit global loads/stores and no
  spills.
- The LSE merge (``kernels/merge.py``): 128-bit accesses, no spills.
- The gated delta rule's chunk state (``kernels/delta_rule.py``): Qwen3.5's and Qwen3-Next's head
  dims (keys and values of 128), float32 and bfloat16 inputs; a latency-bound walk over the
  chunk's tokens with a ``K x BLOCK_C`` float32 block in registers: no spills.
- Attention forward and backward (``kernels/attention_fwd.py``, ``attention_bwd.py``,
  ``attention_bwd_dkdv.py``): bfloat16 at head dims 64 and 128 and float32 at 128, causal with
  two-run positions; at head dim 128 (the tightest register budget) every feature variant (windows,
  softcap, sinks) and the overflow tail of each, in bfloat16 and in float32. Tensor cores for
  bfloat16 (float32 runs IEEE FMA products by design), no spills.

Importing this module imports the kernels, so ``kernel_audit`` imports it only after it has cleared
``TRITON_INTERPRET`` (interpreted kernels cannot be compiled).
"""

from __future__ import annotations

import torch

from mmbalance.kernels import attention_bwd, attention_bwd_dkdv, attention_fwd, delta_rule, merge, varlen
from mmbalance.kernels.attention_common import block_d, bwd_config, dot_precision, fwd_config

__all__ = [
    "FWD_FEATURES",
    "fwd_entry",
    "bwd_entry",
    "BWD_FEATURES",
    "variants",
    "varlen_variants",
    "merge_variants",
    "delta_rule_variants",
    "attention_fwd_variants",
    "attention_bwd_variants",
]


def _signature(kernel, ptr_dtype: str, overrides: dict[str, str]) -> dict[str, str]:
    """Argument types for an ahead-of-time compile: ``overrides`` by name, other pointers of
    ``ptr_dtype``, other scalars int32; constexprs (UPPER_SNAKE) are left to the entry."""
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


# ------------------------------------------------------------------------------------------ varlen
_ELEMENT_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2, "i8": 1, "i64": 8}


def _varlen_entry(kernel, payload: str, row_elems: int, index: str = "i32") -> dict:
    block_t, block_r = varlen.tile_shape(1 << 20, row_elems, _ELEMENT_BYTES[payload])
    index_types = {name: f"*{index}" for name in ("cu_ptr", "src_cu_ptr", "dst_cu_ptr")}
    return {
        "name": f"{kernel.__name__}[{payload},row={row_elems}]",
        "kernel": kernel,
        "signature": _signature(kernel, payload, {**index_types, "order_ptr": "*i64"}),
        "constexprs": {"BLOCK_T": block_t, "BLOCK_R": block_r},
        "divisible_by_16": [
            a for a in kernel.arg_names if a.endswith("_ptr") or a.startswith("stride") or a == "row_elems"
        ],
        "num_warps": varlen.NUM_WARPS,
        "expect": {"load_bits": 128, "store_bits": 128, "spill_bytes": 0},
    }


def varlen_variants() -> list[dict]:
    """Pack, unpack and segment gather in bfloat16, float16 and float32 rows, and an int8 gather
    with int64 offsets."""
    kernels = (varlen.pack_fwd_kernel, varlen.unpack_fwd_kernel, varlen.segment_gather_fwd_kernel)
    entries = [
        _varlen_entry(kernel, payload, row_elems)
        for kernel in kernels
        for payload, row_elems in (("bf16", 1024), ("fp16", 4096), ("fp32", 8192))
    ]
    entries.append(_varlen_entry(varlen.segment_gather_fwd_kernel, "i8", 4096, index="i64"))
    return entries


# ------------------------------------------------------------------------------------------- merge
def merge_variants() -> list[dict]:
    """The merge of a float32 running result with a bfloat16 or float32 block, head dims 64 and 128."""
    kernel = merge.merge_attn_fwd_kernel
    return [
        dict(
            name=f"merge_attn_fwd_{dtype_b}_d{head_dim}",
            kernel=kernel,
            signature=_signature(kernel, "fp32", {"out_b_ptr": f"*{dtype_b}"}),
            constexprs=dict(HEAD_DIM=head_dim, BLOCK_D=head_dim, BLOCK_T=4096 // head_dim),
            num_warps=4,
            expect={"spill_bytes": 0, "load_bits": 128, "store_bits": 128},
        )
        for dtype_b in ("bf16", "fp32")
        for head_dim in (64, 128)
    ]


# -------------------------------------------------------------------------------------- delta rule
def delta_rule_variants() -> list[dict]:
    """The chunk state and its backward at key and value dims 128 (Qwen3.5, Qwen3-Next) and 64,
    float32 and bfloat16."""
    kernel = delta_rule.delta_rule_chunk_state_kernel
    entries = []
    for dtype in ("fp32", "bf16"):
        for key_dim, value_dim in ((128, 128), (64, 64)):
            cfg = delta_rule.chunk_state_config(key_dim, value_dim)
            entries.append(
                dict(
                    name=f"delta_rule_chunk_state_{dtype}_k{key_dim}_v{value_dim}",
                    kernel=kernel,
                    signature=_signature(
                        kernel, dtype, {"cu_ptr": "*i32", "m_ptr": "*fp32", "u_ptr": "*fp32"}
                    ),
                    constexprs=dict(
                        KEY_DIM=key_dim, VALUE_DIM=value_dim, BLOCK_K=cfg["BLOCK_K"], BLOCK_C=cfg["BLOCK_C"]
                    ),  # fmt: skip
                    num_warps=cfg["num_warps"],
                    expect={"spill_bytes": 0},
                )
            )
            bwd = delta_rule.delta_rule_chunk_state_bwd_kernel
            cfg = delta_rule.backward_config(key_dim, value_dim)
            fp32 = {
                n: "*fp32"
                for n in (
                    "dm_ptr",
                    "du_ptr",
                    "dk_ptr",
                    "dv_ptr",
                    "dg_ptr",
                    "db_ptr",
                    "ckpt_ptr",
                    "scratch_ptr",
                )
            }
            entries.append(
                dict(
                    name=f"delta_rule_chunk_state_bwd_{dtype}_k{key_dim}_v{value_dim}",
                    kernel=bwd,
                    signature=_signature(bwd, dtype, {"cu_ptr": "*i32", **fp32}),
                    constexprs=dict(
                        KEY_DIM=key_dim, VALUE_DIM=value_dim, BLOCK_K=cfg["BLOCK_K"], BLOCK_C=cfg["BLOCK_C"]
                    ),  # fmt: skip
                    num_warps=cfg["num_warps"],
                    expect={"spill_bytes": 0},
                )
            )
    return entries


# ------------------------------------------------------------------------------- attention forward
# Feature switches of the audited variants: the plain causal kernel, full attention, then each feature alone and
# all of them together (the overflow tail of each is audited too; it compiles separately).
FWD_FEATURES: dict[str, dict] = {
    "": dict(CAUSAL=True),
    "_full": dict(CAUSAL=False),
    "_window": dict(CAUSAL=True, WIN_LEFT=True),
    "_window2": dict(CAUSAL=False, WIN_LEFT=True, WIN_RIGHT=True),
    "_softcap": dict(CAUSAL=True, SOFTCAP=True),
    "_sinks": dict(CAUSAL=True, SINKS=True),
    "_window_softcap_sinks": dict(CAUSAL=True, WIN_LEFT=True, SOFTCAP=True, SINKS=True),
}

# Feature switches of the audited backward variants (sinks need nothing in the backward).
BWD_FEATURES: dict[str, dict] = {
    "": dict(CAUSAL=True),
    "_full": dict(CAUSAL=False),
    "_window": dict(CAUSAL=True, WIN_LEFT=True),
    "_window2": dict(CAUSAL=False, WIN_LEFT=True, WIN_RIGHT=True),
    "_softcap": dict(CAUSAL=True, SOFTCAP=True),
    "_window_softcap": dict(CAUSAL=True, WIN_LEFT=True, SOFTCAP=True),
}


def _mask_constexprs(features: dict) -> dict:
    return {n: bool(features.get(n, False)) for n in ("CAUSAL", "WIN_LEFT", "WIN_RIGHT", "SOFTCAP")}


def _config(pick, features: dict, dtype: torch.dtype, head_dim: int, capability: int, overflow: bool) -> dict:
    """The launch configuration ``pick`` (``fwd_config``/``bwd_config``) gives this variant on
    ``sm_<capability>``; for an overflow tail, the tail launch's own."""
    window = bool(features.get("WIN_LEFT") or features.get("WIN_RIGHT"))
    cfg = pick(head_dim, torch.device("cuda"), dtype, capability=capability, window=window,
               softcap=features.get("SOFTCAP", False), causal=bool(features.get("CAUSAL", False)))  # fmt: skip
    return dict(cfg, **cfg.get("overflow", {})) if overflow else cfg


def _mask_name(suffix: str) -> str:
    """The mask and features in an entry's name: ``causal``, ``full``, ``causal_window``..."""
    if suffix == "_full":
        return "full"
    features = FWD_FEATURES.get(suffix) or BWD_FEATURES[suffix]
    return ("causal" if features["CAUSAL"] else "full") + suffix


def _short(dtype: torch.dtype) -> str:
    return "bf16" if dtype == torch.bfloat16 else "fp32"


def fwd_entry(
    name: str,
    dtype: torch.dtype,
    head_dim: int,
    features: dict,
    cfg: dict,
    *,
    group: int = 1,
    has_runs: bool = True,
    overflow: bool = False,
) -> dict:
    """The audit entry of one forward kernel: ``features`` its switches (``CAUSAL``, ``WIN_LEFT``,
    ``WIN_RIGHT``, ``SOFTCAP``, ``SINKS``), ``cfg`` the launch (``BLOCK_M``, ``BLOCK_N``,
    ``num_warps``, ``num_stages``); tensor cores expected for 16-bit inputs, no spills."""
    kernel = attention_fwd.attn_fwd_kernel
    types = {n: "*i32" for n in ("cu_q_ptr", "cu_k_ptr", "q_runs_ptr", "k_runs_ptr")}
    types.update(lse_ptr="*fp32", sinks_ptr="*fp32", qk_scale="fp32", softcap_log2e="fp32")
    return dict(
        name=name,
        kernel=kernel,
        signature=_signature(kernel, _short(dtype), types),
        constexprs=dict(
            GROUP=group,
            HEAD_DIM=head_dim,
            BLOCK_D=block_d(head_dim),
            BLOCK_M=cfg["BLOCK_M"],
            BLOCK_N=cfg["BLOCK_N"],
            HAS_RUNS=has_runs,
            DOT_PRECISION=dot_precision(dtype),
            OVERFLOW=overflow,
            SINKS=bool(features.get("SINKS", False)),
            **_mask_constexprs(features),
        ),
        # float32 runs IEEE FMA products by design: no tensor cores expected there
        expect={"spill_bytes": 0, "mma": dtype != torch.float32},
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )


def _fwd_entry(dtype: torch.dtype, head_dim: int, capability: int, suffix: str, overflow: bool) -> dict:
    features = FWD_FEATURES[suffix]
    cfg = _config(fwd_config, features, dtype, head_dim, capability, overflow)
    name = f"attn_fwd_{_short(dtype)}_d{head_dim}_{_mask_name(suffix)}_runs" + (
        "_overflow" if overflow else ""
    )
    return fwd_entry(name, dtype, head_dim, features, cfg, overflow=overflow)


def attention_fwd_variants(capability: int) -> list[dict]:
    """The forward variants for ``sm_<capability>``, each with the configuration ``fwd_config``
    picks there: bfloat16 at head dims 64 and 128 and float32 at 128 with the plain causal mask,
    and at 128 every feature variant and the overflow tail of each, in bfloat16 and float32."""
    entries = [
        _fwd_entry(dtype, head_dim, capability, "", False)
        for dtype, head_dim in ((torch.bfloat16, 64), (torch.bfloat16, 128), (torch.float32, 128))
    ]
    entries.append(_fwd_entry(torch.bfloat16, 128, capability, "", True))
    entries.append(_fwd_entry(torch.float32, 128, capability, "", True))
    # float32 runs IEEE FMA products, whose register allocation differs: each feature in both
    for dtype in (torch.bfloat16, torch.float32):
        for suffix in FWD_FEATURES:
            if suffix:
                entries += [_fwd_entry(dtype, 128, capability, suffix, o) for o in (False, True)]
    return entries


# ------------------------------------------------------------------------------ attention backward
_BWD_TYPES = {name: "*fp32" for name in ("lse_ptr", "delta_ptr", "dlse_ptr", "dq_ptr", "dk_ptr", "dv_ptr")}
_BWD_TYPES.update({name: "*i32" for name in ("cu_q_ptr", "cu_k_ptr", "q_runs_ptr", "k_runs_ptr")})
_BWD_TYPES.update(qk_scale="fp32", sm_scale="fp32", softcap_log2e="fp32")


def bwd_entry(
    name: str,
    prefix: str,
    dtype: torch.dtype,
    head_dim: int,
    features: dict,
    cfg: dict,
    *,
    group: int = 2,
    has_runs: bool = True,
    overflow: bool = False,
) -> dict:
    """The audit entry of one backward pass, ``prefix`` ``"dq"`` or ``"kv"`` (dk/dv), launched with
    ``cfg``'s ``<prefix>_BLOCK_M``, ``_BLOCK_N``, ``_warps`` and ``_stages``; ``features`` as in
    :func:`fwd_entry` (sinks need nothing in the backward)."""
    kernel = attention_bwd.attn_bwd_dq_kernel if prefix == "dq" else attention_bwd_dkdv.attn_bwd_dkdv_kernel
    return dict(
        name=name,
        kernel=kernel,
        signature=_signature(kernel, _short(dtype), _BWD_TYPES),
        constexprs=dict(
            GROUP=group,
            HEAD_DIM=head_dim,
            BLOCK_D=block_d(head_dim),
            HAS_RUNS=has_runs,
            DOT_PRECISION=dot_precision(dtype),
            OVERFLOW=overflow,
            **_mask_constexprs(features),
            BLOCK_M=cfg[f"{prefix}_BLOCK_M"],
            BLOCK_N=cfg[f"{prefix}_BLOCK_N"],
        ),  # fmt: skip
        num_warps=cfg[f"{prefix}_warps"],
        num_stages=cfg[f"{prefix}_stages"],
        # float32 runs IEEE FMA products by design: no tensor cores expected there
        expect={"spill_bytes": 0, "mma": dtype != torch.float32},
    )


def _bwd_entries(
    dtype: torch.dtype, head_dim: int, capability: int, suffix: str, overflow: bool
) -> list[dict]:
    """The dq and dk/dv entries of one variant, with the configuration ``bwd_config`` picks."""
    features = BWD_FEATURES[suffix]
    cfg = _config(bwd_config, features, dtype, head_dim, capability, overflow)
    tail = "_overflow" if overflow else ""
    return [
        bwd_entry(
            f"attn_bwd_{prefix}_{_short(dtype)}_d{head_dim}_{_mask_name(suffix)}_runs_gqa{tail}",
            prefix,
            dtype,
            head_dim,
            features,
            cfg,
            overflow=overflow,
        )  # fmt: skip
        for prefix in ("dq", "kv")
    ]


def attention_bwd_variants(capability: int) -> list[dict]:
    """The backward variants for ``sm_<capability>``, each with the configuration ``bwd_config``
    picks there: bfloat16 at head dims 64 and 128 and float32 at 128 (causal, two-run positions,
    GQA), the preprocess kernel, and at head dim 128 every feature variant with its overflow tail,
    in bfloat16 and in float32."""
    preprocess = attention_bwd.attn_bwd_preprocess_kernel
    entries = []
    for dtype, head_dim in ((torch.bfloat16, 64), (torch.bfloat16, 128), (torch.float32, 128)):
        entries += _bwd_entries(dtype, head_dim, capability, "", False)
        if dtype == torch.float32:
            continue
        entries.append(
            dict(
                name=f"attn_bwd_preprocess_bf16_d{head_dim}",
                kernel=preprocess,
                signature=_signature(preprocess, "bf16", _BWD_TYPES),
                constexprs=dict(HEAD_DIM=head_dim, BLOCK_D=block_d(head_dim), BLOCK_T=64, HAS_DLSE=False),
                num_warps=4,
                expect={"spill_bytes": 0},
            )
        )
    # float32 (IEEE FMA products: a register allocation of its own) as well as bfloat16
    for dtype in (torch.bfloat16, torch.float32):
        entries += _bwd_entries(dtype, 128, capability, "", True)
        for suffix in BWD_FEATURES:
            if suffix:
                for overflow in (False, True):
                    entries += _bwd_entries(dtype, 128, capability, suffix, overflow)
    return entries


def variants(capability: int) -> list[dict]:
    """Every entry the audit compiles for ``sm_<capability>`` (90 for sm_90)."""
    return (
        attention_fwd_variants(capability)
        + attention_bwd_variants(capability)
        + merge_variants()
        + varlen_variants()
        + delta_rule_variants()
    )
