"""The certified fixed-point exit rule (``certified_fixed_point``, looptrace.rules.certified; SPEC §4, [BA]) and its
estimated twin: ρ̄_t / ρ_t flow store → geometry's token_loop.parquet → rule only when the store has the opt-in
``contraction_bound`` / ``contraction`` arrays; their exits equal a hand computation of the Banach bound from the
stored states; the certified rule refuses a store without an upper bound (too wide); both are offline-only."""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest

from looptrace.config import ConfigError, InputError
from looptrace.geometry import TOKEN_LOOP_COLUMNS, GeometryConfig, geometry_model
from looptrace.io.store.writer import write_store
from looptrace.io.tables import load_token_loop
from looptrace.rules import get_rule
from looptrace.rules.evaluate import ReadoutsConfig, evaluate_rule_on, readouts_model, rule_columns
from looptrace.rules.registry import resolve_rules
from looptrace.rules.scoring import CalibrationConfig
from tests.builders import two_group_arrays

T = 4


def _stores(root, contraction: bool, bound: bool = True) -> dict:
    """val / test stores of :func:`two_group_arrays`, with a known ρ_t in [0.2, 1.3) (≥ 1 on some loops) and an upper
    bound ρ̄_t ≥ ρ_t (NaN: none, a model wider than exact_width, unless ``bound``) if asked."""
    out, rhos = {}, {}
    for i, split in enumerate(("val", "test")):
        a = two_group_arrays(160, T, seed=3 + i)
        if contraction:
            rng = np.random.default_rng(10 + i)
            a["contraction"] = rng.uniform(0.2, 1.3, (160, T)).astype(np.float32)
            a["contraction"][:5] = 1.1  # never certified
            a["contraction_bound"] = (a["contraction"] * rng.uniform(1.0, 1.2, (160, T))).astype(np.float32)
            if not bound:
                a["contraction_bound"][:] = np.nan
        rhos[split] = a
        out[split] = write_store(root / f"{split}.zarr", a, {"split": split, "vocab_size": 2}, chunk_tokens=64,
                                 hidden_dtype="float32")
    return out, rhos


def _hand_exits(a: dict, eps: float, name: str = "contraction_bound") -> np.ndarray:
    """First t with ‖h_t − h_{t−1}‖/‖h_t‖ · ρ_t/(1 − ρ_t) ≤ ε (ρ_t < 1, from array ``name``), else T — token by token,
    in float64."""
    h = np.concatenate([a["hidden_init"][:, None], a["hidden"]], axis=1).astype(np.float64)
    out = []
    for i in range(h.shape[0]):
        d = T
        for t in range(1, T + 1):
            rho = float(a[name][i, t - 1])
            r = np.linalg.norm(h[i, t] - h[i, t - 1]) / np.linalg.norm(h[i, t])
            if rho < 1 and r * rho / (1 - rho) <= eps:
                d = t
                break
        out.append(d)
    return np.asarray(out)


