"""Cost of one optimiser step of the default experiment's model: eager vs ``torch.compile``, 1 vs 2 threads.

The default ``make repro`` trains 18 models (2 tasks × 3 regimes × 3 seeds) for 27,000 optimiser steps in all
(1000 per running-parity model, 2000 per running-sum model). This prints what one step costs per variant, so the
training share of a repro can be bounded from below: ``steps × ms/step`` (docs/train.md "Time budget").

Variants (each in a fresh subprocess, so thread settings and compile caches do not leak between them):

- ``eager, T threads``: what ``train_model`` runs (baseline: ``eager, 2 threads``, ``base.threads`` of params.yaml);
- ``compile, T threads``: the same step (forward + regime loss) under ``torch.compile`` (inductor), with an empty
  inductor cache, so ``first step`` is a cold compile.

Usage: ``python benchmarks/train_step.py [--task running_parity] [--regime uniform] [--steps 50] [--smoke]``. Wall times on a
shared VM move by ±15 %; run it twice before reading a ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time


def _child(mode: str, threads: int, task_name: str, regime_name: str, steps: int, params: str) -> dict:
    import numpy as np
    import torch

    from looptrace.config import load_section
    from looptrace.models.looped import LoopedTransformer
    from looptrace.models.regimes import regime_loss
    from looptrace.models.train import TrainConfig, build_model_config, to_torch

    torch.set_num_threads(threads)
    cfg = load_section(TrainConfig, "train", params)
    task, regime = cfg.task(task_name), cfg.regime(regime_name)
    torch.manual_seed(0)
    model = LoopedTransformer(build_model_config(cfg.model, task, regime))
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=tuple(cfg.betas))
    rng = np.random.default_rng(0)

    def loss_of(idx: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        out = model(idx)  # logits [batch, seq, loop, vocab]
        return regime_loss(regime, out.logits, tgt, out.gate_logits)

    fn = torch.compile(loss_of) if mode == "compile" else loss_of

    def step() -> None:
        idx, tgt = to_torch(task.sample("fit", cfg.batch_size, rng), "cpu")  # [batch, seq] each
        loss = fn(idx, tgt)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()

    t = time.perf_counter()
    step()
    first = time.perf_counter() - t
    for _ in range(5):  # warm-up (allocator, OpenMP pool)
        step()
    t = time.perf_counter()
    for _ in range(steps):
        step()
    return {"first_s": first, "ms_per_step": (time.perf_counter() - t) / steps * 1000}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--params", default="params.yaml")
    ap.add_argument("--task", default="running_parity")
    ap.add_argument("--regime", default="uniform")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--smoke", action="store_true", help="2 steps, eager on 1 thread only (no compile): does it "
                    "still run (tests/test_benchmarks.py)")
    ap.add_argument("--child", nargs=2, metavar=("MODE", "THREADS"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(_child(a.child[0], int(a.child[1]), a.task, a.regime, a.steps, a.params)))
        return
    if a.smoke:
        a.steps = 2
    rows = {}
    variants = (("eager", 1),) if a.smoke else (("eager", 2), ("eager", 1), ("compile", 2), ("compile", 1))
    for mode, threads in variants:
        with tempfile.TemporaryDirectory(prefix="looptrace-inductor-") as cache:
            env = os.environ | {"TORCHINDUCTOR_CACHE_DIR": cache}
            out = subprocess.run([sys.executable, __file__, "--params", a.params, "--task", a.task, "--regime",
                                  a.regime, "--steps", str(a.steps), "--child", mode, str(threads)],
                                 env=env, check=True, stdout=subprocess.PIPE, text=True).stdout  # stderr: the child's own
        rows[(mode, threads)] = json.loads(out.strip().splitlines()[-1])
    base = rows[("eager", 2) if ("eager", 2) in rows else ("eager", 1)]["ms_per_step"]
    print(f"{a.task}-{a.regime}, {a.steps} timed steps")
    for (mode, threads), r in rows.items():
        print(f"{mode:8s} {threads} thread(s)   first step {r['first_s']:6.2f} s   {r['ms_per_step']:6.1f} ms/step   "
              f"eager-2-threads / this {base / r['ms_per_step']:.2f}")


if __name__ == "__main__":
    main()
