"""The tile sweep's inputs and checks: one shape's inputs, outputs and float32 reference on a device,
the table's launch configuration, and the rules a candidate's result must meet (against the
reference, and row by row against the table's own result)."""

from __future__ import annotations

import dataclasses
import itertools
import math

import torch

from .shapes import TileShape


# ------------------------------------------------------------------------------------ inputs and runs
@dataclasses.dataclass
class Case:
    """One shape's inputs, outputs and reference on a device."""

    shape: TileShape
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    cu: torch.Tensor
    dout: torch.Tensor
    sinks: torch.Tensor | None
    scale: float
    longest: int
    out: torch.Tensor
    lse: torch.Tensor
    grads: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    ref: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)

    def fwd(self, cfg: dict, out=None, lse=None):
        from mmbalance.kernels.attention_fwd import attn_fwd

        return attn_fwd(self.q, self.k, self.v, self.cu, self.cu, self.longest, self.scale, self.shape.causal,
                        out=self.out if out is None else out, lse=self.lse if lse is None else lse,
                        config=cfg, softcap=self.shape.softcap, sinks=self.sinks)  # fmt: skip

    def bwd(self, cfg: dict, out: torch.Tensor, lse: torch.Tensor):
        from mmbalance.kernels.attention_bwd import attn_bwd

        return attn_bwd(self.dout, self.q, self.k, self.v, out, lse, self.cu, self.cu, self.longest,
                        self.longest, self.scale, self.shape.causal, grads=self.grads, config=cfg,
                        softcap=self.shape.softcap)  # fmt: skip


def make_case(shape: TileShape, device: str, dtype: torch.dtype, with_reference: bool = True) -> Case:
    g = torch.Generator().manual_seed(0)
    lengths = shape.all_lengths
    tokens = sum(lengths)
    q, k, v = (torch.randn(tokens, h, shape.head_dim, generator=g).to(device, dtype)
               for h in (shape.heads, shape.kv_heads, shape.kv_heads))  # fmt: skip
    dout = torch.randn(tokens, shape.heads, shape.head_dim, generator=g).to(device, dtype)
    sinks = (torch.randn(shape.heads, generator=g) * 2).to(device) if shape.sinks else None
    cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=device)
    out = torch.empty_like(q)
    lse = torch.empty((shape.heads, tokens), dtype=torch.float32, device=device)
    grads = tuple(torch.empty(t.shape, dtype=torch.float32, device=device) for t in (q, k, v))
    case = Case(shape, q, k, v, cu, dout, sinks, 1.0 / math.sqrt(shape.head_dim), max(lengths), out, lse,
                 grads)  # type: ignore[arg-type]  # fmt: skip
    if with_reference:
        from mmbalance.pyops.attention_ref import attention_block_bwd_ref, attention_block_fwd_ref

        q32, k32, v32, do32 = (t.float() for t in (q, k, v, dout))
        ref_out, ref_lse = attention_block_fwd_ref(q32, k32, v32, cu, cu, case.scale, shape.causal,
                                                   softcap=shape.softcap, sinks=sinks)  # fmt: skip
        dq, dk, dv = attention_block_bwd_ref(do32, q32, k32, v32, ref_out, ref_lse, cu, cu, case.scale,
                                             shape.causal, softcap=shape.softcap)  # fmt: skip
        case.ref = dict(out=ref_out, lse=ref_lse, dq=dq, dk=dk, dv=dv)
    return case


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest absolute error over the largest reference value (NaN for a non-finite result)."""
    if got.numel() == 0:
        return 0.0
    diff = (got.float() - want.float()).abs().max().item()
    return diff / max(want.abs().max().item(), 1e-30) if math.isfinite(diff) else math.nan


def reference_error(case: Case, pass_: str) -> float:
    """The pass's error against the reference: the forward's output, the dq pass's dq, the dk/dv
    pass's worse of dk and dv."""
    if pass_ == "fwd":
        return _rel_err(case.out, case.ref["out"])
    if pass_ == "dq":
        return _rel_err(case.grads[0], case.ref["dq"])
    return max(_rel_err(case.grads[1], case.ref["dk"]), _rel_err(case.grads[2], case.ref["dv"]))


def pass_outputs(case: Case, pass_: str) -> list[torch.Tensor]:
    """What the pass writes: the forward's output and LSE, dq, or dk and dv."""
    return {"fwd": [case.out, case.lse], "dq": [case.grads[0]], "kv": [case.grads[1], case.grads[2]]}[pass_]


def row_error(got: torch.Tensor, want: torch.Tensor, floor: float = 1e-2) -> float:
    """The largest error of any row (a head's vector of one token; each LSE value alone) over that
    row's own largest value, or over ``floor`` times the largest of all where the row is smaller:
    an error confined to a few rows (a tile that skipped keys for the last queries) shows at its
    size, not diluted by the largest rows. Equal values (infinities too) differ by 0; NaN where
    ``got`` is not finite where ``want`` is."""
    if got.numel() == 0:
        return 0.0
    g = got.detach().double().reshape(-1, got.shape[-1] if got.dim() == 3 else 1)
    w = want.detach().double().reshape(g.shape)
    diff = torch.where(g == w, torch.zeros_like(g), (g - w).abs()).amax(1)
    finite = w[torch.isfinite(w)].abs()
    scale = (
        w.abs()
        .nan_to_num(0.0, 0.0, 0.0)
        .amax(1)
        .clamp_min(floor * (float(finite.max()) if finite.numel() else 1.0))
    )
    err = float((diff / scale.clamp_min(1e-30)).max())
    return err if math.isfinite(err) else math.nan


# the table's own error against the reference must stay under this (relative to the largest
# reference value); a candidate's under twice the table's plus one unit of precision, and never over this
TABLE_TOLERANCE = {torch.float32: 1e-4, torch.float16: 0.02, torch.bfloat16: 0.05}
# a candidate against the table's own result, row by row: the same products, summed in another
# order (16-bit outputs may round one unit apart)
CONSISTENCY_TOLERANCE = {
    torch.float32: 1e-4,
    torch.float16: 2 * torch.finfo(torch.float16).eps,
    torch.bfloat16: 2 * torch.finfo(torch.bfloat16).eps,
}


def accepted(err: float, table_err: float, dtype: torch.dtype) -> bool:
    """A candidate's error against the reference (relative to the largest reference value) is
    accepted within twice the table's plus one unit of ``dtype``'s precision, and never over
    ``TABLE_TOLERANCE``; a table error that is NaN or itself over the tolerance counts as half the
    tolerance. NaN is never accepted."""
    tol = TABLE_TOLERANCE[dtype]
    base = table_err if math.isfinite(table_err) and table_err <= tol else tol / 2
    return math.isfinite(err) and err <= min(2.0 * base + torch.finfo(dtype).eps, tol)


def table_config(case: Case, pass_: str) -> dict:
    """The launch configuration the table gives this case's pass (the whole ``bwd_config`` dict
    for either backward pass)."""
    from mmbalance.kernels.attention_common import bwd_config, fwd_config

    s = case.shape
    pick = fwd_config if pass_ == "fwd" else bwd_config
    return pick(s.head_dim, case.q.device, case.q.dtype, softcap=s.softcap > 0)
