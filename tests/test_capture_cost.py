"""The capture's cheaper paths write the same bytes as the paths they replace.

- :class:`looptrace.io.store.chunk_io.DirectChunk` encodes whole chunks with zarr's own compressor object and crc32c,
  outside zarr's codec pipeline: every file of a store written that way equals the file zarr's pipeline writes
  (the alternative implementation is zarr itself, with the direct path switched off).
- A dump's store is file-for-file the same with and without it.
- Whole chunks of a local store are written past the page cache (``O_DIRECT``): the files hold exactly the encoded
  bytes, a file system that refuses O_DIRECT gets the same files through zarr, a short write and a full disk
  leave no ``.partial`` file, and a full disk is one line.
- A CPU dump encodes chunks between batches on a thread pool, an accelerator's dump in its writer threads: the
  same files. The main thread compresses with one Blosc thread: the same chunk gives the same bytes every time.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

import numpy as np
import pytest

from looptrace.io.store import chunk_io as CI
from looptrace.io.store import writer as W
from looptrace.io.store.writer import StoreWriter, write_store
from tests.builders import random_store_arrays, tiny_model


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _assert_same_files(a_root: Path, b_root: Path) -> None:
    a, b = _files(a_root), _files(b_root)
    assert sorted(a) == sorted(b)
    assert [k for k in a if a[k] != b[k]] == []


def _tiny_dump(seed: int, n_seq: int, masked: bool = False):
    """A tiny model's adapter and ``n_seq`` random 6-token sequences (``masked``: position 0 unscored)."""
    from looptrace.models.interface import LoopedTransformerAdapter
    from looptrace.tasks import TaskBatch

    ad = LoopedTransformerAdapter(tiny_model(vocab=7, seq=6, loops=3, d_model=16), "m")
    rng = np.random.default_rng(seed)
    tok = rng.integers(0, 7, (n_seq, 6))
    tgt = rng.integers(0, 7, tok.shape)
    if masked:
        tgt[:, 0] = -100
    return ad, TaskBatch(tok, tgt, np.zeros_like(tok), np.zeros_like(tok))


def _zarr_only(monkeypatch) -> None:
    monkeypatch.setattr(CI.DirectChunk, "of", classmethod(lambda cls, arr: None))


@pytest.mark.parametrize(("hidden_dtype", "topk", "n", "chunk"),
                         [("float16", None, 37, 8), ("bfloat16", 3, 40, 10), ("float32", None, 33, 64)])
def test_direct_chunks_are_zarrs_bytes(tmp_path, monkeypatch, hidden_dtype, topk, n, chunk):
    """Every chunk file (whole chunks direct, a partial last one through zarr) equals zarr's own."""
    arrays = random_store_arrays(n=n, T=3, D=16, V=7, topk=topk, gate=True)
    arrays["hidden"][::3] *= 1e3  # larger exponents: a less compressible bit pattern
    write_store(tmp_path / "direct.zarr", arrays, chunk_tokens=chunk, hidden_dtype=hidden_dtype)
    with monkeypatch.context() as m:
        _zarr_only(m)
        write_store(tmp_path / "zarr.zarr", arrays, chunk_tokens=chunk, hidden_dtype=hidden_dtype)
    direct, ref = _files(tmp_path / "direct.zarr"), _files(tmp_path / "zarr.zarr")
    assert sorted(direct) == sorted(ref)
    assert [k for k in ref if direct[k] != ref[k]] == []
    assert any("/c/" in k for k in ref)  # chunk files were compared, not only metadata


def test_direct_path_covers_every_token_array(tmp_path):
    """The comparison above is between two paths: a new store's token arrays all take the direct one."""
    arrays = random_store_arrays(n=20, T=2, D=4, V=5)
    st = write_store(tmp_path / "s.zarr", arrays, chunk_tokens=10)
    w = StoreWriter.reopen(st.target)
    assert w is not None
    assert set(w.token_arrays) <= set(w._direct)
    assert "hidden" in w._direct


