"""95 % intervals of every headline figure: a bootstrap over test *sequences* within a model, and the spread
over training seeds across models (SPEC §4 "Headlines"; params section ``intervals``).

**Resampling unit.** Under causal attention the tokens of one sequence share a prefix, so they are not
independent draws; the unit of the bootstrap is a whole test sequence (the store's / token_loop's ``sequence``
field), and a resample draws ``n_sequences`` sequences with replacement. A resample is a vector of
multinomial counts ``w`` [sequence] (Σ w = n_sequences); every statistic that is a ratio of token sums (mean
exit depth, accuracy, shares of failure classes) is then ``(w · S) / (w · m)`` with S the per-sequence sums
and m the per-sequence token counts, so B resamples of K operating points are one [B, U] × [U, K] matrix
product (:meth:`Resampler.ratio`). D@X with its frozen threshold grid is recomputed in every resample from
those [B, K] points (:func:`dx_samples`), and so is anything chosen by index (the val-chosen point: its
index is fixed, its test figures move).

**Intervals.** Percentile intervals at ``intervals.level`` (0.95): the order statistics of the B resampled
values (``inverted_cdf``: no interpolation, so +inf — an unreachable D@X in that resample — stays +inf and an
upper bound can read "unreachable"). The counts of a model are a pure function of (``base.seed``, model
name, number of sequences, B): the readouts, gates and diagnose stages of one model draw the *same*
resamples, so the intervals of different rules of a model are paired.

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
import zlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from looptrace.config import ConfigError

#: The name of the resampling unit, as recorded beside every interval.
UNIT = "sequence"


@dataclass(frozen=True)
class IntervalsConfig:
    """``intervals`` section of ``params.yaml``: one protocol for every stage that reports an interval.

    Attributes:
        n_boot: bootstrap resamples B (over test sequences). 0 disables intervals (lo = hi = NaN). Otherwise at
            least :func:`min_boot` (``level``): each tail of a percentile interval must hold
            :data:`MIN_TAIL_RESAMPLES` resamples, or the "95 %" interval is set by one or two draws (B = 1 gives
            zero-width intervals that mostly miss their own estimate). 200 at level 0.95, 1000 at 0.99.
        level: coverage of every interval (0.95).
    """

    n_boot: int = 1000
    level: float = 0.95

    def __post_init__(self) -> None:
        if self.n_boot < 0:
            raise ConfigError(f"intervals.n_boot must be ≥ 0 (0 = no intervals), got {self.n_boot}")
        if not 0.5 <= self.level < 1.0:
            raise ConfigError(f"intervals.level must be in [0.5, 1), got {self.level}")
        if 0 < self.n_boot < min_boot(self.level):
            raise ConfigError(f"intervals.n_boot = {self.n_boot}: a {self.level:g} percentile interval needs at least "
                              f"{min_boot(self.level)} resamples ({MIN_TAIL_RESAMPLES} in each tail); set "
                              f"intervals.n_boot ≥ {min_boot(self.level)}, or 0 for no intervals")


#: Resamples each tail of a percentile interval must hold (the documented minimum of intervals.n_boot).
MIN_TAIL_RESAMPLES = 5


def min_boot(level: float) -> int:
    """The smallest ``intervals.n_boot`` at coverage ``level``: ``MIN_TAIL_RESAMPLES`` per tail (200 at 0.95)."""
    return math.ceil(round(2 * MIN_TAIL_RESAMPLES / (1.0 - level), 6))


def boot_seed(base_seed: int, *keys: str) -> int:
    """A 32-bit seed from ``base.seed`` and names (the model): stable across runs, stages and platforms."""
    ss = np.random.SeedSequence([int(base_seed) & 0xFFFFFFFF, *[zlib.crc32(str(k).encode()) for k in keys]])
    return int(ss.generate_state(1)[0])


# ----------------------------------------------------------------------------------------------
# The resampler
# ----------------------------------------------------------------------------------------------


class Resampler:
    """Bootstrap resamples of one split's tokens, drawn over their sequences.

    Args:
        unit: [token] the resampling unit of each token (the ``sequence`` id); None = every token is its own unit.
        n_boot: B.
        seed: RNG seed (:func:`boot_seed`).
        level: interval coverage.
        counts: [B, U] explicit resample counts instead of random ones (exact enumeration in tests).

    Attributes:
        index: [token] 0-based unit index of each token; ``n_units`` U; ``counts`` [B, U] float64;
        ``unit_tokens`` [U] tokens per unit; ``unit_name`` ``sequence`` or ``token``.
    """

    def __init__(self, unit: np.ndarray | None, n_boot: int, seed: int = 0, level: float = 0.95,
                 counts: np.ndarray | None = None, n_tokens: int | None = None):
        if unit is None:
            if n_tokens is None:
                raise ValueError("Resampler: give the tokens' units or n_tokens")
            self.index = np.arange(int(n_tokens), dtype=np.int64)
            self.unit_name = "token"
        else:
            _, self.index = np.unique(np.asarray(unit), return_inverse=True)
            self.index = self.index.astype(np.int64).ravel()
            self.unit_name = UNIT
        self.n_tokens = int(self.index.size)
        self.n_units = int(self.index.max()) + 1 if self.n_tokens else 0
        self.level = float(level)
        self.unit_tokens = np.bincount(self.index, minlength=self.n_units).astype(np.float64)
        if counts is not None:
            c = np.asarray(counts, dtype=np.float64)
            if c.ndim != 2 or c.shape[1] != self.n_units:
                raise ValueError(f"Resampler: counts must be [B, {self.n_units}], got {c.shape}")
            self.counts = c
        elif n_boot > 0 and self.n_units > 0:
            rng = np.random.default_rng(seed)
            self.counts = rng.multinomial(self.n_units, np.full(self.n_units, 1.0 / self.n_units),
                                          size=int(n_boot)).astype(np.float64)
        else:
            self.counts = np.zeros((0, self.n_units))
        self._order = np.argsort(self.index, kind="stable")
        srt = self.index[self._order]
        self._starts = np.flatnonzero(np.r_[True, srt[1:] != srt[:-1]]) if self.n_tokens else np.zeros(0, np.int64)

    @property
    def n_boot(self) -> int:
        """B (0 when intervals are off)."""
        return int(self.counts.shape[0])

    def unit_sums(self, values: np.ndarray) -> np.ndarray:
        """Per-unit sums of per-token values: [..., token] -> [..., U] float64 (NaN-free input expected)."""
        v = np.asarray(values, dtype=np.float64)
        if v.shape[-1] != self.n_tokens:
            raise ValueError(f"Resampler: values have {v.shape[-1]} tokens, the resampler {self.n_tokens}")
        if self.n_tokens == 0:
            return np.zeros((*v.shape[:-1], 0))
        return np.add.reduceat(v[..., self._order], self._starts, axis=-1)

    def token_weights(self, b: slice | np.ndarray | None = None) -> np.ndarray:
        """[B', token] resample weight of each token (its unit's count)."""
        c = self.counts if b is None else self.counts[b]
        return c[:, self.index]

    def ratio(self, num: np.ndarray, den: np.ndarray | None = None) -> np.ndarray:
        """Resampled Σ num / Σ den over tokens ([K, token] or [token] each; den None = token counts).

        Returns:
            [B, K] (or [B] for [token] input) float64; NaN where a resample has Σ den = 0.
        """
        n = np.asarray(num, dtype=np.float64)
        one = n.ndim == 1
        n2 = n[None] if one else n
        sn = self.unit_sums(n2)  # [K, U]
        if den is None:
            sd = np.broadcast_to(self.unit_tokens, sn.shape)
        else:
            d = np.asarray(den, dtype=np.float64)
            sd = self.unit_sums(d[None] if d.ndim == 1 else d)
            sd = np.broadcast_to(sd, sn.shape)
        top = self.counts @ sn.T  # [B, K]
        bot = self.counts @ sd.T
        with np.errstate(invalid="ignore", divide="ignore"):
            out = top / bot
        return out[:, 0] if one else out

    def interval(self, samples: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Percentile interval over axis 0 of resampled values (:func:`percentile_interval`)."""
        return percentile_interval(samples, self.level)

    def describe(self) -> dict:
        """``n_boot``, ``n_units`` (as ``n_sequences``), ``unit`` and ``level`` (recorded beside intervals)."""
        return {"n_boot": self.n_boot, "n_sequences": self.n_units, "unit": self.unit_name, "level": self.level}


