"""Hardening: params that mean what they say, nothing quiet, the environment's faults as
user errors, every artifact verified on read. The one-line refusals themselves are rows of tests/test_bad_inputs.py;
this file holds what is not a one-line refusal (warnings, exit status with a closed stdout, verification)."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from looptrace.cli import app
from tests.test_bad_inputs import REPO, _stores


def _params(t: Path, text: str) -> list[str]:
    f = t / "over.yaml"
    f.write_text(text)
    return ["--params", str(REPO / "params.yaml"), "--params", str(f)]


# ------------------------------------------------------------------------------------------- params

def test_min_boot_is_documented_and_derived_from_the_level():
    from looptrace.intervals import IntervalsConfig, min_boot

    assert (min_boot(0.95), min_boot(0.9), min_boot(0.99)) == (200, 100, 1000)
    IntervalsConfig(n_boot=0)
    IntervalsConfig(n_boot=200)
    with pytest.raises(ValueError, match="needs at least 1000"):
        IntervalsConfig(n_boot=200, level=0.99)


def test_duplicate_keys_anywhere_are_refused(tmp_path):
    from looptrace.config import ConfigError, read_params

    f = tmp_path / "p.yaml"
    f.write_text("train:\n  model:\n    d_model: 8\n    d_model: 16\n")
    with pytest.raises(ConfigError, match=r"key 'train.model.d_model' is given twice \(line 3 and line 4\)"):
        read_params(f)
    f.write_text("train:\n  model: {d_model: 8}\ngeometry: {}\n")  # distinct keys: fine
    assert read_params(f)["train"]["model"]["d_model"] == 8


def test_small_block_warns_once_with_its_cost(tmp_path):
    from looptrace.io import bounds

    bounds._WARNED.clear()
    _stores(tmp_path)  # chunks of 16 tokens
    res = CliRunner().invoke(app, ["geometry", "--model", "m", "--dump-root", str(tmp_path / "dump"), "--out",
                                   str(tmp_path / "geometry"), *_params(tmp_path, "geometry: {block_tokens: 8}\n")])
    assert res.exit_code == 0, res.stderr
    warns = [ln for ln in res.stderr.splitlines() if ln.startswith("warning:")]
    assert len(warns) == 1 and "geometry.block_tokens = 8 is below the chunk" in warns[0], res.stderr
    assert "decoded 2 times" in warns[0]


# ------------------------------------------------------------------------------------------- nothing quiet

@pytest.mark.parametrize("policy", ["refuse", "warn"])
def test_lm_dump_short_of_sequences_refuses_or_warns(policy, tmp_path):
    """An LM corpus yielding fewer sequences than asked: refused before any write (default), or one warning and the
    counts got/asked in the summary line (``dump.text.short_splits: warn``)."""
    import yaml

    from tests import hf_helpers as H
    from tests.hf_helpers import corpus, lm_params

    ckpt = H.build_dory(tmp_path / "dory")
    params = lm_params(tmp_path, ckpt, corpus(tmp_path / "corpus.jsonl"))
    p = yaml.safe_load(params.read_text())
    p["dump"]["sequences"] = {"fit": 4, "val": 4, "test": 64}
    p["dump"]["text"]["short_splits"] = policy
    p["dump"]["allow_prefix_overlap"] = True
    params.write_text(yaml.safe_dump(p, sort_keys=False))
    out = tmp_path / "dump"
    r = CliRunner().invoke(app, ["dump", "--params", str(params), "--out", str(out)])
    if policy == "refuse":
        assert r.exit_code == 2, r.output
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and "split 'test' gets" in lines[0] and "of the 64 asked" in lines[0], r.stderr
        assert "dump.text.short_splits: warn" in lines[0]
        assert not out.exists() or not any(out.rglob("zarr.json"))
    else:
        assert r.exit_code == 0, r.output
        warns = [ln for ln in r.stderr.splitlines() if ln.startswith("warning:")]
        assert len(warns) == 1 and "split 'test' gets" in warns[0], r.stderr
        assert "sequences per split (got/asked): fit 4/4, val 4/4, test " in r.stdout and "/64" in r.stdout


@pytest.mark.parametrize("entry", ["launcher", "cli"])
def test_closed_stdout_changes_neither_exit_status_nor_outputs(entry, tmp_path):
    """``looptrace geometry ... | head -0``: the reader is gone before the summary line; exit 0, outputs written."""
    import os
    import subprocess
    import sys

    _stores(tmp_path)
    args = ["--model", "m", "--dump-root", str(tmp_path / "dump"), "--out", str(tmp_path / "geometry"), "--params",
            str(REPO / "params.yaml")]
    cmd = ([sys.executable, str(REPO / "stages" / "geometry.py"), *args] if entry == "launcher" else
           [sys.executable, "-c", "import sys; from looptrace.cli import app; sys.argv[0] = 'looptrace'; app()",
            "geometry", *args])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "pipeline"), str(REPO)])}
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO, env=env)
    p.stdout.close()  # the reader goes away at once
    err = p.stderr.read().decode()
    assert p.wait(timeout=300) == 0, err
    assert not [ln for ln in err.splitlines() if ln.startswith(("error", "internal error", "Exception", "Traceback"))]
    assert (tmp_path / "geometry" / "m" / "metrics.json").is_file()


# ------------------------------------------------------------------------------------------- verified reads

def test_stage_outputs_carry_a_manifest_and_page_checksums(tmp_path):
    """geometry's outputs: a manifest listing every file with its sha256; a page damaged in token_loop.parquet is
    refused by readouts, by the manifest, and by the page checksums when the manifest is gone."""
    import json

    from looptrace.io.manifest import sha256_file
    from tests.test_bad_inputs import _damage_page

    _stores(tmp_path)
    geo = ["geometry", "--model", "m", "--dump-root", str(tmp_path / "dump"), "--out", str(tmp_path / "geometry"),
           "--params", str(REPO / "params.yaml")]
    assert CliRunner().invoke(app, geo).exit_code == 0
    d = tmp_path / "geometry" / "m"
    doc = json.loads((d / "manifest.json").read_text())
    assert doc["stage"] == "geometry" and sorted(doc["files"]) == sorted(p.name for p in d.iterdir()
                                                                           if p.name != "manifest.json")
    assert all(sha256_file(d / f) == h for f, h in doc["files"].items())
    _damage_page(d / "token_loop.parquet")
    ro = ["readouts", "--model", "m", "--geometry-root", str(tmp_path / "geometry"), "--out", str(tmp_path / "ro"),
          "--params", str(REPO / "params.yaml")]
    r = CliRunner().invoke(app, ro)
    assert r.exit_code == 2 and "token_loop.parquet does not match its manifest.json" in r.stderr, r.stderr
    (d / "manifest.json").unlink()
    r = CliRunner().invoke(app, ro)
    assert r.exit_code == 2 and "token_loop.parquet has a damaged data page" in r.stderr, r.stderr
    assert not (tmp_path / "ro").exists()
