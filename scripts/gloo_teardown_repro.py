"""The gloo teardown hang in torch (pytorch#56297 class), in a few lines, and its workaround.

    torchrun --standalone --nproc-per-node 2 scripts/gloo_teardown_repro.py [shutdown]

A DDP run that ends with a collective of its own, then destroys the process group and frees the
model: some launches never end. gloo's worker thread gives the last all-reduce's tensor back a
moment after ``all_reduce`` returned, and that needs the GIL; freeing DDP's reducer, the group's last
owner, runs ``~ProcessGroupGloo``, which joins the worker threads while holding the GIL. With
``shutdown`` the run ends with ``mmbalance.collectives.shutdown()`` instead, and every launch ends
(a word, not an option: torchrun would take ``--shutdown`` for its own ``--shutdown-timeout``).

``torch.distributed.nn.functional`` is imported before the group exists, as transformers does:
imported later (DDP imports it), the default arguments of its functions keep the default group
alive for good, so the reducer is never its last owner and plain scripts do not show the hang.
"""

import sys

import torch
import torch.distributed as dist
import torch.distributed.nn.functional  # noqa: F401
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("gloo")
model = DDP(torch.nn.Linear(4, 4))
model(torch.randn(2, 4)).sum().backward()
t = torch.ones(1)
dist.all_reduce(t)  # the program's last collective
if "shutdown" in sys.argv[1:]:
    from mmbalance.collectives import shutdown

    shutdown()  # the workaround: in place of destroy_process_group()
else:
    dist.destroy_process_group()  # the group lives on in DDP's reducer
del model  # frees the reducer: ~ProcessGroupGloo joins gloo's workers with the GIL held
print("ended", flush=True)
