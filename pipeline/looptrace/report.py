"""The ``report`` stage: figures, headline tables and findings of a looptrace run, as PNGs and one
offline HTML page (SPEC §10: ``artifacts/report/index.html``, ``figures/*.png``).

Everything shown is read from the other stages' artifacts (never recomputed from trajectories):

| figure | input |
|---|---|
| per-loop accuracy by regime | ``readouts/<model>/metrics.json`` (``test_accuracy_per_loop``) |
| step norm and step cosine by loop | ``geometry/<model>/loop_summary.parquet`` |
| convergence depth by difficulty and token type | ``geometry/<model>/convergence.parquet`` (+ loop_summary for names) |
| Pareto fronts per task | ``readouts/<model>/pareto.parquet``, ``chosen.parquet``, ``gates/<model>/pareto.parquet`` |
| failure classes | ``diagnose/failure_classes.parquet`` |
| cross-regime gate matrix | ``gates/cross_regime.parquet`` |
| realised vs ideal speedup | ``latency/latency.parquet`` |
| generation with early exit (table, findings) | ``generate/generate.parquet``, ``generate/metrics.json`` |

A figure whose inputs are missing is left out and the page says which stage to run, so the report
works on partial pipelines (the tests build tiny constructed outputs). The page uses relative image
paths and no scripts or external resources, so it opens offline from the file system.
"""

from __future__ import annotations

import html
import json
import math
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import polars as pl

from looptrace.config import MissingInputError
from looptrace.diagnose import dx_best, with_val_columns
from looptrace.intervals import Interval, across_seeds, from_row
from looptrace.io.artifacts import read_json, read_parquet
from looptrace.io.parquet import read_verified
from looptrace.project import split_seed
from looptrace.rules.scoring import best_chosen

#: Figure file names (``figures/<name>.png``); Pareto fronts add one per task: ``pareto_<task>.png``.
FIGURES = ("accuracy_per_loop", "step_geometry", "convergence", "failure_classes", "cross_regime", "latency")
#: Failure classes of SPEC §7 in plotting order, with their colours.
FAILURE_CLASSES = (("correct", "#4c9f50"), ("trajectory", "#7f7f7f"), ("readout_early", "#e39b2d"),
                   ("readout_overthinking", "#c44e52"))
_REGIME_COLOURS = {"final": "#7f7f7f", "uniform": "#1f77b4", "geometric": "#2ca02c", "joint": "#d62728"}


@dataclass(frozen=True)
class ReportConfig:
    """``report`` section of ``params.yaml``.

    Attributes:
        x: the D@X target (percent) of the headline tables.
        split: split the figures describe (the readouts/gates operating points are always test).
        convergence_signal, convergence_eps, convergence_kind: which convergence depth of
            ``convergence.parquet`` the convergence figure shows (SPEC §2: signal, ε, first|settled).
        dpi: PNG resolution.
        title: page title.
    """

    x: float = 95.0
    split: str = "test"
    convergence_signal: str = "kl_prev"
    convergence_eps: float = 0.001
    convergence_kind: str = "first"
    dpi: int = 110
    title: str = "looptrace report"

    def __post_init__(self) -> None:
        from looptrace.config import ConfigError

        if not 0.0 < self.x <= 100.0:
            raise ConfigError(f"report.x is an accuracy percentage in (0, 100], got {self.x}")
        if self.convergence_kind not in ("first", "settled"):
            raise ConfigError(f"report.convergence_kind must be first or settled, got {self.convergence_kind!r}")
        if self.dpi < 50:
            raise ConfigError(f"report.dpi must be ≥ 50, got {self.dpi}")


@dataclass
class Inputs:
    """Everything the report reads, one frame per kind (``model`` column added), None when absent.

    Attributes:
        meta: model, task, regime, regime_kind, n_loops, full_depth_accuracy (test), has_gate.
        acc_per_loop: model, loop, accuracy (test).
        loop_summary: loop_summary rows of ``split`` (group_by all and token_type).
        convergence: per model × group (difficulty | token_type) mean depth of the chosen signal.
        pareto, chosen, dx: readouts (+ gates, ``source`` column) rows.
        failures, verdicts, verdict_groups: diagnose tables; summary: diagnose summary.md text; claims: its
            [AD] claim statuses (metrics.json).
        full_depth: model, accuracy (+ accuracy_lo/hi, n_boot, n_sequences): fixed depth's test point at T
            (``operating_points.parquet``), the full-depth accuracy with its interval.
        cross_regime: gates' cross-regime table.
        latency: latency.parquet; latency_metrics: its metrics.json.
        generate: generate.parquet (generation-time early exit); generate_metrics: its metrics.json.
        missing: input -> what to run.
    """

    meta: pl.DataFrame
    acc_per_loop: pl.DataFrame | None = None
    loop_summary: pl.DataFrame | None = None
    convergence: pl.DataFrame | None = None
    pareto: pl.DataFrame | None = None
    chosen: pl.DataFrame | None = None
    dx: pl.DataFrame | None = None
    failures: pl.DataFrame | None = None
    verdicts: pl.DataFrame | None = None
    summary: str | None = None
    cross_regime: pl.DataFrame | None = None
    latency: pl.DataFrame | None = None
    latency_metrics: dict | None = None
    full_depth: pl.DataFrame | None = None
    verdict_groups: pl.DataFrame | None = None
    claims: dict | None = None
    generate: pl.DataFrame | None = None
    generate_metrics: dict | None = None
    missing: dict[str, str] = field(default_factory=dict)


def _concat(frames: list[pl.DataFrame]) -> pl.DataFrame | None:
    frames = [f for f in frames if f is not None and f.height]
    return pl.concat(frames, how="diagonal_relaxed") if frames else None


def _token_type_names(loop_summary: pl.DataFrame | None, ids: np.ndarray) -> dict[int, str]:
    """token_type id -> name: loop_summary lists the token-type groups by increasing id (geometry
    ``summarise_loop``), and convergence rows carry the ids of the same tokens."""
    uniq = sorted(int(i) for i in np.unique(ids))
    if loop_summary is None:
        return {i: str(i) for i in uniq}
    names = (loop_summary.filter((pl.col("group_by") == "token_type") & (pl.col("loop") == 1)
                                 & (pl.col("metric") == loop_summary["metric"][0]))["group_value"].to_list())
    return dict(zip(uniq, names, strict=True)) if len(names) == len(uniq) else {i: str(i) for i in uniq}


