"""The dump (SPEC §1): rows, states and readouts against an independent forward pass; top-k mode; NaN
handling; resume after a crash and after SIGKILL (arrays equal to an uninterrupted dump); the stage."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import xarray as xr

from looptrace.capture.dump import DumpConfig, dump_split
from looptrace.config import ConfigError, from_dict, load_section
from looptrace.io.store.location import memory_store
from looptrace.io.store.reader import open_store
from looptrace.io.store.schema import STAT_NAMES, StoreError
from looptrace.io.store.writer import StoreWriter
from looptrace.models.interface import LoopedTransformerAdapter, States
from looptrace.tasks import IGNORE, make_task
from tests.builders import tiny_adapter_and_data, tiny_dump_config, tiny_train_config
from tests.test_stats import _np_reference

REPO = Path(__file__).resolve().parents[1]


def _same_stores(a, b):
    assert a.names == b.names
    for name in a.names:
        np.testing.assert_array_equal(a.read(name), b.read(name), err_msg=name)


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


@pytest.mark.parametrize("unscored", [True, False])
def test_dump_matches_independent_forward(unscored):
    adapter, data = tiny_adapter_and_data(unscored=unscored)
    st = dump_split(adapter, data, memory_store(), DumpConfig(batch_size=7, chunk_tokens=16), {"split": "val"})
    mask = data.targets != IGNORE
    b, p = np.nonzero(mask)  # (sequence, position) order
    assert st.n_tokens == mask.sum() == len(b)
    np.testing.assert_array_equal(st.read("sequence"), b)
    np.testing.assert_array_equal(st.read("position"), p)
    np.testing.assert_array_equal(st.read("target"), data.targets[mask])
    np.testing.assert_array_equal(st.read("token_id"), data.tokens[mask])
    np.testing.assert_array_equal(st.read("difficulty"), data.difficulty[mask])
    np.testing.assert_array_equal(st.read("token_type"), data.token_type[mask])
    assert (2 not in st.read("sequence")) == unscored
    with torch.no_grad():  # one whole-data forward pass with every loop read out
        out = adapter.model(torch.from_numpy(data.tokens))
    m = torch.from_numpy(mask)
    np.testing.assert_allclose(st.read("logits"), out.logits[m].numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(st.read("hidden"), out.hidden[m].numpy(), rtol=1e-3, atol=1e-3)  # float16
    assert st.attrs["dtypes"]["hidden"] == "float16"
    np.testing.assert_allclose(st.read("gate_logit"), out.gate_logits[m].numpy(), rtol=1e-5, atol=1e-6)
    ref = _np_reference(out.logits[m].numpy(), data.targets[mask])
    for k in STAT_NAMES:
        np.testing.assert_allclose(st.read(k), ref[k], rtol=1e-4, atol=1e-5, equal_nan=True, err_msg=k)
    np.testing.assert_array_equal(st.loop_group, [0, 0, 0])
    assert st.attrs["complete"] and st.attrs["split"] == "val" and st.attrs["model"]["checkpoint_hash"] == "abc"
    assert st.attrs["task"]["kind"] == "running_sum" and st.attrs["params"]["chunk_tokens"] == 16
    assert st.attrs["logits_mode"] == "full" and st.attrs["nan_count"] == 0


def test_topk_mode_agrees_with_full_mode():
    adapter, data = tiny_adapter_and_data(gate="none")
    full = dump_split(adapter, data, memory_store(), DumpConfig(batch_size=8, chunk_tokens=32))
    topk = dump_split(adapter, data, memory_store(),
                      DumpConfig(batch_size=8, chunk_tokens=32, full_logits_max_vocab=4, topk=3))
    assert "logits" not in topk and topk.attrs["logits_mode"] == "topk" and not topk.has_gate
    for k in STAT_NAMES:  # exact: computed from the full logits in both modes
        np.testing.assert_array_equal(topk.read(k), full.read(k), err_msg=k)
    z = torch.from_numpy(full.read("logits"))
    ref = z.topk(3, dim=-1)
    np.testing.assert_array_equal(topk.read("topk_logits"), ref.values.numpy())
    np.testing.assert_array_equal(topk.read("topk_ids"), ref.indices.numpy())
    np.testing.assert_array_equal(topk.read("topk_ids")[..., 0], full.read("argmax"))


def test_xarray_opens_a_dump(tmp_path):
    adapter, data = tiny_adapter_and_data()
    dump_split(adapter, data, tmp_path / "val.zarr", DumpConfig(batch_size=16, chunk_tokens=64))
    ds = xr.open_zarr(tmp_path / "val.zarr")
    assert ds["hidden"].dims == ("token", "loop", "d_model") and ds["hidden"].shape[1:] == (3, 16)
    assert ds["kl_prev"].dims == ("token", "loop") and ds["target"].dims == ("token",)
    assert ds.sizes["token"] == int((data.targets != IGNORE).sum())


class _Crash(RuntimeError):
    pass


def test_resume_after_crash_and_start_over_on_new_params(tmp_path, monkeypatch, capsys):
    adapter, data = tiny_adapter_and_data()
    cfg = DumpConfig(batch_size=5, chunk_tokens=16)
    ref = dump_split(adapter, data, memory_store(), cfg)
    path = tmp_path / "val.zarr"
    real = StoreWriter.write_chunk
    calls = {"n": 0}

    def flaky(self, chunk, arrays, **kw):
        calls["n"] += 1
        if calls["n"] == 5:
            raise _Crash("disk full")
        return real(self, chunk, arrays, **kw)

    monkeypatch.setattr(StoreWriter, "write_chunk", flaky)
    with pytest.raises(_Crash):
        dump_split(adapter, data, path, cfg)
    with pytest.raises(StoreError, match=r"incomplete \(4 of \d+ chunks written\)"):
        open_store(path)
    calls["n"] = -3  # the resume crashes too, after 3 more chunks
    with pytest.raises(_Crash):
        dump_split(adapter, data, path, cfg)
    assert "resuming (4 of" in capsys.readouterr().err
    monkeypatch.setattr(StoreWriter, "write_chunk", real)
    st = dump_split(adapter, data, path, cfg)
    assert "resuming (11 of" in capsys.readouterr().err
    _same_stores(st, ref)
    # already complete, same fingerprint: nothing is recomputed
    monkeypatch.setattr(StoreWriter, "write_chunk", lambda *a, **kw: (_ for _ in ()).throw(AssertionError("rewrote")))
    _same_stores(dump_split(adapter, data, path, cfg), ref)
    monkeypatch.setattr(StoreWriter, "write_chunk", real)
    # complete but damaged since (a chunk deleted): that chunk is rewritten, not trusted
    (path / "entropy" / "c" / "0" / "0").unlink()
    _same_stores(dump_split(adapter, data, path, cfg), ref)
    assert "1 damaged chunk(s) (chunk 0: array 'entropy': chunk file missing); rewriting them" in capsys.readouterr().err
    # different params: start over (and say so)
    st32 = dump_split(adapter, data, path, DumpConfig(batch_size=5, chunk_tokens=16, hidden_dtype="float32"))
    assert "starting over" in capsys.readouterr().err
    assert st32.attrs["dtypes"]["hidden"] == "float32"
    np.testing.assert_array_equal(st32.read("logits"), ref.read("logits"))


class _NanAdapter(LoopedTransformerAdapter):
    def states(self, input_ids):
        s = super().states(input_ids)
        h = s.hidden.clone()
        h[0, 0, 1, :2] = float("nan")
        return States(h, s.hidden_init, s.gate_logits)


def test_nan_states_fail_the_dump_unless_allowed(tmp_path):
    base, data = tiny_adapter_and_data(gate="none")
    adapter = _NanAdapter(base.model, "nan")
    cfg = DumpConfig(batch_size=10)
    with pytest.raises(StoreError, match=r"NaN/Inf values in 'hidden'/'hidden_init'.*dump.allow_nan"):
        dump_split(adapter, data, tmp_path / "a.zarr", cfg)
    # 2 NaNs at (row 0 of each batch, position 0, loop 2): sequences 0, 10, 20, all scored there
    assert open_store(tmp_path / "a.zarr", allow_nan=True).attrs["nan_count"] == 6
    with pytest.raises(StoreError, match="6 NaN/Inf"):
        open_store(tmp_path / "a.zarr")
    allowed = DumpConfig(batch_size=10, allow_nan=True)
    st = dump_split(adapter, data, tmp_path / "b.zarr", allowed)
    assert st.attrs["nan_count"] == 6 and np.isnan(st.read("hidden")[0, 1, :2]).all()
    assert open_store(tmp_path / "b.zarr").n_tokens == st.n_tokens  # the dump's allow_nan is recorded


def test_a_change_of_the_value_code_dumps_again(tmp_path, monkeypatch, capsys):
    # DVC re-runs the stage when pipeline/looptrace/capture/dump.py & co change, but keeps the old store (persist): it must be
    # dumped again, not returned as complete
    import looptrace.capture.resume as resume_mod

    adapter, data = tiny_adapter_and_data()
    cfg = DumpConfig(batch_size=5, chunk_tokens=16)
    ref = dump_split(adapter, data, memory_store(), cfg)
    path = tmp_path / "val.zarr"
    code = dump_split(adapter, data, path, cfg).attrs["code_hash"]
    assert code == ref.attrs["code_hash"] and len(code) == 64
    real = StoreWriter.write_chunk
    monkeypatch.setattr(StoreWriter, "write_chunk", lambda *a, **kw: (_ for _ in ()).throw(AssertionError("rewrote")))
    dump_split(adapter, data, path, cfg)  # same code: returned as is
    monkeypatch.setattr(StoreWriter, "write_chunk", real)
    # one more module's source in the hash stands for a changed source
    monkeypatch.setattr(resume_mod, "VALUE_MODULES", (*resume_mod.VALUE_MODULES, "looptrace.tasks"))
    capsys.readouterr()
    st = dump_split(adapter, data, path, cfg)
    assert "data or code; starting over" in capsys.readouterr().err
    assert st.attrs["code_hash"] != code
    _same_stores(st, ref)


def test_never_overwrites_a_directory_that_is_not_a_store(tmp_path):
    # the store is created on the writer thread: its refusal must still reach the caller, and the
    # user's files must be untouched
    adapter, data = tiny_adapter_and_data()
    path = tmp_path / "val.zarr"
    path.mkdir()
    (path / "notes.txt").write_text("mine")
    with pytest.raises(StoreError, match="exists and is not a trajectory store"):
        dump_split(adapter, data, path, DumpConfig(batch_size=5, chunk_tokens=16))
    assert [f.name for f in path.iterdir()] == ["notes.txt"] and (path / "notes.txt").read_text() == "mine"


# ----------------------------------------------------------------------------- SIGKILL and resume

_CHILD = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {repo!r})
    import torch
    torch.set_num_threads(1)
    from looptrace.capture.dump import DumpConfig, dump_split
    from looptrace.io.store.writer import StoreWriter
    from tests.builders import tiny_adapter_and_data, tiny_dump_config
    real = StoreWriter.write_chunk
    def slow(self, c, a, **kw):  # widen every chunk write so the kill lands anywhere, mid-chunk included
        time.sleep(0.01)
        out = real(self, c, a, **kw)
        time.sleep(0.02)
        return out
    StoreWriter.write_chunk = slow
    adapter, data = tiny_adapter_and_data(n_seq=60)
    print("ready", flush=True)
    dump_split(adapter, data, {path!r}, tiny_dump_config(), progress=False)
    print("done", flush=True)
""")

