"""Diagnose's statistics, no sentences: failure classes (SPEC §7), Spearman ρ of difficulty vs signals, the
verdict decision from four depth figures (:func:`decide`), the val-chosen D@X (:func:`dx_best`) and the interval
helpers of verdict rows."""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from typing import Any, cast, overload

import numpy as np
import polars as pl

from looptrace.diagnose.config import CLASSES, DiagnoseConfig
from looptrace.estimates import Difference, Interval, across_seeds, difference, from_row
from looptrace.intervals import Resampler, spearman_level_samples, spearman_token_samples
from looptrace.project import split_seed


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
    groups: list[tuple[str, int | None, np.ndarray]] = [("all", None, np.ones(codes.size, dtype=bool))]
    groups += [("difficulty", int(v), difficulty == v) for v in np.unique(difficulty)]
    for group, level, sel in groups:
        n = int(sel.sum())
        counts = np.bincount(codes[sel], minlength=len(CLASSES))
        row: dict[str, Any] = {"group": group, "difficulty": level, "n_tokens": n}
        row.update({c: int(k) for c, k in zip(CLASSES, counts, strict=True)})
        row.update({f"frac_{c}": (k / n if n else math.nan) for c, k in zip(CLASSES, counts, strict=True)})
        row["exit_depth_mean"] = float(exit_depth[sel].mean()) if n else math.nan
        rows.append(row)
    return rows


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
        # the samplers run only when rs is set (_rho_interval), hence cast(Resampler, rs)
        for loop, v in cols:
            rho, p, n = _spearman(diff, v)
            rows.append({"signal": name, "loop": loop, "aggregation": "token", "rho": rho, "pvalue": p, "n": n,
                         **_rho_interval(rs, with_interval, name, loop, "token", rho,
                                         lambda v=v: spearman_token_samples(cast(Resampler, rs), diff, v))})
            means = np.array([np.nanmean(v[diff == lv]) if np.isfinite(v[diff == lv]).any() else np.nan
                              for lv in levels])
            rho, p, n = _spearman(levels, means)
            rows.append({"signal": name, "loop": loop, "aggregation": "difficulty_mean", "rho": rho, "pvalue": p,
                         "n": n, **_rho_interval(rs, with_interval, name, loop, "difficulty_mean", rho,
                                                 lambda v=v: spearman_level_samples(cast(Resampler, rs), diff, v)[0])})
    return rows


def _rho_interval(rs: Resampler | None, with_interval: Callable | None, signal: str, loop: int | None, agg: str,
                  rho: float, samples: Callable[..., np.ndarray]) -> dict:
    """``rho_lo``, ``rho_hi``, ``n_boot``, ``n_sequences`` of one Spearman row (NaN / 0 when it has none)."""
    if rs is None or rs.n_boot == 0 or math.isnan(rho) or (with_interval is not None
                                                           and not with_interval(signal, loop, agg)):
        return {"rho_lo": math.nan, "rho_hi": math.nan, "n_boot": 0, "n_sequences": 0}
    lo, hi = rs.interval(samples())
    return {"rho_lo": float(lo), "rho_hi": float(hi), "n_boot": rs.n_boot, "n_sequences": rs.n_units}


#: The three verdicts (module docstring) and their reasons; ``undecided`` when the intervals support none.
VERDICTS = ("trajectory-limited", "readout-limited", "at-ceiling", "undecided")

#: (keyed ``str | None`` so a row's missing reason looks up as absent)
REASONS: dict[str | None, str] = {
    "no_early_exit": "trajectory-limited", "no_headroom": "trajectory-limited",
    "native_gate": "readout-limited", "below_ceiling": "readout-limited", "at_ceiling": "at-ceiling",
    "undecided_early_exit": "undecided", "undecided_ceiling": "undecided", "undecided_native": "undecided"}

#: The comparisons a verdict rests on: key -> (a, b) of the difference a − b.
COMPARISONS = {"best_vs_fixed": ("best", "fixed"), "oracle_vs_fixed": ("oracle", "fixed"),
               "native_vs_best": ("native", "best"), "best_vs_oracle": ("best", "oracle")}

#: The comparison an undecided verdict waits on.
BLOCKING = {"undecided_early_exit": "best_vs_fixed", "undecided_ceiling": "best_vs_oracle",
            "undecided_native": "native_vs_best"}


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


@overload
def _chosen_interval(row: dict) -> Interval: ...
@overload
def _chosen_interval(row: dict | None) -> Interval | None: ...
def _chosen_interval(row: dict | None) -> Interval | None:
    """The test depth of a ``chosen`` row (val-chosen point) with its bootstrap interval."""
    return None if row is None else from_row(row, "test_depth")


def _present(i: Interval | None) -> bool:
    return i is not None and i.present


