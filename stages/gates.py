"""DVC stage ``gates``: halting gates refit on frozen trajectories (SPEC §6) -> artifacts/gates/."""

from __future__ import annotations

from pathlib import Path

import typer

from stages._common import UserError, run, user_errors


def main(
    params: Path = typer.Option(Path("params.yaml"), help="params file"),
    models: str = typer.Option("", help="comma-separated model names; default: train.tasks × train.regimes"),
    dump_root: Path = typer.Option(Path("artifacts/dump"), help="root of the dump stage's stores"),
    out: Path = typer.Option(Path("artifacts/gates"), help="output directory"),
) -> None:
    """Offline halting gates: fit on fit, calibrate on val, report on test; cross-regime transfer."""
    from pipeline.config import ConfigError, load_base, load_section, read_params, to_dict
    from pipeline.gates import SPLITS, GatesConfig, gates_stage
    from pipeline.readouts import light_versions, resolve_model
    from pipeline.store import StoreError, open_store

    with user_errors():
        base = load_base(params)
        cfg = load_section(GatesConfig, "gates", params)
        raw = read_params(params)
        train = raw.get("train") or {}
        if models:
            names = [m.strip() for m in models.split(",") if m.strip()]
        else:  # the default matrix, <task>-<regime> (read raw: no torch import just for the names)
            names = [f"{t}-{r}" for t in train.get("tasks") or [] for r in train.get("regimes") or []]
            if not names:
                raise ConfigError("params section 'train' lists no tasks × regimes; pass --models")
        readouts = raw.get("readouts") or {}
        for key in ("n_quantiles", "delta", "dx"):  # same protocol as readouts, or the frontiers are not comparable
            ours = [float(v) for v in (cfg.dx if key == "dx" else [getattr(cfg, key)])]
            theirs = readouts.get(key)
            if theirs is not None and [float(v) for v in (theirs if key == "dx" else [theirs])] != ours:
                typer.echo(f"warning: gates.{key} = {getattr(cfg, key)} differs from readouts.{key} = "
                           f"{readouts[key]}; gate and readout frontiers are then not comparable", err=True)
        stores, meta, tasks = {}, {}, {}
        versions = light_versions()
        for m in names:
            try:
                stores[m] = {s: open_store(dump_root / m / f"{s}.zarr") for s in SPLITS}
            except StoreError as exc:
                raise UserError(str(exc)) from None
            info = resolve_model(m, train.get("task_defs") or {}, train.get("regime_defs") or {})
            task_attr = stores[m]["fit"].attrs.get("task")
            tasks[m] = info["task"] or (task_attr.get("name") if isinstance(task_attr, dict) else None)
            meta[m] = {**info, "seed": base.seed, "params": to_dict(cfg), "versions": versions,
                       "store_seeds": {s: st.attrs.get("seeds") for s, st in stores[m].items()}}
        metrics = gates_stage(stores, cfg, out, base_seed=base.seed, meta=meta, tasks=tasks,
                              threads=cfg.threads or base.threads)
    for m, best in metrics["best_gate"].items():
        typer.echo(f"{m}: best gate D@{best['x']:g} = {best['d_at']} ({best['rule']})")
    typer.echo(f"gates: {len(names)} models × {len(metrics['gates'])} gates in {metrics['seconds']:.1f} s")


if __name__ == "__main__":
    run(main)
