"""The halting methods' matched-compute table (``looptrace.diagnose.halting_table``) on synthetic
readouts outputs of two seeds: fixed depths, the regime's own native exit, the best post-hoc rule chosen on val,
the matched-fixed-depth Δ (linear between ⌊d⌋ and ⌈d⌉) and the across-seed Student-t intervals, by hand."""

from __future__ import annotations

import math

import numpy as np
import polars as pl
import pytest
from scipy.stats import t as student_t

from looptrace.diagnose.halting_table import halting_table, halting_table_markdown, matched_fixed_accuracy
from looptrace.estimates import DEFAULT_RESOLUTION
from looptrace.io.artifacts import write_outputs


def _readouts(root, model, kind, fixed_acc, rows):
    """``readouts/<model>/``: fixed-depth test points at ``fixed_acc`` and chosen points ``rows``
    (rule, kind, val_depth, test_depth, test_accuracy)."""
    T = len(fixed_acc)
    ops = pl.DataFrame({"rule": ["fixed"] * T, "kind": ["fixed"] * T, "threshold": [float(k) for k in range(1, T + 1)],
                        "split": ["test"] * T, "mean_depth": [float(k) for k in range(1, T + 1)],
                        "accuracy": fixed_acc, "accuracy_lo": [a - 0.01 for a in fixed_acc],
                        "accuracy_hi": [a + 0.01 for a in fixed_acc]})
    chosen = pl.DataFrame([{"rule": r, "kind": k, "val_depth": vd, "val_accuracy": 0.99, "within_delta": True,
                            "test_depth": td, "test_depth_lo": td - 0.1, "test_depth_hi": td + 0.1,
                            "test_accuracy": ta, "test_accuracy_lo": ta - 0.02, "test_accuracy_hi": ta + 0.02}
                           for r, k, vd, td, ta in rows])
    write_outputs(root / model, {"operating_points": ops, "chosen": chosen},
                  {"task": "rp", "regime": model.split("-")[1], "regime_kind": kind, "n_loops": T})


def test_matched_fixed_accuracy_interpolates_between_depths():
    acc = np.array([0.5, 0.7, 0.9])
    assert matched_fixed_accuracy(acc, 1.0) == 0.5 and matched_fixed_accuracy(acc, 3.0) == 0.9
    assert math.isclose(matched_fixed_accuracy(acc, 1.25), 0.75 * 0.5 + 0.25 * 0.7)
    assert matched_fixed_accuracy(acc, 0.5) == 0.5 and matched_fixed_accuracy(acc, 7.0) == 0.9  # clipped to [1, T]


