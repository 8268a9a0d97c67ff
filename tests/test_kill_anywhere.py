"""Kill anywhere: every stage SIGKILLed at random points, re-run, equal to an uninterrupted run.

In a tiny copy of the project (the e2e profile, one seed, dynamics on, train long enough to be killed mid-run), every
stage command of dvc.yaml runs once uninterrupted, in this process: the *reference*. Then, for each stage (one item of a
matrix stage), in a copy of the reference project with that stage's output directory removed:

1. ``KILLS`` runs (a child process each: ``tests/kill_child.py`` imports everything, prints ``ready``, runs the
   command) are SIGKILLed at random times after ``ready``, uniform over the stage's reference wall time — each one
   starting from whatever the previous kill left;
2. after every kill, what is visible at the output is never a half-written output that could pass as valid: the
   output directory is absent, or each store in it is refused as incomplete by ``open_store``, or (train: one
   directory per model, a pool training them at once) each model directory is absent or the reference's, or it
   equals the reference's (a kill after the final swap);
3. the stage is re-run (in this process): its output equals the reference's, and no ``*.partial``, claims
   directory, staging directory (``.*.tmp``, ``.*.old``, ``.*.train``) or temp file is left anywhere;
4. one more run over the complete output is killed: the output still equals the reference's; a re-run tidies.

Which stages: ``make test`` kills a seeded draw of them within a time budget — the stages in a random order (seed
``LOOPTRACE_KILL_SEED``), each one killed while less than ``LOOPTRACE_KILL_BUDGET`` seconds (default 45) of kill work
have passed, at least one — so a run costs the reference pipeline plus about the budget, and the seed (by default the
UTC day, printed with any failure) rotates which stages are covered. ``LOOPTRACE_KILL_ALL=1`` is the full sweep:
every stage, whatever the time (docs/DESIGN.md, "Killed runs").

"Equal" is byte-equal, except for what a stage measures with a clock: JSON keys ending in ``seconds`` (train,
gates), and for latency and generate (wall-time measurements by design) their measured columns and metrics
(compared by key structure). ``KILLS`` (env ``LOOPTRACE_KILLS``, default 2) and the seed of the stage draw and
kill times (``LOOPTRACE_KILL_SEED``) are parameters, so a longer sweep is one environment variable away. The figures
of each run (kills tried, kills that landed before the stage finished, identical after re-run) are printed and
written to ``$LOOPTRACE_KILL_REPORT`` when it is set.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import polars as pl
import pytest
import yaml

from looptrace.io.parallel import WORKERS_ENV
from looptrace.stages import registered
from tests.test_e2e_gates import REPO, TINY, _merge, run_in_process, stage_commands
from tests.test_parallel import without_timings

pytestmark = pytest.mark.slow

KILLS = int(os.environ.get("LOOPTRACE_KILLS", "2"))
#: The seed of the stage draw and the kill times: by default the UTC day (days since 1970), so successive days cover
#: different stages; every failure names it, so a failing draw is reproduced with LOOPTRACE_KILL_SEED=<seed>.
SEED = int(os.environ.get("LOOPTRACE_KILL_SEED") or time.time() // 86400)
#: Seconds of kill work after which no further stage is started (the full sweep ignores it).
BUDGET = float(os.environ.get("LOOPTRACE_KILL_BUDGET", "45"))
#: The full sweep: every stage killed, whatever the time.
ALL = os.environ.get("LOOPTRACE_KILL_ALL", "") not in ("", "0")
CHILD = REPO / "tests" / "kill_child.py"

#: The kill profile: the e2e tiny profile, one seed, and a train long enough (~1 s a model; two models, uniform and
#: joint, trained at once by the stage's pool) to be killed between its kept checkpoints (a resume state is saved
#: at each) and between the stopping criterion's evaluations (never met here: each model trains to its cap, 90 steps).
PROFILE = {**TINY, "train": {**TINY["train"], "seeds": [0], "steps": 60, "checkpoint_fractions": [0.25, 0.5, 0.75],
                             "stop": {"target": 0.995, "patience": 2, "every": 20, "hold": 0.5, "cycles": 1}},
           "dynamics": {"enabled": True, "probe_sequences": 32}}

#: What the child imports before ``ready`` and the reference imports before it times a stage, so that a kill
#: time drawn over a stage's reference time lands in its work, not in its first imports.
STAGES = tuple(s.name for s in registered())
PRELOAD = (*(f"looptrace.stages.{s}" for s in STAGES),
           "looptrace.gates.fit", "looptrace.report", "looptrace.diagnose.stage", "looptrace.online.latency",
           "looptrace.online.generate", "sklearn.linear_model", "sklearn.neural_network", "sklearn.decomposition",
           "skops.io", "matplotlib.pyplot")

#: Stages whose output directory holds one directory per model, each swapped in whole as its model finishes (every
#: model of the matrix in one stage, a pool of processes): after a kill each is absent or the reference's.
PER_MODEL_OUTPUTS = {"train", "dump", "loopmap", "geometry", "readouts"}
#: Stages whose outputs are wall-clock measurements (compared without their measured fields).
MEASURED_STAGES = {"latency", "generate"}
_MEASURED_COLUMN = re.compile(r"(_s|_per_s|realised_speedup|continuation_speedup|speedup_ratio|ratio_to_work_ideal|cost_model_ratio)"
                              r"(_lo|_hi)?$")
#: Debris a killed run may leave, which a completed re-run must have removed.
_DEBRIS = re.compile(r"(\.partial|\.tmp|\.claims|\.old|\.train)$")


def _env() -> dict:
    # the killed stage runs its pool of two processes (the tests' default is one model after another)
    return {**os.environ, "SOURCE_DATE_EPOCH": "0", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
            WORKERS_ENV: "2"}


def _skeleton(obj):
    """Key structure of a JSON value (what a measured metrics.json must keep)."""
    if isinstance(obj, dict):
        return {k: _skeleton(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return len(obj)
    return None


def _manifest_content(path: Path, stage: str):
    """A stage's manifest.json: every digest matches its file now; digests of the files compared without
    their measured fields (JSON with timings, measured tables) are masked, the rest compared."""
    from looptrace.io.manifest import sha256_file

    doc = json.loads(path.read_text())
    for rel, digest in doc["files"].items():
        assert sha256_file(path.parent / rel) == digest, f"{path}: {rel} does not match its digest"
    loose = {rel for rel in doc["files"] if rel.endswith(".json") or (stage in MEASURED_STAGES and rel.endswith(".parquet"))}
    return {**doc, "files": {rel: (None if rel in loose else d) for rel, d in doc["files"].items()}}


def _content(path: Path, stage: str):
    """What must be equal between two runs' copies of one output file."""
    if path.name == "manifest.json":
        return _manifest_content(path, stage)
    if path.suffix == ".json":
        data = json.loads(path.read_text())
        return _skeleton(data) if stage in MEASURED_STAGES else without_timings(data)
    if path.suffix == ".parquet" and stage in MEASURED_STAGES:
        df = pl.read_parquet(path)
        return df.drop([c for c in df.columns if _MEASURED_COLUMN.search(c)]).fill_nan(None).to_dicts()  # NaN != NaN
    return path.read_bytes()


