"""What a run is made of: the model list, a model's task and regime, and the versions it ran with.

Every stage that needs the default matrix of models (``train.tasks`` × ``train.regimes``) or the
versions to record asks this module; it reads ``params.yaml`` as plain YAML, so that offline stages
never import torch or the training code just to name the models.
"""

from __future__ import annotations

import datetime as dt
import functools
import hashlib
import importlib
import os
import platform
import sys
from collections.abc import Iterable, Mapping
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import numpy as np
import polars as pl

from looptrace import __version__
from looptrace.config import ConfigError, ParamsFiles, read_params, to_dict


def versions() -> dict:
    """Versions recorded in every artifact: looptrace, torch, numpy, zarr, polars, sklearn, scipy, python.

    Read from the installed distributions' metadata: importing torch, scikit-learn and zarr only to read
    their version strings costs ~5 s per process on this machine — more than the whole readouts
    computation — and would make offline stages import torch. Read once per process (a copy is returned):
    the metadata scan costs ~50 ms, paid by every dump of a split otherwise.
    """
    return dict(_versions())


@functools.cache
def _versions() -> dict:
    def v(dist: str) -> str | None:
        try:
            return version(dist)
        except PackageNotFoundError:
            return None

    return {"looptrace": __version__, "torch": v("torch"), "numpy": np.__version__, "zarr": v("zarr"),
            "polars": pl.__version__, "sklearn": v("scikit-learn"), "scipy": v("scipy"),
            "python": platform.python_version()}


def machine() -> dict:
    """Where and when a report was made: ``date`` (UTC, ISO 8601; ``SOURCE_DATE_EPOCH`` fixes it, the
    reproducible-builds convention), ``platform``, ``machine`` (architecture), ``cpu`` (the CPU model from
    /proc/cpuinfo, else :func:`platform.processor`) and ``cpu_count``.

    Recorded beside the headline figures because the same params give different weights on another CPU:
    the figures' bytes depend on the machine, the findings must hold within their intervals.
    """

    epoch = os.environ.get("SOURCE_DATE_EPOCH")
    when = (dt.datetime.fromtimestamp(int(epoch), dt.UTC) if epoch and epoch.strip().isdigit()
            else dt.datetime.now(dt.UTC)).replace(microsecond=0)
    cpu = ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fh:
            cpu = next((ln.split(":", 1)[1].strip() for ln in fh if ln.lower().startswith("model name")), "")
    except OSError:
        pass
    return {"date": when.isoformat().replace("+00:00", "Z"), "platform": platform.platform(),
            "machine": platform.machine(), "cpu": cpu or platform.processor() or "unknown",
            "cpu_count": os.cpu_count()}


def host_cores() -> int:
    """The cores this process may run on (its CPU affinity where the OS tells it, else every core)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def source_hash(modules: Iterable[str]) -> str:
    """sha256 of the source of the named modules (each imported if it is not yet), in name order: the part of a
    stage's fingerprint that changes when the code that decides its values does."""
    h = hashlib.sha256()
    for name in sorted(set(modules)):
        module = sys.modules.get(name) or importlib.import_module(name)
        source = getattr(module, "__file__", None)
        h.update(name.encode() + b"\0" + (Path(source).read_bytes() if source else b""))
    return h.hexdigest()


def model_name(task: str, regime: str, seed: int | None = None) -> str:
    """``<task>-<regime>`` (one seed) or ``<task>-<regime>-s<seed>`` (a seed axis): the artifact name of every stage."""
    return f"{task}-{regime}" if seed is None else f"{task}-{regime}-s{seed}"


def split_seed(model: str) -> tuple[str, int | None]:
    """``("<task>-<regime>", seed)`` of ``<task>-<regime>-s<seed>``; ``(model, None)`` for a name without a seed.

    The first element is the model's *group*: the models that differ only by training seed, over which the
    report states the spread across seeds.
    """
    head, sep, tail = model.rpartition("-s")
    if sep and head and tail.isdigit():
        return head, int(tail)
    return model, None


def seed_groups(models: list[str]) -> dict[str, list[str]]:
    """group (``<task>-<regime>``) -> its models in the given order; groups in order of first appearance."""
    out: dict[str, list[str]] = {}
    for m in models:
        out.setdefault(split_seed(m)[0], []).append(m)
    return out


