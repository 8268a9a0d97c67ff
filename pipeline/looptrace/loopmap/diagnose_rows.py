"""The loop map in the diagnose stage's outputs (SPEC §2b): per model a regime row and AUC rows of
``loopmap.parquet`` (:data:`LOOPMAP_SCHEMA`) and a ``summary.md`` section, from either source —

- :func:`loopmap_models`: every model whose test store was dumped with ``dump.contraction`` (the whole split:
  :func:`looptrace.loopmap.diagnoses.loopmap_report`);
- :func:`loopmap_artifacts`: otherwise the loopmap stage's tables (its fixed sample, docs/loopmap.md).

A model without either (the default dump has no such arrays) gets nothing and no error; when no model has
them nothing is written at all, so the default outputs are unchanged byte for byte."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import polars as pl

from looptrace.io.artifacts import read_parquet
from looptrace.io.store.reader import open_store
from looptrace.loopmap.config import LoopmapConfig
from looptrace.loopmap.diagnoses import loopmap_report

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
                   cfg: LoopmapConfig | None = None) -> tuple[pl.DataFrame | None, str]:
    """The loop-map diagnoses of every model whose ``<dump_root>/<model>/test.zarr`` holds ``contraction`` and
    ``ftle``.

    Args:
        names: model names.
        dump_root: root of the dump stage's stores.
        seed: the bootstrap seed (``base.seed``).
        cfg: the ``loopmap`` section's diagnoses parameters (default: :class:`LoopmapConfig`'s defaults).

    Returns:
        (:data:`LOOPMAP_SCHEMA` frame, summary.md section), or (None, "") when no model's store has the arrays.
    """
    cfg = cfg or LoopmapConfig()
    rows: list[dict] = []
    words: list[str] = []
    for name in names:
        path = Path(dump_root) / name / "test.zarr"
        if not path.is_dir():
            continue
        store = open_store(path)
        if "contraction" not in store or "ftle" not in store:
            continue  # not dumped with dump.contraction (the default): no diagnosis, no error
        rep = loopmap_report(store, cfg, seed)
        rows.append({"model": name, **{k: rep["regime"][k] for k in _REGIME_KEYS}})
        rows.extend({"model": name, **r} for r in rep["auc"].iter_rows(named=True))
        words.append(f"- **{name}**: " + " ".join(rep["words"]))
    if not rows:
        return None, ""
    frame = pl.DataFrame(rows, schema=LOOPMAP_SCHEMA)
    text = ("\n## Loop-map dynamics (SPEC §2b; models dumped with dump.contraction)\n\n" + "\n".join(words) + "\n")
    return frame, text


def loopmap_artifacts(names: Sequence[str], loopmap_root: Path | str) -> tuple[pl.DataFrame | None, str]:
    """Rows and summary section from the loopmap stage's tables of ``names``.

    Args:
        names: model names.
        loopmap_root: root of the loopmap stage's outputs (``artifacts/loopmap``).

    Returns:
        (:data:`LOOPMAP_SCHEMA` frame, summary.md section), or (None, "") when no model has loopmap outputs.
    """
    rows: list[dict] = []
    words: list[str] = []
    for name in names:
        d = Path(loopmap_root) / name
        if not (d / "regime.parquet").is_file():
            continue
        regime = read_parquet(d / "regime.parquet")
        if not regime.height:  # the loop map could not be differentiated (metrics.json says why)
            continue
        reg = regime.row(0, named=True)
        rows.append({"model": name, **{k: reg[k] for k in _REGIME_KEYS}})
        rows.extend({"model": name, **{k: r[k] for k in LOOPMAP_SCHEMA if k in r and k != "model"}}
                    for r in read_parquet(d / "auc.parquet").iter_rows(named=True))
        summary = (d / "summary.md").read_text().split("\n\n", 1)[1].strip() if (d / "summary.md").is_file() else ""
        words.append(f"- **{name}** ({reg['n_tokens']} tokens of {reg['n_sequences']} sequences): "
                     + " ".join(summary.split("\n\n")))
    if not rows:
        return None, ""
    text = ("\n## Loop-map dynamics (SPEC §2b; the loopmap stage's fixed sample, docs/loopmap.md)\n\n"
            + "\n".join(words) + "\n")
    return pl.DataFrame(rows, schema=LOOPMAP_SCHEMA), text
