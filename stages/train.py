"""DVC stage ``train``: train one looped model (task × regime) -> artifacts/train/<task>-<regime>/."""

from __future__ import annotations

from pathlib import Path

import typer
from looptrace.config import PARAMS_HELP, load_base, load_section
from looptrace.errors import run, user_errors
from looptrace.models.train import TrainConfig, train_model
from looptrace.project import model_name


def main(
    task: str = typer.Option(..., help="task name (a key of train.task_defs)"),
    regime: str = typer.Option(..., help="regime name (a key of train.regime_defs)"),
    params: list[Path] = typer.Option([Path("params.yaml")], help=PARAMS_HELP),
    out: Path = typer.Option(Path("artifacts/train"), help="output root"),
) -> None:
    """Train one looped model under a depth-supervision regime."""
    with user_errors():
        base = load_base(params)
        cfg = load_section(TrainConfig, "train", params)
        cfg.task(task), cfg.regime(regime)
        metrics = train_model(base, cfg, task, regime, out / model_name(task, regime))
    acc = " ".join(f"{a:.3f}" for a in metrics["val"]["acc_per_loop"])
    typer.echo(f"{metrics['model']}: val accuracy per loop {acc} ({metrics['train_seconds']:.0f} s)")


if __name__ == "__main__":
    run(main)
