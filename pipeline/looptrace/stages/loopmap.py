"""DVC stage ``loopmap``: the loop map of a trained model on a small fixed sample (ρ_t, FTLE, regime, certified
frontier, failure AUCs, intervention windows; SPEC §2b) -> artifacts/loopmap/<model>/."""

from __future__ import annotations

import time
from pathlib import Path

import torch
import typer

from looptrace.config import PARAMS_HELP, load_base, load_section, to_dict
from looptrace.errors import user_errors
from looptrace.io.claims import stage_output
from looptrace.loopmap.config import LoopmapConfig
from looptrace.loopmap.stage import loopmap_model, write_loopmap
from looptrace.models import check_device
from looptrace.project import versions
from looptrace.stages import register_stage


@register_stage("loopmap", 35, config=LoopmapConfig, library="looptrace.loopmap.stage", help_blocks=("models",))
def main(
    model: str = typer.Option(..., help="model name <task>-<regime> (artifacts/train/<model>)"),
    params: list[Path] = typer.Option([Path("params.yaml")], help=PARAMS_HELP),
    train_root: Path = typer.Option(Path("artifacts/train"), help="root of the train stage's checkpoints"),
    out: Path = typer.Option(Path("artifacts/loopmap"), help="output root"),
) -> None:
    """Measure the loop map on a fixed sample: contraction, FTLE, regime, certified exit, windows of interventions."""
    with user_errors():
        base = load_base(params)
        cfg = load_section(LoopmapConfig, "loopmap", params, required=True)
        with stage_output(out / model, stage="loopmap", inputs={"--train-root": train_root}, out_root=out):
            torch.set_num_threads(base.threads)
            start = time.perf_counter()
            frames, words, meta, tracing = loopmap_model(train_root / model, cfg, base.seed,
                                                         check_device(base.device), model)
            metrics = {"model": model, "seed": base.seed, "params": to_dict(cfg), "versions": versions(), **meta}
            write_loopmap(out / model, frames, words, metrics, model, cfg.dpi, tracing)
    # wall time on stdout only (metrics.json stays byte-identical across runs)
    typer.echo(f"{model}: loop map on {meta['sequences']} sequences in {time.perf_counter() - start:.1f} s. "
               + " ".join(words + tracing))
