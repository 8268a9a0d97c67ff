"""Loop-map diagnoses (SPEC §2b): the certified bound on closed-form linear loop maps, the certified exit, the regime
in words, failure AUCs against scikit-learn, and the whole report on a tiny model's contraction dump."""

import math

import numpy as np
import polars as pl
import pytest
from sklearn.metrics import roc_auc_score

from looptrace.config import InputError
from looptrace.diagnose.loopmap import (
    LoopMapConfig,
    certified_bound,
    certified_exit,
    certified_frontier,
    failure_auc,
    loopmap_report,
    regime,
)


def _linear_trajectory(A, c, h0, T):
    hs = [h0]
    for _ in range(T):
        hs.append(A @ hs[-1] + c)
    return np.array(hs)  # [T + 1, d]


def _rel_step(hs):
    d = np.linalg.norm(hs[1:] - hs[:-1], axis=1)
    return d / np.linalg.norm(hs[1:], axis=1)


def test_the_bound_holds_on_every_step_of_a_linear_contraction():
    rng = np.random.default_rng(0)
    for _ in range(20):
        A = rng.standard_normal((5, 5))
        A *= rng.uniform(0.2, 0.95) / np.linalg.norm(A, 2)  # ‖A‖₂ < 1: a contraction in the 2-norm
        c, h0 = rng.standard_normal(5), 3 * rng.standard_normal(5)
        hs = _linear_trajectory(A, c, h0, 30)
        h_star = np.linalg.solve(np.eye(5) - A, c)
        rho = np.full((1, 30), np.linalg.norm(A, 2))
        b = certified_bound(rho, _rel_step(hs)[None])[0]
        true = np.linalg.norm(hs[1:] - h_star, axis=1) / np.linalg.norm(hs[1:], axis=1)
        assert np.all(b >= true * (1 - 1e-9) - 1e-14), (b - true).min()  # (rounding once h_t reaches h*)


def test_the_bound_is_tight_for_a_scaled_identity():
    q = 0.6
    A, c, h0 = q * np.eye(3), np.array([1.0, -2.0, 0.5]), np.array([4.0, 1.0, -3.0])
    hs = _linear_trajectory(A, c, h0, 12)
    h_star = c / (1 - q)
    b = certified_bound(np.full((1, 12), q), _rel_step(hs)[None])[0]
    true = np.linalg.norm(hs[1:] - h_star, axis=1) / np.linalg.norm(hs[1:], axis=1)
    np.testing.assert_allclose(b, true, rtol=1e-9)


def test_no_certificate_without_contraction_and_the_exit_is_the_first_hit():
    rho = np.array([[1.2, 0.5, 0.5, 0.5], [np.nan, 1.0, 2.0, 3.0]])
    rel = np.array([[0.01, 1.0, 0.05, 0.001], [0.0, 0.0, 0.0, 0.0]])
    b = certified_bound(rho, rel)
    assert np.isnan(b[0, 0]) and np.isnan(b[1]).all()  # ρ ≥ 1 (or unknown): never certified
    np.testing.assert_allclose(b[0, 1:], [1.0, 0.05, 0.001])
    np.testing.assert_array_equal(certified_exit(b, 0.05), [3, 4])  # the second token never fires: T
    correct = np.array([[0, 0, 1, 1], [1, 1, 1, 0]], dtype=bool)
    fr = certified_frontier(b, correct, [0.05])
    assert fr.row(0, named=True) == {"eps": 0.05, "mean_depth": 3.5, "accuracy": 0.5, "share_certified": 0.5}


def test_regime_words():
    seq = np.repeat(np.arange(40), 3)
    cfg = LoopMapConfig(n_boot=200)
    rng = np.random.default_rng(1)
    con = regime(np.repeat(-0.5 + 0.01 * rng.standard_normal(40), 3), np.full((120, 4), 0.5), seq, cfg)
    assert con["regime"] == "contracting" and con["ftle_hi"] < -0.4 and con["share_rho_below_1"] == 1.0
    exp = regime(np.repeat(0.3 + 0.01 * rng.standard_normal(40), 3), np.full((120, 4), 1.5), seq, cfg)
    assert exp["regime"] == "expanding" and "chaotic" in exp["words"] and exp["share_rho_below_1"] == 0.0
    mar = regime(np.repeat(0.05 * rng.standard_normal(40), 3), np.full((120, 4), 0.9), seq, cfg)
    assert mar["regime"] == "marginal" and "neither clearly" in mar["words"]
    # λ_T clearly < 0 but ρ_t ≥ 1 on 3 of 4 loops: marginal, said as contracting over T loops, not loop by loop
    rho = np.tile([0.5, 1.5, 1.5, 1.5], (120, 1))
    glob = regime(np.repeat(-0.5 + 0.01 * rng.standard_normal(40), 3), rho, seq, cfg)
    assert glob["regime"] == "marginal" and glob["share_rho_below_1"] == 0.25
    assert "contracts over the T loops (λ_T < 0) but not loop by loop" in glob["words"]
    assert con["ftle_lo"] <= con["ftle_median"] <= con["ftle_hi"]


