"""Failure localisation, Spearman, verdicts and the [AD] claims (looptrace.diagnose)."""

from __future__ import annotations

import json
import math
import re

import numpy as np
import polars as pl
import pytest
from scipy.stats import rankdata

from looptrace.config import ConfigError, from_dict
from looptrace.diagnose.ad_claims import ad_claims
from looptrace.diagnose.config import CLASSES, DiagnoseConfig
from looptrace.diagnose.stage import diagnose_models
from looptrace.diagnose.stats import (
    REASONS,
    VERDICTS,
    failure_codes,
    failure_rows,
    spearman_headlines,
    spearman_rows,
)
from looptrace.diagnose.summary import summary_markdown
from looptrace.diagnose.verdicts import group_verdicts
from looptrace.diagnose.verdicts import verdict as model_verdict
from looptrace.diagnose.words import _rho_basis, check_verdict
from looptrace.intervals import IntervalsConfig
from looptrace.io.artifacts import write_outputs
from looptrace.io.tables import SplitArrays
from looptrace.project import resolve_model
from looptrace.rules.readouts import ReadoutsConfig, readouts_model
from looptrace.rules.scoring import CalibrationConfig, evaluate_rule, result_frames
from tests.builders import token_loop_splits, write_token_loop

F, T_ = False, True


def test_failure_codes_constructed():
    correct = np.array([
        [F, T_, T_, T_],  # exit 3: right                       -> correct
        [F, F, F, F],     # exit 2: nothing right ever          -> trajectory
        [F, F, T_, T_],   # exit 1: before the first right loop -> early
        [T_, F, F, F],    # exit 4: after a right loop          -> overthinking
        [F, T_, F, F],    # exit 3                              -> overthinking
        [F, F, F, T_],    # exit 2                              -> early
        [F, F, F, F],     # exit 4                              -> trajectory
        [F, T_, F, T_],   # exit 4: right                       -> correct
    ])
    exits = np.array([3, 2, 1, 4, 3, 2, 4, 4])
    codes = failure_codes(exits, correct)
    np.testing.assert_array_equal(codes, [0, 1, 2, 3, 3, 2, 1, 0])
    diff = np.array([0, 0, 0, 1, 1, 1, 1, 2])
    rows = {(r["group"], r["difficulty"]): r for r in failure_rows(codes, exits, diff)}
    assert set(rows) == {("all", None), ("difficulty", 0), ("difficulty", 1), ("difficulty", 2)}
    a = rows[("all", None)]
    assert (a["correct"], a["trajectory"], a["readout_early"], a["readout_overthinking"]) == (2, 2, 2, 2)
    d1 = rows[("difficulty", 1)]
    assert (d1["n_tokens"], d1["correct"], d1["trajectory"], d1["readout_early"], d1["readout_overthinking"]) == \
        (4, 0, 1, 1, 2)
    assert d1["frac_readout_overthinking"] == 0.5 and d1["exit_depth_mean"] == pytest.approx(13 / 4)
    for r in rows.values():
        assert sum(r[c] for c in CLASSES) == r["n_tokens"]
    with pytest.raises(ValueError, match="1..4"):
        failure_codes(np.array([0, 1, 1, 1, 1, 1, 1, 1]), correct)


def test_spearman_rows():
    rng = np.random.default_rng(0)
    diff = rng.integers(0, 4, 200)
    T = 3
    sig = np.stack([diff + rng.normal(0, 1, 200), -diff + rng.normal(0, 0.1, 200), rng.normal(0, 1, 200)], 1)
    sig[:7, 0] = np.nan
    rows = spearman_rows(diff, {"s": sig, "scalar": diff * 2.0})
    get = {(r["signal"], r["loop"], r["aggregation"]): r for r in rows}
    assert len(rows) == 2 * (T + 1) + 2
    # token aggregation: Pearson correlation of average ranks (independent implementation), NaNs dropped
    ok = np.isfinite(sig[:, 0])
    ref = np.corrcoef(rankdata(diff[ok]), rankdata(sig[ok, 0]))[0, 1]
    assert get[("s", 1, "token")]["rho"] == pytest.approx(ref, abs=1e-12)
    assert get[("s", 1, "token")]["n"] == 193
    # per-level means of loop 2 are strictly decreasing in difficulty -> ρ = −1 over 4 levels
    assert get[("s", 2, "difficulty_mean")]["rho"] == pytest.approx(-1.0)
    assert get[("s", 2, "difficulty_mean")]["n"] == 4
    # mean over loops (loop None): per-token mean of the finite loops
    mean = np.nanmean(sig, 1)
    ref = np.corrcoef(rankdata(diff), rankdata(mean))[0, 1]
    assert get[("s", None, "token")]["rho"] == pytest.approx(ref, abs=1e-12)
    assert get[("scalar", None, "token")]["rho"] == pytest.approx(1.0)
    # constant signal -> NaN, not an error
    assert math.isnan(spearman_rows(diff, {"c": np.ones(200)})[0]["rho"])
    assert all(math.isnan(r["rho_lo"]) and r["n_boot"] == 0 for r in rows)  # no resampler: no intervals


def _expanded_rho(seq, counts, diff, sig, agg):
    """ρ of one resample computed the slow, independent way: repeat every sequence's tokens as often as the
    resample drew it, then scipy's spearmanr on the tokens or on the per-level means."""
    from scipy.stats import spearmanr

    reps = counts[seq].astype(int)
    d, v = np.repeat(diff, reps), np.repeat(sig, reps)
    ok = np.isfinite(v)
    d, v = d[ok], v[ok]
    if agg == "token":
        return spearmanr(d, v).statistic
    lv = np.unique(d)
    return spearmanr(lv, [v[d == x].mean() for x in lv]).statistic


