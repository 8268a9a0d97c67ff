"""Exit rules written the way a user writes them in their own module (tests/test_user_rules.py names them
in params as ``tests.user_rules:<function>``)."""

from __future__ import annotations

import numpy as np

from looptrace.rules import exit_rule


@exit_rule(signals=("max_prob", "argmax"), op="ge", min_loop=2)
def confident_and_stable(s):
    """Stop when confident (max_prob ≥ γ) and the prediction did not change since the previous loop."""
    same = np.zeros(s["argmax"].shape, dtype=bool)
    same[:, 1:] = s["argmax"][:, 1:] == s["argmax"][:, :-1]
    return np.where(same, s["max_prob"], np.nan)  # NaN never fires


@exit_rule(signals=("entropy",), op="le")
def peeks_ahead(s):
    """Not causal: reads the next loop's entropy."""
    nxt = np.full(s["entropy"].shape, np.nan)
    nxt[:, :-1] = s["entropy"][:, 1:]
    return nxt


@exit_rule(signals=("entropy",), op="le")
def batch_normalised(s):
    """Not per-token: subtracts the batch mean (its value depends on the other tokens)."""
    return s["entropy"] - s["entropy"].mean(axis=0, keepdims=True)


@exit_rule(signals=("entropy", "loop"), op="le", thresholds=(0.5, 1.0), name="entropy_by_depth")
def entropy_scaled(s):
    """Entropy times the loop index, at two fixed thresholds."""
    return s["entropy"] * s["loop"]


@exit_rule(signals=("entropy",), op="le")
def entropy(s):
    """A user rule named like a built-in (refused)."""
    return s["entropy"]


not_a_rule = np.mean


@exit_rule(signals=("entropy",), op="le")
def reads_a_loop_it_does_not_have(s):
    """A user's bug: indexes loop 100 whatever the model's depth (IndexError inside the user's function)."""
    return s["entropy"] - s["entropy"][:, 99][:, None]
