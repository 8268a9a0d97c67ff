"""Operating points of exit rules: calibration grid, exit depths, Pareto fronts, D@X, chosen point.

An exit rule turns a token's per-loop score ``[token, loop]`` into an exit depth d ∈ {1..T}
(1-based; T when the threshold is never met). Calibration follows [AD]: the thresholds of a rule
are ``calibration.n_quantiles`` empirical quantiles (0.5th … 99.5th percentile) of the score's
finite values on the validation split; that grid is frozen and applied unchanged to the test split.
Each threshold is one operating point (mean exit depth, accuracy, mean loss). The chosen point of a
rule is the lowest-depth threshold whose *validation* accuracy is within δ points of full-depth
accuracy.

Post-hoc readouts (:mod:`looptrace.rules.readouts`) and refit gates (:mod:`looptrace.gates`) are
scored by exactly these functions, with one :class:`CalibrationConfig` (params section
``calibration``), so their frontiers are comparable by construction.

Units: accuracy is a fraction in [0, 1]; ``x`` of D@X and ``delta`` of the chosen point are in
percentage points (X = 95 means accuracy ≥ 0.95; δ = 0.5 means 0.005), as in SPEC §4.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated

import numpy as np
import polars as pl

from looptrace.config import Check, ConfigError, InputError, Percent
from looptrace.estimates import Interval
from looptrace.intervals import Resampler, dx_samples, percentile_interval
from looptrace.io.tables import SplitArrays
from looptrace.signals import firing

# Comparisons of k/N fractions against x/100: a tiny tolerance so that e.g. 57/100 ≥ 0.57 holds.
_EPS = 1e-12
# Upper bound on the elements of one [K, chunk, T] boolean block in exit_depths (memory guard).
_MAX_BLOCK = 1 << 24
#: The smallest calibration.n_quantiles a params file may set (CalibrationConfig).
MIN_QUANTILES = 11
#: [AD]'s grid size (the default of calibration.n_quantiles), allowed whatever the data's size.
AD_QUANTILES = 51



@dataclass(frozen=True)
class CalibrationConfig:
    """``calibration`` section of ``params.yaml``: one protocol for readouts and gates ([AD], SPEC §4).

    Attributes:
        n_quantiles: size of the validation quantile grid (51 in [AD]: 0.5th … 99.5th percentile). From a params
            file at least :data:`MIN_QUANTILES` (11): the grid is a rule's only operating points, so with n
            quantiles consecutive thresholds are 99/(n − 1) percentiles of the val signal apart and a rule's
            Pareto front has at most n points; below 11 (a point per decile) D@X and the chosen point are set by
            where the few thresholds fall rather than by the rule (measured on the default models: n = 1 flips
            the best rule from entropy to hidden_change, D@95 1.15 → 2.02). Tests may build smaller grids in code.
        delta: chosen-point tolerance, accuracy points below full-depth val accuracy ([AD]: 0.5).
        dx: accuracy targets X (percent) of D@X.
    """

    n_quantiles: Annotated[int, Check(ge=MIN_QUANTILES, why="val quantile thresholds per rule: at least one per decile")] = 51
    delta: Annotated[float, Check(ge=0, le=100, why="accuracy points")] = 0.5
    dx: Annotated[tuple[Percent, ...], Check(nonempty=True)] = (95.0, 98.0, 99.0)

    def __post_init__(self) -> None:
        if self.n_quantiles < 1:
            raise ConfigError(f"calibration.n_quantiles must be ≥ 1, got {self.n_quantiles}")
        if not 0.0 <= self.delta <= 100.0:
            raise ConfigError(f"calibration.delta must be in [0, 100] accuracy points, got {self.delta}")
        if not self.dx or any(not 0.0 < x <= 100.0 for x in self.dx):
            raise ConfigError(f"calibration.dx: accuracy percentages in (0, 100], got {list(self.dx)}")


def check_n_quantiles(n_quantiles: int, n_tokens: int, n_loops: int, where: str) -> None:
    """Refuse a quantile grid larger than the val values it is drawn from (a bound derived from the data).

    A rule's thresholds can only produce distinct operating points where they fall between distinct val values,
    so a grid of more than ``n_tokens × n_loops`` quantiles adds none and only costs memory (1 000 000 on a small
    model allocated 8.4 GiB before dying). [AD]'s 51 is always allowed (a tiny model's val split may hold fewer
    values; the surplus thresholds then repeat operating points at no real cost).

    Raises:
        ConfigError: one line naming the key, the data's size and the bound.
    """
    bound = max(AD_QUANTILES, int(n_tokens) * int(n_loops))
    if n_quantiles > bound:
        raise ConfigError(f"calibration.n_quantiles = {n_quantiles} exceeds the {int(n_tokens) * int(n_loops)} val "
                          f"values it is drawn from ({where}: {n_tokens} val tokens × {n_loops} loops): more "
                          f"thresholds add no operating point; set calibration.n_quantiles ≤ {bound} (51 in [AD])")


def quantile_grid(values: np.ndarray, n: int = 51) -> np.ndarray:
    """Threshold grid of [AD]: ``n`` evenly spaced empirical percentiles, 0.5th … 99.5th.

    Args:
        values: any-shape array of the signal on the validation split (e.g. [token, loop]); NaN and
            ±inf (undefined loops such as kl_prev at t = 1) are ignored.
        n: number of quantiles (51 in [AD]); n = 1 gives the median.

    Returns:
        np.ndarray [n] float64, non-decreasing (``np.percentile``, linear interpolation).

    Raises:
        ValueError: when ``values`` has no finite entry (the rule cannot be calibrated).
    """
    v = np.asarray(values, dtype=np.float64).ravel()
    v = v[np.isfinite(v)]
    if v.size == 0:
        raise InputError("quantile_grid: the signal has no finite value on the calibration split")
    if n < 1:
        raise ValueError(f"quantile_grid: n must be ≥ 1, got {n}")
    q = np.linspace(0.5, 99.5, n) if n > 1 else np.array([50.0])
    return np.percentile(v, q)


def exit_depths(signal: np.ndarray, thresholds: np.ndarray, op: str, min_loop: int = 1,
                two_hit: bool = False) -> np.ndarray:
    """Exit depth of every (threshold, token): d = min{t ≥ min_loop : signal_t op threshold}, else T.

    Args:
        signal: [token, loop] float; NaN never satisfies a threshold (undefined loops).
        thresholds: [K] float.
        op: ``"le"`` (exit when signal ≤ threshold: entropy, KL, steps) or ``"ge"`` (exit when
            signal ≥ threshold: max_prob, margin, halting probability).
        min_loop: first loop (1-based) at which the rule may fire: 2 for rules on t − 1 differences
            (kl_prev, rel_step, ...), 3 for accel_two_hit (SPEC §4).
        two_hit: require the condition at t *and* t − 1 ([TS] acceleration exit, a_t ≤ τ and
            a_{t−1} ≤ τ).

    Returns:
        np.ndarray [K, token] int64 of 1-based exit depths; T where the condition is never met.
    """
    sig = np.asarray(signal, dtype=np.float64)
    if sig.ndim != 2:
        raise ValueError(f"exit_depths: signal must be [token, loop], got shape {sig.shape}")
    thr = np.asarray(thresholds, dtype=np.float64).ravel()
    if op not in ("le", "ge"):
        raise ValueError(f"exit_depths: op must be 'le' or 'ge', got {op!r}")
    n_tok, n_loop = sig.shape
    out = np.empty((thr.size, n_tok), dtype=np.int64)
    allowed = np.arange(1, n_loop + 1) >= min_loop  # [loop]
    chunk = max(1, _MAX_BLOCK // max(1, thr.size * n_loop))
    for lo in range(0, n_tok, chunk):
        s = sig[None, lo:lo + chunk, :]  # [1, n, T]
        t = thr[:, None, None]  # [K, 1, 1]
        hit = (s <= t) if op == "le" else (s >= t)  # NaN compares False
        if two_hit:
            hit = firing.two_hit(hit)
        hit &= allowed
        first = hit.argmax(axis=-1)  # first True (0 when none)
        out[:, lo:lo + chunk] = np.where(hit.any(axis=-1), first + 1, n_loop)
    return out


def evaluate_points(depths: np.ndarray, correct: np.ndarray, loss: np.ndarray
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Mean exit depth, accuracy and mean loss of each operating point.

    Args:
        depths: [K, token] 1-based exit depths.
        correct: [token, loop] bool, argmax_t == y.
        loss: [token, loop] float, ℓ_t = −log p_t(y) (nats).

    Returns:
        (mean_depth [K] in loops, accuracy [K] fraction, mean_loss [K] nats), float64.
    """
    d = np.asarray(depths)
    if d.ndim == 1:
        d = d[None]
    idx = d - 1  # [K, token] 0-based loop
    rows = np.arange(d.shape[1])[None, :]
    corr = np.asarray(correct, dtype=bool)[rows, idx]
    los = np.asarray(loss, dtype=np.float64)[rows, idx]
    return d.mean(axis=1, dtype=np.float64), corr.mean(axis=1, dtype=np.float64), los.mean(axis=1)