def test_spearman_intervals_are_a_paired_bootstrap_over_sequences():
    from looptrace.intervals import Resampler, percentile_interval

    rng = np.random.default_rng(5)
    n_seq, per = 40, 6
    seq = np.repeat(np.arange(n_seq), per)
    diff = rng.integers(0, 5, seq.size)
    sig = np.stack([diff + rng.normal(0, 1.5, seq.size), rng.normal(0, 1, seq.size)], 1)
    sig[:5, 1] = np.nan
    B = 60
    counts = rng.multinomial(n_seq, np.full(n_seq, 1 / n_seq), size=B).astype(float)
    rs = Resampler(seq, 0, counts=counts)
    rows = spearman_rows(diff, {"s": sig}, rs)
    get = {(r["signal"], r["loop"], r["aggregation"]): r for r in rows}
    for loop in (1, 2):
        for agg in ("token", "difficulty_mean"):
            want = np.array([_expanded_rho(seq, counts[b], diff, sig[:, loop - 1], agg) for b in range(B)])
            lo, hi = percentile_interval(want[:, None], 0.95)
            r = get[("s", loop, agg)]
            assert (r["rho_lo"], r["rho_hi"]) == pytest.approx((lo[0], hi[0]), abs=1e-12), (loop, agg)
            assert (r["n_boot"], r["n_sequences"]) == (B, n_seq)
    # a real trend has an interval above 0 that holds the estimate; noise has one that straddles 0
    tr = get[("s", 1, "token")]
    assert 0 < tr["rho_lo"] <= tr["rho"] <= tr["rho_hi"]
    nz = get[("s", 2, "token")]
    assert nz["rho_lo"] < 0 < nz["rho_hi"]
    # headline only: the other rows have no interval, the headline's is the same numbers
    only = spearman_rows(diff, {"s": sig}, rs, lambda s, loop, agg: loop == 1 and agg == "token")
    got = {(r["signal"], r["loop"], r["aggregation"]): r for r in only}
    assert got[("s", 1, "token")]["rho_lo"] == tr["rho_lo"]
    assert math.isnan(got[("s", 2, "token")]["rho_lo"]) and got[("s", None, "difficulty_mean")]["n_boot"] == 0


def test_spearman_headline_with_intervals_in_summary_and_metrics():
    sp = pl.DataFrame({"model": ["t-joint-s0", "t-joint-s1"], "signal": ["entropy"] * 2, "loop": [None, None],
                       "aggregation": ["difficulty_mean"] * 2, "rho": [0.62, 0.70], "pvalue": [0.1, 0.1], "n": [12, 11],
                       "rho_lo": [0.55, 0.61], "rho_hi": [0.69, 0.77], "n_boot": [1000, 1000],
                       "n_sequences": [200, 200]}, schema_overrides={"loop": pl.Int64})
    groups, models = spearman_headlines(sp, DiagnoseConfig())
    m0 = models["t-joint-s0"]
    assert (m0["iv"].estimate, m0["iv"].lo, m0["iv"].hi, m0["n"]) == (0.62, 0.55, 0.69, 12)
    assert _rho_basis(m0) == "n = 12 difficulty levels, bootstrap over 200 test sequences, B = 1000"
    g = groups["t-joint"]["iv"]
    # across seeds: Fisher's z (ρ stays in [−1, 1]): tanh(mean atanh ρ ± t_{0.975, 1} · sd / √2)
    zs = np.arctanh([0.62, 0.70])
    hz = 12.706204736174707 * np.std(zs, ddof=1) / math.sqrt(2)
    lo_r, hi_r = math.tanh(zs.mean() - hz), math.tanh(zs.mean() + hz)
    assert (g.estimate, g.n_seeds) == (pytest.approx(0.66), 2)
    assert (g.lo, g.hi) == (pytest.approx(lo_r), pytest.approx(hi_r)) and -1 <= g.lo < g.hi <= 1
    v = pl.DataFrame([{"model": f"t-joint-s{s}", "regime_kind": "joint", "verdict": "at-ceiling", "best_rule": None,
                       "evidence": "e"} for s in (0, 1)])
    md = summary_markdown(v, [], sp, DiagnoseConfig(), groups=pl.DataFrame())
    assert ("- t-joint-s0 (joint): ρ = 0.62 [0.55, 0.69] (n = 12 difficulty levels, bootstrap over 200 test "
            "sequences, B = 1000).") in md
    assert f"- t-joint: ρ = 0.66 [{lo_r:.2f}, {hi_r:.2f}] (2 seeds; n = 12, 11 difficulty levels)." in md


def _iv3(v):
    """(estimate, lo, hi) from a number (no interval) or a 3-tuple."""
    return (float(v), math.nan, math.nan) if not isinstance(v, tuple) else tuple(float(a) for a in v)


def _tables(fixed, posthoc, gate=None, native=None, oracle=(1.0, 0.98, 1.02), x=95.0, dx=None, within=True,
            val=None, fails=(100, 90, 6)):
    """Hand-built chosen / dx / oracle / failure tables of one model. Depth figures are numbers or
    (estimate, lo, hi); ``val`` maps a rule to its val depth (default: its test estimate); ``fails`` is
    (n_tokens, correct, trajectory) at entropy's point (the rest of the errors: readout, 3 early + rest late)."""
    rows = [("fixed", "fixed", "readouts", fixed), ("entropy", "posthoc", "readouts", posthoc)]
    if gate is not None:
        rows.append(("gate:m-ponder", "gate", "gates", gate))
    if native is not None:
        rows.append(("q_exit", "native", "readouts", native))
    ivs = [_iv3(r[3]) for r in rows]
    val = val or {}
    chosen = pl.DataFrame({"rule": [r[0] for r in rows], "kind": [r[1] for r in rows], "source": [r[2] for r in rows],
                           "val_depth": [float(val.get(r[0], i[0])) for r, i in zip(rows, ivs, strict=True)],
                           "val_accuracy": [0.96] * len(rows),
                           "test_depth": [i[0] for i in ivs], "test_depth_lo": [i[1] for i in ivs],
                           "test_depth_hi": [i[2] for i in ivs], "test_accuracy": [0.96] * len(rows),
                           "within_delta": [within] * len(rows), "n_boot": [1000] * len(rows),
                           "n_sequences": [50] * len(rows)})
    dxv = dx or {}
    dxi = [_iv3(dxv.get(r[0], math.nan)) for r in rows]
    dxf = pl.DataFrame({"rule": [r[0] for r in rows], "kind": [r[1] for r in rows], "source": [r[2] for r in rows],
                        "x": [x] * len(rows), "d_at": [i[0] for i in dxi], "d_at_lo": [i[1] for i in dxi],
                        "d_at_hi": [i[2] for i in dxi], "val_d_at": [i[0] for i in dxi]})
    n, ok, traj = fails
    early = min(3, n - ok - traj)
    fails = pl.DataFrame({"rule": ["entropy"], "group": ["all"], "n_tokens": [n], "correct": [ok], "trajectory": [traj],
                          "readout_early": [early], "readout_overthinking": [n - ok - traj - early]})
    o = _iv3(oracle)
    return chosen, dxf, {"depth": {"estimate": o[0], "lo": o[1], "hi": o[2]}, "accuracy": 0.99}, fails


