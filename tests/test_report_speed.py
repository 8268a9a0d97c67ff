"""The report's "Speed: lossless vs lossy" section and figure on hand-made generate and speculative tables: the
fastest early exit above the agreement bar and overall, the speculative settings' intervals, the sentences, and
when speed.png is drawn."""

from __future__ import annotations

from pathlib import Path

import polars as pl
import pytest

from looptrace.online.generate import GENERATE_SCHEMA
from looptrace.online.speculative import speculative_frame
from looptrace.report import ReportConfig, build_report, plotting
from looptrace.report.fig_speed import fig_speed, speed_panels
from looptrace.report.findings import speed_findings
from looptrace.report.inputs import load_inputs
from looptrace.report.speed_section import speed_rows
from tests.test_report import T, _model_outputs, _write

MODELS = {"ta-uniform": ("ta", "uniform", "uniform"), "ta-joint": ("ta", "joint", "joint"),
          "tb-uniform": ("tb", "uniform", "uniform")}

#: ta-uniform's early-exit runs: (rule, policy, batch size, realised speedup, token agreement).
EXITS = [("top1", "share", 1, 2.5, 0.75), ("entropy", "share", 1, 1.5, 0.995), ("kl_prev", "share", 1, 1.2, 1.0),
         ("top1", "recompute", 1, 0.9, 1.0), ("entropy", "recompute", 1, 1.6, 0.985),
         ("top1", "share", 8, 3.0, 0.75), ("kl_prev", "share", 8, 1.1, 1.0), ("entropy", "share", 8, 0.8, 1.0)]
#: tb-uniform has early exit under recompute and native only (no share): its panel shows the first, recompute.
EXITS_TB = [("top1", "recompute", 1, 0.7, 1.0), ("top1", "native", 1, 0.95, 0.5), ("top1", "recompute", 8, 0.6, 1.0)]
#: speculative rows: (model, k, d, batch size, realised, lo, hi, predicted, lo, hi).
SPEC = [("ta-uniform", 1, 3, 1, 1.4, 1.2, 1.5, 1.3, 1.25, 1.35), ("ta-uniform", 2, 3, 1, 1.8, 1.6, 2.0, 1.5, 1.4, 1.6),
        ("ta-uniform", 2, 3, 8, 1.25, 1.0, 1.3, 0.5, 0.45, 0.55), ("ta-joint", 2, 3, 1, 0.9, 0.8, 1.1, 0.8, 0.7, 0.9)]


def _gen() -> pl.DataFrame:
    rows = [{**dict.fromkeys(GENERATE_SCHEMA), "model": m, "rule": r, "kind": "posthoc", "source": "readouts",
             "policy": p, "batch_size": bs, "n_loops": T, "n_tokens": 64, "mean_exit_depth": T / 2,
             "ideal_speedup": 2.0, "realised_speedup": s, "speedup_ratio": s / 2.0, "tokens_per_s": 100.0 * s,
             "token_agreement": a, "loss_gap": 0.1}
            for m, ex in (("ta-uniform", EXITS), ("tb-uniform", EXITS_TB)) for r, p, bs, s, a in ex]
    return pl.DataFrame(rows, schema=GENERATE_SCHEMA)


def _spec() -> pl.DataFrame:
    return speculative_frame([{"model": m, "k": k, "d": d, "batch_size": bs, "n_loops": T, "exact": True,
                               "realised_speedup": r, "realised_speedup_lo": rl, "realised_speedup_hi": rh,
                               "predicted_speedup": p, "predicted_speedup_lo": pl_, "predicted_speedup_hi": ph,
                               "speedup_ratio": r / p} for m, k, d, bs, r, rl, rh, p, pl_, ph in SPEC])


@pytest.fixture
def root(tmp_path) -> Path:
    root = tmp_path / "artifacts"
    for i, (model, (task, regime, kind)) in enumerate(MODELS.items()):
        _model_outputs(root, model, task, regime, kind, shift=0.1 * i)
    _write(root / "generate" / "generate.parquet", _gen())
    _write(root / "generate" / "speculative.parquet", _spec())
    return root


