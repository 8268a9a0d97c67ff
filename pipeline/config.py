"""Typed configuration: one frozen dataclass per ``params.yaml`` section.

Every stage reads its own section (plus ``base``) through :func:`load_section`. Unknown keys are an
error that names the key and the section, so a typo in ``params.yaml`` or in ``dvc exp run -S`` never
silently falls back to a default.

Profiles (``profiles/<name>/params.yaml``, nanoGPT-style) are small override files layered over
``params.yaml``: every loader takes one params file or a sequence of them (``--params params.yaml --params
profiles/ad/params.yaml``), merged left to right by :func:`merge_params` — mappings merge key by key, any other
value (list, scalar, null) replaces. An override file may only name sections of :data:`SECTIONS` (or of the
first file); keys inside a section are checked against its dataclass when a stage loads it, as for one file.

A section dataclass may nest other dataclasses (fields typed as a dataclass, a tuple of dataclasses
or a ``dict[str, Dataclass]``); nested mappings are converted recursively and checked the same way.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import yaml

T = TypeVar("T")

DEFAULT_PARAMS = Path("params.yaml")

#: One params file, or several layered left to right (later files override earlier ones).
ParamsFiles = Path | str | Sequence[Path | str]

#: ``--params`` help of every stage.
PARAMS_HELP = ("params file; repeat to layer override files over it, later ones winning "
               "(--params params.yaml --params profiles/ad/params.yaml)")

#: The params sections, in params.yaml order (docs/DESIGN.md: which stage reads which).
SECTIONS = ("base", "train", "dump", "geometry", "dynamics", "calibration", "readouts", "gates", "diagnose",
            "latency", "report")


class ConfigError(ValueError):
    """A one-line, user-facing configuration error (names the key, the section and the fix)."""


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
    """

    scheduler: str | None = None
    workers: int | None = None
    max_in_flight: int | None = None

    def __post_init__(self) -> None:
        s = self.scheduler
        if s is not None and not (s == "local" or "://" in s or ":" in s):
            raise ConfigError(f"base.dask.scheduler must be null, 'local' or a scheduler address "
                              f"(tcp://host:8786), got {s!r}")
        for key in ("workers", "max_in_flight"):
            v = getattr(self, key)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ConfigError(f"base.dask.{key} must be an integer >= 1 or null, got {v!r}")


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

    seed: int = 0
    threads: int = 2
    analysis_threads: int = 1
    device: str = "cpu"
    dask: DaskConfig = dataclasses.field(default_factory=DaskConfig)


def _convert(tp: Any, value: Any, where: str) -> Any:
    """Convert a YAML value to the annotated type ``tp`` (recursing into dataclasses)."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {type(value).__name__}")
        return from_dict(tp, value, where)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        non_none = [a for a in args if a is not type(None)]
        if len(non_none) == 1:
            return _convert(non_none[0], value, where)
        return value
    if origin is tuple:
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{where}: expected a list, got {type(value).__name__}")
        inner = args[0] if args else Any
        return tuple(_convert(inner, v, f"{where}[{i}]") for i, v in enumerate(value))
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {type(value).__name__}")
        vt = args[1] if len(args) == 2 else Any
        return {k: _convert(vt, v, f"{where}.{k}") for k, v in value.items()}
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp in (int, float, str, bool) and not isinstance(value, tp):
        raise ConfigError(f"{where}: expected {tp.__name__}, got {value!r}")
    return value


def from_dict(cls: type[T], data: dict[str, Any], section: str) -> T:
    """Build the frozen dataclass ``cls`` from a mapping, rejecting unknown keys.

    Args:
        cls: a dataclass type.
        data: the mapping read from YAML.
        section: dotted name of the section, used in error messages (e.g. ``train.regimes.joint``).

    Raises:
        ConfigError: on an unknown key or a value of the wrong type.
    """
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ConfigError(
            f"unknown key '{unknown[0]}' in params section '{section}'; "
            f"allowed keys: {', '.join(sorted(fields))}"
        )
    hints = typing.get_type_hints(cls)
    kwargs = {k: _convert(hints[k], v, f"{section}.{k}") for k, v in data.items()}
    try:
        return cls(**kwargs)
    except TypeError as exc:  # missing required field
        raise ConfigError(f"params section '{section}': {exc}") from None


def _read_one(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"params file '{path}' not found; run from the repository root or pass --params")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"params file '{path}' is not valid YAML: {exc}".splitlines()[0]) from None
    if not isinstance(data, dict):
        raise ConfigError(f"params file '{path}' must be a mapping of sections")
    return data


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
        ConfigError: a file is missing or not a YAML mapping, or an override file (any file after the first)
            names a section that is neither in :data:`SECTIONS` nor in the first file.
    """
    files = params_files(path)
    data = _read_one(files[0])
    for f in files[1:]:
        over = _read_one(f)
        unknown = sorted(k for k in over if k not in SECTIONS and k not in data)
        if unknown:
            raise ConfigError(f"unknown params section '{unknown[0]}' in override file '{f}'; "
                              f"allowed sections: {', '.join(SECTIONS)}")
        data = merge_params(data, over)
    return data


def load_section(cls: type[T], section: str, path: ParamsFiles = DEFAULT_PARAMS) -> T:
    """Load one section of ``params.yaml`` (or of layered params files) into its dataclass.

    A missing section gives the dataclass defaults (every field must then have one).
    """
    data = read_params(path)
    return from_dict(cls, data.get(section) or {}, section)


def load_base(path: ParamsFiles = DEFAULT_PARAMS) -> BaseConfig:
    """Load the ``base`` section."""
    return load_section(BaseConfig, "base", path)


def to_dict(cfg: Any) -> Any:
    """A dataclass (possibly nested) as plain JSON-able Python objects."""
    if dataclasses.is_dataclass(cfg):
        return {f.name: to_dict(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}
    if isinstance(cfg, tuple | list):
        return [to_dict(v) for v in cfg]
    if isinstance(cfg, dict):
        return {k: to_dict(v) for k, v in cfg.items()}
    return cfg