M = {"model": "m", "regime_kind": "uniform", "n_loops": 6}
FIX = (4.0, 3.9, 4.1)


@pytest.mark.parametrize("case,expect,phrases", [
    # best overlaps fixed and a gain of up to 0.8 loops is possible: undecided, oracle far below
    (dict(fixed=FIX, posthoc=(3.6, 3.3, 3.95), oracle=(1.5, 1.4, 1.6)), ("undecided", "undecided_early_exit"),
     ["best entropy at 3.60 [3.30, 3.95] is within noise of fixed depth 4.00 [3.90, 4.10]",
      "their difference is -0.40 [-0.80, 0.05] loops (intervals)", "the oracle ceiling 1.50 [1.40, 1.60]"]),
    # best overlaps fixed but the interval rules out a gain of gap_tol: trajectory-limited
    (dict(fixed=FIX, posthoc=(3.9, 3.7, 4.1), oracle=(1.5, 1.4, 1.6)), ("trajectory-limited", "no_early_exit"),
     ["best entropy at 3.90 [3.70, 4.10] is within tolerance of fixed depth 4.00 [3.90, 4.10]",
      "difference -0.10 [-0.40, 0.20] loops, intervals: a gain of 0.5 loops or more is ruled out",
      "the oracle ceiling 1.50 [1.40, 1.60] is lower", "no refit gates were run"]),
    # disjoint but closer than gap_tol (0.5 loops)
    (dict(fixed=FIX, posthoc=(3.7, 3.6, 3.8), oracle=(1.5, 1.4, 1.6)), ("trajectory-limited", "no_early_exit"),
     ["is within tolerance of fixed depth 4.00 [3.90, 4.10]"]),
    # even the oracle is at fixed depth: answers arrive only at full depth
    (dict(fixed=FIX, posthoc=(3.95, 3.8, 4.1), oracle=(3.9, 3.8, 4.0)), ("trajectory-limited", "no_headroom"),
     ["even the oracle ceiling 3.90 [3.80, 4.00] is within tolerance of fixed depth"]),
    # the native gate lags the post-hoc readout beyond noise
    (dict(fixed=FIX, posthoc=(2.0, 1.8, 2.2), native=(3.5, 3.3, 3.7), oracle=(1.9, 1.7, 2.1)),
     ("readout-limited", "native_gate"), ["the native gate at 3.50 [3.30, 3.70] is higher than it"]),
    # native within noise of best but possibly 0.7 loops worse: undecided between native_gate and at_ceiling
    (dict(fixed=FIX, posthoc=(2.0, 1.8, 2.2), native=(2.3, 2.1, 2.5), oracle=(1.9, 1.7, 2.1)),
     ("undecided", "undecided_native"), ["whether the native gate at 2.30 [2.10, 2.50] is worse"]),
    # native within gap_tol of best for sure: best is at the ceiling
    (dict(fixed=FIX, posthoc=(2.0, 1.8, 2.2), native=(2.1, 2.0, 2.2), oracle=(1.9, 1.7, 2.1)),
     ("at-ceiling", "at_ceiling"), ["and within tolerance of the oracle ceiling 1.90 [1.70, 2.10]"]),
    # best above the oracle beyond noise and gap_tol
    (dict(fixed=FIX, posthoc=(2.0, 1.9, 2.1), oracle=(1.2, 1.1, 1.3)), ("readout-limited", "below_ceiling"),
     ["entropy at 2.00 [1.90, 2.10] is lower than fixed depth 4.00 [3.90, 4.10] but higher than the oracle "
      "ceiling 1.20 [1.10, 1.30]"]),
    # the same gap of 0.8 loops, but the oracle's interval reaches best's: neither below nor at the ceiling is
    # supported (the gap may be 1.0 loop or none) -> undecided (was at_ceiling)
    (dict(fixed=FIX, posthoc=(2.0, 1.9, 2.1), oracle=(1.2, 1.1, 1.95)), ("undecided", "undecided_ceiling"),
     ["cannot tell whether it is at or above the oracle ceiling 1.20 [1.10, 1.95]"]),
    # a running_parity-uniform model: at the ceiling with every error a readout failure (0 trajectory)
    (dict(fixed=FIX, posthoc=(1.9, 1.8, 2.0), oracle=(1.8, 1.7, 1.9), fails=(100, 80, 0)), ("at-ceiling", "at_ceiling"),
     ["errors at its chosen point: 20 of 100 test tokens, of which 0 (0 %) trajectory failures (no loop right) and "
      "20 (100 %) readout failures"]),
    # without intervals (n_boot 0) the comparisons are on the point values with gap_tol
    (dict(fixed=4.0, posthoc=2.0, oracle=1.2), ("readout-limited", "below_ceiling"), ["higher than the oracle"]),
    (dict(fixed=4.0, posthoc=2.0, oracle=1.7), ("at-ceiling", "at_ceiling"), ["within tolerance of the oracle"]),
])
def test_verdict_cases(case, expect, phrases):
    chosen, dx, oracle, fails = _tables(**case)
    v = model_verdict(M, chosen, dx, oracle, fails, DiagnoseConfig())
    assert (v["verdict"], v["reason"]) == expect
    assert v["evidence"].startswith(f"m: {expect[0]} — ")
    for p in phrases:
        assert p in v["evidence"], (p, v["evidence"])
    n, ok, traj = case.get("fails", (100, 90, 6))
    assert (v["n_errors"], v["n_trajectory_failures"], v["n_readout_failures"]) == (n - ok, traj, n - ok - traj)
    assert check_verdict(v) == []
    for bad in ("None", "nan", " inf"):
        assert bad not in v["evidence"]


