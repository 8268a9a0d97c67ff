"""Trajectory geometry (SPEC §2): per-token, per-loop step metrics, convergence depth and the
drift-to-loop ratio, streamed from the trajectory store block by block (the ``geometry`` stage).

All metric code is written as *block functions*: numpy in, numpy out, on a block of tokens
(``hidden`` [token, loop, d_model] and ``hidden_init`` [token, d_model]). A token's metrics depend
only on that token's row, so the stage can feed blocks aligned to the store's chunks (here, in a
loop; later, under a parallel engine over Zarr chunks) and the result does not depend on the block
size. Nothing here ever holds the whole ``hidden`` array of a store in memory.

Numerics: the store keeps states in float16 by default. Every block is upcast, and each loop's
[token, d_model] slice is processed in float64 (differences, norms and dot products), then the
per-(token, loop) metrics are returned as float32. Values that need a loop that does not exist
(t − 1 or t − 2) are NaN, never 0 (SPEC §2–3), and so are ratios whose denominator is 0.

Conventions chosen here (SPEC leaves them open; docs/geometry.md repeats them):
- The step at loop 1 is Δ_1 = h_1 − h_0 (h_0 = ``hidden_init``), so step_norm, rel_step and
  state_cos_dist are defined at t = 1; step_cos and accel need Δ_{t−1} (t ≥ 2); step_d2 needs
  s_{t−2} (t ≥ 3).
- "Below ε" is strict (value < ε); NaN is never below. Convergence on ``argmax`` uses the 0/1
  signal "argmax_t differs from argmax_T", so any ε in (0, 1] gives the same depth.
- DLR: the steps "within g" are Δ_t with loops t − 1 and t both in g; the step that enters g (from
  h_0 or from the previous group) is the hand-off drift, not a loop step of g.
"""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import polars as pl
import pyarrow as pa
from tqdm.auto import tqdm

from looptrace.config import ConfigError, InputError, to_dict
from looptrace.geometry import inside
from looptrace.geometry.blocks import (
    OPT_IN_COLUMNS,
    STORE_STATS,
    argmax_differs,
    convergence_depth,
    drift_to_loop_ratio,
    group_handoffs,
    read_block,
    release_large_buffers,
)
from looptrace.intervals import IntervalsConfig
from looptrace.io.artifacts import atomic_dir, jsonable
from looptrace.io.bounds import check_block_tokens
from looptrace.io.parallel import DaskRunner, map_chunks
from looptrace.io.parquet import parquet_writer, write_parquet
from looptrace.io.tables import SplitArrays
from looptrace.signals import names as signal_names
from looptrace.signals.names import add_aliases
from looptrace.signals.steps import GEOMETRY_METRICS

SPLITS = ("fit", "val", "test")

#: Signals a convergence depth can be computed on (``geometry.eps`` keys).
CONVERGENCE_SIGNALS = signal_names.CONVERGENCE_SIGNALS
#: ``token_loop.parquet`` columns, exactly as docs/DESIGN.md lists them.
TOKEN_LOOP_COLUMNS = ("split", "token", "sequence", "position", "loop", "loop_group", "difficulty",
                      "token_type", "target", *signal_names.TOKEN_LOOP_SIGNALS)
#: Per-loop quantities summarised in ``loop_summary.parquet`` (``correct`` as accuracy).
SUMMARY_METRICS = (*GEOMETRY_METRICS, *STORE_STATS, "correct")

_INT_COLUMNS = ("token", "sequence", "position", "loop", "loop_group", "difficulty", "token_type", "target",
                *signal_names.TOKEN_LOOP_INTS)
_TOKEN_LOOP_SCHEMA = pa.schema(
    [("split", pa.string())]
    + [(c, pa.int64()) for c in _INT_COLUMNS]
    + [(c, pa.bool_()) for c in signal_names.TOKEN_LOOP_BOOLS]
    + [(c, pa.float32()) for c in signal_names.TOKEN_LOOP_FLOATS]
)


