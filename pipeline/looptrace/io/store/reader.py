"""Reading a store: :func:`open_store` validates it (every problem a one-line :class:`StoreError`) and returns a
:class:`TrajectoryStore` (arrays, chunk-aligned blocks, the tokens frame, verification)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, cast

import numpy as np
import polars as pl
import zarr
import zarr.abc.store
from zarr.core.sync import sync

from looptrace.io.precision import decode_states
from looptrace.io.store.location import (
    _URL,
    StoreTarget,
    _any_key,
    _exists,
    _label,
    resolve_store,
    store_location,
)
from looptrace.io.store.schema import (
    _DIGEST,
    _INTERNAL,
    _MARKER,
    _RERUN,
    DIMS,
    HEAD_NAMES,
    HIDDEN_NAMES,
    REQUIRED,
    REQUIRED_ATTRS,
    SCHEMA_VERSION,
    TOKEN_FIELDS,
    StoreError,
    _is_checksum_error,
    chunk_digest,
)

if TYPE_CHECKING:
    from zarr.core.metadata import ArrayV3Metadata


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
        data = np.asarray(out)
        if isinstance(tokens, slice) and DIMS.get(name, ("",))[0] == "token":
            self._check_identity(name, tokens, data)
        if name in HIDDEN_NAMES:
            data = decode_states(data, (self.attrs.get("dtypes") or {}).get(name))  # float32 (bfloat16 bits widened)
        return data

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
            self._digests = ({n: i for i, n in enumerate(cast("list[str]", arr.attrs.get("arrays", [])))}, table)
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


def _open_group(target: StoreTarget, mode: Literal["r", "r+"]) -> zarr.Group:
    label = _label(target)
    store = resolve_store(target, "r" if mode == "r" else "r+")
    if not isinstance(target, zarr.storage.MemoryStore) and not _exists(store, "zarr.json"):
        loc = store_location(target)
        assert loc is not None  # only a MemoryStore has no location
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
    attrs: dict[str, Any] = group.attrs.asdict()
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
    return sync(_list_chunk_keys(store, name))


def _chunk_keys_of(store: zarr.abc.store.Store, names: Sequence[str]) -> dict[str, set[str]]:
    """:func:`_chunk_keys` of several arrays, listed concurrently in one round trip to zarr's event loop."""

    async def every() -> list[set[str]]:
        return list(await asyncio.gather(*(_list_chunk_keys(store, n) for n in names)))

    return dict(zip(names, sync(every()), strict=True))


async def _list_chunk_keys(store: zarr.abc.store.Store, name: str) -> set[str]:
    prefix = f"{name}/c/"
    out = set()
    async for k in store.list_prefix(prefix):
        rel = k[len(prefix):] if k.startswith(prefix) else k.split("/c/", 1)[-1]
        if all(part.isdigit() for part in rel.split("/")):
            out.add(rel)
    return out


def _stored_chunks(store: zarr.abc.store.Store, name: str) -> int:
    """Number of chunk objects stored for array ``name``."""
    return len(_chunk_keys(store, name))


def _marker_progress(group: zarr.Group) -> tuple[int, int]:
    if _MARKER not in group:
        return 0, 0
    try:
        marks = np.asarray(cast(zarr.Array, group[_MARKER])[...])
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
    size = {"token": n, "loop": T, "d_model": D, "vocab": V, "k": k,
            "layer": arrays["layer_hidden"].shape[2] if "layer_hidden" in arrays else None}
    heads = [h for h in HEAD_NAMES if h in arrays]
    if heads and len(heads) != len(HEAD_NAMES):
        raise StoreError(f"store {label}: {' and '.join(repr(h) for h in HEAD_NAMES)} must come together; {_RERUN}")
    # the head arrays' layer axis lists params.heads (its own layers), not layer_hidden's
    head_size = {**size, "layer": arrays[heads[0]].shape[2], "head": arrays[heads[0]].shape[3]} if heads else size
    for name, arr in arrays.items():
        dims = DIMS.get(name)
        if dims is None:
            continue  # extra arrays are allowed (forwards compatibility); they are not validated
        got_dims = tuple(cast("ArrayV3Metadata", arr.metadata).dimension_names or ())  # opened as zarr_format=3
        if got_dims != dims:
            raise StoreError(f"store {label}: array '{name}' has dimensions {got_dims}, expected {dims}; {_RERUN}")
        if name == _DIGEST and st.complete and _stored_chunks(st.store, name) != arr.nchunks:
            raise StoreError(f"store {label}: array '{name}' is missing {arr.nchunks - _stored_chunks(st.store, name)} "
                             f"of {arr.nchunks} chunks (deleted or never written); {_RERUN}")
        if name in _INTERNAL:
            continue
        want = tuple((head_size if name in HEAD_NAMES else size)[d] for d in dims)
        if tuple(arr.shape) != want:
            expl = ", ".join(f"{d}={s}" for d, s in zip(dims, want, strict=True))
            raise StoreError(f"store {label}: array '{name}' has shape {tuple(arr.shape)}, inconsistent with "
                             f"the attributes ({expl}); {_RERUN}")
        if st.complete:
            have, total = _stored_chunks(st.store, name), arr.nchunks
            if have != total:
                raise StoreError(f"store {label}: array '{name}' is missing {total - have} of {total} chunks "
                                 f"(deleted or never written); {_RERUN}")
