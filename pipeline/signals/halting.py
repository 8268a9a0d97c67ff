"""Halting signals of a native gate (Ouro / PonderNet, SPEC §4 ``q_exit``), defined once.

With gate logits g_t and per-loop halting probabilities λ_t = σ(g_t), the cumulative exit
probability after loop t is CDF_t = 1 − Π_{j≤t}(1 − λ_j); Ouro's Q-exit leaves at the first t with
CDF_t ≥ q. :func:`halting_cdf` computes it over whole trajectories (the readouts stage), :class:`HaltingCDF`
loop by loop (the online rule); both sum the same float64 terms in the same order, so they agree bit for bit.
"""

from __future__ import annotations

import numpy as np
from looptrace.signals import keep_rows


def _log_not_halting(gate_logit: np.ndarray) -> np.ndarray:
    """log(1 − σ(g)) = −softplus(g), float64 (large gate logits do not round to log(1 − 1))."""
    return -np.logaddexp(0.0, np.asarray(gate_logit, dtype=np.float64))


def _cdf(log_not_sum: np.ndarray) -> np.ndarray:
    """1 − exp(Σ_{j≤t} log(1 − λ_j))."""
    return -np.expm1(log_not_sum)


def halting_cdf(gate_logit: np.ndarray) -> np.ndarray:
    """Native Q-exit signal (Ouro): 1 − Π_{j≤t}(1 − σ(gate_j)), per token and loop, in log space.

    Args:
        gate_logit: [token, loop] float.

    Returns:
        [token, loop] float64 cumulative halting probability, non-decreasing in t.
    """
    return _cdf(np.cumsum(_log_not_halting(gate_logit), axis=1))  # cumsum adds left to right, as HaltingCDF


class HaltingCDF:
    """Streaming :func:`halting_cdf`: feed g_1, g_2, ... ([...] arrays, e.g. [batch, seq]); keeps the running sum."""

    def __init__(self) -> None:
        self._sum: np.ndarray | None = None

    def update(self, gate_logit: np.ndarray) -> np.ndarray:
        """CDF_t [...] float64 after loop t."""
        x = _log_not_halting(gate_logit)
        self._sum = x if self._sum is None else self._sum + x
        return _cdf(self._sum)

    def compact(self, rows, seq: int | None) -> None:
        """Follow the early-exit engine's compaction (leading dims [batch, seq])."""
        if self._sum is not None:
            self._sum = keep_rows(self._sum, rows, seq)


# ----------------------------------------------------------------------------------------------
# Ouro's own arithmetic, in the model dtype
# ----------------------------------------------------------------------------------------------

#: dtypes of :func:`ouro_halting_cdf` (the ``q_exit_<dtype>`` rules).
OURO_DTYPES = ("bfloat16", "float16", "float32")


def _torch_dtype(dtype: str):
    import torch  # only here: the rest of looptrace.signals stays numpy-only

    if dtype not in OURO_DTYPES:
        raise ValueError(f"ouro_halting_cdf: dtype must be one of {', '.join(OURO_DTYPES)}, got {dtype!r}")
    return torch, getattr(torch, dtype)


_SIGMOID_BLOCK = 8192  # elements per call: one thread, a multiple of every CPU vector width


def _sigmoid(torch, g):
    """σ(g) in g's dtype through torch's vectorised CPU kernel for every element, whatever g's shape.

    torch computes the last (n mod 2·vector width) elements of a call, and the ends of the chunks it splits a
    large call into across threads, with a scalar σ that can differ from the vectorised one in the last ulp; so
    the same value could round differently depending on where it sits. Padding each call to a multiple of
    :data:`_SIGMOID_BLOCK` makes the result a function of the value alone (offline = online, bit for bit). The
    model itself evaluates σ on its own [batch, seq] gate, whose tail elements take the scalar path: there a
    value can differ by one ulp of the dtype (a decision moves only if the CDF is that close to q).
    """
    flat = g.reshape(-1)
    n = flat.numel()
    pad = (-n) % _SIGMOID_BLOCK
    x = torch.cat([flat, flat.new_zeros(pad)]) if pad else flat
    out = torch.cat([torch.sigmoid(b) for b in x.split(_SIGMOID_BLOCK)]) if n else x
    return out[:n].reshape(g.shape)


