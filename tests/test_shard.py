"""Several processes, one store: N cooperating writers each dump a chunk-aligned range; the result
equals a 1-process dump file for file; a killed shard resumes; an overlapping claim is refused in one line.
Also the claims protocol itself (io/claims.py, io/claims_dir.py): liveness, takeover, leases of other hosts, fencing, locks."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from looptrace.capture.dump import dump_split
from looptrace.io.claims import Coordinator, output_lock
from looptrace.io.claims_dir import (
    ClaimError,
    ClaimsDir,
    Owner,
    claims_location,
    parse_shard,
    shard_from_env,
    shard_range,
)
from looptrace.io.store.location import memory_store
from looptrace.io.store.reader import open_store
from looptrace.io.store.schema import StoreError
from looptrace.io.store.writer import StoreWriter
from tests.builders import tiny_adapter_and_data, tiny_checkpoint, tiny_dump_config

REPO = Path(__file__).resolve().parents[1]
CHILD = REPO / "tests" / "dump_child.py"


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


def spawn(path, shard=(0, 1), delay=0.0, cfg=None, env=None, hold=0.0) -> subprocess.Popen:
    """A dump of the tiny model (60 sequences, 16-row chunks) in a child process (tests/dump_child.py)."""
    args = {"path": str(path), "shard": list(shard), "delay": delay, "cfg": cfg or {}, "hold": hold}
    proc = subprocess.Popen([sys.executable, str(CHILD), json.dumps(args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, cwd=REPO, env={**os.environ, **(env or {})}, text=True)
    return proc


def wait_line(proc: subprocess.Popen, prefix: str, count: int = 1, timeout: float = 60) -> list[str]:
    """Read the child's stdout until ``count`` lines starting with ``prefix`` (all lines read so far)."""
    seen, lines, t0 = 0, [], time.monotonic()
    while seen < count:
        line = proc.stdout.readline()
        if not line:
            raise AssertionError(f"child ended before {count}× {prefix!r}: {lines} {proc.stderr.read()[-2000:]}")
        lines.append(line.strip())
        seen += line.startswith(prefix)
        assert time.monotonic() - t0 < timeout, lines
    return lines


def finish(proc: subprocess.Popen, timeout: float = 90) -> tuple[int, str]:
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out + err


def tree(path: Path) -> dict[str, bytes]:
    """Every file below ``path`` -> its bytes (the whole store, metadata included)."""
    return {str(f.relative_to(path)): f.read_bytes() for f in sorted(path.rglob("*")) if f.is_file()}


def assert_same_tree(a: Path, b: Path) -> None:
    ta, tb = tree(a), tree(b)
    assert sorted(ta) == sorted(tb)
    different = [k for k in ta if ta[k] != tb[k]]
    assert not different, different[:5]


def assert_clean(path: Path) -> None:
    """No claims directory beside the store, no temp file inside it."""
    claims = Path(claims_location(str(path)))
    assert not claims.exists(), {f.name: f.read_text()[:400] for f in sorted(claims.iterdir())}
    assert not list(path.rglob("*.partial")) and not list(path.parent.glob(".*.claims"))



# ----------------------------------------------------------------------------- plans are chunk-aligned

def test_shard_ranges_are_disjoint_whole_chunks_covering_the_store():
    for n_chunks in (0, 1, 2, 5, 17, 64):
        for n in (1, 2, 3, 7):
            ranges = [shard_range(n_chunks, i, n) for i in range(n)]
            assert [c for r in ranges for c in r] == list(range(n_chunks))  # contiguous, disjoint, covering
    assert parse_shard("1/2") == (1, 2) and parse_shard(" 0 / 3 ") == (0, 3)
    for bad in ("2/2", "1", "a/b", "-1/2", "0/0"):
        with pytest.raises(ClaimError, match="expected i/N"):
            parse_shard(bad)
    assert shard_from_env({}) == (0, 1) and shard_from_env({"RANK": "1", "WORLD_SIZE": "4"}) == (1, 4)
    with pytest.raises(ClaimError, match="RANK=4 / WORLD_SIZE=4"):
        shard_from_env({"RANK": "4", "WORLD_SIZE": "4"})


