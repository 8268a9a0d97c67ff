"""One prepared command for an accelerator: the dump and early-exit generation at Ouro-1.4B shape, each as a ratio
against the bare model measured in the same run (issue 28; docs/dump.md, docs/generate.md).

On one CUDA device (``--timeout`` seconds of wall in all, default 360) it builds two random-init models at the
shape of Ouro-1.4B in bfloat16 — d_model 2048, 16 heads, a block of 24 layers looped T = 4 times, vocab 49,152:

- ``looped``: looptrace's own :class:`~looptrace.models.looped.LoopedTransformer` (MLP 4·d, a linear halting gate
  so that the native Q-exit has a gate to read; built directly on the device);
- ``ouro``: the Ouro stand-in of the adapter tests (``tests/hf_helpers.build_ouro``: Ouro's interfaces, GQA-free
  16 heads, MLP 5632, its exit gate), saved and loaded through :mod:`looptrace.models.adapters`, so that the
  adapter path is measured too (needs the ``hf`` extra; skipped with a message otherwise).

For each model it prints:

1. **dump**: wall of :func:`looptrace.capture.dump.dump_split` (states in bfloat16 + top-16 logits + the exact SPEC
   §3 statistics from the full logits, written to a local-disk store) / wall of the bare pass (``adapter.states`` and
   the readout of every loop, nothing kept), interleaved bare, dump, bare, ... and each dump divided by the mean of
   its two bare neighbours (median over ``--reps``); the store's write rate (bytes on disk / dump wall) against a
   plain ``write()`` of as many bytes to a file in the same directory, measured in the same run; peak device memory
   of the dump / of the bare pass.
2. **generation**: greedy decoding (:func:`looptrace.online.generate.decode_tokens`) of ``--new-tokens`` tokens
   after ``--prompts`` random prompts, at each batch size of ``--batches``, for each KV policy the model has
   (``share``, ``recompute``, ``native``): full depth (the baseline), then each rule of ``--rules`` — ``top1``,
   ``entropy``, ``rel_step`` (thresholds calibrated on a full-depth decode for a mean exit depth of T/2, as
   benchmarks/generate.py) and the native Q-exit ``q_exit`` at q = ``--q`` (random gates: no calibration). Reported:
   tokens/s, mean exit depth d, ideal = T/d, realised = t_full / t_rule (median of paired repeats), realised/ideal.
   Each rule runs on the per-loop path (``<rule>``), on the lookahead path with the rule decided on the device
   (``<rule>+la``: looptrace.online.lookahead + device_rules) and, where the rule has a device form, on the lookahead
   path with the rule on the host (``<rule>+la/h``); then a per-phase table at batch 1, policy share (embed, block,
   readout, rule, kv, python in ms per token, each timed call between two synchronisations) for the three paths,
   with each path's total over the per-loop path's. The dump table also gives the device → host copies of one dump
   (capture/transfer.py: bytes and summed CUDA-event time on the side stream).

Without CUDA (or with ``--device cpu``) the same code runs at a tiny shape on the CPU in well under a minute and
says that no device was used: that is the smoke run of tests/test_benchmarks.py. Every section checks the time left
and prints ``skipped (time)`` rather than overrun ``--timeout``.

    python benchmarks/gpu.py [--timeout 360] [--device auto|cuda|cpu] [--shape auto|ouro-1.4b|tiny] [--no-ouro]
                             [--sequences 64 --seq-len 1024 --batch 8] [--reps 2] [--prompts 4 --prompt-len 16
                             --new-tokens 16] [--batches 1,8] [--rules top1,entropy,rel_step,q_exit] [--out DIR]
    make bench-gpu
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]

#: Model shapes: Ouro-1.4B (hidden 2048, 24 layers, 16 heads, 4 recurrent steps, vocab 49152, MLP 5632 in Ouro; 4·d
#: in looptrace's own block) and a tiny one for CPU runs.
SHAPES = {
    "ouro-1.4b": {"d_model": 2048, "heads": 16, "layers": 24, "loops": 4, "vocab": 49152, "ouro_mlp": 5632,
                  "sequences": 64, "seq_len": 1024, "batch": 8, "chunk": 4096},
    "tiny": {"d_model": 64, "heads": 4, "layers": 2, "loops": 4, "vocab": 512, "ouro_mlp": 128,
             "sequences": 8, "seq_len": 16, "batch": 4, "chunk": 32},
}


class Clock:
    """Wall time with the device drained before and after (CUDA kernels are asynchronous)."""

    def __init__(self, device: torch.device):
        self.sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        self.cuda = device.type == "cuda"

    def __call__(self, fn: Callable[[], object]) -> tuple[float, int]:
        """(seconds, peak device bytes allocated during ``fn``; 0 on CPU)."""
        self.sync()
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        fn()
        self.sync()
        dt = time.perf_counter() - t0
        return dt, (torch.cuda.max_memory_allocated() if self.cuda else 0)


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def plain_write(path: Path, n_bytes: int, block: int = 64 << 20) -> float:
    """Seconds to write ``n_bytes`` of incompressible bytes to ``path`` with plain ``write()`` calls (no fsync, like
    the store's writes: both land in the page cache first)."""
    buf = np.random.default_rng(0).integers(0, 256, min(block, max(n_bytes, 1)), dtype=np.uint8).tobytes()
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        left = n_bytes
        while left > 0:
            left -= f.write(buf[:left] if left < len(buf) else buf)
    dt = time.perf_counter() - t0
    path.unlink()
    return dt


# ----------------------------------------------------------------------------------------------
# Models
# ----------------------------------------------------------------------------------------------


def build_looped(shape: dict, block_size: int, device: torch.device, dtype: torch.dtype):
    """looptrace's own looped model at ``shape`` (random init on the device itself: no host copy of the weights)."""
    from looptrace.models.interface import LoopedTransformerAdapter
    from looptrace.models.looped import GroupConfig, LoopedTransformer, ModelConfig

    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=shape["vocab"], block_size=block_size, d_model=shape["d_model"],
                      n_head=shape["heads"], groups=(GroupConfig(shape["layers"], shape["loops"]),), gate="linear")
    with torch.device(device):
        model = LoopedTransformer(cfg)
    model = model.to(dtype).eval()
    extra = {"dtype": str(dtype).removeprefix("torch.")}
    return LoopedTransformerAdapter(model, "looped", extra=extra, device=str(device))


