"""Real early exit on the default models: realised vs ideal speedup, and why they differ (SPEC §8).

For each model and rule (chosen points of artifacts/readouts/<model>/), at batch size 1 and at a
compacted batch, this prints

- the realised wall-clock speedup over full depth, the ideal T / mean exit depth and their ratio
  (the target is ≥ 0.8), and the exact-causal ideal (the best an exit that reproduces the offline
  evaluation can do under causal attention, docs/latency.md);
- at the batch: the speedup *without* compaction (the whole batch loops until its slowest token
  exits, readouts every loop) — what Huginn's docs warn flatters batched early exit;
- at batch size 1: a cost model. The early-exit time per sequence is fitted as t(k) = a + b·k
  against a forced exit loop k = 1..T (the rule's per-loop work still done): ``a`` is the fixed
  cost (embedding, batch set-up, final readout, Python bookkeeping), ``b`` the cost of one loop
  *with* the rule's check (readout, signal, compaction), shown beside one bare loop step; the
  predicted speedup is t_full / (a + b·L) with L the loops actually run. ``b`` − step is the
  price of deciding every loop whether to stop.

Timing is paired: per repeat, full depth then early exit; the speedup is the median of the
per-repeat ratios (robust to load drift on a shared machine).

Usage: ``python benchmarks/latency.py [--models a,b] [--rules top1,q_exit] [--batch 256] [--root artifacts]``
(needs the train, dump and readouts artifacts of the default pipeline).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from looptrace.models.looped import load_checkpoint
from looptrace.online.engine import OnlineRule, full_work, minimal_work
from looptrace.online.latency import load_test_data, readout_rule_specs, run_split

ROOT = Path("artifacts")


def _paired(full, exit_, repeats: int = 9) -> tuple[float, float, float]:
    """Interleaved timing: per repeat, run ``full`` then ``exit_``. Returns (median of the per-repeat
    ratios full / exit, median full time, median exit time) — pairing cancels slow load drift."""
    full(), exit_()
    tf, te = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        full()
        t1 = time.perf_counter()
        exit_()
        t2 = time.perf_counter()
        tf.append(t1 - t0)
        te.append(t2 - t1)
    return statistics.median(a / b for a, b in zip(tf, te, strict=True)), statistics.median(tf), statistics.median(te)


@torch.inference_mode()
def no_compaction(model, tokens, scored, rule) -> None:
    """Batched early exit without compaction: every row loops until the batch's last token exited."""
    cfg = model.cfg
    h0 = model.embed(tokens)
    h = h0
    rule.reset(model, h0)
    undecided = scored.clone()
    for t in range(1, cfg.n_loops + 1):
        h = model.step(h, h0, cfg.loop_group[t - 1])
        z = model.readout(h)
        if t == cfg.n_loops:
            break
        undecided &= ~rule.fires(t, h, z, model)
        if not bool(undecided.any()):
            break


class ForcedDepth(OnlineRule):
    """Pays the wrapped rule's per-loop cost but exits every token at loop k (for the cost model)."""

    def __init__(self, inner: OnlineRule, k: int):
        super().__init__(inner.name, 0.0, "ge")
        self.inner, self.k, self.needs_logits = inner, k, inner.needs_logits

    def reset(self, model, h0):
        self.inner.reset(model, h0)

    def compact(self, rows, seq):
        self.inner.compact(rows, seq)

    def fires(self, t, h, z, model):
        hit = self.inner.fires(t, h, z, model)
        return torch.full_like(hit, t >= self.k)


