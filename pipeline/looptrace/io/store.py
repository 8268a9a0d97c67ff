"""The trajectory store (SPEC §1, DESIGN "Trajectory store"): the only module that imports zarr.

One Zarr v3 group per (model, split); one row per scored token, ordered by (sequence, position).
Every array names its dimensions (``dimension_names``) so ``xarray.open_zarr(path)`` opens the group,
and the group attributes describe the store fully (schema version, model, task, regime, dtypes,
resolved dump parameters, seeds, versions, completion flag, non-finite count).

Layout choices and why:

- Chunks run along the ``token`` axis only (``chunk_tokens`` rows, every other axis whole), so a chunk
  is a self-contained block of tokens: readers stream chunk-aligned blocks (:meth:`TrajectoryStore.blocks`)
  and the writer only ever writes whole, aligned chunks. Measured on this machine: two writers may share
  a store only if each writes whole chunks; unaligned concurrent writes silently lose rows (SPEC §1).
- Codecs: Blosc(zstd, bit shuffle) then a crc32c checksum (SPEC §1), so a damaged chunk raises
  :class:`StoreError` instead of returning wrong numbers.
- Every chunk is written, even one that equals the fill value (``write_empty_chunks``), so a missing chunk
  file is detected on open instead of reading back as zeros.
- Resume markers: ``chunk_nan_count`` [chunk] int64, one Zarr chunk per element, ``-1`` until every array
  of that token chunk is written; then the number of non-finite values in that chunk's ``hidden`` and
  ``hidden_init`` (after the cast to the stored dtype, so float16 overflow counts). A killed dump resumes
  from the first chunk whose marker is still ``-1``; the store is only marked ``complete`` at the end.
  (The local store writes every key atomically — temp file + rename — so a marker is never half-written;
  an object store's PUT is atomic too.)
- Chunk identity: ``chunk_digest`` [chunk, array] uint32, one Zarr chunk per row, holds the crc32c of each
  token array's stored bytes in that chunk (written after the arrays, before the marker). The codec's
  checksum proves a chunk's bytes are intact; the digest proves they are *that* chunk's bytes, so two swapped
  chunk files are caught (:meth:`TrajectoryStore.verify`, chunk-aligned reads, and the dump's re-run, which
  rewrites them). The data arrays' chunks are unchanged by it, byte for byte.
- Targets: a path, a ``file://`` URL, any fsspec URL (``s3://``, ``gs://``, ``memory://``) or a
  :func:`memory_store`; :func:`resolve_store` is the one place that turns them into a zarr store. Credentials
  and endpoints come from the libraries' own environment and config (``AWS_*``, ``AWS_ENDPOINT_URL``,
  ``FSSPEC_S3_*``, ``~/.aws``, ``~/.config/fsspec/*.json``), never from params. A URL that went through
  ``pathlib.Path`` (``s3:/bucket/key``) is restored, so ``Path(root) / model / "val.zarr"`` keeps working.
- Writers coordinate through :mod:`looptrace.io.claims` (a sibling ``.<name>.claims``), never inside the store.

Reader API (other stages use only this)::

    st = open_store(path)                      # validates; every problem is a one-line StoreError
    st.read("hidden", tokens=slice(0, 100))    # np.ndarray, hidden upcast to float32
    for sl in st.blocks(): st.read_block(["hidden", "entropy"], sl)
    st.tokens_frame()                          # polars: token + TOKEN_FIELDS
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import math
import os
import re
import shutil
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import crc32c
import numpy as np
import polars as pl
import zarr
from zarr.codecs import BloscCodec, Crc32cCodec
from zarr.core.sync import sync

from looptrace.config import UserError
from looptrace.io.artifacts import jsonable
from looptrace.io.precision import STATE_DTYPES, PrecisionError, count_nonfinite, decode_states, encode_states
from looptrace.signals.names import LOGIT_SIGNALS

#: Bumped whenever an array, dimension or required attribute changes meaning.
SCHEMA_VERSION = 1

#: Per-(token, loop) logit statistics of SPEC §3 (all float32 except ``argmax``, int32).
STAT_NAMES = LOGIT_SIGNALS

#: Per-token metadata arrays (int64), in ``tokens_frame`` column order.
TOKEN_FIELDS = ("target", "token_id", "sequence", "position", "difficulty", "token_type")

#: Dimension names of every array the store may hold.
DIMS: dict[str, tuple[str, ...]] = {
    "hidden": ("token", "loop", "d_model"),
    "hidden_init": ("token", "d_model"),
    "logits": ("token", "loop", "vocab"),
    "topk_ids": ("token", "loop", "k"),
    "topk_logits": ("token", "loop", "k"),
    **{s: ("token", "loop") for s in STAT_NAMES},
    "gate_logit": ("token", "loop"),
    **{f: ("token",) for f in TOKEN_FIELDS},
    "loop_group": ("loop",),
    "chunk_nan_count": ("chunk",),
    "chunk_digest": ("chunk", "array"),
}

#: Stored dtype of every array except ``hidden``/``hidden_init`` (which follow ``dump.hidden_dtype``).
DTYPES: dict[str, str] = {
    "logits": "float32", "topk_ids": "int32", "topk_logits": "float32",
    **{s: "float32" for s in STAT_NAMES}, "argmax": "int32", "gate_logit": "float32",
    **{f: "int64" for f in TOKEN_FIELDS}, "loop_group": "int32", "chunk_nan_count": "int64",
    "chunk_digest": "uint32",
}

HIDDEN_NAMES = ("hidden", "hidden_init")
#: Stored dtypes of the states; bfloat16 is kept as its uint16 bit pattern (looptrace.io.precision).
HIDDEN_DTYPES = ("float16", "float32", "bfloat16")

#: Arrays every store must hold (``logits`` or ``topk_*`` and ``gate_logit`` are optional).
REQUIRED = ("hidden", "hidden_init", *STAT_NAMES, *TOKEN_FIELDS, "loop_group")

#: Group attributes every store must carry (the rest default to None / empty on read).
REQUIRED_ATTRS = ("schema_version", "complete", "n_tokens", "n_loops", "d_model", "vocab_size",
                  "chunk_tokens", "nan_count", "dtypes")

#: Descriptive attributes and their value when a writer does not know them (``write_store``).
ATTR_DEFAULTS: dict[str, Any] = {"model": {}, "split": None, "task": None, "regime": None,
                                 "difficulty_name": "difficulty", "difficulty_levels": [], "token_types": [],
                                 "params": {}, "seeds": {}, "versions": {}}

_MARKER = "chunk_nan_count"
_DIGEST = "chunk_digest"
#: Internal arrays (resume markers, chunk digests): not data, not listed by ``names``.
_INTERNAL = (_MARKER, _DIGEST)
_RERUN = "re-run `looptrace dump` to rebuild it"


class StoreError(UserError, ValueError):
    """A one-line, user-facing problem with a trajectory store (names the store, the array and the fix)."""


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


#: Blosc block size: blocks of 4 MiB (instead of Blosc's automatic ~256 KiB at level 1) give zstd more
#: context and fewer block headers. Measured on random-init d_model 512 states, one 4096-token chunk per
#: write: store / float32 .npy 0.493 → 0.469, and 289 → 186 ms of CPU per chunk (the smaller blocks cost more).
BLOSC_BLOCKSIZE = 1 << 22


def _codecs(clevel: int) -> list:
    # zstd at a low level with bit shuffle: float16 states compress to ~0.85 and float32 logits to ~0.82
    # (byte shuffle ~0.93 / 0.91; lz4 ~0.91 / 0.86, 30 % less CPU but the store misses half the float32
    # bytes); ints and stats far more. crc32c last, so the checksum covers the bytes actually stored (SPEC §1).
    return [BloscCodec(cname="zstd", clevel=clevel, shuffle="bitshuffle", blocksize=BLOSC_BLOCKSIZE), Crc32cCodec()]


def _is_checksum_error(exc: BaseException) -> bool:
    msg = str(exc).lower()
    return "checksum" in msg or "decompress" in msg or "blosc" in msg or "corrupt" in msg


# ---------------------------------------------------------------------------------------------
# Reader
# ---------------------------------------------------------------------------------------------

class TrajectoryStore:
    """An opened, validated store (use :func:`open_store`).

    Attributes:
        attrs: the group attributes (a plain dict; see DESIGN.md for the keys).
        label: the path (or ``<memory>``) used in error messages.
    """

    def __init__(self, group: zarr.Group, label: str):
        self._group = group
        self.label = label
        self.target: StoreTarget = label if not isinstance(group.store, zarr.storage.MemoryStore) else group.store
        self.store: zarr.abc.store.Store = group.store
        self.attrs: dict = dict(group.attrs.asdict())
        self._arrays: dict[str, zarr.Array] = {name: arr for name, arr in group.arrays()}
        self._digests: tuple[dict[str, int], np.ndarray] | None = None

    # -- shape ---------------------------------------------------------------------------------
    @property
    def n_tokens(self) -> int:
        return int(self.attrs["n_tokens"])

    @property
    def n_loops(self) -> int:
        return int(self.attrs["n_loops"])

    @property
    def d_model(self) -> int:
        return int(self.attrs["d_model"])

    @property
    def vocab_size(self) -> int:
        return int(self.attrs["vocab_size"])

    @property
    def chunk_tokens(self) -> int:
        return int(self.attrs["chunk_tokens"])

    @property
    def has_gate(self) -> bool:
        return "gate_logit" in self._arrays

    @property
    def has_logits(self) -> bool:
        """Full logits stored (else ``topk_ids``/``topk_logits``, or neither)."""
        return "logits" in self._arrays

    @property
    def complete(self) -> bool:
        return bool(self.attrs.get("complete"))

    @property
    def loop_group(self) -> np.ndarray:
        """[loop] int: looped group of each loop index."""
        return self.read("loop_group")

    @property
    def names(self) -> list[str]:
        """Data arrays held (without the internal resume markers)."""
        return sorted(n for n in self._arrays if n not in _INTERNAL)

    def __contains__(self, name: str) -> bool:
        return name in self._arrays and name not in _INTERNAL

    def __repr__(self) -> str:
        return (f"TrajectoryStore({self.label!r}, n_tokens={self.n_tokens}, n_loops={self.n_loops}, "
                f"d_model={self.d_model}, vocab_size={self.vocab_size})")

    # -- reading -------------------------------------------------------------------------------
    def read(self, name: str, tokens: slice | np.ndarray | Sequence[int] = slice(None)) -> np.ndarray:
        """Read one array, optionally only some tokens.

        Args:
            name: array name (see :data:`DIMS`).
            tokens: a slice of rows or an integer index array (rows in any order) along ``token``;
                ignored for ``loop_group``.

        Returns:
            The array (``hidden``/``hidden_init`` upcast to float32; others in their stored dtype).

        Raises:
            StoreError: unknown array, or a chunk whose checksum does not match (damaged on disk).
        """
        if name not in self._arrays:
            raise StoreError(f"store {self.label}: no array '{name}' (has: {', '.join(self.names)})")
        arr = self._arrays[name]
        try:
            if DIMS.get(name, ("token",))[0] != "token":
                out = arr[...]
            elif isinstance(tokens, slice):
                out = arr[tokens]
            else:
                idx = np.asarray(tokens, dtype=np.int64)
                out = arr.get_orthogonal_selection((idx,) + (slice(None),) * (arr.ndim - 1))
        except (ValueError, RuntimeError, OSError) as exc:
            if _is_checksum_error(exc):
                raise StoreError(f"store {self.label}: array '{name}' has a damaged chunk (checksum mismatch); "
                                 f"{_RERUN}") from None
            raise
        out = np.asarray(out)
        if isinstance(tokens, slice) and DIMS.get(name, ("",))[0] == "token":
            self._check_identity(name, tokens, out)
        if name in HIDDEN_NAMES:
            out = decode_states(out, (self.attrs.get("dtypes") or {}).get(name))  # float32 (bfloat16 bits widened)
        return out

    def _digest_table(self) -> tuple[dict[str, int], np.ndarray] | None:
        """(array -> column, [chunk, array] digests) of a store that has them (read once), else None."""
        if self._digests is None:
            arr = self._arrays.get(_DIGEST)
            if arr is None:
                return None
            try:
                table = np.asarray(arr[...])
            except Exception:  # noqa: BLE001 - a damaged digest chunk: the chunk it describes is redone on re-run
                raise StoreError(f"store {self.label}: array '{_DIGEST}' has a damaged chunk; {_RERUN}") from None
            self._digests = ({n: i for i, n in enumerate(arr.attrs.get("arrays", []))}, table)
        return self._digests

    def _check_identity(self, name: str, tokens: slice, out: np.ndarray) -> None:
        """Every whole chunk inside ``tokens`` must hold the bytes recorded for *that* chunk (swapped files)."""
        table = self._digest_table()
        if table is None or name not in table[0]:
            return
        col, digests = table[0][name], table[1]
        start, stop, step = tokens.indices(self.n_tokens)
        if step != 1 or stop <= start:
            return
        ct = self.chunk_tokens
        first = -(-start // ct)
        for c in range(first, digests.shape[0]):
            lo, hi = c * ct, min((c + 1) * ct, self.n_tokens)
            if hi > stop:
                break
            if chunk_digest(out[lo - start:hi - start]) != int(digests[c, col]):
                raise StoreError(f"store {self.label}: chunk {c} of array '{name}' holds another chunk's data "
                                 f"(digest mismatch: chunk files swapped or replaced); {_RERUN}")

    def blocks(self, block_tokens: int | None = None) -> Iterator[slice]:
        """Token slices covering the store in order.

        Args:
            block_tokens: rows per block; ``None`` = the store's ``chunk_tokens`` (chunk-aligned reads,
                each chunk decoded once).
        """
        step = int(block_tokens or self.chunk_tokens)
        if step < 1:
            raise StoreError(f"block_tokens must be >= 1, got {step}")
        for start in range(0, self.n_tokens, step):
            yield slice(start, min(start + step, self.n_tokens))

    def read_block(self, names: Sequence[str], tokens: slice) -> dict[str, np.ndarray]:
        """Several arrays for one token slice: name -> np.ndarray (as :meth:`read`)."""
        return {n: self.read(n, tokens) for n in names}

    def tokens_frame(self) -> pl.DataFrame:
        """Per-token metadata: polars DataFrame with ``token`` (row index) and :data:`TOKEN_FIELDS` (int64)."""
        cols = {"token": np.arange(self.n_tokens, dtype=np.int64)}
        cols.update({f: self.read(f).astype(np.int64) for f in TOKEN_FIELDS})
        return pl.DataFrame(cols)

    def verify(self) -> None:
        """Decode every chunk of every array (checksums) and check each chunk's identity (digests); raises
        :class:`StoreError` on the first damaged one."""
        for name in self._arrays:
            if name in _INTERNAL:
                continue
            if DIMS.get(name, ("token",))[0] != "token":
                self.read(name)
                continue
            for sl in self.blocks():
                self.read(name, sl)


def chunk_digest(rows: np.ndarray) -> int:
    """crc32c of one chunk's rows in their stored dtype (C order): the chunk's identity in ``chunk_digest``."""
    return int(crc32c.crc32c(np.ascontiguousarray(rows).data))


def _open_group(target: StoreTarget, mode: str) -> zarr.Group:
    label = _label(target)
    store = resolve_store(target, "r" if mode == "r" else "r+")
    if not isinstance(target, zarr.storage.MemoryStore) and not _exists(store, "zarr.json"):
        loc = store_location(target)
        present = Path(loc).exists() if not _URL.match(loc) else _any_key(store)
        if not present:
            raise StoreError(f"store {label} not found; run `looptrace dump` first")
        raise StoreError(f"{label} is not a Zarr v3 store (no zarr.json); {_RERUN}")
    try:
        # use_consolidated=False: validate what is really on disk, not a summary written at the end
        return zarr.open_group(store, mode=mode, zarr_format=3, use_consolidated=False)
    except Exception as exc:  # noqa: BLE001 - any failure to parse the metadata is the same user problem
        raise StoreError(f"store {label} cannot be opened as a Zarr v3 group ({type(exc).__name__}); {_RERUN}") from None


def open_store(path: StoreTarget, allow_nan: bool = False, allow_incomplete: bool = False,
               verify: bool = False) -> TrajectoryStore:
    """Open and validate a trajectory store.

    Args:
        path: the ``<split>.zarr`` directory, or a :func:`memory_store`.
        allow_nan: accept a store whose ``hidden``/``hidden_init`` hold NaN/Inf (counted at dump time in
            ``nan_count``). Also accepted when the store was dumped with ``dump.allow_nan: true``.
        allow_incomplete: accept a store whose dump has not finished (``complete`` false).
        verify: decode every chunk now (checksums) instead of on first read.

    Raises:
        StoreError: one line naming the store, the array or attribute and the fix — missing store, wrong
            schema version, incomplete dump, missing array, inconsistent shapes or dimensions, non-finite
            states, damaged chunk.
    """
    label = _label(path)
    group = _open_group(path, "r")
    attrs = group.attrs.asdict()
    version = attrs.get("schema_version")
    if version != SCHEMA_VERSION:
        raise StoreError(f"store {label} has schema_version {version!r}, this looptrace reads {SCHEMA_VERSION}; "
                         f"{_RERUN}")
    if not attrs.get("complete") and not allow_incomplete:
        done, total = _marker_progress(group)
        raise StoreError(f"store {label} is incomplete ({done} of {total} chunks written); "
                         "re-run `looptrace dump` to resume")
    missing = [a for a in REQUIRED_ATTRS if a not in attrs]
    if missing:
        raise StoreError(f"store {label}: attribute '{missing[0]}' missing; {_RERUN}")
    try:
        st = TrajectoryStore(group, label)
    except Exception as exc:  # noqa: BLE001 - an array's metadata does not parse: name the file, not the parser
        bad = _damaged_metadata(group.store)
        what = f"'{bad}/zarr.json' is damaged" if bad else "an array's metadata cannot be read"
        msg = str(exc).strip().splitlines()[0][:100] if str(exc).strip() else type(exc).__name__
        raise StoreError(f"store {label}: {what} ({msg}); delete the store and re-run `looptrace dump` to "
                         "rebuild it") from None
    _validate_arrays(st)
    nan_count = int(attrs.get("nan_count") or 0)
    dumped_allow = bool((attrs.get("params") or {}).get("allow_nan", False))
    if nan_count and not (allow_nan or dumped_allow):
        raise StoreError(f"store {label}: {nan_count} NaN/Inf values in 'hidden'/'hidden_init' (counted at dump "
                         f"time; dtype {attrs['dtypes'].get('hidden')}); set dump.hidden_dtype: float32 if float16 "
                         "overflowed, or pass allow_nan=True")
    if verify:
        st.verify()
    return st


def _damaged_metadata(store: zarr.abc.store.Store) -> str | None:
    """The first member of a store (in name order) whose ``zarr.json`` is not a JSON object, or None."""
    from zarr.core.buffer import default_buffer_prototype

    async def first_bad() -> str | None:
        names = sorted([n async for n in store.list_dir("")])
        for name in names:
            buf = await store.get(f"{name}/zarr.json", default_buffer_prototype())
            if buf is None:
                continue
            try:
                if not isinstance(json.loads(buf.to_bytes()), dict):
                    return name
            except ValueError:
                return name
        return None

    return sync(first_bad())


def _chunk_keys(store: zarr.abc.store.Store, name: str) -> set[str]:
    """Chunk keys stored for array ``name`` (default v3 encoding ``<name>/c/i/j/...``), relative to ``c/``.

    Listed with the trailing slash (a memory store matches string prefixes: ``hidden`` would also match
    ``hidden_init``); temp files an interrupted atomic write may leave (``0.<hex>.partial``) are skipped.
    """
    prefix = f"{name}/c/"

    async def keys() -> set[str]:
        out = set()
        async for k in store.list_prefix(prefix):
            rel = k[len(prefix):] if k.startswith(prefix) else k.split("/c/", 1)[-1]
            if all(part.isdigit() for part in rel.split("/")):
                out.add(rel)
        return out

    return sync(keys())


def _stored_chunks(store: zarr.abc.store.Store, name: str) -> int:
    """Number of chunk objects stored for array ``name``."""
    return len(_chunk_keys(store, name))


def _marker_progress(group: zarr.Group) -> tuple[int, int]:
    if _MARKER not in group:
        return 0, 0
    try:
        marks = np.asarray(group[_MARKER][...])
    except Exception:  # noqa: BLE001 - a damaged marker only changes the progress shown
        return 0, 0
    return int((marks >= 0).sum()), int(marks.size)


def _validate_arrays(st: TrajectoryStore) -> None:
    arrays, label = st._arrays, st.label
    for name in REQUIRED:
        if name not in arrays:
            raise StoreError(f"store {label}: array '{name}' missing; {_RERUN}")
    if ("topk_ids" in arrays) != ("topk_logits" in arrays):
        raise StoreError(f"store {label}: 'topk_ids' and 'topk_logits' must come together; {_RERUN}")
    n, T, D, V = st.n_tokens, st.n_loops, st.d_model, st.vocab_size
    k = arrays["topk_ids"].shape[-1] if "topk_ids" in arrays else None
    size = {"token": n, "loop": T, "d_model": D, "vocab": V, "k": k}
    for name, arr in arrays.items():
        dims = DIMS.get(name)
        if dims is None:
            continue  # extra arrays are allowed (forwards compatibility); they are not validated
        got_dims = tuple(arr.metadata.dimension_names or ())
        if got_dims != dims:
            raise StoreError(f"store {label}: array '{name}' has dimensions {got_dims}, expected {dims}; {_RERUN}")
        if name == _DIGEST and st.complete and _stored_chunks(st.store, name) != arr.nchunks:
            raise StoreError(f"store {label}: array '{name}' is missing {arr.nchunks - _stored_chunks(st.store, name)} "
                             f"of {arr.nchunks} chunks (deleted or never written); {_RERUN}")
        if name in _INTERNAL:
            continue
        want = tuple(size[d] for d in dims)
        if tuple(arr.shape) != want:
            expl = ", ".join(f"{d}={s}" for d, s in zip(dims, want, strict=True))
            raise StoreError(f"store {label}: array '{name}' has shape {tuple(arr.shape)}, inconsistent with "
                             f"the attributes ({expl}); {_RERUN}")
        if st.complete:
            have, total = _stored_chunks(st.store, name), arr.nchunks
            if have != total:
                raise StoreError(f"store {label}: array '{name}' is missing {total - have} of {total} chunks "
                                 f"(deleted or never written); {_RERUN}")


# ---------------------------------------------------------------------------------------------
# Writer
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ArraySpec:
    """Shape and stored dtype of one array to create (dimensions come from :data:`DIMS`)."""

    shape: tuple[int, ...]
    dtype: str


class StoreWriter:
    """Chunk-at-a-time writer of one store; only ever writes whole, aligned token chunks.

    Create with :meth:`create` (new store, ``complete`` false) or :meth:`reopen` (resume an existing
    incomplete store); write each token chunk once with :meth:`write_chunk` (from one thread); call
    :meth:`finish` to record ``nan_count`` and set ``complete``.

    Attributes:
        own: the chunks this writer may write (its claimed shard range; None = every chunk).
            :meth:`write_chunk` refuses any other chunk, so two cooperating writers never share a chunk.
    """

    def __init__(self, target: StoreTarget, group: zarr.Group, own: range | None = None):
        self.target = target
        self.label = _label(target)
        self._group = group
        self.store: zarr.abc.store.Store = group.store
        # write_empty_chunks is a runtime setting (not stored in the metadata): set it on every handle
        self._arrays: dict[str, zarr.Array] = {name: arr.with_config({"write_empty_chunks": True})
                                               for name, arr in group.arrays()}
        self.attrs: dict = dict(group.attrs.asdict())
        self.n_tokens = int(self.attrs["n_tokens"])
        self.chunk_tokens = int(self.attrs["chunk_tokens"])
        self.n_chunks = math.ceil(self.n_tokens / self.chunk_tokens)
        self.state_dtypes = {n: d for n, d in (self.attrs.get("dtypes") or {}).items() if n in HIDDEN_NAMES}
        self.own = own
        dig = self._arrays.get(_DIGEST)
        self._digest_cols: dict[str, int] = {n: i for i, n in enumerate(dig.attrs.get("arrays", []))} if dig else {}

    @property
    def token_arrays(self) -> list[str]:
        """Token-axis data arrays, in the store's order."""
        return [n for n, a in self._arrays.items() if n not in _INTERNAL and DIMS.get(n, ("",))[0] == "token"]

    @classmethod
    def create(cls, target: StoreTarget, specs: Mapping[str, ArraySpec], attrs: Mapping[str, Any],
               chunk_tokens: int, clevel: int = 1) -> StoreWriter:
        """Create a new, empty store (replacing whatever is at ``target``).

        Args:
            target: directory path, URL or :func:`memory_store`.
            specs: name -> :class:`ArraySpec`; every token-axis array must have ``n_tokens`` rows.
            attrs: group attributes (must include ``n_tokens``; ``schema_version``, ``complete``,
                ``chunk_tokens`` and ``nan_count`` are set here).
            chunk_tokens: rows per chunk along ``token``.
            clevel: zstd level of the Blosc compressor.
        """
        if chunk_tokens < 1:
            raise StoreError(f"dump.chunk_tokens must be >= 1, got {chunk_tokens}")
        remove_store(target)
        n_tokens = int(attrs["n_tokens"])
        n_chunks = math.ceil(n_tokens / chunk_tokens)
        full = dict(jsonable(dict(attrs)))
        full.update(schema_version=SCHEMA_VERSION, complete=False, chunk_tokens=int(chunk_tokens), nan_count=None)
        group = zarr.open_group(resolve_store(target, "w"), mode="w", zarr_format=3, attributes=full)
        codecs = _codecs(clevel)
        token_names = []
        for name, spec in specs.items():
            dims = DIMS[name]
            if dims[0] == "token" and spec.shape[0] != n_tokens:
                raise StoreError(f"array '{name}' has {spec.shape[0]} rows, expected n_tokens={n_tokens}")
            chunks = (max(1, chunk_tokens),) + tuple(max(1, s) for s in spec.shape[1:]) if dims[0] == "token" \
                else tuple(max(1, s) for s in spec.shape)
            zdtype = STATE_DTYPES.get(spec.dtype, spec.dtype) if name in HIDDEN_NAMES else spec.dtype
            group.create_array(name, shape=spec.shape, chunks=chunks, dtype=zdtype, compressors=codecs,
                               dimension_names=dims, fill_value=0)
            if dims[0] == "token":
                token_names.append(name)
        group.create_array(_MARKER, shape=(n_chunks,), chunks=(1,), dtype="int64", compressors=[Crc32cCodec()],
                           dimension_names=DIMS[_MARKER], fill_value=-1)
        group.create_array(_DIGEST, shape=(n_chunks, len(token_names)), chunks=(1, max(1, len(token_names))),
                           dtype="uint32", compressors=[Crc32cCodec()], dimension_names=DIMS[_DIGEST], fill_value=0,
                           attributes={"arrays": token_names,
                                       "about": "crc32c of each chunk's stored bytes, per token array"})
        return cls(target, group)

    @classmethod
    def reopen(cls, target: StoreTarget) -> StoreWriter | None:
        """The writer of an existing store at ``target``, or None when there is none or it is unreadable."""
        try:
            group = _open_group(target, "r+")
            attrs = group.attrs.asdict()
            if attrs.get("schema_version") != SCHEMA_VERSION or _MARKER not in group or _DIGEST not in group:
                return None
            return cls(target, group)
        except (StoreError, KeyError, TypeError, ValueError):
            return None

    def done_chunks(self) -> np.ndarray:
        """[chunk] bool: chunks whose every array is written (a damaged marker counts as not done)."""
        arr = self._arrays[_MARKER]
        out = np.zeros(self.n_chunks, dtype=bool)
        try:
            out[:] = np.asarray(arr[...]) >= 0
        except Exception:  # noqa: BLE001 - read element-wise so one damaged marker only redoes its chunk
            for i in range(self.n_chunks):
                try:
                    out[i] = int(arr[i]) >= 0
                except Exception:  # noqa: BLE001
                    out[i] = False
        return out

    def chunk_rows(self, chunk: int) -> slice:
        """Token rows of chunk ``chunk`` (the last one may be shorter)."""
        start = chunk * self.chunk_tokens
        return slice(start, min(start + self.chunk_tokens, self.n_tokens))

    def _check_own(self, chunk: int) -> None:
        if not 0 <= chunk < self.n_chunks:
            raise StoreError(f"store {self.label}: chunk {chunk} out of range (0..{self.n_chunks - 1})")
        if self.own is not None and chunk not in self.own:
            raise StoreError(f"store {self.label}: chunk {chunk} is outside this writer's claimed range "
                             f"{self.own.start}..{self.own.stop - 1}")

    def write_chunk(self, chunk: int, data: Mapping[str, np.ndarray], nonfinite: int | None = None) -> int:
        """Write all token-axis arrays of one whole chunk, then its digests, then its completion marker.

        The arrays are written concurrently (one zarr call; the compressor runs on zarr's thread pool) and
        the marker only after all of them, so a marker always means "every array of this chunk is on disk".

        Args:
            chunk: chunk index (inside :attr:`own`).
            data: name -> rows of that chunk (exactly ``chunk_rows(chunk)`` rows); every token-axis array of
                the store must be present. States are cast to the stored dtype here.
            nonfinite: NaN/Inf count of the chunk's stored ``hidden``/``hidden_init`` when the caller
                counted it already (the dump counts while casting); None = count here.

        Returns:
            Number of non-finite values in the stored ``hidden``/``hidden_init`` rows.

        Raises:
            StoreError: a chunk outside :attr:`own`, a missing array or a wrong shape; a full disk (one line:
                free space and re-run to resume).
        """
        self._check_own(chunk)
        rows = self.chunk_rows(chunk)
        n = rows.stop - rows.start
        counted = 0
        writes: list[tuple[zarr.Array, np.ndarray]] = []
        digests = np.zeros(len(self._digest_cols), dtype=np.uint32)
        for name, arr in self._arrays.items():
            if name in _INTERNAL or DIMS.get(name, ("",))[0] != "token":
                continue
            if name not in data:
                raise StoreError(f"store {self.label}: chunk {chunk} lacks array '{name}'")
            if name in HIDDEN_NAMES:
                # states: range-checked cast (float16 overflow is an error, never a silent inf), bfloat16 as bits
                try:
                    x = encode_states(np.asarray(data[name]), self.state_dtypes.get(name, str(arr.dtype)),
                                      f"store {self.label}: chunk {chunk} of '{name}'")
                except PrecisionError as exc:
                    raise StoreError(str(exc)) from None
            else:
                x = np.asarray(data[name], dtype=arr.dtype)
            if x.shape != (n, *arr.shape[1:]):
                raise StoreError(f"store {self.label}: chunk {chunk} of '{name}' has shape {x.shape}, "
                                 f"expected {(n, *arr.shape[1:])}")
            if name in HIDDEN_NAMES and nonfinite is None:
                counted += count_nonfinite(x, self.state_dtypes.get(name, str(arr.dtype)))
            if name in self._digest_cols:
                digests[self._digest_cols[name]] = chunk_digest(x)
            writes.append((arr, x))

        async def write_all() -> None:
            await asyncio.gather(*(arr.async_array.setitem(rows, x) for arr, x in writes))

        with _disk_errors(self.label, f"chunk {chunk}"):
            sync(write_all())
            if self._digest_cols:
                self._arrays[_DIGEST][chunk] = digests
            total = counted if nonfinite is None else int(nonfinite)
            self._arrays[_MARKER][chunk] = total
        return total

    def reset_chunks(self, chunks: Iterable[int]) -> None:
        """Mark chunks as not written (their marker back to -1), so the dump rewrites them."""
        with _disk_errors(self.label, "resetting markers"):
            for c in chunks:
                self._check_own(int(c))
                self._arrays[_MARKER][int(c)] = -1

    def missing_chunks(self, chunks: Iterable[int]) -> list[int]:
        """Chunks (of ``chunks``) not fully written: marker unset, or a chunk object of some array absent."""
        chunks = list(chunks)
        done = self.done_chunks()
        missing = {c for c in chunks if not done[c]}
        for name in self.token_arrays + ([_DIGEST] if self._digest_cols else []):
            arr = self._arrays[name]
            keys = _chunk_keys(self.store, name)
            tail = "/".join("0" for _ in arr.shape[1:])
            for c in chunks:
                key = f"{c}/{tail}" if tail else str(c)
                if key not in keys:
                    missing.add(c)
        return sorted(missing)

    def damaged_chunks(self, chunks: Iterable[int]) -> dict[int, str]:
        """Chunks (of ``chunks``) that are missing, fail their checksum, or hold another chunk's bytes.

        Decodes every array's chunk once (a full read of the range). Returns chunk -> reason (one per chunk).
        """
        chunks = list(chunks)
        done = self.done_chunks()
        bad: dict[int, str] = {c: "never written (no marker)" for c in chunks if not done[c]}
        try:
            table = np.asarray(self._arrays[_DIGEST][...]) if self._digest_cols else None
        except Exception:  # noqa: BLE001 - the digests themselves are damaged: every chunk is suspect
            return {c: f"array '{_DIGEST}' damaged" for c in chunks}
        for name in self.token_arrays:
            arr = self._arrays[name]
            keys = _chunk_keys(self.store, name)
            tail = "/".join("0" for _ in arr.shape[1:])
            for c in chunks:
                if c in bad:
                    continue
                key = f"{c}/{tail}" if tail else str(c)
                if key not in keys:
                    bad[c] = f"array '{name}': chunk file missing"
                    continue
                try:
                    x = np.asarray(arr[self.chunk_rows(c)])
                except Exception as exc:  # noqa: BLE001
                    if _is_checksum_error(exc):
                        bad[c] = f"array '{name}': checksum mismatch"
                        continue
                    raise
                if table is not None and name in self._digest_cols and \
                        chunk_digest(x) != int(table[c, self._digest_cols[name]]):
                    bad[c] = f"array '{name}': holds another chunk's data"
        return dict(sorted(bad.items()))

    def read(self, name: str) -> np.ndarray:
        """Read back a whole array already written (for :meth:`rewrite` hooks run before :meth:`finish`)."""
        out = np.asarray(self._arrays[name][...])
        return decode_states(out, self.state_dtypes.get(name)) if name in HIDDEN_NAMES else out

    def rewrite(self, name: str, values: np.ndarray) -> None:
        """Replace one token-axis array whole, chunk by chunk (whole aligned chunks only; digests updated).

        Used by ``dump_split(finalize=...)`` for columns known only after every chunk is written (a text
        dump's ``difficulty`` = bin of the full-depth loss). Idempotent, so a killed rewrite is redone on resume.
        """
        arr = self._arrays[name]
        values = np.asarray(values, dtype=arr.dtype)
        if values.shape != arr.shape or DIMS.get(name, ("",))[0] != "token" or name in HIDDEN_NAMES:
            raise StoreError(f"store {self.label}: rewrite of '{name}' needs a non-state token array of shape "
                             f"{arr.shape}, got {values.shape}")
        col = self._digest_cols.get(name)
        with _disk_errors(self.label, f"rewriting '{name}'"):
            for c in range(self.n_chunks):
                rows = self.chunk_rows(c)
                arr[rows] = values[rows]
                if col is not None:
                    row = np.asarray(self._arrays[_DIGEST][c])
                    row[col] = chunk_digest(values[rows])
                    self._arrays[_DIGEST][c] = row

    def write_small(self, name: str, value: np.ndarray) -> None:
        """Write a non-token array whole (``loop_group``)."""
        arr = self._arrays[name]
        with _disk_errors(self.label, f"writing '{name}'"):
            arr[...] = np.asarray(value, dtype=arr.dtype)

    def set_incomplete(self) -> None:
        """Clear ``complete`` (and the consolidated metadata with it) before repairing a finished store."""
        with _disk_errors(self.label, "reopening the store"):
            self._group.attrs.update({"complete": False})
        self.attrs["complete"] = False

    def finish(self, attrs: Mapping[str, Any] | None = None) -> TrajectoryStore:
        """Check every chunk is written, record ``nan_count`` (and ``attrs``), consolidate the metadata (so
        ``xarray.open_zarr`` opens it without a warning), then set ``complete``.

        ``complete`` is written last, in the same (atomic) write of the root ``zarr.json`` that keeps the
        consolidated metadata, so a store is never marked complete without it; a kill before that leaves an
        incomplete store whose every marker is set, which a re-run finalises again.
        """
        marks = np.asarray(self._arrays[_MARKER][...])
        if (marks < 0).any():
            missing = int(np.flatnonzero(marks < 0)[0])
            raise StoreError(f"store {self.label}: chunk {missing} was never written; re-run `looptrace dump` to resume")
        update = dict(jsonable(dict(attrs or {})))
        update.update(nan_count=int(marks.sum()), complete=False)
        with _disk_errors(self.label, "finishing"):
            self._group.attrs.update(update)
            with warnings.catch_warnings():
                # zarr warns that consolidated metadata is not (yet) part of the v3 spec; xarray reads it.
                warnings.simplefilter("ignore")
                zarr.consolidate_metadata(self.store)
                # a group opened from its consolidated metadata keeps it when its attributes are rewritten
                zarr.open_group(self.store, mode="r+", zarr_format=3, use_consolidated=True).attrs.update(
                    {"complete": True})
        return TrajectoryStore(_open_group(self.target, "r"), self.label)

    def metadata_ok(self) -> bool:
        """Whether a complete store's consolidated metadata is present and lists every array on disk."""
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                cons = zarr.open_group(self.store, mode="r", zarr_format=3, use_consolidated=True)
                listed = {n for n, _ in cons.arrays()}
        except Exception:  # noqa: BLE001 - missing or unreadable consolidated metadata
            return False
        return listed == set(self._arrays) and bool(cons.attrs.get("complete"))


