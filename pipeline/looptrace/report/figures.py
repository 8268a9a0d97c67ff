"""The report's figures (``figures/<name>.png``): :func:`make_figures` draws every figure whose inputs
exist, one module per figure family (``fig_loops``, ``fig_pareto``, ``fig_failures``, ``fig_cross_regime``,
``fig_latency``, ``fig_speed``, ``fig_loopmap``, ``fig_heads``), each drawn from :class:`~looptrace.report.inputs.Inputs` only through
:mod:`looptrace.report.plotting`; a figure whose inputs are missing is not drawn (its function returns None)."""

from __future__ import annotations

from pathlib import Path

from looptrace.report.fig_cross_regime import fig_cross_regime
from looptrace.report.fig_failures import fig_failures
from looptrace.report.fig_heads import fig_heads, fig_layers
from looptrace.report.fig_latency import fig_latency
from looptrace.report.fig_loopmap import fig_loopmap, fig_loopmap_trace
from looptrace.report.fig_loops import fig_accuracy_per_loop, fig_convergence, fig_step_geometry
from looptrace.report.fig_pareto import fig_pareto
from looptrace.report.fig_speed import fig_speed
from looptrace.report.inputs import Inputs, ReportConfig
from looptrace.report.plotting import slug, tasks_of

#: Figure file names (``figures/<name>.png``); Pareto fronts add one per task: ``pareto_<task>.png``.
FIGURES = ("accuracy_per_loop", "step_geometry", "convergence", "failure_classes", "cross_regime", "latency", "speed")


def make_figures(inp: Inputs, cfg: ReportConfig, fig_dir: Path) -> dict[str, Path]:
    """Every figure whose inputs exist: name -> PNG path (inside ``fig_dir``)."""
    made: dict[str, Path | None] = {
        "accuracy_per_loop": fig_accuracy_per_loop(inp, fig_dir, cfg.dpi, cfg.seed_lines),
        "step_geometry": fig_step_geometry(inp, fig_dir, cfg.dpi, cfg.seed_lines),
        "convergence": fig_convergence(inp, cfg, fig_dir, cfg.dpi),
    }
    for task in tasks_of(inp.meta):
        made[f"pareto_{slug(task)}"] = fig_pareto(inp, task, fig_dir, cfg.dpi, cfg.seed_lines)
    made["failure_classes"] = fig_failures(inp, fig_dir, cfg.dpi)
    made["cross_regime"] = fig_cross_regime(inp, cfg, fig_dir, cfg.dpi)
    made["latency"] = fig_latency(inp, fig_dir, cfg.dpi)
    made["speed"] = fig_speed(inp, fig_dir, cfg.dpi)  # generate.parquet and/or speculative.parquet
    made["loopmap"] = fig_loopmap(inp, inp.loopmap, fig_dir, cfg.dpi, cfg.seed_lines)
    made["layers"] = fig_layers(inp, fig_dir, cfg.dpi, cfg.seed_lines)  # opt-in dump.layers / dump.heads only
    made["heads"] = fig_heads(inp, fig_dir, cfg.dpi, cfg.seed_lines)
    made["loopmap_trace"] = fig_loopmap_trace(inp, inp.loopmap, fig_dir, cfg.dpi)
    return {k: v for k, v in made.items() if v is not None}
