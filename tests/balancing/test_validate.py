"""``balancing.validate.as_nonnegative``: the one reading of time, cost and size arrays."""

from __future__ import annotations

import numpy as np
import pytest

from mmbalance.balancing.validate import as_nonnegative


def test_reads_numbers_as_contiguous_float64():
    a = as_nonnegative([3, 0, 2.5], "x")
    assert a.dtype == np.float64 and a.flags.c_contiguous and a.tolist() == [3.0, 0.0, 2.5]
    m = as_nonnegative(np.arange(6).reshape(2, 3).T, "m", ndim=2)
    assert m.flags.c_contiguous and m.shape == (3, 2)
    assert as_nonnegative([], "x").shape == (0,)
    assert as_nonnegative([1, 2], "x", size=2).tolist() == [1.0, 2.0]


@pytest.mark.parametrize(
    ("x", "kw", "exc", "words"),
    [
        ("abc", {}, TypeError, "costs must be a 1-D array of numbers, got str"),
        ([[1], [2, 3]], {}, TypeError, "costs must be a 1-D array of numbers"),
        ([[1.0]], {}, ValueError, "costs must be 1-D, got shape (1, 1)"),
        (
            [1.0],
            {"ndim": 2, "dims": "[microbatches, stages]"},
            ValueError,
            "costs must be 2-D [microbatches, stages]",
        ),
        ([1.0, 2.0], {"size": 3}, ValueError, "costs must be 1-D with 3 entries, got shape (2,)"),
        ([1.0, -0.5], {}, ValueError, "costs must be finite and >= 0"),
        ([float("nan")], {}, ValueError, "costs must be finite and >= 0"),
        ([float("inf")], {}, ValueError, "costs must be finite and >= 0"),
    ],
    ids=["string", "ragged", "2d", "1d-for-2d", "size", "negative", "nan", "inf"],
)
def test_refuses_naming_the_argument(x, kw, exc, words):
    with pytest.raises(exc) as err:
        as_nonnegative(x, "costs", **kw)
    assert words in str(err.value)
