"""The trajectory-vs-readout verdict rows (the package docstring's procedure): one per model (:func:`verdict`)
and one per task × regime over its seeds (:func:`group_verdicts`), each with its evidence sentence."""

from __future__ import annotations

import math

import polars as pl

from looptrace.diagnose.config import DiagnoseConfig
from looptrace.diagnose.stats import (
    COMPARISONS,
    VERDICTS,
    _chosen_interval,
    _cols,
    _f,
    _group_ci,
    _iv,
    _row_iv,
    decide,
    decide_margins,
    dx_best,
    with_val_columns,
)
from looptrace.diagnose.words import _pct, _seeds_word, _verdict_sentence, check_verdict
from looptrace.estimates import MAX_SEEDS, Difference, Interval, paired_difference, seeds_needed
from looptrace.project import split_seed
from looptrace.rules.native_halting import NATIVE_EXITS
from looptrace.rules.scoring import best_chosen


def native_rule(regime_kind: str | None, rules: list[str]) -> str | None:
    """The rule that is "the native gate" of a model: its regime's own exit (the rule its head was trained for,
    :data:`looptrace.rules.native_halting.NATIVE_EXITS`: joint → q_exit, recurtrace → gate_step, act → act_exit)
    when the kind has one — None when that rule was not run (another native-kind rule read on the same gate is a
    different halting method, never a stand-in); for a kind without an entry (an adapter's run, whose regime is
    not looptrace's), every native-kind rule of ``rules`` stays a candidate (returns "*": the best on val)."""
    own = NATIVE_EXITS.get(regime_kind or "")
    if own is None:
        return "*"
    return own if own in rules else None


def native_filter(df: pl.DataFrame, rule: str | None) -> pl.DataFrame:
    """``df``'s native-kind rows reduced to the model's native gate (:func:`native_rule`)."""
    if rule == "*":
        return df
    return df.filter((pl.col("kind") != "native") | (pl.col("rule") == (rule or "")))


def verdict(model: dict, chosen: pl.DataFrame, dx: pl.DataFrame, oracle: dict, failures: pl.DataFrame,
            cfg: DiagnoseConfig) -> dict:
    """The verdict row of one model (see the module docstring for the decision procedure).

    Args:
        model: meta (model, task, regime, regime_kind, n_loops).
        chosen: chosen points of the model's rules (readouts + gates): rule, kind, source, val_depth,
            val_accuracy, test_depth, test_accuracy, within_delta, and when present test_depth_lo/hi,
            n_boot, n_sequences (the bootstrap interval of the val-chosen test depth).
        dx: D@X of the model's rules: rule, kind, source, x, d_at (+ d_at_lo/hi, val_d_at when present).
        oracle: {"depth": Interval | interval dict | float, "accuracy": ...}: the oracle ceiling on test.
        failures: the model's ``failure_classes`` rows (group all).
        cfg: the ``diagnose`` section.

    Returns:
        dict: verdict, reason, evidence sentence and every number (with interval bounds) and comparison it cites.
        :func:`check_verdict` of the row is empty (asserted here: a verdict never contradicts its numbers).
    """
    tol = cfg.gap_tol
    x = float(cfg.x)
    chosen = with_val_columns(chosen)
    fixed_row = chosen.filter(pl.col("rule") == "fixed")
    fixed = (_chosen_interval(fixed_row.row(0, named=True)) if fixed_row.height
             else Interval(_f(model.get("n_loops")), method="none"))
    best = best_chosen(chosen, ["posthoc", "gate"])
    best_i = _chosen_interval(best)
    best_gate, best_post = best_chosen(chosen, ["gate"]), best_chosen(chosen, ["posthoc"])
    own = native_rule(model.get("regime_kind"), chosen.filter(pl.col("kind") == "native")["rule"].to_list())
    nat_row = best_chosen(native_filter(chosen, own), ["native"])
    native = _chosen_interval(nat_row)
    orc = _iv(oracle.get("depth"))
    gates_run = bool(chosen.filter(pl.col("kind") == "gate").height)
    d = decide(best_i, fixed, orc, native, tol)
    fail_best = failures.filter((pl.col("rule") == (best["rule"] if best else "")) & (pl.col("group") == "all"))
    n_tok = int(fail_best["n_tokens"][0]) if fail_best.height else 0
    n_err = n_tok - int(fail_best["correct"][0]) if fail_best.height else 0
    n_traj = int(fail_best["trajectory"][0]) if fail_best.height else 0
    n_read = n_err - n_traj
    why = _verdict_sentence(d, best["rule"] if best else None, best_i, fixed, orc, native, tol, gates_run)
    if fail_best.height and not n_err:
        why += f"; no errors at its chosen point ({n_tok} test tokens)"
    elif fail_best.height:
        why += (f"; errors at its chosen point: {n_err} of {n_tok} test tokens, of which {n_traj} "
                f"({_pct(n_traj, n_err)}) trajectory failures (no loop right) and {n_read} ({_pct(n_read, n_err)}) "
                "readout failures (some loop right)")
    dxx = with_val_columns(dx.filter(pl.col("x") == x))
    dx_fixed, _ = dx_best(dxx, ["fixed"])
    dx_post, dx_post_rule = dx_best(dxx, ["posthoc"])
    dx_gate, _ = dx_best(dxx, ["gate"])
    dx_nat, _ = dx_best(native_filter(dxx, own), ["native"])
    row = {
        "model": model["model"], "group": split_seed(model["model"])[0], "seed": split_seed(model["model"])[1],
        "task": model.get("task"), "regime": model.get("regime"),
        "regime_kind": model.get("regime_kind"), "verdict": d["verdict"], "reason": d["reason"],
        "evidence": f"{model['model']}: {d['verdict']} — {why}.",
        **{f"cmp_{k}": d[k] for k in ("best_vs_fixed", "oracle_vs_fixed", "native_vs_best", "best_vs_oracle")},
        "best_rule": best["rule"] if best else None, "best_source": best["source"] if best else None,
        "best_accuracy": _f(best["test_accuracy"]) if best else math.nan,
        "best_posthoc_rule": best_post["rule"] if best_post else None,
        "best_gate_rule": best_gate["rule"] if best_gate else None,
        "native_rule": nat_row["rule"] if nat_row else None,
        **_cols("fixed_depth", fixed), **_cols("best_depth", best_i), **_cols("native_depth", native),
        **_cols("oracle_depth", orc), **_cols("best_posthoc_depth", _chosen_interval(best_post)),
        **_cols("best_gate_depth", _chosen_interval(best_gate)),
        "oracle_accuracy": _iv(oracle.get("accuracy")).estimate, "x": x,
        **_cols("dx_fixed", dx_fixed), **_cols("dx_best_posthoc", dx_post), "dx_best_posthoc_rule": dx_post_rule,
        **_cols("dx_best_gate", dx_gate), **_cols("dx_native", dx_nat),
        "n_errors": n_err, "n_trajectory_failures": n_traj, "n_readout_failures": n_read,
        "error_trajectory_share": n_traj / n_err if n_err else math.nan,
        "error_readout_share": n_read / n_err if n_err else math.nan,
        "gap_tol": tol, "n_boot": fixed.n_boot, "n_sequences": fixed.n_sequences,
        "n_loops": int(_f(model.get("n_loops"))) if math.isfinite(_f(model.get("n_loops"))) else None,
    }
    problems = check_verdict(row)
    if problems:  # a bug in decide / the sentence, never a property of the data
        raise AssertionError(f"verdict of {model['model']} contradicts its numbers: {'; '.join(problems)}")
    return row


