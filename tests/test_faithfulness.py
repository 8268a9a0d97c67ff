"""SEWN's counterfactual faithfulness test adapted to depth (SPEC §7a, looptrace.diagnose.faithfulness): exact
permutation moments against enumeration, hand-computed costs, and synthetic signals with a known answer."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from scipy.stats import binom

from looptrace.diagnose.faithfulness import (
    exit_costs,
    faithfulness_test,
    permutation_moments,
    reverse_depths,
)
from looptrace.intervals import Resampler


def _losses(n: int, T: int, seed: int) -> np.ndarray:
    """[n, T] per-depth losses that fall with depth at token-specific speeds (some tokens are done early)."""
    rng = np.random.default_rng(seed)
    drops = rng.exponential(size=(n, T)) * (rng.random((n, 1)) < 0.5)  # half the tokens keep improving
    return 0.05 + np.cumsum(drops[:, ::-1], axis=1)[:, ::-1] * rng.random((n, 1))


def _threshold_exits(score: np.ndarray, tau: float) -> np.ndarray:
    """First loop with score ≤ tau (1-based), else T."""
    hit = score <= tau
    return np.where(hit.any(1), hit.argmax(1) + 1, score.shape[1])


def test_permutation_moments_equal_enumeration():
    rng = np.random.default_rng(3)
    n, T = 7, 3
    c = exit_costs(rng.normal(size=(n, T)))
    d = np.array([1, 1, 2, 3, 3, 2, 1])
    vals = np.array([c[np.arange(n), d[list(p)] - 1].mean() for p in itertools.permutations(range(n))])
    mean, var = permutation_moments(c, d)
    assert mean == pytest.approx(vals.mean(), abs=1e-12)
    assert var == pytest.approx(vals.var(), rel=1e-10)


def test_costs_by_hand():
    # 4 tokens, T = 2. ℓ = [[1, 0], [0.5, 0.5], [2, 1], [0.2, 0.1]] -> c(1) = [1, 0, 1, 0.1], c(2) = 0.
    loss = np.array([[1.0, 0.0], [0.5, 0.5], [2.0, 1.0], [0.2, 0.1]])
    d = np.array([2, 1, 2, 1])  # the signal exits tokens 1 and 3 (0-based) at loop 1
    r = faithfulness_test(loss, d, n_resamples=99)
    assert r.cost_signal == pytest.approx((0 + 0 + 0 + 0.1) / 4)
    # random: half the tokens at depth 1 -> E = mean_i 0.5 c_i(1)
    assert r.cost_random == pytest.approx(0.5 * (1 + 0 + 1 + 0.1) / 4)
    # reverse: the tokens the signal exits at 2 (0 and 2) get depth 1 -> (1 + 1) / 4
    assert r.cost_reverse == pytest.approx(0.5)
    assert r.saving == pytest.approx(r.cost_random - r.cost_signal)
    assert (r.n, r.n_exited, r.mean_depth) == (4, 2, 1.5)


def test_reverse_depths_reverse_the_ranking():
    d = np.array([3, 1, 2, 3, 1])
    rev = reverse_depths(d, seed=0)
    assert sorted(rev) == sorted(d)
    assert (rev[d == 1] == 3).all() and (rev[d == 2] == 2).all()
    assert set(rev[d == 3]) == {1}


def test_a_signal_that_is_the_loss_increase_is_faithful():
    n, T = 2000, 6
    loss = _losses(n, T, seed=0)
    cost = exit_costs(loss)
    d = _threshold_exits(cost, 0.02)  # the signal is ℓ_t − ℓ_T itself
    assert 0 < (d < T).sum() < n
    rs = Resampler(np.arange(n) // 10, n_boot=200, seed=1)  # 200 sequences of 10 tokens
    r = faithfulness_test(loss, d, rs, n_resamples=199)
    assert r.pvalue < 1e-6 and r.verdict == "faithful" and r.n == 2000
    assert r.saving_lo > 0 and r.saving_lo <= r.saving <= r.saving_hi
    assert r.cost_signal <= 0.02 + 1e-12  # it exits only where the increase is at most its threshold
    # its reverse ranking is worse than random: the same depths on the tokens that need depth most
    rev = faithfulness_test(loss, reverse_depths(d, 0), rs, n_resamples=199)
    assert rev.verdict == "anti-faithful" and rev.saving_hi < 0 and rev.pvalue_worse < 1e-6 and rev.pvalue > 0.5


def test_a_random_signal_rejects_at_the_nominal_rate():
    n, T, alpha, reps = 2000, 6, 0.05, 200
    loss = _losses(n, T, seed=1)
    rng = np.random.default_rng(7)
    rejected = 0
    for k in range(reps):
        d = _threshold_exits(rng.random((n, T)), 0.15)  # a threshold rule on a signal unrelated to ℓ
        rejected += faithfulness_test(loss, d, n_resamples=199, alpha=alpha, seed=k).pvalue < alpha
    lo, hi = binom.interval(0.999, reps, alpha)
    assert lo <= rejected <= hi, (rejected, lo, hi)


def test_one_depth_for_all_tokens_is_untestable():
    loss = _losses(50, 4, seed=2)
    r = faithfulness_test(loss, np.full(50, 2), n_resamples=99)
    assert r.verdict == "untestable" and r.pvalue == 1.0 and r.saving == pytest.approx(0.0, abs=1e-12)


def test_bad_depths_are_refused():
    with pytest.raises(ValueError, match="exit depths must be"):
        faithfulness_test(np.zeros((3, 2)), np.array([1, 2, 3]))


def test_deterministic():
    loss = _losses(300, 4, seed=4)
    d = _threshold_exits(exit_costs(loss), 0.1)
    a, b = faithfulness_test(loss, d, seed=5), faithfulness_test(loss, d, seed=5)
    assert a == b and math.isfinite(a.z)


def test_monte_carlo_pvalue_agrees_with_scipy_permutation_test():
    from scipy.stats import permutation_test

    loss = _losses(400, 4, seed=6)
    rng = np.random.default_rng(8)
    # a weak signal: random depths, but 30 tokens that are done at loop 1 are exited there
    d = rng.integers(1, 5, 400)
    d[rng.choice(np.flatnonzero(exit_costs(loss)[:, 0] < 1e-9), 30, replace=False)] = 1
    B = 4999
    ours = faithfulness_test(loss, d, n_resamples=B, seed=1)
    c = exit_costs(loss)
    ref = permutation_test((d,), lambda x, axis=-1: c[np.arange(d.size), x - 1].mean(axis=-1), vectorized=True,
                           permutation_type="pairings", n_resamples=B, alternative="less",
                           random_state=np.random.default_rng(2)).pvalue
    assert 0.005 < ref < 0.5  # a case where the p-value is resolved, not at a floor
    se = math.sqrt(ref * (1 - ref) / B)
    assert abs(ours.pvalue_mc - ref) < 5 * math.sqrt(2) * se
    assert abs(ours.pvalue_normal - ref) < 0.05  # the combinatorial CLT's tail is close at n = 400


def test_shared_permutations_give_the_same_result():
    from looptrace.diagnose.faithfulness import null_permutations

    loss = _losses(300, 4, seed=9)
    d = _threshold_exits(exit_costs(loss), 0.1)
    perms = null_permutations(300, 99, seed=3)
    assert perms.shape == (99, 300) and (np.sort(perms, axis=1) == np.arange(300)).all()
    assert faithfulness_test(loss, d, seed=3, perms=perms) == faithfulness_test(loss, d, n_resamples=99, seed=3)


def test_config_errors():
    from looptrace.config import ConfigError
    from looptrace.diagnose.config import DiagnoseConfig

    with pytest.raises(ConfigError, match="faithfulness_resamples must be ≥ 0"):
        DiagnoseConfig(faithfulness_resamples=-1)
    with pytest.raises(ConfigError, match="faithfulness_alpha must be in"):
        DiagnoseConfig(faithfulness_alpha=1.0)


def test_empty_table_keeps_its_columns():
    from looptrace.diagnose.faithfulness import faithfulness_frame

    df = faithfulness_frame([])
    assert df.height == 0 and {"model", "rule", "saving", "pvalue", "verdict"} <= set(df.columns)
    r = faithfulness_test(_losses(50, 3, seed=1), np.r_[np.ones(25, int), np.full(25, 3)], n_resamples=19)
    one = faithfulness_frame([{"model": "m", "task": "t", "regime": "r", "regime_kind": "k", "source": "readouts",
                               "rule": "x", "kind": None, **r.to_dict()}])
    assert one.columns == df.columns and one["pvalue"][0] == r.pvalue
