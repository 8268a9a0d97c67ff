"""The report's per-loop figures: the accuracy of each loop's readout, the step geometry by loop and the
convergence depth by difficulty, per task × regime with the across-seed band."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import polars as pl

from looptrace.report import plotting
from looptrace.report.inputs import Inputs, ReportConfig
from looptrace.report.plotting import (
    FIG_W,
    band,
    groups_of,
    legend_below,
    pyplot,
    regime_colours,
    seed_band,
    seeds_label,
    tasks_of,
)


def fig_accuracy_per_loop(inp: Inputs, out: Path, dpi: int, seed_lines: bool = False) -> Path | None:
    """Test accuracy of the readout at every loop t: one panel per task, one line per regime (mean over its seeds
    with the across-seed 95 % interval band, within [0, 100] %)."""
    if inp.acc_per_loop is None:
        return None
    plt = pyplot()
    colours = regime_colours(inp.meta)
    tasks = tasks_of(inp.meta)
    ncol = min(3, len(tasks))
    nrow = math.ceil(len(tasks) / ncol)
    fig, axes = plt.subplots(nrow, ncol, figsize=(FIG_W, 3.4 * nrow + 0.7), squeeze=False, layout="constrained")
    handles: dict[str, object] = {}
    for k, task in enumerate(tasks):
        ax = axes[k // ncol, k % ncol]
        for regime, models in groups_of(inp.meta, task):
            T = max(int(m["n_loops"]) for m in models)
            vals = np.full((len(models), T), np.nan)
            for s, m in enumerate(models):
                d = inp.acc_per_loop.filter(pl.col("model") == m["model"]).sort("loop")
                vals[s, d["loop"].to_numpy() - 1] = 100 * d["accuracy"].to_numpy()
            h = band(ax, np.arange(1, T + 1), vals, colours[regime], regime,
                      bounds=(0.0, 100.0), seed_lines=seed_lines)
            handles.setdefault(f"{regime} ({seeds_label(len(models))})", h)
        ax.set(title=task, xlabel="loop t", ylabel="test accuracy (%)")
        ax.xaxis.get_major_locator().set_params(integer=True)
    for k in range(len(tasks), nrow * ncol):
        axes[k // ncol, k % ncol].set_visible(False)
    legend_below(fig, handles)
    fig.suptitle("Accuracy of each loop's readout (mean over seeds, 95 % band)")
    return plotting.save(fig, out / "accuracy_per_loop.png", dpi)


def fig_step_geometry(inp: Inputs, out: Path, dpi: int, seed_lines: bool = False) -> Path | None:
    """Median step norm ‖Δ_t‖ and consecutive-step cosine cos(Δ_t, Δ_{t−1}) by loop ([TS]): rows = the two
    metrics, columns = tasks, one line per regime — over seeds the geometric mean of the per-seed medians (norm)
    or their mean (cosine, within [−1, 1]) with the across-seed 95 % band."""
    if inp.loop_summary is None:
        return None
    plt = pyplot()
    colours = regime_colours(inp.meta)
    tasks = tasks_of(inp.meta)
    metrics = (("step_norm", r"step norm $\|\Delta_t\|_2$"), ("step_cos", r"$\cos(\Delta_t, \Delta_{t-1})$"))
    ncol = min(3, len(tasks))
    blocks = math.ceil(len(tasks) / ncol)
    fig, axes = plt.subplots(2 * blocks, ncol, figsize=(FIG_W, 5.6 * blocks + 0.8), squeeze=False, layout="constrained")
    handles: dict[str, object] = {}
    ls = inp.loop_summary.filter((pl.col("group_by") == "all") & (pl.col("count") > 0))
    for k in range(len(tasks), blocks * ncol):
        axes[2 * (k // ncol), k % ncol].set_visible(False)
        axes[2 * (k // ncol) + 1, k % ncol].set_visible(False)
    for j, task in enumerate(tasks):
        for r, (metric, label) in enumerate(metrics):
            ax = axes[2 * (j // ncol) + r, j % ncol]
            for regime, models in groups_of(inp.meta, task):
                T = max(int(m["n_loops"]) for m in models)
                vals = np.full((len(models), T), np.nan)
                for s, m in enumerate(models):
                    d = ls.filter((pl.col("model") == m["model"]) & (pl.col("metric") == metric))
                    if d.height:
                        vals[s, d["loop"].to_numpy() - 1] = d["median"].to_numpy()
                if not np.isfinite(vals).any():
                    continue
                h = band(ax, np.arange(1, T + 1), vals, colours[regime], regime,
                          bounds=(-1.0, 1.0) if metric == "step_cos" else None, log=metric == "step_norm",
                          seed_lines=seed_lines)
                handles.setdefault(f"{regime} ({seeds_label(len(models))})", h)
            ax.set(title=task if r == 0 else None, xlabel="loop t" if r == 1 else None, ylabel=label)
            ax.xaxis.get_major_locator().set_params(integer=True)
            if metric == "step_norm":
                ax.set_yscale("log")
    legend_below(fig, handles)
    fig.suptitle("Step geometry by loop (median over tokens; mean over seeds, 95 % band)")
    return plotting.save(fig, out / "step_geometry.png", dpi)


def fig_convergence(inp: Inputs, cfg: ReportConfig, out: Path, dpi: int) -> Path | None:
    """Mean convergence depth by difficulty (lines, mean over seeds with the 95 % band within [1, T + 1]) and by
    token type (bars, mean over seeds), per task and regime."""
    if inp.convergence is None:
        return None
    plt = pyplot()
    colours = regime_colours(inp.meta)
    tasks = tasks_of(inp.meta)
    ncol = min(3, len(tasks))
    blocks = math.ceil(len(tasks) / ncol)
    fig, axes = plt.subplots(2 * blocks, ncol, figsize=(FIG_W, 5.8 * blocks + 0.8), squeeze=False, layout="constrained")
    sig = f"{cfg.convergence_signal} < {cfg.convergence_eps:g} ({cfg.convergence_kind})"
    handles: dict[str, object] = {}
    conv = inp.convergence
    for k in range(len(tasks), blocks * ncol):
        axes[2 * (k // ncol), k % ncol].set_visible(False)
        axes[2 * (k // ncol) + 1, k % ncol].set_visible(False)
    for j, task in enumerate(tasks):
        groups = groups_of(inp.meta, task)
        T = max(int(m["n_loops"]) for _, ms in groups for m in ms)
        ax = axes[2 * (j // ncol), j % ncol]
        names = [m["model"] for _, ms in groups for m in ms]
        levels = sorted(conv.filter(pl.col("model").is_in(names) & (pl.col("group_by") == "difficulty"))
                        ["order"].unique().to_list())
        for regime, models in groups:
            vals = np.full((len(models), len(levels)), np.nan)
            for s, m in enumerate(models):
                d = conv.filter((pl.col("model") == m["model"]) & (pl.col("group_by") == "difficulty"))
                for o, v in zip(d["order"].to_list(), d["mean_depth"].to_list(), strict=True):
                    vals[s, levels.index(o)] = np.nan if v is None else v
            h = band(ax, np.asarray(levels, dtype=float), vals, colours[regime], regime,
                      bounds=(1.0, T + 1.0))
            handles.setdefault(f"{regime} ({seeds_label(len(models))})", h)
        hc = ax.axhline(T + 1, color="k", lw=0.8, ls=":")
        handles.setdefault(f"censored (T + 1 = {T + 1})", hc)
        ax.set(title=task, xlabel="difficulty", ylabel="mean convergence depth")
        ax = axes[2 * (j // ncol) + 1, j % ncol]
        types = list(dict.fromkeys(conv.filter(pl.col("model").is_in(names) & (pl.col("group_by") == "token_type"))
                                   .sort("order")["group_value"].to_list()))
        width = 0.8 / max(1, len(groups))
        for i, (_regime, models) in enumerate(groups):
            vals = np.full((len(models), len(types)), np.nan)
            for s, m in enumerate(models):
                d = conv.filter((pl.col("model") == m["model"]) & (pl.col("group_by") == "token_type"))
                for g, v in zip(d["group_value"].to_list(), d["mean_depth"].to_list(), strict=True):
                    if g in types:
                        vals[s, types.index(g)] = np.nan if v is None else v
            mean, lo, hi = seed_band(vals, (1.0, T + 1.0))
            xs = np.arange(len(types)) + (i - (len(groups) - 1) / 2) * width
            err = None if not np.isfinite(lo).any() else np.vstack([mean - lo, hi - mean])
            ax.bar(xs, mean, width=width, color=colours[_regime], yerr=err, capsize=3)
        ax.set_xticks(np.arange(len(types)), types)
        ax.axhline(T + 1, color="k", lw=0.8, ls=":")
        ax.set(xlabel="token type", ylabel="mean convergence depth")
    legend_below(fig, handles)
    fig.suptitle(f"Convergence depth ({sig}; mean over seeds, 95 % band)")
    return plotting.save(fig, out / "convergence.png", dpi)