@contextlib.contextmanager
def _disk_errors(label: str, what: str) -> Iterator[None]:
    """A full disk (or quota) while writing becomes one line: the store stays incomplete and resumable."""
    try:
        yield
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise StoreError(f"store {label}: no space left on the device while {what} "
                             f"({os.strerror(exc.errno)}); the store is left incomplete: free space and re-run "
                             "`looptrace dump` to resume") from None
        raise


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


def assert_store_or_absent(target: StoreTarget) -> None:
    """Refuse (one line) a target that holds something other than a Zarr store: never write over user files."""
    if isinstance(target, zarr.storage.MemoryStore):
        return
    loc = store_location(target)
    if _URL.match(loc):
        store = resolve_store(target, "r")
        if not _exists(store, "zarr.json") and _any_key(store):
            raise StoreError(f"{loc} exists and is not a trajectory store; remove it or choose another path")
        return
    p = Path(loc)
    if p.exists() and not (p.is_dir() and ((p / "zarr.json").is_file() or not any(p.iterdir()))):
        raise StoreError(f"{p} exists and is not a trajectory store; remove it or choose another path")


def remove_store(target: StoreTarget) -> None:
    """Delete a store (start over). Refuses to delete a directory (or prefix) that is not a Zarr store."""
    if isinstance(target, zarr.storage.MemoryStore):
        target._store_dict.clear()
        return
    loc = store_location(target)
    if _URL.match(loc):
        store = resolve_store(target, "r")
        if _exists(store, "zarr.json"):
            fs, path = _sync_fs(loc)
            with contextlib.suppress(FileNotFoundError):
                fs.rm(path, recursive=True)
        elif _any_key(store):
            raise StoreError(f"{loc} exists and is not a trajectory store; remove it or choose another path")
        return
    p = Path(loc)
    if not p.exists():
        return
    if p.is_dir() and (p / "zarr.json").is_file():
        shutil.rmtree(p)
    elif p.is_dir() and not any(p.iterdir()):
        p.rmdir()
    else:
        raise StoreError(f"{p} exists and is not a trajectory store; remove it or choose another path")


