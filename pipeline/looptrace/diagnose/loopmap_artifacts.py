"""The ``loopmap`` stage's outputs in the diagnose stage (SPEC §2b): for every model with an
``<loopmap_root>/<model>/regime.parquet``, its regime row and AUC rows in ``loopmap.parquet`` (the schema of
:data:`looptrace.diagnose.loopmap_models.LOOPMAP_SCHEMA`, so the file reads the same whichever source filled it) and a
``summary.md`` section with the stage's sentences (regime, certified exit on the sample's front, windows).

The diagnose stage calls this when no test store holds the opt-in ``dump.contraction`` arrays (those give the
whole-split figures, :mod:`looptrace.diagnose.loopmap_models`); a model without loopmap outputs is skipped, and with
none at all nothing is written (as before the stage existed).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import polars as pl

from looptrace.diagnose.loopmap_models import _REGIME_KEYS, LOOPMAP_SCHEMA
from looptrace.io.artifacts import read_parquet


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
