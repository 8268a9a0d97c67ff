"""DVC stage ``loopmap``: the loop map of a trained model (every model's, or ``--model``'s) on a small fixed sample (ρ_t, FTLE, regime, certified
frontier, failure AUCs, intervention windows; SPEC §2b) -> artifacts/loopmap/<model>/."""

from __future__ import annotations

import functools
import time
from pathlib import Path

import torch
import typer

from looptrace.config import PARAMS_HELP, load_base, load_section, to_dict
from looptrace.errors import user_errors
from looptrace.io.claims import stage_output
from looptrace.io.parallel import model_workers, per_model
from looptrace.loopmap.config import LoopmapConfig
from looptrace.loopmap.stage import loopmap_model, write_loopmap
from looptrace.models import check_device
from looptrace.project import model_names, versions
from looptrace.stages import register_stage


def loopmap_one(model: str, params: list[Path], train_root: Path, out: Path) -> str:
    """One model's loop map -> ``<out>/<model>/``; returns the line that reports it."""
    base = load_base(params)
    cfg = load_section(LoopmapConfig, "loopmap", params, required=True)
    with stage_output(out / model, stage="loopmap", inputs={"--train-root": train_root}, out_root=out):
        torch.set_num_threads(base.threads)
        start = time.perf_counter()
        frames, words, meta, tracing = loopmap_model(train_root / model, cfg, base.seed, check_device(base.device),
                                                     model)
        metrics = {"model": model, "seed": base.seed, "params": to_dict(cfg), "versions": versions(), **meta}
        write_loopmap(out / model, frames, words, metrics, model, cfg.dpi, tracing)
    # wall time on stdout only (metrics.json stays byte-identical across runs)
    return (f"{model}: loop map on {meta['sequences']} sequences in {time.perf_counter() - start:.1f} s. "
            + " ".join(words + tracing))


@register_stage("loopmap", 35, config=LoopmapConfig, library="looptrace.loopmap.stage", help_blocks=("models",))
def main(
    model: str | None = typer.Option(None, help="one model <task>-<regime>[-s<seed>] (artifacts/train/<model>); "
                                                "default: every model of the matrix, one per core at a time"),
    params: list[Path] = typer.Option([Path("params.yaml")], help=PARAMS_HELP),
    train_root: Path = typer.Option(Path("artifacts/train"), help="root of the train stage's checkpoints"),
    out: Path = typer.Option(Path("artifacts/loopmap"), help="output root"),
) -> None:
    """Measure the loop map on a fixed sample: contraction, FTLE, regime, certified exit, windows of interventions."""
    with user_errors():
        base = load_base(params)
        load_section(LoopmapConfig, "loopmap", params, required=True)  # a bad section: one line, before any model
        check_device(base.device)
        models = [model] if model else model_names(params)
        workers = model_workers(len(models), base.threads, base.device)
        per_model(functools.partial(loopmap_one, params=params, train_root=train_root, out=out), models, workers,
                  "loopmap", typer.echo)
