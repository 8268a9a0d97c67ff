"""Real early exit in the looped model: the loops really stop (the engine of the ``latency`` stage).

Each loop runs only on the sequences that still have an undecided scored token; exited sequences leave
the batch (compaction: ``index_select`` of the active rows every loop). Every registered exit rule
(:mod:`looptrace.rules.registry`, built-in or a user's) runs here as a :class:`RegistryRule`, on the live
signals of :mod:`looptrace.online.live_signals`. Exit semantics and exactness are described in
:mod:`looptrace.online.latency`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from looptrace.config import ConfigError
from looptrace.models.looped import LoopedTransformer
from looptrace.online.live_signals import LiveSignals, to_numpy
from looptrace.rules.base import HISTORY, SIGNAL, ExitRule
from looptrace.rules.registry import get_rule
from looptrace.signals import keep_rows
from looptrace.signals.firing import two_hit_step

if TYPE_CHECKING:
    from looptrace.models.decode import LoopDecoder

# ----------------------------------------------------------------------------------------------
# Online rules: a rule of the registry evaluated loop by loop on the live batch
# ----------------------------------------------------------------------------------------------


class OnlineRule:
    """An exit rule evaluated loop by loop on the active batch.

    A rule sees, after loop t, the state h_t [batch, seq, d_model] and the readout z_t
    [batch, seq, vocab] of the active rows/prefix, keeps whatever history it needs with leading
    [batch, seq] dims (so :meth:`compact` can follow the batch), and returns which positions fire.
    Semantics are those of ``looptrace.rules.scoring.exit_depths``: fire at the first t ≥ ``min_loop``
    where ``signal op threshold`` holds (and held at t − 1 for two-hit rules); NaN never fires; the
    engine forces the exit at T.

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

    def reset(self, model: LoopedTransformer | LoopDecoder, h0: torch.Tensor) -> None:
        """Start a new batch (h0: [batch, seq, d_model])."""
        self.state = {}

    def signal(self, t: int, h: torch.Tensor, z: torch.Tensor | None,
               model: LoopedTransformer | LoopDecoder) -> torch.Tensor:
        """Signal after loop t (1-based): [batch, seq] float32 (values the store holds as float32) or
        float64 (or integer), NaN where undefined."""
        raise NotImplementedError

    def fires(self, t: int, h: torch.Tensor, z: torch.Tensor | None,
              model: LoopedTransformer | LoopDecoder) -> torch.Tensor:
        """[batch, seq] bool: the rule's condition at loop t (before the engine's undecided mask)."""
        s = self.signal(t, h, z, model)
        # A float32 signal is compared with the float32 threshold that gives the same answer as the
        # offline float64 comparison (one op fewer per loop, identical result); anything else in float64.
        if s.dtype == torch.float32:
            thr = self._thr32
        else:
            s, thr = s.double(), self.threshold
        hit = (s >= thr) if self.op == "ge" else (s <= thr)  # NaN compares False
        if self.two_hit:
            prev = self.state.get("hit_prev")
            self.state["hit_prev"] = hit
            hit = two_hit_step(hit, prev)
        if t < self.min_loop:
            hit = torch.zeros_like(hit)
        return hit

    def compact(self, rows: torch.Tensor | None, seq: int) -> None:
        """Follow the engine's compaction: keep batch rows ``rows`` (None = all) and positions < ``seq``."""
        for k, v in self.state.items():
            self.state[k] = keep_rows(v, rows, seq)


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


class HistoryScore:
    """The online form derived from a rule's offline ``score``: at loop t, ``score`` on the history of loops
    1..t ([batch · seq, t] arrays, token_loop dtypes), last column. Exact for causal rules (checked on val by
    the readouts stage, :func:`looptrace.rules.base.check_causal`)."""

    def __init__(self, rule: ExitRule):
        self.rule = rule
        self.hist: dict[str, np.ndarray] = {}

    def update(self, t: int, s: dict[str, np.ndarray]) -> np.ndarray:
        for k in self.rule.signals:
            v = s[k][..., None]
            self.hist[k] = v if k not in self.hist else np.concatenate([self.hist[k], v], axis=-1)
        lead = s[self.rule.signals[0]].shape
        score = self.rule.score_of({k: v.reshape(-1, t) for k, v in self.hist.items()})
        return score[:, -1].reshape(lead)

    def compact(self, rows, seq: int | None) -> None:
        self.hist = {k: keep_rows(v, rows, seq) for k, v in self.hist.items()}


