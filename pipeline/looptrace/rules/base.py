"""Exit rules as objects (SPEC §4): :class:`ExitRule`, the :func:`exit_rule` decorator of a user's own rule, the
signals a rule may read and its causality check. The built-ins are :mod:`looptrace.rules.builtin`; looking a rule
up by name is :mod:`looptrace.rules.registry`.

An exit rule maps a token's per-loop signals to a per-loop **score** and exits at the first loop
t ≥ ``min_loop`` where ``score_t op threshold`` holds (``op`` ``le`` or ``ge``; two-hit rules also need it
at t − 1), else at T. Its thresholds are calibrated on val: the [AD] quantile grid of the score on the
loops the rule reads, or the values the rule declares itself (a list, or a function of T, the readouts config and
the model's training regime: ``act_exit``'s 1 − ε is the ε its ACT regime trained with). :class:`ExitRule` holds
all of it:

- ``score``: the vectorised offline form, ``dict name -> [token, loop] array`` (the rule's ``signals``,
  ``token_loop.parquet`` columns, plus ``loop`` = t) -> ``[token, loop]`` score;
- ``online``: the per-loop form the early-exit engine runs (:mod:`looptrace.online.engine`). For a
  user's rule it is derived from ``score``: at loop t the engine calls ``score`` on the history of loops
  1..t and takes the last column. The readouts stage checks on val that this equals the offline value at
  every loop (the rule is causal) before it calibrates the rule.

A user's rule is a function in the user's own module, decorated with :func:`exit_rule`::

    # mypkg/rules.py
    import numpy as np
    from looptrace.rules import exit_rule

    @exit_rule(signals=("max_prob", "argmax"), op="ge", min_loop=2)
    def confident_and_stable(s):
        same = np.zeros(s["argmax"].shape, dtype=bool)
        same[:, 1:] = s["argmax"][:, 1:] == s["argmax"][:, :-1]
        return np.where(same, s["max_prob"], np.nan)   # NaN never fires

and named in params — ``readouts.rules: [entropy, mypkg.rules:confident_and_stable]`` (and the same in
``latency.rules``) — or registered under the ``looptrace.rules`` entry-point group
(``confident_and_stable = "mypkg.rules:confident_and_stable"``) and named by its entry-point name. It is
then calibrated, put on the Pareto front, diagnosed, drawn and run with real early exit like a built-in.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from looptrace.config import ConfigError
from looptrace.rules.user_fault import user_rule_error
from looptrace.signals import names as signal_names

#: Rule families (the ``kind`` column of the outputs).
KINDS = ("fixed", "posthoc", "native", "oracle", "gate")
OPS = ("le", "ge")

#: Signals a rule may read online ([token, loop] columns of token_loop.parquet, and ``loop`` = t): the
#: logit signals known at loop t, the step signals (``hidden_change`` = ``step_norm``), the native gate logit.
ONLINE_SIGNALS = signal_names.ONLINE_SIGNALS
#: Columns an exit rule cannot read, and why (only the oracle ceiling reads ``correct``).
OFFLINE_ONLY_SIGNALS = signal_names.OFFLINE_ONLY
SIGNALS = (*ONLINE_SIGNALS, *OFFLINE_ONLY_SIGNALS)

#: ``online`` values: the score at t is the rule's single signal at t (threshold rules).
SIGNAL = "signal"
#: ``online`` values: derived from ``score`` on the history of loops 1..t (the default for user rules).
HISTORY = "history"


@dataclass(frozen=True)
class ExitRule:
    """One exit rule of SPEC §4 (see the module docstring).

    Attributes:
        name: the rule's name in params and in every output (``rule`` column).
        score: offline form: ``{signal: [token, loop]} -> [token, loop]`` float score (NaN never fires).
        signals: the signals ``score`` reads (keys of its dict; :data:`SIGNALS`).
        op: ``"le"`` (exit when score ≤ threshold) or ``"ge"`` (exit when score ≥ threshold).
        min_loop: first loop (1-based) the rule may fire at.
        two_hit: the condition must also hold at t − 1.
        kind: ``fixed`` | ``posthoc`` | ``native`` | ``oracle`` | ``gate``.
        thresholds: None = the calibration quantile grid of the val score (on the loops the rule reads);
            else a sequence of values (``gate_step``: its native 0.5), or ``(T, readouts config, regime) -> values``
            (``fixed``: 1..T, ``argmax_stable``: its k, ``act_exit``: 1 − ε of the model's ACT regime), ``regime``
            being the model's training regime definition as the params file gives it (``train.regime_defs.<name>``,
            a mapping with ``kind``), or None for a model outside the train matrix (an adapter's run). The
            oracle's single point records no threshold (NaN).
        online: how the early-exit engine evaluates it: :data:`SIGNAL`, :data:`HISTORY`, a factory
            ``() -> OnlineScore`` (``update(t, {signal: [batch, seq]}) -> [batch, seq]`` and
            ``compact(rows, seq)``; numpy, token_loop dtypes), or None (cannot run online: the oracle).
        choose: None = the chosen operating point is the [AD] protocol's (SPEC §4); else the rule's own
            calibration on val, ``(val exit depths [K, token], val SplitArrays, thresholds [K], readouts config)
            -> index k`` (CALM's Learn-then-Test, :mod:`looptrace.rules.calm`).
        origin: where it is defined (``builtin``, ``module:function``, ``entry point ...``), for messages.
        description: one line for ``looptrace --help`` ("" = said from op, signals, min_loop and two_hit; a
            decorated function's docstring gives it).
    """

    name: str
    score: Callable[[Mapping[str, np.ndarray]], Any]
    signals: tuple[str, ...]
    op: str
    min_loop: int = 1
    two_hit: bool = False
    kind: str = "posthoc"
    thresholds: Sequence[float] | Callable[[int, Any, Mapping[str, Any] | None], Sequence[float]] | None = None
    online: str | Callable[[], Any] | None = HISTORY
    origin: str = "builtin"
    description: str = ""
    choose: Callable[[np.ndarray, Any, np.ndarray, Any], int] | None = None

    def __post_init__(self) -> None:
        where = f"exit rule '{self.name}' ({self.origin})"
        if not self.name or not isinstance(self.name, str):
            raise ConfigError(f"{where}: a rule needs a non-empty name")
        if self.op not in OPS:
            raise ConfigError(f"{where}: op must be 'le' or 'ge', got {self.op!r}")
        if self.kind not in KINDS:
            raise ConfigError(f"{where}: kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if int(self.min_loop) < 1:
            raise ConfigError(f"{where}: min_loop must be ≥ 1, got {self.min_loop}")
        if isinstance(self.signals, str) or not self.signals:
            raise ConfigError(f"{where}: signals must be a non-empty list of signal names, got {self.signals!r}")
        object.__setattr__(self, "signals", tuple(self.signals))
        for s in self.signals:
            if s not in SIGNALS:
                raise ConfigError(f"{where}: unknown signal '{s}'; signals: {', '.join(SIGNALS)}")
            # a causal offline-only signal (ρ_t, SPEC §2b) is readable by a rule that never runs online
            causal_offline = s in signal_names.OFFLINE_CAUSAL and self.online is None
            if s in OFFLINE_ONLY_SIGNALS and self.kind != "oracle" and not causal_offline:
                raise ConfigError(f"{where}: an exit rule cannot read '{s}' ({OFFLINE_ONLY_SIGNALS[s]}); "
                                 f"it may read {', '.join(ONLINE_SIGNALS)}")
        if self.online == SIGNAL and len(self.signals) != 1:
            raise ConfigError(f"{where}: online='signal' needs exactly one signal")
        if not callable(self.score):
            raise ConfigError(f"{where}: score must be a function of a dict of [token, loop] signals")

    def __call__(self, signals: Mapping[str, np.ndarray]) -> np.ndarray:
        """The offline score of :meth:`score_of` (so a decorated function can still be called)."""
        return self.score_of(signals)

    @property
    def needs_gate(self) -> bool:
        """Reads the native gate logit (skipped on models without a gate)."""
        return "gate_logit" in self.signals

    @property
    def derived_online(self) -> bool:
        """The online form is derived from ``score`` (checked for causality at calibration)."""
        return self.online == HISTORY

    def score_of(self, signals: Mapping[str, np.ndarray]) -> np.ndarray:
        """``score`` on the rule's own signals: [token, loop] float64 (checked shape).

        Args:
            signals: name -> [token, loop] array; must hold every name of ``signals`` (more are ignored).
        """
        missing = [s for s in self.signals if s not in signals]
        if missing:
            raise ConfigError(f"exit rule '{self.name}': signal '{missing[0]}' is not available")
        own = {s: signals[s] for s in self.signals}
        shape = own[self.signals[0]].shape
        try:
            out = self.score(own)
        except KeyError as exc:
            raise ConfigError(f"exit rule '{self.name}' ({self.origin}) reads signal {exc} that it does not "
                             f"declare in signals={list(self.signals)}") from None
        except Exception as exc:  # a user's rule that raises is the user's bug (issue 24); a built-in's is ours
            if self.origin == "builtin" or self.origin.startswith("looptrace."):  # looptrace's own registered rules
                raise
            raise user_rule_error(self, exc, shape) from None
        out = np.asarray(out, dtype=np.float64)
        if out.shape != shape:
            raise ConfigError(f"exit rule '{self.name}' ({self.origin}) returned a score of shape {out.shape} for "
                             f"signals of shape {shape}; a rule maps [token, loop] signals to a [token, loop] score")
        return out

    def calibration_values(self, n_loops: int, cfg: Any = None,
                           regime: Mapping[str, Any] | None = None) -> np.ndarray | None:
        """The rule's own threshold values (float64), or None when it uses the val quantile grid.

        Args:
            n_loops: T.
            cfg: the ``readouts`` section.
            regime: the model's training regime definition (``thresholds``), None when unknown.
        """
        if self.thresholds is None:
            return None
        given = self.thresholds(n_loops, cfg, regime) if callable(self.thresholds) else self.thresholds
        vals = np.asarray(list(given), dtype=np.float64).ravel()
        if vals.size == 0:
            raise ConfigError(f"exit rule '{self.name}': no threshold values")
        return vals


def check_causal(rule: ExitRule, signals: Mapping[str, np.ndarray]) -> None:
    """Refuse a rule whose score at loop t depends on later loops or on other tokens.

    The online form of a derived rule calls ``score`` on the history of loops 1..t of the live batch and
    takes the last column; this checks, on ``signals`` (the val split), that this equals the offline score
    bit for bit at every t, and that a token's score does not change when other tokens are left out.

    Raises:
        ValueError: one line naming the first loop where the score changes.
    """
    full = rule.score_of(signals)
    n, T = full.shape
    own = {s: np.asarray(signals[s]) for s in rule.signals}
    # contiguous copies, as the online form's history arrays are
    if n > 1:
        rows = np.arange(0, n, 2)
        part = rule.score_of({s: np.ascontiguousarray(v[rows]) for s, v in own.items()})
        if not np.array_equal(part, full[rows], equal_nan=True):
            raise ConfigError(f"exit rule '{rule.name}' ({rule.origin}) depends on other tokens: its score of a "
                             f"token changes when other tokens are left out; a rule scores each token on its own")
    for t in range(1, T):
        part = rule.score_of({s: np.ascontiguousarray(v[:, :t]) for s, v in own.items()})
        if not np.array_equal(part[:, -1], full[:, t - 1], equal_nan=True):
            raise ConfigError(f"exit rule '{rule.name}' ({rule.origin}) is not causal: its score at loop {t} "
                             f"changes when the loops after {t} are removed; a rule may read loops 1..t only "
                             f"(online it sees no later loop)")


def exit_rule(signals: Sequence[str], op: str, min_loop: int = 1, two_hit: bool = False,
              thresholds: Sequence[float] | None = None, name: str | None = None,
              kind: str = "posthoc") -> Callable[[Callable], ExitRule]:
    """Decorator: a function ``{signal: [token, loop]} -> [token, loop]`` score becomes an :class:`ExitRule`.

    Args:
        signals: the signals the function reads (:data:`ONLINE_SIGNALS`; ``loop`` is t = 1..T).
        op: ``"ge"`` (exit when score ≥ threshold) or ``"le"``.
        min_loop: first loop the rule may fire at.
        two_hit: also require the condition at t − 1.
        thresholds: explicit threshold values (default: the calibration quantile grid of the val score).
        name: the rule's name in the outputs (default: the function's name).
        kind: ``posthoc`` (default) or ``native``.

    Returns:
        The decorator; the decorated name is the :class:`ExitRule` (still callable on a signal dict).
    """
    if kind not in ("posthoc", "native"):
        raise ConfigError(f"exit_rule: kind must be 'posthoc' or 'native', got {kind!r}")

    def wrap(fn: Callable) -> ExitRule:
        return ExitRule(name=name or fn.__name__, score=fn, signals=tuple(signals), op=op, min_loop=min_loop,
                        two_hit=two_hit, kind=kind, thresholds=tuple(thresholds) if thresholds is not None else None,
                        online=HISTORY, origin=f"{fn.__module__}:{fn.__qualname__}",
                        description=(fn.__doc__ or "").strip().split("\n")[0])

    return wrap