def test_failure_auc_equals_sklearn_and_has_an_interval():
    rng = np.random.default_rng(2)
    n, T = 200, 4
    correct = rng.random((n, T)) < 0.6
    correct[:20] = False  # trajectory failures
    score = rng.standard_normal(n) + 2.0 * ~correct.any(axis=1)
    seq = np.arange(n) // 2
    out = failure_auc({"s": score}, correct, seq, LoopMapConfig(n_boot=200))
    row = out.filter(out["failure"] == "trajectory").row(0, named=True)
    assert row["auc"] == pytest.approx(roc_auc_score(~correct.any(axis=1), score))
    assert row["auc_lo"] <= row["auc"] <= row["auc_hi"] and row["n_pos"] == int((~correct.any(axis=1)).sum())
    rd = out.filter(out["failure"] == "readout").row(0, named=True)
    inc = correct.any(axis=1)
    want = roc_auc_score((inc & ~correct[:, -1])[inc], score[inc])
    assert rd["auc"] == pytest.approx(want)
    # fewer failures than min_class: no AUC (one failure's bootstrap interval is falsely narrow), n_pos still given
    n_traj = row["n_pos"]
    few = failure_auc({"s": score}, correct, seq, LoopMapConfig(n_boot=20, min_class=n_traj + 1))
    fr = few.filter(few["failure"] == "trajectory").row(0, named=True)
    assert math.isnan(fr["auc"]) and math.isnan(fr["auc_lo"]) and fr["n_pos"] == n_traj
    ok = failure_auc({"s": score}, correct, seq, LoopMapConfig(n_boot=20, min_class=n_traj))
    assert ok.filter(ok["failure"] == "trajectory")["auc"][0] == pytest.approx(row["auc"])


def test_report_on_a_tiny_contraction_dump():
    from looptrace.capture.contraction import ContractionConfig
    from looptrace.capture.dump import DumpConfig, dump_split
    from looptrace.io.store.location import memory_store
    from tests.builders import tiny_adapter_and_data

    adapter, data = tiny_adapter_and_data(n_seq=12, unscored=False, gate="none")
    st = dump_split(adapter, data, memory_store(),
                    DumpConfig(batch_size=6, chunk_tokens=32, contraction=ContractionConfig(power_iters=2)))
    rep = loopmap_report(st, LoopMapConfig(n_boot=200))
    rho = st.read("contraction")
    assert rep["regime"]["share_rho_below_1"] == pytest.approx(float((rho < 1).mean()))
    assert rep["regime"]["regime"] in ("contracting", "marginal", "expanding")
    assert rep["frontier"].height == len(LoopMapConfig().eps) and rep["auc"].height == 8
    assert len(rep["words"]) == 4 and "FTLE" in rep["words"][0]
    assert rep["certified"] and "certified fixed-point exit" in rep["words"][1]
    np.testing.assert_allclose(  # the frontier of the certified exit: from the stored upper bound
        rep["frontier"]["share_certified"].to_numpy(),
        [float((certified_bound(st.read("contraction_bound"), _store_rel_step(st)) <= e).any(axis=1).mean())
         for e in LoopMapConfig().eps])
    plain = dump_split(adapter, data, memory_store(), DumpConfig(batch_size=6, chunk_tokens=32))
    with pytest.raises(InputError, match="dump.contraction"):
        loopmap_report(plain)
    # wider than exact_width: no upper bound stored (NaN), the exit is the estimated one, said so
    wide = dump_split(adapter, data, memory_store(), DumpConfig(batch_size=6, chunk_tokens=32, contraction=(
        ContractionConfig(power_iters=2, exact_width=8))))
    rep = loopmap_report(wide, LoopMapConfig(n_boot=0))
    assert not rep["certified"] and np.isnan(wide.read("contraction_bound")).all()
    assert rep["words"][1].startswith("No certified fixed-point exit") and "estimated" in rep["words"][1]


def _store_rel_step(st):
    from looptrace.signals.steps import step_metrics

    return step_metrics(st.read("hidden"), st.read("hidden_init"))["rel_step"]


def test_auc_sentences_best_first_or_why_not():
    from looptrace.diagnose.loopmap import auc_sentences

    nan = float("nan")
    auc = pl.DataFrame({"failure": ["trajectory", "trajectory", "readout", "readout"],
                        "predictor": ["ftle", "entropy", "ftle", "entropy"],
                        "auc": [0.71, 0.98, nan, nan], "auc_lo": [0.6, 0.95, nan, nan], "auc_hi": [0.85, 0.99, nan, nan],
                        "n_pos": [8, 8, 2, 2], "n_neg": [250, 250, 259, 259]})
    assert auc_sentences(auc, 5) == [
        "AUC for trajectory failures (8 on the sample), best first: entropy 0.98 [0.95, 0.99], ftle 0.71 [0.60, 0.85].",
        "No AUC for readout failures: 2 on the sample, fewer than the 5 each class needs (loopmap.min_class)."]
