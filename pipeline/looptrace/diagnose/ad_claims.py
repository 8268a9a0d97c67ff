"""[AD]'s three findings checked on our models, per task × regime on the across-seed intervals
(:func:`ad_claims`)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import polars as pl

from looptrace.diagnose.config import AD_REFERENCE, FIXED_PRIOR_KINDS, DiagnoseConfig, fixed_prior_trajectory
from looptrace.diagnose.stats import _f, _group_ci, dx_best, with_val_columns
from looptrace.diagnose.words import _CMP_WORDS, _dx_ci, _seed_pairs, _seeds_word
from looptrace.estimates import Interval, compare, paired_difference, seeds_needed
from looptrace.project import split_seed
from looptrace.rules.builtin import CONFIDENCE_RULES
from looptrace.rules.native_halting import NATIVE_EXITS


def _status(c: str, good: str, bad: str) -> str:
    """A claim's result on one group from a comparison outcome: ``holds`` / ``does not hold`` / ``within noise``."""
    if c == good:
        return "holds"
    if c == bad:
        return "does not hold"
    return "untestable" if c == "untestable" else "within noise"


def _overall(results: list[str]) -> str:
    """A claim over groups: holds / does not hold / within noise when every tested group agrees, else partly."""
    tested = [r for r in results if r != "untestable"]
    if not tested:
        return "untestable"
    if len(set(tested)) == 1:
        return tested[0]
    return "partly (" + ", ".join(f"{r} in {tested.count(r)}" for r in ("holds", "within noise", "does not hold")
                                 if r in tested) + f" of {len(tested)})"


def _judge(a: Sequence[Interval | None], b: Sequence[Interval | None], ga: Interval, gb: Interval, level: float,
           tol: float = 0.0) -> tuple[str, dict | None, int | None]:
    """How a group's figure a stands to b: on the paired per-seed differences a_s − b_s when two or more seeds
    have both finite (:func:`looptrace.estimates.paired_difference`: the seeds' shared variation cancels), else
    on the two across-seed intervals (:func:`looptrace.estimates.compare`).

    Returns:
        (comparison word, the paired difference as a dict or None, seeds that would decide a ``within noise``
        paired comparison at the observed spread or None).
    """
    pa = [i.estimate if i is not None else math.nan for i in a]
    pb = [i.estimate if i is not None else math.nan for i in b]
    d = paired_difference(pa, pb, level)
    if d is None or d.n_seeds < sum(1 for x, y in zip(pa, pb, strict=True) if not (math.isnan(x) or math.isnan(y))):
        return compare(ga, gb, tol), None, None  # a seed unreachable on one side: the intervals decide
    w = d.word(tol)
    need = seeds_needed(d.estimate, d.sd, [abs(d.estimate)] if abs(d.estimate) >= tol else [], level) \
        if w == "within noise" else None
    return w, d.to_dict(), need


def _paired_words(diff: dict | None, need: int | None) -> str:
    """`` — paired over seeds: difference -1.20 [-1.95, -0.45]`` (and the seeds that would decide)."""
    if diff is None:
        return ""
    out = f"; paired over seeds, the difference is {diff['estimate']:.2f} [{diff['lo']:.2f}, {diff['hi']:.2f}]"
    if need is not None:
        out += f" (about {need} seeds would decide at this spread)"
    return out


def ad_claims(meta: pl.DataFrame, dx: pl.DataFrame, cfg: DiagnoseConfig, gates_present: bool,
              level: float = 0.95) -> list[dict]:
    """Test [AD]'s findings (a), (b), (c) on our models, judged on intervals, one dict per claim.

    The unit is a task × regime group (the models ``<task>-<regime>-s<seed>`` that differ by training seed,
    :func:`looptrace.project.split_seed`): each figure is the across-seed mean with its Student-t interval
    (one seed: that model's bootstrap interval, :func:`looptrace.estimates.across_seeds`); per seed the rule is
    chosen on val (:func:`dx_best`). A claim *holds* on a group only when the intervals are disjoint in the
    claimed direction, *does not hold* when they are disjoint the other way, and is *within noise* when they
    overlap (:func:`looptrace.estimates.compare`).

    (a) best confidence readout's D@X lower than fixed depth's, on fixed-prior groups. (b) the native gate's
    D@X (joint group) higher than the best post-hoc readout's on the fixed-prior models of the same task and
    seed. (c) the best refit gate is strong (lower than fixed by ≥ ``gap_tol``, disjoint intervals) on
    fixed-prior groups and weak (higher, or disjoint but closer than ``gap_tol``; a gate that cannot reach X)
    on joint ones; overlapping intervals leave it within noise.

    Args:
        meta: one row per model: model, task, regime, regime_kind.
        dx: D@X of every model × rule: model, rule, kind, x, d_at (+ d_at_lo/hi, val_d_at, n_boot, n_sequences).
        cfg: the ``diagnose`` section (x, gap_tol).
        gates_present: whether any ``artifacts/gates/<model>`` outputs were found.
        level: interval coverage across seeds.

    Returns:
        list of {"claim": "a"|"b"|"c", "status": holds | does not hold | within noise | partly (...) |
        untestable, "sentences": [str, ...], "details": [dict, ...]}.
    """
    ctx = _groups(meta, dx, cfg)
    return [_claim_a(ctx, level), _claim_b(ctx, level), _claim_c(ctx, cfg, gates_present, level)]


