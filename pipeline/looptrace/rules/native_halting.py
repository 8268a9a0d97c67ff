"""Per-step exit rules of the native halting heads that do not exit by the Q-exit CDF (SPEC §4, §5).

The store's ``gate_logit`` of every gated regime is a stop logit (``looptrace.models.regimes``): λ_t = σ(g_t) is
the probability of halting at t given t was reached. ``q_exit`` (Ouro, PonderNet = ``joint``) exits on the CDF
1 − Π_{j≤t}(1 − λ_j). Two heads are trained for another reading of the same λ_t, and exit by it here:

- ``gate_step`` — [RT]'s halting head (``recurtrace``): a per-step classifier of "a later loop no longer lowers the
  loss by δ", so it exits at min{t : λ_t ≥ γ} (native γ = 0.5). This is the rule of the refit label gates (SPEC §4
  "offline gate": min{t : P(stop | features_t) ≥ γ}), applied to the native head.
- ``act_exit`` — ACT (Graves 2016): min{t : Σ_{j≤t} λ_j ≥ γ} (native γ = 1 − ε).

Both are calibrated like every rule (the val quantile grid, SPEC §4); the native γ is one point of that grid's
range. Registered by :mod:`looptrace.rules.registry`; not among the default ``readouts.rules`` (profiles/halting
lists them).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from looptrace.rules.base import ExitRule
from looptrace.signals import keep_rows


def stop_prob(gate_logit: np.ndarray) -> np.ndarray:
    """λ = σ(g) in float64 (one function for the offline score and the online rule: the same bits)."""
    return np.exp(-np.logaddexp(0.0, -np.asarray(gate_logit, dtype=np.float64)))


class GateStepOnline:
    """Online ``gate_step``: λ_t of the live gate logits ([batch, seq])."""

    def update(self, t: int, s: Mapping[str, np.ndarray]) -> np.ndarray:
        return stop_prob(s["gate_logit"])

    def compact(self, rows, seq: int | None) -> None:
        pass


class ActExitOnline:
    """Online ``act_exit``: the running Σ_{j≤t} λ_j, added left to right as :func:`act_cumulative` does."""

    def __init__(self) -> None:
        self._sum: np.ndarray | None = None

    def update(self, t: int, s: Mapping[str, np.ndarray]) -> np.ndarray:
        lam = stop_prob(s["gate_logit"])
        self._sum = lam if self._sum is None else self._sum + lam
        return self._sum

    def compact(self, rows, seq: int | None) -> None:
        if self._sum is not None:
            self._sum = keep_rows(self._sum, rows, seq)


def act_cumulative(gate_logit: np.ndarray) -> np.ndarray:
    """ACT's cumulative halting mass Σ_{j≤t} σ(g_j): [token, loop] float64."""
    return np.cumsum(stop_prob(gate_logit), axis=1)


#: The exit rule each gated regime kind's head is trained for (SPEC §4, §5): what "the native head" means for it.
NATIVE_EXITS = {"joint": "q_exit", "recurtrace": "gate_step", "act": "act_exit"}
#: Where each regime kind (``looptrace.models.regimes.KINDS``) comes from (tables, reports).
REGIME_SOURCES = {"final": "—", "uniform": "[AD]", "geometric": "[AD]", "joint": "PonderNet; Ouro stage I",
                  "recurtrace": "[RT]", "act": "Graves 2016 (ACT)"}

NATIVE_HALTING_RULES: dict[str, ExitRule] = {r.name: r for r in (
    ExitRule(name="gate_step", score=lambda s: stop_prob(s["gate_logit"]), signals=("gate_logit",), op="ge",
             kind="native", online=GateStepOnline,  # [RT]
             description="exit when the native head's per-step stop probability σ(gate_t) reaches γ (RecurTrace's "
                         "oracle-supervised head, native γ = 0.5; the refit label gates' rule; gated models only)"),
    ExitRule(name="act_exit", score=lambda s: act_cumulative(s["gate_logit"]), signals=("gate_logit",), op="ge",
             kind="native", online=ActExitOnline,  # Graves 2016
             description="exit when the native gate's cumulative halting mass Σ σ(gate_j) reaches γ (ACT, native "
                         "γ = 1 − ε; gated models only)"),
)}
