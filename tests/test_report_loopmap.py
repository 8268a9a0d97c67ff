"""The report's loop-map section (``looptrace.report.loopmap_section``) on hand-made loopmap-stage tables
of two seeds: what it reads back per loop and per intervention, the per-model text (intervals, the certified
exit's share and front, the windows) and the figure; absent tables -> no section, a "not shown" note."""

from __future__ import annotations

import math

import numpy as np
import polars as pl
import pytest
from PIL import Image

from looptrace.io.artifacts import write_outputs
from looptrace.report.fig_loopmap import fig_loopmap
from looptrace.report.loopmap_section import decay_values, load_loopmap, loopmap_rows, per_loop_values

T = 3


def _stage(root, model, rho, ftle, state, lin, window, reached, certified, on_front, rule="certified_fixed_point"):
    """artifacts/loopmap/<model>/ as the stage writes it: per-loop medians ``rho``/``ftle`` [T]; the median state
    effect / linearised prediction [T − 1] of noise 0.01 at k = 1 (and a decoy at scale 0.1 and k = 2)."""
    per_loop = pl.DataFrame({"model": [model] * T, "loop": list(range(1, T + 1)), "rho_median": rho,
                             "rho_lo": rho, "rho_hi": rho, "share_rho_below_1": [0.5] * T, "ftle_median": ftle,
                             "ftle_lo": ftle, "ftle_hi": ftle, "accuracy": [1.0] * T, "n_tokens": [10] * T})
    rows = []
    for kind, scale, k, vals in (("noise", 0.01, 1, {"state": state, "linear": lin}),
                                 ("noise", 0.1, 1, {"state": [9.0, 9.0], "linear": [9.0, 9.0]}),
                                 ("noise", 0.01, 2, {"state": [7.0], "linear": [7.0]})):
        for measure, v in vals.items():
            for j, x in enumerate(v, start=1):
                rows.append({"model": model, "kind": kind, "scale": scale, "loop": k, "j": j, "measure": measure,
                             "statistic": "median", "value": x, "lo": x, "hi": x, "n_tokens": 10})
    windows = pl.DataFrame(rows)
    wl = pl.DataFrame([{"model": model, "kind": "noise", "scale": 0.01, "loop": 1, "measure": "state",
                        "threshold": 0.1, "window": window, "horizon": T - 1, "reached": reached},
                       {"model": model, "kind": "patch", "scale": None, "loop": 1, "measure": "state",
                        "threshold": 0.1, "window": T, "horizon": T - 1, "reached": False}])
    regime = pl.DataFrame([{"model": model, "regime": "contracting", "ftle_median": -0.5, "ftle_lo": -0.61,
                            "ftle_hi": -0.4, "share_rho_below_1": 0.8, "share_lo": 0.75, "share_hi": 0.85,
                            "rho_median": 0.6, "n_sequences": 4, "n_tokens": 10, "words": "w"}])
    frontier = pl.DataFrame({"model": [model] * 3, "rule": [rule, rule, "fixed"],
                             "threshold": [0.3, 0.1, 1.0], "mean_depth": [1.5, 2.0, 1.0], "accuracy": [1.0] * 3,
                             "share_certified": certified + [math.nan], "pareto": [on_front, False, True]})
    write_outputs(root / "loopmap" / model, {"per_loop": per_loop, "windows": windows, "window_length": wl,
                                            "regime": regime, "frontier": frontier}, {})


@pytest.fixture
def two_seeds(tmp_path):
    _stage(tmp_path, "t-geometric-s0", [2.0, 0.5, 0.4], [0.7, 0.1, -0.2], [0.5, 0.25], [0.5, 0.2], 2, True,
           [0.31, 0.2], False)
    _stage(tmp_path, "t-geometric-s1", [8.0, 0.5, 0.1], [0.9, -0.1, -0.4], [0.2, 0.05], [0.3, 0.1], 1, True,
           [0.9, 0.7], True)
    return tmp_path


