"""DVC stage ``dump``: capture one trained model's trajectories -> artifacts/dump/<model>/{fit,val,test}.zarr."""

from __future__ import annotations

from pathlib import Path

import typer

from stages._common import run, user_errors


def main(
    model: str = typer.Option(..., help="model name <task>-<regime> (artifacts/train/<model>/model.pt)"),
    params: Path = typer.Option(Path("params.yaml"), help="params file"),
    train_root: Path = typer.Option(Path("artifacts/train"), help="root of the train stage's checkpoints"),
    out: Path = typer.Option(Path("artifacts/dump"), help="output root"),
) -> None:
    """Run a looped model once and store every scored token's states, readouts and logit stats per loop."""
    import torch

    from pipeline.config import load_base, load_section
    from pipeline.dump import DumpConfig, dump_model
    from pipeline.interface import LoopedTransformerAdapter
    from pipeline.tasks import make_task

    with user_errors():
        base = load_base(params)
        cfg = load_section(DumpConfig, "dump", params)
        torch.set_num_threads(base.threads)
        ckpt = train_root / model / "model.pt"
        adapter = LoopedTransformerAdapter.from_checkpoint(ckpt, device=base.device)
        extra = adapter.info.extra
        if "task" not in extra or "data_seeds" not in extra:
            raise ValueError(f"checkpoint '{ckpt}' records no task or data_seeds; retrain with `looptrace train`")
        spec = dict(extra["task"])
        task = make_task(spec.pop("name"), spec)
        stores = dump_model(adapter, task, extra["data_seeds"], out / model, cfg, base)
    sizes = ", ".join(f"{s} {st.n_tokens}" for s, st in stores.items())
    typer.echo(f"{model}: dumped tokens per split: {sizes} (T = {adapter.info.n_loops})")


if __name__ == "__main__":
    run(main)
