"""The report's cross-regime figure: a gate fitted on one regime's trajectories evaluated on another's
(the gates stage's ``cross_regime.parquet``)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import polars as pl

from looptrace.report import plotting
from looptrace.report.inputs import Inputs, ReportConfig
from looptrace.report.plotting import (
    FIG_W,
    MIN_PT,
    pyplot,
)


def _cross_columns(df: pl.DataFrame) -> tuple[str, str, str] | None:
    """(row, column, value) columns of the cross-regime table: the gate's training model/regime, the
    model/regime it is applied to, and the D@X-or-depth value (first match of known names)."""
    def pick(cands):
        return next((c for c in cands if c in df.columns), None)

    row = pick(["fit_model", "train_model", "source_model", "gate_model", "fit_regime", "train_regime",
                "source_regime", "from_model", "from_regime", "gate_regime"])
    col = pick(["eval_model", "target_model", "apply_model", "test_model", "eval_regime", "target_regime",
                "apply_regime", "test_regime", "to_model", "to_regime", "model"])
    val = pick(["d_at", "d95", "d_at_95", "test_depth", "mean_depth", "accuracy", "test_accuracy"])
    return (row, col, val) if row and col and val and row != col else None


def fig_cross_regime(inp: Inputs, cfg: ReportConfig, out: Path, dpi: int) -> Path | None:
    """Gates fit on one model's frozen trajectory and applied to another's (gates' cross_regime.parquet)."""
    if inp.cross_regime is None or not inp.cross_regime.height:
        return None
    cols = _cross_columns(inp.cross_regime)
    if cols is None:
        inp.missing["gates/cross_regime.parquet (columns)"] = (
            f"unrecognised columns {inp.cross_regime.columns}; the report reads (fit model, eval model, value)")
        return None
    r, c, v = cols
    d = inp.cross_regime
    if "mode" in d.columns:  # transfer = the fitted gate applied as is; refit rows repeat the eval model's own gate
        d = d.filter(pl.col("mode") == "transfer")
    if "x" in d.columns and v == "d_at" and (d["x"] == float(cfg.x)).any():
        d = d.filter(pl.col("x") == float(cfg.x))
    keys: list[str] = [k for k in ("task", "rule") if k in d.columns] or [k for k in ("labels",) if k in d.columns]
    facets = d.select(keys).unique(maintain_order=True).sort(keys).rows() if keys else [()]
    if not d.height or not facets:
        return None
    plt = pyplot()
    ncol = min(3, len(facets))
    nrow = math.ceil(len(facets) / ncol)
    fig, axes = plt.subplots(nrow, ncol, figsize=(FIG_W, 3.9 * nrow + 0.8), squeeze=False, layout="constrained")
    depth_like = v in ("d_at", "d95", "d_at_95", "test_depth", "mean_depth")
    unit = f"D@{cfg.x:g} (loops)" if depth_like else v.replace("_", " ")
    for k, facet in enumerate(facets):
        ax = axes[k // ncol, k % ncol]
        ds = d
        for key, val in zip(keys, facet, strict=True):
            ds = ds.filter(pl.col(key) == val)
        ds = ds.group_by(r, c).agg(pl.col(v).mean())
        rows, colsv = sorted(ds[r].unique().to_list()), sorted(ds[c].unique().to_list())
        mat = np.full((len(rows), len(colsv)), np.nan)
        for a, b, val in ds.iter_rows():
            mat[rows.index(a), colsv.index(b)] = np.nan if val is None else val
        im = ax.imshow(mat, cmap="viridis_r" if depth_like else "viridis", aspect="auto")
        finite = mat[np.isfinite(mat)]
        mid = float(finite.mean()) if finite.size else 0.0
        for i in range(len(rows)):
            for j in range(len(colsv)):
                ok = np.isfinite(mat[i, j])
                ax.text(j, i, f"{mat[i, j]:.2f}" if ok else "n/a", ha="center", va="center", fontsize=MIN_PT,
                        color=("w" if (mat[i, j] > mid) == depth_like else "k") if ok else "k")
        ax.set_xticks(np.arange(len(colsv)), colsv, rotation=25, ha="right")
        ax.set_yticks(np.arange(len(rows)), rows)
        ax.set(xlabel="applied to (eval model)", ylabel="gate fit on (fit model)",
               title=" · ".join(str(x) for x in facet))
        ax.grid(False)
        fig.colorbar(im, ax=ax, label=unit, shrink=0.85)
    for k in range(len(facets), nrow * ncol):
        axes[k // ncol, k % ncol].set_visible(False)
    fig.suptitle("Cross-regime transfer of offline gates\n(fit on one model's frozen trajectories, applied to "
                 "another's; n/a = unreachable)")
    return plotting.save(fig, out / "cross_regime.png", dpi)
