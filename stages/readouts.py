"""DVC stage ``readouts``: every exit rule of SPEC §4 on one model -> artifacts/readouts/<model>/."""

from __future__ import annotations

from pathlib import Path

import typer
from looptrace.config import PARAMS_HELP, load_base, load_section, to_dict
from looptrace.errors import run, user_errors
from looptrace.io.parallel import dask_runner
from looptrace.project import model_meta, versions
from looptrace.rules.evaluate import ReadoutsConfig, readouts_model
from looptrace.rules.scoring import CalibrationConfig


def main(
    model: str = typer.Option(..., help="model name <task>-<regime> (artifacts/geometry/<model>)"),
    params: list[Path] = typer.Option([Path("params.yaml")], help=PARAMS_HELP),
    geometry_root: Path = typer.Option(Path("artifacts/geometry"), help="root of the geometry stage's outputs"),
    out: Path = typer.Option(Path("artifacts/readouts"), help="output root"),
) -> None:
    """Calibrated exit rules: operating points, Pareto fronts, D@X and chosen points of one model."""
    with user_errors():
        base = load_base(params)
        cfg = load_section(ReadoutsConfig, "readouts", params)
        cal = load_section(CalibrationConfig, "calibration", params)
        meta = {**model_meta(model, params), "seed": base.seed,
                "params": {"readouts": to_dict(cfg), "calibration": to_dict(cal)}, "versions": versions()}
        with dask_runner(base.dask) as runner:
            metrics = readouts_model(geometry_root / model, cfg, cal, out / model, meta=meta, runner=runner)
    best = metrics["best_posthoc"]
    fixed = metrics["rules"]["fixed"]["d_at"] if "fixed" in metrics["rules"] else {}
    x = str(int(best["x"]) if float(best["x"]).is_integer() else best["x"])
    typer.echo(f"{model}: full-depth test accuracy {metrics['full_depth_accuracy']['test']:.3f}; "
               f"D@{x} best post-hoc {best['rule']} = {best['d_at']}, fixed = {fixed.get(x)}")


if __name__ == "__main__":
    run(main)