def write_store(path: StoreTarget, arrays: Mapping[str, np.ndarray], attrs: Mapping[str, Any] | None = None,
                chunk_tokens: int = 4096, hidden_dtype: str | None = None, clevel: int = 1) -> TrajectoryStore:
    """One-shot writer for tests and small captures: write ``arrays`` as a complete store.

    No statistics are computed here (see :func:`looptrace.signals.logits.logit_stats`). On disk the store is
    written to ``<path>.tmp`` and renamed, so a failure leaves no store that could be taken as valid; on an
    object store (no rename) it is written in place and marked ``complete`` last.

    Args:
        path: target directory (replaced) or a :func:`memory_store`.
        arrays: name -> np.ndarray with the dimensions of :data:`DIMS`; at least :data:`REQUIRED`
            except ``loop_group`` (default: all loops in group 0). Cast to the stored dtypes
            (:data:`DTYPES`; states to ``hidden_dtype``).
        attrs: group attributes; ``n_tokens``, ``n_loops``, ``d_model``, ``vocab_size`` (from ``logits``,
            ``attrs['model']['vocab_size']`` or 1 + the largest target / argmax / token id), ``dtypes``,
            ``chunk_tokens``, ``nan_count``, ``schema_version`` and ``complete`` are filled in.
        chunk_tokens: rows per chunk along ``token``.
        hidden_dtype: stored dtype of ``hidden``/``hidden_init`` (``float16``/``float32``/``bfloat16``);
            ``None`` keeps the given array's dtype when it is one of those, else float16. A finite value beyond
            float16's range is a :class:`StoreError` (never stored as inf; ``looptrace.io.precision``).

    Returns:
        The store, opened with ``allow_nan=True`` (non-finite states are counted in ``nan_count``).
    """
    arrays = {k: np.asarray(v) for k, v in arrays.items()}
    unknown = sorted((set(arrays) - set(DIMS)) | (set(arrays) & set(_INTERNAL)))
    if unknown:
        raise StoreError(f"write_store: unknown array '{unknown[0]}' (known: {', '.join(sorted(DIMS))})")
    if "hidden" not in arrays:
        raise StoreError("write_store: array 'hidden' [token, loop, d_model] is required")
    n, T, D = arrays["hidden"].shape
    arrays.setdefault("loop_group", np.zeros(T, dtype=np.int32))
    for name in REQUIRED:
        if name not in arrays:
            raise StoreError(f"write_store: array '{name}' {list(DIMS[name])} is required")
    attrs = dict(attrs or {})
    if hidden_dtype is None:
        hidden_dtype = str(arrays["hidden"].dtype) if str(arrays["hidden"].dtype) in HIDDEN_DTYPES else "float16"
    if hidden_dtype not in HIDDEN_DTYPES:
        raise StoreError(f"hidden_dtype must be one of {HIDDEN_DTYPES}, got {hidden_dtype!r}")
    attrs.setdefault("vocab_size", _infer_vocab(arrays, attrs))
    for key, default in ATTR_DEFAULTS.items():
        attrs.setdefault(key, default)
    attrs.update(n_tokens=n, n_loops=T, d_model=D)
    dtypes = {name: (hidden_dtype if name in HIDDEN_NAMES else DTYPES[name]) for name in arrays}
    attrs["dtypes"] = dtypes
    size = {"token": n, "loop": T, "d_model": D, "vocab": attrs["vocab_size"]}
    specs = {}
    for name, a in arrays.items():
        dims = DIMS[name]
        want = tuple(size.get(d, a.shape[i] if i < a.ndim else -1) for i, d in enumerate(dims))
        if a.shape != want:
            raise StoreError(f"write_store: array '{name}' has shape {a.shape}, expected {want} for dims {dims}")
        specs[name] = ArraySpec(a.shape, dtypes[name])
    loc = store_location(path)
    on_disk = loc is not None and not _URL.match(loc)  # object stores have no rename: written in place
    if on_disk and Path(loc).exists() and not (Path(loc) / "zarr.json").is_file() and any(Path(loc).iterdir()):
        raise StoreError(f"{loc} exists and is not a trajectory store; remove it or choose another path")
    target: StoreTarget = Path(loc + ".tmp") if on_disk else path
    writer = StoreWriter.create(target, specs, attrs, chunk_tokens, clevel)
    writer.write_small("loop_group", arrays["loop_group"])
    for c in range(writer.n_chunks):
        rows = writer.chunk_rows(c)
        writer.write_chunk(c, {k: v[rows] for k, v in arrays.items() if DIMS[k][0] == "token"})
    writer.finish()
    if on_disk:
        remove_store(loc)
        os.replace(target, loc)
    return open_store(path, allow_nan=True)