def test_halting_table_hand_case(tmp_path):
    fixed = ([0.5, 0.7, 0.9], [0.6, 0.8, 0.95])
    # seed 0: native (gate_step) at 1.5 loops, 0.85; post-hoc: top1 (val 1.2) beats entropy (val 1.4)
    _readouts(tmp_path, "rp-recurtrace-s0", "recurtrace", fixed[0],
              [("gate_step", "native", 1.6, 1.5, 0.85), ("q_exit", "native", 1.0, 1.0, 0.5),
               ("top1", "posthoc", 1.2, 1.25, 0.8), ("entropy", "posthoc", 1.4, 1.3, 0.9)])
    _readouts(tmp_path, "rp-recurtrace-s1", "recurtrace", fixed[1],
              [("gate_step", "native", 2.1, 2.0, 0.9), ("q_exit", "native", 1.0, 1.0, 0.6),
               ("top1", "posthoc", 1.5, 1.5, 0.85), ("entropy", "posthoc", 1.1, 1.05, 0.7),
               ("calm", "posthoc", 2.5, 2.4, 0.93)])  # CALM run on this seed only: its own row, one seed
    _readouts(tmp_path, "rp-act-s0", "act", fixed[0], [("act_exit", "native", 1.0, 1.04, 0.5),
                                                       ("top1", "posthoc", 1.0, 1.0, 0.5)])
    t = halting_table(["rp-recurtrace-s0", "rp-recurtrace-s1", "rp-act-s0"], tmp_path, None, collapse_tol=0.1)
    rt = t.filter(pl.col("regime") == "recurtrace")
    assert rt["method"].to_list() == ["fixed 1", "fixed 2", "fixed 3", "native", "best post-hoc", "CALM"]
    calm = rt.filter(pl.col("method") == "CALM").row(0, named=True)
    # one seed: its own test point and bootstrap interval; Δ against fixed at 2.4 loops = 0.6·0.8 + 0.4·0.95
    assert calm["rules"] == "calm" and calm["n_seeds"] == 1 and calm["loops"] == pytest.approx(2.4)
    assert calm["accuracy_lo"] == pytest.approx(0.91) and calm["delta_matched"] == pytest.approx(0.93 - 0.86)
    nat = rt.filter(pl.col("method") == "native").row(0, named=True)
    assert nat["rules"] == "gate_step" and nat["n_seeds"] == 2 and nat["source"] == "[RT]"
    tq = student_t.ppf(0.975, 1)

    def t_iv(a, b):
        m, half = (a + b) / 2, tq * abs(a - b) / math.sqrt(2) / math.sqrt(2)  # sd of two values = |a − b| / √2
        return m, m - half, m + half

    def logit_iv(a, b, lo_end, hi_end):  # the t-interval on the logit scale of the range, mapped back
        p = (np.array([a, b]) - lo_end) / (hi_end - lo_end)
        z = np.log(p / (1 - p))
        half = tq * z.std(ddof=1) / math.sqrt(2)
        q = [1 / (1 + math.exp(-(z.mean() + s * half))) for s in (-1, 1)]
        # a bound within the resolution of a range's end is that end (intervals.DEFAULT_RESOLUTION: n unknown here)
        q = [0.0 if x <= DEFAULT_RESOLUTION else 1.0 if x >= 1 - DEFAULT_RESOLUTION else x for x in q]
        back = [lo_end + (hi_end - lo_end) * x for x in q]
        m = (a + b) / 2
        return m, min(back[0], m), max(back[1], m)

    for col, (m, lo, hi) in (("accuracy", logit_iv(0.85, 0.9, 0.0, 1.0)), ("loops", logit_iv(1.5, 2.0, 1.0, 3.0)),
                             # fixed at 1.5 = (0.5+0.7)/2; at 2.0 = 0.8; a difference has no range: the plain t
                             ("delta_matched", t_iv(0.85 - 0.6, 0.9 - 0.8))):
        assert nat[col] == pytest.approx(m) and nat[f"{col}_lo"] == pytest.approx(lo)
        assert nat[f"{col}_hi"] == pytest.approx(hi)
    post = rt.filter(pl.col("method") == "best post-hoc").row(0, named=True)
    assert post["rules"] == "top1,entropy"  # chosen on val per seed: top1 (1.2 < 1.4), entropy (1.1 < 1.5)
    assert post["loops"] == pytest.approx((1.25 + 1.05) / 2) and not post["collapsed"] and post["n_collapsed"] == 1
    f2 = rt.filter(pl.col("method") == "fixed 2").row(0, named=True)
    assert f2["loops"] == 2.0 and f2["accuracy"] == pytest.approx(0.75) and f2["delta_matched"] == 0.0
    act = t.filter((pl.col("regime") == "act") & (pl.col("method") == "native")).row(0, named=True)
    assert act["rules"] == "act_exit" and act["collapsed"] and act["n_collapsed"] == 1  # 1.04 ≤ 1.1
    assert act["accuracy_lo"] == pytest.approx(0.48)  # one seed: its bootstrap interval
    md = halting_table_markdown(t, 0.1)
    assert "| rp | act (Graves 2016 (ACT)) | native | act_exit | 50.0 [48.0, 52.0] | 1.04 [0.94, 1.14] |" in md


def test_fixed_rows_have_no_collapse_flag(tmp_path):
    _readouts(tmp_path, "rp-geometric-s0", "geometric", [0.5, 0.9], [("top1", "posthoc", 1.0, 1.0, 0.5)])
    t = halting_table(["rp-geometric-s0"], tmp_path, None)
    assert t.filter(pl.col("method") == "fixed 1")["collapsed"].to_list() == [None]
    assert t.filter(pl.col("method") == "best post-hoc")["collapsed"].to_list() == [True]
    assert "| fixed 1 | fixed | 50.0 [49.0, 51.0] | 1.00 [1.00, 1.00] | 0.0 | — |" in halting_table_markdown(t, 0.1)
