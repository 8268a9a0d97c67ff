"""Cost of a seed axis: one seed alone vs three seeds sequentially vs three seeds in parallel worker processes.

Runs ``--steps`` optimiser steps of the default experiment's model (params.yaml ``train``; task and regime from the
command line) and prints wall and CPU seconds per variant:

- ``1 seed, T threads``: today's one model per task × regime (``base.threads``);
- ``1 seed, 1 thread``;
- ``3 seeds sequential, T threads``: the naive seed axis;
- ``3 seeds, train_models workers=2``: :func:`looptrace.models.train.train_models` (the train stage's pool), each
  model on one thread.

Every variant trains exactly ``--steps`` steps (``train.stop.target: null``: no stopping criterion).

Usage: ``python benchmarks/seeds.py [--task running_parity] [--regime uniform] [--steps 150]``. On a shared machine
the wall times move with the load; CPU seconds (this process + its workers) are the steadier figure.
"""

from __future__ import annotations

import argparse
import dataclasses
import resource
import tempfile
import time
from pathlib import Path

from looptrace.config import load_base, load_section
from looptrace.models.train import StopConfig, TrainConfig, train_model, train_models


def _cpu() -> float:
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--params", default="params.yaml")
    ap.add_argument("--task", default="running_parity")
    ap.add_argument("--regime", default="uniform")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--smoke", action="store_true", help="2 steps, the 1-thread and train_models variants only: does it "
                    "still run (tests/test_benchmarks.py)")
    a = ap.parse_args()
    if a.smoke:
        a.steps = 2
    base = load_base(a.params)
    cfg = load_section(TrainConfig, "train", a.params)
    cfg = dataclasses.replace(cfg, steps=a.steps, steps_by_task={}, checkpoint_fractions=(), val_sequences=256,
                              stop=StopConfig())
    out = Path(tempfile.mkdtemp(prefix="looptrace-seeds-"))
    variants = [
        (f"1 seed, {base.threads} threads", lambda: train_model(base, cfg, a.task, a.regime, out / "a", False, 0)),
        ("1 seed, 1 thread", lambda: train_model(base, cfg, a.task, a.regime, out / "b", False, 0, threads=1)),
        (f"3 seeds sequential, {base.threads} threads",
         lambda: [train_model(base, cfg, a.task, a.regime, out / f"c{s}", False, s) for s in (0, 1, 2)]),
        ("3 seeds, train_models workers=2 (1 thread each)",
         lambda: train_models(base, dataclasses.replace(cfg, seeds=(0, 1, 2), workers=2, threads_per_model=1),
                              [(a.task, a.regime, s) for s in (0, 1, 2)], out / "d", progress=False)),
    ]
    if a.smoke:  # the other two variants are the same code on more threads or seeds
        variants = [variants[1], variants[3]]
    print(f"{a.task}-{a.regime}, {a.steps} steps, model {cfg.model.loop_form}, d_model {cfg.model.d_model}")
    for name, fn in variants:
        w, c = time.perf_counter(), _cpu()
        fn()
        print(f"{name:48s} wall {time.perf_counter() - w:7.1f} s   cpu {_cpu() - c:7.1f} s")


if __name__ == "__main__":
    main()
