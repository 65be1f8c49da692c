"""Every tile shape the GPU tile sweep may choose (``python -m mmbalance.bench.attention.tiles``),
forward and backward against the float64 reference.

The sweep times candidates on a GPU and keeps the fastest; on the GPU it only compares them with a
float32 reference at one shape. Here each distinct ``(BLOCK_M, BLOCK_N)`` of the forward, the dq
pass and the dk/dv pass (``distinct_tiles``: warps and pipeline depths change no result) runs
under the interpreter on sequences that cross several tiles, an empty one among them, with the
features whose loop bounds depend on the tiles (causal with a softcap and sinks; a two-sided window
with unequal query and key lengths, an offset and position runs). Like the other kernel tests this
needs CUDA or ``TRITON_INTERPRET=1`` at import (``test_under_interpreter.py`` runs it so).
"""

from __future__ import annotations

import itertools

import pytest
import torch

from mmbalance.bench.attention.tiles import distinct_tiles
from tests.kernels.test_attention_features import _batch, _check_all

TILES = distinct_tiles()
# each forward tile once, each backward tile at least once, paired so that no two runs repeat one
N_RUNS = max(len(t) for t in TILES.values())
RUNS = [
    (
        TILES["fwd"][i % len(TILES["fwd"])],
        TILES["dq"][i % len(TILES["dq"])],
        TILES["kv"][(i + 1) % len(TILES["kv"])],
    )
    for i in range(N_RUNS)
]

LENGTHS = [200, 0, 131, 67]
SPECS = {
    "causal-softcap-sinks": (LENGTHS, LENGTHS, dict(causal=True, softcap=3.0), True),
    "window-two-sided-runs": (
        [150, 7, 90],
        [170, 0, 129],
        dict(
            window_left=40,
            window_right=9,
            causal_offset=5,
            q_runs=[[0, 100, 120], [3, 7, 10], [0, 90, 90]],
            k_runs=[[0, 150, 160], [0, 0, 0], [0, 60, 80]],
        ),
        False,
    ),  # fmt: skip
}


def test_the_tiles_cover_every_pass_and_the_tables_choice():
    from mmbalance.kernels.attention_common import bwd_config, fwd_config

    assert {t for run in RUNS for t in [run[0]]} == set(TILES["fwd"])
    assert {run[1] for run in RUNS} == set(TILES["dq"]) and {run[2] for run in RUNS} == set(TILES["kv"])
    for head_dim, causal in itertools.product((64, 128), (True, False)):
        f = fwd_config(head_dim, torch.device("cuda"), torch.bfloat16, capability=90, causal=causal)
        b = bwd_config(head_dim, torch.device("cuda"), torch.bfloat16, capability=90, causal=causal)
        assert (f["BLOCK_M"], f["BLOCK_N"]) in TILES["fwd"]
        assert (b["dq_BLOCK_M"], b["dq_BLOCK_N"]) in TILES["dq"]
        assert (b["kv_BLOCK_M"], b["kv_BLOCK_N"]) in TILES["kv"]


@pytest.mark.parametrize("spec_name", list(SPECS))
@pytest.mark.parametrize(
    "tiles", RUNS, ids=[f"fwd{f[0]}x{f[1]}-dq{d[0]}x{d[1]}-kv{k[0]}x{k[1]}" for f, d, k in RUNS]
)
def test_each_tile_matches_the_reference(tiles, spec_name):
    (fm, fn), (dm, dn), (km, kn) = tiles
    lq, lk, spec, use_sinks = SPECS[spec_name]
    q, k, v, cu_q, cu_k, sinks = _batch(lq, lk, 2, 1, 32, torch.float32, seed=fm + fn + dm)
    fwd = dict(BLOCK_M=fm, BLOCK_N=fn, num_warps=4, num_stages=1)
    bwd = dict(dq_BLOCK_M=dm, dq_BLOCK_N=dn, dq_warps=4, kv_BLOCK_M=km, kv_BLOCK_N=kn, kv_warps=4, stages=1)
    _check_all(q, k, v, cu_q, cu_k, 0.3, dict(spec), sinks if use_sinks else None, seed=3, config=fwd,
               bwd_config=bwd)  # fmt: skip
