"""The halting findings in words, derived from the numbers (``diagnose.halting_table``; SPEC §7 "Halting findings").

Five questions, each answered per task from the diagnose stage's own artifacts, with the interval, p-value and n
behind every word:

1. **Loop memory** ([RT]): does it change the trajectory? ``recurtrace_mem`` − ``recurtrace`` (both decoupled; the
   only difference is [RT]'s loop memory) in mean convergence depth (``diagnose.convergence_signal`` <
   ``convergence_eps``, ``convergence_kind``; test tokens, never-converged = T + 1), mean step cosine (the mean over
   loops of the per-loop median cos(Δ_t, Δ_{t−1}), geometry's loop_summary) and the readout frontier (the val-chosen
   best post-hoc readout's D@X, the verdicts' ``dx_best_posthoc``).
2. **Decoupled head vs joint gate at equal depth**: ``recurtrace``'s native head against ``joint``'s (q_exit): the
   mean accuracy gap of their test frontiers over the depths both reach (below). A head's frontier is that of its
   calibrated rule (:data:`~looptrace.rules.native_halting.NATIVE_CALIBRATED`: ``gate_step_calibrated``, the
   quantile grid of thresholds), or of its native rule when the readouts did not run that one.
3. **recurtrace_flow vs recurtrace** (the head's gradient flowing into the trajectory or not): full-depth accuracy,
   convergence depth, step cosine, best post-hoc D@X and the native-head frontier gap.
4. **Collapse to one loop** ([RT]: ACT and PonderNet do): each of ``act``'s and ``joint``'s native exits, from the
   halting table's mean loops interval: *collapses* when the whole interval is ≤ 1 + ``collapse_tol``, *does not*
   when it lies above, else undecided. The native row is the method's own exit (ACT's N at 1 − ε); the table's
   "native, γ calibrated on val" row, when present, is stated beside it, labelled so.
5. **[FP]'s router on convergence labels vs the stabilisation rules** at their chosen points (matched accuracy: val
   within δ of full depth, SPEC §4): the router's test depth − the stabilisation rule's, per task × regime.

Roles are read from each regime's definition, not its name: ``recurtrace`` = kind recurtrace, head decoupled, no
pinned loop memory; ``recurtrace_mem`` = decoupled with ``loop_memory: true``; ``recurtrace_flow`` = ``detach:
false``; ``joint``, ``act`` = those kinds (the first regime of the task with the role).

**Comparisons.** Two regimes are compared seed by seed (the models ``<task>-<regime>-s<k>`` of one k share the
data order and, for the decoupled pair, the initialisation): d_k = a_k − b_k, the mean with its Student-t 95 %
interval over the n seeds (:func:`looptrace.estimates.paired_difference`) and the two-sided paired t-test's p
(``scipy.stats.ttest_1samp`` of the d_k against 0). With one seed, the two models' own bootstrap intervals when the
figure has them (a conservative interval [a_lo − b_hi, a_hi − b_lo], no p), else no interval. A difference is stated
in words (higher / lower) only when its interval excludes 0; otherwise **undecided** — never a direction the interval
does not support.

**Equal-depth frontier gap** (question 2, 3): a rule's test operating points (mean exit depth d, accuracy a) give its
frontier A(d) = the best accuracy at mean depth ≤ d, linear between consecutive frontier points (running a share of
the tokens at the next threshold realises every point of the segment). The gap of two heads is the mean of
A_1(d) − A_2(d) over 201 evenly spaced depths of the range both frontiers cover (from the larger of their smallest
depths to the smaller of their largest); none when the ranges do not overlap.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import polars as pl

from looptrace.diagnose.config import DiagnoseConfig
from looptrace.diagnose.halting_table import CALIBRATED
from looptrace.estimates import Interval, difference, from_row, paired_difference
from looptrace.io.artifacts import read_json, read_parquet
from looptrace.project import split_seed
from looptrace.rules.native_halting import NATIVE_CALIBRATED, NATIVE_EXITS

#: The roles of the comparisons, in the order of the questions.
ROLES = ("recurtrace", "recurtrace_mem", "recurtrace_flow", "joint", "act")

#: Per-model figures (column -> (words, unit, digits, scale)); each with ``_lo``/``_hi`` where an interval exists.
MEASURES = {"conv_depth": ("mean convergence depth", "loops", 2, 1.0),
            "step_cos": ("mean step cosine", "", 3, 1.0),
            "dx_best_posthoc": ("best post-hoc readout's D@X", "loops", 2, 1.0),
            "full_depth_accuracy": ("full-depth test accuracy", "points", 1, 100.0),
            "native_gap": ("native-head accuracy gap at equal depth", "points", 1, 100.0)}

#: Grid points of the equal-depth frontier gap.
GAP_GRID = 201


def regime_role(regime_kind: str | None, regime_def: dict | None) -> str | None:
    """The comparison role of a regime (module docstring) from its kind and definition."""
    d = regime_def or {}
    if regime_kind == "recurtrace":
        if d.get("detach", True) is False:
            return "recurtrace_flow" if not d.get("loop_memory") else None
        return "recurtrace_mem" if d.get("loop_memory") else "recurtrace"
    return regime_kind if regime_kind in ("joint", "act") else None


def frontier(depth: np.ndarray, acc: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A rule's frontier (module docstring): its points sorted by depth with the running best accuracy."""
    o = np.lexsort((-np.asarray(acc, dtype=np.float64), np.asarray(depth, dtype=np.float64)))
    d, a = np.asarray(depth, dtype=np.float64)[o], np.maximum.accumulate(np.asarray(acc, dtype=np.float64)[o])
    keep = np.r_[True, np.diff(d) > 0]  # one accuracy per depth: the best (sorted first among equal depths, then max)
    return d[keep], a[keep]


