"""Geometry (SPEC §2): block metrics against closed-form trajectories, convergence depth, DLR, and the
streamed stage on small stores built with ``looptrace.io.store.writer.write_store``."""

from __future__ import annotations

import math

import numpy as np
import polars as pl
import pytest

from looptrace.config import ConfigError
from looptrace.geometry.blocks import argmax_differs, convergence_depth, drift_to_loop_ratio, group_handoffs
from looptrace.geometry.stage import GeometryConfig
from looptrace.signals.steps import step_metrics
from tests.builders import random_signal_arrays, tiny_train_config, write_arrays


def _traj(h0: np.ndarray, steps: np.ndarray) -> np.ndarray:
    """h_t = h_0 + Σ_{k≤t} steps_k: h0 [N, D], steps [N, T, D] -> hidden [N, T, D]."""
    return h0[:, None, :] + np.cumsum(steps, axis=1)


# ----------------------------------------------------------------------------- closed forms

def test_constant_steps_cosine_one_acceleration_zero():
    rng = np.random.default_rng(0)
    N, T, D = 5, 6, 8
    h0 = rng.normal(size=(N, D))
    v = rng.normal(size=(N, D))
    hidden = _traj(h0, np.repeat(v[:, None, :], T, axis=1))
    m = step_metrics(hidden, h0)
    vn = np.linalg.norm(v, axis=1)
    np.testing.assert_allclose(m["step_norm"], np.repeat(vn[:, None], T, axis=1), rtol=1e-6)
    np.testing.assert_allclose(m["rel_step"], vn[:, None] / np.linalg.norm(hidden, axis=2), rtol=1e-6)
    np.testing.assert_allclose(m["step_cos"][:, 1:], 1.0, atol=1e-6)
    np.testing.assert_allclose(m["accel"][:, 1:], 0.0, atol=1e-6)
    np.testing.assert_allclose(m["accel_norm"][:, 1:], 0.0, atol=1e-6)
    np.testing.assert_allclose(m["step_d2"][:, 2:], 0.0, atol=1e-5)
    # undefined at t = 1 (step_cos, accel) and t ≤ 2 (step_d2): NaN, never 0
    for k in ("step_cos", "accel", "accel_norm"):
        assert np.isnan(m[k][:, 0]).all()
    assert np.isnan(m["step_d2"][:, :2]).all()
    assert all(v.dtype == np.float32 for v in m.values())


def test_orthogonal_steps_cosine_zero():
    N, T, D = 3, 5, 7
    h0 = np.zeros((N, D))
    h0[:, -1] = 2.0
    steps = np.zeros((N, T, D))
    for t in range(T):
        steps[:, t, t] = 1.5  # Δ_t = 1.5 e_t: mutually orthogonal
    m = step_metrics(_traj(h0, steps), h0)
    np.testing.assert_allclose(m["step_cos"][:, 1:], 0.0, atol=1e-7)
    np.testing.assert_allclose(m["step_norm"], 1.5, rtol=1e-7)
    np.testing.assert_allclose(m["accel"][:, 1:], 1.5 * math.sqrt(2), rtol=1e-6)  # ‖e_t − e_{t−1}‖ = √2
    # ‖h_t‖² = 4 + t · 1.5²
    hn = np.sqrt(4 + np.arange(1, T + 1) * 2.25)
    np.testing.assert_allclose(m["rel_step"], np.broadcast_to(1.5 / hn, (N, T)), rtol=1e-6)


def test_geometric_shrinkage_known_norms_and_ratios():
    r, T = 0.6, 6
    h0 = np.array([[3.0, 0, 0, 0]])
    v = np.array([0, 2.0, 0, 0])  # ⟂ h0
    steps = np.stack([r ** k * v for k in range(1, T + 1)])[None]  # Δ_t = r^t v
    m = step_metrics(_traj(h0, steps), h0)
    t = np.arange(1, T + 1)
    s = 2.0 * r ** t
    np.testing.assert_allclose(m["step_norm"][0], s, rtol=1e-6)
    np.testing.assert_allclose(m["step_norm"][0, 1:] / m["step_norm"][0, :-1], r, rtol=1e-6)
    cum = 2.0 * np.cumsum(r ** t)  # ‖h_t‖² = 9 + (2 Σ r^k)²
    np.testing.assert_allclose(m["rel_step"][0], s / np.sqrt(9 + cum ** 2), rtol=1e-6)
    np.testing.assert_allclose(m["step_cos"][0, 1:], 1.0, atol=1e-6)
    np.testing.assert_allclose(m["accel"][0, 1:], 2.0 * r ** (t[1:] - 1) * (1 - r), rtol=1e-5)
    np.testing.assert_allclose(m["step_d2"][0, 2:], 2.0 * r ** (t[2:] - 2) * (1 - r) ** 2, rtol=1e-4)


