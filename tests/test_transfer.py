"""The dump's overlapping device → host copies (looptrace.capture.transfer).

The asynchronous form (side stream, pinned buffers, events; each batch resolved after the next one is captured) runs
here on CPU tensors with the host stand-ins for CUDA's stream and events. The reference is the synchronous form,
``tensor.cpu().numpy()`` at once, which a CPU dump uses: every file of the store must be the same bytes — float16 and
bfloat16 states, full and top-k logits, a gate, masked positions (rows selected after the copy), a partial last chunk,
and a resumed dump (batches whose chunks are written are skipped while a batch is pending).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import looptrace.capture.chunks as C
import looptrace.capture.dump as D
from looptrace.capture.dump import DumpConfig, dump_split
from looptrace.capture.encode import encode_states_counted
from looptrace.capture.transfer import Pending, Transfer, resolve, take_rows, transfer_for
from looptrace.models.interface import LoopedTransformerAdapter
from looptrace.tasks import TaskBatch
from tests.builders import tiny_model


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_transfer_forms_give_the_same_arrays():
    x = torch.randn(6, 3, 4)
    sync, asy = Transfer("cpu"), Transfer("cpu", asynchronous=True)
    assert not transfer_for("cpu").asynchronous  # a CPU dump keeps the synchronous form
    a = sync.copy(x)
    p = asy.copy(x[:, 1])  # a non-contiguous view: copied as its values
    assert isinstance(a, np.ndarray) and isinstance(p, Pending)
    assert np.array_equal(a, x.numpy()) and np.array_equal(p.numpy(), x[:, 1].numpy())
    keep = np.array([True, False, True, True, False, True])
    assert np.array_equal(take_rows(p, keep).numpy(), x[:, 1].numpy()[keep])
    assert np.array_equal(take_rows(a, keep), x.numpy()[keep])
    out = resolve({"p": p, "a": a})
    assert list(out) == ["p", "a"] and all(isinstance(v, np.ndarray) for v in out.values())
    assert (asy.copies, asy.bytes) == (1, 6 * 4 * 4)
    asy.settle()
    assert asy.copy_ms >= 0.0 and sync.copies == 0


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_encoder_through_a_pending_copy(dtype):
    x = torch.randn(5, 3, 8) * 100
    x[2, 1, 3] = float("nan")
    ref, bad = encode_states_counted(x, dtype, "x")
    got, bad2 = encode_states_counted(x, dtype, "x", Transfer("cpu", asynchronous=True).copy)
    assert isinstance(got, Pending)
    got = got.numpy()
    assert got.dtype == ref.dtype and got.tobytes() == ref.tobytes()
    assert np.array_equal(bad, bad2)


def _async(monkeypatch) -> list[Transfer]:
    made: list[Transfer] = []

    def make(device):
        t = Transfer(device, asynchronous=True)
        made.append(t)
        return t

    monkeypatch.setattr(D, "transfer_for", make)
    return made


def _data(seed: int, n: int, seq: int, vocab: int, masked: bool) -> TaskBatch:
    rng = np.random.default_rng(seed)
    tok = rng.integers(0, vocab, (n, seq))
    tgt = rng.integers(0, vocab, tok.shape)
    if masked:
        tgt[:, 0] = -100
        tgt[::3, -1] = -100
    return TaskBatch(tok, tgt, np.zeros_like(tok), np.zeros_like(tok))


@pytest.mark.parametrize(("hidden_dtype", "topk", "gate", "masked"),
                         [("float16", None, "none", True), ("bfloat16", 3, "linear", False),
                          ("float32", 2, "linear", True)])
def test_dump_with_overlapping_copies_writes_the_same_store(tmp_path, monkeypatch, hidden_dtype, topk, gate, masked):
    ad = LoopedTransformerAdapter(tiny_model(vocab=7, seq=6, loops=3, d_model=16, gate=gate), "m")
    data = _data(0, 11, 6, 7, masked)
    cfg = DumpConfig(batch_size=3, chunk_tokens=7, hidden_dtype=hidden_dtype,
                     **({} if topk is None else {"topk": topk, "full_logits_max_vocab": 4}))
    dump_split(ad, data, tmp_path / "a" / "val.zarr", cfg, progress=False)
    with monkeypatch.context() as m:
        made = _async(m)
        dump_split(ad, data, tmp_path / "b" / "val.zarr", cfg, progress=False)
    assert len(made) == 1 and made[0].copies >= 4 * 4  # every batch's arrays went through the pending copies
    a, b = _files(tmp_path / "a" / "val.zarr"), _files(tmp_path / "b" / "val.zarr")
    assert sorted(a) == sorted(b)
    assert [k for k in a if a[k] != b[k]] == []
    assert any("/c/" in k for k in a)


def test_resumed_dump_with_overlapping_copies(tmp_path, monkeypatch):
    """A dump stopped after a few batches, resumed with the overlapping copies: the skipped batches (chunks already
    written) resolve the pending one first; the store equals an uninterrupted dump's."""
    ad = LoopedTransformerAdapter(tiny_model(vocab=7, seq=6, loops=3, d_model=16), "m")
    data = _data(2, 14, 6, 7, False)
    cfg = DumpConfig(batch_size=2, chunk_tokens=6)
    dump_split(ad, data, tmp_path / "a" / "val.zarr", cfg, progress=False)
    real = D._capture
    calls = []

    def dies(*a, **k):
        calls.append(1)
        if len(calls) > 4:
            raise KeyboardInterrupt
        return real(*a, **k)

    with monkeypatch.context() as m:
        m.setattr(D, "_capture", dies)
        with pytest.raises(KeyboardInterrupt):
            dump_split(ad, data, tmp_path / "b" / "val.zarr", cfg, progress=False)
    with monkeypatch.context() as m:
        made = _async(m)
        dump_split(ad, data, tmp_path / "b" / "val.zarr", cfg, progress=False)
    assert made and made[0].copies > 0
    a, b = _files(tmp_path / "a" / "val.zarr"), _files(tmp_path / "b" / "val.zarr")
    assert sorted(a) == sorted(b)
    assert [k for k in a if a[k] != b[k]] == []


