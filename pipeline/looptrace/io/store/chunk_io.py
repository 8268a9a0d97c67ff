"""The bytes of a store's whole chunks, written fast without changing a byte: :class:`DirectChunk` encodes a
whole chunk with zarr's own codec objects (Blosc, crc32c) without zarr's codec pipeline, and
:func:`write_file_uncached` writes it past the page cache (``O_DIRECT``), atomically as zarr's local store does.
:class:`~looptrace.io.store.writer.StoreWriter` uses both where they apply and zarr otherwise (docs/dump.md,
"Profiled again"; tests/test_capture_cost.py compares the bytes)."""

from __future__ import annotations

import contextlib
import errno
import os
import sys
import threading
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import crc32c
import numcodecs.blosc
import numpy as np
import zarr
from zarr.codecs import BloscCodec, BytesCodec, Crc32cCodec
from zarr.core.buffer import default_buffer_prototype


class DirectChunk:
    """Encoder of one array's whole chunks with zarr's own codec objects, without zarr's codec pipeline.

    Only for the chain every store array uses (little-endian bytes → Blosc → crc32c, :func:`schema._codecs`) on a
    regular grid whose chunk spans every non-token axis: the stored object is ``blosc.encode(raw bytes)`` followed
    by the little-endian crc32c of those compressed bytes, exactly what zarr's pipeline writes for a whole chunk.
    """

    def __init__(self, arr: zarr.Array, blosc: BloscCodec):
        self._arr = arr
        self._blosc = blosc._blosc_codec  # zarr's configured numcodecs compressor (same typesize as zarr's)
        self._tail = (0,) * (len(arr.shape) - 1)

    @classmethod
    def of(cls, arr: zarr.Array) -> DirectChunk | None:
        """The direct encoder of ``arr``, or None when its codec chain or grid is not the one it reproduces."""
        codecs: tuple[Any, ...] = tuple(getattr(arr.metadata, "codecs", ()))
        if (len(codecs) != 3 or not isinstance(codecs[0], BytesCodec) or not isinstance(codecs[1], BloscCodec)
                or not isinstance(codecs[2], Crc32cCodec) or not hasattr(codecs[1], "_blosc_codec")
                or np.dtype(arr.dtype).byteorder == ">" or sys.byteorder != "little"
                or (codecs[0].endian is not None and codecs[0].endian.value != "little")
                or tuple(arr.chunks[1:]) != tuple(arr.shape[1:])):
            return None
        return cls(arr, codecs[1])

    def key(self, chunk: int) -> str:
        return self._arr.metadata.encode_chunk_key((chunk, *self._tail))

    def encode(self, x: np.ndarray) -> Encoded:
        """The stored object of one whole chunk ``x`` (C order, the array's dtype)."""
        raw = np.ascontiguousarray(x).reshape(-1).view(np.uint8)  # what zarr's BytesCodec hands to Blosc
        packed = self._blosc.encode(raw)  # the GIL is released while compressing
        crc = np.uint32(crc32c.crc32c(packed)).tobytes()  # zarr's Crc32cCodec: crc32c, appended little-endian
        return Encoded(packed, crc)


@dataclass(frozen=True)
class Encoded:
    """A whole chunk's stored object, ``packed + crc``, kept in its two parts: the uncached write copies them into
    its aligned buffer anyway, so joining them first (a copy of the whole chunk) is left to zarr's path."""

    packed: bytes
    crc: bytes

    def __len__(self) -> int:
        return len(self.packed) + len(self.crc)

    def buffer(self) -> Any:
        """As one zarr buffer (for ``StorePath.set``)."""
        return default_buffer_prototype().buffer.from_bytes(bytes(self.packed) + self.crc)


