"""Exit rules and operating points (pipeline/readouts.py): hand-made signals and brute-force references."""

from __future__ import annotations

import json
import math

import numpy as np
import polars as pl
import pytest

import looptrace.rules.scoring as scoring_module
from looptrace.config import ConfigError, from_dict
from looptrace.io.tables import SplitArrays, load_token_loop
from looptrace.rules.builtin import ALL_RULES, LOOP_COLUMNS, argmax_stable_depths, oracle_depths
from looptrace.rules.readouts import ReadoutsConfig, readouts_model
from looptrace.rules.scoring import (
    CalibrationConfig,
    choose_point,
    d_at,
    evaluate_points,
    evaluate_rule,
    exit_depths,
    pareto_mask,
    quantile_grid,
)
from looptrace.signals.halting import halting_cdf
from tests.builders import token_loop_splits, write_token_loop

# Token-loop tables of a toy model: tests.builders.token_loop_splits / write_token_loop (shared builders).
synthetic_splits = token_loop_splits


def brute_exit(signal, thr, op, min_loop=1, two_hit=False):
    """Pure-Python reference for one token and threshold."""
    T = len(signal)

    def ok(v):
        return (not math.isnan(v)) and (v <= thr if op == "le" else v >= thr)

    for t in range(1, T + 1):
        if t < min_loop:
            continue
        if ok(signal[t - 1]) and (not two_hit or (t >= 2 and ok(signal[t - 2]))):
            return t
    return T


# ------------------------------------------------------------------------------------------------
# Shared operating-point functions
# ------------------------------------------------------------------------------------------------


def test_quantile_grid_matches_hand_percentiles():
    rng = np.random.default_rng(3)
    vals = rng.normal(size=(37, 3))
    vals[0, 0], vals[5, 1], vals[7, 2] = np.nan, np.inf, -np.inf
    grid = quantile_grid(vals, 51)
    finite = np.sort(vals[np.isfinite(vals)])
    n = finite.size
    expect = []
    for p in [0.5 + 1.98 * i for i in range(51)]:  # 0.5, 2.48, ... 99.5 (51 points, 99/50 apart)
        rank = p / 100 * (n - 1)
        lo = int(math.floor(rank))
        hi = min(lo + 1, n - 1)
        expect.append(finite[lo] + (rank - lo) * (finite[hi] - finite[lo]))
    assert grid.shape == (51,)
    np.testing.assert_allclose(grid, expect, rtol=0, atol=1e-12)
    np.testing.assert_allclose(grid, np.percentile(finite, np.linspace(0.5, 99.5, 51)))
    assert np.all(np.diff(grid) >= 0)
    with pytest.raises(ValueError, match="no finite value"):
        quantile_grid(np.full((3, 2), np.nan))


def test_exit_depths_hand_cases():
    T = 4
    ent = np.array([[3.0, 2.0, 1.0, 0.5], [5.0, 5.0, 5.0, 5.0]])
    d = exit_depths(ent, [1.0, 0.1, 10.0], "le")
    # thr 1.0: token 0 at t=3, token 1 never -> T; thr 0.1: never -> T; thr 10: t=1 for both.
    np.testing.assert_array_equal(d, [[3, T], [T, T], [1, 1]])
    conf = np.array([[0.2, 0.6, 0.9, 0.95]])
    np.testing.assert_array_equal(exit_depths(conf, [0.5, 0.9, 0.99], "ge"), [[2], [3], [T]])


def test_exit_depths_min_loop_floors():
    # kl_prev-like: NaN at t=1; hidden_change-like: defined and tiny at t=1 but the rule may not fire there.
    kl = np.array([[np.nan, 0.5, 1e-4, 1e-5]])
    np.testing.assert_array_equal(exit_depths(kl, [1e-3, 1.0], "le", min_loop=2), [[3], [2]])
    hc = np.array([[0.0, 0.5, 0.01, 0.2]])
    assert exit_depths(hc, [0.1], "le", min_loop=1)[0, 0] == 1
    assert exit_depths(hc, [0.1], "le", min_loop=2)[0, 0] == 3
    assert exit_depths(hc, [1.0], "le", min_loop=3)[0, 0] == 3


def test_exit_depths_accel_two_hit():
    a = np.array([
        [np.nan, 0.1, 0.5, 0.1, 0.1],  # a3 fails; a4 ok but a3 not; t=5: a5, a4 ok -> 5
        [np.nan, 0.1, 0.1, 0.9, 0.9],  # t=3: a3, a2 ok -> 3
        [np.nan, 0.1, 0.9, 0.9, 0.9],  # never -> T
        [np.nan, 0.1, 0.1, 0.1, 0.1],  # would fire at 2 without the t ≥ 3 floor -> 3
    ])
    np.testing.assert_array_equal(exit_depths(a, [0.2], "le", min_loop=3, two_hit=True)[0], [5, 3, 5, 3])


