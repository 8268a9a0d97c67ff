"""The report's halting sections: diagnose's matched-compute table of the halting methods
(``halting_table.parquet``, when ``diagnose.halting_table`` wrote it) with its intervals and, per method, whether it
collapses to one loop; and the counterfactual faithfulness of every halting signal (``faithfulness.parquet``, SPEC
§7a) per task × regime × rule over seeds. Every figure is read from diagnose's artifacts; the words of "collapse"
follow the intervals (:func:`collapse_text`)."""

from __future__ import annotations

import math

import polars as pl

from looptrace.diagnose.config import DiagnoseConfig
from looptrace.estimates import Interval, across_seeds, fmt_ci


def collapse_text(row: dict, collapse_tol: float) -> str:
    """Whether a method collapses to one loop (mean loops ≤ 1 + tol), in words no stronger than its interval:
    ``yes`` when the whole mean-loops interval is ≤ 1 + tol, ``no`` when all of it is above, else ``undecided``;
    with the seeds whose own mean loops is ≤ 1 + tol (``n_collapsed``/``n_seeds``). Fixed depths: "—"."""
    if row.get("collapsed") is None:
        return "—"
    cut = 1.0 + collapse_tol
    lo, hi, est = _f(row.get("loops_lo")), _f(row.get("loops_hi")), float(row["loops"])
    has = math.isfinite(lo) and math.isfinite(hi)
    if has:
        word = "yes" if hi <= cut else "no" if lo > cut else "undecided"
    else:
        word = "undecided" if est <= cut else "no"  # no interval: a mean ≤ cut alone never says "yes"
    return f"{word} ({row['n_collapsed']}/{row['n_seeds']} seeds ≤ {cut:g})"


def halting_rows(table: pl.DataFrame, collapse_tol: float) -> pl.DataFrame:
    """The table with text columns: ``accuracy_text`` (%), ``loops_text``, ``delta_text`` (points), ``collapse_text``
    and ``regime_text`` (regime with its source)."""
    rows = []
    for r in table.iter_rows(named=True):
        rows.append({**r, "regime_text": f"{r['regime']} ({r['source']})",
                     "accuracy_text": fmt_ci(r["accuracy"], _f(r["accuracy_lo"]), _f(r["accuracy_hi"]), 1, 100.0),
                     "loops_text": fmt_ci(r["loops"], _f(r["loops_lo"]), _f(r["loops_hi"]), 2),
                     "delta_text": fmt_ci(r["delta_matched"], _f(r["delta_matched_lo"]), _f(r["delta_matched_hi"]),
                                          1, 100.0),
                     "collapse_text": collapse_text(r, collapse_tol)})
    return pl.DataFrame(rows, infer_schema_length=None)


def _f(v) -> float:
    return math.nan if v is None else float(v)


#: Columns of the halting table on the page and in summary.md: (column, header).
HALTING_COLUMNS = (("task", "task"), ("regime_text", "regime (source)"), ("method", "method"), ("rules", "rule(s)"),
                   ("n_seeds", "seeds"), ("accuracy_text", "test accuracy %"), ("loops_text", "mean loops"),
                   ("delta_text", "Δ vs fixed at matched loops (points)"), ("collapse_text", "collapses to one loop"))


