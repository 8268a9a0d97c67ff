"""The halting findings in words (``looptrace.diagnose.halting_findings``) on synthetic tables whose
answers are known by construction, and the statistics behind the words by hand."""

from __future__ import annotations

import math
import re

import numpy as np
import polars as pl
import pytest
from scipy.stats import t as student_t

from looptrace.diagnose.config import DiagnoseConfig
from looptrace.diagnose.halting_findings import (
    GAP_GRID,
    collapse_rows,
    compare_paired,
    findings_markdown,
    frontier,
    frontier_gap,
    halting_findings,
    regime_role,
)
from looptrace.diagnose.router import COMPARISON_SCHEMA
from looptrace.estimates import Interval


def test_regime_role_from_definition():
    assert regime_role("recurtrace", {"kind": "recurtrace"}) == "recurtrace"
    assert regime_role("recurtrace", {"kind": "recurtrace", "loop_memory": True}) == "recurtrace_mem"
    assert regime_role("recurtrace", {"kind": "recurtrace", "detach": False}) == "recurtrace_flow"
    assert regime_role("recurtrace", None) == "recurtrace"  # detach's default
    assert regime_role("joint", {}) == "joint" and regime_role("act", {}) == "act"
    assert regime_role("geometric", {}) is None


def test_frontier_and_gap_by_hand():
    # a's point at 1.5 (0.3) is dominated by its point at 1.0 (0.5): the frontier keeps 0.5 there
    d, a = frontier(np.array([2.0, 1.0, 1.5]), np.array([0.9, 0.5, 0.3]))
    np.testing.assert_array_equal(d, [1.0, 1.5, 2.0])
    np.testing.assert_array_equal(a, [0.5, 0.5, 0.9])
    # b: (1, 0.4) – (3, 1.0); common range [1, 2]; gap(d) = 0.1 − 0.3u on [1, 1.5] (u = d − 1) and
    # −0.05 + 0.5v on [1.5, 2] (v = d − 1.5): the mean over an even grid ≈ the integral 0.0125 + 0.0375 = 0.05
    g, lo, hi = frontier_gap((np.array([2.0, 1.0, 1.5]), np.array([0.9, 0.5, 0.3])),
                             (np.array([1.0, 3.0]), np.array([0.4, 1.0])))
    assert (lo, hi) == (1.0, 2.0)
    grid = np.linspace(1, 2, GAP_GRID)
    exact = np.where(grid <= 1.5, 0.1 - 0.3 * (grid - 1), -0.05 + 0.5 * (grid - 1.5)).mean()
    assert g == pytest.approx(exact, abs=1e-12) and g == pytest.approx(0.05, abs=1e-3)
    # no overlap: a covers [1, 2], b [3, 4]
    g, lo, hi = frontier_gap((np.array([1.0, 2.0]), np.array([0.5, 0.6])), (np.array([3.0, 4.0]), np.array([0.5, 0.6])))
    assert math.isnan(g) and (lo, hi) == (3.0, 2.0)


def test_compare_paired_by_hand():
    a = {0: Interval(2.0), 1: Interval(2.5), 2: Interval(3.0)}
    b = {0: Interval(1.0), 1: Interval(1.2), 2: Interval(1.5)}
    c = compare_paired(a, b)
    d = np.array([1.0, 1.3, 1.5])
    half = student_t.ppf(0.975, 2) * d.std(ddof=1) / math.sqrt(3)
    tstat = d.mean() / (d.std(ddof=1) / math.sqrt(3))
    assert c["estimate"] == pytest.approx(d.mean()) and c["lo"] == pytest.approx(d.mean() - half)
    assert c["hi"] == pytest.approx(d.mean() + half) and c["n"] == 3
    assert c["p"] == pytest.approx(2 * student_t.sf(tstat, 2)) and c["word"] == "higher"
    # differences of both signs: the interval includes 0 -> undecided, whatever the mean
    c = compare_paired(a, {0: Interval(1.5), 1: Interval(2.9), 2: Interval(2.8)})
    assert c["lo"] < 0 < c["hi"] and c["word"] == "undecided"
    # one seed: from the two bootstrap intervals [a_lo − b_hi, a_hi − b_lo]
    c = compare_paired({0: Interval(2.0, 1.8, 2.2)}, {0: Interval(1.0, 0.9, 1.1)})
    assert (c["lo"], c["hi"]) == pytest.approx((0.7, 1.3)) and c["word"] == "higher" and math.isnan(c["p"])
    c = compare_paired({0: Interval(2.0, 1.8, 2.2)}, {0: Interval(1.9, 1.7, 2.1)})
    assert c["word"] == "undecided"
    c = compare_paired({0: Interval(2.0)}, {0: Interval(1.0)})  # one seed, no interval: never a direction
    assert c["word"] == "undecided" and c["method"] == "one seed, no interval"
    assert compare_paired({0: Interval(2.0)}, {1: Interval(1.0)})["word"] == "untestable"


