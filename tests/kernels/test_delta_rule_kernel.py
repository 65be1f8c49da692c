"""The chunk-state kernel of the gated delta rule (``kernels/delta_rule.py``) against the float64
reference written token by token (``tests/pyops/delta_rule_expected.py``): fresh random inputs,
odd sizes, empty chunks, no value columns, strided token rows, float32 / float16 / bfloat16 inputs,
outputs poisoned before the launch, and the op's ``backend="triton"`` path.

They need a CUDA device or ``TRITON_INTERPRET=1`` set before the kernel modules are imported
(``tests/kernels/test_under_interpreter.py`` runs this file so):
``TRITON_INTERPRET=1 python -m pytest tests/kernels/test_delta_rule_kernel.py``.
"""

from __future__ import annotations

import pytest
import torch

import mmbalance.pyops as P
from mmbalance.kernels import _launch
from mmbalance.kernels import delta_rule as K
from tests.pyops.delta_rule_expected import chunk_maps, random_inputs

pytestmark = pytest.mark.skipif(
    not (_launch.INTERPRET or torch.cuda.is_available()), reason="kernels need TRITON_INTERPRET=1 or CUDA"
)
DEVICE = "cuda" if torch.cuda.is_available() and not _launch.INTERPRET else "cpu"

CASES = [
    (11, 3, 5, 7, [0, 4, 4, 11]),
    (19, 2, 16, 20, [0, 19]),
    (9, 1, 33, 3, [0, 2, 2, 9]),
    (6, 2, 3, 0, [0, 2, 6]),
    (0, 2, 4, 4, [0, 0]),
]


@pytest.mark.parametrize("tokens,heads,key_dim,value_dim,cu", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_kernel_against_the_reference(tokens, heads, key_dim, value_dim, cu, dtype):
    k, v, g, beta, _ = random_inputs(tokens, heads, key_dim, value_dim, seed=tokens + key_dim, dtype=dtype)
    k, v, g, beta = (t.to(DEVICE) for t in (k, v, g, beta))
    bounds = torch.tensor(cu, dtype=torch.int32, device=DEVICE)
    pieces = len(cu) - 1
    m = torch.full((pieces, heads, key_dim, key_dim), float("nan"), device=DEVICE)
    u = torch.full((pieces, heads, key_dim, value_dim), float("nan"), device=DEVICE)
    K.delta_rule_chunk_state(k, v, g, beta, bounds, m=m, u=u)
    want_m, want_u = chunk_maps(k.cpu(), v.cpu(), g.cpu(), beta.cpu(), cu)  # of the rounded inputs
    torch.testing.assert_close(m.cpu().double(), want_m, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(u.cpu().double(), want_u, rtol=2e-5, atol=2e-5)


def test_strided_rows_and_the_ops_triton_path():
    k, v, g, beta, _ = random_inputs(13, 2, 8, 6, seed=4, dtype=torch.float32)
    wide_k = torch.zeros(13, 3, 8)
    wide_k[:, ::2][:, :2] = k  # token and head strides of a wider buffer
    k_view = wide_k[:, ::2][:, :2]
    cu = [0, 6, 13]
    bounds = torch.tensor(cu, dtype=torch.int64, device=DEVICE)
    args = [t.to(DEVICE) for t in (k_view, v, g, beta)]
    m, u = P.delta_rule_chunk_state(*args, bounds, 7, backend="triton")
    want_m, want_u = chunk_maps(k, v, g, beta, cu)
    torch.testing.assert_close(m.cpu().double(), want_m, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(u.cpu().double(), want_u, rtol=2e-5, atol=2e-5)