def test_reads_back_per_loop_and_the_first_smallest_noise(two_seeds):
    names = ["t-geometric-s0", "t-geometric-s1"]
    lm = load_loopmap(two_seeds, names)
    assert set(lm) == {"regime", "per_loop", "windows", "window_length", "frontier"}
    np.testing.assert_array_equal(per_loop_values(lm, names, "rho_median", T), [[2.0, 0.5, 0.4], [8.0, 0.5, 0.1]])
    np.testing.assert_array_equal(per_loop_values(lm, names + ["absent"], "ftle_median", T)[2], [np.nan] * T)
    state, what = decay_values(lm, names, "state", T)  # k = 1, scale 0.01 (not the 0.1 or k = 2 decoys)
    np.testing.assert_array_equal(state, [[0.5, 0.25, np.nan], [0.2, 0.05, np.nan]])
    assert what == "noise of relative scale 0.01 at loop k = 1"
    np.testing.assert_array_equal(decay_values(lm, names, "linear", T)[0][:, :2], [[0.5, 0.2], [0.3, 0.1]])
    assert load_loopmap(two_seeds, ["nobody"]) is None


def test_per_model_text(two_seeds):
    rows = loopmap_rows(load_loopmap(two_seeds, ["t-geometric-s0", "t-geometric-s1"]))
    r0, r1 = rows.row(0, named=True), rows.row(1, named=True)
    assert r0["ftle_text"] == "-0.500 [-0.610, -0.400]" and r0["share_text"] == "80 [75, 85]"
    assert r0["certified_text"] == "31 % at most; not on the front"
    assert r1["certified_text"] == "90 % at most; on the front"
    assert r0["noise_window"] == "2 loops (k = 1, scale 0.01, threshold 0.1)"
    assert r0["patch_window"] == "> 2 loops (k = 1, threshold 0.1)"


def test_an_estimated_exit_is_not_called_certified(tmp_path):
    """A model wider than loopmap.exact_width: its frontier rows are the estimated fixed-point exit, said so."""
    _stage(tmp_path, "wide-s0", [2.0, 0.5, 0.4], [0.7, 0.1, -0.2], [0.5, 0.25], [0.5, 0.2], 2, True, [0.4, 0.2],
           True, rule="estimated_fixed_point")
    r = loopmap_rows(load_loopmap(tmp_path, ["wide-s0"])).row(0, named=True)
    assert r["certified_text"] == "estimated, not certified: 40 % at most; on the front"


def test_figure_and_page_section(two_seeds, tmp_path):
    from looptrace.report.inputs import Inputs

    meta = pl.DataFrame({"model": ["t-geometric-s0", "t-geometric-s1"], "task": ["t", "t"],
                         "regime": ["geometric"] * 2, "regime_kind": ["geometric"] * 2, "n_loops": [T, T]})
    lm = load_loopmap(two_seeds, meta["model"].to_list())
    png = fig_loopmap(Inputs(meta=meta), lm, tmp_path / "fig", dpi=120)
    assert png is not None and Image.open(png).size[0] <= 1400
    assert fig_loopmap(Inputs(meta=meta), None, tmp_path / "fig", dpi=120) is None


