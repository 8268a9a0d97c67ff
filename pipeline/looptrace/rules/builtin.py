"""The built-in exit rules of SPEC §4, registered in output order (:data:`BUILTIN_RULES`).

Each is an :class:`~looptrace.rules.base.ExitRule`: threshold rules score their token_loop column
directly (``online='signal'``: the engine compares the live signal); ``fixed`` scores the loop index
(thresholds 1..T), ``argmax_stable`` Huginn's counter of consecutive equal-argmax transitions (thresholds ``readouts.argmax_stable_n``),
``q_exit`` the halting CDF of the native gate, and the ``oracle`` ceiling the correctness (no threshold,
never run online).

Registered beside them but not among the defaults (:data:`ALL_RULES`): ``q_exit_bfloat16``,
``q_exit_float16`` and ``q_exit_float32``, Ouro's Q-exit in the arithmetic of a checkpoint run in that dtype
(:func:`looptrace.signals.halting.ouro_halting_cdf`). ``q_exit`` is the exact float64 CDF of the same gate; a
bf16 Ouro rounds σ(g) to 1 for g ≳ 6.3 and its CDF reaches q earlier, so only the variant of the model's dtype
reproduces the checkpoint's own ``forward(exit_threshold=q)`` (at threshold ``ouro_threshold(q, dtype)``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from looptrace.rules.base import SIGNAL, ExitRule
from looptrace.rules.scoring import exit_depths
from looptrace.signals.firing import ArgmaxStableCount, argmax_stable_count
from looptrace.signals.halting import OURO_DTYPES, HaltingCDF, OuroHaltingCDF, halting_cdf, ouro_halting_cdf


def _column(col: str):
    def score(s: Mapping[str, np.ndarray]) -> np.ndarray:
        return s[col]

    score.__name__ = score.__qualname__ = col
    return score


class ArgmaxStableOnline:
    """Online ``argmax_stable``: Huginn's counter (:class:`~looptrace.signals.firing.ArgmaxStableCount`) on the live
    argmax, loop by loop ([batch, seq])."""

    def __init__(self) -> None:
        self.counter = ArgmaxStableCount()

    def update(self, t: int, s: Mapping[str, np.ndarray]) -> np.ndarray:
        return self.counter.update(s["argmax"]).astype(np.float64)

    def compact(self, rows, seq: int | None) -> None:
        self.counter.compact(rows, seq)


class QExitOnline:
    """Online ``q_exit``: the halting CDF of the live gate logits (:class:`~looptrace.signals.halting.HaltingCDF`)."""

    def __init__(self) -> None:
        self.cdf = HaltingCDF()

    def update(self, t: int, s: Mapping[str, np.ndarray]) -> np.ndarray:
        return self.cdf.update(s["gate_logit"])

    def compact(self, rows, seq: int | None) -> None:
        self.cdf.compact(rows, seq)


class OuroQExitOnline:
    """Online ``q_exit_<dtype>``: Ouro's exit CDF in the model dtype, loop by loop (:class:`OuroHaltingCDF`)."""

    def __init__(self, dtype: str) -> None:
        self.cdf = OuroHaltingCDF(dtype)

    def update(self, t: int, s: Mapping[str, np.ndarray]) -> np.ndarray:
        return self.cdf.update(s["gate_logit"])

    def compact(self, rows, seq: int | None) -> None:
        self.cdf.compact(rows, seq)


def _ouro_q_exit(dtype: str) -> ExitRule:
    def score(s: Mapping[str, np.ndarray]) -> np.ndarray:
        return ouro_halting_cdf(s["gate_logit"], dtype)

    return ExitRule(name=f"q_exit_{dtype}", score=score, signals=("gate_logit",), op="ge", kind="native",
                    online=lambda: OuroQExitOnline(dtype),
                    description=f"q_exit in {dtype} arithmetic, as an Ouro checkpoint run in {dtype} computes it "
                                "(reproduces its own forward(exit_threshold=q))")


def _threshold(name: str, col: str, op: str, min_loop: int = 1, two_hit: bool = False) -> ExitRule:
    return ExitRule(name=name, score=_column(col), signals=(col,), op=op, min_loop=min_loop, two_hit=two_hit,
                    online=SIGNAL)