def load_inputs(models: Sequence[str], root: Path | str, cfg: ReportConfig) -> Inputs:
    """Read every stage's outputs for ``models`` under the artifacts ``root`` (SPEC §10 layout).

    Raises:
        FileNotFoundError: a model has no ``readouts/<model>/metrics.json`` (the report's spine).
    """
    root = Path(root)
    meta_rows, acc_rows, ls, conv, pareto, chosen, dx, full = [], [], [], [], [], [], [], []
    missing: dict[str, str] = {}
    for model in models:
        rdir = root / "readouts" / model
        mpath = rdir / "metrics.json"
        if not mpath.is_file():
            raise MissingInputError(f"{mpath} not found; run the readouts stage for {model} first")
        rm = read_json(mpath)
        T = int(rm.get("n_loops") or len(rm.get("test_accuracy_per_loop") or []))
        meta_rows.append({"model": model, "task": rm.get("task") or model, "regime": rm.get("regime") or model,
                          "regime_kind": rm.get("regime_kind") or rm.get("regime") or "?", "n_loops": T,
                          "full_depth_accuracy": (rm.get("full_depth_accuracy") or {}).get("test"),
                          "has_gate": bool(rm.get("has_gate"))})
        for t, a in enumerate(rm.get("test_accuracy_per_loop") or [], start=1):
            acc_rows.append({"model": model, "loop": t, "accuracy": float(a)})
        for src, d in (("readouts", rdir), ("gates", root / "gates" / model)):
            for name, acc in (("pareto", pareto), ("chosen", chosen), ("dx", dx)):
                p = d / f"{name}.parquet"
                if p.is_file():
                    f = read_parquet(p)
                    if "kind" not in f.columns:
                        f = f.with_columns(kind=pl.lit("gate" if src == "gates" else "posthoc"))
                    acc.append(f.with_columns(model=pl.lit(model), source=pl.lit(src)))
                elif src == "readouts":
                    raise MissingInputError(f"{p} not found; run the readouts stage for {model} first")
                else:
                    missing[f"gates/{model}"] = "run the gates stage"
        ops = rdir / "operating_points.parquet"
        if ops.is_file():
            f = (read_verified(ops).lazy().filter((pl.col("rule") == "fixed") & (pl.col("split") == "test")
                                             & (pl.col("threshold") == float(T))).collect())
            if f.height:
                full.append(f.head(1).with_columns(model=pl.lit(model)))
        gdir = root / "geometry" / model
        lp, cp = gdir / "loop_summary.parquet", gdir / "convergence.parquet"
        summ = None
        if lp.is_file():
            summ = read_parquet(lp).filter(pl.col("split") == cfg.split)
            ls.append(summ.filter(pl.col("group_by").is_in(["all", "token_type"])).with_columns(model=pl.lit(model)))
        else:
            missing[f"geometry/{model}/loop_summary.parquet"] = "run the geometry stage"
        if cp.is_file():
            c = (read_verified(cp).lazy().filter((pl.col("split") == cfg.split)
                                             & (pl.col("signal") == cfg.convergence_signal)
                                             & ((pl.col("eps") - cfg.convergence_eps).abs() <= 1e-12 * max(1.0, cfg.convergence_eps))
                                             & (pl.col("kind") == cfg.convergence_kind))
                 .select("difficulty", "token_type", "depth", "censored").collect())
            if c.height:
                names = _token_type_names(summ, c["token_type"].to_numpy())
                for key in ("difficulty", "token_type"):
                    g = (c.group_by(key).agg(mean_depth=pl.col("depth").mean(), censored=pl.col("censored").mean(),
                                             n=pl.len()).sort(key))
                    labels = [names.get(int(v), str(v)) if key == "token_type" else str(v) for v in g[key].to_list()]
                    conv.append(pl.DataFrame({"model": model, "group_by": key, "group_value": labels,
                                              "order": g[key].cast(pl.Int64), "mean_depth": g["mean_depth"],
                                              "censored": g["censored"], "n": g["n"].cast(pl.Int64)}))
            else:
                missing[f"geometry/{model}/convergence.parquet"] = (
                    f"no rows for {cfg.convergence_signal}@{cfg.convergence_eps:g} ({cfg.convergence_kind}); "
                    "check report.convergence_* against geometry.eps")
        else:
            missing[f"geometry/{model}/convergence.parquet"] = "run the geometry stage"
    meta = pl.DataFrame(meta_rows, schema={"model": pl.String, "task": pl.String, "regime": pl.String,
                                           "regime_kind": pl.String, "n_loops": pl.Int64,
                                           "full_depth_accuracy": pl.Float64, "has_gate": pl.Boolean})
    inp = Inputs(meta=meta, acc_per_loop=pl.DataFrame(acc_rows) if acc_rows else None, loop_summary=_concat(ls),
                 convergence=_concat(conv), pareto=_concat(pareto), chosen=_concat(chosen), dx=_concat(dx),
                 full_depth=_concat(full), missing=missing)
    ddir = root / "diagnose"
    for name in ("failure_classes", "verdicts", "verdict_groups"):
        p = ddir / f"{name}.parquet"
        if p.is_file():
            f = read_parquet(p)
            setattr(inp, "failures" if name == "failure_classes" else name,
                    f.filter(pl.col("model").is_in(list(models))) if "model" in f.columns else f)
        elif name != "verdict_groups":  # diagnose outputs before issue 12 have no group table
            missing[f"diagnose/{name}.parquet"] = "run the diagnose stage"
    if (ddir / "metrics.json").is_file():
        inp.claims = read_json(ddir / "metrics.json").get("claims")
    if (ddir / "summary.md").is_file():
        inp.summary = (ddir / "summary.md").read_text()
    cr = root / "gates" / "cross_regime.parquet"
    if cr.is_file():
        inp.cross_regime = read_parquet(cr)
    else:
        missing["gates/cross_regime.parquet"] = "run the gates stage"
    lat = root / "latency" / "latency.parquet"
    if lat.is_file():
        inp.latency = read_parquet(lat).filter(pl.col("model").is_in(list(models)))
        lm = root / "latency" / "metrics.json"
        inp.latency_metrics = read_json(lm) if lm.is_file() else None
    else:
        missing["latency/latency.parquet"] = "run the latency stage"
    gen = root / "generate" / "generate.parquet"
    if gen.is_file():
        inp.generate = read_parquet(gen).filter(pl.col("model").is_in(list(models)))
        gm = root / "generate" / "metrics.json"
        inp.generate_metrics = read_json(gm) if gm.is_file() else None
    else:
        missing["generate/generate.parquet"] = "run the generate stage"
    return inp


# ----------------------------------------------------------------------------------------------
# Figures
# ----------------------------------------------------------------------------------------------


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update({"font.size": 10, "axes.titlesize": 11, "axes.labelsize": 10, "legend.fontsize": 9,
                         "figure.dpi": 100, "axes.grid": True, "grid.alpha": 0.3})
    return plt


