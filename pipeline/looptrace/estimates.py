"""Headline figures as estimates with their intervals (:class:`Interval`): one model's bootstrap interval
(:func:`from_row`, from the columns :mod:`looptrace.intervals` writes), the figure over training seeds
(:func:`across_seeds`), paired differences (:func:`paired_difference`), the seeds that would decide
(:func:`seeds_needed`), "within noise" (:func:`compare`) and the text of a figure (:func:`fmt_ci`)
(SPEC §4 "Headlines").

**Seeds.** With S ≥ 2 training seeds of one task × regime, a headline figure is the mean of the per-seed
estimates with a Student-t 95 % interval over seeds (mean ± t_{S−1} · sd / √S), min and max reported beside
it (:func:`across_seeds`); every seed's estimate already carries its test-sampling noise, so the t-interval
covers both sources. With one seed the figure is the bootstrap interval of that seed. A figure with a known
range [a, b] (accuracy in [0, 1], a depth in [1, T], ρ in [−1, 1]) gets the t-interval on the logit scale of
its position in the range, z = logit((v − a) / (b − a)), mapped back (:func:`bounded_t_interval`): it never
leaves [a, b] and is asymmetric near a bound, as the sampling distribution of a bounded mean is (for ρ this is
Fisher's z, atanh ρ = z / 2). A seed exactly at a bound is moved in by half its resolution (0.5 / n of the
range, n = its test sequences; the empirical logit, Cox 1970), and a mapped-back bound within that
resolution of a range bound is the range bound.

**Paired comparisons over seeds.** Two figures of the same models (best rule vs fixed depth of each seed, or a
joint model vs the fixed-prior model of the same seed index) are compared through the per-seed differences
a_s − b_s with their Student-t interval (:func:`paired_difference`): the seed-to-seed variation the two figures
share cancels, which two separate intervals cannot show. :func:`seeds_needed` is the smallest S at which, at the
observed mean and spread of those differences, the interval would decide.

**Within noise.** Two figures whose intervals overlap are "within noise" of each other (:func:`compare`) —
a conservative reading (a real difference may hide in overlapping intervals) and the one every verdict and
claim uses, so that no finding rests on a difference the intervals do not support.

numpy only (plus scipy's t quantile, imported when two or more seeds are aggregated).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class Interval:
    """A headline figure: estimate with its interval, and where the interval comes from.

    Attributes:
        estimate: the point value (NaN = absent; +inf = unreachable, e.g. D@X).
        lo, hi: interval bounds (hi may be +inf: "unreachable" within the interval).
        n_seeds: training seeds behind it (1 = a single model's bootstrap interval).
        method: ``bootstrap`` (over test sequences of one model), ``t over seeds`` or ``none``.
        n_boot, n_sequences: the bootstrap's size (of each seed's model).
        seed_min, seed_max: smallest and largest per-seed estimate (S ≥ 2).
        n_unreachable: seeds whose estimate is unreachable (+inf).
    """

    estimate: float
    lo: float = math.nan
    hi: float = math.nan
    n_seeds: int = 1
    method: str = "bootstrap"
    n_boot: int = 0
    n_sequences: int = 0
    seed_min: float = math.nan
    seed_max: float = math.nan
    n_unreachable: int = 0

    @property
    def present(self) -> bool:
        """Whether there is a figure at all (not NaN)."""
        return not math.isnan(self.estimate)

    @property
    def has_interval(self) -> bool:
        return not (math.isnan(self.lo) or math.isnan(self.hi))

    def fmt(self, nd: int = 2, scale: float = 1.0, unit: str = "") -> str:
        """``1.15 [1.11, 1.19]``; an unreachable estimate or bound reads ``unreachable``; absent ``—``."""
        return fmt_ci(self.estimate, self.lo, self.hi, nd, scale, unit)

    def to_dict(self) -> dict:
        """JSON-ready (NaN/inf become None in ``jsonable``; ``unreachable`` says which)."""
        d = {"estimate": self.estimate, "lo": self.lo, "hi": self.hi, "n_seeds": self.n_seeds, "method": self.method}
        if self.n_boot:
            d.update(n_boot=self.n_boot, n_sequences=self.n_sequences)
        if self.n_seeds > 1:
            d.update(seed_min=self.seed_min, seed_max=self.seed_max)
        if math.isinf(self.estimate) or math.isinf(self.hi) or self.n_unreachable:
            d["unreachable"] = ("estimate" if math.isinf(self.estimate) else "upper bound" if math.isinf(self.hi)
                                else f"{self.n_unreachable} of {self.n_seeds} seeds")
        d["text"] = self.fmt()
        return d


def from_row(row: Mapping, col: str, n_seeds: int = 1) -> Interval:
    """The :class:`Interval` of column ``col`` of a table row with ``col_lo``, ``col_hi``, ``n_boot`` and
    ``n_sequences`` columns (missing ones read as NaN / 0); ``d_at`` NaN (unreachable) becomes +inf."""
    def g(k, default=math.nan):
        v = row.get(k, default)
        return default if v is None else v

    est = float(g(col))
    if col.startswith("d_at") and math.isnan(est):
        est = math.inf
    return Interval(est, float(g(f"{col}_lo")), float(g(f"{col}_hi")), n_seeds, "bootstrap",
                    int(g("n_boot", 0)), int(g("n_sequences", 0)))


def across_seeds(items: Sequence[Interval], level: float = 0.95,
                 bounds: tuple[float, float] | None = None) -> Interval:
    """One figure over training seeds: the mean of the per-seed estimates with a Student-t interval.

    One seed: that seed's interval unchanged. S ≥ 2 seeds: mean ± t_{S−1, (1+level)/2} · sd / √S over the
    seeds' estimates (min and max kept); if some seeds are unreachable (+inf), the estimate is +inf
    ("unreachable in k of S seeds") with the interval from the smallest finite seed to +inf. Absent (NaN)
    seeds are left out.

    Args:
        items: one interval per seed.
        level: coverage.
        bounds: the quantity's range (a, b) — accuracy (0, 1), a depth (1, T), ρ (−1, 1): the interval is
            the t-interval on the logit scale of the range (:func:`bounded_t_interval`, method
            ``t over seeds, logit scale``) and stays within [a, b]. None: the plain t-interval.
    """
    items = [i for i in items if i.present]
    if not items:
        return Interval(math.nan, method="none", n_seeds=0)
    if len(items) == 1:
        return items[0]
    est = np.array([i.estimate for i in items], dtype=np.float64)
    S = est.size
    inf = np.isinf(est)
    fin = est[~inf]
    base: dict[str, Any] = {
        "n_seeds": S, "method": "t over seeds", "n_boot": items[0].n_boot, "n_sequences": items[0].n_sequences,
        "seed_min": float(est.min()), "seed_max": float(est.max()), "n_unreachable": int(inf.sum())}
    if inf.any():
        lo = float(fin.min()) if fin.size else math.inf
        return Interval(math.inf, lo, math.inf, **base)
    # lazy: scipy.stats: a slow import, needed only by these intervals
    from scipy.stats import t as student_t

    m = float(fin.mean())
    if bounds is not None:
        res = [i.n_sequences for i in items]
        lo, hi = bounded_t_interval(fin, bounds, level, res)
        base["method"] = "t over seeds, logit scale"
        return Interval(m, lo, hi, **base)
    half = float(student_t.ppf((1.0 + level) / 2.0, S - 1) * fin.std(ddof=1) / math.sqrt(S))
    return Interval(m, m - half, m + half, **base)


#: Resolution of a seed's figure when its number of test sequences is unknown (fraction of the range).
DEFAULT_RESOLUTION = 1e-3


def bounded_t_interval(values: np.ndarray, bounds: tuple[float, float], level: float = 0.95,
                       n_units: Sequence[int] | None = None) -> tuple[float, float]:
    """A Student-t interval over seeds for a figure with range [a, b], computed on the logit scale.

    z_s = logit(p_s), p_s = (v_s − a) / (b − a) clamped to [ε_s, 1 − ε_s] with ε_s = 0.5 / n_s (half the
    resolution of a mean over n_s test sequences; :data:`DEFAULT_RESOLUTION` when unknown); the interval
    z̄ ± t_{S−1} · sd(z) / √S is mapped back by a + (b − a) · expit(·). A bound within the largest ε_s of the
    range's end is that end (the data cannot tell them apart), and the interval is widened to hold the
    arithmetic mean of the seeds (the reported estimate; the back-transformed centre is a logit-scale mean).

    Args:
        values: [S] per-seed estimates (finite, S ≥ 2).
        bounds: (a, b), a < b.
        level: coverage.
        n_units: [S] test sequences behind each seed's estimate (0 = unknown).

    Returns:
        (lo, hi) with a ≤ lo ≤ mean ≤ hi ≤ b.
    """
    # lazy: scipy.stats / scipy.special: slow imports, needed only here
    from scipy.special import expit, logit
    from scipy.stats import t as student_t

    a, b = float(bounds[0]), float(bounds[1])
    v = np.clip(np.asarray(values, dtype=np.float64), a, b)
    S = v.size
    n = np.asarray(n_units if n_units is not None else [0] * S, dtype=np.float64)
    eps = np.where(n > 0, 0.5 / np.maximum(n, 1.0), DEFAULT_RESOLUTION)
    p = np.clip((v - a) / (b - a), eps, 1.0 - eps)
    z = logit(p)
    half = float(student_t.ppf((1.0 + level) / 2.0, S - 1) * z.std(ddof=1) / math.sqrt(S))
    lo_p, hi_p = float(expit(z.mean() - half)), float(expit(z.mean() + half))
    e = float(eps.max()) + 1e-12

    def snap(q: float) -> float:
        return 0.0 if q <= e else 1.0 if q >= 1.0 - e else q

    lo_p, hi_p = snap(lo_p), snap(hi_p)
    m = float(v.mean())
    return min(a + (b - a) * lo_p, m), max(a + (b - a) * hi_p, m)


#: Rounding slack of the tolerance checks (loops): bounds printed equal to ±tol count as within it.
_EPS = 1e-9


@dataclass(frozen=True)
class Difference:
    """The difference a − b of two figures with its interval, as a decision reads it.

    Attributes:
        estimate, lo, hi: a − b and its interval bounds (NaN = no interval).
        method: ``paired t over seeds`` (per-seed differences, :func:`paired_difference`) or ``intervals``
            (from the two figures' own intervals: [a.lo − b.hi, a.hi − b.lo], conservative).
        n_seeds: seeds (pairs) behind a paired difference; 1 otherwise.
        sd: standard deviation of the per-seed differences (NaN unless paired).
        per_seed: the per-seed differences.
    """

    estimate: float
    lo: float
    hi: float
    method: str = "intervals"
    n_seeds: int = 1
    sd: float = math.nan
    per_seed: tuple[float, ...] = ()

    def lower(self, tol: float) -> bool:
        """a is lower than b: the interval excludes 0 from below and the estimate is at least ``tol`` lower."""
        return self.hi < 0 and self.estimate <= -tol

    def higher(self, tol: float) -> bool:
        """a is higher than b: the interval excludes 0 from above and the estimate is at least ``tol`` higher."""
        return self.lo > 0 and self.estimate >= tol

    def not_lower(self, tol: float) -> bool:
        """The interval rules out a being lower than b by more than ``tol`` (lo ≥ −tol)."""
        return self.lo >= -tol - _EPS

    def not_higher(self, tol: float) -> bool:
        """The interval rules out a being higher than b by more than ``tol`` (hi ≤ tol)."""
        return self.hi <= tol + _EPS

    def word(self, tol: float) -> str:
        """The difference in :func:`compare`'s words: ``lower`` / ``higher`` (decided gap), ``within tolerance``
        (the interval lies within ±tol: no gap of tol either way), else ``within noise`` (undecided)."""
        if self.lower(tol):
            return "lower"
        if self.higher(tol):
            return "higher"
        if self.not_lower(tol) and self.not_higher(tol):
            return "within tolerance"
        return "within noise"

    def to_dict(self) -> dict:
        return {"estimate": self.estimate, "lo": self.lo, "hi": self.hi, "method": self.method,
                "n_seeds": self.n_seeds, "sd": self.sd, "per_seed": list(self.per_seed)}


def difference(a: Interval, b: Interval) -> Difference:
    """a − b from the two figures' own intervals: [a.lo − b.hi, a.hi − b.lo] (an interval-less figure counts as
    its estimate). Disjoint intervals ⇔ this interval excludes 0, so decisions on it are :func:`compare`'s."""
    alo, ahi = (a.lo, a.hi) if a.has_interval else (a.estimate, a.estimate)
    blo, bhi = (b.lo, b.hi) if b.has_interval else (b.estimate, b.estimate)
    return Difference(a.estimate - b.estimate, alo - bhi, ahi - blo)