def _ouro_pdf_step(torch, g, rem, last: bool):
    """One step of Ouro's exit pdf: (p_t, remaining probability after t)."""
    lam = _sigmoid(torch, g)
    if last:
        return rem, rem
    return lam * rem, rem * (1.0 - lam)


def ouro_halting_cdf(gate_logit: np.ndarray, dtype: str) -> np.ndarray:
    """The exit CDF Ouro's own ``OuroForCausalLM.forward`` computes for its Q-exit, in the model's ``dtype``.

    λ_t = σ(g_t); p_t = λ_t · r_t and r_{t+1} = r_t · (1 − λ_t) for t < T (r_1 = 1); p_T = r_T (the last step
    takes the remainder); CDF = cumsum(p). Every operation runs in ``dtype`` with torch (on the CPU), as the model
    runs it, so the values — and the steps where CDF reaches q — are the checkpoint's own (up to one ulp of σ on
    the model's own tail elements, :func:`_sigmoid`): in bf16 σ rounds to 1 for g ≳ 6.3 and the CDF can reach q
    (or 1.0) earlier than exact arithmetic says. :func:`halting_cdf` is the
    exact (float64, log-space) signal of the same gate; the two differ wherever the model dtype rounds.

    Ouro compares ``CDF ≥ q`` in ``dtype`` too, i.e. against q rounded to it: its ``forward(exit_threshold=q)``
    exits where this CDF ≥ :func:`ouro_threshold` (q, dtype) (and at T where it never is).

    Args:
        gate_logit: [token, loop] gate logits (the store's float32 ``gate_logit`` holds bf16 / fp16 values exactly).
        dtype: ``bfloat16`` | ``float16`` | ``float32`` (the model's, ``dump.adapter.dtype``).

    Returns:
        [token, loop] float64 (values of ``dtype``).
    """
    torch, dt = _torch_dtype(dtype)
    g = torch.from_numpy(np.ascontiguousarray(gate_logit)).to(dt)
    T = g.shape[-1]
    rem = torch.ones_like(g[..., 0])
    pdf = []
    for t in range(T):
        p, rem = _ouro_pdf_step(torch, g[..., t], rem, t == T - 1)
        pdf.append(p)
    return torch.cumsum(torch.stack(pdf, dim=-1), dim=-1).double().numpy()


def ouro_threshold(q: float, dtype: str) -> float:
    """``q`` rounded to ``dtype``, as Ouro's ``CDF ≥ q`` comparison in the model dtype sees it (float64 value)."""
    torch, dt = _torch_dtype(dtype)
    return float(torch.tensor(float(q), dtype=torch.float64).to(dt).double())


class OuroHaltingCDF:
    """Streaming :func:`ouro_halting_cdf` for loops t < T (the last loop's remainder is never needed online:
    every position exits at T). The values equal the offline ones bit for bit (same torch operations; the CPU
    cumsum is sequential)."""

    def __init__(self, dtype: str) -> None:
        self.torch, self.dt = _torch_dtype(dtype)
        self.rem = None
        self.pdf: list = []

    def update(self, gate_logit: np.ndarray) -> np.ndarray:
        torch = self.torch
        g = torch.from_numpy(np.ascontiguousarray(gate_logit)).to(self.dt)
        if self.rem is None:
            self.rem = torch.ones_like(g)
        p, self.rem = _ouro_pdf_step(torch, g, self.rem, last=False)
        self.pdf.append(p)
        return torch.cumsum(torch.stack(self.pdf, dim=-1), dim=-1)[..., -1].double().numpy()

    def compact(self, rows, seq: int | None) -> None:
        """Follow the early-exit engine's compaction (leading dims [batch, seq])."""
        if self.rem is not None:
            rows = rows.cpu() if hasattr(rows, "cpu") else rows  # these tensors live on the CPU
            self.rem = keep_rows(self.rem, rows, seq)
            self.pdf = [keep_rows(p, rows, seq) for p in self.pdf]
