"""Benchmark of the inside-the-loop opt-ins of the dump: ``dump.heads`` (per-head attention entropy and JS, SPEC §2c)
and ``dump.layers`` against a plain dump of the same model and data.

A random-init model of the default size (d_model 64, 4 heads, one looped layer × 6 loops, ``norm_add``; the
weights do not change the cost) on running parity of length 12, 2048 sequences (the default dump's fit + val +
test), dumped to fresh on-disk stores with the default ``dump`` settings. Each repetition runs plain, heads, layers
(in an order that rotates) and divides each opt-in's wall time by the plain run's of the same repetition; the
median ratio over repetitions is reported, with the bytes of each store on disk. One untimed run of each comes
first (warm-up).

    python benchmarks/heads.py [--sequences 2048] [--n-layer 1] [--loops 6] [--threads 1] [--reps 3] [--smoke]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

#: ``--smoke``: sizes of a run of seconds (the ratios mean nothing at this size).
SMOKE = {"sequences": 16, "n_layer": 1, "loops": 2, "reps": 1, "threads": 1}


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sequences", type=int, default=2048)
    ap.add_argument("--n-layer", type=int, default=1, help="layers of the looped block (all of them recorded)")
    ap.add_argument("--loops", type=int, default=6)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--smoke", action="store_true", help="a tiny run (seconds) that checks the benchmark still runs")
    args = ap.parse_args()
    if args.smoke:
        for k, v in SMOKE.items():
            setattr(args, k, v)
    torch.set_num_threads(args.threads)
    from looptrace.capture.dump import DumpConfig, dump_split
    from looptrace.models.interface import LoopedTransformerAdapter
    from looptrace.models.looped import GroupConfig, LoopedTransformer, ModelConfig
    from looptrace.tasks import make_task

    task = make_task("rp", {"kind": "running_parity", "length": 12})
    data = task.generate(args.sequences, np.random.default_rng(0))
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=task.vocab_size, block_size=task.seq_len, d_model=64, n_head=4,
                      groups=(GroupConfig(args.n_layer, args.loops),), loop_form="norm_add")
    adapter = LoopedTransformerAdapter(LoopedTransformer(cfg).eval(), "bench", checkpoint_hash="bench",
                                       extra={"task": task.spec(), "regime": {"name": "geometric"}})
    every = tuple(range(args.n_layer))
    runs = {"plain": DumpConfig(), "heads": DumpConfig(heads=every), "layers": DumpConfig(layers=every)}
    tmp = Path(tempfile.mkdtemp(prefix="looptrace-heads-"))
    walls: dict[str, list[float]] = {k: [] for k in runs}
    size: dict[str, int] = {}
    try:
        def once(name: str) -> float:
            path = tmp / f"{name}.zarr"
            shutil.rmtree(path, ignore_errors=True)
            shutil.rmtree(tmp / f".{name}.zarr.claims", ignore_errors=True)
            os.sync()
            t0 = time.perf_counter()
            dump_split(adapter, data, path, runs[name], progress=False)
            wall = time.perf_counter() - t0
            size[name] = _dir_bytes(path)
            return wall

        for name in runs:  # warm-up, untimed
            once(name)
        names = list(runs)
        for r in range(args.reps):
            for name in names[r % 3:] + names[:r % 3]:
                walls[name].append(once(name))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    plain = np.asarray(walls["plain"])
    print(f"model: d_model 64, 4 heads, {args.n_layer} looped layer(s) x {args.loops} loops; {args.sequences} "
          f"sequences x 12 positions; {args.threads} thread(s); {args.reps} repetitions")
    for name in runs:
        w = np.asarray(walls[name])
        print(f"{name:7s} wall median {np.median(w):.2f} s  ratio to plain {np.median(w / plain):.3f}  "
              f"store {size[name] / 2**20:.2f} MiB ({size[name] / size['plain']:.3f}x plain)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
