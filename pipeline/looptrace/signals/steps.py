"""Per-loop step signals of a trajectory (SPEC §2, [TS], Huginn), defined once.

With Δ_t = h_t − h_{t−1} (Δ_1 = h_1 − h_0, h_0 = ``hidden_init``) and s_t = ‖Δ_t‖₂:

- :func:`step_norm` s_t; :func:`rel_step` s_t / ‖h_t‖ (Huginn ``latent-diff``)
- :func:`step_cos` cos(Δ_t, Δ_{t−1}), t ≥ 2 ([TS] step orthogonality)
- :func:`state_cos_dist` 1 − cos(h_t, h_{t−1}) (Huginn ``cosine``)
- :func:`accel` ‖Δ_t − Δ_{t−1}‖₂, t ≥ 2, and :func:`accel_norm` = accel / ‖h_t‖ ([TS])
- :func:`step_d2` s_t − 2 s_{t−1} + s_{t−2}, t ≥ 3

:class:`StepSignals` evaluates them loop by loop (streaming: it keeps loops t − 1 and t − 2 only) and
:func:`step_metrics` runs it over a block of whole trajectories. The geometry stage and the gates' features
(:func:`step_metrics` on stored states) and the online exit rules and online gate (:class:`StepSignals` on
the live batch's states rounded to the store's dtype, :meth:`StepSignals.compact` following the engine's
compaction) all use them, so a value computed online equals the stored one bit for bit.

Numerics: every loop's states are processed as [token, d_model] float64 arrays (differences, norms and
dot products), and the metrics are returned as float32. Values that need a loop that does not exist
(t − 1 or t − 2) are NaN, never 0, and so are ratios whose denominator is 0.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from looptrace.signals import keep_rows
from looptrace.signals.names import STEP_SIGNALS

#: Step signals of :func:`step_metrics`, in ``token_loop.parquet`` column order (the registry's).
GEOMETRY_METRICS = STEP_SIGNALS
#: Bytes of one float64 [rows, d_model] array in :func:`step_metrics`' row groups (2 MiB: the handful of such
#: arrays one loop's update holds stay in cache between operations; 49 rows at d_model 5280, 4096 at 64).
ROW_GROUP_BYTES = 1 << 21


def _dot(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Row-wise dot product: [token, d_model] float64 × 2 -> [token]."""
    return np.einsum("nd,nd->n", a, b)


def _norm(x: np.ndarray) -> np.ndarray:
    """Euclidean norm over the last axis: [token, d_model] float64 -> [token]."""
    return np.sqrt(_dot(x, x))


