"""Running published remote code (Huginn's, Ouro's, Nanbeige's) under the installed transformers: the shim's
machinery.

These models ship their modeling code inside the checkpoint directory (``trust_remote_code``), written for
transformers 4.x: Huginn's ``raven_modeling_minimal.py`` / ``raven_config_minimal.py``
(seal-rg/recurrent-pretraining), Ouro's ``modeling_ouro.py`` / ``configuration_ouro.py`` (as published with the
ByteDance checkpoints) and Nanbeige4.2's ``modeling_nanbeige.py`` / ``configuration_nanbeige.py``. transformers 5
changed several interfaces that code relies on, so none loads unmodified under the version looptrace pins. This module makes it run **without touching the checkpoint**:

- it imports the checkpoint's own modules through transformers' dynamic-module loader
  (``get_class_from_dynamic_module``, local files only) — the very module objects ``AutoModelForCausalLM``
  with ``trust_remote_code`` uses — and patches their classes and module globals **in memory**;
- every patch is **feature-detected**: it is applied only when the installed transformers lacks what the
  code expects (e.g. ``ROPE_INIT_FUNCTIONS`` has no ``'default'``), so under 4.55–4.57 only the
  version-independent config fix fires, and nothing in transformers itself is modified (module-level
  replacements go into the remote module's namespace, class patches onto the remote classes);
- every patch is idempotent and recorded (:func:`active_patches`; the adapter stores the list in the model's
  ``extra.compat_patches``);
- ``LOOPTRACE_COMPAT_DISABLE=name,name`` switches patches off (to reproduce a raw failure);
- the installed transformers must lie in :data:`SUPPORTED_TRANSFORMERS` (checked before loading, the range
  is named in the error).

The patches of a family are its adapter class's ``patches`` (:class:`Patch`), in its kind's module, each listed
there with the transformers 5 change it answers (:mod:`~looptrace.models.adapters.huginn`,
:mod:`~looptrace.models.adapters.ouro`, :mod:`~looptrace.models.adapters.nanbeige`); :func:`patches` collects them. The ones both families use are here:
:func:`tied_weights_mapping` (5.x wants ``_tied_weights_keys`` as a mapping target → source: ``'list' object has no
attribute 'keys'`` → the mapping to the kind's ``tied_source``) and :func:`output_past_key_values` (5.0–5.24 rename
``past_key_values=`` to ``cache=`` in every ``ModelOutput.__init__`` → an output class that declares
``past_key_values`` maps it back).

Loading (:func:`load_remote_model`) turns every failure into one line (:class:`CheckpointLoadError`) when
its cause is known — a missing or malformed file, an unsupported transformers, a kind that does not match the
code, or an interface mismatch raised inside the remote code or transformers' loading code (a revision of the
code the shim does not cover); anything else (a bug) propagates with its traceback.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import json
import os
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from looptrace.config import CheckpointLoadError  # noqa: F401  (re-exported: the loaders' error)
from looptrace.models.adapters.kinds import KINDS, adapter_kinds

#: transformers versions the shim supports: [low, high) as (major, minor).
SUPPORTED_TRANSFORMERS = ((4, 55), (6, 0))
SUPPORTED_TEXT = "transformers>=4.55,<6 (looptrace pins >=5.24)"
DISABLE_ENV = "LOOPTRACE_COMPAT_DISABLE"
_MARK = "_looptrace_compat"


# ---------------------------------------------------------------------------------------------
# Versions, families
# ---------------------------------------------------------------------------------------------

def transformers_version() -> tuple[int, int]:
    # lazy: transformers: a multi-second import, only once a checkpoint is loaded
    import transformers

    major, minor = transformers.__version__.split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


def check_transformers(path: Path | str, kind: str) -> None:
    """Refuse a transformers outside :data:`SUPPORTED_TRANSFORMERS` (one line, names the range)."""
    # lazy: transformers: a multi-second import, only once a checkpoint is loaded
    import transformers

    lo, hi = SUPPORTED_TRANSFORMERS
    if not lo <= transformers_version() < hi:
        raise CheckpointLoadError(
            f"dump.adapter.path '{path}': the {kind} remote code runs through looptrace's compatibility shim under "
            f"{SUPPORTED_TEXT}; transformers {transformers.__version__} is installed — install "
            "'transformers>=5.24,<6'")


def read_auto_map(path: Path | str) -> dict[str, str]:
    """``config.json``'s ``auto_map`` (``{}`` when absent); refs are ``module.Class`` (any ``repo--`` prefix cut)."""
    p = Path(path) / "config.json"
    try:
        raw = json.loads(p.read_text())
    except (OSError, ValueError) as exc:
        msg = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointLoadError(f"dump.adapter.path '{path}': cannot read config.json ({msg}); it must be the "
                                  "JSON a save_pretrained directory holds") from None
    am = raw.get("auto_map") if isinstance(raw, dict) else None
    return {k: str(v).split("--", 1)[-1] for k, v in am.items()} if isinstance(am, dict) else {}


