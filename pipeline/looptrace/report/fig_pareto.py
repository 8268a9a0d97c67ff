"""The report's Pareto figures, one per task: every rule's test operating points over seeds (mean front),
the curves the text talks about in colour (:func:`pareto_highlights`), the rest grey."""

from __future__ import annotations

import math
from pathlib import Path
from typing import cast

import numpy as np
import polars as pl

from looptrace.diagnose.stats import with_val_columns
from looptrace.estimates import across_seeds, from_row
from looptrace.report import plotting
from looptrace.report.inputs import Inputs
from looptrace.report.plotting import (
    FIG_W,
    GREY,
    groups_of,
    legend_below,
    pyplot,
    seeds_label,
    slug,
)
from looptrace.rules.native_halting import NATIVE_CALIBRATED, NATIVE_EXITS
from looptrace.rules.registry import get_rule
from looptrace.rules.scoring import best_chosen

#: Colours of the highlighted Pareto curves (everything else is grey).
_HIGHLIGHT = {"fixed": "black", "oracle": "#e6b800", "native": "#d62728"}
_BEST_COLOURS = ("#1f77b4", "#9467bd", "#17becf", "#8c564b")
_GATE_COLOURS = ("#2ca02c", "#bcbd22", "#e377c2")
_USER_COLOURS = ("#ff7f0e", "#7f3fbf")
#: The native exits' colours when a figure has several (reds: the native family; q_exit keeps the native red).
_NATIVE_COLOURS = {"q_exit": "#d62728", "gate_step": "#8b0000", "act_exit": "#ff9896"}
_NATIVE_SPARE = ("#fb6a4a", "#a50f15", "#fcbba1")


def pareto_highlights(chosen: pl.DataFrame | None, kinds: dict[str, str]) -> dict[str, tuple[str, str]]:
    """The handful of Pareto curves the report's text talks about, each with its role and colour: fixed depth,
    the oracle, the native gate (with several native exits on the figure, each its own red and role: whose own exit
    it is, :data:`~looptrace.rules.native_halting.NATIVE_EXITS`), the val-chosen best post-hoc rule of every seed
    (:func:`looptrace.rules.scoring.best_chosen`), the best refit gate of every seed, and every user rule
    (``module:function`` post-hoc rules). Everything else is drawn grey.

    Args:
        chosen: the chosen points of the group's models (model, rule, kind, val_depth, ...), or None.
        kinds: rule -> kind of every rule on the figure.

    Returns:
        rule -> (role, colour), in legend order.
    """
    out: dict[str, tuple[str, str]] = {}
    natives = [r for r, k in kinds.items() if k == "native"]
    for rule, kind in kinds.items():
        if kind == "native" and len(natives) > 1:  # several readings of the gate: whose exit each is
            own = [k for k, r in NATIVE_EXITS.items() if r == rule]
            tuned = [k for k, r in NATIVE_CALIBRATED.items() if r == rule and k not in own]
            extra = [c for c in _NATIVE_SPARE if c not in _NATIVE_COLOURS.values()]
            out[rule] = ("native head, own exit of " + ", ".join(own) if own else
                         "native head of " + ", ".join(tuned) + ", γ calibrated on val" if tuned else
                         "native head, other reading",
                         _NATIVE_COLOURS.get(rule) or extra[natives.index(rule) % len(extra)])
        elif kind in ("fixed", "oracle", "native"):
            out[rule] = ({"fixed": "fixed depth", "oracle": "oracle ceiling", "native": "native gate"}[kind],
                         _HIGHLIGHT[kind])
    best: list[str] = []
    gates: list[str] = []
    if chosen is not None and chosen.height:
        c = with_val_columns(chosen)
        for model in dict.fromkeys(c["model"].to_list()):
            cm = c.filter(pl.col("model") == model)
            b, g = best_chosen(cm, ["posthoc"]), best_chosen(cm, ["gate"])
            if b is not None and b["rule"] in kinds and b["rule"] not in best:
                best.append(b["rule"])
            if g is not None and g["rule"] in kinds and g["rule"] not in gates:
                gates.append(g["rule"])
    for i, r in enumerate(best):
        out.setdefault(r, ("best post-hoc (val)", _BEST_COLOURS[i % len(_BEST_COLOURS)]))
    for i, r in enumerate(gates):
        out.setdefault(r, ("best refit gate (val)", _GATE_COLOURS[i % len(_GATE_COLOURS)]))
    users = [r for r, k in kinds.items() if k == "posthoc" and _is_user_rule(r)]
    for i, r in enumerate(users):
        out.setdefault(r, ("user rule", _USER_COLOURS[i % len(_USER_COLOURS)]))
    return out


