"""Geometry (SPEC §2): block metrics against closed-form trajectories, convergence depth, DLR, and the
streamed stage on small stores built with ``pipeline.store.write_store``."""

from __future__ import annotations

import math

import numpy as np
import pytest

from pipeline.config import ConfigError
from pipeline.geometry import (
    GeometryConfig,
    argmax_differs,
    convergence_depth,
    drift_to_loop_ratio,
    group_handoffs,
    step_metrics,
)


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
    r, T, D = 0.6, 6, 4
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