def _figs() -> tuple[pl.DataFrame, dict]:
    """Three seeds of recurtrace, recurtrace_mem, recurtrace_flow and joint on task t, with known answers:
    memory lowers convergence depth by 1.0 ± 0.1 (decided), leaves the step cosine unchanged (exactly: zero spread,
    interval [0, 0]: undecided) and moves D@X by +0.3, −0.2, +0.1 (undecided); the decoupled head's frontier is 10
    points above the joint gate's at every depth (decided, higher); flow has 5 ± 1 points lower full-depth accuracy."""
    rows, fronts = [], {}
    base = {"recurtrace": (3.0, 0.5, 2.0, 0.99), "recurtrace_mem": (2.0, 0.5, 2.0, 0.99),
            "recurtrace_flow": (3.0, 0.5, 2.0, 0.94), "joint": (4.0, 0.2, 3.0, 0.98)}
    noise = {0: (0.1, 0.3, -0.01), 1: (0.0, -0.2, 0.0), 2: (-0.1, 0.1, 0.01)}
    for regime, (conv, cos, dx, acc) in base.items():
        for s in range(3):
            nc, nd, na = noise[s]
            m = f"t-{regime}-s{s}"
            rows.append({"model": m, "group": f"t-{regime}", "task": "t", "regime": regime,
                         "regime_kind": "joint" if regime == "joint" else "recurtrace", "role": regime, "seed": s,
                         "n_loops": 6, "conv_depth": conv + (nc if regime == "recurtrace_mem" else 0.0),
                         "step_cos": cos, "dx_best_posthoc": dx + (nd if regime == "recurtrace_mem" else 0.0),
                         "dx_best_posthoc_lo": math.nan, "dx_best_posthoc_hi": math.nan,
                         "full_depth_accuracy": acc + (na if regime == "recurtrace_flow" else 0.0),
                         "full_depth_accuracy_lo": math.nan, "full_depth_accuracy_hi": math.nan})
            d = np.array([1.0, 2.0, 4.0, 6.0])
            a = np.array([0.6, 0.8, 0.9, 0.95]) - (0.1 if regime == "joint" else 0.0)
            fronts[m] = (d, a)
    return pl.DataFrame(rows), fronts


def _table() -> pl.DataFrame:
    rows = [("t", "act", "act", "act_exit", 1.02, 1.00, 1.05, 3, 3, 0.55),
            ("t", "joint", "joint", "q_exit", 3.10, 2.50, 3.70, 3, 0, 0.97),
            ("u", "act", "act", "act_exit", 1.15, 1.05, 1.30, 3, 1, 0.60)]
    return pl.DataFrame([{"task": t, "regime": r, "regime_kind": k, "method": "native", "rules": ru, "loops": e,
                          "loops_lo": lo, "loops_hi": hi, "n_seeds": n, "n_collapsed": nc, "accuracy": acc,
                          "accuracy_lo": acc - 0.02, "accuracy_hi": acc + 0.02, "delta_matched": -0.01,
                          "delta_matched_lo": -0.03, "delta_matched_hi": 0.01}
                         for t, r, k, ru, e, lo, hi, n, nc, acc in rows])


def _router() -> pl.DataFrame:
    rows = []
    for s in range(3):
        # router deeper than kl_prev by 0.5, 0.6, 0.7 (decided: [FP] reproduced); vs argmax_stable +0.2, −0.3, +0.1
        for ba, dr in (("kl_prev", (0.5, 0.6, 0.7)[s]), ("argmax_stable", (0.2, -0.3, 0.1)[s])):
            rows.append({"scope": "model", "name": f"t-joint-s{s}", "task": "t", "regime_kind": "joint", "n_seeds": 1,
                         "router": "gate:logreg-converged", "baseline": ba, "router_depth": 3.0 + dr,
                         "router_depth_lo": 2.9 + dr, "router_depth_hi": 3.1 + dr, "baseline_depth": 3.0,
                         "baseline_depth_lo": 2.9, "baseline_depth_hi": 3.1, "router_accuracy": 0.98,
                         "baseline_accuracy": 0.98, "router_within_delta": True,
                         "baseline_within_delta": ba == "kl_prev", "outcome": "x"})
    rows.append({**rows[0], "scope": "group", "name": "t-joint", "n_seeds": 3})  # group rows are not re-used
    return pl.DataFrame(rows, schema=COMPARISON_SCHEMA)


