"""The result of one decoding run (:func:`looptrace.online.generate.decode_tokens` and its device-side variant
:func:`looptrace.online.lookahead.decode_tokens_lookahead`): its own module so both return it without importing
each other."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class GenRun:
    """One decoding run over a batch of prompts.

    Attributes:
        tokens: [batch, new] int64, the emitted tokens (argmax of the readout at the exit loop).
        exit_depth: [batch, new] int64, 1-based exit loop of each emitted token.
        logprob: [batch, new] float64, log-probability of the token fed back (the emitted one, or the forced one)
            under the readout at the exit loop.
        row_loops: loop steps computed over rows and positions (decode only; recompute's skipped loops included).
        seconds: wall time of the decoding (prefill excluded).
        prefill_seconds: wall time of the prefill.
        redone: positions decoded twice (the lookahead path with a device rule: a row whose device decision was
            not certain, so the position was run again with the host rule; its loops are in ``row_loops``).
    """

    tokens: np.ndarray
    exit_depth: np.ndarray
    logprob: np.ndarray
    row_loops: int
    seconds: float
    prefill_seconds: float
    redone: int = 0
