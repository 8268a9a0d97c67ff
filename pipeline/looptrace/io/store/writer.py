"""Writing a store: :class:`StoreWriter` (whole, aligned token chunks, resume markers and chunk digests, used by
the dump) and :func:`write_store` (one shot, for tests and small captures). The stored bytes are decided here
and in :mod:`~looptrace.io.store.schema` (``looptrace.capture.resume.VALUE_MODULES``)."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import math
import os
import warnings
from collections.abc import Iterable, Iterator, Mapping
from concurrent.futures import Executor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import numpy as np
import zarr
import zarr.abc.store
import zarr.storage
from zarr.codecs import Crc32cCodec
from zarr.core.sync import sync

from looptrace.io.artifacts import jsonable
from looptrace.io.precision import STATE_DTYPES, PrecisionError, count_nonfinite, decode_states, encode_states
from looptrace.io.store.chunk_io import UNCACHED_OK, DirectChunk, Encoded, write_file_uncached
from looptrace.io.store.location import _URL, StoreTarget, _label, remove_store, resolve_store, store_location
from looptrace.io.store.reader import TrajectoryStore, _chunk_keys, _chunk_keys_of, _open_group, open_store
from looptrace.io.store.schema import (
    _DIGEST,
    _INTERNAL,
    _MARKER,
    ATTR_DEFAULTS,
    DIMS,
    DTYPES,
    HIDDEN_DTYPES,
    HIDDEN_NAMES,
    REQUIRED,
    SCHEMA_VERSION,
    StoreError,
    _codecs,
    _is_checksum_error,
    chunk_digest,
)


@dataclass(frozen=True)
class ArraySpec:
    """Shape and stored dtype of one array to create (dimensions come from :data:`DIMS`)."""

    shape: tuple[int, ...]
    dtype: str


@dataclass(frozen=True)
class PreparedChunk:
    """One chunk encoded by :meth:`StoreWriter.prepare_chunk`, not yet written.

    Attributes:
        chunk: chunk index; ``rows``: its token rows.
        direct: (store path, stored object) of every array written as a whole compressed chunk.
        via_zarr: (array, rows) of the arrays zarr's codec pipeline writes (a partial last chunk, other chains).
        digests: crc32c of each token array's rows, in the digest array's column order.
        nonfinite: NaN/Inf count of the chunk's stored states (its marker's value).
    """

    chunk: int
    rows: slice
    direct: list[tuple[Any, Encoded]]
    via_zarr: list[tuple[zarr.Array, np.ndarray]]
    digests: np.ndarray
    nonfinite: int


class StoreWriter:
    """Chunk-at-a-time writer of one store; only ever writes whole, aligned token chunks.

    Create with :meth:`create` (new store, ``complete`` false) or :meth:`reopen` (resume an existing
    incomplete store); write each token chunk once with :meth:`write_chunk` (from one thread); call
    :meth:`finish` to record ``nan_count`` and set ``complete``.

    Attributes:
        own: the chunks this writer may write (its claimed shard range; None = every chunk).
            :meth:`write_chunk` refuses any other chunk, so two cooperating writers never share a chunk.
    """

    def __init__(self, target: StoreTarget, group: zarr.Group, own: range | None = None,
                 arrays: Iterable[tuple[str, zarr.Array]] | None = None):
        self.target = target
        self.label = _label(target)
        self._group = group
        self.store: zarr.abc.store.Store = group.store
        # write_empty_chunks is a runtime setting (not stored in the metadata): set it on every handle
        self._arrays: dict[str, zarr.Array] = {name: arr.with_config({"write_empty_chunks": True})
                                               for name, arr in (group.arrays() if arrays is None else arrays)}
        self.attrs: dict = dict(group.attrs.asdict())
        self.n_tokens = int(self.attrs["n_tokens"])
        self.chunk_tokens = int(self.attrs["chunk_tokens"])
        self.n_chunks = math.ceil(self.n_tokens / self.chunk_tokens)
        self.state_dtypes = {n: d for n, d in (self.attrs.get("dtypes") or {}).items() if n in HIDDEN_NAMES}
        self.own = own
        self._uncached = UNCACHED_OK  # whole chunks written with O_DIRECT until the file system refuses it
        self._direct = {name: enc for name, arr in self._arrays.items() if (enc := DirectChunk.of(arr)) is not None}
        dig = self._arrays.get(_DIGEST)
        self._digest_cols: dict[str, int] = {n: i for i, n in enumerate(cast("list[str]", dig.attrs.get("arrays", [])))} if dig else {}

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
        # every array's metadata written in one round trip to zarr's event loop (concurrently) rather than one
        # blocking call each: ~20 arrays cost ~0.2 s of wall on a busy 2-core host otherwise
        create = group._async_group.create_array
        todo = []
        for name, spec in specs.items():
            dims = DIMS[name]
            if dims[0] == "token" and spec.shape[0] != n_tokens:
                raise StoreError(f"array '{name}' has {spec.shape[0]} rows, expected n_tokens={n_tokens}")
            chunks = (max(1, chunk_tokens),) + tuple(max(1, s) for s in spec.shape[1:]) if dims[0] == "token" \
                else tuple(max(1, s) for s in spec.shape)
            zdtype = STATE_DTYPES.get(spec.dtype, spec.dtype) if name in HIDDEN_NAMES else spec.dtype
            todo.append(create(name, shape=spec.shape, chunks=chunks, dtype=zdtype, compressors=codecs,
                               dimension_names=dims, fill_value=0))
            if dims[0] == "token":
                token_names.append(name)
        todo.append(create(_MARKER, shape=(n_chunks,), chunks=(1,), dtype="int64", compressors=[Crc32cCodec()],
                           dimension_names=DIMS[_MARKER], fill_value=-1))
        todo.append(create(_DIGEST, shape=(n_chunks, len(token_names)), chunks=(1, max(1, len(token_names))),
                           dtype="uint32", compressors=[Crc32cCodec()], dimension_names=DIMS[_DIGEST], fill_value=0,
                           attributes={"arrays": token_names,
                                       "about": "crc32c of each chunk's stored bytes, per token array"}))

        async def create_all() -> list:
            return list(await asyncio.gather(*todo))

        made = sync(create_all())
        return cls(target, group, arrays=[(a.basename, zarr.Array(a)) for a in made])

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
                    out[i] = int(cast(np.ndarray, arr[i])) >= 0
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

    def write_chunk(self, chunk: int, data: Mapping[str, np.ndarray] | PreparedChunk,
                    nonfinite: int | None = None) -> int:
        """Write all token-axis arrays of one whole chunk, then its digests, then its completion marker.

        The arrays are written concurrently (one zarr call) and the marker only after all of them, so a marker
        always means "every array of this chunk is on disk".

        Args:
            chunk: chunk index (inside :attr:`own`).
            data: name -> rows of that chunk (exactly ``chunk_rows(chunk)`` rows); every token-axis array of
                the store must be present. States are cast to the stored dtype here. Or the chunk already
                encoded by :meth:`prepare_chunk` (in another thread).
            nonfinite: NaN/Inf count of the chunk's stored ``hidden``/``hidden_init`` when the caller
                counted it already (the dump counts while casting); None = count here.

        Returns:
            Number of non-finite values in the stored ``hidden``/``hidden_init`` rows.

        Raises:
            StoreError: a chunk outside :attr:`own`, a missing array or a wrong shape; a full disk (one line:
                free space and re-run to resume).
        """
        if isinstance(data, PreparedChunk):
            self._check_own(chunk)  # (prepare_chunk checks it otherwise)
            prepared = data
        else:
            prepared = self.prepare_chunk(chunk, data, nonfinite)
        if prepared.chunk != chunk:
            raise StoreError(f"store {self.label}: chunk {chunk} given the encoded objects of chunk {prepared.chunk}")
        via_zarr, rows = prepared.via_zarr, prepared.rows
        with _disk_errors(self.label, f"chunk {chunk}"):
            direct = [(path, enc) for path, enc in prepared.direct if not self._write_uncached(path, enc)]

            async def write_all() -> None:
                await asyncio.gather(*(path.set(enc.buffer()) for path, enc in direct),
                                     *(arr.async_array.setitem(rows, x) for arr, x in via_zarr))

            sync(write_all())
            if self._digest_cols:
                self._arrays[_DIGEST][chunk] = prepared.digests
            self._arrays[_MARKER][chunk] = prepared.nonfinite
        return prepared.nonfinite

    def prepare_chunk(self, chunk: int, data: Mapping[str, np.ndarray], nonfinite: int | None = None,
                      pool: Executor | None = None) -> PreparedChunk:
        """The CPU half of :meth:`write_chunk`, nothing written: checks, casts, digests and, for whole chunks, the
        compressed objects (what :meth:`write_chunk` then only puts in the store).

        Why a separate step: a dump whose forward pass runs on the host's cores compresses between batches,
        while the forward pass's threads wait, and leaves only the file writes to a background thread; a
        compressing thread beside the forward pass preempts its threads mid-GEMM, which then stall at their
        barrier (docs/dump.md). Arguments as :meth:`write_chunk`, and ``pool``: threads that encode the
        arrays concurrently (each array's bytes are the same from any thread).
        """
        self._check_own(chunk)
        rows = self.chunk_rows(chunk)
        n = rows.stop - rows.start
        names = [name for name in self._arrays if name not in _INTERNAL and DIMS.get(name, ("",))[0] == "token"]
        for name in names:
            if name not in data:
                raise StoreError(f"store {self.label}: chunk {chunk} lacks array '{name}'")
        # Whole chunks of the usual codec chain are encoded here and handed to the store as bytes (the same bytes
        # as zarr's codec pipeline: tests/test_store.py); a partial last chunk or another chain goes through zarr.
        # Why: zarr's pipeline costs ~50 ms of CPU per 4096-token d_model-512 chunk beyond the compressor itself
        # (a hop to a worker thread per codec, a copy of every compressed chunk to append its checksum), which on
        # a busy host is taken from the forward pass (docs/dump.md).
        full = n == self.chunk_tokens
        stored = {name: self._stored_rows(chunk, name, data[name], n) for name in names}
        # the CPU work as independent tasks, largest first so that a pool's threads finish together (a chunk's
        # states are most of its bytes): each array's compressed object, its digest, the states' NaN/Inf count
        tasks: list[tuple[str, str]] = [(name, "encode") for name in names if full and name in self._direct]
        tasks += [(name, "digest") for name in names if name in self._digest_cols]
        if nonfinite is None:
            tasks += [(name, "count") for name in names if name in HIDDEN_NAMES]
        tasks.sort(key=lambda t: -stored[t[0]].nbytes)

        def run(task: tuple[str, str]) -> Any:
            name, what = task
            x = stored[name]
            if what == "encode":
                return self._direct[name].encode(x)
            if what == "digest":
                return chunk_digest(x)
            return count_nonfinite(x, self.state_dtypes.get(name, str(self._arrays[name].dtype)))

        results = dict(zip(tasks, pool.map(run, tasks) if pool is not None else map(run, tasks), strict=True))
        digests = np.zeros(len(self._digest_cols), dtype=np.uint32)
        for name, col in self._digest_cols.items():
            digests[col] = results[(name, "digest")]
        direct = [(self._arrays[name].async_array.store_path / self._direct[name].key(chunk), results[(name, "encode")])
                  for name in names if (name, "encode") in results]
        via_zarr = [(self._arrays[name], stored[name]) for name in names if (name, "encode") not in results]
        bad = sum(int(v) for (_, what), v in results.items() if what == "count")
        return PreparedChunk(chunk, rows, direct, via_zarr, digests, bad if nonfinite is None else int(nonfinite))

    def _write_uncached(self, path: Any, enc: Encoded) -> bool:
        """Write one compressed whole chunk of a local store past the page cache (:func:`write_file_uncached`);
        False when the store is not a local directory or its file system refuses ``O_DIRECT`` (the caller then
        writes it through zarr, as every later chunk of this writer)."""
        if not self._uncached or not isinstance(self.store, zarr.storage.LocalStore):
            return False
        ok = write_file_uncached(Path(self.store.root) / path.path, (enc.packed, enc.crc))
        self._uncached = ok
        return ok

    def _stored_rows(self, chunk: int, name: str, rows: np.ndarray, n: int) -> np.ndarray:
        """One array's rows of :meth:`prepare_chunk` in their stored dtype (checked: shape; states' range)."""
        arr = self._arrays[name]
        if name in HIDDEN_NAMES:
            # states: range-checked cast (float16 overflow is an error, never a silent inf), bfloat16 as bits
            try:
                x = encode_states(np.asarray(rows), self.state_dtypes.get(name, str(arr.dtype)),
                                  f"store {self.label}: chunk {chunk} of '{name}'")
            except PrecisionError as exc:
                raise StoreError(str(exc)) from None
        else:
            x = np.asarray(rows, dtype=arr.dtype)
        if x.shape != (n, *arr.shape[1:]):
            raise StoreError(f"store {self.label}: chunk {chunk} of '{name}' has shape {x.shape}, "
                             f"expected {(n, *arr.shape[1:])}")
        return x

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
        names = self.token_arrays + ([_DIGEST] if self._digest_cols else [])
        listed = _chunk_keys_of(self.store, names)
        for name in names:
            arr = self._arrays[name]
            keys = listed[name]
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
    local = loc if loc is not None and not _URL.match(loc) else None  # object stores have no rename: written in place
    if local is not None and Path(local).exists() and not (Path(local) / "zarr.json").is_file() \
            and any(Path(local).iterdir()):
        raise StoreError(f"{local} exists and is not a trajectory store; remove it or choose another path")
    target: StoreTarget = Path(local + ".tmp") if local is not None else path
    writer = StoreWriter.create(target, specs, attrs, chunk_tokens, clevel)
    writer.write_small("loop_group", arrays["loop_group"])
    for c in range(writer.n_chunks):
        rows = writer.chunk_rows(c)
        writer.write_chunk(c, {k: v[rows] for k, v in arrays.items() if DIMS[k][0] == "token"})
    writer.finish()
    if local is not None:
        assert isinstance(target, Path)  # local: written to <local>.tmp, then renamed
        remove_store(local)
        os.replace(target, local)
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
