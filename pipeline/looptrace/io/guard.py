"""Outputs never destroy inputs.

Two guards, both one-line :class:`~looptrace.config.InputError` refusals raised before anything is written:

- :func:`check_overlap`: a stage's ``--out`` root and each of its input roots are resolved (real paths, symlinks
  followed) and must be disjoint: ``--out`` equal to, inside or above an input root is refused. Overlap is checked
  on the roots, not on the model's sub-directory, so the check does not depend on which model a run names.
- :func:`check_replaceable`: the atomic swap (:func:`looptrace.io.artifacts.swap_in`) replaces an existing
  output directory only if this stage wrote it: its manifest (:mod:`looptrace.io.manifest`) names this stage, or
  it holds nothing another stage owns (a directory written before manifests existed). A directory holding a Zarr
  store, a checkpoint of another stage, or another stage's manifest is never removed.

The stage name comes from :func:`looptrace.io.claims.stage_output` (``stage=``), held in :data:`CURRENT_STAGE`
while the stage writes.
"""

from __future__ import annotations

import contextvars
import os
import re
from collections.abc import Mapping
from pathlib import Path

from looptrace.config import InputError
from looptrace.io.manifest import MANIFEST, read_manifest_stage

#: The stage writing now (set by ``stage_output(..., stage=...)``); None outside a stage (library use, tests).
CURRENT_STAGE: contextvars.ContextVar[str | None] = contextvars.ContextVar("looptrace_stage", default=None)

_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]+://")


def _real(p: str | os.PathLike) -> Path:
    return Path(os.path.realpath(os.path.abspath(os.fspath(p))))


def _relation(out: Path, inp: Path) -> str | None:
    if out == inp:
        return "is"
    if inp in out.parents:
        return "lies inside"
    if out in inp.parents:
        return "contains"
    return None


def check_overlap(out: str | os.PathLike, inputs: Mapping[str, str | os.PathLike | None],
                  out_flag: str = "--out") -> None:
    """Refuse an output root that is, lies inside, or contains one of the input roots (after resolving symlinks).

    Args:
        out: the stage's output root (``--out``); an fsspec URL (``s3://...``) is not a local path and is skipped.
        inputs: option name (``--dump-root``) -> input root; None entries and URLs are skipped.
        out_flag: how the output option is named in the message.

    Raises:
        InputError: one line naming both options, both paths and the fix.
    """
    if _URL.match(os.fspath(out)):
        return
    ro = _real(out)
    for flag, inp in inputs.items():
        if inp is None or _URL.match(os.fspath(inp)):
            continue
        ri = _real(inp)
        rel = _relation(ro, ri)
        if rel is None:
            continue
        plain = str(ro) == os.path.abspath(os.fspath(out)) and str(ri) == os.path.abspath(os.fspath(inp))
        shown = "" if plain else f" (resolved: {ro} {rel} {ri})"
        raise InputError(f"{out_flag} '{out}' {rel} the input root {flag} '{inp}'{shown}: writing there could destroy "
                         f"the inputs; pass {out_flag} a directory outside every input root")


#: What marks a directory as another stage's input that a swap must never remove (a Zarr store, a checkpoint).
_FOREIGN = ("zarr.json", "model.pt")


def check_replaceable(out_dir: str | os.PathLike) -> None:
    """Refuse replacing an existing ``out_dir`` that this stage did not write (see the module docstring).

    Raises:
        InputError: ``out_dir`` holds another stage's output (its manifest names another stage) or an input
            (a Zarr store, another stage's checkpoint): one line naming it and the fix.
    """
    out_dir = Path(out_dir)
    if not out_dir.is_dir():
        return
    stage = CURRENT_STAGE.get()
    owner = read_manifest_stage(out_dir / MANIFEST)
    if owner is not None:
        if stage is None or owner == stage:
            return
        raise InputError(f"output '{out_dir}' holds the {owner} stage's outputs (its {MANIFEST}), not the {stage} "
                         f"stage's; refusing to replace them: pass --out another directory")
    for dirpath, dirnames, filenames in os.walk(out_dir):
        hit = [f for f in filenames if f in _FOREIGN and not (f == "model.pt" and stage in (None, "train"))]
        if hit:
            what = "a Zarr store" if hit[0] == "zarr.json" else "a checkpoint"
            raise InputError(f"output '{out_dir}' holds {what} ('{Path(dirpath, hit[0])}') that the "
                             f"{stage or 'running'} stage did not write; refusing to replace it: pass --out another "
                             "directory")
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]





def input_roots(train_root, dump_root, readouts_root, gates_root) -> dict[str, os.PathLike]:
    """The input roots of the online stages (latency, generate), by option name."""
    return {"--train-root": train_root, "--dump-root": dump_root, "--readouts-root": readouts_root,
            "--gates-root": gates_root}


#: The stages whose outputs the report reads under ``--root`` (SPEC §10 layout).
REPORT_READS = ("readouts", "gates", "geometry", "diagnose", "latency", "generate", "loopmap")


def report_inputs(root: str | os.PathLike) -> dict[str, os.PathLike]:
    """The report's input roots: ``<root>/<stage>`` for each stage it reads."""
    return {f"--root ({s})": Path(root) / s for s in REPORT_READS}
__all__ = ["CURRENT_STAGE", "REPORT_READS", "check_overlap", "check_replaceable", "input_roots", "report_inputs"]
