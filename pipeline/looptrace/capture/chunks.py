"""The dump's chunk pipeline: batch rows cut into whole store chunks (:class:`ChunkAssembler`, reusing their
arrays: :class:`ChunkBuffers`), compressed and written by background threads or between batches
(:class:`BackgroundWriter`, :func:`encode_pool`, :func:`writer_threads`), and the allocator setting a dump runs with
(:func:`reuse_freed_memory`). Only whole, aligned chunks are ever written (SPEC §1: unaligned concurrent writes lose
rows); each chunk's bytes do not depend on the thread that encodes it (docs/dump.md, "What the capture costs")."""

from __future__ import annotations

import ctypes
import ctypes.util
import queue
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import Executor, ThreadPoolExecutor

import numpy as np
import torch

from looptrace.io.store.writer import StoreWriter
from looptrace.project import host_cores

#: Key of the per-row NaN/Inf count of the stored states that travels with a chunk's rows to the writer
#: (counted while casting, so the writer never scans the states again); not a store array.
NONFINITE = "_nonfinite"


#: glibc mallopt parameters (malloc.h): M_TRIM_THRESHOLD, M_MMAP_THRESHOLD.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_ALLOCATOR_TUNED = False


def reuse_freed_memory(mmap_threshold: int = 256 << 20) -> bool:
    """Let glibc keep large freed buffers for reuse instead of unmapping them (once per process).

    Why: a dump allocates and frees the same tens-of-MB buffers every batch and chunk (float32 states, their
    float16 cast, compressed chunks, the checksum codec's copy). glibc serves blocks above its mmap threshold
    (dynamic, at most 32 MiB) with a fresh mmap each time, so every page faults in again. Measured on the
    benchmark's 16k-token d_model-512 dump: 116k–120k minor faults and 0.9 s of system time, 6k–10k and
    0.5 s with this (13 % less CPU per chunk write). Freed memory stays in the process (up to ``mmap_threshold`` per
    block, the heap trimmed only beyond twice that), which suits a process that dumps batch after batch.

    Args:
        mmap_threshold: allocations below this many bytes come from the heap.

    Returns:
        Whether the setting was applied (False off glibc, e.g. macOS, where it is not needed).
    """
    global _ALLOCATOR_TUNED
    if _ALLOCATOR_TUNED:
        return True
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    ok = bool(mallopt(_M_MMAP_THRESHOLD, int(mmap_threshold))) and bool(mallopt(_M_TRIM_THRESHOLD, 2 * int(mmap_threshold)))
    _ALLOCATOR_TUNED = ok
    return ok

class BackgroundWriter:
    """Background threads that write whole chunks from a bounded queue (each chunk by one thread: chunks never
    overlap; a chunk's files, digest row and marker are its own objects, so chunks may be written concurrently).

    Args:
        open_writer: returns the store's writer; called first, in the first thread (the dump passes the writer
            the claims protocol has already opened, so it only hands it over).
        maxsize: chunks that may wait in the queue.
        threads: writer threads. One where the forward pass runs on the host's cores (each compressing thread
            takes a core from it); more where the model runs on an accelerator and the host's compression is
            what keeps up with it (:func:`writer_threads`). The stored bytes do not depend on it.
        encode_pool: when given, each chunk is encoded in the thread that queues it, its arrays spread over
            these threads (:meth:`StoreWriter.prepare_chunk`), and the background threads only write files: for a
            forward pass on the host's cores, which wait meanwhile, instead of a compressing thread preempting
            the forward pass's threads mid-GEMM (docs/dump.md).
    """

    def __init__(self, open_writer: Callable[[], StoreWriter], maxsize: int,
                 before_write: Callable[[], None] | None = None, threads: int = 1,
                 written: Callable[[Mapping[str, np.ndarray]], None] | None = None,
                 encode_pool: Executor | None = None):
        self.open_writer = open_writer
        self.encode_pool = encode_pool
        self.before_write = before_write
        self.written = written  # called with a chunk's arrays once they are on disk (they may be reused)
        self.writer: StoreWriter | None = None
        self.q: queue.Queue = queue.Queue(maxsize=maxsize)
        self.error: BaseException | None = None
        self._opened = threading.Event()
        self._beat = threading.Lock()  # the heartbeat (claims bookkeeping) is not thread-safe
        self.threads = [threading.Thread(target=self._run, args=(i,), name=f"looptrace-dump-writer-{i}", daemon=True)
                        for i in range(max(1, threads))]
        self.thread = self.threads[0]
        for th in self.threads:
            th.start()

    def _run(self, i: int = 0) -> None:
        if i == 0:
            try:
                self.writer = self.open_writer()
            except BaseException as exc:  # noqa: BLE001 - re-raised in the main thread
                self.error = exc
            finally:
                self._opened.set()
        else:
            self._opened.wait()
        while True:
            item = self.q.get()
            if item is None:
                return
            if self.error is None:
                try:
                    chunk, data, prepared = item
                    if self.before_write is not None:
                        with self._beat:
                            self.before_write()  # heartbeat + fencing of this process's claim
                    assert self.writer is not None  # opened above, else self.error is set
                    if prepared is None:
                        counts = data.pop(NONFINITE)
                        self.writer.write_chunk(chunk, data, nonfinite=int(counts.sum()))
                    else:
                        self.writer.write_chunk(chunk, prepared)
                    if self.written is not None:
                        self.written(data)
                except BaseException as exc:  # noqa: BLE001 - re-raised in the main thread
                    self.error = exc

    def put(self, chunk: int, data: dict[str, np.ndarray]) -> None:
        prepared = None
        if self.encode_pool is not None and self.error is None:
            self._opened.wait()
            if self.writer is not None:
                counts = data.pop(NONFINITE)
                prepared = self.writer.prepare_chunk(chunk, data, nonfinite=int(counts.sum()), pool=self.encode_pool)
        while True:
            if self.error is not None:
                raise self.error
            try:
                self.q.put((chunk, data, prepared), timeout=0.5)
                return
            except queue.Full:
                continue

    def stop(self) -> None:
        """Let the threads finish the chunks already queued, then end them."""
        for _ in self.threads:
            self.q.put(None)
        for th in self.threads:
            th.join()

    def close(self) -> StoreWriter:
        """Wait until every queued chunk is written; returns the writer (re-raises the thread's error)."""
        self.stop()
        if self.error is not None:
            raise self.error
        assert self.writer is not None
        return self.writer


