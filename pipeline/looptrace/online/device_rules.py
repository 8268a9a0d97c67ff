"""Exit decisions computed on the device, certified equal to the host's (docs/generate.md).

The online rules of :mod:`looptrace.online.engine` compute some signals on the host: the step signals
(``rel_step``, ``step_norm``/``hidden_change``, ``state_cos_dist``) and ``q_exit``'s halting CDF are float64 numpy
(:class:`~looptrace.signals.steps.StepSignals`, :class:`~looptrace.signals.halting.HaltingCDF`, the functions that
wrote token_loop.parquet), so every loop copies h_t or g_t to the host; the logit rules that sum over p log p
(``entropy``, ``kl_prev``, ...) read one finiteness flag per loop. :func:`device_rule` gives, for such a rule, a form
whose decision stays on the device, so :func:`looptrace.online.lookahead.decode_tokens_lookahead` enqueues loop
after loop without waiting:

- **logit rules**: the same torch code (:class:`~looptrace.signals.logits.LoopStats`) without the finiteness read
  (``check_finite=False``: the masked sums, bit-identical; tests/test_stats.py) — exact, nothing to certify;
- **step rules and q_exit**: the same formulas in torch float64 on the device. Their values can differ from numpy's
  in the last bits (the order of a d_model-long sum; a libm ``exp``/``log1p`` against the device's), so each value
  v comes with a bound e ≥ |v − v_numpy| (below), and a row's decision is *certain* when every value in
  [v − e, v + e] decides the same way (the comparison is monotone in v, so the two ends decide it). A certain
  decision is the host's. A row whose decision is not certain (v within e of the threshold's cut, about 1e-12
  relative: practically never, except a threshold equal to an observed float64 CDF value) is flagged, and the
  decoder redoes that position with the host rule (same states, same KV slots overwritten: the host path's
  result exactly).

Bounds (u = 2⁻⁵³, D = d_model; every elementwise op correctly rounded or within 2 ulp, sums of D terms in any
order, with or without FMA):

- a sum of D non-negative products (‖Δ‖², ‖h‖²) has relative error ≤ γ_D ≈ (D + 1) u in either implementation;
  ``step_norm`` = √(·) and ``rel_step`` = √(·)/√(·) then differ from numpy's by ≤ (2D + 8) u relatively; the
  bound used is e = (8D + 64) u |v| (×4 slack). ``state_cos_dist`` = 1 − ⟨h, h'⟩/(‖h‖‖h'‖): the dot's error is
  ≤ γ_D ‖h‖‖h'‖ (Cauchy–Schwarz), so |Δv| ≤ (4D + 16) u; used e = (8D + 64) u (1 + |v|).
- ``q_exit``: x_j = −softplus(g_j) (two positive terms, each within 2 ulp: relative ≤ 8u), S_t = Σ_{j≤t} x_j
  (same-sign terms: relative ≤ (8 + t) u), CDF = −expm1(S) (|Δ| ≤ e^S |ΔS| + 2 ulp): both implementations within
  (16 + 2t) u (|S| + 1); used e = (64 + 16t) u (|S| + 1). S = −∞ (a gate logit +∞) gives e = ∞: uncertain.
- step signals are stored as float32 and compared with the float32 threshold τ32
  (:func:`~looptrace.online.engine.float32_threshold`): certain when round32(v − e) and round32(v + e) compare
  the same way with τ32 (rounding is monotone); q_exit's float64 CDF is compared with the threshold directly.
- NaN (a zero norm: exactly when every element is 0, in both) never fires and is certain.

Rules without a device form (``argmax_stable``, user rules' history scores, two-hit step rules, refit gates) keep
the host form: :func:`device_rule` returns None.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from looptrace.online.engine import OnlineRule, RegistryRule
from looptrace.online.live_signals import _ROUNDING
from looptrace.rules.base import SIGNAL
from looptrace.rules.builtin import QExitOnline
from looptrace.signals.logits import STAT_NAMES, LoopStats
from looptrace.signals.names import ALIASES, SIGNALS

if TYPE_CHECKING:
    from looptrace.models.decode import LoopDecoder
    from looptrace.models.looped import LoopedTransformer

_U = 2.0 ** -53  # unit roundoff of float64
#: name -> its device form f(h_t, h_{t−1}, ‖h_t‖, ‖h_{t−1}‖ or None, c) -> (value, bound e), [b, s] float64 each,
#: with c = (8D + 64) u (the bound is derived in the module docstring). A step signal gets a device rule by
#: registering its form here (:func:`_device_form`); the vocabulary stays in looptrace.signals.names.
_DEVICE_FORMS: dict[str, Callable[..., tuple[torch.Tensor, torch.Tensor]]] = {}


def _device_form(name: str):
    assert name in SIGNALS and SIGNALS[name].source == "states", name  # a step signal of the vocabulary
    def register(fn):
        _DEVICE_FORMS[name] = fn
        return fn
    return register


@_device_form("state_cos_dist")
def _state_cos_dist(hr, hp, nh, nhp, c):
    nhp = nhp if nhp is not None else (hp * hp).sum(-1).sqrt()
    den = nh * nhp
    v = 1.0 - torch.where(den > 0, (hr * hp).sum(-1) / den, torch.full_like(nh, math.nan))
    return v, c * (1.0 + v.abs())


def _step_length(hr, hp):
    d = hr - hp
    return (d * d).sum(-1).sqrt()


@_device_form("step_norm")
def _step_norm(hr, hp, nh, nhp, c):
    v = _step_length(hr, hp)
    return v, c * v.abs()


@_device_form("rel_step")
def _rel_step(hr, hp, nh, nhp, c):
    v = torch.where(nh > 0, _step_length(hr, hp) / nh, torch.full_like(nh, math.nan))
    return v, c * v.abs()


#: Step signals with a device form.
DEVICE_STEP_SIGNALS = tuple(_DEVICE_FORMS)


class DeviceRule(OnlineRule):
    """An online rule whose decision is computed on the device: :meth:`decide` gives the condition and the rows
    whose decision is not certain to be the host rule's. ``host`` is the host rule it stands for (the decoder
    redoes a position with it when a row is uncertain)."""

    def __init__(self, host: RegistryRule):
        super().__init__(host.name, host.threshold, host.op, host.min_loop, host.two_hit)
        self.host = host
        self.needs_logits = host.needs_logits

    def decide(self, t: int, h: torch.Tensor, z: torch.Tensor | None,
               model: LoopedTransformer | LoopDecoder) -> tuple[torch.Tensor, torch.Tensor | None]:
        """After loop t (1-based): ([batch, seq] bool condition, [batch, seq] bool uncertain rows or None =
        every decision exact)."""
        return self.fires(t, h, z, model), None


class _LogitDeviceRule(DeviceRule):
    """A logit-signal rule on :class:`LoopStats` without the per-loop finiteness read (exact: same values)."""

    def __init__(self, host: RegistryRule, signal: str):
        super().__init__(host)
        self.sig = signal
        self.stats: LoopStats | None = None

    def reset(self, model, h0):
        self.state = {}
        self.stats = LoopStats(names=(self.sig,), check_finite=False)

    def signal(self, t, h, z, model):
        assert self.stats is not None and z is not None  # reset first; needs_logits: the decoder passes z_t
        return self.stats.update(z)[self.sig]


def _certain_f32(v: torch.Tensor, e: torch.Tensor, thr32: float, op: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(round32(v) op τ32, uncertain): the ends of [v − e, v + e], rounded to float32, decide differently."""
    def cmp(x: torch.Tensor) -> torch.Tensor:
        return x <= thr32 if op == "le" else x >= thr32

    return cmp(v.float()), cmp((v - e).float()) != cmp((v + e).float())