def test_rotation_state_cosine_distance_and_chords():
    theta, T, rad = 0.3, 5, 2.0
    ang = theta * np.arange(0, T + 1)
    pts = rad * np.stack([np.cos(ang), np.sin(ang)], axis=1)  # h_0..h_T on a circle
    m = step_metrics(pts[None, 1:], pts[None, 0])
    chord = 2 * rad * math.sin(theta / 2)
    np.testing.assert_allclose(m["state_cos_dist"][0], 1 - math.cos(theta), rtol=1e-6)
    np.testing.assert_allclose(m["step_norm"][0], chord, rtol=1e-6)
    np.testing.assert_allclose(m["step_cos"][0, 1:], math.cos(theta), rtol=1e-6)  # chords turn by θ
    np.testing.assert_allclose(m["accel"][0, 1:], chord * 2 * math.sin(theta / 2), rtol=1e-5)
    np.testing.assert_allclose(m["rel_step"][0], chord / rad, rtol=1e-6)


def test_zero_step_gives_nan_cosine_not_zero():
    h0 = np.ones((1, 3))
    hidden = np.ones((1, 3, 3))  # the state never moves
    m = step_metrics(hidden, h0)
    np.testing.assert_array_equal(m["step_norm"], 0.0)
    assert np.isnan(m["step_cos"]).all()
    np.testing.assert_array_equal(m["accel"][:, 1:], 0.0)


def test_float16_input_is_upcast():
    rng = np.random.default_rng(1)
    h0 = rng.normal(size=(4, 16)).astype(np.float16)
    hidden = rng.normal(size=(4, 3, 16)).astype(np.float16)
    m = step_metrics(hidden, h0)
    ref = np.linalg.norm(hidden.astype(np.float64)[:, 0] - h0.astype(np.float64), axis=1)
    np.testing.assert_allclose(m["step_norm"][:, 0], ref, rtol=1e-6)


def test_block_size_does_not_change_metrics():
    rng = np.random.default_rng(2)
    h0 = rng.normal(size=(50, 16)).astype(np.float16)
    hidden = rng.normal(size=(50, 4, 16)).astype(np.float16)
    whole = step_metrics(hidden, h0)
    parts = [step_metrics(hidden[i:i + 7], h0[i:i + 7]) for i in range(0, 50, 7)]
    for k, v in whole.items():
        np.testing.assert_array_equal(np.concatenate([p[k] for p in parts]), v)


def test_row_groups_do_not_change_metrics(monkeypatch):
    """step_metrics' cache-sized row groups (1, 3 or all rows at once) give the same bits, and equal the
    closed forms at float64 on a row in the middle of a group."""
    import looptrace.signals.steps as steps

    rng = np.random.default_rng(3)
    h0 = rng.normal(size=(20, 40)).astype(np.float32)
    hidden = rng.normal(size=(20, 5, 40)).astype(np.float32)
    got = {}
    for group_bytes in (1, 3 * 8 * 40, 1 << 40):  # 1 row, 3 rows, the whole block
        monkeypatch.setattr(steps, "ROW_GROUP_BYTES", group_bytes)
        got[group_bytes] = steps.step_metrics(hidden, h0)
    for k, v in got[1 << 40].items():
        for g in (1, 3 * 8 * 40):
            np.testing.assert_array_equal(got[g][k], v, err_msg=k)
    h = np.concatenate([h0[:, None], hidden], axis=1).astype(np.float64)[7]  # row 7: inside the third group of 3
    d = np.diff(h, axis=0)
    np.testing.assert_allclose(got[3 * 8 * 40]["step_norm"][7], np.linalg.norm(d, axis=1), rtol=1e-6)
    np.testing.assert_allclose(got[3 * 8 * 40]["accel"][7, 1:], np.linalg.norm(np.diff(d, axis=0), axis=1), rtol=1e-6)


# ----------------------------------------------------------------------------- convergence

