"""Running the published Huginn and Ouro remote code under the installed transformers (a compatibility shim).

Both models ship their modeling code inside the checkpoint directory (``trust_remote_code``), written for
transformers 4.4x–4.57: Huginn's ``raven_modeling_minimal.py`` / ``raven_config_minimal.py``
(seal-rg/recurrent-pretraining) and Ouro's ``modeling_ouro.py`` / ``configuration_ouro.py`` (as published with
the ByteDance checkpoints). transformers 5 changed several interfaces that code relies on, so neither loads
unmodified under the version looptrace pins. This module makes it run **without touching the checkpoint**:

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

The patches (:data:`PATCHES`; what changed in transformers 5 → what the patch does):

========================================  =====================================================================
``huginn.config_tie_word_embeddings``      ``RavenConfig.__init__`` passes ``tie_word_embeddings=`` itself *and*
                                           forwards ``**kwargs``; a config.json that carries the key (5.x writes
                                           it) gives "got multiple values for keyword argument". → drop the
                                           duplicate (it becomes ``tie_embeddings`` when that is unset). Latent
                                           in every version, so it is the one patch 4.x gets too.
``huginn.tied_weights_mapping``            5.x wants ``_tied_weights_keys`` as a mapping target → source
                                           (``'list' object has no attribute 'keys'``). → the mapping
                                           ``{"lm_head.weight": "transformer.wte.weight"}``.
``huginn.output_past_key_values``          5.x renames ``past_key_values=`` to ``cache=`` in every
                                           ``ModelOutput.__init__``; Huginn's own output dataclass declares
                                           ``past_key_values`` ("unexpected keyword argument 'cache'"). → its
                                           ``__init__`` maps ``cache`` back to the declared field.
``huginn.generation_cache_position``       5.x removed ``GenerationMixin._get_initial_cache_position`` and no
                                           longer advances ``model_kwargs["cache_position"]``, which Huginn's
                                           own decoding loops (``generate_minimal``, ``generate_with_adaptive_
                                           compute``, ...) slice inputs with. → both, 4.x behaviour, for those
                                           loops only (transformers' own ``generate`` keeps its contract).
``huginn.generate_route``                  5.x ``generate`` passes the cache as ``cache=`` and no
                                           ``cache_position``: Huginn drops the cache and re-runs every step
                                           from a fresh random state — silently different tokens. → the plain
                                           (greedy / sampling) ``generate`` runs Huginn's own ``generate_minimal``.
``ouro.config_pad_token_id``               5.x ``PreTrainedConfig`` no longer defines ``pad_token_id``;
                                           ``OuroModel.__init__`` reads it. → class default ``None`` (4.x value).
``ouro.rope_default``                      5.x ``ROPE_INIT_FUNCTIONS`` has no ``'default'`` (``KeyError:
                                           'default'``). → the remote module gets its own table with the
                                           default rotary frequencies 1/θ^(2i/d) (scale 1).
``ouro.rope_init_weights``                 5.x ``_init_weights`` re-initialises rotary buffers through
                                           ``module.compute_default_rope_parameters``. → that staticmethod.
``ouro.mask_kwargs``                       5.x ``create_causal_mask(config, inputs_embeds, attention_mask, cache,
                                           position_ids, ...)``: ``input_embeds`` → ``inputs_embeds``,
                                           ``past_key_values`` → ``cache``, no ``cache_position``. → a
                                           module-local wrapper that renames / drops them.
``ouro.tied_weights_mapping``              as Huginn's (only reached with ``tie_word_embeddings: true``).
``ouro.cache_kwarg``                       5.x ``generate`` passes the cache as ``cache=``; Ouro's forwards
                                           take ``past_key_values`` and swallow ``cache`` in ``**kwargs`` (every
                                           step a fresh cache: silently different tokens). → map it.
``ouro.cache_mask_sizes``                  5.x masks call ``cache.get_mask_sizes(query_length: int)``; Ouro's
                                           ``UniversalTransformerCache`` expects a ``cache_position`` tensor (or
                                           inherits one reading its unused ``layers``). → kv length = cached +
                                           query length, offset 0.
========================================  =====================================================================

Loading (:func:`load_remote_model`) turns every failure into one line (:class:`CheckpointLoadError`) when
its cause is known — a missing or malformed file, an unsupported transformers, a kind that does not match the
code, or an interface mismatch raised inside the remote code or transformers' loading code (a revision of the
code the shim does not cover); anything else (a bug) propagates with its traceback.
"""

from __future__ import annotations

