"""DVC stage ``readouts``: every exit rule of SPEC §4 on one model -> artifacts/readouts/<model>/."""

from __future__ import annotations

from pathlib import Path

import typer

from stages._common import run, user_errors


def main(
    model: str = typer.Option(..., help="model name <task>-<regime> (artifacts/geometry/<model>)"),
    params: Path = typer.Option(Path("params.yaml"), help="params file"),
    geometry_root: Path = typer.Option(Path("artifacts/geometry"), help="root of the geometry stage's outputs"),
    out: Path = typer.Option(Path("artifacts/readouts"), help="output root"),
) -> None:
    """Calibrated exit rules: operating points, Pareto fronts, D@X and chosen points of one model."""
    from pipeline.config import load_base, load_section, read_params, to_dict
    from pipeline.readouts import ReadoutsConfig, light_versions, readouts_model, resolve_model

    with user_errors():
        base = load_base(params)
        cfg = load_section(ReadoutsConfig, "readouts", params)
        # train's task/regime definitions name the model's regime; read raw so that this offline stage
        # does not import torch (pipeline.train) just for them.
        train = read_params(params).get("train") or {}
        meta = {**resolve_model(model, train.get("task_defs") or {}, train.get("regime_defs") or {}),
                "seed": base.seed, "params": to_dict(cfg), "versions": light_versions()}
        metrics = readouts_model(geometry_root / model, cfg, out / model, meta=meta)
    best = metrics["best_posthoc"]
    fixed = metrics["rules"]["fixed"]["d_at"] if "fixed" in metrics["rules"] else {}
    x = str(int(best["x"]) if float(best["x"]).is_integer() else best["x"])
    typer.echo(f"{model}: full-depth test accuracy {metrics['full_depth_accuracy']['test']:.3f}; "
               f"D@{x} best post-hoc {best['rule']} = {best['d_at']}, fixed = {fixed.get(x)}")


if __name__ == "__main__":
    run(main)