def test_convergence_first_vs_settled_and_censoring():
    sig = np.array([
        [0.5, 0.01, 0.5, 0.01, 0.01],   # converges, diverges, converges: first 2, settled 4
        [1.0, 1.0, 1.0, 1.0, 1.0],      # never: censored T + 1 for both
        [0.01, 0.01, 0.01, 0.01, 0.5],  # leaves at the end: first 1, settled censored
        [0.01, 0.01, 0.01, 0.01, 0.01],  # always below: 1, 1
        [np.nan, 0.01, 0.01, 0.2, 0.05],  # NaN is not below: first 2, settled 5
        [0.1, 0.2, 0.1, 0.1, 0.1],       # strict: 0.1 is not below 0.1 -> censored
    ])
    res = convergence_depth(sig, 0.1)
    np.testing.assert_array_equal(res["first"], [2, 6, 1, 1, 2, 6])
    np.testing.assert_array_equal(res["settled"], [4, 6, 6, 1, 5, 6])
    np.testing.assert_array_equal(res["first_censored"], [False, True, False, False, False, True])
    np.testing.assert_array_equal(res["settled_censored"], [False, True, True, False, False, True])


def test_argmax_signal():
    am = np.array([[3, 1, 1, 2], [2, 1, 2, 2], [5, 5, 5, 5]])
    d = argmax_differs(am)
    np.testing.assert_array_equal(d, [[1, 1, 1, 0], [0, 1, 0, 0], [0, 0, 0, 0]])
    res = convergence_depth(d, 0.5)
    np.testing.assert_array_equal(res["first"], [4, 1, 1])
    np.testing.assert_array_equal(res["settled"], [4, 3, 1])
    assert not res["settled_censored"].any()  # argmax_T = argmax_T: never censored


# ----------------------------------------------------------------------------- DLR

def test_dlr_hand_computed():
    # 5 loops, groups [0, 0, 0, 1, 1]; steps (norms) 7 (enters g0), 1, 3 (within g0), 10 (hand-off), 4.
    lg = np.array([0, 0, 0, 1, 1])
    D = 3
    norms = [7.0, 1.0, 3.0, 10.0, 4.0]
    dirs = [np.eye(D)[i % D] for i in range(5)]
    steps = np.stack([n * d for n, d in zip(norms, dirs, strict=True)])[None]
    h0 = np.zeros((1, D))
    hidden = _traj(h0, steps)
    sn = step_metrics(hidden, h0)["step_norm"]
    out = drift_to_loop_ratio(sn, lg)
    assert list(out) == [0]
    # ‖h_4 − h_3‖ = 10; within-g0 steps are loops 2 and 3: mean(1, 3) = 2 -> DLR = 5
    np.testing.assert_allclose(out[0]["drift"], 10.0, rtol=1e-6)
    np.testing.assert_allclose(out[0]["loop_step"], 2.0, rtol=1e-6)
    np.testing.assert_allclose(out[0]["dlr"], 5.0, rtol=1e-6)
    assert group_handoffs(lg) == [(0, 2, 3)]
    assert group_handoffs(np.zeros(4)) == []
    with pytest.raises(ValueError, match="loop_group"):
        group_handoffs(np.array([0, 1, 0]))


def test_dlr_single_loop_group_is_nan():
    sn = np.array([[1.0, 2.0, 3.0]])
    out = drift_to_loop_ratio(sn, np.array([0, 1, 1]))
    assert np.isnan(out[0]["dlr"]).all()


# ----------------------------------------------------------------------------- config

def test_config_rejects_bad_values():
    with pytest.raises(ConfigError, match="unknown signal 'entropyy'"):
        GeometryConfig(eps={"entropyy": (0.1,)})
    with pytest.raises(ConfigError, match="geometry.eps.kl_prev"):
        GeometryConfig(eps={"kl_prev": (0.0,)})
    with pytest.raises(ConfigError, match="block_tokens"):
        GeometryConfig(block_tokens=0)
    assert GeometryConfig().convergence_keys()[0] == ("kl_prev", 1e-3)


def test_params_yaml_section_loads_and_matches_defaults(repo_root):
    from looptrace.config import load_section

    assert load_section(GeometryConfig, "geometry", repo_root / "params.yaml") == GeometryConfig()


# ----------------------------------------------------------------------------- streamed stage on real stores

