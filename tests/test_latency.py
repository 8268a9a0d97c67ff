"""Real early exit (SPEC §8): compaction reproduces full-depth predictions truncated at each token's exit
loop; online rules reproduce the offline exit depths; the stage matches the offline evaluation exactly."""

from __future__ import annotations

import json

import numpy as np
import polars as pl
import pytest
import torch

from looptrace.models.looped import GroupConfig, LoopedTransformer
from looptrace.online.engine import (
    OnlineRule,
    early_exit,
    float32_threshold,
    full_work,
    make_rule,
    minimal_work,
)
from looptrace.online.latency import LatencyConfig, latency_models, write_latency
from looptrace.rules.builtin import ALL_RULES
from looptrace.rules.registry import get_rule, loop_signals
from looptrace.rules.scoring import CalibrationConfig, exit_depths
from looptrace.signals.halting import halting_cdf
from looptrace.signals.logits import logit_stats
from looptrace.signals.names import select
from looptrace.signals.steps import step_metrics
from tests.builders import tiny_checkpoint, tiny_model, tiny_task

torch.set_num_threads(1)


class HandRule(OnlineRule):
    """Fires at hand-set per-(row, position) depths; its depth table follows the compaction."""

    needs_logits = False

    def __init__(self, depth: torch.Tensor):
        super().__init__("hand", 0.0, "ge")
        self.depth = depth

    def reset(self, model, h0):
        self.state = {"depth": self.depth[:, :h0.shape[1]].clone()}  # h0 arrives truncated (causal)

    def fires(self, t, h, z, model):
        d = self.state["depth"]
        assert d.shape == h.shape[:2], "rule state must follow the compacted batch"
        return d == t


def _model(causal: bool = True, gate: str = "none", loops: int = 5, vocab: int = 5, seq: int = 9,
           groups=None, seed: int = 1) -> LoopedTransformer:
    return tiny_model(vocab=vocab, seq=seq, loops=loops, gate=gate, causal=causal, groups=groups, n_coda=1, seed=seed)


@pytest.mark.parametrize("causal", [True, False])
def test_compaction_equals_truncated_full_depth(causal):
    """Exit at hand-set depths, batch compaction on: every token's prediction equals the full-depth
    forward's argmax at its exit loop, exactly as the offline evaluation reads it."""
    m = _model(causal=causal, groups=(GroupConfig(1, 2), GroupConfig(1, 3)))  # two looped groups, T = 5
    T, B, S = 5, 7, 9
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 5, (B, S), generator=g)
    scored = torch.rand(B, S, generator=g) < 0.7
    scored[2] = False  # a row with nothing to predict never runs
    scored[4, :] = False
    scored[4, 1] = True  # only an early position: causal truncation to a 2-token prefix
    depth = torch.randint(1, T + 1, (B, S), generator=g)
    depth[0] = 1  # a row that leaves after loop 1
    depth[5, -1] = T  # a late position that keeps its whole prefix looping
    with torch.inference_mode():
        ref = m(tokens).logits  # [B, S, T, V]
    run = early_exit(m, tokens, scored, HandRule(depth))
    want = ref.argmax(-1).gather(2, (depth - 1).unsqueeze(-1)).squeeze(-1)  # [B, S]
    assert torch.equal(run.exit_depth, torch.where(scored, depth, 0))
    assert torch.equal(run.pred[scored], want[scored])
    assert (run.pred[~scored] == -1).all()
    # Batch size 1: the work done equals the exact minimum (suffix max under causal attention).
    w1 = sum(early_exit(m, tokens[i:i + 1], scored[i:i + 1], HandRule(depth[i:i + 1])).work for i in range(B))
    assert w1 == minimal_work(depth.numpy(), scored.numpy(), causal)
    full = early_exit(m, tokens, scored, None)
    assert torch.equal(full.pred[scored], ref[:, :, -1].argmax(-1)[scored])
    assert (full.exit_depth[scored] == T).all() and full.loops_run == T


def test_minimal_and_full_work_hand_cases():
    d = np.array([[1, 3, 2, 9], [2, 1, 1, 1]])
    s = np.array([[True, True, True, False], [True, False, False, False]])
    # causal: row 0 suffix max over scored = 3, 3, 2, 0; row 1 = 2, 0, 0, 0
    assert minimal_work(d, s, causal=True) == 3 + 3 + 2 + 2
    assert minimal_work(d, s, causal=False) == 3 * 4 + 2 * 4
    assert full_work(s, 6, causal=True) == (3 + 1) * 6
    assert full_work(s, 6, causal=False) == 2 * 4 * 6