def test_verdict_best_rule_is_chosen_on_val_not_test():
    # the gate has the lower *test* depth (1.8) but the higher *val* depth (2.2): entropy is best
    chosen, dx, oracle, fails = _tables(fixed=FIX, posthoc=(2.5, 2.3, 2.7), gate=(1.8, 1.6, 2.0),
                                        val={"entropy": 2.0, "gate:m-ponder": 2.2}, oracle=(1.7, 1.6, 1.8))
    v = model_verdict(M, chosen, dx, oracle, fails, DiagnoseConfig())
    assert v["best_rule"] == "entropy" and v["best_depth"] == 2.5 and (v["best_depth_lo"], v["best_depth_hi"]) == (2.3, 2.7)
    # entropy [2.3, 2.7] vs oracle [1.6, 1.8]: disjoint, 0.8 ≥ 0.5 loops -> below the ceiling
    assert (v["verdict"], v["reason"]) == ("readout-limited", "below_ceiling")


def test_check_verdict_catches_contradictions():
    chosen, dx, oracle, fails = _tables(fixed=FIX, posthoc=(1.9, 1.8, 2.0), oracle=(1.8, 1.7, 1.9), fails=(100, 80, 0))
    v = model_verdict(M, chosen, dx, oracle, fails, DiagnoseConfig())
    assert v["verdict"] == "at-ceiling" and check_verdict(v) == []
    # the pre-issue-12 reading of the same numbers: "trajectory-limited" at the ceiling
    old = {**v, "verdict": "trajectory-limited", "reason": "at_ceiling",
           "evidence": v["evidence"].replace("at-ceiling", "trajectory-limited")}
    probs = check_verdict(old)
    assert any("the numbers give at-ceiling (at_ceiling)" in p for p in probs)
    assert any("does not belong" in p for p in probs)
    # a sentence that drops a figure, or prints nan
    assert any("does not cite oracle_depth" in p
               for p in check_verdict({**v, "evidence": v["evidence"].replace("1.80 [1.70, 1.90]", "?")}))
    assert any("prints 'nan'" in p for p in check_verdict({**v, "evidence": v["evidence"] + " nan"}))
    assert any("add up" in p for p in check_verdict({**v, "n_readout_failures": 3}))


def test_verdicts_never_contradict_their_numbers_on_random_tables():
    rng = np.random.default_rng(0)
    seen = set()
    for _ in range(300):
        def iv(lo_, hi_):
            e = rng.uniform(lo_, hi_)
            w = rng.choice([0.0, 0.05, 0.3, 1.0])
            return (e, e - w * rng.uniform(0, 1), e + w * rng.uniform(0, 1)) if w else e
        case = dict(fixed=iv(2.5, 4.0), posthoc=iv(1.0, 4.0), oracle=iv(1.0, 3.5))
        if rng.random() < 0.5:
            case["native"] = iv(1.0, 5.0)
        if rng.random() < 0.5:
            case["gate"] = iv(1.0, 4.0)
        chosen, dx, oracle, fails = _tables(**case, fails=(100, int(rng.integers(50, 100)), 0))
        v = model_verdict(M, chosen, dx, oracle, fails, DiagnoseConfig(gap_tol=float(rng.choice([0.0, 0.5]))))
        assert check_verdict(v) == []
        seen.add(v["reason"])
    assert seen == set(REASONS)  # every outcome was exercised


def test_group_verdict_across_seeds_by_hand():
    """Three seeds: best 2.0/2.2/2.4, fixed 4/4/4, oracle 1.5/1.6/1.7. Figures: Student-t intervals on the logit
    scale of [1, T] (t_{0.975, 2}); comparisons: paired per-seed differences."""
    t2 = 4.302652729911275
    rows = []
    for s, (b, o) in enumerate(((2.0, 1.5), (2.2, 1.6), (2.4, 1.7))):
        chosen, dx, oracle, fails = _tables(fixed=(4.0, 4.0, 4.0), posthoc=(b, b - 0.1, b + 0.1), oracle=(o, o - 0.05, o + 0.05),
                                            dx={"fixed": (3.0, 3.0, 3.0), "entropy": (1.5 + s / 10, 1.4, 1.8)})
        rows.append(model_verdict({**M, "model": f"t-uniform-s{s}", "task": "t", "regime": "uniform"}, chosen, dx, oracle,
                              fails, DiagnoseConfig()))
    # seed-level: best [b ± 0.1] vs oracle [o ± 0.05]: gaps 0.5, 0.6, 0.7 with disjoint intervals -> below ceiling
    assert [r["reason"] for r in rows] == ["below_ceiling"] * 3
    g = group_verdicts(pl.DataFrame(rows), DiagnoseConfig()).row(0, named=True)
    # best: logit of (d - 1) / 5 -> t-interval -> back (no value near a bound: no clamping)
    z = [math.log(p / (1 - p)) for p in (0.2, 0.24, 0.28)]
    zm, zs = float(np.mean(z)), float(np.std(z, ddof=1))
    lo_b = 1 + 5 / (1 + math.exp(-(zm - t2 * zs / math.sqrt(3))))
    hi_b = 1 + 5 / (1 + math.exp(-(zm + t2 * zs / math.sqrt(3))))
    assert g["group"] == "t-uniform" and g["n_seeds"] == 3 and g["seeds"] == "0, 1, 2" and g["n_loops"] == 6
    assert g["best_depth"] == pytest.approx(2.2)
    assert (g["best_depth_lo"], g["best_depth_hi"]) == (pytest.approx(lo_b), pytest.approx(hi_b))
    assert g["fixed_depth_lo"] == pytest.approx(4.0) and g["fixed_depth_hi"] == pytest.approx(4.0)
    assert g["dx_best_posthoc"] == pytest.approx(1.6)
    # paired: best - oracle = 0.5, 0.6, 0.7 -> 0.6 ± t2 · 0.1 / √3 = [0.35, 0.85]: higher by ≥ gap_tol -> below the
    # ceiling, as every seed says (the unpaired intervals overlapped, which an unpaired reading would call "at-ceiling")
    half = t2 * 0.1 / math.sqrt(3)
    assert g["diff_best_vs_oracle_lo"] == pytest.approx(0.6 - half) and g["diff_best_vs_oracle_method"] == \
        "paired t over seeds"
    assert (g["verdict"], g["reason"]) == ("readout-limited", "below_ceiling")
    assert g["seed_verdicts"] == "3 × readout-limited" and g["seeds_needed"] is None
    assert f"entropy at 2.20 [{lo_b:.2f}, {hi_b:.2f}] is lower than fixed depth 4.00 [4.00, 4.00]" in g["evidence"]
    assert "(3 seeds; per-seed verdicts: 3 × readout-limited)" in g["evidence"]
    assert check_verdict(g) == []


