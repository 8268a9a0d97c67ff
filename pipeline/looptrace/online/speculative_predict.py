"""The offline prediction of loop self-speculative decoding (SPEC §8 "Loop self-speculative decoding"): from a
store's per-loop argmax, per draft depth k and draft length d, the expected tokens per verification block and
the speedup over full-depth decoding. numpy only (no torch).

A draft of k loops is accepted at a position exactly when argmax_k = argmax_T there (the draft at loop k of a
position whose earlier tokens are full depth's is full depth's loop-k readout), so along a sequence the
accepted drafts of a block starting at position i are the leading run of agreements a_k(i), a_k(i+1), ...:

- :func:`agreement_windows`: for every stored token (s, i) and j = 1..d, whether positions i..i+j−1 of s are all
  stored (``fits``) and all agree (``hits``); q_j = Σ hits_j / Σ fits_j is P(a block's first j drafts are
  accepted) — a ratio of token sums, so the bootstrap over sequences is :meth:`looptrace.intervals.Resampler.ratio`;
- Q_j = (min_{i ≤ j} q_i)^B: a batch of B rows advances by the shortest acceptance (rows independent; the running
  minimum keeps the estimates a distribution when the windows' denominators differ);
- :func:`horizon_expectations`: the expected blocks and time to emit N tokens (the decoder's last blocks draft
  fewer tokens, d' = min(d, r − 1) with r tokens left), a recursion over r;
- :func:`simulate_blocks`: the blocks themselves, when the agreements along the decoded sequences are known
  (the benchmark; tests).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from looptrace.config import ConfigError


@dataclass(frozen=True)
class SpeculativeConfig:
    """``generate.speculative`` section of ``params.yaml`` (null = off; :mod:`looptrace.online.speculative`).

    Attributes:
        k: draft loops (each 1 ≤ k < T; a k ≥ the model's T is skipped with the reason in metrics.json).
        d: draft lengths (tokens proposed per block).
        cost_repeats: timed repetitions of the cost model's measurements (:func:`measure_costs`; median).
    """

    k: tuple[int, ...] = (2,)
    d: tuple[int, ...] = (3,)
    cost_repeats: int = 5

    def __post_init__(self) -> None:
        if not self.k or min(self.k) < 1:
            raise ConfigError(f"generate.speculative.k must be a non-empty list of draft loops ≥ 1, got {list(self.k)}")
        if not self.d or min(self.d) < 1:
            raise ConfigError(f"generate.speculative.d must be a non-empty list of draft lengths ≥ 1, got {list(self.d)}")
        if self.cost_repeats < 1:
            raise ConfigError(f"generate.speculative.cost_repeats must be ≥ 1, got {self.cost_repeats}")


@dataclass(frozen=True)
class SpecCosts:
    """Measured wall times (seconds, one batch) of a block of each draft length d' = 0..min(d, N − 1) (index d').

    Attributes:
        draft: drafting d' tokens: d'+1 (chunk verification) or d' positions embedded and run through loops 1..k,
            d' readouts after loop k.
        verify: the verification of the d'+1 positions.
        accept: the acceptance bookkeeping (log-softmax, argmax, comparison, the host read of the accepted length).
        chunk: the verification continues the drafts in one chunk, or re-runs each position.
        full: one position of full-depth decoding (the reference: c_full).
    """

    draft: tuple[float, ...]
    verify: tuple[float, ...]
    accept: tuple[float, ...]
    chunk: bool = True
    full: float = float("nan")

    def block(self, dd: int) -> float:
        """c(d') = draft(d') + verify(d') + accept(d')."""
        return self.draft[dd] + self.verify[dd] + self.accept[dd]


def agreement_windows(argmax: np.ndarray, sequence: np.ndarray, position: np.ndarray, k: int, d: int
                      ) -> tuple[np.ndarray, np.ndarray]:
    """Per stored token, whether the window of j positions starting at it is stored and agrees, j = 1..d.

    Args:
        argmax: [token, T] argmax of the readout at every loop (the store's ``argmax``).
        sequence, position: [token] each token's sequence and position.
        k: draft loops (1 ≤ k < T).
        d: the longest window.

    Returns:
        (hits, fits), each [d, token] bool in the input's token order: ``fits[j−1, t]`` = positions i..i+j−1 of
        t's sequence are all stored (i = t's position), ``hits[j−1, t]`` = they are and argmax_k = argmax_T at each.
    """
    am = np.asarray(argmax)
    if am.ndim != 2 or not 1 <= k < am.shape[1]:
        raise ValueError(f"agreement_windows: argmax must be [token, T] with 1 ≤ k < T; got {am.shape}, k = {k}")
    n = am.shape[0]
    seq, pos = np.asarray(sequence, np.int64), np.asarray(position, np.int64)
    order = np.lexsort((pos, seq))
    a = (am[:, k - 1] == am[:, -1])[order]
    s, p = seq[order], pos[order]
    nxt = np.zeros(n, dtype=bool)  # the next stored token is the next position of the same sequence
    nxt[:-1] = (s[1:] == s[:-1]) & (p[1:] == p[:-1] + 1)
    fits = np.zeros((d, n), dtype=bool)
    hits = np.zeros((d, n), dtype=bool)
    fits[0], hits[0] = True, a
    for j in range(1, d):  # window j+1 = window j and one more contiguous position
        f = np.zeros(n, dtype=bool)
        f[: n - j] = fits[j - 1, : n - j] & nxt[j - 1: n - 1]
        h = np.zeros(n, dtype=bool)
        h[: n - j] = hits[j - 1, : n - j] & f[: n - j] & a[j:]
        fits[j], hits[j] = f, h
    out_f, out_h = np.empty_like(fits), np.empty_like(hits)
    out_f[:, order], out_h[:, order] = fits, hits
    return out_h, out_f


def batch_acceptance(q: np.ndarray, batch: int) -> np.ndarray:
    """Q_j = (min_{i ≤ j} q_i)^batch over the last axis ([..., d] -> [..., d]; NaN stays NaN)."""
    qq = np.asarray(q, dtype=np.float64)
    return np.minimum.accumulate(qq, axis=-1) ** int(batch)


def horizon_expectations(Q: np.ndarray, n_tokens: int, block_cost: Callable[[int], float]
                         ) -> tuple[np.ndarray, np.ndarray]:
    """Expected blocks and expected time to emit ``n_tokens`` tokens.

    E(0) = 0; for r ≥ 1 tokens left the block drafts d' = min(d, r − 1), accepts m drafts with P(m ≥ j) = Q_j
    (j ≤ d'; Q_0 = 1, P(m ≥ d'+1) = 0) and emits m + 1: E_b(r) = 1 + Σ_m P(m) E_b(r − m − 1), E_c(r) = c(d') +
    Σ_m P(m) E_c(r − m − 1).

    Args:
        Q: [..., d] per-block acceptance probabilities (:func:`batch_acceptance`).
        n_tokens: N.
        block_cost: d' -> a block's time (:meth:`SpecCosts.block`).

    Returns:
        (E_b, E_c), each [...]: expected blocks and expected time.
    """
    Q = np.asarray(Q, dtype=np.float64)
    d = Q.shape[-1]
    lead = Q.shape[:-1]
    Eb = np.zeros((n_tokens + 1, *lead))
    Ec = np.zeros((n_tokens + 1, *lead))
    for r in range(1, n_tokens + 1):
        dd = min(d, r - 1)
        ge = [np.ones(lead)] + [Q[..., j] for j in range(dd)] + [np.zeros(lead)]  # P(m ≥ j), j = 0..dd+1
        b, c = np.ones(lead), np.full(lead, float(block_cost(dd)))
        for m in range(dd + 1):
            pm = ge[m] - ge[m + 1]
            b = b + pm * Eb[r - m - 1]
            c = c + pm * Ec[r - m - 1]
        Eb[r], Ec[r] = b, c
    return Eb[n_tokens], Ec[n_tokens]


def simulate_blocks(agree: np.ndarray, d: int) -> tuple[np.ndarray, np.ndarray]:
    """The blocks the decoder makes when the agreements along the decoded sequences are known.

    Args:
        agree: [batch, N] bool: a_k at the position that emits each token of each row (the full-depth greedy
            continuation's argmax_k = argmax_T).
        d: draft length.

    Returns:
        (draft lengths d', emitted tokens a), each [blocks] int64.
    """
    ag = np.asarray(agree, dtype=bool)
    N = ag.shape[1]
    n, draft, emitted = 0, [], []
    while n < N:
        dd = min(d, N - n - 1)
        run = np.cumprod(ag[:, n:n + dd], axis=1).sum(axis=1) if dd else np.zeros(ag.shape[0], np.int64)
        a = int(run.min()) + 1
        draft.append(dd)
        emitted.append(a)
        n += a
    return np.asarray(draft, np.int64), np.asarray(emitted, np.int64)


def predict_speculative(store: dict[str, np.ndarray], k: int, d: int, batch: int, n_tokens: int, costs: SpecCosts,
                        resampler: Any = None) -> dict[str, float]:
    """Predicted tokens per block and speedup of speculative decoding (k, d, batch, N) from a store.

    Args:
        store: ``argmax`` [token, T], ``sequence`` and ``position`` [token].
        k, d, batch, n_tokens: the decoding's draft loops, draft length, batch size and tokens per row.
        costs: the measured block times and full-depth position time (``costs.full``).
        resampler: a :class:`looptrace.intervals.Resampler` over the store's tokens (by sequence) for intervals,
            or None (lo = hi = NaN).

    Returns:
        ``tokens_per_block`` (N / E_b), ``speedup`` (N · c_full / E_c), ``accept_steady`` (1 + Σ_{j ≤ d} Q_j:
        tokens per block far from the horizon), each with ``_lo``/``_hi``; ``agreement`` (the share of tokens with
        argmax_k = argmax_T), ``q1`` and ``n_sequences``.
    """
    hits, fits = agreement_windows(store["argmax"], store["sequence"], store["position"], k, d)
    with np.errstate(invalid="ignore", divide="ignore"):
        q = hits.sum(axis=1) / fits.sum(axis=1)  # [d]
    est = _figures(q[None], batch, n_tokens, costs)
    out = {name: float(v[0]) for name, v in est.items()}
    if resampler is not None and resampler.n_boot > 0:
        from looptrace.intervals import percentile_interval

        samples = _figures(resampler.ratio(hits, fits), batch, n_tokens, costs)
        for name, v in samples.items():
            lo, hi = percentile_interval(v, resampler.level)
            out[f"{name}_lo"], out[f"{name}_hi"] = float(lo), float(hi)
    else:
        for name in est:
            out[f"{name}_lo"] = out[f"{name}_hi"] = float("nan")
    am = np.asarray(store["argmax"])
    out["agreement"] = float(np.mean(am[:, k - 1] == am[:, -1]))
    out["q1"] = float(q[0])
    out["n_sequences"] = float(np.unique(np.asarray(store["sequence"])).size)
    return out


def _figures(q: np.ndarray, batch: int, n_tokens: int, costs: SpecCosts) -> dict[str, np.ndarray]:
    """[M, d] acceptance probabilities q_j -> the three predicted figures, each [M]."""
    Q = batch_acceptance(q, batch)
    Eb, Ec = horizon_expectations(Q, n_tokens, costs.block)
    with np.errstate(invalid="ignore", divide="ignore"):
        return {"tokens_per_block": n_tokens / Eb, "speedup": n_tokens * costs.full / Ec,
                "accept_steady": 1.0 + Q.sum(axis=-1)}


__all__ = ["SpecCosts", "SpeculativeConfig", "agreement_windows", "batch_acceptance", "horizon_expectations", "predict_speculative",
           "simulate_blocks"]
