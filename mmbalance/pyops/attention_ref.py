"""Torch implementations of the attention block ops (the CPU path); their input validation is in
``attention_checks.py``, the ops themselves in ``attention_ops.py``.

These are the CPU path of ``torch.ops.mmbalance.attention_block_fwd``, ``attention_block_bwd`` and
``merge_attention_states`` (the path for float64 on any device too), with the masking, empty-row,
GQA, window, softcap and sink semantics of the Triton kernels documented in
``kernels/attention_fwd.py`` and ``pyops/attention_ops.py``.

The block ops are blockwise, like FlashAttention-2 (Dao, 2023) in torch: per sequence, a block of
queries (all query heads of a kv head together, one batched product per kv head) meets the
blocks of keys its mask can reach, with the online softmax in the forward and the probabilities
recomputed from the LSE in the backward; blocks that lie wholly inside the mask need no
elementwise mask, blocks wholly outside are never computed. Memory stays O(tokens + threads *
block^2 * heads), never a sequence's whole score matrix; accumulation is float32 (float64 for
float64 inputs). Query blocks run on parallel threads of single-threaded torch ops (see
``_parallel`` for why).
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import math
import threading

import torch


def acc_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """float64 when any input is float64, float32 otherwise."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def run_positions(length: int, runs_row: list[int] | None, default_start: int) -> torch.Tensor:
    """Absolute positions of a sequence's tokens: one run at ``default_start`` or two runs."""
    t = torch.arange(length)
    if runs_row is None:
        return t + default_start
    start0, len0, start1 = runs_row
    return torch.where(t < len0, start0 + t, start1 + (t - len0))


# ----------------------------------------------------------------------------- blockwise CPU path
# Query rows and keys per block of the blockwise path; module attributes read at every call, so a
# test can make them tiny to exercise the multi-block code at small shapes.
BLOCK_Q = 256
BLOCK_K = 512


@dataclasses.dataclass(frozen=True)
class _Mask:
    """Which keys a query may see, from absolute positions (``attention_block``'s semantics)."""

    causal: bool
    window_left: int
    window_right: int

    def key_range(self, kpos: list[int], q_first: int, q_last: int) -> tuple[int, int]:
        """Keys ``[lo, hi)`` that some query with a position in ``[q_first, q_last]`` may see
        (positions increase along a sequence, so this is a bisection)."""
        lo = 0 if self.window_left < 0 else bisect.bisect_left(kpos, q_first - self.window_left)
        hi = len(kpos)
        if self.causal:
            hi = bisect.bisect_right(kpos, q_last)
        if self.window_right >= 0:
            hi = min(hi, bisect.bisect_right(kpos, q_last + self.window_right))
        return lo, max(lo, hi)

    def all_allowed(self, q_first: int, q_last: int, k_first: int, k_last: int) -> bool:
        """Whether every (query, key) pair of the two position ranges is allowed (no mask needed)."""
        if self.causal and k_last > q_first:
            return False
        if self.window_left >= 0 and k_first < q_last - self.window_left:
            return False
        return not (self.window_right >= 0 and k_last > q_first + self.window_right)

    def blocked(self, qpos: torch.Tensor, kpos: torch.Tensor) -> torch.Tensor:
        """Elementwise mask ``[len(qpos), len(kpos)]``, True where the key is NOT allowed."""
        d = kpos[None, :] - qpos[:, None]
        out = torch.zeros(d.shape, dtype=torch.bool, device=d.device)
        if self.causal:
            out |= d > 0
        if self.window_left >= 0:
            out |= d < -self.window_left
        if self.window_right >= 0:
            out |= d > self.window_right
        return out


