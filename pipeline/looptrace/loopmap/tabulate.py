"""The loopmap stage's tables from a measured sample (torch-free): ρ_t, λ_t and the FTLE per loop, the regime, the
certified (or estimated) fixed-point exit beside fixed depth and two post-hoc rules on the sample's Pareto front,
the failure AUCs and the intervention windows (SPEC §2b), and the summary's words. The report reads them by
:data:`TABLES`."""

from __future__ import annotations

import numpy as np
import polars as pl

from looptrace.intervals import Resampler
from looptrace.loopmap.config import LoopmapConfig
from looptrace.loopmap.diagnoses import (
    AUC_SCHEMA,
    auc_sentences,
    certified_exit,
    certified_frontier,
    failure_auc,
    regime,
)
from looptrace.rules.certified import CERTIFIED, ESTIMATED
from looptrace.rules.scoring import pareto_mask
from looptrace.signals.fixed_point import certified_bound

#: The stage's tables the report reads (``artifacts/loopmap/<model>/<name>.parquet``; the last three are
#: :mod:`looptrace.loopmap.trace_tables`').
TABLES = ("regime", "per_loop", "windows", "window_length", "frontier", "trace", "gate_patch", "flip_depth")
#: Measures of an intervention, per loop j after it (SPEC §2b "intervention window").
MEASURES = ("state", "linear", "kl", "flip")

PER_LOOP_SCHEMA = {"model": pl.String, "loop": pl.Int64, "rho_median": pl.Float64, "rho_lo": pl.Float64,
                   "rho_hi": pl.Float64, "share_rho_below_1": pl.Float64, "ftle_median": pl.Float64,
                   "ftle_lo": pl.Float64, "ftle_hi": pl.Float64, "growth_median": pl.Float64,
                   "growth_lo": pl.Float64, "growth_hi": pl.Float64, "accuracy": pl.Float64, "n_tokens": pl.Int64}
REGIME_SCHEMA = {"model": pl.String, "regime": pl.String, "ftle_median": pl.Float64, "ftle_lo": pl.Float64,
                 "ftle_hi": pl.Float64, "share_rho_below_1": pl.Float64, "share_lo": pl.Float64,
                 "share_hi": pl.Float64, "rho_median": pl.Float64, "n_sequences": pl.Int64, "n_tokens": pl.Int64,
                 "words": pl.String}
FRONTIER_SCHEMA = {"model": pl.String, "rule": pl.String, "threshold": pl.Float64, "mean_depth": pl.Float64,
                   "accuracy": pl.Float64, "share_certified": pl.Float64, "pareto": pl.Boolean}
WINDOWS_SCHEMA = {"model": pl.String, "kind": pl.String, "scale": pl.Float64, "loop": pl.Int64, "j": pl.Int64,
                  "measure": pl.String, "statistic": pl.String, "value": pl.Float64, "lo": pl.Float64,
                  "hi": pl.Float64, "n_tokens": pl.Int64}
WINDOW_LENGTH_SCHEMA = {"model": pl.String, "kind": pl.String, "scale": pl.Float64, "loop": pl.Int64,
                        "measure": pl.String, "threshold": pl.Float64, "window": pl.Int64, "horizon": pl.Int64,
                        "reached": pl.Boolean}