def pareto_mask(depth: np.ndarray, acc: np.ndarray) -> np.ndarray:
    """Non-dominated operating points (lower depth and higher accuracy are better).

    Point i is dominated when some j has depth_j ≤ depth_i and acc_j ≥ acc_i with at least one
    strict; exact duplicates do not dominate each other (both stay on the front).

    Args:
        depth: [K] mean exit depths.
        acc: [K] accuracies.

    Returns:
        bool [K]; NaN points are never on the front.
    """
    d = np.asarray(depth, dtype=np.float64).ravel()
    a = np.asarray(acc, dtype=np.float64).ravel()
    ok = np.isfinite(d) & np.isfinite(a)
    dj, aj = d[None, :], a[None, :]
    di, ai = d[:, None], a[:, None]
    dom = (dj <= di) & (aj >= ai) & ((dj < di) | (aj > ai)) & ok[None, :]
    return ok & ~dom.any(axis=1)


def d_at(depth: np.ndarray, acc: np.ndarray, x: float) -> float:
    """D@X: the smallest mean depth among operating points whose accuracy ≥ X % (SPEC §4).

    Args:
        depth: [K] mean exit depths (test split).
        acc: [K] accuracies as fractions (test split).
        x: the accuracy target in percent (95, 98, 99).

    Returns:
        The depth in loops, or NaN when no point reaches X (unreachable — never clipped to T).
    """
    d = np.asarray(depth, dtype=np.float64).ravel()
    a = np.asarray(acc, dtype=np.float64).ravel()
    ok = np.isfinite(d) & (a + _EPS >= x / 100.0)
    return float(d[ok].min()) if ok.any() else math.nan


