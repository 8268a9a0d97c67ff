"""DVC stage ``latency``: real early exit with batch compaction vs full depth -> artifacts/latency/."""

from __future__ import annotations

from pathlib import Path

import torch
import typer

from looptrace.config import PARAMS_HELP, load_base, load_section, require_in, to_dict
from looptrace.errors import user_errors
from looptrace.io.claims import stage_output
from looptrace.io.guard import input_roots
from looptrace.io.parallel import model_workers
from looptrace.models import check_device
from looptrace.online.latency import LatencyConfig, latency_models, write_latency
from looptrace.project import model_meta, model_names, versions
from looptrace.rules.readouts import ReadoutsConfig
from looptrace.stages import register_stage


@register_stage("latency", 80, config=LatencyConfig, library="looptrace.online.latency", help_blocks=("models", "rules"))
def main(
    params: list[Path] = typer.Option([Path("params.yaml")], help=PARAMS_HELP),
    models: str = typer.Option("", help="comma-separated model names; default: train.tasks × train.regimes"),
    train_root: Path = typer.Option(Path("artifacts/train"), help="root of the train stage's checkpoints"),
    dump_root: Path = typer.Option(Path("artifacts/dump"), help="root of the dump stage's stores (test split)"),
    readouts_root: Path = typer.Option(Path("artifacts/readouts"), help="root of the readouts stage's outputs"),
    gates_root: Path = typer.Option(Path("artifacts/gates"), help="root of the gates stage's outputs (optional)"),
    out: Path = typer.Option(Path("artifacts/latency"), help="output directory"),
) -> None:
    """Wall time of real early exit (loops stop, exited sequences leave the batch) vs full depth."""
    with user_errors():
        base = load_base(params)
        cfg = load_section(LatencyConfig, "latency", params, required=True)
        # Every rule but `gate` runs at the readouts stage's chosen threshold, so it must be one readouts scored.
        scored = load_section(ReadoutsConfig, "readouts", params).rules
        for rule in cfg.rules:
            if rule != "gate":
                require_in("latency.rules", rule, "readouts.rules", scored)
        check_device(base.device)
        # One writer per output (a live run is named; a killed run's claim and staging debris are taken over).
        with stage_output(out, stage="latency", inputs=input_roots(train_root, dump_root, readouts_root, gates_root)):
            torch.set_num_threads(base.analysis_threads)
            torch.manual_seed(base.seed)
            names = model_names(params, models)
            df, metrics = latency_models(names, train_root, dump_root, readouts_root, gates_root, cfg,
                                         device=base.device, regime_meta=lambda name: model_meta(name, params),
                                         workers=model_workers(len(names), base.analysis_threads, base.device,
                                                               setting=cfg.workers),
                                         threads=base.analysis_threads)
            metrics.update(seed=base.seed, threads=base.analysis_threads, device=base.device, params=to_dict(cfg),
                           versions=versions())
            write_latency(out, df, metrics)
    for r in df.iter_rows(named=True):
        typer.echo(f"{r['model']} {r['rule']} batch {r['batch_size']}: depth {r['mean_exit_depth']:.2f}/{r['n_loops']}, "
                   f"realised {r['realised_speedup']:.2f}x vs ideal {r['ideal_speedup']:.2f}x "
                   f"(exact-causal ideal {r['ideal_speedup_work']:.2f}x), exact={r['exact']}")
    for name, m in metrics["models"].items():
        for rule, reason in (m.get("skipped") or {}).items():
            typer.echo(f"{name} {rule}: skipped ({reason})")

