"""Atomic artifact writing shared by every stage.

A stage writes its whole output directory into a temporary sibling and swaps it in at the end, so
an interrupted or failed run never leaves a mix of old and new files that a later stage (or DVC)
could take for valid output. ``jsonable`` makes ``metrics.json`` parse for ``dvc metrics show``.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl


@contextlib.contextmanager
def atomic_dir(out_dir: Path | str) -> Iterator[Path]:
    """Yield a temporary directory that replaces ``out_dir`` when the block exits cleanly.

    On any exception the temporary directory is removed and ``out_dir`` is left as it was.
    """
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".tmp", dir=out_dir.parent))
    try:
        yield tmp
        if out_dir.exists():
            old = out_dir.with_name(f".{out_dir.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(out_dir, old)
            os.replace(tmp, out_dir)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out_dir)
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
            df.write_parquet(tmp / f"{name}.parquet")
        for name, text in (extra_text or {}).items():
            (tmp / name).write_text(text)
        (tmp / "metrics.json").write_text(json.dumps(jsonable(metrics), indent=2, allow_nan=True) + "\n")


def write_parquet_atomic(df: pl.DataFrame, path: Path | str) -> None:
    """Write a polars frame to ``path`` via a temporary file and ``os.replace``."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    df.write_parquet(tmp)
    os.replace(tmp, path)