def choose_point(val_depth: np.ndarray, val_acc: np.ndarray, full_acc: float, delta: float = 0.5) -> int:
    """Index of a rule's chosen operating point, picked on validation only ([AD], SPEC §4).

    The lowest-depth threshold whose validation accuracy is within ``delta`` points of full-depth
    validation accuracy (ties: higher accuracy, then lower index). When no point qualifies, the
    highest-accuracy point (ties: lower depth) — the closest the rule can get.

    Args:
        val_depth: [K] mean exit depth on val.
        val_acc: [K] accuracy on val (fraction).
        full_acc: full-depth (t = T) accuracy on val (fraction).
        delta: tolerance in percentage points (0.5 = half a point).

    Returns:
        int index into the K points.
    """
    d = np.asarray(val_depth, dtype=np.float64).ravel()
    a = np.asarray(val_acc, dtype=np.float64).ravel()
    if d.size == 0:
        raise ValueError("choose_point: no operating points")
    ok = a + _EPS >= full_acc - delta / 100.0
    if ok.any():
        cand = np.flatnonzero(ok)
        order = np.lexsort((cand, -a[cand], d[cand]))  # depth asc, acc desc, index asc
        return int(cand[order[0]])
    idx = np.arange(d.size)
    return int(np.lexsort((idx, d, -a))[0])


@dataclass(frozen=True)
class Points:
    """Operating points of one rule on one split: each array [K]."""

    mean_depth: np.ndarray
    accuracy: np.ndarray
    mean_loss: np.ndarray


@dataclass(frozen=True)
class BootPoints:
    """Bootstrap resamples (over test sequences, :class:`~looptrace.intervals.Resampler`) of a rule's test points.

    Attributes:
        mean_depth, accuracy: [B, K] the K frozen thresholds' test mean depth and accuracy in each resample.
        info: ``n_boot``, ``n_sequences``, ``unit``, ``level``.
    """

    mean_depth: np.ndarray
    accuracy: np.ndarray
    info: dict

    @property
    def level(self) -> float:
        return float(self.info.get("level", 0.95))


