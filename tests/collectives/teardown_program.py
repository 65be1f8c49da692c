"""Launched by test_teardown.py on 2 CPU ranks (the environment torchrun gives its workers): a DDP
run that ends with a collective of its own, then ``shutdown()``, then the model is freed.

    python tests/collectives/teardown_program.py last-all-reduce|late-peer [--destroy]

``late-peer`` is the order that deadlocked in ``~ProcessGroupGloo``: rank 1 comes to the last
all-reduce late, so rank 0's gloo worker is still inside it while rank 0 ends the run; then rank 0
keeps the GIL (a waiting thread asks for it only after 1000 s) until the worker is done with the
tensor, so the worker owes the release of the tensor's Python reference when DDP's reducer, the
group's last owner, is freed. ``--destroy`` ends with ``dist.destroy_process_group()`` instead of
``shutdown()``: rank 0 then hangs (what the fix is measured against; not run by the tests).

``torch.distributed.nn.functional`` is imported before the group exists, as transformers does: imported
later (DDP imports it), its functions' defaults keep the default group alive for good, and DDP's
reducer is then never the group's last owner.
"""

from __future__ import annotations

import gc
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.distributed.nn.functional  # noqa: F401 - before the group exists, as transformers imports it
from torch.nn.parallel import DistributedDataParallel

from mmbalance.collectives import shutdown


def main(pattern: str, destroy: bool) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(8, 8))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(4, 8)).square().mean().backward()
        opt.step()
    t = torch.ones(1)
    if pattern == "late-peer":
        sys.setswitchinterval(1000)
        dist.barrier()
        if rank == 1:
            time.sleep(2)
        dist.all_reduce(t, async_op=True)  # nobody keeps the work: the gloo worker holds it last
    else:
        dist.all_reduce(t)
    if destroy:
        dist.destroy_process_group()
    else:
        shutdown()
    deadline = time.monotonic() + 30
    while t._use_count() > 1 and time.monotonic() < deadline:  # keeps the GIL
        pass
    print(f"rank {rank} done: sum {float(t[0])}", flush=True)
    del model, opt
    gc.collect()  # frees DDP's reducer, the last owner of the default group


if __name__ == "__main__":
    main(sys.argv[1], "--destroy" in sys.argv[2:])
