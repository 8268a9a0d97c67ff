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

What a figure is once estimated — an estimate with its interval, over seeds, compared — is
:mod:`looptrace.estimates`.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Mapping
from dataclasses import dataclass

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

def interval_columns(prefix: str, samples: np.ndarray, level: float) -> dict[str, np.ndarray]:
    """``{prefix}_lo`` and ``{prefix}_hi`` of resampled values [B, ...]."""
    lo, hi = percentile_interval(samples, level)
    return {f"{prefix}_lo": lo, f"{prefix}_hi": hi}

def split_resampler(fields: Mapping[str, np.ndarray], n_tokens: int, cfg: IntervalsConfig | None, seed: int
                    ) -> Resampler | None:
    """The bootstrap of one split: over its ``sequence`` field (over tokens when it has none), B and level from
    ``cfg``; None when ``cfg`` is None or B = 0."""
    if cfg is None or cfg.n_boot == 0:
        return None
    seq = fields.get("sequence")
    return Resampler(seq, cfg.n_boot, seed, cfg.level, n_tokens=n_tokens)
