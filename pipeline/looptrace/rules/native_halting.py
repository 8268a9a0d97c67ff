"""Per-step exit rules of the native halting heads that do not exit by the Q-exit CDF (SPEC §4, §5).

The store's ``gate_logit`` of every gated regime is a stop logit (``looptrace.models.regimes``): λ_t = σ(g_t) is
the probability of halting at t given t was reached. ``q_exit`` (Ouro, PonderNet = ``joint``) exits on the CDF
1 − Π_{j≤t}(1 − λ_j). Two heads are trained for another reading of the same λ_t, and exit by it here, each at the
threshold its method defines (the rule declares it, :attr:`~looptrace.rules.base.ExitRule.thresholds`; no val
calibration):

- ``gate_step`` — [RT]'s halting head (``recurtrace``): a per-step classifier of "a later loop no longer lowers the
  loss by δ", trained by BCE, so it exits at min{t : λ_t ≥ 0.5} (the classifier's decision). This is the rule of
  the refit label gates (SPEC §4 "offline gate": min{t : P(stop | features_t) ≥ γ}), applied to the native head.
- ``act_exit`` — ACT (Graves 2016): N = min{t : Σ_{j≤t} λ_j ≥ 1 − ε}, else T, with ε the one the model's ``act``
  regime trained with (``train.regime_defs.<name>.eps``): the N its training loss used
  (:func:`looptrace.models.regimes.act_halting`). On a model trained otherwise, Graves' ε =
  :data:`~looptrace.signals.halting.ACT_EPS`.

``gate_step_calibrated`` and ``act_exit_calibrated`` read the same scores at thresholds calibrated like every
threshold rule (the val quantile grid, SPEC §4): the head's whole frontier, and a point tuned on val, beside the
method's own. (``q_exit``'s q is a user setting of Ouro's forward, not a trained quantity: it stays calibrated.)
Registered by :mod:`looptrace.rules.registry`; not among the default ``readouts.rules`` (profiles/halting lists
them).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np

from looptrace.rules.base import ExitRule
from looptrace.signals import keep_rows
from looptrace.signals.halting import ACT_EPS

#: RecurTrace's head is a stop classifier: its own decision is P(stop) ≥ 0.5.
GATE_STEP_GAMMA = 0.5


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


def act_eps(regime: Mapping[str, Any] | None) -> float:
    """ε of ACT's halting threshold 1 − ε for a model: its ``act`` regime's ``eps`` (the regime's default when the
    definition leaves it out), else Graves' :data:`~looptrace.signals.halting.ACT_EPS`."""
    if regime is not None and regime.get("kind") == "act" and regime.get("eps") is not None:
        return float(regime["eps"])
    return ACT_EPS


def act_native_threshold(n_loops: int, cfg: Any, regime: Mapping[str, Any] | None) -> list[float]:
    """``act_exit``'s one threshold, 1 − ε (:func:`act_eps`): its native exit is ACT's N."""
    return [1.0 - act_eps(regime)]


#: The exit rule each gated regime kind's head is trained for (SPEC §4, §5): what "the native head" means for it,
#: at its method's own threshold.
NATIVE_EXITS = {"joint": "q_exit", "recurtrace": "gate_step", "act": "act_exit"}
#: The same heads at a val-calibrated threshold (the quantile grid): their whole test frontier (the equal-depth
#: comparisons of SPEC §7 "Halting findings") and the halting table's "native, γ calibrated on val" row.
#: ``q_exit`` is calibrated already (its q is a user setting).
NATIVE_CALIBRATED = {"joint": "q_exit", "recurtrace": "gate_step_calibrated", "act": "act_exit_calibrated"}
#: Where each regime kind (``looptrace.models.regimes.KINDS``) comes from (tables, reports).
REGIME_SOURCES = {"final": "—", "uniform": "[AD]", "geometric": "[AD]", "joint": "PonderNet; Ouro stage I",
                  "recurtrace": "[RT]", "act": "Graves 2016 (ACT)"}


def _gate_step_score(s: Mapping[str, np.ndarray]) -> np.ndarray:
    return stop_prob(s["gate_logit"])


def _act_score(s: Mapping[str, np.ndarray]) -> np.ndarray:
    return act_cumulative(s["gate_logit"])


GATE_STEP = ExitRule(
    name="gate_step", score=_gate_step_score, signals=("gate_logit",), op="ge", kind="native",
    thresholds=(GATE_STEP_GAMMA,), online=GateStepOnline,  # [RT]
    description="exit when the native head's per-step stop probability σ(gate_t) reaches 0.5 (RecurTrace's "
                "oracle-supervised head at its own decision; the refit label gates' rule; gated models only)")
ACT_EXIT = ExitRule(
    name="act_exit", score=_act_score, signals=("gate_logit",), op="ge",
    kind="native", thresholds=act_native_threshold, online=ActExitOnline,  # Graves 2016
    description="ACT's halting step N: exit when the native gate's cumulative halting mass Σ σ(gate_j) reaches "
                "1 − ε, ε of the model's act regime (Graves' 0.01 on other models; gated models only)")

NATIVE_HALTING_RULES: dict[str, ExitRule] = {r.name: r for r in (
    GATE_STEP,
    ACT_EXIT,
    # the same scores on the quantile grid (no thresholds of their own)
    dataclasses.replace(GATE_STEP, name="gate_step_calibrated", thresholds=None,
                        description="gate_step with γ calibrated on val (the quantile grid) instead of 0.5: the "
                                    "head's frontier (gated models only)"),
    dataclasses.replace(ACT_EXIT, name="act_exit_calibrated", thresholds=None,
                        description="act_exit with γ calibrated on val (the quantile grid) instead of 1 − ε: the "
                                    "head's frontier (gated models only)"),
)}
