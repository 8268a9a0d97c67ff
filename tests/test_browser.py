"""The report page in a real browser (headless Chromium from the machine's package manager).

A tiny report (hand-built artifacts: 2 tasks × 2 regimes × 2 seeds, tests/test_report.py's builders) is opened at
1300 px: every figure must load, every interactive view must be drawn by Plotly, nothing may be wider than the
window, and the console must show no error. A screenshot of the first screen is written to
``artifacts/report/screenshot.png``. Chromium is found as ``chromium`` / ``chromium-browser`` / ``google-chrome``
(``make test`` and .ci/run install it with apt where apt works); without it the test is skipped, saying so.
"""

from __future__ import annotations

import html
import json
import re
import shutil
import subprocess
from pathlib import Path

import polars as pl
import pytest

from looptrace.report import build_report
from looptrace.report.inputs import ReportConfig
from tests.test_report import _model_outputs, _write

pytestmark = pytest.mark.slow

#: The window the page must fit (a laptop at 1300 px).
WIDTH = 1300
CHROMIUM = next((p for p in (shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome")) if p), None)

#: Injected first into <head> of a copy of the page: records errors (uncaught, console.error, failed resources)
#: and, after load, what the test checks, as JSON in <body data-check>.
PROBE = """<script>
window.__errors = [];
window.addEventListener('error', function (e) {
  var t = e.target || {};
  window.__errors.push('error: ' + (e.message || ('failed to load ' + (t.src || t.href || t.tagName))));
}, true);
var __ce = console.error;
console.error = function () { window.__errors.push('console.error: ' + [].join.call(arguments, ' '));
                              __ce.apply(console, arguments); };
window.addEventListener('load', function () { setTimeout(function () {
  var imgs = [].slice.call(document.images);
  var live = [].slice.call(document.querySelectorAll('.plotly-graph-div'));
  var wide = [].slice.call(document.querySelectorAll('body *')).filter(function (e) {
    return e.getBoundingClientRect().right > WIDTH + 1; }).map(function (e) { return e.tagName + '.' + e.className; });
  document.body.setAttribute('data-check', JSON.stringify({
    scrollWidth: document.documentElement.scrollWidth, images: imgs.length,
    badImages: imgs.filter(function (i) { return !(i.complete && i.naturalWidth > 0); }).map(function (i) { return i.src; }),
    imageWidths: imgs.map(function (i) { return i.getBoundingClientRect().width; }),
    live: live.length, drawn: live.filter(function (d) { return d.querySelector('svg.main-svg'); }).length,
    wide: wide.slice(0, 10), errors: window.__errors}));
}, 300); });
</script>""".replace("WIDTH", str(WIDTH))


def _chromium(*args: str, timeout: int = 180) -> subprocess.CompletedProcess:
    assert CHROMIUM is not None
    return subprocess.run([CHROMIUM, "--headless=new", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                           "--no-first-run", "--disable-extensions", f"--window-size={WIDTH},1100", *args],
                          capture_output=True, text=True, timeout=timeout)


def tiny_report(tmp_path: Path) -> Path:
    """A report of hand-built artifacts with every figure kind the page shows; returns artifacts/report."""
    arts = tmp_path / "artifacts"
    models = []
    for task in ("ta", "tb"):
        for regime in ("uniform", "joint"):
            for s in range(2):
                m = f"{task}-{regime}-s{s}"
                _model_outputs(arts, m, task, regime, regime, shift=0.03 * s)
                models.append(m)
    fails = [{"model": m, "source": "readouts", "rule": r, "group": "all", "difficulty": None, "n_tokens": 100,
              "frac_correct": 0.9, "frac_trajectory": 0.05, "frac_readout_early": 0.03,
              "frac_readout_overthinking": 0.02} for m in models for r in ("fixed", "entropy")]
    _write(arts / "diagnose" / "failure_classes.parquet", pl.DataFrame(fails))
    (arts / "diagnose" / "summary.md").write_text("# Diagnosis\n\n- a finding\n")
    out = arts / "report"
    build_report(models, arts, out, ReportConfig())
    return out


@pytest.mark.skipif(CHROMIUM is None, reason="headless Chromium not found (chromium / chromium-browser / "
                                             "google-chrome): install it with `apt-get install -y chromium` "
                                             "(make test and .ci/run do, where apt works)")
def test_report_page_in_headless_chromium(tmp_path):
    report = tiny_report(tmp_path)
    page = (report / "index.html").read_text()
    assert "<script src='plotly.min.js'></script>" in page and (report / "plotly.min.js").exists()
    probe = report / "index.check.html"  # beside the page, so its relative paths resolve the same way
    probe.write_text(page.replace("<head>", "<head>" + PROBE, 1))
    res = _chromium("--virtual-time-budget=20000", "--dump-dom", probe.as_uri())
    probe.unlink()
    m = re.search(r'data-check="([^"]*)"', res.stdout)
    assert m, f"the page never finished loading:\n{res.stdout[-2000:]}\n{res.stderr[-2000:]}"
    check = json.loads(html.unescape(m.group(1)))
    n_png = len(list((report / "figures").glob("*.png")))
    assert check["images"] == n_png >= 5 and check["badImages"] == []  # every figure loads
    assert all(0 < w <= WIDTH for w in check["imageWidths"])
    assert check["live"] == 2 and check["drawn"] == 2  # one interactive Pareto view per task, drawn by Plotly
    assert check["scrollWidth"] <= WIDTH and check["wide"] == [], check  # nothing overflows the window
    assert check["errors"] == []  # the console shows no error
    shot = report / "screenshot.png"
    res = _chromium(f"--screenshot={shot}", (report / "index.html").as_uri())
    assert shot.exists(), res.stderr[-2000:]
    assert shot.read_bytes()[16:20] == WIDTH.to_bytes(4, "big")  # the first screen at 1300 px
