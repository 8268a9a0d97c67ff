"""Resume, not restart: what identifies a store's inputs (:func:`fingerprint`, :func:`code_hash`,
:func:`weights_hash`) and how a dump joins its store's plan or makes the next one (:func:`join_or_plan`, the claims
protocol of :mod:`looptrace.io.claims`).

Each chunk gets a completion marker after all of its arrays are written. A dump that is killed at any point and run
again with the same inputs finds the first unmarked chunk and restarts there (:func:`looptrace.capture.dump.dump_split`);
a store with a different fingerprint (params, weights, model config, data, versions, source of the value-producing
modules) is dumped again from scratch, unless another live run is writing it, which is refused. A complete store
with damaged chunks is repaired; one with debris is tidied."""

from __future__ import annotations

import hashlib
import json
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from looptrace.io.claims import Coordinator, Superseded
from looptrace.io.store.location import (
    StoreTarget,
    is_remote,
    remove_debris,
    store_location,
)
from looptrace.io.store.schema import SCHEMA_VERSION
from looptrace.io.store.writer import StoreWriter
from looptrace.models.interface import LoopedModelAdapter, LoopedTransformerAdapter
from looptrace.project import source_hash
from looptrace.tasks import TaskBatch

# Parameters that change how fast, not what, is written: left out of the resume fingerprint.
NOT_FINGERPRINTED = ("writer_queue", "sequences", "claim_lease_s")


def _data_hash(data: TaskBatch) -> str:
    h = hashlib.sha256()
    for name in ("tokens", "targets", "difficulty", "token_type"):
        a = np.ascontiguousarray(getattr(data, name), dtype=np.int64)
        h.update(name.encode() + str(a.shape).encode() + a.tobytes())
    return h.hexdigest()


#: Modules whose code decides the stored values. Their source is part of the fingerprint: DVC re-runs the stage
#: when one changes, and the store it keeps (``persist``) must then be dumped again, not returned as complete; a
#: resume likewise never mixes chunks written by two versions of the code.
VALUE_MODULES = ("looptrace.capture.dump", "looptrace.capture.chunks", "looptrace.capture.encode",
                 "looptrace.signals.logits", "looptrace.signals.names", "looptrace.io.precision",
                 "looptrace.io.store.schema", "looptrace.io.store.writer", "looptrace.io.store.chunk_io",
                 "looptrace.models.interface", "looptrace.models.looped", "looptrace.loopmap.contraction",
                 "looptrace.capture.layers", "looptrace.capture.heads")


def code_hash(*extra_modules: str) -> str:
    """sha256 of the source of :data:`VALUE_MODULES` and ``extra_modules`` (the adapter's class and the looptrace
    classes it derives from, a finalizer's)."""
    return source_hash((*VALUE_MODULES, *extra_modules))


def weights_hash(adapter: LoopedModelAdapter) -> str:
    """What identifies the model's values in the fingerprint.

    For looptrace's own models: sha256 of the weights (names, dtypes, shapes, bytes), not of ``model.pt``,
    whose bytes also hold wall-clock fields (``train_seconds``): identical weights retrained give the same
    fingerprint. For other adapters: ``info.checkpoint_hash`` (a hash of the weight files only).
    """
    model = getattr(adapter, "model", None)
    if not isinstance(adapter, LoopedTransformerAdapter) or not isinstance(model, torch.nn.Module):
        return adapter.info.checkpoint_hash
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        t = t.detach().to("cpu").contiguous()
        h.update(f"{name}\0{t.dtype}\0{tuple(t.shape)}\0".encode())
        # the array's buffer, not a bytes copy of it (same digest; a 1.4B model's weights are 2.8 GB)
        h.update(t.view(torch.uint8).numpy().data if t.numel() else b"")
    return h.hexdigest()