def _infer_vocab(arrays: Mapping[str, np.ndarray], attrs: Mapping[str, Any]) -> int:
    if "logits" in arrays:
        return int(arrays["logits"].shape[-1])
    model = attrs.get("model") or {}
    if isinstance(model, Mapping) and model.get("vocab_size"):
        return int(model["vocab_size"])
    cands = [int(arrays[k].max()) + 1 for k in ("target", "argmax", "token_id", "topk_ids")
             if k in arrays and arrays[k].size]
    if not cands:
        raise StoreError("write_store: cannot infer vocab_size; pass attrs={'vocab_size': V}")
    return max(cands)


# ---------------------------------------------------------------------------------------------
# The split stores of one model belong together
# ---------------------------------------------------------------------------------------------

#: What must agree between the split stores of one model before a stage combines them: (label, getter).
IDENTITY_FIELDS: tuple[tuple[str, Any], ...] = (
    ("model name", lambda a: (a.get("model") or {}).get("name")),
    ("checkpoint hash", lambda a: (a.get("model") or {}).get("checkpoint_hash")),
    ("model config", lambda a: (a.get("model") or {}).get("config")),
    ("code hash", lambda a: a.get("code_hash")),
    ("dump params", lambda a: {k: v for k, v in (a.get("params") or {}).items() if k != "sequences"}),
    ("task", lambda a: a.get("task")),
    ("regime", lambda a: a.get("regime")),
    ("loops", lambda a: a.get("n_loops")),
    ("d_model", lambda a: a.get("d_model")),
    ("vocab size", lambda a: a.get("vocab_size")),
)


