"""The tile sweep of the Triton attention kernels: every candidate tiling per shape, audited, checked, timed.

    python -m mmbalance.bench.attention.tiles [--device cuda|cpu] [--shapes NAME ...] [--audit-only]
        [--arch sm_90] [--jobs N] [--warm-jobs N] [--budget-s S] [--limit N] [--json FILE]

The Triton kernels run whatever ``torch_flash`` cannot (softcap, sinks, position runs, LSE
gradients, float32, ring blocks that need them); their tiles come from one table
(``kernels/attention_common.py``: ``fwd_config``, ``bwd_config``). This command measures that table
against the alternatives on a GPU, per shape (``SHAPES``, in this order: head dim 128 on 8 x 2048
tokens causal and full, head dim 64 on 32 x 512 causal, then head dim 128 causal with a softcap of
50 and with sinks):

1. candidates: the table's choice first, then a grid of tiles, warps and pipeline depths for the
   forward kernel, the dq pass and the dk/dv pass (``fwd_candidates``, ``bwd_candidates``). The
   passes are separate kernels, so each is swept with the other at the table's choice;
2. audit: each candidate compiled for ``--arch`` (the device's own on a GPU) by the kernel audit in
   ``--jobs`` processes; one that spills, or runs 16-bit inputs without tensor-core instructions, is
   dropped (status ``audit: ...``). The table's choice is kept whatever its audit says;
3. check (outputs poisoned with NaN first): each survivor runs once and is compared with the torch
   reference (``pyops/attention_ref.py``, float32, from the same inputs): an error relative to the
   largest reference value over twice the table's plus one unit of the input's precision, or over
   ``TABLE_TOLERANCE``, is dropped (``accepted``); then row by row with the table's own result
   (``row_error``: each row against its own size, so an error confined to a few rows is not
   diluted), over ``CONSISTENCY_TOLERANCE`` is dropped (status ``check: ...``);
4. time: the median of ``triton.testing.do_bench``; each pass's table and three fastest are timed
   twice more, interleaved, and keep the median of their three times (``retimed``). Rows
   ``tiles_fwd``, ``tiles_bwd_dq`` and ``tiles_bwd_kv`` (provider ``table`` or ``candidate``) carry
   TFLOP/s (FLOPs as ``bench attention`` counts them: ``4 * pairs * H * D`` forward, 2.5x that
   backward; a backward row times the whole backward, the preprocess and both passes, with its
   pass's candidate), the tiles, registers and ``vs_table`` (the table's time over this one's). Then
   per shape the fastest of each pass together, ``tiles_fwd_bwd`` with provider ``best``, beside
   the table's choice (``table``) and SDPA's forward + backward (``torch_sdpa``, on the shapes it
   can run): ``vs_sdpa``, and on the softcap and sinks shapes ``vs_plain`` (the plain causal
   shape's time over this one's, provider by provider).

On CUDA, before a shape is timed, ``--warm-jobs`` spawned processes (default up to 8) launch each
surviving candidate once on the same inputs, the tables first, so Triton's compiles run in parallel
and the timing process finds them in its cache; a candidate that fails there fails, and a worker
left unusable by a device error exits (its pool is rebuilt once). ``--budget-s`` bounds the run: no
candidate starts after it (status ``budget``; the tables still run) and no shape starts after it
(named at the end); rows are appended to ``--json`` shape by shape, so a run cut short keeps what
it measured. The summary at the end prints each shape's winners as table entries.

``--audit-only`` needs no GPU: steps 1 and 2 for ``--arch``. ``--device cpu`` runs the same steps
1, 3 and 4 under Triton's interpreter (set here when it is not) on the small ``smoke-*`` shapes in
float32, with the interpreter's tiles; its times are the interpreter's, not a GPU's.
Read ``shapes.py`` (the shapes and candidates), ``check.py`` (inputs, reference and the checks),
``warm.py`` (the parallel warm-up), ``sweep.py`` (one shape's sweep and its rows) and
``command.py`` (the command).
"""

from .check import CONSISTENCY_TOLERANCE, TABLE_TOLERANCE, Case, accepted, make_case, row_error, table_config
from .command import main
from .shapes import FWD_KEYS, PASS_KEYS, SHAPES, TileShape, bwd_candidates, distinct_tiles, fwd_candidates
from .sweep import sweep_shape
from .warm import Warmer

__all__ = [
    "CONSISTENCY_TOLERANCE",
    "FWD_KEYS",
    "PASS_KEYS",
    "SHAPES",
    "TABLE_TOLERANCE",
    "Case",
    "TileShape",
    "Warmer",
    "accepted",
    "bwd_candidates",
    "distinct_tiles",
    "fwd_candidates",
    "main",
    "make_case",
    "row_error",
    "sweep_shape",
    "table_config",
]
