"""DVC stage ``dump``: capture the models' trajectories -> artifacts/dump/<model>/{fit,val,test}.zarr.

The models are the trained looptrace checkpoints of the matrix (every one, a pool of processes; or ``--model
<task>-<regime>-s<seed>``) or, when ``dump.adapter`` is set
(e.g. the LM profile, ``--params params.yaml --params profiles/lm/params.yaml``), a real checkpoint directory
run on the corpus ``dump.text`` (:mod:`looptrace.tasks.text` makes its batches).

``--out`` may be an fsspec URL (``s3://bucket/dump``; credentials and endpoint from the usual ``AWS_*`` /
fsspec config). N processes may dump one model together: ``--shard i/N`` each (or ``RANK``/``WORLD_SIZE``
under ``torchrun``); each writes its chunk-aligned share of every split and the last one marks it complete
(docs/dump.md, "Several processes, one store").
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
from pathlib import Path

import torch
import typer

from looptrace.capture.dump import DumpConfig, dump_model
from looptrace.capture.dump_text import dump_text_model
from looptrace.config import PARAMS_HELP, load_base, load_section
from looptrace.errors import UserError, user_errors
from looptrace.io import interrupts
from looptrace.io.claims_dir import parse_shard, shard_from_env
from looptrace.io.guard import check_overlap
from looptrace.io.parallel import model_workers, per_model
from looptrace.io.store.location import join_store
from looptrace.models import check_device
from looptrace.models.adapters.loading import load_adapter
from looptrace.models.interface import LoopedTransformerAdapter
from looptrace.project import model_names
from looptrace.stages import register_stage
from looptrace.tasks import make_task


@register_stage("dump", 20, config=DumpConfig, library="looptrace.capture.dump", help_blocks=("tasks", "models", "adapters"))
def main(
    model: str = typer.Option("", help="one model <task>-<regime>[-s<seed>] (artifacts/train/<model>/model.pt); "
                                       "default: every model of the matrix, one per core at a time; with "
                                       "dump.adapter optional (it must equal dump.adapter.name)"),
    params: list[Path] = typer.Option([Path("params.yaml")], help=PARAMS_HELP),
    train_root: Path = typer.Option(Path("artifacts/train"), help="root of the train stage's checkpoints"),
    out: str = typer.Option("artifacts/dump", help="output root: a directory or an fsspec URL (s3://bucket/dump)"),
    shard: str = typer.Option("", help="i/N: this process writes shard i of N of every split (N processes dump "
                                       "one store together; needs --model or dump.adapter); default "
                                       "RANK/WORLD_SIZE from the environment (torchrun), else 0/1"),
) -> None:
    """Run a looped model once and store every scored token's states, readouts and logit stats per loop."""
    with user_errors():
        base = load_base(params)
        cfg = load_section(DumpConfig, "dump", params, required=True)
        part = parse_shard(shard) if shard else shard_from_env()
        check_overlap(out, {"--train-root": None if cfg.adapter is not None else train_root})  # before any write
        torch.set_num_threads(base.threads)
        device = _device(check_device(base.device))
        with _sigterm_as_interrupt():  # torchrun's agent stops the other ranks with SIGTERM: drain the writer
            if cfg.adapter is not None:
                name = cfg.adapter.run_name
                if model and model != name:
                    raise UserError(f"--model {model} differs from dump.adapter.name {name}; drop --model or fix one")
                model = name
                interrupts.expect_commit(join_store(out, model), _LEFT)
                adapter = load_adapter(cfg.adapter, device=device)
                stores = dump_text_model(adapter, cfg, join_store(out, model), base, shard=part)
                line = _line(model, adapter.info.n_loops, stores, cfg, part)
            elif model:
                interrupts.expect_commit(join_store(out, model), _LEFT)
                adapter, stores = _dump_trained(model, cfg, base, train_root, out, device, part)
                line = _line(model, adapter.info.n_loops, stores, cfg, part)
            else:
                if part != (0, 1):
                    raise UserError(f"shard {part[0]}/{part[1]}: processes share one store; name it with --model")
                models = model_names(params)
                interrupts.expect_commit(out, _LEFT)
                per_model(functools.partial(dump_one, params=params, train_root=train_root, out=out), models,
                          model_workers(len(models), base.threads, device), "dump", typer.echo)
                line = None
            # this process's share of every store is written and verified (complete ones are marked so): a Ctrl-C
            # from here on no longer interrupts it (looptrace.io.interrupts)
            interrupts.mark_committed()
    if line is not None:
        typer.echo(line)


def dump_one(model: str, params: list[Path], train_root: Path, out: str) -> str:
    """One trained model's dump -> ``<out>/<model>/{fit,val,test}.zarr`` (a pool worker's job); its line."""
    base = load_base(params)
    cfg = load_section(DumpConfig, "dump", params, required=True)
    torch.set_num_threads(base.threads)
    adapter, stores = _dump_trained(model, cfg, base, train_root, out, _device(check_device(base.device)), (0, 1))
    return _line(model, adapter.info.n_loops, stores, cfg, (0, 1))


def _line(model: str, n_loops: int, stores: dict, cfg: DumpConfig, part: tuple[int, int]) -> str:
    """What a model's dump reports: tokens and sequences per split (and, for a shard, what is still missing)."""
    sizes = ", ".join(f"{s} {st.n_tokens}" for s, st in stores.items())
    pending = [s for s, st in stores.items() if not st.complete]
    note = f"; shard {part[0]}/{part[1]} written, still incomplete: {', '.join(pending)}" if pending else ""
    got = ", ".join(f"{s} {st.attrs.get('n_sequences', '?')}/{cfg.sequences.get(s, '?')}" for s, st in stores.items())
    return (f"{model}: dumped tokens per split: {sizes} (T = {n_loops}); sequences per split (got/asked): "
            f"{got}{note}")


#: What an interrupted dump leaves (the line of an interrupted run says it).
_LEFT = "a store not marked complete is refused by every reader, and a re-run resumes it"


def _device(device: str) -> str:
    """``cuda`` under torchrun: one GPU per local rank (``cuda:{LOCAL_RANK % device_count}``)."""
    if device == "cuda" and "LOCAL_RANK" in os.environ and torch.cuda.is_available():
        return f"cuda:{int(os.environ['LOCAL_RANK']) % torch.cuda.device_count()}"
    return device


@contextlib.contextmanager
def _sigterm_as_interrupt():
    """SIGTERM stops the block as Ctrl-C does (:func:`looptrace.io.interrupts.on_signal`, which the launcher
    installs for both; here for a dump run in-process): queued chunks are written, claims released, exit 143."""
    try:
        prev = signal.signal(signal.SIGTERM, interrupts.on_signal)
    except ValueError:  # not the main thread (e.g. a test runner thread): keep the default
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, prev)


def _dump_trained(model: str, cfg, base, train_root: Path, out: str, device: str, part: tuple[int, int]):
    """A trained looptrace checkpoint on its own task's data sets (seeds recorded in the checkpoint)."""
    ckpt = train_root / model / "model.pt"
    adapter = LoopedTransformerAdapter.from_checkpoint(ckpt, device=device, name=model)
    extra = adapter.info.extra
    if "task" not in extra or "data_seeds" not in extra:
        raise UserError(f"checkpoint '{ckpt}' records no task or data_seeds; retrain with `looptrace train`")
    spec = dict(extra["task"])
    task = make_task(spec.pop("name"), spec)
    return adapter, dump_model(adapter, task, extra["data_seeds"], join_store(out, model), cfg, base, shard=part)