def _trace_tables(root, model, restored_answer, flip_mean, gated):
    """trace / flip_depth / gate_patch tables of the stage's schemas: the answer row restores ``restored_answer[k]``
    at loop k = 0..T; flip depth mean ``flip_mean``; fixed depth d exits before F on 0.5/d of the tokens."""
    from looptrace.loopmap.trace_tables import FLIP_SCHEMA, GATE_PATCH_SCHEMA, TRACE_SCHEMA

    rows = []
    for pos, vals in (("answer", restored_answer), ("flipped", [0.9, 0.2, 0.1, 0.0]),
                      ("between", [0.0, 0.3, 0.2, 0.0])):
        rows += [{"model": model, "loop": k, "position": pos, "restored": v, "lo": v - 0.1, "hi": v + 0.1,
                  "n_sequences": 4} for k, v in enumerate(vals)]
    flips = [{"model": model, "rule": "flip_depth", "threshold": None, "mean_depth": flip_mean,
              "depth_lo": flip_mean - 0.2, "depth_hi": flip_mean + 0.2, "share_before_flip": 0.0, "before_lo": 0.0,
              "before_hi": 0.0, "mean_gap": 0.0, "gap_lo": 0.0, "gap_hi": 0.0, "accuracy": 1.0, "n_tokens": 10}]
    flips += [{"model": model, "rule": "fixed", "threshold": float(d), "mean_depth": float(d), "depth_lo": d,
               "depth_hi": d, "share_before_flip": 0.5 / d, "before_lo": 0.4 / d, "before_hi": 0.6 / d,
               "mean_gap": d - flip_mean, "gap_lo": 0.0, "gap_hi": 0.0, "accuracy": 1.0, "n_tokens": 10}
              for d in range(1, T + 1)]
    gate = []
    if gated:
        gate = [{"model": model, "patch": "gate_input", "loop": k, "position": "answer", "measure": "exit_depth",
                 "rule": "q_exit", "clean": 1.0, "corrupt": 2.5, "patched": 2.5 - 0.5 * (k == 2),
                 "shift": -0.5 * (k == 2), "shift_lo": -0.7 * (k == 2), "shift_hi": -0.3 * (k == 2),
                 "restored": 0.33 * (k == 2), "restored_lo": 0.0, "restored_hi": 0.5, "n_sequences": 4}
                for k in range(1, T + 1)]
    from looptrace.io.parquet import write_parquet

    for name, df in {"trace": pl.DataFrame(rows, schema=TRACE_SCHEMA),
                     "flip_depth": pl.DataFrame(flips, schema=FLIP_SCHEMA),
                     "gate_patch": pl.DataFrame(gate, schema=GATE_PATCH_SCHEMA)}.items():
        write_parquet(df, root / "loopmap" / model / f"{name}.parquet")  # beside the fixture's other tables


def test_trace_section_rows_and_figure(two_seeds, tmp_path):
    from looptrace.report.fig_loopmap import fig_loopmap_trace
    from looptrace.report.inputs import Inputs
    from looptrace.report.loopmap_section import flip_curve, trace_map, trace_rows

    _trace_tables(two_seeds, "t-geometric-s0", [0.0, 0.4, 0.6, 1.0], 1.5, gated=False)
    _trace_tables(two_seeds, "t-geometric-s1", [0.0, 0.2, 0.4, 1.0], 2.5, gated=True)
    names = ["t-geometric-s0", "t-geometric-s1"]
    lm = load_loopmap(two_seeds, names)
    rows = trace_rows(lm)
    r0, r1 = rows.row(0, named=True), rows.row(1, named=True)
    assert r0["flip_text"] == "1.50 [1.30, 1.70]" and r0["late_text"] == "50 [40, 60]"
    assert r0["answer_text"] == "0.40 [0.30, 0.50]; loop 2" and r1["answer_text"] == "0.20 [0.10, 0.30]; loop 3"
    assert r0["flipped_text"] == "0.20 [0.10, 0.30]" and r0["gate_text"] == "—"
    assert r1["gate_text"] == "1.00 → 2.50; loop 2: -0.50 [-0.70, -0.30]"  # the largest shift toward clean
    grid = trace_map(lm, names, ("flipped", "answer"), T + 1)
    np.testing.assert_allclose(grid[1, 1], [0.0, 0.2, 0.4, 1.0])
    share, flip = flip_curve(lm, names, T)
    np.testing.assert_allclose(share[0], [0.5, 0.25, 0.5 / 3])
    np.testing.assert_allclose(flip, [1.5, 2.5])
    meta = pl.DataFrame({"model": names, "task": ["t", "t"], "regime": ["geometric"] * 2,
                         "regime_kind": ["geometric"] * 2, "n_loops": [T, T]})
    png = fig_loopmap_trace(Inputs(meta=meta), lm, tmp_path / "fig", dpi=120)
    assert png is not None and Image.open(png).size[0] <= 1400
    assert fig_loopmap_trace(Inputs(meta=meta), None, tmp_path / "fig", dpi=120) is None
    assert trace_rows({"regime": lm["regime"]}) is None
