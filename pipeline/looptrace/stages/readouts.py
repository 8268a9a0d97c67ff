"""DVC stage ``readouts``: every exit rule of SPEC §4 on every model (or ``--model``) -> artifacts/readouts/<model>/."""

from __future__ import annotations

import functools
from pathlib import Path

import typer

from looptrace.config import PARAMS_HELP, load_base, load_section, to_dict
from looptrace.errors import user_errors
from looptrace.intervals import IntervalsConfig
from looptrace.io.claims import stage_output
from looptrace.io.parallel import dask_runner, model_workers, per_model, scheduler_of
from looptrace.project import model_meta, model_names, versions
from looptrace.rules.readouts import ReadoutsConfig, readouts_model
from looptrace.rules.scoring import CalibrationConfig
from looptrace.stages import register_stage


def readouts_one(model: str, params: list[Path], geometry_root: Path, out: Path) -> str:
    """One model's exit rules -> ``<out>/<model>/``; returns the line that reports it."""
    base = load_base(params)
    cfg = load_section(ReadoutsConfig, "readouts", params, required=True)
    cal = load_section(CalibrationConfig, "calibration", params)
    ivc = load_section(IntervalsConfig, "intervals", params)
    # One writer per output (a live run is named; a killed run's claim and staging debris are taken over).
    with stage_output(out / model, stage="readouts", inputs={"--geometry-root": geometry_root}, out_root=out):
        meta = {**model_meta(model, params), "seed": base.seed,
                "params": {"readouts": to_dict(cfg), "calibration": to_dict(cal), "intervals": to_dict(ivc)},
                "versions": versions()}
        with dask_runner(base.dask) as runner:
            metrics = readouts_model(geometry_root / model, cfg, cal, out / model, meta=meta, runner=runner,
                                     intervals=ivc, seed=base.seed)
    best = metrics["best_posthoc"]
    fixed = (metrics["rules"].get("fixed") or {}).get("chosen")
    line = f"{model}: full-depth test accuracy {metrics['full_depth_accuracy']['test']:.3f}"
    if best:
        line += (f"; best post-hoc (chosen on val) {best['rule']}: test depth {best['test_depth']['text']}, "
                 f"accuracy {best['test_accuracy']['text']}")
    if fixed:
        line += f"; fixed depth {fixed['test_depth']['text']}"
    return line


@register_stage("readouts", 50, config=ReadoutsConfig, library="looptrace.rules.readouts", help_blocks=("models", "rules"))
def main(
    model: str | None = typer.Option(None, help="one model <task>-<regime>[-s<seed>] (artifacts/geometry/<model>); "
                                                "default: every model of the matrix, one per core at a time"),
    params: list[Path] = typer.Option([Path("params.yaml")], help=PARAMS_HELP),
    geometry_root: Path = typer.Option(Path("artifacts/geometry"), help="root of the geometry stage's outputs"),
    out: Path = typer.Option(Path("artifacts/readouts"), help="output root"),
) -> None:
    """Calibrated exit rules: operating points, Pareto fronts, D@X and chosen points of every model."""
    with user_errors():
        base = load_base(params)
        # a bad section: one line, before any model
        load_section(ReadoutsConfig, "readouts", params, required=True)
        load_section(CalibrationConfig, "calibration", params)
        load_section(IntervalsConfig, "intervals", params)
        models = [model] if model else model_names(params)
        workers = model_workers(len(models), scheduler=scheduler_of(base.dask))
        per_model(functools.partial(readouts_one, params=params, geometry_root=geometry_root, out=out), models,
                  workers, "readouts", typer.echo)