def _markers(path: Path) -> int:
    d = path / "chunk_nan_count" / "c"
    return sum(1 for f in d.iterdir() if f.name.isdigit()) if d.is_dir() else 0


def test_sigkill_at_a_random_point_then_resume_equals_uninterrupted(tmp_path, capsys):
    adapter, data = tiny_adapter_and_data(n_seq=60)
    kill_cfg = tiny_dump_config()  # the child's config: 7 sequences a batch, 16-row chunks
    ref = dump_split(adapter, data, memory_store(), kill_cfg)
    n_chunks = -(-ref.n_tokens // kill_cfg.chunk_tokens)
    path = tmp_path / "val.zarr"
    script = tmp_path / "child.py"
    script.write_text(_CHILD.format(repo=str(REPO), path=str(path)))
    rng = random.Random(1234)
    target = rng.randint(2, n_chunks - 3)  # chunks written before the kill (then a random extra delay)
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            cwd=REPO, env={**os.environ, "PYTHONPATH": f"{REPO / 'pipeline'}{os.pathsep}{REPO}"}, text=True)
    assert proc.stdout.readline().strip() == "ready"
    deadline = time.monotonic() + 60
    while _markers(path) < target and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.002)
    time.sleep(rng.uniform(0, 0.03))  # anywhere inside the next chunk's write
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    killed_at = _markers(path)
    assert target <= killed_at < n_chunks
    with pytest.raises(StoreError, match="incomplete"):
        open_store(path)
    capsys.readouterr()
    st = dump_split(adapter, data, path, kill_cfg)
    assert f"resuming ({killed_at} of {n_chunks} chunks" in capsys.readouterr().err
    _same_stores(open_store(path), ref)
    assert st.attrs["complete"]


