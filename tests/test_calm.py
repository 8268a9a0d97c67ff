"""CALM (Schuster et al. 2022) as the ``calm`` exit rule (looptrace.rules.calm): its softmax response against a full
softmax, the Hoeffding–Bentkus p-value and the Learn-then-Test choice by hand, and its chosen point in the readouts
stage's outputs."""

from __future__ import annotations

import math

import numpy as np
import polars as pl
import pytest

from looptrace.config import ConfigError
from looptrace.intervals import IntervalsConfig
from looptrace.io.tables import load_token_loop
from looptrace.rules import get_rule
from looptrace.rules.calm import NEVER, calm_grid, consistency_risks, hb_pvalue, ltt_choice, softmax_response
from looptrace.rules.readouts import ReadoutsConfig, readouts_model, rule_columns
from looptrace.rules.registry import loop_signals
from looptrace.rules.scoring import CalibrationConfig, exit_depths
from tests.builders import token_loop_splits, write_token_loop


def test_softmax_response_equals_the_top_two_probability_gap():
    rng = np.random.default_rng(0)
    z = rng.normal(size=(50, 3, 7)) * 3
    p = np.exp(z - z.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    ps, zs = np.sort(p, -1), np.sort(z, -1)
    got = softmax_response({"max_prob": ps[..., -1], "margin": zs[..., -1] - zs[..., -2]})
    assert got == pytest.approx(ps[..., -1] - ps[..., -2], abs=1e-12)


def test_hoeffding_bentkus_pvalue_by_hand():
    # n = 10, δ = 0.2. R̂ = 0: Hoeffding (1 − δ)^n = 0.8^10; Bentkus e · P(Bin(10, .2) ≤ 0) = e · 0.8^10
    assert hb_pvalue(0.0, 10, 0.2) == pytest.approx(0.8 ** 10)
    # R̂ = 0.1: h = 0.1 log(0.1/0.2) + 0.9 log(0.9/0.8); Bentkus e · (0.8^10 + 10 · 0.2 · 0.8^9) > 1
    h = 0.1 * math.log(0.5) + 0.9 * math.log(0.9 / 0.8)
    assert hb_pvalue(0.1, 10, 0.2) == pytest.approx(math.exp(-10 * h))
    # n = 200, δ = 0.1, R̂ = 0.02: Bentkus e · P(Bin(200, .1) ≤ 4) is the smaller one
    b4 = sum(math.comb(200, k) * 0.1 ** k * 0.9 ** (200 - k) for k in range(5))
    h = 0.02 * math.log(0.2) + 0.98 * math.log(0.98 / 0.9)
    assert hb_pvalue(0.02, 200, 0.1) == pytest.approx(min(math.exp(-200 * h), math.e * b4))
    assert math.e * b4 < math.exp(-200 * h)
    assert hb_pvalue(0.3, 10, 0.2) == 1.0  # R̂ ≥ δ: no evidence


def test_learn_then_test_by_hand():
    # 2 sequences × 2 tokens, T = 3; argmax_T = [1, 1, 0, 2]
    argmax = np.array([[0, 1, 1], [1, 1, 1], [0, 0, 0], [1, 2, 2]])
    seq = np.array([7, 7, 9, 9])
    depths = np.array([[3, 3, 3, 3],    # λ = NEVER: all consistent -> risk 0
                       [2, 1, 1, 2],    # tokens 0..3 consistent -> 0
                       [1, 1, 1, 1]])   # token 0 (0 ≠ 1) and token 3 (1 ≠ 2) wrong -> seq 7: 1/2, seq 9: 1/2 -> 0.5
    risks, n = consistency_risks(depths, argmax, seq)
    assert n == 2 and risks.tolist() == [0.0, 0.0, 0.5]
    th = np.array([NEVER, 0.9, 0.1])
    # δ = 0.5, ε = 0.3: p(0) = 0.5^2 = 0.25 ≤ 0.3 for the first two, p(0.5) = 1 > 0.3 -> λ̂ = 0.9 (index 1)
    k, p = ltt_choice(th, risks, n, 0.5, 0.3)
    assert k == 1 and p.tolist() == pytest.approx([0.25, 0.25, 1.0])
    # ε = 0.2: already the second candidate fails -> the walk stops at NEVER (full depth)
    assert ltt_choice(th, risks, n, 0.5, 0.2)[0] == 0
    # the walk is in order of λ, whatever the order of the candidates
    assert ltt_choice(th[::-1], risks[::-1], n, 0.5, 0.3)[0] == 1


def test_grid_starts_at_never_and_ends_at_zero():
    g = calm_grid()
    assert g.size == 51 and g[0] == NEVER and g[1] == 1.0 and g[-1] == 0.0 and (np.diff(g) < 0).all()


def test_calm_is_registered_and_chosen_by_learn_then_test(tmp_path):
    rule = get_rule("calm")
    assert rule.kind == "posthoc" and rule.choose is not None
    splits = token_loop_splits(n=400, T=4, seed=3)
    geo = tmp_path / "geometry" / "m"
    write_token_loop(geo / "token_loop.parquet", splits)
    cfg = ReadoutsConfig(rules=("fixed", "top1", "calm"), calm_delta=0.1, calm_epsilon=0.05)
    readouts_model(geo, cfg, CalibrationConfig(), tmp_path / "readouts", progress=False,
                   intervals=IntervalsConfig(n_boot=0))
    ch = pl.read_parquet(tmp_path / "readouts" / "chosen.parquet").filter(pl.col("rule") == "calm").row(0, named=True)
    # independently: scores from the full formula, exits, per-sequence risks and the walk
    val = load_token_loop(geo / "token_loop.parquet", columns=rule_columns([rule]))["val"]
    s = val.loop["max_prob"] * (1 - np.exp(-val.loop["margin"]))
    th = calm_grid()
    d = exit_depths(s, th, "ge")
    am, seq = val.loop["argmax"], val.fields["sequence"]
    wrong = am[np.arange(am.shape[0]), d - 1] != am[:, -1]  # [K, token]
    units = np.unique(seq)
    risk = np.array([np.mean([w[seq == u].mean() for u in units]) for w in wrong])
    k = 0
    for j in range(1, th.size):  # th is in decreasing order
        if hb_pvalue(risk[j], units.size, 0.1) > 0.05:
            break
        k = j
    assert ch["threshold"] == pytest.approx(th[k])
    assert ch["val_depth"] == pytest.approx(d[k].mean())
    assert 0 < k < th.size - 1  # a non-trivial choice on this toy model
    assert rule.score_of(loop_signals(val.loop, 4)) == pytest.approx(s, rel=1e-12)


def test_calm_config_errors():
    with pytest.raises(ConfigError, match="calm_delta and readouts.calm_epsilon must be in"):
        ReadoutsConfig(calm_delta=0.0)
