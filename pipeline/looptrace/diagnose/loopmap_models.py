"""The loop-map diagnoses (SPEC §2b) in the diagnose stage's outputs: for every model whose test store was dumped
with ``dump.contraction``, its regime with bootstrap intervals, the share of ρ_t < 1 and the failure-AUC table
(:func:`looptrace.diagnose.loopmap.loopmap_report`) as rows of ``loopmap.parquet`` and a ``summary.md`` section in
the report's words. A model without the arrays (the default) gets nothing and no error; when no model has them
nothing is written at all, so the default outputs are unchanged byte for byte."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import polars as pl

from looptrace.diagnose.loopmap import LoopMapConfig, loopmap_report
from looptrace.io.store.reader import open_store

#: ``loopmap.parquet``: per model one regime row (``failure``/``predictor`` null) and one row per failure kind ×
#: predictor with its AUC (regime columns null).
LOOPMAP_SCHEMA = {"model": pl.String, "regime": pl.String, "ftle_median": pl.Float64, "ftle_lo": pl.Float64,
                  "ftle_hi": pl.Float64, "share_rho_below_1": pl.Float64, "share_lo": pl.Float64,
                  "share_hi": pl.Float64, "n_sequences": pl.Int64, "failure": pl.String, "predictor": pl.String,
                  "auc": pl.Float64, "auc_lo": pl.Float64, "auc_hi": pl.Float64, "n_pos": pl.Int64,
                  "n_neg": pl.Int64}
_REGIME_KEYS = ("regime", "ftle_median", "ftle_lo", "ftle_hi", "share_rho_below_1", "share_lo", "share_hi",
                "n_sequences")


def loopmap_models(names: Sequence[str], dump_root: Path | str, seed: int = 0,
                   cfg: LoopMapConfig | None = None) -> tuple[pl.DataFrame | None, str]:
    """The loop-map diagnoses of every model whose ``<dump_root>/<model>/test.zarr`` holds ``contraction`` and
    ``ftle``.

    Args:
        names: model names.
        dump_root: root of the dump stage's stores.
        seed: the bootstrap seed (``base.seed``).
        cfg: the diagnoses' parameters (default :class:`LoopMapConfig` with ``seed``).

    Returns:
        (:data:`LOOPMAP_SCHEMA` frame, summary.md section), or (None, "") when no model's store has the arrays.
    """
    cfg = cfg or LoopMapConfig(seed=seed)
    rows: list[dict] = []
    words: list[str] = []
    for name in names:
        path = Path(dump_root) / name / "test.zarr"
        if not path.is_dir():
            continue
        store = open_store(path)
        if "contraction" not in store or "ftle" not in store:
            continue  # not dumped with dump.contraction (the default): no diagnosis, no error
        rep = loopmap_report(store, cfg)
        rows.append({"model": name, **{k: rep["regime"][k] for k in _REGIME_KEYS}})
        rows.extend({"model": name, **r} for r in rep["auc"].iter_rows(named=True))
        words.append(f"- **{name}**: " + " ".join(rep["words"]))
    if not rows:
        return None, ""
    frame = pl.DataFrame(rows, schema=LOOPMAP_SCHEMA)
    text = ("\n## Loop-map dynamics (SPEC §2b; models dumped with dump.contraction)\n\n" + "\n".join(words) + "\n")
    return frame, text
