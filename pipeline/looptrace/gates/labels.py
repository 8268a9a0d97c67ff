"""Training labels of SPEC §6 on [token, loop] per-depth quantities (RecurTrace oracle, CALM, Ouro utility)."""

from __future__ import annotations

import numpy as np

from looptrace.gates.config import UTILITY_ALIGN, GatesConfig, GateSpec


def oracle_continue(loss: np.ndarray, delta: float) -> np.ndarray:
    """RecurTrace oracle labels: continue_t = 1[min_{t'>t} ℓ_{t'} < ℓ_t − δ].

    Args:
        loss: [token, loop] ℓ_t (nats).
        delta: required improvement δ (nats).

    Returns:
        [token, loop] bool; False at t = T (no later loop).
    """
    ell = np.asarray(loss, dtype=np.float64)
    future = np.full_like(ell, np.inf)
    # suffix minimum over t' > t: reverse cumulative min, shifted one loop left
    future[:, :-1] = np.minimum.accumulate(ell[:, ::-1], axis=1)[:, ::-1][:, 1:]
    return future < ell - delta


def consistent_stop(argmax: np.ndarray) -> np.ndarray:
    """CALM consistency labels: stop_t = 1[argmax_t = argmax_T]; [token, loop] bool (True at T)."""
    a = np.asarray(argmax)
    return a == a[:, -1:]


def utility_continue(loss: np.ndarray, k: float = 50.0, gamma: float = 0.005, align: str = "ouro") -> np.ndarray:
    """Ouro stage II soft continue targets c = σ(k(I − γ)) with I_t = max(0, ℓ_{t−1} − ℓ_t).

    Args:
        loss: [token, loop] ℓ_t (nats).
        k, gamma: slope and offset (Ouro: 50, 0.005).
        align: ``ouro``: loop t gets c(I_t) (t ≥ 2; NaN at t = 1); ``next``: loop t gets c(I_{t+1})
            (t ≤ T − 1; NaN at T).

    Returns:
        [token, loop] float64 continue probabilities in (0, 1), NaN where undefined.
    """
    ell = np.asarray(loss, dtype=np.float64)
    imp = np.maximum(0.0, ell[:, :-1] - ell[:, 1:])  # imp[:, j] = I_{j+2} (1-based loop j + 2)
    c = 1.0 / (1.0 + np.exp(-k * (imp - gamma)))
    out = np.full(ell.shape, np.nan)
    if align == "ouro":
        out[:, 1:] = c
    elif align == "next":
        out[:, :-1] = c
    else:
        raise ValueError(f"utility_continue: align must be one of {UTILITY_ALIGN}, got {align!r}")
    return out


def stop_targets(spec: GateSpec, loss: np.ndarray, argmax: np.ndarray, cfg: GatesConfig) -> np.ndarray:
    """The stop target of a scikit-learn gate per (token, loop): 1 − continue, or stop.

    Returns:
        [token, loop] float64 in [0, 1] (hard labels are 0/1), NaN where the scheme is undefined.
    """
    if spec.labels == "oracle":
        return 1.0 - oracle_continue(loss, cfg.oracle_delta).astype(np.float64)
    if spec.labels == "consistent":
        return consistent_stop(argmax).astype(np.float64)
    if spec.labels == "utility":
        return 1.0 - utility_continue(loss, cfg.utility_k, cfg.utility_gamma, cfg.utility_align)
    raise ValueError(f"stop_targets: labels '{spec.labels}' have no targets (ponder is an objective)")