def test_dump_store_same_with_and_without_direct_chunks(tmp_path, monkeypatch):
    """A dump (float16 states, full logits, a masked position, a partial last chunk) gives the same files."""
    from looptrace.capture.dump import DumpConfig, dump_split

    ad, data = _tiny_dump(0, 9, masked=True)
    cfg = DumpConfig(batch_size=4, chunk_tokens=8)
    dump_split(ad, data, tmp_path / "a" / "val.zarr", cfg, progress=False)
    with monkeypatch.context() as m:
        _zarr_only(m)
        dump_split(ad, data, tmp_path / "b" / "val.zarr", cfg, progress=False)
    _assert_same_files(tmp_path / "a" / "val.zarr", tmp_path / "b" / "val.zarr")


def test_several_writer_threads_write_the_same_store(tmp_path, monkeypatch):
    """Chunks encoded and written by 3 background threads at once (the accelerator setting) = the 1-thread store,
    file for file."""
    import looptrace.capture.chunks as C
    import looptrace.capture.dump as D
    from looptrace.capture.dump import DumpConfig, dump_split

    assert C.writer_threads(__import__("torch").device("cpu")) == 1
    ad, data = _tiny_dump(1, 12)
    cfg = DumpConfig(batch_size=2, chunk_tokens=5)
    dump_split(ad, data, tmp_path / "a" / "val.zarr", cfg, progress=False)
    seen = []
    real = C.BackgroundWriter.__init__

    def spy(self, *a, **k):
        real(self, *a, **k)
        seen.append(len(self.threads))

    monkeypatch.setattr(D, "writer_threads", lambda device: 3)
    monkeypatch.setattr(C.BackgroundWriter, "__init__", spy)
    dump_split(ad, data, tmp_path / "b" / "val.zarr", cfg, progress=False)
    assert seen == [3]
    _assert_same_files(tmp_path / "a" / "val.zarr", tmp_path / "b" / "val.zarr")


def test_reused_chunk_arrays_write_the_same_store(tmp_path, monkeypatch):
    """Chunks assembled into arrays the writer handed back (many small multi-part chunks, so arrays are reused
    while others are queued) = chunks assembled by plain concatenation, file for file."""
    import looptrace.capture.chunks as C
    from looptrace.capture.dump import DumpConfig, dump_split

    ad, data = _tiny_dump(2, 30)
    cfg = DumpConfig(batch_size=3, chunk_tokens=7)  # 18-token batches, 7-token chunks: most chunks span 2 batches
    reused = []
    real_take = C.ChunkBuffers.take

    def take(self, shape, dtype):
        before = sum(len(v) for v in self._free.values())
        out = real_take(self, shape, dtype)
        reused.append(sum(len(v) for v in self._free.values()) < before)
        return out

    monkeypatch.setattr(C.ChunkBuffers, "take", take)
    dump_split(ad, data, tmp_path / "a" / "val.zarr", cfg, progress=False)
    assert any(reused)  # arrays came back from the writer and were filled again
    monkeypatch.setattr(C.ChunkAssembler, "_join", lambda self, parts: np.concatenate(parts))
    dump_split(ad, data, tmp_path / "b" / "val.zarr", cfg, progress=False)
    _assert_same_files(tmp_path / "a" / "val.zarr", tmp_path / "b" / "val.zarr")


def test_chunk_buffers_lend_and_take_back():
    """Only arrays it lent come back; at most ``keep`` free arrays per shape and dtype."""
    from looptrace.capture.chunks import ChunkBuffers

    pool = ChunkBuffers(keep=1)
    a, b = pool.take((4, 2), np.float16), pool.take((4, 2), np.float16)
    pool.give({"x": a, "y": b, "z": np.zeros((4, 2), np.float16)})
    assert pool.take((4, 2), np.float16) is a  # one kept (keep=1), the foreign array ignored
    assert pool.take((4, 2), np.float16) is not b


def _open_spy(monkeypatch) -> list[int]:
    """Record the flags of every os.open in the writer module."""
    flags: list[int] = []
    real = os.open

    def spy(path, fl, *a, **k):
        flags.append(fl)
        return real(path, fl, *a, **k)

    monkeypatch.setattr(W.os, "open", spy)
    return flags


