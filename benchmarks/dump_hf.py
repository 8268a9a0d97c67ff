"""Benchmark of an HF adapter dump: a wide tiny Dory (d_model ≥ 1024) against the model's own forward.

Same random-init ``DoryForCausalLM`` (saved to a temp dir and loaded through ``looptrace.models.adapters``),
same batches, each measured ``--reps`` times, interleaved, best run counts (the machine is shared):

1. own forward: ``DoryForCausalLM(ids, use_cache=False)`` — prelude, T loops, coda, head, once;
2. bare capture: ``adapter.states`` + ``adapter.readout`` of every loop, nothing kept (what any per-loop
   capture must compute: the exit path — coda + norm + head — runs T times instead of once);
3. bare + stats: the same plus ``looptrace.signals.logits.LoopStats`` and the top-k of every loop (the exact SPEC §3
   statistics from the full logits, which the dump computes);
4. dump: ``looptrace.capture.dump.dump_split`` to a fresh on-disk store (top-k mode: vocab > 256; background
   chunk writer).

Reported: wall(dump) / wall(bare + stats) — the cost of capturing and storing (target ≤ 1.15),
wall(bare + stats) / wall(bare) — the cost of exact statistics over the full vocabulary at every loop,
wall(bare) / wall(own) — the cost of T exits (no target: (prelude + T·(loop + exit)) / (prelude + T·loop
+ exit) by construction), and wall(dump) / wall(own). Exit status 1 when the target is missed.

    python benchmarks/dump_hf.py [--d-model 1024] [--loops 4] [--vocab 4096] [--sequences 16] [--seq-len 64]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

TARGETS = {"dump/stats": 1.15}
#: ``--smoke``: sizes of a run of seconds (the ratios mean nothing at this size; targets are not enforced).
SMOKE = {"d_model": 32, "loops": 2, "vocab": 300, "sequences": 2, "seq_len": 8, "batch": 2, "threads": 1, "reps": 1}


def run(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--d-model", type=int, default=1024)
    ap.add_argument("--loops", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--sequences", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8, help="sequences per forward pass")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--smoke", action="store_true", help="a tiny run (seconds) that checks the benchmark still runs end to end; targets not enforced "
                    "(tests/test_benchmarks.py)")
    args = ap.parse_args(argv)
    if args.smoke:
        vars(args).update(SMOKE)

    from transformers import DoryConfig, DoryForCausalLM

    from looptrace.capture.dump import DumpConfig, bare_forward, dump_split
    from looptrace.models.adapters.loading import AdapterConfig, load_adapter
    from looptrace.tasks import TaskBatch

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    d = args.d_model
    cfg = DoryConfig(vocab_size=args.vocab, hidden_size=d, intermediate_size=2 * d, num_hidden_layers=4,
                     num_attention_heads=8, num_key_value_heads=2, head_dim=d // 8, n_input_layers=1,
                     n_output_layers=1, n_recurrent_loops=args.loops, max_position_embeddings=max(128, args.seq_len))
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, args.vocab, (args.sequences, args.seq_len + 1))
    data = TaskBatch(tokens[:, :-1], tokens[:, 1:], np.full_like(tokens[:, :-1], -1), np.zeros_like(tokens[:, :-1]))
    batches = [torch.from_numpy(data.tokens[i:i + args.batch]) for i in range(0, args.sequences, args.batch)]
    T = args.loops
    with tempfile.TemporaryDirectory(prefix="looptrace-bench-hf-") as tmp:
        ckpt = Path(tmp) / "dory"
        DoryForCausalLM(cfg).eval().save_pretrained(ckpt)
        adapter = load_adapter(AdapterConfig(kind="dory", path=str(ckpt)))
        model = adapter.model
        print(f"config: Dory d_model {d}, 1 prelude + 2 recurrent × {T} loops + 1 coda, vocab {args.vocab}, "
              f"{data.tokens.size} tokens, batch {args.batch}, {args.threads} threads")

        def own() -> None:
            with torch.inference_mode():
                for ids in batches:
                    model(input_ids=ids, use_cache=False)

        def bare() -> None:
            bare_forward(adapter, batches)

        def stats() -> None:
            from looptrace.signals.logits import LoopStats

            with torch.inference_mode():
                for ids in batches:
                    st = adapter.states(ids)
                    tgt = torch.from_numpy(data.targets[: len(ids)].reshape(-1))
                    flat = lambda z: z.reshape(-1, z.shape[-1])  # noqa: E731
                    z_T = flat(adapter.readout(st.hidden[:, :, T - 1], T - 1))
                    acc = LoopStats(z_T, tgt)
                    for t in range(T):
                        z = z_T if t == T - 1 else flat(adapter.readout(st.hidden[:, :, t], t))
                        acc.update(z)
                        z.topk(16, dim=-1)

        n = [0]

        def dump() -> None:
            n[0] += 1
            dump_split(adapter, data, Path(tmp) / f"s{n[0]}.zarr",
                       DumpConfig(batch_size=args.batch, chunk_tokens=1024, hidden_dtype="float16"), progress=False)

        own(), bare()  # warm-up
        best = {k: float("inf") for k in ("own", "bare", "stats", "dump")}
        for _ in range(args.reps):
            for name, fn in (("own", own), ("bare", bare), ("stats", stats), ("dump", dump)):
                t0 = time.perf_counter()
                fn()
                best[name] = min(best[name], time.perf_counter() - t0)
    ratios = {"dump/stats": best["dump"] / best["stats"], "stats/bare": best["stats"] / best["bare"],
              "bare/own": best["bare"] / best["own"], "dump/own": best["dump"] / best["own"]}
    for k, v in best.items():
        print(f"{k:>5}: {v:.2f} s ({data.tokens.size / v:,.0f} tokens/s)")
    ok = True
    for k, v in ratios.items():
        tgt = TARGETS.get(k)
        mark = "" if tgt is None else (" ok" if v <= tgt else f" MISSED (target ≤ {tgt})")
        ok &= tgt is None or v <= tgt
        print(f"{k}: {v:.2f}{'' if tgt is None else f' (target ≤ {tgt})'}{mark}")
    return 0 if ok or args.smoke else 1


if __name__ == "__main__":
    sys.exit(run())
