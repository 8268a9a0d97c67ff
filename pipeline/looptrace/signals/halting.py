"""Halting signals of a native gate (Ouro / PonderNet, SPEC §4 ``q_exit``), defined once.

With gate logits g_t and per-loop halting probabilities λ_t = σ(g_t), the cumulative exit
probability after loop t is CDF_t = 1 − Π_{j≤t}(1 − λ_j); Ouro's Q-exit leaves at the first t with
CDF_t ≥ q. :func:`halting_cdf` computes it over whole trajectories (the readouts stage), :class:`HaltingCDF`
loop by loop (the online rule); both sum the same float64 terms in the same order, so they agree bit for bit.
"""

from __future__ import annotations

import numpy as np

from looptrace.signals import keep_rows

#: ACT's halting ε (Graves 2016: N = min{n : Σ_{t≤n} σ(gate_t) ≥ 1 − ε}, ε = 0.01 there): the default of an ``act``
#: regime (``looptrace.models.regimes.RegimeConfig.eps``) and the ε of the ``act_exit`` rule on a model that was not
#: trained under an ``act`` regime. One constant, so the training's N and the rule's native exit cannot drift apart.
ACT_EPS = 0.01


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


def _check_dtype(dtype: str) -> None:
    if dtype not in OURO_DTYPES:
        raise ValueError(f"ouro_halting_cdf: dtype must be one of {', '.join(OURO_DTYPES)}, got {dtype!r}")


def round_to(x: np.ndarray | np.floating, dtype: str) -> np.ndarray:
    """float32 ``x`` rounded (to nearest, ties to even — torch's conversion) to ``dtype``, held as float32."""
    x = np.asarray(x, dtype=np.float32)
    if dtype == "float32":
        return x
    if dtype == "float16":
        return x.astype(np.float16).astype(np.float32)
    u = x.view(np.uint32)  # bfloat16: the upper 16 bits of a float32, rounded
    r = ((u + (((u >> np.uint32(16)) & np.uint32(1)) + np.uint32(0x7FFF))) & np.uint32(0xFFFF0000)).astype(np.uint32)
    return np.where(np.isnan(x), np.float32(np.nan), r.view(np.float32))


def _sigmoid(g: np.ndarray, dtype: str) -> np.ndarray:
    """σ(g) as torch computes it for a ``dtype`` tensor on the CPU: in float32, as 1 / (1 + exp(−g)) with each of
    exp, + and 1/x rounded to float32, then rounded to ``dtype``. exp is the one op not reproduced bit for bit
    (torch's vectorised expf is within about one float32 ulp, this one is correctly rounded), so a float32 σ can
    differ from torch's by an ulp; after rounding to bf16 / fp16 that almost never survives (measured:
    0 / 1 of 491,520 CDF values in bf16 / fp16)."""
    g32 = np.asarray(g, dtype=np.float32)
    with np.errstate(over="ignore"):
        e = np.exp(-g32.astype(np.float64)).astype(np.float32)  # float32 exp(−g), correctly rounded
        s = (np.float32(1.0) / (np.float32(1.0) + e)).astype(np.float32)
    return round_to(s, dtype)


def _pdf_step(g: np.ndarray, rem: np.ndarray, dtype: str, last: bool) -> tuple[np.ndarray, np.ndarray]:
    """One step of Ouro's exit pdf in ``dtype`` (float32 holders): (p_t, remaining probability after t).

    Each torch op on a bf16 / fp16 tensor computes in float32 and rounds once; the products of two such values
    and 1 − λ are exact in float32, so one float32 op plus :func:`round_to` is bit-identical to torch."""
    if last:
        return rem, rem
    lam = _sigmoid(round_to(g, dtype), dtype)
    p = round_to(lam * rem, dtype)
    rem = round_to(rem * round_to(np.float32(1.0) - lam, dtype), dtype)
    return p, rem


