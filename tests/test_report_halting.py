"""The report on the halting regimes: one colour per regime everywhere, the native exits told apart, the
halting table and the faithfulness tests as sections with intervals, "collapse" in words no stronger than the
interval."""

from __future__ import annotations

import math

import polars as pl
import pytest
from scipy.stats import t as student_t

from looptrace.report.fig_pareto import pareto_highlights
from looptrace.report.halting_section import collapse_text, faithfulness_groups, halting_rows
from looptrace.report.inputs import Inputs
from looptrace.report.page import halting_html
from looptrace.report.plotting import regime_colours

HALTING = ["geometric", "joint", "recurtrace", "recurtrace_flow", "recurtrace_mem", "act"]
KINDS = {"geometric": "geometric", "joint": "joint", "recurtrace": "recurtrace", "recurtrace_flow": "recurtrace",
         "recurtrace_mem": "recurtrace", "act": "act"}


def _meta(regimes, kinds=KINDS):
    return pl.DataFrame({"model": [f"t-{r}-s0" for r in regimes], "task": ["t"] * len(regimes), "regime": regimes,
                         "regime_kind": [kinds[r] for r in regimes], "n_loops": [6] * len(regimes)})


def test_regime_colours_distinct_and_stable():
    c = regime_colours(_meta(HALTING))
    assert len(set(c.values())) == len(HALTING)  # three recurtrace regimes of one kind: three colours
    assert c["geometric"] == "#2ca02c" and c["joint"] == "#d62728"  # the default regimes keep theirs
    # the same regime gets the same colour whatever else the run has, and whatever the order
    assert regime_colours(_meta(list(reversed(HALTING)))) == c
    assert regime_colours(_meta(["recurtrace_mem", "geometric"]))["recurtrace_mem"] == c["recurtrace_mem"]
    # regimes of one kind not named by the halting profile: the kind's colour once, then unused ones
    k = {"a": "recurtrace", "b": "recurtrace", "geometric": "geometric"}
    c2 = regime_colours(_meta(["a", "b", "geometric"], k))
    assert c2["a"] == "#9467bd" and len(set(c2.values())) == 3


def test_pareto_highlights_tell_native_exits_apart():
    kinds = {"fixed": "fixed", "q_exit": "native", "gate_step": "native", "act_exit": "native"}
    hl = pareto_highlights(None, kinds)
    assert hl["q_exit"] == ("native head, own exit of joint", "#d62728")
    assert hl["gate_step"][0] == "native head, own exit of recurtrace"
    assert hl["act_exit"][0] == "native head, own exit of act"
    assert len({c for _, c in hl.values()}) == len(hl)
    # the same heads at a val-calibrated γ: named so, each its own colour
    tuned = pareto_highlights(None, {**kinds, "gate_step_calibrated": "native", "act_exit_calibrated": "native"})
    assert tuned["gate_step_calibrated"][0] == "native head of recurtrace, γ calibrated on val"
    assert tuned["act_exit_calibrated"][0] == "native head of act, γ calibrated on val"
    assert len({c for _, c in tuned.values()}) == len(tuned)
    # one native rule (the default run): the label and colour as before
    assert pareto_highlights(None, {"fixed": "fixed", "q_exit": "native"})["q_exit"] == ("native gate", "#d62728")


@pytest.mark.parametrize("lo,hi,est,expect", [
    (1.00, 1.05, 1.02, "yes (3/3 seeds ≤ 1.1)"),
    (1.05, 1.30, 1.15, "undecided (3/3 seeds ≤ 1.1)"),
    (1.20, 1.60, 1.40, "no (3/3 seeds ≤ 1.1)"),
    (None, None, 1.05, "undecided (3/3 seeds ≤ 1.1)"),  # no interval: a mean ≤ 1.1 alone never says yes
])
def test_collapse_words_follow_the_interval(lo, hi, est, expect):
    r = {"collapsed": est <= 1.1, "loops": est, "loops_lo": lo, "loops_hi": hi, "n_collapsed": 3, "n_seeds": 3}
    assert collapse_text(r, 0.1) == expect
    assert collapse_text({**r, "collapsed": None}, 0.1) == "—"


def _table() -> pl.DataFrame:
    return pl.DataFrame([
        {"task": "t", "regime": "act", "regime_kind": "act", "source": "Graves 2016 (ACT)", "method": "native",
         "rules": "act_exit", "n_seeds": 3, "accuracy": 0.55, "accuracy_lo": 0.5, "accuracy_hi": 0.6, "loops": 1.02,
         "loops_lo": 1.0, "loops_hi": 1.05, "delta_matched": 0.01, "delta_matched_lo": -0.02,
         "delta_matched_hi": 0.04, "collapsed": True, "n_collapsed": 3},
        {"task": "t", "regime": "act", "regime_kind": "act", "source": "Graves 2016 (ACT)", "method": "fixed 1",
         "rules": "fixed", "n_seeds": 3, "accuracy": 0.5, "accuracy_lo": 0.48, "accuracy_hi": 0.52, "loops": 1.0,
         "loops_lo": 1.0, "loops_hi": 1.0, "delta_matched": 0.0, "delta_matched_lo": 0.0, "delta_matched_hi": 0.0,
         "collapsed": None, "n_collapsed": None}])


def _faith() -> pl.DataFrame:
    rows = []
    for s, (sv, p) in enumerate(((0.10, 1e-5), (0.12, 1e-3))):
        rows.append({"model": f"t-joint-s{s}", "task": "t", "regime": "joint", "regime_kind": "joint",
                     "source": "readouts", "rule": "q_exit", "kind": "native", "mean_depth": 3.0 + s, "saving": sv,
                     "saving_lo": sv - 0.02, "saving_hi": sv + 0.02, "saving_vs_reverse": 2 * sv,
                     "saving_vs_reverse_lo": 2 * sv - 0.03, "saving_vs_reverse_hi": 2 * sv + 0.03, "pvalue": p,
                     "verdict": "faithful"})
    return pl.DataFrame(rows)


def test_faithfulness_groups_over_seeds():
    g = faithfulness_groups(_faith()).row(0, named=True)
    half = student_t.ppf(0.975, 1) * (0.02 / math.sqrt(2)) / math.sqrt(2)  # sd of (0.10, 0.12) = 0.02 / √2
    assert g["n_seeds"] == 2 and g["verdicts"] == "faithful × 2"
    assert g["saving"] == pytest.approx(0.11) and g["saving_lo"] == pytest.approx(0.11 - half)
    assert g["p_max"] == pytest.approx(1e-3) and g["mean_depth"] == pytest.approx(3.5)


def test_halting_sections_on_the_page():
    inp = Inputs(meta=_meta(["act"]), halting_table=_table(), faithfulness=_faith(), collapse_tol=None)
    page = "\n".join(halting_html(inp))
    assert "<h2>Halting methods at matched compute</h2>" in page
    assert "<td>55.0 [50.0, 60.0]</td>" in page and "<td>1.02 [1.00, 1.05]</td>" in page
    assert "<td>yes (3/3 seeds ≤ 1.1)</td>" in page and "<td>1.0 [-2.0, 4.0]</td>" in page
    assert "<h2>Counterfactual faithfulness of halting signals</h2>" in page and "faithful × 2" in page
    assert not halting_html(Inputs(meta=_meta(["act"])))  # neither output: no section
    rows = halting_rows(_table(), 0.5)
    assert rows["collapse_text"].to_list() == ["yes (3/3 seeds ≤ 1.5)", "—"]