import contextlib
import copy
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
from looptrace.models.adapters.registry import adapter_kinds

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
    registered with a ``remote_class`` (:mod:`looptrace.models.adapters.registry`)."""
    return {k: e.remote_class for k, e in adapter_kinds().items() if e.remote_class}


def family_of(auto_map: dict[str, str]) -> str | None:
    """``huginn`` | ``ouro`` when ``auto_map`` names one of :func:`family_classes`, else None."""
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
    family: str
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
    for p in PATCHES:
        if p.family != rc.family or p.name in off:
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
    for p in PATCHES:
        if p.family != rc.family:
            continue
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


def _tf_rope_has_default() -> bool:
    # lazy: transformers: a multi-second import, only once a checkpoint is loaded
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    return "default" in ROPE_INIT_FUNCTIONS


def _tf_generate_passes_cache() -> bool:
    # lazy: transformers: a multi-second import, only once a checkpoint is loaded
    from transformers.generation.utils import GenerationMixin

    return "cache" in inspect.signature(GenerationMixin.prepare_inputs_for_generation).parameters


def _tf_mask_sizes_take_length() -> bool:
    # lazy: transformers: a multi-second import, only once a checkpoint is loaded
    from transformers.cache_utils import Cache

    params = list(inspect.signature(Cache.get_mask_sizes).parameters)
    return len(params) > 1 and params[1] == "query_length"


# ---------------------------------------------------------------------------------------------
# Patches shared by both families
# ---------------------------------------------------------------------------------------------

def _tied_weights_mapping(rc: RemoteCode) -> bool:
    if not _tf_wants_tied_mapping():
        return False
    changed = False
    for klass in rc.model_cls.__mro__:
        keys = klass.__dict__.get("_tied_weights_keys")
        if isinstance(keys, list | tuple):
            type.__setattr__(klass, "_tied_weights_keys", {k: adapter_kinds()[rc.family].tied_source for k in keys})
            changed = True
    return changed


def _output_past_key_values(rc: RemoteCode) -> bool:
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
# Huginn
# ---------------------------------------------------------------------------------------------

def _huginn_config_tie(rc: RemoteCode) -> bool:
    cls = rc.config_cls
    params = inspect.signature(cls.__init__).parameters
    if "tie_embeddings" not in params or "tie_word_embeddings" in params or \
            not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return False
    init = cls.__init__

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        if "tie_word_embeddings" in kwargs:
            tied = kwargs.pop("tie_word_embeddings")
            kwargs.setdefault("tie_embeddings", tied)
        init(self, *args, **kwargs)

    cls.__init__ = __init__
    return True


def _huginn_generation_cache_position(rc: RemoteCode) -> bool:
    # lazy: transformers: a multi-second import, only once a checkpoint is loaded
    from transformers.generation.utils import GenerationMixin

    cls = rc.model_cls
    loops = [m for m in ("generate_minimal", "generate_with_adaptive_compute", "generate_speculative",
                         "generate_diffusion_style") if m in cls.__dict__]
    if hasattr(GenerationMixin, "_get_initial_cache_position") or not loops:
        return False
    cls._get_initial_cache_position = _initial_cache_position
    for m in loops:
        setattr(cls, m, _with_cache_position_updates(cls.__dict__[m]))
    return True


def _initial_cache_position(self, seq_length, device, model_kwargs):
    """4.x ``GenerationMixin._get_initial_cache_position`` (decoder-only): positions of the not-yet-cached inputs."""
    if model_kwargs.get("cache_position") is not None:
        return model_kwargs
    embeds = model_kwargs.get("inputs_embeds")
    n = embeds.shape[1] if embeds is not None else seq_length
    pos = torch.arange(n, dtype=torch.int64, device=embeds.device if embeds is not None else device)
    cache = model_kwargs.get("past_key_values")
    if cache is not None:
        pos = pos[cache.get_seq_length():]
    model_kwargs["cache_position"] = pos
    return model_kwargs


def _update_kwargs_4x(self, outputs, model_kwargs, is_encoder_decoder=False, num_new_tokens=1):
    """4.x ``_update_model_kwargs_for_generation`` (decoder-only): carry the cache, grow the attention mask,
    advance ``cache_position`` — the contract Huginn's own loops were written against."""
    for name in ("past_key_values", "cache"):
        if name in outputs:
            model_kwargs["past_key_values"] = getattr(outputs, name)
            break
    mask = model_kwargs.get("attention_mask")
    if mask is not None:
        model_kwargs["attention_mask"] = torch.cat([mask, mask.new_ones((mask.shape[0], 1))], dim=-1)
    pos = model_kwargs["cache_position"]
    if model_kwargs.get("use_cache", True):
        model_kwargs["cache_position"] = pos[-1:] + num_new_tokens
    else:
        new = torch.arange(int(pos[-1]) + 1, int(pos[-1]) + num_new_tokens + 1, dtype=pos.dtype, device=pos.device)
        model_kwargs["cache_position"] = torch.cat([pos, new])
    return model_kwargs


