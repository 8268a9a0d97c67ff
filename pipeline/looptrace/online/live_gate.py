"""Fitted gates run loop by loop on a live batch (the latency stage's real early exit).

The fitted gates are read from the gates stage's artifact by :func:`~looptrace.gates.artifact.load_fitted` (JSON,
skops with a trusted-types list and plain arrays: nothing in it is executed).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from looptrace.gates.artifact import load_fitted
from looptrace.gates.config import STORE_FEATURES, gate_rule_form
from looptrace.online.live_signals import round_states
from looptrace.signals.halting import HaltingCDF

__all__ = ["OnlineGate", "load_fitted", "load_online_gate"]


class OnlineGate:
    """A fitted gate evaluated loop by loop on a live batch (``looptrace.online.engine.CallableRule``).

    The features are recomputed exactly as the offline path computed them from the store: the state is
    rounded to the store's ``hidden`` dtype, and the statistics are the live signals of
    :class:`looptrace.online.live_signals.LiveSignals` — the streaming forms of the functions that wrote the store
    (``LoopStats``) and token_loop.parquet (``StepSignals``), so they equal the stored values bit for bit.

    A PonderNet gate's Q-exit rule (``ponder-<arch>``) keeps the running halting CDF of its logits
    (:class:`~looptrace.signals.halting.HaltingCDF`, the native ``q_exit``'s online form, bit for bit the offline
    :func:`~looptrace.signals.halting.halting_cdf`): :meth:`reset` starts it, :meth:`compact` follows the batch.

    Args:
        fit: the dict of :func:`load_fitted`.
        name: gate name (``logreg-oracle`` ...) or its rule name (``ponder-linear-lambda``: the λ_t form).

    Attributes:
        signals: the statistics the gate reads (the engine computes them on the live batch).
        hidden_dtype: the store's hidden dtype the gate was fit on.
        needs_logits: whether a statistic reads the readout.
    """

    def __init__(self, fit: dict, name: str):
        name, self.form = gate_rule_form(name)
        if name not in fit["gates"]:
            raise KeyError(f"gate '{name}' is not in the fitted gates ({', '.join(fit['gates'])})")
        self.name, self.gate, self.features = name, fit["gates"][name], fit["features"]
        self.cdf: HaltingCDF | None = None
        self.stats = tuple(fit["stats"])
        self.signals = self.stats
        self.hidden_dtype = str(fit.get("hidden_dtype") or "float16")
        self.needs_logits = any(s in STORE_FEATURES and s != "gate_logit" for s in self.stats)

    def stop_prob(self, t: int, h, signals: dict):
        """P(stop) after loop t (1-based) from h_t [b, s, D] and the live statistics ``signals``
        (name -> [b, s]): [b, s] float64 tensor."""
        b, s, D = h.shape
        hr = round_states(h, self.hidden_dtype)
        stats = None
        if self.stats:
            stats = np.stack([signals[n].reshape(-1).cpu().numpy() for n in self.stats], axis=-1)[:, None, :]
        X = self.features.transform(hr.reshape(b * s, 1, D).cpu().numpy(), stats, np.array([t - 1]))
        if self.form == "q_exit" and self.gate.constant is None:
            if self.cdf is None:
                self.cdf = HaltingCDF()
            p = self.cdf.update(self.gate.gate_logit(X)[:, 0].reshape(b, s))
        else:
            p = self.gate.stop_prob(X, self.form)[:, 0].reshape(b, s)
        return torch.as_tensor(np.asarray(p, dtype=np.float64), device=h.device).reshape(b, s)

    def reset(self) -> None:
        """Start a new pass (the Q-exit CDF of a PonderNet gate restarts at loop 1)."""
        self.cdf = None

    def compact(self, rows, seq: int | None) -> None:
        """Follow the engine's compaction (leading dims [batch, seq])."""
        if self.cdf is not None:
            self.cdf.compact(rows, seq)


def load_online_gate(gates_dir: Path | str, rule: str) -> OnlineGate:
    """The fitted gate ``rule`` (``gate:<name>``) of one model as an online rule (DESIGN.md latency contract).

    Args:
        gates_dir: ``artifacts/gates/<model>``.
        rule: the rule name as in chosen.parquet.

    Returns:
        :class:`OnlineGate` with ``stop_prob(t, h, signals)``, ``signals``, ``hidden_dtype`` and ``needs_logits``.

    Raises:
        MissingInputError: no gate artifact; InputError: a refused artifact; KeyError: the gate was not fitted.
    """
    return OnlineGate(load_fitted(gates_dir), str(rule).removeprefix("gate:"))