def family_classes() -> dict[str, str]:
    """The remote model class of each family (``auto_map["AutoModelForCausalLM"]``, module.Class): the adapter kinds
    whose class has a ``remote_class`` (:data:`looptrace.models.adapters.kinds.KINDS`)."""
    return {k: e.remote_class for k, e in adapter_kinds().items() if e.remote_class}


def family_of(auto_map: dict[str, str]) -> str | None:
    """The kind (``huginn`` | ``ouro`` | ``nanbeige``...) whose remote class ``auto_map`` names (one of
    :func:`family_classes`), else None."""
    ref = auto_map.get("AutoModelForCausalLM", "")
    return next((f for f, cls in family_classes().items() if ref == cls), None)


# ---------------------------------------------------------------------------------------------
# Patch bookkeeping
# ---------------------------------------------------------------------------------------------

@dataclass
class RemoteCode:
    """The remote classes of one checkpoint directory (what the patches work on)."""

    family: str
    config_cls: type[Any]  # the checkpoint's own classes: the patches set attributes mypy cannot know
    model_cls: type[Any]

    @property
    def module(self):
        return inspect.getmodule(self.model_cls)


@dataclass(frozen=True)
class Patch:
    """One compatibility patch: ``apply`` returns True when it changed something (False: not needed here)."""

    name: str
    target: Callable[[RemoteCode], Any]  # the object the patch changes (its record lives there)
    apply: Callable[[RemoteCode], bool]


def disabled() -> set[str]:
    return {s.strip() for s in os.environ.get(DISABLE_ENV, "").split(",") if s.strip()}


def _record(obj: Any) -> dict[str, bool]:
    """The patch record of ``obj`` (its own ``__dict__``: a subclass does not inherit it)."""
    d = obj.__dict__.get(_MARK)
    if d is None:
        d = {}
        if isinstance(obj, type):
            type.__setattr__(obj, _MARK, d)
        else:
            setattr(obj, _MARK, d)
    return d


def apply_patches(rc: RemoteCode) -> list[str]:
    """Apply every patch of ``rc.family`` that the installed transformers needs (once per object); returns the
    names of the patches in force on these classes."""
    off = disabled()
    for p in KINDS[rc.family].patches:
        if p.name in off:
            continue
        target = p.target(rc)
        if target is None:
            continue
        rec = _record(target)
        if p.name not in rec:
            rec[p.name] = bool(p.apply(rc))
    return active_patches(rc)


def active_patches(rc: RemoteCode) -> list[str]:
    """Names of the patches in force on ``rc`` (provenance)."""
    out = []
    for p in KINDS[rc.family].patches:
        target = p.target(rc)
        if target is not None and target.__dict__.get(_MARK, {}).get(p.name):
            out.append(p.name)
    return out


# ---------------------------------------------------------------------------------------------
# Feature detection of the installed transformers
# ---------------------------------------------------------------------------------------------

def _tf_wants_tied_mapping() -> bool:
    # lazy: transformers: a multi-second import, only once a checkpoint is loaded
    from transformers import PreTrainedModel

    return hasattr(PreTrainedModel, "get_expanded_tied_weights_keys")


@functools.cache
def _tf_renames_output_cache() -> bool:
    """Whether ``OutputClass(past_key_values=...)`` fails on an output that declares ``past_key_values``.

    transformers 5.0-5.24 rename the keyword to ``cache=`` in every ``ModelOutput``; 5.25 leaves classes that
    still declare the old field alone. Probed on a throw-away class rather than read off the version number.
    """

    # lazy: transformers: a multi-second import, only once a checkpoint is loaded
    from transformers.utils import ModelOutput

    @dataclasses.dataclass
    class _Probe(ModelOutput):
        past_key_values: object = None

    try:
        _Probe(past_key_values=0)
    except TypeError:
        return True
    return False


def tf_rope_has_default() -> bool:
    # lazy: transformers: a multi-second import, only once a checkpoint is loaded
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    return "default" in ROPE_INIT_FUNCTIONS


def tf_generate_passes_cache() -> bool:
    # lazy: transformers: a multi-second import, only once a checkpoint is loaded
    from transformers.generation.utils import GenerationMixin

    return "cache" in inspect.signature(GenerationMixin.prepare_inputs_for_generation).parameters