def paired_difference(a: Sequence[float], b: Sequence[float], level: float = 0.95) -> Difference | None:
    """The mean per-seed difference mean(a_s − b_s) with its Student-t interval over the S pairs (pairs with a
    non-finite side are left out); None with fewer than two pairs."""
    with np.errstate(invalid="ignore"):  # inf - inf (unreachable on both sides): NaN, left out below
        d = np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)
    d = d[np.isfinite(d)]
    if d.size < 2:
        return None
    # lazy: scipy.stats: a slow import, needed only by these intervals
    from scipy.stats import t as student_t

    m, sd = float(d.mean()), float(d.std(ddof=1))
    half = float(student_t.ppf((1.0 + level) / 2.0, d.size - 1) * sd / math.sqrt(d.size))
    return Difference(m, m - half, m + half, "paired t over seeds", int(d.size), sd, tuple(float(x) for x in d))


#: :func:`seeds_needed` searches up to this many seeds.
MAX_SEEDS = 10_000


def seeds_needed(mean: float, sd: float, margins: Sequence[float], level: float = 0.95) -> int | None:
    """The smallest number of seeds S ≥ 2 at which a Student-t half-width at the observed spread fits within a
    margin: t_{S−1, (1+level)/2} · sd / √S ≤ m for some m of ``margins`` (each the largest half-width that
    would decide, e.g. |mean| to exclude 0); None when no margin is positive or S would exceed
    :data:`MAX_SEEDS`.

    Args:
        mean: observed mean difference (kept for the record; the margins already use it).
        sd: observed standard deviation over seeds.
        margins: half-widths that would decide (non-positive ones cannot be reached at this mean).
    """
    del mean
    ms = [float(m) for m in margins if m is not None and math.isfinite(m) and m > 0]
    if not ms or not math.isfinite(sd):
        return None
    target = max(ms)
    if sd == 0:
        return 2
    from scipy.stats import t as student_t

    S = np.arange(2, MAX_SEEDS + 1)
    half = student_t.ppf((1.0 + level) / 2.0, S - 1) * sd / np.sqrt(S)
    ok = np.flatnonzero(half <= target)
    return int(S[ok[0]]) if ok.size else None