def _is_user_rule(name: str) -> bool:
    """A rule the user wrote: named ``module:function``, or registered from outside looptrace (an entry point, a
    :func:`looptrace.rules.register` call in the report's process)."""
    if ":" in name:
        return True
    try:
        rule = get_rule(name)
    except Exception:  # noqa: BLE001 - looptrace's own rules always resolve: one that does not came from user code
        return True  # (readouts named it as module:function; its output rows carry only the function's name)
    return not (rule.origin == "builtin" or rule.origin.startswith("looptrace."))


def mean_front(p: pl.DataFrame, models: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """A rule's Pareto front averaged over seeds, vertically: each seed's front as a step function of depth,
    A_s(d) = the best test accuracy among its points with mean depth ≤ d, averaged over the seeds at every depth of
    the union of their points where every seed has one (d ≥ the largest of the seeds' smallest depths).

    Args:
        p: the rule's test points of the group's models (model, mean_depth, accuracy).
        models: the group's models (seeds).

    Returns:
        (depth [loops], mean accuracy [%]), sorted by depth; empty when no seed has a point.
    """
    fronts = []
    for m in models:
        d = p.filter(pl.col("model") == m).sort("mean_depth")
        if d.height:
            x = d["mean_depth"].to_numpy().astype(np.float64)
            fronts.append((x, np.maximum.accumulate(100 * d["accuracy"].to_numpy().astype(np.float64))))
    if not fronts:
        return np.zeros(0), np.zeros(0)
    start = max(f[0][0] for f in fronts)
    grid = np.unique(np.concatenate([f[0] for f in fronts]))
    grid = grid[grid >= start]
    acc = np.mean([f[1][np.searchsorted(f[0], grid, side="right") - 1] for f in fronts], axis=0)
    return grid, acc


def _chosen_means(c: pl.DataFrame, T: float) -> tuple[float, float, tuple[float, float], tuple[float, float]]:
    """A rule's chosen point over seeds: mean test depth and accuracy (%) with their 95 % intervals (one seed:
    its bootstrap interval; several: the across-seed interval within [1, T] and [0, 100] %)."""
    def iv(col: str, scale: float, bounds: tuple[float, float]) -> tuple[float, tuple[float, float]]:
        items = [from_row(r, col) for r in c.iter_rows(named=True)]
        i = across_seeds(items, bounds=bounds)
        return scale * i.estimate, (scale * i.lo, scale * i.hi)

    d, dci = iv("test_depth", 1.0, (1.0, T))
    a, aci = iv("test_accuracy", 100.0, (0.0, 1.0))
    return d, a, dci, aci


def fig_pareto(inp: Inputs, task: str, out: Path, dpi: int, seed_lines: bool = False) -> Path | None:
    """Accuracy vs mean exit depth on test, one panel per regime of ``task`` with its seeds averaged
    (:func:`mean_front`): the curves the text talks about in colour (:func:`pareto_highlights`), every other rule
    in grey, the highlighted rules' val-chosen points marked with their 95 % intervals as error bars."""
    if inp.pareto is None:
        return None
    plt = pyplot()
    groups = groups_of(inp.meta, task)
    n = len(groups)
    ncol = min(3, n)
    nrow = math.ceil(n / ncol)
    fig, axes = plt.subplots(nrow, ncol, figsize=(FIG_W, 4.1 * nrow + 1.3), squeeze=False, layout="constrained")
    handles: dict[str, object] = {}
    names = [m["model"] for _, ms in groups for m in ms]
    sub = inp.pareto.filter(pl.col("model").is_in(names))
    kinds = dict(zip(sub["rule"].to_list(), sub["kind"].to_list(), strict=True))
    ch = inp.chosen.filter(pl.col("model").is_in(names)) if inp.chosen is not None else None
    hl = pareto_highlights(ch, kinds)
    grey = [r for r in sorted(kinds) if r not in hl]
    for k, (regime, models) in enumerate(groups):
        ax = axes[k // ncol, k % ncol]
        ms = [m["model"] for m in models]
        T = float(max(int(m["n_loops"]) for m in models))
        p = sub.filter(pl.col("model").is_in(ms))
        for rule in grey:
            x, y = mean_front(p.filter(pl.col("rule") == rule), ms)
            if x.size:
                (h,) = ax.plot(x, y, color=GREY, lw=0.9, zorder=1)
                handles.setdefault(f"other rules ({len(grey)})", h)
        for rule, (role, colour) in hl.items():
            pr = p.filter(pl.col("rule") == rule)
            x, y = mean_front(pr, ms)
            if not x.size:
                continue
            style = ({"marker": "*", "ms": 14, "mec": "k", "ls": "none"} if kinds[rule] == "oracle" else
                     {"marker": "s", "ms": 4, "lw": 1.8} if kinds[rule] == "fixed" else {"marker": "o", "ms": 3.5,
                                                                                          "lw": 1.8})
            (h,) = ax.plot(x, y, color=colour, zorder=3, **style)
            handles.setdefault(f"{rule} — {role}", h)
            if seed_lines and kinds[rule] != "oracle":
                for m in ms:
                    d = pr.filter(pl.col("model") == m).sort("mean_depth")
                    ax.plot(d["mean_depth"], 100 * d["accuracy"], color=colour, lw=0.6, alpha=0.45, zorder=2)
            if ch is not None and kinds[rule] != "oracle":
                c = ch.filter(pl.col("model").is_in(ms) & (pl.col("rule") == rule))
                if c.height:
                    cd, ca, dci, aci = _chosen_means(c, T)
                    xe = None if math.isnan(dci[0]) else [[cd - dci[0]], [dci[1] - cd]]
                    ye = None if math.isnan(aci[0]) else [[ca - aci[0]], [aci[1] - ca]]
                    ax.errorbar([cd], [ca], xerr=xe, yerr=ye, fmt="o", ms=9, mfc="none", mec=colour, ecolor=colour,
                                mew=1.6, capsize=3, zorder=5)
                    if "chosen point (val), 95 % interval" not in handles:
                        from matplotlib.lines import Line2D

                        handles["chosen point (val), 95 % interval"] = Line2D(
                            [], [], marker="o", ms=9, mfc="none", mec="k", mew=1.6, ls="none")
        lo = 100 * float(cast(float, p["accuracy"].min())) if p.height else 0.0
        ax.set(title=f"{regime} ({seeds_label(len(ms))})", xlabel="mean exit depth (loops)",
               ylabel="test accuracy (%)", xlim=(0.8, T + 0.2), ylim=(max(0.0, lo - 0.05 * (100 - lo) - 0.5), 100.5))
        ax.xaxis.get_major_locator().set_params(integer=True)
    for k in range(n, nrow * ncol):
        axes[k // ncol, k % ncol].set_visible(False)
    legend_below(fig, handles, ncol=3)
    fig.suptitle(f"{task}: Pareto fronts on test (mean over seeds)")
    return plotting.save(fig, out / f"pareto_{slug(task)}.png", dpi)