def tf_mask_sizes_take_length() -> bool:
    # lazy: transformers: a multi-second import, only once a checkpoint is loaded
    from transformers.cache_utils import Cache

    params = list(inspect.signature(Cache.get_mask_sizes).parameters)
    return len(params) > 1 and params[1] == "query_length"


# ---------------------------------------------------------------------------------------------
# Patches several families use
# ---------------------------------------------------------------------------------------------

def tied_weights_mapping(rc: RemoteCode) -> bool:
    """``_tied_weights_keys`` as the mapping 5.x wants: each key -> the kind's ``tied_source``."""
    if not _tf_wants_tied_mapping():
        return False
    changed = False
    for klass in rc.model_cls.__mro__:
        keys = klass.__dict__.get("_tied_weights_keys")
        if isinstance(keys, list | tuple):
            type.__setattr__(klass, "_tied_weights_keys", {k: KINDS[rc.family].tied_source for k in keys})
            changed = True
    return changed


def output_past_key_values(rc: RemoteCode) -> bool:
    """The remote module's output classes that declare ``past_key_values`` accept 5.x's ``cache=`` for it."""
    if not _tf_renames_output_cache():
        return False
    # lazy: transformers: a multi-second import, only once a checkpoint is loaded
    from transformers.utils import ModelOutput

    mod, changed = rc.module, False
    for obj in list(vars(mod).values()):
        if not (isinstance(obj, type) and issubclass(obj, ModelOutput) and obj.__module__ == mod.__name__):
            continue
        fields = getattr(obj, "__dataclass_fields__", {})
        if "past_key_values" not in fields or "cache" in fields:
            continue
        wrapped = obj.__dict__["__init__"]
        dataclass_init = getattr(wrapped, "__wrapped__", wrapped)  # under transformers' renaming wrapper

        def __init__(self, *args, _init=dataclass_init, **kwargs):
            if "cache" in kwargs and "past_key_values" not in kwargs:
                kwargs["past_key_values"] = kwargs.pop("cache")
            _init(self, *args, **kwargs)

        functools.update_wrapper(__init__, dataclass_init)
        type.__setattr__(obj, "__init__", __init__)  # bypass the metaclass, which would wrap it again
        changed = True
    return changed


# ---------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------

def remote_code(path: Path | str, kind: str, auto_map: dict[str, str] | None = None) -> RemoteCode:
    """The checkpoint's own config and model classes (imported from the directory, local files only), patched."""
    # lazy: transformers: a multi-second import, only once a checkpoint is loaded
    from transformers.dynamic_module_utils import get_class_from_dynamic_module

    am = read_auto_map(path) if auto_map is None else auto_map
    for key in ("AutoConfig", "AutoModelForCausalLM"):
        if key not in am:
            raise CheckpointLoadError(f"dump.adapter.path '{path}': config.json's auto_map has no {key}; kind {kind} "
                                      f"needs the checkpoint's own code ({family_classes()[kind]})")
    rc = RemoteCode(kind, get_class_from_dynamic_module(am["AutoConfig"], str(path), local_files_only=True),
                    get_class_from_dynamic_module(am["AutoModelForCausalLM"], str(path), local_files_only=True))
    apply_patches(rc)
    return rc


def load_remote_model(path: Path | str, kind: str, dtype: torch.dtype | str, attn_implementation: str | None = None,
                      config_overrides: dict[str, Any] | None = None):
    """(model in eval mode, patches in force) of a remote-code checkpoint (Huginn, Ouro, Nanbeige) carrying its code.

    ``config_overrides`` are set on the config before the model is built (Ouro's ``total_ut_steps``, which
    ``OuroModel`` copies at construction).

    Raises:
        CheckpointLoadError: one line (see the module docstring); unexpected errors propagate unchanged.
    """
    check_transformers(path, kind)
    am = read_auto_map(path)
    fam = family_of(am)
    if fam is not None and fam != kind:
        raise CheckpointLoadError(f"dump.adapter.path '{path}': kind is {kind} but config.json's auto_map names "
                                  f"{family_classes()[fam]} ({fam}); set dump.adapter.kind: {fam}")
    with quiet_transformers():
        return _load(path, kind, am, dtype, attn_implementation, config_overrides)


def _load(path, kind, am, dtype, attn_implementation, config_overrides):
    try:
        rc = remote_code(path, kind, am)
        config = rc.config_cls.from_pretrained(str(path), local_files_only=True)
        for k, v in (config_overrides or {}).items():
            setattr(config, k, v)
        kw: dict[str, Any] = {"config": config, "local_files_only": True}
        kw["dtype" if transformers_version()[0] >= 5 else "torch_dtype"] = dtype
        if attn_implementation:
            kw["attn_implementation"] = attn_implementation
        model = rc.model_cls.from_pretrained(str(path), **kw)
    except CheckpointLoadError:
        raise
    except Exception as exc:
        if not is_incompatibility(exc):
            raise
        raise CheckpointLoadError(describe_failure(path, kind, exc)) from exc
    return model.eval(), active_patches(rc)


