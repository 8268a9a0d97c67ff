"""The fixed-point bound (SPEC §2b, [BA]) as a per-(token, loop) signal formula (torch-free): read by the
``certified_fixed_point`` and ``estimated_fixed_point`` exit rules (:mod:`looptrace.rules.certified`) and the loop-map
diagnosis (:mod:`looptrace.diagnose.loopmap`).

b_t = r_t·ρ/(1 − ρ) bounds ‖h_t − h*‖/‖h_t‖ when ρ bounds the loop map's Lipschitz constant between h_t and h*
(Banach's a-posteriori estimate): h_t − h* = F(h_{t−1}) − F(h*), so ‖h_t − h*‖ ≤ ρ(‖Δ_t‖ + ‖h_t − h*‖). It is a
*certificate* only with an upper bound of the Jacobian's norm — ``contraction_bound`` ρ̄_t — and an *estimate* with
the power-method ρ_t, a lower bound of it.
"""

from __future__ import annotations

import numpy as np


def certified_bound(rho: np.ndarray, rel_step: np.ndarray) -> np.ndarray:
    """b_t = r_t·ρ_t/(1 − ρ_t): the Banach bound on ‖h_t − h*‖/‖h_t‖ ([BA]); NaN where ρ_t ≥ 1 or undefined.

    Args:
        rho: [token, loop] an upper bound of the local contraction (``contraction_bound``) for a certificate;
            ``contraction`` gives the estimated bound.
        rel_step: [token, loop] r_t = ‖Δ_t‖/‖h_t‖.

    Returns:
        [token, loop] float64.
    """
    rho = np.asarray(rho, dtype=np.float64)
    ok = rho < 1  # NaN compares False
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(ok, np.asarray(rel_step, dtype=np.float64) * rho / (1 - rho), np.nan)
