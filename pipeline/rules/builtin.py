"""The exit rules of SPEC §4: which signal each reads, its comparison and its first loop.

Threshold rules fire at the first loop t ≥ ``min_loop`` where ``signal op threshold`` holds (for
two-hit rules, also at t − 1); ``argmax_stable``, ``fixed`` and ``oracle`` have their own depth
functions here.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

#: Threshold rules of SPEC §4: rule -> (token_loop column, op, min_loop, two_hit).
THRESHOLD_RULES: dict[str, tuple[str, str, int, bool]] = {
    "entropy": ("entropy", "le", 1, False),          # [AD]
    "top1": ("max_prob", "ge", 1, False),            # [AD], CALM softmax_max
    "margin": ("margin", "ge", 1, False),            # [AD] logit gap
    "kl_prev": ("kl_prev", "le", 2, False),          # [AD] KL(p_t ‖ p_{t−1})
    "kl_prev_rev": ("kl_prev_rev", "le", 2, False),  # Huginn KL(p_{t−1} ‖ p_t)
    "logit_change": ("logit_change", "le", 2, False),
    "hidden_change": ("hidden_change", "le", 2, False),
    "rel_step": ("rel_step", "le", 2, False),        # Huginn latent-diff
    "state_cosine": ("state_cos_dist", "le", 2, False),  # Huginn cosine, CALM state
    "accel_two_hit": ("accel", "le", 3, True),       # [TS]: a_t ≤ τ and a_{t−1} ≤ τ
}
#: Confidence readouts of [AD] (claim (a) of the diagnosis).
CONFIDENCE_RULES = ("entropy", "top1", "margin")
#: Every rule the stage knows, in output order (``oracle`` is a ceiling, not a rule).
ALL_RULES = ("fixed", *THRESHOLD_RULES, "argmax_stable", "q_exit", "oracle")
#: Per-(token, loop) columns of token_loop.parquet the rules read.
LOOP_COLUMNS = ("loop", "argmax", "correct", "target_logprob", "gate_logit",
                *sorted({c for c, *_ in THRESHOLD_RULES.values()}))



def oracle_depths(correct: np.ndarray) -> np.ndarray:
    """Oracle earliest-correct depth ([AD] ceiling): min{t : argmax_t = y}, else T.

    Args:
        correct: [token, loop] bool.

    Returns:
        [token] int64, 1-based.
    """
    c = np.asarray(correct, dtype=bool)
    return np.where(c.any(axis=1), c.argmax(axis=1) + 1, c.shape[1]).astype(np.int64)


def argmax_stable_depths(argmax: np.ndarray, ks: Sequence[int]) -> np.ndarray:
    """``argmax_stable k``: min{t ≥ k : argmax_t = argmax_{t−1} = … = argmax_{t−k+1}}, else T.

    Convention (Huginn's argmax-stability counts consecutive loops with the same argmax): the last k
    loops, t included, share one argmax, so the earliest possible exit is t = k; k = 1 exits at 1.

    Args:
        argmax: [token, loop] int.
        ks: the k values.

    Returns:
        [len(ks), token] int64 1-based exit depths.
    """
    a = np.asarray(argmax)
    n, T = a.shape
    same = np.zeros((n, T), dtype=bool)
    same[:, 1:] = a[:, 1:] == a[:, :-1]  # same[t] : argmax_t == argmax_{t-1}
    # run[t] = number of consecutive loops ending at t that share argmax_t.
    run = np.ones((n, T), dtype=np.int64)
    for t in range(1, T):
        run[:, t] = np.where(same[:, t], run[:, t - 1] + 1, 1)
    out = np.empty((len(ks), n), dtype=np.int64)
    for i, k in enumerate(ks):
        hit = run >= k
        out[i] = np.where(hit.any(axis=1), hit.argmax(axis=1) + 1, T)
    return out



def _grid_window(signal: np.ndarray, min_loop: int, two_hit: bool) -> np.ndarray:
    """The loops a rule reads (t ≥ min_loop, and t − 1 for two-hit rules): the calibration values."""
    return signal[:, max(0, min_loop - 1 - int(two_hit)):]