@pytest.mark.parametrize("op,min_loop,two_hit", [("le", 1, False), ("ge", 1, False), ("le", 2, False),
                                                 ("le", 3, True), ("ge", 2, True)])
def test_exit_depths_matches_brute_force(op, min_loop, two_hit, monkeypatch):
    rng = np.random.default_rng(7)
    sig = rng.random((60, 5))
    sig[rng.random(sig.shape) < 0.1] = np.nan
    thr = np.array([0.05, 0.3, 0.5, 0.9, 2.0, -1.0])
    monkeypatch.setattr(scoring_module, "_MAX_BLOCK", 64)  # force several token chunks
    got = exit_depths(sig, thr, op, min_loop, two_hit)
    ref = np.array([[brute_exit(sig[n], t, op, min_loop, two_hit) for n in range(60)] for t in thr])
    np.testing.assert_array_equal(got, ref)


def test_argmax_stable_and_oracle_and_halting():
    am = np.array([[1, 2, 2, 2, 3, 3], [5, 5, 5, 5, 5, 5], [1, 2, 1, 2, 1, 2]])
    # Huginn's n counts equal transitions: n = 0 exits at 1, n = 1 needs two equal loops, n = 3 four.
    np.testing.assert_array_equal(argmax_stable_depths(am, [0, 1, 2, 3]),
                                  [[1, 1, 1], [3, 2, 6], [4, 3, 6], [6, 4, 6]])
    corr = np.array([[False, False, True, False], [False] * 4, [True, False, False, True]])
    np.testing.assert_array_equal(oracle_depths(corr), [3, 4, 1])
    cdf = halting_cdf(np.array([[0.0, 0.0, 800.0], [-800.0, np.log(3.0), 0.0]]))
    # σ(0) = 1/2: 1 − 1/2, 1 − 1/4; σ(800) = 1. σ(ln 3) = 3/4: 1 − 1·(1/4) = 3/4, then 1 − 1/8.
    np.testing.assert_allclose(cdf, [[0.5, 0.75, 1.0], [0.0, 0.75, 0.875]], atol=1e-12)


def test_evaluate_points_hand():
    correct = np.array([[False, True, True], [False, False, True]])
    loss = np.array([[2.0, 1.0, 0.5], [3.0, 2.5, 0.2]])
    depth, acc, los = evaluate_points(np.array([[1, 1], [2, 3], [3, 3]]), correct, loss)
    np.testing.assert_allclose(depth, [1.0, 2.5, 3.0])
    np.testing.assert_allclose(acc, [0.0, 1.0, 1.0])
    np.testing.assert_allclose(los, [2.5, 0.6, 0.35])


def test_pareto_mask_vs_brute_force():
    rng = np.random.default_rng(11)
    depth = rng.integers(1, 6, 80).astype(float)
    acc = rng.integers(0, 8, 80) / 8  # many ties and exact duplicates
    depth[3] = np.nan
    got = pareto_mask(depth, acc)
    ref = []
    for i in range(80):
        if np.isnan(depth[i]):
            ref.append(False)
            continue
        dominated = any(
            (depth[j] <= depth[i] and acc[j] >= acc[i] and (depth[j] < depth[i] or acc[j] > acc[i]))
            for j in range(80) if not np.isnan(depth[j]))
        ref.append(not dominated)
    np.testing.assert_array_equal(got, ref)
    np.testing.assert_array_equal(pareto_mask([1.0, 1.0, 2.0], [0.5, 0.5, 0.5]), [True, True, False])


def test_d_at_and_unreachable():
    depth = np.array([1.2, 2.0, 3.5, 6.0])
    acc = np.array([0.80, 0.95, 0.97, 0.99])
    assert d_at(depth, acc, 95) == 2.0  # exactly 0.95 counts
    assert d_at(depth, acc, 96) == 3.5
    assert d_at(depth, acc, 99) == 6.0
    assert math.isnan(d_at(depth, acc, 99.5))
    assert d_at(np.array([5.0, 2.0]), np.array([57, 57]) / 100, 57) == 2.0  # float k/N edge


