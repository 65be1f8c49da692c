"""Cost models of one group of packed sequences, and their fitting from measured timings.

One form covers the papers' models (numpy only):

    time(G, d) = fixed + linear * S1 / d + combine(attention * (1 + eta) * S2 / d,
                                                   ring * S1 * (d - 1) / d + ring_latency * (d - 1))

for a group ``G`` of sequences with ``S1 = sum l`` and ``S2 = sum l^2`` on ``d`` context-parallel
ranks. ``combine`` is ``max`` when ring attention hides its communication under the attention
compute (DHP eq. 10: ``T_cp + T_cm - min(T_cpa, T_cma)``) and ``+`` otherwise; ``eta`` is 0 for
a causal mask and 1 for a full one (eq. 8). With ``d = 1`` and no ring terms it is OrchMLLM's eq. 2
``alpha * L + beta * sum l^2``; ``padded=True`` gives its padded form ``alpha * b * l_max + beta *
b * l_max^2``. Memory per rank is ``memory_per_token * S1 / d + memory_static`` (DHP eq. 7).

:meth:`CostModel.fit` fits the coefficients to measurements (relative least squares, non-negative,
with the overlap branch of each measurement chosen alternately) and reports the fit error; the
profiler ``mmbalance.bench.profile.profile`` (it runs torch, so it is not in this layer)
produces such measurements for a user's module.

>>> m = CostModel(linear=1.0, attention=0.001)
>>> m.time([100, 200])
350.0
>>> fitted = CostModel.fit([([n], 1, m.time([n])) for n in (64, 128, 256, 512, 1024)])
>>> round(fitted.attention, 6), fitted.fit_report.mean_error < 1e-9
(0.001, True)
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace

import numpy as np

from .validate import as_count, as_lengths

MASKS = ("causal", "full")


@dataclass(frozen=True)
class Measurement:
    """One timing: a group of sequence ``lengths`` run on ``degree`` CP ranks took ``seconds``."""

    lengths: tuple[int, ...]
    degree: int
    seconds: float


@dataclass(frozen=True)
class FitReport:
    """Error of a cost model on measurements: ``|predicted - measured| / measured``.

    ``mean_error`` is the mean relative error (DHP table 3 reports it as a percentage),
    ``max_error`` the largest; ``count`` measurements; ``iterations``: least-squares solves run.
    """

    mean_error: float
    max_error: float
    count: int
    iterations: int = 0

    def __str__(self) -> str:
        return f"mean {100 * self.mean_error:.2f}%, max {100 * self.max_error:.2f}% over {self.count}"


def _aggregates(lengths: np.ndarray, padded: bool) -> tuple[float, float, int]:
    if lengths.size == 0:
        return 0.0, 0.0, 0
    x = lengths.astype(np.float64)
    if padded:
        b, m = float(x.size), float(x.max())
        return b * m, b * m * m, int(x.size)
    return float(x.sum()), float((x * x).sum()), int(x.size)


@dataclass(frozen=True)
class CostModel:
    """Time and memory of one group of sequences (see the module docstring for the formula).

    Attributes:
        linear: seconds per token on one rank (projections, MLP): ``alpha_2`` of DHP eq. 8,
            ``alpha`` of OrchMLLM eq. 2.
        attention: seconds per token^2 of causal attention (``alpha_1``; ``beta`` of eq. 2).
        ring: seconds per token a rank exchanges in ring attention (``alpha_3 / v_p``, eq. 9).
        ring_latency: seconds per ring step (``beta_2`` per step).
        fixed: seconds per group (``beta_1``).
        mask: ``"causal"`` (``eta = 0``) or ``"full"`` (``eta = 1``, vision encoders).
        overlap: ring communication hidden under attention (eq. 10) or added to it.
        padded: sequences padded to the longest (OrchMLLM eq. 2, first case).
        memory_per_token, memory_static: bytes per token and per rank (eq. 7).
        fit_report: the error on the measurements the model was fitted to, if fitted.
    """

    linear: float = 1.0
    attention: float = 0.0
    ring: float = 0.0
    ring_latency: float = 0.0
    fixed: float = 0.0
    mask: str = "causal"
    overlap: bool = True
    padded: bool = False
    memory_per_token: float = 1.0
    memory_static: float = 0.0
    fit_report: FitReport | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        for name in (
            "linear",
            "attention",
            "ring",
            "ring_latency",
            "fixed",
            "memory_per_token",
            "memory_static",
        ):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, numbers.Real):
                raise TypeError(f"{name} must be a real number, got {type(v).__name__}")
            if not np.isfinite(float(v)) or v < 0:
                raise ValueError(f"{name} must be finite and >= 0, got {v}")
        if self.mask not in MASKS:
            raise ValueError(f"mask must be one of {MASKS}, got {self.mask!r}")
        if self.memory_per_token <= 0:
            raise ValueError("memory_per_token must be > 0")

    @property
    def eta(self) -> float:
        """Extra attention cost of the mask over a causal one (DHP eq. 8)."""
        return 1.0 if self.mask == "full" else 0.0

    def _time(self, s1: float, s2: float, count: int, d: int) -> float:
        # same arithmetic order as CpCost::time in csrc/planners.hpp
        if count == 0:
            return 0.0
        dd = float(d)
        a = self.attention * (1.0 + self.eta) * s2 / dd
        c = self.ring * s1 * (dd - 1.0) / dd + self.ring_latency * (dd - 1.0) if d > 1 else 0.0
        return self.fixed + self.linear * s1 / dd + (max(a, c) if self.overlap else a + c)

    def time(self, lengths, degree: int = 1) -> float:
        """Estimated seconds of one group of sequences on ``degree`` CP ranks (0 for no sequence).

        >>> CostModel(linear=2.0, fixed=1.0).time([3, 4], degree=2)
        8.0
        """
        lengths = as_lengths(lengths)
        degree = as_count(degree, "degree")
        s1, s2, count = _aggregates(lengths, self.padded)
        return self._time(s1, s2, count, degree)

    __call__ = time

    def memory(self, lengths, degree: int = 1) -> float:
        """Bytes per rank of a group of sequences on ``degree`` CP ranks (DHP eq. 7)."""
        lengths = as_lengths(lengths)
        degree = as_count(degree, "degree")
        s1, _, _ = _aggregates(lengths, self.padded)
        return self.memory_per_token * s1 / degree + self.memory_static

    def tokens_per_rank(self, memory_bytes: float) -> int:
        """The token budget of one rank with ``memory_bytes`` (``memory_per_rank`` of cp_schedule).

        >>> CostModel(memory_per_token=2.0, memory_static=10.0).tokens_per_rank(30.0)
        10
        """
        if isinstance(memory_bytes, bool) or not isinstance(memory_bytes, numbers.Real):
            raise TypeError(f"memory_bytes must be a real number, got {type(memory_bytes).__name__}")
        tokens = int((float(memory_bytes) - self.memory_static) // self.memory_per_token)
        if tokens < 1:
            raise ValueError(f"memory_bytes ({memory_bytes}) leaves no room for a token after memory_static")
        return tokens

    @classmethod
    def orchmllm(cls, alpha: float, beta: float, *, padded: bool = False) -> CostModel:
        """OrchMLLM eq. 2: ``alpha * L + beta * sum l^2`` (or its padded form)."""
        return cls(linear=alpha, attention=beta, padded=padded)

    @classmethod
    def transformer(
        cls,
        *,
        hidden_size: int = 4096,
        num_layers: int = 32,
        kv_size: int = 1024,
        ffn_size: int | None = None,
        attention_layers: int | None = None,
        linear_state: int = 0,
        mask: str = "causal",
        flops: float = 400e12,
        bandwidth: float = 50e9,
        latency: float = 10e-6,
        bytes_per_value: int = 2,
    ) -> CostModel:
        """A dense transformer from its shape, in seconds (forward + backward = 3x forward FLOPs).

        Defaults: an 8B model (hidden 4096, 32 layers, 8 KV heads of 128, FFN 14336) at 400 TFLOP/s
        achieved, ring P2P at 50 GB/s and 10 us a step. Linear: ``6 * params`` FLOPs a token;
        causal attention: ``6 * hidden * layers`` FLOPs per token pair; ring: K and V of every layer
        travel forward, K, V and their gradients backward; activations: ``34 * hidden`` bytes a
        token a layer (Korthikanti et al.) for the memory model.

        A hybrid (Qwen3.5, Qwen3-Next: Gated DeltaNet layers beside full attention) gives
        ``attention_layers``, the layers with softmax attention (default: all): only those pay the
        quadratic and the ring terms; every layer pays its projections, and each of the others a
        recurrence of ``linear_state`` values (heads x key dim x value dim) per token: about
        ``6 * 3 * linear_state`` FLOPs a token (state update, delta and read-out, forward and
        backward), linear in length.
        """
        h = as_count(hidden_size, "hidden_size")
        layers = as_count(num_layers, "num_layers")
        kv = as_count(kv_size, "kv_size")
        ffn = 3.5 * h if ffn_size is None else as_count(ffn_size, "ffn_size")
        attn = (
            layers if attention_layers is None else as_count(attention_layers, "attention_layers", minimum=0)
        )
        if attn > layers:
            raise ValueError(f"attention_layers ({attn}) must be at most num_layers ({layers})")
        state = as_count(linear_state, "linear_state", minimum=0)
        params = layers * (2.0 * h * h + 2.0 * h * kv + 3.0 * h * ffn)
        return cls(
            linear=(6.0 * params + 18.0 * state * (layers - attn)) / flops,
            attention=6.0 * h * attn / flops,
            ring=3.0 * 2.0 * kv * bytes_per_value * attn / bandwidth,
            ring_latency=3.0 * layers * latency,
            mask=mask,
            memory_per_token=34.0 * h * layers,
        )

    @classmethod
    def fit(
        cls,
        measurements: Iterable,
        *,
        mask: str = "causal",
        overlap: bool = True,
        padded: bool = False,
        fit_fixed: bool = True,
        memory_per_token: float = 1.0,
        memory_static: float = 0.0,
        max_iterations: int = 20,
    ) -> CostModel:
        """Least-squares fit of the coefficients to measured times; the error is in ``fit_report``.

        Args:
            measurements: :class:`Measurement` objects or tuples ``(lengths, seconds)`` /
                ``(lengths, degree, seconds)``: a group of sequences, its CP degree and its time.
            mask, overlap, padded, memory_per_token, memory_static: fixed, not fitted.
            fit_fixed: fit the per-group constant (else it is 0).
            max_iterations: rounds of refining, per measurement, which branch of the overlap ``max``
                is active (only with ``overlap`` and ``degree > 1`` measurements).

        Relative least squares (each row divided by its measured time), so the fit minimizes the
        relative error the schedulers care about; coefficients are kept non-negative. Ring terms
        are fitted only when some measurement has ``degree > 1``.

        Raises:
            ValueError: fewer measurements than coefficients, or a non-positive time.
        """
        rows = [_as_measurement(m, i) for i, m in enumerate(measurements)]
        if mask not in MASKS:
            raise ValueError(f"mask must be one of {MASKS}, got {mask!r}")
        eta = 1.0 if mask == "full" else 0.0
        agg = np.array(
            [(*_aggregates(np.asarray(r.lengths, dtype=np.int64), padded)[:2], r.degree) for r in rows]
        )
        t = np.array([r.seconds for r in rows], dtype=np.float64)
        if len(rows) == 0:
            raise ValueError("measurements must not be empty")
        s1, s2, d = agg[:, 0], agg[:, 1], agg[:, 2]
        multi = bool(np.any(d > 1))
        names = (
            ["linear", "attention"]
            + (["ring", "ring_latency"] if multi else [])
            + (["fixed"] if fit_fixed else [])
        )
        if len(rows) < len(names):
            raise ValueError(f"measurements: need at least {len(names)} to fit {names}, got {len(rows)}")
        lin, att = s1 / d, (1.0 + eta) * s2 / d
        ring_f, lat_f = s1 * (d - 1) / d, d - 1.0
        every = np.ones(len(rows), dtype=bool)

        def solve(use_a, use_r):
            cols = [lin, att * use_a]
            if multi:
                cols += [ring_f * use_r, lat_f * use_r]
            if fit_fixed:
                cols.append(np.ones(len(rows)))
            coef = _nnls(np.stack(cols, axis=1) / t[:, None], np.ones(len(rows)))
            model = cls(
                mask=mask,
                overlap=overlap,
                padded=padded,
                memory_per_token=memory_per_token,
                memory_static=memory_static,
                **dict(zip(names, coef.tolist())),
            )
            return model, np.abs(model.predict(s1, s2, d) - t) / t

        best = solve(every, every)  # additive: exact without overlap, a start with it
        iterations = 1
        if overlap and multi:
            # Which branch of the max each measurement is on is unknown. Candidate assignments come
            # from a grid of boundaries att >= u * ring + v * latency (features normalized), each
            # is fitted, and the best is refined by alternating (branches from the coefficients,
            # then a fit of just those terms).
            single = d <= 1

            def norm(x):
                pos = x[x > 0]
                return x / (np.median(pos) if pos.size else 1.0)

            na, nr, nl = norm(att), norm(ring_f), norm(lat_f)
            grid = np.concatenate([[0.0], np.logspace(-3, 3, 25)])
            seen = set()
            starts = [every, single]
            for u in grid:
                for v in grid:
                    starts.append((na >= u * nr + v * nl) | single)
            for branch in starts:
                key = branch.tobytes()
                if key in seen:
                    continue
                seen.add(key)
                model, err = solve(branch, ~branch)
                iterations += 1
                if err.mean() < best[1].mean():
                    best = (model, err)
            model = best[0]
            for _ in range(max_iterations):
                branch = (model.attention * att >= model.ring * ring_f + model.ring_latency * lat_f) | single
                model, err = solve(branch, ~branch)
                iterations += 1
                if not err.mean() < best[1].mean():
                    break
                best = (model, err)
        model, err = best
        report = FitReport(float(err.mean()), float(err.max()), len(rows), iterations)
        return replace(model, fit_report=report)

    def predict(self, s1: np.ndarray, s2: np.ndarray, d: np.ndarray) -> np.ndarray:
        """:meth:`time` of many groups at once, from their aggregates (broadcast together): ``s1``
        the tokens (``b * l_max`` for a padded model), ``s2`` the sum of squared lengths
        (``b * l_max^2``), ``d`` the CP degree (>= 1)."""
        a = self.attention * (1.0 + self.eta) * s2 / d
        c = np.where(d > 1, self.ring * s1 * (d - 1) / d + self.ring_latency * (d - 1), 0.0)
        return self.fixed + self.linear * s1 / d + (np.maximum(a, c) if self.overlap else a + c)

    def with_encoder(self, encoder_seconds) -> Callable[[np.ndarray, int], np.ndarray]:
        """The per-sequence cost :func:`~mmbalance.balancing.cp_schedule` plans with when a CP
        group's members also run the encoders of its sequences' media: sequence ``s`` of ``l``
        tokens on ``d`` ranks takes this model's time of ``[l]`` on ``d`` ranks plus
        ``encoder_seconds[s] / d`` (its media's encoder time, spread over the group's members);
        a group takes the sum over its sequences (so ``fixed`` and the ring's overlap count per
        sequence). Called with the lengths ``encoder_seconds`` belongs to, one time per sequence.
        :func:`~mmbalance.balancing.cp_schedule`'s ``encoder_seconds`` adds the same share to a
        group's own time instead (exact for a ``CostModel``, and planned in the compiled core).

        >>> CostModel(linear=1.0).with_encoder([4.0, 0.0])(np.array([2, 3]), 2).tolist()
        [3.0, 1.5]
        """
        enc = np.asarray(encoder_seconds, dtype=np.float64).reshape(-1)
        if not np.all(np.isfinite(enc)) or np.any(enc < 0):
            raise ValueError("encoder_seconds must be finite and >= 0")
        if self.padded:
            raise ValueError("with_encoder: a padded CostModel does not describe packed CP groups")

        def cost(lengths: np.ndarray, degree: int) -> np.ndarray:
            if lengths.shape != enc.shape:
                raise ValueError(
                    f"this cost was made for {enc.size} sequences, called with lengths of shape {lengths.shape}"
                )
            x = lengths.astype(np.float64)
            d = np.full(x.shape, float(degree))
            return np.where(lengths > 0, self.predict(x, x * x, d) + enc / d, 0.0)

        cost.__qualname__ = "llm_and_encoder_cost"
        return cost

    def step_with_encoders(
        self, groups: Iterable, lengths, encoder_seconds, *, exchange: str = "world"
    ) -> float:
        """Modelled seconds of a step whose encoders run before the LLM phase. ``groups``: CP
        groups (``degree`` and ``sequences``, as :func:`cp_schedule` gives them), each encoding its
        own sequences' media spread evenly over its members; ``encoder_seconds`` per sequence.

        ``exchange``: where the feature rows move between the phases. ``"world"``: one exchange
        over every rank, so the step is the busiest rank's encoder share plus the slowest group's
        LLM time. ``"group"``: each group's rows stay inside it, so each group starts its LLM phase
        when its own members are done: the step is the slowest group's encoder share plus LLM time.

        >>> from types import SimpleNamespace as G
        >>> groups = [G(degree=2, sequences=[0]), G(degree=1, sequences=[1])]
        >>> CostModel(linear=1.0).step_with_encoders(groups, [4, 1], [6.0, 1.0])
        5.0
        >>> CostModel(linear=1.0).step_with_encoders(groups, [4, 1], [6.0, 1.0], exchange="group")
        5.0
        >>> CostModel(linear=1.0).step_with_encoders(groups, [4, 3], [6.0, 1.0], exchange="group")
        5.0
        >>> CostModel(linear=1.0).step_with_encoders(groups, [4, 3], [6.0, 1.0])
        6.0
        """
        if exchange not in ("world", "group"):
            raise ValueError(f'exchange must be "world" or "group", got {exchange!r}')
        lengths = as_lengths(lengths)
        enc = np.asarray(encoder_seconds, dtype=np.float64).reshape(-1)
        if enc.shape != lengths.shape:
            raise ValueError(f"encoder_seconds has {enc.size} entries for {lengths.size} sequences")
        encode = llm = step = 0.0
        for g in groups:
            members = np.asarray(g.sequences, dtype=np.int64)
            e, t = float(enc[members].sum()) / g.degree, self.time(lengths[members], g.degree)
            encode, llm, step = max(encode, e), max(llm, t), max(step, e + t)
        return encode + llm if exchange == "world" else step

    def error(self, measurements: Iterable) -> FitReport:
        """The model's relative error on other measurements (a held-out check of a fit)."""
        rows = [_as_measurement(m, i) for i, m in enumerate(measurements)]
        if not rows:
            raise ValueError("measurements must not be empty")
        pred = np.array([self.time(r.lengths, r.degree) for r in rows])
        t = np.array([r.seconds for r in rows])
        err = np.abs(pred - t) / t
        return FitReport(float(err.mean()), float(err.max()), len(rows))