def test_speed_table_rows_are_the_hand_derived_ones():
    rows = speed_rows(_gen(), _spec(), list(MODELS), 0.99)
    assert rows is not None
    got = [(r["model"], r["batch_size"], r["k"], r["d"]) for r in rows.iter_rows(named=True)]
    # model order, then batch size, k, d; ta-joint has speculative rows only, tb-uniform early exit only
    assert got == [("ta-uniform", 1, 1, 3), ("ta-uniform", 1, 2, 3), ("ta-uniform", 8, 2, 3), ("ta-joint", 1, 2, 3),
                   ("tb-uniform", 1, None, None), ("tb-uniform", 8, None, None)]
    r = rows.row(1, named=True)
    assert (r["spec_realised_text"], r["spec_predicted_text"], r["spec_ratio_text"], r["exact_text"]) == (
        "1.80× [1.60, 2.00]", "1.50× [1.40, 1.60]", "1.20", "yes")
    # batch 1: ≥ 99 % agreement are entropy/share 1.5 (99.5 %), kl_prev/share 1.2, top1/recompute 0.9 —
    # entropy/recompute (1.6, 98.5 %) and top1/share (2.5, 75 %) are faster but below the bar; top1/share is the
    # fastest of all
    assert (r["bar_rule"], r["bar_speedup"], r["bar_agreement_text"]) == ("entropy (share)", 1.5, "99.5")
    assert (r["fast_rule"], r["fast_speedup_text"], r["fast_agreement_text"]) == ("top1 (share)", "2.50×", "75.0")
    assert rows.row(0, named=True)["bar_rule"] == "entropy (share)"  # the same exits beside both settings
    r8 = rows.row(2, named=True)
    assert (r8["bar_rule"], r8["bar_speedup"], r8["fast_rule"], r8["fast_speedup"]) == (
        "kl_prev (share)", 1.1, "top1 (share)", 3.0)
    assert r8["spec_ratio_text"] == "2.50"
    j = rows.row(3, named=True)
    assert j["bar_rule"] is None and j["fast_rule"] is None and j["spec_realised_text"] == "0.90× [0.80, 1.10]"
    tb = rows.row(4, named=True)  # no speculative setting: the exits alone (native 0.95 at 50 % is the fastest)
    assert tb["spec_realised_text"] is None and (tb["bar_rule"], tb["fast_rule"]) == ("top1 (recompute)",
                                                                                     "top1 (native)")
    # a lower bar admits entropy/recompute (98.5 %)
    low = speed_rows(_gen(), _spec(), list(MODELS), 0.98)
    assert low is not None and low.row(1, named=True)["bar_rule"] == "entropy (recompute)"
    assert speed_rows(_gen(), None, list(MODELS), 0.99) is None  # no speculative rows: no section


def test_speed_findings_carry_the_table_numbers():
    s = speed_findings(_gen(), _spec(), list(MODELS), 0.99)
    assert s == [
        "ta-uniform, batch 1: speculative decoding (k=2, d=3, the fastest of 2 settings) 1.80× [1.60, 2.00] with "
        "every token full depth's (predicted 1.50× [1.40, 1.60]); the fastest early exit at ≥ 99 % token agreement "
        "is entropy (share) at 1.50× (99.5 % agreement); the fastest early exit overall is top1 (share) at 2.50× "
        "with 75.0 % agreement.",
        "ta-uniform, batch 8: speculative decoding (k=2, d=3) 1.25× [1.00, 1.30] with every token full depth's "
        "(predicted 0.50× [0.45, 0.55]); the fastest early exit at ≥ 99 % token agreement is kl_prev (share) at "
        "1.10× (100.0 % agreement); the fastest early exit overall is top1 (share) at 3.00× with 75.0 % agreement.",
        "ta-joint, batch 1: speculative decoding (k=2, d=3) 0.90× [0.80, 1.10] with every token full depth's "
        "(predicted 0.80× [0.70, 0.90]); no early-exit run at this batch size to compare."]
    # a bar nothing reaches, and a fastest run that is also the fastest above the bar
    gen = _gen().filter(pl.col("model") == "ta-uniform")
    one = speed_findings(gen, _spec().filter(pl.col("batch_size") == 1), ["ta-uniform"], 1.0)
    # at a 100 % bar: kl_prev/share 1.2 and top1/recompute 0.9 qualify
    assert "the fastest early exit at ≥ 100 % token agreement is kl_prev (share) at 1.20× (100.0 % agreement)" in one[0]
    top = gen.filter(pl.col("rule") != "top1")
    two = speed_findings(top, _spec().filter(pl.col("batch_size") == 8), ["ta-uniform"], 0.99)
    assert two[0].endswith("is kl_prev (share) at 1.10× (100.0 % agreement), also the fastest early exit overall.")
    none = speed_findings(gen.filter(pl.col("token_agreement") < 0.9), _spec().filter(pl.col("batch_size") == 1),
                          ["ta-uniform"], 0.99)
    assert "; no early-exit run reaches 99 % token agreement; the fastest early exit overall is top1 (share) at " \
           "2.50× with 75.0 % agreement." in none[0]
    bad = speed_findings(None, _spec().with_columns(exact=pl.lit(False)), ["ta-joint"], 0.99)
    assert "differ from full-depth greedy decoding's (exact = false" in bad[0]


