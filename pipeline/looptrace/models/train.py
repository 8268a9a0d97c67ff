"""Training of looped models under a depth-supervision regime (the ``train`` stage).

The loop is written out (nanoGPT style): fresh data from the ``fit`` split every step, AdamW with
linear warm-up and cosine decay, gradient clipping, per-loop evaluation on ``val`` at every kept
checkpoint. Everything is seeded from ``base.seed`` and the data seeds, so the same params give the
same weights and the same numbers.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import multiprocessing as mp
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, cast

import numpy as np
import torch
from tqdm.auto import tqdm

from looptrace.config import (
    OMIT_DEFAULT,
    BaseConfig,
    Check,
    ConfigError,
    NonNegFloat,
    NonNegInt,
    PosFloat,
    PosInt,
    Seed,
    one_of,
    to_dict,
)
from looptrace.io.artifacts import swap_in
from looptrace.models.looped import (
    LOOP_FORMS,
    GroupConfig,
    LoopedTransformer,
    LoopOutput,
    ModelConfig,
    save_checkpoint,
)
from looptrace.models.regimes import RegimeConfig, per_depth_loss, regime_loss
from looptrace.project import model_name, versions
from looptrace.tasks import IGNORE, SPLITS, Task, TaskBatch, TaskConfig, make_task


@dataclass(frozen=True)
class ModelParams:
    """Architecture hyper-parameters (vocabulary, length, causality come from the task; the gate
    from the regime)."""

    d_model: Annotated[int, Check(ge=2, why="model width")] = 64
    n_head: Annotated[int, Check(ge=1, why="attention heads; d_model must be a multiple of it")] = 4
    n_prelude: NonNegInt = 0
    groups: Annotated[tuple[GroupConfig, ...], Check(nonempty=True)] = field(
        default_factory=lambda: (GroupConfig(n_layer=1, loops=6),))
    n_coda: NonNegInt = 0
    reinject: bool = True
    gate_hidden: PosInt = 64
    tie_embeddings: bool = False
    mlp_ratio: PosInt = 4
    loop_form: Annotated[str, one_of(*LOOP_FORMS)] = "add"
    #: [RT] loop memory attention in every looped layer (``looptrace.models.looped``); a regime may pin it
    #: (``RegimeConfig.loop_memory``).
    loop_memory: bool = field(default=False, metadata=OMIT_DEFAULT)

    def __post_init__(self) -> None:
        if self.d_model % self.n_head:
            raise ConfigError(f"train.model.d_model = {self.d_model} is not a multiple of train.model.n_head = "
                              f"{self.n_head}; set n_head to a divisor of d_model")


@dataclass(frozen=True)
class DataSeeds:
    """Data seeds of the three disjoint splits ([AD]: 42 / 43 / 44)."""

    fit: Seed = 42
    val: Seed = 43
    test: Seed = 44


@dataclass(frozen=True)
class TrainConfig:
    """``train`` section of ``params.yaml``.

    Attributes:
        tasks: task names trained in the default matrix (keys of ``task_defs``).
        regimes: regime names trained in the default matrix (keys of ``regime_defs``).
        task_defs: every available task, by name.
        regime_defs: every available regime, by name.
        model: architecture.
        steps: optimiser steps.
        steps_by_task: per-task override of ``steps`` (tasks learn at different speeds).
        batch_size: sequences per step (fresh from the fit split each step).
        lr, min_lr: peak and final learning rate (cosine decay after ``warmup`` steps).
        betas, weight_decay, grad_clip: AdamW settings and gradient-norm clip.
        val_sequences: sequences of the val split used for metrics.
        checkpoint_fractions: fractions of ``steps`` at which an intermediate checkpoint is kept
            ([TS] measures loop dynamics across training).
        data_seeds: seeds of the fit / val / test splits.
        seeds: training seeds of every task × regime (model init and fit-data order); each trains its own model
            ``<task>-<regime>-s<seed>``. Empty: the one seed ``base.seed``, named ``<task>-<regime>``.
        workers: processes that train the seeds of one call of :func:`train_seeds` in parallel.
        threads_per_model: torch threads of each model's training; null = ``base.threads // workers`` (at least 1).
            Part of what defines a checkpoint (recorded in it): the same seed trained with another thread count
            may differ in the last bits.
    """

    tasks: tuple[str, ...] = ("running_sum",)
    regimes: tuple[str, ...] = ("uniform",)
    task_defs: dict[str, TaskConfig] = field(default_factory=dict)
    regime_defs: dict[str, RegimeConfig] = field(default_factory=dict)
    model: ModelParams = field(default_factory=ModelParams)
    steps: Annotated[int, Check(ge=1, why="optimiser steps; 0 would save an untrained model")] = 1500
    steps_by_task: dict[str, Annotated[int, Check(ge=1, why="optimiser steps")]] = field(default_factory=dict)
    batch_size: Annotated[int, Check(ge=1, why="sequences per step")] = 128
    lr: PosFloat = 1e-3
    min_lr: NonNegFloat = 1e-4
    warmup: NonNegInt = 100
    betas: tuple[Annotated[float, Check(ge=0, lt=1, why="an AdamW beta")], ...] = (0.9, 0.98)
    weight_decay: NonNegFloat = 0.1
    grad_clip: PosFloat = 1.0
    val_sequences: Annotated[int, Check(ge=1, why="val sequences of the per-loop metrics")] = 1024
    checkpoint_fractions: tuple[Annotated[float, Check(gt=0, lt=1, why="a fraction of train.steps")], ...] = (
        0.1, 0.25, 0.5)
    data_seeds: DataSeeds = field(default_factory=DataSeeds)
    seeds: tuple[Seed, ...] = ()
    workers: PosInt = 1
    threads_per_model: PosInt | None = None

    def __post_init__(self) -> None:
        if len(self.betas) != 2:
            raise ConfigError(f"train.betas = {list(self.betas)}: AdamW takes two betas; write [0.9, 0.98]")
        if self.min_lr > self.lr:
            raise ConfigError(f"train.min_lr = {self.min_lr} exceeds train.lr = {self.lr}; set min_lr ≤ lr")
        if len(set(self.seeds)) != len(self.seeds):
            raise ConfigError(f"train.seeds has duplicates: {list(self.seeds)}")
        if self.workers < 1:
            raise ConfigError(f"train.workers must be >= 1, got {self.workers}")
        if self.threads_per_model is not None and self.threads_per_model < 1:
            raise ConfigError(f"train.threads_per_model must be >= 1 or null, got {self.threads_per_model}")

    def seed_list(self) -> list[int | None]:
        """The seeds to train: ``seeds``, or ``[None]`` (= ``base.seed`` under the unsuffixed name)."""
        return list(self.seeds) if self.seeds else [None]

    def model_threads(self, base: BaseConfig) -> int:
        """Torch threads of one model's training (:attr:`threads_per_model`)."""
        if self.threads_per_model is not None:
            return self.threads_per_model
        return max(1, base.threads // self.workers)

    def task(self, name: str) -> Task:
        if name not in self.task_defs:
            raise ConfigError(f"task '{name}' is not defined in params section 'train.task_defs' "
                             f"(defined: {', '.join(self.task_defs) or 'none'})")
        return make_task(name, self.task_defs[name])

    def steps_for(self, task: str) -> int:
        """Optimiser steps for ``task`` (``steps_by_task`` overrides ``steps``)."""
        return self.steps_by_task.get(task, self.steps)

    def regime(self, name: str) -> RegimeConfig:
        if name not in self.regime_defs:
            raise ConfigError(f"regime '{name}' is not defined in params section 'train.regime_defs' "
                             f"(defined: {', '.join(self.regime_defs) or 'none'})")
        return self.regime_defs[name]


def build_model_config(mp: ModelParams, task: Task, regime: RegimeConfig) -> ModelConfig:
    return ModelConfig(
        vocab_size=task.vocab_size, block_size=task.seq_len, d_model=mp.d_model, n_head=mp.n_head,
        n_prelude=mp.n_prelude, groups=mp.groups, n_coda=mp.n_coda, causal=task.causal,
        reinject=mp.reinject, gate=regime.model_gate, gate_hidden=mp.gate_hidden,
        tie_embeddings=mp.tie_embeddings, mlp_ratio=mp.mlp_ratio, loop_form=mp.loop_form,
        loop_memory=mp.loop_memory if regime.loop_memory is None else regime.loop_memory,
    )


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up to ``lr``, then cosine decay to ``min_lr`` at ``steps``."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    frac = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * min(1.0, frac)))


def to_torch(batch: TaskBatch, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.from_numpy(batch.tokens).to(device), torch.from_numpy(batch.targets).to(device)


@torch.no_grad()
def evaluate(model: LoopedTransformer, data: TaskBatch, device: str = "cpu", batch_size: int = 512) -> dict:
    """Per-loop accuracy and loss on scored tokens, and per-(difficulty, loop) accuracy.

    Returns:
        ``acc_per_loop`` [T], ``loss_per_loop`` [T] (nats), ``acc_by_difficulty`` {difficulty: [T]},
        ``n_tokens``.
    """
    model.eval()
    T = model.n_loops
    correct, loss, count = torch.zeros(T, dtype=torch.float64), torch.zeros(T, dtype=torch.float64), 0
    by_diff: dict[int, list] = {}
    for i in range(0, len(data), batch_size):
        part = data.take(slice(i, i + batch_size))
        idx, tgt = to_torch(part, device)
        out = model(idx)
        mask = tgt != IGNORE  # [B, S]
        ell = per_depth_loss(out.logits, tgt)[mask]  # [N, T]
        hit = (out.logits.argmax(-1) == tgt.unsqueeze(-1))[mask]  # [N, T]
        correct += hit.sum(0).double().cpu()
        loss += ell.sum(0).double().cpu()
        count += int(mask.sum())
        diff = torch.from_numpy(part.difficulty).to(device)[mask]  # [N]
        for d in torch.unique(diff).tolist():
            sel = diff == d
            acc = by_diff.setdefault(int(d), [torch.zeros(T, dtype=torch.float64), 0])
            acc[0] += hit[sel].sum(0).double().cpu()
            acc[1] += int(sel.sum())
    return {
        "acc_per_loop": (correct / max(count, 1)).tolist(),
        "loss_per_loop": (loss / max(count, 1)).tolist(),
        "acc_by_difficulty": {str(d): (v[0] / max(v[1], 1)).tolist() for d, v in sorted(by_diff.items())},
        "n_tokens": count,
    }


#: A killed run's resume state is also saved between kept checkpoints, at most this often (wall seconds). Where a
#: run resumes from never changes what it computes (the resumed run is bit-identical), so a wall clock may set it.
RESUME_EVERY_S = 60.0


def staging_dir(out_dir: Path | str) -> Path:
    """Where :func:`train_model` builds ``out_dir`` (``.<model>.train`` beside it) before swapping it in whole."""
    out_dir = Path(out_dir)
    return out_dir.with_name(f".{out_dir.name}.train")


def _fingerprint(meta: dict, device: str) -> str:
    """What a resume state must match to be continued: everything the weights depend on (task, regime, seed,
    the train section, threads, versions) and the device."""
    return hashlib.sha256(json.dumps({"meta": meta, "device": device}, sort_keys=True, default=str).encode()).hexdigest()


def _load_resume(stage: Path, fingerprint: str) -> dict | None:
    """The resume state in ``stage`` if it belongs to this run (same fingerprint), else None (the stage is stale:
    another run's, or a killed write's)."""
    path = stage / "resume.pt"
    if not path.is_file():
        return None
    try:  # plain values and tensors only: a resume file cannot run code either
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception:  # noqa: BLE001 - a cut or foreign resume file is debris; start over
        return None
    return state if isinstance(state, dict) and state.get("fingerprint") == fingerprint else None


def _save_resume(stage: Path, state: dict) -> None:
    tmp = stage / "resume.pt.tmp"
    torch.save(state, tmp)
    os.replace(tmp, stage / "resume.pt")


def training_gate_logits(regime: RegimeConfig, model: LoopedTransformer, out: LoopOutput) -> torch.Tensor | None:
    """The gate logits the regime's loss reads: the forward's, except for a decoupled ``recurtrace`` head, whose
    logits (same values) carry no gradient into the state or the shared norm ([RT] / [AD] decoupling; SPEC §5)."""
    if regime.kind == "recurtrace" and regime.detach and model.gate is not None:
        return model.gate_logit(out.hidden, stop_gradient=True)
    return out.gate_logits


def optimiser_step(model, opt, task, regime, cfg: TrainConfig, rng: np.random.Generator,
                   device: str) -> torch.Tensor:
    """One optimiser step on a fit batch drawn from ``rng``: the regime's loss, gradient clipping, AdamW.

    Returns:
        The batch's loss (scalar tensor, before the step).
    """
    idx, tgt = to_torch(task.sample("fit", cfg.batch_size, rng), device)
    out = model(idx)
    loss = regime_loss(regime, out.logits, tgt, training_gate_logits(regime, model, out))
    opt.zero_grad(set_to_none=True)
    loss.backward()
    if regime.kind == "recurtrace" and regime.detach and model.gate is not None:
        # Decoupled head: clip it on its own, so not even the global gradient norm lets the head touch the
        # trajectory's update — the trajectory then trains exactly as the fixed-prior model without a head would
        # (tests/test_halting_regimes.py: bit-identical to `geometric` at the same seed).
        head = [p for n, p in model.named_parameters() if n.startswith("gate.")]
        torch.nn.utils.clip_grad_norm_([p for n, p in model.named_parameters() if not n.startswith("gate.")],
                                       cfg.grad_clip)
        torch.nn.utils.clip_grad_norm_(head, cfg.grad_clip)
    else:
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
    opt.step()
    return loss


def train_model(base: BaseConfig, cfg: TrainConfig, task_name: str, regime_name: str, out_dir: Path,
                progress: bool = True, seed: int | None = None, threads: int | None = None) -> dict:
    """Train one looped model and write ``model.pt``, ``metrics.json`` and ``checkpoints/``.

    The directory is built in :func:`staging_dir` and replaces ``out_dir`` whole when training ends; a killed run
    resumes from its last resume state (every kept checkpoint, and every :data:`RESUME_EVERY_S` seconds) and ends
    bit-identical to an uninterrupted run.

    Args:
        base: shared settings (seed, threads, device).
        cfg: the ``train`` section.
        task_name: key of ``cfg.task_defs``.
        regime_name: key of ``cfg.regime_defs``.
        out_dir: ``artifacts/train/<model>``.
        progress: show a progress bar (it is silent anyway when stderr is not a terminal).
        seed: training seed (model init and fit-data order); None = ``base.seed`` and the unsuffixed model name.
        threads: torch threads (default ``base.threads``).

    Returns:
        The metrics dict written to ``metrics.json``.
    """
    threads = base.threads if threads is None else int(threads)
    torch.set_num_threads(threads)
    named_seed, seed = seed, base.seed if seed is None else int(seed)
    cfg = dataclasses.replace(cfg, steps=cfg.steps_for(task_name))
    task, regime = cfg.task(task_name), cfg.regime(regime_name)
    mcfg = build_model_config(cfg.model, task, regime)
    torch.manual_seed(seed)
    model = LoopedTransformer(mcfg).to(base.device)
    if regime.kind == "recurtrace" and regime.detach:
        # The decoupled head's model starts from the head-less model's weights of the same seed (building the gate
        # draws from the same RNG stream and would shift every later init draw); with its gradient stopped and
        # clipped on its own (optimiser_step), the trajectory then trains bit for bit as the fixed-prior model.
        torch.manual_seed(seed)
        trunk = LoopedTransformer(dataclasses.replace(mcfg, gate="none")).to(base.device)
        missing = model.load_state_dict(trunk.state_dict(), strict=False).missing_keys
        assert all(k.startswith("gate.") for k in missing), missing
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    betas = cast(tuple[float, float], tuple(cfg.betas))  # two, checked by TrainConfig
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=betas)
    rng = np.random.default_rng([cfg.data_seeds.fit, SPLITS.index("fit"), seed])
    val = task.dataset("val", cfg.val_sequences, cfg.data_seeds.val)
    out_dir = Path(out_dir)
    ckpt_steps = sorted({max(1, round(f * cfg.steps)) for f in cfg.checkpoint_fractions if 0 < f < 1})
    name = model_name(task_name, regime_name, named_seed)
    meta = {"name": name, "task": task.spec() | {"name": task_name}, "regime": to_dict(regime) | {"name": regime_name},
            "seed": seed, "data_seeds": to_dict(cfg.data_seeds), "threads": threads,
            "train": to_dict(cfg) | {"task_defs": None, "regime_defs": None}, "versions": versions()}
    # The run is built in a staging dir and swapped in whole at the end, so out_dir only ever holds one finished
    # run (a retrain or a killed run never mixes its checkpoints/ with an earlier run's). A killed run's staging
    # dir keeps its kept checkpoints and a resume state (weights, AdamW moments, data RNG): the next run with the
    # same fingerprint continues from there and ends bit-identical to an uninterrupted run; any other is removed.
    stage, fingerprint = staging_dir(out_dir), _fingerprint(meta, str(base.device))
    resume = _load_resume(stage, fingerprint)
    if resume is None:
        shutil.rmtree(stage, ignore_errors=True)
    (stage / "checkpoints").mkdir(parents=True, exist_ok=True)
    history, loss_ema, start, spent = [], None, 0, (0.0, 0.0)
    if resume is not None:
        model.load_state_dict(resume["model"])
        opt.load_state_dict(resume["opt"])
        rng.bit_generator.state = json.loads(resume["rng"])
        torch.set_rng_state(resume["torch_rng"])
        history, loss_ema, start = json.loads(resume["history"]), resume["loss_ema"], int(resume["step"])
        spent = (float(resume["seconds"]), float(resume["cpu_seconds"]))
        for stale in (stage / "checkpoints").glob("step_*.pt"):  # written after the resume state was saved
            if int(stale.stem.split("_")[1]) > start:
                stale.unlink()
        for tmp in stage.rglob("*.tmp"):  # a save the kill cut short (it would be swapped in with the rest)
            tmp.unlink()

    def save_resume(done: int) -> None:
        _save_resume(stage, {"fingerprint": fingerprint, "step": done, "model": model.state_dict(),
                             "opt": opt.state_dict(), "rng": json.dumps(rng.bit_generator.state),
                             "torch_rng": torch.get_rng_state(), "loss_ema": loss_ema, "history": json.dumps(history),
                             "seconds": spent[0] + time.perf_counter() - t0,
                             "cpu_seconds": spent[1] + time.process_time() - cpu0})

    t0, cpu0 = time.perf_counter(), time.process_time()
    last_save = t0
    bar = tqdm(range(start, cfg.steps), desc=f"train {name}", disable=None if progress else True, leave=False,
               initial=start, total=cfg.steps)
    for step in bar:
        model.train()
        for g in opt.param_groups:
            g["lr"] = lr_at(step, cfg)
        loss = optimiser_step(model, opt, task, regime, cfg, rng, base.device)
        loss_ema = loss.item() if loss_ema is None else 0.98 * loss_ema + 0.02 * loss.item()
        if step % 25 == 0:
            bar.set_postfix(loss=f"{loss_ema:.4f}")
        if step + 1 in ckpt_steps:
            ev = evaluate(model, val, base.device)
            history.append({"step": step + 1, "fraction": (step + 1) / cfg.steps,
                            "acc_per_loop": ev["acc_per_loop"], "loss_per_loop": ev["loss_per_loop"]})
            save_checkpoint(stage / "checkpoints" / f"step_{step + 1:06d}.pt", model,
                            **meta, step=step + 1, fraction=(step + 1) / cfg.steps, metrics=ev)
        if step + 1 < cfg.steps and (step + 1 in ckpt_steps or time.perf_counter() - last_save >= RESUME_EVERY_S):
            save_resume(step + 1)
            last_save = time.perf_counter()
    bar.close()
    seconds, cpu_seconds = spent[0] + time.perf_counter() - t0, spent[1] + time.process_time() - cpu0
    ev = evaluate(model, val, base.device)
    history.append({"step": cfg.steps, "fraction": 1.0, "acc_per_loop": ev["acc_per_loop"],
                    "loss_per_loop": ev["loss_per_loop"]})
    acc = ev["acc_per_loop"]
    metrics = {
        "model": name, "task": task_name, "regime": regime_name, "seed": seed, "steps": cfg.steps,
        "n_params": model.num_params(), "train_seconds": round(seconds, 2), "train_cpu_seconds": round(cpu_seconds, 2),
        "threads": threads, "final_train_loss": loss_ema,
        "val_acc_last_loop": acc[-1], "val_acc_best_loop": max(acc), "best_loop": int(np.argmax(acc)) + 1,
        "val": {"acc_per_loop": acc, "loss_per_loop": ev["loss_per_loop"], "n_tokens": ev["n_tokens"]},
        "val_acc_by_difficulty": ev["acc_by_difficulty"],
        "history": history,
    }
    # Wall-clock figures go to metrics.json only: model.pt's sha256 is the checkpoint hash every store records, so
    # identical weights retrained must write identical bytes.
    timeless = {k: v for k, v in metrics.items() if not k.endswith("seconds")}
    save_checkpoint(stage / "model.pt", model, **meta, step=cfg.steps, fraction=1.0, metrics=timeless)
    (stage / "metrics.json").write_text(json.dumps(metrics, indent=2))
    (stage / "resume.pt").unlink(missing_ok=True)
    swap_in(stage, out_dir)  # the whole model dir at once (a kill between its renames: stage_output tidies)
    return metrics


def _train_job(args: tuple) -> dict:
    base, cfg, task_name, regime_name, out_dir, seed, threads = args
    return train_model(base, cfg, task_name, regime_name, out_dir, progress=False, seed=seed, threads=threads)


def train_seeds(base: BaseConfig, cfg: TrainConfig, jobs: list[tuple[str, str]], out_root: Path,
                progress: bool = True) -> list[dict]:
    """Train every seed of ``cfg.seeds`` for each (task, regime) of ``jobs``: ``<out_root>/<task>-<regime>-s<seed>``.

    The (task, regime, seed) models are independent; ``cfg.workers`` processes train them in parallel, each with
    :meth:`TrainConfig.model_threads` torch threads. A model's weights depend only on its task, regime, seed, the
    train section and its thread count — not on the worker count, the other seeds, or the order — so a seed trained
    here is bit-for-bit the seed trained alone with :func:`train_model` (``tests/test_train.py``).

    Why processes and not one batched ensemble (stacked weights, ``vmap``): training these models on this CPU is
    compute-bound (``mm``/``addmm`` ~half of a step, near single-thread peak), so folding three members into one
    batched pass cost 2.7–3.0× one member (stacked weights; and members were no longer bit-identical to lone
    models) or more than three lone models (per-member weights, bit-identical); a second core is the only real
    saving (docs/train.md).

    Returns:
        The metrics of every model, in (job, seed) order.
    """
    threads = cfg.model_threads(base)
    work = [(base, cfg, t, r, Path(out_root) / model_name(t, r, s), s, threads)
            for t, r in jobs for s in cfg.seed_list()]
    if cfg.workers == 1 or len(work) == 1:
        return [train_model(*w[:5], progress=progress, seed=w[5], threads=w[6]) for w in work]

    # spawn: a fresh interpreter per worker (forking a process whose OpenMP pool is running can deadlock)
    with mp.get_context("spawn").Pool(min(cfg.workers, len(work)), maxtasksperchild=1) as pool:
        return pool.map(_train_job, work, chunksize=1)
