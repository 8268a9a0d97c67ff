"""The loop-map diagnoses in the diagnose stage (looptrace.loopmap.diagnose_rows): rows and summary words for the
models whose test store was dumped with dump.contraction, nothing (and no error) for the others."""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest

from looptrace.io.store.reader import open_store
from looptrace.loopmap.config import LoopmapConfig
from looptrace.loopmap.diagnose_rows import LOOPMAP_SCHEMA, loopmap_models
from looptrace.loopmap.diagnoses import loopmap_report


def test_loopmap_rows_only_for_models_dumped_with_contraction(tmp_path):
    from looptrace.capture.dump import DumpConfig, dump_split
    from looptrace.loopmap.contraction import ContractionConfig
    from tests.builders import tiny_adapter_and_data

    adapter, data = tiny_adapter_and_data(n_seq=12, unscored=False, gate="none")
    root = tmp_path / "dump"
    dump_split(adapter, data, root / "m-con" / "test.zarr",
               DumpConfig(batch_size=6, chunk_tokens=32, contraction=ContractionConfig(power_iters=2)))
    dump_split(adapter, data, root / "m-plain" / "test.zarr", DumpConfig(batch_size=6, chunk_tokens=32))

    # no model with the arrays (or no store at all): nothing, no error
    assert loopmap_models(["m-plain", "m-missing"], root) == (None, "")

    frame, text = loopmap_models(["m-plain", "m-con", "m-missing"], root, seed=3)
    assert frame is not None and dict(frame.schema) == LOOPMAP_SCHEMA
    assert set(frame["model"]) == {"m-con"}
    # the same numbers as the library's report on that store (same seed)
    rep = loopmap_report(open_store(root / "m-con" / "test.zarr"), LoopmapConfig(), seed=3)
    reg = frame.filter(pl.col("failure").is_null()).row(0, named=True)
    assert reg["regime"] == rep["regime"]["regime"]
    for k in ("ftle_median", "ftle_lo", "ftle_hi", "share_rho_below_1", "share_lo", "share_hi"):
        assert reg[k] == pytest.approx(rep["regime"][k], nan_ok=True), k
    rho = open_store(root / "m-con" / "test.zarr").read("contraction")
    assert reg["share_rho_below_1"] == pytest.approx(float((rho < 1).mean()))
    auc = frame.filter(pl.col("failure").is_not_null()).select(rep["auc"].columns)
    assert auc.height == rep["auc"].height == 8
    assert np.allclose(auc["auc"].to_numpy(), rep["auc"]["auc"].to_numpy(), equal_nan=True)
    assert "## Loop-map dynamics" in text and "**m-con**" in text and "m-plain" not in text
    for w in rep["words"]:
        assert w in text
