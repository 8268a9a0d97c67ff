"""Failure localisation and the trajectory-vs-readout verdict (the ``diagnose`` stage, SPEC §7).

For every model × rule at its chosen operating point (readouts' rules and, when present, the offline
gates'), each test token falls in exactly one class:

- ``correct``: the exit loop's prediction is right;
- ``trajectory``: no loop 1..T is right (the oracle fails too);
- ``readout_early``: some loop is right, the rule exited before the first right loop;
- ``readout_overthinking``: the rule exited after a right loop, at a wrong one.

Verdict per model ([AD]'s decision aid, made explicit). Every figure is a val-chosen point on test with its
95 % interval (bootstrap over test sequences; across seeds the Student-t interval, :func:`group_verdicts`); a
gap between two figures counts only when their intervals are disjoint *and* the estimates differ by at least
``gap_tol`` loops (:func:`looptrace.intervals.compare`); otherwise they are "within noise" (or "within
tolerance"). Depths are chosen-point test depths, so every rule is compared at accuracy within δ of full depth
(defined even when D@95 is not).

1. ``best`` = the post-hoc readout or refit gate chosen on *val* (lowest val depth among chosen points within δ,
   :func:`looptrace.rules.scoring.best_chosen`), ``fixed`` = fixed depth's chosen point, ``oracle`` = the
   earliest-correct ceiling (mean first right loop), ``native`` = the native gate.
2. ``best`` not lower than ``fixed`` → **trajectory-limited**: no rule reading the trajectory — post-hoc
   readouts and gates refit on it with every feature — exits earlier than fixed depth beyond noise, so the exit
   information is not decodable from the trajectory ([AD]'s decision aid: refit gates test the trajectory).
   Reason ``no_headroom`` when even the oracle ceiling is not lower than fixed depth (right answers arrive
   only at full depth), ``no_early_exit`` otherwise (the oracle's earlier right answers — on binary tasks partly
   chance hits — are not recognisable from the state).
3. the native gate higher than ``best`` → **readout-limited** (``native_gate``): the trajectory supports early
   exit, the model's own gate does not use it.
4. ``best`` higher than the oracle ceiling → **readout-limited** (``below_ceiling``): right answers come earlier
   than any readout finds them.
5. otherwise **at-ceiling** (``at_ceiling``): ``best`` exits earlier than fixed depth and within noise of (or
   below) the oracle ceiling — the readout already gets everything this trajectory offers, so neither a better
   readout nor, on this evidence, the trajectory is the limit at this accuracy; only a trajectory that is right
   earlier would lower the depth. (Before issue 12 this case was called trajectory-limited, which read as a
   contradiction beside 0 % trajectory failures.)

Each verdict's sentence cites the figures with their intervals, the comparisons it rests on, and the error
counts at the best rule's point (trajectory vs readout failures); :func:`check_verdict` recomputes the
comparisons from the row's own numbers and the stage refuses a row that contradicts them.

The summary checks [AD]'s three findings on our models from the numbers (never tuned), per task × regime on
the across-seed intervals (:func:`ad_claims`): (a) on fixed-prior (uniform / geometric) trajectories confidence
readouts reach a lower D@X than fixed depth; (b) the native joint gate's frontier is worse than post-hoc
readouts on fixed-prior trajectories of the same task; (c) gates refit on frozen fixed-prior trajectories are
strong, on jointly trained ones weak. A claim holds on a group only when the intervals support it.
"""

from __future__ import annotations

import math
import re
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import polars as pl

from looptrace.config import InputError, MissingInputError
from looptrace.intervals import (
    Interval,
    IntervalsConfig,
    Resampler,
    across_seeds,
    boot_seed,
    compare,
    from_row,
    spearman_level_samples,
    spearman_token_samples,
    split_resampler,
)
from looptrace.io.artifacts import read_json, read_parquet, write_outputs
from looptrace.io.parallel import DaskRunner, map_tasks
from looptrace.io.tables import SplitArrays, load_token_loop
from looptrace.project import split_seed
from looptrace.rules.builtin import CONFIDENCE_RULES
from looptrace.rules.scoring import best_chosen

