"""Local contraction of the loop map, per token and loop, at capture time (SPEC §2b; opt-in ``dump.contraction``).

The loop map of a looped model is F_t: h_{t−1} ↦ h_t on a whole sequence ([seq, d_model]; attention mixes
positions). Quantities of its Jacobian J_t = ∂F_t/∂h at h_{t−1}, all from Jacobian–vector products through the
model's own loop step (``torch.func.jvp`` forward mode and ``torch.func.vjp`` reverse mode; no finite differences):

- ``contraction`` ρ_t[i] = σ_max(J_t[i, i]), the top singular value of the position-diagonal block
  ∂h_t[i]/∂h_{t−1}[i] (how much the token's own state is stretched by one loop, the other positions held fixed).
  Up to ``exact_width`` (d_model ≤ it): *exact* — the whole d × d block is read with d one-hot cotangents per
  position (VJPs) and its top singular value taken in float64 (:func:`block_norm_bound`). Wider: estimated by the
  power method on J_ii^T J_ii [Golub & Van Loan §8.2; PI], a lower bound of σ_max (:func:`diagonal_block_norm`).
- ``contraction_bound`` ρ̄_t[i] ≥ σ_max(J_t[i, i]): the exact value rounded *up* by a stated margin (below), the
  upper bound the Banach certificate needs ([BA], :mod:`looptrace.signals.certified`); NaN beyond ``exact_width``
  (no upper bound is computed there: a finite number of products cannot bound an unseen direction).
- ``ftle`` λ_t = (1/t) Σ_{s≤t} log ‖J_s u_{s−1}‖, u_s = J_s u_{s−1} / ‖J_s u_{s−1}‖: the finite-time Lyapunov
  exponent of the sequence by Benettin's method [BE] (one tangent vector per sequence, propagated through the full
  map — every position at once — and renormalised each loop), with ``ftle_share`` π_t[i] = ‖(J_t u_{t−1})[i]‖² /
  ‖J_t u_{t−1}‖², the position's share of the tangent after loop t. λ_t → log ρ(J) for a fixed linear map.

Why per-position tangents for the diagonal block. One JVP with a tangent v on every position returns
(J v)[i] = Σ_j J_ij v_j: attention mixes the positions, so the diagonal block cannot be read off it. A tangent that is
v_i at position i and zero elsewhere returns J_ii v_i exactly at position i (and a cotangent w_i at position i only
returns w_i^T J_ii at position i of the VJP). The one-position tangents of a batch are pushed through one
``torch.vmap``-ed JVP or VJP (``position_chunk`` of them at a time, to bound memory). The exact block costs S·d
VJPs per loop (reverse mode: one saved forward, then the vmapped backward passes; about half the time of the same
number of forward-mode JVPs on CPU), the power method S·(2·``power_iters`` + 1) products, warm-started from loop
t − 1's top singular vector. The alternative — rewriting every attention layer so that tangents only flow through
the own position (stop-gradients on the other positions' keys and values) — costs far fewer products but must be
re-implemented inside each model family; this module needs only the adapter's loop step
(:meth:`looptrace.models.interface.LoopedModelAdapter.loop_step`).

The rounding margin of ``contraction_bound``. The block J̃ is computed in the model's dtype and its top singular
value σ̂ in float64 by LAPACK's SVD, which returns the exact singular values of J̃ + E with ‖E‖₂ ≤ p(d)·u₆₄·‖J̃‖₂
[Golub & Van Loan §8.6], so |σ̂ − σ_max(J̃)| ≤ ‖E‖₂ (Weyl). ρ̄ = σ̂ + d·(ε_J + ε₆₄)·‖J̃‖_F (ε = machine epsilon = 2u;
‖J̃‖_F ≥ ‖J̃‖₂) covers p(d) ≤ 2d, and ε_J (the block's own dtype: 2⁻²³ for float32, 2⁻⁵² for float64) adds an
allowance for the rounding of J̃'s entries in the backward pass (d·u per length-d dot product; an allowance, not a
proof, for a deep float32 network). The float32 store value is then rounded up, never to nearest. On a block with
exact entries (an affine loop step h ↦ A h + c read by one-hot cotangents: every product is by 0 or 1) ρ̄ ≥ ‖A‖₂
holds provably.

Seeding. The random start vectors (Benettin's tangent; the power method's start) are drawn per *sequence* from
(``seed``, the sequence's index in the split), so every sequence's values are the same whatever batch it is
computed in (the loopmap stage's outputs do not depend on ``loopmap.batch_size``, nor a dump's on
``dump.batch_size``, beyond the rounding of batched kernels).

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
            warm-started from the previous loop's singular vector), for a model wider than ``exact_width``. ≥ 1.
        position_chunk: one-position tangents (or one-hot cotangents) pushed through one vmapped JVP/VJP (bounds
            memory: ``position_chunk`` × the batch's activations).
        seed: seed of the initial tangent (Benettin) and power-method vectors; with each sequence's index in the
            split it makes every sequence's draw reproducible and independent of the batching and the device.
        exact_width: the widest d_model whose diagonal blocks are read whole (S·d VJPs per loop) for the exact
            ρ_t and its upper bound ``contraction_bound``; wider models get the power-method estimate and no bound
            (the certified exit then cannot fire; SPEC §2b). ≥ 1.
    """

    power_iters: int = 4
    position_chunk: int = 16
    seed: int = 0
    exact_width: int = 256

    def __post_init__(self) -> None:
        if self.power_iters < 1:
            raise ConfigError(f"dump.contraction.power_iters must be >= 1, got {self.power_iters}")
        if self.position_chunk < 1:
            raise ConfigError(f"dump.contraction.position_chunk must be >= 1, got {self.position_chunk}")
        if self.exact_width < 1:
            raise ConfigError(f"dump.contraction.exact_width must be >= 1, got {self.exact_width}")

    def exact(self, d_model: int) -> bool:
        """Whether a model of this width gets the exact ρ_t and its upper bound (d_model ≤ ``exact_width``)."""
        return d_model <= self.exact_width


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


