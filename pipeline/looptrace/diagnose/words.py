"""Diagnose's prose building blocks: figures as text (``1.15 [1.11, 1.19]``, "not reached", "not run"), a
verdict's sentence, and :func:`check_verdict` (a sentence never contradicts its numbers)."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

from looptrace.diagnose.stats import REASONS, _f, _row_iv, decide
from looptrace.estimates import Difference, Interval, fmt_ci
from looptrace.project import split_seed

#: What each outcome of :func:`looptrace.estimates.compare` reads as in a sentence ("a is ... b").
_CMP_WORDS = {"lower": "lower than", "higher": "higher than", "within noise": "within noise of",
              "within tolerance": "within tolerance of", "untestable": "not comparable with"}


def _ci(i: Interval | None, nd: int = 2) -> str:
    """``1.15 [1.11, 1.19]``; ``not run`` for an absent figure (never None or nan)."""
    return "not run" if i is None or not i.present else i.fmt(nd)


def _dx_ci(i: Interval | None, nd: int = 2) -> str:
    """A D@X figure: ``not reached`` when X is unreachable (+inf estimate), ``not run`` when absent."""
    if i is None or not i.present:
        return "not run"
    if math.isinf(i.estimate):
        extra = f" in {i.n_unreachable} of {i.n_seeds} seeds" if i.n_seeds > 1 and i.n_unreachable else ""
        return f"not reached{extra}"
    return i.fmt(nd).replace("unreachable", "not reached")


def _verdict_sentence(d: dict, best_rule: str | None, best: Interval | None, fixed: Interval, oracle: Interval,
                      native: Interval | None, tol: float, gates_run: bool, seeds: str = "") -> str:
    """The reason of a verdict in words, citing every figure and comparison :func:`decide` used."""
    b = f"{best_rule or 'no rule'} at {_ci(best)}" if best is not None and best.present else "no post-hoc rule"
    fx, orc = f"fixed depth {_ci(fixed)}", f"the oracle ceiling {_ci(oracle)}"
    w = _CMP_WORDS
    r = d["reason"]
    if r in ("no_early_exit", "no_headroom"):
        s = (f"no post-hoc readout{' or refit gate' if gates_run else ''} exits earlier than fixed depth beyond noise "
             f"(tolerance {tol:g} loops): best {b} is {w.get(d['best_vs_fixed'], 'not comparable with')} {fx}")
        bf = d.get("diff_best_vs_fixed")
        if bf is not None:
            s += (f" (difference {fmt_ci(bf.estimate, bf.lo, bf.hi)} loops, {bf.method}: a gain of {tol:g} loops or "
                  "more is ruled out)")
        if r == "no_headroom":
            s += f"; even {orc} is {w.get(d['oracle_vs_fixed'], 'not comparable with')} fixed depth"
        else:
            s += (f"; {orc} is lower, but no rule reading the trajectory finds those right answers"
                  + ("" if gates_run else " (no refit gates were run: the gates stage tests learned readouts)"))
    elif r == "native_gate":
        s = (f"the trajectory supports early exit ({b}, lower than {fx}; {orc}) but the native gate at "
             f"{_ci(native)} is higher than it")
    elif r == "below_ceiling":
        s = (f"{b} is lower than {fx} but higher than {orc}: right answers come earlier than any readout finds them "
             "(on binary tasks the oracle also counts chance hits, so this ceiling is optimistic)")
    elif r == "undecided_early_exit":
        s = (f"the intervals cannot tell whether a rule exits earlier than fixed depth: best {b} is "
             f"{w.get(d['best_vs_fixed'], 'not comparable with')} {fx}{_diff_words(d, 'best_vs_fixed', tol)}; {orc}")
    elif r == "undecided_ceiling":
        s = (f"{b} is lower than {fx}, but the intervals cannot tell whether it is at or above {orc}"
             f"{_diff_words(d, 'best_vs_oracle', tol)}")
    elif r == "undecided_native":
        s = (f"{b} is lower than {fx} and at {orc}, but the intervals cannot tell whether the native gate at "
             f"{_ci(native)} is worse{_diff_words(d, 'native_vs_best', tol)}")
    else:
        s = (f"{b} is lower than {fx} and {w.get(d['best_vs_oracle'], 'not comparable with')} {orc}: the readout "
             "already exits where the trajectory first gets the answer right")
    return s + (f" ({seeds})" if seeds else "")


def _diff_words(d: dict, key: str, tol: float) -> str:
    """``; the difference is -0.40 [-0.90, 0.10] loops (paired t over seeds), neither excluding 0 nor a gap of 0.5``."""
    diff = d.get(f"diff_{key}")
    if diff is None:
        return ""
    return (f"; their difference is {fmt_ci(diff.estimate, diff.lo, diff.hi)} loops ({diff.method}), which neither "
            f"excludes 0 with a gap of at least {tol:g} nor rules such a gap out")


def row_diffs(row: dict) -> dict[str, Difference | None]:
    """The paired differences a verdict row records (``diff_<comparison>``, ``_lo``, ``_hi``, ``_method``), by
    comparison key; a comparison without them is judged on the figures' own intervals."""
    out: dict[str, Difference | None] = {}
    for key in ("best_vs_fixed", "oracle_vs_fixed", "native_vs_best", "best_vs_oracle"):
        e = _f(row.get(f"diff_{key}"))
        if not math.isnan(e) and row.get(f"diff_{key}_method"):
            out[key] = Difference(e, _f(row.get(f"diff_{key}_lo")), _f(row.get(f"diff_{key}_hi")),
                                  str(row[f"diff_{key}_method"]))
    return out


