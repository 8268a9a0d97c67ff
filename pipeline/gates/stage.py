"""The ``gates`` stage over models: fit, calibrate on val, report on test, cross-regime transfer."""

from __future__ import annotations

import json
import math
import pickle
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
from looptrace.config import to_dict
from looptrace.gates.config import SPLITS, GatesConfig
from looptrace.gates.features import check_stats_available, read_targets
from looptrace.gates.fit import ModelGates, analysis_threads, compatible, fit_model_gates, predict_split
from looptrace.io.artifacts import atomic_dir, jsonable, write_outputs
from looptrace.io.parallel import DaskRunner
from looptrace.io.tables import SplitArrays
from looptrace.rules.scoring import (
    CalibrationConfig,
    RuleResult,
    d_at,
    evaluate_depths,
    exit_depths,
    quantile_grid,
    result_frames,
)


def evaluate_gate(rule: str, p_val: np.ndarray, p_test: np.ndarray, val: SplitArrays, test: SplitArrays,
                  cal: CalibrationConfig) -> RuleResult:
    """Calibrate a gate on val and score it on test with the readouts operating-point code.

    The grid is ``quantile_grid`` of val P(stop) at loops 1..T − 1 (the loops where the gate can move
    an exit), frozen and applied to both splits with d = min{t : P(stop)_t ≥ γ} (T when never met).

    Args:
        rule: ``gate:<name>``.
        p_val, p_test: [token, loop] P(stop).
        val, test: the splits' targets.
        cal: the ``calibration`` section (grid size and δ).

    Returns:
        RuleResult of kind ``gate``.
    """
    grid = quantile_grid(p_val[:, :-1], cal.n_quantiles)
    return evaluate_depths(rule, grid, exit_depths(p_val, grid, "ge"), exit_depths(p_test, grid, "ge"),
                           val, test, cal.delta, kind="gate")


def acc_at_budget(r: RuleResult, budget: float) -> float:
    """Best test accuracy among a rule's operating points with mean depth ≤ budget (NaN if none)."""
    ok = r.test.mean_depth <= budget + 1e-12
    return float(r.test.accuracy[ok].max()) if ok.any() else math.nan


# ----------------------------------------------------------------------------------------------
# The stage
# ----------------------------------------------------------------------------------------------

CROSS_SCHEMA = {"task": pl.String, "fit_model": pl.String, "eval_model": pl.String, "gate": pl.String,
                "labels": pl.String, "rule": pl.String, "mode": pl.String, "x": pl.Float64, "d_at": pl.Float64,
                "chosen_test_accuracy": pl.Float64, "chosen_test_depth": pl.Float64, "budget": pl.Float64,
                "acc_at_budget": pl.Float64, "full_depth_accuracy": pl.Float64}


def _model_metrics(mg: ModelGates, results: Sequence[RuleResult], val: SplitArrays, test: SplitArrays,
                   cal: CalibrationConfig, meta: dict) -> dict:
    x0 = cal.dx[0]
    rules = {}
    for r in results:
        g = mg.gates[r.rule.removeprefix("gate:")]
        k = r.chosen
        rules[r.rule] = {
            "gate": g.spec.gate, "labels": g.spec.labels, "kind": r.kind, "fit": g.info,
            "d_at": {f"{x:g}": d_at(r.test.mean_depth, r.test.accuracy, x) for x in cal.dx},
            "chosen": {"threshold": float(r.thresholds[k]), "val_depth": float(r.val.mean_depth[k]),
                       "val_accuracy": float(r.val.accuracy[k]), "test_depth": float(r.test.mean_depth[k]),
                       "test_accuracy": float(r.test.accuracy[k])}}
    reach = [(rules[r.rule]["d_at"][f"{x0:g}"], r.rule) for r in results
             if not math.isnan(rules[r.rule]["d_at"][f"{x0:g}"])]
    best = min(reach) if reach else (math.nan, None)
    return {**meta, "n_loops": mg.n_loops, "d_model": mg.d_model,
            "n_tokens": {"fit_used": mg.info["fit_tokens"], "fit": mg.info["fit_tokens_available"],
                         "val": int(val.loss.shape[0]), "test": int(test.loss.shape[0])},
            "features": {"names": mg.features.feature_names, **{k: v for k, v in mg.info.items()
                                                                 if k.startswith(("n_features", "pca"))}},
            "full_depth_accuracy": {"val": float(val.correct[:, -1].mean()), "test": float(test.correct[:, -1].mean())},
            "best_gate": {"x": x0, "rule": best[1], "d_at": best[0]}, "rules": rules}