_RULES = (
    ExitRule(name="fixed", score=_column("loop"), signals=("loop",), op="ge", kind="fixed",
             thresholds=lambda T, cfg, regime: range(1, T + 1), online=SIGNAL),
    _threshold("entropy", "entropy", "le"),                   # [AD]
    _threshold("top1", "max_prob", "ge"),                     # [AD], CALM softmax_max
    _threshold("margin", "margin", "ge"),                     # [AD] logit gap
    _threshold("kl_prev", "kl_prev", "le", 2),                # [AD] KL(p_t ‖ p_{t−1})
    _threshold("kl_prev_rev", "kl_prev_rev", "le", 2),        # Huginn KL(p_{t−1} ‖ p_t)
    _threshold("logit_change", "logit_change", "le", 2),
    _threshold("hidden_change", "hidden_change", "le", 2),
    _threshold("rel_step", "rel_step", "le", 2),              # Huginn latent-diff
    _threshold("state_cosine", "state_cos_dist", "le", 2),    # Huginn cosine, CALM state
    _threshold("accel_two_hit", "accel", "le", 3, True),      # [TS]: a_t ≤ τ and a_{t−1} ≤ τ
    ExitRule(name="argmax_stable", score=lambda s: argmax_stable_count(s["argmax"]), signals=("argmax",), op="ge",
             thresholds=lambda T, cfg, regime: cfg.argmax_stable_n, online=ArgmaxStableOnline,  # Huginn
             description="exit when the argmax has not changed for k consecutive transitions (Huginn's counter; "
                         "k = readouts.argmax_stable_n, Huginn's default 5 = six equal loops)"),
    ExitRule(name="q_exit", score=lambda s: halting_cdf(s["gate_logit"]), signals=("gate_logit",), op="ge",
             kind="native", online=QExitOnline,               # Ouro
             description="exit when the native gate's cumulative halting probability reaches q (Ouro's Q-exit; "
                         "gated models only)"),
    ExitRule(name="oracle", score=_column("correct"), signals=("correct",), op="ge", kind="oracle",
             thresholds=(1.0,), online=None),                 # [AD] ceiling, not a rule
)

#: Every built-in rule, by name, in output order.
BUILTIN_RULES: dict[str, ExitRule] = {r.name: r for r in _RULES}
#: Ouro's Q-exit in a model dtype (``q_exit_bfloat16`` ...): registered by name, not among the defaults.
OURO_Q_EXIT_RULES: dict[str, ExitRule] = {r.name: r for r in map(_ouro_q_exit, OURO_DTYPES)}
#: Their names (the default ``readouts.rules``).
ALL_RULES = tuple(BUILTIN_RULES)
#: Confidence readouts of [AD] (claim (a) of the diagnosis).
CONFIDENCE_RULES = ("entropy", "top1", "margin")
#: Per-(token, loop) columns of token_loop.parquet the readouts stage reads (every built-in's signals).
LOOP_COLUMNS = ("loop", "argmax", "correct", "target_logprob", "gate_logit",
                *sorted({s for r in _RULES for s in r.signals} - {"loop", "argmax", "correct", "gate_logit"}))


def oracle_depths(correct: np.ndarray) -> np.ndarray:
    """Oracle earliest-correct depth ([AD] ceiling): min{t : argmax_t = y}, else T ([token] int64, 1-based)."""
    r = BUILTIN_RULES["oracle"]
    score = r.score_of({"correct": np.asarray(correct, dtype=bool)})
    vals = r.calibration_values(0)
    assert vals is not None  # the oracle's thresholds are explicit
    return exit_depths(score, vals, r.op)[0]


def argmax_stable_depths(argmax: np.ndarray, ns: Sequence[int]) -> np.ndarray:
    """``argmax_stable n`` as Huginn's evaluator counts it: min{t : c_t ≥ n} (:func:`argmax_stable_count`), else T.

    n counts *transitions*: the exit needs n + 1 consecutive equal argmaxes, so the earliest exit is t = n + 1
    (n = 0 exits at 1; Huginn's default n = 5 needs six equal loops).

    Returns:
        [len(ns), token] int64 1-based exit depths.
    """
    return exit_depths(argmax_stable_count(argmax), np.asarray(ns, dtype=np.float64), "ge")


def grid_window(score: np.ndarray, min_loop: int, two_hit: bool) -> np.ndarray:
    """The loops a rule reads (t ≥ min_loop, and t − 1 for two-hit rules): its calibration values."""
    return score[:, max(0, min_loop - 1 - int(two_hit)):]
