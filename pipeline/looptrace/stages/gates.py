"""DVC stage ``gates``: halting gates refit on frozen trajectories (SPEC §6) -> artifacts/gates/."""

from __future__ import annotations

from pathlib import Path

import typer

from looptrace.config import PARAMS_HELP, load_base, load_section, to_dict
from looptrace.errors import user_errors
from looptrace.gates.config import SPLITS, GatesConfig
from looptrace.gates.stage import gates_stage
from looptrace.intervals import IntervalsConfig
from looptrace.io.claims import stage_output
from looptrace.io.parallel import dask_runner
from looptrace.io.store.format import check_split_formats
from looptrace.io.store.identity import open_split_stores
from looptrace.project import model_meta, model_names, versions
from looptrace.rules.scoring import CalibrationConfig
from looptrace.stages import register_stage


@register_stage("gates", 60, config=GatesConfig, library="looptrace.gates.stage", help_blocks=("models",))
def main(
    params: list[Path] = typer.Option([Path("params.yaml")], help=PARAMS_HELP),
    models: str = typer.Option("", help="comma-separated model names; default: train.tasks × train.regimes"),
    dump_root: Path = typer.Option(Path("artifacts/dump"), help="root of the dump stage's stores"),
    out: Path = typer.Option(Path("artifacts/gates"), help="output directory"),
) -> None:
    """Offline halting gates: fit on fit, calibrate on val, report on test; cross-regime transfer."""
    with user_errors():
        base = load_base(params)
        cfg = load_section(GatesConfig, "gates", params, required=True)
        cal = load_section(CalibrationConfig, "calibration", params)
        ivc = load_section(IntervalsConfig, "intervals", params)
        # One writer per output (a live run is named; a killed run's claim and staging debris are taken over).
        with stage_output(out, stage="gates", inputs={"--dump-root": dump_root}):
            names = model_names(params, models)
            stores, meta, tasks = {}, {}, {}
            vers = versions()
            for m in names:
                check_split_formats(dump_root, m, SPLITS)  # a wrong zarr.json field: one line naming it
                stores[m] = open_split_stores(dump_root, m, SPLITS)  # checked to be one dump of model m
                info = model_meta(m, params)
                task_attr = stores[m]["fit"].attrs.get("task")
                tasks[m] = info["task"] or (task_attr.get("name") if isinstance(task_attr, dict) else None)
                meta[m] = {**info, "seed": base.seed,
                           "params": {"gates": to_dict(cfg), "calibration": to_dict(cal), "intervals": to_dict(ivc)},
                           "versions": vers, "store_seeds": {s: st.attrs.get("seeds") for s, st in stores[m].items()}}
            with dask_runner(base.dask) as runner:
                metrics = gates_stage(stores, cfg, cal, out, base_seed=base.seed, meta=meta, tasks=tasks,
                                      threads=base.analysis_threads, runner=runner, intervals=ivc)
    for m, best in metrics["best_gate"].items():
        if best:
            typer.echo(f"{m}: best gate (chosen on val) {best['rule']}: test depth {best['test_depth']['text']}, "
                       f"accuracy {best['test_accuracy']['text']}")
    typer.echo(f"gates: {len(names)} models × {len(metrics['gates'])} gates in {metrics['seconds']:.1f} s")

