"""The loopmap stage's causal-tracing, exit-gate-patching and answer-flip tables (torch-free; SPEC §2b).

- ``trace`` (:func:`trace_table`): the restored fraction (LD_patched − LD_corrupt) / (LD_clean − LD_corrupt) of a
  patch at (loop k, position) [ROME], per loop k = 0..T and position *role* — ``flipped`` (the substituted position
  f), ``between`` (the mean over f < p < a), ``answer`` (a), ``answer-j`` (p = a − j, when it lies between f and a)
  and, for a model attending both ways, ``other`` (the positions outside [f, a]) — ROME's position axis (subject,
  later tokens, last token), aligned across sequences whose f and a differ. Mean over the traced sequences the model
  answers both ways (LD_clean > 0 > LD_corrupt: a positive denominator larger than either LD) with the bootstrap
  interval over sequences (:class:`looptrace.intervals.Resampler`).
- ``gate_patch`` (:func:`gate_patch_table`, models with a native gate): the halting distribution's expected depth
  and the native exit depth at the answer position in the clean, corrupted and patched runs — patching the gate's
  input at loop k (``gate_input``) or the state at (k, position) (``state``) — with the mean shift
  (patched − corrupt) and the restored share Σ(patched − corrupt) / Σ(clean − corrupt), each with its interval.
- ``flip_depth`` (:func:`flip_depth_table`): the answer-flip depth F of every scored token of the sample — the loop
  from which its argmax never changes again — beside the exit depths of the stage's rules (fixed depth, the
  fixed-point exit, ``rel_step`` and ``entropy`` thresholds, the native gate's exit): mean depth, the share of
  tokens that exit before their flip depth (the answer could still change after the exit), the mean exit − F and the
  accuracy at the exit, with intervals over sequences.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import polars as pl

from looptrace.intervals import Resampler
from looptrace.loopmap.config import LoopmapConfig
from looptrace.loopmap.diagnoses import certified_exit
from looptrace.loopmap.tabulate import fixed_point_rule
from looptrace.rules.native_halting import NATIVE_EXITS, act_cumulative, act_eps, stop_prob
from looptrace.rules.scoring import exit_depths
from looptrace.signals.fixed_point import certified_bound
from looptrace.signals.halting import halting_cdf

#: The tables of this module (``artifacts/loopmap/<model>/<name>.parquet``).
TRACE_TABLES = ("trace", "gate_patch", "flip_depth")

TRACE_SCHEMA = {"model": pl.String, "loop": pl.Int64, "position": pl.String, "restored": pl.Float64,
                "lo": pl.Float64, "hi": pl.Float64, "n_sequences": pl.Int64}
GATE_PATCH_SCHEMA = {"model": pl.String, "patch": pl.String, "loop": pl.Int64, "position": pl.String,
                     "measure": pl.String, "rule": pl.String, "clean": pl.Float64, "corrupt": pl.Float64,
                     "patched": pl.Float64, "shift": pl.Float64, "shift_lo": pl.Float64, "shift_hi": pl.Float64,
                     "restored": pl.Float64, "restored_lo": pl.Float64, "restored_hi": pl.Float64,
                     "n_sequences": pl.Int64}
FLIP_SCHEMA = {"model": pl.String, "rule": pl.String, "threshold": pl.Float64, "mean_depth": pl.Float64,
               "depth_lo": pl.Float64, "depth_hi": pl.Float64, "share_before_flip": pl.Float64,
               "before_lo": pl.Float64, "before_hi": pl.Float64, "mean_gap": pl.Float64, "gap_lo": pl.Float64,
               "gap_hi": pl.Float64, "accuracy": pl.Float64, "n_tokens": pl.Int64}

#: The position roles in table order (``answer-j`` rows follow ``answer``, ``other`` comes last).
ROLES = ("flipped", "between", "answer")


# ---------------------------------------------------------------------------------------------- per-token measures

def flip_depth(argmax: np.ndarray) -> np.ndarray:
    """Answer-flip depth F = min{t : argmax_s = argmax_T for every s ≥ t} (1 = the argmax never changes).

    Args:
        argmax: [token, loop] the readout's argmax at loops 1..T.

    Returns:
        [token] int64 in 1..T: one more than the last loop whose argmax differs from the final one.
    """
    am = np.asarray(argmax)
    differs = am != am[:, -1:]
    T = am.shape[1]
    last = T - 1 - differs[:, ::-1].argmax(axis=1)  # 0-based index of the last differing loop
    return np.where(differs.any(axis=1), last + 2, 1).astype(np.int64)


def halting_distribution(gate_logit: np.ndarray) -> np.ndarray:
    """The native gate's halting distribution p_t = λ_t Π_{j<t}(1 − λ_j) for t < T, p_T = Π_{j<T}(1 − λ_j)
    (PonderNet / Ouro; the last loop takes the remainder), λ = σ(gate): [..., T] -> [..., T] float64, sums to 1."""
    lam = stop_prob(gate_logit)
    survive = np.cumprod(np.concatenate([np.ones_like(lam[..., :1]), 1.0 - lam[..., :-1]], axis=-1), axis=-1)
    p = lam * survive
    p[..., -1] = survive[..., -1]
    return p


def expected_depth(gate_logit: np.ndarray) -> np.ndarray:
    """E_p[t] = Σ_t t·p_t of :func:`halting_distribution`: [..., T] -> [...]."""
    p = halting_distribution(gate_logit)
    return p @ np.arange(1, p.shape[-1] + 1, dtype=np.float64)


def native_exit(regime: Mapping[str, Any] | None, gate_q: float) -> tuple[str, float, Callable[[np.ndarray],
                                                                                                  np.ndarray]]:
    """The native head's exit for a model's regime (SPEC §4): (rule, threshold, gate logits [n, T] -> depth [n]).

    ``joint`` (and a regime that names no other head): ``q_exit`` at q = ``gate_q``; ``recurtrace``: ``gate_step``
    at 0.5; ``act``: ``act_exit`` at 1 − ε of its regime.
    """
    kind = (regime or {}).get("kind")
    rule = NATIVE_EXITS.get(str(kind), "q_exit")
    if rule == "gate_step":
        return rule, 0.5, lambda g: exit_depths(stop_prob(g), np.array([0.5]), "ge")[0]
    if rule == "act_exit":
        thr = 1.0 - act_eps(regime)
        return rule, thr, lambda g: exit_depths(act_cumulative(g), np.array([thr]), "ge")[0]
    return rule, float(gate_q), lambda g: exit_depths(halting_cdf(g), np.array([gate_q]), "ge")[0]


def traced_mask(trace: Mapping[str, Any]) -> np.ndarray:
    """[n] the traced sequences kept: the model prefers the right one of the two answers in both runs
    (LD_clean > 0 > LD_corrupt), so the denominator LD_clean − LD_corrupt is positive and larger than either."""
    return (np.asarray(trace["ld_clean"]) > 0) & (np.asarray(trace["ld_corrupt"]) < 0)


def role_values(x: np.ndarray, answer: np.ndarray, flipped: np.ndarray, patched: np.ndarray
                ) -> dict[str, np.ndarray]:
    """Per position role, one value per sequence and loop (NaN where the role has no position in that sequence).

    Args:
        x: [n, K, seq] a per-(loop, position) value.
        answer, flipped: [n] a and f.
        patched: [n, K, seq] the cells that were run (``other`` appears only when some cell outside [f, a] was).

    Returns:
        label -> [n, K] in table order.
    """
    n, K, S = x.shape
    i = np.arange(n)
    pos = np.arange(S)[None, :]
    inner = (pos > flipped[:, None]) & (pos < answer[:, None])  # [n, S]
    out = {"flipped": x[i, :, flipped], "answer": x[i, :, answer]}
    cnt = inner.sum(1)
    with np.errstate(invalid="ignore"):
        out["between"] = np.where(cnt[:, None] > 0, (x * inner[:, None]).sum(-1) / np.maximum(cnt, 1)[:, None],
                                  np.nan)
    ordered = {r: out[r] for r in ROLES}
    for j in range(1, S):
        p = answer - j
        ok = (p > flipped)
        if not ok.any():
            continue
        ordered[f"answer-{j}"] = np.where(ok[:, None], x[i, :, np.clip(p, 0, S - 1)], np.nan)
    outer = (pos < flipped[:, None]) | (pos > answer[:, None])
    if (patched & outer[:, None, :]).any():
        c = outer.sum(1)
        ordered["other"] = np.where(c[:, None] > 0, (x * outer[:, None]).sum(-1) / np.maximum(c, 1)[:, None],
                                    np.nan)
    return ordered


def _means(rs: Resampler | None, values: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Mean over sequences of each row of ``values`` [K, n] (NaN = no value) with its bootstrap interval: (mean,
    lo, hi, count) [K] each."""
    v = np.asarray(values, dtype=np.float64)
    has = np.isfinite(v)
    cnt = has.sum(1)
    num = np.where(has, v, 0.0)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = num.sum(1) / cnt
    lo = hi = np.full(v.shape[0], np.nan)
    if rs is not None and rs.n_boot:
        lo, hi = rs.interval(rs.ratio(num, has.astype(np.float64)))
    return mean, lo, hi, cnt


