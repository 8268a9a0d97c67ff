"""Training of looped models under a depth-supervision regime (the ``train`` stage).

The loop is written out (nanoGPT style): fresh data from the ``fit`` split every step, AdamW with
linear warm-up and cosine decay, gradient clipping, per-loop evaluation on ``val`` at every kept
checkpoint and at the stopping criterion's fixed step intervals (:class:`StopConfig`). Everything is seeded from
``base.seed`` and the data seeds, so the same params give the same weights and the same numbers on one CPU kernel
path. :func:`train_models` trains the models of the matrix in a pool of processes, each bit for bit as trained
alone.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import multiprocessing as mp
import os
import queue as queue_mod
import shutil
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, cast

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
from looptrace.io.guard import CURRENT_STAGE
from looptrace.io.manifest import MANIFEST, build_manifest
from looptrace.io.parallel import watch_parent
from looptrace.models.looped import (
    LOOP_FORMS,
    GroupConfig,
    LoopedTransformer,
    LoopOutput,
    ModelConfig,
    save_checkpoint,
)
from looptrace.models.regimes import RegimeConfig, per_depth_loss, regime_loss
from looptrace.project import host_cores, model_name, source_hash, versions
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
class StopConfig:
    """``train.stop``: when a model's training ends (docs/train.md "Stopping criterion"; SPEC §5 "Training length").

    With a ``target``, the model is evaluated on the fixed val set (``train.val_sequences`` sequences of data seed
    ``train.data_seeds.val``) after every ``every`` optimiser steps, and training stops after the first evaluation
    that completes ``patience`` consecutive evaluations whose full-depth (loop T) accuracy is ≥ ``target``, or at the
    step cap (:meth:`cap`), whichever comes first. Past the schedule's ``steps`` the learning rate stays at
    ``min_lr`` for ``hold × steps`` steps (a model that nearly holds the target gets there), then the schedule
    starts again (warm-up, cosine over ``steps``: a model stuck below the target at ``min_lr`` gets another cycle),
    and so on. The schedule does not depend on the criterion and an evaluation draws from no RNG, so the weights at a
    step are the same whatever the criterion: it only decides where the run ends, by the same rule at the same steps
    on every machine. Without a ``target`` the run trains exactly ``steps`` (a fixed budget). Never wall time.

    Attributes:
        target: full-depth val accuracy (fraction) a model must hold; null = a fixed budget of ``steps``.
        patience: consecutive evaluations at or above ``target`` (k).
        every: optimiser steps between two evaluations.
        hold: steps at ``min_lr`` after each cycle of the schedule before it starts again, as a fraction of
            ``steps``; null = ``min_lr`` until the cap (never again).
        cycles: the step cap in periods of the schedule: ``cycles × (steps + round(hold × steps))``
            (``cycles × steps`` with ``hold`` null).
    """

    target: Annotated[float, Check(gt=0, le=1, why="a full-depth val accuracy (fraction)")] | None = None
    patience: Annotated[int, Check(ge=1, why="consecutive evaluations")] = 3
    every: Annotated[int, Check(ge=1, why="optimiser steps between evaluations")] = 100
    hold: Annotated[float, Check(ge=0, why="steps at min_lr between two cycles, a fraction of train.steps")] | None = None
    cycles: Annotated[int, Check(ge=1, why="the step cap in periods of the schedule")] = 2

    def period(self, steps: int) -> int | None:
        """Steps of one period of the learning-rate schedule (a cycle and its hold); None: it never restarts."""
        return None if self.hold is None else steps + round(self.hold * steps)

    def cap(self, steps: int) -> int:
        """The last step a model of a ``steps``-step schedule may train to (``steps`` without a target)."""
        if self.target is None:
            return steps
        return self.cycles * (self.period(steps) or steps)


@dataclass(frozen=True)
class TrainConfig:
    """``train`` section of ``params.yaml``.

    Attributes:
        tasks: task names trained in the default matrix (keys of ``task_defs``).
        regimes: regime names trained in the default matrix (keys of ``regime_defs``).
        task_defs: every available task, by name.
        regime_defs: every available regime, by name.
        model: architecture.
        steps: length of the learning-rate schedule (warm-up, cosine decay to ``min_lr`` at this step; ``min_lr``
            after it); without ``stop.target`` also the optimiser steps taken.
        steps_by_task: per-task override of ``steps`` (tasks learn at different speeds).
        stop: when training ends (:class:`StopConfig`).
        batch_size: sequences per step (fresh from the fit split each step).
        lr, min_lr: peak and final learning rate (cosine decay after ``warmup`` steps).
        betas, weight_decay, grad_clip: AdamW settings and gradient-norm clip.
        val_sequences: sequences of the val split used for metrics and the stopping criterion.
        checkpoint_fractions: fractions of ``steps`` at which an intermediate checkpoint is kept
            ([TS] measures loop dynamics across training); one the run stops before is not written.
        data_seeds: seeds of the fit / val / test splits.
        seeds: training seeds of every task × regime (model init and fit-data order); each trains its own model
            ``<task>-<regime>-s<seed>``. Empty: the one seed ``base.seed``, named ``<task>-<regime>``.
        workers: processes that train the models of the matrix at once (:func:`train_models`); null = on the CPU
            the cores this process may use // the threads of one model, on an accelerator 1. Never part of a model:
            a model trained in a pool is bit for bit the model trained alone.
        threads_per_model: torch threads of each model's training; null = ``base.threads``. Part of what defines a
            checkpoint (recorded in it): the same seed trained with another thread count may differ in the last
            bits.
    """

    tasks: tuple[str, ...] = ("running_sum",)
    regimes: tuple[str, ...] = ("uniform",)
    task_defs: dict[str, TaskConfig] = field(default_factory=dict)
    regime_defs: dict[str, RegimeConfig] = field(default_factory=dict)
    model: ModelParams = field(default_factory=ModelParams)
    steps: Annotated[int, Check(ge=1, why="optimiser steps; 0 would save an untrained model")] = 1500
    steps_by_task: dict[str, Annotated[int, Check(ge=1, why="optimiser steps")]] = field(default_factory=dict)
    stop: StopConfig = field(default_factory=StopConfig)
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
    workers: Annotated[int, Check(ge=1, why="models trained at once")] | None = None
    threads_per_model: Annotated[int, Check(ge=1, why="torch threads")] | None = None

    def __post_init__(self) -> None:
        if len(self.betas) != 2:
            raise ConfigError(f"train.betas = {list(self.betas)}: AdamW takes two betas; write [0.9, 0.98]")
        if self.min_lr > self.lr:
            raise ConfigError(f"train.min_lr = {self.min_lr} exceeds train.lr = {self.lr}; set min_lr ≤ lr")
        if len(set(self.seeds)) != len(self.seeds):
            raise ConfigError(f"train.seeds has duplicates: {list(self.seeds)}")

    def seed_list(self) -> list[int | None]:
        """The seeds to train: ``seeds``, or ``[None]`` (= ``base.seed`` under the unsuffixed name)."""
        return list(self.seeds) if self.seeds else [None]

    def model_threads(self, base_threads: int) -> int:
        """Torch threads of one model's training (:attr:`threads_per_model`, else ``base.threads``)."""
        return self.threads_per_model if self.threads_per_model is not None else base_threads

    def pool_size(self, base_threads: int, device: str, models: int) -> int:
        """Processes :func:`train_models` trains ``models`` models in (:attr:`workers`; null = on the CPU the
        cores // the threads of a model, on an accelerator one: the device is the shared resource)."""
        if self.workers is not None:
            n = self.workers
        else:
            n = host_cores() // self.model_threads(base_threads) if str(device) == "cpu" else 1
        return max(1, min(n, models))

    def task(self, name: str) -> Task:
        if name not in self.task_defs:
            raise ConfigError(f"task '{name}' is not defined in params section 'train.task_defs' "
                             f"(defined: {', '.join(self.task_defs) or 'none'})")
        return make_task(name, self.task_defs[name])

    def steps_for(self, task: str) -> int:
        """Schedule steps for ``task`` (``steps_by_task`` overrides ``steps``)."""
        return self.steps_by_task.get(task, self.steps)

    def regime(self, name: str) -> RegimeConfig:
        if name not in self.regime_defs:
            raise ConfigError(f"regime '{name}' is not defined in params section 'train.regime_defs' "
                             f"(defined: {', '.join(self.regime_defs) or 'none'})")
        return self.regime_defs[name]

    def matrix(self) -> list[tuple[str, str, int | None]]:
        """The default matrix: (task, regime, seed) of ``tasks`` × ``regimes`` × :meth:`seed_list`, in that order."""
        return [(t, r, s) for t in self.tasks for r in self.regimes for s in self.seed_list()]