def _as_measurement(m, i: int) -> Measurement:
    if isinstance(m, Measurement):
        lengths, degree, seconds = m.lengths, m.degree, m.seconds
    elif isinstance(m, (tuple, list)) and len(m) in (2, 3):
        lengths, seconds = m[0], m[-1]
        degree = m[1] if len(m) == 3 else 1
    else:
        raise TypeError(f"measurements[{i}] must be a Measurement or (lengths, [degree,] seconds)")
    checked = as_lengths(lengths, f"measurements[{i}].lengths")
    degree = as_count(degree, f"measurements[{i}].degree")
    if (
        isinstance(seconds, bool)
        or not isinstance(seconds, numbers.Real)
        or not np.isfinite(float(seconds))
        or seconds <= 0
    ):
        raise ValueError(f"measurements[{i}].seconds must be a positive number, got {seconds!r}")
    return Measurement(tuple(int(x) for x in checked), degree, float(seconds))


def _nnls(A: np.ndarray, b: np.ndarray, max_iter: int = 100) -> np.ndarray:
    """Non-negative least squares (Lawson-Hanson active set), small dense problems."""
    n = A.shape[1]
    x = np.zeros(n)
    passive = np.zeros(n, dtype=bool)
    scale = np.linalg.norm(A, axis=0)
    scale[scale == 0] = 1.0
    As = A / scale  # column scaling keeps the active-set tests well conditioned
    w = As.T @ (b - As @ x)
    tol = 1e-12 * max(1.0, float(np.abs(w).max()))
    for _ in range(max_iter):
        if passive.all() or w[~passive].max(initial=-np.inf) <= tol:
            break
        j = int(np.argmax(np.where(passive, -np.inf, w)))
        passive[j] = True
        while True:
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(As[:, passive], b, rcond=None)[0]
            if (z[passive] > 0).all():
                x = z
                break
            neg = passive & (z <= 0)
            alpha = np.min(x[neg] / (x[neg] - z[neg]))
            x = x + alpha * (z - x)
            passive &= x > 1e-15
            x[~passive] = 0.0
        w = As.T @ (b - As @ x)
    return x / scale
