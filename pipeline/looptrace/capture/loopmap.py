"""The ``loopmap`` stage's library: the loop map of a trained model measured on a small fixed sample, at a bounded
cost, on every default model (SPEC §2b; issue 27).

``dump.contraction`` stores ρ_t and the FTLE for every dumped token but costs 26–98× a plain dump (docs/dump.md), so
it is off by default and nothing about the loop map would appear in a default run. This stage instead loads the
trained checkpoint and measures, on ``loopmap.sequences`` sequences of ``loopmap.split`` (the first ones of the split,
drawn with the checkpoint's own data seed, so the sample is fixed):

1. ρ_t, its upper bound ρ̄_t and the FTLE per token and loop (:func:`looptrace.capture.contraction.contraction_stats`:
   the exact top singular value of each token's Jacobian block from S·d VJPs up to ``loopmap.exact_width``, a
   power-method estimate beyond it; Benettin [BE] through the model's loop step), and from them, with the
   torch-free functions of :mod:`looptrace.diagnose.loopmap`: the regime in words with bootstrap intervals, the
   share of (token, loop) with ρ_t < 1, the certified fixed-point exit's operating points ([BA], from ρ̄_t; beyond
   ``exact_width`` the *estimated* fixed-point exit, from ρ_t) beside fixed depth and two post-hoc threshold
   rules on the same sample (``rel_step``, ``entropy``; thresholds not calibrated on val — the comparison shows
   where the certificate sits, not a deployable operating point) with the Pareto front over all of them, and the
   failure-prediction AUC table (FTLE, ρ, rel_step, entropy for trajectory vs readout failures, SPEC §7);
2. intervention windows (:mod:`looptrace.capture.interventions`): noise of each relative scale and activation
   patching at each loop k, loops k+1..T re-run; per loop j after it the median and central interval over tokens of
   the state effect e_j, its linearised prediction ê_j (the JVP chain J^j δ), the readout KL, and the share of
   tokens whose argmax flipped (bootstrap interval over sequences); the window length of each (SPEC §2b).

Tables are written by the stage (:mod:`looptrace.stages.loopmap`), figures by :mod:`looptrace.capture.loopmap_plots`.
The cost is bounded by the sample: ``sequences`` × T × S·d VJPs for the exact ρ_t (beyond ``exact_width``:
(2·``power_iters`` + 1) S-position JVP/VJP calls), and a few forwards per intervention (docs/loopmap.md states the
measured cost).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import polars as pl
import torch
from tqdm.auto import tqdm

from looptrace.capture.contraction import ContractionConfig, contraction_stats
from looptrace.capture.interventions import InterventionConfig, intervene, patch_donors, window_summary
from looptrace.config import ConfigError, InputError, MissingInputError
from looptrace.diagnose.loopmap import (
    AUC_SCHEMA,
    LoopMapConfig,
    auc_sentences,
    certified_exit,
    certified_frontier,
    failure_auc,
    regime,
)
from looptrace.intervals import Resampler
from looptrace.models.interface import LoopedModelAdapter, LoopedTransformerAdapter
from looptrace.rules.scoring import pareto_mask
from looptrace.signals.certified import certified_bound
from looptrace.signals.steps import step_metrics
from looptrace.tasks import SPLITS, make_task
from looptrace.tasks.base import IGNORE

#: Measures of an intervention, per loop j after it (SPEC §2b "intervention window").
MEASURES = ("state", "linear", "kl", "flip")
#: The fixed-point exit's name in ``frontier.parquet``: certified (ρ̄_t, an upper bound; d_model ≤ exact_width) or
#: estimated (the power-method ρ_t, a lower bound; wider models).
CERTIFIED_RULE, ESTIMATED_RULE = "certified_fixed_point", "estimated_fixed_point"

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


@dataclass(frozen=True)
class LoopmapConfig:
    """``loopmap`` section of params.yaml (SPEC §2b; docs/loopmap.md).

    Attributes:
        split: the split the fixed sample is drawn from (the checkpoint's data seed for it).
        sequences: sequences in the sample (the first ones of the split): the stage's cost is linear in it.
        batch_size: sequences per forward / JVP batch (bounds memory; the outputs do not depend on it: every
            random draw is per sequence and a patch donor is drawn over the whole sample).
        power_iters: power-method iterations for ρ_t per loop (warm-started from the previous loop's vector), for a
            model wider than ``exact_width``.
        position_chunk: one-position tangents (one-hot cotangents) per vmapped JVP (VJP).
        exact_width: the widest d_model whose Jacobian blocks are read whole: exact ρ_t and its upper bound, the
            *certified* fixed-point exit; a wider model gets the power-method estimate and the *estimated* exit
            (SPEC §2b).
        loops: intervention loops k (0 = perturb h_0); those ≥ T of a model are skipped (and listed in metrics).
        scales: relative noise scales s of the noise interventions (‖δ_i‖ = s·‖h_k[i]‖).
        patch: also patch each token's state with another sequence's at the same position and loop.
        window_threshold: the state effect (and its linearised prediction) below which a perturbation is gone.
        kl_threshold: the readout KL (nats) below which it is gone.
        flip_threshold: the share of flipped argmaxes below which it is gone.
        eps: thresholds ε of the certified exit, also those of the post-hoc ``rel_step`` rule.
        entropy_quantiles: thresholds of the post-hoc ``entropy`` rule: this many quantiles of the sample's entropy.
        delta: |median final FTLE| below this (interval included) reads as marginal.
        n_boot: bootstrap resamples over sequences (regime, AUC, flip share; 0 = no intervals).
        level: interval coverage (also of the central interval over tokens).
        min_class: fewest failures (and non-failures) on the sample for a failure AUC (else NaN; one failure
            gives a falsely narrow interval).
        dpi: figure resolution (figures are ≤ 1400 px wide at any dpi).
    """

    split: str = "test"
    sequences: int = 128
    batch_size: int = 64
    power_iters: int = 2
    position_chunk: int = 16
    exact_width: int = 256
    loops: tuple[int, ...] = (1, 3)
    scales: tuple[float, ...] = (0.01, 0.1)
    patch: bool = True
    window_threshold: float = 0.1
    kl_threshold: float = 0.01
    flip_threshold: float = 0.01
    eps: tuple[float, ...] = (0.3, 0.1, 0.03, 0.01, 0.003, 0.001)
    entropy_quantiles: int = 9
    delta: float = 0.02
    n_boot: int = 200
    level: float = 0.95
    min_class: int = 5
    dpi: int = 100

    def __post_init__(self) -> None:
        if self.split not in SPLITS:
            raise ConfigError(f"loopmap.split must be one of {', '.join(SPLITS)}, got {self.split!r}")
        for key in ("sequences", "batch_size", "power_iters", "position_chunk", "exact_width", "min_class", "dpi"):
            if getattr(self, key) < 1:
                raise ConfigError(f"loopmap.{key} must be >= 1, got {getattr(self, key)}")
        if self.patch and self.sequences < 2:
            raise ConfigError("loopmap.patch needs sequences >= 2 (a token is patched with another sequence's); "
                              "set patch: false or raise it")
        if any(k < 0 for k in self.loops):
            raise ConfigError(f"loopmap.loops must be >= 0, got {list(self.loops)}")
        if any(not s >= 0 for s in self.scales):
            raise ConfigError(f"loopmap.scales must be >= 0, got {list(self.scales)}")
        for key in ("window_threshold", "kl_threshold", "flip_threshold"):
            if not getattr(self, key) >= 0:
                raise ConfigError(f"loopmap.{key} must be >= 0, got {getattr(self, key)}")
        if self.entropy_quantiles < 1:
            raise ConfigError(f"loopmap.entropy_quantiles must be >= 1, got {self.entropy_quantiles}")
        if not 0 < self.level < 1:
            raise ConfigError(f"loopmap.level must be in (0, 1), got {self.level}")
        if self.n_boot < 0:
            raise ConfigError(f"loopmap.n_boot must be >= 0, got {self.n_boot}")
        LoopMapConfig(eps=tuple(self.eps), delta=self.delta)  # its own checks (eps > 0, delta >= 0)

    def diagnoses(self, seed: int) -> LoopMapConfig:
        """The :class:`~looptrace.diagnose.loopmap.LoopMapConfig` of the regime / frontier / AUC functions."""
        return LoopMapConfig(eps=tuple(self.eps), delta=self.delta, n_boot=self.n_boot, level=self.level, seed=seed,
                             min_class=self.min_class)

    def interventions(self, n_loops: int, seed: int) -> list[InterventionConfig]:
        """The interventions run on a model with T = ``n_loops`` (loops k ≥ T skipped), in table order."""
        out = []
        for k in self.loops:
            if k >= n_loops:
                continue
            out += [InterventionConfig(loop=k, kind="noise", scale=float(s), threshold=self.window_threshold,
                                       seed=seed) for s in self.scales]
            if self.patch:
                out.append(InterventionConfig(loop=k, kind="patch", scale=float("nan"),
                                              threshold=self.window_threshold, seed=seed))
        return out


def no_loop_step(adapter: LoopedModelAdapter) -> str | None:
    """Why the adapter's loop map cannot be differentiated here (None = it can): no loop step, or loop memory
    (the step then reads the earlier loops' outputs: the map is not h_{t−1} ↦ h_t alone)."""
    if type(adapter).loop_step is LoopedModelAdapter.loop_step:
        return f"adapter {type(adapter).__name__} exposes no loop step"
    cfg = getattr(getattr(adapter, "model", None), "cfg", None)
    if getattr(cfg, "loop_memory", False):
        return "the model has loop memory ([RT]): its step reads earlier loops' outputs, not a map h_{t-1} -> h_t"
    return None


def measure(adapter: LoopedModelAdapter, tokens: np.ndarray, targets: np.ndarray, cfg: LoopmapConfig, seed: int,
            progress: bool = True) -> dict:
    """Run the sample through the model: per-(token, loop) arrays and every intervention's per-token effects.

    Every random draw is keyed by the sequence's index in the sample (the contraction's start vectors, the noise) or
    drawn once over the whole sample (the patch donors, :func:`~looptrace.capture.interventions.patch_donors`), so
    the result does not depend on ``cfg.batch_size`` beyond the rounding of batched kernels. A batch's states are
    computed in one forward together with its patch donors' (a donor with the token's own prefix then gives δ = 0
    exactly, as within one batch).

    Args:
        adapter: a model with a loop step (:func:`no_loop_step` is None).
        tokens: [sequence, seq] input ids.
        targets: [sequence, seq] target ids, :data:`~looptrace.tasks.base.IGNORE` where not scored.
        cfg: the section.
        seed: ``base.seed`` (tangents, noise, patching permutation).
        progress: show a progress bar.

    Returns:
        ``rho`` (ρ_t: exact up to ``cfg.exact_width``, else the power-method estimate), ``rho_bound`` (its upper
        bound ρ̄_t; NaN beyond ``exact_width``), ``ftle``, ``rel_step``, ``entropy``, ``correct`` [token, loop];
        ``sequence`` [token]; ``exact`` (bool: d_model ≤ ``exact_width``); ``interventions``: list of
        (:class:`InterventionConfig`, measure -> [token, T − k], and ``delta_norm`` [token] ‖δ‖) in
        :meth:`LoopmapConfig.interventions` order. Tokens are the scored positions, sequence-major.
    """
    n = tokens.shape[0]
    T = adapter.info.n_loops
    ccfg = ContractionConfig(power_iters=cfg.power_iters, position_chunk=cfg.position_chunk, seed=seed,
                             exact_width=cfg.exact_width)
    icfgs = cfg.interventions(T, seed)
    # each patch's donors, drawn once over the whole sample (not per batch: the batching changes nothing)
    donors = {i: patch_donors(np.arange(n), c.seed, c.loop) for i, c in enumerate(icfgs) if c.kind == "patch"}
    parts: defaultdict[str, list[np.ndarray]] = defaultdict(list)  # the Returns' [token, loop] / [token] arrays
    effects: list[dict[str, list[np.ndarray]]] = [{m: [] for m in (*MEASURES, "delta_norm")} for _ in icfgs]
    bounds = np.array_split(np.arange(n), max(1, -(-n // cfg.batch_size)))  # near-equal batches
    for rows in tqdm(bounds, desc="loop map", disable=None if progress else True, leave=False):
        B = len(rows)
        extra = np.setdiff1d(np.concatenate([d[rows] for d in donors.values()]), rows) if donors else rows[:0]
        run = np.concatenate([rows, extra])  # the batch, then the donors it lacks: one forward
        at = {int(r): j for j, r in enumerate(run)}
        tgt = targets[rows]
        mask = tgt != IGNORE  # [B, S]
        st = adapter.states(torch.from_numpy(tokens[run]).to(adapter.device))
        h0_all, hid_all = st.hidden_init, st.hidden
        h0, hidden = h0_all[:B], hid_all[:B]

        def step(h: torch.Tensor, t: int, h0: torch.Tensor = h0) -> torch.Tensor:
            return adapter.loop_step(h, h0, t)

        # exact blocks only at the positions some sequence of the batch scores (the others are dropped below)
        stats = contraction_stats(step, h0, hidden, ccfg, rows=rows, positions=np.flatnonzero(mask.any(axis=0)))
        sel = torch.from_numpy(mask).to(h0.device)
        parts["rho"].append(stats["contraction"][sel].cpu().numpy())
        parts["rho_bound"].append(stats["contraction_bound"][sel].cpu().numpy())
        parts["ftle"].append(stats["ftle"][sel].cpu().numpy())
        hid = hidden[sel].double().cpu().numpy()  # [token, loop, d]
        parts["rel_step"].append(step_metrics(hid, h0[sel].double().cpu().numpy())["rel_step"])
        ent, arg = [], []
        for t in range(T):
            logp = torch.log_softmax(adapter.readout(hidden[:, :, t], t).double(), -1)[sel]
            ent.append(-(logp.exp() * logp).sum(-1).cpu().numpy())
            arg.append(logp.argmax(-1).cpu().numpy())
        parts["entropy"].append(np.stack(ent, 1))
        parts["correct"].append(np.stack(arg, 1) == tgt[mask][:, None])
        parts["sequence"].append(np.broadcast_to(rows[:, None], mask.shape)[mask])
        for i, (icfg, acc) in enumerate(zip(icfgs, effects, strict=True)):
            donor = None
            if i in donors:  # the donors' states after loop k, from the same forward
                idx = torch.as_tensor([at[int(d)] for d in donors[i][rows]], device=h0.device)
                donor = (h0_all if icfg.loop == 0 else hid_all[:, :, icfg.loop - 1])[idx]
            out = intervene(step, h0, hidden, icfg, readout=lambda h, t: adapter.readout(h, t), rows=rows,
                            donor=donor)
            for m in (*MEASURES, "delta_norm"):
                acc[m].append(out[m][sel].cpu().numpy())
    res: dict = {k: np.concatenate(v) for k, v in parts.items()}
    res["exact"] = ccfg.exact(int(hid_all.shape[-1]))
    res["interventions"] = [(icfg, {m: np.concatenate(acc[m]).astype(np.float64) for m in (*MEASURES, "delta_norm")})
                            for icfg, acc in zip(icfgs, effects, strict=True)]
    return res


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
        return CERTIFIED_RULE, raw["rho_bound"]
    return ESTIMATED_RULE, raw["rho"]


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
    dcfg = cfg.diagnoses(seed)
    reg = regime(raw["ftle"][:, -1], raw["rho"], raw["sequence"], dcfg)
    rho = raw["rho"].astype(np.float64)
    preds = {"ftle": raw["ftle"][:, -1].astype(np.float64), "contraction": rho.mean(axis=1),
             "rel_step": raw["rel_step"][:, -1].astype(np.float64), "entropy": raw["entropy"][:, -1]}
    auc = failure_auc(preds, raw["correct"], raw["sequence"], dcfg)
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
    estimated = bool(fr.filter(pl.col("rule") == ESTIMATED_RULE).height)
    cert = fr.filter(pl.col("rule") == (ESTIMATED_RULE if estimated else CERTIFIED_RULE))
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


def load_sample(train_dir: Path | str, cfg: LoopmapConfig, device: str, name: str
                ) -> tuple[LoopedTransformerAdapter, np.ndarray, np.ndarray]:
    """The trained checkpoint and the first ``cfg.sequences`` sequences of its ``cfg.split`` (its data seed).

    Raises:
        MissingInputError: no ``model.pt`` (names the stage that writes it).
        InputError: the checkpoint records no task or data seed for the split.
    """
    ckpt = Path(train_dir) / "model.pt"
    if not ckpt.is_file():
        raise MissingInputError(f"checkpoint '{ckpt}' not found; run `dvc repro train` first")
    adapter = LoopedTransformerAdapter.from_checkpoint(ckpt, device=device, name=name)
    extra = adapter.info.extra
    seeds = extra.get("data_seeds") or {}
    if "task" not in extra or cfg.split not in seeds:
        raise InputError(f"checkpoint '{ckpt}' records no task or data seed for split '{cfg.split}'; retrain with "
                         "the current train stage")
    spec = dict(extra["task"])
    task = make_task(spec.pop("name"), spec)
    data = task.dataset(cfg.split, cfg.sequences, int(seeds[cfg.split]))
    return adapter, np.asarray(data.tokens, dtype=np.int64), np.asarray(data.targets)


def empty_frames() -> dict[str, pl.DataFrame]:
    """The output tables with no rows (a model whose loop map cannot be differentiated, :func:`no_loop_step`)."""
    return {"regime": pl.DataFrame(schema=REGIME_SCHEMA), "per_loop": pl.DataFrame(schema=PER_LOOP_SCHEMA),
            "frontier": pl.DataFrame(schema=FRONTIER_SCHEMA),
            "auc": pl.DataFrame(schema={"model": pl.String, **AUC_SCHEMA}),
            "windows": pl.DataFrame(schema=WINDOWS_SCHEMA), "window_length": pl.DataFrame(schema=WINDOW_LENGTH_SCHEMA)}


def loopmap_model(train_dir: Path | str, cfg: LoopmapConfig, seed: int, device: str = "cpu", name: str | None = None,
                  progress: bool = True) -> tuple[dict[str, pl.DataFrame], list[str], dict]:
    """The whole stage for one model: load, measure, tabulate.

    Args:
        train_dir: ``artifacts/train/<model>``.
        cfg: the ``loopmap`` section.
        seed: ``base.seed``.
        device: torch device.
        name: the model's name (default: the directory's).
        progress: show a progress bar.

    Returns:
        (name -> frame, summary sentences, metrics: T, sample size, intervention loops skipped, and why nothing was
        measured when the model has no differentiable loop map).
    """
    name = name or Path(train_dir).name
    adapter, tokens, targets = load_sample(train_dir, cfg, device, name)
    T = adapter.info.n_loops
    meta = {"n_loops": T, "sequences": int(tokens.shape[0]),
            "skipped_loops": [k for k in cfg.loops if k >= T], "not_measured": no_loop_step(adapter)}
    if meta["not_measured"]:
        return empty_frames(), [f"Loop map not measured: {meta['not_measured']}."], meta
    raw = measure(adapter, tokens, targets, cfg, seed, progress)
    frames, words = loopmap_tables(name, raw, cfg, seed, T)
    meta["regime"] = frames["regime"].row(0, named=True)
    return frames, words, meta


def write_loopmap(out_dir: Path | str, frames: dict[str, pl.DataFrame], words: list[str], metrics: dict,
                  model: str, dpi: int) -> None:
    """Write ``<name>.parquet`` per frame, ``summary.md``, ``rho_ftle.png``, ``windows.png`` and ``metrics.json``
    atomically into ``out_dir`` (:func:`looptrace.io.artifacts.atomic_dir`; figures only when measured)."""
    import json

    from looptrace.capture.loopmap_plots import plot_rho_ftle, plot_windows
    from looptrace.io.artifacts import atomic_dir, jsonable
    from looptrace.io.parquet import write_parquet

    with atomic_dir(out_dir) as tmp:
        for key, df in frames.items():
            write_parquet(df, tmp / f"{key}.parquet")
        (tmp / "summary.md").write_text(f"# Loop map: {model}\n\n" + "\n\n".join(words) + "\n")
        if frames["per_loop"].height:
            plot_rho_ftle(frames["per_loop"], model, tmp / "rho_ftle.png", dpi)
        if frames["windows"].height:
            plot_windows(frames["windows"], frames["window_length"], model, tmp / "windows.png", dpi)
        (tmp / "metrics.json").write_text(json.dumps(jsonable(metrics), indent=2, allow_nan=True) + "\n")


__all__ = ["CERTIFIED_RULE", "ESTIMATED_RULE", "FRONTIER_SCHEMA", "LoopmapConfig", "MEASURES", "PER_LOOP_SCHEMA",
           "REGIME_SCHEMA", "WINDOWS_SCHEMA", "WINDOW_LENGTH_SCHEMA", "empty_frames", "fixed_point_rule",
           "frontier_table", "load_sample", "loopmap_model", "loopmap_tables", "measure", "no_loop_step",
           "per_loop_table", "summary_words", "threshold_points", "window_tables", "write_loopmap"]