def test_float32_threshold_same_decisions():
    rng = np.random.default_rng(0)
    for thr in [0.1, 1 / 3, 0.9999999, 1e-8, 2.5]:
        s32 = (np.float32(thr) + rng.integers(-40, 41, 400).astype(np.float32) * np.spacing(np.float32(thr)))
        s32 = s32.astype(np.float32)
        for op in ("ge", "le"):
            t32 = np.float32(float32_threshold(thr, op))
            want = s32.astype(np.float64) >= thr if op == "ge" else s32.astype(np.float64) <= thr
            got = s32 >= t32 if op == "ge" else s32 <= t32
            assert np.array_equal(got, want), (thr, op)


def _gap_thresholds(values: np.ndarray, n: int = 10) -> list[float]:
    """Thresholds in the middle of the widest gaps between sorted values in their central half (widest
    first), so that float32 noise of a different batch composition (~1e-7 relative) cannot move a value
    across one — the test checks the rule logic; the stage checks bit-level agreement on the real models."""
    v = np.unique(values[np.isfinite(values)])
    lo, hi = v.size // 4, 3 * v.size // 4
    if hi - lo < 2:  # a few distinct values (counts): every midpoint
        lo, hi = 0, v.size - 1
    gaps = v[lo + 1:hi + 1] - v[lo:hi]
    return [float((v[lo + k] + v[lo + k + 1]) / 2) for k in np.argsort(-gaps, kind="stable")[:n]]


_ONLINE_BUILTINS = [r for r in ALL_RULES if get_rule(r).online is not None]


def _offline_signals(out, scored: torch.Tensor) -> dict[str, np.ndarray]:
    """token_loop.parquet's columns of the scored positions, computed the offline way: logit stats from full
    logits (LoopStats of the dump), step signals from float16-rounded states, the gate logits (float64)."""
    n = int(scored.sum())
    sig = {k: v.astype(np.int64 if k == "argmax" else np.float64)
           for k, v in logit_stats(out.logits[scored], torch.zeros(n, dtype=torch.int64)).items()}
    geo = step_metrics(out.hidden[scored].to(torch.float16).numpy(), out.hidden_init[scored].to(torch.float16).numpy())
    sig.update({k: v.astype(np.float64) for k, v in geo.items()})
    sig["hidden_change"] = sig["step_norm"]
    sig["gate_logit"] = out.gate_logits[scored].numpy().astype(np.float64)
    return loop_signals(sig, out.logits.shape[2])


def test_online_rules_cover_every_builtin_but_the_oracle():
    assert _ONLINE_BUILTINS == [r for r in ALL_RULES if r != "oracle"]
    with pytest.raises(ValueError, match="cannot run online"):
        make_rule("oracle", 1.0)


@pytest.mark.parametrize("rule", _ONLINE_BUILTINS)
def test_online_rules_reproduce_offline_exit_depths(rule):
    """Each registered rule, run online, fires where readouts.exit_depths fires on the offline score (stats
    from full logits, geometry from float16-rounded states, halting CDF from gate logits)."""
    r = get_rule(rule)
    # seed 3 for argmax_stable: a model whose argmax changes between loops for a few tokens
    m = _model(gate="linear", loops=6, seed=3 if rule == "argmax_stable" else 1)
    m.gate.net.bias.data.fill_(-2.0)
    m.gate.net.weight.data.normal_(0.0, 1.0, generator=torch.Generator().manual_seed(0))  # varied halting
    B, S = 12, 9
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, 5, (B, S), generator=g)
    scored = torch.ones(B, S, dtype=torch.bool)
    scored[:, ::4] = False
    with torch.inference_mode():
        out = m(tokens)
    sig = r.score_of(_offline_signals(out, scored))
    window = sig[:, max(0, r.min_loop - 1 - int(r.two_hit)):]
    for thr in _gap_thresholds(window):  # the widest gap whose threshold gives varied exits
        want = exit_depths(sig, np.array([thr]), r.op, r.min_loop, r.two_hit)[0]
        if len(np.unique(want)) > 1:
            break
    assert rule == "fixed" or 1 < len(np.unique(want))
    for bs in (1, 5):
        got = torch.cat([early_exit(m, tokens[i:i + bs], scored[i:i + bs], make_rule(rule, thr)).exit_depth
                         for i in range(0, B, bs)])
        assert np.array_equal(got[scored].numpy(), want), (rule, bs)


