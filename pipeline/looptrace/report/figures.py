"""The report's figures (``figures/<name>.png``), each drawn from :class:`~looptrace.report.inputs.Inputs` only;
a figure whose inputs are missing is not drawn (its function returns None)."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import cast

import numpy as np
import polars as pl

from looptrace.report.inputs import Inputs, ReportConfig

#: Figure file names (``figures/<name>.png``); Pareto fronts add one per task: ``pareto_<task>.png``.
FIGURES = ("accuracy_per_loop", "step_geometry", "convergence", "failure_classes", "cross_regime", "latency")
#: Failure classes of SPEC §7 in plotting order, with their colours.
FAILURE_CLASSES = (("correct", "#4c9f50"), ("trajectory", "#7f7f7f"), ("readout_early", "#e39b2d"),
                   ("readout_overthinking", "#c44e52"))
_REGIME_COLOURS = {"final": "#7f7f7f", "uniform": "#1f77b4", "geometric": "#2ca02c", "joint": "#d62728"}


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update({"font.size": 10, "axes.titlesize": 11, "axes.labelsize": 10, "legend.fontsize": 9,
                         "figure.dpi": 100, "axes.grid": True, "grid.alpha": 0.3})
    return plt


def _regime_colour(kind: str, i: int) -> str | tuple[float, float, float, float]:
    import matplotlib

    return _REGIME_COLOURS.get(kind) or matplotlib.colormaps["tab10"](i % 10)


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


def fig_accuracy_per_loop(inp: Inputs, out: Path, dpi: int) -> Path | None:
    """Test accuracy of the readout at every loop t, one panel per task, one line per regime."""
    if inp.acc_per_loop is None:
        return None
    plt = _plt()
    tasks = _tasks(inp.meta)
    fig, axes = plt.subplots(1, len(tasks), figsize=(5.2 * len(tasks), 3.8), squeeze=False, layout="constrained")
    for ax, task in zip(axes[0], tasks, strict=True):
        for i, m in enumerate(_models_of(inp.meta, task)):
            d = inp.acc_per_loop.filter(pl.col("model") == m["model"]).sort("loop")
            ax.plot(d["loop"], 100 * d["accuracy"], marker="o", color=_regime_colour(m["regime_kind"], i),
                    label=m["regime"])
        ax.set(title=f"{task}: accuracy of each loop's readout", xlabel="loop t", ylabel="test accuracy (%)")
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.legend(title="regime", loc="lower right")
    return _save(fig, out / "accuracy_per_loop.png", dpi)


def fig_step_geometry(inp: Inputs, out: Path, dpi: int) -> Path | None:
    """Median step norm ‖Δ_t‖ and consecutive-step cosine cos(Δ_t, Δ_{t−1}) by loop ([TS]), IQR bands."""
    if inp.loop_summary is None:
        return None
    plt = _plt()
    tasks = _tasks(inp.meta)
    metrics = (("step_norm", r"step norm $\|\Delta_t\|_2$ (state units)"),
               ("step_cos", r"step cosine $\cos(\Delta_t, \Delta_{t-1})$"))
    fig, axes = plt.subplots(2, len(tasks), figsize=(5.2 * len(tasks), 6.8), squeeze=False, layout="constrained")
    for j, task in enumerate(tasks):
        for r, (metric, label) in enumerate(metrics):
            ax = axes[r, j]
            for i, m in enumerate(_models_of(inp.meta, task)):
                d = (inp.loop_summary.filter((pl.col("model") == m["model"]) & (pl.col("group_by") == "all")
                                             & (pl.col("metric") == metric)).sort("loop")
                     .filter(pl.col("count") > 0))
                if not d.height:
                    continue
                c = _regime_colour(m["regime_kind"], i)
                ax.plot(d["loop"], d["median"], marker="o", color=c, label=m["regime"])
                ax.fill_between(d["loop"].to_numpy(), d["q25"].to_numpy(), d["q75"].to_numpy(), color=c, alpha=0.15)
            ax.set(title=f"{task}: {metric.replace('_', ' ')} (median, IQR)", xlabel="loop t", ylabel=label)
            ax.xaxis.get_major_locator().set_params(integer=True)
            if metric == "step_norm":
                ax.set_yscale("log")
            if ax.get_legend_handles_labels()[0]:
                ax.legend(title="regime", fontsize=8)
    return _save(fig, out / "step_geometry.png", dpi)


def fig_convergence(inp: Inputs, cfg: ReportConfig, out: Path, dpi: int) -> Path | None:
    """Mean convergence depth by difficulty (lines) and by token type (bars), per task and regime."""
    if inp.convergence is None:
        return None
    plt = _plt()
    tasks = _tasks(inp.meta)
    fig, axes = plt.subplots(2, len(tasks), figsize=(5.2 * len(tasks), 6.8), squeeze=False, layout="constrained")
    sig = f"{cfg.convergence_signal} < {cfg.convergence_eps:g} ({cfg.convergence_kind})"
    for j, task in enumerate(tasks):
        models = _models_of(inp.meta, task)
        T = max(int(m["n_loops"]) for m in models)
        ax = axes[0, j]
        for i, m in enumerate(models):
            d = inp.convergence.filter((pl.col("model") == m["model"]) & (pl.col("group_by") == "difficulty")).sort("order")
            ax.plot(d["order"], d["mean_depth"], marker="o", color=_regime_colour(m["regime_kind"], i),
                    label=m["regime"])
        ax.axhline(T + 1, color="k", lw=0.8, ls=":", label=f"censored (T + 1 = {T + 1})")
        ax.set(title=f"{task}: convergence depth by difficulty", xlabel="difficulty", ylabel=f"mean depth (loops)\n{sig}")
        ax.legend(fontsize=8)
        ax = axes[1, j]
        groups = list(dict.fromkeys(inp.convergence.filter(
            pl.col("model").is_in([m["model"] for m in models]) & (pl.col("group_by") == "token_type"))
            .sort("order")["group_value"].to_list()))
        width = 0.8 / max(1, len(models))
        for i, m in enumerate(models):
            d = inp.convergence.filter((pl.col("model") == m["model"]) & (pl.col("group_by") == "token_type"))
            val = dict(zip(d["group_value"].to_list(), d["mean_depth"].to_list(), strict=True))
            xs = np.arange(len(groups)) + (i - (len(models) - 1) / 2) * width
            ax.bar(xs, [val.get(g, np.nan) for g in groups], width=width, color=_regime_colour(m["regime_kind"], i),
                   label=m["regime"])
        ax.set_xticks(np.arange(len(groups)), groups)
        ax.axhline(T + 1, color="k", lw=0.8, ls=":")
        ax.set(title=f"{task}: convergence depth by token type", xlabel="token type", ylabel="mean depth (loops)")
        ax.legend(title="regime", fontsize=8)
    return _save(fig, out / "convergence.png", dpi)


#: Colours of post-hoc rules: tab20 without its reds (native gate) and greys (fixed depth, oracle edge).
_POSTHOC_COLOURS = [i for i in range(20) if i not in (6, 7, 14, 15)]
#: Legend / drawing order of rule kinds on the Pareto figure.
_KIND_ORDER = {"fixed": 0, "native": 1, "gate": 2, "posthoc": 3, "oracle": 4}


def _rule_style(rule: str, kind: str, i: int):
    import matplotlib

    if kind == "fixed":
        return {"color": "black", "marker": "s", "ls": "-", "lw": 1.6}
    if kind == "native":
        return {"color": "#d62728", "marker": "D", "ls": "-", "lw": 1.8}
    if kind == "oracle":
        return {"color": "gold", "marker": "*", "ls": "none", "ms": 14, "mec": "k"}
    if kind == "gate":
        return {"color": matplotlib.colormaps["Dark2"](i % 8), "marker": "v", "ls": "--", "lw": 1.4}
    return {"color": matplotlib.colormaps["tab20"](_POSTHOC_COLOURS[i % len(_POSTHOC_COLOURS)]), "marker": "o",
            "ls": "-", "lw": 1.0, "ms": 3.5}


def fig_pareto(inp: Inputs, task: str, out: Path, dpi: int) -> Path | None:
    """Test operating points on each rule's own Pareto front (accuracy vs mean exit depth), one panel per
    regime of ``task``: every post-hoc rule, fixed depth, the native gate, refit gates and the oracle."""
    if inp.pareto is None:
        return None
    plt = _plt()
    models = _models_of(inp.meta, task)
    n = len(models)
    fig, axes = plt.subplots(1, n, figsize=(4.6 * n + 2.6, 5.0), squeeze=False, layout="constrained")
    handles: dict[str, object] = {}
    sub = inp.pareto.filter(pl.col("model").is_in([m["model"] for m in models]))
    kinds = dict(zip(sub["rule"].to_list(), sub["kind"].to_list(), strict=True))
    rules = sorted(kinds, key=lambda r: (_KIND_ORDER.get(kinds[r], 5), r))
    colour_index: dict[str, int] = {}
    for r in rules:  # one colour per rule across panels, counted within its kind
        colour_index[r] = sum(1 for q in colour_index if kinds[q] == kinds[r])
    for ax, m in zip(axes[0], models, strict=True):
        p = sub.filter(pl.col("model") == m["model"])
        for rule in rules:
            d = p.filter(pl.col("rule") == rule).sort("mean_depth")
            if not d.height:
                continue
            (h,) = ax.plot(d["mean_depth"], 100 * d["accuracy"], label=rule,
                           **_rule_style(rule, kinds[rule], colour_index[rule]))
            handles.setdefault(rule, h)
        if inp.chosen is not None:
            c = inp.chosen.filter(pl.col("model") == m["model"])
            if c.height:
                h = ax.scatter(c["test_depth"], 100 * c["test_accuracy"], s=60, facecolors="none", edgecolors="k",
                               linewidths=1.0, zorder=5, label="chosen point (val within δ)")
                handles.setdefault("chosen point (val within δ)", h)
        lo = 100 * float(cast(float, p["accuracy"].min())) if p.height else 0.0
        ax.set(title=f"{m['regime']}", xlabel="mean exit depth (loops)", ylabel="test accuracy (%)",
               xlim=(0.8, m["n_loops"] + 0.2), ylim=(max(0.0, lo - 0.05 * (100 - lo) - 0.5), 100.3))
        ax.xaxis.get_major_locator().set_params(integer=True)
    fig.suptitle(f"{task}: Pareto fronts of every exit rule (test split)")
    fig.legend(list(handles.values()), list(handles.keys()), loc="outside right center", fontsize=8, frameon=False)
    return _save(fig, out / f"pareto_{_slug(task)}.png", dpi)


def fig_failures(inp: Inputs, out: Path, dpi: int) -> Path | None:
    """Failure classes (SPEC §7) of every rule at its chosen point, share of test tokens, per model."""
    if inp.failures is None or not inp.failures.height:
        return None
    plt = _plt()
    f = inp.failures.filter(pl.col("group") == "all")
    models = [m for m in inp.meta["model"].to_list() if m in set(f["model"].to_list())]
    if not models:
        return None
    ncol = min(3, len(models))
    nrow = math.ceil(len(models) / ncol)
    n_rules = max(f.filter(pl.col("model") == m).height for m in models)
    fig, axes = plt.subplots(nrow, ncol, figsize=(5.0 * ncol, 0.28 * n_rules * nrow + 1.6 * nrow + 0.6),
                             squeeze=False, layout="constrained")
    for k, model in enumerate(models):
        ax = axes[k // ncol, k % ncol]
        d = f.filter(pl.col("model") == model).sort("source", "rule", descending=True)
        labels = d["rule"].to_list()
        # Errors only (the correct share is 100 − the bar): near-perfect models stay readable.
        left = np.zeros(d.height)
        for cls, colour in FAILURE_CLASSES[1:]:
            v = 100 * d[f"frac_{cls}"].to_numpy()
            ax.barh(np.arange(d.height), v, left=left, color=colour, label=cls.replace("_", " "))
            left += v
        top = max(float(left.max()), 0.1)
        for y, tot in enumerate(left):
            ax.text(tot + 0.01 * top, y, f"{tot:.2f}" if top < 5 else f"{tot:.1f}", va="center", fontsize=7)
        ax.set_yticks(np.arange(d.height), labels, fontsize=8)
        ax.set(title=model, xlabel="wrong test tokens (% of all)", xlim=(0, top * 1.18))
    for k in range(len(models), nrow * ncol):
        axes[k // ncol, k % ncol].set_visible(False)
    h, lab = axes[0, 0].get_legend_handles_labels()
    fig.legend(h, lab, loc="outside lower center", ncol=4, frameon=False)
    fig.suptitle("Failure classes (SPEC §7) at each rule's chosen operating point: share of test tokens the "
                 "rule gets wrong, by cause")
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
    fig, axes = plt.subplots(nrow, ncol, figsize=(5.4 * ncol, 4.6 * nrow), squeeze=False, layout="constrained")
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
                ax.text(j, i, f"{mat[i, j]:.2f}" if ok else "n/a", ha="center", va="center", fontsize=9,
                        color=("w" if (mat[i, j] > mid) == depth_like else "k") if ok else "k")
        ax.set_xticks(np.arange(len(colsv)), colsv, rotation=25, ha="right", fontsize=8)
        ax.set_yticks(np.arange(len(rows)), rows, fontsize=8)
        ax.set(xlabel="applied to (eval model)", ylabel="gate fit on (fit model)",
               title=" · ".join(str(x) for x in facet))
        ax.grid(False)
        fig.colorbar(im, ax=ax, label=unit, shrink=0.85)
    for k in range(len(facets), nrow * ncol):
        axes[k // ncol, k % ncol].set_visible(False)
    fig.suptitle("Cross-regime transfer of offline gates\n(fit on one model's frozen trajectories, applied to "
                 "another's; n/a = unreachable)", fontsize=10)
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
    fig, axes = plt.subplots(2, len(sizes), figsize=(5.0 * len(sizes) + 2.6, 8.6), squeeze=False,
                             layout="constrained")
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
                   ylabel="realised speedup:\nwall time full / early exit (×)", xlim=(0.9, hi), ylim=(0, hi))
            for h, lab in zip(*ax.get_legend_handles_labels(), strict=True):
                handles.setdefault(lab, h)
    from matplotlib.lines import Line2D

    for ci, rule in enumerate(rules):
        handles[f"rule: {rule}"] = Line2D([], [], color=_rule_colour(ci), marker="o", ls="none")
    for mi, model in enumerate(models):
        handles[f"model: {model}"] = Line2D([], [], color="grey", marker=markers[mi % len(markers)], ls="none")
    fig.legend(list(handles.values()), list(handles.keys()), loc="outside right center", fontsize=8, frameon=False)
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


def make_figures(inp: Inputs, cfg: ReportConfig, fig_dir: Path) -> dict[str, Path]:
    """Every figure whose inputs exist: name -> PNG path (inside ``fig_dir``)."""
    made: dict[str, Path | None] = {
        "accuracy_per_loop": fig_accuracy_per_loop(inp, fig_dir, cfg.dpi),
        "step_geometry": fig_step_geometry(inp, fig_dir, cfg.dpi),
        "convergence": fig_convergence(inp, cfg, fig_dir, cfg.dpi),
    }
    for task in _tasks(inp.meta):
        made[f"pareto_{_slug(task)}"] = fig_pareto(inp, task, fig_dir, cfg.dpi)
    made["failure_classes"] = fig_failures(inp, fig_dir, cfg.dpi)
    made["cross_regime"] = fig_cross_regime(inp, cfg, fig_dir, cfg.dpi)
    made["latency"] = fig_latency(inp, fig_dir, cfg.dpi)
    return {k: v for k, v in made.items() if v is not None}
