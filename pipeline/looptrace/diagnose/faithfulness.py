"""Counterfactual faithfulness of a halting signal (SPEC §7a; SEWN's test adapted to depth).

A rule or gate at its chosen operating point assigns every test token an exit depth d_i, and by exiting it
there it claims "stopping this token at loop d_i costs nothing". The store holds the counterfactual: the loss
ℓ_t of every loop, so the cost of exiting token i at loop t is c_i(t) = ℓ_t − ℓ_T (nats; ``target_logprob``
of token_loop.parquet, ℓ_t = −log p_t(y)). The test asks whether the signal puts its early exits on the
tokens for which they are cheap, **at a matched budget**: the null hands the *same multiset of exit depths*
(same number of tokens at each depth, so the same mean depth and compute) to tokens chosen at random.

- signal cost  A = (1/n) Σ_i c_i(d_i);
- random cost  E = E_π[(1/n) Σ_i c_i(d_π(i))] = (1/n) Σ_i Σ_t w_t c_i(t), w_t = #{d = t}/n — exact, no draw;
- reverse cost R: the signal's ranking reversed (the tokens it exits latest get its earliest depths;
  ties in d broken at random, seeded);
- effect size = saving S = E − A (nats per token; > 0: the signal's exits are cheaper than random ones),
  with a percentile bootstrap interval over test sequences (the project's interval protocol), the saving
  against the reverse ranking R − A likewise, and the standardised z = (A − E) / sd_π.

**p-value.** A paired permutation test of the pairing of exit depths with tokens (each permutation is a random
assignment of the same depths: scipy.stats.permutation_test's ``permutation_type='pairings'``), one-sided (the
signal's cost is lower than random), Monte-Carlo with B permutations: p_MC = (1 + #{A_π ≤ A}) / (1 + B) ≥
1/(1 + B). The B permutations of a model's test tokens are drawn once (:func:`null_permutations`, seeded) and
shared by all its rules, so the null draws are paired across rules and the test costs one [B, n] gather per rule
(tests/test_faithfulness.py checks p_MC against scipy.stats.permutation_test on the same case). When no
permutation reaches A (p_MC at its floor), the tail is resolved by the normal approximation to the permutation
distribution (Hoeffding 1951's combinatorial CLT) with its *exact* mean E and variance Var_π[Σ_i C_{iπ(i)}] =
(1/(n−1)) Σ_ij (C_ij − C_i· − C_·j + C_··)², C_ij = c_i(d_j); the reported p is min(p_MC, p_normal) in that case
and p_MC otherwise, so at every level ≥ 1/(1 + B) the test is exactly the Monte-Carlo permutation test. C is
n × n but takes only T distinct columns, so the variance costs O(n T).

**Verdict** (``verdict`` column, words of summary.md): ``faithful`` when p < α and the saving's interval
lies above 0; ``anti-faithful`` when the other tail's p (``pvalue_worse``: the signal costs more than random,
same permutations) is < α and the interval lies below 0 (the signal exits the tokens that most need depth: worse
than random; both are required because a skewed null can put the mean and the median of the random costs on
different sides of A); ``untestable`` when every assignment costs the same (all tokens exit at one
depth, e.g. ``fixed``); ``unfaithful`` otherwise — no better than random ranking at this budget.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

import numpy as np
import polars as pl

from looptrace.intervals import Resampler

#: Verdicts of :func:`faithfulness_test`, in the order summary.md counts them.
FAITH_VERDICTS = ("faithful", "unfaithful", "anti-faithful", "untestable")


@dataclass(frozen=True)
class FaithfulnessResult:
    """One signal's test (attributes as in the module docstring; costs and savings in nats per token)."""

    n: int
    n_exited: int
    mean_depth: float
    cost_signal: float
    cost_random: float
    cost_reverse: float
    saving: float
    saving_lo: float
    saving_hi: float
    saving_vs_reverse: float
    saving_vs_reverse_lo: float
    saving_vs_reverse_hi: float
    z: float
    pvalue: float
    pvalue_mc: float
    pvalue_normal: float
    pvalue_worse: float
    n_resamples: int
    n_boot: int
    n_sequences: int
    verdict: str

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def exit_costs(loss: np.ndarray) -> np.ndarray:
    """c_i(t) = ℓ_t − ℓ_T: [token, loop] loss increase of exiting each token at each loop (nats)."""
    ell = np.asarray(loss, dtype=np.float64)
    return ell - ell[:, -1:]


