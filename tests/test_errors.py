"""User errors and bugs told apart.

A :class:`~looptrace.config.UserError` raised where the cause is known prints one line and exits 2; an
operating-system refusal that names its file (disk full) likewise; anything else is a bug: a short message naming
a log file that holds the traceback, exit 1 — a numpy shape error inside a stage must not read as the user's fault.
A garbage or truncated ``model.pt`` is a one-line user error naming the file, what was expected and how to rebuild it.
"""

from __future__ import annotations

import errno
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from looptrace.cli import app
from looptrace.config import CheckpointLoadError, InputError, MissingInputError
from looptrace.errors import BUG_EXIT, USER_EXIT, user_errors
from looptrace.models.looped import load_checkpoint
from tests.builders import tiny_checkpoint


def _exit_of(fn) -> int:
    with pytest.raises(typer.Exit) as exc, user_errors():
        fn()
    return exc.value.exit_code


def _raise(exc: BaseException):
    def f():
        raise exc
    return f


def test_user_error_is_one_line_exit_2(capsys):
    assert _exit_of(_raise(InputError("x.parquet is truncated; re-run geometry\nsecond line"))) == USER_EXIT
    assert capsys.readouterr().err == "error: x.parquet is truncated; re-run geometry\n"


def test_disk_full_is_a_user_error_naming_the_file(capsys):
    assert _exit_of(_raise(OSError(errno.ENOSPC, "No space left on device", "/data/out.parquet"))) == USER_EXIT
    assert capsys.readouterr().err == "error: [Errno 28] No space left on device: '/data/out.parquet'\n"


def test_a_plain_value_error_is_a_bug_with_its_traceback_in_a_log(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("LOOPTRACE_LOG_DIR", str(tmp_path / "logs"))

    def deep():
        import numpy as np

        return np.ones((2, 3)) @ np.ones((2, 3))  # the shape error of an internal bug

    assert _exit_of(deep) == BUG_EXIT
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith("internal error (a bug in looptrace, not in your input): ValueError: matmul")
    logs = list((tmp_path / "logs").glob("looptrace-bug-*.log"))
    assert len(logs) == 1 and f"traceback in {logs[0]}" in err
    text = logs[0].read_text()
    assert "Traceback (most recent call last)" in text and "in deep" in text and "ValueError: matmul" in text


def test_bug_in_a_stage_through_the_cli(tmp_path, monkeypatch):
    """A stage whose library call fails with a non-user exception exits 1 (not 2) and names the log."""
    import looptrace.stages.geometry as geo_stage

    monkeypatch.setenv("LOOPTRACE_LOG_DIR", str(tmp_path / "logs"))
    params = tmp_path / "params.yaml"
    params.write_text("geometry: {splits: [val]}\n")

    def broken(*a, **k):
        raise IndexError("index 7 is out of bounds for axis 0 with size 7")

    monkeypatch.setattr(geo_stage, "open_split_stores", broken)
    res = CliRunner().invoke(app, ["geometry", "--model", "m", "--params", str(params), "--out", str(tmp_path / "o")])
    assert res.exit_code == BUG_EXIT
    assert "internal error" in res.stderr and "IndexError: index 7 is out of bounds" in res.stderr
    assert str(tmp_path / "logs") in res.stderr


@pytest.mark.parametrize("damage", ["garbage", "truncated", "empty"])
def test_damaged_checkpoint_is_one_line_naming_file_and_rebuild(tmp_path, damage):
    ckpt = tiny_checkpoint(tmp_path / "train", name="rs-uniform")
    good = ckpt.read_bytes()
    ckpt.write_bytes({"garbage": b"garbage\n", "truncated": good[: len(good) // 2], "empty": b""}[damage])
    with pytest.raises(CheckpointLoadError) as exc:
        load_checkpoint(ckpt)
    msg = str(exc.value)
    assert "\n" not in msg
    assert msg.startswith(f"checkpoint '{ckpt}' ({ckpt.stat().st_size} bytes) is truncated or not a torch checkpoint")
    assert msg.endswith("rebuild it with `dvc repro train` (or `looptrace train` for model 'rs-uniform')")


def test_damaged_checkpoint_through_the_dump_cli(tmp_path):
    ckpt = tiny_checkpoint(tmp_path / "train", name="rs-uniform")
    ckpt.write_bytes(b"garbage\n")
    params = tmp_path / "params.yaml"
    params.write_text("dump: {}\n")
    res = CliRunner().invoke(app, ["dump", "--model", "rs-uniform", "--params", str(params),
                                   "--train-root", str(tmp_path / "train"), "--out", str(tmp_path / "dump")])
    assert res.exit_code == USER_EXIT
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: checkpoint '{ckpt}'") and "looptrace train" in lines[0]


def test_missing_checkpoint_is_a_missing_input(tmp_path):
    with pytest.raises(MissingInputError, match=r"checkpoint '.*rs-x/model.pt' not found; rebuild it with"):
        load_checkpoint(tmp_path / "rs-x" / "model.pt")


def test_truncated_token_loop_names_the_file(tmp_path):
    from looptrace.io.tables import load_token_loop
    from tests.builders import token_loop_splits, write_token_loop

    p = write_token_loop(tmp_path / "geometry" / "m" / "token_loop.parquet", token_loop_splits(n=20))
    p.write_bytes(p.read_bytes()[:100])
    with pytest.raises(InputError) as exc:
        load_token_loop(p, ("val",))
    assert str(exc.value).startswith(f"{p} is truncated or not a Parquet file")
    assert "re-run the geometry stage" in str(exc.value)


def test_out_pointing_at_a_file_is_refused(tmp_path):
    from looptrace.io.artifacts import atomic_dir

    f = tmp_path / "afile"
    f.write_text("x")
    with pytest.raises(InputError, match=r"output '.*afile' is a file, not a directory"), atomic_dir(f):
        pass
    with pytest.raises(InputError, match=r"'.*afile' is a file, not a directory"), atomic_dir(f / "sub"):
        pass
    assert f.read_text() == "x"


def test_read_json_names_file_and_producer(tmp_path):
    from looptrace.io.artifacts import read_json

    p = tmp_path / "artifacts" / "readouts" / "m" / "metrics.json"
    p.parent.mkdir(parents=True)
    p.write_text('{"a": 1, ')
    with pytest.raises(InputError) as exc:
        read_json(p)
    assert str(exc.value).startswith(f"{p} is truncated or not JSON (")
    assert str(exc.value).endswith("re-run the readouts stage (`dvc repro readouts`) to rebuild it")
    with pytest.raises(MissingInputError, match="run the readouts stage"):
        read_json(Path(p.parent / "nope.json"))
