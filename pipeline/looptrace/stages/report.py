"""DVC stage ``report``: figures, headline tables and findings -> artifacts/report/{index.html, summary.md, figures/}."""

from __future__ import annotations

from pathlib import Path

import typer

from looptrace.config import PARAMS_HELP, load_base, load_section, require_in, to_dict
from looptrace.errors import user_errors
from looptrace.geometry.stage import GeometryConfig
from looptrace.io.claims import stage_output
from looptrace.io.guard import report_inputs
from looptrace.project import model_names, versions
from looptrace.report import ReportConfig, build_report
from looptrace.rules.scoring import CalibrationConfig
from looptrace.stages import register_stage


@register_stage("report", 100, config=ReportConfig, library="looptrace.report", help_blocks=("models",))
def main(
    params: list[Path] = typer.Option([Path("params.yaml")], help=PARAMS_HELP),
    models: str = typer.Option("", help="comma-separated model names; default: train.tasks × train.regimes"),
    root: Path = typer.Option(Path("artifacts"), help="artifacts root the other stages wrote"),
    out: Path = typer.Option(Path("artifacts/report"), help="output directory"),
) -> None:
    """Render the run's figures and an offline HTML report with headline numbers and findings."""
    with user_errors():
        base = load_base(params)
        cfg = load_section(ReportConfig, "report", params, required=True)
        # The headline tables and the convergence figure read what readouts and geometry computed: only those keys.
        cal = load_section(CalibrationConfig, "calibration", params)
        geo = load_section(GeometryConfig, "geometry", params)
        require_in("report.x", cfg.x, "calibration.dx", cal.dx)
        require_in("report.split", cfg.split, "geometry.splits", geo.splits)
        require_in("report.convergence_signal", cfg.convergence_signal, "geometry.eps", list(geo.eps))
        require_in("report.convergence_eps", cfg.convergence_eps, f"geometry.eps.{cfg.convergence_signal}",
                   geo.eps[cfg.convergence_signal])
        # One writer per output (a live run is named; a killed run's claim and staging debris are taken over).
        with stage_output(out, stage="report", inputs=report_inputs(root)):
            names = model_names(params, models)
            metrics = build_report(names, root, out, cfg,
                                   meta={"seed": base.seed, "params": to_dict(cfg), "versions": versions()})
    typer.echo(f"report: {metrics['n_figures']} figures -> {out / 'index.html'}; headline tables -> "
               f"{out / 'summary.md'}")
    for group, g in metrics["groups"].items():
        dx = g["intervals"]["dx_best_posthoc"]["text"]
        typer.echo(f"{group} ({g['n_seeds']} seed{'s' if g['n_seeds'] != 1 else ''}): D@{metrics['x']:g} best "
                   f"post-hoc {dx}; verdict {g['verdict'] or 'not diagnosed'}")
    for k in metrics["missing_inputs"]:
        typer.echo(f"report: not shown: {k}")