def _dx(rows):
    """D@X rows (model, rule, kind, x, d_at as a number or (estimate, lo, hi)); val_d_at = the estimate."""
    out = []
    for m, r, k, x, v in rows:
        e, lo, hi = _iv3(v)
        out.append((m, r, k, float(x), e, lo, hi, e))
    return pl.DataFrame(out, schema={"model": pl.String, "rule": pl.String, "kind": pl.String, "x": pl.Float64,
                                     "d_at": pl.Float64, "d_at_lo": pl.Float64, "d_at_hi": pl.Float64,
                                     "val_d_at": pl.Float64}, orient="row")


META = pl.DataFrame({"model": ["t-uniform", "t-geometric", "t-joint"], "task": ["t", "t", "t"],
                     "regime": ["uniform", "geometric", "joint"], "regime_kind": ["uniform", "geometric", "joint"]})


def test_ad_claims_on_intervals():
    dx = _dx([
        ("t-uniform", "fixed", "fixed", 95, (3.0, 3.0, 3.0)), ("t-uniform", "top1", "posthoc", 95, (1.4, 1.3, 1.5)),
        ("t-uniform", "entropy", "posthoc", 95, (1.6, 1.5, 1.7)), ("t-uniform", "kl_prev", "posthoc", 95, (1.2, 1.1, 1.3)),
        ("t-uniform", "gate:t-uniform-ponder", "gate", 95, (1.5, 1.4, 1.6)),
        # geometric: the confidence readout overlaps fixed depth -> within noise
        ("t-geometric", "fixed", "fixed", 95, (2.5, 2.4, 2.6)), ("t-geometric", "margin", "posthoc", 95, (2.2, 1.9, 2.45)),
        ("t-geometric", "gate:t-geometric-ponder", "gate", 95, (1.4, 1.3, 1.5)),
        ("t-joint", "fixed", "fixed", 95, (4.0, 4.0, 4.0)), ("t-joint", "q_exit", "native", 95, (4.5, 4.3, 4.7)),
        ("t-joint", "entropy", "posthoc", 95, (3.9, 3.8, 4.0)),
        ("t-joint", "gate:t-joint-ponder", "gate", 95, (3.8, 3.7, 3.9)),
        ("t-uniform", "fixed", "fixed", 98, 1.0),  # other X: ignored
    ])
    claims = {c["claim"]: c for c in ad_claims(META, dx, DiagnoseConfig(), gates_present=True)}
    assert claims["a"]["status"] == "partly (holds in 1, within noise in 1 of 2)"
    a = claims["a"]["sentences"]
    # confidence rules only (kl_prev is not a confidence readout), chosen on val: top1 on uniform
    assert a[1].startswith("t-uniform (1 seed): best confidence readout (top1, chosen on val) D@95 = 1.40 [1.30, 1.50], "
                           "lower than fixed depth D@95 = 3.00 [3.00, 3.00]: holds.")
    assert a[2].startswith("t-geometric (1 seed): best confidence readout (margin, chosen on val) D@95 = 2.20 "
                           "[1.90, 2.45], within noise of fixed depth D@95 = 2.50 [2.40, 2.60]: within noise.")
    # (b): native 4.5 [4.3, 4.7] vs the val-chosen post-hoc rule among the same-seed fixed-prior peers (kl_prev on
    # t-uniform, 1.2 [1.1, 1.3]): native higher -> holds
    assert claims["b"]["status"] == "holds"
    assert claims["b"]["sentences"][1] == (
        "t-joint (1 seed): native Q-exit D@95 = 4.50 [4.30, 4.70], higher than the best post-hoc readout on a "
        "fixed-prior trajectory of the same seed (kl_prev on t-uniform): 1.20 [1.10, 1.30]: holds.")
    # (c): uniform 1.5 vs 3.0 strong (holds), geometric 1.4 vs 2.5 strong (holds), joint 3.8 [3.7, 3.9] vs 4.0 [4, 4]:
    # disjoint but 0.2 < gap_tol 0.5 -> weak (holds)
    assert claims["c"]["status"] == "holds"
    c = " ".join(claims["c"]["sentences"])
    assert "t-joint (joint, 1 seed): best refit gate (gate:t-joint-ponder) D@95 = 3.80 [3.70, 3.90] vs fixed 4.00 " \
           "[4.00, 4.00] — weak" in c
    assert "t-uniform (uniform, 1 seed): best refit gate (gate:t-uniform-ponder) D@95 = 1.50 [1.40, 1.60] vs fixed " \
           "3.00 [3.00, 3.00] — strong" in c


