"""Bootstrap intervals over test sequences (looptrace.intervals) against hand-computed and closed-form values."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from looptrace.estimates import Interval, across_seeds
from looptrace.intervals import Resampler, percentile_interval, spearman_token_samples


def test_ratio_over_every_resample_of_two_sequences_by_hand():
    # sequence 0 holds two correct tokens, sequence 1 one wrong token; every resample of the two sequences:
    # counts (2, 0) -> 4/4 = 1; (1, 1) -> 2/3; (0, 2) -> 0/2 = 0 (tokens of a sequence travel together)
    rs = Resampler(np.array([0, 0, 1]), 0, counts=np.array([[2, 0], [1, 1], [0, 2]]))
    got = rs.ratio(np.array([1.0, 1.0, 0.0]))
    np.testing.assert_allclose(got, [1.0, 2.0 / 3.0, 0.0], rtol=0, atol=1e-15)
    # a weighted ratio (mean exit depth over correct tokens only): num = depth·correct, den = correct
    depth, correct = np.array([2.0, 4.0, 6.0]), np.array([1.0, 1.0, 0.0])
    np.testing.assert_allclose(rs.ratio(depth * correct, correct), [3.0, 3.0, np.nan], rtol=0, atol=1e-15)


def test_percentile_interval_is_the_inverted_cdf_order_statistics():
    s = np.arange(1.0, 101.0)[::-1]  # 100 samples 1..100, unsorted
    lo, hi = percentile_interval(s[:, None], 0.95)
    assert (float(lo[0]), float(hi[0])) == (3.0, 98.0)  # ceil(2.5) = 3rd and ceil(97.5) = 98th smallest
    lo, hi = percentile_interval(np.r_[np.arange(1.0, 39.0), [np.inf, np.inf]][:, None], 0.95)  # 39th of 40: inf
    assert math.isinf(hi[0])  # an unreachable D@X in the top resample stays unreachable


def test_bootstrap_spread_matches_the_closed_form_and_shrinks_with_sequences():
    rng = np.random.default_rng(0)

    def sd_of_mean(n_seq: int) -> tuple[float, float]:
        per_seq = rng.normal(0, 1, n_seq)  # each sequence: 4 tokens with the sequence's value
        tokens = np.repeat(per_seq, 4)
        rs = Resampler(np.repeat(np.arange(n_seq), 4), 4000, seed=1)
        boot = rs.ratio(tokens)
        # bootstrap variance of a mean of U equal-size units: population variance of the unit means / U
        return float(boot.std()), float(per_seq.std() / math.sqrt(n_seq))

    got100, want100 = sd_of_mean(100)
    got400, want400 = sd_of_mean(400)
    assert got100 == pytest.approx(want100, rel=0.08) and got400 == pytest.approx(want400, rel=0.08)
    rs_small = Resampler(np.repeat(np.arange(100), 4), 2000, seed=2)
    rs_big = Resampler(np.repeat(np.arange(400), 4), 2000, seed=2)
    vals = rng.integers(0, 2, 1600).astype(float)
    w_small = np.subtract(*rs_small.interval(rs_small.ratio(vals[:400]))[::-1])
    w_big = np.subtract(*rs_big.interval(rs_big.ratio(vals))[::-1])
    assert 0.35 < w_big / w_small < 0.65  # 4x the sequences: about half the width (1/sqrt(4))


def test_spearman_over_tokens_equals_scipy_on_the_expanded_resample():
    rng = np.random.default_rng(3)
    seq = np.repeat(np.arange(30), 5)
    x = rng.integers(0, 6, seq.size).astype(float)  # difficulty levels: many ties
    y = x + rng.normal(0, 2, seq.size)
    counts = rng.multinomial(30, np.full(30, 1 / 30), size=4).astype(float)
    counts[0] = 1.0  # the identity resample: the plain statistic
    rs = Resampler(seq, 0, counts=counts)
    got = spearman_token_samples(rs, x, y)
    for b in range(4):
        reps = counts[b][seq].astype(int)
        want = stats.spearmanr(np.repeat(x, reps), np.repeat(y, reps)).statistic
        assert got[b] == pytest.approx(want, abs=1e-12)


def test_across_seeds_is_a_student_t_interval():
    items = [Interval(v, v - 0.1, v + 0.1) for v in (1.0, 2.0, 3.0)]
    got = across_seeds(items)
    half = 4.302652729911275 * 1.0 / math.sqrt(3)  # t_{2, 0.975} · sd (= 1) / sqrt(3)
    assert (got.estimate, got.n_seeds) == (2.0, 3)
    assert got.lo == pytest.approx(2.0 - half, abs=1e-8) and got.hi == pytest.approx(2.0 + half, abs=1e-8)