def _run(stores, out, block, **cfg):
    from looptrace.geometry.stage import geometry_model

    cfg.setdefault("eps", {"kl_prev": (0.3,), "rel_step": (0.5, 1.0), "argmax": (0.5,)})
    return geometry_model(stores, GeometryConfig(block_tokens=block, **cfg), out, meta={"model": "m"},
                          progress=False)


def _first_settled_loop(sig, eps):
    """Independent scalar implementation of first / settled (T + 1 when never)."""
    T = len(sig)
    below = [bool(v < eps) for v in sig]  # NaN < eps is False
    first = next((t + 1 for t in range(T) if below[t]), T + 1)
    settled = next((t + 1 for t in range(T) if all(below[t:])), T + 1)
    return first, settled


@pytest.fixture(scope="module")
def stage_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("geo")
    rng = np.random.default_rng(7)
    arrays = {"val": random_signal_arrays(rng, N=33), "test": random_signal_arrays(rng, N=40)}
    stores = {s: write_arrays(tmp / f"{s}.zarr", a) for s, a in arrays.items()}
    metrics7 = _run(stores, tmp / "out7", 7)
    metrics_big = _run(stores, tmp / "out4096", 4096)
    return tmp, arrays, stores, metrics7, metrics_big


def test_stage_token_loop_matches_independent_numpy(stage_run):
    from looptrace.geometry.stage import TOKEN_LOOP_COLUMNS

    tmp, arrays, _, _, _ = stage_run
    df = pl.read_parquet(tmp / "out7" / "token_loop.parquet")
    assert tuple(df.columns) == TOKEN_LOOP_COLUMNS
    for split, a in arrays.items():
        sub = df.filter(pl.col("split") == split).sort("token", "loop")
        N, T, _ = a["hidden"].shape
        assert sub.height == N * T
        np.testing.assert_array_equal(sub["loop"].to_numpy().reshape(N, T), np.tile(np.arange(1, T + 1), (N, 1)))
        h = np.concatenate([a["hidden_init"][:, None], a["hidden"]], axis=1).astype(np.float64)
        steps = np.diff(h, axis=1)
        ref = np.linalg.norm(steps, axis=2)
        got = lambda c, sub=sub, N=N, T=T: sub[c].to_numpy().reshape(N, T)  # noqa: E731
        np.testing.assert_allclose(got("step_norm"), ref, rtol=1e-6)
        np.testing.assert_array_equal(got("hidden_change"), got("step_norm"))
        cos = np.sum(steps[:, 1:] * steps[:, :-1], axis=2) / (ref[:, 1:] * ref[:, :-1])
        np.testing.assert_allclose(got("step_cos")[:, 1:], cos, rtol=1e-5, atol=1e-6)
        assert np.isnan(got("step_cos")[:, 0]).all() and np.isnan(got("step_d2")[:, :2]).all()
        np.testing.assert_array_equal(got("correct"), a["argmax"] == a["target"][:, None])
        np.testing.assert_array_equal(got("gate_logit"), a["gate_logit"])
        np.testing.assert_array_equal(got("kl_prev"), a["kl_prev"])  # NaN at t = 1 kept (equal_nan)
        np.testing.assert_array_equal(got("loop_group"), np.tile([0, 0, 0, 1, 1], (N, 1)))
        np.testing.assert_array_equal(sub["difficulty"].to_numpy()[::T], a["difficulty"])


def test_stage_results_do_not_depend_on_block_size(stage_run):
    tmp, _, _, metrics7, metrics_big = stage_run
    for name in ("token_loop", "loop_summary", "convergence", "dlr"):
        a = pl.read_parquet(tmp / "out7" / f"{name}.parquet")
        b = pl.read_parquet(tmp / "out4096" / f"{name}.parquet")
        assert a.equals(b), name
    strip = lambda m: {**m, "params": {k: v for k, v in m["params"].items() if k != "block_tokens"}}  # noqa: E731
    assert metrics7["params"]["block_tokens"] == 7 and strip(metrics7) == strip(metrics_big)


