"""Geometry per layer inside the loop (SPEC §2 metrics on ``layer_hidden``, the opt-in ``dump.layers`` array).

For each stored layer j of the loop block and loop t, with x_{t,j} the layer's output at loop t:

- across loops (the same layer, loop t − 1 -> t; x_{0,j} = h_0, the state entering the first loop): ``step_norm``,
  ``rel_step``, ``step_cos`` exactly as SPEC §2 defines them for h_t (:func:`looptrace.signals.steps.step_metrics`);
- within the loop (from the previous stored layer to this one, same loop; undefined for the first stored layer):
  ``within_norm`` ‖x_{t,j} − x_{t,j'}‖ and ``within_cos`` cos(x_{t,j}, x_{t,j'}).

The loop-level figures (``hidden``) are untouched: this is a separate table. numpy + polars, torch-free.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import polars as pl

from looptrace.signals.steps import step_metrics

#: The SPEC §2 step metrics taken across loops for each layer (the columns this module chooses to compute).
stats = ("step_norm", "rel_step", "step_cos")

#: Long format: one row per (layer, loop, metric), median and mean over tokens (finite values).
LAYER_GEOMETRY_SCHEMA = {"layer": pl.Int64, "loop": pl.Int64, "metric": pl.String, "median": pl.Float64,
                         "mean": pl.Float64, "count": pl.Int64}


def layer_metrics(layer_hidden: np.ndarray, hidden_init: np.ndarray) -> dict[str, np.ndarray]:
    """Per-(token, loop, layer) metrics of the module docstring: name -> [token, loop, layer] float32 (NaN undefined).

    Args:
        layer_hidden: [token, loop, layer, d_model].
        hidden_init: [token, d_model] h_0.
    """
    x = np.asarray(layer_hidden, dtype=np.float32)
    n, T, L, _ = x.shape
    out: dict[str, np.ndarray] = {}
    for j in range(L):
        for name, v in step_metrics(x[:, :, j], hidden_init).items():
            if name in stats:
                out.setdefault(name, np.full((n, T, L), np.nan, np.float32))[:, :, j] = v
    wn = np.full((n, T, L), np.nan, np.float32)
    wc = np.full((n, T, L), np.nan, np.float32)
    if L > 1:
        d = x[:, :, 1:] - x[:, :, :-1]
        wn[:, :, 1:] = np.linalg.norm(d, axis=-1)
        num = (x[:, :, 1:] * x[:, :, :-1]).sum(-1)
        den = np.linalg.norm(x[:, :, 1:], axis=-1) * np.linalg.norm(x[:, :, :-1], axis=-1)
        with np.errstate(invalid="ignore", divide="ignore"):
            wc[:, :, 1:] = np.where(den > 0, num / den, np.nan)
    out["within_norm"], out["within_cos"] = wn, wc
    return out


def layer_geometry(layer_hidden: np.ndarray, hidden_init: np.ndarray, layers: Sequence[int]) -> pl.DataFrame:
    """Median and mean over tokens of :func:`layer_metrics`, per (layer, loop): :data:`LAYER_GEOMETRY_SCHEMA`.

    Args:
        layer_hidden: [token, loop, layer, d_model] (the store's ``layer_hidden``).
        hidden_init: [token, d_model].
        layers: the block indices of the stored layers (the store's ``params.layers``), for the ``layer`` column.
    """
    rows = []
    for name, v in layer_metrics(layer_hidden, hidden_init).items():
        for li, j in enumerate(layers):
            for t in range(v.shape[1]):
                col = v[:, t, li]
                fin = col[np.isfinite(col)]
                rows.append({"layer": int(j), "loop": t + 1, "metric": name,
                             "median": float(np.median(fin)) if fin.size else float("nan"),
                             "mean": float(fin.mean()) if fin.size else float("nan"), "count": int(fin.size)})
    return pl.DataFrame(rows, schema=LAYER_GEOMETRY_SCHEMA)


__all__ = ["LAYER_GEOMETRY_SCHEMA", "layer_geometry", "layer_metrics"]
