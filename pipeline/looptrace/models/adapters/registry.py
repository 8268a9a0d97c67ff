"""Adapter kinds (``dump.adapter.kind``), in the spirit of lm-evaluation-harness's ``@register_model``: one registry
that every list of kinds derives from — the config check (:class:`~looptrace.models.adapters.hf.AdapterConfig`), the
loader (:func:`~looptrace.models.adapters.hf.load_adapter`), the decoders
(:func:`~looptrace.models.adapters.hf_decode.hf_decoder`), the remote-code shim's families
(:mod:`~looptrace.models.adapters.compat`) and the CLI's help.

A new adapter is one module in ``looptrace/models/adapters/``: its adapter class decorated with
:func:`register_adapter` (kind, remote-code needs) and, when it can decode loop by loop, its decoder class decorated
with :func:`register_decoder`. :func:`adapter_kinds` imports every module of the package first, so the new module needs
no line anywhere else (docs/adapters.md, "A new adapter"). Torch-free itself; the adapter modules are not.
"""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class AdapterKind:
    """One registered kind.

    Attributes:
        kind: the ``dump.adapter.kind`` value.
        adapter: its adapter class, built as ``adapter(model, spec, device)``.
        remote_class: ``module.Class`` of the checkpoint's own modeling code (``auto_map["AutoModelForCausalLM"]``)
            when the kind runs remote code (``trust_remote_code``, loaded through the compatibility shim); None for
            a transformers-native architecture.
        tied_source: remote code only: the input embedding an untied-in-4.x ``lm_head.weight`` is tied to (compat).
        needs_block: the kind loops a block of a standard decoder (``dump.adapter.block`` and ``n_loops`` required).
        decoder: its loop-by-loop decoder class (``decoder(adapter, policy, **options)``), None when it has none.
        no_decoder: why it has no decoder (one line, said when generation asks for one).
    """

    kind: str
    adapter: type[Any]
    remote_class: str | None = None
    tied_source: str | None = None
    needs_block: bool = False
    decoder: type | None = None
    no_decoder: str | None = None

    @property
    def remote(self) -> bool:
        """Whether the kind runs the checkpoint's own code (``trust_remote_code`` required)."""
        return self.remote_class is not None


_KINDS: dict[str, AdapterKind] = {}


def register_adapter(kind: str, *, remote_class: str | None = None, tied_source: str | None = None,
                     needs_block: bool = False, no_decoder: str | None = None) -> Callable[[type], type]:
    """Class decorator: register an adapter class as ``kind`` (and set its ``kind`` attribute).

    Raises:
        ValueError: ``kind`` is registered by another class.
    """
    def deco(cls: type[Any]) -> type:
        old = _KINDS.get(kind)
        if old is not None and old.adapter.__qualname__ != cls.__qualname__:
            raise ValueError(f"adapter kind {kind!r} is registered twice ({old.adapter.__qualname__}, {cls.__qualname__})")
        cls.kind = kind
        _KINDS[kind] = AdapterKind(kind, cls, remote_class, tied_source, needs_block,
                                   old.decoder if old is not None else None, no_decoder)
        return cls

    return deco


def register_decoder(kind: str) -> Callable[[type], type]:
    """Class decorator: register the loop-by-loop decoder of the (already registered) adapter ``kind``.

    Raises:
        ValueError: ``kind`` has no registered adapter.
    """
    def deco(cls: type) -> type:
        if kind not in _KINDS:
            raise ValueError(f"decoder {cls.__qualname__} for unregistered adapter kind {kind!r}; register the "
                             "adapter first (its module imports the adapter's)")
        _KINDS[kind] = dataclasses.replace(_KINDS[kind], decoder=cls)
        return cls

    return deco


def adapter_kinds() -> dict[str, AdapterKind]:
    """Every registered kind, in registration order, after importing each module of ``looptrace.models.adapters``
    (torch included): a module there that registers a kind is all a new adapter needs."""
    package = importlib.import_module(__name__.rsplit(".", 1)[0])
    for m in pkgutil.iter_modules(package.__path__):
        importlib.import_module(f"{package.__name__}.{m.name}")
    return dict(_KINDS)


def adapter_kind(kind: str) -> AdapterKind:
    """The registered ``kind``.

    Raises:
        KeyError: no adapter registers it.
    """
    return adapter_kinds()[kind]