#: Failure classes in output order (SPEC §7); codes are their indices.
CLASSES = ("correct", "trajectory", "readout_early", "readout_overthinking")
#: Regime kinds with a fixed depth prior ([AD]'s "fixed-prior" trajectories).
FIXED_PRIOR_KINDS = ("uniform", "geometric")
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
    """

    x: float = 95.0
    gap_tol: float = 0.5
    spearman_signals: tuple[str, ...] = ("entropy", "max_prob", "margin", "kl_prev", "logit_change", "rel_step",
                                         "state_cos_dist", "accel", "step_norm")
    spearman_headline: str = "entropy"
    spearman_loop: int | None = None
    spearman_aggregation: str = "difficulty_mean"
    spearman_intervals: str = "headline"

    def __post_init__(self) -> None:
        from looptrace.config import ConfigError

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
        if self.spearman_loop is not None and self.spearman_loop < 1:
            raise ConfigError(f"diagnose.spearman_loop must be ≥ 1 or null, got {self.spearman_loop}")


# ----------------------------------------------------------------------------------------------
# Failure classes
# ----------------------------------------------------------------------------------------------


def failure_codes(exit_depth: np.ndarray, correct: np.ndarray) -> np.ndarray:
    """SPEC §7 class of each token at its exit (index into ``CLASSES``).

    Args:
        exit_depth: [token] 1-based exit depths.
        correct: [token, loop] bool, argmax_t == y.

    Returns:
        [token] int8: 0 correct, 1 trajectory, 2 readout_early, 3 readout_overthinking.
    """
    c = np.asarray(correct, dtype=bool)
    d = np.asarray(exit_depth, dtype=np.int64)
    n, T = c.shape
    if d.shape != (n,) or d.min(initial=1) < 1 or d.max(initial=1) > T:
        raise ValueError(f"exit depths must be [token] in 1..{T}, got shape {d.shape}")
    right = c[np.arange(n), d - 1]
    anyc = c.any(axis=1)
    first = np.where(anyc, c.argmax(axis=1) + 1, T + 1)
    code = np.full(n, 3, dtype=np.int8)  # wrong at exit, after a right loop
    code[d < first] = 2
    code[~anyc] = 1
    code[right] = 0
    return code


def failure_rows(codes: np.ndarray, exit_depth: np.ndarray, difficulty: np.ndarray) -> list[dict]:
    """Counts and fractions of each class, overall (``group`` all) and per difficulty level.

    Returns:
        list of dicts: group, difficulty (None for all), n_tokens, one count per class, ``frac_<class>``,
        exit_depth_mean. Counts sum to n_tokens by construction.
    """
    rows = []
    groups = [("all", None, np.ones(codes.size, dtype=bool))]
    groups += [("difficulty", int(v), difficulty == v) for v in np.unique(difficulty)]
    for group, level, sel in groups:
        n = int(sel.sum())
        counts = np.bincount(codes[sel], minlength=len(CLASSES))
        row = {"group": group, "difficulty": level, "n_tokens": n}
        row.update({c: int(k) for c, k in zip(CLASSES, counts, strict=True)})
        row.update({f"frac_{c}": (k / n if n else math.nan) for c, k in zip(CLASSES, counts, strict=True)})
        row["exit_depth_mean"] = float(exit_depth[sel].mean()) if n else math.nan
        rows.append(row)
    return rows


# ----------------------------------------------------------------------------------------------
# Spearman: difficulty vs signals
# ----------------------------------------------------------------------------------------------


def _spearman(x: np.ndarray, y: np.ndarray) -> tuple[float, float, int]:
    from scipy.stats import spearmanr

    ok = np.isfinite(x) & np.isfinite(y)
    n = int(ok.sum())
    if n < 3 or np.ptp(x[ok]) == 0 or np.ptp(y[ok]) == 0:
        return math.nan, math.nan, n
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        res = spearmanr(x[ok], y[ok])
    return float(res.statistic), float(res.pvalue), n


def spearman_rows(difficulty: np.ndarray, signals: dict[str, np.ndarray], rs: Resampler | None = None,
                  with_interval: Callable[[str, int | None, str], bool] | None = None) -> list[dict]:
    """Spearman ρ between difficulty and each signal, on two aggregations.

    ``token``: over test tokens (difficulty_i, signal_i). ``difficulty_mean``: over difficulty levels
    (level, mean signal of the level's tokens) — [AD]'s ≈ 1.0 reads as a monotone per-level trend. Each
    [token, loop] signal is taken at every loop (``loop`` 1..T) and as its per-token mean over defined
    loops (``loop`` null); [token] signals (``oracle_depth``) have ``loop`` null. Fewer than 3 finite
    points or a constant input give NaN.

    **Intervals.** ρ's interval is a percentile bootstrap over test *sequences* (the unit of every interval,
    :mod:`looptrace.intervals`): each resample redraws whole sequences, the difficulty and signal of a token
    stay paired, and ρ is recomputed on the resample exactly as on the data — over its tokens (mid-ranks of
    the expanded multiset) or over its difficulty levels' means. The p-value assumes independent points,
    which tokens of one sequence are not; the interval does not.

    Args:
        difficulty: [token] int.
        signals: name -> [token, loop] or [token] array.
        rs: the test split's resampler (:func:`looptrace.intervals.split_resampler`); None = no intervals.
        with_interval: (signal, loop, aggregation) -> whether that row gets an interval (None = every row).

    Returns:
        list of dicts: signal, loop, aggregation, rho, pvalue, n, rho_lo, rho_hi (NaN without an interval),
        n_boot, n_sequences (0 without one).
    """
    diff = np.asarray(difficulty, dtype=np.float64)
    levels = np.unique(diff)
    rows = []
    for name, sig in signals.items():
        sig = np.asarray(sig, dtype=np.float64)
        cols: list[tuple[int | None, np.ndarray]] = []
        if sig.ndim == 2:
            cols = [(t + 1, sig[:, t]) for t in range(sig.shape[1])]
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN tokens -> NaN mean
                cols.append((None, np.nanmean(sig, axis=1)))
        else:
            cols = [(None, sig)]
        for loop, v in cols:
            rho, p, n = _spearman(diff, v)
            rows.append({"signal": name, "loop": loop, "aggregation": "token", "rho": rho, "pvalue": p, "n": n,
                         **_rho_interval(rs, with_interval, name, loop, "token", rho,
                                         lambda v=v: spearman_token_samples(rs, diff, v))})
            means = np.array([np.nanmean(v[diff == lv]) if np.isfinite(v[diff == lv]).any() else np.nan
                              for lv in levels])
            rho, p, n = _spearman(levels, means)
            rows.append({"signal": name, "loop": loop, "aggregation": "difficulty_mean", "rho": rho, "pvalue": p,
                         "n": n, **_rho_interval(rs, with_interval, name, loop, "difficulty_mean", rho,
                                                 lambda v=v: spearman_level_samples(rs, diff, v)[0])})
    return rows


def _rho_interval(rs: Resampler | None, with_interval: Callable | None, signal: str, loop: int | None, agg: str,
                  rho: float, samples: Callable[[], np.ndarray]) -> dict:
    """``rho_lo``, ``rho_hi``, ``n_boot``, ``n_sequences`` of one Spearman row (NaN / 0 when it has none)."""
    if rs is None or rs.n_boot == 0 or math.isnan(rho) or (with_interval is not None
                                                           and not with_interval(signal, loop, agg)):
        return {"rho_lo": math.nan, "rho_hi": math.nan, "n_boot": 0, "n_sequences": 0}
    lo, hi = rs.interval(samples())
    return {"rho_lo": float(lo), "rho_hi": float(hi), "n_boot": rs.n_boot, "n_sequences": rs.n_units}


# ----------------------------------------------------------------------------------------------
# Verdicts and [AD] claims
# ----------------------------------------------------------------------------------------------

#: The three verdicts (module docstring) and their reasons.
VERDICTS = ("trajectory-limited", "readout-limited", "at-ceiling")
REASONS = {"no_early_exit": "trajectory-limited", "no_headroom": "trajectory-limited",
           "native_gate": "readout-limited", "below_ceiling": "readout-limited", "at_ceiling": "at-ceiling"}
#: What each outcome of :func:`looptrace.intervals.compare` reads as in a sentence ("a is ... b").
_CMP_WORDS = {"lower": "lower than", "higher": "higher than", "within noise": "within noise of",
              "within tolerance": "within tolerance of", "untestable": "not comparable with"}


def _nanmin_row(df: pl.DataFrame, col: str) -> dict | None:
    """Row with the smallest finite ``col`` (ties: rule name), or None."""
    ok = df.filter(pl.col(col).is_not_null() & pl.col(col).is_not_nan())
    return ok.sort(col, "rule").row(0, named=True) if ok.height else None


def _f(v) -> float:
    return math.nan if v is None else float(v)


def _iv(v, n_seeds: int = 1) -> Interval:
    """An :class:`Interval` from an Interval, a metrics.json interval dict or a plain number (no interval)."""
    if isinstance(v, Interval):
        return v
    if isinstance(v, dict):
        return Interval(_f(v.get("estimate")), _f(v.get("lo")), _f(v.get("hi")), int(v.get("n_seeds") or n_seeds),
                        v.get("method") or "bootstrap", int(v.get("n_boot") or 0), int(v.get("n_sequences") or 0))
    return Interval(_f(v), n_seeds=n_seeds, method="none")


def _ci(i: Interval | None, nd: int = 2) -> str:
    """``1.15 [1.11, 1.19]``; ``not run`` for an absent figure (never None or nan)."""
    return "not run" if i is None or not i.present else i.fmt(nd)


def _dx_ci(i: Interval | None, nd: int = 2) -> str:
    """A D@X figure: ``not reached`` when X is unreachable (+inf estimate), ``not run`` when absent."""
    if i is None or not i.present:
        return "not run"
    if math.isinf(i.estimate):
        extra = f" in {i.n_unreachable} of {i.n_seeds} seeds" if i.n_seeds > 1 and i.n_unreachable else ""
        return f"not reached{extra}"
    return i.fmt(nd).replace("unreachable", "not reached")


def _chosen_interval(row: dict | None) -> Interval | None:
    """The test depth of a ``chosen`` row (val-chosen point) with its bootstrap interval."""
    return None if row is None else from_row(row, "test_depth")


def decide(best: Interval | None, fixed: Interval, oracle: Interval, native: Interval | None,
           tol: float) -> dict:
    """The verdict from four depth figures (loops; each with its interval), as the module docstring states.

    A gap counts only when the two intervals are disjoint *and* the estimates differ by at least ``tol``
    (:func:`looptrace.intervals.compare`); otherwise the figures are "within noise" / "within tolerance".

    Args:
        best: the val-chosen best post-hoc readout or refit gate's test depth (None: no such rule).
        fixed: fixed depth's val-chosen test depth.
        oracle: the oracle earliest-correct ceiling's mean test depth.
        native: the native gate's test depth (None: no native gate).
        tol: ``diagnose.gap_tol`` (loops).

    Returns:
        dict: verdict, reason, and the comparisons it rests on: ``best_vs_fixed``, ``oracle_vs_fixed``,
        ``native_vs_best``, ``best_vs_oracle`` (compare outcomes; None when a side is absent).
    """
    bf = compare(best, fixed, tol) if best is not None and best.present else None
    of = compare(oracle, fixed, tol) if oracle.present and fixed.present else None
    nb = (compare(native, best, tol) if native is not None and native.present and best is not None and best.present
          else None)
    bo = compare(best, oracle, tol) if best is not None and best.present and oracle.present else None
    if bf != "lower":
        reason = "no_headroom" if of != "lower" else "no_early_exit"
    elif nb == "higher":
        reason = "native_gate"
    elif bo == "higher":
        reason = "below_ceiling"
    else:
        reason = "at_ceiling"
    return {"verdict": REASONS[reason], "reason": reason, "best_vs_fixed": bf, "oracle_vs_fixed": of,
            "native_vs_best": nb, "best_vs_oracle": bo}


def _verdict_sentence(d: dict, best_rule: str | None, best: Interval | None, fixed: Interval, oracle: Interval,
                      native: Interval | None, tol: float, gates_run: bool, seeds: str = "") -> str:
    """The reason of a verdict in words, citing every figure and comparison :func:`decide` used."""
    b = f"{best_rule or 'no rule'} at {_ci(best)}" if best is not None and best.present else "no post-hoc rule"
    fx, orc = f"fixed depth {_ci(fixed)}", f"the oracle ceiling {_ci(oracle)}"
    w = _CMP_WORDS
    r = d["reason"]
    if r in ("no_early_exit", "no_headroom"):
        s = (f"no post-hoc readout{' or refit gate' if gates_run else ''} exits earlier than fixed depth beyond noise "
             f"(tolerance {tol:g} loops): best {b} is {w.get(d['best_vs_fixed'], 'not comparable with')} {fx}")
        if r == "no_headroom":
            s += f"; even {orc} is {w.get(d['oracle_vs_fixed'], 'not comparable with')} fixed depth"
        else:
            s += (f"; {orc} is lower, but no rule reading the trajectory finds those right answers"
                  + ("" if gates_run else " (no refit gates were run: the gates stage tests learned readouts)"))
    elif r == "native_gate":
        s = (f"the trajectory supports early exit ({b}, lower than {fx}; {orc}) but the native gate at "
             f"{_ci(native)} is higher than it")
    elif r == "below_ceiling":
        s = (f"{b} is lower than {fx} but higher than {orc}: right answers come earlier than any readout finds them "
             "(on binary tasks the oracle also counts chance hits, so this ceiling is optimistic)")
    else:
        s = (f"{b} is lower than {fx} and {w.get(d['best_vs_oracle'], 'not comparable with')} {orc}: the readout "
             "already exits where the trajectory first gets the answer right")
    return s + (f" ({seeds})" if seeds else "")


def verdict(model: dict, chosen: pl.DataFrame, dx: pl.DataFrame, oracle: dict, failures: pl.DataFrame,
            cfg: DiagnoseConfig) -> dict:
    """The verdict row of one model (see the module docstring for the decision procedure).

    Args:
        model: meta (model, task, regime, regime_kind, n_loops).
        chosen: chosen points of the model's rules (readouts + gates): rule, kind, source, val_depth,
            val_accuracy, test_depth, test_accuracy, within_delta, and when present test_depth_lo/hi,
            n_boot, n_sequences (the bootstrap interval of the val-chosen test depth).
        dx: D@X of the model's rules: rule, kind, source, x, d_at (+ d_at_lo/hi, val_d_at when present).
        oracle: {"depth": Interval | interval dict | float, "accuracy": ...}: the oracle ceiling on test.
        failures: the model's ``failure_classes`` rows (group all).
        cfg: the ``diagnose`` section.

    Returns:
        dict: verdict, reason, evidence sentence and every number (with interval bounds) and comparison it cites.
        :func:`check_verdict` of the row is empty (asserted here: a verdict never contradicts its numbers).
    """
    tol = cfg.gap_tol
    x = float(cfg.x)
    chosen = with_val_columns(chosen)
    fixed_row = chosen.filter(pl.col("rule") == "fixed")
    fixed = (_chosen_interval(fixed_row.row(0, named=True)) if fixed_row.height
             else Interval(_f(model.get("n_loops")), method="none"))
    best = best_chosen(chosen, ["posthoc", "gate"])
    best_i = _chosen_interval(best)
    best_gate, best_post = best_chosen(chosen, ["gate"]), best_chosen(chosen, ["posthoc"])
    nat_row = best_chosen(chosen, ["native"])
    native = _chosen_interval(nat_row)
    orc = _iv(oracle.get("depth"))
    gates_run = bool(chosen.filter(pl.col("kind") == "gate").height)
    d = decide(best_i, fixed, orc, native, tol)
    fail_best = failures.filter((pl.col("rule") == (best["rule"] if best else "")) & (pl.col("group") == "all"))
    n_tok = int(fail_best["n_tokens"][0]) if fail_best.height else 0
    n_err = n_tok - int(fail_best["correct"][0]) if fail_best.height else 0
    n_traj = int(fail_best["trajectory"][0]) if fail_best.height else 0
    n_read = n_err - n_traj
    why = _verdict_sentence(d, best["rule"] if best else None, best_i, fixed, orc, native, tol, gates_run)
    if fail_best.height and not n_err:
        why += f"; no errors at its chosen point ({n_tok} test tokens)"
    elif fail_best.height:
        why += (f"; errors at its chosen point: {n_err} of {n_tok} test tokens, of which {n_traj} "
                f"({_pct(n_traj, n_err)}) trajectory failures (no loop right) and {n_read} ({_pct(n_read, n_err)}) "
                "readout failures (some loop right)")
    dxx = with_val_columns(dx.filter(pl.col("x") == x))
    dx_fixed, _ = dx_best(dxx, ["fixed"])
    dx_post, dx_post_rule = dx_best(dxx, ["posthoc"])
    dx_gate, _ = dx_best(dxx, ["gate"])
    dx_nat, _ = dx_best(dxx, ["native"])
    row = {
        "model": model["model"], "group": split_seed(model["model"])[0], "seed": split_seed(model["model"])[1],
        "task": model.get("task"), "regime": model.get("regime"),
        "regime_kind": model.get("regime_kind"), "verdict": d["verdict"], "reason": d["reason"],
        "evidence": f"{model['model']}: {d['verdict']} — {why}.",
        **{f"cmp_{k}": d[k] for k in ("best_vs_fixed", "oracle_vs_fixed", "native_vs_best", "best_vs_oracle")},
        "best_rule": best["rule"] if best else None, "best_source": best["source"] if best else None,
        "best_accuracy": _f(best["test_accuracy"]) if best else math.nan,
        "best_posthoc_rule": best_post["rule"] if best_post else None,
        "best_gate_rule": best_gate["rule"] if best_gate else None,
        **_cols("fixed_depth", fixed), **_cols("best_depth", best_i), **_cols("native_depth", native),
        **_cols("oracle_depth", orc), **_cols("best_posthoc_depth", _chosen_interval(best_post)),
        **_cols("best_gate_depth", _chosen_interval(best_gate)),
        "oracle_accuracy": _iv(oracle.get("accuracy")).estimate, "x": x,
        **_cols("dx_fixed", dx_fixed), **_cols("dx_best_posthoc", dx_post), "dx_best_posthoc_rule": dx_post_rule,
        **_cols("dx_best_gate", dx_gate), **_cols("dx_native", dx_nat),
        "n_errors": n_err, "n_trajectory_failures": n_traj, "n_readout_failures": n_read,
        "error_trajectory_share": n_traj / n_err if n_err else math.nan,
        "error_readout_share": n_read / n_err if n_err else math.nan,
        "gap_tol": tol, "n_boot": fixed.n_boot, "n_sequences": fixed.n_sequences,
    }
    problems = check_verdict(row)
    if problems:  # a bug in decide / the sentence, never a property of the data
        raise AssertionError(f"verdict of {model['model']} contradicts its numbers: {'; '.join(problems)}")
    return row


def _pct(k: int, n: int) -> str:
    return f"{100 * k / n:.0f} %" if n else "—"


def _cols(name: str, i: Interval | None) -> dict:
    """``name``, ``name_lo``, ``name_hi`` of an interval (NaN when absent; +inf kept for an unreachable D@X)."""
    if i is None:
        return {name: math.nan, f"{name}_lo": math.nan, f"{name}_hi": math.nan}
    return {name: i.estimate, f"{name}_lo": i.lo, f"{name}_hi": i.hi}


def _row_iv(row: dict, name: str) -> Interval | None:
    v = _f(row.get(name))
    return None if math.isnan(v) else Interval(v, _f(row.get(f"{name}_lo")), _f(row.get(f"{name}_hi")))


def check_verdict(row: dict) -> list[str]:
    """Contradictions between a verdict row and its own numbers (empty = consistent).

    Recomputes every comparison from the row's figures and bounds (``best_depth``, ``fixed_depth``,
    ``oracle_depth``, ``native_depth`` with ``_lo``/``_hi``, ``gap_tol``) and checks that the verdict and reason
    follow from them, that the sentence cites the comparisons it rests on, and that the error counts add up.
    """
    out = []
    tol = _f(row.get("gap_tol"))
    tol = 0.0 if math.isnan(tol) else tol
    fixed = _row_iv(row, "fixed_depth") or Interval(math.nan)
    d = decide(_row_iv(row, "best_depth"), fixed, _row_iv(row, "oracle_depth") or Interval(math.nan),
               _row_iv(row, "native_depth"), tol)
    if (row.get("verdict"), row.get("reason")) != (d["verdict"], d["reason"]):
        out.append(f"the numbers give {d['verdict']} ({d['reason']}), the row says {row.get('verdict')} "
                   f"({row.get('reason')})")
    if REASONS.get(row.get("reason")) != row.get("verdict"):
        out.append(f"reason {row.get('reason')} does not belong to verdict {row.get('verdict')}")
    ev = row.get("evidence") or ""
    if f": {row.get('verdict')} — " not in ev:
        out.append("the evidence sentence does not state the verdict")
    for key in ("best_vs_fixed", "best_vs_oracle"):
        c = d[key]
        need = (key == "best_vs_fixed" or d["reason"] == "at_ceiling") and c is not None
        if need and _CMP_WORDS[c] not in ev and not (c == "lower" and "lower than" in ev):
            out.append(f"the sentence does not say that best is {_CMP_WORDS[c]} {key.split('_vs_')[1]}")
    for name in ("best_depth", "fixed_depth", "oracle_depth"):
        i = _row_iv(row, name)
        if i is not None and i.present and _ci(i) not in ev:
            out.append(f"the sentence does not cite {name} {_ci(i)}")
    for bad in ("None", "nan", "inf"):
        if re.search(rf"\b{bad}\b", ev):
            out.append(f"the sentence prints '{bad}'")
    n_err = row.get("n_errors")
    if n_err is not None and row.get("n_trajectory_failures") is not None:
        if row["n_trajectory_failures"] + row["n_readout_failures"] != n_err:
            out.append("trajectory + readout failures do not add up to the errors")
    return out


def with_val_columns(df: pl.DataFrame) -> pl.DataFrame:
    """``chosen`` / ``dx`` rows with the val columns the val-choice needs; outputs written before those columns
    existed read their test figure in place of val (documented fallback, never used by the current stages)."""
    for val, test in (("val_d_at", "d_at"), ("val_depth", "test_depth"), ("val_accuracy", "test_accuracy")):
        if test in df.columns:  # absent, or null in rows concatenated from such outputs
            df = df.with_columns((pl.coalesce(val, test) if val in df.columns else pl.col(test)).alias(val))
    return df


def dx_best(dx: pl.DataFrame, kinds: Sequence[str], rules: Sequence[str] | None = None
            ) -> tuple[Interval | None, str | None]:
    """The D@X of the rule (of ``kinds``, optionally among ``rules``) chosen on *val*: the lowest ``val_d_at``
    (unreachable = +inf; ties: rule name), with its test D@X and bootstrap interval (+inf = not reached).

    Args:
        dx: D@X rows of one model at one X (rule, kind, d_at, d_at_lo, d_at_hi, val_d_at, n_boot, n_sequences).

    Returns:
        (Interval, rule), or (None, None) when no such rule was run.
    """
    sub = with_val_columns(dx).filter(pl.col("kind").is_in(list(kinds)))
    if rules is not None:
        sub = sub.filter(pl.col("rule").is_in(list(rules)))
    if not sub.height:
        return None, None
    sub = sub.with_columns(_v=pl.col("val_d_at").fill_null(math.inf).fill_nan(math.inf))
    r = sub.sort("_v", "rule").row(0, named=True)
    return from_row(r, "d_at"), r["rule"]


def _status(c: str, good: str, bad: str) -> str:
    """A claim's result on one group from a comparison outcome: ``holds`` / ``does not hold`` / ``within noise``."""
    if c == good:
        return "holds"
    if c == bad:
        return "does not hold"
    return "untestable" if c == "untestable" else "within noise"


