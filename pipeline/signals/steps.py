"""Per-loop step signals of a trajectory (SPEC §2, [TS], Huginn), defined once.

With Δ_t = h_t − h_{t−1} (Δ_1 = h_1 − h_0, h_0 = ``hidden_init``) and s_t = ‖Δ_t‖₂, the signals are
step_norm, rel_step, step_cos, state_cos_dist, accel, accel_norm and step_d2 (see
:func:`step_metrics`). The geometry stage, the gates' features, the online exit rules and the online
gate all call :func:`step_metrics`, so a value computed online equals the stored one bit for bit.

Numerics: every loop's [token, d_model] slice is processed in float64 (differences, norms and dot
products), then the metrics are returned as float32. Values that need a loop that does not exist
(t − 1 or t − 2) are NaN, never 0, and so are ratios whose denominator is 0.
"""

from __future__ import annotations

import numpy as np

#: Step signals of :func:`step_metrics`, in ``token_loop.parquet`` column order.
GEOMETRY_METRICS = ("step_norm", "rel_step", "step_cos", "state_cos_dist", "accel", "accel_norm", "step_d2")


def _norm(x: np.ndarray) -> np.ndarray:
    """Euclidean norm over the last axis: [token, d_model] float64 -> [token]."""
    return np.sqrt(np.einsum("nd,nd->n", x, x))


def _ratio(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    """num / den with NaN (not inf, not 0) where the denominator is 0: undefined stays undefined."""
    out = np.full(num.shape, np.nan)
    np.divide(num, den, out=out, where=den > 0)
    return out


def step_metrics(hidden: np.ndarray, hidden_init: np.ndarray) -> dict[str, np.ndarray]:
    """Per-(token, loop) step geometry of a block of trajectories (SPEC §2, [TS], Huginn).

    With Δ_t = h_t − h_{t−1} (Δ_1 = h_1 − h_0) and s_t = ‖Δ_t‖₂:

    - ``step_norm`` s_t; ``rel_step`` s_t / ‖h_t‖ (Huginn ``latent-diff``)
    - ``step_cos`` cos(Δ_t, Δ_{t−1}), t ≥ 2 ([TS] step orthogonality)
    - ``state_cos_dist`` 1 − cos(h_t, h_{t−1}) (Huginn ``cosine``)
    - ``accel`` ‖Δ_t − Δ_{t−1}‖₂, t ≥ 2, and ``accel_norm`` = accel / ‖h_t‖ ([TS])
    - ``step_d2`` s_t − 2 s_{t−1} + s_{t−2}, t ≥ 3

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
    n, n_loops, _ = hidden.shape
    out = {k: np.full((n, n_loops), np.nan, dtype=np.float64) for k in GEOMETRY_METRICS}
    h_prev = np.asarray(hidden_init, dtype=np.float64)
    nh_prev = _norm(h_prev)
    d_prev = s_prev = s_prev2 = None
    for t in range(n_loops):
        h = np.asarray(hidden[:, t], dtype=np.float64)  # [token, d_model]
        d = h - h_prev
        s, nh = _norm(d), _norm(h)
        out["step_norm"][:, t] = s
        out["rel_step"][:, t] = _ratio(s, nh)
        out["state_cos_dist"][:, t] = 1.0 - _ratio(np.einsum("nd,nd->n", h, h_prev), nh * nh_prev)
        if d_prev is not None:
            out["step_cos"][:, t] = _ratio(np.einsum("nd,nd->n", d, d_prev), s * s_prev)
            a = _norm(d - d_prev)
            out["accel"][:, t] = a
            out["accel_norm"][:, t] = _ratio(a, nh)
        if s_prev2 is not None:
            out["step_d2"][:, t] = s - 2.0 * s_prev + s_prev2
        h_prev, nh_prev, d_prev, s_prev2, s_prev = h, nh, d, s_prev, s
    return {k: v.astype(np.float32) for k, v in out.items()}
