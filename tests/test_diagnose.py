"""Failure localisation, Spearman, verdicts and the [AD] claims (pipeline/diagnose.py)."""

from __future__ import annotations

import json
import math

import numpy as np
import polars as pl
import pytest
from looptrace import diagnose as D
from looptrace.config import ConfigError, from_dict
from looptrace.io.artifacts import write_outputs
from looptrace.io.tables import SplitArrays
from looptrace.project import resolve_model
from looptrace.rules.evaluate import ReadoutsConfig, readouts_model
from looptrace.rules.scoring import CalibrationConfig, evaluate_rule, result_frames
from looptrace.testing import token_loop_splits, write_token_loop
from scipy.stats import rankdata

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
    codes = D.failure_codes(exits, correct)
    np.testing.assert_array_equal(codes, [0, 1, 2, 3, 3, 2, 1, 0])
    diff = np.array([0, 0, 0, 1, 1, 1, 1, 2])
    rows = {(r["group"], r["difficulty"]): r for r in D.failure_rows(codes, exits, diff)}
    assert set(rows) == {("all", None), ("difficulty", 0), ("difficulty", 1), ("difficulty", 2)}
    a = rows[("all", None)]
    assert (a["correct"], a["trajectory"], a["readout_early"], a["readout_overthinking"]) == (2, 2, 2, 2)
    d1 = rows[("difficulty", 1)]
    assert (d1["n_tokens"], d1["correct"], d1["trajectory"], d1["readout_early"], d1["readout_overthinking"]) == \
        (4, 0, 1, 1, 2)
    assert d1["frac_readout_overthinking"] == 0.5 and d1["exit_depth_mean"] == pytest.approx(13 / 4)
    for r in rows.values():
        assert sum(r[c] for c in D.CLASSES) == r["n_tokens"]
    with pytest.raises(ValueError, match="1..4"):
        D.failure_codes(np.array([0, 1, 1, 1, 1, 1, 1, 1]), correct)


def test_spearman_rows():
    rng = np.random.default_rng(0)
    diff = rng.integers(0, 4, 200)
    T = 3
    sig = np.stack([diff + rng.normal(0, 1, 200), -diff + rng.normal(0, 0.1, 200), rng.normal(0, 1, 200)], 1)
    sig[:7, 0] = np.nan
    rows = D.spearman_rows(diff, {"s": sig, "scalar": diff * 2.0})
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
    assert math.isnan(D.spearman_rows(diff, {"c": np.ones(200)})[0]["rho"])


def _tables(fixed, posthoc, gate=None, native=None, oracle=(1.0, 0.99), x=95.0, dx=None, within=True):
    rows = [("fixed", "fixed", "readouts", fixed), ("entropy", "posthoc", "readouts", posthoc)]
    if gate is not None:
        rows.append(("gate:m-ponder", "gate", "gates", gate))
    if native is not None:
        rows.append(("q_exit", "native", "readouts", native))
    chosen = pl.DataFrame({"rule": [r[0] for r in rows], "kind": [r[1] for r in rows], "source": [r[2] for r in rows],
                           "test_depth": [float(r[3]) for r in rows], "test_accuracy": [0.96] * len(rows),
                           "within_delta": [within] * len(rows)})
    dxv = dx or {}
    dxf = pl.DataFrame({"rule": [r[0] for r in rows], "kind": [r[1] for r in rows], "source": [r[2] for r in rows],
                        "x": [x] * len(rows), "d_at": [float(dxv.get(r[0], math.nan)) for r in rows]})
    fails = pl.DataFrame({"rule": ["entropy"], "group": ["all"], "n_tokens": [100], "correct": [90], "trajectory": [6],
                          "readout_early": [3], "readout_overthinking": [1]})
    return chosen, dxf, {"depth": oracle[0], "accuracy": oracle[1]}, fails