def test_skipped_batch_while_one_is_pending(tmp_path, monkeypatch):
    """Chunks 2 and 3 reported written (a shard's or an earlier run's): the batch covering only them is skipped right
    after a captured batch is left pending; the pending one is resolved first, and the store equals the synchronous
    run's under the same report (both without those chunks, which the final verification then refuses)."""
    from looptrace.io.store.schema import StoreError
    from looptrace.io.store.writer import StoreWriter

    orig = StoreWriter.done_chunks

    def report(self):
        out = orig(self)
        out[2:4] = True
        return out

    monkeypatch.setattr(StoreWriter, "done_chunks", report)
    ad = LoopedTransformerAdapter(tiny_model(vocab=7, seq=6, loops=3, d_model=16), "m")
    data = _data(3, 10, 6, 7, False)
    cfg = DumpConfig(batch_size=2, chunk_tokens=6)  # batch 1 = tokens 12..23 = chunks 2 and 3
    seen = []
    real = C.ChunkAssembler.add

    def spy(self, rows):
        seen.append((self.pos, len(rows["target"])))
        real(self, rows)

    monkeypatch.setattr(C.ChunkAssembler, "add", spy)
    with pytest.raises(StoreError, match="chunk 2"):  # the data say chunk 2 is missing: verification refuses it
        dump_split(ad, data, tmp_path / "a" / "val.zarr", cfg, progress=False)
    sync_seen, seen[:] = list(seen), []
    made = _async(monkeypatch)
    with pytest.raises(StoreError, match="chunk 2"):
        dump_split(ad, data, tmp_path / "b" / "val.zarr", cfg, progress=False)
    assert made[0].copies > 0
    assert seen == sync_seen == [(0, 12), (24, 12), (36, 12), (48, 12)]  # batch 1 skipped, the others in order
    a, b = _files(tmp_path / "a" / "val.zarr"), _files(tmp_path / "b" / "val.zarr")
    assert sorted(a) == sorted(b)
    assert [k for k in a if a[k] != b[k]] == []