@dataclass(frozen=True)
class RuleResult:
    """One rule evaluated end to end: frozen val grid, points on val and test, the chosen point.

    Attributes:
        rule: rule name (``entropy``, ``fixed``, ``gate:<model>-<labels>`` ...).
        thresholds: [K] the frozen grid (for fixed / argmax_stable: the depth / k).
        val, test: operating points on each split.
        chosen: index of the chosen point (picked on val).
        test_exits: [token] exit depths on test at the chosen point.
        test_correct: [token] bool, correctness at those exits.
        test_token: [token] store row ids of the test tokens.
        kind: ``fixed`` | ``posthoc`` | ``native`` | ``oracle`` | ``gate`` (for summaries).
        full_val_accuracy: full-depth val accuracy the choice was measured against.
        delta: the chosen-point tolerance used (points).
        boot: bootstrap resamples of the test points (None = no intervals).
    """

    rule: str
    thresholds: np.ndarray
    val: Points
    test: Points
    chosen: int
    test_exits: np.ndarray
    test_correct: np.ndarray
    test_token: np.ndarray
    kind: str = "posthoc"
    full_val_accuracy: float = math.nan
    delta: float = 0.5
    boot: BootPoints | None = None


def boot_points(test_depths: np.ndarray, correct: np.ndarray, rs: Resampler | None) -> BootPoints | None:
    """Resampled test mean depth and accuracy of every threshold: two [B, U] × [U, K] products.

    Args:
        test_depths: [K, token] 1-based exit depths on test.
        correct: [token, loop] bool.
        rs: the model's test resampler (None or B = 0: no intervals).
    """
    if rs is None or rs.n_boot == 0:
        return None
    d = np.asarray(test_depths)
    if d.ndim == 1:
        d = d[None]
    corr = np.asarray(correct, dtype=bool)[np.arange(d.shape[1])[None, :], d - 1]
    return BootPoints(mean_depth=rs.ratio(d), accuracy=rs.ratio(corr), info=rs.describe())


def evaluate_depths(rule: str, thresholds: np.ndarray, val_depths: np.ndarray, test_depths: np.ndarray,
                    val: SplitArrays, test: SplitArrays, delta: float = 0.5, kind: str = "posthoc",
                    resampler: Resampler | None = None, chosen: int | None = None) -> RuleResult:
    """Score precomputed exit depths of one rule on val and test and pick its chosen point.

    Args:
        rule: rule name.
        thresholds: [K] threshold of each point (recorded in the outputs).
        val_depths: [K, token_val] 1-based exit depths on val.
        test_depths: [K, token_test] 1-based exit depths on test (same thresholds).
        val, test: correctness / loss of each split.
        delta: chosen-point tolerance in accuracy points.
        kind: rule family label.
        resampler: bootstrap over the test split's sequences (None = no intervals).
        chosen: the chosen point's index when the rule calibrates itself on val (CALM); None = the [AD]
            protocol (:func:`choose_point`).

    Returns:
        RuleResult.
    """
    vp = Points(*evaluate_points(val_depths, val.correct, val.loss))
    tp = Points(*evaluate_points(test_depths, test.correct, test.loss))
    full = val.full_accuracy
    k = choose_point(vp.mean_depth, vp.accuracy, full, delta) if chosen is None else int(chosen)
    exits = np.asarray(test_depths)[k].astype(np.int64)
    corr = np.asarray(test.correct, dtype=bool)[np.arange(exits.size), exits - 1]
    tok = np.arange(exits.size) if test.token is None else np.asarray(test.token)
    return RuleResult(rule=rule, thresholds=np.asarray(thresholds, dtype=np.float64).ravel(), val=vp, test=tp,
                      chosen=k, test_exits=exits, test_correct=corr, test_token=tok, kind=kind,
                      full_val_accuracy=full, delta=delta, boot=boot_points(test_depths, test.correct, resampler))


