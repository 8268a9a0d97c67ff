"""The signal vocabulary, in one table (torch-free): every per-(token, loop) signal the pipeline stores, derives,
lets an exit rule or a gate read, with where it comes from and where SPEC defines it.

:data:`REGISTRY` is the only literal list of signal names in the library. Every other list derives from it, in
registry order (so the order of the table is the column order of the store's statistics, of
``token_loop.parquet``'s groups and of the rule / gate vocabularies):

- the store's logit statistics (``looptrace.io.store.STAT_NAMES``) = :data:`LOGIT_SIGNALS`;
- the step signals (``looptrace.signals.steps.GEOMETRY_METRICS``) = :data:`STEP_SIGNALS`;
- ``token_loop.parquet``'s signal columns (``looptrace.geometry.TOKEN_LOOP_COLUMNS``) = :data:`TOKEN_LOOP_SIGNALS`;
- what an exit rule may read (``looptrace.rules.registry.ONLINE_SIGNALS`` / ``OFFLINE_ONLY_SIGNALS``) and what
  a gate may use as a feature (``looptrace.gates.config.STORE_FEATURES`` / ``GEOMETRY_FEATURES`` /
  ``FORBIDDEN_STATS`` / ``SIGNED_STATS``) = :data:`ONLINE_SIGNALS`, :data:`OFFLINE_ONLY`, :data:`STORED_FEATURES`,
  :data:`STATE_FEATURES`, :data:`NOT_FEATURES`, :data:`SIGNED`;
- ``hidden_change`` = ``step_norm`` (an alias column, :func:`add_aliases`).

Adding a logit signal = one :class:`Signal` here + its function in :mod:`looptrace.signals.logits` (``LoopStats``
evaluates it); the dump stores it, the geometry stage copies it into ``token_loop.parquet`` and, as the flags
say, exit rules and gates may read it (tests/test_signal_registry.py checks every consumer against this table).
"""

from __future__ import annotations

from collections.abc import MutableMapping
from dataclasses import dataclass

from looptrace.registry import Registry

#: Where a signal comes from: the readout z_t, the states h_t, the native gate, the loop index, the label, the loop
#: map's Jacobian (opt-in store arrays, SPEC §2b).
SOURCES = ("logits", "states", "gate", "loop", "label", "jacobian")


@dataclass(frozen=True)
class Signal:
    """One per-(token, loop) signal.

    Attributes:
        name: the name everywhere (store array, ``token_loop.parquet`` column, rule / gate input).
        source: one of :data:`SOURCES`.
        first_loop: first loop t (1-based) at which it is defined (NaN before: it needs t − 1 or t − 2).
        stored: the dump writes it to the trajectory store (``gate_logit`` only for gated models).
        spec: the SPEC section that defines it.
        dtype: its dtype as stored / computed (``token_loop.parquet`` widens integers to int64).
        online: known at loop t without the label or a later loop (an exit rule may read it).
        offline_why: why an exit rule cannot read it (``online`` False).
        feature: a gate may use it as a feature (``gates.stats``).
        no_feature_why: why a gate may not use it ("" = not a statistic at all, e.g. ``loop``).
        signed: can be negative (a gate feature entered as is, not logged).
        convergence: a convergence depth is computed on it (``geometry.eps`` keys).
        alias_of: the signal whose values it shares (``hidden_change`` = ``step_norm``), or None.
        opt_in: the dump option that stores it ("" = every store has it). An opt-in signal is a
            ``token_loop.parquet`` column only when the store has it (default outputs keep their columns); a rule
            that reads it is offline-only (``online=None``) when ``online`` is False but the signal is causal.
    """

    name: str
    source: str
    first_loop: int
    stored: bool
    spec: str
    dtype: str = "float32"
    online: bool = True
    offline_why: str = ""
    feature: bool = True
    no_feature_why: str = ""
    signed: bool = False
    convergence: bool = False
    alias_of: str | None = None
    opt_in: str = ""


_TARGET = "it uses the target"
_LAST = "it needs loop T's readout"
_JVP = "it needs Jacobian-vector products through the loop step, which the early-exit engine does not compute"
_OPT_IN = "it is an opt-in store array (dump.contraction), absent from default stores"