def build_ouro_adapter(shape: dict, block_size: int, device: torch.device, dtype: torch.dtype, where: Path):
    """The Ouro stand-in of tests/hf_helpers.py at ``shape``, saved under ``where`` and loaded as an adapter."""
    sys.path.insert(0, str(REPO))
    from looptrace.models.adapters.loading import AdapterConfig, load_adapter
    from tests.hf_helpers import build_ouro

    name = str(dtype).removeprefix("torch.")
    path = build_ouro(where / "ouro", dtype=dtype, hidden_size=shape["d_model"], intermediate_size=shape["ouro_mlp"],
                      num_hidden_layers=shape["layers"], num_attention_heads=shape["heads"],
                      num_key_value_heads=shape["heads"], vocab_size=shape["vocab"], total_ut_steps=shape["loops"],
                      layer_types=["full_attention"] * shape["layers"], max_window_layers=shape["layers"],
                      max_position_embeddings=max(128, block_size), torch_dtype=name)
    return load_adapter(AdapterConfig(kind="ouro", path=str(path), name="ouro", dtype=name, trust_remote_code=True),
                        device=str(device))


# ----------------------------------------------------------------------------------------------
# Dump vs bare
# ----------------------------------------------------------------------------------------------


def dump_section(adapter, args, shape: dict, out: Path, clock: Clock, left: Callable[[], float]) -> dict | None:
    """Ratios of one model's dump against its bare pass (same batches, same process, interleaved)."""
    from looptrace.capture.dump import DumpConfig, bare_forward, dump_split
    from looptrace.tasks import TaskBatch

    dev = adapter.device
    T, V = adapter.info.n_loops, adapter.info.vocab_size
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, V, (args.sequences, args.seq_len + 1))
    data = TaskBatch(tokens[:, :-1], tokens[:, 1:], np.zeros_like(tokens[:, :-1]), np.zeros_like(tokens[:, :-1]))
    batches = [torch.from_numpy(data.tokens[i:i + args.batch]).to(dev) for i in range(0, args.sequences, args.batch)]
    cfg = DumpConfig(batch_size=args.batch, chunk_tokens=shape["chunk"], hidden_dtype="auto")
    store = out / f"{adapter.info.name}.zarr"

    def bare() -> None:
        bare_forward(adapter, batches)

    import looptrace.capture.dump as D

    made: list = []  # the dumps' device -> host transfers (capture/transfer.py): their copies' CUDA-event times
    real_transfer = D.transfer_for

    def dump() -> None:
        def spy(device):
            made.append(real_transfer(device))
            return made[-1]
        D.transfer_for = spy
        try:
            dump_split(adapter, data, store, cfg, progress=False)
        finally:
            D.transfer_for = real_transfer

    def fresh() -> None:
        shutil.rmtree(store, ignore_errors=True)
        shutil.rmtree(out / f".{store.name}.claims", ignore_errors=True)
        os.sync()

    t_bare, _ = clock(bare)  # warm-up: kernels, allocator, zarr's event loop
    fresh()
    t_dump, _ = clock(dump)
    if left() < 3 * (t_bare + t_dump) + 5:
        print(f"  {adapter.info.name}: skipped (time: one bare pass {t_bare:.1f} s, one dump {t_dump:.1f} s)")
        return None
    seq: list[tuple[str, float, int]] = []
    size = 0
    made.clear()
    for r in range(args.reps + 1):
        seq.append(("bare", *clock(bare)))
        if r == args.reps or left() < 2 * (t_bare + t_dump) + 5:
            break
        fresh()
        seq.append(("dump", *clock(dump)))
        size = _dir_bytes(store)
    fresh()
    rel = [seq[i][1] / ((seq[i - 1][1] + seq[i + 1][1]) / 2) for i in range(1, len(seq) - 1) if seq[i][0] == "dump"]
    dumps = [w for n, w, _ in seq if n == "dump"]
    bares = [w for n, w, _ in seq if n == "bare"]
    peak = {n: max(p for m, _, p in seq if m == n) for n in ("bare", "dump")}
    t_plain = plain_write(out / "plain.bin", size)
    from looptrace.capture.dump import weights_hash

    t0 = time.perf_counter()
    weights_hash(adapter)  # part of every dump_split call's fingerprint (a checkpoint file hash: at load)
    t_hash = time.perf_counter() - t0
    n_tok = data.tokens.size
    raw = n_tok * (T + 1) * adapter.info.d_model * 2  # the states alone, 2-byte dtype, uncompressed
    res = {"model": adapter.info.name, "tokens": n_tok, "bare_s": statistics.median(bares),
           "dump_s": statistics.median(dumps), "dump/bare": statistics.median(rel), "reps": len(rel),
           "range": (min(rel), max(rel)), "store_gb": size / 1e9, "raw_state_gb": raw / 1e9,
           "write_gbs": size / 1e9 / statistics.median(dumps), "plain_gbs": size / 1e9 / t_plain,
           "peak_bare_gb": peak["bare"] / 1e9, "peak_dump_gb": peak["dump"] / 1e9, "hash_s": t_hash,
           # device -> pinned host copies on the side stream (0 on a CPU: the synchronous form copies nothing)
           "d2h_ms": statistics.median([t.copy_ms for t in made]) if made else 0.0,
           "d2h_gb": statistics.median([t.bytes for t in made]) / 1e9 if made else 0.0}
    return res