@pytest.mark.parametrize("case,expect", [
    (dict(fixed=4.0, posthoc=3.8), ("trajectory-limited", "no_early_exit")),
    (dict(fixed=4.0, posthoc=2.0, native=3.5), ("readout-limited", "native_gate")),
    (dict(fixed=4.0, posthoc=2.0, oracle=(1.2, 0.99)), ("readout-limited", "below_ceiling")),
    (dict(fixed=4.0, posthoc=2.0, oracle=(1.7, 0.99)), ("trajectory-limited", "at_ceiling")),
    (dict(fixed=4.0, posthoc=3.9, gate=1.8, oracle=(1.6, 0.99)), ("trajectory-limited", "at_ceiling")),
])
def test_verdict_cases(case, expect):
    chosen, dx, oracle, fails = _tables(**case)
    v = D.verdict({"model": "m", "regime_kind": "uniform", "n_loops": 6}, chosen, dx, oracle, fails, D.DiagnoseConfig())
    assert (v["verdict"], v["reason"]) == expect
    assert v["best_depth"] == min(case["posthoc"], case.get("gate", math.inf))
    # errors at the best rule's point: 6 of 10 trajectory, 4 of 10 readout (only entropy has failure rows)
    if v["best_rule"] == "entropy":
        assert v["error_trajectory_share"] == pytest.approx(0.6) and v["error_readout_share"] == pytest.approx(0.4)
        assert "60% trajectory failures" in v["evidence"]
    assert f"{v['best_depth']:.2f}" in v["evidence"] and f"{case['fixed']:.2f}" in v["evidence"]


def _dx(rows):
    return pl.DataFrame(rows, schema={"model": pl.String, "rule": pl.String, "kind": pl.String, "x": pl.Float64,
                                      "d_at": pl.Float64}, orient="row")


META = pl.DataFrame({"model": ["t-uniform", "t-geometric", "t-joint"], "task": ["t", "t", "t"],
                     "regime": ["uniform", "geometric", "joint"], "regime_kind": ["uniform", "geometric", "joint"]})


def test_ad_claims_hold_and_sentences():
    dx = _dx([
        ("t-uniform", "fixed", "fixed", 95, 3.0), ("t-uniform", "top1", "posthoc", 95, 1.4),
        ("t-uniform", "entropy", "posthoc", 95, 1.6), ("t-uniform", "kl_prev", "posthoc", 95, 1.2),
        ("t-uniform", "gate:t-uniform-ponder", "gate", 95, 1.5),
        ("t-geometric", "fixed", "fixed", 95, 2.5), ("t-geometric", "margin", "posthoc", 95, 1.3),
        ("t-geometric", "gate:t-geometric-ponder", "gate", 95, 1.4),
        ("t-joint", "fixed", "fixed", 95, 4.0), ("t-joint", "q_exit", "native", 95, 4.5),
        ("t-joint", "entropy", "posthoc", 95, 3.9), ("t-joint", "gate:t-joint-ponder", "gate", 95, 3.8),
        ("t-uniform", "fixed", "fixed", 98, 1.0),  # other X: ignored
    ])
    claims = {c["claim"]: c for c in D.ad_claims(META, dx, D.DiagnoseConfig(), gates_present=True)}
    assert [claims[k]["status"] for k in "abc"] == ["holds", "holds", "holds"]
    a = claims["a"]["sentences"]
    # confidence rules only (kl_prev 1.2 is not a confidence readout): top1 1.40 on uniform
    assert "t-uniform: best confidence readout (top1) D@95 = 1.40, lower than fixed depth D@95 = 3.00." in a
    assert "t-geometric: best confidence readout (margin) D@95 = 1.30, lower than fixed depth D@95 = 2.50." in a
    b = claims["b"]["sentences"][1]
    # best post-hoc over fixed-prior models of the task: kl_prev 1.20 on t-uniform (any post-hoc rule)
    assert b.startswith("t-joint: native Q-exit D@95 = 4.50, worse than the best post-hoc readout on a fixed-prior "
                        "trajectory (kl_prev on t-uniform: 1.20)")
    c = " ".join(claims["c"]["sentences"])
    assert "t-joint (joint): best refit gate (gate:t-joint-ponder) D@95 = 3.80 vs fixed 4.00 — weak" in c
    assert "t-uniform (uniform): best refit gate (gate:t-uniform-ponder) D@95 = 1.50 vs fixed 3.00 — strong" in c