def position_block(vjp_fn: Callable, shape: tuple[int, ...], i: int, chunk: int, like: torch.Tensor
                   ) -> torch.Tensor:
    """The whole diagonal block J_ii of position i of every sequence, row by row: [batch, d, d].

    Row k is e_k^T J_ii, the VJP of the one-hot cotangent e_k at position i (zero elsewhere) read at position i;
    the d cotangents go through ``vjp_fn`` ``chunk`` at a time (one vmapped backward pass each).

    Args:
        vjp_fn: ``torch.func.vjp(f, h)[1]`` of the loop map at the point.
        shape: (batch, seq, d) of the map's input.
        i: the position.
        chunk: cotangents per vmapped call.
        like: a tensor of the map's dtype and device.
    """
    B, _, D = shape
    out = like.new_empty((B, D, D))
    with sdpa_kernel(SDPBackend.MATH):
        for lo in range(0, D, chunk):
            hi = min(D, lo + chunk)
            k = torch.arange(hi - lo, device=like.device)
            cot = like.new_zeros((hi - lo, *shape))
            cot[k, :, i, lo + k] = 1.0
            rows = torch.vmap(lambda c: vjp_fn(c)[0])(cot)  # [n, B, S, D]: e_k^T J_{i, :}
            out[:, lo:hi] = rows[:, :, i].transpose(0, 1)
    return out


