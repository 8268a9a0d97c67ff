"""Where a store is: paths, ``file://`` and fsspec URLs, in-memory stores (:func:`resolve_store` is the one place
that turns them into a zarr store), and whole-store existence, refusal and removal."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
from pathlib import Path

import zarr
import zarr.abc.store
from zarr.core.sync import sync

from looptrace.io.store.schema import StoreError

StoreTarget = str | os.PathLike | zarr.storage.MemoryStore


def memory_store() -> zarr.storage.MemoryStore:
    """A fresh in-memory store (for tests and throw-away captures); pass it wherever a path is accepted."""
    return zarr.storage.MemoryStore()


_URL = re.compile(r"^(?P<proto>[A-Za-z][A-Za-z0-9+.-]+)://")

_COLLAPSED = re.compile(r"^(?P<proto>[A-Za-z][A-Za-z0-9+.-]+):/(?P<rest>[^/].*)$")


def _remote_protocols() -> frozenset[str]:
    import fsspec

    return frozenset(fsspec.available_protocols()) - {"file", "local"}


def store_location(target: StoreTarget) -> str | None:
    """The path or URL string of a target (None for a :func:`memory_store`).

    ``file://`` URLs become plain paths. A URL collapsed by ``pathlib`` (``Path("s3://b/k")`` is ``s3:/b/k``) is
    restored when its scheme is a known fsspec protocol, so stages may join URL roots with ``/``.
    """
    if isinstance(target, zarr.storage.MemoryStore):
        return None
    s = os.fspath(target)
    if s.startswith("file://"):
        return s.removeprefix("file://")
    if _URL.match(s):
        return s
    m = _COLLAPSED.match(s)
    if m and m["proto"].lower() in _remote_protocols():
        return f"{m['proto']}://{m['rest']}"
    return s


def is_remote(target: StoreTarget) -> bool:
    """Whether a target is an fsspec URL (not a local path or an in-process store)."""
    loc = store_location(target)
    return loc is not None and bool(_URL.match(loc))


def join_store(root: StoreTarget, *parts: str) -> str | Path:
    """``root / part / ...`` for a local root (a Path) or a URL root (a string)."""
    loc = store_location(root)
    if loc is None:
        raise StoreError("join_store: an in-memory store has no sub-paths")
    if _URL.match(loc):
        return "/".join([loc.rstrip("/"), *(p.strip("/") for p in parts)])
    return Path(loc).joinpath(*parts)


def resolve_store(target: StoreTarget, mode: str = "r") -> zarr.abc.store.Store:
    """The zarr store of a target: the one function that turns paths and URLs into stores.

    Args:
        target: a local path, a ``file://`` URL (both: ``zarr.storage.LocalStore``, whose writes are atomic,
            temp file + rename), any other fsspec URL (``zarr.storage.FsspecStore`` without a listings cache,
            so a long-lived process sees other writers' keys), or a :func:`memory_store` (returned as is).
        mode: ``"r"`` opens read-only; anything else writable.

    Credentials and endpoints come from the filesystem library's own environment/config, never from here.
    """
    if isinstance(target, zarr.storage.MemoryStore):
        return target
    loc = store_location(target)
    assert loc is not None  # only a MemoryStore has no location
    read_only = mode == "r"
    if not _URL.match(loc):
        return zarr.storage.LocalStore(loc, read_only=read_only)
    opts = {} if loc.startswith("memory://") else {"use_listings_cache": False}
    try:
        return zarr.storage.FsspecStore.from_url(loc, read_only=read_only, storage_options=opts)
    except ImportError as exc:
        raise StoreError(f"store {loc}: {str(exc).splitlines()[0]} (s3:// needs `pip install 'looptrace[remote]'`)") \
            from None
    except ValueError as exc:
        raise StoreError(f"store {loc}: not a usable URL ({str(exc).splitlines()[0]})") from None


def _sync_fs(loc: str):
    """A synchronous fsspec filesystem + path for deleting/listing a URL target (zarr's own is async)."""
    import fsspec

    opts = {} if loc.startswith("memory://") else {"use_listings_cache": False, "skip_instance_cache": True}
    return fsspec.url_to_fs(loc, **opts)


def _exists(store: zarr.abc.store.Store, key: str) -> bool:
    return bool(sync(store.exists(key)))


def _any_key(store: zarr.abc.store.Store) -> bool:
    async def first() -> bool:
        async for _ in store.list():
            return True
        return False

    return bool(sync(first()))


def store_exists(target: StoreTarget) -> bool:
    """Whether a Zarr group (``zarr.json``) is at ``target``."""
    try:
        return _exists(resolve_store(target, "r"), "zarr.json")
    except (FileNotFoundError, StoreError):
        return False


def _label(target: StoreTarget) -> str:
    return "<memory>" if isinstance(target, zarr.storage.MemoryStore) else str(store_location(target))


def remove_debris(target: StoreTarget) -> int:
    """Delete temp files that killed atomic writes left inside a local store (``*.partial``); returns how many.

    Only call this while no other process writes the store (the claims protocol's planner or finaliser).
    Object stores have none: a PUT is whole or absent.
    """
    loc = store_location(target)
    if loc is None or _URL.match(loc) or not Path(loc).is_dir():
        return 0
    n = 0
    for f in Path(loc).rglob("*.partial"):
        with contextlib.suppress(FileNotFoundError):
            f.unlink()
            n += 1
    return n


def _foreign(target: StoreTarget) -> bool:
    """Whether ``target`` holds something other than a Zarr store (files or keys, but no ``zarr.json``).

    The keys are listed *before* ``zarr.json`` is looked up. A peer creating the store at the same moment (the
    shard processes of one dump) writes the group's ``zarr.json`` before anything else, so in this order a
    store being created reads as absent or as a store, never as foreign; looked up the other way round, keys
    that appear between the two reads would. Temp files of atomic local writes (``*.partial``: a ``zarr.json``
    being renamed into place) are not keys.
    """
    loc = store_location(target)
    assert loc is not None  # only a MemoryStore has no location
    if _URL.match(loc):
        store = resolve_store(target, "r")
        return _any_key(store) and not _exists(store, "zarr.json")
    p = Path(loc)
    if not p.exists():
        return False
    if not p.is_dir():
        return True
    return any(not e.name.endswith(".partial") for e in p.iterdir()) and not (p / "zarr.json").is_file()


def assert_store_or_absent(target: StoreTarget) -> None:
    """Refuse (one line) a target that holds something other than a Zarr store: never write over user files."""
    if isinstance(target, zarr.storage.MemoryStore):
        return
    if _foreign(target):
        raise StoreError(f"{store_location(target)} exists and is not a trajectory store; remove it or choose "
                         "another path")


def remove_store(target: StoreTarget) -> None:
    """Delete a store (start over). Refuses to delete a directory (or prefix) that is not a Zarr store."""
    if isinstance(target, zarr.storage.MemoryStore):
        target._store_dict.clear()
        return
    assert_store_or_absent(target)
    loc = store_location(target)
    assert loc is not None  # only a MemoryStore has no location
    if _URL.match(loc):
        fs, path = _sync_fs(loc)
        with contextlib.suppress(FileNotFoundError):
            fs.rm(path, recursive=True)
        return
    p = Path(loc)
    if p.is_dir():
        shutil.rmtree(p)