def test_ad_claims_disagreement_unreachable_and_untestable():
    dx = _dx([
        ("t-uniform", "fixed", "fixed", 95, (2.0, 2.0, 2.0)), ("t-uniform", "entropy", "posthoc", 95, (2.5, 2.3, 2.7)),
        ("t-geometric", "fixed", "fixed", 95, (2.0, 2.0, 2.0)), ("t-geometric", "top1", "posthoc", 95, (2.6, 2.2, 2.9)),
        ("t-joint", "fixed", "fixed", 95, math.nan), ("t-joint", "q_exit", "native", 95, (math.nan, 4.0, math.inf)),
    ])
    claims = {c["claim"]: c for c in ad_claims(META, dx, DiagnoseConfig(), gates_present=False)}
    # both confidence readouts are higher than fixed depth beyond noise
    assert claims["a"]["status"] == "does not hold"
    assert "t-uniform (1 seed): best confidence readout (entropy, chosen on val) D@95 = 2.50 [2.30, 2.70], higher " \
           "than fixed depth D@95 = 2.00 [2.00, 2.00]: does not hold." in claims["a"]["sentences"][1]
    # native not reached [4.0, ∞) vs the peers' top1 2.6 [2.2, 2.9] (entropy's val D@X 2.5 is lower: chosen) ->
    # entropy 2.5 [2.3, 2.7]; native's interval lies above it: holds, and "not reached" is printed in words
    assert claims["b"]["status"] == "holds"
    assert claims["b"]["sentences"][1].startswith("t-joint (1 seed): native Q-exit D@95 = not reached, higher than")
    assert "(entropy on t-uniform): 2.50 [2.30, 2.70]" in claims["b"]["sentences"][1]
    assert claims["c"]["status"] == "untestable" and "Not tested" in claims["c"]["sentences"][0]
    for c in claims.values():
        for s in c["sentences"]:
            assert "None" not in s and "nan" not in s and " inf" not in s
    claims = {c["claim"]: c for c in ad_claims(META.filter(pl.col("regime_kind") != "joint"), dx,
                                                  DiagnoseConfig(), False)}
    assert claims["b"]["status"] == "untestable" and "no jointly trained model" in claims["b"]["sentences"][0]


def test_ad_claims_across_seeds():
    """Two seeds per group: figures are the across-seed mean with the Student-t interval (t_{0.975, 1} = 12.706);
    (b) pairs each joint seed with the fixed-prior models of its own seed."""
    t1 = 12.706204736174707
    meta = pl.DataFrame({"model": ["t-uniform-s0", "t-uniform-s1", "t-joint-s0", "t-joint-s1"], "task": ["t"] * 4,
                         "regime": ["uniform", "uniform", "joint", "joint"],
                         "regime_kind": ["uniform", "uniform", "joint", "joint"]})
    dx = _dx([("t-uniform-s0", "fixed", "fixed", 95, 3.0), ("t-uniform-s1", "fixed", "fixed", 95, 3.0),
              ("t-uniform-s0", "top1", "posthoc", 95, 1.1), ("t-uniform-s1", "top1", "posthoc", 95, 1.3),
              ("t-joint-s0", "q_exit", "native", 95, 2.0), ("t-joint-s1", "q_exit", "native", 95, 2.2)])
    claims = {c["claim"]: c for c in ad_claims(meta, dx, DiagnoseConfig(), gates_present=False)}
    (a,) = claims["a"]["details"]
    half = t1 * np.std([1.1, 1.3], ddof=1) / math.sqrt(2)
    assert a["n_seeds"] == 2 and a["confidence_dx"]["estimate"] == pytest.approx(1.2)
    assert a["confidence_dx"]["lo"] == pytest.approx(1.2 - half) and a["confidence_dx"]["hi"] == pytest.approx(1.2 + half)
    # 1.2 ± 1.27 overlaps fixed 3.0 ± 0? no: hi = 2.47 < 3.0 -> lower: holds
    assert a["result"] == "holds" and claims["a"]["status"] == "holds"
    (b,) = claims["b"]["details"]
    assert [p["fixed_prior_model"] for p in b["per_seed"]] == ["t-uniform-s0", "t-uniform-s1"]
    # native 2.1 ± 1.27 vs post-hoc 1.2 ± 1.27 overlap, but paired by seed the differences are 0.9 and 0.9:
    # higher with a zero-width paired interval -> holds (the seed-to-seed variation cancels)
    assert b["comparison"] == "higher" and claims["b"]["status"] == "holds"
    assert b["paired_difference"]["estimate"] == pytest.approx(0.9) and b["paired_difference"]["lo"] == pytest.approx(0.9)
    assert "t-joint (2 seeds): native Q-exit D@95 = 2.10 [" in claims["b"]["sentences"][1]
    assert "paired over seeds, the difference is 0.90 [0.90, 0.90]" in claims["b"]["sentences"][1]


