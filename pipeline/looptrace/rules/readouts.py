"""Every exit rule of SPEC §4 on one model (the library of the ``readouts`` stage).

Reads the model's ``token_loop.parquet`` (val and test), calibrates every configured rule on val
with the shared protocol of :mod:`looptrace.rules.scoring`, applies the frozen grids to test and
returns the output tables.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
from tqdm.auto import tqdm

from looptrace.config import ConfigError, InputError
from looptrace.intervals import IntervalsConfig, Resampler, boot_seed, split_resampler
from looptrace.io.artifacts import write_outputs
from looptrace.io.parallel import DaskRunner, map_tasks
from looptrace.io.tables import SplitArrays, load_token_loop
from looptrace.rules.base import ExitRule, check_causal
from looptrace.rules.builtin import ALL_RULES, LOOP_COLUMNS, grid_window
from looptrace.rules.registry import loop_signals, resolve_rules
from looptrace.rules.scoring import (
    CalibrationConfig,
    RuleResult,
    best_entry,
    check_n_quantiles,
    evaluate_depths,
    exit_depths,
    headline_entry,
    quantile_grid,
    result_frames,
)


@dataclass(frozen=True)
class ReadoutsConfig:
    """``readouts`` section of ``params.yaml`` (the calibration protocol is the ``calibration`` section).

    Attributes:
        argmax_stable_n: the thresholds n of ``argmax_stable``, each one operating point, in Huginn's units
            (``ArgmaxStabilityExitEvaluator``'s ``exit_threshold``): exit at the first loop where the number of
            consecutive loops whose argmax equals the previous loop's reaches n, i.e. n + 1 equal loops (Huginn's
            default 5 = six equal loops).
        rules: the rules to evaluate, in output order: built-in names (``ALL_RULES``), user rules
            ``package.module:function`` or ``looptrace.rules`` entry-point names (:mod:`looptrace.rules.registry`).
            Rules that read the native gate (``q_exit``) are skipped for models without one.
        calm_delta, calm_epsilon: the ``calm`` rule's Learn-then-Test calibration (:mod:`looptrace.rules.calm`):
            its threshold is certified to keep the val consistency risk (share of a sequence's tokens whose exit
            prediction differs from full depth) ≤ δ with probability ≥ 1 − ε.
    """

    argmax_stable_n: tuple[int, ...] = (1, 2, 3)
    rules: tuple[str, ...] = ALL_RULES
    calm_delta: float = 0.02
    calm_epsilon: float = 0.05

    def __post_init__(self) -> None:
        if not self.argmax_stable_n or min(self.argmax_stable_n) < 0:
            raise ConfigError(f"readouts.argmax_stable_n must be a non-empty list of n ≥ 0 (Huginn's count of "
                              f"consecutive equal-argmax transitions), got {list(self.argmax_stable_n)}")
        if not self.rules:
            raise ConfigError("readouts.rules = []: list at least one exit rule (e.g. [fixed, entropy, top1, oracle]); "
                              f"built-ins: {', '.join(ALL_RULES)}")
        resolve_rules(self.rules, "readouts.rules")
        if not (0.0 < self.calm_delta < 1.0 and 0.0 < self.calm_epsilon < 1.0):
            raise ConfigError(f"readouts.calm_delta and readouts.calm_epsilon must be in (0, 1), got {self.calm_delta} "
                              f"and {self.calm_epsilon}")


def rule_columns(rules: Sequence[ExitRule]) -> tuple[str, ...]:
    """The token_loop.parquet columns to read for ``rules`` (the built-ins' and every rule's own signals)."""
    return tuple(dict.fromkeys([*LOOP_COLUMNS, *(s for r in rules for s in r.signals if s != "loop")]))


def evaluate_rule_on(rule: ExitRule, val: SplitArrays, test: SplitArrays, cfg: ReadoutsConfig,
                     cal: CalibrationConfig, resampler: Resampler | None = None,
                     regime: Mapping[str, Any] | None = None) -> RuleResult | None:
    """One registered rule calibrated on val (frozen) and applied to test; None when the model cannot run it
    (a rule on the native gate of a model without one).

    A rule with a derived online form is first checked for causality on val
    (:func:`~looptrace.rules.base.check_causal`). A rule that declares its own thresholds
    (:meth:`~looptrace.rules.base.ExitRule.calibration_values`: ``fixed``'s 1..T, ``gate_step``'s 0.5,
    ``act_exit``'s 1 − ε of the model's ``regime``) is evaluated at them; the others calibrate on the quantile
    grid of their finite val scores on the loops they can read (t ≥ min_loop; for two-hit rules also t − 1), so
    that e.g. hidden_change at t = 1 (where the rule may not fire) does not shift the grid.
    """
    if rule.needs_gate and not (val.has_gate and test.has_gate):
        return None
    T = val.n_loops
    vsig, tsig = loop_signals(val.loop, T), loop_signals(test.loop, T)
    if rule.derived_online:
        check_causal(rule, vsig)
    vs, ts = rule.score_of(vsig), rule.score_of(tsig)
    grid = rule.calibration_values(T, cfg, regime)
    if grid is None:
        try:
            grid = quantile_grid(grid_window(vs, rule.min_loop, rule.two_hit), cal.n_quantiles)
        except ValueError as exc:
            raise InputError(f"readouts rule '{rule.name}': {exc}") from None
    vd = exit_depths(vs, grid, rule.op, rule.min_loop, rule.two_hit)
    td = exit_depths(ts, grid, rule.op, rule.min_loop, rule.two_hit)
    recorded = np.array([np.nan]) if rule.kind == "oracle" else grid  # a ceiling has no threshold
    chosen = None if rule.choose is None else rule.choose(vd, val, grid, cfg)  # the rule's own calibration (CALM)
    return evaluate_depths(rule.name, recorded, vd, td, val, test, cal.delta, kind=rule.kind, resampler=resampler,
                           chosen=chosen)


def evaluate_model_rules(val: SplitArrays, test: SplitArrays, cfg: ReadoutsConfig, cal: CalibrationConfig,
                         progress: bool = True, rules: Sequence[str | ExitRule] | None = None,
                         runner: DaskRunner | None = None, resampler: Resampler | None = None,
                         regime: Mapping[str, Any] | None = None) -> list[RuleResult]:
    """Every configured exit rule of SPEC §4 on one model (grid on val, frozen, applied to test).

    ``fixed`` has thresholds 1..T, ``argmax_stable`` the n values, ``oracle`` a single NaN threshold (kind
    ``oracle``); every other built-in and user rule the val quantile grid of its score
    (:func:`evaluate_rule_on`).

    Args:
        val, test: the model's splits (same T).
        cfg: the ``readouts`` section.
        cal: the ``calibration`` section.
        progress: show a progress bar.
        rules: rules (names or :class:`ExitRule` objects) instead of ``cfg.rules``.
        runner: one Dask task per rule (val and test are sent to the cluster once); None = in this process.
            A rule's result is the same either way: the same function on the same arrays.
        resampler: bootstrap over the test split's sequences (every rule on the same resamples; None = none).
        regime: the model's training regime definition (``metrics.json``'s ``regime_def``; None when the model is
            not of the train matrix): what a rule's own thresholds may depend on (``act_exit``'s ε).

    Returns:
        list of RuleResult in rule order (rules on the native gate only when the model has one).
    """

    todo = resolve_rules(cfg.rules if rules is None else rules, "readouts.rules")
    results: list[RuleResult] = []
    done = map_tasks(evaluate_rule_on, todo, (val, test, cfg, cal, resampler, regime), runner)
    for r in tqdm(done, total=len(todo), desc="readouts", disable=None if progress else True, leave=False):
        if r is not None:
            results.append(r)
    return results


def readouts_metrics(results: Sequence[RuleResult], frames: dict[str, pl.DataFrame], val: SplitArrays,
                     test: SplitArrays, cal: CalibrationConfig, meta: dict) -> dict:
    """``metrics.json``: full-depth and oracle accuracy, and per rule its val-chosen point on test and its
    oracle-threshold D@X, each with a 95 % interval (bootstrap over test sequences) and the seed count (1: one
    model). ``best_posthoc`` is chosen on val (:func:`~looptrace.rules.scoring.best_chosen`), never on test."""
    rules = {r.rule: headline_entry(r, cal) for r in results}
    best = best_entry(frames["chosen"], rules, ["posthoc"])
    boot = next((r.boot.info for r in results if r.boot is not None), {"n_boot": 0, "n_sequences": 0})
    assert val.token is not None and test.token is not None  # read from token_loop.parquet: store row ids
    return {**meta, "n_loops": val.n_loops, "has_gate": val.has_gate,
            "n_tokens": {"val": int(val.token.size), "test": int(test.token.size)},
            "intervals": {"n_boot": boot["n_boot"], "n_sequences": boot["n_sequences"],
                          "unit": boot.get("unit"), "level": boot.get("level"), "n_seeds": 1},
            "full_depth_accuracy": {"val": val.full_accuracy, "test": test.full_accuracy},
            "test_accuracy_per_loop": test.loop["correct"].mean(axis=0).tolist(),
            "best_posthoc": best, "rules": rules}


def readouts_model(geometry_dir: Path | str, cfg: ReadoutsConfig, cal: CalibrationConfig, out_dir: Path | str,
                   meta: dict | None = None, progress: bool = True, runner: DaskRunner | None = None,
                   intervals: IntervalsConfig | None = None, seed: int = 0) -> dict:
    """The ``readouts`` stage for one model: read token_loop.parquet, evaluate every rule, write outputs.

    Args:
        geometry_dir: ``artifacts/geometry/<model>``.
        cfg: the ``readouts`` section.
        cal: the ``calibration`` section.
        out_dir: ``artifacts/readouts/<model>``.
        meta: extra ``metrics.json`` entries (model, task, regime, regime_kind, versions, params); its
            ``regime_def`` (the model's training regime, :func:`looptrace.project.model_meta`) sets the thresholds
            of the rules that take them from it (``act_exit``).
        progress: progress bars.
        runner: evaluate the rules as Dask tasks, one per rule (:func:`evaluate_model_rules`); None = here.
        intervals: the ``intervals`` section (None = no intervals).
        seed: ``base.seed``; the bootstrap's seed is derived from it and the model name (``meta["model"]``).

    Returns:
        The metrics dict (also written to ``metrics.json``).
    """
    rules = resolve_rules(cfg.rules, "readouts.rules")
    splits = load_token_loop(Path(geometry_dir) / "token_loop.parquet", columns=rule_columns(rules))
    val, test = splits["val"], splits["test"]
    model = (meta or {}).get("model") or Path(geometry_dir).name
    check_n_quantiles(cal.n_quantiles, val.n, val.n_loops, f"model {model}")
    rs = split_resampler(test.fields, test.n, intervals, boot_seed(seed, model, "test"))
    regime = (meta or {}).get("regime_def")
    results = evaluate_model_rules(val, test, cfg, cal, progress, rules=rules, resampler=rs, runner=runner,
                                   regime=regime if isinstance(regime, Mapping) else None)
    frames = result_frames(results, cal.dx)
    metrics = readouts_metrics(results, frames, val, test, cal, meta or {})
    write_outputs(out_dir, frames, metrics)
    return metrics