_ENCODE_POOLS: dict[int, ThreadPoolExecutor] = {}



def encode_pool(device: torch.device) -> ThreadPoolExecutor | None:
    """Where a dump of a model on ``device`` compresses its chunks: None, in its background writer threads,
    or the returned pool, between batches in the dump's own thread.

    Between batches when the forward pass runs on every core the process has (CPU, torch's threads ≥ the cores):
    the chunk's arrays are spread over a pool of as many threads while the forward pass's threads wait. A
    compressing thread beside such a forward pass preempts one of its threads mid-GEMM and the others stall at
    their barrier: on the 2-vCPU host of docs/dump.md, 0.31 s of writer CPU cost the forward pass 0.45 s of wall.
    The pool is the process's, kept for its later dumps: a thread's malloc arena keeps its chunk-sized buffers,
    which a fresh thread would fault in page by page again. In the background otherwise — an accelerator, whose
    host cores are free (:func:`writer_threads`), or a CPU forward pass on fewer threads than cores, which leaves
    one for the writer.
    """
    threads = torch.get_num_threads()
    if device.type != "cpu" or threads < host_cores():
        return None
    if threads not in _ENCODE_POOLS:
        _ENCODE_POOLS[threads] = ThreadPoolExecutor(threads, thread_name_prefix="looptrace-dump-encode")
    return _ENCODE_POOLS[threads]


def writer_threads(device: torch.device) -> int:
    """Background writer threads for a model on ``device``: 1 on the CPU (the forward pass uses the cores), up to
    4 — half the host's cores — for an accelerator, whose forward pass outruns one compressing thread (a 1.4B
    bf16 model's states at ~0.7 GB/s of zstd per core)."""
    if device.type == "cpu":
        return 1
    return max(1, min(4, host_cores() // 2))

class ChunkAssembler:
    """Cuts the stream of batch rows into whole chunks and hands each not-yet-done chunk to ``sink``.

    Args:
        n_tokens: rows of the store; ``chunk_tokens``: rows per chunk (the last chunk may be shorter).
        done: [chunk] bool, chunks already written (skipped).
        start_token: the row the first batch added starts at.
        sink: ``sink(chunk, name -> rows)`` for every whole chunk not yet done.
    """

    def __init__(self, n_tokens: int, chunk_tokens: int, done: np.ndarray, start_token: int, sink,
                 buffers: ChunkBuffers | None = None):
        self.n_tokens, self.chunk_tokens, self.done, self.sink = n_tokens, chunk_tokens, done, sink
        self.pos = start_token
        self.parts: list[dict[str, np.ndarray]] = []
        self.buffers = buffers

    def add(self, rows: dict[str, np.ndarray]) -> None:
        n = len(rows["target"])
        off = 0
        while off < n:
            c = self.pos // self.chunk_tokens
            stop = min((c + 1) * self.chunk_tokens, self.n_tokens)
            take = min(n - off, stop - self.pos)
            if not self.done[c]:
                self.parts.append({k: v[off:off + take] for k, v in rows.items()})
            self.pos += take
            off += take
            if self.pos == stop:
                if not self.done[c]:
                    parts, self.parts = self.parts, []
                    chunk = parts[0] if len(parts) == 1 else {k: self._join([p[k] for p in parts])
                                                               for k in parts[0]}
                    # copy: a view into the batch arrays would keep whole batches alive in the queue
                    self.sink(c, {k: np.ascontiguousarray(v) for k, v in chunk.items()})
                self.parts = []

    def _join(self, parts: list[np.ndarray]) -> np.ndarray:
        if self.buffers is None:
            return np.concatenate(parts)
        out = self.buffers.take((sum(len(p) for p in parts), *parts[0].shape[1:]), parts[0].dtype)
        return np.concatenate(parts, out=out)


class ChunkBuffers:
    """Arrays of assembled chunks, handed back by the writer once written and reused for the next chunks.

    Why: a fresh array per chunk is zeroed page by page by the kernel on first touch — measured ~35 ms of system
    time per 4096-token d_model-512 chunk (36 MB), against ~6 ms to copy the parts into a reused one.

    Args:
        keep: free arrays kept per (shape, dtype) (the chunks that can be in flight at once).
    """

    def __init__(self, keep: int):
        self.keep = keep
        self._free: dict[tuple, list[np.ndarray]] = {}
        self._lent: dict[int, np.ndarray] = {}
        self._lock = threading.Lock()

    def take(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        key = (tuple(shape), np.dtype(dtype).str)
        with self._lock:
            free = self._free.get(key)
            a = free.pop() if free else np.empty(key[0], dtype=dtype)
            self._lent[id(a)] = a
        return a

    def give(self, data: Mapping[str, np.ndarray]) -> None:
        """Take back the arrays of a written chunk that came from here (others are left alone)."""
        with self._lock:
            for a in data.values():
                if self._lent.pop(id(a), None) is not None:
                    free = self._free.setdefault((a.shape, a.dtype.str), [])
                    if len(free) < self.keep:
                        free.append(a)