def _pct(k: int, n: int) -> str:
    return f"{100 * k / n:.0f} %" if n else "—"


def check_verdict(row: dict) -> list[str]:
    """Contradictions between a verdict row and its own numbers (empty = consistent).

    Recomputes every comparison from the row's figures and bounds (``best_depth``, ``fixed_depth``,
    ``oracle_depth``, ``native_depth`` with ``_lo``/``_hi``, ``gap_tol``) and checks that the verdict and reason
    follow from them, that the sentence cites the comparisons it rests on, and that the error counts add up.
    """
    out = []
    tol = _f(row.get("gap_tol"))
    tol = 0.0 if math.isnan(tol) else tol
    fixed = _row_iv(row, "fixed_depth") or Interval(math.nan)
    d = decide(_row_iv(row, "best_depth"), fixed, _row_iv(row, "oracle_depth") or Interval(math.nan),
               _row_iv(row, "native_depth"), tol, row_diffs(row))
    if (row.get("verdict"), row.get("reason")) != (d["verdict"], d["reason"]):
        out.append(f"the numbers give {d['verdict']} ({d['reason']}), the row says {row.get('verdict')} "
                   f"({row.get('reason')})")
    if REASONS.get(row.get("reason")) != row.get("verdict"):
        out.append(f"reason {row.get('reason')} does not belong to verdict {row.get('verdict')}")
    ev = row.get("evidence") or ""
    if f": {row.get('verdict')} — " not in ev:
        out.append("the evidence sentence does not state the verdict")
    for key in ("best_vs_fixed", "best_vs_oracle"):
        c = d[key]
        need = (key == "best_vs_fixed" or d["reason"] == "at_ceiling") and c is not None
        if need and _CMP_WORDS[c] not in ev and not (c == "lower" and "lower than" in ev):
            out.append(f"the sentence does not say that best is {_CMP_WORDS[c]} {key.split('_vs_')[1]}")
    for name in ("best_depth", "fixed_depth", "oracle_depth"):
        i = _row_iv(row, name)
        if i is not None and i.present and _ci(i) not in ev:
            out.append(f"the sentence does not cite {name} {_ci(i)}")
    for bad in ("None", "nan", "inf"):
        if re.search(rf"\b{bad}\b", ev):
            out.append(f"the sentence prints '{bad}'")
    n_err = row.get("n_errors")
    if n_err is not None and row.get("n_trajectory_failures") is not None:
        if row["n_trajectory_failures"] + row["n_readout_failures"] != n_err:
            out.append("trajectory + readout failures do not add up to the errors")
    return out


def _seed_pairs(items: Sequence[tuple[str, Interval | None, Interval | None]]) -> str:
    """``s0 1.40 [1.31, 1.52] vs 3.00 [3.00, 3.00]; s1 …`` (a model without a seed: its name)."""
    def name(m: str) -> str:
        seed = split_seed(m)[1]
        return m if seed is None else f"s{seed}"
    return "; ".join(f"{name(m)} {_dx_ci(a)} vs {_dx_ci(b)}" for m, a, b in items)