def _quantiles(x: np.ndarray, level: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Median and central ``level`` interval over axis 0 ([token, loop] -> 3 × [loop]); NaN-free input."""
    a = (1 - level) / 2
    return np.median(x, axis=0), np.quantile(x, a, axis=0), np.quantile(x, 1 - a, axis=0)


def per_loop_table(model: str, raw: dict, cfg: LoopmapConfig) -> pl.DataFrame:
    """ρ_t over tokens and λ_t over sequences per loop (median, central interval), share ρ_t < 1, accuracy, and the
    tangent's log growth at loop t alone, g_t = t·λ_t − (t − 1)·λ_{t−1} = log ‖J_t u_{t−1}‖ (λ_T is their mean: one
    strongly stretching first loop can make it positive while every later loop contracts)."""
    rho = raw["rho"].astype(np.float64)
    _, first = np.unique(raw["sequence"], return_index=True)
    ftle = raw["ftle"].astype(np.float64)[first]  # one λ_t per sequence
    rm, rl, rh = _quantiles(rho, cfg.level)
    fm, fl, fh = _quantiles(ftle, cfg.level)
    T = rho.shape[1]
    cum = ftle * np.arange(1, T + 1)  # Σ_{s≤t} log growth
    gm, gl, gh = _quantiles(np.diff(cum, axis=1, prepend=0.0), cfg.level)
    return pl.DataFrame({"model": [model] * T, "loop": np.arange(1, T + 1), "rho_median": rm, "rho_lo": rl,
                         "rho_hi": rh, "share_rho_below_1": (rho < 1).mean(axis=0), "ftle_median": fm,
                         "ftle_lo": fl, "ftle_hi": fh, "growth_median": gm, "growth_lo": gl, "growth_hi": gh,
                         "accuracy": raw["correct"].mean(axis=0),
                         "n_tokens": [rho.shape[0]] * T}, schema=PER_LOOP_SCHEMA)


def threshold_points(signal: np.ndarray, correct: np.ndarray, thresholds) -> list[dict]:
    """Operating points of "exit at the first t with signal_t ≤ τ, else T" (NaN never fires), one per τ."""
    n = len(correct)
    rows = []
    for tau in thresholds:
        d = certified_exit(signal, float(tau))
        rows.append({"threshold": float(tau), "mean_depth": float(d.mean()),
                     "accuracy": float(correct[np.arange(n), d - 1].mean())})
    return rows


def fixed_point_rule(raw: dict) -> tuple[str, np.ndarray]:
    """The fixed-point exit the sample supports and its ρ: ``certified_fixed_point`` with the upper bound ρ̄_t when
    the blocks were read whole (``raw["exact"]``), else ``estimated_fixed_point`` with the power-method ρ_t (a lower
    bound of the Jacobian norm: an estimate, never a certificate)."""
    if raw.get("exact", False):
        return CERTIFIED.name, raw["rho_bound"]
    return ESTIMATED.name, raw["rho"]


def frontier_table(model: str, raw: dict, cfg: LoopmapConfig) -> pl.DataFrame:
    """The certified (or, beyond ``exact_width``, estimated) fixed-point exit's points ([BA]) beside fixed depth and
    the post-hoc ``rel_step`` / ``entropy`` threshold rules on the same sample, with the Pareto front over all of
    them (``pareto``). ``share_certified`` is the share of tokens whose bound reaches ε (for the estimated exit: an
    estimate of it)."""
    correct = raw["correct"]
    T = correct.shape[1]
    rule, rho = fixed_point_rule(raw)
    bound = certified_bound(rho, raw["rel_step"])
    cert = certified_frontier(bound, correct, cfg.eps)
    rows = [{"rule": rule, "threshold": r["eps"], "mean_depth": r["mean_depth"],
             "accuracy": r["accuracy"], "share_certified": r["share_certified"]} for r in cert.iter_rows(named=True)]
    rows += [{"rule": "fixed", "threshold": float(d), "mean_depth": float(d),
              "accuracy": float(correct[:, d - 1].mean()), "share_certified": None} for d in range(1, T + 1)]
    rows += [{"rule": "rel_step", **r, "share_certified": None}
             for r in threshold_points(raw["rel_step"], correct, cfg.eps)]
    qs = np.quantile(raw["entropy"], np.linspace(0, 1, cfg.entropy_quantiles + 2)[1:-1])
    rows += [{"rule": "entropy", **r, "share_certified": None} for r in threshold_points(raw["entropy"], correct, qs)]
    front = pareto_mask(np.array([r["mean_depth"] for r in rows]), np.array([r["accuracy"] for r in rows]))
    return pl.DataFrame([{"model": model, **r, "pareto": bool(p)} for r, p in zip(rows, front, strict=True)],
                        schema=FRONTIER_SCHEMA)


def window_tables(model: str, raw: dict, cfg: LoopmapConfig, seed: int, n_loops: int
                  ) -> tuple[pl.DataFrame, pl.DataFrame]:
    """``windows`` (per intervention × measure × j: median and central interval over tokens; for ``flip`` the share
    of tokens flipped with a bootstrap interval over sequences) and ``window_length`` (the first j at or below the
    measure's threshold; ``horizon`` + 1 when never).

    A patched token whose donor's state equals its own (δ = 0: under causal attention, the same prefix) was not
    intervened on, and is left out of the patch's statistics (``n_tokens`` counts those kept); a noise intervention
    keeps every token (scale 0 is the size-0 intervention: every effect 0)."""
    thresholds = {"state": cfg.window_threshold, "linear": cfg.window_threshold, "kl": cfg.kl_threshold,
                  "flip": cfg.flip_threshold}
    rows, lengths = [], []
    for icfg, eff in raw["interventions"]:
        keep = eff["delta_norm"] > 0 if icfg.kind == "patch" else np.ones(len(eff["delta_norm"]), dtype=bool)
        rs = Resampler(raw["sequence"][keep], cfg.n_boot, seed, cfg.level) if cfg.n_boot and keep.any() else None
        key = {"model": model, "kind": icfg.kind, "scale": None if icfg.kind == "patch" else icfg.scale,
               "loop": icfg.loop}
        horizon = n_loops - icfg.loop
        for m in MEASURES:
            e = eff[m][keep]
            if not e.shape[0]:
                continue  # every patch donor equal to its token: nothing was intervened on
            if m == "flip":
                val = e.mean(axis=0)
                lo = hi = np.full(horizon, np.nan)
                if rs is not None:
                    lo, hi = rs.interval(rs.ratio(e.T))
                below = np.flatnonzero(val <= cfg.flip_threshold)
                win = int(below[0]) + 1 if below.size else horizon + 1
                stat = "share"
            else:
                s = window_summary(e, thresholds[m], cfg.level)
                val, lo, hi, win, stat = s["median"], s["lo"], s["hi"], s["window"], "median"
            rows += [{**key, "j": j + 1, "measure": m, "statistic": stat, "value": float(val[j]), "lo": float(lo[j]),
                      "hi": float(hi[j]), "n_tokens": int(e.shape[0])} for j in range(horizon)]
            lengths.append({**key, "measure": m, "threshold": float(thresholds[m]), "window": win,
                            "horizon": horizon, "reached": win <= horizon})
    return pl.DataFrame(rows, schema=WINDOWS_SCHEMA), pl.DataFrame(lengths, schema=WINDOW_LENGTH_SCHEMA)


def loopmap_tables(model: str, raw: dict, cfg: LoopmapConfig, seed: int, n_loops: int) -> tuple[dict, list[str]]:
    """Every output table of one model (name -> frame) and its summary sentences."""
    reg = regime(raw["ftle"][:, -1], raw["rho"], raw["sequence"], cfg, seed)
    rho = raw["rho"].astype(np.float64)
    preds = {"ftle": raw["ftle"][:, -1].astype(np.float64), "contraction": rho.mean(axis=1),
             "rel_step": raw["rel_step"][:, -1].astype(np.float64), "entropy": raw["entropy"][:, -1]}
    auc = failure_auc(preds, raw["correct"], raw["sequence"], cfg, seed)
    frontier = frontier_table(model, raw, cfg)
    windows, lengths = window_tables(model, raw, cfg, seed, n_loops)
    regime_row = {"model": model, **{k: reg[k] for k in REGIME_SCHEMA if k in reg}, "n_tokens": rho.shape[0]}
    frames = {"regime": pl.DataFrame([regime_row], schema=REGIME_SCHEMA),
              "per_loop": per_loop_table(model, raw, cfg), "frontier": frontier,
              "auc": auc.select(pl.lit(model).alias("model"), pl.all()),
              "windows": windows, "window_length": lengths}
    return frames, summary_words(frames, reg["words"], cfg.min_class)


def summary_words(frames: dict, regime_words: str, min_class: int = LoopmapConfig.min_class) -> list[str]:
    """The regime sentence, where the certified exit sits on the sample's front, and the state windows."""
    words = [regime_words]
    fr = frames["frontier"]
    estimated = bool(fr.filter(pl.col("rule") == ESTIMATED.name).height)
    cert = fr.filter(pl.col("rule") == (ESTIMATED.name if estimated else CERTIFIED.name))
    on = cert.filter(pl.col("pareto"))
    fired = cert["share_certified"].max()
    if estimated:
        words.append(f"Estimated fixed-point exit (not certified: ρ_t is a power-method estimate, a lower bound of "
                     f"the Jacobian norm, as d_model > loopmap.exact_width): {on.height} of its {cert.height} "
                     f"operating points on the sample's Pareto front (beside fixed depth, post-hoc rel_step and "
                     f"entropy thresholds); its bound reaches ε on up to {100 * (fired or 0):.0f} % of tokens.")
    else:
        words.append(f"Certified fixed-point exit (ρ̄_t an upper bound of the token's Jacobian norm): {on.height} of "
                     f"its {cert.height} operating points on the sample's Pareto front (beside fixed depth, post-hoc "
                     f"rel_step and entropy thresholds); it certifies up to {100 * (fired or 0):.0f} % of tokens.")
    wl = frames["window_length"].filter(pl.col("measure") == "state")
    lin = frames["window_length"].filter(pl.col("measure") == "linear")
    parts = []
    for r, q in zip(wl.iter_rows(named=True), lin.iter_rows(named=True), strict=True):
        what = "patch" if r["kind"] == "patch" else f"noise {r['scale']:g}"
        w = str(r["window"]) if r["reached"] else f"> {r['horizon']}"
        wq = str(q["window"]) if q["reached"] else f"> {q['horizon']}"
        parts.append(f"{what} at k = {r['loop']}: {w} (linearised {wq})")
    if parts:
        words.append(f"Intervention windows (loops until the median state effect ≤ {wl['threshold'][0]:g}): "
                     + "; ".join(parts) + ".")
    words += auc_sentences(frames["auc"], min_class)
    return words


def empty_frames() -> dict[str, pl.DataFrame]:
    """The output tables with no rows (a model whose loop map cannot be differentiated, :func:`no_loop_step`)."""
    return {"regime": pl.DataFrame(schema=REGIME_SCHEMA), "per_loop": pl.DataFrame(schema=PER_LOOP_SCHEMA),
            "frontier": pl.DataFrame(schema=FRONTIER_SCHEMA),
            "auc": pl.DataFrame(schema={"model": pl.String, **AUC_SCHEMA}),
            "windows": pl.DataFrame(schema=WINDOWS_SCHEMA), "window_length": pl.DataFrame(schema=WINDOW_LENGTH_SCHEMA)}


def window_summary(effect: np.ndarray, threshold: float, level: float = 0.95) -> dict:
    """Median and central ``level`` interval over tokens of an effect [token, J], and the window length.

    Returns:
        ``median``, ``lo``, ``hi`` [J] and ``window``: the smallest j (1-based) with median ≤ threshold, J + 1 if none.
    """
    e = np.asarray(effect, dtype=np.float64)
    a = (1 - level) / 2
    med = np.median(e, axis=0)
    below = np.flatnonzero(med <= threshold)
    return {"median": med, "lo": np.quantile(e, a, axis=0), "hi": np.quantile(e, 1 - a, axis=0),
            "window": int(below[0]) + 1 if below.size else e.shape[1] + 1}