def token_loop_schema(opt_in: Sequence[str] = ()) -> pa.Schema:
    """``token_loop.parquet``'s schema: the default one plus the float32 ``opt_in`` columns (registry order)."""
    return pa.schema([*_TOKEN_LOOP_SCHEMA, *((c, pa.float32()) for c in OPT_IN_COLUMNS if c in opt_in)])


#: ``loop_summary.parquet`` (long format).
SUMMARY_SCHEMA = {"split": pl.String, "loop": pl.Int64, "group_by": pl.String, "group_value": pl.String,
                  "metric": pl.String, "mean": pl.Float64, "median": pl.Float64, "q25": pl.Float64,
                  "q75": pl.Float64, "count": pl.Int64, "n_nan": pl.Int64, "n_inf": pl.Int64}
#: ``dlr.parquet``: one row per split × hand-off g -> g + 1 (loops 1-based).
DLR_SCHEMA = {"split": pl.String, "group": pl.Int64, "next_group": pl.Int64, "last_loop": pl.Int64,
              "first_loop_next": pl.Int64, "n_tokens": pl.Int64, "drift_mean": pl.Float64,
              "loop_step_mean": pl.Float64, "dlr_mean": pl.Float64, "dlr_median": pl.Float64,
              "dlr_of_means": pl.Float64}
_CONVERGENCE_SCHEMA = pa.schema([
    ("split", pa.string()), ("token", pa.int64()), ("difficulty", pa.int64()), ("token_type", pa.int64()),
    ("signal", pa.string()), ("eps", pa.float64()), ("kind", pa.string()), ("depth", pa.int64()),
    ("censored", pa.bool_()),
])


@dataclass(frozen=True)
class GeometryConfig:
    """``geometry`` section of ``params.yaml``.

    Attributes:
        eps: convergence thresholds per signal (keys from :data:`CONVERGENCE_SIGNALS`); every
            (signal, ε) gives a ``first`` and a ``settled`` depth per token (SPEC §2).
        block_tokens: tokens per block read from the store; ``None`` = the store's chunk size
            (chunk-aligned reads, the memory bound of the stage).
        splits: splits of the model's dump to analyse.
    """

    eps: dict[str, tuple[float, ...]] = field(default_factory=lambda: {
        "kl_prev": (1e-3, 5e-4), "rel_step": (0.3, 0.1, 0.03), "argmax": (0.5,)})
    block_tokens: int | None = None
    splits: tuple[str, ...] = SPLITS

    def __post_init__(self) -> None:
        for sig, values in self.eps.items():
            if sig not in CONVERGENCE_SIGNALS:
                raise ConfigError(f"geometry.eps: unknown signal '{sig}'; allowed: {', '.join(CONVERGENCE_SIGNALS)}")
            if not values or any(not (isinstance(e, int | float) and e > 0) for e in values):
                raise ConfigError(f"geometry.eps.{sig}: give a non-empty list of thresholds > 0, got {values!r}")
        if self.block_tokens is not None and self.block_tokens < 1:
            raise ConfigError(f"geometry.block_tokens must be >= 1 or null, got {self.block_tokens}")
        bad = [s for s in self.splits if s not in SPLITS]
        if bad or not self.splits:
            raise ConfigError(f"geometry.splits: each must be one of {', '.join(SPLITS)}, got {list(self.splits)}")

    def convergence_keys(self) -> list[tuple[str, float]]:
        """(signal, ε) pairs in a fixed order (config order of signals, then of thresholds)."""
        return [(s, float(e)) for s, values in self.eps.items() for e in values]
def _signal(block: SplitArrays, name: str) -> np.ndarray:
    return argmax_differs(block.loop["argmax"]) if name == "argmax" else block.loop[name]


