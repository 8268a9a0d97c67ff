"""The halting signals of a gate in torch (training and the PonderNet gates), beside their numpy forms in
:mod:`looptrace.signals.halting` (tests/test_signal_registry.py checks that the two agree).

With gate logits g_t: λ_t = σ(g_t) (:func:`halting_lambda`), and the halting distribution over depths
q_t = λ_t Π_{j<t}(1 − λ_j) for t < T, q_T = Π_{j<T}(1 − λ_j) (:func:`halting_distribution`), whose cumulative sum
is the Q-exit CDF 1 − Π_{j≤t}(1 − λ_j) of :func:`looptrace.signals.halting.halting_cdf` at every t < T.

Imports torch: only torch-side modules import it (the models, and the gates inside their torch functions), never
an offline stage at import.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F


def halting_lambda(gate_logits: torch.Tensor) -> torch.Tensor:
    """λ_t = σ(g_t), the per-loop halting probability."""
    return torch.sigmoid(gate_logits)


def halting_distribution(gate_logits: torch.Tensor) -> torch.Tensor:
    """q over depths from gate logits (PonderNet): [..., T] -> [..., T], sums to 1 over T.

    λ_t = σ(gate_t); q_t = λ_t Π_{j<t}(1−λ_j) for t < T and q_T = Π_{j<T}(1−λ_j) (the last
    loop takes all remaining mass, whatever gate_T is). Computed in log space for stability.
    """
    log_lam = F.logsigmoid(gate_logits)  # log λ_t
    log_not = F.logsigmoid(-gate_logits)  # log (1 − λ_t)
    # log Π_{j<t}(1−λ_j): exclusive cumulative sum.
    surv = torch.cumsum(log_not, dim=-1) - log_not  # [..., T]
    log_q = surv + log_lam
    log_q = torch.cat([log_q[..., :-1], surv[..., -1:]], dim=-1)
    return log_q.exp()
