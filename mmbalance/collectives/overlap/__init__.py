"""Tensor parallelism with its communication hidden: the sliced all-gather/GEMM overlap.

Read ``plan.py`` (shard layouts, chunk plans and the cost model that picks the chunk count: host
arithmetic, the same on every rank), the transports ``_copy_engine.py`` (the GPUs' copy engines
over CUDA IPC, optional) and ``comm.py`` (torch's collectives, the choice between the two, the
sliced loops), then ``matmul.py`` (``all_gather_matmul`` and ``matmul_reduce_scatter``: agreement
and autograd) and on top ``tp_linear.py`` (the column- and row-parallel linears).
"""

from .matmul import all_gather_matmul, matmul_reduce_scatter
from .tp_linear import ColumnParallelLinear, RowParallelLinear

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "all_gather_matmul", "matmul_reduce_scatter"]
