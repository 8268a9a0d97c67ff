"""Benchmark of scale-out (issue 13). Parts are separate functions and flags:

(a) ``--part a``: a sharded dump by 2 cooperating processes (``shard=(0, 2)`` and ``(1, 2)``, one torch thread
    each) vs a 1-process dump of the same store (``--threads`` torch threads, default 2) — the **named
    baseline, measured in the same run**. Same random-init LoopedTransformer (seeded, so every process builds
    the same weights) and the same batches; each process is a fresh ``python`` (imports included in the wall
    time, reported apart as ``startup``). Runs alternate 1-proc, 2-proc, 1-proc, ... ``--reps`` times; the
    ratio wall(1 process) / wall(2 processes) is the median over repetitions (the VM's speed drifts). After
    every run the two stores are compared file by file (arrays, attributes, consolidated metadata): they must
    be identical. Also printed: CPU seconds / wall seconds ("cores obtained"), which tells a loaded shared
    box apart from a slow code path.
(b), (c): Dask analysis parts, added later to this script (``--part b``, ``--part c``).

    python benchmarks/scale.py [--part a] [--sequences 256] [--seq-len 64] [--d-model 512] [--loops 8]
                               [--batch 32] [--chunk 2048] [--threads 2] [--reps 3]

Exit status 1 if the stores ever differ.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve()


def _tree(path: Path) -> dict[str, bytes]:
    return {str(f.relative_to(path)): f.read_bytes() for f in sorted(path.rglob("*")) if f.is_file()}


# --------------------------------------------------------------------------------------------- part (a)

def child(spec: dict) -> None:
    """One dump process (``--child``): build the seeded model and data, dump its shard, print JSON timings."""
    t_start = time.perf_counter()
    import numpy as np
    import torch
    from looptrace.capture.dump import DumpConfig, dump_split
    from looptrace.models.interface import LoopedTransformerAdapter
    from looptrace.models.looped import GroupConfig, LoopedTransformer, ModelConfig
    from looptrace.tasks import TaskBatch

    torch.set_num_threads(int(spec["threads"]))
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=spec["vocab"], block_size=spec["seq_len"], d_model=spec["d_model"], n_head=8,
                      groups=(GroupConfig(1, spec["loops"]),))
    adapter = LoopedTransformerAdapter(LoopedTransformer(cfg).eval(), "bench-scale")
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, spec["vocab"], (spec["sequences"], spec["seq_len"]))
    zeros = np.zeros_like(tokens)
    data = TaskBatch(tokens, rng.integers(0, spec["vocab"], tokens.shape), zeros, zeros)
    t_ready = time.perf_counter()
    cpu0 = time.process_time()
    dump_split(adapter, data, spec["path"], DumpConfig(batch_size=spec["batch"], chunk_tokens=spec["chunk"]),
               progress=False, shard=tuple(spec["shard"]))
    print(json.dumps({"startup_s": t_ready - t_start, "dump_s": time.perf_counter() - t_ready,
                      "dump_cpu_s": time.process_time() - cpu0}), flush=True)


def _run(specs: list[dict]) -> dict:
    """Start one process per spec at once; wall time until all exit, plus each one's timings and CPU."""
    t0 = time.perf_counter()
    cpu0 = os.times()
    procs = [subprocess.Popen([sys.executable, str(HERE), "--child", json.dumps(s)], stdout=subprocess.PIPE,
                              text=True) for s in specs]
    outs = [p.communicate()[0] for p in procs]
    wall = time.perf_counter() - t0
    cpu1 = os.times()
    if any(p.returncode for p in procs):
        raise SystemExit(f"a dump process failed: {[p.returncode for p in procs]}")
    cpu = (cpu1.children_user - cpu0.children_user) + (cpu1.children_system - cpu0.children_system)
    child = [json.loads(o.strip().splitlines()[-1]) for o in outs]
    return {"wall_s": wall, "cpu_s": cpu, "cores": cpu / wall, "startup_s": max(c["startup_s"] for c in child),
            "dump_s": max(c["dump_s"] for c in child)}


