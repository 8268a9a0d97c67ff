"""The report's numbers for DVC's own run comparison: data series for ``dvc plots show/diff`` (declared as top-level
``plots`` in dvc.yaml with a template and ``x``/``y``) and the headline table for ``dvc metrics show`` /
``dvc exp show``.

Files (``artifacts/report/plots/`` and ``artifacts/report/headline.json``), each a pure function of the artifacts:

- ``accuracy_per_loop.json``: panel (task), curve (regime), loop, accuracy (%, mean over seeds), n_seeds.
- ``pareto.json``: panel (task · regime), curve (rule — its role), mean_depth (loops), accuracy (%): the mean
  front over seeds (:func:`looptrace.report.fig_pareto.mean_front`) of the curves the Pareto figures colour
  (:func:`looptrace.report.fig_pareto.pareto_highlights`), so two runs' fronts overlay per rule.
- ``step_geometry.json``: panel (task), curve (regime), loop, step_norm (geometric mean over seeds of the
  per-seed median), step_cos (mean over seeds of the per-seed median).
- ``headline.json``: per task × regime the headline figures of :data:`looptrace.report.headline.HEADLINE_FIGURES`
  (estimate, lo, hi; accuracies in %, depths in loops; null = not run / not reached), n_seeds and the verdict.

The template (``pipeline/looptrace/report/dvc_templates/panels.json``) draws one panel per ``panel``, one colour
per ``curve`` and one dash per revision, so ``dvc plots diff A B`` overlays the two runs curve by curve.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import polars as pl

from looptrace.report.fig_pareto import mean_front, pareto_highlights
from looptrace.report.headline import HEADLINE_FIGURES
from looptrace.report.inputs import Inputs
from looptrace.report.plotting import groups_of, seed_band, tasks_of

#: Where the data series go, relative to the report's directory.
PLOTS_DIR = "plots"
#: The headline metrics file (``dvc exp show``), relative to the report's directory.
HEADLINE_FILE = "headline.json"

_SERIES_SCHEMA = {"panel": pl.String, "curve": pl.String}


def _frame(rows: list[dict], cols: dict) -> pl.DataFrame:
    return pl.DataFrame(rows, schema={**_SERIES_SCHEMA, **cols})


def accuracy_series(inp: Inputs) -> pl.DataFrame:
    """Per-loop test accuracy (%) of every task × regime, the mean over its seeds."""
    rows: list[dict] = []
    if inp.acc_per_loop is not None:
        for task in tasks_of(inp.meta):
            for regime, models in groups_of(inp.meta, task):
                T = max(int(m["n_loops"]) for m in models)
                vals = np.full((len(models), T), np.nan)
                for s, m in enumerate(models):
                    d = inp.acc_per_loop.filter(pl.col("model") == m["model"])
                    vals[s, d["loop"].to_numpy() - 1] = 100 * d["accuracy"].to_numpy()
                mean = seed_band(vals)[0]
                rows += [{"panel": task, "curve": regime, "loop": t + 1, "accuracy": _r(mean[t]),
                          "n_seeds": len(models)} for t in range(T) if math.isfinite(mean[t])]
    return _frame(rows, {"loop": pl.Int64, "accuracy": pl.Float64, "n_seeds": pl.Int64})


def pareto_series(inp: Inputs) -> pl.DataFrame:
    """The highlighted rules' mean fronts over seeds, per task × regime (accuracy in %)."""
    rows: list[dict] = []
    if inp.pareto is not None:
        for task in tasks_of(inp.meta):
            for regime, models in groups_of(inp.meta, task):
                ms = [m["model"] for m in models]
                p = inp.pareto.filter(pl.col("model").is_in(ms))
                kinds = dict(zip(p["rule"].to_list(), p["kind"].to_list(), strict=True))
                ch = inp.chosen.filter(pl.col("model").is_in(ms)) if inp.chosen is not None else None
                for rule, (role, _) in pareto_highlights(ch, kinds).items():
                    x, y = mean_front(p.filter(pl.col("rule") == rule), ms)
                    rows += [{"panel": f"{task} · {regime}", "curve": f"{rule} — {role}", "mean_depth": _r(a),
                              "accuracy": _r(b)} for a, b in zip(x, y, strict=True)]
    return _frame(rows, {"mean_depth": pl.Float64, "accuracy": pl.Float64})


