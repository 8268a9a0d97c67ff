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
  (The local store writes every key atomically — temp file + rename — so a marker is never half-written.)

Reader API (other stages use only this)::

    st = open_store(path)                      # validates; every problem is a one-line StoreError
    st.read("hidden", tokens=slice(0, 100))    # np.ndarray, hidden upcast to float32
    for sl in st.blocks(): st.read_block(["hidden", "entropy"], sl)
    st.tokens_frame()                          # polars: token + TOKEN_FIELDS
"""

from __future__ import annotations

import asyncio
import math
import os
import shutil
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import zarr
from looptrace.io.artifacts import jsonable
from looptrace.io.precision import STATE_DTYPES, PrecisionError, count_nonfinite, decode_states, encode_states
from zarr.codecs import BloscCodec, Crc32cCodec
from zarr.core.sync import sync

#: Bumped whenever an array, dimension or required attribute changes meaning.
SCHEMA_VERSION = 1

#: Per-(token, loop) logit statistics of SPEC §3 (all float32 except ``argmax``, int32).
STAT_NAMES = ("entropy", "max_prob", "margin", "target_logprob", "argmax", "kl_prev", "kl_prev_rev",
              "kl_final", "logit_change")

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
}

#: Stored dtype of every array except ``hidden``/``hidden_init`` (which follow ``dump.hidden_dtype``).
DTYPES: dict[str, str] = {
    "logits": "float32", "topk_ids": "int32", "topk_logits": "float32",
    **{s: "float32" for s in STAT_NAMES}, "argmax": "int32", "gate_logit": "float32",
    **{f: "int64" for f in TOKEN_FIELDS}, "loop_group": "int32", "chunk_nan_count": "int64",
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
_RERUN = "re-run `looptrace dump` to rebuild it"


class StoreError(ValueError):
    """A one-line, user-facing problem with a trajectory store (names the store, the array and the fix)."""


StoreTarget = str | os.PathLike | zarr.storage.MemoryStore


def memory_store() -> zarr.storage.MemoryStore:
    """A fresh in-memory store (for tests and throw-away captures); pass it wherever a path is accepted."""
    return zarr.storage.MemoryStore()


def _label(target: StoreTarget) -> str:
    return "<memory>" if isinstance(target, zarr.storage.MemoryStore) else str(target)


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
        self.attrs: dict = dict(group.attrs.asdict())
        self._arrays: dict[str, zarr.Array] = {name: arr for name, arr in group.arrays()}

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
        return sorted(n for n in self._arrays if n != _MARKER)

    def __contains__(self, name: str) -> bool:
        return name in self._arrays and name != _MARKER

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
        if name in HIDDEN_NAMES:
            out = decode_states(out, (self.attrs.get("dtypes") or {}).get(name))  # float32 (bfloat16 bits widened)
        return out

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
        """Decode every chunk of every array (checksums); raises :class:`StoreError` on the first damaged one."""
        for name in self._arrays:
            if DIMS.get(name, ("token",))[0] != "token":
                self.read(name)
                continue
            for sl in self.blocks():
                self.read(name, sl)


def _open_group(target: StoreTarget, mode: str) -> zarr.Group:
    label = _label(target)
    if not isinstance(target, zarr.storage.MemoryStore):
        p = Path(target)
        if not p.exists():
            raise StoreError(f"store {label} not found; run `looptrace dump` first")
        if not (p / "zarr.json").is_file():
            raise StoreError(f"{label} is not a Zarr v3 store (no zarr.json); {_RERUN}")
        target = str(p)
    try:
        # use_consolidated=False: validate what is really on disk, not a summary written at the end
        return zarr.open_group(target, mode=mode, zarr_format=3, use_consolidated=False)
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
    st = TrajectoryStore(group, label)
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


def _stored_chunks(target: StoreTarget, name: str) -> int:
    """Number of chunk objects stored for array ``name`` (default v3 key encoding ``<name>/c/i/j/...``).

    Counted by hand: zarr 3.1's ``nchunks_initialized`` mis-lists arrays whose name prefixes another's
    (``hidden`` / ``hidden_init``) in a memory store.
    """
    if isinstance(target, zarr.storage.MemoryStore):
        prefix = f"{name}/c/"
        return sum(1 for k in target._store_dict if k.startswith(prefix))
    root = Path(target) / name / "c"
    n = 0
    for _, _, files in os.walk(root):
        n += sum(1 for f in files if f.isdigit())  # skip temp files an interrupted atomic write may leave
    return n


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
        if name == _MARKER:
            continue
        want = tuple(size[d] for d in dims)
        if tuple(arr.shape) != want:
            expl = ", ".join(f"{d}={s}" for d, s in zip(dims, want, strict=True))
            raise StoreError(f"store {label}: array '{name}' has shape {tuple(arr.shape)}, inconsistent with "
                             f"the attributes ({expl}); {_RERUN}")
        if st.complete:
            have, total = _stored_chunks(st.target, name), arr.nchunks
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
    """

    def __init__(self, target: StoreTarget, group: zarr.Group):
        self.target = target
        self.label = _label(target)
        self._group = group
        # write_empty_chunks is a runtime setting (not stored in the metadata): set it on every handle
        self._arrays: dict[str, zarr.Array] = {name: arr.with_config({"write_empty_chunks": True})
                                               for name, arr in group.arrays()}
        self.attrs: dict = dict(group.attrs.asdict())
        self.n_tokens = int(self.attrs["n_tokens"])
        self.chunk_tokens = int(self.attrs["chunk_tokens"])
        self.n_chunks = math.ceil(self.n_tokens / self.chunk_tokens)
        self.state_dtypes = {n: d for n, d in (self.attrs.get("dtypes") or {}).items() if n in HIDDEN_NAMES}

    @classmethod
    def create(cls, target: StoreTarget, specs: Mapping[str, ArraySpec], attrs: Mapping[str, Any],
               chunk_tokens: int, clevel: int = 1) -> StoreWriter:
        """Create a new, empty store (replacing whatever is at ``target``).

        Args:
            target: directory path or :func:`memory_store`.
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
        group = zarr.open_group(target if isinstance(target, zarr.storage.MemoryStore) else str(target),
                                mode="w", zarr_format=3, attributes=full)
        codecs = _codecs(clevel)
        for name, spec in specs.items():
            dims = DIMS[name]
            if dims[0] == "token" and spec.shape[0] != n_tokens:
                raise StoreError(f"array '{name}' has {spec.shape[0]} rows, expected n_tokens={n_tokens}")
            chunks = (max(1, chunk_tokens),) + tuple(max(1, s) for s in spec.shape[1:]) if dims[0] == "token" \
                else tuple(max(1, s) for s in spec.shape)
            zdtype = STATE_DTYPES.get(spec.dtype, spec.dtype) if name in HIDDEN_NAMES else spec.dtype
            group.create_array(name, shape=spec.shape, chunks=chunks, dtype=zdtype, compressors=codecs,
                               dimension_names=dims, fill_value=0)
        group.create_array(_MARKER, shape=(n_chunks,), chunks=(1,), dtype="int64", compressors=[Crc32cCodec()],
                           dimension_names=DIMS[_MARKER], fill_value=-1)
        return cls(target, group)

    @classmethod
    def reopen(cls, target: StoreTarget) -> StoreWriter | None:
        """The writer of an existing store at ``target``, or None when there is none or it is unreadable."""
        try:
            group = _open_group(target, "r+")
            attrs = group.attrs.asdict()
            if attrs.get("schema_version") != SCHEMA_VERSION or _MARKER not in group:
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

    def write_chunk(self, chunk: int, data: Mapping[str, np.ndarray], nonfinite: int | None = None) -> int:
        """Write all token-axis arrays of one whole chunk, then its completion marker.

        The arrays are written concurrently (one zarr call; the compressor runs on zarr's thread pool) and
        the marker only after all of them, so a marker always means "every array of this chunk is on disk".

        Args:
            chunk: chunk index.
            data: name -> rows of that chunk (exactly ``chunk_rows(chunk)`` rows); every token-axis array of
                the store must be present. States are cast to the stored dtype here.
            nonfinite: NaN/Inf count of the chunk's stored ``hidden``/``hidden_init`` when the caller
                counted it already (the dump counts while casting); None = count here.

        Returns:
            Number of non-finite values in the stored ``hidden``/``hidden_init`` rows.
        """
        rows = self.chunk_rows(chunk)
        n = rows.stop - rows.start
        counted = 0
        writes: list[tuple[zarr.Array, np.ndarray]] = []
        for name, arr in self._arrays.items():
            if name == _MARKER or DIMS.get(name, ("",))[0] != "token":
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
            writes.append((arr, x))

        async def write_all() -> None:
            await asyncio.gather(*(arr.async_array.setitem(rows, x) for arr, x in writes))

        sync(write_all())
        total = counted if nonfinite is None else int(nonfinite)
        self._arrays[_MARKER][chunk] = total
        return total

    def read(self, name: str) -> np.ndarray:
        """Read back a whole array already written (for :meth:`rewrite` hooks run before :meth:`finish`)."""
        out = np.asarray(self._arrays[name][...])
        return decode_states(out, self.state_dtypes.get(name)) if name in HIDDEN_NAMES else out

    def rewrite(self, name: str, values: np.ndarray) -> None:
        """Replace one token-axis array whole, chunk by chunk (whole aligned chunks only).

        Used by ``dump_split(finalize=...)`` for columns known only after every chunk is written (a text
        dump's ``difficulty`` = bin of the full-depth loss). Idempotent, so a killed rewrite is redone on resume.
        """
        arr = self._arrays[name]
        values = np.asarray(values, dtype=arr.dtype)
        if values.shape != arr.shape or DIMS.get(name, ("",))[0] != "token" or name in HIDDEN_NAMES:
            raise StoreError(f"store {self.label}: rewrite of '{name}' needs a non-state token array of shape "
                             f"{arr.shape}, got {values.shape}")
        for c in range(self.n_chunks):
            rows = self.chunk_rows(c)
            arr[rows] = values[rows]

    def write_small(self, name: str, value: np.ndarray) -> None:
        """Write a non-token array whole (``loop_group``)."""
        arr = self._arrays[name]
        arr[...] = np.asarray(value, dtype=arr.dtype)

    def finish(self, attrs: Mapping[str, Any] | None = None) -> TrajectoryStore:
        """Check every chunk is written, record ``nan_count`` (and ``attrs``), set ``complete`` and
        consolidate the metadata (so ``xarray.open_zarr`` opens it without a warning)."""
        marks = np.asarray(self._arrays[_MARKER][...])
        if (marks < 0).any():
            missing = int(np.flatnonzero(marks < 0)[0])
            raise StoreError(f"store {self.label}: chunk {missing} was never written; re-run `looptrace dump` to resume")
        update = dict(jsonable(dict(attrs or {})))
        update.update(nan_count=int(marks.sum()), complete=True)
        self._group.attrs.update(update)
        with warnings.catch_warnings():
            # zarr warns that consolidated metadata is not (yet) part of the v3 spec; xarray reads it.
            warnings.simplefilter("ignore")
            zarr.consolidate_metadata(self._store_like())
        return TrajectoryStore(_open_group(self.target, "r"), self.label)

    def _store_like(self):
        return self.target if isinstance(self.target, zarr.storage.MemoryStore) else str(self.target)


def remove_store(target: StoreTarget) -> None:
    """Delete a store (start over). Refuses to delete a directory that is not a Zarr store."""
    if isinstance(target, zarr.storage.MemoryStore):
        target._store_dict.clear()
        return
    p = Path(target)
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
    written to ``<path>.tmp`` and renamed, so a failure leaves no store that could be taken as valid.

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
    unknown = sorted(set(arrays) - set(DIMS) - {_MARKER})
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
    on_disk = not isinstance(path, zarr.storage.MemoryStore)
    if on_disk and Path(path).exists() and not (Path(path) / "zarr.json").is_file() and any(Path(path).iterdir()):
        raise StoreError(f"{path} exists and is not a trajectory store; remove it or choose another path")
    target: StoreTarget = Path(str(path) + ".tmp") if on_disk else path
    writer = StoreWriter.create(target, specs, attrs, chunk_tokens, clevel)
    writer.write_small("loop_group", arrays["loop_group"])
    for c in range(writer.n_chunks):
        rows = writer.chunk_rows(c)
        writer.write_chunk(c, {k: v[rows] for k, v in arrays.items() if DIMS[k][0] == "token"})
    writer.finish()
    if on_disk:
        remove_store(path)
        os.replace(target, path)
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
