"""The ``gates`` stage over models: fit, calibrate on val, report on test, cross-regime transfer."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl

from looptrace.config import MissingInputError, to_dict
from looptrace.gates.artifact import save_fitted
from looptrace.gates.config import SPLITS, GatesConfig, gate_rule_form
from looptrace.gates.features import check_stats_available, read_targets
from looptrace.gates.fit import ModelGates, analysis_threads, compatible, fit_model_gates, predict_split
from looptrace.intervals import IntervalsConfig, Resampler, boot_seed, split_resampler
from looptrace.io.artifacts import atomic_dir, jsonable, write_outputs
from looptrace.io.parallel import DaskRunner
from looptrace.io.parquet import write_parquet
from looptrace.io.tables import SplitArrays
from looptrace.project import split_seed
from looptrace.rules.scoring import (
    CalibrationConfig,
    RuleResult,
    best_entry,
    check_n_quantiles,
    d_at,
    evaluate_depths,
    evaluate_rule,
    exit_depths,
    headline_entry,
    quantile_grid,
    result_frames,
)


def evaluate_gate(rule: str, p_val: np.ndarray, p_test: np.ndarray, val: SplitArrays, test: SplitArrays,
                  cal: CalibrationConfig, resampler: Resampler | None = None) -> RuleResult:
    """Calibrate a gate on val and score it on test with the readouts operating-point code.

    A PonderNet gate's Q-exit rule (``gate:ponder-<arch>``; its score is the halting CDF) is scored exactly as
    the readouts stage scores the native gate's ``q_exit``: :func:`~looptrace.rules.scoring.evaluate_rule` with
    the grid of val CDF values at every loop and d = min{t : CDF_t ≥ q}. Every other gate rule (P(stop), or a
    PonderNet gate's λ_t): the grid is ``quantile_grid`` of val values at loops 1..T − 1 (the loops where the
    gate can move an exit), frozen and applied to both splits with d = min{t : P(stop)_t ≥ γ} (T when never met).

    Args:
        rule: ``gate:<name>`` (:func:`~looptrace.gates.config.gate_rule_form` tells its form).
        p_val, p_test: [token, loop] exit scores.
        val, test: the splits' targets.
        cal: the ``calibration`` section (grid size and δ).
        resampler: bootstrap over the test split's sequences (None = no intervals).

    Returns:
        RuleResult of kind ``gate``.
    """
    n_tokens, n_loops = p_val.shape
    check_n_quantiles(cal.n_quantiles, n_tokens, n_loops, where=f"gate {rule}")
    if gate_rule_form(rule)[1] == "q_exit":
        return evaluate_rule(rule, p_val, p_test, val, test, op="ge", min_loop=1, n_quantiles=cal.n_quantiles,
                             delta=cal.delta, kind="gate", resampler=resampler)
    grid = quantile_grid(p_val[:, :-1], cal.n_quantiles)
    return evaluate_depths(rule, grid, exit_depths(p_val, grid, "ge"), exit_depths(p_test, grid, "ge"),
                           val, test, cal.delta, kind="gate", resampler=resampler)


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


def _model_metrics(mg: ModelGates, results: Sequence[RuleResult], frames: dict[str, pl.DataFrame],
                   val: SplitArrays, test: SplitArrays, cal: CalibrationConfig, meta: dict) -> dict:
    rules = {}
    for r in results:
        name, form = gate_rule_form(r.rule)
        g = mg.gates[name]
        rules[r.rule] = {"gate": g.spec.gate, "labels": g.spec.labels, "exit_form": form, "fit": g.info,
                         **headline_entry(r, cal)}
    best = best_entry(frames["chosen"], rules)
    return {**meta, "n_loops": mg.n_loops, "d_model": mg.d_model,
            "n_tokens": {"fit_used": mg.info["fit_tokens"], "fit": mg.info["fit_tokens_available"],
                         "val": int(val.loss.shape[0]), "test": int(test.loss.shape[0])},
            "features": {"names": mg.features.feature_names, **{k: v for k, v in mg.info.items()
                                                                 if k.startswith(("n_features", "pca"))}},
            "full_depth_accuracy": {"val": float(val.correct[:, -1].mean()), "test": float(test.correct[:, -1].mean())},
            "best_gate": best, "rules": rules}


def gates_stage(stores: dict[str, dict[str, Any]], cfg: GatesConfig, cal: CalibrationConfig, out_root: Path | str,
                base_seed: int = 0,
                meta: dict[str, dict] | None = None, tasks: dict[str, str | None] | None = None,
                progress: bool = True, threads: int | None = None, runner: DaskRunner | None = None,
                intervals: IntervalsConfig | None = None) -> dict:
    """The ``gates`` stage over several models: fit, calibrate, report, cross-regime transfer.

    Writes, atomically (a temporary sibling directory replaces ``out_root`` at the end):
    ``<model>/{operating_points,pareto,dx,chosen,chosen_exits}.parquet``, ``<model>/metrics.json``,
    ``<model>/gates.{json,skops}`` + ``ponder.npz`` (the fitted feature pipeline and gates, without pickle:
    :mod:`looptrace.gates.artifact`, for :func:`load_online_gate`),
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
        intervals: the ``intervals`` section (None = no intervals); the resamples of a model's test split are
            the readouts stage's (same seed: ``base.seed`` and the model name), so gate and readout intervals pair.

    Returns:
        The stage metrics dict (also ``metrics.json``).
    """
    with analysis_threads(threads):
        return _gates_stage(stores, cfg, cal, out_root, base_seed, meta, tasks, progress, runner, threads, intervals)


def _gates_stage(stores, cfg, cal, out_root, base_seed, meta, tasks, progress, runner=None, threads=None,
                 intervals=None) -> dict:
    t_start = time.perf_counter()
    out_root = Path(out_root)
    meta = meta or {}
    tasks = {m: (tasks or {}).get(m) or f"<{m}>" for m in stores}
    specs, cross = cfg.specs, [s.name for s in cfg.cross_specs]
    for m, sp in stores.items():
        missing = [s for s in SPLITS if s not in sp]
        if missing:
            raise MissingInputError(f"model {m}: no '{missing[0]}' store; the gates stage needs fit, val and test")
    fitted = {m: fit_model_gates(sp["fit"], cfg, specs, base_seed, m, progress, runner) for m, sp in stores.items()}
    t_fitted, t_score = time.perf_counter(), 0.0
    with atomic_dir(out_root) as tmp:
        tmp.chmod(0o755)  # mkdtemp makes 0700; the artifacts are meant to be readable
        cross_rows, skipped, summary = [], [], {}
        for b, sp in stores.items():
            check_stats_available(sp["val"], cfg.stats)
            appliers = [(fitted[b], [s.name for s in specs])]
            for a in stores:
                # Cross-regime transfer pairs models of one task *and one training seed*: across seeds the
                # difference would mix regime with initialisation (names <task>-<regime>-s<seed>, project.split_seed).
                if a == b or tasks[a] != tasks[b] or split_seed(a)[1] != split_seed(b)[1] or not cross:
                    continue
                why = compatible(fitted[a], sp["val"], cfg.stats)
                if why:
                    skipped.append({"fit_model": a, "eval_model": b, "reason": why})
                    continue
                appliers.append((fitted[a], cross))
            val, test = read_targets(sp["val"]), read_targets(sp["test"])
            rs = split_resampler(test.fields, test.n, intervals, boot_seed(base_seed, b, "test"))
            t0 = time.perf_counter()
            pv = predict_split(sp["val"], appliers, cfg, runner, threads)
            pt = predict_split(sp["test"], appliers, cfg, runner, threads)
            t_score += time.perf_counter() - t0
            every = {rule: evaluate_gate(rule, pv[(b, rule)], pt[(b, rule)], val, test, cal, rs)
                     for s in specs for rule, _ in s.forms}
            own = {s.name: every[s.rule] for s in specs}
            results = list(every.values())
            frames = result_frames(results, cal.dx)
            metrics = _model_metrics(fitted[b], results, frames, val, test, cal, meta.get(b, {}))
            write_outputs(tmp / b, frames, metrics)
            (tmp / b).chmod(0o755)
            save_fitted(tmp / b, b, fitted[b].features, fitted[b].gates, cfg.stats,
                        (sp["test"].attrs.get("dtypes") or {}).get("hidden", "float16"))
            summary[b] = metrics["best_gate"]
            full = float(test.correct[:, -1].mean())
            for a, names in appliers:
                for g in names:
                    if g not in cross:
                        continue
                    spec = fitted[a.model].gates[g].spec
                    tr = (own[g] if a.model == b else
                          evaluate_gate(spec.rule, pv[(a.model, spec.rule)], pt[(a.model, spec.rule)], val, test, cal))
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
        write_parquet(cross_df, tmp / "cross_regime.parquet")  # page checksums
        stage = {"models": list(stores), "gates": [s.name for s in specs], "cross_gates": cross,
                 "seed": base_seed, "params": to_dict(cfg), "calibration": to_dict(cal),
                 "intervals": to_dict(intervals) if intervals is not None else None,
                 "best_gate": summary, "cross_skipped": skipped,
                 "seconds": time.perf_counter() - t_start}
        # where the wall went: the streaming passes (the fit subsample's read + PCA + features; scoring val and
        # test block by block) apart from the fitting and the evaluation on small per-token arrays
        features = sum(float(f.info["read_and_features_seconds"]) for f in fitted.values())
        stage["phase_seconds"] = {"read_and_features": features, "gate_fit": t_fitted - t_start - features,
                                  "score": t_score, "evaluate": stage["seconds"] - (t_fitted - t_start) - t_score}
        (tmp / "metrics.json").write_text(json.dumps(jsonable(stage), indent=2) + "\n")
    return stage