#: Every signal, in registry order (see the module docstring).
REGISTRY: tuple[Signal, ...] = (
    Signal("loop", "loop", 1, False, "§4", dtype="int64", feature=False),
    Signal("correct", "label", 1, False, "§4", dtype="bool", online=False, offline_why=_TARGET, feature=False,
           no_feature_why=_TARGET),
    # logit statistics (SPEC §3), in the store's order
    Signal("entropy", "logits", 1, True, "§3"),
    Signal("max_prob", "logits", 1, True, "§3"),
    Signal("margin", "logits", 1, True, "§3"),
    Signal("target_logprob", "logits", 1, True, "§3", online=False, offline_why=_TARGET, feature=False,
           no_feature_why=_TARGET),
    Signal("argmax", "logits", 1, True, "§3", dtype="int32", feature=False,
           no_feature_why="it is a class id, not a scalar", convergence=True),
    Signal("kl_prev", "logits", 2, True, "§3", convergence=True),
    Signal("kl_prev_rev", "logits", 2, True, "§3", convergence=True),
    Signal("kl_final", "logits", 1, True, "§3", online=False, offline_why=_LAST, feature=False,
           no_feature_why=_LAST, convergence=True),
    Signal("logit_change", "logits", 2, True, "§3", convergence=True),
    # step signals (SPEC §2), in token_loop.parquet's order
    Signal("step_norm", "states", 1, False, "§2", convergence=True),
    Signal("rel_step", "states", 1, False, "§2", convergence=True),
    Signal("step_cos", "states", 2, False, "§2", signed=True),
    Signal("state_cos_dist", "states", 1, False, "§2", convergence=True),
    Signal("accel", "states", 2, False, "§2"),
    Signal("accel_norm", "states", 2, False, "§2", convergence=True),
    Signal("step_d2", "states", 3, False, "§2", signed=True),
    Signal("hidden_change", "states", 1, False, "§4", alias_of="step_norm"),
    # the native halting gate (SPEC §1 store, §4 q_exit)
    Signal("gate_logit", "gate", 1, True, "§4", signed=True),
    # opt-in loop-map statistics (SPEC §2b, dump.contraction): causal (ρ_t is known at loop t), but the early-exit
    # engine computes no Jacobian, so only an offline rule (online=None) reads it
    Signal("contraction", "jacobian", 1, True, "§2", online=False, offline_why=_JVP, feature=False,
           no_feature_why=_OPT_IN, opt_in="dump.contraction"),
    # its upper bound ρ̄_t (NaN beyond dump.contraction.exact_width): what the certified exit reads
    Signal("contraction_bound", "jacobian", 1, True, "§2", online=False, offline_why=_JVP, feature=False,
           no_feature_why=_OPT_IN, opt_in="dump.contraction"),
)

#: name -> :class:`Signal` (the one registry mechanism, :class:`looptrace.registry.Registry`; an unknown name raises
#: its one-line ``UnknownName``).
SIGNALS: Registry[Signal] = Registry("signal", {s.name: s for s in REGISTRY})


def select(source: str | None = None, *, stored: bool | None = None, online: bool | None = None,
           feature: bool | None = None, alias: bool | None = None, dtype: str | None = None) -> tuple[str, ...]:
    """Names of the signals matching every given property, in registry order."""
    return tuple(s.name for s in REGISTRY
                 if (source is None or s.source == source) and (stored is None or s.stored == stored)
                 and (online is None or s.online == online) and (feature is None or s.feature == feature)
                 and (alias is None or (s.alias_of is not None) == alias) and (dtype is None or s.dtype == dtype))


#: Per-(token, loop) logit statistics the dump stores (SPEC §3; the store's ``STAT_NAMES``).
LOGIT_SIGNALS = select("logits", stored=True)
#: The float ones (every logit statistic but ``argmax``), as ``token_loop.parquet`` copies them from the store.
LOGIT_STATS = select("logits", stored=True, dtype="float32")
#: Logit signals known at loop t without the label or a later loop.
CAUSAL_LOGIT_SIGNALS = select("logits", online=True)
#: Step signals of ``looptrace.signals.steps`` (SPEC §2), in ``token_loop.parquet`` column order.
STEP_SIGNALS = select("states", alias=False)
#: Alias columns: name -> the signal whose values it holds.
ALIASES: dict[str, str] = {s.name: s.alias_of for s in REGISTRY if s.alias_of is not None}
#: ``token_loop.parquet``'s signal columns, in order: the integer and boolean ones (``argmax``, ``correct``), then
#: the float ones by source: the step signals and their aliases, the logit statistics, the gate logit.
TOKEN_LOOP_INTS = tuple(s.name for s in REGISTRY if s.source != "loop" and s.dtype.startswith("int"))
TOKEN_LOOP_BOOLS = select(dtype="bool")
TOKEN_LOOP_FLOATS = (*select("states"), *LOGIT_STATS, *select("gate"))
TOKEN_LOOP_SIGNALS = (*TOKEN_LOOP_INTS, *TOKEN_LOOP_BOOLS, *TOKEN_LOOP_FLOATS)
#: What an exit rule may read (and ``loop`` = t), and what it may not, with why.
ONLINE_SIGNALS = select(online=True)
OFFLINE_ONLY: dict[str, str] = {s.name: s.offline_why for s in REGISTRY if not s.online}
#: Gate features read from the store, and computed from the states (``step_metrics``; with the aliases).
STORED_FEATURES = select(stored=True, feature=True)
STATE_FEATURES = select("states", feature=True)
#: Statistics a gate must not see, with why.
NOT_FEATURES: dict[str, str] = {s.name: s.no_feature_why for s in REGISTRY if s.no_feature_why}
#: Signals that can be negative.
SIGNED = tuple(s.name for s in REGISTRY if s.signed)
#: Opt-in signals: name -> the dump option that stores them (a ``token_loop.parquet`` column only when the store has
#: it, after :data:`TOKEN_LOOP_SIGNALS`).
OPT_IN: dict[str, str] = {s.name: s.opt_in for s in REGISTRY if s.opt_in}
#: Offline-only signals that are nevertheless causal (known at loop t): a rule with ``online=None`` may read them.
OFFLINE_CAUSAL = tuple(s.name for s in REGISTRY if s.opt_in and not s.online)
#: Signals a convergence depth is computed on (``geometry.eps`` keys).
CONVERGENCE_SIGNALS = tuple(s.name for s in REGISTRY if s.convergence)


def add_aliases(cols: MutableMapping) -> MutableMapping:
    """Add every alias column whose signal ``cols`` holds (``hidden_change`` = ``step_norm``, the same array, SPEC
    §4), in place; returns ``cols``."""
    for alias, of in ALIASES.items():
        if of in cols:
            cols[alias] = cols[of]
    return cols
