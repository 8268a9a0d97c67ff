"""Real early exit in the looped model and its wall-clock speedup (the ``latency`` stage, SPEC §8).

The offline stages *simulate* exits: every token ran all T loops, and a rule's exit depth only picks
which loop's readout counts. Here the loops really stop. Each loop runs only on the sequences that
still have an undecided scored token; exited sequences leave the batch (compaction: ``index_select``
of the active rows every loop), so at batch size B the work shrinks as sequences finish. Huginn's
docs warn that batched early exit without compaction flatters itself (the batch runs to the
slowest row); [AD] measured 1.36× at 1.26 of 6 loops.

Exit semantics (the project's convention, chosen so that the real run reproduces the offline
evaluation *exactly*): the offline evaluation scores token i at its exit loop d_i on a trajectory
where every position of its sequence ran every loop. Under attention, the state of position i at
loop t depends on the loop t − 1 states of the positions it attends to, so a position that stopped
early would change its neighbours' later states (and the offline numbers would no longer hold).
Hence:

- every scored token is read out at its own exit loop d_i (its prediction is frozen there);
- **causal** models: position j keeps looping while any scored position i ≥ j is undecided — the
  active part of a sequence at loop t is the prefix up to its last undecided scored position
  (positions after it cannot influence positions before it), so each loop runs on
  ``h[active rows, :longest active prefix]``; a sequence leaves the batch once all its scored
  tokens exited;
- **bidirectional** models: a sequence runs whole until all its scored tokens exited.

Every state the run computes is then exactly the full-depth state of that (position, loop), so the
real run's predictions and accuracy equal the offline chosen point's (the stage checks it token by
token). The price of exactness is that a position runs ``max_{i ≥ j} d_i`` loops instead of its own
d_j; the stage reports that ceiling (``ideal_speedup_work``) beside the token-level ideal of SPEC §8
(``ideal_speedup`` = T / mean exit depth).

Every rule of the registry (:mod:`looptrace.rules.registry`: the built-ins and a user's own rules named in
``latency.rules``) runs online, on signals that reproduce the offline ones bit for bit
(:mod:`looptrace.online.live_signals`): logit signals by the dump's ``LoopStats`` on the readout, step signals by
the geometry stage's ``StepSignals`` on the state rounded to the store's ``hidden`` dtype (the model itself
keeps computing in float32 — only the rule sees the rounding, as the calibrated rule did).
"""

from __future__ import annotations

import functools
import json
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import numpy as np
import polars as pl
import torch
from tqdm.auto import tqdm

from looptrace.config import ConfigError, InputError, MissingInputError
from looptrace.io.artifacts import atomic_dir, read_parquet
from looptrace.io.artifacts import jsonable as _jsonable
from looptrace.io.parallel import map_models
from looptrace.io.parquet import write_parquet
from looptrace.io.store.format import check_store_format_at
from looptrace.io.store.identity import check_store_model
from looptrace.io.store.reader import open_store
from looptrace.models.interface import file_sha256
from looptrace.models.looped import LoopedTransformer, load_checkpoint
from looptrace.online.engine import (
    CallableRule,
    OnlineRule,
    RegistryRule,
    early_exit,
    full_work,
    minimal_work,
)
from looptrace.online.live_gate import load_online_gate
from looptrace.rules.registry import ExitRule, get_rule, resolve_rules
from looptrace.tasks import IGNORE, TaskBatch, make_task

#: The refit-gate entry of ``latency.rules`` (the best gate of the gates stage).
GATE = "gate"

#: ``latency.parquet`` columns (one row per model × rule × batch size).
LATENCY_SCHEMA = {
    "model": pl.String, "task": pl.String, "regime": pl.String, "regime_kind": pl.String,
    "rule": pl.String, "kind": pl.String, "source": pl.String, "threshold": pl.Float64,
    "batch_size": pl.Int64, "n_sequences": pl.Int64, "n_tokens": pl.Int64, "n_loops": pl.Int64,
    "mean_exit_depth": pl.Float64, "mean_loops_run": pl.Float64,
    "full_time_s": pl.Float64, "exit_time_s": pl.Float64, "full_time_iqr_s": pl.Float64,
    "exit_time_iqr_s": pl.Float64, "realised_speedup": pl.Float64, "ideal_speedup": pl.Float64,
    "speedup_ratio": pl.Float64, "ideal_speedup_loops": pl.Float64, "ideal_speedup_work": pl.Float64,
    "work_speedup": pl.Float64, "ratio_to_work_ideal": pl.Float64, "accuracy_real": pl.Float64,
    "accuracy_offline": pl.Float64, "accuracy_full_depth": pl.Float64, "exit_mismatches": pl.Int64,
    "correct_mismatches": pl.Int64, "exact": pl.Boolean, "repeats": pl.Int64, "warmup": pl.Int64,
}


