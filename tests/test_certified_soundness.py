"""The certified fixed-point exit is sound (SPEC §2b, [BA]): on an exactly affine loop map h ← A h + b built from
looptrace's own LoopedTransformer (its looped layer replaced by x ↦ A x + c; the ``add`` loop form feeds it h + h_0,
so b = A h_0 + c per token) with the fixed point in closed form, h* = (I − A)⁻¹ b, the bound b_t = r_t·ρ̄_t/(1 − ρ̄_t)
the loopmap stage computes never undercuts the true relative distance ‖h_t − h*‖/‖h_t‖, on any (token, loop), for
symmetric A (singular values 0.9 and 0.85 on top, positive, negative and mixed spectra), a non-normal A and A = cI;
no token is certified outside ε. The power-method estimate (what ρ_t was before, and still is beyond
``exact_width``) does undercut on the same map: that is why it is called estimated."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from looptrace.capture.loopmap import LoopmapConfig, frontier_table, measure
from looptrace.diagnose.loopmap import certified_exit
from looptrace.models.interface import LoopedTransformerAdapter
from looptrace.models.looped import GroupConfig, LoopedTransformer, ModelConfig
from looptrace.signals.certified import certified_bound

D, T, S, V = 6, 14, 5, 7
EPS = (0.3, 0.1, 0.03, 0.01, 0.003, 0.001)


class AffineLayer(nn.Module):
    """x ↦ A x + c on every position (positions never mix), in the looped block's layer slot."""

    def __init__(self, A: np.ndarray, c: np.ndarray):
        super().__init__()
        self.register_buffer("At", torch.as_tensor(A.T))
        self.register_buffer("c", torch.as_tensor(c))

    def forward(self, x: torch.Tensor, kv=None) -> torch.Tensor:
        return x @ self.At + self.c


def _orthogonal(rng: np.random.Generator) -> np.ndarray:
    return np.linalg.qr(rng.standard_normal((D, D)))[0]


def _matrices() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    q = _orthogonal(rng)
    nonnormal = rng.standard_normal((D, D)) + 2 * np.eye(D)
    nonnormal = nonnormal @ np.diag([0.8, 0.7, -0.6, 0.5, 0.3, -0.1]) @ np.linalg.inv(nonnormal)
    nonnormal *= 0.93 / np.linalg.norm(nonnormal, 2)  # ‖A‖₂ < 1, with ρ(A) well below it
    return {
        "symmetric_positive": q @ np.diag([0.9, 0.85, 0.6, 0.4, 0.2, 0.05]) @ q.T,
        "symmetric_negative": q @ np.diag([-0.9, -0.85, -0.6, -0.4, -0.2, -0.05]) @ q.T,
        "symmetric_mixed": q @ np.diag([0.9, -0.85, 0.6, -0.4, 0.2, -0.05]) @ q.T,
        "nonnormal": nonnormal,
        "scaled_identity": 0.6 * np.eye(D),
        "negative_identity": -0.5 * np.eye(D),
    }


def _affine_model(A: np.ndarray, seed: int = 1) -> LoopedTransformerAdapter:
    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=V, block_size=S, d_model=D, n_head=2, groups=(GroupConfig(1, T),), loop_form="add",
                      reinject=True)
    model = LoopedTransformer(cfg)
    rng = np.random.default_rng(seed)
    model.blocks[0] = nn.ModuleList([AffineLayer(A, rng.standard_normal(D))])
    with torch.no_grad():  # embeddings of order 1 (the init's 0.02 would start every token next to h* = ...)
        model.wte.weight.normal_(0.0, 2.0)
        model.wpe.weight.normal_(0.0, 1.0)
    return LoopedTransformerAdapter(model.double(), "affine")