@pytest.mark.parametrize("n", [0, 1, 4095, 4096, 4097, 3 * 4096 + 5, (1 << 20) + 17])
def test_uncached_write_holds_the_bytes(tmp_path, monkeypatch, n):
    """The file is packed + crc exactly, written with O_DIRECT (this file system takes it), no .partial left."""
    if not CI.UNCACHED_OK:
        pytest.skip("no O_DIRECT on this platform")
    rng = np.random.default_rng(n)
    parts = (rng.integers(0, 256, max(n - 4, 0), dtype=np.uint8).tobytes(), b"\x01\x02\x03\x04"[:n])
    flags = _open_spy(monkeypatch)
    target = tmp_path / "a" / "c" / "0"
    if not CI.write_file_uncached(target, parts):
        pytest.skip("this file system refuses O_DIRECT")
    assert target.read_bytes() == parts[0] + parts[1]
    assert flags and flags[0] & os.O_DIRECT
    assert [p.name for p in tmp_path.rglob("*.partial")] == []


@pytest.mark.parametrize("code", [errno.EINVAL, errno.EOPNOTSUPP])
def test_uncached_write_refused_leaves_nothing(tmp_path, monkeypatch, code):
    """EINVAL / EOPNOTSUPP on open (tmpfs, overlayfs, FUSE): False, nothing written; the store's chunks then go
    through zarr, the same files."""
    real = os.open

    def refuse(path, fl, *a, **k):
        if fl & getattr(os, "O_DIRECT", 0):
            raise OSError(code, os.strerror(code))
        return real(path, fl, *a, **k)

    arrays = random_store_arrays(n=40, T=3, D=16, V=7)
    write_store(tmp_path / "direct.zarr", arrays, chunk_tokens=8)
    monkeypatch.setattr(W.os, "open", refuse)
    assert not CI.write_file_uncached(tmp_path / "x" / "f", (b"a" * 5000, b"crc!"))
    assert list((tmp_path / "x").iterdir()) == []
    write_store(tmp_path / "refused.zarr", arrays, chunk_tokens=8)
    _assert_same_files(tmp_path / "direct.zarr", tmp_path / "refused.zarr")


def test_uncached_short_unaligned_write_finishes_buffered(tmp_path, monkeypatch):
    """A short write that ends off the 4 KiB grid (allowed by POSIX) is finished through the page cache."""
    if not CI.UNCACHED_OK:
        pytest.skip("no O_DIRECT on this platform")
    data = np.random.default_rng(0).integers(0, 256, 3 * 4096 + 100, dtype=np.uint8).tobytes()
    calls: list[int] = []
    real_write = os.write

    def short(fd, view):
        calls.append(len(view))
        if len(calls) > 1:
            return real_write(fd, view)
        real_write(fd, view[:4096])  # aligned: O_DIRECT takes it
        path = os.readlink(f"/proc/self/fd/{fd}")
        with open(path, "r+b") as f:  # 904 more bytes, as a file system might, through another handle
            f.seek(4096)
            f.write(bytes(view[4096:5000]))
        return 5000

    monkeypatch.setattr(W.os, "write", short)
    if not CI.write_file_uncached(tmp_path / "f", (data[:-4], data[-4:])):
        pytest.skip("this file system refuses O_DIRECT")
    assert len(calls) == 1  # the rest was not sent through O_DIRECT again
    assert (tmp_path / "f").read_bytes() == data
    assert list(tmp_path.rglob("*.partial")) == []


def test_uncached_write_disk_full_is_one_line(tmp_path, monkeypatch):
    """ENOSPC while writing a chunk: StoreError naming the store and the fix, no .partial, the chunk not marked."""
    if not CI.UNCACHED_OK:
        pytest.skip("no O_DIRECT on this platform")
    arrays = random_store_arrays(n=16, T=2, D=512, V=5)  # a chunk's states: ~16 KB, past the 4 KiB grid
    w = StoreWriter.create(tmp_path / "s.zarr", {k: W.ArraySpec(v.shape, str(v.dtype) if k != "hidden" else "float16")
                                                 for k, v in arrays.items() if k != "loop_group"},
                           {"n_tokens": 16, "n_loops": 2, "d_model": 512, "vocab_size": 5}, chunk_tokens=8)

    def full(fd, view):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(W.os, "write", full)
    with pytest.raises(W.StoreError, match=r"no space left .* re-run `looptrace dump` to resume") as exc:
        w.write_chunk(0, {k: v[:8] for k, v in arrays.items() if k != "loop_group"})
    assert "\n" not in str(exc.value)
    assert list((tmp_path / "s.zarr").rglob("*.partial")) == []
    assert w.done_chunks().tolist() == [False, False]