def _regime_colour(kind: str, i: int) -> str:
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
    colour_index = {}
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
        lo = 100 * float(p["accuracy"].min()) if p.height else 0.0
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
    keys = [k for k in ("task", "rule") if k in d.columns] or [k for k in ("labels",) if k in d.columns]
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
    hi = float(max(lat["ideal_speedup"].max(), lat["realised_speedup"].max())) * 1.08
    handles = {}
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


# ----------------------------------------------------------------------------------------------
# Tables, findings, the page
# ----------------------------------------------------------------------------------------------


def _num(v) -> float:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return math.nan
    return f


def _fmt(v, nd: int = 2, unit: str = "") -> str:
    f = _num(v)
    return "—" if not math.isfinite(f) else f"{f:.{nd}f}{unit}"


#: Headline figures of the report, in table order: (column, header, kind) — kind ``pct`` (accuracy, shown in %),
#: ``depth`` (loops) or ``dx`` (D@X in loops; +inf = not reached).
HEADLINE_FIGURES = (("full_depth_accuracy", "full-depth accuracy (%)", "pct"),
                    ("best_posthoc_depth", "best post-hoc depth", "depth"),
                    ("best_posthoc_accuracy", "best post-hoc accuracy (%)", "pct"),
                    ("dx_fixed", "D@{x} fixed", "dx"), ("dx_best_posthoc", "D@{x} best post-hoc", "dx"),
                    ("dx_native", "D@{x} native gate", "dx"), ("dx_best_gate", "D@{x} best gate", "dx"),
                    ("oracle_depth", "oracle depth", "depth"))


def _interval_of(row: dict | None, col: str) -> Interval | None:
    return None if row is None else from_row(row, col)


def headline(inp: Inputs, cfg: ReportConfig) -> pl.DataFrame:
    """One row per model: full-depth accuracy, the best post-hoc rule chosen on *val* with its test depth and
    accuracy, D@X of fixed depth / best post-hoc rule / native gate / best refit gate (each rule chosen on val,
    :func:`looptrace.diagnose.dx_best`; D@X itself picks its threshold on test labels), the oracle ceiling's
    depth, and diagnose's verdict. Every figure has ``_lo``/``_hi`` bounds (the 95 % bootstrap interval over
    test sequences the readouts/gates stages wrote; NaN when intervals were off) and a ``_text`` column
    (``1.15 [1.11, 1.19]``, "not reached", "not run").

    Returns:
        DataFrame model, group, seed, task, regime, regime_kind, best_posthoc_rule, dx_best_posthoc_rule,
        best_gate_rule, verdict, reason, n_boot, n_sequences, and for every figure of :data:`HEADLINE_FIGURES`
        ``<figure>``, ``<figure>_lo``, ``<figure>_hi``, ``<figure>_text`` (accuracies as fractions, D@X NaN =
        not run, +inf = not reached).
    """
    x = float(cfg.x)
    rows = []
    for m in inp.meta.iter_rows(named=True):
        model = m["model"]
        dx = (inp.dx.filter((pl.col("model") == model) & (pl.col("x") == x)) if inp.dx is not None
              else pl.DataFrame(schema={"rule": pl.String, "kind": pl.String, "d_at": pl.Float64}))
        ch = inp.chosen.filter(pl.col("model") == model) if inp.chosen is not None else pl.DataFrame()
        figs: dict[str, Interval | None] = {}
        figs["dx_fixed"], _ = dx_best(dx, ["fixed"])
        figs["dx_best_posthoc"], dx_rule = dx_best(dx, ["posthoc"])
        figs["dx_native"], _ = dx_best(dx, ["native"])
        figs["dx_best_gate"], _ = dx_best(dx, ["gate"])
        best = best_chosen(with_val_columns(ch), ["posthoc"]) if ch.height else None
        gate = best_chosen(with_val_columns(ch), ["gate"]) if ch.height else None
        figs["best_posthoc_depth"] = _interval_of(best, "test_depth")
        figs["best_posthoc_accuracy"] = _interval_of(best, "test_accuracy")
        full = Interval(_num(m["full_depth_accuracy"]), method="none")
        if inp.full_depth is not None:
            f = inp.full_depth.filter(pl.col("model") == model)
            if f.height:
                full = from_row(f.row(0, named=True), "accuracy")
        figs["full_depth_accuracy"] = full if full.present else None
        figs["oracle_depth"] = None
        if inp.pareto is not None:
            o = inp.pareto.filter((pl.col("model") == model) & (pl.col("kind") == "oracle"))
            if o.height:
                figs["oracle_depth"] = from_row(o.row(0, named=True), "mean_depth")
        verdict = reason = None
        if inp.verdicts is not None and "model" in inp.verdicts.columns:
            v = inp.verdicts.filter(pl.col("model") == model)
            if v.height:
                verdict = v["verdict"][0]
                reason = v["reason"][0] if "reason" in v.columns else None
        group, seed = split_seed(model)
        ref = next((i for i in figs.values() if i is not None and i.n_boot), None)
        row = {"model": model, "group": group, "seed": seed, "task": m["task"], "regime": m["regime"],
               "regime_kind": m["regime_kind"], "best_posthoc_rule": best["rule"] if best else None,
               "dx_best_posthoc_rule": dx_rule, "best_gate_rule": gate["rule"] if gate else None,
               "verdict": verdict, "reason": reason, "n_boot": ref.n_boot if ref else 0,
               "n_sequences": ref.n_sequences if ref else 0}
        for name, _, kind in HEADLINE_FIGURES:
            row.update(_figure_cols(name, figs.get(name), kind))
        rows.append(row)
    schema = {"model": pl.String, "group": pl.String, "seed": pl.Int64, "task": pl.String, "regime": pl.String,
              "regime_kind": pl.String, "best_posthoc_rule": pl.String, "dx_best_posthoc_rule": pl.String,
              "best_gate_rule": pl.String, "verdict": pl.String, "reason": pl.String, "n_boot": pl.Int64,
              "n_sequences": pl.Int64}
    for name, _, _ in HEADLINE_FIGURES:
        schema.update({name: pl.Float64, f"{name}_lo": pl.Float64, f"{name}_hi": pl.Float64, f"{name}_text": pl.String})
    return pl.DataFrame(rows, schema=schema)


def _figure_text(i: Interval | None, kind: str) -> str:
    """A headline cell: ``1.15 [1.11, 1.19]`` (accuracies in %), "not reached" (D@X), "not run" (absent)."""
    if i is None or not i.present:
        return "not run"
    if kind == "dx" and math.isinf(i.estimate):
        return (f"not reached in {i.n_unreachable} of {i.n_seeds} seeds" if i.n_seeds > 1 and i.n_unreachable
                else "not reached")
    return i.fmt(2, 100.0 if kind == "pct" else 1.0).replace("unreachable", "not reached")


