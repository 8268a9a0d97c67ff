"""The ``dump`` stage: run a looped model once and persist every scored token's trajectory (SPEC §1).

For each batch of sequences the model interface (:mod:`looptrace.models.interface`) returns the per-loop states;
each loop is read out on its own (never [batch, seq, loop, vocab] in memory), loop T first so that
``kl_final`` can be computed while streaming loops 1..T (:class:`looptrace.signals.logits.LoopStats`). Rows are the
scored positions (``targets != IGNORE``) in (sequence, position) order; ``sequence`` is the row index of
the input :class:`~looptrace.tasks.TaskBatch`.

Compute and I/O overlap: the forward pass fills whole token chunks, which a bounded background thread
compresses and writes (``dump.writer_queue`` chunks in flight), so the capture costs little beyond the
forward pass (:mod:`looptrace.capture.chunks`). Only whole, aligned chunks are ever written (SPEC §1: unaligned
concurrent writes lose rows).

Resume, not restart (:mod:`looptrace.capture.resume`): a dump killed at any point and run again with the same inputs
finds the first unmarked chunk, maps it to the sequence holding its first token (cumulative scored-token counts) and
restarts the forward pass at the batch that contains that sequence — batches keep the same boundaries as an
uninterrupted run, so the arrays end up bit-identical. ``complete`` is set only after everything is written.

Writers and claims (:mod:`looptrace.io.claims`): every dump of a store first joins or creates the store's
*plan* (fingerprint + shard count) and claims its shard, in the sibling ``.<split>.zarr.claims``. One process
(1 of 1) or N cooperating processes (``shard=(i, N)``: ``--shard i/N`` or ``RANK``/``WORLD_SIZE``) each write
the chunks of a contiguous, chunk-aligned range (:func:`looptrace.io.claims_dir.shard_range`) — the
:class:`~looptrace.io.store.writer.StoreWriter` refuses any other chunk, so no two writers ever share a chunk. A shard
starts at the batch holding its first token, with the batch boundaries of a 1-process run, so every array is
bit-identical to it. Whoever finds every chunk written finalises (one finaliser claim): the finalize hook,
``nan_count``, consolidated metadata, then ``complete``. A re-run over a complete store verifies its range
(checksums and chunk digests) and rewrites what is damaged.

The splits' prefix-overlap checks are :mod:`looptrace.capture.prefix_overlap`; a checkpoint on a text corpus is
dumped by :mod:`looptrace.capture.dump_text`.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from looptrace.capture import heads as _heads
from looptrace.capture import layers as _layers
from looptrace.capture.chunks import (
    NONFINITE,
    BackgroundWriter,
    ChunkAssembler,
    ChunkBuffers,
    encode_pool,
    reuse_freed_memory,
    writer_threads,
)
from looptrace.capture.encode import encode_states_counted
from looptrace.capture.prefix_overlap import (
    check_prefix_overlap,
    check_training_split,
    overlap_attrs,
    overlap_line,
)
from looptrace.capture.resume import code_hash, fingerprint, join_or_plan
from looptrace.capture.transfer import Transfer, resolve, take_rows, transfer_for
from looptrace.config import BaseConfig, ConfigError, InputError, to_dict
from looptrace.io.claims import LEASE_S, Coordinator, NullCoordinator
from looptrace.io.claims_dir import shard_range
from looptrace.io.precision import resolve_state_dtype
from looptrace.io.store.location import (
    StoreTarget,
    assert_store_or_absent,
    is_remote,
    join_store,
    remove_debris,
    store_location,
)
from looptrace.io.store.reader import TrajectoryStore, open_store
from looptrace.io.store.schema import DIMS, DTYPES, HIDDEN_DTYPES, STAT_NAMES, StoreError
from looptrace.io.store.writer import ArraySpec, StoreWriter
from looptrace.loopmap import contraction as _contraction
from looptrace.loopmap.contraction import ContractionConfig
from looptrace.models.adapters.loading import AdapterConfig
from looptrace.models.interface import LoopedModelAdapter
from looptrace.project import versions
from looptrace.signals.logits import LoopStats
from looptrace.tasks import IGNORE, SPLITS, Task, TaskBatch
from looptrace.tasks.base import split_overlap
from looptrace.tasks.text import TextConfig


@dataclass(frozen=True)
class DumpConfig:
    """``dump`` section of params.yaml.

    Attributes:
        sequences: split -> number of sequences to dump (data seeds come from the checkpoint).
        batch_size: sequences per forward pass.
        chunk_tokens: rows per store chunk along ``token`` (the unit of writing, resuming and streaming reads).
        hidden_dtype: stored dtype of ``hidden``/``hidden_init``: ``float16``, ``float32``, ``bfloat16`` (kept as
            its uint16 bits) or ``auto`` (bfloat16 for bf16 models, else float16; :mod:`looptrace.io.precision`).
            A finite state beyond float16's range is an error, never a silent inf.
        full_logits_max_vocab: store full ``logits`` when vocab ≤ this, else ``topk_ids``/``topk_logits``
            (the statistics are exact either way: computed from the full logits at dump time).
        topk: k of the top-k logits (capped at the vocabulary size).
        writer_queue: whole chunks that may wait for the background writer (bounds memory).
        allow_nan: accept NaN/Inf in the stored states (they are counted in ``nan_count`` either way);
            when false a dump that produced any fails after writing, and readers refuse the store.
        clevel: zstd compression level (Blosc, byte shuffle).
        adapter: a real checkpoint to dump instead of a trained looptrace model (``looptrace.models.adapters``;
            the run name is ``adapter.name``); null = the default pipeline's checkpoints.
        text: the corpus of an adapter dump (:class:`looptrace.tasks.text.TextConfig`); required with ``adapter``.
        claim_lease_s: a writer's claim held by a process on *another host* counts as dead after this many
            seconds without a heartbeat (same host: as soon as its pid is gone); not fingerprinted.
        allow_prefix_overlap: write a test store even when some of its scored tokens have a context (the prefix
            they condition on, :meth:`looptrace.tasks.Task.context_split`) that is also scored in fit or val;
            false (default) refuses it (:func:`check_prefix_overlap`). The measured overlap is recorded in every
            store's ``prefix_overlap`` attribute either way.
        contraction: also store the loop map's local contraction and FTLE per (token, loop) (SPEC §2b,
            :mod:`looptrace.loopmap.contraction`; JVPs through the model's loop step, 25–100× the cost of a plain
            dump on the toy models: docs/dump.md); null (default) = off.
        layers: also store the outputs of these layers of the looped block at every loop, ``layer_hidden``
            [token, loop, layer, d_model] in the states' dtype (:mod:`looptrace.capture.layers`; its size is
            printed before writing); empty (default) = none.
        heads: also store, for these layers of the looped block, every attention head's entropy and its
            Jensen–Shannon divergence from the previous loop per (token, loop), ``head_entropy`` / ``head_js``
            [token, loop, layer, head] float32 (SPEC §2c, :mod:`looptrace.capture.heads`; computed during the forward
            pass, never storing the attention maps; looptrace's own models); empty (default) = none.
    """

    sequences: dict[str, int] = field(default_factory=lambda: {"fit": 1024, "val": 512, "test": 512})
    batch_size: int = 128
    chunk_tokens: int = 4096
    hidden_dtype: str = "float16"
    full_logits_max_vocab: int = 256
    topk: int = 16
    writer_queue: int = 2
    allow_nan: bool = False
    clevel: int = 1
    adapter: AdapterConfig | None = None
    text: TextConfig | None = None
    claim_lease_s: float = LEASE_S
    allow_prefix_overlap: bool = False
    contraction: ContractionConfig | None = None
    layers: tuple[int, ...] = ()
    heads: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        bad = sorted(set(self.sequences) - set(SPLITS))
        if bad:
            raise ConfigError(f"dump.sequences: unknown split '{bad[0]}' (splits: {', '.join(SPLITS)})")
        if any(int(n) < 1 for n in self.sequences.values()):
            raise ConfigError("dump.sequences: every split needs at least 1 sequence")
        for name in ("batch_size", "chunk_tokens", "topk", "writer_queue"):
            if getattr(self, name) < 1:
                raise ConfigError(f"dump.{name} must be >= 1, got {getattr(self, name)}")
        if self.hidden_dtype not in (*HIDDEN_DTYPES, "auto"):
            raise ConfigError(f"dump.hidden_dtype must be one of {', '.join(HIDDEN_DTYPES)}, auto; "
                              f"got {self.hidden_dtype!r}")
        if self.adapter is not None and self.text is None:
            raise ConfigError("dump.adapter needs dump.text (the corpus to run the checkpoint on)")
        if not 0 <= self.clevel <= 9:
            raise ConfigError(f"dump.clevel must be in 0..9, got {self.clevel}")
        lease = self.claim_lease_s
        if isinstance(lease, bool) or not isinstance(lease, int | float) or not lease > 0:
            raise ConfigError(f"dump.claim_lease_s must be a number of seconds > 0, got {lease!r}")


def _params_attr(cfg: DumpConfig) -> dict[str, Any]:
    """The ``params`` store attribute: the resolved section, without the opt-in ``contraction`` / ``layers`` /
    ``heads`` while they are off (so a default store's attributes are those it had before the options existed)."""
    params = to_dict(cfg)
    if cfg.contraction is None:
        params.pop("contraction")
    if not cfg.layers:
        params.pop("layers")
    if not cfg.heads:
        params.pop("heads")
    return params

def bare_forward(adapter: LoopedModelAdapter, batches: Sequence[torch.Tensor]) -> None:
    """The model's own work that a dump captures, with nothing captured: the states of every batch and the
    readout at every loop (the baseline of the capture's cost in benchmarks/dump.py, dump_hf.py and gpu.py).

    Args:
        adapter: the model.
        batches: [batch, seq] int64 token ids each, on the model's device.
    """
    with torch.inference_mode():
        for ids in batches:
            st = adapter.states(ids)
            for t in range(adapter.info.n_loops):
                adapter.readout(st.hidden[:, :, t], t)

def _say(msg: str) -> None:
    tqdm.write(msg, file=sys.stderr)

def _layout(adapter: LoopedModelAdapter, n_tokens: int, cfg: DumpConfig) -> tuple[dict[str, ArraySpec], int | None]:
    info = adapter.info
    T, D, V = info.n_loops, info.d_model, info.vocab_size
    k = None if V <= cfg.full_logits_max_vocab else min(cfg.topk, V)
    sdt = state_dtype(adapter, cfg)
    specs = {"hidden": ArraySpec((n_tokens, T, D), sdt), "hidden_init": ArraySpec((n_tokens, D), sdt)}
    if k is None:
        specs["logits"] = ArraySpec((n_tokens, T, V), DTYPES["logits"])
    else:
        specs["topk_ids"] = ArraySpec((n_tokens, T, k), DTYPES["topk_ids"])
        specs["topk_logits"] = ArraySpec((n_tokens, T, k), DTYPES["topk_logits"])
    for s in STAT_NAMES:
        specs[s] = ArraySpec((n_tokens, T), DTYPES[s])
    if info.has_gate:
        specs["gate_logit"] = ArraySpec((n_tokens, T), DTYPES["gate_logit"])
    for f in ("target", "token_id", "sequence", "position", "difficulty", "token_type"):
        specs[f] = ArraySpec((n_tokens,), DTYPES[f])
    specs["loop_group"] = ArraySpec((T,), DTYPES["loop_group"])
    if cfg.contraction is not None:  # opt-in: a default store has none of these arrays
        _contraction.check_adapter(adapter)
        specs.update({c: ArraySpec((n_tokens, T), DTYPES[c]) for c in _contraction.CONTRACTION_ARRAYS})
    if cfg.layers:  # opt-in: the size is said before the store is created
        _layers.check_layers(adapter, cfg.layers)
        specs[_layers.LAYER_ARRAY] = ArraySpec((n_tokens, T, len(cfg.layers), D), sdt)
        _say(_layers.size_line(info.name, n_tokens, T, cfg.layers, D, sdt))
    if cfg.heads:  # opt-in: per-head statistics, measured during the forward pass
        n_head = _heads.check_heads(adapter, cfg.heads)
        specs.update({a: ArraySpec((n_tokens, T, len(cfg.heads), n_head), DTYPES[a]) for a in _heads.HEAD_ARRAYS})
        _say(_heads.size_line(info.name, n_tokens, T, cfg.heads, n_head))
    return specs, k


def state_dtype(adapter: LoopedModelAdapter, cfg: DumpConfig) -> str:
    """The stored dtype of the states for this model (``auto`` resolved from ``info.extra['dtype']``)."""
    return resolve_state_dtype(cfg.hidden_dtype, adapter.info.extra.get("dtype"))


#: Bytes of one float32 [rows, vocab] tensor in the statistics' row groups on a CPU (see :func:`stat_row_groups`).
STAT_GROUP_BYTES = 4 << 20


def stat_row_groups(n: int, vocab: int, device: torch.device) -> list[slice]:
    """Row groups of a batch's [n, vocab] logits in which the SPEC §3 statistics are computed, loop by loop.

    On a CPU, groups of ``STAT_GROUP_BYTES`` per [rows, vocab] tensor (21 rows at vocab 49,152, 6 at 166,144):
    the ~20 passes the statistics make over a group's logits and log-probabilities then run in cache rather than
    over the whole batch's (201 MB per tensor at 1,024 rows × 49,152) in memory. Each row's statistics are
    computed alone (:mod:`looptrace.signals.rowwise`), so the values do not depend on the grouping. On an
    accelerator one group (one kernel per operation for the whole batch).
    """
    if device.type != "cpu" or n == 0:
        return [slice(0, n)]
    rows = max(1, STAT_GROUP_BYTES // (4 * max(1, vocab)))
    return [slice(r, min(r + rows, n)) for r in range(0, n, rows)]


@torch.inference_mode()
def _capture(adapter: LoopedModelAdapter, data: TaskBatch, mask: np.ndarray, rows: slice,
             k: int | None, hidden_dtype: str, contraction: ContractionConfig | None = None,
             layers: tuple[int, ...] = (), tx: Transfer | None = None, heads: tuple[int, ...] = ()
             ) -> dict[str, Any]:
    """Every token-axis array of one batch of sequences: name -> [n_scored, ...] numpy (``tx``: the device's
    arrays come back through it, possibly still being copied: :func:`looptrace.capture.transfer.resolve`)."""
    tx = tx or Transfer("cpu")  # (synchronous: tensor.cpu().numpy())
    info = adapter.info
    T = info.n_loops
    dev = adapter.device
    ids = torch.from_numpy(np.ascontiguousarray(data.tokens[rows], dtype=np.int64)).to(dev)
    keep = mask[rows]  # [B, S] scored positions
    all_scored = bool(keep.all())
    if heads:  # the same forward pass, its attention heads recorded by hooks that leave its outputs alone
        with _heads.recording(adapter, heads) as head_rec:
            st = adapter.states(ids)
    else:
        st = adapter.states(ids)
    if all_scored:  # a reshape instead of a gather
        sel = lambda x: x.reshape(-1, *x.shape[2:])  # noqa: E731 - [B, S, ...] -> [B*S, ...] row-major
    else:
        m = torch.from_numpy(keep).to(dev)
        sel = lambda x: x[m]  # noqa: E731
    where = f"dump of '{info.name}', sequences {rows.start}..{rows.stop - 1}"
    # range-checked cast to the stored representation before selecting (half the bytes to gather; float16
    # overflow is an error, bfloat16 is kept as bits), with each row's NaN/Inf count for the chunk marker
    out: dict[str, Any] = {}
    nonfinite = np.zeros(int(keep.sum()), dtype=np.int64)
    for name, x in (("hidden", st.hidden), ("hidden_init", st.hidden_init)):
        enc, bad = encode_states_counted(x.reshape(-1, *x.shape[2:]), hidden_dtype, f"{where}: '{name}'", tx.copy)
        out[name] = enc if all_scored else take_rows(enc, keep.reshape(-1))  # hidden [n, T, D], hidden_init [n, D]
        if bad is not None:
            nonfinite += bad if all_scored else bad[keep.reshape(-1)]
    if layers:
        out[_layers.LAYER_ARRAY], bad = _layers.capture_layer_states(adapter, ids, layers, sel, hidden_dtype, where)
        if bad is not None:
            nonfinite += bad
    out[NONFINITE] = nonfinite
    if heads:
        out.update(_heads.capture_head_arrays(head_rec, sel, tx.copy))
    if info.has_gate:
        if st.gate_logits is None:
            raise InputError(f"adapter '{info.name}' declares a gate but returned no gate logits")
        out["gate_logit"] = tx.copy(sel(st.gate_logits.float()))
    if contraction is not None:
        out.update(_contraction.capture_arrays(adapter, st, contraction, rows.start or 0, sel))
    target = torch.from_numpy(data.targets[rows][keep].astype(np.int64)).to(dev)
    # Loop T first (kl_final needs p_T), then 1..T keeping only the previous loop (bounded memory).
    z_final = sel(adapter.readout(st.hidden[:, :, T - 1], T - 1)).float()  # [n, V]
    groups = stat_row_groups(z_final.shape[0], z_final.shape[-1], z_final.device)
    accs = [LoopStats(z_final[g], target[g]) for g in groups]
    per_loop: dict[str, list[torch.Tensor]] = {s: [] for s in STAT_NAMES}
    zs, ids_k = [], []
    for t in range(T):
        z = z_final if t == T - 1 else sel(adapter.readout(st.hidden[:, :, t], t)).float()
        parts = [acc.update(z[g]) for acc, g in zip(accs, groups, strict=True)]  # name -> [rows of g]
        for name in parts[0]:
            per_loop[name].append(parts[0][name] if len(parts) == 1 else torch.cat([q[name] for q in parts]))
        if k is None:
            zs.append(z)
        else:
            top = z.topk(k, dim=-1)
            zs.append(top.values)
            ids_k.append(top.indices.to(torch.int32))
    for name, vs in per_loop.items():
        out[name] = tx.copy(torch.stack(vs, dim=1))
    if k is None:
        out["logits"] = tx.copy(torch.stack(zs, dim=1))
    else:
        out["topk_logits"] = tx.copy(torch.stack(zs, dim=1))
        out["topk_ids"] = tx.copy(torch.stack(ids_k, dim=1))
    b_idx, p_idx = np.nonzero(keep)  # row-major: (sequence, position) order, matching hidden[m]
    out["target"] = data.targets[rows][keep].astype(np.int64)
    out["token_id"] = data.tokens[rows][keep].astype(np.int64)
    out["sequence"] = (b_idx + (rows.start or 0)).astype(np.int64)
    out["position"] = p_idx.astype(np.int64)
    out["difficulty"] = data.difficulty[rows][keep].astype(np.int64)
    out["token_type"] = data.token_type[rows][keep].astype(np.int64)
    return out

def dump_split(adapter: LoopedModelAdapter, data: TaskBatch, path: StoreTarget, cfg: DumpConfig,
               attrs: Mapping[str, Any] | None = None, progress: bool = True,
               finalize: Callable[[StoreWriter], Mapping[str, Any] | None] | None = None,
               shard: tuple[int, int] = (0, 1)) -> TrajectoryStore:
    """Dump one split of one model to a trajectory store (resumable; one of N cooperating writers).

    Args:
        adapter: the model interface (states + per-loop readout).
        data: the sequences; ``tokens``/``targets``/``difficulty``/``token_type`` all [batch, seq];
            ``targets == IGNORE`` marks unscored positions. ``sequence`` in the store = row index here.
        path: ``<split>.zarr`` directory, fsspec URL (``s3://…``) or :func:`looptrace.io.store.location.memory_store`.
        cfg: the ``dump`` section.
        attrs: extra group attributes (split, task, regime, difficulty_name, difficulty_levels, token_types,
            seeds...); ``task``/``regime`` default to the adapter's ``info.extra``.
        progress: show a tqdm bar (silent when not a terminal anyway).
        finalize: called with the writer after every chunk is written and before the store is marked
            complete; may :meth:`~looptrace.io.store.writer.StoreWriter.rewrite` token columns and returns extra
            attributes (or None). Runs again on resume, so it must be idempotent.
        shard: ``(i, N)``: write shard ``i`` of ``N`` (a contiguous range of whole chunks) of the store that
            N processes dump together; every process must be given the same other arguments.

    Returns:
        The completed store, opened (``allow_nan`` as configured). With ``N > 1`` a process whose shard is
        done while others still write returns the store opened with ``allow_incomplete`` (``complete`` false).

    Raises:
        StoreError: the dump produced NaN/Inf states and ``cfg.allow_nan`` is false (the store is written
            and records ``nan_count``), the target path is not a store, or the disk is full.
        looptrace.io.claims.ClaimError: another live process writes this store with other inputs, another
            shard plan, or this very shard (one line naming it: pid, host, start time).
    """
    info = adapter.info
    reuse_freed_memory()
    if data.tokens.ndim != 2 or data.targets.shape != data.tokens.shape:
        raise ValueError(f"data: tokens and targets must both be [batch, seq]; got {data.tokens.shape} and "
                         f"{data.targets.shape}")
    mask = np.asarray(data.targets != IGNORE)
    counts = mask.sum(axis=1)
    cum = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)  # scored tokens before each sequence
    n_tokens = int(cum[-1])
    specs, k = _layout(adapter, n_tokens, cfg)
    extra = dict(info.extra)
    user = dict(attrs or {})
    base_attrs: dict[str, Any] = {
        "model": dataclasses.asdict(info), "n_tokens": n_tokens, "n_loops": info.n_loops,
        "d_model": info.d_model, "vocab_size": info.vocab_size, "n_sequences": len(data),
        "task": extra.get("task"), "regime": extra.get("regime"), "split": None,
        "difficulty_name": "difficulty", "difficulty_levels": [], "token_types": [],
        "seeds": {kk: extra[kk] for kk in ("seed", "data_seeds") if kk in extra},
        "params": _params_attr(cfg), "topk": k, "logits_mode": "full" if k is None else "topk",
        "dtypes": {name: spec.dtype for name, spec in specs.items()},
        "versions": versions(),
    }
    base_attrs.update(user)
    bases = [c.__module__ for c in type(adapter).__mro__ if c.__module__.startswith("looptrace.")]  # an adapter's base
    code = code_hash(type(adapter).__module__, *bases, *([finalize.__module__] if finalize is not None else []))
    base_attrs["code_hash"] = code
    fp = fingerprint(adapter, data, to_dict(cfg), {**user, "versions": base_attrs["versions"]}, code)
    base_attrs["fingerprint"] = fp
    loc = store_location(path)
    label = "<memory>" if loc is None else loc
    assert_store_or_absent(path)  # never claim (or touch) a directory of someone else's files
    n_chunks = -(-n_tokens // cfg.chunk_tokens)
    own = shard_range(n_chunks, *shard)
    coord = (NullCoordinator(fp, shard, label) if loc is None
             else Coordinator(loc, fp, shard, cfg.claim_lease_s, label=f"store {label}"))

    def create_layout() -> StoreWriter:
        new = StoreWriter.create(path, specs, base_attrs, cfg.chunk_tokens, cfg.clevel)
        new.write_small("loop_group", np.asarray(info.loop_group))
        return new

    left_incomplete: int | None = None  # the plan under which this process returned with peers still writing
    try:
        joined = join_or_plan(coord, path, label, fp, own, create_layout)
        if joined is None:  # complete, verified, nothing to do
            return _finished(path, label, cfg)
        plan_k, kind, claim, damage = joined
        writer = StoreWriter.reopen(path)
        if writer is None or writer.attrs.get("fingerprint") != fp:
            raise StoreError(f"store {label}: its layout vanished while joining the dump; re-run `looptrace dump`")
        writer.own = own
        if claim is not None:
            _write_range(adapter, data, cfg, writer, own, kind, damage, cum, mask, k_top=k,
                         hidden_dtype=specs["hidden"].dtype, label=label, progress=progress, coord=coord)
        # verify: completion is read from the data (every marker and chunk object present), not from the claims
        missing = writer.missing_chunks(range(writer.n_chunks))
        if claim is not None:
            if set(missing) & set(own):
                raise StoreError(f"store {label}: chunk {sorted(set(missing) & set(own))[0]} of this process's range "
                                 "failed verification after writing; re-run `looptrace dump`")
            coord.finish(claim, chunks=[own.start, own.stop])
        if missing:
            left_incomplete = plan_k
            return open_store(path, allow_nan=True, allow_incomplete=True)
        fin = coord.claim_final(plan_k)
        if fin is None:  # another process finalises (or has)
            st = open_store(path, allow_nan=True, allow_incomplete=True)
            if not st.complete:
                left_incomplete = plan_k
                return st
            # our last claim write (`finish`: temp file + os.replace) can land after the finaliser tidied the
            # claims, re-creating our record beside a complete store: tidy what is left of this plan
            coord.remove_plans_upto(plan_k)
            return _finished(path, label, cfg)
        if coord.n > 1:  # other processes wrote chunks: read the store back (one process: ours is current)
            writer = StoreWriter.reopen(path)
        assert writer is not None  # every shard is done: the store exists
        if not writer.attrs.get("complete") or not writer.metadata_ok():
            remove_debris(path)  # every shard is done: no live writer can own a temp file now
            # a kill inside create_layout (after the arrays, before this one's only chunk) leaves it unwritten, and
            # only token chunks are markers: the finaliser (one process) writes it again, identical bytes
            writer.write_small("loop_group", np.asarray(info.loop_group))
            # columns known only once every chunk is written (a text dump's loss-bin difficulty), before `complete`
            writer.finish(finalize(writer) if finalize is not None else None)
        coord.finish(fin)
        coord.remove_plans_upto(plan_k)
        return _finished(path, label, cfg)
    finally:
        coord.release_all()
        if left_incomplete is not None:
            # releasing our records (the planner's plan record included) is a write (temp file + replace) that
            # can land after a peer's finaliser tidied the claims, re-creating a record beside the complete
            # store (seen in CI as a left-over claims directory). The finaliser marks the store complete before
            # it lists the claims, so a store found complete after our last write means it is ours to tidy.
            again = StoreWriter.reopen(path)
            if again is not None and again.attrs.get("complete") and again.attrs.get("fingerprint") == fp:
                coord.remove_plans_upto(left_incomplete)

def _write_range(adapter, data: TaskBatch, cfg: DumpConfig, writer: StoreWriter, own: range, kind: str,
                 damage: dict, cum: np.ndarray, mask: np.ndarray, k_top: int | None, hidden_dtype: str,
                 label: str, progress: bool, coord: Coordinator) -> None:
    """Compute and write every chunk of ``own`` that is not written yet (the batches covering them only)."""
    if kind == "repair":
        damage = damage or writer.damaged_chunks(own)
        if damage:
            writer.reset_chunks(damage)
    done = writer.done_chunks()
    outside = np.ones(writer.n_chunks, dtype=bool)
    outside[own.start:own.stop] = False
    done |= outside  # another shard's chunks: never written here
    n_tokens, ct = writer.n_tokens, cfg.chunk_tokens
    todo = np.flatnonzero(~done)
    if todo.size:
        if kind == "resume" and done[own.start:own.stop].any():
            _say(f"{label}: resuming ({int(done[own.start:own.stop].sum())} of {len(own)} chunks"
                 f"{'' if coord.n == 1 else f' of shard {coord.i}/{coord.n}'} already written)")
        first, last = int(todo[0]), int(todo[-1])
        # the sequence holding the chunk's first token, then the batch holding that sequence: batches keep
        # the boundaries of an uninterrupted 1-process run, so the numbers are bit-identical
        s0 = int(np.searchsorted(cum, first * ct, side="right") - 1)
        b0 = s0 // cfg.batch_size
        end_token = min((last + 1) * ct, n_tokens)
        s1 = int(np.searchsorted(cum, end_token - 1, side="right") - 1)  # sequence holding the last token
        b1 = s1 // cfg.batch_size
        threads = writer_threads(torch.device(adapter.device))
        queued = max(cfg.writer_queue, threads)
        buffers = ChunkBuffers(keep=queued + threads + 1)
        pool = encode_pool(torch.device(adapter.device))
        bg = BackgroundWriter(lambda: writer, queued, before_write=coord.beat, threads=threads, written=buffers.give,
                               encode_pool=pool)
        asm = ChunkAssembler(n_tokens, ct, done, int(cum[b0 * cfg.batch_size]), bg.put, buffers)
        total = int(cum[min((b1 + 1) * cfg.batch_size, len(data))] - cum[b0 * cfg.batch_size])
        bar = tqdm(total=total, unit="tok", desc=f"dump {label}", disable=None if progress else True, leave=False)
        # on a device, batch b's host copies are resolved after batch b + 1 is captured (capture/transfer.py)
        tx = transfer_for(adapter.device)
        pending: list[dict] = []
        try:
            for b in range(b0, b1 + 1):
                rows = slice(b * cfg.batch_size, min((b + 1) * cfg.batch_size, len(data)))
                lo, hi = int(cum[rows.start]), int(cum[rows.stop])
                if hi == lo:
                    continue
                chunks = range(lo // ct, (hi - 1) // ct + 1)
                if all(done[c] for c in chunks):  # nothing left to write in this batch
                    while pending:
                        asm.add(resolve(pending.pop(0)))
                    asm.pos = hi
                else:
                    pending.append(_capture(adapter, data, mask, rows, k_top, hidden_dtype, cfg.contraction,
                                            cfg.layers, tx, cfg.heads))
                    while len(pending) > int(tx.asynchronous):
                        asm.add(resolve(pending.pop(0)))
                bar.update(hi - lo)
            while pending:
                asm.add(resolve(pending.pop(0)))
            tx.settle()
        except BaseException:
            # let the writer finish the chunks already queued (their markers keep them), then stop
            bg.stop()
            raise
        finally:
            bar.close()
        bg.close()

def _finished(path: StoreTarget, label: str, cfg: DumpConfig) -> TrajectoryStore:
    st = open_store(path, allow_nan=True)
    nan = int(st.attrs.get("nan_count") or 0)
    if nan and not cfg.allow_nan:
        raise StoreError(f"store {label}: {nan} NaN/Inf values in 'hidden'/'hidden_init' "
                         f"(dtype {cfg.hidden_dtype}) produced by the model itself (float16 overflow is refused "
                         "before writing); set dump.allow_nan: true to keep them")
    return st


def output_root(out_dir: Path | str) -> Path | str:
    """A model's output root: a local directory (created) or a URL prefix (object stores have no directories)."""
    loc = store_location(out_dir)
    assert loc is not None  # a path or URL, not a memory store
    if is_remote(out_dir):
        return loc
    out = Path(loc)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # a file in the way, no permission, a full disk
        raise StoreError(f"cannot create the output directory {out} ({exc.strerror or type(exc).__name__}); "
                         "choose another --out") from None
    return out

def dump_model(adapter: LoopedModelAdapter, task: Task, data_seeds: Mapping[str, int], out_dir: Path | str,
               cfg: DumpConfig, base: BaseConfig | None = None, progress: bool = True,
               shard: tuple[int, int] = (0, 1)) -> dict[str, TrajectoryStore]:
    """Dump every split of ``cfg.sequences`` for one model: ``<out_dir>/<split>.zarr``.

    Args:
        adapter: the model interface.
        task: the model's task (its data sets, difficulty and token-type names).
        data_seeds: split -> data seed (the checkpoint's ``data_seeds``).
        out_dir: ``artifacts/dump/<model>`` (or a URL such as ``s3://bucket/dump/<model>``).
        cfg: the ``dump`` section.
        base: the ``base`` section (its seed is recorded).
        shard: ``(i, N)``: this process's shard of every split (:func:`dump_split`).

    Returns:
        split -> store (complete, unless other shards are still being written).
    """
    out_dir = output_root(out_dir)
    data = {}
    for split, n in cfg.sequences.items():
        if split not in data_seeds:
            raise InputError(f"checkpoint records no data seed for split '{split}'; retrain with the current "
                             "train stage or remove the split from dump.sequences")
        data[split] = task.dataset(split, int(n), int(data_seeds[split]))
    check_training_split(adapter.info.extra.get("task"), cfg.allow_prefix_overlap, adapter.info.name)
    overlap = split_overlap(task, data)  # before writing anything: a refused test store costs no forward pass
    check_prefix_overlap(overlap, cfg.allow_prefix_overlap, adapter.info.name)
    _say(f"{adapter.info.name}: {overlap_line(overlap)}")
    stores = {}
    for split, batch in data.items():
        seed = int(data_seeds[split])
        attrs = {"split": split, "difficulty_name": task.difficulty_name,
                 "difficulty_levels": list(task.difficulty_levels), "token_types": list(task.token_types),
                 "data_seed": seed, "base_seed": None if base is None else base.seed,
                 "prefix_overlap": overlap_attrs(overlap, split, cfg.allow_prefix_overlap)}
        stores[split] = dump_split(adapter, batch, join_store(out_dir, f"{split}.zarr"), cfg, attrs, progress,
                                   shard=shard)
    return stores


__all__ = ["DIMS", "DumpConfig", "bare_forward", "dump_model", "dump_split", "state_dtype"]
