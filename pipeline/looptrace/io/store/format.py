"""A store's metadata documents checked before zarr reads them.

zarr opens a group whose ``zarr.json`` declares another format (``"zarr_format": 2``) or node type with a warning
per member and then reports a missing array; a store is checked here first, so the error is one line naming the
document and the field.
"""

from __future__ import annotations

import json

import zarr
from zarr.core.sync import sync

from looptrace.io.store.location import _URL, _exists, _label, join_store, resolve_store
from looptrace.io.store.schema import _RERUN, StoreError

#: What every metadata document of a trajectory store declares (a Zarr v3 group of v3 arrays).
EXPECTED = {"zarr_format": 3}


def check_store_format(store: zarr.abc.store.Store, label: str) -> None:
    """Refuse a store whose root or member ``zarr.json`` declares another ``zarr_format`` or ``node_type``.

    A document that is not a JSON object is left to the caller's damaged-metadata message.

    Raises:
        StoreError: one line naming the store, the document, the field, its value and the fix.
    """
    from zarr.core.buffer import default_buffer_prototype

    async def first_wrong() -> tuple[str, str, object, object] | None:
        docs: list[tuple[str, str | None]] = [("zarr.json", "group")]
        docs += [(f"{n}/zarr.json", None) for n in sorted([n async for n in store.list_dir("")]) if n != "zarr.json"]
        for key, node_type in docs:
            buf = await store.get(key, default_buffer_prototype())
            if buf is None:
                continue
            try:
                doc = json.loads(buf.to_bytes())
            except ValueError:
                continue
            if not isinstance(doc, dict):
                continue
            for field, want in EXPECTED.items():
                if doc.get(field) != want:
                    return key, field, doc.get(field), want
            if node_type is not None and doc.get("node_type") != node_type:
                return key, "node_type", doc.get("node_type"), node_type
            if node_type is None and doc.get("node_type") not in ("array", "group"):
                return key, "node_type", doc.get("node_type"), "array"
        return None

    wrong = sync(first_wrong())
    if wrong is not None:
        key, field, got, want = wrong
        raise StoreError(f"store {label}: '{key}' field '{field}' is {json.dumps(got)}, expected {json.dumps(want)} "
                         f"(a Zarr v3 store written by `looptrace dump`); {_RERUN}")





def check_store_format_at(target) -> None:
    """:func:`check_store_format` of the store at a path or URL (a missing store is left to ``open_store``).

    Called by the readers (the stage entries, the online stages) before they open a store."""
    import os

    if not isinstance(target, str | os.PathLike) or (not _URL.match(os.fspath(target))
                                                      and not os.path.isdir(target)):
        return
    store = resolve_store(target, "r")
    if _exists(store, "zarr.json"):
        check_store_format(store, _label(target))


def check_split_formats(root, model: str, splits) -> None:
    """:func:`check_store_format_at` for ``<root>/<model>/<split>.zarr`` of each split."""
    for s in splits:
        check_store_format_at(join_store(root, model, f"{s}.zarr"))
__all__ = ["EXPECTED", "check_split_formats", "check_store_format", "check_store_format_at"]
