"""The report's prose: sentences about real early exit, generation and speed (lossless vs lossy), and ``summary.md``
(every number in them read from the artifacts, never hand-written)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import polars as pl

from looptrace.report.halting_section import HALTING_COLUMNS, collapse_tol_of, halting_intro, halting_rows
from looptrace.report.headline import HEADLINE_FIGURES, nonfinite_table
from looptrace.report.inputs import Inputs, ReportConfig
from looptrace.report.speed_section import bar_text, exit_label, fastest_exit, speedup_text


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
             "Mean over training seeds with the Student-t 95 % interval (mean ± t · sd / √n) on the logit scale of "
             "the figure's range, so it stays within [0, 100] % or [1, T]; with one seed, that model's bootstrap "
             "interval. Verdicts: docs/report.md \"Intervals and verdicts\".", ""]
    lines += _md_table(groups, [("group", "task × regime"), ("regime_kind", "regime"), ("n_seeds", "seeds"),
                                ("best_posthoc_rules", "best post-hoc rule(s)"), *figs, ("verdict_text", "verdict")])
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
    if inp.halting_table is not None and inp.halting_table.height:  # diagnose.halting_table
        tol = collapse_tol_of(inp.collapse_tol)
        lines += ["", "## Halting methods at matched compute", "", halting_intro(tol), ""]
        lines += _md_table(halting_rows(inp.halting_table, tol), HALTING_COLUMNS)
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
                   f"(at most {int(cast(int, bad['exit_mismatches'].max()))} exit depths and "
                   f"{int(cast(int, bad['correct_mismatches'].max()))} predictions of "
                   f"{int(cast(int, bad['n_tokens'].max()))} tokens).")
    for bs in sorted(lat["batch_size"].unique().to_list()):
        d = lat.filter(pl.col("batch_size") == bs)
        r, w = d["speedup_ratio"], d["ratio_to_work_ideal"]
        n08 = int((r >= 0.8).sum())
        out.append(f"Batch size {bs}{' (compacted)' if bs > 1 else ''}: realised / ideal speedup (ideal = T / mean "
                   f"exit depth) is {cast(float, r.min()):.2f}–{cast(float, r.max()):.2f} "
                   f"(median {cast(float, r.median()):.2f}); {n08} of {d.height} runs "
                   f"reach ≥ 0.8 × ideal. Against the exact-causal ideal (a position keeps looping while a later "
                   f"scored position of its sequence is undecided) the median ratio is "
                   f"{cast(float, w.median()):.2f}.")
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


def generate_findings(gen: pl.DataFrame | None, gen_metrics: dict | None) -> list[str]:
    """Sentences about generation-time early exit, generated from generate.parquet (never hand-written numbers)."""
    if gen is None or not gen.height:
        return []
    out = []
    for (policy, bs), d in gen.group_by(["policy", "batch_size"], maintain_order=True):
        r = d["speedup_ratio"]
        out.append(f"KV policy {policy}, batch {bs}: realised / ideal speedup "
                   f"{cast(float, r.min()):.2f}–{cast(float, r.max()):.2f} (median "
                   f"{cast(float, r.median()):.2f}; {int((r >= 0.8).sum())} of {d.height} runs ≥ 0.8), token "
                   f"agreement with full-depth greedy decoding median "
                   f"{100 * cast(float, d['token_agreement'].median()):.1f} %, loss gap of the "
                   f"full-depth continuation median {cast(float, d['loss_gap'].median()):.3f} nats/token.")
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


def speed_findings(gen: pl.DataFrame | None, spec: pl.DataFrame | None, models: list[str], bar: float) -> list[str]:
    """One sentence per model × batch size with speculative rows: its fastest (k, d) by realised speedup with the
    interval and the prediction, against the fastest early exit at ≥ ``bar`` token agreement and the fastest early
    exit overall (every number from the tables, never hand-written)."""
    if spec is None or not spec.height:
        return []
    out = []
    b = bar_text(bar)
    for model in models:
        m = spec.filter((pl.col("model") == model) & pl.col("realised_speedup").is_finite())
        for bs in sorted(set(m["batch_size"].to_list())):
            s = m.filter(pl.col("batch_size") == bs).sort(["realised_speedup", "k", "d"],
                                                          descending=[True, False, False])
            r = s.row(0, named=True)
            of = f", the fastest of {s.height} settings" if s.height > 1 else ""
            tokens = ("with every token full depth's" if r["exact"] else
                      "with tokens that differ from full-depth greedy decoding's (exact = false: a bug, SPEC §8)")
            txt = (f"{model}, batch {bs}: speculative decoding (k={r['k']}, d={r['d']}{of}) "
                   f"{speedup_text(r['realised_speedup'], r.get('realised_speedup_lo'), r.get('realised_speedup_hi'))} "
                   f"{tokens} (predicted "
                   f"{speedup_text(r.get('predicted_speedup'), r.get('predicted_speedup_lo'), r.get('predicted_speedup_hi'))})")
            best, fast = fastest_exit(gen, model, bs, bar), fastest_exit(gen, model, bs)
            if fast is None:
                out.append(txt + "; no early-exit run at this batch size to compare.")
                continue
            if best is None:
                txt += f"; no early-exit run reaches {b} token agreement"
            else:
                txt += (f"; the fastest early exit at ≥ {b} token agreement is {exit_label(best)} at "
                        f"{best['realised_speedup']:.2f}× ({100 * best['token_agreement']:.1f} % agreement)")
            if best is not None and exit_label(best) == exit_label(fast):
                txt += ", also the fastest early exit overall."
            else:
                txt += (f"; the fastest early exit overall is {exit_label(fast)} at {fast['realised_speedup']:.2f}× "
                        f"with {100 * fast['token_agreement']:.1f} % agreement.")
            out.append(txt)
    return out
