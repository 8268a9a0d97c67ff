"""The report's loop-map section: what the ``loopmap`` stage measured on every model
(``artifacts/loopmap/<model>/``, docs/loopmap.md) — the regime per model with its intervals, the certified
fixed-point exit against the sample's Pareto front, the intervention windows — and one figure by loop: the local
contraction ρ_t, the finite-time Lyapunov exponent λ_t ([LY], SPEC §2b) and the decay of a noise intervention
with its linearised prediction ‖J^j δ‖/‖δ‖, per task × regime (mean over seeds with the across-seed 95 % band,
the report's one protocol: :func:`looptrace.report.plotting.seed_band`).

Every number is read from the stage's tables; nothing is recomputed here.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import polars as pl

from looptrace.estimates import fmt_ci
from looptrace.io.artifacts import read_parquet
from looptrace.loopmap.tabulate import TABLES
from looptrace.rules.certified import CERTIFIED, ESTIMATED

INTRO = ("The loop map h_t = f(h_{t−1}) of every model on a fixed sample of test sequences (the loopmap stage, "
         "docs/loopmap.md): its regime from the finite-time Lyapunov exponent λ_T (median over sequences, 95 % "
         "bootstrap interval) and the share of (token, loop) pairs whose local contraction ρ_t (top singular value "
         "of the position's Jacobian block) is below 1; the certified fixed-point exit (Banach: exit when "
         "‖Δ_t‖ρ̄_t/(1 − ρ̄_t) ≤ ε‖h_t‖, ρ̄_t an upper bound of that block's norm; \"estimated\" where the model is too "
         "wide for one and ρ_t is a power-method estimate) with the share of tokens it certifies and whether any of "
         "its points lies on the sample's Pareto front beside fixed depth and two post-hoc rules; and how many loops "
         "a perturbation of h_k lives (window: loops until its median relative effect on the state falls below the "
         "threshold; \"> j\" = not within the j loops left).")

COLUMNS = (("model", "model"), ("regime", "regime"), ("ftle_text", "λ_T (FTLE)"),
           ("share_text", "share ρ_t < 1 (%)"), ("certified_text", "certified exit: share certified, on front"),
           ("noise_window", "noise window (state)"), ("patch_window", "patch window (state)"))


def load_loopmap(root: Path | str, models: list[str]) -> dict[str, pl.DataFrame] | None:
    """The loopmap stage's tables of ``models`` under ``root`` (the artifacts root), concatenated per table;
    None when no model has them (the stage did not run)."""
    parts: dict[str, list[pl.DataFrame]] = {t: [] for t in TABLES}
    for m in models:
        d = Path(root) / "loopmap" / m
        for t in TABLES:
            if (d / f"{t}.parquet").is_file():
                parts[t].append(read_parquet(d / f"{t}.parquet"))
    if not parts["regime"]:
        return None
    return {t: pl.concat(v, how="diagonal_relaxed") for t, v in parts.items() if v}


def _window_text(wl: pl.DataFrame | None, model: str, kind: str) -> str:
    """The state window of ``kind`` interventions at the first loop k the stage perturbed (smallest scale for
    noise), at the first state threshold: ``"w"`` or ``"> horizon"``; "—" when not measured."""
    if wl is None or not wl.height:
        return "—"
    d = wl.filter((pl.col("model") == model) & (pl.col("kind") == kind) & (pl.col("measure") == "state"))
    if not d.height:
        return "—"
    r = d.sort("loop", "scale", "threshold", descending=[False, False, True], nulls_last=True).row(0, named=True)
    where = f"k = {r['loop']}" + (f", scale {r['scale']:g}" if r["scale"] is not None else "")
    w = f"{r['window']}" if r["reached"] else f"> {r['horizon']}"
    return f"{w} loops ({where}, threshold {r['threshold']:g})"


def loopmap_rows(lm: dict[str, pl.DataFrame]) -> pl.DataFrame:
    """One row per model with the :data:`COLUMNS` text columns."""
    fr, wl = lm.get("frontier"), lm.get("window_length")
    rows = []
    for r in lm["regime"].iter_rows(named=True):
        m = r["model"]
        cert = "—"
        if fr is not None and fr.height:
            c = fr.filter((pl.col("model") == m) & (pl.col("rule").is_in([CERTIFIED.name, ESTIMATED.name])))
            if c.height:
                best = float(np.nanmax(c["share_certified"].to_numpy()))
                cert = f"{100 * best:.0f} % at most; {'on' if bool(c['pareto'].any()) else 'not on'} the front"
                if bool((c["rule"] == ESTIMATED.name).any()):
                    cert = f"estimated, not certified: {cert}"
        rows.append({"model": m, "regime": r["regime"],
                     "ftle_text": fmt_ci(r["ftle_median"], r["ftle_lo"], r["ftle_hi"], 3),
                     "share_text": fmt_ci(r["share_rho_below_1"], r["share_lo"], r["share_hi"], 0, 100.0),
                     "certified_text": cert, "noise_window": _window_text(wl, m, "noise"),
                     "patch_window": _window_text(wl, m, "patch")})
    return pl.DataFrame(rows, schema={c: pl.String for c, _ in COLUMNS})


def per_loop_values(lm: dict[str, pl.DataFrame], models: list[str], column: str, T: int) -> np.ndarray:
    """[seed, loop] values of one ``per_loop`` column (``rho_median``, ``ftle_median``) for ``models`` (NaN where
    a model has no row)."""
    out = np.full((len(models), T), np.nan)
    pl_ = lm.get("per_loop")
    if pl_ is None:
        return out
    for s, m in enumerate(models):
        d = pl_.filter(pl.col("model") == m)
        loops = d["loop"].to_numpy().astype(int)
        keep = (loops >= 1) & (loops <= T)
        out[s, loops[keep] - 1] = d[column].to_numpy().astype(np.float64)[keep]
    return out


def decay_values(lm: dict[str, pl.DataFrame], models: list[str], measure: str, T: int
                 ) -> tuple[np.ndarray, str | None]:
    """[seed, j − 1] median ``measure`` (``state``: the measured relative effect; ``linear``: its linearised
    prediction) of the noise intervention at the smallest scale and the first perturbed loop k, j = 1..T loops
    after it; and the label of that intervention (None when none was measured)."""
    out = np.full((len(models), T), np.nan)
    w = lm.get("windows")
    if w is None or not w.height:
        return out, None
    noise = w.filter((pl.col("kind") == "noise") & (pl.col("model").is_in(models)))
    if not noise.height:
        return out, None
    k = int(noise["loop"].min())  # type: ignore[arg-type]
    scale = float(noise.filter(pl.col("loop") == k)["scale"].min())  # type: ignore[arg-type]
    for s, m in enumerate(models):
        d = noise.filter((pl.col("model") == m) & (pl.col("loop") == k) & (pl.col("scale") == scale)
                         & (pl.col("measure") == measure) & (pl.col("statistic") == "median"))
        j = d["j"].to_numpy().astype(int)
        keep = (j >= 1) & (j <= T)
        out[s, j[keep] - 1] = d["value"].to_numpy().astype(np.float64)[keep]
    return out, f"noise of relative scale {scale:g} at loop k = {k}"


TRACE_INTRO = ("Where the answer forms across loops (the loopmap stage's causal tracing, SPEC §2b [ROME]): per test "
               "sequence one token substituted so that the answer at its last scored position changes; the clean "
               "run's state copied into the corrupted run at one loop and position, the loops after it re-run, and "
               "the share of the answer's logit difference that comes back (1 = all); mean over the sequences the "
               "model answers both ways, 95 % bootstrap interval over sequences. Flip depth: the loop from which a "
               "token's argmax never changes again, and how many tokens the native gate's exit leaves before it.")

TRACE_COLUMNS = (("model", "model"), ("flip_text", "flip depth F (mean)"),
                 ("late_text", "tokens flipping after loop 1 (%)"),
                 ("answer_text", "answer position: restored at loop 1; ≥ ½ from loop"),
                 ("flipped_text", "substituted position: restored at loop 1"),
                 ("gate_text", "native exit depth: clean → corrupt; gate input patched"))


def _restored(tr: pl.DataFrame, model: str, position: str, loop: int) -> str:
    d = tr.filter((pl.col("model") == model) & (pl.col("position") == position) & (pl.col("loop") == loop))
    if not d.height:
        return "—"
    r = d.row(0, named=True)
    return fmt_ci(r["restored"], r["lo"], r["hi"], 2)


def trace_rows(lm: dict[str, pl.DataFrame]) -> pl.DataFrame | None:
    """One row per model with the :data:`TRACE_COLUMNS` text columns; None when no model has a flip table."""
    fd, tr, gp = lm.get("flip_depth"), lm.get("trace"), lm.get("gate_patch")
    if fd is None or not fd.height:
        return None
    rows = []
    for m in fd["model"].unique(maintain_order=True).to_list():
        f = fd.filter((pl.col("model") == m) & (pl.col("rule") == "flip_depth")).row(0, named=True)
        one = fd.filter((pl.col("model") == m) & (pl.col("rule") == "fixed") & (pl.col("threshold") == 1.0))
        late = "—"
        if one.height:
            o = one.row(0, named=True)
            late = fmt_ci(o["share_before_flip"], o["before_lo"], o["before_hi"], 0, 100.0)
        answer = flipped = "—"
        if tr is not None and tr.filter(pl.col("model") == m).height:
            ans = tr.filter((pl.col("model") == m) & (pl.col("position") == "answer") & (pl.col("restored") >= 0.5))
            first = f"loop {int(ans['loop'].min())}" if ans.height else "never"  # type: ignore[arg-type]
            answer = f"{_restored(tr, m, 'answer', 1)}; {first}"
            flipped = _restored(tr, m, "flipped", 1)
        gate = "—"
        if gp is not None:
            g = gp.filter((pl.col("model") == m) & (pl.col("measure") == "exit_depth")
                          & (pl.col("patch") == "gate_input"))
            if g.height:
                r0 = g.row(0, named=True)
                best = g.sort("shift", descending=r0["clean"] > r0["corrupt"]).row(0, named=True)
                gate = (f"{r0['clean']:.2f} → {r0['corrupt']:.2f}; loop {best['loop']}: "
                        f"{fmt_ci(best['shift'], best['shift_lo'], best['shift_hi'], 2)}")
        rows.append({"model": m, "flip_text": fmt_ci(f["mean_depth"], f["depth_lo"], f["depth_hi"], 2),
                     "late_text": late, "answer_text": answer, "flipped_text": flipped, "gate_text": gate})
    return pl.DataFrame(rows, schema={c: pl.String for c, _ in TRACE_COLUMNS})


def trace_map(lm: dict[str, pl.DataFrame], models: list[str], roles: tuple[str, ...], K: int) -> np.ndarray:
    """[seed, role, loop k = 0..K − 1] restored fraction of ``models`` (NaN where absent)."""
    out = np.full((len(models), len(roles), K), np.nan)
    tr = lm.get("trace")
    if tr is None:
        return out
    for s, m in enumerate(models):
        for i, r in enumerate(roles):
            d = tr.filter((pl.col("model") == m) & (pl.col("position") == r))
            k = d["loop"].to_numpy().astype(int)
            keep = (k >= 0) & (k < K)
            out[s, i, k[keep]] = d["restored"].to_numpy().astype(np.float64)[keep]
    return out


def flip_curve(lm: dict[str, pl.DataFrame], models: list[str], T: int) -> tuple[np.ndarray, np.ndarray]:
    """([seed, d] share of tokens with flip depth F > d for fixed depth d = 1..T, [seed] mean flip depth)."""
    share, mean = np.full((len(models), T), np.nan), np.full(len(models), np.nan)
    fd = lm.get("flip_depth")
    if fd is None:
        return share, mean
    for s, m in enumerate(models):
        d = fd.filter((pl.col("model") == m) & (pl.col("rule") == "fixed"))
        k = d["threshold"].to_numpy().astype(int)
        keep = (k >= 1) & (k <= T)
        share[s, k[keep] - 1] = d["share_before_flip"].to_numpy().astype(np.float64)[keep]
        f = fd.filter((pl.col("model") == m) & (pl.col("rule") == "flip_depth"))
        if f.height:
            mean[s] = float(f["mean_depth"][0])
    return share, mean


__all__ = ["COLUMNS", "INTRO", "TRACE_COLUMNS", "TRACE_INTRO", "decay_values", "flip_curve", "load_loopmap",
           "loopmap_rows", "per_loop_values", "trace_map", "trace_rows"]
