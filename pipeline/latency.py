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

Online signals reproduce the offline ones bit for bit where the offline pipeline allows it: logit
statistics are computed in float32 from the readout exactly as ``pipeline.stats.LoopStats`` does;
geometry signals (acceleration) read the state rounded to the store's ``hidden`` dtype and are
computed in float64 as ``pipeline.geometry.step_metrics`` does (the model itself keeps computing in
float32 — only the rule sees the rounding, as the calibrated rule did).
"""

from __future__ import annotations

import json
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import polars as pl
import torch

from .model import LoopedTransformer
from .readouts import THRESHOLD_RULES
from .stats import kl_div

#: Rules the stage can run online: readouts' chosen points and the gates' best refit gate (``gate``).
ONLINE_RULES = ("top1", "entropy", "margin", "kl_prev", "kl_prev_rev", "logit_change", "accel_two_hit",
                "q_exit", "gate")

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
        rules: rules run online (subset of ``ONLINE_RULES``): each at the threshold of its chosen
            point in ``artifacts/readouts/<model>/chosen.parquet``; ``q_exit`` only for models with a
            native gate; ``gate`` = the best refit gate of ``artifacts/gates/<model>/`` (lowest val
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
        threads: torch intra-op threads while timing (null = ``base.threads``). One thread by default:
            on a shared machine, a multi-threaded op waits for its slowest thread, which makes small
            per-loop kernels slow and their timings erratic.
    """

    rules: tuple[str, ...] = ("top1", "entropy", "kl_prev", "accel_two_hit", "q_exit", "gate")
    batch_sizes: tuple[int, ...] = (1, 256)
    bs1_sequences: int = 32
    sequences: int | None = None
    warmup: int = 0
    repeats: int = 5
    require_exact: bool = True
    threads: int | None = 1

    def __post_init__(self) -> None:
        from .config import ConfigError

        unknown = [r for r in self.rules if r not in ONLINE_RULES]
        if unknown:
            raise ConfigError(f"latency.rules: unknown rule '{unknown[0]}'; allowed: {', '.join(ONLINE_RULES)}")
        if not self.batch_sizes or min(self.batch_sizes) < 1:
            raise ConfigError(f"latency.batch_sizes must be a non-empty list of sizes ≥ 1, got {list(self.batch_sizes)}")
        if self.bs1_sequences < 1:
            raise ConfigError(f"latency.bs1_sequences must be ≥ 1, got {self.bs1_sequences}")
        if self.sequences is not None and self.sequences < 1:
            raise ConfigError(f"latency.sequences must be ≥ 1 or null, got {self.sequences}")
        if self.threads is not None and self.threads < 1:
            raise ConfigError(f"latency.threads must be ≥ 1 or null, got {self.threads}")
        if self.warmup < 0 or self.repeats < 1:
            raise ConfigError(f"latency.warmup must be ≥ 0 and latency.repeats ≥ 1, got {self.warmup}, {self.repeats}")


# ----------------------------------------------------------------------------------------------
# Online rules: the per-loop signal of SPEC §4 computed on the live batch
# ----------------------------------------------------------------------------------------------


