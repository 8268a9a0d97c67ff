"""Depth-supervision regimes (SPEC §5): how the per-depth losses ℓ_1..ℓ_T are combined in training.

- ``final``: ℓ_T only.
- ``uniform``: (1/T) Σ_t ℓ_t.
- ``geometric`` (λ): Σ_t π_t ℓ_t with π_t = λ(1−λ)^{t−1} for t < T, π_T = (1−λ)^{T−1} ([AD]).
- ``joint`` (PonderNet / Ouro stage I): λ_t = σ(gate_t), q_t = λ_t Π_{j<t}(1−λ_j) for t < T,
  q_T = Π_{j<T}(1−λ_j); L = Σ_t q_t ℓ_t + β KL(q ‖ π), π uniform or geometric(λ).
- ``recurtrace`` ([RT] halting head): the trajectory learns under the fixed prior π (uniform or geometric(λ)), the
  gate learns by BCE on the oracle labels of SPEC §6 (stop_t = 1 − continue_t, continue_t =
  1[min_{t'>t} ℓ_t' < ℓ_t − δ], from the current ℓ without gradient): L = Σ_t π_t ℓ_t + w (1/T) Σ_t BCE(g_t, stop_t).
  ``detach`` (default): the head's gradient stops at the state and the shared norm ([AD]'s decoupling); false: it
  flows into the trajectory.
- ``act`` (Graves 2016, Adaptive Computation Time): halting units λ_t = σ(gate_t); N = min{n : Σ_{t≤n} λ_t ≥ 1 − ε}
  (T if never); remainder R = 1 − Σ_{t<N} λ_t; p_t = λ_t (t < N), p_N = R, 0 after N; the output is the
  mean field of the per-loop outputs, z̄ = Σ_t p_t z_t (Graves eq. 12, logits), L = CE(z̄, y) + τ (N + R) (ponder
  cost; N is piecewise constant, the gradient flows through R).

The gate logit of every gated regime is a *stop* logit: σ(gate_t) is the probability of halting at t given t was
reached, which is what the store's ``gate_logit`` and the native exit rules read (q_exit; ``gate_step`` and
``act_exit`` of :mod:`looptrace.rules.native_halting`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Annotated

import torch
from torch.nn import functional as F

from looptrace.config import OMIT_DEFAULT, Check, ConfigError, NonNegFloat, one_of
from looptrace.signals.halting import ACT_EPS
from looptrace.signals.halting_torch import halting_distribution
from looptrace.tasks import IGNORE

KINDS = ("final", "uniform", "geometric", "joint", "recurtrace", "act")
#: Regimes whose model has a halting gate.
GATED_KINDS = ("joint", "recurtrace", "act")
# (The exit rule each gated kind's head is trained for, and each kind's source: looptrace.rules.native_halting
# NATIVE_EXITS / REGIME_SOURCES, torch-free for the offline stages.)


@dataclass(frozen=True)
class RegimeConfig:
    """One regime definition (``train.regime_defs.<name>`` in ``params.yaml``).

    Attributes:
        kind: final | uniform | geometric | joint | recurtrace | act (module docstring).
        lam: λ of the geometric weights (geometric, and the geometric prior of joint / recurtrace).
        prior: joint / recurtrace: uniform | geometric.
        gate: joint / recurtrace / act: linear | mlp (the model's halting gate).
        beta: joint only: weight of KL(q ‖ π).
        delta: recurtrace: the oracle's required improvement δ (nats; SPEC §6 ``oracle``).
        detach: recurtrace: the head's gradient stops at the state (true) or flows into the trajectory (false).
        head_weight: recurtrace: weight w of the head's BCE.
        tau: act: ponder-cost weight τ.
        eps: act: ε of the halting threshold 1 − ε (Graves: 0.01).
        loop_memory: pins ``train.model.loop_memory`` for this regime's models (null: the model section's), so
            one matrix trains a method with and without [RT]'s loop memory.

    The fields after ``beta`` are left out of the recorded dict while at their defaults (``OMIT_DEFAULT``): the
    checkpoints of the regimes that existed before them keep their bytes.
    """

    kind: Annotated[str, one_of(*KINDS)]
    lam: Annotated[float, Check(gt=0, lt=1, why="the geometric λ")] = 0.3
    prior: Annotated[str, one_of("uniform", "geometric")] = "uniform"
    gate: Annotated[str, one_of("linear", "mlp")] = "linear"
    beta: NonNegFloat = 0.1
    delta: NonNegFloat = field(default=0.01, metadata=OMIT_DEFAULT)
    detach: bool = field(default=True, metadata=OMIT_DEFAULT)
    head_weight: NonNegFloat = field(default=1.0, metadata=OMIT_DEFAULT)
    tau: NonNegFloat = field(default=0.01, metadata=OMIT_DEFAULT)
    eps: float = field(default=ACT_EPS, metadata=OMIT_DEFAULT)
    loop_memory: bool | None = field(default=None, metadata=OMIT_DEFAULT)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ConfigError(f"regime kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if self.kind in ("joint", "recurtrace") and self.prior not in ("uniform", "geometric"):
            raise ConfigError(f"{self.kind} regime prior must be uniform or geometric, got {self.prior!r}")
        if self.kind in GATED_KINDS and self.gate not in ("linear", "mlp"):
            raise ConfigError(f"{self.kind} regime gate must be linear or mlp, got {self.gate!r}")
        if not 0.0 < self.lam < 1.0:
            raise ConfigError(f"regime lam must be in (0, 1), got {self.lam}")
        if not 0.0 < self.eps < 1.0:
            raise ConfigError(f"regime eps (ACT's halting threshold 1 − eps) must be in (0, 1), got {self.eps}")

    @property
    def model_gate(self) -> str:
        """The halting gate the model needs under this regime."""
        return self.gate if self.kind in GATED_KINDS else "none"


def geometric_weights(T: int, lam: float) -> torch.Tensor:
    """π_t = λ(1−λ)^{t−1} (t < T), π_T = (1−λ)^{T−1}: [T], sums to 1."""
    t = torch.arange(T, dtype=torch.float64)
    w = lam * (1 - lam) ** t
    w[-1] = (1 - lam) ** (T - 1)
    return w.float()


def prior_weights(T: int, cfg: RegimeConfig) -> torch.Tensor:
    """The fixed prior π over depths [T] for ``uniform``/``geometric`` (and joint's prior)."""
    if cfg.kind == "uniform" or (cfg.kind in ("joint", "recurtrace") and cfg.prior == "uniform"):
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
        gate_logits: [batch, seq, loop] stop logits (gated kinds only; ``looptrace.models.train.training_gate_logits``).

    Returns:
        Scalar loss.
    """
    T = logits.shape[2]
    mask = (targets != IGNORE).float()  # [B, S]
    n = mask.sum().clamp_min(1.0)
    if cfg.kind == "act":
        if gate_logits is None:
            raise ConfigError("act regime needs a model with a halting gate (model gate is 'none')")
        return (act_loss(logits, targets, gate_logits, cfg.eps, cfg.tau) * mask).sum() / n
    ell = per_depth_loss(logits, targets)  # [B, S, T]
    if cfg.kind == "recurtrace":
        if gate_logits is None:
            raise ConfigError("recurtrace regime needs a model with a halting gate (model gate is 'none')")
        w = prior_weights(T, cfg).to(ell)  # [T]
        per_tok = (ell * w).sum(-1) + cfg.head_weight * oracle_head_loss(gate_logits, ell, cfg.delta)
        return (per_tok * mask).sum() / n
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


def oracle_continue_torch(ell: torch.Tensor, delta: float) -> torch.Tensor:
    """RecurTrace oracle labels (SPEC §6 ``oracle``): continue_t = 1[min_{t'>t} ℓ_t' < ℓ_t − δ] on [..., loop]
    losses (no gradient); False at t = T. The torch twin of ``looptrace.gates.labels.oracle_continue``."""
    ell = ell.detach()
    suffix = torch.cummin(ell.flip(-1), dim=-1).values.flip(-1)  # min_{t' ≥ t}
    future = torch.full_like(ell, math.inf)
    future[..., :-1] = suffix[..., 1:]  # min_{t' > t}
    return future < ell - delta


def oracle_head_loss(gate_logits: torch.Tensor, ell: torch.Tensor, delta: float) -> torch.Tensor:
    """[RT] halting head loss per token: (1/T) Σ_t BCE(σ(g_t), stop_t), stop_t = 1 − continue_t.

    Args:
        gate_logits: [batch, seq, loop] stop logits.
        ell: [batch, seq, loop] per-depth losses (the labels are computed from them without gradient).
        delta: the oracle's δ (nats).

    Returns:
        [batch, seq] mean BCE over loops.
    """
    stop = (~oracle_continue_torch(ell, delta)).to(gate_logits.dtype)
    return F.binary_cross_entropy_with_logits(gate_logits, stop, reduction="none").mean(-1)


def act_halting(gate_logits: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ACT's halting distribution (Graves 2016, eqs. 7–10) from stop logits [..., T].

    Returns:
        (p [..., T] the halting weights (λ_t before N, R at N, 0 after), N [...] int64 1-based halting loop,
        R [...] remainder).
    """
    T = gate_logits.shape[-1]
    lam = torch.sigmoid(gate_logits)  # λ_t
    cum = torch.cumsum(lam, dim=-1)  # Σ_{j≤t} λ_j
    reached = cum[..., :-1] >= 1.0 - eps  # halting before T (at T the loop ends anyway)
    first = torch.where(reached.any(-1), reached.int().argmax(-1) + 1, torch.full_like(cum[..., 0], T, dtype=torch.int64))
    t = torch.arange(1, T + 1, device=gate_logits.device)
    before = t < first.unsqueeze(-1)  # t < N
    R = 1.0 - (lam * before).sum(-1)  # remainder
    p = torch.where(before, lam, torch.zeros_like(lam)) + R.unsqueeze(-1) * (t == first.unsqueeze(-1))
    return p, first, R


def act_loss(logits: torch.Tensor, targets: torch.Tensor, gate_logits: torch.Tensor, eps: float,
             tau: float) -> torch.Tensor:
    """ACT's loss per token: CE(Σ_t p_t z_t, y) + τ (N + R) (Graves 2016: mean-field output, ponder cost).

    Args:
        logits: [batch, seq, loop, vocab]; targets: [batch, seq]; gate_logits: [batch, seq, loop] stop logits.

    Returns:
        [batch, seq] (0 at unscored positions' cross-entropy; callers mask them).
    """
    p, N, R = act_halting(gate_logits, eps)
    z = (p.unsqueeze(-1) * logits).sum(2)  # [B, S, V] mean-field output
    ce = F.cross_entropy(z.reshape(-1, z.shape[-1]), targets.reshape(-1), ignore_index=IGNORE,
                         reduction="none").view(targets.shape)
    return ce + tau * (N.to(R.dtype) + R)

