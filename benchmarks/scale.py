"""Benchmark of scale-out. Parts are separate functions and flags:

(a) ``--part a``: a sharded dump by 2 cooperating processes (``shard=(0, 2)`` and ``(1, 2)``, one torch thread
    each) vs a 1-process dump of the same store (``--threads`` torch threads, default 2) — the **named
    baseline, measured in the same run**. Same random-init LoopedTransformer (seeded, so every process builds
    the same weights) and the same batches; each process is a fresh ``python`` (imports included in the wall
    time, reported apart as ``startup``). Runs alternate 1-proc, 2-proc, 1-proc, ... ``--reps`` times; the
    ratio wall(1 process) / wall(2 processes) is the median over repetitions (the VM's speed drifts). After
    every run the two stores are compared file by file (arrays, attributes, consolidated metadata): they must
    be identical. Also printed: CPU seconds / wall seconds ("cores obtained"), which tells a loaded shared
    box apart from a slow code path.
(b) ``--part b``: the geometry and readouts stages (``geometry_model`` on a val and a test store, then
    ``readouts_model``) on a ``LocalCluster`` of 2 single-threaded worker processes (``base.dask.scheduler:
    local``, ``workers: 2``: :func:`looptrace.io.parallel.dask_runner`, the stages' own code path) vs in this
    process (``scheduler: null``) — the baseline, measured in the same run. Each run is a fresh ``python``;
    cluster start-up and close are reported apart from the stage time. Runs alternate in-process, cluster,
    ... ``--reps`` times and the fastest stage wall time of each counts (the VM is shared). Printed: wall
    ratio in-process / cluster, CPU seconds and cores obtained (CPU of main + workers / wall), peak RSS of
    the main process and of each worker, and whether every output file is byte-identical.
(c) ``--part c``: part (b) on stores with 4× the tokens (how cost grows: seconds and RSS per 4× tokens).

Stores of (b)/(c): synthetic contracting trajectories (``h_t = h_{t-1} + 0.6^t ξ``, float16 states, random
statistics), written chunk by chunk (one chunk in memory), ``--analysis-tokens`` tokens per split, chunks
of ``--analysis-chunk`` tokens, ``--analysis-d-model`` × ``--analysis-loops``.

    python benchmarks/scale.py [--part a] [--sequences 256] [--seq-len 64] [--d-model 512] [--loops 8]
                               [--batch 32] [--chunk 2048] [--threads 2] [--reps 3]
    python benchmarks/scale.py --part b --part c [--analysis-tokens 81920] [--analysis-d-model 512]
                               [--analysis-loops 6] [--analysis-chunk 4096] [--analysis-reps 2]

Exit status 1 if the stores (a) or the stage outputs (b, c) ever differ.
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


# --------------------------------------------------------------------------------------------- parts (b), (c)

def build_analysis_store(path: Path, n_tokens: int, d_model: int, loops: int, chunk: int, seed: int,
                         vocab: int = 16, seq_len: int = 16) -> None:
    """A synthetic complete store written chunk by chunk (only one chunk's arrays in memory).

    Each chunk's data comes from ``default_rng((seed, chunk))``: contracting trajectories
    h_t = h_{t-1} + 0.6^t ξ_t (float16), uniform random statistics (NaN at loop 0 for the previous-loop ones),
    an argmax equal to the target 80 % of the time.
    """
    import numpy as np

    from looptrace.io.store.schema import ATTR_DEFAULTS, DIMS, DTYPES
    from looptrace.io.store.writer import ArraySpec, StoreWriter

    names = {"hidden": (loops, d_model), "hidden_init": (d_model,), **{s: (loops,) for s in
             ("entropy", "max_prob", "margin", "target_logprob", "kl_prev", "kl_prev_rev", "kl_final",
              "logit_change", "argmax")},
             **{f: () for f in ("target", "token_id", "sequence", "position", "difficulty", "token_type")}}
    dtypes = {n: ("float16" if n.startswith("hidden") else DTYPES[n]) for n in names}
    dtypes["loop_group"] = DTYPES["loop_group"]
    attrs = {**ATTR_DEFAULTS, "split": path.stem, "token_types": ["keep", "change"], "difficulty_name": "position",
             "difficulty_levels": list(range(1, seq_len + 1)), "model": {"name": "bench-scale"},
             "vocab_size": vocab, "n_tokens": n_tokens, "n_loops": loops, "d_model": d_model, "dtypes": dtypes}
    specs = {n: ArraySpec((n_tokens, *shape), dtypes[n]) for n, shape in names.items()}
    specs["loop_group"] = ArraySpec((loops,), dtypes["loop_group"])
    assert set(specs) <= set(DIMS)
    w = StoreWriter.create(path, specs, attrs, chunk)
    w.write_small("loop_group", np.zeros(loops, dtype=np.int32))
    for c in range(w.n_chunks):
        rows = w.chunk_rows(c)
        n = rows.stop - rows.start
        rng = np.random.default_rng((seed, c))
        h0 = rng.standard_normal((n, d_model), dtype=np.float32)
        hidden = np.empty((n, loops, d_model), dtype=np.float16)
        h = h0.copy()
        for t in range(loops):
            h += np.float32(0.6 ** (t + 1)) * rng.standard_normal((n, d_model), dtype=np.float32)
            hidden[:, t] = h
        target = rng.integers(0, vocab, n)
        data = {"hidden": hidden, "hidden_init": h0.astype(np.float16),
                "argmax": np.where(rng.random((n, loops)) < 0.8, target[:, None],
                                   rng.integers(0, vocab, (n, loops))).astype(np.int32),
                "target": target, "token_id": rng.integers(0, vocab, n),
                "sequence": np.arange(rows.start, rows.stop) // seq_len,
                "position": np.arange(rows.start, rows.stop) % seq_len,
                "difficulty": np.arange(rows.start, rows.stop) % seq_len + 1,
                "token_type": rng.integers(0, 2, n)}
        for s in ("entropy", "max_prob", "margin", "kl_final"):
            data[s] = rng.random((n, loops), dtype=np.float32)
        data["target_logprob"] = -rng.random((n, loops), dtype=np.float32)
        for s in ("kl_prev", "kl_prev_rev", "logit_change"):
            x = rng.random((n, loops), dtype=np.float32)
            x[:, 0] = np.nan
            data[s] = x
        w.write_chunk(c, data)
    w.finish()


def analysis_child(spec: dict) -> None:
    """One analysis run (``--analysis-child``): geometry then readouts, in-process or on a LocalCluster."""
    import resource

    from looptrace.config import DaskConfig
    from looptrace.geometry.stage import GeometryConfig, geometry_model
    from looptrace.io.parallel import dask_runner
    from looptrace.io.store.reader import open_store
    from looptrace.rules.readouts import ReadoutsConfig, readouts_model
    from looptrace.rules.scoring import CalibrationConfig

    def usage() -> tuple[float, float]:
        r = resource.getrusage(resource.RUSAGE_SELF)
        return time.perf_counter(), r.ru_utime + r.ru_stime

    def worker_usage() -> dict:
        r = resource.getrusage(resource.RUSAGE_SELF)
        return {"cpu_s": r.ru_utime + r.ru_stime, "max_rss_mb": r.ru_maxrss / 1024}

    stores = {s: open_store(Path(spec["dir"]) / f"{s}.zarr") for s in ("val", "test")}
    out = Path(spec["out"])
    dask = DaskConfig("local", workers=spec["workers"]) if spec["workers"] else DaskConfig()
    t_start, _ = usage()
    with dask_runner(dask) as runner:
        t_up, _ = usage()
        if runner:  # the workers import the stage modules once, before the clock (reported as warmup_s)
            runner.client.run(_warm_up)
        t_warm, cpu0 = usage()
        w0 = runner.client.run(worker_usage) if runner else {}
        geometry_model(stores, GeometryConfig(splits=("val", "test")), out / "geometry",
                       meta={"model": "bench-scale"}, progress=False, runner=runner)
        t_geo, _ = usage()
        readouts_model(out / "geometry", ReadoutsConfig(), CalibrationConfig(), out / "readouts",
                       meta={"model": "bench-scale"}, progress=False, runner=runner)
        t_end, cpu1 = usage()
        w1 = runner.client.run(worker_usage) if runner else {}
    t_closed, _ = usage()
    workers_cpu = sum(w1[k]["cpu_s"] - w0[k]["cpu_s"] for k in w1)
    print(json.dumps({
        "startup_s": t_up - t_start, "warmup_s": t_warm - t_up, "close_s": t_closed - t_end,
        "geometry_s": t_geo - t_warm, "readouts_s": t_end - t_geo, "stage_s": t_end - t_warm,
        "main_cpu_s": cpu1 - cpu0, "workers_cpu_s": workers_cpu, "cores": (cpu1 - cpu0 + workers_cpu) / (t_end - t_warm),
        "main_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "worker_rss_mb": sorted(round(v["max_rss_mb"]) for v in w1.values())}), flush=True)


def _warm_up() -> None:
    import looptrace.geometry
    import looptrace.rules.readouts  # noqa: F401


def _analysis_run(store_dir: Path, out: Path, workers: int) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    spec = {"dir": str(store_dir), "out": str(out), "workers": workers}
    # stdout only: the child's stderr (its traceback when it fails) goes to this process's stderr
    res = subprocess.run([sys.executable, str(HERE), "--analysis-child", json.dumps(spec)], stdout=subprocess.PIPE,
                         text=True)
    if res.returncode:
        raise SystemExit(f"analysis run failed ({workers} workers, exit status {res.returncode}; its error above)")
    return json.loads(res.stdout.strip().splitlines()[-1])


def _digests(root: Path) -> dict[str, bytes]:
    import hashlib

    return {str(f.relative_to(root)): hashlib.md5(f.read_bytes()).digest() for f in sorted(root.rglob("*"))
            if f.is_file() and f.name != "metrics.json"} | {
        str(f.relative_to(root)): _metrics_without_times(f) for f in sorted(root.rglob("metrics.json"))}


def _metrics_without_times(f: Path) -> bytes:
    """metrics.json without wall-clock entries (none are written by geometry/readouts today; kept defensive)."""
    def strip(o):
        if isinstance(o, dict):
            return {k: strip(v) for k, v in o.items() if not k.endswith("seconds")}
        return [strip(v) for v in o] if isinstance(o, list) else o
    return json.dumps(strip(json.loads(f.read_text())), sort_keys=True).encode()


def _analysis_part(args, label: str, n_tokens: int) -> tuple[bool, dict]:
    n_chunks = -(-n_tokens // args.analysis_chunk)
    gib = 2 * n_tokens * args.analysis_loops * args.analysis_d_model * 2 / 2**30
    print(f"({label}) geometry + readouts: val + test stores of {n_tokens} tokens each ({n_chunks} chunks of "
          f"{args.analysis_chunk} per split, d_model {args.analysis_d_model}, T {args.analysis_loops}, float16 "
          f"hidden {gib:.2f} GiB raw in all); baseline: in-process; cluster: LocalCluster(2 workers x 1 thread); "
          f"{args.analysis_reps} repetitions; load average {os.getloadavg()[0]:.1f}", flush=True)
    tmp = Path(tempfile.mkdtemp(prefix="looptrace-bench-scale-"))
    try:
        t0 = time.perf_counter()
        for i, split in enumerate(("val", "test")):
            build_analysis_store(tmp / "stores" / f"{split}.zarr", n_tokens, args.analysis_d_model,
                                 args.analysis_loops, args.analysis_chunk, seed=i)
        print(f"  stores written in {time.perf_counter() - t0:.1f} s", flush=True)
        runs: dict[int, list] = {0: [], 2: []}
        identical = True
        for rep in range(args.analysis_reps):
            for workers in (0, 2):
                r = _analysis_run(tmp / "stores", tmp / f"out{workers}", workers)
                runs[workers].append(r)
                where = "in-process" if not workers else "2 workers "
                print(f"  rep {rep + 1} {where}: stage {r['stage_s']:.2f} s (geometry {r['geometry_s']:.2f}, "
                      f"readouts {r['readouts_s']:.2f}; cluster startup {r['startup_s']:.2f}, worker imports {r['warmup_s']:.2f}, "
                      f"close {r['close_s']:.2f}), "
                      f"{r['cores']:.2f} cores, main RSS {r['main_rss_mb']:.0f} MiB"
                      + (f", worker RSS {r['worker_rss_mb']} MiB" if workers else ""), flush=True)
            same = _digests(tmp / "out0") == _digests(tmp / "out2")
            identical &= same
            print(f"  rep {rep + 1}: outputs identical: {same}", flush=True)
        one, two = (min(runs[w], key=lambda r: r["stage_s"]) for w in (0, 2))
        ratio = one["stage_s"] / two["stage_s"]
        per_chunk = {w: 1000 * min(r["stage_s"] for r in runs[w]) / (2 * n_chunks) for w in (0, 2)}
        print(f"({label}) wall(in-process) / wall(2 workers), fastest of each: {ratio:.2f} (geometry "
              f"{one['geometry_s'] / two['geometry_s']:.2f}, readouts {one['readouts_s'] / two['readouts_s']:.2f}); "
              f"with cluster start-up and close: {one['stage_s'] / (two['stage_s'] + two['startup_s'] + two['warmup_s'] + two['close_s']):.2f}; "
              f"wall per chunk in-process {per_chunk[0]:.0f} ms, 2 workers {per_chunk[2]:.0f} ms; cores obtained "
              f"{one['cores']:.2f} / {two['cores']:.2f}; CPU in-process {one['main_cpu_s']:.1f} s, 2 workers "
              f"{two['main_cpu_s']:.1f} s main + {two['workers_cpu_s']:.1f} s workers; peak RSS main "
              f"{one['main_rss_mb']:.0f} / {two['main_rss_mb']:.0f} MiB, per worker {two['worker_rss_mb']} MiB; "
              f"outputs identical in every repetition: {identical}", flush=True)
        return identical, {"in_process": one, "cluster": two, "ratio": ratio, "n_tokens": n_tokens}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


_ANALYSIS: dict = {}


def part_b(args) -> bool:
    """Geometry + readouts, 2-worker LocalCluster vs in-process; True when the outputs are identical."""
    ok, _ANALYSIS["b"] = _analysis_part(args, "b", args.analysis_tokens)
    return ok


def part_c(args) -> bool:
    """Part (b) with 4x the tokens; prints how time and memory grow against (b) when (b) ran."""
    ok, c = _analysis_part(args, "c", 4 * args.analysis_tokens)
    b = _ANALYSIS.get("b")
    if b:
        g = {k: c[k]["stage_s"] / b[k]["stage_s"] for k in ("in_process", "cluster")}
        rss = max(c["cluster"]["worker_rss_mb"]) / max(b["cluster"]["worker_rss_mb"])
        print(f"(c) 4x tokens: stage time x{g['in_process']:.2f} in-process, x{g['cluster']:.2f} on 2 workers; "
              f"ratio {b['ratio']:.2f} -> {c['ratio']:.2f}; peak worker RSS x{rss:.2f}; main RSS "
              f"x{c['in_process']['main_rss_mb'] / b['in_process']['main_rss_mb']:.2f} in-process", flush=True)
    return ok


#: ``--smoke``: parts (a) and (b) at sizes of a run of seconds; (c) is (b) at 4x the tokens. Exit status 1 still when
#: outputs differ.
SMOKE = {"part": ["a", "b"], "sequences": 4, "seq_len": 8, "d_model": 16, "loops": 2, "vocab": 16, "batch": 2,
         "chunk": 16, "threads": 1, "reps": 1, "analysis_tokens": 256, "analysis_d_model": 16, "analysis_loops": 3,
         "analysis_chunk": 64, "analysis_reps": 1}
PARTS = {"a": part_a, "b": part_b, "c": part_c}


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
    ap.add_argument("--analysis-tokens", type=int, default=81920, help="(b) tokens per split; (c) has 4x")
    ap.add_argument("--analysis-d-model", type=int, default=512)
    ap.add_argument("--analysis-loops", type=int, default=6)
    ap.add_argument("--analysis-chunk", type=int, default=4096)
    ap.add_argument("--analysis-reps", type=int, default=2)
    ap.add_argument("--smoke", action="store_true", help="parts a and b at tiny sizes (seconds): does it still run, "
                    "are the outputs still identical (tests/test_benchmarks.py)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--analysis-child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.smoke:
        vars(args).update(SMOKE)
    if args.child:
        child(json.loads(args.child))
        return 0
    if args.analysis_child:
        analysis_child(json.loads(args.analysis_child))
        return 0
    ok = True
    for name in args.part or sorted(PARTS):
        ok &= PARTS[name](args)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