def part_a(args) -> bool:
    """2-process sharded dump vs 1-process dump of the same store; True when every pair of stores is identical."""
    base = {"sequences": args.sequences, "seq_len": args.seq_len, "d_model": args.d_model, "loops": args.loops,
            "vocab": args.vocab, "batch": args.batch, "chunk": args.chunk}
    n_tokens = args.sequences * args.seq_len
    n_chunks = -(-n_tokens // args.chunk)
    print(f"(a) sharded dump: d_model {args.d_model}, T {args.loops}, vocab {args.vocab}, {n_tokens} tokens "
          f"({n_chunks} chunks of {args.chunk}), batch {args.batch} sequences; baseline: 1 process x "
          f"{args.threads} threads; sharded: 2 processes x 1 thread; {args.reps} repetitions; "
          f"load average {os.getloadavg()[0]:.1f}", flush=True)
    tmp = Path(tempfile.mkdtemp(prefix="looptrace-bench-scale-"))
    rows, identical = [], True
    try:
        for rep in range(args.reps):
            for old in ("one.zarr", "two.zarr"):
                shutil.rmtree(tmp / old, ignore_errors=True)
            os.sync()
            one = _run([{**base, "threads": args.threads, "shard": [0, 1], "path": str(tmp / "one.zarr")}])
            os.sync()
            two = _run([{**base, "threads": 1, "shard": [i, 2], "path": str(tmp / "two.zarr")} for i in range(2)])
            t1, t2 = _tree(tmp / "one.zarr"), _tree(tmp / "two.zarr")
            same = t1 == t2
            identical &= same
            if not same:
                diff = sorted(k for k in set(t1) | set(t2) if t1.get(k) != t2.get(k))
                print(f"  rep {rep + 1}: stores differ in {len(diff)} file(s): {diff[:8]}", flush=True)
            rows.append((one, two, same))
            print(f"  rep {rep + 1}: 1 process {one['wall_s']:.1f} s (startup {one['startup_s']:.1f}, dump "
                  f"{one['dump_s']:.1f}, {one['cores']:.2f} cores) | 2 processes {two['wall_s']:.1f} s (startup "
                  f"{two['startup_s']:.1f}, dump {two['dump_s']:.1f}, {two['cores']:.2f} cores) | ratio "
                  f"{one['wall_s'] / two['wall_s']:.2f} | stores identical: {same}", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    ratio = statistics.median(o["wall_s"] / t["wall_s"] for o, t, _ in rows)
    dump_ratio = statistics.median(o["dump_s"] / t["dump_s"] for o, t, _ in rows)
    cpu_ratio = statistics.median(t["cpu_s"] / o["cpu_s"] for o, t, _ in rows)
    print(f"(a) wall(1 process) / wall(2 processes), median: {ratio:.2f} (dump phase only: {dump_ratio:.2f}); "
          f"CPU(2) / CPU(1): {cpu_ratio:.2f}; cores obtained 1-proc {statistics.median(o['cores'] for o, _, _ in rows):.2f}, "
          f"2-proc {statistics.median(t['cores'] for _, t, _ in rows):.2f}; stores identical in every repetition: "
          f"{identical}")
    return identical


PARTS = {"a": part_a}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", action="append", choices=sorted(PARTS), help="which part(s) to run (default: all)")
    ap.add_argument("--sequences", type=int, default=256)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--loops", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=64)
    ap.add_argument("--batch", type=int, default=32, help="sequences per forward pass")
    ap.add_argument("--chunk", type=int, default=2048, help="dump.chunk_tokens (shards are whole chunks)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads of the 1-process baseline")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(json.loads(args.child))
        return 0
    ok = True
    for name in args.part or sorted(PARTS):
        ok &= PARTS[name](args)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
