"""The *certified fixed-point* exit (SPEC §2b, §4; Banach's fixed-point theorem [BA]) as an exit rule: the
``certified_fixed_point`` rule, registered here (importing :mod:`looptrace.rules` registers it).

If the loop map is a contraction with constant ρ < 1 near the fixed point h*, then
‖h_t − h*‖ ≤ ‖Δ_t‖·ρ/(1 − ρ) ([BA], a posteriori estimate); with the local contraction ρ_t (``contraction``, the top
singular value of the token's own Jacobian block, :mod:`looptrace.capture.contraction`) in place of ρ, the relative
bound is b_t = r_t·ρ_t/(1 − ρ_t) with r_t = ``rel_step`` = ‖Δ_t‖/‖h_t‖
(:func:`looptrace.signals.certified.certified_bound`). The rule exits at the first t with b_t ≤ ε; where ρ_t ≥ 1
the bound is undefined (NaN) and the rule never fires. ε is calibrated like every threshold rule (the [AD]
quantile grid of the val bound, SPEC §4). ρ_t is a local, estimated (power-method) contraction, so the
"certificate" holds only as far as ρ_t bounds the map's Lipschitz constant between h_t and h*.

It reads ``contraction``, an opt-in store array (``dump.contraction: {power_iters: 2}``): the geometry stage copies it
into ``token_loop.parquet`` only when the store has it, so the rule can run only on such models (add
``certified_fixed_point`` to ``readouts.rules``). The early-exit engine computes no Jacobian, so the rule is
offline-only (``online=None``): ``latency.rules`` / ``generate`` refuse it in one line, as they refuse the oracle.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from looptrace.rules.base import ExitRule
from looptrace.rules.registry import register
from looptrace.signals.certified import certified_bound


def certified_score(s: Mapping[str, np.ndarray]) -> np.ndarray:
    """b_t = r_t·ρ_t/(1 − ρ_t) from ``contraction`` ρ_t and ``rel_step`` r_t; NaN (never fires) where ρ_t ≥ 1."""
    return certified_bound(s["contraction"], s["rel_step"])


CERTIFIED = register(ExitRule(
    name="certified_fixed_point", score=certified_score, signals=("contraction", "rel_step"), op="le",
    kind="posthoc", online=None, origin="looptrace.rules.certified",
    description="certified fixed point [BA]: exit when rel_step·ρ/(1 − ρ) ≤ ε (never where ρ ≥ 1); needs "
                "dump.contraction; offline only"))