def _overall(results: list[str]) -> str:
    """A claim over groups: holds / does not hold / within noise when every tested group agrees, else partly."""
    tested = [r for r in results if r != "untestable"]
    if not tested:
        return "untestable"
    if len(set(tested)) == 1:
        return tested[0]
    return "partly (" + ", ".join(f"{r} in {tested.count(r)}" for r in ("holds", "within noise", "does not hold")
                                 if r in tested) + f" of {len(tested)})"


def _seed_pairs(items: Sequence[tuple[str, Interval | None, Interval | None]]) -> str:
    """``s0 1.40 [1.31, 1.52] vs 3.00 [3.00, 3.00]; s1 …`` (a model without a seed: its name)."""
    def name(m: str) -> str:
        seed = split_seed(m)[1]
        return m if seed is None else f"s{seed}"
    return "; ".join(f"{name(m)} {_dx_ci(a)} vs {_dx_ci(b)}" for m, a, b in items)


def _group_ci(items: Sequence[Interval | None], level: float = 0.95) -> Interval:
    return across_seeds([i for i in items if i is not None], level)


def _seeds_word(n: int) -> str:
    return f"{n} seed{'s' if n != 1 else ''}"


def ad_claims(meta: pl.DataFrame, dx: pl.DataFrame, cfg: DiagnoseConfig, gates_present: bool,
              level: float = 0.95) -> list[dict]:
    """Test [AD]'s findings (a), (b), (c) on our models, judged on intervals, one dict per claim.

    The unit is a task × regime group (the models ``<task>-<regime>-s<seed>`` that differ by training seed,
    :func:`looptrace.project.split_seed`): each figure is the across-seed mean with its Student-t interval
    (one seed: that model's bootstrap interval, :func:`looptrace.intervals.across_seeds`); per seed the rule is
    chosen on val (:func:`dx_best`). A claim *holds* on a group only when the intervals are disjoint in the
    claimed direction, *does not hold* when they are disjoint the other way, and is *within noise* when they
    overlap (:func:`looptrace.intervals.compare`).

    (a) best confidence readout's D@X lower than fixed depth's, on fixed-prior groups. (b) the native gate's
    D@X (joint group) higher than the best post-hoc readout's on the fixed-prior models of the same task and
    seed. (c) the best refit gate is strong (lower than fixed by ≥ ``gap_tol``, disjoint intervals) on
    fixed-prior groups and weak (higher, or disjoint but closer than ``gap_tol``; a gate that cannot reach X)
    on joint ones; overlapping intervals leave it within noise.

    Args:
        meta: one row per model: model, task, regime, regime_kind.
        dx: D@X of every model × rule: model, rule, kind, x, d_at (+ d_at_lo/hi, val_d_at, n_boot, n_sequences).
        cfg: the ``diagnose`` section (x, gap_tol).
        gates_present: whether any ``artifacts/gates/<model>`` outputs were found.
        level: interval coverage across seeds.

    Returns:
        list of {"claim": "a"|"b"|"c", "status": holds | does not hold | within noise | partly (...) |
        untestable, "sentences": [str, ...], "details": [dict, ...]}.
    """
    x = float(cfg.x)
    xs = f"D@{x:g}"
    dxx = with_val_columns(dx.filter(pl.col("x") == x))

    def best(model: str, kinds: Sequence[str], rules: Sequence[str] | None = None):
        return dx_best(dxx.filter(pl.col("model") == model), kinds, rules)

    meta = meta.with_columns(group=pl.col("model").map_elements(lambda m: split_seed(m)[0], return_dtype=pl.String),
                             seed=pl.col("model").map_elements(lambda m: split_seed(m)[1], return_dtype=pl.Int64))
    groups = list(dict.fromkeys(meta["group"].to_list()))
    ginfo = {g: meta.filter(pl.col("group") == g).row(0, named=True) for g in groups}
    members = {g: meta.filter(pl.col("group") == g)["model"].to_list() for g in groups}
    fixed_prior = [g for g in groups if ginfo[g]["regime_kind"] in FIXED_PRIOR_KINDS]
    joint = [g for g in groups if ginfo[g]["regime_kind"] == "joint"]
    claims = []

    # (a) confidence readouts vs fixed depth on fixed-prior trajectories
    res, sent, det = [], [], []
    for g in fixed_prior:
        per = [(m, *best(m, ["posthoc"], CONFIDENCE_RULES), best(m, ["fixed"])[0]) for m in members[g]]
        conf = _group_ci([p[1] for p in per], level)
        fix = _group_ci([p[3] for p in per], level)
        c = compare(conf, fix)
        st = _status(c, "lower", "higher")
        res.append(st)
        rules = ", ".join(dict.fromkeys(p[2] or "none" for p in per))
        det.append({"group": g, "n_seeds": len(per), "confidence_rules": rules, "confidence_dx": conf.to_dict(),
                    "fixed_dx": fix.to_dict(), "comparison": c, "result": st,
                    "per_seed": [{"model": m, "rule": r, "confidence_dx": _f(i.estimate) if i else math.nan,
                                  "fixed_dx": _f(f.estimate) if f else math.nan} for m, i, r, f in per]})
        sent.append(f"{g} ({_seeds_word(len(per))}): best confidence readout ({rules}, chosen on val) {xs} = "
                    f"{_dx_ci(conf)}, {_CMP_WORDS[c]} fixed depth {xs} = {_dx_ci(fix)}: {st}"
                    + (f" (per seed, confidence vs fixed: {_seed_pairs([(m, i, f) for m, i, _, f in per])})"
                       if len(per) > 1 else "") + ".")
    status = _overall(res) if res else "untestable"
    head = (f"(a) [AD]: fixed-prior trajectories with confidence readouts reach a lower {xs} than fixed depth "
            f"([AD]: {AD_REFERENCE['confidence_d95']} vs {AD_REFERENCE['fixed_d95']} at D@95). On our models: {status}"
            + ("" if res else " — no fixed-prior (uniform/geometric) model in this run") + ".")
    claims.append({"claim": "a", "status": status, "sentences": [head, *sent], "details": det})

    # (b) native joint gate vs post-hoc readouts on fixed-prior trajectories of the same task
    res, sent, det = [], [], []
    for g in joint:
        task = ginfo[g]["task"]
        per = []
        for m in members[g]:
            seed = split_seed(m)[1]
            # peers: fixed-prior models of the same task and training seed, so the comparison is between
            # regimes, not between initialisations; the peer's rule is chosen on val over all peers' rules
            peers = meta.filter((pl.col("task") == task) & pl.col("regime_kind").is_in(list(FIXED_PRIOR_KINDS))
                                & (pl.col("seed").is_null() if seed is None else pl.col("seed") == seed)
                                )["model"].to_list()
            sub = dxx.filter(pl.col("model").is_in(peers))
            post, rule = dx_best(sub, ["posthoc"])
            peer = (sub.filter((pl.col("rule") == rule) & (pl.col("kind") == "posthoc"))
                    .with_columns(_v=pl.col("val_d_at").fill_null(math.inf).fill_nan(math.inf))
                    .sort("_v", "model")["model"][0]) if rule else None
            per.append((m, best(m, ["native"])[0], post, rule, peer, peers))
        if not any(p[5] for p in per):
            res.append("untestable")
            sent.append(f"{g}: no fixed-prior model of task {task} to compare with.")
            det.append({"group": g, "result": "untestable"})
            continue
        nat = _group_ci([p[1] for p in per], level)
        post = _group_ci([p[2] for p in per], level)
        c = compare(nat, post)
        st = _status(c, "higher", "lower")
        res.append(st)
        peers_s = ", ".join(f"{p[3]} on {p[4]}" if p[3] else f"none on {', '.join(p[5])}" for p in per)
        det.append({"group": g, "n_seeds": len(per), "native_dx": nat.to_dict(), "fixed_prior_posthoc_dx": post.to_dict(),
                    "comparison": c, "result": st,
                    "per_seed": [{"model": m, "native_dx": _f(n.estimate) if n else math.nan,
                                  "fixed_prior_posthoc_dx": _f(q.estimate) if q else math.nan, "fixed_prior_rule": r,
                                  "fixed_prior_model": pm} for m, n, q, r, pm, _ in per]})
        sent.append(f"{g} ({_seeds_word(len(per))}): native Q-exit {xs} = {_dx_ci(nat)}, {_CMP_WORDS[c]} the best "
                    f"post-hoc readout on a fixed-prior trajectory of the same seed ({peers_s}): {_dx_ci(post)}: {st}"
                    + (f" (per seed, native vs post-hoc: {_seed_pairs([(p[0], p[1], p[2]) for p in per])})"
                       if len(per) > 1 else "") + ".")
    status = _overall(res) if res else "untestable"
    head = (f"(b) [AD]: the native joint gate's frontier is worse than post-hoc readouts on fixed-prior "
            f"trajectories ([AD]: native D@95 {AD_REFERENCE['native_d95']} vs {AD_REFERENCE['confidence_d95']}). "
            f"On our models: {status}" + ("" if res else " — no jointly trained model in this run") + ".")
    claims.append({"claim": "b", "status": status, "sentences": [head, *sent], "details": det})

    # (c) refit gates: strong on fixed-prior, weak on joint trajectories
    res, sent, det = [], [], []
    text = "(c) [AD]: gates refit on frozen fixed-prior trajectories are strong, on jointly trained ones weak."
    if gates_present:
        for g in [*fixed_prior, *joint]:
            per = [(m, *best(m, ["gate"]), best(m, ["fixed"])[0]) for m in members[g]]
            per = [p for p in per if p[1] is not None]
            if not per:
                sent.append(f"{g}: no refit gate outputs.")
                continue
            gate = _group_ci([p[1] for p in per], level)
            fix = _group_ci([p[3] for p in per], level)
            c = compare(gate, fix, cfg.gap_tol)
            strength = {"lower": "strong", "higher": "weak", "within tolerance": "weak",
                        "untestable": "weak"}.get(c, "within noise")  # untestable: neither reaches X
            expect = "strong" if ginfo[g]["regime_kind"] in FIXED_PRIOR_KINDS else "weak"
            st = "within noise" if strength == "within noise" else "holds" if strength == expect else "does not hold"
            res.append(st)
            rules = ", ".join(dict.fromkeys(p[2] for p in per))
            det.append({"group": g, "n_seeds": len(per), "regime_kind": ginfo[g]["regime_kind"], "gate_rules": rules,
                        "gate_dx": gate.to_dict(), "fixed_dx": fix.to_dict(), "comparison": c, "strength": strength,
                        "expected": expect, "result": st})
            sent.append(f"{g} ({ginfo[g]['regime_kind']}, {_seeds_word(len(per))}): best refit gate ({rules}) {xs} = "
                        f"{_dx_ci(gate)} vs fixed {_dx_ci(fix)} — {strength} (strong = lower by at least "
                        f"{cfg.gap_tol:g} loops with disjoint intervals); [AD] expects {expect}: {st}"
                        + (f" (per seed, gate vs fixed: {_seed_pairs([(p[0], p[1], p[3]) for p in per])})"
                           if len(per) > 1 else "") + ".")
        status = _overall(res) if res else "untestable"
        head = f"{text} On our models: {status}."
    else:
        status = "untestable"
        head = f"{text} Not tested: no offline-gate outputs (artifacts/gates/<model>/) were found."
    claims.append({"claim": "c", "status": status, "sentences": [head, *sent], "details": det})
    return claims


