"""Loop-map diagnoses from a store dumped with ``dump.contraction`` (SPEC §2b): the certified fixed-point exit, the
model's regime in words, and how well the FTLE (and ρ, rel_step, entropy) predict the failures of SPEC §7.

Torch-free (an offline module): it reads the store's ``contraction`` / ``ftle`` arrays, the states (for
``rel_step``, :func:`looptrace.signals.steps.step_metrics`), ``argmax``, ``entropy`` and ``target``.

- **Certified exit** ([BA]): b_t = r_t·ρ̄_t/(1 − ρ̄_t) bounds ‖h_t − h*‖/‖h_t‖ when the loop map contracts with
  factor ρ̄_t < 1 (:func:`certified_bound`; NaN — never certified — where ρ̄_t ≥ 1), ρ̄_t = ``contraction_bound`` an
  upper bound of the token's Jacobian norm; the rule exits at the first t with b_t ≤ ε, else at T
  (:func:`certified_exit`). A store without that bound (d_model > ``dump.contraction.exact_width``: NaN) gets the
  *estimated* exit from ``contraction`` instead, named so (the power-method ρ_t is a lower bound: not a
  certificate). How often ρ_t < 1 holds is reported beside it, and said in words: on a model in the expanding
  (chaotic) regime the rule almost never fires, and that is a finding, not a silent censoring.
- **Regime** (:func:`regime`): from the final FTLE λ_T of each sequence (median, bootstrap interval over sequences)
  and the share of (token, loop) pairs with ρ_t < 1.
- **Failure prediction** (:func:`failure_auc`): ROC AUC (scikit-learn ``roc_auc_score``) of each per-token
  predictor, higher = more failure-prone, for *trajectory failures* (no loop 1..T right; negatives: every other
  token) and full-depth *readout failures* (some loop right, loop T wrong — the overthinking of a rule that always
  runs T loops; negatives: tokens right at T), with bootstrap intervals over sequences.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import polars as pl

from looptrace.config import ConfigError, InputError
from looptrace.intervals import Resampler
from looptrace.signals.certified import certified_bound
from looptrace.signals.steps import step_metrics

#: Predictors of :func:`failure_auc`, each per token: λ_T, mean ρ_t over loops, r_T, H_T.
PREDICTORS = ("ftle", "contraction", "rel_step", "entropy")
#: Failure kinds of :func:`failure_auc` (SPEC §7, at full depth).
FAILURES = ("trajectory", "readout")
AUC_SCHEMA = {"failure": pl.String, "predictor": pl.String, "auc": pl.Float64, "auc_lo": pl.Float64,
              "auc_hi": pl.Float64, "n_pos": pl.Int64, "n_neg": pl.Int64}
FRONTIER_SCHEMA = {"eps": pl.Float64, "mean_depth": pl.Float64, "accuracy": pl.Float64,
                   "share_certified": pl.Float64}


@dataclass(frozen=True)
class LoopMapConfig:
    """Parameters of the loop-map diagnoses.

    Attributes:
        eps: thresholds ε of the certified exit (relative distance to the fixed point).
        delta: |median λ_T| below this (in nats per loop, interval included) reads as *marginal*.
        n_boot: bootstrap resamples over sequences (0 = no intervals).
        level: interval coverage.
        seed: bootstrap seed.
        min_class: fewest tokens of each class (failures, non-failures) for an AUC: with fewer, the AUC is NaN —
            one failure makes the AUC the rank of one token and its bootstrap interval falsely narrow (a
            resample holds that token or not at all), seen on the default models (1 readout failure: "AUC 0.997
            [0.990, 1.000]").
    """

    eps: tuple[float, ...] = (0.3, 0.1, 0.03, 0.01, 0.003, 0.001)
    delta: float = 0.02
    n_boot: int = 200
    level: float = 0.95
    seed: int = 0
    min_class: int = 5

    def __post_init__(self) -> None:
        if not self.eps or any(not e > 0 for e in self.eps):
            raise ConfigError(f"loopmap.eps: give thresholds > 0, got {list(self.eps)}")
        if self.delta < 0:
            raise ConfigError(f"loopmap.delta must be >= 0, got {self.delta}")


def certified_exit(bound: np.ndarray, eps: float) -> np.ndarray:
    """Exit depth (1-based) of the certified rule: the first t with b_t ≤ ε, else T. [token] int64."""
    hit = np.asarray(bound) <= eps  # NaN never fires
    T = hit.shape[1]
    return np.where(hit.any(axis=1), hit.argmax(axis=1) + 1, T).astype(np.int64)


def certified_frontier(bound: np.ndarray, correct: np.ndarray, eps: Sequence[float]) -> pl.DataFrame:
    """One operating point per ε: mean exit depth, accuracy at the exit, share of tokens that exit certified."""
    rows = []
    n = len(correct)
    for e in eps:
        d = certified_exit(bound, e)
        fired = (np.asarray(bound) <= e).any(axis=1)
        rows.append({"eps": float(e), "mean_depth": float(d.mean()) if n else float("nan"),
                     "accuracy": float(correct[np.arange(n), d - 1].mean()) if n else float("nan"),
                     "share_certified": float(fired.mean()) if n else float("nan")})
    return pl.DataFrame(rows, schema=FRONTIER_SCHEMA)


def _weighted_median(x: np.ndarray, w: np.ndarray) -> float:
    keep = w > 0
    x, w = x[keep], w[keep]
    order = np.argsort(x, kind="stable")
    c = np.cumsum(w[order])
    return float(x[order][np.searchsorted(c, c[-1] / 2)])


def regime(ftle_final: np.ndarray, rho: np.ndarray, sequence: np.ndarray, cfg: LoopMapConfig) -> dict:
    """The model's regime from the final FTLE of each sequence and the share of ρ_t < 1 (SPEC §2b).

    Args:
        ftle_final: [token] λ_T of each token's sequence.
        rho: [token, loop] ρ_t.
        sequence: [token] sequence id (the bootstrap unit; λ_T is per sequence).
        cfg: δ, B, level, seed.

    Returns:
        ``regime`` (contracting | marginal | expanding), ``ftle_median`` / ``_lo`` / ``_hi``,
        ``share_rho_below_1`` / ``_lo`` / ``_hi``, ``rho_median``, ``n_sequences``, ``words`` (one sentence).
    """
    seq_ids, first = np.unique(sequence, return_index=True)
    lam = np.asarray(ftle_final, dtype=np.float64)[first]  # one λ_T per sequence
    below = (np.asarray(rho) < 1).mean(axis=1)  # per token: share of its loops with ρ_t < 1
    med = float(np.median(lam))
    share = float(below.mean())
    lo = hi = s_lo = s_hi = float("nan")
    if cfg.n_boot:
        rs = Resampler(sequence, cfg.n_boot, cfg.seed, cfg.level)
        # the unit order of the resampler is that of np.unique, as seq_ids
        meds = np.array([_weighted_median(lam, c) for c in rs.counts])
        lo, hi = (float(v[0]) for v in rs.interval(meds[:, None]))
        s_lo, s_hi = (float(v[0]) for v in rs.interval(rs.ratio(below)[:, None]))
    upper = hi if np.isfinite(hi) else med
    lower = lo if np.isfinite(lo) else med
    if upper < -cfg.delta and share > 0.5:
        name = "contracting"
    elif lower > cfg.delta:
        name = "expanding"
    else:
        name = "marginal"
    iv = "" if not np.isfinite(lo) else f" [{lo:.3f}, {hi:.3f}]"
    siv = "" if not np.isfinite(s_lo) else f" [{100 * s_lo:.0f}, {100 * s_hi:.0f}]"
    words = {"contracting": "contracts: perturbations die out loop after loop, so a convergence depth is well "
                            "defined and the certified exit can fire",
             # no claim about the certified exit here: it needs the per-token ρ_t < 1, which can hold on most
             # pairs while λ_T > 0 (one strongly stretching loop); its share is the next sentence
             "expanding": "is in the expanding (chaotic) regime: a perturbation grows over the T loops on "
                          "median, so a convergence depth is not guaranteed",
             "marginal": "is marginal: neither clearly contracting nor clearly expanding at this interval"}[name]
    if name == "marginal" and upper < -cfg.delta:
        # λ_T < 0 with its interval but ρ_t < 1 on at most half the pairs: the trajectory contracts over the T
        # loops while single loops stretch their top direction, so "neither" would misread the FTLE
        words = ("is marginal: it contracts over the T loops (λ_T < 0) but not loop by loop — most single loops "
                 "stretch their top direction (ρ_t ≥ 1), where the Banach certificate cannot apply")
    sentence = (f"The loop map {words} (median final FTLE {med:.3f}{iv} nats per loop over {len(seq_ids)} "
                f"sequences; ρ_t < 1 on {100 * share:.0f}{siv} % of (token, loop) pairs).")
    return {"regime": name, "ftle_median": med, "ftle_lo": lo, "ftle_hi": hi, "share_rho_below_1": share,
            "share_lo": s_lo, "share_hi": s_hi, "rho_median": float(np.nanmedian(rho)),
            "n_sequences": int(len(seq_ids)), "words": sentence}


def failure_labels(correct: np.ndarray) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """failure -> (label [token] bool, included [token] bool) for :data:`FAILURES` (module docstring)."""
    any_right = np.asarray(correct.any(axis=1), dtype=bool)
    at_T = np.asarray(correct[:, -1], dtype=bool)
    return {"trajectory": (np.logical_not(any_right), np.ones_like(any_right)),
            "readout": (np.logical_and(any_right, np.logical_not(at_T)), any_right)}  # readout failures vs tokens right at T


def weighted_auc(label: np.ndarray, score: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """ROC AUC of ``score`` for ``label`` under each row of ``weights`` at once (the bootstrap's resample counts).

    The value of scikit-learn's ``roc_auc_score(label, score, sample_weight=w)`` for each row w — the weighted
    probability that a positive scores above a negative, ties counting one half (the area under the ROC curve with
    its trapezoids over tied scores) — computed for all rows together: one ``roc_auc_score`` call per resample costs
    ~5 ms, 1 600 of them per model were most of the ``loopmap`` stage's time (tests/test_loopmap_stage.py checks
    every row against ``roc_auc_score``).

    Args:
        label: [token] bool, positives.
        score: [token] finite scores.
        weights: [B, token] non-negative weights.

    Returns:
        [B] float64; NaN where a row gives one class no weight.
    """
    y = np.asarray(label, dtype=bool)
    w = np.asarray(weights, dtype=np.float64)
    uniq, inv = np.unique(np.asarray(score, dtype=np.float64), return_inverse=True)
    pos, neg = (np.zeros((w.shape[0], uniq.size)) for _ in range(2))
    np.add.at(pos.T, inv[y], w[:, y].T)  # [B, U] weight of the positives at each distinct score
    np.add.at(neg.T, inv[~y], w[:, ~y].T)
    below = np.cumsum(neg, axis=1) - neg  # negatives strictly below each score
    num = (pos * (below + 0.5 * neg)).sum(axis=1)
    den = pos.sum(axis=1) * neg.sum(axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(den > 0, num / den, np.nan)


def failure_auc(predictors: Mapping[str, np.ndarray], correct: np.ndarray, sequence: np.ndarray,
                cfg: LoopMapConfig) -> pl.DataFrame:
    """ROC AUC of each predictor for each failure kind, with a bootstrap interval over sequences.

    Args:
        predictors: name -> [token] score, higher = more failure-prone.
        correct: [token, loop] argmax == target.
        sequence: [token] sequence id.
        cfg: B, level, seed.

    Returns:
        :data:`AUC_SCHEMA` rows; NaN AUC where a class has fewer than ``cfg.min_class`` tokens (or an interval's
        resample lacks one).
    """
    from sklearn.metrics import roc_auc_score

    rs = Resampler(sequence, cfg.n_boot, cfg.seed, cfg.level) if cfg.n_boot else None
    rows = []
    for failure, (label, inc) in failure_labels(np.asarray(correct, dtype=bool)).items():
        y = label[inc]
        for name, score in predictors.items():
            x = np.asarray(score, dtype=np.float64)[inc]
            ok = np.isfinite(x)
            yy, xx = y[ok], x[ok]
            n_pos, n_neg = int(yy.sum()), int((~yy).sum())
            auc = lo = hi = float("nan")
            if min(n_pos, n_neg) >= max(1, cfg.min_class):
                auc = float(roc_auc_score(yy, xx))
                if rs is not None:
                    samples = weighted_auc(yy, xx, rs.token_weights()[:, inc][:, ok])
                    lo, hi = (float(v[0]) for v in rs.interval(samples[:, None]))
            rows.append({"failure": failure, "predictor": name, "auc": auc, "auc_lo": lo, "auc_hi": hi,
                         "n_pos": n_pos, "n_neg": n_neg})
    return pl.DataFrame(rows, schema=AUC_SCHEMA)


def loopmap_report(store, cfg: LoopMapConfig = LoopMapConfig()) -> dict:
    """Every loop-map diagnosis of one split's store (read whole: a test split of the toy models fits).

    Args:
        store: an open trajectory store dumped with ``dump.contraction``.
        cfg: the diagnoses' parameters.

    Returns:
        ``regime`` (:func:`regime`), ``frontier`` (:func:`certified_frontier`: of the certified exit when the store
        holds an upper bound ``contraction_bound``, else of the estimated one), ``certified`` (which of the two),
        ``auc`` (:func:`failure_auc`) and ``words``: the summary sentences (regime; how often ρ_t < 1 so the rule can
        fire; the best predictor).

    Raises:
        InputError: the store has no ``contraction`` arrays (names the option that writes them).
    """
    if "contraction" not in store or "ftle" not in store:
        raise InputError(f"store {getattr(store, 'label', '')!s}: no 'contraction'/'ftle' arrays; dump it with "
                         "dump.contraction: {} (docs/dump.md)")
    rho = store.read("contraction").astype(np.float64)
    ftle = store.read("ftle").astype(np.float64)
    # block by block (the store's chunks): the states are the one array too big to read whole on a real model
    rel = np.concatenate([step_metrics(**store.read_block(["hidden", "hidden_init"], rows))["rel_step"]
                          for rows in store.blocks()]).astype(np.float64)
    correct = store.read("argmax") == store.read("target")[:, None]
    seq = store.read("sequence")
    upper = store.read("contraction_bound").astype(np.float64) if "contraction_bound" in store else None
    certified = upper is not None and not np.isnan(upper).all()  # NaN: wider than exact_width, no upper bound
    bound = certified_bound(upper if upper is not None and certified else rho, rel)
    reg = regime(ftle[:, -1], rho, seq, cfg)
    frontier = certified_frontier(bound, correct, cfg.eps)
    preds = {"ftle": ftle[:, -1], "contraction": rho.mean(axis=1), "rel_step": rel[:, -1],
             "entropy": store.read("entropy")[:, -1].astype(np.float64)}
    auc = failure_auc(preds, correct, seq, cfg)
    words = [reg["words"]]
    fired = float((bound <= max(cfg.eps)).any(axis=1).mean())
    if not certified:
        words.append(f"No certified fixed-point exit: the store holds no upper bound of the Jacobian norm "
                     f"(d_model > dump.contraction.exact_width, or dumped without one), so ρ_t is a power-method "
                     f"estimate, a lower bound; the estimated fixed-point exit reaches ε = {max(cfg.eps):g} on "
                     f"{100 * fired:.0f} % of tokens (ρ_t < 1 on {100 * reg['share_rho_below_1']:.0f} % of pairs).")
    elif reg["share_rho_below_1"] < 0.5:
        words.append(f"The certified fixed-point exit needs ρ_t < 1, which holds on only "
                     f"{100 * reg['share_rho_below_1']:.0f} % of (token, loop) pairs: at ε = {max(cfg.eps):g} it "
                     f"certifies {100 * fired:.0f} % of tokens; the rest run all loops (not censored silently).")
    else:
        words.append(f"The certified fixed-point exit certifies {100 * fired:.0f} % of tokens at ε = "
                     f"{max(cfg.eps):g} (ρ_t < 1 on {100 * reg['share_rho_below_1']:.0f} % of pairs).")
    words += auc_sentences(auc, cfg.min_class)
    return {"regime": reg, "frontier": frontier, "certified": certified, "auc": auc, "words": words}


def auc_sentences(auc: pl.DataFrame, min_class: int) -> list[str]:
    """One sentence per failure kind of :data:`FAILURES`: every predictor's AUC with its interval, best first, and
    the number of failures; or why there is none (fewer than ``min_class`` failures)."""
    out = []
    for failure in FAILURES:
        rows = auc.filter(pl.col("failure") == failure)
        sub = rows.filter(pl.col("auc").is_not_nan()).sort("auc", descending=True)
        if sub.height:
            each = ", ".join(f"{r['predictor']} {r['auc']:.2f} [{r['auc_lo']:.2f}, {r['auc_hi']:.2f}]"
                             for r in sub.iter_rows(named=True))
            out.append(f"AUC for {failure} failures ({sub['n_pos'][0]} on the sample), best first: {each}.")
        else:
            n = int(rows["n_pos"].max() or 0) if rows.height else 0  # type: ignore[arg-type]
            out.append(f"No AUC for {failure} failures: {n} on the sample, fewer than the {min_class} each class "
                       "needs (loopmap.min_class).")
    return out


__all__ = ["AUC_SCHEMA", "FAILURES", "FRONTIER_SCHEMA", "LoopMapConfig", "PREDICTORS", "certified_bound",
           "auc_sentences", "certified_exit", "certified_frontier", "failure_auc", "failure_labels", "loopmap_report", "regime", "weighted_auc"]
