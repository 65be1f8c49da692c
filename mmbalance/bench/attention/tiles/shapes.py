"""The tile sweep's shapes and candidates: what ``python -m mmbalance.bench.attention.tiles`` tries,
per shape, for the forward kernel, the dq pass and the dk/dv pass (the table's choice first)."""

from __future__ import annotations

import dataclasses
import itertools

import torch

from ..batch import BlockConfig

FWD_KEYS = ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages")
PASS_KEYS = {
    "dq": ("dq_BLOCK_M", "dq_BLOCK_N", "dq_warps", "dq_stages"),
    "kv": ("kv_BLOCK_M", "kv_BLOCK_N", "kv_warps", "kv_stages"),
}


@dataclasses.dataclass(frozen=True)
class TileShape:
    name: str
    n_seqs: int
    seqlen: int
    heads: int
    kv_heads: int
    head_dim: int
    causal: bool
    softcap: float = 0.0
    sinks: bool = False
    lengths: tuple[int, ...] | None = None  # uneven lengths (seqlen: the longest)
    plain: str | None = None  # the same shape without softcap and sinks (``vs_plain``)

    def block(self, dtype: torch.dtype = torch.float32) -> BlockConfig:
        """The shape as ``bench attention`` describes a batch (its lengths and FLOP count)."""
        return BlockConfig(self.n_seqs, self.seqlen, self.heads, self.kv_heads, self.head_dim, self.causal, dtype,
                           lengths=self.lengths)  # fmt: skip

    @property
    def all_lengths(self) -> list[int]:
        return self.block().all_lengths

    @property
    def features(self) -> dict[str, bool]:
        """The kernels' feature switches for this shape (the audit's ``features``)."""
        return dict(CAUSAL=self.causal, SOFTCAP=self.softcap > 0, SINKS=self.sinks)

    def flops_fwd(self) -> float:
        return self.block().flops_fwd()


# in the order they run: the plain causal shape first (vs_plain needs it), the features last
GPU_SHAPES = (
    TileShape("d128-causal", 8, 2048, 16, 4, 128, True),
    TileShape("d128-full", 8, 2048, 16, 4, 128, False),
    TileShape("d64-causal-short", 32, 512, 16, 4, 64, True),
    TileShape("d128-causal-softcap", 8, 2048, 16, 4, 128, True, softcap=50.0, plain="d128-causal"),
    TileShape("d128-causal-sinks", 8, 2048, 16, 4, 128, True, sinks=True, plain="d128-causal"),
)
# under the interpreter: lengths that cross every candidate tile, an empty sequence, GQA
_SMOKE_LENGTHS = (200, 0, 131, 67)
SMOKE_SHAPES = (
    TileShape("smoke-full", 4, 200, 2, 1, 32, False, lengths=_SMOKE_LENGTHS),
    TileShape("smoke-causal", 4, 200, 2, 1, 32, True, lengths=_SMOKE_LENGTHS),
    TileShape(
        "smoke-causal-softcap",
        4,
        200,
        2,
        1,
        32,
        True,
        softcap=5.0,
        lengths=_SMOKE_LENGTHS,
        plain="smoke-causal",
    ),  # fmt: skip
    TileShape(
        "smoke-causal-sinks", 4, 200, 2, 1, 32, True, sinks=True, lengths=_SMOKE_LENGTHS, plain="smoke-causal"
    ),  # fmt: skip
    # the command's own end-to-end check: a few tiles, an empty sequence, GQA, in seconds
    TileShape("smoke-mini", 3, 37, 2, 1, 16, True, lengths=(37, 0, 20)),
    TileShape("smoke-mini-sinks", 3, 37, 2, 1, 16, True, sinks=True, lengths=(37, 0, 20), plain="smoke-mini"),
)
SHAPES: dict[str, TileShape] = {s.name: s for s in (*GPU_SHAPES, *SMOKE_SHAPES)}


# ------------------------------------------------------------------------------------ candidates
def _grid(keys: tuple[str, ...], *values) -> list[dict]:
    return [dict(zip(keys, combo)) for combo in itertools.product(*values)]


def _table_first(table: dict, grid: list[dict], keys: tuple[str, ...]) -> list[dict]:
    """The table's choice, then the grid's other entries in order (each once)."""
    own = {k: table[k] for k in keys}
    return [own] + [c for c in grid if c != own]