def test_loop_summary_matches_polars(stage_run):
    tmp, _, _, metrics, _ = stage_run
    tl = pl.read_parquet(tmp / "out7" / "token_loop.parquet")
    summ = pl.read_parquet(tmp / "out7" / "loop_summary.parquet")
    assert summ.columns == ["split", "loop", "group_by", "group_value", "metric", "mean", "median", "q25", "q75",
                            "count", "n_nan", "n_inf"]
    sel = tl.filter((pl.col("split") == "test") & (pl.col("loop") == 3) & (pl.col("difficulty") == 2))["accel"]
    row = summ.filter((pl.col("split") == "test") & (pl.col("loop") == 3) & (pl.col("group_by") == "difficulty")
                      & (pl.col("group_value") == "2") & (pl.col("metric") == "accel")).row(0, named=True)
    assert row["count"] == sel.len()
    assert row["mean"] == pytest.approx(sel.mean(), rel=1e-6)
    assert row["median"] == pytest.approx(sel.median(), rel=1e-6)
    assert row["q25"] == pytest.approx(sel.quantile(0.25, "linear"), rel=1e-6)
    assert row["q75"] == pytest.approx(sel.quantile(0.75, "linear"), rel=1e-6)
    # token types by name; accuracy = mean of correct; undefined step_cos at loop 1 -> count 0
    tt = summ.filter((pl.col("group_by") == "token_type") & (pl.col("split") == "val") & (pl.col("loop") == 1)
                     & (pl.col("metric") == "correct"))
    assert sorted(tt["group_value"]) == ["change", "keep"]
    acc_val = tl.filter(pl.col("split") == "val").group_by("loop").agg(pl.col("correct").mean()).sort("loop")
    np.testing.assert_allclose(metrics["splits"]["val"]["accuracy_per_loop"], acc_val["correct"], rtol=1e-12)
    c1 = summ.filter((pl.col("metric") == "step_cos") & (pl.col("loop") == 1) & (pl.col("group_by") == "all"))
    assert (c1["count"] == 0).all() and c1["mean"].is_nan().all()
    n_split = tl.filter(pl.col("loop") == 1).group_by("split").len().sort("split")
    assert c1.sort("split")["n_nan"].to_list() == n_split["len"].to_list()  # every value left out is counted
    assert (summ["n_inf"] == 0).all()
    last = tl.filter((pl.col("split") == "test") & (pl.col("loop") == 5))["step_cos"].mean()
    assert metrics["splits"]["test"]["step_cos_mean_last_loop"] == pytest.approx(last, rel=1e-6)


def test_summary_stats_count_what_they_leave_out():
    from looptrace.geometry.stage import summary_stats

    mean, med, q25, q75, count, n_nan, n_inf = summary_stats(np.array([1.0, 2.0, np.inf, -np.inf, np.nan, 3.0]))
    assert (mean, med, q25, q75, count, n_nan, n_inf) == (2.0, 2.0, 1.5, 2.5, 3, 1, 2)
    assert summary_stats(np.array([np.inf]))[4:] == (0, 0, 1)


def test_convergence_table_matches_scalar_reference(stage_run):
    tmp, arrays, _, metrics, _ = stage_run
    cv = pl.read_parquet(tmp / "out7" / "convergence.parquet")
    a = arrays["test"]
    N, T, _ = a["hidden"].shape
    rel = (np.linalg.norm(np.diff(np.concatenate([a["hidden_init"][:, None], a["hidden"]], 1).astype(np.float64),
                                  axis=1), axis=2) / np.linalg.norm(a["hidden"].astype(np.float64), axis=2))
    differs = (a["argmax"] != a["argmax"][:, -1:]).astype(float)
    for sig, eps, values in (("kl_prev", 0.3, a["kl_prev"]), ("rel_step", 1.0, rel), ("argmax", 0.5, differs)):
        sub = cv.filter((pl.col("split") == "test") & (pl.col("signal") == sig) & (pl.col("eps") == eps))
        assert sub.height == 2 * N  # every token, both kinds: censored tokens are kept
        for kind, col in (("first", 0), ("settled", 1)):
            k = sub.filter(pl.col("kind") == kind).sort("token")
            ref = np.array([_first_settled_loop(values[i], eps)[col] for i in range(N)])
            np.testing.assert_array_equal(k["depth"].to_numpy(), ref)
            np.testing.assert_array_equal(k["censored"].to_numpy(), ref == T + 1)
            m = metrics["splits"]["test"]["convergence"][f"{sig}@{eps:g}"]
            assert m[f"censored_{kind}"] == int((ref == T + 1).sum())
            assert m[f"median_{kind}"] == float(np.median(ref))
            if kind == "settled":
                by = {str(d): float(ref[a["difficulty"] == d].mean()) for d in np.unique(a["difficulty"])}
                assert m["settled_mean_by_difficulty"] == pytest.approx(by)