def fingerprint(adapter: LoopedModelAdapter, data: TaskBatch, section: Mapping[str, Any], attrs: Mapping,
                code: str) -> str:
    """sha256 of what decides a store's values: the ``dump`` section (``section``: as a dict, without
    :data:`NOT_FINGERPRINTED`), the model (name, config, weights), the data, the user attributes and ``code``."""
    info = adapter.info
    params = {k: v for k, v in section.items() if k not in NOT_FINGERPRINTED}
    blob = json.dumps({"schema": SCHEMA_VERSION, "params": params, "name": info.name, "config": info.config,
                       "weights": weights_hash(adapter), "data": _data_hash(data), "code": code,
                       "attrs": attrs}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()

def _say(msg: str) -> None:
    tqdm.write(msg, file=sys.stderr)


def join_or_plan(coord: Coordinator, path: StoreTarget, label: str, fp: str, own: range,
                  create_layout: Callable[[], StoreWriter]) -> tuple[int, str, str | None, dict] | None:
    """Join the store's live plan, or make the next one (the claims protocol, :mod:`looptrace.io.claims`).

    Returns None when the store is complete with these inputs and this process's range verified (nothing to
    write), else ``(plan, kind, shard claim or None if already done, {chunk: damage} found before planning)``.
    """
    k: int | None
    damage: dict[int, str]
    while True:
        plan = coord.current_plan()
        if plan is not None and plan.active:
            coord.refuse_incompatible(plan)
            if plan.kind == "tidy":
                coord.wait_inactive(plan)
                continue
            ready = coord.wait_ready(plan)
            if ready is None:
                continue
            k, kind, damage = ready.gen, ready.kind, {}
        else:
            writer = StoreWriter.reopen(path)
            same = writer is not None and writer.attrs.get("fingerprint") == fp
            damage = {}
            if same and writer is not None and writer.attrs.get("complete"):  # (same implies writer)
                damage = writer.damaged_chunks(own)
                metadata = writer.metadata_ok()
                if not damage and metadata and not coord.debris() and not _has_debris(path):
                    return None
                kind = "repair" if damage or not metadata else "tidy"
                if damage:
                    first = next(iter(damage.items()))
                    _say(f"{label}: {len(damage)} damaged chunk(s) (chunk {first[0]}: {first[1]}); rewriting them")
                elif not metadata:
                    _say(f"{label}: complete but its consolidated metadata is missing or stale; finalising again")
            elif same:
                kind = "resume"
            else:
                kind = "layout"
            if (kind == "resume" and plan is not None and plan.ready and plan.fingerprint == fp
                    and plan.n_shards == coord.n and plan.kind != "tidy"):
                k = plan.gen  # the inactive current plan: take over its (dead) claims
                kind = plan.kind if plan.kind == "repair" else "resume"
            else:
                k = coord.new_plan(kind)
                if k is None:
                    continue  # another process made that plan first: look again
                if kind == "layout":
                    if writer is not None:
                        _say(f"{label}: existing store was dumped with different parameters, checkpoint, data or "
                             "code; starting over")
                    elif _has_anything(path):
                        _say(f"{label}: existing store is unreadable or from another schema; starting over")
                    create_layout()
                elif kind == "repair":
                    assert writer is not None  # repair: same store
                    writer.set_incomplete()
                remove_debris(path)  # nothing under an older plan is live: no temp file is being written
                if kind == "tidy":
                    coord.finish(f"plan@{k}.json")
                    coord.remove_plans_upto(k)
                    return None
                coord.set_ready()
        try:
            claim = coord.claim_shard(k)
        except Superseded:
            continue
        return k, kind, claim, damage


def _has_debris(path: StoreTarget) -> bool:
    loc = store_location(path)
    if loc is None or is_remote(path) or not Path(loc).is_dir():
        return False
    return any(True for _ in Path(loc).rglob("*.partial"))


def _has_anything(path: StoreTarget) -> bool:
    loc = store_location(path)
    if loc is None:
        return bool(_memory_keys(path))
    return not is_remote(path) and Path(loc).exists()

def _memory_keys(store) -> list:
    return list(getattr(store, "_store_dict", {}) or [])
