"""``summary.md``: every sentence generated from the tables (verdicts, claims, Spearman headline)."""

from __future__ import annotations

import polars as pl

from looptrace.diagnose.config import CLASSES, DiagnoseConfig
from looptrace.diagnose.stats import _dx_iv, _row_iv, spearman_headlines
from looptrace.diagnose.verdicts import group_verdicts
from looptrace.diagnose.words import _ci, _dx_ci, _rho_basis, _seeds_word, faithfulness_lines, router_lines


def summary_markdown(verdicts: pl.DataFrame, claims: list[dict], spearman: pl.DataFrame, cfg: DiagnoseConfig,
                     failures: pl.DataFrame | None = None, groups: pl.DataFrame | None = None,
                     faithfulness: pl.DataFrame | None = None, router: pl.DataFrame | None = None) -> str:
    """``summary.md``: every sentence generated from the tables (verdicts, claims, Spearman headline).

    Args:
        verdicts: ``verdicts.parquet`` rows (one per model, i.e. per seed).
        claims: ``ad_claims`` output.
        spearman: ``spearman.parquet`` rows (model, signal, loop, aggregation, rho, n).
        cfg: the ``diagnose`` section.
        failures: ``failure_classes.parquet`` rows (for the best-rule table), optional.
        groups: :func:`group_verdicts` rows (computed here when None).
        faithfulness: ``faithfulness.parquet`` rows (SPEC §7a); None = no section.
        router: ``convergence_router.parquet`` rows ([FP]); None or empty = no section.
    """
    if groups is None:
        groups = group_verdicts(verdicts, cfg)
    xs = f"D@{cfg.x:g}"
    lines = ["# Diagnosis: trajectory or readout?", "",
             "Figures are `estimate [lo, hi]`: 95 % intervals, a bootstrap over test sequences for one model and "
             "the Student-t interval over training seeds for a task × regime. Two figures whose intervals overlap "
             "are within noise of each other; a gap counts only when they do not (and, for verdicts, when it is at "
             f"least gap_tol = {cfg.gap_tol:g} loops). \"not reached\" = no operating point reaches the accuracy "
             "target; \"not run\" = the rule does not exist for that model.", ""]
    if groups.height:
        lines += ["## Verdicts per task × regime (across seeds)", "",
                  "| task × regime | regime | seeds | verdict | best rule(s) | best depth | fixed | native | oracle | "
                  f"{xs} fixed | {xs} best post-hoc | {xs} best gate | {xs} native |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for g in groups.iter_rows(named=True):
            lines.append(f"| {g['group']} | {g['regime_kind'] or '?'} | {g['n_seeds']} | {g['verdict']} | "
                         f"{g['best_rules']} | {_ci(_row_iv(g, 'best_depth'))} | {_ci(_row_iv(g, 'fixed_depth'))} | "
                         f"{_ci(_row_iv(g, 'native_depth'))} | {_ci(_row_iv(g, 'oracle_depth'))} | "
                         + " | ".join(_dx_ci(_dx_iv(g, k)) for k in ("dx_fixed", "dx_best_posthoc", "dx_best_gate",
                                                                       "dx_native")) + " |")
        lines += ["", "Evidence:", ""] + [f"- {g['evidence']}" for g in groups.iter_rows(named=True)]
    lines += ["", "## Verdicts per model (one seed each; bootstrap over test sequences)", "",
              "| model | regime | verdict | best rule (depth) | fixed | native | oracle | "
              f"{xs} fixed / post-hoc / gate / native |",
              "|---|---|---|---|---|---|---|---|"]
    for v in verdicts.iter_rows(named=True):
        lines.append(f"| {v['model']} | {v['regime_kind'] or '?'} | {v['verdict']} | {v['best_rule'] or 'none'} "
                     f"({_ci(_row_iv(v, 'best_depth'))}) | {_ci(_row_iv(v, 'fixed_depth'))} | "
                     f"{_ci(_row_iv(v, 'native_depth'))} | {_ci(_row_iv(v, 'oracle_depth'))} | "
                     + " / ".join(_dx_ci(_dx_iv(v, k)) for k in ("dx_fixed", "dx_best_posthoc", "dx_best_gate",
                                                                   "dx_native")) + " |")
    lines += ["", "Depths are mean test exit depths (loops) at each rule's val-chosen point (val accuracy within δ of "
              f"full depth); the best rule is chosen on val. {xs} picks its threshold on test labels (an "
              "oracle-threshold figure). Evidence:", ""]
    lines += [f"- {v['evidence']}" for v in verdicts.iter_rows(named=True)]
    if failures is not None and failures.height:
        lines += ["", "## Failure classes at each model's best rule (test tokens, % of all)", "",
                  "| model | rule | correct | trajectory | readout early | readout overthinking |", "|---|---|---|---|---|---|"]
        for v in verdicts.iter_rows(named=True):
            f = failures.filter((pl.col("model") == v["model"]) & (pl.col("rule") == (v["best_rule"] or ""))
                                & (pl.col("group") == "all"))
            if f.height:
                r = f.row(0, named=True)
                lines.append(f"| {v['model']} | {v['best_rule']} | "
                             + " | ".join(f"{100 * r['frac_' + c]:.1f}" for c in CLASSES) + " |")
    lines += ["", "## Do [AD]'s findings hold on our models?", "",
              "Judged on intervals per task × regime: *holds* only when the intervals are disjoint in the claimed "
              "direction, *within noise* when they overlap, *does not hold* when they are disjoint the other way.",
              ""]
    for c in claims:
        lines.append(f"- {c['sentences'][0]}")
        lines += [f"  - {s}" for s in c["sentences"][1:]]
    lines += ["", "## Difficulty vs signals (Spearman)", ""]
    agg = cfg.spearman_aggregation
    where = "the per-token mean over its defined loops" if cfg.spearman_loop is None else f"loop {cfg.spearman_loop}"
    desc = ("over difficulty levels, of each level's mean signal" if agg == "difficulty_mean" else "over test tokens")
    lines.append(f"Headline: {cfg.spearman_headline} at {where}, Spearman {desc} ([AD]: entropy ≈ 1.0 under fixed "
                 "priors). n is the number of points ρ is computed over"
                 + (" (with a dozen levels ρ = 1 − 6Σd²/(n(n²−1)) is coarse: one swap of two adjacent levels "
                    "moves it by 12/(n(n²−1)) ≈ 0.007 at n = 12)" if agg == "difficulty_mean" else "")
                 + "; the interval is a bootstrap over test sequences (tokens of a sequence stay together, "
                 "difficulty and signal stay paired). Every signal × loop × aggregation is in spearman.parquet.")
    lines.append("")
    groups_rho, models_rho = spearman_headlines(spearman, cfg)
    regime = dict(zip(verdicts["model"].to_list(), verdicts["regime_kind"].to_list(), strict=True))
    for m, d in models_rho.items():
        lines.append(f"- {m} ({regime.get(m) or '?'}): ρ = {d['iv'].fmt()} ({_rho_basis(d)}).")
    multi = {g: d for g, d in groups_rho.items() if d["iv"].n_seeds > 1}
    if multi:
        lines += ["", "Across seeds (mean with the Student-t 95 % interval over seeds):", ""]
        for grp, d in multi.items():
            lines.append(f"- {grp}: ρ = {_ci(d['iv'])} ({_seeds_word(d['iv'].n_seeds)}; n = "
                         f"{', '.join(str(n) for n in d['n'])} {d['unit']}).")
    if router is not None and router.height:
        lines += router_lines(router, cfg.gap_tol)
    if faithfulness is not None:
        lines += faithfulness_lines(faithfulness, cfg.faithfulness_alpha)
    return "\n".join(lines) + "\n"