class OnlineRule:
    """An exit rule evaluated loop by loop on the active batch.

    A rule sees, after loop t, the state h_t [batch, seq, d_model] and the readout z_t
    [batch, seq, vocab] of the active rows/prefix, keeps whatever history its signal needs as
    tensors with leading [batch, seq] dims (so :meth:`compact` can follow the batch), and returns
    which positions fire. Semantics are those of ``pipeline.readouts.exit_depths``: fire at the first
    t ≥ ``min_loop`` where ``signal op threshold`` holds (and held at t − 1 for two-hit rules); NaN
    never fires; the engine forces the exit at T.

    Args:
        name: rule name (``top1``, ``entropy``, ...).
        threshold: the chosen point's threshold (float64 comparison, as offline).
        op: ``"ge"`` or ``"le"``.
        min_loop: first loop (1-based) the rule may fire at.
        two_hit: condition at t and t − 1 ([TS] acceleration exit).
    """

    #: Whether the rule reads the readout z_t (otherwise the engine skips it until the exit).
    needs_logits = True

    def __init__(self, name: str, threshold: float, op: str, min_loop: int = 1, two_hit: bool = False):
        if op not in ("le", "ge"):
            raise ValueError(f"rule {name}: op must be 'le' or 'ge', got {op!r}")
        self.name, self.threshold, self.op = name, float(threshold), op
        self.min_loop, self.two_hit = int(min_loop), bool(two_hit)
        self._thr32 = float32_threshold(self.threshold, op)
        self.state: dict[str, torch.Tensor] = {}

    def reset(self, model: LoopedTransformer, h0: torch.Tensor) -> None:
        """Start a new batch (h0: [batch, seq, d_model])."""
        self.state = {}

    def signal(self, t: int, h: torch.Tensor, z: torch.Tensor | None, model: LoopedTransformer) -> torch.Tensor:
        """Signal after loop t (1-based): [batch, seq] float32 (values the store holds as float32) or
        float64, NaN where undefined."""
        raise NotImplementedError

    def fires(self, t: int, h: torch.Tensor, z: torch.Tensor | None, model: LoopedTransformer) -> torch.Tensor:
        """[batch, seq] bool: the rule's condition at loop t (before the engine's undecided mask)."""
        s = self.signal(t, h, z, model)
        # A float32 signal is compared with the float32 threshold that gives the same answer as the
        # offline float64 comparison (one op fewer per loop, identical result).
        thr = self._thr32 if s.dtype == torch.float32 else self.threshold
        hit = (s >= thr) if self.op == "ge" else (s <= thr)  # NaN compares False
        if self.two_hit:
            prev = self.state.get("hit_prev")
            self.state["hit_prev"] = hit
            hit = hit & prev if prev is not None else torch.zeros_like(hit)
        if t < self.min_loop:
            hit = torch.zeros_like(hit)
        return hit

    def compact(self, rows: torch.Tensor | None, seq: int) -> None:
        """Follow the engine's compaction: keep batch rows ``rows`` (None = all) and positions < ``seq``."""
        for k, v in self.state.items():
            if rows is not None:
                v = v.index_select(0, rows)
            self.state[k] = v[:, :seq]


def float32_threshold(threshold: float, op: str) -> float:
    """The float32 threshold τ32 with ``s op τ32`` ⇔ ``float64(s) op threshold`` for every float32 s.

    ``ge``: the smallest float32 ≥ threshold; ``le``: the largest float32 ≤ threshold.
    """
    thr = float(threshold)
    if not math.isfinite(thr):
        return thr
    t32 = np.float32(thr)
    if op == "ge" and float(t32) < thr:
        t32 = np.nextafter(t32, np.float32(np.inf))
    elif op == "le" and float(t32) > thr:
        t32 = np.nextafter(t32, np.float32(-np.inf))
    return float(t32)