@dataclass(frozen=True)
class LatencyConfig:
    """``latency`` section of ``params.yaml``.

    Attributes:
        rules: rules run online, named as in ``readouts.rules`` (built-ins except ``oracle``, user rules
            ``package.module:function`` or entry-point names): each at the threshold of its chosen point in
            ``artifacts/readouts/<model>/chosen.parquet``; rules on the native gate (``q_exit``) only for
            models with one; ``gate`` = the best refit gate of ``artifacts/gates/<model>/`` (lowest val
            depth among chosen points within δ), when its fitted gate was saved.
        batch_sizes: batch sizes to time (1 = one sequence at a time; larger = compacted batches).
        bs1_sequences: test sequences run at batch size 1 (the first ones; every sequence is its own
            batch, so this bounds the stage's time).
        sequences: test sequences run at batch sizes > 1 (the first ones; null = the whole split).
        warmup: extra untimed passes before the timed ones; the checking pass (one untimed run of
            every rule, compared with the offline evaluation) already warms up allocator and caches.
        repeats: timed passes; the median wall time is reported (full depth and every rule are
            interleaved within each repeat, so machine-load drift hits them alike).
        require_exact: fail (one line) when the real run's exits or correctness differ from the
            offline evaluation's on any token; otherwise the mismatches are only recorded.
        workers: models timed side by side, one process each on its own core (null = as many as the other
            per-model stages run: one per core at ``base.analysis_threads`` threads; 1 = one model at a time, so a
            timing shares the machine with nothing). Full depth and the rules are timed alike either way, so the
            realised speedups agree (docs/latency.md "Timing models side by side"); the absolute times carry
            whatever the other core's work costs this one.
    """

    rules: tuple[str, ...] = ("top1", "entropy", "kl_prev", "accel_two_hit", "q_exit", "gate")
    batch_sizes: tuple[int, ...] = (1, 256)
    bs1_sequences: int = 32
    sequences: int | None = None
    warmup: int = 0
    repeats: int = 5
    require_exact: bool = True
    workers: int | None = None

    def __post_init__(self) -> None:
        resolve_rules([r for r in self.rules if r != GATE], "latency.rules", online=True)
        if self.workers is not None and self.workers < 1:
            raise ConfigError(f"latency.workers must be ≥ 1 or null (one per core), got {self.workers}")
        if not self.batch_sizes or min(self.batch_sizes) < 1:
            raise ConfigError(f"latency.batch_sizes must be a non-empty list of sizes ≥ 1, got {list(self.batch_sizes)}")
        if self.bs1_sequences < 1:
            raise ConfigError(f"latency.bs1_sequences must be ≥ 1, got {self.bs1_sequences}")
        if self.sequences is not None and self.sequences < 1:
            raise ConfigError(f"latency.sequences must be ≥ 1 or null, got {self.sequences}")
        if self.warmup < 0 or self.repeats < 1:
            raise ConfigError(f"latency.warmup must be ≥ 0 and latency.repeats ≥ 1, got {self.warmup}, {self.repeats}")



# ----------------------------------------------------------------------------------------------
# One model: data, chosen points, exactness check, timing
# ----------------------------------------------------------------------------------------------


