"""Diagnose on the halting regimes: the verdict's "native" is the regime's own exit, and [AD]'s claims
count a decoupled RecurTrace trajectory as fixed-prior trained."""

from __future__ import annotations

import math

import polars as pl
import pytest

from looptrace.diagnose.ad_claims import ad_claims
from looptrace.diagnose.config import DiagnoseConfig, fixed_prior_trajectory
from looptrace.diagnose.verdicts import group_verdicts, native_rule
from looptrace.diagnose.verdicts import verdict as model_verdict
from tests.test_diagnose import FIX, _dx, _tables


def _with_native(chosen: pl.DataFrame, dx: pl.DataFrame, rows: dict[str, float]) -> tuple[pl.DataFrame, pl.DataFrame]:
    """Add native-kind rules (rule -> test = val depth, interval ± 0.1; D@X = depth + 0.5) to one model's tables."""
    base = chosen.row(0, named=True)
    new = [{**base, "rule": r, "kind": "native", "val_depth": d, "test_depth": d, "test_depth_lo": d - 0.1,
            "test_depth_hi": d + 0.1} for r, d in rows.items()]
    dbase = dx.row(0, named=True)
    dnew = [{**dbase, "rule": r, "kind": "native", "d_at": d + 0.5, "d_at_lo": d + 0.4, "d_at_hi": d + 0.6,
             "val_d_at": d + 0.5} for r, d in rows.items()]
    return pl.concat([chosen, pl.DataFrame(new, schema=chosen.schema)]), pl.concat([dx, pl.DataFrame(dnew, schema=dx.schema)])


@pytest.mark.parametrize("kind,expect_rule,expect_depth", [
    ("joint", "q_exit", 4.5),           # PonderNet's Q-exit, though gate_step / act_exit exit earlier on val
    ("recurtrace", "gate_step", 3.0),   # RecurTrace's per-step head
    ("act", "act_exit", 2.0),           # ACT's cumulative halting mass
    (None, "act_exit", 2.0),            # an adapter's run (no looptrace regime): the best native rule on val
])
def test_native_verdict_is_the_regimes_own_exit(kind, expect_rule, expect_depth):
    chosen, dx, oracle, fails = _tables(fixed=FIX, posthoc=(2.25, 2.0, 2.5), oracle=(1.5, 1.4, 1.6))
    chosen, dx = _with_native(chosen, dx, {"q_exit": 4.5, "gate_step": 3.0, "act_exit": 2.0})
    m = {"model": "t-r", "task": "t", "regime": "r", "regime_kind": kind, "n_loops": 6}
    v = model_verdict(m, chosen, dx, oracle, fails.with_columns(model=pl.lit("t-r")), DiagnoseConfig())
    assert v["native_rule"] == expect_rule
    assert v["native_depth"] == pytest.approx(expect_depth)
    assert (v["native_depth_lo"], v["native_depth_hi"]) == pytest.approx((expect_depth - 0.1, expect_depth + 0.1))
    assert v["dx_native"] == pytest.approx(expect_depth + 0.5)
    # q_exit at 4.5 is higher than best 2.25 by > gap_tol: the joint model is readout-limited by its own gate;
    # gate_step at 3.0 [2.9, 3.1] vs 2.25 [2.0, 2.5] also higher (0.75 ≥ 0.5); act_exit 2.0 is not
    assert v["reason"] == {"q_exit": "native_gate", "gate_step": "native_gate", "act_exit": "below_ceiling"}[expect_rule]
    g = group_verdicts(pl.DataFrame([v]), DiagnoseConfig())
    assert g["native_rules"][0] == expect_rule


def test_native_rule_not_run_means_no_native_figure():
    chosen, dx, oracle, fails = _tables(fixed=FIX, posthoc=(2.25, 2.0, 2.5), oracle=(1.5, 1.4, 1.6))
    chosen, dx = _with_native(chosen, dx, {"q_exit": 4.5})  # a RecurTrace model whose gate_step was not run
    m = {"model": "t-r", "task": "t", "regime": "r", "regime_kind": "recurtrace", "n_loops": 6}
    v = model_verdict(m, chosen, dx, oracle, fails.with_columns(model=pl.lit("t-r")), DiagnoseConfig())
    assert v["native_rule"] is None and math.isnan(v["native_depth"]) and math.isnan(v["dx_native"])
    assert native_rule("recurtrace", ["q_exit"]) is None
    assert native_rule("joint", ["q_exit", "gate_step"]) == "q_exit"
    assert native_rule("geometric", []) == "*"


def test_fixed_prior_trajectory():
    assert fixed_prior_trajectory("uniform") and fixed_prior_trajectory("geometric")
    assert fixed_prior_trajectory("recurtrace", {"kind": "recurtrace", "prior": "geometric"})  # detach default true
    assert fixed_prior_trajectory("recurtrace", {"kind": "recurtrace", "detach": True, "loop_memory": True})
    assert not fixed_prior_trajectory("recurtrace", {"kind": "recurtrace", "detach": False})
    for k in ("joint", "act", "final", None):
        assert not fixed_prior_trajectory(k, {"kind": k})


