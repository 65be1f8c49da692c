"""The release rule of :mod:`mmbalance.collectives.inflight`: a call returns only once the backend
has given back both its C++ references to the call's tensors and the Python reference those tensors
hold while it has them (returned on the backend's thread, under the GIL, after the C++ count fell:
an interpreter that finalizes in between aborts)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from mmbalance.collectives import inflight
from tests.dist_utils import run_distributed


def test_an_alias_is_free_once_only_the_flight_holds_it():
    flight = inflight.Inflight()
    alias = flight.alias(torch.zeros(4))
    assert inflight._held_elsewhere(flight._aliases)  # the caller's variable still holds it
    del alias
    assert not inflight._held_elsewhere(flight._aliases)


def test_a_late_python_reference_keeps_the_call_waiting():
    # A backend thread that still owes a Python reference (as a tensor does between its C++
    # release and the return of its Python reference) holds the call until it is returned.
    flight = inflight.Inflight()
    late = [flight.alias(torch.zeros(4))]
    released = []

    def give_back():
        time.sleep(0.2)
        released.append(time.monotonic())
        late.clear()

    t = threading.Thread(target=give_back)
    t.start()
    flight.wait()
    done = time.monotonic()
    t.join(timeout=10)
    assert not t.is_alive()
    assert released and done >= released[0]
    assert not inflight._PARKED


def _many_calls(rank: int, world: int) -> int:
    import torch.distributed as dist

    x = torch.arange(8, dtype=torch.float32) + rank
    out = torch.empty(8)
    for _ in range(50):
        inflight.run(dist.all_to_all_single, out, x)
    return len(inflight._PARKED)


@pytest.mark.distributed
def test_calls_on_gloo_never_park():
    # a release that waited for a reference nobody returns would park the aliases after seconds
    assert run_distributed(_many_calls, 2) == [0, 0]
