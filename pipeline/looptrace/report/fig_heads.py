"""The report's inside-the-loop figures (SPEC §2c): per-layer relative step against the block output's, and each
attention head's loop-to-loop Jensen–Shannon divergence and entropy, from the geometry stage's opt-in
``layers.parquet`` / ``heads.parquet`` (:mod:`looptrace.geometry.inside`). Drawn only for models whose dump had
``dump.layers`` / ``dump.heads``."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import polars as pl

from looptrace.report import plotting
from looptrace.report.inputs import Inputs
from looptrace.report.plotting import (
    FIG_W,
    band,
    groups_of,
    legend_below,
    pyplot,
    regime_colours,
    seeds_label,
)


def _per_loop(frame: pl.DataFrame, names: list[str], T: int, **where) -> np.ndarray:
    """[seed, loop] of ``estimate`` for each model of ``names`` (rows matching ``where``; NaN where absent)."""
    out = np.full((len(names), T), np.nan)
    f = frame
    for col, val in where.items():
        f = f.filter(pl.col(col).is_null() if val is None else pl.col(col) == val)
    for i, name in enumerate(names):
        for loop, est in f.filter(pl.col("model") == name).select("loop", "estimate").iter_rows():
            if loop is not None and 1 <= int(loop) <= T and est is not None:
                out[i, int(loop) - 1] = float(est)
    return out


def _groups(inp: Inputs, frame: pl.DataFrame) -> list[tuple[str, list[tuple[str, list[str], int]]]]:
    """Per task: [(regime, model names with rows in ``frame``, T)], tasks and regimes in meta order."""
    have = set(frame["model"].unique().to_list())
    out = []
    for task in plotting.tasks_of(inp.meta):
        groups = []
        for regime, metas in groups_of(inp.meta, task):
            names = [m["model"] for m in metas if m["model"] in have]
            if names:
                groups.append((regime, names, max(int(m["n_loops"]) for m in metas)))
        if groups:
            out.append((task, groups))
    return out


def fig_layers(inp: Inputs, out: Path, dpi: int, seed_lines: bool = False) -> Path | None:
    """Median relative step of each stored layer by loop (solid, one marker per layer) beside the block output's
    (dashed), columns = tasks, colours = regimes; mean over seeds with the across-seed 95 % band."""
    lay = inp.layers
    if lay is None or not lay.height:
        return None
    tasks = _groups(inp, lay)
    if not tasks:
        return None
    plt = pyplot()
    from matplotlib.lines import Line2D

    colours = regime_colours(inp.meta)
    fig, axes = plt.subplots(1, len(tasks), figsize=(FIG_W, 4.2), squeeze=False, layout="constrained")
    handles: dict[str, object] = {}
    markers = "os^vD<>"
    for c, (task, groups) in enumerate(tasks):
        ax = axes[0, c]
        for regime, names, T in groups:
            x = np.arange(1, T + 1)
            sub = lay.filter(pl.col("model").is_in(names) & (pl.col("metric") == "rel_step"))
            layers = sorted(v for v in sub["layer"].unique().to_list() if v is not None)
            for k, layer in enumerate(layers):
                h = band(ax, x, _per_loop(sub, names, T, layer=layer), colours[regime], regime, log=True,
                         seed_lines=seed_lines, marker=markers[k % len(markers)])
                handles.setdefault(f"{regime} ({seeds_label(len(names))})", h)
            band(ax, x, _per_loop(sub, names, T, layer=None), colours[regime], regime, log=True, ls="--", marker=None)
            for k, layer in enumerate(layers):
                handles.setdefault(f"layer {layer}", Line2D([], [], color="grey", marker=markers[k % len(markers)]))
        ax.set(title=task, xlabel="loop t", ylabel="median relative step ‖Δx_t‖ / ‖x_t‖", yscale="log")
        ax.xaxis.get_major_locator().set_params(integer=True)
    handles["block output h_t (dashed)"] = Line2D([], [], color="grey", ls="--")
    legend_below(fig, handles)
    fig.suptitle("Per-layer convergence inside the loop (seeds: mean, 95 % band)")
    return plotting.save(fig, out / "layers.png", dpi)


def fig_heads(inp: Inputs, out: Path, dpi: int, seed_lines: bool = False) -> Path | None:
    """Each head's median JS divergence from the previous loop (top, log scale) and median attention entropy
    (bottom) by loop: columns = tasks, colours = regimes, one line per (layer, head), a line style per layer; mean
    over seeds with the across-seed 95 % band."""
    hd = inp.heads
    if hd is None or not hd.height:
        return None
    tasks = _groups(inp, hd)
    if not tasks:
        return None
    plt = pyplot()
    from matplotlib.lines import Line2D

    colours = regime_colours(inp.meta)
    fig, axes = plt.subplots(2, len(tasks), figsize=(FIG_W, 7.0), squeeze=False, layout="constrained")
    handles: dict[str, object] = {}
    styles = ("-", "--", ":", "-.")
    layer_handles: dict[str, object] = {}
    for c, (task, groups) in enumerate(tasks):
        for regime, names, T in groups:
            x = np.arange(1, T + 1)
            sub = hd.filter(pl.col("model").is_in(names))
            layers = sorted(sub["layer"].unique().to_list())
            for layer, head in sorted(set(sub.select("layer", "head").iter_rows())):
                ls = styles[layers.index(layer) % len(styles)]
                js = _per_loop(sub, names, T, layer=layer, head=head, metric="js")
                h = band(axes[0, c], x, np.where(js > 0, js, np.nan), colours[regime], regime, log=True,
                         seed_lines=seed_lines, marker=None, lw=1.0, ls=ls)
                band(axes[1, c], x, _per_loop(sub, names, T, layer=layer, head=head, metric="entropy"),
                     colours[regime], regime, seed_lines=seed_lines, marker=None, lw=1.0, ls=ls)
                handles.setdefault(f"{regime} ({seeds_label(len(names))}; a line per head)", h)
                layer_handles.setdefault(f"layer {layer}", Line2D([], [], color="grey", ls=ls))
        axes[0, c].set(title=task, ylabel="median JS(a_t ‖ a_{t−1}) (nats)", yscale="log")
        axes[1, c].set(xlabel="loop t", ylabel="median attention entropy (nats)")
        for r in range(2):
            axes[r, c].xaxis.get_major_locator().set_params(integer=True)
    legend_below(fig, {**handles, **(layer_handles if len(layer_handles) > 1 else {})})
    fig.suptitle("Attention heads across loops (seeds: mean, 95 % band)")
    return plotting.save(fig, out / "heads.png", dpi)


__all__ = ["fig_heads", "fig_layers"]