def resolve_model(model: str, task_defs: dict, regime_defs: dict) -> dict:
    """Task, regime, seed and regime definition of a ``<task>-<regime>[-s<seed>]`` model name (SPEC §10).

    Args:
        model: the model name.
        task_defs: ``train.task_defs`` (name -> TaskConfig or its params mapping).
        regime_defs: ``train.regime_defs`` (name -> RegimeConfig or its params mapping).

    Returns:
        dict with ``model``, ``group`` (the name without its seed), ``seed`` (None without one), ``task``,
        ``regime``, ``regime_kind`` and ``regime_def`` (task/regime fields None when the name is not a known
        task × regime, e.g. an adapter's run name).
    """
    group, seed = split_seed(model)
    for name, sd in ((model, None), (group, seed)):
        for t in task_defs:
            for r, rdef in regime_defs.items():
                if name == f"{t}-{r}":
                    d = to_dict(rdef)
                    return {"model": model, "group": name, "seed": sd, "task": t, "regime": r,
                            "regime_kind": d.get("kind"), "regime_def": d}
    return {"model": model, "group": model, "seed": None, "task": None, "regime": None, "regime_kind": None,
            "regime_def": None}


def model_names(params: ParamsFiles | Mapping, models: str = "") -> list[str]:
    """The models a multi-model stage runs on: ``--models a,b`` or the default matrix.

    Args:
        params: the params file(s) (or their parsed, merged mapping).
        models: comma-separated names from the command line ("" = ``train.tasks`` × ``train.regimes``).

    Returns:
        Model names ``<task>-<regime>-s<seed>`` in matrix order (tasks outer, then regimes, then
        ``train.seeds``); ``<task>-<regime>`` when ``train.seeds`` is empty.

    Raises:
        ConfigError: neither ``--models`` nor a non-empty matrix.
    """
    if models:
        return [m.strip() for m in models.split(",") if m.strip()]
    raw = params if isinstance(params, Mapping) else read_params(params)
    train = raw.get("train") or {}
    if not isinstance(train, Mapping):
        raise ConfigError(f"section 'train' must be a mapping (key: value lines), got {type(train).__name__}")
    for key in ("tasks", "regimes"):
        v = train.get(key)
        if v is not None and not (isinstance(v, list) and all(isinstance(x, str) for x in v)):
            raise ConfigError(f"train.{key} = {v!r}: expected a list of names, e.g. [{'running_sum' if key == 'tasks' else 'uniform'}]")
    seeds = train.get("seeds")
    if seeds is not None and not (isinstance(seeds, list) and all(isinstance(x, int) and not isinstance(x, bool)
                                                                  for x in seeds)):
        raise ConfigError(f"train.seeds = {seeds!r}: expected a list of integers, e.g. [0, 1, 2]")
    seeds = list(seeds or []) or [None]
    names = [model_name(t, r, s) for t in train.get("tasks") or [] for r in train.get("regimes") or []
             for s in seeds]
    if not names:
        raise ConfigError("params section 'train' lists no tasks × regimes; pass --models")
    return names


def model_meta(model: str, params: ParamsFiles | Mapping) -> dict:
    """:func:`resolve_model` with the task and regime definitions of the params file."""
    raw = params if isinstance(params, Mapping) else read_params(params)
    train = raw.get("train") or {}
    return resolve_model(model, train.get("task_defs") or {}, train.get("regime_defs") or {})


def defined_names(params: ParamsFiles | Mapping) -> dict[str, list[str]]:
    """What a params file defines, for ``looptrace --help``: ``tasks`` (``train.task_defs`` keys), ``regimes``
    (``train.regime_defs`` keys) and ``models`` (:func:`model_names` of its matrix).

    Raises:
        ConfigError: the file or its ``train`` section cannot be read.
    """
    raw = params if isinstance(params, Mapping) else read_params(params)
    models = model_names(raw)  # also refuses a `train` that is not a mapping
    train = raw.get("train") or {}
    task_defs, regime_defs = train.get("task_defs") or {}, train.get("regime_defs") or {}
    return {"tasks": [str(k) for k in task_defs] if isinstance(task_defs, Mapping) else [],
            "regimes": [str(k) for k in regime_defs] if isinstance(regime_defs, Mapping) else [],
            "models": models}