@dataclass(frozen=True)
class _Groups:
    """The models of a diagnosis by task × regime (the models that differ by training seed) and their D@X rows."""

    xs: str  # "D@95"
    dxx: pl.DataFrame  # D@X rows at X, with val columns
    meta: pl.DataFrame  # meta with group and seed columns
    ginfo: dict[str, dict]  # group -> its first model's meta row
    members: dict[str, list[str]]  # group -> its models
    fixed_prior: list[str]  # groups with a fixed depth prior
    joint: list[str]  # jointly trained groups
    bounds: dict[str, tuple[float, float] | None]  # group -> the range of its depths [1, T] (None: T unknown)

    def best(self, model: str, kinds: Sequence[str], rules: Sequence[str] | None = None):
        return dx_best(self.dxx.filter(pl.col("model") == model), kinds, rules)


def _groups(meta: pl.DataFrame, dx: pl.DataFrame, cfg: DiagnoseConfig) -> _Groups:
    """Group the models by task × regime (:func:`looptrace.project.split_seed`) and keep the D@X rows at X."""
    x = float(cfg.x)
    xs = f"D@{x:g}"
    dxx = with_val_columns(dx.filter(pl.col("x") == x))
    meta = meta.with_columns(group=pl.col("model").map_elements(lambda m: split_seed(m)[0], return_dtype=pl.String),
                             seed=pl.col("model").map_elements(lambda m: split_seed(m)[1], return_dtype=pl.Int64))
    if "fixed_prior" not in meta.columns:  # no regime definitions: each kind's defaults (fixed_prior_trajectory)
        meta = meta.with_columns(fixed_prior=pl.col("regime_kind").map_elements(
            fixed_prior_trajectory, return_dtype=pl.Boolean).fill_null(False))
    if "loop_memory" not in meta.columns:
        meta = meta.with_columns(loop_memory=pl.lit(None, dtype=pl.Boolean))
    groups = list(dict.fromkeys(meta["group"].to_list()))
    ginfo = {g: meta.filter(pl.col("group") == g).row(0, named=True) for g in groups}
    members = {g: meta.filter(pl.col("group") == g)["model"].to_list() for g in groups}
    # trajectories trained by a fixed prior alone (the claims are about the trajectory's training objective): the
    # fixed-prior kinds and decoupled RecurTrace heads (SPEC §7 "[AD]'s claims")
    fixed_prior = [g for g in groups if ginfo[g]["fixed_prior"]]
    joint = [g for g in groups if ginfo[g]["regime_kind"] == "joint"]
    bounds: dict[str, tuple[float, float] | None] = {}
    for g in groups:
        T = ginfo[g].get("n_loops")
        bounds[g] = (1.0, float(T)) if T is not None and float(T) > 1 else None
    return _Groups(xs, dxx, meta, ginfo, members, fixed_prior, joint, bounds)


def _kind_words(info: dict) -> str:
    """A group's regime kind, and for a kind that is not a fixed prior by name whether its trajectory counts as one."""
    k = info["regime_kind"]
    if k in FIXED_PRIOR_KINDS or k == "joint":
        return str(k)
    return f"{k}, trajectory {'under a fixed prior (head decoupled)' if info['fixed_prior'] else 'not fixed-prior'}"


