"""One registry mechanism for everything looked up by name: adapter kinds, stages, exit rules, signals.

A :class:`Registry` maps a name to an object, in the spirit of lm-evaluation-harness's ``Registry``. An entry is

- a **reference** ``"package.module:object"`` (a string), resolved on first use: the module is imported then, not
  when the registry is; ``"package.module"`` alone names a module that registers the name itself when imported
  (:meth:`Registry.register`);
- or the **object** itself (anything but a string), registered by the module that defines it
  (``@REGISTRY.register("name")``, :meth:`Registry.add`).

Names not in the table may come from installed packages, through an entry-point group (``group``); a registry
built with ``references=True`` also resolves a name that is itself a reference (a user's ``mypkg.rules:my_rule``).

References in the table are plain string literals on purpose: the static dependency scan that writes ``dvc.yaml``
(tests/import_graph.py) reads every ``"looptrace.x.y:object"`` literal as an import of ``looptrace.x.y``, so a
module that a stage can only reach through a table is still among that stage's deps, and editing it re-runs the
stage. Torch-free; imports only :mod:`looptrace.config` (the error type).
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Generic, TypeVar

from looptrace.config import ConfigError

T = TypeVar("T")


class RegistryError(ConfigError):
    """A name that resolves to nothing usable (unknown, a module that does not import, an object of the wrong kind):
    one line naming the name, the reference and the cause."""


class UnknownName(RegistryError, KeyError):
    """A name the registry does not know (a :class:`KeyError` too, as a mapping raises)."""

    __str__ = RegistryError.__str__  # the message as given, not KeyError's quoted repr


def _import(module: str):
    """``importlib.import_module``; a user's top-level module is also looked for in the working directory
    (``python stages/x.py``, as DVC runs a stage, does not put it on ``sys.path``)."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        cwd = os.getcwd()
        if exc.name != module.split(".")[0] or cwd in sys.path or "" in sys.path:
            raise
        sys.path.append(cwd)
        return importlib.import_module(module)


