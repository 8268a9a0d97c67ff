"""Synthetic tasks (SPEC §6, §9): MANO, whole-string parity, running parity, running sum mod m.

Every task is deterministic from seeds, labels each scored position with a difficulty and a token
type, and draws three content-disjoint splits (fit / val / test, see :func:`base.split_of`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from looptrace.config import Check, ConfigError, NonNegInt, PosInt, one_of
from looptrace.tasks.base import IGNORE, SPLITS, Task, TaskBatch, split_of
from looptrace.tasks.mano import ManoTask
from looptrace.tasks.parity import ParityTask
from looptrace.tasks.running import RunningTask

__all__ = ["IGNORE", "SPLITS", "Task", "TaskBatch", "TaskConfig", "make_task", "split_of"]

KINDS = ("running_parity", "running_sum", "parity", "mano")


@dataclass(frozen=True)
class TaskConfig:
    """One task definition in ``params.yaml`` (``train.task_defs.<name>``); fields by kind:

    - running_parity: length, fit_only_max
    - running_sum: length, modulus, fit_only_max
    - parity: max_length, min_length, causal
    - mano: modulus, max_ops, min_ops, ops, causal

    Every kind: ``split_rule`` — ``context`` (default: a scored position's split is its context's, so no scored
    prefix is in two splits; :class:`~looptrace.tasks.base.Task`) or ``sequence`` (the old rule, a row's split by
    its content: leaks prefixes; for reproducing old results only). ``fit_only_max`` (running tasks): prefix
    lengths with at most this many distinct prefixes are fit's only (null = the kind's default
    :data:`FIT_ONLY_MAX`: running parity 64, running sum 1024; 0 = none).
    """

    kind: Annotated[str, one_of(*KINDS)]
    length: PosInt = 12
    modulus: Annotated[int, Check(ge=2, why="values 0..modulus-1")] = 5
    max_length: PosInt = 16
    min_length: PosInt = 1
    max_ops: PosInt = 3
    min_ops: PosInt = 1
    ops: Annotated[tuple[Annotated[str, one_of("+", "*", "-")], ...], Check(nonempty=True)] = ("+", "*")
    causal: bool | None = None
    fit_only_max: NonNegInt | None = None
    split_rule: Annotated[str, one_of("context", "sequence")] = "context"

    def __post_init__(self) -> None:
        if self.split_rule not in SPLIT_RULES:
            raise ConfigError(f"task split_rule must be one of {', '.join(SPLIT_RULES)}, got {self.split_rule!r}")
        if self.fit_only_max is not None and self.fit_only_max < 0:
            raise ConfigError(f"task fit_only_max must be >= 0 or null, got {self.fit_only_max}")
        if self.min_length > self.max_length:
            raise ConfigError(f"task {self.kind}: min_length = {self.min_length} exceeds max_length = "
                              f"{self.max_length}; set min_length ≤ max_length")
        if self.min_ops > self.max_ops:
            raise ConfigError(f"task {self.kind}: min_ops = {self.min_ops} exceeds max_ops = {self.max_ops}; "
                              "set min_ops ≤ max_ops")


SPLIT_RULES = ("context", "sequence")

#: Default ``fit_only_max`` by kind (running tasks: prefix lengths with at most this many prefixes are fit's only).
#: Measured on the default experiment (12 tokens, d_model 64, 6 loops, uniform regime, add form; docs/train.md):
#: running parity learns with lengths 1–6 (≤ 64 prefixes) training-only (test 96.5 %, levels 7–12 held out);
#: running sum mod 5 does not with lengths 1–2 (≤ 64: val 19 %, chance) but does with 1–4 (≤ 1024: test 96.7 %,
#: levels 5–12 held out). 1024 for parity would leave test two levels.
FIT_ONLY_MAX = {"running_parity": 64, "running_sum": 1024}


def make_task(name: str, cfg: TaskConfig | dict) -> Task:
    """Build a task from its config (a :class:`TaskConfig` or a checkpoint's ``spec()`` dict)."""
    if isinstance(cfg, dict):
        d = dict(cfg)
        if "ops" in d:
            d["ops"] = tuple(d["ops"])
        cfg = TaskConfig(**d)
    rule = cfg.split_rule
    fo = FIT_ONLY_MAX.get(cfg.kind, 0) if cfg.fit_only_max is None else cfg.fit_only_max
    if cfg.kind == "running_parity":
        return RunningTask(name, length=cfg.length, modulus=2, split_rule=rule, fit_only_max=fo)
    if cfg.kind == "running_sum":
        return RunningTask(name, length=cfg.length, modulus=cfg.modulus, split_rule=rule, fit_only_max=fo)
    if cfg.kind == "parity":
        return ParityTask(name, max_length=cfg.max_length, min_length=cfg.min_length,
                          causal=False if cfg.causal is None else cfg.causal, split_rule=rule)
    if cfg.kind == "mano":
        return ManoTask(name, modulus=cfg.modulus, max_ops=cfg.max_ops, min_ops=cfg.min_ops, ops=cfg.ops,
                        causal=True if cfg.causal is None else cfg.causal, split_rule=rule)
    raise ConfigError(f"task '{name}': kind must be one of {', '.join(KINDS)}, got {cfg.kind!r}")
