"""The kernels' machine code: ``python -m mmbalance.bench.kernel_audit --arch sm_90`` (or ``sm_80``).

Read ``variants.py`` (every kernel variant to compile, with the launch configuration its launcher
picks on the audited architecture) and ``audit.py`` (the compile without a GPU, the audit of the
PTX and cubin against each entry's expectations, and the command). Other benchmarks audit launch
configurations of their own through ``attention_entry`` and ``audit_all`` (importing this face loads
no kernel: ``main`` must clear ``TRITON_INTERPRET`` first).
"""

from .audit import attention_entry, audit_all, main, parse_arch, ptxas_path

__all__ = ["attention_entry", "audit_all", "main", "parse_arch", "ptxas_path"]