def test_ad_claims_disagreement_and_untestable():
    dx = _dx([
        ("t-uniform", "fixed", "fixed", 95, 2.0), ("t-uniform", "entropy", "posthoc", 95, 2.5),  # worse than fixed
        ("t-geometric", "fixed", "fixed", 95, 2.0), ("t-geometric", "top1", "posthoc", 95, 1.5),
        ("t-joint", "fixed", "fixed", 95, math.nan), ("t-joint", "q_exit", "native", 95, math.nan),
    ])
    claims = {c["claim"]: c for c in D.ad_claims(META, dx, D.DiagnoseConfig(), gates_present=False)}
    assert claims["a"]["status"] == "partly"
    assert "t-uniform: best confidence readout (entropy) D@95 = 2.50, not lower than fixed depth D@95 = 2.00." \
        in claims["a"]["sentences"]
    # native unreachable (NaN = ∞) vs post-hoc 1.5 -> the native gate is worse: holds
    assert claims["b"]["status"] == "holds"
    assert claims["b"]["sentences"][1] == (
        "t-joint: native Q-exit D@95 = unreachable, worse than the best post-hoc readout on a fixed-prior trajectory "
        "(top1 on t-geometric: 1.50); no post-hoc readout reaches D@95 on its own joint trajectory.")
    assert claims["c"]["status"] == "untestable" and "Not tested" in claims["c"]["sentences"][0]
    # only uniform confidence fails and nothing else fixed-prior: does not hold
    dx2 = dx.filter(pl.col("model") != "t-geometric")
    claims = {c["claim"]: c for c in D.ad_claims(META.filter(pl.col("model") != "t-geometric"), dx2,
                                                  D.DiagnoseConfig(), False)}
    assert claims["a"]["status"] == "does not hold"
    # no joint model: (b) untestable
    claims = {c["claim"]: c for c in D.ad_claims(META.filter(pl.col("regime_kind") != "joint"), dx,
                                                  D.DiagnoseConfig(), False)}
    assert claims["b"]["status"] == "untestable" and "no jointly trained model" in claims["b"]["sentences"][0]


def test_ad_claim_b_compares_a_joint_model_with_fixed_prior_models_of_its_own_seed():
    """Seeded names: t-joint-s1's peers are t-uniform-s1 only, even though t-uniform-s0 has the lower depth."""
    meta = pl.DataFrame({"model": ["t-uniform-s0", "t-uniform-s1", "t-joint-s1"], "task": ["t"] * 3,
                         "regime": ["uniform", "uniform", "joint"], "regime_kind": ["uniform", "uniform", "joint"]})
    dx = _dx([("t-uniform-s0", "top1", "posthoc", 95, 1.1), ("t-uniform-s1", "top1", "posthoc", 95, 1.7),
              ("t-joint-s1", "q_exit", "native", 95, 2.0)])
    claims = {c["claim"]: c for c in D.ad_claims(meta, dx, D.DiagnoseConfig(), gates_present=False)}
    (det,) = claims["b"]["details"]
    assert det["fixed_prior_model"] == "t-uniform-s1" and det["fixed_prior_posthoc_dx"] == pytest.approx(1.7)


def test_summary_markdown_from_numbers():
    chosen, dx, oracle, fails = _tables(fixed=4.0, posthoc=2.25, native=3.75, oracle=(1.5, 0.97))
    v = D.verdict({"model": "t-joint", "regime_kind": "joint", "n_loops": 6}, chosen, dx, oracle,
                  fails.with_columns(model=pl.lit("t-joint")), D.DiagnoseConfig())
    verdicts = pl.DataFrame([v])
    sp = pl.DataFrame({"model": ["t-joint", "t-joint"], "signal": ["entropy", "entropy"], "loop": [None, 1],
                       "aggregation": ["difficulty_mean", "difficulty_mean"], "rho": [0.875, 0.1], "pvalue": [0.1, 0.2],
                       "n": [4, 4]}, schema_overrides={"loop": pl.Int64})
    claims = D.ad_claims(META.filter(pl.col("model") == "t-joint"), dx.with_columns(model=pl.lit("t-joint")),
                         D.DiagnoseConfig(), gates_present=False)
    failures = fails.with_columns(model=pl.lit("t-joint"), frac_correct=pl.lit(0.9), frac_trajectory=pl.lit(0.06),
                                  frac_readout_early=pl.lit(0.03), frac_readout_overthinking=pl.lit(0.01))
    md = D.summary_markdown(verdicts, claims, sp, D.DiagnoseConfig(), failures)
    assert "| t-joint | joint | readout-limited | entropy (2.25) | 4.00 | 3.75 | 1.50 |" in md
    assert "the native gate needs 3.75" in md
    assert "- t-joint (joint): ρ = 0.88 (n = 4 difficulty levels)." in md  # loop null row, not loop 1
    assert "| t-joint | entropy | 90.0 | 6.0 | 3.0 | 1.0 |" in md
    assert "(a) [AD]" in md and "untestable — no fixed-prior (uniform/geometric) model in this run" in md
    cfg1 = D.DiagnoseConfig(spearman_loop=1)
    assert "ρ = 0.10 (n = 4 difficulty levels)" in D.summary_markdown(verdicts, claims, sp, cfg1)