def token_loop_table(block: SplitArrays, split: str, loop_group: np.ndarray) -> pa.Table:
    """The ``token_loop.parquet`` rows of one block: one row per (token, loop), token-major.

    Args:
        block: a block from :func:`iter_blocks`.
        split: split name written in the ``split`` column.
        loop_group: [loop] group of each loop.

    Returns:
        Arrow table with :data:`TOKEN_LOOP_COLUMNS` (loop 1-based; ``gate_logit`` null without a gate), then the
        opt-in columns the block holds (:func:`token_loop_schema`).
    """
    n, n_loops = block.loop["argmax"].shape
    rep = lambda a: np.repeat(a, n_loops)  # noqa: E731 - [token] -> [token * loop]
    flat = lambda a: a.reshape(-1)  # noqa: E731 - [token, loop] -> [token * loop], token-major
    cols: dict[str, Any] = {
        "split": pa.array([split] * (n * n_loops), pa.string()),
        "token": rep(block.token), "sequence": rep(block.fields["sequence"]),
        "position": rep(block.fields["position"]),
        "loop": np.tile(np.arange(1, n_loops + 1, dtype=np.int64), n),
        "loop_group": np.tile(np.asarray(loop_group, dtype=np.int64), n),
        "difficulty": rep(block.fields["difficulty"]), "token_type": rep(block.fields["token_type"]),
        "target": rep(block.fields["target"]), "argmax": flat(block.loop["argmax"]),
        "correct": flat(block.loop["correct"]),
    }
    for m in GEOMETRY_METRICS:
        cols[m] = flat(block.loop[m])
    add_aliases(cols)  # SPEC §4 `hidden_change` = ‖h_t − h_{t−1}‖ = step norm
    for s in STORE_STATS:
        cols[s] = flat(block.loop[s])
    gate = block.loop.get("gate_logit")
    cols["gate_logit"] = (pa.array(flat(gate), pa.float32()) if gate is not None
                          else pa.nulls(n * n_loops, pa.float32()))
    opt_in = [c for c in OPT_IN_COLUMNS if c in block.loop]
    for c in opt_in:
        cols[c] = flat(block.loop[c])
    schema = token_loop_schema(opt_in)
    return pa.table([pa.array(cols[c], schema.field(c).type) for c in schema.names], schema=schema)


def block_convergence(block: SplitArrays, keys: list[tuple[str, float]]) -> dict[tuple[str, float], dict]:
    """Convergence depths of one block for every (signal, ε): see :func:`convergence_depth`."""
    return {(sig, eps): convergence_depth(_signal(block, sig), eps) for sig, eps in keys}


def convergence_table(block: SplitArrays, split: str, conv: dict[tuple[str, float], dict]) -> pa.Table:
    """The ``convergence.parquet`` rows of one block: token × (signal, ε) × kind (first, settled).

    Rows are token-major (all (signal, ε, kind) of a token together), so concatenating the blocks gives
    the same table whatever the block size.
    """
    if not conv:
        return _CONVERGENCE_SCHEMA.empty_table()
    combos = [(sig, eps, kind) for (sig, eps) in conv for kind in ("first", "settled")]
    k = len(combos)
    depth = np.stack([conv[(sig, eps)][kind] for sig, eps, kind in combos], axis=1)  # [token, combo]
    cens = np.stack([conv[(sig, eps)][f"{kind}_censored"] for sig, eps, kind in combos], axis=1)
    rep = lambda a: np.repeat(a, k)  # noqa: E731 - [token] -> [token * combo]
    tile = lambda vals: np.tile(np.asarray(vals, dtype=object), block.n)  # noqa: E731
    return pa.table({
        "split": pa.array([split] * (block.n * k), pa.string()), "token": rep(block.token),
        "difficulty": rep(block.fields["difficulty"]), "token_type": rep(block.fields["token_type"]),
        "signal": pa.array(tile([c[0] for c in combos]), pa.string()),
        "eps": np.tile(np.array([c[1] for c in combos], dtype=np.float64), block.n),
        "kind": pa.array(tile([c[2] for c in combos]), pa.string()),
        "depth": depth.reshape(-1), "censored": cens.reshape(-1),
    }, schema=_CONVERGENCE_SCHEMA)


