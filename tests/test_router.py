"""[FP]'s router on convergence labels vs the stabilisation rules (looptrace.diagnose.router): rows, the
across-seed comparison by hand, and the summary's words."""

from __future__ import annotations

import math

import polars as pl
import pytest
from scipy.stats import t as student_t

from looptrace.diagnose.config import DiagnoseConfig
from looptrace.diagnose.router import is_router, router_comparisons, router_model_rows
from looptrace.diagnose.words import router_lines


def _chosen(router: float, stable: float, kl: float) -> pl.DataFrame:
    rows = [("gate:logreg-converged", "gates", router), ("argmax_stable", "readouts", stable),
            ("kl_prev", "readouts", kl), ("entropy", "readouts", 1.0)]
    return pl.DataFrame([{"rule": r, "source": s, "val_depth": d, "test_depth": d, "test_depth_lo": d - 0.1,
                          "test_depth_hi": d + 0.1, "test_accuracy": 0.99, "n_boot": 200, "n_sequences": 50}
                         for r, s, d in rows])


def _info(model: str) -> dict:
    return {"model": model, "task": "rp", "regime": "geometric", "regime_kind": "geometric"}


def test_rows_only_for_models_with_a_router():
    assert is_router("gate:mlp-converged") and not is_router("gate:logreg-consistent") and not is_router("converged")
    base = ("argmax_stable", "kl_prev")
    rows = router_model_rows(_info("rp-geometric-s0"), _chosen(5.0, 2.0, 2.9), base)
    assert [(r["rule"], r["role"]) for r in rows] == [("gate:logreg-converged", "router"),
                                                       ("argmax_stable", "stabilisation"), ("kl_prev", "stabilisation")]
    no_router = _chosen(5.0, 2.0, 2.9).filter(pl.col("rule") != "gate:logreg-converged")
    assert router_model_rows(_info("rp-geometric-s0"), no_router, base) == []


def test_comparison_across_seeds_by_hand():
    cfg = DiagnoseConfig(gap_tol=0.5)
    seeds = [(5.0, 2.0, 4.9), (5.2, 2.1, 5.1), (5.4, 2.2, 5.3)]  # (router, argmax_stable, kl_prev) per seed
    rows = pl.DataFrame([r for i, d in enumerate(seeds)
                         for r in router_model_rows(_info(f"rp-geometric-s{i}"), _chosen(*d), cfg.router_baselines)])
    cr = router_comparisons(rows, cfg)
    m0 = cr.filter((pl.col("name") == "rp-geometric-s0") & (pl.col("baseline") == "argmax_stable")).row(0, named=True)
    assert (m0["router_depth"], m0["router_depth_lo"], m0["baseline_depth_hi"]) == (5.0, 4.9, 2.1)
    assert m0["outcome"] == "higher"  # [4.9, 5.1] vs [1.9, 2.1]: disjoint, 3 loops apart
    g = cr.filter((pl.col("scope") == "group") & (pl.col("baseline") == "argmax_stable")).row(0, named=True)
    # mean ± t_2 · sd / √3 over the seeds: router 5.2 ± 4.303 · 0.2 / √3, argmax_stable 2.1 ± 4.303 · 0.1 / √3
    assert g["n_seeds"] == 3 and g["router_depth"] == pytest.approx(5.2)
    assert g["router_depth_hi"] - 5.2 == pytest.approx(student_t.ppf(0.975, 2) * 0.2 / math.sqrt(3))
    assert g["baseline_depth_lo"] == pytest.approx(2.1 - student_t.ppf(0.975, 2) * 0.1 / math.sqrt(3))
    assert g["outcome"] == "higher"
    gk = cr.filter((pl.col("scope") == "group") & (pl.col("baseline") == "kl_prev")).row(0, named=True)
    assert gk["outcome"] == "within noise"  # 5.2 vs 5.1, intervals ± 0.5
    text = "\n".join(router_lines(cr, cfg.gap_tol))
    assert "| rp-geometric | 3 | gate:logreg-converged | argmax_stable |" in text
    assert "Against argmax_stable: the router is higher on 1, lower on 0 and within noise or tolerance on 0 of 1 " \
           "task × regime — as [FP] found, the router needs more depth." in text
    assert "Against kl_prev: the router is higher on 0, lower on 0 and within noise or tolerance on 1" in text


def test_no_rows_give_an_empty_table_with_columns():
    cr = router_comparisons(pl.DataFrame(), DiagnoseConfig())
    assert cr.height == 0 and "outcome" in cr.columns


def test_a_point_not_within_delta_is_flagged():
    cfg = DiagnoseConfig()
    ch = _chosen(5.0, 2.0, 4.9).with_columns(within_delta=pl.col("rule") != "argmax_stable")
    cr = router_comparisons(pl.DataFrame(router_model_rows(_info("rp-geometric-s0"), ch, cfg.router_baselines)), cfg)
    g = cr.filter((pl.col("scope") == "group") & (pl.col("baseline") == "argmax_stable")).row(0, named=True)
    assert g["router_within_delta"] and not g["baseline_within_delta"]
    text = "\n".join(router_lines(cr, cfg.gap_tol))
    assert "| 99.0 % | 99.0 % † |" in text and "† no threshold of this rule reaches" in text