def frontier_gap(a: tuple[np.ndarray, np.ndarray], b: tuple[np.ndarray, np.ndarray]) -> tuple[float, float, float]:
    """Mean of A_a(d) − A_b(d) over the depth range both frontiers cover (module docstring).

    Args:
        a, b: (depth, accuracy) test operating points of the two rules.

    Returns:
        (gap in accuracy fraction, range lo, range hi); gap NaN when the ranges do not overlap or a side is empty.
    """
    if not (len(a[0]) and len(b[0])):
        return math.nan, math.nan, math.nan
    fa, fb = frontier(*a), frontier(*b)
    lo, hi = max(fa[0][0], fb[0][0]), min(fa[0][-1], fb[0][-1])
    if hi < lo:
        return math.nan, lo, hi
    grid = np.linspace(lo, hi, GAP_GRID) if hi > lo else np.array([lo])
    return float(np.mean(np.interp(grid, *fa) - np.interp(grid, *fb))), float(lo), float(hi)


# ---------------------------------------------------------------------------------------------------------------
# Per-model figures from the artifacts


def frontier_rule(ops: pl.DataFrame, kind: str | None) -> str | None:
    """The rule whose test points are a regime's head frontier (module docstring, question 2): the calibrated
    reading when the readouts ran it, else the native exit; None for a regime without a head."""
    for rule in (NATIVE_CALIBRATED.get(kind or ""), NATIVE_EXITS.get(kind or "")):
        if rule is not None and ops.filter(pl.col("rule") == rule).height:
            return rule
    return NATIVE_EXITS.get(kind or "")


def _native_points(ops: pl.DataFrame, rule: str | None) -> tuple[np.ndarray, np.ndarray]:
    if rule is None:
        return np.zeros(0), np.zeros(0)
    p = ops.filter((pl.col("rule") == rule) & (pl.col("split") == "test"))
    return p["mean_depth"].to_numpy().astype(np.float64), p["accuracy"].to_numpy().astype(np.float64)