def permutation_moments(cost: np.ndarray, depth: np.ndarray) -> tuple[float, float]:
    """Exact mean and variance of (1/n) Σ_i c_i(d_π(i)) over uniform random permutations π.

    Hoeffding (1951): for C_ij = c_i(d_j), E = C_·· · n / n and Var(Σ_i C_iπ(i)) = (1/(n−1)) Σ_ij d_ij² with
    d_ij = C_ij − C_i· − C_·j + C_··. Column j depends on d_j only, so the double sum runs over the T depths
    weighted by their counts.

    Args:
        cost: [token, loop] c_i(t).
        depth: [token] 1-based exit depths.

    Returns:
        (mean, variance) of the per-token mean cost under the permutation null.
    """
    c = np.asarray(cost, dtype=np.float64)
    n, T = c.shape
    cnt = np.bincount(np.asarray(depth, dtype=np.int64) - 1, minlength=T).astype(np.float64)
    w = cnt / n
    row = c @ w                    # C_i·
    col = c.mean(axis=0)           # C_·j as a function of d_j = t
    grand = float(col @ w)         # C_··
    resid = c - row[:, None] - col[None, :] + grand
    var_sum = float((resid ** 2 @ cnt).sum()) / max(n - 1, 1)
    return grand, var_sum / n ** 2


def reverse_depths(depth: np.ndarray, seed: int) -> np.ndarray:
    """The signal's ranking reversed: tokens sorted by exit depth (ties at random, ``seed``); the k-th
    earliest-exiting token gets the k-th latest depth. Same multiset of depths."""
    d = np.asarray(depth, dtype=np.int64)
    tie = np.random.default_rng(seed).random(d.size)
    order = np.lexsort((tie, d))
    out = np.empty_like(d)
    out[order] = d[order][::-1]
    return out


def null_permutations(n: int, n_resamples: int, seed: int) -> np.ndarray:
    """[B, n] int32: B independent uniform permutations of the n tokens (the Monte-Carlo null draws)."""
    rng = np.random.default_rng(seed)
    return rng.permuted(np.broadcast_to(np.arange(n, dtype=np.int32), (int(n_resamples), n)), axis=1)