def _tree(root: Path, stage: str) -> dict[str, object]:
    return {str(p.relative_to(root)): _content(p, stage) for p in sorted(root.rglob("*")) if p.is_file()}


def _assert_equal_output(got: Path, ref: Path, stage: str, when: str) -> None:
    a, b = _tree(got, stage), _tree(ref, stage)
    assert sorted(a) == sorted(b), f"{stage} {when}: files {sorted(set(a) ^ set(b))[:5]} differ from the reference"
    different = [k for k in a if a[k] != b[k]]
    assert not different, f"{stage} {when}: {different[:5]} differ from the reference's"


def _debris(artifacts: Path) -> list[str]:
    return [str(p.relative_to(artifacts)) for p in artifacts.rglob("*") if _DEBRIS.search(p.name)]


def _assert_nothing_half_written(out: Path, ref: Path, stage: str) -> str:
    """After a kill: absent, refused as incomplete (stores), or the reference's whole output. Returns which."""
    if not out.exists():
        return "absent"
    if stage in PER_MODEL_OUTPUTS:  # one directory per model, each written whole (or, the dump, stores)
        extra = sorted(p.name for p in out.iterdir() if not (ref / p.name).is_dir() and not _DEBRIS.search(p.name))
        assert not extra, f"{stage}: {extra} beside the model directories after a kill"
        states = []
        for model in sorted(p for p in ref.iterdir() if p.is_dir()):
            if not (out / model.name).exists():
                states.append("absent")
            elif any(p.suffix == ".zarr" for p in model.iterdir()):
                states.append(_stores_state(out / model.name, model, stage))
            else:
                _assert_equal_output(out / model.name, model, stage, f"after a kill ({model.name} is visible)")
                states.append("whole")
        return "models " + "/".join(states)
    if any(p.suffix == ".zarr" for p in ref.iterdir()):
        return _stores_state(out, ref, stage)
    _assert_equal_output(out, ref, stage, "after a kill (the output is visible)")
    return "whole"