def test_config_validation():
    with pytest.raises(ConfigError, match="unknown key"):
        from_dict(D.DiagnoseConfig, {"gap": 1}, "diagnose")
    with pytest.raises(ConfigError, match="spearman_aggregation"):
        from_dict(D.DiagnoseConfig, {"spearman_aggregation": "mean"}, "diagnose")
    with pytest.raises(ConfigError, match="spearman_headline"):
        from_dict(D.DiagnoseConfig, {"spearman_headline": "nope"}, "diagnose")


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
    frames = result_frames([r])
    write_outputs(root / model, frames, {"model": model})


def test_diagnose_end_to_end(tmp_path, repo_root):
    from looptrace.cli import app
    from typer.testing import CliRunner

    models = ["running_parity-uniform", "running_parity-geometric", "running_parity-joint"]
    train_meta = {"running_parity": None}
    regimes = {"uniform": {"kind": "uniform"}, "geometric": {"kind": "geometric"}, "joint": {"kind": "joint"}}
    for i, m in enumerate(models):
        splits = token_loop_splits(n=240, T=6, seed=i, gate=m.endswith("joint"))
        write_token_loop(tmp_path / "geometry" / m / "token_loop.parquet", splits)
        readouts_model(tmp_path / "geometry" / m, ReadoutsConfig(), CalibrationConfig(n_quantiles=21), tmp_path / "readouts" / m,
                         meta=resolve_model(m, train_meta, regimes), progress=False)
        if i < 2:  # gates for two models only: the third has none
            _gate_outputs(tmp_path / "gates", m, splits, i)
    cfg = D.DiagnoseConfig()
    frames, summary, metrics = D.diagnose_models(models, tmp_path / "readouts", tmp_path / "gates",
                                                 tmp_path / "geometry", cfg, progress=False)
    fc = frames["failure_classes"]
    total = fc.select(pl.sum_horizontal(*D.CLASSES)).to_series()
    assert (total == fc["n_tokens"]).all()
    allrows = fc.filter(pl.col("group") == "all")
    assert (allrows["n_tokens"] == 240).all()
    assert set(fc.filter(pl.col("source") == "gates")["model"]) == set(models[:2])
    # per-difficulty rows sum to the overall row for every (model, rule)
    per = fc.filter(pl.col("group") == "difficulty").group_by("model", "source", "rule").agg(
        pl.col(c).sum() for c in D.CLASSES).sort("model", "source", "rule")
    ref = allrows.select("model", "source", "rule", *D.CLASSES).sort("model", "source", "rule")
    assert per.equals(ref)
    # the 'correct' count equals the chosen point's test accuracy × tokens
    ch = pl.read_parquet(tmp_path / "readouts" / models[0] / "chosen.parquet")
    acc = ch.filter(pl.col("rule") == "entropy")["test_accuracy"][0]
    got = allrows.filter((pl.col("model") == models[0]) & (pl.col("rule") == "entropy"))["correct"][0]
    assert got == round(acc * 240)
    assert metrics["gates_present"] and set(metrics["claims"]) == {"a", "b", "c"}
    assert frames["verdicts"].height == 3 and "## Verdicts" in summary
    # CLI: writes the four outputs + metrics.json (strict JSON)
    res = CliRunner().invoke(app, ["diagnose", "--params", str(repo_root / "params.yaml"), "--models", ",".join(models),
                                   "--readouts-root", str(tmp_path / "readouts"), "--gates-root",
                                   str(tmp_path / "gates"), "--geometry-root", str(tmp_path / "geometry"),
                                   "--out", str(tmp_path / "diagnose")])
    assert res.exit_code == 0, res.output
    out = tmp_path / "diagnose"
    for n in ("failure_classes.parquet", "spearman.parquet", "verdicts.parquet", "summary.md", "metrics.json"):
        assert (out / n).is_file()
    json.loads((out / "metrics.json").read_text(), parse_constant=lambda c: pytest.fail(f"non-JSON {c}"))
    res = CliRunner().invoke(app, ["diagnose", "--params", str(repo_root / "params.yaml"), "--models", "nope",
                                   "--readouts-root", str(tmp_path / "readouts"), "--out", str(tmp_path / "d2")])
    assert res.exit_code == 2 and "readouts stage" in res.output
