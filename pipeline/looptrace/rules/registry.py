"""The exit-rule registry: a rule looked up by name (:func:`get_rule`) among the built-ins
(:mod:`looptrace.rules.builtin`) and :data:`RULES` (a :class:`looptrace.registry.Registry`): the rules
:func:`register`-ed in this process (Ouro's Q-exit in a model dtype among them), module references
``package.module:function`` and the ``looptrace.rules`` entry points; and the checked rule list of a params section
(:func:`resolve_rules`). The rule object is :mod:`looptrace.rules.base`."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np

from looptrace.config import ConfigError
from looptrace.registry import Registry, RegistryError, UnknownName
from looptrace.rules.base import OFFLINE_ONLY_SIGNALS, ExitRule
from looptrace.rules.builtin import BUILTIN_RULES, OURO_Q_EXIT_RULES
from looptrace.rules.native_halting import NATIVE_HALTING_RULES

#: Entry-point group through which installed packages register exit rules.
ENTRY_POINT_GROUP = "looptrace.rules"


# ----------------------------------------------------------------------------------------------
# The registry: built-ins, then rules registered in this process, then entry points / module references
# ----------------------------------------------------------------------------------------------

def _not_a_rule(obj) -> str | None:
    if isinstance(obj, ExitRule):
        return None
    return "is not an exit rule: decorate the function with @looptrace.rules.exit_rule(signals=..., op=...)"


def _entry_point_rule(rule: ExitRule, name: str, value: str) -> ExitRule:
    """An entry point's rule goes by the entry point's name."""
    return dataclasses.replace(rule, name=name, origin=f"entry point {value}")


#: The rules besides the built-ins: registered in this process, ``looptrace.rules`` entry points, and any
#: ``package.module:function`` reference (resolved once, then kept).
RULES: Registry[ExitRule] = Registry("rule", group=ENTRY_POINT_GROUP, check=_not_a_rule, adopt=_entry_point_rule,
                                     references=True)


def builtin_rules() -> dict[str, ExitRule]:
    """The built-in rules of SPEC §4, in output order (``looptrace.rules.builtin``)."""
    return BUILTIN_RULES


def register(rule: ExitRule) -> ExitRule:
    """Register a rule in this process under its name (e.g. one defined in a notebook); returns it."""
    if not isinstance(rule, ExitRule):
        raise TypeError("register: pass an ExitRule (a function decorated with looptrace.rules.exit_rule)")
    if rule.name in builtin_rules():
        raise ConfigError(f"exit rule '{rule.name}' ({rule.origin}): the name is a built-in rule; pick another "
                         f"(exit_rule(name=...))")
    RULES.add(rule.name, rule, replace=True)
    return rule


for _rule in (*OURO_Q_EXIT_RULES.values(), *NATIVE_HALTING_RULES.values()):  # by name only, not among the defaults
    register(_rule)


def _how_to_name() -> str:
    return (f"built-ins: {', '.join(builtin_rules())}; a user rule is named 'package.module:function' (a function "
            f"decorated with looptrace.rules.exit_rule) or registered in the '{ENTRY_POINT_GROUP}' entry-point group")


def get_rule(name: str | ExitRule) -> ExitRule:
    """The rule named ``name``: a built-in, a rule :func:`register`-ed in this process, a module reference
    ``package.module:function`` or a ``looptrace.rules`` entry point.

    Raises:
        ConfigError: one line: unknown name (listing the built-ins and how to name a user rule), a module
            that does not import, an object that is not an exit rule, or a user rule named like a built-in.
    """
    if isinstance(name, ExitRule):
        return name
    builtins = builtin_rules()
    if name in builtins:
        return builtins[name]
    try:
        rule = RULES[name]
    except UnknownName:
        raise ConfigError(f"unknown rule '{name}'; {_how_to_name()}") from None
    except RegistryError:
        raise
    except ValueError as exc:  # a bad decorator call inside the user's module
        raise ConfigError(f"rule '{name}': {str(exc).splitlines()[0]}") from None
    if rule.name in builtins:
        raise ConfigError(f"rule '{name}' is named '{rule.name}', a built-in rule; pick another name "
                          f"(exit_rule(name=...))")
    return rule


def resolve_rules(names: Sequence[str | ExitRule], section: str, online: bool = False) -> list[ExitRule]:
    """The rules of a params list (``readouts.rules``, ``latency.rules``), checked: every name known, no two
    rules with one output name, and with ``online`` every rule runnable online.

    Raises:
        ConfigError: one line prefixed with ``section``.
    """
    out: list[ExitRule] = []
    seen: dict[str, str | ExitRule] = {}
    for n in names:
        try:
            r = get_rule(n)
        except ConfigError as exc:
            raise ConfigError(f"{section}: {exc}") from None
        if r.name in seen:
            raise ConfigError(f"{section}: rules '{seen[r.name]}' and '{n}' both have the name '{r.name}'")
        if online and r.online is None:
            why = next((f"; '{s}': {OFFLINE_ONLY_SIGNALS[s]}" for s in r.signals if s in OFFLINE_ONLY_SIGNALS), "")
            raise ConfigError(f"{section}: rule '{r.name}' cannot run online ({r.kind}: it reads "
                              f"{', '.join(r.signals)}{why}); evaluate it offline in readouts.rules")
        seen[r.name] = n if isinstance(n, str) else r.name
        out.append(r)
    return out


def loop_signals(loop: Mapping[str, np.ndarray], n_loops: int) -> dict[str, np.ndarray]:
    """The signal dict a rule's ``score`` sees: token_loop's [token, loop] columns plus ``loop`` = t (int64)."""
    first = next(iter(loop.values()))
    return {**loop, "loop": np.tile(np.arange(1, n_loops + 1, dtype=np.int64), (first.shape[0], 1))}
