"""The halting methods side by side at matched compute, in [RT]'s form (``diagnose.halting_table``).

One row per task × regime × method, over the training seeds of the group:

- ``fixed k`` (k = 1..T): every token exits at loop k (the ``fixed`` rule's test points);
- ``native``: the regime's own halting head, by the exit rule it was trained for, at the threshold its method
  defines (:data:`looptrace.rules.native_halting.NATIVE_EXITS`: ``recurtrace`` → ``gate_step`` at σ(g) ≥ 0.5,
  ``act`` → ``act_exit`` at ACT's N, Σ σ(g) ≥ 1 − ε with the ε the model trained with; ``joint`` = PonderNet →
  ``q_exit`` at its val-chosen q, q being a user setting of Ouro's forward); absent for regimes without a head;
- ``native, γ calibrated on val``: the same head at its val-chosen point on the quantile grid
  (:data:`~looptrace.rules.native_halting.NATIVE_CALIBRATED`: ``gate_step_calibrated``, ``act_exit_calibrated``),
  when the readouts ran it — how much a tuned threshold changes the method's own exit;
- ``best post-hoc``: the post-hoc readout chosen on val (:func:`~looptrace.rules.scoring.best_chosen`, kind
  ``posthoc``; CALM's rule among them when the readouts ran it);
- ``CALM``: CALM's own rule (``calm``: softmax response with its Learn-then-Test threshold, Schuster et al. 2022)
  at its chosen point, when the readouts ran it — the comparable point [RT] reports for CALM;
- ``best refit gate``: the refit gate chosen on val (when the gates stage ran).

Figures (SPEC §4 "Headlines"): test accuracy and mean loops at the val-chosen point, each a 95 % interval —
the bootstrap over test sequences for one seed, the Student-t interval over seeds for several
(:func:`looptrace.estimates.across_seeds`). **Matched compute** ([RT]'s "−2.2 points against the best fixed depth
at matched compute"): the accuracy a method beats or loses against fixed depth run at the same mean loops d, on the
same model — fixed(d) = (1 − f)·acc_⌊d⌋ + f·acc_⌈d⌉, f = d − ⌊d⌋ (running a share f of the tokens one loop deeper
costs exactly d loops on average); Δ = accuracy − fixed(d), per seed, then over seeds. **Collapse to one loop**: a
method collapses when its mean loops over seeds is ≤ 1 + ``diagnose.collapse_tol`` ([RT] reports ACT and PonderNet
"collapse to one loop"); ``n_collapsed`` counts the seeds that do.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import polars as pl

from looptrace.config import MissingInputError
from looptrace.estimates import Interval, across_seeds, from_row
from looptrace.io.artifacts import read_json, read_parquet
from looptrace.project import split_seed
from looptrace.rules.calm import CALM
from looptrace.rules.native_halting import NATIVE_CALIBRATED, NATIVE_EXITS, REGIME_SOURCES
from looptrace.rules.scoring import best_chosen

#: Output columns (``halting_table.parquet``).
COLUMNS = ("task", "regime", "regime_kind", "source", "method", "rules", "n_seeds", "accuracy", "accuracy_lo",
           "accuracy_hi", "loops", "loops_lo", "loops_hi", "delta_matched", "delta_matched_lo", "delta_matched_hi",
           "collapsed", "n_collapsed")
#: The method name of a native head read at a val-calibrated threshold (module docstring).
CALIBRATED = "native, γ calibrated on val"


def matched_fixed_accuracy(fixed_acc: np.ndarray, depth: float) -> float:
    """Fixed-depth accuracy at mean loops ``depth`` (module docstring): [T] accuracies at k = 1..T, d clipped to
    [1, T], linear between ⌊d⌋ and ⌈d⌉."""
    T = fixed_acc.size
    d = min(max(float(depth), 1.0), float(T))
    k = int(math.floor(d))
    if k >= T:
        return float(fixed_acc[T - 1])
    f = d - k
    return float((1.0 - f) * fixed_acc[k - 1] + f * fixed_acc[k])


def _model_rows(model: str, readouts_root: Path, gates_root: Path | None) -> tuple[dict, list[dict]]:
    rdir = Path(readouts_root) / model
    for f in ("chosen.parquet", "operating_points.parquet", "metrics.json"):
        if not (rdir / f).is_file():
            raise MissingInputError(f"{rdir / f} not found; run the readouts stage for {model} first")
    meta = read_json(rdir / "metrics.json")
    chosen = read_parquet(rdir / "chosen.parquet")
    ops = read_parquet(rdir / "operating_points.parquet")
    fixed = ops.filter((pl.col("rule") == "fixed") & (pl.col("split") == "test")).sort("threshold")
    if fixed.height == 0:
        raise MissingInputError(f"{rdir / 'operating_points.parquet'} has no fixed-depth points; the halting table "
                                "compares against fixed depth: keep `fixed` in readouts.rules")
    fixed_acc = fixed["accuracy"].to_numpy().astype(np.float64)
    kind = meta.get("regime_kind") or meta.get("regime") or "?"
    rows = []
    for r in fixed.iter_rows(named=True):
        k = int(r["threshold"])
        acc = from_row(r, "accuracy")
        rows.append({"method": f"fixed {k}", "order": k, "rule": "fixed", "accuracy": acc,
                     "loops": Interval(float(k), float(k), float(k)), "delta": 0.0})
    picks: list[tuple[str, dict | None]] = []
    native = NATIVE_EXITS.get(kind)
    if native is not None:
        own = chosen.filter(pl.col("rule") == native)
        picks.append(("native", own.row(0, named=True) if own.height else None))
        tuned = NATIVE_CALIBRATED.get(kind)
        if tuned is not None and tuned != native:
            cal = chosen.filter(pl.col("rule") == tuned)
            picks.append((CALIBRATED, cal.row(0, named=True) if cal.height else None))
    picks.append(("best post-hoc", best_chosen(chosen, ["posthoc"])))
    calm = chosen.filter(pl.col("rule") == CALM.name)
    if calm.height:
        picks.append(("CALM", calm.row(0, named=True)))
    gdir = None if gates_root is None else Path(gates_root) / model
    if gdir is not None and (gdir / "chosen.parquet").is_file():
        picks.append(("best refit gate", best_chosen(read_parquet(gdir / "chosen.parquet"))))
    for i, (method, pick) in enumerate(picks):
        if pick is None:
            continue
        acc, loops = from_row(pick, "test_accuracy"), from_row(pick, "test_depth")
        rows.append({"method": method, "order": 100 + i, "rule": pick["rule"], "accuracy": acc, "loops": loops,
                     "delta": acc.estimate - matched_fixed_accuracy(fixed_acc, loops.estimate)})
    return {"task": meta.get("task"), "regime": meta.get("regime"), "regime_kind": kind,
            "n_loops": meta.get("n_loops")}, rows


def halting_table(models: Sequence[str], readouts_root: Path | str, gates_root: Path | str | None,
                  collapse_tol: float = 0.1, level: float = 0.95) -> pl.DataFrame:
    """The comparison table (module docstring) over ``models`` (``<task>-<regime>[-s<seed>]``).

    Args:
        models: model names; seeds of one task × regime are pooled.
        readouts_root: ``artifacts/readouts`` (chosen, operating_points, metrics.json per model).
        gates_root: ``artifacts/gates`` (optional ``chosen.parquet`` per model) or None.
        collapse_tol: loops above 1 still counted as "one loop".
        level: interval level of the across-seed intervals.

    Returns:
        DataFrame with :data:`COLUMNS` (accuracy as a fraction, loops in loops, Δ in accuracy fraction).
    """
    groups: dict[str, tuple[dict, list[list[dict]]]] = {}
    for m in models:
        info, rows = _model_rows(m, Path(readouts_root), None if gates_root is None else Path(gates_root))
        g = split_seed(m)[0]
        groups.setdefault(g, (info, []))[1].append(rows)
    out = []
    for info, per_seed in groups.values():
        methods: dict[str, list[dict]] = {}
        for rows in per_seed:
            for r in rows:
                methods.setdefault(r["method"], []).append(r)
        for method, rs in sorted(methods.items(), key=lambda kv: kv[1][0]["order"]):
            # within the figures' ranges: accuracy in [0, 1], loops in [1, T]
            T = info.get("n_loops")
            acc = across_seeds([r["accuracy"] for r in rs], level, bounds=(0.0, 1.0))
            loops = across_seeds([r["loops"] for r in rs], level,
                                 bounds=(1.0, float(T)) if T is not None and float(T) > 1 else None)
            delta = across_seeds([Interval(r["delta"], method="none") for r in rs], level)
            out.append({**{k: v for k, v in info.items() if k != "n_loops"}, "source": REGIME_SOURCES.get(info["regime_kind"], "—"), "method": method,
                        "rules": ",".join(dict.fromkeys(r["rule"] for r in rs)), "n_seeds": len(rs),
                        "accuracy": acc.estimate, "accuracy_lo": acc.lo, "accuracy_hi": acc.hi,
                        "loops": loops.estimate, "loops_lo": loops.lo, "loops_hi": loops.hi,
                        "delta_matched": delta.estimate, "delta_matched_lo": delta.lo, "delta_matched_hi": delta.hi,
                        # (fixed k is one loop or not by definition: no collapse to speak of)
                        "collapsed": None if rs[0]["rule"] == "fixed" else bool(loops.estimate <= 1.0 + collapse_tol),
                        "n_collapsed": None if rs[0]["rule"] == "fixed" else
                        sum(r["loops"].estimate <= 1.0 + collapse_tol for r in rs)})
    schema = {c: pl.Float64 for c in COLUMNS if c not in ("task", "regime", "regime_kind", "source", "method", "rules",
                                                            "n_seeds", "collapsed", "n_collapsed")}
    return pl.DataFrame(out, schema={"task": pl.String, "regime": pl.String, "regime_kind": pl.String,
                                     "source": pl.String, "method": pl.String, "rules": pl.String,
                                     "n_seeds": pl.Int64, **schema, "collapsed": pl.Boolean,
                                     "n_collapsed": pl.Int64}).select(COLUMNS)


def _ci(est: float, lo: float, hi: float, scale: float = 1.0, nd: int = 2) -> str:
    if est is None or math.isnan(est):
        return "—"
    s = f"{est * scale:.{nd}f}"
    return s if lo is None or math.isnan(lo) else f"{s} [{lo * scale:.{nd}f}, {hi * scale:.{nd}f}]"


def halting_table_markdown(table: pl.DataFrame, collapse_tol: float) -> str:
    """The table as a summary.md section (accuracy and Δ in points, 95 % intervals)."""
    lines = ["## Halting methods at matched compute ([RT]'s form)", "",
             "Per task × regime and method: test accuracy and mean loops at the val-chosen point (95 % intervals: "
             "bootstrap over test sequences for one seed, Student-t over seeds), and Δ = accuracy − fixed depth at the "
             "same mean loops on the same model (points). *native* is the head at its method's own threshold "
             "(RecurTrace σ(g) ≥ 0.5, ACT Σ σ(g) ≥ 1 − ε with its training ε; PonderNet's q chosen on val); "
             f"*{CALIBRATED}* the same head at a val-chosen γ. A method *collapses to one loop* when its mean loops ≤ "
             f"{1 + collapse_tol:g} (collapsed seeds / seeds).", "",
             "| task | regime (source) | method | rule(s) | accuracy % | mean loops | Δ vs fixed at matched loops | "
             "collapses |", "|---|---|---|---|---|---|---|---|"]
    for r in table.iter_rows(named=True):
        lines.append(f"| {r['task']} | {r['regime']} ({r['source']}) | {r['method']} | {r['rules']} | "
                     f"{_ci(r['accuracy'], r['accuracy_lo'], r['accuracy_hi'], 100, 1)} | "
                     f"{_ci(r['loops'], r['loops_lo'], r['loops_hi'])} | "
                     f"{_ci(r['delta_matched'], r['delta_matched_lo'], r['delta_matched_hi'], 100, 1)} | "
                     + ("— |" if r["collapsed"] is None else
                        f"{'yes' if r['collapsed'] else 'no'} ({r['n_collapsed']}/{r['n_seeds']}) |"))
    return "\n".join(lines) + "\n"
