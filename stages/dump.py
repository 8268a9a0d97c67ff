"""DVC stage ``dump``: capture one model's trajectories -> artifacts/dump/<model>/{fit,val,test}.zarr.

The model is a trained looptrace checkpoint (``--model <task>-<regime>``) or, when ``dump.adapter`` is set
(e.g. the LM profile, ``--params params.yaml --params profiles/lm/params.yaml``), a real checkpoint directory
run on the corpus ``dump.text`` (:mod:`looptrace.tasks.text` makes its batches).
"""

from __future__ import annotations

from pathlib import Path

import torch
import typer
from looptrace.capture.dump import DumpConfig, dump_model, dump_text_model
from looptrace.config import PARAMS_HELP, load_base, load_section
from looptrace.errors import UserError, run, user_errors
from looptrace.models.adapters.hf import load_adapter
from looptrace.models.interface import LoopedTransformerAdapter
from looptrace.tasks import make_task


def main(
    model: str = typer.Option("", help="model name <task>-<regime> (artifacts/train/<model>/model.pt); with "
                                       "dump.adapter optional (it must equal dump.adapter.name)"),
    params: list[Path] = typer.Option([Path("params.yaml")], help=PARAMS_HELP),
    train_root: Path = typer.Option(Path("artifacts/train"), help="root of the train stage's checkpoints"),
    out: Path = typer.Option(Path("artifacts/dump"), help="output root"),
) -> None:
    """Run a looped model once and store every scored token's states, readouts and logit stats per loop."""
    with user_errors():
        base = load_base(params)
        cfg = load_section(DumpConfig, "dump", params)
        torch.set_num_threads(base.threads)
        if cfg.adapter is not None:
            name = cfg.adapter.run_name
            if model and model != name:
                raise UserError(f"--model {model} differs from dump.adapter.name {name}; drop --model or fix one")
            model = name
            adapter = load_adapter(cfg.adapter, device=base.device)
            stores = dump_text_model(adapter, cfg, out / model, base)
        else:
            if not model:
                raise UserError("--model <task>-<regime> is required (or set dump.adapter in the params file)")
            adapter, stores = _dump_trained(model, cfg, base, train_root, out)
    sizes = ", ".join(f"{s} {st.n_tokens}" for s, st in stores.items())
    typer.echo(f"{model}: dumped tokens per split: {sizes} (T = {adapter.info.n_loops})")


def _dump_trained(model: str, cfg, base, train_root: Path, out: Path):
    """A trained looptrace checkpoint on its own task's data sets (seeds recorded in the checkpoint)."""
    ckpt = train_root / model / "model.pt"
    adapter = LoopedTransformerAdapter.from_checkpoint(ckpt, device=base.device)
    extra = adapter.info.extra
    if "task" not in extra or "data_seeds" not in extra:
        raise UserError(f"checkpoint '{ckpt}' records no task or data_seeds; retrain with `looptrace train`")
    spec = dict(extra["task"])
    task = make_task(spec.pop("name"), spec)
    return adapter, dump_model(adapter, task, extra["data_seeds"], out / model, cfg, base)


if __name__ == "__main__":
    run(main)
