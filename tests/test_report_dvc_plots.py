"""The report's data series are DVC plots (dvc.yaml's top-level ``plots``), so ``dvc plots diff``
overlays two runs; the headline numbers are a metrics file ``dvc metrics show`` / ``dvc exp show`` list.

A tiny git + DVC project is built from the repository's own dvc.yaml and template; the two "runs" are two
reports of hand-built artifacts (tests/test_report.py's builders) that differ in one model's accuracy, one
committed, one in the workspace."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from looptrace.report import build_report
from looptrace.report.inputs import ReportConfig
from tests.test_report import _model_outputs

REPO = Path(__file__).resolve().parents[1]
DVC = REPO / ".venv" / "bin" / "dvc"

pytestmark = pytest.mark.skipif(not DVC.exists() or shutil.which("git") is None,
                                reason="needs the project's .venv with dvc, and git")


def _run(args: list[str], cwd: Path) -> str:
    env = {**os.environ, "DVC_NO_ANALYTICS": "1", "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t",
           "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}
    res = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, f"{' '.join(args)} failed:\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
    return res.stdout


def _report(project: Path, shift: float) -> None:
    arts = project / "artifacts"
    shutil.rmtree(arts / "readouts", ignore_errors=True)
    shutil.rmtree(arts / "geometry", ignore_errors=True)
    models = []
    for regime in ("uniform", "joint"):
        for s in range(2):
            m = f"ta-{regime}-s{s}"
            _model_outputs(arts, m, "ta", regime, regime, shift=shift + 0.02 * s)
            models.append(m)
    build_report(models, arts, arts / "report", ReportConfig(dpi=50))


def test_dvc_plots_diff_overlays_two_runs(tmp_path):
    project = tmp_path / "p"
    (project / "pipeline" / "looptrace" / "report").mkdir(parents=True)
    shutil.copytree(REPO / "pipeline" / "looptrace" / "report" / "dvc_templates",
                    project / "pipeline" / "looptrace" / "report" / "dvc_templates")
    shutil.copy(REPO / "dvc.yaml", project / "dvc.yaml")
    shutil.copy(REPO / "params.yaml", project / "params.yaml")  # dvc.yaml's matrices read it
    _run(["git", "init", "-q"], project)
    _run([str(DVC), "init", "-q"], project)
    _report(project, 0.0)
    _run(["git", "add", "-A", "-f", "."], project)
    _run(["git", "commit", "-q", "-m", "run A"], project)
    _report(project, 0.2)  # run B: the first loop's accuracy moves by 0.2
    out = json.loads(_run([str(DVC), "plots", "diff", "HEAD", "--json", "--targets", "accuracy_per_loop", "pareto"],
                          project))
    data = out.get("data", out)
    for name in ("accuracy_per_loop", "pareto"):
        (plot,) = data[name]
        assert plot["type"] == "vega" and set(plot["revisions"]) == {"HEAD", "workspace"}
        values = plot["content"]["data"]["values"]
        assert {v["rev"] for v in values} == {"HEAD", "workspace"}  # both runs in one overlaid spec
        assert plot["content"]["spec"]["encoding"]["strokeDash"]["field"] == "rev"  # one dash per run
    acc = {(v["rev"], v["curve"], v["loop"]): v["accuracy"] for v in data["accuracy_per_loop"][0]["content"]["data"]
           ["values"]}
    # loop 1 of uniform: mean over seeds of 100 · (0.6 + shift + 0.02 s), s = 0, 1: 61 % in run A, 81 % in run B
    assert acc[("HEAD", "uniform", 1)] == pytest.approx(61.0) and acc[("workspace", "uniform", 1)] == pytest.approx(81.0)
    _run([str(DVC), "plots", "diff", "HEAD", "--targets", "pareto", "-o", str(tmp_path / "plots")], project)
    assert "vega" in (tmp_path / "plots" / "index.html").read_text()
    # the headline numbers: a DVC metrics file of the report stage
    metrics = json.loads(_run([str(DVC), "metrics", "show", "--json"], project))
    flat = json.dumps(metrics)
    assert "headline.json" in flat and "full_depth_accuracy" in flat
    exp = json.loads(_run([str(DVC), "exp", "show", "--json"], project))
    row = next(e for e in exp if e.get("rev") == "workspace")
    shown = row["data"]["metrics"]["artifacts/report/headline.json"]["data"]
    assert shown["ta-uniform"]["best_posthoc_depth"] == pytest.approx(1.8)  # dvc exp show lists the headline
    h = json.loads((project / "artifacts" / "report" / "headline.json").read_text())
    assert h["ta-uniform"]["n_seeds"] == 2 and h["ta-uniform"]["full_depth_accuracy"] == pytest.approx(99.0)