def fwd_candidates(
    head_dim: int,
    dtype: torch.dtype,
    capability: int,
    *,
    softcap: bool = False,
    interpret: bool = False,
    causal: bool = True,
) -> list[dict]:
    """Forward launches to try (``BLOCK_M``, ``BLOCK_N``, ``num_warps``, ``num_stages``), the
    table's choice for ``sm_<capability>`` first. ``interpret``: the interpreter's (tile shapes
    only: warps and stages mean nothing there)."""
    from mmbalance.kernels.attention_common import fwd_config

    if interpret:  # the table's choice there: fwd_config without a capability off CUDA
        table = fwd_config(head_dim, torch.device("cpu"), dtype)
        return _table_first(table, _grid(FWD_KEYS, (16, 64, 128), (16, 32, 128), (4,), (1,)), FWD_KEYS)
    table = fwd_config(
        head_dim, torch.device("cuda"), dtype, capability=capability, softcap=softcap, causal=causal
    )
    if dtype == torch.float32:  # IEEE FMA products on 4-byte tiles
        grid = _grid(FWD_KEYS, (16, 32, 64), (16, 32), (4, 8), (1,))
    else:
        grid = _grid(FWD_KEYS, (64, 128), (32, 64, 128), (4, 8), (2, 3))
    return _table_first(table, grid, FWD_KEYS)


def bwd_candidates(
    head_dim: int,
    dtype: torch.dtype,
    capability: int,
    *,
    softcap: bool = False,
    interpret: bool = False,
    causal: bool = True,
) -> dict[str, list[dict]]:
    """Backward launches to try per pass, ``{"dq": [...], "kv": [...]}`` with each pass's four
    ``bwd_config`` keys, the table's choice first (see :func:`fwd_candidates`)."""
    from mmbalance.kernels.attention_common import bwd_config

    if interpret:
        table = bwd_config(head_dim, torch.device("cpu"), dtype)
        grids = {
            "dq": _grid(PASS_KEYS["dq"], (16, 64, 128), (16, 32, 64), (4,), (1,)),
            "kv": _grid(PASS_KEYS["kv"], (16, 32, 64), (16, 64, 128), (4,), (1,)),
        }
    else:
        table = bwd_config(
            head_dim, torch.device("cuda"), dtype, capability=capability, softcap=softcap, causal=causal
        )
        if dtype == torch.float32:
            grids = {
                "dq": _grid(PASS_KEYS["dq"], (16, 32), (16, 32), (4, 8), (1,)),
                "kv": _grid(PASS_KEYS["kv"], (16, 32), (16, 32), (4, 8), (1,)),
            }
        else:
            grids = {
                "dq": _grid(PASS_KEYS["dq"], (64, 128), (32, 64), (4, 8), (1, 2)),
                "kv": _grid(PASS_KEYS["kv"], (32, 64), (64, 128), (4, 8), (1, 2)),
            }
    return {p: _table_first(table, grids[p], PASS_KEYS[p]) for p in PASS_KEYS}


def distinct_tiles(
    capability: int = 90, dtype: torch.dtype = torch.bfloat16
) -> dict[str, list[tuple[int, int]]]:
    """The distinct ``(BLOCK_M, BLOCK_N)`` of every pass over the GPU shapes' candidates: what the
    interpreter must check against the reference (warps and stages do not change the results)."""
    tiles: dict[str, set[tuple[int, int]]] = {"fwd": set(), "dq": set(), "kv": set()}
    for shape in GPU_SHAPES:
        soft = shape.softcap > 0
        for c in fwd_candidates(shape.head_dim, dtype, capability, softcap=soft, causal=shape.causal):
            tiles["fwd"].add((c["BLOCK_M"], c["BLOCK_N"]))
        for p, cands in bwd_candidates(
            shape.head_dim, dtype, capability, softcap=soft, causal=shape.causal
        ).items():
            for c in cands:
                tiles[p].add((c[f"{p}_BLOCK_M"], c[f"{p}_BLOCK_N"]))
    return {p: sorted(t) for p, t in tiles.items()}


def tile_label(cfg: dict, keys: tuple[str, ...]) -> str:
    m, n, w, s = (cfg[k] for k in keys)
    return f"M{m} N{n} w{w} s{s}"


def each_candidate(cands: dict):
    for c in cands["fwd"]:
        yield "fwd", c
    for p in PASS_KEYS:
        for c in cands[p]:
            yield p, c