def faithfulness_test(loss: np.ndarray, depth: np.ndarray, resampler: Resampler | None = None,
                      n_resamples: int = 199, alpha: float = 0.05, seed: int = 0,
                      perms: np.ndarray | None = None) -> FaithfulnessResult:
    """SEWN's counterfactual faithfulness test of one signal's exits, at matched budget (module docstring).

    Args:
        loss: [token, loop] per-depth losses ℓ_t = −log p_t(y) (nats).
        depth: [token] the signal's 1-based exit depths at its operating point.
        resampler: bootstrap over test sequences of the saving's interval (None = no interval: NaN bounds).
        n_resamples: Monte-Carlo permutations B of the p-value (≥ 1; ignored when ``perms`` is given).
        alpha: level of the verdict.
        seed: RNG seed of the permutations (when ``perms`` is None) and of the reverse ranking's tie-break.
        perms: [B, token] permutations of the tokens (:func:`null_permutations`), shared by a model's rules.

    Returns:
        :class:`FaithfulnessResult`.
    """
    from scipy.stats import norm

    c = exit_costs(loss)
    d = np.asarray(depth, dtype=np.int64)
    n, T = c.shape
    if d.shape != (n,) or d.min(initial=1) < 1 or d.max(initial=1) > T:
        raise ValueError(f"exit depths must be [token] in 1..{T} for {n} tokens, got shape {d.shape}")
    flat = c.ravel()
    base = np.arange(n, dtype=np.int64) * T - 1
    a = flat[base + d]                                      # c_i(d_i)
    cnt = np.bincount(d - 1, minlength=T).astype(np.float64)
    b = c @ (cnt / n)                                       # E_π c_i(d_π(i)), per token
    r = flat[base + reverse_depths(d, seed)]
    A, E, R = float(a.mean()), float(b.mean()), float(r.mean())
    mean, var = permutation_moments(c, d)
    sd = math.sqrt(max(var, 0.0))
    # the permutation null is degenerate (every assignment costs the same, up to rounding)
    untestable = sd <= 1e-12 * max(1.0, float(np.abs(c).max(initial=0.0)))
    if untestable:
        z, p_norm, p_mc, p, p_worse, B = 0.0, 1.0, 1.0, 1.0, 1.0, 0
    else:
        z = (A - mean) / sd
        p_norm = float(norm.cdf(z))
        pm = null_permutations(n, n_resamples, seed) if perms is None else perms
        if pm.shape[1:] != (n,):
            raise ValueError(f"perms must be [B, {n}] permutations of the tokens, got shape {pm.shape}")
        B = int(pm.shape[0])
        # a random assignment of the same depths: token π(j) gets depth d_j (π uniform, so π(j) ranges over a
        # uniform permutation); [B, n] gathers of c in row blocks of ≤ 2M entries
        null = np.empty(B)
        step = max(1, 2_000_000 // max(n, 1))
        for i in range(0, B, step):
            null[i:i + step] = np.take(flat, pm[i:i + step].astype(np.int64) * T + (d - 1)[None, :]).mean(axis=1)
        tol = 1e-12 * max(1.0, abs(A))
        hits = int((null <= A + tol).sum())  # ties count against the signal
        p_mc = (1 + hits) / (1 + B)
        p = min(p_mc, p_norm) if hits == 0 else p_mc
        # the other tail (the signal costs more than random), resolved the same way
        worse = int((null >= A - tol).sum())
        p_worse = (1 + worse) / (1 + B)
        p_worse = min(p_worse, float(norm.sf(z))) if worse == 0 else p_worse  # sf: no 1 − Φ cancellation
    lo = hi = rlo = rhi = math.nan
    nb = ns = 0
    if resampler is not None and resampler.n_boot:
        s = resampler.ratio(np.stack([b - a, r - a]))      # [B, 2]
        los, his = resampler.interval(s)
        lo, rlo, hi, rhi = float(los[0]), float(los[1]), float(his[0]), float(his[1])
        nb, ns = resampler.n_boot, resampler.n_units
    saving = E - A
    if untestable:
        verdict = "untestable"
    elif p < alpha and (lo > 0 if nb else True):
        verdict = "faithful"
    elif p_worse < alpha and (hi < 0 if nb else True):
        verdict = "anti-faithful"
    else:
        verdict = "unfaithful"
    return FaithfulnessResult(
        n=n, n_exited=int((d < T).sum()), mean_depth=float(d.mean()), cost_signal=A, cost_random=E,
        cost_reverse=R, saving=saving, saving_lo=lo, saving_hi=hi, saving_vs_reverse=R - A,
        saving_vs_reverse_lo=rlo, saving_vs_reverse_hi=rhi, z=float(z), pvalue=float(p), pvalue_mc=float(p_mc),
        pvalue_normal=float(p_norm), pvalue_worse=float(p_worse), n_resamples=B, n_boot=nb, n_sequences=ns, verdict=verdict)


def faithfulness_frame(rows: list[dict]) -> pl.DataFrame:
    """``faithfulness.parquet`` from its rows (model, task, regime, regime_kind, source, rule, kind, then the
    :class:`FaithfulnessResult` fields); with no rows (the test off) the same columns, empty."""
    schema: dict[str, Any] = {k: pl.String for k in ("model", "task", "regime", "regime_kind", "source", "rule",
                                                      "kind")}
    for f in fields(FaithfulnessResult):
        schema[f.name] = {"int": pl.Int64, "float": pl.Float64}.get(str(f.type), pl.String)
    return pl.DataFrame(rows, schema=schema) if rows else pl.DataFrame(schema=schema)


def faithfulness_metrics(frame, cfg) -> dict:
    """metrics.json entry: the protocol and, per verdict, how many (model, rule) tests reached it."""
    counts = {v: 0 for v in FAITH_VERDICTS}
    if frame.height:
        for v in frame["verdict"].to_list():
            counts[v] += 1
    return {"alpha": cfg.faithfulness_alpha, "n_resamples": cfg.faithfulness_resamples, "n_tests": frame.height,
            "verdicts": counts}