def test_main_thread_compression_is_deterministic(tmp_path):
    """Blosc with several threads stores blocks in the order they finish (measured: 7 distinct outputs in 20 of
    one 64 MB chunk at 2 threads); a chunk encoded from the main thread gives the same bytes every time, the same
    as from a worker thread."""
    import threading

    arrays = random_store_arrays(n=8, T=2, D=4, V=5)
    st = write_store(tmp_path / "s.zarr", arrays, chunk_tokens=8)
    w = StoreWriter.reopen(st.target)
    assert w is not None
    enc = w._direct["hidden"]
    rng = np.random.default_rng(0)
    x = np.cumsum(rng.standard_normal(32 << 20), dtype=np.float32).astype(np.float16)  # 64 MB, 16 Blosc blocks
    assert threading.current_thread() is threading.main_thread()
    outs = {enc.encode(x).packed for _ in range(10)}
    other: list[bytes] = []
    th = threading.Thread(target=lambda: other.append(enc.encode(x).packed))
    th.start()
    th.join()
    assert len(outs) == 1
    assert outs == set(other)


def test_prepared_chunk_same_with_a_pool(tmp_path):
    """prepare_chunk's tasks on a 3-thread pool = the same tasks in order: stored objects, digests, NaN count."""
    from concurrent.futures import ThreadPoolExecutor

    arrays = random_store_arrays(n=24, T=3, D=16, V=7, gate=True)
    arrays["hidden"][2, 1, 3] = np.nan
    st = write_store(tmp_path / "s.zarr", arrays, chunk_tokens=12, hidden_dtype="float16")
    w = StoreWriter.reopen(st.target)
    assert w is not None
    rows = {k: v[:12] for k, v in arrays.items() if k != "loop_group"}
    plain = w.prepare_chunk(0, rows)
    with ThreadPoolExecutor(3) as pool:
        pooled = w.prepare_chunk(0, rows, pool=pool)
    assert [str(p) for p, _ in pooled.direct] == [str(p) for p, _ in plain.direct]
    assert [bytes(e.packed) + e.crc for _, e in pooled.direct] == [bytes(e.packed) + e.crc for _, e in plain.direct]
    assert pooled.digests.tolist() == plain.digests.tolist() and plain.digests.any()
    assert pooled.nonfinite == plain.nonfinite == 1


def test_encode_pool_rule(monkeypatch):
    """Between batches (a pool of torch's threads) only for a CPU forward pass on every core; else the writers."""
    import torch

    import looptrace.capture.chunks as C

    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    monkeypatch.setattr(C, "host_cores", lambda: 2)
    pool = C.encode_pool(torch.device("cpu"))
    assert pool is not None and pool._max_workers == 2
    assert C.encode_pool(torch.device("cpu")) is pool  # the process's, kept
    assert C.encode_pool(torch.device("meta")) is None  # an accelerator: its host cores are free
    monkeypatch.setattr(C, "host_cores", lambda: 4)
    assert C.encode_pool(torch.device("cpu")) is None  # spare cores: the writer thread compresses beside it


def test_encoding_between_batches_writes_the_same_store(tmp_path, monkeypatch):
    """A CPU dump that encodes between batches on the pool (the forward pass on every core) = one that encodes in
    its background writer thread, file for file (float16 states, a masked position, a partial last chunk)."""
    import looptrace.capture.chunks as C
    from looptrace.capture.dump import DumpConfig, dump_split

    ad, data = _tiny_dump(3, 11, masked=True)
    cfg = DumpConfig(batch_size=3, chunk_tokens=8)
    monkeypatch.setattr(C, "host_cores", lambda: 10**6)  # torch's threads never cover the cores: background
    dump_split(ad, data, tmp_path / "a" / "val.zarr", cfg, progress=False)
    used = []
    real_prepare = W.StoreWriter.prepare_chunk

    def spy(self, *a, pool=None, **k):
        used.append(pool is not None)
        return real_prepare(self, *a, pool=pool, **k)

    monkeypatch.setattr(C, "host_cores", lambda: 1)  # every core: between batches, on the pool
    monkeypatch.setattr(W.StoreWriter, "prepare_chunk", spy)
    dump_split(ad, data, tmp_path / "b" / "val.zarr", cfg, progress=False)
    assert used and all(used)
    _assert_same_files(tmp_path / "a" / "val.zarr", tmp_path / "b" / "val.zarr")