def evaluate_rule(rule: str, val_signal: np.ndarray, test_signal: np.ndarray, val: SplitArrays, test: SplitArrays,
                  op: str, min_loop: int = 1, two_hit: bool = False, n_quantiles: int = 51,
                  delta: float = 0.5, kind: str = "posthoc", resampler: Resampler | None = None) -> RuleResult:
    """Evaluate one threshold rule end to end ([AD] protocol).

    The grid is ``quantile_grid`` of the val signal (finite values, all loops), frozen and applied
    to both splits; the chosen point is picked on val; test exits are reported at that point.

    Args:
        rule: rule name.
        val_signal: [token_val, loop] signal on val.
        test_signal: [token_test, loop] signal on test.
        val, test: correctness / loss per split.
        op: ``"le"`` or ``"ge"`` (see ``exit_depths``).
        min_loop: first loop the rule may fire at (1, 2 or 3).
        two_hit: condition must hold at t and t − 1 (accel_two_hit).
        n_quantiles: grid size (51).
        delta: chosen-point tolerance in points.
        kind: rule family label.
        resampler: bootstrap over the test split's sequences (None = no intervals).

    Returns:
        RuleResult.
    """
    grid = quantile_grid(val_signal, n_quantiles)
    vd = exit_depths(val_signal, grid, op, min_loop, two_hit)
    td = exit_depths(test_signal, grid, op, min_loop, two_hit)
    return evaluate_depths(rule, grid, vd, td, val, test, delta, kind, resampler)


#: Column of ``dx.parquet`` that says where D@X's threshold comes from (SPEC §4: an oracle-threshold figure).
DX_THRESHOLD_FROM = "test labels (oracle threshold)"


def rule_intervals(r: RuleResult, dx: Sequence[float] = (95, 98, 99)) -> dict:
    """Every interval of one rule from its bootstrap resamples (NaN bounds when it has none).

    Returns:
        dict: ``points`` {mean_depth_lo/hi, accuracy_lo/hi: [K]}, ``chosen`` {test_depth_lo/hi,
        test_accuracy_lo/hi}, ``dx`` {x: (lo, hi, reach_share)} (+inf bound = unreachable in those resamples),
        ``info`` (n_boot, n_sequences, unit, level).
    """
    K = r.thresholds.size
    nan = np.full(K, np.nan)
    if r.boot is None:
        return {"points": {"mean_depth_lo": nan, "mean_depth_hi": nan, "accuracy_lo": nan, "accuracy_hi": nan},
                "chosen": {"test_depth_lo": math.nan, "test_depth_hi": math.nan, "test_accuracy_lo": math.nan,
                           "test_accuracy_hi": math.nan},
                "dx": {float(x): (math.nan, math.nan, math.nan) for x in dx},
                "info": {"n_boot": 0, "n_sequences": 0, "unit": None, "level": math.nan}}
    b, lvl = r.boot, r.boot.level
    dlo, dhi = percentile_interval(b.mean_depth, lvl)
    alo, ahi = percentile_interval(b.accuracy, lvl)
    k = r.chosen
    out_dx = {}
    for x in dx:
        s = dx_samples(b.mean_depth, b.accuracy, x)
        lo, hi = percentile_interval(s, lvl)
        out_dx[float(x)] = (float(lo), float(hi), float(np.isfinite(s).mean()))
    return {"points": {"mean_depth_lo": dlo, "mean_depth_hi": dhi, "accuracy_lo": alo, "accuracy_hi": ahi},
            "chosen": {"test_depth_lo": float(dlo[k]), "test_depth_hi": float(dhi[k]),
                       "test_accuracy_lo": float(alo[k]), "test_accuracy_hi": float(ahi[k])},
            "dx": out_dx, "info": dict(b.info)}


def _xkey(x: float) -> str:
    return str(int(x) if float(x).is_integer() else x)


def headline_entry(r: RuleResult, cal: CalibrationConfig) -> dict:
    """One rule's metrics.json entry: its val-chosen point on test with intervals (the honest headline) and,
    labelled as such, its oracle-threshold D@X with intervals."""
    iv = rule_intervals(r, cal.dx)
    info = iv["info"]
    common = {"n_boot": info["n_boot"], "n_sequences": info["n_sequences"]}
    entry: dict = {"kind": r.kind}
    k = r.chosen
    if r.kind != "oracle":
        c = iv["chosen"]
        entry["chosen"] = {
            "threshold": float(r.thresholds[k]), "picked_on": "val", "val_depth": float(r.val.mean_depth[k]),
            "val_accuracy": float(r.val.accuracy[k]),
            "test_depth": Interval(float(r.test.mean_depth[k]), c["test_depth_lo"], c["test_depth_hi"], **common).to_dict(),
            "test_accuracy": Interval(float(r.test.accuracy[k]), c["test_accuracy_lo"], c["test_accuracy_hi"],
                                      **common).to_dict()}
    else:
        p = iv["points"]
        entry["ceiling"] = {
            "test_depth": Interval(float(r.test.mean_depth[0]), float(p["mean_depth_lo"][0]),
                                   float(p["mean_depth_hi"][0]), **common).to_dict(),
            "test_accuracy": Interval(float(r.test.accuracy[0]), float(p["accuracy_lo"][0]),
                                      float(p["accuracy_hi"][0]), **common).to_dict()}
    dxs = {}
    for x in cal.dx:
        v = d_at(r.test.mean_depth, r.test.accuracy, x)
        lo, hi, reach = iv["dx"][float(x)]
        dxs[_xkey(x)] = {**Interval(math.inf if math.isnan(v) else v, lo, hi, **common).to_dict(),
                         "reach_share": reach}
    entry["d_at_oracle_threshold"] = dxs
    return entry


