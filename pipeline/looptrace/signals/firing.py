"""Firing conditions of exit rules on per-loop signals (SPEC §4), defined once, vectorised and streaming.

- :func:`two_hit` / :func:`two_hit_step`: the [TS] two-hit condition, ``hit_t`` and ``hit_{t−1}`` (nothing fires
  at loop 1). The offline scorer (``looptrace.rules.scoring.exit_depths``, numpy [..., loop]) and the early-exit
  engine (``looptrace.online.engine``, one loop of a torch [batch, seq] batch) both call it.
- :func:`argmax_stable_count` / :class:`ArgmaxStableCount`: Huginn's counter of consecutive equal-argmax
  transitions; the vectorised form runs the streaming one over every loop.

numpy only; the streaming forms work on numpy arrays and torch tensors alike (operators only), so the offline
stages that import this module never load torch.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from looptrace.signals import keep_rows


def two_hit(hit: np.ndarray) -> np.ndarray:
    """``hit_t and hit_{t−1}`` along the last (loop) axis: [..., loop] bool -> [..., loop] bool, False at t = 1."""
    prev = np.zeros_like(hit)
    prev[..., 1:] = hit[..., :-1]
    return hit & prev


def two_hit_step(hit: Any, prev: Any) -> Any:
    """One loop of :func:`two_hit`: ``hit_t and hit_{t−1}`` ([...] bool array or tensor; ``prev`` None at t = 1,
    where nothing fires)."""
    return hit & prev if prev is not None else hit & False


class ArgmaxStableCount:
    """Huginn's argmax-stability counter, loop by loop: c_1 = 0; c_t = c_{t−1} + 1 when argmax_t = argmax_{t−1},
    else 0 — the number of consecutive loops, ending at t, whose argmax equals the previous loop's
    (``ArgmaxStabilityExitEvaluator.stable_for_n_steps`` of seal-rg/recurrent-pretraining; its previous argmax
    starts at −1, which no argmax equals, so the first loop counts 0). Huginn exits when c_t ≥ ``exit_threshold``
    (default 5: six equal loops)."""

    def __init__(self) -> None:
        self.prev: np.ndarray | None = None
        self.count: np.ndarray | None = None

    def update(self, argmax: np.ndarray) -> np.ndarray:
        """c_t [...] int64 from argmax_t [...]."""
        a = argmax
        if self.prev is None:
            self.count = np.zeros(a.shape, dtype=np.int64)
        else:
            assert self.count is not None  # set together with prev
            self.count = np.where(a == self.prev, self.count + 1, 0)
        self.prev = a
        return self.count

    def compact(self, rows, seq: int | None) -> None:
        """Follow the early-exit engine's compaction (leading dims [batch, seq])."""
        if self.prev is not None:
            self.prev, self.count = keep_rows(self.prev, rows, seq), keep_rows(self.count, rows, seq)


def argmax_stable_count(argmax: np.ndarray) -> np.ndarray:
    """:class:`ArgmaxStableCount` over whole trajectories: [token, loop] argmax -> [token, loop] int64 c_t."""
    a = np.asarray(argmax)
    out = np.zeros(a.shape, dtype=np.int64)
    acc = ArgmaxStableCount()
    for t in range(a.shape[1]):
        out[:, t] = acc.update(a[:, t])
    return out
