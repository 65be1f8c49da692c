"""Which implementation runs an attention op call, and the flash-attn path.

A call is described by one frozen dataclass, ``AttentionInputs`` for the block ops (shapes, dtype,
device and the features the call uses) and ``MergeInputs`` for the merge, and every backend's
``not_supported_reasons`` reads it (xformers' ``Inputs``). Four backends run the block ops, in
``"auto"``'s order of preference: flash-attn (CUDA, when installed and the call is one it supports:
``flash_attn_unsupported_reasons`` says why not), ``torch_flash`` (torch's own FlashAttention
varlen kernels, which every CUDA wheel of torch ships: ``aten::_flash_attention_forward`` and
``_backward``, FlashAttention-2 on sm_80 and newer, or FlashAttention-3/4 where torch has activated
one: :func:`torch_flash_impl`), the Triton kernels (CUDA, or CPU tensors under
``TRITON_INTERPRET=1``; not float64; they run what no FlashAttention can: softcap, sinks, LSE
gradients, float32, position runs) and the torch reference, which runs everything; the merge has
the last two. The choice goes through :func:`mmbalance.kernels.dispatch.select_backend`, so a forced
backend that cannot run a call raises with the call and the reasons, a call no backend can run
raises with every backend and its reasons, and ``MMBALANCE_ATTN_BACKEND`` forces one for a whole
run of the block ops.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math

import torch
from torch import Tensor

from mmbalance.kernels.dispatch import Backend, select_backend, triton_unsupported_reasons

__all__ = [
    "AttentionInputs",
    "MergeInputs",
    "flash_attn_unsupported_reasons",
    "torch_flash_unsupported_reasons",
    "torch_flash_impl",
    "torch_flash_fwd",
    "torch_flash_bwd",
    "triton_attention_reasons",
    "ATTENTION_BACKENDS",
    "MERGE_BACKENDS",
    "BACKENDS",
    "select_attention_backend",
    "select_merge_backend",
    "auto_order",
    "flash_fwd",
    "flash_bwd",
]


# ------------------------------------------------------------------------------- what a call is
@dataclasses.dataclass(frozen=True)
class AttentionInputs:
    """One call of ``attention_block_fwd`` or ``attention_block_bwd`` as the backends judge it.

    ``q_shape`` is ``(Tq, H, D)`` and ``k_shape`` ``(Tk, Hkv, D)``; q, k and v share ``dtype`` and
    ``device``. The features: ``causal`` with ``causal_offset``, position runs (``has_runs``),
    whether queries and keys share one ``cu_seqlens`` tensor (``same_cu_seqlens``), the sliding
    window (``-1``: unbounded), ``softcap`` (``0``: off) and attention sinks (``has_sinks``); for
    the backward op (``backward``), whether a gradient reaches the LSE (``has_dlse``).
    """

    q_shape: tuple[int, ...]
    k_shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    causal: bool = False
    causal_offset: int = 0
    has_runs: bool = False
    same_cu_seqlens: bool = True
    window_left: int = -1
    window_right: int = -1
    softcap: float = 0.0
    has_sinks: bool = False
    backward: bool = False
    has_dlse: bool = False

    @classmethod
    def of(
        cls,
        q: Tensor,
        k: Tensor,
        cu_seqlens_q: Tensor,
        cu_seqlens_k: Tensor,
        *,
        causal: bool,
        causal_offset: int,
        q_runs: Tensor | None,
        window_left: int,
        window_right: int,
        softcap: float,
        sinks: Tensor | None = None,
        backward: bool = False,
        dlse: Tensor | None = None,
    ) -> AttentionInputs:
        """The description of a validated call from its arguments."""
        return cls(
            q_shape=tuple(q.shape),
            k_shape=tuple(k.shape),
            dtype=q.dtype,
            device=q.device,
            causal=bool(causal),
            causal_offset=int(causal_offset),
            has_runs=q_runs is not None,
            same_cu_seqlens=cu_seqlens_q is cu_seqlens_k,
            window_left=int(window_left),
            window_right=int(window_right),
            softcap=float(softcap),
            has_sinks=sinks is not None,
            backward=backward,
            has_dlse=dlse is not None,
        )

    @property
    def head_dim(self) -> int:
        return self.q_shape[-1]

    @property
    def windowed(self) -> bool:
        return self.window_left >= 0 or self.window_right >= 0

    def __str__(self) -> str:
        parts = [
            f"{'backward' if self.backward else 'forward'}: q {list(self.q_shape)}, k/v {list(self.k_shape)}, "
            f"{self.dtype} on {self.device}"
        ]
        if self.causal:
            parts.append(f"causal (offset {self.causal_offset})" if self.causal_offset else "causal")
        if self.has_runs:
            parts.append("position runs")
        if not self.same_cu_seqlens:
            parts.append("separate cu_seqlens_q/cu_seqlens_k")
        if self.windowed:
            parts.append(f"window ({self.window_left}, {self.window_right})")
        if self.softcap > 0:
            parts.append(f"softcap {self.softcap:g}")
        if self.has_sinks:
            parts.append("sinks")
        if self.has_dlse:
            parts.append("a gradient of the LSE")
        return ", ".join(parts)


@dataclasses.dataclass(frozen=True)
class MergeInputs:
    """One call of ``merge_attention_states``: ``out_a``'s shape ``(T, H, D)``, the dtypes of
    ``out_a``, ``lse_a``, ``out_b`` and ``lse_b``, and their device."""

    shape: tuple[int, ...]
    dtypes: tuple[torch.dtype, ...]
    device: torch.device

    @classmethod
    def of(cls, out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor) -> MergeInputs:
        return cls(tuple(out_a.shape), (out_a.dtype, lse_a.dtype, out_b.dtype, lse_b.dtype), out_a.device)

    def __str__(self) -> str:
        dtypes = ", ".join(str(d) for d in self.dtypes)
        return f"out [{', '.join(map(str, self.shape))}], dtypes (out_a, lse_a, out_b, lse_b) {dtypes} on {self.device}"


# ------------------------------------------------------------------------- why a backend cannot
@functools.lru_cache(maxsize=1)
def _flash_attn_interface():
    try:
        import flash_attn.flash_attn_interface as fai
    except ImportError:
        return None
    return fai


# Whether the installed flash-attn returns the varlen LSE packed as [H, Tq] (2.x releases since the
# varlen LSE stopped being padded) - learnt from the first forward; its backward is only used then.
_FLASH_LSE_PACKED: dict[str, bool] = {}


def flash_attn_unsupported_reasons(inputs: AttentionInputs) -> list[str]:
    """Why flash-attn cannot run this block call (empty list: it can).

    flash-attn aligns causal masks and windows bottom-right per sequence, so only masks over
    identical query and key boundaries without offsets or runs (where both alignments agree) map
    onto it. flash-attn 2 has no attention sinks.
    """
    if inputs.device.type != "cuda":
        return ["flash-attn needs CUDA tensors"]
    reasons = []
    fai = _flash_attn_interface()
    if fai is None:
        reasons.append("flash-attn is not installed")
    if inputs.dtype not in (torch.float16, torch.bfloat16):
        reasons.append(f"flash-attn supports float16/bfloat16, not {inputs.dtype}")
    if inputs.head_dim > 256 or inputs.head_dim % 8:
        reasons.append(f"flash-attn needs a head dim <= 256 and a multiple of 8, got {inputs.head_dim}")
    masked = inputs.causal or inputs.windowed
    if masked and (inputs.has_runs or inputs.causal_offset != 0 or not inputs.same_cu_seqlens):
        reasons.append("flash-attn has no position runs / causal offset (needs identical cu_seqlens)")
    if fai is not None:
        params = inspect.signature(fai.flash_attn_varlen_func).parameters
        if inputs.windowed and "window_size" not in params:
            reasons.append("the installed flash-attn has no sliding window (window_size)")
        if inputs.softcap > 0 and "softcap" not in params:
            reasons.append("the installed flash-attn has no softcap")
    if inputs.has_sinks:
        reasons.append("flash-attn 2 has no attention sinks")
    if inputs.has_dlse:
        reasons.append("flash-attn's backward takes no gradient of the LSE")
    if inputs.backward and not _FLASH_LSE_PACKED.get("packed", False):
        reasons.append(
            "flash-attn's backward is used only after a flash-attn forward returned a packed [H, Tq] LSE"
        )
    return reasons


TORCH_FLASH_MIN = (2, 11)  # the oldest torch whose varlen FlashAttention this backend is written for


def _torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


@functools.lru_cache(maxsize=1)
def _torch_flash_ops() -> tuple | None:
    """torch's FlashAttention forward and backward ops (torch >= 2.11, the release whose varlen
    attention takes windows, with the keywords used here), or ``None``."""
    if _torch_version() < TORCH_FLASH_MIN:
        return None
    try:
        fwd = torch.ops.aten._flash_attention_forward.default
        bwd = torch.ops.aten._flash_attention_backward.default
    except (AttributeError, RuntimeError):  # pragma: no cover - torch without the ops
        return None
    names = {a.name for a in fwd._schema.arguments} & {a.name for a in bwd._schema.arguments}
    if not {"window_size_left", "window_size_right", "scale"} <= names:
        return None
    return fwd, bwd


@functools.lru_cache(maxsize=16)
def _capability(device: torch.device) -> tuple[int, int] | None:
    """The CUDA compute capability of ``device``, ``None`` without a CUDA device or on ROCm (one
    place, cached: the reasons are read at every call; tests fake it)."""
    if not torch.cuda.is_available() or torch.version.hip:
        return None
    return torch.cuda.get_device_capability(device)


def _flash_built() -> bool:
    """Whether this torch was built with its FlashAttention kernels (CUDA wheels are)."""
    return bool(torch.backends.cuda.is_flash_attention_available())


def torch_flash_impl() -> str:
    """Which FlashAttention torch's kernels run: ``"FA2"`` (the one every CUDA wheel builds in), or
    ``"FA3"``/``"FA4"`` where ``torch.nn.attention.activate_flash_attention_impl`` has installed
    it."""
    current = getattr(torch.nn.attention, "current_flash_attention_impl", None)
    name = current() if callable(current) else None
    return str(name) if name else "FA2"


def torch_flash_unsupported_reasons(inputs: AttentionInputs) -> list[str]:
    """Why torch's FlashAttention varlen kernels cannot run this block call (empty list: they can).

    Like flash-attn they align causal masks and windows bottom-right per sequence, so masks need
    identical query and key boundaries without offsets or position runs; and they have no softcap,
    no sinks and no gradient of the LSE (the Triton kernels run those)."""
    if inputs.device.type != "cuda":
        return ["torch's FlashAttention kernels need CUDA tensors"]
    reasons = []
    if _torch_flash_ops() is None:
        reasons.append(
            f"torch {torch.__version__} is older than the varlen FlashAttention this backend is written for "
            "(aten::_flash_attention_forward/backward with windows: torch >= 2.11)"
        )
    elif not _flash_built():
        reasons.append(f"torch {torch.__version__} was built without its FlashAttention kernels")
    capability = _capability(inputs.device)
    if capability is None:
        reasons.append("no CUDA device is available (or a ROCm build, whose kernels are not checked here)")
    elif capability[0] < 8:
        reasons.append(
            f"torch's FlashAttention needs sm_80 or newer, the device is sm_{capability[0]}{capability[1]}"
        )
    elif inputs.backward and inputs.head_dim > 192 and tuple(capability) in ((8, 6), (8, 9), (12, 0)):
        # as SDPA refuses it: these cards lack the shared memory of the backward's larger tiles
        reasons.append(
            f"torch's FlashAttention backward on sm_{capability[0]}{capability[1]} takes head dims <= 192"
        )
    if inputs.dtype not in (torch.float16, torch.bfloat16):
        reasons.append(f"torch's FlashAttention takes float16/bfloat16, not {inputs.dtype}")
    if inputs.head_dim > 256 or inputs.head_dim % 8:
        reasons.append(
            f"torch's FlashAttention needs a head dim <= 256 and a multiple of 8, got {inputs.head_dim}"
        )
    masked = inputs.causal or inputs.windowed
    if masked and (inputs.has_runs or inputs.causal_offset != 0 or not inputs.same_cu_seqlens):
        reasons.append(
            "torch's FlashAttention has no position runs / causal offset (needs identical cu_seqlens)"
        )
    if inputs.softcap > 0:
        reasons.append("torch's FlashAttention has no softcap")
    if inputs.has_sinks:
        reasons.append("torch's FlashAttention has no attention sinks")
    if inputs.has_dlse:
        reasons.append("torch's FlashAttention backward takes no gradient of the LSE")
    return reasons


def triton_attention_reasons(inputs: AttentionInputs | MergeInputs) -> list[str]:
    """Why the Triton kernels cannot run this block or merge call (empty list: they can)."""
    reasons = triton_unsupported_reasons(inputs.device)
    dtypes = inputs.dtypes if isinstance(inputs, MergeInputs) else (inputs.dtype,)
    if torch.float64 in dtypes:
        reasons.append("the Triton kernels take float16, bfloat16 and float32, not float64")
    return reasons


def _runs_everything(inputs: object) -> list[str]:
    return []


ATTENTION_BACKENDS: tuple[Backend[AttentionInputs], ...] = (
    Backend("flash_attn", flash_attn_unsupported_reasons),
    Backend("torch_flash", torch_flash_unsupported_reasons),
    Backend("triton", triton_attention_reasons),
    Backend("reference", _runs_everything),
)
MERGE_BACKENDS: tuple[Backend[MergeInputs], ...] = (
    Backend("triton", triton_attention_reasons),
    Backend("reference", _runs_everything),
)
# what the block ops' ``backend=`` accepts
BACKENDS: tuple[str, ...] = ("auto", *(b.name for b in ATTENTION_BACKENDS))


def auto_order(inputs: AttentionInputs) -> tuple[str, ...]:
    """The order in which ``"auto"`` tries the backends for this call.

    flash-attn, torch's FlashAttention, the Triton kernels, the reference; except on Hopper (sm_90)
    where torch's FlashAttention is FlashAttention-2 (``torch_flash_impl()``) at head dims 65 to
    128 in 16 bits, where the Triton kernels come before it: measured on an H200 (torch 2.11,
    Triton 3.6, ``mmbalance bench attention``), forward + backward at head dim 128 ran 1.19x
    (full, 8 x 2048), 1.26x (causal), 1.13x (4 x 8192), 1.01x (32k), 1.21x (the shipped lengths)
    and 1.37x (a 512 window over 32k) as fast on Triton as on FlashAttention-2, which Hopper runs
    without its own instructions. At head dim 64 FlashAttention-2 stays first."""
    if (
        inputs.device.type == "cuda"
        and inputs.dtype in (torch.float16, torch.bfloat16)
        and 64 < inputs.head_dim <= 128
        and (_capability(inputs.device) or (0, 0))[0] == 9
        and torch_flash_impl() == "FA2"
    ):
        return ("flash_attn", "triton", "torch_flash", "reference")
    return tuple(b.name for b in ATTENTION_BACKENDS)


def select_attention_backend(backend: str, inputs: AttentionInputs) -> str:
    """The backend that runs this block call: ``backend`` when it is a name, otherwise
    ``MMBALANCE_ATTN_BACKEND``'s, otherwise the first of :func:`auto_order` that can run it
    (flash-attn, then torch's FlashAttention, then Triton, then the reference; Triton before
    torch's FlashAttention-2 on Hopper at head dims 65-128)."""
    return select_backend(
        "attention_block", ATTENTION_BACKENDS, backend, inputs, env="MMBALANCE_ATTN_BACKEND",
        prefer=auto_order,
    )  # fmt: skip


def select_merge_backend(backend: str, inputs: MergeInputs) -> str:
    """The backend that runs this merge: ``backend`` when it is a name, otherwise Triton, then the
    reference."""
    return select_backend("merge_attention_states", MERGE_BACKENDS, backend, inputs)


# -------------------------------------------------------------------------------- flash-attn path
def flash_fwd(
    q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_k: Tensor, max_q: int, max_k: int, scale: float, causal: bool,
    window_left: int = -1, window_right: int = -1, softcap: float = 0.0,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """The block forward on flash-attn: ``out`` in q's dtype and the float32 ``lse [H, Tq]`` with
    ``-inf`` for rows without keys (this library's convention)."""
    fai = _flash_attn_interface()
    extra: dict = {}
    # only what the call needs, so releases without these arguments still run plain calls
    if window_left >= 0 or window_right >= 0:
        extra["window_size"] = (window_left, window_right)
    if softcap > 0:
        extra["softcap"] = softcap
    out, lse, _ = fai.flash_attn_varlen_func(
        q, k, v, cu_q, cu_k, max_q, max_k, dropout_p=0.0, softmax_scale=scale, causal=causal,
        return_attn_probs=True, **extra,
    )  # fmt: skip
    _FLASH_LSE_PACKED["packed"] = lse.dim() == 2
    if lse.dim() == 3:
        # older releases pad the varlen LSE to [B, H, max_seqlen_q]: gather it packed, on the device
        tokens = torch.arange(q.shape[0], device=q.device, dtype=cu_q.dtype)
        seq = torch.searchsorted(cu_q, tokens, right=True) - 1
        lse = lse[seq.long(), :, (tokens - cu_q[seq]).long()].t()
    # flash-attn marks rows without keys with +inf; this library uses -inf
    return out, torch.where(lse == math.inf, -math.inf, lse.float()).contiguous()


def flash_bwd(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, cu_q: Tensor, cu_k: Tensor, max_q: int,
    max_k: int, scale: float, causal: bool, window_left: int = -1, window_right: int = -1, softcap: float = 0.0,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """The block backward on flash-attn (after a flash-attn forward); float32 ``dq``, ``dk``, ``dv``."""
    fai = _flash_attn_interface()
    fn = fai._flash_attn_varlen_backward
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    values = dict(
        dout=dout.contiguous(), q=q, k=k, v=v, out=out.to(q.dtype).contiguous(),
        softmax_lse=torch.where(lse == -math.inf, math.inf, lse).float().contiguous(),
        dq=dq, dk=dk, dv=dv, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q, max_seqlen_k=max_k,
        dropout_p=0.0, softmax_scale=scale, causal=causal, window_size=(window_left, window_right),
        window_size_left=window_left, window_size_right=window_right, softcap=softcap, alibi_slopes=None,
        deterministic=False, rng_state=None,
    )  # fmt: skip
    # the private backward's signature changed across 2.x releases: pass what it names
    params = inspect.signature(fn).parameters
    fn(**{name: values[name] for name in params if name in values})
    return dq.float(), dk.float(), dv.float()


# ------------------------------------------------------------------ torch's own FlashAttention path
def _window_args(window_left: int, window_right: int, causal: bool) -> dict:
    if window_left < 0 and window_right < 0:
        return {}
    # causal and windowed: right = 0, said (FlashAttention-2 sets it for causal calls; FA3/FA4 read it)
    return {"window_size_left": int(window_left), "window_size_right": 0 if causal else int(window_right)}


def _launch_sizes(max_q: int, max_k: int) -> tuple[int, int]:
    """The longest query and key lengths as the kernels are told them: at least 2 queries (one
    query a sequence sends FlashAttention-2's grouped-query path through a reshape that needs no
    empty sequence) and one key (a grid of no key blocks is no launch). Upper bounds are safe:
    the kernels' blocks past a sequence's end do nothing."""
    return max(int(max_q), 2), max(int(max_k), 1)


def torch_flash_fwd(
    q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_k: Tensor, max_q: int, max_k: int, scale: float, causal: bool,
    window_left: int = -1, window_right: int = -1,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """The block forward on torch's FlashAttention varlen kernel: ``out`` in q's dtype and the
    float32 ``lse [H, Tq]`` with ``-inf`` for rows without keys (this library's convention)."""
    ops = _torch_flash_ops()
    assert ops is not None  # selected only where they exist
    if q.shape[0] == 0 or cu_q.shape[0] < 2:  # nothing to attend (FlashAttention wants a batch)
        return q.new_zeros(q.shape), q.new_full((q.shape[1], q.shape[0]), -math.inf, dtype=torch.float32)
    out, lse, _, _, _ = ops[0](
        q, k, v, cu_q.to(torch.int32), cu_k.to(torch.int32), *_launch_sizes(max_q, max_k), 0.0, bool(causal), False,
        scale=float(scale), **_window_args(window_left, window_right, causal),
    )  # fmt: skip
    # FlashAttention marks rows without keys with +inf; this library uses -inf. Its outputs keep
    # q's strides: contiguous, as the op's fake says
    return out.contiguous(), torch.where(lse == math.inf, -math.inf, lse.float()).contiguous()


def torch_flash_bwd(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, cu_q: Tensor, cu_k: Tensor, max_q: int,
    max_k: int, scale: float, causal: bool, window_left: int = -1, window_right: int = -1,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """The block backward on torch's FlashAttention varlen kernel, from any forward's ``out`` and
    ``lse`` (the kernel recomputes the probabilities from them; a merged LSE, as the ring gives,
    is right); float32 ``dq``, ``dk``, ``dv``."""
    ops = _torch_flash_ops()
    assert ops is not None
    if q.shape[0] == 0 or cu_q.shape[0] < 2:  # no query: no gradient
        return (q.new_zeros(q.shape, dtype=torch.float32), k.new_zeros(k.shape, dtype=torch.float32),
                v.new_zeros(v.shape, dtype=torch.float32))  # fmt: skip
    rng = torch.zeros(2, dtype=torch.uint64, device=q.device)  # no dropout: the state is not read
    unused = torch.zeros((), dtype=torch.uint64, device=q.device)
    dq, dk, dv = ops[1](
        dout.contiguous(), q, k, v, out.to(q.dtype).contiguous(),
        torch.where(lse == -math.inf, math.inf, lse).float().contiguous(), cu_q.to(torch.int32),
        cu_k.to(torch.int32), *_launch_sizes(max_q, max_k), 0.0, bool(causal), rng, unused, scale=float(scale),
        **_window_args(window_left, window_right, causal),
    )  # fmt: skip
    return dq.float().contiguous(), dk.float().contiguous(), dv.float().contiguous()