def test_dlr_from_a_store_with_two_groups(tmp_path):
    # Every token: steps of norm 7 (enters g0), 1, 3 (within g0), 10 (hand-off), 4 (within g1), scaled by c.
    N, D = 9, 3
    c = np.arange(1, N + 1, dtype=np.float64)[:, None]
    norms = np.array([7.0, 1.0, 3.0, 10.0, 4.0])
    dirs = np.stack([np.eye(D)[i % D] for i in range(5)])  # [loop, d_model]
    steps = c[:, :, None] * norms[None, :, None] * dirs[None]
    h0 = np.full((N, D), 0.5)
    hidden = (h0[:, None] + np.cumsum(steps, axis=1)).astype(np.float32)
    rng = np.random.default_rng(0)
    st = write_arrays(tmp_path / "s.zarr", random_signal_arrays(rng, N=N, T=5, D=D, gate=False, hidden=hidden,
                                            h0=h0.astype(np.float32)), chunk_tokens=4)
    metrics = _run({"test": st}, tmp_path / "out", 3)
    dlr = pl.read_parquet(tmp_path / "out" / "dlr.parquet")
    assert dlr.height == 1
    row = dlr.row(0, named=True)
    # ‖h_4 − h_3‖ = 10c; within g0: mean(1c, 3c) = 2c  -> DLR = 5 for every token
    assert (row["group"], row["next_group"], row["last_loop"], row["first_loop_next"]) == (0, 1, 3, 4)
    assert row["dlr_median"] == pytest.approx(5.0, rel=1e-6)
    assert row["dlr_mean"] == pytest.approx(5.0, rel=1e-6)
    assert row["drift_mean"] == pytest.approx(10 * c.mean(), rel=1e-6)
    assert row["dlr_of_means"] == pytest.approx(5.0, rel=1e-6)
    assert metrics["splits"]["test"]["dlr"][0]["dlr_median"] == pytest.approx(5.0, rel=1e-6)
    tl = pl.read_parquet(tmp_path / "out" / "token_loop.parquet")
    assert tl["gate_logit"].null_count() == tl.height  # no gate -> null, not NaN or 0


def test_single_group_writes_empty_dlr_and_failed_run_leaves_nothing(tmp_path):
    rng = np.random.default_rng(3)
    one = write_arrays(tmp_path / "one.zarr", random_signal_arrays(rng, N=10, loop_group=(0,) * 5, gate=False))
    _run({"val": one}, tmp_path / "ok", None)
    assert pl.read_parquet(tmp_path / "ok" / "dlr.parquet").height == 0
    two = write_arrays(tmp_path / "two.zarr", random_signal_arrays(rng, N=10))
    with pytest.raises(ValueError, match="different loop structure"):
        _run({"val": one, "test": two}, tmp_path / "bad", None)
    assert not (tmp_path / "bad").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".bad")]


# ----------------------------------------------------------------------------- training dynamics and the stage

def test_training_dynamics_match_an_independent_forward(tmp_path, tiny_base):
    import torch

    from looptrace.capture.dump import DumpConfig
    from looptrace.capture.dynamics import DynamicsConfig, training_dynamics
    from looptrace.models.looped import load_checkpoint
    from looptrace.models.train import train_model
    from looptrace.tasks import IGNORE, make_task


    torch.set_num_threads(1)
    train_dir = tmp_path / "rp-uniform"
    train_model(tiny_base, tiny_train_config(steps=20), "rp", "uniform", train_dir, progress=False)
    dump_cfg = DumpConfig(sequences={"val": 12}, batch_size=5, chunk_tokens=16, hidden_dtype="float32")
    df = training_dynamics(train_dir, DynamicsConfig(probe_sequences=12), dump_cfg, progress=False)
    assert df["step"].unique().sort().to_list() == [10, 20]
    assert df.filter(pl.col("step") == 20)["fraction"].unique().to_list() == [1.0]
    task = make_task("rp", {"kind": "running_parity", "length": 8})
    data = task.dataset("val", 12, 43)  # the checkpoint's val data seed
    mask = torch.from_numpy(data.targets != IGNORE)
    for name, step in (("checkpoints/step_000010.pt", 10), ("model.pt", 20)):
        model, _ = load_checkpoint(train_dir / name)
        with torch.no_grad():
            out = model(torch.from_numpy(data.tokens))
        h = torch.cat([out.hidden_init.unsqueeze(2), out.hidden], dim=2)[mask].double().numpy()  # [N, T+1, D]
        s = np.linalg.norm(np.diff(h, axis=1), axis=2)
        acc = (out.logits.argmax(-1) == torch.from_numpy(data.targets).unsqueeze(-1))[mask].double().mean(0)
        rows = df.filter(pl.col("step") == step).sort("loop")
        assert rows["loop"].to_list() == [1, 2, 3, 4]
        np.testing.assert_allclose(rows["step_norm_mean"], s.mean(axis=0), rtol=1e-5)
        np.testing.assert_allclose(rows["step_norm_median"], np.median(s, axis=0), rtol=1e-5)
        np.testing.assert_allclose(rows["accuracy"], acc.numpy(), atol=1e-12)
        assert (rows["n_tokens"] == int(mask.sum())).all()


