"""Local contraction of the loop map, per token and loop, at capture time (SPEC §2b; opt-in ``dump.contraction``).

The loop map of a looped model is F_t: h_{t−1} ↦ h_t on a whole sequence ([seq, d_model]; attention mixes
positions). Two quantities of its Jacobian J_t = ∂F_t/∂h at h_{t−1}, both from Jacobian–vector products through the
model's own loop step (``torch.func.jvp`` forward mode and ``torch.func.vjp`` reverse mode; no finite differences):

- ``contraction`` ρ_t[i] = σ_max(J_t[i, i]), the top singular value of the position-diagonal block
  ∂h_t[i]/∂h_{t−1}[i] (how much the token's own state is stretched by one loop, the other positions held fixed),
  by the power method on J_ii^T J_ii [Golub & Van Loan §8.2; PI].
- ``ftle`` λ_t = (1/t) Σ_{s≤t} log ‖J_s u_{s−1}‖, u_s = J_s u_{s−1} / ‖J_s u_{s−1}‖: the finite-time Lyapunov
  exponent of the sequence by Benettin's method [BE] (one tangent vector per sequence, propagated through the full
  map — every position at once — and renormalised each loop), with ``ftle_share`` π_t[i] = ‖(J_t u_{t−1})[i]‖² /
  ‖J_t u_{t−1}‖², the position's share of the tangent after loop t. λ_t → log ρ(J) for a fixed linear map.

Why per-position tangents for the diagonal block. One JVP with a tangent v on every position returns
(J v)[i] = Σ_j J_ij v_j: attention mixes the positions, so the diagonal block cannot be read off it. A tangent that is
v_i at position i and zero elsewhere returns J_ii v_i exactly at position i (and a cotangent w_i at position i only
returns w_i^T J_ii at position i of the VJP). The S one-position tangents of a batch are pushed through one
``torch.vmap``-ed JVP (``position_chunk`` of them at a time, to bound memory), so one power iteration costs S
JVPs and S VJPs of the loop step; the top singular vector of loop t − 1 warm-starts loop t (the Jacobians of
consecutive loops are close), which is why a few iterations suffice. The alternative — rewriting every attention
layer so that tangents only flow through the own position (stop-gradients on the other positions' keys and
values) — costs one JVP per iteration but must be re-implemented inside each model family; this module needs
only the adapter's loop step (:meth:`looptrace.models.interface.LoopedModelAdapter.loop_step`).

Forward-mode AD of ``scaled_dot_product_attention`` exists for its math kernel only, so the JVPs run under
``sdpa_kernel(SDPBackend.MATH)``; the stored states are the ordinary forward's (this module never changes them).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from looptrace.config import ConfigError
from looptrace.io.store.schema import CONTRACTION_NAMES
from looptrace.models.interface import LoopedModelAdapter, States

#: The store arrays this module writes (each [token, loop] float32), in order.
CONTRACTION_ARRAYS = CONTRACTION_NAMES

#: A loop step: (h_{t−1} [batch, seq, d_model], loop t 0-based) -> h_t [batch, seq, d_model].
StepFn = Callable[[torch.Tensor, int], torch.Tensor]

_EPS = 1e-30  # below any float32 norm that matters: a zero tangent stays zero instead of NaN


@dataclass(frozen=True)
class ContractionConfig:
    """``dump.contraction`` section of params.yaml (absent/null = off: the store has no contraction arrays).

    Attributes:
        power_iters: power-method iterations on J_ii^T J_ii per loop (each one S JVPs + S VJPs of the loop step;
            warm-started from the previous loop's singular vector). ≥ 1.
        position_chunk: one-position tangents pushed through one vmapped JVP/VJP (bounds memory:
            ``position_chunk`` × the batch's activations).
        seed: seed of the initial tangent (Benettin) and power-method vectors; with the batch's first sequence
            index it makes every batch's draw reproducible and independent of the device.
    """

    power_iters: int = 4
    position_chunk: int = 16
    seed: int = 0

    def __post_init__(self) -> None:
        if self.power_iters < 1:
            raise ConfigError(f"dump.contraction.power_iters must be >= 1, got {self.power_iters}")
        if self.position_chunk < 1:
            raise ConfigError(f"dump.contraction.position_chunk must be >= 1, got {self.position_chunk}")


def _unit_rows(x: torch.Tensor) -> torch.Tensor:
    """x / ‖x‖ over the last axis."""
    return x / x.norm(dim=-1, keepdim=True).clamp_min(_EPS)


def _one_position(v: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """[batch, seq, d] -> [hi − lo, batch, seq, d]: tangent k is v at position lo + k and zero elsewhere."""
    n = hi - lo
    out = v.new_zeros((n, *v.shape))
    k = torch.arange(n, device=v.device)
    out[k, :, lo + k, :] = v[:, lo:hi, :].transpose(0, 1)
    return out


def _diagonal(r: torch.Tensor, lo: int) -> torch.Tensor:
    """[n, batch, seq, d] (result k of tangent at position lo + k) -> [batch, n, d]: each result at its own position."""
    k = torch.arange(r.shape[0], device=r.device)
    return r[k, :, lo + k, :].transpose(0, 1)


def diagonal_jvp(f: Callable[[torch.Tensor], torch.Tensor], h: torch.Tensor, v: torch.Tensor,
                 chunk: int) -> torch.Tensor:
    """J_ii v_i for every position i: [batch, seq, d] -> [batch, seq, d] (S one-position JVPs, vmapped)."""
    S = h.shape[1]
    out = torch.empty_like(v)

    def push(t: torch.Tensor) -> torch.Tensor:
        return torch.func.jvp(f, (h,), (t,))[1]

    with sdpa_kernel(SDPBackend.MATH):  # the only kernel with forward-mode AD (module docstring)
        for lo in range(0, S, chunk):
            hi = min(S, lo + chunk)
            out[:, lo:hi] = _diagonal(torch.vmap(push)(_one_position(v, lo, hi)), lo)
    return out


def diagonal_vjp(vjp_fn: Callable, w: torch.Tensor, chunk: int) -> torch.Tensor:
    """w_i^T J_ii for every position i: [batch, seq, d] -> [batch, seq, d] (S one-position VJPs, vmapped)."""
    S = w.shape[1]
    out = torch.empty_like(w)
    with sdpa_kernel(SDPBackend.MATH):
        for lo in range(0, S, chunk):
            hi = min(S, lo + chunk)
            out[:, lo:hi] = _diagonal(torch.vmap(lambda c: vjp_fn(c)[0])(_one_position(w, lo, hi)), lo)
    return out


def diagonal_block_norm(f: Callable[[torch.Tensor], torch.Tensor], h: torch.Tensor, v0: torch.Tensor,
                        iters: int, chunk: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """σ_max of every position-diagonal Jacobian block of ``f`` at ``h`` by the power method on J_ii^T J_ii.

    Args:
        f: the map, [batch, seq, d] -> [batch, seq, d].
        h: the point [batch, seq, d].
        v0: start vectors [batch, seq, d] (one per position; need not be unit).
        iters: power iterations (each: S JVPs, S VJPs); the estimate ‖J_ii v‖ after them costs S more JVPs.
        chunk: one-position tangents per vmapped call.

    Returns:
        (σ [batch, seq], v [batch, seq, d]): the estimate (a lower bound that increases to σ_max, error ∝
        (σ_2/σ_1)^{2·iters}) and the unit vectors it was measured on (the next loop's warm start).
    """
    with sdpa_kernel(SDPBackend.MATH):  # the VJP's saved graph is the math kernel's too
        vjp_fn = torch.func.vjp(f, h)[1]
    v = _unit_rows(v0)
    for _ in range(iters):
        w = diagonal_jvp(f, h, v, chunk)
        v = _unit_rows(diagonal_vjp(vjp_fn, w, chunk))
    return diagonal_jvp(f, h, v, chunk).norm(dim=-1), v


def _start_vectors(shape: tuple[int, ...], seed: int, first_row: int, device: torch.device,
                   dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Gaussian (Benettin tangent, power-method start) for one batch, drawn on the CPU from (seed, first row)."""
    rng = np.random.default_rng([int(seed), int(first_row)])
    u = torch.from_numpy(rng.standard_normal(shape)).to(device=device, dtype=dtype)
    v = torch.from_numpy(rng.standard_normal(shape)).to(device=device, dtype=dtype)
    return u, v


def contraction_stats(step: StepFn, hidden_init: torch.Tensor, hidden: torch.Tensor, cfg: ContractionConfig,
                      first_row: int = 0) -> dict[str, torch.Tensor]:
    """``contraction``, ``ftle`` and ``ftle_share`` of one batch (module docstring), every loop.

    Args:
        step: the loop step (h_{t−1}, t) -> h_t, differentiated with torch.func (whose transforms ignore the
            surrounding ``no_grad``: nothing here builds an autograd graph across loops).
        hidden_init: [batch, seq, d_model] h_0.
        hidden: [batch, seq, loop, d_model] h_1..h_T (the capture's states; loop t's Jacobian is taken at h_{t−1}).
        cfg: iterations, chunking, seed.
        first_row: index of the batch's first sequence (seeds its random vectors).

    Returns:
        name -> [batch, seq, loop] float32 (``ftle`` is the sequence's, repeated on its positions).
    """
    B, S, T, D = hidden.shape
    with torch.inference_mode(False), torch.no_grad(), sdpa_kernel(SDPBackend.MATH):
        h_all = hidden.clone()  # a normal tensor: inference-mode tensors cannot enter autograd transforms
        h_prev = hidden_init.clone()
        u, v = _start_vectors((B, S, D), cfg.seed, first_row, h_prev.device, h_prev.dtype)
        u = u / u.flatten(1).norm(dim=1).clamp_min(_EPS)[:, None, None]
        rho, ftle, share = (h_prev.new_empty((B, S, T)) for _ in range(3))
        log_sum = h_prev.new_zeros(B)
        for t in range(T):
            def f(x: torch.Tensor, t: int = t) -> torch.Tensor:
                return step(x, t)

            sigma, v = diagonal_block_norm(f, h_prev, v, cfg.power_iters, cfg.position_chunk)
            rho[:, :, t] = sigma
            w = torch.func.jvp(f, (h_prev,), (u,))[1]  # the full map: positions mix [BE]
            pos = w.pow(2).sum(-1)  # [B, S]
            g = pos.sum(-1).sqrt().clamp_min(_EPS)  # [B]
            log_sum += g.log()
            ftle[:, :, t] = (log_sum / (t + 1))[:, None]
            share[:, :, t] = pos / (g * g)[:, None]
            u = w / g[:, None, None]
            h_prev = h_all[:, :, t]
        return {"contraction": rho.detach().float(), "ftle": ftle.detach().float(),
                "ftle_share": share.detach().float()}


def check_adapter(adapter: LoopedModelAdapter) -> None:
    """Refuse, before anything is written, an adapter that exposes no loop step (``loop_step``) or refuses it for
    this model (``loop_step_refusal``).

    Raises:
        ConfigError: one line naming the adapter and the fix.
    """
    if type(adapter).loop_step is LoopedModelAdapter.loop_step:
        raise ConfigError(f"dump.contraction: adapter '{adapter.info.name}' ({type(adapter).__name__}) exposes no "
                          "loop step to differentiate; set dump.contraction: null for this model")
    why = adapter.loop_step_refusal()
    if why:
        raise ConfigError(f"dump.contraction: {why}; or set dump.contraction: null for this model")


def capture_arrays(adapter: LoopedModelAdapter, states: States, cfg: ContractionConfig, first_row: int,
                   select: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, np.ndarray]:
    """The dump's hook: :func:`contraction_stats` of one batch through ``adapter.loop_step``, rows selected.

    Args:
        adapter: a :class:`~looptrace.models.interface.LoopedModelAdapter` with a loop step.
        states: its :class:`~looptrace.models.interface.States` of the batch.
        cfg: ``dump.contraction``.
        first_row: index of the batch's first sequence.
        select: [batch, seq, ...] -> [n_scored, ...] (the dump's scored-position selection).

    Returns:
        name -> [n_scored, loop] float32 numpy, for :data:`CONTRACTION_ARRAYS`.
    """
    h0 = states.hidden_init
    stats = contraction_stats(lambda h, t: adapter.loop_step(h, h0, t), h0, states.hidden, cfg, first_row)
    return {name: select(stats[name]).cpu().numpy() for name in CONTRACTION_ARRAYS}


__all__ = ["capture_arrays", "check_adapter", "CONTRACTION_ARRAYS", "ContractionConfig", "StepFn", "contraction_stats", "diagonal_block_norm",
           "diagonal_jvp", "diagonal_vjp"]
