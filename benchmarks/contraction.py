"""Benchmark of ``dump.contraction`` and ``dump.layers``: the loop-map statistics (SPEC §2b) and per-layer states vs a
plain dump.

Same random-init LoopedTransformer and batches for every run (default: the default pipeline's toy size — d_model
64, one layer × 6 loops, 12 positions, vocab 2 — 512 sequences, i.e. one val split). Runs, in an interleaved order
repeated ``--reps`` times (plain, iters₁, plain, iters₂, ..., so each contraction run is divided by the mean of the
plain dumps just before and after it; the ratio is the median over repetitions, which cancels this shared VM's
drift): a plain ``dump_split`` to a fresh in-memory store, the same dump with ``dump.contraction`` at its defaults
(d_model ≤ ``exact_width``: the exact block norm and its upper bound from S·d VJPs per loop), and with the power
method (``exact_width: 1``) at ``dump.contraction.power_iters`` = each of ``--iters``. One untimed run of each comes
first (warm-up).

Printed: seconds of the plain dump, then for the exact run and per power-iteration count the ratio
wall(contraction dump) / wall(plain dump) and the marginal cost of one more iteration in plain dumps; and the
seconds a default-sized run adds (the
default pipeline dumps 2048 sequences per model: fit 1024, val 512, test 512). No target is enforced: the
numbers decide whether the option may be on by default (docs/dump.md).

Then ``dump.layers``: a model whose loop block has two layers (otherwise the same), dumped to on-disk stores plainly
and with ``layers: [0, 1]``; printed: the store bytes and wall time of the per-layer dump as ratios to the plain one.

    python benchmarks/contraction.py [--sequences 512] [--seq-len 12] [--d-model 64] [--loops 6] [--iters 1 2 4]
                                     [--threads 2] [--reps 3] [--device cpu] [--smoke]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

SMOKE = {"sequences": 6, "seq_len": 5, "d_model": 16, "loops": 2, "iters": [1, 2], "reps": 1, "threads": 1}
#: Sequences the default pipeline dumps per model (params.yaml dump.sequences: fit + val + test).
DEFAULT_SEQUENCES = 2048


def paired_ratios(timed: Callable[[str], float], names: list[str], reps: int
                  ) -> tuple[list[float], dict[str, list[float]]]:
    """Each run of ``names`` other than ``"plain"`` timed between two plain runs, after one untimed warm-up of
    every name: (every plain time, name -> its time / the mean of its two plain neighbours per repetition) — the
    baseline measured in the same run, next to each measurement (shared with benchmarks/contraction_hf.py)."""
    for name in names:  # warm-up, untimed
        timed(name)
    plain: list[float] = []
    ratios: dict[str, list[float]] = {n: [] for n in names if n != "plain"}
    for _ in range(reps):
        before = timed("plain")
        plain.append(before)
        for name in ratios:
            t = timed(name)
            after = timed("plain")
            plain.append(after)
            ratios[name].append(t / ((before + after) / 2))
            before = after
    return plain, ratios


def layers_cost(adapter, data, cfg: dict, tmp) -> str:
    """One plain dump and one with ``dump.layers: [0, 1]`` of ``data`` under ``tmp``, one run each: the printed
    line with the store-bytes and wall ratios (shared with benchmarks/contraction_hf.py)."""
    from looptrace.capture.dump import DumpConfig, dump_split  # lazily, as main's imports (after --threads)

    res = {}
    for name, layers in (("plain", ()), ("layers", (0, 1))):
        path = tmp / f"{name}.zarr"
        t0 = time.perf_counter()
        dump_split(adapter, data, path, DumpConfig(**cfg, layers=layers), progress=False)
        res[name] = (time.perf_counter() - t0, sum(f.stat().st_size for f in path.rglob("*") if f.is_file()))
    (tp, bp), (tl, bl) = res["plain"], res["layers"]
    return (f"dump.layers [0, 1]: store {bl / 2**20:.2f} MiB vs plain {bp / 2**20:.2f} MiB = {bl / bp:.2f}x bytes, "
            f"{tl / tp:.2f}x wall ({tl:.2f} s vs {tp:.2f} s, one run each)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sequences", type=int, default=512)
    ap.add_argument("--seq-len", type=int, default=12)
    ap.add_argument("--d-model", type=int, default=64)
    ap.add_argument("--loops", type=int, default=6)
    ap.add_argument("--iters", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--smoke", action="store_true", help="a tiny run (seconds) that checks the benchmark still runs")
    args = ap.parse_args()
    if args.smoke:
        for k, v in SMOKE.items():
            setattr(args, k, v)
    torch.set_num_threads(args.threads)

    from looptrace.capture.contraction import ContractionConfig
    from looptrace.capture.dump import DumpConfig, dump_split
    from looptrace.io.store.location import memory_store
    from looptrace.models.interface import LoopedTransformerAdapter
    from looptrace.models.looped import GroupConfig, LoopedTransformer, ModelConfig
    from looptrace.tasks import TaskBatch

    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=4, block_size=args.seq_len, d_model=args.d_model, n_head=4 if args.d_model % 4 == 0
                      else 1, groups=(GroupConfig(1, args.loops),))
    adapter = LoopedTransformerAdapter(LoopedTransformer(cfg), "bench", device=args.device)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 4, (args.sequences, args.seq_len))
    zeros = np.zeros_like(tokens)
    data = TaskBatch(tokens=tokens, targets=rng.integers(0, 4, tokens.shape), difficulty=zeros, token_type=zeros)
    runs = {"plain": DumpConfig(batch_size=args.batch, chunk_tokens=4096),
            "exact": DumpConfig(batch_size=args.batch, chunk_tokens=4096, contraction=ContractionConfig())}
    for n in args.iters:  # the power method (what a model wider than exact_width gets)
        runs[f"iters={n}"] = DumpConfig(batch_size=args.batch, chunk_tokens=4096,
                                        contraction=ContractionConfig(power_iters=n, exact_width=1))

    def timed(name: str) -> float:
        t0 = time.perf_counter()
        dump_split(adapter, data, memory_store(), runs[name], progress=False)
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    plain, ratios = paired_ratios(timed, list(runs), args.reps)
    base = statistics.median(plain)
    n_tok = args.sequences * args.seq_len
    print(f"contraction benchmark: {args.sequences} sequences x {args.seq_len} positions ({n_tok} tokens), d_model "
          f"{args.d_model}, {args.loops} loops, device {args.device}, {args.threads} threads, {args.reps} reps")
    print(f"plain dump: {base:.3f} s (median)")
    med = {name: statistics.median(r) for name, r in ratios.items()}
    prev = None
    for name, r in med.items():
        extra = (r - 1) * base * DEFAULT_SEQUENCES / args.sequences
        if name == "exact":
            print(f"  exact (d_model {args.d_model} <= exact_width): contraction dump / plain dump = {r:.2f}x (adds "
                  f"~{extra:.1f} s per default-sized model, {DEFAULT_SEQUENCES} sequences)")
            continue
        n = int(name.split("=")[1])
        step = "" if prev is None else f"; +{(r - prev[1]) / (n - prev[0]):.2f} plain dumps per extra iteration"
        print(f"  power_iters={n} (exact_width 1): contraction dump / plain dump = {r:.2f}x (adds ~{extra:.1f} s "
              f"per default-sized model, {DEFAULT_SEQUENCES} sequences){step}")
        prev = (n, r)

    import shutil
    import tempfile
    from pathlib import Path

    torch.manual_seed(0)
    cfg2 = ModelConfig(vocab_size=4, block_size=args.seq_len, d_model=args.d_model, n_head=cfg.n_head,
                       groups=(GroupConfig(2, args.loops),))
    ad2 = LoopedTransformerAdapter(LoopedTransformer(cfg2), "bench2", device=args.device)
    tmp = Path(tempfile.mkdtemp(prefix="looptrace-bench-layers-"))
    try:
        print(layers_cost(ad2, data, {"batch_size": args.batch, "chunk_tokens": 4096}, tmp) + " (a 2-layer block)")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