def _figure_cols(name: str, i: Interval | None, kind: str) -> dict:
    est, lo, hi = (math.nan,) * 3 if i is None else (i.estimate, i.lo, i.hi)
    return {name: est, f"{name}_lo": lo, f"{name}_hi": hi, f"{name}_text": _figure_text(i, kind)}


def _row_interval(row: dict, name: str) -> Interval | None:
    v = _num(row.get(name))
    return None if math.isnan(v) else Interval(v, _num(row.get(f"{name}_lo")), _num(row.get(f"{name}_hi")))


def group_headline(head: pl.DataFrame, inp: Inputs, level: float = 0.95) -> pl.DataFrame:
    """One row per task × regime (the models that differ only by training seed): every headline figure as the
    across-seed mean with its Student-t 95 % interval (:func:`looptrace.intervals.across_seeds`; one seed: that
    model's bootstrap interval), the seed count, the rules chosen per seed, and diagnose's group verdict
    (``verdict_groups.parquet``) when present.

    Returns:
        DataFrame group, task, regime, regime_kind, n_seeds, best_posthoc_rules, verdict, reason, seed_verdicts
        and ``<figure>``, ``_lo``, ``_hi``, ``_text`` for every figure of :data:`HEADLINE_FIGURES`.
    """
    rows = []
    for g in dict.fromkeys(head["group"].to_list()):
        sub = list(head.filter(pl.col("group") == g).iter_rows(named=True))
        row = {"group": g, "task": sub[0]["task"], "regime": sub[0]["regime"], "regime_kind": sub[0]["regime_kind"],
               "n_seeds": len(sub), "best_posthoc_rules": ", ".join(dict.fromkeys(r["best_posthoc_rule"] or "none"
                                                                                   for r in sub)),
               "verdict": None, "reason": None, "seed_verdicts": None}
        for name, _, kind in HEADLINE_FIGURES:
            iv = across_seeds([i for i in (_row_interval(r, name) for r in sub) if i is not None], level)
            row.update(_figure_cols(name, iv if iv.present else None, kind))
        if inp.verdict_groups is not None and "group" in inp.verdict_groups.columns:
            v = inp.verdict_groups.filter(pl.col("group") == g)
            if v.height:
                row.update({k: v[k][0] for k in ("verdict", "reason", "seed_verdicts") if k in v.columns})
        rows.append(row)
    schema = {"group": pl.String, "task": pl.String, "regime": pl.String, "regime_kind": pl.String,
              "n_seeds": pl.Int64, "best_posthoc_rules": pl.String, "verdict": pl.String, "reason": pl.String,
              "seed_verdicts": pl.String}
    for name, _, _ in HEADLINE_FIGURES:
        schema.update({name: pl.Float64, f"{name}_lo": pl.Float64, f"{name}_hi": pl.Float64, f"{name}_text": pl.String})
    return pl.DataFrame(rows, schema=schema)


def _md_table(df: pl.DataFrame, cols: Sequence[tuple[str, str]]) -> list[str]:
    """A Markdown pipe table of ``df``'s columns (column, header); None reads "—"."""
    out = ["| " + " | ".join(h for _, h in cols) + " |", "|" + "---|" * len(cols)]
    for r in df.iter_rows(named=True):
        out.append("| " + " | ".join("—" if r.get(c) is None else str(r.get(c)) for c, _ in cols) + " |")
    return out


