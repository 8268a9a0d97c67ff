"""The PonderNet objective (SPEC §5) on frozen per-depth losses: a small torch gate trained on it."""

from __future__ import annotations

import numpy as np

from looptrace.gates.config import Q_FLOOR, PonderConfig


def ponder_prior(T: int, prior: str = "uniform", lam: float = 0.3):
    """π over depths [T] (torch float32), via ``looptrace.models.regimes.prior_weights`` (joint regime's prior)."""
    # lazy: torch: only a PonderNet gate needs it; importing looptrace.gates loads no torch
    from looptrace.models.regimes import RegimeConfig, prior_weights

    return prior_weights(T, RegimeConfig(kind="joint", prior=prior, lam=lam))


def ponder_loss(gate_logits, loss, beta: float, prior):
    """Mean over tokens of Σ_t q_t ℓ_t + β KL(q ‖ π) (SPEC §5), q from ``signals.halting_torch.halting_distribution``.

    Args:
        gate_logits: [token, loop] torch tensor g_t (λ_t = σ(g_t)).
        loss: [token, loop] frozen ℓ_t (nats), same dtype.
        beta: KL weight.
        prior: [loop] π.

    Returns:
        Scalar tensor (nats).
    """
    # lazy: torch: only a PonderNet gate needs it; importing looptrace.gates loads no torch
    import torch

    from looptrace.signals.halting_torch import halting_distribution

    q = halting_distribution(gate_logits)
    pi = prior.to(q)
    kl = (q * (torch.log(q.clamp_min(Q_FLOOR)) - torch.log(pi))).sum(-1)
    return ((q * loss).sum(-1) + beta * kl).mean()


def _ponder_module(n_features: int, arch: str, hidden: int):
    """The gate g: features [..., F] -> logit [...] (linear, or Linear-ReLU-Linear)."""
    # lazy: torch: only a PonderNet gate needs it; importing looptrace.gates loads no torch
    from torch import nn

    class PonderGate(nn.Module):
        """g(x_t): linear or 2-layer MLP halting-logit head on per-loop features."""

        def __init__(self) -> None:
            super().__init__()
            self.n_features, self.arch, self.hidden = n_features, arch, hidden
            self.net: nn.Module
            if arch == "linear":
                self.net = nn.Linear(n_features, 1)
            else:
                self.net = nn.Sequential(nn.Linear(n_features, hidden), nn.ReLU(), nn.Linear(hidden, 1))

        def forward(self, x):  # x [..., F] -> [...]
            return self.net(x).squeeze(-1)

    return PonderGate()


def fit_ponder(X: np.ndarray, loss: np.ndarray, arch: str, cfg: PonderConfig, seed: int):
    """Train a PonderNet gate on frozen per-depth losses.

    Args:
        X: [token, loop, feature] standardised features (all T loops).
        loss: [token, loop] ℓ_t (nats).
        arch: ``linear`` | ``mlp``.
        cfg: objective and optimiser settings.
        seed: initialisation and batch-order seed (the global torch RNG is left untouched).

    Returns:
        (module in eval mode, dict with the final fit objective and mean halting depth Σ t q_t).
    """
    # lazy: torch: only a PonderNet gate needs it; importing looptrace.gates loads no torch
    import torch

    from looptrace.signals.halting_torch import halting_distribution

    n, T, F = X.shape
    xt = torch.as_tensor(np.ascontiguousarray(X), dtype=torch.float32)
    lt = torch.as_tensor(np.ascontiguousarray(loss), dtype=torch.float32)
    prior = ponder_prior(T, cfg.prior, cfg.lam)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = _ponder_module(F, arch, cfg.hidden)
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    bs = min(cfg.batch_tokens, n)
    for _ in range(cfg.epochs):
        perm = torch.randperm(n, generator=gen)
        for lo in range(0, n, bs):
            idx = perm[lo:lo + bs]
            obj = ponder_loss(model(xt[idx]), lt[idx], cfg.beta, prior)
            opt.zero_grad(set_to_none=True)
            obj.backward()
            opt.step()
    model.eval()
    with torch.no_grad():
        g = model(xt)
        obj = float(ponder_loss(g, lt, cfg.beta, prior))
        depth = float((halting_distribution(g) * torch.arange(1, T + 1, dtype=g.dtype)).sum(-1).mean())
    return model, {"objective": obj, "mean_halting_depth": depth}