def _closed_form(adapter: LoopedTransformerAdapter, A: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """True ‖h_t − h*‖/‖h_t‖ [token, loop]: h* = (I − A)⁻¹(A h_0 + c), h_t = h* + A^t (h_0 − h*), in float64."""
    model = adapter.model
    h0 = model.embed(torch.as_tensor(tokens)).detach().numpy().reshape(-1, D)  # [token, d] (no prelude)
    c = model.blocks[0][0].c.numpy()
    hstar = np.linalg.solve(np.eye(D) - A, (h0 @ A.T + c).T).T
    ht = np.stack([hstar + (h0 - hstar) @ np.linalg.matrix_power(A, t).T for t in range(1, T + 1)], 1)
    return np.linalg.norm(ht - hstar[:, None], axis=-1) / np.linalg.norm(ht, axis=-1)


def _sample(n: int = 8) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(2)
    return rng.integers(0, V, (n, S)), rng.integers(0, V, (n, S))


@pytest.mark.parametrize("name", list(_matrices()))
def test_the_bound_never_undercuts_the_true_distance(name):
    A = _matrices()[name]
    adapter = _affine_model(A)
    tokens, targets = _sample()
    cfg = LoopmapConfig(sequences=len(tokens), batch_size=3, power_iters=2, loops=(), patch=False, n_boot=0, eps=EPS)
    raw = measure(adapter, tokens, targets, cfg, seed=0, progress=False)
    true = _closed_form(adapter, A, tokens)
    norm = np.linalg.norm(A, 2)
    assert raw["exact"] and (raw["rho_bound"] >= norm).all()  # an upper bound of ‖A‖₂ on every (token, loop)
    assert (raw["rho_bound"] <= norm * (1 + 1e-6)).all()  # and a tight one (float32 rounding up)
    bound = certified_bound(raw["rho_bound"], raw["rel_step"])
    assert np.isfinite(bound).all() and true.min() > 1e-9  # every pair compared, none at h* to rounding
    # float64 rounding of the states and of the closed form is ~1e-15 relative; the bound's own margin is larger
    assert (bound >= true * (1 - 1e-12)).all(), float((bound / true).min())
    ratio = bound / true
    c = A[0, 0]
    if name.endswith("identity"):  # A = cI: the ratio is |c − 1|/(1 − |c|): 1 (tight) for c ≥ 0, 3 for c = −0.5
        np.testing.assert_allclose(ratio, abs(c - 1) / (1 - abs(c)), rtol=1e-6)
    # no token certified outside ε: at the certified exit loop the true distance is ≤ ε
    for eps in EPS:
        depth = certified_exit(bound, eps)
        fired = (bound <= eps).any(axis=1)
        at = true[np.arange(len(depth)), depth - 1]
        assert (at[fired] <= eps * (1 + 1e-12)).all(), (eps, float(at[fired].max(initial=0) / eps))
    fr = frontier_table("affine", raw, cfg)
    assert "certified_fixed_point" in set(fr["rule"]) and "estimated_fixed_point" not in set(fr["rule"])
    # it does certify (but on the negative spectrum: there the bound is ≥ |−0.9 − 1|/(1 − 0.9) = 19× the distance
    # along the top direction, out of reach of ε ≤ 0.3 in T loops)
    shared = fr.filter(fr["rule"] == "certified_fixed_point")["share_certified"].max()
    assert shared > 0 or name == "symmetric_negative"


def test_the_power_method_estimate_undercuts_so_it_is_only_an_estimate():
    """ρ_t from 2 power iterations (a lower bound of ‖A‖₂) in the same formula: the bound falls below the true
    distance on some pairs of the symmetric 0.9/0.85 map (the unsound certificate this replaces); beyond
    exact_width the stage names that exit estimated."""
    A = _matrices()["symmetric_positive"]
    adapter = _affine_model(A)
    tokens, targets = _sample()
    cfg = LoopmapConfig(sequences=len(tokens), batch_size=8, power_iters=2, exact_width=D - 1, loops=(), patch=False,
                        n_boot=0, eps=EPS)
    raw = measure(adapter, tokens, targets, cfg, seed=0, progress=False)
    assert not raw["exact"] and np.isnan(raw["rho_bound"]).all()
    assert (raw["rho"] <= np.linalg.norm(A, 2) * (1 + 1e-6)).all() and (raw["rho"] < 0.9 - 1e-3).any()
    est = certified_bound(raw["rho"], raw["rel_step"])
    assert (est < _closed_form(adapter, A, tokens) * (1 - 1e-3)).any()
    assert "estimated_fixed_point" in set(frontier_table("affine", raw, cfg)["rule"])