def model_figures(models: Sequence[str], readouts_root: Path | str, geometry_root: Path | str,
                  verdicts: pl.DataFrame, cfg: DiagnoseConfig) -> tuple[pl.DataFrame, dict[str, tuple]]:
    """The per-model figures the questions compare, read from the artifacts.

    Args:
        models: model names.
        readouts_root: ``artifacts/readouts`` (metrics.json: regime, kind and definition; operating_points.parquet:
            full-depth accuracy with its interval, the native exit's test points).
        geometry_root: ``artifacts/geometry`` (convergence.parquet, loop_summary.parquet; a missing file leaves the
            figure NaN).
        verdicts: the diagnose ``verdicts`` frame (``dx_best_posthoc`` with ``_lo``/``_hi``).
        cfg: the ``diagnose`` section (convergence signal, ε, kind).

    Returns:
        (one row per model: model, group, task, regime, regime_kind, role, seed, n_loops, frontier_rule and the
        figures of :data:`MEASURES` but ``native_gap``, with ``_lo``/``_hi``; model -> its head's frontier points,
        the test points of :func:`frontier_rule`).
    """
    rows, fronts = [], {}
    vd = {r["model"]: r for r in verdicts.iter_rows(named=True)} if verdicts.height else {}
    for m in models:
        rdir, gdir = Path(readouts_root) / m, Path(geometry_root) / m
        meta = read_json(rdir / "metrics.json")
        kind = meta.get("regime_kind")
        rdef = meta.get("regime_def") if isinstance(meta.get("regime_def"), dict) else None
        T = meta.get("n_loops")
        group, seed = split_seed(m)
        row: dict = {"model": m, "group": group, "task": meta.get("task"), "regime": meta.get("regime"),
                     "regime_kind": kind, "role": regime_role(kind, rdef), "seed": seed, "n_loops": T}
        ops = read_parquet(rdir / "operating_points.parquet")
        full = ops.filter((pl.col("rule") == "fixed") & (pl.col("split") == "test")).sort("threshold")
        fa = from_row(full.row(-1, named=True), "accuracy") if full.height else Interval(math.nan)
        row.update(full_depth_accuracy=fa.estimate, full_depth_accuracy_lo=fa.lo, full_depth_accuracy_hi=fa.hi)
        row["frontier_rule"] = frontier_rule(ops, kind)
        fronts[m] = _native_points(ops, row["frontier_rule"])
        conv = math.nan
        if (gdir / "convergence.parquet").is_file():
            c = read_parquet(gdir / "convergence.parquet").filter(
                (pl.col("split") == "test") & (pl.col("signal") == cfg.convergence_signal)
                & ((pl.col("eps") - cfg.convergence_eps).abs() <= 1e-12 * max(1.0, cfg.convergence_eps))
                & (pl.col("kind") == cfg.convergence_kind))
            if c.height:
                conv = float(c["depth"].cast(pl.Float64).mean())  # type: ignore[arg-type]
        cos = math.nan
        if (gdir / "loop_summary.parquet").is_file():
            ls = read_parquet(gdir / "loop_summary.parquet").filter(
                (pl.col("split") == "test") & (pl.col("group_by") == "all") & (pl.col("metric") == "step_cos"))
            med = ls["median"].cast(pl.Float64).to_numpy() if ls.height else np.zeros(0)
            med = med[np.isfinite(med)]
            cos = float(med.mean()) if med.size else math.nan
        v = vd.get(m, {})
        row.update(conv_depth=conv, step_cos=cos, **{f"dx_best_posthoc{s}": _num(v.get(f"dx_best_posthoc{s}"))
                                                     for s in ("", "_lo", "_hi")})
        rows.append(row)
    return pl.DataFrame(rows, infer_schema_length=None), fronts


def _num(v) -> float:
    return math.nan if v is None else float(v)


# ---------------------------------------------------------------------------------------------------------------
# Comparisons and words


def _pvalue(d: Sequence[float]) -> float:
    """Two-sided paired t-test p of per-seed differences (NaN with < 2 or zero spread)."""
    x = np.asarray([v for v in d if math.isfinite(v)], dtype=np.float64)
    if x.size < 2 or float(x.std(ddof=1)) == 0.0:
        return math.nan
    from scipy.stats import ttest_1samp

    return float(ttest_1samp(x, 0.0).pvalue)


