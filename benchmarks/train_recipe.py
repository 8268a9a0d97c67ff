"""Training-recipe study: which recipe makes every default model learn its task, and at what cost.

Each run trains one model with the project's own :func:`looptrace.models.train.train_model` (params.yaml ``train``
with the recipe's overrides layered on top, exactly as a profile would be) — so it stops where the train stage
stops (``train.stop``: the criterion on the fixed val set, or the step cap; with ``stop.target: null`` after
``steps``) — and then scores the final model on held-out test contexts (``--test-sequences`` sequences of the test
split from ``train.data_seeds.test``: the sequences the dump stores). Per run it prints:

- ``steps`` and ``stop``: the steps trained and why the run ended (``criterion``, ``step_cap``, ``budget``);
- ``step99``: the first evaluated step whose full-depth val accuracy is >= ``--target`` (``-`` = never);
- ``val@S``: full-depth val accuracy at the evaluation at the schedule's end (``steps``: where the fixed budget
  stopped), when the run evaluated there; ``val@T``: at the end of the run;
- ``test@T``: full-depth test accuracy (argmax at loop T vs target, every scored test token);
- ``s`` and ``ms/step``: wall seconds of training (eval included) on ``--threads`` threads; ``val/loop``.

The header names the CPU and torch's CPU kernel path (``ATEN_CPU_CAPABILITY`` selects another one: the check of
docs/train.md "On another CPU").

Recipes are ``--recipe NAME key=value ...`` (repeatable): keys of the ``train`` section, dotted for nested ones
(``model.d_model=32``, ``task_defs.running_sum.modulus=3``, ``steps_by_task.running_sum=1500``,
``stop.target=null``); values are YAML. They are layered like a profile: a mapping merges key by key
(``steps_by_task={}`` leaves params.yaml's entries in place; set ``steps_by_task.<task>=N``), lists and scalars
replace. Training never stops on wall time.

Usage (docs/train.md)::

    python benchmarks/train_recipe.py --tasks running_parity running_sum --regimes geometric joint --seeds 0 1 2 \\
        --jobs 2 --out recipe.jsonl

``--jobs`` runs that many models at once in spawned processes (one torch thread each by default).
``--evals N`` also keeps N - 1 evenly spaced checkpoints of the schedule (``checkpoint_fractions``; the weights do
not depend on it). ``--step-cost N`` only times N optimiser steps of each recipe (ms/step, median; no training run).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing as mp
import platform
import shutil
import tempfile
import time
from pathlib import Path

import yaml


def _nest(overrides: dict) -> dict:
    out: dict = {}
    for key, value in overrides.items():
        node = out
        *head, last = key.split(".")
        for part in head:
            node = node.setdefault(part, {})
        node[last] = value
    return out


def parse_recipe(tokens: list[str]) -> tuple[str, dict]:
    """``NAME key=value ...`` -> (name, {"key": value}) (values parsed as YAML)."""
    name, over = tokens[0], {}
    for kv in tokens[1:]:
        if "=" not in kv:
            raise SystemExit(f"recipe {name}: '{kv}' is not key=value")
        k, v = kv.split("=", 1)
        over[k] = yaml.safe_load(v)
    return name, over


def run_one(job: dict) -> dict:
    import torch

    from looptrace.config import load_base, load_section
    from looptrace.models.looped import load_checkpoint
    from looptrace.models.train import TrainConfig, cpu_capability, evaluate, train_model

    tmp = Path(tempfile.mkdtemp(prefix="looptrace-recipe-"))
    over = tmp / "recipe.yaml"
    over.write_text(yaml.safe_dump({"train": _nest(job["overrides"])}))
    files = [Path(p) for p in job["params"]] + [over]
    base = load_base(files)
    cfg = load_section(TrainConfig, "train", files)
    n = job["evals"]
    if n:
        cfg = dataclasses.replace(cfg, checkpoint_fractions=tuple(i / n for i in range(1, n)))
    t0 = time.perf_counter()
    m = train_model(base, cfg, job["task"], job["regime"], tmp / "model", progress=False, seed=job["seed"],
                    threads=job["threads"])
    seconds = time.perf_counter() - t0
    model, _ = load_checkpoint(tmp / "model" / "model.pt")
    test = cfg.task(job["task"]).dataset("test", job["test_sequences"], cfg.data_seeds.test)
    torch.set_num_threads(job["threads"])
    ev = evaluate(model, test, base.device)
    if job["keep"]:
        shutil.copytree(tmp / "model", Path(job["keep"]) / f"{job['recipe']}-{m['model']}", dirs_exist_ok=True)
    shutil.rmtree(tmp, ignore_errors=True)
    step99 = next((h["step"] for h in m["history"] if h["acc_per_loop"][-1] >= job["target"]), None)
    schedule = m["stop"]["schedule_steps"]
    at_schedule = next((h["acc_per_loop"][-1] for h in m["history"] if h["step"] == schedule), None)
    return {"recipe": job["recipe"], "overrides": job["overrides"], "task": job["task"], "regime": job["regime"],
            "seed": job["seed"], "steps": m["steps"], "stop": m["stop"], "val_acc_at_schedule_end": at_schedule,
            "cpu_capability": cpu_capability(), "val_acc_per_loop": m["val"]["acc_per_loop"],
            "val_loss_per_loop": m["val"]["loss_per_loop"],
            "history": [(h["step"], h["acc_per_loop"][-1], h["loss_per_loop"][-1]) for h in m["history"]],
            "step_to_target": step99, "target": job["target"], "test_acc_per_loop": ev["acc_per_loop"],
            "test_tokens": ev["n_tokens"], "train_seconds": round(seconds, 1), "train_cpu_seconds": m["train_cpu_seconds"],
            "ms_per_step": round(1000 * m["train_seconds"] / m["steps"], 1), "threads": job["threads"]}


def step_cost(job: dict, steps: int) -> float:
    """Milliseconds per optimiser step of a recipe (the train loop's step: sample, forward, regime loss, backward,
    clip, AdamW), median of ``steps`` timed steps after 5 untimed ones; no evaluation."""
    import numpy as np
    import torch

    from looptrace.config import load_section
    from looptrace.models.looped import LoopedTransformer
    from looptrace.models.train import TrainConfig, build_model_config, optimiser_step

    torch.set_num_threads(job["threads"])
    with tempfile.TemporaryDirectory() as tmp:
        over = Path(tmp) / "recipe.yaml"
        over.write_text(yaml.safe_dump({"train": _nest(job["overrides"])}))
        cfg = load_section(TrainConfig, "train", [Path(p) for p in job["params"]] + [over])
    task, regime = cfg.task(job["task"]), cfg.regime(job["regime"])
    torch.manual_seed(0)
    model = LoopedTransformer(build_model_config(cfg.model, task, regime))
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=tuple(cfg.betas))
    rng, times = np.random.default_rng(0), []
    for i in range(5 + steps):
        t = time.perf_counter()
        optimiser_step(model, opt, task, regime, cfg, rng, "cpu")
        if i >= 5:
            times.append(time.perf_counter() - t)
    return 1000 * float(np.median(times))


def _cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``; else what :mod:`platform` says)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", action="append", default=None, help="params files, later winning (params.yaml)")
    ap.add_argument("--tasks", nargs="+", default=["running_parity", "running_sum"])
    ap.add_argument("--regimes", nargs="+", default=["geometric"])
    ap.add_argument("--seeds", nargs="+", type=int, default=[0])
    ap.add_argument("--recipe", action="append", nargs="+", metavar="NAME key=value",
                    help="a recipe: its name, then train-section overrides (repeatable; default: base)")
    ap.add_argument("--evals", type=int, default=0,
                    help="keep N - 1 evenly spaced checkpoints of the schedule (0: params.yaml's checkpoint_fractions)")
    ap.add_argument("--target", type=float, default=0.99, help="full-depth val accuracy of step_to_target")
    ap.add_argument("--test-sequences", type=int, default=512, help="test sequences scored (the dump's test split)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per model")
    ap.add_argument("--jobs", type=int, default=1, help="models trained at once (spawned processes)")
    ap.add_argument("--out", type=Path, default=None, help="append one JSON line per run here")
    ap.add_argument("--keep", type=Path, default=None,
                    help="copy each trained model dir here as <recipe>-<model>/ (model.pt, metrics.json, checkpoints/)")
    ap.add_argument("--step-cost", type=int, default=0, metavar="N",
                    help="only time N optimiser steps per recipe x task x regime (ms/step, no training run)")
    a = ap.parse_args()
    recipes = [parse_recipe(r) for r in (a.recipe or [["base"]])]
    jobs = [{"recipe": name, "overrides": over, "task": t, "regime": r, "seed": s, "params": a.params or ["params.yaml"],
             "evals": a.evals, "target": a.target, "test_sequences": a.test_sequences, "threads": a.threads,
             "keep": str(a.keep) if a.keep else None}
            for name, over in recipes for t in a.tasks for r in a.regimes for s in a.seeds]
    import torch

    print(f"# {time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC, {_cpu_name()}, torch {torch.__version__} CPU "
          f"kernels {torch.backends.cpu.get_cpu_capability()}, {len(jobs)} runs, {a.jobs} at once, "
          f"{a.threads} thread(s) each")
    if a.step_cost:
        for job in jobs:
            if job["seed"] == a.seeds[0]:
                print(f"{job['recipe']:14s} {job['task']}-{job['regime']:22s} {step_cost(job, a.step_cost):7.1f} ms/step "
                      f"({a.threads} thread(s))", flush=True)
        return
    print(f"{'recipe':14s} {'model':28s} {'steps':>5s} {'stop':>9s} {'step99':>6s} {'val@S':>6s} {'val@T':>6s} "
          f"{'test@T':>6s} {'s':>6s} {'ms/step':>7s}  val/loop")
    if a.jobs > 1:
        pool = mp.get_context("spawn").Pool(a.jobs, maxtasksperchild=1)
        results = pool.imap_unordered(run_one, jobs)
    else:
        pool, results = None, map(run_one, jobs)
    for res in results:
        model = f"{res['task']}-{res['regime']}-s{res['seed']}"
        at_s = res["val_acc_at_schedule_end"]
        print(f"{res['recipe']:14s} {model:28s} {res['steps']:5d} {res['stop']['reason']:>9s} "
              f"{res['step_to_target'] or '-':>6} {'-' if at_s is None else f'{at_s:.3f}':>6} "
              f"{res['val_acc_per_loop'][-1]:6.3f} {res['test_acc_per_loop'][-1]:6.3f} {res['train_seconds']:6.0f} "
              f"{res['ms_per_step']:7.1f}  " + " ".join(f"{x:.3f}" for x in res["val_acc_per_loop"]), flush=True)
        if a.out is not None:
            with a.out.open("a") as f:
                f.write(json.dumps(res) + "\n")
    if pool is not None:
        pool.close()
        pool.join()


if __name__ == "__main__":
    main()