def test_speed_section_and_figure_on_the_page(root, tmp_path):
    out = tmp_path / "report"
    build_report(list(MODELS), root, out, ReportConfig(dpi=60))
    page = (out / "index.html").read_text()
    assert (out / "figures" / "speed.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "<img src='figures/speed.png'" in page and "<h2>Speed: lossless vs lossy</h2>" in page
    row = ("<tr><td>ta-uniform</td><td>1</td><td>2</td><td>3</td><td>1.80× [1.60, 2.00]</td><td>1.50× [1.40, 1.60]"
           "</td><td>1.20</td><td>yes</td><td>entropy (share)</td><td>1.50×</td><td>99.5</td><td>top1 (share)</td>"
           "<td>2.50×</td><td>75.0</td></tr>")
    assert row in page
    assert "fastest early exit at ≥ 99 % agreement (KV policy)" in page
    assert "the fastest early exit at ≥ 99 % token agreement is entropy (share) at 1.50×" in page
    # the bar is report.speed_agreement
    out2 = tmp_path / "report2"
    build_report(list(MODELS), root, out2, ReportConfig(dpi=60, speed_agreement=0.98))
    assert "<td>entropy (recompute)</td><td>1.60×</td><td>98.5</td>" in (out2 / "index.html").read_text()


def test_speed_figure_draws_what_the_tables_hold(root, tmp_path):
    inp = load_inputs(list(MODELS), root, ReportConfig())
    panels = speed_panels(inp)
    assert [(p["model"], p["policy"], p["exit_batch"], p["spec_batch"]) for p in panels] == [
        ("ta-uniform", "share", 1, 1), ("ta-joint", None, None, 1), ("tb-uniform", "recompute", 1, None)]
    assert sorted(panels[0]["exits"]["rule"].to_list()) == ["entropy", "kl_prev", "top1"]
    drawn = []
    real_save = plotting.save

    def grab(fig, path, dpi):
        axes = [a for a in fig.axes if a.get_visible()]
        drawn.append({"titles": [a.get_title().split("\n")[0] for a in axes],
                      "scales": {a.get_xscale() for a in axes},
                      "points": sorted(tuple(round(float(v), 6) for v in xy) for c in axes[0].collections
                                       if type(c).__name__ == "PathCollection" for xy in c.get_offsets()),
                      "lines": [(tuple(line.get_xdata()), tuple(line.get_ydata()), line.get_marker())
                                for line in axes[0].lines]})
        return real_save(fig, path, dpi)

    plotting.save = grab
    try:
        path = fig_speed(inp, tmp_path, 60)
    finally:
        plotting.save = real_save
    assert path == tmp_path / "speed.png" and path.is_file()
    (d,) = drawn
    assert d["titles"] == ["ta-uniform", "ta-joint", "tb-uniform"] and d["scales"] == {"log"}
    # ta-uniform's share exits at batch 1, as (speedup, agreement %)
    assert d["points"] == [(1.2, 100.0), (1.5, 99.5), (2.5, 75.0)]
    # the speculative markers (not the error bars' caps): realised 1.4 and 1.8, predicted 1.3 and 1.5, at 100 %
    marks = sorted((xs[0], m) for xs, ys, m in d["lines"] if ys == (100.0,) and m not in ("|", "None", ""))
    assert marks == [(1.3, "D"), (1.4, "D"), (1.5, "^"), (1.8, "^")]  # a marker per (k, d): (1, 3) D, (2, 3) ^
    caps = sorted(xs[0] for xs, ys, m in d["lines"] if ys == (100.0,) and m == "|")
    assert caps == [1.2, 1.25, 1.35, 1.4, 1.5, 1.6, 1.6, 2.0]  # realised min–max and predicted 95 % intervals
    assert ((1.0, 1.0), (0.0, 1.0), "None") in d["lines"]  # the 1× line


def test_speed_figure_only_with_a_table(root, tmp_path):
    (root / "generate" / "speculative.parquet").unlink()
    inp = load_inputs(list(MODELS), root, ReportConfig())
    assert inp.speculative is None and "generate/speculative.parquet" not in inp.missing
    assert fig_speed(inp, tmp_path / "a", 60) == tmp_path / "a" / "speed.png"  # the early-exit runs alone
    (root / "generate" / "generate.parquet").unlink()
    _write(root / "generate" / "speculative.parquet", _spec())
    inp = load_inputs(list(MODELS), root, ReportConfig())
    assert [p["model"] for p in speed_panels(inp)] == ["ta-uniform", "ta-joint"]
    assert fig_speed(inp, tmp_path / "b", 60) is not None  # speculative alone
    (root / "generate" / "speculative.parquet").unlink()
    inp = load_inputs(list(MODELS), root, ReportConfig())
    assert fig_speed(inp, tmp_path / "c", 60) is None and not (tmp_path / "c").exists()  # neither table
    out = tmp_path / "report"
    build_report(list(MODELS), root, out, ReportConfig(dpi=60))
    assert not (out / "figures" / "speed.png").exists()
    assert "Speed: lossless vs lossy" not in (out / "index.html").read_text()


def test_speed_agreement_is_checked():
    from looptrace.config import ConfigError

    with pytest.raises(ConfigError, match="report.speed_agreement"):
        ReportConfig(speed_agreement=99.0)
