"""The ``dump`` stage: run a looped model once and persist every scored token's trajectory (SPEC §1).

For each batch of sequences the model interface (:mod:`looptrace.models.interface`) returns the per-loop states;
each loop is read out on its own (never [batch, seq, loop, vocab] in memory), loop T first so that
``kl_final`` can be computed while streaming loops 1..T (:class:`looptrace.signals.logits.LoopStats`). Rows are the
scored positions (``targets != IGNORE``) in (sequence, position) order; ``sequence`` is the row index of
the input :class:`~looptrace.tasks.TaskBatch`.

Compute and I/O overlap: the forward pass fills whole token chunks, which a bounded background thread
compresses and writes (``dump.writer_queue`` chunks in flight), so the capture costs little beyond the
forward pass. Only whole, aligned chunks are ever written (SPEC §1: unaligned concurrent writes lose rows).

Resume, not restart: each chunk gets a completion marker after all of its arrays are written. A dump that
is killed at any point and run again with the same inputs finds the first unmarked chunk, maps it to the
sequence holding its first token (cumulative scored-token counts) and restarts the forward pass at the
batch that contains that sequence — batches keep the same boundaries as an uninterrupted run, so the
arrays end up bit-identical. ``complete`` is set only after everything is written. A store with a different
fingerprint (params, weights, model config, data, versions, source of the value-producing modules) is
deleted and dumped again — unless another live run is writing it, which is refused.

Writers and claims (:mod:`looptrace.io.claims`): every dump of a store first joins or creates the store's
*plan* (fingerprint + shard count) and claims its shard, in the sibling ``.<split>.zarr.claims``. One process
(1 of 1) or N cooperating processes (``shard=(i, N)``: ``--shard i/N`` or ``RANK``/``WORLD_SIZE``) each write
the chunks of a contiguous, chunk-aligned range (:func:`looptrace.io.claims.shard_range`) — the
:class:`~looptrace.io.store.writer.StoreWriter` refuses any other chunk, so no two writers ever share a chunk. A shard
starts at the batch holding its first token, with the batch boundaries of a 1-process run, so every array is
bit-identical to it. Whoever finds every chunk written finalises (one finaliser claim): the finalize hook,
``nan_count``, consolidated metadata, then ``complete``. A re-run over a complete store verifies its range
(checksums and chunk digests) and rewrites what is damaged.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
import hashlib
import importlib
import json
import os
import queue
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from looptrace.capture import contraction as _contraction
from looptrace.capture import layers as _layers
from looptrace.capture.contraction import ContractionConfig
from looptrace.capture.encode import encode_states_counted
from looptrace.capture.transfer import Transfer, resolve, take_rows, transfer_for
from looptrace.config import BaseConfig, ConfigError, InputError, to_dict
from looptrace.io.claims import LEASE_S, Coordinator, NullCoordinator, Superseded, shard_range
from looptrace.io.precision import resolve_state_dtype
from looptrace.io.store.location import (
    StoreTarget,
    assert_store_or_absent,
    is_remote,
    join_store,
    remove_debris,
    store_location,
)
from looptrace.io.store.reader import TrajectoryStore, open_store
from looptrace.io.store.schema import DIMS, DTYPES, HIDDEN_DTYPES, SCHEMA_VERSION, STAT_NAMES, StoreError
from looptrace.io.store.writer import ArraySpec, StoreWriter
from looptrace.models.adapters.loading import AdapterConfig
from looptrace.models.interface import LoopedModelAdapter, LoopedTransformerAdapter
from looptrace.project import versions
from looptrace.signals.logits import LoopStats
from looptrace.tasks import IGNORE, SPLITS, Task, TaskBatch
from looptrace.tasks.base import prefix_keys, shared_prefixes, split_overlap
from looptrace.tasks.text import TextConfig, loss_bins_finalizer, text_attrs, text_dataset


@dataclass(frozen=True)
class DumpConfig:
    """``dump`` section of params.yaml.

    Attributes:
        sequences: split -> number of sequences to dump (data seeds come from the checkpoint).
        batch_size: sequences per forward pass.
        chunk_tokens: rows per store chunk along ``token`` (the unit of writing, resuming and streaming reads).
        hidden_dtype: stored dtype of ``hidden``/``hidden_init``: ``float16``, ``float32``, ``bfloat16`` (kept as
            its uint16 bits) or ``auto`` (bfloat16 for bf16 models, else float16; :mod:`looptrace.io.precision`).
            A finite state beyond float16's range is an error, never a silent inf.
        full_logits_max_vocab: store full ``logits`` when vocab ≤ this, else ``topk_ids``/``topk_logits``
            (the statistics are exact either way: computed from the full logits at dump time).
        topk: k of the top-k logits (capped at the vocabulary size).
        writer_queue: whole chunks that may wait for the background writer (bounds memory).
        allow_nan: accept NaN/Inf in the stored states (they are counted in ``nan_count`` either way);
            when false a dump that produced any fails after writing, and readers refuse the store.
        clevel: zstd compression level (Blosc, byte shuffle).
        adapter: a real checkpoint to dump instead of a trained looptrace model (``looptrace.models.adapters``;
            the run name is ``adapter.name``); null = the default pipeline's checkpoints.
        text: the corpus of an adapter dump (:class:`looptrace.tasks.text.TextConfig`); required with ``adapter``.
        claim_lease_s: a writer's claim held by a process on *another host* counts as dead after this many
            seconds without a heartbeat (same host: as soon as its pid is gone); not fingerprinted.
        allow_prefix_overlap: write a test store even when some of its scored tokens have a context (the prefix
            they condition on, :meth:`looptrace.tasks.Task.context_split`) that is also scored in fit or val;
            false (default) refuses it (:func:`check_prefix_overlap`). The measured overlap is recorded in every
            store's ``prefix_overlap`` attribute either way.
        contraction: also store the loop map's local contraction and FTLE per (token, loop) (SPEC §2b,
            :mod:`looptrace.capture.contraction`; JVPs through the model's loop step, 25–100× the cost of a plain
            dump on the toy models: docs/dump.md); null (default) = off.
        layers: also store the outputs of these layers of the looped block at every loop, ``layer_hidden``
            [token, loop, layer, d_model] in the states' dtype (:mod:`looptrace.capture.layers`; its size is
            printed before writing); empty (default) = none.
    """

    sequences: dict[str, int] = field(default_factory=lambda: {"fit": 1024, "val": 512, "test": 512})
    batch_size: int = 128
    chunk_tokens: int = 4096
    hidden_dtype: str = "float16"
    full_logits_max_vocab: int = 256
    topk: int = 16
    writer_queue: int = 2
    allow_nan: bool = False
    clevel: int = 1
    adapter: AdapterConfig | None = None
    text: TextConfig | None = None
    claim_lease_s: float = LEASE_S
    allow_prefix_overlap: bool = False
    contraction: ContractionConfig | None = None
    layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        bad = sorted(set(self.sequences) - set(SPLITS))
        if bad:
            raise ConfigError(f"dump.sequences: unknown split '{bad[0]}' (splits: {', '.join(SPLITS)})")
        if any(int(n) < 1 for n in self.sequences.values()):
            raise ConfigError("dump.sequences: every split needs at least 1 sequence")
        for name in ("batch_size", "chunk_tokens", "topk", "writer_queue"):
            if getattr(self, name) < 1:
                raise ConfigError(f"dump.{name} must be >= 1, got {getattr(self, name)}")
        if self.hidden_dtype not in (*HIDDEN_DTYPES, "auto"):
            raise ConfigError(f"dump.hidden_dtype must be one of {', '.join(HIDDEN_DTYPES)}, auto; "
                              f"got {self.hidden_dtype!r}")
        if self.adapter is not None and self.text is None:
            raise ConfigError("dump.adapter needs dump.text (the corpus to run the checkpoint on)")
        if not 0 <= self.clevel <= 9:
            raise ConfigError(f"dump.clevel must be in 0..9, got {self.clevel}")
        lease = self.claim_lease_s
        if isinstance(lease, bool) or not isinstance(lease, int | float) or not lease > 0:
            raise ConfigError(f"dump.claim_lease_s must be a number of seconds > 0, got {lease!r}")


#: Key of the per-row NaN/Inf count of the stored states that travels with a chunk's rows to the writer
#: (counted while casting, so the writer never scans the states again); not a store array.
NONFINITE = "_nonfinite"

# Parameters that change how fast, not what, is written: left out of the resume fingerprint.
_NOT_FINGERPRINTED = ("writer_queue", "sequences", "claim_lease_s")


def _params_attr(cfg: DumpConfig) -> dict[str, Any]:
    """The ``params`` store attribute: the resolved section, without the opt-in ``contraction`` / ``layers`` while
    they are off (so a default store's attributes are those it had before the options existed)."""
    params = to_dict(cfg)
    if cfg.contraction is None:
        params.pop("contraction")
    if not cfg.layers:
        params.pop("layers")
    return params


def _data_hash(data: TaskBatch) -> str:
    h = hashlib.sha256()
    for name in ("tokens", "targets", "difficulty", "token_type"):
        a = np.ascontiguousarray(getattr(data, name), dtype=np.int64)
        h.update(name.encode() + str(a.shape).encode() + a.tobytes())
    return h.hexdigest()


#: Modules whose code decides the stored values. Their source is part of the fingerprint: DVC re-runs the stage
#: when one changes, and the store it keeps (``persist``) must then be dumped again, not returned as complete; a
#: resume likewise never mixes chunks written by two versions of the code.
VALUE_MODULES = ("looptrace.capture.dump", "looptrace.capture.encode", "looptrace.signals.logits",
                 "looptrace.signals.names", "looptrace.io.precision", "looptrace.io.store.schema",
                 "looptrace.io.store.writer",
                 "looptrace.models.interface", "looptrace.models.looped", "looptrace.capture.contraction",
                 "looptrace.capture.layers")


def _code_hash(*extra_modules: str) -> str:
    """sha256 of the source of :data:`VALUE_MODULES` and ``extra_modules`` (the adapter's class and the looptrace
    classes it derives from, a finalizer's)."""
    h = hashlib.sha256()
    for name in sorted({*VALUE_MODULES, *extra_modules}):
        module = sys.modules.get(name) or importlib.import_module(name)
        source = getattr(module, "__file__", None)
        h.update(name.encode() + b"\0" + (Path(source).read_bytes() if source else b""))
    return h.hexdigest()


def weights_hash(adapter: LoopedModelAdapter) -> str:
    """What identifies the model's values in the fingerprint.

    For looptrace's own models: sha256 of the weights (names, dtypes, shapes, bytes), not of ``model.pt``,
    whose bytes also hold wall-clock fields (``train_seconds``): identical weights retrained give the same
    fingerprint. For other adapters: ``info.checkpoint_hash`` (a hash of the weight files only).
    """
    model = getattr(adapter, "model", None)
    if not isinstance(adapter, LoopedTransformerAdapter) or not isinstance(model, torch.nn.Module):
        return adapter.info.checkpoint_hash
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        t = t.detach().to("cpu").contiguous()
        h.update(f"{name}\0{t.dtype}\0{tuple(t.shape)}\0".encode())
        # the array's buffer, not a bytes copy of it (same digest; a 1.4B model's weights are 2.8 GB)
        h.update(t.view(torch.uint8).numpy().data if t.numel() else b"")
    return h.hexdigest()


def _fingerprint(adapter: LoopedModelAdapter, data: TaskBatch, cfg: DumpConfig, attrs: Mapping,
                 code: str) -> str:
    info = adapter.info
    params = {k: v for k, v in to_dict(cfg).items() if k not in _NOT_FINGERPRINTED}
    blob = json.dumps({"schema": SCHEMA_VERSION, "params": params, "name": info.name, "config": info.config,
                       "weights": weights_hash(adapter), "data": _data_hash(data), "code": code,
                       "attrs": attrs}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


#: glibc mallopt parameters (malloc.h): M_TRIM_THRESHOLD, M_MMAP_THRESHOLD.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_ALLOCATOR_TUNED = False


def bare_forward(adapter: LoopedModelAdapter, batches: Sequence[torch.Tensor]) -> None:
    """The model's own work that a dump captures, with nothing captured: the states of every batch and the
    readout at every loop (the baseline of the capture's cost in benchmarks/dump.py, dump_hf.py and gpu.py).

    Args:
        adapter: the model.
        batches: [batch, seq] int64 token ids each, on the model's device.
    """
    with torch.inference_mode():
        for ids in batches:
            st = adapter.states(ids)
            for t in range(adapter.info.n_loops):
                adapter.readout(st.hidden[:, :, t], t)


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


def _say(msg: str) -> None:
    tqdm.write(msg, file=sys.stderr)


class _BackgroundWriter:
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
            the forward pass's threads mid-GEMM (issue 28; docs/dump.md).
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


def host_cores() -> int:
    """The cores this process may run on (its CPU affinity where the OS tells it, else every core)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


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


def _layout(adapter: LoopedModelAdapter, n_tokens: int, cfg: DumpConfig) -> tuple[dict[str, ArraySpec], int | None]:
    info = adapter.info
    T, D, V = info.n_loops, info.d_model, info.vocab_size
    k = None if V <= cfg.full_logits_max_vocab else min(cfg.topk, V)
    sdt = state_dtype(adapter, cfg)
    specs = {"hidden": ArraySpec((n_tokens, T, D), sdt), "hidden_init": ArraySpec((n_tokens, D), sdt)}
    if k is None:
        specs["logits"] = ArraySpec((n_tokens, T, V), DTYPES["logits"])
    else:
        specs["topk_ids"] = ArraySpec((n_tokens, T, k), DTYPES["topk_ids"])
        specs["topk_logits"] = ArraySpec((n_tokens, T, k), DTYPES["topk_logits"])
    for s in STAT_NAMES:
        specs[s] = ArraySpec((n_tokens, T), DTYPES[s])
    if info.has_gate:
        specs["gate_logit"] = ArraySpec((n_tokens, T), DTYPES["gate_logit"])
    for f in ("target", "token_id", "sequence", "position", "difficulty", "token_type"):
        specs[f] = ArraySpec((n_tokens,), DTYPES[f])
    specs["loop_group"] = ArraySpec((T,), DTYPES["loop_group"])
    if cfg.contraction is not None:  # opt-in: a default store has none of these arrays
        _contraction.check_adapter(adapter)
        specs.update({c: ArraySpec((n_tokens, T), DTYPES[c]) for c in _contraction.CONTRACTION_ARRAYS})
    if cfg.layers:  # opt-in: the size is said before the store is created
        _layers.check_layers(adapter, cfg.layers)
        specs[_layers.LAYER_ARRAY] = ArraySpec((n_tokens, T, len(cfg.layers), D), sdt)
        _say(_layers.size_line(info.name, n_tokens, T, cfg.layers, D, sdt))
    return specs, k


def state_dtype(adapter: LoopedModelAdapter, cfg: DumpConfig) -> str:
    """The stored dtype of the states for this model (``auto`` resolved from ``info.extra['dtype']``)."""
    return resolve_state_dtype(cfg.hidden_dtype, adapter.info.extra.get("dtype"))


@torch.inference_mode()
def _capture(adapter: LoopedModelAdapter, data: TaskBatch, mask: np.ndarray, rows: slice,
             k: int | None, hidden_dtype: str, contraction: ContractionConfig | None = None,
             layers: tuple[int, ...] = (), tx: Transfer | None = None) -> dict[str, Any]:
    """Every token-axis array of one batch of sequences: name -> [n_scored, ...] numpy (``tx``: the device's
    arrays come back through it, possibly still being copied: :func:`looptrace.capture.transfer.resolve`)."""
    tx = tx or Transfer("cpu")  # (synchronous: tensor.cpu().numpy())
    info = adapter.info
    T = info.n_loops
    dev = adapter.device
    ids = torch.from_numpy(np.ascontiguousarray(data.tokens[rows], dtype=np.int64)).to(dev)
    keep = mask[rows]  # [B, S] scored positions
    all_scored = bool(keep.all())
    st = adapter.states(ids)
    if all_scored:  # a reshape instead of a gather
        sel = lambda x: x.reshape(-1, *x.shape[2:])  # noqa: E731 - [B, S, ...] -> [B*S, ...] row-major
    else:
        m = torch.from_numpy(keep).to(dev)
        sel = lambda x: x[m]  # noqa: E731
    where = f"dump of '{info.name}', sequences {rows.start}..{rows.stop - 1}"
    # range-checked cast to the stored representation before selecting (half the bytes to gather; float16
    # overflow is an error, bfloat16 is kept as bits), with each row's NaN/Inf count for the chunk marker
    out: dict[str, Any] = {}
    nonfinite = np.zeros(int(keep.sum()), dtype=np.int64)
    for name, x in (("hidden", st.hidden), ("hidden_init", st.hidden_init)):
        enc, bad = encode_states_counted(x.reshape(-1, *x.shape[2:]), hidden_dtype, f"{where}: '{name}'", tx.copy)
        out[name] = enc if all_scored else take_rows(enc, keep.reshape(-1))  # hidden [n, T, D], hidden_init [n, D]
        if bad is not None:
            nonfinite += bad if all_scored else bad[keep.reshape(-1)]
    if layers:
        out[_layers.LAYER_ARRAY], bad = _layers.capture_layer_states(adapter, ids, layers, sel, hidden_dtype, where)
        if bad is not None:
            nonfinite += bad
    out[NONFINITE] = nonfinite
    if info.has_gate:
        if st.gate_logits is None:
            raise InputError(f"adapter '{info.name}' declares a gate but returned no gate logits")
        out["gate_logit"] = tx.copy(sel(st.gate_logits.float()))
    if contraction is not None:
        out.update(_contraction.capture_arrays(adapter, st, contraction, rows.start or 0, sel))
    target = torch.from_numpy(data.targets[rows][keep].astype(np.int64)).to(dev)
    # Loop T first (kl_final needs p_T), then 1..T keeping only the previous loop (bounded memory).
    z_final = sel(adapter.readout(st.hidden[:, :, T - 1], T - 1)).float()  # [n, V]
    acc = LoopStats(z_final, target)
    per_loop: dict[str, list[torch.Tensor]] = {s: [] for s in STAT_NAMES}
    zs, ids_k = [], []
    for t in range(T):
        z = z_final if t == T - 1 else sel(adapter.readout(st.hidden[:, :, t], t)).float()
        for name, v in acc.update(z).items():
            per_loop[name].append(v)
        if k is None:
            zs.append(z)
        else:
            top = z.topk(k, dim=-1)
            zs.append(top.values)
            ids_k.append(top.indices.to(torch.int32))
    for name, vs in per_loop.items():
        out[name] = tx.copy(torch.stack(vs, dim=1))
    if k is None:
        out["logits"] = tx.copy(torch.stack(zs, dim=1))
    else:
        out["topk_logits"] = tx.copy(torch.stack(zs, dim=1))
        out["topk_ids"] = tx.copy(torch.stack(ids_k, dim=1))
    b_idx, p_idx = np.nonzero(keep)  # row-major: (sequence, position) order, matching hidden[m]
    out["target"] = data.targets[rows][keep].astype(np.int64)
    out["token_id"] = data.tokens[rows][keep].astype(np.int64)
    out["sequence"] = (b_idx + (rows.start or 0)).astype(np.int64)
    out["position"] = p_idx.astype(np.int64)
    out["difficulty"] = data.difficulty[rows][keep].astype(np.int64)
    out["token_type"] = data.token_type[rows][keep].astype(np.int64)
    return out


class _ChunkAssembler:
    """Cuts the stream of batch rows into whole chunks and hands each not-yet-done chunk to ``sink``.

    Args:
        n_tokens: rows of the store; ``chunk_tokens``: rows per chunk (the last chunk may be shorter).
        done: [chunk] bool, chunks already written (skipped).
        start_token: the row the first batch added starts at.
        sink: ``sink(chunk, name -> rows)`` for every whole chunk not yet done.
    """

    def __init__(self, n_tokens: int, chunk_tokens: int, done: np.ndarray, start_token: int, sink,
                 buffers: _ChunkBuffers | None = None):
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


class _ChunkBuffers:
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


def dump_split(adapter: LoopedModelAdapter, data: TaskBatch, path: StoreTarget, cfg: DumpConfig,
               attrs: Mapping[str, Any] | None = None, progress: bool = True,
               finalize: Callable[[StoreWriter], Mapping[str, Any] | None] | None = None,
               shard: tuple[int, int] = (0, 1)) -> TrajectoryStore:
    """Dump one split of one model to a trajectory store (resumable; one of N cooperating writers).

    Args:
        adapter: the model interface (states + per-loop readout).
        data: the sequences; ``tokens``/``targets``/``difficulty``/``token_type`` all [batch, seq];
            ``targets == IGNORE`` marks unscored positions. ``sequence`` in the store = row index here.
        path: ``<split>.zarr`` directory, fsspec URL (``s3://…``) or :func:`looptrace.io.store.location.memory_store`.
        cfg: the ``dump`` section.
        attrs: extra group attributes (split, task, regime, difficulty_name, difficulty_levels, token_types,
            seeds...); ``task``/``regime`` default to the adapter's ``info.extra``.
        progress: show a tqdm bar (silent when not a terminal anyway).
        finalize: called with the writer after every chunk is written and before the store is marked
            complete; may :meth:`~looptrace.io.store.writer.StoreWriter.rewrite` token columns and returns extra
            attributes (or None). Runs again on resume, so it must be idempotent.
        shard: ``(i, N)``: write shard ``i`` of ``N`` (a contiguous range of whole chunks) of the store that
            N processes dump together; every process must be given the same other arguments.

    Returns:
        The completed store, opened (``allow_nan`` as configured). With ``N > 1`` a process whose shard is
        done while others still write returns the store opened with ``allow_incomplete`` (``complete`` false).

    Raises:
        StoreError: the dump produced NaN/Inf states and ``cfg.allow_nan`` is false (the store is written
            and records ``nan_count``), the target path is not a store, or the disk is full.
        looptrace.io.claims.ClaimError: another live process writes this store with other inputs, another
            shard plan, or this very shard (one line naming it: pid, host, start time).
    """
    info = adapter.info
    reuse_freed_memory()
    if data.tokens.ndim != 2 or data.targets.shape != data.tokens.shape:
        raise ValueError(f"data: tokens and targets must both be [batch, seq]; got {data.tokens.shape} and "
                         f"{data.targets.shape}")
    mask = np.asarray(data.targets != IGNORE)
    counts = mask.sum(axis=1)
    cum = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)  # scored tokens before each sequence
    n_tokens = int(cum[-1])
    specs, k = _layout(adapter, n_tokens, cfg)
    extra = dict(info.extra)
    user = dict(attrs or {})
    base_attrs: dict[str, Any] = {
        "model": dataclasses.asdict(info), "n_tokens": n_tokens, "n_loops": info.n_loops,
        "d_model": info.d_model, "vocab_size": info.vocab_size, "n_sequences": len(data),
        "task": extra.get("task"), "regime": extra.get("regime"), "split": None,
        "difficulty_name": "difficulty", "difficulty_levels": [], "token_types": [],
        "seeds": {kk: extra[kk] for kk in ("seed", "data_seeds") if kk in extra},
        "params": _params_attr(cfg), "topk": k, "logits_mode": "full" if k is None else "topk",
        "dtypes": {name: spec.dtype for name, spec in specs.items()},
        "versions": versions(),
    }
    base_attrs.update(user)
    bases = [c.__module__ for c in type(adapter).__mro__ if c.__module__.startswith("looptrace.")]  # an adapter's base
    code = _code_hash(type(adapter).__module__, *bases, *([finalize.__module__] if finalize is not None else []))
    base_attrs["code_hash"] = code
    fp = _fingerprint(adapter, data, cfg, {**user, "versions": base_attrs["versions"]}, code)
    base_attrs["fingerprint"] = fp
    loc = store_location(path)
    label = "<memory>" if loc is None else loc
    assert_store_or_absent(path)  # never claim (or touch) a directory of someone else's files
    n_chunks = -(-n_tokens // cfg.chunk_tokens)
    own = shard_range(n_chunks, *shard)
    coord = (NullCoordinator(fp, shard, label) if loc is None
             else Coordinator(loc, fp, shard, cfg.claim_lease_s, label=f"store {label}"))

    def create_layout() -> StoreWriter:
        new = StoreWriter.create(path, specs, base_attrs, cfg.chunk_tokens, cfg.clevel)
        new.write_small("loop_group", np.asarray(info.loop_group))
        return new

    left_incomplete: int | None = None  # the plan under which this process returned with peers still writing
    try:
        joined = _join_or_plan(coord, path, label, fp, own, create_layout)
        if joined is None:  # complete, verified, nothing to do
            return _finished(path, label, cfg)
        plan_k, kind, claim, damage = joined
        writer = StoreWriter.reopen(path)
        if writer is None or writer.attrs.get("fingerprint") != fp:
            raise StoreError(f"store {label}: its layout vanished while joining the dump; re-run `looptrace dump`")
        writer.own = own
        if claim is not None:
            _write_range(adapter, data, cfg, writer, own, kind, damage, cum, mask, k_top=k,
                         hidden_dtype=specs["hidden"].dtype, label=label, progress=progress, coord=coord)
        # verify: completion is read from the data (every marker and chunk object present), not from the claims
        missing = writer.missing_chunks(range(writer.n_chunks))
        if claim is not None:
            if set(missing) & set(own):
                raise StoreError(f"store {label}: chunk {sorted(set(missing) & set(own))[0]} of this process's range "
                                 "failed verification after writing; re-run `looptrace dump`")
            coord.finish(claim, chunks=[own.start, own.stop])
        if missing:
            left_incomplete = plan_k
            return open_store(path, allow_nan=True, allow_incomplete=True)
        fin = coord.claim_final(plan_k)
        if fin is None:  # another process finalises (or has)
            st = open_store(path, allow_nan=True, allow_incomplete=True)
            if not st.complete:
                left_incomplete = plan_k
                return st
            # our last claim write (`finish`: temp file + os.replace) can land after the finaliser tidied the
            # claims, re-creating our record beside a complete store: tidy what is left of this plan
            coord.remove_plans_upto(plan_k)
            return _finished(path, label, cfg)
        if coord.n > 1:  # other processes wrote chunks: read the store back (one process: ours is current)
            writer = StoreWriter.reopen(path)
        assert writer is not None  # every shard is done: the store exists
        if not writer.attrs.get("complete") or not writer.metadata_ok():
            remove_debris(path)  # every shard is done: no live writer can own a temp file now
            # a kill inside create_layout (after the arrays, before this one's only chunk) leaves it unwritten, and
            # only token chunks are markers: the finaliser (one process) writes it again, identical bytes
            writer.write_small("loop_group", np.asarray(info.loop_group))
            # columns known only once every chunk is written (a text dump's loss-bin difficulty), before `complete`
            writer.finish(finalize(writer) if finalize is not None else None)
        coord.finish(fin)
        coord.remove_plans_upto(plan_k)
        return _finished(path, label, cfg)
    finally:
        coord.release_all()
        if left_incomplete is not None:
            # releasing our records (the planner's plan record included) is a write (temp file + replace) that
            # can land after a peer's finaliser tidied the claims, re-creating a record beside the complete
            # store (seen in CI as a left-over claims directory). The finaliser marks the store complete before
            # it lists the claims, so a store found complete after our last write means it is ours to tidy.
            again = StoreWriter.reopen(path)
            if again is not None and again.attrs.get("complete") and again.attrs.get("fingerprint") == fp:
                coord.remove_plans_upto(left_incomplete)


def _join_or_plan(coord: Coordinator, path: StoreTarget, label: str, fp: str, own: range,
                  create_layout: Callable[[], StoreWriter]) -> tuple[int, str, str | None, dict] | None:
    """Join the store's live plan, or make the next one (the claims protocol, :mod:`looptrace.io.claims`).

    Returns None when the store is complete with these inputs and this process's range verified (nothing to
    write), else ``(plan, kind, shard claim or None if already done, {chunk: damage} found before planning)``.
    """
    k: int | None
    damage: dict[int, str]
    while True:
        plan = coord.current_plan()
        if plan is not None and plan.active:
            coord.refuse_incompatible(plan)
            if plan.kind == "tidy":
                coord.wait_inactive(plan)
                continue
            ready = coord.wait_ready(plan)
            if ready is None:
                continue
            k, kind, damage = ready.gen, ready.kind, {}
        else:
            writer = StoreWriter.reopen(path)
            same = writer is not None and writer.attrs.get("fingerprint") == fp
            damage = {}
            if same and writer is not None and writer.attrs.get("complete"):  # (same implies writer)
                damage = writer.damaged_chunks(own)
                metadata = writer.metadata_ok()
                if not damage and metadata and not coord.debris() and not _has_debris(path):
                    return None
                kind = "repair" if damage or not metadata else "tidy"
                if damage:
                    first = next(iter(damage.items()))
                    _say(f"{label}: {len(damage)} damaged chunk(s) (chunk {first[0]}: {first[1]}); rewriting them")
                elif not metadata:
                    _say(f"{label}: complete but its consolidated metadata is missing or stale; finalising again")
            elif same:
                kind = "resume"
            else:
                kind = "layout"
            if (kind == "resume" and plan is not None and plan.ready and plan.fingerprint == fp
                    and plan.n_shards == coord.n and plan.kind != "tidy"):
                k = plan.gen  # the inactive current plan: take over its (dead) claims
                kind = plan.kind if plan.kind == "repair" else "resume"
            else:
                k = coord.new_plan(kind)
                if k is None:
                    continue  # another process made that plan first: look again
                if kind == "layout":
                    if writer is not None:
                        _say(f"{label}: existing store was dumped with different parameters, checkpoint, data or "
                             "code; starting over")
                    elif _has_anything(path):
                        _say(f"{label}: existing store is unreadable or from another schema; starting over")
                    create_layout()
                elif kind == "repair":
                    assert writer is not None  # repair: same store
                    writer.set_incomplete()
                remove_debris(path)  # nothing under an older plan is live: no temp file is being written
                if kind == "tidy":
                    coord.finish(f"plan@{k}.json")
                    coord.remove_plans_upto(k)
                    return None
                coord.set_ready()
        try:
            claim = coord.claim_shard(k)
        except Superseded:
            continue
        return k, kind, claim, damage


def _has_debris(path: StoreTarget) -> bool:
    loc = store_location(path)
    if loc is None or is_remote(path) or not Path(loc).is_dir():
        return False
    return any(True for _ in Path(loc).rglob("*.partial"))


def _has_anything(path: StoreTarget) -> bool:
    loc = store_location(path)
    if loc is None:
        return bool(_memory_keys(path))
    return not is_remote(path) and Path(loc).exists()


def _write_range(adapter, data: TaskBatch, cfg: DumpConfig, writer: StoreWriter, own: range, kind: str,
                 damage: dict, cum: np.ndarray, mask: np.ndarray, k_top: int | None, hidden_dtype: str,
                 label: str, progress: bool, coord: Coordinator) -> None:
    """Compute and write every chunk of ``own`` that is not written yet (the batches covering them only)."""
    if kind == "repair":
        damage = damage or writer.damaged_chunks(own)
        if damage:
            writer.reset_chunks(damage)
    done = writer.done_chunks()
    outside = np.ones(writer.n_chunks, dtype=bool)
    outside[own.start:own.stop] = False
    done |= outside  # another shard's chunks: never written here
    n_tokens, ct = writer.n_tokens, cfg.chunk_tokens
    todo = np.flatnonzero(~done)
    if todo.size:
        if kind == "resume" and done[own.start:own.stop].any():
            _say(f"{label}: resuming ({int(done[own.start:own.stop].sum())} of {len(own)} chunks"
                 f"{'' if coord.n == 1 else f' of shard {coord.i}/{coord.n}'} already written)")
        first, last = int(todo[0]), int(todo[-1])
        # the sequence holding the chunk's first token, then the batch holding that sequence: batches keep
        # the boundaries of an uninterrupted 1-process run, so the numbers are bit-identical
        s0 = int(np.searchsorted(cum, first * ct, side="right") - 1)
        b0 = s0 // cfg.batch_size
        end_token = min((last + 1) * ct, n_tokens)
        s1 = int(np.searchsorted(cum, end_token - 1, side="right") - 1)  # sequence holding the last token
        b1 = s1 // cfg.batch_size
        threads = writer_threads(torch.device(adapter.device))
        queued = max(cfg.writer_queue, threads)
        buffers = _ChunkBuffers(keep=queued + threads + 1)
        pool = encode_pool(torch.device(adapter.device))
        bg = _BackgroundWriter(lambda: writer, queued, before_write=coord.beat, threads=threads, written=buffers.give,
                               encode_pool=pool)
        asm = _ChunkAssembler(n_tokens, ct, done, int(cum[b0 * cfg.batch_size]), bg.put, buffers)
        total = int(cum[min((b1 + 1) * cfg.batch_size, len(data))] - cum[b0 * cfg.batch_size])
        bar = tqdm(total=total, unit="tok", desc=f"dump {label}", disable=None if progress else True, leave=False)
        # on a device, batch b's host copies are resolved after batch b + 1 is captured (capture/transfer.py)
        tx = transfer_for(adapter.device)
        pending: list[dict] = []
        try:
            for b in range(b0, b1 + 1):
                rows = slice(b * cfg.batch_size, min((b + 1) * cfg.batch_size, len(data)))
                lo, hi = int(cum[rows.start]), int(cum[rows.stop])
                if hi == lo:
                    continue
                chunks = range(lo // ct, (hi - 1) // ct + 1)
                if all(done[c] for c in chunks):  # nothing left to write in this batch
                    while pending:
                        asm.add(resolve(pending.pop(0)))
                    asm.pos = hi
                else:
                    pending.append(_capture(adapter, data, mask, rows, k_top, hidden_dtype, cfg.contraction,
                                            cfg.layers, tx))
                    while len(pending) > int(tx.asynchronous):
                        asm.add(resolve(pending.pop(0)))
                bar.update(hi - lo)
            while pending:
                asm.add(resolve(pending.pop(0)))
            tx.settle()
        except BaseException:
            # let the writer finish the chunks already queued (their markers keep them), then stop
            bg.stop()
            raise
        finally:
            bar.close()
        bg.close()


def _memory_keys(store) -> list:
    return list(getattr(store, "_store_dict", {}) or [])


def _finished(path: StoreTarget, label: str, cfg: DumpConfig) -> TrajectoryStore:
    st = open_store(path, allow_nan=True)
    nan = int(st.attrs.get("nan_count") or 0)
    if nan and not cfg.allow_nan:
        raise StoreError(f"store {label}: {nan} NaN/Inf values in 'hidden'/'hidden_init' "
                         f"(dtype {cfg.hidden_dtype}) produced by the model itself (float16 overflow is refused "
                         "before writing); set dump.allow_nan: true to keep them")
    return st


def _out_dir(out_dir: Path | str) -> Path | str:
    """A model's output root: a local directory (created) or a URL prefix (object stores have no directories)."""
    loc = store_location(out_dir)
    assert loc is not None  # a path or URL, not a memory store
    if is_remote(out_dir):
        return loc
    out = Path(loc)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # a file in the way, no permission, a full disk
        raise StoreError(f"cannot create the output directory {out} ({exc.strerror or type(exc).__name__}); "
                         "choose another --out") from None
    return out


class PrefixOverlapError(InputError):
    """The test split shares scored contexts with fit or val and ``dump.allow_prefix_overlap`` is false."""


def check_prefix_overlap(report: Mapping[str, Any], allow: bool, name: str) -> None:
    """Refuse a test store that shares a scored prefix with fit or val (SPEC §6), unless ``allow``.

    Args:
        report: :func:`looptrace.tasks.base.shared_prefixes` of the splits being dumped together.
        allow: ``dump.allow_prefix_overlap``.
        name: the model / run name (for the message).

    Raises:
        PrefixOverlapError: one line naming the split, the count and the parameter that overrides it.
    """
    shared = report.get("shared_with", {}).get("test", {})
    n = sum(int(v) for k, v in shared.items() if k in ("fit", "val"))
    if n and not allow:
        total = int(report.get("n_scored", {}).get("test", 0))
        where = ", ".join(f"{k} {int(v)}" for k, v in shared.items() if k in ("fit", "val"))
        raise PrefixOverlapError(
            f"dump of '{name}': split 'test' has {n} of {total} scored tokens whose prefix is also scored in fit or "
            f"val ({where}); the test store would repeat their trajectories; set dump.allow_prefix_overlap: true "
            "to write it anyway")


def check_training_split(spec: Mapping[str, Any] | None, allow: bool, name: str) -> None:
    """Refuse a checkpoint whose training data was split by rows (its task spec has no ``split_rule: context``).

    Such a model was trained on every prefix of its fit rows, most short ones also test's (SPEC §6), so its test
    trajectories are not held out whatever the dump's own splits are. Checkpoints written before token-level
    splits have no ``split_rule`` and count as ``sequence``. No task spec (an external model): nothing to check.

    Raises:
        PrefixOverlapError: one line naming the checkpoint, the rule and ``dump.allow_prefix_overlap``.
    """
    if not isinstance(spec, Mapping):
        return
    rule = spec.get("split_rule", "sequence")
    if rule != "context" and not allow:
        raise PrefixOverlapError(
            f"dump of '{name}': the checkpoint was trained on split_rule '{rule}' data (rows split by content, "
            "short prefixes shared with test); retrain it, or set dump.allow_prefix_overlap: true to dump it anyway")


def overlap_line(report: Mapping[str, Any]) -> str:
    """One line for the log: scored tokens of test and val whose context is scored in another split."""
    n, sh = report["n_scored"], report["shared_with"]
    parts = []
    if "test" in n:
        k = sum(v for o, v in sh["test"].items() if o in ("fit", "val"))
        parts.append(f"test tokens with a prefix scored in fit/val: {k} of {n['test']}")
    if "val" in n:
        parts.append(f"val tokens with a prefix scored in fit: {sh['val'].get('fit', 0)} of {n['val']}")
    return "; ".join(parts)


def dump_model(adapter: LoopedModelAdapter, task: Task, data_seeds: Mapping[str, int], out_dir: Path | str,
               cfg: DumpConfig, base: BaseConfig | None = None, progress: bool = True,
               shard: tuple[int, int] = (0, 1)) -> dict[str, TrajectoryStore]:
    """Dump every split of ``cfg.sequences`` for one model: ``<out_dir>/<split>.zarr``.

    Args:
        adapter: the model interface.
        task: the model's task (its data sets, difficulty and token-type names).
        data_seeds: split -> data seed (the checkpoint's ``data_seeds``).
        out_dir: ``artifacts/dump/<model>`` (or a URL such as ``s3://bucket/dump/<model>``).
        cfg: the ``dump`` section.
        base: the ``base`` section (its seed is recorded).
        shard: ``(i, N)``: this process's shard of every split (:func:`dump_split`).

    Returns:
        split -> store (complete, unless other shards are still being written).
    """
    out_dir = _out_dir(out_dir)
    data = {}
    for split, n in cfg.sequences.items():
        if split not in data_seeds:
            raise InputError(f"checkpoint records no data seed for split '{split}'; retrain with the current "
                             "train stage or remove the split from dump.sequences")
        data[split] = task.dataset(split, int(n), int(data_seeds[split]))
    check_training_split(adapter.info.extra.get("task"), cfg.allow_prefix_overlap, adapter.info.name)
    overlap = split_overlap(task, data)  # before writing anything: a refused test store costs no forward pass
    check_prefix_overlap(overlap, cfg.allow_prefix_overlap, adapter.info.name)
    _say(f"{adapter.info.name}: {overlap_line(overlap)}")
    stores = {}
    for split, batch in data.items():
        seed = int(data_seeds[split])
        attrs = {"split": split, "difficulty_name": task.difficulty_name,
                 "difficulty_levels": list(task.difficulty_levels), "token_types": list(task.token_types),
                 "data_seed": seed, "base_seed": None if base is None else base.seed,
                 "prefix_overlap": overlap_attrs(overlap, split, cfg.allow_prefix_overlap)}
        stores[split] = dump_split(adapter, batch, join_store(out_dir, f"{split}.zarr"), cfg, attrs, progress,
                                   shard=shard)
    return stores


def dump_text_model(adapter, cfg, out_dir: Path | str, base=None, progress: bool = True,
                    shard: tuple[int, int] = (0, 1)) -> dict:
    """Dump every split of ``cfg.sequences`` of a checkpoint on the corpus ``cfg.text``: ``<out_dir>/<split>.zarr``.

    The batches come from :func:`looptrace.tasks.text.text_dataset` (content-disjoint document splits, packed,
    ``difficulty`` from fit-split token frequencies); with ``text.difficulty: final_loss`` it is rewritten before
    completion by :func:`looptrace.tasks.text.loss_bins_finalizer`.

    Args:
        adapter: the checkpoint's :class:`~looptrace.models.interface.LoopedModelAdapter` (``looptrace.models.adapters``).
        cfg: the ``dump`` section (:class:`looptrace.capture.dump.DumpConfig`) with ``text`` set; the tokenizer
            defaults to ``cfg.adapter.path``.
        out_dir: ``artifacts/dump/<model>`` (or a URL).
        base: the ``base`` section (its seed is recorded).
        shard: ``(i, N)``: this process's shard of every split (:func:`dump_split`).

    Returns:
        split -> completed store (``difficulty_*`` attributes: name, definition, edges).
    """
    if cfg.text is None:
        raise ConfigError("dump.text is required to dump a checkpoint on a corpus")
    tok_path = cfg.text.tokenizer or (cfg.adapter.path if cfg.adapter is not None else None)
    if tok_path is None:
        raise ConfigError("dump.text.tokenizer: no tokenizer directory (and no dump.adapter.path)")
    out_dir = _out_dir(out_dir)
    trust = bool(cfg.adapter is not None and cfg.adapter.trust_remote_code)
    data, diff_attrs = text_dataset(cfg.text, cfg.sequences, tok_path, adapter.info.vocab_size, trust)
    overlap = shared_prefixes({s: prefix_keys(b.tokens)[b.targets != IGNORE] for s, b in data.items()})
    check_prefix_overlap(overlap, cfg.allow_prefix_overlap, adapter.info.name)
    _say(f"{adapter.info.name}: {overlap_line(overlap)}")
    stores = {}
    for split, batch in data.items():
        attrs = {**text_attrs(cfg.text, split), **diff_attrs, "base_seed": None if base is None else base.seed,
                 "prefix_overlap": overlap_attrs(overlap, split, cfg.allow_prefix_overlap)}
        stores[split] = dump_split(adapter, batch, join_store(out_dir, f"{split}.zarr"), cfg, attrs, progress,
                                   finalize=(loss_bins_finalizer(cfg.text.difficulty_bins)
                                             if cfg.text.difficulty == "final_loss" else None), shard=shard)
    return stores

def overlap_attrs(report: Mapping[str, Any], split: str, allowed: bool) -> dict[str, Any]:
    """The ``prefix_overlap`` store attribute: this split's shared-token counts plus the whole report.

    ``shared_with[other]`` = this split's scored tokens whose exact context is scored in ``other``; ``splits`` = the
    splits measured together (those dumped in one run); ``allowed`` = ``dump.allow_prefix_overlap``.
    """
    return {"n_scored": int(report["n_scored"][split]), "shared_with": dict(report["shared_with"][split]),
            "shared_any": int(report["shared_any"][split]), "splits": list(report["n_scored"]),
            "report": report, "allowed": bool(allowed)}

__all__ = ["DIMS", "DumpConfig", "PrefixOverlapError", "check_prefix_overlap", "check_training_split", "dump_model",
           "dump_split", "dump_text_model", "overlap_attrs", "reuse_freed_memory", "weights_hash"]