def _meta(rows: list[tuple[str, str, bool, bool | None]]) -> pl.DataFrame:
    """(model, regime kind, fixed_prior, loop_memory) rows of task t."""
    return pl.DataFrame({"model": [r[0] for r in rows], "task": ["t"] * len(rows),
                         "regime": [r[0].split("-")[1] for r in rows], "regime_kind": [r[1] for r in rows],
                         "n_loops": [6] * len(rows), "fixed_prior": [r[2] for r in rows],
                         "loop_memory": [r[3] for r in rows]},
                        schema_overrides={"loop_memory": pl.Boolean})


def test_ad_claims_count_decoupled_recurtrace_as_fixed_prior():
    meta = _meta([("t-recurtrace", "recurtrace", True, None), ("t-recurtrace_flow", "recurtrace", False, None),
                  ("t-recurtrace_mem", "recurtrace", True, True), ("t-joint", "joint", False, None),
                  ("t-act", "act", False, None)])
    dx = _dx([
        ("t-recurtrace", "fixed", "fixed", 95, (3.0, 3.0, 3.0)), ("t-recurtrace", "top1", "posthoc", 95, (1.4, 1.3, 1.5)),
        ("t-recurtrace", "gate:g", "gate", 95, (1.5, 1.4, 1.6)), ("t-recurtrace", "gate_step", "native", 95, (2.0, 1.9, 2.1)),
        ("t-recurtrace_flow", "fixed", "fixed", 95, (3.0, 3.0, 3.0)),
        ("t-recurtrace_flow", "top1", "posthoc", 95, (2.9, 2.8, 3.0)),
        ("t-recurtrace_flow", "gate:g", "gate", 95, (1.0, 1.0, 1.0)),
        # the memory model's readout is the best of all, but a joint model without memory is not compared with it
        ("t-recurtrace_mem", "fixed", "fixed", 95, (2.0, 2.0, 2.0)),
        ("t-recurtrace_mem", "entropy", "posthoc", 95, (1.1, 1.0, 1.2)),
        ("t-recurtrace_mem", "gate:g", "gate", 95, (1.2, 1.1, 1.3)),
        ("t-joint", "fixed", "fixed", 95, (4.0, 4.0, 4.0)),
        ("t-joint", "q_exit", "native", 95, (4.5, 4.3, 4.7)),
        ("t-joint", "gate_step", "native", 95, (1.2, 1.1, 1.3)),  # not the joint gate's own exit: ignored by (b)
        ("t-joint", "gate:g", "gate", 95, (3.8, 3.7, 3.9)),
        ("t-act", "fixed", "fixed", 95, (4.0, 4.0, 4.0)), ("t-act", "gate:g", "gate", 95, (1.0, 1.0, 1.0)),
    ])
    claims = {c["claim"]: c for c in ad_claims(meta, dx, DiagnoseConfig(), gates_present=True)}
    # (a) on the two decoupled groups (with and without memory), not on flow / joint / act
    assert [d["group"] for d in claims["a"]["details"]] == ["t-recurtrace", "t-recurtrace_mem"]
    assert claims["a"]["status"] == "holds"
    # (b): joint's own q_exit 4.5 vs the memory-less fixed-prior peer's top1 1.4 (not the memory model's 1.1)
    (b,) = claims["b"]["details"]
    assert b["per_seed"][0]["fixed_prior_model"] == "t-recurtrace" and b["per_seed"][0]["native_dx"] == 4.5
    assert b["fixed_prior_posthoc_dx"]["estimate"] == pytest.approx(1.4) and b["result"] == "holds"
    # (c): decoupled groups expected strong, joint weak; flow and act are neither (not tested)
    c = {d["group"]: d for d in claims["c"]["details"]}
    assert set(c) == {"t-recurtrace", "t-recurtrace_mem", "t-joint"}
    assert c["t-recurtrace"]["expected"] == "strong" and c["t-recurtrace"]["result"] == "holds"
    assert c["t-joint"]["expected"] == "weak"
    assert ("t-recurtrace (recurtrace, trajectory under a fixed prior (head decoupled), 1 seed): best refit gate"
            in " ".join(claims["c"]["sentences"]))


def test_ad_claims_without_regime_definitions_use_kind_defaults():
    """Tables without fixed_prior / loop_memory columns (older diagnose inputs): a recurtrace kind has detach's
    default (decoupled), so it counts; uniform/geometric as before."""
    meta = pl.DataFrame({"model": ["t-rt", "t-joint"], "task": ["t", "t"], "regime": ["rt", "joint"],
                         "regime_kind": ["recurtrace", "joint"]})
    dx = _dx([("t-rt", "fixed", "fixed", 95, (3.0, 3.0, 3.0)), ("t-rt", "top1", "posthoc", 95, (1.4, 1.3, 1.5)),
              ("t-joint", "q_exit", "native", 95, (4.5, 4.3, 4.7))])
    claims = {c["claim"]: c for c in ad_claims(meta, dx, DiagnoseConfig(), gates_present=False)}
    assert [d["group"] for d in claims["a"]["details"]] == ["t-rt"]
    assert claims["b"]["details"][0]["per_seed"][0]["fixed_prior_model"] == "t-rt"
