"""Parquet written with page checksums and read with verification.

Every table a stage writes carries a CRC32 per data page (``write_page_checksum=True``) and every table a stage
reads is decoded with ``page_checksum_verification=True`` (both pyarrow's; the Parquet format's own page CRC), so
bytes damaged inside a data page — which the footer and the schema never notice — are a one-line
:class:`~looptrace.config.InputError` naming the file and the stage to re-run instead of silently different
numbers. The directory's manifest (:mod:`looptrace.io.manifest`) is checked first: it also covers a file whose
pages are intact but whose bytes were swapped or edited.

``benchmarks/verify_read.py`` measures what verification costs at read time.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq

from looptrace.config import InputError
from looptrace.io.manifest import producer
from looptrace.io.manifest import verify as verify_manifest

#: Options of every Parquet file the stages write (page checksums on; zstd as polars' own writer uses).
WRITE_OPTIONS: dict[str, Any] = {"compression": "zstd", "write_page_checksum": True}


def write_parquet(df: pl.DataFrame, path: str | os.PathLike) -> None:
    """Write ``df`` to ``path`` with page checksums (:data:`WRITE_OPTIONS`)."""
    pq.write_table(df.to_arrow(), path, **WRITE_OPTIONS)


def parquet_writer(path: str | os.PathLike, schema: pa.Schema, **options: Any) -> pq.ParquetWriter:
    """A streaming ``pq.ParquetWriter`` with page checksums on (``options`` as pyarrow's)."""
    return pq.ParquetWriter(path, schema, **{"write_page_checksum": True, **options})


def verify_parquet(path: str | os.PathLike, columns: Sequence[str] | None = None) -> None:
    """Check the table at ``path`` before it is read: against its directory's manifest (sha256 of every byte) when
    the manifest lists it, else by decoding ``columns`` with ``page_checksum_verification=True`` (pyarrow).

    Raises:
        InputError: the file does not match its manifest, a page checksum fails, or it is not readable Parquet.
    """
    path = Path(path)
    if verify_manifest(path):
        return
    try:
        pq.read_table(path, columns=None if columns is None else list(columns), page_checksum_verification=True)
    except (OSError, pa.ArrowException, ValueError) as exc:
        raise _damaged(path, exc) from None


def _damaged(path: Path, exc: BaseException) -> InputError:
    msg = str(exc).strip().splitlines()[0][:120] if str(exc).strip() else type(exc).__name__
    what = ("has a damaged data page" if "checksum" in msg.lower() or "crc" in msg.lower()
            else "is truncated or not a Parquet file")
    return InputError(f"{path} {what} ({msg}); re-run {producer(path)} to rebuild it")


def read_verified(path: str | Path, columns: Sequence[str] | None = None, verify: bool = True) -> pl.DataFrame:
    """``pl.read_parquet(path, columns=...)`` after :func:`verify_parquet` (``verify=False``: without it)."""
    if verify:
        verify_parquet(path, columns)
    try:
        return pl.read_parquet(path, columns=None if columns is None else list(columns))
    except (OSError, pl.exceptions.PolarsError) as exc:
        raise _damaged(Path(path), exc) from None


__all__ = ["WRITE_OPTIONS", "parquet_writer", "read_verified", "verify_parquet", "write_parquet"]
