"""Per-stage output manifests: every file of an output directory with its sha256, written last.

:func:`looptrace.io.artifacts.swap_in` writes ``manifest.json`` into the staged directory just before it swaps it
in, so a manifest exists only beside a complete output (like a store's digests). It records the stage that wrote
the directory (the swap replaces only a directory whose manifest names the running stage,
:func:`looptrace.io.guard.check_replaceable`) and ``file -> sha256`` for every file under it (paths relative to
the directory, ``/``-separated, sorted; no time stamps, so the same outputs give the same manifest bytes).

Readers of another stage's tables and JSON (:func:`looptrace.io.artifacts.read_parquet`, ``read_json``,
:func:`looptrace.io.tables.load_token_loop`) call :func:`verify`: a file whose digest differs from the one its
directory's manifest lists is a one-line :class:`~looptrace.config.InputError` naming the file and the stage to
re-run. A directory without a manifest (written before manifests, or restored by DVC, whose outs list files) is
read unverified; Parquet files also carry page checksums, verified on every read.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from looptrace.config import STAGE_NAMES, InputError

#: File name of the manifest inside an output directory.
MANIFEST = "manifest.json"
_CHUNK = 1 << 20
#: (path, size, mtime_ns) -> sha256 of files verified in this process (a table read twice is hashed once).
_VERIFIED: dict[tuple[str, int, int], str] = {}


def sha256_file(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_CHUNK):
            h.update(block)
    return h.hexdigest()


def build_manifest(root: str | os.PathLike, stage: str | None) -> dict[str, Any]:
    """The manifest of the directory ``root`` (every file under it but the top-level manifest itself)."""
    root = Path(root)
    files: dict[str, str] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(filenames):
            p = Path(dirpath, name)
            rel = p.relative_to(root).as_posix()
            if rel == MANIFEST:
                continue
            files[rel] = sha256_file(p)
    return {"stage": stage, "algorithm": "sha256", "files": dict(sorted(files.items()))}


def write_manifest(root: str | os.PathLike, stage: str | None) -> Path:
    """Write ``root/manifest.json`` (call it last, after every other file of the directory is written)."""
    path = Path(root) / MANIFEST
    path.write_text(json.dumps(build_manifest(root, stage), indent=1, sort_keys=True) + "\n")
    return path


def producer(path: Path | str) -> str:
    """How to rebuild the artifact at ``path``: ``the <stage> stage (dvc repro <stage>)`` for a path under a stage's
    output directory (the nearest such directory), else "the stage that wrote it"."""
    for part in reversed(Path(path).parts[:-1]):
        if part in STAGE_NAMES:
            return f"the {part} stage (`dvc repro {part}`)"
    return "the stage that wrote it"


def _load(path: Path) -> dict | None:
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise InputError(f"{path} is damaged ({str(exc).splitlines()[0][:80] if str(exc) else type(exc).__name__}); "
                         f"re-run {producer(path)} to rebuild its directory") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("files"), dict):
        raise InputError(f"{path}: field 'files' is missing or not a mapping; re-run {producer(path)}")
    return doc


def read_manifest_stage(path: str | os.PathLike) -> str | None:
    """The stage a manifest names (None when there is no manifest or it names none)."""
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    stage = doc.get("stage") if isinstance(doc, dict) else None
    return stage if isinstance(stage, str) else None


def verify(path: str | os.PathLike) -> bool:
    """Check ``path`` against the manifest of its directory (nothing to check when there is none, or when the
    manifest does not list it). Returns whether the manifest covered it.

    Raises:
        InputError: the file's sha256 differs from the manifest's, or the manifest is damaged.
    """
    path = Path(path)
    mpath = path.parent / MANIFEST
    if path.name == MANIFEST or not mpath.is_file():
        return False
    doc = _load(mpath)
    want = doc["files"].get(path.name) if doc else None
    if want is None:
        return False
    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    got = _VERIFIED.get(key) or sha256_file(path)
    if got != want:
        raise InputError(f"{path} does not match its {MANIFEST} (sha256 {got[:12]}, written as {want[:12]}): the file "
                         f"was damaged or changed after it was written; re-run {producer(path)} to rebuild it")
    _VERIFIED[key] = got
    return True


__all__ = ["MANIFEST", "build_manifest", "read_manifest_stage", "sha256_file", "verify", "write_manifest"]
