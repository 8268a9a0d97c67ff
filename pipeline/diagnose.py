"""Failure localisation and the trajectory-vs-readout verdict (the ``diagnose`` stage, SPEC §7).

For every model × rule at its chosen operating point (readouts' rules and, when present, the offline
gates'), each test token falls in exactly one class:

- ``correct``: the exit loop's prediction is right;
- ``trajectory``: no loop 1..T is right (the oracle fails too);
- ``readout_early``: some loop is right, the rule exited before the first right loop;
- ``readout_overthinking``: the rule exited after a right loop, at a wrong one.

Verdict per model ([AD]'s decision aid, made explicit; all depths are *chosen-point* test depths, so
every rule is compared at accuracy within δ of full depth, which stays defined when D@95 is not):

1. ``best`` = the lowest-depth chosen point among post-hoc readouts and refit gates (kind ``posthoc``
   or ``gate``; points within δ on val), ``fixed`` = the fixed-depth rule's chosen depth.
2. ``best > fixed − gap_tol`` → **trajectory-limited** (``no_early_exit``): no readout and no gate
   refit on the frozen trajectory exits materially earlier than fixed depth.
3. the model has a native gate and ``native − best > gap_tol`` → **readout-limited** (``native_gate``):
   the trajectory supports early exit, the model's own gate does not use it.
4. ``best − oracle > gap_tol`` → **readout-limited** (``below_ceiling``): the oracle earliest-correct
   ceiling shows right answers earlier than any readout finds them. (On binary tasks the oracle counts
   chance hits at early loops, so this ceiling is optimistic; the failure shares are reported beside it.)
5. otherwise **trajectory-limited** (``at_ceiling``): readouts already reach the oracle ceiling.

The summary checks [AD]'s three findings on our models from the numbers (never tuned): (a) on
fixed-prior (uniform / geometric) trajectories confidence readouts reach a lower D@X than fixed depth;
(b) the native joint gate's frontier is worse than post-hoc readouts on fixed-prior trajectories of the
same task; (c) gates refit on frozen fixed-prior trajectories are strong, on jointly trained ones weak.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import polars as pl
from looptrace.config import InputError, MissingInputError
from looptrace.io.artifacts import read_json, read_parquet, write_outputs
from looptrace.io.parallel import DaskRunner, map_tasks
from looptrace.io.tables import SplitArrays, load_token_loop
from looptrace.project import split_seed
from looptrace.rules.builtin import CONFIDENCE_RULES

#: Failure classes in output order (SPEC §7); codes are their indices.
CLASSES = ("correct", "trajectory", "readout_early", "readout_overthinking")
#: Regime kinds with a fixed depth prior ([AD]'s "fixed-prior" trajectories).
FIXED_PRIOR_KINDS = ("uniform", "geometric")
#: [AD]'s headline numbers (SPEC §9), quoted beside ours.
AD_REFERENCE = {"confidence_d95": 1.38, "fixed_d95": 2.50, "native_d95": 4.49}


@dataclass(frozen=True)
class DiagnoseConfig:
    """``diagnose`` section of ``params.yaml``.

    Attributes:
        x: the D@X target (percent) the claims of the summary are tested at ([AD]: 95).
        gap_tol: loops; a depth difference smaller than this is "no material difference" (verdicts,
            "strong" gates in claim (c)).
        spearman_signals: token_loop columns correlated with difficulty (plus ``oracle_depth``, always).
        spearman_headline: the signal quoted in the summary ([AD]: entropy ≈ 1.0 under fixed priors).
        spearman_loop: loop of the headline (1..T), or null for the per-token mean over the signal's
            defined loops.
        spearman_aggregation: headline aggregation: ``difficulty_mean`` (Spearman over difficulty levels
            of the per-level mean signal) or ``token`` (over test tokens).
    """

    x: float = 95.0
    gap_tol: float = 0.5
    spearman_signals: tuple[str, ...] = ("entropy", "max_prob", "margin", "kl_prev", "logit_change", "rel_step",
                                         "state_cos_dist", "accel", "step_norm")
    spearman_headline: str = "entropy"
    spearman_loop: int | None = None
    spearman_aggregation: str = "difficulty_mean"

    def __post_init__(self) -> None:
        from looptrace.config import ConfigError

        if not 0.0 < self.x <= 100.0:
            raise ConfigError(f"diagnose.x is an accuracy percentage in (0, 100], got {self.x}")
        if self.gap_tol < 0:
            raise ConfigError(f"diagnose.gap_tol must be ≥ 0 loops, got {self.gap_tol}")
        if self.spearman_aggregation not in ("difficulty_mean", "token"):
            raise ConfigError("diagnose.spearman_aggregation must be 'difficulty_mean' or 'token', got "
                              f"{self.spearman_aggregation!r}")
        if self.spearman_headline not in (*self.spearman_signals, "oracle_depth"):
            raise ConfigError(f"diagnose.spearman_headline '{self.spearman_headline}' must be one of "
                              "diagnose.spearman_signals or 'oracle_depth'")
        if self.spearman_loop is not None and self.spearman_loop < 1:
            raise ConfigError(f"diagnose.spearman_loop must be ≥ 1 or null, got {self.spearman_loop}")


# ----------------------------------------------------------------------------------------------
# Failure classes
# ----------------------------------------------------------------------------------------------


def failure_codes(exit_depth: np.ndarray, correct: np.ndarray) -> np.ndarray:
    """SPEC §7 class of each token at its exit (index into ``CLASSES``).

    Args:
        exit_depth: [token] 1-based exit depths.
        correct: [token, loop] bool, argmax_t == y.

    Returns:
        [token] int8: 0 correct, 1 trajectory, 2 readout_early, 3 readout_overthinking.
    """
    c = np.asarray(correct, dtype=bool)
    d = np.asarray(exit_depth, dtype=np.int64)
    n, T = c.shape
    if d.shape != (n,) or d.min(initial=1) < 1 or d.max(initial=1) > T:
        raise ValueError(f"exit depths must be [token] in 1..{T}, got shape {d.shape}")
    right = c[np.arange(n), d - 1]
    anyc = c.any(axis=1)
    first = np.where(anyc, c.argmax(axis=1) + 1, T + 1)
    code = np.full(n, 3, dtype=np.int8)  # wrong at exit, after a right loop
    code[d < first] = 2
    code[~anyc] = 1
    code[right] = 0
    return code


def failure_rows(codes: np.ndarray, exit_depth: np.ndarray, difficulty: np.ndarray) -> list[dict]:
    """Counts and fractions of each class, overall (``group`` all) and per difficulty level.

    Returns:
        list of dicts: group, difficulty (None for all), n_tokens, one count per class, ``frac_<class>``,
        exit_depth_mean. Counts sum to n_tokens by construction.
    """
    rows = []
    groups = [("all", None, np.ones(codes.size, dtype=bool))]
    groups += [("difficulty", int(v), difficulty == v) for v in np.unique(difficulty)]
    for group, level, sel in groups:
        n = int(sel.sum())
        counts = np.bincount(codes[sel], minlength=len(CLASSES))
        row = {"group": group, "difficulty": level, "n_tokens": n}
        row.update({c: int(k) for c, k in zip(CLASSES, counts, strict=True)})
        row.update({f"frac_{c}": (k / n if n else math.nan) for c, k in zip(CLASSES, counts, strict=True)})
        row["exit_depth_mean"] = float(exit_depth[sel].mean()) if n else math.nan
        rows.append(row)
    return rows


# ----------------------------------------------------------------------------------------------
# Spearman: difficulty vs signals
# ----------------------------------------------------------------------------------------------


def _spearman(x: np.ndarray, y: np.ndarray) -> tuple[float, float, int]:
    from scipy.stats import spearmanr

    ok = np.isfinite(x) & np.isfinite(y)
    n = int(ok.sum())
    if n < 3 or np.ptp(x[ok]) == 0 or np.ptp(y[ok]) == 0:
        return math.nan, math.nan, n
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        res = spearmanr(x[ok], y[ok])
    return float(res.statistic), float(res.pvalue), n


def spearman_rows(difficulty: np.ndarray, signals: dict[str, np.ndarray]) -> list[dict]:
    """Spearman ρ between difficulty and each signal, on two aggregations.

    ``token``: over test tokens (difficulty_i, signal_i). ``difficulty_mean``: over difficulty levels
    (level, mean signal of the level's tokens) — [AD]'s ≈ 1.0 reads as a monotone per-level trend. Each
    [token, loop] signal is taken at every loop (``loop`` 1..T) and as its per-token mean over defined
    loops (``loop`` null); [token] signals (``oracle_depth``) have ``loop`` null. Fewer than 3 finite
    points or a constant input give NaN.

    Args:
        difficulty: [token] int.
        signals: name -> [token, loop] or [token] array.

    Returns:
        list of dicts: signal, loop, aggregation, rho, pvalue, n.
    """
    diff = np.asarray(difficulty, dtype=np.float64)
    levels = np.unique(diff)
    rows = []
    for name, sig in signals.items():
        sig = np.asarray(sig, dtype=np.float64)
        cols: list[tuple[int | None, np.ndarray]] = []
        if sig.ndim == 2:
            cols = [(t + 1, sig[:, t]) for t in range(sig.shape[1])]
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN tokens -> NaN mean
                cols.append((None, np.nanmean(sig, axis=1)))
        else:
            cols = [(None, sig)]
        for loop, v in cols:
            rho, p, n = _spearman(diff, v)
            rows.append({"signal": name, "loop": loop, "aggregation": "token", "rho": rho, "pvalue": p, "n": n})
            means = np.array([np.nanmean(v[diff == lv]) if np.isfinite(v[diff == lv]).any() else np.nan
                              for lv in levels])
            rho, p, n = _spearman(levels, means)
            rows.append({"signal": name, "loop": loop, "aggregation": "difficulty_mean", "rho": rho, "pvalue": p,
                         "n": n})
    return rows


# ----------------------------------------------------------------------------------------------
# Verdicts and [AD] claims
# ----------------------------------------------------------------------------------------------


def _nanmin_row(df: pl.DataFrame, col: str) -> dict | None:
    """Row with the smallest finite ``col`` (ties: rule name), or None."""
    ok = df.filter(pl.col(col).is_not_null() & pl.col(col).is_not_nan())
    return ok.sort(col, "rule").row(0, named=True) if ok.height else None


def _f(v) -> float:
    return math.nan if v is None else float(v)


def _fmt(v, nd: int = 2) -> str:
    v = _f(v)
    return "unreachable" if math.isnan(v) else f"{v:.{nd}f}"


def verdict(model: dict, chosen: pl.DataFrame, dx: pl.DataFrame, oracle: dict, failures: pl.DataFrame,
            cfg: DiagnoseConfig) -> dict:
    """The verdict row of one model (see the module docstring for the decision procedure).

    Args:
        model: meta (model, task, regime, regime_kind, n_loops).
        chosen: chosen points of the model's rules (readouts + gates): rule, kind, source, test_depth,
            test_accuracy, within_delta.
        dx: D@X of the model's rules: rule, kind, source, x, d_at.
        oracle: {"depth": mean oracle depth, "accuracy": oracle accuracy} on test.
        failures: the model's ``failure_classes`` rows (group all).
        cfg: the ``diagnose`` section.

    Returns:
        dict: verdict, reason, evidence sentence and every number it cites.
    """
    tol = cfg.gap_tol
    x = float(cfg.x)
    fixed = chosen.filter(pl.col("rule") == "fixed")
    fixed_depth = _f(fixed["test_depth"][0]) if fixed.height else float(model.get("n_loops") or math.nan)
    adaptive = chosen.filter(pl.col("kind").is_in(["posthoc", "gate"]))
    pool = adaptive.filter(pl.col("within_delta")) if adaptive.filter(pl.col("within_delta")).height else adaptive
    best = _nanmin_row(pool, "test_depth")
    best_depth = _f(best["test_depth"]) if best else math.nan
    native = chosen.filter(pl.col("kind") == "native")
    native_depth = _f(native["test_depth"][0]) if native.height else math.nan
    dxx = dx.filter(pl.col("x") == x)

    def dx_of(kind: str) -> dict | None:
        return _nanmin_row(dxx.filter(pl.col("kind") == kind), "d_at")

    dx_fixed, dx_post, dx_gate, dx_nat = dx_of("fixed"), dx_of("posthoc"), dx_of("gate"), dx_of("native")
    best_gate = _nanmin_row(adaptive.filter(pl.col("kind") == "gate"), "test_depth")
    best_post = _nanmin_row(adaptive.filter(pl.col("kind") == "posthoc"), "test_depth")
    fail_best = failures.filter((pl.col("rule") == (best["rule"] if best else "")) & (pl.col("group") == "all"))
    n_err = int(fail_best["n_tokens"][0] - fail_best["correct"][0]) if fail_best.height else 0
    traj_share = fail_best["trajectory"][0] / n_err if n_err else math.nan
    read_share = (fail_best["readout_early"][0] + fail_best["readout_overthinking"][0]) / n_err if n_err else math.nan
    orc_depth = _f(oracle.get("depth"))
    if best is None or not best_depth <= fixed_depth - tol:
        v, reason = "trajectory-limited", "no_early_exit"
        why = (f"no post-hoc readout or refit gate exits materially earlier than fixed depth "
               f"(best {best['rule'] if best else 'none'} at {_fmt(best_depth)} loops vs fixed {_fmt(fixed_depth)}, "
               f"tolerance {tol:g})")
    elif native.height and native_depth - best_depth > tol:
        v, reason = "readout-limited", "native_gate"
        why = (f"the trajectory supports early exit ({best['rule']} at {_fmt(best_depth)} loops vs fixed "
               f"{_fmt(fixed_depth)}) but the native gate needs {_fmt(native_depth)}")
    elif best_depth - orc_depth > tol:
        v, reason = "readout-limited", "below_ceiling"
        why = (f"{best['rule']} exits at {_fmt(best_depth)} loops (fixed {_fmt(fixed_depth)}) while the oracle "
               f"earliest-correct ceiling is {_fmt(orc_depth)} (oracle accuracy {_fmt(100 * _f(oracle.get('accuracy')), 1)}%)")
    else:
        v, reason = "trajectory-limited", "at_ceiling"
        why = (f"{best['rule']} exits at {_fmt(best_depth)} loops, within {tol:g} of the oracle ceiling "
               f"{_fmt(orc_depth)} (fixed {_fmt(fixed_depth)})")
    if not math.isnan(traj_share):
        why += (f"; errors at its chosen point: {100 * traj_share:.0f}% trajectory failures, "
                f"{100 * read_share:.0f}% readout failures")
    return {
        "model": model["model"], "task": model.get("task"), "regime": model.get("regime"),
        "regime_kind": model.get("regime_kind"), "verdict": v, "reason": reason,
        "evidence": f"{model['model']}: {v} — {why}.",
        "fixed_depth": fixed_depth, "best_rule": best["rule"] if best else None,
        "best_source": best["source"] if best else None, "best_depth": best_depth,
        "best_accuracy": _f(best["test_accuracy"]) if best else math.nan,
        "best_posthoc_rule": best_post["rule"] if best_post else None,
        "best_posthoc_depth": _f(best_post["test_depth"]) if best_post else math.nan,
        "best_gate_rule": best_gate["rule"] if best_gate else None,
        "best_gate_depth": _f(best_gate["test_depth"]) if best_gate else math.nan,
        "native_depth": native_depth, "oracle_depth": orc_depth, "oracle_accuracy": _f(oracle.get("accuracy")),
        "x": x, "dx_fixed": _f(dx_fixed["d_at"]) if dx_fixed else math.nan,
        "dx_best_posthoc": _f(dx_post["d_at"]) if dx_post else math.nan,
        "dx_best_posthoc_rule": dx_post["rule"] if dx_post else None,
        "dx_best_gate": _f(dx_gate["d_at"]) if dx_gate else math.nan,
        "dx_native": _f(dx_nat["d_at"]) if dx_nat else math.nan,
        "error_trajectory_share": traj_share, "error_readout_share": read_share,
    }


def _lt(a: float, b: float) -> bool | None:
    """a < b with NaN = unreachable (+∞); None when both are unreachable (untestable)."""
    a, b = _f(a), _f(b)
    if math.isnan(a) and math.isnan(b):
        return None
    return (math.inf if math.isnan(a) else a) < (math.inf if math.isnan(b) else b)


def _overall(results: list[bool | None]) -> str:
    tested = [r for r in results if r is not None]
    if not tested:
        return "untestable"
    if all(tested):
        return "holds"
    return "partly" if any(tested) else "does not hold"


def ad_claims(meta: pl.DataFrame, dx: pl.DataFrame, cfg: DiagnoseConfig, gates_present: bool) -> list[dict]:
    """Test [AD]'s findings (a), (b), (c) on our models, one dict per claim with generated sentences.

    Args:
        meta: one row per model: model, task, regime, regime_kind.
        dx: D@X of every model × rule: model, rule, kind, x, d_at (readouts and gates).
        cfg: the ``diagnose`` section (x, gap_tol).
        gates_present: whether any ``artifacts/gates/<model>`` outputs were found.

    Returns:
        list of {"claim": "a"|"b"|"c", "status": holds | partly | does not hold | untestable,
        "sentences": [str, ...], "details": [dict, ...]}.
    """
    x = float(cfg.x)
    xs = f"D@{x:g}"
    dxx = dx.filter(pl.col("x") == x)

    def best(model: str, kinds: Sequence[str], rules: Sequence[str] | None = None) -> tuple[float, str | None]:
        sub = dxx.filter((pl.col("model") == model) & pl.col("kind").is_in(list(kinds)))
        if rules is not None:
            sub = sub.filter(pl.col("rule").is_in(list(rules)))
        r = _nanmin_row(sub, "d_at")
        return (_f(r["d_at"]), r["rule"]) if r else (math.nan, None)

    fixed_prior = meta.filter(pl.col("regime_kind").is_in(list(FIXED_PRIOR_KINDS)))
    joint = meta.filter(pl.col("regime_kind") == "joint")
    claims = []

    # (a) confidence readouts vs fixed depth on fixed-prior trajectories
    res, sent, det = [], [], []
    for m in fixed_prior.iter_rows(named=True):
        conf, rule = best(m["model"], ["posthoc"], CONFIDENCE_RULES)
        fix, _ = best(m["model"], ["fixed"])
        ok = _lt(conf, fix)
        res.append(ok)
        det.append({"model": m["model"], "confidence_rule": rule, "confidence_dx": conf, "fixed_dx": fix, "holds": ok})
        verb = {True: "lower than", False: "not lower than", None: "not comparable with (both unreachable)"}[ok]
        sent.append(f"{m['model']}: best confidence readout ({rule or 'none'}) {xs} = {_fmt(conf)}, {verb} "
                    f"fixed depth {xs} = {_fmt(fix)}.")
    status = _overall(res) if res else "untestable"
    head = (f"(a) [AD]: fixed-prior trajectories with confidence readouts reach a lower {xs} than fixed depth "
            f"([AD]: {AD_REFERENCE['confidence_d95']} vs {AD_REFERENCE['fixed_d95']} at D@95). On our models: {status}"
            + ("" if res else " — no fixed-prior (uniform/geometric) model in this run") + ".")
    claims.append({"claim": "a", "status": status, "sentences": [head, *sent], "details": det})

    # (b) native joint gate vs post-hoc readouts on fixed-prior trajectories of the same task
    res, sent, det = [], [], []
    for m in joint.iter_rows(named=True):
        nat, _ = best(m["model"], ["native"])
        # peers: fixed-prior models of the same task and training seed (<task>-<regime>-s<seed>), so the
        # comparison is between regimes, not between initialisations
        peers = [p for p in fixed_prior.filter(pl.col("task") == m["task"])["model"].to_list()
                 if split_seed(p)[1] == split_seed(m["model"])[1]]
        cands = [(*best(p, ["posthoc"]), p) for p in peers]
        cands = [c for c in cands if not math.isnan(c[0])]
        post, rule, peer = min(cands) if cands else (math.nan, None, None)
        own, own_rule = best(m["model"], ["posthoc"])
        if not peers:
            ok = None
            sent.append(f"{m['model']}: no fixed-prior model of task {m['task']} to compare with.")
        else:
            ok = _lt(post, nat)
            verb = {True: "worse than", False: "not worse than", None: "not comparable with (both unreachable)"}[ok]
            own_s = (f"the best post-hoc readout on its own joint trajectory: {own_rule} {_fmt(own)}" if own_rule
                     else f"no post-hoc readout reaches {xs} on its own joint trajectory")
            post_s = (f"{rule} on {peer}: {_fmt(post)}" if rule
                      else f"none reaches {xs} on {', '.join(peers)}")
            sent.append(f"{m['model']}: native Q-exit {xs} = {_fmt(nat)}, {verb} the best post-hoc readout on a "
                        f"fixed-prior trajectory ({post_s}); {own_s}.")
        res.append(ok)
        det.append({"model": m["model"], "native_dx": nat, "fixed_prior_posthoc_dx": post, "fixed_prior_rule": rule,
                    "fixed_prior_model": peer, "own_posthoc_dx": own, "holds": ok})
    status = _overall(res) if res else "untestable"
    head = (f"(b) [AD]: the native joint gate's frontier is worse than post-hoc readouts on fixed-prior "
            f"trajectories ([AD]: native D@95 {AD_REFERENCE['native_d95']} vs {AD_REFERENCE['confidence_d95']}). "
            f"On our models: {status}" + ("" if res else " — no jointly trained model in this run") + ".")
    claims.append({"claim": "b", "status": status, "sentences": [head, *sent], "details": det})

    # (c) refit gates: strong on fixed-prior, weak on joint trajectories
    res, sent, det = [], [], []
    if gates_present:
        for m in meta.filter(pl.col("regime_kind").is_in([*FIXED_PRIOR_KINDS, "joint"])).iter_rows(named=True):
            gate, rule = best(m["model"], ["gate"])
            fix, _ = best(m["model"], ["fixed"])
            if rule is None and math.isnan(gate) and not dxx.filter((pl.col("model") == m["model"])
                                                                     & (pl.col("kind") == "gate")).height:
                sent.append(f"{m['model']}: no refit gate outputs.")
                continue
            strong = _lt(gate, fix - cfg.gap_tol if not math.isnan(fix) else math.nan)
            if strong is None:  # both unreachable at X: a gate that cannot reach X is not strong
                strong = False
            expect_strong = m["regime_kind"] in FIXED_PRIOR_KINDS
            ok = strong if expect_strong else not strong
            res.append(ok)
            det.append({"model": m["model"], "regime_kind": m["regime_kind"], "gate_rule": rule, "gate_dx": gate,
                        "fixed_dx": fix, "strong": strong, "holds": ok})
            sent.append(f"{m['model']} ({m['regime_kind']}): best refit gate ({rule or 'none'}) {xs} = {_fmt(gate)} "
                        f"vs fixed {_fmt(fix)} — {'strong' if strong else 'weak'} (strong = at least "
                        f"{cfg.gap_tol:g} loops below fixed depth); [AD] expects "
                        f"{'strong' if expect_strong else 'weak'}.")
        status = _overall(res) if res else "untestable"
        head = (f"(c) [AD]: gates refit on frozen fixed-prior trajectories are strong, on jointly trained ones weak. "
                f"On our models: {status}.")
    else:
        status = "untestable"
        head = ("(c) [AD]: gates refit on frozen fixed-prior trajectories are strong, on jointly trained ones weak. "
                "Not tested: no offline-gate outputs (artifacts/gates/<model>/) were found.")
    claims.append({"claim": "c", "status": status, "sentences": [head, *sent], "details": det})
    return claims


def summary_markdown(verdicts: pl.DataFrame, claims: list[dict], spearman: pl.DataFrame, cfg: DiagnoseConfig,
                     failures: pl.DataFrame | None = None) -> str:
    """``summary.md``: every sentence generated from the tables (verdicts, claims, Spearman headline).

    Args:
        verdicts: ``verdicts.parquet`` rows.
        claims: ``ad_claims`` output.
        spearman: ``spearman.parquet`` rows (model, signal, loop, aggregation, rho, n).
        cfg: the ``diagnose`` section.
        failures: ``failure_classes.parquet`` rows (for the best-rule table), optional.
    """
    lines = ["# Diagnosis: trajectory or readout?", ""]
    lines += ["## Verdicts", "",
              "| model | regime | verdict | best rule (depth) | fixed | native | oracle | "
              f"D@{cfg.x:g} fixed / post-hoc / gate / native |",
              "|---|---|---|---|---|---|---|---|"]
    for v in verdicts.iter_rows(named=True):
        lines.append(f"| {v['model']} | {v['regime_kind'] or '?'} | {v['verdict']} | {v['best_rule'] or '—'} "
                     f"({_fmt(v['best_depth'])}) | {_fmt(v['fixed_depth'])} | {_fmt(v['native_depth'])} | "
                     f"{_fmt(v['oracle_depth'])} | {_fmt(v['dx_fixed'])} / {_fmt(v['dx_best_posthoc'])} / "
                     f"{_fmt(v['dx_best_gate'])} / {_fmt(v['dx_native'])} |")
    lines += ["", "Depths are mean test exit depths (loops) at each rule's chosen point (val accuracy within δ of "
              "full depth). Evidence:", ""]
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
    lines += ["", "## Do [AD]'s findings hold on our models?", ""]
    for c in claims:
        lines.append(f"- {c['sentences'][0]}")
        lines += [f"  - {s}" for s in c["sentences"][1:]]
    lines += ["", "## Difficulty vs signals (Spearman)", ""]
    agg = cfg.spearman_aggregation
    where = "the per-token mean over its defined loops" if cfg.spearman_loop is None else f"loop {cfg.spearman_loop}"
    desc = ("over difficulty levels, of each level's mean signal" if agg == "difficulty_mean" else "over test tokens")
    lines.append(f"Headline: {cfg.spearman_headline} at {where}, Spearman {desc} ([AD]: entropy ≈ 1.0 under fixed "
                 "priors). Every signal × loop × aggregation is in spearman.parquet.")
    lines.append("")
    sel = spearman.filter((pl.col("signal") == cfg.spearman_headline) & (pl.col("aggregation") == agg))
    sel = sel.filter(pl.col("loop").is_null() if cfg.spearman_loop is None else pl.col("loop") == cfg.spearman_loop)
    regime = dict(zip(verdicts["model"].to_list(), verdicts["regime_kind"].to_list(), strict=True))
    for r in sel.sort("model").iter_rows(named=True):
        unit = "difficulty levels" if agg == "difficulty_mean" else "tokens"
        lines.append(f"- {r['model']} ({regime.get(r['model']) or '?'}): ρ = {_fmt(r['rho'])} "
                     f"(n = {r['n']} {unit}).")
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------------------------
# The stage
# ----------------------------------------------------------------------------------------------


def _read_rule_outputs(model_dir: Path, source: str) -> dict[str, pl.DataFrame] | None:
    """chosen, dx, chosen_exits (+ operating_points when present) of a readouts/gates model dir."""
    need = ("chosen", "dx", "chosen_exits")
    if not all((model_dir / f"{n}.parquet").is_file() for n in need):
        if source == "gates":
            return None
        missing = next(n for n in need if not (model_dir / f"{n}.parquet").is_file())
        raise MissingInputError(f"{model_dir / (missing + '.parquet')} not found; run the readouts stage first")
    out = {n: read_parquet(model_dir / f"{n}.parquet") for n in need}
    for n in ("chosen", "dx"):
        df = out[n]
        if "kind" not in df.columns:  # gates may omit it: every gates rule is a refit gate
            df = df.with_columns(kind=pl.lit("gate" if source == "gates" else "posthoc"))
        out[n] = df.with_columns(source=pl.lit(source))
    if "within_delta" not in out["chosen"].columns:
        out["chosen"] = out["chosen"].with_columns(within_delta=pl.lit(True))
    ops = model_dir / "operating_points.parquet"
    if ops.is_file():
        out["operating_points"] = read_parquet(ops)
    return out


def diagnose_models(models: Sequence[str], readouts_root: Path | str, gates_root: Path | str,
                    geometry_root: Path | str, cfg: DiagnoseConfig, meta: dict | None = None,
                    progress: bool = True, runner: DaskRunner | None = None
                    ) -> tuple[dict[str, pl.DataFrame], str, dict]:
    """Failure classes, Spearman, verdicts and the [AD] claims over all models.

    Args:
        models: model names (``<task>-<regime>``).
        readouts_root: ``artifacts/readouts`` (each model's chosen, dx, chosen_exits, operating_points,
            metrics.json — task/regime/regime_kind come from there).
        gates_root: ``artifacts/gates`` (optional per-model outputs with the readouts schema).
        geometry_root: ``artifacts/geometry`` (test rows of token_loop.parquet: difficulty, correctness,
            signals).
        cfg: the ``diagnose`` section.
        meta: extra metrics.json entries (versions, params).
        progress: progress bar.
        runner: one Dask task per model (:func:`model_rows`; the workers read the model's files, so with a
            remote scheduler the artifacts must be on a filesystem the workers share); None = in this process.
            The claims over all models are then drawn here from the per-model rows, in model order.

    Returns:
        (frames {failure_classes, spearman, verdicts}, summary markdown, metrics dict incl. claim details).
    """
    from tqdm.auto import tqdm

    models = list(models)
    parts = map_tasks(model_rows, [[m] for m in models], (readouts_root, gates_root, geometry_root, cfg), runner)
    rows: dict[str, list] = {k: [] for k in _ROW_KEYS}
    gates_present = False
    for part in tqdm(parts, total=len(models), desc="diagnose", disable=None if progress else True, leave=False):
        for k in _ROW_KEYS:
            rows[k] += part[k]
        gates_present = gates_present or part["gates_present"]
    return _diagnosis(**rows, gates_present=gates_present, cfg=cfg, meta=meta)


#: The per-model rows :func:`model_rows` returns.
_ROW_KEYS = ("fail_rows", "sp_rows", "verdict_rows", "meta_rows", "dx_all")


def model_rows(models: Sequence[str], readouts_root: Path | str, gates_root: Path | str, geometry_root: Path | str,
               cfg: DiagnoseConfig) -> dict:
    """The per-model work of :func:`diagnose_models` (in this process or as a Dask task): each model's failure
    rows, Spearman rows, verdict, metadata row and D@X rows (lists, one entry per row, in model order) and
    whether it has gates outputs."""
    readouts_root, gates_root, geometry_root = Path(readouts_root), Path(gates_root), Path(geometry_root)
    fail_rows, sp_rows, verdict_rows, meta_rows, dx_all = [], [], [], [], []
    gates_present = False
    for model in models:
        mpath = readouts_root / model / "metrics.json"
        if not mpath.is_file():
            raise MissingInputError(f"{mpath} not found; run the readouts stage for {model} first")
        rm = read_json(mpath)
        info = {"model": model, "task": rm.get("task"), "regime": rm.get("regime"),
                "regime_kind": rm.get("regime_kind"), "n_loops": rm.get("n_loops")}
        meta_rows.append({k: info[k] for k in ("model", "task", "regime", "regime_kind")})
        outs = [("readouts", _read_rule_outputs(readouts_root / model, "readouts"))]
        g = _read_rule_outputs(gates_root / model, "gates")
        if g is not None:
            gates_present = True
            outs.append(("gates", g))
        test: SplitArrays = load_token_loop(geometry_root / model / "token_loop.parquet", splits=("test",),
                                           columns=("correct", *cfg.spearman_signals))["test"]
        correct = test.loop["correct"]
        chosen, dxs = [], []
        for source, o in outs:
            chosen.append(o["chosen"].select("rule", "kind", "source", "test_depth", "test_accuracy", "within_delta"))
            dxs.append(o["dx"].select("rule", "kind", "source", "x", "d_at"))
            kinds = dict(zip(o["chosen"]["rule"].to_list(), o["chosen"]["kind"].to_list(), strict=True))
            ex = o["chosen_exits"]
            for rule in ex["rule"].unique(maintain_order=True).to_list():
                e = ex.filter(pl.col("rule") == rule).sort("token")
                tok = e["token"].to_numpy()
                if tok.size != test.token.size or not np.array_equal(tok, test.token):
                    raise InputError(f"{source}/{model}/chosen_exits.parquet rule '{rule}': test tokens do not match "
                                     f"the geometry test split ({tok.size} vs {test.token.size}); re-run {source}")
                depth = e["exit_depth"].to_numpy()
                codes = failure_codes(depth, correct)
                for row in failure_rows(codes, depth, test.fields["difficulty"]):
                    fail_rows.append({**{k: info[k] for k in ("model", "task", "regime", "regime_kind")},
                                      "source": source, "rule": rule, "kind": kinds.get(rule), **row})
        signals = {s: test.loop[s] for s in cfg.spearman_signals}
        c = correct
        signals["oracle_depth"] = np.where(c.any(1), c.argmax(1) + 1, c.shape[1]).astype(np.float64)
        sp_rows += [{"model": model, **r} for r in spearman_rows(test.fields["difficulty"], signals)]
        ch, dx = pl.concat(chosen, how="diagonal_relaxed"), pl.concat(dxs, how="diagonal_relaxed")
        dx_all.append(dx.with_columns(model=pl.lit(model)))
        orc = rm.get("rules", {}).get("oracle", {})
        oracle = {"depth": orc.get("test_depth", float(signals["oracle_depth"].mean())),
                  "accuracy": orc.get("test_accuracy", float(c.any(1).mean()))}
        mf = pl.DataFrame([r for r in fail_rows if r["model"] == model])
        verdict_rows.append(verdict(info, ch, dx, oracle, mf, cfg))
    return {"fail_rows": fail_rows, "sp_rows": sp_rows, "verdict_rows": verdict_rows, "meta_rows": meta_rows,
            "dx_all": dx_all, "gates_present": gates_present}


def _diagnosis(fail_rows: list, sp_rows: list, verdict_rows: list, meta_rows: list, dx_all: list,
               gates_present: bool, cfg: DiagnoseConfig, meta: dict | None
               ) -> tuple[dict[str, pl.DataFrame], str, dict]:
    """Frames, claims, summary and metrics of :func:`diagnose_models` from the per-model rows."""
    meta_df = pl.DataFrame(meta_rows, schema={"model": pl.String, "task": pl.String, "regime": pl.String,
                                              "regime_kind": pl.String})
    dx_df = pl.concat(dx_all, how="diagonal_relaxed")
    claims = ad_claims(meta_df, dx_df, cfg, gates_present)
    frames = {
        "failure_classes": pl.DataFrame(fail_rows, infer_schema_length=None),
        "spearman": pl.DataFrame(sp_rows, schema_overrides={"loop": pl.Int64}, infer_schema_length=None),
        "verdicts": pl.DataFrame(verdict_rows, infer_schema_length=None),
    }
    summary = summary_markdown(frames["verdicts"], claims, frames["spearman"], cfg, frames["failure_classes"])
    metrics = {**(meta or {}), "gates_present": gates_present,
               "claims": {c["claim"]: c["status"] for c in claims},
               "models": {v["model"]: {k: v[k] for k in ("verdict", "reason", "best_rule", "best_depth", "fixed_depth",
                                                         "native_depth", "oracle_depth", "dx_fixed", "dx_best_posthoc",
                                                         "dx_best_gate", "dx_native")}
                          for v in verdict_rows}}
    return frames, summary, {**metrics, "claim_details": [{k: c[k] for k in ("claim", "status", "details")}
                                                          for c in claims]}


def write_diagnosis(out_dir: Path | str, frames: dict[str, pl.DataFrame], summary: str, metrics: dict) -> None:
    """Write the diagnose outputs atomically (parquets, summary.md, metrics.json)."""
    write_outputs(out_dir, frames, metrics, extra_text={"summary.md": summary})
