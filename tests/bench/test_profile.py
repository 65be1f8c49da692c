"""``bench.profile``: a module timed over lengths, and the cost model fitted to the timings."""

from __future__ import annotations

import numpy as np
import pytest

from mmbalance.balancing import CostModel


def test_profile_measures_a_module_and_fits():
    torch = pytest.importorskip("torch")
    from mmbalance.bench.profile import profile

    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(d_model=32, nhead=2, dim_feedforward=64, batch_first=True)
    meas = profile(layer, lengths=(16, 32, 64, 128, 256), warmup=1, repeats=2)
    assert [m.lengths for m in meas] == [(16,), (32,), (64,), (128,), (256,)]
    assert all(m.degree == 1 and m.seconds > 0 for m in meas)
    fit = CostModel.fit(meas)
    assert fit.fit_report.count == 5 and np.isfinite(fit.fit_report.mean_error)


def test_profile_errors():
    torch = pytest.importorskip("torch")
    from mmbalance.bench.profile import profile

    with pytest.raises(ValueError, match="hidden_size"):
        profile(lambda x: x, lengths=(4,))
    with pytest.raises(ValueError, match="positive"):
        profile(torch.nn.Linear(4, 4), lengths=(0,))