def test_certified_rule_exits_equal_hand_computation(tmp_path):
    stores, arrays = _stores(tmp_path / "dump", contraction=True)
    geometry_model(stores, GeometryConfig(splits=("val", "test")), tmp_path / "geo", meta={"model": "m"},
                   progress=False)
    tl = pl.read_parquet(tmp_path / "geo" / "token_loop.parquet")
    # appended, the default columns unchanged
    assert tuple(tl.columns) == (*TOKEN_LOOP_COLUMNS, "contraction", "contraction_bound")
    test_rows = tl.filter(pl.col("split") == "test").sort("token", "loop")
    for name in ("contraction", "contraction_bound"):
        assert np.array_equal(test_rows[name].to_numpy(), arrays["test"][name].reshape(-1))

    rule = get_rule("certified_fixed_point")
    splits = load_token_loop(tmp_path / "geo" / "token_loop.parquet", columns=rule_columns([rule]))
    res = evaluate_rule_on(rule, splits["val"], splits["test"], ReadoutsConfig(), CalibrationConfig(n_quantiles=11))
    assert res is not None
    eps = float(res.thresholds[res.chosen])
    want = _hand_exits(arrays["test"], eps)
    assert np.array_equal(res.test_exits, want)
    assert (want[:5] == T).all() and (want < T).any()  # ρ ≥ 1 never fires; some tokens are certified early
    # every operating point of the grid too (mean test depth per ε)
    for k, e in enumerate(res.thresholds):
        assert res.test.mean_depth[k] == pytest.approx(_hand_exits(arrays["test"], float(e)).mean(), abs=1e-12)
    # the estimated twin: the same bound from ρ_t (``contraction``)
    est = evaluate_rule_on(get_rule("estimated_fixed_point"), *load_token_loop(
        tmp_path / "geo" / "token_loop.parquet", columns=rule_columns([get_rule("estimated_fixed_point")])).values(),
        ReadoutsConfig(), CalibrationConfig(n_quantiles=11))
    assert est is not None
    e = float(est.thresholds[est.chosen])
    assert np.array_equal(est.test_exits, _hand_exits(arrays["test"], e, "contraction"))

    # on the Pareto front / chosen table beside the other rules
    cfg = ReadoutsConfig(rules=("fixed", "entropy", "oracle", "certified_fixed_point"))
    readouts_model(tmp_path / "geo", cfg, CalibrationConfig(n_quantiles=11), tmp_path / "out", meta={"model": "m"},
                   progress=False)
    chosen = pl.read_parquet(tmp_path / "out" / "chosen.parquet")
    assert "certified_fixed_point" in chosen["rule"].to_list()


def test_default_outputs_have_no_contraction_and_the_rule_says_how_to_turn_it_on(tmp_path):
    stores, _ = _stores(tmp_path / "dump", contraction=False)
    geometry_model(stores, GeometryConfig(splits=("val", "test")), tmp_path / "geo", meta={"model": "m"},
                   progress=False)
    assert tuple(pl.read_parquet_schema(tmp_path / "geo" / "token_loop.parquet")) == TOKEN_LOOP_COLUMNS
    rule = get_rule("certified_fixed_point")
    with pytest.raises(InputError,
                       match="column 'contraction_bound' is missing: it is stored only with dump.contraction"):
        load_token_loop(tmp_path / "geo" / "token_loop.parquet", columns=rule_columns([rule]))
    assert "certified_fixed_point" not in ReadoutsConfig().rules  # opt-in: not a default rule
    assert "estimated_fixed_point" not in ReadoutsConfig().rules


def test_certified_rule_refuses_a_model_without_an_upper_bound(tmp_path):
    """Wider than dump.contraction.exact_width: no ρ̄_t (NaN); the certified rule says so in one line, the estimated
    one runs."""
    stores, _ = _stores(tmp_path / "dump", contraction=True, bound=False)
    geometry_model(stores, GeometryConfig(splits=("val", "test")), tmp_path / "geo", meta={"model": "m"},
                   progress=False)
    for name, ok in (("certified_fixed_point", False), ("estimated_fixed_point", True)):
        rule = get_rule(name)
        splits = load_token_loop(tmp_path / "geo" / "token_loop.parquet", columns=rule_columns([rule]))
        if ok:
            assert evaluate_rule_on(rule, splits["val"], splits["test"], ReadoutsConfig(),
                                    CalibrationConfig(n_quantiles=11)) is not None
        else:
            with pytest.raises(InputError, match="certified_fixed_point.*exact_width.*estimated_fixed_point"):
                evaluate_rule_on(rule, splits["val"], splits["test"], ReadoutsConfig(),
                                 CalibrationConfig(n_quantiles=11))


@pytest.mark.parametrize("section", ["latency.rules", "generate.rules"])
@pytest.mark.parametrize(("name", "signal"), [("certified_fixed_point", "contraction_bound"),
                                              ("estimated_fixed_point", "contraction")])
def test_certified_rule_is_offline_only(section, name, signal):
    with pytest.raises(ConfigError, match=f"{section}: rule '{name}' cannot run online .*'{signal}'"):
        resolve_rules(["entropy", name], section, online=True)
    assert get_rule(name).online is None