# Blosc's own threads store a chunk's blocks in the order they finish, so one chunk compressed twice from the main
# thread (where numcodecs lets Blosc use its threads) could give different bytes: measured 7 distinct outputs in 20
# runs of one 64 MB float16 chunk at 2 threads. zarr compresses in worker threads, where numcodecs already uses one
# thread; this makes the main thread do the same, so the same states always give the same stored bytes (SPEC §1).
numcodecs.blosc.use_threads = False

#: O_DIRECT wants the buffer's address, the file offset and the length aligned to the device's logical block
#: (512 B or 4 KiB); 4 KiB suits both.
_ALIGN = 4096
#: Whether whole chunks may be written with O_DIRECT at all (Linux and a few others; not macOS or Windows).
UNCACHED_OK = hasattr(os, "O_DIRECT")
#: What a file system that does not do O_DIRECT answers (tmpfs before Linux 6.6, overlayfs, some FUSE mounts).
_REFUSED = (errno.EINVAL, errno.EOPNOTSUPP)
_scratch: list[np.ndarray] = []  # free aligned buffers, kept for the process's later writes
_scratch_lock = threading.Lock()


@contextlib.contextmanager
def _aligned(n: int) -> Iterator[np.ndarray]:
    """A reusable ``_ALIGN``-aligned byte buffer of at least ``n`` bytes, lent for the ``with`` block (one per
    concurrent writer; kept for the process's later writes, so its pages are faulted in once)."""
    with _scratch_lock:
        fits = [i for i, b in enumerate(_scratch) if len(b) >= n]
        buf = _scratch.pop(fits[0]) if fits else None
        if buf is None and _scratch:
            _scratch.pop(0)  # too small for this chunk: replaced by a larger one
    if buf is None:
        raw = np.empty(n + _ALIGN, dtype=np.uint8)
        off = (-raw.ctypes.data) % _ALIGN
        buf = raw[off:off + n]
    try:
        yield buf
    finally:
        with _scratch_lock:
            _scratch.append(buf)


def write_file_uncached(path: Path, parts: Sequence[bytes]) -> bool:
    """Write the concatenated ``parts`` to the file ``path`` past the page cache (``O_DIRECT``), atomically as
    zarr's local store does (a ``.<uuid>.partial`` file in the same directory, renamed over ``path``).

    Why: a buffered write copies every byte into page-cache pages, CPU that a dump on the host's cores takes from
    the forward pass. On the 2-vCPU VM of docs/dump.md fresh page-cache pages cost ~2 ms of kernel
    time per MB (the hypervisor faults them in): 0.31 s per 150 MB dump, against ~0 for O_DIRECT, whose device
    writes ran at 1.2 GB/s there. The parts are copied into an aligned buffer; its aligned head goes through
    O_DIRECT, the last ``len % 4096`` bytes through a buffered write.

    Returns:
        False, with nothing left behind, when the file system refuses O_DIRECT (``EINVAL`` or ``EOPNOTSUPP``:
        :data:`_REFUSED`); True once ``path`` holds the bytes.
    """
    n = sum(len(p) for p in parts)
    head = n - n % _ALIGN
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{uuid.uuid4().hex}.partial")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o666)
    except OSError as exc:
        if exc.errno in _REFUSED:
            return False
        raise
    try:
        with _aligned(max(n, 1)) as buf:
            at = 0
            for p in parts:
                buf[at:at + len(p)] = np.frombuffer(p, dtype=np.uint8)
                at += len(p)
            view = buf[:n].data
            done = 0
            try:
                while done < head:
                    wrote = os.write(fd, view[done:head])
                    done += wrote
                    if wrote % _ALIGN:  # a short, unaligned write: the rest goes through the page cache
                        break
            except OSError as exc:
                if exc.errno not in _REFUSED or done:
                    raise
                os.close(fd)
                fd = -1
                tmp.unlink(missing_ok=True)
                return False
            finally:
                if fd >= 0:
                    os.close(fd)
            if done < n:
                with open(tmp, "r+b") as f:
                    f.seek(done)
                    f.write(view[done:])
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return True