def group_verdicts(verdicts: pl.DataFrame, cfg: DiagnoseConfig, level: float = 0.95) -> pl.DataFrame:
    """One verdict per task × regime over its training seeds.

    Each depth figure of :func:`verdict` (best, fixed, oracle, native; D@X) becomes its across-seed mean with
    the Student-t interval (:func:`looptrace.intervals.across_seeds`; one seed: that model's bootstrap
    interval), and :func:`decide` is applied to those intervals. The per-seed verdicts are counted beside it.

    Returns:
        DataFrame: group, task, regime, regime_kind, n_seeds, seeds, verdict, reason, seed_verdicts,
        best_rules, evidence, and ``<figure>``, ``<figure>_lo``, ``<figure>_hi`` for fixed_depth, best_depth,
        native_depth, oracle_depth, dx_fixed, dx_best_posthoc, dx_best_gate, dx_native.
    """
    rows = []
    if not verdicts.height:
        return pl.DataFrame()
    vs = verdicts if "group" in verdicts.columns else verdicts.with_columns(
        group=pl.col("model").map_elements(lambda m: split_seed(m)[0], return_dtype=pl.String))
    for g in dict.fromkeys(vs["group"].to_list()):
        sub = vs.filter(pl.col("group") == g)
        rs = list(sub.iter_rows(named=True))
        figs = {}
        for name in ("fixed_depth", "best_depth", "native_depth", "oracle_depth", "dx_fixed", "dx_best_posthoc",
                     "dx_best_gate", "dx_native"):
            figs[name] = _group_ci([_row_iv(r, name) for r in rs], level)
        native = figs["native_depth"] if figs["native_depth"].present else None
        best = figs["best_depth"] if figs["best_depth"].present else None
        d = decide(best, figs["fixed_depth"], figs["oracle_depth"], native, cfg.gap_tol)
        n = len(rs)
        counts = {v: sum(r["verdict"] == v for r in rs) for v in VERDICTS}
        seed_v = ", ".join(f"{k} × {v}" for v, k in counts.items() if k)
        rules = ", ".join(dict.fromkeys(r["best_rule"] or "none" for r in rs))
        gates_run = any(r.get("best_gate_rule") for r in rs)
        why = _verdict_sentence(d, rules, best, figs["fixed_depth"], figs["oracle_depth"], native, cfg.gap_tol,
                                gates_run, seeds=f"{_seeds_word(n)}; per-seed verdicts: {seed_v}")
        row = {"group": g, "task": rs[0].get("task"), "regime": rs[0].get("regime"),
               "regime_kind": rs[0].get("regime_kind"), "n_seeds": n,
               "seeds": ", ".join(str(r["seed"]) for r in rs if r.get("seed") is not None),
               "verdict": d["verdict"], "reason": d["reason"], "seed_verdicts": seed_v, "best_rules": rules,
               "evidence": f"{g}: {d['verdict']} — {why}.", "gap_tol": cfg.gap_tol,
               **{f"cmp_{k}": d[k] for k in ("best_vs_fixed", "oracle_vs_fixed", "native_vs_best", "best_vs_oracle")}}
        for name, i in figs.items():
            row.update(_cols(name, i if i.present else None))
        problems = check_verdict(row)
        if problems:
            raise AssertionError(f"verdict of {g} contradicts its numbers: {'; '.join(problems)}")
        rows.append(row)
    return pl.DataFrame(rows, infer_schema_length=None)