def test_live_signals_equal_stored_values_bit_for_bit_under_compaction():
    """LiveSignals fed the same states and readouts as the dump and geometry stage, with rows dropped and
    positions truncated between loops, returns exactly the stored float32 values of the kept positions.
    (``gate_logit`` is the model's own output, not a signal formula: not part of this check.)"""
    from looptrace.online.live_signals import LiveSignals
    from looptrace.signals.logits import LoopStats

    m = _model(gate="linear", loops=6)
    B, S, T = 7, 9, 6
    tokens = torch.randint(0, 5, (B, S), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        out = m(tokens)
        zs = [m.readout(out.hidden[:, :, t]) for t in range(T)]  # [B, S, V] per loop, as the engine reads out
    # every online logit and state signal of the registry (aliases too), and the loop index
    names = (*select("logits", online=True), *select("states", online=True), "loop")
    # Offline: the dump's LoopStats on [token, vocab] rows, step_metrics on the float16 store, gate logits as stored.
    flat = [z.reshape(B * S, -1) for z in zs]
    acc = LoopStats(flat[-1], torch.zeros(B * S, dtype=torch.int64))
    stored = [acc.update(z) for z in flat]
    geo = step_metrics(out.hidden.reshape(B * S, T, -1).to(torch.float16).numpy(),
                       out.hidden_init.reshape(B * S, -1).to(torch.float16).numpy())
    live = LiveSignals(names, m, "float16")
    rows, seq = torch.arange(B), S
    with torch.inference_mode():
        live.reset(out.hidden_init)
        for t in range(T):
            if t == 2:  # drop rows 1 and 4, keep the first 6 positions
                keep = torch.tensor([0, 2, 3, 5, 6])
                rows, seq = rows[keep], 6
                live.compact(keep, seq)
            if t == 4:  # drop one more row (a compacted index), truncate to 4 positions
                keep = torch.tensor([0, 1, 3])
                rows, seq = rows[keep], 4
                live.compact(keep, seq)
            h = out.hidden[rows][:, :seq, t].contiguous()
            got = live.update(t + 1, h, zs[t][rows][:, :seq].contiguous())
            idx = (rows[:, None] * S + torch.arange(seq)[None]).reshape(-1)
            for n in names:
                g = got[n].reshape(-1).numpy()
                if n in stored[t]:
                    w = stored[t][n][idx].numpy()
                elif n == "loop":
                    w = np.full(idx.numel(), t + 1, dtype=np.int64)
                else:
                    w = geo["step_norm" if n == "hidden_change" else n][idx.numpy(), t]
                assert g.dtype == w.dtype, n
                assert np.array_equal(g.view(np.uint32) if g.dtype == np.float32 else g,
                                      w.view(np.uint32) if w.dtype == np.float32 else w), (n, t)


# ----------------------------------------------------------------------------------------------
# The stage end to end on a tiny checkpoint + dump store + hand-written chosen points
# ----------------------------------------------------------------------------------------------


def _tiny_pipeline(tmp_path):
    from looptrace.capture.dump import DumpConfig, dump_model
    from looptrace.models.interface import LoopedTransformerAdapter

    task = tiny_task()  # running sum mod 5, 8 digits; checkpoint: 4 loops, linear gate
    # seed 7: a random model whose refit gate exits at depths > 1 (test_refit_gate_runs_online_exactly)
    model = tiny_model(vocab=task.vocab_size, seq=task.seq_len, loops=4, gate="linear", seed=7)
    name = "rs-joint"
    ckpt = tiny_checkpoint(tmp_path / "train", name, task, model=model)
    adapter = LoopedTransformerAdapter.from_checkpoint(ckpt)
    stores = dump_model(adapter, task, {"fit": 42, "val": 43, "test": 44}, tmp_path / "dump" / name,
                        DumpConfig(sequences={"fit": 48, "val": 30, "test": 30}, batch_size=4, chunk_tokens=32),
                        progress=False)
    st = stores["test"]
    # Offline evaluation at hand-picked thresholds, straight from the store's signals.
    correct = st.read("argmax") == st.read("target")[:, None]
    sigs = {"top1": (st.read("max_prob").astype(np.float64), "ge", 1, False),
            "q_exit": (halting_cdf(st.read("gate_logit")), "ge", 1, False)}
    rows, ex = [], []
    for rule, (sig, op, ml, two) in sigs.items():
        thr = float(np.median(sig))
        d = exit_depths(sig, np.array([thr]), op, ml, two)[0]
        c = correct[np.arange(d.size), d - 1]
        rows.append({"rule": rule, "kind": "native" if rule == "q_exit" else "posthoc", "threshold": thr,
                     "test_depth": float(d.mean()), "test_accuracy": float(c.mean())})
        ex.append(pl.DataFrame({"rule": [rule] * d.size, "token": np.arange(d.size), "exit_depth": d,
                                "correct": c}))
    rdir = tmp_path / "readouts" / name
    rdir.mkdir(parents=True)
    pl.DataFrame(rows).write_parquet(rdir / "chosen.parquet")
    pl.concat(ex).write_parquet(rdir / "chosen_exits.parquet")
    return name, rows, stores


def test_stage_matches_offline_evaluation(tmp_path):
    name, rows, stores = _tiny_pipeline(tmp_path)
    cfg = LatencyConfig(rules=("top1", "q_exit", "gate"), batch_sizes=(1, 4), bs1_sequences=30, warmup=0, repeats=1)
    roots = [tmp_path / d for d in ("train", "dump", "readouts", "gates")]
    df, metrics = latency_models([name], *roots, cfg, progress=False)
    assert df.height == 4 and df["exact"].all()
    off = {r["rule"]: r for r in rows}
    for r in df.iter_rows(named=True):
        assert r["accuracy_real"] == pytest.approx(off[r["rule"]]["test_accuracy"], abs=0)
        assert r["mean_exit_depth"] == pytest.approx(off[r["rule"]]["test_depth"], abs=1e-12)
        assert r["ideal_speedup"] == pytest.approx(4 / off[r["rule"]]["test_depth"])
        assert r["speedup_ratio"] == pytest.approx(r["realised_speedup"] / r["ideal_speedup"])
        assert r["n_tokens"] == stores["test"].n_tokens and r["exit_mismatches"] == 0
    assert metrics["all_exact"] and "gate" in metrics["models"][name]["skipped"]
    fastest = df.filter(pl.col("batch_size") == 4).sort("realised_speedup", descending=True)["rule"][0]
    assert metrics["models"][name]["fastest_bs4"]["rule"] == fastest and metrics["models"][name]["exact_bs1"]
    write_latency(tmp_path / "latency", df, metrics)
    assert pl.read_parquet(tmp_path / "latency" / "latency.parquet").shape == df.shape
    assert json.loads((tmp_path / "latency" / "metrics.json").read_text())["all_exact"] is True


def test_stage_refuses_mismatching_offline_exits(tmp_path):
    name, _, _ = _tiny_pipeline(tmp_path)
    p = tmp_path / "readouts" / name / "chosen_exits.parquet"
    ex = pl.read_parquet(p)
    ex = ex.with_columns(exit_depth=pl.when((pl.col("rule") == "top1") & (pl.col("token") == 3))
                         .then(5 - pl.col("exit_depth")).otherwise(pl.col("exit_depth")))
    ex.write_parquet(p)
    roots = [tmp_path / d for d in ("train", "dump", "readouts", "gates")]
    cfg = LatencyConfig(rules=("top1",), batch_sizes=(4,), warmup=0, repeats=1)
    with pytest.raises(ValueError, match="differs from the offline chosen point on 1 exit depths"):
        latency_models([name], *roots, cfg, progress=False)
    df, _ = latency_models([name], *roots, LatencyConfig(rules=("top1",), batch_sizes=(4,), warmup=0, repeats=1,
                                                         require_exact=False), progress=False)
    assert df["exit_mismatches"].to_list() == [1] and not df["exact"].any()


def test_stage_cli_one_line_error(tmp_path):
    from typer.testing import CliRunner

    from looptrace.cli import app

    res = CliRunner().invoke(app, ["latency", "--models", "nope", "--train-root", str(tmp_path)])
    assert res.exit_code == 2
    assert "model.pt' not found" in res.output and len(res.output.strip().splitlines()) == 1


def test_refit_gate_runs_online_exactly(tmp_path):
    """The gates stage's fitted gate (saved without pickle, loaded through looptrace.online.live_gate.load_online_gate)
    runs in the engine and reproduces the gates stage's offline chosen exits token by token."""
    from looptrace.gates.config import GatesConfig
    from looptrace.gates.stage import gates_stage

    name, _, stores = _tiny_pipeline(tmp_path)
    gcfg = GatesConfig(gates=("logreg-consistent",), pca_components=4, stats=("entropy", "kl_prev", "accel"),
                       cross_gates=(), max_fit_tokens=None)
    gates_stage({name: stores}, gcfg, CalibrationConfig(), tmp_path / "gates", progress=False)
    roots = [tmp_path / d for d in ("train", "dump", "readouts", "gates")]
    cfg = LatencyConfig(rules=("gate",), batch_sizes=(1, 3), bs1_sequences=30, warmup=0, repeats=1)
    df, metrics = latency_models([name], *roots, cfg, progress=False)
    assert df["rule"].to_list() == ["gate:logreg-consistent"] * 2 and df["source"].to_list() == ["gates"] * 2
    assert df["exact"].all() and "gate" not in metrics["models"][name].get("skipped", {})
    assert 1.0 < df["mean_exit_depth"][0] < 4.0  # the gate really decides (not all at 1 or at T)
    ex = pl.read_parquet(tmp_path / "gates" / name / "chosen_exits.parquet")
    assert df["mean_exit_depth"][1] == pytest.approx(float(ex["exit_depth"].mean()), abs=1e-12)
    assert df["accuracy_real"][1] == pytest.approx(float(ex["correct"].mean()), abs=1e-12)