# ----------------------------------------------------------------------------- config and stage

def test_config_defaults_match_params_yaml_and_reject_bad_values():
    cfg = load_section(DumpConfig, "dump", REPO / "params.yaml")
    # the one difference: the default experiment looks inside its one looped layer, the library default (any model,
    # an LM's many wide layers included) does not
    assert cfg == DumpConfig(layers=(0,), heads=(0,))
    assert cfg.sequences == {"fit": 1024, "val": 512, "test": 512}
    with pytest.raises(ConfigError, match="unknown key 'chunk'"):
        from_dict(DumpConfig, {"chunk": 3}, "dump")
    with pytest.raises(ConfigError, match="hidden_dtype"):
        DumpConfig(hidden_dtype="int8")
    with pytest.raises(ConfigError, match="unknown split 'train'"):
        DumpConfig(sequences={"train": 3})


def test_stage_dumps_every_split_with_checkpoint_seeds(tmp_path, tiny_base):
    from typer.testing import CliRunner

    import looptrace.stages.dump as stage
    from looptrace.models.train import train_model


    train_model(tiny_base, tiny_train_config(steps=2), "rp", "uniform", tmp_path / "train" / "rp-uniform",
                progress=False)
    params = tmp_path / "params.yaml"
    params.write_text("base: {seed: 0, threads: 1, device: cpu}\n"
                      "dump: {sequences: {fit: 12, val: 6, test: 5}, batch_size: 4, chunk_tokens: 20}\n")
    import typer

    app = typer.Typer()
    app.command()(stage.main)
    res = CliRunner().invoke(app, ["--model", "rp-uniform", "--params", str(params),
                                   "--train-root", str(tmp_path / "train"), "--out", str(tmp_path / "dump")])
    assert res.exit_code == 0, res.output
    task = make_task("rp", {"kind": "running_parity", "length": 8})
    for split, n, seed in (("fit", 12, 42), ("val", 6, 43), ("test", 5, 44)):
        st = open_store(tmp_path / "dump" / "rp-uniform" / f"{split}.zarr")
        data = task.dataset(split, n, seed)
        assert st.attrs["split"] == split and st.attrs["data_seed"] == seed
        np.testing.assert_array_equal(st.read("token_id"), data.tokens[data.targets != IGNORE])
        assert st.attrs["token_types"] == task.token_types and st.n_loops == 4
    res = CliRunner().invoke(app, ["--model", "nope", "--params", str(params), "--train-root", str(tmp_path)])
    assert res.exit_code == 2 and "not found" in res.output