def _resampler(sequence: np.ndarray, cfg: LoopmapConfig, seed: int) -> Resampler | None:
    return Resampler(sequence, cfg.n_boot, seed, cfg.level) if cfg.n_boot and len(sequence) else None


# ---------------------------------------------------------------------------------------------- tables

def restored_fraction(trace: Mapping[str, Any]) -> np.ndarray:
    """(LD_patched − LD_corrupt) / (LD_clean − LD_corrupt): [n, T + 1, seq] (NaN where LD_clean = LD_corrupt)."""
    lc, lx = np.asarray(trace["ld_clean"])[:, None, None], np.asarray(trace["ld_corrupt"])[:, None, None]
    with np.errstate(invalid="ignore", divide="ignore"):
        return (np.asarray(trace["ld_patched"]) - lx) / (lc - lx)


def trace_table(model: str, trace: Mapping[str, Any], cfg: LoopmapConfig, seed: int) -> pl.DataFrame:
    """Restored fraction per loop k = 0..T × position role (module docstring)."""
    keep = traced_mask(trace)
    if not keep.any():
        return pl.DataFrame(schema=TRACE_SCHEMA)
    frac = restored_fraction(trace)[keep]
    roles = role_values(frac, trace["answer"][keep], trace["flipped"][keep], trace["patched"][keep])
    K = frac.shape[1]
    stacked = np.concatenate([v.T for v in roles.values()])  # [roles·K, n]
    mean, lo, hi, cnt = _means(_resampler(trace["sequence"][keep], cfg, seed), stacked)
    rows = []
    for r, label in enumerate(roles):
        for k in range(K):
            i = r * K + k
            rows.append({"model": model, "loop": k, "position": label, "restored": float(mean[i]),
                         "lo": float(lo[i]), "hi": float(hi[i]), "n_sequences": int(cnt[i])})
    return pl.DataFrame(rows, schema=TRACE_SCHEMA)