def decide(best: Interval | None, fixed: Interval, oracle: Interval, native: Interval | None,
           tol: float, diffs: dict[str, Difference | None] | None = None) -> dict:
    """The verdict from four depth figures (loops; each with its interval), as the module docstring states.

    Every comparison is the difference a − b with an interval (:class:`looptrace.estimates.Difference`): by
    default from the two figures' own intervals ([a.lo − b.hi, a.hi − b.lo]: disjoint intervals ⇔ it excludes
    0); ``diffs`` overrides it per comparison (the paired per-seed differences of a task × regime). A gap
    counts only when the interval excludes 0 *and* the estimate is at least ``tol`` loops; the *absence* of a
    gap counts only when the interval rules out one of ``tol`` or more. A verdict is one of the three outcomes
    only when the comparisons it rests on are decided that way; otherwise **undecided** (reason
    ``undecided_early_exit`` / ``undecided_ceiling`` / ``undecided_native``: the comparison it waits on).

    Args:
        best: the val-chosen best post-hoc readout or refit gate's test depth (None: no such rule).
        fixed: fixed depth's val-chosen test depth.
        oracle: the oracle earliest-correct ceiling's mean test depth.
        native: the native gate's test depth (None: no native gate).
        tol: ``diagnose.gap_tol`` (loops).
        diffs: comparison key (:data:`COMPARISONS`) -> its difference, replacing the one from the intervals.

    Returns:
        dict: verdict, reason, the comparisons' words ``best_vs_fixed``, ``oracle_vs_fixed``, ``native_vs_best``,
        ``best_vs_oracle`` (:meth:`Difference.word`; None when a side is absent), ``diff_<key>`` (the
        :class:`Difference` or None) and ``blocking`` (the comparison an undecided verdict waits on, else None).
    """
    figs = {"best": best, "fixed": fixed, "oracle": oracle, "native": native}
    dd: dict[str, Difference | None] = {}
    for key, (a, b) in COMPARISONS.items():
        fa, fb = figs[a], figs[b]
        over = (diffs or {}).get(key)
        dd[key] = (over if over is not None else difference(cast(Interval, fa), cast(Interval, fb))) \
            if _present(fa) and _present(fb) else None
    bf, of, nb, bo = (dd[k] for k in COMPARISONS)
    if bf is None or bf.not_lower(tol) and not bf.lower(tol):
        reason = "no_headroom" if of is None or not of.lower(tol) else "no_early_exit"
    elif not bf.lower(tol):
        reason = "undecided_early_exit"
    elif nb is not None and nb.higher(tol):
        reason = "native_gate"
    elif bo is not None and bo.higher(tol):
        reason = "below_ceiling"
    elif bo is not None and not bo.not_higher(tol):
        reason = "undecided_ceiling"
    elif nb is not None and not nb.not_higher(tol):
        reason = "undecided_native"
    else:
        reason = "at_ceiling"
    out: dict[str, Any] = {"verdict": REASONS[reason], "reason": reason, "blocking": BLOCKING.get(reason)}
    for key, d in dd.items():
        out[key] = d.word(tol) if d is not None else None
        out[f"diff_{key}"] = d
    return out


def decide_margins(d: Difference, key: str, tol: float) -> list[float]:
    """The largest half-widths at which the comparison ``key`` would be decided at its observed mean: one to
    exclude 0 (when |mean| ≥ tol) and one to rule out a gap of ``tol`` in the direction the verdict needs
    (:func:`looptrace.estimates.seeds_needed`)."""
    m = d.estimate
    out = [abs(m)] if abs(m) >= tol else []
    out.append(m + tol if key == "best_vs_fixed" else tol - m)  # not lower / not higher by tol
    return out


def _cols(name: str, i: Interval | None) -> dict:
    """``name``, ``name_lo``, ``name_hi`` of an interval (NaN when absent; +inf kept for an unreachable D@X)."""
    if i is None:
        return {name: math.nan, f"{name}_lo": math.nan, f"{name}_hi": math.nan}
    return {name: i.estimate, f"{name}_lo": i.lo, f"{name}_hi": i.hi}


def _row_iv(row: dict, name: str) -> Interval | None:
    v = _f(row.get(name))
    return None if math.isnan(v) else Interval(v, _f(row.get(f"{name}_lo")), _f(row.get(f"{name}_hi")))


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


def _group_ci(items: Sequence[Interval | None], level: float = 0.95,
              bounds: tuple[float, float] | None = None) -> Interval:
    """Across-seed figure of per-seed intervals (None = absent), within ``bounds`` when given."""
    return across_seeds([i for i in items if i is not None], level, bounds)


def _headline_rho(spearman: pl.DataFrame, cfg: DiagnoseConfig) -> pl.DataFrame:
    sel = spearman.filter((pl.col("signal") == cfg.spearman_headline)
                          & (pl.col("aggregation") == cfg.spearman_aggregation))
    return sel.filter(pl.col("loop").is_null() if cfg.spearman_loop is None else pl.col("loop") == cfg.spearman_loop)


def spearman_headlines(spearman: pl.DataFrame, cfg: DiagnoseConfig) -> tuple[dict[str, dict], dict[str, dict]]:
    """The headline ρ of every model and of every task × regime over its seeds.

    Returns:
        (groups, models): name -> {``iv`` (:class:`Interval`: a model's bootstrap interval; a group's mean
        with the Student-t interval over seeds on Fisher's z scale, within [−1, 1]), ``n`` (points ρ is over; a list for groups), ``unit``,
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
    groups = {g: {"iv": across_seeds([models[m]["iv"] for m in ms], bounds=(-1.0, 1.0)), "n": [models[m]["n"] for m in ms],
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
