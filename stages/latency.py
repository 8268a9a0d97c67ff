"""DVC stage ``latency``: real early exit with batch compaction vs full depth -> artifacts/latency/."""

from __future__ import annotations

from pathlib import Path

import typer

from stages._common import run, user_errors


def main(
    params: Path = typer.Option(Path("params.yaml"), help="params file"),
    models: str = typer.Option("", help="comma-separated model names; default: train.tasks × train.regimes"),
    train_root: Path = typer.Option(Path("artifacts/train"), help="root of the train stage's checkpoints"),
    dump_root: Path = typer.Option(Path("artifacts/dump"), help="root of the dump stage's stores (test split)"),
    readouts_root: Path = typer.Option(Path("artifacts/readouts"), help="root of the readouts stage's outputs"),
    gates_root: Path = typer.Option(Path("artifacts/gates"), help="root of the gates stage's outputs (optional)"),
    out: Path = typer.Option(Path("artifacts/latency"), help="output directory"),
) -> None:
    """Wall time of real early exit (loops stop, exited sequences leave the batch) vs full depth."""
    import torch

    from pipeline.config import ConfigError, load_base, load_section, read_params
    from pipeline.latency import LatencyConfig, latency_models, write_latency
    from pipeline.readouts import resolve_model

    with user_errors():
        base = load_base(params)
        cfg = load_section(LatencyConfig, "latency", params)
        torch.set_num_threads(cfg.threads or base.threads)
        torch.manual_seed(base.seed)
        train = read_params(params).get("train") or {}
        if models:
            names = [m.strip() for m in models.split(",") if m.strip()]
        else:
            names = [f"{t}-{r}" for t in train.get("tasks") or [] for r in train.get("regimes") or []]
            if not names:
                raise ConfigError("params section 'train' lists no tasks × regimes; pass --models")

        def meta(name: str) -> dict:
            return resolve_model(name, train.get("task_defs") or {}, train.get("regime_defs") or {})

        df, metrics = latency_models(names, train_root, dump_root, readouts_root, gates_root, cfg,
                                     device=base.device, regime_meta=meta)
        metrics.update(seed=base.seed, threads=cfg.threads or base.threads, device=base.device,
                       params={k: list(v) if isinstance(v, tuple) else v for k, v in cfg.__dict__.items()})
        from pipeline.train import versions

        metrics["versions"] = versions()
        write_latency(out, df, metrics)
    for r in df.iter_rows(named=True):
        typer.echo(f"{r['model']} {r['rule']} batch {r['batch_size']}: depth {r['mean_exit_depth']:.2f}/{r['n_loops']}, "
                   f"realised {r['realised_speedup']:.2f}x vs ideal {r['ideal_speedup']:.2f}x "
                   f"(exact-causal ideal {r['ideal_speedup_work']:.2f}x), exact={r['exact']}")
    for name, m in metrics["models"].items():
        for rule, reason in (m.get("skipped") or {}).items():
            typer.echo(f"{name} {rule}: skipped ({reason})")


if __name__ == "__main__":
    run(main)