def test_a_writer_only_writes_whole_chunks_of_its_own_range(tmp_path):
    adapter, data = tiny_adapter_and_data(n_seq=60)
    cfg = tiny_dump_config()
    path = tmp_path / "val.zarr"
    st = dump_split(adapter, data, path, cfg, progress=False, shard=(0, 2))  # shard 0 of 2 alone
    assert not st.complete
    w = StoreWriter.reopen(path)
    own = shard_range(w.n_chunks, 0, 2)
    for name in ("hidden", "entropy", "sequence"):
        written = sorted(int(f.parent.parent.name if name == "hidden" else f.parent.name if name == "entropy"
                             else f.name) for f in (path / name / "c").rglob("*") if f.is_file())
        assert written == list(own), name  # only whole chunks of its range, nothing else
    w.own = own
    rows = w.chunk_rows(own.stop)
    with pytest.raises(StoreError, match=rf"chunk {own.stop} is outside this writer's claimed range 0\.\.{own.stop - 1}"):
        w.write_chunk(own.stop, {n: np.zeros((rows.stop - rows.start, *w._arrays[n].shape[1:]))
                                 for n in w.token_arrays})
    with pytest.raises(StoreError, match="incomplete"):
        open_store(path)


# ----------------------------------------------------------------------------- N processes, one store

def test_two_processes_equal_one_process_file_for_file(tmp_path, reference):
    path = tmp_path / "val.zarr"
    procs = [spawn(path, (i, 2)) for i in range(2)]
    results = [finish(p) for p in procs]
    assert [rc for rc, _ in results] == [0, 0], results
    assert sorted(r[1].split("done ")[1].split()[0] for r in results) in (["False", "True"], ["True", "True"])
    assert_same_tree(path, reference)  # arrays, attributes and consolidated metadata, byte for byte
    assert_clean(path)
    st = open_store(path, verify=True)
    assert st.complete and st.attrs == open_store(reference).attrs


def test_a_release_landing_after_the_peers_tidy_is_tidied_too(tmp_path, reference, monkeypatch):
    """The CI race of stop 32, made deterministic: shard 0 returns with shard 1 still writing and releases its
    plan record (temp file + replace); shard 1 finalises and tidies the claims *between* the two (the young temp
    file keeps the directory), so the replace re-creates a record beside the complete store. Shard 0 must find
    the store complete after its last write and tidy it."""
    path = tmp_path / "val.zarr"
    adapter, data = tiny_adapter_and_data(n_seq=60)
    real_release_all = Coordinator.release_all
    real_overwrite = ClaimsDir.overwrite
    raced: list[str] = []

    def release_all(self):  # shard 0's exit: its next record write races shard 1's whole dump
        if self.i == 0 and not raced:
            self.dir.race = True
        real_release_all(self)

    def overwrite(self, name, rec):
        if not getattr(self, "race", False):
            return real_overwrite(self, name, rec)
        self.race = False
        assert os.path.exists(self._path(name))  # the record exists when the write starts
        fd, tmp = tempfile.mkstemp(dir=self.root, prefix=".tmp-")
        with os.fdopen(fd, "wb") as f:
            f.write(json.dumps(rec, sort_keys=True).encode())
        st = dump_split(adapter, data, path, tiny_dump_config(), progress=False, shard=(1, 2))  # the peer
        assert st.complete and not os.path.exists(self._path(name))  # it finalised and removed our record ...
        raced.append(name)
        os.replace(tmp, self._path(name))  # ... which our write now re-creates

    monkeypatch.setattr(Coordinator, "release_all", release_all)
    monkeypatch.setattr(ClaimsDir, "overwrite", overwrite)
    assert not dump_split(adapter, data, path, tiny_dump_config(), progress=False, shard=(0, 2)).complete
    assert raced == ["plan@0.json"]  # the planner's record, released at exit
    assert_same_tree(path, reference)
    assert_clean(path)


def test_a_killed_shard_resumes_and_the_store_equals_one_process(tmp_path, reference, capsys):
    path = tmp_path / "val.zarr"
    fast = spawn(path, (0, 2))
    slow = spawn(path, (1, 2), delay=0.05)
    wait_line(slow, "wrote", 2)
    slow.send_signal(signal.SIGKILL)
    slow.wait()
    rc, out = finish(fast)
    assert rc == 0 and "done False" in out, out  # its range is written; the store waits for shard 1
    with pytest.raises(StoreError, match="incomplete"):
        open_store(path)
    assert Path(claims_location(str(path))).is_dir()  # the killed shard's claim is left (dead)
    adapter, data = tiny_adapter_and_data(n_seq=60)
    st = dump_split(adapter, data, path, tiny_dump_config(), progress=False, shard=(1, 2))  # the rerun
    assert "resuming (" in capsys.readouterr().err and st.complete
    assert_same_tree(path, reference)
    assert_clean(path)