def best_chosen(chosen: pl.DataFrame, kinds: Sequence[str] | None = None) -> dict | None:
    """The best rule chosen on validation only: among chosen points (of ``kinds``) whose val accuracy is within
    δ of full depth (all of them when none is), the lowest *val* depth (ties: higher val accuracy, then rule
    name). Test labels never enter the choice (SPEC §4 "Headlines").

    Returns:
        The ``chosen`` row as a dict, or None when there is none.
    """
    c = chosen
    if c is None or c.height == 0:
        return None
    if kinds is not None:
        c = c.filter(pl.col("kind").is_in(list(kinds)))
    c = c.filter(pl.col("val_depth").is_not_null() & pl.col("val_depth").is_not_nan())
    if c.height == 0:
        return None
    if "within_delta" in c.columns and c["within_delta"].any():
        c = c.filter(pl.col("within_delta"))
    return c.sort(["val_depth", "val_accuracy", "rule"], descending=[False, True, False]).row(0, named=True)


def best_entry(chosen: pl.DataFrame, rules: dict[str, dict], kinds: Sequence[str] | None = None) -> dict | None:
    """The metrics entry of the val-chosen best rule (:func:`best_chosen`): its test depth, test accuracy and
    oracle-threshold D@X, taken from ``rules`` (rule name -> :func:`headline_entry`). None when there is none."""
    b = best_chosen(chosen, kinds)
    if b is None:
        return None
    e = rules[b["rule"]]
    return {"rule": b["rule"], "picked_on": "val (lowest val depth within delta)",
            "test_depth": e["chosen"]["test_depth"], "test_accuracy": e["chosen"]["test_accuracy"],
            "d_at_oracle_threshold": e["d_at_oracle_threshold"]}


