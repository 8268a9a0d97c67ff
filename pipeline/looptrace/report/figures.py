"""The report's figures (``figures/<name>.png``), each drawn from :class:`~looptrace.report.inputs.Inputs` only;
a figure whose inputs are missing is not drawn (its function returns None)."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import cast

import numpy as np
import polars as pl

from looptrace.diagnose.stats import with_val_columns
from looptrace.intervals import Interval, across_seeds, from_row
from looptrace.report.inputs import Inputs, ReportConfig
from looptrace.report.loopmap_section import decay_values, per_loop_values
from looptrace.rules.native_halting import NATIVE_CALIBRATED, NATIVE_EXITS
from looptrace.rules.registry import get_rule
from looptrace.rules.scoring import best_chosen

#: Figure file names (``figures/<name>.png``); Pareto fronts add one per task: ``pareto_<task>.png``.
FIGURES = ("accuracy_per_loop", "step_geometry", "convergence", "failure_classes", "cross_regime", "latency")
#: Failure classes of SPEC §7 in plotting order, with their colours.
FAILURE_CLASSES = (("correct", "#4c9f50"), ("trajectory", "#7f7f7f"), ("readout_early", "#e39b2d"),
                   ("readout_overthinking", "#c44e52"))
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
_GREY = "#b8b8b8"


def _plt():
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


def _save(fig, path: Path, dpi: int) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


def _tasks(meta: pl.DataFrame) -> list[str]:
    return list(dict.fromkeys(meta["task"].to_list()))


def _models_of(meta: pl.DataFrame, task: str) -> list[dict]:
    return list(meta.filter(pl.col("task") == task).iter_rows(named=True))


def _groups_of(meta: pl.DataFrame, task: str) -> list[tuple[str, list[dict]]]:
    """The task × regime groups of ``task`` (models that differ only by training seed), in meta order:
    [(regime, [model meta rows])]."""
    out: dict[str, list[dict]] = {}
    for m in _models_of(meta, task):
        out.setdefault(m["regime"], []).append(m)
    return list(out.items())


def _legend_below(fig, handles: dict[str, object], ncol: int = 4) -> None:
    """One de-duplicated legend for the whole figure, below the panels (constrained layout keeps it off the data)."""
    if handles:
        fig.legend(list(handles.values()), list(handles.keys()), loc="outside lower center",
                   ncol=min(ncol, len(handles)), frameon=False)


def seed_band(values: np.ndarray, bounds: tuple[float, float] | None = None, log: bool = False
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Mean over seeds with the across-seed 95 % interval, per column (the report's one protocol,
    :func:`looptrace.intervals.across_seeds`: Student-t, on the logit scale of ``bounds`` when given).

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


def _band(ax, x, values: np.ndarray, colour, label: str, bounds=None, log: bool = False, seed_lines: bool = False,
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


def _seeds_label(n: int) -> str:
    return f"{n} seed{'s' if n != 1 else ''}"


def fig_accuracy_per_loop(inp: Inputs, out: Path, dpi: int, seed_lines: bool = False) -> Path | None:
    """Test accuracy of the readout at every loop t: one panel per task, one line per regime (mean over its seeds
    with the across-seed 95 % interval band, within [0, 100] %)."""
    if inp.acc_per_loop is None:
        return None
    plt = _plt()
    colours = regime_colours(inp.meta)
    tasks = _tasks(inp.meta)
    ncol = min(3, len(tasks))
    nrow = math.ceil(len(tasks) / ncol)
    fig, axes = plt.subplots(nrow, ncol, figsize=(FIG_W, 3.4 * nrow + 0.7), squeeze=False, layout="constrained")
    handles: dict[str, object] = {}
    for k, task in enumerate(tasks):
        ax = axes[k // ncol, k % ncol]
        for regime, models in _groups_of(inp.meta, task):
            T = max(int(m["n_loops"]) for m in models)
            vals = np.full((len(models), T), np.nan)
            for s, m in enumerate(models):
                d = inp.acc_per_loop.filter(pl.col("model") == m["model"]).sort("loop")
                vals[s, d["loop"].to_numpy() - 1] = 100 * d["accuracy"].to_numpy()
            h = _band(ax, np.arange(1, T + 1), vals, colours[regime], regime,
                      bounds=(0.0, 100.0), seed_lines=seed_lines)
            handles.setdefault(f"{regime} ({_seeds_label(len(models))})", h)
        ax.set(title=task, xlabel="loop t", ylabel="test accuracy (%)")
        ax.xaxis.get_major_locator().set_params(integer=True)
    for k in range(len(tasks), nrow * ncol):
        axes[k // ncol, k % ncol].set_visible(False)
    _legend_below(fig, handles)
    fig.suptitle("Accuracy of each loop's readout (mean over seeds, 95 % band)")
    return _save(fig, out / "accuracy_per_loop.png", dpi)


def fig_step_geometry(inp: Inputs, out: Path, dpi: int, seed_lines: bool = False) -> Path | None:
    """Median step norm ‖Δ_t‖ and consecutive-step cosine cos(Δ_t, Δ_{t−1}) by loop ([TS]): rows = the two
    metrics, columns = tasks, one line per regime — over seeds the geometric mean of the per-seed medians (norm)
    or their mean (cosine, within [−1, 1]) with the across-seed 95 % band."""
    if inp.loop_summary is None:
        return None
    plt = _plt()
    colours = regime_colours(inp.meta)
    tasks = _tasks(inp.meta)
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
            for regime, models in _groups_of(inp.meta, task):
                T = max(int(m["n_loops"]) for m in models)
                vals = np.full((len(models), T), np.nan)
                for s, m in enumerate(models):
                    d = ls.filter((pl.col("model") == m["model"]) & (pl.col("metric") == metric))
                    if d.height:
                        vals[s, d["loop"].to_numpy() - 1] = d["median"].to_numpy()
                if not np.isfinite(vals).any():
                    continue
                h = _band(ax, np.arange(1, T + 1), vals, colours[regime], regime,
                          bounds=(-1.0, 1.0) if metric == "step_cos" else None, log=metric == "step_norm",
                          seed_lines=seed_lines)
                handles.setdefault(f"{regime} ({_seeds_label(len(models))})", h)
            ax.set(title=task if r == 0 else None, xlabel="loop t" if r == 1 else None, ylabel=label)
            ax.xaxis.get_major_locator().set_params(integer=True)
            if metric == "step_norm":
                ax.set_yscale("log")
    _legend_below(fig, handles)
    fig.suptitle("Step geometry by loop (median over tokens; mean over seeds, 95 % band)")
    return _save(fig, out / "step_geometry.png", dpi)


def fig_convergence(inp: Inputs, cfg: ReportConfig, out: Path, dpi: int) -> Path | None:
    """Mean convergence depth by difficulty (lines, mean over seeds with the 95 % band within [1, T + 1]) and by
    token type (bars, mean over seeds), per task and regime."""
    if inp.convergence is None:
        return None
    plt = _plt()
    colours = regime_colours(inp.meta)
    tasks = _tasks(inp.meta)
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
        groups = _groups_of(inp.meta, task)
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
            h = _band(ax, np.asarray(levels, dtype=float), vals, colours[regime], regime,
                      bounds=(1.0, T + 1.0))
            handles.setdefault(f"{regime} ({_seeds_label(len(models))})", h)
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
    _legend_below(fig, handles)
    fig.suptitle(f"Convergence depth ({sig}; mean over seeds, 95 % band)")
    return _save(fig, out / "convergence.png", dpi)


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
    plt = _plt()
    groups = _groups_of(inp.meta, task)
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
                (h,) = ax.plot(x, y, color=_GREY, lw=0.9, zorder=1)
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
        ax.set(title=f"{regime} ({_seeds_label(len(ms))})", xlabel="mean exit depth (loops)",
               ylabel="test accuracy (%)", xlim=(0.8, T + 0.2), ylim=(max(0.0, lo - 0.05 * (100 - lo) - 0.5), 100.5))
        ax.xaxis.get_major_locator().set_params(integer=True)
    for k in range(n, nrow * ncol):
        axes[k // ncol, k % ncol].set_visible(False)
    _legend_below(fig, handles, ncol=3)
    fig.suptitle(f"{task}: Pareto fronts on test (mean over seeds)")
    return _save(fig, out / f"pareto_{_slug(task)}.png", dpi)


def fig_failures(inp: Inputs, out: Path, dpi: int) -> Path | None:
    """Failure classes (SPEC §7) of every rule at its chosen point: share of test tokens, per task × regime (mean
    over its seeds), one panel per group."""
    if inp.failures is None or not inp.failures.height:
        return None
    plt = _plt()
    f = inp.failures.filter(pl.col("group") == "all")
    present = set(f["model"].to_list())
    groups = [(f"{task} · {regime}", [m["model"] for m in ms if m["model"] in present])
              for task in _tasks(inp.meta) for regime, ms in _groups_of(inp.meta, task)]
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
        ax.set(title=f"{name} ({_seeds_label(len(ms))})", xlabel="wrong test tokens (%)", xlim=(0, top * 1.05))
    for k in range(len(groups), nrow * ncol):
        axes[k // ncol, k % ncol].set_visible(False)
    h, lab = axes[0, 0].get_legend_handles_labels()
    fig.legend(h, lab, loc="outside lower center", ncol=3, frameon=False)
    fig.suptitle("Failure classes at each rule's chosen point (mean over seeds)")
    return _save(fig, out / "failure_classes.png", dpi)


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
    plt = _plt()
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
    return _save(fig, out / "cross_regime.png", dpi)


def fig_latency(inp: Inputs, out: Path, dpi: int) -> Path | None:
    """Realised wall-clock speedup vs ideal T / mean exit depth, per batch size (SPEC §8)."""
    if inp.latency is None or not inp.latency.height:
        return None
    plt = _plt()

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
                ax.scatter(r[col], r["realised_speedup"], color=_rule_colour(ci),
                           marker=markers[mi], s=42, edgecolors="k", linewidths=0.4, zorder=3)
            ax.set(title=f"batch size {bs}" + (" (compacted)" if bs > 1 else ""), xlabel=xlabel,
                   ylabel="realised speedup (×)", xlim=(0.9, hi), ylim=(0, hi))
            for h, lab in zip(*ax.get_legend_handles_labels(), strict=True):
                handles.setdefault(lab, h)
    from matplotlib.lines import Line2D

    for ci, rule in enumerate(rules):
        handles[f"rule: {rule}"] = Line2D([], [], color=_rule_colour(ci), marker="o", ls="none")
    for mi, model in enumerate(models):
        handles[f"model: {model}"] = Line2D([], [], color="grey", marker=markers[mi % len(markers)], ls="none")
    _legend_below(fig, handles, ncol=3)
    fig.suptitle("Real early exit: realised speedup vs the token-level ideal (top) and the exact-causal ideal (bottom)")
    return _save(fig, out / "latency.png", dpi)


def _rule_colour(i: int):
    """Distinct colours for rules, without greys (grey marks the model legend)."""
    import matplotlib

    cols = [matplotlib.colormaps["tab10"](k) for k in range(10) if k != 7]
    cols += [matplotlib.colormaps["Dark2"](k) for k in range(8) if k != 7]
    return cols[i % len(cols)]


def _slug(s: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", s)


def fig_loopmap(inp: Inputs, lm: dict[str, pl.DataFrame] | None, out: Path, dpi: int, seed_lines: bool = False
                ) -> Path | None:
    """The loop-map figure (the loopmap stage's tables, :mod:`looptrace.report.loopmap_section`): ρ_t, λ_t and
    the noise decay by loop: rows = the three measures, columns = tasks, one line per regime
    (geometric mean over seeds for ρ and the decay, plain mean for λ, each with the across-seed 95 % band)."""
    if lm is None or "per_loop" not in lm:
        return None
    from looptrace.report.figures import (
        FIG_W,
        _band,
        _groups_of,
        _legend_below,
        _plt,
        _save,
        _seeds_label,
        _tasks,
        regime_colours,
    )

    plt = _plt()
    colours = regime_colours(inp.meta)
    tasks = _tasks(inp.meta)
    fig, axes = plt.subplots(3, len(tasks), figsize=(FIG_W, 9.6), squeeze=False, layout="constrained")
    handles: dict[str, object] = {}
    what = None
    for c, task in enumerate(tasks):
        for regime, metas in _groups_of(inp.meta, task):
            names = [m["model"] for m in metas]
            T = max(int(m["n_loops"]) for m in metas)
            x = np.arange(1, T + 1)
            rho = per_loop_values(lm, names, "rho_median", T)
            if not np.isfinite(rho).any():
                continue
            h = _band(axes[0, c], x, rho, colours[regime], regime, log=True, seed_lines=seed_lines)
            _band(axes[1, c], x, per_loop_values(lm, names, "ftle_median", T), colours[regime], regime,
                  seed_lines=seed_lines)
            state, what = decay_values(lm, names, "state", T)
            if np.isfinite(state).any():
                _band(axes[2, c], x, state, colours[regime], regime, log=True, seed_lines=seed_lines)
                lin, _ = decay_values(lm, names, "linear", T)
                _band(axes[2, c], x, lin, colours[regime], regime, log=True, ls="--", marker=None)
            handles.setdefault(f"{regime} ({_seeds_label(len(names))})", h)
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
    _legend_below(fig, handles)
    # short enough for the page width at 12 pt (the long form cut off at both ends); the caption says the rest
    fig.suptitle("Loop map: ρ_t, λ_t and the decay of " + (what or "an intervention").replace(
        "noise of relative scale", "noise") + " (seeds: mean, 95 % band)")
    return _save(fig, out / "loopmap.png", dpi)



def make_figures(inp: Inputs, cfg: ReportConfig, fig_dir: Path) -> dict[str, Path]:
    """Every figure whose inputs exist: name -> PNG path (inside ``fig_dir``)."""
    made: dict[str, Path | None] = {
        "accuracy_per_loop": fig_accuracy_per_loop(inp, fig_dir, cfg.dpi, cfg.seed_lines),
        "step_geometry": fig_step_geometry(inp, fig_dir, cfg.dpi, cfg.seed_lines),
        "convergence": fig_convergence(inp, cfg, fig_dir, cfg.dpi),
    }
    for task in _tasks(inp.meta):
        made[f"pareto_{_slug(task)}"] = fig_pareto(inp, task, fig_dir, cfg.dpi, cfg.seed_lines)
    made["failure_classes"] = fig_failures(inp, fig_dir, cfg.dpi)
    made["cross_regime"] = fig_cross_regime(inp, cfg, fig_dir, cfg.dpi)
    made["latency"] = fig_latency(inp, fig_dir, cfg.dpi)
    made["loopmap"] = fig_loopmap(inp, inp.loopmap, fig_dir, cfg.dpi, cfg.seed_lines)
    return {k: v for k, v in made.items() if v is not None}
