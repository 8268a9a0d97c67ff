"""Atomic artifact writing shared by every stage.

A stage writes its whole output directory into a temporary sibling and swaps it in at the end, so
an interrupted or failed run never leaves a mix of old and new files that a later stage (or DVC)
could take for valid output. ``jsonable`` makes ``metrics.json`` parse for ``dvc metrics show``.

Reading another stage's artifact goes through :func:`read_parquet` / :func:`read_json`: a missing file is a
:class:`~looptrace.config.MissingInputError` and a truncated or damaged one an
:class:`~looptrace.config.InputError`, each one line naming the file and the stage that rebuilds it (a parse
failure inside polars or json would otherwise surface as a bare "Expecting ',' delimiter").
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl

from looptrace.config import InputError, MissingInputError
from looptrace.io.guard import CURRENT_STAGE, check_replaceable
from looptrace.io.interrupts import committing
from looptrace.io.manifest import producer, verify, write_manifest
from looptrace.io.parquet import read_verified, write_parquet


#: Stage names, as directories under ``artifacts/`` (which stage rebuilds a file).
def _damaged(path: Path, what: str, exc: BaseException) -> InputError:
    msg = str(exc).strip().splitlines()[0][:120] if str(exc).strip() else type(exc).__name__
    return InputError(f"{path} is truncated or not {what} ({msg}); re-run {producer(path)} to rebuild it")


def read_parquet(path: Path | str, **kwargs: Any) -> pl.DataFrame:
    """``pl.read_parquet(path, **kwargs)``, with a missing or damaged file as a one-line user error.

    Raises:
        MissingInputError: no file at ``path``.
        InputError: the file is not a readable Parquet file (truncated, overwritten).
    """
    path = Path(path)
    if not path.is_file():
        raise MissingInputError(f"{path} not found; run {producer(path)} first")
    unknown = set(kwargs) - {"columns"}
    if unknown:
        raise TypeError(f"read_parquet: unsupported arguments {sorted(unknown)}")
    return read_verified(path, columns=kwargs.get("columns"))  # manifest digest and page checksums


def read_json(path: Path | str) -> Any:
    """The JSON document at ``path``, with a missing or damaged file as a one-line user error.

    Raises:
        MissingInputError: no file at ``path``.
        InputError: the file is not valid JSON (truncated, overwritten).
    """
    path = Path(path)
    if not path.is_file():
        raise MissingInputError(f"{path} not found; run {producer(path)} first")
    verify(path)  # against its directory's manifest
    try:
        return json.loads(path.read_text())
    except (UnicodeDecodeError, ValueError) as exc:
        raise _damaged(path, "JSON", exc) from None


def check_output_path(out: Path | str) -> Path:
    """Create ``out``'s parent directories, refusing in one line an output (or a parent) that is an existing file
    (``--out`` pointing at a file).

    Raises:
        InputError: ``out`` or one of its parents exists and is not a directory.
    """
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise InputError(f"output '{out}' is a file, not a directory; pass --out a directory (or remove the file)")
    for parent in out.parents:
        if parent.exists() and not parent.is_dir():
            raise InputError(f"output '{out}': '{parent}' is a file, not a directory; pass --out a directory")
    out.parent.mkdir(parents=True, exist_ok=True)
    return out


def clear_debris(out_dir: Path | str) -> list[Path]:
    """Remove what a killed run of :func:`atomic_dir` left beside ``out_dir``: its staging dirs
    (``.<name>.XXXXXXXX.tmp``) and a half-swapped ``.<name>.old``. Call it only while holding ``out_dir``'s
    :func:`looptrace.io.claims.output_lock` (then no other live run owns them). Returns what was removed."""
    out_dir = Path(out_dir)
    if not out_dir.parent.is_dir():
        return []
    pattern = re.compile(rf"\.{re.escape(out_dir.name)}\.(?:[A-Za-z0-9_]{{8}}\.tmp|old)")
    removed = [p for p in sorted(out_dir.parent.iterdir()) if pattern.fullmatch(p.name)]
    for p in removed:
        shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
    return removed


def swap_in(staged: Path | str, out_dir: Path | str) -> None:
    """Replace ``out_dir`` by the directory ``staged`` (a sibling), whole: a reader sees the old or the new one,
    never a mix. A kill between the two renames leaves ``.<name>.old`` (and no ``out_dir``), which
    :func:`clear_debris` removes on the next run. Swapping in the directory a stage holds commits the stage
    (:mod:`looptrace.io.interrupts`: a Ctrl-C during the renames waits for them)."""
    staged, out_dir = Path(staged), Path(out_dir)
    _claim_and_manifest(staged, out_dir)
    old = out_dir.with_name(f".{out_dir.name}.old")
    shutil.rmtree(old, ignore_errors=True)  # a stale one of an earlier kill (not part of the commit)
    with committing(out_dir):  # a Ctrl-C waits for the renames; the stage's own directory commits it
        if out_dir.exists():
            os.replace(out_dir, old)
        os.replace(staged, out_dir)
    shutil.rmtree(old, ignore_errors=True)


def _claim_and_manifest(staged: Path, out_dir: Path) -> None:
    """Before a swap: refuse replacing what another stage wrote, then write the staged directory's manifest last
    (:mod:`looptrace.io.guard`, :mod:`looptrace.io.manifest`)."""
    check_replaceable(out_dir)
    write_manifest(staged, CURRENT_STAGE.get())


@contextlib.contextmanager
def atomic_dir(out_dir: Path | str) -> Iterator[Path]:
    """Yield a temporary directory that replaces ``out_dir`` when the block exits cleanly.

    On any exception the temporary directory is removed and ``out_dir`` is left as it was.

    Raises:
        InputError: ``out_dir`` (or a parent) exists and is not a directory (:func:`check_output_path`).
    """
    out_dir = check_output_path(out_dir)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".tmp", dir=out_dir.parent))
    try:
        yield tmp
        swap_in(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def jsonable(obj: Any) -> Any:
    """Plain JSON types for ``metrics.json`` and store attributes (the one converter of the project).

    numpy scalars/arrays → Python, tuples → lists, NaN/±inf → None (JSON has no NaN; ``dvc metrics show``
    must parse), anything else that JSON cannot hold (paths, dtypes, devices) → its ``str``.
    """
    if isinstance(obj, Mapping):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [jsonable(v) for v in obj]
    if isinstance(obj, np.ndarray):
        return jsonable(obj.tolist())
    if isinstance(obj, np.generic):
        obj = obj.item()
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if obj is None or isinstance(obj, bool | int | float | str):
        return obj
    return str(obj)


def write_outputs(out_dir: Path | str, frames: dict[str, pl.DataFrame], metrics: dict,
                  extra_text: dict[str, str] | None = None) -> None:
    """Write ``<name>.parquet`` for each frame and ``metrics.json`` atomically into ``out_dir``.

    Everything goes to a temporary sibling directory first, which then replaces ``out_dir``, so an
    interrupted run never leaves a mix of old and new files.

    Args:
        out_dir: the model's (or stage's) output directory.
        frames: file stem -> frame.
        metrics: JSON-able dict (NaN written as null).
        extra_text: file name -> text written beside them (``summary.md``).
    """
    with atomic_dir(out_dir) as tmp:
        for name, df in frames.items():
            write_parquet(df, tmp / f"{name}.parquet")  # page checksums
        for name, text in (extra_text or {}).items():
            (tmp / name).write_text(text)
        (tmp / "metrics.json").write_text(json.dumps(jsonable(metrics), indent=2, allow_nan=True) + "\n")


def write_parquet_atomic(df: pl.DataFrame, path: Path | str) -> None:
    """Write a polars frame to ``path`` via a temporary file and ``os.replace``."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    write_parquet(df, tmp)
    os.replace(tmp, path)
