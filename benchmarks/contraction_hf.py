"""Benchmark of ``dump.contraction`` and ``dump.layers`` through an HF adapter's loop step (issue 27): the cost ratio
to a plain dump of the same adapter, measured in the same run.

The model is one of the adapter tests' tiny checkpoints (tests/hf_helpers.py: the Huginn / Ouro stand-ins of the
published code, or transformers' own Dory), built in a temporary directory and loaded through ``load_adapter`` like
any checkpoint; every run dumps the same random token batches to a fresh in-memory store. Runs, interleaved and
repeated ``--reps`` times (plain, exact, plain, iters₁, plain, iters₂, ...: ``dump.contraction`` at its defaults — the
exact block norm when d_model ≤ ``exact_width`` — then the power method, ``exact_width: 1``, at each
``power_iters``; each contraction run divided by the mean of the plain
dumps just before and after it, the ratio the median over repetitions), after one untimed warm-up of each. Then
``dump.layers: [0, 1]`` to on-disk stores: bytes and wall as ratios to the plain on-disk dump (one run each).

    python benchmarks/contraction_hf.py [--kind ouro|huginn|dory] [--sequences 64] [--seq-len 16] [--iters 1 2]
                                        [--threads 2] [--reps 2] [--smoke]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling benchmark's paired timing
from contraction import layers_cost, paired_ratios  # noqa: E402

SMOKE = {"sequences": 4, "seq_len": 5, "iters": [1], "reps": 1, "threads": 1}


def build(kind: str, where: Path):
    """The tiny checkpoint of the adapter tests, loaded as an adapter."""
    sys.path.insert(0, str(REPO))
    from looptrace.models.adapters.loading import AdapterConfig, load_adapter
    from tests import hf_helpers as H

    if kind == "dory":
        return load_adapter(AdapterConfig(kind="dory", path=str(H.build_dory(where / "dory"))))
    path = (H.build_ouro if kind == "ouro" else H.build_huginn)(where / kind)
    return load_adapter(AdapterConfig(kind=kind, path=str(path), trust_remote_code=True))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kind", choices=("ouro", "huginn", "dory"), default="ouro")
    ap.add_argument("--sequences", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=16)
    ap.add_argument("--iters", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--smoke", action="store_true", help="a tiny run (seconds) that checks the benchmark still runs")
    args = ap.parse_args()
    if args.smoke:
        for k, v in SMOKE.items():
            setattr(args, k, v)
    torch.set_num_threads(args.threads)

    from looptrace.capture.contraction import ContractionConfig
    from looptrace.capture.dump import DumpConfig, dump_split
    from looptrace.io.store.location import memory_store
    from looptrace.tasks import TaskBatch

    tmp = Path(tempfile.mkdtemp(prefix="looptrace-bench-contraction-hf-"))
    try:
        adapter = build(args.kind, tmp)
        rng = np.random.default_rng(0)
        tokens = rng.integers(0, adapter.info.vocab_size - 4, (args.sequences, args.seq_len))
        zeros = np.zeros_like(tokens)
        data = TaskBatch(tokens=tokens, targets=rng.integers(0, 4, tokens.shape), difficulty=zeros, token_type=zeros)
        base = {"batch_size": args.batch, "chunk_tokens": 4096, "hidden_dtype": "float32"}
        runs = {"plain": DumpConfig(**base), "exact": DumpConfig(**base, contraction=ContractionConfig())}
        for n in args.iters:  # the power method (what a model wider than exact_width gets)
            runs[f"iters={n}"] = DumpConfig(**base, contraction=ContractionConfig(power_iters=n, exact_width=1))

        def timed(name: str) -> float:
            t0 = time.perf_counter()
            dump_split(adapter, data, memory_store(), runs[name], progress=False)
            return time.perf_counter() - t0

        plain, ratios = paired_ratios(timed, list(runs), args.reps)
        info = adapter.info
        print(f"contraction_hf benchmark: {args.kind} ({info.n_loops} loops, d_model {info.d_model}, "
              f"{len(adapter.loop_layers(0))} loop-block layers), {args.sequences} sequences x {args.seq_len} "
              f"positions, {args.threads} threads, {args.reps} reps")
        print(f"plain dump: {statistics.median(plain):.3f} s (median)")
        for name, r in ratios.items():
            what = (f"exact (d_model {info.d_model} <= exact_width)" if name == "exact"
                    else f"power_iters={name.split('=')[1]} (exact_width 1)")
            print(f"  {what}: contraction dump / plain dump = {statistics.median(r):.2f}x")
        print(layers_cost(adapter, data, base, tmp))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
