"""The *certified fixed-point* exit (SPEC §2b, §4; Banach's fixed-point theorem [BA]) as an exit rule, and its
*estimated* twin: the ``certified_fixed_point`` and ``estimated_fixed_point`` rules, registered here (importing
:mod:`looptrace.rules` registers them).

If the loop map is a contraction with constant ρ < 1 between h_t and the fixed point h*, then
‖h_t − h*‖ ≤ ‖Δ_t‖·ρ/(1 − ρ) ([BA], a posteriori estimate); the relative bound is b_t = r_t·ρ/(1 − ρ) with
r_t = ``rel_step`` = ‖Δ_t‖/‖h_t‖ (:func:`looptrace.signals.certified.certified_bound`). The rule exits at the first t
with b_t ≤ ε; where ρ ≥ 1 the bound is undefined (NaN) and the rule never fires. ε is calibrated like every
threshold rule (the [AD] quantile grid of the val bound, SPEC §4).

- ``certified_fixed_point`` uses ρ̄_t = ``contraction_bound``, an *upper* bound of the token's Jacobian block norm
  σ_max(J_t[i, i]) (its exact float64 value plus a rounding margin, :mod:`looptrace.capture.contraction`), as a
  certificate needs. It is computed only up to ``dump.contraction.exact_width``; a wider model's bound is NaN and
  this rule refuses it in one line (use ``estimated_fixed_point`` there). What the certificate still assumes: for a
  nonlinear loop map, that ‖J_ii‖₂ stays ≤ ρ̄_t on the way from h_t to h* (one point's derivative is not a Lipschitz
  constant; exact for an affine map), and that the other positions hold still (the block is the token's own).
- ``estimated_fixed_point`` uses ρ_t = ``contraction``: the same exact value up to ``exact_width`` (where the two
  rules agree up to the margin), a power-method estimate — a *lower* bound of σ_max, so b_t can undercut the true
  distance — beyond it. An estimate, never a certificate.

Both read opt-in store arrays (``dump.contraction: {}``): the geometry stage copies them into
``token_loop.parquet`` only when the store has them, so the rules can run only on such models (add them to
``readouts.rules``). The early-exit engine computes no Jacobian, so the rules are offline-only (``online=None``):
``latency.rules`` / ``generate`` refuse them in one line, as they refuse the oracle.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from looptrace.config import InputError
from looptrace.rules.base import ExitRule
from looptrace.rules.registry import register
from looptrace.signals.certified import certified_bound


def certified_score(s: Mapping[str, np.ndarray]) -> np.ndarray:
    """b_t = r_t·ρ̄_t/(1 − ρ̄_t) from ``contraction_bound`` ρ̄_t and ``rel_step`` r_t; NaN (never fires) where
    ρ̄_t ≥ 1.

    Raises:
        InputError: ``contraction_bound`` is NaN everywhere: the model is wider than ``dump.contraction.exact_width``
            (no upper bound was computed).
    """
    upper = np.asarray(s["contraction_bound"])
    if upper.size and np.isnan(upper).all():
        raise InputError("readouts rule 'certified_fixed_point': no upper bound of the Jacobian norm was stored "
                         "(contraction_bound is NaN: d_model > dump.contraction.exact_width); raise exact_width and "
                         "re-run dump and geometry, or use estimated_fixed_point (an estimate, not a certificate)")
    return certified_bound(upper, s["rel_step"])


def estimated_score(s: Mapping[str, np.ndarray]) -> np.ndarray:
    """b_t = r_t·ρ_t/(1 − ρ_t) from ``contraction`` ρ_t (exact or a power-method estimate) and ``rel_step``."""
    return certified_bound(s["contraction"], s["rel_step"])


CERTIFIED = register(ExitRule(
    name="certified_fixed_point", score=certified_score, signals=("contraction_bound", "rel_step"), op="le",
    kind="posthoc", online=None, origin="looptrace.rules.certified",
    description="certified fixed point [BA]: exit when rel_step·ρ̄/(1 − ρ̄) ≤ ε with ρ̄ an upper bound of the "
                "token's Jacobian norm (never where ρ̄ ≥ 1); needs dump.contraction with d_model ≤ exact_width; "
                "offline only"))

ESTIMATED = register(ExitRule(
    name="estimated_fixed_point", score=estimated_score, signals=("contraction", "rel_step"), op="le",
    kind="posthoc", online=None, origin="looptrace.rules.certified",
    description="estimated fixed point: the certified rule's bound with ρ_t = contraction (a power-method lower "
                "bound beyond dump.contraction.exact_width: not a certificate); needs dump.contraction; offline only"))
