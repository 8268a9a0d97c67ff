"""Exact float32 logit statistics per (token, loop) (SPEC §3), from full logits, loop by loop.

With z_t the logits read out after loop t, p_t = softmax(z_t) and y the target:

- ``entropy``        H_t = −Σ_v p_t(v) log p_t(v)            (nats)
- ``max_prob``       C_t = max_v p_t(v)
- ``margin``         M_t = z_(1) − z_(2), the gap between the two largest logits ([AD])
- ``target_logprob`` log p_t(y)  (so ℓ_t = −target_logprob)
- ``argmax``         argmax_v z_t(v)  (first index on ties, as numpy and torch)
- ``kl_prev``        KL(p_t ‖ p_{t−1})   ([AD]'s direction)
- ``kl_prev_rev``    KL(p_{t−1} ‖ p_t)   (Huginn code's direction)
- ``kl_final``       KL(p_T ‖ p_t)       (tuned-lens direction; exactly 0 at t = T)
- ``logit_change``   ‖z_t − z_{t−1}‖₂

Values at t = 1 that need t − 1 are NaN, never 0 (SPEC §3).

Memory is bounded by two loops: :class:`LoopStats` is fed loop T first (for ``kl_final``), then loops
1..T in order, keeping only the previous loop — a [token, loop, vocab] tensor is never built, so the
dump works for LM-sized vocabularies. Everything is computed in float32 from log_softmax; terms with
p = 0 contribute exactly 0 (so −inf logits of masked vocabulary entries are fine), and the KLs, which
float32 rounding can push a few ulps below 0, are clamped at 0.
"""

from __future__ import annotations

import numpy as np
import torch
from looptrace.io.store import STAT_NAMES

__all__ = ["STAT_NAMES", "LoopStats", "kl_div", "logit_stats"]


def _masked_dot(p: torch.Tensor, x: torch.Tensor, finite: bool = False) -> torch.Tensor:
    """Σ_v p·x per row with the terms where p = 0 exactly 0 (p log p → 0; never 0·(−∞) = NaN).

    With ``finite`` (the caller knows ``x`` holds no ±inf/NaN) a term with p = 0 is already ±0, and the sum
    is bit-identical to the masked one (a −0 added to any partial sum leaves it unchanged), so the mask —
    two of the costliest passes — is skipped.
    """
    terms = p * x
    if not finite:
        terms = torch.where(p > 0, terms, torch.zeros((), dtype=terms.dtype, device=terms.device))
    return terms.sum(-1)


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


class LoopStats:
    """Streaming statistics of one batch of tokens: feed the final loop first, then every loop in order.

    Args:
        final_logits: [token, vocab] z_T (any float dtype; used in float32).
        target: [token] target ids (int, each in [0, vocab)).

    Example::

        acc = LoopStats(z_T, target)
        rows = [acc.update(z_t) for z_t in (z_1, ..., z_T)]   # each: name -> [token] tensor
    """

    def __init__(self, final_logits: torch.Tensor, target: torch.Tensor):
        z = final_logits.float()
        self._final_logp = torch.log_softmax(z, dim=-1)
        self._final_p = self._final_logp.exp()
        self._final_finite = _all_finite(z)
        self._target = target.to(device=z.device, dtype=torch.int64).reshape(-1, 1)
        vocab = z.shape[-1]
        if self._target.numel() and (int(self._target.min()) < 0 or int(self._target.max()) >= vocab):
            raise ValueError(f"target ids must lie in [0, {vocab}); got {int(self._target.min())}.."
                             f"{int(self._target.max())}")
        self._prev_z: torch.Tensor | None = None
        self._prev_logp: torch.Tensor | None = None
        self._prev_p: torch.Tensor | None = None
        self._prev_finite = False

    def update(self, logits: torch.Tensor) -> dict[str, torch.Tensor]:
        """Statistics of the next loop t (1, 2, ... in order).

        Args:
            logits: [token, vocab] z_t.

        Returns:
            name -> [token] tensor for every name in :data:`STAT_NAMES` (float32; ``argmax`` int32).
        """
        z = logits.float()
        logp = torch.log_softmax(z, dim=-1)
        p = logp.exp()
        finite = _all_finite(z)  # finite logits: finite log-probabilities, no mask needed in the sums
        # one max pass gives the top logit, argmax (first index on ties, as torch.argmax) and, through
        # log_softmax's monotonicity, max_prob = exp(logp[argmax]); the runner-up is the max with the top
        # masked — the same values as topk(2), at a fraction of its cost
        z_top, top = z.max(dim=-1)  # [token], [token]
        out: dict[str, torch.Tensor] = {
            "entropy": -_masked_dot(p, logp, finite),
            "max_prob": logp.gather(-1, top[:, None]).squeeze(-1).exp(),
            "target_logprob": logp.gather(-1, self._target).squeeze(-1),
            "argmax": top.to(torch.int32),
            "kl_final": kl_div(self._final_logp, logp, self._final_p, finite and self._final_finite),
        }
        if z.shape[-1] >= 2:
            out["margin"] = z_top - z.scatter(-1, top[:, None], float("-inf")).amax(dim=-1)
        else:  # a single class has no runner-up
            out["margin"] = torch.full(z.shape[:1], float("nan"), device=z.device)
        if self._prev_logp is None:
            nan = torch.full(z.shape[:1], float("nan"), dtype=torch.float32, device=z.device)
            out.update(kl_prev=nan, kl_prev_rev=nan.clone(), logit_change=nan.clone())
        else:
            both = finite and self._prev_finite
            out["kl_prev"] = kl_div(logp, self._prev_logp, p, both)
            out["kl_prev_rev"] = kl_div(self._prev_logp, logp, self._prev_p, both)
            out["logit_change"] = torch.linalg.vector_norm(z - self._prev_z, dim=-1)
        self._prev_z, self._prev_logp, self._prev_p, self._prev_finite = z, logp, p, finite
        return {k: out[k] for k in STAT_NAMES}


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
