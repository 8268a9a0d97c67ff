"""Typed configuration: one frozen dataclass per ``params.yaml`` section.

Every stage reads its own section (plus ``base``) through :func:`load_section`. Unknown keys are an
error that names the key and the section, so a typo in ``params.yaml`` or in ``dvc exp run -S`` never
silently falls back to a default.

A section dataclass may nest other dataclasses (fields typed as a dataclass, a tuple of dataclasses
or a ``dict[str, Dataclass]``); nested mappings are converted recursively and checked the same way.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

import yaml

T = TypeVar("T")

DEFAULT_PARAMS = Path("params.yaml")


class ConfigError(ValueError):
    """A one-line, user-facing configuration error (names the key, the section and the fix)."""


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
    """

    seed: int = 0
    threads: int = 2
    analysis_threads: int = 1
    device: str = "cpu"


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


def read_params(path: Path | str = DEFAULT_PARAMS) -> dict[str, Any]:
    """Read ``params.yaml`` as a plain mapping (error names the file when it is missing or bad)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"params file '{path}' not found; run from the repository root or pass --params")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"params file '{path}' is not valid YAML: {exc}".splitlines()[0]) from None
    if not isinstance(data, dict):
        raise ConfigError(f"params file '{path}' must be a mapping of sections")
    return data


def load_section(cls: type[T], section: str, path: Path | str = DEFAULT_PARAMS) -> T:
    """Load one section of ``params.yaml`` into its dataclass.

    A missing section gives the dataclass defaults (every field must then have one).
    """
    data = read_params(path)
    return from_dict(cls, data.get(section) or {}, section)


def load_base(path: Path | str = DEFAULT_PARAMS) -> BaseConfig:
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
