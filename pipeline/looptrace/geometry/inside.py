"""Inside the loop (SPEC §2c): per-layer convergence from ``layer_hidden`` and per-head attention statistics from
``head_entropy`` / ``head_js``, summarised per split with bootstrap intervals over sequences.

Each table is written by the geometry stage only when every analysed split's store holds its arrays (the opt-in
``dump.layers`` / ``dump.heads``), so a default run's outputs are unchanged:

- ``layers.parquet`` (:data:`LAYERS_SCHEMA`): for each stored layer ℓ of the looped block and for the block output
  h_t (``layer`` null), per loop t the median over tokens of the layer's own step norm ‖x_{t,ℓ} − x_{t−1,ℓ}‖ and
  relative step ‖x_{t,ℓ} − x_{t−1,ℓ}‖ / ‖x_{t,ℓ}‖ (SPEC §2's ``rel_step`` of the layer's own states;
  x_{0,ℓ} = h_0, as SPEC §2 takes h_0 before loop 1); per
  ``geometry.eps.rel_step`` threshold ε the median settled depth (SPEC §2 ``settled`` on the layer's relative step;
  censored tokens count as T + 1) and, against the block output's settled depth d_out of the same token, the share
  of tokens with d_ℓ < d_out (``settles_before_output``) and the mean of d_ℓ − d_out (``settled_gap``).
- ``heads.parquet`` (:data:`HEADS_SCHEMA`): per (layer, head, loop) the median over tokens of the head's attention
  entropy and of its JS divergence from the previous loop.

Intervals: percentile bootstrap over the split's sequences (:class:`looptrace.intervals.Resampler`, the
``intervals`` section; seed ``boot_seed(base.seed, model, split)``, so the test split draws the resamples the
readouts draw). A median's resample is the median of the resampled multiset (:func:`resampled_medians`). Memory:
one block of ``layer_hidden`` at a time, plus the per-token scalars of one split.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import polars as pl

from looptrace.geometry.blocks import convergence_depth
from looptrace.intervals import IntervalsConfig, Resampler, boot_seed, percentile_interval
from looptrace.signals.steps import step_metrics

#: The store arrays each table needs (all of them in every analysed split).
LAYER_ARRAYS = ("layer_hidden",)
HEAD_ARRAYS = ("head_entropy", "head_js")

#: ``layers.parquet``: ``layer`` null = the block output h_t; ``loop`` null on the depth rows, ``eps`` null on the
#: per-loop rows; ``statistic`` says what ``estimate`` is (median | share | mean over tokens).
LAYERS_SCHEMA = {"split": pl.String, "layer": pl.Int64, "loop": pl.Int64, "metric": pl.String, "eps": pl.Float64,
                 "statistic": pl.String, "estimate": pl.Float64, "lo": pl.Float64, "hi": pl.Float64,
                 "count": pl.Int64, "n_boot": pl.Int64, "n_sequences": pl.Int64}
#: ``heads.parquet``: ``estimate`` the median over tokens of ``metric`` (entropy | js, nats).
HEADS_SCHEMA = {"split": pl.String, "layer": pl.Int64, "head": pl.Int64, "loop": pl.Int64, "metric": pl.String,
                "estimate": pl.Float64, "lo": pl.Float64, "hi": pl.Float64, "count": pl.Int64, "n_boot": pl.Int64,
                "n_sequences": pl.Int64}
#: Per-loop metrics of ``layers.parquet`` and the per-head metrics of ``heads.parquet``, in row order.
LAYER_METRICS = ("step_norm", "rel_step")
HEAD_METRICS = ("entropy", "js")


def has_arrays(stores: Mapping[str, Any], names: Iterable[str]) -> bool:
    """Whether every store holds every array of ``names``."""
    return all(n in st for st in stores.values() for n in names)


# ---------------------------------------------------------------------------------------------
# Resampled statistics
# ---------------------------------------------------------------------------------------------

def resampled_medians(rs: Resampler, values: np.ndarray, batch: int = 256) -> np.ndarray:
    """The median of every bootstrap resample of per-token values: [token] -> [B] float64.

    A resample gives token i the weight w_i of its unit (its sequence's count); its median is the median of the
    multiset in which value i appears w_i times (the mean of the two middle elements when Σ w is even), so unit
    weights give ``np.median``. Non-finite values are left out (their weight with them); NaN where a resample keeps
    no value.

    The values are sorted once; a middle element of resample b is the first sorted token whose cumulative weight
    reaches its rank. Rather than the cumulative weight of all n tokens per resample (B × n), the sorted tokens are
    cut into ~√n blocks: the block weights of every resample are one matrix product, counts [B, U] @ tokens of
    unit u in block j [U, blocks], and only the block holding the rank is summed token by token. Weights are
    integers, so every sum is exact in float64 whatever its order: the same medians as the direct sum.
    """
    v = np.asarray(values, dtype=np.float64)
    out = np.full(rs.n_boot, np.nan)
    keep = np.flatnonzero(np.isfinite(v))
    if not keep.size or not rs.n_boot:
        return out
    order = keep[np.argsort(v[keep], kind="stable")]
    sv, units = v[order], rs.index[order]
    n = sv.size
    width = max(1, math.isqrt(n))  # tokens per block
    n_blocks = -(-n // width)
    in_block = np.zeros((rs.n_units, n_blocks))
    np.add.at(in_block, (units, np.arange(n) // width), 1.0)  # [U, blocks] tokens of unit u in block j
    offsets = np.arange(width)
    for b0 in range(0, rs.n_boot, batch):
        counts = rs.counts[b0:b0 + batch]  # [b, U]
        rows = np.arange(counts.shape[0])[:, None]
        cum = np.cumsum(counts @ in_block, axis=1)  # [b, blocks] cumulative weight at each block's end
        total = cum[:, -1]
        picked = []
        for rank in (np.floor((total + 1) / 2), np.floor(total / 2) + 1):  # 1-based ranks of the two middle ones
            j = np.minimum((cum < rank[:, None]).sum(axis=1), n_blocks - 1)  # the block holding the rank
            before = np.where(j > 0, cum[rows[:, 0], j - 1], 0.0)  # weight of the blocks before it
            tok = j[:, None] * width + offsets  # [b, width] its tokens (past n: weight 0)
            w = np.where(tok < n, counts[rows, units[np.minimum(tok, n - 1)]], 0.0)
            inside = (before[:, None] + np.cumsum(w, axis=1) < rank[:, None]).sum(axis=1)
            picked.append(np.minimum(j * width + inside, n - 1))
        out[b0:b0 + batch] = np.where(total > 0, 0.5 * (sv[picked[0]] + sv[picked[1]]), np.nan)
    return out


def _median_row(rs: Resampler | None, values: np.ndarray) -> dict[str, Any]:
    v = np.asarray(values, dtype=np.float64)
    fin = v[np.isfinite(v)]
    est = float(np.median(fin)) if fin.size else math.nan
    lo = hi = math.nan
    if rs is not None and fin.size:
        lo_a, hi_a = percentile_interval(resampled_medians(rs, v), rs.level)
        lo, hi = float(lo_a), float(hi_a)
    return {"estimate": est, "lo": lo, "hi": hi, "count": int(fin.size)}


def _mean_row(rs: Resampler | None, values: np.ndarray) -> dict[str, Any]:
    v = np.asarray(values, dtype=np.float64)
    est = float(v.mean()) if v.size else math.nan
    lo = hi = math.nan
    if rs is not None and v.size:
        lo_a, hi_a = percentile_interval(rs.ratio(v), rs.level)
        lo, hi = float(lo_a), float(hi_a)
    return {"estimate": est, "lo": lo, "hi": hi, "count": int(v.size)}


def _resampler(cfg: IntervalsConfig | None, sequence: np.ndarray, seed: int) -> Resampler | None:
    if cfg is None or cfg.n_boot == 0:
        return None
    return Resampler(sequence, cfg.n_boot, seed, cfg.level)


def _boot_cols(rs: Resampler | None) -> dict[str, int]:
    return {"n_boot": 0 if rs is None else rs.n_boot, "n_sequences": 0 if rs is None else rs.n_units}


# ---------------------------------------------------------------------------------------------
# Per-layer convergence
# ---------------------------------------------------------------------------------------------

def layer_block(layer_hidden: np.ndarray, hidden: np.ndarray, hidden_init: np.ndarray) -> dict[str, np.ndarray]:
    """Per-token step metrics of each stored layer and of the block output, one block of tokens.

    Args:
        layer_hidden: [token, loop, layer, d_model] x_{t,ℓ}.
        hidden: [token, loop, d_model] h_t (the block output).
        hidden_init: [token, d_model] h_0.

    Returns:
        ``step_norm`` and ``rel_step``: [token, loop, layer + 1] float32, the last column the block output (NaN where
        undefined: a zero previous state).
    """
    n, T, L, _ = layer_hidden.shape
    out = {m: np.full((n, T, L + 1), np.nan, np.float32) for m in LAYER_METRICS}
    for j in range(L + 1):
        x = hidden if j == L else layer_hidden[:, :, j]
        sm = step_metrics(x, hidden_init)
        for m in LAYER_METRICS:
            out[m][:, :, j] = sm[m]
    return out


def layer_table(split: str, layers: Sequence[int], step_norm: np.ndarray, rel_step: np.ndarray, sequence: np.ndarray,
                eps: Sequence[float], rs: Resampler | None) -> list[dict]:
    """``layers.parquet`` rows of one split.

    Args:
        layers: the block indices of the stored layers (the store's ``params.layers``).
        step_norm, rel_step: [token, loop, layer + 1] from :func:`layer_block` (the last column: the block output).
        sequence: [token] sequence ids (the resampling unit).
        eps: the relative-step thresholds of the settled depths (``geometry.eps.rel_step``).
        rs: the split's resampler (None: no intervals, lo = hi = NaN).
    """
    _, T, L1 = rel_step.shape
    names: list[int | None] = [int(j) for j in layers] + [None]
    base = {"split": split, **_boot_cols(rs)}
    rows = []
    for li, layer in enumerate(names):
        for m, arr in (("step_norm", step_norm), ("rel_step", rel_step)):
            for t in range(T):
                rows.append({**base, "layer": layer, "loop": t + 1, "metric": m, "eps": None, "statistic": "median",
                             **_median_row(rs, arr[:, t, li])})
    for e in eps:
        depth = [convergence_depth(rel_step[:, :, li], float(e))["settled"].astype(np.float64) for li in range(L1)]
        out_depth = depth[-1]
        for li, layer in enumerate(names):
            rows.append({**base, "layer": layer, "loop": None, "metric": "settled_depth", "eps": float(e),
                         "statistic": "median", **_median_row(rs, depth[li])})
            if layer is None:
                continue
            rows.append({**base, "layer": layer, "loop": None, "metric": "settles_before_output", "eps": float(e),
                         "statistic": "share", **_mean_row(rs, (depth[li] < out_depth).astype(np.float64))})
            rows.append({**base, "layer": layer, "loop": None, "metric": "settled_gap", "eps": float(e),
                         "statistic": "mean", **_mean_row(rs, depth[li] - out_depth)})
    return rows


def layers_frame(stores: Mapping[str, Any], eps: Sequence[float], intervals: IntervalsConfig | None, model: str,
                 base_seed: int, block_tokens: int | None = None) -> pl.DataFrame:
    """``layers.parquet`` of one model: every split's stores streamed block by block (:data:`LAYERS_SCHEMA`)."""
    rows: list[dict] = []
    for split, st in stores.items():
        parts: dict[str, list[np.ndarray]] = {"step_norm": [], "rel_step": [], "sequence": []}
        for tokens in st.blocks(block_tokens):
            arr = st.read_block(["layer_hidden", "hidden", "hidden_init", "sequence"], tokens)
            m = layer_block(arr["layer_hidden"], arr["hidden"], arr["hidden_init"])
            parts["step_norm"].append(m["step_norm"])
            parts["rel_step"].append(m["rel_step"])
            parts["sequence"].append(np.asarray(arr["sequence"], np.int64))
        seq = np.concatenate(parts["sequence"])
        n_layers = parts["rel_step"][0].shape[2] - 1
        layers = list((st.attrs.get("params") or {}).get("layers") or range(n_layers))
        rs = _resampler(intervals, seq, boot_seed(base_seed, model, split))
        rows += layer_table(split, layers, np.concatenate(parts["step_norm"]), np.concatenate(parts["rel_step"]),
                            seq, eps, rs)
    return pl.DataFrame(rows, schema=LAYERS_SCHEMA)


# ---------------------------------------------------------------------------------------------
# Per-head attention statistics
# ---------------------------------------------------------------------------------------------

def head_table(split: str, layers: Sequence[int], entropy: np.ndarray, js: np.ndarray, rs: Resampler | None
               ) -> list[dict]:
    """``heads.parquet`` rows of one split: entropy and js [token, loop, layer, head] (the store's arrays)."""
    _, T, L, H = entropy.shape
    base = {"split": split, **_boot_cols(rs)}
    rows = []
    for li, layer in enumerate(layers):
        for h in range(H):
            for m, arr in (("entropy", entropy), ("js", js)):
                for t in range(T):
                    rows.append({**base, "layer": int(layer), "head": h, "loop": t + 1, "metric": m,
                                 **_median_row(rs, arr[:, t, li, h])})
    return rows


def heads_frame(stores: Mapping[str, Any], intervals: IntervalsConfig | None, model: str, base_seed: int
                ) -> pl.DataFrame:
    """``heads.parquet`` of one model (:data:`HEADS_SCHEMA`). A split's two arrays are held whole (the medians need
    every token): 8 bytes per (token, loop, layer, head)."""
    rows: list[dict] = []
    for split, st in stores.items():
        ent, js = np.asarray(st.read("head_entropy")), np.asarray(st.read("head_js"))
        layers = list((st.attrs.get("params") or {}).get("heads") or range(ent.shape[2]))
        rs = _resampler(intervals, st.read("sequence"), boot_seed(base_seed, model, split))
        rows += head_table(split, layers, ent, js, rs)
    return pl.DataFrame(rows, schema=HEADS_SCHEMA)


def inside_tables(stores: Mapping[str, Any], eps: Sequence[float], intervals: IntervalsConfig | None, model: str,
                  base_seed: int, block_tokens: int | None = None) -> dict[str, pl.DataFrame]:
    """The tables the stores allow: ``layers.parquet`` with ``layer_hidden``, ``heads.parquet`` with the head arrays
    (file name -> frame; empty for a default dump)."""
    out = {}
    if has_arrays(stores, LAYER_ARRAYS):
        out["layers.parquet"] = layers_frame(stores, eps, intervals, model, base_seed, block_tokens)
    if has_arrays(stores, HEAD_ARRAYS):
        out["heads.parquet"] = heads_frame(stores, intervals, model, base_seed)
    return out


__all__ = ["HEADS_SCHEMA", "LAYERS_SCHEMA", "has_arrays", "head_table", "heads_frame", "inside_tables", "layer_block",
           "layer_table", "layers_frame", "resampled_medians"]
