"""Figures sized for the page, seeds aggregated, the Pareto curves the text talks about in colour."""

from __future__ import annotations

import math
import struct
from pathlib import Path

import numpy as np
import polars as pl
import pytest

from looptrace.report import build_report
from looptrace.report.fig_pareto import mean_front, pareto_highlights
from looptrace.report.inputs import ReportConfig
from looptrace.report.plotting import FIG_W, MIN_PT, seed_band
from tests.test_report import _model_outputs, _write


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) in pixels from the PNG's IHDR chunk."""
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    return struct.unpack(">II", head[16:24])


def test_figures_fit_the_page_and_aggregate_seeds(tmp_path):
    root = tmp_path / "artifacts"
    models = []
    for task in ("ta", "tb"):
        for regime, kind in (("uniform", "uniform"), ("joint", "joint")):
            for s in range(3):
                m = f"{task}-{regime}-s{s}"
                _model_outputs(root, m, task, regime, kind, shift=0.05 * s)
                models.append(m)
    out = tmp_path / "report"
    metrics = build_report(models, root, out, ReportConfig())
    sizes = {p.name: png_size(p) for p in sorted((out / "figures").glob("*.png"))}
    assert {"accuracy_per_loop.png", "step_geometry.png", "pareto_ta.png", "pareto_tb.png"} <= set(sizes)
    for name, (w, _) in sizes.items():
        # 10.5 in at the default 110 dpi: 1155 px, inside the page's 1180 px column (shown 1:1, ≤ 1400 px)
        assert w == round(FIG_W * 110) <= 1400, (name, w)
    assert metrics["n_figures"] == len(sizes)
    assert MIN_PT >= 10


def test_seed_band_stays_in_range_and_matches_the_t_interval():
    v = np.array([[100.0, 90.0], [100.0, 92.0], [100.0, 94.0]])
    mean, lo, hi = seed_band(v, (0.0, 100.0))
    assert (mean[0], lo[0], hi[0]) == (100.0, 100.0, 100.0)  # every seed at 100 %: the band is the bound
    assert 0.0 <= lo[1] < 92.0 < hi[1] <= 100.0
    # a positive quantity on a log scale: geometric mean, t-interval of the logs
    m, lo, hi = seed_band(np.array([[1.0], [4.0]]), log=True)
    half = 12.706204736174707 * np.std(np.log([1.0, 4.0]), ddof=1) / math.sqrt(2)
    assert m[0] == pytest.approx(2.0) and lo[0] == pytest.approx(2.0 * math.exp(-half))
    # one seed: a line without a band
    m, lo, _ = seed_band(np.array([[0.5, 0.7]]), (0.0, 1.0))
    assert list(m) == [0.5, 0.7] and np.isnan(lo).all()


def test_pareto_highlights_are_the_curves_the_text_names():
    kinds = {"fixed": "fixed", "oracle": "oracle", "q_exit": "native", "entropy": "posthoc", "top1": "posthoc",
             "margin": "posthoc", "gate:logreg-oracle": "gate", "gate:mlp": "gate", "my.rules:slow": "posthoc"}
    chosen = pl.DataFrame({
        "model": ["m-s0"] * 4 + ["m-s1"] * 4,
        "rule": ["entropy", "top1", "gate:logreg-oracle", "gate:mlp"] * 2,
        "kind": ["posthoc", "posthoc", "gate", "gate"] * 2,
        # seed 0 picks entropy and the logreg gate on val, seed 1 top1 and the mlp gate
        "val_depth": [1.5, 2.0, 1.8, 2.5, 2.2, 1.7, 2.6, 1.9], "val_accuracy": [0.96] * 8,
        "within_delta": [True] * 8, "test_depth": [1.0] * 8, "test_accuracy": [0.9] * 8})
    hl = pareto_highlights(chosen, kinds)
    assert list(hl) == ["fixed", "oracle", "q_exit", "entropy", "top1", "gate:logreg-oracle", "gate:mlp",
                        "my.rules:slow"]
    assert hl["entropy"][0] == hl["top1"][0] == "best post-hoc (val)" and hl["my.rules:slow"][0] == "user rule"
    assert "margin" not in hl  # drawn grey
    assert len({c for _, c in hl.values()}) == len(hl)  # every highlighted curve has its own colour