class RegistryRule(OnlineRule):
    """A registered exit rule (:class:`~looptrace.rules.base.ExitRule`) run online at ``threshold``.

    The signals it reads come from :class:`~looptrace.online.live_signals.LiveSignals` (the offline values bit for
    bit). ``online='signal'`` rules compare that signal directly; other rules evaluate their online form
    (a built-in's streaming score, or :class:`HistoryScore` for a user's rule) in float64 numpy.

    Args:
        rule: the rule (or its name).
        threshold: the chosen point's threshold.
        hidden_dtype: the store's hidden dtype (step signals read rounded states).
    """

    def __init__(self, rule: ExitRule | str, threshold: float, hidden_dtype: str = "float16"):
        rule = get_rule(rule)
        if rule.online is None:
            raise ConfigError(f"rule '{rule.name}' cannot run online ({rule.kind}: it reads {', '.join(rule.signals)})")
        super().__init__(rule.name, threshold, rule.op, rule.min_loop, rule.two_hit)
        self.rule, self.hidden_dtype = rule, hidden_dtype
        self.live = LiveSignals(rule.signals, None, hidden_dtype)
        self.needs_logits = self.live.needs_logits
        self.form = None

    def reset(self, model, h0):
        self.state = {}
        self.live = LiveSignals(self.rule.signals, model, self.hidden_dtype)
        self.live.reset(h0)
        online = self.rule.online
        self.form = None if online == SIGNAL else HistoryScore(self.rule) if online == HISTORY else online()

    def signal(self, t, h, z, model):
        sig = self.live.update(t, h, z)
        if self.form is None:
            return sig[self.rule.signals[0]]
        score = self.form.update(t, {k: to_numpy(v) for k, v in sig.items()})
        return torch.from_numpy(np.asarray(score, dtype=np.float64)).to(h.device)

    def compact(self, rows, seq):
        super().compact(rows, seq)
        self.live.compact(rows, seq)
        if self.form is not None:
            self.form.compact(rows, seq)


class CallableRule(OnlineRule):
    """A rule whose per-position probability is produced by a callable on (t, h_t, live signals).

    Used for refit offline gates: ``stop_prob(t, h, signals) -> [batch, seq] float64`` with ``signals`` the
    :class:`~looptrace.online.live_signals.LiveSignals` values of ``signals`` at loop t, fired when ≥ the threshold
    (SPEC §4 "offline gate"). ``state``: the gate's own running state (a PonderNet gate's halting CDF), reset
    with the rule and compacted with the batch.
    """

    def __init__(self, name: str, threshold: float, stop_prob: Callable, signals: Sequence[str] = (),
                 hidden_dtype: str = "float16", state=None):
        super().__init__(name, threshold, "ge", 1, False)
        self._stop_prob, self._signals, self.hidden_dtype = stop_prob, tuple(signals), hidden_dtype
        self._gate_state = state  # an object with reset() and compact(rows, seq) (a stateful gate), or None
        self.live = LiveSignals(self._signals, None, hidden_dtype)
        self.needs_logits = self.live.needs_logits

    def reset(self, model, h0):
        self.state = {}
        self.live = LiveSignals(self._signals, model, self.hidden_dtype)
        self.live.reset(h0)
        if self._gate_state is not None:
            self._gate_state.reset()

    def signal(self, t, h, z, model):
        return self._stop_prob(t, h, self.live.update(t, h, z))

    def compact(self, rows, seq):
        super().compact(rows, seq)
        self.live.compact(rows, seq)
        if self._gate_state is not None:
            self._gate_state.compact(rows, seq)


def make_rule(rule: str | ExitRule, threshold: float, state_dtype: str = "float16") -> OnlineRule:
    """The online version of a registered rule at ``threshold`` (:class:`RegistryRule`).

    Args:
        rule: a rule name of the registry (built-in or user rule) or an :class:`ExitRule`.
        threshold: the chosen point's threshold.
        state_dtype: the store's hidden dtype (step signals read rounded states).
    """
    return RegistryRule(rule, threshold, state_dtype)


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
    keep: torch.Tensor | None
    if not bool(any_scored.all()):  # rows with nothing to predict never run
        keep = any_scored.nonzero().squeeze(1)
        rows, h0, undecided = rows[keep], h0.index_select(0, keep), undecided.index_select(0, keep)
        if rule is not None:
            rule.compact(keep, seq)
    h = h0
    work = 0
    t = 0
    memory = None  # loop memory ([RT]; models with loop_memory): each kept position's own earlier outputs
    for t in range(1, T + 1):
        if t == 1 or groups[t - 1] != groups[t - 2]:
            memory = model.empty_memory(groups[t - 1], h)
        h, outputs = model.step_outputs(h, h0, groups[t - 1], memory=memory)  # [b, seq, D]
        if memory is not None:
            memory = model.extend_memory(memory, outputs)
        work += h.shape[0] * h.shape[1]
        last = t == T
        if rule is None and not last:
            continue
        # (before T the rule is not None: the loop continued above without one)
        z = model.readout(h) if (last or (rule is not None and rule.needs_logits)) else None  # [b, seq, V]
        if last:
            fire = undecided
        else:
            assert rule is not None
            fire = rule.fires(t, h, z, model) & undecided
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
            if memory is not None:
                memory = tuple(m.index_select(0, keep) for m in memory)
        new_seq = max(last_pos) + 1 if cfg.causal else seq
        if new_seq < seq:
            h, h0, undecided = h[:, :new_seq], h0[:, :new_seq], undecided[:, :new_seq]
            if memory is not None:  # the memory is per position: a dropped position's goes with it
                memory = tuple(m[:, :new_seq] for m in memory)
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