def result_frames(results: Sequence[RuleResult], dx: Sequence[float] = (95, 98, 99)) -> dict[str, pl.DataFrame]:
    """The readouts/gates output tables for a list of evaluated rules (one model).

    Interval columns (95 % bootstrap over test sequences, :mod:`looptrace.intervals`; NaN when intervals are
    off): ``<col>_lo`` / ``<col>_hi`` beside every test figure, with ``n_boot`` and ``n_sequences``.

    Returns:
        dict with polars DataFrames
        ``operating_points`` (rule, kind, threshold, split, mean_depth, accuracy, mean_loss; test rows also
        mean_depth_lo/hi, accuracy_lo/hi),
        ``pareto`` (the test points on their rule's own front, plus ``on_model_front``: non-dominated
        among all non-oracle points of the model),
        ``dx`` (rule, kind, x, d_at — NaN when unreachable — d_at_lo, d_at_hi (+inf: unreachable in those
        resamples), reach_share (share of resamples where X is reachable), val_d_at (D@X of the val points,
        for choosing a rule on val), threshold_from (D@X picks its threshold on test labels: an oracle-threshold
        figure), n_boot, n_sequences),
        ``chosen`` (rule, kind, threshold, index, val_depth, val_accuracy, test_depth, test_accuracy,
        test_loss, full_val_accuracy, within_delta, test_depth_lo/hi, test_accuracy_lo/hi, n_boot,
        n_sequences, level) — the honest figures: the threshold was picked on val,
        ``chosen_exits`` (rule, token, exit_depth, correct) on test.
    """
    op_rows, dx_rows, ch_rows, ex = [], [], [], []
    for r in results:
        iv = rule_intervals(r, dx)
        info = iv["info"]
        for split, p in (("val", r.val), ("test", r.test)):
            cols = {"rule": [r.rule] * r.thresholds.size, "kind": [r.kind] * r.thresholds.size,
                    "threshold": r.thresholds, "split": [split] * r.thresholds.size,
                    "mean_depth": p.mean_depth, "accuracy": p.accuracy, "mean_loss": p.mean_loss}
            for c, v in iv["points"].items():
                cols[c] = v if split == "test" else np.full(r.thresholds.size, np.nan)
            op_rows.append(pl.DataFrame(cols, schema_overrides={c: pl.Float64 for c in iv["points"]}))
        for x in dx:
            lo, hi, reach = iv["dx"][float(x)]
            dx_rows.append({"rule": r.rule, "kind": r.kind, "x": float(x),
                            "d_at": d_at(r.test.mean_depth, r.test.accuracy, x), "d_at_lo": lo, "d_at_hi": hi,
                            "reach_share": reach, "val_d_at": d_at(r.val.mean_depth, r.val.accuracy, x),
                            "threshold_from": DX_THRESHOLD_FROM, "n_boot": info["n_boot"],
                            "n_sequences": info["n_sequences"]})
        if r.kind == "oracle":  # a ceiling, not a rule: no chosen point
            continue
        k = r.chosen
        ch_rows.append({"rule": r.rule, "kind": r.kind, "threshold": float(r.thresholds[k]), "index": k,
                        "val_depth": float(r.val.mean_depth[k]), "val_accuracy": float(r.val.accuracy[k]),
                        "test_depth": float(r.test.mean_depth[k]), "test_accuracy": float(r.test.accuracy[k]),
                        "test_loss": float(r.test.mean_loss[k]), "full_val_accuracy": r.full_val_accuracy,
                        "within_delta": bool(r.val.accuracy[k] + _EPS >= r.full_val_accuracy - r.delta / 100.0),
                        **iv["chosen"], "n_boot": info["n_boot"], "n_sequences": info["n_sequences"],
                        "level": info["level"]})
        ex.append(pl.DataFrame({"rule": [r.rule] * r.test_exits.size, "token": r.test_token.astype(np.int64),
                                "exit_depth": r.test_exits.astype(np.int64), "correct": r.test_correct}))
    op_schema = {"rule": pl.String, "kind": pl.String, "threshold": pl.Float64, "split": pl.String,
                 "mean_depth": pl.Float64, "accuracy": pl.Float64, "mean_loss": pl.Float64,
                 "mean_depth_lo": pl.Float64, "mean_depth_hi": pl.Float64, "accuracy_lo": pl.Float64,
                 "accuracy_hi": pl.Float64}
    ops = pl.concat(op_rows) if op_rows else pl.DataFrame(schema=op_schema)
    test = ops.filter(pl.col("split") == "test")
    depth, acc = test["mean_depth"].to_numpy(), test["accuracy"].to_numpy()
    rules, kinds = test["rule"].to_numpy(), test["kind"].to_numpy()
    own = np.zeros(len(test), dtype=bool)
    for rule in np.unique(rules):
        sel = rules == rule
        own[sel] = pareto_mask(depth[sel], acc[sel])
    model = np.zeros(len(test), dtype=bool)
    sel = kinds != "oracle"
    model[sel] = pareto_mask(depth[sel], acc[sel])
    pareto = test.with_columns(on_model_front=pl.Series(model, dtype=pl.Boolean)).filter(
        pl.Series(own, dtype=pl.Boolean))
    ex_schema = {"rule": pl.String, "token": pl.Int64, "exit_depth": pl.Int64, "correct": pl.Boolean}
    dx_schema = {"rule": pl.String, "kind": pl.String, "x": pl.Float64, "d_at": pl.Float64, "d_at_lo": pl.Float64,
                 "d_at_hi": pl.Float64, "reach_share": pl.Float64, "val_d_at": pl.Float64,
                 "threshold_from": pl.String, "n_boot": pl.Int64, "n_sequences": pl.Int64}
    return {
        "operating_points": ops,
        "pareto": pareto,
        "dx": pl.DataFrame(dx_rows, schema=dx_schema),
        "chosen": pl.DataFrame(ch_rows) if ch_rows else pl.DataFrame(),
        "chosen_exits": pl.concat(ex) if ex else pl.DataFrame(schema=ex_schema),
    }