def test_dump_refuses_shared_prefixes_and_row_split_checkpoints(tmp_path):
    """dump_model measures the scored-prefix overlap of the splits it dumps and records it; it refuses, in one line
    and before writing, a test split that shares scored prefixes with fit/val or a checkpoint trained on row-split
    data, unless dump.allow_prefix_overlap."""
    from looptrace.capture.dump import dump_model
    from looptrace.capture.prefix_overlap import PrefixOverlapError

    adapter, _ = tiny_adapter_and_data(n_seq=4)
    model, seeds = adapter.model, {"fit": 42, "val": 43, "test": 44}
    cfg = DumpConfig(sequences={"fit": 8, "val": 4, "test": 4}, batch_size=4, chunk_tokens=16)
    task = make_task("rs", {"kind": "running_sum", "length": 8, "modulus": 5})
    st = dump_model(adapter, task, seeds, tmp_path / "ok", cfg, progress=False)
    a = st["test"].attrs["prefix_overlap"]
    assert a["shared_any"] == 0 and a["n_scored"] == st["test"].n_tokens and a["splits"] == ["fit", "val", "test"]
    assert not a["allowed"] and a["report"]["shared_with"]["val"] == {"fit": 0, "test": 0}

    old = LoopedTransformerAdapter(model, "rs-old", checkpoint_hash="abc",  # a checkpoint from before split_rule
                                   extra={"task": {k: v for k, v in task.spec().items() if k != "split_rule"}})
    with pytest.raises(PrefixOverlapError, match=r"trained on split_rule 'sequence'.*dump.allow_prefix_overlap"):
        dump_model(old, task, seeds, tmp_path / "old", cfg, progress=False)
    assert not (tmp_path / "old" / "test.zarr").exists()

    rows = make_task("rs", {"kind": "running_sum", "length": 8, "modulus": 5, "split_rule": "sequence"})
    leaky = LoopedTransformerAdapter(model, "rs-rows", checkpoint_hash="abc", extra={"task": task.spec()})
    with pytest.raises(PrefixOverlapError) as err:
        dump_model(leaky, rows, seeds, tmp_path / "rows", cfg, progress=False)
    msg = str(err.value)
    assert "split 'test' has" in msg and "dump.allow_prefix_overlap: true" in msg and "\n" not in msg
    assert not (tmp_path / "rows").exists() or not any((tmp_path / "rows").iterdir())
    st = dump_model(leaky, rows, seeds, tmp_path / "rows", DumpConfig(**{**cfg.__dict__, "allow_prefix_overlap": True}),
                    progress=False)
    a = st["test"].attrs["prefix_overlap"]
    assert a["allowed"] and a["shared_any"] > 0 and a["shared_with"]["fit"] > 0


def test_statistics_row_groups_write_the_same_store(monkeypatch):
    """One row per statistics group (STAT_GROUP_BYTES tiny) writes the same store, bit for bit, as one group."""
    import looptrace.capture.dump as dump_mod

    adapter, data = tiny_adapter_and_data()
    cfg = DumpConfig(batch_size=7, chunk_tokens=16)
    one = dump_split(adapter, data, memory_store(), cfg, {"split": "val"})
    monkeypatch.setattr(dump_mod, "STAT_GROUP_BYTES", 1)
    assert len(dump_mod.stat_row_groups(5, 4, torch.device("cpu"))) == 5
    _same_stores(dump_split(adapter, data, memory_store(), cfg, {"split": "val"}), one)