class LoopColumns:
    """Loop-major scratch columns of one split, for exact per-loop quantiles in bounded memory.

    Each block appends, for every loop t, its tokens' difficulty, token_type and metric values to one
    raw binary file per (loop, column) under ``root``; a summary later reads one column of one loop
    at a time ([token] values), never the [token, loop, ...] table.

    Args:
        root: scratch directory (created).
        n_loops: T.
        metrics: per-loop columns to keep (float32).
    """

    def __init__(self, root: Path, n_loops: int, metrics: tuple[str, ...]):
        self.root, self.n_loops, self.metrics = Path(root), n_loops, metrics
        self.root.mkdir(parents=True, exist_ok=True)
        self._files: dict[tuple[int, str], BinaryIO] = {}

    def _path(self, t: int, col: str) -> Path:
        return self.root / f"loop{t + 1}.{col}.bin"

    def append(self, block: SplitArrays) -> None:
        """Append a block's values (difficulty/token_type int64, metrics float32) for every loop."""
        for t in range(self.n_loops):
            cols = {"difficulty": block.fields["difficulty"], "token_type": block.fields["token_type"]}
            cols.update({m: block.loop[m][:, t].astype(np.float32) for m in self.metrics})
            for col, values in cols.items():
                key = (t, col)
                if key not in self._files:
                    self._files[key] = open(self._path(t, col), "ab")  # noqa: SIM115 - closed in close()
                np.ascontiguousarray(values).tofile(self._files[key])

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()

    def read(self, t: int, col: str) -> np.ndarray:
        """[token] values of column ``col`` at loop t (0-based)."""
        dtype = np.int64 if col in ("difficulty", "token_type") else np.float32
        path = self._path(t, col)
        return np.fromfile(path, dtype=dtype) if path.exists() else np.zeros(0, dtype)


def summary_stats(x: np.ndarray) -> tuple[float, float, float, float, int, int, int]:
    """mean, median, q25, q75 (numpy's linear interpolation) and count of the finite values of ``x``, and how many
    values were left out: NaN and ±inf.

    NaN (undefined: t too small, or a zero step) and ±inf are excluded, never averaged as numbers — and counted,
    so a summary never changes silently (``n_nan``, ``n_inf`` columns; the report shows any ±inf); no finite
    value gives NaN statistics and count 0.
    """
    x = np.asarray(x, dtype=np.float64)
    n_nan, n_inf = int(np.count_nonzero(np.isnan(x))), int(np.count_nonzero(np.isinf(x)))
    x = x[np.isfinite(x)]
    if not x.size:
        return math.nan, math.nan, math.nan, math.nan, 0, n_nan, n_inf
    q25, med, q75 = np.quantile(x, [0.25, 0.5, 0.75])
    return float(x.mean()), float(med), float(q25), float(q75), int(x.size), n_nan, n_inf


def summarise_loop(cols: LoopColumns, t: int, split: str, token_types: list[str]) -> list[dict]:
    """Long-format summary rows of one (split, loop t) (t 0-based) from the scratch columns.

    Args:
        cols: the split's :class:`LoopColumns`.
        t: 0-based loop.
        split: split name.
        token_types: names indexed by token_type id (ids without a name keep their number).

    Returns:
        Rows (split, loop, group_by, group_value, metric, mean, median, q25, q75, count, n_nan, n_inf) for
        group_by ∈ {all, difficulty, token_type}, groups in increasing id order.
    """
    groups: list[tuple[str, list[str], list[slice | np.ndarray]]] = [("all", ["all"], [slice(None)])]
    for key in ("difficulty", "token_type"):
        ids = cols.read(t, key)
        order = np.argsort(ids, kind="stable")
        uniq, starts = np.unique(ids[order], return_index=True)
        bounds = [*starts.tolist(), ids.size]
        names = [token_types[int(u)] if key == "token_type" and 0 <= u < len(token_types) else str(int(u))
                 for u in uniq]
        groups.append((key, names, [order[bounds[i]:bounds[i + 1]] for i in range(uniq.size)]))
    rows = []
    for metric in cols.metrics:
        x = cols.read(t, metric)
        for group_by, names, members in groups:
            for name, idx in zip(names, members, strict=True):
                mean, med, q25, q75, count, n_nan, n_inf = summary_stats(x[idx])
                rows.append({"split": split, "loop": t + 1, "group_by": group_by, "group_value": name,
                             "metric": metric, "mean": mean, "median": med, "q25": q25, "q75": q75,
                             "count": count, "n_nan": n_nan, "n_inf": n_inf})
    return rows