def load_test_data(store_path: Path | str, model: str | None = None, checkpoint: Path | str | None = None
                   ) -> tuple[TaskBatch, np.ndarray, str]:
    """Rebuild the exact test sequences of a dump store and check them against the store.

    ``model`` / ``checkpoint``, when given: the store must be that model's dump of that checkpoint
    (:func:`looptrace.io.store.identity.check_store_model`), checked on the store opened here.

    The store records its task (``task`` attrs), ``data_seed`` and ``n_sequences``; the sequences are
    regenerated with ``task.dataset`` (deterministic) and verified against the store's ``token_id``,
    ``sequence``, ``position`` and ``target`` arrays.

    Returns:
        (the test sequences as a :class:`~looptrace.tasks.TaskBatch` [batch, seq]; ``token`` [batch, seq]
        int64, the store row of each scored position (−1 unscored), rows ordered by (sequence, position) as
        the dump writes them; the store's hidden dtype).

    Raises:
        FileNotFoundError: the store is missing.
        ValueError: attributes missing, or the regenerated data do not match the store.
    """

    store_path = Path(store_path)
    if not store_path.exists():
        raise MissingInputError(f"{store_path} not found; run the dump stage first (dvc repro dump)")
    check_store_format_at(store_path)
    st = open_store(store_path)
    if model is not None:
        check_store_model(st, model, None if checkpoint is None else file_sha256(checkpoint),
                          None if checkpoint is None else str(checkpoint))
    a = st.attrs
    spec = a.get("task")
    if not spec or a.get("data_seed") is None or a.get("n_sequences") is None:
        raise InputError(f"{store_path}: attributes task/data_seed/n_sequences are missing; re-run the dump stage")
    spec = dict(spec)
    task = make_task(spec.pop("name", "task"), spec)
    data = task.dataset(str(a.get("split", "test")), int(a["n_sequences"]), int(a["data_seed"]))
    scored = data.targets != IGNORE
    b, p = np.nonzero(scored)
    fields = {k: st.read(k) for k in ("token_id", "sequence", "position", "target")}
    ok = (b.size == st.n_tokens and np.array_equal(fields["sequence"], b) and np.array_equal(fields["position"], p)
          and np.array_equal(fields["token_id"], data.tokens[b, p]) and np.array_equal(fields["target"], data.targets[b, p]))
    if not ok:
        raise InputError(f"{store_path}: the test sequences regenerated from its task and data_seed do not match "
                         f"the store's token_id/sequence/position/target; re-run the dump stage")
    token = np.full(scored.shape, -1, dtype=np.int64)
    token[b, p] = np.arange(b.size)
    dtype = (a.get("dtypes") or {}).get("hidden", "float16")
    batch = TaskBatch(tokens=data.tokens.astype(np.int64), targets=data.targets.astype(np.int64),
                      difficulty=data.difficulty, token_type=data.token_type)
    return batch, token, str(dtype)


@dataclass(frozen=True)
class RuleSpec:
    """One rule to run online: the rule object factory and the offline chosen point it must match.

    Attributes:
        rule: name as in chosen.parquet (``top1``, ``gate:<...>``).
        kind: posthoc | native | gate.
        source: readouts | gates.
        threshold: chosen threshold.
        factory: () -> a fresh :class:`OnlineRule`.
        offline_exit: [token] offline exit depth per store row (chosen_exits).
        offline_correct: [token] bool.
    """

    rule: str
    kind: str
    source: str
    threshold: float
    factory: Callable[[], OnlineRule]
    offline_exit: np.ndarray
    offline_correct: np.ndarray


