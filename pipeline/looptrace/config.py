"""Typed configuration: one frozen dataclass per ``params.yaml`` section.

Every stage reads its own section (plus ``base``) through :func:`load_section`. Unknown keys are an
error that names the key and the section, so a typo in ``params.yaml`` or in ``dvc exp run -S`` never
silently falls back to a default.

Profiles (``profiles/<name>/params.yaml``, nanoGPT-style) are small override files layered over
``params.yaml``: every loader takes one params file or a sequence of them (``--params params.yaml --params
profiles/ad/params.yaml``), merged left to right by :func:`merge_params` — mappings merge key by key, any other
value (list, scalar, null) replaces. Every file may only name sections of :data:`SECTIONS`; keys inside a
section are checked against its dataclass when a stage loads it, as for one file.

A section dataclass may nest other dataclasses (fields typed as a dataclass, a tuple of dataclasses
or a ``dict[str, Dataclass]``); nested mappings are converted recursively and checked the same way.

Validation is declarative where a field is declared: types are exact (a bool is not an int, an int is a float but
NaN/inf are not, a string is not a number), and a field typed with one of the constrained aliases below
(:data:`PosInt`, :data:`NonNegInt`, :data:`PosFloat`, :data:`Unit`, :data:`Percent` ... or ``Annotated[T, Check(...)]``)
is range-checked by :func:`from_dict` with a one-line :class:`ConfigError` naming the key, the value and the fix.
Checks that need several fields stay in the dataclass's ``__post_init__``; checks across sections are
:func:`require_in` calls in the stage that reads both. A section of the wrong shape (``readouts: [bad]``) and a
top-level section that is not one of :data:`SECTIONS` (``readout:``) are refused; a stage refuses a params file
without its own section (``load_section(..., required=True)``; docs/errors.md, "Params").

Errors: every error a user can fix is a :class:`UserError` (one line, exit 2 through ``looptrace.errors``):
:class:`ConfigError` (params), :class:`InputError` (an input artifact is missing, truncated or does not belong
with the others), :class:`CheckpointLoadError` (a checkpoint cannot be loaded); ``StoreError``
(looptrace.io.store.schema) and ``LockError`` (looptrace.io.artifacts) are of the same family. Anything else is a bug (traceback, exit 1).
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import math
import re
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

import yaml

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

T = TypeVar("T", bound="DataclassInstance")

DEFAULT_PARAMS = Path("params.yaml")

#: One params file, or several layered left to right (later files override earlier ones).
ParamsFiles = Path | str | Sequence[Path | str]

#: ``--params`` help of every stage.
PARAMS_HELP = ("params file; repeat to layer override files over it, later ones winning "
               "(--params params.yaml --params profiles/ad/params.yaml)")

#: The stages: one per entry module ``looptrace/stages/<name>.py`` (each registers itself there,
#: :func:`looptrace.stages.register_stage`), named by its file so that loading params imports no entry (torch).
STAGE_NAMES = tuple(sorted(p.stem for p in (Path(__file__).parent / "stages").glob("*.py") if p.stem != "__init__"))
#: Sections read by several stages (``base``: :class:`BaseConfig`; ``calibration``, ``intervals``: the operating-point
#: and interval protocols, looptrace.rules.scoring and looptrace.intervals).
SHARED_SECTIONS = ("base", "calibration", "intervals")
#: The params sections: the shared ones and one per stage (docs/DESIGN.md: which stage reads which).
SECTIONS = (*SHARED_SECTIONS, *STAGE_NAMES)


class UserError(Exception):
    """An error the user can fix (bad params, a missing or damaged input): printed as one line, exit status 2.

    Raise it (or a subclass) only where the cause is known, with the file or key, what was expected and the fix;
    anything else that escapes a stage is a bug and is reported with its traceback (``looptrace.errors``).
    """


class ConfigError(UserError, ValueError):
    """A one-line, user-facing configuration error (names the key, the section and the fix)."""


class InputError(UserError, ValueError):
    """An input artifact of a stage is missing, truncated, damaged or belongs to another run (names the file and the
    stage that rebuilds it)."""


class MissingInputError(InputError, FileNotFoundError):
    """An input artifact does not exist (names the file and the stage that writes it)."""


class CheckpointLoadError(UserError, ValueError):
    """A checkpoint that cannot be loaded, with a known cause: one line naming the path, what failed and the fix."""


# ----------------------------------------------------------------------------------------------
# Declarative field constraints
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Check:
    """A constraint on a field's value, attached with ``Annotated[T, Check(...)]`` and checked by :func:`from_dict`.

    Attributes:
        ge, gt, le, lt: bounds (``None`` = none).
        choices: the allowed values.
        pattern: a regular expression the whole string must match.
        nonempty: a list or mapping must have at least one entry.
        why: what the value means (printed with the requirement, e.g. "optimiser steps").
    """

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    choices: tuple | None = None
    pattern: str | None = None
    nonempty: bool = False
    why: str = ""

    def requirement(self) -> str:
        if self.choices is not None:
            return "one of " + ", ".join(str(c) for c in self.choices)
        if self.pattern is not None:
            return f"a string matching {self.pattern}"
        lo = f"≥ {_num(self.ge)}" if self.ge is not None else f"> {_num(self.gt)}" if self.gt is not None else ""
        hi = f"≤ {_num(self.le)}" if self.le is not None else f"< {_num(self.lt)}" if self.lt is not None else ""
        if lo and hi:
            a = "[" if self.ge is not None else "("
            b = "]" if self.le is not None else ")"
            lo_v = self.ge if self.ge is not None else self.gt
            hi_v = self.le if self.le is not None else self.lt
            return f"in {a}{_num(lo_v)}, {_num(hi_v)}{b}"
        return lo or hi or "non-empty"

    def ok(self, v: Any) -> bool:
        if self.nonempty and isinstance(v, tuple | list | dict) and not v:
            return False
        if isinstance(v, tuple | list | dict):
            return True
        if self.choices is not None and v not in self.choices:
            return False
        if self.pattern is not None and not (isinstance(v, str) and re.fullmatch(self.pattern, v)):
            return False
        if isinstance(v, int | float) and not isinstance(v, bool):
            if self.ge is not None and not v >= self.ge:
                return False
            if self.gt is not None and not v > self.gt:
                return False
            if self.le is not None and not v <= self.le:
                return False
            if self.lt is not None and not v < self.lt:
                return False
        return True

    def validate(self, v: Any, where: str) -> None:
        if not self.ok(v):
            why = f" ({self.why})" if self.why else ""
            raise ConfigError(f"{where} = {_show(v)}: must be {self.requirement()}{why}; set {where} to such a value")


def _num(x: float | None) -> str:
    return str(int(x)) if isinstance(x, float) and x.is_integer() and abs(x) < 1e15 else str(x)


def _show(v: Any) -> str:
    """A value as the user wrote it in YAML (true/false/null, lists in brackets)."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, tuple | list):
        return "[" + ", ".join(_show(x) for x in v) + "]"
    if isinstance(v, str):
        return repr(v)
    return str(v)