def percentile_interval(samples: np.ndarray, level: float = 0.95) -> tuple[np.ndarray, np.ndarray]:
    """(lo, hi) over axis 0: the α/2 and 1 − α/2 order statistics (``inverted_cdf``, no interpolation).

    +inf (an unreachable D@X) is an ordinary, largest value; NaN entries (a statistic undefined in that
    resample) are ignored. No sample (B = 0) or all NaN gives NaN.
    """
    s = np.asarray(samples, dtype=np.float64)
    shape = s.shape[1:]
    if s.shape[0] == 0:
        return np.full(shape, np.nan), np.full(shape, np.nan)
    a = (1.0 - level) / 2.0
    flat = s.reshape(s.shape[0], -1)

    def pos(n: int) -> tuple[int, int]:  # inverted_cdf: the smallest value whose empirical CDF ≥ q
        return (max(0, math.ceil(a * n - 1e-9) - 1), min(n - 1, max(0, math.ceil((1.0 - a) * n - 1e-9) - 1)))

    nan = np.isnan(flat)
    if not nan.any():
        v = np.sort(flat, axis=0)
        i, j = pos(v.shape[0])
        return v[i].reshape(shape), v[j].reshape(shape)
    lo, hi = np.full(flat.shape[1], np.nan), np.full(flat.shape[1], np.nan)
    for c in range(flat.shape[1]):
        v = np.sort(flat[~nan[:, c], c])
        if v.size:
            i, j = pos(v.size)
            lo[c], hi[c] = v[i], v[j]
    return lo.reshape(shape), hi.reshape(shape)