def gate_patch_table(model: str, trace: Mapping[str, Any], regime: Mapping[str, Any] | None, cfg: LoopmapConfig,
                     seed: int) -> pl.DataFrame:
    """Exit-gate patching (module docstring); no rows for a model without a native gate."""
    keep = traced_mask(trace)
    if "gate_clean" not in trace or not keep.any():
        return pl.DataFrame(schema=GATE_PATCH_SCHEMA)
    rule, _, exit_depth = native_exit(regime, cfg.gate_q)
    gc, gx, gp = (np.asarray(trace[k])[keep] for k in ("gate_clean", "gate_corrupt", "gate_patched"))
    n, T = gc.shape
    measures: dict[str, Callable[[np.ndarray], np.ndarray]] = {
        "expected_depth": expected_depth,
        "exit_depth": lambda g: exit_depth(g.reshape(-1, T)).reshape(g.shape[:-1]).astype(np.float64)}
    rs = _resampler(trace["sequence"][keep], cfg, seed)
    rows = []
    for name, m in measures.items():
        clean, corrupt = m(gc), m(gx)
        cases: list[tuple[str, int, str, np.ndarray]] = []
        for k in range(1, T + 1):  # the gate of loop k reads the clean state; nothing else changes
            g = gx.copy()
            g[:, k - 1] = gc[:, k - 1]
            cases.append(("gate_input", k, "answer", m(g)))
        roles = role_values(m(gp), trace["answer"][keep], trace["flipped"][keep], trace["patched"][keep])
        for label, v in roles.items():
            if label in ROLES:
                cases += [("state", k, label, v[:, k]) for k in range(T + 1)]
        patched = np.stack([c[3] for c in cases])  # [cases, n]
        has = np.isfinite(patched)
        shift = np.where(has, patched - corrupt, np.nan)
        s_mean, s_lo, s_hi, cnt = _means(rs, shift)
        gap = np.where(has, clean - corrupt, 0.0)
        moved = np.where(has, shift, 0.0)
        with np.errstate(invalid="ignore", divide="ignore"):
            restored = np.where(gap.sum(1) != 0, moved.sum(1) / gap.sum(1), np.nan)  # NaN: nothing to restore
        r_lo = r_hi = np.full(len(cases), np.nan)
        if rs is not None and rs.n_boot:
            boot = rs.ratio(moved, gap)
            r_lo, r_hi = rs.interval(np.where(np.isfinite(boot), boot, np.nan))  # a resample without a gap: none
        for i, (patch, k, label, _) in enumerate(cases):
            sel = has[i]
            rows.append({"model": model, "patch": patch, "loop": k, "position": label, "measure": name,
                         "rule": rule if name == "exit_depth" else "halting_distribution",
                         "clean": float(clean[sel].mean()) if sel.any() else float("nan"),
                         "corrupt": float(corrupt[sel].mean()) if sel.any() else float("nan"),
                         "patched": float(patched[i][sel].mean()) if sel.any() else float("nan"),
                         "shift": float(s_mean[i]), "shift_lo": float(s_lo[i]), "shift_hi": float(s_hi[i]),
                         "restored": float(restored[i]), "restored_lo": float(r_lo[i]),
                         "restored_hi": float(r_hi[i]), "n_sequences": int(cnt[i])})
    return pl.DataFrame(rows, schema=GATE_PATCH_SCHEMA)