def _chosen_exits(path: Path, rule: str, n_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """[token] exit depth and correctness of ``rule`` from a chosen_exits.parquet (by store row)."""
    ex = read_parquet(path).filter(pl.col("rule") == rule).sort("token")
    tok = ex["token"].to_numpy()
    if tok.size != n_tokens or not np.array_equal(tok, np.arange(n_tokens)):
        raise InputError(f"{path}: rule '{rule}' does not cover the {n_tokens} test tokens of the store; "
                         f"re-run the stage that wrote it")
    return ex["exit_depth"].to_numpy().astype(np.int64), ex["correct"].to_numpy().astype(bool)


def readout_rule_specs(readouts_dir: Path | str, rules: Sequence[str], n_tokens: int, has_gate: bool,
                       hidden_dtype: str) -> tuple[list[RuleSpec], dict[str, str]]:
    """The readouts rules to run (registry names; ``gate`` is skipped here), at their chosen thresholds, with
    the offline exits to match.

    Returns:
        (specs, skipped) where skipped maps rule -> reason (e.g. q_exit on a model without a gate).
    """
    readouts_dir = Path(readouts_dir)
    cpath, epath = readouts_dir / "chosen.parquet", readouts_dir / "chosen_exits.parquet"
    for p in (cpath, epath):
        if not p.is_file():
            raise MissingInputError(f"{p} not found; run the readouts stage first (dvc repro readouts)")
    chosen = read_parquet(cpath)
    specs, skipped = [], {}
    for name in rules:
        if name == GATE:
            continue
        exit_rule = get_rule(name)
        rule = exit_rule.name
        if exit_rule.needs_gate and not has_gate:
            skipped[rule] = "model has no native halting gate"
            continue
        row = chosen.filter(pl.col("rule") == rule)
        if row.height == 0:
            skipped[rule] = f"no chosen point for '{rule}' in {cpath} (not in readouts.rules?)"
            continue
        r = row.row(0, named=True)
        thr = float(r["threshold"])
        ex, corr = _chosen_exits(epath, rule, n_tokens)

        def factory(r: ExitRule = exit_rule, thr: float = thr) -> OnlineRule:
            return RegistryRule(r, thr, hidden_dtype)

        specs.append(RuleSpec(rule=rule, kind=str(r.get("kind") or "posthoc"), source="readouts", threshold=thr,
                              factory=factory, offline_exit=ex, offline_correct=corr))
    return specs, skipped


def best_gate_rule(gates_dir: Path | str) -> dict | None:
    """The best refit offline gate of a model: lowest val depth among chosen points within δ on val
    (ties: higher val accuracy, then name) — picked on val only, like every chosen point.

    Returns:
        The chosen.parquet row as a dict, or None when the model has no gates outputs.
    """
    cpath = Path(gates_dir) / "chosen.parquet"
    if not cpath.is_file():
        return None
    ch = read_parquet(cpath)
    if ch.height == 0:
        return None
    if "within_delta" in ch.columns and ch["within_delta"].any():
        ch = ch.filter(pl.col("within_delta"))
    return ch.sort(["val_depth", "val_accuracy", "rule"], descending=[False, True, False]).row(0, named=True)


def load_gate_rule(gates_dir: Path | str, n_tokens: int, hidden_dtype: str) -> tuple[RuleSpec | None, str | None]:
    """The best refit gate as an online rule, or (None, reason) when it cannot run online.

    Needs ``pipeline.gates.load_online_gate(gates_dir, rule)`` returning an object with
    ``stop_prob(t, h, z, state) -> [batch, seq]`` (probability of stopping at loop t, float64),
    ``needs_logits`` and ``reset(model, h0) -> state dict`` (compactable tensors with leading
    [batch, seq] dims). The gates stage owns the fitted gate's format and features.
    """
    row = best_gate_rule(gates_dir)
    if row is None:
        return None, f"no gates outputs in {gates_dir} (run the gates stage)"
    rule = str(row["rule"])
    try:
        gate = load_online_gate(gates_dir, rule)
    except (FileNotFoundError, ValueError, KeyError) as exc:
        return None, f"best gate '{rule}': {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
    thr = float(row["threshold"])
    ex, corr = _chosen_exits(Path(gates_dir) / "chosen_exits.parquet", rule, n_tokens)

    def factory(gate=gate, thr=thr, rule=rule):
        return CallableRule(rule, thr, gate.stop_prob, signals=gate.signals, hidden_dtype=gate.hidden_dtype,
                            state=gate)

    return RuleSpec(rule=rule, kind="gate", source="gates", threshold=thr, factory=factory, offline_exit=ex,
                    offline_correct=corr), None


def _batches(n: int, batch_size: int) -> list[slice]:
    return [slice(lo, min(n, lo + batch_size)) for lo in range(0, n, batch_size)]


def run_split(model: LoopedTransformer, tokens: torch.Tensor, scored: torch.Tensor, batch_size: int,
              factory: Callable[[], OnlineRule] | None) -> tuple[np.ndarray, np.ndarray, list[int], int]:
    """One real pass over sequences in batches of ``batch_size`` (the timed unit).

    Returns:
        (exit_depth [batch, seq], pred [batch, seq], loops run per batch, total work in position-loops).
    """
    eds, preds, loops, work = [], [], [], 0
    for sl in _batches(tokens.shape[0], batch_size):
        r = early_exit(model, tokens[sl], scored[sl], factory() if factory is not None else None)
        eds.append(r.exit_depth)
        preds.append(r.pred)
        loops.append(r.loops_run)
        work += r.work
    return torch.cat(eds).cpu().numpy(), torch.cat(preds).cpu().numpy(), loops, work


def _median_iqr(x: list[float]) -> tuple[float, float]:
    q = np.quantile(np.asarray(x), [0.25, 0.75])
    return float(statistics.median(x)), float(q[1] - q[0])


def latency_model(model: LoopedTransformer, data: TaskBatch, token: np.ndarray, specs: Sequence[RuleSpec],
                  cfg: LatencyConfig, meta: dict, device: str = "cpu", progress: bool = True) -> list[dict]:
    """Time full depth and every rule's real early exit at each batch size; check exactness.

    For each batch size, one untimed checking pass per rule (and full depth) compares the real run's
    exit depth and correctness with the offline chosen point token by token — it is also the warm-up;
    then ``warmup`` + ``repeats`` passes time full depth and every rule, interleaved within each
    repeat (median reported).

    Args:
        model: the looped transformer (eval mode, on ``device``).
        data: the test sequences, ``token`` the store row of each scored position (:func:`load_test_data`).
        specs: the rules (:func:`readout_rule_specs`, :func:`load_gate_rule`).
        cfg: the ``latency`` section.
        meta: model, task, regime, regime_kind (copied into every row).
        device: torch device.
        progress: progress bar.

    Returns:
        ``latency.parquet`` rows (``LATENCY_SCHEMA``).

    Raises:
        ValueError: ``cfg.require_exact`` and some token's real exit or correctness differs.
    """

    T = model.cfg.n_loops
    causal = model.cfg.causal

    scored_all = data.targets != IGNORE
    tok_all = torch.from_numpy(data.tokens).to(device)
    sc_all = torch.from_numpy(scored_all).to(device)
    rows = []
    bar = tqdm(total=len(cfg.batch_sizes) * (cfg.warmup + cfg.repeats + 1), desc=f"latency {meta.get('model')}",
               disable=None if progress else True, leave=False)
    for bs in cfg.batch_sizes:
        n_seq = min(cfg.bs1_sequences if bs == 1 else (cfg.sequences or data.tokens.shape[0]), data.tokens.shape[0])
        tok, sc = tok_all[:n_seq], sc_all[:n_seq]
        scored = scored_all[:n_seq]
        ids = token[:n_seq][scored]  # store rows of the run's tokens, (sequence, position) order
        target = data.targets[:n_seq][scored]
        # Checking pass (untimed): the real run against the offline evaluation.
        _, full_pred, full_loops, full_w = run_split(model, tok, sc, bs, None)
        full_acc = float((full_pred[scored] == target).mean())
        checks = {}
        for sp in specs:
            ed, pred, loops, w = run_split(model, tok, sc, bs, sp.factory)
            e, correct = ed[scored], pred[scored] == target
            ex_mis = int((e != sp.offline_exit[ids]).sum())
            co_mis = int((correct != sp.offline_correct[ids]).sum())
            if cfg.require_exact and (ex_mis or co_mis):
                raise InputError(f"latency {meta.get('model')} rule '{sp.rule}' batch {bs}: the real run differs from "
                                 f"the offline chosen point on {ex_mis} exit depths / {co_mis} predictions of "
                                 f"{e.size} tokens; set latency.require_exact: false to record it instead")
            checks[sp.rule] = dict(exit_depth=e, correct=correct, loops=loops, work=w, ex_mis=ex_mis, co_mis=co_mis,
                                   min_work=minimal_work(ed, scored, causal))
        bar.update(1)
        # Timed passes: full depth and every rule interleaved within each repeat.
        times: dict[str | None, list[float]] = {None: [], **{sp.rule: [] for sp in specs}}
        runs = [(None, None)] + [(sp.rule, sp.factory) for sp in specs]
        for rep in range(cfg.warmup + cfg.repeats):
            for key, factory in runs:
                t0 = time.perf_counter()
                run_split(model, tok, sc, bs, factory)
                dt = time.perf_counter() - t0
                if rep >= cfg.warmup:
                    times[key].append(dt)
            bar.update(1)
        t_full, iqr_full = _median_iqr(times[None])
        fw = full_work(scored, T, causal)
        for sp in specs:
            c = checks[sp.rule]
            t_exit, iqr_exit = _median_iqr(times[sp.rule])
            mean_d = float(c["exit_depth"].mean())
            # Median of the per-repeat ratios: full and exit ran back to back in each repeat, so the
            # ratio cancels slow load drift on a shared machine.
            realised = float(statistics.median(f / e for f, e in zip(times[None], times[sp.rule], strict=True)))
            ideal = T / mean_d
            rows.append({
                **{k: meta.get(k) for k in ("model", "task", "regime", "regime_kind")},
                "rule": sp.rule, "kind": sp.kind, "source": sp.source, "threshold": sp.threshold,
                "batch_size": int(bs), "n_sequences": int(n_seq), "n_tokens": int(c["exit_depth"].size),
                "n_loops": int(T), "mean_exit_depth": mean_d, "mean_loops_run": float(np.mean(c["loops"])),
                "full_time_s": t_full, "exit_time_s": t_exit, "full_time_iqr_s": iqr_full, "exit_time_iqr_s": iqr_exit,
                "realised_speedup": realised, "ideal_speedup": ideal, "speedup_ratio": realised / ideal,
                "ideal_speedup_loops": float(np.sum(full_loops) / np.sum(c["loops"])),
                "ideal_speedup_work": fw / c["min_work"], "work_speedup": full_w / c["work"],
                "ratio_to_work_ideal": realised / (fw / c["min_work"]),
                "accuracy_real": float(c["correct"].mean()),
                "accuracy_offline": float(sp.offline_correct[ids].mean()),
                "accuracy_full_depth": full_acc, "exit_mismatches": c["ex_mis"], "correct_mismatches": c["co_mis"],
                "exact": c["ex_mis"] == 0 and c["co_mis"] == 0, "repeats": cfg.repeats, "warmup": cfg.warmup,
            })
    bar.close()
    return rows


def latency_one(name: str, train_root: Path | str, dump_root: Path | str, readouts_root: Path | str,
                gates_root: Path | str, cfg: LatencyConfig, device: str = "cpu", meta: dict | None = None,
                progress: bool = True, threads: int | None = None) -> tuple[list[dict], dict, dict]:
    """One model of the ``latency`` stage: checkpoint + test store + chosen points -> (rows, skipped rules with
    reasons, model info). A module-level function of the model name and paths, so that a pool's worker process
    runs it (:func:`latency_models`); ``threads``: torch threads of this process (None = leave them)."""
    if threads is not None:
        torch.set_num_threads(threads)
    ckpt = Path(train_root) / name / "model.pt"
    model, _ = load_checkpoint(ckpt, name=name)
    model = model.to(device).eval()
    data, token, hidden_dtype = load_test_data(Path(dump_root) / name / "test.zarr", name, ckpt)
    n_tokens = int((token >= 0).sum())
    specs, skip = readout_rule_specs(Path(readouts_root) / name, cfg.rules, n_tokens, model.gate is not None,
                                     hidden_dtype)
    if GATE in cfg.rules:
        spec, reason = load_gate_rule(Path(gates_root) / name, n_tokens, hidden_dtype)
        if spec is not None:
            specs.append(spec)
        else:
            assert reason is not None  # no spec comes with its reason
            skip[GATE] = reason
    rows = latency_model(model, data, token, specs, cfg, meta if meta is not None else {"model": name}, device,
                         progress)
    info = {"causal": bool(model.cfg.causal), "n_loops": model.cfg.n_loops, "n_tokens": n_tokens,
            "hidden_dtype": hidden_dtype}
    return rows, skip, info


def latency_models(models: Sequence[str], train_root: Path | str, dump_root: Path | str, readouts_root: Path | str,
                   gates_root: Path | str, cfg: LatencyConfig, device: str = "cpu", regime_meta: Callable | None = None,
                   progress: bool = True, workers: int = 1, threads: int | None = None) -> tuple[pl.DataFrame, dict]:
    """The ``latency`` stage over models: checkpoint + test store + chosen points -> rows and metrics.

    Args:
        models: model names.
        train_root, dump_root, readouts_root, gates_root: artifact roots (SPEC §10).
        cfg: the ``latency`` section.
        device: torch device.
        regime_meta: model name -> dict(model, task, regime, regime_kind) (``readouts.resolve_model``).
        progress: progress bars.
        workers: models timed side by side, each in its own process (:func:`looptrace.io.parallel.map_models`;
            1 = one after another in this process). Every row but the wall times is the same bytes either way.
        threads: torch threads of each model's process (None = this process's).

    Returns:
        (latency frame, metrics dict with per-model headline numbers, skipped rules with reasons and the processes
        the models were timed in, ``workers``).
    """
    metas = {name: regime_meta(name) if regime_meta is not None else {"model": name} for name in models}
    one = functools.partial(_latency_task, roots=(train_root, dump_root, readouts_root, gates_root), cfg=cfg,
                            device=device, metas=metas, progress=progress, threads=threads)
    workers = max(1, min(int(workers), len(models)))
    results = map_models(one, list(models), workers, "latency")
    all_rows, skipped, info = [], {}, {}
    for name, (rows, skip, model_info) in zip(models, results, strict=True):
        all_rows += rows
        skipped[name] = skip
        info[name] = model_info
    df = pl.DataFrame(all_rows, schema=LATENCY_SCHEMA)
    return df, {**latency_metrics(df, skipped, info), "workers": workers}


def _latency_task(name: str, roots: tuple, cfg: LatencyConfig, device: str, metas: dict, progress: bool,
                  threads: int | None) -> tuple[list[dict], dict, dict]:
    train_root, dump_root, readouts_root, gates_root = roots
    return latency_one(name, train_root, dump_root, readouts_root, gates_root, cfg, device, metas[name], progress,
                       threads)


def latency_metrics(df: pl.DataFrame, skipped: dict, info: dict) -> dict:
    """``metrics.json`` (``dvc metrics show``): whether every real run reproduced the offline evaluation,
    the realised/ideal medians per batch size and, per model and batch size, the fastest rule.
    Every row's numbers are in latency.parquet."""
    models: dict = {name: {**info.get(name, {})} for name in info}
    for (name, bs), d in df.group_by(["model", "batch_size"], maintain_order=True):
        r = d.sort("realised_speedup", descending=True).row(0, named=True)
        models.setdefault(name, {})[f"fastest_bs{bs}"] = {
            k: r[k] for k in ("rule", "mean_exit_depth", "realised_speedup", "ideal_speedup", "speedup_ratio",
                              "ideal_speedup_work")}
        models[name][f"exact_bs{bs}"] = bool(d["exact"].all())
    for name, sk in skipped.items():
        if sk:
            models.setdefault(name, {})["skipped"] = sk
    ratios = {}
    for bs in sorted(set(df["batch_size"].to_list())) if df.height else []:
        sub = df.filter(pl.col("batch_size") == bs)
        ratios[f"bs{bs}"] = {"median_speedup_ratio": float(cast(float, sub["speedup_ratio"].median())),
                             "min_speedup_ratio": float(cast(float, sub["speedup_ratio"].min())),
                             "max_speedup_ratio": float(cast(float, sub["speedup_ratio"].max())),
                             "runs_ratio_ge_0p8": int((sub["speedup_ratio"] >= 0.8).sum()),
                             "median_ratio_to_work_ideal": float(cast(float, sub["ratio_to_work_ideal"].median()))}
    return {"all_exact": bool(df["exact"].all()) if df.height else True, "n_runs": df.height, "summary": ratios,
            "models": models}


def write_latency(out_dir: Path | str, df: pl.DataFrame, metrics: dict) -> None:
    """Write ``latency.parquet`` and ``metrics.json`` atomically (temp dir + os.replace)."""

    with atomic_dir(out_dir) as tmp:
        write_parquet(df, tmp / "latency.parquet")  # page checksums
        (tmp / "metrics.json").write_text(json.dumps(_jsonable(metrics), indent=2) + "\n")