def _with_cache_position_updates(loop):
    @functools.wraps(loop)
    def run(self, *args, **kwargs):
        own = self.__dict__.get("_update_model_kwargs_for_generation")
        self.__dict__["_update_model_kwargs_for_generation"] = _update_kwargs_4x.__get__(self)
        try:
            return loop(self, *args, **kwargs)
        finally:
            if own is None:
                self.__dict__.pop("_update_model_kwargs_for_generation", None)
            else:
                self.__dict__["_update_model_kwargs_for_generation"] = own

    return run


#: ``generate`` keyword arguments that Huginn's own dispatcher sends to its own loops.
_HUGINN_OWN_GENERATE = ("criterion", "exit_threshold", "exit_evaluator", "draft_steps", "lookahead_for_draft",
                        "verification_threshold", "headway", "state_noise_mixing", "inner_recurrence",
                        "freeze_strategy", "continuous_compute")


def _huginn_generate_route(rc: RemoteCode) -> bool:
    cls = rc.model_cls
    if "generate" not in cls.__dict__ or "generate_minimal" not in cls.__dict__ or not _tf_generate_passes_cache():
        return False
    own = cls.__dict__["generate"]

    @functools.wraps(own)
    def generate(self, *args, **kwargs):
        if any(k in kwargs for k in _HUGINN_OWN_GENERATE):
            return own(self, *args, **kwargs)

        input_ids = args[0] if args else kwargs.pop("input_ids")
        gc = args[1] if len(args) > 1 else kwargs.pop("generation_config", None)
        gc = copy.deepcopy(gc if gc is not None else self.generation_config)
        if int(kwargs.get("num_beams", getattr(gc, "num_beams", 1)) or 1) > 1:
            raise NotImplementedError("huginn under transformers 5: beam search is not supported (looptrace's "
                                      "compatibility shim routes generate to Huginn's own generate_minimal)")
        lengths = {k: kwargs.pop(k) for k in ("max_new_tokens", "max_length") if k in kwargs}
        model_kwargs = gc.update(**kwargs)  # generation options into the config, the rest are model kwargs
        return self.generate_minimal(input_ids, gc, **lengths, **model_kwargs)

    cls.generate = generate
    return True


# ---------------------------------------------------------------------------------------------
# Ouro
# ---------------------------------------------------------------------------------------------

def _ouro_pad_token_id(rc: RemoteCode) -> bool:
    cls = rc.config_cls
    try:
        probe = cls()
    except Exception:  # noqa: BLE001 - a config that cannot default-construct: nothing to detect
        return False
    if hasattr(probe, "pad_token_id"):
        return False
    type.__setattr__(cls, "pad_token_id", None)
    return True


