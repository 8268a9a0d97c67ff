"""The signals of a live batch, loop by loop, as the offline pipeline stored them (for online rules and gates).

:class:`LiveSignals` evaluates the per-loop signals an online rule or gate reads on the active batch of the
early-exit engine with the streaming forms of :mod:`looptrace.signals` — the functions the dump and the
geometry stage used — and follows the engine's compaction:

- logit signals: :class:`~looptrace.signals.logits.LoopStats` on the readout z_t (float32);
- step signals: :class:`~looptrace.signals.steps.StepSignals` on the states rounded to the store's ``hidden``
  dtype and processed in float64 (the model itself keeps computing in float32 — only the signal sees the
  rounding, as the calibrated rule did); returned as float32, as token_loop.parquet holds them;
- ``gate_logit``: the native gate's logit (float32, as the dump stores it); ``loop``: t.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from looptrace.config import ConfigError
from looptrace.signals.logits import STAT_NAMES, LoopStats
from looptrace.signals.names import ALIASES
from looptrace.signals.steps import GEOMETRY_METRICS, StepSignals

_ROUNDING = {"float16": torch.float16, "bfloat16": torch.bfloat16}


def round_states(h: torch.Tensor, hidden_dtype: str) -> torch.Tensor:
    """States rounded to the store's ``hidden`` dtype, as float32 (float32 stores: unchanged)."""
    dt = _ROUNDING.get(str(hidden_dtype))
    return (h.to(dt) if dt is not None else h).float()


def to_numpy(x: torch.Tensor | np.ndarray) -> np.ndarray:
    """A live signal as token_loop.parquet's reader holds it: float64, integers as int64."""
    a = x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)
    return a.astype(np.int64) if np.issubdtype(a.dtype, np.integer) else a.astype(np.float64)


class LiveSignals:
    """Per-loop signals of the live batch ([batch, seq] each), bit-identical to the stored ones.

    Args:
        names: signals to compute (logit signals, step signals, ``hidden_change``, ``gate_logit``, ``loop``).
        model: the looped model (``gate_logit`` for ``gate_logit``).
        hidden_dtype: the store's hidden dtype (the rounding of the states step signals see).
    """

    def __init__(self, names: Sequence[str], model=None, hidden_dtype: str = "float16"):
        known = (*STAT_NAMES, *GEOMETRY_METRICS, *ALIASES, "gate_logit", "loop")
        unknown = [n for n in names if n not in known]
        if unknown:
            raise ConfigError(f"online signal '{unknown[0]}' is not computable on a live batch; known: {', '.join(known)}")
        self.names = tuple(dict.fromkeys(names))
        self.model, self.hidden_dtype = model, hidden_dtype
        self._logit = tuple(n for n in self.names if n in STAT_NAMES)
        self._step = tuple(dict.fromkeys(ALIASES.get(n, n) for n in self.names
                                         if ALIASES.get(n, n) in GEOMETRY_METRICS))
        self._logits: LoopStats | None = None
        self._steps: StepSignals | None = None

    @property
    def needs_logits(self) -> bool:
        """Whether any signal reads the readout z_t."""
        return bool(self._logit)

    def reset(self, h0: torch.Tensor) -> None:
        """Start a new batch from h_0 [batch, seq, d_model]."""
        self._logits = LoopStats(names=self._logit) if self._logit else None
        self._steps = StepSignals(self._rounded(h0), self._step) if self._step else None

    def _rounded(self, h: torch.Tensor) -> np.ndarray:
        dt = _ROUNDING.get(str(self.hidden_dtype))  # float16 -> float64 directly: the same values as via float32
        return (h.to(dt) if dt is not None else h).double().cpu().numpy()

    def update(self, t: int, h: torch.Tensor, z: torch.Tensor | None) -> dict[str, torch.Tensor]:
        """Signals after loop t (1-based) from h_t [b, s, D] and z_t [b, s, V] (None when no logit signal).

        Returns:
            name -> [b, s] tensor on h's device (float32 as stored; ``argmax`` int32; ``loop`` int64).
        """
        out: dict[str, torch.Tensor] = {}
        if self._logits is not None:
            assert z is not None  # the caller passes z_t whenever needs_logits
            out.update(self._logits.update(z))
        if self._steps is not None:
            cpu = h.device.type == "cpu"
            for k, v in self._steps.update(self._rounded(h)).items():
                x = torch.from_numpy(v.astype(np.float32))
                out[k] = x if cpu else x.to(h.device)
        for n in self.names:
            if n in ALIASES:
                out[n] = out[ALIASES[n]]
            elif n == "gate_logit":
                out[n] = self.model.gate_logit(h).float()
            elif n == "loop":
                out[n] = torch.full(h.shape[:-1], t, dtype=torch.int64, device=h.device)
        return {n: out[n] for n in self.names}

    def compact(self, rows: torch.Tensor | None, seq: int | None) -> None:
        """Follow the engine's compaction: keep batch rows ``rows`` (None = all) and positions < ``seq``."""
        if self._logits is not None:
            self._logits.compact(rows, seq)
        if self._steps is not None:
            self._steps.compact(rows, seq)