#: Exception types that, raised outside looptrace's own code while loading, mean "this code / these files do
#: not fit the installed transformers or the expected layout" (not a looptrace bug).
INCOMPATIBLE = (OSError, ImportError, AttributeError, TypeError, KeyError, ValueError, NameError,
                NotImplementedError, IndexError)
_OWN_DIR = str(Path(__file__).resolve().parents[2])  # pipeline/looptrace/ (the installed looptrace)


def _frames(exc: BaseException) -> list[traceback.FrameSummary]:
    return traceback.extract_tb(exc.__traceback__)


def is_incompatibility(exc: BaseException, remote_only: bool = False) -> bool:
    """Whether ``exc`` has a known cause: an :data:`INCOMPATIBLE` type raised outside looptrace's own modules —
    while loading: in the remote code, transformers, safetensors, json...; with ``remote_only`` (while running):
    in the remote code or transformers only."""
    if not isinstance(exc, INCOMPATIBLE):
        return False
    frames = _frames(exc)
    if not frames:
        return not remote_only
    last = str(Path(frames[-1].filename).resolve())
    if remote_only:
        return "transformers_modules" in last or f"{os.sep}transformers{os.sep}" in last
    return not last.startswith(_OWN_DIR)


def _short(filename: str) -> str:
    """``modeling_ouro.py`` for remote code, ``transformers/modeling_utils.py`` for a package file."""
    p = Path(filename)
    if "transformers_modules" in filename:
        return p.name
    parts = p.parts
    for top in ("transformers", "safetensors", "torch", "huggingface_hub"):
        if top in parts:
            return "/".join(parts[len(parts) - 1 - parts[::-1].index(top):])
    return p.name


@contextlib.contextmanager
def quiet_transformers():
    """Hide the deprecation notices transformers 5 prints for the 4.x-era remote code (``check_model_inputs``,
    ``rope_scaling``, ``past_key_values``... — known and harmless; docs/adapters.md): its logger at ERROR and its
    FutureWarning / DeprecationWarning ignored while the model loads and runs."""
    # lazy: transformers: a multi-second import, only once a checkpoint is loaded
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            for cat in (FutureWarning, DeprecationWarning):
                warnings.filterwarnings("ignore", category=cat, module=r"transformers(_modules)?(\.|$)")
            yield
    finally:
        hf_logging.set_verbosity(level)


def describe_failure(path: Path | str, kind: str, exc: BaseException, verb: str = "load") -> str:
    """One line: the checkpoint, what failed (type, where, message) and the fix (``verb``: load | run)."""
    # lazy: transformers: a multi-second import, only once a checkpoint is loaded
    import transformers

    msg = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    frames = _frames(exc)
    remote = next((f for f in reversed(frames) if "transformers_modules" in f.filename), None)
    at = ""
    if frames:
        last = frames[-1]
        at = f" at {_short(last.filename)}:{last.lineno}"
        if remote is not None and remote is not last:
            at += f", called from {Path(remote.filename).name}:{remote.lineno}"
    what = f"{type(exc).__name__}{at}: {msg}" if msg else f"{type(exc).__name__}{at}"
    if isinstance(exc, OSError) and not isinstance(exc, ImportError):
        fix = "it must be a save_pretrained directory with config.json, its weights and the model's .py files"
    elif kind not in family_classes():
        fix = "the checkpoint's own code does not run under the installed transformers; use a revision of it that does"
    else:
        fix = (f"the shim (looptrace.models.adapters.compat) covers the published {kind} code "
               f"({family_classes()[kind].split('.')[0]}.py, docs/adapters.md 'Remote code'); compare the directory's "
               f"code with it, or set {DISABLE_ENV} to narrow down which patch no longer fits")
    return (f"dump.adapter.path '{path}': cannot {verb} the {kind} checkpoint under transformers "
            f"{transformers.__version__} ({what}); {fix}")


__all__ = ["DISABLE_ENV", "SUPPORTED_TRANSFORMERS", "CheckpointLoadError", "Patch", "RemoteCode", "active_patches",
           "apply_patches", "check_transformers", "describe_failure", "family_classes", "family_of", "is_incompatibility",
           "load_remote_model", "output_past_key_values", "quiet_transformers", "read_auto_map", "remote_code",
           "tf_generate_passes_cache", "tf_mask_sizes_take_length", "tf_rope_has_default", "tied_weights_mapping",
           "transformers_version"]
