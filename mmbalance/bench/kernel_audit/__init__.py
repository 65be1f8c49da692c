"""The kernels' machine code: ``python -m mmbalance.bench.kernel_audit --arch sm_90`` (or ``sm_80``).

Read ``variants.py`` (every kernel variant to compile, with the launch configuration its launcher
picks on the audited architecture) and ``audit.py`` (the compile without a GPU, the audit of the
PTX and cubin against each entry's expectations, and the command).
"""

from .audit import main

__all__ = ["main"]
