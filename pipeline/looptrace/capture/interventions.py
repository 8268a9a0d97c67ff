"""Intervention windows: perturb the state after loop k, re-run loops k+1..T, and measure how the effect decays with
the number of loops j after it (SPEC §2b "intervention window"; a capture-side computation: it runs the model).

For a batch of sequences with states h_0..h_T (the capture's), an intervention at loop k replaces h_k by h'_k =
h_k + δ on every position of every sequence at once:

- ``noise``: δ[i] = s·‖h_k[i]‖·ξ_i/‖ξ_i‖, ξ Gaussian: noise of relative scale s per token, each sequence's ξ drawn
  from (seed, k, the sequence's index in the split) — never the same draw for two sequences, whatever the batching;
- ``patch``: h'_k[b, i] = h_k[π(b), i], the state of another sequence's token at the same position and loop
  (activation patching across the loop axis). π is a seeded derangement — one random cycle through the given
  sequences, drawn from (seed, k, their indices) (:func:`patch_donors`); the loopmap stage draws it once over its
  whole sample and passes each batch its donors' states, so a token's donor does not depend on the batching.

Then h'_{k+j} = F_{k+j}(h'_{k+j−1}) through the model's own loop step, and per token and j = 1..T − k:

- state effect e_j[i] = ‖h'_{k+j}[i] − h_{k+j}[i]‖ / ‖δ[i]‖ (h_{k+j} re-run from h_k by the same code) (1 at j = 0; the decay of the perturbation);
- readout effect KL(p_{k+j} ‖ p'_{k+j}) of the exit readout at loop k + j, and the argmax flip
  1[argmax p'_{k+j} ≠ argmax p_{k+j}] (the answer changed);
- linearised prediction ê_j[i] = ‖(J_{k+j} ⋯ J_{k+1} δ)[i]‖ / ‖δ[i]‖, the JVP chain of SPEC §2b's Jacobians
  (exact for a linear map: there e_j = ‖A^j δ‖/‖δ‖).

The *window* is the smallest j at which the median state effect falls below a threshold (T − k + 1 = never).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch.nn import functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from looptrace.config import ConfigError

#: Intervention kinds.
KINDS = ("noise", "patch")
_EPS = 1e-30


@dataclass(frozen=True)
class InterventionConfig:
    """One intervention.

    Attributes:
        loop: k, the loop whose output is perturbed (0 = h_0, the state entering loop 1; at most T − 1).
        kind: ``noise`` or ``patch``.
        scale: relative size s of the noise (``noise``); 0 changes nothing.
        threshold: the state effect below which the perturbation counts as gone (the window).
        seed: seed of the noise / the patching permutation.
    """

    loop: int = 1
    kind: str = "noise"
    scale: float = 0.1
    threshold: float = 0.1
    seed: int = 0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ConfigError(f"intervention.kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if self.loop < 0:
            raise ConfigError(f"intervention.loop must be >= 0, got {self.loop}")
        if self.scale < 0:
            raise ConfigError(f"intervention.scale must be >= 0, got {self.scale}")


def patch_donors(rows: np.ndarray, seed: int, loop: int) -> np.ndarray:
    """π for :data:`KINDS` ``patch``: the donor of each of ``rows`` (sequence indices, ≥ 2 of them), another of them.

    One random cycle through ``rows`` (a derangement: nobody keeps its own), drawn from (seed, loop, rows), so
    another set of sequences gets another pattern.

    Returns:
        [len(rows)] int64, the donor's index in the split for each row.
    """
    rows = np.asarray(rows, dtype=np.int64).reshape(-1)
    if rows.shape[0] < 2:
        raise ConfigError("intervention.kind patch needs at least 2 sequences (a token is patched with another "
                          "sequence's state)")
    order = np.random.default_rng([int(seed), int(loop), *map(int, rows)]).permutation(rows.shape[0])
    donor = np.empty_like(order)
    donor[order] = order[np.r_[1:order.shape[0], 0]]  # each one's successor on the cycle
    return rows[donor]


def perturbation(h_k: torch.Tensor, cfg: InterventionConfig, rows: np.ndarray | None = None,
                 donor: torch.Tensor | None = None) -> torch.Tensor:
    """δ [batch, seq, d] of the intervention on h_k [batch, seq, d] (module docstring).

    Args:
        h_k: the states after loop k.
        cfg: the intervention.
        rows: [batch] each sequence's index in the split (seeds its noise, or the within-batch patch); None =
            0..batch − 1.
        donor: ``patch`` only: [batch, seq, d] the donor sequences' states after loop k (the loopmap stage's,
            from :func:`patch_donors` over its sample); None = a :func:`patch_donors` derangement within the batch.
    """
    B = h_k.shape[0]
    rows = np.arange(B) if rows is None else np.asarray(rows, dtype=np.int64).reshape(-1)
    if rows.shape[0] != B:
        raise ValueError(f"rows: one index per sequence of the batch ({B}), got {rows.shape[0]}")
    if cfg.kind == "noise":
        xi = np.stack([np.random.default_rng([int(cfg.seed), int(cfg.loop), int(r)]).standard_normal(h_k.shape[1:])
                       for r in rows])
        x = torch.from_numpy(xi).to(h_k)
        x = x / x.norm(dim=-1, keepdim=True).clamp_min(_EPS)
        return cfg.scale * h_k.norm(dim=-1, keepdim=True) * x
    if donor is None:
        local = {int(r): b for b, r in enumerate(rows)}
        perm = [local[int(d)] for d in patch_donors(rows, cfg.seed, cfg.loop)]
        donor = h_k[torch.as_tensor(perm, device=h_k.device)]
    if donor.shape != h_k.shape:
        raise ValueError(f"donor states must be shaped as h_k {tuple(h_k.shape)}, got {tuple(donor.shape)}")
    return donor - h_k


def intervene(step: Callable[[torch.Tensor, int], torch.Tensor], hidden_init: torch.Tensor, hidden: torch.Tensor,
              cfg: InterventionConfig, readout: Callable[[torch.Tensor, int], torch.Tensor] | None = None,
              rows: np.ndarray | None = None, donor: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Run one intervention and measure its decay (module docstring).

    Args:
        step: the loop step (h_{t−1}, t 0-based) -> h_t.
        hidden_init: [batch, seq, d] h_0.
        hidden: [batch, seq, loop, d] h_1..h_T.
        cfg: the intervention.
        readout: (h_t, t) -> logits [batch, seq, vocab]; None = no readout effect.
        rows, donor: the sequences' indices in the split and (``patch``) the donors' states after loop k
            (:func:`perturbation`).

    Returns:
        ``state`` e_j, ``linear`` ê_j and (with ``readout``) ``kl`` and ``flip`` (0/1) — each [batch, seq, T − k]
        float32, column j − 1
        for j = 1..T − k — and ``delta_norm`` [batch, seq] ‖δ‖.
    """
    T = hidden.shape[2]
    k = cfg.loop
    if k >= T:
        raise ConfigError(f"intervention.loop must be < T = {T} (a perturbation after the last loop has no effect "
                          f"to measure), got {k}")
    with torch.inference_mode(False), torch.no_grad(), sdpa_kernel(SDPBackend.MATH):
        h_all = hidden.clone()
        h_k = hidden_init.clone() if k == 0 else h_all[:, :, k - 1]
        delta = perturbation(h_k, cfg, rows, donor)
        dn = delta.norm(dim=-1)
        denom = dn.clamp_min(_EPS)[..., None]
        # the reference re-runs loops k+1..T from h_k through the same code (and attention kernel) as the perturbed
        # run, so a size-0 intervention gives exactly zero effect instead of the kernels' rounding differences
        h_p, tangent, h_ref = h_k + delta, delta, h_k
        state, linear, kl, flip = [], [], [], []
        for t in range(k, T):
            h_p = step(h_p, t)
            pushed = torch.func.jvp(lambda x, t=t: step(x, t), (h_ref,), (tangent,))
            h_ref, tangent = pushed[0], pushed[1]
            state.append(((h_p - h_ref).norm(dim=-1, keepdim=True) / denom)[..., 0])
            linear.append((tangent.norm(dim=-1, keepdim=True) / denom)[..., 0])
            if readout is not None:
                lp, lq = F.log_softmax(readout(h_ref, t).float(), -1), F.log_softmax(readout(h_p, t).float(), -1)
                kl.append((lp.exp() * (lp - lq)).sum(-1))
                flip.append((lp.argmax(-1) != lq.argmax(-1)).float())
        zero = (dn == 0)[..., None]  # no perturbation: no effect (not 0/0)
        out = {"state": torch.stack(state, -1).masked_fill(zero, 0.0).float(),
               "linear": torch.stack(linear, -1).masked_fill(zero, 0.0).float(), "delta_norm": dn.float()}
        if readout is not None:
            out["kl"] = torch.stack(kl, -1).float()
            out["flip"] = torch.stack(flip, -1)
        return out