def _key(v: float) -> float:
    return math.inf if math.isnan(v) else v


def overlaps(a: Interval, b: Interval) -> bool:
    """Whether the two intervals share a point (an interval-less figure counts as its estimate)."""
    alo, ahi = (a.lo, a.hi) if a.has_interval else (a.estimate, a.estimate)
    blo, bhi = (b.lo, b.hi) if b.has_interval else (b.estimate, b.estimate)
    return not (ahi < blo or bhi < alo)


def compare(a: Interval, b: Interval, tol: float = 0.0) -> str:
    """How a stands to b: ``lower`` / ``higher`` (intervals disjoint and the estimates at least ``tol`` apart),
    ``within noise`` (intervals overlap), ``within tolerance`` (disjoint but closer than ``tol``), or
    ``untestable`` (a side absent, or both unreachable)."""
    if not (a.present and b.present) or (math.isinf(a.estimate) and math.isinf(b.estimate)):
        return "untestable"
    if overlaps(a, b):
        return "within noise"
    gap = _key(a.estimate) - _key(b.estimate)
    if abs(gap) < tol:
        return "within tolerance"
    return "lower" if gap < 0 else "higher"


def fmt_value(v: float, nd: int = 2, scale: float = 1.0, unit: str = "") -> str:
    """A number, ``unreachable`` for +inf, ``—`` for NaN/None."""
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "—"
    v = float(v)
    if math.isinf(v):
        return "unreachable"
    return f"{v * scale:.{nd}f}{unit}"


def fmt_ci(est: float, lo: float, hi: float, nd: int = 2, scale: float = 1.0, unit: str = "") -> str:
    """``1.15 [1.11, 1.19]`` (``unreachable`` in words, never None/nan; no interval: the value alone)."""
    e = fmt_value(est, nd, scale, unit)
    if e == "—":
        return e
    if lo is None or hi is None or math.isnan(float(lo)) or math.isnan(float(hi)):
        return e
    return f"{e} [{fmt_value(lo, nd, scale, unit)}, {fmt_value(hi, nd, scale, unit)}]"


def seeds_text(items: Iterable[Interval]) -> str:
    """``3 seeds`` / ``1 seed``: the largest seed count among ``items``."""
    n = max((i.n_seeds for i in items), default=0)
    return f"{n} seed{'s' if n != 1 else ''}"
