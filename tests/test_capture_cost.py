"""The capture's cheaper paths write the same bytes as the paths they replace (issue 28).

- :class:`looptrace.io.store.writer._DirectChunk` encodes whole chunks with zarr's own compressor object and crc32c,
  outside zarr's codec pipeline: every file of a store written that way equals the file zarr's pipeline writes
  (the alternative implementation is zarr itself, with the direct path switched off).
- A dump's store is file-for-file the same with and without it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from looptrace.io.store import writer as W
from looptrace.io.store.writer import StoreWriter, write_store
from tests.builders import random_store_arrays, tiny_model


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _zarr_only(monkeypatch) -> None:
    monkeypatch.setattr(W._DirectChunk, "of", classmethod(lambda cls, arr: None))


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
    from looptrace.models.interface import LoopedTransformerAdapter
    from looptrace.tasks import TaskBatch

    ad = LoopedTransformerAdapter(tiny_model(vocab=7, seq=6, loops=3, d_model=16), "m")
    rng = np.random.default_rng(0)
    tok = rng.integers(0, 7, (9, 6))
    tgt = rng.integers(0, 7, tok.shape)
    tgt[:, 0] = -100
    data = TaskBatch(tok, tgt, np.zeros_like(tok), np.zeros_like(tok))
    cfg = DumpConfig(batch_size=4, chunk_tokens=8)
    dump_split(ad, data, tmp_path / "a" / "val.zarr", cfg, progress=False)
    with monkeypatch.context() as m:
        _zarr_only(m)
        dump_split(ad, data, tmp_path / "b" / "val.zarr", cfg, progress=False)
    a, b = _files(tmp_path / "a" / "val.zarr"), _files(tmp_path / "b" / "val.zarr")
    assert sorted(a) == sorted(b)
    assert [k for k in a if a[k] != b[k]] == []


def test_several_writer_threads_write_the_same_store(tmp_path, monkeypatch):
    """Chunks written by 3 background threads at once (the accelerator setting) = the 1-thread store, file for file."""
    import looptrace.capture.dump as D
    from looptrace.capture.dump import DumpConfig, dump_split
    from looptrace.models.interface import LoopedTransformerAdapter
    from looptrace.tasks import TaskBatch

    assert D.writer_threads(__import__("torch").device("cpu")) == 1
    ad = LoopedTransformerAdapter(tiny_model(vocab=7, seq=6, loops=3, d_model=16), "m")
    rng = np.random.default_rng(1)
    tok = rng.integers(0, 7, (12, 6))
    data = TaskBatch(tok, rng.integers(0, 7, tok.shape), np.zeros_like(tok), np.zeros_like(tok))
    cfg = DumpConfig(batch_size=2, chunk_tokens=5)
    dump_split(ad, data, tmp_path / "a" / "val.zarr", cfg, progress=False)
    seen = []
    real = D._BackgroundWriter.__init__

    def spy(self, *a, **k):
        real(self, *a, **k)
        seen.append(len(self.threads))

    monkeypatch.setattr(D, "writer_threads", lambda device: 3)
    monkeypatch.setattr(D._BackgroundWriter, "__init__", spy)
    dump_split(ad, data, tmp_path / "b" / "val.zarr", cfg, progress=False)
    assert seen == [3]
    a, b = _files(tmp_path / "a" / "val.zarr"), _files(tmp_path / "b" / "val.zarr")
    assert sorted(a) == sorted(b)
    assert [k for k in a if a[k] != b[k]] == []


def test_reused_chunk_arrays_write_the_same_store(tmp_path, monkeypatch):
    """Chunks assembled into arrays the writer handed back (many small multi-part chunks, so arrays are reused
    while others are queued) = chunks assembled by plain concatenation, file for file."""
    import looptrace.capture.dump as D
    from looptrace.capture.dump import DumpConfig, dump_split
    from looptrace.models.interface import LoopedTransformerAdapter
    from looptrace.tasks import TaskBatch

    ad = LoopedTransformerAdapter(tiny_model(vocab=7, seq=6, loops=3, d_model=16), "m")
    rng = np.random.default_rng(2)
    tok = rng.integers(0, 7, (30, 6))
    data = TaskBatch(tok, rng.integers(0, 7, tok.shape), np.zeros_like(tok), np.zeros_like(tok))
    cfg = DumpConfig(batch_size=3, chunk_tokens=7)  # 18-token batches, 7-token chunks: most chunks span 2 batches
    reused = []
    real_take = D._ChunkBuffers.take

    def take(self, shape, dtype):
        before = sum(len(v) for v in self._free.values())
        out = real_take(self, shape, dtype)
        reused.append(sum(len(v) for v in self._free.values()) < before)
        return out

    monkeypatch.setattr(D._ChunkBuffers, "take", take)
    dump_split(ad, data, tmp_path / "a" / "val.zarr", cfg, progress=False)
    assert any(reused)  # arrays came back from the writer and were filled again
    monkeypatch.setattr(D._ChunkAssembler, "_join", lambda self, parts: np.concatenate(parts))
    dump_split(ad, data, tmp_path / "b" / "val.zarr", cfg, progress=False)
    a, b = _files(tmp_path / "a" / "val.zarr"), _files(tmp_path / "b" / "val.zarr")
    assert sorted(a) == sorted(b)
    assert [k for k in a if a[k] != b[k]] == []


def test_chunk_buffers_lend_and_take_back():
    """Only arrays it lent come back; at most ``keep`` free arrays per shape and dtype."""
    from looptrace.capture.dump import _ChunkBuffers

    pool = _ChunkBuffers(keep=1)
    a, b = pool.take((4, 2), np.float16), pool.take((4, 2), np.float16)
    pool.give({"x": a, "y": b, "z": np.zeros((4, 2), np.float16)})
    assert pool.take((4, 2), np.float16) is a  # one kept (keep=1), the foreign array ignored
    assert pool.take((4, 2), np.float16) is not b