def _default_rope_parameters(config, device=None, seq_len=None, **_):
    """Default rotary frequencies (the 4.x ``'default'`` rope type): inv_freq_i = 1 / θ^(2i/d), scaling 1."""
    theta = getattr(config, "rope_theta", None)
    if theta is None:
        theta = (getattr(config, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    dim = int(head_dim * getattr(config, "partial_rotary_factor", 1.0))
    exponent = torch.arange(0, dim, 2, dtype=torch.int64).to(device=device, dtype=torch.float) / dim
    return 1.0 / (theta ** exponent), 1.0


def _ouro_rope_default(rc: RemoteCode) -> bool:
    mod = rc.module
    table = getattr(mod, "ROPE_INIT_FUNCTIONS", None)
    if table is None or "default" in table:
        return False
    mod.ROPE_INIT_FUNCTIONS = {**table, "default": _default_rope_parameters}
    return True


def _rotary_classes(mod) -> list[type[Any]]:
    return [v for k, v in vars(mod).items() if isinstance(v, type) and k.endswith("RotaryEmbedding")
            and v.__module__ == mod.__name__]


def _ouro_rope_init_weights(rc: RemoteCode) -> bool:
    if _tf_rope_has_default():
        return False
    changed = False
    for cls in _rotary_classes(rc.module):
        if not hasattr(cls, "compute_default_rope_parameters"):
            cls.compute_default_rope_parameters = staticmethod(_default_rope_parameters)
            changed = True
    return changed


def _mask_kwargs_wrapper(fn):
    params = inspect.signature(fn).parameters

    @functools.wraps(fn)
    def create_mask(*args, **kw):
        if "input_embeds" in kw:
            kw["inputs_embeds"] = kw.pop("input_embeds")
        if "past_key_values" in kw and "cache" in params:
            kw["cache"] = kw.pop("past_key_values")
        if "cache_position" in kw and "cache_position" not in params:
            del kw["cache_position"]
        return fn(*args, **kw)

    return create_mask


def _ouro_mask_kwargs(rc: RemoteCode) -> bool:
    mod, changed = rc.module, False
    for name in ("create_causal_mask", "create_sliding_window_causal_mask"):
        fn = getattr(mod, name, None)
        if fn is not None and "input_embeds" not in inspect.signature(fn).parameters and \
                "inputs_embeds" in inspect.signature(fn).parameters:
            setattr(mod, name, _mask_kwargs_wrapper(fn))
            changed = True
    return changed


def _cache_to_past_key_values(forward):
    @functools.wraps(forward)
    def run(self, *args, **kwargs):
        if "cache" in kwargs:
            cache = kwargs.pop("cache")
            if kwargs.get("past_key_values") is None:
                kwargs["past_key_values"] = cache
        return forward(self, *args, **kwargs)

    return run


def _ouro_cache_kwarg(rc: RemoteCode) -> bool:
    if not _tf_generate_passes_cache():
        return False
    changed = False
    for cls in (rc.model_cls, getattr(rc.module, "OuroModel", None)):
        if cls is None or "forward" not in cls.__dict__:
            continue
        params = inspect.signature(cls.__dict__["forward"]).parameters
        if "cache" not in params and "past_key_values" in params:
            cls.forward = _cache_to_past_key_values(cls.__dict__["forward"])
            changed = True
    return changed


def _ouro_cache_mask_sizes(rc: RemoteCode) -> bool:
    cls = getattr(rc.module, "UniversalTransformerCache", None)
    if cls is None or not _tf_mask_sizes_take_length():
        return False

    def get_mask_sizes(self, query, layer_idx: int = 0):
        """(kv length, kv offset) of the mask: the cached positions of slot ``layer_idx`` plus the query's."""
        q = int(query) if isinstance(query, int) else int(query.shape[0])
        return self.get_seq_length(layer_idx) + q, 0

    cls.get_mask_sizes = get_mask_sizes
    return True


PATCHES: tuple[Patch, ...] = (
    Patch("huginn.config_tie_word_embeddings", "huginn", lambda rc: rc.config_cls, _huginn_config_tie),
    Patch("huginn.tied_weights_mapping", "huginn", lambda rc: rc.model_cls, _tied_weights_mapping),
    Patch("huginn.output_past_key_values", "huginn", lambda rc: rc.module, _output_past_key_values),
    Patch("huginn.generation_cache_position", "huginn", lambda rc: rc.model_cls, _huginn_generation_cache_position),
    Patch("huginn.generate_route", "huginn", lambda rc: rc.model_cls, _huginn_generate_route),
    Patch("ouro.config_pad_token_id", "ouro", lambda rc: rc.config_cls, _ouro_pad_token_id),
    Patch("ouro.rope_default", "ouro", lambda rc: rc.module, _ouro_rope_default),
    Patch("ouro.rope_init_weights", "ouro", lambda rc: rc.module, _ouro_rope_init_weights),
    Patch("ouro.mask_kwargs", "ouro", lambda rc: rc.module, _ouro_mask_kwargs),
    Patch("ouro.tied_weights_mapping", "ouro", lambda rc: rc.model_cls, _tied_weights_mapping),
    Patch("ouro.cache_kwarg", "ouro", lambda rc: rc.model_cls, _ouro_cache_kwarg),
    Patch("ouro.cache_mask_sizes", "ouro", lambda rc: rc.module, _ouro_cache_mask_sizes),
)


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
    """(model in eval mode, patches in force) of a Huginn / Ouro checkpoint carrying its remote code.

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


__all__ = ["DISABLE_ENV", "PATCHES", "SUPPORTED_TRANSFORMERS", "CheckpointLoadError", "Patch",
           "RemoteCode", "active_patches", "apply_patches", "check_transformers", "describe_failure", "family_classes", "family_of",
           "is_incompatibility", "load_remote_model", "quiet_transformers", "read_auto_map", "remote_code",
           "transformers_version"]
