"""The report's failure-class figure (SPEC §7): each model's test tokens at its best rule's chosen point by
class."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import polars as pl

from looptrace.report import plotting
from looptrace.report.inputs import Inputs
from looptrace.report.plotting import (
    FIG_W,
    groups_of,
    pyplot,
    seeds_label,
    tasks_of,
)

#: Failure classes of SPEC §7 in plotting order, with their colours.
FAILURE_CLASSES = (("correct", "#4c9f50"), ("trajectory", "#7f7f7f"), ("readout_early", "#e39b2d"),
                   ("readout_overthinking", "#c44e52"))


def fig_failures(inp: Inputs, out: Path, dpi: int) -> Path | None:
    """Failure classes (SPEC §7) of every rule at its chosen point: share of test tokens, per task × regime (mean
    over its seeds), one panel per group."""
    if inp.failures is None or not inp.failures.height:
        return None
    plt = pyplot()
    f = inp.failures.filter(pl.col("group") == "all")
    present = set(f["model"].to_list())
    groups = [(f"{task} · {regime}", [m["model"] for m in ms if m["model"] in present])
              for task in tasks_of(inp.meta) for regime, ms in groups_of(inp.meta, task)]
    groups = [(g, ms) for g, ms in groups if ms]
    if not groups:
        return None
    ncol = min(3, len(groups))
    nrow = math.ceil(len(groups) / ncol)
    # one rule axis shared by every panel (labels once, on the left column)
    labels = (f.select("source", "rule").unique().sort("source", "rule", descending=True)["rule"].to_list())
    labels = list(dict.fromkeys(labels))
    fig, axes = plt.subplots(nrow, ncol, figsize=(FIG_W, (0.2 * len(labels) + 1.1) * nrow + 0.9), squeeze=False,
                             sharey=True, layout="constrained")
    cols = [f"frac_{c}" for c, _ in FAILURE_CLASSES[1:]]
    for k, (name, ms) in enumerate(groups):
        ax = axes[k // ncol, k % ncol]
        d = (f.filter(pl.col("model").is_in(ms)).group_by("rule", maintain_order=True)
             .agg([pl.col(c).mean() for c in cols]))
        at = {r: i for i, r in enumerate(labels)}
        y = np.array([at[r] for r in d["rule"].to_list()])
        # Errors only (the correct share is 100 − the bar): near-perfect models stay readable.
        left = np.zeros(d.height)
        for (cls, colour), c in zip(FAILURE_CLASSES[1:], cols, strict=True):
            v = 100 * d[c].to_numpy()
            ax.barh(y, v, left=left, color=colour, label=cls.replace("_", " "))
            left += v
        top = max(float(left.max()), 0.1)
        ax.set_yticks(np.arange(len(labels)), labels)
        ax.set(title=f"{name} ({seeds_label(len(ms))})", xlabel="wrong test tokens (%)", xlim=(0, top * 1.05))
    for k in range(len(groups), nrow * ncol):
        axes[k // ncol, k % ncol].set_visible(False)
    h, lab = axes[0, 0].get_legend_handles_labels()
    fig.legend(h, lab, loc="outside lower center", ncol=3, frameon=False)
    fig.suptitle("Failure classes at each rule's chosen point (mean over seeds)")
    return plotting.save(fig, out / "failure_classes.png", dpi)