def exit_rule_depths(raw: Mapping[str, Any], cfg: LoopmapConfig, regime: Mapping[str, Any] | None
                     ) -> list[tuple[str, float, np.ndarray]]:
    """(rule, threshold, exit depth [token]) of the stage's rules on the sample: fixed depth, the fixed-point exit
    (certified or estimated, at ``eps``), ``rel_step`` at ``eps``, ``entropy`` at its sample quantiles (the
    ``frontier`` table's points) and, with a native gate, the native head's exit."""
    correct = raw["correct"]
    n, T = correct.shape
    out = [("fixed", float(d), np.full(n, d, dtype=np.int64)) for d in range(1, T + 1)]
    rule, rho = fixed_point_rule(dict(raw))
    bound = certified_bound(rho, raw["rel_step"])
    out += [(rule, float(e), certified_exit(bound, e)) for e in cfg.eps]
    out += [("rel_step", float(e), certified_exit(raw["rel_step"], e)) for e in cfg.eps]
    qs = np.quantile(raw["entropy"], np.linspace(0, 1, cfg.entropy_quantiles + 2)[1:-1])
    out += [("entropy", float(q), certified_exit(raw["entropy"], q)) for q in qs]
    if "gate_logit" in raw:
        name, thr, depth = native_exit(regime, cfg.gate_q)
        out.append((name, thr, depth(raw["gate_logit"])))
    return out


def flip_depth_table(model: str, raw: Mapping[str, Any], cfg: LoopmapConfig, seed: int,
                     regime: Mapping[str, Any] | None = None) -> pl.DataFrame:
    """The flip depth F beside every rule's exit depth (module docstring); the first row (rule ``flip_depth``) is
    F itself."""
    correct = raw["correct"]
    n = correct.shape[0]
    if not n:
        return pl.DataFrame(schema=FLIP_SCHEMA)
    F = flip_depth(raw["argmax"])
    rules = [("flip_depth", float("nan"), F), *exit_rule_depths(raw, cfg, regime)]
    depth = np.stack([d for _, _, d in rules]).astype(np.float64)  # [rules, token]
    before = (depth < F).astype(np.float64)
    gap = depth - F
    rs = Resampler(raw["sequence"], cfg.n_boot, seed, cfg.level) if cfg.n_boot else None
    lo = {k: np.full(len(rules), np.nan) for k in ("depth", "before", "gap")}
    hi = dict(lo)
    if rs is not None and rs.n_boot:
        for key, v in (("depth", depth), ("before", before), ("gap", gap)):
            lo[key], hi[key] = rs.interval(rs.ratio(v))
    acc = [float(correct[np.arange(n), d - 1].mean()) for _, _, d in rules]
    return pl.DataFrame([{"model": model, "rule": r, "threshold": None if r == "flip_depth" else thr,
                          "mean_depth": float(depth[i].mean()), "depth_lo": float(lo["depth"][i]),
                          "depth_hi": float(hi["depth"][i]), "share_before_flip": float(before[i].mean()),
                          "before_lo": float(lo["before"][i]), "before_hi": float(hi["before"][i]),
                          "mean_gap": float(gap[i].mean()), "gap_lo": float(lo["gap"][i]),
                          "gap_hi": float(hi["gap"][i]), "accuracy": acc[i], "n_tokens": n}
                         for i, (r, thr, _) in enumerate(rules)], schema=FLIP_SCHEMA)


def empty_trace_frames() -> dict[str, pl.DataFrame]:
    """The three tables with no rows."""
    return {"trace": pl.DataFrame(schema=TRACE_SCHEMA), "gate_patch": pl.DataFrame(schema=GATE_PATCH_SCHEMA),
            "flip_depth": pl.DataFrame(schema=FLIP_SCHEMA)}