class _CumSum:
    """torch's CPU cumsum: accumulates in float32 for bf16 / fp16 and in float64 for float32, sequentially, and
    rounds every prefix sum to the dtype."""

    def __init__(self, dtype: str) -> None:
        self.dtype = dtype
        self.acc: np.ndarray | None = None

    def add(self, p: np.ndarray) -> np.ndarray:
        wide = np.float64 if self.dtype == "float32" else np.float32
        self.acc = p.astype(wide) if self.acc is None else (self.acc + p.astype(wide)).astype(wide)
        return round_to(self.acc.astype(np.float32), self.dtype)


def ouro_halting_cdf(gate_logit: np.ndarray, dtype: str) -> np.ndarray:
    """The exit CDF Ouro's own ``OuroForCausalLM.forward`` computes for its Q-exit, in the model's ``dtype``.

    λ_t = σ(g_t); p_t = λ_t · r_t and r_{t+1} = r_t · (1 − λ_t) for t < T (r_1 = 1); p_T = r_T (the last step
    takes the remainder); CDF = cumsum(p) — every step rounded as torch rounds it on a ``dtype`` tensor (CPU), so
    the values, and the steps where CDF reaches q, are the checkpoint's own: in bf16 σ rounds to 1 for
    g ≳ 6.3 and the CDF reaches q (or 1.0) earlier than exact arithmetic says. The one approximation is σ
    itself (:func:`_sigmoid`: correctly rounded here, within a float32 ulp in torch). :func:`halting_cdf` is
    the exact (float64, log-space) signal of the same gate; the two differ wherever the model dtype rounds.

    Ouro compares ``CDF ≥ q`` in ``dtype`` too, i.e. against q rounded to it: its ``forward(exit_threshold=q)``
    exits where this CDF ≥ :func:`ouro_threshold` (q, dtype) (and at T where it never is).

    Args:
        gate_logit: [token, loop] gate logits (the store's float32 ``gate_logit`` holds bf16 / fp16 values exactly).
        dtype: ``bfloat16`` | ``float16`` | ``float32`` (the model's, ``dump.adapter.dtype``).

    Returns:
        [token, loop] float64 (values of ``dtype``).
    """
    _check_dtype(dtype)
    g = np.asarray(gate_logit, dtype=np.float32)
    T = g.shape[-1]
    rem = np.ones(g.shape[:-1], dtype=np.float32)
    cum, out = _CumSum(dtype), np.empty(g.shape, dtype=np.float64)
    for t in range(T):
        p, rem = _pdf_step(g[..., t], rem, dtype, t == T - 1)
        out[..., t] = cum.add(p)
    return out


def ouro_threshold(q: float, dtype: str) -> float:
    """``q`` rounded to ``dtype``, as Ouro's ``CDF ≥ q`` comparison in the model dtype sees it (float64 value)."""
    _check_dtype(dtype)
    return float(round_to(np.float32(q), dtype))  # torch: double -> float -> dtype, as here


class OuroHaltingCDF:
    """Streaming :func:`ouro_halting_cdf` for loops t < T (the last loop's remainder is never needed online:
    every position exits at T); the same operations, so the values equal the offline ones bit for bit."""

    def __init__(self, dtype: str) -> None:
        _check_dtype(dtype)
        self.dtype, self.cum = dtype, _CumSum(dtype)
        self.rem: np.ndarray | None = None

    def update(self, gate_logit: np.ndarray) -> np.ndarray:
        g = np.asarray(gate_logit, dtype=np.float32)
        if self.rem is None:
            self.rem = np.ones(g.shape, dtype=np.float32)
        p, self.rem = _pdf_step(g, self.rem, self.dtype, last=False)
        return self.cum.add(p).astype(np.float64)

    def compact(self, rows, seq: int | None) -> None:
        """Follow the early-exit engine's compaction (leading dims [batch, seq])."""
        if self.rem is not None:
            self.rem = keep_rows(self.rem, rows, seq)
            self.cum.acc = keep_rows(self.cum.acc, rows, seq)
