"""DVC stage ``report``: figures, headline tables and findings -> artifacts/report/{index.html, summary.md, figures/}."""

from __future__ import annotations

from pathlib import Path

import typer
from looptrace.config import PARAMS_HELP, load_base, load_section, to_dict
from looptrace.errors import run, user_errors
from looptrace.project import model_names, versions
from looptrace.report import ReportConfig, build_report


def main(
    params: list[Path] = typer.Option([Path("params.yaml")], help=PARAMS_HELP),
    models: str = typer.Option("", help="comma-separated model names; default: train.tasks × train.regimes"),
    root: Path = typer.Option(Path("artifacts"), help="artifacts root the other stages wrote"),
    out: Path = typer.Option(Path("artifacts/report"), help="output directory"),
) -> None:
    """Render the run's figures and an offline HTML report with headline numbers and findings."""
    with user_errors():
        base = load_base(params)
        cfg = load_section(ReportConfig, "report", params)
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


if __name__ == "__main__":
    run(main)