def cost_model(model, tokens, scored, spec, repeats: int) -> dict:
    """Least-squares fit, at batch size 1, of the early-exit wall time per sequence against the exit
    loop k = 1..T (every token forced to exit at k, the rule's per-loop work still done):
    t(k) = a + b·k. ``b`` is the per-loop cost with the rule's check, ``c_step`` one bare loop."""
    T = model.cfg.n_loops
    n = tokens.shape[0]
    ks = np.arange(1, T + 1)
    ts = [_paired(lambda: None, lambda k=k: run_split(model, tokens, scored, 1,
                                                       lambda k=k: ForcedDepth(spec.factory(), k)), repeats)[2] / n
          for k in ks]
    b, a = np.polyfit(ks, ts, 1)
    with torch.inference_mode():
        h0 = model.embed(tokens[:1])
        c_step = _paired(lambda: None, lambda: model.step(h0, h0, 0), 50)[2]
    return {"a": float(a), "b": float(b), "c_step": c_step}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="running_parity-uniform,running_parity-geometric,running_parity-joint,"
                                        "running_sum-uniform,running_sum-geometric,running_sum-joint")
    ap.add_argument("--rules", default="top1,entropy,q_exit")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--bs1-sequences", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--root", type=Path, default=ROOT, help="artifacts root holding train/, dump/ and readouts/")
    args = ap.parse_args()
    root = args.root
    torch.set_num_threads(args.threads)
    rules = tuple(args.rules.split(","))
    print(f"{'model':26s} {'rule':8s} {'batch':>5s} {'depth':>5s} {'ideal':>6s} {'exact':>6s} {'real':>6s} "
          f"{'r/ideal':>7s} {'no-compact':>10s} {'model-pred':>10s} {'a/b/step us':>14s}")
    ratios: dict[int, list[float]] = {1: [], args.batch: []}
    for name in args.models.split(","):
        model, _ = load_checkpoint(root / "train" / name / "model.pt")
        data, token, hidden_dtype = load_test_data(root / "dump" / name / "test.zarr")
        scored_all = token >= 0
        specs, _ = readout_rule_specs(root / "readouts" / name, rules, int(scored_all.sum()), model.gate is not None,
                                      hidden_dtype)
        T = model.cfg.n_loops
        for spec in specs:
            for bs in (1, args.batch):
                n = args.bs1_sequences if bs == 1 else data.tokens.shape[0]
                tok, sc = torch.from_numpy(data.tokens[:n]), torch.from_numpy(scored_all[:n])
                ed, _, loops, _ = run_split(model, tok, sc, bs, spec.factory)
                scored = scored_all[:n]
                depth = float(ed[scored].mean())
                exact_ideal = full_work(scored, T, model.cfg.causal) / minimal_work(ed, scored, model.cfg.causal)
                real, t_full, _ = _paired(lambda m=model, tok=tok, sc=sc, bs=bs: run_split(m, tok, sc, bs, None),
                                          lambda m=model, tok=tok, sc=sc, bs=bs, spec=spec: run_split(
                                              m, tok, sc, bs, spec.factory), args.repeats)
                ideal = T / depth
                ratios[bs].append(real / ideal)
                extra_nc = extra_pred = extra_cs = ""
                if bs > 1:
                    def nc(m=model, tok=tok, sc=sc, bs=bs, spec=spec):
                        for lo in range(0, tok.shape[0], bs):
                            no_compaction(m, tok[lo:lo + bs], sc[lo:lo + bs], spec.factory())
                    extra_nc = f"{_paired(lambda m=model, tok=tok, sc=sc, bs=bs: run_split(m, tok, sc, bs, None), nc, args.repeats)[0]:.2f}x"
                else:
                    c = cost_model(model, tok, sc, spec, max(3, args.repeats // 2))
                    L = float(np.mean(loops))
                    pred = (t_full / n) / (c["a"] + c["b"] * L)
                    extra_pred = f"{pred:.2f}x"
                    extra_cs = f"{1e6 * c['a']:.0f}/{1e6 * c['b']:.0f}/{1e6 * c['c_step']:.0f}"
                print(f"{name:26s} {spec.rule:8s} {bs:5d} {depth:5.2f} {ideal:5.2f}x {exact_ideal:5.2f}x "
                      f"{real:5.2f}x {real / ideal:7.2f} {extra_nc:>10s} {extra_pred:>10s} {extra_cs:>14s}")
    for bs, r in ratios.items():
        if r:
            print(f"batch {bs}: realised / ideal median {statistics.median(r):.2f} (min {min(r):.2f}, max {max(r):.2f}); "
                  f"{sum(x >= 0.8 for x in r)} of {len(r)} runs ≥ 0.8")


if __name__ == "__main__":
    main()