def print_dump(rows: list[dict]) -> None:
    print(f"  {'model':7s} {'tokens':>7s} {'bare s':>7s} {'dump s':>7s} {'dump/bare':>9s} {'(range)':>13s} "
          f"{'store MB':>8s} {'write GB/s':>10s} {'plain GB/s':>10s} {'w/plain':>7s} {'peak GB bare':>12s} "
          f"{'dump':>6s} {'ratio':>6s} {'hash s':>6s} {'d2h GB':>6s} {'d2h ms':>7s}")
    for r in rows:
        ratio = r["peak_dump_gb"] / r["peak_bare_gb"] if r["peak_bare_gb"] else float("nan")  # nan: no device
        print(f"  {r['model']:7s} {r['tokens']:7d} {r['bare_s']:7.3f} {r['dump_s']:7.3f} {r['dump/bare']:9.3f} "
              f"{r['range'][0]:6.3f}-{r['range'][1]:6.3f} {r['store_gb'] * 1e3:8.1f} {r['write_gbs']:10.2f} "
              f"{r['plain_gbs']:10.2f} {r['write_gbs'] / r['plain_gbs']:7.3f} {r['peak_bare_gb']:12.2f} "
              f"{r['peak_dump_gb']:6.2f} {ratio:6.2f} {r['hash_s']:6.2f} {r['d2h_gb']:6.2f} {r['d2h_ms']:7.1f}")
    print("  (hash s: the weights' sha256 in the dump's fingerprint, included in dump s; write GB/s: bytes on disk / "
          "dump wall; plain: a write() of as many bytes in the same directory; d2h: the device -> pinned host copies "
          "of one dump on the side stream, overlapping the next batch's compute, summed CUDA-event time; 0 on a CPU)")