def _ratio(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    """num / den with NaN (not inf, not 0) where the denominator is 0: undefined stays undefined."""
    out = np.full(num.shape, np.nan)
    np.divide(num, den, out=out, where=den > 0)
    return out


# ----------------------------------------------------------------------------------------------
# The signals, one definition each: h = h_t, d = Δ_t, s = s_t, nh = ‖h_t‖ ([token, d_model] / [token] float64).
# ----------------------------------------------------------------------------------------------


def step_norm(d: np.ndarray) -> np.ndarray:
    """s_t = ‖Δ_t‖₂."""
    return _norm(d)


def rel_step(s: np.ndarray, nh: np.ndarray) -> np.ndarray:
    """s_t / ‖h_t‖ (Huginn ``latent-diff``)."""
    return _ratio(s, nh)


def state_cos_dist(h: np.ndarray, h_prev: np.ndarray, nh: np.ndarray, nh_prev: np.ndarray) -> np.ndarray:
    """1 − cos(h_t, h_{t−1}) (Huginn ``cosine``)."""
    return 1.0 - _ratio(_dot(h, h_prev), nh * nh_prev)


def step_cos(d: np.ndarray, d_prev: np.ndarray, s: np.ndarray, s_prev: np.ndarray) -> np.ndarray:
    """cos(Δ_t, Δ_{t−1}) ([TS] step orthogonality)."""
    return _ratio(_dot(d, d_prev), s * s_prev)


def accel(d: np.ndarray, d_prev: np.ndarray) -> np.ndarray:
    """a_t = ‖Δ_t − Δ_{t−1}‖₂ ([TS])."""
    return _norm(d - d_prev)


def accel_norm(a: np.ndarray, nh: np.ndarray) -> np.ndarray:
    """a_t / ‖h_t‖ ([TS]; Huginn ``latent-acceleration``)."""
    return _ratio(a, nh)


def step_d2(s: np.ndarray, s_prev: np.ndarray, s_prev2: np.ndarray) -> np.ndarray:
    """s_t − 2 s_{t−1} + s_{t−2}."""
    return s - 2.0 * s_prev + s_prev2


class StepSignals:
    """Streaming step signals: start from h_0, feed h_1, h_2, ... in order.

    States may have any leading dims ([token, d_model] in the geometry stage, [batch, seq, d_model] on the
    live batch); each loop is computed on the [rows, d_model] float64 view, so the values do not depend on
    the leading shape.

    Args:
        hidden_init: [..., d_model] h_0 (any float dtype; used in float64).
        names: the signals to compute (default all of :data:`GEOMETRY_METRICS`).
    """

    def __init__(self, hidden_init: np.ndarray, names: Sequence[str] = GEOMETRY_METRICS):
        unknown = [n for n in names if n not in GEOMETRY_METRICS]
        if unknown:
            raise ValueError(f"StepSignals: unknown signal '{unknown[0]}'; known: {', '.join(GEOMETRY_METRICS)}")
        self.names = tuple(n for n in GEOMETRY_METRICS if n in names)
        self._h_prev = np.asarray(hidden_init, dtype=np.float64)
        self._nh_prev: np.ndarray | None = None
        self._d_prev: np.ndarray | None = None
        self._s_prev: np.ndarray | None = None
        self._s_prev2: np.ndarray | None = None
        self._need_nh = any(n in self.names for n in ("rel_step", "state_cos_dist", "accel_norm"))
        self._need_s = any(n in self.names for n in ("step_norm", "rel_step", "step_cos", "step_d2"))

    def update(self, hidden: np.ndarray) -> dict[str, np.ndarray]:
        """Signals of the next loop t.

        Args:
            hidden: [..., d_model] h_t (same leading dims as the previous loop's, after any :meth:`compact`).

        Returns:
            name -> [...] float64 for every requested name (NaN where undefined).
        """
        h = np.asarray(hidden, dtype=np.float64)
        lead, D = h.shape[:-1], h.shape[-1]
        h2 = h.reshape(-1, D)
        hp = self._h_prev.reshape(-1, D)
        d = h2 - hp
        s = step_norm(d) if self._need_s else None
        nh = _norm(h2) if self._need_nh else None
        if self._need_nh and self._nh_prev is None:
            self._nh_prev = _norm(hp).reshape(lead)
        flat: dict[str, np.ndarray] = {}  # [rows] values
        # The asserts restate the invariants: s is there for step_norm/rel_step/step_cos/step_d2, nh and
        # the previous loop's norms for rel_step/state_cos_dist/accel_norm, and a previous loop's d / s
        # (t − 1, t − 2) once one has been seen.
        v: np.ndarray
        for n in self.names:
            if n == "step_norm":
                assert s is not None
                v = s
            elif n == "rel_step":
                assert s is not None and nh is not None
                v = rel_step(s, nh)
            elif n == "state_cos_dist":
                assert nh is not None and self._nh_prev is not None
                v = state_cos_dist(h2, hp, nh, self._nh_prev.reshape(-1))
            elif n == "step_d2" and self._s_prev2 is not None:
                assert s is not None and self._s_prev is not None
                v = step_d2(s, self._s_prev.reshape(-1), self._s_prev2.reshape(-1))
            elif n == "step_d2" or self._d_prev is None:  # needs t − 2 / t − 1
                v = np.full(h2.shape[0], np.nan)
            elif n == "step_cos":
                assert s is not None and self._s_prev is not None
                v = step_cos(d, self._d_prev.reshape(-1, D), s, self._s_prev.reshape(-1))
            elif n == "accel":
                v = accel(d, self._d_prev.reshape(-1, D))
            else:  # accel_norm
                assert nh is not None
                v = accel_norm(flat["accel"] if "accel" in flat else accel(d, self._d_prev.reshape(-1, D)), nh)
            flat[n] = v
        out = {n: v.reshape(lead) for n, v in flat.items()}
        self._h_prev, self._nh_prev = h, (nh.reshape(lead) if nh is not None else None)
        self._d_prev = d.reshape(h.shape)
        self._s_prev2, self._s_prev = self._s_prev, (s.reshape(lead) if s is not None else None)
        return out

    def compact(self, rows, seq: int | None) -> None:
        """Follow the early-exit engine's compaction (leading dims [batch, seq]): keep ``rows``, truncate to
        ``seq`` positions."""
        for k in ("_h_prev", "_nh_prev", "_d_prev", "_s_prev", "_s_prev2"):
            v = getattr(self, k)
            if v is not None:
                setattr(self, k, keep_rows(v, rows, seq))


def step_metrics(hidden: np.ndarray, hidden_init: np.ndarray) -> dict[str, np.ndarray]:
    """Per-(token, loop) step geometry of a block of trajectories (SPEC §2; the module docstring).

    Args:
        hidden: [token, loop, d_model] h_1..h_T (any float dtype; float16 from the store is fine).
        hidden_init: [token, d_model] h_0.

    Returns:
        Metric name -> [token, loop] float32 (loop axis 0-based: column t − 1 is loop t). Undefined
        entries (t too small, zero denominators) are NaN.
    """
    if hidden.ndim != 3 or hidden_init.shape != (hidden.shape[0], hidden.shape[2]):
        raise ValueError(f"step_metrics: hidden must be [token, loop, d_model] and hidden_init [token, d_model], "
                         f"got {hidden.shape} and {hidden_init.shape}")
    n, n_loops, d_model = hidden.shape
    out = {k: np.full((n, n_loops), np.nan, dtype=np.float64) for k in GEOMETRY_METRICS}
    # Rows in groups whose float64 [rows, d_model] working arrays stay in cache across the loops (each row's
    # values are computed alone, so they do not depend on the grouping: bit-identical, ~2x faster at LM width
    # than a pass over the whole block per operation: benchmarks/geometry.py)
    rows = max(1, ROW_GROUP_BYTES // (8 * d_model))
    for r0 in range(0, n, rows):
        r = slice(r0, min(r0 + rows, n))
        acc = StepSignals(hidden_init[r])
        for t in range(n_loops):
            for k, v in acc.update(hidden[r, t]).items():
                out[k][r, t] = v
    return {k: v.astype(np.float32) for k, v in out.items()}