def _stores_state(out: Path, ref: Path, stage: str) -> str:
    """A model's dump after a kill: each store absent, refused (incomplete) or complete and equal to the
    reference's."""
    from looptrace.io.store.reader import open_store
    from looptrace.io.store.schema import StoreError

    stores = sorted(out / p.name for p in ref.iterdir() if p.suffix == ".zarr")
    extra = sorted(p.name for p in out.iterdir() if out / p.name not in stores and not _DEBRIS.search(p.name))
    assert not extra, f"{stage}: {extra} beside the stores after a kill"
    states = []
    for st in stores:
        if not st.exists():
            states.append("absent")
            continue
        try:
            open_store(st)
        except StoreError as exc:
            assert "incomplete" in str(exc) or "not found" in str(exc) or "no zarr.json" in str(exc), str(exc)
            states.append("refused")
        else:
            _assert_equal_output(st, ref / st.name, stage, f"after a kill ({st.name} opens as complete)")
            states.append("complete")
    return "stores " + "/".join(states)


def _out_dir(dvc_stage: dict, item: dict) -> str:
    """The one directory a stage writes (the common path of its outs, metrics and plots)."""
    paths = []
    for key in ("outs", "metrics", "plots"):
        for e in dvc_stage.get(key) or []:
            p = next(iter(e)) if isinstance(e, dict) else e
            for k, v in item.items():
                p = p.replace("${item." + k + "}", str(v))
            paths.append(p)
    return os.path.commonpath(paths) if len(paths) > 1 else str(Path(paths[0]).parent if "." in Path(paths[0]).name
                                                                  else paths[0])


def _wait_group_gone(pgid: int, timeout_s: float = 10.0) -> None:
    """Until no process of group ``pgid`` runs (a zombie has exited: it only waits to be reaped)."""
    import psutil

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        alive = []
        for proc in psutil.process_iter(["status"]):
            try:
                if os.getpgid(proc.pid) == pgid and proc.info["status"] != psutil.STATUS_ZOMBIE:
                    alive.append(proc.pid)
            except (ProcessLookupError, psutil.Error):
                continue
        if not alive:
            return
        time.sleep(0.01)
    raise AssertionError(f"processes {alive} of the killed group {pgid} still run after {timeout_s} s")


