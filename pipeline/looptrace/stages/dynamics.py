"""DVC stage ``dynamics``: loop geometry across training checkpoints ([TS]) -> artifacts/dynamics/<model>/."""

from __future__ import annotations

from pathlib import Path

import polars as pl
import torch
import typer

from looptrace.capture.dump import DumpConfig
from looptrace.capture.dynamics import DYNAMICS_SCHEMA, DynamicsConfig, dynamics_metrics, training_dynamics
from looptrace.config import PARAMS_HELP, load_base, load_section, to_dict
from looptrace.errors import user_errors
from looptrace.io.artifacts import write_outputs
from looptrace.io.claims import stage_output
from looptrace.models import check_device
from looptrace.project import versions
from looptrace.stages import register_stage


@register_stage("dynamics", 30, config=DynamicsConfig, library="looptrace.capture.dynamics", help_blocks=("models",))
def main(
    model: str = typer.Option(..., help="model name <task>-<regime> (artifacts/train/<model>)"),
    params: list[Path] = typer.Option([Path("params.yaml")], help=PARAMS_HELP),
    train_root: Path = typer.Option(Path("artifacts/train"), help="root of the train stage's checkpoints"),
    out: Path = typer.Option(Path("artifacts/dynamics"), help="output root"),
) -> None:
    """Run a fixed probe set through every kept checkpoint: step norms, relative step, cosine, accuracy."""
    with user_errors():
        base = load_base(params)
        cfg = load_section(DynamicsConfig, "dynamics", params, required=True)
        dump_cfg = load_section(DumpConfig, "dump", params)
        # One writer per output (a live run is named; a killed run's claim and staging debris are taken over).
        with stage_output(out / model, stage="dynamics", inputs={"--train-root": train_root}, out_root=out):
            torch.set_num_threads(base.threads)
            df = (training_dynamics(train_root / model, cfg, dump_cfg, check_device(base.device)) if cfg.enabled
                  else pl.DataFrame(schema=DYNAMICS_SCHEMA))
            metrics = {"model": model, "seed": base.seed, "params": to_dict(cfg), "versions": versions(),
                       "training_dynamics": dynamics_metrics(df) if df.height else None}
            write_outputs(out / model, {"training_dynamics": df}, metrics)
    typer.echo(f"{model}: training dynamics over {df['checkpoint'].n_unique() if df.height else 0} checkpoints")