def group_verdicts(verdicts: pl.DataFrame, cfg: DiagnoseConfig, level: float = 0.95) -> pl.DataFrame:
    """One verdict per task × regime over its training seeds.

    Each depth figure of :func:`verdict` (best, fixed, oracle, native; D@X) becomes its across-seed mean with
    the Student-t interval on the logit scale of [1, T] (:func:`looptrace.estimates.across_seeds`; one seed:
    that model's bootstrap interval). The comparisons :func:`decide` rests on are *paired* by seed: all four
    figures of a seed come from one model, so each comparison is the mean per-seed difference with its
    Student-t interval (:func:`looptrace.estimates.paired_difference`); with one seed, the model's own
    comparison. The group verdict is one of the three outcomes only when those intervals decide it, else
    ``undecided`` — with the per-seed verdicts beside it and ``seeds_needed``: the smallest number of seeds at
    which, at the observed mean and spread of the blocking difference, the interval would decide
    (:func:`looptrace.estimates.seeds_needed`; null with one seed: no spread observed).

    Returns:
        DataFrame: group, task, regime, regime_kind, n_seeds, seeds, n_loops, verdict, reason, seed_verdicts,
        best_rules, evidence, blocking, seeds_needed, ``diff_<comparison>`` (``_lo``, ``_hi``, ``_method``) and
        ``<figure>``, ``<figure>_lo``, ``<figure>_hi`` for fixed_depth, best_depth, native_depth, oracle_depth,
        dx_fixed, dx_best_posthoc, dx_best_gate, dx_native.
    """
    rows = []
    if not verdicts.height:
        return pl.DataFrame()
    vs = verdicts if "group" in verdicts.columns else verdicts.with_columns(
        group=pl.col("model").map_elements(lambda m: split_seed(m)[0], return_dtype=pl.String))
    for g in dict.fromkeys(vs["group"].to_list()):
        sub = vs.filter(pl.col("group") == g)
        rs = list(sub.iter_rows(named=True))
        T = max((_f(r.get("n_loops")) for r in rs), default=math.nan)
        bounds = (1.0, T) if math.isfinite(T) and T > 1 else None
        figs = {}
        for name in ("fixed_depth", "best_depth", "native_depth", "oracle_depth", "dx_fixed", "dx_best_posthoc",
                     "dx_best_gate", "dx_native"):
            figs[name] = _group_ci([_seed_iv(r, name) for r in rs], level, bounds)
        native = figs["native_depth"] if figs["native_depth"].present else None
        best = figs["best_depth"] if figs["best_depth"].present else None
        paired: dict[str, Difference | None] = {}
        for key, (a, b) in COMPARISONS.items():
            paired[key] = paired_difference([_f(r.get(f"{a}_depth")) for r in rs],
                                            [_f(r.get(f"{b}_depth")) for r in rs], level)
        if len(rs) == 1:  # one seed: the model's own comparisons, on its bootstrap intervals
            d = decide(_row_iv(rs[0], "best_depth"), _row_iv(rs[0], "fixed_depth") or Interval(math.nan),
                       _row_iv(rs[0], "oracle_depth") or Interval(math.nan), _row_iv(rs[0], "native_depth"),
                       cfg.gap_tol)
        else:
            d = decide(best, figs["fixed_depth"], figs["oracle_depth"], native, cfg.gap_tol, paired)
        n = len(rs)
        counts = {v: sum(r["verdict"] == v for r in rs) for v in VERDICTS}
        seed_v = ", ".join(f"{k} × {v}" for v, k in counts.items() if k)
        rules = ", ".join(dict.fromkeys(r["best_rule"] or "none" for r in rs))
        native_rules = ", ".join(dict.fromkeys(r["native_rule"] for r in rs if r.get("native_rule")))
        gates_run = any(r.get("best_gate_rule") for r in rs)
        need = None
        if d["blocking"] is not None and n > 1:
            diff = d[f"diff_{d['blocking']}"]
            if diff is not None and diff.method.startswith("paired"):
                need = seeds_needed(diff.estimate, diff.sd, decide_margins(diff, d["blocking"], cfg.gap_tol), level)
        extra = ""
        if d["verdict"] == "undecided":
            extra = ("; one seed: more seeds would show the spread" if n == 1 else
                     f"; at the observed spread about {need} seeds would decide" if need is not None else
                     f"; at the observed mean difference no number of seeds up to {MAX_SEEDS} would decide")
        why = _verdict_sentence(d, rules if n > 1 else (rs[0]["best_rule"] or None), best if n > 1 else
                                _row_iv(rs[0], "best_depth"), figs["fixed_depth"] if n > 1 else
                                (_row_iv(rs[0], "fixed_depth") or Interval(math.nan)),
                                figs["oracle_depth"] if n > 1 else (_row_iv(rs[0], "oracle_depth") or Interval(math.nan)),
                                native if n > 1 else _row_iv(rs[0], "native_depth"), cfg.gap_tol,
                                gates_run, seeds=f"{_seeds_word(n)}; per-seed verdicts: {seed_v}{extra}")
        row = {"group": g, "task": rs[0].get("task"), "regime": rs[0].get("regime"),
               "regime_kind": rs[0].get("regime_kind"), "n_seeds": n,
               "seeds": ", ".join(str(r["seed"]) for r in rs if r.get("seed") is not None),
               "n_loops": int(T) if math.isfinite(T) else None,
               "verdict": d["verdict"], "reason": d["reason"], "seed_verdicts": seed_v, "best_rules": rules,
               "native_rules": native_rules or None,
               "evidence": f"{g}: {d['verdict']} — {why}.", "gap_tol": cfg.gap_tol,
               "blocking": d["blocking"], "seeds_needed": need,
               **{f"cmp_{k}": d[k] for k in COMPARISONS}}
        for key in COMPARISONS:
            diff = d[f"diff_{key}"]
            row.update({f"diff_{key}": diff.estimate if diff else math.nan, f"diff_{key}_lo": diff.lo if diff else math.nan,
                        f"diff_{key}_hi": diff.hi if diff else math.nan,
                        f"diff_{key}_method": diff.method if diff else None})
        for name, i in figs.items():
            row.update(_cols(name, i if i.present else None))
        if n == 1:  # the figures the one-seed verdict rests on: the model's own (same values; keeps check_verdict exact)
            for name in ("fixed_depth", "best_depth", "native_depth", "oracle_depth"):
                row.update(_cols(name, _row_iv(rs[0], name)))
        problems = check_verdict(row)
        if problems:
            raise AssertionError(f"verdict of {g} contradicts its numbers: {'; '.join(problems)}")
        rows.append(row)
    return pl.DataFrame(rows, infer_schema_length=None)


def _seed_iv(row: dict, name: str) -> Interval | None:
    """A seed's figure with its bootstrap interval and test-sequence count (the resolution of a bounded interval);
    a D@X NaN with bounds is not reached (+inf)."""
    i = _row_iv(row, name)
    if i is None:
        return None
    return Interval(i.estimate, i.lo, i.hi, n_boot=int(row.get("n_boot") or 0),
                    n_sequences=int(row.get("n_sequences") or 0))
