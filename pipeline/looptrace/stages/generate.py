"""DVC stage ``generate``: generation-time early exit (each new token loops until its rule fires) with a KV
policy for the loops it skipped, against full-depth greedy decoding -> artifacts/generate/.

The model is a trained looptrace checkpoint (default pipeline: prompts from its task's test split) or, when
``dump.adapter`` is set (the LM profile), that checkpoint directory (prompts from the corpus's test split).
"""

from __future__ import annotations

from pathlib import Path

import torch
import typer

from looptrace.capture.dump import DumpConfig
from looptrace.config import PARAMS_HELP, load_base, load_section, to_dict
from looptrace.errors import user_errors
from looptrace.intervals import IntervalsConfig
from looptrace.io.claims import stage_output
from looptrace.io.guard import input_roots
from looptrace.io.parallel import model_workers
from looptrace.models import check_device
from looptrace.online.generate import GenerateConfig, dump_text_windows, generate_models, write_generate
from looptrace.online.speculative import SpeculativeStage
from looptrace.project import model_meta, model_names, versions
from looptrace.stages import register_stage


@register_stage("generate", 90, config=GenerateConfig, library="looptrace.online.generate", help_blocks=("models", "rules"))
def main(
    params: list[Path] = typer.Option([Path("params.yaml")], help=PARAMS_HELP),
    models: str = typer.Option("", help="comma-separated model names; default: train.tasks × train.regimes "
                                        "(with dump.adapter: its run name)"),
    train_root: Path = typer.Option(Path("artifacts/train"), help="root of the train stage's checkpoints"),
    dump_root: Path = typer.Option(Path("artifacts/dump"), help="root of the dump stage's stores (test split)"),
    readouts_root: Path = typer.Option(Path("artifacts/readouts"), help="root of the readouts stage's outputs"),
    gates_root: Path = typer.Option(Path("artifacts/gates"), help="root of the gates stage's outputs (optional)"),
    out: Path = typer.Option(Path("artifacts/generate"), help="output directory"),
) -> None:
    """Greedy decoding with early exit per token (KV policies share / recompute / native) vs full depth."""
    with user_errors():
        base = load_base(params)
        cfg = load_section(GenerateConfig, "generate", params, required=True)
        check_device(base.device)
        dump_cfg = load_section(DumpConfig, "dump", params)
        intervals = load_section(IntervalsConfig, "intervals", params) if cfg.speculative is not None else None
        adapter = dump_cfg.adapter
        # One writer per output (a live run is named; a killed run's claim and staging debris are taken over).
        with stage_output(out, stage="generate", inputs=input_roots(train_root, dump_root, readouts_root, gates_root)):
            torch.set_num_threads(base.analysis_threads)
            torch.manual_seed(base.seed)
            names = model_names(params, models) if models or adapter is None else [adapter.run_name]
            names = cfg.pick(names) if not models and adapter is None else names
            spec = None if intervals is None or cfg.speculative is None else SpeculativeStage(
                cfg.speculative, cfg.batch_sizes, cfg.new_tokens, cfg.repeats, intervals.n_boot, intervals.level,
                base.seed, base.device)
            df, metrics = generate_models(names, cfg, dump_root, readouts_root, gates_root, train_root=train_root,
                                          adapter=adapter, device=base.device, seed=base.seed,
                                          regime_meta=lambda name: model_meta(name, params),
                                          text_windows=(lambda: dump_text_windows(dump_cfg)) if dump_cfg.text
                                          else None, after_model=spec,
                                          workers=model_workers(len(names), base.analysis_threads, base.device,
                                                                setting=cfg.workers),
                                          threads=base.analysis_threads)
            spec_df = None
            if spec is not None:
                metrics["speculative"], spec_df = spec.metrics(), spec.frame()
            metrics.update(seed=base.seed, threads=base.analysis_threads, device=base.device, params=to_dict(cfg),
                           versions=versions())
            write_generate(out, df, metrics, spec_df)
    for r in df.iter_rows(named=True):
        typer.echo(f"{r['model']} {r['rule']} {r['policy']} batch {r['batch_size']}: depth {r['mean_exit_depth']:.2f}/"
                   f"{r['n_loops']}, {r['tokens_per_s']:.0f} tok/s, realised {r['realised_speedup']:.2f}x vs ideal "
                   f"{r['ideal_speedup']:.2f}x, agreement {r['token_agreement']:.2f}")
    for r in (spec_df.iter_rows(named=True) if spec_df is not None else ()):
        typer.echo(f"{r['model']} speculative k={r['k']} d={r['d']} batch {r['batch_size']}: exact {r['exact']}, "
                   f"tokens/block {r['realised_tokens_per_block']:.2f} (predicted {r['predicted_tokens_per_block']:.2f}), "
                   f"speedup {r['realised_speedup']:.2f}x (predicted {r['predicted_speedup']:.2f}x)")
    for name, m in metrics["models"].items():
        for what, reason in (m.get("skipped") or {}).items():
            typer.echo(f"{name} {what}: skipped ({reason})")

