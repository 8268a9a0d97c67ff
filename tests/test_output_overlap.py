"""Outputs never destroy inputs: every stage refuses an ``--out`` equal to, inside or above one of its
input roots (symlinks followed) in one line before writing anything, and a swap never replaces a directory that
another stage wrote."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from looptrace.cli import app
from looptrace.io.guard import REPORT_READS
from tests.test_bad_inputs import REPO, _argv

#: stage -> the options naming its input roots (``--root`` of report: the directories of the stages it reads).
INPUTS = {
    "dump": ["--train-root"],
    "dynamics": ["--train-root"],
    "loopmap": ["--train-root"],
    "geometry": ["--dump-root"],
    "readouts": ["--geometry-root"],
    "gates": ["--dump-root"],
    "diagnose": ["--readouts-root", "--gates-root", "--geometry-root", "--dump-root", "--loopmap-root"],
    "latency": ["--train-root", "--dump-root", "--readouts-root", "--gates-root"],
    "generate": ["--train-root", "--dump-root", "--readouts-root", "--gates-root"],
    "report": [f"--root/{s}" for s in REPORT_READS],
}
CASES = [(stage, opt, where) for stage, opts in INPUTS.items() for opt in opts for where in ("equal", "inside", "above")]


def _snapshot(t: Path) -> dict[str, float]:
    return {str(p.relative_to(t)): p.stat().st_mtime_ns for p in sorted(t.rglob("*"))}


def _run(stage: str, opt: str, where: str, t: Path, via_link: bool = False):
    argv = _argv(stage, t)
    if opt.startswith("--root/"):
        root = Path(argv[argv.index("--root") + 1])
        inp = root / opt.split("/", 1)[1]
    else:
        inp = Path(argv[argv.index(opt) + 1])
    inp.mkdir(parents=True, exist_ok=True)
    (inp / "m").mkdir(exist_ok=True)
    (inp / "m" / "sentinel").write_text("input")
    out = {"equal": inp, "inside": inp / "sub", "above": inp.parent}[where]
    if via_link:  # the same place reached through a symlink
        link = t / "link"
        link.symlink_to(out.parent, target_is_directory=True)
        out = link / out.name
    argv[argv.index("--out") + 1] = str(out)
    before = _snapshot(t)
    res = CliRunner().invoke(app, [*argv, "--params", str(REPO / "params.yaml")])
    return res, before, _snapshot(t), inp


@pytest.mark.parametrize("stage,opt,where", CASES, ids=[f"{s}{o}-{w}" for s, o, w in CASES])
def test_out_overlapping_an_input_root_is_refused_before_any_write(stage, opt, where, tmp_path):
    res, before, after, inp = _run(stage, opt, where, tmp_path)
    lines = res.stderr.strip().splitlines()
    assert res.exit_code == 2, res.stderr
    assert len(lines) == 1 and lines[0].startswith("error: --out "), res.stderr
    assert "the input root" in lines[0] and "outside every input root" in lines[0], lines[0]
    assert after == before  # nothing written, nothing removed
    assert (inp / "m" / "sentinel").read_text() == "input"


@pytest.mark.parametrize("stage,opt", [("geometry", "--dump-root"), ("readouts", "--geometry-root")])
def test_overlap_through_a_symlink_is_refused(stage, opt, tmp_path):
    res, before, after, inp = _run(stage, opt, "equal", tmp_path, via_link=True)
    assert res.exit_code == 2, res.stderr
    assert "resolved:" in res.stderr and "the input root" in res.stderr, res.stderr
    assert after == before


def test_geometry_out_equal_dump_root_keeps_the_stores(tmp_path):
    """The reported data loss: ``geometry --dump-root D --out D`` swapped the model's folder, stores included."""
    from tests.test_bad_inputs import _stores

    _stores(tmp_path)
    d = tmp_path / "dump"
    res = CliRunner().invoke(app, ["geometry", "--model", "m", "--dump-root", str(d), "--out", str(d),
                                   "--params", str(REPO / "params.yaml")])
    assert res.exit_code == 2, res.stderr
    assert sorted(p.name for p in (d / "m").iterdir()) == ["fit.zarr", "test.zarr", "val.zarr"]


def test_swap_never_replaces_another_stages_output(tmp_path):
    """A directory another stage wrote (its manifest, a store, a checkpoint) is never replaced by a swap."""
    from looptrace.config import InputError
    from looptrace.io.artifacts import write_outputs
    from looptrace.io.guard import CURRENT_STAGE
    from looptrace.io.manifest import MANIFEST, read_manifest_stage

    out = tmp_path / "x"
    tok = CURRENT_STAGE.set("readouts")
    try:
        write_outputs(out, {}, {"a": 1})
        assert read_manifest_stage(out / MANIFEST) == "readouts"
        write_outputs(out, {}, {"a": 2})  # its own output: replaced
    finally:
        CURRENT_STAGE.reset(tok)
    tok = CURRENT_STAGE.set("geometry")
    try:
        with pytest.raises(InputError, match="holds the readouts stage's outputs"):
            write_outputs(out, {}, {"a": 3})
        store = tmp_path / "y"
        (store / "fit.zarr").mkdir(parents=True)
        (store / "fit.zarr" / "zarr.json").write_text("{}")
        with pytest.raises(InputError, match="holds a Zarr store"):
            write_outputs(store, {}, {"a": 3})
        assert (store / "fit.zarr" / "zarr.json").is_file()
    finally:
        CURRENT_STAGE.reset(tok)
    assert '"a": 2' in (out / "metrics.json").read_text()


def test_stage_into_another_stages_output_is_refused_before_work(tmp_path):
    """``geometry --out <readouts root>``: the model's readouts directory is not geometry's to replace."""
    from looptrace.io.artifacts import write_outputs
    from looptrace.io.guard import CURRENT_STAGE
    from tests.test_bad_inputs import _stores

    _stores(tmp_path)
    tok = CURRENT_STAGE.set("readouts")
    try:
        write_outputs(tmp_path / "readouts" / "m", {}, {"a": 1})
    finally:
        CURRENT_STAGE.reset(tok)
    res = CliRunner().invoke(app, ["geometry", "--model", "m", "--dump-root", str(tmp_path / "dump"), "--out",
                                   str(tmp_path / "readouts"), "--params", str(REPO / "params.yaml")])
    assert res.exit_code == 2 and "holds the readouts stage's outputs" in res.stderr, res.stderr
    assert sorted(os.listdir(tmp_path / "readouts" / "m")) == ["manifest.json", "metrics.json"]