def compare_paired(a: dict[int | None, Interval], b: dict[int | None, Interval], level: float = 0.95) -> dict:
    """a − b seed by seed (module docstring, "Comparisons").

    Args:
        a, b: seed -> the figure of that seed's model (an :class:`Interval`, possibly without bounds).

    Returns:
        dict: estimate, lo, hi, method, p, n (pairs), per_seed, word (``higher`` / ``lower`` / ``undecided``;
        ``equal`` when two or more seeds all differ by exactly 0; ``untestable`` with no pair).
    """
    seeds = [s for s in a if s in b and math.isfinite(a[s].estimate) and math.isfinite(b[s].estimate)]
    per_seed = [a[s].estimate - b[s].estimate for s in seeds]
    out: dict = {"estimate": math.nan, "lo": math.nan, "hi": math.nan, "method": "none", "p": math.nan,
                 "n": len(seeds), "per_seed": per_seed}
    if not seeds:
        return {**out, "word": "untestable"}
    if len(seeds) >= 2:
        d = paired_difference([a[s].estimate for s in seeds], [b[s].estimate for s in seeds], level)
        assert d is not None  # two finite pairs
        out.update(estimate=d.estimate, lo=d.lo, hi=d.hi, method="paired t over seeds", p=_pvalue(per_seed))
    else:
        s = seeds[0]
        if a[s].has_interval and b[s].has_interval:
            d = difference(a[s], b[s])
            out.update(estimate=d.estimate, lo=d.lo, hi=d.hi, method="bootstrap intervals of one seed")
        else:
            out.update(estimate=a[s].estimate - b[s].estimate, method="one seed, no interval")
    lo, hi = float(out["lo"]), float(out["hi"])
    out["word"] = ("higher" if math.isfinite(lo) and lo > 0 else "lower" if math.isfinite(hi) and hi < 0
                   else "equal" if len(seeds) >= 2 and all(x == 0 for x in per_seed) else "undecided")
    return out


def _fmt(v: float, nd: int, scale: float = 1.0) -> str:
    return "—" if not math.isfinite(v) else f"{scale * v:+.{nd}f}"


def stat_text(c: dict, nd: int = 2, scale: float = 1.0, unit: str = "") -> str:
    """``+0.12 [+0.05, +0.19] loops (paired t over 3 seeds, p = 0.012)``."""
    u = f" {unit}" if unit else ""
    s = _fmt(c["estimate"], nd, scale)
    if math.isfinite(c["lo"]):
        s += f" [{_fmt(c['lo'], nd, scale)}, {_fmt(c['hi'], nd, scale)}]"
    how = (f"paired t over {c['n']} seeds, p = {c['p']:.2g}" if c["method"].startswith("paired") and math.isfinite(c["p"])
           else f"paired over {c['n']} seeds, no spread" if c["method"].startswith("paired")
           else "one seed: bootstrap intervals, no p" if c["method"].startswith("bootstrap")
           else "one seed: no interval")
    return f"{s}{u} ({how})"


def _seed_ivs(figs: pl.DataFrame, group: str, col: str) -> dict[int | None, Interval]:
    out = {}
    for r in figs.filter(pl.col("group") == group).iter_rows(named=True):
        lo, hi = r.get(f"{col}_lo"), r.get(f"{col}_hi")
        out[r["seed"]] = Interval(_num(r.get(col)), _num(lo), _num(hi))
    return out


def _role_group(figs: pl.DataFrame, task: str, role: str) -> str | None:
    g = figs.filter((pl.col("task") == task) & (pl.col("role") == role))["group"].to_list()
    return g[0] if g else None


def _gap_ivs(figs: pl.DataFrame, fronts: dict, ga: str, gb: str) -> tuple[dict, dict, list[tuple[float, float]]]:
    """Seed -> the native-head frontier gap of group ga's model over gb's (as an interval-less figure), and b = 0."""
    a, b, ranges = {}, {}, []
    sb = {r["seed"]: r["model"] for r in figs.filter(pl.col("group") == gb).iter_rows(named=True)}
    for r in figs.filter(pl.col("group") == ga).iter_rows(named=True):
        if r["seed"] in sb:
            g, lo, hi = frontier_gap(fronts.get(r["model"], ((), ())), fronts.get(sb[r["seed"]], ((), ())))
            a[r["seed"]], b[r["seed"]] = Interval(g), Interval(0.0)
            if math.isfinite(g):
                ranges.append((lo, hi))
    return a, b, ranges


def _row(question: str, task: str, subject: str, measure: str, c: dict, sentence: str) -> dict:
    return {"question": question, "task": task, "subject": subject, "measure": measure,
            **{k: c.get(k) for k in ("estimate", "lo", "hi", "method", "p", "n", "word")}, "sentence": sentence}


