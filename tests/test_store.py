"""Trajectory store (SPEC §1): exact round trips (memory and disk), xarray, and every validation error."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import xarray as xr

from looptrace.io.store.location import memory_store
from looptrace.io.store.reader import open_store
from looptrace.io.store.schema import TOKEN_FIELDS, StoreError
from looptrace.io.store.writer import ArraySpec, StoreWriter, write_store
from tests.builders import random_store_arrays

ATTRS = {"split": "val", "task": {"name": "rp", "kind": "running_parity", "length": 8},
         "regime": {"name": "uniform", "kind": "uniform"}, "token_types": ["keep", "change"],
         "model": {"name": "rp-uniform", "vocab_size": 5, "config": {"groups": [{"n_layer": 1, "loops": 3}]}}}


def _assert_same(st, arrays):
    for k, v in arrays.items():
        got = st.read(k)
        assert got.dtype == (np.float32 if k.startswith("hidden") else v.dtype), k
        np.testing.assert_array_equal(got, v, err_msg=k)  # NaN == NaN for array_equal on floats


@pytest.mark.parametrize("where", ["memory", "disk"])
def test_exact_round_trip(where, tmp_path):
    arrays = random_store_arrays(gate=True)
    target = memory_store() if where == "memory" else tmp_path / "val.zarr"
    st = write_store(target, arrays, ATTRS, chunk_tokens=10)
    st = open_store(target)
    _assert_same(st, arrays)
    assert (st.n_tokens, st.n_loops, st.d_model, st.vocab_size, st.chunk_tokens) == (37, 3, 4, 5, 10)
    assert st.has_gate and st.has_logits and "hidden" in st and "topk_ids" not in st
    np.testing.assert_array_equal(st.loop_group, [0, 0, 1])
    assert st.attrs["task"] == ATTRS["task"] and st.attrs["token_types"] == ["keep", "change"]
    assert st.attrs["complete"] is True and st.attrs["nan_count"] == 0 and st.attrs["schema_version"] == 1
    assert st.attrs["dtypes"]["hidden"] == "float32" and st.attrs["dtypes"]["argmax"] == "int32"
    # blocks: chunk-aligned by default; arbitrary sizes on request; together they cover every row once
    assert list(st.blocks()) == [slice(0, 10), slice(10, 20), slice(20, 30), slice(30, 37)]
    rows = np.concatenate([st.read_block(["hidden", "entropy"], sl)["entropy"] for sl in st.blocks(8)])
    np.testing.assert_array_equal(rows, arrays["entropy"])
    idx = np.array([36, 3, 3, 0])
    np.testing.assert_array_equal(st.read("hidden", idx), arrays["hidden"][idx])
    tf = st.tokens_frame()
    assert tf.columns == ["token", *TOKEN_FIELDS]
    np.testing.assert_array_equal(tf["token"].to_numpy(), np.arange(37))
    for f in TOKEN_FIELDS:
        np.testing.assert_array_equal(tf[f].to_numpy(), arrays[f])
    if where == "disk":
        assert not Path(str(target) + ".tmp").exists()
        assert (target / "hidden" / "c" / "3" / "0" / "0").is_file()  # chunked along token only


def test_float16_states_and_topk_round_trip():
    arrays = random_store_arrays(topk=2)
    st = write_store(memory_store(), arrays, {}, chunk_tokens=16, hidden_dtype="float16")
    assert st.attrs["dtypes"]["hidden"] == "float16" and not st.has_logits and "topk_ids" in st
    np.testing.assert_array_equal(st.read("hidden"), arrays["hidden"].astype(np.float16).astype(np.float32))
    np.testing.assert_array_equal(st.read("topk_ids"), arrays["topk_ids"])
    assert st.vocab_size == 5  # no logits, no attrs: 1 + the largest id seen
    assert st.attrs["split"] is None and st.attrs["difficulty_name"] == "difficulty"


def test_xarray_opens_store_with_named_dims(tmp_path):
    arrays = random_store_arrays(gate=True)
    write_store(tmp_path / "s.zarr", arrays, ATTRS, chunk_tokens=10)
    ds = xr.open_zarr(tmp_path / "s.zarr")
    assert ds["hidden"].dims == ("token", "loop", "d_model")
    assert ds["hidden_init"].dims == ("token", "d_model")
    assert ds["logits"].dims == ("token", "loop", "vocab")
    assert ds["entropy"].dims == ("token", "loop") and ds["gate_logit"].dims == ("token", "loop")
    assert ds["sequence"].dims == ("token",) and ds["loop_group"].dims == ("loop",)
    token_arrays = sum(v.shape[0] == 37 for v in arrays.values())  # every array written with a token axis
    assert dict(ds.sizes) | {"chunk": 4} == {"token": 37, "loop": 3, "d_model": 4, "vocab": 5, "chunk": 4,
                                             "array": token_arrays}  # chunk_digest [chunk, array]
    assert ds["position"].dtype == np.int64  # no fill-value masking of ints
    np.testing.assert_array_equal(ds["hidden"].values, arrays["hidden"])
    assert ds.attrs["split"] == "val" and ds.attrs["n_loops"] == 3


# ----------------------------------------------------------------------------- validation

def _disk_store(tmp_path, **kw) -> Path:
    p = tmp_path / "val.zarr"
    write_store(p, random_store_arrays(**kw), ATTRS, chunk_tokens=10)
    return p


def _edit_json(path: Path, fn) -> None:
    meta = json.loads(path.read_text())
    fn(meta)
    path.write_text(json.dumps(meta))


def test_missing_store_and_not_a_store(tmp_path):
    with pytest.raises(StoreError, match=r"not found; run `looptrace dump`"):
        open_store(tmp_path / "nope.zarr")
    (tmp_path / "junk").mkdir()
    with pytest.raises(StoreError, match="not a Zarr v3 store"):
        open_store(tmp_path / "junk")


def test_wrong_schema_version(tmp_path):
    p = _disk_store(tmp_path)
    _edit_json(p / "zarr.json", lambda m: m["attributes"].update(schema_version=0))
    with pytest.raises(StoreError, match=r"schema_version 0, this looptrace reads 1; re-run `looptrace dump`"):
        open_store(p)


def test_missing_array(tmp_path):
    p = _disk_store(tmp_path)
    shutil.rmtree(p / "kl_final")
    with pytest.raises(StoreError, match=r"array 'kl_final' missing; re-run `looptrace dump`"):
        open_store(p)


def test_inconsistent_shapes(tmp_path):
    p = _disk_store(tmp_path)
    _edit_json(p / "target" / "zarr.json", lambda m: m.update(shape=[36]))
    with pytest.raises(StoreError, match=r"array 'target' has shape \(36,\), inconsistent .*token=37"):
        open_store(p)
    with pytest.raises(StoreError, match="array 'margin' has shape"):
        bad = random_store_arrays()
        bad["margin"] = bad["margin"][:, :2]
        write_store(memory_store(), bad, {})


def test_nan_in_hidden_counted_and_refused(tmp_path):
    arrays = random_store_arrays()
    arrays["hidden"][3, 1, 2] = np.nan
    arrays["hidden_init"][5, 0] = np.inf
    p = tmp_path / "nan.zarr"
    write_store(p, arrays, ATTRS, chunk_tokens=10, hidden_dtype="float16")
    with pytest.raises(StoreError, match=r"2 NaN/Inf values in 'hidden'/'hidden_init'.*allow_nan=True"):
        open_store(p)
    st = open_store(p, allow_nan=True)
    assert st.attrs["nan_count"] == 2 and np.isposinf(st.read("hidden_init")[5, 0])
    # a finite state beyond float16's range is refused, never stored as inf (looptrace.io.precision)
    arrays["hidden"][7, 0, 0] = 1e5
    with pytest.raises(StoreError, match=r"chunk 0 of 'hidden': \|value\| reaches 1e\+05, beyond float16"):
        write_store(tmp_path / "over.zarr", arrays, ATTRS, chunk_tokens=10, hidden_dtype="float16")


def test_damaged_chunk_is_an_error(tmp_path):
    p = _disk_store(tmp_path)
    chunk = p / "hidden" / "c" / "1" / "0" / "0"
    raw = bytearray(chunk.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    chunk.write_bytes(bytes(raw))
    st = open_store(p)  # lazy: the damage is found on read
    np.testing.assert_array_equal(st.read("hidden", slice(0, 10)), random_store_arrays()["hidden"][:10])  # other chunks fine
    with pytest.raises(StoreError, match=r"array 'hidden' has a damaged chunk \(checksum mismatch\)"):
        st.read("hidden", slice(10, 20))
    with pytest.raises(StoreError, match="damaged chunk"):
        open_store(p, verify=True)


def test_missing_chunk_is_an_error_not_zeros(tmp_path):
    p = _disk_store(tmp_path)
    (p / "difficulty" / "c" / "2").unlink()
    with pytest.raises(StoreError, match=r"array 'difficulty' is missing 1 of 4 chunks"):
        open_store(p)


def test_incomplete_store_says_resume(tmp_path):
    arrays = random_store_arrays()
    p = tmp_path / "inc.zarr"
    specs = {k: ArraySpec(v.shape, str(v.dtype)) for k, v in arrays.items()}
    w = StoreWriter.create(p, specs, {"n_tokens": 37, "n_loops": 3, "d_model": 4, "vocab_size": 5,
                                      "dtypes": {}}, chunk_tokens=10)
    w.write_chunk(0, {k: v[:10] for k, v in arrays.items() if k != "loop_group"})
    with pytest.raises(StoreError, match=r"incomplete \(1 of 4 chunks written\); re-run `looptrace dump` to resume"):
        open_store(p)
    assert open_store(p, allow_incomplete=True).n_tokens == 37
    # only whole, aligned chunks can be written
    with pytest.raises(StoreError, match="expected"):
        w.write_chunk(1, {k: v[10:15] for k, v in arrays.items() if k != "loop_group"})
    np.testing.assert_array_equal(w.done_chunks(), [True, False, False, False])
    with pytest.raises(StoreError, match="chunk 1 was never written"):
        w.finish()


def test_write_store_names_missing_or_unknownrandom_store_arrays():
    arrays = random_store_arrays()
    del arrays["token_type"]
    with pytest.raises(StoreError, match="array 'token_type'"):
        write_store(memory_store(), arrays, {})
    with pytest.raises(StoreError, match="unknown array 'hiden'"):
        write_store(memory_store(), {**random_store_arrays(), "hiden": np.zeros(3)}, {})


def test_refuses_to_replace_a_non_store_directory(tmp_path):
    (tmp_path / "x.zarr").mkdir()
    (tmp_path / "x.zarr" / "precious.txt").write_text("keep")
    with pytest.raises(StoreError, match="not a trajectory store"):
        write_store(tmp_path / "x.zarr", random_store_arrays(), {})
    assert (tmp_path / "x.zarr" / "precious.txt").read_text() == "keep"
    assert not (tmp_path / "x.zarr.tmp").exists()


@pytest.mark.parametrize("where", ["local", "url"])
@pytest.mark.parametrize("lands_before", [0, 1, 2, 3, 4])
def test_a_store_a_peer_is_creating_is_never_refused(tmp_path, monkeypatch, where, lands_before):
    """Shard processes of one dump check the target while a peer creates it: whichever read of the check the
    peer's creation lands before, the target reads as absent or as a store (absent -> present is the only
    change a peer makes), never as someone else's files."""
    import pathlib

    from looptrace.io.store import location

    target = tmp_path / "s.zarr" if where == "local" else f"memory://peer-{lands_before}/s.zarr"
    state = {"reads": 0, "created": False, "peer_writing": False}

    def before_read() -> None:
        if state["reads"] == lands_before and not state["created"]:
            state["peer_writing"] = True  # the peer's own reads and writes are not the check's
            write_store(target, random_store_arrays(), {"split": "val"}, chunk_tokens=8)
            state["peer_writing"], state["created"] = False, True
        state["reads"] += 1

    def counted(real, on_target=lambda *a: True):
        def read(*args, **kwargs):
            if not state["peer_writing"] and on_target(*args):
                before_read()
            return real(*args, **kwargs)
        return read

    if where == "url":
        monkeypatch.setattr(location, "_any_key", counted(location._any_key))
        monkeypatch.setattr(location, "_exists", counted(location._exists))
    else:
        for name in ("exists", "is_dir", "iterdir", "is_file"):
            monkeypatch.setattr(pathlib.Path, name, counted(getattr(pathlib.Path, name),
                                                            lambda path, *a: str(path).startswith(str(target))))
    location.assert_store_or_absent(target)  # no refusal, wherever the creation landed
    assert state["created"] or state["reads"] <= lands_before  # it landed during the check, or after it


def test_a_temp_file_of_an_atomic_write_is_not_foreign(tmp_path):
    # zarr's local store writes zarr.json as `zarr.<uuid>.partial`, then renames it: the instant before the
    # rename, a store being created is a directory holding only that temp file
    from looptrace.io.store.location import assert_store_or_absent, remove_store

    (tmp_path / "s.zarr").mkdir()
    (tmp_path / "s.zarr" / "zarr.0123abcd.partial").write_bytes(b"{")
    assert_store_or_absent(tmp_path / "s.zarr")
    (tmp_path / "s.zarr" / "notes.txt").write_text("mine")
    with pytest.raises(StoreError, match=r"s\.zarr exists and is not a trajectory store"):
        assert_store_or_absent(tmp_path / "s.zarr")
    with pytest.raises(StoreError, match="not a trajectory store"):
        remove_store(tmp_path / "s.zarr")
    assert (tmp_path / "s.zarr" / "notes.txt").read_text() == "mine"
