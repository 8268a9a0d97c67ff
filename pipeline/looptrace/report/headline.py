"""The report's numbers: the headline tables (per model and per task × regime across seeds, every figure with its
interval), the non-finite, latency and generation tables, and ``metrics.json`` (``report_metrics``)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import cast

import polars as pl

from looptrace.diagnose.stats import dx_best, with_val_columns
from looptrace.diagnose.verdicts import native_filter, native_rule
from looptrace.estimates import Interval, across_seeds, from_row
from looptrace.project import split_seed
from looptrace.report.inputs import Inputs, ReportConfig
from looptrace.rules.scoring import best_chosen


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
        # the regime's own exit, as diagnose's verdict reads it (not the best of every native rule)
        own = native_rule(m["regime_kind"], dx.filter(pl.col("kind") == "native")["rule"].to_list())
        figs["dx_native"], _ = dx_best(native_filter(dx, own), ["native"])
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
               "n_loops": m.get("n_loops"),
               "regime_kind": m["regime_kind"], "best_posthoc_rule": best["rule"] if best else None,
               "dx_best_posthoc_rule": dx_rule, "best_gate_rule": gate["rule"] if gate else None,
               "verdict": verdict, "reason": reason, "n_boot": ref.n_boot if ref else 0,
               "n_sequences": ref.n_sequences if ref else 0}
        for name, _, kind in HEADLINE_FIGURES:
            row.update(_figure_cols(name, figs.get(name), kind))
        rows.append(row)
    schema = {"model": pl.String, "group": pl.String, "seed": pl.Int64, "task": pl.String, "regime": pl.String,
              "n_loops": pl.Int64, "regime_kind": pl.String, "best_posthoc_rule": pl.String, "dx_best_posthoc_rule": pl.String,
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
    return None if math.isnan(v) else Interval(v, _num(row.get(f"{name}_lo")), _num(row.get(f"{name}_hi")),
                                               n_sequences=int(_num(row.get("n_sequences")) or 0)
                                               if math.isfinite(_num(row.get("n_sequences"))) else 0)


def figure_bounds(kind: str, n_loops: float) -> tuple[float, float] | None:
    """The range of a headline figure of ``kind``: accuracy [0, 1] (a fraction), a depth or D@X [1, T]; None
    when T is unknown (the plain t-interval over seeds)."""
    if kind == "pct":
        return (0.0, 1.0)
    return (1.0, float(n_loops)) if math.isfinite(n_loops) and n_loops > 1 else None


def group_headline(head: pl.DataFrame, inp: Inputs, level: float = 0.95) -> pl.DataFrame:
    """One row per task × regime (the models that differ only by training seed): every headline figure as the
    across-seed mean with its Student-t 95 % interval on the logit scale of the figure's range (accuracy
    [0, 1], depths [1, T]: :func:`looptrace.estimates.across_seeds`, :func:`figure_bounds`; one seed: that
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
               "verdict": None, "reason": None, "seed_verdicts": None, "seeds_needed": None}
        T = _num(sub[0].get("n_loops"))
        for name, _, kind in HEADLINE_FIGURES:
            iv = across_seeds([i for i in (_row_interval(r, name) for r in sub) if i is not None], level,
                              figure_bounds(kind, T))
            row.update(_figure_cols(name, iv if iv.present else None, kind))
        if inp.verdict_groups is not None and "group" in inp.verdict_groups.columns:
            v = inp.verdict_groups.filter(pl.col("group") == g)
            if v.height:
                row.update({k: v[k][0] for k in ("verdict", "reason", "seed_verdicts", "seeds_needed")
                            if k in v.columns})
        row["verdict_text"] = verdict_text(row)
        rows.append(row)
    schema = {"group": pl.String, "task": pl.String, "regime": pl.String, "regime_kind": pl.String,
              "n_seeds": pl.Int64, "best_posthoc_rules": pl.String, "verdict": pl.String, "reason": pl.String,
              "seed_verdicts": pl.String, "seeds_needed": pl.Int64, "verdict_text": pl.String}
    for name, _, _ in HEADLINE_FIGURES:
        schema.update({name: pl.Float64, f"{name}_lo": pl.Float64, f"{name}_hi": pl.Float64, f"{name}_text": pl.String})
    return pl.DataFrame(rows, schema=schema)


def verdict_text(g: dict) -> str | None:
    """A group's verdict cell: the verdict, and when it is ``undecided`` or the seeds disagree the per-seed
    verdicts and the seeds that would decide (``undecided — per seed: 1 × …, 2 × …; ~7 seeds would decide``)."""
    v = g.get("verdict")
    if not v:
        return None
    per = g.get("seed_verdicts")
    if v != "undecided" and (not per or per.startswith(f"{g.get('n_seeds')} × {v}")):
        return v
    out = f"{v} — per seed: {per}" if per else v
    if v == "undecided":
        need = g.get("seeds_needed")
        n = g.get("n_seeds") or 0
        out += (f"; ~{need} seeds would decide" if need is not None else
                "; more seeds would show the spread" if n <= 1 else "; not decidable at the observed mean")
    return out


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


def report_metrics(head: pl.DataFrame, inp: Inputs, cfg: ReportConfig, figures: dict[str, Path],
                   groups: pl.DataFrame | None = None) -> dict:
    """``metrics.json`` (``dvc metrics show``): the headline numbers per model (point values under the keys
    of older versions, and every figure with its interval under ``intervals``), per task × regime across seeds
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
    lat: dict[str, dict[str, float] | bool] = {}
    if inp.latency is not None and inp.latency.height:
        for bs in sorted(inp.latency["batch_size"].unique().to_list()):
            d = inp.latency.filter(pl.col("batch_size") == bs)
            lat[f"bs{bs}"] = {"median_speedup_ratio": float(cast(float, d["speedup_ratio"].median())),
                              "max_realised_speedup": float(cast(float, d["realised_speedup"].max())),
                              "median_ratio_to_exact_causal_ideal":
                                  float(cast(float, d["ratio_to_work_ideal"].median()))}
        lat["all_exact"] = bool(inp.latency["exact"].all())
    gen = {}
    if inp.generate is not None and inp.generate.height:
        for (policy, bs), d in inp.generate.group_by(["policy", "batch_size"], maintain_order=True):
            gen[f"{policy}_bs{bs}"] = {"median_speedup_ratio": float(cast(float, d["speedup_ratio"].median())),
                                       "max_realised_speedup": float(cast(float, d["realised_speedup"].max())),
                                       "median_token_agreement": float(cast(float, d["token_agreement"].median())),
                                       "median_loss_gap": float(cast(float, d["loss_gap"].median()))}
    return {"x": cfg.x, "models": models, "groups": grp, "latency": lat, "generate": gen, "n_figures": len(figures),
            "missing_inputs": sorted(inp.missing)}