class Registry(Mapping[str, T], Generic[T]):
    """name -> object, resolved lazily (module docstring).

    Args:
        what: what an entry is, for messages (``adapter kind``, ``stage``, ``rule``).
        table: name -> reference ``"package.module:object"`` (or ``"package.module"``, which registers the name
            itself) or the object, in listing order.
        group: entry-point group of installed packages' entries (names not in the table), or None.
        check: why a resolved object is not a valid entry (``"is not an exit rule: ..."``), None when it is.
        adopt: the entry an object found through an entry point becomes: ``adopt(obj, name, value)`` (e.g. renamed
            after its entry point); default the object itself.
        references: a name that is itself a reference ``package.module:object`` resolves to that object.
    """

    def __init__(self, what: str, table: Mapping[str, str | T] | None = None, *, group: str | None = None,
                 check: Callable[[Any], str | None] | None = None,
                 adopt: Callable[[Any, str, str], T] | None = None, references: bool = False) -> None:
        self.what, self.group, self.references = what, group, references
        self._check, self._adopt = check, adopt
        self._table: dict[str, Any] = dict(table or {})
        self._loaded: dict[str, T] = {}

    # -- registering -----------------------------------------------------------------------------
    def add(self, name: str, entry: str | T, *, module: str | None = None, replace: bool = False) -> None:
        """Add ``name``: a reference (string) or the object. An object may replace the reference to the module
        registering it (``module``, default the object's ``__module__``), or anything with ``replace``; adding an
        equal entry again is a no-op.

        Raises:
            ValueError: ``name`` already holds another entry.
        """
        old = self._table.get(name)
        same = old is entry or (type(old) is type(entry) and old == entry)  # a module imported again
        if old is not None and not same and not replace:
            mod = module if module is not None else getattr(entry, "__module__", None)
            if not (isinstance(old, str) and not isinstance(entry, str) and old.split(":")[0] == mod):
                raise ValueError(f"{self.what} {name!r} is registered twice ({self._describe(old)}, "
                                 f"{self._describe(entry)})")
        self._table[name] = entry
        self._loaded.pop(name, None)

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator: register the decorated object (defined in the module that decorates it) as ``name``."""
        def deco(obj: T) -> T:
            self.add(name, obj)
            return obj

        return deco

    def copy(self) -> Registry[T]:
        """An independent registry with the same entries (tests swap one in)."""
        new: Registry[T] = Registry(self.what, self._table, group=self.group, check=self._check, adopt=self._adopt,
                                    references=self.references)
        new._loaded = dict(self._loaded)
        return new

    # -- looking up ----------------------------------------------------------------------------------
    def entry(self, name: str) -> Any:
        """The table's entry of ``name`` as it stands, resolving nothing: the object, the reference, or None."""
        return self._table.get(name)

    def refs(self) -> dict[str, str]:
        """The table's entries that are references (name -> ``package.module:object``), not yet or already
        resolved."""
        return {k: v for k, v in self._table.items() if isinstance(v, str)}

    def installed(self) -> dict[str, str]:
        """Entry points of ``group`` not shadowed by the table: name -> ``package.module:object``."""
        if self.group is None:
            return {}
        from importlib.metadata import entry_points

        out: dict[str, str] = {}
        for ep in entry_points(group=self.group):
            if ep.name not in self._table:
                out.setdefault(ep.name, ep.value)
        return out

    def names(self) -> tuple[str, ...]:
        """Every name, resolving nothing: the table's, in order, then the installed entry points'."""
        return (*self._table, *self.installed())

    def __iter__(self) -> Iterator[str]:
        """The table's names (registered and referenced), in order; :meth:`names` adds the installed ones."""
        return iter(list(self._table))

    def __len__(self) -> int:
        return len(self._table)

    def __contains__(self, name: object) -> bool:
        """Whether ``name`` is known, resolving nothing (the table, an installed entry point, a reference)."""
        if not isinstance(name, str):
            return False
        return name in self._table or name in self._loaded or name in self.installed() or \
            (self.references and ":" in name)

    def __getitem__(self, name: str) -> T:
        """The object of ``name``, resolved on first use.

        Raises:
            UnknownName: no entry, entry point or (``references``) reference of that name.
            RegistryError: its module does not import, lacks the object, or the object is not a valid entry.
        """
        if name in self._loaded:
            return self._loaded[name]
        if name in self._table:
            obj = self._resolve(name, self._table[name])
        elif self.group is not None and name in (installed := self.installed()):
            obj = self._from_entry_point(name, installed[name])
        elif self.references and ":" in name:
            obj = self.load(name)
        else:
            raise UnknownName(f"unknown {self.what} '{name}'")
        self._loaded[name] = obj
        return obj

    def load(self, ref: str, name: str | None = None) -> T:
        """The object a reference ``package.module:object`` names (attributes may be dotted), checked.

        Raises:
            RegistryError: one line: a malformed reference, a module that does not import, a missing attribute,
                an object that is not a valid entry.
        """
        label = f"{self.what} '{ref if name is None else name}'"
        mod, _, attr = ref.partition(":")
        if not mod or not attr:
            raise RegistryError(f"{label}: name it 'package.module:object'")
        obj = self._module(mod, label)
        for part in attr.split("."):
            if not hasattr(obj, part):
                raise RegistryError(f"{label}: module '{mod}' has no attribute '{attr}'")
            obj = getattr(obj, part)
        why = self._check(obj) if self._check is not None else None
        if why:
            raise RegistryError(f"{self.what} '{ref}' {why}" if name is None else f"{label}: '{ref}' {why}")
        return obj

    # -- internals -----------------------------------------------------------------------------------
    def _module(self, mod: str, label: str):
        try:
            return _import(mod)
        except Exception as exc:  # noqa: BLE001 - any import failure of a referenced module is one line
            msg = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise RegistryError(f"{label}: cannot import module '{mod}' ({msg})") from None

    def _resolve(self, name: str, entry: Any) -> T:
        if not isinstance(entry, str):
            return entry
        if ":" in entry:
            return self.load(entry, name)
        self._module(entry, f"{self.what} '{name}'")  # a module that registers the name itself
        now = self._table.get(name)
        if now is None or isinstance(now, str):
            raise RegistryError(f"{self.what} '{name}': module '{entry}' registers no {self.what} of that name")
        return now

    def _from_entry_point(self, name: str, value: str) -> T:
        from importlib.metadata import entry_points

        ep = next(iter(entry_points(group=str(self.group), name=name)))
        try:
            obj = ep.load()
        except Exception as exc:  # noqa: BLE001 - an installed package that fails to load is one line
            msg = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise RegistryError(f"{self.what} '{name}': cannot load entry point '{value}' ({msg})") from None
        why = self._check(obj) if self._check is not None else None
        if why:
            raise RegistryError(f"{self.what} '{name}': entry point '{value}' {why}")
        return self._adopt(obj, name, value) if self._adopt is not None else obj

    @staticmethod
    def _describe(entry: Any) -> str:
        if isinstance(entry, str) or not hasattr(entry, "__qualname__"):
            return repr(entry) if not isinstance(entry, str) else entry
        return f"{entry.__module__}:{entry.__qualname__}"


__all__ = ["Registry", "RegistryError", "UnknownName"]