def _logp(z: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(z.float(), dim=-1)


class MaxProbRule(OnlineRule):
    """top1 (CALM softmax_max, [AD]): C_t = max p_t, as ``LoopStats`` (float32)."""

    def signal(self, t, h, z, model):
        return _logp(z).max(dim=-1).values.exp()


class EntropyRule(OnlineRule):
    """entropy ([AD]): H_t = −Σ p log p, terms with p = 0 exactly 0 (as ``LoopStats``)."""

    def signal(self, t, h, z, model):
        logp = _logp(z)
        p = logp.exp()
        return -torch.where(p > 0, p * logp, torch.zeros((), dtype=logp.dtype, device=logp.device)).sum(-1)


class MarginRule(OnlineRule):
    """margin ([AD]): z_(1) − z_(2)."""

    def signal(self, t, h, z, model):
        zf = z.float()
        if zf.shape[-1] < 2:
            return torch.full(zf.shape[:-1], math.nan, dtype=torch.float32, device=zf.device)
        top2 = zf.topk(2, dim=-1).values
        return top2[..., 0] - top2[..., 1]


class KLPrevRule(OnlineRule):
    """kl_prev = KL(p_t ‖ p_{t−1}) ([AD]) or kl_prev_rev = KL(p_{t−1} ‖ p_t) (Huginn); NaN at t = 1."""

    def __init__(self, *args, reverse: bool = False, **kw):
        super().__init__(*args, **kw)
        self.reverse = reverse

    def signal(self, t, h, z, model):
        logp = _logp(z)
        prev = self.state.get("logp_prev")
        self.state["logp_prev"] = logp
        if prev is None:
            return torch.full(logp.shape[:-1], math.nan, dtype=torch.float32, device=logp.device)
        return kl_div(prev, logp) if self.reverse else kl_div(logp, prev)


class LogitChangeRule(OnlineRule):
    """logit_change = ‖z_t − z_{t−1}‖₂; NaN at t = 1."""

    def signal(self, t, h, z, model):
        zf = z.float()
        prev = self.state.get("z_prev")
        self.state["z_prev"] = zf
        if prev is None:
            return torch.full(zf.shape[:-1], math.nan, dtype=torch.float32, device=zf.device)
        return torch.linalg.vector_norm(zf - prev, dim=-1)


class AccelRule(OnlineRule):
    """accel_two_hit ([TS]): a_t = ‖Δ_t − Δ_{t−1}‖₂ ≤ τ at t and t − 1, t ≥ 3.

    The states are rounded to the store's ``hidden`` dtype and the norms computed in float64 and
    stored as float32, exactly as ``pipeline.geometry.step_metrics`` computed the calibrated signal.

    Args:
        state_dtype: the store's hidden dtype (``float16`` or ``float32``).
    """

    needs_logits = False

    def __init__(self, *args, state_dtype: str = "float16", **kw):
        super().__init__(*args, **kw)
        self.state_dtype = torch.float16 if state_dtype == "float16" else torch.float32

    def _round(self, h: torch.Tensor) -> torch.Tensor:
        return h.to(self.state_dtype).double()

    def reset(self, model, h0):
        self.state = {"h_prev": self._round(h0)}

    def signal(self, t, h, z, model):
        hr = self._round(h)
        d = hr - self.state["h_prev"]
        prev = self.state.get("d_prev")
        self.state["h_prev"], self.state["d_prev"] = hr, d
        if prev is None:
            return torch.full(h.shape[:-1], math.nan, dtype=torch.float32, device=h.device)
        x = d - prev
        return torch.sqrt(torch.einsum("bsd,bsd->bs", x, x)).float()  # float32 as in token_loop.parquet


class QExitRule(OnlineRule):
    """Native Q-exit (Ouro): 1 − Π_{j≤t}(1 − σ(gate_j)) ≥ q, in log space as ``readouts.halting_cdf``."""

    needs_logits = False

    def reset(self, model, h0):
        self.state = {"log_not": torch.zeros(h0.shape[:-1], dtype=torch.float64, device=h0.device)}

    def signal(self, t, h, z, model):
        g = model.gate_logit(h).float().double()  # float32 logits as stored, then float64 as offline
        self.state["log_not"] = self.state["log_not"] - torch.logaddexp(torch.zeros((), dtype=g.dtype), g)
        return -torch.expm1(self.state["log_not"])


class CallableRule(OnlineRule):
    """A rule whose per-position probability is produced by a callable on (h_t, z_t, history).

    Used for refit offline gates: ``stop_prob(t, h, z, state) -> [batch, seq] float64`` (state is the
    rule's compactable history dict), fired when ≥ the threshold (SPEC §4 "offline gate").
    """

    def __init__(self, name: str, threshold: float, stop_prob: Callable, needs_logits: bool = True,
                 reset_fn: Callable | None = None):
        super().__init__(name, threshold, "ge", 1, False)
        self._stop_prob, self.needs_logits, self._reset = stop_prob, needs_logits, reset_fn

    def reset(self, model, h0):
        self.state = self._reset(model, h0) if self._reset is not None else {}

    def signal(self, t, h, z, model):
        return self._stop_prob(t, h, z, self.state)


def make_rule(rule: str, threshold: float, state_dtype: str = "float16") -> OnlineRule:
    """The online version of a readouts rule at ``threshold`` (columns and ops of ``THRESHOLD_RULES``).

    Args:
        rule: a rule of ``ONLINE_RULES`` except ``gate`` (gates come from :func:`load_gate_rule`).
        threshold: the chosen point's threshold.
        state_dtype: the store's hidden dtype (geometry rules read rounded states).
    """
    if rule == "q_exit":
        return QExitRule(rule, threshold, "ge", 1, False)
    if rule not in THRESHOLD_RULES:
        raise ValueError(f"rule '{rule}' cannot run online; allowed: {', '.join(r for r in ONLINE_RULES if r != 'gate')}")
    _, op, min_loop, two_hit = THRESHOLD_RULES[rule]
    cls = {"top1": MaxProbRule, "entropy": EntropyRule, "margin": MarginRule, "kl_prev": KLPrevRule,
           "kl_prev_rev": KLPrevRule, "logit_change": LogitChangeRule, "accel_two_hit": AccelRule}.get(rule)
    if cls is None:
        raise ValueError(f"rule '{rule}' has no online implementation; allowed: "
                         f"{', '.join(r for r in ONLINE_RULES if r != 'gate')}")
    kw: dict = {}
    if rule == "kl_prev_rev":
        kw["reverse"] = True
    if cls is AccelRule:
        kw["state_dtype"] = state_dtype
    return cls(rule, threshold, op, min_loop, two_hit, **kw)


# ----------------------------------------------------------------------------------------------
# The engine: real early exit with compaction
# ----------------------------------------------------------------------------------------------


@dataclass
class ExitRun:
    """What one early-exit run produced for a batch of sequences.

    Attributes:
        exit_depth: [batch, seq] int64, 1-based exit loop of each scored position (0 unscored).
        pred: [batch, seq] int64 prediction (argmax of the readout at the exit loop; −1 unscored).
        loops_run: number of loop steps executed (the batch's depth).
        work: Σ over executed loops of active rows × active positions (position-loops computed).
    """

    exit_depth: torch.Tensor
    pred: torch.Tensor
    loops_run: int
    work: int


@torch.inference_mode()
def early_exit(model: LoopedTransformer, tokens: torch.Tensor, scored: torch.Tensor,
               rule: OnlineRule | None) -> ExitRun:
    """Run the looped model with real early exit and batch compaction (module docstring semantics).

    Args:
        model: the looped transformer (eval mode).
        tokens: [batch, seq] int64 token ids.
        scored: [batch, seq] bool, positions whose prediction is wanted (targets ≠ IGNORE).
        rule: the online exit rule, or None for full depth (all T loops, readout only at T).

    Returns:
        :class:`ExitRun` (tensors on the model's device).
    """
    cfg = model.cfg
    T = cfg.n_loops
    groups = cfg.loop_group
    B, S = tokens.shape
    dev = tokens.device
    exit_depth = torch.zeros((B, S), dtype=torch.int64, device=dev)
    pred = torch.full((B, S), -1, dtype=torch.int64, device=dev)
    undecided = scored.clone()
    if not bool(undecided.any()):
        return ExitRun(exit_depth, pred, 0, 0)
    rows = torch.arange(B, device=dev)
    pos = torch.arange(S, device=dev)
    seq = S
    if cfg.causal:  # positions after the last scored one cannot influence it
        seq = int(torch.where(undecided, pos, -1).max()) + 1
    h0 = model.embed(tokens)  # embedding sees the full sequence (prelude attention), then truncates
    h0, undecided = h0[:, :seq], undecided[:, :seq]
    if rule is not None:  # the rule starts on the batch it was made for, then follows the compaction
        rule.reset(model, h0)
    any_scored = undecided.any(dim=1)
    if not bool(any_scored.all()):  # rows with nothing to predict never run
        keep = any_scored.nonzero().squeeze(1)
        rows, h0, undecided = rows[keep], h0.index_select(0, keep), undecided.index_select(0, keep)
        if rule is not None:
            rule.compact(keep, seq)
    h = h0
    work = 0
    t = 0
    for t in range(1, T + 1):
        h = model.step(h, h0, groups[t - 1])  # [b, seq, D]
        work += h.shape[0] * h.shape[1]
        last = t == T
        if rule is None and not last:
            continue
        z = model.readout(h) if (last or rule.needs_logits) else None  # [b, seq, V]
        fire = undecided if last else (rule.fires(t, h, z, model) & undecided)
        b, s = fire.nonzero(as_tuple=True)
        if b.numel():
            if z is None:
                z = model.readout(h)
            r = rows[b]
            exit_depth[r, s] = t
            pred[r, s] = z[b, s].argmax(dim=-1)
            undecided = undecided & ~fire
        if last:
            break
        # Compaction: drop finished sequences; causal models also drop positions after the last
        # undecided one (every kept state stays the exact full-depth state, see module docstring).
        last_pos = torch.where(undecided, pos[:seq], -1).amax(dim=1).tolist()  # [b], −1 = finished
        kept = [i for i, v in enumerate(last_pos) if v >= 0]
        if not kept:
            break
        keep = None
        if len(kept) < len(last_pos):
            keep = torch.tensor(kept, dtype=torch.int64, device=dev)
            rows = rows[keep]
            h, h0, undecided = h.index_select(0, keep), h0.index_select(0, keep), undecided.index_select(0, keep)
        new_seq = max(last_pos) + 1 if cfg.causal else seq
        if new_seq < seq:
            h, h0, undecided = h[:, :new_seq], h0[:, :new_seq], undecided[:, :new_seq]
        if rule is not None and (keep is not None or new_seq < seq):
            rule.compact(keep, new_seq)
        seq = new_seq
    return ExitRun(exit_depth, pred, t, work)


def minimal_work(exit_depth: np.ndarray, scored: np.ndarray, causal: bool) -> int:
    """Position-loops an *exact* early exit must compute for given per-token exit depths.

    Causal: position j runs max_{i ≥ j, i scored} d_i loops (0 after the last scored position);
    bidirectional: every position of a sequence runs max_i d_i loops (module docstring).

    Args:
        exit_depth: [batch, seq] int, 1-based exit loop of scored positions.
        scored: [batch, seq] bool.
        causal: attention mask of the model.

    Returns:
        The total number of (position, loop) states computed.
    """
    d = np.where(scored, exit_depth, 0).astype(np.int64)
    if causal:
        suffix = np.maximum.accumulate(d[:, ::-1], axis=1)[:, ::-1]  # max_{i ≥ j} d_i
        return int(suffix.sum())
    return int((d.max(axis=1) * d.shape[1]).sum())


def full_work(scored: np.ndarray, n_loops: int, causal: bool) -> int:
    """Position-loops of the full-depth run (T loops over every position up to the last scored one)."""
    s = np.asarray(scored, dtype=bool)
    if causal:
        last = np.where(s.any(axis=1), s.shape[1] - np.argmax(s[:, ::-1], axis=1), 0)
        return int(last.sum() * n_loops)
    return int(s.any(axis=1).sum() * s.shape[1] * n_loops)


# ----------------------------------------------------------------------------------------------
# One model: data, chosen points, exactness check, timing
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TestData:
    """The model's test split, rebuilt from the checkpoint's task and the store's data seed.

    Attributes:
        tokens: [batch, seq] int64 token ids.
        targets: [batch, seq] int64 (IGNORE where unscored).
        scored: [batch, seq] bool.
        token: [batch, seq] int64 store row id of each scored position (−1 unscored), rows ordered by
            (sequence, position) as the dump writes them.
        hidden_dtype: the store's hidden dtype.
    """

    tokens: np.ndarray
    targets: np.ndarray
    scored: np.ndarray
    token: np.ndarray
    hidden_dtype: str


def load_test_data(store_path: Path | str) -> TestData:
    """Rebuild the exact test sequences of a dump store and check them against the store.

    The store records its task (``task`` attrs), ``data_seed`` and ``n_sequences``; the sequences are
    regenerated with ``task.dataset`` (deterministic) and verified against the store's ``token_id``,
    ``sequence``, ``position`` and ``target`` arrays.

    Raises:
        FileNotFoundError: the store is missing.
        ValueError: attributes missing, or the regenerated data do not match the store.
    """
    from .store import open_store
    from .tasks import IGNORE, make_task

    store_path = Path(store_path)
    if not store_path.exists():
        raise FileNotFoundError(f"{store_path} not found; run the dump stage first (dvc repro dump)")
    st = open_store(store_path)
    a = st.attrs
    spec = a.get("task")
    if not spec or a.get("data_seed") is None or a.get("n_sequences") is None:
        raise ValueError(f"{store_path}: attributes task/data_seed/n_sequences are missing; re-run the dump stage")
    spec = dict(spec)
    task = make_task(spec.pop("name", "task"), spec)
    data = task.dataset(str(a.get("split", "test")), int(a["n_sequences"]), int(a["data_seed"]))
    scored = data.targets != IGNORE
    b, p = np.nonzero(scored)
    fields = {k: st.read(k) for k in ("token_id", "sequence", "position", "target")}
    ok = (b.size == st.n_tokens and np.array_equal(fields["sequence"], b) and np.array_equal(fields["position"], p)
          and np.array_equal(fields["token_id"], data.tokens[b, p]) and np.array_equal(fields["target"], data.targets[b, p]))
    if not ok:
        raise ValueError(f"{store_path}: the test sequences regenerated from its task and data_seed do not match "
                         f"the store's token_id/sequence/position/target; re-run the dump stage")
    token = np.full(scored.shape, -1, dtype=np.int64)
    token[b, p] = np.arange(b.size)
    dtype = (a.get("dtypes") or {}).get("hidden", "float16")
    return TestData(tokens=data.tokens.astype(np.int64), targets=data.targets.astype(np.int64), scored=scored,
                    token=token, hidden_dtype=str(dtype))


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
    ex = pl.read_parquet(path).filter(pl.col("rule") == rule).sort("token")
    tok = ex["token"].to_numpy()
    if tok.size != n_tokens or not np.array_equal(tok, np.arange(n_tokens)):
        raise ValueError(f"{path}: rule '{rule}' does not cover the {n_tokens} test tokens of the store; "
                         f"re-run the stage that wrote it")
    return ex["exit_depth"].to_numpy().astype(np.int64), ex["correct"].to_numpy().astype(bool)


def readout_rule_specs(readouts_dir: Path | str, rules: Sequence[str], n_tokens: int, has_gate: bool,
                       hidden_dtype: str) -> tuple[list[RuleSpec], dict[str, str]]:
    """The readouts rules to run, at their chosen thresholds, with the offline exits to match.

    Returns:
        (specs, skipped) where skipped maps rule -> reason (e.g. q_exit on a model without a gate).
    """
    readouts_dir = Path(readouts_dir)
    cpath, epath = readouts_dir / "chosen.parquet", readouts_dir / "chosen_exits.parquet"
    for p in (cpath, epath):
        if not p.is_file():
            raise FileNotFoundError(f"{p} not found; run the readouts stage first (dvc repro readouts)")
    chosen = pl.read_parquet(cpath)
    specs, skipped = [], {}
    for rule in rules:
        if rule == "gate":
            continue
        if rule == "q_exit" and not has_gate:
            skipped[rule] = "model has no native halting gate"
            continue
        row = chosen.filter(pl.col("rule") == rule)
        if row.height == 0:
            skipped[rule] = f"no chosen point for '{rule}' in {cpath} (not in readouts.rules?)"
            continue
        r = row.row(0, named=True)
        thr = float(r["threshold"])
        ex, corr = _chosen_exits(epath, rule, n_tokens)
        specs.append(RuleSpec(rule=rule, kind=str(r.get("kind") or "posthoc"), source="readouts", threshold=thr,
                              factory=(lambda rule=rule, thr=thr: make_rule(rule, thr, hidden_dtype)),
                              offline_exit=ex, offline_correct=corr))
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
    ch = pl.read_parquet(cpath)
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
        from . import gates as gates_mod
    except ImportError:
        return None, "pipeline.gates is not available"
    loader = getattr(gates_mod, "load_online_gate", None)
    if loader is None:
        return None, (f"best gate '{rule}': the gates stage saves no fitted gate that can run online "
                      "(pipeline.gates.load_online_gate is missing)")
    try:
        gate = loader(gates_dir, rule)
    except (FileNotFoundError, ValueError, KeyError) as exc:
        return None, f"best gate '{rule}': {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
    thr = float(row["threshold"])
    ex, corr = _chosen_exits(Path(gates_dir) / "chosen_exits.parquet", rule, n_tokens)

    def factory(gate=gate, thr=thr, rule=rule):
        return CallableRule(rule, thr, gate.stop_prob, needs_logits=bool(getattr(gate, "needs_logits", True)),
                            reset_fn=getattr(gate, "reset", None))

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


def latency_model(model: LoopedTransformer, data: TestData, specs: Sequence[RuleSpec], cfg: LatencyConfig,
                  meta: dict, device: str = "cpu", progress: bool = True) -> list[dict]:
    """Time full depth and every rule's real early exit at each batch size; check exactness.

    For each batch size, one untimed checking pass per rule (and full depth) compares the real run's
    exit depth and correctness with the offline chosen point token by token — it is also the warm-up;
    then ``warmup`` + ``repeats`` passes time full depth and every rule, interleaved within each
    repeat (median reported).

    Args:
        model: the looped transformer (eval mode, on ``device``).
        data: the test split (:func:`load_test_data`).
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
    from tqdm.auto import tqdm

    T = model.cfg.n_loops
    causal = model.cfg.causal
    tok_all = torch.from_numpy(data.tokens).to(device)
    sc_all = torch.from_numpy(data.scored).to(device)
    rows = []
    bar = tqdm(total=len(cfg.batch_sizes) * (cfg.warmup + cfg.repeats + 1), desc=f"latency {meta.get('model')}",
               disable=None if progress else True, leave=False)
    for bs in cfg.batch_sizes:
        n_seq = min(cfg.bs1_sequences if bs == 1 else (cfg.sequences or data.tokens.shape[0]), data.tokens.shape[0])
        tok, sc = tok_all[:n_seq], sc_all[:n_seq]
        scored = data.scored[:n_seq]
        ids = data.token[:n_seq][scored]  # store rows of the run's tokens, (sequence, position) order
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
                raise ValueError(f"latency {meta.get('model')} rule '{sp.rule}' batch {bs}: the real run differs from "
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


def latency_models(models: Sequence[str], train_root: Path | str, dump_root: Path | str, readouts_root: Path | str,
                   gates_root: Path | str, cfg: LatencyConfig, device: str = "cpu", regime_meta: Callable | None = None,
                   progress: bool = True) -> tuple[pl.DataFrame, dict]:
    """The ``latency`` stage over models: checkpoint + test store + chosen points -> rows and metrics.

    Args:
        models: model names.
        train_root, dump_root, readouts_root, gates_root: artifact roots (SPEC §10).
        cfg: the ``latency`` section.
        device: torch device.
        regime_meta: model name -> dict(model, task, regime, regime_kind) (``readouts.resolve_model``).
        progress: progress bars.

    Returns:
        (latency frame, metrics dict with per-model headline numbers and skipped rules with reasons).
    """
    from .model import load_checkpoint

    all_rows, skipped, info = [], {}, {}
    for name in models:
        ckpt = Path(train_root) / name / "model.pt"
        model, _ = load_checkpoint(ckpt)
        model = model.to(device).eval()
        data = load_test_data(Path(dump_root) / name / "test.zarr")
        n_tokens = int(data.scored.sum())
        specs, skip = readout_rule_specs(Path(readouts_root) / name, cfg.rules, n_tokens, model.gate is not None,
                                         data.hidden_dtype)
        if "gate" in cfg.rules:
            spec, reason = load_gate_rule(Path(gates_root) / name, n_tokens, data.hidden_dtype)
            if spec is not None:
                specs.append(spec)
            else:
                skip["gate"] = reason
        meta = regime_meta(name) if regime_meta is not None else {"model": name}
        all_rows += latency_model(model, data, specs, cfg, meta, device, progress)
        skipped[name] = skip
        info[name] = {"causal": bool(model.cfg.causal), "n_loops": model.cfg.n_loops, "n_tokens": n_tokens,
                      "hidden_dtype": data.hidden_dtype}
    df = pl.DataFrame(all_rows, schema=LATENCY_SCHEMA)
    return df, latency_metrics(df, skipped, info)


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
        ratios[f"bs{bs}"] = {"median_speedup_ratio": float(sub["speedup_ratio"].median()),
                             "min_speedup_ratio": float(sub["speedup_ratio"].min()),
                             "max_speedup_ratio": float(sub["speedup_ratio"].max()),
                             "runs_ratio_ge_0p8": int((sub["speedup_ratio"] >= 0.8).sum()),
                             "median_ratio_to_work_ideal": float(sub["ratio_to_work_ideal"].median())}
    return {"all_exact": bool(df["exact"].all()) if df.height else True, "n_runs": df.height, "summary": ratios,
            "models": models}


def write_latency(out_dir: Path | str, df: pl.DataFrame, metrics: dict) -> None:
    """Write ``latency.parquet`` and ``metrics.json`` atomically (temp dir + os.replace)."""
    from .artifacts import atomic_dir
    from .artifacts import jsonable as _jsonable

    with atomic_dir(out_dir) as tmp:
        df.write_parquet(tmp / "latency.parquet")
        (tmp / "metrics.json").write_text(json.dumps(_jsonable(metrics), indent=2) + "\n")