def _seeds_word(n: int) -> str:
    return f"{n} seed{'s' if n != 1 else ''}"


def _rho_basis(d: dict) -> str:
    """``n = 12 difficulty levels, bootstrap over 64 test sequences, B = 1000`` (or ``no interval``)."""
    out = f"n = {d['n']} {d['unit']}"
    if d["n_boot"]:
        out += f", bootstrap over {d['n_sequences']} test sequences, B = {d['n_boot']}"
    else:
        out += "; no interval"
    return out


def _p_text(p: float) -> str:
    """``p = 0.41`` / ``p = 3e-12`` / ``p < 1e-300``."""
    if p <= 0 or not math.isfinite(p):
        return "p < 1e-300"
    return f"p = {p:.2g}" if p >= 1e-3 else f"p = {p:.0e}"


def _nats(v: float) -> str:
    """A saving in nats, three significant digits (savings range from 1e-4 to 1)."""
    return "0" if v == 0 else f"{v:+.3g}"


def _saving_text(r: dict) -> str:
    s = _nats(r["saving"])
    if r.get("n_boot"):
        s += f" [{_nats(r['saving_lo'])}, {_nats(r['saving_hi'])}]"
    return s


def faithfulness_lines(frame, alpha: float) -> list[str]:
    """summary.md's section on SEWN's counterfactual faithfulness test (SPEC §7a), from ``faithfulness.parquet``.

    One table row per (source, rule): how many models' tests reached each verdict and the range of the saving;
    then, in words, every signal that is *unfaithful* (no better than random tokens given the same exit depths)
    or *anti-faithful* (worse than random), with its saving, interval, p and n.
    """
    import polars as pl

    out = ["", "## Counterfactual faithfulness of halting signals (SEWN's test, SPEC §7a)", "",
           "A rule or gate at its chosen point claims that exiting a token at its exit loop costs nothing. The store "
           "holds the counterfactual loss ℓ_t of every loop, so the claim is tested at a matched budget: the "
           "signal's exit depths on its own tokens against the *same* exit depths handed to random tokens (and to "
           "its reverse ranking). Saving = random cost − signal cost, in nats of ℓ_exit − ℓ_T per test token "
           "(interval: bootstrap over test sequences); p: one-sided paired permutation test (permuted pairing of "
           f"depths with tokens). *faithful* = p < {alpha:g} and the saving's interval above 0; *unfaithful* = no "
           "better than random ranking; *anti-faithful* = worse than random (the other tail's p < α and the interval below 0); *untestable* = every token exits at "
           "one depth.", ""]
    if frame is None or not frame.height:
        return out + ["No rule was tested."]
    from looptrace.diagnose.faithfulness import FAITH_VERDICTS

    out += ["| source | rule | kind | " + " | ".join(FAITH_VERDICTS) + " | saving (min … max over models) |",
            "|---|---|---|" + "---|" * len(FAITH_VERDICTS) + "---|"]
    agg = (frame.group_by("source", "rule", maintain_order=True)
           .agg(pl.col("kind").first(), *[(pl.col("verdict") == v).sum().alias(v) for v in FAITH_VERDICTS],
                pl.col("saving").min().alias("lo"), pl.col("saving").max().alias("hi")))
    for r in agg.iter_rows(named=True):
        out.append(f"| {r['source']} | {r['rule']} | {r['kind'] or '?'} | "
                   + " | ".join(str(r[v]) for v in FAITH_VERDICTS) + f" | {_nats(r['lo'])} … {_nats(r['hi'])} |")
    tested = frame.filter(pl.col("verdict") != "untestable")
    out.append("")
    for verdict, what in (("unfaithful", "no better than random tokens given the same exit depths"),
                          ("anti-faithful", "worse than random: they exit the tokens that most need depth")):
        bad = tested.filter(pl.col("verdict") == verdict)
        if not bad.height:
            out.append(f"- No tested signal is {verdict}.")
            continue
        out.append(f"- {bad.height} of {tested.height} tested signals are **{verdict}** ({what}):")
        pcol = "pvalue_worse" if verdict == "anti-faithful" else "pvalue"  # the tail the verdict rests on
        for rule, sub in bad.group_by("rule", maintain_order=True):
            items = "; ".join(f"{r['model']} saving {_saving_text(r)}, {_p_text(r[pcol])}"
                              + (" (worse than random)" if pcol == "pvalue_worse" else "") + f", n = {r['n']}"
                              for r in sub.iter_rows(named=True))
            out.append(f"  - {rule[0]}: {items}.")
    kinds = {"native": "native halting heads", "gate": "refit gates", "posthoc": "post-hoc readouts"}
    by_kind = [f"{int((sub['verdict'] == 'faithful').sum())} of {sub.height} {kinds[k]}"
               for k in kinds if (sub := tested.filter(pl.col("kind") == k)).height]
    if by_kind:
        out.append(f"- Faithful by family: {'; '.join(by_kind)} ([SEWN]: a static prior fails the test, a contextual "
                   "gate passes it).")
    good = tested.filter(pl.col("verdict") == "faithful")
    if good.height:
        w = good.sort("pvalue", descending=True).row(0, named=True)
        out.append(f"- {good.height} of {tested.height} tested signals are faithful; the weakest is {w['rule']} on "
                   f"{w['model']} (saving {_saving_text(w)} nats/token, {_p_text(w['pvalue'])}, n = {w['n']}).")
    return out


