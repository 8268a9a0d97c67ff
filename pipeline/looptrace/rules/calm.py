"""CALM (Schuster et al. 2022, "Confident Adaptive Language Modeling") as an exit rule: the ``calm`` rule,
registered here (importing :mod:`looptrace.rules` registers it).

**Confidence measure.** CALM's softmax response: the gap between the two largest softmax probabilities,
s_t = p_(1) − p_(2) ∈ [0, 1]. From the stored statistics exactly: p_(2) / p_(1) = exp(z_(2) − z_(1)) =
exp(−M_t), so s_t = C_t · (1 − exp(−M_t)) with C_t = ``max_prob`` and M_t = ``margin`` (SPEC §3). The rule exits
at the first loop with s_t ≥ λ (CALM's local exit decision, min_loop 1).

**Calibration** (CALM §3, via Learn-then-Test, Angelopoulos et al. 2021): the threshold is the smallest λ of a
fixed candidate grid whose *textual-consistency* risk against the full model is certified ≤ δ with probability
≥ 1 − ε on val:

- consistency loss of a val sequence s at λ: L_s(λ) = the fraction of its scored tokens whose exit prediction
  differs from full depth, 1[argmax_{d(λ)} ≠ argmax_T] — the ``consistent`` labels of the gates (SPEC §6) read
  at the exit. Sequences are the calibration examples (LTT needs i.i.d. examples; tokens of a sequence share a
  prefix), so n = the number of val sequences and R̂(λ) = (1/n) Σ_s L_s(λ) ∈ [0, 1];
- p-value of H_λ: R(λ) > δ, Hoeffding–Bentkus (Bates et al. 2021, the bound CALM uses):
  p(λ) = min( exp(−n · h(min(R̂, δ), δ)), e · P(Binomial(n, δ) ≤ ⌈n R̂⌉) ), h(a, b) = a log(a/b) + (1 − a) log((1 −
  a)/(1 − b));
- fixed-sequence testing: candidates ordered from the most conservative (largest λ) down; H_λ is rejected while
  p(λ) ≤ ε; λ̂ = the last rejected one. The grid's first candidate λ = 1.5 > max s never fires (the full model,
  risk 0), so λ̂ always exists; if nothing else is certified, CALM's point is full depth.

The variant implemented is CALM's *textual consistency* objective (not its *risk consistency*, which would need
the gold loss) with the softmax-response measure and a global (not per-layer-decaying) threshold. The candidate
grid (:func:`calm_grid`) is 1.5, 1.0 and 1 − 10^(−x) for 49 values of x from 6 down to 0 (fine near 1, where a
trained looped model's confident tokens sit); every candidate is also an operating point of the frontier.
δ and ε are ``readouts.calm_delta`` / ``readouts.calm_epsilon``. The chosen point is CALM's λ̂, not the [AD]
δ-accuracy point (``within_delta`` in chosen.parquet says whether it also meets that).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from looptrace.io.tables import SplitArrays
from looptrace.rules.base import ExitRule
from looptrace.rules.registry import register

#: A λ above any softmax response: the candidate that never exits early (the full model).
NEVER = 1.5


def softmax_response(s: Mapping[str, np.ndarray]) -> np.ndarray:
    """CALM's softmax response p_(1) − p_(2) = C · (1 − exp(−M)) from ``max_prob`` C and ``margin`` M."""
    c = np.asarray(s["max_prob"], dtype=np.float64)
    m = np.asarray(s["margin"], dtype=np.float64)
    return c * -np.expm1(-m)


def calm_grid(n_loops: int = 0, cfg: Any = None) -> np.ndarray:
    """The 51 candidate thresholds (as many operating points as the default quantile grid), most conservative
    first: ``NEVER``, 1, then 1 − 10^(−x) for 49 values of x from 6 down to 0 (the last is λ = 0: exit at loop 1)."""
    return np.r_[NEVER, 1.0, 1.0 - np.logspace(-6, 0, 49)]


def hb_pvalue(risk: float, n: int, delta: float) -> float:
    """Hoeffding–Bentkus p-value of H: R > δ given the empirical risk R̂ of n i.i.d. losses in [0, 1]."""
    from scipy.stats import binom

    a = min(float(risk), delta)
    h = (a * math.log(a / delta) if a > 0 else 0.0) + (1 - a) * math.log((1 - a) / (1 - delta))
    hoeffding = math.exp(-n * h)
    bentkus = math.e * float(binom.cdf(math.ceil(n * float(risk) - 1e-9), n, delta))
    return min(hoeffding, bentkus, 1.0)


def consistency_risks(depths: np.ndarray, argmax: np.ndarray, unit: np.ndarray | None) -> tuple[np.ndarray, int]:
    """R̂ per candidate: the mean over calibration units (sequences) of each unit's share of tokens whose exit
    argmax differs from argmax_T.

    Args:
        depths: [K, token] 1-based exit depths of each candidate.
        argmax: [token, loop] predictions.
        unit: [token] sequence ids (None = every token its own unit).

    Returns:
        ([K] risks, n units).
    """
    d = np.asarray(depths, dtype=np.int64)
    am = np.asarray(argmax)
    n_tok = am.shape[0]
    wrong = am[np.arange(n_tok)[None, :], d - 1] != am[:, -1][None, :]  # [K, token]
    idx = np.arange(n_tok) if unit is None else np.unique(np.asarray(unit), return_inverse=True)[1].ravel()
    n = int(idx.max()) + 1 if n_tok else 0
    per_unit = np.stack([np.bincount(idx, weights=w, minlength=n) for w in wrong.astype(np.float64)])
    size = np.bincount(idx, minlength=n).astype(np.float64)
    return (per_unit / size).mean(axis=1), n


def ltt_choice(thresholds: np.ndarray, risks: np.ndarray, n: int, delta: float, epsilon: float
               ) -> tuple[int, np.ndarray]:
    """Learn-then-Test with fixed-sequence testing: the index of λ̂ and every candidate's p-value.

    Candidates are tested from the largest λ down (the most conservative first); the walk stops at the first
    p > ε. The largest λ is always taken (it is certified or, failing that, the most conservative there is).
    """
    th = np.asarray(thresholds, dtype=np.float64)
    p = np.array([hb_pvalue(r, n, delta) for r in risks])
    order = np.argsort(-th, kind="stable")
    k = int(order[0])
    for j in order[1:]:
        if p[j] > epsilon:
            break
        k = int(j)
    return k, p


def _choose(val_depths: np.ndarray, val: SplitArrays, thresholds: np.ndarray, cfg: Any) -> int:
    """The ``choose`` hook of the rule: CALM's λ̂ on val (module docstring)."""
    risks, n = consistency_risks(val_depths, val.loop["argmax"], val.fields.get("sequence"))
    return ltt_choice(thresholds, risks, n, cfg.calm_delta, cfg.calm_epsilon)[0]


CALM = register(ExitRule(
    name="calm", score=softmax_response, signals=("max_prob", "margin"), op="ge", kind="posthoc",
    thresholds=lambda T, cfg, regime: calm_grid().tolist(), choose=_choose, origin="looptrace.rules.calm",
    description="CALM: exit when the softmax response p1 − p2 ≥ λ, λ certified on val by Learn-then-Test "
                "(consistency with full depth ≥ 1 − δ w.p. 1 − ε; readouts.calm_delta / calm_epsilon)"))