def test_stage_cli_end_to_end_and_errors(tmp_path, tiny_base):
    import json

    import typer
    from typer.testing import CliRunner

    import looptrace.stages.dump as dump_stage
    import looptrace.stages.dynamics as dynamics_stage
    import looptrace.stages.geometry as stage
    from looptrace.models.train import train_model


    train_model(tiny_base, tiny_train_config(steps=10), "rp", "uniform", tmp_path / "train" / "rp-uniform",
                progress=False)
    params = tmp_path / "params.yaml"
    params.write_text("base: {seed: 0, threads: 1, device: cpu}\n"
                      "dump: {sequences: {fit: 6, val: 6, test: 5}, batch_size: 4, chunk_tokens: 20}\n"
                      "dynamics: {probe_sequences: 4}\n"
                      "geometry: {eps: {kl_prev: [0.001], argmax: [0.5]}}\n")
    runner = CliRunner()
    dump_app, app = typer.Typer(), typer.Typer()
    dump_app.command()(dump_stage.main)
    app.command()(stage.main)
    res = runner.invoke(dump_app, ["--model", "rp-uniform", "--params", str(params), "--train-root",
                                   str(tmp_path / "train"), "--out", str(tmp_path / "dump")])
    assert res.exit_code == 0, res.output
    args = ["--params", str(params), "--dump-root", str(tmp_path / "dump"), "--out", str(tmp_path / "geometry")]
    res = runner.invoke(app, ["--model", "rp-uniform", *args])
    assert res.exit_code == 0, res.output
    out = tmp_path / "geometry" / "rp-uniform"
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["token_loop.parquet", "loop_summary.parquet", "convergence.parquet", "dlr.parquet", "metrics.json",
         "manifest.json"])
    m = json.loads((out / "metrics.json").read_text())
    assert m["model"] == "rp-uniform"
    # training dynamics: its own stage (capture code), never part of the offline geometry stage
    dyn_app = typer.Typer()
    dyn_app.command()(dynamics_stage.main)
    res = runner.invoke(dyn_app, ["--model", "rp-uniform", "--params", str(params), "--train-root",
                                  str(tmp_path / "train"), "--out", str(tmp_path / "dynamics")])
    assert res.exit_code == 0, res.output
    dyn = json.loads((tmp_path / "dynamics" / "rp-uniform" / "metrics.json").read_text())
    assert dyn["training_dynamics"]["step"] == [5, 10]
    assert pl.read_parquet(tmp_path / "dynamics" / "rp-uniform" / "training_dynamics.parquet").height == 2 * 4
    from looptrace.tasks import IGNORE, make_task

    rp = make_task("rp", {"kind": "running_parity", "length": 8})
    n_test = int((rp.dataset("test", 5, 44).targets != IGNORE).sum())  # scored where the prefix is test's
    assert set(m["splits"]) == {"fit", "val", "test"} and m["splits"]["test"]["n_tokens"] == n_test
    assert set(m["splits"]["test"]["convergence"]) == {"kl_prev@0.001", "argmax@0.5"}
    res = runner.invoke(app, ["--model", "nope", *args])
    assert res.exit_code == 2 and "not found" in res.output and len(res.output.strip().splitlines()) == 1
    params.write_text("geometry: {epz: {}}\n")
    res = runner.invoke(app, ["--model", "rp-uniform", *args])
    assert res.exit_code == 2 and "unknown key 'epz' in params section 'geometry'" in res.output
