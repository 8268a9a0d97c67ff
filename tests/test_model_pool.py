"""The per-model stages (dump, loopmap, geometry, readouts) run every model of the matrix in one DVC stage, a pool of
processes: the bytes equal each model run alone, one after another (``--model``), and a model's failure is one
line naming it."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.test_e2e_gates import copy_tiny_project, run_in_process, stage_commands

pytestmark = pytest.mark.slow

POOLED = ("dump", "loopmap", "geometry", "readouts")


def _tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_pooled_stages_equal_each_model_alone(tmp_path, monkeypatch):
    import yaml

    import looptrace.project

    params = copy_tiny_project(tmp_path)
    params["train"]["seeds"] = [0, 1]  # 1 task x 2 regimes x 2 seeds = 4 models
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    dvc_yaml = yaml.safe_load((tmp_path / "dvc.yaml").read_text())
    cmds = dict(stage_commands(dvc_yaml, params))
    for name in POOLED:
        assert "matrix" not in dvc_yaml["stages"][name] and "--model" not in cmds[name], name
    run_in_process(cmds["train"], tmp_path)
    models = sorted(p.name for p in (tmp_path / "artifacts" / "train").iterdir() if p.is_dir())
    assert len(models) == 4

    # the pool: two worker processes (whatever this machine's cores)
    monkeypatch.delenv("LOOPTRACE_MODEL_WORKERS", raising=False)
    monkeypatch.setattr(looptrace.project, "host_cores", lambda: 2)
    for name in POOLED:
        run_in_process(cmds[name], tmp_path)
    # alone: each model in this process, into other roots
    alone = tmp_path / "alone"
    for m in models:
        run_in_process(f"python stages/dump.py --model {m} --out {alone / 'dump'}", tmp_path)
        run_in_process(f"python stages/loopmap.py --model {m} --out {alone / 'loopmap'}", tmp_path)
        run_in_process(f"python stages/geometry.py --model {m} --dump-root {alone / 'dump'} --out {alone / 'geometry'}",
                       tmp_path)
        run_in_process(f"python stages/readouts.py --model {m} --geometry-root {alone / 'geometry'} "
                       f"--out {alone / 'readouts'}", tmp_path)
    for name in POOLED:
        pooled, single = _tree(tmp_path / "artifacts" / name), _tree(alone / name)
        assert {k.split("/")[0] for k in pooled} == set(models), name
        assert pooled.keys() == single.keys(), name
        differ = [k for k in pooled if pooled[k] != single[k]]
        assert not differ, f"{name}: pooled and alone differ in {differ}"


def test_workers_from_the_environment(monkeypatch):
    """``$LOOPTRACE_MODEL_WORKERS`` sets the pool (capped by the models); a bad value is one line naming it; an
    accelerator or a Dask cluster gets one process."""
    from looptrace.config import UserError
    from looptrace.io.parallel import model_workers

    monkeypatch.setenv("LOOPTRACE_MODEL_WORKERS", "3")
    assert model_workers(12) == 3 and model_workers(2) == 2
    assert model_workers(12, device="cuda") == 1 and model_workers(12, scheduler="local") == 1
    monkeypatch.setenv("LOOPTRACE_MODEL_WORKERS", "0")
    with pytest.raises(UserError, match="LOOPTRACE_MODEL_WORKERS"):
        model_workers(12)
    monkeypatch.delenv("LOOPTRACE_MODEL_WORKERS")
    import looptrace.project

    monkeypatch.setattr(looptrace.project, "host_cores", lambda: 4)
    assert model_workers(12) == 4 and model_workers(12, threads=2) == 2 and model_workers(3) == 3


def test_a_failing_model_is_one_line_and_the_others_finish(tmp_path, monkeypatch):
    """One model's dump is missing: the pooled geometry exits non-zero naming that model's store, and every model
    whose dump is there has its complete output."""
    import shutil

    import yaml
    from typer.testing import CliRunner

    import looptrace.project
    from looptrace.cli import app

    params = copy_tiny_project(tmp_path)
    params["train"]["seeds"] = [0]  # 2 models: both run at once, so the one that can finish does
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    dvc_yaml = yaml.safe_load((tmp_path / "dvc.yaml").read_text())
    cmds = dict(stage_commands(dvc_yaml, params))
    for name in ("train", "dump"):
        run_in_process(cmds[name], tmp_path)
    models = sorted(p.name for p in (tmp_path / "artifacts" / "dump").iterdir() if p.is_dir())
    assert len(models) == 2
    shutil.rmtree(tmp_path / "artifacts" / "dump" / models[0])
    monkeypatch.delenv("LOOPTRACE_MODEL_WORKERS", raising=False)
    monkeypatch.setattr(looptrace.project, "host_cores", lambda: 2)
    monkeypatch.chdir(tmp_path)
    res = CliRunner().invoke(app, ["geometry"])
    assert res.exit_code != 0
    assert models[0] in res.output and "Traceback" not in res.output, res.output
    assert (tmp_path / "artifacts" / "geometry" / models[1] / "manifest.json").is_file()
    assert not (tmp_path / "artifacts" / "geometry" / models[0]).exists()


#: What a clock measured (the columns that differ between two runs of the same timed stage on one machine).
CLOCK = {
    "latency.parquet": {"full_time_s", "exit_time_s", "full_time_iqr_s", "exit_time_iqr_s", "realised_speedup",
                        "speedup_ratio", "ratio_to_work_ideal"},
    "generate.parquet": {"full_time_s", "exit_time_s", "full_time_iqr_s", "exit_time_iqr_s", "full_tokens_per_s",
                         "tokens_per_s", "realised_speedup", "speedup_ratio", "prefill_time_s"},
    "speculative.parquet": {"full_time_s", "spec_time_s", "realised_speedup", "realised_speedup_lo",
                            "realised_speedup_hi", "predicted_speedup", "predicted_speedup_lo", "predicted_speedup_hi",
                            "speedup_ratio", "continuation_speedup", "cost_model_ratio", "cost_block_s",
                            "cost_draft_s", "cost_verify_s", "cost_accept_s", "cost_verify_one_s", "full_cost_s"},
}


def test_timed_stages_side_by_side_equal_one_at_a_time_but_the_clock(tmp_path, monkeypatch):
    """latency and generate time their models in a pool (one process per core): every column but the clock's is
    the bytes of one model at a time, in the same row order, and metrics.json records the workers."""
    import json

    import polars as pl
    import yaml

    import looptrace.project

    params = copy_tiny_project(tmp_path)
    params["train"]["seeds"] = [0, 1]  # 4 models
    params["generate"]["seeds"] = None  # every model
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    cmds = dict(stage_commands(yaml.safe_load((tmp_path / "dvc.yaml").read_text()), params))
    for name in ("train", "dump", "geometry", "readouts", "gates"):
        run_in_process(cmds[name], tmp_path)
    monkeypatch.delenv("LOOPTRACE_MODEL_WORKERS", raising=False)
    monkeypatch.setattr(looptrace.project, "host_cores", lambda: 2)
    for name in ("latency", "generate"):
        run_in_process(cmds[name], tmp_path)
    monkeypatch.setenv("LOOPTRACE_MODEL_WORKERS", "1")
    alone = tmp_path / "alone"
    run_in_process(f"python stages/latency.py --out {alone / 'latency'}", tmp_path)
    run_in_process(f"python stages/generate.py --out {alone / 'generate'}", tmp_path)
    for stage, files in (("latency", ("latency.parquet",)), ("generate", ("generate.parquet", "speculative.parquet"))):
        pooled, single = tmp_path / "artifacts" / stage, alone / stage
        assert json.loads((pooled / "metrics.json").read_text())["workers"] == 2
        assert json.loads((single / "metrics.json").read_text())["workers"] == 1
        for f in files:
            a, b = pl.read_parquet(pooled / f), pl.read_parquet(single / f)
            assert a["model"].n_unique() == 4 and a.height == b.height, f
            keep = [c for c in a.columns if c not in CLOCK[f]]
            assert a.select(keep).equals(b.select(keep)), f