def test_choose_point():
    d = np.array([1.0, 2.0, 2.0, 3.0, 6.0])
    a = np.array([0.90, 0.952, 0.956, 0.96, 0.96])
    assert choose_point(d, a, full_acc=0.96, delta=0.5) == 2  # 0.956 ≥ 0.955; tie at depth 2 -> higher acc
    assert choose_point(d, a, full_acc=0.96, delta=1.0) == 2
    assert choose_point(d, a, full_acc=0.96, delta=0.0) == 3
    assert choose_point(d, a, full_acc=0.96, delta=10.0) == 0
    # nothing within delta: the most accurate point, lowest depth among ties
    assert choose_point(np.array([2.0, 1.0, 3.0]), np.array([0.7, 0.8, 0.8]), full_acc=0.99, delta=0.5) == 1


def test_evaluate_rule_freezes_val_grid():
    rng = np.random.default_rng(5)
    vs = rng.random((200, 4))
    ts = rng.random((150, 4)) * 0.5  # shifted test distribution: the grid must not move
    vc = rng.random((200, 4)) < 0.8
    tc = rng.random((150, 4)) < 0.8
    val = SplitArrays(None, {"correct": vc, "target_logprob": -rng.random((200, 4))})
    test = SplitArrays(np.arange(150) + 10, {"correct": tc, "target_logprob": -rng.random((150, 4))})
    r = evaluate_rule("x", vs, ts, val, test, "le", n_quantiles=11, delta=0.5)
    np.testing.assert_allclose(r.thresholds, np.percentile(vs, np.linspace(0.5, 99.5, 11)))
    td = exit_depths(ts, r.thresholds, "le")
    np.testing.assert_allclose(r.test.mean_depth, td.mean(1))
    vd = exit_depths(vs, r.thresholds, "le")
    vacc = vc[np.arange(200)[None], vd - 1].mean(1)
    assert r.chosen == choose_point(vd.mean(1), vacc, vc[:, -1].mean(), 0.5)
    np.testing.assert_array_equal(r.test_exits, td[r.chosen])
    np.testing.assert_array_equal(r.test_correct, tc[np.arange(150), td[r.chosen] - 1])
    np.testing.assert_array_equal(r.test_token, np.arange(150) + 10)


# ------------------------------------------------------------------------------------------------
# The stage on a synthetic token_loop.parquet
# ------------------------------------------------------------------------------------------------


def test_readouts_model_end_to_end(tmp_path):
    splits = synthetic_splits(n=300, T=4, gate=True)
    write_token_loop(tmp_path / "geo" / "token_loop.parquet", splits)
    cfg = ReadoutsConfig()
    m = readouts_model(tmp_path / "geo", cfg, CalibrationConfig(n_quantiles=21), tmp_path / "out", meta={"model": "toy"}, progress=False)
    out = tmp_path / "out"
    for name in ("operating_points", "pareto", "dx", "chosen", "chosen_exits"):
        assert (out / f"{name}.parquet").is_file()
    ops = pl.read_parquet(out / "operating_points.parquet")
    test = splits["test"]
    corr = test["correct"]
    # fixed depth k: accuracy = mean correctness at loop k; oracle = any loop correct
    fixed = ops.filter((pl.col("rule") == "fixed") & (pl.col("split") == "test")).sort("threshold")
    np.testing.assert_allclose(fixed["accuracy"].to_numpy(), corr.mean(0))
    np.testing.assert_allclose(fixed["mean_loss"].to_numpy(), -test["target_logprob"].mean(0))
    orc = ops.filter((pl.col("rule") == "oracle") & (pl.col("split") == "test"))
    assert orc["accuracy"][0] == pytest.approx(corr.any(1).mean())
    assert set(ops["rule"].unique()) == set(ALL_RULES)  # q_exit present: the model has a gate
    assert ops.filter(pl.col("rule") == "entropy").height == 2 * 21
    # chosen exits: correctness matches the per-token table; mean depth matches chosen.parquet
    ex = pl.read_parquet(out / "chosen_exits.parquet")
    ch = pl.read_parquet(out / "chosen.parquet")
    assert "oracle" not in ch["rule"].to_list()
    tok = test["token"][:, 0]
    for rule in ("entropy", "q_exit", "fixed"):
        e = ex.filter(pl.col("rule") == rule).sort("token")
        np.testing.assert_array_equal(e["token"].to_numpy(), np.sort(tok))
        order = np.argsort(tok)
        d = e["exit_depth"].to_numpy()
        np.testing.assert_array_equal(e["correct"].to_numpy(), corr[order][np.arange(d.size), d - 1])
        row = ch.filter(pl.col("rule") == rule).row(0, named=True)
        assert row["test_depth"] == pytest.approx(d.mean())
    # entropy: correct tokens have entropy ≤ 0.3 < incorrect ≥ 1, so it should reach the oracle's accuracy
    # at well below full depth
    assert m["rules"]["entropy"]["chosen"]["test_depth"]["estimate"] < 3.5
    # metrics.json is strict JSON (NaN -> null)
    json.loads((out / "metrics.json").read_text(), parse_constant=lambda c: pytest.fail(f"non-JSON {c}"))
    # pareto: each rule's own front is non-dominated
    par = pl.read_parquet(out / "pareto.parquet")
    for rule in par["rule"].unique():
        sub = par.filter(pl.col("rule") == rule)
        assert pareto_mask(sub["mean_depth"].to_numpy(), sub["accuracy"].to_numpy()).all()


