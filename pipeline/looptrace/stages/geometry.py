"""DVC stage ``geometry``: trajectory geometry of every model's dump (or ``--model``'s) -> artifacts/geometry/<model>/."""

from __future__ import annotations

import functools
from pathlib import Path

import typer

from looptrace.config import PARAMS_HELP, load_base, load_section
from looptrace.errors import user_errors
from looptrace.geometry.stage import GeometryConfig, geometry_model
from looptrace.intervals import IntervalsConfig
from looptrace.io.claims import stage_output
from looptrace.io.parallel import dask_runner, model_workers, per_model, scheduler_of
from looptrace.io.store.format import check_split_formats
from looptrace.io.store.identity import open_split_stores
from looptrace.project import model_names, versions
from looptrace.stages import register_stage


def geometry_one(model: str, params: list[Path], dump_root: Path, out: Path) -> str:
    """One model's geometry -> ``<out>/<model>/``; returns the line that reports it."""
    base = load_base(params)
    cfg = load_section(GeometryConfig, "geometry", params, required=True)
    intervals = load_section(IntervalsConfig, "intervals", params)  # the opt-in per-layer / per-head tables
    # One writer per output (a live run is named; a killed run's claim and staging debris are taken over).
    with stage_output(out / model, stage="geometry", inputs={"--dump-root": dump_root}, out_root=out):
        check_split_formats(dump_root, model, cfg.splits)  # a wrong zarr.json field: one line naming it
        stores = open_split_stores(dump_root, model, cfg.splits)  # checked to be one dump of this model
        meta = {"model": model, "seed": base.seed,
                "store_seeds": {s: st.attrs.get("seeds") for s, st in stores.items()}, "versions": versions()}
        with dask_runner(base.dask) as runner:
            metrics = geometry_model(stores, cfg, out / model, meta=meta, runner=runner, intervals=intervals)
    split = "test" if "test" in metrics["splits"] else next(iter(metrics["splits"]))
    m = metrics["splits"][split]
    norms = " ".join(f"{v:.3g}" for v in m["step_norm_mean_per_loop"])
    return f"{model} ({split}): mean step norm per loop {norms}; last-loop step cosine {m['step_cos_mean_last_loop']}"


@register_stage("geometry", 40, config=GeometryConfig, library="looptrace.geometry.stage", help_blocks=("models",))
def main(
    model: str | None = typer.Option(None, help="one model <task>-<regime>[-s<seed>] (artifacts/dump/<model>); "
                                                "default: every model of the matrix, one per core at a time"),
    params: list[Path] = typer.Option([Path("params.yaml")], help=PARAMS_HELP),
    dump_root: Path = typer.Option(Path("artifacts/dump"), help="root of the dump stage's stores"),
    out: Path = typer.Option(Path("artifacts/geometry"), help="output root"),
) -> None:
    """Step norms, step cosines, acceleration, convergence depth and DLR of a model's trajectories (and, for a dump
    with ``dump.layers`` / ``dump.heads``, per-layer convergence and per-head attention statistics)."""
    with user_errors():
        base = load_base(params)
        load_section(GeometryConfig, "geometry", params, required=True)  # a bad section: one line, before any model
        models = [model] if model else model_names(params)
        workers = model_workers(len(models), scheduler=scheduler_of(base.dask))
        per_model(functools.partial(geometry_one, params=params, dump_root=dump_root, out=out), models, workers,
                  "geometry", typer.echo)
