"""Stores on object storage: a real S3 API on loopback — a moto server subprocess on 127.0.0.1,
started here — with credentials and endpoint only in the environment (``AWS_*``), as a user would set them.

The dump stage writes ``s3://…`` stores and the geometry stage reads them, both through ``looptrace.cli.app``
with URL roots, and geometry's Parquet outputs equal those of the same run on local stores; two shard
processes dump one S3 store together and it equals the 1-process store.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from looptrace.capture.dump import dump_split
from looptrace.io.store.location import remove_store, store_exists
from looptrace.io.store.reader import open_store
from looptrace.io.store.writer import write_store
from tests.builders import random_store_arrays, tiny_adapter_and_data, tiny_checkpoint, tiny_dump_config

pytest.importorskip("s3fs")
pytest.importorskip("moto")

REPO = Path(__file__).resolve().parents[1]
CHILD = REPO / "tests" / "dump_child.py"
BUCKET = "looptrace-test"

pytestmark = [pytest.mark.filterwarnings("ignore:Unclosed client session"),
              pytest.mark.filterwarnings("ignore:Unclosed connector")]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def s3():
    """A moto S3 server on 127.0.0.1 (subprocess), its endpoint and fake credentials in ``os.environ``."""
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
           "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_EC2_METADATA_DISABLED": "true"}
    with pytest.MonkeyPatch.context() as mp:
        for k, v in env.items():
            mp.setenv(k, v)
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, "moto server did not start"
                time.sleep(0.1)
        import fsspec

        fs = fsspec.filesystem("s3", skip_instance_cache=True)
        fs.mkdir(BUCKET)
        yield env
        proc.terminate()
        proc.wait(timeout=30)


def test_store_round_trip_and_refusals_on_s3(s3):
    arrays = random_store_arrays(gate=True)
    url = f"s3://{BUCKET}/rt/val.zarr"
    st = write_store(url, arrays, {"split": "val"}, chunk_tokens=10)
    assert st.label == url and store_exists(url)
    st = open_store(url, verify=True)
    for k in ("hidden", "entropy", "sequence"):
        np.testing.assert_array_equal(st.read(k), arrays[k].astype(st.read(k).dtype))
    # pathlib collapses the scheme's '//' (Path(root) / model / "val.zarr" in the stages): still the URL
    assert open_store(Path(f"s3://{BUCKET}/rt") / "val.zarr").label == url
    with pytest.raises(Exception, match=f"store s3://{BUCKET}/nope.zarr not found; run `looptrace dump` first"):
        open_store(f"s3://{BUCKET}/nope.zarr")
    remove_store(url)
    assert not store_exists(url)


def test_dump_and_geometry_stages_on_s3_equal_local(s3, tmp_path):
    from typer.testing import CliRunner

    from looptrace.cli import app

    tiny_checkpoint(tmp_path / "train")
    params = tmp_path / "params.yaml"
    params.write_text("base: {seed: 0, threads: 1, device: cpu}\n"
                      "dump: {sequences: {val: 8, test: 8}, batch_size: 4, chunk_tokens: 32}\n"
                      "geometry: {splits: [val, test]}\n")
    runner = CliRunner()
    outs = {}
    for where, root in (("s3", f"s3://{BUCKET}/dump"), ("local", str(tmp_path / "dump"))):
        res = runner.invoke(app, ["dump", "--model", "rs-joint", "--params", str(params),
                                  "--train-root", str(tmp_path / "train"), "--out", root])
        assert res.exit_code == 0, res.output
        res = runner.invoke(app, ["geometry", "--model", "rs-joint", "--params", str(params), "--dump-root", root,
                                  "--out", str(tmp_path / f"geometry-{where}")])
        assert res.exit_code == 0, res.output
        outs[where] = tmp_path / f"geometry-{where}" / "rs-joint"
    parquet = sorted(p.name for p in outs["local"].glob("*.parquet"))
    assert parquet and parquet == sorted(p.name for p in outs["s3"].glob("*.parquet"))
    for name in parquet:
        assert (outs["s3"] / name).read_bytes() == (outs["local"] / name).read_bytes(), name
    st = open_store(f"s3://{BUCKET}/dump/rs-joint/test.zarr", verify=True)
    assert st.complete and st.attrs["split"] == "test"
    import fsspec

    fs = fsspec.filesystem("s3", skip_instance_cache=True, use_listings_cache=False)
    assert not [p for p in fs.ls(f"{BUCKET}/dump/rs-joint") if p.endswith(".claims")]  # no claims left behind
    # a missing store named by URL: one line, exit 2
    res = runner.invoke(app, ["geometry", "--model", "nope", "--params", str(params),
                              "--dump-root", f"s3://{BUCKET}/dump", "--out", str(tmp_path / "g")])
    assert res.exit_code == 2 and f"s3://{BUCKET}/dump/nope/val.zarr not found" in res.output


def test_two_shard_processes_on_s3_equal_one_process(s3, tmp_path):
    torch.set_num_threads(1)
    adapter, data = tiny_adapter_and_data(n_seq=60)
    cfg = {"chunk_tokens": 64}  # few objects: moto is one single-threaded Python server
    ref = dump_split(adapter, data, tmp_path / "ref.zarr", tiny_dump_config(**cfg), progress=False)
    url = f"s3://{BUCKET}/shards/val.zarr"
    procs = [subprocess.Popen([sys.executable, str(CHILD), json.dumps({"path": url, "shard": [i, 2], "cfg": cfg})],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=dict(os.environ))
             for i in range(2)]
    outs = [p.communicate(timeout=180) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    st = open_store(url, verify=True)
    assert st.complete and st.names == ref.names and st.attrs == ref.attrs
    for name in st.names:
        np.testing.assert_array_equal(st.read(name), ref.read(name), err_msg=name)
