"""[FP]'s comparison: a router (refit gate) trained on convergence labels vs the training-free stabilisation rules.

[FP] reports that halting a token once its output stabilises reaches uniform-depth quality at 4.94 of 8 loops,
while a linear router trained on the same model's convergence labels needs nearly full depth. Here the router is
every refit gate with the ``converged`` labels (``gate:<clf>-converged``, SPEC §6; the gates stage) and the
stabilisation rules are ``diagnose.router_baselines`` of the readouts stage (default ``argmax_stable``, Huginn's
counter, and ``kl_prev``). All are read at their val-chosen operating points — the same criterion for every rule
(val accuracy within δ of full depth, SPEC §4) — so their test depths are compared at matched accuracy (a rule none of
whose thresholds reaches δ is flagged ``*_within_delta`` False: its point is its most accurate one): per
model on the bootstrap intervals, per task × regime on the Student-t interval over seeds, with
:func:`looptrace.estimates.compare` and ``diagnose.gap_tol`` (as the verdicts).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import polars as pl

from looptrace.diagnose.config import DiagnoseConfig
from looptrace.estimates import Interval, across_seeds, compare, from_row
from looptrace.project import split_seed

#: Suffix of a refit gate trained on convergence labels (``gate:logreg-converged``).
ROUTER_SUFFIX = "-converged"


#: Columns of ``convergence_router.parquet``.
COMPARISON_SCHEMA = {"scope": pl.String, "name": pl.String, "task": pl.String, "regime_kind": pl.String,
                     "n_seeds": pl.Int64, "router": pl.String, "baseline": pl.String,
                     **{f"{w}_depth{s}": pl.Float64 for w in ("router", "baseline") for s in ("", "_lo", "_hi")},
                     "router_accuracy": pl.Float64, "baseline_accuracy": pl.Float64,
                     "router_within_delta": pl.Boolean, "baseline_within_delta": pl.Boolean, "outcome": pl.String}


def is_router(rule: str) -> bool:
    """A refit gate on [FP]'s convergence labels."""
    return rule.startswith("gate:") and rule.endswith(ROUTER_SUFFIX)


def router_model_rows(info: dict, chosen: pl.DataFrame, baselines: Sequence[str]) -> list[dict]:
    """The chosen points of one model's routers and stabilisation rules (one row each; none without a router).

    Args:
        info: model, task, regime, regime_kind.
        chosen: the model's readouts + gates ``chosen`` rows (rule, source, test_depth with _lo/_hi,
            test_accuracy, val_depth, n_boot, n_sequences).
        baselines: ``diagnose.router_baselines``.
    """
    rules = chosen["rule"].to_list()
    if not any(is_router(r) for r in rules):
        return []
    out = []
    for r in chosen.iter_rows(named=True):
        role = "router" if is_router(r["rule"]) else "stabilisation" if r["rule"] in baselines else None
        if role is None:
            continue
        out.append({k: info[k] for k in ("model", "task", "regime", "regime_kind")}
                   | {"n_loops": info.get("n_loops"), "source": r.get("source"), "rule": r["rule"], "role": role,
                      **{k: r.get(k) for k in ("val_depth", "test_depth", "test_depth_lo", "test_depth_hi",
                                               "test_accuracy", "within_delta", "n_boot", "n_sequences")}})
    return out


def router_comparisons(rows: pl.DataFrame, cfg: DiagnoseConfig) -> pl.DataFrame:
    """Router vs each stabilisation rule, per model and per task × regime (across seeds).

    Returns:
        DataFrame: scope (``model`` | ``group``), name, task, regime_kind, n_seeds, router, baseline,
        router_depth(_lo/_hi), baseline_depth(_lo/_hi), router_accuracy, baseline_accuracy (means over seeds),
        outcome (router is ``lower`` / ``higher`` / ``within noise`` / ``within tolerance`` than the baseline).
    """
    if not rows.height:
        return pl.DataFrame(schema=COMPARISON_SCHEMA)
    rows = rows.with_columns(group=pl.col("model").map_elements(lambda m: split_seed(m)[0], return_dtype=pl.String))
    out = []
    for scope, key in (("model", "model"), ("group", "group")):
        for name in dict.fromkeys(rows[key].to_list()):
            sub = rows.filter(pl.col(key) == name)
            routers = sub.filter(pl.col("role") == "router")["rule"].unique(maintain_order=True).to_list()
            bases = sub.filter(pl.col("role") == "stabilisation")["rule"].unique(maintain_order=True).to_list()
            for ro in routers:
                for ba in bases:
                    a, acc_a, n, in_a = _figure(sub, ro)
                    b, acc_b, _, in_b = _figure(sub, ba)
                    out.append({"scope": scope, "name": name, "task": sub["task"][0],
                                "regime_kind": sub["regime_kind"][0], "n_seeds": n, "router": ro, "baseline": ba,
                                "router_depth": a.estimate, "router_depth_lo": a.lo, "router_depth_hi": a.hi,
                                "baseline_depth": b.estimate, "baseline_depth_lo": b.lo, "baseline_depth_hi": b.hi,
                                "router_accuracy": acc_a, "baseline_accuracy": acc_b,
                                "router_within_delta": in_a, "baseline_within_delta": in_b,
                                "outcome": compare(a, b, cfg.gap_tol)})
    return pl.DataFrame(out, schema=COMPARISON_SCHEMA)


def _figure(sub: pl.DataFrame, rule: str) -> tuple[Interval, float, int, bool]:
    """A rule's test depth over the models of ``sub`` (one: its bootstrap interval; several: t over seeds), its mean
    test accuracy, the model count, and whether every model's chosen point is within δ of full depth on val (False:
    no threshold reached it, so the accuracy is not matched)."""
    rs = list(sub.filter(pl.col("rule") == rule).iter_rows(named=True))
    T = max((int(r["n_loops"]) for r in rs if r.get("n_loops") is not None), default=None)
    # across seeds within [1, T] (a depth interval never leaves its range)
    iv = across_seeds([from_row(r, "test_depth") for r in rs], bounds=(1.0, float(T)) if T and T > 1 else None)
    accs = [float(r["test_accuracy"]) for r in rs if r.get("test_accuracy") is not None]
    within = all(r.get("within_delta") is not False for r in rs)
    return iv, (sum(accs) / len(accs) if accs else math.nan), len(rs), within
