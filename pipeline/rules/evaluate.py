"""Every exit rule of SPEC §4 on one model (the library of the ``readouts`` stage).

Reads the model's ``token_loop.parquet`` (val and test), calibrates every configured rule on val
with the shared protocol of :mod:`looptrace.rules.scoring`, applies the frozen grids to test and
returns the output tables.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import polars as pl
from looptrace.config import ConfigError
from looptrace.io.artifacts import write_outputs
from looptrace.io.tables import SplitFrame, load_token_loop
from looptrace.rules.builtin import (
    ALL_RULES,
    LOOP_COLUMNS,
    THRESHOLD_RULES,
    _grid_window,
    argmax_stable_depths,
    oracle_depths,
)
from looptrace.rules.scoring import (
    CalibrationConfig,
    RuleResult,
    d_at,
    evaluate_depths,
    evaluate_rule,
    exit_depths,
    quantile_grid,
    result_frames,
)
from looptrace.signals.halting import halting_cdf


@dataclass(frozen=True)
class ReadoutsConfig:
    """``readouts`` section of ``params.yaml`` (the calibration protocol is the ``calibration`` section).

    Attributes:
        argmax_stable_k: the k values of ``argmax_stable`` (each is one operating point).
        rules: the rules to evaluate (subset of ``ALL_RULES``; ``q_exit`` is skipped for models
            without a native gate).
    """

    argmax_stable_k: tuple[int, ...] = (2, 3)
    rules: tuple[str, ...] = ALL_RULES

    def __post_init__(self) -> None:
        if not self.argmax_stable_k or min(self.argmax_stable_k) < 1:
            raise ConfigError(f"readouts.argmax_stable_k must be a non-empty list of k ≥ 1, got "
                              f"{list(self.argmax_stable_k)}")
        unknown = [r for r in self.rules if r not in ALL_RULES]
        if unknown:
            raise ConfigError(f"readouts.rules: unknown rule '{unknown[0]}'; allowed: {', '.join(ALL_RULES)}")


def evaluate_model_rules(val: SplitFrame, test: SplitFrame, cfg: ReadoutsConfig, cal: CalibrationConfig,
                         progress: bool = True) -> list[RuleResult]:
    """Every configured exit rule of SPEC §4 on one model (grid on val, frozen, applied to test).

    Threshold rules calibrate on the finite val values of the loops they can read (t ≥ min_loop; for
    accel_two_hit also t − 1), so that e.g. hidden_change at t = 1 (where the rule may not fire) does
    not shift its grid. ``fixed`` has thresholds 1..T, ``argmax_stable`` the k values, ``oracle`` a
    single NaN threshold (kind ``oracle``).

    Args:
        val, test: the model's splits (same T).
        cfg: the ``readouts`` section.
        cal: the ``calibration`` section.
        progress: show a progress bar.

    Returns:
        list of RuleResult in ``ALL_RULES`` order (``q_exit`` only when the model has a gate).
    """
    from tqdm.auto import tqdm

    T = val.n_loops
    vdat, tdat = val.data, test.data
    nv, nt = val.token.size, test.token.size
    results: list[RuleResult] = []
    for rule in tqdm(cfg.rules, desc="readouts", disable=None if progress else True, leave=False):
        if rule == "fixed":
            k = np.arange(1, T + 1)
            results.append(evaluate_depths(rule, k, np.repeat(k[:, None], nv, 1), np.repeat(k[:, None], nt, 1),
                                           vdat, tdat, cal.delta, kind="fixed"))
        elif rule in THRESHOLD_RULES:
            col, op, min_loop, two_hit = THRESHOLD_RULES[rule]
            vs, ts = val.loop[col], test.loop[col]
            grid = quantile_grid(_grid_window(vs, min_loop, two_hit), cal.n_quantiles)
            results.append(evaluate_depths(rule, grid, exit_depths(vs, grid, op, min_loop, two_hit),
                                           exit_depths(ts, grid, op, min_loop, two_hit), vdat, tdat, cal.delta))
        elif rule == "argmax_stable":
            ks = list(cfg.argmax_stable_k)
            results.append(evaluate_depths(rule, np.array(ks, dtype=np.float64),
                                           argmax_stable_depths(val.loop["argmax"], ks),
                                           argmax_stable_depths(test.loop["argmax"], ks), vdat, tdat, cal.delta))
        elif rule == "q_exit":
            if not (val.has_gate and test.has_gate):
                continue
            vs, ts = halting_cdf(val.loop["gate_logit"]), halting_cdf(test.loop["gate_logit"])
            results.append(evaluate_rule(rule, vs, ts, vdat, tdat, "ge", n_quantiles=cal.n_quantiles,
                                         delta=cal.delta, kind="native"))
        elif rule == "oracle":
            results.append(evaluate_depths(rule, np.array([np.nan]), oracle_depths(vdat.correct)[None],
                                           oracle_depths(tdat.correct)[None], vdat, tdat, cal.delta, kind="oracle"))
    return results


def readouts_metrics(results: Sequence[RuleResult], frames: dict[str, pl.DataFrame], val: SplitFrame,
                     test: SplitFrame, cal: CalibrationConfig, meta: dict) -> dict:
    """``metrics.json``: full-depth and oracle accuracy, and per rule its chosen point and D@X."""
    dx = frames["dx"]
    rules = {}
    for r in results:
        entry = {"kind": r.kind,
                 "d_at": {str(int(x) if float(x).is_integer() else x): d_at(r.test.mean_depth, r.test.accuracy, x)
                          for x in cal.dx}}
        if r.kind != "oracle":
            k = r.chosen
            entry["chosen"] = {"threshold": float(r.thresholds[k]), "val_depth": float(r.val.mean_depth[k]),
                               "val_accuracy": float(r.val.accuracy[k]), "test_depth": float(r.test.mean_depth[k]),
                               "test_accuracy": float(r.test.accuracy[k])}
        else:
            entry["test_depth"] = float(r.test.mean_depth[0])
            entry["test_accuracy"] = float(r.test.accuracy[0])
        rules[r.rule] = entry
    x0 = cal.dx[0]
    posthoc = dx.filter((pl.col("kind") == "posthoc") & (pl.col("x") == float(x0)) & pl.col("d_at").is_not_nan())
    best = posthoc.sort("d_at", "rule").row(0, named=True) if posthoc.height else None
    return {**meta, "n_loops": val.n_loops, "has_gate": val.has_gate,
            "n_tokens": {"val": int(val.token.size), "test": int(test.token.size)},
            "full_depth_accuracy": {"val": val.data.full_accuracy, "test": test.data.full_accuracy},
            "test_accuracy_per_loop": test.loop["correct"].mean(axis=0).tolist(),
            "best_posthoc": {"x": x0, "rule": best["rule"] if best else None,
                             "d_at": best["d_at"] if best else math.nan},
            "rules": rules}


def readouts_model(geometry_dir: Path | str, cfg: ReadoutsConfig, cal: CalibrationConfig, out_dir: Path | str,
                   meta: dict | None = None, progress: bool = True) -> dict:
    """The ``readouts`` stage for one model: read token_loop.parquet, evaluate every rule, write outputs.

    Args:
        geometry_dir: ``artifacts/geometry/<model>``.
        cfg: the ``readouts`` section.
        cal: the ``calibration`` section.
        out_dir: ``artifacts/readouts/<model>``.
        meta: extra ``metrics.json`` entries (model, task, regime, regime_kind, versions, params).
        progress: progress bars.

    Returns:
        The metrics dict (also written to ``metrics.json``).
    """
    splits = load_token_loop(Path(geometry_dir) / "token_loop.parquet", columns=LOOP_COLUMNS)
    val, test = splits["val"], splits["test"]
    results = evaluate_model_rules(val, test, cfg, cal, progress)
    frames = result_frames(results, cal.dx)
    metrics = readouts_metrics(results, frames, val, test, cal, meta or {})
    write_outputs(out_dir, frames, metrics)
    return metrics