def _certain_f64(v: torch.Tensor, e: torch.Tensor, thr: float, op: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(v op thr, uncertain) in float64."""
    def cmp(x: torch.Tensor) -> torch.Tensor:
        return x <= thr if op == "le" else x >= thr

    return cmp(v), cmp(v - e) != cmp(v + e)


class _BoundedDeviceRule(DeviceRule):
    """A device rule whose values carry an error bound: :meth:`certain` gives (condition, uncertain rows) after
    loop t; before the host rule's ``min_loop`` neither fires nor is uncertain."""

    def certain(self, t: int, h: torch.Tensor, model: LoopedTransformer | LoopDecoder
                ) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def decide(self, t, h, z, model):
        hit, unc = self.certain(t, h, model)
        if t < self.min_loop:
            hit, unc = torch.zeros_like(hit), torch.zeros_like(unc)
        return hit, unc

    def fires(self, t, h, z, model):
        return self.decide(t, h, z, model)[0]


class _StepDeviceRule(_BoundedDeviceRule):
    """A step-signal rule (``rel_step``, ``step_norm``, ``state_cos_dist``) in torch float64 on the device, with
    the states rounded to the store's hidden dtype as :class:`~looptrace.online.live_signals.LiveSignals` does."""

    def __init__(self, host: RegistryRule, signal: str):
        super().__init__(host)
        self.sig = signal
        self._dt = _ROUNDING.get(str(host.hidden_dtype))
        self._prev: torch.Tensor | None = None  # h_{t−1} rounded, float64 [b, s, D]
        self._nh_prev: torch.Tensor | None = None

    def _rounded(self, h: torch.Tensor) -> torch.Tensor:
        return (h.to(self._dt) if self._dt is not None else h).double()

    def reset(self, model, h0):
        self.state = {}
        self._prev, self._nh_prev = self._rounded(h0), None

    def values(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The signal after the next loop from h_t [b, s, D]: (v, its bound e), [b, s] float64 each (advances)."""
        hr, hp = self._rounded(h), self._prev
        assert hp is not None  # reset first
        D = hr.shape[-1]
        c = (8 * D + 64) * _U
        nh = (hr * hr).sum(-1).sqrt()
        v, e = _DEVICE_FORMS[self.sig](hr, hp, nh, self._nh_prev, c)
        self._prev, self._nh_prev = hr, nh
        return v, e

    def certain(self, t, h, model):
        v, e = self.values(h)
        return _certain_f32(v, e, self._thr32, self.op)


class _QExitDeviceRule(_BoundedDeviceRule):
    """``q_exit``: the halting CDF 1 − exp(Σ_{j≤t} −softplus(g_j)) in torch float64 on the device."""

    def __init__(self, host: RegistryRule):
        super().__init__(host)
        self._sum: torch.Tensor | None = None

    def reset(self, model, h0):
        self.state = {}
        self._sum = None

    def values(self, t: int, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """CDF_t from the gate logits g_t [b, s] (float32 values): (v, its bound e), [b, s] float64 (advances)."""
        x = -torch.logaddexp(torch.zeros((), dtype=torch.float64, device=g.device), g.double())
        self._sum = x if self._sum is None else self._sum + x
        return -torch.expm1(self._sum), (64 + 16 * t) * _U * (self._sum.abs() + 1.0)

    def certain(self, t, h, model):
        # the live signal's float32 value, as LiveSignals gives it
        v, e = self.values(t, model.gate_logit(h).float())
        return _certain_f64(v, e, self.threshold, self.op)


def device_rule(rule: OnlineRule | None) -> DeviceRule | None:
    """The device form of an online rule (module docstring), or None where it has none (the host form is used).

    Args:
        rule: an online rule (a :class:`DeviceRule` is returned as it is); only
            :class:`~looptrace.online.engine.RegistryRule` of a signal rule (a logit
            signal, or a step signal of :data:`DEVICE_STEP_SIGNALS` without two-hit) or of the built-in
            ``q_exit`` has one.
    """
    if isinstance(rule, DeviceRule):
        return rule
    if type(rule) is not RegistryRule:  # a subclass may compute its signal its own way
        return None
    r = rule.rule
    if r.online is QExitOnline:
        return _QExitDeviceRule(rule)
    if r.online != SIGNAL or len(r.signals) != 1:
        return None
    sig = ALIASES.get(r.signals[0], r.signals[0])
    if sig in STAT_NAMES and sig not in ("kl_final", "target_logprob"):
        return _LogitDeviceRule(rule, sig)
    if sig in DEVICE_STEP_SIGNALS and not r.two_hit:
        return _StepDeviceRule(rule, sig)
    return None


__all__ = ["DEVICE_STEP_SIGNALS", "DeviceRule", "device_rule"]