def _median_int(x: np.ndarray) -> float:
    return float(np.median(x)) if x.size else math.nan


def geometry_model(stores: dict[str, Any], cfg: GeometryConfig, out_dir: Path | str,
                   meta: dict | None = None, extra_tables: dict[str, pl.DataFrame] | None = None,
                   progress: bool = True, runner: DaskRunner | None = None,
                   intervals: IntervalsConfig | None = None) -> dict:
    """Run the geometry of one model's dump: stream each split's store and write the artifacts.

    Writes, atomically (a temporary directory next to ``out_dir`` that replaces it at the end):
    ``token_loop.parquet``, ``loop_summary.parquet``, ``convergence.parquet``, ``dlr.parquet`` (rows
    only when the model has several looped groups) and ``metrics.json``; ``layers.parquet`` / ``heads.parquet``
    (SPEC §2c, :mod:`looptrace.geometry.inside`) only when every split's store holds ``layer_hidden`` / the head
    arrays (opt-in ``dump.layers`` / ``dump.heads``). Memory is bounded by one block of ``hidden`` plus per-(split,
    loop) scalar columns for the summary quantiles (and the per-token scalars of the opt-in tables).

    Args:
        stores: split -> open :class:`looptrace.io.store.reader.TrajectoryStore` (one model; same T and groups).
        cfg: the ``geometry`` section.
        out_dir: ``artifacts/geometry/<model>``.
        meta: extra entries for ``metrics.json`` (model name, seeds, versions, params).
        extra_tables: file name -> frame written into the same directory in the same atomic swap
            (``training_dynamics.parquet``).
        progress: show progress bars (silent anyway when not a terminal).
        runner: run the per-chunk work (:func:`geometry_chunk`) as Dask tasks (:mod:`looptrace.io.parallel`);
            None = in this process. The outputs are the same bytes either way.
        intervals: the bootstrap of the opt-in tables' intervals (seeded by ``meta``'s ``seed`` and ``model``);
            None = no intervals.

    Returns:
        The metrics dict written to ``metrics.json``.
    """
    with atomic_dir(out_dir) as tmp:
        metrics = _geometry_into(stores, cfg, tmp, dict(meta or {}), progress, runner)
        m = dict(meta or {})
        tables = inside.inside_tables(stores, cfg.eps.get("rel_step", ()), intervals, str(m.get("model", "")),
                                      int(m.get("seed") or 0), cfg.block_tokens)
        for name, df in {**tables, **(extra_tables or {})}.items():
            write_parquet(df, tmp / name)
    return metrics


def geometry_chunk(store, tokens: slice, split: str, loop_group: np.ndarray, keys: list[tuple[str, float]]
                   ) -> tuple[SplitArrays, pa.Table, dict, pa.Table, dict]:
    """The per-chunk work of the geometry stage, in this process or as one Dask task per chunk.

    Returns:
        (the block of :func:`read_block`, its ``token_loop`` rows, its convergence depths
        (:func:`block_convergence`), its ``convergence`` rows, its DLR parts (:func:`drift_to_loop_ratio`)).
        The stage writes and accumulates these in chunk order, so the outputs do not depend on where a chunk ran.
    """
    block = read_block(store, tokens)
    conv = block_convergence(block, keys)
    return (block, token_loop_table(block, split, loop_group), conv, convergence_table(block, split, conv),
            drift_to_loop_ratio(block.loop["step_norm"], loop_group))