def window_summary(effect: np.ndarray, threshold: float, level: float = 0.95) -> dict:
    """Median and central ``level`` interval over tokens of an effect [token, J], and the window length.

    Returns:
        ``median``, ``lo``, ``hi`` [J] and ``window``: the smallest j (1-based) with median ≤ threshold, J + 1 if none.
    """
    e = np.asarray(effect, dtype=np.float64)
    a = (1 - level) / 2
    med = np.median(e, axis=0)
    below = np.flatnonzero(med <= threshold)
    return {"median": med, "lo": np.quantile(e, a, axis=0), "hi": np.quantile(e, 1 - a, axis=0),
            "window": int(below[0]) + 1 if below.size else e.shape[1] + 1}


def adapter_intervention(adapter, input_ids: torch.Tensor, cfg: InterventionConfig) -> dict[str, torch.Tensor]:
    """:func:`intervene` on a model behind the dump's interface (its ``loop_step`` and ``readout``)."""
    st = adapter.states(input_ids.to(adapter.device))
    h0 = st.hidden_init
    return intervene(lambda h, t: adapter.loop_step(h, h0, t), h0, st.hidden, cfg,
                     readout=lambda h, t: adapter.readout(h, t))


__all__ = ["InterventionConfig", "KINDS", "adapter_intervention", "intervene", "patch_donors", "perturbation",
           "window_summary"]