#: Integers ≥ 1 (counts, sizes, steps).
PosInt = Annotated[int, Check(ge=1)]
#: Integers ≥ 0.
NonNegInt = Annotated[int, Check(ge=0)]
#: Floats > 0.
PosFloat = Annotated[float, Check(gt=0)]
#: Floats ≥ 0.
NonNegFloat = Annotated[float, Check(ge=0)]
#: Floats in the open interval (0, 1) (fractions, λ).
Unit = Annotated[float, Check(gt=0, lt=1)]
#: Accuracy targets in percent, (0, 100].
Percent = Annotated[float, Check(gt=0, le=100)]
#: A seed: numpy's SeedSequence and torch.manual_seed take any integer in [0, 2^32).
Seed = Annotated[int, Check(ge=0, lt=2**32, why="a seed")]


def one_of(*choices: Any, why: str = "") -> Check:
    """``Annotated[str, one_of("a", "b")]``: the value must be one of ``choices``."""
    return Check(choices=tuple(choices), why=why)


def require_in(key: str, value: Any, allowed_key: str, allowed: Sequence[Any]) -> None:
    """A cross-section check: ``value`` (of params key ``key``) must be one of ``allowed`` (the values of
    ``allowed_key``), else a one-line :class:`ConfigError` naming both keys."""
    vals = list(allowed)
    if not any(_same(value, a) for a in vals):
        raise ConfigError(f"{key} = {_show(value)} is not in {allowed_key} = {_show(vals)}; "
                          f"set {key} to one of them or add it to {allowed_key}")


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, int | float) and isinstance(b, int | float) and not isinstance(a, bool):
        return math.isclose(float(a), float(b), rel_tol=1e-9, abs_tol=0.0)
    return a == b