def step_series(inp: Inputs) -> pl.DataFrame:
    """Per-loop step norm (geometric mean over seeds of the per-seed median) and step cosine (mean over seeds)."""
    rows: list[dict] = []
    if inp.loop_summary is not None:
        ls = inp.loop_summary.filter((pl.col("group_by") == "all") & (pl.col("count") > 0))
        for task in tasks_of(inp.meta):
            for regime, models in groups_of(inp.meta, task):
                T = max(int(m["n_loops"]) for m in models)
                out = {}
                for metric in ("step_norm", "step_cos"):
                    vals = np.full((len(models), T), np.nan)
                    for s, m in enumerate(models):
                        d = ls.filter((pl.col("model") == m["model"]) & (pl.col("metric") == metric))
                        vals[s, d["loop"].to_numpy() - 1] = d["median"].to_numpy()
                    out[metric] = seed_band(vals, log=metric == "step_norm")[0]
                rows += [{"panel": task, "curve": regime, "loop": t + 1, "step_norm": _r(out["step_norm"][t]),
                          "step_cos": _r(out["step_cos"][t])} for t in range(T)
                         if math.isfinite(out["step_norm"][t]) or math.isfinite(out["step_cos"][t])]
    return _frame(rows, {"loop": pl.Int64, "step_norm": pl.Float64, "step_cos": pl.Float64})


def _r(v: float) -> float | None:
    """Rounded to 6 significant digits (stable bytes); NaN/inf -> None (JSON null)."""
    v = float(v)
    return None if not math.isfinite(v) else float(f"{v:.6g}")


def headline_metrics(groups: pl.DataFrame) -> dict:
    """``headline.json``: {task × regime: {figure: value, figure_lo, figure_hi, ..., n_seeds, verdict}}, accuracies
    in %, depths in loops, a D@X not reached or a figure not run as null."""
    out: dict[str, dict] = {}
    for g in groups.iter_rows(named=True):
        row: dict = {"n_seeds": g["n_seeds"]}
        for name, _, kind in HEADLINE_FIGURES:
            scale = 100.0 if kind == "pct" else 1.0
            for suffix in ("", "_lo", "_hi"):
                v = g[f"{name}{suffix}"]
                row[f"{name}{suffix}"] = None if v is None else _r(scale * v)
        row["verdict"] = g.get("verdict")
        out[g["group"]] = row
    return out


def write_dvc_plots(inp: Inputs, groups: pl.DataFrame, out_dir: Path) -> dict[str, Path]:
    """Write the data series and ``headline.json`` into ``out_dir`` (the report's directory).

    Returns:
        name -> path of every file written.
    """
    import json

    d = out_dir / PLOTS_DIR
    d.mkdir(parents=True, exist_ok=True)
    files = {"accuracy_per_loop": (accuracy_series(inp), d / "accuracy_per_loop.json"),
             "pareto": (pareto_series(inp), d / "pareto.json"),
             "step_geometry": (step_series(inp), d / "step_geometry.json")}
    for df, path in files.values():  # JSON (numbers stay numbers for Vega-Lite; CSV cells would be strings)
        path.write_text(json.dumps(df.to_dicts(), indent=1, ensure_ascii=False) + "\n")
    h = out_dir / HEADLINE_FILE
    h.write_text(json.dumps(headline_metrics(groups), indent=2, sort_keys=True) + "\n")
    return {**{k: p for k, (_, p) in files.items()}, "headline": h}
