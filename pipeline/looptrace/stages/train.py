"""DVC stage ``train``: train the looped models of the matrix (``train.tasks`` × ``train.regimes`` × ``train.seeds``,
or one task × regime × seed) -> artifacts/train/<task>-<regime>[-s<seed>]/."""

from __future__ import annotations

import contextlib
from pathlib import Path

import typer

from looptrace.config import PARAMS_HELP, ConfigError, load_base, load_section
from looptrace.errors import user_errors
from looptrace.io.claims import stage_output
from looptrace.models import check_device
from looptrace.models.train import TrainConfig, train_models
from looptrace.project import model_name
from looptrace.stages import register_stage


@register_stage("train", 10, config=TrainConfig, library="looptrace.models.train", help_blocks=("tasks", "regimes", "models"))
def main(
    task: str | None = typer.Option(None, help="task name (a key of train.task_defs); with --regime: that one model "
                                               "only (default: every model of the matrix)"),
    regime: str | None = typer.Option(None, help="regime name (a key of train.regime_defs); with --task"),
    seed: int | None = typer.Option(None, help="training seed of --task/--regime (one of train.seeds); none = base.seed, "
                                              "unsuffixed name"),
    params: list[Path] = typer.Option([Path("params.yaml")], help=PARAMS_HELP),
    out: Path = typer.Option(Path("artifacts/train"), help="output root"),
) -> None:
    """Train looped models under depth-supervision regimes: every model of the matrix, train.workers at a time."""
    with user_errors():
        base = load_base(params)
        cfg = load_section(TrainConfig, "train", params, required=True)
        check_device(base.device)
        if (task is None) != (regime is None) or (seed is not None and task is None):
            raise ConfigError("give --task and --regime (and optionally --seed) for one model, or none of them for "
                              "every model of train.tasks x train.regimes x train.seeds")
        if task is not None and regime is not None:
            if seed is not None and cfg.seeds and seed not in cfg.seeds:
                raise ConfigError(f"--seed {seed} is not in train.seeds {list(cfg.seeds)}: add it there or pick one "
                                  "of them")
            models = [(task, regime, seed)]
        else:
            models = cfg.matrix()
        for t, r, _ in models:
            cfg.task(t), cfg.regime(r)
        # One writer per output (a live run is named; a killed run's claim and staging debris are taken over),
        # held here for every model while the pool's workers write them.
        with contextlib.ExitStack() as held:
            for t, r, s in models:
                held.enter_context(stage_output(out / model_name(t, r, s), stage="train", out_root=out))
            train_models(base, cfg, models, out, echo=typer.echo)