def _claim_a(ctx: _Groups, level: float) -> dict:
    """(a) Confidence readouts vs fixed depth on fixed-prior trajectories."""
    xs, best, members, fixed_prior = ctx.xs, ctx.best, ctx.members, ctx.fixed_prior
    res, sent, det = [], [], []
    for g in fixed_prior:
        per = [(m, *best(m, ["posthoc"], CONFIDENCE_RULES), best(m, ["fixed"])[0]) for m in members[g]]
        conf = _group_ci([p[1] for p in per], level, ctx.bounds[g])
        fix = _group_ci([p[3] for p in per], level, ctx.bounds[g])
        c, diff, need = _judge([p[1] for p in per], [p[3] for p in per], conf, fix, level)
        st = _status(c, "lower", "higher")
        res.append(st)
        rules = ", ".join(dict.fromkeys(p[2] or "none" for p in per))
        det.append({"group": g, "n_seeds": len(per), "confidence_rules": rules, "confidence_dx": conf.to_dict(),
                    "fixed_dx": fix.to_dict(), "comparison": c, "result": st, "paired_difference": diff,
                    "seeds_needed": need,
                    "per_seed": [{"model": m, "rule": r, "confidence_dx": _f(i.estimate) if i else math.nan,
                                  "fixed_dx": _f(f.estimate) if f else math.nan} for m, i, r, f in per]})
        sent.append(f"{g} ({_seeds_word(len(per))}): best confidence readout ({rules}, chosen on val) {xs} = "
                    f"{_dx_ci(conf)}, {_CMP_WORDS[c]} fixed depth {xs} = {_dx_ci(fix)}{_paired_words(diff, need)}: "
                    f"{st}" + (f" (per seed, confidence vs fixed: {_seed_pairs([(m, i, f) for m, i, _, f in per])})"
                       if len(per) > 1 else "") + ".")
    status = _overall(res) if res else "untestable"
    head = (f"(a) [AD]: fixed-prior trajectories with confidence readouts reach a lower {xs} than fixed depth "
            f"([AD]: {AD_REFERENCE['confidence_d95']} vs {AD_REFERENCE['fixed_d95']} at D@95). On our models: {status}"
            + ("" if res else " — no fixed-prior (uniform/geometric, or decoupled RecurTrace) model in this run")
            + ".")
    return {"claim": "a", "status": status, "sentences": [head, *sent], "details": det}


def _claim_b(ctx: _Groups, level: float) -> dict:
    """(b) Native joint gate vs post-hoc readouts on fixed-prior trajectories of the same task."""
    xs, best, members, joint, ginfo, meta, dxx = ctx.xs, ctx.best, ctx.members, ctx.joint, ctx.ginfo, ctx.meta, ctx.dxx
    det: list[dict]
    res, sent, det = [], [], []
    for g in joint:
        task = ginfo[g]["task"]
        per = []
        for m in members[g]:
            seed = split_seed(m)[1]
            # peers: fixed-prior models of the same task and training seed, so the comparison is between
            # regimes, not between initialisations; the peer's rule is chosen on val over all peers' rules
            # (and the same architecture: the regime's pinned loop memory, None = the model section's)
            mem = ginfo[g]["loop_memory"]
            peers = meta.filter((pl.col("task") == task) & pl.col("fixed_prior")
                                & (pl.col("seed").is_null() if seed is None else pl.col("seed") == seed)
                                & (pl.col("loop_memory").is_null() if mem is None else pl.col("loop_memory") == mem)
                                )["model"].to_list()
            sub = dxx.filter(pl.col("model").is_in(peers))
            post, rule = dx_best(sub, ["posthoc"])
            peer = (sub.filter((pl.col("rule") == rule) & (pl.col("kind") == "posthoc"))
                    .with_columns(_v=pl.col("val_d_at").fill_null(math.inf).fill_nan(math.inf))
                    .sort("_v", "model")["model"][0]) if rule else None
            # the joint gate's own exit (the rule it was trained for: PonderNet's Q-exit), not the best native rule
            per.append((m, best(m, ["native"], [NATIVE_EXITS["joint"]])[0], post, rule, peer, peers))
        if not any(p[5] for p in per):
            res.append("untestable")
            sent.append(f"{g}: no fixed-prior model of task {task} to compare with.")
            det.append({"group": g, "result": "untestable"})
            continue
        nat = _group_ci([p[1] for p in per], level, ctx.bounds[g])
        post = _group_ci([p[2] for p in per], level, ctx.bounds[g])
        # paired by seed index: joint seed s against the fixed-prior models of seed s
        c, diff, need = _judge([p[1] for p in per], [p[2] for p in per], nat, post, level)
        st = _status(c, "higher", "lower")
        res.append(st)
        peers_s = ", ".join(f"{p[3]} on {p[4]}" if p[3] else f"none on {', '.join(p[5])}" for p in per)
        det.append({"group": g, "n_seeds": len(per), "native_dx": nat.to_dict(), "fixed_prior_posthoc_dx": post.to_dict(),
                    "comparison": c, "result": st, "paired_difference": diff, "seeds_needed": need,
                    "per_seed": [{"model": m, "native_dx": _f(n.estimate) if n else math.nan,
                                  "fixed_prior_posthoc_dx": _f(q.estimate) if q else math.nan, "fixed_prior_rule": r,
                                  "fixed_prior_model": pm} for m, n, q, r, pm, _ in per]})
        sent.append(f"{g} ({_seeds_word(len(per))}): native Q-exit {xs} = {_dx_ci(nat)}, {_CMP_WORDS[c]} the best "
                    f"post-hoc readout on a fixed-prior trajectory of the same seed ({peers_s}): {_dx_ci(post)}"
                    f"{_paired_words(diff, need)}: {st}"
                    + (f" (per seed, native vs post-hoc: {_seed_pairs([(p[0], p[1], p[2]) for p in per])})"
                       if len(per) > 1 else "") + ".")
    status = _overall(res) if res else "untestable"
    head = (f"(b) [AD]: the native joint gate's frontier is worse than post-hoc readouts on fixed-prior "
            f"trajectories ([AD]: native D@95 {AD_REFERENCE['native_d95']} vs {AD_REFERENCE['confidence_d95']}). "
            f"On our models: {status}" + ("" if res else " — no jointly trained model in this run") + ".")
    return {"claim": "b", "status": status, "sentences": [head, *sent], "details": det}