def test_an_overlapping_or_foreign_writer_is_refused_in_one_line(tmp_path, reference):
    path = tmp_path / "val.zarr"
    # it holds its claim after its first chunk until killed: on a loaded machine a third process can take longer to
    # start than a whole slow range takes to write (a finished range is not refused, it is simply done)
    running = spawn(path, (1, 2), hold=600.0)
    try:
        wait_line(running, "wrote", 1)
        adapter, data = tiny_adapter_and_data(n_seq=60)
        cfg = tiny_dump_config()
        cases = [((1, 2), cfg, rf"shard 1/2 is being written by pid {running.pid} on host \S+ \(started "),
                 ((1, 3), cfg, r"is being written as 2 shard\(s\) by pid \d+ .*shard 1/3 would overlap them"),
                 ((0, 1), cfg, r"is being written as 2 shard\(s\)"),
                 ((0, 2), tiny_dump_config(hidden_dtype="float32"), "with other parameters, checkpoint, data or code")]
        for shard, c, pattern in cases:
            with pytest.raises(ClaimError, match=pattern) as exc:
                dump_split(adapter, data, path, c, progress=False, shard=shard)
            assert "\n" not in str(exc.value)
        # a third *process* gets the same one line and exit status 2
        rc, out = finish(spawn(path, (1, 2)))
        assert rc == 2 and "error: store" in out and f"pid {running.pid}" in out, out
    finally:
        running.kill()
        running.wait()
    # the cooperating shard is still welcome, and after the kill the shard is taken over
    adapter, data = tiny_adapter_and_data(n_seq=60)
    dump_split(adapter, data, path, tiny_dump_config(), progress=False, shard=(0, 2))
    assert dump_split(adapter, data, path, tiny_dump_config(), progress=False, shard=(1, 2)).complete
    assert_same_tree(path, reference)


