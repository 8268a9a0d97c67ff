"""Halting signals of a native gate (Ouro / PonderNet, SPEC §4 ``q_exit``), defined once.

With gate logits g_t and per-loop halting probabilities λ_t = σ(g_t), the cumulative exit
probability after loop t is CDF_t = 1 − Π_{j≤t}(1 − λ_j); Ouro's Q-exit leaves at the first t with
CDF_t ≥ q. :func:`halting_cdf` computes it over whole trajectories (the readouts stage), :class:`HaltingCDF`
loop by loop (the online rule); both sum the same float64 terms in the same order, so they agree bit for bit.
"""

from __future__ import annotations

import numpy as np
from looptrace.signals import keep_rows


def _log_not_halting(gate_logit: np.ndarray) -> np.ndarray:
    """log(1 − σ(g)) = −softplus(g), float64 (large gate logits do not round to log(1 − 1))."""
    return -np.logaddexp(0.0, np.asarray(gate_logit, dtype=np.float64))


def _cdf(log_not_sum: np.ndarray) -> np.ndarray:
    """1 − exp(Σ_{j≤t} log(1 − λ_j))."""
    return -np.expm1(log_not_sum)


def halting_cdf(gate_logit: np.ndarray) -> np.ndarray:
    """Native Q-exit signal (Ouro): 1 − Π_{j≤t}(1 − σ(gate_j)), per token and loop, in log space.

    Args:
        gate_logit: [token, loop] float.

    Returns:
        [token, loop] float64 cumulative halting probability, non-decreasing in t.
    """
    return _cdf(np.cumsum(_log_not_halting(gate_logit), axis=1))  # cumsum adds left to right, as HaltingCDF


class HaltingCDF:
    """Streaming :func:`halting_cdf`: feed g_1, g_2, ... ([...] arrays, e.g. [batch, seq]); keeps the running sum."""

    def __init__(self) -> None:
        self._sum: np.ndarray | None = None

    def update(self, gate_logit: np.ndarray) -> np.ndarray:
        """CDF_t [...] float64 after loop t."""
        x = _log_not_halting(gate_logit)
        self._sum = x if self._sum is None else self._sum + x
        return _cdf(self._sum)

    def compact(self, rows, seq: int | None) -> None:
        """Follow the early-exit engine's compaction (leading dims [batch, seq])."""
        if self._sum is not None:
            self._sum = keep_rows(self._sum, rows, seq)
