"""Exact float32 logit signals per (token, loop) (SPEC §3), from full logits, loop by loop — defined once.

With z_t the logits read out after loop t, p_t = softmax(z_t) and y the target:

- :func:`entropy`        H_t = −Σ_v p_t(v) log p_t(v)            (nats)
- :func:`max_prob`       C_t = max_v p_t(v)
- :func:`margin`         M_t = z_(1) − z_(2), the gap between the two largest logits ([AD])
- :func:`target_logprob` log p_t(y)  (so ℓ_t = −target_logprob)
- :func:`argmax`         argmax_v z_t(v)  (first index on ties, as numpy and torch)
- :func:`kl_prev`        KL(p_t ‖ p_{t−1})   ([AD]'s direction)
- :func:`kl_prev_rev`    KL(p_{t−1} ‖ p_t)   (Huginn code's direction)
- :func:`kl_final`       KL(p_T ‖ p_t)       (tuned-lens direction; exactly 0 at t = T)
- :func:`logit_change`   ‖z_t − z_{t−1}‖₂

Values at t = 1 that need t − 1 are NaN, never 0 (SPEC §3).

:class:`LoopStats` is the one place that evaluates them: fed loops 1..T in order (the dump also gives it
loop T first, for ``kl_final``), it keeps only the previous loop — a [token, loop, vocab] tensor is never
built, so the dump works for LM-sized vocabularies — and computes only the signals asked for. The dump
(every signal, [token, vocab] logits), the online exit rules and the online gate (a few signals,
[batch, seq, vocab] logits of the live batch, :meth:`LoopStats.compact` following the engine's
compaction) all use it, so an online value is the stored value bit for bit.

Everything is computed in float32 from log_softmax; terms with p = 0 contribute exactly 0 (so −inf
logits of masked vocabulary entries are fine), and the KLs, which float32 rounding can push a few ulps
below 0, are clamped at 0. Speed (bit-identical to the direct formulas, tests/test_stats.py): the p = 0
mask is skipped when the logits are finite, one max pass gives the top logit, argmax and max_prob, and
the runner-up is the max with the top masked (not topk).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from looptrace.signals import keep_rows
from looptrace.signals.names import CAUSAL_LOGIT_SIGNALS
from looptrace.signals.names import LOGIT_SIGNALS as STAT_NAMES
from looptrace.signals.rowwise import row_norm, row_sum

__all__ = ["CAUSAL_LOGIT_SIGNALS", "STAT_NAMES", "LoopStats", "argmax", "entropy", "kl_div", "kl_final",
           "kl_prev", "kl_prev_rev", "logit_change", "logit_stats", "margin", "max_prob", "target_logprob"]


def _masked_dot(p: torch.Tensor, x: torch.Tensor, finite: bool = False) -> torch.Tensor:
    """Σ_v p·x per row with the terms where p = 0 exactly 0 (p log p → 0; never 0·(−∞) = NaN).

    With ``finite`` (the caller knows ``x`` holds no ±inf/NaN) a term with p = 0 is already ±0, and the sum
    is bit-identical to the masked one (a −0 added to any partial sum leaves it unchanged), so the mask —
    two of the costliest passes — is skipped.
    """
    terms = p * x
    if not finite:
        terms = torch.where(p > 0, terms, torch.zeros((), dtype=terms.dtype, device=terms.device))
    return row_sum(terms)  # a lone row in a batch's order (one row's value never depends on the batch size)


def kl_div(logp: torch.Tensor, logq: torch.Tensor, p: torch.Tensor | None = None,
           finite: bool = False) -> torch.Tensor:
    """KL(p ‖ q) per row, in nats: [..., vocab] log-probabilities -> [...] float32, clamped at 0.

    Args:
        logp, logq: [..., vocab] log-probabilities.
        p: ``logp.exp()`` when the caller has it already (same values, one pass fewer).
        finite: both come from finite logits (same values, two passes fewer; see :func:`_masked_dot`).
    """
    p = logp.exp() if p is None else p
    return _masked_dot(p, logp - logq, finite).clamp_min(0.0)


def _all_finite(z: torch.Tensor) -> bool:
    # aminmax is one cheap pass (torch.isfinite(z).all() costs ~15x more here); NaN propagates into it
    if not z.numel():
        return True
    lo, hi = torch.aminmax(z)
    return bool(torch.isfinite(lo) & torch.isfinite(hi))


def _nan(z: torch.Tensor) -> torch.Tensor:
    """[...] float32 NaN for [..., vocab] logits (a value that needs a loop or class that does not exist)."""
    return torch.full(z.shape[:-1], float("nan"), dtype=torch.float32, device=z.device)


# ----------------------------------------------------------------------------------------------
# The signals, one definition each. Inputs of loop t: z = z_t float32 [..., vocab], logp = log_softmax(z),
# p = exp(logp), (z_top, top) = z.max(-1); ``finite``: the logits involved hold no ±inf/NaN.
# ----------------------------------------------------------------------------------------------


def entropy(logp: torch.Tensor, p: torch.Tensor, finite: bool = False) -> torch.Tensor:
    """H_t = −Σ p log p (nats), terms with p = 0 exactly 0."""
    return -_masked_dot(p, logp, finite)


def max_prob(logp: torch.Tensor, top: torch.Tensor) -> torch.Tensor:
    """C_t = max p = exp(logp[argmax]) (log_softmax is monotone, so the top logit's entry is the max)."""
    return logp.gather(-1, top.unsqueeze(-1)).squeeze(-1).exp()


def margin(z: torch.Tensor, z_top: torch.Tensor, top: torch.Tensor) -> torch.Tensor:
    """M_t = z_(1) − z_(2): the top logit minus the max with the top masked (= topk(2)); NaN for one class."""
    if z.shape[-1] < 2:  # a single class has no runner-up
        return _nan(z)
    return z_top - z.scatter(-1, top.unsqueeze(-1), float("-inf")).amax(dim=-1)


def target_logprob(logp: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """log p_t(y) for target ids ``target`` [..., 1] (int64)."""
    return logp.gather(-1, target).squeeze(-1)


def argmax(top: torch.Tensor) -> torch.Tensor:
    """argmax_v z_t(v) as int32, from the indices of ``z.max(-1)`` (first index on ties, as torch.argmax)."""
    return top.to(torch.int32)


def kl_prev(logp: torch.Tensor, p: torch.Tensor, prev_logp: torch.Tensor, finite: bool = False) -> torch.Tensor:
    """KL(p_t ‖ p_{t−1}) ([AD]'s direction)."""
    return kl_div(logp, prev_logp, p, finite)


def kl_prev_rev(logp: torch.Tensor, prev_logp: torch.Tensor, prev_p: torch.Tensor,
                finite: bool = False) -> torch.Tensor:
    """KL(p_{t−1} ‖ p_t) (Huginn code's direction)."""
    return kl_div(prev_logp, logp, prev_p, finite)


def kl_final(logp: torch.Tensor, final_logp: torch.Tensor, final_p: torch.Tensor,
             finite: bool = False) -> torch.Tensor:
    """KL(p_T ‖ p_t) (tuned-lens direction)."""
    return kl_div(final_logp, logp, final_p, finite)


def logit_change(z: torch.Tensor, prev_z: torch.Tensor) -> torch.Tensor:
    """‖z_t − z_{t−1}‖₂."""
    return row_norm(z - prev_z)


_NEEDS_PREV = ("kl_prev", "kl_prev_rev", "logit_change")


class LoopStats:
    """Streaming logit signals of one batch: feed every loop's logits in order (loop 1, 2, ...).

    Args:
        final_logits: [..., vocab] z_T (any float dtype; used in float32); needed for ``kl_final``.
        target: [...] target ids (int, each in [0, vocab)); needed for ``target_logprob``.
        names: the signals to compute (default every one of :data:`STAT_NAMES`, as the dump stores).
        check_finite: read whether the logits are finite (one host read per loop) to skip the p = 0 mask;
            False: always mask (the same values, :func:`_masked_dot`; nothing read to the host).

    Example::

        acc = LoopStats(z_T, target)
        rows = [acc.update(z_t) for z_t in (z_1, ..., z_T)]   # each: name -> [token] tensor
        live = LoopStats(names=("max_prob", "kl_prev"))      # online: no label, no loop T
    """

    def __init__(self, final_logits: torch.Tensor | None = None, target: torch.Tensor | None = None,
                 names: Sequence[str] = STAT_NAMES, check_finite: bool = True):
        unknown = [n for n in names if n not in STAT_NAMES]
        if unknown:
            raise ValueError(f"LoopStats: unknown signal '{unknown[0]}'; known: {', '.join(STAT_NAMES)}")
        self.names = tuple(n for n in STAT_NAMES if n in names)
        if "kl_final" in self.names and final_logits is None:
            raise ValueError("LoopStats: 'kl_final' needs final_logits (loop T's readout)")
        if "target_logprob" in self.names and target is None:
            raise ValueError("LoopStats: 'target_logprob' needs the target ids")
        self._final_logp: torch.Tensor | None = None
        self._final_p: torch.Tensor | None = None
        self._target: torch.Tensor | None = None
        self._final_finite = False
        if final_logits is not None and "kl_final" in self.names:
            z = final_logits.float()
            self._final_logp = torch.log_softmax(z, dim=-1)
            self._final_p = self._final_logp.exp()
            self._final_finite = _all_finite(z)
        if target is not None and "target_logprob" in self.names:
            vocab = final_logits.shape[-1] if final_logits is not None else None
            tgt = target.to(dtype=torch.int64)
            if final_logits is not None:
                tgt = tgt.to(device=final_logits.device)
            if vocab is not None and tgt.numel() and (int(tgt.min()) < 0 or int(tgt.max()) >= vocab):
                raise ValueError(f"target ids must lie in [0, {vocab}); got {int(tgt.min())}..{int(tgt.max())}")
            self._target = tgt.unsqueeze(-1)
        self._need_top = any(n in self.names for n in ("max_prob", "argmax", "margin"))
        self._need_logp = any(n not in ("argmax", "margin", "logit_change") for n in self.names)
        self._need_finite = any(n in self.names for n in ("entropy", "kl_prev", "kl_prev_rev", "kl_final"))
        self._keep_z = "logit_change" in self.names
        self._keep_logp = "kl_prev" in self.names or "kl_prev_rev" in self.names
        self._keep_p = "kl_prev_rev" in self.names
        self._prev_z: torch.Tensor | None = None
        self._prev_logp: torch.Tensor | None = None
        self._prev_p: torch.Tensor | None = None
        self._prev_finite = False
        self._started = False
        # False: never read the finiteness flag to the host (always the masked sums: the same values, see
        # _masked_dot; a decode loop on a device then waits for nothing; looptrace.online.device_rules)
        self._check_finite = bool(check_finite)

    def update(self, logits: torch.Tensor) -> dict[str, torch.Tensor]:
        """Signals of the next loop t (1, 2, ... in order).

        Args:
            logits: [..., vocab] z_t.

        Returns:
            name -> [...] tensor for every requested name, in :data:`STAT_NAMES` order (float32;
            ``argmax`` int32).
        """
        z = logits.float()
        names = self.names
        logp = torch.log_softmax(z, dim=-1) if self._need_logp else None
        # (_keep_p implies _need_logp: kl_prev_rev needs logp)
        p = logp.exp() if logp is not None and (any(n in names for n in ("entropy", "kl_prev", "kl_final"))
                                                 or self._keep_p) else None
        # finite logits: finite log-probabilities, no mask needed in the sums (only the sums need to know)
        finite = _all_finite(z) if self._need_finite and self._check_finite else False
        z_top, top = z.max(dim=-1) if self._need_top else (None, None)  # [...], [...]
        prev = self._started
        out: dict[str, torch.Tensor] = {}
        # The asserts restate the invariants of __init__: a requested name has its inputs (logp for every
        # name but argmax/margin/logit_change, p for entropy/kl_prev/kl_prev_rev, top for
        # max_prob/argmax/margin, the target/final loop when asked for, the kept previous loop when prev).
        for n in names:
            if n == "entropy":
                assert logp is not None and p is not None
                out[n] = entropy(logp, p, finite)
            elif n == "max_prob":
                assert logp is not None and top is not None
                out[n] = max_prob(logp, top)
            elif n == "margin":
                assert z_top is not None and top is not None
                out[n] = margin(z, z_top, top)
            elif n == "target_logprob":
                assert logp is not None and self._target is not None
                out[n] = target_logprob(logp, self._target)
            elif n == "argmax":
                assert top is not None
                out[n] = argmax(top)
            elif n == "kl_final":
                assert logp is not None and self._final_logp is not None and self._final_p is not None
                out[n] = kl_final(logp, self._final_logp, self._final_p, finite and self._final_finite)
            elif not prev:  # kl_prev, kl_prev_rev, logit_change at t = 1
                out[n] = _nan(z)
            elif n == "kl_prev":
                assert logp is not None and p is not None and self._prev_logp is not None
                out[n] = kl_prev(logp, p, self._prev_logp, finite and self._prev_finite)
            elif n == "kl_prev_rev":
                assert logp is not None and self._prev_logp is not None and self._prev_p is not None
                out[n] = kl_prev_rev(logp, self._prev_logp, self._prev_p, finite and self._prev_finite)
            elif n == "logit_change":
                assert self._prev_z is not None
                out[n] = logit_change(z, self._prev_z)
        self._prev_z = z if self._keep_z else None
        self._prev_logp = logp if self._keep_logp else None
        self._prev_p = p if self._keep_p else None
        self._prev_finite, self._started = finite, True
        return out

    def compact(self, rows: torch.Tensor | None, seq: int | None) -> None:
        """Follow the early-exit engine's compaction of [batch, seq, vocab] inputs (rows kept, positions
        truncated) so that the next loop's signals that need t − 1 see the same rows."""
        for k in ("_prev_z", "_prev_logp", "_prev_p"):
            v = getattr(self, k)
            if v is not None:
                setattr(self, k, keep_rows(v, rows, seq))


def logit_stats(logits: np.ndarray | torch.Tensor, target: np.ndarray | torch.Tensor) -> dict[str, np.ndarray]:
    """All statistics of full logits held in memory (tests, small captures, :func:`write_store` inputs).

    Args:
        logits: [token, loop, vocab] z_1..z_T.
        target: [token] target ids.

    Returns:
        name -> np.ndarray [token, loop] (float32; ``argmax`` int32), NaN at loop 1 for ``kl_prev``,
        ``kl_prev_rev`` and ``logit_change``.
    """
    z = torch.as_tensor(logits)
    if z.ndim != 3:
        raise ValueError(f"logits must be [token, loop, vocab], got shape {tuple(z.shape)}")
    acc = LoopStats(z[:, -1], torch.as_tensor(target))
    rows = [acc.update(z[:, t]) for t in range(z.shape[1])]
    return {k: torch.stack([r[k] for r in rows], dim=1).cpu().numpy() for k in STAT_NAMES}