#: Keys of the train section that choose *which* models are trained and how many at once, not how one is trained:
#: left out of what a checkpoint records (and of its fingerprint), so adding a seed to ``train.seeds`` leaves the
#: other models' bytes, and DVC's downstream stages of them, as they were. ``steps_by_task`` is recorded as the
#: model's own ``steps``, ``threads_per_model`` as its ``threads``.
MATRIX_KEYS = ("tasks", "regimes", "task_defs", "regime_defs", "seeds", "workers", "steps_by_task", "threads_per_model")


def recipe(cfg: TrainConfig, task: str) -> dict:
    """The train section as one model of ``task`` records it: :data:`MATRIX_KEYS` out, ``steps`` = the task's."""
    out = to_dict(dataclasses.replace(cfg, steps=cfg.steps_for(task)))
    if cfg.stop.target is None:  # a fixed budget: the criterion's other settings change nothing
        out["stop"] = {"target": None}
    return {k: v for k, v in out.items() if k not in MATRIX_KEYS}



def build_model_config(mp: ModelParams, task: Task, regime: RegimeConfig) -> ModelConfig:
    return ModelConfig(
        vocab_size=task.vocab_size, block_size=task.seq_len, d_model=mp.d_model, n_head=mp.n_head,
        n_prelude=mp.n_prelude, groups=mp.groups, n_coda=mp.n_coda, causal=task.causal,
        reinject=mp.reinject, gate=regime.model_gate, gate_hidden=mp.gate_hidden,
        tie_embeddings=mp.tie_embeddings, mlp_ratio=mp.mlp_ratio, loop_form=mp.loop_form,
        loop_memory=mp.loop_memory if regime.loop_memory is None else regime.loop_memory,
    )


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up to ``lr``, then cosine decay to ``min_lr`` at ``steps``; past ``steps`` (a run the stopping
    criterion takes on) ``min_lr`` for ``stop.hold × steps`` steps, then the same schedule again (null: ``min_lr``
    on)."""
    period = cfg.stop.period(cfg.steps)
    if period is not None:
        step %= period
    if step >= cfg.steps:
        return cfg.min_lr
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


#: Modules whose code decides a trained model (weights and recorded metrics). Their source is part of a run's
#: fingerprint: DVC re-runs the stage when one of them changes, and a model directory holding a run of the earlier
#: code must then be trained again, not kept as up to date; a resume likewise never mixes two versions of the code.
TRAIN_MODULES = ("looptrace.models.train", "looptrace.models.looped", "looptrace.models.invariant",
                 "looptrace.models.regimes", "looptrace.signals.halting", "looptrace.signals.halting_torch",
                 "looptrace.tasks", "looptrace.tasks.base", "looptrace.tasks.mano",
                 "looptrace.tasks.parity", "looptrace.tasks.running")


@functools.cache
def _code_hash() -> str:
    """sha256 of the source of :data:`TRAIN_MODULES`."""
    return source_hash(TRAIN_MODULES)


def _fingerprint(meta: dict, device: str) -> str:
    """What a run is: everything the weights depend on (task, regime, seed, the model's recipe, threads, CPU kernel
    path, versions: ``meta``), the device and the code of :data:`TRAIN_MODULES`. A resume state continues only a run
    of the same fingerprint, and a finished model directory of the same fingerprint is kept (:func:`finished_run`)."""
    doc = {"meta": meta, "device": device, "code": _code_hash()}
    return hashlib.sha256(json.dumps(doc, sort_keys=True, default=str).encode()).hexdigest()


def cpu_capability() -> str:
    """The CPU kernel path torch's ATen runs on this machine (``AVX512``, ``AVX2``, ``DEFAULT`` ...; env
    ``ATEN_CPU_CAPABILITY`` lowers it): the same seed trained on two of them differs in the last bits."""
    return str(torch.backends.cpu.get_cpu_capability())


@dataclass(frozen=True)
class RunPlan:
    """One model's run before it trains: its name, the metadata every checkpoint of it records, and its
    fingerprint (:func:`_fingerprint`)."""

    name: str
    seed: int
    threads: int
    meta: dict
    fingerprint: str


def plan_run(base: BaseConfig, cfg: TrainConfig, task_name: str, regime_name: str, seed: int | None = None,
             threads: int | None = None) -> RunPlan:
    """The :class:`RunPlan` of ``task_name`` × ``regime_name`` × ``seed`` (None = ``base.seed``, unsuffixed name) at
    ``threads`` torch threads (None = :meth:`TrainConfig.model_threads`)."""
    threads = cfg.model_threads(base.threads) if threads is None else int(threads)
    task, regime = cfg.task(task_name), cfg.regime(regime_name)
    run_seed = base.seed if seed is None else int(seed)
    meta = {"name": model_name(task_name, regime_name, seed), "task": task.spec() | {"name": task_name},
            "regime": to_dict(regime) | {"name": regime_name}, "seed": run_seed, "data_seeds": to_dict(cfg.data_seeds),
            "threads": threads, "train": recipe(cfg, task_name), "versions": versions()}
    if str(base.device) == "cpu":
        meta["cpu_capability"] = cpu_capability()
    return RunPlan(meta["name"], run_seed, threads, meta, _fingerprint(meta, str(base.device)))


def finished_run(out_dir: Path | str, fingerprint: str) -> dict | None:
    """The metrics of the finished run in ``out_dir`` if it is the run ``fingerprint`` names and every file of the
    directory matches its manifest (nothing added, removed or changed since it was written); else None."""
    out_dir = Path(out_dir)
    try:
        metrics = json.loads((out_dir / "metrics.json").read_text())
        manifest = json.loads((out_dir / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(metrics, dict) or metrics.get("fingerprint") != fingerprint or not isinstance(manifest, dict):
        return None
    stage = CURRENT_STAGE.get()
    if manifest.get("stage") != stage or manifest.get("files") != build_manifest(out_dir, stage)["files"]:
        return None
    return metrics


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


#: ``progress`` of :func:`train_model` may be a callable: ``(steps done, step cap, status text)``, called every
#: :data:`REPORT_EVERY` steps, at every evaluation and at the end (the pool's progress lines).
Reporter = Callable[[int, int, str], None]
REPORT_EVERY = 25


def train_model(base: BaseConfig, cfg: TrainConfig, task_name: str, regime_name: str, out_dir: Path,
                progress: bool | Reporter = True, seed: int | None = None, threads: int | None = None) -> dict:
    """Train one looped model and write ``model.pt``, ``metrics.json`` and ``checkpoints/``.

    The run ends on ``cfg.stop`` (:class:`StopConfig`): the criterion on the fixed val set, or the step cap, or
    without a target after ``steps``. The directory is built in :func:`staging_dir` and replaces ``out_dir`` whole
    when training ends; a killed run resumes from its last resume state (every kept checkpoint, and every
    :data:`RESUME_EVERY_S` seconds) and ends bit-identical to an uninterrupted run. An ``out_dir`` that already
    holds this very run (:func:`finished_run`) is kept as it is.

    Args:
        base: shared settings (seed, threads, device).
        cfg: the ``train`` section.
        task_name: key of ``cfg.task_defs``.
        regime_name: key of ``cfg.regime_defs``.
        out_dir: ``artifacts/train/<model>``.
        progress: show a progress bar (silent anyway when stderr is not a terminal), or a :data:`Reporter`.
        seed: training seed (model init and fit-data order); None = ``base.seed`` and the unsuffixed model name.
        threads: torch threads (default :meth:`TrainConfig.model_threads`).

    Returns:
        The metrics dict written to ``metrics.json``.
    """
    plan = plan_run(base, cfg, task_name, regime_name, seed, threads)
    out_dir = Path(out_dir)
    done_before = finished_run(out_dir, plan.fingerprint)
    if done_before is not None:
        return done_before
    threads, seed, name, meta, fingerprint = plan.threads, plan.seed, plan.name, plan.meta, plan.fingerprint
    torch.set_num_threads(threads)
    steps = cfg.steps_for(task_name)
    cfg = dataclasses.replace(cfg, steps=steps)
    stop, cap = cfg.stop, cfg.stop.cap(steps)
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
    ckpt_steps = sorted({max(1, round(f * steps)) for f in cfg.checkpoint_fractions if 0 < f < 1})
    # The run is built in a staging dir and swapped in whole at the end, so out_dir only ever holds one finished
    # run (a retrain or a killed run never mixes its checkpoints/ with an earlier run's). A killed run's staging
    # dir keeps its kept checkpoints and a resume state (weights, AdamW moments, data RNG, the criterion's streak):
    # the next run with the same fingerprint continues from there and ends bit-identical to an uninterrupted run;
    # any other is removed.
    stage = staging_dir(out_dir)
    resume = _load_resume(stage, fingerprint)
    if resume is None:
        shutil.rmtree(stage, ignore_errors=True)
    (stage / "checkpoints").mkdir(parents=True, exist_ok=True)
    history: list[dict] = []
    loss_ema: float | None = None
    start, spent, streak = 0, (0.0, 0.0), 0
    # The best evaluation so far (full-depth val accuracy, its step, its weights): a run that reaches the cap
    # without holding the target ends with these weights, not with wherever the last cycle left it.
    best: dict[str, Any] = {"acc": -1.0, "step": None, "state": None}
    if resume is not None:
        model.load_state_dict(resume["model"])
        opt.load_state_dict(resume["opt"])
        rng.bit_generator.state = json.loads(resume["rng"])
        torch.set_rng_state(resume["torch_rng"])
        history, loss_ema, start = json.loads(resume["history"]), resume["loss_ema"], int(resume["step"])
        spent, streak = (float(resume["seconds"]), float(resume["cpu_seconds"])), int(resume["streak"])
        best = resume["best"]
        for stale in (stage / "checkpoints").glob("step_*.pt"):  # written after the resume state was saved
            if int(stale.stem.split("_")[1]) > start:
                stale.unlink()
        for tmp in stage.rglob("*.tmp"):  # a save the kill cut short (it would be swapped in with the rest)
            tmp.unlink()

    def save_resume(done: int) -> None:
        _save_resume(stage, {"fingerprint": fingerprint, "step": done, "model": model.state_dict(),
                             "opt": opt.state_dict(), "rng": json.dumps(rng.bit_generator.state),
                             "torch_rng": torch.get_rng_state(), "loss_ema": loss_ema, "history": json.dumps(history),
                             "streak": streak, "best": best, "seconds": spent[0] + time.perf_counter() - t0,
                             "cpu_seconds": spent[1] + time.process_time() - cpu0})

    def record(done: int) -> dict:
        ev = evaluate(model, val, base.device)
        history.append({"step": done, "fraction": done / steps, "acc_per_loop": ev["acc_per_loop"],
                        "loss_per_loop": ev["loss_per_loop"]})
        return ev

    def status() -> str:
        text = f"loss {loss_ema:.4f}" if loss_ema is not None else ""
        if history:
            text += f", val {history[-1]['acc_per_loop'][-1]:.4f}"
        return text + (f" ({streak}/{stop.patience} ≥ {stop.target})" if stop.target is not None else "")

    show = progress if callable(progress) else None
    bar = tqdm(total=cap, initial=start, desc=f"train {name}", disable=None if progress is True else True,
               leave=False)
    t0, cpu0 = time.perf_counter(), time.process_time()
    last_save, done, ev, reason = t0, start, None, "budget" if stop.target is None else "step_cap"
    for step in range(start, cap):
        model.train()
        for g in opt.param_groups:
            g["lr"] = lr_at(step, cfg)
        loss = optimiser_step(model, opt, task, regime, cfg, rng, base.device)
        loss_ema = loss.item() if loss_ema is None else 0.98 * loss_ema + 0.02 * loss.item()
        done, ev = step + 1, None
        if stop.target is not None and done % stop.every == 0:
            ev = record(done)
            streak = streak + 1 if ev["acc_per_loop"][-1] >= stop.target else 0
            if ev["acc_per_loop"][-1] > best["acc"]:  # strictly better: the earliest step of a tie
                best = {"acc": ev["acc_per_loop"][-1], "step": done,
                        "state": {k: v.detach().clone() for k, v in model.state_dict().items()}}
            if streak >= stop.patience:
                reason = "criterion"
                break
        if done in ckpt_steps:
            ev = ev or record(done)
            save_checkpoint(stage / "checkpoints" / f"step_{done:06d}.pt", model,
                            **meta, step=done, fraction=done / steps, metrics=ev)
        if done < cap and (done in ckpt_steps or time.perf_counter() - last_save >= RESUME_EVERY_S):
            save_resume(done)
            last_save = time.perf_counter()
        if done % REPORT_EVERY == 0 or ev is not None:
            bar.update(done - bar.n)
            bar.set_postfix_str(status(), refresh=False)
            if show is not None:
                show(done, cap, status())
    bar.close()
    seconds, cpu_seconds = spent[0] + time.perf_counter() - t0, spent[1] + time.process_time() - cpu0
    if ev is None:
        ev = record(done)
    restored = None
    if reason == "step_cap" and best["step"] is not None and best["acc"] > ev["acc_per_loop"][-1]:
        # The cap without the target: keep the best evaluated weights (early stopping's restore; the val set chose
        # them, the test split never did). Their evaluation is the history's entry at that step.
        model.load_state_dict(best["state"])
        restored = int(best["step"])
        ev = evaluate(model, val, base.device)
    acc = ev["acc_per_loop"]
    target_steps = [h["step"] for h in history if stop.target is not None and h["step"] % stop.every == 0
                    and h["acc_per_loop"][-1] >= stop.target]
    metrics = {
        "model": name, "task": task_name, "regime": regime_name, "seed": seed, "steps": done,
        "stop": {"reason": reason, "steps": done, "schedule_steps": steps, "cap": cap, "target": stop.target}
        | ({"patience": stop.patience, "every": stop.every, "hold": stop.hold, "cycles": stop.cycles,
            "first_step_at_target": target_steps[0] if target_steps else None, "restored_step": restored}
           if stop.target is not None else {}),
        "n_params": model.num_params(), "train_seconds": round(seconds, 2), "train_cpu_seconds": round(cpu_seconds, 2),
        "threads": threads, "final_train_loss": loss_ema,
        "val_acc_last_loop": acc[-1], "val_acc_best_loop": max(acc), "best_loop": int(np.argmax(acc)) + 1,
        "val": {"acc_per_loop": acc, "loss_per_loop": ev["loss_per_loop"], "n_tokens": ev["n_tokens"]},
        "val_acc_by_difficulty": ev["acc_by_difficulty"],
        "history": history,
    }
    if show is not None:  # the run's length is known now: its line ends full
        show(done, done, f"{reason} at step {done}, val {acc[-1]:.4f}")
    # Wall-clock figures go to metrics.json only: model.pt's sha256 is the checkpoint hash every store records, so
    # identical weights retrained must write identical bytes (the fingerprint, which hashes the code, likewise).
    timeless = {k: v for k, v in metrics.items() if not k.endswith("seconds")}
    at = done if restored is None else restored  # the step whose weights these are
    save_checkpoint(stage / "model.pt", model, **meta, step=at, fraction=at / steps, metrics=timeless)
    (stage / "metrics.json").write_text(json.dumps(metrics | {"fingerprint": fingerprint}, indent=2))
    (stage / "resume.pt").unlink(missing_ok=True)
    swap_in(stage, out_dir)  # the whole model dir at once (a kill between its renames: stage_output tidies)
    return metrics


def summary_line(metrics: dict) -> str:
    """One line per trained model: name, how the run ended, full-depth val accuracy, val accuracy per loop."""
    st = metrics.get("stop") or {}
    acc = " ".join(f"{a:.3f}" for a in metrics["val"]["acc_per_loop"])
    return (f"{metrics['model']}: {st.get('reason', 'budget')} at step {metrics['steps']}, val accuracy per loop "
            f"{acc} ({metrics['train_seconds']:.0f} s)")


# ------------------------------------------------------------------------------------------------ the pool

_QUEUE: Any = None


def _worker_init(queue: Any, stage: str | None, parent: int) -> None:
    """A pool worker: where to report progress, which stage writes (the manifests name it), and a watchdog that
    ends the worker when its parent is gone (a killed stage leaves no orphan writing on; its staging dirs keep the
    resume states the re-run continues from)."""
    global _QUEUE
    _QUEUE = queue
    CURRENT_STAGE.set(stage)
    watch_parent(parent)


def _train_job(args: tuple) -> dict:
    index, base, cfg, task_name, regime_name, out_dir, seed, threads = args

    def report(done: int, total: int, text: str) -> None:
        _QUEUE.put((index, done, total, text))

    return train_model(base, cfg, task_name, regime_name, out_dir, progress=report, seed=seed, threads=threads)


class _Lines:
    """One progress line per model (tqdm; silent when stderr is not a terminal), fed from any process."""

    def __init__(self, names: list[str], totals: list[int], enabled: bool) -> None:
        self.bars = [tqdm(total=t, desc=f"train {n}", position=i, leave=True, disable=None if enabled else True)
                     for i, (n, t) in enumerate(zip(names, totals, strict=True))]
        self.started: set[int] = set()
        self.closed: set[int] = set()

    def reporter(self, i: int) -> Reporter:
        return lambda done, total, text: self.update(i, done, total, text)

    def update(self, i: int, done: int, total: int, text: str) -> None:
        bar = self.bars[i]
        if i in self.closed:
            return
        if i not in self.started:  # its clock starts with its model's training, not with the pool
            self.started.add(i)
            bar.reset(total=total)
        if total != bar.total:
            bar.total = total
        bar.update(done - bar.n)
        bar.set_postfix_str(text)

    def drain(self, queue: Any) -> None:
        while True:
            try:
                self.update(*queue.get_nowait())
            except queue_mod.Empty:
                return

    def finish(self, i: int, metrics: dict) -> None:
        """Model ``i`` is done: its line shows how it ended and stops its clock (closed, kept on screen); a report
        still on its way from the worker is dropped."""
        st = metrics.get("stop") or {}
        self.update(i, metrics["steps"], metrics["steps"],
                    f"{st.get('reason', 'budget')} at step {metrics['steps']}, val {metrics['val_acc_last_loop']:.4f}")
        self.bars[i].close()
        self.closed.add(i)

    def close(self) -> None:
        for bar in reversed(self.bars):
            bar.close()


def train_models(base: BaseConfig, cfg: TrainConfig, models: list[tuple[str, str, int | None]], out_root: Path | str,
                 progress: bool = True, echo: Callable[[str], None] | None = None) -> list[dict]:
    """Train ``models`` ((task, regime, seed) each; :meth:`TrainConfig.matrix`) into ``<out_root>/<model>``, at most
    :meth:`TrainConfig.pool_size` at once.

    The models are independent: each trains in one of the pool's spawned processes on
    :meth:`TrainConfig.model_threads` torch threads, and its weights depend only on its task, regime, seed, recipe,
    thread count and the CPU kernel path — not on the pool size, the other models or the order — so a model trained
    here is bit for bit the model trained alone with :func:`train_model` (``tests/test_train.py``). The longest
    schedules start first. A model whose directory already holds this very run is kept (:func:`finished_run`); a
    killed pool leaves every finished model whole and each unfinished one's resume state, so a re-run trains only
    the rest, from where each stopped. With ``pool_size`` 1 the models train one after another in this process.

    Why processes and not one batched ensemble (stacked weights, ``vmap``): training these models on a CPU is
    compute-bound (``mm``/``addmm`` ~half of a step, near single-thread peak), so folding three members into one
    batched pass cost 2.7–3.0× one member (stacked weights; and members were no longer bit-identical to lone
    models) or more than three lone models (per-member weights, bit-identical); another core is the only real
    saving (docs/train.md "Seeds").

    Args:
        base: shared settings (seed, threads, device).
        cfg: the ``train`` section.
        models: (task, regime, seed) to train; seed None = ``base.seed`` under the unsuffixed name.
        out_root: ``artifacts/train``.
        progress: one progress line per model (silent when stderr is not a terminal).
        echo: called with :func:`summary_line` of each model as it finishes (or is found up to date).

    Returns:
        The metrics of every model, in the order of ``models``.
    """
    threads = cfg.model_threads(base.threads)
    lean = BaseConfig(seed=base.seed, threads=base.threads, device=base.device)  # what a model's run reads of base
    outs = [Path(out_root) / model_name(t, r, s) for t, r, s in models]
    results: dict[int, dict] = {}
    todo = []
    for i, ((t, r, s), out) in enumerate(zip(models, outs, strict=True)):
        done = finished_run(out, plan_run(lean, cfg, t, r, s, threads).fingerprint)
        if done is None:
            todo.append(i)
            continue
        results[i] = done
        if echo is not None:
            echo(f"{done['model']}: up to date ({summary_line(done).split(': ', 1)[1]})")
    todo.sort(key=lambda i: -cfg.stop.cap(cfg.steps_for(models[i][0])))  # longest first (stable: matrix order)
    caps = [cfg.stop.cap(cfg.steps_for(models[i][0])) for i in todo]
    lines = _Lines([outs[i].name for i in todo], caps, progress)

    def finished(k: int, metrics: dict) -> None:
        results[todo[k]] = metrics
        lines.finish(k, metrics)
        if echo is not None:
            with tqdm.external_write_mode():
                echo(summary_line(metrics))

    try:
        n = cfg.pool_size(base.threads, base.device, len(todo))
        if n == 1:
            for k, i in enumerate(todo):
                t, r, s = models[i]
                finished(k, train_model(lean, cfg, t, r, outs[i], progress=lines.reporter(k), seed=s, threads=threads))
        elif todo:
            # spawn: a fresh interpreter per worker (forking a process whose OpenMP pool is running can deadlock).
            # A worker trains one model after another, as the serial path does in this process: a run seeds and
            # sets everything it depends on itself (tests/test_train.py: serial and pooled bytes are equal).
            ctx = mp.get_context("spawn")
            queue = ctx.Queue()
            with ProcessPoolExecutor(n, mp_context=ctx, initializer=_worker_init,
                                     initargs=(queue, CURRENT_STAGE.get(), os.getpid())) as pool:
                futures = {pool.submit(_train_job, (k, lean, cfg, *models[i][:2], outs[i], models[i][2], threads)): k
                           for k, i in enumerate(todo)}
                pending = set(futures)
                try:
                    while pending:
                        ready, pending = wait(pending, timeout=0.2, return_when=FIRST_COMPLETED)
                        lines.drain(queue)
                        for f in ready:
                            finished(futures[f], f.result())
                except BaseException:
                    for f in pending:
                        f.cancel()
                    raise
                lines.drain(queue)
    finally:
        lines.close()
    return [results[i] for i in range(len(models))]
