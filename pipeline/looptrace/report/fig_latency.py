"""The report's latency figure: real early exit's realised against ideal speedup per rule and batch size
(the latency stage's table)."""

from __future__ import annotations

from pathlib import Path
from typing import cast

import polars as pl

from looptrace.report import plotting
from looptrace.report.inputs import Inputs
from looptrace.report.plotting import (
    FIG_W,
    legend_below,
    pyplot,
    rule_colour,
)


def fig_latency(inp: Inputs, out: Path, dpi: int) -> Path | None:
    """Realised wall-clock speedup vs ideal T / mean exit depth, per batch size (SPEC §8)."""
    if inp.latency is None or not inp.latency.height:
        return None
    plt = pyplot()

    lat = inp.latency
    sizes = sorted(lat["batch_size"].unique().to_list())
    rules = list(dict.fromkeys(lat.sort("source", "rule")["rule"].to_list()))
    models = list(dict.fromkeys(lat["model"].to_list()))
    markers = "osD^vP*Xh<>"
    ideals = (("ideal_speedup", "ideal speedup T / mean exit depth (×)"),
              ("ideal_speedup_work", "exact-causal ideal: full / minimal position-loops (×)"))
    fig, axes = plt.subplots(2, len(sizes), figsize=(FIG_W, 8.0), squeeze=False, layout="constrained")
    hi = float(max(cast(float, lat["ideal_speedup"].max()), cast(float, lat["realised_speedup"].max()))) * 1.08
    handles: dict[str, object] = {}
    for row, (col, xlabel) in enumerate(ideals):
        for ax, bs in zip(axes[row], sizes, strict=True):
            d = lat.filter(pl.col("batch_size") == bs)
            ax.plot([0, hi], [0, hi], color="k", lw=0.8, label="realised = ideal")
            ax.plot([0, hi], [0, 0.8 * hi], color="k", lw=0.8, ls="--", label="0.8 × ideal")
            ax.axhline(1.0, color="grey", lw=0.6, ls=":")
            for r in d.iter_rows(named=True):
                ci = rules.index(r["rule"])
                mi = models.index(r["model"]) % len(markers)
                ax.scatter(r[col], r["realised_speedup"], color=rule_colour(ci),
                           marker=markers[mi], s=42, edgecolors="k", linewidths=0.4, zorder=3)
            ax.set(title=f"batch size {bs}" + (" (compacted)" if bs > 1 else ""), xlabel=xlabel,
                   ylabel="realised speedup (×)", xlim=(0.9, hi), ylim=(0, hi))
            for h, lab in zip(*ax.get_legend_handles_labels(), strict=True):
                handles.setdefault(lab, h)
    from matplotlib.lines import Line2D

    for ci, rule in enumerate(rules):
        handles[f"rule: {rule}"] = Line2D([], [], color=rule_colour(ci), marker="o", ls="none")
    for mi, model in enumerate(models):
        handles[f"model: {model}"] = Line2D([], [], color="grey", marker=markers[mi % len(markers)], ls="none")
    legend_below(fig, handles, ncol=3)
    fig.suptitle("Real early exit: realised speedup vs the token-level ideal (top) and the exact-causal ideal (bottom)")
    return plotting.save(fig, out / "latency.png", dpi)