def test_mean_front_averages_the_seeds_fronts_as_step_functions():
    """Seed a: (1, 50), (2, 80), (3, 90) %; seed b: (1.5, 60), (3, 70) %. From depth 1.5 (both defined) on the union
    of depths: at 1.5 a = 50, b = 60; at 2 a = 80, b = 60; at 3 a = 90, b = 70."""
    p = pl.DataFrame({"model": ["a"] * 3 + ["b"] * 2, "mean_depth": [1.0, 2.0, 3.0, 1.5, 3.0],
                      "accuracy": [0.5, 0.8, 0.9, 0.6, 0.7]})
    x, y = mean_front(p, ["a", "b"])
    assert list(x) == [1.5, 2.0, 3.0] and list(y) == pytest.approx([55.0, 70.0, 80.0])


def test_legends_are_deduplicated(tmp_path):
    """One legend entry per regime although every regime has three seeds (the issue: each regime three times)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    from looptrace.report import plotting
    from looptrace.report.fig_loops import fig_step_geometry
    from looptrace.report.inputs import load_inputs

    root = tmp_path / "artifacts"
    models = [f"ta-{r}-s{s}" for r in ("uniform", "joint") for s in range(3)]
    for m in models:
        _model_outputs(root, m, "ta", m.split("-")[1], m.split("-")[1], 0.0)
    _write(root / "diagnose" / "verdicts.parquet", pl.DataFrame({"model": models}))
    inp = load_inputs(models, root, ReportConfig())
    legends = []
    real_save = plotting.save

    def grab(fig, path, dpi):
        legends.append([t.get_text() for lg in fig.legends for t in lg.get_texts()])
        return real_save(fig, path, dpi)

    plotting.save = grab
    try:
        fig_step_geometry(inp, tmp_path, 110)
    finally:
        plotting.save = real_save
        plt.close("all")
    assert legends == [["uniform (3 seeds)", "joint (3 seeds)"]]


def test_interactive_pareto_view_hover_toggles_and_offline(tmp_path):
    """One Plotly view per task: hover text with rule, threshold, depth and accuracy with intervals; a legend group
    per rule (one click toggles it in every panel and seed); a seed menu; the bundle beside the page; same bytes
    twice."""
    from looptrace.report.inputs import load_inputs
    from looptrace.report.interactive import PLOTLY_JS, interactive_html, pareto_figure

    root = tmp_path / "artifacts"
    models = [f"ta-{r}-s{s}" for r in ("uniform", "joint") for s in range(2)]
    for i, m in enumerate(models):
        _model_outputs(root, m, "ta", m.split("-")[1], m.split("-")[1], 0.01 * i)
    pq = root / "readouts" / "ta-uniform-s0" / "pareto.parquet"
    p = pl.read_parquet(pq)
    _write(pq, p.with_columns(mean_depth_lo=pl.col("mean_depth") - 0.1, mean_depth_hi=pl.col("mean_depth") + 0.1,
                              accuracy_lo=pl.col("accuracy") - 0.01, accuracy_hi=pl.col("accuracy") + 0.01))
    inp = load_inputs(models, root, ReportConfig())
    fig = pareto_figure(inp, "ta")
    ent = [t for t in fig.data if t.name == "entropy"]
    assert len(ent) == 4 and {t.legendgroup for t in ent} == {"entropy"}  # 2 regimes × 2 seeds, one group
    assert sum(bool(t.showlegend) for t in fig.data if t.name == "entropy") == 1  # one legend entry per rule
    # ta-uniform-s0's entropy points: 1.2 loops / 80 % with the intervals written above
    assert ("<b>entropy</b> (best post-hoc (val))<br>ta-uniform-s0<br>threshold 0<br>depth 1.20 [1.10, 1.30] loops"
            "<br>accuracy 80.00 [79.00, 81.00] %") in ent[0].hovertext
    top1 = [t for t in fig.data if t.name == "top1"]
    assert all(t.visible == "legendonly" for t in top1)  # a rule the text does not name: grey, hidden until clicked
    (menu,) = fig.layout.updatemenus
    assert [b.label for b in menu.buttons] == ["all seeds", "seed 0", "seed 1"]
    assert menu.buttons[1].args[0]["opacity"] == [1.0 if "s0" in _trace_model(t) else 0.0 for t in fig.data]
    a = interactive_html(inp, tmp_path)
    assert a == interactive_html(inp, tmp_path) and a.count("Plotly.newPlot") == 1
    assert (tmp_path / PLOTLY_JS).stat().st_size > 1_000_000  # the bundle, offline


def _trace_model(t) -> str:
    return t.hovertext[0].split("<br>")[1]
