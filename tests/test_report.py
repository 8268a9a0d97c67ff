"""The report stage on tiny constructed outputs: figures exist, the page references only files that
exist (relative, offline), and headline numbers equal hand-computed ones."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import polars as pl
import pytest

from looptrace.online.generate import GENERATE_SCHEMA
from looptrace.online.latency import LATENCY_SCHEMA
from looptrace.report import ReportConfig, build_report
from looptrace.report.findings import generate_findings, latency_findings
from looptrace.report.page import markdown_to_html

T = 4
MODELS = {"ta-uniform": ("ta", "uniform", "uniform"), "ta-joint": ("ta", "joint", "joint"),
          "tb-uniform": ("tb", "uniform", "uniform")}


def _write(path: Path, df: pl.DataFrame) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    df.write_parquet(path)


def _points(rule, kind, depths, accs):
    n = len(depths)
    return pl.DataFrame({"rule": [rule] * n, "kind": [kind] * n, "threshold": np.arange(n, dtype=float),
                         "split": ["test"] * n, "mean_depth": depths, "accuracy": accs, "mean_loss": [0.1] * n,
                         "on_model_front": [True] * n})


def _model_outputs(root: Path, model: str, task: str, regime: str, kind: str, shift: float) -> None:
    rd = root / "readouts" / model
    acc = [0.6 + shift, 0.9, 0.97, 0.99]
    rd.mkdir(parents=True)
    (rd / "metrics.json").write_text(json.dumps({
        "model": model, "task": task, "regime": regime, "regime_kind": kind, "n_loops": T,
        "has_gate": kind == "joint", "full_depth_accuracy": {"val": 0.99, "test": acc[-1]},
        "test_accuracy_per_loop": acc}))
    parts = [_points("fixed", "fixed", [1.0, 2.0, 3.0, 4.0], acc),
             _points("entropy", "posthoc", [1.2 + shift, 1.8, 2.4], [0.8, 0.96, 0.99]),
             _points("top1", "posthoc", [1.1, 2.2 + shift], [0.7, 0.955]),
             _points("oracle", "oracle", [1.05], [0.995])]
    if kind == "joint":
        parts.append(_points("q_exit", "native", [2.0, 3.5], [0.9, 0.96]))
    pareto = pl.concat(parts)
    _write(rd / "pareto.parquet", pareto)
    dx = []
    for rule in pareto["rule"].unique(maintain_order=True).to_list():
        p = pareto.filter(pl.col("rule") == rule)
        ok = p.filter(pl.col("accuracy") >= 0.95)
        dx.append({"rule": rule, "kind": p["kind"][0], "x": 95.0,
                   "d_at": float(ok["mean_depth"].min()) if ok.height else float("nan")})
    _write(rd / "dx.parquet", pl.DataFrame(dx))
    _write(rd / "chosen.parquet", pl.DataFrame({"rule": ["fixed", "entropy"], "kind": ["fixed", "posthoc"],
                                                "threshold": [3.0, 1.0], "test_depth": [3.0, 1.8],
                                                "test_accuracy": [0.97, 0.96]}))
    gd = root / "geometry" / model
    rows = []
    for t in range(1, T + 1):
        for metric, v in (("step_norm", 2.0 / t), ("step_cos", 0.1 * t if t > 1 else None), ("correct", acc[t - 1])):
            # one model has ±inf step norms at loops 2 and 4 (3 + 1 values left out of its summaries)
            n_inf = {2: 3, 4: 1}.get(t, 0) if (model == "ta-joint" and metric == "step_norm") else 0
            rows.append({"split": "test", "loop": t, "group_by": "all", "group_value": "all", "metric": metric,
                         "mean": v, "median": v, "q25": None if v is None else 0.9 * v,
                         "q75": None if v is None else 1.1 * v, "count": 0 if v is None else 10,
                         "n_nan": 10 if v is None else 0, "n_inf": n_inf})
            for tt, name in enumerate(("keep", "change")):
                rows.append({"split": "test", "loop": t, "group_by": "token_type", "group_value": name,
                             "metric": metric, "mean": v, "median": v, "q25": v, "q75": v, "count": 5 + tt})
    _write(gd / "loop_summary.parquet", pl.DataFrame(rows, infer_schema_length=None))
    n = 12
    _write(gd / "convergence.parquet", pl.DataFrame({
        "split": ["test"] * n, "token": np.arange(n), "difficulty": np.arange(n) % 3 + 1,
        "token_type": np.arange(n) % 2, "signal": ["kl_prev"] * n, "eps": [0.001] * n, "kind": ["first"] * n,
        "depth": np.array([2, 3, 5] * 4), "censored": np.array([2, 3, 5] * 4) > T}))


@pytest.fixture
def artifacts(tmp_path) -> Path:
    root = tmp_path / "artifacts"
    for i, (model, (task, regime, kind)) in enumerate(MODELS.items()):
        _model_outputs(root, model, task, regime, kind, shift=0.1 * i)
    fails = []
    for model in MODELS:
        for rule in ("fixed", "entropy"):
            fails.append({"model": model, "source": "readouts", "rule": rule, "group": "all", "difficulty": None,
                          "n_tokens": 100, "frac_correct": 0.9, "frac_trajectory": 0.05, "frac_readout_early": 0.03,
                          "frac_readout_overthinking": 0.02})
    _write(root / "diagnose" / "failure_classes.parquet", pl.DataFrame(fails))
    _write(root / "diagnose" / "verdicts.parquet", pl.DataFrame({
        "model": list(MODELS), "verdict": ["readout-limited", "trajectory-limited", "readout-limited"],
        "reason": ["below_ceiling", "no_early_exit", "below_ceiling"]}))
    (root / "diagnose" / "summary.md").write_text(
        "# Diagnosis: trajectory or readout?\n\n## Verdicts\n\n| model | verdict |\n|---|---|\n"
        "| ta-uniform | readout-limited |\n\n- claim (a) **holds**\n  - nested `detail`\n\nA paragraph.\n")
    pairs = [("ta-uniform", "ta-uniform"), ("ta-uniform", "ta-joint"), ("ta-joint", "ta-uniform"), ("ta-joint", "ta-joint")]
    _write(root / "gates" / "cross_regime.parquet", pl.DataFrame({  # gates' schema (subset)
        "task": ["ta"] * 8, "fit_model": [a for a, _ in pairs] * 2, "eval_model": [b for _, b in pairs] * 2,
        "rule": ["gate:logreg-oracle"] * 8, "mode": ["transfer"] * 4 + ["refit"] * 4, "x": [95.0] * 8,
        "d_at": [1.5, None, 2.0, 3.0, 1.5, 3.0, 1.5, 3.0]}))
    lat = []
    for model in ("ta-uniform", "ta-joint"):
        for bs, real in ((1, 1.2), (256, 1.8)):
            lat.append({**{k: None for k in LATENCY_SCHEMA}, "model": model, "rule": "entropy", "kind": "posthoc",
                        "source": "readouts", "batch_size": bs, "n_loops": T, "n_tokens": 48, "mean_exit_depth": 2.0,
                        "realised_speedup": real, "ideal_speedup": 2.0, "speedup_ratio": real / 2.0,
                        "ideal_speedup_work": 1.9, "ratio_to_work_ideal": real / 1.9, "accuracy_real": 0.96,
                        "accuracy_offline": 0.96, "exact": True, "exit_mismatches": 0, "correct_mismatches": 0})
    _write(root / "latency" / "latency.parquet", pl.DataFrame(lat, schema=LATENCY_SCHEMA))
    (root / "latency" / "metrics.json").write_text(json.dumps({"models": {
        "ta-uniform": {"skipped": {"q_exit": "model has no native halting gate", "gate": "no fitted gate"}}}}))
    gen = []
    for policy, real in (("share", 1.6), ("recompute", 0.9)):
        for bs, f in ((1, 1.0), (8, 0.5)):
            gen.append({**{k: None for k in GENERATE_SCHEMA}, "model": "ta-uniform", "rule": "top1", "kind": "posthoc",
                        "source": "readouts", "policy": policy, "batch_size": bs, "n_loops": T, "n_tokens": 64,
                        "mean_exit_depth": 2.0, "ideal_speedup": T / 2.0, "realised_speedup": real * f,
                        "speedup_ratio": real * f / (T / 2.0), "tokens_per_s": 100.0 * real * f,
                        "token_agreement": 0.75, "loss_gap": 0.125 if policy == "share" else 0.0})
    _write(root / "generate" / "generate.parquet", pl.DataFrame(gen, schema=GENERATE_SCHEMA))
    (root / "generate" / "metrics.json").write_text(json.dumps({"models": {
        "ta-uniform": {"skipped": {"policy:native": "KV policy native: none (looptrace's LoopedTransformer has no KV "
                                                    "policy of its own)"}}}}))
    return root


def _img_srcs(page: str) -> list[str]:
    return re.findall(r"<img src='([^']+)'", page)


def test_report_end_to_end(artifacts, tmp_path):
    out = tmp_path / "report"
    metrics = build_report(list(MODELS), artifacts, out, ReportConfig(dpi=60))
    page = (out / "index.html").read_text()
    srcs = _img_srcs(page)
    want = {"accuracy_per_loop", "step_geometry", "convergence", "pareto_ta", "pareto_tb", "failure_classes",
            "cross_regime", "latency", "speed"}  # speed: the early-exit runs alone (no speculative.parquet)
    assert {Path(s).stem for s in srcs} == want
    for s in srcs:  # relative, inside the report, existing PNGs
        assert not s.startswith(("/", "http", "file:")) and (out / s).is_file()
        assert (out / s).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # offline: the only script file is the Plotly bundle beside the page (the interactive view); no URL
    assert set(re.findall(r"<script([^>]*)>", page)) == {" src='plotly.min.js'", ""}
    assert (out / "plotly.min.js").is_file() and "http://" not in page and "https://" not in page
    assert sorted(p.name for p in (out / "figures").iterdir()) == sorted(f"{w}.png" for w in want)
    # Headline numbers, hand-derived from the constructed dx tables (D@95 = min depth with accuracy ≥ 0.95).
    m = metrics["models"]
    assert m["ta-uniform"]["d95_fixed"] == 3.0  # fixed reaches 0.97 at depth 3
    assert m["ta-uniform"]["d95_best_posthoc"] == pytest.approx(1.8)  # entropy 1.8 < top1 2.2
    assert m["ta-uniform"]["best_posthoc_rule"] == "entropy"
    assert m["tb-uniform"]["best_posthoc_rule"] == "entropy" and m["tb-uniform"]["d95_best_posthoc"] == 1.8
    assert m["ta-joint"]["d95_native"] == 3.5 and m["ta-uniform"]["d95_native"] is None
    assert m["ta-joint"]["d95_best_posthoc"] == pytest.approx(1.8)  # top1 2.3 vs entropy 1.8
    assert m["ta-uniform"]["oracle_depth"] == 1.05 and m["ta-joint"]["verdict"] == "trajectory-limited"
    assert metrics["latency"]["bs256"]["median_speedup_ratio"] == pytest.approx(0.9)
    assert metrics["latency"]["all_exact"] is True
    assert metrics["generate"]["share_bs1"] == {"median_speedup_ratio": pytest.approx(1.6 / (T / 2)),
                                                "max_realised_speedup": 1.6, "median_token_agreement": 0.75,
                                                "median_loss_gap": 0.125}
    assert metrics["generate"]["recompute_bs8"]["max_realised_speedup"] == pytest.approx(0.45)
    # the generation table: one row per model × rule × policy, batch sizes side by side
    assert "<h2>Generation with early exit</h2>" in page and page.count("<td>top1</td><td>share</td>") == 1
    assert "<td>1.60×</td><td>" in page and "<td>160.0</td>" in page and "<td>0.80×</td>" in page
    assert "policy:native not run on ta-uniform" in page
    # no speculative.parquet (generate.speculative is opt-in): no speed section, and no "Not shown" note for it
    assert "Speed: lossless vs lossy" not in page and "speculative.parquet" not in page
    # this fixture has no loopmap stage outputs: the page says so (and has no loop-map section)
    assert metrics["missing_inputs"] == [*sorted(f"gates/{k}" for k in MODELS), "loopmap/"]
    assert "<h2>Loop map</h2>" not in page and "<code>loopmap/</code>: run the loopmap stage" in page
    saved = json.loads((out / "metrics.json").read_text())
    assert saved["models"]["ta-uniform"]["d95_fixed"] == 3.0
    # ±inf left out of the loop summaries are shown, per model and metric, summed over loops (3 + 1 by construction)
    assert "4 infinite (±∞) values were left out of the loop summaries" in page
    assert "<tr><td>ta-joint</td><td>step_norm</td><td>4</td><td>2, 4</td><td>0</td></tr>" in page
    summary = (out / "summary.md").read_text()
    assert "## Non-finite values" in summary and "| ta-joint | step_norm | 4 | 2, 4 | 0 |" in summary
    # Findings: diagnose's sentences are on the page, rendered from Markdown.
    assert "<td>readout-limited</td>" in page and "<strong>holds</strong>" in page


def test_report_partial_inputs_and_missing_readouts(artifacts, tmp_path):
    import shutil

    for d in ("diagnose", "latency", "gates", "generate"):
        shutil.rmtree(artifacts / d)
    out = tmp_path / "report"
    metrics = build_report(["ta-uniform"], artifacts, out, ReportConfig(dpi=60))
    page = (out / "index.html").read_text()
    assert {Path(s).stem for s in _img_srcs(page)} == {"accuracy_per_loop", "step_geometry", "convergence",
                                                       "pareto_ta"}
    assert all((out / s).is_file() for s in _img_srcs(page))
    assert "run the diagnose stage" in page and "latency/latency.parquet" in page
    assert metrics["latency"] == {} and metrics["generate"] == {}
    assert "generate/generate.parquet" in page and "run the generate stage" in page
    with pytest.raises(FileNotFoundError, match="run the readouts stage for nope"):
        build_report(["nope"], artifacts, tmp_path / "r2", ReportConfig())
    assert not (tmp_path / "r2").exists()  # nothing half-written


def test_latency_findings_numbers():
    rows = [{"model": "m", "rule": r, "batch_size": 1, "n_loops": 6, "mean_exit_depth": d, "realised_speedup": rs,
             "ideal_speedup": 6 / d, "speedup_ratio": rs * d / 6, "ideal_speedup_work": 2.0,
             "ratio_to_work_ideal": rs / 2.0, "exact": True, "exit_mismatches": 0, "correct_mismatches": 0,
             "n_tokens": 10} for r, d, rs in (("a", 2.0, 2.7), ("b", 3.0, 1.0), ("c", 1.5, 2.0))]
    s = latency_findings(pl.DataFrame(rows), None)
    # ratios: 0.9, 0.5, 0.5 -> min 0.50, max 0.90, median 0.50; one run ≥ 0.8
    assert "is 0.50–0.90 (median 0.50); 1 of 3 runs reach ≥ 0.8 × ideal" in s[1]
    assert "Largest realised speedup: 2.70× (m, a, batch 1" in s[2]


def test_generate_findings_numbers():
    rows = [{"model": "m", "rule": r, "policy": "share", "batch_size": 1, "n_loops": 8, "mean_exit_depth": d,
             "realised_speedup": rs, "ideal_speedup": 8 / d, "speedup_ratio": rs * d / 8, "tokens_per_s": 10 * rs,
             "token_agreement": a, "loss_gap": g} for r, d, rs, a, g in (("a", 4.0, 1.8, 0.5, 0.2), ("b", 2.0, 2.0, 0.25, 0.4),
                                                                          ("c", 8.0, 1.0, 1.0, 0.0))]
    s = generate_findings(pl.DataFrame(rows), None)
    # ratios: 0.9, 0.5, 1.0 -> min 0.50, max 1.00, median 0.90; two runs ≥ 0.8; agreement median 50 %; gap 0.2
    assert s[0] == ("KV policy share, batch 1: realised / ideal speedup 0.50–1.00 (median 0.90; 2 of 3 runs ≥ 0.8), "
                    "token agreement with full-depth greedy decoding median 50.0 %, loss gap of the full-depth "
                    "continuation median 0.200 nats/token.")
    assert s[1].startswith("Largest realised generation speedup: 2.00× (m, b, share, batch 1; mean exit depth 2.00 of 8")


def test_markdown_subset():
    """diagnose's summary.md through Python-Markdown: headings shifted, pipe tables, two-space nested bullets nested,
    raw HTML escaped (the text is text), inline code, bold and emphasis."""
    h = markdown_to_html("# T\n\n| a | b |\n|---|---|\n| 1 | <x> |\n\n- one\n  - two\n- three\n\ntext `c` **b** *e*\nmore")
    assert h.splitlines() == [
        "<h2>T</h2>",
        "<table>", "<thead>", "<tr>", "<th>a</th>", "<th>b</th>", "</tr>", "</thead>",
        "<tbody>", "<tr>", "<td>1</td>", "<td>&lt;x&gt;</td>", "</tr>", "</tbody>", "</table>",
        "<ul>", "<li>one<ul>", "<li>two</li>", "</ul>", "</li>", "<li>three</li>", "</ul>",
        "<p>text <code>c</code> <strong>b</strong> <em>e</em>", "more</p>"]


def test_report_stage_cli(artifacts, tmp_path):
    from typer.testing import CliRunner

    from looptrace.cli import app

    params = tmp_path / "params.yaml"
    params.write_text("report:\n  dpi: 60\n  bogus: 1\n")
    res = CliRunner().invoke(app, ["report", "--params", str(params), "--models", "ta-uniform",
                                   "--root", str(artifacts), "--out", str(tmp_path / "r")])
    assert res.exit_code == 2 and "unknown key 'bogus' in params section 'report'" in res.output


def _seeded_outputs(root: Path, model: str, dx_entropy: float, native: float | None) -> None:
    """A seeded model whose tables carry the interval and val columns the readouts stage writes: top1 has the
    lower *test* figures, entropy the lower *val* figures (so a val choice picks entropy)."""
    _model_outputs(root, model, "tc", "uniform", "joint", shift=0.0)
    rd = root / "readouts" / model
    nan = float("nan")
    dx = [("fixed", "fixed", 3.0, 3.0, 3.0, 3.0), ("entropy", "posthoc", dx_entropy, dx_entropy - 0.1, dx_entropy + 0.1, 1.9),
          ("top1", "posthoc", 1.2, 1.1, 1.3, 2.0), ("oracle", "oracle", 1.05, 1.0, 1.1, 1.05),
          ("q_exit", "native", nan if native is None else native, 3.2 if native is None else native - 0.2,
           float("inf") if native is None else native + 0.2, 3.5)]
    _write(rd / "dx.parquet", pl.DataFrame(
        [{"rule": r, "kind": k, "x": 95.0, "d_at": d, "d_at_lo": lo, "d_at_hi": hi, "val_d_at": v, "n_boot": 500,
          "n_sequences": 40} for r, k, d, lo, hi, v in dx]))
    _write(rd / "chosen.parquet", pl.DataFrame({
        "rule": ["fixed", "entropy", "top1"], "kind": ["fixed", "posthoc", "posthoc"], "threshold": [3.0, 1.0, 2.0],
        "val_depth": [3.0, 1.7, 1.9], "val_accuracy": [0.97, 0.96, 0.96], "within_delta": [True] * 3,
        "test_depth": [3.0, 1.8, 1.6], "test_depth_lo": [3.0, 1.7, 1.5], "test_depth_hi": [3.0, 1.9, 1.7],
        "test_accuracy": [0.97, 0.96, 0.95], "test_accuracy_lo": [0.95, 0.94, 0.93],
        "test_accuracy_hi": [0.99, 0.98, 0.97], "n_boot": [500] * 3, "n_sequences": [40] * 3}))
    p = pl.read_parquet(rd / "pareto.parquet")
    o = p["kind"] == "oracle"
    _write(rd / "pareto.parquet", p.with_columns(mean_depth_lo=pl.when(o).then(1.0).otherwise(None),
                                                 mean_depth_hi=pl.when(o).then(1.1).otherwise(None),
                                                 n_boot=pl.lit(500), n_sequences=pl.lit(40)))
    _write(rd / "operating_points.parquet", pl.DataFrame({
        "rule": ["fixed", "fixed"], "kind": ["fixed", "fixed"], "threshold": [4.0, 4.0], "split": ["val", "test"],
        "mean_depth": [4.0, 4.0], "accuracy": [0.985, 0.99], "mean_loss": [0.1, 0.1], "accuracy_lo": [None, 0.98],
        "accuracy_hi": [None, 1.0], "n_boot": [500, 500], "n_sequences": [40, 40]}))


def test_report_intervals_seeds_and_summary(artifacts, tmp_path, monkeypatch):
    models = ["tc-joint-s0", "tc-joint-s1"]
    _seeded_outputs(artifacts, models[0], 1.6, 3.6)
    _seeded_outputs(artifacts, models[1], 1.8, None)  # native gate never reaches 95 % on seed 1
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "0")
    out = tmp_path / "report"
    metrics = build_report(models, artifacts, out, ReportConfig(dpi=50), meta={"versions": {"torch": "9.9", "x": None}})
    m0 = metrics["models"]["tc-joint-s0"]
    # chosen on val: entropy (val depth 1.7 < top1's 1.9; val D@95 1.9 < 2.0) although top1 is lower on test
    assert m0["best_posthoc_rule"] == "entropy" and m0["d95_best_posthoc_rule"] == "entropy"
    iv = m0["intervals"]
    assert iv["dx_best_posthoc"]["text"] == "1.60 [1.50, 1.70]" and iv["dx_fixed"]["text"] == "3.00 [3.00, 3.00]"
    assert iv["best_posthoc_depth"]["text"] == "1.80 [1.70, 1.90]"
    assert iv["best_posthoc_accuracy"]["text"] == "96.00 [94.00, 98.00]"
    assert iv["full_depth_accuracy"]["text"] == "99.00 [98.00, 100.00]"
    assert iv["oracle_depth"]["text"] == "1.05 [1.00, 1.10]"
    assert metrics["models"]["tc-joint-s1"]["intervals"]["dx_native"]["text"] == "not reached"
    assert metrics["models"]["tc-joint-s1"]["d95_native"] is None
    # across seeds: D@95 best post-hoc 1.6, 1.8 -> 1.70 ± t_{0.975, 1} · sd / √2 = 1.70 ± 12.706 · 0.1
    # across seeds: D@95 best post-hoc 1.6, 1.8 in [1, T]: the t-interval (t_{0.975, 1} = 12.706) on the logit
    # scale of (d - 1) / (T - 1), mapped back (the plain 1.70 ± 1.27 would leave [1, T])
    g = metrics["groups"]["tc-joint"]
    z = np.array([math.log(p / (1 - p)) for p in (0.6 / (T - 1), 0.8 / (T - 1))])
    hz = 12.706204736174707 * np.std(z, ddof=1) / np.sqrt(2)
    lo_d, hi_d = (1 + (T - 1) / (1 + math.exp(-(z.mean() + k * hz))) for k in (-1, 1))
    assert g["n_seeds"] == 2 and g["intervals"]["dx_best_posthoc"]["estimate"] == pytest.approx(1.7)
    assert g["intervals"]["dx_best_posthoc"]["lo"] == pytest.approx(lo_d) and 1 <= lo_d < hi_d <= T
    text = f"1.70 [{lo_d:.2f}, {hi_d:.2f}]"
    assert g["intervals"]["dx_best_posthoc"]["text"] == text
    assert g["intervals"]["dx_native"]["text"] == "not reached in 1 of 2 seeds"
    assert g["intervals"]["dx_fixed"]["text"] == "3.00 [3.00, 3.00]"
    summary = (out / "summary.md").read_text()
    assert "Run of 1970-01-01T00:00:00Z on " in summary and "| date | 1970-01-01T00:00:00Z |" in summary
    assert "| torch | 9.9 |" in summary and "| x | not installed |" in summary
    assert "bootstrap over test sequences, 500 resamples of 40 sequences" in summary
    assert "| tc-joint | joint | 2 | entropy | 99.00 [" in summary and text in summary
    assert "| tc-joint-s1 | joint | entropy |" in summary
    assert "findings must hold within the intervals" in summary
    assert not re.search(r"\b(None|nan|inf)\b", summary)
    page = (out / "index.html").read_text()
    assert text in page and "not reached in 1 of 2 seeds" in page and "Headline per task × regime" in page
    assert not re.search(r"\b(None|nan|inf)\b", re.sub(r"<[^>]+>", " ", page))
