"""DVC stage ``train``: train one looped model (task × regime × seed) -> artifacts/train/<task>-<regime>[-s<seed>]/."""

from __future__ import annotations

from pathlib import Path

import typer

from looptrace.config import PARAMS_HELP, ConfigError, load_base, load_section
from looptrace.errors import user_errors
from looptrace.io.claims import stage_output
from looptrace.models import check_device
from looptrace.models.train import TrainConfig, train_model
from looptrace.project import model_name
from looptrace.stages import register_stage


@register_stage("train", 10, config=TrainConfig, library="looptrace.models.train", help_blocks=("tasks", "regimes", "models"))
def main(
    task: str = typer.Option(..., help="task name (a key of train.task_defs)"),
    regime: str = typer.Option(..., help="regime name (a key of train.regime_defs)"),
    seed: int | None = typer.Option(None, help="training seed (one of train.seeds); none = base.seed, unsuffixed name"),
    params: list[Path] = typer.Option([Path("params.yaml")], help=PARAMS_HELP),
    out: Path = typer.Option(Path("artifacts/train"), help="output root"),
) -> None:
    """Train one looped model under a depth-supervision regime."""
    with user_errors():
        base = load_base(params)
        cfg = load_section(TrainConfig, "train", params, required=True)
        check_device(base.device)
        cfg.task(task), cfg.regime(regime)
        if seed is not None and cfg.seeds and seed not in cfg.seeds:
            raise ConfigError(f"--seed {seed} is not in train.seeds {list(cfg.seeds)}: add it there or pick one of them")
        # One writer per output (a live run is named; a killed run's claim and staging debris are taken over).
        with stage_output(out / model_name(task, regime, seed), stage="train", out_root=out):
            # One model per DVC stage: DVC runs stages one at a time, so each uses base.threads (docs/train.md "Seeds").
            metrics = train_model(base, cfg, task, regime, out / model_name(task, regime, seed), seed=seed)
    acc = " ".join(f"{a:.3f}" for a in metrics["val"]["acc_per_loop"])
    typer.echo(f"{metrics['model']}: val accuracy per loop {acc} ({metrics['train_seconds']:.0f} s)")