def _pair_rows(question: str, figs: pl.DataFrame, fronts: dict, task: str, ra: str, rb: str,
               measures: Sequence[str], level: float) -> list[dict]:
    ga, gb = _role_group(figs, task, ra), _role_group(figs, task, rb)
    if ga is None or gb is None:
        missing = ra if ga is None else rb
        return [_row(question, task, f"{ra} vs {rb}", "—", {"word": "untestable", "n": 0},
                     f"{task}: not testable — no {missing} models (role: {_ROLE_WORDS[missing]}).")]
    out = []
    for meas in measures:
        words, unit, nd, scale = MEASURES[meas]
        if meas == "native_gap":
            a, b, ranges = _gap_ivs(figs, fronts, ga, gb)
            c = compare_paired(a, b, level)
            where = (f" over the depths both reach ({min(r[0] for r in ranges):.2f}–{max(r[1] for r in ranges):.2f} "
                     "loops across seeds)" if ranges else "")
            if c["word"] == "untestable":
                s = f"{task}: {ga} vs {gb}, {words}: not testable (the two heads' frontiers share no depth range)."
            else:
                verdict = {"higher": f"{ga}'s head is more accurate", "lower": f"{gb}'s head is more accurate",
                           "equal": "no difference (equal in every seed)",
                           "undecided": _undecided(c)}[c["word"]]
                s = (f"{task}: {ga}'s native head ({_native(figs, ga)}) − {gb}'s ({_native(figs, gb)}), {words}"
                     f"{where}: {stat_text(c, nd, scale, unit)}: {verdict}.")
        else:
            c = compare_paired(_seed_ivs(figs, ga, meas), _seed_ivs(figs, gb, meas), level)
            if c["word"] == "untestable":
                s = (f"{task}: {ga} vs {gb}, {words}: not testable (no seed has the figure on both sides; a D@X "
                     "not reached counts as absent).")
            else:
                verdict = {"higher": f"higher in {ga}", "lower": f"lower in {ga}",
                           "equal": "no difference (equal in every seed)",
                           "undecided": _undecided(c)}[c["word"]]
                s = f"{task}: {ga} − {gb}, {words}: {stat_text(c, nd, scale, unit)}: {verdict}."
        out.append(_row(question, task, f"{ga} vs {gb}", meas, c, s))
    return out


_ROLE_WORDS = {"recurtrace": "kind recurtrace, head decoupled, no loop memory",
               "recurtrace_mem": "kind recurtrace, head decoupled, loop_memory true",
               "recurtrace_flow": "kind recurtrace, detach false", "joint": "kind joint", "act": "kind act"}


def _native(figs: pl.DataFrame, group: str) -> str:
    """The rule whose frontier stands for the group's head (its first seed's; :func:`frontier_rule`)."""
    sub = figs.filter(pl.col("group") == group)
    rule = sub["frontier_rule"][0] if "frontier_rule" in sub.columns else None
    return rule or NATIVE_EXITS.get(sub["regime_kind"][0] or "", "—")


def _undecided(c: dict) -> str:
    """Why a comparison is undecided, in words."""
    if c["method"] == "one seed, no interval":
        return "undecided (one seed and no interval: more seeds would give one)"
    return "undecided (the interval includes 0)"


def _overall_row(question: str, task: str, rows: list[dict]) -> list[dict]:
    """One sentence over a pair's measures: where the intervals decide a difference, and where they do not."""
    tested = [r for r in rows if r["word"] not in ("untestable",) and r["measure"] in MEASURES]
    if not tested:
        return []
    subject = tested[0]["subject"]
    differs = [MEASURES[r["measure"]][0] for r in tested if r["word"] in ("higher", "lower")]
    same = [MEASURES[r["measure"]][0] for r in tested if r["word"] not in ("higher", "lower")]
    if differs:
        s = (f"{task}: {subject.replace(' vs ', ' differs from ')} in {', '.join(differs)}"
             + (f"; no decided difference in {', '.join(same)}" if same else "") + ".")
    else:
        s = f"{task}: {subject}: no measured difference is decided."
    return [_row(question, task, subject, "overall", {"word": "differs" if differs else "undecided",
                                                       "n": max(int(r["n"] or 0) for r in tested)}, s)]


