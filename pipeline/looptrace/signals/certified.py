"""The certified fixed-point bound (SPEC §2b, [BA]) as a per-(token, loop) signal formula (torch-free): read by the
``certified_fixed_point`` exit rule (:mod:`looptrace.rules.certified`) and the loop-map diagnosis
(:mod:`looptrace.diagnose.loopmap`)."""

from __future__ import annotations

import numpy as np


def certified_bound(rho: np.ndarray, rel_step: np.ndarray) -> np.ndarray:
    """b_t = r_t·ρ_t/(1 − ρ_t): the Banach bound on ‖h_t − h*‖/‖h_t‖ ([BA]); NaN where ρ_t ≥ 1 or undefined.

    Args:
        rho: [token, loop] local contraction ρ_t (``contraction``).
        rel_step: [token, loop] r_t = ‖Δ_t‖/‖h_t‖.

    Returns:
        [token, loop] float64.
    """
    rho = np.asarray(rho, dtype=np.float64)
    ok = rho < 1  # NaN compares False
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(ok, np.asarray(rel_step, dtype=np.float64) * rho / (1 - rho), np.nan)