def _geometry_into(stores: dict[str, Any], cfg: GeometryConfig, tmp: Path, meta: dict, progress: bool,
                   runner: DaskRunner | None = None) -> dict:
    release_large_buffers()
    first = next(iter(stores.values()))
    n_loops = first.n_loops
    loop_group = np.asarray(first.loop_group, dtype=np.int64)
    for split, st in stores.items():
        if st.n_loops != n_loops or not np.array_equal(np.asarray(st.loop_group), loop_group):
            raise InputError(f"store of split '{split}' has a different loop structure (n_loops {st.n_loops}, "
                             f"loop_group {[int(g) for g in st.loop_group]}) from the other splits; "
                             "re-run the dump")
    handoffs = group_handoffs(loop_group)
    has_gate = first.has_gate
    sum_metrics = SUMMARY_METRICS + (("gate_logit",) if has_gate else ())
    keys = cfg.convergence_keys()
    scratch = tmp / "_scratch"
    # the opt-in columns (SPEC §2b) only when every split's store has them: the default table is unchanged
    opt_in = [c for c in OPT_IN_COLUMNS if all(c in st for st in stores.values())]
    tl_writer = parquet_writer(tmp / "token_loop.parquet", token_loop_schema(opt_in))  # page checksums
    cv_writer = parquet_writer(tmp / "convergence.parquet", _CONVERGENCE_SCHEMA)
    summaries, dlr_rows, split_metrics = [], [], {}
    try:
        for split, st in stores.items():
            loop_cols = LoopColumns(scratch / split, n_loops, sum_metrics)
            depths: dict = {}  # (signal, eps, kind) -> [token] int16 blocks; "difficulty" -> [token]
            dlr_parts: dict[int, dict[str, list]] = {g: {"drift": [], "loop_step": [], "dlr": []}
                                                     for g, _, _ in handoffs}
            bar = tqdm(total=st.n_tokens, desc=f"geometry {split}", unit="tok", disable=None if progress else True,
                       leave=False)
            check_block_tokens(cfg.block_tokens, st.chunk_tokens, "geometry.block_tokens", st.label)
            # ahead=1: the next block is read, decoded and measured on a second thread while this one is written
            # (the stage is bound by decompression and float64 step metrics, both outside the GIL)
            chunks = map_chunks(geometry_chunk, st, st.blocks(cfg.block_tokens), (split, loop_group, keys), runner,
                                ahead=1)
            for block, tl_table, conv, cv_table, dlr in chunks:
                tl_writer.write_table(tl_table.select(tl_writer.schema.names))
                cv_writer.write_table(cv_table)
                depths.setdefault("difficulty", []).append(block.fields["difficulty"])
                for (sig, eps), res in conv.items():
                    for kind in ("first", "settled"):
                        depths.setdefault((sig, eps, kind), []).append(res[kind].astype(np.int16))
                for g, parts in dlr.items():
                    for k, v in parts.items():
                        dlr_parts[g][k].append(v.astype(np.float32))
                loop_cols.append(block)
                bar.update(block.n)
            bar.close()
            loop_cols.close()
            token_types = list(st.attrs.get("token_types") or [])
            for t in range(n_loops):
                summaries.extend(summarise_loop(loop_cols, t, split, token_types))
            shutil.rmtree(scratch / split)
            split_metrics[split] = _convergence_metrics(depths, keys, n_loops, st.n_tokens)
            for g, _last, first_next in handoffs:
                parts = {k: np.concatenate(v) if v else np.zeros(0, np.float32) for k, v in dlr_parts[g].items()}
                finite = parts["dlr"][np.isfinite(parts["dlr"])]
                dlr_rows.append({
                    "split": split, "group": g, "next_group": g + 1, "last_loop": first_next,
                    "first_loop_next": first_next + 1, "n_tokens": int(parts["dlr"].size),
                    "drift_mean": float(np.mean(parts["drift"])) if parts["drift"].size else math.nan,
                    "loop_step_mean": float(np.nanmean(parts["loop_step"])) if finite.size else math.nan,
                    "dlr_mean": float(finite.mean()) if finite.size else math.nan,
                    "dlr_median": float(np.median(finite)) if finite.size else math.nan,
                    "dlr_of_means": (float(np.mean(parts["drift"]) / np.nanmean(parts["loop_step"]))
                                     if finite.size else math.nan),
                })
    finally:
        tl_writer.close()
        cv_writer.close()
    shutil.rmtree(scratch, ignore_errors=True)
    summary = pl.DataFrame(summaries, schema=SUMMARY_SCHEMA)
    write_parquet(summary, tmp / "loop_summary.parquet")
    # Always written (zero rows for a single looped group) so the stage's outputs are a fixed set.
    write_parquet(pl.DataFrame(dlr_rows, schema=DLR_SCHEMA), tmp / "dlr.parquet")
    metrics = _metrics(summary, split_metrics, dlr_rows, stores, cfg, meta)
    (tmp / "metrics.json").write_text(json.dumps(jsonable(metrics), indent=2, allow_nan=False))
    return metrics