def collapse_rows(table: pl.DataFrame | None, tasks: Sequence[str], collapse_tol: float) -> list[dict]:
    """Question 4 from the halting table's native rows of ``act`` and ``joint`` (module docstring)."""
    out = []
    cut = 1.0 + collapse_tol
    for task in tasks:
        for kind, name in (("act", "ACT"), ("joint", "PonderNet")):
            sub = (table.filter((pl.col("task") == task) & (pl.col("regime_kind") == kind)
                                & pl.col("method").is_in(["native", CALIBRATED]))
                   .sort(pl.col("method") != "native", maintain_order=True)  # the method's own exit first
                   if table is not None and table.height else None)
            if sub is None or not sub.height:
                out.append(_row("collapse", task, kind, "loops", {"word": "untestable", "n": 0},
                                f"{task}: {name}: not testable — no {kind} model with its native exit "
                                f"({NATIVE_EXITS[kind]}) in the halting table."))
                continue
            for r in sub.iter_rows(named=True):
                est, lo, hi = r["loops"], r["loops_lo"], r["loops_hi"]
                has = lo is not None and hi is not None and math.isfinite(lo) and math.isfinite(hi)
                word = ("collapses" if has and hi <= cut else "does not collapse" if has and lo > cut
                        else "undecided")
                iv = f"{est:.2f} [{lo:.2f}, {hi:.2f}]" if has else f"{est:.2f} (no interval)"
                how = "t over seeds" if r["n_seeds"] > 1 else "bootstrap over test sequences"
                acc = f"{100 * r['accuracy']:.1f} %"
                if r.get("accuracy_lo") is not None and math.isfinite(r["accuracy_lo"]):
                    acc += f" [{100 * r['accuracy_lo']:.1f}, {100 * r['accuracy_hi']:.1f}]"
                dm = r.get("delta_matched")
                dtext = "" if dm is None or not math.isfinite(dm) else (
                    f", Δ = {100 * dm:+.1f}"
                    + (f" [{100 * r['delta_matched_lo']:+.1f}, {100 * r['delta_matched_hi']:+.1f}]"
                       if r.get("delta_matched_lo") is not None and math.isfinite(r["delta_matched_lo"]) else "")
                    + " points against fixed depth at the same mean loops")
                verdict = {"collapses": f"collapses to one loop (the whole interval ≤ {cut:g})",
                           "does not collapse": f"does not collapse (the whole interval > {cut:g})",
                           "undecided": f"undecided (the interval straddles {cut:g})" if has
                           else "undecided (no interval)"}[word]
                tuned = r["method"] == CALIBRATED  # the same head at a val-chosen γ, not the method's own exit
                s = (f"{task}: {name} ({r['regime']}, {r['rules']}{', γ calibrated on val' if tuned else ''}) exits "
                     f"at {iv} mean loops ({how}, "
                     f"n = {r['n_seeds']} seed{'s' if r['n_seeds'] != 1 else ''}; {r['n_collapsed']} of them ≤ {cut:g}) "
                     f"at {acc} test accuracy{dtext}: {verdict}.")
                out.append(_row("collapse", task, f"{r['regime']} ({CALIBRATED})" if tuned else r["regime"], "loops",
                                {"estimate": est, "lo": lo if has else math.nan, "hi": hi if has else math.nan,
                                 "method": how, "p": math.nan, "n": r["n_seeds"], "word": word}, s))
    return out


def router_rows(router: pl.DataFrame | None, level: float = 0.95) -> list[dict]:
    """Question 5 from ``convergence_router.parquet``'s per-model rows, paired by seed within each task × regime."""
    if router is None or not router.height:
        return [_row("router", "—", "—", "depth", {"word": "untestable", "n": 0},
                     "[FP]'s router: not testable — no refit gate on convergence labels (gates.gates *-converged).")]
    out = []
    m = router.filter(pl.col("scope") == "model").with_columns(
        group=pl.col("name").map_elements(lambda n: split_seed(n)[0], return_dtype=pl.String),
        seed=pl.col("name").map_elements(lambda n: split_seed(n)[1], return_dtype=pl.Int64))
    for (group, ro, ba), sub in m.group_by(["group", "router", "baseline"], maintain_order=True):
        rs = list(sub.iter_rows(named=True))
        a = {r["seed"]: Interval(_num(r["router_depth"]), _num(r["router_depth_lo"]), _num(r["router_depth_hi"]))
             for r in rs}
        b = {r["seed"]: Interval(_num(r["baseline_depth"]), _num(r["baseline_depth_lo"]),
                                 _num(r["baseline_depth_hi"])) for r in rs}
        c = compare_paired(a, b, level)
        matched = all(r["router_within_delta"] is not False and r["baseline_within_delta"] is not False for r in rs)
        verdict = {"higher": "the router exits later — [FP]'s finding reproduced",
                   "lower": "the router exits earlier — [FP]'s finding not reproduced",
                   "undecided": _undecided(c),
                   "equal": "no difference (equal in every seed)", "untestable": "not testable"}[c["word"]]
        acc = (f"; test accuracy {100 * float(sub['router_accuracy'].mean()):.1f} % vs "  # type: ignore[arg-type]
               f"{100 * float(sub['baseline_accuracy'].mean()):.1f} %")  # type: ignore[arg-type]
        caveat = "" if matched else (" (not at matched operating points: a chosen point is not within δ of full depth "
                                     "on val, so the comparison is not at equal accuracy)")
        task = rs[0]["task"]
        s = (f"{group}: router {ro} − stabilisation rule {ba}, test depth at the chosen points: "
             f"{stat_text(c, 2, 1.0, 'loops')}{acc}: {verdict}{caveat}.")
        out.append(_row("router", task, f"{group}: {ro} vs {ba}", "depth", c, s))
    return out