class _Blocks:
    """One sequence cut into query blocks (rows of all heads of a kv group) and key blocks on a
    fixed grid, with the masks of the pairs that straddle the mask's edge (cached by relative
    position when both blocks are contiguous runs, as they are for one causal diagonal)."""

    def __init__(self, qpos: list[int], kpos: list[int], mask: _Mask, bq: int, bk: int, device) -> None:
        self.qpos, self.kpos, self.mask, self.bq, self.bk, self.device = qpos, kpos, mask, bq, bk, device
        self._cache: dict[tuple[int, int, int], torch.Tensor] = {}

    def q_blocks(self):
        for i0 in range(0, len(self.qpos), self.bq):
            yield i0, min(i0 + self.bq, len(self.qpos))

    def k_blocks(self, i0: int, i1: int):
        """Key blocks ``(index, j0, j1, blocked mask or None)`` that queries ``[i0, i1)`` may see."""
        lo, hi = self.mask.key_range(self.kpos, self.qpos[i0], self.qpos[i1 - 1])
        if lo == hi:
            return
        q_first, q_last = self.qpos[i0], self.qpos[i1 - 1]
        for jb in range(lo // self.bk, (hi - 1) // self.bk + 1):
            j0, j1 = jb * self.bk, min((jb + 1) * self.bk, len(self.kpos))
            k_first, k_last = self.kpos[j0], self.kpos[j1 - 1]
            if self.mask.all_allowed(q_first, q_last, k_first, k_last):
                yield jb, j0, j1, None
                continue
            runs = q_last - q_first == i1 - i0 - 1 and k_last - k_first == j1 - j0 - 1
            key = (k_first - q_first, i1 - i0, j1 - j0)
            blocked = self._cache.get(key) if runs else None
            if blocked is None:
                blocked = self.mask.blocked(
                    torch.tensor(self.qpos[i0:i1], device=self.device),
                    torch.tensor(self.kpos[j0:j1], device=self.device),
                )[:, None, :]
                if runs:
                    self._cache[key] = blocked
            yield jb, j0, j1, blocked


def _new_output(shape: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Allocation of every output of the blockwise path (one place, so tests can poison it)."""
    return torch.empty(shape, dtype=dtype, device=device)


def _sequences(cu_seqlens_q, cu_seqlens_k, causal_offset, q_runs, k_runs, with_empty=False):
    """``(qs, qe, ks, ke, qpos, kpos)`` of every sequence with queries, or of every sequence with
    ``with_empty`` (positions as lists)."""
    cu_q, cu_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    qr = None if q_runs is None else q_runs.tolist()
    kr = None if k_runs is None else k_runs.tolist()
    for b in range(len(cu_q) - 1):
        qs, qe, ks, ke = cu_q[b], cu_q[b + 1], cu_k[b], cu_k[b + 1]
        if qe == qs and not with_empty:
            continue
        qpos = run_positions(qe - qs, None if qr is None else qr[b], causal_offset).tolist()
        kpos = run_positions(ke - ks, None if kr is None else kr[b], 0).tolist()
        yield qs, qe, ks, ke, qpos, kpos


def _grouped(x: torch.Tensor, n_kv: int, acc: torch.dtype) -> torch.Tensor:
    """``[L, H, D]`` -> ``[Hkv, L * group, D]`` (rows ordered (token, head in group)) in ``acc``,
    so a query block of every kv head's group is one batched matrix: a strided view without GQA
    (``H == Hkv``) in ``acc`` already, one copy otherwise."""
    length, n_heads, head_dim = x.shape
    group = n_heads // n_kv
    if group == 1 and x.dtype == acc:
        return x.permute(1, 0, 2)
    y = torch.empty((n_kv, length, group, head_dim), dtype=acc, device=x.device)
    y.copy_(x.view(length, n_kv, group, head_dim).permute(1, 0, 2, 3))
    return y.view(n_kv, length * group, head_dim)


def _key_blocks(x: torch.Tensor, bk: int, acc: torch.dtype, ones: bool = False) -> list[torch.Tensor]:
    """``[L, Hkv, D]`` -> ``[Hkv, bk, D]`` blocks in ``acc``: strided views when already in ``acc``
    (they are only read by the products), contiguous copies otherwise; ``ones`` appends a column
    of ones (a copy), so the product ``p @ [v, 1]`` also gives the row sums of ``p``."""
    blocks = []
    for j0 in range(0, x.shape[0], bk):
        xb = x[j0 : j0 + bk].permute(1, 0, 2)
        n, length, head_dim = xb.shape
        if ones:
            blk = torch.ones((n, length, head_dim + 1), dtype=acc, device=x.device)
            blk[..., :-1] = xb
        elif x.dtype == acc:
            blk = xb
        else:
            blk = torch.empty((n, length, head_dim), dtype=acc, device=x.device).copy_(xb)
        blocks.append(blk)
    return blocks


def _row_dots(a: torch.Tensor, b: torch.Tensor, acc: torch.dtype, chunk: int = 4096) -> torch.Tensor:
    """``rowsum(a * b)`` of two ``[T, H, D]`` tensors as ``[H, T]`` in ``acc``, a chunk of tokens at a
    time (no temporary of the inputs' size)."""
    out = torch.empty((a.shape[1], a.shape[0]), dtype=acc, device=a.device)
    for t0 in range(0, a.shape[0], chunk):
        out[:, t0 : t0 + chunk] = (a[t0 : t0 + chunk].to(acc) * b[t0 : t0 + chunk].to(acc)).sum(-1).t()
    return out


def _rows(t: torch.Tensor, n_kv: int) -> torch.Tensor:
    """``[H, L]`` (per-head row statistics) -> ``[Hkv, L * group]`` in the grouped row order."""
    n_heads, length = t.shape
    return t.view(n_kv, n_heads // n_kv, length).transpose(1, 2).reshape(n_kv, length * (n_heads // n_kv))


@contextlib.contextmanager
def _single_threaded_ops(device: torch.device):
    """Run the block path with single-threaded torch ops in the calling thread; yields how many
    threads ``_parallel`` may use (the thread count, restored afterwards; 1 off the CPU).

    Coarse-grained parallelism over blocks rather than every op's own OpenMP region: on a few
    shared cores a thread team per small op waits at each op's barrier for a thread the OS has
    descheduled, which made the blockwise path several times slower than on a quiet machine, and
    a small batch spent most of its time in such barriers.
    """
    if device.type != "cpu":
        yield 1
        return
    n_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        # the path sets its own precision (float32 or float64 accumulation), in every thread alike
        with torch.autocast("cpu", enabled=False):
            yield n_threads
    finally:
        torch.set_num_threads(n_threads)


def _parallel(tasks: list, run, workers: int) -> None:
    """Run ``run(worker, task)`` for every task on up to ``workers`` Python threads (the calling
    one included), each doing single-threaded torch ops (inside ``_single_threaded_ops``).

    Torch ops release the GIL, so the threads really run side by side. Tasks must write disjoint
    outputs (or lock what they share).
    """
    workers = min(workers, len(tasks))
    if workers <= 1:
        for task in tasks:
            run(0, task)
        return
    lock = threading.Lock()
    todo = iter(tasks)
    errors: list[BaseException] = []
    # new threads start without the caller's thread-local modes: carry inference mode over (the
    # outputs are inference tensors then, which only inference mode may write)
    inference = torch.is_inference_mode_enabled()

    def work(worker: int) -> None:
        torch.set_num_threads(1)
        try:
            # new threads do not inherit the op's below-autograd dispatch state: record no graph
            with torch.inference_mode(inference), torch.no_grad():
                while not errors:
                    with lock:
                        task = next(todo, None)
                    if task is None:
                        return
                    run(worker, task)
        except BaseException as e:  # re-raised in the calling thread
            errors.append(e)

    threads = [threading.Thread(target=work, args=(w,), daemon=True) for w in range(1, workers)]
    for t in threads:
        t.start()
    work(0)
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


class _Scratch:
    """Per-thread buffers for the score-sized temporaries of the block loop, allocated by the
    calling thread and reused across blocks: a fresh multi-MiB tensor per block pair, allocated
    in a worker thread's own heap, fragments it and grows the process's resident memory far
    beyond what is live."""

    def __init__(
        self, seqs: list, heads: int, bq: int, bk: int, names: tuple[str, ...], workers: int, dtype, device
    ) -> None:
        longest_q = max((s.qe - s.qs for s in seqs), default=0)
        longest_k = max((s.ke - s.ks for s in seqs), default=0)
        numel = heads * min(bq, longest_q) * min(bk, longest_k)
        self.buffers = {
            (worker, name): torch.empty(numel, dtype=dtype, device=device)
            for worker in range(workers)
            for name in names
        }

    def get(self, worker: int, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """A contiguous ``shape`` view of this thread's buffer ``name`` (contents undefined)."""
        return self.buffers[worker, name][: math.prod(shape)].view(shape)


@dataclasses.dataclass
class _Seq:
    """One sequence prepared for the blockwise path."""

    qs: int
    qe: int
    ks: int
    ke: int
    blocks: _Blocks
    q_g: torch.Tensor
    k_b: list[torch.Tensor]
    v_b: list[torch.Tensor]
    do_g: torch.Tensor | None = None


def attention_block_fwd_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    softmax_scale: float,
    causal: bool,
    causal_offset: int = 0,
    q_runs: torch.Tensor | None = None,
    k_runs: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    window_left: int = -1,
    window_right: int = -1,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
    block_q: int | None = None,
    block_k: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Blockwise forward: ``out [Tq, H, D]`` (``out_dtype``, default q's) and ``lse [H, Tq]``.

    Flash-attention's online softmax in torch: per sequence, blocks of ``block_q`` queries (all
    heads of a kv group together, one batched product per kv head) against blocks of ``block_k``
    keys, only the key blocks the mask leaves visible, elementwise masks only on the blocks that
    straddle the mask's edge; query blocks run in parallel (``_parallel``). Memory is
    O(tokens + threads * block_q * block_k * H), never a sequence's whole score matrix.
    Accumulates in float32 (float64 for float64 inputs); ``lse`` is in that dtype. Rows without an
    allowed key get ``out = 0`` and ``lse = -inf`` (``sinks[h]`` with sinks).
    """
    with _single_threaded_ops(q.device) as workers:
        return _fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal, causal_offset, q_runs, k_runs,
                    out_dtype, window_left, window_right, softcap, sinks, block_q or BLOCK_Q, block_k or BLOCK_K,
                    workers)  # fmt: skip


def _fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal, causal_offset, q_runs, k_runs, out_dtype,
         window_left, window_right, softcap, sinks, bq, bk, workers):  # fmt: skip
    acc = acc_dtype(q)
    tq, n_heads, head_dim = q.shape
    n_kv = k.shape[1]
    group = n_heads // n_kv
    mask = _Mask(bool(causal), window_left, window_right)
    # every row of a sequence with queries is written by exactly one query-block task
    out = _new_output((tq, n_heads, head_dim), out_dtype or q.dtype, q.device)
    lse = _new_output((n_heads, tq), acc, q.device)
    # pre * q . k are the logits (the logits / softcap when capping): pre is the products' alpha
    pre = softmax_scale / softcap if softcap > 0 else softmax_scale
    zero = torch.zeros((1, 1, 1), dtype=acc, device=q.device)
    # the running maximum starts at the lowest finite value rather than -inf: a row whose keys are
    # all masked so far then needs no special case (exp(-inf - lowest) = 0, exp(0) = 1)
    lowest = torch.finfo(acc).min
    sink_rows = None if sinks is None else sinks.to(acc).view(n_kv, 1, group)
    seqs = []
    for qs, qe, ks, ke, qpos, kpos in _sequences(cu_seqlens_q, cu_seqlens_k, causal_offset, q_runs, k_runs):
        seqs.append(_Seq(qs, qe, ks, ke, _Blocks(qpos, kpos, mask, bq, bk, q.device),
                         _grouped(q[qs:qe], n_kv, acc), _key_blocks(k[ks:ke], bk, acc),
                         _key_blocks(v[ks:ke], bk, acc, ones=True)))  # fmt: skip

    scratch = _Scratch(seqs, n_heads, bq, bk, ("s",), workers, acc, q.device)

    def run(worker: int, task: tuple[_Seq, int, int]) -> None:
        seq, i0, i1 = task
        rows = (i1 - i0) * group
        qb = seq.q_g[:, i0 * group : i1 * group]
        m = torch.full((n_kv, rows), lowest, dtype=acc, device=q.device)
        # o[..., :D] = sum_j exp(s_j - m) v_j and o[..., D] = sum_j exp(s_j - m)
        o = torch.zeros((n_kv, rows, head_dim + 1), dtype=acc, device=q.device)
        for jb, _, _, blocked in seq.blocks.k_blocks(i0, i1):
            kb = seq.k_b[jb]
            s = scratch.get(worker, "s", (n_kv, rows, kb.shape[1]))
            torch.baddbmm(zero, qb, kb.transpose(1, 2), beta=0.0, alpha=pre, out=s)
            if softcap > 0:
                s.tanh_().mul_(softcap)
            if blocked is not None:
                s.view(n_kv, i1 - i0, group, -1).masked_fill_(blocked, -math.inf)
            m_new = torch.maximum(m, s.amax(-1))
            alpha = m.sub_(m_new).exp_()
            p = s.sub_(m_new[..., None]).exp_()
            o.mul_(alpha[..., None]).baddbmm_(p, seq.v_b[jb])
            m = m_new
        lse_b = m + torch.log(o[..., head_dim])
        if sink_rows is not None:
            lse_b = torch.logaddexp(lse_b.view(n_kv, i1 - i0, group), sink_rows).view(n_kv, rows)
        factor = torch.where(lse_b == -math.inf, 0.0, torch.exp(m - lse_b))
        lq = seq.qe - seq.qs
        out_g = out[seq.qs : seq.qe].view(lq, n_kv, group, head_dim).permute(1, 0, 2, 3)
        out_g[:, i0:i1] = (o[..., :head_dim] * factor[..., None]).view(n_kv, i1 - i0, group, head_dim)
        lse[:, seq.qs + i0 : seq.qs + i1] = (
            lse_b.view(n_kv, i1 - i0, group).permute(0, 2, 1).reshape(n_heads, i1 - i0)
        )

    _parallel([(seq, i0, i1) for seq in seqs for i0, i1 in seq.blocks.q_blocks()], run, workers)
    return out, lse


def attention_block_bwd_ref(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    softmax_scale: float,
    causal: bool,
    causal_offset: int = 0,
    q_runs: torch.Tensor | None = None,
    k_runs: torch.Tensor | None = None,
    dlse: torch.Tensor | None = None,
    window_left: int = -1,
    window_right: int = -1,
    softcap: float = 0.0,
    block_q: int | None = None,
    block_k: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Blockwise backward from the saved ``out``/``lse`` (FlashAttention-2's backward in torch):
    ``dq``, ``dk``, ``dv`` in float32 (float64 for float64 ``q``); computed in float64 if any input
    is. Probabilities are recomputed block by block from ``lse`` (sinks need nothing here: they
    are inside ``lse``); ``ds = p * (dout v^T - D)`` with ``D_i = rowsum(dout_i * out_i) - dlse_i``.

    ``lse`` may be a merged LSE over more keys than this block holds (a ring); ``dlse`` is the
    gradient reaching ``lse``, if any. Query blocks run in parallel, each thread accumulating
    ``dk``/``dv`` of its own (summed at the end); memory as in the forward plus one ``dk``/``dv``
    per thread.
    """
    with _single_threaded_ops(q.device) as workers:
        return _bwd(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal, causal_offset,
                    q_runs, k_runs, dlse, window_left, window_right, softcap, block_q or BLOCK_Q,
                    block_k or BLOCK_K, workers)  # fmt: skip


def _bwd(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal, causal_offset, q_runs,
         k_runs, dlse, window_left, window_right, softcap, bq, bk, workers):  # fmt: skip
    acc = acc_dtype(q, lse)
    grad_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    tq, n_heads, head_dim = q.shape
    tk, n_kv = k.shape[0], k.shape[1]
    group = n_heads // n_kv
    mask = _Mask(bool(causal), window_left, window_right)
    neg_delta = _row_dots(dout, out, acc).neg_()
    if dlse is not None:
        neg_delta += dlse.to(acc)
    # rows with no key (lse = -inf) get p = exp(s - inf) = 0
    lse_acc = lse.to(acc)
    neg_lse = -torch.where(lse_acc == -math.inf, math.inf, lse_acc)
    # The products x = pre * q . k are the logits (/ softcap when capping), pre applied as the
    # products' alpha. With g = dL/dx (ds, or ds * softcap * (1 - tanh^2) when capping):
    # dq = pre g k and dk = pre g^T q. The loop accumulates ds' = ds (* (1 - tanh^2)) and applies
    # the constant factors in the products' alpha or once at the end.
    pre = softmax_scale / softcap if softcap > 0 else softmax_scale
    dq_alpha = softmax_scale
    dq = _new_output((tq, n_heads, head_dim), grad_dtype, q.device)
    seqs, empty = [], []
    for qs, qe, ks, ke, qpos, kpos in _sequences(
        cu_seqlens_q, cu_seqlens_k, causal_offset, q_runs, k_runs, with_empty=True
    ):
        if ke == ks or qe == qs:
            dq[qs:qe] = 0.0
            empty.append((ks, ke))
            continue
        seqs.append(_Seq(qs, qe, ks, ke, _Blocks(qpos, kpos, mask, bq, bk, q.device),
                         _grouped(q[qs:qe], n_kv, acc), _key_blocks(k[ks:ke], bk, acc),
                         _key_blocks(v[ks:ke], bk, acc), _grouped(dout[qs:qe], n_kv, acc)))  # fmt: skip
    # one dk and one dv accumulator per key block, contiguous (the in-place batched products into
    # them take BLAS's fast path), each behind a lock: threads work on different query blocks and
    # walk the key blocks in opposite directions, so they rarely wait for one another
    dk_acc = [
        [torch.zeros((n_kv, kb.shape[1], head_dim), dtype=acc, device=q.device) for kb in s.k_b] for s in seqs
    ]
    dv_acc = [
        [torch.zeros((n_kv, kb.shape[1], head_dim), dtype=acc, device=q.device) for kb in s.k_b] for s in seqs
    ]
    locks = [[threading.Lock() for _ in s.k_b] for s in seqs]

    names = ("s", "ds", "t") if softcap > 0 else ("s", "ds")
    scratch = _Scratch(seqs, n_heads, bq, bk, names, workers, acc, q.device)

    def run(worker: int, task: tuple[int, int, int]) -> None:
        index, i0, i1 = task
        seq = seqs[index]
        r0, r1 = i0 * group, i1 * group
        assert seq.do_g is not None
        qb, dob = seq.q_g[:, r0:r1], seq.do_g[:, r0:r1]
        nl = _rows(neg_lse[:, seq.qs + i0 : seq.qs + i1], n_kv)[..., None]
        nd = _rows(neg_delta[:, seq.qs + i0 : seq.qs + i1], n_kv)[..., None]
        dq_b = torch.zeros((n_kv, r1 - r0, head_dim), dtype=acc, device=q.device)
        pairs = list(seq.blocks.k_blocks(i0, i1))
        for jb, _, _, blocked in reversed(pairs) if worker % 2 else pairs:
            kb, vb = seq.k_b[jb], seq.v_b[jb]
            shape = (n_kv, r1 - r0, kb.shape[1])
            s = scratch.get(worker, "s", shape)
            t = None
            if softcap > 0:
                t = scratch.get(worker, "t", shape)
                torch.baddbmm(nl, qb, kb.transpose(1, 2), beta=0.0, alpha=pre, out=t).tanh_()
                torch.add(nl, t, alpha=softcap, out=s)
            else:
                torch.baddbmm(nl, qb, kb.transpose(1, 2), alpha=pre, out=s)
            if blocked is not None:
                s.view(n_kv, i1 - i0, group, -1).masked_fill_(blocked, -math.inf)
            p = s.exp_()
            ds = torch.baddbmm(nd, dob, vb.transpose(1, 2), out=scratch.get(worker, "ds", shape)).mul_(p)
            if t is not None:
                ds.mul_(t.square_().neg_().add_(1.0))
            dq_b.baddbmm_(ds, kb, alpha=dq_alpha)
            with locks[index][jb]:
                dv_acc[index][jb].baddbmm_(p.transpose(1, 2), dob)
                dk_acc[index][jb].baddbmm_(ds.transpose(1, 2), qb)
        lq = seq.qe - seq.qs
        dq_g = dq[seq.qs : seq.qe].view(lq, n_kv, group, head_dim).permute(1, 0, 2, 3)
        dq_g[:, i0:i1] = dq_b.view(n_kv, i1 - i0, group, head_dim)

    tasks = [(index, i0, i1) for index, seq in enumerate(seqs) for i0, i1 in seq.blocks.q_blocks()]
    _parallel(tasks, run, workers)
    seq_starts = [seq.ks for seq in seqs]
    del seqs[:]  # copies of q, k, v and dout (GQA, other dtypes) go before dk and dv are allocated
    dk = _new_output((tk, n_kv, head_dim), grad_dtype, q.device)
    dv = _new_output((tk, n_kv, head_dim), grad_dtype, q.device)
    for ks, ke in empty:
        dk[ks:ke] = 0.0
        dv[ks:ke] = 0.0
    for index, ks in enumerate(seq_starts):
        dk_blocks, dv_blocks = dk_acc[index], dv_acc[index]
        for jb in range(len(dk_blocks)):
            j0, j1 = ks + jb * bk, ks + jb * bk + dk_blocks[jb].shape[1]
            dk[j0:j1] = dk_blocks[jb].transpose(0, 1).mul_(softmax_scale)
            dv[j0:j1] = dv_blocks[jb].transpose(0, 1)
            # an empty placeholder frees the block now rather than with the whole list
            dk_blocks[jb] = dv_blocks[jb] = dk_blocks[jb].new_empty(0)
    return dq, dk, dv


def sinks_grad(
    sinks: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dout: torch.Tensor | None,
    dlse: torch.Tensor | None,
) -> torch.Tensor:
    """Gradient of the loss in the per-head sink logits (``[H]``, in ``sinks``' dtype).

    The sink joins every row's softmax denominator, so ``d lse_hi / d sink_h = exp(sink_h - lse_hi)``
    and ``d out_hi / d sink_h = -exp(sink_h - lse_hi) out_hi``:
    ``d sink_h = sum_i exp(sink_h - lse_hi) * (dlse_hi - rowsum(dout_hi * out_hi))``.
    """
    acc = acc_dtype(out, lse)
    g = torch.zeros(lse.shape, dtype=acc, device=lse.device)
    if dout is not None:
        g = g - (dout.to(acc) * out.to(acc)).sum(-1).transpose(0, 1)
    if dlse is not None:
        g = g + dlse.to(acc)
    w = torch.exp(sinks.to(acc)[:, None] - lse.to(acc))
    return (w * g).sum(1).to(sinks.dtype)


def merge_weights(
    lse_a: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Merged ``lse`` and the normalised weights ``exp(lse_a - lse)``, ``exp(lse_b - lse)`` ([H, T])."""
    m = torch.maximum(lse_a, lse_b)
    m = torch.where(m == -math.inf, 0.0, m)
    w_a = torch.exp(lse_a - m)
    w_b = torch.exp(lse_b - m)
    total = w_a + w_b
    empty = total == 0
    safe = torch.where(empty, 1.0, total)
    lse = torch.where(empty, -math.inf, m + torch.log(safe))
    return lse, w_a / safe, w_b / safe


def merge_attention_states_ref(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference merge: float32 (float64 if any input is) ``out [T, H, D]`` and ``lse [H, T]``."""
    acc = acc_dtype(out_a, out_b, lse_a, lse_b)
    lse, w_a, w_b = merge_weights(lse_a.to(acc), lse_b.to(acc))
    out = out_a.to(acc) * w_a.t()[..., None] + out_b.to(acc) * w_b.t()[..., None]
    return out, lse
