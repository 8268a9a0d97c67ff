"""Training labels of SPEC §6 on [token, loop] per-depth quantities (RecurTrace oracle, CALM, Ouro utility, [FP]
convergence depth)."""

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


def converged_stop(signal: np.ndarray, eps: float) -> np.ndarray:
    """[FP] convergence labels: stop_t = 1[t ≥ the token's settled convergence depth] (SPEC §2 / §6).

    The settled depth is the first loop from which the signal stays below ε through T (geometry's ``settled``,
    :func:`looptrace.geometry.blocks.convergence_depth`), so stop_t = 1[signal_s < ε for every s ≥ t]: a reverse
    cumulative AND (not imported from geometry, so that gates do not re-run when geometry's code changes;
    tests/test_convergence_labels.py checks that the two agree). A token that never settles (censored, T + 1)
    is never labelled stop; NaN never counts as below ε.

    Args:
        signal: [token, loop] convergence signal (``kl_prev``, ``rel_step``, or ``argmax`` = 1[argmax_t ≠
            argmax_T]).
        eps: its threshold ε.

    Returns:
        [token, loop] bool.
    """
    with np.errstate(invalid="ignore"):
        below = np.asarray(signal) < eps  # NaN compares False
    return np.logical_and.accumulate(below[:, ::-1], axis=1)[:, ::-1]


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


def stop_targets(spec: GateSpec, loss: np.ndarray, argmax: np.ndarray, cfg: GatesConfig,
                 conv: np.ndarray | None = None) -> np.ndarray:
    """The stop target of a scikit-learn gate per (token, loop): 1 − continue, or stop.

    ``conv``: [token, loop] the convergence signal ``gates.converged_signal`` (needed by ``converged`` only).

    Returns:
        [token, loop] float64 in [0, 1] (hard labels are 0/1), NaN where the scheme is undefined.
    """
    if spec.labels == "oracle":
        return 1.0 - oracle_continue(loss, cfg.oracle_delta).astype(np.float64)
    if spec.labels == "consistent":
        return consistent_stop(argmax).astype(np.float64)
    if spec.labels == "utility":
        return 1.0 - utility_continue(loss, cfg.utility_k, cfg.utility_gamma, cfg.utility_align)
    if spec.labels == "converged":
        if conv is None:
            raise ValueError("stop_targets: the 'converged' labels need the convergence signal (conv)")
        return converged_stop(conv, cfg.converged_eps).astype(np.float64)
    raise ValueError(f"stop_targets: labels '{spec.labels}' have no targets (ponder is an objective)")