# ---------------------------------------------------------------------------------------------- words

def _ci(v: float, lo: float, hi: float, digits: int = 2) -> str:
    if not np.isfinite(lo):
        return f"{v:.{digits}f}"
    return f"{v:.{digits}f} [{lo:.{digits}f}, {hi:.{digits}f}]"


def trace_words(frames: Mapping[str, pl.DataFrame], meta: Mapping[str, Any]) -> list[str]:
    """The sentences of ``tracing.md``: the flip depth beside the exits, where the answer comes back when the clean
    state is patched in, and what the native gate does (each with its interval)."""
    words = []
    fd = frames["flip_depth"]
    if fd.height:
        f = fd.row(0, named=True)
        fixed1 = fd.filter((pl.col("rule") == "fixed") & (pl.col("threshold") == 1.0))
        late = fixed1.row(0, named=True)["share_before_flip"] if fixed1.height else float("nan")
        words.append(f"Answer flips ({f['n_tokens']} scored tokens): the argmax stops changing after loop "
                     f"{_ci(f['mean_depth'], f['depth_lo'], f['depth_hi'])} on average (flip depth F); "
                     f"{100 * late:.0f} % of tokens still change their argmax after loop 1.")
        native = fd.filter(~pl.col("rule").is_in(["flip_depth", "fixed", "rel_step", "entropy",
                                                   "certified_fixed_point", "estimated_fixed_point"]))
        for r in native.iter_rows(named=True):
            words.append(f"The native gate's exit ({r['rule']} at {r['threshold']:g}) leaves at mean depth "
                         f"{_ci(r['mean_depth'], r['depth_lo'], r['depth_hi'])}, before the flip depth on "
                         f"{_ci(100 * r['share_before_flip'], 100 * r['before_lo'], 100 * r['before_hi'], 0)} % "
                         f"of tokens.")
    if meta.get("not_traced"):
        words.append(f"Causal tracing not run: {meta['not_traced']}.")
        return words
    tr = frames["trace"]
    kept, total = meta.get("traced_kept", 0), meta.get("traced", 0)
    if not tr.height:
        words.append(f"Causal tracing: none of the {total} traced sequences is answered both ways "
                     "(LD_clean > 0 > LD_corrupt), nothing to normalise.")
        return words
    ans = tr.filter(pl.col("position") == "answer").sort("loop")
    half = ans.filter(pl.col("restored") >= 0.5)
    first = int(half["loop"].min()) if half.height else None  # type: ignore[arg-type]
    at1 = ans.filter(pl.col("loop") == 1)
    fl = tr.filter((pl.col("position") == "flipped") & (pl.col("loop") == 1))
    txt = (f"Causal tracing on {kept} of {total} traced sequences (answered both ways; "
           f"{meta.get('untraced', 0)} without an answer-changing substitution): patching the clean state at the "
           f"answer position restores ")
    txt += (f"half of the logit difference from loop {first} on" if first is not None
            else "less than half of the logit difference at every loop")
    if at1.height:
        r = at1.row(0, named=True)
        txt += f" ({_ci(r['restored'], r['lo'], r['hi'])} at loop 1"
        if fl.height:
            q = fl.row(0, named=True)
            txt += f"; the substituted position at loop 1: {_ci(q['restored'], q['lo'], q['hi'])}"
        txt += ")"
    words.append(txt + ".")
    gp = frames["gate_patch"]
    if gp.height:
        ex = gp.filter((pl.col("measure") == "exit_depth") & (pl.col("patch") == "gate_input"))
        if ex.height:
            r0 = ex.row(0, named=True)
            best = ex.sort("shift", descending=r0["clean"] > r0["corrupt"]).row(0, named=True)
            words.append(f"Exit-gate patching ({r0['rule']}): the corruption moves the native exit depth at the "
                         f"answer from {r0['clean']:.2f} (clean) to {r0['corrupt']:.2f}; the clean gate input at "
                         f"loop {best['loop']} alone shifts it by "
                         f"{_ci(best['shift'], best['shift_lo'], best['shift_hi'])} loops.")
    return words


__all__ = ["FLIP_SCHEMA", "GATE_PATCH_SCHEMA", "ROLES", "TRACE_SCHEMA", "TRACE_TABLES", "empty_trace_frames",
           "exit_rule_depths", "expected_depth", "flip_depth", "flip_depth_table", "gate_patch_table",
           "halting_distribution", "native_exit", "restored_fraction", "role_values", "trace_table",
           "trace_words", "traced_mask"]