def test_cli_shards_and_torchrun_env_equal_one_process(tmp_path):
    """``looptrace dump --shard 0/2`` and a second process given RANK=1 WORLD_SIZE=2 (as torchrun sets them)."""
    tiny_checkpoint(tmp_path / "train")
    params = tmp_path / "params.yaml"
    params.write_text("base: {seed: 0, threads: 1, device: cpu}\n"
                      "dump: {sequences: {fit: 16, val: 8, test: 8}, batch_size: 4, chunk_tokens: 16}\n")
    exe = str(Path(sys.executable).parent / "looptrace")
    common = ["dump", "--model", "rs-joint", "--params", str(params), "--train-root", str(tmp_path / "train")]
    one = subprocess.run([exe, *common, "--out", str(tmp_path / "one")], capture_output=True, text=True, timeout=120)
    assert one.returncode == 0, one.stderr
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    a = subprocess.Popen([exe, *common, "--out", str(tmp_path / "two"), "--shard", "0/2"], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    b = subprocess.Popen([exe, *common, "--out", str(tmp_path / "two")], env={**env, "RANK": "1", "WORLD_SIZE": "2"},
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    outs = [p.communicate(timeout=120) for p in (a, b)]
    assert a.returncode == 0 and b.returncode == 0, outs
    for split in ("fit", "val", "test"):
        assert_same_tree(tmp_path / "two" / "rs-joint" / f"{split}.zarr", tmp_path / "one" / "rs-joint" / f"{split}.zarr")
        assert_clean(tmp_path / "two" / "rs-joint" / f"{split}.zarr")
    bad = subprocess.run([exe, *common, "--out", str(tmp_path / "x"), "--shard", "2/2"], capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode == 2 and bad.stderr.strip().count("\n") == 0 and "expected i/N" in bad.stderr


# ----------------------------------------------------------------------------- the protocol itself

def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_claims_of_another_host_expire_after_the_lease_and_a_zombie_is_fenced(tmp_path):
    target = str(tmp_path / "out.zarr")
    remote = Coordinator(target, "fp", (0, 1), lease_s=5.0)
    remote.me = Owner("remote1", "other-host", 4242, None, time.time())
    k = remote.new_plan("layout")
    remote.set_ready()
    name = remote.claim_shard(k)
    assert name == f"p{k}.shard0of1@0.json"
    here = Coordinator(target, "fp", (0, 1), lease_s=5.0)
    plan = here.current_plan()
    assert plan.active and plan.ready  # fresh heartbeat: alive, wherever it runs
    with pytest.raises(ClaimError, match=r"is being written by pid 4242 on host other-host \(started "):
        here.claim_shard(plan.gen)
    with pytest.raises(ClaimError, match="with other parameters"):
        Coordinator(target, "other-fp", (0, 1), lease_s=5.0).refuse_incompatible(plan)
    # no heartbeat for longer than the lease: dead, taken over (generation 1), and the zombie stops at its fence
    cd = ClaimsDir(claims_location(target))
    for n in cd.names():
        rec = cd.read(n)
        rec["heartbeat"] = time.time() - 10
        cd.overwrite(n, rec)
    assert not here.current_plan().active
    assert here.claim_shard(plan.gen) == f"p{k}.shard0of1@1.json"
    with pytest.raises(ClaimError, match="was taken over by another process"):
        remote.beat(force=True)


def test_a_shard_that_looked_before_its_peer_made_the_layout_joins_the_peers_plan(tmp_path):
    """torchrun starts every rank at once: rank 1 may find no plan, then lose the race to rank 0's layout plan.
    It must join that plan (found once rank 1 makes the next plan and sees rank 0's live), not be refused."""
    target = str(tmp_path / "out.zarr")
    rank0, rank1 = Coordinator(target, "fp", (0, 2)), Coordinator(target, "fp", (1, 2))
    assert rank1.current_plan() is None  # rank 1 looks: nothing yet
    k = rank0.new_plan("layout")  # rank 0 plans meanwhile (alive: this process)
    assert k == 0
    assert rank1.new_plan("layout") is None  # plan@1 withdrawn: look again
    plan = rank1.current_plan()
    assert plan.gen == 0 and plan.active
    rank0.set_ready()
    assert rank1.wait_ready(plan).gen == 0 and rank1.claim_shard(0) == "p0.shard1of2@0.json"
    # a writer that cannot join (another shard count) is still refused in one line, naming the live one
    with pytest.raises(ClaimError, match=r"is being written as 2 shard\(s\) by pid \d+ on host"):
        Coordinator(target, "fp", (0, 3)).new_plan("resume")
    rank0.release_all(), rank1.release_all()
    # once the output is complete, the tidy removes the withdrawn plans @1 (rank 1's) and @2 (the refused one's)
    # too: of later generations than the plan they yielded to, they were left beside the store (a left-over
    # claims directory when two shards start at the same moment) — but not a live later plan
    cd = ClaimsDir(claims_location(target))
    assert cd.read("plan@1.json")["withdrawn"] and cd.read("plan@2.json")["withdrawn"]
    later = Coordinator(target, "fp", (0, 1))
    later.me = Owner("other", "other-host", 4242, None, time.time())
    assert cd.create("plan@3.json", later._record(kind="resume", n_shards=1, ready=False, withdrawn=False))
    rank0.remove_plans_upto(0)
    assert sorted(cd.names()) == ["plan@3.json"]
    rank0.remove_plans_upto(3)
    assert not Path(claims_location(target)).exists()


def test_only_one_of_many_racing_processes_wins_a_claim(tmp_path):
    code = ("import sys; from looptrace.io.claims_dir import ClaimsDir; "
            "print(int(ClaimsDir(sys.argv[1]).create('plan@0.json', {'x': 1})))")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "c")], stdout=subprocess.PIPE, text=True)
             for _ in range(6)]
    wins = [int(p.communicate(timeout=60)[0]) for p in procs]
    assert sum(wins) == 1


def test_output_lock_one_writer_per_output_and_stale_takeover(tmp_path):
    out = tmp_path / "geometry" / "m"
    with output_lock(out) as held:
        assert Path(claims_location(str(out))).is_dir()
        with pytest.raises(ClaimError, match=rf"geometry/m is being written by pid {os.getpid()} on host \S+ \(started ") \
                as exc:
            with output_lock(out):
                pass
        assert "\n" not in str(exc.value) and held.plan_gen == 0
    assert not Path(claims_location(str(out))).exists()
    # a killed run's lock (its pid is gone) is taken over
    stale = Coordinator(str(out), "-", (0, 1))
    stale.me = Owner("dead", stale.me.host, _dead_pid(), 1.0, time.time() - 60)
    k = stale.new_plan("resume")
    stale.set_ready()
    stale.claim_shard(k)
    with output_lock(out) as took:
        assert took.plan_gen == k + 1
    assert not Path(claims_location(str(out))).exists()


def test_memory_store_needs_no_claims():
    adapter, data = tiny_adapter_and_data(n_seq=12)
    st = dump_split(adapter, data, memory_store(), tiny_dump_config(), progress=False)
    assert st.complete
