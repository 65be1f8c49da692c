"""Triton kernels and their launchers (``mmbalance.kernels``).

Each module holds only ``@triton.jit`` kernels and the launchers that size their grids. Launchers
accept CUDA tensors, and CPU tensors when ``TRITON_INTERPRET=1`` is set before the first kernel
module is imported.
"""