def dx_samples(depth: np.ndarray, acc: np.ndarray, x: float) -> np.ndarray:
    """D@X of every resample: the smallest mean depth among points with accuracy ≥ X % (+inf when none).

    Args:
        depth, acc: [B, K] resampled mean depth and accuracy of the K frozen thresholds.
        x: target in percent.

    Returns:
        [B] float64 (+inf = unreachable in that resample).
    """
    d = np.asarray(depth, dtype=np.float64)
    a = np.asarray(acc, dtype=np.float64)
    ok = np.isfinite(d) & (a + 1e-12 >= x / 100.0)
    return np.where(ok, d, np.inf).min(axis=-1) if d.shape[-1] else np.full(d.shape[:-1], np.inf)


# ----------------------------------------------------------------------------------------------
# Spearman over resampled tokens
# ----------------------------------------------------------------------------------------------


def _tie_ranks(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Mid-ranks of the values ``x`` [n] in each weighted resample ``w`` [B, n] (a token of weight c counts c
    times, ties share their mean rank), [B, n]: exactly scipy's ``rankdata`` of the expanded data."""
    order = np.argsort(x, kind="stable")
    xs = x[order]
    starts = np.flatnonzero(np.r_[True, xs[1:] != xs[:-1]])
    grp = np.cumsum(np.r_[True, xs[1:] != xs[:-1]]) - 1  # tie group of each sorted token
    ws = w[:, order]
    gw = np.add.reduceat(ws, starts, axis=1)  # [B, G] weight of each tie group
    below = np.cumsum(gw, axis=1) - gw  # weight strictly below each group
    mid = below + (gw + 1.0) / 2.0
    ranks = np.empty_like(ws)
    ranks[:, order] = mid[:, grp]
    return ranks


def _weighted_pearson(x: np.ndarray, y: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Pearson r of (x, y) [B, n] with weights w [B, n] per row; NaN when a side is constant."""
    sw = w.sum(axis=1, keepdims=True)
    mx = (w * x).sum(axis=1, keepdims=True) / sw
    my = (w * y).sum(axis=1, keepdims=True) / sw
    dx, dy = x - mx, y - my
    cov = (w * dx * dy).sum(axis=1)
    vx, vy = (w * dx * dx).sum(axis=1), (w * dy * dy).sum(axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        r = cov / np.sqrt(vx * vy)
    r[(vx <= 1e-12 * np.maximum(1.0, sw[:, 0] ** 3)) | (vy <= 1e-12 * np.maximum(1.0, sw[:, 0] ** 3))] = np.nan
    return np.clip(r, -1.0, 1.0)


def spearman_token_samples(rs: Resampler, x: np.ndarray, y: np.ndarray, block: int = 0) -> np.ndarray:
    """Spearman ρ over tokens in every resample ([B]); tokens with a non-finite x or y are left out.

    Each resample is the multiset of its sequences' tokens; ρ is Pearson's r of their mid-ranks (ties share
    a rank), i.e. ``scipy.stats.spearmanr`` of the expanded resample. Computed in blocks of resamples
    (``block`` rows; 0 = sized to ~1 M elements, ~8 MB per array) so memory stays bounded on large splits.
    """
    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    ok = np.isfinite(x) & np.isfinite(y)
    if rs.n_boot == 0:
        return np.zeros(0)
    xo, yo = x[ok], y[ok]
    n = int(ok.sum())
    if n < 3:
        return np.full(rs.n_boot, np.nan)
    block = block or max(1, (1 << 20) // max(1, n))  # ~1 M elements (measured: 0.8 s vs 21 s at 32 M)
    out = np.empty(rs.n_boot)
    for lo in range(0, rs.n_boot, block):
        w = rs.token_weights(slice(lo, lo + block))[:, ok]
        out[lo:lo + w.shape[0]] = _weighted_pearson(_tie_ranks(xo, w), _tie_ranks(yo, w), w)
    return out


def spearman_level_samples(rs: Resampler, levels: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Spearman ρ over difficulty levels of the per-level mean of y, in every resample ([B]), and the level
    values. A level absent from a resample (or with no finite y) is left out of that resample's ρ."""
    lv = np.asarray(levels)
    y = np.asarray(y, dtype=np.float64)
    ok = np.isfinite(y)
    uniq = np.unique(lv[ok])
    if rs.n_boot == 0 or uniq.size < 3:
        return np.full(rs.n_boot, np.nan), uniq
    onehot = (lv[None, :] == uniq[:, None]) & ok[None, :]  # [L, token]
    s = rs.unit_sums(np.where(onehot, np.where(ok, y, 0.0)[None, :], 0.0))  # [L, U]
    c = rs.unit_sums(onehot.astype(np.float64))
    top, bot = rs.counts @ s.T, rs.counts @ c.T  # [B, L]
    with np.errstate(invalid="ignore", divide="ignore"):
        means = top / bot
    lx = uniq.astype(np.float64)
    return _spearman_rows_vs(lx, means), uniq


def _spearman_rows_vs(x: np.ndarray, ys: np.ndarray) -> np.ndarray:
    """Spearman ρ of the fixed values ``x`` [L] against every row of ``ys`` [B, L] (mid-ranks; a NaN entry
    leaves its level out of that row; fewer than 3 points or a constant side give NaN), [B]."""
    # lazy: scipy.stats: a slow import, needed only by these intervals
    from scipy.stats import rankdata

    out = np.full(ys.shape[0], np.nan)
    full = np.isfinite(ys).all(axis=1)
    if full.any() and x.size >= 3:  # the common case, vectorised: ranks of each row at once
        y = ys[full]
        w = np.ones_like(y)
        rx = np.broadcast_to(_tie_ranks(x, w[:1])[0], y.shape)
        out[full] = _weighted_pearson(rx, rankdata(y, axis=1), w)
    for b in np.flatnonzero(~full):
        k = np.isfinite(ys[b])
        out[b] = _spearman_plain(x[k], ys[b, k])
    return out


def _spearman_plain(x: np.ndarray, y: np.ndarray) -> float:
    if x.size < 3:
        return math.nan
    w = np.ones((1, x.size))
    return float(_weighted_pearson(_tie_ranks(x, w), _tie_ranks(y, w), w)[0])


# ----------------------------------------------------------------------------------------------
# An interval, its aggregation over seeds, comparison and printing
# ----------------------------------------------------------------------------------------------


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


def interval_columns(prefix: str, samples: np.ndarray, level: float) -> dict[str, np.ndarray]:
    """``{prefix}_lo`` and ``{prefix}_hi`` of resampled values [B, ...]."""
    lo, hi = percentile_interval(samples, level)
    return {f"{prefix}_lo": lo, f"{prefix}_hi": hi}


def seeds_text(items: Iterable[Interval]) -> str:
    """``3 seeds`` / ``1 seed``: the largest seed count among ``items``."""
    n = max((i.n_seeds for i in items), default=0)
    return f"{n} seed{'s' if n != 1 else ''}"


def split_resampler(fields: Mapping[str, np.ndarray], n_tokens: int, cfg: IntervalsConfig | None, seed: int
                    ) -> Resampler | None:
    """The bootstrap of one split: over its ``sequence`` field (over tokens when it has none), B and level from
    ``cfg``; None when ``cfg`` is None or B = 0."""
    if cfg is None or cfg.n_boot == 0:
        return None
    seq = fields.get("sequence")
    return Resampler(seq, cfg.n_boot, seed, cfg.level, n_tokens=n_tokens)