def _claim_c(ctx: _Groups, cfg: DiagnoseConfig, gates_present: bool, level: float) -> dict:
    """(c) Refit gates: strong on fixed-prior, weak on joint trajectories."""
    xs, best, members, fixed_prior, joint, ginfo = ctx.xs, ctx.best, ctx.members, ctx.fixed_prior, ctx.joint, ctx.ginfo
    res, sent, det = [], [], []
    text = "(c) [AD]: gates refit on frozen fixed-prior trajectories are strong, on jointly trained ones weak."
    if gates_present:
        for g in [*fixed_prior, *joint]:
            per = [(m, *best(m, ["gate"]), best(m, ["fixed"])[0]) for m in members[g]]
            per = [p for p in per if p[1] is not None]
            if not per:
                sent.append(f"{g}: no refit gate outputs.")
                continue
            gate = _group_ci([p[1] for p in per], level, ctx.bounds[g])
            fix = _group_ci([p[3] for p in per], level, ctx.bounds[g])
            c, diff, need = _judge([p[1] for p in per], [p[3] for p in per], gate, fix, level, cfg.gap_tol)
            # weak needs the interval to rule out a gain of gap_tol (or a gate that cannot reach X at all)
            strength = {"lower": "strong", "higher": "weak", "within tolerance": "weak",
                        "untestable": "weak"}.get(c, "within noise")  # untestable: neither reaches X
            expect = "strong" if ginfo[g]["fixed_prior"] else "weak"
            st = "within noise" if strength == "within noise" else "holds" if strength == expect else "does not hold"
            res.append(st)
            rules = ", ".join(dict.fromkeys(p[2] for p in per))
            det.append({"group": g, "n_seeds": len(per), "regime_kind": ginfo[g]["regime_kind"], "gate_rules": rules,
                        "gate_dx": gate.to_dict(), "fixed_dx": fix.to_dict(), "comparison": c, "strength": strength,
                        "expected": expect, "result": st, "paired_difference": diff, "seeds_needed": need})
            sent.append(f"{g} ({_kind_words(ginfo[g])}, {_seeds_word(len(per))}): best refit gate ({rules}) {xs} = "
                        f"{_dx_ci(gate)} vs fixed {_dx_ci(fix)}{_paired_words(diff, need)} — {strength} (strong = lower by at least "
                        f"{cfg.gap_tol:g} loops with disjoint intervals); [AD] expects {expect}: {st}"
                        + (f" (per seed, gate vs fixed: {_seed_pairs([(p[0], p[1], p[3]) for p in per])})"
                           if len(per) > 1 else "") + ".")
        status = _overall(res) if res else "untestable"
        head = f"{text} On our models: {status}."
    else:
        status = "untestable"
        head = f"{text} Not tested: no offline-gate outputs (artifacts/gates/<model>/) were found."
    return {"claim": "c", "status": status, "sentences": [head, *sent], "details": det}
