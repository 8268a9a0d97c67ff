"""DVC stage ``report``: figures, headline tables and findings -> artifacts/report/{index.html, figures/}."""

from __future__ import annotations

from pathlib import Path

import typer

from stages._common import run, user_errors


def main(
    params: Path = typer.Option(Path("params.yaml"), help="params file"),
    models: str = typer.Option("", help="comma-separated model names; default: train.tasks × train.regimes"),
    root: Path = typer.Option(Path("artifacts"), help="artifacts root the other stages wrote"),
    out: Path = typer.Option(Path("artifacts/report"), help="output directory"),
) -> None:
    """Render the run's figures and an offline HTML report with headline numbers and findings."""
    from pipeline.config import ConfigError, load_base, load_section, read_params, to_dict
    from pipeline.readouts import light_versions
    from pipeline.report import ReportConfig, build_report

    with user_errors():
        base = load_base(params)
        cfg = load_section(ReportConfig, "report", params)
        if models:
            names = [m.strip() for m in models.split(",") if m.strip()]
        else:
            train = read_params(params).get("train") or {}
            names = [f"{t}-{r}" for t in train.get("tasks") or [] for r in train.get("regimes") or []]
            if not names:
                raise ConfigError("params section 'train' lists no tasks × regimes; pass --models")
        metrics = build_report(names, root, out, cfg,
                               meta={"seed": base.seed, "params": to_dict(cfg), "versions": light_versions()})
    typer.echo(f"report: {metrics['n_figures']} figures -> {out / 'index.html'}")
    for k in metrics["missing_inputs"]:
        typer.echo(f"report: not shown: {k}")


if __name__ == "__main__":
    run(main)
