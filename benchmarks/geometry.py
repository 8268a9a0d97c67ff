"""Benchmark of the geometry stage: streamed blocks vs the whole store in memory, and memory flatness.

One run, on synthetic stores big enough that ``hidden`` dominates (d_model 512, float16):

1. stream: ``geometry_model`` reading the store block by block (chunk-aligned, the stage default);
2. memory: the same code with one block holding every token (the whole ``hidden`` upcast in numpy);
3. stream on a store with 4× the tokens.

Each run is a fresh subprocess that reports its own wall and CPU time (around ``geometry_model`` only)
and peak RSS (``resource.getrusage(RUSAGE_SELF).ru_maxrss``). Stream and memory runs alternate
``--repeats`` times and the fastest wall time of each counts (the cores are shared, so a single run
can be slowed by other work; CPU time is printed too). Targets: time(stream) / time(memory) ≤ 1.2,
RSS(stream) / RSS(memory) ≤ 0.25, RSS(stream, 4×) / RSS(stream) ≤ 1.10. Exit status 1 when a target
is missed.

    python benchmarks/geometry.py [--tokens 40000] [--d-model 512] [--loops 6] [--chunk 2048] [--repeats 2] [--smoke]
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

TARGETS = {"time_ratio": 1.2, "rss_ratio": 0.25, "rss_growth": 1.10}
#: ``--smoke``: sizes of a run of seconds (the ratios mean nothing at this size; targets are not enforced).
SMOKE = {"tokens": 512, "d_model": 16, "loops": 3, "chunk": 128, "repeats": 1}


def build_store(path: Path, n_tokens: int, d_model: int, loops: int, vocab: int, chunk: int, seed: int) -> None:
    """Write a synthetic store: contracting trajectories h_t = h_{t−1} + r^t ξ_t (float16 hidden)."""
    from looptrace.io.store.writer import write_store

    rng = np.random.default_rng(seed)
    seq_len = 16
    h0 = rng.standard_normal((n_tokens, d_model), dtype=np.float32)
    hidden = np.empty((n_tokens, loops, d_model), dtype=np.float16)
    h = h0.copy()
    for t in range(loops):
        h += (0.6 ** (t + 1)) * rng.standard_normal((n_tokens, d_model), dtype=np.float32)
        hidden[:, t] = h
    del h

    def stat(positive: bool = True, first_nan: bool = False) -> np.ndarray:
        x = rng.random((n_tokens, loops), dtype=np.float32)
        x = x if positive else x - 0.5
        if first_nan:
            x[:, 0] = np.nan
        return x

    target = rng.integers(0, vocab, n_tokens)
    argmax = np.where(rng.random((n_tokens, loops)) < 0.8, target[:, None], rng.integers(0, vocab, (n_tokens, loops)))
    arrays = {
        "hidden": hidden, "hidden_init": h0.astype(np.float16),
        "entropy": stat(), "max_prob": stat(), "margin": stat(), "target_logprob": -stat(),
        "kl_prev": stat(first_nan=True), "kl_prev_rev": stat(first_nan=True), "kl_final": stat(),
        "logit_change": stat(first_nan=True), "argmax": argmax.astype(np.int32),
        "target": target.astype(np.int64), "token_id": rng.integers(0, vocab, n_tokens).astype(np.int64),
        "sequence": (np.arange(n_tokens) // seq_len).astype(np.int64),
        "position": (np.arange(n_tokens) % seq_len).astype(np.int64),
        "difficulty": (np.arange(n_tokens) % seq_len + 1).astype(np.int64),
        "token_type": rng.integers(0, 2, n_tokens).astype(np.int64),
        "loop_group": np.zeros(loops, dtype=np.int32),
    }
    attrs = {"split": "test", "token_types": ["keep", "change"], "difficulty_name": "position",
             "difficulty_levels": list(range(1, seq_len + 1)), "model": {"name": "bench"}}
    write_store(path, arrays, attrs, chunk_tokens=chunk)


def child(mode: str, store: Path, out: Path) -> None:
    """Run ``geometry_model`` once and print {"seconds", "cpu_seconds", "max_rss_mb"} as JSON."""
    from looptrace.geometry.stage import GeometryConfig, geometry_model
    from looptrace.io.store.reader import open_store

    st = open_store(store)
    block = None if mode == "stream" else st.n_tokens
    cfg = GeometryConfig(block_tokens=block, splits=("test",))
    r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    geometry_model({"test": st}, cfg, out, meta={"model": "bench"}, progress=False)
    seconds = time.perf_counter() - t0
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
    rss_mb = r1.ru_maxrss / 1024  # Linux: KiB
    print(json.dumps({"seconds": seconds, "cpu_seconds": cpu, "max_rss_mb": rss_mb}))


def _run_child(mode: str, store: Path, out: Path) -> dict:
    # stdout only: the child's stderr (its traceback when it fails) goes to this process's stderr
    res = subprocess.run([sys.executable, __file__, "--child", mode, "--store", str(store), "--out", str(out)],
                         check=True, stdout=subprocess.PIPE, text=True)
    return json.loads(res.stdout.strip().splitlines()[-1])


def _build_child(path: Path, args: argparse.Namespace, n_tokens: int) -> None:
    subprocess.run([sys.executable, __file__, "--build", str(path), "--tokens", str(n_tokens),
                    "--d-model", str(args.d_model), "--loops", str(args.loops), "--chunk", str(args.chunk)],
                   check=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=40_000)
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--loops", type=int, default=6)
    ap.add_argument("--vocab", type=int, default=16)
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--smoke", action="store_true", help="a tiny run (seconds) that checks the benchmark still runs end to end; targets not enforced "
                    "(tests/test_benchmarks.py)")
    ap.add_argument("--child", choices=["stream", "memory"], help=argparse.SUPPRESS)
    ap.add_argument("--build", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--store", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.smoke:
        vars(args).update(SMOKE)
    if args.child:
        child(args.child, args.store, args.out)
        return 0
    if args.build:
        build_store(args.build, args.tokens, args.d_model, args.loops, args.vocab, args.chunk, seed=0)
        return 0

    work = Path(args.workdir or tempfile.mkdtemp(prefix="looptrace-bench-geometry-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        small, big = work / "small.zarr", work / "big.zarr"
        _build_child(small, args, args.tokens)
        gb = args.tokens * args.loops * args.d_model * 2 / 2**30
        print(f"store: {args.tokens} tokens x {args.loops} loops x d_model {args.d_model} "
              f"(hidden {gb:.2f} GiB float16, chunk {args.chunk} tokens)")
        runs = {"stream": [], "memory": []}
        for _ in range(max(1, args.repeats)):
            for mode in runs:
                runs[mode].append(_run_child(mode, small, work / f"out_{mode}"))
        stream, memory = (min(runs[m], key=lambda r: r["seconds"]) for m in ("stream", "memory"))
        shutil.rmtree(small)
        _build_child(big, args, 4 * args.tokens)
        stream4 = _run_child("stream", big, work / "out_stream4")
        ratios = {"time_ratio": stream["seconds"] / memory["seconds"],
                  "rss_ratio": stream["max_rss_mb"] / memory["max_rss_mb"],
                  "rss_growth": stream4["max_rss_mb"] / stream["max_rss_mb"]}
        print(f"{'run':<14}{'wall s':>10}{'cpu s':>10}{'peak RSS MiB':>14}")
        for name, r in (("stream", stream), ("memory", memory), ("stream 4x", stream4)):
            print(f"{name:<14}{r['seconds']:>10.2f}{r['cpu_seconds']:>10.2f}{r['max_rss_mb']:>14.0f}")
        print(f"all wall times: stream {[round(r['seconds'], 2) for r in runs['stream']]}, "
              f"memory {[round(r['seconds'], 2) for r in runs['memory']]}")
        ok = True
        for k, v in ratios.items():
            good = v <= TARGETS[k]
            ok &= good
            print(f"{k:<12} {v:6.3f}  (target <= {TARGETS[k]})  {'ok' if good else 'MISSED'}")
        return 0 if ok or args.smoke else 1
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
