"""Issue 24 (hardening, second round): params that mean what they say, nothing quiet, the environment's faults as
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
    from looptrace import bounds

    bounds._WARNED.clear()
    _stores(tmp_path)  # chunks of 16 tokens
    res = CliRunner().invoke(app, ["geometry", "--model", "m", "--dump-root", str(tmp_path / "dump"), "--out",
                                   str(tmp_path / "geometry"), *_params(tmp_path, "geometry: {block_tokens: 8}\n")])
    assert res.exit_code == 0, res.stderr
    warns = [ln for ln in res.stderr.splitlines() if ln.startswith("warning:")]
    assert len(warns) == 1 and "geometry.block_tokens = 8 is below the chunk" in warns[0], res.stderr
    assert "decoded 2 times" in warns[0]