def _convergence_metrics(depths: dict, keys: list[tuple[str, float]], n_loops: int, n_tokens: int) -> dict:
    """Per (signal, ε): median depth, mean over converged tokens, censored count and fraction for
    first / settled, and the settled depth by difficulty (mean, censored tokens counted as T + 1)."""
    diff = np.concatenate(depths.get("difficulty", [np.zeros(0, np.int64)]))
    levels = np.unique(diff)
    out = {}
    for sig, eps in keys:
        entry: dict[str, Any] = {}
        for kind in ("first", "settled"):
            d = np.concatenate(depths.get((sig, eps, kind), [np.zeros(0, np.int16)])).astype(np.int64)
            censored = d > n_loops
            entry[f"median_{kind}"] = _median_int(d)
            entry[f"mean_{kind}_uncensored"] = float(d[~censored].mean()) if (~censored).any() else math.nan
            entry[f"censored_{kind}"] = int(censored.sum())
            entry[f"censored_frac_{kind}"] = float(censored.mean()) if d.size else math.nan
            if kind == "settled":
                entry["settled_mean_by_difficulty"] = {str(int(v)): float(d[diff == v].mean()) for v in levels}
        out[f"{sig}@{eps:g}"] = entry
    return out


def _metrics(summary: pl.DataFrame, conv: dict, dlr_rows: list, stores: dict, cfg: GeometryConfig,
             meta: dict) -> dict:
    """metrics.json: headline numbers per split (DVC metrics; nested, JSON-able)."""
    allrows = summary.filter(pl.col("group_by") == "all")

    def per_loop(split: str, metric: str, stat: str = "mean") -> list[float | None]:
        rows = allrows.filter((pl.col("split") == split) & (pl.col("metric") == metric)).sort("loop")
        return [None if v is None or math.isnan(v) else float(v) for v in rows[stat].to_list()]

    out: dict[str, Any] = dict(meta)
    out.update({"n_loops": int(next(iter(stores.values())).n_loops),
                "loop_group": [int(g) for g in next(iter(stores.values())).loop_group],
                "params": to_dict(cfg), "splits": {}})
    for split, st in stores.items():
        cos = per_loop(split, "step_cos")
        out["splits"][split] = {
            "n_tokens": int(st.n_tokens),
            "accuracy_per_loop": per_loop(split, "correct"),
            "step_norm_mean_per_loop": per_loop(split, "step_norm"),
            "rel_step_median_per_loop": per_loop(split, "rel_step", "median"),
            "step_cos_mean_per_loop": cos,
            "step_cos_mean_last_loop": cos[-1] if cos else None,
            "accel_mean_per_loop": per_loop(split, "accel"),
            "convergence": conv.get(split, {}),
            "dlr": [{k: r[k] for k in ("group", "dlr_median", "dlr_of_means")} for r in dlr_rows
                    if r["split"] == split],
        }
    return out