def _headline_rho(spearman: pl.DataFrame, cfg: DiagnoseConfig) -> pl.DataFrame:
    sel = spearman.filter((pl.col("signal") == cfg.spearman_headline)
                          & (pl.col("aggregation") == cfg.spearman_aggregation))
    return sel.filter(pl.col("loop").is_null() if cfg.spearman_loop is None else pl.col("loop") == cfg.spearman_loop)


def summary_markdown(verdicts: pl.DataFrame, claims: list[dict], spearman: pl.DataFrame, cfg: DiagnoseConfig,
                     failures: pl.DataFrame | None = None, groups: pl.DataFrame | None = None) -> str:
    """``summary.md``: every sentence generated from the tables (verdicts, claims, Spearman headline).

    Args:
        verdicts: ``verdicts.parquet`` rows (one per model, i.e. per seed).
        claims: ``ad_claims`` output.
        spearman: ``spearman.parquet`` rows (model, signal, loop, aggregation, rho, n).
        cfg: the ``diagnose`` section.
        failures: ``failure_classes.parquet`` rows (for the best-rule table), optional.
        groups: :func:`group_verdicts` rows (computed here when None).
    """
    if groups is None:
        groups = group_verdicts(verdicts, cfg)
    xs = f"D@{cfg.x:g}"
    lines = ["# Diagnosis: trajectory or readout?", "",
             "Figures are `estimate [lo, hi]`: 95 % intervals, a bootstrap over test sequences for one model and "
             "the Student-t interval over training seeds for a task × regime. Two figures whose intervals overlap "
             "are within noise of each other; a gap counts only when they do not (and, for verdicts, when it is at "
             f"least gap_tol = {cfg.gap_tol:g} loops). \"not reached\" = no operating point reaches the accuracy "
             "target; \"not run\" = the rule does not exist for that model.", ""]
    if groups.height:
        lines += ["## Verdicts per task × regime (across seeds)", "",
                  "| task × regime | regime | seeds | verdict | best rule(s) | best depth | fixed | native | oracle | "
                  f"{xs} fixed | {xs} best post-hoc | {xs} best gate | {xs} native |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for g in groups.iter_rows(named=True):
            lines.append(f"| {g['group']} | {g['regime_kind'] or '?'} | {g['n_seeds']} | {g['verdict']} | "
                         f"{g['best_rules']} | {_ci(_row_iv(g, 'best_depth'))} | {_ci(_row_iv(g, 'fixed_depth'))} | "
                         f"{_ci(_row_iv(g, 'native_depth'))} | {_ci(_row_iv(g, 'oracle_depth'))} | "
                         + " | ".join(_dx_ci(_dx_iv(g, k)) for k in ("dx_fixed", "dx_best_posthoc", "dx_best_gate",
                                                                       "dx_native")) + " |")
        lines += ["", "Evidence:", ""] + [f"- {g['evidence']}" for g in groups.iter_rows(named=True)]
    lines += ["", "## Verdicts per model (one seed each; bootstrap over test sequences)", "",
              "| model | regime | verdict | best rule (depth) | fixed | native | oracle | "
              f"{xs} fixed / post-hoc / gate / native |",
              "|---|---|---|---|---|---|---|---|"]
    for v in verdicts.iter_rows(named=True):
        lines.append(f"| {v['model']} | {v['regime_kind'] or '?'} | {v['verdict']} | {v['best_rule'] or 'none'} "
                     f"({_ci(_row_iv(v, 'best_depth'))}) | {_ci(_row_iv(v, 'fixed_depth'))} | "
                     f"{_ci(_row_iv(v, 'native_depth'))} | {_ci(_row_iv(v, 'oracle_depth'))} | "
                     + " / ".join(_dx_ci(_dx_iv(v, k)) for k in ("dx_fixed", "dx_best_posthoc", "dx_best_gate",
                                                                   "dx_native")) + " |")
    lines += ["", "Depths are mean test exit depths (loops) at each rule's val-chosen point (val accuracy within δ of "
              f"full depth); the best rule is chosen on val. {xs} picks its threshold on test labels (an "
              "oracle-threshold figure). Evidence:", ""]
    lines += [f"- {v['evidence']}" for v in verdicts.iter_rows(named=True)]
    if failures is not None and failures.height:
        lines += ["", "## Failure classes at each model's best rule (test tokens, % of all)", "",
                  "| model | rule | correct | trajectory | readout early | readout overthinking |", "|---|---|---|---|---|---|"]
        for v in verdicts.iter_rows(named=True):
            f = failures.filter((pl.col("model") == v["model"]) & (pl.col("rule") == (v["best_rule"] or ""))
                                & (pl.col("group") == "all"))
            if f.height:
                r = f.row(0, named=True)
                lines.append(f"| {v['model']} | {v['best_rule']} | "
                             + " | ".join(f"{100 * r['frac_' + c]:.1f}" for c in CLASSES) + " |")
    lines += ["", "## Do [AD]'s findings hold on our models?", "",
              "Judged on intervals per task × regime: *holds* only when the intervals are disjoint in the claimed "
              "direction, *within noise* when they overlap, *does not hold* when they are disjoint the other way.",
              ""]
    for c in claims:
        lines.append(f"- {c['sentences'][0]}")
        lines += [f"  - {s}" for s in c["sentences"][1:]]
    lines += ["", "## Difficulty vs signals (Spearman)", ""]
    agg = cfg.spearman_aggregation
    where = "the per-token mean over its defined loops" if cfg.spearman_loop is None else f"loop {cfg.spearman_loop}"
    desc = ("over difficulty levels, of each level's mean signal" if agg == "difficulty_mean" else "over test tokens")
    lines.append(f"Headline: {cfg.spearman_headline} at {where}, Spearman {desc} ([AD]: entropy ≈ 1.0 under fixed "
                 "priors). n is the number of points ρ is computed over"
                 + (" (with a dozen levels ρ = 1 − 6Σd²/(n(n²−1)) is coarse: one swap of two adjacent levels "
                    "moves it by 12/(n(n²−1)) ≈ 0.007 at n = 12)" if agg == "difficulty_mean" else "")
                 + "; the interval is a bootstrap over test sequences (tokens of a sequence stay together, "
                 "difficulty and signal stay paired). Every signal × loop × aggregation is in spearman.parquet.")
    lines.append("")
    groups_rho, models_rho = spearman_headlines(spearman, cfg)
    regime = dict(zip(verdicts["model"].to_list(), verdicts["regime_kind"].to_list(), strict=True))
    for m, d in models_rho.items():
        lines.append(f"- {m} ({regime.get(m) or '?'}): ρ = {d['iv'].fmt()} ({_rho_basis(d)}).")
    multi = {g: d for g, d in groups_rho.items() if d["iv"].n_seeds > 1}
    if multi:
        lines += ["", "Across seeds (mean with the Student-t 95 % interval over seeds):", ""]
        for g, d in multi.items():
            lines.append(f"- {g}: ρ = {_ci(d['iv'])} ({_seeds_word(d['iv'].n_seeds)}; n = "
                         f"{', '.join(str(n) for n in d['n'])} {d['unit']}).")
    return "\n".join(lines) + "\n"


def _rho_basis(d: dict) -> str:
    """``n = 12 difficulty levels, bootstrap over 64 test sequences, B = 1000`` (or ``no interval``)."""
    out = f"n = {d['n']} {d['unit']}"
    if d["n_boot"]:
        out += f", bootstrap over {d['n_sequences']} test sequences, B = {d['n_boot']}"
    else:
        out += "; no interval"
    return out


def spearman_headlines(spearman: pl.DataFrame, cfg: DiagnoseConfig) -> tuple[dict[str, dict], dict[str, dict]]:
    """The headline ρ of every model and of every task × regime over its seeds.

    Returns:
        (groups, models): name -> {``iv`` (:class:`Interval`: a model's bootstrap interval; a group's mean
        with the Student-t interval over seeds), ``n`` (points ρ is over; a list for groups), ``unit``,
        ``n_boot``, ``n_sequences``}.
    """
    unit = "difficulty levels" if cfg.spearman_aggregation == "difficulty_mean" else "tokens"
    sel = _headline_rho(spearman, cfg)
    models: dict[str, dict] = {}
    by_group: dict[str, list[str]] = {}
    for r in sel.sort("model").iter_rows(named=True):
        nb = int(r.get("n_boot") or 0)
        iv = Interval(_f(r["rho"]), _f(r.get("rho_lo")), _f(r.get("rho_hi")), 1,
                      "bootstrap" if nb else "none", nb, int(r.get("n_sequences") or 0))
        models[r["model"]] = {"iv": iv, "n": int(r["n"]), "unit": unit, "n_boot": nb,
                              "n_sequences": int(r.get("n_sequences") or 0)}
        by_group.setdefault(split_seed(r["model"])[0], []).append(r["model"])
    groups = {g: {"iv": across_seeds([models[m]["iv"] for m in ms]), "n": [models[m]["n"] for m in ms],
                  "unit": unit, "n_boot": models[ms[0]]["n_boot"], "n_sequences": models[ms[0]]["n_sequences"]}
              for g, ms in by_group.items()}
    return groups, models


def _dx_iv(row: dict, name: str) -> Interval | None:
    """A D@X figure of a verdict row: NaN/+inf estimate with bounds = not reached; no row value = not run."""
    v = _f(row.get(name))
    lo, hi = _f(row.get(f"{name}_lo")), _f(row.get(f"{name}_hi"))
    if math.isnan(v):
        return None
    return Interval(v, lo, hi)


# ----------------------------------------------------------------------------------------------
# The stage
# ----------------------------------------------------------------------------------------------


def _read_rule_outputs(model_dir: Path, source: str) -> dict[str, pl.DataFrame] | None:
    """chosen, dx, chosen_exits (+ operating_points when present) of a readouts/gates model dir."""
    need = ("chosen", "dx", "chosen_exits")
    if not all((model_dir / f"{n}.parquet").is_file() for n in need):
        if source == "gates":
            return None
        missing = next(n for n in need if not (model_dir / f"{n}.parquet").is_file())
        raise MissingInputError(f"{model_dir / (missing + '.parquet')} not found; run the readouts stage first")
    out = {n: read_parquet(model_dir / f"{n}.parquet") for n in need}
    for n in ("chosen", "dx"):
        df = out[n]
        if "kind" not in df.columns:  # gates may omit it: every gates rule is a refit gate
            df = df.with_columns(kind=pl.lit("gate" if source == "gates" else "posthoc"))
        out[n] = df.with_columns(source=pl.lit(source))
    if "within_delta" not in out["chosen"].columns:
        out["chosen"] = out["chosen"].with_columns(within_delta=pl.lit(True))
    ops = model_dir / "operating_points.parquet"
    if ops.is_file():
        out["operating_points"] = read_parquet(ops)
    return out


def diagnose_models(models: Sequence[str], readouts_root: Path | str, gates_root: Path | str,
                    geometry_root: Path | str, cfg: DiagnoseConfig, meta: dict | None = None,
                    progress: bool = True, runner: DaskRunner | None = None,
                    intervals: IntervalsConfig | None = None, seed: int = 0
                    ) -> tuple[dict[str, pl.DataFrame], str, dict]:
    """Failure classes, Spearman, verdicts and the [AD] claims over all models.

    Args:
        models: model names (``<task>-<regime>``).
        readouts_root: ``artifacts/readouts`` (each model's chosen, dx, chosen_exits, operating_points,
            metrics.json — task/regime/regime_kind come from there).
        gates_root: ``artifacts/gates`` (optional per-model outputs with the readouts schema).
        geometry_root: ``artifacts/geometry`` (test rows of token_loop.parquet: difficulty, correctness,
            signals).
        cfg: the ``diagnose`` section.
        meta: extra metrics.json entries (versions, params).
        progress: progress bar.
        runner: one Dask task per model (:func:`model_rows`; the workers read the model's files, so with a
            remote scheduler the artifacts must be on a filesystem the workers share); None = in this process.
            The claims over all models are then drawn here from the per-model rows, in model order.
        intervals: the ``intervals`` section (Spearman intervals; None = none).
        seed: ``base.seed`` (the bootstrap's seed with the model name).

    Returns:
        (frames {failure_classes, spearman, verdicts}, summary markdown, metrics dict incl. claim details).
    """
    from tqdm.auto import tqdm

    models = list(models)
    parts = map_tasks(model_rows, [[m] for m in models], (readouts_root, gates_root, geometry_root, cfg, intervals, seed),
                     runner)
    rows: dict[str, list] = {k: [] for k in _ROW_KEYS}
    gates_present = False
    for part in tqdm(parts, total=len(models), desc="diagnose", disable=None if progress else True, leave=False):
        for k in _ROW_KEYS:
            rows[k] += part[k]
        gates_present = gates_present or part["gates_present"]
    return _diagnosis(**rows, gates_present=gates_present, cfg=cfg, meta=meta)


#: The per-model rows :func:`model_rows` returns.
_ROW_KEYS = ("fail_rows", "sp_rows", "verdict_rows", "meta_rows", "dx_all")


#: Columns of chosen.parquet / dx.parquet diagnose reads (the interval and val columns when the stage wrote them).
_CHOSEN_COLS = ("rule", "kind", "source", "val_depth", "val_accuracy", "test_depth", "test_accuracy", "within_delta",
                "test_depth_lo", "test_depth_hi", "n_boot", "n_sequences")
_DX_COLS = ("rule", "kind", "source", "x", "d_at", "d_at_lo", "d_at_hi", "val_d_at", "reach_share", "n_boot",
            "n_sequences")


def _present(df: pl.DataFrame, cols: Sequence[str]) -> list[str]:
    return [c for c in cols if c in df.columns]


def model_rows(models: Sequence[str], readouts_root: Path | str, gates_root: Path | str, geometry_root: Path | str,
               cfg: DiagnoseConfig, intervals: IntervalsConfig | None = None, seed: int = 0) -> dict:
    """The per-model work of :func:`diagnose_models` (in this process or as a Dask task): each model's failure
    rows, Spearman rows, verdict, metadata row and D@X rows (lists, one entry per row, in model order) and
    whether it has gates outputs. The Spearman intervals resample the test split exactly as the readouts and
    gates stages do (same sequences, same B, same seed from ``base.seed`` and the model name)."""
    readouts_root, gates_root, geometry_root = Path(readouts_root), Path(gates_root), Path(geometry_root)
    fail_rows, sp_rows, verdict_rows, meta_rows, dx_all = [], [], [], [], []
    gates_present = False
    for model in models:
        mpath = readouts_root / model / "metrics.json"
        if not mpath.is_file():
            raise MissingInputError(f"{mpath} not found; run the readouts stage for {model} first")
        rm = read_json(mpath)
        info = {"model": model, "task": rm.get("task"), "regime": rm.get("regime"),
                "regime_kind": rm.get("regime_kind"), "n_loops": rm.get("n_loops")}
        meta_rows.append({k: info[k] for k in ("model", "task", "regime", "regime_kind")})
        outs = [("readouts", _read_rule_outputs(readouts_root / model, "readouts"))]
        g = _read_rule_outputs(gates_root / model, "gates")
        if g is not None:
            gates_present = True
            outs.append(("gates", g))
        test: SplitArrays = load_token_loop(geometry_root / model / "token_loop.parquet", splits=("test",),
                                           columns=("correct", *cfg.spearman_signals))["test"]
        correct = test.loop["correct"]
        chosen, dxs = [], []
        for source, o in outs:
            chosen.append(o["chosen"].select(_present(o["chosen"], _CHOSEN_COLS)))
            dxs.append(o["dx"].select(_present(o["dx"], _DX_COLS)))
            kinds = dict(zip(o["chosen"]["rule"].to_list(), o["chosen"]["kind"].to_list(), strict=True))
            ex = o["chosen_exits"]
            for rule in ex["rule"].unique(maintain_order=True).to_list():
                e = ex.filter(pl.col("rule") == rule).sort("token")
                tok = e["token"].to_numpy()
                if tok.size != test.token.size or not np.array_equal(tok, test.token):
                    raise InputError(f"{source}/{model}/chosen_exits.parquet rule '{rule}': test tokens do not match "
                                     f"the geometry test split ({tok.size} vs {test.token.size}); re-run {source}")
                depth = e["exit_depth"].to_numpy()
                codes = failure_codes(depth, correct)
                for row in failure_rows(codes, depth, test.fields["difficulty"]):
                    fail_rows.append({**{k: info[k] for k in ("model", "task", "regime", "regime_kind")},
                                      "source": source, "rule": rule, "kind": kinds.get(rule), **row})
        signals = {s: test.loop[s] for s in cfg.spearman_signals}
        c = correct
        signals["oracle_depth"] = np.where(c.any(1), c.argmax(1) + 1, c.shape[1]).astype(np.float64)
        rs = split_resampler(test.fields, test.n, intervals, boot_seed(seed, model, "test"))
        sp_rows += [{"model": model, **r} for r in spearman_rows(test.fields["difficulty"], signals, rs,
                                                                _interval_rows(cfg))]
        ch, dx = pl.concat(chosen, how="diagonal_relaxed"), pl.concat(dxs, how="diagonal_relaxed")
        dx_all.append(dx.with_columns(model=pl.lit(model)))
        # the ceiling with its bootstrap interval as the readouts stage wrote it (same resamples as every rule
        # of the model); outputs without one fall back to the point value from the test split
        orc = (rm.get("rules") or {}).get("oracle", {}).get("ceiling") or {}
        oracle = {"depth": orc.get("test_depth") or float(signals["oracle_depth"].mean()),
                  "accuracy": orc.get("test_accuracy") or float(c.any(1).mean())}
        mf = pl.DataFrame([r for r in fail_rows if r["model"] == model])
        verdict_rows.append(verdict(info, ch, dx, oracle, mf, cfg))
    return {"fail_rows": fail_rows, "sp_rows": sp_rows, "verdict_rows": verdict_rows, "meta_rows": meta_rows,
            "dx_all": dx_all, "gates_present": gates_present}


def _interval_rows(cfg: DiagnoseConfig) -> Callable[[str, int | None, str], bool] | None:
    """Which Spearman rows get an interval (``diagnose.spearman_intervals``); None = all."""
    if cfg.spearman_intervals == "all":
        return None
    return lambda signal, loop, agg: (signal == cfg.spearman_headline and agg == cfg.spearman_aggregation
                                      and loop == cfg.spearman_loop)


def _diagnosis(fail_rows: list, sp_rows: list, verdict_rows: list, meta_rows: list, dx_all: list,
               gates_present: bool, cfg: DiagnoseConfig, meta: dict | None
               ) -> tuple[dict[str, pl.DataFrame], str, dict]:
    """Frames, claims, summary and metrics of :func:`diagnose_models` from the per-model rows."""
    meta_df = pl.DataFrame(meta_rows, schema={"model": pl.String, "task": pl.String, "regime": pl.String,
                                              "regime_kind": pl.String})
    dx_df = pl.concat(dx_all, how="diagonal_relaxed")
    claims = ad_claims(meta_df, dx_df, cfg, gates_present)
    frames = {
        "failure_classes": pl.DataFrame(fail_rows, infer_schema_length=None),
        "spearman": pl.DataFrame(sp_rows, schema_overrides={"loop": pl.Int64}, infer_schema_length=None),
        "verdicts": pl.DataFrame(verdict_rows, infer_schema_length=None),
    }
    groups = group_verdicts(frames["verdicts"], cfg)
    frames["verdict_groups"] = groups
    summary = summary_markdown(frames["verdicts"], claims, frames["spearman"], cfg, frames["failure_classes"],
                               groups)
    figs = ("best_depth", "fixed_depth", "native_depth", "oracle_depth", "dx_fixed", "dx_best_posthoc",
            "dx_best_gate", "dx_native")

    def entry(row: dict, n_seeds: int) -> dict:
        out = {k: row[k] for k in ("verdict", "reason")}
        out["best_rule" if "best_rule" in row else "best_rules"] = row.get("best_rule", row.get("best_rules"))
        for k in figs:
            i = _row_iv(row, k)
            out[k] = None if i is None else {**Interval(i.estimate, i.lo, i.hi, n_seeds,
                                                        "t over seeds" if n_seeds > 1 else "bootstrap").to_dict(),
                                             "text": (_dx_ci if k.startswith("dx_") else _ci)(i)}
        return out

    g_rho, m_rho = spearman_headlines(frames["spearman"], cfg)

    def rho_entry(d: dict) -> dict:
        return {**d["iv"].to_dict(), "n": d["n"], "unit": d["unit"]}

    metrics = {**(meta or {}), "gates_present": gates_present,
               "spearman": {"signal": cfg.spearman_headline, "loop": cfg.spearman_loop,
                            "aggregation": cfg.spearman_aggregation,
                            "models": {m: rho_entry(d) for m, d in m_rho.items()},
                            "groups": {g: rho_entry(d) for g, d in g_rho.items()}},
               "claims": {c["claim"]: c["status"] for c in claims},
               "models": {v["model"]: entry(v, 1) for v in verdict_rows},
               "groups": {g["group"]: {"n_seeds": g["n_seeds"], "seed_verdicts": g["seed_verdicts"],
                                       **entry(g, g["n_seeds"])} for g in groups.iter_rows(named=True)}}
    return frames, summary, {**metrics, "claim_details": [{k: c[k] for k in ("claim", "status", "details")}
                                                          for c in claims]}


def write_diagnosis(out_dir: Path | str, frames: dict[str, pl.DataFrame], summary: str, metrics: dict) -> None:
    """Write the diagnose outputs atomically (parquets, summary.md, metrics.json)."""
    write_outputs(out_dir, frames, metrics, extra_text={"summary.md": summary})