def test_readouts_without_gate_skips_q_exit(tmp_path):
    write_token_loop(tmp_path / "geo" / "token_loop.parquet", synthetic_splits(n=80, T=3, gate=False))
    readouts_model(tmp_path / "geo", ReadoutsConfig(), CalibrationConfig(n_quantiles=5), tmp_path / "out", progress=False)
    rules = set(pl.read_parquet(tmp_path / "out" / "chosen.parquet")["rule"])
    assert "q_exit" not in rules and "entropy" in rules


def test_bad_inputs_and_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="geometry stage"):
        load_token_loop(tmp_path / "missing.parquet")
    p = write_token_loop(tmp_path / "a" / "token_loop.parquet", synthetic_splits(n=20, T=3))
    pl.read_parquet(p).drop("entropy").write_parquet(p)
    with pytest.raises(ValueError, match="'entropy'"):
        load_token_loop(p, columns=LOOP_COLUMNS)
    p = write_token_loop(tmp_path / "b" / "token_loop.parquet", synthetic_splits(n=20, T=3))
    pl.read_parquet(p).filter(~((pl.col("token") == 1003) & (pl.col("loop") == 2))).write_parquet(p)
    with pytest.raises(ValueError, match="loops 1..3"):
        load_token_loop(p, columns=LOOP_COLUMNS)
    with pytest.raises(ConfigError, match="unknown rule 'bogus'"):
        from_dict(ReadoutsConfig, {"rules": ["bogus"]}, "readouts")
    with pytest.raises(ConfigError, match="unknown key"):
        from_dict(ReadoutsConfig, {"n_quantiles": 3}, "readouts")  # now in the calibration section
    with pytest.raises(ConfigError, match="calibration.n_quantiles"):
        from_dict(CalibrationConfig, {"n_quantiles": 0}, "calibration")


def test_stage_cli(tmp_path, repo_root):
    from typer.testing import CliRunner

    from looptrace.cli import app

    write_token_loop(tmp_path / "geometry" / "running_parity-uniform" / "token_loop.parquet",
                     synthetic_splits(n=60, T=6))
    res = CliRunner().invoke(app, ["readouts", "--model", "running_parity-uniform", "--params",
                                   str(repo_root / "params.yaml"), "--geometry-root", str(tmp_path / "geometry"),
                                   "--out", str(tmp_path / "readouts")])
    assert res.exit_code == 0, res.output
    m = json.loads((tmp_path / "readouts" / "running_parity-uniform" / "metrics.json").read_text())
    assert (m["task"], m["regime"], m["regime_kind"]) == ("running_parity", "uniform", "uniform")
    res = CliRunner().invoke(app, ["readouts", "--model", "nope", "--params", str(repo_root / "params.yaml"),
                                   "--geometry-root", str(tmp_path / "geometry"), "--out", str(tmp_path / "r2")])
    assert res.exit_code == 2 and "geometry stage" in res.output


def huginn_argmax_exit(seq, exit_threshold: int) -> int:
    """Transcription of ArgmaxStabilityExitEvaluator (seal-rg/recurrent-pretraining): prev starts at −1,
    the counter increments when the argmax equals the previous one and resets to 0 otherwise; exit at the
    first step whose counter ≥ exit_threshold (1-based loop), else the last loop."""
    prev, stable = -1, 0
    for step, a in enumerate(seq, start=1):
        stable = stable + 1 if a == prev else 0
        prev = a
        if stable >= exit_threshold:
            return step
    return len(seq)


def test_argmax_stable_matches_huginn_counter_on_random_sequences():
    rng = np.random.default_rng(12)
    am = rng.integers(0, 3, size=(1200, 12))  # few classes, so long runs occur
    ns = [0, 1, 2, 3, 5]
    got = argmax_stable_depths(am, ns)
    ref = np.array([[huginn_argmax_exit(row, n) for row in am] for n in ns])
    np.testing.assert_array_equal(got, ref)
