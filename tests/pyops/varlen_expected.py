"""Independent expected results and inputs for the varlen op tests (shared by tests/kernels).

The expectations are Python loops over segments on widened copies (float64 for float payloads,
int64 for integer and bool payloads), written without the library's index arithmetic, so they
check the references in ``pyops/varlen_ref.py`` and the Triton kernels alike.
"""

from __future__ import annotations

import torch

# readable ids -> segment lengths; zeros, an empty batch and odd sizes on purpose
LENGTHS = {
    "odd": [3, 1, 7, 2, 5],
    "zero_len": [0, 4, 0, 0, 3, 0],
    "all_zero": [0, 0, 0],
    "single": [9],
    "empty_batch": [],
}

DTYPES = {
    "f64": torch.float64,
    "f32": torch.float32,
    "f16": torch.float16,
    "bf16": torch.bfloat16,
    "i64": torch.int64,
    "i32": torch.int32,
    "u8": torch.uint8,
    "bool": torch.bool,
}


def widen(x: torch.Tensor) -> torch.Tensor:
    return x.double() if x.is_floating_point() else x.long()


def poison(dtype: torch.dtype):
    """A value no valid output element holds: NaN for floats, the dtype's max for integers."""
    if dtype.is_floating_point:
        return float("nan")
    if dtype == torch.bool:
        return True
    return torch.iinfo(dtype).max


def payload(shape, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Random values that are exact in ``dtype`` and never equal the poison value."""
    if dtype.is_floating_point:
        return torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)
    if dtype == torch.bool:
        return torch.zeros(shape, dtype=torch.bool)  # poison for bool is True
    hi = 100 if dtype in (torch.uint8, torch.int8) else 10_000
    return torch.randint(0, hi, shape, generator=gen, dtype=torch.int64).to(dtype)


def cu_of(lengths: list[int], dtype=torch.int32) -> torch.Tensor:
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return torch.tensor(cu, dtype=dtype)


def expected_pack(padded: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    rows = []
    for b, n in enumerate(lengths):
        for s in range(n):
            rows.append(widen(padded[b, s]))
    if not rows:
        return widen(padded.new_empty((0, *padded.shape[2:])))
    return torch.stack(rows)


def expected_unpack(packed: torch.Tensor, lengths: list[int], max_seqlen: int, pad: float) -> torch.Tensor:
    wide = widen(packed)
    out = torch.full((len(lengths), max_seqlen, *packed.shape[1:]), pad, dtype=wide.dtype)
    start = 0
    for b, n in enumerate(lengths):
        for s in range(n):
            out[b, s] = wide[start + s]
        start += n
    return out


def expected_gather(packed: torch.Tensor, lengths: list[int], order: list[int]) -> torch.Tensor:
    wide = widen(packed)
    starts = cu_of(lengths).tolist()
    rows = [wide[t] for k in order for t in range(starts[k], starts[k + 1])]
    return torch.stack(rows) if rows else wide.new_empty((0, *packed.shape[1:]))


def expected_scatter(src: torch.Tensor, lengths: list[int], order: list[int]) -> torch.Tensor:
    wide = widen(src)
    starts = cu_of(lengths).tolist()
    out = torch.zeros((starts[-1], *src.shape[1:]), dtype=wide.dtype)
    t = 0
    for k in order:
        for row in range(starts[k], starts[k + 1]):
            out[row] = wide[t]
            t += 1
    return out


def assert_same(out: torch.Tensor, expected: torch.Tensor) -> None:
    """Bit-exact after widening (the ops only copy), NaN anywhere is a failure."""
    assert out.shape == expected.shape, (tuple(out.shape), tuple(expected.shape))
    got = widen(out)
    if got.is_floating_point():
        assert not torch.isnan(got).any(), "output holds poisoned (NaN) elements"
    assert torch.equal(got, expected), f"max abs diff {(got - expected).abs().max() if got.numel() else 0}"


def padded_input(lengths: list[int], max_len: int, trailing: tuple, dtype, gen) -> torch.Tensor:
    """``[B, max_len, *trailing]`` with random valid rows and poisoned padding."""
    x = torch.full((len(lengths), max_len, *trailing), poison(dtype), dtype=dtype)
    for b, n in enumerate(lengths):
        x[b, :n] = payload((n, *trailing), dtype, gen)
    return x


def some_orders(n: int, gen: torch.Generator) -> dict[str, list[int]]:
    """Readable-id -> order: identity, reversed, a random permutation, a random subset, empty."""
    perm = torch.randperm(n, generator=gen).tolist()
    return {
        "identity": list(range(n)),
        "reversed": list(range(n))[::-1],
        "permutation": perm,
        "subset": perm[: max(1, n // 2)] if n else [],
        "none": [],
    }