def spectral_bound(block: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """σ_max of each d × d block in float64 and its upper bound with the rounding margin (module docstring).

    Args:
        block: [..., d, d] J̃ in the model's dtype (any device).

    Returns:
        (σ̂ [...], ρ̄ [...]) float64 on the CPU: ρ̄ = σ̂ + d·(ε_J + ε₆₄)·‖J̃‖_F ≥ σ_max(J̃).
    """
    d = block.shape[-1]
    eps = torch.finfo(block.dtype).eps + torch.finfo(torch.float64).eps
    x = block.detach().to(device="cpu", dtype=torch.float64)  # exact: every float16/32/64 is a float64
    sigma = torch.linalg.matrix_norm(x, ord=2)  # LAPACK SVD (gesdd) of each block
    return sigma, sigma + d * eps * torch.linalg.matrix_norm(x, ord="fro")


def round_up_float32(x: torch.Tensor) -> torch.Tensor:
    """float64 -> the smallest float32 ≥ each value (a cast rounds to nearest, possibly down)."""
    y = x.float()
    return torch.where(y.double() < x, torch.nextafter(y, torch.tensor(float("inf"))), y)


def block_norm_bound(f: Callable[[torch.Tensor], torch.Tensor], h: torch.Tensor, chunk: int = 16,
                     positions: np.ndarray | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact σ_max of every position-diagonal Jacobian block of ``f`` at ``h`` and its upper bound.

    Args:
        f: the map, [batch, seq, d] -> [batch, seq, d].
        h: the point [batch, seq, d].
        chunk: one-hot cotangents per vmapped VJP.
        positions: the positions to read (the others are NaN); None = all.

    Returns:
        (σ̂ [batch, seq], ρ̄ [batch, seq]) float64 on the CPU (:func:`spectral_bound`); d VJPs per position read.
    """
    B, S = h.shape[:2]
    sigma, upper = (torch.full((B, S), float("nan"), dtype=torch.float64) for _ in range(2))
    with sdpa_kernel(SDPBackend.MATH):  # the VJP's saved graph is the math kernel's too
        vjp_fn = torch.func.vjp(f, h)[1]
    for i in range(S) if positions is None else (int(i) for i in positions):
        sigma[:, i], upper[:, i] = spectral_bound(position_block(vjp_fn, tuple(h.shape), i, chunk, h))
    return sigma, upper


def sequence_rows(rows: np.ndarray | int, n: int) -> np.ndarray:
    """The batch's sequence indices in the split: ``rows`` as given, or ``rows`` .. ``rows`` + n − 1 for an int
    (the first of n consecutive sequences)."""
    if isinstance(rows, (int, np.integer)):
        return np.arange(int(rows), int(rows) + n)
    out = np.asarray(rows, dtype=np.int64).reshape(-1)
    if out.shape[0] != n:
        raise ValueError(f"rows: one index per sequence of the batch ({n}), got {out.shape[0]}")
    return out


def _start_vectors(shape: tuple[int, ...], seed: int, rows: np.ndarray, device: torch.device,
                   dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Gaussian (Benettin tangent, power-method start) [batch, seq, d], each sequence's drawn on the CPU from
    (seed, its index in the split): the same whatever batch it is in."""
    us, vs = [], []
    for r in rows:
        rng = np.random.default_rng([int(seed), int(r)])
        us.append(rng.standard_normal(shape[1:]))
        vs.append(rng.standard_normal(shape[1:]))
    u = torch.from_numpy(np.stack(us)).to(device=device, dtype=dtype)
    v = torch.from_numpy(np.stack(vs)).to(device=device, dtype=dtype)
    return u, v


def contraction_stats(step: StepFn, hidden_init: torch.Tensor, hidden: torch.Tensor, cfg: ContractionConfig,
                      rows: np.ndarray | int = 0, positions: np.ndarray | None = None) -> dict[str, torch.Tensor]:
    """``contraction``, ``contraction_bound``, ``ftle`` and ``ftle_share`` of one batch (module docstring), every
    loop.

    Args:
        step: the loop step (h_{t−1}, t) -> h_t, differentiated with torch.func (whose transforms ignore the
            surrounding ``no_grad``: nothing here builds an autograd graph across loops).
        hidden_init: [batch, seq, d_model] h_0.
        hidden: [batch, seq, loop, d_model] h_1..h_T (the capture's states; loop t's Jacobian is taken at h_{t−1}).
        cfg: iterations, chunking, seed, exact width.
        rows: each sequence's index in the split ([batch]; seeds its random vectors), or the first one's when the
            batch's sequences are consecutive.
        positions: the positions whose exact ``contraction`` / ``contraction_bound`` are wanted (the scored ones:
            each costs d VJPs per loop); the others are NaN. None = all. The power method and the FTLE cover
            every position either way.

    Returns:
        name -> [batch, seq, loop] float32 (``ftle`` is the sequence's, repeated on its positions;
        ``contraction_bound`` NaN when d_model > ``cfg.exact_width``).
    """
    B, S, T, D = hidden.shape
    exact = cfg.exact(D)
    with torch.inference_mode(False), torch.no_grad(), sdpa_kernel(SDPBackend.MATH):
        h_all = hidden.clone()  # a normal tensor: inference-mode tensors cannot enter autograd transforms
        h_prev = hidden_init.clone()
        u, v = _start_vectors((B, S, D), cfg.seed, sequence_rows(rows, B), h_prev.device, h_prev.dtype)
        u = u / u.flatten(1).norm(dim=1).clamp_min(_EPS)[:, None, None]
        ftle, share = (h_prev.new_empty((B, S, T)) for _ in range(2))
        rho = torch.empty((B, S, T), dtype=torch.float32)
        bound = torch.full((B, S, T), float("nan"), dtype=torch.float32)
        log_sum = h_prev.new_zeros(B)
        for t in range(T):
            def f(x: torch.Tensor, t: int = t) -> torch.Tensor:
                return step(x, t)

            if exact:
                sigma, upper = block_norm_bound(f, h_prev, cfg.position_chunk, positions)
                rho[:, :, t] = sigma.float()
                bound[:, :, t] = round_up_float32(upper)
            else:
                est, v = diagonal_block_norm(f, h_prev, v, cfg.power_iters, cfg.position_chunk)
                rho[:, :, t] = est.detach().float().cpu()
            w = torch.func.jvp(f, (h_prev,), (u,))[1]  # the full map: positions mix [BE]
            pos = w.pow(2).sum(-1)  # [B, S]
            g = pos.sum(-1).sqrt().clamp_min(_EPS)  # [B]
            log_sum += g.log()
            ftle[:, :, t] = (log_sum / (t + 1))[:, None]
            share[:, :, t] = pos / (g * g)[:, None]
            u = w / g[:, None, None]
            h_prev = h_all[:, :, t]
        dev = hidden.device
        return {"contraction": rho.to(dev), "contraction_bound": bound.to(dev), "ftle": ftle.detach().float(),
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
        first_row: index of the batch's first sequence (its sequences are consecutive: each one's random vectors
            are seeded by its own index).
        select: [batch, seq, ...] -> [n_scored, ...] (the dump's scored-position selection).

    Returns:
        name -> [n_scored, loop] float32 numpy, for :data:`CONTRACTION_ARRAYS`.
    """
    h0 = states.hidden_init
    B, S = h0.shape[:2]
    # the positions some sequence of the batch scores (the others are never stored: no exact block for them)
    scored = np.unique(select(torch.arange(S, device=h0.device).expand(B, S)).cpu().numpy())
    stats = contraction_stats(lambda h, t: adapter.loop_step(h, h0, t), h0, states.hidden, cfg, first_row, scored)
    return {name: select(stats[name]).cpu().numpy() for name in CONTRACTION_ARRAYS}


__all__ = ["capture_arrays", "check_adapter", "CONTRACTION_ARRAYS", "ContractionConfig", "StepFn", "block_norm_bound",
           "contraction_stats", "diagonal_block_norm", "diagonal_jvp", "diagonal_vjp", "position_block",
           "round_up_float32", "sequence_rows", "spectral_bound"]