def test_summary_markdown_from_numbers():
    chosen, dx, oracle, fails = _tables(fixed=FIX, posthoc=(2.25, 2.0, 2.5), native=(3.75, 3.5, 4.0),
                                        oracle=(1.5, 1.4, 1.6), dx={"fixed": (3.0, 3.0, 3.0), "q_exit": math.nan})
    v = model_verdict({"model": "t-joint", "task": "t", "regime": "joint", "regime_kind": "joint", "n_loops": 6}, chosen,
                  dx, oracle, fails.with_columns(model=pl.lit("t-joint")), DiagnoseConfig())
    verdicts = pl.DataFrame([v])
    sp = pl.DataFrame({"model": ["t-joint", "t-joint"], "signal": ["entropy", "entropy"], "loop": [None, 1],
                       "aggregation": ["difficulty_mean", "difficulty_mean"], "rho": [0.875, 0.1], "pvalue": [0.1, 0.2],
                       "n": [4, 4]}, schema_overrides={"loop": pl.Int64})
    claims = ad_claims(META.filter(pl.col("model") == "t-joint"), dx.with_columns(model=pl.lit("t-joint")),
                         DiagnoseConfig(), gates_present=False)
    failures = fails.with_columns(model=pl.lit("t-joint"), frac_correct=pl.lit(0.9), frac_trajectory=pl.lit(0.06),
                                  frac_readout_early=pl.lit(0.03), frac_readout_overthinking=pl.lit(0.01))
    md = summary_markdown(verdicts, claims, sp, DiagnoseConfig(), failures)
    # entropy's and q_exit's D@95 are NaN in dx (not reached); no gate was run
    assert ("| t-joint | joint | readout-limited | entropy (2.25 [2.00, 2.50]) | 4.00 [3.90, 4.10] | 3.75 [3.50, 4.00] | "
            "1.50 [1.40, 1.60] | 3.00 [3.00, 3.00] / not reached / not run / not reached |") in md
    assert ("| t-joint | joint | 1 | readout-limited | entropy | 2.25 [2.00, 2.50] | 4.00 [3.90, 4.10] | "
            "3.75 [3.50, 4.00] | 1.50 [1.40, 1.60] | 3.00 [3.00, 3.00] | not reached | not run | not reached |") in md
    assert "the native gate at 3.75 [3.50, 4.00] is higher than it" in md
    assert "- t-joint (joint): ρ = 0.88 (n = 4 difficulty levels; no interval)." in md  # loop null row, not loop 1
    assert "| t-joint | entropy | 90.0 | 6.0 | 3.0 | 1.0 |" in md
    assert "(a) [AD]" in md and "untestable — no fixed-prior (uniform/geometric, or decoupled RecurTrace) model in this run" in md
    assert not re.search(r"\b(None|nan|inf)\b", md)
    cfg1 = DiagnoseConfig(spearman_loop=1)
    assert "ρ = 0.10 (n = 4 difficulty levels; no interval)" in summary_markdown(verdicts, claims, sp, cfg1)
    # two seeds of one group: the Spearman headline across seeds, t_{0.975, 1} · sd / √2
    sp2 = pl.DataFrame({"model": ["t-joint-s0", "t-joint-s1"], "signal": ["entropy"] * 2, "loop": [None, None],
                        "aggregation": ["difficulty_mean"] * 2, "rho": [0.8, 0.9], "pvalue": [0.1, 0.1], "n": [4, 4]},
                       schema_overrides={"loop": pl.Int64})
    v2 = pl.DataFrame([{**v, "model": f"t-joint-s{s}", "group": "t-joint", "seed": s} for s in (0, 1)])
    md2 = summary_markdown(v2, claims, sp2, DiagnoseConfig())
    # Fisher's z keeps ρ within [−1, 1] (the plain t-interval read [0.21, 1.49]); the upper bound is within the
    # default resolution (1e-3 of the range) of 1, so it is 1
    zs = np.arctanh([0.8, 0.9])
    hz = 12.706204736174707 * np.std(zs, ddof=1) / math.sqrt(2)
    assert 1 - (math.tanh(zs.mean() + hz) + 1) / 2 < 1e-3
    assert f"- t-joint: ρ = 0.85 [{math.tanh(zs.mean() - hz):.2f}, 1.00] (2 seeds; n = 4, 4 difficulty levels)." in md2


def test_config_validation():
    with pytest.raises(ConfigError, match="unknown key"):
        from_dict(DiagnoseConfig, {"gap": 1}, "diagnose")
    with pytest.raises(ConfigError, match="spearman_aggregation"):
        from_dict(DiagnoseConfig, {"spearman_aggregation": "mean"}, "diagnose")
    with pytest.raises(ConfigError, match="spearman_headline"):
        from_dict(DiagnoseConfig, {"spearman_headline": "nope"}, "diagnose")
    with pytest.raises(ConfigError, match="spearman_intervals must be 'headline' or 'all'"):
        from_dict(DiagnoseConfig, {"spearman_intervals": "some"}, "diagnose")


def _gate_outputs(root, model, splits, seed):
    """A stand-in for the gates stage: an entropy-derived 'gate' scored with the shared functions."""
    def frame(s):
        cols = splits[s]
        order = np.argsort(cols["token"][:, 0])
        return {k: np.asarray(v)[order] for k, v in cols.items() if v is not None}
    val, test = frame("val"), frame("test")
    vd = SplitArrays(val["token"][:, 0], {"correct": val["correct"], "target_logprob": val["target_logprob"]})
    td = SplitArrays(test["token"][:, 0], {"correct": test["correct"], "target_logprob": test["target_logprob"]})
    r = evaluate_rule(f"gate:{model}-ponder", -val["entropy"], -test["entropy"], vd, td, "ge", kind="gate")
    # a stand-in for [FP]'s router on convergence labels (diagnose compares it with argmax_stable and kl_prev)
    rc = evaluate_rule("gate:logreg-converged", val["max_prob"], test["max_prob"], vd, td, "ge", kind="gate")
    frames = result_frames([r, rc])
    write_outputs(root / model, frames, {"model": model})


