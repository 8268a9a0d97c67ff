"""DVC stage ``diagnose``: failure classes, Spearman, verdicts and [AD]'s claims -> artifacts/diagnose/."""

from __future__ import annotations

from pathlib import Path

import typer

from looptrace.config import PARAMS_HELP, load_base, load_section, require_in, to_dict
from looptrace.diagnose.config import DiagnoseConfig
from looptrace.diagnose.halting_findings import findings_markdown, halting_findings, model_figures
from looptrace.diagnose.halting_table import halting_table, halting_table_markdown
from looptrace.diagnose.stage import diagnose_models, write_diagnosis
from looptrace.errors import user_errors
from looptrace.intervals import IntervalsConfig
from looptrace.io.claims import stage_output
from looptrace.io.parallel import dask_runner
from looptrace.loopmap.diagnose_rows import loopmap_artifacts, loopmap_models
from looptrace.project import model_names, versions
from looptrace.rules.scoring import CalibrationConfig
from looptrace.stages import register_stage


@register_stage("diagnose", 70, config=DiagnoseConfig, library="looptrace.diagnose.stage", help_blocks=("models",))
def main(
    params: list[Path] = typer.Option([Path("params.yaml")], help=PARAMS_HELP),
    models: str = typer.Option("", help="comma-separated model names; default: train.tasks × train.regimes"),
    readouts_root: Path = typer.Option(Path("artifacts/readouts"), help="root of the readouts stage's outputs"),
    gates_root: Path = typer.Option(Path("artifacts/gates"), help="root of the gates stage's outputs (optional)"),
    geometry_root: Path = typer.Option(Path("artifacts/geometry"), help="root of the geometry stage's outputs"),
    dump_root: Path = typer.Option(Path("artifacts/dump"), help="root of the dump stage's stores (loop-map "
                                   "diagnoses of test stores dumped with dump.contraction)"),
    loopmap_root: Path = typer.Option(Path("artifacts/loopmap"), help="root of the loopmap stage's outputs (loop-map "
                                      "diagnoses on a fixed sample of every model)"),
    out: Path = typer.Option(Path("artifacts/diagnose"), help="output directory"),
) -> None:
    """Trajectory vs readout failures per model × rule, and whether [AD]'s findings hold."""
    with user_errors():
        base = load_base(params)
        cfg = load_section(DiagnoseConfig, "diagnose", params, required=True)
        # The claims are tested at D@x, which exists only if readouts and gates computed it.
        ivc = load_section(IntervalsConfig, "intervals", params)
        require_in("diagnose.x", cfg.x, "calibration.dx", load_section(CalibrationConfig, "calibration", params).dx)
        # One writer per output (a live run is named; a killed run's claim and staging debris are taken over).
        with stage_output(out, stage="diagnose", inputs={"--readouts-root": readouts_root, "--gates-root": gates_root,
                                                       "--geometry-root": geometry_root,
                                                       "--dump-root": dump_root, "--loopmap-root": loopmap_root}):
            names = model_names(params, models)
            meta = {"seed": base.seed, "params": {**to_dict(cfg), "intervals": to_dict(ivc)}, "versions": versions(),
                    "models_list": names}
            with dask_runner(base.dask) as runner:
                frames, summary, metrics = diagnose_models(names, readouts_root, gates_root, geometry_root, cfg, meta=meta,
                                                           runner=runner, intervals=ivc, seed=base.seed)
            if cfg.halting_table:  # the halting methods at matched compute (profiles/halting)
                table = halting_table(names, readouts_root, gates_root, cfg.collapse_tol, ivc.level)
                frames = {**frames, "halting_table": table}
                summary += "\n" + halting_table_markdown(table, cfg.collapse_tol)
                # item 6's findings in words, from these numbers (SPEC §7 "Halting findings")
                figs, fronts = model_figures(names, readouts_root, geometry_root, frames["verdicts"], cfg)
                found = halting_findings(figs, fronts, table, frames["convergence_router"], cfg, ivc.level)
                summary += "\n" + findings_markdown(found, cfg)
                metrics = {**metrics, "halting_findings": found}
            # only models dumped with dump.contraction; none (the default) -> nothing written
            loopmap, loopmap_words = loopmap_models(names, dump_root, base.seed)
            if loopmap is None:  # the default: the loopmap stage's fixed sample of every model
                loopmap, loopmap_words = loopmap_artifacts(names, loopmap_root)
            if loopmap is not None:
                frames = {**frames, "loopmap": loopmap}
                summary += loopmap_words
            write_diagnosis(out, frames, summary, metrics)
    for name, status in metrics["claims"].items():
        typer.echo(f"[AD] claim ({name}): {status}")
    for name, m in metrics["models"].items():
        typer.echo(f"{name}: {m['verdict']} ({m['reason']})")
    for name, g in metrics["groups"].items():
        typer.echo(f"{name} ({g['n_seeds']} seed{'s' if g['n_seeds'] != 1 else ''}): {g['verdict']} ({g['reason']}); "
                   f"per seed: {g['seed_verdicts']}")

