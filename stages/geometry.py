"""DVC stage ``geometry``: trajectory geometry of one model's dump -> artifacts/geometry/<model>/."""

from __future__ import annotations

from pathlib import Path

import typer

from stages._common import UserError, run, user_errors


def main(
    model: str = typer.Option(..., help="model name <task>-<regime> (artifacts/dump/<model>)"),
    params: Path = typer.Option(Path("params.yaml"), help="params file"),
    dump_root: Path = typer.Option(Path("artifacts/dump"), help="root of the dump stage's stores"),
    train_root: Path = typer.Option(Path("artifacts/train"), help="root of the train stage's checkpoints"),
    out: Path = typer.Option(Path("artifacts/geometry"), help="output root"),
) -> None:
    """Step norms, step cosines, acceleration, convergence depth and DLR of a model's trajectories."""
    import polars as pl

    from pipeline.config import load_base, load_section
    from pipeline.geometry import DYNAMICS_SCHEMA, GeometryConfig, geometry_model, training_dynamics
    from pipeline.store import StoreError, open_store

    with user_errors():
        base = load_base(params)
        cfg = load_section(GeometryConfig, "geometry", params)
        try:
            stores = {s: open_store(dump_root / model / f"{s}.zarr") for s in cfg.splits}
        except StoreError as exc:
            raise UserError(str(exc)) from None
        # training_dynamics.parquet is always an output (zero rows when disabled): a fixed set of outs.
        extra = {"training_dynamics.parquet": pl.DataFrame(schema=DYNAMICS_SCHEMA)}
        if cfg.training_dynamics:
            import torch

            from pipeline.dump import DumpConfig

            torch.set_num_threads(base.threads)
            dump_cfg = load_section(DumpConfig, "dump", params)
            extra["training_dynamics.parquet"] = training_dynamics(train_root / model, cfg, dump_cfg, base.device)
        from pipeline.train import versions

        meta = {"model": model, "seed": base.seed,
                "store_seeds": {s: st.attrs.get("seeds") for s, st in stores.items()}, "versions": versions()}
        metrics = geometry_model(stores, cfg, out / model, meta=meta, extra_tables=extra)
    split = "test" if "test" in metrics["splits"] else next(iter(metrics["splits"]))
    m = metrics["splits"][split]
    norms = " ".join(f"{v:.3g}" for v in m["step_norm_mean_per_loop"])
    typer.echo(f"{model} ({split}): mean step norm per loop {norms}; "
               f"last-loop step cosine {m['step_cos_mean_last_loop']}")


if __name__ == "__main__":
    run(main)