def test_diagnose_end_to_end(tmp_path, repo_root):
    from typer.testing import CliRunner

    from looptrace.cli import app

    models = ["running_parity-uniform", "running_parity-geometric", "running_parity-joint"]
    train_meta = {"running_parity": None}
    regimes = {"uniform": {"kind": "uniform"}, "geometric": {"kind": "geometric"}, "joint": {"kind": "joint"}}
    for i, m in enumerate(models):
        splits = token_loop_splits(n=240, T=6, seed=i, gate=m.endswith("joint"))
        write_token_loop(tmp_path / "geometry" / m / "token_loop.parquet", splits)
        readouts_model(tmp_path / "geometry" / m, ReadoutsConfig(), CalibrationConfig(n_quantiles=21), tmp_path / "readouts" / m,
                       meta=resolve_model(m, train_meta, regimes), progress=False, intervals=IntervalsConfig(n_boot=200))
        if i < 2:  # gates for two models only: the third has none
            _gate_outputs(tmp_path / "gates", m, splits, i)
    cfg = DiagnoseConfig()
    frames, summary, metrics = diagnose_models(models, tmp_path / "readouts", tmp_path / "gates",
                                                 tmp_path / "geometry", cfg, progress=False,
                                                 intervals=IntervalsConfig(n_boot=200), seed=0)
    # the Spearman headline of every model carries its bootstrap interval; the other rows none (headline mode)
    sp = frames["spearman"]
    head = sp.filter((pl.col("signal") == "entropy") & pl.col("loop").is_null()
                     & (pl.col("aggregation") == "difficulty_mean"))
    assert head.height == 3 and (head["n_boot"] == 200).all() and (head["n_sequences"] > 1).all()
    assert ((head["rho_lo"] <= head["rho"]) & (head["rho"] <= head["rho_hi"])).all()
    assert sp.filter(pl.col("n_boot") == 0).height == sp.height - 3
    ms = metrics["spearman"]["models"][models[0]]
    assert ms["lo"] == head["rho_lo"][0] and ms["n_boot"] == 200 and ms["unit"] == "difficulty levels"
    assert f"ρ = {ms['text']} (n = {ms['n']} difficulty levels, bootstrap over" in summary
    fc = frames["failure_classes"]
    total = fc.select(pl.sum_horizontal(*CLASSES)).to_series()
    assert (total == fc["n_tokens"]).all()
    allrows = fc.filter(pl.col("group") == "all")
    assert (allrows["n_tokens"] == 240).all()
    assert set(fc.filter(pl.col("source") == "gates")["model"]) == set(models[:2])
    # per-difficulty rows sum to the overall row for every (model, rule)
    per = fc.filter(pl.col("group") == "difficulty").group_by("model", "source", "rule").agg(
        pl.col(c).sum() for c in CLASSES).sort("model", "source", "rule")
    ref = allrows.select("model", "source", "rule", *CLASSES).sort("model", "source", "rule")
    assert per.equals(ref)
    # the 'correct' count equals the chosen point's test accuracy × tokens
    ch = pl.read_parquet(tmp_path / "readouts" / models[0] / "chosen.parquet")
    acc = ch.filter(pl.col("rule") == "entropy")["test_accuracy"][0]
    got = allrows.filter((pl.col("model") == models[0]) & (pl.col("rule") == "entropy"))["correct"][0]
    assert got == round(acc * 240)
    assert metrics["gates_present"] and set(metrics["claims"]) == {"a", "b", "c"}
    # SEWN's faithfulness test (SPEC §7a): one row per model × rule at its chosen point, fixed depth untestable
    ft = frames["faithfulness"]
    assert ft.select("model", "source", "rule").sort("model", "source", "rule").equals(
        allrows.select("model", "source", "rule").sort("model", "source", "rule"))
    assert set(ft.filter(pl.col("rule") == "fixed")["verdict"]) == {"untestable"}
    assert (ft["n"] == 240).all() and (ft["n_resamples"].is_in([0, cfg.faithfulness_resamples])).all()
    assert metrics["faithfulness"]["n_tests"] == ft.height
    assert "## Counterfactual faithfulness of halting signals" in summary
    # [FP]: the router (two models have gates) against argmax_stable and kl_prev, per model and per group
    cr = frames["convergence_router"]
    assert set(cr.filter(pl.col("scope") == "model")["name"]) == set(models[:2])
    assert set(cr["baseline"]) == {"argmax_stable", "kl_prev"} and set(cr["router"]) == {"gate:logreg-converged"}
    r0 = cr.filter((pl.col("name") == models[0]) & (pl.col("baseline") == "kl_prev")).row(0, named=True)
    ch0 = pl.read_parquet(tmp_path / "gates" / models[0] / "chosen.parquet").filter(
        pl.col("rule") == "gate:logreg-converged").row(0, named=True)
    kl0 = ch.filter(pl.col("rule") == "kl_prev").row(0, named=True)
    assert (r0["router_depth"], r0["router_accuracy"]) == (ch0["test_depth"], ch0["test_accuracy"])
    assert (r0["baseline_depth"], r0["baseline_depth_lo"], r0["baseline_depth_hi"]) == (
        kl0["test_depth"], kl0["test_depth_lo"], kl0["test_depth_hi"])
    assert "## [FP]: a router on convergence labels vs training-free stabilisation" in summary
    assert frames["verdicts"].height == 3 and "## Verdicts" in summary
    # the verdicts carry the readouts' bootstrap intervals: the oracle ceiling's from metrics.json, fixed depth's
    # from chosen.parquet (the same resamples)
    v0 = frames["verdicts"].row(0, named=True)
    rm = json.loads((tmp_path / "readouts" / models[0] / "metrics.json").read_text())
    ceil = rm["rules"]["oracle"]["ceiling"]["test_depth"]
    assert (v0["oracle_depth"], v0["oracle_depth_lo"], v0["oracle_depth_hi"]) == (ceil["estimate"], ceil["lo"], ceil["hi"])
    fx = ch.filter(pl.col("rule") == "fixed").row(0, named=True)
    assert (v0["fixed_depth_lo"], v0["fixed_depth_hi"]) == (fx["test_depth_lo"], fx["test_depth_hi"])
    assert v0["fixed_depth_lo"] <= v0["fixed_depth"] <= v0["fixed_depth_hi"]
    # CLI: writes the four outputs + metrics.json (strict JSON)
    res = CliRunner().invoke(app, ["diagnose", "--params", str(repo_root / "params.yaml"), "--models", ",".join(models),
                                   "--readouts-root", str(tmp_path / "readouts"), "--gates-root",
                                   str(tmp_path / "gates"), "--geometry-root", str(tmp_path / "geometry"),
                                   "--out", str(tmp_path / "diagnose")])
    assert res.exit_code == 0, res.output
    out = tmp_path / "diagnose"
    for n in ("failure_classes.parquet", "spearman.parquet", "verdicts.parquet", "verdict_groups.parquet",
              "faithfulness.parquet", "convergence_router.parquet", "summary.md", "metrics.json"):
        assert (out / n).is_file()
    for row in pl.read_parquet(out / "verdicts.parquet").iter_rows(named=True):
        assert row["verdict"] in VERDICTS and check_verdict(row) == []
    assert not re.search(r"\b(None|nan|inf)\b", (out / "summary.md").read_text())
    json.loads((out / "metrics.json").read_text(), parse_constant=lambda c: pytest.fail(f"non-JSON {c}"))
    res = CliRunner().invoke(app, ["diagnose", "--params", str(repo_root / "params.yaml"), "--models", "nope",
                                   "--readouts-root", str(tmp_path / "readouts"), "--out", str(tmp_path / "d2")])
    assert res.exit_code == 2 and "readouts stage" in res.output