def run_summary_markdown(head: pl.DataFrame, groups: pl.DataFrame, inp: Inputs, cfg: ReportConfig,
                         machine_info: dict, versions_info: dict, claims: dict | None = None) -> str:
    """``artifacts/report/summary.md``: the headline tables with intervals and seed counts, the verdicts and
    [AD] claim statuses, and the machine and versions the run was made with (every figure from the artifacts).

    Args:
        head: :func:`headline` rows; groups: :func:`group_headline` rows.
        inp: the report's inputs (latency findings).
        cfg: the ``report`` section.
        machine_info: :func:`looptrace.project.machine` (date, platform, CPU).
        versions_info: :func:`looptrace.project.versions`.
        claims: diagnose's claim statuses ({"a": "holds", ...}), optional.
    """
    x = f"{cfg.x:g}"
    figs = [(f"{n}_text", h.format(x=x)) for n, h, _ in HEADLINE_FIGURES]
    nb = sorted({int(v) for v in head["n_boot"].to_list() if v})
    ns = sorted({int(v) for v in head["n_sequences"].to_list() if v})
    boot = (f"bootstrap over test sequences, {', '.join(map(str, nb))} resamples of "
            f"{', '.join(map(str, ns))} sequences" if nb else "no bootstrap (intervals.n_boot = 0: point values only)")
    lines = [f"# {cfg.title}: run summary", "",
             f"Run of {machine_info.get('date')} on {machine_info.get('platform')} "
             f"({machine_info.get('cpu')}, {machine_info.get('cpu_count')} CPUs); versions below. "
             f"{head.height} models in {groups.height} task × regime groups. Every figure is read from the "
             "pipeline's artifacts and printed as `estimate [lo, hi]`, a 95 % interval. Exact bytes depend on the "
             "CPU (the same params give different weights on another machine); findings must hold within the "
             "intervals, and two figures whose intervals overlap are within noise of each other.", "",
             f"D@{x} = the smallest mean exit depth (loops) whose test accuracy ≥ {x} %, its threshold picked on test "
             "labels (an oracle-threshold figure); \"not reached\" = no operating point reaches it. The best post-hoc "
             "rule and each D@X's rule are chosen on validation, never on test. Depths are loops; accuracies %.", "",
             "## Headline per task × regime (across seeds)", "",
             "Mean over training seeds with the Student-t 95 % interval (mean ± t · sd / √n); with one seed, that "
             "model's bootstrap interval.", ""]
    lines += _md_table(groups, [("group", "task × regime"), ("regime_kind", "regime"), ("n_seeds", "seeds"),
                                ("best_posthoc_rules", "best post-hoc rule(s)"), *figs, ("verdict", "verdict")])
    lines += ["", f"## Headline per model ({boot})", ""]
    lines += _md_table(head, [("model", "model"), ("regime_kind", "regime"), ("best_posthoc_rule", "best post-hoc rule"),
                              *figs, ("verdict", "verdict")])
    if groups["verdict"].drop_nulls().len() or claims:
        lines += ["", "## Verdicts and [AD]'s claims", ""]
        for g in groups.iter_rows(named=True):
            if g["verdict"]:
                lines.append(f"- {g['group']} ({g['n_seeds']} seed{'s' if g['n_seeds'] != 1 else ''}): "
                             f"{g['verdict']} ({g['reason']}); per seed: {g['seed_verdicts']}.")
        for k, v in (claims or {}).items():
            lines.append(f"- [AD] claim ({k}): {v}.")
        lines += ["", "The sentences behind them (figures, comparisons, error counts): artifacts/diagnose/summary.md."]
    lf = latency_findings(inp.latency, inp.latency_metrics)
    if lf:
        lines += ["", "## Real early exit", ""] + [f"- {s}" for s in lf]
    if inp.loop_summary is not None:
        inf = nonfinite_table(inp.loop_summary)
        lines += ["", "## Non-finite values", "", _nonfinite_text(inf)]
        if inf is not None and inf.height:
            lines += [""] + _md_table(inf, [("model", "model"), ("metric", "metric"), ("n_inf", "±∞ left out"),
                                            ("loops", "at loops"), ("n_nan", "NaN left out")])
    lines += ["", "## Machine and versions", "", "| | |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in machine_info.items()]
    lines += [f"| {k} | {v if v is not None else 'not installed'} |" for k, v in versions_info.items()]
    return "\n".join(lines) + "\n"


def nonfinite_table(loop_summary: pl.DataFrame | None) -> pl.DataFrame | None:
    """±inf values the geometry stage left out of its loop summaries, per (model, metric) of the report's split
    (``group_by = all``): ``n_inf`` (summed over loops), ``loops`` (those with any, 1-based, as text) and
    ``n_nan`` for the same metric (NaN is also "undefined", e.g. a step cosine at loop 1). Empty = none; None = the
    summaries predate the ``n_inf`` column (re-run geometry)."""
    if loop_summary is None or "n_inf" not in loop_summary.columns:
        return None
    d = loop_summary.filter(pl.col("group_by") == "all")
    return (d.group_by("model", "metric", maintain_order=True)
            .agg(n_inf=pl.col("n_inf").sum(), n_nan=pl.col("n_nan").sum(),
                 loops=pl.col("loop").filter(pl.col("n_inf") > 0).sort().cast(pl.String).str.join(", "))
            .filter(pl.col("n_inf") > 0).sort("model", "metric"))


def _nonfinite_text(tab: pl.DataFrame | None) -> str:
    if tab is None:
        return ("The loop summaries predate the n_inf column, so infinite (±∞) values they left out are not known: re-run "
                "the geometry stage.")
    if not tab.height:
        return "No infinite (±∞) value in any trajectory metric: the loop summaries left out only undefined (NaN) values."
    return (f"{int(tab['n_inf'].sum())} infinite (±∞) values were left out of the loop summaries (means, medians and "
            "quartiles are over the finite values only): per model and metric below.")


def latency_findings(lat: pl.DataFrame | None, lat_metrics: dict | None) -> list[str]:
    """Sentences about real early exit, generated from latency.parquet (never hand-written numbers)."""
    if lat is None or not lat.height:
        return []
    out = []
    n, n_exact = lat.height, int(lat["exact"].sum())
    if n_exact == n:
        out.append(f"All {n} real early-exit runs (model × rule × batch size) reproduced the offline chosen point "
                   "exactly: the same exit loop and the same correctness for every token, so their accuracy equals "
                   "the offline evaluation's.")
    else:
        bad = lat.filter(~pl.col("exact"))
        out.append(f"{n - n_exact} of {n} real runs differ from the offline chosen point "
                   f"(at most {int(bad['exit_mismatches'].max())} exit depths and "
                   f"{int(bad['correct_mismatches'].max())} predictions of {int(bad['n_tokens'].max())} tokens).")
    for bs in sorted(lat["batch_size"].unique().to_list()):
        d = lat.filter(pl.col("batch_size") == bs)
        r, w = d["speedup_ratio"], d["ratio_to_work_ideal"]
        n08 = int((r >= 0.8).sum())
        out.append(f"Batch size {bs}{' (compacted)' if bs > 1 else ''}: realised / ideal speedup (ideal = T / mean "
                   f"exit depth) is {r.min():.2f}–{r.max():.2f} (median {r.median():.2f}); {n08} of {d.height} runs "
                   f"reach ≥ 0.8 × ideal. Against the exact-causal ideal (a position keeps looping while a later "
                   f"scored position of its sequence is undecided) the median ratio is {w.median():.2f}.")
    b = lat.sort("realised_speedup", descending=True).row(0, named=True)
    out.append(f"Largest realised speedup: {b['realised_speedup']:.2f}× ({b['model']}, {b['rule']}, batch "
               f"{b['batch_size']}; mean exit depth {b['mean_exit_depth']:.2f} of {b['n_loops']} loops, ideal "
               f"{b['ideal_speedup']:.2f}×, exact-causal ideal {b['ideal_speedup_work']:.2f}×).")
    skipped: dict[str, list[tuple[str, str]]] = {}
    for model, m in ((lat_metrics or {}).get("models") or {}).items():
        for rule, reason in (m.get("skipped") or {}).items():
            if rule == "q_exit" and "no native halting gate" in reason:
                continue  # expected: Q-exit exists only on natively gated models
            skipped.setdefault(rule, []).append((model, reason))
    for rule, items in skipped.items():
        models = ", ".join(m for m, _ in items)
        out.append(f"Rule {rule} was not run online on {len(items)} model(s) ({models}): {items[0][1]}.")
    return out


def latency_table(lat: pl.DataFrame, meta: pl.DataFrame) -> tuple[pl.DataFrame, list[tuple[str, str, str | None]]]:
    """One row per model × rule with the batch sizes side by side (for the page)."""
    sizes = sorted(lat["batch_size"].unique().to_list())
    big = sizes[-1]
    order = {m: i for i, m in enumerate(meta["model"].to_list())}
    rows = []
    for (model, rule), d in lat.group_by(["model", "rule"], maintain_order=True):
        ref = d.filter(pl.col("batch_size") == big).row(0, named=True) if (d["batch_size"] == big).any() else d.row(0, named=True)
        r = {"model": model, "rule": rule, "depth": ref["mean_exit_depth"], "ideal": ref["ideal_speedup"],
             "ideal_work": ref["ideal_speedup_work"], "accuracy": ref["accuracy_real"], "exact": bool(d["exact"].all())}
        for bs in sizes:
            e = d.filter(pl.col("batch_size") == bs)
            r[f"realised_{bs}"] = e["realised_speedup"][0] if e.height else None
            r[f"ratio_{bs}"] = e["speedup_ratio"][0] if e.height else None
        rows.append(r)
    df = pl.DataFrame(rows).with_columns(_o=pl.col("model").replace_strict(order, default=len(order))).sort("_o", "rule").drop("_o")
    cols = [("model", "model", None), ("rule", "rule", None), ("depth", f"mean exit depth (batch {big})", "2"),
            ("ideal", "ideal T / depth", "x"), ("ideal_work", "exact-causal ideal", "x")]
    for bs in sizes:
        cols += [(f"realised_{bs}", f"realised, batch {bs}", "x"), (f"ratio_{bs}", f"realised / ideal, batch {bs}", "2")]
    cols += [("accuracy", "accuracy real = offline (%)", "pct"), ("exact", "exact (all batches)", None)]
    return df, cols


def generate_table(gen: pl.DataFrame, meta: pl.DataFrame) -> tuple[pl.DataFrame, list[tuple[str, str, str | None]]]:
    """One row per model × rule × KV policy with the batch sizes side by side (for the page)."""
    sizes = sorted(gen["batch_size"].unique().to_list())
    order = {m: i for i, m in enumerate(meta["model"].to_list())}
    rows = []
    for (model, rule, policy), d in gen.group_by(["model", "rule", "policy"], maintain_order=True):
        first = d.sort("batch_size").row(0, named=True)
        r = {"model": model, "rule": rule, "policy": policy, "depth": first["mean_exit_depth"],
             "n_loops": first["n_loops"], "ideal": first["ideal_speedup"], "agreement": first["token_agreement"],
             "loss_gap": first["loss_gap"]}
        for bs in sizes:
            e = d.filter(pl.col("batch_size") == bs)
            for key, col in (("tps", "tokens_per_s"), ("realised", "realised_speedup"), ("ratio", "speedup_ratio")):
                r[f"{key}_{bs}"] = e[col][0] if e.height else None
        rows.append(r)
    df = (pl.DataFrame(rows).with_columns(_o=pl.col("model").replace_strict(order, default=len(order)))
          .sort("_o", "rule", "policy").drop("_o"))
    cols = [("model", "model", None), ("rule", "rule", None), ("policy", "KV policy", None),
            ("depth", f"mean exit depth (batch {sizes[0]})", "2"), ("ideal", "ideal T / depth", "x")]
    for bs in sizes:
        cols += [(f"tps_{bs}", f"tokens/s, batch {bs}", "1"), (f"realised_{bs}", f"realised, batch {bs}", "x"),
                 (f"ratio_{bs}", f"realised / ideal, batch {bs}", "2")]
    cols += [("agreement", "token agreement with full depth (%)", "pct"),
             ("loss_gap", "loss gap of the full-depth continuation (nats/token)", "3")]
    return df, cols


def generate_findings(gen: pl.DataFrame | None, gen_metrics: dict | None) -> list[str]:
    """Sentences about generation-time early exit, generated from generate.parquet (never hand-written numbers)."""
    if gen is None or not gen.height:
        return []
    out = []
    for (policy, bs), d in gen.group_by(["policy", "batch_size"], maintain_order=True):
        r = d["speedup_ratio"]
        out.append(f"KV policy {policy}, batch {bs}: realised / ideal speedup {r.min():.2f}–{r.max():.2f} (median "
                   f"{r.median():.2f}; {int((r >= 0.8).sum())} of {d.height} runs ≥ 0.8), token agreement with "
                   f"full-depth greedy decoding median {100 * d['token_agreement'].median():.1f} %, loss gap of the "
                   f"full-depth continuation median {d['loss_gap'].median():.3f} nats/token.")
    b = gen.sort("realised_speedup", descending=True).row(0, named=True)
    out.append(f"Largest realised generation speedup: {b['realised_speedup']:.2f}× ({b['model']}, {b['rule']}, "
               f"{b['policy']}, batch {b['batch_size']}; mean exit depth {b['mean_exit_depth']:.2f} of {b['n_loops']} "
               f"loops, ideal {b['ideal_speedup']:.2f}×, {b['tokens_per_s']:.1f} tokens/s).")
    for model, m in ((gen_metrics or {}).get("models") or {}).items():
        for what, reason in (m.get("skipped") or {}).items():
            if what == "q_exit" and "no native halting gate" in reason:
                continue
            out.append(f"generate: {what} not run on {model}: {reason}.")
    return out


def _inline(s: str) -> str:
    s = html.escape(s, quote=False)
    s = re.sub(r"`([^`]+)`", r"<code>\1</code>", s)
    return re.sub(r"\*\*([^*]+)\*\*", r"<strong>\1</strong>", s)


def markdown_to_html(md: str, shift: int = 1) -> str:
    """The Markdown subset diagnose's summary.md uses: headings, (nested) bullet lists, pipe tables,
    paragraphs, inline code and bold. Headings are shifted down ``shift`` levels (page has its own h1)."""
    out: list[str] = []
    lines = md.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if not line.strip():
            i += 1
            continue
        mh = re.match(r"^(#{1,6})\s+(.*)$", line)
        if mh:
            lvl = min(6, len(mh.group(1)) + shift)
            out.append(f"<h{lvl}>{_inline(mh.group(2))}</h{lvl}>")
            i += 1
        elif line.lstrip().startswith("|"):
            rows = []
            while i < len(lines) and lines[i].lstrip().startswith("|"):
                cells = [c.strip() for c in lines[i].strip().strip("|").split("|")]
                if not all(re.fullmatch(r":?-{2,}:?", c) for c in cells):
                    rows.append(cells)
                i += 1
            if rows:
                head = "".join(f"<th>{_inline(c)}</th>" for c in rows[0])
                body = "".join("<tr>" + "".join(f"<td>{_inline(c)}</td>" for c in r) + "</tr>" for r in rows[1:])
                out.append(f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>")
        elif re.match(r"^\s*[-*]\s+", line):
            html_list, depth = [], -1
            while i < len(lines) and re.match(r"^\s*[-*]\s+", lines[i]):
                ind = (len(lines[i]) - len(lines[i].lstrip())) // 2
                text = re.sub(r"^\s*[-*]\s+", "", lines[i])
                while depth < ind:
                    html_list.append("<ul>")
                    depth += 1
                while depth > ind:
                    html_list.append("</ul>")
                    depth -= 1
                html_list.append(f"<li>{_inline(text)}</li>")
                i += 1
            html_list += ["</ul>"] * (depth + 1)
            out.append("".join(html_list))
        else:
            para = []
            while (i < len(lines) and lines[i].strip() and not re.match(r"^(#{1,6})\s", lines[i])
                   and not lines[i].lstrip().startswith("|") and not re.match(r"^\s*[-*]\s+", lines[i])):
                para.append(lines[i].strip())
                i += 1
            out.append(f"<p>{_inline(' '.join(para))}</p>")
    return "\n".join(out)


def _table(df: pl.DataFrame, cols: Sequence[tuple[str, str, str | None]]) -> str:
    """HTML table: cols = (column, header, format) with format ``"pct"``, ``"2"`` (decimals) or None."""
    head = "".join(f"<th>{html.escape(h)}</th>" for _, h, _ in cols)
    body = []
    for r in df.iter_rows(named=True):
        cells = []
        for c, _, f in cols:
            v = r.get(c)
            if f == "pct":
                txt = _fmt(100 * _num(v), 2) if v is not None else "—"
            elif f and f.isdigit():
                txt = _fmt(v, int(f))
            elif f == "x":
                txt = _fmt(v, 2, "×")
            elif isinstance(v, bool):
                txt = "yes" if v else "NO"
            else:
                txt = "—" if v is None else str(v)
            cells.append(f"<td>{html.escape(txt)}</td>")
        body.append("<tr>" + "".join(cells) + "</tr>")
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


_CSS = """
body{font-family:-apple-system,Segoe UI,Helvetica,Arial,sans-serif;max-width:1180px;margin:2em auto;padding:0 1em;
color:#222;line-height:1.45}
h1{border-bottom:2px solid #444;padding-bottom:.2em}h2{margin-top:2em;border-bottom:1px solid #bbb}
table{border-collapse:collapse;margin:1em 0;font-size:.9em}th,td{border:1px solid #ccc;padding:.25em .6em;
text-align:left}th{background:#f0f0f0}tr:nth-child(even) td{background:#fafafa}
figure{margin:1.5em 0}figure img{max-width:100%;border:1px solid #ddd}figcaption{font-size:.9em;color:#555}
code{background:#f3f3f3;padding:0 .2em}.missing{color:#8a5a00}td:first-child{white-space:nowrap}
"""

_CAPTIONS = {
    "accuracy_per_loop": "Test accuracy of the shared readout at every loop t, per task and depth-supervision regime "
                         "(SPEC §5).",
    "step_geometry": "Median step norm ‖Δ_t‖₂ (log scale) and consecutive-step cosine cos(Δ_t, Δ_{t−1}) per loop "
                     "with interquartile bands ([TS], SPEC §2).",
    "convergence": "Mean per-token convergence depth (SPEC §2) by difficulty and by token type; tokens that never "
                   "converge count as T + 1 (censored, dotted line).",
    "failure_classes": "Wrong test tokens per failure class (SPEC §7) at every rule's chosen operating point "
                       "(number = total error %; the rest is correct): trajectory = no loop is right, readout early = "
                       "exited before the first right loop, overthinking = exited after a right loop at a wrong one.",
    "cross_regime": "Offline gates fit on one model's frozen trajectories and applied to another's (SPEC §6).",
    "latency": "Real early exit (SPEC §8): realised wall-clock speedup against the ideal T / mean exit depth; the "
               "dashed line is 0.8 × ideal.",
}


def render_html(inp: Inputs, cfg: ReportConfig, figures: dict[str, Path], head: pl.DataFrame, out_dir: Path,
                groups: pl.DataFrame | None = None) -> str:
    """The page: headline tables (per task × regime across seeds, and per model; every figure with its 95 %
    interval), findings (diagnose's summary.md + latency sentences) and every figure, with image paths relative
    to ``out_dir``."""
    x = f"{cfg.x:g}"
    figs = [(f"{n}_text", h.format(x=x), None) for n, h, _ in HEADLINE_FIGURES]
    parts = [f"<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'><title>{html.escape(cfg.title)}</title>"
             f"<style>{_CSS}</style></head><body>", f"<h1>{html.escape(cfg.title)}</h1>",
             f"<p>{inp.meta.height} models; every number below is read from the pipeline's artifacts, as "
             f"<code>estimate [lo, hi]</code> (95 % interval; figures whose intervals overlap are within noise). "
             f"D@{x} = the smallest mean exit depth (loops) whose test accuracy ≥ {x} %, threshold picked on test "
             "labels (oracle-threshold); \"not reached\" = no operating point reaches it, \"not run\" = no such "
             "rule. Best rules are chosen on validation. The same tables, with the machine and versions, are in "
             "<code>summary.md</code> beside this page.</p>"]
    if groups is not None and groups.height:
        parts += ["<h2>Headline per task × regime (across seeds)</h2>",
                  "<p>Mean over training seeds with the Student-t 95 % interval; one seed: its bootstrap "
                  "interval.</p>",
                  _table(groups, [("group", "task × regime", None), ("regime_kind", "regime", None),
                                  ("n_seeds", "seeds", None), ("best_posthoc_rules", "best post-hoc rule(s)", None),
                                  *figs, ("verdict", "verdict", None)])]
    parts += ["<h2>Headline per model</h2>",
              "<p>95 % bootstrap intervals over test sequences.</p>",
              _table(head, [("model", "model", None), ("regime_kind", "regime", None),
                            ("best_posthoc_rule", "best post-hoc rule", None), *figs,
                            ("best_gate_rule", "best refit gate", None), ("verdict", "verdict", None),
                            ("reason", "reason", None)])]
    if inp.latency is not None and inp.latency.height:
        lt, lcols = latency_table(inp.latency, inp.meta)
        parts += ["<h2>Real early exit</h2>",
                  "<p>Wall time of real early exit (loops stop; finished sequences leave the batch) against full "
                  "depth, at each rule's chosen point. Ideal = T / mean exit depth (SPEC §8); exact-causal ideal = "
                  "the best any exit that reproduces the offline evaluation can do under causal attention "
                  "(docs/latency.md).</p>", _table(lt, lcols)]
    if inp.generate is not None and inp.generate.height:
        gt, gcols = generate_table(inp.generate, inp.meta)
        parts += ["<h2>Generation with early exit</h2>",
                  "<p>Greedy decoding token by token: each new token loops until its rule fires; the KV policy says "
                  "what later tokens see at the loops it skipped (share = copy of the exit loop's keys/values, "
                  "Huginn's; recompute = computed, no saving, exact cache; native = the model's own). Realised = "
                  "wall time of full-depth decoding / early exit in the same run; ideal = T / mean exit depth; "
                  "agreement and loss gap against full-depth greedy decoding (docs/generate.md).</p>",
                  _table(gt, gcols)]
    if inp.loop_summary is not None:
        inf = nonfinite_table(inp.loop_summary)
        parts += ["<h2>Non-finite values</h2>", f"<p>{html.escape(_nonfinite_text(inf))}</p>"]
        if inf is not None and inf.height:
            parts.append(_table(inf, [("model", "model", None), ("metric", "metric", None),
                                      ("n_inf", "±∞ left out", None), ("loops", "at loops", None),
                                      ("n_nan", "NaN left out", None)]))
    parts.append("<h2>Findings</h2>")
    lf = latency_findings(inp.latency, inp.latency_metrics)
    if lf:
        parts.append("<h3>Latency</h3><ul>" + "".join(f"<li>{_inline(s)}</li>" for s in lf) + "</ul>")
    gf = generate_findings(inp.generate, inp.generate_metrics)
    if gf:
        parts.append("<h3>Generation</h3><ul>" + "".join(f"<li>{_inline(s)}</li>" for s in gf) + "</ul>")
    if inp.summary:
        parts.append(markdown_to_html(inp.summary, shift=2))
    else:
        parts.append("<p class='missing'>No diagnosis yet (artifacts/diagnose/summary.md): run the diagnose stage.</p>")
    parts.append("<h2>Figures</h2>")
    for name, path in figures.items():
        rel = os.path.relpath(path, out_dir).replace(os.sep, "/")
        cap = _CAPTIONS.get(name) or (f"Pareto fronts of task {name[len('pareto_'):]}: test accuracy vs mean exit depth "
                                      "of every rule's own front; hollow circles are the chosen points; fixed depth "
                                      "black squares, native gate red diamonds, refit gates dashed, oracle star.")
        parts.append(f"<figure><img src='{html.escape(rel, quote=True)}' alt='{html.escape(name, quote=True)}'>"
                     f"<figcaption>{html.escape(cap)}</figcaption></figure>")
    if inp.missing:
        parts.append("<h2>Not shown</h2><ul class='missing'>" + "".join(
            f"<li><code>{html.escape(k)}</code>: {html.escape(v)}</li>" for k, v in sorted(inp.missing.items())) + "</ul>")
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"


def report_metrics(head: pl.DataFrame, inp: Inputs, cfg: ReportConfig, figures: dict[str, Path],
                   groups: pl.DataFrame | None = None) -> dict:
    """``metrics.json`` (``dvc metrics show``): the headline numbers per model (point values under the keys
    of before issue 12, and every figure with its interval under ``intervals``), per task × regime across seeds
    (``groups``: estimate, lo, hi, n_seeds, text) and the latency summary."""
    x = f"{cfg.x:g}"

    def ivs(r: dict, n_seeds: int) -> dict:
        return {n: {"estimate": r[n], "lo": r[f"{n}_lo"], "hi": r[f"{n}_hi"], "n_seeds": n_seeds,
                    "text": r[f"{n}_text"]} for n, _, _ in HEADLINE_FIGURES}

    models = {}
    for r in head.iter_rows(named=True):
        def point(n, r=r):  # D@X not reached: null, as before
            v = r[n]
            return None if v is None or not math.isfinite(v) else v
        models[r["model"]] = {"full_depth_accuracy": point("full_depth_accuracy"), f"d{x}_fixed": point("dx_fixed"),
                              f"d{x}_best_posthoc": point("dx_best_posthoc"),
                              "best_posthoc_rule": r["best_posthoc_rule"], f"d{x}_best_posthoc_rule": r["dx_best_posthoc_rule"],
                              f"d{x}_native": point("dx_native"), f"d{x}_best_gate": point("dx_best_gate"),
                              "oracle_depth": point("oracle_depth"), "verdict": r["verdict"], "n_seeds": 1,
                              "intervals": ivs(r, 1)}
    grp = {}
    for g in (groups.iter_rows(named=True) if groups is not None else []):
        grp[g["group"]] = {"n_seeds": g["n_seeds"], "best_posthoc_rules": g["best_posthoc_rules"],
                           "verdict": g["verdict"], "intervals": ivs(g, g["n_seeds"])}
    lat = {}
    if inp.latency is not None and inp.latency.height:
        for bs in sorted(inp.latency["batch_size"].unique().to_list()):
            d = inp.latency.filter(pl.col("batch_size") == bs)
            lat[f"bs{bs}"] = {"median_speedup_ratio": float(d["speedup_ratio"].median()),
                              "max_realised_speedup": float(d["realised_speedup"].max()),
                              "median_ratio_to_exact_causal_ideal": float(d["ratio_to_work_ideal"].median())}
        lat["all_exact"] = bool(inp.latency["exact"].all())
    gen = {}
    if inp.generate is not None and inp.generate.height:
        for (policy, bs), d in inp.generate.group_by(["policy", "batch_size"], maintain_order=True):
            gen[f"{policy}_bs{bs}"] = {"median_speedup_ratio": float(d["speedup_ratio"].median()),
                                       "max_realised_speedup": float(d["realised_speedup"].max()),
                                       "median_token_agreement": float(d["token_agreement"].median()),
                                       "median_loss_gap": float(d["loss_gap"].median())}
    return {"x": cfg.x, "models": models, "groups": grp, "latency": lat, "generate": gen, "n_figures": len(figures),
            "missing_inputs": sorted(inp.missing)}


def build_report(models: Sequence[str], root: Path | str, out_dir: Path | str, cfg: ReportConfig,
                 meta: dict | None = None) -> dict:
    """The ``report`` stage: read the artifacts, draw the figures, write index.html, summary.md and metrics.json.

    ``summary.md`` and metrics.json record the machine and the date of the run (:func:`looptrace.project.machine`;
    ``SOURCE_DATE_EPOCH`` fixes the date), so those two bytes differ between runs; index.html and the figures
    depend on the artifacts only.

    Everything is written into a temporary sibling directory that replaces ``out_dir`` at the end.

    Args:
        models: model names.
        root: the artifacts root (``artifacts``).
        out_dir: ``artifacts/report``.
        cfg: the ``report`` section.
        meta: extra metrics.json entries (versions, params).

    Returns:
        The metrics dict as written (NaN = unreachable/absent written as None).
    """
    from looptrace.io.artifacts import atomic_dir
    from looptrace.io.artifacts import jsonable as _jsonable
    from looptrace.project import machine, versions

    out_dir = Path(out_dir)
    inp = load_inputs(models, root, cfg)
    head = headline(inp, cfg)
    groups = group_headline(head, inp)
    mach = machine()
    with atomic_dir(out_dir) as tmp:
        figs = make_figures(inp, cfg, tmp / "figures")
        (tmp / "index.html").write_text(render_html(inp, cfg, figs, head, tmp, groups))
        (tmp / "summary.md").write_text(run_summary_markdown(head, groups, inp, cfg, mach,
                                                             (meta or {}).get("versions") or versions(), inp.claims))
        metrics = _jsonable({**report_metrics(head, inp, cfg, figs, groups), "machine": mach,
                             **(meta or {})})  # NaN -> null
        (tmp / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    return metrics
