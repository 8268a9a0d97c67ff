"""Depth-supervision regimes against closed forms (SPEC §5)."""

import math

import torch

from looptrace.models.regimes import (
    RegimeConfig,
    geometric_weights,
    halting_distribution,
    per_depth_loss,
    regime_loss,
)


def test_geometric_weights_closed_form():
    w = geometric_weights(4, 0.3)
    expect = [0.3, 0.3 * 0.7, 0.3 * 0.49, 0.7**3]
    assert torch.allclose(w, torch.tensor(expect), atol=1e-7)
    assert math.isclose(float(w.sum()), 1.0, rel_tol=1e-6)
    # SPEC §5's convention: the last loop takes the tail mass (1 − λ)^{T−1}, 0.168 at T = 6, λ = 0.3 — not the
    # truncated-renormalised λ(1 − λ)^{T−1} / (1 − (1 − λ)^T) = 0.057
    w6 = geometric_weights(6, 0.3)
    assert round(float(w6[-1]), 3) == 0.168 and math.isclose(float(w6[-1]), 0.7**5, rel_tol=1e-6)
    assert round(0.3 * 0.7**5 / (1 - 0.7**6), 3) == 0.057


def test_halting_distribution_hand_case():
    lam = torch.tensor([0.5, 0.25, 0.9])
    q = halting_distribution(torch.logit(lam))
    # q1 = 0.5, q2 = 0.25 * 0.5, q3 = remaining mass (whatever gate_3 is)
    assert torch.allclose(q, torch.tensor([0.5, 0.125, 0.375]), atol=1e-6)


def _logits_with_losses(losses):
    """[1, 1, T, 2] logits whose per-depth CE against target 0 is exactly `losses`."""
    # CE = log(1 + e^{-d}) for logit gap d -> d = -log(e^{l} - 1)
    d = torch.tensor([-math.log(math.exp(x) - 1) for x in losses])
    z = torch.stack([d, torch.zeros_like(d)], -1)
    return z.view(1, 1, len(losses), 2)


def test_losses_match_hand_computation():
    ell = [1.0, 0.5, 0.25]
    z, y = _logits_with_losses(ell), torch.tensor([[0]])
    assert torch.allclose(per_depth_loss(z, y).flatten(), torch.tensor(ell), atol=1e-5)
    assert math.isclose(regime_loss(RegimeConfig("final"), z, y, None).item(), 0.25, rel_tol=1e-4)
    assert math.isclose(regime_loss(RegimeConfig("uniform"), z, y, None).item(), 1.75 / 3, rel_tol=1e-4)
    geo = 0.5 * 1.0 + 0.25 * 0.5 + 0.25 * 0.25
    assert math.isclose(regime_loss(RegimeConfig("geometric", lam=0.5), z, y, None).item(), geo, rel_tol=1e-4)
    # joint: q from gates, plus beta * KL(q || uniform)
    gates = torch.logit(torch.tensor([0.5, 0.5, 0.5])).view(1, 1, 3)
    q = [0.5, 0.25, 0.25]
    kl = sum(qi * math.log(qi * 3) for qi in q)
    expect = sum(qi * li for qi, li in zip(q, ell, strict=True)) + 0.1 * kl
    got = regime_loss(RegimeConfig("joint", beta=0.1), z, y, gates).item()
    assert math.isclose(got, expect, rel_tol=1e-4)


def test_ignored_positions_do_not_count():
    z = torch.randn(2, 3, 4, 5)
    y = torch.tensor([[1, -100, 2], [-100, -100, 0]])
    full = regime_loss(RegimeConfig("uniform"), z, y, None)
    manual = per_depth_loss(z, y)[y != -100].mean()
    assert torch.allclose(full, manual)