def _kill_once(cwd: Path, argv: list[str], delay: float) -> str:
    """Run ``argv`` in a child, SIGKILL it ``delay`` s after ``ready``; 'killed' or 'finished' (done before)."""
    proc = subprocess.Popen([sys.executable, str(CHILD), json.dumps({"cwd": str(cwd), "argv": argv})],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(),
                            start_new_session=True)
    try:
        line = proc.stdout.readline()
        assert line.strip() == "ready", f"child did not start: {line!r} {proc.stderr.read()[-2000:]}"
        try:
            proc.wait(timeout=delay)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            _wait_group_gone(proc.pid)  # the stage's pool workers too: SIGKILL lands, but not in the same instant
            return "killed"
        err = proc.stderr.read()
        assert proc.returncode == 0, f"{argv} exited {proc.returncode}: {err[-2000:]}"
        return "finished"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        proc.stdout.close()
        proc.stderr.close()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The tiny project, every stage run once uninterrupted: (root, dvc.yaml, [(name, item, cmd, seconds)])."""
    import importlib

    import torch

    torch.set_num_threads(1)
    os.environ.setdefault("SOURCE_DATE_EPOCH", "0")
    for mod in PRELOAD:
        importlib.import_module(mod)
    root = tmp_path_factory.mktemp("kill-ref")
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    params = {k: _merge(v, PROFILE[k]) if k in PROFILE and isinstance(v, dict) else v for k, v in params.items()}
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    dvc_yaml = yaml.safe_load((REPO / "dvc.yaml").read_text())
    runs = []
    for name, cmd in stage_commands(dvc_yaml, params):
        t0 = time.perf_counter()
        run_in_process(cmd, root)
        runs.append((name, cmd, time.perf_counter() - t0))
    return root, dvc_yaml, runs


def _targets(dvc_yaml: dict, runs: list) -> list[tuple[str, str, str, float]]:
    """One command per stage to kill (a matrix stage: its joint-regime item, which has a gate): (stage, cmd,
    output dir, reference seconds)."""
    chosen: dict[str, tuple] = {}
    for name, cmd, secs in runs:
        stage = name.split("@", 1)[0]
        if stage not in chosen or "joint" in name:
            item = {}
            if "@" in name:
                task, regime, seed = name.split("@", 1)[1].rsplit("-", 2)
                item = {"task": task, "regime": regime, "seed": seed}
            chosen[stage] = (stage, cmd, _out_dir(dvc_yaml["stages"][stage], item), secs)
    return list(chosen.values())


def _kill_stage(stage: str, cmd: str, out_rel: str, secs: float, ref_root: Path, tmp: Path,
                rng: np.random.Generator) -> dict:
    """Kill one stage ``KILLS`` times from nothing, re-run, kill once over the complete output, re-run; returns
    its figures."""
    import shlex

    work = tmp / stage
    shutil.copytree(ref_root, work, ignore=shutil.ignore_patterns("__pycache__"))
    out, ref_out = work / out_rel, ref_root / out_rel
    shutil.rmtree(out)
    argv = shlex.split(cmd)[1:]
    argv = [Path(argv[0]).stem, *argv[1:]]
    fig = {"kills_tried": 0, "killed": 0, "finished_first": 0, "seen_after_kill": [], "identical_after_rerun": 0,
           "reference_s": round(secs, 2)}

    def kill(k: int, of: int, over_complete: bool) -> None:
        # uniform over the k-th of ``of`` equal parts of the stage's reference work time (stratified: early and
        # late kills both happen; the child's imports are done before 'ready')
        state = _kill_once(work, argv, float(rng.uniform(k / of, (k + 1) / of)) * max(secs, 0.05))
        fig["kills_tried"] += 1
        fig["killed" if state == "killed" else "finished_first"] += 1
        seen = _assert_nothing_half_written(out, ref_out, stage)
        if over_complete:
            assert seen != "absent", f"{stage}: a killed run over a complete output removed it"
        fig["seen_after_kill"].append(seen)

    def rerun(when: str) -> None:
        run_in_process(cmd, work)
        _assert_equal_output(out, ref_out, stage, when)
        assert not _debris(work / "artifacts"), f"{stage} {when}: debris left: {_debris(work / 'artifacts')}"
        fig["identical_after_rerun"] += 1

    for k in range(KILLS):
        kill(k, KILLS, over_complete=False)
    rerun(f"re-run after {KILLS} kills")
    kill(0, 1, over_complete=True)
    rerun("re-run after a kill over the complete output")
    shutil.rmtree(work)
    return fig


def test_every_stage_killed_anywhere_reruns_to_the_uninterrupted_output(reference, tmp_path):
    ref_root, dvc_yaml, runs = reference
    rng = np.random.default_rng(SEED)
    targets = _targets(dvc_yaml, runs)
    order = [targets[i] for i in rng.permutation(len(targets))]
    figures, t0 = {}, time.perf_counter()
    for stage, cmd, out_rel, secs in order:
        if figures and not ALL and time.perf_counter() - t0 >= BUDGET:
            break
        try:
            figures[stage] = _kill_stage(stage, cmd, out_rel, secs, ref_root, tmp_path, rng)
        except AssertionError as exc:
            raise AssertionError(f"[LOOPTRACE_KILL_SEED={SEED}] {exc}") from exc
    skipped = [t[0] for t in order if t[0] not in figures]
    text = json.dumps({"kills_per_stage": KILLS + 1, "seed": SEED, "budget_s": None if ALL else BUDGET,
                       "seconds": round(time.perf_counter() - t0, 1), "stages": figures, "not_drawn": skipped},
                      indent=1)
    print(text)
    if os.environ.get("LOOPTRACE_KILL_REPORT"):
        Path(os.environ["LOOPTRACE_KILL_REPORT"]).write_text(text + "\n")
    assert {t[0] for t in targets} == set(STAGES), "every registered stage is a dvc.yaml stage the harness can kill"
    if ALL:
        assert set(figures) == set(STAGES)
