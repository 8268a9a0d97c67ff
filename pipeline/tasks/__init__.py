"""Synthetic tasks (SPEC §6, §9): MANO, whole-string parity, running parity, running sum mod m.

Every task is deterministic from seeds, labels each scored position with a difficulty and a token
type, and draws three content-disjoint splits (fit / val / test, see :func:`base.split_of`).
"""

from __future__ import annotations

from dataclasses import dataclass

from looptrace.tasks.base import IGNORE, SPLITS, Task, TaskBatch, split_of
from looptrace.tasks.mano import ManoTask
from looptrace.tasks.parity import ParityTask
from looptrace.tasks.running import RunningTask

__all__ = ["IGNORE", "SPLITS", "Task", "TaskBatch", "TaskConfig", "make_task", "split_of"]

KINDS = ("running_parity", "running_sum", "parity", "mano")


@dataclass(frozen=True)
class TaskConfig:
    """One task definition in ``params.yaml`` (``train.task_defs.<name>``); fields by kind:

    - running_parity: length
    - running_sum: length, modulus
    - parity: max_length, min_length, causal
    - mano: modulus, max_ops, min_ops, ops, causal
    """

    kind: str
    length: int = 12
    modulus: int = 5
    max_length: int = 16
    min_length: int = 1
    max_ops: int = 3
    min_ops: int = 1
    ops: tuple[str, ...] = ("+", "*")
    causal: bool | None = None


def make_task(name: str, cfg: TaskConfig | dict) -> Task:
    """Build a task from its config (a :class:`TaskConfig` or a checkpoint's ``spec()`` dict)."""
    if isinstance(cfg, dict):
        d = dict(cfg)
        if "ops" in d:
            d["ops"] = tuple(d["ops"])
        cfg = TaskConfig(**d)
    if cfg.kind == "running_parity":
        return RunningTask(name, length=cfg.length, modulus=2)
    if cfg.kind == "running_sum":
        return RunningTask(name, length=cfg.length, modulus=cfg.modulus)
    if cfg.kind == "parity":
        return ParityTask(name, max_length=cfg.max_length, min_length=cfg.min_length,
                          causal=False if cfg.causal is None else cfg.causal)
    if cfg.kind == "mano":
        return ManoTask(name, modulus=cfg.modulus, max_ops=cfg.max_ops, min_ops=cfg.min_ops, ops=cfg.ops,
                        causal=True if cfg.causal is None else cfg.causal)
    raise ValueError(f"task '{name}': kind must be one of {', '.join(KINDS)}, got {cfg.kind!r}")