def test_findings_with_known_answers():
    figs, fronts = _figs()
    rows = halting_findings(figs, fronts, _table(), _router(), DiagnoseConfig())
    by = {(r["question"], r["subject"], r["measure"]): r for r in rows}
    mem = {m: by[("memory", "t-recurtrace_mem vs t-recurtrace", m)] for m in ("conv_depth", "step_cos",
                                                                              "dx_best_posthoc")}
    assert mem["conv_depth"]["word"] == "lower" and mem["conv_depth"]["estimate"] == pytest.approx(-1.0)
    assert mem["conv_depth"]["n"] == 3 and 0 < mem["conv_depth"]["p"] < 0.01
    assert mem["step_cos"]["word"] == "equal"  # no difference at all: never "higher" or "lower"
    assert "no difference (equal in every seed)" in mem["step_cos"]["sentence"]
    assert mem["dx_best_posthoc"]["word"] == "undecided"
    assert "lower in t-recurtrace_mem" in mem["conv_depth"]["sentence"]
    assert "paired t over 3 seeds, p = " in mem["conv_depth"]["sentence"]
    hj = by[("head_vs_joint", "t-recurtrace vs t-joint", "native_gap")]
    assert hj["word"] == "higher" and hj["estimate"] == pytest.approx(0.1) and hj["n"] == 3
    assert "t-recurtrace's head is more accurate" in hj["sentence"] and "+10.0 [+10.0, +10.0] points" in hj["sentence"]
    flow = by[("flow", "t-recurtrace_flow vs t-recurtrace", "full_depth_accuracy")]
    assert flow["word"] == "lower" and flow["estimate"] == pytest.approx(-0.05)
    assert by[("flow", "t-recurtrace_flow vs t-recurtrace", "conv_depth")]["word"] == "equal"
    overall = by[("flow", "t-recurtrace_flow vs t-recurtrace", "overall")]
    assert overall["word"] == "differs" and overall["sentence"].startswith(
        "t: t-recurtrace_flow differs from t-recurtrace in full-depth test accuracy; no decided difference in mean "
        "convergence depth")
    col = {(r["task"], r["subject"]): r for r in rows if r["question"] == "collapse"}
    assert col[("t", "act")]["word"] == "collapses" and col[("t", "joint")]["word"] == "does not collapse"
    assert col[("u", "act")]["word"] == "undecided"  # [1.05, 1.30] straddles 1.1
    assert col[("u", "joint")]["word"] == "untestable"
    assert "exits at 1.02 [1.00, 1.05] mean loops (t over seeds, n = 3 seeds; 3 of them ≤ 1.1) at 55.0 % [53.0, 57.0] test " \
        "accuracy, Δ = -1.0 [-3.0, +1.0] points against fixed depth at the same mean loops: collapses" in \
        col[("t", "act")]["sentence"]
    rt = {r["subject"]: r for r in rows if r["question"] == "router"}
    kl = rt["t-joint: gate:logreg-converged vs kl_prev"]
    assert kl["word"] == "higher" and kl["estimate"] == pytest.approx(0.6) and "[FP]'s finding reproduced" in kl["sentence"]
    am = rt["t-joint: gate:logreg-converged vs argmax_stable"]
    assert am["word"] == "undecided" and "not at matched operating points" in am["sentence"]
    md = findings_markdown(rows, DiagnoseConfig())
    assert md.count("### ") == 5 and not re.search(r"\b(None|nan|inf)\b", md)


def test_findings_say_untestable_without_the_regimes():
    figs, fronts = _figs()
    rows = halting_findings(figs.filter(pl.col("role") == "joint"), fronts, None, None, DiagnoseConfig())
    assert {r["word"] for r in rows} == {"untestable"}
    assert any("no t-recurtrace" not in r["sentence"] and "no recurtrace_mem models" in r["sentence"] for r in rows)


def test_collapse_states_the_native_exit_first_and_the_calibrated_reading_labelled():
    """ACT's collapse is read at its own exit (N at 1 − ε); the same head at a val-chosen γ is a second, labelled
    sentence (here the two disagree: the tuned threshold collapses, the native exit does not)."""
    from looptrace.diagnose.halting_table import CALIBRATED

    base = _table().filter(pl.col("task") == "t")
    tuned = base.filter(pl.col("regime_kind") == "act").with_columns(method=pl.lit(CALIBRATED),
                                                                     rules=pl.lit("act_exit_calibrated"))
    native = base.filter(pl.col("regime_kind") == "act").with_columns(loops=pl.lit(2.4), loops_lo=pl.lit(1.8),
                                                                      loops_hi=pl.lit(3.0), n_collapsed=pl.lit(0, dtype=pl.Int64))
    table = pl.concat([tuned, native, base.filter(pl.col("regime_kind") == "joint")])
    rows = [r for r in collapse_rows(table, ["t"], 0.1) if r["subject"].startswith("act")]
    assert [(r["subject"], r["word"]) for r in rows] == [("act", "does not collapse"),
                                                        (f"act ({CALIBRATED})", "collapses")]
    assert rows[0]["sentence"].startswith("t: ACT (act, act_exit) exits at 2.40 [1.80, 3.00] mean loops")
    assert rows[1]["sentence"].startswith("t: ACT (act, act_exit_calibrated, γ calibrated on val) exits at 1.02")


def test_a_head_frontier_is_its_calibrated_rule_when_the_readouts_ran_it():
    from looptrace.diagnose.halting_findings import frontier_rule

    ops = pl.DataFrame({"rule": ["gate_step", "gate_step_calibrated", "gate_step_calibrated", "q_exit"]})
    assert frontier_rule(ops, "recurtrace") == "gate_step_calibrated"  # its grid of γ, not the one native point
    assert frontier_rule(ops.filter(pl.col("rule") != "gate_step_calibrated"), "recurtrace") == "gate_step"
    assert frontier_rule(ops, "joint") == "q_exit" and frontier_rule(ops, "geometric") is None
