"""The adapter kinds (``dump.adapter.kind``): one line each, kind -> the class in its own module.

A kind is one module of this package holding its adapter (a subclass of
:class:`~looptrace.models.adapters.base.HFAdapter`, whose class attributes say what the kind needs: a block, remote
code, its decoder, its compatibility patches) and, when it decodes loop by loop, its decoder. Installed packages add
kinds through the ``looptrace.adapters`` entry-point group (``mykind = "mypkg.adapter:MyAdapter"``).

Every list of kinds derives from :data:`KINDS`: the config check (:class:`~looptrace.models.adapters.loading.
AdapterConfig`), the loader, the decoders (:func:`~looptrace.models.adapters.decoding.hf_decoder`), the remote-code
shim's families (:mod:`~looptrace.models.adapters.compat`) and the CLI's help. Listing kinds imports none of them
(torch-free); looking one up imports its module. The references are string literals, which the static dependency
scan reads (:mod:`looptrace.registry`): every module here is a dep of each stage that can load an adapter.
"""

from __future__ import annotations

from typing import Any

from looptrace.registry import Registry

#: Entry-point group through which installed packages register adapter kinds.
ENTRY_POINT_GROUP = "looptrace.adapters"

#: What an adapter class has (:class:`~looptrace.models.adapters.base.HFAdapter` defines each).
_INTERFACE = ("states", "readout", "needs_block", "remote_class", "decoder", "config_overrides")


def _not_an_adapter(obj: Any) -> str | None:
    if isinstance(obj, type) and all(hasattr(obj, a) for a in _INTERFACE):
        return None
    return ("is not an adapter class: subclass looptrace.models.adapters.base.HFAdapter (docs/adapters.md, "
            "'A new adapter')")


#: kind -> ``module:class``, in the order the help and errors list them.
KINDS: Registry[Any] = Registry("adapter kind", {
    "dory": "looptrace.models.adapters.dory:DoryAdapter",
    "retrofit": "looptrace.models.adapters.retrofit:RetrofitAdapter",
    "inkling2loop": "looptrace.models.adapters.inkling2loop:Inkling2LoopAdapter",
    "ouro": "looptrace.models.adapters.ouro:OuroAdapter",
    "huginn": "looptrace.models.adapters.huginn:HuginnAdapter",
    "nanbeige": "looptrace.models.adapters.nanbeige:NanbeigeAdapter",
}, group=ENTRY_POINT_GROUP, check=_not_an_adapter)


def adapter_kinds() -> dict[str, Any]:
    """Every kind, installed ones included, resolved (each module imported): kind -> adapter class."""
    return {k: KINDS[k] for k in KINDS.names()}


__all__ = ["ENTRY_POINT_GROUP", "KINDS", "adapter_kinds"]
