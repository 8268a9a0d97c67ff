"""What every report figure shares: matplotlib set up for the page (:func:`pyplot`: sizes in points,
:data:`FIG_W` wide, no text below :data:`MIN_PT`), one colour per regime (:func:`regime_colours`), the across-seed
mean with its 95 % band (:func:`seed_band`, :func:`band`), the run's tasks and regime groups, and :func:`save`
(every figure is written through it)."""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
import polars as pl

from looptrace.estimates import Interval, across_seeds

_REGIME_COLOURS = {"final": "#7f7f7f", "uniform": "#1f77b4", "geometric": "#2ca02c", "joint": "#d62728",
                   "recurtrace": "#9467bd", "act": "#8c564b"}
#: Regimes named as in profiles/halting, several of one kind: a colour per name, the same in every figure.
_REGIME_NAME_COLOURS = {"recurtrace": "#9467bd", "recurtrace_flow": "#e377c2", "recurtrace_mem": "#17becf",
                        "act": "#8c564b"}


#: Figure width in inches: at the default ``report.dpi`` (110) 1155 px, inside the page's 1180 px column, so a
#: figure is shown 1:1 and its 10 pt text stays 10 pt (≤ 1400 px wide at the page's scale).
FIG_W = 10.5
#: Smallest font size on any figure (points).
MIN_PT = 10
#: Grey of the curves a Pareto figure's text does not talk about.
GREY = "#b8b8b8"


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update({"font.size": MIN_PT, "axes.titlesize": 11, "axes.labelsize": MIN_PT,
                         "legend.fontsize": MIN_PT, "legend.title_fontsize": MIN_PT, "xtick.labelsize": MIN_PT,
                         "ytick.labelsize": MIN_PT, "figure.titlesize": 12, "figure.dpi": 100, "axes.grid": True,
                         "grid.alpha": 0.3})
    return plt


def regime_colours(meta: pl.DataFrame) -> dict[str, str]:
    """One colour per regime of the run, the same in every figure: the regime's name colour (the halting
    profile's regimes), else its kind's, else the next tab10 colour no other regime has (so two regimes of one kind
    never share a colour).

    Args:
        meta: the report's model metadata (regime, regime_kind), in model order.

    Returns:
        regime -> hex colour.
    """
    import matplotlib
    from matplotlib.colors import to_hex

    out: dict[str, str] = {}
    pairs = dict.fromkeys(zip(meta["regime"].to_list(), meta["regime_kind"].to_list(), strict=True))
    spare = [to_hex(matplotlib.colormaps["tab10"](k)) for k in range(10)]
    for regime, kind in pairs:
        if regime in out:
            continue
        used = set(out.values())
        c = _REGIME_NAME_COLOURS.get(regime)
        if c is None or c in used:
            c = _REGIME_COLOURS.get(kind)
        if c is None or c in used:
            c = next((x for x in spare if x not in used and x not in _REGIME_NAME_COLOURS.values()),
                     spare[len(out) % 10])
        out[regime] = c
    return out


def save(fig, path: Path, dpi: int) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


def tasks_of(meta: pl.DataFrame) -> list[str]:
    return list(dict.fromkeys(meta["task"].to_list()))


def models_of(meta: pl.DataFrame, task: str) -> list[dict]:
    return list(meta.filter(pl.col("task") == task).iter_rows(named=True))


def groups_of(meta: pl.DataFrame, task: str) -> list[tuple[str, list[dict]]]:
    """The task × regime groups of ``task`` (models that differ only by training seed), in meta order:
    [(regime, [model meta rows])]."""
    out: dict[str, list[dict]] = {}
    for m in models_of(meta, task):
        out.setdefault(m["regime"], []).append(m)
    return list(out.items())


def legend_below(fig, handles: dict[str, object], ncol: int = 4) -> None:
    """One de-duplicated legend for the whole figure, below the panels (constrained layout keeps it off the data)."""
    if handles:
        fig.legend(list(handles.values()), list(handles.keys()), loc="outside lower center",
                   ncol=min(ncol, len(handles)), frameon=False)


def seed_band(values: np.ndarray, bounds: tuple[float, float] | None = None, log: bool = False
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Mean over seeds with the across-seed 95 % interval, per column (the report's one protocol,
    :func:`looptrace.estimates.across_seeds`: Student-t, on the logit scale of ``bounds`` when given).

    Args:
        values: [seed, point] float (NaN = absent in that seed).
        bounds: the quantity's range (the band never leaves it).
        log: a positive quantity (a norm): the geometric mean with the t-interval of its logarithm.

    Returns:
        (mean, lo, hi), each [point]; lo = hi = NaN with fewer than two seeds.
    """
    v = np.asarray(values, dtype=np.float64)
    mean, lo, hi = (np.full(v.shape[1], np.nan) for _ in range(3))
    for j in range(v.shape[1]):
        col = v[:, j][np.isfinite(v[:, j])]
        if log:
            col = np.log(col[col > 0])
        if not col.size:
            continue
        iv = across_seeds([Interval(float(x)) for x in col], bounds=bounds if col.size > 1 else None)
        e, a, b = (iv.estimate, iv.lo, iv.hi) if col.size > 1 else (float(col[0]), math.nan, math.nan)
        mean[j], lo[j], hi[j] = (math.exp(e), math.exp(a), math.exp(b)) if log else (e, a, b)
    return mean, lo, hi


def band(ax, x, values: np.ndarray, colour, label: str, bounds=None, log: bool = False, seed_lines: bool = False,
          **kw):
    """A mean line over seeds with its interval band (and, on request, each seed as a thin line)."""
    mean, lo, hi = seed_band(values, bounds, log)
    (h,) = ax.plot(x, mean, color=colour, label=label, **{"marker": "o", "ms": 4, **kw})
    if np.isfinite(lo).any():
        ax.fill_between(x, lo, hi, color=colour, alpha=0.18, lw=0)
    if seed_lines:
        for row in values:
            ax.plot(x, row, color=colour, lw=0.6, alpha=0.5)
    return h


def seeds_label(n: int) -> str:
    return f"{n} seed{'s' if n != 1 else ''}"


def rule_colour(i: int):
    """Distinct colours for rules, without greys (grey marks the model legend)."""
    import matplotlib

    cols = [matplotlib.colormaps["tab10"](k) for k in range(10) if k != 7]
    cols += [matplotlib.colormaps["Dark2"](k) for k in range(8) if k != 7]
    return cols[i % len(cols)]


def slug(s: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", s)