def check_same_model(stores: Mapping[str, TrajectoryStore]) -> None:
    """Refuse split stores that do not come from one dump of one model (before combining them).

    Compares model name, checkpoint hash, model config, code hash, dump params (all but ``sequences``), task,
    regime, loop count, d_model and vocabulary size of every store with the first one's.

    Raises:
        StoreError: one line naming both stores, the field and both values.
    """
    items = list(stores.items())
    if len(items) < 2:
        return
    (split0, ref), rest = items[0], items[1:]
    for split, st in rest:
        for what, get in IDENTITY_FIELDS:
            a, b = get(ref.attrs), get(st.attrs)
            if a != b:
                def short(v: Any) -> str:
                    text = str(v)
                    return text if len(text) <= 40 else text[:37] + "..."

                name_a = (ref.attrs.get("model") or {}).get("name")
                name_b = (st.attrs.get("model") or {}).get("name")
                raise StoreError(f"stores {ref.label} ({split0}, model {name_a}) and {st.label} ({split}, model "
                                 f"{name_b}) differ in {what} ({short(a)} vs {short(b)}): they are not one dump of "
                                 f"one model; re-run `looptrace dump` for this model")


def check_store_model(store: TrajectoryStore, name: str, checkpoint_hash: str | None = None,
                      checkpoint: str | None = None) -> None:
    """Refuse a store that is not ``name``'s dump (another model's store copied under this name), or — when
    ``checkpoint_hash`` is given — not a dump of the checkpoint a stage is about to combine it with.

    Args:
        store: an open store.
        name: the model the caller looks for (``<model>`` of ``<root>/<model>/<split>.zarr``).
        checkpoint_hash: sha256 of the checkpoint the caller loaded (None: not checked).
        checkpoint: the checkpoint's path or id, named in the error.

    Raises:
        StoreError: one line naming the store, both models (or both hashes) and the fix.
    """
    model = store.attrs.get("model") or {}
    if model.get("name") not in (None, name):
        raise StoreError(f"store {store.label} is a dump of model '{model.get('name')}', not '{name}' (another "
                         f"model's store under this name?); re-run `looptrace dump` for model '{name}'")
    have = model.get("checkpoint_hash")
    if checkpoint_hash is not None and have and have != checkpoint_hash:
        raise StoreError(f"store {store.label} was dumped from checkpoint {have[:12]}, not {checkpoint or 'the one'} "
                         f"loaded now ({checkpoint_hash[:12]}): the model was retrained or replaced since the dump; "
                         f"re-run `looptrace dump` for model '{name}' (dvc repro)")


def open_split_stores(root: StoreTarget, model: str, splits: Sequence[str], **open_kwargs: Any
                      ) -> dict[str, TrajectoryStore]:
    """``{split: open_store(<root>/<model>/<split>.zarr)}`` for a model, checked to belong together.

    Args:
        root: the dump root (a path or URL, e.g. ``artifacts/dump`` or ``s3://bucket/dump``).
        model: the model's name (a sub-directory of ``root``).
        splits: the splits to open, in order.
        open_kwargs: passed to :func:`open_store` (``allow_nan``, ``verify``...).

    Raises:
        StoreError: a store is missing/invalid, is another model's (:func:`check_store_model`), or the stores
            differ in identity (:func:`check_same_model`).
    """
    stores = {s: open_store(join_store(root, model, f"{s}.zarr"), **open_kwargs) for s in splits}
    for st in stores.values():
        check_store_model(st, model)
    check_same_model(stores)
    return stores