def faithfulness_groups(faith: pl.DataFrame, level: float = 0.95) -> pl.DataFrame:
    """Faithfulness per task × regime × rule over its seeds: verdicts per seed, saving vs random and vs the reverse
    ranking (nats per test token; across seeds the Student-t interval, one seed its bootstrap interval), the largest
    p over seeds and the mean exit depth.

    Returns:
        DataFrame task, regime, source, rule, kind, n_seeds, verdicts, saving(_lo/_hi), saving_vs_reverse(_lo/_hi),
        p_max, mean_depth, and ``*_text`` columns.
    """
    out = []
    keys = ["task", "regime", "source", "rule"]
    for key, sub in faith.group_by(keys, maintain_order=True):
        rs = list(sub.iter_rows(named=True))
        counts: dict[str, int] = {}
        for r in rs:
            counts[r["verdict"]] = counts.get(r["verdict"], 0) + 1
        sv = across_seeds([Interval(_f(r["saving"]), _f(r["saving_lo"]), _f(r["saving_hi"])) for r in rs], level)
        rv = across_seeds([Interval(_f(r["saving_vs_reverse"]), _f(r["saving_vs_reverse_lo"]),
                                    _f(r["saving_vs_reverse_hi"])) for r in rs], level)
        ps = [_f(r["pvalue"]) for r in rs if math.isfinite(_f(r["pvalue"]))]
        out.append({**dict(zip(keys, key, strict=True)), "kind": rs[0].get("kind"), "n_seeds": len(rs),
                    "verdicts": ", ".join(f"{v} × {n}" if len(rs) > 1 else v for v, n in counts.items()),
                    "saving": sv.estimate, "saving_lo": sv.lo, "saving_hi": sv.hi,
                    "saving_vs_reverse": rv.estimate, "saving_vs_reverse_lo": rv.lo,
                    "saving_vs_reverse_hi": rv.hi, "p_max": max(ps) if ps else math.nan,
                    "mean_depth": sum(_f(r["mean_depth"]) for r in rs) / len(rs),
                    "saving_text": fmt_ci(sv.estimate, sv.lo, sv.hi, 4),
                    "reverse_text": fmt_ci(rv.estimate, rv.lo, rv.hi, 4),
                    "p_text": "—" if not ps else f"{max(ps):.2g}"})
        out[-1]["depth_text"] = f"{out[-1]['mean_depth']:.2f}"
    return pl.DataFrame(out, infer_schema_length=None)


#: Columns of the faithfulness table: (column, header).
FAITH_COLUMNS = (("task", "task"), ("regime", "regime"), ("rule", "rule / gate / head"), ("kind", "kind"),
                 ("verdicts", "verdict (per seed)"), ("depth_text", "mean exit depth"),
                 ("saving_text", "saving vs random (nats/token)"), ("reverse_text", "saving vs reverse"),
                 ("p_text", "p (largest over seeds)"))


def collapse_tol_of(value: float | None) -> float:
    """The diagnose run's ``collapse_tol`` (its metrics.json omits the default)."""
    return DiagnoseConfig().collapse_tol if value is None else float(value)


def halting_intro(collapse_tol: float) -> str:
    return ("Per task × regime and method (fixed depths, the regime's own native exit at its method's threshold — "
            "RecurTrace's head at σ(g) ≥ 0.5, ACT's N at Σ σ(g) ≥ 1 − ε with its training ε, PonderNet's q chosen on "
            "val — the same head at a val-calibrated γ where it was run, the best post-hoc rule and "
            "the best refit gate, both chosen on val), test accuracy and mean loops at the val-chosen point with "
            "95 % intervals (bootstrap over test sequences for one seed, Student-t over seeds), Δ = accuracy − "
            "fixed depth at the same mean loops on the same model ([RT]'s matched compute). A method collapses to "
            f"one loop when its mean loops ≤ {1 + collapse_tol:g}: \"yes\" only when the whole interval is, \"no\" "
            "when all of it is above, else undecided; in brackets the seeds whose own mean is (docs/SPEC.md §7).")


FAITH_INTRO = ("SEWN's counterfactual test adapted to depth (docs/SPEC.md §7a): at each rule's chosen point, the loss "
               "increase ℓ_exit − ℓ_T of the tokens it exits against the same exit depths given to random tokens. "
               "Saving = random − signal (nats per test token, > 0: the signal picks tokens that lose less); "
               "faithful = p < α and the saving's interval above 0, unfaithful = no better than random, "
               "anti-faithful = worse than random, untestable = one depth for every token. Across seeds: the mean "
               "saving with its Student-t interval and the largest p.")
