"""Depth-supervision regimes (SPEC §5): how the per-depth losses ℓ_1..ℓ_T are combined in training.

- ``final``: ℓ_T only.
- ``uniform``: (1/T) Σ_t ℓ_t.
- ``geometric`` (λ): Σ_t π_t ℓ_t with π_t = λ(1−λ)^{t−1} for t < T, π_T = (1−λ)^{T−1} ([AD]).
- ``joint`` (PonderNet / Ouro stage I): λ_t = σ(gate_t), q_t = λ_t Π_{j<t}(1−λ_j) for t < T,
  q_T = Π_{j<T}(1−λ_j); L = Σ_t q_t ℓ_t + β KL(q ‖ π), π uniform or geometric(λ).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

import torch
from torch.nn import functional as F

from looptrace.config import Check, ConfigError, NonNegFloat, one_of
from looptrace.signals.halting_torch import halting_distribution
from looptrace.tasks import IGNORE

KINDS = ("final", "uniform", "geometric", "joint")


@dataclass(frozen=True)
class RegimeConfig:
    """One regime definition (``train.regime_defs.<name>`` in ``params.yaml``).

    Attributes:
        kind: final | uniform | geometric | joint.
        lam: λ of the geometric weights (geometric, and the geometric prior of joint).
        prior: joint only: uniform | geometric.
        gate: joint only: linear | mlp (the model's halting gate).
        beta: joint only: weight of KL(q ‖ π).
    """

    kind: Annotated[str, one_of(*KINDS)]
    lam: Annotated[float, Check(gt=0, lt=1, why="the geometric λ")] = 0.3
    prior: Annotated[str, one_of("uniform", "geometric")] = "uniform"
    gate: Annotated[str, one_of("linear", "mlp")] = "linear"
    beta: NonNegFloat = 0.1

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ConfigError(f"regime kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if self.kind == "joint" and self.prior not in ("uniform", "geometric"):
            raise ConfigError(f"joint regime prior must be uniform or geometric, got {self.prior!r}")
        if self.kind == "joint" and self.gate not in ("linear", "mlp"):
            raise ConfigError(f"joint regime gate must be linear or mlp, got {self.gate!r}")
        if not 0.0 < self.lam < 1.0:
            raise ConfigError(f"regime lam must be in (0, 1), got {self.lam}")

    @property
    def model_gate(self) -> str:
        """The halting gate the model needs under this regime."""
        return self.gate if self.kind == "joint" else "none"


def geometric_weights(T: int, lam: float) -> torch.Tensor:
    """π_t = λ(1−λ)^{t−1} (t < T), π_T = (1−λ)^{T−1}: [T], sums to 1."""
    t = torch.arange(T, dtype=torch.float64)
    w = lam * (1 - lam) ** t
    w[-1] = (1 - lam) ** (T - 1)
    return w.float()


def prior_weights(T: int, cfg: RegimeConfig) -> torch.Tensor:
    """The fixed prior π over depths [T] for ``uniform``/``geometric`` (and joint's prior)."""
    if cfg.kind == "uniform" or (cfg.kind == "joint" and cfg.prior == "uniform"):
        return torch.full((T,), 1.0 / T)
    if cfg.kind == "final":
        w = torch.zeros(T)
        w[-1] = 1.0
        return w
    return geometric_weights(T, cfg.lam)


def per_depth_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """ℓ_t = −log p_t(y): logits [batch, seq, loop, vocab], targets [batch, seq] -> [batch, seq, loop].

    Unscored positions (``IGNORE``) get 0.
    """
    B, S, T, V = logits.shape
    tgt = targets.unsqueeze(-1).expand(B, S, T)  # [B, S, T]
    return F.cross_entropy(logits.reshape(-1, V), tgt.reshape(-1), ignore_index=IGNORE,
                           reduction="none").view(B, S, T)


def regime_loss(cfg: RegimeConfig, logits: torch.Tensor, targets: torch.Tensor,
                gate_logits: torch.Tensor | None) -> torch.Tensor:
    """Training loss of a regime, averaged over scored tokens.

    Args:
        cfg: the regime.
        logits: [batch, seq, loop, vocab] per-loop readouts.
        targets: [batch, seq] target ids (``IGNORE`` where not scored).
        gate_logits: [batch, seq, loop] (joint only).

    Returns:
        Scalar loss.
    """
    T = logits.shape[2]
    mask = (targets != IGNORE).float()  # [B, S]
    n = mask.sum().clamp_min(1.0)
    ell = per_depth_loss(logits, targets)  # [B, S, T]
    if cfg.kind != "joint":
        w = prior_weights(T, cfg).to(ell)  # [T]
        return ((ell * w).sum(-1) * mask).sum() / n
    if gate_logits is None:
        raise ConfigError("joint regime needs a model with a halting gate (model gate is 'none')")
    q = halting_distribution(gate_logits)  # [B, S, T]
    pi = prior_weights(T, cfg).to(q)  # [T]
    kl = (q * (torch.log(q.clamp_min(1e-12)) - torch.log(pi))).sum(-1)  # KL(q ‖ π), [B, S]
    per_tok = (q * ell).sum(-1) + cfg.beta * kl
    return (per_tok * mask).sum() / n
