"""The report's loop-map figures, from the loopmap stage's tables (:mod:`looptrace.report.loopmap_section`): ρ_t,
λ_t and the decay of an intervention by loop (``loopmap.png``); the causal-tracing map and the answer-flip depth
(``loopmap_trace.png``)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import polars as pl

from looptrace.report import plotting
from looptrace.report.inputs import Inputs
from looptrace.report.loopmap_section import decay_values, flip_curve, per_loop_values, trace_map
from looptrace.report.plotting import (
    FIG_W,
    band,
    groups_of,
    legend_below,
    pyplot,
    regime_colours,
    seeds_label,
    tasks_of,
)


def fig_loopmap(inp: Inputs, lm: dict[str, pl.DataFrame] | None, out: Path, dpi: int, seed_lines: bool = False
                ) -> Path | None:
    """The loop-map figure (the loopmap stage's tables, :mod:`looptrace.report.loopmap_section`): ρ_t, λ_t and
    the noise decay by loop: rows = the three measures, columns = tasks, one line per regime
    (geometric mean over seeds for ρ and the decay, plain mean for λ, each with the across-seed 95 % band)."""
    if lm is None or "per_loop" not in lm:
        return None
    plt = pyplot()
    colours = regime_colours(inp.meta)
    tasks = tasks_of(inp.meta)
    fig, axes = plt.subplots(3, len(tasks), figsize=(FIG_W, 9.6), squeeze=False, layout="constrained")
    handles: dict[str, object] = {}
    what = None
    for c, task in enumerate(tasks):
        for regime, metas in groups_of(inp.meta, task):
            names = [m["model"] for m in metas]
            T = max(int(m["n_loops"]) for m in metas)
            x = np.arange(1, T + 1)
            rho = per_loop_values(lm, names, "rho_median", T)
            if not np.isfinite(rho).any():
                continue
            h = band(axes[0, c], x, rho, colours[regime], regime, log=True, seed_lines=seed_lines)
            band(axes[1, c], x, per_loop_values(lm, names, "ftle_median", T), colours[regime], regime,
                  seed_lines=seed_lines)
            state, what = decay_values(lm, names, "state", T)
            if np.isfinite(state).any():
                band(axes[2, c], x, state, colours[regime], regime, log=True, seed_lines=seed_lines)
                lin, _ = decay_values(lm, names, "linear", T)
                band(axes[2, c], x, lin, colours[regime], regime, log=True, ls="--", marker=None)
            handles.setdefault(f"{regime} ({seeds_label(len(names))})", h)
        axes[0, c].axhline(1.0, color="k", lw=0.8, ls=":")
        axes[1, c].axhline(0.0, color="k", lw=0.8, ls=":")
        axes[0, c].set(title=task, ylabel="median ρ_t (local contraction)", yscale="log")
        axes[1, c].set(ylabel="median λ_t (FTLE, nats per loop)")
        axes[2, c].set(xlabel="loop t  /  loops j after the intervention (bottom)",
                       ylabel="median relative state effect", yscale="log")
        for r in range(3):
            axes[r, c].xaxis.get_major_locator().set_params(integer=True)
    from matplotlib.lines import Line2D

    handles["linearised ‖J^j δ‖/‖δ‖ (dashed)"] = Line2D([], [], color="grey", ls="--")
    legend_below(fig, handles)
    # short enough for the page width at 12 pt (the long form cut off at both ends); the caption says the rest
    fig.suptitle("Loop map: ρ_t, λ_t and the decay of " + (what or "an intervention").replace(
        "noise of relative scale", "noise") + " (seeds: mean, 95 % band)")
    return plotting.save(fig, out / "loopmap.png", dpi)


#: The causal-tracing map's rows in the report (position roles of ``trace.parquet``), top to bottom.
TRACE_ROLES = ("flipped", "between", "answer")


def fig_loopmap_trace(inp: Inputs, lm: dict[str, pl.DataFrame] | None, out: Path, dpi: int) -> Path | None:
    """The causal-tracing figure: per task (columns) and regime (rows) the restored fraction of the answer's logit
    difference by patched loop k × position role (mean over seeds), and below them the share of tokens whose
    argmax still changes after loop d (P(F > d), F the flip depth) per regime with the across-seed band and the
    mean flip depth dotted. None without the stage's flip tables."""
    if lm is None or "flip_depth" not in lm or not lm["flip_depth"].height:
        return None
    plt = pyplot()
    colours = regime_colours(inp.meta)
    tasks = tasks_of(inp.meta)
    regimes = list(dict.fromkeys(r for t in tasks for r, _ in groups_of(inp.meta, t)))
    n_rows = len(regimes) + 1
    fig, axes = plt.subplots(n_rows, len(tasks), figsize=(FIG_W, 2.3 * n_rows + 0.8), squeeze=False,
                             layout="constrained")
    handles: dict[str, object] = {}
    im = None
    for c, task in enumerate(tasks):
        groups = dict(groups_of(inp.meta, task))
        for r, regime in enumerate(regimes):
            ax = axes[r, c]
            metas = groups.get(regime)
            if not metas:
                ax.set_axis_off()
                continue
            names = [m["model"] for m in metas]
            T = max(int(m["n_loops"]) for m in metas)
            grid = trace_map(lm, names, TRACE_ROLES, T + 1)
            if not np.isfinite(grid).any():
                ax.text(0.5, 0.5, "not traced", ha="center", va="center", transform=ax.transAxes)
                ax.set_axis_off()
                continue
            with np.errstate(all="ignore"):
                mean = np.nanmean(grid, axis=0)
            im = ax.imshow(mean, aspect="auto", cmap="viridis", vmin=0.0, vmax=1.0)
            ax.grid(False)  # the report style's grid would cross the cells
            ax.set_yticks(range(len(TRACE_ROLES)), TRACE_ROLES)
            ax.set_xticks(range(T + 1))
            ax.set(title=f"{task} · {regime} ({seeds_label(len(names))})", xlabel="patched loop k (0 = h_0)")
        ax = axes[-1, c]
        for regime, metas in groups.items():
            names = [m["model"] for m in metas]
            T = max(int(m["n_loops"]) for m in metas)
            share, flip = flip_curve(lm, names, T)
            if not np.isfinite(share).any():
                continue
            h = band(ax, np.arange(1, T + 1), 100 * share, colours[regime], regime, bounds=(0.0, 100.0))
            if np.isfinite(flip).any():
                ax.axvline(float(np.nanmean(flip)), color=colours[regime], lw=1, ls=":")
            handles.setdefault(f"{regime} ({seeds_label(len(names))})", h)
        ax.set(xlabel="loop d (dotted: mean flip depth)", ylabel="tokens flipping after d (%)")
        ax.xaxis.get_major_locator().set_params(integer=True)
    if im is not None:
        fig.colorbar(im, ax=axes[:-1, :].ravel().tolist(), label="restored fraction of LD", extend="both")
    legend_below(fig, handles)
    fig.suptitle("Causal tracing across loops and the answer-flip depth (seeds: mean, 95 % band)")
    return plotting.save(fig, out / "loopmap_trace.png", dpi)
