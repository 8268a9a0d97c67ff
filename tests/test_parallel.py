"""The offline stages on Dask (looptrace.io.parallel): on a LocalCluster of 2 single-threaded worker processes,
geometry, readouts, gates and diagnose write the same bytes as in this process; results come back in chunk order;
a worker's error is the stage's one-line error; the default (scheduler null) never imports dask.

One cluster for the module (startup is seconds); every stage runs on tiny stores of several chunks.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import polars as pl
import pytest

from looptrace.config import ConfigError, DaskConfig, from_dict
from looptrace.io import parallel
from looptrace.io.parallel import DaskRunner, dask_runner, map_chunks, map_tasks, scheduler_of
from tests.builders import random_signal_arrays, two_group_stores, write_arrays

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def runner():
    pytest.importorskip("distributed")
    from distributed import Client, LocalCluster

    cluster = LocalCluster(n_workers=2, threads_per_worker=1, processes=True, host="127.0.0.1",
                           dashboard_address=":0")
    client = Client(cluster)
    client.run(parallel.tune_allocator)
    try:
        yield DaskRunner(client, max_in_flight=3)  # a window smaller than the chunk count: the bound is exercised
    finally:
        client.close()
        cluster.close()


def digests(root: Path, skip: tuple[str, ...] = ()) -> dict[str, str]:
    """relative path -> md5 of every file under root (except names in ``skip``)."""
    return {str(p.relative_to(root)): hashlib.md5(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and p.name not in skip}


def without_timings(obj):
    """A metrics dict without its wall-clock entries (``seconds``, ``fit_seconds`` ...)."""
    if isinstance(obj, dict):
        return {k: without_timings(v) for k, v in obj.items() if not k.endswith("seconds")}
    if isinstance(obj, list):
        return [without_timings(v) for v in obj]
    return obj


# ---------------------------------------------------------------------------------------------- no cluster

def test_config_and_scheduler_choice(monkeypatch):
    assert from_dict(DaskConfig, {}, "base.dask") == DaskConfig(None, None, None)
    assert from_dict(DaskConfig, {"scheduler": "tcp://10.0.0.5:8786", "max_in_flight": 8}, "base.dask").max_in_flight == 8
    for bad, match in (({"scheduler": "locla"}, "scheduler"), ({"workers": 0}, "workers"),
                       ({"max_in_flight": "4"}, "max_in_flight"), ({"wokers": 2}, "unknown key 'wokers'")):
        with pytest.raises(ConfigError, match=match):
            from_dict(DaskConfig, bad, "base.dask")
    monkeypatch.delenv(parallel.SCHEDULER_ENV, raising=False)
    assert scheduler_of(DaskConfig("local")) == "local" and scheduler_of(DaskConfig()) is None
    monkeypatch.setenv(parallel.SCHEDULER_ENV, "tcp://127.0.0.1:1")
    assert scheduler_of(DaskConfig()) == "tcp://127.0.0.1:1"
    monkeypatch.setenv(parallel.SCHEDULER_ENV, "null")
    assert scheduler_of(DaskConfig("local")) is None


def test_params_yaml_default_is_in_process(repo_root):
    from looptrace.config import load_base

    assert load_base(repo_root / "params.yaml").dask == DaskConfig()


def test_default_never_imports_dask(tmp_path):
    """scheduler null: the stage's loop runs here and neither dask nor distributed is imported."""
    code = f"""
import sys
from looptrace.config import DaskConfig
from looptrace.geometry.stage import GeometryConfig, geometry_model
from looptrace.io.parallel import dask_runner
from tests.builders import random_signal_arrays, write_arrays
import numpy as np
st = write_arrays({str(tmp_path / 's.zarr')!r}, random_signal_arrays(np.random.default_rng(0), N=50), chunk_tokens=16)
with dask_runner(DaskConfig()) as r:
    assert r is None
    geometry_model({{"test": st}}, GeometryConfig(splits=("test",)), {str(tmp_path / 'g')!r}, runner=r, progress=False)
bad = sorted(m for m in sys.modules if m.split(".")[0] in ("dask", "distributed"))
assert not bad, bad
print("ok")
"""
    env = {k: v for k, v in __import__("os").environ.items() if k != parallel.SCHEDULER_ENV}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr[-2000:]


def test_in_process_map_keeps_order():
    assert list(map_tasks(divmod, [7, 9, 11], (4,))) == [(1, 3), (2, 1), (2, 3)]