def gates_stage(stores: dict[str, dict[str, Any]], cfg: GatesConfig, cal: CalibrationConfig, out_root: Path | str,
                base_seed: int = 0,
                meta: dict[str, dict] | None = None, tasks: dict[str, str | None] | None = None,
                progress: bool = True, threads: int | None = None, runner: DaskRunner | None = None) -> dict:
    """The ``gates`` stage over several models: fit, calibrate, report, cross-regime transfer.

    Writes, atomically (a temporary sibling directory replaces ``out_root`` at the end):
    ``<model>/{operating_points,pareto,dx,chosen,chosen_exits}.parquet``, ``<model>/metrics.json``,
    ``<model>/gates.pkl`` (the fitted feature pipeline and gates, for :func:`load_online_gate`),
    ``cross_regime.parquet`` and ``metrics.json``.

    Args:
        stores: model -> split (fit/val/test) -> opened TrajectoryStore.
        cfg: the ``gates`` section.
        cal: the ``calibration`` section (shared with readouts).
        out_root: ``artifacts/gates``.
        base_seed: ``base.seed``.
        meta: model -> extra metrics.json entries (task, regime, params, versions ...).
        tasks: model -> task name (models of one task are crossed); None/missing = the model alone.
        progress: progress bars.
        threads: BLAS and torch threads for the duration of the call (None = leave as they are), and of the
            scoring tasks on Dask workers.
        runner: run the per-block work (reading the fit subsample, scoring val and test) as Dask tasks
            (:mod:`looptrace.io.parallel`); None = in this process. Fitting stays here, on the gathered subsample.

    Returns:
        The stage metrics dict (also ``metrics.json``).
    """
    with analysis_threads(threads):
        return _gates_stage(stores, cfg, cal, out_root, base_seed, meta, tasks, progress, runner, threads)


def _gates_stage(stores, cfg, cal, out_root, base_seed, meta, tasks, progress, runner=None, threads=None) -> dict:
    t_start = time.perf_counter()
    out_root = Path(out_root)
    meta = meta or {}
    tasks = {m: (tasks or {}).get(m) or f"<{m}>" for m in stores}
    specs, cross = cfg.specs, [s.name for s in cfg.cross_specs]
    for m, sp in stores.items():
        missing = [s for s in SPLITS if s not in sp]
        if missing:
            raise ValueError(f"model {m}: no '{missing[0]}' store; the gates stage needs fit, val and test")
    fitted = {m: fit_model_gates(sp["fit"], cfg, specs, base_seed, m, progress, runner) for m, sp in stores.items()}
    with atomic_dir(out_root) as tmp:
        tmp.chmod(0o755)  # mkdtemp makes 0700; the artifacts are meant to be readable
        cross_rows, skipped, summary = [], [], {}
        for b, sp in stores.items():
            check_stats_available(sp["val"], cfg.stats)
            appliers = [(fitted[b], [s.name for s in specs])]
            for a in stores:
                if a == b or tasks[a] != tasks[b] or not cross:
                    continue
                why = compatible(fitted[a], sp["val"], cfg.stats)
                if why:
                    skipped.append({"fit_model": a, "eval_model": b, "reason": why})
                    continue
                appliers.append((fitted[a], cross))
            val, test = read_targets(sp["val"]), read_targets(sp["test"])
            pv = predict_split(sp["val"], appliers, cfg, runner, threads)
            pt = predict_split(sp["test"], appliers, cfg, runner, threads)
            own = {s.name: evaluate_gate(s.rule, pv[(b, s.name)], pt[(b, s.name)], val, test, cal) for s in specs}
            results = list(own.values())
            frames = result_frames(results, cal.dx)
            metrics = _model_metrics(fitted[b], results, val, test, cal, meta.get(b, {}))
            write_outputs(tmp / b, frames, metrics)
            (tmp / b).chmod(0o755)
            with open(tmp / b / "gates.pkl", "wb") as fh:
                pickle.dump({"model": b, "features": fitted[b].features, "gates": fitted[b].gates,
                             "stats": tuple(cfg.stats),
                             "hidden_dtype": (sp["test"].attrs.get("dtypes") or {}).get("hidden", "float16")}, fh)
            summary[b] = metrics["best_gate"]
            full = float(test.correct[:, -1].mean())
            for a, names in appliers:
                for g in names:
                    if g not in cross:
                        continue
                    spec = fitted[a.model].gates[g].spec
                    tr = (own[g] if a.model == b else
                          evaluate_gate(spec.rule, pv[(a.model, g)], pt[(a.model, g)], val, test, cal))
                    for mode, r in (("transfer", tr), ("refit", own[g])):
                        k = r.chosen
                        cross_rows.append({
                            "task": tasks[b], "fit_model": a.model, "eval_model": b, "gate": spec.gate,
                            "labels": spec.labels, "rule": spec.rule, "mode": mode, "x": float(cal.dx[0]),
                            "d_at": d_at(r.test.mean_depth, r.test.accuracy, cal.dx[0]),
                            "chosen_test_accuracy": float(r.test.accuracy[k]),
                            "chosen_test_depth": float(r.test.mean_depth[k]), "budget": float(cfg.cross_budget),
                            "acc_at_budget": acc_at_budget(r, cfg.cross_budget), "full_depth_accuracy": full})
        cross_df = pl.DataFrame(cross_rows, schema=CROSS_SCHEMA).sort("task", "rule", "fit_model", "eval_model", "mode")
        cross_df.write_parquet(tmp / "cross_regime.parquet")
        stage = {"models": list(stores), "gates": [s.name for s in specs], "cross_gates": cross,
                 "seed": base_seed, "params": to_dict(cfg), "calibration": to_dict(cal), "best_gate": summary, "cross_skipped": skipped,
                 "seconds": time.perf_counter() - t_start}
        (tmp / "metrics.json").write_text(json.dumps(jsonable(stage), indent=2) + "\n")
    return stage