# ----------------------------------------------------------------------------------------------
# Generation
# ----------------------------------------------------------------------------------------------


def gen_section(model, args, clock: Clock, left: Callable[[], float],
                breakdowns: list[dict] | None = None) -> list[dict]:
    """Early-exit decoding of one model: every policy it has × batch size × rule, against full depth (and, into
    ``breakdowns``, the per-phase cost at batch 1 with policy share of each rule on each path)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from generate import (  # benchmarks/generate.py (calibrate: a mean exit depth of T/2)
        PHASES,
        breakdown,
        calibrate,
    )

    from looptrace.models.decode import DecodeUnsupported
    from looptrace.models.decoders import decoder_for
    from looptrace.online.device_rules import device_rule
    from looptrace.online.engine import RegistryRule
    from looptrace.online.generate import decode_tokens
    from looptrace.online.lookahead import decode_tokens_lookahead

    info = model.info
    T = info.n_loops
    dev = model.device
    gen = torch.Generator().manual_seed(1)
    prompts = torch.randint(0, info.vocab_size, (max(args.batches), args.prompt_len), generator=gen).to(dev)
    rows: list[dict] = []
    for policy in ("share", "recompute", "native"):
        try:
            dec = decoder_for(model, policy)
        except DecodeUnsupported as exc:
            print(f"  {info.name} {policy}: not decodable ({str(exc)[:90]})")
            continue
        rules: dict[str, float] = {}
        for name in args.rules:
            if name == "q_exit":
                if info.has_gate:
                    rules[name] = args.q
                continue
            if left() < 10:
                break
            tau, _ = calibrate(dec, prompts[: args.prompts], args.new_tokens, name, T / 2)
            rules[name] = tau
        for B in args.batches:
            if left() < 10 or len(rules) < len([r for r in args.rules if r != "q_exit" or info.has_gate]):
                print(f"  {info.name} {policy} batch {B}: skipped (time)")
                continue
            p = prompts[:B] if B > 1 else prompts[: args.prompts]

            def run(rule_name: str | None, la: bool = False, dv: bool = True, p=p, B=B, dec=dec,
                    rules=rules) -> tuple[float, np.ndarray, np.ndarray]:
                """Seconds (decode only), exit depths, tokens of one pass over the prompts at batch B (``la``: the
                lookahead path, no host read per loop: looptrace.online.lookahead; ``dv``: its rule decided on the
                device where it has a device form, looptrace.online.device_rules)."""
                out = []
                for i in range(0, p.shape[0], B):
                    rule = None if rule_name is None else RegistryRule(rule_name, rules[rule_name], "float32")
                    out.append(decode_tokens_lookahead(dec, p[i:i + B], args.new_tokens, rule, device_rules=dv)
                               if la else decode_tokens(dec, p[i:i + B], args.new_tokens, rule))
                return (sum(r.seconds for r in out), np.concatenate([r.exit_depth for r in out]),
                        np.concatenate([r.tokens for r in out]))

            clock(lambda: run(None))  # warm-up
            # the lookahead path too (issue 28 item 2), where the policy allows it (Ouro's native runs every loop)
            la_ok = policy != "native" or dec.native == "compact"
            # '+la': the lookahead path with the rule decided on the device where it can be (the default); '+la/h':
            # the same with the rule on the host (numpy signals, a host read per loop), for the rules with a device form
            dv_rules = {r for r in rules if device_rule(RegistryRule(r, rules[r], "float32")) is not None}
            times: dict[str | None, list[float]] = {None: [], **{r: [] for r in rules}, **{f"{r}+la": [] for r in rules},
                                                    **{f"{r}+la/h": [] for r in dv_rules}}
            last: dict[str, tuple[np.ndarray, np.ndarray]] = {}
            full_tok = None
            for _ in range(args.gen_reps):
                s, _, full_tok = run(None)
                times[None].append(s)
                for r in rules:
                    s, depth, tok = run(r)
                    times[r].append(s)
                    last[r] = (depth, tok)
                    if la_ok:
                        s, depth, tok = run(r, True)
                        times[f"{r}+la"].append(s)
                        last[f"{r}+la"] = (depth, tok)
                    if la_ok and r in dv_rules:
                        s, depth, tok = run(r, True, False)
                        times[f"{r}+la/h"].append(s)
                        last[f"{r}+la/h"] = (depth, tok)
                        assert np.array_equal(tok, last[f"{r}+la"][1]), f"{r}: the device rule changed the tokens"
            n_tok = p.shape[0] * args.new_tokens
            t_full = statistics.median(times[None])
            rows.append({"model": info.name, "policy": policy, "batch": B, "rule": "full", "thr": float("nan"),
                         "depth": float(T), "ideal": 1.0, "real": 1.0, "tok_s": n_tok / t_full, "agree": 1.0})
            for r in [v for name in rules for v in ((name, f"{name}+la", *((f"{name}+la/h",) if name in dv_rules else ()))
                                                       if la_ok else (name,))]:
                depth, tok = last[r]
                d = float(depth.mean())
                real = statistics.median(f / e for f, e in zip(times[None], times[r], strict=True))
                rows.append({"model": info.name, "policy": policy, "batch": B, "rule": r, "thr": rules[r.split("+")[0]],
                             "depth": d,
                             "ideal": T / d, "real": real, "tok_s": n_tok / statistics.median(times[r]),
                             "agree": float((tok == full_tok).mean())})
            if breakdowns is None or B != 1 or policy != "share":
                continue
            # per-phase cost (issue 28 item 2): block, head (readout), rule, KV policy, python; each timed call
            # between two synchronisations on a device (its own cost: the overlap is in the table above)
            sync = torch.cuda.synchronize if dev.type == "cuda" else None
            for r in rules:
                if left() < 15:
                    print(f"  {info.name} breakdown {r}: skipped (time)")
                    break

                def factory(r=r, rules=rules):
                    return RegistryRule(r, rules[r], "float32")
                paths = [("per-loop", False, False), *((("la/h", True, False),) if r in dv_rules else ()),
                         ("la", True, True)]
                base = None
                for path, la, dv in paths:
                    b, depth = breakdown(dec, p, args.new_tokens, factory, la, dv, sync)
                    tot = sum(b.values())
                    base = tot if base is None else base
                    breakdowns.append({"model": info.name, "name": r, "path": path, "depth": float(depth.mean()),
                                       **{k: 1e3 * b[k] / n_tok for k in PHASES}, "total": 1e3 * tot / n_tok,
                                       "vs": tot / base})
    return rows


def print_breakdown(rows: list[dict]) -> None:
    from generate import PHASES

    print(f"  {'model':7s} {'rule':9s} {'path':8s} {'depth':>5s} " + " ".join(f"{p:>7s}" for p in PHASES)
          + f" {'total':>8s} {'/per-loop':>9s}   (ms per token)")
    for r in rows:
        print(f"  {r['model']:7s} {r['name']:9s} {r['path']:8s} {r['depth']:5.2f} "
              + " ".join(f"{r[p]:7.3f}" for p in PHASES) + f" {r['total']:8.3f} {r['vs']:9.3f}")


def print_gen(rows: list[dict]) -> None:
    print(f"  {'model':7s} {'policy':9s} {'batch':>5s} {'rule':13s} {'thr':>9s} {'depth':>6s} {'ideal':>6s} "
          f"{'real':>6s} {'r/ideal':>7s} {'tok/s':>8s} {'agree':>6s}")
    for r in rows:
        print(f"  {r['model']:7s} {r['policy']:9s} {r['batch']:5d} {r['rule']:13s} {r['thr']:9.4g} {r['depth']:6.2f} "
              f"{r['ideal']:5.2f}x {r['real']:5.2f}x {r['real'] / r['ideal']:7.2f} {r['tok_s']:8.1f} {r['agree']:6.2f}")


# ----------------------------------------------------------------------------------------------
# The run
# ----------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--timeout", type=float, default=360, help="seconds of wall for the whole run (sections that "
                    "would overrun it are skipped and say so)")
    ap.add_argument("--device", default="auto", help="auto (cuda when available), cuda, cuda:N or cpu")
    ap.add_argument("--shape", default="auto", choices=("auto", *SHAPES), help="auto: ouro-1.4b on CUDA, tiny on CPU")
    ap.add_argument("--no-ouro", action="store_true", help="only looptrace's own model (not the Ouro stand-in)")
    ap.add_argument("--sequences", type=int, default=None)
    ap.add_argument("--seq-len", type=int, default=None)
    ap.add_argument("--batch", type=int, default=None, help="sequences per forward pass of the dump")
    ap.add_argument("--reps", type=int, default=2, help="dumps, each between two bare passes")
    ap.add_argument("--prompts", type=int, default=4, help="prompts decoded at batch 1 (and the calibration's)")
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--rules", default="top1,entropy,rel_step,q_exit")
    ap.add_argument("--q", type=float, default=0.5, help="q of the native Q-exit (random gates: not calibrated)")
    ap.add_argument("--gen-reps", type=int, default=3, help="paired repeats (full depth, then every rule)")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's own)")
    ap.add_argument("--out", default=None, help="directory of the stores (local disk; default a temp dir)")
    ap.add_argument("--smoke", action="store_true", help="the CPU form whatever devices there are: tiny shape, 1 "
                    "repetition, batches 1 and 2 (tests/test_benchmarks.py)")
    args = ap.parse_args(argv)
    t_start = time.perf_counter()
    if args.smoke:
        args.device = "cpu"
    cuda = args.device.startswith("cuda") or (args.device == "auto" and torch.cuda.is_available())
    if not cuda and args.shape in ("auto", "tiny"):  # the CPU form: the same code at a size of seconds
        args.shape, args.reps, args.gen_reps, args.prompts, args.new_tokens = "tiny", 1, 1, 2, 3
        args.prompt_len, args.batches, args.threads = 4, "1,2", args.threads or 1
    if args.threads:
        torch.set_num_threads(args.threads)
    if cuda and not torch.cuda.is_available():
        print("--device cuda: no CUDA device visible to torch", file=sys.stderr)
        return 2
    dev = torch.device(("cuda" if args.device == "auto" else args.device) if cuda else "cpu")
    shape = dict(SHAPES[args.shape if args.shape != "auto" else ("ouro-1.4b" if cuda else "tiny")])
    for k in ("sequences", "seq_len", "batch"):
        if getattr(args, k) is None:
            setattr(args, k, shape[k])
    args.batches = [int(b) for b in args.batches.split(",")]
    args.rules = [r for r in args.rules.split(",") if r]
    dtype = torch.bfloat16 if cuda else torch.float32
    left = lambda: args.timeout - (time.perf_counter() - t_start)  # noqa: E731
    clock = Clock(dev)
    name = torch.cuda.get_device_name(dev) if cuda else "none (CPU only)"
    print(f"# looptrace benchmarks/gpu.py — {datetime.now(UTC):%Y-%m-%d %H:%M} UTC, {platform.node()}, torch "
          f"{torch.__version__}; device: {name}")
    if not cuda:
        print("# NO ACCELERATOR USED: the CPU run at the tiny shape (a smoke run of the same code; its ratios are not "
              "the accelerator's)")
    print(f"# shape {args.shape if args.shape != 'auto' else ('ouro-1.4b' if cuda else 'tiny')}: d_model "
          f"{shape['d_model']}, {shape['heads']} heads, {shape['layers']} layers x T = {shape['loops']} loops, vocab "
          f"{shape['vocab']}, {str(dtype).removeprefix('torch.')}; dump {args.sequences} x {args.seq_len} tokens, "
          f"batch {args.batch}; decode {args.prompts} prompts x {args.prompt_len} + {args.new_tokens} new, batches "
          f"{args.batches}")
    block = max(args.seq_len, args.prompt_len + args.new_tokens)
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="looptrace-gpu-"))
    out.mkdir(parents=True, exist_ok=True)
    models = []
    dump_rows: list[dict] = []
    gen_rows: list[dict] = []
    bd_rows: list[dict] = []
    try:
        t0 = time.perf_counter()
        looped = build_looped(shape, block, dev, dtype)
        n_params = sum(p.numel() for p in looped.model.parameters())
        print(f"# looped: {n_params / 1e9:.3f} B parameters, built in {time.perf_counter() - t0:.1f} s")
        models.append(looped)
        if not args.no_ouro:
            try:
                import transformers  # noqa: F401 - the hf extra
            except ImportError:
                print("# ouro: skipped (transformers not installed: pip install -e '.[hf]')")
            else:
                t0 = time.perf_counter()
                models.append(build_ouro_adapter(shape, block, dev, dtype, out))
                print(f"# ouro: stand-in built, saved and loaded through the adapter in {time.perf_counter() - t0:.1f} s")
        print("\n== dump: states + top-16 logits + exact statistics -> local-disk store, vs the bare pass ==")
        for m in models:
            if left() < 20:
                print(f"  {m.info.name}: skipped (time)")
                continue
            r = dump_section(m, args, shape, out, clock, left)
            if r is not None:
                dump_rows.append(r)
        print_dump(dump_rows)
        print("\n== generation: greedy decode, early exit vs full depth (same decoder, same run) ==")
        for m in models:
            if left() < 15:
                print(f"  {m.info.name}: skipped (time)")
                continue
            gen_rows += gen_section(m, args, clock, left, bd_rows)
        print_gen(gen_rows)
        print("\n== per-phase cost at batch 1, policy share: per-loop path, lookahead with the rule on the host (la/h) "
              "and on the device (la) ==")
        print_breakdown(bd_rows)
    finally:
        if not args.out:
            shutil.rmtree(out, ignore_errors=True)
    print(f"\n# total {time.perf_counter() - t_start:.1f} s wall (timeout {args.timeout:.0f} s); device: {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
