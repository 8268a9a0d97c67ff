"""The ``diagnose`` section (``DiagnoseConfig``) and the constants of SPEC §7 and [AD] the stage uses."""

from __future__ import annotations

from dataclasses import dataclass, field

from looptrace.config import OMIT_DEFAULT, ConfigError

#: Failure classes in output order (SPEC §7); codes are their indices.
CLASSES = ("correct", "trajectory", "readout_early", "readout_overthinking")

#: Regime kinds with a fixed depth prior ([AD]'s "fixed-prior" trajectories).
FIXED_PRIOR_KINDS = ("uniform", "geometric")


def fixed_prior_trajectory(regime_kind: str | None, regime_def: dict | None = None) -> bool:
    """Whether a model's *trajectory* was trained by a fixed depth prior alone ([AD]'s "fixed-prior"
    trajectories, where a claim is about the trajectory's training objective; SPEC §7 "[AD]'s claims"): the
    fixed-prior kinds, and a RecurTrace model whose halting head is decoupled (``recurtrace`` with ``detach``
    true, the default: its trajectory loss is Σ π_t ℓ_t under the fixed prior π and the head's gradient stops at
    the state, [RT]/[AD]). Not ``recurtrace`` with ``detach: false`` (the head's BCE reaches the trajectory),
    ``joint`` or ``act`` (halting and trajectory trained together), ``final``.

    Args:
        regime_kind: the regime's kind (readouts' metrics.json ``regime_kind``).
        regime_def: the regime's definition as the params file gives it (metrics.json ``regime_def``; a field
            left out has its default).
    """
    if regime_kind in FIXED_PRIOR_KINDS:
        return True
    return regime_kind == "recurtrace" and (regime_def or {}).get("detach", True) is not False

#: [AD]'s headline numbers (SPEC §9), quoted beside ours.
AD_REFERENCE = {"confidence_d95": 1.38, "fixed_d95": 2.50, "native_d95": 4.49}


@dataclass(frozen=True)
class DiagnoseConfig:
    """``diagnose`` section of ``params.yaml``.

    Attributes:
        x: the D@X target (percent) the claims of the summary are tested at ([AD]: 95).
        gap_tol: loops; a depth difference smaller than this is "no material difference" (verdicts,
            "strong" gates in claim (c)).
        spearman_signals: token_loop columns correlated with difficulty (plus ``oracle_depth``, always).
        spearman_headline: the signal quoted in the summary ([AD]: entropy ≈ 1.0 under fixed priors).
        spearman_loop: loop of the headline (1..T), or null for the per-token mean over the signal's
            defined loops.
        spearman_aggregation: headline aggregation: ``difficulty_mean`` (Spearman over difficulty levels
            of the per-level mean signal) or ``token`` (over test tokens).
        spearman_intervals: which spearman.parquet rows get a bootstrap interval (over test sequences, the
            ``intervals`` section's B and level): ``headline`` (the headline signal × loop × aggregation of
            every model; the others have NaN bounds and n_boot 0) or ``all`` (every row; ≈ 0.8 s per
            token-aggregation row at 20 k tokens × B = 1000).
        faithfulness_resamples: Monte-Carlo permutations B of the counterfactual faithfulness test of every
            rule, gate and native head at its chosen point (SPEC §7a, ``faithfulness.parquet``); 0 = no test.
        faithfulness_alpha: its level (a signal is ``faithful`` when p < α and its saving's interval is above 0).
        router_baselines: the training-free stabilisation rules (readouts rules) that [FP]'s router on
            convergence labels (refit gates ``*-converged``) is compared with, at their chosen points
            (``convergence_router.parquet``).
        halting_table: also write the halting methods' matched-compute table (``halting_table.parquet`` and a
            summary.md section; :mod:`looptrace.diagnose.halting_table`). Off by default (profiles/halting).
        collapse_tol: loops; a method whose mean loops is ≤ 1 + this "collapses to one loop" (halting table).
        convergence_signal, convergence_eps, convergence_kind: the convergence depth of the halting findings
            (geometry's convergence.parquet: signal, one of geometry.eps, first | settled; SPEC §2), with
            ``halting_table`` only (:mod:`looptrace.diagnose.halting_findings`).
    """

    x: float = 95.0
    gap_tol: float = 0.5
    spearman_signals: tuple[str, ...] = ("entropy", "max_prob", "margin", "kl_prev", "logit_change", "rel_step",
                                         "state_cos_dist", "accel", "step_norm")
    spearman_headline: str = "entropy"
    spearman_loop: int | None = None
    spearman_aggregation: str = "difficulty_mean"
    spearman_intervals: str = "headline"
    faithfulness_resamples: int = 199
    faithfulness_alpha: float = 0.05
    router_baselines: tuple[str, ...] = ("argmax_stable", "kl_prev")
    halting_table: bool = field(default=False, metadata=OMIT_DEFAULT)
    collapse_tol: float = field(default=0.1, metadata=OMIT_DEFAULT)
    convergence_signal: str = field(default="kl_prev", metadata=OMIT_DEFAULT)
    convergence_eps: float = field(default=0.001, metadata=OMIT_DEFAULT)
    convergence_kind: str = field(default="settled", metadata=OMIT_DEFAULT)

    def __post_init__(self) -> None:
        if not 0.0 < self.x <= 100.0:
            raise ConfigError(f"diagnose.x is an accuracy percentage in (0, 100], got {self.x}")
        if self.gap_tol < 0:
            raise ConfigError(f"diagnose.gap_tol must be ≥ 0 loops, got {self.gap_tol}")
        if self.spearman_aggregation not in ("difficulty_mean", "token"):
            raise ConfigError("diagnose.spearman_aggregation must be 'difficulty_mean' or 'token', got "
                              f"{self.spearman_aggregation!r}")
        if self.spearman_intervals not in ("headline", "all"):
            raise ConfigError("diagnose.spearman_intervals must be 'headline' or 'all', got "
                              f"{self.spearman_intervals!r}")
        if self.spearman_headline not in (*self.spearman_signals, "oracle_depth"):
            raise ConfigError(f"diagnose.spearman_headline '{self.spearman_headline}' must be one of "
                              "diagnose.spearman_signals or 'oracle_depth'")
        if self.faithfulness_resamples < 0:
            raise ConfigError(f"diagnose.faithfulness_resamples must be ≥ 0 (0 = no faithfulness test), got "
                              f"{self.faithfulness_resamples}")
        if not 0.0 < self.faithfulness_alpha < 1.0:
            raise ConfigError(f"diagnose.faithfulness_alpha must be in (0, 1), got {self.faithfulness_alpha}")
        if self.convergence_kind not in ("first", "settled"):
            raise ConfigError(f"diagnose.convergence_kind must be first or settled, got {self.convergence_kind!r}")
        if self.collapse_tol < 0:
            raise ConfigError(f"diagnose.collapse_tol must be ≥ 0 loops, got {self.collapse_tol}")
        if self.spearman_loop is not None and self.spearman_loop < 1:
            raise ConfigError(f"diagnose.spearman_loop must be ≥ 1 or null, got {self.spearman_loop}")