@dataclasses.dataclass(frozen=True)
class DaskConfig:
    """``base.dask``: where the offline stages' per-chunk work runs (:mod:`looptrace.io.parallel`).

    The outputs are the same bytes wherever they run; only time and memory change.

    Attributes:
        scheduler: ``null`` (in this process, the default: no Dask), ``local`` (a ``LocalCluster`` of
            ``workers`` single-threaded processes on 127.0.0.1, for the stage's duration) or the address of a
            running scheduler (``tcp://host:8786``; dask-jobqueue, Kubernetes). ``$LOOPTRACE_DASK_SCHEDULER``
            overrides it.
        workers: worker processes of ``local`` (null = the machine's CPU count); ignored for an address.
        max_in_flight: tasks submitted ahead of the one the stage consumes (null = 2 × worker threads);
            bounds the results waiting in the stage's memory.
        connect_timeout_s: seconds to wait for a scheduler address to answer before the stage stops with a one-line
            error naming it (an address nothing listens on).
    """

    scheduler: str | None = None
    workers: int | None = None
    max_in_flight: int | None = None
    connect_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        s = self.scheduler
        if s is not None and not (s == "local" or "://" in s or ":" in s):
            raise ConfigError(f"base.dask.scheduler must be null, 'local' or a scheduler address "
                              f"(tcp://host:8786), got {s!r}")
        for key in ("workers", "max_in_flight"):
            v = getattr(self, key)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ConfigError(f"base.dask.{key} must be an integer >= 1 or null, got {v!r}")
        t = self.connect_timeout_s
        if isinstance(t, bool) or not isinstance(t, int | float) or not 0 < t < math.inf:
            raise ConfigError(f"base.dask.connect_timeout_s must be a number of seconds > 0, got {t!r}")


@dataclasses.dataclass(frozen=True)
class BaseConfig:
    """``base`` section: settings shared by every stage.

    Attributes:
        seed: master seed; every RNG in every stage is derived from it.
        threads: torch intra-op threads of model work (train, dump, dynamics).
        analysis_threads: BLAS and torch threads of gate fitting and of latency timing. One by default:
            the gates' matrices are small (a multi-threaded OpenBLAS SVD of a 10k × 64 matrix was measured
            25× slower than one thread on a shared machine), and a multi-threaded op waits for its slowest
            thread, which makes the small per-loop kernels that latency times slow and erratic.
        device: torch device string for model work (``cpu``, ``cuda``).
        dask: where the offline stages (geometry, readouts, gates, diagnose) run their per-chunk work
            (:class:`DaskConfig`; default in this process).
    """

    seed: Seed = 0
    threads: Annotated[int, Check(ge=1, why="torch threads")] = 2
    analysis_threads: Annotated[int, Check(ge=1, why="BLAS and torch threads")] = 1
    device: Annotated[str, Check(pattern=r"cpu|cuda(:[0-9]+)?|mps", why="a torch device")] = "cpu"
    dask: DaskConfig = dataclasses.field(default_factory=DaskConfig)


def _type_name(tp: Any) -> str:
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false"}.get(tp, str(tp))