def router_lines(frame, tol: float) -> list[str]:
    """summary.md's section on [FP]'s router on convergence labels vs the stabilisation rules, from
    ``convergence_router.parquet`` (task × regime rows; :mod:`looptrace.diagnose.router`)."""
    import polars as pl

    g = frame.filter(pl.col("scope") == "group")
    out = ["", "## [FP]: a router on convergence labels vs training-free stabilisation", "",
           "[FP] found that halting a token once its output stabilises reaches uniform-depth quality at 4.94 of 8 "
           "loops, while a linear router trained on the same model's convergence labels needs nearly full depth. "
           "Router = refit gate on the `converged` labels (stop once the token has settled, SPEC §6); baselines = "
           "the training-free stabilisation rules. Mean test exit depth (loops) at each rule's val-chosen point "
           "(val accuracy within δ of full depth, so accuracy is matched); across seeds the Student-t interval. "
           f"\"higher\" = the router needs more depth (intervals disjoint, gap ≥ {tol:g} loops).", "",
           "| task × regime | seeds | router | baseline | router depth | baseline depth | router acc | baseline acc | "
           "router is |", "|---|---|---|---|---|---|---|---|---|"]

    def iv(r: dict, w: str) -> str:
        return _ci(Interval(r[f"{w}_depth"], r[f"{w}_depth_lo"], r[f"{w}_depth_hi"], int(r["n_seeds"])))

    def acc(r: dict, w: str) -> str:
        return f"{100 * r[f'{w}_accuracy']:.1f} %" + ("" if r.get(f"{w}_within_delta", True) is not False else " †")

    for r in g.iter_rows(named=True):
        out.append(f"| {r['name']} | {r['n_seeds']} | {r['router']} | {r['baseline']} | {iv(r, 'router')} | "
                   f"{iv(r, 'baseline')} | {acc(r, 'router')} | {acc(r, 'baseline')} | "
                   f"{_CMP_WORDS.get(r['outcome'], r['outcome']).removesuffix(' than').removesuffix(' of')} |")
    out.append("")
    if any(r.get(f"{w}_within_delta") is False for r in g.iter_rows(named=True) for w in ("router", "baseline")):
        out += ["† no threshold of this rule reaches val accuracy within δ of full depth: its point is its most accurate "
                "one, so the depths are not at matched accuracy there.", ""]
    for base in dict.fromkeys(g["baseline"].to_list()):
        sub = g.filter(pl.col("baseline") == base)
        n = sub.height
        cnt = {o: int((sub["outcome"] == o).sum()) for o in ("higher", "lower")}
        rest = n - cnt["higher"] - cnt["lower"]
        verdict = ("as [FP] found, the router needs more depth" if cnt["higher"] > n / 2 else
                   "unlike [FP], the router needs less depth" if cnt["lower"] > n / 2 else
                   "no majority either way: [FP]'s finding is neither reproduced nor refuted")
        out.append(f"- Against {base}: the router is higher on {cnt['higher']}, lower on {cnt['lower']} and within "
                   f"noise or tolerance on {rest} of {n} task × regime{'s' if n != 1 else ''} — {verdict}.")
    return out