#: The questions in order, with their headings.
QUESTIONS = {"memory": "Does loop memory change the trajectory? (recurtrace_mem − recurtrace, paired by seed)",
             "head_vs_joint": "Does the decoupled head beat the joint gate at equal depth? (recurtrace vs joint)",
             "flow": "Does the head's gradient flowing into the trajectory change anything? (recurtrace_flow − "
                     "recurtrace)",
             "collapse": "Do ACT and PonderNet (joint) collapse to one loop?",
             "router": "Is [FP]'s router on convergence labels worse than the stabilisation rules at matched operating "
                       "points?"}


def halting_findings(figs: pl.DataFrame, fronts: dict, table: pl.DataFrame | None, router: pl.DataFrame | None,
                     cfg: DiagnoseConfig, level: float = 0.95) -> list[dict]:
    """Every finding row (question, task, subject, measure, estimate, lo, hi, method, p, n, word, sentence).

    Args:
        figs, fronts: :func:`model_figures`.
        table: ``halting_table.parquet`` (:func:`looptrace.diagnose.halting_table.halting_table`) or None.
        router: ``convergence_router.parquet`` or None.
        cfg: the ``diagnose`` section (collapse_tol).
        level: interval level.
    """
    tasks = list(dict.fromkeys(t for t in figs["task"].to_list() if t is not None)) if figs.height else []
    rows: list[dict] = []
    for task in tasks:
        rows += _pair_rows("memory", figs, fronts, task, "recurtrace_mem", "recurtrace",
                           ("conv_depth", "step_cos", "dx_best_posthoc"), level)
    for task in tasks:
        rows += _pair_rows("head_vs_joint", figs, fronts, task, "recurtrace", "joint", ("native_gap",), level)
    for task in tasks:
        flow = _pair_rows("flow", figs, fronts, task, "recurtrace_flow", "recurtrace",
                          ("full_depth_accuracy", "conv_depth", "step_cos", "dx_best_posthoc", "native_gap"), level)
        rows += [*flow, *_overall_row("flow", task, flow)]
    in_table = table["task"].to_list() if table is not None and table.height else []
    rows += collapse_rows(table, list(dict.fromkeys([*tasks, *(t for t in in_table if t is not None)])),
                          cfg.collapse_tol)
    rows += router_rows(router, level)
    return rows


def findings_markdown(rows: list[dict], cfg: DiagnoseConfig) -> str:
    """The summary.md section: one heading per question, its sentences, and a closing line on the protocol."""
    conv = f"{cfg.convergence_signal} < {cfg.convergence_eps:g}, {cfg.convergence_kind}"
    lines = ["## Halting findings (from the numbers)", "",
             "Each sentence is derived from the artifacts: differences are a − b seed by seed with the Student-t 95 % "
             "interval over seeds and the paired t-test's p (n = seeds); with one seed, the two models' bootstrap "
             "intervals (no p). A direction is stated only when its interval excludes 0, else *undecided*. "
             f"Convergence depth: {conv} (never converged = T + 1); step cosine: mean over loops of the median "
             f"cos(Δ_t, Δ_{{t−1}}); collapse: mean loops ≤ {1 + cfg.collapse_tol:g} for the whole interval "
             "(docs/SPEC.md §7 \"Halting findings\").", ""]
    for q, head in QUESTIONS.items():
        sub = [r for r in rows if r["question"] == q]
        if not sub:
            continue
        lines += [f"### {head}", ""] + [f"- {r['sentence']}" for r in sub] + [""]
    return "\n".join(lines)