def _convert(tp: Any, value: Any, where: str) -> Any:
    """Convert a YAML value to the annotated type ``tp`` (recursing into dataclasses), checking exact types and
    every :class:`Check` of an ``Annotated`` type."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is Annotated:
        out = _convert(args[0], value, where)
        for c in tp.__metadata__:
            if isinstance(c, Check):
                c.validate(out, where)
        return out
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{where} must be a mapping (key: value lines), got {_kind(value)} {_show(value)}")
        return from_dict(typing.cast("type[DataclassInstance]", tp), value, where)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        non_none = [a for a in args if a is not type(None)]
        if len(non_none) == 1:
            if value is None:
                raise ConfigError(f"{where} = null: expected {_type_name(_base_type(non_none[0]))}; set a value")
            return _convert(non_none[0], value, where)
        return value
    if origin is tuple:
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{where} = {_show(value)}: expected a list, got {_kind(value)}; write [a, b, ...]")
        inner = args[0] if args else Any
        return tuple(_convert(inner, v, f"{where}[{i}]") for i, v in enumerate(value))
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where} must be a mapping (key: value lines), got {_kind(value)} {_show(value)}")
        kt = args[0] if len(args) == 2 else Any
        vt = args[1] if len(args) == 2 else Any
        if kt is str:
            bad = [k for k in value if not isinstance(k, str)]
            if bad:
                raise ConfigError(f"{where}: key {_show(bad[0])} must be a name (a string), got {_kind(bad[0])}")
        return {k: _convert(vt, v, f"{where}.{k}") for k, v in value.items()}
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{where} = {_show(value)}: expected a number, got {_kind(value)}")
        if not math.isfinite(value):
            raise ConfigError(f"{where} = {value}: expected a finite number; set a finite value")
        return float(value)
    if tp is int and (isinstance(value, bool) or not isinstance(value, int)):
        hint = "; write an integer such as 1" if isinstance(value, bool | float) else ""
        raise ConfigError(f"{where} = {_show(value)}: expected an integer, got {_kind(value)}{hint}")
    if tp in (str, bool) and not isinstance(value, tp):
        raise ConfigError(f"{where} = {_show(value)}: expected {_type_name(tp)}, got {_kind(value)}")
    return value


def _base_type(tp: Any) -> Any:
    return typing.get_args(tp)[0] if typing.get_origin(tp) is Annotated else tp


def _kind(v: Any) -> str:
    if v is None:
        return "null"
    return {bool: "a bool", int: "an integer", float: "a number", str: "a string", list: "a list",
            dict: "a mapping", tuple: "a list"}.get(type(v), type(v).__name__)


def from_dict(cls: type[T], data: dict[str, Any], section: str) -> T:
    """Build the frozen dataclass ``cls`` from a mapping, rejecting unknown keys.

    Args:
        cls: a dataclass type.
        data: the mapping read from YAML.
        section: dotted name of the section, used in error messages (e.g. ``train.regimes.joint``).

    Raises:
        ConfigError: on an unknown key or a value of the wrong type.
    """
    if not isinstance(data, dict):
        raise ConfigError(f"section '{section}' must be a mapping (key: value lines), got {_kind(data)} "
                          f"{_show(data)}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(map(str, data)) - set(fields))
    if unknown:
        close = difflib.get_close_matches(unknown[0], list(fields), n=1)
        hint = f"did you mean '{close[0]}'? " if close else ""
        raise ConfigError(
            f"unknown key '{unknown[0]}' in params section '{section}'; {hint}"
            f"allowed keys: {', '.join(sorted(fields))}"
        )
    hints = typing.get_type_hints(cls, include_extras=True)
    kwargs = {k: _convert(hints[k], v, f"{section}.{k}") for k, v in data.items()}
    try:
        return cls(**kwargs)
    except TypeError as exc:  # missing required field
        raise ConfigError(f"params section '{section}': {exc}") from None


#: libyaml's parser where PyYAML has it: the same documents, ~10x faster than the pure-Python one.
_FAST_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def _read_one(path: Path) -> dict[str, Any]:
    if not path.is_file():
        what = "is a directory, not a file" if path.is_dir() else "not found"
        raise ConfigError(f"params file '{path}' {what}; run from the repository root or pass --params")
    try:
        text = path.read_text()
    except UnicodeDecodeError as exc:
        raise ConfigError(f"params file '{path}' is not valid YAML: {exc}".splitlines()[0]) from None
    # A stage loads a dozen sections, each reading the params files: parse each distinct text once per process
    # (keyed on the text itself, so an edited file is parsed again), and hand out copies.
    return copy.deepcopy(_parse(text, str(path)))


@functools.lru_cache(maxsize=32)
def _parse(text: str, path: str) -> dict[str, Any]:
    try:
        data = yaml.load(text, Loader=_FAST_LOADER)  # noqa: S506 - a SafeLoader (libyaml's or PyYAML's)
    except yaml.YAMLError:
        try:  # the pure-Python parser decides, with its message (the same whichever parser is installed)
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ConfigError(f"params file '{path}' is not valid YAML: {exc}".splitlines()[0]) from None
    refuse_duplicate_keys(text, path, _FAST_LOADER)
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"params file '{path}' must be a mapping of sections (base:, train:, ...), got "
                          f"{_kind(data)}")
    unknown = [k for k in data if k not in SECTIONS]
    if unknown:
        close = difflib.get_close_matches(str(unknown[0]), SECTIONS, n=1)
        hint = f"did you mean '{close[0]}'? " if close else ""
        raise ConfigError(f"unknown params section '{unknown[0]}' in '{path}'; {hint}"
                          f"allowed sections: {', '.join(SECTIONS)}")
    return data


def refuse_duplicate_keys(text: str, path: Path | str, loader: Any = yaml.SafeLoader) -> None:
    """Refuse a YAML mapping that gives a key twice (a section twice in one file, or ``{delta: 0.5, delta: 5}``):
    PyYAML keeps the last value silently. The document's node tree (``yaml.compose``) is walked, so the message
    names the dotted key and both lines.

    Raises:
        ConfigError: one line naming the file, the key, both lines and the fix.
    """
    def walk(node: yaml.Node, where: str) -> None:
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, yaml.Node] = {}
            for k, v in node.value:
                key = k.value if isinstance(k, yaml.ScalarNode) else None
                if key is not None and key != "<<":
                    name = f"{where}.{key}" if where else str(key)
                    if key in seen:
                        what = "section" if not where else "key"
                        raise ConfigError(f"params file '{path}': {what} '{name}' is given twice (line "
                                          f"{seen[key].start_mark.line + 1} and line {k.start_mark.line + 1}); "
                                          "YAML would keep only the last one: keep one of them")
                    seen[key] = k
                    walk(v, name)
                else:
                    walk(v, where)
        elif isinstance(node, yaml.SequenceNode):
            for i, v in enumerate(node.value):
                walk(v, f"{where}[{i}]")

    root = yaml.compose(text, Loader=loader)
    if root is not None:
        walk(root, "")


def merge_params(base: Mapping[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    """``override`` layered over ``base``: mappings merge key by key (recursively); any other value replaces."""
    out = dict(base)
    for k, v in override.items():
        out[k] = merge_params(out[k], v) if isinstance(v, Mapping) and isinstance(out.get(k), Mapping) else v
    return out


def params_files(path: ParamsFiles) -> list[Path]:
    """The params files of a ``--params`` value (one path or a sequence of them), in layering order."""
    files = [Path(path)] if isinstance(path, str | Path) else [Path(p) for p in path]
    if not files:
        raise ConfigError("no params file given; pass --params params.yaml")
    return files


def read_params(path: ParamsFiles = DEFAULT_PARAMS) -> dict[str, Any]:
    """Read ``params.yaml`` (or several files, merged left to right) as a plain mapping.

    Raises:
        ConfigError: a file is missing or not a YAML mapping, or a file names a section that is not in
            :data:`SECTIONS` (a misspelled ``readout:`` would otherwise be ignored silently).
    """
    files = params_files(path)
    data = _read_one(files[0])
    for f in files[1:]:
        data = merge_params(data, _read_one(f))
    return data


def load_section(cls: type[T], section: str, path: ParamsFiles = DEFAULT_PARAMS, required: bool = False) -> T:
    """Load one section of ``params.yaml`` (or of layered params files) into its dataclass.

    A missing (or empty, ``section:``) section gives the dataclass defaults (every field must then have one),
    unless ``required``: a stage loads its own section with ``required=True``, so that an empty params file or an
    override file passed alone is refused instead of running on built-in defaults that differ from params.yaml.

    Raises:
        ConfigError: the section is required and absent, is not a mapping, or has a bad key or value.
    """
    data = read_params(path)
    if required and section not in data:
        files = ", ".join(str(f) for f in params_files(path))
        raise ConfigError(f"params section '{section}' is missing from {files} (the {section} stage's settings); "
                          "pass the repository's params.yaml first (--params params.yaml), or add the section")
    raw = data.get(section)
    return from_dict(cls, {} if raw is None else raw, section)


def load_base(path: ParamsFiles = DEFAULT_PARAMS) -> BaseConfig:
    """Load the ``base`` section."""
    return load_section(BaseConfig, "base", path)


#: ``dataclasses.field(metadata=OMIT_DEFAULT)``: :func:`to_dict` leaves the field out while it has its default. For
#: options added after checkpoints and stores already recorded their config: a run that does not use the option
#: keeps the bytes it had (checkpoint hashes, store fingerprints), and loading fills the default back in.
OMIT_DEFAULT = {"omit_default": True}


def to_dict(cfg: Any) -> Any:
    """A dataclass (possibly nested) as plain JSON-able Python objects (fields marked :data:`OMIT_DEFAULT` only
    when they differ from their default)."""
    if dataclasses.is_dataclass(cfg):
        return {f.name: to_dict(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)
                if not (f.metadata.get("omit_default") and getattr(cfg, f.name) == f.default)}
    if isinstance(cfg, tuple | list):
        return [to_dict(v) for v in cfg]
    if isinstance(cfg, dict):
        return {k: to_dict(v) for k, v in cfg.items()}
    return cfg