def _slow_slice(st, tokens: slice, delays: tuple) -> tuple[int, int]:
    time.sleep(delays[tokens.start // 16])
    return _rows(st, tokens)


def test_read_ahead_threads_keep_order_and_results(tmp_path):
    """map_chunks(ahead=k): later slices that finish first still come back after earlier ones, same values as
    the serial loop; at most k + 1 calls run at once."""
    import threading

    st = write_arrays(tmp_path / "s.zarr", random_signal_arrays(np.random.default_rng(1), N=100), chunk_tokens=16)
    delays = (0.2, 0.0, 0.1, 0.0, 0.15, 0.0, 0.0)  # slice 1 finishes before slice 0, …
    serial = list(map_chunks(_rows, st, st.blocks()))
    assert serial[0] == (0, int(st.read("target", slice(0, 16)).sum())) and len(serial) == 7
    running, peak, lock = [0], [0], threading.Lock()

    def counted(store, tokens, d):
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        try:
            return _slow_slice(store, tokens, d)
        finally:
            with lock:
                running[0] -= 1

    for ahead in (1, 2):
        peak[0] = 0
        assert list(map_chunks(counted, st, st.blocks(), (delays,), ahead=ahead)) == serial
        assert 2 <= peak[0] <= ahead + 1


def test_read_ahead_error_and_early_close_leave_no_thread(tmp_path):
    """A call's exception is the consumer's exception; closing the iterator early cancels the calls not yet
    started (they never run) and joins the running ones."""
    import threading

    st = write_arrays(tmp_path / "s.zarr", random_signal_arrays(np.random.default_rng(1), N=100), chunk_tokens=16)
    started: list[int] = []

    def fn(store, tokens):
        started.append(tokens.start)
        if tokens.start == 32:
            raise ValueError("chunk 2 is bad")
        time.sleep(0.05)
        return tokens.start

    with pytest.raises(ValueError, match="chunk 2 is bad"):
        list(map_chunks(fn, st, st.blocks(), ahead=1))
    assert max(started) <= 48  # slice 2 failed while at most slice 3 had started; 4–6 never ran
    started.clear()
    it = map_chunks(fn, st, st.blocks(), ahead=1)
    assert next(it) == 0
    it.close()
    assert 0 in started and set(started) <= {0, 16}  # slice 2 was never submitted, slice 1 cancelled or joined
    assert not [t for t in threading.enumerate() if t.name.startswith("looptrace-chunk")]


# ---------------------------------------------------------------------------------------------- on the cluster

def _slow_identity(i: int, delays: tuple) -> int:
    time.sleep(delays[i])
    return i


def test_results_come_back_in_submission_order(runner):
    delays = tuple(float(d) for d in np.random.default_rng(0).uniform(0, 0.15, 10))
    assert list(map_tasks(_slow_identity, range(10), (delays,), runner)) == list(range(10))


def _rows(st, tokens: slice) -> tuple[int, int]:
    return tokens.start, int(st.read("target", tokens).sum())


def test_map_chunks_opens_the_store_on_the_workers(runner, tmp_path):
    st = write_arrays(tmp_path / "s.zarr", random_signal_arrays(np.random.default_rng(1), N=100), chunk_tokens=16)
    want = list(map_chunks(_rows, st, st.blocks()))
    assert list(map_chunks(_rows, st, st.blocks(), runner=runner)) == want and len(want) == 7
    from looptrace.io.store.location import memory_store
    from looptrace.io.store.writer import write_store

    mem = write_store(memory_store(), random_signal_arrays(np.random.default_rng(1), N=20), {"vocab_size": 4})
    with pytest.raises(ValueError, match="in memory"):
        list(map_chunks(_rows, mem, mem.blocks(), runner=runner))


def test_a_worker_error_is_the_stage_error(runner, tmp_path):
    """A damaged chunk read on a worker raises the same one-line StoreError as in this process."""
    from looptrace.geometry.stage import GeometryConfig, geometry_model
    from looptrace.io.store.schema import StoreError

    st = write_arrays(tmp_path / "s.zarr", random_signal_arrays(np.random.default_rng(2), N=64), chunk_tokens=16)
    chunk = tmp_path / "s.zarr" / "hidden" / "c" / "2" / "0" / "0"
    raw = bytearray(chunk.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    chunk.write_bytes(bytes(raw))
    msgs = []
    for r in (None, runner):
        with pytest.raises(StoreError, match="damaged chunk") as exc:
            geometry_model({"test": st}, GeometryConfig(splits=("test",)), tmp_path / "g", progress=False, runner=r)
        msgs.append(str(exc.value))
    assert msgs[0] == msgs[1] and not (tmp_path / "g").exists()


def test_geometry_same_bytes(runner, tmp_path):
    """Two looped groups (DLR rows), a native gate, float16 states, several chunks per split and a block size
    that is not the chunk size."""
    from looptrace.geometry.stage import GeometryConfig, geometry_model
    from looptrace.io.store.reader import open_store

    stores = {}
    for i, split in enumerate(("fit", "val", "test")):
        a = random_signal_arrays(np.random.default_rng(10 + i), N=150 + 20 * i, T=5, D=24, loop_group=(0, 0, 0, 1, 1))
        write_arrays(tmp_path / "d" / f"{split}.zarr", a, chunk_tokens=32, hidden_dtype="float16")
        stores[split] = open_store(tmp_path / "d" / f"{split}.zarr")
    for block in (None, 48):
        cfg = GeometryConfig(eps={"kl_prev": (0.3, 0.1), "rel_step": (0.5,), "argmax": (0.5,)}, block_tokens=block)
        geometry_model(stores, cfg, tmp_path / f"a{block}", meta={"model": "m"}, progress=False)
        geometry_model(stores, cfg, tmp_path / f"b{block}", meta={"model": "m"}, progress=False, runner=runner)
        a, b = digests(tmp_path / f"a{block}"), digests(tmp_path / f"b{block}")
        assert set(a) == {"token_loop.parquet", "loop_summary.parquet", "convergence.parquet", "dlr.parquet",
                          "metrics.json", "manifest.json"}
        assert a == b
    assert pl.read_parquet(tmp_path / "aNone" / "dlr.parquet").height == 3


def test_readouts_gates_diagnose_same_bytes(runner, tmp_path):
    """The offline chain on two models (dump stores -> geometry -> readouts; gates; diagnose), once in this
    process and once on the cluster: every output file is the same, but for wall-clock entries."""
    from looptrace.diagnose.config import DiagnoseConfig
    from looptrace.diagnose.stage import diagnose_models, write_diagnosis
    from looptrace.gates.config import GatesConfig
    from looptrace.gates.stage import gates_stage
    from looptrace.geometry.stage import GeometryConfig, geometry_model
    from looptrace.rules.readouts import ReadoutsConfig, readouts_model
    from looptrace.rules.scoring import CalibrationConfig

    models = ("rp-uniform", "rp-joint")
    stores = {m: two_group_stores(tmp_path / "dump", m, n=(300, 200, 200), seed=i) for i, m in enumerate(models)}
    gcfg = from_dict(GatesConfig, {
        "gates": ["logreg-oracle", "mlp-consistent", "logreg-utility", "ponder-linear"],
        "cross_gates": ["logreg-oracle", "ponder-linear"], "pca_components": 4, "max_fit_tokens": 150,
        "stats": ["entropy", "kl_prev", "rel_step"], "mlp_max_iter": 10, "ponder": {"epochs": 5, "batch_tokens": 128},
    }, "gates")
    cal = CalibrationConfig(n_quantiles=21)
    rules = ("fixed", "entropy", "top1", "kl_prev", "rel_step", "argmax_stable", "oracle")
    for where, r in (("a", None), ("b", runner)):
        root = tmp_path / where
        for m in models:
            geometry_model(stores[m], GeometryConfig(), root / "geometry" / m, progress=False, runner=r)
            readouts_model(root / "geometry" / m, ReadoutsConfig(rules=rules), cal, root / "readouts" / m,
                           meta={"model": m, "task": "rp", "regime": m.split("-")[1], "regime_kind": m.split("-")[1]},
                           progress=False, runner=r)
        gates_stage(stores, gcfg, cal, root / "gates", base_seed=3, tasks=dict.fromkeys(models, "rp"), progress=False,
                    threads=1, runner=r)
        frames, summary, metrics = diagnose_models(models, root / "readouts", root / "gates", root / "geometry",
                                                   DiagnoseConfig(), progress=False, runner=r)
        write_diagnosis(root / "diagnose", frames, summary, metrics)
    a, b = tmp_path / "a", tmp_path / "b"
    # gates.json records fit times; the skops archive of the estimators and the ponder weights are bytes-equal
    skip = ("metrics.json", "gates.json", "manifest.json")  # manifests: compared below (gates': digests of timings)
    da, db = digests(a, skip=skip), digests(b, skip=skip)
    for p in sorted(a.rglob("manifest.json")):
        if "gates" not in p.parts:
            assert p.read_bytes() == (b / p.relative_to(a)).read_bytes(), p
    # geometry, readouts, gates, cross, diagnose (6 tables, faithfulness and convergence_router among them, + summary)
    assert da == db and len(da) == 2 * 4 + 2 * 5 + 2 * 7 + 1 + 6 + 1
    for p in sorted([*a.rglob("metrics.json"), *a.rglob("gates.json")]):
        q = b / p.relative_to(a)
        if "gates" in p.parts:  # the gates stage records fit times
            assert without_timings(json.loads(p.read_text())) == without_timings(json.loads(q.read_text())), p
        else:
            assert p.read_bytes() == q.read_bytes(), p


def test_dask_runner_local_from_config(monkeypatch, tmp_path):
    """``scheduler: local`` starts and closes its own LocalCluster (2 workers) around the stage."""
    pytest.importorskip("distributed")
    monkeypatch.delenv(parallel.SCHEDULER_ENV, raising=False)
    st = write_arrays(tmp_path / "s.zarr", random_signal_arrays(np.random.default_rng(3), N=40), chunk_tokens=16)
    with dask_runner(DaskConfig("local", workers=1, max_in_flight=2)) as r:
        assert isinstance(r, DaskRunner) and r.max_in_flight == 2
        assert len(r.client.nthreads()) == 1
        assert list(map_chunks(_rows, st, st.blocks(), runner=r)) == list(map_chunks(_rows, st, st.blocks()))
        assert all(r.client.run(parallel.tune_allocator).values())
    assert r.client.status == "closed"
