"""One writer per output for every stage, and a killed run's staging debris removed.

Every stage takes :func:`looptrace.io.claims.output_lock` on its output before it writes: a second run on the same
output while the first is alive is refused with one line naming it (pid, host, start); a killed run's claim is
taken over, and the staging dirs its :func:`~looptrace.io.artifacts.atomic_dir` left beside the output are removed.
"""

from __future__ import annotations

import os
import socket
import sys

import numpy as np
from typer.testing import CliRunner

from looptrace.cli import app
from looptrace.io.artifacts import clear_debris
from looptrace.io.claims import output_lock
from looptrace.io.claims_dir import claims_location
from tests.builders import random_signal_arrays, write_arrays


def _geometry(tmp_path):
    for i, s in enumerate(("fit", "val", "test")):
        write_arrays(tmp_path / "dump" / "m" / f"{s}.zarr", random_signal_arrays(np.random.default_rng(i), N=40))
    params = tmp_path / "params.yaml"
    params.write_text("geometry: {eps: {kl_prev: [0.001]}}\n")
    argv = ["geometry", "--model", "m", "--params", str(params), "--dump-root", str(tmp_path / "dump"),
            "--out", str(tmp_path / "geometry")]
    return lambda: CliRunner().invoke(app, argv)


def test_a_live_writer_is_named_and_the_second_run_refused(tmp_path):
    run = _geometry(tmp_path)
    out = tmp_path / "geometry" / "m"
    with output_lock(out):  # a live writer (this process) holds the output
        res = run()
    assert res.exit_code == 2
    line = res.stderr.strip()
    assert len(line.splitlines()) == 1 and f"{out}" in line and "is being written by" in line
    assert f"pid {os.getpid()}" in line and socket.gethostname() in line
    assert not out.exists()
    res = run()  # the holder is gone: the run goes through and leaves no claims dir
    assert res.exit_code == 0, res.stderr
    assert (out / "token_loop.parquet").is_file() and not os.path.exists(claims_location(str(out)))


def test_killed_runs_staging_debris_is_removed(tmp_path):
    out = tmp_path / "geometry" / "m"
    out.parent.mkdir(parents=True)
    debris = [out.parent / ".m.ab12cd_9.tmp", out.parent / ".m.old"]
    for d in debris:
        d.mkdir()
        (d / "token_loop.parquet").write_bytes(b"")  # the 0-byte Parquet a kill mid-write leaves
    keep = [out.parent / ".other.ab12cd_9.tmp", out.parent / ".m.claims.x"]
    for k in keep:
        k.mkdir()
    assert clear_debris(out) == sorted(debris)
    assert all(not d.exists() for d in debris) and all(k.exists() for k in keep)
    for d in debris:  # and through a stage run
        d.mkdir()
    res = _geometry(tmp_path)()
    assert res.exit_code == 0, res.stderr
    assert all(not d.exists() for d in debris) and (out / "token_loop.parquet").stat().st_size > 0


def test_a_claim_of_an_exited_unreaped_process_is_not_live():
    """A pool worker of a killed stage exits but may stay a zombie (nothing reaps orphans in some containers): its
    claim must be taken over, while a running process's is live."""
    import dataclasses
    import subprocess
    import time

    import psutil

    from looptrace.io.claims_dir import Owner, is_live, this_host

    def record(pid: int) -> dict:
        owner = Owner(id=f"t-{pid}", host=this_host(), pid=pid, pid_start=psutil.Process(pid).create_time(),
                      started=time.time())
        return {"owner": dataclasses.asdict(owner), "state": "active", "heartbeat": time.time()}

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        rec = record(child.pid)
        assert is_live(rec, lease_s=60.0)
        child.kill()
        deadline = time.time() + 10
        while psutil.Process(child.pid).status() != psutil.STATUS_ZOMBIE and time.time() < deadline:
            time.sleep(0.01)
        assert psutil.Process(child.pid).status() == psutil.STATUS_ZOMBIE  # exited, not yet reaped
        assert not is_live(rec, lease_s=60.0)
    finally:
        child.kill()
        child.wait()
