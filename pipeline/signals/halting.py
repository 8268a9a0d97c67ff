"""Halting signals of a native gate (Ouro / PonderNet, SPEC §4 ``q_exit``).

With gate logits g_t and per-loop halting probabilities λ_t = σ(g_t), the cumulative exit
probability after loop t is CDF_t = 1 − Π_{j≤t}(1 − λ_j); Ouro's Q-exit leaves at the first t with
CDF_t ≥ q.
"""

from __future__ import annotations

import numpy as np


def halting_cdf(gate_logit: np.ndarray) -> np.ndarray:
    """Native Q-exit signal (Ouro): 1 − Π_{j≤t}(1 − σ(gate_j)), per token and loop.

    Computed in log space: log(1 − σ(g)) = −softplus(g), so large gate logits do not round to 1 − 1.

    Args:
        gate_logit: [token, loop] float.

    Returns:
        [token, loop] float64 cumulative halting probability, non-decreasing in t.
    """
    g = np.asarray(gate_logit, dtype=np.float64)
    log_not = -np.logaddexp(0.0, g)  # log(1 − σ(g))
    return -np.expm1(np.cumsum(log_not, axis=1))
